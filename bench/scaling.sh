#!/usr/bin/env bash
# scaling.sh - data-parallel scaling of ampc's training step (issue 13): ampc-bench alone (one
# process) and under mpirun with 2 processes, each with the same per-process batch and one
# thread, on the same workloads and modes. Prints samples/s of both, the scaling efficiency
# (2-process samples/s over twice the 1-process figure) and the share of the step spent in
# communication not hidden behind backward (ampc_ddp_stats.exposed_seconds).
#
#     bash bench/scaling.sh [BUILD_DIR] [STEPS]        (default build, 20 steps)
#
# Needs a machine with at least 2 idle cores: both processes compute at once. Results go to
# bench/RESULTS.md by hand with the date and the load average printed here.
set -eu
B=${1:-build}
STEPS=${2:-20}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
echo "scaling: $(date -u +%Y-%m-%dT%H:%MZ), $(nproc --all) cores, load $(cut -d' ' -f1-3 /proc/loadavg), $STEPS steps"
printf "%-9s %-9s %7s %12s %12s %10s %14s\n" workload mode batch "1 proc s/s" "2 procs s/s" efficiency "exposed comm"
for w in mlp cnn resnet18; do
    for m in fp32 amp-bf16; do
        "$B/ampc-bench" --workloads "$w" --modes "$m" --steps "$STEPS" --threads 1 --no-peak --json "$T/1.json" >"$T/1.out" 2>&1
        mpirun --oversubscribe -np 2 --bind-to core "$B/ampc-bench" --workloads "$w" --modes "$m" --steps "$STEPS" --threads 1 \
            --no-peak --json "$T/2.json" >"$T/2.out" 2>&1
        python3 - "$T/1.json" "$T/2.json" "$w" "$m" <<'PY'
import json, sys
one = json.load(open(sys.argv[1]))["results"][0]
two = json.load(open(sys.argv[2]))["results"][0]
eff = two["samples_per_s"] / (2 * one["samples_per_s"])
exp = two["ddp_exposed_ms"] / two["ms_median"]
print(f"{sys.argv[3]:<9} {sys.argv[4]:<9} {one['batch']:>7} {one['samples_per_s']:>12.1f} {two['samples_per_s']:>12.1f} "
      f"{100 * eff:>9.1f}% {two['ddp_exposed_ms']:>8.2f} ms {100 * exp:4.1f}%")
PY
    done
done
echo "load at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
