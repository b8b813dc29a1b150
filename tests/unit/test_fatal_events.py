"""The one reader of `fatal` events, the recorder, and the launcher's rank and size."""

from __future__ import annotations

import time

from hvd_resilient.events import EventLog, read_events
from hvd_resilient.fatal_events import fatal_events, record_fatal
from hvd_resilient.launcher_place import launcher_rank, launcher_size


def test_fatal_events_since_a_time_oldest_first(tmp_path):
    path = tmp_path / "events.jsonl"
    assert fatal_events(path, 0.0) == []  # no log yet
    log = EventLog(path, rank=0, size=2)
    log.emit("fatal", error="old")
    since = time.time()
    log.emit("start")
    log.emit("fatal", error="a")
    log.emit("fatal", error="b")
    assert [e["error"] for e in fatal_events(path, since)] == ["a", "b"]
    assert [e["error"] for e in fatal_events(path, since, tail_bytes=None)] == ["a", "b"]
    assert [e["error"] for e in fatal_events(path, 0.0)] == ["old", "a", "b"]


def test_the_whole_log_is_read_when_asked(tmp_path):
    """A rank's fatal error, then the other ranks trained on: the tail alone misses it."""
    path = tmp_path / "events.jsonl"
    log = EventLog(path, rank=0, size=2)
    log.emit("fatal", error="early")
    for i in range(200):
        log.emit("commit", i=i)
    assert fatal_events(path, 0.0, tail_bytes=2000) == []
    assert [e["error"] for e in fatal_events(path, 0.0, tail_bytes=None)] == ["early"]


def test_record_fatal_once_with_the_launchers_rank(tmp_path):
    since = time.time()
    assert record_fatal("", "x", since, rank=None, size=None) is False  # no run folder
    assert record_fatal(str(tmp_path), "config: bad", since, rank=3, size=4) is True
    assert record_fatal(str(tmp_path), "config: bad", since, rank=2, size=4) is True
    (ev,) = read_events(tmp_path / "events.jsonl")
    assert (ev["event"], ev["rank"], ev["size"], ev["error"], ev["step"]) == (
        "fatal", 3, 4, "config: bad", -1)
    assert record_fatal(str(tmp_path / "events.jsonl" / "x"), "e", since, rank=None,
                        size=None) is False  # cannot be written: the caller prints it


def test_the_launchers_rank_and_size_in_its_own_names():
    assert launcher_rank({}) is None and launcher_size({}) is None
    assert (launcher_rank({"OMPI_COMM_WORLD_RANK": "3"}),
            launcher_size({"OMPI_COMM_WORLD_SIZE": "4"})) == (3, 4)
    assert launcher_rank({"HOROVOD_RANK": "1", "RANK": "5"}) == 1  # horovodrun's first
    assert launcher_rank({"RANK": "x", "SLURM_PROCID": "2"}) == 2  # not a number: skipped
