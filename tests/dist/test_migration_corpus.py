"""The migration corpus: DeepSpeed configs a user of the built-in Muon would bring (tests/migration_configs/).

Each file either trains for two optimizer steps at parity with the oracle, or fails with an error naming
the fix (:data:`CORPUS` says which, per file; a file without an entry fails the test). Parity configs run
in one W=2 process group (CPU, gloo): ParityNet, the config's micro batch,
accumulation, clipping and precision, and the oracle ``ds_muon.MuonAdamW`` on the same data with the
config's scheduler driving its lrs (``harness.oracle_schedule``). Tolerances: fp32 harness.PARITY_RTOL
(1e-5) of each parameter and 1e-3 of its update; bf16/fp16 models (fp32 master weights) 1e-2 of each
parameter and 5e-2 of a Muon parameter's update, and 0.5 of an AdamW parameter's update (Adam turns the
half-precision noise of near-zero gradients into full-size steps), as in test_zero3_parity.
The Hugging Face ``ds_config_zero3.json`` (with ``"auto"`` fields) runs through ``Trainer`` in the same
process group: it must train three steps with ds_muon (its "auto" WarmupLR reaches the lr at the third),
with AdamW's lr at ``adam_lr / lr`` of Muon's at every step. The NVMe file trains in the same group at the fp32
tolerances (as tests/dist/test_offload.py's NVMe cases); DeepSpeed's async_io op is loaded (JIT-built if needed) once in
the parent first, so its build does not count against the group's deadline. Its run once hung: a killed async_io
build had left ``<TORCH_EXTENSIONS_DIR>/async_io/lock`` behind, which torch's loader waits for without a deadline;
ds_muon now refuses such a stale lock with an error naming it (:func:`test_stale_async_io_build_lock_is_refused`).
Error configs go through ``ds_muon.initialize``, which raises before any process group is needed.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch

from tests.support.spawn import run_distributed
from tests.support.harness import (PARITY_RTOL, build_engine, clone_tags, compare, fp32_master_params, gathered_params,
                           oracle_schedule, reference_model, swap_dir_for, train_engine, train_reference)
from tests.support.models import ParityNet
from tests.support.precision import FP16_SKIP, fp16_supported, is_fp16_config

DIR = Path(__file__).resolve().parents[1] / "migration_configs"
STEPS = 2
TRAINER_STEPS = 3  # Trainer's "auto" WarmupLR starts at 0 (warmup_min_lr) and reaches lr at the third step
HALF = dict(rtol=1e-2, rtol_update=5e-2, adamw_rtol_update=0.5)

# file -> what it must do. "error": a regex the ConfigError must match (it names the fix);
# "scaled": the config's scheduler writes one lr into every group (None: no scheduler).
CORPUS: dict[str, dict] = {
    "builtin_keys_bf16_states.json": {"error": r"fp32_optimizer_states: False is invalid: ds_muon keeps the Adam "
                                               r"moments in fp32.*allowed: true"},
    "partial_offload.json": {"error": r"offload_optimizer\.ratio: 0\.3 is invalid: DeepSpeed \S+'s ZeRO-3 partial "
                                      r"optimizer offload runs only with DeepSpeedCPUAdam.*remove ratio"},
    "super_offload.json": {"error": r"super_offload: true is invalid: DeepSpeed \S+'s SuperOffload.*remove "
                                    r"super_offload"},
    "builtin_blog_zero3.json": {"scaled": None},
    "builtin_tutorial_zero2.json": {"scaled": None},  # ZeRO stage 2: MuonZero12Optimizer
    "builtin_keys_torch_adam.json": {"scaled": None, "adamw": "AdamW"},
    "bf16_warmuplr_gas_clip_actckpt.json": {"scaled": True, "checkpoint_up": True, **HALF},
    "fp16_warmupdecay.json": {"scaled": True, **HALF},
    "cpu_offload_cosine_gas.json": {"scaled": False},
    "nvme_offload_onecycle.json": {"scaled": True},
    "zero_init_lrrange_save16bit.json": {"scaled": True, "zero_init": True, "save16": True},
    "hf_ds_config_zero3_muon.json": {"trainer": True},
}
PARITY = [f for f, e in CORPUS.items() if "error" not in e and not e.get("trainer")]


def _load(name: str) -> dict:
    with open(DIR / name) as f:
        return json.load(f)


def test_every_corpus_file_has_an_expectation():
    assert sorted(p.name for p in DIR.glob("*.json")) == sorted(CORPUS)


@pytest.mark.parametrize("name", [f for f, e in CORPUS.items() if "error" in e])
def test_refused_configs_name_the_fix(name):
    import ds_muon
    from ds_muon.config import ConfigError
    model = ParityNet()
    with pytest.raises(ConfigError, match=CORPUS[name]["error"]):
        ds_muon.initialize(model=model, model_parameters=model.parameters(), config=_load(name))


def test_stale_async_io_build_lock_is_refused(tmp_path, monkeypatch):
    """A killed JIT build of DeepSpeed's async_io op leaves ``<TORCH_EXTENSIONS_DIR>/async_io/lock``, and
    ``deepspeed.initialize`` with NVMe offload then waits for it forever (torch's FileBaton): refused with
    the lock's path when no process builds there. A lock with a live builder (a process working in the build
    directory, as ninja does) is a build in progress and passes, however old; so does a lock younger than
    ``LOCK_GRACE_S``."""
    import subprocess
    import time

    from deepspeed.git_version_info import installed_ops

    from ds_muon.config import ConfigError
    from ds_muon.integration.jit_ops import LOCK_GRACE_S
    from ds_muon.integration.validation import validate as validate_ds_config
    monkeypatch.setitem(installed_ops, "async_io", False)  # JIT-built, as on the CPU test machines
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    cfg = _load("nvme_offload_onecycle.json")
    cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = swap_dir_for(str(tmp_path / "nvme"))
    os.makedirs(cfg["zero_optimization"]["offload_optimizer"]["nvme_path"], exist_ok=True)
    assert validate_ds_config(cfg) is not None  # no lock
    lock = tmp_path / "ext" / "async_io" / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    assert validate_ds_config(cfg) is not None  # just taken: a build starting
    old = time.time() - LOCK_GRACE_S - 60
    os.utime(lock, (old, old))
    builder = subprocess.Popen(["sleep", "60"], cwd=lock.parent)  # stands for ninja in the build directory
    try:
        assert validate_ds_config(cfg) is not None  # an old lock with a live builder: a slow build
    finally:
        builder.kill()
        builder.wait()
    with pytest.raises(ConfigError, match=r"offload_optimizer\.device: 'nvme' needs DeepSpeed's async_io op, whose "
                                          r"JIT build lock \S+async_io/lock exists although no process is building "
                                          r"in \S+.*waits for it forever\. Run `python -m ds_muon.integration.jit_ops`"):
        validate_ds_config(cfg)


def test_hf_config_outside_trainer_names_the_auto_placeholder():
    import ds_muon
    from ds_muon.config import ConfigError
    model = ParityNet()
    with pytest.raises(ConfigError, match=r"optimizer\.params\.lr: 'auto' is invalid.*'auto' is a placeholder the "
                                          r"Hugging Face DeepSpeed integration fills in"):
        ds_muon.initialize(model=model, model_parameters=model.parameters(), config=_load("hf_ds_config_zero3_muon.json"))


def _checkpointed_up(model) -> None:
    """Activation checkpointing as Hugging Face models do it (torch.utils.checkpoint, non-reentrant)."""
    forward = model.up.forward
    model.up.forward = lambda x: torch.utils.checkpoint.checkpoint(forward, x, use_reentrant=False)


def _parity_case(rank: int, world_size: int, name: str, tmp: str) -> dict:
    import ds_muon
    cfg, exp = _load(name), CORPUS[name]
    zero = cfg["zero_optimization"]
    if zero.get("offload_optimizer", {}).get("device") == "nvme":
        zero["offload_optimizer"]["nvme_path"] = swap_dir_for(os.path.join(tmp, "nvme"))
        os.makedirs(zero["offload_optimizer"]["nvme_path"], exist_ok=True)
    model_fn = ParityNet
    engine, model = build_engine(cfg, zero_init=exp.get("zero_init", False), model_fn=model_fn,
                                 before=_checkpointed_up if exp.get("checkpoint_up") else None)
    init, tags = gathered_params(model), clone_tags(model)
    gas, mbs = cfg.get("gradient_accumulation_steps", 1), cfg["train_micro_batch_size_per_gpu"]
    clip = cfg.get("gradient_clipping", 1.0)  # DeepSpeed's default (GRADIENT_CLIPPING_DEFAULT) when absent
    half = cfg.get("bf16", {}).get("enabled") or cfg.get("fp16", {}).get("enabled")
    res = {"adamw": type(engine.optimizer.optimizer.adamw).__name__, "muon_steps": None}
    train_engine(engine, STEPS, rank, gas, micro_batch=mbs)
    res["muon_steps"] = engine.optimizer.muon_step_count
    got = fp32_master_params(model) if half else gathered_params(model)
    if exp.get("save16"):
        engine.save_16bit_model(os.path.join(tmp, "save16"))
        live = gathered_params(model)
    engine.destroy()
    if rank != 0:
        return res
    if exp.get("save16"):
        saved = torch.load(os.path.join(tmp, "save16", "pytorch_model.bin"), map_location="cpu")
        # every parameter (a tied head is saved under both names), bit for bit
        res["save16_exact"] = set(live) <= set(saved) and all(torch.equal(saved[n].float(), live[n]) for n in live)
    ref = reference_model(init, tags, model_fn)
    params = cfg["optimizer"]["params"]
    opt = ds_muon.MuonAdamW(ref.parameters(), **params)
    before_step = None
    if "scheduler" in cfg:
        muon_lr = params.get("muon_lr", params["lr"])
        schedule = oracle_schedule(cfg["scheduler"], [g["lr"] for g in opt.param_groups], muon_lr, STEPS,
                                   exp["scaled"])

        def before_step(step: int) -> None:
            for g, lr in zip(opt.param_groups, schedule[step]):
                g["lr"] = lr

    train_reference(ref, opt, STEPS, world_size, gas, clip, micro_batch=mbs, before_step=before_step)
    res["errors"] = compare(got, {n: p.detach().clone() for n, p in ref.named_parameters()}, init)
    res["tags"] = tags
    return res


def _trainer_case(rank: int, world_size: int, name: str, tmp: str) -> dict:
    """Hugging Face Trainer fills the "auto" fields and calls deepspeed.initialize; ds_muon.enable() serves it."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    import ds_muon
    from examples.hf_trainer import CountingTokens

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    lrs = []
    with ds_muon.enable_scope():
        args = TrainingArguments(output_dir=tmp, per_device_train_batch_size=2, learning_rate=0.02,
                                 max_steps=TRAINER_STEPS, warmup_steps=2, weight_decay=0.01, logging_steps=1, deepspeed=_load(name),
                                 use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=CountingTokens(n=16, seq=16))

        class StepLrs(TrainerCallback):  # every param group's (use_muon, lr) before each step
            def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
                lrs.append([(g["use_muon"], g["lr"]) for g in optimizer.param_groups])

        trainer.add_callback(StepLrs())
        trainer.train()
        opt = trainer.deepspeed.optimizer
        res = {"optimizer": type(opt).__name__, "muon_steps": opt.muon_step_count, "lrs": lrs,
               "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}
        trainer.deepspeed.destroy()
    return res


def _worker(rank: int, world_size: int, fp16: bool) -> dict:
    import shutil

    import torch.distributed as dist
    out = {}
    root = os.path.join(tempfile.gettempdir(), f"ds_muon_corpus_{os.getppid()}")  # the same on every rank
    for name in PARITY + ["hf_ds_config_zero3_muon.json"]:
        if is_fp16_config(_load(name)) and not fp16:
            continue
        tmp = os.path.join(root, name[:-5])
        os.makedirs(tmp, exist_ok=True)
        run = _trainer_case if CORPUS[name].get("trainer") else _parity_case
        out[name] = run(rank, world_size, name, tmp)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return out


@pytest.fixture(scope="module")
def results():
    import threading

    from deepspeed.ops.op_builder import AsyncIOBuilder

    from ds_muon.integration.probes import _async_io_build_lock_problem
    problem = _async_io_build_lock_problem()
    assert problem is None, problem
    # a JIT build of async_io happens here once, not inside the group's deadline (scripts/test.sh builds it before
    # pytest); bounded, as a lock whose builder is still alive would make the loader wait
    loader = threading.Thread(target=AsyncIOBuilder().load, kwargs={"verbose": False}, daemon=True)
    loader.start()
    loader.join(timeout=1200)
    assert not loader.is_alive(), "DeepSpeed's async_io op did not load in 20 min (a stale JIT build lock?)"
    return run_distributed(_worker, 2, fp16_supported())


@pytest.mark.parametrize("name", PARITY)
def test_config_trains_at_parity(results, name):
    if is_fp16_config(_load(name)) and not fp16_supported():
        pytest.skip(FP16_SKIP)
    exp, res = CORPUS[name], results[0][name]
    assert results[1][name]["muon_steps"] == res["muon_steps"] == STEPS
    if "adamw" in exp:
        assert res["adamw"] == exp["adamw"]
    if exp.get("save16"):
        assert res["save16_exact"], "engine.save_16bit_model did not write the trained weights"
    rtol, rtol_update = exp.get("rtol", PARITY_RTOL), exp.get("rtol_update", 1e-3)
    for pname, err in res["errors"].items():
        if not res["tags"][pname] and "adamw_rtol_update" in exp:
            assert err["rel_update"] <= exp["adamw_rtol_update"], f"{name}: {pname} {err['rel_update']:.2e}"
            continue
        assert err["rel"] <= rtol, f"{name}: {pname} rel error {err['rel']:.2e}"
        if err["moved"] > 0:
            assert err["rel_update"] <= rtol_update, f"{name}: {pname} update rel error {err['rel_update']:.2e}"


def test_hf_zero3_config_through_trainer(results):
    res = results[0]["hf_ds_config_zero3_muon.json"]
    assert res["optimizer"] == "MuonZeroOptimizer" and res["muon_steps"] == TRAINER_STEPS
    assert len(res["losses"]) == TRAINER_STEPS and all(l == l and l > 0 for l in res["losses"])
    assert [lr for m, lr in res["lrs"][-1] if m][0] == pytest.approx(0.02)  # warmed up to learning_rate
    for step in res["lrs"]:  # Trainer's "auto" WarmupLR writes one lr: AdamW keeps adam_lr / lr of it
        muon = [lr for m, lr in step if m]
        adam = [lr for m, lr in step if not m]
        assert muon and adam
        assert all(a == pytest.approx(muon[0] * 3e-3 / 0.02, rel=1e-12) for a in adam), step
