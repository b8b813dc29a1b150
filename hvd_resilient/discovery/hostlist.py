"""Slurm hostlist expressions: ``node[01-04,07],gpu-[1-2],rack[1-2]-n[1-2]``.

Parsed natively because ``scontrol`` is not always on the machine that runs ``horovodrun``
(a login node image, a container) and costs a process start every second.

Rules, as Slurm writes them:

* top-level commas separate host expressions; commas inside ``[...]`` separate ranges;
* a range is ``N`` or ``LO-HI``; numbers keep the zero padding of ``LO``
  (``[08-10]`` -> ``08 09 10``, ``[8-10]`` -> ``8 9 10``);
* no whitespace anywhere (left in the names, for validation to refuse);
* several bracket groups in one expression expand as a cartesian product, left to right
  (``rack[1-2]-n[1-2]`` -> ``rack1-n1 rack1-n2 rack2-n1 rack2-n2``).

Anything else (nested or unbalanced brackets, ``HI < LO``, empty pieces) raises
``HostlistError`` so the caller can fall back to ``scontrol show hostnames``.  The order of
the expansion is kept: it pairs hosts with ``SLURM_TASKS_PER_NODE``.
"""

from __future__ import annotations

import itertools
import re

#: Refuse expansions larger than this: a typo like ``[1-99999999]`` must not eat the memory
#: of the machine driving the job.
MAX_HOSTS = 65536
_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?\Z")


class HostlistError(ValueError):
    """The expression is not a hostlist this parser understands."""


def split_top_level(expr: str) -> list[str]:
    """Split on commas outside brackets; raises on unbalanced or nested brackets."""
    parts: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(expr):
        if ch == "[":
            if depth:
                raise HostlistError(f"nested '[' at position {i} in {expr!r}")
            depth = 1
        elif ch == "]":
            if not depth:
                raise HostlistError(f"unmatched ']' at position {i} in {expr!r}")
            depth = 0
        elif ch == "," and not depth:
            parts.append(expr[start:i])
            start = i + 1
    if depth:
        raise HostlistError(f"unclosed '[' in {expr!r}")
    parts.append(expr[start:])
    return parts


def _expand_ranges(body: str, expr: str) -> list[str]:
    values: list[str] = []
    for piece in body.split(","):
        match = _RANGE.match(piece)
        if not match:
            raise HostlistError(f"bad range {piece!r} in {expr!r}")
        lo_text, hi_text = match.group(1), match.group(2)
        lo = int(lo_text)
        hi = lo if hi_text is None else int(hi_text)
        if hi < lo:
            raise HostlistError(f"range {piece!r} runs backwards in {expr!r}")
        if hi - lo + 1 > MAX_HOSTS:
            raise HostlistError(f"range {piece!r} expands to more than {MAX_HOSTS} hosts")
        width = len(lo_text)
        values.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return values


def expand_one(expr: str) -> list[str]:
    """Expand one expression without top-level commas (``rack[1-2]-n[01-02]``)."""
    if not expr:
        raise HostlistError("empty host expression")
    pieces: list[list[str]] = []
    pos = 0
    for match in re.finditer(r"\[([^\[\]]*)\]", expr):
        literal = expr[pos:match.start()]
        if "[" in literal or "]" in literal:
            raise HostlistError(f"unbalanced brackets in {expr!r}")
        pieces.append([literal])
        pieces.append(_expand_ranges(match.group(1), expr))
        pos = match.end()
    tail = expr[pos:]
    if "[" in tail or "]" in tail:
        raise HostlistError(f"unbalanced brackets in {expr!r}")
    pieces.append([tail])
    total = 1
    for group in pieces:
        total *= len(group)
        if total > MAX_HOSTS:
            raise HostlistError(f"{expr!r} expands to more than {MAX_HOSTS} hosts")
    return ["".join(combo) for combo in itertools.product(*pieces)]


def expand_hostlist(expr: str) -> list[str]:
    """Expand a full hostlist expression, keeping Slurm's order.

    Raises:
        HostlistError: the syntax is not understood (caller may try ``scontrol``).
    """
    # Only surrounding whitespace goes; inner whitespace is left in place (Slurm never puts
    # any in SLURM_JOB_NODELIST) so that hostname validation refuses "host name" instead of
    # quietly reading two hosts.
    expr = expr.strip()
    if not expr:
        raise HostlistError("empty hostlist")
    hosts: list[str] = []
    for part in split_top_level(expr):
        hosts.extend(expand_one(part))
        if len(hosts) > MAX_HOSTS:
            raise HostlistError(f"hostlist expands to more than {MAX_HOSTS} hosts")
    return hosts
