"""Two ranks: rank 0 has trained, rank 1 is a newcomer (another init, an empty optimizer).
After the state's sync every component must be bit-identical on both, for every optimizer of
torch.optim, and stay identical through one more data-parallel step. One JSON line per case.

    horovodrun -np 2 --gloo python tests/scripts/sync_matrix.py horovod OUT.jsonl
    mpirun -np 2 python tests/scripts/sync_matrix.py horovod OUT.jsonl
    torchrun --nproc-per-node 2 tests/scripts/sync_matrix.py torchrun OUT.jsonl

`horovod-legacy` runs Horovod's own `TorchState.sync()` on the same cases, to show which
optimizers it leaves diverged.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.support import recipes  # noqa: E402

LEGACY_CASES = ("SGD-nesterov-wd", "Adam", "AdamW-foreach", "AdamW-fused", "Adagrad",
                "RMSprop")


def main(kind: str, out_path: str) -> None:
    from hvd_resilient.state.agreement import digest_tree

    if kind.startswith("horovod"):
        import horovod.torch as hvd

        hvd.init()
        rank, gather = hvd.rank(), hvd.allgather_object
    else:
        import torch.distributed as dist

        from hvd_resilient.backends.torchdist.collectives import TorchDistCollectives

        dist.init_process_group("gloo")
        rank, gather = dist.get_rank(), TorchDistCollectives().allgather_object
    results = []
    cases = recipes.optimizers()
    if kind == "horovod-legacy":  # Horovod refuses LBFGS outright; the common ones suffice
        cases = {k: v for k, v in cases.items() if k in LEGACY_CASES}
    for name, (build, sparse) in cases.items():
        torch.manual_seed(0 if rank == 0 else 1000)  # the newcomer starts elsewhere
        model = recipes.RecipeModel(sparse=sparse)
        opt = build(model)
        sched = torch.optim.lr_scheduler.SequentialLR(opt, [
            torch.optim.lr_scheduler.LinearLR(opt, 0.1, total_iters=2),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)], milestones=[2])
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        ema = torch.optim.swa_utils.AveragedModel(
            model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
        if rank == 0:
            recipes.train_steps(model, opt, [1, 2, 3])
            sched.step()
            ema.update_parameters(model)
            scaler.scale(torch.ones(()))  # the scale exists once something was scaled
            scaler.update(2.0 ** 12)
        comps = {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler,
                 "ema": ema}
        if kind == "horovod-legacy":
            state = hvd.elastic.TorchState(model, opt)
        elif kind.startswith("horovod"):
            from hvd_resilient.backends.horovod.state import ElasticState

            state = ElasticState(model, opt, scheduler=sched, scaler=scaler, ema=ema)
        else:
            from hvd_resilient.backends.torchdist.collectives import TorchDistCollectives
            from hvd_resilient.backends.torchrun.state import TorchrunState

            state = TorchrunState(model, opt, rank=dist.get_rank, size=dist.get_world_size,
                                  scheduler=sched, collectives=TorchDistCollectives(),
                                  scaler=scaler, ema=ema)
        state.sync()
        after_sync = {k: digest_tree(v.state_dict()) for k, v in comps.items()}
        recipes.train_steps(model, opt, [7])  # the same batch on both: must stay equal
        after_step = digest_tree(model.state_dict())
        everyone = gather((after_sync, after_step))
        if rank == 0:
            bad = sorted(k for k in after_sync if everyone[1][0][k] != everyone[0][0][k])
            results.append({"case": name, "differ_after_sync": bad,
                            "differ_after_step": everyone[1][1] != everyone[0][1]})
    if rank == 0:
        with open(out_path, "w") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    if not kind.startswith("horovod"):
        # released before the interpreter's teardown: left to it, Gloo's threads can abort a
        # finished process ("terminate called without an active exception", seen in CI)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
