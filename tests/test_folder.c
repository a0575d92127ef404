/*
 * test_folder.c - the image-folder dataset and image decoding: a temporary folder tree of PNGs
 * (written with libpng) and JPEGs (libturbojpeg) of known content, plus files that must be
 * skipped or fail; checks class order and names, labels, pixel values, resizing against
 * independent formulas, channel conversion, the CSV index and the error messages.
 *
 * Tolerances: PNG is lossless, so pixels are exact (v/255 as f32). JPEGs of solid colours are
 * written at quality 100 (DC quantiser 1): decoded values are within 3/255 (YCbCr rounding both
 * ways plus the DCT's rounding). Resizing accumulates at most 2 passes of k-tap f32 sums of
 * values <= 255 with weights summing to 1: the absolute error on v/255 is a few f32 ulps.
 */
#include "testutil.h"

#include <ftw.h>
#include <math.h>
#include <png.h>
#include <stdio.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <turbojpeg.h>
#include <unistd.h>

#include "data/data.h"
#include "data/image.h"

#define JPEG_TOL (3.0 / 255.0)
#define RESIZE_TOL (32 * 0x1p-24)

// ---------------------------------------------------------------------------------------------
// Writing test files

/* An 8- or 16-bit PNG of color type ctype from packed rows (optionally Adam7-interlaced and
   with a palette). */
static void write_png_ex(const char *path, int w, int h, int ctype, int depth, const uint8_t *data, bool interlace,
                         const png_color *palette, int npal) {
    FILE *f = fopen(path, "wb");
    if (!f) fail_msg("cannot write %s", path);
    png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, NULL, NULL, NULL);
    png_infop info = png_create_info_struct(png);
    if (setjmp(png_jmpbuf(png))) fail_msg("libpng failed writing %s", path);
    png_init_io(png, f);
    png_set_IHDR(png, info, (png_uint_32)w, (png_uint_32)h, depth, ctype,
                 interlace ? PNG_INTERLACE_ADAM7 : PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT,
                 PNG_FILTER_TYPE_DEFAULT);
    if (palette) png_set_PLTE(png, info, palette, npal);
    png_write_info(png, info);
    int ch = ctype == PNG_COLOR_TYPE_GRAY || ctype == PNG_COLOR_TYPE_PALETTE ? 1
           : ctype == PNG_COLOR_TYPE_GRAY_ALPHA ? 2 : ctype == PNG_COLOR_TYPE_RGB ? 3 : 4;
    size_t rowbytes = (size_t)w * (size_t)ch * (size_t)(depth / 8);
    png_bytep *rows = malloc((size_t)h * sizeof *rows);
    for (int y = 0; y < h; y++) rows[y] = (png_bytep)data + (size_t)y * rowbytes;
    png_write_image(png, rows);
    png_write_end(png, NULL);
    png_destroy_write_struct(&png, &info);
    free(rows);
    fclose(f);
}

static void write_png(const char *path, int w, int h, int channels, const uint8_t *data) {
    int ctype = channels == 1 ? PNG_COLOR_TYPE_GRAY : channels == 3 ? PNG_COLOR_TYPE_RGB : PNG_COLOR_TYPE_RGBA;
    write_png_ex(path, w, h, ctype, 8, data, false, NULL, 0);
}

static void write_bytes(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) fail_msg("cannot write %s", path);
    assert_int_equal(fwrite(data, 1, n, f), n);
    fclose(f);
}

static uint8_t *read_bytes(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) fail_msg("cannot read %s", path);
    fseek(f, 0, SEEK_END);
    *n = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc(*n + 1);
    assert_int_equal(fread(b, 1, *n, f), *n);
    b[*n] = 0;
    fclose(f);
    return b;
}

/* A JPEG from packed pixels of format pf (TJPF_RGB, TJPF_GRAY, TJPF_CMYK). */
static void write_jpeg(const char *path, int w, int h, int pf, const uint8_t *data, int quality) {
    tjhandle tj = tjInitCompress();
    unsigned char *jpg = NULL;
    unsigned long n = 0;
    int samp = pf == TJPF_GRAY ? TJSAMP_GRAY : TJSAMP_444;
    if (tjCompress2(tj, data, w, 0, h, pf, &jpg, &n, samp, quality, 0) != 0)
        fail_msg("tjCompress2 %s: %s", path, tjGetErrorStr2(tj));
    write_bytes(path, jpg, n);
    tjFree(jpg);
    tjDestroy(tj);
}

static uint8_t *solid(int w, int h, int ch, const uint8_t *v) {
    uint8_t *p = malloc((size_t)w * h * ch);
    for (int i = 0; i < w * h; i++) memcpy(p + (size_t)i * ch, v, (size_t)ch);
    return p;
}

static void write_solid_png(const char *path, int w, int h, int ch, const uint8_t *v) {
    uint8_t *p = solid(w, h, ch, v);
    write_png(path, w, h, ch, p);
    free(p);
}

static void write_solid_jpeg(const char *path, int w, int h, int pf, const uint8_t *v) {
    uint8_t *p = solid(w, h, tjPixelSize[pf], v);
    write_jpeg(path, w, h, pf, p, 100);
    free(p);
}

static char *pathf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *pathf(const char *fmt, ...) {
    static _Thread_local char bufs[8][1024];
    static _Thread_local int k;
    char *b = bufs[k++ % 8];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(b, 1024, fmt, ap);
    va_end(ap);
    return b;
}

static int rm_one(const char *p, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st, (void)flag, (void)ftw;
    return remove(p);
}
static void rm_rf(const char *dir) { nftw(dir, rm_one, 16, FTW_DEPTH | FTW_PHYS); }

static char *make_tmpdir(void) {
    char *d = strdup("/tmp/ampc_test_folder_XXXXXX");
    if (!mkdtemp(d)) fail_msg("mkdtemp failed");
    return d;
}

static void expect_error(int status, const char *substr) {
    if (ampc_last_status() != status || !strstr(ampc_last_error(), substr))
        fail_msg("expected status %d with '%s', got %d: %s", status, substr, ampc_last_status(), ampc_last_error());
}

// ---------------------------------------------------------------------------------------------
// The main tree
//
// Class folders sorted by bytes: "B_upper" < "a_gray" < "b,comma" (a case-insensitive sort
// would put a_gray first). Samples, in order:
//   0 B_upper/Solid.JPG   16x16 JPEG (50, 100, 150)
//   1 B_upper/grad.png    4x3 RGB gradient GRAD(x, y)
//   2 B_upper/red.png     4x3 RGB (200, 10, 30)
//   3 B_upper/sub/inner.png  4x3 RGB (1, 2, 3)        (nested folders come after the files)
//   4 a_gray/g.jpeg       8x8 gray JPEG 77
//   5 a_gray/g8.png       4x3 gray, value 20*x + 60*y + 5
//   6 a_gray/rgba.png     4x3 RGBA (9, 99, 199, alpha 17*x): alpha dropped
//   7 b,comma/p16.png     4x3 16-bit RGB (0x1234, 0xABCD, 0xFF00): high bytes
//   8 b,comma/x,"q".png   4x3 RGB (255, 128, 0)
// Skipped (2): B_upper/x.jpg (text), a_gray/cut.png (cut inside its header). Ignored: hidden
// files and folders, notes.txt, files directly under root.

static char *g_root, *g_aux;

#define GRAD_R(x, y) (uint8_t)(10 + 60 * (x) + 3 * (y))
#define GRAD_G(x, y) (uint8_t)(250 - 40 * (y) - 7 * (x))
#define GRAD_B(x, y) (uint8_t)(17 * (x) * (y) + 1)

static const uint8_t SOLID_JPG[3] = {50, 100, 150}, RED[3] = {200, 10, 30}, INNER[3] = {1, 2, 3},
                     GRAY_JPG = 77, RGBA_RGB[3] = {9, 99, 199}, COMMA[3] = {255, 128, 0};

