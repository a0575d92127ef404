#!/usr/bin/env bash
# e2e_tensorboard.sh - ampc-train's TensorBoard event files (--tensorboard, on by default) read
# by an independent reader, tests/tensorboard_read.py (the TFRecord framing and both CRCs parsed
# there, each Event by python3-protobuf from tools/tensorboard/*.proto compiled by protoc): the
# tags, per-step values equal to steps.csv's and per-epoch values to metrics.csv's to float
# precision, steps strictly increasing; train/loss_scale only with the GradScaler; no file with
# --tensorboard no; a corrupted record is refused by the reader; and across a stop and a kill,
# the resumed run's file opens with SessionLog START at the checkpoint's step + 1, so what
# TensorBoard shows after dropping the killed run's later events is exactly steps.csv.
#
#     bash tests/e2e_tensorboard.sh BUILD/ampc-train
#
# Skipped (exit 0, "SKIP: ...") when protoc or python3-protobuf is missing (scripts/install-deps.sh
# installs them), or the Fashion-MNIST files are. A few seconds: every run is the mlp on 512
# samples (the killed run on 4096).
set -u
TRAIN=${1:?usage: e2e_tensorboard.sh AMPC_TRAIN}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=/usr/bin/python3   # Debian's, with python3-protobuf
if ! command -v protoc >/dev/null; then
    echo "SKIP: protoc not found (Debian's protobuf-compiler: scripts/install-deps.sh)"
    exit 0
fi
if ! "$PY" -c 'import google.protobuf' 2>/dev/null; then
    echo "SKIP: $PY has no google.protobuf (Debian's python3-protobuf: scripts/install-deps.sh)"
    exit 0
fi
. "$HERE/e2e_lib.sh" e2e_tensorboard
PROTO="$HERE/../tools/tensorboard"
ARGS=(--model mlp --limit-train 512 --limit-val 128 --progress off --step-log yes)   # 8 steps an epoch

# check NAME DIR SCALER STARTS: the reader's checks of the run in DIR
check() {
    if "$PY" "$HERE/tensorboard_read.py" check "$PROTO" "$2" --steps-csv "$2/steps.csv" --metrics-csv "$2/metrics.csv" \
        --scaler "$3" --starts "$4" >"$W/$1.read" 2>&1; then
        ok "$1: $(tail -1 "$W/$1.read" | sed "s/^ok: //")"
    else
        bad "$1: the reader says:"
        sed 's/^/    /' "$W/$1.read" | tail -15
    fi
}
n_files() { find "$1" -maxdepth 1 -name 'events.out.tfevents.*' | wc -l; }

# fp16 with the GradScaler: every tag; the file alone in the folder
if run fp16 "${ARGS[@]}" --amp-dtype fp16 --epochs 2 --out "$W/fp16"; then
    check fp16 "$W/fp16" yes ""
    [ "$(n_files "$W/fp16")" -eq 1 ] || bad "fp16: $(n_files "$W/fp16") event files in the run's folder, not 1"
fi
# fp32: no loss scale
run fp32 "${ARGS[@]}" --use-amp no --epochs 1 --out "$W/fp32" && check fp32 "$W/fp32" no ""
# --tensorboard no: no event file, the rest as usual
if run off "${ARGS[@]}" --use-amp no --epochs 1 --tensorboard no --out "$W/off"; then
    [ "$(n_files "$W/off")" -eq 0 ] && [ -s "$W/off/metrics.csv" ] && ok "--tensorboard no: no event file" ||
        bad "--tensorboard no: $(n_files "$W/off") event file(s)"
fi

# The reader's CRC checks can fail: a byte changed in the last record's Event, or in a length
for what in record length; do
    cp -r "$W/fp16" "$W/bad_$what"
    f=$(ls "$W/bad_$what"/events.out.tfevents.*)
    size=$(stat -c %s "$f")
    at=$([ $what = record ] && echo $((size - 8)) || echo 0)
    printf '\x7f' | dd of="$f" bs=1 seek="$at" conv=notrunc status=none
    out=$("$PY" "$HERE/tensorboard_read.py" dump "$PROTO" "$f" 2>&1)
    rc=$?
    [ $rc -eq 2 ] && grep -q "CRC" <<<"$out" && ok "a changed byte ($what): $(tail -1 <<<"$out" | cut -c1-140)" ||
        bad "a changed byte ($what): the reader exited $rc: $(tail -2 <<<"$out")"
