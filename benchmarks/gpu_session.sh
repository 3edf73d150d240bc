#!/usr/bin/env bash
# One call on the GPU machine (no package index there): installs the wheels gpu_wheels.sh put in
# .whl/ (carried), then runs gpu_session.py with the given arguments, its log teed to $OUT.
#   bash benchmarks/gpu_session.sh --phases env vs_torch_350m gpu_tests train_loop
set -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-session-out}"
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  # The wheels of this Python's tags (gpu_wheels.sh's set is for the GPU machine's CPython 3.12;
  # pip refuses the others, and would end here).
  mapfile -t wheels < <(python3 - .whl/*.whl <<'PY'
import sys
from pip._vendor.packaging.tags import sys_tags
from pip._vendor.packaging.utils import parse_wheel_filename

here = set(sys_tags())
for path in sys.argv[1:]:
    name = path.rsplit("/", 1)[-1]
    if here & set(parse_wheel_filename(name)[3]):
        print(path)
    else:
        print(f"gpu_session.sh: {name} is for another Python than this one: not installed", file=sys.stderr)
PY
)
  # The carried protobuf only where the machine's is older than grain's generated code needs
  # (5.28.3): ahead of a newer one it would break the machine's packages generated with that.
  if python3 -c "import sys, google.protobuf as p; sys.exit(tuple(map(int, p.__version__.split('.')[:3])) < (5, 28, 3))" 2>/dev/null; then
    wheels=($(printf '%s\n' "${wheels[@]}" | grep -v '/protobuf-'))
  fi
  if ((${#wheels[@]})); then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "${wheels[@]}" || exit 1
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# Compiled programs are reused across the session's processes (compile time only; never timings).
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-/tmp/jax-cache}"
python3 benchmarks/gpu_session.py --out "$OUT" "$@" 2>&1 | tee "$OUT/session.log"
