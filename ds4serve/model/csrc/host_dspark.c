/* The DSpark block drafter's forward on the host (model/dspark.py's commit and draft), one call each.

   Why: the torch drafter is ~300 dispatched ops a block (two mHC Sinkhorns, the block attention, the
   MoE, the head, five Markov slots), 2.3-3.3 ms on two cores for arithmetic worth ~0.05 ms, against a
   ~0.7 ms target decode step: drafting cost more than it saved. Here the same network runs as plain
   loops over raw fp32 pointers, one request at a time, every row in a fixed order, so a request's
   drafts never depend on the batch it is drafted in. The block's products read each linear transposed
   ([in, out], a copy NativeDSpark keeps) and accumulate output vectors along the input axis with the
   explicit vfma of host.h (the build uses -ffp-contract=off), a weight vector shared by up to four rows
   (ds_linear_rows); the few narrow ones (router, mHC, confidence) are dot products (ds_dots).

   Its own translation unit (native_dspark.py builds it): it includes host.h for the vector type and
   vfma only, and no other part, so the trunk's kernels can change without touching it.

   Formulas and the Python function each mirrors:
     commit:  main_x = rms_norm(main_proj @ concat(captured), main_norm); per stage
              row = rope(rms_norm(wkv @ main_x, kv_norm), pos) at ring slot pos % window  (dspark.commit)
     draft:   block [anchor, noise x (B-1)] at p .. p+B-1 through every stage (dspark.stage_block: mHC,
              sink attention over valid ring rows + the block, mHC, routed + shared experts), the last
              stage's hc_head, norm, the shared LM head (dspark.draft); then, when greedy, the Markov
              and confidence heads left to right (dspark.markov_sample with an argmax sampler). */
#include "host.h"

#include <time.h>

typedef struct {  /* field order: native_dspark.py _Dims */
    int64_t D, hc, H, hd, rd, q_lora, o_groups, o_lora, n_exp, top_k, inter, sh_inter, V, iters, scoring,
        norm_topk, W, S, B, rank, L, noise, lm_kn, capacity;
    float eps, hc_eps, limit, rscale;
} DSDims;

/* one stage's tensors, all fp32 and contiguous (native_dspark.py _Stage): the linears read by
   ds_linear_rows transposed, [in, out] (wq_a, wq_b, wkv, wo_b, the shared experts; wo_a [G, in / G, o_lora]
   and the experts [E, in, out], per group / expert), the rest as stored */
typedef struct {
    const float *hc_attn_fn, *hc_attn_base, *hc_attn_scale, *hc_ffn_fn, *hc_ffn_base, *hc_ffn_scale;
    const float *attn_norm, *ffn_norm, *wq_a, *q_norm, *wq_b, *wkv, *kv_norm, *sink, *wo_a, *wo_b;
    const float *gate, *gate_bias, *gate_up, *down, *sh_w1, *sh_w3, *sh_w2;
} DSStage;

typedef struct {  /* native_dspark.py _Model; main_proj [L * D, D] and w2 [rank, V] transposed too */
    DSDims d;
    const DSStage *stages;
    const float *main_proj, *main_norm, *norm, *head_fn, *head_base, *head_scale, *w1, *w2, *wc;
    const float *embed, *lm_head, *inv_freq;
} DSModel;

/* ---- small kernels --------------------------------------------------------------------------- */

/* y[n] = W[n, :] . x for outputs [n0, n1) (W [N, K] contiguous): four outputs a pass, vectors along K */
static void ds_dots(const float *x, const float *w, int64_t n0, int64_t n1, int64_t k, float *y) {
    int64_t kv = k - k % VW, n = n0;
    for (; n + 4 <= n1; n += 4) {
        const float *w0 = w + n * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
        vf a0 = vsplat(0), a1 = vsplat(0), a2 = vsplat(0), a3 = vsplat(0);
        for (int64_t i = 0; i < kv; i += VW) {
            vf xv = vload(x + i);
            a0 = vfma(vload(w0 + i), xv, a0);
            a1 = vfma(vload(w1 + i), xv, a1);
            a2 = vfma(vload(w2 + i), xv, a2);
            a3 = vfma(vload(w3 + i), xv, a3);
        }
        float s0 = vsum(a0), s1 = vsum(a1), s2 = vsum(a2), s3 = vsum(a3);
        for (int64_t i = kv; i < k; i++) {
            s0 = sfma(w0[i], x[i], s0), s1 = sfma(w1[i], x[i], s1);
            s2 = sfma(w2[i], x[i], s2), s3 = sfma(w3[i], x[i], s3);
        }
        y[n] = s0, y[n + 1] = s1, y[n + 2] = s2, y[n + 3] = s3;
    }
    for (; n < n1; n++) {
        const float *wr = w + n * k;
        vf a = vsplat(0);
        for (int64_t i = 0; i < kv; i += VW) a = vfma(vload(wr + i), vload(x + i), a);
        float s = vsum(a);
        for (int64_t i = kv; i < k; i++) s = sfma(wr[i], x[i], s);
        y[n] = s;
    }
}

