"""The docs build strictly, and the configuration reference matches the pydantic models."""
from __future__ import annotations

import subprocess
import sys

import pytest

from ds_muon.config.reference import main as reference_main, render_reference
from tests.support.tools import REPO



def test_configuration_reference_is_current() -> None:
    assert reference_main(["--check", "--out", str(REPO / "docs" / "configuration.md")]) == 0, \
        "docs/configuration.md drifted: run python -m ds_muon.config.reference"


def test_configuration_reference_lists_every_field() -> None:
    from ds_muon.config import MuonOptimizerParams
    page = render_reference()
    for name in MuonOptimizerParams.model_fields:
        assert f"| `{name}`" in page
    assert "(alias `adam_betas`)" in page and "a number in [0, 1)" in page


def test_reference_check_fails_on_drift(tmp_path) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text(render_reference().replace("Nesterov", "Nestorov"), encoding="utf-8")
    assert reference_main(["--check", "--out", str(stale)]) == 1


def test_mkdocs_build_strict(tmp_path) -> None:
    pytest.importorskip("mkdocs", reason="the docs build needs the docs (or test) extra: pip install -e '.[docs]'")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "configuration" / "index.html").exists()


def test_diagram_is_regenerated_by_its_script(tmp_path, monkeypatch) -> None:
    from tests.support.tools import repo_module
    mod = repo_module("scripts/make_diagram.py")
    monkeypatch.setattr(mod, "OUT", tmp_path / "d.svg")
    mod.main()
    assert (tmp_path / "d.svg").read_text() == (REPO / "docs" / "owner-exchange.svg").read_text()
