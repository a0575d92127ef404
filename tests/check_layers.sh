#!/usr/bin/env bash
# check_layers.sh - each layer of src/ calls only the layers below it (README.md, "Layout").
#
#     bash tests/check_layers.sh SRC_DIR [OBJECT_DIR]
#
# 1. Includes: a file in src/L/ may include the internal headers ("X/....h") of layers X at or
#    below L, and nn/ none of backend/ or autograd/ (it goes through ops/).
# 2. Symbols (when OBJECT_DIR, the build's CMakeFiles/ampc_objs.dir/src, is given): no object
#    file of layer L refers to a function or variable defined by a layer above L, public API
#    included, so an upward call cannot hide behind include/ampc.h.
# Then it shows that both checks fail: on a planted upward include and a planted upward call.
set -u
export LC_ALL=C   # join and sort agree on the order
LAYERS=(core backend autograd ops nn optim amp dist data io)   # bottom to top
declare -A RANK
for i in "${!LAYERS[@]}"; do RANK[${LAYERS[$i]}]=$i; done
# layers a layer may not include although they are below it
declare -A SKIPS=([nn]="backend autograd")

# check_includes SRC: prints one line per forbidden include; returns 1 when there is one
check_includes() {
    local src=$1 bad=0 f layer inc target
    while IFS= read -r f; do
        layer=${f#"$src"/}
        layer=${layer%%/*}
        [ -n "${RANK[$layer]+x}" ] || { echo "$f: not in a known layer (${LAYERS[*]})"; bad=1; continue; }
        while IFS= read -r inc; do
            target=${inc%%/*}
            [ -n "${RANK[$target]+x}" ] || continue
            if [ "${RANK[$target]}" -gt "${RANK[$layer]}" ]; then
                echo "$f includes \"$inc\": $target is above $layer"
                bad=1
            elif [[ " ${SKIPS[$layer]:-} " == *" $target "* ]]; then
                echo "$f includes \"$inc\": $layer reaches $target through the layers between"
                bad=1
            fi
        done < <(sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1/p' "$f")
    done < <(find "$src" -name '*.[ch]' | sort)
    return $bad
}

# check_symbols OBJDIR: prints one line per upward reference; returns 1 when there is one
check_symbols() {
    local obj=$1 defs
    defs=$(mktemp)
    for o in $(find "$obj" -name '*.o'); do
        local layer=${o#"$obj"/}
        nm -g --defined-only "$o" | awk -v l="${layer%%/*}" 'NF == 3 { print $3, l }'
    done | sort -u >"$defs"
    local bad=0 o layer sym owner
    for o in $(find "$obj" -name '*.o' | sort); do
        layer=${o#"$obj"/}
        layer=${layer%%/*}
        while read -r sym owner; do
            if [ "${RANK[$owner]}" -gt "${RANK[$layer]}" ]; then
                echo "${o#"$obj"/} uses $sym: defined in $owner, above $layer"
                bad=1
            fi
        done < <(nm -u "$o" | awk '{ print $2 }' | sort -u | join - "$defs")
    done
    rm -f "$defs"
    return $bad
}

SRC=${1:?usage: check_layers.sh SRC_DIR [OBJECT_DIR]}
OBJ=${2:-}
FAILS=0
check_includes "$SRC" || FAILS=$((FAILS + 1))
if [ -n "$OBJ" ]; then
    check_symbols "$OBJ" || FAILS=$((FAILS + 1))
fi

# The checks can fail: a planted upward include, a planted include that skips ops, and (with
# objects) a planted upward call must each be reported.
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
mkdir -p "$T/src/core" "$T/src/nn" "$T/obj/core" "$T/obj/ops"
printf '#include "core/core.h"\n#include "ops/ops.h"\n' >"$T/src/core/planted.c"
printf '#include "nn/nn.h"\n#include "backend/backend.h"\n' >"$T/src/nn/planted.c"
out=$(check_includes "$T/src") && { echo "FAIL: the include check accepted a planted upward include"; FAILS=$((FAILS + 1)); }
grep -q 'core/planted.c includes "ops/ops.h": ops is above core' <<<"$out" || { echo "FAIL: planted upward include not named: $out"; FAILS=$((FAILS + 1)); }
grep -q 'nn/planted.c includes "backend/backend.h"' <<<"$out" || { echo "FAIL: planted skipping include not named: $out"; FAILS=$((FAILS + 1)); }
if [ -n "$OBJ" ]; then
    echo 'int ampc_op_policy_planted(void) { return 0; }' | cc -x c -c -o "$T/obj/ops/op.o" -
    echo 'int ampc_op_policy_planted(void); int f(void) { return ampc_op_policy_planted(); }' | cc -x c -c -o "$T/obj/core/planted.o" -
    out=$(check_symbols "$T/obj") && { echo "FAIL: the symbol check accepted a planted upward call"; FAILS=$((FAILS + 1)); }
    grep -q 'core/planted.o uses ampc_op_policy_planted: defined in ops, above core' <<<"$out" || { echo "FAIL: planted upward call not named: $out"; FAILS=$((FAILS + 1)); }
fi
[ $FAILS -eq 0 ] && echo "check_layers: every include and call goes downward (${LAYERS[*]})"
[ $FAILS -eq 0 ]
