#!/bin/bash
# install_test.sh - the installed library as a C project outside this tree sees it. Installs the
# already-built tree into a temporary prefix (cmake --install), then builds README.md's "A short
# example" (extracted from the ```c fence after "## A short example", so the test fails when the
# README's example stops compiling) four ways and runs each binary:
#   CMake find_package(ampc) with ampc::ampc and ampc::ampc_static; pkg-config, shared and --static.
# Also checks the SONAME and links of libampc.so (from the installed ampc/version.h), that its
# NEEDED list has no cairo (ampc-train's plots), that ampc.pc and the CMake package report that
# version, and that no installed text file names the source or build tree.
#
#     install_test.sh SOURCE_DIR BUILD_DIR C_COMPILER [EXTRA_CFLAGS]   (ctest: install_test)
# EXTRA_CFLAGS: what the library was built with that its users must repeat (the sanitizers).
set -u
SRC=$(cd "$1" && pwd)
BUILD=$(cd "$2" && pwd)
CC=$3
EXTRA=${4:-}
die() { echo "FAIL: $*"; exit 1; }   # the first failure ends the test
W=$(mktemp -d "${TMPDIR:-/tmp}/ampc-install-test.XXXXXX") || die "mktemp"
trap 'rm -rf "$W"' EXIT

P=$W/prefix
cmake --install "$BUILD" --prefix "$P" >"$W/install.log" 2>&1 || { cat "$W/install.log"; die "cmake --install"; }
LIB=$(find "$P" -name libampc.so -printf '%h\n' | head -n 1)   # lib or lib/<multiarch>
[ -n "$LIB" ] || die "no libampc.so installed under $P"
for f in include/ampc.h include/ampc/data.h include/ampc/io.h include/ampc/version.h; do
    [ -f "$P/$f" ] || die "$f not installed"
done
[ -f "$LIB/libampc.a" ] || die "libampc.a not installed"
[ -f "$LIB/pkgconfig/ampc.pc" ] || die "ampc.pc not installed"
for f in ampcConfig.cmake ampcConfigVersion.cmake ampcTargets.cmake; do
    [ -f "$LIB/cmake/ampc/$f" ] || die "lib/cmake/ampc/$f not installed"
done

