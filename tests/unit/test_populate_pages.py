"""`populate_pages`: the kernel supplies a mapping's pages in one call, and the other threads
of the process keep running meanwhile (Python's MAP_POPULATE held the GIL for the whole call:
a heartbeat thread starved for seconds with a 1 GB state and its process exited as frozen)."""

from __future__ import annotations

import mmap
import sys
import threading
import time

import psutil

from hvd_resilient.checkpoint.host_buffers import populate_pages

SIZE = 256 << 20


def test_pages_are_supplied_while_other_threads_run() -> None:
    """A thread populates while this one watches a flag set only around the call. The switch
    interval is made huge, so the populating thread is never made to yield between setting
    the flag and the call: this thread can see the flag set only if the call itself lets the
    GIL go."""
    buf = mmap.mmap(-1, SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    me = psutil.Process()
    rss_before = me.memory_info().rss
    inside = [False]

    def populate() -> None:
        inside[0] = True
        populate_pages(buf)
        inside[0] = False

    seen = 0
    interval = sys.getswitchinterval()
    sys.setswitchinterval(10.0)
    try:
        t = threading.Thread(target=populate, daemon=True)
        t.start()
        while t.is_alive():
            seen += inside[0]
            time.sleep(0.0005)  # lets the GIL go; waking needs it back
        t.join(10)
    finally:
        sys.setswitchinterval(interval)

    assert me.memory_info().rss - rss_before > SIZE * 0.9, "pages were not supplied"
    assert seen > 0, "populate_pages held the GIL: no other thread ran during the call"
    buf.close()  # no export of the buffer is left behind


def test_a_file_mapping_is_supplied_and_can_be_closed(tmp_path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"")
    with open(path, "r+b") as f:
        f.truncate(8 << 20)
        buf = mmap.mmap(f.fileno(), 8 << 20, flags=mmap.MAP_SHARED)
    populate_pages(buf)
    buf[:5] = b"hello"
    buf.close()
    assert path.read_bytes()[:5] == b"hello"
