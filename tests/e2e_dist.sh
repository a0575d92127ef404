#!/usr/bin/env bash
# e2e_dist.sh - ampc-train as an MPI job (issue 13): two ranks train with rank 0 alone writing
# and printing the global figures; a checkpoint written by 2 ranks resumes on 1 and one written
# by 1 on 2; a bad flag on one rank ends the job; SIGKILL of one rank ends the whole job within
# seconds with a non-zero status, and its last checkpoint still resumes.
#
#     bash tests/e2e_dist.sh AMPC_TRAIN MPIRUN
set -u
TRAIN=${1:?usage: e2e_dist.sh AMPC_TRAIN MPIRUN}
MPIRUN=${2:?usage: e2e_dist.sh AMPC_TRAIN MPIRUN}
. "$(dirname "$0")/e2e_lib.sh" e2e_dist
# Open MPI refuses root unless told so; a 2-core machine needs --oversubscribe for 2 ranks;
# containers often forbid the cross-process copies (CMA) of its shared-memory transport
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none
MPI=("$MPIRUN" --oversubscribe)
SMALL=(--limit-train 1024 --limit-val 256 --batch-size 32 --threads 1 --progress off --use-amp no)

sanitizer_clean() { ! grep -qE 'Sanitizer|runtime error' "$1"; }

# 1. two ranks: world and global batch in the configuration, rank 0's outputs only
"${MPI[@]}" -np 2 "$TRAIN" "${SMALL[@]}" --epochs 2 --out "$W/two" >"$W/two.out" 2>"$W/two.err"
rc=$?
if [ $rc -eq 0 ] && sanitizer_clean "$W/two.err" && grep -q "world          2 processes (MPI), batch 32 each: global batch 64" "$W/two.out" &&
    [ "$(grep -c '^epoch ' "$W/two.out")" -eq 2 ] && [ "$(wc -l <"$W/two/metrics.csv")" -eq 3 ] && [ -s "$W/two/checkpoint.safetensors" ]; then
    ok "2 ranks: trained 2 epochs, configuration names the world, rank 0 wrote the outputs"
else
    bad "2 ranks: exit $rc"; tail -n 20 "$W/two.out" "$W/two.err"
fi
# the printed figures are the job's: 1024 training samples per epoch over 16 steps of 64
if grep -q "summary: 2 epoch(s)" "$W/two.out" && ! grep -q "rank 1" "$W/two.err"; then
    ok "2 ranks: one summary, nothing from rank 1"
else
    bad "2 ranks: output of other ranks"; cat "$W/two.err"
fi

# 2. resume 2 -> 1 and 1 -> 2 at an epoch's end
"$TRAIN" --resume "$W/two/checkpoint.safetensors" --epochs 3 --threads 1 --progress off >"$W/r21.out" 2>"$W/r21.err"
rc=$?
if [ $rc -eq 0 ] && grep -q "resumed from .* after epoch 2" "$W/r21.out" && grep -q "^epoch 3/3" "$W/r21.out"; then
    ok "resume 2 -> 1 ranks"
else
    bad "resume 2 -> 1: exit $rc"; tail -n 5 "$W/r21.err"
fi
"$TRAIN" "${SMALL[@]}" --epochs 1 --out "$W/one" >"$W/one.out" 2>"$W/one.err" &&
    "${MPI[@]}" -np 2 "$TRAIN" --resume "$W/one/checkpoint.safetensors" --epochs 2 --threads 1 --progress off >"$W/r12.out" 2>"$W/r12.err"
rc=$?
if [ $rc -eq 0 ] && grep -q "world          2 processes" "$W/r12.out" && grep -q "^epoch 2/2" "$W/r12.out"; then
    ok "resume 1 -> 2 ranks"
else
    bad "resume 1 -> 2: exit $rc"; tail -n 5 "$W/r12.err"
fi

# 3. an error on one rank (only rank 1's file is missing) ends the job: one error naming the rank
t0=$SECONDS
"${MPI[@]}" -np 2 bash -c 'if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then exec "$0" --data /nonexistent "${@}"; else exec "$0" "$@"; fi' \
    "$TRAIN" "${SMALL[@]}" --epochs 50 --out "$W/err" >"$W/err.out" 2>"$W/err.err"
rc=$?
if [ $rc -ne 0 ] && grep -q "ampc-train: rank 1: error: .*nonexistent" "$W/err.err" && [ $((SECONDS - t0)) -lt 60 ]; then
    ok "error on rank 1 ended the job (exit $rc, $((SECONDS - t0)) s)"
else
    bad "error on rank 1: exit $rc after $((SECONDS - t0)) s"; tail -n 5 "$W/err.err"
fi