done
# ... and so can its value checks: the fp16 run's file against the fp32 run's CSV files
if "$PY" "$HERE/tensorboard_read.py" check "$PROTO" "$W/fp16" --steps-csv "$W/fp32/steps.csv" --metrics-csv "$W/fp32/metrics.csv" \
    --scaler yes --starts "" >"$W/mismatch.read" 2>&1; then
    bad "the fp16 run's events passed as the fp32 run's"
else
    ok "the fp16 run's events against the fp32 run's CSV files: $(grep -c FAIL "$W/mismatch.read") differences"
fi

# Stopped mid-epoch (--stop-after-steps 11, the checkpoint at step 11) and resumed: the second file
# starts with START at step 12. Then the resumed run's own events past that checkpoint are made
# orphans, as a kill before its next checkpoint leaves them: the step-11 checkpoint back in place
# and resumed once more, TensorBoard must drop them (steps 12..24) for the third file's.
R="$W/resume"
if run stop "${ARGS[@]}" --amp-dtype fp16 --epochs 3 --stop-after-steps 11 --out "$R"; then
    grep -q "stopped after 11 training step" "$W/stop.out" || bad "stop: no 'stopped after 11 training step(s)' line"
    cp "$R/checkpoint.safetensors" "$W/ckpt11.safetensors"
    run resume1 --resume "$R/checkpoint.safetensors" && check resume "$R" yes "12"
    cp "$W/ckpt11.safetensors" "$R/checkpoint.safetensors"
    run resume2 --resume "$R/checkpoint.safetensors" && check orphans "$R" yes "12 12"
    [ "$(n_files "$R")" -eq 3 ] || bad "resume: $(n_files "$R") event files, not 3"
fi

# SIGKILL at a random moment after the first epoch's checkpoint (rows of epoch 2 in steps.csv), then
# --resume to the end: START at the step after the checkpoint's (its epochs x 64 steps), and the
# killed run's later events (those its stdio buffer had written, perhaps a partial last record) dropped.
K="$W/kill"
KARGS=(--model mlp --limit-train 4096 --limit-val 128 --progress off --step-log yes --amp-dtype fp16 --epochs 4 --out "$K")
killed=0
for ((try = 1; try <= 10 && !killed; try++)); do
    rm -rf "$K"
    "$TRAIN" "${KARGS[@]}" >"$W/kill.out" 2>&1 &
    pid=$!
    while kill -0 $pid 2>/dev/null && ! awk -F, 'NR > 1 && $2 >= 2 { f = 1 } END { exit !f }' "$K/steps.csv" 2>/dev/null; do
        sleep 0.005
    done
    sleep "0.0$((RANDOM % 10))"
    kill -KILL $pid 2>/dev/null && killed=1
    wait $pid 2>/dev/null
done
if [ $killed -eq 1 ] && run kill_resume --resume "$K/checkpoint.safetensors"; then
    epochs=$(sed -n 's/^resumed from .* after epoch \([0-9]*\)$/\1/p' "$W/kill_resume.out")
    if [ -z "$epochs" ]; then
        bad "kill: no 'resumed ... after epoch N' line"
    else
        check kill "$K" yes "$((epochs * 64 + 1))"
        echo "  (killed after epoch $epochs, try $((try - 1)); $(grep -c . "$K/steps.csv") lines in steps.csv)"
    fi
elif [ $killed -eq 0 ]; then
    bad "kill: the run ended before the kill 10 times"
fi

echo "e2e_tensorboard: $FAILS failure(s) in $((SECONDS - T0)) s"
[ "$FAILS" -eq 0 ]
