#!/usr/bin/env bash
# Run the ds_muon test suite from a fresh checkout (the README's second command; .ci/run calls it).
#
#   scripts/test.sh                 # all tests
#   scripts/test.sh -k parity -x    # extra arguments go to pytest
#
# Creates .venv (or $VENV) if missing and installs torch unless it is importable (scripts/venv.sh: torch==2.13.0
# when there is no nvidia-smi; set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu where PyPI would give the
# CUDA build), installs ds_muon with its
# test extra (pip install -e ".[test]"), installs libaio-dev with apt-get when missing (as root), then runs pytest. Multi-rank tests start 1-8 CPU processes on gloo.
# pytest's exit code is the script's, so "no tests collected" (5) fails too.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/venv.sh  # $VENV, PATH, TORCH_EXTENSIONS_DIR, torch (the same as scripts/train.sh)

# The NVMe offload tests need libaio for DeepSpeed's async_io op (JIT-built below; 165 s to 18 min on 2 loaded cores).
if [[ ! -e /usr/include/libaio.h ]]; then
    if command -v apt-get >/dev/null 2>&1 && [[ "$(id -u)" == 0 ]]; then
        echo ">> installing libaio-dev (apt-get) for the NVMe offload tests"
        apt-get install -y -q libaio-dev >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null && apt-get install -y -q libaio-dev >/dev/null; }
    else
        echo "!! libaio-dev is missing and cannot be installed here (needs root and apt-get):" \
             "the NVMe offload tests will fail; install it (sudo apt-get install libaio-dev)" >&2
    fi
fi
echo ">> installing ds_muon (pip install -e .[test])"
python -m pip install -q -U "setuptools>=77" wheel  # tests/e2e/test_autoload.py builds ds_muon without isolation (77: the SPDX license and license-files keys)
python -m pip install -q -e ".[test]"

# DeepSpeed's CPU shared-memory all-reduce never unlinks its /dev/shm segments (66 MiB per rank, RAM until reboot):
# remove those that no process maps or holds open, left by earlier runs, before the op builds below need the memory.
python -m ds_muon.integration.shm_segments || true

# Build DeepSpeed's JIT ops (shared-memory comm, CPU Adam, FusedAdam, pinned memory, async_io) once, here, with a
# progress line each: a build inside a test would run under that test's time-out, and a build killed halfway leaves
# a lock every later run waits on forever (the builder removes such a lock when no process is building).
python -m ds_muon.integration.jit_ops || echo "!! a DeepSpeed op did not build (above); the tests that need it will say so" >&2

echo ">> python -m pytest${*:+ $(printf '%q ' "$@")}"  # the arguments quoted as a shell would need them
exec python -m pytest "$@"
