#!/usr/bin/env bash
# Download the wheels of scripts/gpu/wheels.txt into .whl/ for the GPU machine (Python 3.12, x86_64): about
# 61 MB, within the 64 MiB a device call carries with the tree. .whl/ is git-ignored.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
grep -v '^#' scripts/gpu/wheels.txt | xargs python3 -m pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl
ls -la .whl
