"""`hvd-resilient demo`: an elastic job on this one machine that survives a fault, a host
added and a host removed, then reports what it went through. No cloud account, no setup.

It trains the small GPT of examples/gpt.py on the Python standard library's sources (shards
written to the run folder and streamed back through loader workers) under Horovod Elastic
with one "host" per slot (`hvd_resilient.launch.horovod.driver`), and plays a script while it
runs, watching the event log:

1. a worker is killed with SIGKILL part-way (`HVD_RESILIENT_FAULT`): the survivors notice in
   milliseconds, restore the last in-memory commit and train on; the slot comes back after a
   short cooldown;
2. a host is added to the discovery file: its worker is forked at once from the machine's warm
   pool (the imports done; --no-warm-pool: it imports while the others train on); the world
   grows at the first commit after it is ready;
3. it is removed again: the world shrinks at the next step, nothing lost;
4. once some steps are trained at that size, the job may end: `hvd-resilient report` prints
   recovery times, steps lost and goodput, and writes the plot.

The script is paced by the event log, never by a step count: each act waits for the events of
the one before, and the job cannot end before the last act has been seen. Its step budget
(--max-steps) used to be its end; a quiet machine trained it through while the killed slot
cooled down and the story stopped half-told. Now the job is started with `--end-file`
(examples/gpt.py): --max-steps is the least it trains, and it ends at its first commit step
from there on after the demo has written that file, which it does when its script has played
(or stopped). Where the script takes fewer steps than the budget (a busy machine) the job ends
at the budget as before; where it takes more, only as long as the acts take (a few seconds
past the budget): about the same total time, the whole story on any machine.

--interactive skips the script: the job runs with the printed hosts file, edit it yourself.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hvd_resilient import event_names as ev
from hvd_resilient.errors import LaunchError
from hvd_resilient.launch.horovod.command import ElasticLaunch, horovodrun_command
from hvd_resilient.launch.horovod.options import DriverSwitches, driver_env

REPO = Path(__file__).resolve().parents[2]  # hvd_resilient/launch/demo.py -> the checkout
KILL_STEP = 60
FINAL_STEPS = 20
"""Steps trained at the final world size before the job may end (the report shows them)."""


def _say(text: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {text}", flush=True)


class EventTail:
    """Reads the run's events.jsonl as it grows (torn last lines are left for the next read)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.events: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n") + 1
        self.offset += end
        new = []
        for line in chunk[:end].splitlines():
            try:
                new.append(json.loads(line))
            except ValueError:
                continue
        self.events += new
        return new

    def commits(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == ev.COMMIT]

    def size(self) -> int:
        c = self.commits()
        return c[-1]["size"] if c else 0

    def step(self) -> int:
        c = self.commits()
        return c[-1]["step"] if c else 0


