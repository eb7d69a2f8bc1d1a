"""Checkpoints at ZeRO stages 1 and 2 (``MuonZero12Optimizer``), and across stages.

* Same world size (W=2; stage 1 and 2, without and with CPU optimizer offload): N continuous steps vs. N/2 steps,
  save, a fresh process group, load, N/2 steps; compared on every rank bit for bit (``torch.equal``): the full
  fp32 weights and every optimizer state tensor (Muon momentum, Adam moments), right after loading and after the
  resumed steps, and the step counts. AdamW betas (0.5, 0.75), exact in fp32 (tests/dist/test_checkpoint.py's
  docstring says why).
* Another world size and stage: a W=2 stage-2 checkpoint (and a W=2 stage-3 one) after N/2 steps on the shared
  6-row batch, ``python -m ds_muon.checkpoint to-universal``, then ``"load_universal": true`` at stage 2 W=3,
  stage 1 W=1, stage 3 W=3 (from stage 2) and stage 2 W=3 (from stage 3), N/2 more steps; the stage-2 W=3 load
  with ``parameter_alignment`` (gaps between the parameters of a flat partition). Right after loading the
  full state equals the saved one bit for bit; the final parameters match the single-device oracle trained N
  steps (``PARITY_RTOL`` = 1e-5 of each parameter, 1e-3 of its update).
* Loads that do not fit fail on every rank with ``CheckpointError`` naming the fix: another world size (the
  conversion command), another stage at the same world size (the conversion command), a parameter Muon <-> AdamW.
* ``zero_to_fp32`` (DeepSpeed's own script) on a stage-2 checkpoint gives the saved fp32 weights exactly.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.support.harness import assert_same_state, resume_phase, state_snapshot, train_steps, PARITY_RTOL, build_engine, clone_tags, compare, ds_config, gathered_params, \
    reference_model, train_reference
from tests.support.models import GLOBAL_BATCH, ParityNet, batch, shared_batch, use_extra
from tests.support.spawn import run_distributed
from tests.support.tools import REPO

STEPS, HALF, TAG = 4, 2, "half"
EXACT_BETAS = [0.5, 0.75]
SAME_W = {"stage1": {"stage": 1}, "stage2": {"stage": 2},
          "stage1_cpu": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
          "stage2_cpu": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}


_train_range = train_steps  # the steps a resumed run trains (tests/support/harness.py)


def _config(zero: dict, gas: int = 2, micro_batch: int = 2, universal: bool = False) -> dict:
    cfg = ds_config(gas=gas, clip=0.5, micro_batch=micro_batch, **zero)
    cfg["optimizer"]["params"]["betas"] = list(EXACT_BETAS)
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def resume_worker(rank: int, world_size: int, mode: str, root: str) -> dict:
    out = {}
    for run, zero in SAME_W.items():
        engine, _ = build_engine(_config(zero))
        assert type(engine.optimizer).__name__ == "MuonZero12Optimizer"
        ckpt = os.path.join(root, run)
        out[run] = resume_phase(engine, rank, mode, ckpt, TAG, HALF, STEPS, 2, state_snapshot)
        engine.destroy()
    return out


def test_same_world_size_resume_is_bit_exact(tmp_path) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    W = 2
    continuous = run_distributed(resume_worker, W, "continuous", str(tmp_path))
    saved = run_distributed(resume_worker, W, "save", str(tmp_path))
    resumed = run_distributed(resume_worker, W, "load", str(tmp_path))
    for rank in range(W):
        for run in SAME_W:
            loaded, final = resumed[rank][run]
            assert saved[rank][run]["muon_steps"] == HALF and set(saved[rank][run]["steps"].values()) == {HALF}
            assert_same_state(loaded, saved[rank][run], f"rank {rank} {run}, right after loading:")
            assert any(key == "momentum_buffer" for _, key in final["tensors"])
            assert_same_state(final, continuous[rank][run], f"rank {rank} {run}, resumed vs. continuous:")
    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "stage2"), tag=TAG)
    for (name, key), want in saved[0]["stage2"]["tensors"].items():
        if key == "fp32":
            assert torch.equal(fp32[name].float(), want), f"zero_to_fp32 on the stage-2 checkpoint: {name}"


# ---- another world size and stage ---------------------------------------------------------------
def _cross_config(world_size: int, stage: int, universal: bool = False, aligned: bool = False) -> dict:
    zero = {"stage": stage, **({"parameter_alignment": True} if aligned else {})}
    return _config(zero, gas=1, micro_batch=GLOBAL_BATCH // world_size, universal=universal)


def save_worker(rank: int, world_size: int, ckpt_dir: str, stage: int) -> dict | None:
    engine, model = build_engine(_cross_config(world_size, stage))
    init, tags = gathered_params(model), clone_tags(model)
    _train_range(engine, rank, 0, HALF, 1, shared_batch, GLOBAL_BATCH // world_size)
    engine.save_checkpoint(ckpt_dir, tag=TAG)
    snap = _full_state(engine)
    engine.destroy()
    return {"init": init, "tags": tags, "saved": snap} if rank == 0 else None


def _full_state(engine) -> dict:
    """Full fp32 weights and optimizer state per parameter at any stage (stage 3 gathers). Collective."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    out = {}
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            out[(name, "fp32")] = safe_get_full_fp32_param(p).clone()
            for key in (("momentum_buffer",) if p.use_muon else ("exp_avg", "exp_avg_sq")):
                out[(name, key)] = safe_get_full_optimizer_state(p, key).clone()
    return out


