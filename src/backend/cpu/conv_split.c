/*
 * conv_split.c - bf16 weight gradients split over threads, one one-thread oneDNN primitive per
 * slice of the work.
 *
 * oneDNN 2.6's jit_bf16 backward-weights kernel synchronises its threads with spin barriers
 * (a shared transposition of the source, the reduction of per-thread gradients): when the OS
 * deschedules one thread the others spin, so on a loaded machine the pass runs 10-100x slower
 * (resnet18 amp-bf16 at 4-25 GFLOP/s, steps of 2-3 s instead of 0.5). Instead each thread runs
 * a one-thread primitive (no barrier inside) on a slice of the work:
 * - of the output channels (16-channel blocks) when the weights outnumber the input values:
 *   each slice writes its rows of the gradient, no reduction;
 * - else of the batch, each slice into an f32 partial gradient, summed in a fixed order.
 * On an idle machine both run as fast as oneDNN's own threading (measured: bench/NOTES.md,
 * "Convolutions").
 */
#include "backend/cpu/conv.h"

#include <omp.h>
#include <string.h>

#define MAX_SLICES AMPC_DNNL_MAX_STREAMS

/* First unit of slice s of S over n units (the first n % S slices get one more). */
static int64_t slice_start(int64_t n, int S, int s) { return s * (n / S) + (s < n % S ? s : n % S); }

typedef struct {
    bool by_oc;
    int S;
} split_plan;

/* First image (or output channel) of slice s. */
static int64_t plan_start(const conv_key *k, const split_plan *p, int s) {
    if (!p->by_oc) return slice_start(k->N, p->S, s);
    int64_t o = 16 * slice_start((k->O + 15) / 16, p->S, s);
    return o < k->O ? o : k->O;
}

/* The one-thread primitives of the slices (keys with slot 1..S). Lock held. */
static int slice_entries(const conv_key *k, const split_plan *p, ampc_dnnl_entry **e) {
    int nthr = omp_get_max_threads(), s = 0;
    omp_set_num_threads(1);   /* oneDNN sizes a primitive's threading at creation */
    for (; s < p->S; s++) {
        conv_key ks = *k;
        int64_t size = plan_start(k, p, s + 1) - plan_start(k, p, s);
        if (p->by_oc) ks.O = size;
        else ks.N = size;
        ks.nthr = 1;
        ks.slot = s + 1;
        if (!(e[s] = ampc__dnnl_get(AMPC_DNNL_CONV_BWD_WEIGHTS, &ks, sizeof ks, ampc__conv_build_bwd_weights))) break;
    }
    omp_set_num_threads(nthr);
    return s < p->S ? ampc_last_status() : AMPC_OK;
}

/* Runs slice s's entry with handles h[s] and scratchpad scratch[s] on the threads of a
   parallel region, each slice on its own stream. */
static int run_slices(ampc_dnnl_entry **e, int S, void *const (*h)[4], char *const *scratch) {
    dnnl_status_t st[MAX_SLICES];
    int rc = ampc__dnnl_reserve_streams(S);
    if (rc < 0) return rc;
#pragma omp parallel num_threads(S)
    for (int s = omp_get_thread_num(); s < S; s += omp_get_num_threads()) st[s] = ampc__dnnl_exec(e[s], h[s], scratch[s], s);
    for (int s = 0; s < S; s++)
        if (st[s] != dnnl_success)
            return ampc__err(AMPC_ERR_BACKEND, "oneDNN convolution backward weights slice: %s", dnnl_status2str(st[s]));
    return AMPC_OK;
}

/* md (a slice's src or diff_dst) widened to batch N, if the batch is its outermost, unblocked
   dimension: then image i starts i * strides[0] elements in. */
