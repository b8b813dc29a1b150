"""The shared ``main()`` of every discovery script: options, time budget, errors, cache, output.

Each script module only declares its options and a ``discover(ctx) -> {host: slots}``
function; everything a script must do the same way lives here, once:

* parse flags and their environment variables (``options.EnvOptions``);
* run ``discover`` under a ``watchdog.Deadline`` so the process answers in time;
* validate and print the answer (``output.format_hosts``), then refresh the cache;
* turn every failure into one stderr line and an exit status, never a traceback:
  2 for bad input or configuration (``DiscoveryError``), 1 for an unreachable source
  (``TransientDiscoveryError`` / deadline) unless a recent cached answer can be printed
  instead, in which case that answer goes to stdout, a note to stderr, and the status is 0.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from hvd_resilient import errors

from .cache import DEFAULT_MAX_AGE_S, AnswerCache
from .errors import (
    EXIT_INVALID,
    EXIT_TRANSIENT,
    DeadlineExceeded,
    DiscoveryError,
    TransientDiscoveryError,
)
from .options import EnvOptions, nonnegative_float, positive_float
from .output import HostSlots, format_hosts
from .watchdog import DEFAULT_DEADLINE_S, Deadline

_RUNNER_OPTIONS = ("deadline", "cache", "cache_max_age")
_MAX_MESSAGE = 1000


@dataclass
class Context:
    """What ``discover`` gets: parsed options, the time budget, the environment."""

    name: str
    args: argparse.Namespace
    deadline: Deadline
    environ: Mapping[str, str]
    notes: list[str] = field(default_factory=list)

    def note(self, message: str) -> None:
        """A line for stderr, printed after the answer (stdout stays machine-readable)."""
        self.notes.append(message)


@dataclass(frozen=True)
class Script:
    """Declaration of one discovery script."""

    name: str
    description: str
    add_options: Callable[[EnvOptions], None]
    discover: Callable[[Context], HostSlots]
    #: False for scripts that wrap another discovery command (it keeps its own cache).
    use_cache: bool = True
    #: Environment inputs that shape the answer besides the options (for the cache key).
    cache_inputs: Callable[[Mapping[str, str]], Mapping[str, object]] | None = None
    default_deadline: float = DEFAULT_DEADLINE_S
    #: Usage line for ``--help`` when argparse's own would mislead.
    usage: str | None = None


def one_line(message: object) -> str:
    """`errors.one_line` at the discovery's bound (Horovod logs stderr line by line)."""
    return errors.one_line(str(message), limit=_MAX_MESSAGE)


def _add_common_options(opts: EnvOptions, script: Script) -> None:
    opts.add("--deadline", env="HVD_RESILIENT_DISCOVERY_DEADLINE", type=positive_float,
             default=script.default_deadline, metavar="SECONDS",
             help=f"give up after this long (default {script.default_deadline:g})")
    if script.use_cache:
        opts.add("--cache", env="HVD_RESILIENT_DISCOVERY_CACHE", metavar="FILE",
                 help="file holding the last good answer (default: a private file under "
                      "$XDG_RUNTIME_DIR or /tmp, keyed by script and options)")
        opts.add("--cache-max-age", env="HVD_RESILIENT_DISCOVERY_CACHE_MAX_AGE",
                 type=nonnegative_float, default=DEFAULT_MAX_AGE_S, metavar="SECONDS",
                 help="oldest cached answer that may stand in for a transient failure; "
                      f"0 disables the fallback (default {DEFAULT_MAX_AGE_S:g})")