static int setup_tree(void **state) {
    tu_group_setup(state);
    g_root = make_tmpdir();
    g_aux = make_tmpdir();
    const char *r = g_root;
    /* classes made in non-sorted order */
    mkdir(pathf("%s/b,comma", r), 0755);
    mkdir(pathf("%s/a_gray", r), 0755);
    mkdir(pathf("%s/B_upper", r), 0755);
    mkdir(pathf("%s/B_upper/sub", r), 0755);
    mkdir(pathf("%s/.git", r), 0755);

    write_solid_jpeg(pathf("%s/B_upper/Solid.JPG", r), 16, 16, TJPF_RGB, SOLID_JPG);
    uint8_t grad[3 * 4 * 3];
    for (int y = 0; y < 3; y++)
        for (int x = 0; x < 4; x++) {
            grad[(y * 4 + x) * 3] = GRAD_R(x, y);
            grad[(y * 4 + x) * 3 + 1] = GRAD_G(x, y);
            grad[(y * 4 + x) * 3 + 2] = GRAD_B(x, y);
        }
    write_png(pathf("%s/B_upper/grad.png", r), 4, 3, 3, grad);
    write_solid_png(pathf("%s/B_upper/red.png", r), 4, 3, 3, RED);
    write_solid_png(pathf("%s/B_upper/sub/inner.png", r), 4, 3, 3, INNER);
    write_solid_png(pathf("%s/B_upper/.hidden.png", r), 4, 3, 3, RED);
    write_bytes(pathf("%s/B_upper/x.jpg", r), "hello, I am not a JPEG\n", 23);
    write_bytes(pathf("%s/B_upper/notes.txt", r), "notes\n", 6);

    write_solid_jpeg(pathf("%s/a_gray/g.jpeg", r), 8, 8, TJPF_GRAY, &GRAY_JPG);
    uint8_t g8[12];
    for (int y = 0; y < 3; y++)
        for (int x = 0; x < 4; x++) g8[y * 4 + x] = (uint8_t)(20 * x + 60 * y + 5);
    write_png(pathf("%s/a_gray/g8.png", r), 4, 3, 1, g8);
    uint8_t rgba[12 * 4];
    for (int i = 0; i < 12; i++) {
        memcpy(rgba + 4 * i, RGBA_RGB, 3);
        rgba[4 * i + 3] = (uint8_t)(17 * (i % 4));
    }
    write_png(pathf("%s/a_gray/rgba.png", r), 4, 3, 4, rgba);
    /* cut inside the header: the first 20 bytes of a valid PNG */
    size_t n;
    uint8_t *full = read_bytes(pathf("%s/a_gray/g8.png", r), &n);
    write_bytes(pathf("%s/a_gray/cut.png", r), full, 20);
    free(full);

    uint8_t p16[12 * 6];
    for (int i = 0; i < 12; i++) {
        const uint8_t be[6] = {0x12, 0x34, 0xAB, 0xCD, 0xFF, 0x00};
        memcpy(p16 + 6 * i, be, 6);
    }
    write_png_ex(pathf("%s/b,comma/p16.png", r), 4, 3, PNG_COLOR_TYPE_RGB, 16, p16, false, NULL, 0);
    write_solid_png(pathf("%s/b,comma/x,\"q\".png", r), 4, 3, 3, COMMA);

    write_solid_png(pathf("%s/.git/in_hidden.png", r), 4, 3, 3, RED);
    write_solid_png(pathf("%s/at_root.png", r), 4, 3, 3, RED);
    return 0;
}

static int teardown_tree(void **state) {
    rm_rf(g_root);
    rm_rf(g_aux);
    free(g_root);
    free(g_aux);
    return tu_group_teardown(state);
}

static ampc_dataset *open_tree(int64_t h, int64_t w, int channels, const char *csv) {
    ampc_folder_options o = {.height = h, .width = w, .channels = channels, .index_csv = csv};
    ampc_dataset *ds = ampc_dataset_folder_open(g_root, &o);
    ASSERT_NOT_NULL_MSG(ds);
    return ds;
}

static const char *const NAMES[3] = {"B_upper", "a_gray", "b,comma"};
static const char *const REL[9] = {"B_upper/Solid.JPG", "B_upper/grad.png",   "B_upper/red.png",
                                   "B_upper/sub/inner.png", "a_gray/g.jpeg", "a_gray/g8.png",
                                   "a_gray/rgba.png", "b,comma/p16.png", "b,comma/x,\"q\".png"};
static const int64_t LABELS[9] = {0, 0, 0, 0, 1, 1, 1, 2, 2};

static void check_layout(const ampc_dataset *ds) {
    assert_int_equal(ampc_dataset_size(ds), 9);
    assert_int_equal(ampc_dataset_num_classes(ds), 3);
    for (int c = 0; c < 3; c++) {
        const char *name = ampc_dataset_class_name(ds, c);
        if (!name || strcmp(name, NAMES[c])) fail_msg("class %d: '%s', expected '%s'", c, name ? name : "(null)", NAMES[c]);
    }
    for (int i = 0; i < 9; i++) {
        const char *p = ampc_dataset_folder_path(ds, i);
        ASSERT_NOT_NULL_MSG(p);
        const char *want = pathf("%s/%s", g_root, REL[i]);
        if (strcmp(p, want)) fail_msg("sample %d: path %s, expected %s", i, p, want);
    }
}

/* Sample i of ds into a malloc'd buffer (checks its label). */
static float *sample(ampc_dataset *ds, int64_t i) {
    int64_t c, h, w, label = -1;
    ampc_dataset_sample_shape(ds, &c, &h, &w);
    float *img = malloc((size_t)(c * h * w) * sizeof *img);
    ASSERT_OK(ampc_dataset_get(ds, i, img, &label));
    assert_int_equal(label, LABELS[i]);
    return img;
}

/* Every pixel of plane c of img (h x w) within tol of v/255. */
static void expect_plane(const float *img, int64_t c, int64_t h, int64_t w, double v, double tol, const char *what) {
    for (int64_t k = 0; k < h * w; k++) {
        double got = img[c * h * w + k];
        if (fabs(got - v / 255.0) > tol)
            fail_msg("%s: channel %lld pixel %lld: %.7f, expected %.7f (tol %.2g)", what, (long long)c, (long long)k,
                     got, v / 255.0, tol);
    }
}

static void expect_exact_rgb(const float *img, const uint8_t rgb[3], const char *what) {
    for (int c = 0; c < 3; c++)
        for (int k = 0; k < 12; k++)
            if (img[c * 12 + k] != (float)rgb[c] / 255.0f)
                fail_msg("%s: channel %d pixel %d: %.7f, expected %d/255", what, c, k, img[c * 12 + k], rgb[c]);
}

/* ITU-R 601 luma of an RGB triple (unrounded). */
static double luma(const uint8_t rgb[3]) { return 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]; }

// ---------------------------------------------------------------------------------------------
// Tests

