"""The options of `hvd-resilient run` that every launcher is handed, declared once: their
flags, their config-file keys (`--config run.yaml`, the same names without dashes), their
--help and their table in docs/configuration.md all come from `RunOptions` through
`hvd_resilient.settings`, the machinery `TrainConfig` uses. Defaults < config file < flags; no
environment variables (the HVD_RESILIENT_* of its environment are the workers' training
settings, forwarded to them).

What only one launcher takes is that launcher's own section (`launch/launchers/`), and the
whole set, with `--launcher`, is `launch/run_settings.py`. A few options here are taken by some
launchers only (--hosts, --min-np, ...): each launcher lists those it takes (`Launcher.shared`),
and the others refuse them.
"""

from __future__ import annotations

from dataclasses import dataclass

from hvd_resilient.settings import setting


@dataclass(kw_only=True)
class RunOptions:
    """Where `hvd-resilient run` launches, with what, and how often it relaunches."""

    hosts: str | None = None
    """Horovod, mpi, inplace: static hosts host:slots,..., e.g. h1:2,h2:2 (default: this
    machine)."""
    np: int = 2
    """Processes to start; with --discovery the first world size; torchrun: processes per
    node."""
    discovery: str | None = setting(None, metavar="SCRIPT")
    """Horovod, inplace: host-discovery executable printing host:slots lines; hosts join and
    leave while the job trains (Horovod: makes the job elastic) (default: none, fixed
    hosts)."""
    min_np: int | None = None
    """Horovod with --discovery, or with --hosts (elastic on fixed hosts, as horovodrun -H with
    --min-np), or inplace: train on down to this many processes (default 1)."""
    max_np: int | None = None
    """Horovod with --discovery or elastic --hosts: grow up to this many processes (default:
    --np); inplace with --discovery: the slots of the hosts run never pass it (default: every
    host listed)."""
    checkpoint: str = setting("", metavar="URL")
    """Durable checkpoints: {store_urls}, credentials never in it (default
    <run-dir>/checkpoints)."""
    run_id: str = "run"
    """Names the run; a relaunch with the same id resumes from its checkpoints."""
    run_dir: str = ""
    """Folder for the event log, shared by all hosts (default runs/<run-id>)."""
    max_restarts: int = 3
    """Full relaunches after failures before giving up."""
    fresh_start: bool = False
    """Before the first launch only, set the checkpoints at --checkpoint aside
    (superseded-<UTC time>) so that training starts from step 0; relaunches resume as usual
    (default: resume from them)."""
    lease_wait: float = 30.0
    """Seconds to wait for a live job that holds this run (its lease in --run-dir) to end
    before giving up with one line; a dead job's lease is free within seconds."""
    take_over: bool = False
    """Take the run from a live job at once (a higher lease epoch): its checkpoints are refused
    from then on and it stops itself (default: wait for it, --lease-wait)."""
    ssh_port: int = 22
    """Horovod, mpi, inplace: ssh port of remote --hosts, checked before launch."""
    dry_run: bool = False
    """Print the launcher command and its environment (credentials masked), then exit
    (default: launch)."""
    command: list[str] = setting(default_factory=list, positional=True)
    """The training command after --, e.g. -- python train.py ARGS (in a config file: one
    string or a list of words)."""
