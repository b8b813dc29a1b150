"""The one output format every discovery script shares: ``hostname:slots`` lines, sorted.

Horovod reads our stdout as a set of lines and builds ``{host: slots}`` from it; a host that
appears twice keeps whichever line its set iteration yields last.  So the formatting here
refuses duplicates structurally (the input is a mapping), sorts for a stable answer (same
input, same output, easy to diff in logs) and validates every entry once more right before
printing, whatever validated it earlier.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from .errors import DiscoveryError
from .validate import parse_slots, validate_hostname

HostSlots = dict[str, int]


def format_hosts(hosts: Mapping[str, int]) -> str:
    """Render ``hosts`` as sorted ``host:slots`` lines, each ending in a newline.

    An empty mapping renders as the empty string: Horovod reads that as "no hosts right now".

    Raises:
        DiscoveryError: a hostname or slot count is not safe to print.
    """
    lines = []
    for host in sorted(hosts):
        try:
            validate_hostname(host)
            slots = parse_slots(hosts[host])
        except ValueError as exc:
            raise DiscoveryError(str(exc)) from None
        lines.append(f"{host}:{slots}\n")
    return "".join(lines)


def merge_hosts(pairs: Iterable[tuple[str, int]], *, what: str = "host") -> HostSlots:
    """Build a mapping from ``(host, slots)`` pairs, refusing a host seen twice.

    Used where a duplicate can only mean the source is confused (two pods with one IP,
    two instances with one address): refusing is safer than picking one.
    """
    out: HostSlots = {}
    for host, slots in pairs:
        if host in out:
            raise DiscoveryError(f"{what} {host!r} appears twice; refusing to guess its slots")
        out[host] = slots
    return out
