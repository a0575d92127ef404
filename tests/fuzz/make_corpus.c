/*
 * make_corpus.c - writes the fuzzers' seed corpora (tests/fuzz/corpus/<reader>/): for each
 * reader a few valid inputs and a few edge cases, each a few hundred bytes at most.
 * `make fuzz-corpus` rebuilds it and rewrites tests/fuzz/corpus (commit the result).
 *
 *     fuzz_make_corpus OUTDIR
 *
 * Input layouts are the harnesses' (see each tests/fuzz/fuzz_<reader>.c).
 */
#include "ampc.h"
#include "fuzz_checkpoint_model.h"

#include <png.h>
#include <turbojpeg.h>
#include <zlib.h>

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static const char *out_dir;
static int failures;

static void put(const char *reader, const char *name, const void *data, size_t n) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", out_dir, reader);
    mkdir(path, 0755);
    snprintf(path, sizeof path, "%s/%s/%s", out_dir, reader, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, n, f) != n || fclose(f) != 0) {
        fprintf(stderr, "make_corpus: %s: %s\n", path, strerror(errno));
        failures++;
    }
}

static void put_str(const char *reader, const char *name, const char *s) { put(reader, name, s, strlen(s)); }

/* Text seeds from a table of {name, text}. */
static void put_strs(const char *reader, const char *const (*seeds)[2], size_t n) {
    for (size_t i = 0; i < n; i++) put_str(reader, seeds[i][0], seeds[i][1]);
}

static size_t slurp(const char *path, uint8_t **out) {
    FILE *f = fopen(path, "rb");
    size_t n = 0;
    *out = NULL;
    if (f && fseek(f, 0, SEEK_END) == 0) {
        long k = ftell(f);
        rewind(f);
        if (k > 0 && (*out = malloc((size_t)k)) && fread(*out, 1, (size_t)k, f) == (size_t)k) n = (size_t)k;
    }
    if (f) fclose(f);
    return n;
}

// ---------------------------------------------------------------------------------------------
// IDX: flags, images length (2 bytes LE), images file, labels file

typedef struct {
    uint8_t b[4096];
    size_t n;
} buf;

static void be32(buf *b, uint32_t v) {
    for (int i = 3; i >= 0; i--) b->b[b->n++] = (uint8_t)(v >> (8 * i));
}

static buf idx_images(uint32_t magic, uint32_t n, uint32_t rows, uint32_t cols, size_t pixels) {
    buf b = {.n = 0};
    be32(&b, magic);
    be32(&b, n);
    be32(&b, rows);
    be32(&b, cols);
    for (size_t i = 0; i < pixels; i++) b.b[b.n++] = (uint8_t)(i * 37);
    return b;
}

static buf idx_labels(uint32_t magic, uint32_t n, size_t count, uint8_t first) {
    buf b = {.n = 0};
    be32(&b, magic);
    be32(&b, n);
    for (size_t i = 0; i < count; i++) b.b[b.n++] = (uint8_t)(i ? i % 10 : first);
    return b;
}

static buf gzip(const buf *in) {
    buf out = {.n = 0};
    z_stream z = {0};
    deflateInit2(&z, 9, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY);   /* gzip wrapper, mtime 0 */
    z.next_in = (Bytef *)in->b;
    z.avail_in = (uInt)in->n;
    z.next_out = out.b;
    z.avail_out = sizeof out.b;
    deflate(&z, Z_FINISH);
    out.n = z.total_out;
    deflateEnd(&z);
    return out;
}

static void put_idx(const char *name, uint8_t flags, const buf *img, const buf *lbl) {
    buf b = {.n = 0};
    b.b[b.n++] = flags;
    b.b[b.n++] = (uint8_t)img->n;
    b.b[b.n++] = (uint8_t)(img->n >> 8);
    memcpy(b.b + b.n, img->b, img->n);
    b.n += img->n;
    memcpy(b.b + b.n, lbl->b, lbl->n);
    b.n += lbl->n;
    put("idx", name, b.b, b.n);
}

