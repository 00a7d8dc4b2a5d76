/* The DeepSeek-V4 text forward on the host, as one call per step (decode rows and prefill chunks).

   Why: on a CPU a decode step of the torch path is ~1,700 small dispatched ops (most of a 20 ms step
   at one row is Python and dispatch, not arithmetic), and the BLAS it calls is slow for the 1-32-row
   products of decode (MKL picks a generic path on some CPUs: 4-15 GFLOP/s at one row). This file is
   the same network as model/decoder.py for text views (decode rows, whose keys index the rings after
   this step's writes, and prefill chunks, whose keys index cat(ring, this step's rows)), written
   against raw pointers: products by small-M kernels written for
   the model's shapes (weights stored [K, N] where N is a multiple of the vector width, so a row of
   outputs is a run of vector FMAs; [N, K] dot products elsewhere), everything else as plain loops,
   OpenMP across output columns and (row, head) pairs. The torch path stays the reference: tests pin
   this one to it (fp32, logits within 1e-4; sums are ordered differently, so not bit for bit).

   Every formula here names the Python function it mirrors. Nothing is allocated per step: scratch
   comes from a caller-owned arena that grows to the largest step seen. */
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

typedef struct {  /* a projection weight: [K, N] ("kn", row stride ld) or [N, K] (row stride ld) */
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
    const float *exp_gate_up, *exp_down;  /* [E, 2I, D], [E, D, I] */
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

/* ---- products --------------------------------------------------------------------------------- */

/* y[m, n] = sum_k x[m, k] w[k, n] for 4 x (nv * VW) outputs; w is [K, N] with row stride ldw */
static void kn_tile(const float *x, int64_t ldx, int mr, int64_t K, const float *w, int64_t ldw, int nv,
                    float *y, int64_t ldy) {
    vf acc[4][4];
    memset(acc, 0, sizeof acc);
    if (mr == 4 && nv == 4) {
        for (int64_t k = 0; k < K; k++) {
            const float *wr = w + k * ldw;
            vf b0 = vload(wr), b1 = vload(wr + VW), b2 = vload(wr + 2 * VW), b3 = vload(wr + 3 * VW);
            for (int i = 0; i < 4; i++) {
                vf a = vsplat(x[i * ldx + k]);
                acc[i][0] += a * b0; acc[i][1] += a * b1; acc[i][2] += a * b2; acc[i][3] += a * b3;
            }
        }
    } else {
        for (int64_t k = 0; k < K; k++) {
            const float *wr = w + k * ldw;
            for (int j = 0; j < nv; j++) {
                vf b = vload(wr + j * VW);
                for (int i = 0; i < mr; i++) acc[i][j] += vsplat(x[i * ldx + k]) * b;
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nv; j++) vstore(y + i * ldy + j * VW, acc[i][j]);
}

/* y[m, n] = sum_k x[m, k] w[n, k] for up to 4 x 4 outputs (w [N, K], row stride ldw) */
static void nk_tile(const float *x, int64_t ldx, int mr, int64_t K, const float *w, int64_t ldw, int nr,
                    float *y, int64_t ldy) {
    vf acc[4][4];
    memset(acc, 0, sizeof acc);
    int64_t kv = K - K % VW, k = 0;
    if (mr == 4 && nr == 4) {
        for (; k < kv; k += VW) {
            vf w0 = vload(w + k), w1 = vload(w + ldw + k), w2 = vload(w + 2 * ldw + k), w3 = vload(w + 3 * ldw + k);
            for (int i = 0; i < 4; i++) {
                vf a = vload(x + i * ldx + k);
                acc[i][0] += a * w0; acc[i][1] += a * w1; acc[i][2] += a * w2; acc[i][3] += a * w3;
            }
        }
    } else {
        for (; k < kv; k += VW)
            for (int j = 0; j < nr; j++) {
                vf b = vload(w + j * ldw + k);
                for (int i = 0; i < mr; i++) acc[i][j] += vload(x + i * ldx + k) * b;
            }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            float s = vsum(acc[i][j]);
            for (int64_t kk = kv; kk < K; kk++) s += x[i * ldx + kk] * w[j * ldw + kk];
            y[i * ldy + j] = s;
        }
}

static int g_threads = 1;

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ W^T, W as stored (see Weight) */
static void linear(const float *x, int64_t ldx, int64_t M, int64_t K, Weight w, int64_t N, float *y, int64_t ldy) {
    int64_t work = M * N * K;
    int nt = work >= 65536 ? g_threads : 1;
    if (w.kn) {  /* N % VW == 0 (host_decode.py stores [K, N] only then) */
        int64_t blocks = (N + 4 * VW - 1) / (4 * VW);
        #pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            int64_t n0 = b * 4 * VW;
            int nv = (int)((N - n0) / VW < 4 ? (N - n0) / VW : 4);
            for (int64_t m0 = 0; m0 < M; m0 += 4)
                kn_tile(x + m0 * ldx, ldx, (int)(M - m0 < 4 ? M - m0 : 4), K, w.p + n0, w.ld, nv, y + m0 * ldy + n0, ldy);
        }
    } else {
        int64_t blocks = (N + 3) / 4;
        #pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            int64_t n0 = b * 4;
            int nr = (int)(N - n0 < 4 ? N - n0 : 4);
            for (int64_t m0 = 0; m0 < M; m0 += 4)
                nk_tile(x + m0 * ldx, ldx, (int)(M - m0 < 4 ? M - m0 : 4), K, w.p + n0 * w.ld, w.ld, nr,
                        y + m0 * ldy + n0, ldy);
        }
    }
}

static inline float dot(const float *a, const float *b, int64_t n) {
    vf acc = {};
    int64_t k = 0, kv = n - n % VW;
    for (; k < kv; k += VW) acc += vload(a + k) * vload(b + k);
    float s = vsum(acc);
    for (; k < n; k++) s += a[k] * b[k];
    return s;
}

static inline void axpy(float *y, float a, const float *x, int64_t n) {  /* y += a x */
    int64_t k = 0, kv = n - n % VW;
    vf va = vsplat(a);
    for (; k < kv; k += VW) vstore(y + k, vload(y + k) + va * vload(x + k));
    for (; k < n; k++) y[k] += a * x[k];
}

/* ---- elementwise blocks (norms.py, rope.py, mhc.py) ------------------------------------------- */

/* F.rms_norm over rows of width n: x * rsqrt(mean(x^2) + eps) (* w) */
static void rms_norm(float *x, int64_t rows, int64_t n, const float *w, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        float *p = x + r * n;
        float ss = 0.0f;
        for (int64_t i = 0; i < n; i++) ss += p[i] * p[i];
        float inv = 1.0f / sqrtf(ss / (float)n + eps);
        if (w)
            for (int64_t i = 0; i < n; i++) p[i] = p[i] * inv * w[i];
        else
            for (int64_t i = 0; i < n; i++) p[i] = p[i] * inv;
    }
}

