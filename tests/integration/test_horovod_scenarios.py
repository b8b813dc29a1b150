"""Horovod's own elastic scenarios, run under `hvd-resilient run`.

A port (the team's own, not a copy) of the eight scenarios of Horovod's elastic integration
suite, `test/integration/elastic_common.py` in the horovod repository (github.com/horovod/horovod,
Apache-2.0, read at commit 2626dc87), twelve runs with the exit-mode variants. Their worker is
ported in tests/scripts/horovod_elastic_main.py with only its state line and decorator swapped.
Horovod's suite skips four of them for PyTorch (single rank failure, fault tolerance without
scaling, all hosts blacklisted, min hosts timeout: horovod#2030, #2908); here all run.

Two tiers of the same scenarios:
- `--no-slot-hosts`: Horovod's semantics (a failure blacklists the whole host), so Horovod's
  assertions on world sizes, start ranks, hostnames and rendezvous counts apply unchanged;
- slot hosts (`hvd-resilient run`'s default): every slot is its own host, so a failure costs a
  slot, not its host-mates. Where that changes an outcome, the test asserts the new one and
  says why.

How Horovod's test harness maps onto ours:
- its discovery script (a bash `if` on the number of lines rank 0 has logged) becomes a `case`
  on the same count (`discovery_script`); `hosts=` runs use `--hosts` (elastic on fixed hosts,
  Horovod's `-H` with `--min-np`), whose `--max-np` is the slot total, Horovod's own default;
- its mocks become flags: `DISCOVER_HOSTS_FREQUENCY_SECS = 0.01` ->
  `HVD_RESILIENT_DISCOVERY_INTERVAL=0.05` (the driver's floor), `ELASTIC_TIMEOUT_SECS = 1` ->
  `--elastic-timeout 1`, `_get_min_start_hosts = 1` -> `--network-interface lo` (which is what
  makes Horovod need only one host);
- horovodrun's defaults that ours changes are passed back: no blacklist cooldown
  (`--blacklist-cooldown-range 0 0`) unless the scenario sets one; one launch, no relaunch
  (`--max-restarts 0`), since Horovod's scenarios are about one horovodrun;
- `_run_elastic` raising RuntimeError becomes a non-zero exit with Horovod's message in the
  output (our driver prints the launcher's error as one line).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.jobs import PYTHON, VENV_BIN, events
from tests.support.paths import SCRIPTS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
# The scenarios take 30-95 s each here (Python, torch and Horovod start in 2-4 workers on 2
# cores), about 17 minutes for both tiers: too long for `make test`, so a tier of their own
# that CI runs (`-m horovod_scenarios`). The notice test below stays in `make test`.
SCENARIO = pytest.mark.horovod_scenarios

WORKER = str(SCRIPTS / "horovod_elastic_main.py")
JOB_TIMEOUT_S = 240
NONZERO = "Horovod detected that one or more processes exited with non-zero status"
RESET_LIMIT = "Horovod was shutdown because number of resets during elastic job exceeded limit: {}"


def discovery_script(path: Path, logfile: Path, schedule: list) -> Path:
    """Prints the hosts of schedule entry `epoch`, where the epoch is the number of lines rank
    0 has logged so far (one per finished epoch); an entry with epoch None is the default."""
    arms = []
    for epoch, hosts in schedule:
        pattern = "*" if epoch is None else str(epoch)
        arms.append(f"  {pattern}) printf '%s\\n' {' '.join(hosts)} ;;")
    path.write_text(
        "#!/bin/sh\n"
        f"epoch=0\n[ -f {logfile} ] && epoch=$(( $(wc -l < {logfile}) ))\n"
        'case "$epoch" in\n' + "\n".join(arms) + "\nesac\n")
    path.chmod(0o755)
    return path


@dataclass
class Outcome:
    code: int
    output: str
    results: list[dict]  # the worker's log lines, one per finished epoch
    seconds: float


def run_scenario(tmp_path: Path, jobs, *, slot_hosts: bool, discovery_schedule: list | None = None,
                 hosts: str | None = None, exit_schedule: dict | None = None,
                 exit_mode: str = "exception", num_proc: int = 2, min_num_proc: int = 2,
                 max_num_proc: int = 4, reset_limit: int | None = None,
                 cooldown_range: tuple[int, int] | None = None, epoch_wait: float | None = None,
                 epochs: int | None = None, elastic_timeout: int | None = None,
                 worker_args: tuple[str, ...] = (), name: str = "scenario") -> Outcome:
    """Horovod's `BaseElasticTests._run`, through `hvd-resilient run`."""
    assert discovery_schedule or hosts, "a discovery schedule or fixed hosts"
    logfile = tmp_path / f"{name}.log"
    cmd = [str(VENV_BIN / "hvd-resilient"), "run", "--launcher", "horovod",
           "--np", str(num_proc), "--min-np", str(min_num_proc),
           "--network-interface", "lo", "--max-restarts", "0",
           "--run-id", name, "--run-dir", str(tmp_path / f"{name}-run"),
           "--blacklist-cooldown-range", *map(str, cooldown_range or (0, 0))]
    if not slot_hosts:
        cmd.append("--no-slot-hosts")
    if hosts is not None:
        slots = sum(int(h.rsplit(":", 1)[1]) for h in hosts.split(","))
        cmd += ["--hosts", hosts, "--max-np", str(slots)]
    else:
        script = discovery_script(tmp_path / f"{name}-discover.sh", logfile, discovery_schedule)
        cmd += ["--discovery", str(script), "--max-np", str(max_num_proc)]
    if reset_limit is not None:
        cmd += ["--reset-limit", str(reset_limit)]
    if elastic_timeout is not None:
        cmd += ["--elastic-timeout", str(elastic_timeout)]
    cmd += ["--", PYTHON, WORKER, "--logfile", str(logfile)]
    if discovery_schedule:
        cmd += ["--discovery-schedule", json.dumps(discovery_schedule)]
    if epoch_wait:
        cmd += ["--epoch-wait", json.dumps(epoch_wait)]
    if epochs:
        cmd += ["--epochs", json.dumps(epochs)]
    if exit_schedule:
        cmd += ["--exit-schedule", json.dumps(exit_schedule), "--exit-mode", exit_mode]
    cmd += list(worker_args)
    t0 = time.monotonic()
    job = jobs.start(cmd, env=jobs.env(HVD_RESILIENT_DISCOVERY_INTERVAL="0.05"), name=name)
    code = job.wait(JOB_TIMEOUT_S)
    seconds = time.monotonic() - t0
    lines = logfile.read_text().splitlines() if logfile.exists() else []
    print(f"[scenario] {name}: exit {code} in {seconds:.1f} s, {len(lines)} epoch lines")
    return Outcome(code, job.output(), [json.loads(line) for line in lines], seconds)


