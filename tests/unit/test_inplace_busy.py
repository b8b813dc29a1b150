"""A member busy in a declared section renews `busy/<member>` in the agent's store, and only
then (`backends/inplace/busy.py`; a real TCPStore)."""

from __future__ import annotations

import datetime
import time

import torch.distributed as dist

from hvd_resilient.backends.inplace.busy import BusyReporter
from hvd_resilient.backends.inplace.membership import AGENT_ENV, PREFIX, busy_key
from tests.support.jobs import wait_for


def test_the_busy_time_is_renewed_inside_a_section_only(monkeypatch):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    monkeypatch.setenv(AGENT_ENV, f"127.0.0.1:{server.port}")
    store = dist.PrefixStore(PREFIX, server)
    section = [""]
    reporter = BusyReporter(3, section=lambda: section[0], every_s=0.02).start()
    try:
        time.sleep(0.2)  # ten rounds outside any section: nothing written
        assert not store.check([busy_key(3)])
        section[0] = "evaluation"
        wait_for(lambda: store.check([busy_key(3)]), 10, "the busy time")
        first = float(store.get(busy_key(3)))
        wait_for(lambda: float(store.get(busy_key(3))) > first, 10, "a renewal")
        section[0] = ""
        time.sleep(0.1)  # a round in flight may still write once
        last = store.get(busy_key(3))
        time.sleep(0.2)
        assert store.get(busy_key(3)) == last, "renewed outside the section"
    finally:
        reporter.stop()