static void make_idx(void) {
    const uint32_t I = 0x803, L = 0x801;
    buf img = idx_images(I, 3, 2, 2, 12), lbl = idx_labels(L, 3, 3, 0);
    buf gimg = gzip(&img), glbl = gzip(&lbl);
    put_idx("plain", 0, &img, &lbl);
    put_idx("gzip", 0, &gimg, &glbl);
    put_idx("mnist_plain", 1, &img, &lbl);
    put_idx("mnist_gz_names", 3, &gimg, &glbl);
    put_idx("fashion_test_split", 5, &img, &glbl);
    buf trunc = idx_images(I, 3, 2, 2, 7), bad_magic = idx_images(0x804, 3, 2, 2, 12);
    buf absurd = idx_images(I, 0xffffffffu, 0xffff, 0xffff, 4), zero = idx_images(I, 0, 2, 2, 0);
    buf extra = idx_images(I, 3, 2, 2, 13), lbl_short = idx_labels(L, 2, 2, 0), lbl_big = idx_labels(L, 3, 3, 200);
    put_idx("truncated_pixels", 0, &trunc, &lbl);
    put_idx("wrong_magic", 0, &bad_magic, &lbl);
    put_idx("absurd_count", 0, &absurd, &lbl);
    put_idx("zero_count", 0, &zero, &lbl);
    put_idx("trailing_byte", 0, &extra, &lbl);
    put_idx("count_mismatch", 0, &img, &lbl_short);
    put_idx("label_over_classes", 1, &img, &lbl_big);
    buf gtrunc = gzip(&img);
    gtrunc.n -= 6;   /* cut into the 8-byte trailer (CRC-32, length) */
    put_idx("gzip_trailer_cut", 0, &gtrunc, &glbl);
    gtrunc.n -= 8;   /* and into the deflate data */
    put_idx("gzip_data_cut", 0, &gtrunc, &glbl);
}

// ---------------------------------------------------------------------------------------------
// Image folder index (the harness's root has cat/a.png and dog/b.png)

static void make_folder_index(void) {
    static const char *const seeds[][2] = {
        {"valid", "image_path,target\ncat/a.png,0\ndog/b.png,1\n"},
        {"bom_crlf_quoted", "\xEF\xBB\xBFimage_path,target\r\n\"cat/a.png\",0\r\n\"dog/\"\"b\"\",\n.png\",1\r\n"},
        {"blank_lines_no_final_newline", "image_path,target\n\ncat/a.png,0\n\ndog/b.png,7"},
        {"bad_header", "path,label\ncat/a.png,0\n"},
        {"target_out_of_range", "image_path,target\ncat/a.png,1000000\n"},
        {"negative_target", "image_path,target\ncat/a.png,-1\n"},
        {"three_fields", "image_path,target\ncat/a.png,0,extra\n"},
        {"missing_first_image", "image_path,target\ncat/missing.png,0\ndog/b.png,1\n"},
        {"absolute_and_dotdot", "image_path,target\n/dev/null,0\n../root/cat/a.png,1\n"},
        {"unterminated_quote", "image_path,target\n\"cat/a.png,0\n"},
        {"header_only", "image_path,target\n"},
        {"empty_path", "image_path,target\n,0\n"},
    };
    put_strs("folder_index", seeds, sizeof seeds / sizeof *seeds);
}

// ---------------------------------------------------------------------------------------------
// Images

static uint8_t pixels[8 * 8 * 3];

static void fill_pixels(void) {
    for (size_t i = 0; i < sizeof pixels; i++) pixels[i] = (uint8_t)(i * 29 + (i / 24) * 7);
}

static void put_png(const char *name, int w, int h, png_uint_32 format) {
    png_image im = {.version = PNG_IMAGE_VERSION, .width = (png_uint_32)w, .height = (png_uint_32)h, .format = format};
    png_alloc_size_t n = 0;
    if (!png_image_write_to_memory(&im, NULL, &n, 0, pixels, 0, NULL)) goto fail;
    uint8_t *mem = malloc(n);
    if (!mem || !png_image_write_to_memory(&im, mem, &n, 0, pixels, 0, NULL)) {
        free(mem);
        goto fail;
    }
    put("image", name, mem, n);
    free(mem);
    return;
fail:
    fprintf(stderr, "make_corpus: png %s: %s\n", name, im.message);
    failures++;
}

