#!/usr/bin/env bash
# e2e_robust.sh - ampc-train against hostile input and interruptions: FIFOs given as inputs are
# refused at once, splits of another shape than the training data are caught before training,
# diverging runs (fp32, bf16, fp16 with a GradScaler) stop with exit 3 and leave the last good
# checkpoint untouched, out-of-range checkpoint values are refused, and SIGINT/SIGTERM save a
# checkpoint that resumes to the bits of an uninterrupted run.
#
#     bash tests/e2e_robust.sh BUILD/ampc-train
#
# Skipped (exit 0) only when the Fashion-MNIST files are missing. Every run uses a few hundred
# samples; every command that could hang runs under `timeout`, so a regression fails, never hangs.
set -u
TRAIN=${1:?usage: e2e_robust.sh AMPC_TRAIN}
. "$(dirname "$0")/e2e_lib.sh" e2e_robust
LIMIT=${E2E_TIMEOUT:-120}   # seconds any one command may take before it counts as hung
SMALL=(--limit-train 256 --limit-val 64 --batch-size 32 --progress off)

# expect STATUS NAME PATTERN ARGS...: exit status STATUS, one "ampc-train: error: " (or, for
# 130/143, "ampc-train: interrupted by ") line on stderr matching PATTERN, no sanitizer report.
expect() {
    local want=$1 name=$2 pattern=$3
    shift 3
    timeout -k 5 "$LIMIT" "$TRAIN" "$@" >"$W/$name.out" 2>"$W/$name.err"
    local rc=$? tag='ampc-train: error: '
    [ "$want" -ge 128 ] && tag='ampc-train: interrupted by '
    local n
    n=$(grep -c "^$tag" "$W/$name.err")
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then   # 137: blocked where SIGTERM only asks to stop at the next step
        bad "$name: hung (killed after $LIMIT s): $*"
    elif [ "$want" -eq 0 ] && [ $rc -eq 0 ]; then
        ok "$name: exit 0"
        return 0
    elif [ $rc -ne "$want" ]; then
        bad "$name: exit $rc (want $want): $*"
        sed 's/^/    /' "$W/$name.err" | tail -5
    elif [ "$n" -ne 1 ]; then
        bad "$name: $n '$tag' lines (want 1)"
    elif ! grep "^$tag" "$W/$name.err" | grep -qiE -- "$pattern"; then
        bad "$name: the line does not match /$pattern/: $(grep "^$tag" "$W/$name.err")"
    elif grep -qE 'Sanitizer|runtime error' "$W/$name.err"; then
        bad "$name: sanitizer report"
    else
        ok "$name: $(grep "^$tag" "$W/$name.err")"
        return 0
    fi
    return 1
}

# Perl (part of every Debian system) edits a safetensors header: FILE OUT REGEX REPLACEMENT.
edit_header() {
    perl -e 'open(F, "<:raw", $ARGV[0]) or die; local $/; my $d = <F>; my $n = unpack("Q<", substr($d, 0, 8));
             my ($h, $b) = (substr($d, 8, $n), substr($d, 8 + $n)); $h =~ s/$ARGV[2]/$ARGV[3]/ or die "no match\n";
             open(O, ">:raw", $ARGV[1]) or die; print O pack("Q<", length $h) . $h . $b' "$@"
}

# IDX files: images N ROWS COLS (random pixels) and labels N (0..9), big-endian headers.
be32() { printf "\\x$(printf %02x $(($1 >> 24 & 255)))\\x$(printf %02x $(($1 >> 16 & 255)))\\x$(printf %02x $(($1 >> 8 & 255)))\\x$(printf %02x $(($1 & 255)))"; }
idx_images() { { printf '\x00\x00\x08\x03'; be32 "$2"; be32 "$3"; be32 "$4"; head -c $(($2 * $3 * $4)) /dev/urandom; } >"$1"; }
idx_labels() {
    { printf '\x00\x00\x08\x01'; be32 "$2"; for ((i = 0; i < $2; i++)); do printf "\\x0$((i % 10))"; done; } >"$1"
}

# ---------------------------------------------------------------------------------------------
# The cases of issue 25 (an independent probe), as functions so that each group runs alone:
#     E2E_CASES="outputs guard" bash tests/e2e_robust.sh BUILD/ampc-train
# Without E2E_CASES every group runs, after the sections below.
CASES="outputs utf8 guard inputs limits resume_lr"
QN=(--limit-train 64 --limit-val 32 --batch-size 32 --progress off)   # 2 steps an epoch: a second or so
Q=(--model mlp --epochs 1 "${QN[@]}")

# a fp32 mlp's files in $W/base (checkpoint and model), made once for the cases that need one
base() {
    [ -s "$W/base/checkpoint.safetensors" ] || timeout "$LIMIT" "$TRAIN" "${Q[@]}" --use-amp no --out "$W/base" >/dev/null 2>&1 ||
        bad "the base run failed"
}

# Outputs in --out are created without blocking and without following a link planted there; one
# --out is one run's (a lock file)
case_outputs() {
    echo outside >"$W/victim"
    local d f
    # written in place: a link there is refused (each in a folder of its own)
    for f in metrics.csv steps.csv numerics.csv ampc-train.lock; do
        d="$W/link_$f"
        mkdir -p "$d"
        ln -s "$W/victim" "$d/$f"
        expect 1 "link_$f" "'$d/$f' is a symbolic link" "${Q[@]}" --step-log yes --numerics-every 1 --out "$d"
    done
    # replaced by rename, never written through: the link goes, the file it named stays
    d="$W/link_renamed"
    mkdir -p "$d"
    for f in loss.png accuracy.png scale.png checkpoint.safetensors model.safetensors; do ln -s "$W/victim" "$d/$f"; done
    expect 0 link_renamed '' "${Q[@]}" --step-log yes --amp-dtype fp16 --out "$d"
    [ "$(cat "$W/victim")" = outside ] && [ ! -L "$d/loss.png" ] && [ ! -L "$d/checkpoint.safetensors" ] &&
        ok "links planted in --out: refused or replaced, the file outside never written" || bad "links: $W/victim was written"
    # FIFOs: refused at once (numerics.csv at the end of the run; steps.csv on resume, when read back)
    d="$W/out_fifo"
    mkdir -p "$d"
    mkfifo "$d/numerics.csv"
    expect 1 fifo_numerics "numerics.csv' is a FIFO" "${Q[@]}" --numerics-every 1 --out "$d"
    rm "$d/numerics.csv"
    if timeout "$LIMIT" "$TRAIN" "${Q[@]}" --step-log yes --out "$d" --overwrite yes >/dev/null 2>&1; then
        rm "$d/steps.csv"
        mkfifo "$d/steps.csv"
        expect 1 fifo_steps_resume "steps.csv' is a FIFO" --resume "$d/checkpoint.safetensors" --epochs 2
    else
        bad "fifo_steps_resume: the first run failed"
    fi
    # two runs, one --out: the second names the holder of the lock (flock(1) holds it here)
    d="$W/out_lock"
    mkdir -p "$d"
    echo 4242 >"$d/ampc-train.lock"
    # one process holds the lock (flock(1) would leave its command holding it once killed)
    : >"$W/holder.out"
    perl -e 'use Fcntl ":flock"; open(F, ">>", $ARGV[0]) or die; flock(F, LOCK_EX) or die; $| = 1; print "held\n"; sleep 60' \
        "$d/ampc-train.lock" >"$W/holder.out" &
    local holder=$!
    for ((t = 0; t < 100; t++)); do grep -q held "$W/holder.out" && break; sleep 0.1; done
    expect 1 lock_held "--out '$d' is in use: another ampc-train \(pid 4242\) holds $d/ampc-train.lock" "${Q[@]}" --out "$d"
    [ ! -e "$d/metrics.csv" ] || bad "lock_held: the second run wrote metrics.csv"
    kill "$holder"
    wait "$holder" 2>/dev/null
    expect 0 lock_free '' "${Q[@]}" --out "$d"
    [ "$(cat "$d/ampc-train.lock")" != 4242 ] && ok "lock: taken once free, with the run's pid" || bad "lock: the pid was not written"
}