/* rotations(): cos/sin of pos * inv_freq (fp32), scaled by the attention factor -> rot [half, 2] */
static void rotation(float *rot, int64_t pos, const float *inv_freq, int64_t half, float af) {
    for (int64_t j = 0; j < half; j++) {
        float f = (float)pos * inv_freq[j];
        rot[2 * j] = cosf(f) * af;
        rot[2 * j + 1] = sinf(f) * af;
    }
}

/* apply_rope on the last 2 * half channels of each of `heads` vectors of width dim */
static void rope(float *x, int64_t heads, int64_t dim, const float *rot, int64_t half, int inverse) {
    for (int64_t h = 0; h < heads; h++) {
        float *p = x + h * dim + (dim - 2 * half);
        for (int64_t j = 0; j < half; j++) {
            float a = p[2 * j], b = p[2 * j + 1], c = rot[2 * j], s = inverse ? -rot[2 * j + 1] : rot[2 * j + 1];
            p[2 * j] = a * c - b * s;
            p[2 * j + 1] = a * s + b * c;
        }
    }
}

static inline float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

/* mhc.sinkhorn on one hc x hc matrix, in place */
static void sinkhorn(float *m, int64_t hc, int64_t iters, float eps) {
    for (int64_t it = 0; it < iters; it++) {
        if (it > 0)
            for (int64_t i = 0; i < hc; i++) {
                float s = 0.0f;
                for (int64_t j = 0; j < hc; j++) s += m[i * hc + j];
                for (int64_t j = 0; j < hc; j++) m[i * hc + j] /= eps + s;
            }
        for (int64_t j = 0; j < hc; j++) {
            float s = 0.0f;
            for (int64_t i = 0; i < hc; i++) s += m[i * hc + j];
            for (int64_t i = 0; i < hc; i++) m[i * hc + j] /= eps + s;
        }
    }
}

/* mhc.hc_pre: x [T, D] collapsed, post [T, hc], comb [T, hc, hc]; flat / z are scratch */
static void hc_pre(const Dims *d, const float *streams, int64_t T, Weight fn, const float *base, const float *scale,
                   float *x, float *post, float *comb, float *flat, float *z) {
    int64_t hc = d->hc, D = d->hidden, n_mix = (2 + hc) * hc;
    memcpy(flat, streams, (size_t)(T * hc * D) * 4);
    #pragma omp parallel for num_threads(T >= 16 ? g_threads : 1) schedule(static)
    for (int64_t t = 0; t < T; t++) rms_norm(flat + t * hc * D, 1, hc * D, NULL, d->rms_eps);
    linear(flat, hc * D, T, hc * D, fn, n_mix, z, n_mix);
    #pragma omp parallel for num_threads(T >= 16 ? g_threads : 1) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        float *zt = z + t * n_mix, pre[16];
        for (int64_t i = 0; i < n_mix; i++) zt[i] = base[i] + zt[i] * scale[i < hc ? 0 : (i < 2 * hc ? 1 : 2)];
        for (int64_t i = 0; i < hc; i++) {
            pre[i] = sigmoidf(zt[i]) + d->hc_eps;
            post[t * hc + i] = 2.0f * sigmoidf(zt[hc + i]);
        }
        float *c = comb + t * hc * hc;
        for (int64_t i = 0; i < hc; i++) {  /* softmax over the last axis, then + eps */
            const float *row = zt + 2 * hc + i * hc;
            float mx = row[0], s = 0.0f;
            for (int64_t j = 1; j < hc; j++) mx = row[j] > mx ? row[j] : mx;
            for (int64_t j = 0; j < hc; j++) s += (c[i * hc + j] = expf(row[j] - mx));
            for (int64_t j = 0; j < hc; j++) c[i * hc + j] = c[i * hc + j] / s + d->hc_eps;
        }
        sinkhorn(c, hc, d->sinkhorn_iters, d->hc_eps);
        float *xt = x + t * D;
        const float *st = streams + t * hc * D;
        for (int64_t k = 0; k < D; k++) xt[k] = 0.0f;
        for (int64_t i = 0; i < hc; i++) axpy(xt, pre[i], st + i * D, D);
    }
}

