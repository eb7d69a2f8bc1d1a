"""Hugging Face Trainer + ``ds_muon.enable()`` trains with ds_muon's ZeRO-3 Muon (2 CPU processes).

Runs ``examples/hf_trainer.py`` under ``torchrun`` as a user would and reads its RESULT line; through
``tests/support/exit_after.py``, which ends each rank with ``os._exit(0)`` once the script returned (upstream's
intermittent gloo abort at interpreter exit, docs/troubleshooting.md).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from tests.support import exit_after
from tests.support.tools import REPO

pytest.importorskip("transformers", reason="the Hugging Face path needs the test extra: pip install -e '.[test]'")
pytest.importorskip("accelerate", reason="the Hugging Face path needs the test extra: pip install -e '.[test]'")


def test_trainer_runs_ds_muon(tmp_path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         exit_after.PATH, str(REPO / "examples" / "hf_trainer.py"), "--steps", "3", "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
    assert result["optimizer"] == "MuonZeroOptimizer"
    assert result["muon_step_count"] == 3  # ds_muon's step ran every optimizer step
    assert "model.layers.0.self_attn.q_proj.weight" in result["muon_params"]
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= set(result["adamw_params"])
    assert "ds_muon parameter split" in out  # the start-up summary reached the log
    # Trainer logs the raw gradient norm (of order 1 here), not the orthogonalized update's (~28, design §8b)
    assert len(result["grad_norms"]) == 3 and all(0 < g < 5 for g in result["grad_norms"])
    # it trained: one finite loss per step, falling, and both a Muon and an AdamW weight moved
    losses = result["losses"]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], losses
    change = result["weight_change"]
    assert set(change) == {"model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"}, change
    assert all(1e-4 < c < 1 for c in change.values()), change