# What the checkpoint's metadata records must be UTF-8: refused on the command line, naming the flag
case_utf8() {
    expect 2 utf8_out '--out is not valid UTF-8' "${Q[@]}" --out "$W/bad"$'\xff'
    mkdir -p "$W/data"$'\xfe'
    expect 2 utf8_data '--data is not valid UTF-8' "${Q[@]}" --data "$W/data"$'\xfe' --out "$W/x"
    [ ! -e "$W/bad"$'\xff' ] && ! grep -q '^epoch' "$W/utf8_out.out" && ok "utf8: refused before any training" ||
        bad "utf8: trained or created --out"
}

# Guard rails: an fp16 epoch whose steps were all skipped (fewer than --max-skipped-steps) stops as
# diverged; a NaN validation loss is a divergence that keeps the last good checkpoint
case_guard() {
    base
    if set_tensor "$W/base/model.safetensors" "$W/big.safetensors" 3.bias 1e5; then   # overflows fp16 in every forward
        expect 3 all_skipped 'in epoch 1: the grad scaler skipped all 2 optimizer step\(s\) of the epoch .*not one was applied.*Remedies:' \
            "${Q[@]}" --amp-dtype fp16 --pretrained "$W/big.safetensors" --out "$W/allsk"
    fi
    # IDX data: black training images, white validation ones; the first Linear's weights 1e38 make
    # -inf for black (ReLU: 0, training goes on) and +inf for white: NaN in validation only
    local d="$W/bw"
    mkdir -p "$d"
    { printf '\x00\x00\x08\x03'; be32 64; be32 28; be32 28; head -c $((64 * 784)) /dev/zero; } >"$d/train-images-idx3-ubyte"
    idx_labels "$d/train-labels-idx1-ubyte" 64
    { printf '\x00\x00\x08\x03'; be32 32; be32 28; be32 28; head -c $((32 * 784)) /dev/zero | tr '\0' '\377'; } >"$d/t10k-images-idx3-ubyte"
    idx_labels "$d/t10k-labels-idx1-ubyte" 32
    if timeout "$LIMIT" "$TRAIN" "${Q[@]}" --data "$d" --use-amp no --out "$W/nanval" >/dev/null 2>&1 &&
        set_tensor "$W/nanval/checkpoint.safetensors" "$W/nanval/edited" 1.weight 1e38 &&
        mv "$W/nanval/edited" "$W/nanval/checkpoint.safetensors"; then
        cp "$W/nanval/checkpoint.safetensors" "$W/nanval.good"
        expect 3 nan_val "in epoch 2: the validation loss is -?nan; stopped without saving: the last good checkpoint is $W/nanval/checkpoint.safetensors \(after epoch 1\)" \
            --resume "$W/nanval/checkpoint.safetensors" --epochs 2
        cmp -s "$W/nanval.good" "$W/nanval/checkpoint.safetensors" && ok "nan_val: the good checkpoint is unchanged" ||
            bad "nan_val: the checkpoint was replaced"
    else
        bad "nan_val: no checkpoint to edit"
    fi
}

# Inputs accepted silently before: a t10k set that is a FIFO, --pretrained matching nothing,
# --pretrained with --resume
case_inputs() {
    local d="$W/t10kfifo"
    mkdir -p "$d"
    idx_images "$d/train-images-idx3-ubyte" 64 28 28
    idx_labels "$d/train-labels-idx1-ubyte" 64
    [ -p "$W/fifo" ] || mkfifo "$W/fifo"
    ln -s "$W/fifo" "$d/t10k-images-idx3-ubyte"   # a link to a FIFO: refused by name, not taken for absent
    idx_labels "$d/t10k-labels-idx1-ubyte" 64
    expect 1 fifo_t10k "t10k-images-idx3-ubyte' is a FIFO" --data "$d" "${Q[@]}" --out "$W/x"
    grep -q 'held-out split' "$W/fifo_t10k.out" && bad "fifo_t10k: validation became a split of the training data"
    base
    expect 1 pretrained_none "--pretrained '$W/base/model.safetensors': none of its tensors matched the model's" \
        "${QN[@]}" --model cnn --epochs 1 --pretrained "$W/base/model.safetensors" --pretrained-strict no --out "$W/x"
    expect 2 pretrained_resume '--pretrained starts a new run.*--resume continues' \
        --resume "$W/base/checkpoint.safetensors" --pretrained "$W/base/model.safetensors" --epochs 2 --out "$W/x"
    [ ! -e "$W/x" ] || bad "inputs: a refused run left an output folder"
}

# Limits: $OMP_NUM_THREADS gets --threads' bound (libgomp crashed on 100000); --lr-step-size is range-checked
case_limits() {
    OMP_NUM_THREADS=100000 expect 1 omp_threads 'OMP_NUM_THREADS=100000 is more threads than the 1024' "${Q[@]}" --out "$W/x"
    expect 2 lr_step_size '--lr-step-size takes an integer in \[1, 1000000000\]' "${Q[@]}" --lr-schedule step --lr-step-size 9e18 --out "$W/x"
    expect 2 lr_step_size_big '--lr-step-size takes an integer' "${Q[@]}" --lr-schedule step --lr-step-size 9000000000000000000 --out "$W/x"
    expect 0 lr_step_size_max '' "${Q[@]}" --lr-schedule step --lr-step-size 1000000000 --out "$W/lrss"
}