/* mhc.hc_post: X'[j] = post[j] y + sum_i comb[i, j] X[i], in place on streams */
static void hc_post(const Dims *d, float *streams, int64_t T, const float *y, const float *post, const float *comb,
                    float *tmp) {
    int64_t hc = d->hc, D = d->hidden;
    #pragma omp parallel for num_threads(T >= 16 ? g_threads : 1) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        float *st = streams + t * hc * D;
        const float *c = comb + t * hc * hc;
        for (int64_t j = 0; j < hc; j++) {
            float *o = tmp + t * hc * D + j * D;
            for (int64_t k = 0; k < D; k++) o[k] = post[t * hc + j] * y[t * D + k];
            for (int64_t i = 0; i < hc; i++) axpy(o, c[i * hc + j], st + i * D, D);
        }
        memcpy(st, tmp + t * hc * D, (size_t)(hc * D) * 4);
    }
}

/* ---- compressor (compressor.py token_states / pool_windows / finish_rows) ------------------------ */

typedef struct {
    Weight wkv, wgate;
    const float *ape, *norm;
    float *ring, *pool, *snap;
    int64_t ring_rows, width, out_dim;  /* width: C (and Z) channels per token; out_dim: of a pooled row */
} Emitter;

/* token_states: [C | Z + ape[pos % ratio]] per token, fp32 -> states [T, 2 * width] */
static void token_states(const Emitter *e, const CompView *cv, const float *xn, int64_t T, int64_t D,
                         const int64_t *positions, float *states) {
    int64_t w = e->width, w2 = 2 * w;
    linear(xn, D, T, D, e->wkv, w, states, w2);
    linear(xn, D, T, D, e->wgate, w, states + w, w2);
    for (int64_t t = 0; t < T; t++) {
        const float *ape = e->ape + (positions[t] % cv->ratio) * w;
        for (int64_t c = 0; c < w; c++) states[t * w2 + w + c] += ape[c];
    }
}

/* pool_windows + finish_rows for every closing window: slots from cat(ring, states) (the ring alone
   after this step's writes in decode views), softmax over slots per channel, norm, RoPE, into the pool */
static void emit_rows(const Model *m, const Emitter *e, const CompView *cv, const float *states, int after,
                      float *rot_scratch) {
    const Dims *d = &m->d;
    int64_t w2 = 2 * e->width, w = e->width, ratio = cv->ratio, od = e->out_dim, span = cv->span;
    int64_t half = d->rope_dim / 2, n_ring = after ? INT64_MAX : e->ring_rows;
    #pragma omp parallel for num_threads(cv->E >= 8 ? g_threads : 1) schedule(static)
    for (int64_t k = 0; k < cv->E; k++) {
        float *out = e->pool + cv->emit_rows[k] * od, *rot = rot_scratch + k * 2 * half;
        const float *rows[1024];
        for (int64_t j = 0; j < span; j++)
            rows[j] = cv->emit_valid[k * span + j] ? row_of(e->ring, n_ring, states, cv->emit_slots[k * span + j], w2)
                                                   : NULL;
        for (int64_t c = 0; c < od; c++) {
            float mx = -INFINITY, s = 0.0f, acc = 0.0f;
            for (int64_t j = 0; j < span; j++) {  /* CSA: first ratio slots "a" halves, the rest "b" halves */
                if (!rows[j]) continue;
                float g = rows[j][w + (cv->overlap && j >= ratio ? od + c : c)];
                mx = g > mx ? g : mx;
            }
            for (int64_t j = 0; j < span; j++) {
                if (!rows[j]) continue;
                int64_t ch = cv->overlap && j >= ratio ? od + c : c;
                float p = expf(rows[j][w + ch] - mx);
                s += p;
                acc += rows[j][ch] * p;
            }
            out[c] = acc / s;
        }
        rms_norm(out, 1, od, e->norm, d->rms_eps);
        rotation(rot, cv->emit_pos[k], m->inv_freq_comp, half, m->af_comp);
        rope(out, 1, od, rot, half, 0);
    }
}

/* ---- attention (decoder.Attention, attention.sink_attention) ------------------------------------ */

