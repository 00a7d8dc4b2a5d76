/* Products and elementwise blocks of the host forward (part of host.c; see host.h). */
#include "host.h"


/* ---- products --------------------------------------------------------------------------------- */

/* y[m, n] = sum_k x[m, k] w[k, n] for MR rows x 4 vectors of outputs; w is [K, N] with row stride ldw.
   One function per row count, so the accumulators stay in registers (a runtime count spills them). */
#define KN_TILE(MR)                                                                                      \
    static void kn_tile_##MR(const float *x, int64_t ldx, int64_t K, const float *w, int64_t ldw, float *y, \
                             int64_t ldy, int add) {                                                     \
        vf acc[MR][4];                                                                                   \
        for (int i = 0; i < MR; i++)                                                                     \
            for (int j = 0; j < 4; j++) acc[i][j] = add ? vload(y + i * ldy + j * VW) : (vf){};          \
        for (int64_t k = 0; k < K; k++) {                                                                \
            const float *wr = w + k * ldw;                                                               \
            vf b0 = vload(wr), b1 = vload(wr + VW), b2 = vload(wr + 2 * VW), b3 = vload(wr + 3 * VW);    \
            for (int i = 0; i < MR; i++) {                                                               \
                vf a = vsplat(x[i * ldx + k]);                                                           \
                acc[i][0] = vfma(a, b0, acc[i][0]); acc[i][1] = vfma(a, b1, acc[i][1]);                  \
                acc[i][2] = vfma(a, b2, acc[i][2]); acc[i][3] = vfma(a, b3, acc[i][3]);                  \
            }                                                                                            \
        }                                                                                                \
        for (int i = 0; i < MR; i++)                                                                     \
            for (int j = 0; j < 4; j++) vstore(y + i * ldy + j * VW, acc[i][j]);                         \
    }
KN_TILE(1)
KN_TILE(2)
KN_TILE(3)
KN_TILE(4)
KN_TILE(5)
KN_TILE(6)

/* the same for mr <= 6 rows x nv < 4 vectors (the last block of a padded small projection: the mHC
   mixes are 24 columns = 2 vectors, a q_a of 96 columns ends in 2): one function per (rows, vectors), so
   the accumulators stay in registers (a generic loop over a runtime count spilled them: a verify step of
   4-5 rows on the bundled model spent 12% of its time there). Every output is the same fused
   multiply-add chain in k order as in every other tile. On AVX2 builds (KN_NV = 2) every block takes
   these. The weight rows of a [K, N] product are ldw floats apart (a page or more for N >= 1024), where
   the hardware prefetchers do not follow, so the row KN_PF ahead is prefetched (16 decoder rows of the
   Flash-shaped checkpoint on Zen 3: +10% tok/s). */
#ifndef KN_PF
#define KN_PF 16
#endif
#define KN_PREFETCH(p, NV)                                                                  \
    do {                                                                                    \
        for (int j_ = 0; j_ < (NV) * VW; j_ += 16) __builtin_prefetch((p) + j_, 0, 3);       \
    } while (0)
#define KN_TILE_MxNV(MR, NV)                                                                              \
    static void kn_tile_##MR##x##NV(const float *x, int64_t ldx, int64_t K, const float *w, int64_t ldw,  \
                                    float *y, int64_t ldy, int add) {                                     \
        vf acc[MR][NV];                                                                                   \
        for (int i = 0; i < MR; i++)                                                                      \
            for (int j = 0; j < NV; j++) acc[i][j] = add ? vload(y + i * ldy + j * VW) : (vf){};          \
        for (int64_t k = 0; k < K; k++) {                                                                 \
            vf b[NV];                                                                                     \
            KN_PREFETCH(w + (k + KN_PF) * ldw, NV);                                                       \
            for (int j = 0; j < NV; j++) b[j] = vload(w + k * ldw + j * VW);                              \
            for (int i = 0; i < MR; i++) {                                                                \
                vf a = vsplat(x[i * ldx + k]);                                                            \
                for (int j = 0; j < NV; j++) acc[i][j] = vfma(a, b[j], acc[i][j]);                        \
            }                                                                                             \
        }                                                                                                 \
        for (int i = 0; i < MR; i++)                                                                      \
            for (int j = 0; j < NV; j++) vstore(y + i * ldy + j * VW, acc[i][j]);                        \
    }
