"""What DeepSpeed's built-in Muon does with each DeepSpeed lr scheduler (docs/migration.md's table).

    PYTHONPATH=. python scripts/measure_builtin_schedulers.py

CPU, one process, ZeRO-3 with reduce_scatter false (the built-in refuses true), lr 0.02, adam_lr 0.003,
ds_muon not enabled. Prints, per scheduler, each param group's lr before each of 3 optimizer steps.
"""
import os
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29611",
                  DS_MUON="0")  # the built-in, not ds_muon (the zero-code hook reads it when deepspeed is imported)
import torch, deepspeed
deepspeed.init_distributed(dist_backend="gloo", verbose=False)
from tests.support.models import ParityNet, batch
scheds = {
 "WarmupLR(warmup_max_lr=0.02)": ("WarmupLR", {"warmup_min_lr": 0.002, "warmup_max_lr": 0.02, "warmup_num_steps": 4, "warmup_type": "linear"}),
 "WarmupLR(no warmup_max_lr)": ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_num_steps": 4, "warmup_type": "linear"}),
 "WarmupDecayLR(warmup_max_lr=0.02)": ("WarmupDecayLR", {"total_num_steps": 10, "warmup_max_lr": 0.02, "warmup_num_steps": 2, "warmup_type": "linear"}),
 "WarmupCosineLR": ("WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 2, "warmup_type": "linear"}),
 "OneCycle(0.002..0.02)": ("OneCycle", {"cycle_min_lr": 0.002, "cycle_max_lr": 0.02, "cycle_first_step_size": 2}),
 "LRRangeTest(min 0.02)": ("LRRangeTest", {"lr_range_test_min_lr": 0.02, "lr_range_test_step_size": 1}),
}
for label, (name, params) in scheds.items():
    torch.manual_seed(0)
    model = ParityNet(conv=False)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 3e-3}},
           "zero_optimization": {"stage": 3, "reduce_scatter": False}, "scheduler": {"type": name, "params": params},
           "steps_per_print": 10000}
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    rows = []
    for step in range(3):
        tok, tgt = batch(step, 0, 0, 2)
        loss = engine(tok, tgt, True); engine.backward(loss)
        groups = engine.optimizer.optimizer.param_groups
        rows.append(", ".join(f"{'muon' if g.get('use_muon') else 'adam'}={g['lr']:.4g}" for g in groups))
        engine.step()
    print(f"{label} [{type(engine.optimizer.optimizer).__name__}]: " + " | ".join(f"step{i+1}: {r}" for i, r in enumerate(rows)), flush=True)
    engine.destroy()
# every rank done, then the process group torn down while Python is fully alive (docs/troubleshooting.md)
torch.distributed.barrier()
torch.distributed.destroy_process_group()
