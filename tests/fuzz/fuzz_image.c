/*
 * fuzz_image.c - JPEG/PNG decoding (src/data/image_decode.c): the header probe of a file, the
 * decoder in memory, and the resize to f32 CHW of what it decoded.
 *
 * Input: the encoded image. Odd lengths decode to gray (1 channel), even ones to RGB, so both
 * conversions are reached without spending a byte. Images the probe accepts but that are
 * over 4M pixels are not decoded: the library allows up to 16384 pixels a side, and a 100-byte
 * JPEG declaring that size takes seconds to decode (a documented limit, not a finding).
 */
#include "fuzz_common.h"

#include "data/image.h"

#define MAX_DECODED_PIXELS (4ll << 20)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_begin();
    static char path[512];
    if (!path[0]) fuzz_path(path, sizeof path, "image");
    fuzz_write(path, data, size);
    int w = 0, h = 0;
    int probed = ampc__image_probe_file(path, &w, &h);
    fuzz_report("probe", probed == 0);
    if (probed == 0 && (w < 1 || h < 1 || w > AMPC_IMAGE_MAX_DIM || h > AMPC_IMAGE_MAX_DIM)) abort();
    if (probed == 0 && (long long)w * h > MAX_DECODED_PIXELS) return 0;

    int channels = size % 2 ? 1 : 3;
    ampc_image img = {0};
    int rc = ampc__image_decode_mem(data, size, "fuzz input", channels, &img);
    fuzz_report("decode", rc == 0);
    if (rc < 0) {
        if (!ampc_last_error()[0]) abort();   /* a failure must say why */
        return 0;
    }
    /* when both succeed they agree on the size */
    if (img.channels != channels || img.width < 1 || img.height < 1 || !img.pixels) abort();
    if (probed == 0 && (img.width != w || img.height != h)) abort();
    float out[3 * 5 * 7];
    if (ampc__image_resize_chw(&img, 5, 7, out) < 0) abort();
    ampc__image_free(&img);
    return 0;
}
