/* FP8 projections on bf16 activations: pairs of bf16 products added into fp32 (part of host.c; see
   host.h). Weight fmt 4: the FP8 e4m3 codes exactly as fmt 1 stores them ([K, N], row stride ld, block
   scales), with the input rows rounded to bf16.

   Why: at DS4-Flash's widths an 8-row decode step spends ~30% of its time in the FP8 projections and a
   prefill over half, and both are bound by fp32 multiply-adds (host_stored.c decodes each code to fp32
   and multiplies: one FMA, 16 products). An FP8 value is exact in bf16 (3 mantissa bits, an exponent
   range bf16 covers), so with the activations rounded to bf16, as llama.cpp rounds them to q8_0, one
   vdpbf16ps does 32 products: measured 2x host_stored.c's 8-row rate with the weights in L1 (Zen 4),
   `--fp8-activations` (model/host_f8pairs.py chooses; auto: where the instruction is).

   The result is defined here, not by the instruction set, so every build computes the same bits. For
   output n of input row m:
   - the row is rounded to bf16 once (p16_round: nearest, ties to even, subnormals to a signed zero);
   - the weight w[k][n] is its code's value (exact in bf16, never subnormal: the smallest is 2^-9);
   - K is gone over in the blocks of scales, kb = 0, 1, ... (bk inputs each): a block's partial sum P
     starts at +0 and takes the pairs k = kb bk, kb bk + 2, ..., each as vdpbf16ps does: the odd input
     first, P = flush(fma(x[k + 1], w[k + 1][n], P)), then P = flush(fma(x[k], w[k][n], P)) (flush: a
     subnormal to a zero of its sign; each product of two bf16 values is exact in fp32, so each step is
     the exact sum rounded once);
   - then y = fma(P, s, y) from y = +0, s the block's scale (UE8M0: a power of two, so P s is exact and
     the add rounds once), plain fp32 without a flush.
   Every row count and thread count takes this order, so a row's bits never depend on its batch. K and bk
   must be even and N and bn multiples of 32 (DS4's widths are multiples of 128); host_f8pairs.py keeps
   any other FP8 weight on host_stored.c.

   Where AVX-512 BF16 and VBMI are, a strip of 32 outputs decodes a pair of weight rows in six
   instructions: one byte permute interleaves the two rows' 32 codes (in the order the unpacks below
   undo), two more look the codes' bf16 high and low bytes up in 128-entry tables (the sign goes in with
   one ternary logic op), and two unpacks put the bytes together as 32 pairs, two vectors of 16 outputs
   in order; then one vdpbf16ps a row and vector. Elsewhere a plain C loop computes the same definition
   (for the same bits on every build target the tests build, not for speed: `auto` takes the pairs only
   where the instructions are). ds4_f8p_reference is the definition in scalar C, one output at a time:
   the start-up probe holds the kernel to it on the machine that serves, and the tests hold both to an
   oracle of their own. */

#if P16_NATIVE && defined(__AVX512VBMI__)
#define F8P_NATIVE 1
#define F8P_KERNEL "AVX-512 BF16 + VBMI (vdpbf16ps over codes decoded by vpermt2b)"
#else
#define F8P_NATIVE 0
#define F8P_KERNEL "plain C (the definition, one output at a time)"
#endif
#define F8P_STRIP 32  /* outputs a strip: two vectors of 16 */

static float f8p_value[256];  /* a code's value (the sign included; NaN codes are refused at load) */
#if F8P_NATIVE
static uint8_t f8p_hi[128] __attribute__((aligned(64)));  /* the bf16 bits of a code's magnitude: high byte */
static uint8_t f8p_lo[128] __attribute__((aligned(64)));  /* ... low byte */
static uint8_t f8p_ix[64] __attribute__((aligned(64)));   /* the byte interleave of two rows' 32 codes */
#endif

