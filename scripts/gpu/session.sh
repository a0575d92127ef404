#!/bin/bash
# One GPU lease's checks in one call, most important first, each step bounded so that the whole
# run ends inside BUDGET seconds (default 560); a step that no longer fits is skipped and says
# so. Every output goes under $OUT (the device tool brings back at most 8 files): session.log
# (all that is printed), json.tar.gz (the JSON of each ampc-bench and PyTorch peer run), the
# profile's CSV and JSON, the failed tests' output.
#
#     bash scripts/gpu/session.sh [STEPS]     STEPS: comma list, default all, in this order:
#       env       the GPU, the driver, the CPU's AMX flags
#       kernels   test_cl_kernels, test_bn_relu (batch norm and pooling kernels against REF, the fusions
#                 against their composites, SyncBatchNorm's two-call kernels in a world of one)
#       dist      test_dist as 2 processes on the one GPU (the bundle's mpirun): SyncBatchNorm on CUDA
#                 against one process's batch norm, DDP's buckets on the GPU, ZeRO on CUDA
#       gpt       the transformer ops on CUDA against REF (test_transformer: attention, embedding, permute;
#                 their first run on a GPU), then ampc-bench's gpt (batch 16) and gpt2 (batch 8) in
#                 amp-bf16 beside the PyTorch peer (nanoGPT with F.scaled_dot_product_attention)
#       bench     ampc-bench resnet50 amp-fp16,amp-bf16 batch 256, then the PyTorch peer (eager,
#                 cudnn.benchmark) on the same configs; ampc without the batch norm + add + ReLU
#                 fusion (AMPC_CUDA_BN_ADD_RELU=0), then the default again
#       cudnn     (not by default) ampc-bench's resnet50 rows with --cudnn-benchmark yes, and the
#                 resnet18/resnet50 fp32 rows with it off and on
#       profile   one resnet50 amp-fp16 step under Nsight Compute beside torch.profiler
#       memory    the largest resnet50 batch whose step fits 16 GiB, fp32 and AMP (the seed's "double
#                 the batch")
#       benchall  every workload and mode of ampc-bench; the peer's resnet fp32 and tf32 rows (its
#                 mlp and cnn rows: bench/RESULTS.md, 2026-11-26)
#       tests     the test programs that run ops on CUDA ($TESTS: others)
#       e2e       tests/e2e_cuda.sh (Fashion-MNIST from $AMPC_FASHION_MNIST_DIR or .gpu/fashion-mnist)
#       train     ampc-train --device cuda on Fashion-MNIST (the cnn, bf16, batch 256): its samples/s
#                 and data wait as it is, with 2 loader workers, and with them and --pin-memory yes,
#                 beside ampc-bench's cnn step on the same batch
#       compile   the peer through torch.compile on resnet50 amp-fp16
#       cpusuite  every test program on the CPU alone (CUDA hidden), the GPU machine's Xeon with AMX
#       tensorboard  ampc-train's event files (a CPU run stopped, killed and resumed) read by the real
#                 TensorBoard's EventAccumulator (tests/tensorboard_accumulator.py; pip's tensorboard
#                 is on that machine, not in Debian)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/ampc-out}
export OUT
mkdir -p "$OUT"
BUDGET=${BUDGET:-560}
STEPS=,${1:-env,kernels,dist,gpt,bench,profile,tests,e2e,memory,benchall,train,tensorboard,cpusuite},   # also: cudnn, compile
J=$(mktemp -d)   # the JSON files, packed into $OUT/json.tar.gz at the end (the tool brings back 8 files)
T0=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - T0))); }
R="bash scripts/gpu/run.sh"
[ -d .gpu/fashion-mnist ] && export AMPC_FASHION_MNIST_DIR=${AMPC_FASHION_MNIST_DIR:-$PWD/.gpu/fashion-mnist}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

# step NAME SECONDS_NEEDED COMMAND...: runs it with what is left of the budget as its limit
step() {
    local name=$1 need=$2 t
    shift 2
    case $STEPS in *,$name,*) ;; *) return 1 ;; esac
    if [ "$(left)" -lt "$need" ]; then
        echo "== $name: skipped, $(left) s left of $BUDGET (needs ~$need)"
        return 1
    fi
    t=$(date +%s)
    echo "== $name ($(left) s left)"
    timeout $(($(left) - 3)) "$@"
    local rc=$?
    echo "== $name: exit $rc, $(($(date +%s) - t)) s"
    return $rc
}

