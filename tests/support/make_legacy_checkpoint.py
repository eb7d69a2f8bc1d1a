"""Write the checkpoints of tests/support/legacy/ with whatever ds_muon is importable (public API only).

The committed files were written by ds_muon at commit ef314f8 (2026-12-01), the layout before the
architecture change, so a test can load them with today's code (tests/dist/test_checkpoint.py,
``test_checkpoint_of_2026_12_01_loads_and_continues``):

    git worktree add /tmp/old ef314f8
    cd /tmp/old && DS_MUON=0 PYTHONPATH=/tmp/old:$VIRTUAL_ENV/lib/python3.11/site-packages \\
        python -S $REPO/tests/support/make_legacy_checkpoint.py $REPO/tests/support/legacy

(``python -S``: the installed ds_muon's start-up hook, a ``.pth`` file, must not load today's package into
the old run; its spawned ranks inherit the flag.)

Per optimizer (``muon``: ParityNet with Muon and AdamW sub-groups; ``adam_mini``: the same model with
``"type": "AdamMini"``), at W=2 on gloo: train 2 steps, save tag ``legacy`` into ``OUT/<optimizer>/``, train a
3rd step and store every trainable parameter's fp32 master weights after the 3rd step in
``OUT/<optimizer>/after_step3.pt`` (what today's code must reach from the checkpoint).
"""
from __future__ import annotations

import os
import sys


def _models():
    try:
        from tests.support import models
    except ImportError:  # the layout of 2026-12-01 and before
        from tests import models
    return models


def config(optimizer: str) -> dict:
    # betas (0.5, 0.75): powers exact in fp32, so DeepSpeed's CPU Adam gives a resumed run the continuous
    # run's bias corrections bit for bit (tests/dist/test_checkpoint.py's module docstring says why)
    params = ({"lr": 0.02, "adam_lr": 3e-3, "momentum": 0.9, "weight_decay": 0.05, "ns_dtype": "float32",
               "exchange_dtype": "float32", "betas": [0.5, 0.75]} if optimizer == "muon"
              else {"lr": 3e-3, "weight_decay": 0.05, "betas": [0.5, 0.75]})
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "optimizer": {"type": "Muon" if optimizer == "muon" else "AdamMini", "params": params},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "steps_per_print": 10_000, "wall_clock_breakdown": False}


def train(engine, rank: int, steps) -> None:
    models = _models()
    for step in steps:
        tokens, targets = models.batch(step, rank, 0)
        engine.backward(engine(tokens, targets, models.use_extra(step)))
        engine.step()


def fp32_masters(engine) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param
    return {n: safe_get_full_fp32_param(p).detach().float().cpu().clone()
            for n, p in engine.module.named_parameters() if p.requires_grad}


def worker(rank: int, world_size: int, out: str) -> None:
    import torch

    import ds_muon
    for optimizer in ("muon", "adam_mini"):
        torch.manual_seed(0)
        model = _models().ParityNet()
        engine, _, _, _ = ds_muon.initialize(model=model, model_parameters=model.parameters(), config=config(optimizer))
        train(engine, rank, range(2))
        engine.save_checkpoint(os.path.join(out, optimizer), tag="legacy")
        train(engine, rank, range(2, 3))
        masters = fp32_masters(engine)
        if rank == 0:
            torch.save(masters, os.path.join(out, optimizer, "after_step3.pt"))
        engine.destroy()


def main(out: str) -> None:
    import torch.multiprocessing as mp
    os.makedirs(out, exist_ok=True)
    mp.start_processes(_spawned, args=(2, out, sys.path), nprocs=2, start_method="spawn")


def _spawned(rank: int, world_size: int, out: str, path: list) -> None:
    sys.path[:] = path
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29631", RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import deepspeed
    import torch
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    worker(rank, world_size, out)
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
