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

   One translation unit, host.c, which includes the parts in order: host_base.c (ring writes, captures,
   the arena), host_pool.c (the thread pool), host_kernels.c (products, norms, RoPE, mHC), host_stored.c
   (products over FP8 and bf16 weights decoded in registers), host_packed.c (products over MXFP4 experts), host_layers.c (compressor, attention, experts), host_forward.c (the
   step, the entry points and the ABI table). This header holds what they share: the vector type and
   its fused multiply-add, the named limits, the bounds checks and the descriptors. Every formula names the Python
   function it mirrors. Nothing is allocated per step: scratch comes from a caller-owned arena that grows
   to the largest step seen. */
#ifndef DS4_HOST_H
#define DS4_HOST_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(VW * 4)));

static inline vf vload(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }
/* a broadcast, nothing else: `(vf){} + a` was an add of zero before every broadcast (the compiler may not
   drop it: it turns -0 into +0), so the register tiles broadcast through a register instead of straight
   from memory, one more uop per row and k on the FP pipes: the AVX2 6 x 2 tile of a prefill ran ~25%
   slower for it on Zen 3. Only the sign of a zero changes, and only where an accumulator is -0 */
static inline vf vsplat(float a) {
#if defined(__AVX512F__)
    return (vf)_mm512_set1_ps(a);
#elif defined(__AVX__)
    return (vf)_mm256_set1_ps(a);
#else
    vf v;
    for (int i = 0; i < VW; i++) v[i] = a;
    return v;
#endif
}
/* the lanes of v summed as a tree (halves, then quarters, ...) in registers: a fixed order, the same bits
   on every call, in log2(VW) dependent adds where a lane-by-lane sum took VW (the attention's logits end
   in one such sum per key and head: a quarter of its time went to them) */
typedef float vf8_ __attribute__((vector_size(32)));
typedef float vf4_ __attribute__((vector_size(16)));
static inline float vsum(vf v) {
#if VW == 16
    vf8_ h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    vf8_ h = v;
#endif
    vf4_ q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    return (q[0] + q[2]) + (q[1] + q[3]);
}

/* Rounding is decided here, in the source, never by the compiler. The library is built with
   -ffp-contract=off (host_forward.py), so `a * b + c` is always a product rounded, then a sum rounded;
   every multiply-add whose result must agree between two paths (tiles vs panels, packed vs dense, a
   row alone vs in a batch) goes through vfma / sfma, which are ONE fused operation wherever the target
   has FMA and the separate two everywhere else. Before this, GCC's default contraction fused some
   `acc += a * b` and not others depending on the instruction set and the inlining of each path, so
   rows that were promised equal bit for bit differed on an AVX2 machine (and agreed on AVX-512). */
