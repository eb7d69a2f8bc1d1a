"""Same-world-size resume: N continuous steps vs. N/2 steps, save, a fresh process group, load, N/2.

Compared on every rank: the fp32 master partitions, every optimizer state tensor (Muon momentum,
Adam moments) and the Adam step counters. State right after loading is bit-identical to the saved
state; after further steps the runs agree to 1 ulp, not bit for bit, on this CPU build: DeepSpeed's
CPU Adam kernel (``csrc/includes/cpu_adam.h``, used by FusedAdam on the CPU accelerator and by
DeepSpeedCPUAdam) keeps ``beta^t`` as a running product in a continuous run but recomputes it with
``std::pow`` in a fresh process, so the AdamW bias correction differs in the last bit. (Given
identical parameters, gradients, moments, step, lr and weight decay, the kernel's outputs differ; the
Muon sub-groups themselves stay exact until the AdamW difference reaches them through the forward.)
"""
from __future__ import annotations

import pytest
import torch

from tests.dist_util import run_distributed
from tests.harness import build_engine, ds_config

STEPS = 4


def _snapshot(engine) -> dict:
    """Full (gathered, padding-free) fp32 weights and optimizer state per parameter. Collective."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    out = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        out[(name, "fp32")] = safe_get_full_fp32_param(p).clone()
        for key in (("momentum_buffer",) if p.use_muon else ("exp_avg", "exp_avg_sq")):
            out[(name, key)] = safe_get_full_optimizer_state(p, key).clone()
    steps = {k: v for s in engine.optimizer.optimizer.state.values() for k, v in s.items() if k == "step"}
    return {"tensors": out, "steps": steps}


def _train_range(engine, rank: int, start: int, stop: int, gas: int) -> None:
    """Optimizer steps ``start..stop-1`` on the same data the continuous run sees at those steps."""
    from tests.models import batch, use_extra
    for step in range(start, stop):
        for micro in range(gas):
            tokens, targets = (t.to(engine.device) for t in batch(step, rank, micro))
            engine.backward(engine(tokens, targets, use_extra(step)))
            engine.step()


def resume_worker(rank: int, world_size: int, mode: str, ckpt_dir: str, cfg: dict) -> dict | None:
    engine, _ = build_engine(cfg)
    gas = cfg["gradient_accumulation_steps"]
    if mode == "continuous":
        _train_range(engine, rank, 0, STEPS, gas)
        return _snapshot(engine)
    if mode == "save":
        _train_range(engine, rank, 0, STEPS // 2, gas)
        engine.save_checkpoint(ckpt_dir, tag="half")
        return _snapshot(engine)
    engine.load_checkpoint(ckpt_dir, tag="half")
    loaded = _snapshot(engine)
    _train_range(engine, rank, STEPS // 2, STEPS, gas)
    return loaded, _snapshot(engine)


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_same_world_size_resume_matches_continuous(tmp_path, offload: str) -> None:
    zero = {} if offload == "none" else {"offload_optimizer": {"device": "cpu"}}
    cfg = ds_config(gas=2, clip=0.5, **zero)
    W = 2
    continuous = run_distributed(resume_worker, W, "continuous", str(tmp_path), cfg)
    saved = run_distributed(resume_worker, W, "save", str(tmp_path), cfg)
    loaded_and_resumed = run_distributed(resume_worker, W, "load", str(tmp_path), cfg)
    for rank in range(W):
        loaded, b = loaded_and_resumed[rank]
        assert loaded["steps"] == saved[rank]["steps"] == {"step": STEPS // 2}
        for k, x in saved[rank]["tensors"].items():  # the load itself is bit-exact
            assert torch.equal(loaded["tensors"][k], x), f"rank {rank} {k}: loaded state differs from saved"
        a = continuous[rank]
        assert a["tensors"].keys() == b["tensors"].keys() and a["steps"] == b["steps"] == {"step": STEPS}
        assert any(key == "momentum_buffer" for _, key in a["tensors"]), "no Muon momentum in the optimizer state"
        for k, x in a["tensors"].items():
            torch.testing.assert_close(b["tensors"][k], x, rtol=1e-6, atol=1e-7, msg=lambda m: f"rank {rank} {k}: {m}")
