#!/usr/bin/env python3
"""A small transformer language model with a custom training loop: the state + decorated
function way in, for people who keep their own loop.

    horovodrun -np 2 --min-np 1 --max-np 4 --host-discovery-script ./hosts.sh \
        --network-interface lo python examples/tiny_lm.py --run-id lm --max-steps 300

The text is generated here from a tiny grammar (no download), so the model has something
learnable: its loss falls well below the uniform-guess log(vocab).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hvd_resilient.cli_errors import exit_on_error  # noqa: E402
from hvd_resilient.config import TrainConfig  # noqa: E402

BLOCK = 32


def make_text(n_sentences: int = 3000, seed: int = 0) -> str:
    r = random.Random(seed)
    adj = ["quick", "lazy", "small", "bright", "quiet", "heavy", "green", "old"]
    noun = ["fox", "dog", "rank", "host", "model", "worker", "tensor", "node"]
    verb = ["jumps over", "waits for", "restores", "syncs with", "trains", "finds"]
    return " ".join(
        f"the {r.choice(adj)} {r.choice(noun)} {r.choice(verb)} the {r.choice(adj)} "
        f"{r.choice(noun)}." for _ in range(n_sentences)
    )


def make_data(seed: int = 0) -> tuple[list[str], torch.Tensor]:
    """The vocabulary and the generated text as character ids."""
    text = make_text(seed=seed)
    vocab = sorted(set(text))
    return vocab, torch.tensor([vocab.index(c) for c in text])


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(BLOCK, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.1, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(BLOCK))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        h = self.embed(idx) + self.pos[:t]
        return self.head(self.blocks(h, mask=self.mask[:t, :t], is_causal=True))


@exit_on_error
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    TrainConfig.add_arguments(parser)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    cfg = TrainConfig.from_sources(args)
    if not cfg.max_steps:
        cfg.max_steps = 300

    import horovod.torch as hvd

    import hvd_resilient
    from hvd_resilient import log
    from hvd_resilient.backends.horovod.backend import HorovodBackend
    from hvd_resilient.backends.horovod.state import ElasticState
    from hvd_resilient.backends.threads import share_cores
    from hvd_resilient.events import EventLog
    from hvd_resilient.state.sampler import ElasticDataSampler
    from hvd_resilient.training.durable import DurableCheckpoints

    hvd.init()
    log.setup(rank_fn=hvd.rank)
    share_cores(hvd.local_size())
    vocab, data = make_data()
    n_windows = (len(data) - 1) // BLOCK

    torch.manual_seed(cfg.seed)
    model = TinyLM(len(vocab))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=args.lr),
        named_parameters=model.named_parameters(),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(
            s / cfg.max_steps, 1.0))))
    events = EventLog(os.path.join(cfg.run_dir, "events.jsonl"), rank=hvd.rank, size=hvd.size)
    state = ElasticState(model, optimizer, scheduler=scheduler, events=events,
                         sampler=ElasticDataSampler(n_windows, seed=cfg.seed), seed=cfg.seed,
                         lr_scaling=cfg.lr_scaling, loss=math.nan)
    checkpoints = DurableCheckpoints(cfg, state, events, HorovodBackend())
    checkpoints.start()  # resume on rank 0; a failure stops every rank at the first sync

    @hvd_resilient.run
    def train(state: ElasticState) -> None:
        while state.step < cfg.max_steps:
            if state.sampler.epoch_done():
                state.sampler.set_epoch(state.sampler.epoch + 1)
            sl = state.sampler.next_slice(hvd.rank(), hvd.size(), cfg.batch_size)
            optimizer.zero_grad()
            if sl.indices:
                starts = torch.tensor(sl.indices) * BLOCK
                x = torch.stack([data[s : s + BLOCK] for s in starts])
                y = torch.stack([data[s + 1 : s + BLOCK + 1] for s in starts])
                loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
                (loss * len(sl.indices) * hvd.size() / sl.global_count).backward()
                state.loss = loss.item()
            optimizer.step()
            scheduler.step()
            state.sampler.advance(sl.global_count)
            state.step += 1
            if hvd.rank() == 0 and state.step % cfg.log_every == 0:
                print(f"step {state.step} loss {state.loss:.3f} world {hvd.size()}", flush=True)
            # a host change is acted on at once, not at the next commit
            if state.step % cfg.commit_every == 0 or state.host_change_pending():
                state.commit()
            if checkpoints.due():
                checkpoints.save()
        checkpoints.finish()  # the final checkpoint, published before anyone returns

    train(state)
    checkpoints.close(timeout=cfg.checkpoint.grace_seconds)
    events.emit("done", loss=state.loss, params_sha256=state.params_sha256())
    if hvd.rank() == 0:
        print(f"final loss {state.loss:.3f} (uniform guess {math.log(len(vocab)):.3f}); "
              f"run folder {cfg.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
