/*
 * ampc/dist.h - data-parallel training across processes and machines (PyTorch's
 * DistributedDataParallel), on MPI.
 *
 * ampc starts no process and opens no connection: a launcher does (Open MPI's `mpirun -np 4
 * prog`, with a hostfile for several machines, or Slurm's srun), and MPI carries the bytes.
 * Every process runs the same program on its own shard of the data:
 *
 *     ampc_dist_init(&argc, &argv);                       // or ampc_dist_adopt(&my_comm)
 *     ampc_module *model = ampc_model_new("resnet18", &mo);
 *     ampc_ddp *ddp = ampc_ddp_new(model, NULL);          // rank 0's weights everywhere
 *     ... loader with .shard_rank = ampc_dist_rank(), .shard_count = ampc_dist_world_size()
 *     for each batch:
 *         loss = ...forward...;
 *         ampc_backward(ampc_scaler_scale(scaler, loss)); // gradients averaged over ranks
 *         ampc_scaler_step(scaler, opt); ampc_scaler_update(scaler);
 *     ampc_ddp_free(ddp); ampc_dist_finalize();
 *
 * Without a launcher the same program is one process of a world of one: ampc_dist_init then
 * reports rank 0 of 1 and every collective returns at once.
 */
#ifndef AMPC_DIST_H
#define AMPC_DIST_H

#include "ampc.h"