static bool widen_batch(dnnl_memory_desc_t *full, const dnnl_memory_desc_t *md, int64_t N) {
    const dnnl_blocking_desc_t *b = &md->format_desc.blocking;
    if (md->format_kind != dnnl_blocked || md->offset0 != 0 || md->extra.flags != 0) return false;
    for (int i = 0; i < b->inner_nblks; i++)
        if (b->inner_idxs[i] == 0) return false;
    if ((size_t)(b->strides[0] * md->padded_dims[0]) * dnnl_data_type_size(md->data_type) != dnnl_memory_desc_get_size(md))
        return false;
    *full = *md;
    full->dims[0] = full->padded_dims[0] = N;
    return true;
}

static const dnnl_memory_desc_t *arg_md(const ampc_dnnl_entry *e, int i) {
    const dnnl_memory_desc_t *md = NULL;
    return dnnl_memory_get_memory_desc(e->mem[i], &md) == dnnl_success ? md : NULL;
}

/* Split over the batch (see above); 1 when a layout does not have the batch outermost. */
static int split_batch(const conv_key *k, const split_plan *p, ampc_dnnl_entry **e, void *const *user) {
    int S = p->S, n, rc = AMPC_OK;
    const arg_spec *args = ampc__conv_family_args(AMPC_DNNL_CONV_BWD_WEIGHTS, &n, k);
    /* slice descriptors (src, diff_dst, diff_weights, diff_bias): the same in every slice
       but the batch; full: the whole batch's src and diff_dst */
    dnnl_memory_desc_t pmd[4], umd[4], full[2], w;
    for (int s = 0; s < S; s++)
        for (int i = 0; i < n; i++) {
            const dnnl_memory_desc_t *md = arg_md(e[s], i);
            if (!md) return ampc__err(AMPC_ERR_BACKEND, "oneDNN convolution: no descriptor for argument %d", i);
            if (s == 0 && i < 2 && !widen_batch(&full[i], md, k->N)) return 1;
            if (s == 0) pmd[i] = *md;
            if (i < 2 ? !widen_batch(&w, md, k->N) || !dnnl_memory_desc_equal(&w, &full[i]) : !dnnl_memory_desc_equal(md, &pmd[i]))
                return 1;
        }
    for (int i = 0; i < n; i++) AMPC_DNNL_TRY(ampc__conv_user_md(&umd[i], k, &args[i]), "user descriptor");

    /* workspace: the whole src and diff_dst where reordered, S partial gradients (slot 0's
       in the user's buffer when it has the layout), S scratchpads */
    conv_key kr = *k;
    kr.slot = -1;
    ampc_dnnl_entry *reo[4] = {0};
    size_t off[4] = {0}, total = 0, block = 0, bytes[4];
    for (int i = 0; i < n; i++) {
        const dnnl_memory_desc_t *md = i < 2 ? &full[i] : &pmd[i];
        bytes[i] = dnnl_memory_desc_get_size(md);
        bool same = dnnl_memory_desc_equal(md, &umd[i]);
        if (!same) reo[i] = args[i].output ? ampc__conv_reorder_entry(&kr, AMPC_DNNL_CONV_BWD_WEIGHTS, args[i].arg, md, &umd[i])
                                           : ampc__conv_reorder_entry(&kr, AMPC_DNNL_CONV_BWD_WEIGHTS, args[i].arg, &umd[i], md);
        if (!same && !reo[i]) return ampc_last_status();
        off[i] = total;
        total += i < 2 ? (same ? 0 : ampc__conv_align64(bytes[i])) : (size_t)S * ampc__conv_align64(bytes[i]);
    }
    char *scratch[MAX_SLICES], *out[4][MAX_SLICES], *in[2];
    size_t part = total;
    for (int s = 0; s < S; s++) total += ampc__conv_align64(e[s]->scratch_bytes);
    char *ws = ampc__alloc(AMPC_DEVICE_CPU, total, AMPC_MEM_WORKSPACE, &block);
    if (!ws) return ampc_last_status();
    for (int s = 0; s < S; part += ampc__conv_align64(e[s]->scratch_bytes), s++) scratch[s] = ws + part;
    for (int i = 2; i < n; i++)
        for (int s = 0; s < S; s++) out[i][s] = s == 0 && !reo[i] ? user[i] : ws + off[i] + (size_t)s * ampc__conv_align64(bytes[i]);
    for (int i = 0; i < 2 && rc >= 0; i++) {
        in[i] = reo[i] ? ws + off[i] : user[i];
        if (reo[i]) rc = ampc__dnnl_run(reo[i], (void *[]){user[i], in[i]});
    }
    void *h[MAX_SLICES][4];
    for (int s = 0; s < S; s++) {
        size_t i0 = (size_t)plan_start(k, p, s);
        h[s][0] = in[0] + i0 * (bytes[0] / (size_t)k->N);
        h[s][1] = in[1] + i0 * (bytes[1] / (size_t)k->N);
        h[s][2] = out[2][s];
        h[s][3] = n > 3 ? out[3][s] : NULL;
    }
    if (rc >= 0) rc = run_slices(e, S, (void *const(*)[4])h, scratch);
    /* sum the partials into slot 0's (f32: the weights' and bias' layouts hold floats) */
    for (int i = 2; i < n && rc >= 0; i++) {
        size_t m = bytes[i] / sizeof(float);
        float *const *q = (float *const *)out[i];
#pragma omp parallel for schedule(static) if (m > 32768)
        for (size_t j = 0; j < m; j++) {
            float v = q[0][j];
            for (int s = 1; s < S; s++) v += q[s][j];
            q[0][j] = v;
        }
        if (reo[i]) rc = ampc__dnnl_run(reo[i], (void *[]){out[i][0], user[i]});
    }
    ampc__free(AMPC_DEVICE_CPU, ws, block, AMPC_MEM_WORKSPACE);
    return rc;
fail:
    return rc;
}

