/*
 * datasets.c - --data: a folder of IDX files (Fashion-MNIST by default) or an image folder (one
 * subfolder per class; --exclude-class), its transforms (resize, --augment, Normalize with the
 * data's statistics),
 * the validation split when the data has no test set, and --limit-train/--limit-val.
 */
#include "train.h"

#include <errno.h>
#include <math.h>
#include <inttypes.h>
#include <stdio.h>
#include <sys/stat.h>

/* Fashion-MNIST's and MNIST's pixel statistics (training sets), for Normalize as in PyTorch's
   examples; ImageNet's for image folders, as torchvision's reference scripts use. */
static const float FASHION_MEAN = 0.2860f, FASHION_STD = 0.3530f;
static const float MNIST_MEAN = 0.1307f, MNIST_STD = 0.3081f;
static const float IMAGENET_MEAN[3] = {0.485f, 0.456f, 0.406f}, IMAGENET_STD[3] = {0.229f, 0.224f, 0.225f};

void data_free(data *d) {
    ampc_dataset_free(d->train);
    ampc_dataset_free(d->val);
    ampc_transforms_free(d->tf_train);
    ampc_transforms_free(d->tf_val);
    memset(d, 0, sizeof *d);
}

static bool file_exists(const char *dir, const char *name) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    struct stat st;
    return stat(path, &st) == 0;
}

/* Whether dir holds <prefix>-images-idx3-ubyte(.gz). A name taken by something that is not a
   file (a FIFO, a link to one) counts too: opening it refuses it by name, where taking it for
   absent would make validation a split of the training data. */
static bool has_idx(const char *dir, const char *prefix) {
    char a[64], b[64];
    snprintf(a, sizeof a, "%s-images-idx3-ubyte", prefix);
    snprintf(b, sizeof b, "%s-images-idx3-ubyte.gz", prefix);
    return file_exists(dir, a) || file_exists(dir, b);
}

static ampc_dataset *first_n(ampc_dataset *ds, int64_t limit) {
    int64_t n = ampc_dataset_size(ds);
    if (limit <= 0 || limit >= n) return ds;
    int64_t *idx = malloc((size_t)limit * sizeof *idx);
    if (!idx) {
        ampc_dataset_free(ds);
        fail("out of memory");
        return NULL;
    }
    for (int64_t i = 0; i < limit; i++) idx[i] = i;
    ampc_dataset *sub = ampc_dataset_subset(ds, idx, limit);
    free(idx);
    ampc_dataset_free(ds);   /* the subset holds its own reference */
    if (!sub) fail_lib("taking the first samples");
    return sub;
}

/* --augment (resolved): the transfer-learning tutorial's albumentations pipeline, after the
   resize: HorizontalFlip(p=0.5), then ShiftScaleRotate(0.3, 0.3, 15, p=0.5, BORDER_REFLECT_101). */
static int add_augmentation(const settings *s, ampc_transforms *t) {
    const char *a = sval(s, OPT_AUGMENT);
    if ((!strcmp(a, "flip") || !strcmp(a, "flip+ssr")) && ampc_transforms_add_hflip(t, 0.5) < 0) return -1;
    if ((!strcmp(a, "ssr") || !strcmp(a, "flip+ssr")) &&
        ampc_transforms_add_shift_scale_rotate(t, 0.5, 0.3, 0.3, 15.0, AMPC_BORDER_REFLECT_101) < 0)
        return -1;
    return 0;
}

/* The validation windows' targets' cross-entropy (nats) under the training windows' target
   frequencies with add-one smoothing: the unigram baseline a language model has to beat. */
static int unigram_baseline(data *d) {
    const int64_t V = d->num_classes, T = d->block;
    double *count = calloc((size_t)V, sizeof *count);
    int64_t *x = malloc((size_t)T * sizeof *x), *y = malloc((size_t)T * sizeof *y);
    int rc = count && x && y ? 0 : fail("out of memory");
    double total = (double)V, ce = 0, n = 0;
    for (int64_t i = 0; rc == 0 && i < ampc_dataset_size(d->train); i++) {
        if (ampc_dataset_get_window(d->train, i, 0, x, y) < 0) rc = fail_lib("--data");
        for (int64_t j = 0; rc == 0 && j < T; j++) count[y[j]] += 1;
        total += (double)T;
    }
    for (int64_t i = 0; rc == 0 && i < ampc_dataset_size(d->val); i++) {
        if (ampc_dataset_get_window(d->val, i, 0, x, y) < 0) rc = fail_lib("--data");
        for (int64_t j = 0; rc == 0 && j < T; j++, n++) ce -= log((count[y[j]] + 1) / total);
    }
    d->unigram = n > 0 ? ce / n : NAN;
    free(count), free(x), free(y);
    return rc;
}

/* --model gpt: --data FILE's windows of --block-size + 1 tokens, its head to train and its tail
   (--val-split) to validate. */
