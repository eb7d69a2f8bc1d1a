"""Host cost of the overlapped Muon step's bookkeeping in backward: ``SpeculativeMuon.mark_final`` with the
speculation itself stubbed out, on owner plans built as ds_muon builds them for a model preset (CPU, no engine,
no GPU).

Issue 40 (docs/benchmarks.md, session 5): at MoE-1.5B the overlapped step adds 0.038 s of CPU time to backward's
thread, not yet attributed. ``mark_final`` runs on that thread once per ZeRO gradient bucket, with the bucket's
parameters, and finds the owner-plan buckets they complete. Before 2026-12-05 it scanned every bucket of the
sub-group for every parameter, and every slot of each started bucket (quadratic in the parameters); it now looks
the parameter's buckets up (``SpeculativeMuon._buckets_of``). This script measures what is left.

For each preset (built on the meta device): the Muon parameters as ds_muon selects them (``select_muon_params``),
cut into sub-groups by DeepSpeed 0.19.8's own ``DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups`` at its
default ``sub_group_size`` (1e9 elements), each sub-group's owner plan at W=1 in backward order with the default
256 MiB exchange bucket (bf16, as ``zero_common.py`` sizes it). ``mark_final`` is called once per ZeRO reduce
bucket, with that bucket's Muon parameters: every trainable parameter in reverse order (backward's, roughly),
cut into buckets of at most ``--reduce-bucket`` elements (default 5e7, ds_muon's bucket under the overlapped step
when the measurement below was taken; 1e8 since, which halves the calls; a larger
parameter is a bucket of its own), ``--steps`` times. Prints a table: Muon parameters, sub-groups, owner-plan
buckets, calls per step, milliseconds per step.

**Target**: under 0.5 ms per step at each preset, at most a few percent of the 0.038 s to attribute. Measured on
this repository's 2-core CPU machine (2026-12-05, default arguments): see docs/benchmarks.md, "The bookkeeping of
``mark_final``"; at most about 1% of MoE-1.5B's 0.038 s before the lookup, about 0.3% after.

    python benchmarks/mark_final_cost.py [--presets 934m,2.9b,moe-1.5b] [--steps 200] [--reduce-bucket 50000000]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]


class _Sized:
    """A parameter as DeepSpeed's sub-group cut reads it (``partition_numel()`` at W=1)."""

    def __init__(self, name: str, param) -> None:
        self.name, self.param = name, param

    def partition_numel(self) -> int:
        return self.param.numel()


def preset_steps(preset: str, reduce_bucket: int = 50_000_000):
    """``(steps, calls)`` for ``preset``: ``{sub-group: MuonShardStep}`` at W=1 (its parameters cut as DeepSpeed
    cuts sub-groups), and per ZeRO reduce bucket of backward the ``[(sub-group, index), ...]`` of its Muon
    parameters (buckets without one left out: ``mark_final`` is not called for them)."""
    import types

    import torch
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from model import CausalLM, ModelConfig
    from ds_muon.model.selection import select_muon_params
    from ds_muon.sharded.blocks import build_block_map
    from ds_muon.sharded.exchange import OwnerExchange
    from ds_muon.sharded.muon_step import MuonShardStep
    from ds_muon.sharded.ownership import ParamInfo, build_bucketed_plan
    with torch.device("meta"):
        model = CausalLM(dataclasses.replace(ModelConfig.preset(preset), record_max_logits=False))
    selection = select_muon_params(model)
    muon = [_Sized(name, p) for name, p in model.named_parameters() if selection.use_muon.get(name)]
    groups = DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups(types.SimpleNamespace(sub_group_size=10**9), muon)
    group = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True, "ns_method": "standard",
             "ns_steps": 5, "update_scale": "shape"}
    steps, where = {}, {}
    for i, params in enumerate(groups):
        infos = [ParamInfo(x.name, tuple(x.param.shape), x.param.numel(), selection.splits.get(x.name))
                 for x in params]
        plan = build_bucketed_plan(infos, 1, (256 << 20) // 2, order="reverse")
        exchange = OwnerExchange(None, torch.bfloat16, torch.bfloat16, torch.device("cpu"))
        steps[i] = MuonShardStep(f"{preset} sub-group {i}", plan, build_block_map(plan.slots, 0, plan.shard_numel),
                                 exchange, group, ns_compile=False, ns_autotune=False)
        where.update({x.name: (i, j) for j, x in enumerate(params)})
    calls, bucket, size = [], [], 0
    for name, p in reversed(list(model.named_parameters())):
        if bucket and size + p.numel() > reduce_bucket:
            calls.append(bucket)
            bucket, size = [], 0
        bucket.append(name)
        size += p.numel()
    calls.append(bucket)
    return steps, [[where[n] for n in b if n in where] for b in calls if any(n in where for n in b)]


def seconds_per_step(steps: dict, calls: list, n_steps: int) -> float:
    """Mean seconds of one step's ``mark_final`` calls (the speculation stubbed: it only marks its bucket started)."""
    from ds_muon.sharded.overlap import SpeculativeMuon
    spec = SpeculativeMuon(steps, {i: step.exchange for i, step in steps.items()})

    def started(i, k, *args):
        spec._state[i].started[k] = True
    spec._speculate = started
    t0 = time.perf_counter()
    for _ in range(n_steps):
        spec._state.clear()
        for finals in calls:
            spec.mark_final(finals, lambda i: None, lambda i: None, lambda i: {}, 1.0)
    return (time.perf_counter() - t0) / n_steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="934m,2.9b,moe-1.5b")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--reduce-bucket", type=int, default=50_000_000, help="ZeRO reduce bucket, elements")
    args = ap.parse_args()
    print("| preset | Muon parameters | sub-groups | owner-plan buckets | mark_final calls per step | "
          "ms per step (target < 0.5) |")
    print("|---|---|---|---|---|---|")
    for preset in args.presets.split(","):
        steps, calls = preset_steps(preset, args.reduce_bucket)
        seconds = seconds_per_step(steps, calls, args.steps)
        print(f"| {preset} | {sum(len(s.plan.slots) for s in steps.values())} | {len(steps)} | "
              f"{sum(len(s.plan.buckets) for s in steps.values())} | {len(calls)} | {seconds * 1e3:.3f} |")


if __name__ == "__main__":
    main()
