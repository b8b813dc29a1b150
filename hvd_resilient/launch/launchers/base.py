"""What a launcher is to `hvd-resilient run`: the `Launcher` protocol.

`hvd-resilient run` knows no launcher by its name. It reads its options, takes the launcher
`--launcher` names from the registry (`launchers/__init__.py`), hands it its own section of the
options, and asks it everything that differs between launchers: what it refuses, what it
probes before the launch, its command line and environment, whether a warm pool serves its
workers, and how a signal to `hvd-resilient run` reaches them. Everything else (the lease, the
checkpoint store, the supervisor's relaunches) is the same for every launcher.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

from hvd_resilient.launch.run_options import RunOptions


class Launcher(Protocol):
    """One way to start the workers, holding its own section of the options (`own`)."""

    name: ClassVar[str]
    """Its `--launcher` value, and the name of its section."""
    options: ClassVar[type]
    """The dataclass of the options only it takes, its section: their flags, file keys and
    docs come from it as every run option's do. An option of another launcher's section, given
    as a flag or in the config file, is refused (`run_settings.refuse_foreign`)."""
    shared: ClassVar[frozenset[str]]
    """The options of `RunOptions` that only some launchers take (--hosts, --min-np, ...) that
    this one takes; the rest of `RunOptions` every launcher takes."""
    stop_signal: ClassVar[signal.Signals | None]
    """What the first SIGTERM or SIGINT to `hvd-resilient run` reaches the launcher as (None:
    as it came), so that the workers stop at a final checkpoint rather than being killed."""
    signal_group: ClassVar[bool]
    """A signal to `hvd-resilient run` goes to the launcher's whole process group (True), or to
    the launcher process alone, which then ends its workers itself."""

    def __init__(self, own: Any) -> None: ...

    def check(self, opts: RunOptions) -> None:
        """Refuses (ConfigError, one line) what this launcher cannot run, before anything
        starts: values of its section, and of `opts` as it uses them."""
        ...

    def probe(self, opts: RunOptions) -> None:
        """Checks that touch the world (a discovery script's first answer, ssh to the hosts),
        after `--dry-run` has printed and before the launch: LaunchError, one line."""
        ...

    def command(self, opts: RunOptions, env_names: list[str]) -> list[str]:
        """The launcher's command line; ``env_names``: the variables every worker must get
        (those of the supervisor's environment the launch forwards)."""
        ...

    def environment(self, opts: RunOptions) -> dict[str, str]:
        """Variables the launcher is started with beyond the supervisor's own."""
        ...

    def wants_warm_pool(self, opts: RunOptions, env: Mapping[str, str]) -> bool:
        """Whether `hvd-resilient run` holds a warm pool on this machine across launches for
        it (`launch/warm/pool_server.hold`); ``env``: the launch's environment."""
        ...

    def lease_group(self, opts: RunOptions) -> str | None:
        """The name under which the supervisors of one job share the run's lease (one per node
        of a multi-node torchrun job); None: this supervisor holds it alone."""
        ...