# 4. SIGKILL of rank 1 once the first checkpoint is written: the job ends, non-zero, within 60 s
"${MPI[@]}" -np 2 "$TRAIN" "${SMALL[@]}" --epochs 1000 --out "$W/kill" >"$W/kill.out" 2>"$W/kill.err" &
job=$!
for _ in $(seq 600); do [ -s "$W/kill/checkpoint.safetensors" ] && break; sleep 0.1; done
# the job's processes (mpirun, ranks) by their command line, from /proc (no procps needed)
job_pids() {
    local d
    for d in /proc/[0-9]*; do
        tr '\0' ' ' <"$d/cmdline" 2>/dev/null | grep -q -- "--out $W/kill" && echo "${d#/proc/}"
    done
}
victim=$(for p in $(job_pids); do
    tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx 'OMPI_COMM_WORLD_RANK=1' && echo "$p"; done | head -1)
t0=$SECONDS
if [ -n "$victim" ]; then kill -9 "$victim"; fi
for _ in $(seq 600); do kill -0 "$job" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$job" 2>/dev/null; then
    bad "SIGKILL of rank 1: the job still runs after 60 s"; kill -9 "$job" $(job_pids)
fi
wait "$job"
rc=$?
if [ -n "$victim" ] && [ $rc -ne 0 ] && [ $((SECONDS - t0)) -lt 60 ]; then
    ok "SIGKILL of rank 1 (pid $victim) ended the job in $((SECONDS - t0)) s with exit $rc"
else
    bad "SIGKILL of rank 1: victim '$victim', exit $rc"; tail -n 5 "$W/kill.err"
fi
"${MPI[@]}" -np 2 "$TRAIN" --resume "$W/kill/checkpoint.safetensors" --epochs 0 --threads 1 --progress off >"$W/kr.out" 2>"$W/kr.err"
rc1=$?
last=$(tail -1 "$W/kill/metrics.csv" | cut -d, -f1)
"${MPI[@]}" -np 2 "$TRAIN" --resume "$W/kill/checkpoint.safetensors" --epochs $((last + 1)) --threads 1 --progress off >"$W/kr2.out" 2>"$W/kr2.err"
rc2=$?
if [ $rc1 -eq 0 ] && [ $rc2 -eq 0 ] && grep -q "^epoch $((last + 1))/" "$W/kr2.out"; then
    ok "the killed job's checkpoint (after epoch $last) loads and --resume completes"
else
    bad "resume after the kill: exit $rc1, $rc2"; tail -n 5 "$W/kr.err" "$W/kr2.err"
fi

# 5. --sync-bn: ResNet-18's 20 BatchNorms become SyncBatchNorm and the job trains
"${MPI[@]}" -np 2 "$TRAIN" --model resnet18 --sync-bn --limit-train 64 --limit-val 32 --batch-size 8 --epochs 1 --threads 1 \
    --progress off --out "$W/sbn" >"$W/sbn.out" 2>"$W/sbn.err"
rc=$?
if [ $rc -eq 0 ] && grep -q "sync-bn        20 BatchNorm layers with the statistics of all 2 processes' batches" "$W/sbn.out" &&
    grep -q "^epoch 1/1" "$W/sbn.out"; then
    ok "--sync-bn: resnet18 trains with its 20 BatchNorms synchronised"
else
    bad "--sync-bn: exit $rc"; tail -n 5 "$W/sbn.out" "$W/sbn.err"
fi

# 6. --zero 1: the optimizer state sharded over the ranks trains the same run: its checkpoint (the
# state gathered on rank 0) is identical to the unsharded job's, weights and optimizer state
"${MPI[@]}" -np 2 "$TRAIN" "${SMALL[@]}" --epochs 1 --zero 1 --out "$W/zero" >"$W/zero.out" 2>"$W/zero.err"
rc=$?
"${MPI[@]}" -np 2 "$TRAIN" "${SMALL[@]}" --epochs 1 --out "$W/nozero" >"$W/nozero.out" 2>"$W/nozero.err"
rc2=$?
"$TRAIN" --compare-checkpoints "$W/zero/checkpoint.safetensors" "$W/nozero/checkpoint.safetensors" >"$W/zcmp.out" 2>&1
rc3=$?
if [ $rc -eq 0 ] && [ $rc2 -eq 0 ] && [ $rc3 -eq 0 ] && grep -q "^identical" "$W/zcmp.out" &&
    grep -q "zero           optimizer state shared out by parameter over 2 processes" "$W/zero.out"; then
    ok "--zero 1: the same checkpoint as unsharded training ($(grep -o 'optimizer state shared.*' "$W/zero.out"))"
else
    bad "--zero 1: exit $rc, $rc2, compare $rc3"; cat "$W/zcmp.out"; tail -n 5 "$W/zero.err"
fi

echo "e2e_dist: $FAILS failure(s) in $((SECONDS - T0)) s"
[ "$FAILS" -eq 0 ]
