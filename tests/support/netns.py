"""Several ssh-reachable "hosts" on one machine: network namespaces on a private bridge.

`Cluster(k)` builds, for one test run:

- a bridge `hvcXXXXXX` in the root namespace holding 198.18.N.1/24 (RFC 2544 benchmarking
  range: never routed on the internet; N is picked so that no address or route of this machine
  and no other live run already uses 198.18.N.0/24);
- K namespaces `hvchaos-XXXXXX-I`, each joined to the bridge by a veth pair whose inner end is
  renamed to the bridge's name (Horovod hands ONE `--network-interface` name to every host)
  and holds 198.18.N.(10+I);
- `/etc/netns/NS/hosts`, which `ip netns exec` mounts over /etc/hosts: it maps the machine's
  hostname to the namespace's own address (otherwise Gloo advertises 127.0.0.1 to its peers);
- one `sshd -D` per namespace on NS_ADDR:2222, with a host key and a client key made for the
  run, and an `ssh` wrapper (first on PATH for horovodrun) that adds `-F RUN/ssh_config` so
  root's own ~/.ssh/known_hosts is never touched.

Fault tools: `kill_pid`, `kill_host` (every process in the namespace, with or without its
sshd), `partition`/`heal` (the host's veth down/up), `slow`/`unslow` (tc on both ends of the
host's link), `kill_driver`.

Teardown (`close`, also from atexit and SIGTERM) kills every process in the namespaces, then
removes veths, bridge, namespaces and /etc/netns/NS. Each run is recorded in
/run/hvd-chaos/ID.json before anything is created; a later run removes what a dead owner
left behind. Only names matching this run's patterns are ever touched.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

PREFIX = "hvchaos"
REGISTRY = Path("/run/hvd-chaos")
NETNS_DIR = Path("/run/netns")
ETC_NETNS = Path("/etc/netns")
SSHD = Path("/usr/sbin/sshd")
SSH = shutil.which("ssh") or "/usr/bin/ssh"
SSH_PORT = 2222
POOL = ipaddress.ip_network("198.18.0.0/15")
CMD_TIMEOUT = 30.0

_NS_RE = re.compile(rf"^{PREFIX}-([0-9a-f]{{6}})-\d+$")
# hvcID: the bridge; hvcIDpI: a host's root-side veth; hvtIDI: its peer before the move
_LINK_RE = re.compile(r"^hv[ct]([0-9a-f]{6})(p?\d+)?$")


class Unavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no CAP_NET_ADMIN)."""


class MissingTool(RuntimeError):
    """A required program (sshd) is not installed."""


