"""The one walk over a state tree (the nested dicts, lists and tuples a ``state_dict()`` is made
of), for everything that copies, strips, rebuilds or sends a state leaf by leaf: snapshots and
split checkpoints here, in-memory commits and the state sync above (``state``), the sharded
memory tier (``training``). One walk, so every one of them keeps the same containers, key
paths and ``OrderedDict._metadata`` (module versions ``load_state_dict`` reads). Stdlib only:
any layer may import it."""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from typing import Any


def map_leaves(obj: Any, leaf: Callable[[Any, tuple[Any, ...]], Any],
               path: tuple[Any, ...] = ()) -> Any:
    """Rebuild the containers of a state dict (dicts, lists, tuples, named tuples), passing
    every other value with its key path to ``leaf`` and putting back what it returns.

    ``OrderedDict._metadata`` (module versions that ``load_state_dict`` reads) is kept.
    """
    if isinstance(obj, dict):
        out: dict[Any, Any] = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for k, v in obj.items():
            out[k] = map_leaves(v, leaf, (*path, k))
        meta = getattr(obj, "_metadata", None)
        if meta is not None and isinstance(out, OrderedDict):
            out._metadata = copy.deepcopy(meta)  # type: ignore[attr-defined]
        return out
    if isinstance(obj, list):
        return [map_leaves(v, leaf, (*path, i)) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        items = [map_leaves(v, leaf, (*path, i)) for i, v in enumerate(obj)]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return leaf(obj, path)
