"""``discovery/aws-asg``: InService instances of an EC2 Auto Scaling group.

Two API calls per run (three with ``--spot-requests``), each with the time left as timeout
and no botocore retries (the next run is a second away):

1. ``autoscaling:DescribeAutoScalingGroups``: keep instances whose ``LifecycleState`` is
   ``InService`` and ``HealthStatus`` is ``Healthy``.  ``Pending``, ``Pending:Wait``,
   ``Terminating``, ``Terminating:Wait``, ``Standby``, ``Detaching``, ``Warmed:*`` ... are
   dropped: the group is already taking them away (scale-in, a failed health check, Capacity
   Rebalancing after a rebalance recommendation) or has not finished adding them.
2. ``ec2:DescribeInstances``: the address (``--address private-ip|private-dns``), tags and
   state.  Dropped as well: instances whose EC2 state is not ``running``, and instances that
   carry a drain tag (``--drain-tag``, default ``hvd-resilient/drain``, any value).  EC2 does
   not expose spot interruption notices or rebalance recommendations through
   DescribeInstances (only through instance metadata and EventBridge), so the drain tag is
   the hook: an EventBridge rule for "EC2 Spot Instance Interruption Warning" / "EC2
   Instance Rebalance Recommendation" (or a watcher on the instance itself) tags the
   instance, and it leaves the job within a second.
3. With ``--spot-requests``: ``ec2:DescribeSpotInstanceRequests`` for the spot instances;
   a request whose status code starts with ``marked-for-`` (``marked-for-termination``,
   ``marked-for-stop``, ...) or ``instance-terminated``/``instance-stopped`` means the
   interruption has been decided, and the instance is dropped.

Slots, first that applies: the instance's ``--slots-tag`` tag, ``--slots``, the GPU count of
its instance type (``instance_types.py``), 1.

boto3 is imported only when the script runs, with an install hint if it is missing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .errors import DiscoveryError, TransientDiscoveryError
from .instance_types import gpus_for
from .options import EnvOptions, positive_int
from .output import HostSlots, merge_hosts
from .runner import Context, Script, run
from .validate import parse_slots, validate_hostname

ADDRESS_MODES = ("private-ip", "private-dns")
DEFAULT_DRAIN_TAG = "hvd-resilient/drain"
_ADDRESS_FIELD = {"private-ip": "PrivateIpAddress", "private-dns": "PrivateDnsName"}
_TRANSIENT_CODES = frozenset({
    "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException",
    "ServiceUnavailable", "Unavailable", "InternalError", "InternalFailure", "RequestTimeout",
    "RequestTimeoutException", "PriorRequestNotComplete",
    # DescribeInstances can lag behind the Auto Scaling group by a moment (eventual
    # consistency): an id the group just reported may not be known to EC2 yet.
    "InvalidInstanceID.NotFound", "InvalidSpotInstanceRequestID.NotFound",
})
_PERMISSION_CODES = frozenset({"AccessDenied", "AccessDeniedException",
                               "UnauthorizedOperation"})
_SPOT_GONE_PREFIXES = ("marked-for-", "instance-terminated", "instance-stopped")
_CHUNK = 200


def _import_boto3() -> Any:
    try:
        import boto3
    except ImportError:
        raise DiscoveryError("boto3 is not installed for this python; "
                             "install it with: python3 -m pip install boto3") from None
    return boto3


def _call(client: Any, operation: str, **kwargs: Any) -> dict[str, Any]:
    """Call ``client.<operation>`` and sort botocore failures into transient or not."""
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        NoCredentialsError,
        NoRegionError,
        PartialCredentialsError,
    )

    try:
        return getattr(client, operation)(**kwargs)
    except ClientError as exc:
        err = exc.response.get("Error", {})
        code, message = err.get("Code", "?"), err.get("Message", "")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        text = f"{operation}: {code}: {message}".rstrip(": ")
        if code in _TRANSIENT_CODES or status >= 500:
            raise TransientDiscoveryError(text) from None
        if code in _PERMISSION_CODES:
            raise DiscoveryError(f"{text}; grant the IAM permissions in docs/discovery.md"
                                 ) from None
        raise DiscoveryError(text) from None
    except (NoCredentialsError, PartialCredentialsError) as exc:
        raise DiscoveryError(f"{operation}: {exc}; configure AWS credentials (instance "
                             "profile, AWS_PROFILE or AWS_ACCESS_KEY_ID)") from None
    except NoRegionError:
        raise DiscoveryError(f"{operation}: no AWS region configured; pass --region or set "
                             "AWS_REGION") from None
    except BotoCoreError as exc:  # connection refused, timeouts, DNS: the network's fault
        raise TransientDiscoveryError(f"{operation}: {exc}") from None


def _tags(instance: Mapping[str, Any]) -> dict[str, str]:
    return {t.get("Key", ""): t.get("Value", "") for t in instance.get("Tags") or []}


def _chunks(items: list[str], size: int = _CHUNK) -> Iterable[list[str]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def in_service_instances(group: Mapping[str, Any]) -> list[str]:
    """Ids of the group's instances that are InService and Healthy, in a stable order."""
    return sorted(
        inst["InstanceId"] for inst in group.get("Instances") or []
        if inst.get("LifecycleState") == "InService"
        and inst.get("HealthStatus", "Healthy") == "Healthy"
    )