__attribute__((constructor)) static void f8p_tables(void) {
    for (int c = 0; c < 256; c++) {
        int e = (c >> 3) & 15, m = c & 7;
        float v = e ? ldexpf(1.0f + (float)m / 8.0f, e - 7) : ldexpf((float)m, -9);
        f8p_value[c] = c & 0x80 ? -v : v;
    }
#if F8P_NATIVE
    for (int c = 0; c < 128; c++) {
        uint32_t b;
        memcpy(&b, &f8p_value[c], sizeof b);
        f8p_hi[c] = (uint8_t)(b >> 24);
        f8p_lo[c] = (uint8_t)(b >> 16);
    }
    /* byte p of the interleave: pair j = p / 2 of the strip, from row k (p even) or k + 1 (odd). The low
       unpack takes bytes 0-7 of each 16-byte lane t (pairs 8t .. 8t + 3) into outputs 4t .. 4t + 3, the
       high unpack bytes 8-15 (pairs 8t + 4 .. 8t + 7) into outputs 16 + 4t .. 16 + 4t + 3: so pair j
       holds output 4t + u (u = j % 8 < 4) or 16 + 4t + u - 4 */
    for (int p = 0; p < 64; p++) {
        int j = p / 2, t = j / 8, u = j % 8;
        int col = u < 4 ? 4 * t + u : 16 + 4 * t + (u - 4);
        f8p_ix[p] = (uint8_t)(p % 2 ? 64 + col : col);
    }
#endif
}

static inline float f8p_scale(const Weight *w, int64_t n, int64_t k) {
    int64_t nb = n / w->bn, kb = k / w->bk;
    BOUND("FP8 scale block (outputs)", nb, w->scale_rows);
    BOUND("FP8 scale block (inputs)", kb, w->sld);
    return w->scales[nb * w->sld + kb];
}

/* Up to F8P_MANY_ROWS rows: the partial sums live in P, [rows, panel] fp32 (a thread's scratch, in
   L1/L2), while a pass of up to F8P_PASS pairs of weight rows goes across the whole panel, so each weight
   row is read as one run of panel bytes, with the next pass's rows prefetched. (Walking a strip of 32
   bytes down a block's rows instead, the sums in registers as f8p_strip does, read every weight row 32
   bytes at a time, 64 KB apart, which the hardware prefetchers do not follow: 1 / 2 rows ran at a quarter /
   a third of host_stored.c's rate.) At the end of a block of scales y = fma(P, s, y) (f8p_finish).
   Tried on a Zen 4 (bench_stored.py -D): passes of 8 pairs 0.68-0.92x at 1-2 rows (1.04-1.14x at 8); the
   prefetch to L1 or L3 instead of L2 0.80-1.15x, no better overall. */
#ifndef F8P_PASS
#define F8P_PASS 4  /* pairs of weight rows a pass: 8 rows streaming at once, as f8_rows */
#endif
#ifndef F8P_MANY_ROWS
#define F8P_MANY_ROWS 16  /* more rows than this take f8p_strip */
#endif
#ifndef F8P_PF_LOC
#define F8P_PF_LOC 1  /* the next pass's rows prefetched to L2 (as host_stored.c's streamed kernels) */
#endif

#if F8P_NATIVE
/* MR bf16 rows (row stride ldx, in bf16 values, from input k) x ns strips of 32 outputs, over the np <=
   F8P_PASS pairs of weight rows from wk (row k at the panel's first column, row stride ld), continuing
   the partial sums P (row stride ldp). pf: the next pass's first row (NULL: none) */
#define F8P_UNROLL _Pragma("GCC unroll 16")

typedef struct { __m512i th0, th1, tl0, tl1, ix, sign; } F8pTables;  /* kept in registers by the kernels */

static inline __attribute__((always_inline)) F8pTables f8p_load_tables(void) {
    return (F8pTables){_mm512_load_si512(f8p_hi), _mm512_load_si512(f8p_hi + 64), _mm512_load_si512(f8p_lo),
                       _mm512_load_si512(f8p_lo + 64), _mm512_load_si512(f8p_ix), _mm512_set1_epi8((char)0x80)};
}

/* weight rows k (r0) and k + 1 (r0 + ld) of a strip -> its 32 outputs' (w[k], w[k + 1]) bf16 pairs: outputs
   0-15 in *w0, 16-31 in *w1 */
static inline __attribute__((always_inline)) void f8p_decode(const F8pTables *t, const uint8_t *r0, int64_t ld,
                                                            __m512bh *w0, __m512bh *w1) {
    __m512i a = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)r0));
    __m512i b = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(r0 + ld)));
    __m512i codes = _mm512_permutex2var_epi8(a, t->ix, b);
    __m512i hi = _mm512_permutex2var_epi8(t->th0, codes, t->th1);
    __m512i lo = _mm512_permutex2var_epi8(t->tl0, codes, t->tl1);
    hi = _mm512_ternarylogic_epi32(hi, codes, t->sign, 0xF8); /* hi | (codes & 0x80) */
    *w0 = (__m512bh)_mm512_unpacklo_epi8(lo, hi);
    *w1 = (__m512bh)_mm512_unpackhi_epi8(lo, hi);
}

