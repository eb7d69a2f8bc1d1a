"""No code runs from a checkpoint that a ds_muon engine or ``python -m ds_muon.checkpoint`` reads.

Real checkpoints (W=2, ZeRO-3 Muon and Adam-mini, and ZeRO-2 Muon; their universal conversions) are copied, and in
each copy one file of one kind gets a crafted entry that pickles as ``os.system("touch <marker>")``: the model
states, another rank's optimizer states, the universal header ``zero/optimizer_state.pt``, a parameter's
``zero/<name>/fp32.pt`` and Adam-mini's ``block_exp_avg_sq.pt``. ``engine.load_checkpoint`` (per-rank files,
universal with ``load_universal``, and ZeRO-2's weights-only load) and ``to-universal`` must refuse each with a
``CheckpointError`` naming the crafted file, on every rank, and no marker may ever appear. The clean checkpoints
load. Control: with ``DS_MUON_TRUST_CHECKPOINT=1`` the crafted model states do run their payload (the file is
one DeepSpeed really reads), so a loader that executed pickles would fail this test.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

import torch

from tests.support.harness import build_engine, ds_config, train_engine
from tests.support.spawn import run_distributed
from tests.support.tools import REPO

TAG = "t"
TRUST_ENV = "DS_MUON_TRUST_CHECKPOINT"


def _configs() -> dict:
    adam_mini = {"type": "AdamMini", "params": {"lr": 1e-3}}
    return {"muon3": ds_config(), "adam_mini3": ds_config(optimizer=adam_mini),
            "muon2": dict(ds_config(), zero_optimization={"stage": 2})}


class Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _craft(src_dir: str, dst_dir: str, pattern: str, marker: str) -> str:
    """Copy ``src_dir`` to ``dst_dir`` and add a payload to the first file matching ``pattern``; its path."""
    shutil.copytree(src_dir, dst_dir)
    path = sorted(glob.glob(os.path.join(dst_dir, pattern), recursive=True))[0]
    state = torch.load(path, map_location="cpu", weights_only=False)  # our own clean file
    state["payload"] = Payload(marker)
    torch.save(state, path)
    return path


def _worker(rank: int, world_size: int, root: str) -> dict:
    from ds_muon.checkpoint import convert_to_universal
    from ds_muon.errors import CheckpointError
    marker = os.path.join(root, "marker")
    configs = _configs()
    for name, cfg in configs.items():
        engine, _ = build_engine(cfg)
        train_engine(engine, 1, rank, 1)
        engine.save_checkpoint(os.path.join(root, name), tag=TAG)
        engine.destroy()
    crafted = {}
    if rank == 0:
        for name in ("muon3", "adam_mini3"):
            convert_to_universal(os.path.join(root, name), os.path.join(root, f"{name}_u"), TAG)
        for case, (src, pattern) in {
                "model_states": ("muon3", "*model_states.pt"),
                "optim_states_rank1": ("muon3", "*rank_1_*optim_states.pt"),
                "stage2_model_states": ("muon2", "*model_states.pt"),
                "universal_header": ("muon3_u", "zero/optimizer_state.pt"),
                "universal_fp32": ("muon3_u", "zero/*/fp32.pt"),
                "universal_block_state": ("adam_mini3_u", "zero/*/block_exp_avg_sq.pt")}.items():
            crafted[case] = _craft(os.path.join(root, src, TAG), os.path.join(root, f"crafted_{case}", TAG),
                                   pattern, marker)
            with open(os.path.join(root, f"crafted_{case}", "latest_universal" if src.endswith("_u") else "latest"),
                      "w") as f:
                f.write(TAG)
    torch.distributed.barrier()
    out = {}
    loads = {"clean_muon3": ("muon3", "muon3", {}), "clean_universal": ("muon3", "muon3_u", {"u": True}),
             "model_states": ("muon3", "crafted_model_states", {}),
             "optim_states_rank1": ("muon3", "crafted_optim_states_rank1", {}),
             "stage2_weights_only": ("muon2", "crafted_stage2_model_states", {"module_only": True}),
             "universal_header": ("muon3", "crafted_universal_header", {"u": True}),
             "universal_fp32": ("muon3", "crafted_universal_fp32", {"u": True}),
             "universal_block_state": ("adam_mini3", "crafted_universal_block_state", {"u": True})}
    for case, (config, folder, how) in loads.items():
        cfg = dict(configs[config], checkpoint={"load_universal": True}) if how.get("u") else configs[config]
        engine, _ = build_engine(cfg)
        try:
            engine.load_checkpoint(os.path.join(root, folder), load_module_only=how.get("module_only", False))
            out[case] = "loaded"
        except CheckpointError as err:
            out[case] = f"CheckpointError: {err}"
        engine.destroy()
        out[f"{case}/marker"] = os.path.exists(marker)
    return {"errors": out, "crafted": crafted}


def _trusted_worker(rank: int, world_size: int, folder: str) -> bool:
    engine, _ = build_engine(ds_config())
    try:
        engine.load_checkpoint(folder)
    except Exception:  # noqa: BLE001 - the payload entry may upset DeepSpeed after it ran; only the marker matters
        pass
    engine.destroy()
    return True


def test_crafted_checkpoint_files_never_run(tmp_path) -> None:
    root = str(tmp_path)
    marker = os.path.join(root, "marker")
    env = {k: v for k, v in os.environ.items() if k != TRUST_ENV}
    results = run_distributed(_worker, 2, root, env={TRUST_ENV: "0"})
    crafted = results[0]["crafted"]
    for rank, res in enumerate(results):
        errors = res["errors"]
        assert errors["clean_muon3"] == "loaded" and errors["clean_universal"] == "loaded", (rank, errors)
        for case in ("model_states", "optim_states_rank1", "universal_header", "universal_fp32",
                     "universal_block_state"):
            assert errors[case].startswith("CheckpointError") and crafted[case] in errors[case], (rank, case, errors[case])
            assert "system" in errors[case] and TRUST_ENV in errors[case], errors[case]
        assert errors["stage2_weights_only"].startswith("CheckpointError"), (rank, errors["stage2_weights_only"])
        assert crafted["stage2_model_states"] in errors["stage2_weights_only"]
        assert not any(v for k, v in errors.items() if k.endswith("/marker")), errors
    for case in ("model_states", "optim_states_rank1"):  # the converter refuses them too
        proc = subprocess.run([sys.executable, "-m", "ds_muon.checkpoint", "to-universal",
                               os.path.join(root, f"crafted_{case}"), os.path.join(root, f"out_{case}")],
                              capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
        assert proc.returncode == 1 and crafted[case] in proc.stderr, (case, proc.returncode, proc.stderr[-2000:])
    assert not os.path.exists(marker)
    # control: trusted, the same crafted model states do run (DeepSpeed really reads that file)
    run_distributed(_trusted_worker, 2, os.path.join(root, "crafted_model_states"), env={TRUST_ENV: "1"})
    assert os.path.exists(marker), "the crafted file's payload did not run even when trusted: the test proves nothing"
