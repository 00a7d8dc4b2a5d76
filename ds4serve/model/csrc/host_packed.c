/* Products over routed experts kept packed in MXFP4 (part of host.c; see host.h).

   Why: a DS4-Flash checkpoint's routed experts are 277B of its 284B parameters. Dequantised to fp32
   they need 7.5x the bytes of their MXFP4 form (4 bits a value + one exponent byte per 32), so a step
   that reads experts as fp32 streams 7.5x the memory and a real checkpoint does not fit a host at all.
   Here the experts stay as the checkpoint has them (packed.py: codes [E, rows, K / 2], two E2M1 values
   a byte, the even input in the low nibble; scales [E, rows, K / 32], UE8M0 exponent bytes) and each
   block of 32 weights is decoded in registers right before its multiply-adds: a permute per 16 values
   out of the 16 weights its exponent byte allows (q_lut: fp4 value x 2^(e - 127), the one fp32 product
   quant.dequant_mxfp4 makes, done once at load), so the weights are exactly the dequantise-at-load
   values. Every row count, decode (1-8 rows an expert) and prefill alike, runs register tiles that
   decode each block once for up to 5 rows; two rows or more are first copied interleaved by block
   (q_interleave), so that a tile reads its inputs from one pointer.

   The products run along K ([N, K] dot products): one block's 16 bytes become the 16 even and the 16
   odd inputs' weights (low and high nibbles), so the input rows are first reordered the same way within
   each block (qperm_rows): even inputs of the block, then odd, in runs of VW. Each row's sums run in a
   fixed order whatever else is in the batch. */
#include "host.h"


typedef struct {  /* one expert stack packed: up to two parts along the output rows (gate, up) */
    const uint8_t *codes[2], *scales[2];
    int64_t rows[2];  /* output rows of each part (the stack's rows are part 0's, then part 1's) */
    int64_t nparts, K;
} QStack;

static float e8m0[256];
static const float fp4[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                              -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
/* the 16 weights a code can stand for under each exponent byte: q_lut[e][c] = fp4[c] * 2^(e - 127), the
   one fp32 product quant.dequant_mxfp4 makes, done once here instead of once per block (16 KiB) */
static float q_lut[256][16] __attribute__((aligned(64)));

__attribute__((constructor)) static void e8m0_init(void) {  /* 2 ** (byte - 127), as exp2 gives it (255: inf) */
    for (int e = 0; e < 256; e++) e8m0[e] = ldexpf(1.0f, e - 127);
    /* read through volatile so that the compiler multiplies every entry: folding -a * s into -(a * s)
       is the same number except for 0 * inf (byte 255), whose NaN would change sign */
    const volatile float *f = fp4;
    for (int e = 0; e < 256; e++)
        for (int c = 0; c < 16; c++) q_lut[e][c] = f[c] * e8m0[e];
}

/* one output row's packed codes and scales in expert e */
static inline void qrow(const QStack *q, int64_t e, int64_t n, const uint8_t **c, const uint8_t **s) {
    int p = n >= q->rows[0];
    int64_t r = n - (p ? q->rows[0] : 0), rows = q->rows[p];
    *c = q->codes[p] + (e * rows + r) * (q->K / 2);
    *s = q->scales[p] + (e * rows + r) * (q->K / 32);
}

/* The block's 32 weights in input order (even/odd runs of VW), scaled: w[0 .. 32 / VW), picked from the
   block's row of q_lut by explicit permutes. (GCC 12 compiled the generic form, a byte vector converted
   to int lanes and a variable __builtin_shuffle, into a load, a move and an insert per value: the
   decode cost ~10x the multiply-adds.) */
#if defined(__AVX512F__)
static inline void qdecode(const uint8_t *codes, uint8_t sbyte, vf *w) {
    __m512 lut = _mm512_load_ps(q_lut[sbyte]);
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes));  /* vpermps reads 4 bits */
    w[0] = (vf)_mm512_permutexvar_ps(b, lut);
    w[1] = (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut);
}
#elif defined(__AVX2__)
/* two 8-entry permutes (codes 0-7 and 8-15; the permute reads 3 index bits) and a blend on the code's
   bit 3 moved to the sign bit */