/* JPEG of w x h; returns a malloc'd copy (caller frees) in *out. */
static size_t jpeg(int w, int h, int pf, int subsamp, int flags, uint8_t **out) {
    tjhandle tj = tjInitCompress();
    unsigned char *mem = NULL;
    unsigned long n = 0;
    int rc = tj ? tjCompress2(tj, pixels, w, 0, h, pf, &mem, &n, subsamp, 75, flags) : -1;
    *out = rc == 0 ? malloc(n) : NULL;
    if (*out) memcpy(*out, mem, n);
    else failures++, fprintf(stderr, "make_corpus: jpeg: %s\n", tj ? tjGetErrorStr2(tj) : "no handle");
    tjFree(mem);
    if (tj) tjDestroy(tj);
    return *out ? n : 0;
}

static void make_image(void) {
    fill_pixels();
    put_png("png_rgb_8x8", 8, 8, PNG_FORMAT_RGB);   /* also cut in IDAT below */
    put_png("png_gray_5x3", 5, 3, PNG_FORMAT_GRAY);
    put_png("png_rgba_4x4", 4, 4, PNG_FORMAT_RGBA);
    put_png("png_gray_alpha_3x3", 3, 3, PNG_FORMAT_GA);
    put_png("png_16bit_2x2", 2, 2, PNG_FORMAT_LINEAR_RGB);
    uint8_t *j;
    size_t n;
    if ((n = jpeg(8, 8, TJPF_RGB, TJSAMP_420, 0, &j))) {
        put("image", "jpeg_rgb_420", j, n);
        put("image", "jpeg_truncated", j, n / 2);
        put("image", "jpeg_cut_in_scan", j, n - 24);
        if (n > 200) {   /* claim 16384 x 16384 in the SOF0 frame header */
            for (size_t i = 2; i + 9 < n; i++)
                if (j[i] == 0xFF && j[i + 1] == 0xC0) {
                    j[i + 5] = 0x40, j[i + 6] = 0x00, j[i + 7] = 0x40, j[i + 8] = 0x00;
                    put("image", "jpeg_claims_16384", j, n);
                    break;
                }
        }
        free(j);
    }
    if ((n = jpeg(7, 5, TJPF_GRAY, TJSAMP_GRAY, 0, &j))) put("image", "jpeg_gray_7x5", j, n), free(j);
    if ((n = jpeg(8, 8, TJPF_RGB, TJSAMP_444, TJFLAG_PROGRESSIVE, &j))) put("image", "jpeg_progressive", j, n), free(j);
    put_str("image", "text_named_image", "not an image at all\n");
    put("image", "png_signature_only", "\x89PNG\r\n\x1a\n", 8);
    uint8_t *p;
    char path[1024];
    snprintf(path, sizeof path, "%s/image/png_rgb_8x8", out_dir);
    if ((n = slurp(path, &p)) > 40) put("image", "png_cut_in_idat", p, n - 30), free(p);
    put("image", "jpeg_soi_only", "\xFF\xD8\xFF", 3);
}

// ---------------------------------------------------------------------------------------------
// Checkpoints (the harness's model) and metadata JSON

/* A safetensors file from a header text (length prefix added) and data bytes. */
static void put_st_in(const char *reader, const char *name, const char *header, const void *data, size_t n_data) {
    size_t h = strlen(header), n = 8 + h + n_data;
    uint8_t *b = malloc(n);
    if (!b) return;
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)((uint64_t)h >> (8 * i));
    memcpy(b + 8, header, h);
    if (n_data) memcpy(b + 8 + h, data, n_data);
    put(reader, name, b, n);
    free(b);
}

static void put_st(const char *name, const char *header, const void *data, size_t n_data) {
    put_st_in("checkpoint", name, header, data, n_data);
}

/* The harness model's checkpoints (make_checkpoint), for the pretrained and compare seeds. */
static uint8_t *full_ckpt, *weights_ckpt;
static size_t full_n, weights_n;

