"""Settings as users meet them: each one a field of a dataclass, whose docstring is its help
text, with one flag, one config-file key and, for a command that reads them, one environment
variable.

`TrainConfig` (config.py), `hvd-resilient run` (launch/run_settings.py) and the Horovod
driver's switches (launch/horovod/options.py) declare theirs as dataclasses and get everything
else from here, so that they cannot drift apart: the flags, the merge of file < environment <
flags, the coercion of each value (a bad one stops with one line naming where it came from),
the refusal of unknown keys with the closest known one, and the reference tables of
docs/configuration.md. A setting has one name (no release shipped with another).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from hvd_resilient.errors import ConfigError

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def setting(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
            choices: tuple[str, ...] = (),
            metavar: str | tuple[str, ...] | None = None, positional: bool = False,
            env: str | None = None) -> Any:
    """A dataclass field with what its flag needs beyond name, type and default: argparse's
    choices and metavar, or a positional place (the training command of `hvd-resilient run`).
    ``env``: its environment variable where that is not `<prefix><NAME>` (a switch whose variable is
    older than its flag: the flag's name was taken)."""
    meta = {"choices": choices, "metavar": metavar,
            "positional": positional, "env": env}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class Setting:
    """One setting as a user meets it: its flag, its environment variable, its default."""

    name: str
    """Flat name: the field, or `<section>_<field>`; the file key, and with dashes the flag."""
    section: str
    field: str
    type: str
    default: Any
    doc: str
    env_prefix: str | None = None
    """None: this command reads no environment variables."""
    choices: tuple[str, ...] = ()
    metavar: str | tuple[str, ...] | None = None
    positional: bool = False
    env_name: str | None = None
    """Its environment variable, where it is not `<prefix><NAME>`."""

    @property
    def flag(self) -> str:
        return _flag(self.name)

    @property
    def env(self) -> str | None:
        if self.env_prefix is None:
            return None
        return self.env_name or self.env_prefix + self.name.upper()


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class Schema:
    """The settings of one command: a dataclass, and the dataclasses of its sections (a
    section's settings are named `<section>_<field>` in flags, files and the environment,
    and `section: {field: ...}` in a file too; with ``prefix_sections=False`` by their
    field names alone, which must then differ across sections).

    Args:
        what: the first word of every message (`config`, `run`).
        top: the dataclass; its fields named in ``sections`` hold those sections.
        sections: section name -> its dataclass.
        env_prefix: `HVD_RESILIENT_`: every setting is read from `<prefix><NAME>` too; None:
            from files and flags only.
        doc_values: ``{name}`` in a field's docstring -> what replaces it (asked for when the
            docs are first needed, so that what they name is imported only then).
        prefix_sections: False: a section's settings keep their field names (`hvd-resilient
            run`: each launcher's options are a section, and its flags are the ones users
            know).
    """

    def __init__(self, what: str, top: type, sections: Mapping[str, type] | None = None, *,
                 env_prefix: str | None = None,
                 doc_values: Callable[[], Mapping[str, str]] | None = None,
                 prefix_sections: bool = True) -> None:
        self.what = what
        self.top = top
        self.sections = dict(sections or {})
        self.prefix_sections = prefix_sections
        self.env_prefix = env_prefix
        self._doc_values = doc_values
        self._settings: list[Setting] | None = None

    # -- what there is -------------------------------------------------------------------
    @property
    def settings(self) -> list[Setting]:
        """Every setting, in declaration order (built on first use: the docs come from the
        source)."""
        if self._settings is None:
            values = dict(self._doc_values()) if self._doc_values else {}
            out: list[Setting] = []
            for cls, section in [(self.top, ""), *((c, n) for n, c in self.sections.items())]:
                docs = docs_from_source(cls)
                for f in fields(cls):
                    if section == "" and f.name in self.sections:
                        continue
                    doc = docs.get(f.name, "")
                    for k, v in values.items():
                        doc = doc.replace("{" + k + "}", v)
                    out.append(self._setting(f, section, doc))
            names = [st.name for st in out]
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise TypeError(f"{self.what}: settings named twice: {', '.join(twice)}")
            self._settings = out
        return self._settings

    def _setting(self, f: dataclasses.Field[Any], section: str, doc: str) -> Setting:
        meta = f.metadata
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        name = f"{section}_{f.name}" if section and self.prefix_sections else f.name
        return Setting(name, section, f.name,
                       f.type if isinstance(f.type, str) else f.type.__name__, default, doc,
                       env_prefix=self.env_prefix, choices=tuple(meta.get("choices", ())),
                       metavar=meta.get("metavar"),
                       positional=bool(meta.get("positional", False)),
                       env_name=meta.get("env"))

    def by_name(self) -> dict[str, Setting]:
        """Flat names -> the setting."""
        return {st.name: st for st in self.settings}

    def names(self) -> set[str]:
        return {st.name for st in self.settings}

    # -- sources -------------------------------------------------------------------------
    def add_arguments(self, parser: argparse.ArgumentParser,
                      titles: Mapping[str, str] | None = None) -> None:
        """One flag per setting; defaults are None, so that a flag not given overrides
        nothing. ``titles``: section -> argument group title ("" the top level); none: every
        flag in the parser itself."""
        groups: dict[str, Any] = {}
        for st in self.settings:
            if titles is None:
                group = parser
            else:
                if st.section not in groups:
                    groups[st.section] = parser.add_argument_group(titles.get(st.section))
                group = groups[st.section]
            doc = st.doc if st.default is None or st.positional or "(default" in st.doc else \
                f"{st.doc} (default: {_shown(st.default)})"
            if st.positional:
                group.add_argument(st.name, nargs=argparse.REMAINDER, help=doc)
                continue
            flags = [st.flag]
            kw: dict[str, Any] = {"dest": st.name, "default": None, "help": doc}
            if st.type == "bool":
                kw["action"] = argparse.BooleanOptionalAction
            else:
                if st.choices:
                    kw["choices"] = st.choices
                if st.metavar is not None:
                    kw["metavar"] = st.metavar
                if st.type.startswith("tuple["):
                    kw["nargs"] = st.type.count(",") + 1
            group.add_argument(*flags, **kw)

    def read(self, *, file: str | None = None, env: Mapping[str, str] | None = None,
             args: argparse.Namespace | None = None,
             overrides: Mapping[str, Any] | None = None,
             file_values: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Flat name -> value, coerced to its type, for every setting some source sets:
        file (``file``, or ``file_values`` already loaded) < environment < flags (``args``)
        < ``overrides``. A None value sets nothing.

        Raises:
            ConfigError: an unknown key in a file or in the overrides, or a value that is not
                of its setting's type (one line naming the key and where it came from).
        """
        values: dict[str, Any] = {}
        if file and file_values is None:
            file_values = load_file(file, self.what)
        if file_values:
            self._take(values, flatten(file_values, self.sections, self.prefix_sections),
                       f"config file {file}: " if file else "", "")
        if env is not None and self.env_prefix is not None:
            self._take_env(values, env)
        if args is not None:
            given = {st.name: getattr(args, st.name) for st in self.settings
                     if getattr(args, st.name, None) not in (None, [])}  # [] no `-- cmd`
            self._take(values, given, "", "flag")
        if overrides:
            self._take(values, flatten(overrides, self.sections, self.prefix_sections), "", "")
        return values

    def _take(self, values: dict[str, Any], raw: Mapping[str, Any], where: str,
              source: str) -> None:
        known = self.by_name()
        refuse_unknown(raw, set(known), f"{self.what}: {where}".rstrip(": "),
                       shown=self.names())
        for key in raw:
            if raw[key] is None:
                continue
            st = known[key]
            hint = f" ({_flag(key)})" if source == "flag" else ""
            values[st.name] = self.coerce(st, raw[key], f"{where}{key}", hint)

    def _take_env(self, values: dict[str, Any], env: Mapping[str, str]) -> None:
        for st in self.settings:
            if st.env is not None and st.env in env:
                values[st.name] = self.coerce(st, env[st.env], st.name, f" (from {st.env})")

    def coerce(self, st: Setting, value: Any, key: str, hint: str = "") -> Any:
        """``value`` as ``st``'s type; ConfigError `<what>: <key> must be ..., got ...`."""
        try:
            return coerce(st, value)
        except ValueError as e:
            raise ConfigError(f"{self.what}: {key} {e}, got {value!r}{hint}") from None

    # -- the object ----------------------------------------------------------------------
    def build(self, values: Mapping[str, Any], **extra: Any) -> Any:
        """The dataclass (and its sections) from flat values; their checks run there."""
        known = {st.name: st for st in self.settings}
        top: dict[str, Any] = dict(extra)
        parts: dict[str, dict[str, Any]] = {section: {} for section in self.sections}
        for name, v in values.items():
            st = known[name]
            (parts[st.section] if st.section else top)[st.field] = v
        return self.top(**top, **{s: self.sections[s](**kw) for s, kw in parts.items()})

    # -- the reference page --------------------------------------------------------------
    def table(self, section: str = "",
              describe: Callable[[Setting], str] | None = None) -> str:
        """The markdown table of one section's settings, as docs/configuration.md shows
        it (generated by `python -m hvd_resilient.reference`)."""
        env = self.env_prefix is not None
        head = "| field | flag |" + (" environment |" if env else "") + " default | what it does |"
        rows = [head, "|" + " --- |" * (5 if env else 4)]
        for st in self.settings:
            if st.section != section:
                continue
            flag = "after `--`" if st.positional else f"`{st.flag}`"
            if st.type == "bool":
                flag += f" / `--no-{st.flag[2:]}`"
            doc = describe(st) if describe else st.doc
            cells = [f"`{st.name}`", flag, *([f"`{st.env}`"] if env else []),
                     f"`{st.default!r}`", doc.replace("|", "\\|")]
            rows.append("| " + " | ".join(cells) + " |")
        return "\n".join(rows)


def _shown(default: Any) -> str:
    return repr(default) if not isinstance(default, tuple) else " ".join(map(str, default))


def flatten(values: Mapping[str, Any], sections: Mapping[str, type],
            prefix: bool = True) -> dict[str, Any]:
    """`store: {sse: AES256}` -> `store_sse: AES256` (a section given as an object too;
    ``prefix`` False: `sse: AES256`); dashes in keys read as underscores, as in the flags."""
    out: dict[str, Any] = {}
    for key, v in values.items():
        key = str(key).replace("-", "_")
        if key in sections and dataclasses.is_dataclass(v):
            v = dataclasses.asdict(v)  # type: ignore[arg-type]
        if key in sections and isinstance(v, Mapping):
            head = f"{key}_" if prefix else ""
            out.update({f"{head}{str(k).replace('-', '_')}": x for k, x in v.items()})
        else:
            out[key] = v
    return out


def coerce(st: Setting, value: Any) -> Any:
    """``value`` as the setting's type, from a file's value, an environment string or a
    flag's words; ValueError says what it must be (`must be a whole number`)."""
    t = st.type
    if t.endswith(" | None"):
        if value is None:
            return None
        t = t[: -len(" | None")]
    if t.startswith("tuple["):
        n = t.count(",") + 1
        if isinstance(value, str):
            value = value.split()
        if not isinstance(value, (list, tuple)) or len(value) != n:
            raise ValueError(f"must be a list of {_count(n)} numbers")
        return tuple(_whole(v) for v in value)
    if t == "list[str]":
        if isinstance(value, str):
            return shlex.split(value)
        if not isinstance(value, (list, tuple)) or not all(
                isinstance(v, (str, int, float)) for v in value):
            raise ValueError("must be a list of words or one string")
        return [str(v) for v in value]
    if t == "bool":
        if isinstance(value, bool):
            return value
        s = str(value).strip().lower()
        if s in TRUE:
            return True
        if s in FALSE:
            return False
        raise ValueError("must be true or false")
    if t == "int":
        return _whole(value)
    if t == "float":
        if isinstance(value, bool):
            raise ValueError("must be a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError("must be a number") from None
    if isinstance(value, (dict, list, tuple, bool)) or value is None:
        raise ValueError("must be a string")
    s = str(value)
    if st.choices and s not in st.choices:
        raise ValueError(f"must be one of {', '.join(st.choices)}")
    return s


def _whole(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("must be a whole number")
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        raise ValueError("must be a whole number")
    if isinstance(value, int):
        return value
    s = str(value).strip()
    if isinstance(value, str) and s.lstrip("+-").isdigit():
        return int(s)
    raise ValueError("must be a whole number")


def _count(n: int) -> str:
    return {2: "two", 3: "three"}.get(n, str(n))


def refuse_unknown(values: Mapping[str, Any], known: set[str] | frozenset[str], what: str,
                   *, shown: set[str] | None = None) -> None:
    """One line naming each unknown key and the closest known one (a typo never passes
    silently: `max_restart: 0` would otherwise leave the default in force). ``shown``: the
    names to list as known (default: all of ``known``)."""
    unknown = sorted(set(values) - set(known))
    if not unknown:
        return
    parts = []
    for key in unknown:
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
        parts.append(f"{key} (did you mean {close[0]}?)" if close else key)
    listed = sorted(shown if shown is not None else known)
    raise ConfigError(f"{what}: unknown field{'s' if len(unknown) > 1 else ''} "
                      f"{', '.join(parts)}; known: {', '.join(listed)}")


def load_file(path: str, what: str = "config") -> dict[str, Any]:
    """A YAML (.yaml/.yml) or JSON file holding a mapping; keys as written (dashes become
    underscores). Raises ConfigError (one line) for a file that cannot be read or parsed."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"{what}: cannot read config file {path}: {e.strerror}") from None
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # yaml and json raise different types; both mean "fix the file"
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{what}: {path} is not valid {p.suffix or 'JSON'}: {first}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: {path} must hold a mapping of field: value")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def docs_from_source(cls: type) -> dict[str, str]:
    """Field docstrings (the string under each field) become the --help texts; a field a
    dataclass inherits keeps its base's (a subclass that declares it again, its own)."""
    import ast
    import inspect

    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):  # object has no fields
        try:
            tree = ast.parse(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for a, b in zip(body, body[1:], strict=False):
            if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
                    and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)):
                out[a.target.id] = " ".join(str(b.value.value).split())
    return out
