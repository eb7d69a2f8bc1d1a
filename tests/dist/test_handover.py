"""Installing ds_muon never breaks a Muon config that DeepSpeed's built-in runs (ZeRO stages 0-3).

The configs of tests/migration_configs/ (what users of the built-in bring), each at ZeRO stage 0, 1, 2 and 3,
in one W=2 process group (CPU, gloo), three ways:

* **zero-code** (``hooks.auto_enable()``, what the start-up hook does when ds_muon is installed): a mode ds_muon
  serves builds ds_muon's optimizer and trains; any other is handed to DeepSpeed's built-in, with exactly one
  rank-0 line (``HANDOVER_NOTICE``) naming why, and then behaves exactly as with ``DS_MUON=0``: the same
  optimizer class, or the same error. A config that neither can run (a partial offload ``ratio`` at stage 3)
  gets ds_muon's ConfigError naming the fix instead of DeepSpeed's assertion;
* **built-in** (ds_muon disabled, ``DS_MUON=0``): the reference for the hand-over;
* **explicit** (``ds_muon.initialize``): stage 0 is a ``ConfigError`` naming the served stages, before any
  engine exists.

So wherever the built-in trains a config, the zero-code path trains it too (asserted for every file and stage).
The fp16 files run in their own process group, skipped with the reason where the accelerator has no fp16 (this
repository's CPU machines may not: DeepSpeed refuses it there, with and without ds_muon).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from tests.support.precision import FP16_SKIP, fp16_supported, is_fp16_config
from tests.support.spawn import run_distributed

DIR = Path(__file__).resolve().parents[1] / "migration_configs"
# NVMe needs a swap folder and the async_io op (tests/dist/test_migration_corpus.py runs it); the Trainer file
# holds "auto" placeholders only Trainer fills.
FILES = sorted(p.name for p in DIR.glob("*.json") if p.name not in ("nvme_offload_onecycle.json",
                                                                    "hf_ds_config_zero3_muon.json"))
STAGES = (0, 1, 2, 3)
FP16_FILES = [name for name in FILES if is_fp16_config(json.loads((DIR / name).read_text()))]
DS_MUON_TYPES = ("MuonZeroOptimizer", "MuonZero12Optimizer")


def _config(name: str, stage: int) -> dict:
    cfg = json.loads((DIR / name).read_text())
    cfg.setdefault("zero_optimization", {})["stage"] = stage
    cfg["steps_per_print"] = 10_000
    return cfg


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _build(cfg: dict, explicit: bool = False) -> dict:
    """Build an engine from ``cfg`` (``deepspeed.initialize``, or ``ds_muon.initialize`` when ``explicit``), train
    two optimizer steps; the optimizer's class, or the error's type and first line."""
    import deepspeed

    import ds_muon
    from tests.support.models import ParityNet, batch, use_extra
    torch.manual_seed(0)
    model = ParityNet(conv=False)  # the built-in fails on 4-D weights at stage 3 in 0.19.8
    init = ds_muon.initialize if explicit else deepspeed.initialize
    try:
        engine, _, _, _ = init(model=model, model_parameters=model.parameters(), config=cfg)
    except Exception as err:  # noqa: BLE001 - the outcome is what is compared
        return {"error": f"{type(err).__name__}: {str(err)[:600]}"}
    out = {"optimizer": type(engine.optimizer).__name__}
    try:
        gas, mbs = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
        losses = []
        for step in range(2 * gas):
            tokens, targets = (t.to(engine.device) for t in batch(step, engine.global_rank, 0, mbs))
            loss = engine(tokens, targets, use_extra(step))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        out["finite"] = all(map(lambda x: x == x and abs(x) != float("inf"), losses))
    except Exception as err:  # noqa: BLE001
        out["error"] = f"{type(err).__name__}: {str(err)[:600]}"
    engine.destroy()
    return out


def worker(rank: int, world_size: int, cases: list[tuple[str, int]]) -> dict:
    from deepspeed.utils import logger

    from ds_muon.integration import hooks
    lines = _Lines()
    logger.addHandler(lines)
    out = {}
    for name, stage in cases:
        cfg = _config(name, stage)
        hooks.auto_enable()  # what ds_muon's start-up hook does (DS_MUON unset)
        before = len(lines.lines)
        auto = _build(cfg)
        auto["notices"] = [line for line in lines.lines[before:] if "runs DeepSpeed's built-in Muon" in line]
        hooks.disable()
        hooks._auto = False
        entry = {"auto": auto}
        if auto.get("optimizer") not in DS_MUON_TYPES:  # handed over (or refused): what DS_MUON=0 does
            entry["builtin"] = _build(cfg)
        if stage == 0:
            entry["explicit"] = _build(cfg, explicit=True)
        out[f"{name}@{stage}"] = entry
    logger.removeHandler(lines)
    return out


def test_zero_code_path_hands_unserved_modes_to_the_builtin() -> None:
    cases = [(name, stage) for name in FILES if name not in FP16_FILES for stage in STAGES]
    served = _check(run_distributed(worker, 2, cases, timeout=1500))
    assert served == {1, 2, 3}, served


@pytest.mark.skipif(not fp16_supported(), reason=FP16_SKIP)
def test_zero_code_path_fp16_configs() -> None:
    """The fp16 files, at every stage, checked as above (their own process group)."""
    assert FP16_FILES
    _check(run_distributed(worker, 2, [(name, stage) for name in FP16_FILES for stage in STAGES], timeout=900))


def _check(results: list[dict]) -> set[int]:
    """The assertions of the hand-over per file and stage; returns the stages at which ds_muon served a file."""
    served_somewhere = set()
    for key, entry in results[0].items():
        name, stage = key.rsplit("@", 1)
        stage = int(stage)
        auto, builtin = entry["auto"], entry.get("builtin")
        if auto.get("optimizer") in DS_MUON_TYPES:
            served_somewhere.add(stage)
            assert "error" not in auto and auto["finite"], (key, auto)
            assert not auto["notices"], (key, auto["notices"])
            assert auto["optimizer"] == ("MuonZeroOptimizer" if stage == 3 else "MuonZero12Optimizer"), (key, auto)
        elif auto.get("error", "").startswith("ConfigError") and not auto["notices"]:
            # refused by ds_muon with a message naming the fix: only where the built-in cannot run it either
            assert "error" in builtin, f"{key}: ds_muon refuses what the built-in runs: {auto['error']}"
        else:
            # handed over (or refused by DeepSpeed's own config checks first): exactly as DS_MUON=0; one line
            # saying so and why whenever an engine was built
            assert {k: v for k, v in auto.items() if k != "notices"} == builtin, (key, auto, builtin)
            assert len(auto["notices"]) == 1 if "optimizer" in auto else len(auto["notices"]) <= 1, (key, auto)
        if builtin is not None and "error" not in builtin:
            assert "error" not in auto, f"{key}: the built-in trains it but the zero-code path fails: {auto}"
        if stage == 0:
            assert auto.get("optimizer") not in DS_MUON_TYPES, key
            assert all("zero_optimization.stage" in line for line in auto["notices"]), (key, auto["notices"])
            explicit = entry["explicit"]
            assert explicit.get("error", "").startswith("ConfigError") and "zero_optimization.stage" in \
                explicit["error"], (key, explicit)
    for rank_result in results[1:]:  # rank 1 logs nothing
        assert all(not e["auto"]["notices"] for e in rank_result.values())
    return served_somewhere
