"""The globals (besides torch's weights-only defaults) that real ds_muon checkpoints hold.

    python scripts/checkpoint_globals.py OUT_DIR

Trains the parity model one step at W=2 on the CPU (gloo) in each mode of ``MODES`` (ZeRO-1/2/3; fp32, bf16, fp16;
CPU and NVMe optimizer offload; Adam-mini; an lr scheduler), saves a checkpoint of each under OUT_DIR, converts
three of them to universal checkpoints, and prints every global that ``torch.load(weights_only=True)`` would
refuse with the files that hold it. ``ds_muon.checkpoint.safe_load.ALLOWED_GLOBALS`` is this list (measured
2026-12-02, deepspeed 0.19.8: ``LossScaler``, ``DynamicLossScaler``, ``ZeroStageEnum``, ``fragment_address``).
"""
import glob
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

from tests.support.spawn import run_distributed  # noqa: E402

MODES = {
    "z3_bf16": dict(stage=3, bf16=True), "z3_fp16": dict(stage=3, fp16=True), "z3_cpu": dict(stage=3, offload="cpu"),
    "z3_nvme": dict(stage=3, offload="nvme"), "z3_adam_mini": dict(stage=3, adam_mini=True),
    "z2_bf16": dict(stage=2, bf16=True), "z2_fp16": dict(stage=2, fp16=True), "z1_cpu": dict(stage=1, offload="cpu"),
    "z2_adam_mini": dict(stage=2, adam_mini=True), "z3_sched": dict(stage=3, sched=True),
}
UNIVERSAL = ("z3_bf16", "z2_fp16", "z3_adam_mini")


def _config(root: str, name: str, mode: dict) -> dict:
    from tests.support.harness import ds_config, swap_dir_for
    cfg = ds_config(optimizer={"type": "AdamMini", "params": {"lr": 1e-3}} if mode.get("adam_mini") else None)
    cfg["zero_optimization"] = {"stage": mode["stage"]}
    if mode.get("offload") == "cpu":
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if mode.get("offload") == "nvme":
        swap = swap_dir_for(os.path.join(root, f"swap-{name}"))
        os.makedirs(swap, exist_ok=True)
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": swap}
    if mode.get("bf16"):
        cfg["bf16"] = {"enabled": True}
    if mode.get("fp16"):
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if mode.get("sched"):
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.02,
                                                             "warmup_num_steps": 3}}
    return cfg


def worker(rank: int, world_size: int, root: str) -> bool:
    from tests.support.harness import build_engine, train_engine
    for name, mode in MODES.items():
        engine, _ = build_engine(_config(root, name, mode))
        train_engine(engine, 1, rank, 1)
        engine.save_checkpoint(os.path.join(root, name), tag="t", client_state={"epoch": 1})
        engine.destroy()
    return True


def main() -> None:
    root = sys.argv[1]
    os.makedirs(root, exist_ok=True)
    run_distributed(worker, 2, root, timeout=1800)
    os.environ["DS_MUON_TRUST_CHECKPOINT"] = "1"  # list everything, refuse nothing
    from ds_muon.checkpoint import convert_to_universal
    for name in UNIVERSAL:
        convert_to_universal(os.path.join(root, name), os.path.join(root, f"{name}_universal"), "t")
    found: dict[str, set] = {}
    for path in sorted(glob.glob(os.path.join(root, "**", "*.pt"), recursive=True)):
        for name in torch.serialization.get_unsafe_globals_in_checkpoint(path):
            found.setdefault(name, set()).add(os.path.relpath(path, root))
    print("| global | files holding it | e.g. |\n|---|---|---|")
    for name, files in sorted(found.items()):
        print(f"| `{name}` | {len(files)} | {sorted(files)[0]} |")


if __name__ == "__main__":
    main()
