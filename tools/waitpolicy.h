/*
 * waitpolicy.h - the OpenMP wait policy of ampc's programs (ampc-train, ampc-bench).
 *
 * libgomp's idle threads spin for a while (300,000 rounds, about a millisecond) before they
 * sleep. On a machine whose cores are taken by other processes that spinning competes with them
 * and every parallel region waits for a descheduled peer: ampc's step grew 3.9-4.8x with 3 busy
 * loops on 2 cores against PyTorch's 2.6-4.5x; with a spin of 10,000 rounds 2.4-3.3x, at no
 * measurable cost on a quiet machine (bench/RESULTS.md, "Under load"). libgomp reads
 * GOMP_SPINCOUNT and OMP_WAIT_POLICY once, when it is loaded, before main runs; so when the user
 * set neither, the program sets GOMP_SPINCOUNT=10000 and executes itself again (same pid, same
 * arguments: mpirun sees one process). AMPC_KEEP_WAIT_POLICY=1 keeps libgomp's default.
 */
#ifndef AMPC_TOOLS_WAITPOLICY_H
#define AMPC_TOOLS_WAITPOLICY_H

/* Call first in main (before MPI or any thread starts). Returns only when no re-execution is
   due or it failed (then the default policy stays). */
void ampc_tool_wait_policy(char **argv);
/* "GOMP_SPINCOUNT=10000 (ampc's default)", "OMP_WAIT_POLICY=passive (set by the user)", ... */
const char *ampc_tool_wait_policy_desc(void);

#endif /* AMPC_TOOLS_WAITPOLICY_H */