typedef struct {
    float *q, *kv, *qr, *out, *o_mid, *rot, *rot_emit, *states_c, *states_i, *q_idx, *head_w, *scores, *probs;
    int64_t *cols, *crows;
    uint8_t *cvalid;
} AttnScratch;

/* select_top_rows: the k best columns of scores [R] (ties: lower column first); -inf is invalid */
static int64_t top_rows(const float *scores, int64_t R, int64_t k, int64_t *cols) {
    int64_t n = 0;
    for (int64_t r = 0; r < R; r++) {
        float v = scores[r];
        if (!(v > -INFINITY)) continue;
        int64_t pos = n < k ? n : k;  /* insertion into the sorted prefix; drop the worst beyond k */
        while (pos > 0 && scores[cols[pos - 1]] < v) pos--;
        if (pos >= k) continue;
        int64_t last = n < k ? n : k - 1;
        for (int64_t i = last; i > pos; i--) cols[i] = cols[i - 1];
        cols[pos] = r;
        if (n < k) n++;
    }
    return n;
}

/* CSA: per query, score every visible indexer row and keep the top-k pool rows (Compressor.gathered) */
static void csa_rows(const Model *m, const Layer *L, const VisView *vis, int64_t T, AttnScratch *s, int64_t kc) {
    const Dims *d = &m->d;
    int64_t Hi = d->idx_heads, di = d->idx_dim, R = vis->R;
    float scale = 1.0f / sqrtf((float)di);
    #pragma omp parallel for num_threads(T * R >= 64 ? g_threads : 1) schedule(dynamic, 4)
    for (int64_t t = 0; t < T; t++) {
        float *sc = s->scores + t * R;
        for (int64_t r = 0; r < R; r++) {
            if (!vis->valid[t * R + r]) { sc[r] = -INFINITY; continue; }
            const float *key = L->idx_pool + vis->rows[t * R + r] * di;
            float acc = 0.0f;
            for (int64_t h = 0; h < Hi; h++) {
                float v = dot(s->q_idx + (t * Hi + h) * di, key, di);
                acc += (v > 0.0f ? v : 0.0f) * scale * s->head_w[t * Hi + h];
            }
            sc[r] = acc;
        }
        int64_t *cols = s->cols + t * kc;
        int64_t n = top_rows(sc, R, kc, cols);
        for (int64_t j = 0; j < kc; j++) {
            s->crows[t * kc + j] = j < n ? vis->rows[t * R + cols[j]] : 0;
            s->cvalid[t * kc + j] = j < n;
        }
    }
}

typedef struct {  /* where one query's keys live */
    const float *swa, *fresh, *pool;
    int64_t n_ring, Kw, Kc, hd;
    const int64_t *keys, *crows;
    const uint8_t *valid, *cvalid;
} Keys;

static inline const float *key_row(const Keys *k, int64_t i) {
    return i < k->Kw ? row_of(k->swa, k->n_ring, k->fresh, k->keys[i], k->hd) : k->pool + k->crows[i - k->Kw] * k->hd;
}

/* one query head over its sliding keys and compressed keys, with the sink (sink_attention) */
static void attend(const float *q, const Keys *k, float sink, float *probs, float *out) {
    int64_t n = k->Kw + k->Kc, hd = k->hd;
    float scale = 1.0f / sqrtf((float)hd), mx = sink;
    for (int64_t i = 0; i < n; i++) {
        int ok = i < k->Kw ? k->valid[i] : k->cvalid[i - k->Kw];
        probs[i] = ok ? dot(q, key_row(k, i), hd) * scale : -INFINITY;
        mx = probs[i] > mx ? probs[i] : mx;
    }
    float denom = expf(sink - mx);
    for (int64_t i = 0; i < n; i++) denom += (probs[i] = expf(probs[i] - mx));
    for (int64_t c = 0; c < hd; c++) out[c] = 0.0f;
    for (int64_t i = 0; i < n; i++)
        if (probs[i] != 0.0f) axpy(out, probs[i] / denom, key_row(k, i), hd);
}

static void indexer_inputs(const Model *m, const Layer *L, const float *xn, int64_t T, AttnScratch *s) {
    const Dims *d = &m->d;
    int64_t Hi = d->idx_heads, di = d->idx_dim, half = d->rope_dim / 2;
    linear(s->qr, d->q_lora, T, d->q_lora, L->i_q_b, Hi * di, s->q_idx, Hi * di);
    linear(xn, d->hidden, T, d->hidden, L->i_w, Hi, s->head_w, Hi);
    for (int64_t t = 0; t < T; t++) {  /* s->rot rows hold the compress rotations (a CSA layer's own) */
        rope(s->q_idx + t * Hi * di, Hi, di, s->rot + t * half * 2, half, 0);
        for (int64_t h = 0; h < Hi; h++) s->head_w[t * Hi + h] *= 1.0f / sqrtf((float)Hi);
    }
}

