#!/usr/bin/env bash
# e2e_gpt.sh - ampc-train --model gpt on a real text Debian ships (fortunes' "computers", 238 KB,
# read as bytes): under autocast it trains until the held-out tail's loss is clearly below the
# unigram baseline ampc-train prints (0.5 nats below), samples text at the end, evaluates and
# samples again from the checkpoint (the same validation loss: the same weights), continues a run
# stopped mid-epoch to the very figures of an uninterrupted one, loads its weights back from
# Hugging Face's GPT-2 layout through scripts/gpt2_to_safetensors.py, trains on an llm.c .bin of
# GPT-2 tokens, and refuses bad command lines with a clear line.
#
#     bash tests/e2e_gpt.sh BUILD/ampc-train
#
# Skipped (exit 0, "SKIP: ...") when Debian's fortunes package is missing (scripts/install-deps.sh
# installs it). About a minute on 2 cores. AMPC_E2E_QUICK=1 (the sanitizer build, where training
# runs 10-20x slower) trains a few steps instead and checks everything but the loss's level.
set -u
TRAIN=${1:?usage: e2e_gpt.sh AMPC_TRAIN}
TEXT=/usr/share/games/fortunes/computers
if [ ! -r "$TEXT" ]; then
    echo "SKIP: $TEXT not found (Debian's fortunes: scripts/install-deps.sh)"
    exit 0
fi
. "$(dirname "$0")/e2e_lib.sh" e2e_gpt no-fashion-mnist
QUICK=${AMPC_E2E_QUICK:-0}
TRAIN_ARGS=(--epochs 4)
PART_ARGS=(--epochs 2 --limit-train 1600)
if [ "$QUICK" = 1 ]; then
    TRAIN_ARGS=(--epochs 1 --limit-train 640)
    PART_ARGS=(--epochs 2 --limit-train 320 --limit-val 64)
fi
MODEL=(--model gpt --data "$TEXT" --n-layer 2 --n-head 4 --n-embd 64 --block-size 64 --batch-size 32 --lr 3e-3 --progress off)

field() { grep -o "$2 [0-9.]*" "$1" | tail -1 | awk '{ print $NF }'; }

# --- training: below the unigram baseline, and a sample
if run train "${MODEL[@]}" "${TRAIN_ARGS[@]}" --sample 300 --out "$W/run"; then
    base=$(field "$W/train.out" "unigram baseline: validation loss")
    final=$(grep '^  final:' "$W/train.out" | grep -o 'validation loss [0-9.]*' | awk '{ print $3 }')
    if [ "$QUICK" = 1 ]; then ok "validation loss $final after a few steps (AMPC_E2E_QUICK: its level not checked)"
    elif awk -v f="$final" -v b="$base" 'BEGIN { exit !(f < b - 0.5) }'; then ok "validation loss $final, unigram baseline $base"
    else bad "validation loss $final is not 0.5 below the unigram baseline $base"; fi
    grep -q 'perplexity' "$W/train.out" && ok "perplexity reported" || bad "no perplexity"
    n=$(awk '/^sample: /{ s = 1; next } s' "$W/train.out" | wc -c)
    [ "$n" -ge 300 ] && ok "a sample of $n bytes" || bad "the sample has $n bytes, not 300"
    epochs=${TRAIN_ARGS[1]}
    [ "$(($(wc -l <"$W/run/metrics.csv") - 1))" -eq "$epochs" ] && ok "metrics.csv: $epochs epoch(s)" || bad "metrics.csv rows"
    grep -q '^  n-embd  *64' "$W/train.out" && ok "the model's shape in the configuration" || bad "no n-embd line"
fi

# --- the checkpoint: evaluated (the same loss) and sampled from a prompt
if run eval --eval-only yes --resume "$W/run/checkpoint.safetensors" --sample 80 --prompt "The " --progress off; then
    got=$(grep '^evaluation:' "$W/eval.out" | grep -o 'loss [0-9.]*' | awk '{ print $2 }')
    [ "$got" = "$final" ] && ok "evaluation from the checkpoint: loss $got" || bad "evaluation loss $got, training ended at $final"
    awk '/^sample: /{ getline; exit !/^The / }' "$W/eval.out" && ok "the sample continues the prompt" || bad "the sample does not start with the prompt"
fi

# --- Hugging Face's GPT-2 layout (no "transformer." prefix, Conv1D weights (in, out), mask
#     buffers, no lm_head) made from the trained weights here, converted back by
#     scripts/gpt2_to_safetensors.py and evaluated: the very loss of the checkpoint
PY=$(command -v python3)
if [ -n "$PY" ] && "$PY" - "$W/run/model.safetensors" "$W/hf.safetensors" <<'PYEOF'
import json, struct, sys
def load(p):
    d = open(p, "rb").read(); n = struct.unpack("<Q", d[:8])[0]; h = json.loads(d[8:8 + n])
    return {k: (v["dtype"], v["shape"], d[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]]) for k, v in h.items() if k != "__metadata__"}
