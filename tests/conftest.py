"""Suite-wide settings.

* The zero-code start-up hook (ds_muon/_autoload.py) stays off unless a test turns it on: where ds_muon is
  pip-installed into the test environment, its ``ds_muon_autoload.pth`` would enable ds_muon in every process
  that imports deepspeed, and tests that build DeepSpeed's own optimizers, or check that ``ds_muon.disable()``
  restores DeepSpeed, would see ds_muon instead. Spawned ranks inherit the variable; tests/e2e/test_autoload.py
  sets it per subprocess.
* Every test gets the marker of its folder: ``unit`` (one process, no process group), ``dist`` (gloo process
  groups spawned by :func:`tests.support.spawn.run_distributed`), ``e2e`` (subprocesses: launchers, clients,
  fresh interpreters). ``pytest -m unit`` (or ``pytest tests/unit``) is the quick run.
"""
import os
from pathlib import Path

os.environ["DS_MUON"] = "0"

KINDS = ("unit", "dist", "e2e")


def pytest_collection_modifyitems(items):
    for item in items:
        kind = Path(str(item.fspath)).parent.name
        if kind in KINDS:
            item.add_marker(kind)