/* q and kv of every token: projections, norms, RoPE (rotations kept in s->rot for the output) */
static void project(const Model *m, const Layer *L, const StepView *v, const float *xn, AttnScratch *s) {
    const Dims *d = &m->d;
    int64_t T = v->T, D = d->hidden, H = d->n_heads, hd = d->head_dim, half = d->rope_dim / 2;
    int sliding = L->kind == 0;
    linear(xn, D, T, D, L->q_a, d->q_lora, s->qr, d->q_lora);
    rms_norm(s->qr, T, d->q_lora, L->q_a_norm, d->rms_eps);
    linear(s->qr, d->q_lora, T, d->q_lora, L->q_b, H * hd, s->q, H * hd);
    linear(xn, D, T, D, L->kv, hd, s->kv, hd);
    #pragma omp parallel for num_threads(T >= 16 ? g_threads : 1) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        float *rot = s->rot + t * half * 2;
        rms_norm(s->q + t * H * hd, H, hd, NULL, d->rms_eps);
        rms_norm(s->kv + t * hd, 1, hd, L->kv_norm, d->rms_eps);
        rotation(rot, v->positions[t], sliding ? m->inv_freq_main : m->inv_freq_comp, half,
                 sliding ? m->af_main : m->af_comp);
        rope(s->q + t * H * hd, H, hd, rot, half, 0);
        rope(s->kv + t * hd, 1, hd, rot, half, 0);
    }
}

/* the compressor (and indexer) of a compressed layer: states, captures, emits; returns the keys
   (pool rows) every query sees beside its sliding ones */
static void compress(const Model *m, const Layer *L, const StepView *v, const float *xn, AttnScratch *s, Keys *k) {
    const Dims *d = &m->d;
    int64_t T = v->T, hd = d->head_dim;
    const CompView *cv = &v->comp[L->comp_key];
    const VisView *vis = &v->vis[L->vis_key];
    int csa = L->kind == 1, after = (int)v->after_write;
    Emitter ce = {L->c_kv, L->c_gate, L->c_ape, L->c_norm, L->comp_ring, L->comp_pool, L->snap_comp,
                  L->comp_ring_rows, hd * (csa ? 2 : 1), hd};
    Emitter ie = {L->i_kv, L->i_gate, L->i_ape, L->i_norm, L->idx_ring, L->idx_pool, L->snap_idx,
                  L->idx_ring_rows, 2 * d->idx_dim, d->idx_dim};
    token_states(&ce, cv, xn, T, d->hidden, v->positions, s->states_c);
    if (csa) token_states(&ie, cv, xn, T, d->hidden, v->positions, s->states_i);
    for (int i = 0; i < 1 + csa; i++) {
        const Emitter *e = i ? &ie : &ce;
        const float *st = i ? s->states_i : s->states_c;
        if (after) {
            write_ring(e->ring, st, cv->ring_dst, cv->ring_src, cv->M, 2 * e->width);
        } else {
            capture(v, cv->span, e->snap, e->ring, st, 2 * e->width);
        }
        emit_rows(m, e, cv, st, after, s->rot_emit);
    }
    k->pool = L->comp_pool;
    if (csa) {
        indexer_inputs(m, L, xn, T, s);
        k->Kc = d->idx_topk < vis->R ? d->idx_topk : vis->R;
        csa_rows(m, L, vis, T, s, k->Kc);
        k->crows = s->crows;
        k->cvalid = s->cvalid;
    } else {
        k->Kc = vis->R;
        k->crows = vis->rows;
        k->cvalid = vis->valid;
    }
}

static void attention(const Model *m, const Layer *L, const StepView *v, const float *xn, float *y, AttnScratch *s) {
    const Dims *d = &m->d;
    int64_t T = v->T, D = d->hidden, H = d->n_heads, hd = d->head_dim, half = d->rope_dim / 2;
    int after = (int)v->after_write;
    project(m, L, v, xn, s);
    if (after) {
        write_ring(L->swa, s->kv, v->swa_dst, v->swa_src, v->M, hd);
    } else {
        capture(v, d->window, L->snap_swa, L->swa, s->kv, hd);
    }
    Keys k0 = {L->swa, s->kv, NULL, after ? INT64_MAX : L->swa_rows, v->Kw, 0, hd, NULL, NULL, NULL, NULL};
    if (L->kind != 0) compress(m, L, v, xn, s, &k0);
    int64_t stride = k0.Kw + k0.Kc + 1;
    #pragma omp parallel for num_threads(T * H > 1 ? g_threads : 1) schedule(static)
    for (int64_t th = 0; th < T * H; th++) {
        int64_t t = th / H, h = th % H;
        Keys k = k0;
        k.keys = v->swa_keys + t * v->Kw;
        k.valid = v->swa_valid + t * v->Kw;
        if (k.Kc) {
            k.crows += t * k.Kc;
            k.cvalid += t * k.Kc;
        }
        attend(s->q + th * hd, &k, L->sinks[h], s->probs + th * stride, s->out + th * hd);
    }
    if (!after) {  /* prefill: every read of the rings is done; now this forward's rows go in */
        write_ring(L->swa, s->kv, v->swa_dst, v->swa_src, v->M, hd);
        if (L->kind != 0) {
            const CompView *cv = &v->comp[L->comp_key];
            write_ring(L->comp_ring, s->states_c, cv->ring_dst, cv->ring_src, cv->M, 2 * hd * (L->kind == 1 ? 2 : 1));
            if (L->kind == 1) write_ring(L->idx_ring, s->states_i, cv->ring_dst, cv->ring_src, cv->M, 4 * d->idx_dim);
        }
    }
    #pragma omp parallel for num_threads(T >= 16 ? g_threads : 1) schedule(static)
    for (int64_t t = 0; t < T; t++) rope(s->out + t * H * hd, H, hd, s->rot + t * half * 2, half, 1);
    int64_t G = d->o_groups, ol = d->o_lora, X = H * hd / G;
    for (int64_t g = 0; g < G; g++) {  /* block-diagonal o_a: group g of the heads by its own rows */
        Weight wg = L->o_a;
        wg.p += L->o_a.kn ? g * ol : g * ol * L->o_a.ld;
        linear(s->out + g * X, H * hd, T, X, wg, ol, s->o_mid + g * ol, G * ol);
    }
    linear(s->o_mid, G * ol, T, G * ol, L->o_b, D, y, D);
}

