"""Serialization: safe loading, and one clear line when a checkpoint does not fit the model."""

from __future__ import annotations

import pickle

import pytest
import torch

from hvd_resilient.checkpoint import (
    CheckpointMismatchError,
    check_state_dict_keys,
    from_bytes,
    to_buffer,
    to_bytes,
)


def test_roundtrip_loads_onto_cpu() -> None:
    model = torch.nn.Linear(3, 2)
    data = to_bytes({"model": model.state_dict(), "epoch": 4})
    assert isinstance(data, bytes)
    back = from_bytes(data)
    assert back["epoch"] == 4
    fresh = torch.nn.Linear(3, 2)
    fresh.load_state_dict(back["model"])
    assert torch.equal(fresh.weight, model.weight)
    assert bytes(to_buffer({"x": 1})) == to_bytes({"x": 1})
    # Downloads arrive as bytearray / memoryview: loaded without an extra copy of the input.
    for view in (bytearray(data), memoryview(bytearray(data))):
        assert torch.equal(from_bytes(view)["model"]["weight"], model.weight)


class Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_weights_only_refuses_arbitrary_objects() -> None:
    with pytest.raises(pickle.UnpicklingError):
        from_bytes(to_bytes({"x": Evil()}))


def test_key_mismatch_is_one_clear_line() -> None:
    check_state_dict_keys(["a", "b"], {"b", "a"})  # equal: nothing
    with pytest.raises(CheckpointMismatchError) as e:
        check_state_dict_keys(["fc.weight", "fc.bias", "emb"], ["emb", "head.weight"], "model")
    assert str(e.value) == (
        "model does not match the checkpoint: missing keys (2): fc.bias, fc.weight; "
        "unexpected keys (1): head.weight"
    )
    many = [f"layer{i:02d}.weight" for i in range(30)]
    with pytest.raises(CheckpointMismatchError) as e:
        check_state_dict_keys(many, [])
    msg = str(e.value)
    assert "missing keys (30): layer00.weight" in msg and "... and 22 more" in msg
    assert "unexpected" not in msg and "\n" not in msg