static void test_scan_order_labels_pixels(void **state) {
    (void)state;
    ampc_dataset *ds = open_tree(3, 4, 3, NULL);   /* the PNGs' own size: no resampling */
    check_layout(ds);
    assert_int_equal(ampc_dataset_folder_skipped(ds), 2);
    int64_t c, h, w;
    ampc_dataset_sample_shape(ds, &c, &h, &w);
    assert_true(c == 3 && h == 3 && w == 4);

    float *img = sample(ds, 0);   /* solid JPEG, shrunk 16x16 -> 3x4: still solid */
    for (int k = 0; k < 3; k++) expect_plane(img, k, 3, 4, SOLID_JPG[k], JPEG_TOL, "Solid.JPG");
    free(img);
    img = sample(ds, 1);   /* CHW layout of a gradient */
    for (int y = 0; y < 3; y++)
        for (int x = 0; x < 4; x++) {
            assert_true(img[0 * 12 + y * 4 + x] == (float)GRAD_R(x, y) / 255.0f);
            assert_true(img[1 * 12 + y * 4 + x] == (float)GRAD_G(x, y) / 255.0f);
            assert_true(img[2 * 12 + y * 4 + x] == (float)GRAD_B(x, y) / 255.0f);
        }
    free(img);
    img = sample(ds, 2);
    expect_exact_rgb(img, RED, "red.png");
    free(img);
    img = sample(ds, 3);
    expect_exact_rgb(img, INNER, "sub/inner.png");
    free(img);
    img = sample(ds, 4);   /* gray JPEG replicated to 3 channels */
    for (int k = 0; k < 3; k++) expect_plane(img, k, 3, 4, GRAY_JPG, JPEG_TOL, "g.jpeg");
    for (int k = 0; k < 12; k++) assert_true(img[k] == img[12 + k] && img[k] == img[24 + k]);
    free(img);
    img = sample(ds, 5);   /* gray PNG replicated, exact */
    for (int k = 0; k < 3; k++)
        for (int y = 0; y < 3; y++)
            for (int x = 0; x < 4; x++) assert_true(img[k * 12 + y * 4 + x] == (float)(20 * x + 60 * y + 5) / 255.0f);
    free(img);
    img = sample(ds, 6);
    expect_exact_rgb(img, RGBA_RGB, "rgba.png (alpha dropped)");
    free(img);
    img = sample(ds, 7);
    expect_exact_rgb(img, (const uint8_t[3]){0x12, 0xAB, 0xFF}, "p16.png (high bytes)");
    free(img);
    img = sample(ds, 8);
    expect_exact_rgb(img, COMMA, "x,\"q\".png");
    free(img);

    /* several threads at once (the loader's workers) give the same samples */
    float *serial = malloc(9 * 36 * sizeof *serial);
    int64_t lab[9];
    for (int i = 0; i < 9; i++) ASSERT_OK(ampc_dataset_get(ds, i, serial + 36 * i, &lab[i]));
    int bad = 0;
#pragma omp parallel for num_threads(4) reduction(+ : bad)
    for (int i = 0; i < 9 * 4; i++) {
        int64_t l;
        float buf[36];
        if (ampc_dataset_get(ds, i % 9, buf, &l) < 0 || l != lab[i % 9] || memcmp(buf, serial + 36 * (i % 9), sizeof buf))
            bad++;
    }
    assert_int_equal(bad, 0);
    free(serial);

    ampc_dataset_free(ds);
}

static void test_gray_conversion(void **state) {
    (void)state;
    ampc_dataset *ds = open_tree(3, 4, 1, NULL);
    int64_t c, h, w;
    ampc_dataset_sample_shape(ds, &c, &h, &w);
    assert_true(c == 1 && h == 3 && w == 4);
    /* RGB -> gray is ITU-R 601 luma rounded to 8 bits: within half a level (plus the 1e-5
       difference of PIL's 16-bit fixed-point coefficients from 0.299/0.587/0.114) */
    const double round_tol = (0.5 + 0.01) / 255.0;
    float *img = sample(ds, 2);
    expect_plane(img, 0, 3, 4, luma(RED), round_tol, "red.png as gray");
    free(img);
    img = sample(ds, 1);
    for (int y = 0; y < 3; y++)
        for (int x = 0; x < 4; x++) {
            const uint8_t px[3] = {GRAD_R(x, y), GRAD_G(x, y), GRAD_B(x, y)};
            assert_true(fabs(img[y * 4 + x] - luma(px) / 255.0) <= round_tol);
        }
    free(img);
    img = sample(ds, 0);   /* RGB JPEG to gray */
    expect_plane(img, 0, 3, 4, luma(SOLID_JPG), JPEG_TOL + round_tol, "Solid.JPG as gray");
    free(img);
    img = sample(ds, 4);   /* gray JPEG stays gray */
    expect_plane(img, 0, 3, 4, GRAY_JPG, JPEG_TOL, "g.jpeg");
    free(img);
    img = sample(ds, 5);   /* gray PNG: exact */
    for (int y = 0; y < 3; y++)
        for (int x = 0; x < 4; x++) assert_true(img[y * 4 + x] == (float)(20 * x + 60 * y + 5) / 255.0f);
    free(img);
    ampc_dataset_free(ds);
}

/* PyTorch's interpolate(bilinear, align_corners=False) of channel fn at output (oy, ox). */
static double bilinear_ref(double (*fn)(int, int, int), int c, int in_h, int in_w, int out_h, int out_w, int oy,
                           int ox) {
    double sy = fmax(0, (oy + 0.5) * in_h / out_h - 0.5), sx = fmax(0, (ox + 0.5) * in_w / out_w - 0.5);
    int y0 = (int)sy, x0 = (int)sx;
    int y1 = y0 + 1 < in_h ? y0 + 1 : in_h - 1, x1 = x0 + 1 < in_w ? x0 + 1 : in_w - 1;
    double ly = sy - y0, lx = sx - x0;
    return (1 - ly) * ((1 - lx) * fn(c, y0, x0) + lx * fn(c, y0, x1)) + ly * ((1 - lx) * fn(c, y1, x0) + lx * fn(c, y1, x1));
}

/* PIL's antialiased (triangle) filter by its definition: the weight of input pixel x for output
   i is max(0, 1 - |x + 0.5 - (i + 0.5) * scale| / max(scale, 1)), normalised over all x. */
static double triangle_w(int x, int i, int in, int out) {
    double scale = (double)in / out, s = scale > 1 ? scale : 1;
    return fmax(0, 1 - fabs(x + 0.5 - (i + 0.5) * scale) / s);
}
static double triangle_ref(double (*fn)(int, int, int), int c, int in_h, int in_w, int out_h, int out_w, int oy,
                           int ox) {
    double sum = 0, wsum_y = 0, wsum_x = 0;
    for (int y = 0; y < in_h; y++) wsum_y += triangle_w(y, oy, in_h, out_h);
    for (int x = 0; x < in_w; x++) wsum_x += triangle_w(x, ox, in_w, out_w);
    for (int y = 0; y < in_h; y++)
        for (int x = 0; x < in_w; x++)
            sum += triangle_w(y, oy, in_h, out_h) * triangle_w(x, ox, in_w, out_w) * fn(c, y, x);
    return sum / (wsum_y * wsum_x);
}

static double grad_px(int c, int y, int x) {
    return (c == 0 ? GRAD_R(x, y) : c == 1 ? GRAD_G(x, y) : GRAD_B(x, y)) / 255.0;
}

static void check_resize(int out_h, int out_w, bool upsample) {
    ampc_dataset *ds = open_tree(out_h, out_w, 3, NULL);
    float *img = sample(ds, 1);   /* grad.png, 4x3 */
    for (int c = 0; c < 3; c++)
        for (int y = 0; y < out_h; y++)
            for (int x = 0; x < out_w; x++) {
                double ref = upsample ? bilinear_ref(grad_px, c, 3, 4, out_h, out_w, y, x)
                                      : triangle_ref(grad_px, c, 3, 4, out_h, out_w, y, x);
                double got = img[(c * out_h + y) * out_w + x];
                if (fabs(got - ref) > RESIZE_TOL)
                    fail_msg("resize 3x4 -> %dx%d: channel %d (%d, %d): %.8f, expected %.8f", out_h, out_w, c, y, x, got,
                             ref);
            }
    free(img);
    img = sample(ds, 2);   /* a solid colour stays that colour at any size */
    for (int c = 0; c < 3; c++) expect_plane(img, c, out_h, out_w, RED[c], RESIZE_TOL, "red.png resized");
    free(img);
    ampc_dataset_free(ds);
}

static void test_resize(void **state) {
    (void)state;
    check_resize(6, 8, true);    /* enlarging: plain bilinear, half-pixel centres, edge clamp */
    check_resize(7, 5, true);    /* non-integer factors */
    check_resize(1, 2, false);   /* shrinking: the antialiasing triangle */
    check_resize(2, 3, false);
}

