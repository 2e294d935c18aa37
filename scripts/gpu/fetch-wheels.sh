#!/usr/bin/env bash
# Download the wheels of scripts/gpu/wheels.txt into .whl/ for the GPU machine (Python 3.12, x86_64): about
# 61 MB, within the 64 MiB a device call carries with the tree. .whl/ is git-ignored.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
grep -v '^#' scripts/gpu/wheels.txt | xargs python3 -m pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl
ls -la .whl/*.whl
# kvplane itself built for CPython 3.12, the fallback of run.sh where the GPU machine cannot build it
PY312=${PY312:-python3.12}
if "$PY312" -c "import sys; assert sys.version_info[:2] == (3, 12)" 2>/dev/null; then
  rm -rf .whl/prebuilt
  "$PY312" -m pip wheel -q --no-deps -w .whl/prebuilt . ./backends/cuda
  ls -la .whl/prebuilt
else
  echo "no CPython 3.12 here ($PY312): .whl/prebuilt not built (run.sh then needs the GPU machine to build kvplane)"
fi
