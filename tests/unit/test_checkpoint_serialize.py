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
from hvd_resilient.checkpoint.serialize import check_state_dict


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
        "model does not fit the checkpoint: fc.bias is missing from the checkpoint; "
        "fc.weight is missing from the checkpoint; head.weight is in the checkpoint but not "
        "in the model"
    )
    many = [f"layer{i:02d}.weight" for i in range(30)]
    with pytest.raises(CheckpointMismatchError) as e:
        check_state_dict_keys(many, [])
    msg = str(e.value)
    assert msg.startswith("model does not fit the checkpoint: layer00.weight is missing")
    assert msg.endswith("; ... (27 more)") and "\n" not in msg


def _mlp(hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 8))


def test_other_layer_sizes_are_one_line_naming_shapes() -> None:
    """Linear(64, 32) saved, Linear(64, 48) loaded: the names agree, only the shapes tell."""
    saved = from_bytes(to_bytes(_mlp(32).state_dict()))
    model = _mlp(48)
    check_state_dict(_mlp(32).state_dict(), saved)  # the same architecture fits
    with pytest.raises(CheckpointMismatchError) as e:
        check_state_dict(model.state_dict(), saved, limit=1)
    assert str(e.value) == ("model does not fit the checkpoint: 0.weight is [32, 64] in the "
                            "checkpoint, [48, 64] in the model; ... (2 more)")
    with pytest.raises(CheckpointMismatchError) as e:
        check_state_dict(model.state_dict(), saved)
    assert str(e.value).count(";") == 2 and "2.weight is [8, 32] in the checkpoint, [8, 48]" \
        in str(e.value)
    # What the check spares the user: load_state_dict's multi-line traceback.
    with pytest.raises(RuntimeError) as raw:
        model.load_state_dict(saved)
    assert "\n" in str(raw.value)


def test_dtype_and_names_mismatches() -> None:
    model = _mlp(32)
    half = {k: v.half() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointMismatchError, match=r"^model does not fit the checkpoint: "
                       r"0\.weight is float16 in the checkpoint, float32 in the model; "):
        check_state_dict(model.state_dict(), half)
    both = dict(model.state_dict())
    both["0.weight"] = torch.zeros(48, 64, dtype=torch.float64)
    del both["2.bias"]
    both["head.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointMismatchError) as e:
        check_state_dict(model.state_dict(), both, "model")
    assert str(e.value) == (
        "model does not fit the checkpoint: 0.weight is [48, 64] float64 in the checkpoint, "
        "[32, 64] float32 in the model; 2.bias is missing from the checkpoint; head.weight "
        "is in the checkpoint but not in the model")
    # Entries that are not tensors are compared by name only.
    check_state_dict({"w": torch.zeros(2), "_extra_state": {"a": 1}},
                     {"w": torch.ones(2), "_extra_state": "anything"})


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_sharded_resume_checks_shapes_against_dcp_metadata(tmp_path) -> None:
    """The FSDP path compares the model's (D)Tensors with what DCP's .metadata records."""
    import torch.distributed.checkpoint as dcp

    from hvd_resilient.checkpoint.sharded.checkpointer import check_fits
    from hvd_resilient.checkpoint.sharded.dcp_safe import read_metadata

    saved = _mlp(32)
    dcp.save({"model": saved.state_dict()}, storage_writer=dcp.FileSystemWriter(str(tmp_path)))
    metadata = read_metadata(str(tmp_path)).state_dict_metadata
    check_fits({"model": _mlp(32).state_dict(), "optim": {}}, metadata)
    with pytest.raises(CheckpointMismatchError) as e:
        check_fits({"model": _mlp(48).state_dict()}, metadata)
    assert str(e.value) == (
        "model does not fit the checkpoint: 0.weight is [32, 64] in the checkpoint, [48, 64] "
        "in the model; 0.bias is [32] in the checkpoint, [48] in the model; 2.weight is "
        "[8, 32] in the checkpoint, [8, 48] in the model")
