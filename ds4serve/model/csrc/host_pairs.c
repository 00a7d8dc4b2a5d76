/* The bf16 LM head on bf16 activations: pairs of bf16 products added into fp32 (part of host.c; see
   host.h). Weight fmt 3: the head as loaded, bf16 [N, K], with its input rows rounded to bf16.

   Why: at DS4-Flash's widths the head is 129,280 x 4096 bf16 (1 GB) and the largest product of a decode
   step: 36% of an 8-row step and half of a one-row step on fp32 activations (host_stored.c's b16_tile,
   which widens every weight to fp32 and is bound by fp32 multiply-adds at 8 rows). llama.cpp rounds the
   head's inputs to bf16 and multiplies bf16 pairs (vdpbf16ps: 32 products an instruction, twice the
   fp32 FMA's 16), and so can we: `--head-activations bf16` (model/host_pairs.py chooses).

   The result is defined here, not by the instruction set, so that every build computes the same bits:
   - each input row is rounded to bf16 (nearest, ties to even; subnormals to a signed zero; NaN quiet;
     p16_round), once, in plain C;
   - output n of row m has 16 lanes; lane j takes the inputs k = 32 t + 2 j (even) and 32 t + 2 j + 1
     (odd), t = 0, 1, ..., in order, and for each t adds the odd product, then the even one, into its
     fp32 sum: acc = flush(fma(x_odd, w_odd, acc)), then the same with the even pair, where flush sends a
     subnormal to a zero of its sign, and a subnormal weight counts as zero (both sums start at +0).
     The product of two bf16 values is exact in fp32, so each step is the exact sum rounded once;
   - then the lanes are added as a tree (lane i += lane i + h for h = 8, 4, 2, 1; plain fp32 adds);
   - then the inputs past the last whole 32, one at a time in k order, by the same flushed fma.
   That is exactly what AVX-512 BF16's vdpbf16ps computes (Intel's definition: the odd pair first, DAZ,
   FTZ, round to nearest even; measured bit-equal on 31.6 M random lane operations, random bit patterns
   included, on a Zen 5), so with __AVX512BF16__ the loop is one instruction a pair vector; every other
   build emulates it with two fused multiply-adds and the flushes (fma16: libm's fmaf where the target has
   no FMA, so still fused). The emulation exists for the same bits everywhere, not for speed: on the
   129,280 x 4096 head it takes 42 / 177 ms for 1 / 8 rows on AVX-512F and 83-92 / 429 ms on AVX2, against
   ~30 / 54 ms for the fp32 rows (b16_tile), so `auto` picks it only where the instruction is.
   ds4_p16_reference computes the definition in scalar C: the start-up probe (host_pairs.py) holds the
   kernel bit-equal to it on the machine that serves, and the tests hold both to an independent oracle on
   every build target CI tests. */

#if defined(__AVX512BF16__) && VW == 16
#define P16_NATIVE 1
#define P16_KERNEL "AVX-512 BF16 (vdpbf16ps)"
#elif VW == 16
#define P16_NATIVE 0
#define P16_KERNEL "AVX-512F emulation of vdpbf16ps"
#elif defined(__FMA__)
#define P16_NATIVE 0
#define P16_KERNEL "AVX2 emulation of vdpbf16ps"
#else
#define P16_NATIVE 0
#define P16_KERNEL "plain C emulation of vdpbf16ps"
#endif

/* The 16-lane types below are wider than an AVX2 register: GCC warns that passing them by value changes
   the ABI (-Wpsabi). Every function here is static and inlined in this one library, so no ABI is
   crossed; the warning is off for the rest of the file (it failed -Werror builds on AVX2 machines). */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
typedef float f16x __attribute__((vector_size(64)));     /* sixteen fp32 lanes, whatever the build's width */
typedef uint32_t u16x __attribute__((vector_size(64)));  /* ... or 32 bf16 values, as 16 pairs */
typedef int32_t i16x __attribute__((vector_size(64)));

/* fp32 -> bf16: nearest, ties to even; zero and subnormals to a zero of their sign; NaN stays NaN */
static inline uint16_t p16_round(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    if ((b & 0x7F800000u) == 0) return (uint16_t)((b >> 16) & 0x8000u);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((b >> 16) | 0x0040u);
    b += 0x7FFFu + ((b >> 16) & 1u);  /* carries into the exponent (to inf past the largest finite) */
    return (uint16_t)(b >> 16);
}

/* rows x [M, K] (row stride ldx) rounded into xb [M, K] (row stride K) */
static void p16_round_rows(const float *x, int64_t ldx, int64_t M, int64_t K, uint16_t *xb) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++) xb[m * K + k] = p16_round(x[m * ldx + k]);
}

static inline float p16_flush1(float v) {
    uint32_t b;
    memcpy(&b, &v, sizeof b);
    if ((b & 0x7F800000u) == 0) b &= 0x80000000u;
    memcpy(&v, &b, sizeof v);
    return v;
}

static inline float p16_value(uint16_t h) {  /* bf16 widened, a subnormal counted as zero */
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, sizeof f);
    return p16_flush1(f);
}

