/*
 * tbevents.h - TensorBoard event files: scalars as TensorBoard's Event protocol buffers (a subset
 * of its event.proto and summary.proto in tools/tensorboard/, packed by protobuf-c) in TFRecord
 * framing, so `tensorboard --logdir runs` shows them. Not part of libampc: only ampc-train writes
 * them, so only it links protobuf-c and ISA-L (whose crc32_iscsi is the CRC32C TFRecord needs).
 *
 *     char err[512];
 *     tb_writer *w = tb_writer_open("runs/latest", err, sizeof err);   // NULL: err says why
 *     static const char *const tags[] = {"train/loss", "train/lr"};
 *     double values[] = {0.51, 1e-3};
 *     if (tb_writer_scalars(w, step, 2, tags, values) < 0) ... tb_writer_error(w) ...
 *     tb_writer_close(w);   // flushes; -1 if a write failed
 *
 * A record is: uint64 little-endian length n, uint32 masked CRC32C of those 8 bytes, the n bytes
 * of a serialized Event, uint32 masked CRC32C of them (mask: ((crc >> 15) | (crc << 17)) +
 * 0xa282ead8, all little-endian). The file's first record is Event{wall_time, file_version:
 * "brain.Event:2"}, as TensorFlow's and PyTorch's writers start theirs.
 */
#ifndef AMPC_TOOLS_TBEVENTS_H
#define AMPC_TOOLS_TBEVENTS_H

#include <stddef.h>
#include <stdint.h>

#define TB_MAX_VALUES 16          /* scalars in one tb_writer_scalars call */
#define TB_FLUSH_SECONDS 5.0      /* a write this long after the last flush flushes */

typedef struct tb_writer tb_writer;

/* CRC-32C (Castagnoli) of n bytes: "123456789" -> 0xE3069283. */
uint32_t tb_crc32c(const void *data, size_t n);
/* TFRecord's masked form of a CRC, stored in the file. */
uint32_t tb_crc_mask(uint32_t crc);

/* Creates dir/events.out.tfevents.<unix seconds>.<hostname>.<pid>.0 (TensorBoard's name; the
   seconds made later than those of any event file already in dir, since TensorBoard reads a run's
   files in name order) and writes its first record. The folder must exist; a file already at that
   name is refused, never followed or truncated. NULL on failure, with the reason in err (errn
   bytes). The caller owns the writer: tb_writer_close. */
tb_writer *tb_writer_open(const char *dir, char *err, size_t errn);
/* The file's path (owned by w). */
const char *tb_writer_path(const tb_writer *w);
/* The first error of w ("" while none): once a write failed, every call returns -1 and writes nothing. */
const char *tb_writer_error(const tb_writer *w);

/* Event{step, session_log: START}: TensorBoard drops the events of earlier files in the run with
   step >= step (a restarted job's orphans; PyTorch SummaryWriter's purge_step). 0 or -1. */
int tb_writer_session_start(tb_writer *w, int64_t step);
/* One Event{wall_time, step, summary} holding n (at most TB_MAX_VALUES) scalars tags[i] =
   values[i], stored as float (simple_value). Buffered: the file gets it at the next flush, which
   happens here once TB_FLUSH_SECONDS have passed since the last. No allocation once the packing
   buffer has grown to the largest event. 0 or -1 (a tag list too long, a write error). */
int tb_writer_scalars(tb_writer *w, int64_t step, int n, const char *const *tags, const double *values);
/* Everything written so far to the file (fflush). 0 or -1. */
int tb_writer_flush(tb_writer *w);
/* Flushes, closes and frees w (NULL: nothing). 0, or -1 if a write or the close failed: the message
   (err, errn bytes, may be NULL) names the file. */
int tb_writer_close(tb_writer *w, char *err, size_t errn);

#endif /* AMPC_TOOLS_TBEVENTS_H */
