"""`hvd-resilient run`: build the launcher command line, check what can be checked, supervise.

    hvd-resilient run --backend horovod --discovery ./hosts.sh --np 2 --min-np 1 --max-np 4 \
        --checkpoint s3://bucket/ckpt/exp1 --run-id exp1 -- python train.py --epochs 10
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from hvd_resilient.config import TrainConfig, load_file
from hvd_resilient.errors import ConfigError, LaunchError
from hvd_resilient.launch.commands import horovodrun_static, mpirun_command, torchrun_command
from hvd_resilient.launch.horovod import ElasticLaunch, horovodrun_command
from hvd_resilient.launch.supervisor import Supervisor

BACKENDS = ("horovod", "mpi", "torchrun")
_SECRET = ("SECRET", "TOKEN", "PASSWORD", "CREDENTIAL")
FORWARDED_PREFIXES = ("HVD_RESILIENT_", "AWS_", "PYTHONPATH", "OMP_NUM_THREADS")


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
    p = argparse.ArgumentParser(prog="hvd-resilient run", description=__doc__.splitlines()[0])
    p.add_argument("--config", help="YAML/JSON file with any of these options")
    p.add_argument("--backend", choices=BACKENDS)
    p.add_argument("--hosts", help="static hosts, e.g. h1:2,h2:2")
    p.add_argument("--discovery", help="host-discovery executable (elastic horovod)")
    p.add_argument("--np", type=int)
    p.add_argument("--min-np", type=int)
    p.add_argument("--max-np", type=int)
    p.add_argument("--checkpoint", help="file:///path or s3://bucket/prefix")
    p.add_argument("--run-id")
    p.add_argument("--run-dir")
    p.add_argument("--max-restarts", type=int)
    p.add_argument("--network-interface")
    p.add_argument("--ssh-port", type=int, default=22, help="checked before launch")
    p.add_argument("--gloo-timeout-seconds", type=int)
    p.add_argument("--reset-limit", type=int,
                   help="horovod: stop after this many resets (default: no limit)")
    p.add_argument("--elastic-timeout", type=int,
                   help="horovod: seconds to wait for --min-np slots (default 600)")
    p.add_argument("--blacklist-cooldown-range", type=int, nargs=2, metavar=("MIN", "MAX"),
                   help="horovod: a failed slot is readmitted after MIN..MAX s (default 10 30)")
    p.add_argument("--no-slot-hosts", dest="slot_hosts", action="store_false", default=None,
                   help="horovod: blacklist whole hosts on a failure, as plain horovodrun does "
                        "(default: per slot, so one dead worker never ends a one-host job)")
    p.add_argument("--nnodes", help="torchrun: MIN:MAX nodes (default 1)")
    p.add_argument("--rdzv-endpoint", help="torchrun: host:port of the c10d rendezvous")
    p.add_argument("--torchrun-restarts", type=int,
                   help="torchrun: in-job restarts before the supervisor relaunches (default 3)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the launcher command and environment, then exit")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- python train.py ARGS")
    return p


DEFAULTS: dict[str, Any] = {
    "backend": "horovod", "np": 2, "max_restarts": 3, "gloo_timeout_seconds": 30,
    "run_id": "run",
}


def resolve(args: argparse.Namespace) -> dict[str, Any]:
    """Defaults < config file < flags; the result is validated before anything starts."""
    opts = dict(DEFAULTS)
    if args.config:
        opts.update(load_file(args.config))
    opts.update({k: v for k, v in vars(args).items() if v is not None and k != "config"})
    cmd = list(opts.get("command") or [])
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise ConfigError("run: no training command; add it after --, e.g. -- python train.py")
    opts["command"] = cmd
    if opts["backend"] not in BACKENDS:
        raise ConfigError(f"run: --backend must be one of {', '.join(BACKENDS)}")
    if opts.get("discovery") and opts.get("hosts"):
        raise ConfigError("run: give --hosts or --discovery, not both")
    if opts.get("discovery") and opts["backend"] != "horovod":
        raise ConfigError("run: --discovery needs --backend horovod (torchrun and MPI find "
                          "their hosts themselves)")
    if opts["max_restarts"] < 0:
        raise ConfigError("run: --max-restarts must be >= 0")
    # The training config the workers will build: validated here, once, before any launch.
    cfg = TrainConfig(run_id=opts["run_id"], run_dir=opts.get("run_dir") or "",
                      checkpoint_url=opts.get("checkpoint") or "")
    opts["run_dir"], opts["checkpoint"] = cfg.run_dir, cfg.checkpoint_url
    return opts


def launcher_command(opts: dict[str, Any], env_names: list[str]) -> list[str]:
    hosts = parse_hosts(opts["hosts"]) if opts.get("hosts") else None
    train = opts["command"]
    if opts["backend"] == "mpi":
        return mpirun_command(opts["np"], hosts, env_names, train)
    if opts["backend"] == "torchrun":
        return torchrun_command(
            opts["np"], opts.get("nnodes") or "1", opts.get("rdzv_endpoint") or "127.0.0.1:29400",
            opts.get("torchrun_restarts", 3), opts["run_id"], train,
        )
    if opts.get("discovery"):
        launch = ElasticLaunch(
            np=opts["np"], min_np=opts.get("min_np") or 1,
            max_np=opts.get("max_np") or opts["np"], discovery_script=opts["discovery"],
            network_interface=opts.get("network_interface"),
            gloo_timeout_seconds=opts["gloo_timeout_seconds"],
            slot_hosts=opts.get("slot_hosts", True),
            reset_limit=opts.get("reset_limit"),
            elastic_timeout=opts.get("elastic_timeout") or 600,
            blacklist_cooldown=tuple(opts.get("blacklist_cooldown_range") or (10, 30)),
        )
        return horovodrun_command(launch, train)
    return horovodrun_static(opts["np"], hosts, opts.get("network_interface"), train)


def check_discovery(script: str) -> None:
    """Horovod would retry a failing discovery script for minutes; fail at once instead."""
    try:
        r = subprocess.run([script], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LaunchError(f"discovery script {script} could not run: {e}") from None
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise LaunchError(f"discovery script {script} failed on its first call: {last}")
    if not r.stdout.strip():
        raise LaunchError(f"discovery script {script} printed no hosts: no slots to run on")


def check_store(url: str) -> None:
    """Missing bucket, bad credentials: one line now, not a crash on every rank later."""
    from hvd_resilient.checkpoint.store import StoreError, open_store

    try:
        open_store(url).list("")
    except StoreError as e:
        raise LaunchError(f"checkpoint store {url}: {e}") from None


def masked(env: dict[str, str]) -> dict[str, str]:
    return {k: ("***" if any(s in k.upper() for s in _SECRET) else v) for k, v in env.items()}


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    opts = resolve(args)
    env = dict(os.environ)
    env.update({
        "HVD_RESILIENT_RUN_ID": opts["run_id"], "HVD_RESILIENT_RUN_DIR": opts["run_dir"],
        "HVD_RESILIENT_CHECKPOINT_URL": opts["checkpoint"],
    })
    forwarded = sorted(k for k in env if k.startswith(FORWARDED_PREFIXES))
    cmd = launcher_command(opts, forwarded)
    if opts.get("dry_run"):
        print(shlex.join(cmd))
        for k in forwarded:
            print(f"{k}={masked(env)[k]}")
        return 0
    if opts.get("discovery"):
        check_discovery(opts["discovery"])
    if opts.get("hosts"):
        check_hosts_reachable(parse_hosts(opts["hosts"]), opts.get("ssh_port") or 22)
    check_store(opts["checkpoint"])
    Path(opts["run_dir"]).mkdir(parents=True, exist_ok=True)
    outcome = Supervisor(cmd, env, opts["run_dir"], max_restarts=opts["max_restarts"]).run()
    msg = f"hvd-resilient run: {outcome.reason} (exit {outcome.exit_code}, " \
          f"{outcome.restarts} restarts; events: {opts['run_dir']}/events.jsonl)"
    print(msg, file=sys.stderr if outcome.exit_code else sys.stdout)
    return outcome.exit_code
