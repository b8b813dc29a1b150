"""What a backend can do is declared on its class (`Backend.supports_fsdp`), and a model that
holds its sharded module says so by its type (`fsdp.ShardedHolder`): nothing decides either by
a backend's name or by probing an undeclared attribute."""

from __future__ import annotations

import ast

import pytest
from torch import nn

from hvd_resilient import backends
from hvd_resilient.backends.base import Backend
from hvd_resilient.backends.inplace.backend import InPlaceBackend
from hvd_resilient.backends.inplace.fsdp import Resharded
from hvd_resilient.backends.torchdist import fsdp
from hvd_resilient.backends.torchdist.backend import TorchDistBackend
from hvd_resilient.backends.torchrun.backend import TorchrunBackend
from hvd_resilient.errors import ConfigError
from tests.support.paths import ROOT

NO_FSDP = ("config: fsdp needs the torchrun or inplace backend, this job runs on {} (launch it "
           "with torchrun or `hvd-resilient run --launcher torchrun|inplace`, or drop --fsdp / "
           "HVD_RESILIENT_FSDP)")


def test_the_torch_distributed_backends_declare_fsdp_and_the_base_does_not():
    assert not Backend.supports_fsdp
    assert TorchDistBackend.supports_fsdp
    assert issubclass(TorchrunBackend, TorchDistBackend)
    assert issubclass(InPlaceBackend, TorchDistBackend)
    assert backends.get("torchrun", fsdp=True).supports_fsdp
    assert backends.get("inplace", fsdp=True).supports_fsdp


def test_fsdp_on_horovod_is_one_config_error():
    pytest.importorskip("horovod.torch")
    from hvd_resilient.backends.horovod.backend import HorovodBackend

    assert not HorovodBackend.supports_fsdp
    with pytest.raises(ConfigError) as e:
        backends.get("horovod", fsdp=True)
    assert str(e.value) == NO_FSDP.format("horovod")


def test_fsdp_where_the_backend_is_not_installed_is_still_one_config_error(monkeypatch):
    """Without Horovod its class cannot be asked; fsdp is then the mistake to name."""
    def missing(**_):
        raise ModuleNotFoundError("No module named 'horovod'", name="horovod")

    monkeypatch.setitem(backends._REGISTRY, "absent", missing)
    with pytest.raises(ConfigError) as e:
        backends.get("absent", fsdp=True)
    assert str(e.value) == NO_FSDP.format("absent")
    with pytest.raises(ModuleNotFoundError):  # without fsdp: the missing module, as before
        backends.get("absent")


def test_a_registered_backend_is_asked_its_class_not_its_name(monkeypatch):
    class Replicating(TorchrunBackend):
        name = "torchrun"  # the name of one that shards: the class still decides
        supports_fsdp = False

    monkeypatch.setitem(backends._REGISTRY, "replicating", lambda **_: Replicating())
    with pytest.raises(ConfigError) as e:
        backends.get("replicating", fsdp=True)
    assert str(e.value) == NO_FSDP.format("torchrun")
    assert isinstance(backends.get("replicating"), Replicating)  # without fsdp: fine


def test_only_a_declared_holder_is_read_through():
    class Holder(fsdp.ShardedHolder):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)

    class Undeclared(nn.Module):  # the old duck-typed flag no longer counts
        holds_sharded_module = True

        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)

    holder, plain, undeclared = Holder(), nn.Linear(2, 2), Undeclared()
    assert fsdp.holds_sharded_module(holder) and fsdp.root(holder) is holder.module
    assert not fsdp.holds_sharded_module(plain) and fsdp.root(plain) is plain
    assert not fsdp.holds_sharded_module(undeclared) and fsdp.root(undeclared) is undeclared
    assert issubclass(Resharded, fsdp.ShardedHolder)


def test_nothing_decides_a_capability_by_a_backend_name():
    """No comparison with a backend's name in the backends, the tiers or the states (the
    launcher compares its own --launcher names), and no probe of an undeclared flag."""
    names = set(backends.names())
    for rel in ("backends", "training", "state", "checkpoint"):
        for path in (ROOT / "hvd_resilient" / rel).rglob("*.py"):
            text = path.read_text()
            assert '"holds_sharded_module"' not in text, path
            for node in ast.walk(ast.parse(text)):
                if not isinstance(node, ast.Compare):
                    continue
                for side in (node.left, *node.comparators):
                    values = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) \
                        else [side]
                    named = {v.value for v in values if isinstance(v, ast.Constant)}
                    assert not named & names, f"{path.relative_to(ROOT)}:{node.lineno}"
