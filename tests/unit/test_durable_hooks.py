"""The durable-checkpoint and memory-tier bases own their public methods (the sharded forms fill
in protected hooks only), and every wait on an upload or on the memory tier's background
thread ends: what happens when it expires is one line (an error, an event, a warning), never a
hang."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from hvd_resilient.config import TrainConfig
from hvd_resilient.errors import RESTARTABLE_EXIT_CODE, error_exit_code
from hvd_resilient.training import durable
from hvd_resilient.training.durable import (
    DurableCheckpoints,
    FinalCheckpointError,
    UploadStalled,
)
from hvd_resilient.training.durable_sharded import ShardedDurableCheckpoints
from hvd_resilient.training.memory_tier import MemoryCommits
from hvd_resilient.training.memory_tier_sharded import ShardedMemoryCommits


@pytest.mark.parametrize("base,sub", [(DurableCheckpoints, ShardedDurableCheckpoints),
                                      (MemoryCommits, ShardedMemoryCommits)])
def test_the_sharded_forms_override_no_public_method(base: type, sub: type) -> None:
    overridden = sorted(name for name in vars(sub)
                        if not name.startswith("_") and name in dir(base)
                        and callable(getattr(base, name)) and name != "sharded")
    assert overridden == [], f"{sub.__name__} overrides {overridden}: fill in a hook instead"


class _State:
    def __init__(self, step: int) -> None:
        self.step, self.epoch = step, 0
        self.ckpt_requested = self.ckpt_published = -1
        self.fatal = ""

    def on_sync(self, fn: Any) -> None:
        pass

    def on_commit(self, fn: Any) -> None:
        pass


class _Backend:
    resume_on_every_rank = False
    numbers_generations = False

    def __init__(self) -> None:
        self.gathers = 0

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1

    def allgather_object(self, obj: Any) -> list[Any]:
        self.gathers += 1
        return [obj]


class _StuckWriter:
    """An upload that never ends (a store that hangs)."""

    last_saved = None

    def __init__(self, step: int) -> None:
        self.step, self.waits = step, []

    def holds(self, step: int) -> bool:
        return step == self.step

    def wait(self, timeout: float | None) -> bool:
        assert timeout is not None, "an unbounded wait"
        self.waits.append(timeout)
        return False

    def close(self, timeout: float | None) -> bool:
        return self.wait(timeout)


@contextlib.contextmanager
def _records(name: str) -> Iterator[list[logging.LogRecord]]:
    got: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = got.append  # type: ignore[method-assign]
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield got
    finally:
        logger.removeHandler(handler)


def _durable(tmp_path: Any, step: int = 30) -> tuple[DurableCheckpoints, _StuckWriter]:
    ckpt = DurableCheckpoints(TrainConfig(run_dir=str(tmp_path)), _State(step),  # type: ignore[arg-type]
                              events=None, backend=_Backend())  # type: ignore[arg-type]
    writer = _StuckWriter(step)
    ckpt._writer = writer  # type: ignore[assignment]
    return ckpt, writer


def test_a_final_upload_that_never_ends_stops_the_run_restartably(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(durable, "UPLOAD_WAIT_SECONDS", 0.05)
    ckpt, writer = _durable(tmp_path)
    ckpt.state.ckpt_requested = 30  # saved at this step already, still uploading
    with _records("hvd_resilient.training.durable") as logged, \
            pytest.raises(FinalCheckpointError, match="still uploading after") as err:
        ckpt.finish()
    assert error_exit_code(err.value) == RESTARTABLE_EXIT_CODE
    assert len(writer.waits) == 2 and all(w <= 0.05 for w in writer.waits)  # one deadline
    assert [r.levelname for r in logged] == ["ERROR"]  # said once, not per attempt


def test_a_save_behind_a_stuck_upload_raises_before_any_collective(tmp_path) -> None:
    ckpt, writer = _durable(tmp_path)
    ckpt._in_flight = lambda: True  # type: ignore[method-assign]  # the sharded saver's case
    with pytest.raises(UploadStalled, match="still running after") as err:
        ckpt.save()
    assert error_exit_code(err.value) == RESTARTABLE_EXIT_CODE
    assert writer.waits == [durable.UPLOAD_WAIT_SECONDS]
    assert ckpt.backend.gathers == 0 and ckpt.state.ckpt_requested == -1  # type: ignore[attr-defined]


def test_close_bounds_its_wait_and_says_what_stays_invisible(tmp_path) -> None:
    ckpt, writer = _durable(tmp_path)
    with _records("hvd_resilient.training.durable") as logged:
        ckpt.close()
    assert writer.waits == [durable.UPLOAD_WAIT_SECONDS]
    assert "stays invisible" in logged[0].getMessage()


class _Events(list):
    def emit(self, name: str, **fields: Any) -> None:
        self.append((name, fields))


def _tier(tmp_path: Any) -> MemoryCommits:
    cfg = TrainConfig(run_dir=str(tmp_path))
    cfg.memory_tier.enabled = False  # built as off; the test drives the writing by hand
    tier = MemoryCommits(cfg, _State(7), _Events(), _Backend())  # type: ignore[arg-type]
    tier.finish_wait_seconds = 0.05
    return tier


def test_a_commit_behind_a_segment_still_finishing_is_kept_in_the_process(tmp_path) -> None:
    tier = _tier(tmp_path)
    tier._idle.clear()  # the previous segment never finishes

    class Folder:
        def begin(self, *args: Any) -> Any:
            raise AssertionError("written over a segment still being finished")

    tier._write(Folder(), 7, {})  # type: ignore[arg-type]
    ((name, fields),) = tier.events  # type: ignore[misc]
    assert name == "memory_commit_failed" and fields["ckpt_step"] == 7
    assert "still being finished after 0.05s" in fields["error"]
    assert tier.flush() is False  # bounded by default too


def test_close_does_not_wait_for_a_thread_that_never_ends(tmp_path) -> None:
    tier = _tier(tmp_path)
    stop = threading.Event()
    tier._thread = threading.Thread(target=stop.wait, daemon=True)
    tier._thread.start()
    tier._jobs.put("a job the thread never takes")
    with _records("hvd_resilient.training.memory_tier") as logged:
        tier.close()
    stop.set()
    assert tier._thread is None
    assert "still being finished" in logged[0].getMessage()


def test_an_in_place_world_stamps_its_generation_on_every_memory_segment(tmp_path) -> None:
    """In place, a segment says which world wrote it (beside the job's lease epoch), as a
    durable checkpoint's fence does; a backend that does not number its worlds writes none."""
    seen: list[dict[str, Any]] = []

    class Folder:
        def begin(self, step: int, state: Any, meta: dict[str, Any]) -> Any:
            seen.append(meta)
            raise OSError("kept in the process (the test stops here)")

    class Generations(_Backend):
        numbers_generations = True

        def generation(self) -> int:
            return 3

    for backend, want in ((Generations(), 3), (_Backend(), None)):
        tier = _tier(tmp_path)
        tier.backend = backend  # type: ignore[assignment]
        tier._write(Folder(), 7, {})  # type: ignore[arg-type]
        assert seen[-1].get("generation") == want, seen
