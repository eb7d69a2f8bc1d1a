"""scripts/venv_hook.py: the set-up scripts' environment carries its JIT-op cache (issue 30, item a).

``scripts/train.sh`` and ``scripts/test.sh`` keep DeepSpeed's JIT-built ops in ``.venv/torch_extensions``; after
``source .venv/bin/activate`` a ``deepspeed ...`` run must find them there (not rebuild them for minutes in torch's
default cache). A real virtual environment (``python -m venv --without-pip``) is changed twice, then activated in
bash with and without a value of the user's own.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.support.tools import REPO, repo_module

hook = repo_module("scripts/venv_hook.py")


def _bash(venv, script: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("TORCH_EXTENSIONS_DIR", "VIRTUAL_ENV")}
    proc = subprocess.run(["bash", "-c", f"source {venv}/bin/activate\n{script}"], capture_output=True, text=True,
                          env=dict(base, **env), timeout=60)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    return proc.stdout


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash to source the venv's activate")
def test_activate_sets_the_venv_cache_once_and_deactivate_undoes_it(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    original = (venv / "bin" / "activate").read_text()
    mode = (venv / "bin" / "activate").stat().st_mode
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "venv_hook.py"), str(venv)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and "now sets TORCH_EXTENSIONS_DIR" in proc.stdout, proc.stdout + proc.stderr
    once = (venv / "bin" / "activate").read_text()
    assert not hook.add_hook(str(venv))  # the second run changes nothing
    assert (venv / "bin" / "activate").read_text() == once and once.count(hook.BEGIN) == 2, once
    assert once.replace(hook.DEACTIVATE_BLOCK, "", 1).replace("\n" + hook.ACTIVATE_BLOCK, "") == original
    assert (venv / "bin" / "activate").stat().st_mode == mode
    want = f"{venv}/torch_extensions"
    # unset before: activate sets it, deactivate removes it
    out = _bash(venv, 'echo "A=$TORCH_EXTENSIONS_DIR"; deactivate; echo "D=${TORCH_EXTENSIONS_DIR-unset}"')
    assert out.splitlines() == [f"A={want}", "D=unset"], out
    # activating twice (activate runs `deactivate nondestructive` first) keeps the one value
    out = _bash(venv, f'source {venv}/bin/activate; echo "A=$TORCH_EXTENSIONS_DIR"')
    assert out.splitlines() == [f"A={want}"], out
    # a value of the user's own is kept, through deactivate too
    out = _bash(venv, 'echo "A=$TORCH_EXTENSIONS_DIR"; deactivate; echo "D=$TORCH_EXTENSIONS_DIR"',
                TORCH_EXTENSIONS_DIR="/mine")
    assert out.splitlines() == ["A=/mine", "D=/mine"], out
    # changed by the user after activation: deactivate leaves the new value alone
    out = _bash(venv, 'export TORCH_EXTENSIONS_DIR=/later; deactivate; echo "D=$TORCH_EXTENSIONS_DIR"')
    assert out.splitlines() == ["D=/later"], out


def test_missing_activate_is_left_alone(tmp_path):
    assert not hook.add_hook(str(tmp_path))
    assert hook.main([str(tmp_path)]) == 0 and not (tmp_path / "bin").exists()
