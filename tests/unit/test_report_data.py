"""`hvd-resilient report` on `epoch_end` events: a clean log says "exactly once" per epoch; a
tampered event (a sample added, one taken away, the count or the digest edited) is a PROBLEM
that names the mismatch. The logs are written through the real EventLog from the real
sampler's records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hvd_resilient.events import EventLog, read_events
from hvd_resilient.report import cli
from hvd_resilient.report.analysis import analyze
from hvd_resilient.report.text import render
from hvd_resilient.state import ids_digest as d
from hvd_resilient.state.sampler import ElasticDataSampler

N = 200


def epoch_records(epochs: int) -> list[dict[str, Any]]:
    """What the trainer writes at each epoch's end, from a sampler run at world size 3."""
    s = ElasticDataSampler(N, seed=1)
    out = []
    for _ in range(epochs):
        while not s.epoch_done():
            s.advance(s.next_slice(0, 3, 8).global_count)
        out.append(s.epoch_record())
        s.set_epoch(s.epoch + 1)
    return out


def write_log(run: Path, records: list[dict[str, Any]]) -> Path:
    log = EventLog(run / "events.jsonl", rank=0, size=3)
    log.emit("start", pid=1, host="h", run_id="t")
    for i, rec in enumerate(records):
        log.step_source = 9 * (i + 1)
        log.emit("epoch_end", **rec)
    log.emit("done")
    return run


def report(run: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    assert cli.main([str(run), "--no-plot", *extra]) == 0
    return capsys.readouterr().out


def test_a_clean_log_says_exactly_once_per_epoch(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = report(write_log(tmp_path, epoch_records(3)), capsys)
    for e in range(3):
        assert f"epoch {e}: {N} samples, digest matches the dataset (exactly once)" in out
    assert "PROBLEM" not in out
    assert out.count("\ndata ") == 1, "one label for the section"


def tamper(rec: dict[str, Any], *, add: int | None = None, drop: int | None = None,
           samples: int | None = None) -> dict[str, Any]:
    digest = d.from_hex(rec["ids_digest"])
    assert digest is not None
    count = rec["samples"]
    if add is not None:
        digest, count = digest + d.mix(add), count + 1
    if drop is not None:
        digest, count = digest - d.mix(drop), count - 1
    return {**rec, "samples": count if samples is None else samples,
            "ids_digest": d.to_hex(digest)}


@pytest.mark.parametrize("how,expected", [
    (dict(add=17), f"epoch 1: {N + 1} samples, the dataset has {N}: 1 duplicated "
                   "(sample 17 used twice)"),
    (dict(drop=42), f"epoch 1: {N - 1} samples, the dataset has {N}: 1 missing "
                    "(sample 42 never used)"),
    (dict(add=3, drop=4), f"epoch 1: {N} samples, the dataset has {N}: the right count but "
                          "other ids"),
    (dict(add=3, samples=N), f"epoch 1: {N} samples, the dataset has {N}: the right count but "
                             "other ids"),
    (dict(samples=N + 2), f"epoch 1: {N + 2} samples, the dataset has {N}: 2 duplicated; yet "
                          "the digest matches: the event contradicts itself"),
])
def test_a_tampered_event_is_a_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       how: dict[str, int], expected: str) -> None:
    records = epoch_records(3)
    records[1] = tamper(records[1], **how)
    run = write_log(tmp_path, records)
    out = report(run, capsys)
    problem = [line for line in out.splitlines() if line.startswith("PROBLEM")]
    assert len(problem) == 1 and expected in problem[0], out
    assert "epoch 0: 200 samples, digest matches" in out
    assert "epoch 2: 200 samples, digest matches" in out
    doc = json.loads(report(run, capsys, "--json"))
    assert len(doc["problems"]) == 1 and expected in doc["problems"][0]
    assert [x["exactly_once"] for x in doc["data_epochs"]] == [True, False, True]


def test_an_epoch_that_ended_twice_is_one_line_unless_the_two_differ(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A rollback past an epoch's end makes it end again: equal events are one line; if one
    of them was tampered with it is still flagged."""
    records = epoch_records(2)
    out = report(write_log(tmp_path / "a", [records[0], records[0], records[1]]), capsys)
    assert out.count("epoch 0:") == 1 and "PROBLEM" not in out
    out = report(write_log(tmp_path / "b", [records[0], tamper(records[0], drop=9),
                                            records[1]]), capsys)
    assert "epoch 0: 200 samples, digest matches" in out
    assert "PROBLEM       epoch 0: 199 samples" in out and "(sample 9 never used)" in out


def test_malformed_and_unknown_tallies(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A tally unknown (resumed mid-epoch from a checkpoint older than it) is not checked, not
    a problem; an event stripped of its digest or expectation is."""
    records = epoch_records(4)
    records[0] = {**records[0], "samples": None, "ids_digest": None}
    records[1] = {**records[1], "ids_digest": "not a digest"}
    records[2] = {k: v for k, v in records[2].items() if k != "expected_ids_digest"}
    out = report(write_log(tmp_path, records), capsys)
    assert "epoch 0: not checked: resumed mid-epoch" in out
    problems = [line for line in out.splitlines() if line.startswith("PROBLEM")]
    assert len(problems) == 2, out
    assert "epoch 1: the event has no valid sample count or digest" in problems[0]
    assert "epoch 2: the event has no valid expected count or digest" in problems[1]
    assert "epoch 3: 200 samples, digest matches" in out


def test_many_epochs_are_shown_as_ranges_around_a_problem(tmp_path: Path) -> None:
    records = epoch_records(14)
    records[6] = tamper(records[6], add=1)
    text = render(analyze(read_events(write_log(tmp_path, records) / "events.jsonl")))
    lines = [line for line in text.splitlines()
             if line.startswith(("data", "PROBLEM", " " * 14 + "epoch"))]
    assert lines == [
        "data          epochs 0-5: 200 samples each, digest matches the dataset (exactly once)",
        "PROBLEM       epoch 6: 201 samples, the dataset has 200: 1 duplicated (sample 1 used "
        "twice)",
        "data          epochs 7-13: 200 samples each, digest matches the dataset (exactly once)",
    ]
    # a range never spans an epoch without an event
    del records[9]
    text = render(analyze(read_events(write_log(tmp_path / "gap", records) / "events.jsonl")))
    assert "epochs 7-8: 200 samples each" in text and "epochs 10-13: 200 samples each" in text
