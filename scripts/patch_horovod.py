"""Patches Horovod 0.28.1's unpacked sdist before it is built (called by install.sh).

1. C++17: torch >= 2.1's headers need it; Horovod 0.28.1 asks for C++14 (fixed upstream,
   never released).
2. Gloo's wedged pair. A pair keeps a receive or send it was asked for by a weak pointer to
   the operation's buffer; when that operation fails and unwinds (a ring allreduce whose
   other peer died), the buffer is freed and the pair is left with it:
   - receive side: the peer's message for it arrives, `Pair::prepareRead` returns -1 without
     reading, and does so again on every later event: the pair never reads again, so it never
     sees its peer's EOF nor our own shutdown(2) of its socket, and every later operation on it
     waits out the Gloo timeout (30 s) while the device thread spins on the readable socket.
     Measured as a survivor's `hvd.shutdown()` stuck in the next cycle's cache-sync allreduce
     (`bench/recovery.py`'s random kills: 1 in 40 stuck before; with the patch its message
     showed in 2 of 25 runs beside a busy neighbour, both recovered in 0.2 s); shown on
     torch's copy of Gloo by `bench/gloo_dead_buffer.py`.
   - send side: the peer's ready-to-receive arrives, the send is queued with its dead buffer,
     `Pair::write` refuses it on every writable event, and every later send on the pair queues
     behind it: the peer's next receives wait out the timeout.
   Both are patched to close the pair with an error, as Gloo does for any other failure on a
   pair: the operation's buffer is gone, the stream cannot be resynchronised, and every
   operation pending on the pair fails at once, which the peer sees as EOF.

Exits non-zero naming the file when a pattern is not found: a silent non-patch would bring
the 30 s tail back unnoticed.
"""
from __future__ import annotations

import sys
from pathlib import Path

#: Also grepped for in the built library (install.sh, a unit test): the patch's presence.
MARKER = "buffer of this message is gone (its operation failed)"
MESSAGES = (f"the receive {MARKER}", f"the send {MARKER}")

READ_OLD = """    buf = NonOwningPtr<UnboundBuffer>(op.ubuf);
    if (!buf) {
      return -1;
    }
"""
READ_NEW = f"""    buf = NonOwningPtr<UnboundBuffer>(op.ubuf);
    if (!buf) {{
      signalException(GLOO_ERROR_MSG("Read from ", peer_.str(), ": {MESSAGES[0]}"));
      return -1;
    }}
"""
SEND_OLD = """      localPendingSend_.erase(it);
    }
    sendUnboundBuffer(std::move(buf), slot, offset, nbytes);
"""
SEND_NEW = f"""      localPendingSend_.erase(it);
    }}
    if (!NonOwningPtr<UnboundBuffer>(buf)) {{
      signalException(GLOO_ERROR_MSG("Send to ", peer_.str(), ": {MESSAGES[1]}"));
      return;
    }}
    sendUnboundBuffer(std::move(buf), slot, offset, nbytes);
"""


def _replace(path: Path, old: str, new: str, count: int) -> None:
    text = path.read_text()
    if text.count(old) != count:
        sys.exit(f"patch_horovod: expected {count} match(es) in {path}, found {text.count(old)}")
    path.write_text(text.replace(old, new))


def main(src: str) -> None:
    root = Path(src)
    for cmake in (root / "CMakeLists.txt", root / "horovod/torch/CMakeLists.txt"):
        _replace(cmake, "set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 17)", 1)
    pair = root / "third_party/gloo/gloo/transport/tcp/pair.cc"
    _replace(pair, READ_OLD, READ_NEW, 1)
    _replace(pair, SEND_OLD, SEND_NEW, 1)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: patch_horovod.py HOROVOD_SDIST_DIR")
    main(sys.argv[1])