typedef float f8x __attribute__((vector_size(32)));
typedef float f4x __attribute__((vector_size(16)));

/* the lane tree (as vector halves: lanes i and i + h are the two halves' lane i), then the inputs
   [k, K) one at a time */
static inline float p16_finish(f16x acc, const uint16_t *x, const uint16_t *w, int64_t k, int64_t K) {
    f8x h8[2];
    f4x h4[2];
    memcpy(h8, &acc, sizeof h8);
    h8[0] += h8[1];
    memcpy(h4, &h8[0], sizeof h4);
    h4[0] += h4[1];
    float s = (h4[0][0] + h4[0][2]) + (h4[0][1] + h4[0][3]);
    for (; k < K; k++) s = p16_flush1(fmaf(p16_value(x[k]), p16_value(w[k]), s));
    return s;
}

#if P16_NATIVE
static inline f16x p16_step(f16x acc, u16x x, u16x w) {
    return (f16x)_mm512_dpbf16_ps((__m512)acc, (__m512bh)x, (__m512bh)w);
}
#else
static inline f16x fma16(f16x a, f16x b, f16x c) {
#if VW == 16
    return (f16x)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__) && (defined(__x86_64__) || defined(__i386__))
    /* the halves as register values (shuffles, not a round trip through memory) */
    __m256 lo = _mm256_fmadd_ps((__m256)__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7),
                                (__m256)__builtin_shufflevector(b, b, 0, 1, 2, 3, 4, 5, 6, 7),
                                (__m256)__builtin_shufflevector(c, c, 0, 1, 2, 3, 4, 5, 6, 7));
    __m256 hi = _mm256_fmadd_ps((__m256)__builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15),
                                (__m256)__builtin_shufflevector(b, b, 8, 9, 10, 11, 12, 13, 14, 15),
                                (__m256)__builtin_shufflevector(c, c, 8, 9, 10, 11, 12, 13, 14, 15));
    return __builtin_shufflevector((f8x)lo, (f8x)hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    for (int i = 0; i < 16; i++) c[i] = fmaf(a[i], b[i], c[i]);  /* fused even without the instruction */
    return c;
#endif
}

static inline f16x p16_flush(f16x v) {  /* subnormal lanes to a zero of their sign */
    u16x b;
    memcpy(&b, &v, sizeof b);
    /* all ones where the exponent is zero: (exponent - 1) goes negative only there (a compare of these
       16-lane vectors was scalarised by GCC 12 on AVX2, 22x slower) */
    u16x tiny = (u16x)((i16x)((b & 0x7F800000u) - 1u) >> 31);
    b &= ~(tiny & 0x7FFFFFFFu);
    memcpy(&v, &b, sizeof v);
    return v;
}

static inline f16x p16_as_f(u16x b) {
    f16x f;
    memcpy(&f, &b, sizeof f);
    return f;
}

static inline f16x p16_step(f16x acc, u16x x, u16x w) {  /* the inputs are flushed already (p16_round) */
    acc = p16_flush(fma16(p16_as_f(x & 0xFFFF0000u), p16_flush(p16_as_f(w & 0xFFFF0000u)), acc));
    return p16_flush(fma16(p16_as_f(x << 16), p16_flush(p16_as_f(w << 16)), acc));
}
#endif

/* tiles: MR rows x NR outputs of accumulators (AVX-512 BF16: 8 x 3 and one row alone x 8, as b16_tile;
   the emulations take 4 x 2 and 1 x 4; on AVX2 a 16-lane sum is two vectors and 4 x 2 of them spill, but
   2 x 2 read the head twice as often and ran 8 rows 1.13x slower) */
#if P16_NATIVE
#define P16_MR 8
#define P16_NR 3
#define P16_NR1 8
#else
#define P16_MR 4
#define P16_NR 2
#define P16_NR1 4
#endif

/* 64 bytes from anywhere, as a vector load. Why not memcpy into the vector: GCC 12 then copied each
   weight vector through the stack in two 32-byte halves that the 64-byte load could not forward from
   (a store-forwarding stall a weight vector) and kept the 24 accumulators' copies in memory, stored every
   pass (objdump): the 8-row tile ran at ~12% of the instruction's peak on an Intel Xeon, 1.55x slower than
   now. Fully unrolled loops keep every vector in a register. The prefetch is b16_tile's (B16_AHEAD, one
   tile ahead): here 1.19x at 8 rows, 1.08x at one, over 2 KB ahead in each row. */
typedef uint32_t u16x_any __attribute__((vector_size(64), aligned(1), may_alias));
static inline u16x p16_load(const void *p) { return *(const u16x_any *)p; }
#define P16_UNROLL _Pragma("GCC unroll 16")

