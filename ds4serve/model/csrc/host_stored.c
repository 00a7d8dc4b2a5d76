/* Products over weights kept at the checkpoint's width (part of host.c; see host.h).

   Why: DS4-Flash stores its attention and shared-expert projections as FP8 e4m3 (one byte a weight,
   one scale per 128 x 128 block) and its embedding and LM head as bf16. Dequantised to fp32 at load
   they take 4x / 2x the bytes, and at real widths a decode step is bound by the bytes it reads (one
   token of one stream reads every projection once): held as stored, a step reads ~2.3x less. Here each
   weight is decoded in registers right before its multiply-adds, into exactly the fp32 value the
   dequantise-at-load path holds, and added in exactly the order the fp32 kernels add, so a product over
   a stored weight has the same bits as the same kernel over the dequantised one (tests pin this).

   FP8 projections are stored [K, N] (transposed once at load, host_forward.py), like the fp32 [K, N]
   weights, and add in the same order: every path continues one multiply-add chain per output in k order
   from zero, so the path taken never changes a bit (a zero activation's sign cannot reach a sum that
   starts at +0, so its broadcast, vsplat, need not normalise it). Up to F8_ROWS_THRESHOLD (40) rows stream the weight
   rows in panels of outputs, in groups of up to 8 rows made as even as may be (17 = 6 + 6 + 5): one or
   two rows take eight weight rows a pass (f8_rows, several output vectors interleaved for the sums'
   latency), 3-8 rows sixteen, with the accumulators of 8 x 2 vectors in registers (f8_many); both
   prefetch the next pass's rows, a line at a time (the rows of a pass are `panel` bytes apart from the
   next row's, which the hardware prefetchers do not follow). With more than one group, K is gone over
   in chunks of F8_KCHUNK weight rows, every group over a chunk while it is in L2, so a weight comes from
   memory once a step (a sum continued from its stored value is the same chain). More rows decode a
   [KN_KBLOCK, KN_NV VW] block into a thread's panel and run the fp32 register tiles over it (kn_tile):
   17-32 rows ran 1.2-1.5x faster streamed, 48+ faster decoded. The bf16 LM head stays [N, K] as loaded
   (1 GB at DS4's 129,280 x 4096; only the rows that need logits run it) and adds like nk_tile: lanes
   along k, then the lane sum, then the scalar tail, in tiles of up to 8 rows x 3 outputs (AVX-512) that
   prefetch the next tile's rows (B16_AHEAD).

   Decoding FP8 e4m3 (1 sign, 4 exponent bits biased by 7, 3 mantissa bits): the code's low 7 bits
   shifted to the top of an fp32 exponent/mantissa field give the value times 2^-120 exactly (normal
   and subnormal codes alike; the fp32 is then normal for normal codes and subnormal for subnormal
   ones), the sign goes to bit 31, and one product by the block scale times 2^120 (a power of two, so
   exact) gives the value times its scale rounded once, as the dequantiser's `code.float() * scale`
   rounds it once. Where the scales are powers of two (UE8M0, as DS4 stores them) and the activations
   leave every product exact, the scale moves to the activations instead (f8_foldable): no multiply a
   weight. NaN codes (0x7f / 0xff) are refused at load. bf16 widens exactly: its 16 bits become the top
   half of the fp32. */
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

/* VW FP8 e4m3 codes -> their values times 2^-120, exactly (fp8_raw), or times mul, the block's scale
   times 2^120 (fp8_vec). The sign-extended code shifted left by 20 puts the exponent and mantissa in
   place in an fp32, and clearing bits 27-30 (set by the sign extension of a negative code) leaves the
   sign alone in bit 31: three instructions a vector, the load widening. The F16C route (sign-extend to
   16 bits, shift, mask, vcvtph2ps: the value times 2^-8) is one more, and was slower on Zen 5 both for
   AVX-512 (24 vs 33 G weights/s, one row in L2) and AVX2 builds (15 vs 22). */
