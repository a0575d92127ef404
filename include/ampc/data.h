/*
 * ampc/data.h - datasets, transforms and the data loader (included by ampc.h).
 */
#ifndef AMPC_DATA_H
#define AMPC_DATA_H

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A dataset of labelled images (f32 CHW samples in [0, 1], int64 labels). */
typedef struct ampc_dataset ampc_dataset;
int64_t ampc_dataset_size(const ampc_dataset *ds);
int64_t ampc_dataset_num_classes(const ampc_dataset *ds);
/* Shape of every sample: channels, height, width. */
void ampc_dataset_sample_shape(const ampc_dataset *ds, int64_t *c, int64_t *h, int64_t *w);
/* Sample i (raw, untransformed) into img (c*h*w floats) and *label. */
int ampc_dataset_get(ampc_dataset *ds, int64_t i, float *img, int64_t *label);
/* Drops the caller's reference; the dataset goes once no subset or loader holds it (NULL: no-op).
   The handle is stale from then on (ampc.h, "Stale handles"), whoever still holds the object. */
void ampc_dataset_free(ampc_dataset *ds);
/* A 64-bit hash of what names the samples: size, classes, sample shape, class names, and the IDX
   headers and labels, the image folder's file list (as scanned or indexed, relative to its root)
   and targets, or a subset's parent and indices. Equal datasets on two machines hash alike, so
   data-parallel ranks compare it to find one given other data; 0 for NULL. */
uint64_t ampc_dataset_fingerprint(const ampc_dataset *ds);

// ---------------------------------------------------------------------------------------------
// Datasets: IDX files (MNIST, Fashion-MNIST), subsets and splits
//
//     ampc_dataset *all = ampc_dataset_mnist_open(ampc_fashion_mnist_dir(), true);
//     ampc_dataset *train, *val;
//     ampc_dataset_split(all, 0.1, 42, &train, &val);
//     ampc_dataset_free(all);             // fine: the subsets hold their own reference

/* Name of class i ("Ankle boot"), owned by ds; NULL when the dataset has no names. */
const char *ampc_dataset_class_name(const ampc_dataset *ds, int64_t i);
/* A pair of IDX files (plain or gzip, told by content): images magic 0x00000803 (N x rows x cols
   ubyte), labels magic 0x00000801 (N ubyte). Loaded into memory; samples are 1 x rows x cols
   in [0, 1]; num_classes = max label + 1. NULL + AMPC_ERR_IO/AMPC_ERR_FORMAT naming the file
   and the problem. Free with ampc_dataset_free. */
ampc_dataset *ampc_dataset_idx_open(const char *images_path, const char *labels_path);
/* The standard MNIST file names in dir: {train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz];
   10 classes (a label >= 10 is an error). Class names are Fashion-MNIST's ("T-shirt/top", ...)
   when dir's name contains "fashion" (any case), none otherwise. */
ampc_dataset *ampc_dataset_mnist_open(const char *dir, bool train);
/* Same, always with Fashion-MNIST's class names; dir NULL: ampc_fashion_mnist_dir(). */
ampc_dataset *ampc_dataset_fashion_mnist_open(const char *dir, bool train);
/* Directory of Fashion-MNIST: $AMPC_FASHION_MNIST_DIR when set and non-empty, else Debian's
   dataset-fashion-mnist (/usr/share/datasets/fashion-mnist) when it exists, else NULL. */
const char *ampc_fashion_mnist_dir(void);

/* Samples indices[0..n) of ds, in that order (copied; repeats allowed). The subset holds a
   reference on ds: ds may be freed before it. Free with ampc_dataset_free. */
ampc_dataset *ampc_dataset_subset(ampc_dataset *ds, const int64_t *indices, int64_t n);
/* Random split: val gets round(val_fraction * size) samples, train the rest, each in the
   parent's order. Depends only on (seed, size): the same split on every machine. val_fraction
   in [0, 1]. Both are subsets of ds (free each). */
int ampc_dataset_split(ampc_dataset *ds, double val_fraction, uint64_t seed, ampc_dataset **train,
                       ampc_dataset **val);

// ---------------------------------------------------------------------------------------------
// Token windows for language models (the zoo's "gpt")
//
// A token file as a dataset of windows of block_size + 1 tokens: a text file read as bytes
// (vocabulary 256) or llm.c's pre-tokenised .bin (a 256 x int32 header: magic 20240520, version 1
// with uint16 GPT-2 tokens, vocabulary 50257, or version 2 with uint32 LLaMA-3 tokens, 128256;
// the token count), told by content and mapped read-only. The part [begin, end) of the stream
// (fractions) is used: [0, 0.9) to train, [0.9, 1) to validate on the held-out tail. Window i,
// cut at shift s in [0, T), starts at token s + i T: inputs tokens s + i T .. + T - 1, targets the
// next token of each. The data loader gives such a dataset's batches as x (B, T) i64 and y (B, T)
// i64, shuffled, sharded and resumed as images are; when it shuffles, each epoch's shift comes
// from (seed, epoch), so the text is cut at other places every epoch (0 unshuffled).
// num_classes is the vocabulary, the sample shape (1, 1, T), and no token may lie outside it.

