#!/usr/bin/env bash
# largest_batch.sh - ampc-bench --largest-batch: under a --max-memory budget the batch it reports
# for each mode trains (a plain run at that batch succeeds under the same budget) and one sample
# more does not (that run fails as out of memory), and the reported peak is within the budget.
# Which mode fits more depends on the CPU (16-bit arithmetic or f32 emulation): not asserted here;
# bench/RESULTS.md records the ratio.
#
#     bash tests/largest_batch.sh AMPC_BENCH
set -u
B=${1:?usage: largest_batch.sh AMPC_BENCH}
W=$(mktemp -d) && trap 'rm -rf "$W"' EXIT
bad=0
if ! "$B" --workloads cnn --modes fp32,amp-bf16 --max-memory 48M --largest-batch --no-peak >"$W/out" 2>&1; then
    echo "FAIL: --largest-batch exited non-zero: $(tail -3 "$W/out")"; exit 1
fi
for mode in fp32 amp-bf16; do
    read -r b peak < <(awk -v m="$mode" '$1 == "cnn" && $2 == m { print $3, $NF }' "$W/out")
    if [ -z "${b:-}" ] || [ "$b" -lt 1 ]; then echo "FAIL: no batch for $mode: $(cat "$W/out")"; bad=1; continue; fi
    awk -v p="$peak" 'BEGIN { exit !(p <= 48.0) }' || { echo "FAIL: $mode peak $peak MiB over the 48 MiB budget"; bad=1; }
    if "$B" --workloads cnn --modes "$mode" --batch "$b" --max-memory 48M --steps 1 --warmup 1 --no-peak >"$W/fit" 2>&1; then
        echo "ok: cnn $mode batch $b trains under 48 MiB (peak $peak MiB)"
    else
        echo "FAIL: cnn $mode batch $b, reported to fit, failed: $(grep ampc-bench: "$W/fit" | tail -1)"; bad=1
    fi
    if "$B" --workloads cnn --modes "$mode" --batch $((b + 1)) --max-memory 48M --steps 1 --warmup 1 --no-peak >"$W/over" 2>&1; then
        echo "FAIL: cnn $mode batch $((b + 1)) fits too: $b is not the largest"; bad=1
    elif grep -q "out of memory" "$W/over"; then
        echo "ok: cnn $mode batch $((b + 1)) runs out of memory"
    else
        echo "FAIL: cnn $mode batch $((b + 1)) failed other than by memory: $(grep ampc-bench: "$W/over" | tail -1)"; bad=1
    fi
done
if "$B" --largest-batch --no-peak >"$W/none" 2>&1 || ! grep -q "needs --max-memory" "$W/none"; then
    echo "FAIL: --largest-batch without a budget: $(tail -1 "$W/none")"; bad=1
else
    echo "ok: --largest-batch without --max-memory is refused"
fi
exit $bad
