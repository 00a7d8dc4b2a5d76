/* MXFP4 expert products on int8 activations (part of host.c; see host.h).

   Why: at DS4-Flash's widths a decode step routes each row to 6 of the experts, so an expert sees 1-3
   rows and host_packed.c's fp32 product is bound by decoding: 4 instructions to turn 32 codes into fp32
   weights, then 2 fused multiply-adds a row. ggml (llama.cpp) quantises the activations to int8 and
   multiplies integers, 64 a row per instruction (VNNI), and ran the same experts 7x faster. This file
   does the same, with the native forward's rule that rounding is decided here, not by the compiler or the
   batch:

   - Activations (q8_quantize): each row's blocks of 32 inputs become int8 q = round(x * (127 / amax))
     (ties to even) and a scale amax / 127, amax the block's largest |x| (a block with a NaN or an
     infinity gives NaN outputs). A row's quantisation depends on that row alone.
   - Weights: an MXFP4 value is fp4 x 2^(e - 127) with fp4 in {0, .5, 1, 1.5, 2, 3, 4, 6} and a sign, so
     2 fp4 is an integer in [-12, 12]; the kernel multiplies u = 2 fp4 + 12 (unsigned, as VNNI wants)
     and removes 12 x (the block's sum of q) exactly afterwards.
   - Each (row, output, block) dot product is an exact integer; the output is then, block after block
     in order from zero, acc = fma(float(dot), (amax / 127 / 2) x 2^(e - 127), acc): the same operations
     on every instruction set (AVX-512 VNNI, AVX2, plain C), whatever the row's tile or batch.

   The weights are read in an interleaved layout made once at load (packed.py interleave_q8; the torch
   path reads it back through deinterleave_q8): for each group of 16 output rows and block b of 32
   inputs, 4 vectors of 64 bytes; byte 4j + r of vector t holds, in its low nibble, output j's input
   32b + 8t + r and, in its high nibble, input 32b + 8t + 4 + r. So one 64-byte load decodes into the
   weights of 16 outputs x 4 inputs, twice, and each VNNI instruction adds 4 products into each output's
   lane against 4 input bytes broadcast: an output's sum never leaves its lane, and the block's scale is
   applied once per 16 outputs. The scales: [group][block][16 outputs], one byte each. */
#include "host.h"

#define Q8_G 16          /* outputs of one interleaved group */
#define Q8_GROUP_BYTES 256  /* codes of one group and block: 16 outputs x 32 inputs / 2 */
#define Q8_MR 8          /* rows of the largest tile */
#define Q8_ITEM 4        /* groups one pool item covers (64 outputs) */
#define Q8_PF 1024       /* codes are prefetched this many bytes ahead of the block being decoded */

