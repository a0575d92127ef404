/*
 * size.h - sizes on the programs' command lines (ampc-train --max-memory, ampc-bench --max-memory).
 */
#ifndef AMPC_TOOLS_SIZE_H
#define AMPC_TOOLS_SIZE_H

#include <stdbool.h>

/* "512M" -> bytes; K, M, G, T (either case, optionally followed by "iB" or "B") are powers of
   1024; a plain number (or with "B") is bytes. False for anything else, negative or >= 9e18. */
bool tool_parse_size(const char *s, double *bytes);

#endif /* AMPC_TOOLS_SIZE_H */
