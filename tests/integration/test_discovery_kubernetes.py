"""discovery/kubernetes against a real HTTPS server on 127.0.0.1 (self-signed certificate,
bearer token checked), plus the pod selection rules table-driven."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from hvd_resilient.discovery.errors import DiscoveryError
from hvd_resilient.discovery.kubernetes import list_pods, resolve_config, select_hosts
from tests.support.local_http import LocalHTTPServer
from tests.support.paths import ROOT

SCRIPT = ROOT / "discovery" / "kubernetes"
TOKEN = "s3cr3t-token"
SELECTOR = "app=train,job=run1"


# ---- certificate and server ------------------------------------------------------------------

def _make_cert(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    if shutil.which("openssl"):
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
             "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out", str(cert),
             "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
            check=True, capture_output=True, timeout=60)
        return cert, key
    crypto = pytest.importorskip("cryptography", reason="needs the openssl CLI or cryptography")
    del crypto
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    pkey = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(pkey.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .sign(pkey, hashes.SHA256()))
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(pkey.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return cert, key


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _make_cert(tmp_path_factory.mktemp("tls"))


def _matches(labels: dict[str, str], selector: str) -> bool:
    for term in selector.split(","):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


class FakeApi:
    """Just enough of the pods list endpoint: token check, selector, pagination."""

    def __init__(self, cert: Path, key: Path) -> None:
        self.pods: list[dict[str, Any]] = []
        self.page_size: int | None = None
        self.force_status: int | None = None
        self.queries: list[dict[str, str]] = []
        self.auth_headers: list[str | None] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _reply(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                url = urllib.parse.urlsplit(self.path)
                query = dict(urllib.parse.parse_qsl(url.query))
                api.queries.append(query)
                api.auth_headers.append(self.headers.get("Authorization"))
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self._reply(401, {"kind": "Status", "message": "Unauthorized"})
                if api.force_status:
                    return self._reply(api.force_status, {"kind": "Status",
                                                          "message": "forced"})
                parts = url.path.strip("/").split("/")
                if parts[:3] != ["api", "v1", "namespaces"] or parts[4:] != ["pods"]:
                    return self._reply(404, {"kind": "Status", "message": "not found"})
                pods = [p for p in api.pods if p["metadata"].get("namespace", "train")
                        == parts[3] and _matches(p["metadata"].get("labels", {}),
                                                 query.get("labelSelector", ""))]
                start = int(query.get("continue") or 0)
                end = len(pods) if api.page_size is None else start + api.page_size
                meta = {"continue": str(end)} if end < len(pods) else {}
                self._reply(200, {"kind": "PodList", "metadata": meta,
                                  "items": pods[start:end]})

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.server = LocalHTTPServer(Handler, tls=context)
        self.port, self.url = self.server.port, self.server.url

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture
def api(tls: tuple[Path, Path]) -> Iterator[FakeApi]:
    server = FakeApi(*tls)
    try:
        yield server
    finally:
        server.stop()


def pod(name: str, ip: str | None, *, phase: str = "Running", ready: bool = True,
        deleting: bool = False, labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None, hostname: str | None = None,
        subdomain: str | None = None, namespace: str = "train") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace,
                            "labels": {"app": "train", "job": "run1", **(labels or {})}}
    if annotations:
        meta["annotations"] = annotations
    if deleting:
        meta["deletionTimestamp"] = "2024-01-01T00:00:00Z"
    status: dict[str, Any] = {"phase": phase, "conditions": [
        {"type": "PodScheduled", "status": "True"},
        {"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    spec: dict[str, Any] = {}
    if hostname:
        spec["hostname"] = hostname
    if subdomain:
        spec["subdomain"] = subdomain
    return {"metadata": meta, "spec": spec, "status": status}


FLEET = [
    pod("w-2", "10.1.0.12", labels={"slots": "4"}),
    pod("w-0", "10.1.0.10", labels={"slots": "2"}),
    pod("w-1", "10.1.0.11"),
    pod("w-pending", None, phase="Pending", ready=False),
    pod("w-starting", "10.1.0.13", ready=False),
    pod("w-leaving", "10.1.0.14", deleting=True),
    pod("w-done", "10.1.0.15", phase="Succeeded", ready=False),
    pod("other", "10.1.0.99", labels={"app": "web"}),
]


# ---- selection rules (no network) ------------------------------------------------------------

@pytest.mark.parametrize(("pods", "kwargs", "expected"), [
    ([pod("a", "10.0.0.1")], {}, {"10.0.0.1": 1}),
    ([pod("a", "10.0.0.1", phase="Pending")], {}, {}),
    ([pod("a", "10.0.0.1", ready=False)], {}, {}),
    ([pod("a", "10.0.0.1", deleting=True)], {}, {}),
    ([pod("a", None)], {}, {}),
    ([pod("a", "10.0.0.1")], {"address": "pod-name"}, {"a": 1}),
    ([pod("a", "10.0.0.1", hostname="w0", subdomain="workers")],
     {"address": "hostname-subdomain"}, {"w0.workers": 1}),
    ([pod("a", "10.0.0.1", subdomain="workers")],
     {"address": "hostname-subdomain", "dns_suffix": "train.svc.cluster.local"},
     {"a.workers.train.svc.cluster.local": 1}),
    ([pod("a", "10.0.0.1", labels={"gpus": "8"})], {"slots_label": "gpus"}, {"10.0.0.1": 8}),
    ([pod("a", "10.0.0.1")], {"slots_label": "gpus", "slots": 3}, {"10.0.0.1": 3}),
    ([pod("a", "10.0.0.1", annotations={"hvd/slots": "2"})],
     {"slots_annotation": "hvd/slots"}, {"10.0.0.1": 2}),
    ([pod("a", "10.0.0.1", labels={"gpus": "8"}, annotations={"hvd/slots": "2"})],
     {"slots_label": "gpus", "slots_annotation": "hvd/slots"}, {"10.0.0.1": 8}),
    ([{"metadata": "junk"}, {}, {"status": {"phase": "Running", "conditions": "x"}}], {}, {}),
    ([{**pod("a", "fd00::1"), "status": {**pod("a", "fd00::1")["status"], "podIPs": [
        {"ip": "fd00::1"}, {"ip": "10.0.0.7"}]}}], {}, {"10.0.0.7": 1}),
])
def test_select_hosts(pods: list[dict[str, Any]], kwargs: dict[str, Any],
                      expected: dict[str, int]) -> None:
    assert select_hosts(pods, **kwargs) == expected


@pytest.mark.parametrize(("pods", "kwargs", "fragment"), [
    ([pod("a", "10.0.0.1", labels={"gpus": "0"})], {"slots_label": "gpus"},
     "pod 'a' label gpus: slots must be a positive integer, got '0'"),
    ([pod("a", "10.0.0.1", annotations={"s": "many"})], {"slots_annotation": "s"}, "'many'"),
    ([pod("a", "10.0.0.1")], {"address": "hostname-subdomain"}, "no spec.subdomain"),
    ([pod("a;reboot", "10.0.0.1")], {"address": "pod-name"}, "contains ';'"),
    ([pod("$(x)", "10.0.0.1", subdomain="s")], {"address": "hostname-subdomain"}, "'$'"),
    ([pod("a", "fd00::1")], {}, "IPv6"),
    ([pod("a", "10.0.0.1"), pod("b", "10.0.0.1")], {}, "appears twice"),
])
def test_select_hosts_refuses(pods: list[dict[str, Any]], kwargs: dict[str, Any],
                              fragment: str) -> None:
    with pytest.raises(DiscoveryError) as info:
        select_hosts(pods, **kwargs)
    assert fragment in str(info.value)


def test_in_cluster_config_from_service_account(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("tok\n")
    (tmp_path / "ca.crt").write_text("x")
    (tmp_path / "namespace").write_text("train\n")
    cfg = resolve_config(api_server=None, token_file=None, ca_file=None, namespace=None,
                         environ={"KUBERNETES_SERVICE_HOST": "10.96.0.1",
                                  "KUBERNETES_SERVICE_PORT": "6443"}, sa_dir=str(tmp_path))
    assert cfg.server == "https://10.96.0.1:6443"
    assert cfg.token_file == str(tmp_path / "token")
    assert cfg.ca_file == str(tmp_path / "ca.crt")
    assert cfg.namespace == "train"
    cfg6 = resolve_config(api_server=None, token_file=None, ca_file=None, namespace="x",
                          environ={"KUBERNETES_SERVICE_HOST": "fd00::1"}, sa_dir=str(tmp_path))
    assert cfg6.server == "https://[fd00::1]:443"


@pytest.mark.parametrize(("kwargs", "environ", "fragment"), [
    ({}, {}, "KUBERNETES_SERVICE_HOST is not set"),
    ({"api_server": "ftp://x"}, {}, "not an http(s) URL"),
    ({"api_server": "http://10.0.0.1:8080", "token_file": "/t"}, {}, "plain http"),
])
def test_config_errors(tmp_path: Path, kwargs: dict[str, Any], environ: dict[str, str],
                       fragment: str) -> None:
    args = {"api_server": None, "token_file": None, "ca_file": None, "namespace": None,
            **kwargs}
    with pytest.raises(DiscoveryError) as info:
        resolve_config(**args, environ=environ, sa_dir=str(tmp_path))
    assert fragment in str(info.value)


def test_list_pods_in_cluster_style_with_pagination(api: FakeApi, tls: tuple[Path, Path],
                                                    tmp_path: Path) -> None:
    (tmp_path / "token").write_text(TOKEN + "\n")
    shutil.copy(tls[0], tmp_path / "ca.crt")
    (tmp_path / "namespace").write_text("train")
    api.pods = [pod(f"w-{i}", f"10.2.0.{i}") for i in range(5)]
    api.page_size = 2
    cfg = resolve_config(api_server=None, token_file=None, ca_file=None, namespace=None,
                         environ={"KUBERNETES_SERVICE_HOST": "127.0.0.1",
                                  "KUBERNETES_SERVICE_PORT": str(api.port)},
                         sa_dir=str(tmp_path))
    pods = list_pods(cfg, "app=train", lambda: 5.0)
    assert [p["metadata"]["name"] for p in pods] == [f"w-{i}" for i in range(5)]
    assert [q.get("continue") for q in api.queries] == [None, "2", "4"]
    assert all(q["labelSelector"] == "app=train" and q["limit"] == "500" for q in api.queries)


# ---- the executable against the server ---------------------------------------------------------

def _run(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
         deadline: str | None = "10") -> tuple[subprocess.CompletedProcess[str], float]:
    """Run the executable; ``deadline=None`` keeps the script's own 1.5 s budget (the timing
    tests), otherwise a generous one so a loaded machine cannot fail functional tests."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("HVD_RESILIENT_", "KUBERNETES_"))}
    base["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{base.get('PATH', '')}"
    base["XDG_RUNTIME_DIR"] = str(tmp_path)
    if deadline:
        base["HVD_RESILIENT_DISCOVERY_DEADLINE"] = deadline
    base.update(env or {})
    start = time.monotonic()
    proc = subprocess.run([str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=20, env=base, cwd=tmp_path)
    return proc, time.monotonic() - start


@pytest.fixture
def creds(tmp_path: Path, tls: tuple[Path, Path]) -> dict[str, str]:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    return {"token": str(token), "ca": str(tls[0])}


def _flags(api: FakeApi, creds: dict[str, str], *extra: str) -> list[str]:
    return ["--api-server", api.url, "--token-file", creds["token"], "--ca-file", creds["ca"],
            "--namespace", "train", "--selector", SELECTOR, *extra]


def test_only_running_ready_pods_not_being_deleted(api: FakeApi, creds: dict[str, str],
                                                   tmp_path: Path) -> None:
    api.pods = FLEET
    proc, _ = _run(tmp_path, *_flags(api, creds, "--slots-label", "slots"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "10.1.0.10:2\n10.1.0.11:1\n10.1.0.12:4\n"
    assert proc.stderr == ""
    assert api.auth_headers == [f"Bearer {TOKEN}"]
    assert api.queries[0]["labelSelector"] == SELECTOR
    assert api.queries[0]["fieldSelector"] == "status.phase=Running"
    again, _ = _run(tmp_path, *_flags(api, creds, "--slots-label", "slots"))
    assert again.stdout == proc.stdout


def test_configured_through_environment_only(api: FakeApi, creds: dict[str, str],
                                             tmp_path: Path) -> None:
    # What a horovodrun launch looks like: no arguments, everything in the environment.
    api.pods = FLEET
    env = {"HVD_RESILIENT_K8S_API_SERVER": api.url,
           "HVD_RESILIENT_K8S_TOKEN_FILE": creds["token"],
           "HVD_RESILIENT_K8S_CA_FILE": creds["ca"], "HVD_RESILIENT_K8S_NAMESPACE": "train",
           "HVD_RESILIENT_K8S_SELECTOR": SELECTOR, "HVD_RESILIENT_K8S_SLOTS": "8",
           "HVD_RESILIENT_K8S_ADDRESS": "pod-name"}
    proc, _ = _run(tmp_path, env=env)
    assert (proc.returncode, proc.stdout) == (0, "w-0:8\nw-1:8\nw-2:8\n"), proc.stderr


def test_use_pod_name_flag(api: FakeApi, creds: dict[str, str], tmp_path: Path) -> None:
    api.pods = FLEET
    proc, _ = _run(tmp_path, *_flags(api, creds, "--use-pod-name"))
    assert proc.stdout == "w-0:1\nw-1:1\nw-2:1\n", proc.stderr


def test_wrong_token_is_refused_and_never_masked(api: FakeApi, creds: dict[str, str],
                                                 tmp_path: Path) -> None:
    api.pods = FLEET
    assert _run(tmp_path, *_flags(api, creds))[0].returncode == 0  # a cached answer exists
    Path(creds["token"]).write_text("wrong-token")
    proc, _ = _run(tmp_path, *_flags(api, creds))
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.startswith("kubernetes: API server rejected the token (401 Unauthorized)")
    assert proc.stderr.count("\n") == 1
    assert TOKEN not in proc.stderr and "wrong-token" not in proc.stderr


def test_forbidden_names_the_missing_role(api: FakeApi, creds: dict[str, str],
                                          tmp_path: Path) -> None:
    api.force_status = 403
    proc, _ = _run(tmp_path, *_flags(api, creds))
    assert proc.returncode == 2
    assert "not allowed to list pods in namespace 'train' (403 Forbidden): forced" in proc.stderr
    assert "Role" in proc.stderr


def test_untrusted_certificate_is_a_configuration_error(api: FakeApi, creds: dict[str, str],
                                                        tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    other_cert, _ = _make_cert(other)
    flags = _flags(api, {**creds, "ca": str(other_cert)})
    proc, _ = _run(tmp_path, *flags)
    assert proc.returncode == 2
    assert "TLS verification" in proc.stderr and "--ca-file" in proc.stderr


def test_api_down_fails_quickly(api: FakeApi, creds: dict[str, str], tmp_path: Path) -> None:
    api.stop()  # the port is closed now: connection refused
    proc, elapsed = _run(tmp_path, *_flags(api, creds), deadline=None)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.startswith(f"kubernetes: cannot reach API server {api.url}")
    assert "no earlier answer cached" in proc.stderr
    assert elapsed < 2


def test_api_down_after_success_prints_last_good_answer(api: FakeApi, creds: dict[str, str],
                                                        tmp_path: Path) -> None:
    api.pods = FLEET
    good, _ = _run(tmp_path, *_flags(api, creds))
    assert good.returncode == 0 and good.stdout == "10.1.0.10:1\n10.1.0.11:1\n10.1.0.12:1\n"
    api.stop()
    proc, elapsed = _run(tmp_path, *_flags(api, creds), deadline=None)
    assert proc.returncode == 0
    assert proc.stdout == good.stdout
    assert "cannot reach API server" in proc.stderr
    assert "printed the last good answer from" in proc.stderr
    assert elapsed < 2
    # With the fallback switched off the same outage is a failure.
    off, _ = _run(tmp_path, *_flags(api, creds, "--cache-max-age", "0"))
    assert (off.returncode, off.stdout) == (1, "")


def test_server_error_is_transient(api: FakeApi, creds: dict[str, str], tmp_path: Path) -> None:
    api.pods = FLEET
    cache = tmp_path / "k8s.json"
    assert _run(tmp_path, *_flags(api, creds, "--cache", str(cache)))[0].returncode == 0
    api.force_status = 503
    proc, _ = _run(tmp_path, *_flags(api, creds, "--cache", str(cache)))
    assert proc.returncode == 0 and proc.stdout.count("\n") == 3
    assert "API server answered 503: forced; printed the last good answer" in proc.stderr


def test_api_that_never_answers_hits_the_deadline(creds: dict[str, str], tmp_path: Path) -> None:
    # Accepts TCP connections (the kernel completes the handshake for the backlog) but never
    # speaks TLS: only the deadline can end the wait.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"https://127.0.0.1:{silent.getsockname()[1]}"
        flags = ["--api-server", url, "--token-file", creds["token"], "--ca-file",
                 creds["ca"], "--selector", SELECTOR, "--deadline", "1.0"]
        proc, elapsed = _run(tmp_path, *flags)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1
    assert elapsed < 2


def test_selector_is_required(tmp_path: Path) -> None:
    proc, _ = _run(tmp_path, "--api-server", "https://127.0.0.1:1")
    assert proc.returncode == 2 and "HVD_RESILIENT_K8S_SELECTOR" in proc.stderr