/* y[r, :] = x[r, :] W^T for `rows` rows (x stride ldx, y stride ldy), from the weight transposed: wt [K, N]
   contiguous (NativeDSpark keeps that copy of each [N, K] linear). Output vectors are accumulated along k
   with the block's rows inner, so one weight vector feeds up to DS_KN_R rows' multiply-adds from registers:
   ds_dots over [N, K] spent a horizontal sum per output and ran at a third of this on the drafter's K of
   128-384 (half of a block's time). Every output is one chain of fused multiply-adds in k order from 0,
   in a vector lane or (the last N % VW outputs) in sfma: the same bits whatever `rows`, the grouping or
   the lane, so a request's block does not depend on its batch. */
#define DS_KN_R 4
#define DS_KN_V 4
/* R rows (<= DS_KN_R) over panels of NV output vectors (<= DS_KN_V): R x NV independent chains */
static inline __attribute__((always_inline)) void ds_kn_group(const float *x, int64_t ldx, const float *wt,
                                                              int64_t n_out, int64_t k, float *y, int64_t ldy,
                                                              const int R, const int NV) {
    int64_t nv = n_out - n_out % VW, n = 0;
    for (; n + NV * VW <= nv; n += NV * VW) {
        vf a[DS_KN_R][DS_KN_V];
        for (int j = 0; j < R; j++)
            for (int v = 0; v < NV; v++) a[j][v] = vsplat(0);
        for (int64_t i = 0; i < k; i++) {
            vf w[DS_KN_V];
            for (int v = 0; v < NV; v++) w[v] = vload(wt + i * n_out + n + v * VW);
            for (int j = 0; j < R; j++) {
                vf xv = vsplat(x[j * ldx + i]);
                for (int v = 0; v < NV; v++) a[j][v] = vfma(w[v], xv, a[j][v]);
            }
        }
        for (int j = 0; j < R; j++)
            for (int v = 0; v < NV; v++) vstore(y + j * ldy + n + v * VW, a[j][v]);
    }
    for (; n < nv; n += VW) {
        vf a[DS_KN_R];
        for (int j = 0; j < R; j++) a[j] = vsplat(0);
        for (int64_t i = 0; i < k; i++) {
            vf w0 = vload(wt + i * n_out + n);
            for (int j = 0; j < R; j++) a[j] = vfma(w0, vsplat(x[j * ldx + i]), a[j]);
        }
        for (int j = 0; j < R; j++) vstore(y + j * ldy + n, a[j]);
    }
    for (; n < n_out; n++)
        for (int j = 0; j < R; j++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < k; i++) acc = sfma(wt[i * n_out + n], x[j * ldx + i], acc);
            y[j * ldy + n] = acc;
        }
}

/* groups of DS_KN_R rows over 2-vector panels, the last 1-3 rows over wider ones (chains enough to hide
   the multiply-add latency with fewer rows) */
static void ds_linear_rows(const float *x, int64_t ldx, int64_t rows, const float *wt, int64_t n_out, int64_t k,
                           float *y, int64_t ldy) {
    int64_t r = 0;
    for (; r + DS_KN_R <= rows; r += DS_KN_R)
        ds_kn_group(x + r * ldx, ldx, wt, n_out, k, y + r * ldy, ldy, DS_KN_R, 2);
    switch (rows - r) {
        case 3: ds_kn_group(x + r * ldx, ldx, wt, n_out, k, y + r * ldy, ldy, 3, 2); break;
        case 2: ds_kn_group(x + r * ldx, ldx, wt, n_out, k, y + r * ldy, ldy, 2, 4); break;
        case 1: ds_kn_group(x + r * ldx, ldx, wt, n_out, k, y + r * ldy, ldy, 1, 4); break;
        default: break;
    }
}

/* y[r, :] = W x[r, :] for `rows` rows of x [rows, K] over W [N, K] as stored (an LM head the host forward
   left [V, D]): blocks of 16 weight rows outer, the rows inner, so a weight is read once per call */
static void ds_dots_rows(const float *x, int64_t rows, const float *w, int64_t n_out, int64_t k, float *y) {
    for (int64_t n = 0; n < n_out; n += 16) {
        int64_t n1 = n + 16 < n_out ? n + 16 : n_out;
        for (int64_t r = 0; r < rows; r++) ds_dots(x + r * k, w, n, n1, k, y + r * n_out);
    }
}

static void ds_linear(const float *x, const float *w, int64_t n_out, int64_t k, float *y) {
    ds_dots(x, w, 0, n_out, k, y);
}

/* x . y over n (vectors, then the tail) */
static float ds_dot(const float *x, const float *y, int64_t n) {
    int64_t nv = n - n % VW;
    vf a = vsplat(0);
    for (int64_t i = 0; i < nv; i += VW) a = vfma(vload(x + i), vload(y + i), a);
    float s = vsum(a);
    for (int64_t i = nv; i < n; i++) s = sfma(x[i], y[i], s);
    return s;
}

/* y[r, n] = sum_k x[r, k] W[k, n] for `rows` rows (W [K, N] contiguous: a transposed [N, K] parameter,
   e.g. the LM head as the host forward stores it); four output vectors a pass, the rows inner */
