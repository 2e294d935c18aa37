#!/usr/bin/env bash
# `make test`'s run, in three parts: the main suite in the foreground, and beside it, one after the other in the
# background, tests/serve (live vLLM servers, mostly waiting on their starts) and tests/vllm on the second vLLM.
# The main suite leaves the cores idle much of its time (processes, networks, timeouts), so this takes about
# the main suite's time instead of the sum. The background parts' output is printed after the main suite's;
# the exit status is non-zero if any part failed. Usage: run-tests.sh PYTHON PYTHON_VLLM2
set -uo pipefail
py=$1 py2=$2
out=$(mktemp -d -t kvplane-test-XXXXXX)
(
    "$py" -m pytest -p no:cacheprovider tests/serve > "$out/serve.log" 2>&1
    echo $? > "$out/serve.rc"
    { "$py2" -c "import vllm; print(f'tests/vllm on vLLM {vllm.__version__}')" && \
        "$py2" -m pytest -p no:cacheprovider tests/vllm; } > "$out/vllm2.log" 2>&1
    echo $? > "$out/vllm2.rc"
) &
background=$!
"$py" -m pytest --ignore=tests/serve
main=$?
wait "$background"
status=$main
for part in serve vllm2; do
    echo
    echo "======== ${part}: $([ "$part" = serve ] && echo "tests/serve (live vllm serve, .venv-serve)" || \
        echo "tests/vllm on the second vLLM (.venv-vllm2)") ========"
    cat "$out/$part.log"
    rc=$(cat "$out/$part.rc" 2>/dev/null || echo 1)
    [ "$rc" = 0 ] || status=1
done
rm -rf "$out"
exit "$status"
