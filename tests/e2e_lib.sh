# e2e_lib.sh - sourced by the tests/e2e_*.sh scripts: the Fashion-MNIST check (SKIP, exit 0, when
# Debian's dataset-fashion-mnist is missing), a work folder $W removed at exit, ok/bad counters
# ($FAILS), the start time $T0, and max_rel (the largest relative difference an
# ampc-train --compare-checkpoints report names).
#
#     . "$(dirname "$0")/e2e_lib.sh" NAME
FM=${AMPC_FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}
if [ ! -e "$FM/train-images-idx3-ubyte.gz" ] && [ ! -e "$FM/train-images-idx3-ubyte" ]; then
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
max_rel() { grep -o 'relative [0-9.e+-]*' "$1" | awk '{ if ($2 + 0 > m) m = $2 + 0 } END { printf "%g", m + 0 }'; }
