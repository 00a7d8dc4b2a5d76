/* The layer blocks of the host forward: compressor, attention, mixture of experts (see host.h). */
#include "host.h"


/* ---- compressor (compressor.py token_states / pool_windows / finish_rows) ------------------------ */

typedef struct {
    Weight wkv, wgate;
    const float *ape, *norm;
    float *ring, *pool, *snap;
    int64_t ring_rows, width, out_dim;  /* width: C (and Z) channels per token; out_dim: of a pooled row */
    int64_t pool_rows, snap_rows;
} Emitter;

struct AttnScratch;
struct Keys;

typedef struct {  /* what a per-row loop of a layer reads (each loop uses its own fields) */
    const Model *m;
    const Layer *L;
    const StepView *v;
    struct AttnScratch *s;
    const Emitter *e;
    const CompView *cv;
    const VisView *vis;
    const float *states;
    const struct Keys *keys;
    float *rot;
    int64_t n_ring, kc, stride;
} RowJob;

/* token_states: [C | Z + ape[pos % ratio]] per token, fp32 -> states [T, 2 * width]: the two products go
   in the layer's first set of products (attention_inputs), the ape rows are added after it ran */
static void state_products(const Emitter *e, const float *xn, int64_t T, int64_t D, float *states, LinearSet *set) {
    int64_t w = e->width, w2 = 2 * w;
    linears_add(set, xn, D, T, D, e->wkv, w, states, w2);
    linears_add(set, xn, D, T, D, e->wgate, w, states + w, w2);
}

static void add_ape(const Emitter *e, const CompView *cv, int64_t T, const int64_t *positions, float *states) {
    int64_t w = e->width, w2 = 2 * w;
    for (int64_t t = 0; t < T; t++) {
        BOUND("position", positions[t], INT64_MAX);
        const float *ape = e->ape + (positions[t] % cv->ratio) * w;
        for (int64_t c = 0; c < w; c++) states[t * w2 + w + c] += ape[c];
    }
}

static void emit_windows(void *c, int64_t lo, int64_t hi) {
    const RowJob *j = (const RowJob *)c;
    const Emitter *e = j->e;
    const CompView *cv = j->cv;
    const Dims *d = &j->m->d;
    int64_t w2 = 2 * e->width, w = e->width, ratio = cv->ratio, od = e->out_dim, span = cv->span;
    int64_t half = d->rope_dim / 2;
    BOUND("compressor window span", span - 1, DS4_MAX_SPAN);
    for (int64_t k = lo; k < hi; k++) {
        BOUND("compressed pool row written", cv->emit_rows[k], e->pool_rows);
        float *out = e->pool + cv->emit_rows[k] * od, *rot = j->rot + k * 2 * half;
        const float *rows[DS4_MAX_SPAN];
        for (int64_t q = 0; q < span; q++)
            rows[q] = cv->emit_valid[k * span + q] ? row_of(e->ring, e->ring_rows, j->n_ring, j->states, j->v->T,
                                                            cv->emit_slots[k * span + q], w2) : NULL;
        for (int64_t ch0 = 0; ch0 < od; ch0++) {
            float mx = -INFINITY, s = 0.0f, acc = 0.0f;
            for (int64_t q = 0; q < span; q++) {  /* CSA: first ratio slots "a" halves, the rest "b" halves */
                if (!rows[q]) continue;
                float g = rows[q][w + (cv->overlap && q >= ratio ? od + ch0 : ch0)];
                mx = g > mx ? g : mx;
            }
            for (int64_t q = 0; q < span; q++) {
                if (!rows[q]) continue;
                int64_t ch = cv->overlap && q >= ratio ? od + ch0 : ch0;
                float p = expf(rows[q][w + ch] - mx);
                s += p;
                acc += rows[q][ch] * p;
            }
            out[ch0] = acc / s;
        }
        rms_norm(out, 1, od, e->norm, d->rms_eps);
        rotation(rot, cv->emit_pos[k], j->m->inv_freq_comp, half, j->m->af_comp);
        rope(out, 1, od, rot, half, 0);
    }
}

