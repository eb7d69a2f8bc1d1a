#!/usr/bin/env bash
# Train the example model with DeepSpeed ZeRO-3 + ds_muon, from a fresh checkout.
#
#   scripts/train.sh                          # tiny model, 2 processes (CPU or GPUs), examples/ds_config_cpu.json
#   NPROC=8 scripts/train.sh --model small --deepspeed_config examples/ds_config_gpu_bf16.json
#
# What it does: creates .venv (or uses $VENV) if missing and installs torch unless it is importable (scripts/venv.sh:
# torch==2.13.0 when there is no nvidia-smi; PyPI's Linux wheel of it is the multi-GB CUDA build, so set
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu for the CPU one); installs this package (pip install -e .);
# then runs `deepspeed --num_gpus $NPROC examples/train.py "$@"`.
# On a CPU-only machine DeepSpeed picks its CPU accelerator and gloo by itself; nothing else is needed.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
NPROC="${NPROC:-2}"
source scripts/venv.sh  # $VENV, PATH, TORCH_EXTENSIONS_DIR, torch

# Reinstall only when the package metadata changed (the editable install tracks source edits by itself).
stamp="$VENV/.ds_muon-installed"
if [[ ! -f "$stamp" || pyproject.toml -nt "$stamp" ]] || ! python -c "import ds_muon, deepspeed" 2>/dev/null; then
    echo ">> installing ds_muon (pip install -e .)"
    python -m pip install -q -e .
    touch "$stamp"
fi

# DeepSpeed's JIT ops the job needs, built once with a progress line each (later runs load them from
# $TORCH_EXTENSIONS_DIR); a lock left by a killed build is removed when no process is building.
if command -v nvidia-smi >/dev/null 2>&1; then
    python -m ds_muon.integration.jit_ops FusedAdamBuilder || true
else
    python -m ds_muon.integration.jit_ops ShareMemCommBuilder FusedAdamBuilder || true
fi
echo ">> deepspeed --num_gpus $NPROC examples/train.py $*"
# On the CPU, DeepSpeed 0.19.8's shared-memory all-reduce gives each rank a 66 MiB /dev/shm segment named after the
# launcher's port (29500) and never unlinks it: RAM until reboot. When the script exits (the run ended, failed, or
# was stopped by Ctrl-C, SIGTERM or SIGHUP: with these traps bash waits for the launcher, then exits), this job's
# port's segments that no process maps or holds open any more are removed (a live job's are kept). The exit status
# is the launcher's (on Ctrl-C DeepSpeed's launcher stops its ranks and exits 1 itself; the INT trap serves a
# launcher killed by the signal).
cleanup() { python -m ds_muon.integration.shm_segments --port 29500 || true; }
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP
status=0
deepspeed --num_gpus "$NPROC" examples/train.py "$@" || status=$?
exit "$status"
