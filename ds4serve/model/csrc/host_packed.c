/* Products over routed experts kept packed in MXFP4 (part of host.c; see host.h).

   Why: a DS4-Flash checkpoint's routed experts are 277B of its 284B parameters. Dequantised to fp32
   they need 7.5x the bytes of their MXFP4 form (4 bits a value + one exponent byte per 32), so a step
   that reads experts as fp32 streams 7.5x the memory and a real checkpoint does not fit a host at all.
   Here the experts stay as the checkpoint has them (packed.py: codes [E, rows, K / 2], two E2M1 values
   a byte, the even input in the low nibble; scales [E, rows, K / 32], UE8M0 exponent bytes) and each
   block of 32 weights is decoded in registers right before its multiply-adds: one table lookup and one
   fp32 product per value, the same product quant.dequant_mxfp4 makes, so the weights are exactly the
   dequantise-at-load values.

   The products run along K ([N, K] dot products): one block's 16 bytes become the 16 even and the 16
   odd inputs' weights (low and high nibbles), so the input rows are first reordered the same way within
   each block (qperm_rows): even inputs of the block, then odd, in runs of VW. Each row's sums run in a
   fixed order whatever else is in the batch. */
#include "host.h"


typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef uint8_t vb __attribute__((vector_size(VW)));

typedef struct {  /* one expert stack packed: up to two parts along the output rows (gate, up) */
    const uint8_t *codes[2], *scales[2];
    int64_t rows[2];  /* output rows of each part (the stack's rows are part 0's, then part 1's) */
    int64_t nparts, K;
} QStack;

static float e8m0[256];
static const float fp4[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                              -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

__attribute__((constructor)) static void e8m0_init(void) {  /* 2 ** (byte - 127), as exp2 gives it (255: inf) */
    for (int e = 0; e < 256; e++) e8m0[e] = ldexpf(1.0f, e - 127);
}

/* one output row's packed codes and scales in expert e */
static inline void qrow(const QStack *q, int64_t e, int64_t n, const uint8_t **c, const uint8_t **s) {
    int p = n >= q->rows[0];
    int64_t r = n - (p ? q->rows[0] : 0), rows = q->rows[p];
    *c = q->codes[p] + (e * rows + r) * (q->K / 2);
    *s = q->scales[p] + (e * rows + r) * (q->K / 32);
}

/* the block's 32 weights in input order (even/odd runs of VW), scaled: w[0 .. 32 / VW) */
static inline void qdecode(const uint8_t *codes, float scale, vf *w) {
    vf lut_lo, lut_hi;
    memcpy(&lut_lo, fp4, sizeof lut_lo);
    for (int h = 0; h < 16 / VW; h++) {
        vb bytes;
        memcpy(&bytes, codes + h * VW, sizeof bytes);
        vi b = __builtin_convertvector(bytes, vi);
        vi lo = b & 15, hi = b >> 4;
#if VW == 16
        (void)lut_hi;
        w[2 * h] = __builtin_shuffle(lut_lo, lo) * scale;
        w[2 * h + 1] = __builtin_shuffle(lut_lo, hi) * scale;
#else
        memcpy(&lut_hi, fp4 + VW, sizeof lut_hi);
        w[2 * h] = __builtin_shuffle(lut_lo, lut_hi, lo) * scale;
        w[2 * h + 1] = __builtin_shuffle(lut_lo, lut_hi, hi) * scale;
#endif
    }
}

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

/* y[m, n] = sum_k xq[m, k] w[n, k] for up to 4 rows x 4 outputs of expert e */
static void q_tile(const float *x, int64_t ldx, int mr, const QStack *q, int64_t e, int64_t n0, int nr, float *y,
                   int64_t ldy) {
    const uint8_t *c[4], *s[4];
    for (int j = 0; j < nr; j++) qrow(q, e, n0 + j, &c[j], &s[j]);
    vf acc[4][4];
    memset(acc, 0, sizeof acc);
    for (int64_t b = 0; b < q->K / 32; b++) {
        vf w[4][32 / VW];
        for (int j = 0; j < nr; j++) qdecode(c[j] + b * 16, e8m0[s[j][b]], w[j]);
        for (int i = 0; i < mr; i++) {
            const float *xb = x + i * ldx + b * 32;
            for (int v = 0; v < 32 / VW; v++) {
                vf a = vload(xb + v * VW);
                for (int j = 0; j < nr; j++) acc[i][j] = vfma(a, w[j][v], acc[i][j]);
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) y[i * ldy + j] = vsum(acc[i][j]);
}

typedef struct {
    const float *x;
    int64_t ldx, M;
    const QStack *q;
    int64_t e, N;
    float *y;
    int64_t ldy;
} QJob;

/* the nr output rows n0.. of expert e decoded whole into w [nr, K] (in the decode's input order) */
static void q_decode_rows(const QStack *q, int64_t e, int64_t n0, int nr, float *w) {
    for (int j = 0; j < nr; j++) {
        const uint8_t *c, *s;
        qrow(q, e, n0 + j, &c, &s);
        for (int64_t b = 0; b < q->K / 32; b++) {
            vf v[32 / VW];
            qdecode(c + b * 16, e8m0[s[b]], v);
            memcpy(w + j * q->K + b * 32, v, sizeof v);
        }
    }
}

static __thread float *q_panel;  /* a pool thread's decoded rows (grown as needed, kept for the next step) */
static __thread int64_t q_panel_floats;

/* Few rows decode each block in registers as they go; more rows (prefill) decode the four output rows
   once into a panel and run the dense [N, K] tiles over it, which add in the same order (k vectors in
   sequence per lane, then the lane sum), so a row's result is the same bits either way. */
static void q_blocks(void *c, int64_t lo, int64_t hi) {
    const QJob *j = (const QJob *)c;
    int64_t K = j->q->K;
    float *panel = NULL;
    if (j->M > 4) {
        if (q_panel_floats < 4 * K) {
            float *grown = realloc(q_panel, (size_t)(4 * K) * 4);
            if (grown) q_panel = grown, q_panel_floats = 4 * K;
        }
        panel = q_panel_floats >= 4 * K ? q_panel : NULL;  /* out of memory: decode as we go */
    }
    for (int64_t b = lo; b < hi; b++) {
        int64_t n0 = b * 4;
        int nr = (int)(j->N - n0 < 4 ? j->N - n0 : 4);
        if (panel) q_decode_rows(j->q, j->e, n0, nr, panel);
        for (int64_t m0 = 0; m0 < j->M; m0 += 4) {
            int mr = (int)(j->M - m0 < 4 ? j->M - m0 : 4);
            if (panel)
                nk_tile(j->x + m0 * j->ldx, j->ldx, mr, K, panel, K, nr, j->y + m0 * j->ldy + n0, j->ldy);
            else
                q_tile(j->x + m0 * j->ldx, j->ldx, mr, j->q, j->e, n0, nr, j->y + m0 * j->ldy + n0, j->ldy);
        }
    }
}

/* y [M, N] = xq [M, K] @ W_e^T for expert e of a packed stack (xq reordered by qperm_rows) */
static void q_linear(const float *xq, int64_t ldx, int64_t M, const QStack *q, int64_t e, int64_t N, float *y,
                     int64_t ldy) {
    QJob job = {xq, ldx, M, q, e, N, y, ldy};
    int64_t blocks = (N + 3) / 4, per_block = M * q->K * 4;
    int64_t grain = per_block >= 32768 ? 1 : (32768 + per_block - 1) / per_block;
    parallel(blocks, grain, q_blocks, &job);
}
