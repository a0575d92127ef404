/*
 * plot.h - training curves as PNG files for ampc-train, drawn with cairo (headless: no display,
 * no X server). Not part of libampc: only this tool draws, so only it links cairo.
 *
 *     plot_series s[2] = {{"train", epochs, train_loss, n}, {"validation", epochs, val_loss, n}};
 *     if (plot_curves("run/loss.png", "loss", "epoch", "cross-entropy loss", s, 2) < 0)
 *         ... ampc_last_error() says why ...
 *
 *     plot_series st = {"loss", steps, step_loss, n_steps};     // panels stacked top to bottom
 *     plot_panel p[2] = {{"per step", "optimizer step", "loss", &st, 1, true},   // log10 y axis
 *                        {"per epoch", "epoch", "loss", s, 2, false}};
 *     plot_figure("run/steps.png", "mlp on Fashion-MNIST (AMP bf16)", p, 2);   // 800 x 1000
 */
#ifndef AMPC_TOOLS_PLOT_H
#define AMPC_TOOLS_PLOT_H

#include <stdbool.h>

typedef struct {
    const char *name;       /* legend entry; NULL or "": not in the legend */
    const double *x, *y;    /* n points; non-finite points are skipped (the line breaks there) */
    int n;
    bool points_only;       /* markers at every point, no line (e.g. the events on a curve) */
} plot_series;

typedef struct {
    const char *title, *xlabel, *ylabel;   /* each may be NULL: not drawn */
    const plot_series *series;             /* n_series >= 1 curves, coloured by matplotlib's tab10 in order */
    int n_series;
    bool log_y;   /* log10 y axis over the positive points (the others are skipped like non-finite ones) */
} plot_panel;

#define PLOT_MAX_PANELS 16

/* n_panels (1..PLOT_MAX_PANELS) panels stacked vertically under an optional figure title, as an
   800 x (600 + 400 (n_panels - 1)) PNG written to png_path atomically (via "<png_path>.tmp.<pid>",
   renamed when complete). Each panel: grid, ticks at 1-2-5 steps (powers of ten, or 1-2-5
   times them, on a log axis), each series a line with markers (at most ~60, the last point
   always) or markers only, axes ranged over the finite points (a single point or a constant
   series gets a padded range), a legend in the corner with the fewest points. Nothing is kept:
   the caller's arrays are only read. Thread-safe (figures draw concurrently). Returns 0 or a
   negative ampc status, with the message in ampc_last_error(): AMPC_ERR_INVALID (bad arguments;
   nothing written), AMPC_ERR_IO (the file can't be written; no temporary file is left),
   AMPC_ERR_OOM, AMPC_ERR_BACKEND (cairo failed). */
int plot_figure(const char *png_path, const char *title, const plot_panel *panels, int n_panels);

/* One panel titled title, 800x600: plot_figure with one panel (linear axes) and no figure title. */
int plot_curves(const char *png_path, const char *title, const char *xlabel, const char *ylabel,
                const plot_series *series, int n_series);

#endif /* AMPC_TOOLS_PLOT_H */