def spot_interrupted(ec2: Any, request_ids: list[str]) -> dict[str, str]:
    """``{instance_id: status_code}`` for spot requests whose interruption is decided."""
    gone: dict[str, str] = {}
    for chunk in _chunks(request_ids):
        page = _call(ec2, "describe_spot_instance_requests", SpotInstanceRequestIds=chunk)
        for req in page.get("SpotInstanceRequests") or []:
            code = (req.get("Status") or {}).get("Code", "")
            if req.get("InstanceId") and code.startswith(_SPOT_GONE_PREFIXES):
                gone[req["InstanceId"]] = code
    return gone


def discover_asg(group_name: str, *, autoscaling: Any, ec2: Any, address: str = "private-ip",
                 slots: int | None = None, slots_tag: str | None = None,
                 drain_tags: Iterable[str] = (DEFAULT_DRAIN_TAG,),
                 spot_requests: bool = False,
                 note: Callable[[str], None] | None = None) -> HostSlots:
    """``{address: slots}`` of the usable instances of Auto Scaling group ``group_name``.

    ``autoscaling`` and ``ec2`` are boto3 clients (tests pass stubbed ones).  ``note``
    receives one line for each instance dropped because of a drain tag or spot signal.

    Raises:
        DiscoveryError: no such group, no permission, an invalid slots tag or address.
        TransientDiscoveryError: throttled, unreachable, timed out.
    """
    if address not in _ADDRESS_FIELD:
        raise ValueError(f"address must be one of {ADDRESS_MODES}")
    page = _call(autoscaling, "describe_auto_scaling_groups",
                 AutoScalingGroupNames=[group_name])
    groups = page.get("AutoScalingGroups") or []
    if not groups:
        raise DiscoveryError(f"no Auto Scaling group named {group_name!r} in this region; "
                             "check the name and --region")
    ids = in_service_instances(groups[0])
    if not ids:
        return {}
    instances: list[dict[str, Any]] = []
    for chunk in _chunks(ids):
        token = None
        while True:
            kwargs: dict[str, Any] = {"InstanceIds": chunk}
            if token:
                kwargs["NextToken"] = token
            reply = _call(ec2, "describe_instances", **kwargs)
            for reservation in reply.get("Reservations") or []:
                instances.extend(reservation.get("Instances") or [])
            token = reply.get("NextToken")
            if not token:
                break

    drain = set(drain_tags)
    gone: dict[str, str] = {}
    if spot_requests:
        request_ids = sorted({i["SpotInstanceRequestId"] for i in instances
                              if i.get("SpotInstanceRequestId")})
        if request_ids:
            gone = spot_interrupted(ec2, request_ids)

    pairs = []
    for inst in sorted(instances, key=lambda i: i.get("InstanceId", "")):
        iid = inst.get("InstanceId", "?")
        if (inst.get("State") or {}).get("Name") != "running":
            continue
        tags = _tags(inst)
        drained = sorted(drain & tags.keys())
        if drained:
            if note:
                note(f"dropped {iid}: tagged {drained[0]}")
            continue
        if iid in gone:
            if note:
                note(f"dropped {iid}: spot request {gone[iid]}")
            continue
        host = inst.get(_ADDRESS_FIELD[address])
        if not host:
            continue
        try:
            validate_hostname(host)
        except ValueError as exc:
            raise DiscoveryError(f"instance {iid}: {exc}") from None
        pairs.append((host, _instance_slots(inst, tags, slots=slots, slots_tag=slots_tag)))
    return merge_hosts(pairs, what="instance address")


