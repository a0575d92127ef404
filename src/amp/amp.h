/*
 * amp.h - internal hooks of the AMP layer for other parts of the library (checkpoints save and
 * restore the grad scaler's state through these).
 */
#ifndef AMPC_AMP_H
#define AMPC_AMP_H

#include "core/core.h"

/* The scaler's state as doubles (exact: a float scale and counts below 2^53), in this order. */
enum {
    AMPC_SCALER_STATE_ENABLED = 0,     /* 1 or 0 */
    AMPC_SCALER_STATE_SCALE,           /* the float scale */
    AMPC_SCALER_STATE_GROWTH_TRACKER,  /* consecutive unskipped updates */
    AMPC_SCALER_STATE_HYSTERESIS,      /* overflows still absorbed before a backoff */
    AMPC_SCALER_STATE_APPLIED,         /* optimizer steps applied */
    AMPC_SCALER_STATE_SKIPPED,         /* optimizer steps skipped */
    /* the options GradScaler.state_dict holds; NaN on import: absent (an older checkpoint),
       the scaler keeps its own */
    AMPC_SCALER_STATE_GROWTH_FACTOR,
    AMPC_SCALER_STATE_BACKOFF_FACTOR,
    AMPC_SCALER_STATE_GROWTH_INTERVAL,
    AMPC_SCALER_STATE_COUNT
};

/* AMPC_OK for NULL or a live scaler; a freed one records AMPC_ERR_STATE naming call. */
int ampc__scaler_check(const ampc_scaler *s, const char *call);
/* Writes the state into v[0..AMPC_SCALER_STATE_COUNT); returns the count or a negative status
   when n is too small. */
int ampc__scaler_export(const ampc_scaler *s, double *v, int n);
/* Validates v (as exported; the enabled entry is not restored) and, unless dry_run, sets the
   state from it: the growth and backoff factors and the growth interval (when present), the
   tracker and hysteresis counter clamped to the growth interval and hysteresis then in force,
   and every optimizer is READY again (as after update()).
   Returns 0 or a negative status with nothing changed. */
int ampc__scaler_import(ampc_scaler *s, const double *v, int n, bool dry_run);

/* The policy autocast applies to op now: the table's for dt, but fp32 where the table says lower
   precision inside a module named by ampc_autocast_fp32_modules. */
ampc_policy ampc__autocast_policy(ampc_op op, ampc_dtype dt);

#endif /* AMPC_AMP_H */
