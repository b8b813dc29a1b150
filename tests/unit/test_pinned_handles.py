"""Horovod's handle map with every pending tensor pinned by a C++ reference (a view)."""

from __future__ import annotations

import torch

from hvd_resilient.backends.horovod.pinned_handles import PinningHandles, install


def test_each_pending_tensor_is_held_by_a_view_until_its_handle_is_popped():
    a, b, c = torch.ones(2), torch.zeros(3), torch.ones(1)
    m = PinningHandles({7: (a, a)})
    m[8] = ((b,), (c, None), [3, 4])
    assert [p._base is a for p in m._pins[7]] == [True]  # in place: one pin
    assert [p._base for p in m._pins[8]] == [b, c]
    assert m.pop(7)[-1] is a and 7 not in m._pins and not m._retired
    assert 8 in m and dict(m) == {8: ((b,), (c, None), [3, 4])}


def test_a_failed_operations_tensors_stay_pinned_until_the_map_is_replaced():
    t = torch.ones(4)
    m = PinningHandles()
    m[1] = (t, t)
    assert m.pop(1, None) == (t, t)  # synchronize's failure path: the loop may still drop them
    assert [p._base is t for p in m._retired[0]] == [True]
    assert m.pop(2, None) is None


def test_a_tensor_without_views_is_left_unpinned():
    s = torch.eye(3).to_sparse()
    m = PinningHandles()
    m[1] = (s, s)
    assert m._pins[1] == [] and m[1] == (s, s)


def test_install_replaces_horovods_map_once_keeping_its_entries():
    from horovod.torch import mpi_ops

    before = mpi_ops._handle_map
    try:
        t = torch.ones(1)
        mpi_ops._handle_map = {5: (t, t)}
        install()
        first = mpi_ops._handle_map
        install()
        assert isinstance(first, PinningHandles) and mpi_ops._handle_map is first
        assert first[5] == (t, t) and first._pins[5][0]._base is t
    finally:
        mpi_ops._handle_map = before
