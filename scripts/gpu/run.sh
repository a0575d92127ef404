#!/bin/bash
# On a GPU machine, from the repository root: unpacks .gpu/bundle.tar.xz (scripts/gpu/pack.sh)
# into /tmp/ampc, finds CUDA's libraries (/usr/local/cuda, else the pip packages beside PyTorch)
# and runs the steps named: env, tests, train, e2e (tests/e2e_cuda.sh), bench ARGS..., peer ARGS...
# Everything it prints also goes to $OUT/gpu.log when $OUT is set.
set -uo pipefail
cd "$(dirname "$0")/../.."
mkdir -p /tmp/ampc && tar -C /tmp/ampc -xJf .gpu/bundle.tar.xz
BIN=/tmp/ampc/bin
libs=/tmp/ampc/lib
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib; do [ -d "$d" ] && libs="$libs:$d"; done
site=$(python3 -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null || true)
for d in "$site"/nvidia/*/lib; do [ -d "$d" ] && libs="$libs:$d"; done
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export AMPC_BIN=$BIN
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
        for p in $t; do
            start=$(date +%s.%N)
            if timeout 150 "$p" >/tmp/ampc/out.txt 2>&1; then r=ok; else r=FAIL; fails=$((fails + 1)); fi
            printf "%-28s %s (%s s)\n" "$(basename "$p")" "$r" "$(( $(date +%s) - ${start%.*} ))"
            grep -E 'NOTE|FAILED|ERROR|error|\[  FAIL' /tmp/ampc/out.txt | head -20
        done
    done
    echo "failed programs: $fails" ;;
train) "$BIN/ampc-train" "$@" ;;
e2e) bash tests/e2e_cuda.sh "$BIN/ampc-train" ;;
bench) "$BIN/ampc-bench" "$@" ;;
peer) python3 bench/pytorch_peer.py "$@" ;;
*) echo "unknown step $step"; exit 2 ;;
esac
