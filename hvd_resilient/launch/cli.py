"""`hvd-resilient run`: build the launcher command line, check what can be checked, supervise.

    hvd-resilient run --launcher horovod --discovery ./hosts.sh --np 2 --min-np 1 --max-np 4 \
        --checkpoint s3://bucket/ckpt/exp1 --run-id exp1 -- python train.py --epochs 10

What differs between launchers is the chosen launcher's to say (`launch/launchers/`): its
options, checks, command line, environment, warm pool and signals. What is here is the same
for every launcher: the options read and checked once, the run's lease, the checkpoint store,
the supervisor.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Any

from hvd_resilient.config import CheckpointOptions, TrainConfig, refuse_credentials
from hvd_resilient.errors import SUPERVISED_ENV, ConfigError, LaunchError
from hvd_resilient.events import LEASE_EPOCH_ENV
from hvd_resilient.launch.hosts import parse_hosts
from hvd_resilient.launch.interpreter import check_interpreter, workers_command
from hvd_resilient.launch.job_guard import JOB_ENV, end_job
from hvd_resilient.launch.launchers import Launcher
from hvd_resilient.launch.run_options import RunOptions
from hvd_resilient.launch.run_settings import RUN, RunSettings, add_arguments, refuse_foreign
from hvd_resilient.launch.supervisor import Supervisor
from hvd_resilient.launch.warm import pool_server
from hvd_resilient.launcher_env import RUN_DIR_ENV, RUN_ID_ENV
from hvd_resilient.masking import has_credentials, mask_env, mask_text, mask_url
from hvd_resilient.run_lease import LeaseHeldError, LeaseRecord, Renewal, RunLease
from hvd_resilient.settings import load_file

__all__ = ["build_parser", "main", "resolve"]

FORWARDED_PREFIXES = ("HVD_RESILIENT_", "AWS_", "PYTHONPATH", "OMP_NUM_THREADS")
MEMORY_SCOPE_ENV = "HVD_RESILIENT_MEMORY_TIER_SCOPE"
"""The workers' `memory_tier_scope`, which --fresh-start sets for them."""


def build_parser() -> argparse.ArgumentParser:
    """One flag per option (run_settings.py), each default None: the config file may set it;
    the real default is named in each help line."""
    p = argparse.ArgumentParser(prog="hvd-resilient run", description=__doc__.splitlines()[0])
    p.add_argument("--config", metavar="FILE",
                   help="YAML or JSON file with any of these options, named as here without "
                        "the dashes (max_restarts: 5); flags given here win (default: none)")
    add_arguments(p)
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


