/* The DeepSeek-V4 forward on the host, as one call per step: decode rows, prefill chunks, image blocks.

   Why: on a CPU a decode step of the torch path is ~1,700 small dispatched ops (most of a 20 ms step at
   one row is Python and dispatch, not arithmetic), and the BLAS it calls is slow for the 1-32-row
   products of decode (MKL picks a generic path on some CPUs: 4-15 GFLOP/s at one row). These files are
   the same network as model/decoder.py, written against raw pointers, for both view forms (decode rows,
   whose keys index the rings after this step's writes, and prefill chunks, whose keys index
   cat(ring, this step's rows)): products by small-M kernels written for the model's shapes (weights
   stored [K, N] where N is a multiple of the vector width, so a row of outputs is a run of vector FMAs;
   [N, K] dot products elsewhere), everything else as plain loops, split across threads by a
   work-claiming pool (host_pool.c). Every row is computed on its own in a fixed order, so a row's result
   does not depend on the batch. The torch path stays the reference: tests pin this one to it (fp32,
   logits within 1e-4; sums are ordered differently, so not bit for bit).

   One translation unit, concatenated by host_decode.py in this order: host_base.c (types, descriptors,
   arena), host_pool.c, host_kernels.c (products, norms, RoPE, mHC), host_packed.c (products over MXFP4
   experts), host_layers.c (compressor,
   attention, experts), host_forward.c (the step and the entry points). Every formula names the Python
   function it mirrors. Nothing is allocated per step: scratch comes from a caller-owned arena that grows
   to the largest step seen. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(VW * 4)));

static inline vf vload(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf vsplat(float a) { return (vf){} + a; }
static inline float vsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < VW; i++) s += v[i];
    return s;
}

int ds4_vector_width(void) { return VW; }

/* ---- descriptors (filled once by host_decode.py; field order must match its ctypes mirrors) ---- */

typedef struct {  /* a projection weight: [K, N] ("kn", row stride ld, N padded to whole vectors) or [N, K] */
    const float *p;
    int64_t ld;
    int64_t kn;
} Weight;

typedef struct {
    int64_t hidden, hc, n_heads, head_dim, rope_dim, q_lora, o_groups, o_lora;
    int64_t idx_heads, idx_dim, idx_topk, n_experts, top_k, moe_inter, shared_inter, vocab;
    int64_t sinkhorn_iters, scoring, norm_topk, window;  /* scoring: 0 softmax, 1 sigmoid, 2 sqrtsoftplus */
    float rms_eps, hc_eps, swiglu_limit, routed_scale;
} Dims;

typedef struct {
    int64_t kind, ratio, comp_key, vis_key;  /* kind: 0 sliding, 1 CSA, 2 HCA; keys index the step's tables */
    Weight hc_attn_fn, hc_ffn_fn;
    const float *hc_attn_base, *hc_attn_scale, *hc_ffn_base, *hc_ffn_scale, *attn_norm, *ffn_norm;
    Weight q_a, q_b, kv, o_a, o_b;
    const float *q_a_norm, *kv_norm, *sinks;
    Weight c_kv, c_gate;
    const float *c_ape, *c_norm;
    Weight i_kv, i_gate, i_q_b, i_w;
    const float *i_ape, *i_norm;
    Weight gate;
    const float *gate_bias;       /* NULL on hash layers */
    const float *bias_vl;         /* DS4V: image tokens select experts by scores + bias_vl (or NULL) */
    const int64_t *tid2eid;       /* [vocab, top_k] on hash layers, else NULL */
    int64_t tid2eid_rows;
    const float *exp_gate_up, *exp_down;  /* [E, 2I, D], [E, D, I]; with exp_kn stored [E, D, 2I], [E, I, D] */
    int64_t exp_kn;
    int64_t exp_packed;                   /* experts kept in MXFP4: read from these instead (host_packed.c) */
    const uint8_t *qgu_codes[2], *qgu_scales[2], *qdn_codes, *qdn_scales;
    int64_t qgu_rows[2], qgu_parts;
    Weight sh_gate, sh_up, sh_down;
    int64_t has_shared;
    float *swa, *comp_ring, *comp_pool, *idx_ring, *idx_pool;
    int64_t swa_rows, comp_ring_rows, idx_ring_rows;  /* ring rows: a key index past them is a new row */
    float *snap_swa, *snap_comp, *snap_idx;          /* prefix-cache snapshot arena rings (or NULL) */
} Layer;

