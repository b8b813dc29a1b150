#!/usr/bin/env python3
"""A small GPT-style language model on real text, streamed as shards from S3 (or a folder),
with loader workers: the trainer's way in, for data that does not fit one process.

    horovodrun -np 2 --min-np 1 --max-np 4 --host-discovery-script ./hosts.sh \
        --network-interface lo python examples/gpt.py --run-id gpt \
        --data-url s3://bucket/gpt-data --checkpoint-url s3://bucket/ckpt/gpt --max-steps 400

The corpus is the Python standard library's own source files (every Python installation has
them: nothing is downloaded). They are cut into windows of --block + 1 bytes, shuffled,
written once as webdataset tar shards to --data-url (launcher rank 0 writes them; the other
ranks wait for the index), and streamed back by every rank: whole shards per rank, fetched
ahead in the background, bytes turned into token tensors in --data-num-workers loader workers (2 by
default here). Tokens are bytes (a vocabulary of 256), so the baseline to beat is the unigram
entropy of the text's bytes, printed with the final and held-out losses at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import sysconfig
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hvd_resilient.cli_errors import exit_on_error  # noqa: E402
from hvd_resilient.config import TrainConfig  # noqa: E402
from hvd_resilient.errors import ConfigError  # noqa: E402
from hvd_resilient.launcher_place import launcher_rank, launcher_size  # noqa: E402

if TYPE_CHECKING:
    from hvd_resilient.training.trainer import Trainer

VOCAB = 256
HELD_OUT = 0.02  # 2% of the windows, never trained on: the held-out loss


SKIPPED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "lib2to3"})


def corpus(megabytes: float) -> bytes:
    """The first `megabytes` of the standard library's .py files, in a fixed order (tests and
    vendored packages left out: repetitive, and not there in every installation)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total, limit = [], 0, int(megabytes * 2**20)
    for path in _sources(root):
        try:
            text = path.read_bytes()
        except OSError:
            continue
        out.append(text)
        total += len(text)
        if total >= limit:
            break
    data = b"\n".join(out)[:limit]
    if len(data) < 2**20:
        raise ConfigError(f"gpt: found only {len(data)} bytes of Python sources under {root}")
    return data


def _sources(folder: Path) -> Iterator[Path]:
    """The .py files below `folder` in sorted-path order, lazily, never entering a skipped
    folder. A sorted `rglob` walked all of site-packages (torch's included) before the first
    file: 0.6 s of every worker's start, and 3 s of a newcomer's on a busy machine."""
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        if entry.is_dir():
            if entry.name not in SKIPPED_DIRS:
                yield from _sources(Path(entry.path))
        elif entry.name.endswith(".py"):
            yield Path(entry.path)


def windows(data: bytes, block: int) -> list[bytes]:
    n = (len(data) - 1) // block
    return [data[i * block: i * block + block + 1] for i in range(n)]


def unigram_nats(data: bytes) -> float:
    """Cross-entropy of predicting every byte from the bytes' frequencies alone."""
    counts = Counter(data)
    n = len(data)
    return -sum(c / n * math.log(c / n) for c in counts.values())


def prepare_shards(url: str, train: list[bytes], per_shard: int) -> None:
    """Launcher rank 0 writes the shards (put_new: a rerun with the same text agrees with
    what is there), or the process itself when no launcher started it; the others wait for
    the index, bounded. A worker the launcher started without a rank (an in-place standby
    not taken in yet: no rank, but a world size) is one of the others."""
    from hvd_resilient.data.errors import DataError
    from hvd_resilient.data.shards import read_index, write_shards

    try:
        index = read_index(url)
        if index.num_samples == len(train):
            return
        raise ConfigError(f"gpt: {url} holds {index.num_samples} windows, this text makes "
                          f"{len(train)}; use another --data-url")
    except DataError:
        pass
    rank = launcher_rank()
    if rank == 0 or (rank is None and launcher_size() is None):
        t0 = time.time()
        write_shards(({"__key__": f"{i:08d}", "bin": w} for i, w in enumerate(train)), url,
                     samples_per_shard=per_shard)
        print(f"wrote {len(train)} windows as shards of {per_shard} to {url} in "
              f"{time.time() - t0:.1f}s", flush=True)
        return
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            read_index(url)
            return
        except DataError:
            time.sleep(1.0)  # polling the store for rank 0's index, bounded by the deadline
    raise ConfigError(f"gpt: no shard index at {url} after 600 s (launcher rank 0 writes it)")


