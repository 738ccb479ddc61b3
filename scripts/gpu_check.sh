#!/usr/bin/env bash
# The fast path checked and measured on a GPU machine in one command (about 7 minutes):
#   scripts/gpu_check.sh [--dtype bfloat16|float16] [--out gpu-check] [--budget-s 420]
# It builds an SD-1.5-sized pipeline (and a Flux.1-dev-sized transformer) with random weights from the real
# configs, checks compiled vs eager and half vs float32, writes a latency model for `stepserve simulate`, and prints
# one table (see benchmarks/gpu_check.py). Nothing is downloaded.
#
# A GPU machine without diffusers and without a package index: carry the wheel along, fetched beforehand where pip
# can reach an index (diffusers is pure Python; add any other missing package the same way):
#   pip download diffusers==0.42.1 --no-deps -d wheels/
# This script then installs what wheels/ holds with `pip install --no-index --no-deps` into a private folder when
# diffusers is missing (WHEELS=DIR to look elsewhere).
# On a CPU, `scripts/gpu_check.sh --smoke` runs the same phases at tiny sizes (the test suite does that).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ -z "${PYTHON_SET:-}" ] && [ -x .venv/bin/python ] && ! command -v nvidia-smi >/dev/null 2>&1; then
    PYTHON=.venv/bin/python  # a CPU machine with the project's venv
fi
WHEELS="${WHEELS:-wheels}"
if ! "$PYTHON" -c "import diffusers" 2>/dev/null; then
    if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        echo "gpu_check: diffusers is not installed and $WHEELS/ has no wheel; beforehand, where pip reaches an index:" >&2
        echo "  pip download diffusers==0.42.1 --no-deps -d $WHEELS/" >&2
        exit 2
    fi
    SITE="${TMPDIR:-/tmp}/stepserve-gpu-check-site"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$WHEELS"/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PYTHON" -c "import stepserve" 2>/dev/null; then
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # run from the checkout, not installed
fi
exec "$PYTHON" benchmarks/gpu_check.py "$@"
