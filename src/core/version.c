/*
 * version.c - ampc_version(): the version CMake wrote into ampc/version.h (build tree).
 */
#include "ampc.h"
#include "ampc/version.h"

const char *ampc_version(void) { return AMPC_VERSION_STRING; }
