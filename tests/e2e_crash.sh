#!/usr/bin/env bash
# e2e_crash.sh - kill ampc-train with SIGKILL at random points, then resume it until it finishes:
# every run must end with the weights, optimizer state and metrics of an uninterrupted run, and
# no run may lose its last checkpoint or leave a temporary file behind.
#
#     bash tests/e2e_crash.sh BUILD/ampc-train [RUNS]     (RUNS: default $CRASH_RUNS or 20)
#
# Each run is killed at least once: half of the kills at a random moment of the run, half the
# moment a checkpoint's temporary file appears (in the middle of the write). Runs killed before
# their first checkpoint start again from scratch, as a user would. Skipped (exit 0) only when
# the Fashion-MNIST files are missing.
set -u
TRAIN=${1:?usage: e2e_crash.sh AMPC_TRAIN [RUNS]}
RUNS=${2:-${CRASH_RUNS:-20}}
. "$(dirname "$0")/e2e_lib.sh" e2e_crash
RANDOM=${CRASH_SEED:-$$}

ARGS=(--model mlp --limit-train 1024 --limit-val 128 --batch-size 64 --epochs 3 --progress off --amp-dtype fp16)
ts=$(date +%s%N)
"$TRAIN" "${ARGS[@]}" --out "$W/ref" >"$W/ref.out" 2>&1 || { echo "FAIL: the reference run failed"; cat "$W/ref.out"; exit 1; }
ref_ms=$((($(date +%s%N) - ts) / 1000000))
echo "reference run: ${ref_ms} ms"

# No run may hang: one that outlives LIMIT seconds (30 reference runs, at least 60 s) is a
# failure, reported with what its threads were doing (wchan, gdb's backtraces where gdb may attach),
# then killed, so a hang names itself instead of running into ctest's timeout.
LIMIT=${CRASH_LIMIT:-$((ref_ms * 30 / 1000))}; [ -z "${CRASH_LIMIT:-}" ] && [ $LIMIT -lt 60 ] && LIMIT=60
hung() {   # hung PID RUN: report and kill a run past LIMIT
    bad "run $2: ampc-train (pid $1) still running after $LIMIT s; its threads (state, wchan):"
    for t in /proc/"$1"/task/*; do
        echo "  thread ${t##*/}: $(awk '{ print $3 }' "$t/stat" 2>/dev/null) $(cat "$t/wchan" 2>/dev/null)"
    done
    command -v gdb >/dev/null && timeout 60 gdb -p "$1" -batch -ex 'thread apply all bt' 2>&1 | grep -E '^(Thread|#)' | head -80
    echo "  its stderr: $(tail -5 "$d.err" | tr '\n' ' ')"
    kill -KILL "$1" 2>/dev/null
}
alive_within() {   # alive_within PID START: true while PID runs and LIMIT has not passed since START
    kill -0 "$1" 2>/dev/null || return 1
    [ $((SECONDS - $2)) -le $LIMIT ] && return 0
    hung "$1" "$i"
    return 1
}