/* the pair (x[k], x[k + 1]) of MR rows (xk: row 0 at input k) into acc[MR][2] with the strip's pairs */
#define F8P_ROWS(MR, xk, ldx, acc, w0, w1)                                                                  \
    F8P_UNROLL for (int i = 0; i < MR; i++) {                                                              \
        uint32_t pair;                                                                                     \
        memcpy(&pair, (xk) + i * (ldx), sizeof pair);                                                      \
        __m512bh x = (__m512bh)_mm512_set1_epi32((int)pair);                                               \
        acc[i][0] = _mm512_dpbf16_ps(acc[i][0], x, w0);                                                    \
        acc[i][1] = _mm512_dpbf16_ps(acc[i][1], x, w1);                                                    \
    }
#define F8P_PASS_KERNEL(MR)                                                                                 \
    static void f8p_pass_##MR(const uint16_t *xb, int64_t ldx, const uint8_t *wk, int64_t ld, int np,      \
                              int64_t ns, float *P, int64_t ldp, const uint8_t *pf) {                      \
        const F8pTables t = f8p_load_tables();                                                             \
        for (int64_t st = 0; st < ns; st++) {                                                              \
            const uint8_t *col = wk + st * F8P_STRIP;                                                      \
            if (pf && (st & 1) == 0) /* the next pass's rows, a line at a time */                          \
                for (int r = 0; r < 2 * F8P_PASS; r++) __builtin_prefetch(pf + r * ld + st * F8P_STRIP, 0, F8P_PF_LOC); \
            __m512 acc[MR][2];                                                                             \
            F8P_UNROLL for (int i = 0; i < MR; i++) {                                                      \
                acc[i][0] = _mm512_loadu_ps(P + i * ldp + st * F8P_STRIP);                                 \
                acc[i][1] = _mm512_loadu_ps(P + i * ldp + st * F8P_STRIP + 16);                            \
            }                                                                                              \
            for (int r = 0; r < np; r++) {                                                                 \
                __m512bh w0, w1;                                                                           \
                f8p_decode(&t, col + 2 * r * ld, ld, &w0, &w1);                                            \
                F8P_ROWS(MR, xb + 2 * r, ldx, acc, w0, w1)                                                 \
            }                                                                                              \
            F8P_UNROLL for (int i = 0; i < MR; i++) {                                                      \
                _mm512_storeu_ps(P + i * ldp + st * F8P_STRIP, acc[i][0]);                                 \
                _mm512_storeu_ps(P + i * ldp + st * F8P_STRIP + 16, acc[i][1]);                            \
            }                                                                                              \
        }                                                                                                  \
    }
F8P_PASS_KERNEL(1)
F8P_PASS_KERNEL(2)
F8P_PASS_KERNEL(3)
F8P_PASS_KERNEL(4)
F8P_PASS_KERNEL(5)
F8P_PASS_KERNEL(6)
F8P_PASS_KERNEL(7)
F8P_PASS_KERNEL(8)

static void f8p_pass(int mr, const uint16_t *xb, int64_t ldx, const uint8_t *wk, int64_t ld, int np, int64_t ns,
                     float *P, int64_t ldp, const uint8_t *pf) {
    switch (mr) {
        case 1: f8p_pass_1(xb, ldx, wk, ld, np, ns, P, ldp, pf); break;
        case 2: f8p_pass_2(xb, ldx, wk, ld, np, ns, P, ldp, pf); break;
        case 3: f8p_pass_3(xb, ldx, wk, ld, np, ns, P, ldp, pf); break;
        case 4: f8p_pass_4(xb, ldx, wk, ld, np, ns, P, ldp, pf); break;
        case 5: f8p_pass_5(xb, ldx, wk, ld, np, ns, P, ldp, pf); break;
        case 6: f8p_pass_6(xb, ldx, wk, ld, np, ns, P, ldp, pf); break;
        case 7: f8p_pass_7(xb, ldx, wk, ld, np, ns, P, ldp, pf); break;
        default: f8p_pass_8(xb, ldx, wk, ld, np, ns, P, ldp, pf); break;
    }
}

