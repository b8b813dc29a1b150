"""What the verified sync costs (state/agreement.py), beside Horovod's own TorchState.sync.

Two Gloo ranks under `horovodrun -np 2`, an AdamW state of ``--sizes`` MB in total (parameters
a third, the two moments the rest), median and max of ``--repeats``:

- agreed: every rank already holds rank 0's state (the survivors of a kill, who restored the
  same commit): digests + one allgather, nothing sent;
- newcomer: rank 1 holds another model and an empty optimizer: digests, the model and the
  optimizer sent, digests again;
- horovod: Horovod's `TorchState.sync()` on the same newcomer state (broadcast_parameters +
  broadcast_optimizer_state), what the sync cost before; it does not verify, and it leaves an
  AdamW newcomer diverged (tests/integration/test_sync_agreement.py).

    python bench/sync_check.py --sizes 100,1000 --repeats 5

prints a markdown table and writes bench/results/sync_check.json (run it through this script:
it starts horovodrun itself).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worker(sizes: list[int], repeats: int, out: str) -> None:
    import horovod.torch as hvd
    import torch

    sys.path.insert(0, str(ROOT))
    from hvd_resilient.backends.horovod.state import ElasticState

    hvd.init()
    rows = []
    for mb in sizes:
        n = mb * 2**20 // 4 // 3 // 8  # 8 tensors of parameters, a third of the state
        times: dict[str, list[float]] = {"agreed": [], "newcomer": [], "horovod": [],
                                         "digest": []}
        for _ in range(repeats):
            for kind in ("agreed", "newcomer", "horovod"):
                torch.manual_seed(0 if kind == "agreed" or hvd.rank() == 0 else 1)
                model = torch.nn.ParameterList(
                    [torch.nn.Parameter(torch.randn(n)) for _ in range(8)])
                opt = torch.optim.AdamW(model.parameters(), weight_decay=0.01)
                if kind == "agreed" or hvd.rank() == 0:
                    for p in model.parameters():
                        p.grad = torch.ones_like(p)
                    opt.step()
                state = (hvd.elastic.TorchState(model, opt) if kind == "horovod"
                         else ElasticState(model, opt))
                hvd.allreduce(torch.zeros(1), name="bench.barrier")
                t0 = time.perf_counter()
                state.sync()
                times[kind].append(time.perf_counter() - t0)
                if kind != "horovod":
                    times["digest"].append(state.last_agreement.digest_seconds)
                del state, model, opt
        rows.append({"mb": mb, **{k: {"median": statistics.median(v), "max": max(v)}
                                  for k, v in times.items()}})
    if hvd.rank() == 0:
        Path(out).write_text(json.dumps(rows))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="100,1000")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    if a.worker:
        worker(sizes, a.repeats, a.out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        horovodrun = Path(sys.executable).parent / "horovodrun"
        subprocess.run([str(horovodrun), "-np", "2", "--gloo", sys.executable, __file__,
                        "--worker", "--sizes", a.sizes, "--repeats", str(a.repeats),
                        "--out", out], check=True, timeout=3600)
        rows = json.loads(Path(out).read_text())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()
    print(f"verified sync, 2 Gloo ranks, AdamW state, median / max of {a.repeats} "
          f"({time.strftime('%Y-%m-%d')}, {commit}, load {os.getloadavg()[0]:.1f})\n")
    print("| state | agreed (survivors) | of it hashing | newcomer (sent + verified) | "
          "Horovod TorchState.sync (unverified) |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        def cell(k: str, r: dict = r) -> str:
            return f"{r[k]['median']:.3f} s / {r[k]['max']:.3f} s"
        print(f"| {r['mb']} MB | {cell('agreed')} | {cell('digest')} | {cell('newcomer')} | "
              f"{cell('horovod')} |")
    results = ROOT / "bench" / "results"
    results.mkdir(exist_ok=True)
    (results / "sync_check.json").write_text(json.dumps(
        {"date": time.strftime("%Y-%m-%d"), "commit": commit, "repeats": a.repeats,
         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