def _out(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _say(line: str) -> None:
    """One line on stderr; a closed stderr must not turn into a traceback."""
    try:
        sys.stderr.write(one_line(line) + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def run(script: Script, argv: list[str] | None = None,
        environ: Mapping[str, str] | None = None, *, hard_exit: bool | None = None,
        extra: Mapping[str, object] | None = None) -> int:
    """Run ``script`` and return its exit status (see the module docstring).

    ``argv=None`` means "this process's own command line"; only then (unless ``hard_exit``
    says otherwise) may the hard watchdog end the process, which must never happen to a
    test runner calling ``main([...])`` in-process.  ``extra`` is set on the parsed
    options as is (health-filter's wrapped command, which argparse must not see).
    """
    if hard_exit is None:
        hard_exit = argv is None
    if argv is None:
        argv = sys.argv[1:]
    if environ is None:
        environ = os.environ
    armed: list[Deadline] = []
    try:
        try:
            return _run(script, argv, environ, hard_exit, extra or {}, armed)
        finally:
            for deadline in armed:
                deadline.disarm()
    except DeadlineExceeded as exc:  # the alarm went off inside an error handler below
        _say(f"{script.name}: {exc}")
        return EXIT_TRANSIENT


def _run(script: Script, argv: list[str], environ: Mapping[str, str], hard_exit: bool,
         extra: Mapping[str, object], armed: list[Deadline]) -> int:
    def disarm() -> None:
        for deadline in armed:
            deadline.disarm()

    try:
        try:
            opts = EnvOptions(script.name, script.description, environ, script.usage)
            script.add_options(opts)
            _add_common_options(opts, script)
            args = opts.parser.parse_args(argv)
            for key, value in extra.items():
                setattr(args, key, value)
        except SystemExit as exc:  # --help
            return int(exc.code or 0)
        deadline = Deadline(args.deadline, name=script.name)
        armed.append(deadline)
        deadline.arm(hard_exit=hard_exit)
        ctx = Context(script.name, args, deadline, environ)
        cache = _cache_for(script, args, environ) if script.use_cache else None
        try:
            hosts = script.discover(ctx)
            text = format_hosts(hosts)
            if cache is not None:
                cache.store(hosts)
        except (TransientDiscoveryError, DeadlineExceeded) as exc:
            disarm()
            return _fallback(script.name, exc, cache, args)
        disarm()
        _out(text)
        for note in ctx.notes:
            _say(f"{script.name}: {note}")
        return 0
    except DiscoveryError as exc:
        disarm()
        _say(f"{script.name}: {exc}")
        return EXIT_INVALID
    except (TransientDiscoveryError, DeadlineExceeded) as exc:
        disarm()
        _say(f"{script.name}: {exc}")
        return EXIT_TRANSIENT
    except KeyboardInterrupt:
        disarm()
        return 130
    except BrokenPipeError:  # nobody reads our stdout any more
        disarm()
        return EXIT_TRANSIENT
    except Exception as exc:  # the contract is one line on stderr, never a traceback
        disarm()
        _say(f"{script.name}: internal error: {type(exc).__name__}: {exc} "
             "(please report this)")
        return EXIT_TRANSIENT


def _cache_for(script: Script, args: argparse.Namespace,
               environ: Mapping[str, str]) -> AnswerCache:
    material: dict[str, object] = {
        k: v for k, v in sorted(vars(args).items()) if k not in _RUNNER_OPTIONS
    }
    if script.cache_inputs is not None:
        material["inputs"] = dict(script.cache_inputs(environ))
    return AnswerCache.for_script(script.name, material, environ, explicit_path=args.cache)


def _fallback(name: str, exc: BaseException, cache: AnswerCache | None,
              args: argparse.Namespace) -> int:
    reason = one_line(exc)
    loaded = cache.load(args.cache_max_age) if cache is not None else None
    if loaded is None:
        why = f" ({cache.unusable})" if cache is not None and cache.unusable else ""
        _say(f"{name}: {reason}{why}")
        return EXIT_TRANSIENT
    assert cache is not None
    hosts, age = loaded
    _out(format_hosts(hosts))
    _say(f"{name}: {reason}; printed the last good answer from {age:.0f} s ago "
         f"({cache.path})")
    return 0