/* Split over the output channels (see above): every slice reads the whole src and its own
   channels of diff_dst (reordered from a view of the user's), and writes its rows of the
   user's gradients. 1 when the slices disagree on the src layout. */
static int split_oc(const conv_key *k, const split_plan *p, ampc_dnnl_entry **e, void *const *user) {
    int S = p->S, n, rc = AMPC_OK;
    const arg_spec *args = ampc__conv_family_args(AMPC_DNNL_CONV_BWD_WEIGHTS, &n, k);
    dnnl_memory_desc_t umd[4];
    for (int i = 0; i < n; i++) AMPC_DNNL_TRY(ampc__conv_user_md(&umd[i], k, &args[i]), "user descriptor");
    /* per slice and argument: the reorder between the slice's layout and the view of the
       user's buffer (diff_dst (N, os, OH, OW), weights (os, C, KH, KW), bias (os) at o0), or
       none where they agree (an f32 bias: written in place); the src once, by slice 0 */
    ampc_dnnl_entry *reo[MAX_SLICES][4] = {{0}};
    size_t off[MAX_SLICES][4] = {{0}}, view_off[MAX_SLICES][4] = {{0}}, total = 0, block = 0;
    for (int s = 0; s < S; s++) {
        int64_t o0 = plan_start(k, p, s), os = plan_start(k, p, s + 1) - o0;
        conv_key kr = *k;
        kr.slot = -2 - s;
        const dnnl_memory_desc_t *src = arg_md(e[s], 0), *src0 = arg_md(e[0], 0);
        if (!src || !src0 || !dnnl_memory_desc_equal(src, src0)) return 1;
        for (int i = s == 0 ? 0 : 1; i < n; i++) {
            const dnnl_memory_desc_t *md = arg_md(e[s], i);
            if (!md) return ampc__err(AMPC_ERR_BACKEND, "oneDNN convolution: no descriptor for argument %d", i);
            dnnl_memory_desc_t view = umd[i], at0;
            if (i > 0) {
                dnnl_dims_t dims = {0}, offs = {0};
                for (int d = 0; d < umd[i].ndims; d++) dims[d] = umd[i].dims[d];
                dims[i == 1] = os, offs[i == 1] = o0;   /* channels: dim 1 of diff_dst, dim 0 of the others */
                AMPC_DNNL_TRY(dnnl_memory_desc_init_submemory(&view, &umd[i], dims, offs), "memory_desc_init_submemory");
            }
            view_off[s][i] = (size_t)view.offset0 * dnnl_data_type_size(view.data_type);
            at0 = view;
            at0.offset0 = 0;
            if (dnnl_memory_desc_equal(md, &at0)) continue;
            reo[s][i] = args[i].output ? ampc__conv_reorder_entry(&kr, AMPC_DNNL_CONV_BWD_WEIGHTS, args[i].arg, md, &view)
                                       : ampc__conv_reorder_entry(&kr, AMPC_DNNL_CONV_BWD_WEIGHTS, args[i].arg, &view, md);
            if (!reo[s][i]) return ampc_last_status();
            off[s][i] = total;
            total += ampc__conv_align64(dnnl_memory_desc_get_size(md));
        }
    }
    size_t part = total;
    for (int s = 0; s < S; s++) total += ampc__conv_align64(e[s]->scratch_bytes);
    char *ws = ampc__alloc(AMPC_DEVICE_CPU, total ? total : 64, AMPC_MEM_WORKSPACE, &block);
    if (!ws) return ampc_last_status();
    char *scratch[MAX_SLICES];
    void *h[MAX_SLICES][4];
    for (int s = 0; s < S; part += ampc__conv_align64(e[s]->scratch_bytes), s++) {
        scratch[s] = ws + part;
        for (int i = 0; i < n; i++) {
            int r = i == 0 ? 0 : s;   /* the src: slice 0's buffer for all */
            h[s][i] = reo[r][i] ? ws + off[r][i] : (char *)user[i] + view_off[r][i];
        }
    }
    /* the src once, each slice's channels of diff_dst in; gradients out (reorders take the
       view's offset from its descriptor, so they get the user's base pointer) */
    for (int s = 0; s < S && rc >= 0; s++)
        for (int i = s == 0 ? 0 : 1; i < 2 && rc >= 0; i++)
            if (reo[s][i]) rc = ampc__dnnl_run(reo[s][i], (void *[]){user[i], h[s][i]});
    if (rc >= 0) rc = run_slices(e, S, (void *const(*)[4])h, scratch);
    for (int s = 0; s < S && rc >= 0; s++)
        for (int i = 2; i < n && rc >= 0; i++)
            if (reo[s][i]) rc = ampc__dnnl_run(reo[s][i], (void *[]){h[s][i], user[i]});
    ampc__free(AMPC_DEVICE_CPU, ws, block, AMPC_MEM_WORKSPACE);
    return rc;
fail:
    return rc;
}

/* The backward weights pass of k (blocked bf16) split over threads, on the user's plain
   buffers like ampc__conv_run_dnnl; 1 when it does not apply (fewer than 2 threads or units of work, a
   layout the split cannot slice). Lock held. */
int ampc__conv_run_split(const conv_key *k, void *const *user) {
    split_plan p = {.by_oc = k->groups == 1 && k->O * k->C * k->KH * k->KW > k->N * k->C * k->H * k->W};
    int64_t units = p.by_oc ? (k->O + 15) / 16 : k->N, S = k->nthr < units ? k->nthr : units;
    p.S = (int)(S < MAX_SLICES ? S : MAX_SLICES);
    if (p.S < 2) return 1;
    ampc_dnnl_entry *e[MAX_SLICES];
    int rc = slice_entries(k, &p, e);
    if (rc < 0) return rc;
    return p.by_oc ? split_oc(k, &p, e, user) : split_batch(k, &p, e, user);
}
