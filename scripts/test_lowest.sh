#!/usr/bin/env bash
# CI's second leg (.ci/run runs it after scripts/test.sh): the other end of the supported versions. The main leg runs
# the test extra's pins (deepspeed 0.19.8, transformers 5.25.0: the newest); this one runs the lowest supported
# deepspeed and transformers (pyproject.toml: the lower bounds of the deepspeed dependency and of the hf extra's
# transformers) with torch 2.13.0 (CPU), on a smoke subset: the unit tests, the W=2 ZeRO-3 and ZeRO-1/2 parity groups
# (every case compared with the oracle), transformers' model families against the oracle (test_family_parity) and
# the main job (examples/train.py, 2 ranks) for a few steps.
#
#   scripts/test.sh && scripts/test_lowest.sh                          # .ci/run
#   LOWEST_DEEPSPEED=0.19.8 LOWEST_TRANSFORMERS=5.24.0 scripts/test_lowest.sh
#
# Its environment, .venv-lowest (or $LOWEST_VENV), is layered over .venv (or $VENV, made by scripts/test.sh): its own
# site-packages hold only what differs (transformers, and deepspeed when the lowest is not .venv's), and a .pth file
# appends .venv's site-packages after them for everything else (torch, accelerate, pytest, ...), so nothing is
# downloaded twice. With .venv's DeepSpeed the JIT-built ops are .venv's (the same sources at the same paths: no
# rebuild); another DeepSpeed gets its own op cache (a few minutes of builds). Exits non-zero when any step fails,
# and pytest's exit code 5 ("no tests collected") is a failure too.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
BASE="${VENV:-.venv}"
LOW="${LOWEST_VENV:-.venv-lowest}"
PYTHON="${PYTHON:-python3}"
STEPS="${LOWEST_TRAIN_STEPS:-5}"
started=$(date +%s)

if [[ ! -x "$BASE/bin/python" ]]; then
    echo "!! $BASE does not exist: run scripts/test.sh first (this leg reuses its packages)" >&2
    exit 2
fi
lower_bound() {  # the first "NAME>=X" in pyproject.toml: the dependency's (deepspeed) or the hf extra's (transformers)
    "$BASE/bin/python" -c 'import re, sys; m = re.search(r"\"%s>=([0-9][0-9.]*)" % sys.argv[1], open("pyproject.toml").read()); print(m.group(1) if m else "")' "$1"
}
DEEPSPEED="${LOWEST_DEEPSPEED:-$(lower_bound deepspeed)}"
TRANSFORMERS="${LOWEST_TRANSFORMERS:-$(lower_bound transformers)}"
if [[ -z "$DEEPSPEED" || -z "$TRANSFORMERS" ]]; then
    echo "!! no lower bound for deepspeed ('$DEEPSPEED') or transformers ('$TRANSFORMERS') in pyproject.toml" >&2
    exit 2
fi

if [[ ! -x "$LOW/bin/python" ]]; then
    echo ">> creating $LOW (layered over $BASE)"
    "$PYTHON" -m venv --without-pip "$LOW"   # pip (and setuptools) are $BASE's: a venv's own older ones would shadow them
fi
purelib() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
# "zz": after every other .pth of $LOW; the repository itself for ds_muon (its editable install's .pth is $BASE's)
printf '%s\n%s\n' "$(pwd)" "$(cd "$(purelib "$BASE")" && pwd)" > "$(purelib "$LOW")/zz_ds_muon_base_venv.pth"
export PATH="$(cd "$LOW/bin" && pwd):$(cd "$BASE/bin" && pwd):$PATH"   # python is $LOW's; ninja is $BASE's

installed() {  # whether the importable NAME is release VERSION (5.24 == 5.24.0)
    python -c 'import sys; from importlib.metadata import version; from packaging.version import Version
sys.exit(Version(version(sys.argv[1])) != Version(sys.argv[2]))' "$1" "$2"
}
for pkg in "transformers==$TRANSFORMERS" "deepspeed==$DEEPSPEED"; do
    if ! installed "${pkg%%==*}" "${pkg##*==}"; then
        echo ">> installing $pkg into $LOW"
        python -m pip install -q "$pkg"
    fi
done
# where deepspeed is imported from (found, not imported: importing it prints the accelerator line)
ds_site="$(python -c 'import importlib.util, os; print(os.path.dirname(os.path.dirname(importlib.util.find_spec("deepspeed").origin)))')"
if [[ "$(cd "$ds_site" && pwd)" == "$(cd "$(purelib "$BASE")" && pwd)" ]]; then
    export TORCH_EXTENSIONS_DIR="$(cd "$BASE" && pwd)/torch_extensions"   # .venv's DeepSpeed: its ops as built
else
    export TORCH_EXTENSIONS_DIR="$(cd "$LOW" && pwd)/torch_extensions"
    python -m ds_muon.integration.jit_ops ShareMemCommBuilder FusedAdamBuilder CPUAdamBuilder
fi
python -c 'import deepspeed, torch, transformers; print(f">> lowest leg: deepspeed {deepspeed.__version__}, "
    f"torch {torch.__version__}, transformers {transformers.__version__}")' 2>/dev/null

echo ">> unit tests"
python -m pytest -q -p no:cacheprovider -rfEs -m unit tests/unit
echo ">> ZeRO-3 and ZeRO-1/2 parity with the oracle at W=2; transformers' model families (Llama, Qwen3, Qwen3-MoE, ...) too"
python -m pytest -q -p no:cacheprovider -rfEs "tests/dist/test_zero3_parity.py::test_parity_with_oracle[2]" \
    "tests/dist/test_zero12_parity.py::test_stage12_parity_with_oracle[2]" \
    tests/dist/test_family_parity.py::test_model_families_match_oracle_and_follow_their_rules
echo ">> the main job: examples/train.py, 2 ranks, $STEPS steps"
python -m deepspeed.launcher.runner --num_gpus 2 examples/train.py --steps "$STEPS" --eval-every 0 --save-dir ""
echo ">> lowest leg passed in $(( $(date +%s) - started )) s"
