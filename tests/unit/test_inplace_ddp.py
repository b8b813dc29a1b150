"""The DDP adapter's pieces that need no process group: which formation path this torch gets
(a feature check), the sampler's re-plan, and the agent's reading of an unadopted script's
traceback, on torch's own message and a real pipe."""

from __future__ import annotations

import datetime
import os
import types

import pytest
import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

from hvd_resilient.backends.inplace import reconfigure
from hvd_resilient.backends.inplace.ddp import replan, set_torchrun_env
from hvd_resilient.launch.inplace_unadopted import StderrWatch, is_unadopted


def test_torch_2_13_has_no_reconfigure_so_each_generation_is_a_new_group():
    assert not reconfigure.available()


def test_the_feature_check_takes_the_reconfigure_path_where_the_functions_exist():
    def f(*_a: object, **_k: object) -> None:
        return None

    full = types.SimpleNamespace(**{name: f for name in reconfigure.REQUIRED})
    assert reconfigure.available(full)
    partial = types.SimpleNamespace(_reconfigure=f)
    assert not reconfigure.available(partial)


@pytest.mark.parametrize("n, size, drop_last", [(2048, 2, False), (10, 3, False),
                                                (10, 3, True), (7, 4, False)])
def test_a_replanned_sampler_is_the_one_built_for_the_new_world(n, size, drop_last):
    data = list(range(n))
    old = DistributedSampler(data, num_replicas=size + 1, rank=size, drop_last=drop_last,
                             seed=3)
    old.set_epoch(5)
    replan(old, rank=1, size=size)
    new = DistributedSampler(data, num_replicas=size, rank=1, drop_last=drop_last, seed=3)
    new.set_epoch(5)
    assert (len(old), old.total_size, list(old)) == (len(new), new.total_size, list(new))


def test_torchrun_variables_follow_the_generation():
    env: dict[str, str] = {}
    set_torchrun_env(1, 2, env)
    assert env == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   "GROUP_RANK": "0"}


def torch_env_error(monkeypatch: pytest.MonkeyPatch) -> str:
    """The last line of the traceback torch 2.13 prints for a script that calls its own
    init_process_group() without RANK (what an unadopted script dies with)."""
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError) as e:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))
    return f"ValueError: {e.value}"


def test_torchs_own_error_is_what_the_agent_recognises(monkeypatch):
    line = torch_env_error(monkeypatch)
    assert is_unadopted(line.encode() + b"\n")
    assert is_unadopted(b"[rank1]: " + line.encode() + b"\n")
    assert is_unadopted(b"KeyError: 'RANK'\n")
    assert not is_unadopted(b"ValueError: something else\n")
    assert not is_unadopted(b"RuntimeError: " + line.encode() + b"\n")


def copied(data: bytes) -> tuple[bytes, bool]:
    r_in, w_in = os.pipe()
    r_out, w_out = os.pipe()
    watch = StderrWatch(os.fdopen(r_in, "rb"), w_out)
    os.write(w_in, data)
    os.close(w_in)
    watch.join(10)
    os.close(w_out)
    with os.fdopen(r_out, "rb") as f:
        return f.read(), watch.unadopted


def test_the_unadopted_traceback_is_held_back_and_everything_else_passes(monkeypatch):
    last = torch_env_error(monkeypatch).encode()
    tb = (b"Traceback (most recent call last):\n  File \"x.py\", line 3, in <module>\n"
          b"    dist.init_process_group(\"gloo\")\n    ^^^^^^^^^^\n")
    out, unadopted = copied(b"a warning\n" + tb + last + b"\nafter\n")
    assert unadopted and out == b"a warning\nafter\n"
    other = tb + b"ZeroDivisionError: division by zero\n"
    out, unadopted = copied(b"before\n" + other)
    assert not unadopted and out == b"before\n" + other
    out, unadopted = copied(b"cut short\n" + tb)  # killed while printing: all of it passes
    assert not unadopted and out == b"cut short\n" + tb


def test_torch_cpu_build_is_what_the_suite_runs_on():
    assert torch.__version__.startswith("2.13"), "re-check the reconfigure path's tests"
