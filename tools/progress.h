/*
 * progress.h - progress report for a loop of known length: a tqdm-style bar redrawn in place on
 * a terminal, or plain lines every 10% when the output is a file or a pipe (CI logs, mpirun).
 *
 *     progress p;
 *     progress_begin(&p, "epoch 1/3 train", n_batches, 0);
 *     for (b = 0; b < n_batches; b++) { ...; progress_update(&p, b + 1, "loss=%.4f", loss); }
 *     progress_end(&p);
 */
#ifndef AMPC_TOOLS_PROGRESS_H
#define AMPC_TOOLS_PROGRESS_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

typedef enum {
    PROGRESS_AUTO = 0,   /* a bar if stdout is a terminal, else lines */
    PROGRESS_BAR,        /* a bar on whichever of stderr and stdout is a terminal; lines if neither is */
    PROGRESS_LINES,
    PROGRESS_OFF,
} progress_mode;

typedef struct {
    progress_mode mode;   /* resolved: BAR, LINES or OFF */
    FILE *out;            /* where the bar or the lines go */
    char label[64];
    int64_t total, done;
    int64_t initial;      /* done before this process began the loop (a resumed epoch) */
    double t0, last_draw;
    int last_decile;      /* LINES: the last 10% step printed */
    bool utf8;            /* draw the bar with block characters */
    char postfix[128];
} progress;

/* Seconds from a monotonic clock. */
double progress_now(void);
/* The mode PROGRESS_AUTO resolves to in this process (terminal or not). */
progress_mode progress_detect(void);
/* Sets the mode every later progress_begin uses (default PROGRESS_AUTO). */
void progress_set_mode(progress_mode mode);
/* initial of total were done before (a resumed epoch): the bar starts there, and the rate and the
   time left count only the steps this process takes (tqdm's initial=). */
void progress_begin(progress *p, const char *label, int64_t total, int64_t initial);
/* done of total finished; postfix (printf format, may be NULL) shows after the rate. */
void progress_update(progress *p, int64_t done, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Draws the final state and ends the line (the bar stays on screen, as tqdm leaves it). */
void progress_end(progress *p);
/* "1:02:03" or "02:03" for seconds >= 0; "?" for a negative or non-finite value. */
const char *progress_format_time(double seconds, char *buf, size_t n);

#endif /* AMPC_TOOLS_PROGRESS_H */
