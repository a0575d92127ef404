/*
 * image_decode.c - JPEG (libturbojpeg) and PNG (libpng) decoding into 8-bit buffers, gray/RGB
 * conversion and the antialiased bilinear resize used by the image-folder dataset.
 *
 * Formats are recognised by content, never by file name. Conversions follow what PIL does for
 * torchvision's ImageFolder (img.convert("RGB") / convert("L"), Resize with BILINEAR), so a
 * dataset decoded here matches the usual PyTorch preprocessing up to rounding:
 * - PNG: palette and low-bit gray are expanded; 16-bit color samples keep their high byte (PIL
 *   opens them as 8-bit RGB/RGBA), 16-bit gray is clipped to 255 (PIL opens it as mode "I" and
 *   convert("RGB") / convert("L") clamp: 256 and up become 255); alpha and tRNS transparency
 *   are dropped (not composited), gamma/ICC chunks are ignored.
 * - JPEG: accurate IDCT, fancy upsampling (the library defaults); CMYK/YCCK files are Adobe's
 *   inverted CMYK, turned into RGB as R = C*K/255 like PIL. Warnings that leave a complete
 *   image ("extraneous bytes before marker") are accepted as PIL accepts them; data that ends
 *   early is an error, since the rest of the image would be filled with grey.
 * Failures return AMPC_ERR_FORMAT (bad or unsupported data), AMPC_ERR_IO (cannot read) or
 * AMPC_ERR_OOM with the file name and the library's reason; libpng's longjmp lands in this
 * file and nothing aborts.
 */
#include "data/image.h"

#include <errno.h>
#include <math.h>
#include <png.h>
#include <setjmp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <turbojpeg.h>

/* Bytes read first by the header probe: enough for the headers of nearly every file (EXIF and
   ICC segments included); the probe reads the whole file only when this is not. */
#define PROBE_BYTES ((size_t)64 << 10)

// ---------------------------------------------------------------------------------------------
// Files

/* Reads up to max bytes (0: all) of path into a malloc'd buffer; *size gets the file's size. */
static int read_file(const char *path, size_t max, uint8_t **buf, size_t *n, size_t *size) {
    char eb[128];
    *buf = NULL;
    *n = 0;
    struct stat st;
    FILE *f = ampc__fopen_regular(path, "image file", &st);   /* refuses a FIFO without blocking */
    if (!f) return ampc_last_status();
    size_t total = (size_t)st.st_size;
    if (size) *size = total;
    if (total > AMPC_IMAGE_MAX_FILE) {
        fclose(f);
        return ampc__err(AMPC_ERR_FORMAT, "%s: file of %zu bytes is larger than the %zu accepted", path, total,
                         AMPC_IMAGE_MAX_FILE);
    }
    size_t want = max && max < total ? max : total;
    uint8_t *p = malloc(want ? want : 1);
    if (!p) {
        fclose(f);
        return ampc__err(AMPC_ERR_OOM, "%s: %zu bytes to read the file", path, want);
    }
    size_t got = fread(p, 1, want, f);
    int e = ferror(f) ? errno : 0;
    fclose(f);
    if (got != want) {
        free(p);
        if (e) return ampc__err(AMPC_ERR_IO, "%s: read failed: %s", path, strerror_r(e, eb, sizeof eb));
        return ampc__err(AMPC_ERR_IO, "%s: file shrank while being read", path);
    }
    *buf = p;
    *n = got;
    return 0;
}

ampc_image_format ampc__image_sniff(const void *buf, size_t n) {
    const uint8_t *b = buf;
    if (n >= 3 && b[0] == 0xFF && b[1] == 0xD8 && b[2] == 0xFF) return AMPC_IMAGE_JPEG;
    if (n >= 4 && b[0] == 0x89 && b[1] == 'P' && b[2] == 'N' && b[3] == 'G') return AMPC_IMAGE_PNG;
    return AMPC_IMAGE_UNKNOWN;
}

/* Never the file's bytes: a path an index points anywhere would print what it holds. */
static int err_unknown(size_t n, const char *name) {
    if (n == 0) return ampc__err(AMPC_ERR_FORMAT, "%s: not a JPEG or PNG file (empty)", name);
    return ampc__err(AMPC_ERR_FORMAT, "%s: not a JPEG or PNG file (no JPEG or PNG signature)", name);
}

