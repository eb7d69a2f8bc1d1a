"""DeepSpeed's built-in Muon under AutoTP vs. the full-matrix Muon update: how far apart are they? (issue 25)

Trains a tiny transformers Llama (tests/support/autotp.py) for ONE optimizer step with DeepSpeed 0.19.8's built-in
Muon (ds_muon disabled: ``DS_MUON=0``), ZeRO stage 2, no weight decay, in two runs: W=2 with
``tensor_parallel.autotp_size: 2`` (TP=2, DP=1) and W=1 without tensor parallelism. Each run's update of every split
Muon matrix (the 7 projections of each layer; the TP shards reassembled) is compared with the update of the
single-device oracle ``ds_muon.MuonAdamW`` (fp32 Newton–Schulz of the full matrix, same lr, momentum, data):
``||c * built-in update - full-matrix update|| / ||full-matrix update||``. The built-in orthogonalizes and shape-scales
each TP shard on its own, so with TP it lands far from the full-matrix update; without TP it matches up to its
bf16 Newton–Schulz.

Usage: ``python benchmarks/tp_builtin_distance.py`` (CPU, gloo; a few minutes). Prints one line per run and a JSON
summary; docs/parallelism_tp.md records the result.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tests.support.autotp import SPLIT, full_params, tiny_llama, tokens  # noqa: E402
from tests.support.spawn import run_distributed  # noqa: E402

MUON = {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.0}
MICRO = 2


def _builtin(rank: int, world_size: int, tp: int) -> dict | None:
    import deepspeed
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "Muon", "params": dict(MUON)}, "zero_optimization": {"stage": 2},
           "steps_per_print": 10_000}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    model = tiny_llama()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    ids = tokens(0, 0, 0)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    got = full_params(model, tp) if tp > 1 else {n: p.detach().float().clone() for n, p in model.named_parameters()}
    out = {"optimizer": type(engine.optimizer).__name__, "got": got, "init": init}
    return out if rank == 0 else None


def _oracle_updates(init: dict) -> dict:
    """The full-matrix Muon update of every split Muon matrix (single-device oracle, fp32 Newton–Schulz)."""
    import ds_muon
    model = tiny_llama()
    opt = ds_muon.MuonAdamW(model, **MUON, ns_dtype="float32")
    ids = tokens(0, 0, 0)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return {n: p.detach() - init[n] for n, p in model.named_parameters()
            if n.endswith(".weight") and any(k in n for k in SPLIT)}


def _distances(run: dict, want: dict, scale: float) -> dict:
    """``||scale * built-in update - full-matrix update|| / ||full-matrix update||`` per matrix."""
    return {n: float((scale * (run["got"][n] - run["init"][n]) - w).norm() / w.norm()) for n, w in want.items()}


def main() -> None:
    runs = {tp: run_distributed(_builtin, world, tp, env={"DS_MUON": "0"})[0] for world, tp in ((2, 2), (1, 1))}
    want = _oracle_updates(runs[1]["init"])
    # The built-in's step size differs from ds_muon's by one global factor (measured at TP=1, where both
    # orthogonalize the same matrices): fitted once, least squares over every matrix, and applied to both runs.
    got1 = {n: runs[1]["got"][n] - runs[1]["init"][n] for n in want}
    scale = float(sum((got1[n] * want[n]).sum() for n in want) / sum((got1[n] ** 2).sum() for n in want))
    summary = {"global_step_size_factor": scale}
    for tp, run in runs.items():
        for label, c in (("raw", 1.0), ("step-size matched", scale)):
            rel = _distances(run, want, c)
            summary[f"TP={tp} {label}"] = {"mean": sum(rel.values()) / len(rel), "min": min(rel.values()),
                                          "max": max(rel.values()), "per_matrix": rel}
            print(f"built-in Muon ({run['optimizer']}), TP={tp}, {label}: relative distance from the full-matrix "
                  f"update mean {sum(rel.values()) / len(rel):.3g}, min {min(rel.values()):.3g}, "
                  f"max {max(rel.values()):.3g}")
    print(f"global step-size factor (ds_muon / built-in) fitted at TP=1: {scale:.4g}")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
