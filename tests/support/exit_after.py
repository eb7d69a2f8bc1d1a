"""Run a script as ``python SCRIPT ARGS...`` would, then leave without interpreter finalization.

    python tests/support/exit_after.py SCRIPT ARGS...
    python -m torch.distributed.run --nproc_per_node 2 tests/support/exit_after.py SCRIPT ARGS...

Every test and tool that launches a job with a process group as its own processes and judges it by their exit
codes (``tests/e2e``, ``tests/dist/test_step_walk.py``, ``scripts/soak.py``) launches it through this file, except
``tests/e2e/test_clean_exit.py``, which checks the main job's real exit. After ``SCRIPT`` returns (or calls
``sys.exit(0)``), the process does what shutdown does before finalization (below) and ends with ``os._exit(0)``: no
interpreter finalization. The reason: on CPU (gloo) a rank can abort there now and then with torch's "terminate
called without an active exception" (SIGABRT, exit code -6) after all its work and output, while a live DeepSpeed
engine keeps the gloo backend's worker threads alive (docs/troubleshooting.md has the cause and the counts). The
tests saw it once each in test_readme_snippet, test_hf_trainer and test_soak_short (full suites on 2 cores).

What stays as without this file: ``sys.argv`` (``SCRIPT ARGS...``, as given), ``sys.path[0]`` (the script's folder,
symbolic links resolved), an uncaught exception (traceback, exit code 1), ``sys.exit(n)`` with n not 0, and what
interpreter shutdown does before finalization, in its order: wait for the non-daemon Python threads
(``threading._shutdown``; gloo's worker threads are C++ threads, not among them), run the ``atexit`` handlers, flush
Python's and C's standard streams.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import runpy
import sys
import threading


def main() -> None:
    """Run ``sys.argv[1]`` as ``__main__`` with ``sys.argv[2:]`` as its arguments; when it succeeds, :func:`leave`.
    Raises what the script raises (SystemExit with a code other than 0 included)."""
    if len(sys.argv) < 2:
        raise SystemExit("usage: python tests/support/exit_after.py SCRIPT [ARGS...]")
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    leave()


def leave() -> None:
    """What interpreter shutdown does before finalization (CPython's ``Py_FinalizeEx``: non-daemon threads joined,
    ``atexit`` handlers, standard streams flushed), then ``os._exit(0)`` instead of finalization."""
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        ctypes.CDLL(None).fflush(None)  # C stdio buffers (extension modules' printf), which os._exit drops
    except (OSError, AttributeError):  # no C library to load by name here: nothing of C's buffered to drop
        pass
    os._exit(0)


#: This file's path, to put before a script in a command line.
PATH = os.path.abspath(__file__)

if __name__ == "__main__":
    main()
