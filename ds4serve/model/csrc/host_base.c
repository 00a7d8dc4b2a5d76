/* Ring writes, snapshot captures and the scratch arena of the host forward (part of host.c; see host.h). */
#include "host.h"

int ds4_vector_width(void) { return VW; }

/* what this build computes with, for the start-up log and the tests */
const char *ds4_build_info(void) {
    return "vector width " DS4_STR(VW) ", " DS4_FMA_NAME ", contraction off" DS4_CHECK_NAME;
}

/* ring[dst[i]] = fresh[src[i]] for n rows of width w */
static void write_ring(Rows ring, const float *fresh, int64_t fresh_rows, const int64_t *dst, const int64_t *src,
                       int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        BOUND("ring row written", dst[i], ring.rows);
        BOUND("row copied into a ring", src[i], fresh_rows);
        memcpy(ring.p + dst[i] * ring.w, fresh + src[i] * ring.w, (size_t)ring.w * 4);
    }
    (void)fresh_rows;
}

/* capture_ring: copy the ring as it stood at each capture point into the snapshot rows */
static void capture(const StepView *v, int64_t ring_len, Rows snap, Rows ring, const float *fresh) {
    if (!snap.p) return;
    for (int64_t c = 0; c < v->n_cap; c++) {
        const Capture *cp = &v->cap[c];
        if (cp->ring_len != ring_len) continue;
        write_ring(snap, ring.p, ring.rows, cp->old_dst, cp->old_src, cp->n_old);
        write_ring(snap, fresh, v->T, cp->new_dst, cp->new_src, cp->n_new);
    }
}

void ds4_arena_free(Arena *a) {
    free(a->buf);
    a->buf = NULL;
    a->cap = a->used = 0;
}

static int arena_reserve(Arena *a, int64_t bytes) {
    a->used = 0;
    if (bytes <= a->cap) return 0;
    free(a->buf);
    a->buf = NULL;
    a->cap = 0;
    if (posix_memalign((void **)&a->buf, 64, (size_t)bytes) != 0) return -1;
    a->cap = bytes;
    return 0;
}

static float *take(Arena *a, int64_t n) {  /* n floats, 64-byte aligned, from a reserved arena */
    float *p = (float *)(a->buf + a->used);
    a->used += ((n * 4 + 63) / 64) * 64;
    return p;
}

