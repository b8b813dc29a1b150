"""A worker started ahead of time: imports done while the old world trains, then released.

Horovod starts the workers of an added host (or a slot back from its cooldown) only after the
running workers have stopped at a reset, so they sit idle for the newcomer's cold start (Python,
torch, Horovod: 5-20 s). `launch.horovod.driver` starts the newcomer early through this module: it
imports torch and Horovod, says it is ready through the driver's key-value store, and waits for
the driver's go (given when the new world is formed, which the driver holds back until the
standby is ready); only then does the training script run, in this same process, with its
imports already paid for. Without a Horovod driver around (no
rendezvous address), or when the command is not this Python, it just runs the command.

    python -m hvd_resilient.launch.horovod.standby python train.py ARGS
"""

from __future__ import annotations

import os
import runpy
import shutil
import sys
import time
import urllib.error
import urllib.request

READY = "hvd_resilient_standby_ready"
GO = "hvd_resilient_standby_go"
MAX_WAIT_S = 900.0  # a standby never released (its host left again) exits quietly


def _url(scope: str, key: str) -> str:
    addr = os.environ["HOROVOD_GLOO_RENDEZVOUS_ADDR"]
    port = os.environ["HOROVOD_GLOO_RENDEZVOUS_PORT"]
    return f"http://{addr}:{port}/{scope}/{key}"


def _get(url: str) -> bytes | bool | None:
    """The value; False when the driver says there is none; None when it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.read()
    except urllib.error.HTTPError:
        return False
    except (urllib.error.URLError, OSError):
        return None


#: What the go carries: the slot's place in the world the standby is released into.
SLOT_ENV = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
            "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")


def slot_env(slot: object) -> bytes:
    """The go for ``slot`` (Horovod's SlotInfo of the world being formed)."""
    names = (n.removeprefix("HOROVOD_").lower() for n in SLOT_ENV)  # rank, size, ...
    return ",".join(str(int(getattr(slot, n))) for n in names).encode()


def apply_go(value: bytes) -> None:
    """Takes rank and sizes from the go: the world may have changed since this process was
    started (a failure reset in between shifts ranks), and a worker that joins with the rank
    it was started with would wait forever for a world that does not exist."""
    fields = value.decode(errors="replace").split(",")
    if len(fields) != len(SLOT_ENV) or not all(f.isdigit() for f in fields):
        sys.exit(f"hvd-resilient standby: bad go {value[:60]!r} from the driver")
    os.environ.update(zip(SLOT_ENV, fields, strict=True))


def _put(url: str) -> None:
    """PUTs "1"; a driver that does not answer is noticed by the wait loop, not here."""
    req = urllib.request.Request(url, data=b"1", method="PUT")
    try:
        with urllib.request.urlopen(req, timeout=5):
            pass
    except (urllib.error.URLError, OSError):
        pass


def same_python(exe: str) -> bool:
    found = shutil.which(exe)
    return bool(found) and os.path.realpath(found) == os.path.realpath(sys.executable)


def runnable_here(cmd: list[str]) -> bool:
    """`python script.py ...` or `python -m module ...` with this very Python; anything else
    (other interpreters, `-u`, `-c`, ...) is exec'd as given, without the head start."""
    if len(cmd) < 2 or not same_python(cmd[0]):
        return False
    return (cmd[1] == "-m" and len(cmd) >= 3) or not cmd[1].startswith("-")


def run_in_process(cmd: list[str]) -> None:
    """Runs `python script.py ARGS` or `python -m module ARGS` here, as Python itself would."""
    args = cmd[1:]
    if args[:1] == ["-m"] and len(args) >= 2:
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


def main() -> None:
    cmd = sys.argv[1:]
    if not cmd:
        sys.exit("usage: python -m hvd_resilient.launch.horovod.standby COMMAND [ARGS]")
    if "HOROVOD_GLOO_RENDEZVOUS_ADDR" not in os.environ or not runnable_here(cmd):
        os.execvp(cmd[0], cmd)
    key = f"{os.environ['HOROVOD_HOSTNAME']}:{os.environ['HOROVOD_LOCAL_RANK']}"
    # The cold start this module exists to hide. torch._dynamo too: every optimizer's first
    # construction imports it (torch wraps optimizer methods in a lazy `_disable_dynamo`), 1 s
    # idle and 2-5 s on a busy host, after the reset, while the whole old world waits.
    import horovod.torch  # noqa: F401
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401

    import hvd_resilient.backends.horovod.run  # noqa: F401 - and ours, which every training script imports

    go = _url(GO, key)
    deadline = time.monotonic() + MAX_WAIT_S
    silent_since = None
    said_ready = 0.0
    while not isinstance(answer := _get(go), bytes):
        now = time.monotonic()
        if now - said_ready > 1.0:
            # again and again: every rendezvous clears the driver's store
            _put(_url(READY, key))
            said_ready = now
        silent_since = (silent_since or now) if answer is None else None
        if now > deadline or (silent_since is not None and now - silent_since > 5.0):
            sys.exit(0)  # never released, or the driver is gone
        time.sleep(0.05)
    apply_go(answer)
    run_in_process(cmd)


if __name__ == "__main__":
    main()