static inline __m256 qpick(__m256 lo, __m256 hi, __m256i idx, __m256i sign) {
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx), _mm256_permutevar8x32_ps(hi, idx),
                            _mm256_castsi256_ps(sign));
}
static inline void qdecode(const uint8_t *codes, uint8_t sbyte, vf *w) {
    __m256 lo = _mm256_load_ps(q_lut[sbyte]), hi = _mm256_load_ps(q_lut[sbyte] + 8);
    for (int h = 0; h < 2; h++) {
        __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + 8 * h)));
        w[2 * h] = (vf)qpick(lo, hi, b, _mm256_slli_epi32(b, 28));
        w[2 * h + 1] = (vf)qpick(lo, hi, _mm256_srli_epi32(b, 4), _mm256_slli_epi32(b, 24));
    }
}
#else
static inline void qdecode(const uint8_t *codes, uint8_t sbyte, vf *w) {
    const float *t = q_lut[sbyte];
    for (int h = 0; h < 16 / VW; h++)
        for (int j = 0; j < VW; j++) {
            uint8_t c = codes[h * VW + j];
            w[2 * h][j] = t[c & 15];
            w[2 * h + 1][j] = t[c >> 4];
        }
}
#endif

/* rows [M, K] (row stride ld) reordered in place within each block of 32 inputs to the order qdecode
   gives the weights: for each run h of VW bytes, the even inputs 2 (h VW + j), then the odd ones */
static void qperm_rows(float *x, int64_t M, int64_t K, int64_t ld) {
    float t[32];
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < K; b += 32) {
            float *blk = x + m * ld + b;
            for (int h = 0; h < 16 / VW; h++)
                for (int j = 0; j < VW; j++) {
                    t[2 * h * VW + j] = blk[2 * (h * VW + j)];
                    t[(2 * h + 1) * VW + j] = blk[2 * (h * VW + j) + 1];
                }
            memcpy(blk, t, sizeof t);
        }
}

/* Codes are prefetched this many bytes ahead of the block being decoded: the row streams of a tile
   (1-6 at a time, K / 2 bytes apart) come from memory at decode and the hardware prefetch alone left one
   core waiting on them (M = 1 from DRAM: 21 -> 28-31 G weights/s on one core of the Zen 5 measured). */
#define Q_PF 512

/* With 32 vector registers a block's inputs of every row are loaded once into registers and serve all
   NR outputs (an empty asm keeps GCC from folding them back into NR memory operands each); with 16
   there is no room, and each multiply-add reads its input from L1. */
#if VW == 16
#define Q_HOIST 1
#define Q_KEEP(v) __asm__("" : "+v"(v))
#else
#define Q_HOIST 0
#define Q_KEEP(v) ((void)0)
#endif

/* y[m, n] = sum_k xq[m, k] w[n, k] for MR rows x NR outputs (codes c[j], scales s[j]; nb blocks of 32),
   each block decoded in registers once for the MR rows. One function per shape, so the MR x NR
   accumulators stay in registers. Per output: lanes of fused multiply-adds over the k vectors in order
   from zero, then the lane sum, the order nk_tile adds in over a decoded panel (which the former panel
   path of this file used; the bits do not depend on the tile a row lands in). Block b of row i is at
   x + b BS + i RS: rows as given (BS 32, RS ldx; q_tile_MRxNR) or interleaved by q_interleave
   (BS 32 MR, RS 32; q_tilei_MRxNR, which reads every input at a constant offset from one pointer). H:
   the block's inputs are loaded into registers once for all NR outputs. */
#define Q_TILE_ANY(NAME, MR, NR, H, BS, RS)                                                                \
    static void NAME(const float *x, int64_t ldx, const uint8_t *const *c, const uint8_t *const *s, int64_t nb, \
                     float *y, int64_t ldy) {                                                              \
        (void)ldx;                                                                                         \
        vf acc[MR][NR];                                                                                    \
        for (int i = 0; i < MR; i++)                                                                       \
            for (int j = 0; j < NR; j++) acc[i][j] = (vf){};                                               \
        for (int64_t b = 0; b < nb; b++) {                                                                 \
            const float *xb = x + b * (BS);                                                                \
            vf xv[MR][H ? 32 / VW : 1];                                                                    \
            if (H)                                                                                         \
                for (int i = 0; i < MR; i++)                                                               \
                    for (int v = 0; v < 32 / VW; v++) {                                                    \
                        xv[i][v] = vload(xb + i * (RS) + v * VW);                                          \
                        Q_KEEP(xv[i][v]);                                                                  \
                    }                                                                                      \
            for (int j = 0; j < NR; j++) {                                                                 \
                vf w[32 / VW];                                                                             \
                __builtin_prefetch(c[j] + b * 16 + Q_PF);                                                  \
                qdecode(c[j] + b * 16, s[j][b], w);                                                        \
                for (int v = 0; v < 32 / VW; v++)                                                          \
                    for (int i = 0; i < MR; i++)                                                           \
                        acc[i][j] = vfma(H ? xv[i][H ? v : 0] : vload(xb + i * (RS) + v * VW), w[v], acc[i][j]); \
            }                                                                                              \
        }                                                                                                  \
        for (int i = 0; i < MR; i++)                                                                       \
            for (int j = 0; j < NR; j++) y[i * ldy + j] = vsum(acc[i][j]);                                 \
    }