{
    date -u
    step env 5 $R env
    step env 5 sh -c 'grep -o -E "amx_[a-z0-9]+|avx512_fp16|avx512_bf16" /proc/cpuinfo | sort | uniq -c; nproc --all'
    # the kernels of batch norm (the fused add + ReLU by default) and pooling
    step kernels 30 $R tests test_cl_kernels test_bn_relu
    step dist 60 $R dist 2
    step gpt 30 $R tests test_transformer test_ops
    for w in "gpt 16" "gpt2 8"; do
        set -- $w
        step gpt 20 $R bench --device cuda --workloads $1 --modes amp-bf16 --batch $2 --steps 10 --warmup 3 --no-peak \
            --json "$J/ampc_$1.json"
        step gpt 40 $R peer --device cuda --workloads $1 --modes amp-bf16 --batch $2 --steps 10 --warmup 3 --json "$J/peer_$1.json"
    done
    RN="--device cuda --workloads resnet50 --modes amp-fp16,amp-bf16 --batch 256 --steps 10 --warmup 3 --no-peak"
    step bench 30 $R bench $RN --json "$J/ampc_default.json"
    step bench 60 $R peer --device cuda --workloads resnet50 --modes amp-fp16,amp-bf16 --batch 256 --channels-last yes \
        --steps 10 --warmup 3 --json "$J/peer.json"
    step bench 30 env AMPC_CUDA_BN_ADD_RELU=0 $R bench $RN --json "$J/ampc_unfused.json"
    step bench 30 $R bench $RN --json "$J/ampc_default2.json"   # the default again: the run's drift
    step cudnn 40 $R bench $RN --cudnn-benchmark yes --json "$J/ampc_cudnn_benchmark.json"
    # the fp32 rows (TF32 off: 1.44-1.47x PyTorch's with cuDNN's heuristics) with the algorithms timed
    for cb in no yes; do
        step cudnn 40 $R bench --device cuda --workloads resnet18,resnet50 --modes fp32 --batch 256 --steps 10 --warmup 3 \
            --no-peak --cudnn-benchmark $cb --json "$J/ampc_fp32_cudnn_$cb.json"
    done
    step profile 60 $R profile resnet50 amp-fp16 256
    # the test programs that run ops on the GPU (the rest are the CPU suite, which CI runs)
    step tests 60 $R tests ${TESTS:-test_ops test_norm test_pool test_loss test_matmul test_conv test_conv_cl test_channels_last \
        test_gemm_skinny test_optim test_scaler test_autocast test_models test_train test_kept_casts test_dtype test_data}
    step e2e 90 $R e2e
    step memory 90 $R bench --device cuda --workloads resnet50 --modes fp32,amp-fp16 --max-memory 16G --largest-batch --no-peak
    step benchall 60 $R bench --device cuda --workloads mlp,cnn,resnet18,resnet50 --modes fp32,tf32,amp-bf16,amp-fp16 \
        --batch 256 --steps 10 --warmup 3 --no-peak --json "$J/ampc_all.json"
    step benchall 70 $R peer --device cuda --workloads resnet18,resnet50 --modes fp32,tf32 \
        --batch 256 --channels-last yes --steps 10 --warmup 3 --json "$J/peer_fp32.json"
    step train 40 $R train --device cuda --model cnn --epochs 2 --batch-size 256 --amp-dtype bf16 --progress off \
        --out /tmp/ampc-train-run --overwrite yes
    # the loader's workers, then its page-locked buffers and asynchronous uploads (--pin-memory)
    step train 30 $R train --device cuda --model cnn --epochs 2 --batch-size 256 --amp-dtype bf16 --progress off \
        --num-workers 2 --out /tmp/ampc-train-run2 --overwrite yes
    step train 30 $R train --device cuda --model cnn --epochs 2 --batch-size 256 --amp-dtype bf16 --progress off \
        --num-workers 2 --pin-memory yes --out /tmp/ampc-train-run3 --overwrite yes
    step train 20 $R bench --device cuda --workloads cnn --modes amp-bf16 --batch 256 --steps 50 --warmup 5 --no-peak
    step compile 100 $R peer --device cuda --workloads resnet50 --modes amp-fp16 --batch 256 --channels-last yes \
        --steps 10 --warmup 3 --compile yes
    step tensorboard 30 bash scripts/gpu/tensorboard_check.sh
    step cpusuite 150 env CUDA_VISIBLE_DEVICES= $R tests
    date -u
} 2>&1 | tee "$OUT/session.log"
tar -C "$J" -czf "$OUT/json.tar.gz" . 2>/dev/null
