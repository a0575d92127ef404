/*
 * plot.h - training curves as PNG files (PLplot, pngcairo device, headless) for ampc-train.
 * Not part of libampc: only this tool draws, so only it links PLplot.
 *
 *     plot_series s[2] = {{"train", epochs, train_loss, n}, {"validation", epochs, val_loss, n}};
 *     if (plot_curves("run/loss.png", "loss", "epoch", "cross-entropy loss", s, 2) < 0)
 *         ... ampc_last_error() says why ...
 */
#ifndef AMPC_TOOLS_PLOT_H
#define AMPC_TOOLS_PLOT_H

#include <stdbool.h>

typedef struct {
    const char *name;       /* legend entry */
    const double *x, *y;    /* n points; non-finite points are skipped (the line breaks there) */
    int n;
    bool points_only;       /* markers at every point, no line (e.g. the events on a curve) */
} plot_series;

/* Line plot with markers of n_series curves with title, axis labels and a legend, axes ranged
   over the finite points (a single point or a constant series gets a padded range), written
   as an 800x600 PNG to png_path (atomically, via a temporary file). Thread-safe (PLplot is
   serialized by a lock). Returns 0 or a negative ampc status, with the message in
   ampc_last_error() (AMPC_ERR_IO: the file can't be written; AMPC_ERR_UNSUPPORTED: PLplot's
   pngcairo driver is not installed). */
int plot_curves(const char *png_path, const char *title, const char *xlabel, const char *ylabel,
                const plot_series *series, int n_series);

#endif /* AMPC_TOOLS_PLOT_H */
