#!/usr/bin/env bash
# bench_json.sh - `ampc-bench --json FILE` writes JSON that jansson reads back
# (tests/check_bench_json.c): the keys of a short mlp run, and a failed config whose error holds
# quotes, backslashes, a tab and newlines (AMPC_BENCH_FAIL, a hook for this test) comes back as
# the very same text, in a document that still parses.
#
#     bash tests/bench_json.sh BUILD/ampc-bench BUILD/check_bench_json
set -u
BENCH=${1:?usage: bench_json.sh AMPC_BENCH CHECK_BENCH_JSON}
CHECK=${2:?usage: bench_json.sh AMPC_BENCH CHECK_BENCH_JSON}
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
FAILS=0
ARGS=(--workloads mlp --modes fp32 --steps 2 --warmup 1 --no-peak)

if "$BENCH" "${ARGS[@]}" --json "$W/ok.json" >"$W/ok.out" 2>&1 && "$CHECK" "$W/ok.json" ok 2; then
    echo "ok: the JSON of a run parses, with its keys"
else
    echo "FAIL: the JSON of a run"; sed 's/^/    /' "$W/ok.out" | tail -5; FAILS=$((FAILS + 1))
fi

TEXT=$'say "hi" to C:\\path\\ and\ta tab\nsecond line {"not": json}\n'
AMPC_BENCH_FAIL=$TEXT "$BENCH" "${ARGS[@]}" --json "$W/err.json" >"$W/err.out" 2>&1
rc=$?
if [ $rc -eq 1 ] && "$CHECK" "$W/err.json" error "$TEXT"; then
    echo "ok: a failed config: ok false, its error text exact"
else
    echo "FAIL: a failed config (exit $rc, want 1)"; sed 's/^/    /' "$W/err.out" | tail -5; FAILS=$((FAILS + 1))
fi
echo "bench_json: $FAILS failure(s)"
[ "$FAILS" -eq 0 ]
