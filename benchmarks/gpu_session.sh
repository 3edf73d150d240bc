#!/usr/bin/env bash
# One call on the GPU machine (no package index there): installs the wheels gpu_wheels.sh put in
# .whl/ (carried), then runs gpu_session.py with the given arguments, its log teed to $OUT.
#   bash benchmarks/gpu_session.sh --phases env gpu_tests vs_torch_350m train_loop
set -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-session-out}"
mkdir -p "$OUT"
tag=$(python3 -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
if compgen -G ".whl/*-cp3*.whl" >/dev/null && ! compgen -G ".whl/*-${tag}-*.whl" >/dev/null; then
  # gpu_wheels.sh's set is for the GPU machine's CPython 3.12; pip would refuse it here.
  echo "gpu_session.sh: .whl/ holds wheels for another Python than this $tag: not installed" >&2
elif compgen -G ".whl/*.whl" >/dev/null; then
  # The carried protobuf only where the machine's is older than grain's generated code needs
  # (5.28.3): ahead of a newer one it would break the machine's packages generated with that.
  wheels=(.whl/*.whl)
  if python3 -c "import sys, google.protobuf as p; sys.exit(tuple(map(int, p.__version__.split('.')[:3])) < (5, 28, 3))" 2>/dev/null; then
    wheels=($(printf '%s\n' "${wheels[@]}" | grep -v '/protobuf-'))
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "${wheels[@]}" || exit 1
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# Compiled programs are reused across the session's processes (compile time only; never timings).
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-/tmp/jax-cache}"
python3 benchmarks/gpu_session.py --out "$OUT" "$@" 2>&1 | tee "$OUT/session.log"
