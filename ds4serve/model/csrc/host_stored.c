/* Products over weights kept at the checkpoint's width (part of host.c; see host.h).

   Why: DS4-Flash stores its attention and shared-expert projections as FP8 e4m3 (one byte a weight,
   one scale per 128 x 128 block) and its embedding and LM head as bf16. Dequantised to fp32 at load
   they take 4x / 2x the bytes, and at real widths a decode step is bound by the bytes it reads (one
   token of one stream reads every projection once): held as stored, a step reads ~2.3x less. Here each
   weight is decoded in registers right before its multiply-adds, into exactly the fp32 value the
   dequantise-at-load path holds, and added in exactly the order the fp32 kernels add, so a product over
   a stored weight has the same bits as the same kernel over the dequantised one (tests pin this).

   FP8 projections are stored [K, N] (transposed once at load, host_decode.py), like the fp32 [K, N]
   weights, and add in the same order: up to 16 rows stream the weight rows (as kn_rows does, in passes
   of up to 8 rows, each weight decoded once a pass), more rows decode a [KN_KBLOCK, KN_NV VW] block into a
   thread's panel and run the fp32 register tiles over it (kn_tile); every path continues one fused
   multiply-add chain per output in k order from zero, so the path taken never changes a bit. The bf16 LM
   head stays [N, K] as loaded (1 GB at DS4's 129,280 x 4096; only the rows that need logits run it) and
   adds like nk_tile: lanes along k, then the lane sum, then the scalar tail.

   Decoding FP8 e4m3 (1 sign, 4 exponent bits biased by 7, 3 mantissa bits): the code's low 7 bits
   shifted to the top of an fp32 exponent/mantissa field give the value times 2^-120 exactly (normal
   and subnormal codes alike; the fp32 is then normal for normal codes and subnormal for subnormal
   ones), the sign goes to bit 31, and one product by the block scale times 2^120 (a power of two, so
   exact) gives the value times its scale rounded once, as the dequantiser's `code.float() * scale`
   rounds it once. Targets with F16C take a shorter route to the value times 2^-8 (fp8_vec). NaN codes (0x7f / 0xff) are refused at load.
   bf16 widens exactly: its 16 bits become the top half of the fp32. */
#include "host.h"


typedef uint32_t vu __attribute__((vector_size(VW * 4)));
typedef uint16_t vh __attribute__((vector_size(VW * 2)));
typedef uint8_t vq __attribute__((vector_size(VW)));

/* VW bytes / 16-bit values zero-extended to 32-bit lanes: one instruction where the target has it
   (GCC 12 scalarises __builtin_convertvector from bytes: 16 inserts a vector, 3 G weights/s) */
static inline vu widen_u8(const uint8_t *p) {
#if defined(__AVX512F__)
    return (vu)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    return (vu)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    vq b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, vu);
#endif
}

static inline vu widen_u16(const uint8_t *p) {
#if defined(__AVX512F__)
    return (vu)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__AVX2__)
    return (vu)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    vh h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, vu);
#endif
}

/* VW FP8 e4m3 codes -> their values times mul (the block's scale times FP8_BIAS). With F16C (AVX2 and
   AVX-512 targets) a code becomes an fp16 with the same fields one exponent bit wider: the sign-extended
   byte shifted left by 7 puts the exponent and mantissa in place, and clearing bit 14 (set by the sign
   extension of a negative code) leaves the sign alone in bit 15; the fp16 is the code's value times 2^-8
   exactly (normal and subnormal codes), and vcvtph2ps widens it exactly: 4 instructions a vector where
   the integer route below takes 6. */
#if defined(__F16C__) && (defined(__AVX512F__) || defined(__AVX2__))
#define FP8_BIAS 0x1p8f
static inline vf fp8_vec(const uint8_t *p, vf mul) {
#if defined(__AVX512F__)
    __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16((short)0xBFFF));
    return (vf)_mm512_cvtph_ps(h) * mul;
#else
    __m128i h = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    h = _mm_and_si128(_mm_slli_epi16(h, 7), _mm_set1_epi16((short)0xBFFF));
    return (vf)_mm256_cvtph_ps(h) * mul;
#endif
}
#else
#define FP8_BIAS 0x1p120f
static inline vf fp8_vec(const uint8_t *p, vf mul) {
    vu u = widen_u8(p);
    vu bits = ((u & 0x7Fu) << 20) | ((u & 0x80u) << 24);
    vf f;
    memcpy(&f, &bits, sizeof f);
    return f * mul;
}
#endif