static int check_dims(long long w, long long h, const char *name, const char *what) {
    if (w <= 0 || h <= 0) return ampc__err(AMPC_ERR_FORMAT, "%s: %s has no pixels (%lldx%lld)", name, what, w, h);
    if (w > AMPC_IMAGE_MAX_DIM || h > AMPC_IMAGE_MAX_DIM)
        return ampc__err(AMPC_ERR_FORMAT, "%s: %s of %lldx%lld pixels is larger than the %d per side accepted", name,
                         what, w, h, AMPC_IMAGE_MAX_DIM);
    return 0;
}

// ---------------------------------------------------------------------------------------------
// JPEG (libturbojpeg)

static int jpeg_header(tjhandle tj, const uint8_t *buf, size_t n, const char *name, int *w, int *h, int *cs) {
    int subsamp = -1;
    *w = *h = 0;
    *cs = -1;
    if (tjDecompressHeader3(tj, buf, (unsigned long)n, w, h, &subsamp, cs) != 0)
        return ampc__err(AMPC_ERR_FORMAT, "%s: JPEG header: %s", name, tjGetErrorStr2(tj));
    /* Data that ends before the frame header "succeeds" without filling anything in. */
    if (*w == 0 && *h == 0)
        return ampc__err(AMPC_ERR_FORMAT, "%s: JPEG header: no frame header (%s)", name, tjGetErrorStr2(tj));
    return check_dims(*w, *h, name, "JPEG");
}

/* The pixel format to decode a colorspace into: gray stays gray, CMYK stays CMYK (converted
   below), everything else (YCbCr, RGB) becomes RGB. */
static int jpeg_pixel_format(int cs) {
    if (cs == TJCS_GRAY) return TJPF_GRAY;
    if (cs == TJCS_CMYK || cs == TJCS_YCCK) return TJPF_CMYK;
    return TJPF_RGB;
}

static int jpeg_decode(const uint8_t *buf, size_t n, const char *name, ampc_image *img) {
    tjhandle tj = tjInitDecompress();
    if (!tj) return ampc__err(AMPC_ERR_BACKEND, "%s: tjInitDecompress: %s", name, tjGetErrorStr2(NULL));
    int w, h, cs;
    int rc = jpeg_header(tj, buf, n, name, &w, &h, &cs);
    if (rc < 0) goto done;
    int pf = jpeg_pixel_format(cs);
    size_t px = (size_t)w * (size_t)h;
    uint8_t *raw = malloc(px * (size_t)tjPixelSize[pf]);
    if (!raw) {
        rc = ampc__err(AMPC_ERR_OOM, "%s: %dx%d JPEG", name, w, h);
        goto done;
    }
    /* LIMITSCANS refuses progressive files with absurd scan counts (a known decoding DoS). */
    if (tjDecompress2(tj, buf, (unsigned long)n, raw, w, 0, h, pf, TJFLAG_LIMITSCANS) != 0) {
        const char *why = tjGetErrorStr2(tj);
        if (tjGetErrorCode(tj) == TJERR_FATAL || strcasestr(why, "premature end")) {
            free(raw);
            rc = ampc__err(AMPC_ERR_FORMAT, "%s: JPEG: %s", name, why);
            goto done;
        }
    }
    if (pf == TJPF_CMYK) {
        /* In place: pixel i's 4 bytes are read before 3i..3i+2 (all < 4i+4) are written. */
        for (size_t i = 0; i < px; i++) {
            unsigned c = raw[4 * i], m = raw[4 * i + 1], y = raw[4 * i + 2], k = raw[4 * i + 3];
            raw[3 * i] = (uint8_t)((c * k + 127) / 255);
            raw[3 * i + 1] = (uint8_t)((m * k + 127) / 255);
            raw[3 * i + 2] = (uint8_t)((y * k + 127) / 255);
        }
    }
    img->width = w;
    img->height = h;
    img->channels = pf == TJPF_GRAY ? 1 : 3;
    img->pixels = raw;
done:
    tjDestroy(tj);
    return rc;
}

// ---------------------------------------------------------------------------------------------
// PNG (libpng, classic API: it gives the PIL-like conversions above)

typedef struct {
    const uint8_t *p;
    size_t n, pos;
    char msg[200], warning[200];   /* the error, and the last warning (often its cause) */
    /* owned while decoding; in memory (not registers) so they survive libpng's longjmp */
    png_structp png;
    png_infop info;
    uint8_t *pixels;
    png_bytep *rows;
} png_ctx;