static void test_index_csv(void **state) {
    (void)state;
    char csv[1024];
    snprintf(csv, sizeof csv, "%s/index.csv", g_aux);
    unlink(csv);
    ampc_dataset *a = open_tree(3, 4, 3, csv);   /* scans and writes the index */
    check_layout(a);
    assert_int_equal(ampc_dataset_folder_skipped(a), 2);
    size_t n;
    char *text = (char *)read_bytes(csv, &n);
    const char *want =
        "image_path,target\n"
        "B_upper/Solid.JPG,0\nB_upper/grad.png,0\nB_upper/red.png,0\nB_upper/sub/inner.png,0\n"
        "a_gray/g.jpeg,1\na_gray/g8.png,1\na_gray/rgba.png,1\n"
        "\"b,comma/p16.png\",2\n\"b,comma/x,\"\"q\"\".png\",2\n";
    if (strcmp(text, want)) fail_msg("index written:\n%s\nexpected:\n%s", text, want);
    free(text);

    ampc_dataset *b = open_tree(3, 4, 3, csv);   /* reads it: same dataset, nothing scanned */
    check_layout(b);
    assert_int_equal(ampc_dataset_folder_skipped(b), 0);
    for (int i = 0; i < 9; i++) {
        float *x = sample(a, i), *y = sample(b, i);
        assert_memory_equal(x, y, 36 * sizeof *x);
        free(x);
        free(y);
    }
    ampc_dataset_free(a);
    ampc_dataset_free(b);

    /* A hand-written index: CRLF, a BOM, blank lines, quoted fields, a class without rows, an
       absolute path; labels and names come from it, not from the folders. */
    char csv2[1024];
    snprintf(csv2, sizeof csv2, "%s/hand.csv", g_aux);
    FILE *f = fopen(csv2, "wb");
    fprintf(f, "\xEF\xBB\xBFimage_path,target\r\n\"b,comma/x,\"\"q\"\".png\",0\r\n\r\n%s/B_upper/red.png,3\r\n"
               "\"a_gray/g8.png\",0",
            g_root);
    fclose(f);
    ampc_folder_options o = {.height = 3, .width = 4, .channels = 3, .index_csv = csv2};
    ampc_dataset *d = ampc_dataset_folder_open(g_root, &o);
    ASSERT_NOT_NULL_MSG(d);
    assert_int_equal(ampc_dataset_size(d), 3);
    assert_int_equal(ampc_dataset_num_classes(d), 4);
    assert_string_equal(ampc_dataset_class_name(d, 0), "b,comma");
    assert_null(ampc_dataset_class_name(d, 1));   /* no rows */
    assert_null(ampc_dataset_class_name(d, 3));   /* absolute path: no class folder */
    assert_string_equal(ampc_dataset_folder_path(d, 0), pathf("%s/b,comma/x,\"q\".png", g_root));
    assert_string_equal(ampc_dataset_folder_path(d, 1), pathf("%s/B_upper/red.png", g_root));
    float img[36];
    int64_t label;
    ASSERT_OK(ampc_dataset_get(d, 0, img, &label));
    assert_int_equal(label, 0);
    expect_exact_rgb(img, COMMA, "hand index row 2");
    ASSERT_OK(ampc_dataset_get(d, 1, img, &label));
    assert_int_equal(label, 3);
    expect_exact_rgb(img, RED, "hand index row 4");
    ampc_dataset_free(d);
}

static void expect_csv_error_n(const char *content, size_t n, const char *substr) {
    const char *csv = pathf("%s/bad.csv", g_aux);
    write_bytes(csv, content, n);
    ampc_folder_options o = {.height = 3, .width = 4, .index_csv = csv};
    ampc_clear_error();
    ampc_dataset *ds = ampc_dataset_folder_open(g_root, &o);
    if (ds) fail_msg("index %s opened, expected an error with '%s'", content, substr);
    expect_error(AMPC_ERR_FORMAT, substr);
    expect_error(AMPC_ERR_FORMAT, "bad.csv");
}

static void expect_csv_error(const char *content, const char *substr) {
    expect_csv_error_n(content, strlen(content), substr);
}

static void test_index_errors(void **state) {
    (void)state;
    expect_csv_error("", "empty file");
    expect_csv_error("path,label\nB_upper/red.png,0\n", "bad.csv:1: the header must be image_path,target");
    expect_csv_error("image_path,target\n", "no rows");
    expect_csv_error("image_path,target\nB_upper/red.png,0\nB_upper/grad.png,0,extra\n", "bad.csv:3: expected 2 fields");
    expect_csv_error("image_path,target\nB_upper/red.png\n", "bad.csv:2: expected 2 fields");
    expect_csv_error("image_path,target\nB_upper/red.png,abc\n", "bad.csv:2: target 'abc' is not an integer");
    expect_csv_error("image_path,target\nB_upper/red.png,-1\n", "bad.csv:2: target '-1'");
    expect_csv_error("image_path,target\nB_upper/red.png,1x\n", "bad.csv:2: target '1x'");
    expect_csv_error("image_path,target\n,0\n", "bad.csv:2: empty image_path");
    expect_csv_error("image_path,target\nB_upper/red.png,0\n\"a,b.png,1\n", "bad.csv:3: unterminated quoted field");
    expect_csv_error("image_path,target\nB_up\"per/red.png,0\n", "bad.csv:2: quote inside an unquoted field");
    expect_csv_error("image_path,target\n\"B_upper/red.png\"x,0\n", "bad.csv:2: text after a closing quote");
    /* targets: digits only, at most 65535 (no sign, space, decimal point, overflow) */
    expect_csv_error("image_path,target\nB_upper/red.png,0\nB_upper/grad.png,999999\n",
                     "bad.csv:3: target '999999' is not an integer in [0, 65535]");
    expect_csv_error("image_path,target\nB_upper/red.png,65536\n", "bad.csv:2: target '65536' is not an integer");
    expect_csv_error("image_path,target\nB_upper/red.png,99999999999999999999999\n", "bad.csv:2: target '9999");
    expect_csv_error("image_path,target\nB_upper/red.png,+1\n", "bad.csv:2: target '+1' is not an integer");
    expect_csv_error("image_path,target\nB_upper/red.png, 1\n", "bad.csv:2: target ' 1' is not an integer");
    expect_csv_error("image_path,target\nB_upper/red.png,1.0\n", "bad.csv:2: target '1.0' is not an integer");
    expect_csv_error("image_path,target\nB_upper/red.png,\n", "bad.csv:2: target '' is not an integer");
    /* sparse targets: ids, not class indices (the largest >= 2 * distinct + 16) */
    expect_csv_error("image_path,target\nB_upper/red.png,0\nB_upper/grad.png,22\nB_upper/red.png,1\n",
                     "bad.csv:3: target 22 would make 23 classes for 3 distinct targets: targets must be class "
                     "indices 0..K-1");
    expect_csv_error("image_path,target\nB_upper/red.png,18\n", "bad.csv:2: target 18 would make 19 classes for 1 distinct");
    expect_csv_error_n("image_path,target\nB_upper/red.png,0\nB_up\0per/grad.png,0\n", 56, "bad.csv:3: a NUL byte");
    /* the largest target allowed for one distinct target: 17 (18 classes) */
    const char *sparse = pathf("%s/sparse.csv", g_aux);
    write_bytes(sparse, "image_path,target\nB_upper/red.png,17\n", 37);
    ampc_folder_options so = {.height = 3, .width = 4, .index_csv = sparse};
    ampc_dataset *ds = ampc_dataset_folder_open(g_root, &so);
    ASSERT_NOT_NULL_MSG(ds);
    assert_int_equal(ampc_dataset_num_classes(ds), 18);
    ampc_dataset_free(ds);
    /* rows stay inside the root: no '..' component, absolute paths only under it (as given or real) */
    expect_csv_error("image_path,target\nB_upper/red.png,0\n../outside.png,0\n", "bad.csv:3: image_path '../outside.png' leaves the dataset root");
    expect_csv_error("image_path,target\nB_upper/../../x.png,0\n", "bad.csv:2: image_path 'B_upper/../../x.png' leaves");
    expect_csv_error("image_path,target\nB_upper/..,0\n", "bad.csv:2: image_path 'B_upper/..' leaves");
    expect_csv_error("image_path,target\n/etc/shadow,0\n", "bad.csv:2: image_path '/etc/shadow' leaves the dataset root");
    expect_csv_error(pathf("image_path,target\n%s/../x.png,0\n", g_root), "leaves the dataset root");
    expect_csv_error(pathf("image_path,target\n%sx/a.png,0\n", g_root), "leaves the dataset root");   /* a sibling "<root>x" */
    const char *dots = pathf("%s/dots.csv", g_aux);   /* names that merely start with dots are names */
    const char *dots_text = "image_path,target\nB_upper/red.png,0\n..a/x.png,0\nB_upper/...png,0\n";
    write_bytes(dots, dots_text, strlen(dots_text));
    ampc_folder_options dop = {.height = 3, .width = 4, .index_csv = dots};
    ds = ampc_dataset_folder_open(g_root, &dop);
    ASSERT_NOT_NULL_MSG(ds);
    ampc_dataset_free(ds);
    /* a quoted field spanning lines: later rows keep their true line numbers */
    expect_csv_error("image_path,target\n\"B_upper\nred.png\",0\nB_upper/red.png,q\n", "bad.csv:4: target 'q'");

    /* an index that cannot be read (a folder), and one whose rows are not under root */
    ampc_folder_options o = {.height = 3, .width = 4, .index_csv = g_aux};
    assert_null(ampc_dataset_folder_open(g_root, &o));
    expect_error(AMPC_ERR_IO, "not a regular file");
    const char *csv = pathf("%s/elsewhere.csv", g_aux);
    write_bytes(csv, "image_path,target\nno/such.png,0\n", 32);
    o.index_csv = csv;
    assert_null(ampc_dataset_folder_open(g_root, &o));
    expect_error(AMPC_ERR_IO, "no/such.png");
    /* an index in a folder that does not exist cannot be written: an error, no dataset */
    o.index_csv = pathf("%s/missing_dir/index.csv", g_aux);
    assert_null(ampc_dataset_folder_open(g_root, &o));
    expect_error(AMPC_ERR_IO, "missing_dir/index.csv");
}