#define KN_TILES_NV(MR) KN_TILE_MxNV(MR, 1) KN_TILE_MxNV(MR, 2) KN_TILE_MxNV(MR, 3)
KN_TILES_NV(1)
KN_TILES_NV(2)
KN_TILES_NV(3)
KN_TILES_NV(4)
KN_TILES_NV(5)
KN_TILES_NV(6)

typedef void (*KnTile)(const float *, int64_t, int64_t, const float *, int64_t, float *, int64_t, int);
#define KN_ROW_NV(MR) {kn_tile_##MR##x1, kn_tile_##MR##x2, kn_tile_##MR##x3}
static const KnTile KN_NARROW[6][3] = {KN_ROW_NV(1), KN_ROW_NV(2), KN_ROW_NV(3), KN_ROW_NV(4), KN_ROW_NV(5),
                                       KN_ROW_NV(6)};

static void kn_tile_narrow(const float *x, int64_t ldx, int mr, int64_t K, const float *w, int64_t ldw, int nv,
                           float *y, int64_t ldy, int add) {
    KN_NARROW[mr - 1][nv - 1](x, ldx, K, w, ldw, y, ldy, add);
}

/* add: start from the outputs already in y (a later block of K rows) instead of zero; continuing the
   same chain of fused multiply-adds from a stored float gives the same bits as one pass over all K */
static void kn_tile(const float *x, int64_t ldx, int mr, int64_t K, const float *w, int64_t ldw, int nv,
                    float *y, int64_t ldy, int add) {
    if (nv < 4) {
        kn_tile_narrow(x, ldx, mr, K, w, ldw, nv, y, ldy, add);
        return;
    }
    switch (mr) {
        case 1: kn_tile_1(x, ldx, K, w, ldw, y, ldy, add); break;
        case 2: kn_tile_2(x, ldx, K, w, ldw, y, ldy, add); break;
        case 3: kn_tile_3(x, ldx, K, w, ldw, y, ldy, add); break;
        case 4: kn_tile_4(x, ldx, K, w, ldw, y, ldy, add); break;
        case 5: kn_tile_5(x, ldx, K, w, ldw, y, ldy, add); break;
        default: kn_tile_6(x, ldx, K, w, ldw, y, ldy, add); break;
    }
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
                acc[i][0] = vfma(a, w0, acc[i][0]); acc[i][1] = vfma(a, w1, acc[i][1]);
                acc[i][2] = vfma(a, w2, acc[i][2]); acc[i][3] = vfma(a, w3, acc[i][3]);
            }
        }
    } else {
        for (; k < kv; k += VW)
            for (int j = 0; j < nr; j++) {
                vf b = vload(w + j * ldw + k);
                for (int i = 0; i < mr; i++) acc[i][j] = vfma(vload(x + i * ldx + k), b, acc[i][j]);
            }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            float s = vsum(acc[i][j]);
            for (int64_t kk = kv; kk < K; kk++) s = sfma(x[i * ldx + kk], w[j * ldw + kk], s);
            y[i * ldy + j] = s;
        }
}

/* Up to ROWS_MAX rows: y[m, n] = sum_k x[m, k] w[k, n] over a panel of nv vectors of outputs. A few
   rows are a matrix-vector product, bound by how fast the weights stream in. The register tiles above
   walk a column panel of 4 vectors down all K rows, so every row of the walk starts a new page (the
   row stride is the whole width): 13-14 GB/s on a 4096 x 4096 weight where this machine streams 43.
   Here the outputs of a wide panel (at most ROW_PANEL floats per row, in L1) are updated four weight
   rows at a time, so the weights are read in long runs along their rows (1-3 rows measured faster
   this way, 4 rows not). Each output still adds its K terms one fused multiply-add at a time in k
   order from zero, like every tile above, so a row's bits do not depend on which kernel computed it
   (batch invariance). */