#define Q_TILE(MR, NR) Q_TILE_ANY(q_tile_##MR##x##NR, MR, NR, Q_HOIST, 32, ldx)
#define Q_TILE_I(MR, NR) Q_TILE_ANY(q_tilei_##MR##x##NR, MR, NR, Q_HOIST, 32 * MR, 32)

typedef void (*q_tile_fn)(const float *, int64_t, const uint8_t *const *, const uint8_t *const *, int64_t, float *,
                          int64_t);

/* Tiles of 1 .. Q_MR rows, each with the output count measured fastest for it (enough independent
   accumulator chains to hide the multiply-add latency and share the input loads, few enough to stay in
   registers), and the one-output tile for the outputs left over; each in two forms, over rows as given
   and over rows interleaved (q_interleave, which every product of two or more rows uses). More rows
   than Q_MR run as tiles of 4 (the fastest per multiply-add) and one of the rest (q_group), each
   decoding the blocks again: the decode is a fifth of a 4-row tile's work, less than the panel of
   decoded weights this replaced cost to write and read back. Tiles of 6 or 8 rows ran 0.5-0.97x as fast
   with the inputs in registers or read from L1 (too few registers), and no faster with the weights of 3
   outputs in registers and each row's inputs loaded once (6x3, 7x3, 8x3: 1.12-1.16x the old tiles, as
   the interleaved 4x5). Q_OUT, the outputs one pool item covers, is a multiple of every NR. */
