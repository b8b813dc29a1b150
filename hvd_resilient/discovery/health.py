"""``discovery/health-filter``: run another discovery command, keep the hosts that answer.

``health-filter [--port 22] [--timeout 0.5] -- CMD ARGS...`` (or the command in
``HVD_RESILIENT_HEALTH_COMMAND``, split like a shell would) runs CMD, reads its
``host:slots`` lines and tries a TCP connection to ``--port`` on every host, all in
parallel.  Hosts that refuse, time out or do not resolve are left out of the answer.

Why: a host that died without its source of truth noticing (a Slurm node that crashed, a
pod whose node lost its network) stays in the wrapped command's answer, and Horovod would
keep placing workers there and wait for Gloo to time out (minutes) on every reset.  A probe
of the port Horovod itself uses to reach the host (ssh, 22) notices within a second.

Trade-offs: a host whose sshd is saturated can be dropped for a round (it comes back on the
next call); every probe is an ssh connection without a login, which sshd may log.

This script keeps no cache of its own: the wrapped command has one.  It hands the child its
share of the time budget through ``HVD_RESILIENT_DISCOVERY_DEADLINE``.
"""

from __future__ import annotations

import math
import queue
import shlex
import socket
import subprocess
import threading
from collections.abc import Iterable, Mapping

from .errors import DiscoveryError, TransientDiscoveryError
from .options import EnvOptions, port_number, positive_float, positive_int
from .output import HostSlots
from .runner import Context, Script, one_line, run
from .validate import parse_slots, validate_hostname

DEFAULT_PORT = 22
DEFAULT_PROBE_TIMEOUT_S = 0.5
#: Slightly more than the other scripts: the wrapped command's own start-up comes first.
DEFAULT_DEADLINE_S = 1.8
_MAX_THREADS = 256
#: Name resolution is not bounded by the socket timeout; allow it this much on top.
_RESOLVE_SLACK_S = 0.25
_MIN_CHILD_S = 0.2


def parse_host_lines(text: str, *, default_slots: int | None = None,
                     source: str = "wrapped command") -> HostSlots:
    """Parse ``host:slots`` lines (what every discovery script prints).

    A bare ``host`` line needs ``default_slots``: horovodrun would give it its own
    ``--slots`` value, which this filter cannot know.
    """
    hosts: HostSlots = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        host, colon, slot_text = line.partition(":")
        try:
            validate_hostname(host)
            if colon:
                slots = parse_slots(slot_text)
            elif default_slots is not None:
                slots = default_slots
            else:
                raise ValueError(f"{host!r} has no ':slots'; pass --default-slots N")
        except ValueError as exc:
            raise DiscoveryError(f"{source} output line {number}: {exc}") from None
        if host in hosts:
            raise DiscoveryError(f"{source} output lists {host!r} twice")
        hosts[host] = slots
    return hosts