def _instance_slots(inst: Mapping[str, Any], tags: Mapping[str, str], *, slots: int | None,
                    slots_tag: str | None) -> int:
    if slots_tag and slots_tag in tags:
        try:
            return parse_slots(tags[slots_tag])
        except ValueError as exc:
            raise DiscoveryError(f"instance {inst.get('InstanceId')} tag {slots_tag}: {exc}"
                                 ) from None
    if slots is not None:
        return slots
    return gpus_for(inst.get("InstanceType", "")) or 1


def _add_options(opts: EnvOptions) -> None:
    opts.add("--group", "--asg", env="HVD_RESILIENT_ASG_NAME", metavar="NAME", dest="group",
             help="Auto Scaling group name (required)")
    opts.add("--region", env="HVD_RESILIENT_ASG_REGION", metavar="REGION",
             help="AWS region (default: the boto3 chain: AWS_DEFAULT_REGION, profile, "
                  "...; then AWS_REGION)")
    opts.add("--address", env="HVD_RESILIENT_ASG_ADDRESS", choices=list(ADDRESS_MODES),
             default="private-ip", help="what to print as the host (default private-ip)")
    opts.add("--slots", env="HVD_RESILIENT_ASG_SLOTS", type=positive_int, metavar="N",
             help="slots per instance (default: GPUs of the instance type, else 1)")
    opts.add("--slots-tag", env="HVD_RESILIENT_ASG_SLOTS_TAG", metavar="KEY",
             help="instance tag holding the slot count; wins over --slots")
    opts.add("--drain-tag", env="HVD_RESILIENT_ASG_DRAIN_TAG", default=DEFAULT_DRAIN_TAG,
             metavar="KEY[,KEY]", help="instances with any of these tag keys are dropped "
                                       f"(default {DEFAULT_DRAIN_TAG})")
    opts.add_flag("--spot-requests", env="HVD_RESILIENT_ASG_SPOT_REQUESTS",
                  help="also drop spot instances whose request is marked for interruption "
                       "(needs ec2:DescribeSpotInstanceRequests)")


def _discover(ctx: Context) -> HostSlots:
    args = ctx.args
    if not args.group:
        raise DiscoveryError("no Auto Scaling group; pass --group NAME or set "
                             "HVD_RESILIENT_ASG_NAME")
    boto3 = _import_boto3()
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError

    left = ctx.deadline.remaining()
    config = Config(connect_timeout=max(0.1, min(1.0, left)), read_timeout=max(0.1, left),
                    retries={"max_attempts": 1, "mode": "standard"})
    try:
        session = boto3.session.Session(region_name=args.region or None)
        if not session.region_name and ctx.environ.get("AWS_REGION"):
            # Older botocore reads only AWS_DEFAULT_REGION; ECS, Lambda and the other SDKs
            # set AWS_REGION.
            session = boto3.session.Session(region_name=ctx.environ["AWS_REGION"])
        autoscaling = session.client("autoscaling", config=config)
        ec2 = session.client("ec2", config=config)
    except BotoCoreError as exc:  # NoRegionError, a broken profile
        raise DiscoveryError(f"cannot create AWS clients: {exc}; pass --region or fix the "
                             "AWS configuration") from None
    drain = [t.strip() for t in (args.drain_tag or "").split(",") if t.strip()]
    return discover_asg(args.group, autoscaling=autoscaling, ec2=ec2, address=args.address,
                        slots=args.slots, slots_tag=args.slots_tag, drain_tags=drain,
                        spot_requests=args.spot_requests, note=ctx.note)


def _cache_inputs(environ: Mapping[str, str]) -> Mapping[str, object]:
    keys = ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE", "AWS_ENDPOINT_URL")
    return {k: environ.get(k) for k in keys}


SCRIPT = Script(name="aws-asg", description=__doc__ or "", add_options=_add_options,
                discover=_discover, cache_inputs=_cache_inputs)


def main(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> int:
    """Entry point of ``discovery/aws-asg``; returns the exit status."""
    return run(SCRIPT, argv, environ)
