"""Command-line options that can also come from the environment.

Every option of every discovery script has an environment variable (named in ``--help``),
because the natural way to configure a script that ``horovodrun`` calls every second is the
environment it inherits from ``horovodrun``.  Precedence: flag, then variable, then default.

argparse is told to raise instead of printing usage and exiting, so that a bad flag or a
bad variable becomes the same single stderr line and exit status 2 as any other bad input.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from .errors import DiscoveryError
from .validate import parse_slots

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def positive_int(text: str) -> int:
    """argparse type for slot counts and ports; same strictness as ``parse_slots``."""
    try:
        return parse_slots(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None


def port_number(text: str) -> int:
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port 1..65535, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise DiscoveryError(f"{message} (see --help)")


class EnvOptions:
    """An ``ArgumentParser`` whose options each read a default from one environment variable."""

    def __init__(self, prog: str, description: str, environ: Mapping[str, str],
                 usage: str | None = None) -> None:
        self.environ = environ
        self.parser = _RaisingParser(
            prog=prog, description=description, usage=usage, allow_abbrev=False,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    def _from_env(self, env: str, convert: Callable[[str], Any],
                  choices: list[str] | None) -> Any:
        raw = self.environ.get(env, "")
        if raw == "":
            return None
        try:
            value = convert(raw)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            raise DiscoveryError(f"environment variable {env}={raw!r}: {exc}") from None
        if choices is not None and value not in choices:
            raise DiscoveryError(
                f"environment variable {env}={raw!r}: choose from {', '.join(choices)}")
        return value

    def add(self, *flags: str, env: str, help: str, type: Callable[[str], Any] = str,
            default: Any = None, choices: list[str] | None = None,
            metavar: str | None = None, dest: str | None = None) -> None:
        """An option with a value; ``default`` applies when neither flag nor variable is set."""
        from_env = self._from_env(env, type, choices)
        kwargs: dict[str, Any] = {
            "type": type, "default": default if from_env is None else from_env,
            "choices": choices, "metavar": metavar,
            "help": f"{help} [env {env}]",
        }
        if dest:
            kwargs["dest"] = dest
        self.parser.add_argument(*flags, **kwargs)

    def add_flag(self, *flags: str, env: str, help: str, dest: str | None = None) -> None:
        """A boolean switch; the variable accepts 1/0, true/false, yes/no, on/off."""
        def as_bool(text: str) -> bool:
            low = text.strip().lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError("expected 1/0, true/false, yes/no or on/off")

        from_env = self._from_env(env, as_bool, None)
        kwargs: dict[str, Any] = {"action": "store_true", "default": bool(from_env),
                                  "help": f"{help} [env {env}]"}
        if dest:
            kwargs["dest"] = dest
        self.parser.add_argument(*flags, **kwargs)
