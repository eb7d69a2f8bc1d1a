# Sourced by scripts/train.sh and scripts/test.sh (not run on its own): the virtual environment both use, from a
# fresh checkout.
#
# Creates $VENV (default .venv, with $PYTHON, default python3) if missing; puts its bin/ first on PATH (the
# deepspeed launcher, and ninja for DeepSpeed's JIT-built ops); keeps those ops in $VENV/torch_extensions
# (TORCH_EXTENSIONS_DIR; scripts/venv_hook.py makes `source $VENV/bin/activate` set the same); installs torch
# unless it is importable: torch==2.13.0 where there is no nvidia-smi (PyPI's Linux wheel of it is the multi-GB CUDA
# build, so set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu for the CPU one), else pip's torch.
# Expects the caller's working directory to be the repository root and `set -euo pipefail`.
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"

if [[ ! -x "$VENV/bin/python" ]]; then
    echo ">> creating virtual environment $VENV"
    "$PYTHON" -m venv "$VENV"
fi
venv_bin="$(cd "$VENV/bin" && pwd)"  # apart from the export, so that a failing cd stops the script (set -e)
export PATH="$venv_bin:$PATH"
# DeepSpeed JIT-builds a C++ op on first use (on CPU: its shared-memory all-reduce: 48 s on 2 idle cores, 284 s on 2
# loaded ones). The default cache (~/.cache/torch_extensions) is shared by all environments, and each one rebuilds it
# with its own include paths, so keep one cache per environment ...
venv_dir="$(cd "$VENV" && pwd)"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$venv_dir/torch_extensions}"
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
    # what was installed, not what was meant: the index decides the build (CPU, or a CUDA version); -W ignore: torch
    # warns that it cannot load numpy, which comes with the package install next
    python -W ignore -c 'import torch; cuda = torch.version.cuda; print(">> installed torch", torch.__version__, f"(CUDA {cuda} build)" if cuda else "(CPU build)")'
fi
