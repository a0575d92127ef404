#!/usr/bin/env bash
# check_layers.sh - each layer of src/ uses only the layers README.md's "Layout" allows it, and
# tools/ uses only the public API (include/), but for the exceptions named below.
#
#     bash tests/check_layers.sh SRC_DIR [OBJECT_DIR]
#
# SRC_DIR's parent holds include/ and tools/; OBJECT_DIR is the build's CMakeFiles/ampc_objs.dir/src,
# and the tools' objects are found beside it (CMakeFiles/<target>.dir/tools/).
# 1. Includes: every #include of every file in src/ (.c .h .cu .cuh; any other file is refused) is
#    resolved as the compiler opens it: "x" from the including file's folder first ("./x", "../x",
#    a plain "x.h" beside it), then "x" and <x> from include/ and src/. The file it names must be
#    public (include/) or in a layer USES allows; a computed include is refused.
# 2. Symbols (with OBJECT_DIR): every source has its object (a wrong or half-built OBJECT_DIR can't
#    pass), and no object of layer L refers to a function or variable defined by a layer L may not
#    use, public API included: a forbidden call cannot hide behind include/ampc.h; nor a name of
#    PRIVATE outside the layer that defines it.
# 3. Tools: tools/ includes only include/, tools/ and system headers, and its objects refer to no
#    symbol of the library that include/ does not declare (ampc__ names never are); each exception
#    (TOOL_EXCEPTIONS) names its file, its headers and why, and allows only those headers' names.
# Then it plants every kind of violation in a scratch tree and requires each to be reported.
set -u
export LC_ALL=C   # join and sort agree on the order
LAYERS=(core backend autograd ops nn optim amp dist data io)   # bottom to top
# What each layer may use besides itself (README.md, "Layout"): layers below it only (checked).
declare -A USES=(
    [core]=""
    [backend]="core"
    [autograd]="core backend"
    [ops]="core backend autograd"
    [nn]="core ops"                  # layers and models go through ops, never backend or autograd
    [optim]="core backend autograd ops nn"
    [amp]="core backend autograd ops nn optim"
    [dist]="core backend autograd ops nn optim amp"
    [data]="core"                    # datasets, transforms, loader: core only
    [io]="core backend autograd ops nn optim amp dist data"
)
# Names private to the layer that defines them, though the table lets layers above use that layer:
# the kernel tables (ampc__backend), which every layer above reaches through the door instead
# (src/backend/dispatch.c: one place checks device and dtype).
PRIVATE=(ampc__backend)
# Tools use include/ and tools/; these files use internal headers too (and those headers' names).
#   file under tools/ | the src/ headers it may include | why
TOOL_EXCEPTIONS=(
    "plot.c | core/core.h | ampc-train's plots record their errors as the library does (ampc__err after
     ampc__ensure_init, read back with ampc_last_error) and write the PNG through core's no-FIFO opener and stale-temporary
     cleanup (ampc__fopen_regular, ampc__remove_stale_temps) instead of a second copy of each"
    "bench_profile.c | backend/backend.h backend/cpu/cpu.h | ampc-bench --profile times every kernel
     by patching the CPU backend's kernel table (ampc__backend: a tool's privilege, never the
     library's) and names the oneDNN implementation of each gemm/conv shape (ampc__cpu_*_impl)"
)

declare -A RANK
for i in "${!LAYERS[@]}"; do RANK[${LAYERS[$i]}]=$i; done
for l in "${LAYERS[@]}"; do   # the table itself: a layer may use only layers below it
    [ -n "${USES[$l]+x}" ] || { echo "check_layers.sh: USES has no entry for $l"; exit 2; }
    for t in ${USES[$l]}; do
        [ -n "${RANK[$t]+x}" ] && [ "${RANK[$t]}" -lt "${RANK[$l]}" ] ||
            { echo "check_layers.sh: USES[$l] lists $t, which is not a layer below $l"; exit 2; }
    done
done

