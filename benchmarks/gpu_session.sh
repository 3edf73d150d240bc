#!/usr/bin/env bash
# One call on the GPU machine (no package index there): installs the wheels gpu_wheels.sh put in
# .whl/ (carried), then runs gpu_session.py with the given arguments, its log teed to $OUT.
#   bash benchmarks/gpu_session.sh --phases env gpu_tests vs_torch_350m train_loop
set -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-session-out}"
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# Compiled programs are reused across the session's processes (compile time only; never timings).
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-/tmp/jax-cache}"
python3 benchmarks/gpu_session.py --out "$OUT" "$@" 2>&1 | tee "$OUT/session.log"
