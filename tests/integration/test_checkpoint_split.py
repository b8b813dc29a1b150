"""A state split into raw parts on real storage (disk and SeaweedFS): it comes back equal, tied
weights stay tied, a corrupt part makes the whole checkpoint skipped (the previous one loads),
snapshot buffers are reused only once nothing refers to them, and checkpoints in the older
layouts (``torch.save``-d parts, one ``state.pt``) still load."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from hvd_resilient.checkpoint import CheckpointManager, snapshot_state_dict, to_buffer
from hvd_resilient.checkpoint.host_buffers import HostBufferPool, pool
from hvd_resilient.checkpoint.split import (
    INDEX_FILE,
    LEGACY_FILE,
    decode_file,
    join_state,
    part_name,
    split_state,
    warm_buffers,
)
from tests.support.checkpoints import Events, flip_byte


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


def _encode(files: dict) -> dict:
    """What the writer stores: buffers as they are, other objects through torch.save."""
    return {n: o if isinstance(o, memoryview) else to_buffer(o) for n, o in files.items()}


def _through_bytes(files: dict) -> object:
    """The state back from what the writer would store, as a restore decodes it."""
    return join_state({n: decode_file(n, d) for n, d in _encode(files).items()})


def _save(mgr: CheckpointManager, step: int, files: dict) -> None:
    mgr.save(step, 0, 1, _encode(files))


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
    assert all(0 < files[name].nbytes <= 20_000 for name in parts[:-1])
    # A part never mixes top-level keys: restored optimizer tensors (views of their part)
    # must not keep the model's bytes alive.
    tops = [{path[0] for path, slot in files[INDEX_FILE]["refs"]
             if files[INDEX_FILE]["slots"][slot][0] == i} for i in range(len(parts))]
    assert all(len(t) == 1 for t in tops), tops
    back = _through_bytes(files)
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
    reason = f"{part_name(1)} xxh3_128 mismatch"
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
    with pytest.raises(ValueError, match=r"^checkpoint lacks state-00001.bin of \d+ parts$"):
        join_state(files)
    with pytest.raises(ValueError, match="neither state.pt nor state-index.pt"):
        join_state({"other.bin": b""})
    with pytest.raises(ValueError, match="part_bytes must be >= 1"):
        split_state({}, part_bytes=0)


def test_split_is_a_snapshot_and_reuses_buffers_only_when_released() -> None:
    buffers = HostBufferPool()
    live = {"model": {"w": torch.arange(1000.0)}, "step": 1}
    files = split_state(live, part_bytes=1 << 20, buffers=buffers)
    live["model"]["w"].add_(1)  # training goes on: the snapshot must not change
    back = _through_bytes(files)
    assert torch.equal(back["model"]["w"], torch.arange(1000.0))
    second = split_state(live, part_bytes=1 << 20, buffers=buffers)
    assert buffers.reused_bytes == 0, "a buffer still referenced (back, files) was reused"
    del files, back, second
    third = split_state(live, part_bytes=1 << 20, buffers=buffers)
    assert buffers.reused_bytes == 4000
    assert torch.equal(_through_bytes(third)["model"]["w"], torch.arange(1000.0) + 1)


def test_the_pool_keeps_in_flight_snapshots_plus_one() -> None:
    """Snapshots faster than uploads (the writer supersedes): memory stays bounded."""
    buffers = HostBufferPool()
    sizes = [3 << 20, 5]
    a, b = buffers.take(sizes), buffers.take(sizes)  # one uploading, one pending
    assert buffers.reused_bytes == 0
    del a, b  # both done
    c = buffers.take(sizes)
    assert buffers.reused_bytes == sum(sizes)
    assert len(buffers._all) == len(sizes), "the second free set must have been dropped"
    del c
    buffers.take([7 << 20])  # another layout: the old free set goes
    assert [len(x) for x in buffers._all] == [7 << 20]


def test_reuse_can_be_turned_off_from_the_config() -> None:
    from hvd_resilient.config import TrainConfig

    env = {"HVD_RESILIENT_CHECKPOINT_SNAPSHOT_REUSE": "0"}
    assert TrainConfig.from_sources(env=env).checkpoint.snapshot_reuse is False
    assert TrainConfig.from_sources(env={}).checkpoint.snapshot_reuse is True
    assert pool().enabled  # nothing is read at import: the trainer applies the setting


def test_restore_buffers_are_reused_only_once_let_go() -> None:
    buffers = HostBufferPool()
    first = buffers.borrow(3 << 20)
    held = buffers.borrow(3 << 20)  # `first` is still referenced: a fresh buffer
    assert first.obj is not held.obj and buffers.reused_bytes == 0
    first_id = id(first.obj)
    del first
    again = buffers.borrow(2 << 20)  # the smallest free one that fits: first's
    assert id(again.obj) == first_id and buffers.reused_bytes == 2 << 20
    assert len(again) == 2 << 20


def test_warmed_buffers_serve_the_first_snapshot() -> None:
    buffers = HostBufferPool()
    state = _state(6)
    warmed = warm_buffers(state, part_bytes=3 << 20, buffers=buffers)
    assert warmed > 0 and buffers.reused_bytes == 0
    files = split_state(state, part_bytes=3 << 20, buffers=buffers)
    assert buffers.reused_bytes == warmed  # every part landed in warmed memory
    _assert_same(state, _through_bytes(files))


def test_odd_tensors_round_trip() -> None:
    """Every dtype, 0-d and empty tensors, views and non-contiguous tensors, and tensors no
    raw part can hold (sparse) come back equal."""
    base = torch.randn(6, 4)
    state = {
        "model": {
            "t": base.t(), "row": base[2], "scalar": torch.tensor(3.5, dtype=torch.float64),
            "empty": torch.empty(0, 3), "bool": torch.tensor([True, False, True]),
            "half": torch.randn(5).half(), "bf16": torch.randn(7).bfloat16(),
            "cplx": torch.randn(3, dtype=torch.complex64), "i64": torch.arange(9),
            "u8": torch.arange(5, dtype=torch.uint8), "sparse": torch.eye(3).to_sparse(),
        },
    }
    back = _through_bytes(split_state(state))["model"]
    for k, v in state["model"].items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape, k
        assert torch.equal(back[k].to_dense(), v.to_dense()), k


def test_older_split_layout_still_loads(url: str) -> None:
    """``hvd_resilient.split/1``: ``torch.save``-d parts, as written before raw parts."""
    state = _state(5)
    paths, tensors = [], []

    def strip(obj: object, path: tuple) -> object:
        if isinstance(obj, torch.Tensor):
            paths.append(path)
            tensors.append(obj)
            return None
        return obj

    from hvd_resilient.checkpoint.serialize import map_leaves

    tree = map_leaves(state, strip)
    half = len(tensors) // 2
    files = {
        "state-00000.pt": dict(enumerate(tensors[:half])),
        "state-00001.pt": {j: t for j, t in enumerate(tensors) if j >= half},
        INDEX_FILE: {"format": "hvd_resilient.split/1", "tree": tree, "paths": paths,
                     "parts": 2},
    }
    _save(CheckpointManager(url), 3, files)
    _, loaded = CheckpointManager(url).load_latest(decode=decode_file)
    _assert_same(state, join_state(loaded))
