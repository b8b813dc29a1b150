"""Event log, random streams and fault plans: small pieces with sharp contracts."""

from __future__ import annotations

import ast
import json
import multiprocessing as mp
import random

import numpy as np
import pytest
import torch

from hvd_resilient.errors import ConfigError
from hvd_resilient.events import RESERVED, EventLog, ckpt_step, read_events
from hvd_resilient.state import rng
from hvd_resilient.training.faults import FaultPlan, InjectedFault
from tests.support.paths import ROOT


def test_event_has_contract_keys_and_hides_secrets(tmp_path):
    log = EventLog(tmp_path / "e.jsonl", rank=3, size=4, step=lambda: 17)
    log.emit("checkpoint_saved", seconds=1.5, extra={"aws_secret_access_key": "S3CR3T"})
    (rec,) = list(read_events(tmp_path / "e.jsonl"))
    assert {"ts", "event", "rank", "size", "step"} <= set(rec)
    assert (rec["rank"], rec["size"], rec["step"]) == (3, 4, 17)
    assert "S3CR3T" not in (tmp_path / "e.jsonl").read_text()


@pytest.mark.parametrize("key", ["step", "ts", "rank", "size"])
def test_a_field_named_like_a_fixed_key_is_refused(tmp_path, key):
    """`step` is the training step on every event: a checkpoint's own is `ckpt_step`."""
    log = EventLog(tmp_path / "e.jsonl", step=lambda: 17)
    with pytest.raises(ValueError, match=f"'checkpoint_saved': field '{key}' is reserved"):
        log.emit("checkpoint_saved", **{key: 5})
    assert not (tmp_path / "e.jsonl").exists()  # nothing written
    rec = log.emit("checkpoint_saved", ckpt_step=5)
    assert (rec["step"], rec["ckpt_step"]) == (17, 5)


def test_ckpt_step_reads_logs_of_every_version():
    new = {"ts": 1.0, "event": "checkpoint_saved", "rank": 0, "size": 2, "step": 17,
           "ckpt_step": 10}
    assert ckpt_step(new) == 10
    # before ckpt_step: a checkpoint event's `step` was its checkpoint's, a memory tier
    # event's was `at_step`
    assert ckpt_step({"ts": 1.0, "event": "checkpoint_saved", "rank": 0, "size": 2,
                      "step": 10}) == 10
    assert ckpt_step({"ts": 1.0, "event": "memory_commit", "rank": 0, "size": 2, "step": 12,
                      "at_step": 10}) == 10
    assert ckpt_step({"event": "x", "step": True}) is None and ckpt_step({}) is None


