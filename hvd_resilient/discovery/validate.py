"""Validation of what a discovery script is about to print.

Horovod passes every discovered hostname to ``ssh`` inside a shell command line, and splits
each output line on ``:``.  A hostname is therefore both an injection vector (``a;rm -rf /``,
``$(reboot)``, ``-oProxyCommand=...`` read as an ssh option) and a parsing hazard (an IPv6
address has colons).  Everything printed goes through ``validate_hostname`` and
``parse_slots`` first, whatever source it came from, including our own cache file.

Accepted hostnames: RFC 1123 names (ASCII letters, digits, ``-``; labels of 1..63 characters
separated by ``.``; no label starts or ends with ``-``; at most 253 characters) and dotted-quad
IPv4 addresses.  ``_`` is tolerated inside labels because real fleets have such names
(``/etc/hosts`` entries, some cloud DNS) and it carries no meaning for a shell or for ssh.
IPv6 addresses are refused: ``horovodrun`` would split them on ``:`` and fail.
"""

from __future__ import annotations

import ipaddress
import re

_ALLOWED = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._")
_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?\Z")
_DIGITS = re.compile(r"[0-9]+\Z")
_MAX_NAME = 253


def validate_hostname(name: str) -> str:
    """Return ``name`` unchanged if it is safe to print, else raise ``ValueError``.

    The message names the offending character or rule so an operator can fix the source.
    """
    if not isinstance(name, str) or not name:
        raise ValueError("empty hostname")
    if ":" in name:
        raise ValueError(
            f"hostname {name!r} contains ':' (IPv6 addresses cannot be used: horovodrun "
            "splits 'host:slots' on ':'; use a hostname or an IPv4 address)"
        )
    for ch in name:
        if ch not in _ALLOWED:
            raise ValueError(
                f"hostname {name!r} contains {ch!r}; only ASCII letters, digits, '-', '_' "
                "and '.' are allowed"
            )
    if name.startswith("-"):
        raise ValueError(f"hostname {name!r} starts with '-' (ssh would read it as an option)")
    if len(name) > _MAX_NAME:
        raise ValueError(f"hostname {name[:20]!r}... is longer than {_MAX_NAME} characters")
    if all(ch.isdigit() or ch == "." for ch in name):
        # All digits and dots: it is meant as an IPv4 address, so it must be a valid one
        # (``10.0.0.256`` or ``10.1`` would otherwise be resolved in surprising ways).
        try:
            ipaddress.IPv4Address(name)
        except ValueError:
            raise ValueError(f"{name!r} is not a valid IPv4 address") from None
        return name
    for label in name.split("."):
        if not _LABEL.match(label):
            if not label:
                raise ValueError(f"hostname {name!r} has an empty label (leading, trailing or "
                                 "doubled '.')")
            if len(label) > 63:
                raise ValueError(f"hostname {name!r} has a label longer than 63 characters")
            raise ValueError(f"hostname {name!r} has a label that starts or ends with '-'")
    return name


def parse_slots(value: object) -> int:
    """Parse a slot count: plain decimal digits, at least 1.

    Strict on purpose: ``int()`` would accept ``' 4'``, ``'+4'``, ``'4_0'`` and non-ASCII
    digits, and ``True`` is an ``int``; none of these is what an operator meant to write.
    """
    if isinstance(value, bool):
        raise ValueError(f"slots must be a positive integer, got {value!r}")
    if isinstance(value, int):
        text = str(value)
    elif isinstance(value, str):
        text = value
    else:
        raise ValueError(f"slots must be a positive integer, got {value!r}")
    if not _DIGITS.match(text) or len(text) > 9 or int(text) < 1:
        raise ValueError(f"slots must be a positive integer, got {text!r}")
    return int(text)


GOOD_LINE = "one 'hostname:slots' line per host, e.g. 'node1:4' (or a bare hostname)"


class DiscoveryOutputError(ValueError):
    """A discovery script printed something Horovod would misread; the message names the line."""


def parse_discovery_output(text: str, default_slots: int = 1) -> dict[str, int]:
    """Read what a discovery script printed, as Horovod does, refusing what it would misread.

    Each non-blank line is ``hostname:slots`` or a bare ``hostname`` (which gets
    ``default_slots``, Horovod's ``--slots-per-host``); blank output means "no hosts right now".
    Horovod itself turns ``hello world`` into a host named ``hello world`` (and later an ssh
    command line) and dies on ``localhost:lots`` with a traceback; here either is a
    ``DiscoveryOutputError`` naming the line and what a good one looks like. A host listed twice
    is refused too (Horovod would keep an arbitrary one of its lines).
    """
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        host, colon, slots = line.partition(":")
        try:
            validate_hostname(host)
            count = parse_slots(slots.strip()) if colon else default_slots
        except ValueError as e:
            raise DiscoveryOutputError(
                f"line {number} {_show(line)} is not a host: {e}; expected {GOOD_LINE}"
            ) from None
        if host in hosts:
            raise DiscoveryOutputError(
                f"line {number} {_show(line)} lists host {host!r} a second time; expected "
                f"{GOOD_LINE}"
            )
        hosts[host] = count
    return hosts


def _show(line: str) -> str:
    return repr(line if len(line) <= 80 else line[:77] + "...")
