"""Data path benchmark (not a test): the trainer's loader against a hand-written loop, and
shards streamed from S3 against the same shards on local disk. Side by side in one run,
interleaved, median of --repeats.

1. A CPU-heavy per-sample transform (a seeded 3x64x64 image, --conv-passes 5x5 convolutions,
   a crop and a flip: a few ms a sample), a small MLP: the step waits for data. Rows:
   - plain: `torch.utils.data.DataLoader(num_workers=2, DistributedSampler)` + a Horovod
     `DistributedOptimizer` loop, written by hand as a user would;
   - trainer: `Trainer.fit()` with `--data-num-workers 2` over the same data set (the elastic
     sampler's order, batches keyed and prefetched by `ElasticLoader`).
   Bar: trainer >= 95% of plain's samples/s.
2. The same kind of samples stored as webdataset shards (`write_shards`), read by the trainer
   with 2 loader workers and a light decode: from SeaweedFS on this machine (`s3://`: fetched
   ahead into a local cache) and from a local folder (`file://`: read in place). Bar: s3 >=
   90% of local's samples/s.

Each row is its own process (`python bench/data_bench.py --role ...`), one Horovod rank,
OMP_NUM_THREADS=1 (the loader workers get the cores); samples/s is measured from the end of
step --warmup to the end of step --steps, and so is the CPU time of the row's processes (the
training process and its workers) per sample. Pairs (plain/trainer, local/s3) run back to
back, their order swapped every repeat. Usage: `python bench/data_bench.py --repeats 7`;
prints a markdown table and writes bench/results/data.json (with the load average around
each run: the machine is shared, read the numbers with it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the checkout's tests.support and package

N_SAMPLES = 4096
BATCH = 32
SIDE = 64
SHARD = 512
"""Samples per shard (6 MB): with two shards read ahead, 1024 samples are on their way."""


class HeavyImages:
    """Sample i: a seeded random image, augmented with CPU-heavy work; label i % 10."""

    def __init__(self, conv_passes: int) -> None:
        self.conv_passes = conv_passes
        self.kernel = torch.full((3, 1, 5, 5), 1 / 25)

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        img = torch.rand(1, 3, SIDE, SIDE, generator=g)
        return augment(img, self.kernel, self.conv_passes), i % 10


def augment(img: torch.Tensor, kernel: torch.Tensor, passes: int) -> torch.Tensor:
    for _ in range(passes):
        img = F.conv2d(F.pad(img, (2, 2, 2, 2), mode="reflect"), kernel, groups=3)
    top, left = torch.randint(0, 16, (2,)).tolist()
    img = img[:, :, top:top + 48, left:left + 48]
    if torch.rand(()) < 0.5:
        img = img.flip(3)
    return F.avg_pool2d(img, 3).flatten()  # 3 x 16 x 16 = 768 features


def decode_image(conv_passes: int):  # noqa: ANN201 - a closure for the data set
    kernel = torch.full((3, 1, 5, 5), 1 / 25)

    def decode(s: dict) -> tuple[torch.Tensor, int]:
        img = torch.frombuffer(bytearray(s["img"]), dtype=torch.uint8).float().div(255)
        return augment(img.view(1, 3, SIDE, SIDE), kernel, conv_passes), int(s["cls"])

    return decode


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(768, 256), nn.ReLU(), nn.Linear(256, 10))


def rate(times: dict[int, float], warmup: int, steps: int) -> float:
    return (steps - warmup) * BATCH / (times[steps] - times[warmup])


def cpu_now() -> float:
    """CPU seconds used so far by this process and its loader workers (alive, not reaped):
    what the row costs the machine, whatever else runs on it."""
    import psutil

    total = 0.0
    me = psutil.Process()
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total


class Window:
    """Wall and CPU time at the end of step `warmup` and of step `steps`."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps = warmup, steps
        self.times: dict[int, float] = {}
        self.cpu: dict[int, float] = {}

    def at(self, step: int) -> None:
        if step in (self.warmup, self.steps):
            self.times[step] = time.perf_counter()
            self.cpu[step] = cpu_now()

    def result(self) -> dict[str, float]:
        n = (self.steps - self.warmup) * BATCH
        return {"samples_per_s": rate(self.times, self.warmup, self.steps),
                "cpu_ms_per_sample": 1000 * (self.cpu[self.steps] - self.cpu[self.warmup]) / n}