/* Many rows (more than F8P_MANY_ROWS): each group of 8 goes over a block's weights in L2 (f8p_blocks'
   chunks) a strip at a time, the MR x 2 partial sums in registers for the whole block (no P traffic):
   1.3-1.4x the passes at 64-512 rows (scripts/bench_stored.py --fmt 4, Zen 4). xb from the block's
   first input k0 (the pairs [k0, k1) of one block), wk: row k0 at the strip's first column. Adds
   y = fma(P, s, y) itself. */
#define F8P_STRIP_KERNEL(MR)                                                                                \
    static void f8p_strip_##MR(const uint16_t *xb, int64_t ldx, const uint8_t *wk, int64_t ld, int np,     \
                               float s, float *y, int64_t ldy) {                                           \
        const F8pTables t = f8p_load_tables();                                                             \
        __m512 acc[MR][2];                                                                                 \
        F8P_UNROLL for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();                \
        for (int r = 0; r < np; r++) {                                                                     \
            __m512bh w0, w1;                                                                               \
            f8p_decode(&t, wk + 2 * r * ld, ld, &w0, &w1);                                                 \
            F8P_ROWS(MR, xb + 2 * r, ldx, acc, w0, w1)                                                     \
        }                                                                                                  \
        __m512 sv = _mm512_set1_ps(s);                                                                     \
        F8P_UNROLL for (int i = 0; i < MR; i++) {                                                          \
            float *yi = y + i * ldy;                                                                       \
            _mm512_storeu_ps(yi, _mm512_fmadd_ps(acc[i][0], sv, _mm512_loadu_ps(yi)));                     \
            _mm512_storeu_ps(yi + 16, _mm512_fmadd_ps(acc[i][1], sv, _mm512_loadu_ps(yi + 16)));           \
        }                                                                                                  \
    }
F8P_STRIP_KERNEL(1)
F8P_STRIP_KERNEL(2)
F8P_STRIP_KERNEL(3)
F8P_STRIP_KERNEL(4)
F8P_STRIP_KERNEL(5)
F8P_STRIP_KERNEL(6)
F8P_STRIP_KERNEL(7)
F8P_STRIP_KERNEL(8)

static void f8p_strip(int mr, const uint16_t *xb, int64_t ldx, const uint8_t *wk, int64_t ld, int np, float s,
                      float *y, int64_t ldy) {
    switch (mr) {
        case 1: f8p_strip_1(xb, ldx, wk, ld, np, s, y, ldy); break;
        case 2: f8p_strip_2(xb, ldx, wk, ld, np, s, y, ldy); break;
        case 3: f8p_strip_3(xb, ldx, wk, ld, np, s, y, ldy); break;
        case 4: f8p_strip_4(xb, ldx, wk, ld, np, s, y, ldy); break;
        case 5: f8p_strip_5(xb, ldx, wk, ld, np, s, y, ldy); break;
        case 6: f8p_strip_6(xb, ldx, wk, ld, np, s, y, ldy); break;
        case 7: f8p_strip_7(xb, ldx, wk, ld, np, s, y, ldy); break;
        default: f8p_strip_8(xb, ldx, wk, ld, np, s, y, ldy); break;
    }
}
#else
/* the definition's steps in plain C, one partial sum at a time (the same arguments) */
static void f8p_pass(int mr, const uint16_t *xb, int64_t ldx, const uint8_t *wk, int64_t ld, int np, int64_t ns,
                     float *P, int64_t ldp, const uint8_t *pf) {
    (void)pf;
    for (int i = 0; i < mr; i++)
        for (int64_t c = 0; c < ns * F8P_STRIP; c++) {
            float p = P[i * ldp + c];
            for (int r = 0; r < np; r++) {
                const uint16_t *xk = xb + i * ldx + 2 * r;
                p = p16_flush1(fmaf(p16_value(xk[1]), f8p_value[wk[(2 * r + 1) * ld + c]], p));
                p = p16_flush1(fmaf(p16_value(xk[0]), f8p_value[wk[2 * r * ld + c]], p));
            }
            P[i * ldp + c] = p;
        }
}

/* a block's pairs for mr rows x one strip, then y = fma(P, s, y) (the arguments of the kernels above) */
static void f8p_strip(int mr, const uint16_t *xb, int64_t ldx, const uint8_t *wk, int64_t ld, int np, float s,
                      float *y, int64_t ldy) {
    float P[F8_ROWS_MAX * F8P_STRIP] = {0};
    f8p_pass(mr, xb, ldx, wk, ld, np, 1, P, F8P_STRIP, NULL);
    for (int i = 0; i < mr; i++)
        for (int c = 0; c < F8P_STRIP; c++) y[i * ldy + c] = fmaf(P[i * F8P_STRIP + c], s, y[i * ldy + c]);
}
#endif