static void ds_linear_kn_rows(const float *x, int64_t rows, const float *w, int64_t n_out, int64_t k, float *y) {
    int64_t nv = n_out - n_out % VW, n = 0;
    for (; n + 4 * VW <= nv; n += 4 * VW)
        for (int64_t r = 0; r < rows; r++) {
            const float *xr = x + r * k;
            vf a0 = vsplat(0), a1 = vsplat(0), a2 = vsplat(0), a3 = vsplat(0);
            for (int64_t i = 0; i < k; i++) {
                const float *wr = w + i * n_out + n;
                vf xv = vsplat(xr[i]);
                a0 = vfma(vload(wr), xv, a0), a1 = vfma(vload(wr + VW), xv, a1);
                a2 = vfma(vload(wr + 2 * VW), xv, a2), a3 = vfma(vload(wr + 3 * VW), xv, a3);
            }
            float *yr = y + r * n_out + n;
            vstore(yr, a0), vstore(yr + VW, a1), vstore(yr + 2 * VW, a2), vstore(yr + 3 * VW, a3);
        }
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * k;
        for (int64_t c = n; c < nv; c += VW) {
            vf a = vsplat(0);
            for (int64_t i = 0; i < k; i++) a = vfma(vload(w + i * n_out + c), vsplat(xr[i]), a);
            vstore(y + r * n_out + c, a);
        }
        for (int64_t c = nv; c < n_out; c++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < k; i++) acc = sfma(xr[i], w[i * n_out + c], acc);
            y[r * n_out + c] = acc;
        }
    }
}

/* norms.rms_norm / rms_norm_unweighted (weight NULL), in place or into out */
static void ds_rms(const float *x, const float *weight, int64_t n, float eps, float *out) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss = sfma(x[i], x[i], ss);
    float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = weight ? x[i] * r * weight[i] : x[i] * r;
}

static float ds_sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

/* rope.apply_rope on the trailing 2 * half channels of one head (interleaved pairs) at position pos */
static void ds_rope(float *x, int64_t hd, int64_t rd, const float *inv_freq, int64_t pos, int inverse) {
    float *p = x + hd - rd;
    for (int64_t j = 0; j < rd / 2; j++) {
        float f = (float)pos * inv_freq[j], c = cosf(f), s = sinf(f);
        if (inverse) s = -s;
        float a = p[2 * j], b = p[2 * j + 1];
        p[2 * j] = a * c - b * s;
        p[2 * j + 1] = a * s + b * c;
    }
}

/* ---- mHC (mhc.py) ---------------------------------------------------------------------------- */

/* hc_pre of one row: streams [hc, D] -> x [D], post [hc], comb [hc, hc]; scratch >= hc * D + (2 + hc) * hc */
static void ds_hc_pre(const DSDims *d, const float *streams, const float *fn, const float *base, const float *scale,
                      float *x, float *post, float *comb, float *scratch) {
    int64_t hc = d->hc, D = d->D, m = (2 + hc) * hc;
    float *flat = scratch, *z = scratch + hc * D, pre[DS4_MAX_HC];
    ds_rms(streams, NULL, hc * D, d->eps, flat);
    ds_linear(flat, fn, m, hc * D, z);
    for (int64_t i = 0; i < m; i++) z[i] = base[i] + z[i] * scale[i < hc ? 0 : i < 2 * hc ? 1 : 2];
    for (int64_t i = 0; i < hc; i++) pre[i] = ds_sigmoid(z[i]) + d->hc_eps, post[i] = 2.0f * ds_sigmoid(z[hc + i]);
    for (int64_t i = 0; i < hc; i++) {  /* softmax over each row of comb_z, then + eps */
        const float *zr = z + 2 * hc + i * hc;
        float mx = zr[0], sum = 0.0f;
        for (int64_t j = 1; j < hc; j++) mx = zr[j] > mx ? zr[j] : mx;
        for (int64_t j = 0; j < hc; j++) comb[i * hc + j] = expf(zr[j] - mx), sum += comb[i * hc + j];
        for (int64_t j = 0; j < hc; j++) comb[i * hc + j] = comb[i * hc + j] / sum + d->hc_eps;
    }
    for (int64_t it = 0; it < d->iters; it++) {  /* mhc.sinkhorn: columns, then (rows, columns) pairs */
        if (it > 0)
            for (int64_t i = 0; i < hc; i++) {
                float s = d->hc_eps;
                for (int64_t j = 0; j < hc; j++) s += comb[i * hc + j];
                for (int64_t j = 0; j < hc; j++) comb[i * hc + j] /= s;
            }
        for (int64_t j = 0; j < hc; j++) {
            float s = d->hc_eps;
            for (int64_t i = 0; i < hc; i++) s += comb[i * hc + j];
            for (int64_t i = 0; i < hc; i++) comb[i * hc + j] /= s;
        }
    }
    for (int64_t k = 0; k < D; k++) {
        float s = 0.0f;
        for (int64_t i = 0; i < hc; i++) s = sfma(pre[i], streams[i * D + k], s);
        x[k] = s;
    }
}

/* hc_post in place: X'[j] = post[j] * y + sum_i comb[i, j] X[i] */
static void ds_hc_post(const DSDims *d, float *streams, const float *y, const float *post, const float *comb,
                       float *scratch) {
    int64_t hc = d->hc, D = d->D;
    memcpy(scratch, streams, (size_t)(hc * D) * sizeof(float));
    for (int64_t j = 0; j < hc; j++)
        for (int64_t k = 0; k < D; k++) {
            float s = post[j] * y[k];
            for (int64_t i = 0; i < hc; i++) s = sfma(comb[i * hc + j], scratch[i * D + k], s);
            streams[j * D + k] = s;
        }
}

