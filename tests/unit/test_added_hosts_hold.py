"""Rank 0 holds an added host's reset until the driver's standbys are warm, never a removal,
and never longer than the timeout (`backends/horovod/added_hosts.py`, with a fake driver and
a fake clock)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from hvd_resilient.backends.horovod import driver_kv
from hvd_resilient.backends.horovod.added_hosts import ASK_EVERY_S, AddedHostsHold

ADDED, REMOVED, MIXED = 2, 1, 3


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_addition_waits_for_the_standbys_and_a_removal_never_does():
    warming = [["h2:0"]]
    asked: list[int] = []

    def ask() -> list[str]:
        asked.append(1)
        return warming[0]

    clock = Clock()
    hold = AddedHostsHold(ask, timeout_s=60, clock=clock)
    assert hold.holding([ADDED])
    clock.now += ASK_EVERY_S / 2
    assert hold.holding([ADDED, ADDED]) and len(asked) == 1, "asked once per ASK_EVERY_S"
    assert not hold.holding([ADDED, REMOVED]), "a removal is acted on at once"
    assert not hold.holding([MIXED])
    assert hold.holding([ADDED])
    warming[0] = []
    clock.now += 2.5
    assert not hold.holding([ADDED]) and hold.held_s == 2.5
    assert not hold.holding([])


def test_the_hold_ends_at_the_timeout_and_when_the_driver_does_not_answer():
    clock = Clock()
    hold = AddedHostsHold(lambda: ["h2:0"], timeout_s=10, clock=clock)
    assert hold.holding([ADDED])
    clock.now += 10.5
    assert not hold.holding([ADDED])
    assert not AddedHostsHold(lambda: None, clock=clock).holding([ADDED])


def test_warming_reads_the_drivers_list_and_the_ready_keys_over_http():
    store = {f"/{driver_kv.WARMING}/{driver_kv.WARMING_KEY}": b"h1:0,h2:0",
             f"/{driver_kv.READY}/h1:0": b"1"}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = store.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            if body is not None:
                self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        env = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
               "HOROVOD_GLOO_RENDEZVOUS_PORT": str(server.server_address[1])}
        assert driver_kv.warming(env) == ["h2:0"]
        store[f"/{driver_kv.READY}/h2:0"] = b"1"
        assert driver_kv.warming(env) == []
        del store[f"/{driver_kv.WARMING}/{driver_kv.WARMING_KEY}"]
        assert driver_kv.warming(env) == []
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert driver_kv.warming(env) is None, "a driver that does not answer holds nothing"
    assert driver_kv.warming({}) is None