# may_use L T: whether layer L may use layer T; WHY says why not
may_use() {
    WHY=
    [ -n "${RANK[$2]+x}" ] || { WHY="$2 is not a layer"; return 1; }
    [ "$1" = "$2" ] || [[ " ${USES[$1]} " == *" $2 "* ]] && return 0
    if [ "${RANK[$2]}" -gt "${RANK[$1]}" ]; then WHY="$2 is above $1"
    else WHY="$1 uses only ${USES[$1]:-itself}, not $2"; fi
    return 1
}

# norm PATH: NORM = PATH with "." and ".." folded, as the compiler opens it
norm() {
    local IFS=/ p abs='' out=() parts
    read -ra parts <<<"$1"
    [ "${1:0:1}" = / ] && abs=/
    for p in "${parts[@]}"; do
        case $p in
            '' | .) ;;
            ..) if [ ${#out[@]} -gt 0 ] && [ "${out[-1]}" != .. ]; then unset 'out[-1]'; else out+=(..); fi ;;
            *) out+=("$p") ;;
        esac
    done
    NORM="$abs${out[*]}"
}

# resolve FILE FORM NAME BASE...: RES = the file that `#include "NAME"` (FORM q) or <NAME> (FORM a)
# in FILE opens: FILE's folder first for q, then each BASE; empty when none has it (a system header)
resolve() {
    local f=$1 form=$2 name=$3 b
    shift 3
    RES=
    if [ "${name:0:1}" = / ]; then set -- ""; elif [ "$form" = q ]; then set -- "${f%/*}" "$@"; fi
    for b in "$@"; do
        norm "$b/$name"
        [ -f "$NORM" ] && { RES=$NORM; return; }
    done
}

