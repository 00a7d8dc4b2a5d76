/* The step: scratch layout, the layer loop, embedding, entry points (see host.h). */
#include "host.h"


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

static int64_t lay_out(const Need *needs, size_t n, Arena *ar, int dry) {
    int64_t total = 0;
    for (size_t i = 0; i < n; i++) {
        int64_t k = max_i(needs[i].floats, 1);
        total += ((k * 4 + 63) / 64) * 64;
        if (!dry) *needs[i].slot = take(ar, k);
    }
    return total;
}

/* lay the step's scratch out in the arena (or, with dry, only add up its bytes). The attention's buffers
   and the experts' are never live at once, so they share one region; mHC's normed streams (hc_pre) and
   its expanded streams (hc_post) share one buffer too. */
static int64_t plan_scratch(const Model *m, const StepView *v, Arena *ar, Scratch *s, int dry) {
    const Dims *d = &m->d;
    int64_t T = v->T, D = d->hidden, hc = d->hc, H = d->n_heads, hd = d->head_dim, n_mix = (2 + hc) * hc;
    int64_t Rmax = 0;
    for (int64_t i = 0; i < v->n_vis; i++) Rmax = max_i(Rmax, v->vis[i].R);
    int64_t Kc = max_i(Rmax, d->idx_topk), P = T * d->top_k, I = d->moe_inter, Hi = d->idx_heads, q8 = 0;
    for (int64_t l = 0; l < m->n_layers; l++) q8 |= m->layers[l].exp_q8;
    Need common[] = {
        {(void **)&s->flat, T * hc * D}, {(void **)&s->z, T * padded(n_mix)}, {(void **)&s->x, T * D},
        {(void **)&s->post, T * hc}, {(void **)&s->comb, T * hc * hc}, {(void **)&s->y, T * D},
    };
    Need attn[] = {
        {(void **)&s->a.q, T * H * hd}, {(void **)&s->a.kv, T * hd}, {(void **)&s->a.qr, T * d->q_lora},
        {(void **)&s->a.out, T * H * hd}, {(void **)&s->a.o_mid, T * d->o_groups * d->o_lora},
        {(void **)&s->a.rot, T * d->rope_dim}, {(void **)&s->a.rot_emit, T * d->rope_dim},
        {(void **)&s->a.states_c, T * 4 * hd}, {(void **)&s->a.states_i, T * 4 * d->idx_dim},
        {(void **)&s->a.q_idx, T * Hi * d->idx_dim}, {(void **)&s->a.head_w, T * padded(Hi)},
        {(void **)&s->a.scores, T * Rmax}, {(void **)&s->a.probs, T * H * (v->Kw + Kc + 1)},
        {(void **)&s->a.cols, T * Kc * 2}, {(void **)&s->a.crows, T * Kc * 2}, {(void **)&s->a.cvalid, T * Kc},
    };
    Need experts[] = {
        {(void **)&s->e.logits, T * padded(d->n_experts)}, {(void **)&s->e.weights, P}, {(void **)&s->e.xs, P * D},
        {(void **)&s->e.h, P * 2 * I}, {(void **)&s->e.ys, P * D}, {(void **)&s->e.sh, T * 2 * d->shared_inter},
        {(void **)&s->e.shy, T * D},
        {(void **)&s->e.idx, P * 2}, {(void **)&s->e.order, P * 2}, {(void **)&s->e.counts, (d->n_experts + 1) * 2},
        {(void **)&s->e.xq, P * (q8 ? q8_row_bytes(D) / 4 : 0)}, {(void **)&s->e.hq, P * (q8 ? q8_row_bytes(I) / 4 : 0)},
    };
    int64_t base = lay_out(common, sizeof common / sizeof common[0], ar, dry);
    int64_t a = lay_out(attn, sizeof attn / sizeof attn[0], ar, dry);
    if (!dry) ar->used -= a;  /* the experts' buffers start where the attention's do */
    int64_t e = lay_out(experts, sizeof experts / sizeof experts[0], ar, dry);
    s->tmp = s->flat;
    return base + max_i(a, e);
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
        int token = 0;
        if (v->is_image && v->is_image[t]) {
            int64_t kind = id - d->vocab;
            if (kind < 0 || kind > 4 || (kind != 2 && !sentinel[kind])) return -2;
            row = sentinel[kind];  /* NULL for IMAGE slots: zero until their aligner row lands */
        } else if (id < 0 || id >= d->vocab) {
            return -2;
        } else {
            token = 1;
        }
        float *first = streams + t * hc * D;
        if (token && m->embed_bf16)
            b16_row(m->embed_bf16, id, D, first);  /* the table kept as the checkpoint stores it */
        else if (token)
            memcpy(first, m->embed + id * D, (size_t)D * 4);
        else if (row)
            memcpy(first, row, (size_t)D * 4);
        else
            memset(first, 0, (size_t)D * 4);
        for (int64_t i = 1; i < hc; i++) memcpy(streams + (t * hc + i) * D, first, (size_t)D * 4);
    }
    for (int64_t r = 0; r < v->n_image_rows; r++) {
        int64_t t = v->image_rows[r];
        if (t < 0 || t >= T) return -2;
        for (int64_t i = 0; i < hc; i++) memcpy(streams + (t * hc + i) * D, v->image_embeds + r * D, (size_t)D * 4);
    }
    return 0;
}