/* u = 2 fp4 + 12 for each code (the sign is bit 3) */
static const uint8_t q8_u[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

/* bytes of one quantised row of K inputs: K int8, then K / 32 float scales, then K / 32 int32 sums of q
   times -12; padded to whole cache lines */
static inline int64_t q8_row_bytes(int64_t K) { return (K + 8 * (K / 32) + 63) / 64 * 64; }

/* rows x [M, K] (row stride ldx floats) -> their quantised form at out (row stride ldq bytes) */
static void q8_quantize(const float *x, int64_t ldx, int64_t M, int64_t K, uint8_t *out, int64_t ldq) {
    int64_t nb = K / 32;
    for (int64_t m = 0; m < M; m++) {
        const float *r = x + m * ldx;
        int8_t *q = (int8_t *)(out + m * ldq);
        float *sx = (float *)(out + m * ldq + K);
        int32_t *corr = (int32_t *)(sx + nb);
        for (int64_t b = 0; b < nb; b++) {
            const float *v = r + 32 * b;
            float amax = 0.0f;
            int bad = 0;
            for (int i = 0; i < 32; i++) {
                float a = fabsf(v[i]);
                bad |= !(a <= 3.4028234663852886e38f);  /* NaN or infinity */
                amax = a > amax ? a : amax;
            }
            float id = amax > 0.0f ? 127.0f / amax : 0.0f;
            int32_t sum = 0;
            for (int i = 0; i < 32; i++) {
                int32_t t = bad ? 0 : (int32_t)nearbyintf(v[i] * id);
                q[32 * b + i] = (int8_t)t;
                sum += t;
            }
            sx[b] = bad ? NAN : (amax / 127.0f) * 0.5f;
            corr[b] = -12 * sum;
        }
    }
}

/* one output group: its codes, its scales (the group of output row n0 of expert e; rows[0] is a whole
   number of groups, so a group never straddles the two parts) */
static inline void q8_group(const QStack *q, int64_t e, int64_t n0, const uint8_t **c, const uint8_t **s) {
    int p = n0 >= q->rows[0];
    int64_t g = (n0 - (p ? q->rows[0] : 0)) / Q8_G, groups = q->rows[p] / Q8_G, nb = q->K / 32;
    *c = q->codes[p] + (e * groups + g) * nb * Q8_GROUP_BYTES;
    *s = q->scales[p] + (e * groups + g) * nb * Q8_G;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q8_KERNEL "AVX-512 VNNI"
/* mr rows (quantised, ldq bytes apart) x the 16 outputs of one group, all blocks: y[i * ldy + j] */
#define Q8_TILE(MR)                                                                                         \
    static void q8_tile_##MR(const uint8_t *xq, int64_t ldq, const uint8_t *c, const uint8_t *s, int64_t K,    \
                             float *y, int64_t ldy) {                                                          \
        const int64_t nb = K / 32;                                                                         \
        const __m512i tbl = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)q8_u));               \
        const __m512i low = _mm512_set1_epi8(0x0F);                                                        \
        const __m512i sub = _mm512_set1_epi32(0x00400000);  /* 2^-127, byte 0's scale */                   \
        __m512 acc[MR];                                                                                    \
        for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_ps();                                         \
        for (int64_t b = 0; b < nb; b++) {                                                                 \
            const uint8_t *cb = c + b * Q8_GROUP_BYTES;                                                    \
            __builtin_prefetch(cb + Q8_PF);                                                                \
            __builtin_prefetch(cb + Q8_PF + 64);                                                           \
            __builtin_prefetch(cb + Q8_PF + 128);                                                          \
            __builtin_prefetch(cb + Q8_PF + 192);                                                          \
            __m512i w[8];                                                                                  \
            for (int t = 0; t < 4; t++) {                                                                  \
                __m512i z = _mm512_loadu_si512((const void *)(cb + 64 * t));                               \
                w[2 * t] = _mm512_shuffle_epi8(tbl, _mm512_and_si512(z, low));                              \
                w[2 * t + 1] = _mm512_shuffle_epi8(tbl, _mm512_and_si512(_mm512_srli_epi16(z, 4), low));    \
            }                                                                                              \
            __m512i ex = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(s + b * Q8_G)));           \
            __m512i bits = _mm512_mask_mov_epi32(_mm512_slli_epi32(ex, 23),                                \
                                                 _mm512_cmpeq_epi32_mask(ex, _mm512_setzero_si512()), sub);  \
            __m512 dw = _mm512_castsi512_ps(bits);                                                         \
            for (int i = 0; i < MR; i++) {                                                                 \
                const uint8_t *r = xq + i * ldq;                                                           \
                const float *sx = (const float *)(r + K);                                                  \
                const int32_t *corr = (const int32_t *)(sx + nb);                                          \
                const int32_t *qb = (const int32_t *)(r + 32 * b);                                         \
                __m512i d0 = _mm512_set1_epi32(corr[b]), d1 = _mm512_setzero_si512();                      \
                for (int g = 0; g < 8; g += 2) {                                                           \
                    d0 = _mm512_dpbusd_epi32(d0, w[g], _mm512_set1_epi32(qb[g]));                           \
                    d1 = _mm512_dpbusd_epi32(d1, w[g + 1], _mm512_set1_epi32(qb[g + 1]));                   \
                }                                                                                          \
                __m512 sc = _mm512_mul_ps(_mm512_set1_ps(sx[b]), dw);                                      \
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1)), sc, acc[i]);        \
            }                                                                                              \
        }                                                                                                  \
        for (int i = 0; i < MR; i++) _mm512_storeu_ps(y + i * ldy, acc[i]);                                \
    }
#elif defined(__AVX2__) && defined(__FMA__)
#define Q8_KERNEL "AVX2"
/* the same as two halves of 8 outputs: u8 x s8 pairs (maddubs; a pair is at most 2 x 24 x 127, a sum of
   four pairs' results at most 24,384, inside int16), widened to int32 by madd against ones */
