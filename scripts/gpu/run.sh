#!/bin/bash
# On a GPU machine, from the repository root: unpacks .gpu/bundle.tar.xz (scripts/gpu/pack.sh)
# into /tmp/ampc, finds CUDA's libraries (/usr/local/cuda, else the pip packages beside PyTorch)
# and runs the step named: env, tests [PROGRAMS...], dist [RANKS], train ARGS..., e2e (tests/e2e_cuda.sh),
# bench ARGS..., peer ARGS..., profile [WORKLOAD MODE BATCH]. scripts/gpu/session.sh runs them all
# within a time budget and keeps every output under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
# unpacked once per machine (again when the bundle is newer)
if [ ! -f /tmp/ampc/.unpacked ] || [ .gpu/bundle.tar.xz -nt /tmp/ampc/.unpacked ]; then
    mkdir -p /tmp/ampc && tar -C /tmp/ampc -xJf .gpu/bundle.tar.xz && touch /tmp/ampc/.unpacked
fi
BIN=/tmp/ampc/bin
libs=/tmp/ampc/lib
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib; do [ -d "$d" ] && libs="$libs:$d"; done
site=$(python3 -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null || true)
for d in "$site"/nvidia/*/lib; do [ -d "$d" ] && libs="$libs:$d"; done
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export AMPC_BIN=$BIN
# the bundle's Open MPI (pack.sh), relocated: its components, help texts and PMIx's plugins
if [ -x /tmp/ampc/ompi/bin/mpirun ]; then
    export PATH=/tmp/ampc/ompi/bin:$PATH OPAL_PREFIX=/tmp/ampc/ompi OPAL_LIBDIR=/tmp/ampc/lib
    export OPAL_PKGLIBDIR=/tmp/ampc/ompi/lib/openmpi3 PMIX_PREFIX=/tmp/ampc/ompi/pmix2
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
step=${1:-tests}
shift || true
case "$step" in
env)
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
    ls /usr/local/cuda/lib64 2>/dev/null | grep -E 'cudnn|cublasLt|cudart' | head
    ldd $BIN/test_ops | grep -E 'not found|cuda|cublas|cudnn' ;;
tests)
    fails=0
    for t in "${@:-$BIN/test_*}"; do
        case $t in /*) ;; *) t=$BIN/$t ;; esac   # a bare name: the bundle's program
        for p in $t; do
            start=$(date +%s.%N)
            if timeout 150 "$p" >/tmp/ampc/out.txt 2>&1; then r=ok; else r=FAIL; fails=$((fails + 1)); fi
            printf "%-28s %s (%s s)\n" "$(basename "$p")" "$r" "$(( $(date +%s) - ${start%.*} ))"
            grep -E 'NOTE|FAILED|ERROR|error|\[  FAIL' /tmp/ampc/out.txt | head -20
            if [ $r = FAIL ] && [ -n "${OUT:-}" ]; then { echo "=== $p"; tail -80 /tmp/ampc/out.txt; } >>"$OUT/tests_failed.log"; fi
        done
    done
    echo "failed programs: $fails"
    [ "$fails" -eq 0 ] ;;
dist)
    # several processes on the one GPU (the bundle's mpirun): test_dist as 2 ranks, its CUDA cases
    # (SyncBatchNorm's kernels, DDP's buckets on the GPU through page-locked staging, ZeRO) with them
    command -v mpirun >/dev/null || { echo "dist: no mpirun (pack.sh found no Open MPI to bundle)"; exit 1; }
    timeout 240 mpirun --oversubscribe --bind-to none -np "${1:-2}" "$BIN/test_dist" >/tmp/ampc/dist.txt 2>&1
    rc=$?
    grep -E -i "cuda|skipped|FAIL|ERROR|PASSED|rank [0-9]:" /tmp/ampc/dist.txt | head -40
    if [ $rc -ne 0 ] && [ -n "${OUT:-}" ]; then tail -80 /tmp/ampc/dist.txt >"$OUT/dist_failed.log"; fi
    # and ampc-train itself: resnet18 with SyncBatchNorm, the ranks on the one GPU
    timeout 120 mpirun --oversubscribe --bind-to none -np "${1:-2}" "$BIN/ampc-train" --device cuda --model resnet18 --sync-bn yes \
        --amp-dtype bf16 --limit-train 2048 --limit-val 512 --batch-size 64 --epochs 1 --progress off \
        --out /tmp/ampc-dist-run --overwrite yes >/tmp/ampc/dist_train.txt 2>&1
    rc2=$?
    grep -E "sync-bn|final:|error" /tmp/ampc/dist_train.txt | head -8
    if [ $rc2 -ne 0 ] && [ -n "${OUT:-}" ]; then tail -40 /tmp/ampc/dist_train.txt >>"$OUT/dist_failed.log"; fi
    [ $rc -eq 0 ] && [ $rc2 -eq 0 ] ;;
train) "$BIN/ampc-train" "$@" ;;
e2e) bash tests/e2e_cuda.sh "$BIN/ampc-train" ;;
bench) "$BIN/ampc-bench" "$@" ;;
peer) python3 bench/pytorch_peer.py "$@" ;;
profile)
    # One training step's kernels timed by Nsight Compute (one metric, clock control off: the
    # clocks as a run has them), the one timed step after 5 warm-up steps of ampc-bench, grouped by op
    # family beside torch.profiler's table for the same model (bench/profile_step.py).
    w=${1:-resnet50} m=${2:-amp-fp16} b=${3:-256}
    dir=${OUT:-/tmp/ampc}
    NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    [ -n "$NCU" ] || { echo "profile: ncu not found"; exit 1; }
    AMPC_BENCH_CUDA_PROFILE_STEP=1 "$NCU" --csv --print-units base --metrics gpu__time_duration.sum --clock-control none \
        --profile-from-start off \
        "$BIN/ampc-bench" --device cuda --workloads "$w" --modes "$m" --batch "$b" --warmup 5 --steps 1 --no-peak \
        >"$dir/ncu_${w}_${m}.csv" 2>/tmp/ampc/ncu.err || { tail -5 /tmp/ampc/ncu.err; exit 1; }
    python3 bench/profile_step.py --ncu-csv "$dir/ncu_${w}_${m}.csv" --workload "$w" --mode "$m" --batch "$b" \
        --json "$dir/profile_${w}_${m}.json" ;;
*) echo "unknown step $step"; exit 2 ;;
esac