static void make_checkpoint(void) {
    char path[1024];
    snprintf(path, sizeof path, "%s/checkpoint", out_dir);
    mkdir(path, 0755);
    snprintf(path, sizeof path, "%s/checkpoint/.tmp.safetensors", out_dir);
    fuzz_model fm;
    ampc_manual_seed(1);
    if (fuzz_model_new(&fm) < 0) {
        fprintf(stderr, "make_corpus: model: %s\n", ampc_last_error());
        failures++;
        return;
    }
    /* one step through the linear layers, so Adam has state and the scaler has counts */
    ampc_scope_begin();
    float xv[2 * 4] = {0.5f, -1, 2, 0.25f, 1, 0, -0.5f, 3}, yv[2 * 2] = {1, 0, 0, 1};
    ampc_tensor *x = ampc_tensor_from_f32(AMPC_F32, 2, (int64_t[]){2, 4}, xv);
    ampc_tensor *y = ampc_tensor_from_f32(AMPC_F32, 2, (int64_t[]){2, 2}, yv);
    for (int i = 0; i < 3; i++) x = ampc_module_forward(ampc_module_child(fm.m, i), x);
    int rc = ampc_backward(ampc_scaler_scale(fm.s, ampc_mse_loss(x, y, AMPC_REDUCTION_MEAN)));
    if (rc == 0) rc = ampc_scaler_step(fm.s, fm.opt);
    ampc_scaler_update(fm.s);
    ampc_scope_end();
    const char *kv[] = {"epoch", "3", "note", "caf\xC3\xA9 \"quoted\"\\", NULL};
    uint8_t *b;
    size_t n;
    if (rc >= 0 && ampc_checkpoint_save(path, fm.m, fm.opt, fm.s, kv) == 0 && (n = slurp(path, &b))) {
        put("checkpoint", "full", b, n);
        put("checkpoint", "truncated_data", b, n - 5);
        full_ckpt = b, full_n = n;
    } else {
        fprintf(stderr, "make_corpus: full checkpoint: %s\n", ampc_last_error());
        failures++;
    }
    if (ampc_checkpoint_save(path, fm.m, NULL, NULL, NULL) == 0 && (n = slurp(path, &b))) {
        put("checkpoint", "weights_only", b, n);
        weights_ckpt = b, weights_n = n;
    }
    remove(path);
    fuzz_model_free(&fm);

    put_st("empty_object", "{}      ", NULL, 0);
    put_st("meta_only", "{\"__metadata__\":{\"format\":\"pt\",\"epoch\":\"1\"}}", NULL, 0);
    put_st("one_tensor", "{\"0.bias\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]}}", "\0\0\x80?\0\0\0@\0\0@@", 12);
    put_st("overlapping_offsets",
           "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[2,6]}}",
           "\0\0\0\0\0\0\0\0", 8);
    put_st("shape_overflow", "{\"a\":{\"dtype\":\"F64\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,0]}}", NULL, 0);
    put_st("duplicate_key", "{\"__metadata__\":{\"a\":\"1\",\"a\":\"2\"}}", NULL, 0);
    put_st("bad_utf8", "{\"__metadata__\":{\"a\":\"\xC3\x28\"}}", NULL, 0);
    put_st("escapes", "{\"__metadata__\":{\"\\u00e9\\ud83d\\ude00\":\"\\n\\t\\\"\\\\\\/\"}}", NULL, 0);
    put("checkpoint", "header_size_too_big", "\xff\xff\xff\xff\0\0\0\0{}", 10);
    put("checkpoint", "short", "\x02\0\0", 3);
}