/* one captured layer's output for a model drafter (engine/capture.py): every row's streams [hc, D] into
   its slot of out [T, n_layers * width]; mean_hc: the plain mean over the hc copies summed in copy order
   then divided (width D, what torch's mean over that dimension computes), else every copy (width hc * D) */
static void capture_layer(const float *streams, int64_t T, int64_t hc, int64_t D, int64_t slot, int64_t n_layers,
                          int mean_hc, float *out) {
    int64_t width = mean_hc ? D : hc * D;
    for (int64_t t = 0; t < T; t++) {
        const float *x = streams + t * hc * D;
        float *o = out + (t * n_layers + slot) * width;
        if (!mean_hc) {
            memcpy(o, x, (size_t)width * 4);
            continue;
        }
        for (int64_t d = 0; d < D; d++) {
            float sum = x[d];
            for (int64_t i = 1; i < hc; i++) sum += x[i * D + d];
            o[d] = sum / (float)hc;
        }
    }
}

int ds4_forward_captured(const Model *m, const StepView *v, float *streams, int64_t start, int64_t stop, Arena *ar,
                         int threads, const int64_t *cap_layers, int64_t n_cap_layers, int mean_hc, float *cap_out);

/* layers [start, stop) of the step's rows on streams [T, hc, D] in place; with start 0 the streams
   are embedded first. 0 on success, -1 without memory, -2 for an id out of range (nothing written). */
int ds4_forward(const Model *m, const StepView *v, float *streams, int64_t start, int64_t stop, Arena *ar,
                int threads) {
    return ds4_forward_captured(m, v, streams, start, stop, ar, threads, NULL, 0, 0, NULL);
}

/* ds4_forward that also copies the outputs of ``cap_layers`` (ascending, n_cap_layers of them, each in
   [start, stop)) into cap_out as each finishes: one call where a split forward took one per capture */
int ds4_forward_captured(const Model *m, const StepView *v, float *streams, int64_t start, int64_t stop, Arena *ar,
                         int threads, const int64_t *cap_layers, int64_t n_cap_layers, int mean_hc, float *cap_out) {
    Scratch s;
    g_threads = threads > 0 ? threads : 1;
    if (v->n_comp < 0 || v->n_comp > DS4_MAX_RATIOS || v->n_vis < 0 || v->n_vis > DS4_MAX_RATIOS || v->n_cap < 0
        || v->n_cap > DS4_MAX_CAPTURES)
        return -3;
    if (n_cap_layers < 0 || (n_cap_layers > 0 && !cap_out)) return -3;
    for (int64_t j = 0; j < n_cap_layers; j++)
        if (cap_layers[j] < start || cap_layers[j] >= stop || cap_layers[j] >= m->n_layers
            || (j && cap_layers[j] <= cap_layers[j - 1]))
            return -3;
    for (int64_t l = start; l < stop && l < m->n_layers; l++) {
        const Layer *L = &m->layers[l];
        if (L->kind != 0 && (L->comp_key < 0 || L->comp_key >= v->n_comp || L->vis_key < 0 || L->vis_key >= v->n_vis))
            return -3;
    }
    if (start == 0) {
        int rc = embed(m, v, streams);
        if (rc) return rc;
    }
    if (arena_reserve(ar, plan_scratch(m, v, ar, &s, 1)) != 0) return -1;
    plan_scratch(m, v, ar, &s, 0);
    int64_t next = 0;
    for (int64_t l = start; l < stop && l < m->n_layers; l++) {
        layer_forward(m, &m->layers[l], v, streams, &s);
        if (next < n_cap_layers && cap_layers[next] == l)
            capture_layer(streams, v->T, m->d.hc, m->d.hidden, next++, n_cap_layers, mean_hc, cap_out);
    }
    return next == n_cap_layers ? 0 : -3;
}

