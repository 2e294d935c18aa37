#!/usr/bin/env bash
# `make test`'s run, in six parts: the main suite in the foreground, and beside it, one after the other in the
# background, tests/serve (live vLLM servers, mostly waiting on their starts), tests/vllm on the second vLLM,
# tests/sglang in SGLang's venv, tests/netns (faults between network namespaces, mostly waiting on timeouts), then
# ruff and strict mypy. The main suite leaves the cores idle much of its time (processes, networks, timeouts), so
# this takes about the longer lane's time instead of the sum (2026-11-28, 2 cores: main about 17 min, the
# background about 13). The background parts' output is printed after the main suite's; the exit status is
# non-zero if any part failed. Usage: run-tests.sh PYTHON PYTHON_VLLM2 PYTHON_SGLANG
set -uo pipefail
py=$1 py2=$2 py4=$3
out=$(mktemp -d -t kvplane-test-XXXXXX)
(
    "$py" -m pytest -p no:cacheprovider tests/serve > "$out/serve.log" 2>&1
    echo $? > "$out/serve.rc"
    { "$py2" -c "import vllm; print(f'tests/vllm on vLLM {vllm.__version__}')" && \
        "$py2" -m pytest -p no:cacheprovider tests/vllm; } > "$out/vllm2.log" 2>&1
    echo $? > "$out/vllm2.rc"
    "$py4" -m pytest -p no:cacheprovider tests/sglang > "$out/sglang.log" 2>&1
    echo $? > "$out/sglang.rc"
    "$py" -m pytest -p no:cacheprovider tests/netns > "$out/netns.log" 2>&1
    echo $? > "$out/netns.rc"
    { "$py" -m ruff check kvplane backends tests examples scripts && "$py" -m mypy; } > "$out/lint.log" 2>&1
    echo $? > "$out/lint.rc"
) &
background=$!
"$py" -m pytest --ignore=tests/serve --ignore=tests/netns --ignore=tests/sglang
main=$?
wait "$background"
status=$main
for part in serve vllm2 sglang netns lint; do
    case $part in
        serve) what="tests/serve (live vllm serve, .venv-serve)" ;;
        vllm2) what="tests/vllm on the second vLLM (.venv-vllm2)" ;;
        sglang) what="tests/sglang on SGLang (.venv-sglang)" ;;
        netns) what="tests/netns (network namespaces)" ;;
        lint) what="ruff and strict mypy (kvplane and the backends)" ;;
    esac
    echo
    echo "======== ${part}: ${what} ========"
    cat "$out/$part.log"
    rc=$(cat "$out/$part.rc" 2>/dev/null || echo 1)
    [ "$rc" = 0 ] || status=1
done
rm -rf "$out"
exit "$status"