static void make_checkpoint_meta(void) {
    static const char *const seeds[][2] = {
        {"empty_object", "{}"},
        {"key_epoch", "epoch\n{\"format\":\"pt\",\"epoch\":\"12\"}"},
        {"long_value", "note\n{\"note\":\"a value longer than the sixteen-byte buffer\"}"},
        {"escapes", "\xC3\xA9\xF0\x9F\x98\x80\n{\"\\u00e9\\ud83d\\ude00\":\"\\b\\f\\n\\r\\t\\\"\\\\\\/\"}"},
        {"lone_surrogate", "{\"epoch\":\"\\ud800\"}"},
        {"nested", "{\"epoch\":{\"a\":\"b\"}}"},
        {"number_value", "{\"epoch\":3}"},
        {"trailing", "{\"epoch\":\"3\"} x"},
        {"duplicate", "{\"epoch\":\"3\",\"epoch\":\"4\"}"},
        {"unterminated", "{\"epoch\":\"3"},
        {"whitespace", " \t\r\n{ \"epoch\" : \"3\" , \"a\" : \"\" } \n"},
    };
    put_strs("checkpoint_meta", seeds, sizeof seeds / sizeof *seeds);
}

/* ampc-train's command lines: arguments separated by NUL bytes (sizeof - 1 drops the last NUL). */
static void make_train_args(void) {
    static const struct { const char *name; const char *args; size_t n; } seeds[] = {
#define ARGS(name, text) {name, text, sizeof text - 1}
        ARGS("flags", "--model\0resnet18\0--batch-size\0" "128\0--lr=0.1\0--optimizer\0sgd"),
        ARGS("sizes", "--max-memory\0" "1.5GiB\0--amp-dtype\0fp16\0--grad-scaler\0on\0--epochs\0" "3"),
        ARGS("divergence", "--max-loss\0" "1e300\0--max-skipped-steps\0" "0\0--momentum\0" "0.999\0--val-split\0" "0.5"),
        ARGS("compare", "--compare-checkpoints\0a\0b"),
        ARGS("resume", "--resume\0runs/latest/checkpoint.safetensors\0--epochs\0" "8\0--keep-casts=no"),
        ARGS("bad", "--bogus\0--lr\0nan\0--lr\0-1"),
        ARGS("typo", "--epoch\0" "3\0--lr-shedule=cosine"),   /* did you mean */
        ARGS("smoothing", "--label-smoothing\0" "0.1\0--model\0mlp"),
        ARGS("help", "--help"),
#undef ARGS
    };
    for (size_t i = 0; i < sizeof seeds / sizeof *seeds; i++) put("train_args", seeds[i].name, seeds[i].args, seeds[i].n);
}

// ---------------------------------------------------------------------------------------------
// Pretrained weights, checkpoint pairs, metrics.csv and steps.csv appends, resume metadata

static void make_pretrained(void) {
    if (full_ckpt) put("pretrained", "full", full_ckpt, full_n);
    if (weights_ckpt) put("pretrained", "weights_only", weights_ckpt, weights_n);
    /* a head of another shape, a tensor the model lacks, an integer buffer as floats */
    put_st_in("pretrained", "mismatched_head", "{\"2.weight\":{\"dtype\":\"F32\",\"shape\":[1,3],\"data_offsets\":[0,12]}}",
              "\0\0\x80?\0\0\0@\0\0@@", 12);
    put_st_in("pretrained", "unexpected", "{\"fc.bias\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[0,4]}}", "\0<\0<", 4);
    put_st_in("pretrained", "int_as_float", "{\"3.num_batches_tracked\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]}}",
              "\0\0\x80?", 4);
}

/* A pair for fuzz_checkpoint_compare: the first file's length (2 bytes LE), both files. */
static void put_pair(const char *name, const uint8_t *a, size_t na, const uint8_t *b, size_t nb) {
    uint8_t *p = malloc(2 + na + nb);
    if (!p || na > 0xffff) {
        free(p);
        return;
    }
    p[0] = (uint8_t)na, p[1] = (uint8_t)(na >> 8);
    memcpy(p + 2, a, na);
    memcpy(p + 2 + na, b, nb);
    put("checkpoint_compare", name, p, 2 + na + nb);
    free(p);
}