#define Q8_TILE(MR)                                                                                         \
    static void q8_tile_##MR(const uint8_t *xq, int64_t ldq, const uint8_t *c, const uint8_t *s, int64_t K,    \
                             float *y, int64_t ldy) {                                                          \
        const int64_t nb = K / 32;                                                                         \
        const __m256i tbl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)q8_u));          \
        const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);                           \
        const __m256i sub = _mm256_set1_epi32(0x00400000);                                                 \
        __m256 acc[MR][2];                                                                                 \
        for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();                          \
        for (int64_t b = 0; b < nb; b++) {                                                                 \
            const uint8_t *cb = c + b * Q8_GROUP_BYTES;                                                    \
            for (int p = 0; p < 4; p++) __builtin_prefetch(cb + Q8_PF + 64 * p);                           \
            for (int h = 0; h < 2; h++) {                                                                  \
                __m256i w[8];                                                                              \
                for (int t = 0; t < 4; t++) {                                                              \
                    __m256i z = _mm256_loadu_si256((const __m256i *)(cb + 64 * t + 32 * h));                \
                    w[2 * t] = _mm256_shuffle_epi8(tbl, _mm256_and_si256(z, low));                          \
                    w[2 * t + 1] = _mm256_shuffle_epi8(tbl, _mm256_and_si256(_mm256_srli_epi16(z, 4), low)); \
                }                                                                                          \
                __m256i ex = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(s + b * Q8_G + 8 * h))); \
                __m256i zero = _mm256_cmpeq_epi32(ex, _mm256_setzero_si256());                             \
                __m256 dw = _mm256_castsi256_ps(_mm256_blendv_epi8(_mm256_slli_epi32(ex, 23), sub, zero));  \
                for (int i = 0; i < MR; i++) {                                                             \
                    const uint8_t *r = xq + i * ldq;                                                       \
                    const float *sx = (const float *)(r + K);                                              \
                    const int32_t *corr = (const int32_t *)(sx + nb);                                      \
                    const int32_t *qb = (const int32_t *)(r + 32 * b);                                     \
                    __m256i p0 = _mm256_setzero_si256(), p1 = _mm256_setzero_si256();                      \
                    for (int g = 0; g < 4; g++) {                                                          \
                        p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(w[g], _mm256_set1_epi32(qb[g])));    \
                        p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(w[g + 4], _mm256_set1_epi32(qb[g + 4]))); \
                    }                                                                                      \
                    __m256i d = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(p0, ones),             \
                                                                  _mm256_madd_epi16(p1, ones)),            \
                                                 _mm256_set1_epi32(corr[b]));                              \
                    __m256 sc = _mm256_mul_ps(_mm256_set1_ps(sx[b]), dw);                                  \
                    acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), sc, acc[i][h]);                     \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
        for (int i = 0; i < MR; i++) {                                                                     \
            _mm256_storeu_ps(y + i * ldy, acc[i][0]);                                                      \
            _mm256_storeu_ps(y + i * ldy + 8, acc[i][1]);                                                  \
        }                                                                                                  \
    }
#else
#define Q8_KERNEL "portable C"
/* the definition in plain loops (the order of the integer sums does not matter: they are exact) */
#define Q8_TILE(MR)                                                                                         \
    static void q8_tile_##MR(const uint8_t *xq, int64_t ldq, const uint8_t *c, const uint8_t *s, int64_t K,    \
                             float *y, int64_t ldy) {                                                          \
        const int64_t nb = K / 32;                                                                         \
        for (int i = 0; i < MR; i++) {                                                                     \
            const uint8_t *r = xq + i * ldq;                                                               \
            const int8_t *q = (const int8_t *)r;                                                           \
            const float *sx = (const float *)(r + K);                                                      \
            const int32_t *corr = (const int32_t *)(sx + nb);                                              \
            for (int j = 0; j < Q8_G; j++) {                                                               \
                float acc = 0.0f;                                                                          \
                for (int64_t b = 0; b < nb; b++) {                                                         \
                    const uint8_t *cb = c + b * Q8_GROUP_BYTES;                                            \
                    int32_t d = corr[b];                                                                   \
                    for (int t = 0; t < 4; t++)                                                            \
                        for (int k = 0; k < 4; k++) {                                                      \
                            uint8_t byte = cb[64 * t + 4 * j + k];                                         \
                            d += q8_u[byte & 15] * q[32 * b + 8 * t + k] + q8_u[byte >> 4] * q[32 * b + 8 * t + 4 + k]; \
                        }                                                                                  \
                    acc = sfma((float)d, sx[b] * e8m0[s[b * Q8_G + j]], acc);                              \
                }                                                                                          \
                y[i * ldy + j] = acc;                                                                      \
            }                                                                                              \
        }                                                                                                  \
    }
#endif

Q8_TILE(1) Q8_TILE(2) Q8_TILE(3) Q8_TILE(4) Q8_TILE(5) Q8_TILE(6) Q8_TILE(7) Q8_TILE(8)

typedef void (*q8_tile_fn)(const uint8_t *, int64_t, const uint8_t *, const uint8_t *, int64_t, float *, int64_t);
static const q8_tile_fn q8_tiles[Q8_MR + 1] = {NULL, q8_tile_1, q8_tile_2, q8_tile_3, q8_tile_4,
                                               q8_tile_5, q8_tile_6, q8_tile_7, q8_tile_8};

typedef struct {
    const uint8_t *xq;
    int64_t ldq, M;
    const QStack *q;
    int64_t e, N;
    float *y;
    int64_t ldy;
} Q8Job;

/* Q8_ITEM groups of outputs per item, every row over them in tiles of up to Q8_MR (a group's codes,
   K / 2 x 16 bytes, stay in cache while the tiles pass over them) */