def reserved_fields(source: str) -> list[tuple[int, str]]:
    """(line, key) of each call `X.emit("name", key=...)` / `emit(cb, "name", {"key": ...})`
    in `source` whose field is one of the event log's fixed keys."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if not name.endswith("emit"):
            continue
        found += [(node.lineno, k.arg) for k in node.keywords if k.arg in RESERVED]
        dicts = [a for a in node.args if isinstance(a, ast.Dict)]
        dicts += [k.value for k in node.keywords if k.arg is None and isinstance(k.value, ast.Dict)]
        found += [(node.lineno, key.value) for d in dicts for key in d.keys
                  if isinstance(key, ast.Constant) and key.value in RESERVED]
    return found


def test_no_event_in_the_package_passes_a_fixed_key():
    assert reserved_fields('self.events.emit("memory_commit", step=3)\n'
                           'emit(self.on_event, "checkpoint_saved", {"step": 3, "url": u})\n'
                           'emit(cb, "x", {"ckpt_step": 3})\nlog.emit("y", ckpt_step=1)\n'
                           ) == [(1, "step"), (2, "step")]
    for path in sorted((ROOT / "hvd_resilient").rglob("*.py")):
        for line, key in reserved_fields(path.read_text()):
            pytest.fail(f"{path.relative_to(ROOT)}:{line}: an event field named {key!r} "
                        "(reserved: the event log's own; a checkpoint's step is ckpt_step)")


def test_torn_and_garbage_lines_are_skipped(tmp_path):
    p = tmp_path / "e.jsonl"
    log = EventLog(p)
    log.emit("start")
    with open(p, "ab") as fh:
        fh.write(b"not json\n")
    log.emit("commit")
    with open(p, "ab") as fh:
        fh.write(b'{"ts": 1, "event": "comm')  # a writer killed mid-line
    assert [e["event"] for e in read_events(p)] == ["start", "commit"]
    assert list(read_events(tmp_path / "missing.jsonl")) == []


def _writer(path: str, tag: int) -> None:
    log = EventLog(path, rank=tag)
    for i in range(300):
        log.emit("tick", i=i, pad="x" * 200)


def test_concurrent_appenders_never_interleave(tmp_path):
    p = str(tmp_path / "e.jsonl")
    procs = [mp.get_context("fork").Process(target=_writer, args=(p, k)) for k in range(4)]
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join(60)
    lines = open(p).read().splitlines()
    assert len(lines) == 1200
    assert all(json.loads(line)["event"] == "tick" for line in lines)


def test_rng_capture_restore_all_streams():
    state = rng.capture()
    a = (torch.rand(3), np.random.rand(3), random.random())
    rng.restore(state)
    b = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


def test_rng_state_survives_weights_only_load(tmp_path):
    torch.save(rng.capture(), tmp_path / "r.pt")
    rng.restore(torch.load(tmp_path / "r.pt", weights_only=True))


def test_derived_seed_is_stable():
    assert rng.derived_seed(1, "rank", 2) == rng.derived_seed(1, "rank", 2)
    assert rng.derived_seed(1, "rank", 2) != rng.derived_seed(1, "rank", 3)


def test_fault_plan_fires_once_per_run(tmp_path):
    plan = FaultPlan.parse("raise:rank=1:step=5", str(tmp_path))
    plan.maybe_fire(0, 5)
    plan.maybe_fire(1, 4)
    with pytest.raises(InjectedFault):
        plan.maybe_fire(1, 5)
    FaultPlan.parse("raise:rank=1:step=5", str(tmp_path)).maybe_fire(1, 5)  # refilled slot


def test_fault_plan_bad_spec():
    with pytest.raises(ConfigError, match="cannot parse 'explode:rank=1'"):
        FaultPlan.parse("explode:rank=1", "/tmp")


def test_memory_growth_flagged_only_when_steady():
    from hvd_resilient.training.rss import GrowthWatch, sample

    w = GrowthWatch(resets=3, min_growth=0.10)
    assert [w.at_reset(x) for x in (100, 105, 111)] == [None, None, None]
    warning = w.at_reset(120)
    assert warning and "+20%" in warning
    flat = GrowthWatch(resets=3, min_growth=0.10)
    assert all(flat.at_reset(x) is None for x in (100, 130, 120, 150, 140))
    assert sample()["rss_bytes"] > 0


def test_event_during_a_reset_keeps_the_last_rank_and_size(tmp_path):
    up = {"rank": 0, "size": 3}

    def rank() -> int:
        if up["rank"] is None:
            raise ValueError("Horovod has not been initialized")  # what hvd.rank() does then
        return up["rank"]

    log = EventLog(tmp_path / "e.jsonl", rank=rank, size=lambda: up["size"])
    log.emit("commit")
    up["rank"] = None  # shut down for a reset: the checkpoint writer still reports
    e = log.emit("checkpoint_saved")
    assert (e["rank"], e["size"]) == (0, 3)
    fresh = EventLog(tmp_path / "f.jsonl", rank=rank)
    assert fresh.emit("start")["rank"] == -1  # nothing known yet: says so


def test_a_log_line_while_the_backend_has_no_rank_is_written_and_raises_nothing(capsys):
    """The checkpoint writer's thread logs at any moment, also between a reset's shutdown and
    init, when Horovod's rank() raises; the filter used to raise with it and kill the thread
    (seen: the writer died mid-run, no checkpoint after it)."""
    import logging

    from hvd_resilient import log

    def no_rank() -> int:
        raise ValueError("Horovod has not been initialized; use hvd.init().")

    log.setup(rank_fn=lambda: 0)
    log.setup(rank_fn=no_rank)
    try:
        logging.getLogger("hvd_resilient.test").warning("pruned checkpoints at steps [46]")
    finally:
        log.setup(rank_fn=lambda: 0)
    assert "[rank ?] WARNING hvd_resilient.test: pruned checkpoints at steps [46]" in \
        capsys.readouterr().err


def test_a_host_agent_says_which_host_it_is_not_a_rank(capsys):
    """Every in-place host agent logs at rank 0's level; `[rank 0]` on host 1's agent's lines
    (its cut-off, its takeover) sent a reader to the wrong host."""
    import logging

    from hvd_resilient import log

    log.setup(rank_fn=lambda: 0, who="agent h1")
    try:
        logging.getLogger("hvd_resilient.test").info("host 1 coordinates from generation 3 on")
    finally:
        log.setup(rank_fn=lambda: 0)
    assert "[agent h1] INFO hvd_resilient.test: host 1 coordinates" in capsys.readouterr().err
