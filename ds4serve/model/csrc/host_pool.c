/* A work-claiming thread pool for the host forward (see host.h).

   Why not OpenMP: an OpenMP parallel region ends in a barrier every thread must reach. In a server the
   other core is shared with the HTTP thread and the clients, so a worker is often descheduled for a
   moment; with ~100 regions a step, each waiting for the slowest thread, a 4.6 ms decode forward took
   7.8 ms in the server (and 12 ms beside a busy thread: worse than one thread alone, 8 ms). Here the
   caller splits a loop into chunks that any thread claims with one atomic compare-and-swap; the caller
   works too and waits only for chunks that were claimed, never for a worker to show up. A worker that
   wakes late finds nothing left and goes back to waiting.

   Workers spin briefly for the next loop (a forward issues them microseconds apart), then sleep on a
   condition variable (between steps). One caller at a time: a second thread calling in while the
   pool is busy runs its loop alone. */
#include "host.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>

typedef void (*range_fn)(void *ctx, int64_t lo, int64_t hi);

#define POOL_MAX 64
#define SPIN_ROUNDS 4000    /* ~0.1 ms of polling before a worker sleeps */
#define WAIT_SPINS 256      /* the caller's polling for a claimed chunk before it yields its core */

/* the claim word: generation, the loop's chunk count and its next unclaimed chunk, so that a thread
   decides whether there is work from this one atomic alone (chunks <= 8 x POOL_MAX < 2^16) */
#define CLAIM(g, n, i) (((uint64_t)(g) << 32) | ((uint64_t)(n) << 16) | (uint64_t)(i))

typedef struct {
    _Atomic uint64_t claim;   /* CLAIM(generation, chunks, next unclaimed chunk) */
    _Atomic int64_t done;     /* chunks finished in the current generation */
    _Atomic uint32_t gen;     /* the published generation */
    _Atomic int sleepers, quit;
    range_fn fn;              /* the loop of the current generation (written before its claim word) */
    void *ctx;
    int64_t n_items;
    int n_workers;
    pthread_t threads[POOL_MAX];
    pthread_mutex_t mu, busy;
    pthread_cond_t cv;
} Pool;

static Pool g_pool = {.mu = PTHREAD_MUTEX_INITIALIZER, .busy = PTHREAD_MUTEX_INITIALIZER,
                      .cv = PTHREAD_COND_INITIALIZER};
static int g_threads = 1;  /* threads a loop may use in this call (set per entry point) */

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#else
    sched_yield();
#endif
}

/* run chunks of generation g until none is left; returns when this thread found nothing to claim.
   The loop's fields are read only after a claim succeeded: the caller wrote them before it published
   g's claim word (which the successful compare-and-swap read), and cannot write the next loop's before
   this chunk is counted done, so a late worker never reads fields while they are being written. */
static void pool_claim(Pool *p, uint32_t g) {
    for (;;) {
        uint64_t s = atomic_load(&p->claim);
        int64_t i = (int64_t)(s & 0xffff), n = (int64_t)((s >> 16) & 0xffff);
        if ((uint32_t)(s >> 32) != g || i >= n) return;
        if (!atomic_compare_exchange_weak(&p->claim, &s, s + 1)) continue;
        int64_t items = p->n_items;
        p->fn(p->ctx, i * items / n, (i + 1) * items / n);
        atomic_fetch_add(&p->done, 1);
    }
}

static void *pool_worker(void *arg) {
    Pool *p = (Pool *)arg;
    uint32_t seen = atomic_load(&p->gen);
    for (;;) {
        uint32_t g;
        int spins = 0;
        while ((g = atomic_load(&p->gen)) == seen && !atomic_load(&p->quit)) {
            if (++spins < SPIN_ROUNDS) { cpu_relax(); continue; }
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->sleepers, 1);
            while (atomic_load(&p->gen) == seen && !atomic_load(&p->quit)) pthread_cond_wait(&p->cv, &p->mu);
            atomic_fetch_sub(&p->sleepers, 1);
            pthread_mutex_unlock(&p->mu);
            spins = 0;
        }
        if (atomic_load(&p->quit)) return NULL;
        seen = g;
        pool_claim(p, g);
    }
}