def succeeded(out: Outcome) -> list[dict]:
    assert out.code == 0, f"exit {out.code}:\n{out.output[-4000:]}"
    return out.results


def failed_with(out: Outcome, message: str) -> None:
    assert out.code != 0, f"expected the job to fail:\n{out.output[-4000:]}"
    assert message in out.output, f"expected {message!r} in:\n{out.output[-4000:]}"


def shape(results: list[dict], *keys: str) -> list[tuple]:
    return [tuple(r[k] for k in keys) for r in results]


MODES = [pytest.param(False, id="no-slot-hosts"), pytest.param(True, id="slot-hosts")]


def machine(hostname: str, slot_hosts: bool) -> str:
    """The host of a worker's HOROVOD_HOSTNAME: with slot hosts that name is its slot,
    `<host>+<n>`, and which slot of a host gets the lowest rank is Horovod's choice (it orders
    hosts that appear together by iterating a set)."""
    if not slot_hosts:
        return hostname
    base, sep, n = hostname.rpartition("+")
    assert sep and n.isdigit(), f"{hostname!r} is not a slot host name"
    return base


# -- hosts added and removed --------------------------------------------------------------------
@SCENARIO
@pytest.mark.parametrize("slot_hosts", MODES)
@pytest.mark.parametrize("slots,num_proc,min_num_proc,max_num_proc", [(2, 2, 2, 4), (1, 1, 1, 2)])
def test_hosts_added_and_removed(tmp_path, jobs, slot_hosts, slots, num_proc, min_num_proc,
                                 max_num_proc):
    """Rank 0 waits at most 3 s (--discovery-wait) for the driver's notice of each change; the
    driver's standby workers used to hold it back while the newcomers warmed up."""
    schedule = [
        (0, [f"localhost:{slots}"]),
        (1, [f"localhost:{slots}", f"127.0.0.1:{slots}"]),
        (None, [f"127.0.0.1:{slots}"]),
    ]
    results = succeeded(run_scenario(
        tmp_path, jobs, slot_hosts=slot_hosts, discovery_schedule=schedule, num_proc=num_proc,
        min_num_proc=min_num_proc, max_num_proc=max_num_proc, name="added-removed"))
    assert len(results) == 3
    # Same sizes, start ranks and rendezvous counts in both modes: whole hosts come and go.
    # Slot hosts only rename them: a worker's HOROVOD_HOSTNAME is its slot, `localhost+0`.
    assert [(r["start_rank"], r["size"], machine(r["hostname"], slot_hosts))
            for r in results] == [
        (0, slots, "localhost"), (0, slots * 2, "localhost"), (slots, slots, "127.0.0.1")]
    assert results[2]["rendezvous"] == 3