# --lr given on --resume applies (the guard rails' "lower --lr" remedy): two resumes of copies of
# one checkpoint, one with --lr 0.5, end different; without --lr, the bits of one uninterrupted
# run (the signal cases below check that too)
case_resume_lr() {
    base
    mkdir -p "$W/rl_a" "$W/rl_b"
    cp "$W/base/checkpoint.safetensors" "$W/rl_a/"
    cp "$W/base/checkpoint.safetensors" "$W/rl_b/"
    if timeout "$LIMIT" "$TRAIN" --resume "$W/rl_a/checkpoint.safetensors" --epochs 2 >"$W/rl_a.out" 2>&1 &&
        timeout "$LIMIT" "$TRAIN" --resume "$W/rl_b/checkpoint.safetensors" --epochs 2 --lr 0.5 >"$W/rl_b.out" 2>&1 &&
        timeout "$LIMIT" "$TRAIN" --model mlp "${QN[@]}" --use-amp no --epochs 2 --out "$W/rl_ref" >/dev/null 2>&1; then
        "$TRAIN" --compare-checkpoints "$W/rl_a/checkpoint.safetensors" "$W/rl_b/checkpoint.safetensors" >"$W/rl.cmp"
        local rc=$?
        [ $rc -eq 1 ] && grep -q '^note: changed on resume: --lr 0.5 (was 0.001)' "$W/rl_b.out" &&
            ok "resume --lr 0.5 applies: $(tail -1 "$W/rl.cmp")" || bad "resume --lr 0.5: compare exit $rc: $(tail -1 "$W/rl.cmp")"
        "$TRAIN" --compare-checkpoints "$W/rl_ref/checkpoint.safetensors" "$W/rl_a/checkpoint.safetensors" >"$W/rl_ref.cmp" &&
            ok "resume without --lr == uninterrupted: $(tail -1 "$W/rl_ref.cmp")" || bad "resume without --lr: $(tail -1 "$W/rl_ref.cmp")"
    else
        bad "resume --lr: a run failed: $(tail -n 1 "$W/rl_a.out" "$W/rl_b.out" | tr '\n' ' ')"
    fi
}

if [ -n "${E2E_CASES:-}" ]; then
    for c in $E2E_CASES; do "case_$c"; done
    echo "e2e_robust: $FAILS failure(s) in $((SECONDS - T0)) s"
    [ "$FAILS" -eq 0 ]
    exit
fi

# ---------------------------------------------------------------------------------------------
# FIFOs (and other non-regular files) given as inputs are refused at once, never opened blocking
mkfifo "$W/fifo"
expect 1 fifo_resume 'FIFO|not a regular file' --resume "$W/fifo" --out "$W/x"
expect 2 fifo_compare 'FIFO|not a regular file' --compare-checkpoints "$W/fifo" "$W/fifo"
mkdir -p "$W/img/a" "$W/img/b"
expect 1 fifo_index_csv 'FIFO|not a regular file' --data "$W/img" --index-csv "$W/fifo" --epochs 1 --out "$W/x"
mkdir -p "$W/outfifo"   # an output name taken by a FIFO: writing it would block too
mkfifo "$W/outfifo/metrics.csv"
expect 1 fifo_metrics 'metrics.*FIFO' --model mlp "${SMALL[@]}" --epochs 1 --out "$W/outfifo"
mkdir -p "$W/idxfifo"
idx_images "$W/idxfifo/train-images-idx3-ubyte" 64 28 28
mkfifo "$W/idxfifo/train-labels-idx1-ubyte"   # preferred to a .gz of the same name: opened, and refused
expect 1 fifo_idx 'train-labels-idx1-ubyte.*(FIFO|not a regular file)' --data "$W/idxfifo" --model mlp --epochs 1 "${SMALL[@]}" --out "$W/x"
rm "$W/idxfifo/train-labels-idx1-ubyte"

# ---------------------------------------------------------------------------------------------
# Every split has the training data's shape, checked before training
mkdir -p "$W/shape"
idx_images "$W/shape/train-images-idx3-ubyte" 64 28 28
idx_labels "$W/shape/train-labels-idx1-ubyte" 64
idx_images "$W/shape/t10k-images-idx3-ubyte" 32 14 56
idx_labels "$W/shape/t10k-labels-idx1-ubyte" 32
for m in mlp cnn; do
    expect 1 "shape_$m" 'validation images \(t10k test set\) are 1x14x56 but the training images are 1x28x28' \
        --data "$W/shape" --model $m --epochs 1 "${SMALL[@]}" --out "$W/x"
    grep -q '^epoch' "$W/shape_$m.out" && bad "shape_$m: trained before the check"
done

# ---------------------------------------------------------------------------------------------
# A CPU without bf16 kernels (oneDNN limited to AVX2, as on older CPUs): the default picks fp16
# autocast with a GradScaler and trains; asking for bf16 says why not and what to use
if ONEDNN_MAX_CPU_ISA=AVX2 timeout "$LIMIT" "$TRAIN" --model mlp "${SMALL[@]}" --epochs 1 --out "$W/avx2" >"$W/avx2.out" 2>"$W/avx2.err"; then
    grep -qE '^  amp-dtype +fp16$' "$W/avx2.out" && grep -qE '^  grad-scaler +yes$' "$W/avx2.out" &&
        ok "AVX2 only: the default is fp16 autocast with a GradScaler, and it trains" ||
        bad "AVX2 only: $(grep -E 'amp-dtype|grad-scaler' "$W/avx2.out" | tr '\n' ' ')"
else
    bad "AVX2 only: the default run failed: $(tail -1 "$W/avx2.err")"
fi
# plain AVX-512 (no AVX512-BF16): bf16 works but emulated, several times slower than fp32, so the
# default is fp16 (with a note); asking for bf16 trains, with a warning
ONEDNN_MAX_CPU_ISA=AVX512_CORE expect 0 avx512_default '' --model mlp "${SMALL[@]}" --epochs 1 --out "$W/a512"
grep -qE '^  amp-dtype +fp16$' "$W/avx512_default.out" && grep -q '^note: --amp-dtype fp16, since this CPU has no bf16 arithmetic' "$W/avx512_default.out" &&
    ok "AVX-512 without BF16: the default is fp16, with a note" || bad "AVX-512 without BF16: $(grep -E 'amp-dtype|note' "$W/avx512_default.out" | tr '\n' ' ')"
ONEDNN_MAX_CPU_ISA=AVX512_CORE expect 0 avx512_bf16 '' --model mlp "${SMALL[@]}" --epochs 1 --amp-dtype bf16 --out "$W/b512"
grep -q 'warning: bf16 is emulated on this CPU' "$W/avx512_bf16.err" && ok "AVX-512 without BF16: --amp-dtype bf16 trains, with a warning" ||
    bad "AVX-512 without BF16: no emulation warning"
ONEDNN_MAX_CPU_ISA=AVX2 expect 1 avx2_bf16 'amp-dtype bf16: this CPU has no bf16 kernels.*use --amp-dtype fp16' \
    --model mlp "${SMALL[@]}" --amp-dtype bf16 --epochs 1 --out "$W/x"

