/*
 * error.c - status codes, thread-local last-error message.
 */
#include "core/core.h"

#include <stdarg.h>
#include <string.h>

static _Thread_local char last_msg[512];
static _Thread_local int last_status;

const char *ampc_strerror(int status) {
    switch (status) {
#define AMPC_X_CASE(name, value, text) case value: return text;
        AMPC_STATUS_LIST(AMPC_X_CASE)
#undef AMPC_X_CASE
    }
    return "unknown status";
}

const char *ampc_last_error(void) { return last_status ? last_msg : ""; }
int ampc_last_status(void) { return last_status; }
void ampc_clear_error(void) { last_status = 0; last_msg[0] = 0; }

static void set_msg(int status, const char *fmt, va_list ap) {
    int n = snprintf(last_msg, sizeof last_msg, "%s: ", ampc_strerror(status));
    if (n < 0) n = 0;
    if ((size_t)n < sizeof last_msg) vsnprintf(last_msg + n, sizeof last_msg - (size_t)n, fmt, ap);
    last_status = status;
}

int ampc__err(int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    set_msg(status, fmt, ap);
    va_end(ap);
    return status;
}

void *ampc__err_null(int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    set_msg(status, fmt, ap);
    va_end(ap);
    return NULL;
}

int ampc__check_handle(const void *h, uint64_t gen, const char *call, const char *what, const char *why) {
    if (h && gen) return AMPC_OK;
    if (h) return ampc__err(AMPC_ERR_STATE, "%s: %s handle is stale (%s)", call, what, why);
    if (!last_status) ampc__err(AMPC_ERR_INVALID, "%s: %s is NULL", call, what);
    return last_status;
}