static int data_open_tokens(settings *s, data *d) {
    const char *path = sval(s, OPT_DATA);
    if (!*path)
        return usage_error("--model gpt needs --data FILE: a text file (read as bytes) or llm.c's pre-tokenised .bin tokens");
    if (is_auto(s, OPT_BLOCK_SIZE) && set_val(s, OPT_BLOCK_SIZE, "128") < 0) return -1;
    if (is_auto(s, OPT_NUM_WORKERS) && set_val(s, OPT_NUM_WORKERS, "0") < 0) return -1;
    if (is_auto(s, OPT_AUGMENT) && set_val(s, OPT_AUGMENT, "none") < 0) return -1;
    if (strcmp(sval(s, OPT_AUGMENT), "none") || *sval(s, OPT_EXCLUDE_CLASS) || *sval(s, OPT_INDEX_CSV))
        return usage_error("--augment, --exclude-class and --index-csv apply to images, not to --model gpt's tokens");
    const int64_t T = ival(s, OPT_BLOCK_SIZE);
    const double vs = rval(s, OPT_VAL_SPLIT);
    if (!(vs < 1)) return usage_error("--model gpt holds out the tail of --data for validation: --val-split must be below 1");
    d->train = ampc_dataset_tokens_open(path, &(ampc_tokens_options){.block_size = T, .begin = 0, .end = 1 - vs});
    if (!d->train) return fail_lib("--data");
    d->val = ampc_dataset_tokens_open(path, &(ampc_tokens_options){.block_size = T, .begin = 1 - vs, .end = 1});
    if (!d->val) return fail_lib("--data (its held-out tail, --val-split)");
    d->num_classes = ampc_dataset_num_classes(d->train);
    d->text = d->num_classes == 256;
    d->block = T;
    d->c = d->h = 1;
    d->w = T;
    snprintf(d->desc, sizeof d->desc, "%s (%s, vocabulary %" PRId64 ")", path, d->text ? "text read as bytes" : "llm.c tokens",
             d->num_classes);
    d->val_name = "held-out tail";
    d->full_train = ampc_dataset_size(d->train);
    d->full_val = ampc_dataset_size(d->val);
    if (!(d->train = first_n(d->train, ival(s, OPT_LIMIT_TRAIN)))) return -1;
    if (!(d->val = first_n(d->val, ival(s, OPT_LIMIT_VAL)))) return -1;
    return unigram_baseline(d);
}

