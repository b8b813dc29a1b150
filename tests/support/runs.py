"""What a run left in its folder: the commits, world sizes and final digests in its
events.jsonl, and the markers of the faults its plan fired.

A planned fault (`HVD_RESILIENT_FAULT`, hvd_resilient/training/faults.py) writes no event: as
it fires it creates `.fault-I-KIND-rR-sS` in the run folder (claimed atomically, so each
planned fault fires at most once per run, restarts included), holding when it fired. A
recovery test whose fault never fired passes for the wrong reason, so a test that plans faults
says how many fired.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.jobs import events


def commits(run: Path) -> list[dict]:
    return [e for e in events(run / "events.jsonl") if e["event"] == "commit"]


def sizes_seen(run: Path) -> list[int]:
    """The world sizes rank 0's commits went through, each change once."""
    out: list[int] = []
    for e in commits(run):
        if not out or out[-1] != e["size"]:
            out.append(e["size"])
    return out


def final_digests(run: Path) -> dict[int, str]:
    done = [e for e in events(run / "events.jsonl") if e["event"] == "done"]
    assert done, "no rank reported done"
    return {e["rank"]: e["params_sha256"] for e in done}


def fault_times(run: Path) -> list[float]:
    """When each fired fault fired (time.time()), earliest first."""
    return sorted(float(p.read_text()) for p in run.glob(".fault-*"))


def assert_faults_fired(run: Path, n: int) -> list[float]:
    """Exactly `n` planned faults fired in `run`; returns when, earliest first."""
    fired = sorted(p.name for p in run.glob(".fault-*"))
    assert len(fired) == n, f"expected {n} injected fault(s) to fire in {run}, got {fired}"
    return fault_times(run)


def resumed_from_last_commit(evs: list[dict], source: str = "memory",
                             commit_every: int = 5) -> dict:
    """The one resume of a run: from the memory tier (or a peer's copy), at the newest commit
    a memory_commit event reported before it: nothing but the steps since that commit redone.

    One commit newer is right too: the writer completes a segment and then reports it, and
    the restart can end it between the two (seen in CI: segment 70 resumed, 69 the newest
    reported). Older is the defect this catches: a complete commit passed over."""
    (resume,) = [e for e in evs if e["event"] == "resume"]
    committed = [e["ckpt_step"] for e in evs if e["event"] == "memory_commit"
                 and e["ts"] < resume["ts"]]
    assert committed, "no commit reached the memory tier before the restart"
    assert resume.get("source") == source, resume
    newest = max(committed)
    assert newest <= resume["from_step"] <= newest + commit_every, (resume,
                                                                    sorted(committed)[-3:])
    return resume