typedef struct {
    int64_t block_size;   /* T (>= 1) */
    double begin, end;    /* the part used, as fractions of the stream: 0 <= begin < end <= 1 */
} ampc_tokens_options;
ampc_dataset *ampc_dataset_tokens_open(const char *path, const ampc_tokens_options *o);
/* T for a token dataset (or a subset of one), 0 for images. */
int64_t ampc_dataset_block_size(const ampc_dataset *ds);
/* Window i cut at shift (< T): T inputs into x, T targets into y. */
int ampc_dataset_get_window(ampc_dataset *ds, int64_t i, int64_t shift, int64_t *x, int64_t *y);

// ---------------------------------------------------------------------------------------------
// Transforms: a pipeline applied per sample to f32 CHW images, in the order added.
// Random choices of sample `index` in epoch `epoch` come from Philox keyed by (seed, epoch,
// index): the same for any number of loader threads and on every machine.

typedef struct ampc_transforms ampc_transforms;
ampc_transforms *ampc_transforms_new(void);   /* empty (identity); free with ampc_transforms_free */
void ampc_transforms_free(ampc_transforms *t);
/* Bilinear resize to h x w (half-pixel centres, edge clamp, no antialiasing: PyTorch's
   interpolate(mode="bilinear", align_corners=False)). */
int ampc_transforms_add_resize(ampc_transforms *t, int64_t h, int64_t w);
/* Mirrors left-right with probability p. */
int ampc_transforms_add_hflip(ampc_transforms *t, double p);
/* Random affine about the image centre (torchvision's RandomAffine): rotation uniform in
   [-degrees, degrees], scale uniform in [scale_min, scale_max], shift uniform in
   [-max_shift, max_shift] times the width (x) and height (y); bilinear sampling, zero fill. */
int ampc_transforms_add_affine(ampc_transforms *t, double max_shift, double scale_min,
                               double scale_max, double degrees);
/* What fills the points an affine transform takes from outside the image. */
typedef enum {
    AMPC_BORDER_ZERO,         /* 0 (torchvision's RandomAffine fill = 0) */
    AMPC_BORDER_REFLECT_101   /* the image mirrored about its edge pixels, gfedcb|abcdefgh|gfedcba
                                 (OpenCV's BORDER_REFLECT_101, albumentations' default) */
} ampc_border;
/* albumentations' ShiftScaleRotate: with probability p, rotation uniform in [-rotate_limit,
   rotate_limit] degrees (positive: counter-clockwise, as cv2.getRotationMatrix2D), scale uniform
   in [1 - scale_limit, 1 + scale_limit], shift uniform in [-shift_limit, shift_limit] times the
   width (x) and height (y), about the centre ((w - 1) / 2, (h - 1) / 2); bilinear sampling, the
   border filled as `border` says. The seed's: (0.5, 0.3, 0.3, 15, AMPC_BORDER_REFLECT_101). */
int ampc_transforms_add_shift_scale_rotate(ampc_transforms *t, double p, double shift_limit, double scale_limit,
                                           double rotate_limit, ampc_border border);
/* x = (x - mean[c]) / std[c] per channel; n = 1 applies one pair to every channel. */
int ampc_transforms_add_normalize(ampc_transforms *t, int n, const float *mean, const float *std);
/* Output shape for input c x h x w (checks that normalize's channel count fits). */
int ampc_transforms_output_shape(const ampc_transforms *t, int64_t c, int64_t h, int64_t w,
                                 int64_t *oc, int64_t *oh, int64_t *ow);
/* Applies the pipeline to one sample in (c x h x w) into out (output shape); t NULL: copy.
   Allocates scratch per call: the loader has a faster path. */
int ampc_transforms_apply(const ampc_transforms *t, int64_t c, int64_t h, int64_t w, const float *in,
                          float *out, uint64_t seed, int64_t epoch, int64_t index);

