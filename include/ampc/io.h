/*
 * ampc/io.h - checkpoints (safetensors) and metrics logs (included by ampc.h).
 *
 * Resuming a run, as PyTorch's torch.save/torch.load of model, optimizer and scaler state:
 *
 *     const char *kv[] = {"epoch", "3", "best_acc", "0.91", NULL};
 *     if (ampc_checkpoint_save("run/last.safetensors", net, opt, scaler, kv) < 0) fail(...);
 *     ...
 *     char *meta = NULL, epoch[32];
 *     if (ampc_checkpoint_load("run/last.safetensors", net, opt, scaler, &meta) < 0) fail(...);
 *     ampc_checkpoint_meta_get(meta, "epoch", epoch, sizeof epoch);
 *     free(meta);
 *
 * The file is a plain safetensors file: the model's tensors under their state_dict names
 * ("conv1.weight", "bn1.running_mean"), so `safetensors.torch.load_file` reads them in PyTorch;
 * a checkpoint with optimizer state also holds the "optimizer.*" tensors below, so
 * `load_state_dict(strict=True)` takes the weights-only file (ampc_checkpoint_save with opt NULL,
 * ampc-train's model.safetensors) and not a training checkpoint as it is. Optimizer state is stored as extra tensors
 * "optimizer.<param name>.<momentum_buffer|exp_avg|exp_avg_sq|max_exp_avg_sq>"; step counts,
 * the learning rate, the scaler, the RNG and the caller's key/values are strings in the header's
 * "__metadata__" (keys "format", "ampc.*", "optimizer.*", "scaler.*" and "rng.*" are reserved).
 * ampc_checkpoint_list lists the tensors of any safetensors file (name, dtype, shape, offset).
 */
#ifndef AMPC_IO_H
#define AMPC_IO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ampc_module ampc_module;
typedef struct ampc_optimizer ampc_optimizer;
typedef struct ampc_scaler ampc_scaler;

// ---------------------------------------------------------------------------------------------
// Checkpoints

/* Writes m's state_dict, and when given opt's state (per-parameter buffers, step counts, lr)
   and s's state (scale, growth tracker, hysteresis counter, applied/skipped counts), the global
   RNG state, and meta_kv: "key", "value" pairs ending with NULL (NULL: none). Atomic: the file
   is written to "<path>.tmp.<pid>", fsync'ed and renamed over path (then the directory is
   fsync'ed); on failure the temporary file is removed and an existing file at path is left as
   it was. Returns 0 or a negative status. */
int ampc_checkpoint_save(const char *path, ampc_module *m, ampc_optimizer *opt, ampc_scaler *s,
                         const char *const *meta_kv);

/* Restores what ampc_checkpoint_save wrote, bit for bit. The whole file is validated first
   (safetensors structure, every model tensor present with m's dtype and shape, no unexpected
   model tensor, optimizer kind, scaler state; every value in range; for a parameter that has
   taken steps, each state tensor opt's settings use): on any error nothing is changed (model,
   optimizer, scaler, RNG) and the message names the problem (the key and both shapes for a
   different model). opt NULL: optimizer entries in the file are ignored (weights only); with
   opt the RNG state is restored too (a resumed run replays the same random numbers). s NULL or
   disabled: scaler entries are ignored; an enabled s needs scaler state in the file.
   meta_json_out (NULL ok) receives a malloc'd copy of the "__metadata__" JSON object ("{}" when
   there is none); the caller frees it. */
int ampc_checkpoint_load(const char *path, ampc_module *m, ampc_optimizer *opt, ampc_scaler *s,
                         char **meta_json_out);

/* What ampc_load_state_dict matched: tensors loaded, the model's that the file lacks (missing),
   the file's that the model lacks (unexpected; an ampc checkpoint's optimizer.* tensors are not
   counted), and those present in both with another shape (mismatched). */
typedef struct {
    int loaded, missing, unexpected, mismatched;
} ampc_load_report;

/* Loads model weights from a safetensors state_dict (written by ampc, or converted from a
   PyTorch .pth with scripts/pth_to_safetensors.py: torchvision's names), as PyTorch's
   load_state_dict. Floating-point tensors are converted to the model's dtype (copy_ casts);
   integer ones (num_batches_tracked) must match. strict: any missing, unexpected or mismatched
   tensor is an error and nothing is loaded; not strict: what matches in name and shape is
   loaded and the rest of the model keeps its values (a classifier head of another size stays
   new; PyTorch would refuse the size mismatch). Each missing, unexpected and mismatched name is
   written to report (NULL: none) as "missing: NAME SHAPE", "unexpected: NAME SHAPE",
   "mismatched: NAME: SHAPE in the file, SHAPE in the model"; *out (NULL ok) gets the counts.
   The whole file is validated and converted before the model changes. Returns 0 or a negative
   status. */
int ampc_load_state_dict(const char *path, ampc_module *m, bool strict, FILE *report, ampc_load_report *out);

/* Only the metadata of a checkpoint (validated like a load, nothing restored): a malloc'd JSON
   object in *meta_json_out, as ampc_checkpoint_load gives it. */