def test_rank_0_hears_of_added_hosts_within_a_second_while_the_newcomers_warm_up(tmp_path, jobs):
    """The driver starts an added host's workers at once as standby workers (they import torch
    and Horovod ahead of the reset) and tells rank 0 at once too: the worker gives up after
    --discovery-wait 1 (1 to 2 s by its whole-second clock), where a cold start takes longer
    here. The reset then waits for the newcomers, which join as the processes started early."""
    schedule = [(0, ["localhost:1"]), (None, ["localhost:1", "127.0.0.1:1"])]
    out = run_scenario(tmp_path, jobs, slot_hosts=True, discovery_schedule=schedule,
                       num_proc=1, min_num_proc=1, max_num_proc=2,
                       worker_args=("--discovery-wait", "1"), name="notice")
    results = succeeded(out)
    assert shape(results, "size", "rendezvous") == [(1, 1), (2, 2), (2, 2)]
    # The driver's own events: the newcomer was started as a standby, and its release into
    # the new world (after rank 0 was told, and rank 0 reset) still had to wait for its
    # warm-up: rank 0 was told while it warmed up.
    evs = [e for e in events(tmp_path / "notice-run" / "events.jsonl")
           if e["event"].startswith("standby_")]
    assert [(e["event"], e["slots"]) for e in evs] == [
        ("standby_started", ["127.0.0.1+0:0"]), ("standby_released", ["127.0.0.1+0:0"])], evs
    assert evs[1]["waited_s"] > 0.5, evs  # torch alone takes longer to import


# -- one rank fails -----------------------------------------------------------------------------
@SCENARIO
@pytest.mark.parametrize("slot_hosts", MODES)
@pytest.mark.parametrize("exit_mode", ["exception", "kill"])
@pytest.mark.parametrize("fixed_hosts", [False, True],
                         ids=["single_rank_failure", "fault_tolerance_without_scaling"])
def test_one_rank_fails(tmp_path, jobs, slot_hosts, exit_mode, fixed_hosts):
    """Horovod's single rank failure (discovery) and fault tolerance without scaling (fixed
    hosts `-H`): start rank 0 exits at epoch 1, batch 0."""
    where = ({"hosts": "localhost:2,127.0.0.1:2"} if fixed_hosts
             else {"discovery_schedule": [(None, ["localhost:2", "127.0.0.1:2"])]})
    results = succeeded(run_scenario(
        tmp_path, jobs, slot_hosts=slot_hosts, exit_schedule={str((1, 0)): [0]},
        exit_mode=exit_mode, name=f"one-rank-{exit_mode}", **where))
    assert len(results) == 3
    if not slot_hosts:  # Horovod's: localhost is blacklisted, 127.0.0.1's two ranks go on
        assert shape(results, "start_rank", "size", "rendezvous") == [
            (0, 4, 1), (2, 2, 2), (2, 2, 2)]
    else:
        # Only the dead slot (localhost+0) is blacklisted; its host-mate localhost+1 (start rank
        # 1) survives and becomes rank 0 of a world of 3.
        assert shape(results, "start_rank", "size", "rendezvous") == [
            (0, 4, 1), (1, 3, 2), (1, 3, 2)]


# -- every rank fails ----------------------------------------------------------------------------
@SCENARIO
@pytest.mark.parametrize("slot_hosts", MODES)
def test_all_ranks_failure(tmp_path, jobs, slot_hosts):
    """The same in both modes: nothing is left to train."""
    out = run_scenario(tmp_path, jobs, slot_hosts=slot_hosts,
                       discovery_schedule=[(None, ["localhost:2", "127.0.0.1:2"])],
                       exit_schedule={str((1, 0)): [0, 1, 2, 3]}, name="all-ranks")
    failed_with(out, NONZERO)
    assert len(out.results) == 1  # epoch 0 finished; then everyone exited
    # The worker, ported with the migration page's lines only, writes `start` (the ported
    # loop's events, on by default under hvd-resilient run): the supervisor knows it trained
    # and would relaunch it; these scenarios allow no restart (--max-restarts 0).
    assert "exited before any rank started training" not in out.output
    assert "no rank wrote a `start` event" not in out.output
    assert "gave up after 0 restarts" in out.output


@SCENARIO
@pytest.mark.parametrize("slot_hosts", MODES)
def test_all_hosts_blacklisted(tmp_path, jobs, slot_hosts):
    """Start ranks 0 and 2 exit: one on each host."""
    out = run_scenario(tmp_path, jobs, slot_hosts=slot_hosts,
                       discovery_schedule=[(None, ["localhost:2", "127.0.0.1:2"])],
                       exit_schedule={str((1, 0)): [0, 2]}, name="all-hosts")
    if not slot_hosts:  # Horovod's: both hosts blacklisted, no slot left, the job fails
        failed_with(out, NONZERO)
        return
    # Slot hosts blacklist only the two dead slots: start ranks 1 and 3 finish at size 2.
    results = succeeded(out)
    assert shape(results, "start_rank", "size", "rendezvous") == [
        (0, 4, 1), (1, 2, 2), (1, 2, 2)]