#define Q_TABLES(NR1, NR2, NR3, NR4, NR5)                                                                  \
    Q_TILE(1, NR1) Q_TILE(2, NR2) Q_TILE(3, NR3) Q_TILE(4, NR4) Q_TILE(5, NR5)                              \
    Q_TILE(1, 1) Q_TILE(2, 1) Q_TILE(3, 1) Q_TILE(4, 1) Q_TILE(5, 1)                                       \
    Q_TILE_I(2, NR2) Q_TILE_I(3, NR3) Q_TILE_I(4, NR4) Q_TILE_I(5, NR5)                                    \
    Q_TILE_I(2, 1) Q_TILE_I(3, 1) Q_TILE_I(4, 1) Q_TILE_I(5, 1)                                            \
    static const int q_tile_nr[Q_MR + 1] = {0, NR1, NR2, NR3, NR4, NR5};                                    \
    /* [interleaved][rows]: the tile of the row's NR outputs, and of one (one row is its own interleaving) */ \
    static const q_tile_fn q_tiles[2][Q_MR + 1] = {                                                        \
        {NULL, q_tile_1x##NR1, q_tile_2x##NR2, q_tile_3x##NR3, q_tile_4x##NR4, q_tile_5x##NR5},             \
        {NULL, q_tile_1x##NR1, q_tilei_2x##NR2, q_tilei_3x##NR3, q_tilei_4x##NR4, q_tilei_5x##NR5}};        \
    static const q_tile_fn q_tiles1[2][Q_MR + 1] = {                                                       \
        {NULL, q_tile_1x1, q_tile_2x1, q_tile_3x1, q_tile_4x1, q_tile_5x1},                                 \
        {NULL, q_tile_1x1, q_tilei_2x1, q_tilei_3x1, q_tilei_4x1, q_tilei_5x1}};
#define Q_MR 5
#if VW == 16
#define Q_OUT 60
Q_TABLES(6, 4, 6, 5, 4)
#else
#define Q_OUT 8
Q_TABLES(4, 4, 2, 2, 2)
#endif

/* rows of the group that starts at row m0 of M: tiles of 4 while more than Q_MR are left, then the rest */
static inline int q_group(int64_t M, int64_t m0) { return (int)(M - m0 <= Q_MR ? M - m0 : 4); }

/* y[m, n] for the mr <= Q_MR rows at x (interleaved by q_interleave, or rows ldx apart) and the nr
   outputs n0.. of expert e, decoded in registers */
static void q_tile(const float *x, int64_t ldx, int inter, int mr, const QStack *q, int64_t e, int64_t n0, int nr,
                   float *y, int64_t ldy) {
    int64_t nb = q->K / 32;
    int w = q_tile_nr[mr], j = 0;
    const uint8_t *c[8], *s[8];
    for (; j + w <= nr; j += w) {
        for (int t = 0; t < w; t++) qrow(q, e, n0 + j + t, &c[t], &s[t]);
        q_tiles[inter][mr](x, ldx, c, s, nb, y + j, ldy);
    }
    for (; j < nr; j++) {
        qrow(q, e, n0 + j, &c[0], &s[0]);
        q_tiles1[inter][mr](x, ldx, c, s, nb, y + j, ldy);
    }
}

typedef struct {
    const float *x;
    int64_t ldx, M;
    const QStack *q;
    int64_t e, N;
    float *y;
    int64_t ldy;
    const float *xi;  /* the rows interleaved by q_interleave, or NULL */
} QJob;

/* Q_OUT outputs per item, every row of the batch over them: the item's codes (Q_OUT x K / 2 bytes) stay
   in cache while the row tiles pass over them. Each row's sums run in the same order whatever tile
   it is in, so a row's result does not depend on the batch. */
static void q_blocks(void *c, int64_t lo, int64_t hi) {
    const QJob *j = (const QJob *)c;
    for (int64_t b = lo; b < hi; b++) {
        int64_t n0 = b * Q_OUT;
        int nr = (int)(j->N - n0 < Q_OUT ? j->N - n0 : Q_OUT);
        for (int64_t m0 = 0; m0 < j->M;) {
            int mr = q_group(j->M, m0);
            float *y = j->y + m0 * j->ldy + n0;
            if (j->xi)
                q_tile(j->xi + m0 * j->q->K, 32, 1, mr, j->q, j->e, n0, nr, y, j->ldy);
            else
                q_tile(j->x + m0 * j->ldx, j->ldx, 0, mr, j->q, j->e, n0, nr, y, j->ldy);
            m0 += mr;
        }
    }
}

/* The rows of xq interleaved by block within each group of q_group (the group at row m0 of mr rows: block
   b of its row i at m0 K + (b mr + i) 32), in this thread's buffer (kept for its next product), so that a
   tile reads all its inputs at constant offsets from one pointer: with a pointer per row GCC ran out of
   general registers and reloaded them from the stack every block (the 4-row tiles ran 1.06-1.36x faster
   interleaved, scripts/bench_mxfp4.py). The copy is M x K floats, ~1/(2 N) of the product's work. One
   row is its own interleaving; NULL when there is no memory (the tiles then read the rows where they are,
   in the same order: the same bits). */
static const float *q_interleave(const float *xq, int64_t ldx, int64_t M, int64_t K) {
    static __thread float *buf;
    static __thread int64_t cap;
    if (M == 1) return xq;
#if defined(Q_NO_INTERLEAVE)  /* tests: the path taken without memory for the copy */
    return NULL;
#endif
    if (M * K > cap) {
        free(buf);
        cap = M * K;
        buf = aligned_alloc(64, (size_t)cap * 4);
        if (!buf) {
            cap = 0;
            return NULL;
        }
    }
    for (int64_t m0 = 0, mr; m0 < M; m0 += mr) {
        mr = q_group(M, m0);
        for (int64_t b = 0; b < K / 32; b++)
            for (int64_t i = 0; i < mr; i++)
                memcpy(buf + m0 * K + (b * mr + i) * 32, xq + (m0 + i) * ldx + b * 32, 128);
    }
    return buf;
}

/* y [M, N] = xq [M, K] @ W_e^T for expert e of a packed stack (xq reordered by qperm_rows) */
static void q_linear(const float *xq, int64_t ldx, int64_t M, const QStack *q, int64_t e, int64_t N, float *y,
                     int64_t ldy) {
    QJob job = {xq, ldx, M, q, e, N, y, ldy, q_interleave(xq, ldx, M, q->K)};
    int64_t blocks = (N + Q_OUT - 1) / Q_OUT, per_block = M * q->K * Q_OUT;
    int64_t grain = per_block >= 32768 ? 1 : (32768 + per_block - 1) / per_block;
    pool_run(blocks, grain, q_blocks, &job);
}
