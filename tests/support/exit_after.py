"""Run a script as ``python SCRIPT ARGS...`` would, then leave without interpreter finalization.

    python tests/support/exit_after.py SCRIPT ARGS...
    python -m torch.distributed.run --nproc_per_node 2 tests/support/exit_after.py SCRIPT ARGS...

Every test and tool that launches a job with a process group as its own processes and judges it by their exit
codes (``tests/e2e``, ``tests/dist/test_step_walk.py``, ``scripts/soak.py``) launches it through this file. After ``SCRIPT`` returns (or calls
``sys.exit(0)``), its output is flushed, and the process ends with ``os._exit(0)``: no interpreter finalization.
The reason: on CPU (gloo) a rank can abort there now and then with torch's "terminate called without an active
exception" (SIGABRT, exit code -6) after all its work and output, while a live DeepSpeed engine keeps the gloo
backend's worker threads alive (docs/troubleshooting.md has the cause and the counts). The tests saw it once each
in test_readme_snippet, test_hf_trainer and test_soak_short (full suites on 2 cores). That abort is upstream's, and
the main job's own teardown is checked where it is meant to be: tests/e2e/test_clean_exit.py.

What stays as without this file: ``sys.argv`` (``SCRIPT ARGS...``), ``sys.path[0]`` (the script's folder), an
uncaught exception (traceback, exit code 1), ``sys.exit(n)`` with n not 0, and the ``atexit`` handlers, which
run before ``os._exit`` (torch's elastic agent reads nothing from them).
"""
from __future__ import annotations

import atexit
import os
import runpy
import sys


def main() -> None:
    """Run ``sys.argv[1]`` as ``__main__`` with ``sys.argv[2:]`` as its arguments; exit 0 without finalization
    when it succeeds. Raises what the script raises (SystemExit with a code other than 0 included)."""
    if len(sys.argv) < 2:
        raise SystemExit("usage: python tests/support/exit_after.py SCRIPT [ARGS...]")
    script = os.path.abspath(sys.argv[1])
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(script)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    atexit._run_exitfuncs()  # what finalization would have run first, in the same order
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


#: This file's path, to put before a script in a command line.
PATH = os.path.abspath(__file__)

if __name__ == "__main__":
    main()