static void q8_blocks(void *c, int64_t lo, int64_t hi) {
    const Q8Job *j = (const Q8Job *)c;
    int64_t groups = j->N / Q8_G;
    for (int64_t it = lo; it < hi; it++)
        for (int64_t g = it * Q8_ITEM; g < (it + 1) * Q8_ITEM && g < groups; g++) {
            const uint8_t *codes, *scales;
            q8_group(j->q, j->e, g * Q8_G, &codes, &scales);
            for (int64_t m0 = 0; m0 < j->M; m0 += Q8_MR) {
                int mr = (int)(j->M - m0 < Q8_MR ? j->M - m0 : Q8_MR);
                q8_tiles[mr](j->xq + m0 * j->ldq, j->ldq, codes, scales, j->q->K, j->y + m0 * j->ldy + g * Q8_G,
                             j->ldy);
            }
        }
}

/* y [M, N] = the quantised rows xq [M] (q8_quantize, ldq bytes apart) times expert e's weights (N a
   whole number of groups) */
static void q8_linear(const uint8_t *xq, int64_t ldq, int64_t M, const QStack *q, int64_t e, int64_t N, float *y,
                      int64_t ldy) {
    Q8Job job = {xq, ldq, M, q, e, N, y, ldy};
    int64_t groups = N / Q8_G, items = (groups + Q8_ITEM - 1) / Q8_ITEM;
    int64_t per_item = M * q->K * Q8_G * Q8_ITEM;
    int64_t grain = per_item >= 65536 ? 1 : (65536 + per_item - 1) / per_item;
    pool_run(items, grain, q8_blocks, &job);
}

/* which of the three kernels above this build runs (the start-up log names it) */
const char *ds4_q8_kernel(void) { return Q8_KERNEL; }

/* y [M, N] = x [M, K] (fp32 rows) on int8 activations times one interleaved expert (codes and scales of
   N output rows, N a whole number of groups): the start-up self-check's probe of this kernel on the
   loaded checkpoint. -1: no memory. */
int ds4_q8_product(const float *x, int64_t M, int64_t K, const uint8_t *codes, const uint8_t *scales, int64_t N,
                   float *y, int threads) {
    int64_t ld = q8_row_bytes(K);
    uint8_t *xq = aligned_alloc(64, (size_t)(M * ld));
    if (!xq) return -1;
    g_threads = threads < 1 ? 1 : threads;
    QStack q = {{codes, NULL}, {scales, NULL}, {N, 0}, 1, K};
    q8_quantize(x, K, M, K, xq, ld);
    q8_linear(xq, ld, M, &q, 0, N, y, N);
    free(xq);
    return 0;
}

/* packed.interleave_q8 for one part (codes [E, R, K / 2], scales [E, R, K / 32]) in place, one expert at
   a time through a buffer of its size: at load, ~20x faster than the same permutation in torch. -1: no
   memory. */
int ds4_q8_interleave(uint8_t *codes, uint8_t *scales, int64_t E, int64_t R, int64_t K) {
    int64_t half = K / 2, nb = K / 32, G = R / Q8_G;
    uint8_t *tc = malloc((size_t)(R * half)), *ts = malloc((size_t)(R * nb));
    if (!tc || !ts) {
        free(tc);
        free(ts);
        return -1;
    }
    for (int64_t e = 0; e < E; e++) {
        uint8_t *c = codes + e * R * half, *s = scales + e * R * nb;
        for (int64_t g = 0; g < G; g++)
            for (int64_t b = 0; b < nb; b++)
                for (int t = 0; t < 4; t++)
                    for (int j = 0; j < Q8_G; j++) {
                        /* inputs 32b + 8t + (0..7) of row 16g + j: bytes 16b + 4t + (0..3) */
                        const uint8_t *src = c + (g * Q8_G + j) * half + 16 * b + 4 * t;
                        uint8_t *dst = tc + ((g * nb + b) * 4 + t) * 64 + 4 * j;
                        for (int r = 0; r < 4; r++) {
                            int k0 = r, k1 = 4 + r;  /* the inputs 8t + r and 8t + 4 + r */
                            uint8_t lo = (src[k0 / 2] >> (4 * (k0 % 2))) & 15, hi = (src[k1 / 2] >> (4 * (k1 % 2))) & 15;
                            dst[r] = (uint8_t)(lo | hi << 4);
                        }
                    }
        for (int64_t g = 0; g < G; g++)
            for (int64_t b = 0; b < nb; b++)
                for (int j = 0; j < Q8_G; j++) ts[(g * nb + b) * Q8_G + j] = s[(g * Q8_G + j) * nb + b];
        memcpy(c, tc, (size_t)(R * half));
        memcpy(s, ts, (size_t)(R * nb));
    }
    free(tc);
    free(ts);
    return 0;
}
