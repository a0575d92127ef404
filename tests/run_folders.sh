#!/usr/bin/env bash
# run_folders.sh - every ampc-train run gets its own folder and none is ever overwritten:
# runs/<date>-<time> by default (a suffix when two start in the same second), runs/<--name>, or
# --out; runs/latest links to the newest; a folder that holds a run is refused (the run's files
# untouched) unless --overwrite yes, which deletes that run's files (and only those) first; a
# resumed run continues in its own folder; a "latest" that is not a link is left alone.
#
#     bash tests/run_folders.sh BUILD/ampc-train
#
# Skipped (exit 0) only when the Fashion-MNIST files are missing. Each run trains one epoch of 64
# samples of the mlp (about a second).
set -u
TRAIN=$(realpath "${1:?usage: run_folders.sh AMPC_TRAIN}")
. "$(dirname "$0")/e2e_lib.sh" run_folders
cd "$W" || exit 1
Q=(--model mlp --limit-train 64 --limit-val 32 --batch-size 32 --epochs 1 --progress off)

# t NAME WANT_RC ARGS...: runs ampc-train in $W, output in NAME.out/.err; a failure unless its
# exit status is WANT_RC
t() {
    local name=$1 want=$2
    shift 2
    "$TRAIN" "$@" >"$name.out" 2>"$name.err"
    local rc=$?
    [ $rc -eq "$want" ] && return 0
    bad "$name: exit $rc (want $want): $* :: $(tail -2 "$name.err" | tr '\n' ' ')"
    return 1
}
sum() { md5sum "$@" 2>/dev/null | awk '{ print $1 }' | tr '\n' ' '; }

# 1. two runs with no --out: two folders, runs/latest at the second, the first untouched
t a1 0 "${Q[@]}"
first=$(readlink runs/latest)
before=$(sum "runs/$first/metrics.csv" "runs/$first/checkpoint.safetensors")
t a2 0 "${Q[@]}"
second=$(readlink runs/latest)
n=$(find runs -mindepth 1 -maxdepth 1 -type d | wc -l)
if [[ "$first" =~ ^[0-9]{8}-[0-9]{6}(-[0-9]+)?$ ]] && [ "$second" != "$first" ] && [ "$n" -eq 2 ] &&
    [ -s "runs/$second/metrics.csv" ] && [ "$(sum "runs/$first/metrics.csv" "runs/$first/checkpoint.safetensors")" = "$before" ]; then
    ok "two runs: runs/$first and runs/$second, latest -> $second, the first untouched"
else
    bad "two runs: folders '$first' '$second' ($n in runs/), latest -> $(readlink runs/latest)"
fi
grep -q "outputs: runs/$second/" a2.out || bad "the outputs line does not name runs/$second: $(grep outputs: a2.out)"

# 2. --name, twice: the second is refused and the first run's files are untouched
t n1 0 "${Q[@]}" --name exp && [ "$(readlink runs/latest)" = exp ] && ok "--name exp: runs/exp, latest -> exp" ||
    bad "--name exp: latest -> $(readlink runs/latest)"
echo "my notes" >runs/exp/notes.txt
touch runs/exp/scale.png   # as if an fp16 run had drawn it: this fp32-free run would not redraw it
before=$(sum runs/exp/metrics.csv runs/exp/checkpoint.safetensors runs/exp/model.safetensors)
if t n2 1 "${Q[@]}" --name exp --lr 0.5 && grep -q "holds an earlier run" n2.err &&
    [ "$(sum runs/exp/metrics.csv runs/exp/checkpoint.safetensors runs/exp/model.safetensors)" = "$before" ]; then
    ok "--name exp again: refused ($(grep -o "error: .*" n2.err | cut -c1-90)...), files untouched"
else
    bad "--name exp again: not refused, or the first run's files changed"
fi

