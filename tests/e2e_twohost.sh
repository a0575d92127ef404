#!/usr/bin/env bash
# e2e_twohost.sh - ampc-train and test_dist as MPI jobs over two "hosts" of the test's own making
# (issue 13): two Linux network namespaces joined by a veth pair, each with its own address and
# host name. mpirun runs in the first, reads a hostfile naming both addresses, and starts the
# second host's daemon through a launch agent that takes ssh's place (`ip netns exec` instead
# of a login); the ranks talk over TCP only, so every byte between them crosses the veth, whose
# counters prove it. Needs root with CAP_NET_ADMIN, iproute2 and unshare; exits 77 (skipped)
# without them.
#
#     bash tests/e2e_twohost.sh AMPC_TRAIN MPIRUN [TEST_DIST]
set -u
[ $# -ge 2 ] || { echo "usage: e2e_twohost.sh AMPC_TRAIN MPIRUN [TEST_DIST]" >&2; exit 2; }
TRAIN=$(readlink -f "$1")   # absolute: each rank starts in a folder of its own
MPIRUN=$2
TEST_DIST=${3:-$(dirname "$TRAIN")/test_dist}
. "$(dirname "$0")/e2e_lib.sh" e2e_twohost
skip() { echo "SKIP: $*"; exit 77; }

# the two hosts: names unique to this run (parallel runs each have their own namespaces, so the
# same private addresses do not collide); the veth ends live inside them and go with them
H1=ampc-h1-$$ H2=ampc-h2-$$ V1=ampc$$a V2=ampc$$b
NET=10.213.7.0/24 A1=10.213.7.1 A2=10.213.7.2
# a process left in a namespace (a stray daemon) would keep it and its veth alive
del_ns() {
    local p
    for p in $(ip netns pids "$1" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
    ip netns del "$1" 2>/dev/null
}
cleanup() {
    del_ns "$H1"
    del_ns "$H2"
    ip link del "$V1" 2>/dev/null
    rm -rf "$W"
}
trap cleanup EXIT
trap 'exit 129' HUP
trap 'exit 130' INT
trap 'exit 143' TERM

command -v ip >/dev/null || skip "no 'ip' command (install iproute2: scripts/install-deps.sh)"
# namespaces of earlier runs killed before their cleanup could run (SIGKILL at a test's timeout)
for ns in $(ip netns list 2>/dev/null | grep -o '^ampc-h[12]-[0-9]*'); do
    kill -0 "${ns##*-}" 2>/dev/null || del_ns "$ns"
done
command -v unshare >/dev/null || skip "no 'unshare' command (util-linux)"
ip netns add "$H1" 2>"$W/netns.err" || skip "'ip netns add' refused (needs root with CAP_NET_ADMIN): $(head -1 "$W/netns.err")"
ip netns add "$H2" 2>"$W/netns.err" || skip "'ip netns add' refused: $(head -1 "$W/netns.err")"
ip netns exec "$H1" true 2>"$W/netns.err" || skip "'ip netns exec' refused: $(head -1 "$W/netns.err")"
ip link add "$V1" netns "$H1" type veth peer name "$V2" netns "$H2" 2>"$W/netns.err" ||
    skip "no veth pair: $(head -1 "$W/netns.err")"
unshare --uts true 2>"$W/netns.err" || skip "'unshare --uts' refused: $(head -1 "$W/netns.err")"
ip -n "$H1" addr add "$A1/24" dev "$V1" && ip -n "$H2" addr add "$A2/24" dev "$V2" &&
    ip -n "$H1" link set lo up && ip -n "$H2" link set lo up &&
    ip -n "$H1" link set "$V1" up && ip -n "$H2" link set "$V2" up || { bad "could not set up the veth"; exit 1; }

# the hostfile names the two hosts by address, one slot each; the launch agent is called as
# ssh would be ("AGENT HOST COMMAND...") and runs the command in the namespace owning HOST,
# under that host's name and, like a fresh login, with a clean environment (what the ranks
# need travels with -x)
printf '%s slots=1\n%s slots=1\n' "$A1" "$A2" >"$W/hosts"
cat >"$W/agent" <<EOF
#!/bin/sh
host=\$1; shift
case \$host in
  $A1) ns=$H1 ;;
  $A2) ns=$H2 ;;
  *) echo "agent: unknown host \$host" >&2; exit 255 ;;
