"""`--hosts h1:2,h2:2`: parsed and checked once, before any launcher sees it.

The hostnames go to ssh (Horovod's, mpirun's and the in-place fan-out's), so they are validated
here; and a host that cannot be reached would make the launcher hang or print pages of ssh
errors, so it is probed first, with one line for what failed.
"""

from __future__ import annotations

import socket

from hvd_resilient.errors import ConfigError, LaunchError


def parse_hosts(spec: str) -> list[tuple[str, int]]:
    """`h1:2,h2` -> [("h1", 2), ("h2", 1)]; hostnames go to ssh, so they are validated here."""
    from hvd_resilient.discovery.validate import validate_hostname

    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        host, _, slots = part.partition(":")
        if not host or not (slots or "1").isdigit() or int(slots or 1) < 1:
            raise ConfigError(f"run: --hosts entry {part!r} must look like host:slots")
        try:
            validate_hostname(host)
        except ValueError as e:
            raise ConfigError(f"run: --hosts: {e}") from None
        out.append((host, int(slots or 1)))
    return out


def discover_hosts(script: str, timeout: float = 10.0, when: str = "") -> dict[str, int]:
    """One call of a host-discovery script (Horovod's contract: ``host:slots`` lines): its
    hosts and slots in the order printed, the names validated (they go to ssh). LaunchError,
    one line, when it cannot run, fails, or prints what Horovod would misread; empty output is
    "no hosts now", not an error. ``when``: said after "failed" (" on its first call")."""
    import subprocess

    from hvd_resilient.discovery.validate import DiscoveryOutputError, parse_discovery_output

    try:
        r = subprocess.run([script], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LaunchError(f"discovery script {script} could not run: {e}") from None
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise LaunchError(f"discovery script {script} failed{when}: {last}")
    try:
        return parse_discovery_output(r.stdout)
    except DiscoveryOutputError as e:
        raise LaunchError(f"discovery script {script} printed {e}") from None


def first_discovered(script: str) -> dict[str, int]:
    """The script's first answer, before anything starts: LaunchError, one line, when it cannot
    run, fails, prints what Horovod would misread, or lists no host."""
    found = discover_hosts(script, when=" on its first call")
    if not found:
        raise LaunchError(f"discovery script {script} printed no hosts: no slots to run on")
    return found


def hosts_arg(hosts: list[tuple[str, int]]) -> str:
    """The launchers' own spelling (`-H h1:2,h2:1`)."""
    return ",".join(f"{h}:{n}" for h, n in hosts)


def is_local(host: str) -> bool:
    """Horovod's rule: local (started without ssh) iff the name resolves to an address of a
    local interface; 127.0.0.2 is not one unless it was added to lo. The in-place fan-out
    (`launch/inplace/fanout.py`) starts a host's agent by the same rule, so that what is probed
    over ssh is what is reached over ssh."""
    import psutil

    try:
        addrs = {i[4][0] for i in socket.getaddrinfo(host, None, socket.AF_INET)}
    except OSError:
        return False
    local = {a.address for nic in psutil.net_if_addrs().values() for a in nic
             if a.family == socket.AF_INET}
    return bool(addrs) and addrs <= local


def is_loopback(host: str) -> bool:
    """True for a name or address that means this machine to whoever uses it (127.x, ::1,
    localhost): another host given it reaches itself, not this one."""
    import ipaddress

    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False  # not resolvable here: the reachability probe says so
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def check_hosts_reachable(hosts: list[tuple[str, int]], ssh_port: int) -> None:
    """The launcher would hang or print pages of ssh errors; one line before it starts."""
    from hvd_resilient.discovery.health import probe_hosts

    remote = [h for h, _ in hosts if not is_local(h)]
    failed = {h: why for h, why in probe_hosts(remote, ssh_port, 2.0).items() if why}
    if failed:
        detail = "; ".join(f"{h}: {why}" for h, why in sorted(failed.items()))
        raise LaunchError(f"hosts unreachable over ssh ({detail}); check they are up and "
                          f"sshd listens on port {ssh_port} (--ssh-port)")
