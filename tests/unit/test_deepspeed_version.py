"""An unsupported DeepSpeed is refused with a DeepSpeedVersionError naming the supported range (issue 38, item 1):
at ``ds_muon.enable``/``ds_muon.initialize`` (before anything is patched or built) and at the import of the
integration layer, never an AttributeError from inside ``deepspeed.initialize``. The range is pyproject.toml's
(``tests/dist/test_offload.py`` checks that they agree)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ds_muon.errors import SUPPORTED_DEEPSPEED, DeepSpeedVersionError
from tests.support.tools import REPO


@pytest.mark.parametrize("version,ok", [("0.18.9", False), ("0.19.7", False), ("0.19.8", True),
                                        ("0.19.9+cu128", True), ("0.19.9.dev0", True), ("0.20.0", False),
                                        ("not-a-version", False)])
def test_version_problem_names_the_range(version, ok):
    from ds_muon.integration.deepspeed_version import deepspeed_version_problem
    problem = deepspeed_version_problem(version)
    assert (problem is None) is ok, problem
    if not ok:
        assert f"deepspeed{SUPPORTED_DEEPSPEED}" in problem and f"deepspeed {version} is installed" in problem
        assert f"pip install 'deepspeed{SUPPORTED_DEEPSPEED}'" in problem


def test_enable_and_initialize_refuse_an_unsupported_deepspeed(monkeypatch):
    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine

    import ds_muon
    from tests.support.models import ParityNet
    original = DeepSpeedEngine._configure_basic_optimizer
    monkeypatch.setattr(deepspeed, "__version__", "0.18.9")
    calls = []
    monkeypatch.setattr(deepspeed, "initialize", lambda *a, **k: calls.append(1))
    for enter in (ds_muon.enable, lambda: ds_muon.initialize(
            model=ParityNet(), config={"train_batch_size": 1, "optimizer": {"type": "Muon"},
                                      "zero_optimization": {"stage": 3}})):
        with pytest.raises(DeepSpeedVersionError, match=rf"supports deepspeed{SUPPORTED_DEEPSPEED}.*deepspeed 0\.18\.9 "
                                                        "is installed"):
            enter()
        assert not ds_muon.is_enabled() and DeepSpeedEngine._configure_basic_optimizer is original
    assert calls == []  # refused before deepspeed.initialize


def test_importing_the_integration_layer_refuses_an_unsupported_deepspeed():
    """A fresh interpreter (DS_MUON=0: the start-up hook would import the layer at `import deepspeed`, before the
    version is changed)."""
    code = ("import deepspeed; deepspeed.__version__ = '0.18.9'\n"
            "try:\n    import ds_muon.integration\nexcept Exception as err:\n"
            "    print(type(err).__name__, err)\nelse:\n    print('imported')\n")
    env = dict(os.environ, DS_MUON="0", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=300).stdout
    assert f"DeepSpeedVersionError ds_muon supports deepspeed{SUPPORTED_DEEPSPEED}" in out, out
