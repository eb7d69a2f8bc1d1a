"""DeepSpeed's step paths that ds_muon replaces for speed give the same bits.

``MuonZeroOptimizer._prepare_fp32_grad_for_sub_group`` (ZeRO-3: the gradient read in place in DeepSpeed's flat
buffer, or converted once, instead of DeepSpeed's concatenated copy) and ``DsMuonZeroSteps.unscale_and_clip_grads``
(both stages: DeepSpeed's multiply by exactly 1 skipped) must change no value. Each case trains the parity model
with them and again with both deleted from their classes (DeepSpeed's own methods then run), in one process group,
and requires the end states equal bit for bit: weights, momentum, AdamW state, step counts. The oracle tests'
tolerances (1e-5 relative) could not see a small difference; this can. CPU, gloo, W=2.
"""
from __future__ import annotations

import contextlib

import torch

from tests.support.harness import assert_same_state, build_engine, ds_config, state_snapshot, train_engine
from tests.support.spawn import run_distributed

STEPS = 3

CASES = [
    # fp32 accumulation: the view; clipping that fires: DeepSpeed's unscale runs on the view, in place
    {"name": "fp32_gas2_clip", "gas": 2, "clip": 0.5},
    # bf16 accumulation: the slice converted once; clipping off: the multiply by 1 skipped
    {"name": "bf16_gas2", "gas": 2, "bf16": True},
    # small sub-groups, all-reduce, small reduce buckets: many slices of the buffer
    {"name": "subgroups_allreduce", "gas": 2, "zero": {"sub_group_size": 300, "reduce_scatter": False,
                                                       "reduce_bucket_size": 100}},
    # the overlapped step with clipping that never fires: the skip decided by its clip decision on the host
    {"name": "overlap_clip_never", "clip": 1e6, "params": {"overlap_backward": True}},
    {"name": "zero2_overlap_clip_never", "clip": 1e6, "zero": {"stage": 2}, "params": {"overlap_backward": True}},
]


@contextlib.contextmanager
def deepspeeds_own_step_paths():
    """Delete ds_muon's two overrides from their classes for the block (DeepSpeed's methods run instead)."""
    from ds_muon.integration.zero3 import MuonZeroOptimizer
    from ds_muon.integration.zero_common import DsMuonZeroSteps
    saved = [(cls, name, cls.__dict__[name]) for cls, name in ((MuonZeroOptimizer, "_prepare_fp32_grad_for_sub_group"),
                                                               (DsMuonZeroSteps, "unscale_and_clip_grads"))]
    for cls, name, _ in saved:
        delattr(cls, name)
    try:
        yield
    finally:
        for cls, name, method in saved:
            setattr(cls, name, method)


def _train(rank: int, case: dict) -> dict:
    cfg = ds_config(gas=case.get("gas", 1), clip=case.get("clip", 0.0), **case.get("zero", {}))
    cfg["optimizer"]["params"].update(case.get("params", {}))
    if case.get("bf16"):
        cfg["bf16"] = {"enabled": True}
    torch.manual_seed(0)
    engine, _ = build_engine(cfg)
    train_engine(engine, STEPS, rank, case.get("gas", 1))
    state = state_snapshot(engine)
    engine.destroy()
    return state


def _cases(rank: int, world_size: int) -> list[str]:
    done = []
    for case in CASES:
        ours = _train(rank, case)
        with deepspeeds_own_step_paths():
            theirs = _train(rank, case)
        assert_same_state(ours, theirs, f"{case['name']} W={world_size} rank {rank}")
        done.append(case["name"])
    return done


def test_step_overrides_change_no_value():
    results = run_distributed(_cases, 2)
    assert all(r == [c["name"] for c in CASES] for r in results), results
