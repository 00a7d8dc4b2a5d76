/* The index view of a text forward (cache/view.py build_view, without image blocks, snapshots or query
   tiles), built in one call instead of ~100 small torch ops: on a CPU step of the native forward the
   Python view cost more than a quarter of the decode forward itself. Every array follows the rule
   of the view.py function named beside it; tests/test_native_view.py checks them equal to build_view's
   on random batches. Sizes come from the caller (native_view.py), which allocates every output. */
#include <stdint.h>

typedef struct {
    int64_t S, T, W, n_slots, page_tokens, table_width, n_keys, n_ratios, after;
    const int64_t *slot, *start, *n, *tables;  /* [S], [S], [S], [S, table_width] (block tables, 0-padded) */
    const int64_t *key_ratio, *key_overlap;    /* the compressor geometries, [n_keys] */
    const int64_t *ratios;                     /* distinct compress ratios, [n_ratios] */
} ViewIn;

typedef struct {
    int64_t *positions;                        /* [T] */
    int64_t *swa_keys;                         /* [T, Kw] */
    uint8_t *swa_valid;
    int64_t *swa_dst, *swa_src;                /* [M] */
    int64_t *emit_slots[4];                    /* per geometry: [E, span] */
    uint8_t *emit_valid[4];
    int64_t *emit_pos[4], *emit_rows[4];       /* [E] */
    int64_t *ring_dst[4], *ring_src[4];        /* [M_k] */
    int64_t *vis_rows[4];                      /* per ratio: [T, R] */
    uint8_t *vis_valid[4];
    int64_t Kw, R[4];
} ViewOut;

static inline int64_t floor_mod(int64_t a, int64_t m) { int64_t r = a % m; return r < 0 ? r + m : r; }

/* _pool_rows: compressed row r of sequence s at ratio m -> its flat pool row */
static inline int64_t pool_row(const ViewIn *in, int64_t s, int64_t r, int64_t m) {
    int64_t rpp = in->page_tokens / m, page = r * m / in->page_tokens;
    if (page > in->table_width - 1) page = in->table_width - 1;
    return in->tables[s * in->table_width + page] * rpp + floor_mod(r, rpp);
}

/* _ring_gather for positions [lo, lo + width) of sequence s at token offset `base` (its first token) */
static void gather(const ViewIn *in, int64_t s, int64_t base, int64_t lo, int64_t hi, int64_t width,
                   int64_t ring_len, int64_t *idx, uint8_t *valid) {
    int64_t c0 = in->start[s], n_ring = in->n_slots * ring_len;
    for (int64_t j = 0; j < width; j++) {
        int64_t kp = lo + j;
        int ok = kp <= hi && kp >= 0;
        int64_t ring = in->slot[s] * ring_len + floor_mod(kp, ring_len);
        int64_t fresh = n_ring + base + (kp - c0);
        idx[j] = ok ? (in->after || kp < c0 ? ring : fresh) : 0;
        valid[j] = (uint8_t)ok;
    }
}

/* _ring_writes: each sequence's last min(n, ring_len) tokens -> slot * ring_len + pos % ring_len */
static int64_t ring_writes(const ViewIn *in, int64_t ring_len, int64_t *dst, int64_t *src) {
    int64_t m = 0, base = 0;
    for (int64_t s = 0; s < in->S; s++) {
        int64_t n = in->n[s], count = n < ring_len ? n : ring_len;
        for (int64_t j = 0; j < count; j++) {
            int64_t t = base + n - count + j;
            dst[m] = in->slot[s] * ring_len + floor_mod(in->start[s] + n - count + j, ring_len);
            src[m++] = t;
        }
        base += n;
    }
    return m;
}

/* _compress_index for geometry k: every window closing in this forward, then the ring writes */
static void compress_index(const ViewIn *in, ViewOut *out, int64_t k) {
    int64_t ratio = in->key_ratio[k], span = ratio * (in->key_overlap[k] ? 2 : 1), e = 0, base = 0;
    for (int64_t s = 0; s < in->S; s++) {
        int64_t c0 = in->start[s], count = (c0 + in->n[s]) / ratio - c0 / ratio;
        for (int64_t j = 0; j < count; j++, e++) {
            int64_t w = c0 / ratio + j, first = w * ratio + ratio - span;
            gather(in, s, base, first, first + span - 1, span, span, out->emit_slots[k] + e * span,
                   out->emit_valid[k] + e * span);
            out->emit_pos[k][e] = w * ratio;
            out->emit_rows[k][e] = pool_row(in, s, w, ratio);
        }
        base += in->n[s];
    }
    ring_writes(in, span, out->ring_dst[k], out->ring_src[k]);
}

int ds4_text_view(const ViewIn *in, ViewOut *out) {
    int64_t t = 0;
    for (int64_t s = 0; s < in->S; s++) {
        int64_t base = t;
        for (int64_t j = 0; j < in->n[s]; j++, t++) {
            int64_t p = in->start[s] + j, lo = p - (in->W - 1) < 0 ? 0 : p - (in->W - 1);
            out->positions[t] = p;
            gather(in, s, base, lo, p, out->Kw, in->W, out->swa_keys + t * out->Kw, out->swa_valid + t * out->Kw);
            for (int64_t r = 0; r < in->n_ratios; r++) {  /* _visible: rows r < (p + 1) // ratio */
                int64_t m = in->ratios[r], n_vis = (p + 1) / m, R = out->R[r];
                for (int64_t q = 0; q < R; q++) {
                    int ok = q < n_vis;
                    out->vis_rows[r][t * R + q] = ok ? pool_row(in, s, q, m) : 0;
                    out->vis_valid[r][t * R + q] = (uint8_t)ok;
                }
            }
        }
    }
    ring_writes(in, in->W, out->swa_dst, out->swa_src);
    for (int64_t k = 0; k < in->n_keys; k++) compress_index(in, out, k);
    return 0;
}
