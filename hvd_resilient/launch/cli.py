"""`hvd-resilient run`: build the launcher command line, check what can be checked, supervise.

    hvd-resilient run --launcher horovod --discovery ./hosts.sh --np 2 --min-np 1 --max-np 4 \
        --checkpoint s3://bucket/ckpt/exp1 --run-id exp1 -- python train.py --epochs 10
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hvd_resilient.config import CheckpointOptions, TrainConfig, refuse_credentials
from hvd_resilient.errors import SUPERVISED_ENV, ConfigError, LaunchError
from hvd_resilient.events import LEASE_EPOCH_ENV
from hvd_resilient.launch import mpi_warm
from hvd_resilient.launch.commands import (
    horovodrun_static,
    hosts_arg,
    inplace_command,
    mpirun_command,
    torchrun_command,
)
from hvd_resilient.launch.horovod import warm_pool
from hvd_resilient.launch.horovod.command import ElasticLaunch, horovodrun_command
from hvd_resilient.launch.horovod.standby import runnable_here
from hvd_resilient.launch.horovod.warm_pool_server import Started
from hvd_resilient.launch.interpreter import check_interpreter, workers_command
from hvd_resilient.launch.job_guard import JOB_ENV, end_job
from hvd_resilient.launch.run_options import LAUNCHERS, RUN
from hvd_resilient.launch.supervisor import Supervisor
from hvd_resilient.masking import has_credentials, mask_env, mask_text, mask_url
from hvd_resilient.run_lease import LeaseHeldError, LeaseRecord, Renewal, RunLease
from hvd_resilient.settings import load_file

__all__ = ["LAUNCHERS", "build_parser", "launcher_command", "main", "resolve"]

FORWARDED_PREFIXES = ("HVD_RESILIENT_", "AWS_", "PYTHONPATH", "OMP_NUM_THREADS")
MEMORY_SCOPE_ENV = "HVD_RESILIENT_MEMORY_TIER_SCOPE"
"""The workers' `memory_tier_scope`, which --fresh-start sets for them."""


def parse_hosts(spec: str) -> list[tuple[str, int]]:
    """`h1:2,h2` -> [("h1", 2), ("h2", 1)]; hostnames go to ssh, so they are validated here."""
    from hvd_resilient.discovery.validate import validate_hostname

    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        host, _, slots = part.partition(":")
        if not host or not (slots or "1").isdigit() or int(slots or 1) < 1:
            raise ConfigError(f"run: --hosts entry {part!r} must look like host:slots")
        try:
            validate_hostname(host)
        except ValueError as e:
            raise ConfigError(f"run: --hosts: {e}") from None
        out.append((host, int(slots or 1)))
    return out


def _is_local(host: str) -> bool:
    """Horovod's rule: local (started without ssh) iff the name resolves to an address of a
    local interface; 127.0.0.2 is not one unless it was added to lo."""
    import psutil

    try:
        addrs = {i[4][0] for i in socket.getaddrinfo(host, None, socket.AF_INET)}
    except OSError:
        return False
    local = {a.address for nic in psutil.net_if_addrs().values() for a in nic
             if a.family == socket.AF_INET}
    return bool(addrs) and addrs <= local


def check_hosts_reachable(hosts: list[tuple[str, int]], ssh_port: int) -> None:
    """The launcher would hang or print pages of ssh errors; one line before it starts."""
    from hvd_resilient.discovery.health import probe_hosts

    remote = [h for h, _ in hosts if not _is_local(h)]
    failed = {h: why for h, why in probe_hosts(remote, ssh_port, 2.0).items() if why}
    if failed:
        detail = "; ".join(f"{h}: {why}" for h, why in sorted(failed.items()))
        raise LaunchError(f"hosts unreachable over ssh ({detail}); check they are up and "
                          f"sshd listens on port {ssh_port} (--ssh-port)")


def build_parser() -> argparse.ArgumentParser:
    """One flag per option of `RunOptions` (run_options.py), each default None: the config
    file may set it; the real default is named in each help line."""
    p = argparse.ArgumentParser(prog="hvd-resilient run", description=__doc__.splitlines()[0])
    p.add_argument("--config", metavar="FILE",
                   help="YAML or JSON file with any of these options, named as here without "
                        "the dashes (max_restarts: 5); flags given here win (default: none)")
    RUN.add_arguments(p)
    return p


