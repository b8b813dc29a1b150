"""The optimizers and recipes the conformance tests run: every optimizer class of
``torch.optim`` (foreach and fused variants where the build has them), and a small model with
what real models have (an embedding tied to the output layer, a frozen layer, norm buffers).

Importable by the test scripts that run under horovodrun, torchrun and mpirun.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

VOCAB, DIM = 16, 12


class RecipeModel(nn.Module):
    """Tied embedding/output weights, a frozen projection, a norm layer and a buffer.

    LayerNorm, not BatchNorm: BatchNorm's running statistics are each rank's own under Horovod
    (as in Horovod: `hvd.SyncBatchNorm` shares them; DDP broadcasts rank 0's every forward),
    so they are equal only right after a sync, which the sync matrix checks."""

    def __init__(self, sparse: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, sparse=sparse)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.hidden = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM))
        self.out = nn.Linear(DIM, VOCAB, bias=True)
        if not sparse:
            self.out.weight = self.embed.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx).mean(dim=1)
        h = torch.relu(self.hidden(self.frozen(h)))
        return self.out(self.norm(h) * self.scale)


def batch(seed: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n, 4), generator=g)
    return x, x[:, 0]


def _param_groups(model: nn.Module, lr: float) -> list[dict[str, Any]]:
    """Two groups with their own lr and weight decay; frozen parameters left out."""
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() <= 1]
    return [{"params": decay, "weight_decay": 0.05, "lr": lr},
            {"params": rest, "weight_decay": 0.0, "lr": lr * 2}]


def _make(cls: type, **kw: Any) -> Callable[[nn.Module], torch.optim.Optimizer]:
    def build(model: nn.Module) -> torch.optim.Optimizer:
        if cls is torch.optim.Muon:  # matrices only, by its definition
            params = [p for p in model.parameters() if p.requires_grad and p.dim() == 2]
            return cls(params, **kw)
        if cls is torch.optim.SparseAdam:  # the sparse embedding's gradients only
            return cls([model.embed.weight], **kw)
        if cls is torch.optim.LBFGS:  # one group only
            return cls([p for p in model.parameters() if p.requires_grad], **kw)
        return cls(_param_groups(model, kw.pop("lr", 1e-2)), **kw)
    return build


def optimizers() -> dict[str, tuple[Callable[[nn.Module], torch.optim.Optimizer], bool]]:
    """name -> (builder, sparse model). Every Optimizer class in torch.optim; one not listed
    here fails the completeness test, so a new torch release cannot slip one past."""
    o = torch.optim
    out: dict[str, tuple[Callable[[nn.Module], torch.optim.Optimizer], bool]] = {
        "SGD-nesterov-wd": (_make(o.SGD, lr=0.05, momentum=0.9, nesterov=True,
                                  weight_decay=1e-2), False),
        "Adam": (_make(o.Adam, lr=1e-2), False),
        "AdamW-foreach": (_make(o.AdamW, lr=1e-2, weight_decay=0.01, foreach=True), False),
        "AdamW-loop": (_make(o.AdamW, lr=1e-2, weight_decay=0.01, foreach=False), False),
        "AdamW-amsgrad": (_make(o.AdamW, lr=1e-2, amsgrad=True), False),
        "Adagrad": (_make(o.Adagrad, lr=1e-2), False),
        "RMSprop": (_make(o.RMSprop, lr=1e-3, momentum=0.9, centered=True), False),
        "Adadelta": (_make(o.Adadelta), False),
        "Adamax": (_make(o.Adamax), False),
        "NAdam": (_make(o.NAdam, decoupled_weight_decay=True), False),
        "RAdam": (_make(o.RAdam, decoupled_weight_decay=True), False),
        "ASGD": (_make(o.ASGD, lr=1e-2, t0=1), False),
        "Rprop": (_make(o.Rprop), False),
        "LBFGS": (_make(o.LBFGS, lr=0.1, history_size=3, max_iter=2), False),
        "SparseAdam": (_make(o.SparseAdam, lr=1e-2), True),
    }
    if hasattr(o, "Adafactor"):
        out["Adafactor"] = (_make(o.Adafactor, lr=1e-2), False)
    if hasattr(o, "Muon"):
        out["Muon"] = (_make(o.Muon, lr=1e-2), False)
    for cls in (o.Adam, o.AdamW, o.SGD, o.Adagrad):
        if "fused" in inspect.signature(cls.__init__).parameters and _fused_works(cls):
            extra = {"momentum": 0.9} if cls is o.SGD else {}
            out[f"{cls.__name__}-fused"] = (_make(cls, lr=1e-2, fused=True, **extra), False)
    return out


def _fused_works(cls: type) -> bool:
    try:
        p = nn.Parameter(torch.zeros(2))
        p.grad = torch.ones(2)
        cls([p], lr=1e-2, fused=True).step()
        return True
    except (RuntimeError, ValueError):
        return False


def covered_classes() -> set[str]:
    names = {name.split("-")[0] for name in optimizers()}
    return names


def all_classes() -> set[str]:
    return {n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)
            and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)
            and n != "Optimizer"}


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, seeds: list[int]) -> None:
    """A few local steps (no collective): state in every slot of the optimizer."""
    dense = [p for g in opt.param_groups for p in g["params"]]
    for s in seeds:
        x, y = batch(s)

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            for p in model.parameters():  # what this optimizer does not own stays put
                if all(p is not q for q in dense):
                    p.grad = None
            return loss

        opt.step(closure)
