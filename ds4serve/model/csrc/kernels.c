/* Small kernels the torch forward calls on the host (model/native.py builds and binds them): mHC's
   Sinkhorn and MXFP4 dequantisation (bit-equal to their torch forms) and RoPE (within fp32 rounding).

   Why built apart from the host forward (host.c), with other flags: these must equal their torch forms
   on every CPU, and they are not where the time goes, so they are built -O2 without -march
   (no target-dependent vector width or FMA) and with contraction off; the host forward is built for the
   CPU (-O3 -march=native) because its products are the time, and it promises equality only between its
   own paths (see host.h). */
#include <math.h>

/* Sinkhorn on n row-major hc x hc fp32 matrices, in place: one column pass, then iters - 1
   (row, column) pairs. Each normaliser is eps + the in-order sum of hc entries. */
void ds4_sinkhorn_f32(float *m, long n, long hc, long iters, float eps) {
    for (long b = 0; b < n; b++) {
        float *x = m + b * hc * hc;
        for (long it = 0; it < iters; it++) {
            if (it > 0) {
                for (long i = 0; i < hc; i++) {
                    float s = 0.0f;
                    for (long j = 0; j < hc; j++) s += x[i * hc + j];
                    float d = eps + s;
                    for (long j = 0; j < hc; j++) x[i * hc + j] = x[i * hc + j] / d;
                }
            }
            for (long j = 0; j < hc; j++) {
                float s = 0.0f;
                for (long i = 0; i < hc; i++) s += x[i * hc + j];
                float d = eps + s;
                for (long i = 0; i < hc; i++) x[i * hc + j] = x[i * hc + j] / d;
            }
        }
    }
}

/* Rotary embedding in place on the last 2 * half channels of x [n, h, dim] (contiguous), with
   rot [n, half, 2] = (cos, sin): the pair (a, b) becomes (a c - b s, a s + b c), which is the
   arithmetic of torch's complex multiply (s negated for the inverse rotation). */
void ds4_rope_f32(float *x, const float *rot, long n, long h, long dim, long half, int inverse) {
    for (long i = 0; i < n; i++) {
        const float *r = rot + i * half * 2;
        for (long k = 0; k < h; k++) {
            float *p = x + (i * h + k) * dim + (dim - 2 * half);
            for (long j = 0; j < half; j++) {
                float a = p[2 * j], b = p[2 * j + 1], c = r[2 * j], d = inverse ? -r[2 * j + 1] : r[2 * j + 1];
                p[2 * j] = a * c - b * d;
                p[2 * j + 1] = a * d + b * c;
            }
        }
    }
}

/* E2M1 values by code (bit 3 the sign), for both MXFP4 dequantisers below */
static const float mxfp4_lut[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* MXFP4 dequantisation: codes [rows, half] (two E2M1 codes per byte, the low nibble first) times
   2^(scale byte - 127) per block of inputs, into out [rows, 2 * half]; each output is one table value
   times its block's power of two (one fp32 product, as the torch form computes it). */
void ds4_mxfp4_f32(const unsigned char *codes, const unsigned char *scales, float *out, long rows, long half,
                   long block) {
    float pairs[512]; /* byte -> (low nibble's value, high nibble's value) */
    for (int b = 0; b < 256; b++) { pairs[2 * b] = mxfp4_lut[b & 15]; pairs[2 * b + 1] = mxfp4_lut[b >> 4]; }
    long n_blocks = 2 * half / block, per = block / 2;
    for (long r = 0; r < rows; r++) {
        const unsigned char *c = codes + r * half;
        float *o = out + r * 2 * half;
        for (long b = 0; b < n_blocks; b++) {
            float s = ldexpf(1.0f, (int)scales[r * n_blocks + b] - 127);
            for (long j = b * per; j < (b + 1) * per; j++) {
                const float *p = pairs + 2 * c[j];
                o[2 * j] = p[0] * s;
                o[2 * j + 1] = p[1] * s;
            }
        }
    }
}

/* ds4_mxfp4_f32 for codes and scales in the int8 product's interleaved layout (host_q8.c, packed.py
   interleave_q8: per group of 16 rows and block of 32 inputs, byte 64t + 4j + r holds row j's inputs
   8t + r (low nibble) and 8t + 4 + r (high); scales [group][block][16]): the same values, the same
   product per value, so the torch path reads interleaved experts exactly as plain ones. rows % 16 == 0. */
void ds4_mxfp4_q8_f32(const unsigned char *codes, const unsigned char *scales, float *out, long rows, long cols) {
    long nb = cols / 32;
    for (long g = 0; g < rows / 16; g++)
        for (long b = 0; b < nb; b++) {
            const unsigned char *c = codes + (g * nb + b) * 256, *sc = scales + (g * nb + b) * 16;
            for (int j = 0; j < 16; j++) {
                float s = ldexpf(1.0f, (int)sc[j] - 127), *o = out + (g * 16 + j) * cols + 32 * b;
                for (int t = 0; t < 4; t++)
                    for (int r = 0; r < 4; r++) {
                        unsigned char byte = c[64 * t + 4 * j + r];
                        o[8 * t + r] = mxfp4_lut[byte & 15] * s;
                        o[8 * t + 4 + r] = mxfp4_lut[byte >> 4] * s;
                    }
            }
        }
}

/* FP8 e4m3 dequantisation: codes [rows, cols] (physical layout, contiguous) times their block's fp32
   scale, into out [rows, cols]. Blocks are br physical rows x bc columns; scales [ceil(rows / br),
   ceil(cols / bc)] contiguous, or, with transposed, [ceil(cols / bc), ceil(rows / br)] (codes stored
   [in, out] for a weight whose scales are [out, in] blocks). Each output is the code's exact value
   times the scale, one fp32 product, as ``code.float() * scale`` rounds it. NaN codes are refused at load. */
void ds4_fp8_f32(const unsigned char *codes, long rows, long cols, long ld, const float *scales, long br, long bc,
                 int transposed, float *out) {  /* ld: the codes' row stride (>= cols); out is dense */
    float lut[256];
    for (int b = 0; b < 256; b++) {  /* sign, 4 exponent bits biased by 7, 3 mantissa bits */
        int e = (b >> 3) & 15, m = b & 7;
        float v = e ? ldexpf(1.0f + (float)m / 8.0f, e - 7) : ldexpf((float)m / 8.0f, -6);
        lut[b] = (b & 0x80) ? -v : v;
    }
    long srows = (rows + br - 1) / br, scols = (cols + bc - 1) / bc;
    for (long r = 0; r < rows; r++) {
        const unsigned char *c = codes + r * ld;
        float *o = out + r * cols;
        for (long b = 0; b < scols; b++) {
            float s = transposed ? scales[b * srows + r / br] : scales[(r / br) * scols + b];
            long end = (b + 1) * bc < cols ? (b + 1) * bc : cols;
            for (long j = b * bc; j < end; j++) o[j] = lut[c[j]] * s;
        }
    }
}