def _file_values(path: str) -> dict[str, Any]:
    """The config file's options as written; `no_slot_hosts` (the flag's own name, for a
    file written from the --help) reads as the negation of `slot_hosts`."""
    raw = load_file(path, "run")
    if "no_slot_hosts" in raw:
        st = RUN.by_name()["slot_hosts"]
        off = RUN.coerce(st, raw.pop("no_slot_hosts"), f"config file {path}: no_slot_hosts")
        if off is not None:
            raw.setdefault("slot_hosts", not off)
    return raw


def resolve(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None
            ) -> dict[str, Any]:
    """Defaults < config file < flags; the result is validated before anything starts.
    (``parser`` is accepted for callers that built their own; the options are RunOptions'.)"""
    file = getattr(args, "config", None)
    values = RUN.read(file=file, file_values=_file_values(file) if file else None, args=args)
    opts: dict[str, Any] = dataclasses.asdict(RUN.build(values))
    cmd = list(opts.get("command") or [])
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise ConfigError("run: no training command; add it after --, e.g. -- python train.py")
    opts["command"] = workers_command(cmd)
    if opts.get("discovery") and opts.get("hosts"):
        raise ConfigError("run: give --hosts or --discovery, not both")
    if opts.get("discovery") and opts["launcher"] != "horovod":
        raise ConfigError("run: --discovery needs --launcher horovod (torchrun and MPI find "
                          "their hosts themselves)")
    watch = opts.get("discovery_watch")
    if watch and not opts.get("discovery"):
        raise ConfigError("run: --discovery-watch needs --discovery (it runs that script when "
                          "the file changes)")
    if watch and not os.path.isfile(watch):
        raise ConfigError(f"run: --discovery-watch {watch} is not a file; name the hosts file "
                          "your discovery script reads")
    if watch:
        opts["discovery_watch"] = os.path.abspath(watch)
    check_sizes(opts)
    refuse_credentials(opts["checkpoint"], "run: --checkpoint")
    if opts["checkpoint"]:
        check_url(opts["checkpoint"])
    # The training config the workers will build: validated here, once, before any launch.
    cfg = TrainConfig(run_id=opts["run_id"], run_dir=opts.get("run_dir") or "",
                      checkpoint=CheckpointOptions(url=opts["checkpoint"]))
    secret = [a for a in cmd if has_credentials(a)]
    if secret:
        raise ConfigError(f"run: the training command carries credentials in "
                          f"{mask_url(secret[0])}; process lists and logs would show them: use "
                          "the AWS credential chain (AWS_ACCESS_KEY_ID / AWS_PROFILE) instead")
    opts["run_dir"], opts["checkpoint"] = cfg.run_dir, cfg.checkpoint.url
    return opts


def check_sizes(opts: dict[str, Any]) -> None:
    """Sizes no launcher can run with, refused before anything starts, for every launcher."""
    np, lo, hi = opts["np"], opts.get("min_np"), opts.get("max_np")
    if np < 1:
        raise ConfigError(f"run: --np must be >= 1, got {np}")
    if opts.get("replace") and opts["launcher"] != "inplace":
        raise ConfigError("run: --replace is the inplace launcher's (horovod readmits a failed "
                          "host after its cooldown; torchrun restarts every worker)")
    if opts.get("standby") and opts["launcher"] != "inplace":
        raise ConfigError("run: --standby is the inplace launcher's (horovod: --warm-pool; "
                          "torchrun restarts every worker)")
    if opts["launcher"] == "inplace" and opts.get("hosts"):
        raise ConfigError("run: --launcher inplace runs its workers on this machine for now; "
                          "drop --hosts (or use --launcher horovod for several hosts)")
    if (lo is not None or hi is not None) and not elastic_hosts(opts) \
            and not opts.get("discovery") and opts["launcher"] != "inplace":
        raise ConfigError("run: --min-np/--max-np size an elastic job: they need --discovery "
                          "or --hosts (--launcher horovod); without them the job runs at --np")
    if lo is not None and lo < 1:
        raise ConfigError(f"run: --min-np must be >= 1, got {lo}")
    if hi is not None and hi < 1:
        raise ConfigError(f"run: --max-np must be >= 1, got {hi}")
    lo, hi = lo or 1, hi or max(np, lo or 1)
    if lo > hi:
        raise ConfigError(f"run: --min-np ({lo}) is larger than --max-np ({hi})")
    if not lo <= np <= hi:
        raise ConfigError(f"run: --np {np} must lie between --min-np {lo} and --max-np {hi}")
    if opts.get("hosts") and opts["launcher"] in ("horovod", "mpi"):
        slots = sum(n for _, n in parse_hosts(opts["hosts"]))
        if np > slots:
            raise ConfigError(f"run: --np {np} is more than the {slots} slots in --hosts "
                              f"{opts['hosts']}")
    for name, least in (("max_restarts", 0), ("gloo_timeout_seconds", 1), ("reset_limit", 0),
                        ("elastic_timeout", 1), ("torchrun_restarts", 0), ("ssh_port", 1),
                        ("standby", 0)):
        value = opts.get(name)
        if value is not None and value < least:
            raise ConfigError(f"run: --{name.replace('_', '-')} must be >= {least}, got {value}")
    cooldown = opts.get("blacklist_cooldown_range") or [10, 30]
    if list(cooldown) != [0, 0] and not 0 < cooldown[0] <= cooldown[1]:
        raise ConfigError(f"run: --blacklist-cooldown-range needs 0 < MIN <= MAX (or 0 0: a "
                          f"failed host never comes back), got {cooldown[0]} {cooldown[1]}")
    if opts["ssh_port"] > 65535:
        raise ConfigError(f"run: --ssh-port must be a port number, got {opts['ssh_port']}")
    nodes = str(opts.get("nnodes") or "1").split(":")
    if (len(nodes) > 2 or not all(n.isdigit() and int(n) >= 1 for n in nodes)
            or int(nodes[0]) > int(nodes[-1])):
        raise ConfigError(f"run: --nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got "
                          f"{opts.get('nnodes')!r}")


