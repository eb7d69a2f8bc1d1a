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

import pytest

os.environ["DS_MUON"] = "0"

KINDS = ("unit", "dist", "e2e")

#: The JIT op cache of this session (TORCH_EXTENSIONS_DIR as the session starts; a test may point it elsewhere).
_OP_CACHE: list[str] = []


def pytest_sessionstart(session):
    """Remove JIT build locks that a killed build left in the op cache before this session (another run's time-out,
    Ctrl-C): DeepSpeed's loader would wait on each forever, and the NVMe configs are refused while one stands."""
    from ds_muon.integration.jit_ops import _build_dir, clear_stale_locks
    _OP_CACHE.append(os.path.dirname(_build_dir("async_io")))
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    clear_stale_locks(_OP_CACHE[0], reporter.write_line if reporter is not None else print)


@pytest.fixture(autouse=True)
def _no_lock_left_by_a_killed_build():
    """After each test, remove the JIT build locks no live process holds: a rank or subprocess the test killed
    (a time-out, a failed peer) while it loaded an op leaves its lock, which would fail every later NVMe test.
    No grace: when a test ends, no process of it is between taking a lock and starting ninja."""
    yield
    if _OP_CACHE:
        import warnings

        from ds_muon.integration.jit_ops import clear_stale_locks
        clear_stale_locks(_OP_CACHE[0], lambda line: warnings.warn(line.removeprefix(">> "), stacklevel=1), grace_s=0)


def pytest_collection_modifyitems(items):
    for item in items:
        kind = Path(str(item.fspath)).parent.name
        if kind in KINDS:
            item.add_marker(kind)
