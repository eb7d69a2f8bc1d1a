"""The overlapped Muon step at ZeRO stages 1 and 2 (``MuonZero12Optimizer`` + ``integration/overlap12.py``) is exact.

As tests/dist/test_overlap.py at ZeRO-3 (same model, ParityNet; same training loop): on the CPU the speculative
step runs inline in the last micro-batch's backward, from DeepSpeed's ``reduce_ipg_grads``. Each case trains with
overlap on and with overlap off in the same process group and requires the end states bit for bit equal
(weights, momentum, AdamW state, step counts); the plain and gradient-accumulation cases also check the oracle at
the ZeRO-1/2 parity tests' fp32 tolerances (tests/dist/test_zero12_parity.py). The counters say which path ran:
clipping that fires on every step falls back on every Muon step ("clip"), clipping that never fires commits.
DeepSpeed's reduce paths are covered: reduce-scatter into ``grads_in_partition`` (``contiguous_gradients``), with
``overlap_comm`` and many small reduce buckets, the all-reduce fallback without ``contiguous_gradients``, and
parameters larger than a reduce bucket (reduced alone), DeepSpeed's own fp32 accumulation partition (bf16 model);
and ZeRO stage 1 with ``overlap_comm`` (reduced in the last micro-batch's backward, the same hook). Stage 1 without
``overlap_comm`` (reduced after backward) refuses ``overlap_backward: true`` naming the fix; "auto" builds nothing
there, and so does stage 2 with CPU optimizer offload. A resumed run and a boundary backward never followed by a step (evaluation) are exact too (test_overlap's
checks at stage 2). One process group per world size runs every case.
"""
from __future__ import annotations

import pytest

from tests.dist.test_overlap import (_train, check_alternate, check_oracle, check_unscale_calls, resume_and_evaluation,
                                     train_on_off)
from tests.support import families
from tests.support.spawn import run_distributed

STAGE2 = {"stage": 2}

CASES = [
    {"name": "plain", "oracle": True, "zero": STAGE2},
    {"name": "gas2", "gas": 2, "oracle": True, "zero": STAGE2},
    {"name": "clip_every_step", "clip": 1e-4, "zero": STAGE2},
    {"name": "clip_never", "gas": 2, "clip": 1e6, "zero": STAGE2},
    # many reduce_ipg_grads calls during backward, gradients reduced on DeepSpeed's reduction stream path, the
    # all-reduce fallback (no contiguous_gradients), round-robin order (test_zero12_parity's overlap case)
    {"name": "overlap_comm_small_buckets", "gas": 2,
     "zero": {"stage": 2, "overlap_comm": True, "contiguous_gradients": False, "round_robin_gradients": True,
              "reduce_bucket_size": 200}},
    # contiguous gradients, small reduce buckets: most matrices are larger than a bucket (reduced alone)
    {"name": "contiguous_small_buckets", "gas": 2, "params": {"exchange_bucket_mb": 1e-4},
     "zero": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 300}},
    {"name": "allreduce_clip", "gas": 2, "clip": 0.5, "zero": {"stage": 2, "reduce_scatter": False}},
    {"name": "bf16", "bf16": True, "params": {"ns_dtype": "bfloat16", "exchange_dtype": "bfloat16"},
     "zero": STAGE2},
    # bf16 momentum (the built-in's state precision): as test_overlap's case
    {"name": "bf16_momentum", "bf16": True, "gas": 2,
     "params": {"momentum_dtype": "bfloat16", "ns_dtype": "bfloat16", "exchange_dtype": "bfloat16"}, "zero": STAGE2},
    # an owner-plan bucket of two matrices across the partition boundary at W=2 ([conv, up]: rank 0 holds conv's head
    # and none of up, rank 1 the rest): a rank's scratch then starts far into its partition and a piece it lacks is
    # empty (the per-bucket scratch once read such a piece at its offset 0: IndexError mid-backward on rank 0)
    {"name": "bucket_across_partitions", "params": {"exchange_bucket_mb": 0.0105}, "zero": STAGE2},
    # ZeRO stage 1 with overlap_comm: reduced bucket by bucket in the last micro-batch's backward, the same hook
    {"name": "stage1_overlap_comm", "gas": 2, "oracle": True,
     "zero": {"stage": 1, "overlap_comm": True, "reduce_bucket_size": 300}},
    {"name": "stage1_overlap_comm_allreduce", "gas": 2, "clip": 1e6,
     "zero": {"stage": 1, "overlap_comm": True, "contiguous_gradients": False, "reduce_scatter": False}},
    # bf16 model, fp32 accumulation: DeepSpeed reduces into its own flat fp32 partition, handed over as it is
    {"name": "bf16_fp32_accumulation", "gas": 2, "bf16": True, "config": {"data_types": {"grad_accum_dtype": "fp32"}},
     "zero": STAGE2},
    # an expert without tokens (test_overlap's case): the commit sets the zero-gradient block aside
    {"name": "idle_expert", "idle_expert": True, "zero": STAGE2},
    {"name": "mixtral_top1", "model": families.mixtral, "zero": STAGE2},  # test_overlap's real MoE
    {"name": "alternate", "alternate": True, "zero": STAGE2},  # test_overlap's: odd steps with overlap paused
]


