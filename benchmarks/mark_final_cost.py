"""Host cost of the overlapped Muon step's bookkeeping in backward: ``SpeculativeMuon.mark_final`` with the
speculation itself stubbed out, on the real owner plans of a model preset (CPU, no DeepSpeed, no GPU).

Issue 40 (docs/benchmarks.md, session 5): at MoE-1.5B the overlapped step adds 0.038 s of CPU time to backward's
thread, not yet attributed. ``mark_final`` runs on that thread once per ZeRO gradient bucket, with the bucket's
parameters, and finds the owner-plan buckets they complete. Before 2026-12-05 it scanned every bucket of the
sub-group for every parameter, and every slot of each started bucket (quadratic in the parameters); it now looks
the parameter's buckets up (``SpeculativeMuon._buckets_of``). This script measures what is left.

For each preset: the Muon parameters as ds_muon selects them (``select_muon_params``, built on the meta device), one
sub-group, the owner plan at W=1 in backward order with the default 256 MiB exchange bucket (bf16), and
``mark_final`` called with ``--params-per-call`` parameters at a time in reverse order (a ZeRO reduce bucket of
5e7 elements holds a few layers' matrices), ``--steps`` times. Prints a table: parameters, owner-plan buckets,
calls per step, milliseconds per step.

**Target**: under 0.5 ms per step at each preset (a few percent of the 0.038 s to attribute). Measured on this
repository's 2-core CPU machine (2026-12-05, default arguments): 934M 0.071, 2.9B 0.113, MoE-1.5B 0.063 ms per
step; the scan before: 0.351, 1.171, 0.356 ms. Either way the bookkeeping is about 1% of MoE-1.5B's 0.038 s.

    python benchmarks/mark_final_cost.py [--presets 934m,2.9b,moe-1.5b] [--steps 200] [--params-per-call 6]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]


def preset_plan_step(preset: str):
    """A W=1 :class:`~ds_muon.sharded.muon_step.MuonShardStep` over the Muon parameters of ``preset`` (built on the
    meta device) in backward order, and the number of its parameters."""
    import torch
    from model import CausalLM, ModelConfig
    from ds_muon.model.selection import select_muon_params
    from ds_muon.sharded.blocks import build_block_map
    from ds_muon.sharded.exchange import OwnerExchange
    from ds_muon.sharded.muon_step import MuonShardStep
    from ds_muon.sharded.ownership import ParamInfo, build_bucketed_plan
    with torch.device("meta"):
        model = CausalLM(dataclasses.replace(ModelConfig.preset(preset), record_max_logits=False))
    selection = select_muon_params(model)
    infos = [ParamInfo(name, tuple(p.shape), p.numel(), selection.splits.get(name))
             for name, p in model.named_parameters() if selection.use_muon.get(name)]
    plan = build_bucketed_plan(infos, 1, (256 << 20) // 2, order="reverse")
    exchange = OwnerExchange(None, torch.bfloat16, torch.bfloat16, torch.device("cpu"))
    group = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True, "ns_method": "standard",
             "ns_steps": 5, "update_scale": "shape"}
    step = MuonShardStep(preset, plan, build_block_map(plan.slots, 0, plan.shard_numel), exchange, group,
                         ns_compile=False, ns_autotune=False)
    return step, len(infos)


def seconds_per_step(step, n_params: int, steps: int, per_call: int) -> tuple[float, int]:
    """Mean seconds of one step's ``mark_final`` calls (the speculation stubbed: it only marks its bucket started),
    and the calls per step."""
    from ds_muon.sharded.overlap import SpeculativeMuon
    spec = SpeculativeMuon({0: step}, {0: step.exchange})

    def started(i, k, *args):
        spec._state[i].started[k] = True
    spec._speculate = started
    order = list(range(n_params))[::-1]
    calls = [[(0, p) for p in order[j:j + per_call]] for j in range(0, n_params, per_call)]
    t0 = time.perf_counter()
    for _ in range(steps):
        spec._state.clear()
        for finals in calls:
            spec.mark_final(finals, lambda i: None, lambda i: None, lambda i: {}, 1.0)
    return (time.perf_counter() - t0) / steps, len(calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="934m,2.9b,moe-1.5b")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--params-per-call", type=int, default=6)
    args = ap.parse_args()
    print("| preset | Muon parameters | owner-plan buckets | mark_final calls per step | ms per step (target < 0.5) |")
    print("|---|---|---|---|---|")
    for preset in args.presets.split(","):
        step, n = preset_plan_step(preset)
        s, calls = seconds_per_step(step, n, args.steps, args.params_per_call)
        print(f"| {preset} | {n} | {len(step.plan.buckets)} | {calls} | {s * 1e3:.3f} |")


if __name__ == "__main__":
    main()