# ---------------------------------------------------------------------------------------------
# Out of memory under --max-memory: the message names what took the memory and the largest batch
# that fits, measured; that batch does fit, and optimizer state that alone does not fit is named
MEM=(--limit-train 256 --limit-val 64 --epochs 1 --max-memory 44M --progress off --use-amp no)
if expect 1 oom_advice 'largest batch that fits is [0-9]+ \(--batch-size [0-9]+, measured\)' "${MEM[@]}" --batch-size 64 --out "$W/oom1"; then
    fit=$(grep -oE 'fits is [0-9]+ \(--batch-size' "$W/oom_advice.err" | grep -oE '[0-9]+')
    timeout "$LIMIT" "$TRAIN" "${MEM[@]}" --batch-size "$fit" --out "$W/fit" >/dev/null 2>"$W/fit.err" &&
        ok "oom: the advised --batch-size $fit fits" || bad "oom: the advised --batch-size $fit fails: $(tail -1 "$W/fit.err")"
    more=$((fit + fit / 10 + 1))   # and it is the largest, within the probes' 1.5%
    ! timeout "$LIMIT" "$TRAIN" "${MEM[@]}" --batch-size "$more" --out "$W/fit_more" >/dev/null 2>"$W/fit.err" &&
        grep -q 'out of memory' "$W/fit.err" && ok "oom: --batch-size $more does not fit" || bad "oom: --batch-size $more fits too: not the largest"
    rm -rf "$W/fit" "$W/fit_more"
fi
expect 1 oom_state 'not even a batch of 1 fits; the optimizer.s state is the largest part' \
    --model resnet18 --batch-size 1 --limit-train 16 --limit-val 8 --epochs 1 --max-memory 150M --progress off --out "$W/oom2"
# More than the machine allows (a limit emulated by $AMPC_MEMORY_AVAILABLE, which the
# library takes with MemAvailable and the cgroup's limit): a 5.5 GiB IDX file (sparse), a 4 GiB CSV
# index (sparse) and --image-size 4096 are errors with the figures before anything is allocated,
# never the OOM killer's
mkdir -p "$W/bigidx"
{ printf '\x00\x00\x08\x03'; be32 7500000; be32 28; be32 28; } >"$W/bigidx/train-images-idx3-ubyte"
truncate -s $((16 + 7500000 * 784)) "$W/bigidx/train-images-idx3-ubyte"
{ printf '\x00\x00\x08\x01'; be32 7500000; } >"$W/bigidx/train-labels-idx1-ubyte"
truncate -s $((8 + 7500000)) "$W/bigidx/train-labels-idx1-ubyte"
AMPC_MEMORY_AVAILABLE=3G expect 1 mem_idx "train-images-idx3-ubyte' \(5880000000 bytes of pixels\) needs 5.5 GiB of memory, more than the 3.0 GiB that \\\$AMPC_MEMORY_AVAILABLE allows: at most [0-9]+ images fit" \
    --data "$W/bigidx" --model mlp --epochs 1 --out "$W/x"
mkdir -p "$W/img/a" "$W/img/b"
truncate -s 4G "$W/big.csv"
AMPC_MEMORY_AVAILABLE=3G expect 1 mem_csv "image folder index $W/big.csv \(read whole\) needs 4.0 GiB of memory, more than the 3.0 GiB" \
    --data "$W/img" --index-csv "$W/big.csv" --epochs 1 --out "$W/x"
AMPC_MEMORY_AVAILABLE=1G expect 1 mem_image_size "a batch of 64 images of 1x4096x4096 takes 4.00 GiB in f32 before any activation, more than the 1.00 GiB that \\\$AMPC_MEMORY_AVAILABLE allows: --batch-size 16 at most" \
    --model resnet18 --image-size 4096 --limit-train 64 --limit-val 16 --epochs 1 --out "$W/x"
rm -f "$W/bigidx"/* "$W/big.csv"

# ---------------------------------------------------------------------------------------------
# Diverging runs stop with exit 3, name the step and the last good checkpoint, and never
# replace it
DIV=(--limit-train 512 --limit-val 64 --batch-size 64 --progress off)
expect 3 diverge_fp32_nan 'diverged in epoch 1 at step [0-9]+ of 8: the loss is -?nan.*no checkpoint was written' \
    "${DIV[@]}" --epochs 3 --use-amp no --optimizer sgd --lr 1e6 --max-loss 1e300 --out "$W/d1"
expect 3 diverge_bf16_adam 'diverged in epoch 1 at step [0-9]+ of 8: the loss [0-9.e+]+ exceeds --max-loss 1e\+04' \
    "${DIV[@]}" --epochs 3 --amp-dtype bf16 --lr 1e6 --out "$W/d2"
expect 3 diverge_fp16_skips 'skipped 5 steps in a row' \
    "${DIV[@]}" --epochs 3 --model mlp --amp-dtype fp16 --lr 1e6 --max-skipped-steps 5 --out "$W/d3"
# the default bound, 2^-24, is 40 halvings from 65536: met within the first epoch (50 steps),
# since a NaN validation loss would stop the run after it
expect 3 diverge_fp16_scale 'in epoch 1 at step 4[0-9] of 50: the loss scale collapsed to .*2\^-24' \
    --limit-train 3200 --limit-val 64 --batch-size 64 --progress off --model mlp --amp-dtype fp16 --lr 1e6 --max-skipped-steps 0 \
    --epochs 8 --out "$W/d4"

# --step-log: a row per optimizer step; a skipped step carries the scale it was taken at, halved
# in the next row; the first skip gets a line on stdout (the rest at most one per 2 s); scale.png
SL=(--model mlp --limit-train 512 --limit-val 64 --batch-size 64 --progress off --amp-dtype fp16 --step-log yes)
# (lr 1e6: every step from the second overflows fp16; so does validation, whose NaN loss stops the
# run after epoch 1, its 8 rows written; scale.png: the resumed run's below)
if expect 3 steplog 'in epoch 1: the validation loss is -?nan' "${SL[@]}" --epochs 3 --lr 1e6 --max-skipped-steps 0 --out "$W/sl"; then
    rows=$(($(wc -l <"$W/sl/steps.csv") - 1))
    sk=$(awk -F, 'NR > 1 && $6 == 1' "$W/sl/steps.csv" | wc -l)
    halves=$(awk -F, 'NR > 2 && prev && $5 * 2 != scale { bad++ } NR > 1 { prev = $6; scale = $5 } END { print bad + 0 }' "$W/sl/steps.csv")
    if [ "$rows" -eq 8 ] && [ "$sk" -eq 7 ] && [ "$halves" -eq 0 ] && head -1 "$W/sl/steps.csv" | grep -qx 'step,epoch,batch,loss,scale,skipped,lr,samples_per_s' &&
        grep -qE '^skipped step 2 \(epoch 1, batch 2\): inf/NaN gradients at loss scale 65536; the scale is now 32768' "$W/steplog.out"; then
        ok "--step-log: 8 rows, 7 skipped, each halving the scale; the skip line"
    else
        bad "--step-log: $rows rows, $sk skipped, $halves bad halvings: $(grep -E '^skipped' "$W/steplog.out" | tr '\n' ' ')"
    fi
fi
# --doctor: the diverged run's message and the skip line name the first op whose output went
# non-finite (lr 1e6: the second step's forward overflows in the mlp's first Linear, '1')
expect 3 doctor "skipped 5 steps in a row.*the first non-finite output: linear in '1' \\(forward, [0-9]+ of 8192 values\\), intrinsic" \
    "${DIV[@]}" --epochs 3 --model mlp --amp-dtype fp16 --lr 1e6 --max-skipped-steps 5 --doctor yes --out "$W/d5"
grep -q "^skipped step 2 (epoch 1, batch 2): .*the first non-finite output: linear in '1'" "$W/doctor.out" &&
    ok "--doctor: the skip line names it too" || bad "--doctor: skip line: $(grep '^skipped' "$W/doctor.out" | head -1)"
# Guard rails: a model whose last Linear overflows fp16 in every forward (its bias 1e5, above
# fp16's 65504; softmax does not care, so fp32 trains it) skips every step. After 3 in a row the
# run stops, saves where it stopped (diverged.safetensors: the pretrained weights, since skipped
# steps change nothing) apart from any good checkpoint, and names the doctor's module as the
# remedy; resumed with --fp32-modules for it, it trains without a skip (set_tensor: e2e_lib.sh).
GR=(--model mlp --limit-train 512 --limit-val 64 --batch-size 64 --progress off --amp-dtype fp16)
if timeout "$LIMIT" "$TRAIN" "${GR[@]}" --use-amp no --epochs 1 --out "$W/gr0" >/dev/null 2>&1 &&
    set_tensor "$W/gr0/model.safetensors" "$W/big.safetensors" 3.bias 1e5; then
    expect 3 guard_skips "skipped 3 steps in a row.*linear in '3' \(forward.*intrinsic.*saved where it stopped to $W/gr/diverged.safetensors.*no good checkpoint.*Remedies: --fp32-modules '3'.*--resume $W/gr/diverged.safetensors --fp32-modules '3'" \
        "${GR[@]}" --pretrained "$W/big.safetensors" --epochs 2 --max-skipped-steps 3 --doctor yes --out "$W/gr"
    [ ! -e "$W/gr/checkpoint.safetensors" ] && "$TRAIN" --compare-checkpoints "$W/big.safetensors" "$W/gr/diverged.safetensors" >/dev/null &&
        ok "guard rails: diverged.safetensors holds the weights of the last applied step (the pretrained ones), no checkpoint replaced" ||
        bad "guard rails: the saved state is not the pretrained weights, or a checkpoint was written"
    cp "$W/gr/diverged.safetensors" "$W/gr.diverged"
    expect 3 guard_again 'skipped 3 steps in a row' --resume "$W/gr.diverged" --out "$W/gr_again"
    grep -q 'warning: resuming a diverged run as it was' "$W/guard_again.err" && ok "guard rails: resuming without a remedy warns" ||
        bad "guard rails: no warning for a resume without a remedy"
    if timeout "$LIMIT" "$TRAIN" --resume "$W/gr/diverged.safetensors" --fp32-modules 3 >"$W/gr_fix.out" 2>&1 &&
        grep -q "^note: changed on resume: --fp32-modules 3 (was '')" "$W/gr_fix.out" &&
        grep -q '^note: the grad scaler starts afresh at scale 65536' "$W/gr_fix.out" &&
        grep -q "^resumed from $W/gr/diverged.safetensors in epoch 1 after step 3 of 8" "$W/gr_fix.out" &&
        grep -qE '^epoch 2/2: .*scale 65536, 0 skipped' "$W/gr_fix.out" && grep -q 'grad scaler: 0 skipped steps of 13' "$W/gr_fix.out" &&
        [ -s "$W/gr/checkpoint.safetensors" ]; then
        ok "guard rails: resumed with --fp32-modules 3, $(grep -E '^  final' "$W/gr_fix.out" | sed 's/^ *//'), no step skipped"
    else
        bad "guard rails: the remedy did not train: $(grep -E '^note|^epoch [0-9]/|grad scaler|error' "$W/gr_fix.out" | tr '\n' ' ')"
    fi
    expect 3 guard_scale 'the loss scale collapsed to 512 \(below --min-loss-scale 1e\+03\)' \
        "${GR[@]}" --pretrained "$W/big.safetensors" --epochs 2 --max-skipped-steps 0 --min-loss-scale 1000 --out "$W/gr2"