/* hc_head of one row: streams [hc, D] -> h [D] */
static void ds_hc_head(const DSModel *m, const float *streams, float *h, float *scratch) {
    const DSDims *d = &m->d;
    int64_t hc = d->hc, D = d->D;
    float z[DS4_MAX_HC];
    ds_rms(streams, NULL, hc * D, d->eps, scratch);
    ds_linear(scratch, m->head_fn, hc, hc * D, z);
    for (int64_t i = 0; i < hc; i++) z[i] = ds_sigmoid(z[i] * m->head_scale[0] + m->head_base[i]) + d->hc_eps;
    for (int64_t k = 0; k < D; k++) {
        float s = 0.0f;
        for (int64_t i = 0; i < hc; i++) s = sfma(z[i], streams[i * D + k], s);
        h[k] = s;
    }
}

/* ---- a stage (dspark.stage_attention, stage_moe) --------------------------------------------- */

/* the attention output o [H * hd] of block row b: sink softmax over the valid ring rows of stage s, then
   the block's own K=V rows, accumulated in registers (hd a multiple of VW) or by axpy */
static void ds_attend(const DSModel *m, const DSStage *st, int64_t s, const float *q, const float *kv,
                      const float *ring, const uint8_t *valid, float *att, float *o) {
    const DSDims *d = &m->d;
    int64_t H = d->H, hd = d->hd, W = d->W, B = d->B;
    float scale = 1.0f / sqrtf((float)hd);
    for (int64_t h = 0; h < H; h++) {
        const float *qh = q + h * hd;
        float mx = st->sink[h], sum;
        for (int64_t w = 0; w < W + B; w++) {
            if (w < W && !valid[w]) continue;
            att[w] = ds_dot(qh, w < W ? ring + (w * d->S + s) * hd : kv + (w - W) * hd, hd) * scale;
            mx = att[w] > mx ? att[w] : mx;
        }
        sum = expf(st->sink[h] - mx);
        for (int64_t w = 0; w < W + B; w++) {
            if (w < W && !valid[w]) continue;
            att[w] = expf(att[w] - mx);
            sum += att[w];
        }
        for (int64_t w = 0; w < W + B; w++)  /* the weights, divided once (not once per output vector) */
            if (w >= W || valid[w]) att[w] /= sum;
        float *oh = o + h * hd;
        int64_t cv = hd - hd % VW;
        int64_t c0 = 0;
        for (; c0 + 4 * VW <= cv; c0 += 4 * VW) {  /* keys outer: four chains in registers, each in key order */
            vf a0 = vsplat(0), a1 = vsplat(0), a2 = vsplat(0), a3 = vsplat(0);
            for (int64_t w = 0; w < W + B; w++) {
                if (w < W && !valid[w]) continue;
                const float *key = (w < W ? ring + (w * d->S + s) * hd : kv + (w - W) * hd) + c0;
                vf p = vsplat(att[w]);
                a0 = vfma(p, vload(key), a0), a1 = vfma(p, vload(key + VW), a1);
                a2 = vfma(p, vload(key + 2 * VW), a2), a3 = vfma(p, vload(key + 3 * VW), a3);
            }
            vstore(oh + c0, a0), vstore(oh + c0 + VW, a1), vstore(oh + c0 + 2 * VW, a2), vstore(oh + c0 + 3 * VW, a3);
        }
        for (; c0 < cv; c0 += VW) {
            vf a = vsplat(0);
            for (int64_t w = 0; w < W + B; w++) {
                if (w < W && !valid[w]) continue;
                a = vfma(vsplat(att[w]), vload((w < W ? ring + (w * d->S + s) * hd : kv + (w - W) * hd) + c0), a);
            }
            vstore(oh + c0, a);
        }
        for (int64_t c = cv; c < hd; c++) {
            float a = 0.0f;
            for (int64_t w = 0; w < W + B; w++) {
                if (w < W && !valid[w]) continue;
                a = sfma(att[w], (w < W ? ring + (w * d->S + s) * hd : kv + (w - W) * hd)[c], a);
            }
            oh[c] = a;
        }
    }
}

/* DSparkAttention of the block's B rows of one request: x [B, D] normed -> out [B, D]; keys: ring rows
   ring [W, S, hd] of stage s where valid, then the block's own K=V rows; rope tables cs [B, rd] */