# --- the version, one fact: header, library name, pkg-config, CMake package
V=$(sed -n 's/^#define AMPC_VERSION_STRING "\(.*\)"$/\1/p' "$P/include/ampc/version.h")
MAJOR=${V%%.*}
[[ $V =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "AMPC_VERSION_STRING '$V' is not major.minor.patch"
SONAME=$(readelf -d "$LIB/libampc.so" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[ "$SONAME" = "libampc.so.$MAJOR" ] && echo "ok: SONAME $SONAME" || die "SONAME '$SONAME', want libampc.so.$MAJOR"
[ -f "$LIB/libampc.so.$V" ] && [ ! -L "$LIB/libampc.so.$V" ] || die "libampc.so.$V is not the library file"
[ "$(readlink "$LIB/libampc.so.$MAJOR")" = "libampc.so.$V" ] || die "libampc.so.$MAJOR does not link to libampc.so.$V"
[ "$(readlink "$LIB/libampc.so")" = "libampc.so.$MAJOR" ] || die "libampc.so does not link to libampc.so.$MAJOR"
NEEDED=$(readelf -d "$LIB/libampc.so" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | tr '\n' ' ')
if [[ $NEEDED == *cairo* ]]; then die "libampc.so needs cairo: $NEEDED"; else echo "ok: NEEDED: $NEEDED"; fi
[[ $NEEDED == *libdnnl* ]] || die "libampc.so does not record oneDNN in NEEDED: $NEEDED"
export PKG_CONFIG_PATH=$LIB/pkgconfig
PCV=$(pkg-config --modversion ampc)
[ "$PCV" = "$V" ] && echo "ok: version $V (version.h, SONAME, ampc.pc)" || die "ampc.pc says version '$PCV', version.h '$V'"
# --- the licence: the text beside the changelog, named by ampc.pc, the CMake package and the programs
cmp -s "$SRC/LICENSE" "$P/share/doc/ampc/LICENSE" && [ -f "$P/share/doc/ampc/CHANGELOG.md" ] || die "LICENSE/CHANGELOG.md not installed in share/doc/ampc"
grep -q "^Description: .*(MIT licence)" "$LIB/pkgconfig/ampc.pc" || die "ampc.pc does not name the licence"
grep -q 'set(ampc_LICENSE "MIT")' "$LIB/cmake/ampc/ampcConfig.cmake" || die "ampcConfig.cmake does not name the licence"
grep -q "^## $V (" "$SRC/CHANGELOG.md" || die "CHANGELOG.md has no entry for $V"
for prog in ampc-train ampc-bench; do
    "$BUILD/$prog" --version | grep -qx "$prog (ampc) $V.*" || die "$prog --version: $("$BUILD/$prog" --version 2>&1 | head -1)"
done
echo "ok: MIT licence installed and named; CHANGELOG.md has $V; ampc-train and ampc-bench --version say $V"
grep -rlF -e "$SRC" -e "$BUILD" "$P/include" "$LIB/cmake" "$LIB/pkgconfig" >"$W/paths" && die "installed files name the build machine's trees: $(cat "$W/paths")"

# --- README's example
awk '/^## A short example/ { s = 1 } s && /^```c$/ { p = 1; next } p && /^```$/ { exit } p' "$SRC/README.md" >"$W/example.c"
grep -q 'int main' "$W/example.c" || die "no \`\`\`c example after '## A short example' in README.md"
run() {   # name binary: runs it, expects exit 0; no LD_LIBRARY_PATH: the binary finds libampc.so itself (rpath)
    if env -u LD_LIBRARY_PATH "$2" >"$W/$1.out" 2>&1; then echo "ok: $1 ran"; else die "$1 exited $?: $(tail -n 5 "$W/$1.out")"; fi
}
links_shared() {   # name binary yes|no: whether libampc.so.MAJOR is in its NEEDED list
    local got=no
    readelf -d "$2" | grep -q "(NEEDED).*\[libampc\.so\.$MAJOR\]" && got=yes
    [ "$got" = "$3" ] || die "$1: NEEDED libampc.so.$MAJOR is '$got', want '$3'"
}
CFLAGS="-std=c17 -Wall -Wextra -Werror $EXTRA"

# CMake: find_package(ampc) in a project of its own
mkdir -p "$W/cmake-src"
cp "$W/example.c" "$W/cmake-src/example.c"
cat >"$W/cmake-src/CMakeLists.txt" <<'EOF'
cmake_minimum_required(VERSION 3.18)
project(ampc_user LANGUAGES C)
find_package(ampc REQUIRED COMPONENTS static)
add_executable(example_shared example.c)
target_link_libraries(example_shared PRIVATE ampc::ampc)
add_executable(example_static example.c)
target_link_libraries(example_static PRIVATE ampc::ampc_static)
file(WRITE ${CMAKE_BINARY_DIR}/found_version "${ampc_VERSION}")
EOF
if cmake -S "$W/cmake-src" -B "$W/cmake-build" -DCMAKE_PREFIX_PATH="$P" -DCMAKE_C_COMPILER="$CC" \
         -DCMAKE_C_FLAGS="$CFLAGS" -DCMAKE_EXE_LINKER_FLAGS="$EXTRA" >"$W/cmake.log" 2>&1 &&
   cmake --build "$W/cmake-build" -j 2 >>"$W/cmake.log" 2>&1; then
    echo "ok: find_package(ampc) built the example (shared and static)"
    [ "$(cat "$W/cmake-build/found_version")" = "$V" ] || die "find_package(ampc) found version '$(cat "$W/cmake-build/found_version")'"
    links_shared cmake-shared "$W/cmake-build/example_shared" yes
    links_shared cmake-static "$W/cmake-build/example_static" no
    run cmake-shared "$W/cmake-build/example_shared"
    run cmake-static "$W/cmake-build/example_static"
else
    die "CMake build against the prefix: $(tail -n 20 "$W/cmake.log")"
fi

# A program linking the shared library needs none of the static one's development files:
# find_package(ampc) with MPI, OpenMP and CUDA hidden still gives ampc::ampc (and says the
# component "static" was not found); asking for that component then fails, naming what is missing.
mkdir -p "$W/cmake-src2"
cp "$W/example.c" "$W/cmake-src2/example.c"
cat >"$W/cmake-src2/CMakeLists.txt" <<'EOF2'
cmake_minimum_required(VERSION 3.18)
project(ampc_shared_user LANGUAGES C)
find_package(ampc REQUIRED)
add_executable(example_shared example.c)
target_link_libraries(example_shared PRIVATE ampc::ampc)
file(WRITE ${CMAKE_BINARY_DIR}/static_found "${ampc_static_FOUND}")
EOF2
HIDE=(-DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON -DCMAKE_DISABLE_FIND_PACKAGE_OpenMP=ON -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON)
if cmake -S "$W/cmake-src2" -B "$W/cmake-build2" -DCMAKE_PREFIX_PATH="$P" -DCMAKE_C_COMPILER="$CC" "${HIDE[@]}" \
         -DCMAKE_C_FLAGS="$CFLAGS" -DCMAKE_EXE_LINKER_FLAGS="$EXTRA" >"$W/cmake2.log" 2>&1 &&
   cmake --build "$W/cmake-build2" -j 2 >>"$W/cmake2.log" 2>&1; then
    [ "$(cat "$W/cmake-build2/static_found")" = "FALSE" ] || die "with OpenMP hidden, ampc_static_FOUND is '$(cat "$W/cmake-build2/static_found")'"
    links_shared cmake-shared-only "$W/cmake-build2/example_shared" yes
    run cmake-shared-only "$W/cmake-build2/example_shared"
    echo "ok: find_package(ampc) for the shared library needs no MPI, OpenMP or CUDA files"
else
    die "find_package(ampc) with MPI/OpenMP/CUDA hidden: $(tail -n 20 "$W/cmake2.log")"
fi
sed -i 's/find_package(ampc REQUIRED)/find_package(ampc REQUIRED COMPONENTS static)/' "$W/cmake-src2/CMakeLists.txt"
if cmake -S "$W/cmake-src2" -B "$W/cmake-build3" -DCMAKE_PREFIX_PATH="$P" -DCMAKE_C_COMPILER="$CC" "${HIDE[@]}" >"$W/cmake3.log" 2>&1; then
    die "find_package(ampc COMPONENTS static) succeeded with OpenMP hidden"
fi
grep -q "ampc::ampc_static needs.*OpenMP" "$W/cmake3.log" || die "the static component's failure does not name OpenMP: $(tail -n 8 "$W/cmake3.log")"
echo "ok: find_package(ampc COMPONENTS static) without OpenMP fails naming it"

# pkg-config: shared (ampc.pc), then static (ampc-static.pc: the archive by its path)
# shellcheck disable=SC2046,SC2086
if "$CC" $CFLAGS "$W/example.c" -o "$W/pc_shared" $(pkg-config --cflags --libs ampc) $EXTRA 2>"$W/pc.log"; then
    echo "ok: pkg-config built the example"
    links_shared pc-shared "$W/pc_shared" yes
    run pc-shared "$W/pc_shared"
else
    die "cc \$(pkg-config --cflags --libs ampc): $(tail -n 20 "$W/pc.log")"
fi
STATIC_LIBS=$(pkg-config --libs ampc-static)
# shellcheck disable=SC2046,SC2086
if "$CC" $CFLAGS "$W/example.c" -o "$W/pc_static" $(pkg-config --cflags ampc) $STATIC_LIBS $EXTRA 2>"$W/pcs.log"; then
    echo "ok: pkg-config ampc-static built the example ($STATIC_LIBS)"
    links_shared pc-static "$W/pc_static" no
    run pc-static "$W/pc_static"
else
    die "cc with pkg-config --libs ampc-static ($STATIC_LIBS): $(tail -n 20 "$W/pcs.log")"
fi

echo "install_test: all passed"
