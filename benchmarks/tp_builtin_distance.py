"""DeepSpeed's built-in Muon under AutoTP vs. the full-matrix Muon update: how far apart are they? (issue 25)

Trains a tiny transformers Llama (tests/support/autotp.py) for ONE optimizer step with DeepSpeed 0.19.8's built-in
Muon (ds_muon disabled: ``DS_MUON=0``), ZeRO stage 2, no weight decay, in two runs: W=2 with
``tensor_parallel.autotp_size: 2`` (TP=2, DP=1) and W=1 without tensor parallelism. Each run's update of every split
Muon matrix (the 7 projections of each layer; the TP shards reassembled) is compared with the update of the
single-device oracle ``ds_muon.MuonAdamW`` (fp32 Newton–Schulz of the full matrix, same lr, momentum, data):
``||built-in update - full-matrix update|| / ||full-matrix update||``. The built-in orthogonalizes and shape-scales
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


def _distance(run: dict) -> dict:
    import ds_muon
    model = tiny_llama()
    opt = ds_muon.MuonAdamW(model, **MUON, ns_dtype="float32")
    ids = tokens(0, 0, 0)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    rel = {}
    for n, p in model.named_parameters():
        if n.endswith(".weight") and any(k in n for k in SPLIT):
            want = p.detach() - run["init"][n]
            rel[n] = float((run["got"][n] - run["init"][n] - want).norm() / want.norm())
    return rel


def main() -> None:
    summary = {}
    for world, tp in ((2, 2), (1, 1)):
        run = run_distributed(_builtin, world, tp, env={"DS_MUON": "0"})[0]
        rel = _distance(run)
        overall = sum(rel.values()) / len(rel)
        summary[f"TP={tp}"] = {"optimizer": run["optimizer"], "mean": overall, "min": min(rel.values()),
                               "max": max(rel.values()), "per_matrix": rel}
        print(f"built-in Muon ({run['optimizer']}), TP={tp}: relative distance from the full-matrix update "
              f"mean {overall:.3g}, min {min(rel.values()):.3g}, max {max(rel.values()):.3g}")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
