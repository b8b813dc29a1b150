"""discovery/aws-asg: the library function against botocore Stubber clients, and the
executable against a small local endpoint speaking the AWS query protocol."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from hvd_resilient.discovery import aws
from hvd_resilient.discovery.errors import DiscoveryError, TransientDiscoveryError
from tests.support.local_http import LocalHTTPServer
from tests.support.paths import ROOT

botocore_session = pytest.importorskip("botocore.session")
from botocore.stub import Stubber  # noqa: E402

SCRIPT = ROOT / "discovery" / "aws-asg"
GROUP = "train-asg"


_SESSION: list[Any] = []


def _clients() -> tuple[Any, Any]:
    if not _SESSION:  # one session: its loader caches the (large) EC2 service model
        _SESSION.append(botocore_session.get_session())
    session = _SESSION[0]
    kw = {"region_name": "us-east-1", "aws_access_key_id": "AKIDEXAMPLE",
          "aws_secret_access_key": "secret"}
    return session.create_client("autoscaling", **kw), session.create_client("ec2", **kw)


def _asg_member(iid: str, state: str = "InService", health: str = "Healthy",
                itype: str = "g5.12xlarge") -> dict[str, Any]:
    return {"InstanceId": iid, "InstanceType": itype, "AvailabilityZone": "us-east-1a",
            "LifecycleState": state, "HealthStatus": health, "ProtectedFromScaleIn": False}


def _group(*members: dict[str, Any]) -> dict[str, Any]:
    return {"AutoScalingGroups": [{
        "AutoScalingGroupName": GROUP, "MinSize": 0, "MaxSize": 10, "DesiredCapacity": 3,
        "DefaultCooldown": 300, "AvailabilityZones": ["us-east-1a"],
        "HealthCheckType": "EC2", "CreatedTime": datetime.datetime(2024, 1, 1),
        "Instances": list(members)}]}


def _instance(iid: str, n: int, *, itype: str = "g5.12xlarge", state: str = "running",
              tags: dict[str, str] | None = None, spot_request: str | None = None
              ) -> dict[str, Any]:
    inst: dict[str, Any] = {
        "InstanceId": iid, "InstanceType": itype, "State": {"Code": 16, "Name": state},
        "PrivateIpAddress": f"10.0.0.{n}", "PrivateDnsName": f"ip-10-0-0-{n}.ec2.internal",
        "Tags": [{"Key": k, "Value": v} for k, v in (tags or {}).items()]}
    if spot_request:
        inst["InstanceLifecycle"] = "spot"
        inst["SpotInstanceRequestId"] = spot_request
    return inst


def _reservations(*instances: dict[str, Any]) -> dict[str, Any]:
    return {"Reservations": [{"ReservationId": "r-1", "Instances": list(instances)}]}


def _discover(group: dict[str, Any], instances: dict[str, Any] | None,
              expected_ids: list[str] | None = None, spot: dict[str, Any] | None = None,
              **kwargs: Any) -> tuple[dict[str, int], list[str]]:
    autoscaling, ec2 = _clients()
    notes: list[str] = []
    with Stubber(autoscaling) as asg_stub, Stubber(ec2) as ec2_stub:
        asg_stub.add_response("describe_auto_scaling_groups", group,
                              {"AutoScalingGroupNames": [GROUP]})
        if instances is not None:
            ec2_stub.add_response("describe_instances", instances,
                                  {"InstanceIds": expected_ids} if expected_ids else None)
        if spot is not None:
            ec2_stub.add_response("describe_spot_instance_requests", spot)
        hosts = aws.discover_asg(GROUP, autoscaling=autoscaling, ec2=ec2, note=notes.append,
                                 **kwargs)
        asg_stub.assert_no_pending_responses()
        ec2_stub.assert_no_pending_responses()
    return hosts, notes


LIFECYCLE = ["Pending", "Pending:Wait", "Pending:Proceed", "Terminating", "Terminating:Wait",
             "Terminating:Proceed", "Terminated", "Standby", "EnteringStandby", "Detaching",
             "Detached", "Quarantined", "Warmed:Running"]


def test_only_in_service_healthy_instances_are_described() -> None:
    members = [_asg_member("i-b"), _asg_member("i-a"), _asg_member("i-sick", health="Unhealthy")]
    members += [_asg_member(f"i-{n}", state=s) for n, s in enumerate(LIFECYCLE)]
    hosts, notes = _discover(_group(*members),
                             _reservations(_instance("i-a", 1), _instance("i-b", 2)),
                             expected_ids=["i-a", "i-b"])
    assert hosts == {"10.0.0.1": 4, "10.0.0.2": 4}  # g5.12xlarge: 4 GPUs
    assert notes == []


def test_no_instance_in_service_is_an_empty_answer_without_ec2_call() -> None:
    hosts, _ = _discover(_group(_asg_member("i-a", state="Pending")), None)
    assert hosts == {}


@pytest.mark.parametrize(("address", "expected"), [
    ("private-ip", {"10.0.0.1": 1, "10.0.0.2": 1}),
    ("private-dns", {"ip-10-0-0-1.ec2.internal": 1, "ip-10-0-0-2.ec2.internal": 1}),
])
def test_address_modes(address: str, expected: dict[str, int]) -> None:
    hosts, _ = _discover(_group(_asg_member("i-a"), _asg_member("i-b")),
                         _reservations(_instance("i-a", 1, itype="c6i.large"),
                                       _instance("i-b", 2, itype="c6i.large")),
                         address=address)
    assert hosts == expected


def test_slots_from_tag_then_flag_then_instance_type() -> None:
    group = _group(*[_asg_member(i) for i in ("i-a", "i-b", "i-c", "i-d")])
    instances = _reservations(
        _instance("i-a", 1, tags={"hvd/slots": "2"}),
        _instance("i-b", 2, itype="p4d.24xlarge"),
        _instance("i-c", 3, itype="m7i.large"),
        _instance("i-d", 4, itype="g5.xlarge"))
    hosts, _ = _discover(group, instances, slots_tag="hvd/slots")
    assert hosts == {"10.0.0.1": 2, "10.0.0.2": 8, "10.0.0.3": 1, "10.0.0.4": 1}
    hosts, _ = _discover(group, instances, slots_tag="hvd/slots", slots=3)
    assert hosts == {"10.0.0.1": 2, "10.0.0.2": 3, "10.0.0.3": 3, "10.0.0.4": 3}


def test_bad_slots_tag_is_refused() -> None:
    with pytest.raises(DiscoveryError, match="i-a tag hvd/slots: slots must be a positive "
                                             "integer, got '0'"):
        _discover(_group(_asg_member("i-a")),
                  _reservations(_instance("i-a", 1, tags={"hvd/slots": "0"})),
                  slots_tag="hvd/slots")


def test_drain_tag_and_ec2_state_drop_instances() -> None:
    group = _group(*[_asg_member(i) for i in ("i-a", "i-b", "i-c", "i-d")])
    instances = _reservations(
        _instance("i-a", 1),
        _instance("i-b", 2, tags={"hvd-resilient/drain": "spot-interruption"}),
        _instance("i-c", 3, state="shutting-down"),
        _instance("i-d", 4, tags={"custom-drain": ""}))
    hosts, notes = _discover(group, instances)
    assert hosts == {"10.0.0.1": 4, "10.0.0.4": 4}
    assert notes == ["dropped i-b: tagged hvd-resilient/drain"]
    hosts, notes = _discover(group, instances, drain_tags=["custom-drain",
                                                           "hvd-resilient/drain"])
    assert hosts == {"10.0.0.1": 4}


def test_spot_requests_marked_for_interruption_drop_instances() -> None:
    group = _group(*[_asg_member(i) for i in ("i-a", "i-b", "i-c")])
    instances = _reservations(_instance("i-a", 1, spot_request="sir-a"),
                              _instance("i-b", 2, spot_request="sir-b"),
                              _instance("i-c", 3))
    spot = {"SpotInstanceRequests": [
        {"SpotInstanceRequestId": "sir-a", "InstanceId": "i-a",
         "Status": {"Code": "fulfilled"}},
        {"SpotInstanceRequestId": "sir-b", "InstanceId": "i-b",
         "Status": {"Code": "marked-for-termination"}}]}
    hosts, notes = _discover(group, instances, spot=spot, spot_requests=True)
    assert hosts == {"10.0.0.1": 4, "10.0.0.3": 4}
    assert notes == ["dropped i-b: spot request marked-for-termination"]


def test_unknown_group_is_a_configuration_error() -> None:
    with pytest.raises(DiscoveryError, match="no Auto Scaling group named 'train-asg'"):
        _discover({"AutoScalingGroups": []}, None)


def test_malicious_address_is_refused() -> None:
    inst = _instance("i-a", 1)
    inst["PrivateDnsName"] = "$(reboot)"
    with pytest.raises(DiscoveryError, match="instance i-a: hostname '\\$\\(reboot\\)'"):
        _discover(_group(_asg_member("i-a")), _reservations(inst), address="private-dns")


@pytest.mark.parametrize(("operation", "code", "status", "error"), [
    ("describe_auto_scaling_groups", "Throttling", 400, TransientDiscoveryError),
    ("describe_auto_scaling_groups", "InternalFailure", 500, TransientDiscoveryError),
    ("describe_auto_scaling_groups", "AccessDenied", 403, DiscoveryError),
    ("describe_auto_scaling_groups", "ValidationError", 400, DiscoveryError),
    ("describe_instances", "RequestLimitExceeded", 503, TransientDiscoveryError),
    ("describe_instances", "InvalidInstanceID.NotFound", 400, TransientDiscoveryError),
    ("describe_instances", "UnauthorizedOperation", 403, DiscoveryError),
])
def test_api_errors_are_sorted(operation: str, code: str, status: int,
                               error: type[Exception]) -> None:
    autoscaling, ec2 = _clients()
    with Stubber(autoscaling) as asg_stub, Stubber(ec2) as ec2_stub:
        if operation == "describe_auto_scaling_groups":
            asg_stub.add_client_error(operation, code, "nope", status)
        else:
            asg_stub.add_response("describe_auto_scaling_groups", _group(_asg_member("i-a")))
            ec2_stub.add_client_error(operation, code, "nope", status)
        with pytest.raises(error) as info:
            aws.discover_asg(GROUP, autoscaling=autoscaling, ec2=ec2)
    assert code in str(info.value)
    if code in ("AccessDenied", "UnauthorizedOperation"):
        assert "docs/discovery.md" in str(info.value)


def test_missing_boto3_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "boto3", None)  # makes `import boto3` raise ImportError
    assert aws.main(["--group", GROUP], {"XDG_RUNTIME_DIR": str(tmp_path)}) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == ("aws-asg: boto3 is not installed for this python; install it with: "
                   "python3 -m pip install boto3\n")


def test_group_is_required(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert aws.main([], {"XDG_RUNTIME_DIR": str(tmp_path)}) == 2
    assert "HVD_RESILIENT_ASG_NAME" in capsys.readouterr().err


# ---- the executable against a local endpoint -------------------------------------------------

ASG_XML = """<DescribeAutoScalingGroupsResponse
 xmlns="http://autoscaling.amazonaws.com/doc/2011-01-01/"><DescribeAutoScalingGroupsResult>