/* the end of a block of scales (inputs from kb): y = fma(P, s, y) for mr rows x the panel's ns strips
   from column n0, and P back to zero for the next block */
static void f8p_finish(int mr, float *P, int64_t ldp, const Weight *w, int64_t n0, int64_t ns, int64_t kb, float *y,
                       int64_t ldy) {
    for (int i = 0; i < mr; i++)
        for (int64_t st = 0; st < ns; st++) {
            float s = f8p_scale(w, n0 + st * F8P_STRIP, kb), *p = P + i * ldp + st * F8P_STRIP;
            float *yi = y + i * ldy + st * F8P_STRIP;
            for (int c = 0; c < F8P_STRIP; c++) {
                yi[c] = fmaf(p[c], s, yi[c]);
                p[c] = 0.0f;
            }
        }
}

/* rows to bf16 for fmt 4 (linear() rounds its input into this thread's buffer: M x K, kept) */
static __thread uint16_t *f8p_rows;
static __thread int64_t f8p_rows_cap;

static const uint16_t *f8p_round(const float *x, int64_t ldx, int64_t M, int64_t K) {
    if (M * K > f8p_rows_cap) {
        free(f8p_rows);
        f8p_rows_cap = M * K;
        f8p_rows = malloc((size_t)f8p_rows_cap * 2 + 2);
        if (!f8p_rows) {
            f8p_rows_cap = 0;
            return NULL;
        }
    }
    p16_round_rows(x, ldx, M, K, f8p_rows);
    return f8p_rows;
}

static __thread float *f8p_sums;  /* a pool thread's partial sums P (kept for the next product) */
static __thread int64_t f8p_sums_cap;

/* a pool job over column panels (LinearJob: x holds bf16 rows, row stride ldx in bf16 values; panel a
   multiple of 32): up to 8 rows a group (as even as may be), K in chunks of whole blocks of scales when
   there is more than one group, every group over a chunk while it is in L2 (as f8_row_blocks) */
static void f8p_blocks(void *c, int64_t lo, int64_t hi) {
    const LinearJob *j = (const LinearJob *)c;
    const uint16_t *xb = (const uint16_t *)j->x;
    const Weight *w = &j->w;
    const int64_t K = j->K, bk = w->bk, ld = w->ld;
    const int64_t kc = j->M > F8_ROWS_MAX ? (F8_KCHUNK > bk ? F8_KCHUNK / bk * bk : bk) : K;
    if (F8_ROWS_MAX * j->panel > f8p_sums_cap) {
        free(f8p_sums);
        f8p_sums = aligned_alloc(64, (size_t)F8_ROWS_MAX * j->panel * 4);
        f8p_sums_cap = f8p_sums ? F8_ROWS_MAX * j->panel : 0;
    }
    float *P = f8p_sums;
    if (!P) {  /* out of memory: stop with NaN outputs, never silently different ones */
        for (int64_t m = 0; m < j->M; m++)
            for (int64_t n = lo * j->panel; n < hi * j->panel && n < j->N; n++) j->y[m * j->ldy + n] = NAN;
        return;
    }
    for (int64_t b = lo; b < hi; b++) {
        int64_t n0 = b * j->panel, n1 = n0 + j->panel < j->N ? n0 + j->panel : j->N, ns = (n1 - n0) / F8P_STRIP;
        for (int64_t m = 0; m < j->M; m++)
            for (int64_t n = n0; n < n1; n++) j->y[m * j->ldy + n] = 0.0f;
        for (int64_t k0 = 0; k0 < K; k0 += kc) {
            int64_t k1 = K - k0 < kc ? K : k0 + kc;
            for (int64_t m0 = 0, mr; m0 < j->M; m0 += mr) {
                int64_t left = (j->M - m0 + F8_ROWS_MAX - 1) / F8_ROWS_MAX;
                mr = (j->M - m0 + left - 1) / left;
                if (j->M > F8P_MANY_ROWS) {  /* a block at a time in registers, a strip at a time */
                    for (int64_t kb = k0, ke; kb < k1; kb = ke) {
                        ke = (kb / bk + 1) * bk < k1 ? (kb / bk + 1) * bk : k1;
                        for (int64_t st = 0; st < ns; st++)
                            f8p_strip((int)mr, xb + m0 * j->ldx + kb, j->ldx, w->q + kb * ld + n0 + st * F8P_STRIP, ld,
                                      (int)((ke - kb) / 2), f8p_scale(w, n0 + st * F8P_STRIP, kb),
                                      j->y + m0 * j->ldy + n0 + st * F8P_STRIP, j->ldy);
                    }
                    continue;
                }
                memset(P, 0, (size_t)(mr * j->panel) * 4);
                for (int64_t kb = k0, ke; kb < k1; kb = ke) {
                    ke = (kb / bk + 1) * bk < k1 ? (kb / bk + 1) * bk : k1;
                    for (int64_t k = kb; k < ke; k += 2 * F8P_PASS) {
                        int np = (int)((ke - k) / 2 < F8P_PASS ? (ke - k) / 2 : F8P_PASS);
                        const uint8_t *wk = w->q + k * ld + n0;
                        const uint8_t *pf = k + 4 * F8P_PASS <= K ? wk + 2 * F8P_PASS * ld : NULL;
                        f8p_pass((int)mr, xb + m0 * j->ldx + k, j->ldx, wk, ld, np, ns, P, j->panel, pf);
                    }
                    f8p_finish((int)mr, P, j->panel, w, n0, ns, kb, j->y + m0 * j->ldy + n0, j->ldy);
                }
            }
        }
    }
}