static void make_checkpoint_compare(void) {
    if (!full_ckpt || !weights_ckpt) return;
    put_pair("same", full_ckpt, full_n, full_ckpt, full_n);
    put_pair("weights_vs_full", weights_ckpt, weights_n, full_ckpt, full_n);
    uint8_t *b = malloc(full_n);
    if (!b) return;
    memcpy(b, full_ckpt, full_n);
    b[full_n - 1] ^= 0x40;   /* one byte of the last tensor */
    put_pair("one_byte", full_ckpt, full_n, b, full_n);
    put_pair("truncated", full_ckpt, full_n, b, full_n - 3);
    free(b);
    static const char tiny[] = "\x08\0\0\0\0\0\0\0{}      ";
    put_pair("empty_files", (const uint8_t *)tiny, sizeof tiny - 1, (const uint8_t *)tiny, sizeof tiny - 1);
}

static void make_metrics_append(void) {
    static const char h[] = "epoch,train_loss,train_acc,val_loss,val_acc,seconds,samples_per_s,scale,skipped_steps,data_wait\n";
    static const char *const seeds[][2] = {
        {"empty", "\x01"},
        {"header", "\x01%s"},
        {"rows", "\x01%s1,2.3,0.1,2.2,0.2,9.5,120.5,65536,0,0.01\n2,1.9,0.3,nan,inf,9.1,118,32768,1,-inf\n"},
        {"torn_row", "\x01%s1,2.3,0.1,2.2,0.2,9.5,120.5,65536,0,0.01\n2,1.9,0."},
        {"header_no_newline", "\x01" "epoch,train_loss,train_acc,val_loss,val_acc,seconds,samples_per_s,scale,skipped_steps,data_wait"},
        {"other_header", "\x01" "epoch,loss\n1,2\n"},
        {"quoted", "\x00\"a,b\",\"say \"\"hi\"\"\"\n1,2\n"},
        {"crlf", "\x01%s1,2\r\n"},
    };
    for (size_t i = 0; i < sizeof seeds / sizeof *seeds; i++) {
        char text[1024];
        int n = snprintf(text, sizeof text, seeds[i][1] + 1, h);
        char *b = malloc((size_t)n + 1);
        if (!b) return;
        b[0] = seeds[i][1][0];
        memcpy(b + 1, text, (size_t)n);
        put("metrics_append", seeds[i][0], b, (size_t)n + 1);
        free(b);
    }
}

/* steps.csv seeds: the checkpoint's steps (2 bytes LE), then the file. */
static void make_steps_csv(void) {
    static const char h[] = "step,epoch,batch,loss,scale,skipped,lr\n";
    static const struct { const char *name; uint16_t keep; const char *rows; } seeds[] = {
        {"cut", 3, "1,1,1,2.3,65536,0,0.001\n2,1,2,2.2,65536,1,0.001\n3,1,3,2.1,32768,0,0.001\n4,1,4,2,32768,0,0.001\n5,2,1,1.9,3"},
        {"keep_all", 65535, "1,1,1,2.3,65536,0,0.001\n2,1,2,nan,0,1,0.001\n"},
        {"keep_none", 0, "1,1,1,2.3,65536,0,0.001\n"},
        {"junk_lines", 9, "\nx,1\n-3,1,1,1,1,1,1\n7,1\n8\n9,1,1,1,1,1,1"},
        {"header_only", 1, ""},
    };
    for (size_t i = 0; i < sizeof seeds / sizeof *seeds; i++) {
        char b[1024];
        b[0] = (char)(seeds[i].keep & 0xff), b[1] = (char)(seeds[i].keep >> 8);
        int n = snprintf(b + 2, sizeof b - 2, "%s%s", h, seeds[i].rows);
        put("steps_csv", seeds[i].name, b, (size_t)n + 2);
    }
}

/* Resume metadata: keys and values each ended by a NUL (sizeof - 1 keeps the last NUL of the
   literal's own). */