<AutoScalingGroups><member><AutoScalingGroupName>{group}</AutoScalingGroupName>
<MinSize>0</MinSize><MaxSize>4</MaxSize><DesiredCapacity>3</DesiredCapacity>
<Instances>{members}</Instances></member></AutoScalingGroups>
</DescribeAutoScalingGroupsResult><ResponseMetadata><RequestId>1</RequestId>
</ResponseMetadata></DescribeAutoScalingGroupsResponse>"""
MEMBER_XML = ("<member><InstanceId>{iid}</InstanceId><InstanceType>g5.48xlarge</InstanceType>"
              "<AvailabilityZone>us-east-1a</AvailabilityZone>"
              "<LifecycleState>{state}</LifecycleState><HealthStatus>Healthy</HealthStatus>"
              "<ProtectedFromScaleIn>false</ProtectedFromScaleIn></member>")
EC2_XML = """<DescribeInstancesResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/">
<requestId>2</requestId><reservationSet><item><reservationId>r-1</reservationId>
<instancesSet>{items}</instancesSet></item></reservationSet></DescribeInstancesResponse>"""
ITEM_XML = ("<item><instanceId>{iid}</instanceId><instanceType>g5.48xlarge</instanceType>"
            "<instanceState><code>16</code><name>running</name></instanceState>"
            "<privateDnsName>ip-10-0-0-{n}.ec2.internal</privateDnsName>"
            "<privateIpAddress>10.0.0.{n}</privateIpAddress><tagSet>{tags}</tagSet></item>")
TAG_XML = "<item><key>{k}</key><value>{v}</value></item>"


class FakeAws:
    """Answers DescribeAutoScalingGroups and DescribeInstances like the query API does."""

    def __init__(self) -> None:
        self.members = [("i-a", "InService", 1, {}), ("i-b", "InService", 2,
                                                      {"hvd/slots": "2"}),
                        ("i-c", "Terminating:Wait", 3, {})]
        self.actions: list[str] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                length = int(self.headers.get("Content-Length", 0))
                form = dict(urllib.parse.parse_qsl(self.rfile.read(length).decode()))
                action = form.get("Action", "")
                fake.actions.append(action)
                if action == "DescribeAutoScalingGroups":
                    body = ASG_XML.format(group=form["AutoScalingGroupNames.member.1"],
                                          members="".join(MEMBER_XML.format(iid=i, state=s)
                                                          for i, s, _, _ in fake.members))
                elif action == "DescribeInstances":
                    wanted = {v for k, v in form.items() if k.startswith("InstanceId.")}
                    body = EC2_XML.format(items="".join(
                        ITEM_XML.format(iid=i, n=n, tags="".join(
                            TAG_XML.format(k=k, v=v) for k, v in tags.items()))
                        for i, _, n, tags in fake.members if i in wanted))
                else:
                    self.send_response(400)
                    self.end_headers()
                    return
                data = body.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/xml")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = LocalHTTPServer(Handler)
        self.url = self.server.url

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture
def endpoint() -> Iterator[FakeAws]:
    fake = FakeAws()
    try:
        yield fake
    finally:
        fake.stop()


def _run(tmp_path: Path, url: str, *args: str, env: dict[str, str] | None = None,
         deadline: str | None = "10") -> tuple[subprocess.CompletedProcess[str], float]:
    """Run the executable; ``deadline=None`` keeps the script's own 1.5 s budget (the timing
    tests), otherwise a generous one so a loaded machine cannot fail functional tests."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("HVD_RESILIENT_", "AWS_"))}
    base.update({
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "XDG_RUNTIME_DIR": str(tmp_path), "AWS_ENDPOINT_URL": url,
        "AWS_ACCESS_KEY_ID": "AKIDEXAMPLE", "AWS_SECRET_ACCESS_KEY": "secret",
        "AWS_REGION": "us-east-1", "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_EC2_METADATA_DISABLED": "true",
    })
    if deadline:
        base["HVD_RESILIENT_DISCOVERY_DEADLINE"] = deadline
    base.update(env or {})
    start = time.monotonic()
    proc = subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=20,
                          env=base, cwd=tmp_path)
    return proc, time.monotonic() - start