static void ds_attention(const DSModel *m, const DSStage *st, int64_t s, const float *x, const float *ring,
                         const uint8_t *valid, int64_t p0, float *out, float *scratch) {
    const DSDims *d = &m->d;
    int64_t B = d->B, H = d->H, hd = d->hd, W = d->W, D = d->D, G = d->o_groups, hh = H * hd;
    float *q = scratch, *kv = q + B * hh, *qr = kv + B * hd, *att = qr + B * d->q_lora, *low = att + W + B + 1;
    float *o = low + B * G * d->o_lora;  /* [B, H * hd] */
    ds_linear_rows(x, D, B, st->wq_a, d->q_lora, D, qr, d->q_lora);
    for (int64_t b = 0; b < B; b++) ds_rms(qr + b * d->q_lora, st->q_norm, d->q_lora, d->eps, qr + b * d->q_lora);
    ds_linear_rows(qr, d->q_lora, B, st->wq_b, hh, d->q_lora, q, hh);
    ds_linear_rows(x, D, B, st->wkv, hd, D, kv, hd);
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < H; h++) {
            float *qh = q + b * hh + h * hd;
            ds_rms(qh, NULL, hd, d->eps, qh);  /* Q_HEAD_NORM */
            ds_rope(qh, hd, d->rd, m->inv_freq, p0 + b, 0);
        }
        ds_rms(kv + b * hd, st->kv_norm, hd, d->eps, kv + b * hd);
        ds_rope(kv + b * hd, hd, d->rd, m->inv_freq, p0 + b, 0);
    }
    for (int64_t b = 0; b < B; b++) {
        ds_attend(m, st, s, q + b * hh, kv, ring, valid, att, o + b * hh);
        for (int64_t h = 0; h < H; h++) ds_rope(o + b * hh + h * hd, hd, d->rd, m->inv_freq, p0 + b, 1);
    }
    int64_t gin = hh / G, lw = G * d->o_lora;  /* wo_a: [G * o_lora, H * hd / G], block-diagonal by group */
    for (int64_t g = 0; g < G; g++)
        ds_linear_rows(o + g * gin, hh, B, st->wo_a + g * d->o_lora * gin, d->o_lora, gin, low + g * d->o_lora, lw);
    ds_linear_rows(low, lw, B, st->wo_b, D, lw, out, D);
}

static float ds_score(float v, int64_t scoring) {
    if (scoring == 2) return sqrtf(v > 20.0f ? v : log1pf(expf(v)));  /* sqrt(softplus) */
    return ds_sigmoid(v);
}

static float ds_swiglu(float g, float u, float limit) {
    g = g < limit ? g : limit;
    u = u < -limit ? -limit : u > limit ? limit : u;
    return g / (1.0f + expf(-g)) * u;
}

/* moe.route of one row (learned: the bias steers selection only): top_k experts into idx, weights into wts */
static void ds_route(const DSDims *d, const DSStage *st, const float *x, int64_t *idx, float *wts) {
    int64_t E = d->n_exp;
    float sc[DS4_MAX_EXPERTS], sel[DS4_MAX_EXPERTS], wsum = 0.0f;
    ds_linear(x, st->gate, E, d->D, sc);
    if (d->scoring == 0) {  /* softmax */
        float mx = sc[0], s = 0.0f;
        for (int64_t e = 1; e < E; e++) mx = sc[e] > mx ? sc[e] : mx;
        for (int64_t e = 0; e < E; e++) sc[e] = expf(sc[e] - mx), s += sc[e];
        for (int64_t e = 0; e < E; e++) sc[e] /= s;
    } else {
        for (int64_t e = 0; e < E; e++) sc[e] = ds_score(sc[e], d->scoring);
    }
    for (int64_t e = 0; e < E; e++) sel[e] = st->gate_bias ? sc[e] + st->gate_bias[e] : sc[e];
    for (int64_t k = 0; k < d->top_k; k++) {  /* top-k by selection score (first index on ties) */
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t j = 0; j < k; j++) taken |= idx[j] == e;
            if (!taken && (best < 0 || sel[e] > sel[best])) best = e;
        }
        idx[k] = best, wts[k] = sc[best], wsum += sc[best];
    }
    for (int64_t k = 0; k < d->top_k; k++)
        wts[k] = (d->norm_topk ? wts[k] / (wsum + 1e-20f) : wts[k]) * d->rscale;
}

#define DS_MAX_ROUTES 1024  /* block rows x top_k (ds_draft refuses more) */

/* the stage's MoE for the B block rows x [B, D] -> out [B, D]: each expert once over the rows routed to
   it (its weights read once), added to a row's sum in expert order, then the shared expert; a row's
   result depends on that row alone */
