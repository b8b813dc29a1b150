"""The preparation of our torchrun workers (`launch/torchrun_worker.py`,
`launch/torchrun_round_store.py`, `launch/warm/torchrun.worker_args`), in this process."""

from __future__ import annotations

import datetime
import importlib
import signal
import socket

import pytest
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import api

from hvd_resilient.launch import torchrun_round_store, torchrun_worker
from hvd_resilient.launch.warm import torchrun as torchrun_warm

rendezvous = importlib.import_module("torch.distributed.rendezvous")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def agent_store(monkeypatch):
    """A TCPStore server standing in for the agent's shared store, and a worker's view of
    it (TORCHELASTIC_USE_AGENT_STORE=True, as torchrun's agent sets it)."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True,
                           timeout=datetime.timedelta(seconds=5))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    torchrun_round_store.apply_round_store()
    yield server, port


def worker_store(port: int, monkeypatch, round_: str):
    monkeypatch.setenv(torchrun_round_store.ROUND_ENV, round_)
    return rendezvous._create_c10d_store("127.0.0.1", port, 1, 3,
                                         datetime.timedelta(seconds=5))


def test_a_restarted_round_does_not_see_the_dead_rounds_keys(agent_store, monkeypatch):
    server, port = agent_store
    old = worker_store(port, monkeypatch, "0")
    old.set("default_pg/0//cpu/rank_1", "dead address")
    new = worker_store(port, monkeypatch, "1")
    assert not new.check(["default_pg/0//cpu/rank_1"])
    new.set("k", "v")
    assert server.get("hvd_resilient/round1/k") == b"v"
    assert server.get("hvd_resilient/round0/default_pg/0//cpu/rank_1") == b"dead address"


def test_the_round_falls_back_to_the_restart_count(agent_store, monkeypatch):
    server, port = agent_store
    monkeypatch.delenv(torchrun_round_store.ROUND_ENV, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    rendezvous._create_c10d_store("127.0.0.1", port, 1, 3,
                                  datetime.timedelta(seconds=5)).set("k", "v")
    assert server.get("hvd_resilient/round2/k") == b"v"


def test_without_the_agent_store_nothing_is_prefixed(monkeypatch):
    """TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: rank 0 hosts a fresh store each round."""
    torchrun_round_store.apply_round_store()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    store = rendezvous._create_c10d_store("127.0.0.1", free_port(), 0, 1,
                                          datetime.timedelta(seconds=5))
    assert type(store) is dist.TCPStore


def test_applying_twice_wraps_once():
    torchrun_round_store.apply_round_store()
    wrapped = rendezvous._create_c10d_store
    torchrun_round_store.apply_round_store()
    assert rendezvous._create_c10d_store is wrapped


def test_a_torch_without_the_target_is_refused(monkeypatch):
    monkeypatch.setattr(rendezvous, "_create_c10d_store", lambda host, port: None)
    with pytest.raises(torchrun_round_store.RoundStoreMismatch, match="expects"):
        torchrun_round_store.apply_round_store()
    monkeypatch.delattr(rendezvous, "_create_c10d_store")
    with pytest.raises(torchrun_round_store.RoundStoreMismatch, match="no _create_c10d_store"):
        torchrun_round_store.apply_round_store()


def test_the_agents_signal_handlers_give_way_to_the_defaults():
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    saved = {n: signal.getsignal(getattr(signal, n)) for n in names}
    try:
        for n in names:
            signal.signal(getattr(signal, n), api._terminate_process_handler)
        mine = lambda *_: None  # noqa: E731 - a handler of the script's own stays
        signal.signal(signal.SIGQUIT, mine)
        assert torchrun_worker.restore_default_signals() == ["SIGTERM", "SIGINT", "SIGHUP"]
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGQUIT) is mine
    finally:
        for n, h in saved.items():
            signal.signal(getattr(signal, n), h)


TORCHRUN = ["--nproc-per-node", "2", "--rdzv-backend", "c10d"]


@pytest.mark.parametrize("given,expected", [
    ([*TORCHRUN, "train.py", "--lr", "1"],
     [*TORCHRUN, "-m", torchrun_warm.WORKER, "train.py", "--lr", "1"]),
    ([*TORCHRUN, "-m", "pkg.train", "--lr", "1"],
     [*TORCHRUN, "-m", torchrun_warm.WORKER, "-m", "pkg.train", "--lr", "1"]),
    ([*TORCHRUN, "--no-python", "./train.sh"], None),
    ([*TORCHRUN, "--run-path", "train.py"], None),
])
def test_new_interpreter_workers_start_through_the_worker_module(given, expected):
    assert torchrun_warm.worker_args(given) == expected


RUNS = """
import sys
print(repr((__name__, sys.argv, sys.path[0])))
"""


def test_the_worker_module_runs_a_script_as_python_would(tmp_path, capsys, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text(RUNS)
    monkeypatch.setattr("sys.argv", ["x"])
    monkeypatch.setattr("sys.path", ["somewhere", *__import__("sys").path])
    monkeypatch.delenv("HVD_RESILIENT_RUN_DIR", raising=False)
    torchrun_worker.main([str(script), "--lr", "1"])
    assert capsys.readouterr().out.strip() == repr(
        ("__main__", [str(script), "--lr", "1"], str(tmp_path)))