t, out = load(sys.argv[1]), {}
for k, (dt, shape, raw) in t.items():
    if k == "lm_head.weight": continue
    k = k[len("transformer."):]
    if k.split(".")[-2] in ("c_attn", "c_proj", "c_fc") and k.endswith("weight"):   # (out, in) -> Conv1D's (in, out)
        r, c = shape; v = struct.unpack("<%df" % (r * c), raw)
        raw = struct.pack("<%df" % (r * c), *[v[i * c + j] for j in range(c) for i in range(r)]); shape = [c, r]
    out[k] = (dt, shape, raw)
    if k.endswith("ln_1.weight"):   # the mask buffer Hugging Face's older files hold
        out[k.replace("ln_1.weight", "attn.bias")] = ("F32", [1, 1, 2, 2], struct.pack("<4f", 1, 0, 1, 1))
hdr, off, blobs = {}, 0, []
for k in sorted(out):
    dt, shape, raw = out[k]; hdr[k] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(raw)]}; off += len(raw); blobs.append(raw)
h = json.dumps(hdr).encode(); h += b" " * (-len(h) % 8)
open(sys.argv[2], "wb").write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
PYEOF
then
    if "$PY" "$(dirname "$0")/../scripts/gpt2_to_safetensors.py" "$W/hf.safetensors" "$W/converted.safetensors" >"$W/convert.out" 2>&1 &&
        grep -q -- "--n-layer 2 --n-embd 64" "$W/convert.out" &&
        run hf "${MODEL[@]}" --eval-only yes --pretrained "$W/converted.safetensors"; then
        got=$(grep '^evaluation:' "$W/hf.out" | grep -o 'loss [0-9.]*' | awk '{ print $2 }')
        [ "$got" = "$final" ] && ok "GPT-2 layout converted and loaded strictly: loss $got" || bad "converted weights: loss $got, not $final"
    else
        bad "gpt2_to_safetensors.py: $(tail -2 "$W/convert.out" "$W/hf.out" 2>/dev/null)"
    fi
else
    echo "skip: no python3 for the GPT-2 conversion"
fi

# --- stopped after 15 steps (in the first epoch, or the second when quick) and continued: the figures of an uninterrupted run
if run whole "${MODEL[@]}" "${PART_ARGS[@]}" --out "$W/whole" &&
    run part "${MODEL[@]}" "${PART_ARGS[@]}" --stop-after-steps 15 --out "$W/part" &&
    run rest --resume "$W/part/checkpoint.safetensors" --progress off; then
    a=$(grep '^epoch 2/2' "$W/whole.out" | grep -o 'val loss [0-9.]*')
    b=$(grep '^epoch 2/2' "$W/rest.out" | grep -o 'val loss [0-9.]*')
    [ -n "$a" ] && [ "$a" = "$b" ] && ok "a continued run ends as the uninterrupted one ($a)" || bad "continued '$b' vs uninterrupted '$a'"
fi

# --- llm.c's .bin: a header of 256 int32 (20240520, 1, count) and uint16 GPT-2 tokens
perl -e 'my $n = 20000; print pack("l<3", 20240520, 1, $n), "\0" x (1024 - 12);
         print pack("S<*", map { ($_ * 7919 + int($_ / 3)) % 50257 } 0 .. $n - 1)' >"$W/tokens.bin"
if run bin --model gpt --data "$W/tokens.bin" --n-layer 1 --n-head 2 --n-embd 32 --block-size 32 --batch-size 16 --epochs 1 \
    --limit-train 64 --limit-val 16 --sample 5 --progress off --out "$W/bin"; then
    grep -q 'vocabulary 50257' "$W/bin.out" && ok "llm.c tokens: GPT-2's vocabulary" || bad "no vocabulary 50257 line"
    awk '/^sample: /{ getline; exit !/^50256 [0-9]+ [0-9]+ [0-9]+ [0-9]+ [0-9]+/ }' "$W/bin.out" && ok "token ids sampled after <|endoftext|>" ||
        bad "the .bin sample: $(awk '/^sample: /{ getline; print }' "$W/bin.out")"
fi

# --- refusals: exit status and the line that names the problem
refuse() {
    local want=$1 text=$2
    shift 2
    "$TRAIN" "$@" --progress off >"$W/refuse.out" 2>&1
    local rc=$?
    if [ $rc -eq "$want" ] && grep -qF -- "$text" "$W/refuse.out" && ! grep -qE 'Sanitizer|runtime error' "$W/refuse.out"; then ok "refused: $text"
    else bad "exit $rc (want $want) for $*: $(tail -1 "$W/refuse.out")"; fi
}
refuse 2 "--model gpt needs --data FILE" --model gpt --out "$W/x1"
refuse 1 "No such file" --model gpt --data "$W/none.txt" --out "$W/x2"
refuse 2 "--sample generates text with a language model" --model mlp --sample 5 --epochs 0 --out "$W/x3"
refuse 1 "n_embd a multiple of n_head" --model gpt --data "$TEXT" --n-embd 66 --n-head 4 --epochs 0 --out "$W/x4"
refuse 2 "--model gpt's output head is its token embedding" --model gpt --data "$TEXT" --freeze backbone --epochs 0 --out "$W/x6"
refuse 1 "fewer than the 2048 (twice the block size 1024)" --model gpt --data /usr/share/common-licenses/BSD --block-size 1024 --epochs 0 --out "$W/x5"

if [ $FAILS -ne 0 ]; then
    echo "e2e_gpt: $FAILS failure(s)"
    exit 1
fi
echo "e2e_gpt: all passed"
