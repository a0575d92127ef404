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
tar -C .gpu/stage -cJf .gpu/bundle.tar.xz bin lib
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
