#!/bin/bash
# load_contention.sh - the training step with the cores taken (issue 25, "Under load"): ampc-bench
# with its default wait policy (GOMP_SPINCOUNT=10000, tools/waitpolicy.h), with libgomp's own
# default (AMPC_KEEP_WAIT_POLICY=1) and the PyTorch peer (bench/pytorch_peer.py, as it runs by
# default), with LOADS busy loops beside them (default "0 3", in that order), alternating, REPS
# times (default 2). JSON and text per run in OUT (default /tmp/loadres); bench/RESULTS.md has
# the tables.
#
#     [WORKLOADS=mlp,cnn] [MODES=fp32,amp-bf16] [STEPS=15] [LOADS="0 3"] [REPS=2] bash bench/load_contention.sh [OUT]
cd "$(dirname "$0")/.."
B=./build/ampc-bench
OUT=${1:-/tmp/loadres}; mkdir -p "$OUT"
W=${WORKLOADS:-mlp,cnn} M=${MODES:-fp32,amp-bf16} S=${STEPS:-15}
ampc() {  # tag env...
    local tag=$1; shift
    env "$@" $B --workloads $W --modes $M --steps $S --warmup 2 --no-peak --json $OUT/$tag.json > $OUT/$tag.txt 2>&1
}
peer() {
    /usr/bin/python3 bench/pytorch_peer.py --workloads $W --modes $M --steps $S --warmup 2 --json $OUT/$1.json > $OUT/$1.txt 2>&1
}
for load in ${LOADS:-0 3}; do
    pids=()
    for ((i = 0; i < load; i++)); do (while :; do :; done) & pids+=($!); done
    sleep 1
    for ((rep = 1; rep <= ${REPS:-2}; rep++)); do
        ampc a_spin10k_l${load}_r$rep
        peer p_l${load}_r$rep
        ampc a_gompdefault_l${load}_r$rep AMPC_KEEP_WAIT_POLICY=1
    done
    for p in "${pids[@]}"; do kill $p; done
    wait 2>/dev/null
done
echo done