int ampc_checkpoint_read_meta(const char *path, char **meta_json_out);
/* Removes the temporaries ("<path>.tmp.<pid>") that writers of path killed mid-save left behind
   (those of live processes stay); ampc_checkpoint_save does it too. Returns how many. */
int ampc_checkpoint_remove_stale_temps(const char *path);

/* Value of key in a metadata JSON object (from load/read_meta) into buf (NUL-terminated,
   truncated to n-1 bytes). Returns the value's full length in bytes (>= n: truncated), or
   AMPC_ERR_INVALID when the key is absent, AMPC_ERR_FORMAT when meta_json is malformed (not an
   object of string values, or a key given twice). Linear in the text's size: one parse of the
   whole text and one hash lookup. */
int ampc_checkpoint_meta_get(const char *meta_json, const char *key, char *buf, size_t n);

/* A metadata JSON object parsed once, for many lookups (meta_get parses the whole text per
   call). Checked as meta_get checks it; NULL + error (AMPC_ERR_FORMAT) when malformed. The
   caller frees it with ampc_checkpoint_meta_free (NULL ok). */
typedef struct ampc_checkpoint_meta ampc_checkpoint_meta;
ampc_checkpoint_meta *ampc_checkpoint_meta_parse(const char *meta_json);
/* The value of key (a hash lookup), owned by m and valid until it is freed; NULL when absent. */
const char *ampc_checkpoint_meta_find(const ampc_checkpoint_meta *m, const char *key);
void ampc_checkpoint_meta_free(ampc_checkpoint_meta *m);

/* One tensor of a safetensors file, as ampc_checkpoint_list gives it. */
typedef struct {
    const char *name;      /* in the list's own allocation */
    const char *dtype;     /* the safetensors dtype: "F32", "F16", "BF16", "F64", "I64", "U8", ... */
    int ampc_dtype;        /* the same as an ampc_dtype, or -1 where ampc has none ("U8", "I32", ...) */
    int ndim;
    int64_t shape[8];      /* AMPC_MAX_DIMS; the first ndim count */
    uint64_t offset;       /* where its bytes start in the file */
    uint64_t nbytes;
} ampc_checkpoint_tensor;

/* Lists the tensors of the safetensors file at path (any safetensors file, validated as by a
   load; the metadata is read_meta's), sorted by name (strcmp). *out receives one malloc'd array,
   names included, that the caller frees with free() (NULL when there are none or on error).
   Returns the number of tensors or a negative status. */
int ampc_checkpoint_list(const char *path, ampc_checkpoint_tensor **out);

/* Are the tensors of two checkpoints (weights, buffers, optimizer state; by name, dtype, shape
   and bytes) identical? Both files are validated as by a load; the metadata is not compared.
   Writes to report (NULL: nothing) one line per differing tensor ("differ: tensor 'x': ...", the
   first 20; a floating-point one ends ", max |a-b| D (relative R)", R = D / max |a|), then "checkpoints differ: N tensor(s)" or "identical: N tensors, B bytes of tensor
   data". Returns 0 identical, 1 different, or a negative status (a file missing or invalid);
   nothing is retained after the call. */
int ampc_checkpoint_compare(const char *path_a, const char *path_b, FILE *report);

/* Can text be stored in a checkpoint's metadata (valid UTF-8, as safetensors' JSON header needs)? */
bool ampc_checkpoint_meta_text_valid(const char *text);

// ---------------------------------------------------------------------------------------------
// Output files: a run's outputs go into a folder others may write to

/* Opens path as fopen(path, mode) would ("r", "r+", "w", "w+", "a", "a+", an 'x' for O_EXCL),
   but never blocks and never follows a symbolic link: what is there and is not a regular file
   (a FIFO, a device, a directory, a link) is refused at once, "<what>: '<path>' is a FIFO (named
   pipe), not a regular file", and "w" truncates only a regular file. The caller fcloses the FILE;
   NULL + error on failure. */
FILE *ampc_output_fopen(const char *path, const char *what, const char *mode);

// ---------------------------------------------------------------------------------------------
// Metrics log: a CSV file with a header line and one row per call, flushed per row.

typedef struct ampc_metrics ampc_metrics;

/* Opens csv_path for n columns (names copied; quoted as CSV needs). append=false truncates and
   writes the header; append=true (a resumed run) keeps existing rows after checking that the
   file's header is exactly this one (a missing or empty file gets the header), and drops an
   incomplete last line left by a crash. NULL + error on failure. */
ampc_metrics *ampc_metrics_open(const char *csv_path, const char *const *columns, int n, bool append);
/* One row of n values (shortest text that reads back to the same double; "nan", "inf",
   "-inf"), written and flushed. Returns 0 or a negative status. */
int ampc_metrics_row(ampc_metrics *m, const double *values);
int ampc_metrics_num_columns(const ampc_metrics *m);
/* Closes the file; returns a negative status if a buffered write failed (NULL: 0). */
int ampc_metrics_close(ampc_metrics *m);

#ifdef __cplusplus
}
#endif

#endif /* AMPC_IO_H */
