"""Loading an optimizer's state without breaking who else holds its parameter groups.

`Optimizer.load_state_dict` replaces `param_groups` with new dicts. Anything holding the old
ones then steers nothing: an LR scheduler built before `hvd.DistributedOptimizer` wrapped the
optimizer (the usual order: Horovod's wrapper is a second object sharing the group dicts) kept
setting the learning rate on dicts the wrapper no longer used, so after the first restore or
sync the schedule silently stopped (found by the recipe tests: the warmup-cosine LR froze at
its value of the restored commit). Here the loaded values go into the live dicts instead.
"""

from __future__ import annotations

from typing import Any


def load_optimizer_state(optimizer: Any, state_dict: dict[str, Any]) -> None:
    live = list(optimizer.param_groups)
    optimizer.load_state_dict(state_dict)
    for old, new in zip(live, optimizer.param_groups, strict=True):
        old.clear()
        old.update(new)  # `params` included: the same list of the same tensors
    optimizer.param_groups[:] = live
