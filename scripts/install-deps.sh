#!/usr/bin/env bash
# Installs the Debian packages ampc needs, only when some are missing.
#   bash scripts/install-deps.sh        build and test (gcc)
#   bash scripts/install-deps.sh fuzz   the same plus clang 14 and libFuzzer (`make fuzz`)
set -euo pipefail
# protobuf-c and ISA-L (its CRC32C): ampc-train's TensorBoard event files; protoc and python3-protobuf:
# tests/e2e_tensorboard.sh's independent reader; fortunes: a text to train the GPT on (tests/e2e_gpt.sh)
PKGS=(build-essential cmake pkg-config openmpi-bin libopenmpi-dev iproute2 libdnnl-dev libcmocka-dev zlib1g-dev dataset-fashion-mnist libturbojpeg0-dev libpng-dev libjansson-dev libcairo2-dev
      protobuf-c-compiler libprotobuf-c-dev libisal-dev protobuf-compiler python3-protobuf fortunes)
# clang's OpenMP runtime (libomp) is what clang's -fopenmp links; libclang-rt has libFuzzer
FUZZ_PKGS=(clang-14 libclang-rt-14-dev libomp-14-dev)
case "${1:-}" in
  "") ;;
  fuzz) PKGS+=("${FUZZ_PKGS[@]}") ;;
  *) echo "usage: $0 [fuzz]" >&2; exit 2 ;;
esac
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
echo "installing: ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
