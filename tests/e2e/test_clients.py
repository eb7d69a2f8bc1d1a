"""Real clients kept green (CPU, 2 processes, a tiny Llama): Trainer, PEFT LoRA, Accelerate, TRL,
``engine.compile()``, gradient checkpointing, ``zero_to_fp32`` and Trainer resume at another world size.

The Hugging Face jobs run ``tests/support/hf_clients.py`` under ``torchrun`` as a user's script (through
``tests/support/exit_after.py``: no interpreter finalization after it returns, docs/troubleshooting.md); the
engine-level checks run in-process through ``tests/dist_util.run_distributed``. Reference for each:
the same job without the feature (gradient checkpointing and compile must not change a step), the
uninterrupted run (save/resume), the gathered master weights (zero_to_fp32). Tolerance: 1e-5 relative
of each parameter, the project's fp32 standard (tests/support/harness.py); resume at the same world size is
exact.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support import exit_after
from tests.support.spawn import run_distributed
from tests.support.harness import fp32_master_params
from tests.support.tools import REPO

pytest.importorskip("transformers", reason="needs the test extra: pip install -e '.[test]'")
pytest.importorskip("accelerate", reason="needs the test extra: pip install -e '.[test]'")

RTOL = 1e-5


def _job(mode: str, out: Path, nproc: int = 2, *extra: str) -> tuple[dict, dict, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(nproc), exit_after.PATH, str(REPO / "tests" / "support" / "hf_clients.py"), mode,
                           "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=900, env=env, cwd=out.parent)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    result = json.loads((out / "result.json").read_text())
    return result, torch.load(out / "params.pt"), log


def _assert_close(got: dict, want: dict, rtol: float = RTOL) -> None:
    assert sorted(got) == sorted(want)
    worst = max(((got[n] - want[n]).norm() / want[n].norm()).item() for n in want)
    assert worst <= rtol, worst


def _params_moved(a: dict, b: dict) -> bool:
    return all(not torch.equal(a[n], b[n]) for n in a)


# ------------------------------------------------------------------------------------------------
# Trainer: zero_to_fp32 on its checkpoint, resume at W=2 -> W=1 through to-universal
# ------------------------------------------------------------------------------------------------
def test_trainer_zero_to_fp32_and_resume_at_another_world_size(tmp_path) -> None:
    full, full_params, log = _job("trainer", tmp_path / "w2")  # W=2, 4 steps, checkpoints at 2 and 4
    assert full["optimizer"] == "MuonZeroOptimizer" and full["muon_step_count"] == 4
    assert "ds_muon parameter split (trainable parameters only)" in log  # log_level="info" shows it

    # zero_to_fp32 (the script Trainer copies into the checkpoint) reproduces the trained weights
    ckpt4 = tmp_path / "w2" / "checkpoint-4"
    subprocess.run([sys.executable, str(ckpt4 / "zero_to_fp32.py"), str(ckpt4), str(tmp_path / "fp32"),
                    "--safe_serialization"], check=True, capture_output=True, text=True, cwd=tmp_path)
    from safetensors.torch import load_file
    consolidated = {}
    for f in sorted((tmp_path / "fp32").glob("*.safetensors")):
        consolidated.update(load_file(f))
    assert set(full_params) <= set(consolidated)
    for n, p in full_params.items():
        assert torch.equal(consolidated[n].float(), p), n

    # W=2 checkpoint-2 -> universal -> Trainer resumes it at W=1 (same global batch of 4)
    uni = tmp_path / "uni2"
    conv = subprocess.run([sys.executable, "-m", "ds_muon.checkpoint", "to-universal",
                           str(tmp_path / "w2" / "checkpoint-2"), str(uni)],
                          capture_output=True, text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert conv.returncode == 0, conv.stderr
    carried = {p.name for p in uni.iterdir() if p.is_file()}
    assert {"trainer_state.json", "rng_state_0.pth", "rng_state_1.pth", "rng_state.pth"} <= carried, carried
    resumed, resumed_params, log = _job("trainer", tmp_path / "w1", 1, "--batch", "4", "--resume", str(uni),
                                        "--load-universal")
    assert "Resuming training from checkpoint with epoch 0 and global step 2" in log
    assert resumed["muon_step_count"] == 4  # 2 restored from the checkpoint + 2 trained
    for step in ("3", "4"):  # the same global batches at W=1 (batch 4) as at W=2 (2 x 2)
        assert abs(resumed["losses"][step] - full["losses"][step]) <= 1e-5 * abs(full["losses"][step])
    _assert_close(resumed_params, full_params)


# ------------------------------------------------------------------------------------------------
# PEFT LoRA under Trainer: the split counts the adapters, save/resume is exact
# ------------------------------------------------------------------------------------------------
def test_peft_lora_trainer_split_and_resume(tmp_path) -> None:
    pytest.importorskip("peft", reason="needs the test extra: pip install -e '.[test]'")
    full, full_params, log = _job("peft", tmp_path / "full")
    assert full["optimizer"] == "MuonZeroOptimizer" and full["muon_step_count"] == 4
    # only LoRA matrices are trainable; every one of them is a Muon matrix (2 layers x q,v x A,B)
    assert len(full["muon"]) == 8 and all(".lora_" in n for n in full["muon"])
    assert sorted(full_params) == full["muon"]
    split = log[log.index("ds_muon parameter split"):]
    counts = {line.split()[0]: int(line.split()[1]) for line in split.splitlines()[1:5]
              if line.strip().startswith(("Muon ", "AdamW ", "frozen "))}
    assert counts == {"Muon": 8, "AdamW": 0, "frozen": len(full["frozen"])}, split[:600]
    assert "requires_grad=False" in split
    resumed, resumed_params, _ = _job("peft", tmp_path / "resumed", 2, "--resume",
                                      str(tmp_path / "full" / "checkpoint-2"))
    assert resumed["muon_step_count"] == 4
    for step in ("3", "4"):
        assert resumed["losses"][step] == full["losses"][step]
    for n, p in full_params.items():
        assert torch.equal(resumed_params[n], p), n


# ------------------------------------------------------------------------------------------------
# Accelerate's native DeepSpeed path, TRL's SFTTrainer
# ------------------------------------------------------------------------------------------------
def test_trainer_adam_mini_matches_reference(tmp_path) -> None:
    """HF Trainer with ``"optimizer": {"type": "AdamMini"}`` at W=2 (3 steps, weight decay, Trainer's
    gradient clipping at 1.0) against ``ds_muon.AdamMini`` on the same batches (recorded by the job):
    per-rank mean loss, averaged over the ranks, raw-norm clip, one step. Tolerance: 1e-5 relative to
    each parameter and 1e-3 relative to its update (tests/support/harness.py); the result is also far from AdamW's."""
    import ds_muon
    from tests.support.harness import compare
    from tests.support.hf_clients import ADAM_MINI, tiny_llama
    result, params, _ = _job("trainer", tmp_path / "am", 2, "--steps", "3", "--save-steps", "100",
                             "--optimizer", "adam_mini")
    assert result["optimizer"] == "MuonZeroOptimizer" and result["adam_mini_sub_groups"] > 0, result
    batches = torch.load(tmp_path / "am" / "batches.pt")
    assert len(batches) == 2 and all(len(b) == 3 for b in batches)
    want = {}
    for kind in ("adam_mini", "adamw"):
        model = tiny_llama()
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        hp = dict(ADAM_MINI["params"], betas=tuple(ADAM_MINI["params"]["betas"]))
        opt = ds_muon.AdamMini(model, **hp) if kind == "adam_mini" else torch.optim.AdamW(model.parameters(), **hp)
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            for rank_batches in batches:
                x = rank_batches[step]
                (model(input_ids=x, labels=x).loss / len(batches)).backward()
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
            opt.step()
        want[kind] = compare(params, {n: p.detach() for n, p in model.named_parameters()}, init)
    for name, e in want["adam_mini"].items():
        assert e["moved"] > 0 and e["rel"] <= RTOL and e["rel_update"] <= 1e-3, (name, e)
    assert any(e["rel_update"] > 1e-2 for e in want["adamw"].values()), "Trainer's AdamMini run equals AdamW's"