static void ds_moe(const DSDims *d, const DSStage *st, const float *x, float *out, float *scratch) {
    int64_t D = d->D, I = d->inter, B = d->B, K = d->top_k, mi = I > d->sh_inter ? I : d->sh_inter;
    int64_t idx[DS_MAX_ROUTES], rows[DS_MAX_ROUTES];
    float wts[DS_MAX_ROUTES], rw[DS_MAX_ROUTES];
    float *xs = scratch, *h = xs + B * D, *act = h + 2 * B * mi, *ys = act + B * mi;
    for (int64_t b = 0; b < B; b++) ds_route(d, st, x + b * D, idx + b * K, wts + b * K);
    memset(out, 0, (size_t)(B * D) * sizeof(float));
    for (int64_t e = 0; e < d->n_exp; e++) {
        int64_t n = 0;
        for (int64_t b = 0; b < B; b++)
            for (int64_t k = 0; k < K; k++)
                if (idx[b * K + k] == e) rows[n] = b, rw[n] = wts[b * K + k], n++;
        if (n == 0) continue;
        for (int64_t j = 0; j < n; j++) memcpy(xs + j * D, x + rows[j] * D, (size_t)D * sizeof(float));
        ds_linear_rows(xs, D, n, st->gate_up + e * 2 * I * D, 2 * I, D, h, 2 * I);
        for (int64_t j = 0; j < n; j++)
            for (int64_t i = 0; i < I; i++)
                act[j * I + i] = ds_swiglu(h[j * 2 * I + i], h[j * 2 * I + I + i], d->limit) * rw[j];
        ds_linear_rows(act, I, n, st->down + e * D * I, D, I, ys, D);
        for (int64_t j = 0; j < n; j++)
            for (int64_t c = 0; c < D; c++) out[rows[j] * D + c] += ys[j * D + c];
    }
    if (st->sh_w1) {
        int64_t S = d->sh_inter;
        ds_linear_rows(x, D, B, st->sh_w1, S, D, h, 2 * S);
        ds_linear_rows(x, D, B, st->sh_w3, S, D, h + S, 2 * S);
        for (int64_t b = 0; b < B; b++)
            for (int64_t i = 0; i < S; i++)
                act[b * S + i] = ds_swiglu(h[b * 2 * S + i], h[b * 2 * S + S + i], d->limit);
        ds_linear_rows(act, S, B, st->sh_w2, D, S, ys, D);
        for (int64_t c = 0; c < B * D; c++) out[c] += ys[c];
    }
}

/* ---- entry points ---------------------------------------------------------------------------- */

/* dspark.commit: captured rows `rows[r]` (each L * D floats) at `positions` for pool slots `slots` -> ring
   kv [capacity + 1, W, S, hd] and pos [capacity + 1, W]; a row is kept when it is among its slot's last
   W positions of this call and not older than what its ring row holds. Returns 0, or -1 (no memory).
   Row pointers, not one matrix: the engine's backlog holds a request's rows as the chunks its steps
   captured, and a copy into one tensor first cost more than the commit (ds_commit takes one matrix). */
int ds_commit_rows(const DSModel *m, int64_t n, const float *const *rows, const int64_t *positions,
                   const int64_t *slots, float *ring_kv, int64_t *ring_pos) {
    const DSDims *d = &m->d;
    int64_t D = d->D, hd = d->hd, W = d->W, S = d->S, LD = d->L * D, kept = 0;
    int64_t *newest = malloc((size_t)(d->capacity + 1 + n) * sizeof(int64_t)), *keep = newest + d->capacity + 1;
    float *buf = malloc((size_t)(n * (LD + D + hd) + 1) * sizeof(float));
    if (!newest || !buf) return free(newest), free(buf), -1;
    for (int64_t c = 0; c <= d->capacity; c++) newest[c] = -1;
    for (int64_t r = 0; r < n; r++) {
        BOUND("dspark slot", slots[r], d->capacity);
        newest[slots[r]] = positions[r] > newest[slots[r]] ? positions[r] : newest[slots[r]];
    }
    float *cap = buf, *mx = cap + n * LD, *kv = mx + n * D;
    for (int64_t r = 0; r < n; r++) {  /* the rows that land: gathered, so each weight is read once */
        int64_t pos = positions[r], slot = slots[r];
        if (pos <= newest[slot] - W || pos < ring_pos[slot * W + pos % W]) continue;
        memcpy(cap + kept * LD, rows[r], (size_t)LD * sizeof(float));
        keep[kept++] = r;
    }
    ds_linear_rows(cap, LD, kept, m->main_proj, D, LD, mx, D);
    for (int64_t j = 0; j < kept; j++) ds_rms(mx + j * D, m->main_norm, D, d->eps, mx + j * D);
    for (int64_t s = 0; s < S; s++) {
        ds_linear_rows(mx, D, kept, m->stages[s].wkv, hd, D, kv, hd);
        for (int64_t j = 0; j < kept; j++) {
            int64_t pos = positions[keep[j]], slot = slots[keep[j]];
            float *row = kv + j * hd;
            ds_rms(row, m->stages[s].kv_norm, hd, d->eps, row);
            ds_rope(row, hd, d->rd, m->inv_freq, pos, 0);
            memcpy(ring_kv + ((slot * W + pos % W) * S + s) * hd, row, (size_t)hd * sizeof(float));
        }
    }
    for (int64_t j = 0; j < kept; j++) ring_pos[slots[keep[j]] * W + positions[keep[j]] % W] = positions[keep[j]];
    free(newest), free(buf);
    return 0;
}

/* ds_commit_rows over `captured [N, L * D]` (one matrix) */
int ds_commit(const DSModel *m, int64_t n, const float *captured, const int64_t *positions, const int64_t *slots,
              float *ring_kv, int64_t *ring_pos) {
    const float **rows = malloc((size_t)(n + 1) * sizeof(*rows));
    if (!rows) return -1;
    for (int64_t r = 0; r < n; r++) rows[r] = captured + r * m->d.L * m->d.D;
    int rc = ds_commit_rows(m, n, rows, positions, slots, ring_kv, ring_pos);
    free(rows);
    return rc;
}