kills=0 mid_write=0 retries=0 hangs=0
shopt -s nullglob
for ((i = 1; i <= RUNS; i++)); do
    d="$W/r$i"
    mode=$((i % 2))   # 0: a random moment; 1: while a checkpoint is being written
    killed=0
    # the bound of the random moment; halved each time a run finishes before its kill lands (the
    # reference run may have been slow: cold page cache, a busy machine)
    bound_ms=$((ref_ms * 8 / 10))
    for ((attempt = 0; attempt < 50; attempt++)); do
        if [ -s "$d/checkpoint.safetensors" ]; then
            cmd=(--resume "$d/checkpoint.safetensors")
        else
            cmd=("${ARGS[@]}" --out "$d" --overwrite yes)   # what a kill before the first checkpoint left is replaced
        fi
        "$TRAIN" "${cmd[@]}" >"$d.out" 2>"$d.err" &
        pid=$! started=$SECONDS
        if [ $killed -eq 0 ]; then
            if [ $mode -eq 0 ]; then
                sleep "$(awk -v r=$RANDOM -v t="$bound_ms" 'BEGIN { printf "%.3f", r / 32768 * t / 1000 }')"
            else
                # the n-th checkpoint write of the run (n = 1..3), caught while its temporary exists
                n=$((RANDOM % 3 + 1)) seen=0 last=""
                while alive_within $pid $started; do
                    tmps=("$d"/checkpoint.safetensors.tmp.*)
                    if [ ${#tmps[@]} -gt 0 ] && [ "${tmps[0]}" != "$last" ]; then
                        seen=$((seen + 1)) last=${tmps[0]}
                        [ $seen -ge $n ] && break
                    fi
                done
            fi
            if kill -KILL $pid 2>/dev/null; then
                killed=1 kills=$((kills + 1))
                tmps=("$d"/checkpoint.safetensors.tmp.*)
                [ $mode -eq 1 ] && [ ${#tmps[@]} -gt 0 ] && mid_write=$((mid_write + 1))
            fi
        fi
        while alive_within $pid $started; do sleep 0.05; done
        wait $pid 2>/dev/null
        rc=$?
        [ $((SECONDS - started)) -gt $LIMIT ] && { hangs=$((hangs + 1)); rc=1; break; }
        if [ $rc -eq 0 ] && [ $killed -eq 0 ] && [ $attempt -lt 12 ]; then
            # finished before the kill landed: start this run again, killing at a random moment
            # of a shorter window (12 halvings reach a few milliseconds, still inside the run)
            rm -rf "$d"
            retries=$((retries + 1)) mode=0
            [ $attempt -gt 0 ] && bound_ms=$((bound_ms / 2))
            continue
        fi
        [ $rc -eq 0 ] && break
        if [ $rc -ne 137 ]; then
            bad "run $i: exit $rc: $(tail -2 "$d.err" | tr '\n' ' ')"
            break
        fi
        # what survived the kill is a complete checkpoint or none: never a torn file
        if [ -e "$d/checkpoint.safetensors" ] && ! "$TRAIN" --compare-checkpoints "$d/checkpoint.safetensors" "$d/checkpoint.safetensors" >/dev/null 2>&1; then
            bad "run $i: the checkpoint left by the kill is unreadable"
            break
        fi
    done
    [ $hangs -ge 2 ] && { bad "two runs hung: the remaining runs are not tried"; break; }
    if [ $rc -eq 0 ]; then
        if "$TRAIN" --compare-checkpoints "$W/ref/checkpoint.safetensors" "$d/checkpoint.safetensors" >"$d.cmp"; then
            :
        else
            bad "run $i (killed $killed time(s), mode $mode): tensors differ from the uninterrupted run: $(head -3 "$d.cmp" | tr '\n' ' ')"
        fi
        cmp -s <(cut -d, -f1-5,8,9 "$W/ref/metrics.csv") <(cut -d, -f1-5,8,9 "$d/metrics.csv") ||
            bad "run $i: metrics.csv differs: $(diff <(cut -d, -f1-5 "$W/ref/metrics.csv") <(cut -d, -f1-5 "$d/metrics.csv") | tr '\n' ' ')"
        left=("$d"/*.tmp.*)
        [ ${#left[@]} -gt 0 ] && bad "run $i: temporary files left: ${left[*]}"
    fi
    rm -rf "$d" "$d".*
done
[ $kills -ge "$RUNS" ] || bad "only $kills SIGKILLs landed in $RUNS runs"
echo "e2e_crash: $RUNS runs, $kills SIGKILLs ($mid_write during a checkpoint write, $retries run(s) restarted because they finished first, $hangs hung), $FAILS failure(s) in $((SECONDS - T0)) s"
[ "$FAILS" -eq 0 ]
