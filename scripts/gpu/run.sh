#!/usr/bin/env bash
# The GPU run in one prepared call (docs/gpu.md).
#   scripts/gpu/run.sh OUT [--device cuda] [--quick] [--no-install] [--only PART]...
# Installs the carried wheels (scripts/gpu/wheels.txt, in .whl/) and kvplane with its cuda backend into a
# target folder (building the C extensions there), then runs python -m kvplane.bench.gpu_run, which writes
# OUT/report.md and OUT/report.json. The CPU twin in make test: --device cpu --quick --no-install.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR=${1:?usage: scripts/gpu/run.sh OUT [--device NAME] [--quick] [--no-install] [--only PART]}
shift
PYTHON=$(command -v "${PYTHON:-python3}") || { echo "no ${PYTHON:-python3} here"; exit 3; }
case "$PYTHON" in /*) ;; *) PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")" ;; esac  # a venv's link
SITE=${KVPLANE_SITE:-/tmp/kvplane-site}
INSTALL=1
ARGS=()
for a in "$@"; do
  if [ "$a" = "--no-install" ]; then INSTALL=0; else ARGS+=("$a"); fi
done
mkdir -p "$OUT_DIR"
if [ "$INSTALL" = 1 ]; then
  start=$(date +%s)
  {
    echo "===== install into $SITE"
    if compgen -G ".whl/*.whl" > /dev/null; then
      timeout 180 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl || exit 3
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    timeout 240 "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
      --target "$SITE" . ./backends/cuda || {
      echo "building kvplane here failed; installing the prebuilt wheels of .whl/prebuilt (fetch-wheels.sh)"
      timeout 120 "$PYTHON" -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target "$SITE" \
        .whl/prebuilt/*.whl
    } || exit 3
  } >> "$OUT_DIR/run.log" 2>&1 || { echo "install failed: see $OUT_DIR/run.log"; tail -30 "$OUT_DIR/run.log"; exit 3; }
  echo "install: ok in $(( $(date +%s) - start )) s"
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$SITE/bin:$PATH"
  cd /tmp  # import the installed kvplane (with its built extensions), not the source tree
fi
exec "$PYTHON" -m kvplane.bench.gpu_run --out "$(cd "$OLDPWD" 2>/dev/null; realpath -m "$OUT_DIR")" "${ARGS[@]}"