static void png_read_cb(png_structp png, png_bytep out, size_t len) {
    png_ctx *c = png_get_io_ptr(png);
    if (len > c->n - c->pos) png_error(png, "file ends early (truncated)");
    memcpy(out, c->p + c->pos, len);
    c->pos += len;
}

static void png_error_cb(png_structp png, png_const_charp msg) {
    png_ctx *c = png_get_error_ptr(png);
    snprintf(c->msg, sizeof c->msg, "%s", msg);
    png_longjmp(png, 1);
}

/* Warnings (e.g. "iCCP: known incorrect sRGB profile") leave a correct image; the last one is
   kept for the message of an error that follows (libpng warns "Image width exceeds user limit"
   before failing with "Invalid IHDR data"). */
static void png_warning_cb(png_structp png, png_const_charp msg) {
    png_ctx *c = png_get_error_ptr(png);
    snprintf(c->warning, sizeof c->warning, "%s", msg);
}

static void png_ctx_free(png_ctx *c) {
    free(c->pixels);
    free(c->rows);
    c->pixels = NULL;
    c->rows = NULL;
    png_destroy_read_struct(&c->png, &c->info, NULL);
}

/* Decodes (or, with img NULL, only reads the header of) the PNG in c->p[0..n). Everything that
   changes after setjmp lives in *c, so a longjmp finds it intact. */
