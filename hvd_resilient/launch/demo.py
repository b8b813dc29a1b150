"""`hvd-resilient demo`: an elastic job on this one machine, no cloud account needed.

Two one-slot "hosts" (`localhost` and `127.0.0.1` count as two, both started without ssh), so
a killed worker costs one host for a cooldown, not the whole job; edit the printed hosts file
while it runs to scale between 1 and 4 workers.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

from hvd_resilient.errors import LaunchError
from hvd_resilient.launch.horovod.command import ElasticLaunch, horovodrun_command

REPO = Path(__file__).resolve().parents[2]  # hvd_resilient/launch/demo.py -> the checkout


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="hvd-resilient demo", description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", default="runs/demo")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--dry-run", action="store_true", help="print the command and exit")
    a = p.parse_args(argv)
    example = REPO / "examples" / "digits.py"
    hostfile_script = REPO / "discovery" / "hostfile"
    if not example.exists() or not hostfile_script.exists():
        raise LaunchError(f"the demo runs from a source checkout; {example} is missing")
    run_dir = Path(a.run_dir).absolute()
    run_dir.mkdir(parents=True, exist_ok=True)
    hosts = run_dir / "hosts.txt"
    if not hosts.exists():
        hosts.write_text("# one host:slots per line; edit while the job runs\n"
                         "localhost:1\n127.0.0.1:1\n")
    discover = run_dir / "discover.sh"
    discover.write_text(
        f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(hostfile_script))} "
        f"{shlex.quote(str(hosts))}\n"
    )
    discover.chmod(0o755)
    launch = ElasticLaunch(np=2, min_np=1, max_np=4, discovery_script=str(discover),
                           network_interface="lo", gloo_timeout_seconds=15,
                           blacklist_cooldown=(5, 10))
    cmd = horovodrun_command(launch, [
        sys.executable, str(example), "--run-id", "demo", "--run-dir", str(run_dir),
        "--epochs", str(a.epochs), "--checkpoint-every", "100",
    ])
    print(f"run folder:  {run_dir}\ncheckpoints: {run_dir / 'checkpoints'}\n"
          f"hosts file:  {hosts} (edit it to add or remove workers)\n"
          f"command:     {shlex.join(cmd)}", flush=True)
    if a.dry_run:
        return 0
    rc = subprocess.call(cmd)
    print(f"exit code {rc}\nevents:      {run_dir / 'events.jsonl'}\n"
          f"report:      hvd-resilient report {run_dir}\n"
          f"checkpoints: hvd-resilient ckpt list {(run_dir / 'checkpoints').as_uri()}")
    return rc