static void make_resume_meta(void) {
#define K(key, value) "ampc_train." key "\0" value "\0"
#define BASE K("version", "1") K("world_size", "1") K("train_size", "8") K("val_size", "8") K("num_classes", "10")
#define HIST(v) K("history.epoch", v) K("history.train_loss", v) K("history.train_acc", v) K("history.val_loss", v) \
    K("history.val_acc", v) K("history.seconds", v) K("history.samples_per_s", v) K("history.scale", v)           \
    K("history.skipped_steps", v) K("history.data_wait", v)
    static const struct { const char *name; const char *kv; size_t n; } seeds[] = {
#define SEED(name, text) {name, text, sizeof text - 1}
        SEED("epoch_end", BASE K("epoch", "1") K("step", "0") K("config.batch-size", "2") K("config.model", "cnn") HIST("1")),
        SEED("mid_epoch", BASE K("epoch", "1") K("step", "2") K("partial", "1.5,1,4,0.1,0.2,0,0.3") K("config.batch-size", "2")
                              K("config.use-amp", "yes") K("config.amp-dtype", "fp16") K("config.lr", "0.001") HIST("0.5")),
        SEED("two_epochs", BASE K("epoch", "2") K("config.batch-size", "4") K("config.epochs", "5") K("config.grad-scaler", "yes")
                               K("history.epoch", "1,2") K("history.train_loss", "2.3,nan") K("history.train_acc", "0.1,0.2")
                               K("history.val_loss", "inf,1") K("history.val_acc", "0,1") K("history.seconds", "1,2")
                               K("history.samples_per_s", "8,8") K("history.scale", "65536,32768") K("history.skipped_steps", "0,1")),
        SEED("diverged", BASE K("epoch", "0") K("step", "1") K("partial", "nan,0,2,0,0,1,0") K("diverged", "the loss is nan")
                             K("config.batch-size", "2") K("config.use-amp", "no") HIST("")),
        SEED("bad_values", BASE K("epoch", "-1") K("config.batch-size", "0x10") K("config.model", "resnet9") HIST("1,")),
        SEED("not_ours", "epoch\0" "3\0" "note\0" "caf\xc3\xa9\0"),
#undef SEED
    };
#undef HIST
#undef BASE
#undef K
    for (size_t i = 0; i < sizeof seeds / sizeof *seeds; i++) put("resume_meta", seeds[i].name, seeds[i].kv, seeds[i].n);
}

// ---------------------------------------------------------------------------------------------
// Token files: flags (block size - 1 in bits 0-4, tail, shuffle), then the file

/* llm.c's .bin: the 256 x int32 header (magic, version, count as given) and n tokens of width 2
   (version 1) or 4, little-endian. */
static void put_tokens_bin(const char *name, uint8_t flags, int32_t version, int32_t count, int n, uint32_t first) {
    static uint8_t b[1 + 1024 + 4 * 200];
    memset(b, 0, sizeof b);
    b[0] = flags;
    const int32_t h[3] = {20240520, version, count};
    memcpy(b + 1, h, sizeof h);
    const int w = version == 1 ? 2 : 4;
    for (int i = 0; i < n; i++)
        for (int k = 0; k < w; k++) b[1 + 1024 + i * w + k] = (uint8_t)((first + 37u * (uint32_t)i) >> (8 * k));
    put("tokens", name, b, (size_t)(1 + 1024 + n * w));
}

static void make_tokens(void) {
    static const char text[] = "\x03To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n";
    put("tokens", "text_t4", text, sizeof text - 1);
    put_str("tokens", "short", "\x1fhello");
    put_tokens_bin("bin_v1", 7, 1, 200, 200, 100);
    put_tokens_bin("bin_v2_tail", 2 | 32 | 64, 2, 200, 200, 120000);
    put_tokens_bin("bin_v1_past_vocab", 7, 1, 200, 200, 50250);
    put_tokens_bin("bin_lying_count", 3, 1, 300, 200, 1);
    put_tokens_bin("bin_version_9", 3, 9, 200, 200, 1);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s OUTDIR\n", argv[0]);
        return 2;
    }
    out_dir = argv[1];
    mkdir(out_dir, 0755);
    make_idx();
    make_folder_index();
    make_image();
    make_checkpoint();
    make_checkpoint_meta();
    make_train_args();
    make_pretrained();
    make_checkpoint_compare();
    make_metrics_append();
    make_steps_csv();
    make_resume_meta();
    make_tokens();
    free(full_ckpt);
    free(weights_ckpt);
    ampc_shutdown();
    if (failures) fprintf(stderr, "make_corpus: %d failures\n", failures);
    return failures ? 1 : 0;
}
