"""The README's user snippet runs as written: its ``ds_config.json`` and its ``ds_muon.initialize`` script, at W=2 on
CPU (gloo), train with ds_muon's ZeRO-3 Muon and the printed loss falls.

The two blocks are read from README.md (the one ```json block, the ```python block that calls
``ds_muon.initialize``), so an edit that breaks either fails here. One line is appended to the script: rank 0
prints the optimizer's class. It runs through ``tests/support/exit_after.py``, which ends each rank with
``os._exit(0)`` once the script returned, skipping interpreter finalization: there a rank can abort now and then
with torch's "terminate called without an active exception" after all its work (docs/troubleshooting.md; seen
here once in a full suite on 2 cores, 2026-12-05, after the snippet's own barrier and ``destroy_process_group``).
That abort is upstream and the teardown is checked where it is meant to be, on the main job
(tests/e2e/test_clean_exit.py).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.support import exit_after
from tests.support.spawn import free_port
from tests.support.tools import REPO


def _readme_blocks() -> tuple[str, str]:
    blocks = re.findall(r"```(\w+)\n(.*?)```", (REPO / "README.md").read_text(encoding="utf-8"), flags=re.S)
    configs = [b for kind, b in blocks if kind == "json"]
    scripts = [b for kind, b in blocks if kind == "python" and "ds_muon.initialize(" in b]
    assert len(configs) == 1 and len(scripts) == 1, "README.md should have one json config and one initialize script"
    return configs[0], scripts[0]


def test_readme_config_and_initialize_snippet_train(tmp_path):
    config, script = _readme_blocks()
    (tmp_path / "ds_config.json").write_text(config)
    (tmp_path / "train.py").write_text(script + "if engine.global_rank == 0:\n"
                                                "    print('optimizer', type(engine.optimizer).__name__)\n")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           exit_after.PATH, "train.py"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "optimizer MuonZeroOptimizer" in proc.stdout, proc.stdout[-3000:]
    losses = [float(v) for v in re.findall(r"^step (?:10|20|30): loss ([\d.]+)$", proc.stdout, flags=re.M)]
    assert len(losses) == 3, proc.stdout[-3000:]
    # measured 4.645 -> 2.035 (the data are counting sequences, learnable); a step that updates nothing stays ~5.5
    assert losses[-1] < 0.7 * losses[0], losses
