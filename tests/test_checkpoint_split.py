"""A state split into parts on real storage (disk and SeaweedFS): it comes back equal, tied
weights stay tied, a corrupt part makes the whole checkpoint skipped (the previous one loads),
and checkpoints in the older single ``state.pt`` layout still load."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from test_checkpoint_manager import Events, flip_byte

from hvd_resilient.checkpoint import CheckpointManager, snapshot_state_dict, to_buffer
from hvd_resilient.checkpoint.split import (
    INDEX_FILE,
    LEGACY_FILE,
    decode_file,
    join_state,
    part_name,
    split_state,
)


@pytest.fixture(params=["file", "s3"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/ckpt"
    return request.getfixturevalue("s3_url")


def _state(seed: int) -> dict:
    """A training state shaped like DurableCheckpoints': model, Adam, tuples, plain values."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    shared = torch.randn(100)
    return snapshot_state_dict({
        "model": model.state_dict(), "optimizer": opt.state_dict(), "step": seed,
        "tied": (shared, shared), "rng": [torch.get_rng_state(), None, "x"],
    })


def _save(mgr: CheckpointManager, step: int, files: dict) -> None:
    mgr.save(step, 0, 1, {name: to_buffer(obj) for name, obj in files.items()})


def _assert_same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b)  # type: ignore[arg-type]
        for k in a:
            _assert_same(a[k], b[k])  # type: ignore[index]
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)  # type: ignore[arg-type]
        for x, y in zip(a, b, strict=True):  # type: ignore[call-overload]
            _assert_same(x, y)
    else:
        assert a == b


def test_split_bounds_parts_and_join_restores_everything() -> None:
    state = _state(1)
    files = split_state(state, part_bytes=20_000)  # the 64x64 weights are 16 KB each
    parts = sorted(n for n in files if n != INDEX_FILE)
    assert parts == [part_name(i) for i in range(len(parts))] and len(parts) >= 3
    for name in parts:
        assert all(isinstance(t, torch.Tensor) for t in files[name].values())
    back = join_state({n: decode_file(n, to_buffer(obj)) for n, obj in files.items()})
    _assert_same(state, back)
    assert isinstance(back["model"], OrderedDict)
    assert back["model"]._metadata == state["model"]._metadata  # load_state_dict reads it
    assert back["tied"][0].data_ptr() == back["tied"][1].data_ptr()  # still one tensor
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    fresh.load_state_dict(back["model"])


def test_split_checkpoint_roundtrip_on_store(url: str) -> None:
    mgr = CheckpointManager(url)
    state = _state(2)
    files = split_state(state, part_bytes=20_000)
    _save(mgr, 5, files)
    info, loaded = CheckpointManager(url).load_latest(decode=decode_file)
    assert info.step == 5 and set(info.files) == set(files)
    _assert_same(state, join_state(loaded))


def test_corrupt_part_is_rejected_and_previous_checkpoint_loads(url: str) -> None:
    events = Events()
    mgr = CheckpointManager(url, on_event=events)
    _save(mgr, 1, split_state(_state(1), part_bytes=20_000))
    bad = split_state(_state(2), part_bytes=20_000)
    _save(mgr, 2, bad)
    flip_byte(mgr, f"step-0000000002/{part_name(1)}", offset=200)
    decoded: list[str] = []

    def decode(name: str, data: bytearray) -> object:
        decoded.append(name)
        return decode_file(name, data)

    info, loaded = CheckpointManager(url, on_event=events).load_latest(decode=decode)
    assert info.step == 1
    _assert_same(_state(1), join_state(loaded))
    reason = f"{part_name(1)} sha256 mismatch"
    assert [e["reason"] for e in events.named("checkpoint_skipped")] == [reason]
    # Only verified bytes were ever deserialized: step 2's part 0, then all of step 1.
    assert decoded.count(part_name(1)) == 1
    assert CheckpointManager(url).verify(CheckpointManager(url).list()[-1]) == [reason]


def test_legacy_single_file_checkpoint_still_loads(url: str) -> None:
    state = _state(3)
    _save(CheckpointManager(url), 7, {LEGACY_FILE: state})
    info, loaded = CheckpointManager(url).load_latest(decode=decode_file)
    assert set(info.files) == {LEGACY_FILE}
    _assert_same(state, join_state(loaded))


def test_incomplete_split_is_one_clear_line() -> None:
    files = split_state(_state(4), part_bytes=20_000)
    del files[part_name(1)]
    with pytest.raises(ValueError, match=r"^checkpoint lacks state-00001.pt of \d+ parts$"):
        join_state(files)
    with pytest.raises(ValueError, match="neither state.pt nor state-index.pt"):
        join_state({"other.bin": b""})
    with pytest.raises(ValueError, match="part_bytes must be >= 1"):
        split_state({}, part_bytes=0)
