"""The random streams a step may draw from (torch, numpy, python), captured and restored.

A bit-identical resume needs every rank's streams, not only rank 0's: dropout masks and data
augmentation differ per rank. States are plain tensors/lists so they survive
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, cast

import numpy as np
import torch


def capture() -> dict[str, Any]:
    # numpy's stub types the default (legacy=True) call as the dict form; it is the tuple.
    np_state = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())
    py_state = random.getstate()
    out: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": {
            "version": py_state[0],
            "state": torch.tensor(py_state[1], dtype=torch.int64),
            "gauss": py_state[2],
        },
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def restore(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        ("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
         n["cached_gaussian"])
    )
    p = state["python"]
    random.setstate((p["version"], tuple(int(x) for x in p["state"].tolist()), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def derived_seed(*parts: object) -> int:
    """A stable 63-bit seed from any parts (Python's hash() is salted per process)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