static void test_open_errors(void **state) {
    (void)state;
    ampc_folder_options o = {.height = 8, .width = 8, .channels = 3};
    char *missing = pathf("%s/no_such_root", g_aux);
    assert_null(ampc_dataset_folder_open(missing, &o));
    expect_error(AMPC_ERR_IO, "no_such_root");
    assert_null(ampc_dataset_folder_open(pathf("%s/at_root.png", g_root), &o));
    expect_error(AMPC_ERR_IO, "not a directory");

    char *empty = make_tmpdir();
    mkdir(pathf("%s/.hidden_class", empty), 0755);
    write_bytes(pathf("%s/file.png", empty), "x", 1);
    assert_null(ampc_dataset_folder_open(empty, &o));
    expect_error(AMPC_ERR_FORMAT, "no class folders");
    mkdir(pathf("%s/only_text", empty), 0755);
    write_bytes(pathf("%s/only_text/a.txt", empty), "x", 1);
    assert_null(ampc_dataset_folder_open(empty, &o));
    expect_error(AMPC_ERR_FORMAT, "'only_text' has no readable");
    rm_rf(empty);
    free(empty);

    ampc_folder_options bad = o;
    bad.height = 0;
    assert_null(ampc_dataset_folder_open(g_root, &bad));
    expect_error(AMPC_ERR_INVALID, "height and width");
    bad = o;
    bad.channels = 2;
    assert_null(ampc_dataset_folder_open(g_root, &bad));
    expect_error(AMPC_ERR_INVALID, "channels must be 1 or 3");
    assert_null(ampc_dataset_folder_open(g_root, NULL));
    expect_error(AMPC_ERR_INVALID, "NULL");

    /* accessors refuse datasets of another kind */
    ampc_dataset *ds = open_tree(3, 4, 3, NULL);
    ampc_dataset *sub = ampc_dataset_subset(ds, (const int64_t[]){8, 2}, 2);
    ASSERT_NOT_NULL_MSG(sub);
    assert_int_equal(ampc_dataset_folder_skipped(sub), AMPC_ERR_INVALID);
    assert_null(ampc_dataset_folder_path(ds, 9));
    expect_error(AMPC_ERR_INVALID, "out of range");
    assert_string_equal(ampc_dataset_class_name(sub, 2), "b,comma");
    ampc_dataset_free(ds);   /* the subset keeps it alive */
    float img[36];
    int64_t label;
    ASSERT_OK(ampc_dataset_get(sub, 0, img, &label));
    assert_int_equal(label, 2);
    expect_exact_rgb(img, COMMA, "subset sample 0");
    ampc_dataset_free(sub);
}

/* Files that pass the header check but are cut in their pixel data fail in get(), naming the
   file; an image over the size limit is skipped at scan time. */
static void test_late_failures(void **state) {
    (void)state;
    char *root = make_tmpdir();
    mkdir(pathf("%s/c", root), 0755);
    uint64_t seed = 7;
    enum { W = 64, H = 48 };
    uint8_t *noise = malloc(W * H * 3), *big = calloc(20000, 1);
    for (int i = 0; i < W * H * 3; i++) noise[i] = (uint8_t)(tu_uniform(&seed, 0, 256));
    write_png(pathf("%s/c/a_ok.png", root), W, H, 3, noise);
    write_png(pathf("%s/c/b_cut.png", root), W, H, 3, noise);
    write_jpeg(pathf("%s/c/c_cut.jpg", root), W, H, TJPF_RGB, noise, 90);
    write_png(pathf("%s/c/d_huge.png", root), 20000, 1, 1, big);
    size_t n;
    uint8_t *b = read_bytes(pathf("%s/c/b_cut.png", root), &n);
    write_bytes(pathf("%s/c/b_cut.png", root), b, n / 2);
    free(b);
    b = read_bytes(pathf("%s/c/c_cut.jpg", root), &n);
    write_bytes(pathf("%s/c/c_cut.jpg", root), b, n / 2);
    free(b);

    ampc_folder_options o = {.height = H, .width = W, .channels = 3};
    ampc_dataset *ds = ampc_dataset_folder_open(root, &o);
    ASSERT_NOT_NULL_MSG(ds);
    assert_int_equal(ampc_dataset_size(ds), 3);
    assert_int_equal(ampc_dataset_folder_skipped(ds), 1);   /* d_huge.png */
    float *img = malloc(W * H * 3 * sizeof *img);
    int64_t label;
    ASSERT_OK(ampc_dataset_get(ds, 0, img, &label));
    for (int c = 0; c < 3; c++)
        for (int k = 0; k < W * H; k++) assert_true(img[c * W * H + k] == (float)noise[3 * k + c] / 255.0f);
    assert_int_equal(ampc_dataset_get(ds, 1, img, &label), AMPC_ERR_FORMAT);
    expect_error(AMPC_ERR_FORMAT, "b_cut.png");
    assert_int_equal(ampc_dataset_get(ds, 2, img, &label), AMPC_ERR_FORMAT);
    expect_error(AMPC_ERR_FORMAT, "c_cut.jpg");
    ampc_dataset_free(ds);
    free(img);
    free(noise);
    free(big);
    rm_rf(root);
    free(root);
}

/* Every reader refuses a FIFO at once (opening one for reading would block until a writer came):
   the image decoder and probe, the index CSV, a FIFO named like an image in a class folder
   (skipped without being opened, as are links to it) and one listed by an index. alarm() turns
   a regression into a failure instead of a hang. */
