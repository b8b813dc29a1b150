"""Every option of `hvd-resilient run`, as one schema: `--launcher`, the options every launcher
is handed (`RunOptions`) and each launcher's own section (`launch/launchers/`), their flags
named as they always were (`Schema(prefix_sections=False)`).

An option of a launcher that was not chosen is refused, with one line that says whose it is
and what to do, where it used to be ignored without a word (`--nnodes` under Horovod,
`--warm-pool` under torchrun): only options the user set, as a flag or in the config file,
never a default.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hvd_resilient.config import doc_values
from hvd_resilient.errors import ConfigError
from hvd_resilient.launch.launchers import LAUNCHERS, Launcher, owners
from hvd_resilient.launch.launchers.horovod import HorovodOptions
from hvd_resilient.launch.launchers.inplace import InplaceOptions
from hvd_resilient.launch.launchers.mpi import MpiOptions
from hvd_resilient.launch.launchers.torchrun import TorchrunOptions
from hvd_resilient.launch.run_options import RunOptions
from hvd_resilient.settings import Schema, Setting, setting


@dataclass(kw_only=True)
class RunSettings:
    """What `hvd-resilient run` was given: which launcher, the options every launcher is
    handed, and each launcher's section (only the chosen one's is used)."""

    launcher: str = setting(next(iter(LAUNCHERS)), choices=tuple(LAUNCHERS))
    """What starts the workers, and so the collective backend they train on: horovod (Horovod
    Elastic with --discovery, else static horovodrun), mpi (mpirun), torchrun, or inplace
    (torch.distributed, survivors keep their processes; one agent per host)."""
    run: RunOptions = field(default_factory=RunOptions)
    horovod: HorovodOptions = field(default_factory=HorovodOptions)
    mpi: MpiOptions = field(default_factory=MpiOptions)
    torchrun: TorchrunOptions = field(default_factory=TorchrunOptions)
    inplace: InplaceOptions = field(default_factory=InplaceOptions)

    def chosen(self) -> Launcher:
        """The chosen launcher, holding its own section (the field named as it is)."""
        cls = LAUNCHERS[self.launcher]
        return cls(getattr(self, cls.name))


RUN = Schema("run", RunSettings,
             {"run": RunOptions, **{name: cls.options for name, cls in LAUNCHERS.items()}},
             doc_values=doc_values, prefix_sections=False)
"""Every option of `hvd-resilient run`: its flag, its file key, its default."""

TITLES = {"": "launcher", "run": "the run",
          **{name: f"--launcher {name} only" for name in LAUNCHERS}}
"""The groups of `hvd-resilient run --help`."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per option, grouped by the launcher that takes it; each default None (a flag
    not given overrides nothing, and counts as not set)."""
    RUN.add_arguments(parser, TITLES)


def _shown(st: Setting, value: Any) -> str:
    """The flag as given: `--no-slot-hosts` for a switch turned off."""
    return f"--no-{st.flag[2:]}" if st.type == "bool" and value is False else st.flag


def refuse_foreign(launcher: str, flags: Mapping[str, Any], file: Mapping[str, Any],
                   file_name: str = "") -> None:
    """ConfigError, one line, for the first option (in their declared order) that the user set
    and ``launcher`` does not take: named as the flag given (``flags``), else as the key of
    the config file ``file_name`` (``file``); flat names -> values as read, defaults absent."""
    for st in RUN.settings:
        own = owners(st.name)
        if not own or launcher in own or (st.name not in flags and st.name not in file):
            continue
        where = (_shown(st, flags[st.name]) if st.name in flags
                 else f"config file {file_name}: {st.name}")
        named = " or ".join(own)
        raise ConfigError(f"run: {where} applies to --launcher {named} only; drop it or "
                          f"choose {named}")


def tables() -> str:
    """The tables of docs/configuration.md: `--launcher` and the options every launcher takes,
    then each launcher's own (the Horovod driver's switches with the variable the driver
    reads them from)."""
    from hvd_resilient.launch.horovod.options import DRIVER

    driver = {st.name: st.env for st in DRIVER.settings}

    def describe(st: Setting) -> str:
        if st.name in driver:
            return f"{st.doc} The driver reads it from `{driver[st.name]}`."
        return st.doc

    every = RUN.table("").splitlines() + RUN.table("run").splitlines()[2:]  # one header
    out = ["\n".join(every)]
    for name in LAUNCHERS:
        if any(st.section == name for st in RUN.settings):
            out += ["", f"#### `--launcher {name}` only", "", RUN.table(name, describe)]
    return "\n".join(out)
