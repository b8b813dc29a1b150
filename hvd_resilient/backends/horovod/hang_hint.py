"""What the progress watchdog of a `@hvd_resilient.run` loop says when it fires: a known cause.

The commonest hang of a Horovod Elastic script after a resize is not in Horovod at all: a
`torch.utils.data.DistributedSampler` built once with ``num_replicas=hvd.size(),
rank=hvd.rank()`` keeps the world it was built for, so after a host is added or removed the
ranks' epochs have different numbers of batches; the rank with the shortest finishes first and
enters a different collective (its commit's broadcast against the others' gradient allreduce),
and every rank waits for ever. The symptom on every rank is "stuck in a collective", which says
nothing about the cause; the samplers still in memory do. They are looked for only when the
watchdog fires (a `gc` scan costs tens of milliseconds on a big heap: never per step).
"""

from __future__ import annotations

import gc
import warnings

FIX = ("replace it with hvd_resilient.DistributedSampler (same arguments) and pass it to "
       "ElasticState(..., sampler=...): it re-partitions at every reset "
       "(docs/migrating-from-horovod.md)")


def stale_samplers(size: int, rank: int, objects: list[object] | None = None) -> list[str]:
    """Each `torch.utils.data.DistributedSampler` (or subclass) whose world is not the live
    one, as ``num_replicas=N rank=R`` text; ``objects``: where to look (default: every object
    the garbage collector tracks)."""
    from torch.utils.data import DistributedSampler

    found = []
    with warnings.catch_warnings():  # isinstance on a deprecated alias (torch's reduce_op) warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects() if objects is None else objects:
            try:
                if not isinstance(obj, DistributedSampler):
                    continue
                if obj.num_replicas != size or obj.rank != rank:
                    found.append(f"num_replicas={obj.num_replicas} rank={obj.rank}")
            except Exception:  # a half-built object, a proxy that raises on isinstance
                continue
    return found


def diagnose(size: int, rank: int, objects: list[object] | None = None) -> str:
    """One clause for the watchdog's line ("" when nothing stale is found)."""
    stale = stale_samplers(size, rank, objects)
    if not stale:
        return ""
    more = f" (and {len(stale) - 1} more)" if len(stale) > 1 else ""
    return (f"a torch.utils.data.DistributedSampler built for {stale[0]}{more} while this "
            f"rank is rank {rank} of {size}: after the resize the ranks' epochs have different "
            f"lengths and they wait in different collectives; {FIX}")


def diagnose_live() -> str:
    """`diagnose` against the running Horovod world (the watchdog thread asks at fire time:
    `hvd.size()` reads Horovod's state, it waits for no peer)."""
    import horovod.torch as hvd

    try:
        size, rank = hvd.size(), hvd.rank()
    except ValueError:  # Horovod is down (a reset in progress): no world to compare with
        return ""
    return diagnose(size, rank)
