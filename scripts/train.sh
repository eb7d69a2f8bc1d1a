#!/usr/bin/env bash
# Train the example model with DeepSpeed ZeRO-3 + ds_muon, from a fresh checkout.
#
#   scripts/train.sh                          # tiny model, 2 processes (CPU or GPUs), examples/ds_config_cpu.json
#   NPROC=8 scripts/train.sh --model small --deepspeed_config examples/ds_config_gpu_bf16.json
#
# What it does: creates .venv (or uses $VENV) if missing; installs torch (torch==2.13.0 when there is no
# nvidia-smi: PyPI's Linux wheel of it is the multi-GB CUDA build, so set
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu for the CPU one) unless torch is already importable; installs
# this package (pip install -e .); then runs `deepspeed --num_gpus $NPROC examples/train.py "$@"`.
# On a CPU-only machine DeepSpeed picks its CPU accelerator and gloo by itself; nothing else is needed.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${VENV:-.venv}"
NPROC="${NPROC:-2}"
PYTHON="${PYTHON:-python3}"

if [[ ! -x "$VENV/bin/python" ]]; then
    echo ">> creating virtual environment $VENV"
    "$PYTHON" -m venv "$VENV"
fi
export PATH="$(cd "$VENV/bin" && pwd):$PATH"        # the launcher, and ninja for DeepSpeed's JIT-built ops
# DeepSpeed JIT-builds a C++ op on first use (on CPU: its shared-memory all-reduce: 48 s on 2 idle cores, 284 s on 2
# loaded ones). The default
# cache (~/.cache/torch_extensions) is shared by all environments, and each one rebuilds it with its own include
# paths, so keep one cache per environment.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$(cd "$VENV" && pwd)/torch_extensions}"
# ... and `source $VENV/bin/activate` sets the same default later (deactivate removes it): without it, a
# later `deepspeed examples/train.py` rebuilds every op in torch's default cache, silently, for minutes.
python scripts/venv_hook.py "$VENV" || true

if ! python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        echo ">> installing torch (pip's configured index or local wheels)"
        python -m pip install torch
    else
        echo ">> installing torch==2.13.0 (pip's ${TORCH_INDEX_URL:+index $TORCH_INDEX_URL}${TORCH_INDEX_URL:-configured index or local wheels})"
        # TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu where PyPI would give the CUDA build
        python -m pip install "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
    fi
    # what was installed, not what was meant: the index decides the build (CPU, or a CUDA version)
    python -c 'import torch; cuda = torch.version.cuda; print(">> installed torch", torch.__version__, f"(CUDA {cuda} build)" if cuda else "(CPU build)")'
fi

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
exec deepspeed --num_gpus "$NPROC" examples/train.py "$@"
