#!/bin/bash
# Builds ampc with the CUDA backend here (nvcc, cuBLASLt and cuDNN under /usr/local/cuda) and
# packs what a GPU machine without ampc's Debian libraries needs to run its tests, ampc-train and
# ampc-bench: the programs and the shared libraries they load (oneDNN, libpng, cairo and its X11,
# fontconfig and freetype libraries, ...; not glibc and not CUDA's, which the GPU machine has) into
# .gpu/bundle.tar.xz, and Fashion-MNIST into .gpu/fashion-mnist. scripts/gpu/run.sh unpacks the
# bundle there. No fonts travel: on a machine without any, cairo draws the plots' text in its
# built-in font.
# Usage: bash scripts/gpu/pack.sh [build dir, default build-gpu]
set -euo pipefail
cd "$(dirname "$0")/../.."
B=${1:-build-gpu}
cmake -S . -B "$B" -DCMAKE_BUILD_TYPE=Release -DAMPC_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 >/dev/null
cmake --build "$B" -j2 >/dev/null
rm -rf .gpu/stage .gpu/bundle.tar.xz && mkdir -p .gpu/stage/bin .gpu/stage/lib
progs=$(cd "$B" && ls test_* ampc-train ampc-bench make_image_folder 2>/dev/null | grep -v '\.')
for p in $progs; do cp "$B/$p" .gpu/stage/bin/; done
for p in $progs; do ldd "$B/$p"; done | awk '$3 ~ /^\// {print $3}' | sort -u |
    grep -v -E '/(libc|libm|libdl|libpthread|librt|ld-linux[^/]*|libgcc_s|libstdc\+\+)\.so|/cuda' |
    while read -r lib; do cp -L "$lib" .gpu/stage/lib/; done
# Open MPI (Debian's 4.1 and its PMIx), for the tests of several ranks on one GPU: mpirun, the
# component folders and help texts, and the libraries they load; run.sh points OPAL_* and
# PMIX_PREFIX at them (the GPU machine has no Open MPI).
parts="bin lib"
if command -v orterun >/dev/null && [ -d /usr/lib/x86_64-linux-gnu/openmpi/lib/openmpi3 ]; then
    o=.gpu/stage/ompi
    mkdir -p $o/bin $o/lib $o/share $o/pmix2/lib
    cp "$(readlink -f "$(command -v orterun)")" $o/bin/mpirun
    cp -r /usr/lib/x86_64-linux-gnu/openmpi/lib/openmpi3 $o/lib/
    cp -r /usr/share/openmpi $o/share/
    cp -r /usr/lib/x86_64-linux-gnu/pmix2/lib/pmix $o/pmix2/lib/ && cp -r /usr/lib/x86_64-linux-gnu/pmix2/share $o/pmix2/
    for f in $o/bin/mpirun $o/lib/openmpi3/*.so $o/pmix2/lib/pmix/*.so; do ldd "$f"; done | awk '$3 ~ /^\// {print $3}' | sort -u |
        grep -v -E '/(libc|libm|libdl|libpthread|librt|ld-linux[^/]*|libgcc_s|libstdc\+\+)\.so|/cuda' |
        while read -r lib; do cp -L "$lib" .gpu/stage/lib/; done
    parts="$parts ompi"
fi
tar -C .gpu/stage -cJf .gpu/bundle.tar.xz $parts
rm -rf .gpu/stage
# Fashion-MNIST for tests/e2e_cuda.sh and ampc-train there (30 MB; session.sh points
# AMPC_FASHION_MNIST_DIR at it). .gpu/ is git-ignored (.git/info/exclude): name it in the device
# tool's carry.
fm=${AMPC_FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}
if [ -f "$fm/train-images-idx3-ubyte.gz" ] && [ ! -f .gpu/fashion-mnist/train-images-idx3-ubyte.gz ]; then
    mkdir -p .gpu/fashion-mnist && cp "$fm"/*-ubyte.gz .gpu/fashion-mnist/
fi
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude
ls -la .gpu/bundle.tar.xz
