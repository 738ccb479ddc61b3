#!/usr/bin/env bash
# The fast path checked and measured on a GPU machine in one command (about 5-8 minutes):
#   scripts/gpu_check.sh [--dtype bfloat16|float16] [--out gpu-check] [--budget-s 420]
# It builds an SD-1.5-sized pipeline (and a Flux.1-dev-sized transformer) with random weights from the real
# configs, checks compiled vs eager and half vs float32, writes a latency model for `stepserve simulate`, and prints
# one table (see benchmarks/gpu_check.py). Nothing is downloaded.
#
# The GPU machine has torch (CUDA), transformers and accelerate but no diffusers and no index to install from.
# Carry the wheels along, fetched beforehand on a machine with an index:
#   pip download diffusers==0.42.1 --no-deps -d wheels/
# This script then installs them with `pip install --no-index wheels/*.whl` when diffusers is missing.
# On a CPU, `scripts/gpu_check.sh --smoke` runs the same phases at tiny sizes (the test suite does that).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ -x .venv/bin/python ] && [ -z "${PYTHON_SET:-}" ] && ! command -v nvidia-smi >/dev/null 2>&1; then
    PYTHON=.venv/bin/python  # a CPU machine with the project's venv
fi
if ! "$PYTHON" -c "import diffusers" 2>/dev/null; then
    if ! ls wheels/*.whl >/dev/null 2>&1; then
        echo "gpu_check: diffusers is not installed and wheels/ has no wheel; beforehand, on a machine with an index:" >&2
        echo "  pip download diffusers==0.42.1 --no-deps -d wheels/" >&2
        exit 2
    fi
    "$PYTHON" -m pip install --no-index wheels/*.whl
fi
if ! "$PYTHON" -c "import stepserve" 2>/dev/null; then
    "$PYTHON" -m pip install --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$PYTHON" benchmarks/gpu_check.py "$@"
