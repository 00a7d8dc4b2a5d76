/* The ring rows a verify pass overwrites, saved and put back in one call (cache/draft_rows.py). The
   torch form was two small ops per ring of every layer per drafting step (~0.1 ms of a ~1.3 ms step
   of the bundled model); this copies the same bytes. Only copies: no arithmetic, no rounding. */
#include <stdint.h>
#include <string.h>

typedef struct {
    char *ring;         /* the ring tensor's first byte (contiguous rows) */
    int64_t row_bytes;  /* bytes of one ring row */
    int64_t list;       /* which of the row lists below addresses this ring (rings of one length share one) */
} RingRef;

/* rows[list * n_rows + j]: the ring row of draft position j. buf holds every ring's n_rows rows, ring after
   ring. restore == 0: buf <- rings (every row); else rings <- buf for the positions in picks only. */
int ds4_ring_rows(int64_t n_rings, const RingRef *rings, const int64_t *rows, int64_t n_rows, char *buf,
                  const int64_t *picks, int64_t n_picks, int64_t restore) {
    char *at = buf;
    for (int64_t k = 0; k < n_rings; k++) {
        const RingRef *r = rings + k;
        const int64_t *idx = rows + r->list * n_rows;
        int64_t rb = r->row_bytes;
        if (!restore) {
            for (int64_t j = 0; j < n_rows; j++) memcpy(at + j * rb, r->ring + idx[j] * rb, (size_t)rb);
        } else {
            for (int64_t p = 0; p < n_picks; p++) {
                int64_t j = picks[p];
                memcpy(r->ring + idx[j] * rb, at + j * rb, (size_t)rb);
            }
        }
        at += n_rows * rb;
    }
    return 0;
}
