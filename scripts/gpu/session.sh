#!/bin/bash
# One GPU lease's checks in one call, most important first, each step bounded so that the whole
# run ends inside BUDGET seconds (default 420); a step that no longer fits is skipped and says
# so. Every output goes under $OUT (the device tool brings back at most 8 files): session.log
# (all that is printed), the JSON of ampc-bench and of the PyTorch peer, the profile's CSV and
# JSON, the failed tests' output.
#
#     bash scripts/gpu/session.sh [STEPS]     STEPS: comma list, default all, in this order:
#       env       the GPU, the driver, the CPU's AMX flags
#       kernels   test_cl_kernels (the channels-last batch-norm and pooling kernels against REF)
#       bench     ampc-bench resnet50 amp-fp16,amp-bf16 batch 256, then the PyTorch peer (eager,
#                 cudnn.benchmark) on the same configs
#       profile   one resnet50 amp-fp16 step under Nsight Compute beside torch.profiler
#       tests     every test program (CUDA op checks; the CPU suite on this host's CPU)
#       e2e       tests/e2e_cuda.sh (Fashion-MNIST from $AMPC_FASHION_MNIST_DIR or .gpu/fashion-mnist)
#       benchall  every workload and mode of ampc-bench and the peer, torch.compile on resnet50
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/ampc-out}
export OUT
mkdir -p "$OUT"
BUDGET=${BUDGET:-420}
STEPS=,${1:-env,kernels,bench,profile,tests,e2e,benchall},
T0=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - T0))); }
R="bash scripts/gpu/run.sh"
[ -d .gpu/fashion-mnist ] && export AMPC_FASHION_MNIST_DIR=${AMPC_FASHION_MNIST_DIR:-$PWD/.gpu/fashion-mnist}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

# step NAME SECONDS_NEEDED COMMAND...: runs it with what is left of the budget as its limit
step() {
    local name=$1 need=$2 t
    shift 2
    case $STEPS in *,$name,*) ;; *) return ;; esac
    if [ "$(left)" -lt "$need" ]; then
        echo "== $name: skipped, $(left) s left of $BUDGET (needs ~$need)"
        return
    fi
    t=$(date +%s)
    echo "== $name ($(left) s left)"
    timeout $(($(left) - 3)) "$@"
    echo "== $name: exit $?, $(($(date +%s) - t)) s"
}

{
    date -u
    step env 5 $R env
    step env 5 sh -c 'grep -o -E "amx_[a-z0-9]+|avx512_fp16|avx512_bf16" /proc/cpuinfo | sort | uniq -c; nproc --all'
    step kernels 30 $R tests test_cl_kernels
    step bench 60 $R bench --device cuda --workloads resnet50 --modes amp-fp16,amp-bf16 --batch 256 --steps 10 --warmup 3 \
        --no-peak --json "$OUT/ampc_bench.json"
    step bench 60 $R peer --device cuda --workloads resnet50 --modes amp-fp16,amp-bf16 --batch 256 --channels-last yes \
        --steps 10 --warmup 3 --json "$OUT/peer.json"
    step profile 90 $R profile resnet50 amp-fp16 256
    step tests 120 $R tests
    step e2e 90 $R e2e
    step benchall 150 $R bench --device cuda --workloads mlp,cnn,resnet18,resnet50 --modes fp32,tf32,amp-bf16,amp-fp16 \
        --batch 256 --steps 10 --warmup 3 --json "$OUT/ampc_bench_all.json"
    step benchall 120 $R peer --device cuda --workloads mlp,cnn,resnet18,resnet50 --modes fp32,tf32,amp-bf16,amp-fp16 \
        --batch 256 --channels-last yes --steps 10 --warmup 3 --compile yes --json "$OUT/peer_all.json"
    date -u
} 2>&1 | tee "$OUT/session.log"