/* ---- mixture of experts (moe.py route / _grouped_pairs / swiglu) -------------------------------- */

typedef struct {
    float *logits, *weights, *xs, *h, *ys, *sh;
    int64_t *idx, *order, *counts;
} MoeScratch;

static inline float swiglu1(float g, float u, float limit) {
    g = g < limit ? g : limit;
    u = u < -limit ? -limit : (u > limit ? limit : u);
    return g / (1.0f + expf(-g)) * u;
}

static void route(const Model *m, const Layer *L, const float *xn, const int64_t *ids, const uint8_t *is_image,
                  int64_t T, MoeScratch *s) {
    const Dims *d = &m->d;
    int64_t E = d->n_experts, k = d->top_k;
    linear(xn, d->hidden, T, d->hidden, L->gate, E, s->logits, E);
    for (int64_t t = 0; t < T; t++) {
        float *sc = s->logits + t * E, sel[512];
        if (d->scoring == 0) {
            float mx = sc[0], sum = 0.0f;
            for (int64_t e = 1; e < E; e++) mx = sc[e] > mx ? sc[e] : mx;
            for (int64_t e = 0; e < E; e++) sum += (sc[e] = expf(sc[e] - mx));
            for (int64_t e = 0; e < E; e++) sc[e] /= sum;
        } else {
            for (int64_t e = 0; e < E; e++)
                sc[e] = d->scoring == 1 ? sigmoidf(sc[e]) : sqrtf(sc[e] > 20.0f ? sc[e] : log1pf(expf(sc[e])));
        }
        int64_t *idx = s->idx + t * k;
        int image = is_image && is_image[t] && L->bias_vl;
        if (L->tid2eid && !image) {
            int64_t id = ids[t] < 0 ? 0 : (ids[t] >= L->tid2eid_rows ? L->tid2eid_rows - 1 : ids[t]);
            for (int64_t j = 0; j < k; j++) idx[j] = L->tid2eid[id * k + j];
        } else {
            const float *bias = image ? L->bias_vl : L->gate_bias;
            for (int64_t e = 0; e < E; e++) sel[e] = sc[e] + (bias ? bias[e] : 0.0f);
            for (int64_t j = 0; j < k; j++) {  /* top-k, highest first (ties: lower expert id) */
                int64_t best = -1;
                for (int64_t e = 0; e < E; e++) {
                    int taken = 0;
                    for (int64_t i = 0; i < j; i++) taken |= idx[i] == e;
                    if (!taken && (best < 0 || sel[e] > sel[best])) best = e;
                }
                idx[j] = best;
            }
        }
        float sum = 0.0f, *w = s->weights + t * k;
        for (int64_t j = 0; j < k; j++) sum += (w[j] = sc[idx[j]]);
        for (int64_t j = 0; j < k; j++) w[j] = (d->norm_topk ? w[j] / (sum + 1e-20f) : w[j]) * d->routed_scale;
    }
}

static void experts(const Model *m, const Layer *L, const float *xn, int64_t T, float *out, MoeScratch *s) {
    const Dims *d = &m->d;
    int64_t E = d->n_experts, k = d->top_k, D = d->hidden, I = d->moe_inter, P = T * k;
    memset(s->counts, 0, (size_t)(E + 1) * 8);
    for (int64_t p = 0; p < P; p++) s->counts[s->idx[p] + 1]++;
    for (int64_t e = 0; e < E; e++) s->counts[e + 1] += s->counts[e];  /* start of each expert's pairs */
    int64_t fill[1024];
    for (int64_t e = 0; e < E; e++) fill[e] = s->counts[e];
    for (int64_t p = 0; p < P; p++) s->order[fill[s->idx[p]]++] = p;  /* pairs sorted by expert, stable */
    for (int64_t i = 0; i < P; i++) memcpy(s->xs + i * D, xn + (s->order[i] / k) * D, (size_t)D * 4);
    for (int64_t e = 0; e < E; e++) {
        int64_t a = s->counts[e], n = s->counts[e + 1] - a;
        if (!n) continue;
        Weight gu = {L->exp_gate_up + e * 2 * I * D, D, 0}, dn = {L->exp_down + e * D * I, I, 0};
        linear(s->xs + a * D, D, n, D, gu, 2 * I, s->h + a * 2 * I, 2 * I);
        for (int64_t i = a; i < a + n; i++) {
            float *h = s->h + i * 2 * I;
            for (int64_t c = 0; c < I; c++) h[c] = swiglu1(h[c], h[I + c], d->swiglu_limit);
        }
        linear(s->h + a * 2 * I, 2 * I, n, I, dn, D, s->ys + a * D, D);
    }
    memset(out, 0, (size_t)(T * D) * 4);
    for (int64_t i = 0; i < P; i++) axpy(out + (s->order[i] / k) * D, s->weights[s->order[i]], s->ys + i * D, D);
}

