"""``tests/support/exit_after.py`` runs a script as ``python SCRIPT ARGS`` would and leaves without finalization.

What the e2e tests and scripts/soak.py rely on: the script sees its own ``sys.argv`` and ``sys.path[0]``; a failure
still fails (an exception: exit 1 with the traceback; ``sys.exit(3)``: 3); ``atexit`` handlers and buffered
output are not lost; and after a successful run nothing of interpreter finalization runs. The last is checked
with a non-daemon thread that sleeps for 60 s: finalization would wait for it, ``os._exit`` does not.
"""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
from tests.support import exit_after

SCRIPT = '''
import atexit, sys, threading, time
print("argv", sys.argv[1:], "path0", sys.path[0], end="")  # buffered, no newline: must still come out
atexit.register(lambda: print(" atexit-ran", end=""))
MODE = sys.argv[1]
if MODE in ("return", "0"):
    threading.Thread(target=time.sleep, args=(60,)).start()  # non-daemon: finalization would wait for it
if MODE == "raise":
    raise ValueError("planted")
if MODE in ("0", "3"):
    sys.exit(int(MODE))
'''


def _run(tmp_path, mode: str) -> tuple[subprocess.CompletedProcess, float]:
    script = tmp_path / "job" / "script.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text(SCRIPT)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, exit_after.PATH, str(script), mode, "--flag"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    return proc, time.monotonic() - start


@pytest.mark.parametrize("mode", ["return", "0"])
def test_success_exits_zero_without_finalization(tmp_path, mode) -> None:
    proc, seconds = _run(tmp_path, mode)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"argv ['{mode}', '--flag'] path0 {tmp_path / 'job'} atexit-ran", proc.stdout
    assert seconds < 30, f"{seconds:.1f} s: finalization waited for the script's thread"


@pytest.mark.parametrize("mode, code, text", [("raise", 1, "ValueError: planted"), ("3", 3, "")])
def test_failure_keeps_its_exit_code(tmp_path, mode, code, text) -> None:
    proc, _ = _run(tmp_path, mode)
    assert proc.returncode == code, proc.stderr
    assert text in proc.stderr
    assert "atexit-ran" in proc.stdout