/* VW bf16 values (2 bytes each) widened to fp32 */
static inline vf bf16_vec(const uint8_t *p) {
    vu bits = widen_u16(p) << 16;
    vf f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float bf16_one(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* ---- FP8 [K, N]: one to ROWS_MAX rows, the order of kn_rows ---------------------------------------- */

/* the scales (times FP8_BIAS) of the nv vectors from column n0 in weight row k: muls[j] (two divisions a
   call, not two a vector: the block size is a multiple of VW, so a vector never straddles blocks) */
static inline void fp8_row_muls(const Weight *w, int64_t k, int64_t n0, int64_t nv, float *muls) {
    int64_t nb = n0 / w->bn, next = (nb + 1) * w->bn, kb = k / w->bk;
    for (int64_t j = 0; j < nv; j++) {
        int64_t n = n0 + j * VW;
        if (n >= next) nb++, next += w->bn;
        BOUND("FP8 scale block (outputs)", nb, w->scale_rows);
        BOUND("FP8 scale block (inputs)", kb, w->sld);
        muls[j] = w->scales[nb * w->sld + kb] * FP8_BIAS;  /* a power of two: exact */
    }
}

#ifndef F8_EIGHT
#define F8_EIGHT 1  /* one or two rows take eight weight rows per pass over the outputs (half the output traffic) */
#endif
#ifndef F8_EIGHT_ROWS
#define F8_EIGHT_ROWS 2  /* up to this many rows take eight weight rows a pass */
#endif
#define F8_ROWS_MAX 8  /* rows per pass of the streamed kernel: decoding, not the FMAs, bounds it */
/* outputs per panel of the streamed kernel at one row (half at two, a quarter beyond): each weight row is
   read in runs of `panel` bytes and the panel's outputs stay in L1/L2. FP8 codes in 1 KB runs (fp32's
   1024-output panel) streamed at ~20 G weights/s, 8 KB runs at ~25 (one row of 4096 x 8192 on 2 threads;
   8 rows ~13 either way) */
#ifndef F8_PANEL_MAX
#define F8_PANEL_MAX 8192
#endif
#define F8_ROWS(MR)                                                                                      \
    static void f8_rows_##MR(const float *x, int64_t ldx, int64_t K, const Weight *w, int64_t n0, float *y, \
                             int64_t ldy, int64_t nv) {                                                 \
        float muls[F8_PANEL_MAX / VW];                                                                   \
        int64_t kb_end = 0; /* the first weight row of the next block of scales */                      \
        for (int i = 0; i < MR; i++)                                                                     \
            for (int64_t j = 0; j < nv; j++) vstore(y + i * ldy + j * VW, (vf){});                      \
        int64_t k = 0;                                                                                   \
        if (F8_EIGHT && MR <= F8_EIGHT_ROWS && w->bk % 8 == 0) /* eight weight rows a pass */          \
            for (; k + 8 <= K; k += 8) {                                                                 \
                if (k >= kb_end) {                                                                       \
                    fp8_row_muls(w, k, n0, nv, muls);                                                    \
                    kb_end = (k / w->bk + 1) * w->bk;                                                    \
                }                                                                                        \
                const uint8_t *wk = w->q + k * w->ld + n0;                                               \
                for (int64_t j = 0; j < nv; j++) {                                                       \
                    vf m = vsplat(muls[j]), b[8];                                                        \
                    for (int q = 0; q < 8; q++) b[q] = fp8_vec(wk + q * w->ld + j * VW, m);              \
                    for (int i = 0; i < MR; i++) {                                                       \
                        vf acc = vload(y + i * ldy + j * VW);                                            \
                        for (int q = 0; q < 8; q++) acc = vfma(vsplat(x[i * ldx + k + q]), b[q], acc);   \
                        vstore(y + i * ldy + j * VW, acc);                                               \
                    }                                                                                    \
                }                                                                                        \
            }                                                                                            \
        for (; k + 4 <= K; k += 4) {                                                                     \
            if (k >= kb_end) { /* the block size is a multiple of 4: four rows share their scales */    \
                fp8_row_muls(w, k, n0, nv, muls);                                                        \
                kb_end = (k / w->bk + 1) * w->bk;                                                        \
            }                                                                                            \
            const uint8_t *w0 = w->q + k * w->ld + n0, *w1 = w0 + w->ld, *w2 = w1 + w->ld, *w3 = w2 + w->ld; \
            vf a[MR][4];                                                                                 \
            for (int i = 0; i < MR; i++)                                                                 \
                for (int q = 0; q < 4; q++) a[i][q] = vsplat(x[i * ldx + k + q]);                       \
            for (int64_t j = 0; j < nv; j++) {                                                           \
                vf m = vsplat(muls[j]);                                                                  \
                vf b0 = fp8_vec(w0 + j * VW, m), b1 = fp8_vec(w1 + j * VW, m), b2 = fp8_vec(w2 + j * VW, m), \
                   b3 = fp8_vec(w3 + j * VW, m);                                                         \
                for (int i = 0; i < MR; i++) {                                                           \
                    vf acc = vload(y + i * ldy + j * VW);                                                \
                    acc = vfma(a[i][0], b0, acc);                                                        \
                    acc = vfma(a[i][1], b1, acc);                                                        \
                    acc = vfma(a[i][2], b2, acc);                                                        \
                    acc = vfma(a[i][3], b3, acc);                                                        \
                    vstore(y + i * ldy + j * VW, acc);                                                   \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        for (; k < K; k++) {                                                                             \
            fp8_row_muls(w, k, n0, nv, muls);                                                            \
            const uint8_t *wr = w->q + k * w->ld + n0;                                                   \
            for (int i = 0; i < MR; i++) {                                                               \
                vf a = vsplat(x[i * ldx + k]);                                                           \
                for (int64_t j = 0; j < nv; j++)                                                         \
                    vstore(y + i * ldy + j * VW,                                                         \
                           vfma(a, fp8_vec(wr + j * VW, vsplat(muls[j])), vload(y + i * ldy + j * VW)));  \
            }                                                                                            \
        }                                                                                                \
    }
F8_ROWS(1)
F8_ROWS(2)
F8_ROWS(3)
F8_ROWS(4)
F8_ROWS(5)
F8_ROWS(6)
F8_ROWS(7)
F8_ROWS(8)

static void f8_row_blocks(void *c, int64_t lo, int64_t hi) {
    const LinearJob *j = (const LinearJob *)c;
    for (int64_t b = lo; b < hi; b++) {
        int64_t n0 = b * j->panel, n1 = n0 + j->panel < j->N ? n0 + j->panel : j->N, nv = (n1 - n0) / VW;
        float *y = j->y + n0;
        for (int64_t m0 = 0; m0 < j->M; m0 += F8_ROWS_MAX) {  /* each weight decoded once per 8 rows */
            int64_t mr = j->M - m0 < F8_ROWS_MAX ? j->M - m0 : F8_ROWS_MAX;
            const float *x = j->x + m0 * j->ldx;
            float *ym = y + m0 * j->ldy;
            switch (mr) {
                case 1: f8_rows_1(x, j->ldx, j->K, &j->w, n0, ym, j->ldy, nv); break;
                case 2: f8_rows_2(x, j->ldx, j->K, &j->w, n0, ym, j->ldy, nv); break;
                case 3: f8_rows_3(x, j->ldx, j->K, &j->w, n0, ym, j->ldy, nv); break;
                case 4: f8_rows_4(x, j->ldx, j->K, &j->w, n0, ym, j->ldy, nv); break;
                case 5: f8_rows_5(x, j->ldx, j->K, &j->w, n0, ym, j->ldy, nv); break;
                case 6: f8_rows_6(x, j->ldx, j->K, &j->w, n0, ym, j->ldy, nv); break;
                case 7: f8_rows_7(x, j->ldx, j->K, &j->w, n0, ym, j->ldy, nv); break;
                default: f8_rows_8(x, j->ldx, j->K, &j->w, n0, ym, j->ldy, nv); break;
            }
        }
    }
}

/* ---- FP8 [K, N]: more rows, decoded blocks under the fp32 register tiles (kn_blocks' order) -------- */

static __thread float *f8_panel;  /* a pool thread's decoded block (kept for the next step) */

/* weight rows [k0, k0 + kk) of the nv vectors from column n0, decoded into panel [kk, 4 VW] */
static void f8_decode_block(const Weight *w, int64_t k0, int64_t kk, int64_t n0, int nv, float *panel) {
    float muls[4];
    for (int64_t r = 0; r < kk; r++) {
        int64_t k = k0 + r;
        if (r == 0 || k % w->bk == 0) fp8_row_muls(w, k, n0, nv, muls);
        const uint8_t *src = w->q + k * w->ld + n0;
        for (int v = 0; v < nv; v++) vstore(panel + r * 4 * VW + v * VW, fp8_vec(src + v * VW, vsplat(muls[v])));
    }
}

static void f8_blocks(void *c, int64_t lo, int64_t hi) {
    const LinearJob *j = (const LinearJob *)c;
    if (!f8_panel) f8_panel = aligned_alloc(64, (size_t)KN_KBLOCK * 4 * VW * 4);
    for (int64_t b = lo; b < hi; b++) {
        int64_t n0 = b * KN_NV * VW;
        int nv = (int)((j->N - n0 + VW - 1) / VW < KN_NV ? (j->N - n0 + VW - 1) / VW : KN_NV);
        for (int64_t k0 = 0; k0 < j->K; k0 += KN_KBLOCK) {
            int64_t kk = j->K - k0 < KN_KBLOCK ? j->K - k0 : KN_KBLOCK;
            if (!f8_panel) {  /* out of memory: the block rows one at a time, the same sums */
                for (int64_t m = 0; m < j->M; m++)
                    f8_rows_1(j->x + m * j->ldx, j->ldx, j->K, &j->w, n0, j->y + m * j->ldy + n0, j->ldy, nv);
                break;
            }
            f8_decode_block(&j->w, k0, kk, n0, nv, f8_panel);
            for (int64_t m0 = 0; m0 < j->M; m0 += 6)
                kn_tile(j->x + m0 * j->ldx + k0, j->ldx, (int)(j->M - m0 < 6 ? j->M - m0 : 6), kk, f8_panel, 4 * VW,
                        nv, j->y + m0 * j->ldy + n0, j->ldy, k0 > 0);
        }
    }
}

/* ---- bf16 [N, K]: nk_tile's order, decoded in registers -------------------------------------------- */

/* y[m, n] = sum_k x[m, k] w[n, k] for up to 4 rows x 4 outputs of a bf16 [N, K] weight (row stride ld) */
static void b16_tile(const float *x, int64_t ldx, int mr, int64_t K, const uint8_t *w, int64_t ld, int nr, float *y,
                     int64_t ldy) {
    vf acc[4][4];
    memset(acc, 0, sizeof acc);
    const uint8_t *row[4];
    for (int j = 0; j < 4; j++) row[j] = w + (j < nr ? j : nr - 1) * ld * 2;  /* a short block repeats its last row */
    int64_t kv = K - K % VW, k = 0;
    for (; k < kv; k += VW) {
        vf b0 = bf16_vec(row[0] + 2 * k), b1 = bf16_vec(row[1] + 2 * k), b2 = bf16_vec(row[2] + 2 * k),
           b3 = bf16_vec(row[3] + 2 * k);
        for (int i = 0; i < mr; i++) {
            vf a = vload(x + i * ldx + k);
            acc[i][0] = vfma(a, b0, acc[i][0]); acc[i][1] = vfma(a, b1, acc[i][1]);
            acc[i][2] = vfma(a, b2, acc[i][2]); acc[i][3] = vfma(a, b3, acc[i][3]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            float s = vsum(acc[i][j]);
            for (int64_t kk = kv; kk < K; kk++) s = sfma(x[i * ldx + kk], bf16_one(row[j] + 2 * kk), s);
            y[i * ldy + j] = s;
        }
}

/* outputs per panel of the streamed FP8 kernel for M rows (at least one tile's width) */
static int64_t f8_panel_cap(int64_t M) {
    int64_t cap = M <= 1 ? F8_PANEL_MAX : M <= 2 ? F8_PANEL_MAX / 2 : F8_PANEL_MAX / 4;
    return cap < 4 * VW ? 4 * VW : cap;
}

/* one stored embedding row (bf16) widened into out [D] */
static void b16_row(const uint8_t *table, int64_t row, int64_t D, float *out) {
    const uint8_t *src = table + row * D * 2;
    int64_t k = 0, kv = D - D % VW;
    for (; k < kv; k += VW) vstore(out + k, bf16_vec(src + 2 * k));
    for (; k < D; k++) out[k] = bf16_one(src + 2 * k);
}

/* y [M, N] = x [M, K] @ W^T for a Weight of any kind: the tests' and benchmarks' entry point (the
   forward calls linear() itself). ldy: the row stride of y (padded(N) for fp32 and FP8 [K, N]). */
int ds4_linear(const float *x, int64_t M, int64_t K, const Weight *w, int64_t N, float *y, int64_t ldy, int threads) {
    g_threads = threads > 0 ? threads : 1;
    linear(x, K, M, K, *w, N, y, ldy);
    return 0;
}
