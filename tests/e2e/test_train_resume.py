"""``examples/train.py --resume``: the resumed loss curve continues the saved one (W=2, CPU).

One uninterrupted 4-step run at W=2 saves checkpoints at steps 2 and 4 and logs its per-step metrics.
Its ``latest`` is then pointed at step 2 and the run resumed from there:
* at W=2 (the ZeRO files directly), steps 3 and 4 must repeat the uninterrupted run's losses: step 3
  exactly (same weights, optimizer state, lr schedule and data position), step 4 to 1e-5 relative
  (DeepSpeed's CPU Adam computes ``beta^t`` differently after a restart, see docs/checkpointing.md);
* at W=1 (converted to a universal checkpoint in ``DIR/universal`` by train.py): the one process draws the saved
  run's 2 data streams with gradient accumulation 2, the same global batch and samples, so steps 3 and 4 repeat
  the uninterrupted losses to 1e-5;
* at W=3, where the 2 streams do not divide: 3 streams from there on, said in the log, and the first resumed
  loss is the trained model's (near the uninterrupted step-3 loss), not a fresh model's.

Each run goes through ``tests/support/exit_after.py`` (no interpreter finalization once train.py returned:
torch's intermittent gloo abort there, docs/troubleshooting.md; test_clean_exit.py checks the teardown).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from tests.support import exit_after
from tests.support.spawn import free_port
from tests.support.tools import REPO

ROOT = str(REPO)
TRAIN = os.path.join(ROOT, "examples", "train.py")
COMMON = ["--steps", "4", "--eval-every", "0", "--eval-batches", "1", "--max-bytes", "200000", "--seq-len", "64"]



def _train(nproc: int, cwd: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), exit_after.PATH, TRAIN, *COMMON, *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    # captured output is no terminal: progress lines, not tqdm's redraws (unit/test_train_progress.py)
    assert "\r" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    return proc.stdout


def _losses(path: str, key: str = "loss") -> dict[int, float]:
    with open(path) as f:
        return {r["step"]: r[key] for r in map(json.loads, f) if "loss" in r}


def test_resume_continues_loss_curve(tmp_path):
    cwd = str(tmp_path)
    out = _train(2, cwd, "--save-dir", "ck", "--save-every", "2", "--metrics", "full.jsonl")
    assert re.findall(r"^step (\d)/4: loss [\d.]+, tok/s ", out, flags=re.M) == ["1", "2", "3", "4"], out[-3000:]
    full = _losses(tmp_path / "full.jsonl")
    assert sorted(full) == [1, 2, 3, 4] and full[4] < full[1]
    assert sorted(os.listdir(tmp_path / "ck")) >= ["global_step2", "global_step4"]
    (tmp_path / "ck" / "latest").write_text("global_step2")

    _train(2, cwd, "--resume", "ck", "--save-dir", "ck_w2", "--metrics", "w2.jsonl")
    w2 = _losses(tmp_path / "w2.jsonl")
    assert sorted(w2) == [3, 4]
    assert w2[3] == full[3]
    # the step's max attention logit (ds_muon.model.max_logits, all layers/heads/ranks): same weights and data, same value
    logits_full, logits_w2 = _losses(tmp_path / "full.jsonl", "max_logit"), _losses(tmp_path / "w2.jsonl", "max_logit")
    assert all(0 < v < 1e4 for v in logits_full.values()) and logits_w2[3] == logits_full[3]
    assert w2[4] == pytest.approx(full[4], rel=1e-5)

    _train(1, cwd, "--resume", "ck", "--save-dir", "ck_w1", "--metrics", "w1.jsonl")
    w1 = _losses(tmp_path / "w1.jsonl")
    assert sorted(w1) == [3, 4]
    assert os.path.isfile(tmp_path / "ck" / "universal" / "global_step2" / "zero" / "optimizer_state.pt")
    # the saved run's 2 data streams, both drawn by the one process (gradient accumulation 2): the same global
    # batch and samples, so the same losses up to the reordered sums (measured: identical)
    assert w1[3] == pytest.approx(full[3], rel=1e-5)
    assert w1[4] == pytest.approx(full[4], rel=1e-5)

    out = _train(3, cwd, "--resume", "ck", "--save-dir", "ck_w3", "--metrics", "w3.jsonl")
    assert "the saved run's 2 data streams do not divide among 3 processes: 3 streams" in out, out[-3000:]
    w3 = _losses(tmp_path / "w3.jsonl")
    assert sorted(w3) == [3, 4]
    assert w3[3] == pytest.approx(full[3], rel=0.06)      # the trained model, other samples
    assert w3[3] < full[1] - 0.5 * (full[1] - full[3])     # well below a fresh model's loss


def test_data_streams_must_divide_among_the_processes():
    """``--data-streams`` that is not a positive multiple of the processes fails before anything is loaded."""
    from tests.support.tools import repo_module
    train = repo_module("examples/train.py")
    train.check_data_streams(None, 3)
    train.check_data_streams(4, 2)
    for streams, world in ((3, 2), (0, 1), (-2, 2)):
        with pytest.raises(ValueError, match=rf"--data-streams {streams} is not a positive multiple of the {world} "):
            train.check_data_streams(streams, world)
