/*
 * make_image_folder.c - writes a small image folder for tests/e2e_train.sh (the test can't rely
 * on python3): ROOT/class_<k>/img_<i>.png, RGB, SIZE x SIZE, each class a different pattern
 * (horizontal stripes, vertical stripes, a checkerboard, a disc, ...) in its own colour with
 * per-image noise, so a small network learns to tell them apart in a few steps. With --junk it
 * adds files a dataset must skip: a text file named like a PNG and a README.
 *
 *     make_image_folder ROOT N_CLASSES N_PER_CLASS SIZE [--junk]
 */
#include <png.h>

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static uint32_t rng = 12345;
static unsigned noise(void) {   /* an LCG: reproducible everywhere */
    rng = rng * 1664525u + 1013904223u;
    return rng >> 24;
}

static int pattern(int k, int x, int y, int size) {
    int s = size / 4 > 0 ? size / 4 : 1;
    switch (k % 4) {
    case 0: return (y / s) % 2;
    case 1: return (x / s) % 2;
    case 2: return (x / s + y / s) % 2;
    default: {
        int dx = 2 * x - size, dy = 2 * y - size;
        return dx * dx + dy * dy < size * size / 2;
    }
    }
}

static int write_png(const char *path, int k, int size) {
    unsigned char *px = malloc((size_t)size * size * 3);
    if (!px) return -1;
    const unsigned char colours[4][3] = {{220, 40, 40}, {40, 200, 60}, {50, 80, 230}, {230, 200, 40}};
    for (int y = 0; y < size; y++)
        for (int x = 0; x < size; x++) {
            int on = pattern(k, x, y, size);
            for (int c = 0; c < 3; c++) {
                int v = on ? colours[k % 4][c] : 20;
                v += (int)(noise() % 41) - 20;
                px[((size_t)y * size + x) * 3 + c] = (unsigned char)(v < 0 ? 0 : v > 255 ? 255 : v);
            }
        }
    png_image img;
    memset(&img, 0, sizeof img);
    img.version = PNG_IMAGE_VERSION;
    img.width = (png_uint_32)size;
    img.height = (png_uint_32)size;
    img.format = PNG_FORMAT_RGB;
    int ok = png_image_write_to_file(&img, path, 0, px, 0, NULL);
    free(px);
    if (!ok) fprintf(stderr, "make_image_folder: %s: %s\n", path, img.message);
    return ok ? 0 : -1;
}

static int write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    if (!f) return -1;
    fputs(text, f);
    return fclose(f);
}

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: make_image_folder ROOT N_CLASSES N_PER_CLASS SIZE [--junk]\n");
        return 2;
    }
    const char *root = argv[1];
    int n_classes = atoi(argv[2]), per = atoi(argv[3]), size = atoi(argv[4]);
    int junk = argc > 5 && strcmp(argv[5], "--junk") == 0;
    if (n_classes < 1 || per < 1 || size < 4) return 2;
    char path[4096];
    if (mkdir(root, 0777) != 0 && errno != EEXIST) return perror(root), 1;
    for (int k = 0; k < n_classes; k++) {
        snprintf(path, sizeof path, "%s/class_%d", root, k);
        if (mkdir(path, 0777) != 0 && errno != EEXIST) return perror(path), 1;
        for (int i = 0; i < per; i++) {
            snprintf(path, sizeof path, "%s/class_%d/img_%03d.png", root, k, i);
            if (write_png(path, k, size) < 0) return 1;
        }
    }
    if (junk) {
        snprintf(path, sizeof path, "%s/class_0/not_an_image.png", root);
        if (write_text(path, "this is a text file with a .png name\n") < 0) return 1;
        snprintf(path, sizeof path, "%s/class_1/README.txt", root);
        if (write_text(path, "not an image either\n") < 0) return 1;
    }
    return 0;
}
