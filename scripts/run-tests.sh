#!/usr/bin/env bash
# `make test`'s run, in four parts: the main suite in the foreground, and beside it, one after the other in the
# background, tests/serve (live vLLM servers, mostly waiting on their starts), tests/vllm on the second vLLM and
# tests/netns (faults between network namespaces, mostly waiting on timeouts). The main suite leaves the cores idle
# much of its time (processes, networks, timeouts), so this takes about the longer lane's time instead of the sum
# (2026-11-28, 2 cores: main about 17 min, the background about 13). The background parts' output is printed after
# the main suite's; the exit status is non-zero if any part failed. Usage: run-tests.sh PYTHON PYTHON_VLLM2
set -uo pipefail
py=$1 py2=$2
out=$(mktemp -d -t kvplane-test-XXXXXX)
(
    "$py" -m pytest -p no:cacheprovider tests/serve > "$out/serve.log" 2>&1
    echo $? > "$out/serve.rc"
    { "$py2" -c "import vllm; print(f'tests/vllm on vLLM {vllm.__version__}')" && \
        "$py2" -m pytest -p no:cacheprovider tests/vllm; } > "$out/vllm2.log" 2>&1
    echo $? > "$out/vllm2.rc"
    "$py" -m pytest -p no:cacheprovider tests/netns > "$out/netns.log" 2>&1
    echo $? > "$out/netns.rc"
) &
background=$!
"$py" -m pytest --ignore=tests/serve --ignore=tests/netns
main=$?
wait "$background"
status=$main
for part in serve vllm2 netns; do
    case $part in
        serve) what="tests/serve (live vllm serve, .venv-serve)" ;;
        vllm2) what="tests/vllm on the second vLLM (.venv-vllm2)" ;;
        netns) what="tests/netns (network namespaces)" ;;
    esac
    echo
    echo "======== ${part}: ${what} ========"
    cat "$out/$part.log"
    rc=$(cat "$out/$part.rc" 2>/dev/null || echo 1)
    [ "$rc" = 0 ] || status=1
done
rm -rf "$out"
exit "$status"
