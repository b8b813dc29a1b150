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
