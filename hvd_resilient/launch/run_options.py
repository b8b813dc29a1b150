"""The options of `hvd-resilient run`, declared once: its flags, its config-file keys
(`--config run.yaml`, the same names without dashes), its --help and its table in
docs/configuration.md all come from `RunOptions` through `hvd_resilient.settings`, the
machinery `TrainConfig` uses. Defaults < config file < flags; no environment variables (the
HVD_RESILIENT_* of its environment are the workers' training settings, forwarded to them).
"""

from __future__ import annotations

from dataclasses import dataclass

from hvd_resilient.config import doc_values
from hvd_resilient.settings import Schema, setting

LAUNCHERS = ("horovod", "mpi", "torchrun", "inplace")


@dataclass(kw_only=True)
class RunOptions:
    """What `hvd-resilient run` launches, where, and how often it relaunches."""

    launcher: str = setting("horovod", choices=LAUNCHERS, aliases=("backend",))
    """What starts the workers, and so the collective backend they train on: horovod (Horovod
    Elastic with --discovery, else static horovodrun), mpi (mpirun), torchrun, or inplace
    (torch.distributed, survivors keep their processes; one machine)."""
    hosts: str | None = None
    """Static hosts host:slots,..., e.g. h1:2,h2:2 (default: this machine)."""
    discovery: str | None = setting(None, metavar="SCRIPT")
    """Host-discovery executable printing host:slots lines; makes a horovod job elastic
    (default: none, a static job)."""
    discovery_watch: str | None = setting(None, metavar="FILE")
    """Horovod with --discovery: a file the script reads (a hosts file); the script runs as soon
    as it changes, not at the next once-a-second poll (default: the poll only)."""
    np: int = 2
    """Processes to start; with --discovery the first world size; torchrun: processes per
    node."""
    min_np: int | None = None
    """Horovod with --discovery, or with --hosts (elastic on fixed hosts, as horovodrun -H with
    --min-np), or inplace: train on down to this many processes (default 1)."""
    max_np: int | None = None
    """Horovod with --discovery or elastic --hosts: grow up to this many processes (default:
    --np)."""
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
    replace: bool = False
    """Inplace: start a new worker for each one lost; it joins the others at their next commit
    once it is up (default: train on without it)."""
    standby: int = 0
    """Inplace: K more workers started at launch that set up and wait; a lost worker's place
    goes to one of them in the generation that answers the fault, without an import."""
    network_interface: str | None = setting(None, metavar="NIC")
    """Horovod: the interface Gloo uses, e.g. eth0; lo on one machine (default: Horovod finds a
    common one across hosts)."""
    ssh_port: int = 22
    """Ssh port of remote --hosts, checked before launch."""
    gloo_timeout_seconds: int = 30
    """Horovod: seconds a collective waits for a lost peer before the survivors reset."""
    reset_limit: int | None = None
    """Horovod: stop after this many resets (default: no limit)."""
    elastic_timeout: int = 600
    """Horovod: seconds to wait for --min-np slots."""
    blacklist_cooldown_range: tuple[int, int] = setting((10, 30), metavar=("MIN", "MAX"))
    """Horovod: a failed slot is readmitted after MIN..MAX s; 0 0: never (plain horovodrun's
    default)."""
    slot_hosts: bool = True
    """Horovod: blacklist per slot, so one dead worker never ends a one-host job
    (--no-slot-hosts: whole hosts, as plain horovodrun does)."""
    warm_pool: bool = False
    """Horovod: fork the workers of this machine from a warm pool that did their imports
    once, so a slot that comes back or joins here is ready in a tenth of a second instead of
    its cold start (default: each imports for itself; a joining host has a pool only if it
    starts one, docs/architecture.md)."""
    nnodes: str = "1"
    """Torchrun: N or MIN:MAX nodes."""
    rdzv_endpoint: str = setting("127.0.0.1:29400", metavar="HOST:PORT")
    """Torchrun: where the c10d rendezvous listens."""
    torchrun_restarts: int = 3
    """Torchrun: in-job restarts before the supervisor relaunches."""
    dry_run: bool = False
    """Print the launcher command and its environment (credentials masked), then exit
    (default: launch)."""
    command: list[str] = setting(default_factory=list, positional=True)
    """The training command after --, e.g. -- python train.py ARGS (in a config file: one
    string or a list of words)."""


RUN = Schema("run", RunOptions, doc_values=doc_values)
"""Every option of `hvd-resilient run`: its flag, its file key, its default."""
