"""``discovery/slurm``: the hosts of the current Slurm allocation and their task counts.

Reads ``SLURM_JOB_NODELIST`` (or the older ``SLURM_NODELIST``) and ``SLURM_TASKS_PER_NODE``
from the environment ``horovodrun`` was started in (inside ``sbatch``/``salloc``).  Those
variables are fixed when the job starts, so on its own this script reports a static host set;
wrap it in ``discovery/health-filter`` so that a dead node leaves the job.

Slots: ``--slots N`` for every node, else ``SLURM_TASKS_PER_NODE`` (``2(x3),1`` means three
nodes with 2 tasks then one with 1), paired with the nodes in Slurm's order.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping

from .errors import DiscoveryError, TransientDiscoveryError
from .hostlist import HostlistError, expand_hostlist
from .options import EnvOptions, positive_int
from .output import HostSlots
from .runner import Context, Script, run
from .validate import parse_slots, validate_hostname

_TASKS = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?\Z")
_NODELIST_VARS = ("SLURM_JOB_NODELIST", "SLURM_NODELIST")


def parse_tasks_per_node(text: str) -> list[int]:
    """Expand Slurm's compressed task counts: ``2(x3),1`` -> ``[2, 2, 2, 1]``.

    Raises:
        ValueError: not in that form, or a count below 1.
    """
    counts: list[int] = []
    for piece in text.strip().split(","):
        match = _TASKS.match(piece.strip())
        if not match:
            raise ValueError(f"cannot read {piece!r} in SLURM_TASKS_PER_NODE={text!r} "
                             "(expected forms like '4' or '2(x3),1')")
        count = parse_slots(match.group(1))
        repeat = parse_slots(match.group(2)) if match.group(2) else 1
        counts.extend([count] * repeat)
    return counts


def scontrol_hostnames(nodelist: str, timeout: float, scontrol: str = "scontrol",
                       env: Mapping[str, str] | None = None) -> list[str]:
    """Ask ``scontrol show hostnames`` to expand ``nodelist`` (the slow, authoritative way)."""
    try:
        proc = subprocess.run(
            [scontrol, "show", "hostnames", nodelist],
            capture_output=True, text=True, timeout=timeout, check=False,
            env=None if env is None else dict(env),
        )
    except subprocess.TimeoutExpired:
        raise TransientDiscoveryError(f"scontrol show hostnames took longer than {timeout:.1f} s"
                                      ) from None
    except OSError as exc:
        raise DiscoveryError(f"cannot run {scontrol}: {exc.strerror or exc}") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        raise DiscoveryError(f"scontrol show hostnames {nodelist!r} failed: {last}")
    return proc.stdout.split()


def slurm_hosts(nodelist: str, *, tasks_per_node: str | None, slots: int | None,
                timeout: float = 1.0, scontrol: str | None = None,
                env: Mapping[str, str] | None = None) -> HostSlots:
    """Pair the nodes of ``nodelist`` with their slots.

    ``scontrol`` is the path of the ``scontrol`` binary to fall back on when the native
    parser does not understand ``nodelist`` (``None``: no fallback).
    """
    try:
        nodes = expand_hostlist(nodelist)
    except HostlistError as exc:
        if scontrol is None:
            raise DiscoveryError(f"cannot expand nodelist: {exc}; scontrol is not available "
                                 "to try instead") from None
        nodes = scontrol_hostnames(nodelist, timeout, scontrol, env)
        if not nodes:
            raise DiscoveryError(f"scontrol expanded {nodelist!r} to no hosts") from None
    for node in nodes:
        try:
            validate_hostname(node)
        except ValueError as exc:
            raise DiscoveryError(f"nodelist {nodelist!r}: {exc}") from None
    if slots is not None:
        counts = [slots] * len(nodes)
    elif tasks_per_node:
        try:
            counts = parse_tasks_per_node(tasks_per_node)
        except ValueError as exc:
            raise DiscoveryError(f"{exc}; or pass --slots N") from None
        if len(counts) != len(nodes):
            raise DiscoveryError(
                f"SLURM_TASKS_PER_NODE={tasks_per_node!r} gives {len(counts)} counts for "
                f"{len(nodes)} nodes; pass --slots N")
    else:
        raise DiscoveryError("SLURM_TASKS_PER_NODE is not set (allocation made without "
                             "--ntasks/--ntasks-per-node?); pass --slots N")
    hosts: HostSlots = {}
    for node, count in zip(nodes, counts, strict=True):
        if node in hosts:
            raise DiscoveryError(f"nodelist {nodelist!r} lists {node!r} twice")
        hosts[node] = count
    return hosts


def _nodelist_from(environ: Mapping[str, str]) -> str | None:
    for var in _NODELIST_VARS:
        if environ.get(var):
            return environ[var]
    return None


def _add_options(opts: EnvOptions) -> None:
    opts.add("--slots", env="HVD_RESILIENT_SLURM_SLOTS", type=positive_int, metavar="N",
             help="slots on every node, instead of SLURM_TASKS_PER_NODE")
    opts.add("--nodelist", env="HVD_RESILIENT_SLURM_NODELIST", metavar="HOSTLIST",
             help="hostlist to use instead of SLURM_JOB_NODELIST / SLURM_NODELIST")


def _discover(ctx: Context) -> HostSlots:
    nodelist = ctx.args.nodelist or _nodelist_from(ctx.environ)
    if not nodelist:
        raise DiscoveryError("SLURM_JOB_NODELIST is not set: not inside a Slurm allocation? "
                             "run under sbatch/salloc or pass --nodelist")
    return slurm_hosts(
        nodelist, tasks_per_node=ctx.environ.get("SLURM_TASKS_PER_NODE"),
        slots=ctx.args.slots, timeout=ctx.deadline.remaining(),
        scontrol=shutil.which("scontrol", path=ctx.environ.get("PATH")), env=ctx.environ,
    )


def _cache_inputs(environ: Mapping[str, str]) -> Mapping[str, object]:
    keys = ("SLURM_JOB_ID", *_NODELIST_VARS, "SLURM_TASKS_PER_NODE")
    return {k: environ.get(k) for k in keys}


SCRIPT = Script(name="slurm", description=__doc__ or "", add_options=_add_options,
                discover=_discover, cache_inputs=_cache_inputs)


def main(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> int:
    """Entry point of ``discovery/slurm``; returns the exit status."""
    return run(SCRIPT, argv, environ)
