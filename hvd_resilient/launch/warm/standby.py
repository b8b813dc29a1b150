"""A worker started ahead of time: imports and set-up done while the old world trains.

Horovod starts the workers of an added host (or a slot back from its cooldown) only after the
running workers have stopped at a reset, so they sit idle for the newcomer's cold start (Python,
torch, Horovod: 5-20 s). `launch.horovod.driver` starts the newcomer early through this module: it
imports torch and Horovod, then runs the training script in this same process at once, up to
its first `hvd.init()`; there it says it is ready through the driver's key-value store and
waits for the driver's go (given when the new world is formed, which the driver holds back
until the standby is ready), takes its rank from it and initializes. The script's own set-up
(data, model, loader) is then done too. Where a warm pool serves the machine
(`pool.py`), the standby is forked from it instead, its imports done before it was asked
for. Without a Horovod driver around (no rendezvous address), or when the command is not this
Python, it just runs the command.

    python -m hvd_resilient.launch.warm.standby python train.py ARGS
"""

from __future__ import annotations

import os
import runpy
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

from hvd_resilient.launch.warm import pool as warm_pool

# Nothing else of the package at import: where a warm pool serves the machine this module is
# only the stand-in of the forked worker (`main`), and each import here is in the launch of
# every standby (the store's client, through `hvd_resilient.backends`: 60 ms of 100 idle).

MAX_WAIT_S = 900.0  # a standby never released (its host left again) exits quietly
READY_AGAIN_S = 0.2
"""How often a waiting standby says READY again: a driver restarted in place of a dead one,
or one whose store lost the key, hears it within this. The driver keeps a READY across its
rendezvous, which clears the rest of its store (`launch/horovod/patches/standby_slots.py`,
`keeping_ready`): had the standby's next beat been waited for, it would be in the stall of
every growth."""


GO_POLL_S, GO_POLL_FAST_FOR_S, GO_POLL_SLOW_S = 0.01, 10.0, 0.05
"""How often a waiting standby asks for its go: every 10 ms for its first 10 s (a warm standby
is ready a few tenths of a second after its start and released at the next commit, and the
whole new world waits for its go: 25 ms on average at 50 ms), then every 50 ms (one that waits
longer waits for a cold peer or a later change, and should not load the driver)."""


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


def same_python(exe: str) -> bool:
    found = shutil.which(exe)
    return found is not None and os.path.realpath(found) == os.path.realpath(sys.executable)


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


def warm_up() -> None:
    """The cold start this module exists to hide. torch._dynamo too: every optimizer's first
    construction imports it (torch wraps optimizer methods in a lazy `_disable_dynamo`), 1 s
    idle and 2-5 s on a busy host, after the reset, while the whole old world waits."""
    import horovod.torch  # noqa: F401
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401

    import hvd_resilient.backends.horovod.driver_kv  # noqa: F401 - the release's client
    import hvd_resilient.backends.horovod.run  # noqa: F401 - and ours, which every training script imports


def released_run(cmd: list[str]) -> None:
    """Runs `cmd` in this process at once; its first `hvd.init()` waits for the release.

    The script's own set-up before it initializes Horovod (arguments, data, model, loader
    workers: 1.25 s for examples/gpt.py here) runs while the old world trains, and READY means
    "at hvd.init": had it run after the release, the whole new world would have waited for it
    inside the reset."""
    hold_init_until(lambda: wait_for_release(
        f"{os.environ['HOROVOD_HOSTNAME']}:{os.environ['HOROVOD_LOCAL_RANK']}"))
    run_in_process(cmd)


def wait_for_release(key: str) -> None:
    """Says READY until the driver's go, then takes rank and sizes from it."""
    from hvd_resilient.backends.horovod.driver_kv import GO, READY, get, put, url
    from hvd_resilient.launch.warm.imports import settle_heap

    settle_heap()  # the script's set-up is done: before READY, not in the reset
    go = url(GO, key)
    start = time.monotonic()
    deadline = start + MAX_WAIT_S
    silent_since = None
    said_ready = 0.0
    while not isinstance(answer := get(go), bytes):
        now = time.monotonic()
        if now - said_ready > READY_AGAIN_S:
            # again and again: every rendezvous clears the driver's store
            put(url(READY, key))
            said_ready = now
        silent_since = (silent_since or now) if answer is None else None
        if now > deadline or (silent_since is not None and now - silent_since > 5.0):
            sys.exit(0)  # never released, or the driver is gone
        time.sleep(GO_POLL_S if now - start < GO_POLL_FAST_FOR_S else GO_POLL_SLOW_S)
    apply_go(answer)


def hold_init_until(released: Callable[[], None]) -> None:
    """Horovod's init (every path to it: `hvd.init`, the elastic reset) calls `released()`
    the first time, before it reads rank and sizes from the environment."""
    from horovod.common.basics import HorovodBasics

    from hvd_resilient.backends.horovod import compat

    original = HorovodBasics.init

    def init(self: Any, *args: Any, **kwargs: Any) -> Any:
        if HorovodBasics.init is init:  # the first call: this process's release
            released()
            HorovodBasics.init = original  # type: ignore[method-assign]
        return original(self, *args, **kwargs)

    compat.replace(HorovodBasics, "init", init)


def main() -> None:
    cmd = sys.argv[1:]
    if not cmd:
        sys.exit("usage: python -m hvd_resilient.launch.warm.standby COMMAND [ARGS]")
    if "HOROVOD_GLOO_RENDEZVOUS_ADDR" not in os.environ or not runnable_here(cmd):
        os.execvp(cmd[0], cmd)
    warm_pool.run_in_pool(cmd)  # exits when a pool on this machine forked the standby
    warm_up()
    released_run(cmd)


if __name__ == "__main__":
    main()