def test_accelerate_dummy_optim_and_scheduler(tmp_path) -> None:
    result, params, _ = _job("accelerate", tmp_path / "acc", 2, "--steps", "3")
    assert result["optimizer"] == "MuonZeroOptimizer" and result["muon_step_count"] == 3
    assert len(result["losses"]) == 3 and all(map(lambda v: v == v, result["losses"].values()))
    # WarmupCosineLR scaled each group's own lr: Muon (0.02) and AdamW (3e-3) groups keep their ratio
    lrs = result["lrs"]
    assert len(set(round(lr, 12) for lr in lrs)) == 2
    assert abs(max(lrs) / min(lrs) - 0.02 / 3e-3) < 1e-6


def test_trl_sft_trainer(tmp_path) -> None:
    pytest.importorskip("trl", reason="needs the test extra: pip install -e '.[test]'")
    result, params, _ = _job("trl", tmp_path / "trl", 2, "--steps", "2")
    assert result["optimizer"] == "MuonZeroOptimizer" and result["muon_step_count"] == 2
    assert len(result["losses"]) == 2


# ------------------------------------------------------------------------------------------------
# engine.compile() and gradient checkpointing do not change a ds_muon step
# ------------------------------------------------------------------------------------------------
def _compile_and_checkpointing(rank: int, world_size: int) -> dict:
    import ds_muon
    from tests.support.harness import ds_config
    from tests.support.hf_clients import tiny_llama
    out = {}
    for mode in ("plain", "gradient_checkpointing", "compile"):
        model = tiny_llama()
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        if mode == "gradient_checkpointing":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        engine, _, _, _ = ds_muon.initialize(model=model, model_parameters=model.parameters(), config=ds_config())
        if mode == "compile":
            engine.compile(backend="eager")
        losses = []
        for step in range(2):
            x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(100 * step + rank))
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out[mode] = {"optimizer": type(engine.optimizer).__name__, "steps": engine.optimizer.muon_step_count,
                     "compiled": bool(getattr(engine, "is_compiled", False)), "losses": losses,
                     "params": fp32_master_params(model), "init": init}
    return out


def test_compile_and_gradient_checkpointing_match_plain() -> None:
    res = run_distributed(_compile_and_checkpointing, 2)[0]
    plain = res["plain"]
    assert _params_moved(plain["params"], plain["init"])
    assert res["compile"]["compiled"]
    for mode in ("gradient_checkpointing", "compile"):
        assert res[mode]["optimizer"] == "MuonZeroOptimizer" and res[mode]["steps"] == 2
        assert res[mode]["losses"] == pytest.approx(plain["losses"], rel=1e-6)
        _assert_close(res[mode]["params"], plain["params"])