# -- the rows, each in its own process -------------------------------------------------------
def role_plain(a: argparse.Namespace) -> dict[str, Any]:
    import horovod.torch as hvd
    from torch.utils.data import DataLoader, DistributedSampler

    hvd.init()
    data = HeavyImages(a.conv_passes)
    sampler = DistributedSampler(data, num_replicas=hvd.size(), rank=hvd.rank(), seed=0)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler, num_workers=2,
                        prefetch_factor=2, persistent_workers=True)
    m = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05),
                                   named_parameters=m.named_parameters())
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    window = Window(a.warmup, a.steps)
    step, epoch = 0, 0
    while step < a.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
            step += 1
            window.at(step)
            if step == a.steps:
                break
        epoch += 1
    return window.result()


def role_trainer(a: argparse.Namespace) -> dict[str, Any]:
    from hvd_resilient.config import TrainConfig
    from hvd_resilient.data.shards import ShardedDataset
    from hvd_resilient.training.trainer import Trainer

    run = tempfile.mkdtemp(prefix="data-bench-")
    cfg = TrainConfig.from_sources(env={}, run_id="bench", run_dir=run, max_steps=a.steps,
                                   epochs=1000, batch_size=BATCH, commit_every=50,
                                   log_every=10_000, checkpoint_every=10_000)
    cfg.data.num_workers = 2
    cfg.observability.log_level = "WARNING"
    if a.shards_url:
        data: Any = ShardedDataset(a.shards_url, decode=decode_image(a.conv_passes))
    else:
        data = HeavyImages(a.conv_passes)
    window = Window(a.warmup, a.steps)

    def on_step(state: Any, _loss: float) -> None:
        window.at(state.step)

    m = model()
    Trainer(m, torch.optim.SGD(m.parameters(), lr=0.05), F.cross_entropy, data, cfg,
            on_step=on_step).fit()
    return window.result()


# -- the driver ---------------------------------------------------------------------------------
def load() -> float:
    return round(os.getloadavg()[0], 2)


def run_row(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    before = load()
    p = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                       timeout=900, env=env)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    line = [x for x in p.stdout.splitlines() if x.startswith("{")][-1]
    out = json.loads(line)
    out.update(load_before=before, load_after=load())
    return out