/* DS4ForCausalLM.logits: hc_head, the final norm, the LM head -> logits [N, vocab] */
int ds4_logits(const Model *m, const float *streams, int64_t N, float *logits, Arena *ar, int threads) {
    const Dims *d = &m->d;
    int64_t D = d->hidden, hc = d->hc;
    g_threads = threads > 0 ? threads : 1;
    int64_t ms = m->head_fn.kn ? padded(hc) : hc;
    int pairs = m->lm_head.fmt == 3;  /* the head takes its rows rounded to bf16 (host_pairs.c) */
    if (arena_reserve(ar, (N * hc * D + N * ms + N * D + (pairs ? N * D / 2 + 1 : 0)) * 4 + 320) != 0) return -1;
    float *flat = take(ar, N * hc * D), *mix = take(ar, N * ms), *h = take(ar, N * D);
    memcpy(flat, streams, (size_t)(N * hc * D) * 4);
    rms_norm(flat, N, hc * D, NULL, d->rms_eps);
    linear(flat, hc * D, N, hc * D, m->head_fn, hc, mix, ms);
    for (int64_t t = 0; t < N; t++) {
        float *ht = h + t * D;
        for (int64_t k = 0; k < D; k++) ht[k] = 0.0f;
        for (int64_t i = 0; i < hc; i++) {
            float pre = sigmoidf(mix[t * ms + i] * m->head_scale[0] + m->head_base[i]) + d->hc_eps;
            axpy(ht, pre, streams + (t * hc + i) * D, D);
        }
    }
    rms_norm(h, N, D, m->final_norm, d->rms_eps);
    if (pairs) {
        uint16_t *hb = (uint16_t *)take(ar, N * D / 2 + 1);
        p16_round_rows(h, D, N, D, hb);
        linear((const float *)hb, D, N, D, m->lm_head, d->vocab, logits, d->vocab);
    } else {
        linear(h, D, N, D, m->lm_head, d->vocab, logits, d->vocab);
    }
    return 0;
}

/* ---- the binary interface host_forward.py mirrors ---------------------------------------------------
   The struct sizes and the fixed limits, by name; host_forward.py compares each with its ctypes mirror
   when it binds the library and refuses a mismatch (a field added on one side only), and takes the
   limits from here instead of restating them. */
#define ABI_ENTRIES(X)                                                                            \
    X(Weight, sizeof(Weight)) X(Dims, sizeof(Dims)) X(Layer, sizeof(Layer)) X(Model, sizeof(Model))   \
    X(CompView, sizeof(CompView)) X(VisView, sizeof(VisView)) X(Capture, sizeof(Capture))           \
    X(StepView, sizeof(StepView)) X(Arena, sizeof(Arena)) X(MAX_EXPERTS, DS4_MAX_EXPERTS)            \
    X(MAX_HC, DS4_MAX_HC) X(MAX_SPAN, DS4_MAX_SPAN) X(MAX_CAPTURES, DS4_MAX_CAPTURES)               \
    X(MAX_RATIOS, DS4_MAX_RATIOS) X(MAX_GROUP_HEADS, DS4_MAX_GROUP_HEADS)          \
    X(Q8_GROUP, Q8_G)
#define ABI_NAME(name, value) #name ","
#define ABI_VALUE(name, value) (int64_t)(value),

/* the names, comma-separated, of the values ds4_abi writes */
const char *ds4_abi_names(void) { return ABI_ENTRIES(ABI_NAME); }

/* writes up to n values (in ds4_abi_names' order) to out; returns how many there are */
int64_t ds4_abi(int64_t *out, int64_t n) {
    static const int64_t values[] = {ABI_ENTRIES(ABI_VALUE)};
    int64_t count = (int64_t)(sizeof values / sizeof values[0]);
    for (int64_t i = 0; i < n && i < count; i++) out[i] = values[i];
    return count;
}