static void test_fifo_inputs(void **state) {
    (void)state;
    alarm(10);
    char *root = make_tmpdir();
    mkdir(pathf("%s/c", root), 0755);
    write_solid_png(pathf("%s/c/a.png", root), 4, 3, 3, RED);
    char *fifo = strdup(pathf("%s/c/b_fifo.png", root));   /* pathf's buffers rotate */
    assert_int_equal(mkfifo(fifo, 0600), 0);
    assert_int_equal(symlink("b_fifo.png", pathf("%s/c/c_to_fifo.png", root)), 0);
    assert_int_equal(symlink(pathf("%s/c/a.png", root), pathf("%s/c/d_to_a.png", root)), 0);

    ampc_image im;
    assert_int_equal(ampc__image_decode_file(fifo, 3, &im), AMPC_ERR_IO);
    expect_error(AMPC_ERR_IO, pathf("'%s' is a FIFO (named pipe), not a regular file", fifo));
    assert_null(im.pixels);
    assert_int_equal(ampc__image_probe_file(fifo, NULL, NULL), AMPC_ERR_IO);
    expect_error(AMPC_ERR_IO, "FIFO");

    ampc_folder_options o = {.height = 3, .width = 4, .channels = 3};
    ampc_dataset *ds = ampc_dataset_folder_open(root, &o);
    ASSERT_NOT_NULL_MSG(ds);
    assert_int_equal(ampc_dataset_size(ds), 2);   /* a.png and the link to it */
    assert_int_equal(ampc_dataset_folder_skipped(ds), 2);   /* the FIFO and the link to it */
    assert_string_equal(ampc_dataset_folder_path(ds, 1), pathf("%s/c/d_to_a.png", root));
    float img[36];
    int64_t label;
    ASSERT_OK(ampc_dataset_get(ds, 1, img, &label));
    expect_exact_rgb(img, RED, "link to a.png");
    ampc_dataset_free(ds);

    const char *csv_fifo = pathf("%s/index_fifo.csv", root);
    assert_int_equal(mkfifo(csv_fifo, 0600), 0);
    o.index_csv = csv_fifo;
    assert_null(ampc_dataset_folder_open(root, &o));
    expect_error(AMPC_ERR_IO, pathf("image folder index: '%s' is a FIFO", csv_fifo));

    const char *csv = pathf("%s/index.csv", root);
    const char *rows = "image_path,target\nc/b_fifo.png,0\nc/a.png,0\n";
    write_bytes(csv, rows, strlen(rows));
    o.index_csv = csv;
    ds = ampc_dataset_folder_open(root, &o);   /* an index is not probed: get() refuses it */
    ASSERT_NOT_NULL_MSG(ds);
    assert_int_equal(ampc_dataset_get(ds, 0, img, &label), AMPC_ERR_IO);
    expect_error(AMPC_ERR_IO, pathf("'%s' is a FIFO", fifo));
    ASSERT_OK(ampc_dataset_get(ds, 1, img, &label));
    ampc_dataset_free(ds);
    alarm(0);
    free(fifo);
    rm_rf(root);
    free(root);
}

/* Links to folders: each folder is taken once (loops end, nothing is duplicated, nothing is
   counted in two classes), a link into a hidden folder is followed, the order stays sorted; a
   link that leaves the root is an error naming it. */
static void test_folder_links(void **state) {
    (void)state;
    alarm(10);
    char *root = make_tmpdir();
    const char *r = root;
    mkdir(pathf("%s/cat", r), 0755);
    mkdir(pathf("%s/cat/sub", r), 0755);
    mkdir(pathf("%s/dog", r), 0755);
    mkdir(pathf("%s/.store", r), 0755);
    write_solid_png(pathf("%s/cat/a.png", r), 4, 3, 3, RED);
    write_solid_png(pathf("%s/cat/b.png", r), 4, 3, 3, RED);
    write_solid_png(pathf("%s/cat/sub/c.png", r), 4, 3, 3, RED);
    write_solid_png(pathf("%s/dog/d.png", r), 4, 3, 3, COMMA);
    write_solid_png(pathf("%s/.store/e.png", r), 4, 3, 3, INNER);
    const char *links[][2] = {{".", "cat/l1"}, {".", "cat/l2"}, {"..", "cat/up"}, {"../..", "cat/sub/back"},
                              {"../cat/sub", "dog/tocat"}, {"../.store", "dog/stored"}, {"../.store", "dog/stored2"},
                              {"..", "dog/zz"}};
    for (size_t i = 0; i < sizeof links / sizeof links[0]; i++)
        assert_int_equal(symlink(links[i][0], pathf("%s/%s", r, links[i][1])), 0);
    ampc_folder_options o = {.height = 3, .width = 4, .channels = 3};
    ampc_dataset *ds = ampc_dataset_folder_open(root, &o);
    ASSERT_NOT_NULL_MSG(ds);
    static const char *const want[] = {"cat/a.png", "cat/b.png", "cat/sub/c.png", "dog/d.png", "dog/stored/e.png"};
    static const int64_t labels[] = {0, 0, 0, 1, 1};
    assert_int_equal(ampc_dataset_size(ds), 5);
    assert_int_equal(ampc_dataset_num_classes(ds), 2);
    for (int i = 0; i < 5; i++) {
        assert_string_equal(ampc_dataset_folder_path(ds, i), pathf("%s/%s", r, want[i]));
        float img[36];
        int64_t label;
        ASSERT_OK(ampc_dataset_get(ds, i, img, &label));
        assert_int_equal(label, labels[i]);
    }
    ampc_dataset_free(ds);

    /* four self-links (16^4 paths before): still the real images, at once */
    for (int i = 3; i <= 4; i++) assert_int_equal(symlink(".", pathf("%s/cat/sub/l%d", r, i)), 0);
    ds = ampc_dataset_folder_open(root, &o);
    ASSERT_NOT_NULL_MSG(ds);
    assert_int_equal(ampc_dataset_size(ds), 5);
    ampc_dataset_free(ds);

    /* a class folder that is a link to another class */
    assert_int_equal(symlink("cat", pathf("%s/cat2", r)), 0);
    assert_null(ampc_dataset_folder_open(root, &o));
    expect_error(AMPC_ERR_FORMAT, "class folder 'cat2' is a link to a folder already scanned");
    unlink(pathf("%s/cat2", r));

    /* links out of the root: to a sibling folder, and a class folder that is a link out */
    char *outside = make_tmpdir();
    write_solid_png(pathf("%s/o.png", outside), 4, 3, 3, RED);
    char *out_real = realpath(outside, NULL);
    assert_int_equal(symlink(outside, pathf("%s/dog/out", r)), 0);
    assert_null(ampc_dataset_folder_open(root, &o));
    expect_error(AMPC_ERR_FORMAT, pathf("link '%s/dog/out' points to '%s', which leaves the dataset root", r, out_real));
    unlink(pathf("%s/dog/out", r));
    assert_int_equal(symlink("../../..", pathf("%s/cat/sub/far", r)), 0);
    assert_null(ampc_dataset_folder_open(root, &o));
    expect_error(AMPC_ERR_FORMAT, pathf("link '%s/cat/sub/far' points to '/", r));
    expect_error(AMPC_ERR_FORMAT, "leaves the dataset root");
    unlink(pathf("%s/cat/sub/far", r));
    assert_int_equal(symlink(outside, pathf("%s/zebra", r)), 0);
    assert_null(ampc_dataset_folder_open(root, &o));
    expect_error(AMPC_ERR_FORMAT, pathf("link '%s/zebra' points to '%s'", r, out_real));
    alarm(0);
    free(out_real);
    rm_rf(outside);
    free(outside);
    rm_rf(root);
    free(root);
}

