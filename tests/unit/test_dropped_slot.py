"""A worker whose slot the driver's next world leaves out knows it before `hvd.init()` (a real
Horovod key-value server holding what the driver wrote; `backends/horovod/dropped_slot.py`)."""

from __future__ import annotations

import pytest
from horovod.runner.http.http_server import KVStoreServer

from hvd_resilient.backends.horovod import driver_kv, dropped_slot


@pytest.fixture
def driver(monkeypatch):
    server = KVStoreServer(verbose=0)
    port = server.start_server()
    monkeypatch.setenv("HOROVOD_GLOO_RENDEZVOUS_ADDR", "127.0.0.1")
    monkeypatch.setenv("HOROVOD_GLOO_RENDEZVOUS_PORT", str(port))
    monkeypatch.setenv("HOROVOD_HOSTNAME", "localhost+2")
    monkeypatch.setenv("HOROVOD_LOCAL_RANK", "0")
    yield lambda value: driver_kv.put(
        driver_kv.url(driver_kv.NEXT_SLOTS, driver_kv.NEXT_SLOTS_KEY), value)
    server.shutdown_server()


def test_a_slot_missing_from_the_next_world_has_left(driver):
    assert dropped_slot.slot_left() is None, "the driver said nothing: hvd.init() decides"
    driver(b"localhost+0:0,localhost+1:0")
    assert dropped_slot.slot_left() == "localhost+2:0"
    driver(b"localhost+0:0,localhost+2:0")
    assert dropped_slot.slot_left() is None
    driver(b"localhost+0:0,localhost+2:1")  # the same host, another slot of it
    assert dropped_slot.slot_left() == "localhost+2:0"


def test_no_driver_means_nothing_is_known(monkeypatch):
    monkeypatch.delenv("HOROVOD_GLOO_RENDEZVOUS_ADDR", raising=False)
    assert dropped_slot.slot_left() is None