static void pool_stop(Pool *p) {
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->quit, 1);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_workers; i++) pthread_join(p->threads[i], NULL);
    p->n_workers = 0;
    atomic_store(&p->quit, 0);
}

/* (re)start the pool with `workers` threads besides the caller; returns the workers running */
static int pool_resize(Pool *p, int workers) {
    if (workers > POOL_MAX) workers = POOL_MAX;
    if (workers == p->n_workers) return workers;
    pool_stop(p);
    for (int i = 0; i < workers; i++) {
        if (pthread_create(&p->threads[i], NULL, pool_worker, p) != 0) break;
        p->n_workers = i + 1;
    }
    return p->n_workers;
}

/* fn(ctx, lo, hi) over [0, n_items), split into chunks of at least `grain` items; on the pool when
   there is enough work and the pool is free, else on the calling thread alone */
static void pool_run(int64_t n_items, int64_t grain, range_fn fn, void *ctx) {
    int64_t chunks = grain > 0 ? n_items / grain : n_items;
    if (chunks > 8 * (int64_t)g_threads) chunks = 8 * (int64_t)g_threads;
    if (chunks > 0xffff) chunks = 0xffff;  /* what the claim word holds */
    if (g_threads <= 1 || chunks < 2 || pthread_mutex_trylock(&g_pool.busy) != 0) {
        if (n_items > 0) fn(ctx, 0, n_items);
        return;
    }
    Pool *p = &g_pool;
    if (pool_resize(p, g_threads - 1) == 0) {
        pthread_mutex_unlock(&p->busy);
        fn(ctx, 0, n_items);
        return;
    }
    uint32_t g = atomic_load(&p->gen) + 1;
    /* every chunk of the last loop was claimed and done, so no thread reads these fields now */
    p->fn = fn;
    p->ctx = ctx;
    p->n_items = n_items;
    atomic_store(&p->done, 0);
    atomic_store(&p->claim, CLAIM(g, chunks, 0));
    atomic_store(&p->gen, g);
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    pool_claim(p, g);
    /* a chunk is still running on a worker: poll, then yield this core (the worker may be waiting for
       a core itself, e.g. behind the HTTP thread) */
    for (int spins = 0; atomic_load(&p->done) < chunks; spins++) {
        if (spins < WAIT_SPINS) cpu_relax(); else sched_yield();
    }
    pthread_mutex_unlock(&p->busy);
}

/* ---- one job beside the caller ------------------------------------------------------------------
   ds4_pool_submit hands one function to the pool's worker and returns at once; ds4_pool_join waits for
   it (running it on the calling thread if no worker has taken it yet). Why: a checkpoint drafter's block
   (host_dspark.c) is single-threaded native work the engine's Python bookkeeping does not depend on; on
   the worker, which spins right after the step's forward, it runs while the caller applies the step.
   The pool stays claimed (busy) until the join, so a loop started in between runs on its caller alone. */

typedef void (*job_fn)(void *arg);

static struct {
    job_fn fn;
    void *arg;
    uint32_t gen;
    int live;
    _Atomic int on_worker;  /* the worker ran it (not the joining caller) */
    pthread_t caller;
} g_job;

static void job_chunk(void *ctx, int64_t lo, int64_t hi) {
    (void)ctx, (void)lo, (void)hi;
    atomic_store(&g_job.on_worker, !pthread_equal(pthread_self(), g_job.caller));
    g_job.fn(g_job.arg);
}

/* returns 1 when the job went to the pool (join before the next submit), 0 when it ran here already
   (one thread, the pool busy, or no worker could start) */
