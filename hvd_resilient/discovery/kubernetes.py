"""``discovery/kubernetes``: Running, Ready pods that match a label selector.

Talks to the Kubernetes API directly (``GET /api/v1/namespaces/NS/pods?labelSelector=...``)
with urllib: no kubectl, no client library.  Credentials, in this order:

* flags ``--api-server URL --token-file F --ca-file F`` (each also an environment variable);
* otherwise the pod's own service account: ``KUBERNETES_SERVICE_HOST``/``_PORT`` and
  ``/var/run/secrets/kubernetes.io/serviceaccount/{token,ca.crt,namespace}``.

The token is read on every call because kubelet rotates projected tokens.  Proxy
environment variables are ignored: the API server is reached directly, as in-cluster
clients do, and a proxy would be one more thing to fail within the 2 s budget.

A pod counts when ``status.phase`` is ``Running``, its ``Ready`` condition is ``True`` and it
has no ``metadata.deletionTimestamp`` (a pod being deleted can stay Running and Ready for its
whole grace period; Horovod must stop placing work on it as soon as deletion starts).
No matching pod is a valid answer (an empty one): pods can all be restarting at once.
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import DiscoveryError, TransientDiscoveryError
from .options import EnvOptions, positive_int
from .output import HostSlots, merge_hosts
from .runner import Context, Script, run
from .validate import parse_slots, validate_hostname

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
ADDRESS_MODES = ("pod-ip", "pod-name", "hostname-subdomain")
_PAGE_SIZE = 500
_MAX_BODY = 64 << 20


@dataclass(frozen=True)
class ApiConfig:
    """Where and how to reach the API server."""

    server: str
    token_file: str | None
    ca_file: str | None
    namespace: str


def _read_small(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read(1 << 20).strip()
    except OSError as exc:
        raise DiscoveryError(f"cannot read {what} {path}: {exc.strerror or exc}") from None


def resolve_config(*, api_server: str | None, token_file: str | None, ca_file: str | None,
                   namespace: str | None, environ: Mapping[str, str],
                   sa_dir: str = SERVICE_ACCOUNT_DIR) -> ApiConfig:
    """Fill what the flags leave open from the pod's service account.

    Raises:
        DiscoveryError: neither flags nor an in-cluster environment say where the API is.
    """
    if not api_server:
        host = environ.get("KUBERNETES_SERVICE_HOST", "")
        port = environ.get("KUBERNETES_SERVICE_PORT", "443") or "443"
        if not host:
            raise DiscoveryError("KUBERNETES_SERVICE_HOST is not set (not running in a pod?); "
                                 "pass --api-server URL --token-file F --ca-file F")
        if ":" in host:
            host = f"[{host}]"
        api_server = f"https://{host}:{port}"
        token_file = token_file or os.path.join(sa_dir, "token")
        ca_file = ca_file or os.path.join(sa_dir, "ca.crt")
    parsed = urllib.parse.urlsplit(api_server)
    if parsed.scheme not in ("https", "http") or not parsed.netloc:
        raise DiscoveryError(f"--api-server {api_server!r} is not an http(s) URL")
    if parsed.scheme == "http" and token_file:
        raise DiscoveryError("refusing to send a bearer token over plain http; use https "
                             "(or 'kubectl proxy' without --token-file)")
    if not namespace:
        ns_file = os.path.join(sa_dir, "namespace")
        namespace = _read_small(ns_file, "namespace file") if os.path.exists(ns_file) \
            else "default"
    return ApiConfig(server=api_server.rstrip("/"), token_file=token_file, ca_file=ca_file,
                     namespace=namespace)


def _ssl_context(ca_file: str | None) -> ssl.SSLContext:
    try:
        return ssl.create_default_context(cafile=ca_file)
    except FileNotFoundError:
        raise DiscoveryError(f"CA file {ca_file} does not exist; pass --ca-file") from None
    except (OSError, ssl.SSLError) as exc:
        raise DiscoveryError(f"cannot load CA file {ca_file}: {exc}") from None


def _status_message(body: bytes) -> str:
    try:
        msg = json.loads(body.decode("utf-8", "replace")).get("message", "")
    except (ValueError, AttributeError):
        return ""
    return f": {msg}" if isinstance(msg, str) and msg else ""


def _http_error(exc: urllib.error.HTTPError, cfg: ApiConfig) -> Exception:
    try:
        detail = _status_message(exc.read(64 << 10))
    except (OSError, http.client.HTTPException):
        detail = ""
    code = exc.code
    if code == 401:
        return DiscoveryError(f"API server rejected the token (401 Unauthorized){detail}; "
                              "check --token-file / the pod's service account token")
    if code == 403:
        return DiscoveryError(f"not allowed to list pods in namespace {cfg.namespace!r} "
                              f"(403 Forbidden){detail}; bind a Role with get/list/watch on "
                              "pods (docs/discovery.md)")
    if code == 404:
        return DiscoveryError(f"namespace {cfg.namespace!r} or the pods API not found "
                              f"(404){detail}; check --namespace")
    if code in (408, 410, 429) or code >= 500:
        return TransientDiscoveryError(f"API server answered {code}{detail}")
    return DiscoveryError(f"API server answered {code}{detail}")


def list_pods(cfg: ApiConfig, selector: str, timeout: Callable[[], float]) -> list[dict[str, Any]]:
    """All pods in ``cfg.namespace`` matching ``selector``, following pagination.

    ``timeout()`` is asked before each request for the seconds left (the run's deadline).
    """
    token = _read_small(cfg.token_file, "token file") if cfg.token_file else None
    if token is not None and (not token or not token.isprintable() or " " in token):
        raise DiscoveryError(f"token file {cfg.token_file} does not hold a single bearer "
                             "token (empty, or has spaces or line breaks)")
    context = _ssl_context(cfg.ca_file) if cfg.server.startswith("https:") else None
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context))
    path = f"/api/v1/namespaces/{urllib.parse.quote(cfg.namespace, safe='')}/pods"
    pods: list[dict[str, Any]] = []
    cont = ""
    while True:
        query = {"labelSelector": selector, "fieldSelector": "status.phase=Running",
                 "limit": str(_PAGE_SIZE)}
        if cont:
            query["continue"] = cont
        request = urllib.request.Request(
            f"{cfg.server}{path}?{urllib.parse.urlencode(query)}",
            headers={"Accept": "application/json"})
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        page = _get_json(opener, request, cfg, timeout())
        items = page.get("items")
        if not isinstance(items, list):
            raise TransientDiscoveryError("API server answer has no 'items' list")
        pods.extend(item for item in items if isinstance(item, dict))
        meta = page.get("metadata")
        if not isinstance(meta, dict):
            meta = {}
        cont = meta.get("continue") or ""
        if not cont:
            return pods


def _get_json(opener: urllib.request.OpenerDirector, request: urllib.request.Request,
              cfg: ApiConfig, timeout: float) -> dict[str, Any]:
    try:
        with opener.open(request, timeout=timeout) as response:
            body = response.read(_MAX_BODY + 1)
    except urllib.error.HTTPError as exc:
        raise _http_error(exc, cfg) from None
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ssl.SSLCertVerificationError):
            raise DiscoveryError(f"TLS verification of {cfg.server} failed "
                                 f"({exc.reason.verify_message}); check --ca-file") from None
        raise TransientDiscoveryError(f"cannot reach API server {cfg.server}: {exc.reason}"
                                      ) from None
    except TimeoutError:
        raise TransientDiscoveryError(f"API server {cfg.server} did not answer within "
                                      f"{timeout:.1f} s") from None
    except (OSError, http.client.HTTPException) as exc:
        raise TransientDiscoveryError(f"API server {cfg.server}: {type(exc).__name__}: {exc}"
                                      ) from None
    if len(body) > _MAX_BODY:
        raise TransientDiscoveryError("API server answer is too large")
    try:
        page = json.loads(body)
    except ValueError:
        raise TransientDiscoveryError("API server answer is not JSON") from None
    if not isinstance(page, dict):
        raise TransientDiscoveryError("API server answer is not a JSON object")
    return page


def _dict(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def pod_is_ready(pod: Mapping[str, Any]) -> bool:
    """Running, Ready and not being deleted."""
    meta, status = _dict(pod.get("metadata")), _dict(pod.get("status"))
    if meta.get("deletionTimestamp"):
        return False
    if status.get("phase") != "Running":
        return False
    conditions = status.get("conditions")
    return any(
        isinstance(c, dict) and c.get("type") == "Ready" and c.get("status") == "True"
        for c in (conditions if isinstance(conditions, list) else [])
    )


def pod_address(pod: Mapping[str, Any], mode: str, dns_suffix: str = "") -> str | None:
    """The host Horovod should ssh to; ``None`` when the pod has none yet (no IP)."""
    meta, spec, status = (_dict(pod.get(k)) for k in ("metadata", "spec", "status"))
    name = meta.get("name") or "?"
    if mode == "pod-ip":
        # Dual-stack pods list both families in podIPs; horovodrun cannot take IPv6
        # (it splits on ':'), so the first IPv4 address wins.
        listed = status.get("podIPs")
        ips = [p.get("ip") for p in listed if isinstance(p, dict)] \
            if isinstance(listed, list) else []
        ips = [ip for ip in ips if isinstance(ip, str) and ip] or [status.get("podIP")]
        for ip in ips:
            if isinstance(ip, str) and ip and ":" not in ip:
                return ip
        return ips[0] or None
    if mode == "pod-name":
        return name
    if mode == "hostname-subdomain":
        subdomain = spec.get("subdomain")
        if not subdomain:
            raise DiscoveryError(f"pod {name!r} has no spec.subdomain (needed by --address "
                                 "hostname-subdomain); set it to a headless Service or use "
                                 "--address pod-ip")
        host = f"{spec.get('hostname') or name}.{subdomain}"
        return f"{host}.{dns_suffix.strip('.')}" if dns_suffix else host
    raise ValueError(f"unknown address mode {mode!r}")


def pod_slots(pod: Mapping[str, Any], *, default: int, label: str | None,
              annotation: str | None) -> int:
    """Slots from the pod's label, else its annotation, else ``default``."""
    meta = _dict(pod.get("metadata"))
    for kind, key in (("label", label), ("annotation", annotation)):
        if not key:
            continue
        values = _dict(meta.get("labels" if kind == "label" else "annotations"))
        if key in values:
            try:
                return parse_slots(values[key])
            except ValueError as exc:
                raise DiscoveryError(f"pod {meta.get('name')!r} {kind} {key}: {exc}") from None
    return default


def select_hosts(pods: Iterable[Mapping[str, Any]], *, address: str = "pod-ip",
                 slots: int = 1, slots_label: str | None = None,
                 slots_annotation: str | None = None, dns_suffix: str = "") -> HostSlots:
    """Map usable pods to ``{host: slots}``; a pod without an address yet is skipped."""
    pairs = []
    for pod in pods:
        if not pod_is_ready(pod):
            continue
        host = pod_address(pod, address, dns_suffix)
        if host is None:
            continue
        name = _dict(pod.get("metadata")).get("name")
        try:
            validate_hostname(host)
        except ValueError as exc:
            raise DiscoveryError(f"pod {name!r}: {exc}") from None
        pairs.append((host, pod_slots(pod, default=slots, label=slots_label,
                                      annotation=slots_annotation)))
    return merge_hosts(pairs, what="pod address")


def _add_options(opts: EnvOptions) -> None:
    opts.add("--selector", "-l", env="HVD_RESILIENT_K8S_SELECTOR", metavar="SELECTOR",
             help="label selector of the worker pods, e.g. 'app=train,job=run1' (required)")
    opts.add("--namespace", "-n", env="HVD_RESILIENT_K8S_NAMESPACE", metavar="NS",
             help="namespace (default: the pod's own, else 'default')")
    opts.add("--api-server", env="HVD_RESILIENT_K8S_API_SERVER", metavar="URL",
             help="API server URL (default: in-cluster https://$KUBERNETES_SERVICE_HOST:PORT)")
    opts.add("--token-file", env="HVD_RESILIENT_K8S_TOKEN_FILE", metavar="FILE",
             help="bearer token file (default: the service account token)")
    opts.add("--ca-file", env="HVD_RESILIENT_K8S_CA_FILE", metavar="FILE",
             help="CA bundle for the API server (default: the service account ca.crt)")
    opts.add("--address", env="HVD_RESILIENT_K8S_ADDRESS", choices=list(ADDRESS_MODES),
             default="pod-ip", help="what to print as the host (default pod-ip)")
    opts.parser.add_argument("--use-pod-name", dest="address", action="store_const",
                             const="pod-name", help="same as --address pod-name")
    opts.add("--dns-suffix", env="HVD_RESILIENT_K8S_DNS_SUFFIX", default="", metavar="SUFFIX",
             help="appended to hostname.subdomain, e.g. 'ns.svc.cluster.local'")
    opts.add("--slots", env="HVD_RESILIENT_K8S_SLOTS", type=positive_int, default=1,
             metavar="N", help="slots of a pod without the label/annotation (default 1)")
    opts.add("--slots-label", env="HVD_RESILIENT_K8S_SLOTS_LABEL", metavar="KEY",
             help="pod label holding the slot count")
    opts.add("--slots-annotation", env="HVD_RESILIENT_K8S_SLOTS_ANNOTATION", metavar="KEY",
             help="pod annotation holding the slot count")


def _discover(ctx: Context) -> HostSlots:
    args = ctx.args
    if not args.selector:
        raise DiscoveryError("no label selector; pass --selector or set "
                             "HVD_RESILIENT_K8S_SELECTOR (listing every pod is never right)")
    cfg = resolve_config(api_server=args.api_server, token_file=args.token_file,
                         ca_file=args.ca_file, namespace=args.namespace, environ=ctx.environ)
    pods = list_pods(cfg, args.selector, ctx.deadline.remaining)
    return select_hosts(pods, address=args.address, slots=args.slots,
                        slots_label=args.slots_label, slots_annotation=args.slots_annotation,
                        dns_suffix=args.dns_suffix)


def _cache_inputs(environ: Mapping[str, str]) -> Mapping[str, object]:
    return {k: environ.get(k) for k in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")}


SCRIPT = Script(name="kubernetes", description=__doc__ or "", add_options=_add_options,
                discover=_discover, cache_inputs=_cache_inputs)


def main(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> int:
    """Entry point of ``discovery/kubernetes``; returns the exit status."""
    return run(SCRIPT, argv, environ)