static void moe(const Model *m, const Layer *L, const float *xn, const int64_t *ids, const uint8_t *is_image,
                int64_t T, float *y, MoeScratch *s) {
    const Dims *d = &m->d;
    int64_t D = d->hidden, W = d->shared_inter;
    route(m, L, xn, ids, is_image, T, s);
    experts(m, L, xn, T, y, s);
    if (!L->has_shared) return;
    linear(xn, D, T, D, L->sh_gate, W, s->sh, 2 * W);
    linear(xn, D, T, D, L->sh_up, W, s->sh + W, 2 * W);
    for (int64_t t = 0; t < T; t++) {
        float *h = s->sh + t * 2 * W;
        for (int64_t c = 0; c < W; c++) h[c] = swiglu1(h[c], h[W + c], d->swiglu_limit);
    }
    linear(s->sh, 2 * W, T, W, L->sh_down, D, s->ys, D);  /* ys is free again: the routed sum is in y */
    for (int64_t i = 0; i < T * D; i++) y[i] += s->ys[i];
}

/* ---- the step --------------------------------------------------------------------------------- */

typedef struct {
    float *flat, *z, *x, *post, *comb, *y, *tmp;
    AttnScratch a;
    MoeScratch e;
} Scratch;

static int64_t max_i(int64_t a, int64_t b) { return a > b ? a : b; }

typedef struct {
    void **slot;
    int64_t floats;  /* 4-byte units (an int64 takes two) */
} Need;

/* lay the step's scratch out in the arena (or, with dry, only add up its bytes) */
static int64_t plan_scratch(const Model *m, const StepView *v, Arena *ar, Scratch *s, int dry) {
    const Dims *d = &m->d;
    int64_t T = v->T, D = d->hidden, hc = d->hc, H = d->n_heads, hd = d->head_dim, n_mix = (2 + hc) * hc;
    int64_t Rmax = 0;
    for (int64_t i = 0; i < v->n_vis; i++) Rmax = max_i(Rmax, v->vis[i].R);
    int64_t Kc = max_i(Rmax, d->idx_topk), P = T * d->top_k, I = d->moe_inter, Hi = d->idx_heads;
    Need needs[] = {
        {(void **)&s->flat, T * hc * D}, {(void **)&s->z, T * n_mix}, {(void **)&s->x, T * D},
        {(void **)&s->post, T * hc}, {(void **)&s->comb, T * hc * hc}, {(void **)&s->y, T * D},
        {(void **)&s->tmp, T * hc * D},
        {(void **)&s->a.q, T * H * hd}, {(void **)&s->a.kv, T * hd}, {(void **)&s->a.qr, T * d->q_lora},
        {(void **)&s->a.out, T * H * hd}, {(void **)&s->a.o_mid, T * d->o_groups * d->o_lora},
        {(void **)&s->a.rot, T * d->rope_dim}, {(void **)&s->a.rot_emit, T * d->rope_dim},
        {(void **)&s->a.states_c, T * 4 * hd}, {(void **)&s->a.states_i, T * 4 * d->idx_dim},
        {(void **)&s->a.q_idx, T * Hi * d->idx_dim}, {(void **)&s->a.head_w, T * Hi},
        {(void **)&s->a.scores, T * Rmax}, {(void **)&s->a.probs, T * H * (v->Kw + Kc + 1)},
        {(void **)&s->a.cols, T * Kc * 2}, {(void **)&s->a.crows, T * Kc * 2}, {(void **)&s->a.cvalid, T * Kc},
        {(void **)&s->e.logits, T * d->n_experts}, {(void **)&s->e.weights, P}, {(void **)&s->e.xs, P * D},
        {(void **)&s->e.h, P * 2 * I}, {(void **)&s->e.ys, max_i(P, T) * D}, {(void **)&s->e.sh, T * 2 * d->shared_inter},
        {(void **)&s->e.idx, P * 2}, {(void **)&s->e.order, P * 2}, {(void **)&s->e.counts, (d->n_experts + 1) * 2},
    };
    int64_t total = 0;
    for (size_t i = 0; i < sizeof needs / sizeof needs[0]; i++) {
        int64_t n = max_i(needs[i].floats, 1);
        total += ((n * 4 + 63) / 64) * 64;
        if (!dry) *needs[i].slot = take(ar, n);
    }
    return total;
}

