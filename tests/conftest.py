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
    Ctrl-C): DeepSpeed's loader would wait on each forever, and the NVMe configs are refused while one stands. A
    failure here (an unsupported DeepSpeed, an unwritable cache) is a warning: the tests then say what is wrong."""
    import warnings
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    log = reporter.write_line if reporter is not None else print
    try:
        from ds_muon.integration.jit_ops import _build_dir, clear_stale_locks
        from ds_muon.integration.shm_segments import describe, remove_leaked_segments
        cache = os.path.dirname(_build_dir("async_io"))
        clear_stale_locks(cache, log)
        removed = remove_leaked_segments(min_age_s=0)
    except Exception as err:  # noqa: BLE001 - reported; every test still runs, without the clean-ups
        warnings.warn(f"stale JIT build locks and leaked shared memory were not checked: {type(err).__name__}: "
                      f"{err}", stacklevel=1)
        return
    _OP_CACHE.append(cache)
    if removed:
        log(f">> removed {describe(removed)}, left by earlier runs")


@pytest.fixture(autouse=True)
def _nothing_left_by_the_test():
    """After each test, remove what its processes left that would break or slow later tests, each with a warning
    that names it: JIT build locks no live process holds (a rank or subprocess the test killed while it loaded an
    op leaves its lock, which would fail every later NVMe test; no grace: a lock some live process holds open, or
    builds under, is kept, :func:`ds_muon.integration.jit_ops.builder_alive`), and DeepSpeed shared-memory
    segments no process maps or holds open (RAM until reboot: :mod:`ds_muon.integration.shm_segments`)."""
    yield
    if not _OP_CACHE:  # the session's start could not check (a warning said why)
        return
    import warnings

    from ds_muon.integration.jit_ops import clear_stale_locks
    from ds_muon.integration.shm_segments import describe, remove_leaked_segments
    clear_stale_locks(_OP_CACHE[0], lambda line: warnings.warn(line.removeprefix(">> "), stacklevel=1), grace_s=0)
    removed = remove_leaked_segments(min_age_s=0)  # the suite's groups take free ports: no name is reused
    if removed:
        warnings.warn(f"this test (or another process meanwhile) left {describe(removed)}, removed: "
                      + ", ".join(os.path.basename(p) for p, _ in removed), stacklevel=1)


def pytest_collection_modifyitems(items):
    for item in items:
        kind = Path(str(item.fspath)).parent.name
        if kind in KINDS:
            item.add_marker(kind)