def resolve(args: argparse.Namespace) -> tuple[RunOptions, Launcher]:
    """The options every launcher is handed, and the chosen launcher holding its own: defaults
    < config file < flags, an option of another launcher refused, everything checked before
    anything starts."""
    file = getattr(args, "config", None)
    from_file = RUN.read(file=file, file_values=_file_values(file)) if file else {}
    from_flags = RUN.read(args=args)
    given: RunSettings = RUN.build({**from_file, **from_flags})
    refuse_foreign(given.launcher, from_flags, from_file, file or "")
    opts, launcher = given.run, given.chosen()
    cmd = list(opts.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise ConfigError("run: no training command; add it after --, e.g. -- python train.py")
    opts = dataclasses.replace(opts, command=workers_command(cmd))
    if "np" not in from_flags and "np" not in from_file and (opts.min_np or 1) > opts.np:
        # --np not given: its default (2) never refuses a --min-np above it
        opts = dataclasses.replace(opts, np=opts.min_np or 1)
    check_sizes(opts)
    launcher.check(opts)
    refuse_credentials(opts.checkpoint, "run: --checkpoint")
    if opts.checkpoint:
        check_url(opts.checkpoint)
    # The training config the workers will build: validated here, once, before any launch.
    cfg = TrainConfig(run_id=opts.run_id, run_dir=opts.run_dir,
                      checkpoint=CheckpointOptions(url=opts.checkpoint))
    secret = [a for a in cmd if has_credentials(a)]
    if secret:
        raise ConfigError(f"run: the training command carries credentials in "
                          f"{mask_url(secret[0])}; process lists and logs would show them: use "
                          "the AWS credential chain (AWS_ACCESS_KEY_ID / AWS_PROFILE) instead")
    return dataclasses.replace(opts, run_dir=cfg.run_dir, checkpoint=cfg.checkpoint.url), launcher


def check_sizes(opts: RunOptions) -> None:
    """Sizes no launcher can run with, refused before anything starts, for every launcher (a
    launcher refuses what only it cannot run, `Launcher.check`)."""
    np, lo, hi = opts.np, opts.min_np, opts.max_np
    if np < 1:
        raise ConfigError(f"run: --np must be >= 1, got {np}")
    if lo is not None and lo < 1:
        raise ConfigError(f"run: --min-np must be >= 1, got {lo}")
    if hi is not None and hi < 1:
        raise ConfigError(f"run: --max-np must be >= 1, got {hi}")
    lo, hi = lo or 1, hi or max(np, lo or 1)
    if lo > hi:
        raise ConfigError(f"run: --min-np ({lo}) is larger than --max-np ({hi})")
    if not lo <= np <= hi:
        raise ConfigError(f"run: --np {np} must lie between --min-np {lo} and --max-np {hi}")
    if opts.hosts:
        slots = sum(n for _, n in parse_hosts(opts.hosts))
        if np > slots:
            raise ConfigError(f"run: --np {np} is more than the {slots} slots in --hosts "
                              f"{opts.hosts}")
    for name, value, least in (("max-restarts", opts.max_restarts, 0),
                               ("ssh-port", opts.ssh_port, 1)):
        if value < least:
            raise ConfigError(f"run: --{name} must be >= {least}, got {value}")
    if opts.ssh_port > 65535:
        raise ConfigError(f"run: --ssh-port must be a port number, got {opts.ssh_port}")


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


def take_run(opts: RunOptions, launcher: Launcher, token: str) -> Renewal:
    """Takes the run's lease (`run_lease.py`) and raises the checkpoint store's fence to its
    epoch, and renews it from then on: a job that held the run before can publish no
    checkpoint. A live holder is waited for (--lease-wait) or displaced (--take-over). What a
    dead supervisor of this machine left running is ended here, should its guard have missed
    anything; a live holder (frozen, or on another host) is left to stop itself: its
    supervisor ends its job when it finds the run taken, and its workers when their next
    checkpoint is refused. The supervisors of one job (one per node of a multi-node torchrun
    job, `Launcher.lease_group`) share the lease under the job's name, with one epoch."""
    from hvd_resilient.checkpoint.fence import raise_fence
    from hvd_resilient.checkpoint.stores import StoreError, open_store

    group = launcher.lease_group(opts)
    lease = RunLease(opts.run_dir, token if group is None else group)

    def waiting(old: LeaseRecord) -> None:
        print(f"hvd-resilient run: run {opts.run_id} is held by a live job "
              f"({old.describe(time.time())}); waiting up to {opts.lease_wait:g} s for it "
              "to end (--take-over takes the run from it)", file=sys.stderr, flush=True)

    try:
        take = lease.acquire if group is None else lease.join_or_take
        old = take(wait_s=opts.lease_wait, take_over=opts.take_over, on_wait=waiting)
    except LeaseHeldError as e:
        raise LaunchError(f"{e}; stop it first, or pass --take-over to take the run from it "
                          "(its checkpoints are refused from then on)") from None
    try:
        raise_fence(open_store(opts.checkpoint), lease.epoch)
    except StoreError as e:
        lease.release()
        raise LaunchError(f"checkpoint store {mask_url(opts.checkpoint)}: cannot set the "
                          f"run's fence: {e}") from None
    if old is not None and old.token and old.holder_gone():
        end_job(old.token)
    return Renewal(lease)


def main(argv: list[str]) -> int:
    opts, launcher = resolve(build_parser().parse_args(argv))
    env = dict(os.environ)
    env.update({
        RUN_ID_ENV: opts.run_id, RUN_DIR_ENV: opts.run_dir,
        "HVD_RESILIENT_CHECKPOINT_URL": opts.checkpoint, SUPERVISED_ENV: "1",
        # marks every process of this job, on every host: what ends with this process
        JOB_ENV: f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(8)}",
    })
    if opts.fresh_start:  # never resume from the old history's memory tier either
        env[MEMORY_SCOPE_ENV] = time.strftime("fresh%Y%m%dT%H%M%S", time.gmtime())
    env.update(launcher.environment(opts))
    forwarded = sorted(k for k in env if k.startswith(FORWARDED_PREFIXES))
    cmd = launcher.command(opts, forwarded)
    if opts.dry_run:
        print(mask_text(shlex.join(cmd)))
        shown = mask_env({k: env[k] for k in forwarded})
        for k in forwarded:
            print(f"{k}={shown[k]}")
        if opts.fresh_start:
            print(f"# --fresh-start: checkpoints at {mask_url(opts.checkpoint)} would be "
                  "set aside before the first launch")
        return 0
    launcher.probe(opts)
    check_interpreter(opts.command)
    check_store(opts.checkpoint)
    Path(opts.run_dir).mkdir(parents=True, exist_ok=True)
    renewal = take_run(opts, launcher, env[JOB_ENV])  # before anything is written to the run
    env[LEASE_EPOCH_ENV] = str(renewal.lease.epoch)
    pool = None
    try:
        if opts.fresh_start:
            print(fresh_start(opts.checkpoint), flush=True)
        if launcher.wants_warm_pool(opts, env):
            pool = pool_server.hold(opts.command, env)
        # the lease's epoch and the pool's socket: more names for mpirun to forward
        cmd = launcher.command(opts, sorted(k for k in env if k.startswith(FORWARDED_PREFIXES)))
        outcome = Supervisor(cmd, env, opts.run_dir, max_restarts=opts.max_restarts,
                             graceful=launcher.stop_signal, signal_group=launcher.signal_group,
                             renewal=renewal).run()
    finally:
        if pool is not None:
            pool.stop()
        renewal.stop()
        renewal.lease.release()
    msg = f"hvd-resilient run: {outcome.reason} (exit {outcome.exit_code}, " \
          f"{outcome.restarts} restarts; events: {opts.run_dir}/events.jsonl)"
    print(mask_text(msg), file=sys.stderr if outcome.exit_code else sys.stdout)
    return outcome.exit_code
