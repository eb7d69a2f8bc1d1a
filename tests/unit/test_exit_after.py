"""``tests/support/exit_after.py`` runs a script as ``python SCRIPT ARGS`` would and leaves without finalization.

What the e2e tests and scripts/soak.py rely on: the script sees its own ``sys.argv`` and ``sys.path[0]``; a failure
still fails (an exception: exit 1 with the traceback; ``sys.exit(3)``: 3); what shutdown does before finalization
still happens, in its order (a non-daemon thread is waited for, then the ``atexit`` handlers run, and unflushed
output comes out); and after a successful run nothing of interpreter finalization runs. The last is seen with an
object held by a module in ``sys.modules`` whose ``__del__`` writes " finalized": finalization clears the modules
and so calls it (the control run, plain ``python SCRIPT``, shows it), ``os._exit`` does not.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from tests.support import exit_after

SCRIPT = '''
import atexit, os, sys, threading, time, types
print("argv", sys.argv[1:], "path0", sys.path[0], end="")  # buffered, no newline: must still come out

class Probe:
    def __del__(self, write=os.write):  # os.write bound now: imports fail during finalization
        write(1, b" finalized")

probe_module = types.ModuleType("probe_module")
probe_module.probe = Probe()
sys.modules["probe_module"] = probe_module
atexit.register(lambda: print(" atexit-ran", end=""))
# non-daemon: shutdown waits for it before the atexit handlers
threading.Thread(target=lambda: (time.sleep(0.5), print(" thread-done", end=""))).start()
MODE = sys.argv[1]
if MODE == "raise":
    raise ValueError("planted")
if MODE in ("0", "3"):
    sys.exit(int(MODE))
'''


def _run(tmp_path, mode: str, through_exit_after: bool = True) -> subprocess.CompletedProcess:
    script = tmp_path / "job" / "script.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text(SCRIPT)
    launcher = [exit_after.PATH] if through_exit_after else []
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered output, as by default
    return subprocess.run([sys.executable, *launcher, str(script), mode, "--flag"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path, env=env)


def _expected(tmp_path, mode: str) -> str:
    return f"argv ['{mode}', '--flag'] path0 {tmp_path / 'job'} thread-done atexit-ran"


def test_control_plain_python_finalizes(tmp_path) -> None:
    proc = _run(tmp_path, "return", through_exit_after=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == _expected(tmp_path, "return") + " finalized", proc.stdout


@pytest.mark.parametrize("mode", ["return", "0"])
def test_success_does_shutdown_then_exits_zero_without_finalization(tmp_path, mode) -> None:
    proc = _run(tmp_path, mode)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == _expected(tmp_path, mode), proc.stdout  # no " finalized"


@pytest.mark.parametrize("mode, code, text", [("raise", 1, "ValueError: planted"), ("3", 3, "")])
def test_failure_keeps_its_exit_code(tmp_path, mode, code, text) -> None:
    proc = _run(tmp_path, mode)
    assert proc.returncode == code, proc.stderr
    assert text in proc.stderr
    assert proc.stdout == _expected(tmp_path, mode) + " finalized", proc.stdout  # an ordinary exit
