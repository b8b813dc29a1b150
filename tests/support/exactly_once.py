"""The samples.jsonl history of tests/scripts/elastic_job.py, and its exactly-once check; the
`epoch_end` events the trainer writes, checked against the data set."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from hvd_resilient.report.analysis import analyze
from hvd_resilient.state.ids_digest import digest, to_hex
from tests.support.jobs import events


def final_history(run: Path) -> list[list[dict]]:
    """The steps the final model holds, each as its ranks' samples.jsonl lines.

    A step undone by a restore is run again later under the same number, so a step's last line
    in time belongs to the final run of it; its ranks are the latest lines with that step, world
    size and sampler position. Rank lines are written before the forward pass, so a rank that
    died inside a step still has its line; every step also carries its sampler position, which
    must continue exactly where the step before ended (a restore that forgot the sampler fails
    here).
    """
    lines = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    done = [e for e in events(run / "events.jsonl") if e["event"] == "done"]
    assert done, "no rank reported done"
    n_steps = done[-1]["steps"]
    latest: dict[tuple, dict] = {}
    for rec in sorted(lines, key=lambda r: r["t"]):
        latest[(rec["step"],)] = rec
        latest[(rec["step"], rec["size"], rec["epoch"], rec["pos"], rec["rank"])] = rec
    history = []
    for k in range(n_steps):
        assert (k,) in latest, f"step {k} of {n_steps} has no record"
        last = latest[(k,)]
        ranks = []
        for r in range(last["size"]):
            key = (k, last["size"], last["epoch"], last["pos"], r)
            assert key in latest, f"step {k} at size {last['size']}: rank {r} has no record"
            ranks.append(latest[key])
        history.append(ranks)
    return history


def assert_exactly_once(run: Path, n_samples: int) -> int:
    """Every completed epoch of the final model's history used each sample id exactly once."""
    per_epoch: dict[int, list[int]] = defaultdict(list)
    where = None  # (epoch, position) the next step must start at
    for k, ranks in enumerate(final_history(run)):
        epoch, pos = ranks[0]["epoch"], ranks[0]["pos"]
        if where is not None and where[1] >= n_samples:
            where = (where[0] + 1, 0)
        assert where is None or (epoch, pos) == where, (
            f"step {k} starts at epoch {epoch} position {pos}, but the step before ended at "
            f"epoch {where[0]} position {where[1]}"
        )
        ids = [i for rec in ranks for i in rec["ids"]]
        per_epoch[epoch].extend(ids)
        where = (epoch, pos + len(ids))
    complete = [e for e in per_epoch if e < max(per_epoch)]
    assert complete, f"no epoch completed (epochs seen: {sorted(per_epoch)})"
    for e in complete:
        ids = per_epoch[e]
        assert sorted(ids) == list(range(n_samples)), (
            f"epoch {e}: {len(ids)} ids, {len(set(ids))} distinct, expected each of "
            f"{n_samples} exactly once"
        )
    last = per_epoch[max(per_epoch)]
    assert len(last) == len(set(last)), "the running epoch repeated a sample"
    return len(complete)


def assert_epoch_ends(run: Path, n_samples: int, epochs: int) -> list[dict]:
    """Every epoch 0 .. epochs-1 ended with rank 0's `epoch_end` event whose count and digest of
    the consumed ids are the data set's (each id 0 .. n-1 once; the digest worked out here in
    plain Python, not taken from the event), and `hvd-resilient report` finds no problem. An
    epoch may end twice (a rollback or a restart past its end): each event must hold."""
    expected = to_hex(digest(range(n_samples)))
    evs = events(run / "events.jsonl")
    ends = [e for e in evs if e["event"] == "epoch_end"]
    assert sorted({e["epoch"] for e in ends}) == list(range(epochs)), ends
    for e in ends:
        assert e["rank"] == 0, e
        assert (e["samples"], e["ids_digest"]) == (n_samples, expected), e
        assert (e["expected_samples"], e["expected_ids_digest"]) == (n_samples, expected), e
    report = analyze(evs)
    assert not report.problems, report.problems
    assert [x["exactly_once"] for x in report.data_epochs] == [True] * epochs, report.data_epochs
    return ends