else
    bad "guard rails: no model to give a 1e5 bias"
fi
# a remedy on an ordinary resume: --lr may change (noted; the scaler's state carries on), the
# batch may not
if timeout "$LIMIT" "$TRAIN" "${GR[@]}" --epochs 1 --out "$W/lr1" >/dev/null 2>&1 &&
    timeout "$LIMIT" "$TRAIN" --resume "$W/lr1/checkpoint.safetensors" --epochs 2 --lr 0.0005 >"$W/lr1.out" 2>&1 &&
    grep -q '^note: changed on resume: --lr 0.0005 (was 0.001)$' "$W/lr1.out" && ! grep -q 'starts afresh' "$W/lr1.out"; then
    ok "resume: --lr 0.0005 accepted as a remedy, noted"
else
    bad "resume --lr: $(grep -E '^note|error' "$W/lr1.out" | tr '\n' ' ')"
fi
expect 1 resume_batch 'batch-size 32 differs from the checkpoint' --resume "$W/lr1/checkpoint.safetensors" --epochs 3 --batch-size 32
# --amp-dtype fastest: the choice is the precision with the smallest printed median, and timing
# it left the run as it was: the checkpoint equals, bit for bit, a run given that precision (the
# cnn's dropout draws from the random stream; resnet18's BatchNorm statistics are buffers)
for m in cnn resnet18; do
    FA=(--model "$m" --limit-train 16 --limit-val 8 --batch-size 4 --epochs 1 --progress off)   # small: bf16 may be emulated
    if timeout "$LIMIT" "$TRAIN" "${FA[@]}" --amp-dtype fastest --out "$W/fa_$m" >"$W/fa_$m.out" 2>&1; then
        line=$(grep '^amp-dtype fastest: fp32' "$W/fa_$m.out")
        want=$(echo "$line" | grep -oE '(fp32|bf16|fp16) [0-9.]+ ms' | sort -k2 -g | head -1 | cut -d' ' -f1)
        got=$(echo "$line" | grep -oE -- '-> (fp32|bf16|fp16)' | cut -d' ' -f2)
        case $got in fp32) flags=(--use-amp no) ;; *) flags=(--amp-dtype "$got") ;; esac
        if [ -n "$want" ] && [ "$want" = "$got" ] && timeout "$LIMIT" "$TRAIN" "${FA[@]}" "${flags[@]}" --out "$W/fb_$m" >/dev/null 2>&1 &&
            "$TRAIN" --compare-checkpoints "$W/fa_$m/checkpoint.safetensors" "$W/fb_$m/checkpoint.safetensors" >"$W/fa_$m.cmp"; then
            ok "--amp-dtype fastest ($m): ${line#amp-dtype fastest: }; the run equals one given ${flags[*]}: $(tail -1 "$W/fa_$m.cmp")"
        else
            bad "--amp-dtype fastest ($m): '$line', chose '$got', fastest printed '$want': $(tail -1 "$W/fa_$m.cmp" 2>/dev/null)"
        fi
    else
        bad "--amp-dtype fastest ($m): $(tail -1 "$W/fa_$m.out")"
    fi