/* pool_windows + finish_rows for every closing window: slots from cat(ring, states) (the ring alone
   after this step's writes in decode views), softmax over slots per channel, norm, RoPE, into the pool */
static void emit_rows(const Model *m, const StepView *v, const Emitter *e, const CompView *cv, const float *states,
                      int after, float *rot_scratch) {
    RowJob job = {.m = m, .v = v, .e = e, .cv = cv, .states = states, .rot = rot_scratch,
                  .n_ring = after ? INT64_MAX : e->ring_rows};
    pool_run(cv->E, 4, emit_windows, &job);
}

/* ---- attention (decoder.Attention, attention.sink_attention) ------------------------------------ */

typedef struct AttnScratch {
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

static void csa_queries(void *c, int64_t lo, int64_t hi) {
    const RowJob *j = (const RowJob *)c;
    const Dims *d = &j->m->d;
    const VisView *vis = j->vis;
    AttnScratch *s = j->s;
    int64_t Hi = d->idx_heads, di = d->idx_dim, R = vis->R, kc = j->kc;
    float scale = 1.0f / sqrtf((float)di);
    for (int64_t t = lo; t < hi; t++) {
        float *sc = s->scores + t * R;
        for (int64_t r = 0; r < R; r++) {
            if (!vis->valid[t * R + r]) { sc[r] = -INFINITY; continue; }
            BOUND("indexer pool row", vis->rows[t * R + r], j->L->idx_pool_rows);
            const float *key = j->L->idx_pool + vis->rows[t * R + r] * di;
            float acc = 0.0f;
            for (int64_t h = 0; h < Hi; h++) {
                float v = dot(s->q_idx + (t * Hi + h) * di, key, di);
                acc += (v > 0.0f ? v : 0.0f) * scale * s->head_w[t * Hi + h];
            }
            sc[r] = acc;
        }
        int64_t *cols = s->cols + t * kc;
        int64_t n = top_rows(sc, R, kc, cols);
        for (int64_t q = 0; q < kc; q++) {
            s->crows[t * kc + q] = q < n ? vis->rows[t * R + cols[q]] : 0;
            s->cvalid[t * kc + q] = q < n;
        }
    }
}

/* CSA: per query, score every visible indexer row and keep the top-k pool rows (Compressor.gathered) */
static void csa_rows(const Model *m, const Layer *L, const VisView *vis, int64_t T, AttnScratch *s, int64_t kc) {
    RowJob job = {.m = m, .L = L, .vis = vis, .s = s, .kc = kc};
    pool_run(T, vis->R >= 64 ? 1 : 1 + 64 / (vis->R + 1), csa_queries, &job);
}

typedef struct Keys {  /* where one query's keys live */
    const float *swa, *fresh, *pool;
    int64_t n_ring, Kw, Kc, hd;
    const int64_t *keys, *crows;
    const uint8_t *valid, *cvalid;
    int64_t swa_rows, fresh_rows, pool_rows;
} Keys;

static inline const float *key_row(const Keys *k, int64_t i) {
    if (i < k->Kw) return row_of(k->swa, k->swa_rows, k->n_ring, k->fresh, k->fresh_rows, k->keys[i], k->hd);
    BOUND("compressed pool row attended", k->crows[i - k->Kw], k->pool_rows);
    return k->pool + k->crows[i - k->Kw] * k->hd;
}

/* heads [0, nh) of one token over its sliding and compressed keys, with the sinks (sink_attention).
   DS4 has one K=V head (MQA): every key row is read once for all these heads, which matters with many
   heads (Flash has 64 per rank). q / out: [nh, hd]; probs: [nh, stride] */
static void attend_logits(const float *q, int64_t nh, int64_t hd, const float *const *rows, const int64_t *idx,
                          int cnt, float scale, float *probs, int64_t stride, float *mx) {
    float l[ATT_KEYS];
    for (int64_t h = 0; h < nh; h++) {
        if (cnt == ATT_KEYS) {
            dots(q + h * hd, rows, hd, l);
        } else {
            for (int c = 0; c < cnt; c++) l[c] = dot(q + h * hd, rows[c], hd);
        }
        for (int c = 0; c < cnt; c++) {  /* key order, as one key at a time: the same running max */
            float v = l[c] * scale;
            probs[h * stride + idx[c]] = v;
            mx[h] = v > mx[h] ? v : mx[h];
        }
    }
}

static void attend(const float *q, int64_t nh, const Keys *k, const float *sinks, float *probs, int64_t stride,
                   float *out) {
    int64_t n = k->Kw + k->Kc, hd = k->hd, idx[ATT_KEYS];
    float scale = 1.0f / sqrtf((float)hd), mx[DS4_MAX_GROUP_HEADS], denom[DS4_MAX_GROUP_HEADS], a[ATT_KEYS];
    const float *rows[ATT_KEYS];
    int cnt = 0;
    BOUND("heads in one attention item", nh - 1, DS4_MAX_GROUP_HEADS);
    for (int64_t h = 0; h < nh; h++) mx[h] = sinks[h];
    for (int64_t i = 0; i < n; i++) {  /* the valid keys' logits ATT_KEYS at a time (dots) */
        int ok = i < k->Kw ? k->valid[i] : k->cvalid[i - k->Kw];
        if (!ok) {
            for (int64_t h = 0; h < nh; h++) probs[h * stride + i] = -INFINITY;
            continue;
        }
        rows[cnt] = key_row(k, i);
        idx[cnt++] = i;
        if (cnt == ATT_KEYS) {
            attend_logits(q, nh, hd, rows, idx, cnt, scale, probs, stride, mx);
            cnt = 0;
        }
    }
    if (cnt) attend_logits(q, nh, hd, rows, idx, cnt, scale, probs, stride, mx);
    for (int64_t h = 0; h < nh; h++) {  /* the weights in one pass (vexp), then summed in key order */
        float *p = probs + h * stride;
        p[n] = sinks[h];
        for (int64_t i = 0; i <= n; i++) p[i] -= mx[h];
        ds4_exp_rows(p, n + 1);
        denom[h] = p[n];
        for (int64_t i = 0; i < n; i++) denom[h] += p[i];
    }
    memset(out, 0, (size_t)(nh * hd) * 4);
    for (int64_t h = 0; h < nh; h++) {  /* per head, the keys of nonzero weight in order, ATT_KEYS a pass */
        cnt = 0;
        for (int64_t i = 0; i < n; i++) {
            float p = probs[h * stride + i];
            if (p == 0.0f) continue;
            rows[cnt] = key_row(k, i);
            a[cnt++] = p / denom[h];
            if (cnt == ATT_KEYS) {
                axpys(out + h * hd, a, rows, cnt, hd);
                cnt = 0;
            }
        }
        if (cnt) axpys(out + h * hd, a, rows, cnt, hd);
    }
}

/* the indexer's queries (from the normed q_a rows) and head weights: products for the layer's second set */
static void indexer_products(const Model *m, const Layer *L, const float *xn, int64_t T, AttnScratch *s,
                             LinearSet *set) {
    const Dims *d = &m->d;
    int64_t Hi = d->idx_heads, di = d->idx_dim;
    linears_add(set, s->qr, d->q_lora, T, d->q_lora, L->i_q_b, Hi * di, s->q_idx, Hi * di);
    linears_add(set, xn, d->hidden, T, d->hidden, L->i_w, Hi, s->head_w, L->i_w.kn ? padded(Hi) : Hi);
}

/* the indexer's queries rotated, its head weights scaled (after project_rows wrote the rotations) */
static void indexer_inputs(const Model *m, const Layer *L, int64_t T, AttnScratch *s) {
    const Dims *d = &m->d;
    int64_t Hi = d->idx_heads, di = d->idx_dim, half = d->rope_dim / 2, hs = L->i_w.kn ? padded(Hi) : Hi;
    for (int64_t t = 0; t < T; t++) {  /* s->rot rows hold the compress rotations (a CSA layer's own) */
        rope(s->q_idx + t * Hi * di, Hi, di, s->rot + t * half * 2, half, 0);
        for (int64_t h = 0; h < Hi; h++) s->head_w[t * Hi + h] = s->head_w[t * hs + h] / sqrtf((float)Hi);
    }
}

static void project_rows(void *c, int64_t lo, int64_t hi) {
    const RowJob *j = (const RowJob *)c;
    const Model *m = j->m;
    const Dims *d = &m->d;
    AttnScratch *s = j->s;
    int64_t H = d->n_heads, hd = d->head_dim, half = d->rope_dim / 2;
    int sliding = j->L->kind == 0;
    for (int64_t t = lo; t < hi; t++) {
        float *rot = s->rot + t * half * 2;
        rms_norm(s->q + t * H * hd, H, hd, NULL, d->rms_eps);
        rms_norm(s->kv + t * hd, 1, hd, j->L->kv_norm, d->rms_eps);
        rotation(rot, j->v->positions[t], sliding ? m->inv_freq_main : m->inv_freq_comp, half,
                 sliding ? m->af_main : m->af_comp);
        rope(s->q + t * H * hd, H, hd, rot, half, 0);
        rope(s->kv + t * hd, 1, hd, rot, half, 0);
    }
}

/* the emitters of a compressed layer's compressor and (CSA) indexer */
static void layer_emitters(const Model *m, const Layer *L, Emitter *ce, Emitter *ie) {
    const Dims *d = &m->d;
    int64_t hd = d->head_dim;
    Emitter c = {L->c_kv, L->c_gate, L->c_ape, L->c_norm, L->comp_ring, L->comp_pool, L->snap_comp,
                 L->comp_ring_rows, hd * (L->kind == 1 ? 2 : 1), hd, L->comp_pool_rows, L->snap_comp_rows};
    Emitter i = {L->i_kv, L->i_gate, L->i_ape, L->i_norm, L->idx_ring, L->idx_pool, L->snap_idx,
                 L->idx_ring_rows, 2 * d->idx_dim, d->idx_dim, L->idx_pool_rows, L->snap_idx_rows};
    *ce = c;
    *ie = i;
}

/* Every product of the layer's inputs in two pool loops: q_a, kv and the compressor's and indexer's kv
   and gate (ce / ie, NULL where the layer has none) from xn; then, after q_a's norm, q_b and the
   indexer's query and head weights. Then q and kv normed and rotated (rotations kept in s->rot for the
   output and the indexer). */
static void attention_inputs(const Model *m, const Layer *L, const StepView *v, const float *xn, AttnScratch *s,
                             const Emitter *ce, const Emitter *ie) {
    const Dims *d = &m->d;
    int64_t T = v->T, D = d->hidden, H = d->n_heads, hd = d->head_dim;
    LinearSet set = {.n = 0};
    linears_add(&set, xn, D, T, D, L->q_a, d->q_lora, s->qr, d->q_lora);
    linears_add(&set, xn, D, T, D, L->kv, hd, s->kv, hd);
    if (ce) state_products(ce, xn, T, D, s->states_c, &set);
    if (ie) state_products(ie, xn, T, D, s->states_i, &set);
    linears_run(&set);
    rms_norm(s->qr, T, d->q_lora, L->q_a_norm, d->rms_eps);
    linears_add(&set, s->qr, d->q_lora, T, d->q_lora, L->q_b, H * hd, s->q, H * hd);
    if (ie) indexer_products(m, L, xn, T, s, &set);
    linears_run(&set);
    RowJob job = {.m = m, .L = L, .v = v, .s = s};
    pool_run(T, 8, project_rows, &job);
}

/* the compressor (and indexer) of a compressed layer, its states computed (attention_inputs): captures,
   emits; returns the keys (pool rows) every query sees beside its sliding ones */
static void compress(const Model *m, const Layer *L, const StepView *v, const Emitter *ce, const Emitter *ie,
                     AttnScratch *s, Keys *k) {
    const Dims *d = &m->d;
    int64_t T = v->T;
    const CompView *cv = &v->comp[L->comp_key];
    const VisView *vis = &v->vis[L->vis_key];
    int csa = L->kind == 1, after = (int)v->after_write;
    for (int i = 0; i < 1 + csa; i++) {
        const Emitter *e = i ? ie : ce;
        float *st = i ? s->states_i : s->states_c;
        add_ape(e, cv, T, v->positions, st);
        Rows ring = {e->ring, e->ring_rows, 2 * e->width}, snap = {e->snap, e->snap_rows, 2 * e->width};
        if (after) {
            write_ring(ring, st, T, cv->ring_dst, cv->ring_src, cv->M);
        } else {
            capture(v, cv->span, snap, ring, st);
        }
        emit_rows(m, v, e, cv, st, after, s->rot_emit);
    }
    k->pool = L->comp_pool;
    k->pool_rows = L->comp_pool_rows;
    if (csa) {
        indexer_inputs(m, L, T, s);
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

static void attend_rows(void *c, int64_t lo, int64_t hi) {  /* (token, group of heads) items */
    const RowJob *j = (const RowJob *)c;
    const StepView *v = j->v;
    int64_t H = j->m->d.n_heads, hd = j->m->d.head_dim, groups = j->kc, per = (H + groups - 1) / groups;
    for (int64_t item = lo; item < hi; item++) {
        int64_t t = item / groups, h0 = (item % groups) * per, nh = H - h0 < per ? H - h0 : per;
        Keys k = *j->keys;
        k.keys = v->swa_keys + t * v->Kw;
        k.valid = v->swa_valid + t * v->Kw;
        if (k.Kc) {
            k.crows += t * k.Kc;
            k.cvalid += t * k.Kc;
        }
        int64_t th = t * H + h0;
        attend(j->s->q + th * hd, nh, &k, j->L->sinks + h0, j->s->probs + th * j->stride, j->stride,
               j->s->out + th * hd);
    }
}

static void unrope_rows(void *c, int64_t lo, int64_t hi) {  /* the output's inverse rotation */
    const RowJob *j = (const RowJob *)c;
    int64_t H = j->m->d.n_heads, hd = j->m->d.head_dim, half = j->m->d.rope_dim / 2;
    for (int64_t t = lo; t < hi; t++) rope(j->s->out + t * H * hd, H, hd, j->s->rot + t * half * 2, half, 1);
}

static void attention(const Model *m, const Layer *L, const StepView *v, const float *xn, float *y, AttnScratch *s) {
    const Dims *d = &m->d;
    int64_t T = v->T, D = d->hidden, H = d->n_heads, hd = d->head_dim;
    int after = (int)v->after_write, comp = L->kind != 0;
    Emitter ce, ie;
    if (comp) layer_emitters(m, L, &ce, &ie);
    attention_inputs(m, L, v, xn, s, comp ? &ce : NULL, L->kind == 1 ? &ie : NULL);
    Rows swa = {L->swa, L->swa_rows, hd}, snap = {L->snap_swa, L->snap_swa_rows, hd};
    if (after) {
        write_ring(swa, s->kv, T, v->swa_dst, v->swa_src, v->M);
    } else {
        capture(v, d->window, snap, swa, s->kv);
    }
    Keys k0 = {L->swa, s->kv, NULL, after ? INT64_MAX : L->swa_rows, v->Kw, 0, hd, NULL, NULL, NULL, NULL,
               L->swa_rows, T, 0};
    if (comp) compress(m, L, v, &ce, &ie, s, &k0);
    /* items: (token, group of heads); one group of all heads once there are 4 tokens a thread, else the
       heads split so that the items even out over the threads (at most 64 heads a group): a verify step
       of 5 rows on 2 threads is 10 items, not 5 (3 against 2 items a thread) */
    int64_t groups = T >= 4 * g_threads ? 1 : (4 * g_threads + T - 1) / T;
    groups = groups > H ? H : groups;
    while ((H + groups - 1) / groups > 64) groups++;
    groups = (H + (H + groups - 1) / groups - 1) / ((H + groups - 1) / groups);  /* no group left empty */
    RowJob job = {.m = m, .L = L, .v = v, .s = s, .keys = &k0, .stride = k0.Kw + k0.Kc + 1, .kc = groups};
    pool_run(T * groups, 1, attend_rows, &job);
    if (!after) {  /* prefill: every read of the rings is done; now this forward's rows go in */
        write_ring(swa, s->kv, T, v->swa_dst, v->swa_src, v->M);
        if (L->kind != 0) {
            const CompView *cv = &v->comp[L->comp_key];
            Rows comp = {L->comp_ring, L->comp_ring_rows, 2 * hd * (L->kind == 1 ? 2 : 1)},
                 idx = {L->idx_ring, L->idx_ring_rows, 4 * d->idx_dim};
            write_ring(comp, s->states_c, T, cv->ring_dst, cv->ring_src, cv->M);
            if (L->kind == 1) write_ring(idx, s->states_i, T, cv->ring_dst, cv->ring_src, cv->M);
        }
    }
    pool_run(T, 16, unrope_rows, &job);
    int64_t G = d->o_groups, ol = d->o_lora, X = H * hd / G;
    LinearSet set = {.n = 0};
    for (int64_t g = 0; g < G; g++)  /* block-diagonal o_a: group g of the heads by its own rows */
        linears_add(&set, s->out + g * X, H * hd, T, X, weight_cols(L->o_a, g * ol), ol, s->o_mid + g * ol, G * ol);
    linears_run(&set);
    linear(s->o_mid, G * ol, T, G * ol, L->o_b, D, y, D);
}

/* ---- mixture of experts (moe.py route / _grouped_pairs / swiglu) -------------------------------- */

typedef struct {
    float *logits, *weights, *xs, *h, *ys, *sh, *shy;  /* shy: the shared expert's outputs */
    int64_t *idx, *order, *counts;
    uint8_t *xq, *hq;  /* the pairs' inputs and SwiGLU outputs quantised (host_q8.c; q8 experts only) */
} MoeScratch;

static inline float swiglu1(float g, float u, float limit) {
    g = g < limit ? g : limit;
    u = u < -limit ? -limit : (u > limit ? limit : u);
    return g / (1.0f + expf(-g)) * u;
}

static void route(const Model *m, const Layer *L, const float *xn, const int64_t *ids, const uint8_t *is_image,
                  int64_t T, MoeScratch *s) {
    const Dims *d = &m->d;
    int64_t E = d->n_experts, k = d->top_k, ls = L->gate.kn ? padded(E) : E;
    linear(xn, d->hidden, T, d->hidden, L->gate, E, s->logits, ls);
    for (int64_t t = 0; t < T; t++) {
        float *sc = s->logits + t * ls, sel[DS4_MAX_EXPERTS];
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
            for (int64_t j = 0; j < k; j++) {
                idx[j] = L->tid2eid[id * k + j];
                BOUND("tid2eid expert id", idx[j], E);  /* weights.py refuses such a table at load */
            }
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

/* rows [a, a + n) of h ([gate | up], 2I wide): the gate half becomes SwiGLU(gate, up) in place */
static void swiglu_rows(float *h, int64_t a, int64_t n, int64_t I, float limit) {
    vf hi = vsplat(limit), lo = vsplat(-limit), one = vsplat(1.0f);
    for (int64_t i = a; i < a + n; i++) {
        float *r = h + i * 2 * I;
        int64_t c = 0;
        for (; c + VW <= I; c += VW) {  /* swiglu1 lane by lane (its clamps as written there), exp by vexp */
            vf g = vload(r + c), u = vload(r + I + c);
            g = vsel(g < hi, g, hi);
            u = vsel(u < lo, lo, vsel(u > hi, hi, u));
            vstore(r + c, g / (one + vexp(-g)) * u);
        }
        for (; c < I; c++) r[c] = swiglu1(r[c], r[I + c], limit);
    }
}

/* the shared expert of a layer (has_shared): gate and up of every token into sh [T, 2W] and down into
   out [T, D] added to a set (the caller runs it), SwiGLU in the gate half; each a no-op without one */
typedef struct {
    const Model *m;
    const Layer *L;
    const float *xn;
    int64_t T;
    float *sh, *out;
} SharedExpert;

static void shared_gate_up(const SharedExpert *e, LinearSet *set) {
    int64_t D = e->m->d.hidden, W = e->m->d.shared_inter;
    if (!e->L->has_shared) return;
    linears_add(set, e->xn, D, e->T, D, e->L->sh_gate, W, e->sh, 2 * W);
    linears_add(set, e->xn, D, e->T, D, e->L->sh_up, W, e->sh + W, 2 * W);
}

static void shared_swiglu(const SharedExpert *e) {
    if (e->L->has_shared) swiglu_rows(e->sh, 0, e->T, e->m->d.shared_inter, e->m->d.swiglu_limit);
}

static void shared_down(const SharedExpert *e, LinearSet *set) {
    int64_t D = e->m->d.hidden, W = e->m->d.shared_inter;
    if (e->L->has_shared) linears_add(set, e->sh, 2 * W, e->T, W, e->L->sh_down, D, e->out, D);
}

/* each expert's pairs (rows xs, sorted by expert) through its gate/up, SwiGLU and down products, beside
   the shared expert's (the set's): every gate/up product in one pool loop, then every down product */
static void grouped_experts(const Model *m, const Layer *L, int64_t P, MoeScratch *s, LinearSet *set,
                            const SharedExpert *sh) {
    const Dims *d = &m->d;
    int64_t E = d->n_experts, D = d->hidden, I = d->moe_inter;
    for (int64_t e = 0; e < E; e++) {
        int64_t a = s->counts[e], n = s->counts[e + 1] - a;
        /* stored [E, D, 2I] / [E, I, D] ([K, N] per expert) or as the checkpoint has them */
        Weight gu = {.p = L->exp_gate_up + e * 2 * I * D, .ld = L->exp_kn ? 2 * I : D, .kn = L->exp_kn};
        linears_add(set, s->xs + a * D, D, n, D, gu, 2 * I, s->h + a * 2 * I, 2 * I);
    }
    shared_gate_up(sh, set);
    linears_run(set);  /* every gate/up product before any SwiGLU */
    swiglu_rows(s->h, 0, P, I, d->swiglu_limit);
    shared_swiglu(sh);
    for (int64_t e = 0; e < E; e++) {
        int64_t a = s->counts[e], n = s->counts[e + 1] - a;
        Weight dn = {.p = L->exp_down + e * D * I, .ld = L->exp_kn ? D : I, .kn = L->exp_kn};
        linears_add(set, s->h + a * 2 * I, 2 * I, n, I, dn, D, s->ys + a * D, D);
    }
}

/* the same over MXFP4 stacks: the inputs reordered once per product to the decode's order */
static void packed_experts(const Model *m, const Layer *L, int64_t P, MoeScratch *s) {
    const Dims *d = &m->d;
    int64_t E = d->n_experts, D = d->hidden, I = d->moe_inter;
    QStack gu = {{L->qgu_codes[0], L->qgu_codes[1]}, {L->qgu_scales[0], L->qgu_scales[1]},
                 {L->qgu_rows[0], L->qgu_rows[1]}, L->qgu_parts, D},
           dn = {{L->qdn_codes, NULL}, {L->qdn_scales, NULL}, {D, 0}, 1, I};
    qperm_rows(s->xs, P, D, D);
    for (int64_t e = 0; e < E; e++) {
        int64_t a = s->counts[e], n = s->counts[e + 1] - a;
        if (!n) continue;
        q_linear(s->xs + a * D, D, n, &gu, e, 2 * I, s->h + a * 2 * I, 2 * I);
        swiglu_rows(s->h, a, n, I, d->swiglu_limit);
        qperm_rows(s->h + a * 2 * I, n, I, 2 * I);
        q_linear(s->h + a * 2 * I, 2 * I, n, &dn, e, D, s->ys + a * D, D);
    }
}

/* the same over interleaved MXFP4 stacks on int8 activations: each pair's input quantised once, each
   expert's SwiGLU outputs quantised before its down product */
static void q8_experts(const Model *m, const Layer *L, int64_t P, MoeScratch *s) {
    const Dims *d = &m->d;
    int64_t E = d->n_experts, D = d->hidden, I = d->moe_inter, lx = q8_row_bytes(D), lh = q8_row_bytes(I);
    QStack gu = {{L->qgu_codes[0], L->qgu_codes[1]}, {L->qgu_scales[0], L->qgu_scales[1]},
                 {L->qgu_rows[0], L->qgu_rows[1]}, L->qgu_parts, D},
           dn = {{L->qdn_codes, NULL}, {L->qdn_scales, NULL}, {D, 0}, 1, I};
    q8_quantize(s->xs, D, P, D, s->xq, lx);
    for (int64_t e = 0; e < E; e++) {
        int64_t a = s->counts[e], n = s->counts[e + 1] - a;
        if (!n) continue;
        q8_linear(s->xq + a * lx, lx, n, &gu, e, 2 * I, s->h + a * 2 * I, 2 * I);
        swiglu_rows(s->h, a, n, I, d->swiglu_limit);
        q8_quantize(s->h + a * 2 * I, 2 * I, n, I, s->hq + a * lh, lh);
        q8_linear(s->hq + a * lh, lh, n, &dn, e, D, s->ys + a * D, D);
    }
}

/* the pairs (token, chosen expert) sorted by expert, stable, and each pair's input row gathered */
static void sort_pairs(const Dims *d, const float *xn, int64_t P, MoeScratch *s) {
    int64_t E = d->n_experts, k = d->top_k, D = d->hidden;
    memset(s->counts, 0, (size_t)(E + 1) * 8);
    for (int64_t p = 0; p < P; p++) s->counts[s->idx[p] + 1]++;
    for (int64_t e = 0; e < E; e++) s->counts[e + 1] += s->counts[e];  /* start of each expert's pairs */
    int64_t fill[DS4_MAX_EXPERTS];
    for (int64_t e = 0; e < E; e++) fill[e] = s->counts[e];
    for (int64_t p = 0; p < P; p++) s->order[fill[s->idx[p]]++] = p;  /* pairs sorted by expert, stable */
    for (int64_t i = 0; i < P; i++) memcpy(s->xs + i * D, xn + (s->order[i] / k) * D, (size_t)D * 4);
}

/* route, the routed experts and the shared one: y = the pairs' outputs summed per token in pair order
   (by expert), then + the shared expert's. The fp32 experts' products share their pool loops with the
   shared expert's (grouped_experts); the MXFP4 ones run their own, the shared expert's then. */
static void moe(const Model *m, const Layer *L, const float *xn, const int64_t *ids, const uint8_t *is_image,
                int64_t T, float *y, MoeScratch *s) {
    const Dims *d = &m->d;
    int64_t D = d->hidden, k = d->top_k, P = T * k;
    SharedExpert sh = {m, L, xn, T, s->sh, s->shy};
    LinearSet set = {.n = 0};
    route(m, L, xn, ids, is_image, T, s);
    sort_pairs(d, xn, P, s);
    if (L->exp_q8) {
        q8_experts(m, L, P, s);
    } else if (L->exp_packed) {
        packed_experts(m, L, P, s);
    } else {
        grouped_experts(m, L, P, s, &set, &sh);
    }
    if (L->exp_q8 || L->exp_packed) {
        shared_gate_up(&sh, &set);
        linears_run(&set);
        shared_swiglu(&sh);
    }
    shared_down(&sh, &set);
    linears_run(&set);
    memset(y, 0, (size_t)(T * D) * 4);
    for (int64_t i = 0; i < P; i++) axpy(y + (s->order[i] / k) * D, s->weights[s->order[i]], s->ys + i * D, D);
    if (L->has_shared)
        for (int64_t i = 0; i < T * D; i++) y[i] += s->shy[i];
}