/* The decoder on its own: formats PIL handles that the folder tree does not cover. */
static void test_decode_formats(void **state) {
    (void)state;
    ampc_image im;
    /* not images */
    assert_int_equal(ampc__image_decode_mem("", 0, "empty.png", 3, &im), AMPC_ERR_FORMAT);
    expect_error(AMPC_ERR_FORMAT, "empty.png: not a JPEG or PNG file (empty)");
    assert_int_equal(ampc__image_decode_mem("GIF89a", 6, "a.gif", 3, &im), AMPC_ERR_FORMAT);
    expect_error(AMPC_ERR_FORMAT, "a.gif: not a JPEG or PNG file (no JPEG or PNG signature)");
    /* never the file's bytes (an index row once pointed at /etc/shadow: "root:" was printed) */
    assert_int_equal(ampc__image_decode_mem("root:$6$x:19000:0:99999:7:::", 28, "shadow", 3, &im), AMPC_ERR_FORMAT);
    expect_error(AMPC_ERR_FORMAT, "shadow: not a JPEG or PNG file");
    assert_null(strstr(ampc_last_error(), "root"));
    assert_null(strstr(ampc_last_error(), "72 6f"));
    assert_int_equal(ampc__image_decode_mem("\xFF\xD8\xFF\xE0", 4, "short.jpg", 3, &im), AMPC_ERR_FORMAT);
    expect_error(AMPC_ERR_FORMAT, "short.jpg: JPEG");
    assert_int_equal(ampc__image_decode_mem("\x89PNG\r\n\x1a\n", 8, "short.png", 3, &im), AMPC_ERR_FORMAT);
    expect_error(AMPC_ERR_FORMAT, "short.png: PNG");
    assert_int_equal(ampc__image_decode_mem("\x89PNGxxxxxxxxxxxxxxxx", 20, "sig.png", 3, &im), AMPC_ERR_FORMAT);
    expect_error(AMPC_ERR_FORMAT, "sig.png: PNG");
    assert_int_equal(ampc__image_decode_file(pathf("%s/none.png", g_aux), 3, &im), AMPC_ERR_IO);
    expect_error(AMPC_ERR_IO, "none.png");

    /* palette, interlaced (Adam7), gray+alpha: exact */
    const png_color pal[3] = {{255, 0, 0}, {0, 200, 0}, {1, 2, 3}};
    uint8_t idx[5 * 4];
    for (int i = 0; i < 20; i++) idx[i] = (uint8_t)(i % 3);
    const char *p = pathf("%s/pal.png", g_aux);
    write_png_ex(p, 5, 4, PNG_COLOR_TYPE_PALETTE, 8, idx, true, pal, 3);
    ASSERT_OK(ampc__image_decode_file(p, 3, &im));
    assert_true(im.width == 5 && im.height == 4 && im.channels == 3);
    for (int i = 0; i < 20; i++)
        assert_true(im.pixels[3 * i] == pal[i % 3].red && im.pixels[3 * i + 1] == pal[i % 3].green &&
                    im.pixels[3 * i + 2] == pal[i % 3].blue);
    ampc__image_free(&im);
    uint8_t ga[6 * 2];
    for (int i = 0; i < 6; i++) ga[2 * i] = (uint8_t)(40 * i), ga[2 * i + 1] = (uint8_t)(255 - i);
    p = pathf("%s/ga.png", g_aux);
    write_png_ex(p, 3, 2, PNG_COLOR_TYPE_GRAY_ALPHA, 8, ga, true, NULL, 0);
    ASSERT_OK(ampc__image_decode_file(p, 1, &im));
    assert_true(im.width == 3 && im.height == 2 && im.channels == 1);
    for (int i = 0; i < 6; i++) assert_int_equal(im.pixels[i], 40 * i);
    ampc__image_free(&im);

    /* CMYK JPEG (Adobe's inverted values, as libjpeg returns them): R = C*K/255 */
    const uint8_t cmyk[4] = {200, 100, 250, 180};
    p = pathf("%s/cmyk.jpg", g_aux);
    write_solid_jpeg(p, 8, 8, TJPF_CMYK, cmyk);
    ASSERT_OK(ampc__image_decode_file(p, 3, &im));
    assert_int_equal(im.channels, 3);
    /* each of C and K off by <= 3 levels: the product moves by <= (3*C + 3*K + 9)/255 + 0.5 */
    for (int i = 0; i < 64; i++)
        for (int c = 0; c < 3; c++) {
            double ref = cmyk[c] * cmyk[3] / 255.0, tol = (3.0 * cmyk[c] + 3.0 * cmyk[3] + 9) / 255 + 0.5;   /* 5 levels */
            if (fabs(im.pixels[3 * i + c] - ref) > tol) fail_msg("CMYK pixel %d channel %d: %d, expected %.1f", i, c, im.pixels[3 * i + c], ref);
        }
    ampc__image_free(&im);

    /* header probe: size without decoding; the size limit */
    int w = 0, h = 0;
    ASSERT_OK(ampc__image_probe_file(pathf("%s/B_upper/Solid.JPG", g_root), &w, &h));
    assert_true(w == 16 && h == 16);
    ASSERT_OK(ampc__image_probe_file(pathf("%s/B_upper/grad.png", g_root), &w, &h));
    assert_true(w == 4 && h == 3);
    uint8_t *wide = calloc(AMPC_IMAGE_MAX_DIM + 1, 1);
    p = pathf("%s/wide.png", g_aux);
    write_png(p, AMPC_IMAGE_MAX_DIM + 1, 1, 1, wide);
    free(wide);
    assert_int_equal(ampc__image_probe_file(p, &w, &h), AMPC_ERR_FORMAT);
    expect_error(AMPC_ERR_FORMAT, "wide.png: PNG");
    assert_int_equal(ampc__image_decode_file(p, 1, &im), AMPC_ERR_FORMAT);
    assert_null(im.pixels);
}

/* Every truncation and some byte flips of a valid PNG and JPEG: each decode either succeeds
   with the right size or fails naming the file; none crashes (run under ASan/UBSan). JPEG flips
   stay in the entropy-coded data: a flipped frame header may legally ask for 16384x16384. */
static void check_mangled(const uint8_t *buf, size_t n, const char *name, int w, int h) {
    ampc_image im;
    ampc_clear_error();
    int rc = ampc__image_decode_mem(buf, n, name, 3, &im);
    if (rc == 0) {
        if (im.width != w || im.height != h || im.channels != 3 || !im.pixels)
            fail_msg("%s (%zu bytes): decoded as %dx%dx%d", name, n, im.width, im.height, im.channels);
        ampc__image_free(&im);
    } else if (!strstr(ampc_last_error(), name) || im.pixels) {
        fail_msg("%s (%zu bytes): rc %d, message '%s'", name, n, rc, ampc_last_error());
    }
}

static void test_decode_corrupt(void **state) {
    (void)state;
    uint64_t seed = 11;
    enum { W = 24, H = 16 };
    uint8_t px[W * H * 3];
    for (size_t i = 0; i < sizeof px; i++) px[i] = (uint8_t)tu_uniform(&seed, 0, 256);
    const char *pp = pathf("%s/m.png", g_aux), *jp = pathf("%s/m.jpg", g_aux);
    write_png(pp, W, H, 3, px);
    write_jpeg(jp, W, H, TJPF_RGB, px, 80);
    size_t np, nj;
    uint8_t *png = read_bytes(pp, &np), *jpg = read_bytes(jp, &nj);
    for (size_t k = 0; k < np; k++) check_mangled(png, k, "mangled.png", W, H);
    for (size_t k = 0; k < nj; k++) check_mangled(jpg, k, "mangled.jpg", W, H);
    size_t sos = 0;
    for (size_t i = 0; i + 1 < nj; i++)
        if (jpg[i] == 0xFF && jpg[i + 1] == 0xDA) sos = i;
    assert_true(sos > 0);
    uint8_t *m = malloc(np > nj ? np : nj);
    for (int t = 0; t < 300; t++) {
        memcpy(m, png, np);
        size_t at = (size_t)tu_uniform(&seed, 8, (double)np);
        m[at] ^= (uint8_t)(1 + tu_uniform(&seed, 0, 255));
        check_mangled(m, np, "flipped.png", W, H);
        memcpy(m, jpg, nj);
        at = (size_t)tu_uniform(&seed, (double)sos + 2, (double)nj);
        m[at] ^= (uint8_t)(1 + tu_uniform(&seed, 0, 255));
        check_mangled(m, nj, "flipped.jpg", W, H);
    }
    free(m);
    free(png);
    free(jpg);
}

