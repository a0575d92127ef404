# e2e_lib.sh - sourced by the tests/e2e_*.sh scripts: the Fashion-MNIST check (SKIP, exit 0, when
# Debian's dataset-fashion-mnist is missing; not with a second argument "no-fashion-mnist"), a
# work folder $W removed at exit, ok/bad counters ($FAILS), the start time $T0, run (ampc-train
# $TRAIN into $W/NAME.out, a failure reported), and max_rel (the largest relative difference an
# ampc-train --compare-checkpoints report names).
#
#     . "$(dirname "$0")/e2e_lib.sh" NAME [no-fashion-mnist]
FM=${AMPC_FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}
if [ "${2:-}" != no-fashion-mnist ] && [ ! -e "$FM/train-images-idx3-ubyte.gz" ] && [ ! -e "$FM/train-images-idx3-ubyte" ]; then
    echo "SKIP: Fashion-MNIST not found in $FM (install dataset-fashion-mnist: scripts/install-deps.sh)"
    exit 0
fi
W=$(mktemp -d "${TMPDIR:-/tmp}/$1.XXXXXX")
trap 'rm -rf "$W"' EXIT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
FAILS=0
ok() { echo "ok: $*"; }
bad() { echo "FAIL: $*"; FAILS=$((FAILS + 1)); }
T0=$SECONDS

# run NAME ARGS...: $TRAIN with ARGS, its output in $W/NAME.out; a failure or sanitizer output
# fails the test (its last lines shown); returns non-zero then
run() {
    local name=$1
    shift
    "$TRAIN" "$@" >"$W/$name.out" 2>&1
    local rc=$?
    if [ $rc -ne 0 ] || grep -qE 'Sanitizer|runtime error' "$W/$name.out"; then
        bad "$name: exit $rc: $*"
        tail -5 "$W/$name.out" | sed 's/^/    /'
        return 1
    fi
}
max_rel() { grep -o 'relative [0-9.e+-]*' "$1" | awk '{ if ($2 + 0 > m) m = $2 + 0 } END { printf "%g", m + 0 }'; }

# update_rel DIFF UPDATE: two --compare-checkpoints reports (a run against the reference, the
# reference against its starting weights); the largest, over tensors, of the run's max |a-b| over
# the reference's max |update| in that tensor ("within x of the update")
update_rel() {
    awk '/^differ: tensor/ { name = $3; for (i = 1; i <= NF; i++) if ($i == "|a-b|") v = $(i + 1) + 0;
                             if (FILENAME == ARGV[1]) d[name] = v; else u[name] = v }
         END { m = 0; for (k in u) if (u[k] > 0 && d[k] / u[k] > m) m = d[k] / u[k]; for (k in d) if (!(k in u)) m = 1; printf "%g", m }' "$1" "$2"
}

# set_tensor FILE OUT NAME VALUE: a copy of safetensors FILE with every f32 of tensor NAME set to
# VALUE (Perl, part of every Debian system)
set_tensor() {
    perl -e 'open(F, "<:raw", $ARGV[0]) or die; local $/; my $d = <F>; my $n = unpack("Q<", substr($d, 0, 8));
             substr($d, 8, $n) =~ /"\Q$ARGV[2]\E":\{"dtype":"F32","shape":\[[0-9,]*\],"data_offsets":\[(\d+),(\d+)\]/ or die "no tensor\n";
             substr($d, 8 + $n + $1, $2 - $1) = pack("f<", $ARGV[3]) x (($2 - $1) / 4);
             open(O, ">:raw", $ARGV[1]) or die; print O $d' "$@"
}