/* one request's block: base logits [B, V] and hidden [B, D] */
static void ds_block(const DSModel *m, int64_t anchor, int64_t p0, const float *ring, const int64_t *rpos,
                     float *base, float *hidden, float *ws) {
    const DSDims *d = &m->d;
    int64_t B = d->B, D = d->D, hc = d->hc;
    float *streams = ws, *x = streams + B * hc * D, *y = x + B * D, *post = y + B * D, *comb = post + B * hc;
    float *scratch = comb + B * hc * hc;
    uint8_t valid[4096];
    int64_t last = p0 - 1;
    for (int64_t w = 0; w < d->W; w++) valid[w] = rpos[w] >= 0 && rpos[w] <= last && rpos[w] > last - d->W;
    for (int64_t b = 0; b < B; b++) {
        const float *e = m->embed + (b == 0 ? anchor : d->noise) * D;
        for (int64_t i = 0; i < hc; i++) memcpy(streams + (b * hc + i) * D, e, (size_t)D * sizeof(float));
    }
    for (int64_t s = 0; s < d->S; s++) {
        const DSStage *st = &m->stages[s];
        for (int64_t b = 0; b < B; b++) {
            ds_hc_pre(d, streams + b * hc * D, st->hc_attn_fn, st->hc_attn_base, st->hc_attn_scale, x + b * D,
                      post + b * hc, comb + b * hc * hc, scratch);
            ds_rms(x + b * D, st->attn_norm, D, d->eps, x + b * D);
        }
        ds_attention(m, st, s, x, ring, valid, p0, y, scratch);
        for (int64_t b = 0; b < B; b++) {
            float *sb = streams + b * hc * D;
            ds_hc_post(d, sb, y + b * D, post + b * hc, comb + b * hc * hc, scratch);
            ds_hc_pre(d, sb, st->hc_ffn_fn, st->hc_ffn_base, st->hc_ffn_scale, x + b * D, post + b * hc,
                      comb + b * hc * hc, scratch);
            ds_rms(x + b * D, st->ffn_norm, D, d->eps, x + b * D);
        }
        ds_moe(d, st, x, y, scratch);
        for (int64_t b = 0; b < B; b++)
            ds_hc_post(d, streams + b * hc * D, y + b * D, post + b * hc, comb + b * hc * hc, scratch);
    }
    for (int64_t b = 0; b < B; b++) {
        ds_hc_head(m, streams + b * hc * D, hidden + b * D, scratch);
        ds_rms(hidden + b * D, m->norm, D, d->eps, x + b * D);
    }
    if (d->lm_kn) ds_linear_kn_rows(x, B, m->lm_head, d->V, D, base);
    else ds_dots_rows(x, B, m->lm_head, d->V, D, base);
}

/* the Markov and confidence heads, greedy (dspark.markov_sample with an argmax sampler) */
static void ds_markov_greedy(const DSModel *m, int64_t anchor, const float *base, const float *hidden,
                             int64_t *tokens, float *conf, float *ws) {
    const DSDims *d = &m->d;
    int64_t V = d->V, r = d->rank, D = d->D, prev = anchor;
    float *logits = ws, *hm = logits + V, c;
    for (int64_t i = 0; i < d->B; i++) {
        const float *mrow = m->w1 + prev * r;
        ds_linear_rows(mrow, r, 1, m->w2, V, r, logits, V);
        int64_t best = 0;
        for (int64_t v = 0; v < V; v++) {
            logits[v] = base[i * V + v] + logits[v];
            if (logits[v] > logits[best]) best = v;
        }
        memcpy(hm, hidden + i * D, (size_t)D * sizeof(float));
        memcpy(hm + D, mrow, (size_t)r * sizeof(float));
        ds_linear(hm, m->wc, 1, D + r, &c);
        tokens[i] = best, conf[i] = ds_sigmoid(c), prev = best;
    }
}

/* dspark.draft for R requests, each alone: ring rows of pool slot slots[r] valid for the block at
   anchor_pos[r] (= p + 1). Writes base [R, B, V] and hidden [R, B, D]; with `greedy`, also tokens [R, B]
   and confidence [R, B]. Returns 0, or -1 (no memory, or a window the stack mask cannot hold). */
int ds_draft(const DSModel *m, int64_t R, const int64_t *anchors, const int64_t *anchor_pos, const int64_t *slots,
             const float *ring_kv, const int64_t *ring_pos, int64_t greedy, float *base, float *hidden,
             int64_t *tokens, float *conf) {
    const DSDims *d = &m->d;
    int64_t B = d->B, D = d->D, hc = d->hc, hh = d->H * d->hd;
    int64_t inter = d->inter > d->sh_inter ? d->inter : d->sh_inter;
    if (d->W > 4096 || d->hc > DS4_MAX_HC || d->n_exp > DS4_MAX_EXPERTS) return -1;
    if (B * d->top_k > DS_MAX_ROUTES) return -1;
    int64_t need = hc * D + (2 + hc) * hc;  /* the scratch of hc_pre / hc_post, attention, moe: the largest */
    int64_t att = 2 * B * hh + B * d->hd + B * d->q_lora + d->W + B + 1 + B * d->o_groups * d->o_lora;
    need = att > need ? att : need;
    need = 2 * B * D + 3 * B * inter > need ? 2 * B * D + 3 * B * inter : need;
    int64_t block = B * hc * D + 2 * B * D + B * hc + B * hc * hc + need, markov = d->V + D + d->rank;
    size_t n = (size_t)(block > markov ? block : markov);
    float *ws = malloc(n * sizeof(float));
    if (!ws) return -1;
    for (int64_t r = 0; r < R; r++) {
        BOUND("dspark slot", slots[r], d->capacity);
        const float *ring = ring_kv + slots[r] * d->W * d->S * d->hd;
        ds_block(m, anchors[r], anchor_pos[r], ring, ring_pos + slots[r] * d->W, base + r * B * d->V,
                 hidden + r * B * D, ws);
        if (greedy) ds_markov_greedy(m, anchors[r], base + r * B * d->V, hidden + r * B * D, tokens + r * B,
                                     conf + r * B, ws);
    }
    free(ws);
    return 0;
}