def probe_one(host: str, port: int, timeout: float) -> str | None:
    """``None`` if a TCP connection to ``host:port`` opens within ``timeout``, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except TimeoutError:
        return f"no answer on port {port} within {timeout:g} s"
    except ConnectionRefusedError:
        return f"connection refused on port {port}"
    except socket.gaierror as exc:
        return f"cannot resolve ({exc.strerror})"
    except OSError as exc:
        return f"port {port}: {exc.strerror or exc}"


def probe_hosts(hosts: Iterable[str], port: int, timeout: float, *,
                wait: float | None = None) -> dict[str, str | None]:
    """Probe every host in parallel; ``{host: None or the reason it failed}``.

    Daemon threads, not an executor: a thread stuck in ``getaddrinfo`` must neither delay
    the answer nor keep the interpreter from exiting.  ``wait`` caps the total time; a host
    without a result by then counts as failed.
    """
    todo = list(dict.fromkeys(hosts))
    if not todo:
        return {}
    results: dict[str, str | None] = {}
    lock = threading.Lock()
    finished = threading.Event()
    work: queue.SimpleQueue[str] = queue.SimpleQueue()
    for host in todo:
        work.put(host)

    def worker() -> None:
        while True:
            try:
                host = work.get_nowait()
            except queue.Empty:
                return
            reason = probe_one(host, port, timeout)
            with lock:
                results[host] = reason
                if len(results) == len(todo):
                    finished.set()

    threads = min(len(todo), _MAX_THREADS)
    for i in range(threads):
        threading.Thread(target=worker, name=f"probe-{i}", daemon=True).start()
    rounds = math.ceil(len(todo) / threads)
    budget = rounds * (timeout + _RESOLVE_SLACK_S)
    finished.wait(budget if wait is None else min(wait, budget))
    with lock:
        snapshot = dict(results)
    return {h: snapshot[h] if h in snapshot else f"no answer within {timeout:g} s"
            for h in todo}


def run_wrapped(command: list[str], *, timeout: float,
                environ: Mapping[str, str]) -> tuple[str, str]:
    """Run the wrapped discovery command; its ``(stdout, stderr)``, or the reason it failed.

    The child's exit status 2 (bad input/configuration) stays a ``DiscoveryError``; any
    other failure is transient, like the child's own view of it.
    """
    child_env = dict(environ)
    child_env["HVD_RESILIENT_DISCOVERY_DEADLINE"] = f"{max(0.1, timeout - 0.35):.2f}"
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env=child_env, stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired:
        raise TransientDiscoveryError(f"wrapped command {command[0]} gave no answer within "
                                      f"{timeout:.1f} s") from None
    except OSError as exc:
        raise DiscoveryError(f"cannot run wrapped command {command[0]!r}: "
                             f"{exc.strerror or exc}") from None
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        reason = one_line(lines[-1]) if lines else "no message on stderr"
        text = f"wrapped command {command[0]} exited {proc.returncode}: {reason}"
        if proc.returncode == 2:
            raise DiscoveryError(text)
        raise TransientDiscoveryError(text)
    return proc.stdout, proc.stderr


def _add_options(opts: EnvOptions) -> None:
    opts.add("--port", env="HVD_RESILIENT_HEALTH_PORT", type=port_number,
             default=DEFAULT_PORT, metavar="PORT",
             help=f"TCP port to probe, the one horovodrun uses to reach hosts (default "
                  f"{DEFAULT_PORT})")
    opts.add("--timeout", env="HVD_RESILIENT_HEALTH_TIMEOUT", type=positive_float,
             default=DEFAULT_PROBE_TIMEOUT_S, metavar="SECONDS",
             help=f"connect timeout of one probe (default {DEFAULT_PROBE_TIMEOUT_S:g})")
    opts.add("--default-slots", env="HVD_RESILIENT_HEALTH_DEFAULT_SLOTS", type=positive_int,
             metavar="N", help="slots of a bare 'host' line in the command's output")
    opts.add_flag("--quiet", env="HVD_RESILIENT_HEALTH_QUIET",
                  help="do not name dropped hosts on stderr")
    opts.add("--command", env="HVD_RESILIENT_HEALTH_COMMAND", metavar="CMD",
             help="wrapped command as one string (split like a shell); '-- CMD ARGS' wins")


def _discover(ctx: Context) -> HostSlots:
    args = ctx.args
    command = list(args.wrapped) if args.wrapped else shlex.split(args.command or "")
    if not command:
        raise DiscoveryError("no command to wrap; use 'health-filter [options] -- CMD ARGS' "
                             "or set HVD_RESILIENT_HEALTH_COMMAND")
    child_budget = ctx.deadline.remaining() - args.timeout - _RESOLVE_SLACK_S
    if child_budget < _MIN_CHILD_S:
        raise DiscoveryError(f"--timeout {args.timeout:g} leaves the wrapped command no time "
                             f"within --deadline {args.deadline:g}")
    stdout, stderr = run_wrapped(command, timeout=child_budget, environ=ctx.environ)
    for line in stderr.splitlines():
        if line.strip():
            ctx.note(f"(from {command[0]}) {line}")
    hosts = parse_host_lines(stdout, default_slots=args.default_slots)
    results = probe_hosts(hosts, args.port, args.timeout, wait=ctx.deadline.remaining())
    kept = {h: s for h, s in hosts.items() if results.get(h) is None}
    if not args.quiet:
        for host in sorted(hosts.keys() - kept.keys()):
            ctx.note(f"dropped {host}: {results[host]}")
    return kept


SCRIPT = Script(name="health-filter", description=__doc__ or "", add_options=_add_options,
                discover=_discover, use_cache=False, default_deadline=DEFAULT_DEADLINE_S,
                usage="%(prog)s [options] -- CMD [ARGS...]")


def main(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> int:
    """Entry point of ``discovery/health-filter``; returns the exit status.

    Everything after the first ``--`` is the wrapped command, passed on untouched.
    """
    import sys

    args = sys.argv[1:] if argv is None else list(argv)
    wrapped: list[str] = []
    if "--" in args:
        cut = args.index("--")
        args, wrapped = args[:cut], args[cut + 1:]
    return run(SCRIPT, args, environ, hard_exit=argv is None, extra={"wrapped": wrapped})
