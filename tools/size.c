/*
 * size.c - see size.h.
 */
#include "size.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

bool tool_parse_size(const char *s, double *bytes) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || errno || !isfinite(v) || v < 0) return false;
    double mul = 1;
    static const char units[] = "KMGT";
    const char *u = *end ? strchr(units, toupper((unsigned char)*end)) : NULL;
    if (u) {
        mul = pow(1024, (double)(u - units) + 1);
        end++;
        if (strcasecmp(end, "iB") == 0) end += 2;
    }
    if (strcasecmp(end, "B") == 0) end++;
    if (*end) return false;
    *bytes = floor(v * mul);
    return *bytes < 9.0e18;
}