/* whether the ring of pool slot `slot` holds every row a block after committed position `last` may see:
   ring row q only ever holds a position = q (mod W) or -1, so the window [max(0, last - W + 1), last] is
   whole exactly when each row it needs holds a position inside it (NativeDSparkDrafts.ready) */
static int ds_whole(const DSModel *m, int64_t slot, int64_t last, const int64_t *ring_pos) {
    int64_t W = m->d.W, n = last + 1 < W ? last + 1 : W, lo = last - W + 1 > 0 ? last - W + 1 : 0;
    if (last < 0) return 1;
    const int64_t *row = ring_pos + slot * W;
    for (int64_t q = 0; q < n; q++)
        if (row[q] < lo || row[q] > last) return 0;
    return 1;
}

/* ds_whole of R requests: ready[r] for pool slot slots[r] after committed position last[r] */
void ds_ready(const DSModel *m, int64_t R, const int64_t *slots, const int64_t *last, const int64_t *ring_pos,
              int64_t *ready) {
    for (int64_t r = 0; r < R; r++) {
        BOUND("dspark slot", slots[r], m->d.capacity);
        ready[r] = ds_whole(m, slots[r], last[r], ring_pos);
    }
}

/* The greedy proposal of R requests in one call: for each, whether its ring is whole for the block at
   anchor_pos[r] (ready[r]; ModelDrafts counts the others as not ready), and where it is, ds_draft's greedy
   tokens [R, B] and the survival estimate [R, B]: the running product of the confidences as torch.cumprod
   makes it on the CPU (in double, each output rounded to float). The engine's greedy blocks come through
   here: the separate ready, draft and cumprod calls and their tensors were ~0.1 ms of a ~1.5 ms drafting
   step of the bundled model. */
int ds_propose_greedy(const DSModel *m, int64_t R, const int64_t *anchors, const int64_t *anchor_pos,
                      const int64_t *slots, const float *ring_kv, const int64_t *ring_pos, int64_t *ready,
                      int64_t *tokens, float *survival) {
    const DSDims *d = &m->d;
    int64_t B = d->B;
    float *base = malloc((size_t)(B * (d->V + d->D)) * sizeof(float));
    if (!base) return -1;
    for (int64_t r = 0; r < R; r++) {
        BOUND("dspark slot", slots[r], d->capacity);
        ready[r] = ds_whole(m, slots[r], anchor_pos[r] - 1, ring_pos);
        if (!ready[r]) continue;
        int rc = ds_draft(m, 1, anchors + r, anchor_pos + r, slots + r, ring_kv, ring_pos, 1, base, base + B * d->V,
                          tokens + r * B, survival + r * B);
        if (rc != 0) return free(base), rc;
        double acc = survival[r * B];  /* torch.cumprod on the CPU: a double product, each output rounded */
        for (int64_t i = 1; i < B; i++) acc *= survival[r * B + i], survival[r * B + i] = (float)acc;
    }
    free(base);
    return 0;
}

/* ---- a commit and a greedy proposal as one job (ds4_pool_submit of the host unit runs it) ----------
   The engine hands the step's backlog rows and greedy blocks to the host pool's worker and applies the
   step meanwhile (engine/model_drafts.py, ModelDrafts.propose_later); the job's own times say how its
   unhidden wait splits between the commit and the blocks. Field order: native_dspark.py _Job. */
typedef struct {
    const DSModel *m;
    int64_t n_rows;
    const float *const *rows;
    const int64_t *row_pos, *row_slots;
    int64_t R;
    const int64_t *anchors, *anchor_pos, *slots;
    float *ring_kv;
    int64_t *ring_pos, *ready, *tokens;
    float *survival;
    int64_t rc, commit_ns, propose_ns;
} DSJob;

static int64_t ds_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

void ds_job_run(void *arg) {
    DSJob *j = (DSJob *)arg;
    int64_t t0 = ds_now_ns();
    j->rc = j->n_rows ? ds_commit_rows(j->m, j->n_rows, j->rows, j->row_pos, j->row_slots, j->ring_kv, j->ring_pos) : 0;
    int64_t t1 = ds_now_ns();
    if (j->rc == 0 && j->R)
        j->rc = ds_propose_greedy(j->m, j->R, j->anchors, j->anchor_pos, j->slots, j->ring_kv, j->ring_pos, j->ready,
                                  j->tokens, j->survival);
    j->commit_ns = t1 - t0;
    j->propose_ns = ds_now_ns() - t1;
}