#if defined(__AVX512F__)
static inline vf fp8_raw(const uint8_t *p) {
    __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
    return (vf)_mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(v, 20), _mm512_set1_epi32((int)0x87F00000u)));
}
#elif defined(__AVX2__)
static inline vf fp8_raw(const uint8_t *p) {
    __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
    return (vf)_mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(v, 20), _mm256_set1_epi32((int)0x87F00000u)));
}
#else
static inline vf fp8_raw(const uint8_t *p) {
    vu u = widen_u8(p);
    vu bits = ((u & 0x7Fu) << 20) | ((u & 0x80u) << 24);
    vf f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#endif
#define FP8_BIAS 0x1p120f
static inline vf fp8_vec(const uint8_t *p, vf mul) { return fp8_raw(p) * mul; }

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

/* ---- FP8 [K, N]: one or two rows, eight weight rows a pass (the order of kn_rows) ----------------- */

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

#define F8_JU(MR) ((MR) == 1 ? 4 : 2)  /* output vectors f8_rows interleaves (the sums' latency) */
#ifndef F8_PF
#define F8_PF 1  /* prefetch the next pass's weight rows (0: leave it to the hardware, to compare) */
#endif
/* the prefetches' locality: to L2 (1) where few rows stream the weights (1-2 rows from DRAM: 1.06-1.13x
   against L1, whose few fill buffers the prefetches then hold), to L1 (3) under the many-row tiles
   (0.96-0.98x with L2 there), scripts/bench_stored.py on a Zen 5 */
#ifndef F8_PF_LOC
#define F8_PF_LOC 1
#endif
#ifndef F8_MANY_PF_LOC
#define F8_MANY_PF_LOC 3
#endif
#define F8_ROWS_MAX 8  /* rows a group of the streamed kernels */
/* outputs per panel of the streamed kernels at one row (half at two, a quarter beyond): each weight row is
   read in runs of `panel` bytes and the panel's outputs stay in L1/L2 */
#ifndef F8_PANEL_MAX
#define F8_PANEL_MAX 8192
#endif
/* May the panel's product fold its block scales into the activations? Then a weight is its code's value
   times 2^-120 (fp8_raw, no multiply) and an activation is x times the block's scale times
   2^120, and every product x * w has exactly the value of the dequantised path's product, so every
   rounding (the fused multiply-add's, or the product's and the sum's) is the same: that needs each scale
   to be a power of two (UE8M0: DS4's checkpoints) that is exact against every code (the value of a code times
   the scale is then exact, as the dequantiser's is), and each x times each scale (times 2^120) to
   stay a normal float (so exact): checked here over this panel's scales and the rows' activations (a
   pass over K x rows inputs, against K x panel weights). Non-finite activations take the multiply. */
static int f8_foldable(const Weight *w, int64_t n0, int64_t nv, const float *x, int64_t ldx, int64_t mr, int64_t k0,
                       int64_t K) {
    double smin = INFINITY, smax = 0.0, xmin = INFINITY, xmax = 0.0;
    if (K <= k0 || nv <= 0) return 0;
    int64_t nb_last = (n0 + nv * VW - 1) / w->bn, kb_last = (K - 1) / w->bk;
    for (int64_t nb = n0 / w->bn; nb <= nb_last; nb++)
        for (int64_t kb = k0 / w->bk; kb <= kb_last; kb++) {
            BOUND("FP8 scale block (outputs)", nb, w->scale_rows);
            BOUND("FP8 scale block (inputs)", kb, w->sld);
            float s = w->scales[nb * w->sld + kb];
            uint32_t bits;
            memcpy(&bits, &s, sizeof bits);
            if ((bits & 0x807FFFFFu) || bits >> 23 == 0 || bits >> 23 == 255) return 0;  /* a positive normal power of two */
            double sd = (double)s * FP8_BIAS;
            smin = sd < smin ? sd : smin;
            smax = sd > smax ? sd : smax;
        }
    for (int64_t i = 0; i < mr; i++)
        for (int64_t k = k0; k < K; k++) {
            double a = fabs((double)x[i * ldx + k]);
            if (!(a <= 0x1.fffffep127)) return 0;  /* inf or NaN */
            if (a != 0.0) {
                xmin = a < xmin ? a : xmin;
                xmax = a > xmax ? a : xmax;
            }
        }
    /* the smallest code's value is 2^-9: times a scale it must not fall below 2^-149 (then it is exact) */
    if (smin * 0x1p-9 / FP8_BIAS < 0x1p-149) return 0;
    return xmax == 0.0 || (xmin * smin >= 0x1p-126 && xmax * smax < 0x1p127);
}

/* eight weight rows (from wk, row stride ld) into MR rows of outputs over nv vectors: every output's sum
   continues in k order. fold: muls are the scales the activations take (f8_foldable said so). */
#define F8_EIGHT_PASS(MR)                                                                                  \
    static inline __attribute__((always_inline)) void f8_eight_##MR(const float *x, int64_t ldx, const uint8_t *wk,   \
                                                                    int64_t ld, const float *muls, int fold,  \
                                                                    const uint8_t *pf, float *y, int64_t ldy, \
                                                                    int64_t nv) {                             \
        for (int64_t j = 0, je; j < nv; j = je) {                                                         \
            /* a run of vectors whose activations are the same: one block of scales, or all (no fold) */  \
            float cur = fold ? muls[j] : 1.0f;                                                            \
            for (je = j + 1; je < nv && (!fold || muls[je] == cur); je++) {}                              \
            vf a[MR][8]; /* in registers: the stores to y cannot change them */                          \
            for (int i = 0; i < MR; i++)                                                                  \
                for (int q = 0; q < 8; q++) a[i][q] = vsplat(fold ? x[i * ldx + q] * cur : x[i * ldx + q]);   \
            for (; j + F8_JU(MR) <= je; j += F8_JU(MR)) { /* F8_JU chains interleaved: latency */               \
                vf acc[MR][F8_JU(MR)], m[F8_JU(MR)];                                                              \
                for (int u = 0; u < F8_JU(MR); u++) {                                                         \
                    m[u] = vsplat(muls[j + u]);                                                           \
                    for (int i = 0; i < MR; i++) acc[i][u] = vload(y + i * ldy + (j + u) * VW);           \
                }                                                                                         \
                if (pf && ((j * VW) & 63) == 0) /* the next pass's rows, a line at a time */            \
                    for (int q = 0; q < 8; q++) __builtin_prefetch(pf + q * ld + j * VW, 0, F8_PF_LOC);              \
                for (int q = 0; q < 8; q++)                                                               \
                    for (int u = 0; u < F8_JU(MR); u++) {                                                     \
                        const uint8_t *p = wk + q * ld + (j + u) * VW;                                    \
                        vf b = fold ? fp8_raw(p) : fp8_vec(p, m[u]);                                      \
                        for (int i = 0; i < MR; i++) acc[i][u] = vfma(a[i][q], b, acc[i][u]);             \
                    }                                                                                     \
                for (int u = 0; u < F8_JU(MR); u++)                                                           \
                    for (int i = 0; i < MR; i++) vstore(y + i * ldy + (j + u) * VW, acc[i][u]);           \
            }                                                                                             \
            for (; j < je; j++) {                                                                         \
                const uint8_t *wj = wk + j * VW;                                                          \
                vf b[8];                                                                                  \
                if (fold) {                                                                               \
                    for (int q = 0; q < 8; q++) b[q] = fp8_raw(wj + q * ld);                              \
                } else {                                                                                  \
                    vf m = vsplat(muls[j]);                                                               \
                    for (int q = 0; q < 8; q++) b[q] = fp8_vec(wj + q * ld, m);                           \
                }                                                                                         \
                for (int i = 0; i < MR; i++) {                                                            \
                    vf acc = vload(y + i * ldy + j * VW);                                                 \
                    for (int q = 0; q < 8; q++) acc = vfma(a[i][q], b[q], acc);                           \
                    vstore(y + i * ldy + j * VW, acc);                                                    \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
    }
F8_EIGHT_PASS(1)
F8_EIGHT_PASS(2)

/* weight rows [k, K) into MR rows of outputs (continuing their sums): four rows a pass while they share
   their scales, then one (blocks of inputs that are not a multiple of 8, and K's tail) */
#define F8_TAIL(MR)                                                                                      \
    static void f8_rows_tail_##MR(const float *x, int64_t ldx, int64_t k, int64_t K, const Weight *w, int64_t n0, \
                                  float *y, int64_t ldy, int64_t nv) {                                   \
        float muls[F8_PANEL_MAX / VW];                                                                   \
        int64_t kb_end = k; /* the first weight row of the next block of scales */                      \
        for (; k + 4 <= K; k += 4) {                                                                     \
            if (k >= kb_end) { /* the block size is a multiple of 4: four rows share their scales */    \
                fp8_row_muls(w, k, n0, nv, muls);                                                        \
                kb_end = (k / w->bk + 1) * w->bk;                                                        \
            }                                                                                            \
            const uint8_t *w0 = w->q + k * w->ld + n0, *w1 = w0 + w->ld, *w2 = w1 + w->ld, *w3 = w2 + w->ld; \
            for (int64_t j = 0; j < nv; j++) {                                                           \
                vf m = vsplat(muls[j]);                                                                  \
                vf b0 = fp8_vec(w0 + j * VW, m), b1 = fp8_vec(w1 + j * VW, m), b2 = fp8_vec(w2 + j * VW, m), \
                   b3 = fp8_vec(w3 + j * VW, m);                                                         \
                for (int i = 0; i < MR; i++) {                                                           \
                    const float *xi = x + i * ldx + k;                                                   \
                    vf acc = vload(y + i * ldy + j * VW);                                                \
                    acc = vfma(vsplat(xi[0]), b0, acc);                                                  \
                    acc = vfma(vsplat(xi[1]), b1, acc);                                                  \
                    acc = vfma(vsplat(xi[2]), b2, acc);                                                  \
                    acc = vfma(vsplat(xi[3]), b3, acc);                                                  \
                    vstore(y + i * ldy + j * VW, acc);                                                   \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        for (; k < K; k++) {                                                                             \
            fp8_row_muls(w, k, n0, nv, muls);                                                            \
            const uint8_t *wr = w->q + k * w->ld + n0;                                                   \
            for (int i = 0; i < MR; i++) {                                                               \
                vf a = vsplat(x[i * ldx + k]);                                                             \
                for (int64_t j = 0; j < nv; j++)                                                         \
                    vstore(y + i * ldy + j * VW,                                                         \
                           vfma(a, fp8_vec(wr + j * VW, vsplat(muls[j])), vload(y + i * ldy + j * VW)));    \
            }                                                                                            \
        }                                                                                                \
    }
F8_TAIL(1)
F8_TAIL(2)
F8_TAIL(3)
F8_TAIL(4)
F8_TAIL(5)
F8_TAIL(6)
F8_TAIL(7)
F8_TAIL(8)

#define F8_ROWS(MR)                                                                                      \
    static void f8_rows_##MR(const float *x, int64_t ldx, int64_t k0, int64_t K, int64_t Kall, const Weight *w, \
                             int64_t n0, float *y, int64_t ldy, int64_t nv) {                           \
        float muls[F8_PANEL_MAX / VW];                                                                   \
        int64_t kb_end = 0; /* the first weight row of the next block of scales */                      \
        for (int i = 0; i < MR && k0 == 0; i++)                                                          \
            for (int64_t j = 0; j < nv; j++) vstore(y + i * ldy + j * VW, (vf){});                      \
        int64_t k = k0;                                                                                  \
        if (w->bk % 8 == 0 && k0 % 8 == 0) { /* eight weight rows a pass */                            \
            int fold = f8_foldable(w, n0, nv, x, ldx, MR, k0, K);                                        \
            for (; k + 8 <= K; k += 8) {                                                                 \
                if (k >= kb_end) {                                                                       \
                    fp8_row_muls(w, k, n0, nv, muls);                                                    \
                    kb_end = (k / w->bk + 1) * w->bk;                                                    \
                }                                                                                        \
                const uint8_t *wk = w->q + k * w->ld + n0;                                               \
                const uint8_t *pf = F8_PF && k + 16 <= Kall ? wk + 8 * w->ld : NULL;                      \
                if (fold)                                                                                \
                    f8_eight_##MR(x + k, ldx, wk, w->ld, muls, 1, pf, y, ldy, nv);                       \
                else                                                                                     \
                    f8_eight_##MR(x + k, ldx, wk, w->ld, muls, 0, pf, y, ldy, nv);                       \
            }                                                                                            \
        }                                                                                                \
        if (k < K) f8_rows_tail_##MR(x, ldx, k, K, w, n0, y, ldy, nv);                                   \
    }
F8_ROWS(1)
F8_ROWS(2)

/* ---- FP8 [K, N]: 3 to 8 rows, sixteen weight rows a pass, the accumulators in registers ----------- */

#ifndef F8_MG
#define F8_MG 16  /* weight rows a pass of f8_many: the outputs are loaded and stored once per 16 */
#endif
#ifndef F8_MNV
#if VW == 16
#define F8_MNV 2  /* output vectors a step holds: 8 rows x 2 accumulators fit AVX-512's 32 registers */
#else
#define F8_MNV 2  /* AVX2: 6 rows x 2 (12 accumulators, 2 weights, a broadcast: its 16 registers) */
#endif
#endif
/* rows a register group holds: more rows go over the same F8_MG x F8_MNV weights in groups as even as may
   be (8 = 4 + 4), each decoding them again from L1. Why not 8 x 1 on AVX2: every multiply-add then
   takes its own broadcast load, one load a FMA plus the weight's (load-bound, ~35% of the FMA peak) */
#ifndef F8_GROUP
#if VW == 16
#define F8_GROUP 8
#else
#define F8_GROUP 6
#endif
#endif

/* MR rows x NV vectors of outputs from y over the F8_MG weight rows from p (row stride ld): each output's
   sum continues in k order; fold: xs [MR, F8_MG] are the activations times the vectors' one scale */
#define F8_MSTEP(MR, NV)                                                                                   \
    static inline __attribute__((always_inline)) void f8_mstep_##MR##_##NV(                                 \
        const float *xk, int64_t ldx, const float *xs, const uint8_t *p, int64_t ld, const float *muls,     \
        int fold, float *y, int64_t ldy) {                                                                  \
        vf acc[MR][NV], m[NV];                                                                              \
        for (int u = 0; u < NV; u++) {                                                                      \
            m[u] = vsplat(muls[u]);                                                                         \
            for (int i = 0; i < MR; i++) acc[i][u] = vload(y + i * ldy + u * VW);                           \
        }                                                                                                   \
        for (int q = 0; q < F8_MG; q++) {                                                                   \
            vf b[NV];                                                                                       \
            for (int u = 0; u < NV; u++) b[u] = fold ? fp8_raw(p + q * ld + u * VW) : fp8_vec(p + q * ld + u * VW, m[u]); \
            for (int i = 0; i < MR; i++) {                                                                  \
                vf a = vsplat(fold ? xs[i * F8_MG + q] : xk[i * ldx + q]);                                  \
                for (int u = 0; u < NV; u++) acc[i][u] = vfma(a, b[u], acc[i][u]);                          \
            }                                                                                               \
        }                                                                                                   \
        for (int u = 0; u < NV; u++)                                                                        \
            for (int i = 0; i < MR; i++) vstore(y + i * ldy + u * VW, acc[i][u]);                           \
    }

/* MR rows over a panel of nv vectors from column n0 (fewer rows: f8_rows): FMA-bound, so the multiply
   of the decode is folded away where it may be (f8_foldable; it also skips the multiply's slow subnormal
   inputs: vmulps on them cost this CPU ~2x at 8 rows). A subnormal code (exponent 0) still decodes to a
   subnormal fp32 here, and an Intel core takes a microcode assist for each multiply-add it feeds (AMD's
   do not): with a checkpoint's ~1e-4 of such codes the 8-row product runs ~1.2x slower on an Intel Xeon
   than with none (scripts/bench_stored.py, 2026-12-06). Every decode that keeps them normal (the F16C
   route, or a masked fix-up of exponent-0 lanes) costs AMD one or two more instructions a vector in an
   FMA-bound loop, so it is left as is. */
#define F8_MSTEP_X(MR, NV) F8_MSTEP(MR, NV) /* NV expanded first: the names carry F8_MNV's value */
#if F8_MNV != 1
#define F8_MSTEPS(MR) F8_MSTEP_X(MR, F8_MNV) F8_MSTEP(MR, 1)
#else
#define F8_MSTEPS(MR) F8_MSTEP(MR, 1)
#endif
F8_MSTEPS(1)
F8_MSTEPS(2)
F8_MSTEPS(3)
F8_MSTEPS(4)
F8_MSTEPS(5)
F8_MSTEPS(6)
F8_MSTEPS(7)
F8_MSTEPS(8)

/* rows [0, mr) of an F8_MG-row pass in register groups of at most F8_GROUP rows (each group's sums are
   its own: the split changes no order); nv: F8_MNV or 1. mr and nv are constants where it inlines. */
#define F8_MGROUP_CASE(G, NV)                                                                                \
    case G:                                                                                                  \
        f8_mstep_##G##_##NV(xk + i0 * ldx, ldx, xs + i0 * F8_MG, p, ld, muls, fold, y + i0 * ldy, ldy);      \
        break;
#define F8_MGROUPS(NV)                                                                                        \
    static inline __attribute__((always_inline)) void f8_mgroups_##NV(                                        \
        int mr, const float *xk, int64_t ldx, const float *xs, const uint8_t *p, int64_t ld, const float *muls,   \
        int fold, float *y, int64_t ldy) {                                                                    \
        int groups = (mr + F8_GROUP - 1) / F8_GROUP;                                                         \
        for (int i0 = 0, g; i0 < mr; i0 += g, groups--) {                                                   \
            g = (mr - i0 + groups - 1) / groups;                                                              \
            switch (g) {                                                                                      \
                F8_MGROUP_CASE(1, NV) F8_MGROUP_CASE(2, NV) F8_MGROUP_CASE(3, NV) F8_MGROUP_CASE(4, NV)       \
                F8_MGROUP_CASE(5, NV) F8_MGROUP_CASE(6, NV) F8_MGROUP_CASE(7, NV) default:                    \
                    f8_mstep_8_##NV(xk + i0 * ldx, ldx, xs + i0 * F8_MG, p, ld, muls, fold, y + i0 * ldy, ldy);   \
            }                                                                                                 \
        }                                                                                                     \
    }
F8_MGROUPS(1)
#if F8_MNV != 1
/* the macro's value in the name: one level of expansion first */
#define F8_MGROUPS_NV(NV) F8_MGROUPS(NV)
F8_MGROUPS_NV(F8_MNV)
#endif
#define F8_MGROUPS_CALL2(NV, ...) f8_mgroups_##NV(__VA_ARGS__)
#define F8_MGROUPS_CALL(NV, ...) F8_MGROUPS_CALL2(NV, __VA_ARGS__)

#define F8_MANY(MR)                                                                                        \
    static void f8_many_##MR(const float *x, int64_t ldx, int64_t k0, int64_t K, int64_t Kall, const Weight *w, \
                             int64_t n0, float *y, int64_t ldy, int64_t nv) {                               \
        float muls[F8_PANEL_MAX / VW], xs[MR * F8_MG], cur;                                                 \
        const int64_t ld = w->ld;                                                                           \
        int64_t kb_end = 0, k = k0;                                                                         \
        for (int i = 0; i < MR && k0 == 0; i++)                                                             \
            for (int64_t j = 0; j < nv; j++) vstore(y + i * ldy + j * VW, (vf){});                         \
        int whole = w->bk % F8_MG == 0 && k0 % F8_MG == 0; /* passes never straddle a block of scales */    \
        int fold = whole && f8_foldable(w, n0, nv, x, ldx, MR, k0, K);                                      \
        for (; whole && k + F8_MG <= K; k += F8_MG) {                                                       \
            if (k >= kb_end) {                                                                              \
                fp8_row_muls(w, k, n0, nv, muls);                                                           \
                kb_end = (k / w->bk + 1) * w->bk;                                                           \
            }                                                                                               \
            const uint8_t *wk = w->q + k * ld + n0;                                                         \
            const uint8_t *pf = F8_PF && k + 2 * F8_MG <= Kall ? wk + F8_MG * ld : NULL;                   \
            int64_t j = 0;                                                                                  \
            cur = 0.0f;                                                                                     \
            for (; j + F8_MNV <= nv; j += F8_MNV) {                                                         \
                if (pf && ((j * VW) & 63) == 0) /* the next pass's rows, a line at a time */               \
                    for (int q = 0; q < F8_MG; q++) __builtin_prefetch(pf + q * ld + j * VW, 0, F8_MANY_PF_LOC);    \
                int f = fold;                                                                               \
                for (int u = 1; u < F8_MNV; u++) f &= muls[j + u] == muls[j];                               \
                if (f && muls[j] != cur) { /* the activations times this scale (exact: f8_foldable) */     \
                    cur = muls[j];                                                                          \
                    for (int i = 0; i < MR; i++)                                                            \
                        for (int q = 0; q < F8_MG; q++) xs[i * F8_MG + q] = x[i * ldx + k + q] * cur;       \
                }                                                                                           \
                if (f)                                                                                      \
                    F8_MGROUPS_CALL(F8_MNV, MR, x + k, ldx, xs, wk + j * VW, ld, muls + j, 1, y + j * VW, ldy); \
                else                                                                                        \
                    F8_MGROUPS_CALL(F8_MNV, MR, x + k, ldx, xs, wk + j * VW, ld, muls + j, 0, y + j * VW, ldy); \
            }                                                                                               \
            for (; j < nv; j++) f8_mgroups_1(MR, x + k, ldx, xs, wk + j * VW, ld, muls + j, 0, y + j * VW, ldy); \
        }                                                                                                   \
        if (k < K) f8_rows_tail_##MR(x, ldx, k, K, w, n0, y, ldy, nv);                                      \
    }
F8_MANY(3)
F8_MANY(4)
F8_MANY(5)
F8_MANY(6)
F8_MANY(7)
F8_MANY(8)

/* weight rows a chunk when a panel has more than one group of rows: every group goes over the chunk while
   it is in L2 (KC x panel bytes: 512 KB at 16 rows), so the weights come from memory once, not once a
   group; a multiple of every pass's 8 / 16 rows */
#ifndef F8_KCHUNK
#define F8_KCHUNK 256
#endif

static void f8_row_blocks(void *c, int64_t lo, int64_t hi) {
    const LinearJob *j = (const LinearJob *)c;
    const int64_t K = j->K, kc = j->M > F8_ROWS_MAX ? F8_KCHUNK : K;
    for (int64_t b = lo; b < hi; b++) {
        int64_t n0 = b * j->panel, n1 = n0 + j->panel < j->N ? n0 + j->panel : j->N, nv = (n1 - n0) / VW;
        float *y = j->y + n0;
        for (int64_t k0 = 0; k0 < K; k0 += kc) {  /* each sum continues in k order across chunks */
            int64_t k1 = K - k0 < kc ? K : k0 + kc;
            for (int64_t m0 = 0, mr; m0 < j->M; m0 += mr) {  /* each weight decoded once per group of rows */
                int64_t left = (j->M - m0 + F8_ROWS_MAX - 1) / F8_ROWS_MAX;  /* groups left: as even as may be */
                mr = (j->M - m0 + left - 1) / left;  /* (17 rows: 6 + 6 + 5, not 8 + 8 + 1) */
                const float *x = j->x + m0 * j->ldx;
                float *ym = y + m0 * j->ldy;
                switch (mr) {
                    case 1: f8_rows_1(x, j->ldx, k0, k1, K, &j->w, n0, ym, j->ldy, nv); break;
                    case 2: f8_rows_2(x, j->ldx, k0, k1, K, &j->w, n0, ym, j->ldy, nv); break;
                    case 3: f8_many_3(x, j->ldx, k0, k1, K, &j->w, n0, ym, j->ldy, nv); break;
                    case 4: f8_many_4(x, j->ldx, k0, k1, K, &j->w, n0, ym, j->ldy, nv); break;
                    case 5: f8_many_5(x, j->ldx, k0, k1, K, &j->w, n0, ym, j->ldy, nv); break;
                    case 6: f8_many_6(x, j->ldx, k0, k1, K, &j->w, n0, ym, j->ldy, nv); break;
                    case 7: f8_many_7(x, j->ldx, k0, k1, K, &j->w, n0, ym, j->ldy, nv); break;
                    default: f8_many_8(x, j->ldx, k0, k1, K, &j->w, n0, ym, j->ldy, nv); break;
                }
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
                    f8_rows_1(j->x + m * j->ldx, j->ldx, 0, j->K, j->K, &j->w, n0, j->y + m * j->ldy + n0, j->ldy, nv);
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

/* y[m, n] = sum_k x[m, k] w[n, k] for MR rows x NR outputs of a bf16 [N, K] weight (row stride ld), each
   output in nk_tile's order (a vector of lanes along k, the lane sum, the scalar tail). One function per
   row count so the MR x NR accumulators stay in registers: with a runtime count (the 4 x 4 tile before)
   GCC kept them on the stack, ~45 GFLOP per CPU-second at 4 rows, and at 8 rows each head row was read
   twice. nr < NR: a short block repeats its last row and stores nr outputs. */
#ifndef B16_PF
#define B16_PF 1  /* prefetch the weights ahead (0: leave it to the hardware, to compare) */
#endif
#ifndef B16_PF_LOC
#define B16_PF_LOC 1  /* to L2: 1.25-1.5x at 1-2 rows, 1.06x at 8, against L1 (scripts/bench_stored.py, Zen 5) */
#endif
/* How far ahead: each row's counterpart in the next tile (NR rows on), at the same offset, so a tile's
   rows are in L2 when it starts. A tile reads NR whole rows, back to back in memory; prefetching 2 KB
   ahead in each row (as before: 1.30x at 8 rows against none, Zen 5) reached only the next tile's first
   row, and every tile began with NR - 1 rows missing to DRAM. One tile ahead, on an Intel Xeon (AVX-512,
   2 threads, the 129,280 x 4096 head): 1.10x at one row, 1.16x at 4, 1.28x at 8; the AVX2 build
   (-march=znver3) there 1.10x / 1.18x / 1.19x (scripts/bench_stored.py --head). */
#ifndef B16_AHEAD
#define B16_AHEAD next_tile
#endif
#define B16_TILE(MR, NR)                                                                                    \
    static void b16_tile_##MR##_##NR(const float *x, int64_t ldx, int64_t K, const uint8_t *w, int64_t ld, int nr,   \
                              float *y, int64_t ldy) {                                                      \
        vf acc[MR][NR];                                                                                 \
        const uint8_t *row[NR];                                                                         \
        const int64_t next_tile = (int64_t)NR * ld * 2; /* bytes from a row to the next tile's */      \
        for (int j = 0; j < NR; j++) row[j] = w + (j < nr ? j : nr - 1) * ld * 2;                      \
        for (int i = 0; i < MR; i++)                                                                        \
            for (int j = 0; j < NR; j++) acc[i][j] = (vf){};                                            \
        int64_t kv = K - K % VW, k = 0;                                                                     \
        for (; k < kv; k += VW) {                                                                           \
            vf b[NR];                                                                                   \
            if (B16_PF && (k & 31) == 0) /* the next tile's rows, a line at a time */                     \
                for (int j = 0; j < NR; j++) __builtin_prefetch(row[j] + 2 * k + B16_AHEAD, 0, B16_PF_LOC); \
            for (int j = 0; j < NR; j++) b[j] = bf16_vec(row[j] + 2 * k);                               \
            for (int i = 0; i < MR; i++) {                                                                  \
                vf a = vload(x + i * ldx + k);                                                              \
                for (int j = 0; j < NR; j++) acc[i][j] = vfma(a, b[j], acc[i][j]);                      \
            }                                                                                               \
        }                                                                                                   \
        for (int i = 0; i < MR; i++)                                                                        \
            for (int j = 0; j < nr; j++) {                                                                  \
                float s = vsum(acc[i][j]);                                                                  \
                for (int64_t kk = kv; kk < K; kk++) s = sfma(x[i * ldx + kk], bf16_one(row[j] + 2 * kk), s); \
                y[i * ldy + j] = s;                                                                         \
            }                                                                                               \
    }
B16_TILE(1, B16_NR1)
B16_TILE(1, B16_NR)
B16_TILE(2, B16_NR)
B16_TILE(3, B16_NR)
B16_TILE(4, B16_NR)
#if B16_MR > 4
B16_TILE(5, B16_NR)
B16_TILE(6, B16_NR)
#endif
#if B16_MR > 6
B16_TILE(7, B16_NR)
B16_TILE(8, B16_NR)
#endif

/* up to B16_MR rows x B16_NR outputs, or one row alone x B16_NR1 (the names carry the macros' names: an
   argument next to ## is not expanded) (nk_blocks cuts the rows into groups of at
   most B16_MR and the outputs into blocks of nk_width) */
static void b16_tile(const float *x, int64_t ldx, int mr, int64_t K, const uint8_t *w, int64_t ld, int nr, float *y,
                     int64_t ldy, int alone) {
    if (alone) {
        b16_tile_1_B16_NR1(x, ldx, K, w, ld, nr, y, ldy);
        return;
    }
    switch (mr) {
        case 1: b16_tile_1_B16_NR(x, ldx, K, w, ld, nr, y, ldy); break;
        case 2: b16_tile_2_B16_NR(x, ldx, K, w, ld, nr, y, ldy); break;
        case 3: b16_tile_3_B16_NR(x, ldx, K, w, ld, nr, y, ldy); break;
#if B16_MR > 6
        case 4: b16_tile_4_B16_NR(x, ldx, K, w, ld, nr, y, ldy); break;
        case 5: b16_tile_5_B16_NR(x, ldx, K, w, ld, nr, y, ldy); break;
        case 6: b16_tile_6_B16_NR(x, ldx, K, w, ld, nr, y, ldy); break;
        case 7: b16_tile_7_B16_NR(x, ldx, K, w, ld, nr, y, ldy); break;
        default: b16_tile_8_B16_NR(x, ldx, K, w, ld, nr, y, ldy); break;
#elif B16_MR > 4
        case 4: b16_tile_4_B16_NR(x, ldx, K, w, ld, nr, y, ldy); break;
        case 5: b16_tile_5_B16_NR(x, ldx, K, w, ld, nr, y, ldy); break;
        default: b16_tile_6_B16_NR(x, ldx, K, w, ld, nr, y, ldy); break;
#else
        default: b16_tile_4_B16_NR(x, ldx, K, w, ld, nr, y, ldy); break;
#endif
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
   forward calls linear() itself). ldy: the row stride of y (padded(N) for fp32 and FP8 [K, N]). -1: no memory; -2: a
   shape fmt 4 does not take (host_f8pairs.c). */
int ds4_linear(const float *x, int64_t M, int64_t K, const Weight *w, int64_t N, float *y, int64_t ldy, int threads) {
    g_threads = threads > 0 ? threads : 1;
    if (w->fmt == 4 && !f8p_shape_ok(w, K, N)) return -2;
    if (w->fmt == 3) {  /* rows rounded to bf16 first, as ds4_logits does (host_pairs.c) */
        uint16_t *xb = malloc((size_t)(M * K + 1) * 2);
        if (!xb) return -1;
        p16_round_rows(x, K, M, K, xb);
        linear((const float *)xb, K, M, K, *w, N, y, ldy);
        free(xb);
        return 0;
    }
    linear(x, K, M, K, *w, N, y, ldy);
    return 0;
}