def _refusals(rank: int) -> dict:
    """ZeRO stage 1 without ``overlap_comm`` (DeepSpeed reduces after backward) and stage 2 with CPU optimizer
    offload: ``overlap_backward`` true is a ConfigError (its message, by setting); "auto" builds no speculative step
    (its all-zero counters)."""
    from ds_muon.errors import ConfigError
    out = {}
    for name, zero in (("stage1", {"stage": 1, "overlap_comm": False}),
                       ("stage2_offload", {"stage": 2, "offload_optimizer": {"device": "cpu"}})):
        for setting in (True, "auto"):
            try:
                stats = _train(rank, {"zero": zero}, setting, steps=1).stats
                out.setdefault(name, {})[str(setting)] = stats
            except ConfigError as exc:
                out.setdefault(name, {})[str(setting)] = str(exc)
    return out


def _cases(rank: int, world_size: int, ckpt_root: str) -> dict:
    out = train_on_off(rank, world_size, CASES)
    out.update(resume_and_evaluation(rank, world_size, ckpt_root, STAGE2))
    out.update(_refusals(rank))
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_overlap_zero2_exact(world_size, tmp_path):
    results = run_distributed(_cases, world_size, str(tmp_path), timeout=900)
    r = results[0]
    # which path ran (ParityNet's `extra` layer has no gradient on odd steps: its param group falls back there)
    assert r["plain"]["off_stats"]["commits"] == 0
    assert r["bf16_momentum"]["momentum_dtypes"] == ["torch.bfloat16"], r["bf16_momentum"]
    for name in ("plain", "gas2", "clip_never", "overlap_comm_small_buckets", "contiguous_small_buckets", "bf16",
                 "bf16_momentum",
                 "bf16_fp32_accumulation", "stage1_overlap_comm", "stage1_overlap_comm_allreduce"):
        assert r[name]["stats"]["commits"] > 0 and r[name]["stats"]["fallback_clip"] == 0, (name, r[name])
    assert r["resume"]["stats"]["commits"] > 0 and r["eval_stats"]["commits"] > 0, (r["resume"], r["eval_stats"])
    every = r["clip_every_step"]["stats"]
    assert every["commits"] == 0 and every["fallback_clip"] > 0, every
    check_unscale_calls(r)  # DeepSpeed's unscale_and_clip_grads only where its factor may not be 1
    assert r["allreduce_clip"]["stats"]["fallback_clip"] > 0, r["allreduce_clip"]  # 0.5 clips the parity model
    assert r["idle_expert"]["stats"]["commits_idle_blocks"] >= 2, r["idle_expert"]
    mixtral = r["mixtral_top1"]["stats"]
    assert mixtral["commits_idle_blocks"] > 0 and mixtral["fallback_not_ready"] == 0, mixtral
    check_alternate(r)
    for name in ("plain", "gas2", "stage1_overlap_comm"):  # test_zero12_parity.py's fp32 tolerances
        check_oracle(r[name]["errors"])
    # every rank took the same path
    assert all(x[c["name"]]["stats"] == r[c["name"]]["stats"] for x in results for c in CASES)
    refused = r["stage1"]["True"]
    assert isinstance(refused, str) and "overlap_backward is true" in refused, refused
    assert "overlap_comm true" in refused, refused  # the message names the fix
    assert r["stage1"]["auto"]["commits"] == 0 and sum(r["stage1"]["auto"].values()) == 0, r["stage1"]
    refused = r["stage2_offload"]["True"]
    assert isinstance(refused, str) and "overlap_backward is true" in refused and "offload_optimizer" in refused
    assert sum(r["stage2_offload"]["auto"].values()) == 0, r["stage2_offload"]