# 3. --overwrite yes: that run's files go first (a stale plot too); the user's own file stays
if t n3 0 "${Q[@]}" --name exp --use-amp no --overwrite yes && [ ! -e runs/exp/scale.png ] && [ -s runs/exp/notes.txt ] &&
    [ "$(sum runs/exp/metrics.csv)" != "$(echo "$before" | cut -d' ' -f1)" ] && grep -q "use-amp.*no" n3.out; then
    ok "--overwrite yes: replaced, the stale scale.png deleted, notes.txt kept"
else
    bad "--overwrite yes: scale.png $( [ -e runs/exp/scale.png ] && echo kept || echo gone), notes.txt $( [ -e runs/exp/notes.txt ] && echo kept || echo gone)"
fi

# 4. --out: refused a second time; --resume continues in it; resuming into another run's folder is refused
t o1 0 "${Q[@]}" --out mine
t o2 1 "${Q[@]}" --out mine && grep -q "holds an earlier run" o2.err && ok "--out mine again: refused" || bad "--out mine again: $(tail -1 o2.err)"
t o3 0 --resume mine/checkpoint.safetensors --epochs 2 --progress off && [ "$(wc -l <mine/metrics.csv)" -eq 3 ] &&
    ok "--resume mine/checkpoint.safetensors: continued in mine (2 epochs in metrics.csv)" || bad "--resume in its own folder"
t o4 1 --resume mine/checkpoint.safetensors --epochs 3 --out runs/exp --progress off && grep -q "holds an earlier run" o4.err &&
    ok "--resume into another run's folder: refused" || bad "--resume into another run's folder: $(tail -1 o4.err)"
[ "$(readlink runs/latest)" = exp ] || bad "--out or --resume moved runs/latest to $(readlink runs/latest)"

# 5. bad names and flags: usage errors (exit 2), no folder made
t u1 2 "${Q[@]}" --name ../escape && t u2 2 "${Q[@]}" --name latest && t u3 2 "${Q[@]}" --name x --out y &&
    t u4 2 --resume mine/checkpoint.safetensors --name z && [ ! -e escape ] && [ ! -e y ] && [ ! -e runs/x ] && [ ! -e runs/z ] &&
    ok "--name ../escape, --name latest, --name with --out, --name with --resume: usage errors" || bad "bad --name cases"

# 6. --epochs 0 prints the setup and makes no folder; --compare makes one pair's folder
n0=$(find runs -mindepth 1 -maxdepth 1 | wc -l)
t e0 0 --model mlp --epochs 0 && [ "$(find runs -mindepth 1 -maxdepth 1 | wc -l)" -eq "$n0" ] && ok "--epochs 0: no folder" ||
    bad "--epochs 0 made a folder"
t c1 0 "${Q[@]}" --compare --name pair && [ -s runs/pair/fp32/metrics.csv ] && [ -s runs/pair/amp/metrics.csv ] &&
    [ "$(readlink runs/latest)" = pair ] && ok "--compare --name pair: runs/pair/{fp32,amp}, latest -> pair" || bad "--compare --name pair"
t c2 1 "${Q[@]}" --compare --name pair && grep -q "holds an earlier run" c2.err && ok "--compare --name pair again: refused" ||
    bad "--compare --name pair again: $(tail -1 c2.err)"

# 7. a runs/latest that is a folder (an older ampc-train's default): left as it is, with a warning
mkdir -p old/runs/latest && echo keep >old/runs/latest/metrics.csv
(cd old && "$TRAIN" "${Q[@]}" >../l1.out 2>../l1.err)
if [ $? -eq 0 ] && [ "$(cat old/runs/latest/metrics.csv)" = keep ] && grep -q "not a link" l1.err; then
    ok "runs/latest a folder: kept, with a warning"
else
    bad "runs/latest a folder: $(tail -2 l1.err | tr '\n' ' ')"
fi

ls runs/*.tmp.* .*.tmp.* 2>/dev/null && bad "temporary files left"
echo "run_folders: $FAILS failure(s) in $((SECONDS - T0)) s"
[ "$FAILS" -eq 0 ]