def elastic_hosts(opts: dict[str, Any]) -> bool:
    """--hosts with --min-np or --max-np under --launcher horovod: an elastic job on fixed
    hosts (horovodrun -H ... --min-np N: Horovod's own elastic mode without a discovery
    script), which recovers from failures in place but never grows beyond those hosts."""
    return bool(opts.get("hosts")) and opts.get("launcher") == "horovod" and (
        opts.get("min_np") is not None or opts.get("max_np") is not None)


def launcher_command(opts: dict[str, Any], env_names: list[str]) -> list[str]:
    hosts = parse_hosts(opts["hosts"]) if opts.get("hosts") else None
    train = opts["command"]
    if opts["launcher"] == "mpi":
        if mpi_warm.enabled(os.environ):
            train = mpi_warm.wrap(train)
        return mpirun_command(opts["np"], hosts, env_names, train)
    if opts["launcher"] == "inplace":
        return inplace_command(opts["np"], opts.get("min_np") or 1, train,
                               replace=bool(opts.get("replace")),
                               standby=int(opts.get("standby") or 0))
    if opts["launcher"] == "torchrun":
        return torchrun_command(
            opts["np"], opts["nnodes"], opts["rdzv_endpoint"], opts["torchrun_restarts"],
            opts["run_id"], train,
        )
    if opts.get("discovery") or elastic_hosts(opts):
        cooldown = tuple(opts["blacklist_cooldown_range"])
        launch = ElasticLaunch(
            np=opts["np"], min_np=opts.get("min_np") or 1,
            max_np=opts.get("max_np") or opts["np"], discovery_script=opts.get("discovery"),
            hosts=hosts_arg(hosts) if hosts else None,
            network_interface=opts.get("network_interface"),
            gloo_timeout_seconds=opts["gloo_timeout_seconds"],
            reset_limit=opts.get("reset_limit"),
            elastic_timeout=opts["elastic_timeout"],
            blacklist_cooldown=None if cooldown == (0, 0) else cooldown,
        )
        return horovodrun_command(launch, train)
    return horovodrun_static(opts["np"], hosts, opts.get("network_interface"), train)


def start_pool(opts: dict[str, Any], env: dict[str, str]) -> Started | None:
    """This machine's warm pool, held here across launches: mpirun relaunches every rank after
    a failure, and a relaunched horovodrun driver every worker; both fork this machine's
    ranks from it with their imports done (`launch/mpi_warm.py`, the standby stand-in). Held
    by the driver, Horovod's pool died with it, and a relaunch started cold. Ready before the
    first launch: its imports are the ones the ranks would do, once. None: not wanted (mpi
    turned off with HVD_RESILIENT_MPI_WARM=0, Horovod without --warm-pool or not elastic), a
    command it cannot serve, or a pool that did not come up (the ranks start cold)."""
    cmd = opts["command"]
    if opts["launcher"] == "mpi":
        wanted = mpi_warm.enabled(env) and mpi_warm.wrap(cmd) != cmd
    else:
        elastic = bool(opts.get("discovery")) or elastic_hosts(opts)
        wanted = opts["launcher"] == "horovod" and opts["warm_pool"] and elastic \
            and runnable_here(cmd)
    if not wanted:
        return None
    pool = Started(cmd)
    if not pool.wait_ready():
        pool.stop()
        return None
    env[warm_pool.SOCKET_ENV] = pool.path  # mpirun forwards it (-x); the driver's env has it
    return pool