int ds4_pool_submit(job_fn fn, void *arg, int threads) {
    Pool *p = &g_pool;
    if (g_job.live) return -1;  /* one job at a time: the caller joins first */
    g_threads = threads > 0 ? threads : 1;
    if (g_threads <= 1 || pthread_mutex_trylock(&p->busy) != 0) {
        fn(arg);
        return 0;
    }
    if (pool_resize(p, g_threads - 1) == 0) {
        pthread_mutex_unlock(&p->busy);
        fn(arg);
        return 0;
    }
    uint32_t g = atomic_load(&p->gen) + 1;
    g_job.fn = fn, g_job.arg = arg, g_job.gen = g, g_job.live = 1, g_job.caller = pthread_self();
    atomic_store(&g_job.on_worker, 0);
    p->fn = job_chunk;
    p->ctx = NULL;
    p->n_items = 1;
    atomic_store(&p->done, 0);
    atomic_store(&p->claim, CLAIM(g, 1, 0));
    atomic_store(&p->gen, g);
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    return 1;
}

/* waits for the submitted job; returns 0 without one, 1 when the worker ran it, 2 when this thread did */
int ds4_pool_join(void) {
    Pool *p = &g_pool;
    if (!g_job.live) return 0;
    pool_claim(p, g_job.gen);  /* not taken yet: it runs here */
    for (int spins = 0; atomic_load(&p->done) < 1; spins++) {
        if (spins < WAIT_SPINS) cpu_relax(); else sched_yield();
    }
    g_job.live = 0;
    pthread_mutex_unlock(&p->busy);
    return atomic_load(&g_job.on_worker) ? 1 : 2;
}

/* ---- self-check (tests): every item of every loop runs exactly once ---------------------------- */

typedef struct {
    _Atomic int32_t *counts;
} CountJob;

static void count_items(void *c, int64_t lo, int64_t hi) {
    CountJob *j = (CountJob *)c;
    for (int64_t i = lo; i < hi; i++) {
        for (volatile int spin = 0; spin < 200; spin++) {}  /* long enough for loops to overlap */
        atomic_fetch_add(&j->counts[i], 1);
    }
}

/* run `loops` loops of `items` items on `threads` threads; returns how many items did not run once per loop */
int64_t ds4_pool_check(int64_t loops, int64_t items, int threads) {
    _Atomic int32_t *counts = calloc((size_t)items, sizeof *counts);
    if (!counts) return -1;
    g_threads = threads > 0 ? threads : 1;
    CountJob job = {counts};
    for (int64_t l = 0; l < loops; l++) pool_run(items, 1 + (l % 3), count_items, &job);
    int64_t wrong = 0;
    for (int64_t i = 0; i < items; i++) wrong += atomic_load(&counts[i]) != loops;
    free(counts);
    return wrong;
}

static void count_job(void *c) {
    CountJob *j = (CountJob *)c;
    for (volatile int spin = 0; spin < 20000; spin++) {}  /* long enough for the caller to reach its join */
    atomic_fetch_add(&j->counts[0], 1);
}

/* `jobs` submitted jobs, each joined after a loop of `items` items run meanwhile (alone: the pool is the
   job's); returns -1 on a job that did not run exactly once, else how many jobs the worker ran */
int64_t ds4_pool_job_check(int64_t jobs, int64_t items, int threads) {
    _Atomic int32_t *counts = calloc((size_t)(items + 1), sizeof *counts);
    if (!counts) return -1;
    CountJob job = {counts}, loop = {counts + 1};
    int64_t on_worker = 0;
    for (int64_t l = 0; l < jobs; l++) {
        atomic_store(&counts[0], 0);
        ds4_pool_submit(count_job, &job, threads);
        pool_run(items, 1, count_items, &loop);
        on_worker += ds4_pool_join() == 1;
        if (atomic_load(&counts[0]) != 1) return free(counts), -1;
    }
    int64_t wrong = 0;
    for (int64_t i = 0; i < items; i++) wrong += atomic_load(&counts[i + 1]) != jobs;
    free(counts);
    return wrong ? -1 : on_worker;
}