def _run(*args: str, check: bool = True, timeout: float = CMD_TIMEOUT) -> str:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} -> {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


def netns_pids(ns: str) -> list[int]:
    out = _run("ip", "netns", "pids", ns, check=False)
    return [int(x) for x in out.split() if x.isdigit()]


def _netns_inode(ns: str) -> int | None:
    try:
        return os.stat(NETNS_DIR / ns).st_ino
    except OSError:
        return None


def _kill_all_in(ns: str, keep: set[int] = frozenset(), timeout: float = 15.0) -> list[int]:
    """SIGKILLs every process in namespace `ns` except `keep`; waits until they are gone."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout
    while True:
        pids = [p for p in netns_pids(ns) if p not in keep and p != os.getpid()]
        live = []
        for pid in pids:
            try:
                proc = psutil.Process(pid)
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                os.kill(pid, signal.SIGKILL)
                live.append(pid)
                if pid not in killed:
                    killed.append(pid)
            except (ProcessLookupError, psutil.NoSuchProcess):
                continue
        if not live:
            return killed
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes in {ns} survive SIGKILL: {live}")
        psutil.wait_procs([psutil.Process(p) for p in live if psutil.pid_exists(p)],
                          timeout=1.0)


def _owner_alive(record: dict) -> bool:
    try:
        proc = psutil.Process(int(record["pid"]))
        return abs(proc.create_time() - float(record["create_time"])) < 1.0
    except (psutil.NoSuchProcess, KeyError, ValueError, TypeError):
        return False


def _teardown(run_id: str) -> list[str]:
    """Removes everything named after `run_id`; returns what failed (empty when all went)."""
    errors: list[str] = []
    record = REGISTRY / f"{run_id}.json"
    try:
        rec = json.loads(record.read_text())
    except (OSError, ValueError):
        rec = {}
    for pid, created in rec.get("adopted", []):  # launchers in the root namespace
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            p = psutil.Process(pid)
            if abs(p.create_time() - created) < 1.0:
                for child in p.children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        child.kill()
                p.kill()
                p.wait(10)
    namespaces = [ns for ns in _list_netns() if (m := _NS_RE.match(ns)) and m[1] == run_id]
    for ns in namespaces:
        try:
            _kill_all_in(ns)
        except Exception as e:  # keep going: the rest must still be removed
            errors.append(str(e))
    for name in _list_links():
        m = _LINK_RE.match(name)
        if m and m[1] == run_id and m[2]:  # root-side veths first, then the bridge
            _run("ip", "link", "del", name, check=False)
    bridge = f"hvc{run_id}"
    if bridge in _list_links():
        _run("ip", "link", "del", bridge, check=False)
    for ns in namespaces:
        out = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True,
                             timeout=CMD_TIMEOUT)
        if out.returncode != 0 and ns in _list_netns():
            errors.append(f"ip netns del {ns}: {out.stderr.strip()}")
    if ETC_NETNS.is_dir():
        for d in ETC_NETNS.iterdir():
            m = _NS_RE.match(d.name)
            if m and m[1] == run_id:
                shutil.rmtree(d, ignore_errors=True)
    leftovers = [n for n in _list_links() if (m := _LINK_RE.match(n)) and m[1] == run_id]
    if leftovers:
        errors.append(f"links left: {leftovers}")
    workdir = rec.get("workdir")
    if workdir and Path(workdir).name.startswith(f"{PREFIX}-{run_id}"):
        shutil.rmtree(workdir, ignore_errors=True)
    if not errors:
        record.unlink(missing_ok=True)
    return errors


def _tidy_etc_netns(exclude: str | None = None) -> None:
    """Removes /etc/netns once empty if one of our runs made it and no other run is live.
    Call with the registry lock held."""
    marker = REGISTRY / "made-etc-netns"
    if not marker.exists() or set(_live_runs()) - {exclude}:
        return
    with contextlib.suppress(OSError):
        ETC_NETNS.rmdir()  # fails (and stays) while anything is in it
        marker.unlink()


def _list_netns() -> list[str]:
    return [line.split()[0] for line in _run("ip", "netns", "list", check=False).splitlines()
            if line.strip()]


def _list_links() -> list[str]:
    out = _run("ip", "-o", "link", "show", check=False)
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


@contextlib.contextmanager
def _registry_lock() -> Iterator[None]:
    REGISTRY.mkdir(mode=0o755, exist_ok=True)
    with open(REGISTRY / "lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _live_runs() -> dict[str, dict]:
    live = {}
    for f in REGISTRY.glob("*.json"):
        try:
            rec = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if _owner_alive(rec):
            live[f.stem] = rec
    return live


def sweep_stale() -> list[str]:
    """Tears down what runs whose owner process is gone left behind; returns their ids."""
    if not REGISTRY.is_dir() and not any(_NS_RE.match(n) for n in _list_netns()):
        return []
    with _registry_lock():
        live = _live_runs()
        ids = {f.stem for f in REGISTRY.glob("*.json")}
        ids |= {m[1] for n in _list_netns() if (m := _NS_RE.match(n))}
        ids |= {m[1] for n in _list_links() if (m := _LINK_RE.match(n))}
        stale = sorted(ids - set(live))
        for run_id in stale:
            _teardown(run_id)
        _tidy_etc_netns()
    return stale


def _used_networks() -> list[ipaddress.IPv4Network]:
    nets = []
    for line in _run("ip", "-4", "-o", "addr", "show", check=False).splitlines():
        m = re.search(r"inet (\S+)", line)
        if m:
            nets.append(ipaddress.ip_interface(m[1]).network)
    for line in _run("ip", "-4", "route", "show", "table", "all", check=False).splitlines():
        first = line.split()[0] if line.split() else ""
        if first in ("default", "broadcast", "local", "unreachable", "prohibit", "blackhole"):
            continue
        with contextlib.suppress(ValueError):
            nets.append(ipaddress.ip_network(first, strict=False))
    return nets


def _pick_subnet(live: dict[str, dict]) -> ipaddress.IPv4Network:
    taken = {r.get("subnet") for r in live.values()}
    used = _used_networks()
    candidates = list(POOL.subnets(new_prefix=24))
    for _ in range(64):
        net = candidates[secrets.randbelow(len(candidates))]
        if str(net) in taken or any(net.overlaps(u) for u in used):
            continue
        return net
    raise RuntimeError("no free /24 left in 198.18.0.0/15")


@dataclass
class Host:
    index: int
    ns: str
    addr: str
    veth: str  # root-side end; its peer inside `ns` carries the bridge's name
    sshd: subprocess.Popen | None = None
    sshd_log: Path | None = None
    slowed: bool = False
    inode: int | None = field(default=None, repr=False)

    def __str__(self) -> str:
        return f"{self.ns}({self.addr})"


class Cluster:
    """K ssh-reachable hosts in network namespaces; use as a context manager."""

    def __init__(self, k: int, *, workdir: Path | None = None) -> None:
        if k < 1 or k > 8:
            raise ValueError("1 <= k <= 8")
        self.k = k
        self.run_id = secrets.token_hex(3)
        self.iface = f"hvc{self.run_id}"  # the bridge, and every host's interface
        self.port = SSH_PORT
        self.hosts: list[Host] = []
        self._own_workdir = workdir is None
        self.dir = Path(workdir or tempfile.mkdtemp(prefix=f"{PREFIX}-{self.run_id}-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.key = self.dir / "id_ed25519"
        self.ssh_config = self.dir / "ssh_config"
        self.bin = self.dir / "bin"
        self.subnet: ipaddress.IPv4Network | None = None
        self._closed = False
        self._lock = threading.Lock()
        self.before_close: list[Callable[[], object]] = []  # e.g. stop the jobs first

    # -- lifecycle ------------------------------------------------------------------------
    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self._probe()  # not root: Unavailable (a skip) before anything else
        if not SSHD.exists():
            raise MissingTool(f"{SSHD} not found: install openssh-server (make install)")
        sweep_stale()
        _live_clusters.add(self)
        _install_exit_hooks()
        with _registry_lock():
            self.subnet = _pick_subnet(_live_runs())
            me = psutil.Process()
            (REGISTRY / f"{self.run_id}.json").write_text(json.dumps({
                "pid": me.pid, "create_time": me.create_time(), "subnet": str(self.subnet),
                "workdir": str(self.dir) if self._own_workdir else None,
                "k": self.k, "started": time.time(),
            }))
            self._make_network()
        self._make_keys()
        for h in self.hosts:
            self._start_sshd(h)
        for h in self.hosts:
            self.wait_ssh(h)

    @staticmethod
    def _probe() -> None:
        probe = f"{PREFIX}-probe{os.getpid()}"
        r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                           timeout=CMD_TIMEOUT)
        if r.returncode != 0:
            raise Unavailable(f"`ip netns add` failed (needs root / CAP_NET_ADMIN): "
                              f"{r.stderr.strip()}")
        _run("ip", "netns", "del", probe, check=False)

    def _make_network(self) -> None:
        assert self.subnet is not None
        net = self.subnet
        gw = f"{net[1]}/{net.prefixlen}"
        _run("ip", "link", "add", self.iface, "type", "bridge")
        _run("ip", "addr", "add", gw, "dev", self.iface)
        _run("ip", "link", "set", self.iface, "up")
        if not ETC_NETNS.exists():
            (REGISTRY / "made-etc-netns").touch()
        hostname = socket.gethostname()
        for i in range(self.k):
            ns = f"{PREFIX}-{self.run_id}-{i}"
            addr = str(net[10 + i])
            veth = f"{self.iface}p{i}"
            tmp_peer = f"hvt{self.run_id}{i}"
            h = Host(i, ns, addr, veth)
            self.hosts.append(h)
            _run("ip", "netns", "add", ns)
            h.inode = _netns_inode(ns)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", tmp_peer)
            _run("ip", "link", "set", tmp_peer, "netns", ns)
            _run("ip", "-n", ns, "link", "set", tmp_peer, "name", self.iface)
            _run("ip", "-n", ns, "addr", "add", f"{addr}/{net.prefixlen}", "dev", self.iface)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "link", "set", self.iface, "up")
            _run("ip", "link", "set", veth, "master", self.iface)
            _run("ip", "link", "set", veth, "up")
            etc = ETC_NETNS / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(_hosts_file(hostname, addr))

    def _make_keys(self) -> None:
        for name in ("host_ed25519", "id_ed25519"):
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"hvchaos-{self.run_id}",
                 "-f", str(self.dir / name))
        (self.dir / "authorized_keys").write_text((self.dir / "id_ed25519.pub").read_text())
        self.ssh_config.write_text(
            "Host *\n"
            "  User root\n"
            f"  Port {self.port}\n"
            f"  IdentityFile {self.key}\n"
            "  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {self.dir / 'known_hosts'}\n"
            "  StrictHostKeyChecking no\n"
            "  BatchMode yes\n"
            "  LogLevel ERROR\n"
            "  ConnectTimeout 5\n"
            # A partitioned host must end its ssh sessions, or Horovod never notices it.
            "  ServerAliveInterval 2\n"
            "  ServerAliveCountMax 3\n"
        )
        self.bin.mkdir(exist_ok=True)
        (self.dir / "home").mkdir(exist_ok=True)
        wrapper = self.bin / "ssh"
        wrapper.write_text(f'#!/bin/sh\nexec {SSH} -F {self.ssh_config} "$@"\n')
        wrapper.chmod(0o755)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation dir

    def _sshd_config(self, h: Host) -> Path:
        cfg = self.dir / f"sshd_{h.index}.conf"
        cfg.write_text(
            f"Port {self.port}\n"
            f"ListenAddress {h.addr}\n"
            f"HostKey {self.dir / 'host_ed25519'}\n"
            f"PidFile {self.dir / f'sshd_{h.index}.pid'}\n"
            f"AuthorizedKeysFile {self.dir / 'authorized_keys'}\n"
            "PermitRootLogin prohibit-password\n"
            "PubkeyAuthentication yes\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            "UsePAM no\n"
            "StrictModes no\n"
            "UseDNS no\n"
            "PrintMotd no\n"
            "X11Forwarding no\n"
            "MaxStartups 64:30:128\n"
            "MaxSessions 64\n"
            "ClientAliveInterval 2\n"
            "ClientAliveCountMax 3\n"
            # Sessions must not run root's ~/.bashrc: here it runs `pyenv rehash`, whose lock
            # file a killed host leaves behind, and every later login then waits 60 s.
            f"SetEnv HOME={self.dir / 'home'}\n"
            "LogLevel INFO\n"
        )
        return cfg

    def _start_sshd(self, h: Host) -> None:
        cfg = self._sshd_config(h)
        h.sshd_log = self.dir / f"sshd_{h.index}.log"
        h.sshd = subprocess.Popen(
            ["ip", "netns", "exec", h.ns, str(SSHD), "-D", "-f", str(cfg), "-E",
             str(h.sshd_log)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def wait_ssh(self, h: Host, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if h.sshd is not None and h.sshd.poll() is not None:
                log = h.sshd_log.read_text() if h.sshd_log and h.sshd_log.exists() else ""
                raise RuntimeError(f"sshd of {h} exited ({h.sshd.returncode}): {log[-2000:]}")
            try:
                r = subprocess.run(self.ssh_cmd(h, "true"), capture_output=True, text=True,
                                   timeout=10, stdin=subprocess.DEVNULL)
                if r.returncode == 0:
                    return
                last = r.stderr.strip()
            except subprocess.TimeoutExpired:
                last = "ssh timed out"
            time.sleep(0.2)  # retry pacing, not synchronisation
        raise RuntimeError(f"ssh to {h} not ready after {timeout}s: {last}")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        errors = []
        try:
            for fn in self.before_close:
                try:
                    fn()
                except Exception as e:  # the network must still go
                    errors.append(f"before_close: {e}")
            for h in self.hosts:
                if h.sshd is not None and h.sshd.poll() is None:
                    h.sshd.kill()
            errors += _teardown(self.run_id)
            with _registry_lock():
                _tidy_etc_netns(exclude=self.run_id)
            for h in self.hosts:
                if h.sshd is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        h.sshd.wait(timeout=10)
        finally:
            _live_clusters.discard(self)
            if self._own_workdir:
                shutil.rmtree(self.dir, ignore_errors=True)
        if errors:
            raise RuntimeError(f"chaos cluster {self.run_id} teardown incomplete: {errors}")

    # -- using the hosts ------------------------------------------------------------------
    def ssh_cmd(self, h: Host, *command: str) -> list[str]:
        return [SSH, "-F", str(self.ssh_config), h.addr, *command]

    def hostfile(self, hosts: list[Host] | None = None, slots: int = 1) -> str:
        """`addr:slots,...` for jobs.set_hosts / write_discovery."""
        return ",".join(f"{h.addr}:{slots}" for h in (self.hosts if hosts is None else hosts))

    def horovodrun_args(self) -> list[str]:
        return ["-p", str(self.port), "-i", str(self.key), "--network-interface", self.iface]

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """`base` with the run's ssh wrapper first on PATH (for horovodrun's ssh calls)."""
        env = dict(base)
        env["PATH"] = f"{self.bin}:{env.get('PATH', '')}"
        return env

    def host(self, addr_or_index: str | int) -> Host:
        for h in self.hosts:
            if addr_or_index in (h.addr, h.index, h.ns):
                return h
        raise KeyError(addr_or_index)

    def sshd_pid(self, h: Host) -> int | None:
        return h.sshd.pid if h.sshd is not None and h.sshd.poll() is None else None

    def pids(self, h: Host, *, include_sshd: bool = False) -> list[int]:
        """Processes in the host's namespace (ssh sessions and workers; its sshd if asked)."""
        keep = set() if include_sshd else {self.sshd_pid(h)}
        return [p for p in netns_pids(h.ns) if p not in keep]

    def adopt(self, pid: int) -> None:
        """Records a launcher (root namespace) so that a sweep after a crash kills it too."""
        p = psutil.Process(pid)
        path = REGISTRY / f"{self.run_id}.json"
        with _registry_lock():
            rec = json.loads(path.read_text())
            rec.setdefault("adopted", []).append([pid, p.create_time()])
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(rec))
            os.replace(tmp, path)

    def named(self, h: Host, name: str) -> list[int]:
        """Processes in the host's namespace whose name is `name`."""
        out = []
        for pid in self.pids(h):
            with contextlib.suppress(psutil.Error):
                if psutil.Process(pid).name() == name:
                    out.append(pid)
        return out

    def workers(self, h: Host, marker: str | None = None) -> list[int]:
        """Python processes in the host's namespace (with the job marker, if given)."""
        out = []
        for pid in self.pids(h):
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if "python" not in os.path.basename(p.exe()):
                    continue
                if marker is None or p.environ().get("HVD_RESILIENT_TEST_JOB") == marker:
                    out.append(pid)
        return out

    def host_of_pid(self, pid: int) -> Host | None:
        try:
            inode = os.stat(f"/proc/{pid}/ns/net").st_ino
        except OSError:
            return None
        for h in self.hosts:
            if h.inode == inode:
                return h
        return None

    # -- faults ---------------------------------------------------------------------------
    @staticmethod
    def kill_pid(pid: int) -> float:
        """SIGKILL one process; returns when it was sent (time.time())."""
        t = time.time()
        os.kill(pid, signal.SIGKILL)
        return t

    def kill_host(self, h: Host, *, keep_sshd: bool = True) -> tuple[float, list[int]]:
        """SIGKILL every process in the host (its sshd too unless keep_sshd)."""
        keep = {self.sshd_pid(h)} if keep_sshd else set()
        t = time.time()
        killed = _kill_all_in(h.ns, keep={p for p in keep if p})
        if not keep_sshd and h.sshd is not None:
            h.sshd.wait(timeout=10)
        return t, killed

    def freeze_host(self, h: Host) -> tuple[float, list[int]]:
        """SIGSTOPs every process in the host but its sshd (a paused VM, a host whose
        processes all hang in the kernel): nothing closes, its kernel still ACKs."""
        keep = self.sshd_pid(h)
        t = time.time()
        frozen = []
        for pid in netns_pids(h.ns):
            if pid != keep:
                try:
                    os.kill(pid, signal.SIGSTOP)
                    frozen.append(pid)
                except ProcessLookupError:
                    pass
        return t, frozen

    def restart_sshd(self, h: Host) -> None:
        if self.sshd_pid(h) is None:
            self._start_sshd(h)
            self.wait_ssh(h)

    def partition(self, h: Host) -> float:
        """Cuts the host off: its link goes down (packets vanish, no reset is sent)."""
        t = time.time()
        _run("ip", "link", "set", h.veth, "down")
        return t

    def heal(self, h: Host) -> float:
        t = time.time()
        _run("ip", "link", "set", h.veth, "up")
        return t

    def slow(self, h: Host, *, delay_ms: int = 50, rate: str = "2mbit") -> str:
        """Slows the host's link both ways: netem delay where the kernel has it, else a tbf
        rate limit (this machine's kernel has no netem; `delay_ms=0` asks for the rate limit
        everywhere). Returns what was applied."""
        applied = ""
        for ns_args in ([], ["-n", h.ns]):
            dev = h.veth if not ns_args else self.iface
            base = ["tc", *ns_args, "qdisc", "replace", "dev", dev, "root"]
            r = subprocess.run([*base, "netem", "delay", f"{delay_ms}ms"], capture_output=True,
                               text=True, timeout=CMD_TIMEOUT) if delay_ms else None
            if r is not None and r.returncode == 0:
                applied = f"netem delay {delay_ms}ms"
                continue
            _run(*base, "tbf", "rate", rate, "burst", "8kb", "latency", "500ms")
            applied = f"tbf rate {rate} (no netem in this kernel)"
        h.slowed = True
        return applied

    def unslow(self, h: Host) -> None:
        _run("tc", "qdisc", "del", "dev", h.veth, "root", check=False)
        _run("tc", "-n", h.ns, "qdisc", "del", "dev", self.iface, "root", check=False)
        h.slowed = False

    @staticmethod
    def kill_driver(driver_pid: int) -> float:
        """SIGKILL the horovodrun driver (the launcher process, not its workers)."""
        return Cluster.kill_pid(driver_pid)


def _hosts_file(hostname: str, addr: str) -> str:
    lines = []
    try:
        base = Path("/etc/hosts").read_text().splitlines()
    except OSError:
        base = ["127.0.0.1 localhost"]
    for line in base:
        body = line.split("#", 1)[0].split()
        if len(body) >= 2 and hostname in body[1:]:
            names = [n for n in body[1:] if n != hostname]
            if names:
                lines.append(" ".join([body[0], *names]))
            continue
        lines.append(line)
    lines.append(f"{addr} {hostname}")
    return "\n".join(lines) + "\n"


# -- teardown on interpreter exit and SIGTERM ------------------------------------------------
_live_clusters: set[Cluster] = set()
_hooks_installed = False


def _close_all() -> None:
    for c in list(_live_clusters):
        with contextlib.suppress(Exception):
            c.close()


def _install_exit_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(_close_all)
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        def on_term(signum: int, frame: object) -> None:
            _close_all()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGTERM, on_term)


@contextlib.contextmanager
def cluster(k: int, workdir: Path | None = None) -> Iterator[Cluster]:
    """`with cluster(3) as c:` -- K hosts, always torn down."""
    c = Cluster(k, workdir=workdir)
    with c:
        yield c