/* exclude_classes: Caltech-256's layout ("001.ak47", ..., "257.clutter"). Matched classes are
   left out before the walk (an excluded folder without images is no error), the rest labelled
   0..K-1; numbered names match by the part after the dot; fnmatch patterns; an index written
   with or without the exclusion gives the same dataset; bad patterns name the problem. */
static void test_exclude_classes(void **state) {
    (void)state;
    char *root = make_tmpdir(), csv[1200], full[1200];
    const char *cls[4] = {"001.ak47", "002.bat", "257.clutter", "xx-101"};
    const uint8_t v[4][3] = {{10, 20, 30}, {40, 50, 60}, {70, 80, 90}, {100, 110, 120}};
    for (int c = 0; c < 4; c++) {
        mkdir(pathf("%s/%s", root, cls[c]), 0755);
        for (int k = 0; k < 2; k++) write_solid_png(pathf("%s/%s/%d.png", root, cls[c], k), 4, 3, 3, v[c]);
    }
    mkdir(pathf("%s/empty", root), 0755);   /* no images: an error unless left out */
    ampc_folder_options o = {.height = 3, .width = 4, .channels = 3};
    assert_null(ampc_dataset_folder_open(root, &o));
    expect_error(AMPC_ERR_FORMAT, "'empty' has no readable");

    o.exclude_classes = "clutter,empty";
    ampc_dataset *ds = ampc_dataset_folder_open(root, &o);
    ASSERT_NOT_NULL_MSG(ds);
    assert_int_equal(ampc_dataset_num_classes(ds), 3);
    assert_int_equal(ampc_dataset_size(ds), 6);
    assert_int_equal(ampc_dataset_folder_excluded(ds), 2);
    const int keep[3] = {0, 1, 3};
    for (int c = 0; c < 3; c++) assert_string_equal(ampc_dataset_class_name(ds, c), cls[keep[c]]);
    for (int i = 0; i < 6; i++) {
        float img[36];
        int64_t label;
        ASSERT_OK(ampc_dataset_get(ds, i, img, &label));
        assert_int_equal(label, i / 2);
        expect_exact_rgb(img, v[keep[i / 2]], "excluded tree");
        assert_null(strstr(ampc_dataset_folder_path(ds, i), "clutter"));
    }
    ampc_dataset_free(ds);

    /* patterns: fnmatch on the whole name or the numbered name's rest */
    o.exclude_classes = "*-101,2??.*,empty";
    ASSERT_NOT_NULL_MSG(ds = ampc_dataset_folder_open(root, &o));
    assert_int_equal(ampc_dataset_num_classes(ds), 2);
    assert_string_equal(ampc_dataset_class_name(ds, 1), "002.bat");
    ampc_dataset_free(ds);

    /* index: written after an excluding scan, read back with the same flag, the same dataset;
       a full index read with the exclusion drops the rows and renumbers the targets */
    snprintf(csv, sizeof csv, "%s/excl.csv", g_aux);
    snprintf(full, sizeof full, "%s/full.csv", g_aux);
    unlink(csv);
    unlink(full);
    o.exclude_classes = "clutter,empty";
    o.index_csv = csv;
    ampc_dataset *a = ampc_dataset_folder_open(root, &o), *b = ampc_dataset_folder_open(root, &o);
    ASSERT_NOT_NULL_MSG(a);
    ASSERT_NOT_NULL_MSG(b);
    rm_rf(pathf("%s/empty", root));
    o.exclude_classes = NULL;
    o.index_csv = full;
    ampc_dataset *f = ampc_dataset_folder_open(root, &o);   /* all 4 classes, written to full.csv */
    ASSERT_NOT_NULL_MSG(f);
    assert_int_equal(ampc_dataset_num_classes(f), 4);
    ampc_dataset_free(f);
    o.exclude_classes = "clutter";
    ASSERT_NOT_NULL_MSG(f = ampc_dataset_folder_open(root, &o));
    assert_int_equal(ampc_dataset_folder_excluded(f), 1);
    ampc_dataset *ds2[2] = {b, f};
    for (int k = 0; k < 2; k++) {
        assert_int_equal(ampc_dataset_num_classes(ds2[k]), 3);
        assert_int_equal(ampc_dataset_size(ds2[k]), 6);
        for (int i = 0; i < 6; i++) {
            assert_string_equal(ampc_dataset_folder_path(ds2[k], i), ampc_dataset_folder_path(a, i));
            float x[36], y[36];
            int64_t lx, ly;
            ASSERT_OK(ampc_dataset_get(a, i, x, &lx));
            ASSERT_OK(ampc_dataset_get(ds2[k], i, y, &ly));
            assert_int_equal(lx, ly);
            assert_memory_equal(x, y, sizeof x);
        }
    }
    ampc_dataset_free(a);
    ampc_dataset_free(b);
    ampc_dataset_free(f);

    /* errors */
    o.index_csv = NULL;
    o.exclude_classes = "cluter";
    assert_null(ampc_dataset_folder_open(root, &o));
    expect_error(AMPC_ERR_INVALID, "exclude pattern 'cluter' matches no class");
    o.exclude_classes = "*";
    assert_null(ampc_dataset_folder_open(root, &o));
    expect_error(AMPC_ERR_INVALID, "leaves no class");
    o.exclude_classes = "clutter,,bat";
    assert_null(ampc_dataset_folder_open(root, &o));
    expect_error(AMPC_ERR_INVALID, "empty pattern");
    rm_rf(root);
    free(root);
}

/* 16-bit PNGs decode as PIL decodes them (tests/fixtures/png16, made by make_png16.py with
   python3-pil): color samples keep their high byte, gray is clipped to 255 (PIL's mode "I"),
   for convert("RGB") and convert("L") alike, every value equal. */
static void test_png16_as_pil(void **state) {
    (void)state;
    char dir[560], path[700], line[1024];
    snprintf(dir, sizeof dir, "%s", tu_fixture("png16"));
    snprintf(path, sizeof path, "%s/pil.txt", dir);
    FILE *f = fopen(path, "r");
    if (!f) fail_msg("can't open %s", path);
    int cases = 0;
    while (fgets(line, sizeof line, f)) {
        char name[64], mode[8];
        int at = 0;
        if (sscanf(line, "%63s %7s %n", name, mode, &at) != 2) fail_msg("bad line '%s'", line);
        const int ch = strcmp(mode, "RGB") == 0 ? 3 : 1;
        snprintf(path, sizeof path, "%s/%s", dir, name);
        ampc_image img;
        ASSERT_OK(ampc__image_decode_file(path, ch, &img));
        assert_int_equal(img.width, 8);
        assert_int_equal(img.height, 1);
        assert_int_equal(img.channels, ch);
        const char *p = line + at;
        for (int i = 0; i < 8 * ch; i++) {
            char *end;
            long want = strtol(p, &end, 10);
            if (end == p) fail_msg("%s %s: %d values in pil.txt", name, mode, i);
            p = end;
            if (img.pixels[i] != want) fail_msg("%s %s: value %d is %d, PIL gives %ld", name, mode, i, img.pixels[i], want);
        }
        ampc__image_free(&img);
        cases++;
    }
    fclose(f);
    assert_int_equal(cases, 8);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_scan_order_labels_pixels),
        cmocka_unit_test(test_gray_conversion),
        cmocka_unit_test(test_resize),
        cmocka_unit_test(test_index_csv),
        cmocka_unit_test(test_index_errors),
        cmocka_unit_test(test_open_errors),
        cmocka_unit_test(test_late_failures),
        cmocka_unit_test(test_fifo_inputs),
        cmocka_unit_test(test_folder_links),
        cmocka_unit_test(test_decode_formats),
        cmocka_unit_test(test_decode_corrupt),
        cmocka_unit_test(test_png16_as_pil),
        cmocka_unit_test(test_exclude_classes),
    };
    return cmocka_run_group_tests(tests, setup_tree, teardown_tree);
}
