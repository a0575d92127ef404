/*
 * patterns.c - comma-separated name patterns (--exclude-class, --fp32-modules), split once here.
 */
#include "core/core.h"

#include <stdlib.h>
#include <string.h>

void ampc__patterns_free(ampc_patterns *p) {
    for (int k = 0; k < p->n; k++) free(p->pat[k]);
    p->n = 0;
}

int ampc__patterns_parse(ampc_patterns *p, const char *text, int max, const char *who) {
    p->n = 0;
    if (max > AMPC_MAX_PATTERNS) max = AMPC_MAX_PATTERNS;
    for (const char *s = text; s && *s;) {
        const char *comma = strchr(s, ',');
        size_t len = comma ? (size_t)(comma - s) : strlen(s);
        int rc = len == 0   ? ampc__err(AMPC_ERR_INVALID, "%s '%s' has an empty pattern", who, text)
                 : p->n == max ? ampc__err(AMPC_ERR_INVALID, "%s '%s' has more than %d patterns", who, text, max)
                 : (p->pat[p->n] = strndup(s, len)) == NULL ? ampc__err(AMPC_ERR_OOM, "%s: out of memory", who)
                                                            : AMPC_OK;
        if (rc < 0) {
            ampc__patterns_free(p);
            return rc;
        }
        p->n++;
        if (!comma) break;
        s = comma + 1;
        if (!*s) {   /* a trailing comma: an empty last pattern */
            ampc__patterns_free(p);
            return ampc__err(AMPC_ERR_INVALID, "%s '%s' has an empty pattern", who, text);
        }
    }
    return AMPC_OK;
}
