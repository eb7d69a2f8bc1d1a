"""DeepSpeed's step paths that ds_muon replaces for speed give the same bits.

``MuonZeroOptimizer._prepare_fp32_grad_for_sub_group`` (ZeRO-3: the gradient read in place in DeepSpeed's flat
buffer, or converted once, instead of DeepSpeed's concatenated copy),
``MuonZero12Optimizer._get_preflattened_grad_partition`` (ZeRO-1/2: the partition assembled straight into fp32) and
``DsMuonZeroSteps.unscale_and_clip_grads`` (both stages: DeepSpeed's multiply by exactly 1 skipped) must change no
value. Each case trains the parity model
with them and again with all three deleted from their classes (DeepSpeed's own methods then run), in one process group,
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
    # ZeRO-1/2: the gradient partition assembled straight into fp32 (bf16 accumulation; W=2 pads the last rank's
    # partition), with clipping that fires and without
    {"name": "zero2_bf16_gas2_clip", "gas": 2, "clip": 0.5, "bf16": True, "zero": {"stage": 2}, "assembled": True},
    {"name": "zero1_bf16", "bf16": True, "zero": {"stage": 1}, "assembled": True},
    # fp32 pieces: DeepSpeed's concatenation is already the only copy (or a view), so its path runs
    {"name": "zero2_fp32_no_contiguous", "gas": 2, "zero": {"stage": 2, "contiguous_gradients": False},
     "assembled": False},
]


@contextlib.contextmanager
def deepspeeds_own_step_paths():
    """Delete ds_muon's two overrides from their classes for the block (DeepSpeed's methods run instead)."""
    from ds_muon.integration.zero12 import MuonZero12Optimizer
    from ds_muon.integration.zero3 import MuonZeroOptimizer
    from ds_muon.integration.zero_common import DsMuonZeroSteps
    methods = ((MuonZeroOptimizer, "_prepare_fp32_grad_for_sub_group"), (DsMuonZeroSteps, "unscale_and_clip_grads"),
               (MuonZero12Optimizer, "_get_preflattened_grad_partition"))
    saved = [(cls, name, cls.__dict__[name]) for cls, name in methods]
    for cls, name, _ in saved:
        delattr(cls, name)
    try:
        yield
    finally:
        for cls, name, method in saved:
            setattr(cls, name, method)


def _train(rank: int, case: dict) -> tuple[dict, list[bool]]:
    """The case's end state, and per ZeRO-1/2 param group step over several gradient pieces whether ds_muon
    assembled the partition."""
    cfg = ds_config(gas=case.get("gas", 1), clip=case.get("clip", 0.0), **case.get("zero", {}))
    cfg["optimizer"]["params"].update(case.get("params", {}))
    if case.get("bf16"):  # bf16 model and bf16 gradient accumulation (DeepSpeed's default, pinned)
        cfg["bf16"] = {"enabled": True}
        cfg["data_types"] = {"grad_accum_dtype": "bf16"}
    torch.manual_seed(0)
    engine, _ = build_engine(cfg)
    opt, assembled = engine.optimizer, []
    if hasattr(opt, "single_partition_of_fp32_groups"):  # ZeRO-1/2: record what the hook returns
        real = opt._get_preflattened_grad_partition

        def recorded(i):  # per group step with several pieces and no DeepSpeed pre-flattened buffer
            pieces = opt.averaged_gradients.get(i)
            flat = real(i)  # not None there: ds_muon's assembled partition
            if isinstance(pieces, list) and len(pieces) > 1:
                assembled.append(flat is not None and flat.dtype == torch.float32)
            return flat

        opt._get_preflattened_grad_partition = recorded
    train_engine(engine, STEPS, rank, case.get("gas", 1))
    state = state_snapshot(engine)
    engine.destroy()
    return state, assembled


def _cases(rank: int, world_size: int) -> list[str]:
    done = []
    for case in CASES:
        ours, assembled = _train(rank, case)
        with deepspeeds_own_step_paths():
            theirs, _ = _train(rank, case)
        assert_same_state(ours, theirs, f"{case['name']} W={world_size} rank {rank}")
        if "assembled" in case:  # every multi-piece group step assembled by ds_muon, or none
            assert assembled and all(a == case["assembled"] for a in assembled), (case["name"], assembled)
        done.append(case["name"])
    return done


def test_step_overrides_change_no_value():
    results = run_distributed(_cases, 2)
    assert all(r == [c["name"] for c in CASES] for r in results), results