#define P16_TILE(MR, NR)                                                                                        \
    static void p16_tile_##MR##_##NR(const uint16_t *x, int64_t ldx, int64_t K, const uint8_t *w, int64_t ld,   \
                                     int nr, float *y, int64_t ldy) {                                          \
        f16x acc[MR][NR];                                                                                       \
        const uint8_t *row[NR];                                                                                 \
        const int64_t next_tile = (int64_t)NR * ld * 2; /* bytes from a row to the next tile's */              \
        for (int j = 0; j < NR; j++) row[j] = w + (j < nr ? j : nr - 1) * ld * 2;                              \
        for (int i = 0; i < MR; i++)                                                                            \
            for (int j = 0; j < NR; j++) acc[i][j] = (f16x){};                                                  \
        int64_t kv = K - K % 32;                                                                                \
        for (int64_t k = 0; k < kv; k += 32) {                                                                  \
            u16x b[NR];                                                                                         \
            P16_UNROLL for (int j = 0; j < NR; j++) {                                                           \
                if (B16_PF) __builtin_prefetch(row[j] + 2 * k + B16_AHEAD, 0, B16_PF_LOC);                      \
                b[j] = p16_load(row[j] + 2 * k);                                                                \
            }                                                                                                   \
            P16_UNROLL for (int i = 0; i < MR; i++) {                                                           \
                u16x a = p16_load(x + i * ldx + k);                                                             \
                P16_UNROLL for (int j = 0; j < NR; j++) acc[i][j] = p16_step(acc[i][j], a, b[j]);               \
            }                                                                                                   \
        }                                                                                                       \
        for (int i = 0; i < MR; i++)                                                                            \
            for (int j = 0; j < nr; j++)                                                                        \
                y[i * ldy + j] = p16_finish(acc[i][j], x + i * ldx, (const uint16_t *)row[j], kv, K);           \
    }
P16_TILE(1, P16_NR1)
P16_TILE(1, P16_NR)
P16_TILE(2, P16_NR)
P16_TILE(3, P16_NR)
P16_TILE(4, P16_NR)
#if P16_MR > 4
P16_TILE(5, P16_NR)
P16_TILE(6, P16_NR)
P16_TILE(7, P16_NR)
P16_TILE(8, P16_NR)
#endif

static inline int64_t nk_width(const Weight *w, int64_t M) {
    return w->fmt == 3 ? (M == 1 ? P16_NR1 : P16_NR) : w->fmt == 2 ? (M == 1 ? B16_NR1 : B16_NR) : 4;
}
static inline int64_t nk_rows(const Weight *w) { return w->fmt == 3 ? P16_MR : w->fmt == 2 ? B16_MR : 4; }

/* up to P16_MR rows of bf16 inputs (row stride ldx) x P16_NR outputs, or one row alone x P16_NR1 */
static void p16_tile(const uint16_t *x, int64_t ldx, int mr, int64_t K, const uint8_t *w, int64_t ld, int nr,
                     float *y, int64_t ldy, int alone) {
    if (alone) {
        p16_tile_1_P16_NR1(x, ldx, K, w, ld, nr, y, ldy);
        return;
    }
    switch (mr) {
        case 1: p16_tile_1_P16_NR(x, ldx, K, w, ld, nr, y, ldy); break;
        case 2: p16_tile_2_P16_NR(x, ldx, K, w, ld, nr, y, ldy); break;
        case 3: p16_tile_3_P16_NR(x, ldx, K, w, ld, nr, y, ldy); break;
#if P16_MR > 4
        case 4: p16_tile_4_P16_NR(x, ldx, K, w, ld, nr, y, ldy); break;
        case 5: p16_tile_5_P16_NR(x, ldx, K, w, ld, nr, y, ldy); break;
        case 6: p16_tile_6_P16_NR(x, ldx, K, w, ld, nr, y, ldy); break;
        case 7: p16_tile_7_P16_NR(x, ldx, K, w, ld, nr, y, ldy); break;
        default: p16_tile_8_P16_NR(x, ldx, K, w, ld, nr, y, ldy); break;
#else
        default: p16_tile_4_P16_NR(x, ldx, K, w, ld, nr, y, ldy); break;
#endif
    }
}

/* which kernel this build runs (the start-up log names it), and whether it is the instruction itself */
const char *ds4_p16_kernel(void) { return P16_KERNEL; }
int ds4_p16_native(void) { return P16_NATIVE; }

/* y [M, N] = the definition above in scalar C, one output at a time (x fp32 [M, K], w bf16 [N, K]): what
   the start-up probe and the tests hold the kernel to. -1: no memory. */
int ds4_p16_reference(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, float *y) {
    uint16_t *xb = malloc((size_t)(M * K + 1) * 2);
    if (!xb) return -1;
    p16_round_rows(x, K, M, K, xb);
    int64_t kv = K - K % 32;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            const uint16_t *xr = xb + m * K, *wr = w + n * K;
            f16x acc = {};
            for (int64_t t = 0; t < kv; t += 32)
                for (int j = 0; j < 16; j++)
                    for (int odd = 1; odd >= 0; odd--) {
                        int64_t k = t + 2 * j + odd;
                        acc[j] = p16_flush1(fmaf(p16_value(xr[k]), p16_value(wr[k]), acc[j]));
                    }
            y[m * N + n] = p16_finish(acc, xr, wr, kv, K);
        }
    free(xb);
    return 0;
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