#if defined(__AVX512F__)
#define DS4_FMA 1
static inline vf vfma(vf a, vf b, vf c) { return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
#elif defined(__FMA__) && (defined(__x86_64__) || defined(__i386__))
#define DS4_FMA 1
static inline vf vfma(vf a, vf b, vf c) { return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#elif defined(__ARM_FEATURE_FMA)
#define DS4_FMA 1
static inline vf vfma(vf a, vf b, vf c) {
    vf r;
    for (int i = 0; i < VW; i++) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
    return r;
}
#else
#define DS4_FMA 0
static inline vf vfma(vf a, vf b, vf c) { return a * b + c; }  /* two roundings, as everywhere in this build */
#endif

/* a * b + c for one float: fused exactly where vfma is */
static inline float sfma(float a, float b, float c) {
#if DS4_FMA
    return __builtin_fmaf(a, b, c);
#else
    return a * b + c;
#endif
}

/* Fixed limits of the buffers below and in the layers; host_forward.py reads them from ds4_abi (it does
   not restate them) and keeps a model that exceeds one on the torch path. */
#define DS4_MAX_EXPERTS 512     /* routed experts (route's and experts' stack arrays) */
#define DS4_MAX_HC 16           /* hyper-connection streams (hc_mix_rows) */
#define DS4_MAX_SPAN 1024       /* slots of one compressor window: 2 x the largest ratio (emit_windows) */
#define DS4_MAX_CAPTURES 8      /* prefix-cache snapshots inside one forward (StepView.cap) */
#define DS4_MAX_RATIOS 4        /* distinct compress ratios, and (ratio, indexer) keys (StepView.comp / vis) */
#define DS4_MAX_GROUP_HEADS 64  /* attention heads one work item attends (attend's stack arrays) */

/* ---- bounds (DS4_CHECK builds) ------------------------------------------------------------------
   Every index the forward reads from a view or a checkpoint table is checked against the size of what
   it indexes when built with -DDS4_CHECK (DS4SERVE_NATIVE_CHECK=1): a bad one stops the process with
   the name of the index, its value and its range instead of reading or writing another tensor's memory.
   Ordinary builds compile the checks away (the views are built by cache/view.py and checked there). */
#if defined(DS4_CHECK)
#include <stdio.h>
__attribute__((noreturn, cold)) static void ds4_out_of_bounds(const char *what, int64_t value, int64_t bound) {
    fprintf(stderr, "ds4 native bounds check failed: %s = %lld is outside [0, %lld)\n", what, (long long)value,
            (long long)bound);
    fflush(stderr);
    abort();
}
#define BOUND(what, value, bound)                                                              \
    do {                                                                                       \
        int64_t v_ = (int64_t)(value), b_ = (int64_t)(bound);                                   \
        if (v_ < 0 || v_ >= b_) ds4_out_of_bounds(what, v_, b_);                                \
    } while (0)
#else
#define BOUND(what, value, bound) ((void)0)
#endif

#define DS4_STR2(x) #x
#define DS4_STR(x) DS4_STR2(x)
#if DS4_FMA
#define DS4_FMA_NAME "fused multiply-add"
#else
#define DS4_FMA_NAME "no FMA (multiply, then add)"
#endif
#if defined(DS4_CHECK)
#define DS4_CHECK_NAME ", bounds checked"
#else
#define DS4_CHECK_NAME ""
#endif

/* ---- descriptors (filled once by host_forward.py; field order must match its ctypes mirrors) ---- */

typedef struct {  /* a projection weight: [K, N] ("kn", row stride ld, N padded to whole vectors) or [N, K] */
    const float *p;       /* fmt 0: fp32 */
    int64_t ld;
    int64_t kn;
    int64_t fmt;          /* 0 fp32 at p; 1 FP8 e4m3 codes at q, [K, N]; 2 bf16 at q, [N, K] (host_stored.c);
                             3 the same on bf16-rounded inputs (host_pairs.c); 4 fmt 1's codes on
                             bf16-rounded inputs (host_f8pairs.c) */
    const uint8_t *q;
    const float *scales;  /* fmt 1, 4: [scale_rows, sld] scales of bn x bk (outputs x inputs) blocks */
    int64_t bn, bk, sld, scale_rows;
} Weight;

/* outputs [n0, ...) of a weight (a group of o_a's block-diagonal rows); an FP8 weight's n0 is a whole
   number of scale blocks (host_forward.py keeps other FP8 weights dequantised) */
static inline Weight weight_cols(Weight w, int64_t n0) {
    if (w.fmt == 1 || w.fmt == 4) {
        w.q += n0;
        w.scales += (n0 / w.bn) * w.sld;
        w.scale_rows -= n0 / w.bn;
    } else if (w.fmt == 2 || w.fmt == 3) {
        w.q += n0 * w.ld * 2;
    } else {
        w.p += w.kn ? n0 : n0 * w.ld;
    }
    return w;
}

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
    int64_t exp_q8;                       /* ... interleaved, on int8 activations (host_q8.c) */
    const uint8_t *qgu_codes[2], *qgu_scales[2], *qdn_codes, *qdn_scales;
    int64_t qgu_rows[2], qgu_parts;
    Weight sh_gate, sh_up, sh_down;
    int64_t has_shared;
    float *swa, *comp_ring, *comp_pool, *idx_ring, *idx_pool;
    int64_t swa_rows, comp_ring_rows, idx_ring_rows;  /* ring rows: a key index past them is a new row */
    int64_t comp_pool_rows, idx_pool_rows;           /* rows of the paged pools (the page pool's whole size) */
    float *snap_swa, *snap_comp, *snap_idx;          /* prefix-cache snapshot arena rings (or NULL) */
    int64_t snap_swa_rows, snap_comp_rows, snap_idx_rows;
} Layer;

typedef struct {
    const float *embed;  /* [vocab, D] */
    const uint8_t *embed_bf16;  /* [vocab, D] bf16 instead of embed (or NULL) */
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
    CompView comp[DS4_MAX_RATIOS];
    VisView vis[DS4_MAX_RATIOS];
    Capture cap[DS4_MAX_CAPTURES];
} StepView;

typedef struct {  /* rows of width w: a ring (or pool) and its row count */
    float *p;
    int64_t rows, w;
} Rows;

/* row idx of cat(ring, fresh): ring rows first (n_ring of them: the ring's row count before this
   forward's writes, INT64_MAX when the ring already holds them), then this forward's `fresh` rows */
static inline const float *row_of(const float *ring, int64_t ring_rows, int64_t n_ring, const float *fresh,
                                  int64_t fresh_rows, int64_t idx, int64_t w) {
    if (idx < n_ring) {
        BOUND("ring row", idx, ring_rows);
        return ring + idx * w;
    }
    BOUND("row of this forward", idx - n_ring, fresh_rows);
    (void)ring_rows, (void)fresh_rows;
    return fresh + (idx - n_ring) * w;
}

typedef struct {
    char *buf;
    int64_t cap, used;
} Arena;

#endif  /* DS4_HOST_H */