def decode(sample: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs in the loader workers: a window of bytes -> (input tokens, next tokens)."""
    t = torch.frombuffer(bytearray(sample["bin"]), dtype=torch.uint8).long()
    return t[:-1], t[1:]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)
        self.p = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True,
                                           dropout_p=self.p if self.training else 0.0)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """Token and position embeddings, pre-norm causal transformer blocks, a tied output."""

    def __init__(self, block: int, dim: int = 64, layers: int = 2, heads: int = 4,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.zeros(block, dim))
        self.blocks = nn.Sequential(*(Block(dim, heads, dropout) for _ in range(layers)))
        self.ln = nn.LayerNorm(dim)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok(idx) + self.pos[: idx.shape[1]]
        return self.ln(self.blocks(h)) @ self.tok.weight.T


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@torch.no_grad()
def held_out_loss(model: nn.Module, held: list[bytes], batch: int = 64) -> float:
    model.eval()
    total, n = 0.0, 0
    for i in range(0, len(held), batch):
        xs, ys = zip(*(decode({"bin": w}) for w in held[i: i + batch]), strict=True)
        x, y = torch.stack(xs), torch.stack(ys)
        total += float(lm_loss(model(x), y)) * len(xs)
        n += len(xs)
    return total / max(n, 1)


class EndWhenAllowed:
    """`--end-file`: the job ends only once a file exists, so that whoever watches it (the
    demo, playing its script of faults and host changes) decides when it may end, not a step
    budget that a faster machine uses up before the script has played.

    The trainer stops at `config.max_steps`, read before every step; this takes that budget
    over (no limit, and no last epoch, until the end is allowed) and, from the old budget on,
    every `commit_every` steps asks all ranks whether the file exists, ending at the step of
    the first yes. Ranks that decide alone would end at different steps (a file appears
    between two ranks' looks) and leave the others in a collective with a dead peer, so the
    answer is a collective (`any_rank`): every rank gets the same one at the same step. The
    steps that ask are fixed by the step count, which the ranks share (a newcomer receives it
    with the state), never by a rank's own clock, so a rank that joined late asks at the same
    steps, and a rank rolled back to a commit asks again on the way. A timeout bounds the
    hold: with nobody left to write the file (its writer killed), the job still ends.
    """

    def __init__(self, trainer: Trainer, path: str, timeout_s: float) -> None:
        cfg = trainer.config
        self.trainer, self.path, self.timeout_s = trainer, path, timeout_s
        self.least = cfg.max_steps
        self.held_since: float | None = None
        cfg.max_steps, cfg.epochs = 0, sys.maxsize  # open-ended until the end is allowed

    def __call__(self, state: Any, loss: float) -> None:
        cfg = self.trainer.config
        if state.step < self.least or state.step % cfg.commit_every:
            return
        if self.held_since is None:
            self.held_since = time.monotonic()
        allowed = (os.path.exists(self.path)
                   or time.monotonic() - self.held_since > self.timeout_s)
        if self.trainer.backend.any_rank(allowed):
            cfg.max_steps = state.step  # every rank ends after this step, at the same one


@exit_on_error
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    TrainConfig.add_arguments(parser)
    parser.add_argument("--data-url", default="",
                        help="where the shards live: s3://bucket/prefix or file:///path "
                             "(default: <run_dir>/data)")
    parser.add_argument("--corpus-mb", type=float, default=4.0)
    parser.add_argument("--block", type=int, default=64, help="context length in bytes")
    parser.add_argument("--shard-windows", type=int, default=1000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--end-file", default="",
                        help="end only once this file exists: --max-steps is then the least "
                             "the job trains (and --epochs does not end it); `hvd-resilient "
                             "demo` writes it when its script has played")
    parser.add_argument("--end-file-timeout", type=float, default=600.0,
                        help="with --end-file: end anyway this many seconds after reaching "
                             "--max-steps (a job whose writer died does not train forever)")
    args = parser.parse_args(argv)
    # Clipping as LM recipes do; bf16 autocast only on a GPU: on this project's CPUs (no
    # bf16 instructions) it made the same 80 steps 5.1x slower (118.9 s against 23.3 s, same
    # loss to 3 digits; docs/recipes.md).
    defaults = {"batch_size": 32, "max_steps": 400, "data_num_workers": 2, "log_every": 25,
                "recipe_clip_grad_norm": 1.0,
                "recipe_precision": "bf16" if torch.cuda.is_available() else "fp32"}
    cfg = TrainConfig.from_sources(args, **{k: v for k, v in defaults.items()
                                            if getattr(args, k) is None
                                            and f"HVD_RESILIENT_{k.upper()}" not in os.environ})
    data_url = args.data_url or Path(cfg.run_dir, "data").as_uri()

    from hvd_resilient.data.shards import ShardedDataset
    from hvd_resilient.training.trainer import Trainer

    text = corpus(args.corpus_mb)
    all_windows = windows(text, args.block)
    # Shards are written from shuffled windows, as data preparation for streaming does: a
    # rank reads one shard at a time, so a shard in corpus order would fill each batch (and
    # ~30 steps in a row) with windows of the same few files. The order is fixed, so every
    # run writes the same bytes.
    order = torch.randperm(len(all_windows), generator=torch.Generator().manual_seed(1234))
    all_windows = [all_windows[i] for i in order.tolist()]
    cut = int(len(all_windows) * (1 - HELD_OUT))
    train, held = all_windows[:cut], all_windows[cut:]
    prepare_shards(data_url, train, args.shard_windows)
    dataset = ShardedDataset(data_url, decode=decode)

    torch.manual_seed(cfg.seed)
    model = GPT(args.block, dim=args.dim, layers=args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01,
                                  betas=(0.9, 0.95))
    warmup, total = 30, max(cfg.max_steps, 1)  # with --end-file, the least it trains
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * max(
            0.1, 0.5 * (1 + math.cos(math.pi * min(s / total, 1.0)))))
    # The trainer hands the model a Horovod/DDP-wrapped optimizer sharing this one's parameter
    # groups (so the schedule applies), but the scheduler counts calls of this object's step.
    warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
    t0 = time.time()
    trainer = Trainer(model, optimizer, lm_loss, dataset, cfg, scheduler=scheduler)
    if args.end_file:
        trainer.on_step = EndWhenAllowed(trainer, args.end_file, args.end_file_timeout)
    result = trainer.fit()
    seconds = time.time() - t0
    if result.rank == 0:
        baseline = unigram_nats(b"".join(train))
        held_loss = held_out_loss(model, held)
        out = {"train_loss": result.loss, "held_out_loss": held_loss,
               "unigram_baseline": baseline, "uniform_baseline": math.log(VOCAB),
               "steps": result.step, "seconds": round(seconds, 1),
               "world_size": result.world_size, "samples": len(train),
               "params": sum(p.numel() for p in model.parameters())}
        with open(os.path.join(cfg.run_dir, "result.json"), "w") as fh:
            json.dump(out, fh, indent=1)
        print(f"after {result.step} steps ({seconds:.0f}s): train loss {result.loss:.3f}, "
              f"held-out {held_loss:.3f} nats/byte; unigram baseline {baseline:.3f}, uniform "
              f"{math.log(VOCAB):.3f}; run folder {cfg.run_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