def test_executable_lists_in_service_instances(endpoint: FakeAws, tmp_path: Path) -> None:
    proc, _ = _run(tmp_path, endpoint.url, "--group", GROUP, "--slots-tag", "hvd/slots")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "10.0.0.1:8\n10.0.0.2:2\n"  # g5.48xlarge: 8 GPUs; tag wins
    assert proc.stderr == ""
    assert endpoint.actions == ["DescribeAutoScalingGroups", "DescribeInstances"]
    # Configured through the environment only, region from AWS_DEFAULT_REGION this time.
    env = {"HVD_RESILIENT_ASG_NAME": GROUP, "HVD_RESILIENT_ASG_ADDRESS": "private-dns",
           "HVD_RESILIENT_ASG_SLOTS": "1", "AWS_REGION": "", "AWS_DEFAULT_REGION": "eu-west-1"}
    proc, _ = _run(tmp_path, endpoint.url, env=env)
    assert proc.stdout == "ip-10-0-0-1.ec2.internal:1\nip-10-0-0-2.ec2.internal:1\n", \
        proc.stderr


def test_executable_endpoint_down(endpoint: FakeAws, tmp_path: Path) -> None:
    good, _ = _run(tmp_path, endpoint.url, "--group", GROUP)
    assert good.returncode == 0, good.stderr
    endpoint.stop()
    # The script's own budget from here on: whether the refused connection or (on a loaded
    # machine, while boto3 loads) the 1.5 s deadline ends the attempt, the answer comes in
    # time.  2.5 s = interpreter start + deadline + the hard watchdog's grace, with margin.
    proc, elapsed = _run(tmp_path, endpoint.url, "--group", GROUP, deadline=None)
    assert (proc.returncode, proc.stdout) == (0, good.stdout)
    assert "printed the last good answer" in proc.stderr
    assert elapsed < 2.5
    proc, elapsed = _run(tmp_path, endpoint.url, "--group", GROUP, "--cache-max-age", "0",
                         deadline=None)
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr.startswith("aws-asg: ") and proc.stderr.count("\n") == 1
    assert elapsed < 2.5
    slow, _ = _run(tmp_path, endpoint.url, "--group", GROUP, "--cache-max-age", "0")
    assert slow.stderr.startswith("aws-asg: describe_auto_scaling_groups: Could not connect")