#define ROW_PANEL 1024
#define ROWS_MAX 3
#define KN_ROWS(MR)                                                                                      \
    static void kn_rows_##MR(const float *x, int64_t ldx, int64_t K, const float *w, int64_t ldw, float *y, \
                             int64_t ldy, int64_t nv) {                                                 \
        for (int i = 0; i < MR; i++)                                                                     \
            for (int64_t j = 0; j < nv; j++) vstore(y + i * ldy + j * VW, (vf){});                      \
        int64_t k = 0;                                                                                   \
        for (; k + 4 <= K; k += 4) {                                                                     \
            const float *w0 = w + k * ldw, *w1 = w0 + ldw, *w2 = w1 + ldw, *w3 = w2 + ldw;              \
            vf a[MR][4];                                                                                 \
            for (int i = 0; i < MR; i++)                                                                 \
                for (int q = 0; q < 4; q++) a[i][q] = vsplat(x[i * ldx + k + q]);                       \
            for (int64_t j = 0; j < nv; j++) {                                                           \
                vf b0 = vload(w0 + j * VW), b1 = vload(w1 + j * VW), b2 = vload(w2 + j * VW),            \
                   b3 = vload(w3 + j * VW);                                                              \
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
            const float *wr = w + k * ldw;                                                               \
            for (int i = 0; i < MR; i++) {                                                               \
                vf a = vsplat(x[i * ldx + k]);                                                           \
                for (int64_t j = 0; j < nv; j++)                                                         \
                    vstore(y + i * ldy + j * VW, vfma(a, vload(wr + j * VW), vload(y + i * ldy + j * VW))); \
            }                                                                                            \
        }                                                                                                \
    }
KN_ROWS(1)
KN_ROWS(2)
KN_ROWS(3)

typedef struct {
    const float *x;
    int64_t ldx, M, K;
    Weight w;
    int64_t N;
    float *y;
    int64_t ldy;
    int64_t panel;  /* products of 1-ROWS_MAX rows: outputs per panel (a whole number of vectors) */
} LinearJob;

/* up to ROWS_MAX rows, panels of job->panel outputs (at most ROW_PANEL; the last one narrower) */
static void kn_row_blocks(void *c, int64_t lo, int64_t hi) {
    const LinearJob *j = (const LinearJob *)c;
    for (int64_t b = lo; b < hi; b++) {
        int64_t n0 = b * j->panel, n1 = n0 + j->panel < j->N ? n0 + j->panel : j->N, nv = (n1 - n0) / VW;
        const float *w = j->w.p + n0;
        float *y = j->y + n0;
        switch (j->M) {
            case 1: kn_rows_1(j->x, j->ldx, j->K, w, j->w.ld, y, j->ldy, nv); break;
            case 2: kn_rows_2(j->x, j->ldx, j->K, w, j->w.ld, y, j->ldy, nv); break;
            default: kn_rows_3(j->x, j->ldx, j->K, w, j->w.ld, y, j->ldy, nv); break;
        }
    }
}

/* Weight rows per pass of the 6-row tiles: a [512, 64] block (128 KB) stays in L2 while every group of 6
   rows goes over it, instead of each group streaming all K rows again (a 4096 x 4096 product of 16
   rows: 60 -> 85 GFLOP/s, 64 rows 114 -> 142; K <= 512, one block, is unchanged). */
#ifndef KN_KBLOCK
#define KN_KBLOCK 512
#endif
/* Vectors of outputs per register tile of many rows: 6 x 4 accumulators want AVX-512's 32 registers; with
   AVX2's 16 they spill to the stack on every multiply-add, and 6 x 2 fit (a 960-token prefill on the AVX2
   build ran 1.9x slower than on AVX-512 before this; the order of every output's sum is the same). */
#if VW == 16
#define KN_NV 4
#else
#define KN_NV 2
#endif
static void kn_blocks(void *c, int64_t lo, int64_t hi) {
    const LinearJob *j = (const LinearJob *)c;
    for (int64_t b = lo; b < hi; b++) {
        int64_t n0 = b * KN_NV * VW;
        int nv = (int)((j->N - n0 + VW - 1) / VW < KN_NV ? (j->N - n0 + VW - 1) / VW : KN_NV);
        for (int64_t k0 = 0; k0 < j->K; k0 += KN_KBLOCK)  /* a block of weight rows stays in cache for all rows */
            for (int64_t m0 = 0; m0 < j->M; m0 += 6)
                kn_tile(j->x + m0 * j->ldx + k0, j->ldx, (int)(j->M - m0 < 6 ? j->M - m0 : 6),
                        j->K - k0 < KN_KBLOCK ? j->K - k0 : KN_KBLOCK, j->w.p + k0 * j->w.ld + n0, j->w.ld, nv,
                        j->y + m0 * j->ldy + n0, j->ldy, k0 > 0);
    }
}

/* host_stored.c: the kernels over weights kept at the checkpoint's width, which linear() picks by fmt */
static void b16_tile(const float *x, int64_t ldx, int mr, int64_t K, const uint8_t *w, int64_t ld, int nr, float *y,
                     int64_t ldy, int alone);
static void f8_row_blocks(void *c, int64_t lo, int64_t hi);
static void f8_blocks(void *c, int64_t lo, int64_t hi);
static int64_t f8_panel_cap(int64_t M);
/* host_pairs.c: the bf16 head on bf16 activations (fmt 3; its tile sizes are there) */
static void p16_tile(const uint16_t *x, int64_t ldx, int mr, int64_t K, const uint8_t *w, int64_t ld, int nr,
                     float *y, int64_t ldy, int alone);
static void p16_round_rows(const float *x, int64_t ldx, int64_t M, int64_t K, uint16_t *xb);
/* host_f8pairs.c: FP8 [K, N] on bf16-rounded inputs (fmt 4) */
static void f8p_linear(const float *x, int64_t ldx, int64_t M, int64_t K, Weight w, int64_t N, float *y, int64_t ldy);
static int f8p_shape_ok(const Weight *w, int64_t K, int64_t N);
/* a bf16 [N, K] tile (b16_tile): rows x outputs, every head row decoded once per B16_MR rows: 8 x 3
   accumulators in AVX-512's 32 registers, 6 x 2 in AVX2's 16 (with the 2 weight vectors and the row's: 15);
   one row alone takes B16_NR1 outputs (more rows streaming at once: 3 were 0.90x the 4 before at one row;
   with the prefetches to L2, 8 ran 1.02x / 1.10x the 4 on 1 / 2 threads and 16 0.97-0.99x,
   scripts/bench_stored.py --head, Zen 5). AVX2's rows were 4 a tile: 6 reads the head once where 4 read it
   twice (5-6 rows) and 3 times where 4 read it 4 times (13-16), 1.26x / 1.23x / 1.07x at 5 / 6 / 16 rows,
   the same at 8 (two tiles of 4 either way: the rows are split as evenly as may be), -march=znver3 on a
   Zen 5 (8 x 2 spills: 0.87x) */
#ifndef B16_MR
#if VW == 16
#define B16_MR 8
#define B16_NR 3
#else
#define B16_MR 6
#define B16_NR 2
#endif
#endif
#ifndef B16_NR1
#if VW == 16
#define B16_NR1 8
#else
#define B16_NR1 4  /* 8 accumulators and 8 weight vectors would not fit AVX2's 16 registers */
#endif
#endif
/* outputs per column block of an [N, K] product of M rows, and rows a tile (host_pairs.c, after the last
   tile sizes) */
static inline int64_t nk_width(const Weight *w, int64_t M);
static inline int64_t nk_rows(const Weight *w);
/* up to this many rows stream the rows of an FP8 weight (each weight decoded once per 8 rows); more decode
   blocks under the register tiles, which reuse each decoded weight for every row */
#ifndef F8_ROWS_THRESHOLD
#define F8_ROWS_THRESHOLD 40
#endif

/* [N, K] weights: fp32 (nk_tile), bf16 (b16_tile, the same order) or bf16 on bf16 inputs (p16_tile: x
   holds bf16 rows, ldx in bf16 values) */
static void nk_blocks(void *c, int64_t lo, int64_t hi) {
    const LinearJob *j = (const LinearJob *)c;
    const int64_t width = nk_width(&j->w, j->M), rows = nk_rows(&j->w);
    for (int64_t b = lo; b < hi; b++) {
        int64_t n0 = b * width;
        int nr = (int)(j->N - n0 < width ? j->N - n0 : width);
        for (int64_t m0 = 0, mr; m0 < j->M; m0 += mr) {
            int64_t left = (j->M - m0 + rows - 1) / rows;  /* groups left: as even as may be */
            mr = (j->M - m0 + left - 1) / left;
            const float *x = j->x + m0 * j->ldx;
            float *y = j->y + m0 * j->ldy + n0;
            if (j->w.fmt == 3)
                p16_tile((const uint16_t *)j->x + m0 * j->ldx, j->ldx, (int)mr, j->K, j->w.q + n0 * j->w.ld * 2,
                         j->w.ld, nr, y, j->ldy, j->M == 1);
            else if (j->w.fmt == 2)
                b16_tile(x, j->ldx, (int)mr, j->K, j->w.q + n0 * j->w.ld * 2, j->w.ld, nr, y, j->ldy, j->M == 1);
            else
                nk_tile(x, j->ldx, (int)mr, j->K, j->w.p + n0 * j->w.ld, j->w.ld, nr, y, j->ldy);
        }
    }
}

static inline int64_t padded(int64_t n) { return (n + VW - 1) / VW * VW; }

/* how linear() runs one product: its job, the loop over its column blocks, how many, their work */
typedef struct {
    LinearJob job;
    range_fn fn;
    int64_t blocks, per_block;  /* per_block: multiply-adds in one block */
} LinearPlan;

/* a loop's items of `per_block` multiply-adds each, chunked so that a chunk holds ~32k of them */
static inline int64_t product_grain(int64_t per_block) {
    return per_block >= 32768 ? 1 : (32768 + per_block - 1) / per_block;
}

/* linear()'s plan for every format but FP8 pairs (fmt 4, f8p_linear has its own loops): 0 for those */
static int linear_plan(const float *x, int64_t ldx, int64_t M, int64_t K, Weight w, int64_t N, float *y, int64_t ldy,
                       LinearPlan *plan) {
    if (w.fmt == 4) return 0;
    int f8 = w.fmt == 1;
    int row = w.kn && M <= (f8 ? F8_ROWS_THRESHOLD : ROWS_MAX);
    int64_t per_thread = padded((padded(N) + g_threads - 1) / g_threads);  /* every thread gets a panel */
    int64_t cap = f8 ? f8_panel_cap(M) : ROW_PANEL;
    int64_t panel = per_thread < cap ? per_thread : cap;
    LinearJob job = {x, ldx, M, K, w, w.kn ? padded(N) : N, y, ldy, panel};
    int64_t width = row ? panel : w.kn ? KN_NV * VW : nk_width(&w, M);
    plan->job = job;
    plan->fn = row ? (f8 ? f8_row_blocks : kn_row_blocks) : w.kn ? (f8 ? f8_blocks : kn_blocks) : nk_blocks;
    plan->blocks = (N + width - 1) / width;
    plan->per_block = M * K * width;
    return 1;
}

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ W^T, W as stored (see Weight; FP8 is [K, N] and
   bf16 [N, K], host_stored.c); column blocks on the pool once there are ~32k multiply-adds per chunk. A
   [K, N] weight is stored padded to whole vectors (host_forward.py), and writes padded(N) columns: the
   caller's ldy makes room for them. */
static void linear(const float *x, int64_t ldx, int64_t M, int64_t K, Weight w, int64_t N, float *y, int64_t ldy) {
    LinearPlan plan;
    if (!linear_plan(x, ldx, M, K, w, N, y, ldy, &plan)) {
        f8p_linear(x, ldx, M, K, w, N, y, ldy);
        return;
    }
    pool_run(plan.blocks, product_grain(plan.per_block), plan.fn, &plan.job);
}

/* Independent products run as one loop over all their column blocks: a layer's products of a few rows
   each (an expert's gate and up of the 1-3 rows routed to it, the shared expert's, the compressor's kv
   and gate) are too small to split alone (under ~32k multiply-adds a chunk each ran on the calling thread
   while the others waited), and together they fill every thread in one wait. Each output is computed by
   the kernel linear() would pick, so its bits are linear()'s. */
#define LINEARS_MAX 24
typedef struct {
    LinearPlan plan[LINEARS_MAX];
    int64_t start[LINEARS_MAX + 1];  /* plan i's blocks are items [start[i], start[i + 1]) */
    int n;
} LinearSet;

static void linears_blocks(void *c, int64_t lo, int64_t hi) {
    const LinearSet *set = (const LinearSet *)c;
    for (int i = 0; i < set->n && lo < hi; i++) {
        int64_t a = set->start[i], b = set->start[i + 1], l = lo > a ? lo : a, h = hi < b ? hi : b;
        if (l < h) set->plan[i].fn((void *)&set->plan[i].job, l - a, h - a);
    }
}

/* run the set's products (one pool loop) and empty it */
static void linears_run(LinearSet *set) {
    if (set->n == 0) return;
    int64_t blocks = set->start[set->n], work = 0;
    for (int i = 0; i < set->n; i++) work += set->plan[i].blocks * set->plan[i].per_block;
    if (blocks > 0) pool_run(blocks, product_grain(work / blocks), linears_blocks, set);
    set->n = 0;
}

/* linear(), added to the set (run by linears_run): the products of a set read none of each other's
   outputs. An FP8-pairs product (it has its own loops) and one that writes padding columns run now; a
   full set is run first. */
static void linears_add(LinearSet *set, const float *x, int64_t ldx, int64_t M, int64_t K, Weight w, int64_t N,
                        float *y, int64_t ldy) {
    if (M <= 0) return;
    if (set->n == LINEARS_MAX) linears_run(set);
    if (w.kn && N % VW) {  /* it writes padded(N) columns: never beside a product whose columns follow */
        linear(x, ldx, M, K, w, N, y, ldy);
        return;
    }
    if (!linear_plan(x, ldx, M, K, w, N, y, ldy, &set->plan[set->n])) {
        f8p_linear(x, ldx, M, K, w, N, y, ldy);
        return;
    }
    if (set->n == 0) set->start[0] = 0;
    set->start[set->n + 1] = set->start[set->n] + set->plan[set->n].blocks;
    set->n++;
}

static inline float dot(const float *a, const float *b, int64_t n) {
    vf acc = {};
    int64_t k = 0, kv = n - n % VW;
    for (; k < kv; k += VW) acc = vfma(vload(a + k), vload(b + k), acc);
    float s = vsum(acc);
    for (; k < n; k++) s = sfma(a[k], b[k], s);
    return s;
}

static inline void axpy(float *y, float a, const float *x, int64_t n) {  /* y += a x */
    int64_t k = 0, kv = n - n % VW;
    vf va = vsplat(a);
    for (; k < kv; k += VW) vstore(y + k, vfma(va, vload(x + k), vload(y + k)));
    for (; k < n; k++) y[k] = sfma(a, x[k], y[k]);
}

/* ATT_KEYS dots of one vector with ATT_KEYS rows at once: each is dot()'s own chain (the same bits), but
   the chains are in flight together where one dot alone waits on its multiply-add latency (an
   attention logit over a 512-wide head was one chain of 64) */
#define ATT_KEYS 8
static inline void dots(const float *a, const float *const *b, int64_t n, float *out) {
    vf c[ATT_KEYS] = {};
    int64_t k = 0, kv = n - n % VW;
    for (; k < kv; k += VW) {
        vf x = vload(a + k);
        for (int j = 0; j < ATT_KEYS; j++) c[j] = vfma(x, vload(b[j] + k), c[j]);
    }
    for (int j = 0; j < ATT_KEYS; j++) {
        float s = vsum(c[j]);
        for (int64_t kk = k; kk < n; kk++) s = sfma(a[kk], b[j][kk], s);
        out[j] = s;
    }
}

/* axpy() of cnt <= ATT_KEYS rows in turn, y += a[0] x[0], then a[1] x[1], ...: every output takes the
   same multiply-adds in the same order, but each vector of y is loaded and stored once, not cnt times */
static inline void axpys(float *y, const float *a, const float *const *x, int cnt, int64_t n) {
    if (cnt < 4) {
        for (int j = 0; j < cnt; j++) axpy(y, a[j], x[j], n);
        return;
    }
    vf va[ATT_KEYS];
    for (int j = 0; j < cnt; j++) va[j] = vsplat(a[j]);
    int64_t k = 0, kv = n - n % VW;
    for (; k < kv; k += VW) {
        vf acc = vload(y + k);
        for (int j = 0; j < cnt; j++) acc = vfma(va[j], vload(x[j] + k), acc);
        vstore(y + k, acc);
    }
    for (; k < n; k++)
        for (int j = 0; j < cnt; j++) y[k] = sfma(a[j], x[j][k], y[k]);
}

/* ---- elementwise blocks (norms.py, rope.py, mhc.py) ------------------------------------------- */

/* F.rms_norm over rows of width n: x * rsqrt(mean(x^2) + eps) (* w); the squares summed as dot() sums
   (lanes of fused multiply-adds, then vsum: one value at a time was a chain of n dependent adds, ~6% of
   a verify forward of the bundled model in mHC's norm of its 256-wide streams alone) */
static void rms_norm(float *x, int64_t rows, int64_t n, const float *w, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        float *p = x + r * n;
        float ss = dot(p, p, n);
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

/* exp(x) lane by lane: Cephes' expf (2^n times a polynomial of the remainder, ~1 ulp), 0 below -87.3 and
   inf above 88 (expf: 88.72). glibc's expf, one float a call, was ~10% of a verify forward of the bundled
   model (the experts' SwiGLU, the attention's weights) on the thread the others wait for. A lane's
   result depends on its input alone and every path of the forward computes these through here, so rows
   promised equal stay equal. */
typedef int32_t vi __attribute__((vector_size(VW * 4)));
static inline vi vbits(vf x) { vi b; memcpy(&b, &x, sizeof b); return b; }
static inline vf vfloat(vi b) { vf x; memcpy(&x, &b, sizeof x); return x; }
static inline vf vsel(vi mask, vf a, vf b) { return vfloat((vbits(a) & mask) | (vbits(b) & ~mask)); }  /* m ? a : b */
static inline vf vexp(vf x) {
    vi lo = x < vsplat(-87.3f), hi = x > vsplat(88.0f), nan = x != x, out = lo | hi | nan;
    x = vfloat(vbits(x) & ~out);  /* 0 in those lanes, so that n below is a small whole number in every lane */
    vf n = (x * vsplat(1.44269504088896341f) + vsplat(12582912.0f)) - vsplat(12582912.0f);  /* round(x / ln 2) */
    vf r = vfma(n, vsplat(-0.693359375f), x);  /* x - n ln 2 in two parts (Cody-Waite) */
    r = vfma(n, vsplat(2.12194440e-4f), r);
    vf p = vfma(vsplat(1.9875691500e-4f), r, vsplat(1.3981999507e-3f));
    p = vfma(p, r, vsplat(8.3334519073e-3f));
    p = vfma(p, r, vsplat(4.1665795894e-2f));
    p = vfma(p, r, vsplat(1.6666665459e-1f));
    p = vfma(p, r, vsplat(5.0000001201e-1f));
    vf y = (vfma(p, r * r, r) + vsplat(1.0f)) * vfloat((__builtin_convertvector(n, vi) + 127) << 23);
    return vfloat((vbits(y) & ~out) | (hi & ((vi){} + 0x7f800000)) | (nan & vbits(vsplat(NAN))));
}

/* vexp over n floats in place (a last part vector through a padded copy: its lanes as any other's) */
void ds4_exp_rows(float *x, int64_t n) {
    int64_t k = 0;
    for (; k + VW <= n; k += VW) vstore(x + k, vexp(vload(x + k)));
    if (k < n) {
        float tail[VW] = {0};
        memcpy(tail, x + k, (size_t)(n - k) * 4);
        vstore(tail, vexp(vload(tail)));
        memcpy(x + k, tail, (size_t)(n - k) * 4);
    }
}

/* mhc.sinkhorn on up to VW hc x hc matrices at once, one a lane (m: hc * hc vectors, element e of matrix
   r in lane r of m[e]): each lane takes the operations of the one-matrix loop, in its order, so a
   matrix's bits do not depend on its neighbours. 20 iterations of dependent divisions took ~0.2 us a
   matrix; a 5-row verify step has 40 of them per forward, which now cost what 8 did. */
static void sinkhorn_lanes(vf *m, int64_t hc, int64_t iters, float eps) {
    vf e = vsplat(eps);
    for (int64_t it = 0; it < iters; it++) {
        if (it > 0)
            for (int64_t i = 0; i < hc; i++) {
                vf s = vsplat(0.0f);
                for (int64_t j = 0; j < hc; j++) s = s + m[i * hc + j];
                for (int64_t j = 0; j < hc; j++) m[i * hc + j] = m[i * hc + j] / (e + s);
            }
        for (int64_t j = 0; j < hc; j++) {
            vf s = vsplat(0.0f);
            for (int64_t i = 0; i < hc; i++) s = s + m[i * hc + j];
            for (int64_t i = 0; i < hc; i++) m[i * hc + j] = m[i * hc + j] / (e + s);
        }
    }
}

typedef struct {
    const Dims *d;
    const float *streams, *base, *scale;
    float *x, *post, *comb, *flat, *z;
    int64_t zs;  /* row stride of z: the mixes, padded when the weight is stored [K, N] */
} HcJob;

static void hc_norm_rows(void *c, int64_t lo, int64_t hi) {
    const HcJob *j = (const HcJob *)c;
    int64_t w = j->d->hc * j->d->hidden;
    for (int64_t t = lo; t < hi; t++) rms_norm(j->flat + t * w, 1, w, NULL, j->d->rms_eps);
}

/* one token: pre (its own array) / post / comb (before Sinkhorn) from the mixes */
static void hc_mix_one(const HcJob *j, int64_t t, float *pre) {
    const Dims *d = j->d;
    int64_t hc = d->hc, n_mix = (2 + hc) * hc;
    float *zt = j->z + t * j->zs;
    for (int64_t i = 0; i < n_mix; i++) zt[i] = j->base[i] + zt[i] * j->scale[i < hc ? 0 : (i < 2 * hc ? 1 : 2)];
    for (int64_t i = 0; i < hc; i++) {
        pre[i] = sigmoidf(zt[i]) + d->hc_eps;
        j->post[t * hc + i] = 2.0f * sigmoidf(zt[hc + i]);
    }
    float *c2 = j->comb + t * hc * hc;
    for (int64_t i = 0; i < hc; i++) {  /* softmax over the last axis, then + eps */
        const float *row = zt + 2 * hc + i * hc;
        float mx = row[0], s = 0.0f;
        for (int64_t k = 1; k < hc; k++) mx = row[k] > mx ? row[k] : mx;
        for (int64_t k = 0; k < hc; k++) s += (c2[i * hc + k] = expf(row[k] - mx));
        for (int64_t k = 0; k < hc; k++) c2[i * hc + k] = c2[i * hc + k] / s + d->hc_eps;
    }
}

/* per token: pre / post / comb from the mixes, Sinkhorn (VW tokens at a time, one a lane), and the
   collapse of the streams */
static void hc_mix_rows(void *c, int64_t lo, int64_t hi) {
    const HcJob *j = (const HcJob *)c;
    const Dims *d = j->d;
    int64_t hc = d->hc, D = d->hidden, hh = hc * hc;
    float pre[VW][DS4_MAX_HC];
    vf m[DS4_MAX_HC * DS4_MAX_HC];
    for (int64_t t0 = lo; t0 < hi; t0 += VW) {
        int64_t n = hi - t0 < VW ? hi - t0 : VW;
        for (int64_t r = 0; r < n; r++) hc_mix_one(j, t0 + r, pre[r]);
        for (int64_t e = 0; e < hh; e++) {  /* lanes past the last token hold 1 (never stored back) */
            m[e] = vsplat(1.0f);
            for (int64_t r = 0; r < n; r++) m[e][r] = j->comb[(t0 + r) * hh + e];
        }
        sinkhorn_lanes(m, hc, d->sinkhorn_iters, d->hc_eps);
        for (int64_t r = 0; r < n; r++) {
            for (int64_t e = 0; e < hh; e++) j->comb[(t0 + r) * hh + e] = m[e][r];
            float *xt = j->x + (t0 + r) * D;
            const float *st = j->streams + (t0 + r) * hc * D;
            for (int64_t k = 0; k < D; k++) xt[k] = 0.0f;
            for (int64_t i = 0; i < hc; i++) axpy(xt, pre[r][i], st + i * D, D);
        }
    }
}

/* mhc.hc_pre: x [T, D] collapsed, post [T, hc], comb [T, hc, hc]; flat / z are scratch */
static void hc_pre(const Dims *d, const float *streams, int64_t T, Weight fn, const float *base, const float *scale,
                   float *x, float *post, float *comb, float *flat, float *z) {
    int64_t hc = d->hc, D = d->hidden, n_mix = (2 + hc) * hc;
    HcJob job = {d, streams, base, scale, x, post, comb, flat, z, fn.kn ? padded(n_mix) : n_mix};
    memcpy(flat, streams, (size_t)(T * hc * D) * 4);
    pool_run(T, 8, hc_norm_rows, &job);
    linear(flat, hc * D, T, hc * D, fn, n_mix, z, job.zs);
    pool_run(T, 8, hc_mix_rows, &job);
}

typedef struct {
    const Dims *d;
    float *streams;
    const float *y, *post, *comb;
    float *tmp;
} PostJob;

static void hc_post_rows(void *c, int64_t lo, int64_t hi) {
    const PostJob *j = (const PostJob *)c;
    int64_t hc = j->d->hc, D = j->d->hidden;
    for (int64_t t = lo; t < hi; t++) {
        float *st = j->streams + t * hc * D, *tmp = j->tmp + t * hc * D;
        const float *cm = j->comb + t * hc * hc;
        for (int64_t k = 0; k < hc; k++) {
            float *o = tmp + k * D;
            for (int64_t e = 0; e < D; e++) o[e] = j->post[t * hc + k] * j->y[t * D + e];
            for (int64_t i = 0; i < hc; i++) axpy(o, cm[i * hc + k], st + i * D, D);
        }
        memcpy(st, tmp, (size_t)(hc * D) * 4);
    }
}

/* mhc.hc_post: X'[j] = post[j] y + sum_i comb[i, j] X[i], in place on streams (tmp: [T, hc, D]) */
static void hc_post(const Dims *d, float *streams, int64_t T, const float *y, const float *post, const float *comb,
                    float *tmp) {
    PostJob job = {d, streams, y, post, comb, tmp};
    pool_run(T, 8, hc_post_rows, &job);
}
