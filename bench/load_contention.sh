#!/bin/bash
# load_contention.sh - the training step with the cores taken (issue 25, "Under load"): ampc-bench
# with libgomp's default wait policy, OMP_WAIT_POLICY=passive and GOMP_SPINCOUNT=10000, and the
# PyTorch peer (bench/pytorch_peer.py, as it runs by default), with 0 and then 3 busy loops beside
# them, alternating, twice. JSON per run in OUT (default /tmp/loadres); bench/RESULTS.md has the
# table.
#
#     bash bench/load_contention.sh [OUT]
cd "$(dirname "$0")/.."
B=./build/ampc-bench
OUT=${1:-/tmp/loadres}; mkdir -p "$OUT"
ampc() {  # tag env...
    local tag=$1; shift
    env "$@" $B --workloads mlp,cnn --modes fp32,amp-bf16 --steps 15 --warmup 3 --no-peak --json $OUT/$tag.json > $OUT/$tag.txt 2>&1
}
peer() {
    local tag=$1
    /usr/bin/python3 bench/pytorch_peer.py --workloads mlp,cnn --modes fp32,amp-bf16 --steps 15 --warmup 3 --json $OUT/$tag.json > $OUT/$tag.txt 2>&1
}
for load in 0 3; do
    pids=()
    for ((i = 0; i < load; i++)); do (while :; do :; done) & pids+=($!); done
    sleep 1
    for rep in 1 2; do
        ampc a_default_l${load}_r$rep
        peer p_l${load}_r$rep
        ampc a_passive_l${load}_r$rep OMP_WAIT_POLICY=passive
        ampc a_spin10k_l${load}_r$rep GOMP_SPINCOUNT=10000
    done
    for p in "${pids[@]}"; do kill $p; done
    wait 2>/dev/null
done
echo done