static int png_run(png_ctx *c, const char *name, ampc_image *img, int *w, int *h) {
    c->png = png_create_read_struct(PNG_LIBPNG_VER_STRING, c, png_error_cb, png_warning_cb);
    if (!c->png) return ampc__err(AMPC_ERR_OOM, "%s: png_create_read_struct", name);
    c->info = png_create_info_struct(c->png);
    if (!c->info) {
        png_ctx_free(c);
        return ampc__err(AMPC_ERR_OOM, "%s: png_create_info_struct", name);
    }
    if (setjmp(png_jmpbuf(c->png))) {
        png_ctx_free(c);
        if (c->warning[0]) return ampc__err(AMPC_ERR_FORMAT, "%s: PNG: %s (%s)", name, c->msg, c->warning);
        return ampc__err(AMPC_ERR_FORMAT, "%s: PNG: %s", name, c->msg);
    }
    png_set_read_fn(c->png, c, png_read_cb);
    /* libpng refuses bigger images in png_read_info, before allocating anything for them */
    png_set_user_limits(c->png, AMPC_IMAGE_MAX_DIM, AMPC_IMAGE_MAX_DIM);
    png_read_info(c->png, c->info);
    png_uint_32 pw, ph;
    int depth, ctype;
    png_get_IHDR(c->png, c->info, &pw, &ph, &depth, &ctype, NULL, NULL, NULL);
    if (w) *w = (int)pw;
    if (h) *h = (int)ph;
    if (!img) {
        png_ctx_free(c);
        return 0;
    }
    const bool gray16 = ctype == PNG_COLOR_TYPE_GRAY && depth == 16;   /* clipped below, as PIL */
    if (depth == 16 && !gray16) png_set_strip_16(c->png);
    if (ctype == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(c->png);
    if (ctype == PNG_COLOR_TYPE_GRAY && depth < 8) png_set_expand_gray_1_2_4_to_8(c->png);
    png_set_strip_alpha(c->png);
    png_set_interlace_handling(c->png);
    png_read_update_info(c->png, c->info);
    int ch = png_get_channels(c->png, c->info);
    size_t rowbytes = png_get_rowbytes(c->png, c->info);
    if ((ch != 1 && ch != 3) || rowbytes != (size_t)pw * (size_t)ch * (gray16 ? 2 : 1)) png_error(c->png, "unexpected pixel layout");
    c->pixels = malloc((size_t)ph * rowbytes);
    c->rows = malloc((size_t)ph * sizeof *c->rows);
    if (!c->pixels || !c->rows) {
        png_ctx_free(c);
        return ampc__err(AMPC_ERR_OOM, "%s: %ux%u PNG", name, (unsigned)pw, (unsigned)ph);
    }
    for (png_uint_32 y = 0; y < ph; y++) c->rows[y] = c->pixels + (size_t)y * rowbytes;
    png_read_image(c->png, c->rows);
    if (gray16) {   /* big-endian samples, narrowed in place: min(v, 255) */
        const size_t px = (size_t)pw * (size_t)ph;
        for (size_t i = 0; i < px; i++) c->pixels[i] = c->pixels[2 * i] ? 255 : c->pixels[2 * i + 1];
    }
    img->width = (int)pw;
    img->height = (int)ph;
    img->channels = ch;
    img->pixels = c->pixels;
    c->pixels = NULL;   /* now the image's */
    png_ctx_free(c);
    return 0;
}

static int png_decode(const uint8_t *buf, size_t n, const char *name, ampc_image *img, int *w, int *h) {
    png_ctx c = {.p = buf, .n = n};
    return png_run(&c, name, img, w, h);
}

// ---------------------------------------------------------------------------------------------
// Header probe and full decode

static int probe_mem(const uint8_t *buf, size_t n, const char *name, int *w, int *h) {
    switch (ampc__image_sniff(buf, n)) {
    case AMPC_IMAGE_JPEG: {
        tjhandle tj = tjInitDecompress();
        if (!tj) return ampc__err(AMPC_ERR_BACKEND, "%s: tjInitDecompress: %s", name, tjGetErrorStr2(NULL));
        int width, height, colorspace;
        int rc = jpeg_header(tj, buf, n, name, &width, &height, &colorspace);
        tjDestroy(tj);
        if (rc < 0) return rc;
        if (w) *w = width;
        if (h) *h = height;
        return 0;
    }
    case AMPC_IMAGE_PNG:
        return png_decode(buf, n, name, NULL, w, h);
    default:
        return err_unknown(n, name);
    }
}

int ampc__image_probe_file(const char *path, int *w, int *h) {
    uint8_t *buf;
    size_t n, size;
    int rc = read_file(path, PROBE_BYTES, &buf, &n, &size);
    if (rc < 0) return rc;
    rc = probe_mem(buf, n, path, w, h);
    if (rc < 0 && n < size && ampc__image_sniff(buf, n) != AMPC_IMAGE_UNKNOWN) {
        /* headers longer than the first read (big EXIF/ICC segments): try the whole file */
        free(buf);
        rc = read_file(path, 0, &buf, &n, &size);
        if (rc < 0) return rc;
        rc = probe_mem(buf, n, path, w, h);
    }
    free(buf);
    return rc;
}

/* Converts img to `channels` in place (1 <-> 3). */
static int convert_channels(ampc_image *img, int channels, const char *name) {
    if (img->channels == channels) return 0;
    size_t px = (size_t)img->width * (size_t)img->height;
    uint8_t *p = img->pixels;
    if (channels == 3) {   /* gray -> RGB: replicate */
        uint8_t *q = malloc(px * 3);
        if (!q) return ampc__err(AMPC_ERR_OOM, "%s: gray to RGB", name);
        for (size_t i = 0; i < px; i++) q[3 * i] = q[3 * i + 1] = q[3 * i + 2] = p[i];
        free(p);
        img->pixels = q;
    } else {   /* RGB -> gray: ITU-R 601-2 luma with PIL's fixed-point rounding */
        for (size_t i = 0; i < px; i++) {
            uint32_t r = p[3 * i], g = p[3 * i + 1], b = p[3 * i + 2];
            p[i] = (uint8_t)((r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16);
        }
    }
    img->channels = channels;
    return 0;
}

int ampc__image_decode_mem(const void *buf, size_t n, const char *name, int channels, ampc_image *img) {
    *img = (ampc_image){0};
    if (channels != 1 && channels != 3)
        return ampc__err(AMPC_ERR_INVALID, "%s: channels must be 1 or 3, not %d", name, channels);
    int rc;
    switch (ampc__image_sniff(buf, n)) {
    case AMPC_IMAGE_JPEG: rc = jpeg_decode(buf, n, name, img); break;
    case AMPC_IMAGE_PNG: rc = png_decode(buf, n, name, img, NULL, NULL); break;
    default: return err_unknown(n, name);
    }
    if (rc == 0) rc = convert_channels(img, channels, name);
    if (rc < 0) ampc__image_free(img);
    return rc;
}

int ampc__image_decode_file(const char *path, int channels, ampc_image *img) {
    *img = (ampc_image){0};
    uint8_t *buf;
    size_t n;
    int rc = read_file(path, 0, &buf, &n, NULL);
    if (rc < 0) return rc;
    rc = ampc__image_decode_mem(buf, n, path, channels, img);
    free(buf);
    return rc;
}

void ampc__image_free(ampc_image *img) {
    if (!img) return;
    free(img->pixels);
    *img = (ampc_image){0};
}

// ---------------------------------------------------------------------------------------------
// Resize: PIL's ImagingResample with the bilinear (triangle) filter, in f32, separable.

typedef struct {
    int64_t *lo, *cnt;   /* per output index: first input index and number of taps */
    float *w;            /* per output index: kmax normalised weights */
    int64_t kmax;
} resize_taps;

static void taps_free(resize_taps *t) {
    free(t->lo);
    free(t->cnt);
    free(t->w);
    *t = (resize_taps){0};
}

static int taps_init(resize_taps *t, int64_t in, int64_t out) {
    double scale = (double)in / (double)out;
    double fs = scale > 1 ? scale : 1;   /* shrinking widens the filter: antialiasing */
    double support = fs;                 /* the triangle's support is 1 input pixel, scaled */
    t->kmax = (int64_t)ceil(support) * 2 + 1;
    t->lo = malloc((size_t)out * sizeof *t->lo);
    t->cnt = malloc((size_t)out * sizeof *t->cnt);
    t->w = calloc((size_t)(out * t->kmax), sizeof *t->w);
    double *kk = malloc((size_t)t->kmax * sizeof *kk);   /* one output's unnormalised weights */
    if (!t->lo || !t->cnt || !t->w || !kk) {
        taps_free(t);
        free(kk);
        return ampc__err(AMPC_ERR_OOM, "resize taps for %lld -> %lld", (long long)in, (long long)out);
    }
    for (int64_t i = 0; i < out; i++) {
        double centre = ((double)i + 0.5) * scale;
        int64_t x0 = (int64_t)(centre - support + 0.5), x1 = (int64_t)(centre + support + 0.5);
        if (x0 < 0) x0 = 0;
        if (x1 > in) x1 = in;
        float *w = t->w + i * t->kmax;
        double sum = 0;
        for (int64_t x = x0; x < x1; x++) {
            double d = fabs(((double)x - centre + 0.5) / fs);
            kk[x - x0] = d < 1 ? 1 - d : 0;
            sum += kk[x - x0];
        }
        for (int64_t x = x0; x < x1; x++) w[x - x0] = (float)(sum != 0 ? kk[x - x0] / sum : 0);
        t->lo[i] = x0;
        t->cnt[i] = x1 - x0;
    }
    free(kk);
    return 0;
}

int ampc__image_resize_chw(const ampc_image *img, int64_t out_h, int64_t out_w, float *out) {
    if (out_h <= 0 || out_w <= 0)
        return ampc__err(AMPC_ERR_INVALID, "resize to %lldx%lld", (long long)out_h, (long long)out_w);
    const int64_t C = img->channels, H = img->height, W = img->width;
    resize_taps th = {0}, tv = {0};
    float *tmp = malloc((size_t)(C * H * out_w) * sizeof *tmp);   /* (C, H, out_w) */
    int rc = tmp ? 0 : ampc__err(AMPC_ERR_OOM, "resize buffer");
    if (rc == 0) rc = taps_init(&th, W, out_w);
    if (rc == 0) rc = taps_init(&tv, H, out_h);
    if (rc < 0) goto done;
    /* horizontal pass: rows of the interleaved image -> (C, H, out_w) */
    for (int64_t y = 0; y < H; y++) {
        const uint8_t *row = img->pixels + y * W * C;
        for (int64_t x = 0; x < out_w; x++) {
            const float *w = th.w + x * th.kmax;
            const uint8_t *src = row + th.lo[x] * C;
            for (int64_t c = 0; c < C; c++) {
                float s = 0;
                for (int64_t k = 0; k < th.cnt[x]; k++) s += w[k] * (float)src[k * C + c];
                tmp[(c * H + y) * out_w + x] = s;
            }
        }
    }
    /* vertical pass: (C, H, out_w) -> (C, out_h, out_w), scaled to [0, 1] */
    for (int64_t c = 0; c < C; c++) {
        for (int64_t y = 0; y < out_h; y++) {
            const float *w = tv.w + y * tv.kmax;
            const float *src = tmp + (c * H + tv.lo[y]) * out_w;
            float *dst = out + (c * out_h + y) * out_w;
            for (int64_t x = 0; x < out_w; x++) dst[x] = 0;
            for (int64_t k = 0; k < tv.cnt[y]; k++)
                for (int64_t x = 0; x < out_w; x++) dst[x] += w[k] * src[k * out_w + x];
            for (int64_t x = 0; x < out_w; x++) dst[x] /= 255.0f;
        }
    }
done:
    taps_free(&th);
    taps_free(&tv);
    free(tmp);
    return rc;
}
