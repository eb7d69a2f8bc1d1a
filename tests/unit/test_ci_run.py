"""``.ci/run`` runs both CI legs (``scripts/test.sh``, then ``scripts/test_lowest.sh``: the lowest supported versions)
and fails when either fails, pytest's exit code 5 ("no tests collected") included (issue 38, item 1). Run on a copy of
``.ci/run`` beside stub scripts that record that they ran and exit with a given code."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.support.tools import REPO


@pytest.mark.parametrize("main,lowest,want", [(0, 0, 0), (1, 0, 1), (0, 1, 1), (0, 5, 5), (5, 0, 5), (2, 3, 2)])
def test_ci_runs_both_legs_and_fails_when_either_fails(tmp_path, main, lowest, want):
    (tmp_path / ".ci").mkdir()
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / ".ci" / "run", tmp_path / ".ci" / "run")
    for name, code in (("test.sh", main), ("test_lowest.sh", lowest)):
        (tmp_path / "scripts" / name).write_text(f'echo "$0 $*" >> "$(dirname "$0")/../ran"\nexit {code}\n')
    result = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True, text=True, timeout=60,
                            env=dict(os.environ))
    assert result.returncode == want, (result.returncode, result.stdout, result.stderr)
    ran = (tmp_path / "ran").read_text().splitlines()
    assert [line.split()[0].rsplit("/", 1)[1] for line in ran] == ["test.sh", "test_lowest.sh"], ran
    assert ran[0].split()[1:] == ["-q", "-p", "no:cacheprovider", "-rfEs"], ran
    assert f"main leg exit code {main}, lowest-versions leg exit code {lowest}" in result.stdout, result.stdout


def test_lowest_leg_reads_the_lower_bounds_it_tests_from_pyproject():
    """The leg's versions are pyproject.toml's lower bounds (the deepspeed dependency's, the hf extra's transformers),
    which are the supported range's and the one ds_muon.errors.SUPPORTED_DEEPSPEED states."""
    import re

    from ds_muon.errors import SUPPORTED_DEEPSPEED
    text = (REPO / "pyproject.toml").read_text()
    assert re.search(r'"deepspeed>=([0-9.]+)', text).group(1) == re.match(r">=([0-9.]+)", SUPPORTED_DEEPSPEED).group(1)
    assert re.search(r'"transformers>=([0-9.]+)', text) is not None
    script = (REPO / "scripts" / "test_lowest.sh").read_text()
    for step in ("-m unit tests/unit", "test_zero3_parity.py::test_parity_with_oracle[2]",
                 "test_zero12_parity.py::test_stage12_parity_with_oracle[2]",
                 "test_family_parity.py::test_model_families_match_oracle_and_follow_their_rules", "examples/train.py"):
        assert step in script, step