def universal_worker(rank: int, world_size: int, universal_dir: str, stage: int, plain_dir: str,
                     aligned: bool) -> dict | None:
    """Load the universal checkpoint at this W and stage, N/2 steps; then loading the plain one fails naming
    the conversion. ``aligned``: ZeRO-1/2's ``parameter_alignment`` (gaps between the parameters of a flat
    partition, which the loader must leave)."""
    from ds_muon.checkpoint import CheckpointError
    engine, model = build_engine(_cross_config(world_size, stage, universal=True, aligned=aligned))
    gaps = stage < 3 and any(any(p) for p in engine.optimizer.round_robin_bit16_padding)
    engine.load_checkpoint(universal_dir)
    loaded = _full_state(engine)
    step_count = engine.optimizer.step_count
    _train_range(engine, rank, HALF, STEPS, 1, shared_batch, GLOBAL_BATCH // world_size)
    final = gathered_params(model)
    engine.destroy()
    engine, _ = build_engine(_cross_config(world_size, stage))
    error = None
    try:
        engine.load_checkpoint(plain_dir, tag=TAG)
    except CheckpointError as err:
        error = str(err)
    engine.destroy()
    return ({"loaded": loaded, "final": final, "step_count": step_count, "error": error, "gaps": gaps}
            if rank == 0 else None)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """W=2 checkpoints after N/2 steps at stage 2 and stage 3, each converted with the command line."""
    root = tmp_path_factory.mktemp("ckpt12")
    runs = {}
    for stage in (2, 3):
        plain, universal = str(root / f"s{stage}"), str(root / f"s{stage}_universal")
        runs[stage] = dict(run_distributed(save_worker, 2, plain, stage)[0], plain=plain, universal=universal)
        proc = subprocess.run([sys.executable, "-m", "ds_muon.checkpoint", "to-universal", plain, universal],
                              cwd=str(REPO), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return runs


def _oracle(run: dict) -> dict:
    import ds_muon
    cfg = _cross_config(1, 2)
    model = reference_model(run["init"], run["tags"], ParityNet)
    opt = ds_muon.MuonAdamW(model.parameters(), **cfg["optimizer"]["params"])
    train_reference(model, opt, STEPS, 1, 1, cfg["gradient_clipping"], micro_batch=GLOBAL_BATCH, data=shared_batch)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("source,w_to,stage_to,aligned", [(2, 3, 2, True), (2, 1, 1, False), (2, 3, 3, False),
                                                          (3, 3, 2, False)])
def test_universal_across_world_sizes_and_stages(saved, source, w_to, stage_to, aligned) -> None:
    src = saved[source]
    res = run_distributed(universal_worker, w_to, src["universal"], stage_to, src["plain"], aligned)[0]
    assert res["gaps"] is aligned  # parameter_alignment: padding between the parameters of a partition
    assert res["loaded"].keys() == src["saved"].keys()
    for key, want in src["saved"].items():
        assert torch.equal(res["loaded"][key], want), f"stage {source} W=2 -> stage {stage_to} W={w_to}: {key}"
    assert res["step_count"] == HALF
    for name, err in compare(res["final"], _oracle(src), src["init"]).items():
        if name.startswith("frozen"):
            continue
        assert err["rel"] <= PARITY_RTOL, f"{name}: rel error {err['rel']:.2e}"
        assert err["moved"] > 0 and err["rel_update"] <= 1e-3, f"{name}: update rel error {err['rel_update']:.2e}"
    # the plain checkpoint at this world size / stage: refused naming the conversion (the stage first, then W)
    why = "was saved at ZeRO stage" if (source == 3) != (stage_to == 3) else "world size 2"
    assert res["error"] and "to-universal" in res["error"] and why in res["error"], res["error"]


def wrong_load_worker(rank: int, world_size: int, stage2_dir: str) -> dict:
    """At W=2: the stage-2 checkpoint into stage 3 (same W), and into stage 2 with o.weight on AdamW."""
    from ds_muon.checkpoint import CheckpointError
    out = {}
    for label, stage, before in (("stage3", 3, None), ("o_on_adamw", 2, _o_on_adamw)):
        engine, _ = build_engine(_cross_config(world_size, stage), before=before)
        try:
            engine.load_checkpoint(stage2_dir, tag=TAG)
            out[label] = None
        except CheckpointError as err:
            out[label] = str(err)
        engine.destroy()
    return out


def _o_on_adamw(model) -> None:
    model.o.weight.use_muon = False


def test_loads_that_do_not_fit_fail_on_every_rank(saved) -> None:
    results = run_distributed(wrong_load_worker, 2, saved[2]["plain"])
    for r in results:
        assert r["stage3"] and "was saved at ZeRO stage 1/2, this run is at ZeRO stage 3" in r["stage3"] \
            and "to-universal" in r["stage3"], r["stage3"]
        assert r["o_on_adamw"] and "parameter 'o.weight': Muon in the checkpoint, AdamW in the model" in \
            r["o_on_adamw"], r["o_on_adamw"]