def image_samples(n: int):
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        img = (torch.rand(3, SIDE, SIDE, generator=g) * 255).to(torch.uint8)
        yield {"__key__": f"{i:06d}", "img": img.numpy().tobytes(), "cls": i % 10}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=("plain", "trainer"), default=None)
    p.add_argument("--shards-url", default="")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=110)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--conv-passes", type=int, default=12)
    p.add_argument("--shard-conv-passes", type=int, default=4)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "data.json"))
    a = p.parse_args()
    if a.role == "plain":
        print(json.dumps(role_plain(a)), flush=True)
        return 0
    if a.role == "trainer":
        print(json.dumps(role_trainer(a)), flush=True)
        return 0

    from hvd_resilient.data.shards import write_shards
    from tests.support.s3_server import S3Server

    common = ["--steps", str(a.steps), "--warmup", str(a.warmup)]
    # One intra-op thread in every row's training process: with torch's default (one per
    # core) its OpenMP threads spin against the two loader workers for the same two cores, and
    # the tiny model's step, not the data, sets the pace (a backward of 180 ms instead of 1).
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    work = Path(tempfile.mkdtemp(prefix="data-bench-"))
    server = S3Server(work / "s3")
    server.start()
    try:
        env.update(server.env())
        os.environ.update(server.env())
        s3 = f"s3://{server.bucket}/bench-shards"
        local = (work / "shards").as_uri()
        for url in (s3, local):
            write_shards(image_samples(N_SAMPLES), url, samples_per_shard=SHARD)
        rows: dict[str, list[dict[str, Any]]] = {k: [] for k in
                                                 ("plain", "trainer", "s3", "local")}
        heavy = ["--conv-passes", str(a.conv_passes)]
        light = ["--conv-passes", str(a.shard_conv_passes)]
        args = {"plain": ["--role", "plain", *common, *heavy],
                "trainer": ["--role", "trainer", *common, *heavy],
                "s3": ["--role", "trainer", "--shards-url", s3, *common, *light],
                "local": ["--role", "trainer", "--shards-url", local, *common, *light]}
        for r in range(a.repeats):
            # Each pair back to back, the order swapped every repeat: a busy minute on this
            # shared machine then hits both sides of a pair, and neither always goes first.
            for pair in (("plain", "trainer"), ("local", "s3")):
                for k in (pair if r % 2 == 0 else pair[::-1]):
                    rows[k].append(run_row(args[k], env))
            print(f"repeat {r + 1}/{a.repeats}: " + ", ".join(
                f"{k} {v[-1]['samples_per_s']:.0f}" for k, v in rows.items()), flush=True)
    finally:
        server.stop()
    med = {k: statistics.median(x["samples_per_s"] for x in v) for k, v in rows.items()}
    cpu = {k: statistics.median(x["cpu_ms_per_sample"] for x in v) for k, v in rows.items()}
    pairs = {"trainer_vs_plain": [t["samples_per_s"] / p["samples_per_s"]
                                  for t, p in zip(rows["trainer"], rows["plain"], strict=True)],
             "s3_vs_local": [t["samples_per_s"] / p["samples_per_s"]
                             for t, p in zip(rows["s3"], rows["local"], strict=True)]}
    checks = {"trainer_vs_plain": med["trainer"] / med["plain"],
              "s3_vs_local": med["s3"] / med["local"]}
    pair_medians = {k: statistics.median(v) for k, v in pairs.items()}
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    result = {
        "date": time.strftime("%Y-%m-%d"), "commit": commit, "host": platform.node(),
        "cpus": os.cpu_count(), "torch": torch.__version__,
        "command": "python bench/data_bench.py " + " ".join(sys.argv[1:]),
        "settings": {"samples": N_SAMPLES, "batch": BATCH, "steps": a.steps,
                     "samples_per_shard": SHARD, "sample_bytes": 3 * SIDE * SIDE,
                     "warmup": a.warmup, "conv_passes": a.conv_passes,
                     "shard_conv_passes": a.shard_conv_passes, "loader_workers": 2,
                     "ranks": 1},
        "median_samples_per_s": {k: round(v, 1) for k, v in med.items()},
        "median_cpu_ms_per_sample": {k: round(v, 3) for k, v in cpu.items()},
        "ratios": {k: round(v, 3) for k, v in checks.items()},
        "median_of_pair_ratios": {k: round(v, 3) for k, v in pair_medians.items()},
        "pair_ratios": {k: [round(x, 3) for x in v] for k, v in pairs.items()},
        "goals": {"trainer_vs_plain >= 0.95": checks["trainer_vs_plain"] >= 0.95,
                  "s3_vs_local >= 0.90": checks["s3_vs_local"] >= 0.90},
        "runs": rows,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print("| row | samples/s (median) | CPU ms per sample (median) | runs (samples/s) |\n"
          "| --- | --- | --- | --- |")
    for k, v in rows.items():
        print(f"| {k} | {med[k]:.1f} | {cpu[k]:.2f} | "
              + ", ".join(f"{x['samples_per_s']:.0f}" for x in v) + " |")
    print(f"trainer / plain = {checks['trainer_vs_plain']:.3f} of medians, "
          f"{pair_medians['trainer_vs_plain']:.3f} median of pairs (goal >= 0.95); "
          f"s3 / local = {checks['s3_vs_local']:.3f} of medians, "
          f"{pair_medians['s3_vs_local']:.3f} median of pairs (goal >= 0.90); wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
