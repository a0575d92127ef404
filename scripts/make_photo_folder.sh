#!/usr/bin/env bash
# make_photo_folder.sh - an image folder of real photographs from Debian packages, for the
# transfer-learning run in README.md: each photograph is a class, its samples are crops of it.
#
#     bash scripts/make_photo_folder.sh OUT SET [PER_CLASS]
#
# SET nature: the 12 photographs of mate-backgrounds' nature/ (garden, dune, wood, ladybird,
#     flowers, storm, ...), the fine-tuning task;
# SET other: the other photographs and pictures of mate-backgrounds (abstract/, desktop/; the
#     elephants once), the "pretraining" task, so the pretrained weights never saw the nature set.
# Each source is scaled to 640 pixels on its shorter side, then PER_CLASS (default 60) square
# crops of 30-60% of that side at positions drawn from a fixed LCG are saved as 128x128 JPEGs
# (quality 92): OUT/<photo>/crop_NNN.jpg. Needs imagemagick (installed here if missing);
# the same command gives the same files.
set -euo pipefail
OUT=${1:?usage: make_photo_folder.sh OUT nature|other [PER_CLASS]}
SET=${2:?usage: make_photo_folder.sh OUT nature|other [PER_CLASS]}
PER=${3:-60}
BG=/usr/share/backgrounds/mate
if [ ! -d "$BG/nature" ] || ! command -v convert >/dev/null; then
    SUDO=; [ "$(id -u)" -eq 0 ] || SUDO=sudo
    $SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends mate-backgrounds imagemagick
fi
case "$SET" in
nature) SRC=("$BG"/nature/*.jpg) ;;
other) SRC=("$BG"/abstract/Elephants.jpg "$BG"/abstract/*.png "$BG"/desktop/*.png "$BG"/desktop/*.jpg) ;;
*) echo "make_photo_folder.sh: SET is nature or other, not '$SET'" >&2; exit 2 ;;
esac
mkdir -p "$OUT"
seed=12345
for src in "${SRC[@]}"; do
    name=$(basename "${src%.*}")
    mkdir -p "$OUT/$name"
    small="$OUT/$name/.source.png"
    convert "$src" -resize '640x640^' "$small"
    w=$(identify -format '%w' "$small") h=$(identify -format '%h' "$small")
    side=$((w < h ? w : h))
    args=()
    for ((i = 0; i < PER; i++)); do
        # a 31-bit LCG (glibc's constants): three draws per crop
        seed=$(((seed * 1103515245 + 12345) % 2147483648)); s=$((side * (30 + seed % 31) / 100))
        seed=$(((seed * 1103515245 + 12345) % 2147483648)); x=$((seed % (w - s + 1)))
        seed=$(((seed * 1103515245 + 12345) % 2147483648)); y=$((seed % (h - s + 1)))
        args+=(\( +clone -crop "${s}x${s}+${x}+${y}" +repage -resize 128x128! -quality 92 -write "$OUT/$name/$(printf 'crop_%03d.jpg' "$i")" +delete \))
    done
    convert "$small" "${args[@]}" null:
    rm -f "$small"
done
echo "$OUT: $(find "$OUT" -name '*.jpg' | wc -l) images in ${#SRC[@]} classes"
