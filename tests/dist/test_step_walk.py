"""docs/design.md's walk of one Muon step holds: Newton–Schulz runs at most 6 frames below ``_optimizer_step`` (13
before the dispatch moved into the shared base; issue 37 asked for at most half), and every ds_muon frame on the way
is named in the walk's list, so the list cannot drift from the code. The W=1 gloo job runs through
``tests/support/exit_after.py`` (no interpreter finalization after it: torch's gloo abort, docs/troubleshooting.md).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from tests.support import exit_after
from tests.support.spawn import free_port
from tests.support.tools import REPO

MAX_FRAMES = 6


def test_newton_schulz_is_six_frames_below_the_dispatch_and_the_design_walk_names_them():
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, exit_after.PATH, str(REPO / "scripts" / "step_walk.py"), "--json"], env=env,
                          cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    below = summary["below"]
    assert below[-1] == ["ds_muon/core/newton_schulz.py", "orthogonalize"], below
    assert summary["frames_below_optimizer_step"] <= MAX_FRAMES, below
    walk = (REPO / "docs" / "design.md").read_text(encoding="utf-8").split("### The walk, file by file")[1]
    walk = walk.split("### ")[0]
    stated = re.search(r"Newton–Schulz runs (\d+) frames below `_optimizer_step` \(([^)]*)\)", walk)
    assert stated, "docs/design.md's walk no longer states how many frames below _optimizer_step Newton–Schulz runs"
    assert int(stated.group(1)) == summary["frames_below_optimizer_step"], (stated.group(1), below)
    listed = [name.strip("`\n ").split(".")[-1] for name in stated.group(2).split(";")[0].split(",")]
    assert listed == [name for _, name in below], f"design.md lists {listed}, the step runs {below}"
    for where, name in below:
        assert where.startswith("ds_muon/"), f"a frame outside ds_muon below the dispatch: {where} {name}"
        assert where.removeprefix("ds_muon/") in walk, f"docs/design.md's walk does not name {where}"