esac
echo "agent: \$host -> namespace \$ns" >>"$W/agent.log"
exec env -i PATH="$PATH" ip netns exec "\$ns" unshare --uts sh -c 'hostname "\$0" && exec sh -c "\$1"' "\$ns" "\$*"
EOF
chmod +x "$W/agent"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
FWD=(-x OMP_NUM_THREADS)
for v in AMPC_FASHION_MNIST_DIR ASAN_OPTIONS UBSAN_OPTIONS; do [ -n "${!v:-}" ] && FWD+=(-x "$v"); done
# mpirun on host 1 (rank 0 runs there, locally); TCP between the hosts, no shared memory
MPI=(ip netns exec "$H1" unshare --uts sh -c 'hostname "$0" && exec "$@"' "$H1"
    "$MPIRUN" --hostfile "$W/hosts" -np 2 --mca plm_rsh_agent "$W/agent"
    --mca btl tcp,self --mca btl_tcp_if_include "$NET" --mca oob_tcp_if_include "$NET" "${FWD[@]}")
# the veth's byte counters seen from host 1
counter() { ip netns exec "$H1" cat "/sys/class/net/$V1/statistics/$1"; }
# every process of the job has left both namespaces
# a job runs in the background so that a signal to this script is handled at once (bash runs a
# trap only once the foreground command has ended); cleanup kills what is left of it
job() { "$@" & wait $!; }
none_left() { [ -z "$(ip netns pids "$H1")$(ip netns pids "$H2")" ]; }
# mpirun may return before the daemon it started on host 2 has ended (under load, or once that
# daemon finds host 1 gone): give the job's processes a bounded 20 s to leave
wait_none_left() { local _; for _ in $(seq 20); do none_left && return 0; sleep 1; done; none_left; }
sanitizer_clean() { ! grep -qE 'Sanitizer|runtime error' "$1"; }

# 1. ampc-train on the two hosts: each rank reports its namespace and host name and works in a
#    folder of its host's own; --out is relative, so an output of rank 1 would land on host 2
rx0=$(counter rx_bytes) tx0=$(counter tx_bytes)
job "${MPI[@]}" sh -c 'ns=$(ip netns identify $$); echo "rank $OMPI_COMM_WORLD_RANK in $ns on $(hostname)" >>"$1/ranks.log"
    mkdir -p "$1/$ns" && cd "$1/$ns" && shift && exec "$@"' rank "$W" \
    "$TRAIN" --limit-train 512 --limit-val 128 --batch-size 32 --threads 1 --progress off --use-amp no --epochs 1 \
    --out out >"$W/train.out" 2>"$W/train.err"
rc=$?
rx=$(($(counter rx_bytes) - rx0)) tx=$(($(counter tx_bytes) - tx0))
if [ $rc -eq 0 ] && sanitizer_clean "$W/train.err" &&
    grep -q "world          2 processes (MPI), batch 32 each: global batch 64" "$W/train.out" &&
    grep -q "^epoch 1/1: train loss" "$W/train.out"; then
    ok "2 ranks on 2 hosts: trained 1 epoch, the configuration names the world of 2"
else
    bad "2 ranks on 2 hosts: exit $rc"; tail -n 20 "$W/train.out" "$W/train.err"
fi
if grep -qx "rank 0 in $H1 on $H1" "$W/ranks.log" && grep -qx "rank 1 in $H2 on $H2" "$W/ranks.log" &&
    grep -qx "agent: $A2 -> namespace $H2" "$W/agent.log" && ! grep -q "$A1" "$W/agent.log"; then
    ok "rank 0 ran on host 1 ($H1), rank 1 on host 2 ($H2), started through the agent"
else
    bad "ranks not on their hosts"; cat "$W/ranks.log" "$W/agent.log"