// ---------------------------------------------------------------------------------------------
// Data loader: batches of (images f32 (B, C, H, W), labels i64 (B)) on the CPU device; of a token
// dataset, (inputs i64 (B, T), targets i64 (B, T)).
//
//     ampc_loader_options lo = ampc_loader_defaults();
//     lo.batch_size = 128; lo.num_workers = 2; lo.transforms = tf;
//     ampc_loader *ld = ampc_loader_new(train, &lo);
//     for (int epoch = 0; epoch < n_epochs; epoch++) {
//         ampc_loader_start_epoch(ld, epoch);
//         ampc_tensor *x, *y;
//         int rc;
//         ampc_scope_begin();
//         while ((rc = ampc_loader_next(ld, &x, &y)) == 1) { ...; ampc_scope_end(); ampc_scope_begin(); }
//         ampc_scope_end();
//         if (rc < 0) fail(ampc_last_error());
//     }
//     ampc_loader_free(ld);
//
// Data-parallel training (DistributedSampler): each of W ranks makes a loader with the same
// options and dataset plus shard_rank = its rank, shard_count = W. Every rank shuffles the same
// permutation of (seed, epoch); global batch s is its next W * batch_size samples, and rank r
// takes the r-th batch_size of them, so the ranks' batches s, concatenated in rank order, are
// batch s of one loader with batch_size W * batch_size. The last global batch of R < W *
// batch_size samples is dropped with drop_last; otherwise it is split in rank order as evenly
// as possible (the first R % W ranks get R / W + 1 samples, the others R / W): when R < W the
// last W - R ranks get a batch of 0 samples (a (0, C, H, W) tensor), so no sample is dropped and
// every rank has the same number of batches. Ranks of such an uneven batch weight their loss by
// their share of it (ampc_loader_global_rows; ampc_ddp_join for a rank with none) to train as
// one process. Random transforms depend on the sample, not on its rank.
// To checkpoint mid-epoch, store ampc_loader_epoch_position and resume, on any number of
// ranks, with ampc_loader_start_epoch_at_sample.

typedef struct {
    int64_t batch_size;    /* default 64; per rank when sharded */
    bool shuffle;          /* default true: order from (seed, epoch) */
    bool drop_last;        /* default false: the last batch may be smaller */
    uint64_t seed;         /* default 0: shuffling and random transforms */
    int num_workers;       /* default 0: batches made on the calling thread in ampc_loader_next */
    int prefetch;          /* batches made ahead by workers; default (0) 2 per worker */
    const ampc_transforms *transforms;   /* default NULL; copied by ampc_loader_new */
    int shard_rank;        /* default 0: this rank, in [0, shard_count) */
    int shard_count;       /* default 1 (no sharding: every sample here): the number of ranks */
    bool drop_short_tail;  /* default false: an epoch's last global batch with fewer samples than
                              ranks is dropped (some rank would get none: SyncBatchNorm needs one) */
    ampc_device device;    /* default CPU: where ampc_loader_next puts the images (a token
                              dataset's x); the labels (y) stay on the CPU, where a training loop
                              counts them. A GPU with num_workers > 0: the workers' batch buffers
                              are page-locked and each batch is copied on the GPU's copy stream,
                              the next batch's copy started while this one is in use (PyTorch's
                              pin_memory with non_blocking copies); otherwise one copy per batch */
} ampc_loader_options;
typedef struct ampc_loader ampc_loader;

ampc_loader_options ampc_loader_defaults(void);
/* Holds a reference on ds (ds may be freed before the loader); NULL + error on bad options. */
ampc_loader *ampc_loader_new(ampc_dataset *ds, const ampc_loader_options *o);
/* Starts epoch `epoch` (>= 0): the order is a function of (seed, epoch) alone, the same for every
   num_workers. Abandons the rest of a running epoch. ampc_loader_next starts epoch 0 itself if no
   epoch was started. */
int ampc_loader_start_epoch(ampc_loader *ld, int64_t epoch);
/* The same, continuing epoch `epoch` at batch first_batch (0..num_batches of a whole epoch):
   the batches handed out are exactly those an uninterrupted epoch hands out from there
   (resuming mid-epoch on the same shard_count; it is start_epoch_at_sample at sample
   first_batch * shard_count * batch_size, but num_batches stays that of a whole epoch). */
int ampc_loader_start_epoch_at(ampc_loader *ld, int64_t epoch, int64_t first_batch);
/* Continues epoch `epoch` at global sample first_sample (0..dataset size): the samples all
   ranks together took so far, as ampc_loader_epoch_position returned them, on any shard_count.
   The remaining samples of the permutation are split into global batches as in a whole epoch
   (so the batches taken before and after are the epoch's samples, each once, up to the drops
   at its end described above); num_batches becomes those of this shortened epoch. */
int ampc_loader_start_epoch_at_sample(ampc_loader *ld, int64_t epoch, int64_t first_sample);
/* Global sample position in the current epoch after the batches ampc_loader_next has returned
   (all ranks together: the epoch's first sample + batches handed * shard_count * batch_size,
   at most the dataset size); prefetching workers do not move it, and it is the same on every
   rank after the same number of batches. 0 before any epoch starts. */
