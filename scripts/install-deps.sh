#!/usr/bin/env bash
# Installs the Debian packages ampc needs, only when some are missing.
set -euo pipefail
PKGS=(build-essential cmake pkg-config libdnnl-dev libcmocka-dev zlib1g-dev dataset-fashion-mnist libturbojpeg0-dev libpng-dev libplplot-dev plplot-driver-cairo)
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
