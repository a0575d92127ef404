#!/bin/bash
# ampc-train's TensorBoard event files read by TensorBoard's own EventAccumulator, on a machine
# whose Python has pip's tensorboard (the GPU machine; Debian has no package): a CPU run stopped
# mid-epoch and resumed, then SIGKILLed in its second epoch (events past its checkpoint written)
# and resumed; tests/tensorboard_accumulator.py asserts one train/loss point per steps.csv row, at
# its step and value, and the epoch tags equal to metrics.csv. Run by scripts/gpu/session.sh.
set -uo pipefail
cd "$(dirname "$0")/../.."
R=${AMPC_TRAIN_CMD:-bash scripts/gpu/run.sh train}   # AMPC_TRAIN_CMD: another ampc-train, to try the script
D=/tmp/ampc-tb-check
rm -rf "$D"
A=(--model mlp --limit-train 4096 --limit-val 256 --batch-size 32 --epochs 3 --amp-dtype fp16 --progress off --threads 2)
$R "${A[@]}" --stop-after-steps 40 --out "$D" >/dev/null || { echo "FAIL: the first run"; exit 1; }
$R --resume "$D/checkpoint.safetensors" --progress off >/dev/null &
# killed once steps.csv has rows of epoch 2 (its first epoch's checkpoint written, later events too)
for _ in $(seq 600); do
    awk -F, '$2 == 2' "$D/steps.csv" 2>/dev/null | grep -q . && break
    sleep 0.05
done
pkill -KILL -f "ampc-train --resume $D/" ; wait
echo "killed at step $(tail -1 "$D/steps.csv" | cut -d, -f1) of steps.csv; $(ls "$D" | grep -c tfevents) event files"
$R --resume "$D/checkpoint.safetensors" --progress off >/dev/null || { echo "FAIL: the last resume"; exit 1; }
${PYTHON:-python3} tests/tensorboard_accumulator.py "$D"
