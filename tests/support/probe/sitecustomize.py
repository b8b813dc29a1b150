"""Test probe (tests/support/thirdparty.py): with HVDR_TEST_PROBE_DIR set, wraps
torch.distributed.destroy_process_group so that, before the group goes, this worker writes a
digest of every DistributedDataParallel model's parameters to rank<RANK>.json. Nothing at all
without the variable; torch is never imported by this file itself (the hook waits for it).

It also appends one line to `marks.jsonl` when a worker's default group has formed
(`"mark": "group"`) and at its first optimizer step after that (`"mark": "step"`), each with
rank, pid, torchrun's restart count and the time: which process is which rank now (a test
kills rank 1's current process) and when a restarted round trained again (a benchmark's
step marker), seen from outside an unchanged script. One `os.write` per line (O_APPEND), so
lines of concurrent workers never interleave."""

import os
import sys

_DIR = os.environ.get("HVDR_TEST_PROBE_DIR")


def _install() -> None:
    import hashlib
    import json

    import torch.distributed as dist

    original = dist.destroy_process_group
    original_init = dist.init_process_group

    def init_process_group(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = original_init(*args, **kwargs)
        try:
            _mark("group")
            _hook_first_step()
        except Exception as e:  # a probe never fails the script
            print(f"probe: {e!r}", file=sys.stderr)
        return out

    def _hook_first_step() -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        done = []  # never removed: torch iterates its hooks while calling this one

        def first_step(*_args):  # type: ignore[no-untyped-def]
            if not done:
                done.append(True)
                _mark("step")

        register_optimizer_step_post_hook(first_step)

    def _mark(what: str) -> None:
        import json
        import time

        rec = {"mark": what, "rank": dist.get_rank(), "pid": os.getpid(), "ts": time.time(),
               "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
        fd = os.open(os.path.join(_DIR, "marks.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, (json.dumps(rec) + "\n").encode())
        finally:
            os.close(fd)

    def destroy_process_group(*args, **kwargs):  # type: ignore[no-untyped-def]
        if not args and not kwargs.get("group"):
            try:
                _record(dist)
            except Exception as e:  # a probe never fails the script
                print(f"probe: {e!r}", file=sys.stderr)
        return original(*args, **kwargs)

    def _record(dist_mod) -> None:  # type: ignore[no-untyped-def]
        import gc
        import warnings

        from torch.nn.parallel import DistributedDataParallel

        h = hashlib.sha256()
        with warnings.catch_warnings():  # isinstance on torch's deprecated module objects
            warnings.simplefilter("ignore")
            models = [o for o in gc.get_objects() if isinstance(o, DistributedDataParallel)]
        for m in models:
            for name, t in sorted(m.module.state_dict().items()):
                h.update(name.encode())
                h.update(t.detach().cpu().contiguous().numpy().tobytes())
        rank = dist_mod.get_rank() if dist_mod.is_initialized() else int(os.environ["RANK"])
        rec = {"rank": rank, "pid": os.getpid(), "models": len(models),
               "digest": h.hexdigest()}
        path = os.path.join(_DIR, f"rank{rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(rec, f)
        os.replace(path + ".tmp", path)

    dist.destroy_process_group = destroy_process_group
    dist.init_process_group = init_process_group


class _Hook:
    """Installs the wrapper right after torch.distributed is first imported."""

    def find_spec(self, name, path=None, target=None):  # type: ignore[no-untyped-def]
        if name != "torch.distributed":
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def run(module):  # type: ignore[no-untyped-def]
            exec_module(module)
            _install()

        loader.exec_module = run  # type: ignore[method-assign]
        return spec


if _DIR:
    if "torch.distributed" in sys.modules:
        _install()
    else:
        sys.meta_path.insert(0, _Hook())