done
# --explain: the first step's ops with their policies and dtypes (test_doctor checks them against the table)
if timeout "$LIMIT" "$TRAIN" --limit-train 64 --limit-val 32 --epochs 1 --amp-dtype fp16 --explain yes --progress off --out "$W/ex" >"$W/ex.out" 2>&1 &&
    grep -qE "^ +1 +forward +conv1 +conv2d +lower_precision +f32,f32,f32 -> f16,f16,f16 +f16 +[0-9,]+$" "$W/ex.out" &&
    grep -qE "^ +[0-9]+ +backward +conv2 +ConvolutionBackward" "$W/ex.out" && grep -qE "^  13 forward and [0-9]+ backward ops" "$W/ex.out"; then
    ok "--explain: $(grep -E '^explain' "$W/ex.out")"
else
    bad "--explain: $(grep -A3 -E '^explain' "$W/ex.out" | tr '\n' ' ')"
fi
# --fp32-modules: fc1 and fc2 run in fp32 under fp16 autocast, the convolutions stay fp16
if timeout "$LIMIT" "$TRAIN" --limit-train 64 --limit-val 32 --epochs 1 --amp-dtype fp16 --explain yes --fp32-modules 'fc*' --progress off \
    --out "$W/ex32" >"$W/ex32.out" 2>&1 &&
    grep -qE "^ +[0-9]+ +forward +fc1 +linear +fp32 +f16,f32,f32 -> f32,f32,f32 +f32 " "$W/ex32.out" &&
    grep -qE "^ +[0-9]+ +forward +fc2 +linear +fp32 +f32,f32,f32 -> f32,f32,f32 +f32 " "$W/ex32.out" &&
    grep -qE "^ +[0-9]+ +forward +conv2 +conv2d +lower_precision +f16,f32,f32 -> f16,f16,f16 +f16 " "$W/ex32.out"; then
    ok "--fp32-modules 'fc*': fc1 and fc2 in fp32, conv2 in fp16"
else
    bad "--fp32-modules: $(grep -E ' forward +(fc|conv)' "$W/ex32.out" | tr '\n' ' ')"
fi
expect 2 fp32_modules_bad 'fp32-modules.*empty pattern' --epochs 0 --fp32-modules 'fc1,,fc2'
# --numerics-every 4: 16 steps of which 4 sampled; the table, and numerics.csv with a row per op,
# among them the logits' gradient narrowed to fp16 (CastBackward) at scale 65536
if timeout "$LIMIT" "$TRAIN" --limit-train 1024 --limit-val 64 --epochs 1 --amp-dtype fp16 --numerics-every 4 --progress off \
    --out "$W/nm" >"$W/nm.out" 2>&1 && grep -qE '^numerics: 4 sampled step\(s\), [0-9]+ ops; what fp16 would lose' "$W/nm.out" &&
    head -1 "$W/nm/numerics.csv" | grep -qx 'pass,module,op,outputs,values,amax,flushed,subnormal,saturated,zeros,nonfinite' &&
    grep -qE '^backward,,CastBackward,4,2560,' "$W/nm/numerics.csv" && grep -qE '^forward,conv1,conv2d,4,' "$W/nm/numerics.csv"; then
    ok "--numerics-every 4: $(grep -E '^numerics' "$W/nm.out" | cut -c1-60), $(($(wc -l <"$W/nm/numerics.csv") - 1)) rows in numerics.csv"
else
    bad "--numerics-every: $(grep -E '^numerics' "$W/nm.out"; head -3 "$W/nm/numerics.csv" 2>&1 | tr '\n' ' ')"
fi
# on --resume, rows past the checkpoint (written before a kill) are dropped: the log then ends
# as the uninterrupted run's, byte for byte but for the samples_per_s timings
if timeout "$LIMIT" "$TRAIN" "${SL[@]}" --epochs 2 --out "$W/slref" >/dev/null 2>&1 &&
    timeout "$LIMIT" "$TRAIN" "${SL[@]}" --epochs 2 --stop-after-steps 11 --out "$W/slcut" >/dev/null 2>&1; then
    printf '12,2,4,0.5,65536,0,0.001\n13,2,5,0.5' >>"$W/slcut/steps.csv"
    timeout "$LIMIT" "$TRAIN" --resume "$W/slcut/checkpoint.safetensors" >/dev/null 2>&1 && cmp -s <(cut -d, -f1-7 "$W/slref/steps.csv") <(cut -d, -f1-7 "$W/slcut/steps.csv") &&
        [ -s "$W/slcut/scale.png" ] &&
        ok "--step-log + resume: rows past the checkpoint dropped, the log equals the uninterrupted run's; scale.png" ||
        bad "--step-log + resume: $(diff <(cut -d, -f1-7 "$W/slref/steps.csv") <(cut -d, -f1-7 "$W/slcut/steps.csv") | head -4 | tr '\n' ' ')"
fi
for d in d1 d2 d3; do [ -e "$W/$d/checkpoint.safetensors" ] && bad "$d: a diverged run wrote a checkpoint"; done
# a good first epoch, then divergence: the good checkpoint stays, byte for byte
if timeout "$LIMIT" "$TRAIN" "${DIV[@]}" --model mlp --use-amp no --lr 1e6 --max-loss 1e300 --epochs 1 --out "$W/d6" >/dev/null 2>&1; then
    cp "$W/d6/checkpoint.safetensors" "$W/d6.good"
    cp "$W/d6/metrics.csv" "$W/d6.csv"
    expect 3 diverge_keeps_good "the last good checkpoint is $W/d6/checkpoint.safetensors \\(after epoch 1\\)" \
        --resume "$W/d6/checkpoint.safetensors" --epochs 3 --max-loss 1e4
    cmp -s "$W/d6.good" "$W/d6/checkpoint.safetensors" && ok "diverge: the good checkpoint is unchanged" ||
        bad "diverge: the good checkpoint was replaced"
    cmp -s "$W/d6.csv" "$W/d6/metrics.csv" && ok "diverge: metrics.csv holds the good epochs only" ||
        bad "diverge: metrics.csv changed: $(tail -1 "$W/d6/metrics.csv")"
else
    bad "diverge: the first epoch (--max-loss 1e300) failed"
fi