@SCENARIO
@pytest.mark.parametrize("slot_hosts", MODES)
def test_min_hosts_timeout(tmp_path, jobs, slot_hosts):
    """Start rank 0 exits with --min-np 4: fewer than 4 slots are left in both modes (2 without
    slot hosts, 3 with), and the job fails once the 1 s elastic timeout runs out."""
    out = run_scenario(tmp_path, jobs, slot_hosts=slot_hosts,
                       discovery_schedule=[(None, ["localhost:2", "127.0.0.1:2"])],
                       exit_schedule={str((1, 0)): [0]}, num_proc=4, min_num_proc=4,
                       elastic_timeout=1, name="min-hosts")
    failed_with(out, NONZERO)


# -- reset limit ---------------------------------------------------------------------------------
@SCENARIO
@pytest.mark.parametrize("slot_hosts", MODES)
@pytest.mark.parametrize("limit", [1, 2])
def test_reset_limit(tmp_path, jobs, slot_hosts, limit):
    """Two resets (a host added, then the first one removed): a limit of 1 stops the job, 2
    lets it finish. The same with slot hosts: both slots of a host change in one reset."""
    schedule = [(0, ["localhost:2"]), (1, ["localhost:2", "127.0.0.1:2"]),
                (None, ["127.0.0.1:2"])]
    out = run_scenario(tmp_path, jobs, slot_hosts=slot_hosts, discovery_schedule=schedule,
                       reset_limit=limit, elastic_timeout=1, name=f"reset-limit-{limit}")
    if limit == 1:
        failed_with(out, RESET_LIMIT.format(1))
    else:
        assert len(succeeded(out)) == 3


# -- a blacklisted host comes back ---------------------------------------------------------------
@SCENARIO
@pytest.mark.parametrize("slot_hosts", MODES)
def test_resurrecting_blacklisted_hosts_exponential_backoff(tmp_path, jobs, slot_hosts):
    """Start rank 3 exits at epochs 1 and 3, with a 1-2 s cooldown and 0.25 s epochs."""
    out = run_scenario(tmp_path, jobs, slot_hosts=slot_hosts,
                       discovery_schedule=[(None, ["localhost:2", "127.0.0.1:2"])],
                       exit_schedule={str((1, 0)): [3], str((3, 0)): [3]},
                       exit_mode="exception", epoch_wait=0.25, epochs=5, cooldown_range=(1, 2),
                       name="resurrect")
    results = succeeded(out)
    assert len(results) == 5
    # Horovod's: 127.0.0.1 is blacklisted after the first exit and stays out to the end:
    # (0, 4, 1), then (0, 2, 2) for every later epoch. With slot hosts only slot 127.0.0.1+1
    # is, and the world goes on at 3, not 2.
    out_size = 3 if slot_hosts else 2
    # That "to the end" is a race Horovod's test relies on: epochs 1-4 (10 batches and a
    # 0.25 s sleep each) must end within the 2 s cooldown. This machine loses it with our
    # stack (epochs of 0.5-0.7 s at load 9-11). Seen: without slot hosts the host back for
    # the last epoch, (0, 4, 3) or (0, 4, 4); with slot hosts the slot back before epoch 1
    # ended, then start rank 3 exiting again at epoch 3: rendezvous 1, 3, 3, 5, 5. So the
    # exact sequence is asserted when the host stayed out; otherwise what holds at any timing.
    assert shape(results[:1], "start_rank", "size", "rendezvous") == [(0, 4, 1)]
    later = results[1:]
    assert {r["start_rank"] for r in later} == {0}, results  # start rank 0 never exits
    assert {r["size"] for r in later} <= {out_size, 4}, results
    rendezvous = [r["rendezvous"] for r in results]
    assert rendezvous == sorted(rendezvous) and rendezvous[1] >= 2, results  # the exit reset
    # The slot can also come back and leave again between two epoch records (back at the
    # start of epoch 3, out at its first batch: every record at the smaller size, one more
    # rendezvous, seen once at load ~3): its second exit says so in the output.
    assert "check_rank and exit epoch=1" in out.output  # the first exit, where it is told
    came_back = (any(r["size"] != out_size for r in later)
                 or "check_rank and exit epoch=3" in out.output)
    if not came_back:
        assert rendezvous[1:] == [2, 2, 2, 2], results  # Horovod's exact expectation
    else:  # the host came back: one reset for its return, after the exit's reset
        assert rendezvous[-1] >= 3, results