#ifdef __cplusplus
extern "C" {
#endif

// ---------------------------------------------------------------------------------------------
// Processes

/* Whether this build has MPI (CMake AMPC_MPI); without it ampc_dist_init fails when launched by
   mpirun, and works as a world of one process otherwise. */
bool ampc_dist_available(void);
/* Whether a launcher started this process as one of several (Open MPI, PMIx, PMI or Slurm set
   the rank in the environment). ampc-train initialises MPI only then. */
bool ampc_dist_launched(void);
/* Initialises MPI (MPI_Init_thread, MPI_THREAD_FUNNELED: ampc calls MPI from the thread that
   called this), unless the program already did, and makes MPI_COMM_WORLD ampc's world.
   argc/argv may be NULL. Calling it again is harmless. */
int ampc_dist_init(int *argc, char ***argv);
/* Makes a duplicate of the program's own communicator ampc's world (mpi_comm points to an
   MPI_Comm; MPI must be initialised with at least MPI_THREAD_FUNNELED). */
int ampc_dist_adopt(const void *mpi_comm);
/* Frees ampc's communicator; finalizes MPI when ampc_dist_init initialised it. Models wrapped
   with ampc_ddp_new must be freed first. */
int ampc_dist_finalize(void);
int ampc_dist_rank(void);         /* 0 without a world */
int ampc_dist_world_size(void);   /* 1 without a world */
/* This process's rank among the world's processes on its machine (those that can share memory
   with it, MPI_COMM_TYPE_SHARED), in world order, and their number: 0 and 1 without a world.
   Each process of a multi-GPU machine takes GPU local_rank (ampc_cuda_set_device). */
int ampc_dist_local_rank(void);
int ampc_dist_local_size(void);
/* Ends every process of the world (MPI_Abort) with exit status code; returns only without one. */
void ampc_dist_abort(int code);
/* Sums n doubles over all ranks, in place (validation totals). */
int ampc_dist_allreduce_sum_f64(double *values, int64_t n);
int ampc_dist_max_f64(double *values, int64_t n);   /* element-wise maximum, in place */
int ampc_dist_broadcast(void *buf, size_t nbytes, int root);
int ampc_dist_barrier(void);
/* The time limit of every collective (ampc's, DDP's, ZeRO's, SyncBatchNorm's), as NCCL's and
   gloo's timeouts: a collective that not every rank joins within it fails with AMPC_ERR_TIMEOUT
   naming it, and the world is then unusable: end the job (ampc_dist_abort). Default
   AMPC_DIST_DEFAULT_TIMEOUT seconds; 0: wait for ever. */
#define AMPC_DIST_DEFAULT_TIMEOUT 1800.0
int ampc_dist_set_timeout(double seconds);
double ampc_dist_get_timeout(void);

// ---------------------------------------------------------------------------------------------
// Data-parallel models

typedef struct {
    /* Gradients are all-reduced in buckets of about this many bytes (fp32), each started as soon
       as its gradients are final so that communication overlaps the rest of backward. Default
       25 MiB, and 1 MiB for the first bucket (the last layers' gradients, ready first), as
       PyTorch. */
    size_t bucket_bytes;
    size_t first_bucket_bytes;
    /* The gradients' type on the wire: AMPC_F32 (default), or AMPC_BF16 / AMPC_F16 (half the
       bytes; each addition done in f32 and rounded once; PyTorch's bf16/fp16 compression
       hooks). Gradients are divided by the world size before they are sent, as PyTorch does. */
    ampc_dtype comm_dtype;
} ampc_ddp_options;
ampc_ddp_options ampc_ddp_defaults(void);

typedef struct ampc_ddp ampc_ddp;
/* Wraps model (which stays the caller's): broadcasts its parameters and buffers from rank 0
   (collective: every rank calls it, with the same architecture; a different parameter count or
   shape on any rank is an error on every rank) and from then on averages the gradients of its
   trainable parameters across ranks inside every ampc_backward. Frozen parameters
   (requires_grad false when wrapped) are left out. NULL + error on failure. */
ampc_ddp *ampc_ddp_new(ampc_module *model, const ampc_ddp_options *opts);
void ampc_ddp_free(ampc_ddp *ddp);
/* sync false: a no-sync region (PyTorch's ddp.no_sync()): backward accumulates gradients
   locally; the first backward with sync on again averages everything accumulated. */
int ampc_ddp_set_sync(ampc_ddp *ddp, bool sync);
/* This rank has no samples in this step (the epoch's last batch is smaller than the world, as
   PyTorch's Join context manager handles): instead of a backward, it takes part in the gradient
   all-reduce with the gradients it holds (those accumulated in a no-sync region; zeros where it
   has none) and receives the averages, as the ranks that ran backward do. Collective with their
   backward. Does nothing in a no-sync region or a world of one. */
int ampc_ddp_join(ampc_ddp *ddp);
/* Copies rank 0's buffers (BatchNorm running statistics) to every rank, as PyTorch's DDP does
   before each forward (broadcast_buffers=True). Collective. */
int ampc_ddp_sync_buffers(ampc_ddp *ddp);

typedef struct {
    int64_t buckets;              /* buckets per backward */
    int64_t allreduces;           /* collectives started since ampc_ddp_new */
    int64_t started_in_backward;  /* of those, started as their last gradient became final (not by
                                     the end of backward, which starts the ones left over) */
    int64_t bytes_sent;           /* bytes reduced (per rank, wire dtype) since ampc_ddp_new */
    double exposed_seconds;       /* time backward waited for collectives after its last node */
    double copy_seconds;          /* time copying gradients into and out of the buckets */
} ampc_ddp_stats;
int ampc_ddp_get_stats(const ampc_ddp *ddp, ampc_ddp_stats *stats);

// ---------------------------------------------------------------------------------------------
// Sharded optimizer state (ZeRO stage 1, partitioned by element as DeepSpeed and llm.c)

/* Shards opt's state over the ranks (every rank calls it, after ampc_ddp_new, with the same
   optimizer settings; no communication: the partition is computed alike everywhere). The
   trainable parameters' elements, laid end to end in the optimizer's order, are cut into one
   contiguous range per rank (boundaries on 16 elements), so each rank keeps 1/world of the state
   (momentum, Adam's moments) whatever the tensors' sizes, a tensor across a boundary in parts.
   Each rank steps its range only; after every step (ampc_optimizer_step or the GradScaler's)
   each rank's part of every updated parameter is broadcast from it, so every rank holds the same
   weights, bit for bit those of unsharded training. Gradients stay whole on every rank (DDP's
   all-reduce). Parameters on any one device (a GPU's parts go through host memory where MPI
   cannot read it). Whole state present (a checkpoint loaded before, or
   rank 0's after ampc_zero_consolidate) is cut down to this rank's part; calling it again after
   a consolidate re-shards the same way. *bytes_here and *bytes_all (may be NULL): the state
   bytes this rank will hold and all ranks together. A sharded optimizer's state is not saved
   (consolidate first) nor loaded into (load before sharding). */
int ampc_zero_shard(ampc_optimizer *opt, int64_t *bytes_here, int64_t *bytes_all);
/* Gathers the whole optimizer state on rank 0, as PyTorch's consolidate_state_dict(to=0), for
   a checkpoint that any number of ranks can resume (the step counts agree on every rank).
   Collective. Rank 0 then holds the unsharded state until ampc_zero_shard is called again. */
int ampc_zero_consolidate(ampc_optimizer *opt);

#ifdef __cplusplus
}
#endif
#endif /* AMPC_DIST_H */