# includes_of FILE: "LINE q|a|? NAME" per #include (? : computed, NAME the rest of the line)
includes_of() {
    awk '/^[ \t]*#[ \t]*include/ {
        s = $0; sub(/^[ \t]*#[ \t]*include[ \t]*/, "", s)
        if (match(s, /^"[^"]*"/)) print FNR, "q", substr(s, 2, RLENGTH - 2)
        else if (match(s, /^<[^>]*>/)) print FNR, "a", substr(s, 2, RLENGTH - 2)
        else print FNR, "?", s
    }' "$1"
}

# show FORM NAME: the include as written
show() { if [ "$1" = q ]; then echo "\"$2\""; else echo "<$2>"; fi; }

# check_includes ROOT: one line per forbidden include in ROOT/src; returns 1 when there is one
check_includes() {
    local root=$1 src=$1/src inc=$1/include bad=0 f rel layer ln form name tl
    while IFS= read -r f; do
        rel=src/${f#"$src"/}
        layer=${f#"$src"/}
        layer=${layer%%/*}
        [ -f "$f" ] && [ ! -L "$f" ] || { echo "$rel: not a plain file (the check reads files, not links)"; bad=1; continue; }
        case $f in *.c | *.h | *.cu | *.cuh) ;; *) echo "$rel: not a .c, .h, .cu or .cuh file, the kinds the check reads"; bad=1; continue ;; esac
        [ -n "${RANK[$layer]+x}" ] && [ "$rel" != "src/$layer" ] || { echo "$rel: not in a layer (${LAYERS[*]})"; bad=1; continue; }
        while read -r ln form name; do
            if [ "$form" = '?' ]; then echo "$rel:$ln: #include $name: a computed include, which the check can't follow"; bad=1; continue; fi
            resolve "$f" "$form" "$name" "$inc" "$src"
            case $RES in
                '' | "$inc"/*) continue ;;   # a system header, or the public API
                "$src"/*/*) tl=${RES#"$src"/}; tl=${tl%%/*} ;;
                *) echo "$rel:$ln includes $(show "$form" "$name"): ${RES#"$root"/} is in no layer of src/"; bad=1; continue ;;
            esac
            if [ -z "${RANK[$tl]+x}" ]; then echo "$rel:$ln includes $(show "$form" "$name"): ${RES#"$root"/} is in no layer"; bad=1
            elif ! may_use "$layer" "$tl"; then echo "$rel:$ln includes $(show "$form" "$name") (${RES#"$root"/}): $WHY"; bad=1; fi
        done < <(includes_of "$f")
    done < <(find "$src" -mindepth 1 ! -type d | sort)
    return $bad
}

# library_defs SRC OBJDIR: "symbol layer" for every global the library's objects define, sorted;
# objects whose source is gone (stale) are left out
library_defs() {
    local o rel
    find "$2" -name '*.o' | sort | while IFS= read -r o; do
        rel=${o#"$2"/}
        [ -f "$1/${rel%.o}" ] || continue
        nm -g --defined-only "$o" | awk -v l="${rel%%/*}" 'NF == 3 { print $3, l }'
    done | sort -u
}

# check_symbols SRC OBJDIR DEFS: one line per missing object or forbidden reference; returns 1 then
check_symbols() {
    local src=$1 obj=$2 defs=$3 bad=0 f rel o layer sym owner cuda=0
    [ -n "$(find "$obj/backend/cuda" -name '*.o' 2>/dev/null)" ] && cuda=1
    while IFS= read -r f; do
        rel=${f#"$src"/}
        [ $cuda = 0 ] && [[ $rel == backend/cuda/* ]] && continue   # built only when AMPC_CUDA finds CUDA
        [ -f "$obj/$rel.o" ] || { echo "src/$rel has no object $obj/$rel.o: build ampc_objs (or pass its object folder)"; bad=1; }
    done < <(find "$src" -name '*.c' -o -name '*.cu' | sort)
    while IFS= read -r o; do
        rel=${o#"$obj"/}
        [ -f "$src/${rel%.o}" ] || continue
        layer=${rel%%/*}
        [ -n "${RANK[$layer]+x}" ] || { echo "$rel: not in a layer (${LAYERS[*]})"; bad=1; continue; }
        while read -r sym owner; do
            if [ "$layer" != "$owner" ] && [[ " ${PRIVATE[*]} " == *" $sym "* ]]; then
                echo "$rel uses $sym: private to $owner (PRIVATE)"; bad=1
            else
                may_use "$layer" "$owner" || { echo "$rel uses $sym: defined in $owner; $WHY"; bad=1; }
            fi
        done < <(nm -u "$o" | awk '{ print $2 }' | sort -u | join - "$defs")
    done < <(find "$obj" -name '*.o' | sort)
    return $bad
}

# exception_of FILE: EXC = the src/ headers tools/FILE may include (empty: none)
exception_of() {
    local e file heads
    EXC=
    for e in "${TOOL_EXCEPTIONS[@]}"; do
        IFS='|' read -r file heads _ <<<"$e"
        [ "$(echo $file)" = "$1" ] && EXC=$(echo $heads)
    done
    return 0
}

# names_in < FILES: the identifiers of the C headers named one a line, comments left out
names_in() {
    local f
    while IFS= read -r f; do cc -fpreprocessed -dD -E -P -x c "$f" 2>/dev/null; done | grep -o '[A-Za-z_][A-Za-z0-9_]*' | sort -u
}

# check_tools ROOT [BUILD DEFS]: one line per tool include of an internal header, stale exception,
# or (with BUILD) tool object's reference to an internal symbol; returns 1 when there is one
check_tools() {
    local root=$1 build=${2:-} defs=${3:-} src=$1/src inc=$1/include tools=$1/tools bad=0
    local f rel ln form name e file heads h o public allowed sym owner n=0
    while IFS= read -r f; do
        rel=${f#"$tools"/}
        case $f in *.c | *.h | *.cu | *.cuh) ;; *) continue ;; esac   # tools/tensorboard/*.proto
        [ ! -L "$f" ] || { echo "tools/$rel: a link (the check reads files, not links)"; bad=1; continue; }
        exception_of "$rel"
        while read -r ln form name; do
            if [ "$form" = '?' ]; then echo "tools/$rel:$ln: #include $name: a computed include, which the check can't follow"; bad=1; continue; fi
            resolve "$f" "$form" "$name" "$inc" "$tools" "$src"
            case $RES in
                '' | "$inc"/* | "$tools"/*) continue ;;   # system, generated, public or the tools' own
                "$src"/*) h=${RES#"$src"/}
                          [[ " $EXC " == *" $h "* ]] && continue
                          echo "tools/$rel:$ln includes $(show "$form" "$name"): src/$h is internal; tools use include/ (exceptions: TOOL_EXCEPTIONS)" ;;
                *) echo "tools/$rel:$ln includes $(show "$form" "$name"): ${RES#"$root"/} is outside include/ and tools/" ;;
            esac
            bad=1
        done < <(includes_of "$f")
    done < <(find "$tools" -mindepth 1 ! -type d | sort)
    for e in "${TOOL_EXCEPTIONS[@]}"; do   # an exception that no longer holds is removed, not kept
        IFS='|' read -r file heads _ <<<"$e"
        file=$(echo $file)
        for h in $heads; do
            [ -f "$tools/$file" ] && includes_of "$tools/$file" | awk '{ print $3 }' | grep -qxF "$h" ||
                { echo "TOOL_EXCEPTIONS: tools/$file no longer includes $h: remove it from the exception"; bad=1; }
        done
    done
    [ -n "$build" ] || return $bad
    public=$(mktemp)
    allowed=$(mktemp)
    find "$inc" "$build/include" -name '*.h' 2>/dev/null | names_in | grep -v '^ampc__' >"$public"   # never public
    while IFS= read -r o; do
        rel=${o#*.dir/tools/}
        rel=${rel%.o}
        [ -f "$tools/$rel" ] || continue   # stale: its source is gone
        n=$((n + 1))
        exception_of "$rel"
        cp "$public" "$allowed"
        [ -z "$EXC" ] || { for h in $EXC; do echo "$src/$h"; done | names_in; cat "$public"; } | sort -u >"$allowed"
        while read -r sym owner; do
            echo "${o#"$build"/} uses $sym: internal to $owner (include/ doesn't declare it)"
            bad=1
        done < <(nm -u "$o" | awk '{ print $2 }' | sort -u | join - "$defs" | join -v1 - "$allowed")
    done < <(find "$build/CMakeFiles" -path '*.dir/tools/*' -name '*.o' | sort)
    [ $n -gt 0 ] || { echo "no tool objects under $build/CMakeFiles/*.dir/tools/: build the tools first"; bad=1; }
    rm -f "$public" "$allowed"
    return $bad
}

# check ROOT [OBJDIR]: every check on a tree; FAILS counts the failing ones
check() {
    local root=$1 obj=${2:-} build defs
    check_includes "$root" || FAILS=$((FAILS + 1))
    if [ -z "$obj" ]; then
        check_tools "$root" || FAILS=$((FAILS + 1))
        return
    fi
    build=${obj%/CMakeFiles/ampc_objs.dir/src}
    [ "$build" != "$obj" ] || { echo "OBJECT_DIR must be <build>/CMakeFiles/ampc_objs.dir/src, not $obj"; FAILS=$((FAILS + 1)); return; }
    defs=$(mktemp)
    library_defs "$root/src" "$obj" >"$defs"
    check_symbols "$root/src" "$obj" "$defs" || FAILS=$((FAILS + 1))
    check_tools "$root" "$build" "$defs" || FAILS=$((FAILS + 1))
    rm -f "$defs"
}

SRC=${1:?usage: check_layers.sh SRC_DIR [OBJECT_DIR]}
SRC=$(cd "$SRC" && pwd) || exit 2
OBJ=${2:-}
[ -z "$OBJ" ] || OBJ=$(cd "$OBJ" && pwd) || exit 2
[ "${SRC##*/}" = src ] || { echo "SRC_DIR must be a folder named src (beside include/ and tools/)"; exit 2; }
FAILS=0
check "${SRC%/src}" "$OBJ"
REAL_FAILS=$FAILS
N_EXCEPTIONS=${#TOOL_EXCEPTIONS[@]}

# ---------------------------------------------------------------------------------------------
# The checks can fail: each planted violation below must be reported (every reported line fails
# its check), and the planted allowed uses must not be.
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
plant() { mkdir -p "$(dirname "$T/$1")" && printf '%b' "$2" >"$T/$1"; }
for h in core/core.h backend/backend.h backend/cpu/cpu.h autograd/autograd.h ops/ops.h nn/nn.h optim/optim.h; do
    plant "src/$h" ''
done
plant src/core/core.h 'int ampc__planted_core(void);\n'
plant include/ampc.h 'int ampc_public(void);\n'
plant tools/ok.h ''
plant src/core/upward.c '#include "core/core.h"\n#include "ops/ops.h"\n'
plant src/nn/skip.c '#include "nn/nn.h"\n#include "backend/backend.h"\n'
plant src/core/relative.c '#include "core.h"\n#include "../ops/ops.h"\n'
plant src/core/angle.c '#include <ops/ops.h>\n'
plant src/backend/cuda/planted.cu '#include "nn/nn.h"\n'
plant src/backend/cuda/planted.cuh '#include "../../ops/ops.h"\n'
plant src/data/planted.c '#include "core/core.h"\n#include "nn/nn.h"\n'
plant src/core/computed.c '#include AMPC_HEADER\n'
plant src/core/planted.inc ''
plant src/nn/ok.c '#include "nn.h"\n#include "./nn.h"\n#include "../ops/ops.h"\n#include <core/core.h>\n#include "ampc.h"\n#include <stdio.h>\n'
plant tools/planted.c '#include "ampc.h"\n#include "optim/optim.h"\n'
plant tools/sub/relative.c '#include "../../src/core/core.h"\n'
plant tools/plot.c '#include "core/core.h"\n#include <backend/backend.h>\n'
plant tools/bench_profile.c '#include "backend/backend.h"\n#include "backend/cpu/cpu.h"\n'
plant tools/ok.c '#include "ampc.h"\n#include "ok.h"\n#include <stdio.h>\n'
TOOL_EXCEPTIONS+=("gone.c | core/core.h | planted: an exception for a file that is gone")
planted_out=$(check_includes "$T"; check_tools "$T")
OBJS=$T/build/CMakeFiles/ampc_objs.dir/src
TOBJ=$T/build/CMakeFiles/tool.dir/tools
compile() { mkdir -p "$(dirname "$1")" && echo "$2" | cc -x c -c -o "$1" -; }
if [ -n "$OBJ" ]; then   # objects for the symbol checks, in a tree of their own (src/ with no plants)
    S=$T/sym
    for f in core/core.c ops/op.c autograd/engine.c nn/layer.c nn/planted.c data/planted.c backend/table.c backend/door.c ops/private.c; do plant "sym/src/$f" ''; done
    plant sym/src/core/missing.c ''
    plant sym/tools/planted.c ''
    plant sym/tools/plot.c ''
    compile "$OBJS/core/core.c.o" 'int ampc__planted_core(void) { return 0; } int ampc__planted_internal(void) { return 0; }
        int ampc_planted_hidden(void) { return 0; } int ampc_public(void) { return 0; }
        int ampc_op_policy_planted(void); int f(void) { return ampc_op_policy_planted(); }'
    compile "$OBJS/ops/op.c.o" 'int ampc_op_policy_planted(void) { return 0; }'
    PRIVATE+=(ampc__planted_private)
    compile "$OBJS/backend/table.c.o" 'int ampc__planted_private(void) { return 0; }'
    compile "$OBJS/backend/door.c.o" 'int ampc__planted_private(void); int k(void) { return ampc__planted_private(); }'
    compile "$OBJS/ops/private.c.o" 'int ampc__planted_private(void); int q(void) { return ampc__planted_private(); }'
    compile "$OBJS/autograd/engine.c.o" 'int ampc_planted_set_grad(void) { return 0; }'
    compile "$OBJS/nn/layer.c.o" 'int ampc_planted_layer(void) { return 0; }'
    compile "$OBJS/nn/planted.c.o" 'int ampc_planted_set_grad(void), ampc_public(void); int g(void) { return ampc_planted_set_grad() + ampc_public(); }'
    compile "$OBJS/data/planted.c.o" 'int ampc_planted_layer(void); int h(void) { return ampc_planted_layer(); }'
    compile "$TOBJ/planted.c.o" 'int ampc__planted_internal(void), ampc_planted_hidden(void), ampc_public(void);
        int t(void) { return ampc__planted_internal() + ampc_planted_hidden() + ampc_public(); }'
    compile "$TOBJ/plot.c.o" 'int ampc__planted_core(void), ampc_public(void); int p(void) { return ampc__planted_core() + ampc_public(); }'
    mkdir -p "$S/include"
    cp "$T/include/ampc.h" "$S/include/"
    cp -r "$T/src/core/core.h" "$S/src/core/"
    defs=$(mktemp -p "$T")
    library_defs "$S/src" "$OBJS" >"$defs"
    planted_out+=$'\n'$(check_symbols "$S/src" "$OBJS" "$defs"; check_tools "$S" "$T/build" "$defs" | grep -v TOOL_EXCEPTIONS)
fi
CASES=0
# expect CASE TEXT: the planted CASE is reported, by a line holding TEXT
expect() {
    CASES=$((CASES + 1))
    grep -qF -- "$2" <<<"$planted_out" || { echo "FAIL: the check missed the planted $1 (no line with: $2)"; FAILS=$((FAILS + 1)); }
}
expect "upward include" 'src/core/upward.c:2 includes "ops/ops.h" (src/ops/ops.h): ops is above core'
expect "include skipping ops (nn -> backend)" 'src/nn/skip.c:2 includes "backend/backend.h" (src/backend/backend.h): nn uses only core ops, not backend'
expect "relative include in core" 'src/core/relative.c:2 includes "../ops/ops.h" (src/ops/ops.h): ops is above core'
expect "angle-form include" 'src/core/angle.c:1 includes <ops/ops.h> (src/ops/ops.h): ops is above core'
expect "include in a .cu file" 'src/backend/cuda/planted.cu:1 includes "nn/nn.h" (src/nn/nn.h): nn is above backend'
expect "include in a .cuh file" 'src/backend/cuda/planted.cuh:1 includes "../../ops/ops.h" (src/ops/ops.h): ops is above backend'
expect "data including nn" 'src/data/planted.c:2 includes "nn/nn.h" (src/nn/nn.h): data uses only core, not nn'
expect "computed include" 'src/core/computed.c:1: #include AMPC_HEADER: a computed include'
expect "file of another kind in src/" 'src/core/planted.inc: not a .c, .h, .cu or .cuh file'
expect "tool including an internal header" 'tools/planted.c:2 includes "optim/optim.h": src/optim/optim.h is internal'
expect "tool including src/ by a relative path" 'tools/sub/relative.c:1 includes "../../src/core/core.h": src/core/core.h is internal'
expect "excepted tool including beyond its exception" 'tools/plot.c:2 includes <backend/backend.h>: src/backend/backend.h is internal'
expect "exception that no longer holds" 'TOOL_EXCEPTIONS: tools/gone.c no longer includes core/core.h'
if [ -n "$OBJ" ]; then
    expect "upward call" 'core/core.c.o uses ampc_op_policy_planted: defined in ops; ops is above core'
    expect "nn calling autograd" 'nn/planted.c.o uses ampc_planted_set_grad: defined in autograd; nn uses only core ops, not autograd'
    expect "data calling nn" 'data/planted.c.o uses ampc_planted_layer: defined in nn; data uses only core, not nn'
    expect "source without its object" 'src/core/missing.c has no object'
    expect "private name used above its layer" 'ops/private.c.o uses ampc__planted_private: private to backend (PRIVATE)'
    expect "tool calling an ampc__ function" 'CMakeFiles/tool.dir/tools/planted.c.o uses ampc__planted_internal: internal to core'
    expect "tool calling a function include/ doesn't declare" 'CMakeFiles/tool.dir/tools/planted.c.o uses ampc_planted_hidden: internal to core'
fi
# the allowed uses: same folder, "./", "../" within the rules, angles, include/, system headers,
# public symbols, an excepted tool's own headers and their names
if grep -E 'src/nn/ok\.c|tools/ok\.c|tools/bench_profile\.c|tools/plot\.c:1 |uses ampc_public|plot\.c\.o uses|door\.c\.o' <<<"$planted_out"; then
    echo "FAIL: the check refused an allowed use (above)"
    FAILS=$((FAILS + 1))
fi
[ $FAILS -gt $REAL_FAILS ] && echo "planted and checked in $T: $planted_out"
[ $FAILS -eq 0 ] && echo "check_layers: every include and call goes where the layer table allows" \
    "(${LAYERS[*]}; tools: include/ + $N_EXCEPTIONS named exceptions); all $CASES planted violations caught"
[ $FAILS -eq 0 ]
