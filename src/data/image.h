/*
 * image.h - internal image decoding for the image-folder dataset: JPEG (libturbojpeg) and PNG
 * (libpng) into 8-bit interleaved buffers, channel conversion and resizing to f32 CHW.
 * Every failure returns a negative ampc_status with a message naming the file and the reason.
 */
#ifndef AMPC_DATA_IMAGE_H
#define AMPC_DATA_IMAGE_H

#include "core/core.h"

/* Largest width or height accepted: bigger images are refused before any pixel is decoded. */
#define AMPC_IMAGE_MAX_DIM 16384
/* Largest file read into memory (bytes). */
#define AMPC_IMAGE_MAX_FILE ((size_t)1 << 30)

typedef enum { AMPC_IMAGE_UNKNOWN = 0, AMPC_IMAGE_JPEG, AMPC_IMAGE_PNG } ampc_image_format;

typedef struct {
    int width, height;
    int channels;      /* 1 (gray) or 3 (RGB) */
    uint8_t *pixels;   /* height*width*channels, row-major, interleaved (HWC); malloc'd */
} ampc_image;

/* Format from the first bytes (FF D8 FF: JPEG, 89 'P' 'N' 'G': PNG); UNKNOWN otherwise. */
ampc_image_format ampc__image_sniff(const void *buf, size_t n);

/* Reads only as much of the file as the header needs and checks it: a supported JPEG/PNG of at
   most AMPC_IMAGE_MAX_DIM per side. Fills *w, *h (either may be NULL). name is for messages. */
int ampc__image_probe_file(const char *path, int *w, int *h);

/* Decodes an encoded image in memory into img (caller frees with ampc__image_free), converted to
   `channels` (1 or 3: gray is replicated to RGB, RGB becomes ITU-R 601 luma). */
int ampc__image_decode_mem(const void *buf, size_t n, const char *name, int channels, ampc_image *img);
/* Same, reading the file first. */
int ampc__image_decode_file(const char *path, int channels, ampc_image *img);
void ampc__image_free(ampc_image *img);

/* Resizes an 8-bit image to out (channels x out_h x out_w f32, CHW, values v/255) with PIL's
   antialiased bilinear (triangle) filter: plain bilinear with half-pixel centres when
   enlarging, a triangle of width scale when shrinking; the identity at the same size. */
int ampc__image_resize_chw(const ampc_image *img, int64_t out_h, int64_t out_w, float *out);

#endif /* AMPC_DATA_IMAGE_H */