/* may fmt 4 take a weight of this shape (else it is an error to ask: host_f8pairs.py keeps it on fmt 1) */
static int f8p_shape_ok(const Weight *w, int64_t K, int64_t N) {
    return K % 2 == 0 && w->bk % 2 == 0 && w->bk > 0 && N % F8P_STRIP == 0 && w->bn % F8P_STRIP == 0;
}

/* linear() for fmt 4: the rows rounded, then column panels of whole strips on the pool */
static void f8p_linear(const float *x, int64_t ldx, int64_t M, int64_t K, Weight w, int64_t N, float *y, int64_t ldy) {
    const uint16_t *xb = f8p_round(x, ldx, M, K);
    if (!xb) {  /* no memory for the rounded rows: stop with NaN outputs, never silently different ones */
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) y[m * ldy + n] = NAN;
        return;
    }
    int64_t per_thread = (N / F8P_STRIP + g_threads - 1) / g_threads * F8P_STRIP;
    int64_t cap = f8_panel_cap(M) / F8P_STRIP * F8P_STRIP;
    int64_t panel = per_thread < cap ? per_thread : cap;
    panel = panel < F8P_STRIP ? F8P_STRIP : panel;
    LinearJob job = {(const float *)xb, K, M, K, w, N, y, ldy, panel};
    int64_t blocks = (N + panel - 1) / panel, per_block = M * K * panel;
    int64_t grain = per_block >= 32768 ? 1 : (32768 + per_block - 1) / per_block;
    pool_run(blocks, grain, f8p_blocks, &job);
}

const char *ds4_f8p_kernel(void) { return F8P_KERNEL; }
int ds4_f8p_native(void) { return F8P_NATIVE; }

/* y [M, N] (row stride N) = the definition above in scalar C, one output at a time: x fp32 [M, K], codes
   [K, ld] with scales [scale_rows, sld] of bn x bk blocks (outputs x inputs). What the start-up probe and
   the tests hold the kernel to. -1: no memory; -2: a shape fmt 4 does not take. */
int ds4_f8p_reference(const float *x, int64_t M, int64_t K, const uint8_t *codes, int64_t ld, const float *scales,
                      int64_t sld, int64_t bn, int64_t bk, int64_t N, float *y) {
    if (K % 2 || bk % 2 || bk <= 0 || bn <= 0) return -2;
    uint16_t *xb = malloc((size_t)(M * K + 1) * 2);
    if (!xb) return -1;
    p16_round_rows(x, K, M, K, xb);
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            float out = 0.0f;
            for (int64_t k0 = 0; k0 < K; k0 += bk) {
                float p = 0.0f;
                for (int64_t k = k0; k < k0 + bk && k < K; k += 2) {
                    p = p16_flush1(fmaf(p16_value(xb[m * K + k + 1]), f8p_value[codes[(k + 1) * ld + n]], p));
                    p = p16_flush1(fmaf(p16_value(xb[m * K + k]), f8p_value[codes[k * ld + n]], p));
                }
                out = fmaf(p, scales[(n / bn) * sld + k0 / bk], out);
            }
            y[m * N + n] = out;
        }
    free(xb);
    return 0;
}
