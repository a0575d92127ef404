#!/usr/bin/env bash
# e2e_cuda.sh - ampc-train on the CUDA backend (issue 16): the cnn trains on the GPU, in fp32 and
# with fp16 AMP (real fp16 arithmetic there, so the GradScaler does real work), to the CPU's
# validation accuracy within 1.5 points (bf16 also with the loader's workers and --pin-memory); the guard rails stop an fp16 overflow on the GPU as on
# the CPU and the remedy resumes it; --amp-dtype fastest keeps the precision it timed fastest.
#
#     bash tests/e2e_cuda.sh AMPC_TRAIN
#
# Exit 77 (ctest: skipped), saying why, where the build has no CUDA backend or the machine no
# GPU. AMPC_E2E_DEVICE=cpu runs the same checks on the CPU (to check this script where no GPU is).
set -u
TRAIN=${1:?usage: e2e_cuda.sh AMPC_TRAIN}
. "$(dirname "$0")/e2e_lib.sh" e2e_cuda
DEV=${AMPC_E2E_DEVICE:-cuda}
LIMIT=${E2E_TIMEOUT:-300}
if ! probe=$("$TRAIN" --device "$DEV" --model mlp --limit-train 64 --limit-val 16 --epochs 0 --progress off 2>&1); then
    echo "SKIPPED: no $DEV device here: $(echo "$probe" | tail -1)"
    exit 77
fi

final_acc() { grep -oE '^  final: .*validation loss [0-9.]+ acc [0-9.]+%' "$1" | grep -oE '[0-9.]+%$' | tr -d %; }

# 1. the cnn, 2 epochs of 8192 samples: fp32 on the CPU is the reference
CNN=(--model cnn --limit-train 8192 --limit-val 2048 --batch-size 128 --epochs 2 --progress off)
if timeout "$LIMIT" "$TRAIN" "${CNN[@]}" --use-amp no --out "$W/cpu" >"$W/cpu.out" 2>&1; then
    ref=$(final_acc "$W/cpu.out")
    for mode in fp32 fp16 bf16 bf16-pinned; do
        case $mode in
        fp32) f=(--use-amp no) ;;
        bf16-pinned) f=(--amp-dtype bf16 --num-workers 2 --pin-memory yes) ;;   # the loader's asynchronous uploads
        *) f=(--amp-dtype "$mode") ;;
        esac
        if timeout "$LIMIT" "$TRAIN" "${CNN[@]}" "${f[@]}" --device "$DEV" --out "$W/$mode" >"$W/$mode.out" 2>&1; then
            acc=$(final_acc "$W/$mode.out")
            if awk -v a="$acc" -v r="$ref" 'BEGIN { d = a - r; exit !(d < 1.5 && d > -1.5) }'; then
                ok "cnn on $DEV, $mode: validation accuracy $acc% (CPU fp32: $ref%); $(grep -E '^  grad scaler' "$W/$mode.out" | sed 's/^ *//')"
            else
                bad "cnn on $DEV, $mode: validation accuracy $acc%, CPU fp32 $ref%: more than 1.5 points apart"
            fi
        else
            bad "cnn on $DEV, $mode: $(tail -1 "$W/$mode.out")"
        fi
    done
else
    bad "cnn on the CPU: $(tail -1 "$W/cpu.out")"
fi

# 2. guard rails: a last Linear whose fp16 output overflows (bias 1e5) skips every step; the run
# stops after 3, saves diverged.safetensors, names --fp32-modules '3', and resumed with it trains
# without a skip
GR=(--model mlp --limit-train 512 --limit-val 64 --batch-size 64 --progress off --device "$DEV")
if timeout "$LIMIT" "$TRAIN" "${GR[@]}" --use-amp no --epochs 1 --out "$W/gr0" >/dev/null 2>&1 &&
    set_tensor "$W/gr0/model.safetensors" "$W/big.safetensors" 3.bias 1e5; then
    timeout "$LIMIT" "$TRAIN" "${GR[@]}" --amp-dtype fp16 --pretrained "$W/big.safetensors" --epochs 2 --max-skipped-steps 3 --doctor yes \
        --out "$W/gr" >"$W/gr.out" 2>"$W/gr.err"
    rc=$?
    timeout "$LIMIT" "$TRAIN" --resume "$W/gr/diverged.safetensors" --fp32-modules 3 >"$W/grr.out" 2>&1
    rc1=$?
    if [ $rc -eq 3 ] && grep -q "skipped 3 steps in a row.*linear in '3' (forward.*saved where it stopped.*--fp32-modules '3'" "$W/gr.err" &&
        [ $rc1 -eq 0 ] && grep -q 'grad scaler: 0 skipped steps' "$W/grr.out"; then
        ok "guard rails on $DEV: stopped at step 3 naming linear in '3'; resumed with --fp32-modules 3, no step skipped"
    else
        bad "guard rails on $DEV: exit $rc, resume $rc1: $(tail -1 "$W/gr.err") $(tail -2 "$W/grr.out" | tr '\n' ' ')"
    fi
else
    bad "guard rails on $DEV: no model to give a 1e5 bias"
fi

# 3. --amp-dtype fastest: the precision with the smallest printed median is the one kept
if timeout "$LIMIT" "$TRAIN" --model resnet18 --limit-train 512 --limit-val 64 --batch-size 64 --epochs 1 --progress off --device "$DEV" \
    --amp-dtype fastest --out "$W/fa" >"$W/fa.out" 2>&1; then
    line=$(grep '^amp-dtype fastest: fp32' "$W/fa.out")
    want=$(echo "$line" | grep -oE '(fp32|bf16|fp16) [0-9.]+ ms' | sort -k2 -g | head -1 | cut -d' ' -f1)
    got=$(echo "$line" | grep -oE -- '-> (fp32|bf16|fp16)' | cut -d' ' -f2)
    [ -n "$want" ] && [ "$want" = "$got" ] && ok "--amp-dtype fastest on $DEV (resnet18, batch 64): ${line#amp-dtype fastest: }" ||
        bad "--amp-dtype fastest on $DEV: '$line'"
else
    bad "--amp-dtype fastest on $DEV: $(tail -1 "$W/fa.out")"
fi

echo "e2e_cuda: $FAILS failure(s) in $((SECONDS - T0)) s"
[ "$FAILS" -eq 0 ]