int64_t ampc_loader_epoch_position(const ampc_loader *ld);
/* Next batch: 1 and two new tensors in the caller's current scope; 0 at the end of the epoch
   (and on every call after it until the next start_epoch); < 0 on error (a dataset or transform
   error, also one from a worker thread, with its message), sticky until the next start_epoch. */
int ampc_loader_next(ampc_loader *ld, ampc_tensor **images, ampc_tensor **labels);
/* The samples all ranks together have in the batch ampc_loader_next returned last (W *
   batch_size but for the epoch's last batch; this rank has dim 0 of its images of them); 0 before
   the first. With it a rank weights its batch's mean loss by rows * W / global_rows, so that the
   gradient DDP averages is the mean over the global batch however it was split. */
int64_t ampc_loader_global_rows(const ampc_loader *ld);
/* This rank's batches in the current epoch, the same on every rank: set by ampc_loader_new to
   those of a whole epoch, and by each start_epoch call (start_epoch_at_sample: the rest only). */
int64_t ampc_loader_num_batches(const ampc_loader *ld);
/* This rank's batches in an epoch that starts at global sample first_sample (0..dataset size;
   0: a whole epoch), as start_epoch_at_sample would set num_batches, without starting anything;
   -1 + error on a NULL loader or a sample out of range. */
int64_t ampc_loader_count_batches(const ampc_loader *ld, int64_t first_sample);
/* Output shape of each sample (after transforms). */
void ampc_loader_sample_shape(const ampc_loader *ld, int64_t *c, int64_t *h, int64_t *w);
/* Stops and joins the workers (also mid-epoch) and frees everything the loader owns. */
void ampc_loader_free(ampc_loader *ld);

// ---------------------------------------------------------------------------------------------
// Image folders (section maintained with src/data/folder.c, src/data/image_decode.c)
//
// torchvision's ImageFolder layout, e.g. Caltech-256: root/<class>/.../<image>.{jpg,jpeg,png}.
// Classes are root's subfolders sorted by name (labels 0, 1, ...; names = folder names); each
// class folder is walked recursively, files sorted by name. Hidden names ('.'-prefixed) are
// skipped. Each folder is taken once (links to one already taken, loops included, are skipped);
// a link to a folder that resolves outside root is an error. Images are decoded (libturbojpeg,
// libpng; format told by content) in ampc_dataset_get and resized to height x width with PIL's
// antialiased bilinear filter.
//
//     ampc_folder_options fo = {.height = 64, .width = 64, .channels = 3,
//                               .index_csv = "caltech256.csv"};
//     ampc_dataset *ds = ampc_dataset_folder_open("/data/256_ObjectCategories", &fo);
//     if (!ds) fail(ampc_last_error());

typedef struct {
    int64_t height, width;   /* every sample is resized to this; required, in [1, 16384] */
    int channels;            /* 3 (RGB; 0 means 3) or 1 (gray: ITU-R 601 luma, as PIL's "L") */
    /* Optional index (CSV: header image_path,target, one row per image, paths relative to root,
       RFC 4180 quoting; targets are class indices 0..K-1, K <= 65536, no sparse ids). Exists:
       read instead of scanning. Missing: scan, then write it. */
    const char *index_csv;
    /* Classes left out, as if their folders were not there (labels 0..K-1 over the rest):
       comma-separated fnmatch(3) patterns of class names, such as "clutter" or "257.*,*-101"; a
       numbered name "NNN.name" (Caltech's) also matches by the part after the dot. A pattern that
       matches no class of a scanned folder is an error (from an index, written after a scan that
       left them out, it is not). NULL: none. */
    const char *exclude_classes;
} ampc_folder_options;

/* Opens an image folder. Candidates whose header is not a readable JPEG/PNG (text named x.jpg,
   truncated header, over 16384 pixels a side, a FIFO or device: never opened) are skipped at
   scan time with a line on stderr naming each, and counted; a file that fails later (pixel data
   cut short) makes ampc_dataset_get fail naming it. NULL + error: root missing or not a folder, no class folder,
   a class without images, a link out of root, a malformed index or one that is a FIFO (the
   message names the line or the file), bad options.
   Free with ampc_dataset_free. */
ampc_dataset *ampc_dataset_folder_open(const char *root, const ampc_folder_options *o);
/* Files skipped at scan time (0 when read from an index); AMPC_ERR_INVALID if ds is not a folder. */
int64_t ampc_dataset_folder_skipped(const ampc_dataset *ds);
/* Classes left out by exclude_classes; AMPC_ERR_INVALID if ds is not a folder. */
int64_t ampc_dataset_folder_excluded(const ampc_dataset *ds);
/* Path of sample i (root joined with its relative path), owned by ds; NULL + error if out of range
   or ds is not a folder. */
const char *ampc_dataset_folder_path(const ampc_dataset *ds, int64_t i);

#ifdef __cplusplus
}
#endif

#endif /* AMPC_DATA_H */