int data_open(settings *s, data *d) {
    memset(d, 0, sizeof *d);
    const char *model = sval(s, OPT_MODEL);
    if (!strcmp(model, "gpt")) return data_open_tokens(s, d);
    bool resnet = strncmp(model, "resnet", 6) == 0;
    const char *path = sval(s, OPT_DATA);
    const char *dir = path;
    bool fashion = false;
    if (!*path) {
        dir = ampc_fashion_mnist_dir();
        if (!dir)
            return fail("Fashion-MNIST not found: install Debian's dataset-fashion-mnist (scripts/install-deps.sh), "
                        "set AMPC_FASHION_MNIST_DIR, or give --data DIR");
        fashion = true;
    } else {
        struct stat st;
        if (stat(path, &st) != 0) return fail("--data '%s': %s", path, strerror(errno));
        if (!S_ISDIR(st.st_mode))
            return fail("--data '%s' is not a folder (expected IDX files or one subfolder of images per class)", path);
    }
    bool idx = fashion || has_idx(dir, "train");
    d->folder = !idx;
    if (is_auto(s, OPT_NUM_WORKERS) && set_val(s, OPT_NUM_WORKERS, idx ? "0" : "2") < 0) return -1;
    if (is_auto(s, OPT_IMAGE_SIZE) && set_val(s, OPT_IMAGE_SIZE, idx || !resnet ? "28" : "64") < 0) return -1;
    if (is_auto(s, OPT_AUGMENT) && set_val(s, OPT_AUGMENT, idx ? "none" : "flip") < 0) return -1;
    if (idx && *sval(s, OPT_EXCLUDE_CLASS))
        return usage_error("--exclude-class applies to image folders; --data '%s' holds IDX files", dir);
    int64_t size = ival(s, OPT_IMAGE_SIZE);
    uint64_t seed = (uint64_t)ival(s, OPT_SEED);
    d->tf_train = ampc_transforms_new();
    d->tf_val = ampc_transforms_new();
    if (!d->tf_train || !d->tf_val) return fail_lib("transforms");

    ampc_dataset *all = NULL;
    if (idx) {
        if (fashion) {
            d->train = ampc_dataset_fashion_mnist_open(dir, true);
            snprintf(d->desc, sizeof d->desc, "Fashion-MNIST (%s)", dir);
        } else {
            d->train = ampc_dataset_mnist_open(dir, true);
            snprintf(d->desc, sizeof d->desc, "IDX files in %s", dir);
        }
        if (!d->train) return fail_lib("--data");
        if (fashion || has_idx(dir, "t10k")) {
            d->val = fashion ? ampc_dataset_fashion_mnist_open(dir, false) : ampc_dataset_mnist_open(dir, false);
            if (!d->val) return fail_lib("--data");
            d->val_name = "t10k test set";
        } else {
            all = d->train;
            d->train = NULL;
        }
        bool fashion_names = fashion || (ampc_dataset_class_name(d->train ? d->train : all, 0) != NULL);
        float mean = fashion_names ? FASHION_MEAN : MNIST_MEAN, sd = fashion_names ? FASHION_STD : MNIST_STD;
        for (int k = 0; k < 2; k++) {
            ampc_transforms *t = k ? d->tf_val : d->tf_train;
            if ((size != 28 && ampc_transforms_add_resize(t, size, size) < 0) || (k == 0 && add_augmentation(s, t) < 0) ||
                ampc_transforms_add_normalize(t, 1, &mean, &sd) < 0)
                return fail_lib("transforms");
        }
    } else {
        ampc_folder_options fo = {.height = size, .width = size, .channels = 3,
                                  .index_csv = *sval(s, OPT_INDEX_CSV) ? sval(s, OPT_INDEX_CSV) : NULL,
                                  .exclude_classes = *sval(s, OPT_EXCLUDE_CLASS) ? sval(s, OPT_EXCLUDE_CLASS) : NULL};
        all = ampc_dataset_folder_open(dir, &fo);
        if (!all) return fail_lib("--data");
        int64_t skipped = ampc_dataset_folder_skipped(all), excluded = ampc_dataset_folder_excluded(all);
        char extra[160] = "";
        int n = 0;
        if (excluded) n = snprintf(extra, sizeof extra, "; %" PRId64 " left out by --exclude-class", excluded);
        if (skipped && n >= 0 && (size_t)n < sizeof extra)
            snprintf(extra + n, sizeof extra - (size_t)n, "; skipped %" PRId64 " file(s) that are not readable images", skipped);
        snprintf(d->desc, sizeof d->desc, "image folder %s (%" PRId64 " classes%s)", dir, ampc_dataset_num_classes(all), extra);
        /* torchvision's usual recipe: augmentation for training, ImageNet normalisation */
        if (add_augmentation(s, d->tf_train) < 0 || ampc_transforms_add_normalize(d->tf_train, 3, IMAGENET_MEAN, IMAGENET_STD) < 0 ||
            ampc_transforms_add_normalize(d->tf_val, 3, IMAGENET_MEAN, IMAGENET_STD) < 0)
            return fail_lib("transforms");
    }
    if (all) {   /* no test set: a reproducible split keyed by --seed */
        int rc = ampc_dataset_split(all, rval(s, OPT_VAL_SPLIT), seed, &d->train, &d->val);
        d->num_classes = ampc_dataset_num_classes(all);
        ampc_dataset_free(all);
        if (rc < 0) return fail_lib("--val-split");
        d->val_name = "held-out split";
        if (ampc_dataset_size(d->val) == 0 || ampc_dataset_size(d->train) == 0)
            return fail("--data '%s': %" PRId64 " samples are too few for --val-split %s", dir,
                        ampc_dataset_size(d->val) + ampc_dataset_size(d->train), sval(s, OPT_VAL_SPLIT));
    } else {
        d->num_classes = ampc_dataset_num_classes(d->train);
    }
    d->full_train = ampc_dataset_size(d->train);
    d->full_val = ampc_dataset_size(d->val);
    if (!(d->train = first_n(d->train, ival(s, OPT_LIMIT_TRAIN)))) return -1;
    if (!(d->val = first_n(d->val, ival(s, OPT_LIMIT_VAL)))) return -1;
    int64_t c, h, w;
    ampc_dataset_sample_shape(d->train, &c, &h, &w);
    if (ampc_transforms_output_shape(d->tf_train, c, h, w, &d->c, &d->h, &d->w) < 0) return fail_lib("transforms");
    /* every split must give the model the same images: a mismatch found now, not after an epoch */
    int64_t vc, vh, vw;
    ampc_dataset_sample_shape(d->val, &c, &h, &w);
    if (ampc_transforms_output_shape(d->tf_val, c, h, w, &vc, &vh, &vw) < 0) return fail_lib("transforms");
    if (vc != d->c || vh != d->h || vw != d->w)
        return fail("--data '%s': the validation images (%s) are %" PRId64 "x%" PRId64 "x%" PRId64 " but the training images are %" PRId64
                    "x%" PRId64 "x%" PRId64 " (channels x height x width); give both splits one shape, or --image-size to resize both",
                    dir, d->val_name, vc, vh, vw, d->c, d->h, d->w);
    if (!resnet && (d->h != 28 || d->w != 28))
        return fail("--model %s needs 28x28 images, not %" PRId64 "x%" PRId64 " (--image-size 28)", model, d->h, d->w);
    if (d->num_classes < 2) return fail("--data: %" PRId64 " class(es); a classifier needs at least 2", d->num_classes);
    return 0;
}