# ---------------------------------------------------------------------------------------------
# Values from a checkpoint are range-checked
if timeout "$LIMIT" "$TRAIN" --model mlp "${SMALL[@]}" --epochs 1 --out "$W/ck" >/dev/null 2>&1; then
    C="$W/ck/checkpoint.safetensors"
    edit_header "$C" "$W/e18.safetensors" '"ampc_train.epoch":"1"' '"ampc_train.epoch":"1000000000000000000"'
    expect 1 epoch_1e18 "bad metadata 'ampc_train.epoch'" --resume "$W/e18.safetensors" --out "$W/x"
    edit_header "$C" "$W/e5.safetensors" '"ampc_train.epoch":"1"' '"ampc_train.epoch":"5"'
    expect 1 epoch_history "has 1 values for 5 epochs" --resume "$W/e5.safetensors" --out "$W/x"
    edit_header "$C" "$W/step.safetensors" '"ampc_train.step":"0"' '"ampc_train.step":"99999"'
    expect 1 step_range "bad metadata 'ampc_train.step'" --resume "$W/step.safetensors" --out "$W/x"
    edit_header "$C" "$W/neg.safetensors" '"ampc_train.train_size":"256"' '"ampc_train.train_size":"-256"'
    expect 1 negative_size "bad metadata 'ampc_train.train_size'" --resume "$W/neg.safetensors" --out "$W/x"
    # metadata of 200,000 extra keys resumes in seconds (it is parsed once, not per value read), and
    # metadata over the 32 MiB ampc-train writes at most is refused
    mkdir -p "$W/keys"
    perl -e 'open(F, "<:raw", $ARGV[0]) or die; local $/; my $d = <F>; my $n = unpack("Q<", substr($d, 0, 8));
             my ($h, $b) = (substr($d, 8, $n), substr($d, 8 + $n)); my $k = join("", map { "\"x$_\":\"$_\"," } 1 .. $ARGV[2]);
             $h =~ s/"__metadata__":\{/"__metadata__":{$k/ or die "no metadata\n";
             open(O, ">:raw", $ARGV[1]) or die; print O pack("Q<", length $h) . $h . $b' "$C" "$W/keys/checkpoint.safetensors" 200000
    t0=$SECONDS
    if timeout 30 "$TRAIN" --resume "$W/keys/checkpoint.safetensors" --epochs 1 >"$W/keys.out" 2>&1 &&
        grep -q "^resumed from $W/keys/checkpoint.safetensors after epoch 1" "$W/keys.out"; then
        ok "resume: metadata of 200,000 keys read in $((SECONDS - t0)) s"
    else
        bad "resume: metadata of 200,000 keys: $(tail -1 "$W/keys.out")"
    fi
    perl -e 'open(F, "<:raw", $ARGV[0]) or die; local $/; my $d = <F>; my $n = unpack("Q<", substr($d, 0, 8));
             my ($h, $b) = (substr($d, 8, $n), substr($d, 8 + $n)); my $v = "1," x (17 << 20);
             $h =~ s/"ampc_train.history.epoch":"1"/"ampc_train.history.epoch":"${v}1"/ or die "no history\n";
             open(O, ">:raw", $ARGV[1]) or die; print O pack("Q<", length $h) . $h . $b' "$C" "$W/big_meta.safetensors"
    expect 1 meta_size "metadata is [0-9]+ bytes, more than ampc-train writes \(at most 32 MiB\)" --resume "$W/big_meta.safetensors" --out "$W/x"
else
    bad "checkpoint for the range checks not written"
fi
[ ! -e "$W/x" ] || bad "a failed run left an output folder"

# ---------------------------------------------------------------------------------------------
# SIGINT / SIGTERM: the run stops at a step boundary, saves a checkpoint, says how to go on and
# exits 128 + signal; resuming gives the bits and the metrics of an uninterrupted run
# 32 steps an epoch: the signal, sent once epoch 2's first progress line shows, lands well before
# its end even on a loaded machine (with 16 it once arrived after training had finished)
SIG=(--model cnn --limit-train 1024 --limit-val 128 --batch-size 32 --epochs 2 --progress lines)
if timeout "$LIMIT" "$TRAIN" "${SIG[@]}" --out "$W/sref" >/dev/null 2>&1; then
    for sig in INT TERM; do
        d="$W/s$sig"
        # --foreground: timeout(1) passes a signal on to ampc-train alone; without it, it also sends
        # it to its process group, ampc-train included, and a second SIGINT stops at once
        timeout --foreground "$LIMIT" "$TRAIN" "${SIG[@]}" --out "$d" >"$d.out" 2>"$d.err" &
        pid=$!
        # wait for the second epoch's first progress line: the signal lands mid-epoch
        for ((t = 0; t < 600; t++)); do grep -q '^epoch 2/2 train' "$d.out" 2>/dev/null && break; sleep 0.1; done
        kill -$sig $pid 2>/dev/null
        # timeout(1) passes the signal on to ampc-train
        wait $pid
        rc=$?
        want=$((128 + $(kill -l $sig)))
        if [ $rc -eq $want ] && grep -qE "^ampc-train: interrupted by SIG$sig: saved .* \(in epoch 2, after step [0-9]+\); continue with: ampc-train --resume" "$d.err"; then
            ok "SIG$sig: $(grep '^ampc-train: interrupted' "$d.err")"
        else
            bad "SIG$sig: exit $rc (want $want): $(tail -2 "$d.err" | tr '\n' ' ')"
        fi
        [ "$(wc -l <"$d/metrics.csv")" -eq 2 ] || bad "SIG$sig: metrics.csv has $(wc -l <"$d/metrics.csv") lines after epoch 1 (want 2)"
        if timeout "$LIMIT" "$TRAIN" --resume "$d/checkpoint.safetensors" >"$d.res" 2>&1; then
            grep -qE 'resumed from .* in epoch 2 after step [0-9]+ of 32' "$d.res" || bad "SIG$sig: no mid-epoch 'resumed' line"
            "$TRAIN" --compare-checkpoints "$W/sref/checkpoint.safetensors" "$d/checkpoint.safetensors" >"$d.cmp" &&
                ok "SIG$sig + resume == uninterrupted: $(tail -1 "$d.cmp")" || bad "SIG$sig + resume: tensors differ"
            cmp -s <(cut -d, -f1-5,8,9 "$W/sref/metrics.csv") <(cut -d, -f1-5,8,9 "$d/metrics.csv") &&
                ok "SIG$sig + resume: metrics rows equal the uninterrupted run's" ||
                bad "SIG$sig + resume: metrics differ: $(diff <(cut -d, -f1-5 "$W/sref/metrics.csv") <(cut -d, -f1-5 "$d/metrics.csv") | tr '\n' ' ')"
        else
            bad "SIG$sig: resume failed: $(tail -2 "$d.res" | tr '\n' ' ')"
        fi
    done
    # --stop-after-steps: the same stop at a known step (epoch 2, step 5 of 32), exit 0; in two
    # sessions the bits of the uninterrupted run, and the metrics' rows
    d="$W/ssteps"
    if timeout "$LIMIT" "$TRAIN" "${SIG[@]}" --stop-after-steps 37 --out "$d" >"$d.out" 2>&1 &&
        grep -q "^stopped after 37 training step(s) (--stop-after-steps): saved .* (in epoch 2, after step 5)" "$d.out" &&
        timeout "$LIMIT" "$TRAIN" --resume "$d/checkpoint.safetensors" >"$d.res" 2>&1 &&
        grep -q "resumed from .* in epoch 2 after step 5 of 32 (sample 160 of 1024)" "$d.res" &&
        "$TRAIN" --compare-checkpoints "$W/sref/checkpoint.safetensors" "$d/checkpoint.safetensors" >"$d.cmp" &&
        cmp -s <(cut -d, -f1-5,8,9 "$W/sref/metrics.csv") <(cut -d, -f1-5,8,9 "$d/metrics.csv"); then
        ok "--stop-after-steps 37 + resume == uninterrupted: $(tail -1 "$d.cmp")"
    else
        bad "--stop-after-steps: $(tail -n 2 "$d.out" "$d.res" "$d.cmp" 2>&1 | tr '\n' ' ')"
    fi
    # with a learning-rate schedule (warm-up, then cosine by applied optimizer steps): the rate
    # follows the restored step count, so the two sessions still give the uninterrupted bits
    LRS=(--lr-schedule cosine --warmup-steps 5)
    d="$W/slr"
    if timeout "$LIMIT" "$TRAIN" "${SIG[@]}" "${LRS[@]}" --out "$W/slr_ref" >/dev/null 2>&1 &&
        timeout "$LIMIT" "$TRAIN" "${SIG[@]}" "${LRS[@]}" --stop-after-steps 19 --out "$d" >"$d.out" 2>&1 &&
        timeout "$LIMIT" "$TRAIN" --resume "$d/checkpoint.safetensors" >"$d.res" 2>&1 &&
        "$TRAIN" --compare-checkpoints "$W/slr_ref/checkpoint.safetensors" "$d/checkpoint.safetensors" >"$d.cmp" &&
        ! "$TRAIN" --compare-checkpoints "$W/sref/checkpoint.safetensors" "$d/checkpoint.safetensors" >/dev/null 2>&1; then
        ok "--lr-schedule cosine --warmup-steps 5, stopped and resumed == uninterrupted (and != constant rate): $(tail -1 "$d.cmp")"
    else
        bad "--lr-schedule + resume: $(tail -n 2 "$d.out" "$d.res" "$d.cmp" 2>&1 | tr '\n' ' ')"
    fi
    # --clip-grad-norm: unscale, clip, step. A bound no gradient reaches leaves the bits of the
    # fused step (the same unscaled gradients); a small one changes the run
    if timeout "$LIMIT" "$TRAIN" "${SIG[@]}" --clip-grad-norm 1e9 --out "$W/clip_big" >/dev/null 2>&1 &&
        timeout "$LIMIT" "$TRAIN" "${SIG[@]}" --clip-grad-norm 0.01 --out "$W/clip_small" >/dev/null 2>&1 &&
        "$TRAIN" --compare-checkpoints "$W/sref/checkpoint.safetensors" "$W/clip_big/checkpoint.safetensors" >"$W/clip.cmp" &&
        ! "$TRAIN" --compare-checkpoints "$W/sref/checkpoint.safetensors" "$W/clip_small/checkpoint.safetensors" >/dev/null 2>&1; then
        ok "--clip-grad-norm 1e9 == no clipping ($(tail -1 "$W/clip.cmp")), 0.01 changes the run"
    else
        bad "--clip-grad-norm: $(tail -n 2 "$W/clip.cmp" 2>&1 | tr '\n' ' ')"
    fi
    # --accumulate 2 of 16 == batches of 32: the mlp has no dropout, so each optimizer step sees the
    # same 32 samples and the halves' mean differs from the whole's by rounding only (observed
    # ~2e-6 relative after 2 epochs); 1040 samples make 65 batches, the last group one batch (16 samples) as
    # batch 32's last. Without accumulating, batches of 16 are another run (> 1e-3 apart).
    ACC=(--model mlp --limit-train 1040 --limit-val 64 --epochs 2 --progress off --optimizer sgd --lr 0.05)
    timeout "$LIMIT" "$TRAIN" "${ACC[@]}" --use-amp no --batch-size 32 --out "$W/b32" >/dev/null 2>&1 &&
        timeout "$LIMIT" "$TRAIN" "${ACC[@]}" --use-amp no --batch-size 16 --accumulate 2 --out "$W/a2" >"$W/a2.out" 2>&1 &&
        timeout "$LIMIT" "$TRAIN" "${ACC[@]}" --use-amp no --batch-size 16 --out "$W/b16" >/dev/null 2>&1
    rc=$?
    "$TRAIN" --compare-checkpoints "$W/b32/checkpoint.safetensors" "$W/a2/checkpoint.safetensors" >"$W/a2.cmp" 2>&1
    "$TRAIN" --compare-checkpoints "$W/b32/checkpoint.safetensors" "$W/b16/checkpoint.safetensors" >"$W/b16.cmp" 2>&1
    da=$(max_rel "$W/a2.cmp") db=$(max_rel "$W/b16.cmp")
    if [ $rc -eq 0 ] && grep -q "accumulate     2 batches per optimizer step: 32 samples a step" "$W/a2.out" &&
        grep -qE '^(identical|checkpoints differ)' "$W/a2.cmp" && awk -v a="$da" -v b="$db" 'BEGIN { exit !(a <= 1e-5 && b > 1e-3) }'; then
        ok "--accumulate 2 x 16 == --batch-size 32 within $da (batches of 16 alone: $db)"
    else
        bad "--accumulate: exit $rc, relative $da (batches of 16: $db)"; tail -n 3 "$W/a2.out" "$W/a2.cmp"
    fi
    # stopped inside epoch 2 (40 optimizer steps: 33 + 7 of 2 batches) with fp16 and the scaler,
    # resumed: the bits of the uninterrupted run
    ACC16=("${ACC[@]}" --use-amp yes --amp-dtype fp16 --batch-size 16 --accumulate 2)
    d="$W/sacc"
    if timeout "$LIMIT" "$TRAIN" "${ACC16[@]}" --out "$W/sacc_ref" >/dev/null 2>&1 &&
        timeout "$LIMIT" "$TRAIN" "${ACC16[@]}" --stop-after-steps 40 --out "$d" >"$d.out" 2>&1 &&
        grep -q "^stopped after 40 training step(s) (--stop-after-steps): saved .* (in epoch 2, after step 14)" "$d.out" &&
        timeout "$LIMIT" "$TRAIN" --resume "$d/checkpoint.safetensors" >"$d.res" 2>&1 &&
        "$TRAIN" --compare-checkpoints "$W/sacc_ref/checkpoint.safetensors" "$d/checkpoint.safetensors" >"$d.cmp"; then
        ok "--accumulate 2 in fp16, stopped after 40 optimizer steps and resumed == uninterrupted: $(tail -1 "$d.cmp")"
    else
        bad "--accumulate + resume: $(tail -n 2 "$d.out" "$d.res" "$d.cmp" 2>&1 | tr '\n' ' ')"
    fi
    # a second signal stops at once: no checkpoint of the interrupted epoch
    d="$W/s2"
    "$TRAIN" "${SIG[@]}" --out "$d" >"$d.out" 2>"$d.err" &
    pid=$!
    for ((t = 0; t < 600; t++)); do grep -q '^epoch 1/2 train' "$d.out" 2>/dev/null && break; sleep 0.1; done
    kill -INT $pid
    sleep 0.01
    kill -INT $pid 2>/dev/null
    wait $pid
    rc=$?
    if grep -q '^ampc-train: interrupted' "$d.err"; then
        ok "second SIGINT: the first one's save finished first (exit $rc)"   # the step was too short to catch
    elif [ $rc -eq 130 ]; then
        ok "second SIGINT: stopped at once (exit 130, no checkpoint: $([ -e "$d/checkpoint.safetensors" ] && echo present || echo none))"
    else
        bad "second SIGINT: exit $rc"
    fi
else
    bad "signals: the reference run failed"
fi

for c in $CASES; do "case_$c"; done

echo "e2e_robust: $FAILS failure(s) in $((SECONDS - T0)) s"
[ "$FAILS" -eq 0 ]
