#!/usr/bin/env bash
# Downloads, on a machine with PyPI, the wheels gpu_session.sh installs on the GPU machine (which
# has no package index): galore-torch (the peer; its bitsandbytes is left out, vs_torch.py loads
# GaLoreAdamW without it), grain with array-record and portpicker (train/data.py), protobuf
# (installed there only when the machine's is older than grain's generated code needs), tensorboardX
# (tests/test_metrics_writers.py), all for CPython 3.12 on x86-64 Linux: the one wheel set of the
# GPU sessions (benchmarks/gpu_session.sh, and benchmarks/evidence.py stage, which runs this). They
# go to .whl/ in the repository root (or the folder given), which .gitignore ignores, and travel
# with the device call's `carry: [".whl"]`.
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-.whl}"
mkdir -p "$dest"
rm -f "$dest"/*.whl  # the set below alone: pip refuses two versions of one package
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$dest" galore-torch==1.0 grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 tensorboardX==2.6.5 \
  protobuf==5.29.6
du -sh "$dest"