static void layer_forward(const Model *m, const Layer *L, const StepView *v, float *streams, Scratch *s) {
    const Dims *d = &m->d;
    int64_t T = v->T, D = d->hidden;
    hc_pre(d, streams, T, L->hc_attn_fn, L->hc_attn_base, L->hc_attn_scale, s->x, s->post, s->comb, s->flat, s->z);
    rms_norm(s->x, T, D, L->attn_norm, d->rms_eps);
    attention(m, L, v, s->x, s->y, &s->a);
    hc_post(d, streams, T, s->y, s->post, s->comb, s->tmp);
    hc_pre(d, streams, T, L->hc_ffn_fn, L->hc_ffn_base, L->hc_ffn_scale, s->x, s->post, s->comb, s->flat, s->z);
    rms_norm(s->x, T, D, L->ffn_norm, d->rms_eps);
    moe(m, L, s->x, v->ids, v->is_image, T, s->y, &s->e);
    hc_post(d, streams, T, s->y, s->post, s->comb, s->tmp);
}

/* DS4ForCausalLM.embed: token rows expanded to hc streams; image-block tokens (ids vocab + type) take
   their sentinel row, and IMAGE slots the aligner rows (spec ds4-vision 3.3). -2: an id out of range */
static int embed(const Model *m, const StepView *v, float *streams) {
    const Dims *d = &m->d;
    int64_t T = v->T, D = d->hidden, hc = d->hc;
    const float *sentinel[5] = {m->image_start, m->image_pad, NULL, m->image_newline, m->image_end};
    for (int64_t t = 0; t < T; t++) {
        int64_t id = v->ids[t];
        const float *row = NULL;
        if (v->is_image && v->is_image[t]) {
            int64_t kind = id - d->vocab;
            if (kind < 0 || kind > 4 || (kind != 2 && !sentinel[kind])) return -2;
            row = sentinel[kind];  /* NULL for IMAGE slots: zero until their aligner row lands */
        } else if (id < 0 || id >= d->vocab) {
            return -2;
        } else {
            row = m->embed + id * D;
        }
        for (int64_t i = 0; i < hc; i++) {
            float *o = streams + (t * hc + i) * D;
            if (row) memcpy(o, row, (size_t)D * 4); else memset(o, 0, (size_t)D * 4);
        }
    }
    for (int64_t r = 0; r < v->n_image_rows; r++) {
        int64_t t = v->image_rows[r];
        if (t < 0 || t >= T) return -2;
        for (int64_t i = 0; i < hc; i++) memcpy(streams + (t * hc + i) * D, v->image_embeds + r * D, (size_t)D * 4);
    }
    return 0;
}

/* layers [start, stop) of the step's rows on streams [T, hc, D] in place; with start 0 the streams
   are embedded first. 0 on success, -1 without memory, -2 for an id out of range (nothing written). */
int ds4_forward(const Model *m, const StepView *v, float *streams, int64_t start, int64_t stop, Arena *ar,
                int threads) {
    Scratch s;
    g_threads = threads > 0 ? threads : 1;
    if (start == 0) {
        int rc = embed(m, v, streams);
        if (rc) return rc;
    }
    if (arena_reserve(ar, plan_scratch(m, v, ar, &s, 1)) != 0) return -1;
    plan_scratch(m, v, ar, &s, 0);
    for (int64_t l = start; l < stop && l < m->n_layers; l++) layer_forward(m, &m->layers[l], v, streams, &s);
    return 0;
}

/* DS4ForCausalLM.logits: hc_head, the final norm, the LM head -> logits [N, vocab] */
int ds4_logits(const Model *m, const float *streams, int64_t N, float *logits, Arena *ar, int threads) {
    const Dims *d = &m->d;
    int64_t D = d->hidden, hc = d->hc;
    g_threads = threads > 0 ? threads : 1;
    if (arena_reserve(ar, (N * hc * D + N * hc + N * D) * 4 + 256) != 0) return -1;
    float *flat = take(ar, N * hc * D), *mix = take(ar, N * hc), *h = take(ar, N * D);
    memcpy(flat, streams, (size_t)(N * hc * D) * 4);
    rms_norm(flat, N, hc * D, NULL, d->rms_eps);
    linear(flat, hc * D, N, hc * D, m->head_fn, hc, mix, hc);
    for (int64_t t = 0; t < N; t++) {
        float *ht = h + t * D;
        for (int64_t k = 0; k < D; k++) ht[k] = 0.0f;
        for (int64_t i = 0; i < hc; i++) {
            float pre = sigmoidf(mix[t * hc + i] * m->head_scale[0] + m->head_base[i]) + d->hc_eps;
            axpy(ht, pre, streams + (t * hc + i) * D, D);
        }
    }
    rms_norm(h, N, D, m->final_norm, d->rms_eps);
    linear(h, D, N, D, m->lm_head, d->vocab, logits, d->vocab);
    return 0;
}