def check_discovery(script: str) -> None:
    """Horovod would retry a failing discovery script for minutes, and die with a traceback on
    output it cannot parse; fail at once, with one line, instead."""
    from hvd_resilient.discovery.validate import DiscoveryOutputError, parse_discovery_output

    try:
        r = subprocess.run([script], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LaunchError(f"discovery script {script} could not run: {e}") from None
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise LaunchError(f"discovery script {script} failed on its first call: {last}")
    try:
        hosts = parse_discovery_output(r.stdout)
    except DiscoveryOutputError as e:
        raise LaunchError(f"discovery script {script} printed {e}") from None
    if not hosts:
        raise LaunchError(f"discovery script {script} printed no hosts: no slots to run on")


def check_url(url: str) -> None:
    """What the store can tell of --checkpoint without opening it (scheme, bucket)."""
    from hvd_resilient.checkpoint import stores

    try:
        stores.check_url(url)
    except stores.StoreConfigError as e:
        raise ConfigError(f"run: --checkpoint: {e}") from None


def check_store(url: str) -> None:
    """Missing bucket, bad credentials: one line now, not a crash on every rank later."""
    from hvd_resilient.checkpoint.stores import StoreError, open_store

    try:
        open_store(url).list("")
    except StoreError as e:
        raise LaunchError(f"checkpoint store {mask_url(url)}: {e}") from None


def fresh_start(url: str) -> str:
    """--fresh-start: the run's checkpoints set aside (never deleted), before the first launch
    only. Returns the line that says where they went."""
    from hvd_resilient.checkpoint.errors import CheckpointError
    from hvd_resilient.checkpoint.manager import CheckpointManager
    from hvd_resilient.checkpoint.stores import StoreError
    from hvd_resilient.checkpoint.supersede import default_supersede_tag

    shown = mask_url(url)
    try:
        mgr = CheckpointManager(url)
        if not mgr.has_checkpoints():
            return f"hvd-resilient run: --fresh-start: no checkpoints at {shown}; starting " \
                   "from step 0"
        tag = default_supersede_tag()
        steps = mgr.supersede(tag)
    except (StoreError, CheckpointError) as e:
        raise LaunchError(f"--fresh-start: checkpoints at {shown}: {e}") from None
    listed = ", ".join(map(str, steps[:5])) + (", ..." if len(steps) > 5 else "")
    return (f"hvd-resilient run: --fresh-start: moved {len(steps)} checkpoint(s) (steps "
            f"{listed or 'none'}) from {shown} to {shown}/{tag} (`hvd-resilient ckpt list "
            f"{shown}/{tag}` lists them); starting from step 0")


def take_run(opts: dict[str, Any], token: str) -> Renewal:
    """Takes the run's lease (`run_lease.py`) and raises the checkpoint store's fence to its
    epoch, and renews it from then on: a job that held the run before can publish no
    checkpoint. A live
    holder is waited for (--lease-wait) or displaced (--take-over). What a dead supervisor of
    this machine left running is ended here, should its guard have missed anything; a live
    holder (frozen, or on another host) is left to stop itself: its supervisor ends its job when
    it finds the run taken, and its workers when their next checkpoint is refused."""
    from hvd_resilient.checkpoint.fence import raise_fence
    from hvd_resilient.checkpoint.stores import StoreError, open_store

    # A multi-node torchrun job runs one supervisor per node, all on one run: they share the
    # lease under the job's name (its run id and rendezvous endpoint), with one epoch.
    nodes = str(opts.get("nnodes") or "1").split(":")[-1]
    shared = opts["launcher"] == "torchrun" and int(nodes) > 1
    if shared:
        token = f"torchrun:{opts['run_id']}:{opts['rdzv_endpoint']}"
    lease = RunLease(opts["run_dir"], token)

    def waiting(old: LeaseRecord) -> None:
        print(f"hvd-resilient run: run {opts['run_id']} is held by a live job "
              f"({old.describe(time.time())}); waiting up to {opts['lease_wait']:g} s for it "
              "to end (--take-over takes the run from it)", file=sys.stderr, flush=True)

    try:
        take = lease.join_or_take if shared else lease.acquire
        old = take(wait_s=opts["lease_wait"], take_over=opts["take_over"], on_wait=waiting)
    except LeaseHeldError as e:
        raise LaunchError(f"{e}; stop it first, or pass --take-over to take the run from it "
                          "(its checkpoints are refused from then on)") from None
    try:
        raise_fence(open_store(opts["checkpoint"]), lease.epoch)
    except StoreError as e:
        lease.release()
        raise LaunchError(f"checkpoint store {mask_url(opts['checkpoint'])}: cannot set the "
                          f"run's fence: {e}") from None
    if old is not None and old.token and old.holder_gone():
        end_job(old.token)
    return Renewal(lease)


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    opts = resolve(args, parser)
    env = dict(os.environ)
    env.update({
        "HVD_RESILIENT_RUN_ID": opts["run_id"], "HVD_RESILIENT_RUN_DIR": opts["run_dir"],
        "HVD_RESILIENT_CHECKPOINT_URL": opts["checkpoint"], SUPERVISED_ENV: "1",
        # marks every process of this job, on every host: what ends with this process
        JOB_ENV: f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(8)}",
    })
    if opts["fresh_start"]:  # never resume from the old history's memory tier either
        env[MEMORY_SCOPE_ENV] = time.strftime("fresh%Y%m%dT%H%M%S", time.gmtime())
    if opts["launcher"] == "horovod" and not opts["slot_hosts"]:
        env["HVD_RESILIENT_SLOT_HOSTS"] = "0"  # read by the driver (launch/horovod/driver.py)
    if opts["launcher"] == "horovod" and opts["warm_pool"]:
        env["HVD_RESILIENT_WARM_POOL"] = "1"  # likewise
    if opts.get("discovery_watch"):
        env["HVD_RESILIENT_DISCOVERY_WATCH"] = opts["discovery_watch"]  # likewise
    forwarded = sorted(k for k in env if k.startswith(FORWARDED_PREFIXES))
    cmd = launcher_command(opts, forwarded)
    if opts["dry_run"]:
        print(mask_text(shlex.join(cmd)))
        shown = mask_env({k: env[k] for k in forwarded})
        for k in forwarded:
            print(f"{k}={shown[k]}")
        if opts["fresh_start"]:
            print(f"# --fresh-start: checkpoints at {mask_url(opts['checkpoint'])} would be "
                  "set aside before the first launch")
        return 0
    if opts.get("discovery"):
        check_discovery(opts["discovery"])
    if opts.get("hosts"):
        check_hosts_reachable(parse_hosts(opts["hosts"]), opts["ssh_port"])
    check_interpreter(opts["command"])
    check_store(opts["checkpoint"])
    Path(opts["run_dir"]).mkdir(parents=True, exist_ok=True)
    renewal = take_run(opts, env[JOB_ENV])  # before anything is written to the run
    env[LEASE_EPOCH_ENV] = str(renewal.lease.epoch)
    pool = None
    try:
        if opts["fresh_start"]:
            print(fresh_start(opts["checkpoint"]), flush=True)
        pool = start_pool(opts, env)
        # the lease's epoch and the pool's socket: more names for mpirun to forward
        cmd = launcher_command(opts, sorted(k for k in env if k.startswith(FORWARDED_PREFIXES)))
        # mpirun passes SIGUSR1 on to every rank, on every host: the preemption path
        graceful = signal.SIGUSR1 if opts["launcher"] == "mpi" else None
        outcome = Supervisor(cmd, env, opts["run_dir"], max_restarts=opts["max_restarts"],
                             graceful=graceful, signal_group=opts["launcher"] != "horovod",
                             renewal=renewal).run()
    finally:
        if pool is not None:
            pool.stop()
        renewal.stop()
        renewal.lease.release()
    msg = f"hvd-resilient run: {outcome.reason} (exit {outcome.exit_code}, " \
          f"{outcome.restarts} restarts; events: {opts['run_dir']}/events.jsonl)"
    print(mask_text(msg), file=sys.stderr if outcome.exit_code else sys.stdout)
    return outcome.exit_code
