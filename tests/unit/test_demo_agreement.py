"""The demo's closing line: all ranks agree, or a loud banner and a failing exit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hvd_resilient.launch import demo


def write(path: Path, done: list[dict]) -> Path:
    path.write_text("".join(json.dumps({"ts": 1.0, "event": "done", "size": len(done),
                                        "step": 9, **d}) + "\n" for d in done))
    return path


def test_equal_ranks_are_said_to_agree(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ev = write(tmp_path / "e.jsonl", [
        {"rank": r, "params_sha256": "ab" * 32, "digests": {"model": "1", "optimizer": "2"}}
        for r in range(3)])
    assert demo._ranks_agree(ev) is True
    assert "all 3 ranks hold the same parameters" in capsys.readouterr().out


def test_a_differing_optimizer_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ev = write(tmp_path / "e.jsonl", [
        {"rank": 0, "params_sha256": "ab", "digests": {"model": "1", "optimizer": "2"}},
        {"rank": 1, "params_sha256": "ab", "digests": {"model": "1", "optimizer": "3"}}])
    assert demo._ranks_agree(ev) is False
    assert "components optimizer" in capsys.readouterr().out


def test_no_finished_rank_compares_nothing(tmp_path: Path) -> None:
    (tmp_path / "e.jsonl").write_text("")
    assert demo._ranks_agree(tmp_path / "e.jsonl") is None