def _wait(tail: EventTail, job: subprocess.Popen[bytes], what: str,
          done: Callable[[], bool], timeout: float) -> bool:
    """Polls the event log until `done()`; False if the job ended or the wait ran out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tail.poll()
        if done():
            return True
        if job.poll() is not None:
            _say(f"the job ended before {what}")
            return False
        time.sleep(0.2)  # polling a file another process appends to, bounded by the deadline
    _say(f"gave up waiting for {what} after {timeout:.0f} s")
    return False


def _set_hosts(hosts: Path, text: str) -> None:
    tmp = hosts.with_suffix(".tmp")
    tmp.write_text("# one host:slots per line; read by discover.sh while the job runs\n"
                   + text + "\n")
    os.replace(tmp, hosts)


def _script(tail: EventTail, job: subprocess.Popen[bytes], hosts: Path, np: int) -> bool:
    """Kill, add, remove, narrating what the event log shows; True once all of it was seen
    and FINAL_STEPS trained at the final size, False where an act never came (the job's end
    is allowed either way, by the caller)."""
    if not _wait(tail, job, "the first commit", lambda: tail.size() > 0, 600):
        return False
    _say(f"training: world size {tail.size()}, one rank per slot")
    _say(f"a worker will be killed with SIGKILL at step {KILL_STEP}")
    if not _wait(tail, job, "the kill", lambda: any(
            e["event"] == ev.RESTORE for e in tail.events), 600):
        return False
    restore = next(e for e in tail.events if e["event"] == ev.RESTORE)
    fired = [float(f.read_text()) for f in tail.path.parent.glob(".fault-*")]
    took = f" {restore['ts'] - min(fired):.2f} s after the kill" if fired else ""
    detected = [e for e in tail.events if e["event"] == ev.FAILURE_DETECTED]
    how = " by a peer's hang-up" if detected and detected[0].get("peer_hangup") else ""
    _say(f"worker killed; the survivors noticed{how} and restored the last commit{took}: "
         f"step {restore['to_step']}, {restore['lost_steps']} steps to redo")
    if not _wait(tail, job, "training at the smaller size",
                 lambda: 0 < tail.size() < np, 120):
        return False
    _say(f"world size {tail.size()}; the killed slot returns after its cooldown")
    if not _wait(tail, job, "the slot's return", lambda: tail.size() >= np, 180):
        return False
    _say(f"world size {tail.size()} again at step {tail.step()}")
    t0 = time.time()  # the event log's clock
    _set_hosts(hosts, f"localhost:{np + 1}")
    _say(f"added a host: {hosts.name} now says localhost:{np + 1}")
    if not _wait(tail, job, "the added host", lambda: tail.size() == np + 1, 180):
        return False
    _say(f"world size {tail.size()}: training at it {_after(tail, t0, ev.SYNC, np + 1)} after "
         f"the file changed (its first commit at step {tail.step()})")
    _say_growth(tail, np + 1)
    grown = tail.step()
    if not _wait(tail, job, "some steps at the new size",
                 lambda: tail.step() >= grown + 30, 180):
        return False
    t0 = time.time()
    _set_hosts(hosts, f"localhost:{np}")
    _say(f"removed it again: {hosts.name} says localhost:{np}")
    if not _wait(tail, job, "the removal", lambda: tail.size() == np, 180):
        return False
    shrunk = tail.step()
    _say(f"world size {tail.size()}: training at it {_after(tail, t0, ev.RESET, np)} after the "
         f"file changed (its first commit at step {shrunk})")
    return _wait(tail, job, "some steps at the final size",
                 lambda: tail.step() >= shrunk + FINAL_STEPS, 180)


def _stop(job: subprocess.Popen[bytes]) -> int:
    """Terminates the job (horovodrun stops its workers), killing it if that takes too long."""
    job.terminate()
    try:
        return job.wait(timeout=60)
    except subprocess.TimeoutExpired:
        job.kill()
        return job.wait(timeout=10)


def _after(tail: EventTail, t0: float, event: str, size: int) -> str:
    """How long after `t0` rank 0 recorded `event` at world size `size` (the sync that starts
    training at a new size, or the reset into it), as the event log says, not this poll."""
    at = [e["ts"] for e in tail.events if e["event"] == event and e["rank"] == 0
          and e["size"] == size and e["ts"] >= t0]
    return f"{min(at) - t0:.2f} s" if at else "(not in the log)"


def _say_growth(tail: EventTail, size: int) -> None:
    """What the growth cost the workers already training: the newcomer's warm-up (they trained
    on meanwhile) and the reset (they waited)."""
    held = [e for e in tail.events if e["event"] == ev.STANDBY_WAIT]
    resets = [e for e in tail.events
              if e["event"] == ev.RESET and e["new_size"] == size and e["rank"] == 0]
    if held:
        pooled = any(e["event"] == ev.WARM_POOL_READY for e in tail.events)
        how = ("was forked from the warm pool (its imports done ahead) and set itself up"
               if pooled else "imported torch and Horovod and set itself up (a standby worker, "
               "started at once)")
        _say(f"the others trained on for {held[-1]['seconds']:.1f} s while the newcomer {how}")
    if resets:
        _say(f"the reset into the new world paused them for {resets[-1]['seconds']:.2f} s")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="hvd-resilient demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", default="",
                   help="default: runs/demo-<time> (a fresh folder: a used one would resume)")
    p.add_argument("--max-steps", type=int, default=450,
                   help="the least the job trains; it ends once the script has played too "
                        "(--interactive: at this step)")
    p.add_argument("--np", type=int, default=2, help="workers at start (one per slot)")
    p.add_argument("--interactive", action="store_true",
                   help="no script: edit the hosts file yourself while it trains")
    p.add_argument("--dry-run", action="store_true", help="print the command and exit")
    p.add_argument("--no-warm-pool", action="store_true",
                   help="workers import for themselves (the cold start a warm pool hides)")
    p.add_argument("--job-args", default="",
                   help="more arguments for examples/gpt.py, after the demo's own (a later flag "
                        "wins), e.g. --job-args='--dim 16 --batch-size 4'")
    a = p.parse_args(argv)
    example = REPO / "examples" / "gpt.py"
    hostfile_script = REPO / "discovery" / "hostfile"
    if not example.exists() or not hostfile_script.exists():
        raise LaunchError(f"the demo runs from a source checkout; {example} is missing")
    run_dir = Path(a.run_dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}").absolute()
    run_dir.mkdir(parents=True, exist_ok=True)
    hosts = run_dir / "hosts.txt"
    _set_hosts(hosts, f"localhost:{a.np}")
    end_file = run_dir / "end-allowed"  # written when the script has played: the job may end
    discover = run_dir / "discover.sh"
    discover.write_text(
        f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(hostfile_script))} "
        f"{shlex.quote(str(hosts))}\n"
    )
    discover.chmod(0o755)
    launch = ElasticLaunch(np=a.np, min_np=1, max_np=a.np + 2, discovery_script=str(discover),
                           network_interface="lo", gloo_timeout_seconds=30,
                           blacklist_cooldown=(2, 4))
    cmd = horovodrun_command(launch, [
        sys.executable, str(example), "--run-id", "demo", "--run-dir", str(run_dir),
        "--max-steps", str(a.max_steps), "--checkpoint-every", "100", "--commit-every", "5",
        "--log-every", "20", "--corpus-mb", "1", "--dim", "64", "--layers", "2",
        "--block", "64", "--batch-size", "16", "--data-num-workers", "1",
        "--shard-windows", "500",
        *([] if a.interactive else ["--end-file", str(end_file)]), *shlex.split(a.job_args),
    ])
    # --discovery-watch: the script runs as soon as the hosts file changes, not at the poll;
    # --warm-pool: this machine's workers fork from a warm process
    switches = DriverSwitches(discovery_watch=str(hosts), warm_pool=not a.no_warm_pool)
    env = dict(os.environ, **driver_env(switches))
    if not a.no_warm_pool:
        env["HVD_RESILIENT_RUN_DIR"] = str(run_dir)
    if not a.interactive:
        env["HVD_RESILIENT_FAULT"] = f"kill:rank=1:step={KILL_STEP}"
    log = run_dir / "job.log"
    print(f"run folder:  {run_dir}\nhosts file:  {hosts}"
          + (" (edit it to add or remove workers)" if a.interactive else "")
          + f"\njob output:  {log}\ncommand:     {shlex.join(cmd)}", flush=True)
    if a.dry_run:
        return 0
    t_start = time.monotonic()
    with open(log, "wb") as out:
        job = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True)
    tail = EventTail(run_dir / "events.jsonl")
    # SIGTERM ends the demo as Ctrl-C does, the job with it: the job runs in a session of its
    # own, where neither signal reaches it but through the demo (and its end waits for a file).
    sigterm = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        if not a.interactive:
            try:
                played = _script(tail, job, hosts, a.np)
            finally:  # the job trains on until this file exists; never leave it waiting
                end_file.touch()
            if job.poll() is None:
                tail.poll()
                end = ("its next commit" if tail.step() >= a.max_steps
                       else f"its first commit from step {a.max_steps} (--max-steps) on")
                _say(f"{'the script has played' if played else 'the script stopped early'}: "
                     f"the job may end, and ends at {end}")
        rc = job.wait()
    except KeyboardInterrupt:
        rc = _stop(job)
    finally:
        signal.signal(signal.SIGTERM, sigterm)
        if job.poll() is None:  # an error of the demo itself: the job does not outlive it
            _stop(job)
    tail.poll()
    _say(f"job finished with exit code {rc} after {time.monotonic() - t_start:.0f} s")
    result = run_dir / "result.json"
    if result.exists():
        r = json.loads(result.read_text())
        _say(f"final train loss {r['train_loss']:.3f}, held-out {r['held_out_loss']:.3f} "
             f"nats/byte (unigram baseline {r['unigram_baseline']:.3f})")
    agreed = _ranks_agree(run_dir / "events.jsonl")
    print(flush=True)
    from hvd_resilient.report.cli import main as report

    report([str(run_dir)])
    print(f"\nevents:      {run_dir / 'events.jsonl'}\n"
          f"checkpoints: hvd-resilient ckpt list {(run_dir / 'checkpoints').as_uri()}\n"
          f"again:       hvd-resilient report {run_dir}")
    if agreed is False:  # said last, where it is seen
        print(DIVERGED_BANNER.format(run=run_dir), flush=True)
        return rc or 1
    return rc


DIVERGED_BANNER = """
!!! THE RANKS ENDED WITH DIFFERENT PARAMETERS !!!
!!! a replica diverged: this is a bug of hvd_resilient; please report it with {run}/events.jsonl
"""


def _ranks_agree(events_path: Path) -> bool | None:
    """Compares the final parameters every rank reported (the `done` events): True, False, or
    None when no rank got that far."""
    from hvd_resilient.events import read_events

    done = {e["rank"]: e for e in read_events(events_path) if e["event"] == ev.DONE}
    if not done:
        _say("no rank finished: nothing to compare")
        return None
    digests = {e.get("params_sha256") for e in done.values()}
    parts = {k for e in done.values() for k, v in (e.get("digests") or {}).items()
             if v != (done[min(done)].get("digests") or {}).get(k)}
    if len(digests) == 1 and not parts:
        _say(f"all {len(done)} ranks hold the same parameters, optimizer state and schedule "
             f"(digest {str(next(iter(digests)))[:12]})")
        return True
    _say(f"the {len(done)} ranks differ: {len(digests)} parameter digests"
         + (f", components {', '.join(sorted(parts))}" if parts else ""))
    return False
