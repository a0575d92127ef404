#!/usr/bin/env bash
# wait_policy.sh - the programs' OpenMP wait policy (tools/waitpolicy.h): with nothing set,
# ampc-bench runs again under GOMP_SPINCOUNT=10000 and says so; a policy the user set is kept and
# named; AMPC_KEEP_WAIT_POLICY=1 keeps libgomp's default. The re-executed program keeps its pid
# and arguments (its own JSON file is written where the first one was told).
#
#     bash tests/wait_policy.sh AMPC_BENCH
set -u
B=${1:?usage: wait_policy.sh AMPC_BENCH}
W=$(mktemp -d) && trap 'rm -rf "$W"' EXIT
bad=0
run() {   # expected-text env...
    local want=$1; shift
    if ! out=$(env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT -u AMPC_KEEP_WAIT_POLICY "$@" "$B" --workloads mlp --modes fp32 \
        --steps 1 --warmup 1 --no-peak --json "$W/out.json" 2>&1); then
        echo "FAIL: ampc-bench with $* exited non-zero: $(echo "$out" | tail -2)"; bad=1; return
    fi
    if ! echo "$out" | head -1 | grep -qF "wait policy $want"; then
        echo "FAIL: with '$*' expected 'wait policy $want' in: $(echo "$out" | head -1)"; bad=1; return
    fi
    if ! grep -qF "\"omp_wait_policy\": \"$want" "$W/out.json"; then
        echo "FAIL: the JSON of the run with '$*' does not name the policy: $(grep -o '"omp_wait_policy": "[^"]*"' "$W/out.json")"; bad=1
    fi
    rm -f "$W/out.json"
    echo "ok: $* -> $want"
}
run "GOMP_SPINCOUNT=10000 (ampc's default" AMPC_TEST_NOTHING_SET=1
run "OMP_WAIT_POLICY=passive (set by the user)" OMP_WAIT_POLICY=passive
run "GOMP_SPINCOUNT=300000 (set by the user)" GOMP_SPINCOUNT=300000
run "libgomp's default" AMPC_KEEP_WAIT_POLICY=1
exit $bad