fi
if [ -s "$W/$H1/out/checkpoint.safetensors" ] && [ "$(wc -l <"$W/$H1/out/metrics.csv")" -eq 2 ] &&
    [ -d "$W/$H2" ] && [ -z "$(ls -A "$W/$H2")" ]; then
    ok "rank 0 alone wrote the outputs (host 2's folder stays empty)"
else
    bad "outputs"; ls -lR "$W/$H1" "$W/$H2"
fi
# the gradients crossed the veth: a 2-rank all-reduce sends and receives about one gradient
# (parameters x 4 bytes in fp32) per step each way; assert at least half of that
params=$(sed -n 's/^\([0-9,]*\) total parameters\.$/\1/p' "$W/train.out" | tr -d ,)
samples=$(sed -n 's/^data: \([0-9,]*\) training samples.*/\1/p' "$W/train.out" | tr -d ,)
steps=$((${samples:-0} / 64))
need=$((${params:-0} * 4 * steps / 2))
if [ "$need" -gt 0 ] && [ "$rx" -ge "$need" ] && [ "$tx" -ge "$need" ]; then
    ok "over the veth: $rx bytes in, $tx out for $steps steps ($((rx / steps)) per step; gradients $((params * 4)) bytes, asserted >= $need each way)"
else
    bad "over the veth: $rx bytes in, $tx out; expected >= $need ($params parameters, $steps steps)"
fi
wait_none_left && ok "no process of the job left on either host" || { bad "processes left"; ip netns pids "$H1"; ip netns pids "$H2"; }

# 2. test_dist across the hosts: 2 ranks x 32 against 1 x 64, the scaler, SyncBatchNorm
t0=$SECONDS
job "${MPI[@]}" "$TEST_DIST" >"$W/dist.out" 2>&1
rc=$?
if [ $rc -eq 0 ] && grep -q "^\[  PASSED  \]" "$W/dist.out" && ! grep -q "FAILED" "$W/dist.out" && sanitizer_clean "$W/dist.out"; then
    ok "test_dist passes with its 2 ranks on 2 hosts ($((SECONDS - t0)) s)"
else
    bad "test_dist on 2 hosts: exit $rc"; tail -30 "$W/dist.out"
fi

# so that what is left after the next job is that job's own
wait_none_left && ok "no process of test_dist's job left on either host" || { bad "test_dist's processes left"; ip netns pids "$H1"; ip netns pids "$H2"; }

# 3. the hosts cannot reach each other (host 1's end of the veth down): the job ends, non-zero,
#    within the 60 s it is given, with one of Open MPI's messages for it (which one depends on
#    where its daemon launch stands when the link is found dead), and leaves no process behind
ip -n "$H1" link set "$V1" down
t0=$SECONDS
job timeout 60 "${MPI[@]}" "$TRAIN" --limit-train 512 --limit-val 128 --batch-size 32 --threads 1 --progress off \
    --epochs 1 --out "$W/down" >"$W/down.out" 2>&1
rc=$?
took=$((SECONDS - t0))
wait_none_left
why=
[ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $took -lt 60 ] || why="exit $rc after $took s"
grep -qE "unable to reliably start one or more daemons|does not know how to route a message to the specified daemon" "$W/down.out" ||
    why="$why; neither of Open MPI's messages for an unreachable host"
[ ! -e "$W/down" ] || why="$why; the output folder was made"
none_left || why="$why; processes left 20 s after mpirun ended: $(ip netns pids "$H1" | tr '\n' ' ')/ $(ip netns pids "$H2" | tr '\n' ' ')"
if [ -z "$why" ]; then
    ok "unreachable host: the job ended in $took s with exit $rc and nothing left running"
else
    bad "unreachable host: ${why#; }"; tail -20 "$W/down.out"
    for p in $(ip netns pids "$H1") $(ip netns pids "$H2"); do ps -o pid=,etimes=,args= -p "$p"; done
fi

echo "e2e_twohost: $FAILS failure(s) in $((SECONDS - T0)) s"
[ "$FAILS" -eq 0 ]
