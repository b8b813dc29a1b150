"""``discovery/hostfile``: the hosts listed in a file that operators edit while the job runs.

Accepted lines (``#`` starts a comment; blank lines are skipped)::

    node1:4               # host:slots, what horovodrun itself prints
    node2 slots=4         # Open MPI hostfile style
    node3 slots=2 max_slots=8   # max_slots / max-slots accepted and ignored
    node4                 # bare host: --default-slots (default 1)

Duplicate hosts: slots are summed by default (``--on-duplicate sum``).  That is what Open
MPI does with a repeated host and what MPICH-style machinefiles mean by listing a host once
per process (``node1`` four times = 4 slots), so existing files keep their meaning.
``--on-duplicate error`` refuses them instead, for teams that prefer a typo to fail loudly.

A file without any host is refused rather than printed as "no hosts": an editor that
truncates the file before writing it can be read in between, and Horovod would then drop
every worker.  Edit by writing a new file and renaming it over the old one (``mv``,
``sed -i``, ``vim`` with its default ``backupcopy``) so readers only ever see whole files.
"""

from __future__ import annotations

import os
import re

from .errors import DiscoveryError, TransientDiscoveryError
from .options import EnvOptions, positive_int
from .output import HostSlots
from .runner import Context, Script, run
from .validate import parse_slots, validate_hostname

ON_DUPLICATE = ("sum", "error")
_MAX_BYTES = 4 << 20
_KEY_VALUE_SPACES = re.compile(r"\s*=\s*")
_IGNORED_KEYS = ("max_slots", "max-slots")


def parse_hostfile(text: str, *, default_slots: int = 1, on_duplicate: str = "sum",
                   source: str = "<hostfile>") -> HostSlots:
    """Parse hostfile ``text`` into ``{host: slots}``.

    Raises:
        DiscoveryError: naming the line, what is wrong with it and the file (``source``).
    """
    if on_duplicate not in ON_DUPLICATE:
        raise ValueError(f"on_duplicate must be one of {ON_DUPLICATE}")
    hosts: HostSlots = {}
    first_line: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            host, slots = _parse_line(line, default_slots)
        except ValueError as exc:
            raise DiscoveryError(f"line {number}: {exc} ({source})") from None
        if host in hosts:
            if on_duplicate == "error":
                raise DiscoveryError(
                    f"line {number}: host {host!r} already listed on line {first_line[host]}; "
                    f"merge the lines or use --on-duplicate sum ({source})")
            hosts[host] += slots
        else:
            hosts[host] = slots
            first_line[host] = number
    if not hosts:
        raise DiscoveryError(
            f"no hosts listed ({source}); if the file is being rewritten, write a new file "
            "and rename it over this one")
    return hosts


def _parse_line(line: str, default_slots: int) -> tuple[str, int]:
    tokens = _KEY_VALUE_SPACES.sub("=", line).split()
    first, rest = tokens[0], tokens[1:]
    if ":" in first:
        host, _, slot_text = first.rpartition(":")
        if rest:
            raise ValueError(f"unexpected {rest[0]!r} after {first!r}; "
                             "write either 'host:slots' or 'host slots=N'")
        if not host:
            raise ValueError(f"missing hostname before ':' in {first!r}")
        validate_hostname(host)
        return host, parse_slots(slot_text)
    host = validate_hostname(first)
    slots = default_slots
    seen_slots = False
    for token in rest:
        key, eq, value = token.partition("=")
        if not eq:
            raise ValueError(f"unexpected {token!r} after host {host!r}; "
                             f"write '{host}:N' or '{host} slots=N'")
        if key == "slots":
            if seen_slots:
                raise ValueError("slots= given twice")
            slots = parse_slots(value)
            seen_slots = True
        elif key in _IGNORED_KEYS:
            parse_slots(value)  # ignored, but a malformed value still means a confused file
        else:
            raise ValueError(f"unknown key {key!r} (known: slots, max_slots)")
    return host, slots


def read_hostfile(path: str, *, default_slots: int = 1, on_duplicate: str = "sum",
                  attempts: int = 3) -> HostSlots:
    """Read and parse ``path``, re-reading if the file changed while it was being read.

    A missing or unreadable file is a configuration error (the path is wrong); an I/O error
    such as a stale NFS handle is transient.
    """
    text = ""
    for _ in range(attempts):
        try:
            before = os.stat(path)
            with open(path, "rb") as fh:
                data = fh.read(_MAX_BYTES + 1)
            after = os.stat(path)
        except FileNotFoundError:
            raise DiscoveryError(f"hostfile {path} does not exist; pass its path as the "
                                 "argument or in HVD_RESILIENT_HOSTFILE") from None
        except (PermissionError, IsADirectoryError) as exc:
            raise DiscoveryError(f"cannot read hostfile {path}: {exc.strerror}") from None
        except OSError as exc:
            raise TransientDiscoveryError(f"cannot read hostfile {path}: {exc.strerror or exc}"
                                          ) from None
        if len(data) > _MAX_BYTES:
            raise DiscoveryError(f"hostfile {path} is larger than {_MAX_BYTES} bytes")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DiscoveryError(f"hostfile {path} is not UTF-8 text (byte {exc.start})"
                                 ) from None
        stable = (before.st_ino, before.st_size, before.st_mtime_ns) == (
            after.st_ino, after.st_size, after.st_mtime_ns)
        if stable:
            break
    else:
        raise TransientDiscoveryError(f"hostfile {path} kept changing while being read")
    return parse_hostfile(text, default_slots=default_slots, on_duplicate=on_duplicate,
                          source=path)


def _add_options(opts: EnvOptions) -> None:
    opts.parser.add_argument(
        "path", nargs="?", default=opts.environ.get("HVD_RESILIENT_HOSTFILE") or None,
        help="hostfile to read [env HVD_RESILIENT_HOSTFILE]")
    opts.add("--default-slots", env="HVD_RESILIENT_HOSTFILE_DEFAULT_SLOTS", type=positive_int,
             default=1, metavar="N", help="slots of a line that names only a host (default 1)")
    opts.add("--on-duplicate", env="HVD_RESILIENT_HOSTFILE_ON_DUPLICATE",
             choices=list(ON_DUPLICATE), default="sum",
             help="a host listed twice: add its slots, or refuse the file (default sum)")


def _discover(ctx: Context) -> HostSlots:
    path = ctx.args.path
    if not path:
        raise DiscoveryError("no hostfile given; pass its path or set HVD_RESILIENT_HOSTFILE")
    return read_hostfile(path, default_slots=ctx.args.default_slots,
                         on_duplicate=ctx.args.on_duplicate)


SCRIPT = Script(name="hostfile", description=__doc__ or "", add_options=_add_options,
                discover=_discover)


def main(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> int:
    """Entry point of ``discovery/hostfile``; returns the exit status."""
    return run(SCRIPT, argv, environ)