typedef struct {
    const float *embed;  /* [vocab, D] */
    const float *image_start, *image_pad, *image_newline, *image_end;  /* DS4V sentinel rows (or NULL) */
    const float *inv_freq_main, *inv_freq_comp;
    float af_main, af_comp;
    Weight head_fn;
    const float *head_base, *head_scale, *final_norm;
    Weight lm_head;
    int64_t n_layers;
    const Layer *layers;
    Dims d;
} Model;

typedef struct {  /* cache/view.py _compress_index, for one (ratio, overlap) */
    int64_t ratio, overlap, span, E, M;
    const int64_t *emit_slots;  /* [E, span] ring rows (read after this step's ring writes) */
    const uint8_t *emit_valid;  /* [E, span] */
    const int64_t *emit_pos, *emit_rows, *ring_dst, *ring_src;
} CompView;

typedef struct {  /* visible compressed rows of one ratio */
    int64_t R;
    const int64_t *rows;
    const uint8_t *valid;
} VisView;

typedef struct {  /* batch.RingCapture: rings as they stood at a position inside this forward */
    int64_t ring_len, n_old, n_new;
    const int64_t *old_dst, *old_src, *new_dst, *new_src;
} Capture;

typedef struct {
    int64_t T, Kw, M, after_write;
    const int64_t *ids, *positions, *swa_keys, *swa_dst, *swa_src;
    const uint8_t *swa_valid;
    const uint8_t *is_image;      /* [T] image-block tokens (NULL: none) */
    int64_t n_image_rows;
    const int64_t *image_rows;    /* [n] token index of each aligner row */
    const float *image_embeds;    /* [n, D] */
    int64_t n_comp, n_vis, n_cap;
    CompView comp[4];
    VisView vis[4];
    Capture cap[8];
} StepView;

/* row idx of cat(ring, fresh): ring rows first, then this forward's rows */
static inline const float *row_of(const float *ring, int64_t n_ring, const float *fresh, int64_t idx, int64_t w) {
    return idx < n_ring ? ring + idx * w : fresh + (idx - n_ring) * w;
}

static void write_ring(float *ring, const float *fresh, const int64_t *dst, const int64_t *src, int64_t n, int64_t w) {
    for (int64_t i = 0; i < n; i++) memcpy(ring + dst[i] * w, fresh + src[i] * w, (size_t)w * 4);
}

/* capture_ring: copy the ring as it stood at each capture point into the snapshot rows */
static void capture(const StepView *v, int64_t ring_len, float *snap, const float *ring, const float *fresh, int64_t w) {
    if (!snap) return;
    for (int64_t c = 0; c < v->n_cap; c++) {
        const Capture *cp = &v->cap[c];
        if (cp->ring_len != ring_len) continue;
        write_ring(snap, ring, cp->old_dst, cp->old_src, cp->n_old, w);
        write_ring(snap, fresh, cp->new_dst, cp->new_src, cp->n_new, w);
    }
}

typedef struct {
    char *buf;
    int64_t cap, used;
} Arena;

void ds4_arena_free(Arena *a) {
    free(a->buf);
    a->buf = NULL;
    a->cap = a->used = 0;
}

static int arena_reserve(Arena *a, int64_t bytes) {
    a->used = 0;
    if (bytes <= a->cap) return 0;
    free(a->buf);
    a->buf = NULL;
    a->cap = 0;
    if (posix_memalign((void **)&a->buf, 64, (size_t)bytes) != 0) return -1;
    a->cap = bytes;
    return 0;
}

static float *take(Arena *a, int64_t n) {  /* n floats, 64-byte aligned, from a reserved arena */
    float *p = (float *)(a->buf + a->used);
    a->used += ((n * 4 + 63) / 64) * 64;
    return p;
}

