// test_dist.c - tsys_dist.h's process groups and collectives. Run as many ranks as you like:
//   build/test_dist                                   a group of one (engine self)
//   mpirun -np 4 build/test_dist                      MPI ranks (one host: shared memory, and MPI itself)
//   build/test_dist --nproc 3                         the built-in launcher (engine tcp: shared memory, and TCP)
//   build/test_dist [--nproc N] [filter]              only the tests whose name contains filter
//   build/test_dist --die R | --stall R               rank R exits early / stalls before a collective: the
//                                                     others must fail within TSYS_DIST_TIMEOUT, naming it
//                                                     (tests/test_dist_fail.sh runs these)
//   build/test_dist_cuda --die R --nccl               the same through NCCL with CUDA tensors (one GPU a rank):
//                                                     the others' tsys_dist_barrier must fail within the timeout
// Every rank fills its tensors with a known function of (rank, index); results are checked against
// values computed on one rank. Each collective runs on every path the group has: with shared memory
// and without (MPI or TCP), on CPU tensors, and on CUDA tensors when built with CUDA (NCCL in a
// group of one, host staging with several ranks on one GPU).
#define TSYS_PRELUDE_DIST
#include "../drivers/prelude.h"
#include "harness.h"
#include "harness_dist.h"

static tsys_ctx *g_ctx;
static int g_rank, g_size;
// (group, device) pairs every collective test runs on
#define MAXPATHS 5   // the standing paths, and one slot for a group a test makes (check_group)
static tsys_dist *g_group[MAXPATHS];
static tsys_device g_dev[MAXPATHS];
static const char *g_name[MAXPATHS];
static int g_npaths;
static tsys_dist *g_main;
static char g_threads_given[32];   // OMP_NUM_THREADS as the rank was started with ("": unset)

static const int g_types[] = { TSYS_F32, TSYS_BF16, TSYS_F16, TSYS_I32, TSYS_I64 };

// ---- values --------------------------------------------------------------------------------------

static double val(int type, int r, int64_t i) {
    if (type == TSYS_I64) return (double)(r + 1) * 1099511627776.0 + (double)(i % 100003);   // 2^40 scale: more than int32, exact in a double
    if (type == TSYS_I32) return (double)((r + 1) * 100000 - (int)(i % 1000));
    return (double)((r + 1) * 3 - (int)(i % 11));   // small integers: exact sums in every float dtype
}
static double round_to(int type, double x) {
    switch (type) {
    case TSYS_F32: return (double)(float)x;
    case TSYS_BF16: return tsys_bf16_to_f32(tsys_f32_to_bf16((float)x));
    case TSYS_F16: return tsys_f16_to_f32(tsys_f32_to_f16((float)x));
    default: return x;
    }
}
static void put(int type, void *buf, int64_t i, double v) {
    switch (type) {
    case TSYS_F32: ((float *)buf)[i] = (float)v; break;
    case TSYS_BF16: ((uint16_t *)buf)[i] = tsys_f32_to_bf16((float)v); break;
    case TSYS_F16: ((uint16_t *)buf)[i] = tsys_f32_to_f16((float)v); break;
    case TSYS_I32: ((int32_t *)buf)[i] = (int32_t)v; break;
    default: ((int64_t *)buf)[i] = (int64_t)v; break;
    }
}
static double get(int type, const void *buf, int64_t i) {
    switch (type) {
    case TSYS_F32: return ((const float *)buf)[i];
    case TSYS_BF16: return tsys_bf16_to_f32(((const uint16_t *)buf)[i]);
    case TSYS_F16: return tsys_f16_to_f32(((const uint16_t *)buf)[i]);
    case TSYS_I32: return ((const int32_t *)buf)[i];
    default: return (double)((const int64_t *)buf)[i];
    }
}
// op over ranks of val(type, r, i), rounded the way the library rounds: fp32 sum, one division, one rounding
static double expect(int type, int op, int64_t i) {
    double acc = val(type, 0, i);
    for (int r = 1; r < g_size; r++) acc = op == TSYS_DIST_MAX ? (val(type, r, i) > acc ? val(type, r, i) : acc) : acc + val(type, r, i);
    if (op == TSYS_DIST_AVG) return round_to(type, (double)((float)acc / (float)g_size));
    return round_to(type, acc);
}

static const char *op_name(int op) { return op == TSYS_DIST_SUM ? "sum" : op == TSYS_DIST_AVG ? "avg" : "max"; }
static int64_t big_count(int type) { return ((int64_t)3 << 20) / (int64_t)tsys_dtype_size((tsys_dtype)type) + 1; }   // 3 MB and one more element

static tsys_dist *g_mk_group;   // set: mk makes its tensors with this group's tsys_dist_tensor_new
static tsys_tensor *mk(tsys_device dev, int type, int64_t n, const void *host) {
    int64_t shape[1] = { n };
    tsys_tensor *t;
    if (g_mk_group) {
        t = tsys_dist_tensor_new(g_mk_group, (tsys_dtype)type, dev, 1, shape);
        tsys_tensor *src = t && host ? tsys_tensor_from_data(g_ctx, (tsys_dtype)type, dev, 1, shape, host) : NULL;
        if (t && host && (!src || tsys_tensor_copy_from(g_ctx, t, src) != TSYS_OK)) { tsys_tensor_release(t); t = NULL; }
        tsys_tensor_release(src);
    } else t = host ? tsys_tensor_from_data(g_ctx, (tsys_dtype)type, dev, 1, shape, host) : tsys_tensor_new(g_ctx, (tsys_dtype)type, dev, 1, shape);
    if (!t) { printf("    cannot make a tensor: %s\n", tsys_ctx_last_error(g_ctx)); tsys_ctx_clear_error(g_ctx); }
    return t;
}
static void *hbuf(int type, int64_t n) { return calloc((size_t)(n > 0 ? n : 1), tsys_dtype_size((tsys_dtype)type)); }

// Counts elements of got that differ from want(i); reports the first.
#define CHECK_VALUES(n, got_expr, want_expr, ...) do { \
    int64_t bad_ = 0, first_ = -1; double g1_ = 0, w1_ = 0; \
    for (int64_t i = 0; i < (n); i++) { double g_ = (got_expr), w_ = (want_expr); if (g_ != w_) { if (!bad_) { first_ = i; g1_ = g_; w1_ = w_; } bad_++; } } \
    TEST_CHECK(bad_ == 0, __VA_ARGS__); \
    if (bad_) printf("      rank %d: %lld of %lld wrong, first at %lld: got %.17g, want %.17g\n", g_rank, (long long)bad_, (long long)(n), (long long)first_, g1_, w1_); \
} while (0)

#define STATUS_OK(st, ...) do { tsys_status s_ = (st); TEST_CHECK(s_ == TSYS_OK, __VA_ARGS__); \
    if (s_ != TSYS_OK) { printf("      rank %d: %s\n", g_rank, tsys_ctx_last_error(g_ctx)); tsys_ctx_clear_error(g_ctx); } } while (0)

// ---- one collective, checked -----------------------------------------------------------------------

static void check_all_reduce(int p, int type, int op, int64_t n, bool async) {
    void *h = hbuf(type, n);
    for (int64_t i = 0; i < n; i++) put(type, h, i, val(type, g_rank, i));
    tsys_tensor *t = mk(g_dev[p], type, n, h);
    if (!t) { free(h); TEST_CHECK(0, "tensor"); return; }
    tsys_status st = async ? tsys_dist_wait(tsys_dist_all_reduce_async(g_group[p], t, (tsys_dist_op)op)) : tsys_dist_all_reduce(g_group[p], t, (tsys_dist_op)op);
    STATUS_OK(st, "%s: all_reduce%s %s %s n=%lld", g_name[p], async ? "_async" : "", tsys_dtype_name((tsys_dtype)type), op_name(op), (long long)n);
    memset(h, 0xff, (size_t)(n > 0 ? n : 1) * tsys_dtype_size((tsys_dtype)type));
    STATUS_OK(tsys_tensor_to_host(g_ctx, t, h), "to host");
    CHECK_VALUES(n, get(type, h, i), expect(type, op, i), "%s: all_reduce%s %s %s n=%lld values", g_name[p], async ? "_async" : "", tsys_dtype_name((tsys_dtype)type), op_name(op), (long long)n);
    tsys_tensor_release(t);
    free(h);
}

static void check_broadcast(int p, int type, int root, int64_t n, bool async_unused) {
    (void)async_unused;
    void *h = hbuf(type, n);
    for (int64_t i = 0; i < n; i++) put(type, h, i, val(type, g_rank, i));
    tsys_tensor *t = mk(g_dev[p], type, n, h);
    if (!t) { free(h); TEST_CHECK(0, "tensor"); return; }
    STATUS_OK(tsys_dist_broadcast(g_group[p], t, root), "%s: broadcast %s root %d n=%lld", g_name[p], tsys_dtype_name((tsys_dtype)type), root, (long long)n);
    STATUS_OK(tsys_tensor_to_host(g_ctx, t, h), "to host");
    CHECK_VALUES(n, get(type, h, i), round_to(type, val(type, root, i)), "%s: broadcast %s root %d n=%lld values", g_name[p], tsys_dtype_name((tsys_dtype)type), root, (long long)n);
    tsys_tensor_release(t);
    free(h);
}

// in = size x m elements per rank; out = m: out[i] = op over ranks of in_r[rank * m + i]
static void check_reduce_scatter(int p, int type, int op, int64_t m, bool async) {
    int64_t nin = m * g_size;
    void *h = hbuf(type, nin);
    for (int64_t i = 0; i < nin; i++) put(type, h, i, val(type, g_rank, i));
    tsys_tensor *in = mk(g_dev[p], type, nin, h), *out = mk(g_dev[p], type, m, NULL);
    if (!in || !out) { free(h); tsys_tensor_release(in); tsys_tensor_release(out); TEST_CHECK(0, "tensor"); return; }
    tsys_status st = async ? tsys_dist_wait(tsys_dist_reduce_scatter_async(g_group[p], out, in, (tsys_dist_op)op)) : tsys_dist_reduce_scatter(g_group[p], out, in, (tsys_dist_op)op);
    STATUS_OK(st, "%s: reduce_scatter%s %s %s m=%lld", g_name[p], async ? "_async" : "", tsys_dtype_name((tsys_dtype)type), op_name(op), (long long)m);
    STATUS_OK(tsys_tensor_to_host(g_ctx, out, h), "to host");
    CHECK_VALUES(m, get(type, h, i), expect(type, op, (int64_t)g_rank * m + i), "%s: reduce_scatter%s %s %s m=%lld values", g_name[p], async ? "_async" : "", tsys_dtype_name((tsys_dtype)type), op_name(op), (long long)m);
    tsys_tensor_release(in); tsys_tensor_release(out);
    free(h);
}

// in = m elements per rank; out = size x m: out[q * m + i] = in_q[i]
static void check_all_gather(int p, int type, int64_t m, bool async) {
    int64_t nout = m * g_size;
    void *h = hbuf(type, nout);
    for (int64_t i = 0; i < m; i++) put(type, h, i, val(type, g_rank, i));
    tsys_tensor *in = mk(g_dev[p], type, m, h), *out = mk(g_dev[p], type, nout, NULL);
    if (!in || !out) { free(h); tsys_tensor_release(in); tsys_tensor_release(out); TEST_CHECK(0, "tensor"); return; }
    tsys_status st = async ? tsys_dist_wait(tsys_dist_all_gather_async(g_group[p], out, in)) : tsys_dist_all_gather(g_group[p], out, in);
    STATUS_OK(st, "%s: all_gather%s %s m=%lld", g_name[p], async ? "_async" : "", tsys_dtype_name((tsys_dtype)type), (long long)m);
    STATUS_OK(tsys_tensor_to_host(g_ctx, out, h), "to host");
    CHECK_VALUES(nout, get(type, h, i), round_to(type, val(type, (int)(i / (m ? m : 1)), i % (m ? m : 1))), "%s: all_gather%s %s m=%lld values", g_name[p], async ? "_async" : "", tsys_dtype_name((tsys_dtype)type), (long long)m);
    tsys_tensor_release(in); tsys_tensor_release(out);
    free(h);
}

static int64_t small_sizes[] = { 0, 1, 1001 };

// ---- tests -------------------------------------------------------------------------------------------

TSYS_TEST(group_info) {
    for (int p = 0; p < g_npaths; p++) {
        tsys_dist *d = g_group[p];
        TEST_CHECK(tsys_dist_rank(d) == g_rank && tsys_dist_size(d) == g_size, "%s: rank %d size %d", g_name[p], tsys_dist_rank(d), tsys_dist_size(d));
        TEST_CHECK(tsys_dist_local_rank(d) >= 0 && tsys_dist_local_rank(d) < g_size, "%s: local rank %d", g_name[p], tsys_dist_local_rank(d));
        TEST_CHECK(tsys_dist_ctx(d) == g_ctx, "ctx");
        tsys_dist_engine e = tsys_dist_engine_of(d);
        TEST_CHECK(g_size > 1 ? e != TSYS_DIST_ENGINE_SELF : (e == TSYS_DIST_ENGINE_SELF || e == TSYS_DIST_ENGINE_NCCL), "%s: engine %s with %d ranks", g_name[p], tsys_dist_engine_name(e), g_size);
    }
    TEST_CHECK(!strcmp(tsys_dist_engine_name(TSYS_DIST_ENGINE_MPI), "mpi") && !strcmp(tsys_dist_engine_name(TSYS_DIST_ENGINE_NCCL), "nccl") &&
               !strcmp(tsys_dist_engine_name(TSYS_DIST_ENGINE_SELF), "self") && !strcmp(tsys_dist_engine_name(TSYS_DIST_ENGINE_TCP), "tcp"), "engine names");
    // the launcher's ranks carry a run id and a secret it made for them (the rendezvous admits only those)
    if (getenv("TSYS_DIST_LAUNCHER") && !getenv("TORCHELASTIC_RUN_ID"))
        TEST_CHECK(getenv("TSYS_DIST_RUN_ID") && strlen(getenv("TSYS_DIST_RUN_ID")) > 8 && getenv("TSYS_DIST_SECRET") && strlen(getenv("TSYS_DIST_SECRET")) >= 32,
                   "a rank of tsys_dist_spawn has run id '%s' and a secret of %zu characters", getenv("TSYS_DIST_RUN_ID") ? getenv("TSYS_DIST_RUN_ID") : "",
                   getenv("TSYS_DIST_SECRET") ? strlen(getenv("TSYS_DIST_SECRET")) : (size_t)0);
    // the launcher does nothing inside a rank
    int code = 7;
    char *argv[] = { (char *)"x", NULL };
    TEST_CHECK(g_size == 1 || !tsys_dist_spawn(4, 1, argv, &code), "spawn inside a rank");
    TEST_CHECK(!tsys_dist_spawn(1, 1, argv, &code) && code == 0, "spawn of one");
}

// tsys_dist_init shares the host's cores among its ranks (cores / ranks threads each, at least one), unless the
// launcher set OMP_NUM_THREADS; a group of one keeps the host whole.
TSYS_TEST(init_shares_the_hosts_cores) {
    const char *now = getenv("OMP_NUM_THREADS");
    const int local = tsys_dist_local_size(g_main);
    const long cores = sysconf(_SC_NPROCESSORS_ONLN);
    char want[32] = "";
    if (g_threads_given[0]) snprintf(want, sizeof want, "%s", g_threads_given);
    else if (local > 1) snprintf(want, sizeof want, "%ld", cores / local > 1 ? cores / local : 1);
    TEST_CHECK(!strcmp(now ? now : "", want), "OMP_NUM_THREADS '%s' with %d ranks on %ld cores (started with '%s'), want '%s'",
               now ? now : "", local, cores, g_threads_given, want);
#if defined(_OPENMP) && !defined(TSYS_NO_OPENMP)
    if (want[0]) TEST_CHECK(omp_get_max_threads() == atoi(want), "OpenMP runs %d threads, want %s", omp_get_max_threads(), want);
#endif
}

static void all_reduce_dtype(int type) {
    for (int p = 0; p < g_npaths; p++)
        for (int op = TSYS_DIST_SUM; op <= TSYS_DIST_MAX; op++) {
            if (op == TSYS_DIST_AVG && !tsys_dtype_is_float((tsys_dtype)type)) continue;
            for (int s = 0; s < 3; s++) check_all_reduce(p, type, op, small_sizes[s], false);
            check_all_reduce(p, type, op, 1001, true);
            check_all_reduce(p, type, op, big_count(type), false);
        }
}
TSYS_TEST(all_reduce_f32) { all_reduce_dtype(TSYS_F32); }
TSYS_TEST(all_reduce_bf16) { all_reduce_dtype(TSYS_BF16); }
TSYS_TEST(all_reduce_f16) { all_reduce_dtype(TSYS_F16); }
TSYS_TEST(all_reduce_i32) { all_reduce_dtype(TSYS_I32); }
TSYS_TEST(all_reduce_i64) { all_reduce_dtype(TSYS_I64); }

TSYS_TEST(all_reduce_i64_full_range) {   // values a double cannot hold: the integers are summed as integers
    for (int p = 0; p < g_npaths; p++) {
        int64_t h[3] = { ((int64_t)1 << 60) + g_rank, -((int64_t)1 << 58) * (g_rank + 1) + 1, (int64_t)g_rank * 3 };
        tsys_tensor *t = mk(g_dev[p], TSYS_I64, 3, h);
        STATUS_OK(tsys_dist_all_reduce(g_group[p], t, TSYS_DIST_SUM), "%s", g_name[p]);
        tsys_tensor_to_host(g_ctx, t, h);
        int64_t w0 = 0, w1 = 0, w2 = 0;
        for (int r = 0; r < g_size; r++) { w0 += ((int64_t)1 << 60) + r; w1 += -((int64_t)1 << 58) * (r + 1) + 1; w2 += (int64_t)r * 3; }
        TEST_CHECK(h[0] == w0 && h[1] == w1 && h[2] == w2, "%s: %lld %lld %lld", g_name[p], (long long)h[0], (long long)h[1], (long long)h[2]);
        tsys_tensor_release(t);
    }
}

TSYS_TEST(broadcast_every_dtype) {
    for (int p = 0; p < g_npaths; p++)
        for (int k = 0; k < 5; k++) {
            int roots[2] = { 0, g_size - 1 };
            for (int ri = 0; ri < 2; ri++) {
                for (int s = 0; s < 3; s++) check_broadcast(p, g_types[k], roots[ri], small_sizes[s], false);
                check_broadcast(p, g_types[k], roots[ri], big_count(g_types[k]), false);
            }
        }
}

TSYS_TEST(reduce_scatter_every_dtype) {
    for (int p = 0; p < g_npaths; p++)
        for (int k = 0; k < 5; k++)
            for (int op = TSYS_DIST_SUM; op <= TSYS_DIST_MAX; op++) {
                int type = g_types[k];
                if (op == TSYS_DIST_AVG && !tsys_dtype_is_float((tsys_dtype)type)) continue;
                for (int s = 0; s < 3; s++) check_reduce_scatter(p, type, op, small_sizes[s], false);
                check_reduce_scatter(p, type, op, 1001, true);
                check_reduce_scatter(p, type, op, big_count(type) / g_size, false);
            }
}

TSYS_TEST(all_gather_every_dtype) {
    for (int p = 0; p < g_npaths; p++)
        for (int k = 0; k < 5; k++) {
            for (int s = 0; s < 3; s++) check_all_gather(p, g_types[k], small_sizes[s], false);
            check_all_gather(p, g_types[k], 1001, true);
            check_all_gather(p, g_types[k], big_count(g_types[k]) / g_size, false);
        }
}

TSYS_TEST(all_gather_in_place) {   // in is this rank's block of out (a view), as ZeRO-1 does it
    for (int p = 0; p < g_npaths; p++) {
        int64_t m = 777;
        tsys_tensor *out = mk(g_dev[p], TSYS_F32, m * g_size, NULL);
        int64_t shape[1] = { m };
        tsys_tensor *in = tsys_tensor_view_raw(g_ctx, out, (size_t)(g_rank * m) * 4, TSYS_F32, 1, shape);
        float *h = (float *)hbuf(TSYS_F32, m * g_size);
        for (int64_t i = 0; i < m; i++) h[g_rank * m + i] = (float)val(TSYS_F32, g_rank, i);
        tsys_tensor *src = mk(g_dev[p], TSYS_F32, m, h + g_rank * m);
        tsys_tensor_copy_from(g_ctx, in, src);
        STATUS_OK(tsys_dist_all_gather(g_group[p], out, in), "%s", g_name[p]);
        tsys_tensor_to_host(g_ctx, out, h);
        CHECK_VALUES(m * g_size, (double)h[i], val(TSYS_F32, (int)(i / m), i % m), "%s: in-place all_gather", g_name[p]);
        tsys_tensor_release(in); tsys_tensor_release(out); tsys_tensor_release(src);
        free(h);
    }
}

TSYS_TEST(reduce_scatter_in_place) {   // out is this rank's block of in (a view)
    for (int p = 0; p < g_npaths; p++) {
        int64_t m = 999, nin = m * g_size;
        float *h = (float *)hbuf(TSYS_F32, nin);
        for (int64_t i = 0; i < nin; i++) h[i] = (float)val(TSYS_F32, g_rank, i);
        tsys_tensor *in = mk(g_dev[p], TSYS_F32, nin, h);
        int64_t shape[1] = { m };
        tsys_tensor *out = tsys_tensor_view_raw(g_ctx, in, (size_t)(g_rank * m) * 4, TSYS_F32, 1, shape);
        STATUS_OK(tsys_dist_reduce_scatter(g_group[p], out, in, TSYS_DIST_SUM), "%s", g_name[p]);
        tsys_tensor_to_host(g_ctx, out, h);
        CHECK_VALUES(m, (double)h[i], expect(TSYS_F32, TSYS_DIST_SUM, (int64_t)g_rank * m + i), "%s: in-place reduce_scatter", g_name[p]);
        tsys_tensor_release(out); tsys_tensor_release(in);
        free(h);
    }
}

TSYS_TEST(async_several_in_flight) {   // launched together, a blocking collective in between, waited out of order
    for (int p = 0; p < g_npaths; p++) {
        enum { K = 6 };
        int64_t n = 5000;
        tsys_tensor *t[K];
        tsys_dist_work *w[K];
        float *h = (float *)hbuf(TSYS_F32, n);
        for (int k = 0; k < K; k++) {
            for (int64_t i = 0; i < n; i++) h[i] = (float)(val(TSYS_F32, g_rank, i) + k);
            t[k] = mk(g_dev[p], TSYS_F32, n, h);
            w[k] = tsys_dist_all_reduce_async(g_group[p], t[k], k % 2 ? TSYS_DIST_MAX : TSYS_DIST_SUM);
            TEST_CHECK(w[k] != NULL, "%s: launch %d: %s", g_name[p], k, tsys_ctx_last_error(g_ctx));
            if (k == 2) STATUS_OK(tsys_dist_barrier(g_group[p]), "%s: barrier between", g_name[p]);
        }
        for (int k = K - 1; k >= 0; k--) {
            if (!w[k]) continue;
            STATUS_OK(tsys_dist_wait(w[k]), "%s: wait %d", g_name[p], k);
            tsys_tensor_to_host(g_ctx, t[k], h);
            int op = k % 2 ? TSYS_DIST_MAX : TSYS_DIST_SUM;
            CHECK_VALUES(n, (double)h[i], expect(TSYS_F32, op, i) + (op == TSYS_DIST_SUM ? (double)k * g_size : (double)k), "%s: async %d values", g_name[p], k);
            tsys_tensor_release(t[k]);
        }
        free(h);
    }
}

// An agreed layout's collectives skip the descriptor check (tsys_dist__trust, as DDP, ZeRO-1 and FSDP
// issue them); the decision travels with each queued collective. Were it read from the group when the
// worker thread runs the collective, the ranks would post different MPI calls (check or not) as the
// trust is released around them: wrong sums, MPI_ERR_TRUNCATE or a corrupt heap.
TSYS_TEST(async_trusted_collectives_keep_their_check) {
    for (int p = 0; p < g_npaths; p++) {
        enum { K = 4, ROUNDS = 60 };
        const int64_t n = (TSYS_DIST__CHECK_BYTES / 4) * 2;   // large enough to be checked when not trusted
        float *h = (float *)hbuf(TSYS_F32, n);
        for (int round = 0; round < ROUNDS; round++) {
            tsys_tensor *t[K];
            tsys_dist_work *w[K];
            for (int k = 0; k < K; k++) {
                for (int64_t i = 0; i < n; i++) h[i] = (float)(val(TSYS_F32, g_rank, i) + k);
                t[k] = mk(g_dev[p], TSYS_F32, n, h);
                bool trusting = tsys_dist__trust(g_group[p], k % 2 == 0);
                w[k] = t[k] ? tsys_dist_all_reduce_async(g_group[p], t[k], TSYS_DIST_SUM) : NULL;
                tsys_dist__untrust(g_group[p], trusting);
            }
            for (int k = 0; k < K; k++) {
                STATUS_OK(w[k] ? tsys_dist_wait(w[k]) : TSYS_ERR_INVALID_ARGS, "%s: round %d wait %d", g_name[p], round, k);
                if (t[k]) tsys_tensor_to_host(g_ctx, t[k], h);
                CHECK_VALUES(n, (double)h[i], expect(TSYS_F32, TSYS_DIST_SUM, i) + (double)k * g_size, "%s: round %d collective %d values", g_name[p], round, k);
                tsys_tensor_release(t[k]);
            }
            if (tsys__test_failed) break;
        }
        free(h);
    }
}

// Every host path sums in rank order, ((x0 + x1) + x2) + ..., accumulated in fp32: shared memory, MPI
// and TCP give the same bits (MPI's own reductions choose an order by size and rank count).
static float ragged(int r, int64_t i) { return (float)(1.0 + (double)((r * 7919 + i * 104729) % 1000003) / 1000003.0) * (r % 2 ? 1e-3f : 1.0f); }
static double ragged_sum(int64_t i) {
    float acc = ragged(0, i);
    for (int r = 1; r < g_size; r++) acc += ragged(r, i);
    return acc;
}
TSYS_TEST(float_sums_in_rank_order) {
    const int64_t n = 300001, m = 70001;
    float *h = (float *)hbuf(TSYS_F32, n > m * g_size ? n : m * g_size);
    for (int p = 0; p < g_npaths; p++) {
        if (g_dev[p] != TSYS_CPU) continue;
        for (int64_t i = 0; i < n; i++) h[i] = ragged(g_rank, i);
        tsys_tensor *t = mk(g_dev[p], TSYS_F32, n, h);
        STATUS_OK(t ? tsys_dist_all_reduce(g_group[p], t, TSYS_DIST_SUM) : TSYS_ERR_OOM, "%s: all_reduce", g_name[p]);
        if (t) tsys_tensor_to_host(g_ctx, t, h);
        CHECK_VALUES(n, (double)h[i], ragged_sum(i), "%s: all_reduce sums in rank order", g_name[p]);
        tsys_tensor_release(t);
        for (int64_t i = 0; i < m * g_size; i++) h[i] = ragged(g_rank, i);
        tsys_tensor *in = mk(g_dev[p], TSYS_F32, m * g_size, h), *out = mk(g_dev[p], TSYS_F32, m, NULL);
        STATUS_OK(in && out ? tsys_dist_reduce_scatter(g_group[p], out, in, TSYS_DIST_SUM) : TSYS_ERR_OOM, "%s: reduce_scatter", g_name[p]);
        if (out) tsys_tensor_to_host(g_ctx, out, h);
        const int64_t base = (int64_t)g_rank * m;
        CHECK_VALUES(m, (double)h[i], ragged_sum(base + i), "%s: reduce_scatter sums in rank order", g_name[p]);
        tsys_tensor_release(in); tsys_tensor_release(out);
    }
    free(h);
}

// Broadcasts from every rank in one group (ZeRO-1's parameter exchange): launched together (through NCCL
// as one group), waited after the group's end; a blocking call inside, a nested begin and an end without a
// begin are refused by name, and the group is usable again afterwards.
TSYS_TEST(broadcast_group_every_root) {
    for (int p = 0; p < g_npaths; p++) {
        enum { K = 5 };
        int64_t n = 3001;
        tsys_tensor *t[K];
        tsys_dist_work *w[K];
        float *h = (float *)hbuf(TSYS_F32, n);
        STATUS_OK(tsys_dist_group_begin(g_group[p]), "%s: group begin", g_name[p]);
        for (int k = 0; k < K; k++) {
            for (int64_t i = 0; i < n; i++) h[i] = (float)(val(TSYS_F32, g_rank, i) + 10 * k);
            t[k] = mk(g_dev[p], TSYS_F32, n, h);
            w[k] = tsys_dist_broadcast_async(g_group[p], t[k], k % g_size);
            TEST_CHECK(w[k] != NULL, "%s: broadcast %d: %s", g_name[p], k, tsys_ctx_last_error(g_ctx));
        }
        TEST_CHECK(tsys_dist_all_reduce(g_group[p], t[0], TSYS_DIST_SUM) == TSYS_ERR_INVALID_ARGS &&
                   strstr(tsys_ctx_last_error(g_ctx), "only asynchronous") != NULL, "%s: a blocking call inside a group: %s", g_name[p], tsys_ctx_last_error(g_ctx));
        tsys_ctx_clear_error(g_ctx);
        TEST_CHECK(tsys_dist_group_begin(g_group[p]) == TSYS_ERR_INVALID_ARGS && strstr(tsys_ctx_last_error(g_ctx), "nest") != NULL,
                   "%s: nested begin: %s", g_name[p], tsys_ctx_last_error(g_ctx));
        tsys_ctx_clear_error(g_ctx);
        STATUS_OK(tsys_dist_group_end(g_group[p]), "%s: group end", g_name[p]);
        for (int k = 0; k < K; k++) {
            if (!w[k]) continue;
            STATUS_OK(tsys_dist_wait(w[k]), "%s: wait %d", g_name[p], k);
            tsys_tensor_to_host(g_ctx, t[k], h);
            CHECK_VALUES(n, (double)h[i], val(TSYS_F32, k % g_size, i) + 10 * k, "%s: broadcast %d from rank %d", g_name[p], k, k % g_size);
            tsys_tensor_release(t[k]);
        }
        TEST_CHECK(tsys_dist_group_end(g_group[p]) == TSYS_ERR_INVALID_ARGS && strstr(tsys_ctx_last_error(g_ctx), "no group") != NULL,
                   "%s: end without begin: %s", g_name[p], tsys_ctx_last_error(g_ctx));
        tsys_ctx_clear_error(g_ctx);
        STATUS_OK(tsys_dist_barrier(g_group[p]), "%s: barrier after the group", g_name[p]);
        free(h);
    }
}

// A random sequence (the same on every rank) of blocking and asynchronous collectives of random
// sizes, several in flight, barriers between: shakes the slot reuse and the worker's ordering.
TSYS_TEST(random_sequence_mixed) {
    for (int p = 0; p < g_npaths; p++) {
        uint64_t rs = 0x9e3779b97f4a7c15ull;
        enum { K = 4 };
        for (int it = 0; it < 40; it++) {
            tsys_tensor *t[K], *o[K];
            tsys_dist_work *w[K];
            int kind[K];
            int64_t m[K];
            rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17;
            int kn = 1 + (int)(rs % K);
            for (int k = 0; k < kn; k++) {
                rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17;
                kind[k] = (int)(rs % 4); m[k] = (int64_t)((rs >> 8) % 20000);
                bool async = (rs >> 40) & 1;
                int64_t nin = kind[k] == 2 ? m[k] * g_size : m[k], nout = kind[k] == 3 ? m[k] * g_size : m[k];
                float *h = (float *)hbuf(TSYS_F32, nin);
                for (int64_t i = 0; i < nin; i++) h[i] = (float)(g_rank * 7 + (i % 13) + k);
                t[k] = mk(g_dev[p], TSYS_F32, nin, h);
                o[k] = kind[k] >= 2 ? mk(g_dev[p], TSYS_F32, nout, NULL) : NULL;
                free(h);
                tsys_status st = TSYS_OK;
                w[k] = NULL;
                if (kind[k] == 0) { if (async) w[k] = tsys_dist_all_reduce_async(g_group[p], t[k], TSYS_DIST_SUM); else st = tsys_dist_all_reduce(g_group[p], t[k], TSYS_DIST_SUM); }
                else if (kind[k] == 1) st = tsys_dist_broadcast(g_group[p], t[k], it % g_size);
                else if (kind[k] == 2) { if (async) w[k] = tsys_dist_reduce_scatter_async(g_group[p], o[k], t[k], TSYS_DIST_SUM); else st = tsys_dist_reduce_scatter(g_group[p], o[k], t[k], TSYS_DIST_SUM); }
                else { if (async) w[k] = tsys_dist_all_gather_async(g_group[p], o[k], t[k]); else st = tsys_dist_all_gather(g_group[p], o[k], t[k]); }
                STATUS_OK(st, "%s: step %d.%d", g_name[p], it, k);
                if (async && kind[k] != 1) TEST_CHECK(w[k] != NULL, "%s: step %d.%d launch: %s", g_name[p], it, k, tsys_ctx_last_error(g_ctx));
                if ((rs >> 50) % 5 == 0) STATUS_OK(tsys_dist_barrier(g_group[p]), "%s: barrier", g_name[p]);
            }
            for (int k = kn - 1; k >= 0; k--) if (w[k]) STATUS_OK(tsys_dist_wait(w[k]), "%s: wait %d.%d", g_name[p], it, k);
            for (int k = 0; k < kn; k++) {
                int64_t cnt = kind[k] == 3 ? m[k] * g_size : m[k], mm = m[k] ? m[k] : 1;
                float *h = (float *)hbuf(TSYS_F32, cnt);
                tsys_tensor_to_host(g_ctx, kind[k] >= 2 ? o[k] : t[k], h);
                int kk = k, root = it % g_size;
                if (kind[k] == 0) CHECK_VALUES(cnt, (double)h[i], 7.0 * g_size * (g_size - 1) / 2 + (double)g_size * ((i % 13) + kk), "%s: step %d.%d all_reduce", g_name[p], it, k);
                else if (kind[k] == 1) CHECK_VALUES(cnt, (double)h[i], (double)(root * 7 + (i % 13) + kk), "%s: step %d.%d broadcast", g_name[p], it, k);
                else if (kind[k] == 2) CHECK_VALUES(cnt, (double)h[i], 7.0 * g_size * (g_size - 1) / 2 + (double)g_size * (((g_rank * mm + i) % 13) + kk), "%s: step %d.%d reduce_scatter", g_name[p], it, k);
                else CHECK_VALUES(cnt, (double)h[i], (double)((i / mm) * 7 + ((i % mm) % 13) + kk), "%s: step %d.%d all_gather", g_name[p], it, k);
                free(h);
                tsys_tensor_release(t[k]);
                tsys_tensor_release(o[k]);
            }
        }
    }
}

// NCCL before 2.28.7 corrupted symmetric collectives of sizes that are not a multiple of 8 bytes: tsys_dist refuses
// them on windows (a GPU group of several NCCL ranks)
static bool window_refuses_odd(int p) {
#ifdef TSYS_DIST__WINDOWS
    tsys_dist *d = g_group[p];
    return g_dev[p] == TSYS_CUDA && d->nccl && d->size > 1 && d->nccl_version < NCCL_VERSION(2, 28, 7);
#else
    (void)p;
    return false;
#endif
}

// Tensors made for the group's collectives (NCCL symmetric windows on a GPU group of several ranks, plain
// tensors elsewhere): the collectives that NCCL's window kernels take (sums of 32-bit floats and smaller) and
// some they do not (max, avg, int32), blocking and async, small and 3 MB, sizes of 8-byte multiples and not;
// and the memory tracker sees them come and go.
TSYS_TEST(tensors_for_collectives) {
    for (int p = 0; p < g_npaths; p++) {
        int64_t live0 = tsys_mem_stats_get(g_ctx, g_dev[p]).live_bytes;
        int64_t shape[2] = { 3, 5 };
        tsys_tensor *t = tsys_dist_tensor_new(g_group[p], TSYS_BF16, g_dev[p], 2, shape);
        TEST_CHECK(t && t->ndim == 2 && t->shape[1] == 5 && t->dtype == TSYS_BF16 && t->device == g_dev[p], "%s: tsys_dist_tensor_new: %s", g_name[p], tsys_ctx_last_error(g_ctx));
        TEST_CHECK(tsys_mem_stats_get(g_ctx, g_dev[p]).live_bytes - live0 >= 30, "%s: the tracker counts it", g_name[p]);
        tsys_tensor_release(t);
        TEST_CHECK(tsys_mem_stats_get(g_ctx, g_dev[p]).live_bytes == live0, "%s: and lets it go (%lld live bytes left over)", g_name[p],
                   (long long)(tsys_mem_stats_get(g_ctx, g_dev[p]).live_bytes - live0));
        int64_t bad[1] = { -1 };
        TEST_CHECK(!tsys_dist_tensor_new(g_group[p], TSYS_F32, g_dev[p], 1, bad) && strstr(tsys_ctx_last_error(g_ctx), "negative"), "%s: a negative size: %s", g_name[p], tsys_ctx_last_error(g_ctx));
        tsys_ctx_clear_error(g_ctx);

        g_mk_group = g_group[p];
        int types[3] = { TSYS_F32, TSYS_BF16, TSYS_F16 };
        for (int k = 0; k < 3; k++) {
            check_all_reduce(p, types[k], TSYS_DIST_SUM, 1000, false);
            check_all_reduce(p, types[k], TSYS_DIST_SUM, big_count(types[k]) - 1, k == 1);   // 3 MB
            check_reduce_scatter(p, types[k], TSYS_DIST_SUM, 4096, k == 2);
            check_all_gather(p, types[k], 4096, false);
            if (window_refuses_odd(p)) continue;
            check_all_reduce(p, types[k], TSYS_DIST_SUM, 1001, false);
            check_reduce_scatter(p, types[k], TSYS_DIST_SUM, 4097, false);
            check_all_gather(p, types[k], 4097, k == 0);
        }
        check_all_reduce(p, TSYS_F32, TSYS_DIST_MAX, 1000, false);
        check_all_reduce(p, TSYS_F32, TSYS_DIST_AVG, big_count(TSYS_F32) - 1, true);
        check_all_reduce(p, TSYS_I32, TSYS_DIST_SUM, 1000, false);
        if (window_refuses_odd(p)) {   // refused on every rank before anything is launched: the group goes on
            tsys_tensor *in = mk(g_dev[p], TSYS_BF16, (int64_t)g_size * 4097, NULL), *out = mk(g_dev[p], TSYS_BF16, 4097, NULL);
            tsys_tensor *even = mk(g_dev[p], TSYS_F32, 1024, NULL);
            TEST_CHECK(in && out && tsys_dist_reduce_scatter(g_group[p], out, in, TSYS_DIST_SUM) == TSYS_ERR_INVALID_ARGS &&
                       strstr(tsys_ctx_last_error(g_ctx), "multiple of 8 bytes") && strstr(tsys_ctx_last_error(g_ctx), "2.28.7"), "%s: a window of 4097 bf16 refused: %s", g_name[p], tsys_ctx_last_error(g_ctx));
            tsys_ctx_clear_error(g_ctx);
            STATUS_OK(tsys_dist_group_begin(g_group[p]), "group begin");
            TEST_CHECK(even && !tsys_dist_all_reduce_async(g_group[p], even, TSYS_DIST_SUM) && strstr(tsys_ctx_last_error(g_ctx), "inside a group"), "%s: a window in a group refused: %s", g_name[p], tsys_ctx_last_error(g_ctx));
            tsys_ctx_clear_error(g_ctx);
            STATUS_OK(tsys_dist_group_end(g_group[p]), "group end");
            tsys_tensor_release(in); tsys_tensor_release(out); tsys_tensor_release(even);
            check_all_reduce(p, TSYS_F32, TSYS_DIST_SUM, 1000, false);
        }
        g_mk_group = NULL;
        TEST_CHECK(tsys_mem_stats_get(g_ctx, g_dev[p]).live_bytes == live0, "%s: every tensor given back", g_name[p]);
    }
#ifdef TSYS_WITH_CUDA
    // a tensor that outlives its NCCL group: tsys_dist_free deregisters its window, the last release frees the memory
    for (int p = 0; p < g_npaths; p++) {
        if (g_dev[p] != TSYS_CUDA || tsys_dist_engine_of(g_group[p]) != TSYS_DIST_ENGINE_NCCL) continue;
        tsys_dist_desc cd;
        memset(&cd, 0, sizeof cd);
        cd.cuda = true;
        cd.engine = TSYS_DIST_ENGINE_NCCL;
        int64_t live0 = tsys_mem_stats_get(g_ctx, TSYS_CUDA).live_bytes, shape[1] = { 4096 };
        tsys_dist *d2 = tsys_dist_init(g_ctx, &cd);
        TEST_CHECK(d2 != NULL, "a second NCCL group: %s", tsys_ctx_last_error(g_ctx));
        if (!d2) { tsys_ctx_clear_error(g_ctx); continue; }
        tsys_tensor *t = tsys_dist_tensor_new(d2, TSYS_F32, TSYS_CUDA, 1, shape);
        TEST_CHECK(t && tsys_tensor_fill(g_ctx, t, 1.0f) == TSYS_OK && tsys_dist_all_reduce(d2, t, TSYS_DIST_SUM) == TSYS_OK, "a tensor of the second group: %s", tsys_ctx_last_error(g_ctx));
        tsys_dist_free(d2);
        if (t) {
            float *all = (float *)malloc(sizeof(float) * 4096);
            TEST_CHECK(all && tsys_tensor_to_host(g_ctx, t, all) == TSYS_OK && all[0] == (float)g_size && all[4095] == (float)g_size, "its values after the group is gone");
            free(all);
        }
        tsys_tensor_release(t);
        TEST_CHECK(tsys_mem_stats_get(g_ctx, TSYS_CUDA).live_bytes == live0 && tsys_ctx_status(g_ctx) == TSYS_OK, "released after its group: %s", tsys_ctx_last_error(g_ctx));
        tsys_ctx_clear_error(g_ctx);
    }
#endif
}

TSYS_TEST(all_reduce_host_doubles) {
    for (int p = 0; p < g_npaths; p++) {
        double v[3] = { 1.5 * g_rank, -(double)g_rank, 1e300 };
        STATUS_OK(tsys_dist_all_reduce_host(g_group[p], v, 3, TSYS_DIST_SUM), "%s", g_name[p]);
        TEST_CHECK(v[0] == 1.5 * g_size * (g_size - 1) / 2 && v[1] == -(double)g_size * (g_size - 1) / 2 && v[2] == 1e300 * g_size, "%s: sum %g %g %g", g_name[p], v[0], v[1], v[2]);
        double m[2] = { (double)g_rank, -(double)g_rank };
        STATUS_OK(tsys_dist_all_reduce_host(g_group[p], m, 2, TSYS_DIST_MAX), "%s", g_name[p]);
        TEST_CHECK(m[0] == g_size - 1 && m[1] == 0, "%s: max %g %g", g_name[p], m[0], m[1]);
        double a = g_rank;
        STATUS_OK(tsys_dist_all_reduce_host(g_group[p], &a, 1, TSYS_DIST_AVG), "%s", g_name[p]);
        TEST_CHECK(a == (g_size - 1) / 2.0, "%s: avg %g", g_name[p], a);
        STATUS_OK(tsys_dist_all_reduce_host(g_group[p], NULL, 0, TSYS_DIST_SUM), "%s: empty", g_name[p]);
    }
}

TSYS_TEST(barriers) {
    for (int p = 0; p < g_npaths; p++)
        for (int k = 0; k < 20; k++) STATUS_OK(tsys_dist_barrier(g_group[p]), "%s: barrier %d", g_name[p], k);
}

// A mismatch is an error on every rank (not a hang) and leaves the group usable.
static void expect_mismatch(int p, tsys_status st, const char *what) {
    TEST_CHECK(g_size == 1 || st != TSYS_OK, "%s: %s went through", g_name[p], what);
    if (st != TSYS_OK) {
        const char *msg = tsys_ctx_last_error(g_ctx);
        TEST_CHECK(strstr(msg, "disagree") != NULL, "%s: %s: message '%s'", g_name[p], what, msg);
        tsys_ctx_clear_error(g_ctx);
    }
    check_all_reduce(p, TSYS_F32, TSYS_DIST_SUM, 1001, false);   // still usable
}

TSYS_TEST(mismatch_is_an_error) {
    for (int p = 0; p < g_npaths; p++) {
        tsys_tensor *t = mk(g_dev[p], TSYS_F32, g_rank == 0 ? 100 : 101, NULL), *b = mk(g_dev[p], TSYS_F32, g_rank == 0 ? 1 << 18 : (1 << 18) + 1, NULL);
        tsys_tensor_fill(g_ctx, t, 1); tsys_tensor_fill(g_ctx, b, 1);
        expect_mismatch(p, tsys_dist_all_reduce(g_group[p], t, TSYS_DIST_SUM), "all_reduce of 100 vs 101 elements");
        expect_mismatch(p, tsys_dist_all_reduce(g_group[p], b, TSYS_DIST_SUM), "all_reduce of 1 MB vs 1 MB + 4 bytes");
        expect_mismatch(p, tsys_dist_broadcast(g_group[p], t, 0), "broadcast of 100 vs 101 elements");
        tsys_dist_work *w = tsys_dist_all_reduce_async(g_group[p], t, TSYS_DIST_SUM);
        expect_mismatch(p, w ? tsys_dist_wait(w) : tsys_ctx_status(g_ctx), "async all_reduce of 100 vs 101 elements");
        tsys_tensor *x = mk(g_dev[p], g_rank == 0 ? TSYS_F32 : TSYS_I32, 64, NULL);
        tsys_tensor_fill(g_ctx, x, 0);
        expect_mismatch(p, tsys_dist_all_reduce(g_group[p], x, TSYS_DIST_SUM), "all_reduce of f32 vs i32");
        expect_mismatch(p, tsys_dist_all_reduce(g_group[p], x, g_rank == 0 ? TSYS_DIST_SUM : TSYS_DIST_MAX), "all_reduce sum vs max");
        expect_mismatch(p, g_rank == 0 ? tsys_dist_broadcast(g_group[p], x, 0) : tsys_dist_all_reduce(g_group[p], x, TSYS_DIST_MAX), "broadcast vs all_reduce");
        expect_mismatch(p, g_rank == 0 ? tsys_dist_barrier(g_group[p]) : tsys_dist_all_reduce(g_group[p], x, TSYS_DIST_MAX), "barrier vs all_reduce");
        tsys_tensor_release(t); tsys_tensor_release(b); tsys_tensor_release(x);
    }
}

TSYS_TEST(bad_arguments) {   // caught on each rank before anything is sent: the group stays in step
    for (int p = 0; p < g_npaths; p++) {
        tsys_dist *d = g_group[p];
        tsys_tensor *a = mk(g_dev[p], TSYS_F32, 10, NULL), *b = mk(g_dev[p], TSYS_F32, 10 * g_size + 1, NULL);
        tsys_tensor *i = mk(g_dev[p], TSYS_I32, 10, NULL), *h = mk(g_dev[p], TSYS_BF16, 10 * g_size, NULL);
        struct { tsys_status st; const char *what, *needle; } cases[] = {
            { tsys_dist_reduce_scatter(d, a, b, TSYS_DIST_SUM), "reduce_scatter with in != size x out", "must hold" },
            { tsys_dist_all_gather(d, b, a), "all_gather with out != size x in", "must hold" },
            { tsys_dist_all_reduce(d, i, TSYS_DIST_AVG), "AVG of int32", "AVG needs" },
            { tsys_dist_broadcast(d, a, g_size), "broadcast from a root outside the group", "not a rank" },
            { tsys_dist_broadcast(d, a, -1), "broadcast from root -1", "not a rank" },
            { tsys_dist_all_reduce(d, NULL, TSYS_DIST_SUM), "NULL tensor", "NULL" },
            { tsys_dist_all_reduce(d, a, (tsys_dist_op)7), "unknown op", "unknown op" },
            { tsys_dist_reduce_scatter(d, a, h, TSYS_DIST_SUM), "reduce_scatter bf16 into f32", "must match" },
            { tsys_dist_all_reduce_host(d, NULL, 3, TSYS_DIST_SUM), "all_reduce_host of NULL", "bad arguments" },
        };
        for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
            TEST_CHECK(cases[k].st != TSYS_OK, "%s: %s went through", g_name[p], cases[k].what);
            tsys_ctx_clear_error(g_ctx);
        }
        // the messages, one at a time
        tsys_dist_reduce_scatter(d, a, b, TSYS_DIST_SUM);
        TEST_CHECK(strstr(tsys_ctx_last_error(g_ctx), "must hold") != NULL, "message: %s", tsys_ctx_last_error(g_ctx));
        tsys_ctx_clear_error(g_ctx);
        tsys_dist_all_reduce(d, i, TSYS_DIST_AVG);
        TEST_CHECK(strstr(tsys_ctx_last_error(g_ctx), "AVG needs") != NULL, "message: %s", tsys_ctx_last_error(g_ctx));
        tsys_ctx_clear_error(g_ctx);
        TEST_CHECK(tsys_dist_all_reduce_async(d, i, TSYS_DIST_AVG) == NULL, "async with bad arguments gives NULL");
        tsys_ctx_clear_error(g_ctx);
        TEST_CHECK(tsys_dist_wait(NULL) == TSYS_ERR_INVALID_ARGS, "wait(NULL)");
        tsys_tensor_release(a); tsys_tensor_release(b); tsys_tensor_release(i); tsys_tensor_release(h);
        check_all_reduce(p, TSYS_F32, TSYS_DIST_SUM, 1001, false);   // in step
    }
}

TSYS_TEST(init_errors) {   // every rank fails the same way, at the same point
    tsys_dist_desc dd;
    memset(&dd, 0, sizeof dd);
    tsys_dist_engine host_engine = tsys_dist_engine_of(g_main);
    if (g_size > 1) {
        dd.engine = TSYS_DIST_ENGINE_SELF;
        TEST_CHECK(tsys_dist_init(g_ctx, &dd) == NULL && strstr(tsys_ctx_last_error(g_ctx), "group of one"), "engine self with %d ranks: %s", g_size, tsys_ctx_last_error(g_ctx));
        tsys_ctx_clear_error(g_ctx);
        dd.engine = host_engine == TSYS_DIST_ENGINE_MPI ? TSYS_DIST_ENGINE_TCP : TSYS_DIST_ENGINE_MPI;
        TEST_CHECK(tsys_dist_init(g_ctx, &dd) == NULL, "engine %s when the ranks were started for %s", tsys_dist_engine_name(dd.engine), tsys_dist_engine_name(host_engine));
        printf("%s", g_rank == 0 && g_size > 1 && 0 ? tsys_ctx_last_error(g_ctx) : "");
        tsys_ctx_clear_error(g_ctx);
    }
#ifndef TSYS_DIST_NCCL
    dd.engine = TSYS_DIST_ENGINE_NCCL; dd.cuda = true;
    TEST_CHECK(tsys_dist_init(g_ctx, &dd) == NULL && strstr(tsys_ctx_last_error(g_ctx), "TSYS_DIST_NCCL"), "engine nccl without NCCL: %s", tsys_ctx_last_error(g_ctx));
    tsys_ctx_clear_error(g_ctx);
#endif
    dd.engine = (tsys_dist_engine)42; dd.cuda = false;
    TEST_CHECK(tsys_dist_init(g_ctx, &dd) == NULL && strstr(tsys_ctx_last_error(g_ctx), "unknown engine"), "engine 42: %s", tsys_ctx_last_error(g_ctx));
    tsys_ctx_clear_error(g_ctx);
    dd.engine = TSYS_DIST_ENGINE_AUTO; dd.timeout_s = -3;
    TEST_CHECK(tsys_dist_init(g_ctx, &dd) == NULL, "negative timeout");
    tsys_ctx_clear_error(g_ctx);
    setenv("TSYS_DIST_TIMEOUT", "soon", 1);
    TEST_CHECK(tsys_dist_init(g_ctx, NULL) == NULL && strstr(tsys_ctx_last_error(g_ctx), "TSYS_DIST_TIMEOUT"), "TSYS_DIST_TIMEOUT=soon: %s", tsys_ctx_last_error(g_ctx));
    unsetenv("TSYS_DIST_TIMEOUT");
    tsys_ctx_clear_error(g_ctx);
    check_all_reduce(0, TSYS_F32, TSYS_DIST_SUM, 1001, false);   // the groups that exist still work
}

// ---- options: the desc's fields, the environment over them -----------------------------------------

// Sets an environment variable for a while; env_restore puts back what was there.
typedef struct saved_env { const char *name; char *old; } saved_env;
static saved_env env_set(const char *name, const char *v) {
    saved_env s = { name, getenv(name) ? strdup(getenv(name)) : NULL };
    if (v) setenv(name, v, 1); else unsetenv(name);
    return s;
}
static void env_restore(saved_env s) {
    if (s.old) { setenv(s.name, s.old, 1); free(s.old); }
    else unsetenv(s.name);
}

// A few collectives on a group a test made, in the slot after the standing paths.
static void check_group(tsys_dist *d, const char *name) {
    const int p = g_npaths;
    g_group[p] = d; g_dev[p] = TSYS_CPU; g_name[p] = name;
    check_all_reduce(p, TSYS_F32, TSYS_DIST_SUM, 300001, false);   // several shared-memory slices
    check_all_reduce(p, TSYS_BF16, TSYS_DIST_AVG, 1001, true);
    check_reduce_scatter(p, TSYS_F32, TSYS_DIST_SUM, 4097, false);
    g_group[p] = NULL;
}

TSYS_TEST(desc_options) {   // desc.no_shm is TSYS_DIST_SHM=0; every field shows in tsys_dist_get_desc
    const tsys_dist_desc main_opt = tsys_dist_get_desc(g_main);
    TEST_CHECK(main_opt.timeout_s > 0 && main_opt.shm_slice >= 4096 && main_opt.engine == tsys_dist_engine_of(g_main),
               "defaults filled in: timeout %d s, slice %lld, engine %s", main_opt.timeout_s, (long long)main_opt.shm_slice, tsys_dist_engine_name(main_opt.engine));
    // the variables of the runner (run_dist.sh sets TSYS_DIST_SHM=0) would override what this test asks for
    saved_env shm = env_set("TSYS_DIST_SHM", NULL), slice = env_set("TSYS_DIST_SHM_SLICE", NULL), check = env_set("TSYS_DIST_CHECK", NULL);
    tsys_dist_desc dd;
    memset(&dd, 0, sizeof dd);
    dd.no_shm = true; dd.check = TSYS_DIST_CHECK_NEVER; dd.timeout_s = 77;
    tsys_dist *d = tsys_dist_init(g_ctx, &dd);
    TEST_CHECK(d != NULL, "desc.no_shm: %s", tsys_ctx_last_error(g_ctx));
    if (d) {
        const tsys_dist_desc got = tsys_dist_get_desc(d);
        TEST_CHECK(got.no_shm && !d->shm_base && got.check == TSYS_DIST_CHECK_NEVER && got.timeout_s == 77 && got.engine == tsys_dist_engine_of(g_main),
                   "desc.no_shm: no_shm %d, segment %s, check %d, timeout %d s, engine %s", (int)got.no_shm, d->shm_base ? "mapped" : "none", (int)got.check,
                   got.timeout_s, tsys_dist_engine_name(got.engine));
        TEST_CHECK(g_size == 1 || !d->one_host || strstr(d->shm_note, "no_shm"), "why shared memory is off: '%s'", d->shm_note);
        check_group(d, "desc.no_shm");
        tsys_dist_free(d);
    }
    memset(&dd, 0, sizeof dd);
    dd.shm_slice = 3 * 4096 + 5;   // whole pages: 16 KiB
    d = tsys_dist_init(g_ctx, &dd);
    TEST_CHECK(d != NULL, "desc.shm_slice: %s", tsys_ctx_last_error(g_ctx));
    if (d) {
        const tsys_dist_desc got = tsys_dist_get_desc(d);
        TEST_CHECK(got.shm_slice == 16384 && (!d->shm_base || d->slice == 16384) && !got.no_shm && (d->shm_base || g_size == 1 || !d->one_host),
                   "desc.shm_slice: %lld in effect, segment %s", (long long)got.shm_slice, d->shm_base ? "mapped" : "none");
        check_group(d, "desc.shm_slice");
        tsys_dist_free(d);
    }
    env_restore(shm); env_restore(slice); env_restore(check);
}

TSYS_TEST(env_over_desc) {   // each variable overrides its field
    saved_env shm = env_set("TSYS_DIST_SHM", "0"), slice = env_set("TSYS_DIST_SHM_SLICE", "65536"), check = env_set("TSYS_DIST_CHECK", "1");
    saved_env ce = env_set("TSYS_DIST_CE", "1");   // host tensors: in effect in the desc, no path of its own
    tsys_dist_desc dd;
    memset(&dd, 0, sizeof dd);
    dd.shm_slice = 131072; dd.check = TSYS_DIST_CHECK_NEVER;
    tsys_dist *d = tsys_dist_init(g_ctx, &dd);
    TEST_CHECK(d != NULL, "TSYS_DIST_SHM=0: %s", tsys_ctx_last_error(g_ctx));
    if (d) {
        const tsys_dist_desc got = tsys_dist_get_desc(d);
        TEST_CHECK(got.no_shm && !d->shm_base && got.check == TSYS_DIST_CHECK_ALWAYS && got.shm_slice == 65536 && got.ce_allreduce,
                   "TSYS_DIST_SHM=0, _CHECK=1, _SHM_SLICE=65536, _CE=1 over the desc: no_shm %d, segment %s, check %d, slice %lld, ce %d",
                   (int)got.no_shm, d->shm_base ? "mapped" : "none", (int)got.check, (long long)got.shm_slice, (int)got.ce_allreduce);
        check_group(d, "TSYS_DIST_SHM=0 over the desc");
        tsys_dist_free(d);
    }
    setenv("TSYS_DIST_SHM", "1", 1);
    setenv("TSYS_DIST_CHECK", "0", 1);
    setenv("TSYS_DIST_CE", "0", 1);
    memset(&dd, 0, sizeof dd);
    dd.no_shm = true; dd.ce_allreduce = true;
    d = tsys_dist_init(g_ctx, &dd);
    TEST_CHECK(d != NULL, "TSYS_DIST_SHM=1: %s", tsys_ctx_last_error(g_ctx));
    if (d) {
        const tsys_dist_desc got = tsys_dist_get_desc(d);
        TEST_CHECK(!got.no_shm && got.check == TSYS_DIST_CHECK_NEVER && !got.ce_allreduce &&
                       (g_size == 1 || !d->one_host || d->shm_base || !strstr(d->shm_note, "no_shm")),
                   "TSYS_DIST_SHM=1, _CE=0 over desc.no_shm, .ce_allreduce: no_shm %d, check %d, ce %d, '%s'", (int)got.no_shm, (int)got.check,
                   (int)got.ce_allreduce, d->shm_note);
        check_group(d, "TSYS_DIST_SHM=1 over desc.no_shm");
        tsys_dist_free(d);
    }
    env_restore(shm); env_restore(slice); env_restore(check); env_restore(ce);
}

TSYS_TEST(desc_run_id) {   // the rendezvous' run id and secret from the desc (copied: the caller's may go)
    saved_env run = env_set("TSYS_DIST_RUN_ID", NULL), secret = env_set("TSYS_DIST_SECRET", NULL);
    char run_id[32], key[32];
    snprintf(run_id, sizeof run_id, "tsys-desc-run");
    snprintf(key, sizeof key, "a secret of the desc");
    tsys_dist_desc dd;
    memset(&dd, 0, sizeof dd);
    dd.run_id = run_id; dd.secret = key;
    tsys_dist *d = tsys_dist_init(g_ctx, &dd);
    TEST_CHECK(d != NULL, "desc.run_id: %s", tsys_ctx_last_error(g_ctx));
    memset(run_id, 0, sizeof run_id);
    if (d) {
        const tsys_dist_desc got = tsys_dist_get_desc(d);
        TEST_CHECK(got.run_id && !strcmp(got.run_id, "tsys-desc-run") && got.secret && !strcmp(got.secret, key) && !got.listen_addr,
                   "desc.run_id in effect: '%s'", got.run_id ? got.run_id : "(none)");
        check_group(d, "desc.run_id");
        tsys_dist_free(d);
    }
    setenv("TSYS_DIST_RUN_ID", "tsys-env-run", 1);
    dd.run_id = "tsys-desc-run";
    d = tsys_dist_init(g_ctx, &dd);
    TEST_CHECK(d != NULL, "TSYS_DIST_RUN_ID over desc.run_id: %s", tsys_ctx_last_error(g_ctx));
    if (d) {
        const tsys_dist_desc got = tsys_dist_get_desc(d);
        TEST_CHECK(got.run_id && !strcmp(got.run_id, "tsys-env-run"), "TSYS_DIST_RUN_ID over desc.run_id: '%s'", got.run_id ? got.run_id : "(none)");
        tsys_dist_free(d);
    }
    env_restore(run); env_restore(secret);
}

TSYS_TEST(bad_options) {   // refused before any collective, on every rank alike, naming the variable or field
    static const char *const vars[][2] = {
        { "TSYS_DIST_SHM", "yes" }, { "TSYS_DIST_SHM_SLICE", "12" }, { "TSYS_DIST_SHM_SLICE", "1MB" }, { "TSYS_DIST_BIND", "2" },
        { "TSYS_DIST_NCCL_BLOCKING", "on" }, { "TSYS_DIST_CHECK", "always" }, { "TSYS_DIST_TIMEOUT", "0" }, { "TSYS_DIST_CE", "nccl" } };
    for (size_t k = 0; k < sizeof vars / sizeof vars[0]; k++) {
        saved_env s = env_set(vars[k][0], vars[k][1]);
        tsys_dist *d = tsys_dist_init(g_ctx, NULL);
        const char *err = tsys_ctx_last_error(g_ctx);
        TEST_CHECK(d == NULL && strstr(err, vars[k][0]) && strstr(err, vars[k][1]), "%s=%s: %s", vars[k][0], vars[k][1], d ? "accepted" : err);
        if (d) tsys_dist_free(d);
        tsys_ctx_clear_error(g_ctx);
        env_restore(s);
    }
    tsys_dist_desc dd;
    memset(&dd, 0, sizeof dd);
    dd.shm_slice = 100;
    TEST_CHECK(tsys_dist_init(g_ctx, &dd) == NULL && strstr(tsys_ctx_last_error(g_ctx), "desc.shm_slice = 100"), "shm_slice 100: %s", tsys_ctx_last_error(g_ctx));
    tsys_ctx_clear_error(g_ctx);
    dd.shm_slice = 0; dd.check = (tsys_dist_check)9;
    TEST_CHECK(tsys_dist_init(g_ctx, &dd) == NULL && strstr(tsys_ctx_last_error(g_ctx), "desc.check = 9"), "check 9: %s", tsys_ctx_last_error(g_ctx));
    tsys_ctx_clear_error(g_ctx);
    char longer[300];
    memset(longer, 'x', sizeof longer - 1);
    longer[sizeof longer - 1] = 0;
    dd.check = TSYS_DIST_CHECK_AUTO; dd.listen_addr = longer;
    TEST_CHECK(tsys_dist_init(g_ctx, &dd) == NULL && strstr(tsys_ctx_last_error(g_ctx), "desc.listen_addr is 299 bytes"), "listen_addr of 299: %s", tsys_ctx_last_error(g_ctx));
    tsys_ctx_clear_error(g_ctx);
    dd.listen_addr = NULL;
    longer[64] = 0;
    saved_env run = env_set("TSYS_DIST_RUN_ID", longer);
    TEST_CHECK(tsys_dist_init(g_ctx, &dd) == NULL && strstr(tsys_ctx_last_error(g_ctx), "TSYS_DIST_RUN_ID is 64 bytes"), "run id of 64: %s", tsys_ctx_last_error(g_ctx));
    tsys_ctx_clear_error(g_ctx);
    env_restore(run);
    check_all_reduce(0, TSYS_F32, TSYS_DIST_SUM, 1001, false);   // the groups that exist still work
}

TSYS_TEST(two_groups_interleaved) {   // groups are independent: alternate between them
    if (g_npaths < 2) return;
    for (int k = 0; k < 10; k++) {
        check_all_reduce(k % 2, TSYS_F32, TSYS_DIST_SUM, 100 + k, k % 3 == 0);
        STATUS_OK(tsys_dist_barrier(g_group[(k + 1) % 2]), "barrier");
    }
}

#ifdef TSYS_WITH_CUDA
// NCCL collectives inside a captured CUDA graph (a group of one here: several ranks on this machine's
// one GPU go through host staging, which cannot be captured and must say so).
static void cuda_graph_capture_on(tsys_dist *d, bool nccl);
TSYS_TEST(cuda_graph_capture) {
    for (int p = 0; p < g_npaths; p++) {
        if (g_dev[p] != TSYS_CUDA) continue;
        bool nccl = tsys_dist_engine_of(g_group[p]) == TSYS_DIST_ENGINE_NCCL;
        cuda_graph_capture_on(g_group[p], nccl);
    }
}
static void cuda_graph_capture_on(tsys_dist *d, bool nccl) {
    int64_t n = 1000;
    float *h = (float *)hbuf(TSYS_F32, n * g_size);
    for (int64_t i = 0; i < n; i++) h[i] = (float)i;
    tsys_tensor *t = mk(TSYS_CUDA, TSYS_F32, n, h), *o = mk(TSYS_CUDA, TSYS_F32, n * g_size, NULL);
    STATUS_OK(tsys_cuda_graph_begin(g_ctx), "graph begin");
    if (nccl) {
        tsys_dist_work *w = tsys_dist_all_reduce_async(d, t, TSYS_DIST_AVG);
        TEST_CHECK(w != NULL, "async all_reduce while capturing: %s", tsys_ctx_last_error(g_ctx));
        if (w) STATUS_OK(tsys_dist_wait(w), "wait while capturing");
        STATUS_OK(tsys_dist_all_gather(d, o, t), "all_gather while capturing");
        tsys_cuda_graph *g = NULL;
        STATUS_OK(tsys_cuda_graph_end(g_ctx, &g), "graph end");
        for (int k = 0; k < 3 && g; k++) STATUS_OK(tsys_cuda_graph_replay(g_ctx, g), "replay %d", k);
        STATUS_OK(tsys_sync(g_ctx, TSYS_CUDA), "sync");
        tsys_cuda_graph_free(g);
        memset(h, 0, sizeof(float) * (size_t)(n * g_size));
        tsys_tensor_to_host(g_ctx, o, h);
        CHECK_VALUES(n * g_size, (double)h[i], (double)(i % n), "replayed all_reduce (avg of equal tensors) + all_gather");
        STATUS_OK(tsys_dist_barrier(d), "barrier after the graph");
    } else {
        TEST_CHECK(tsys_dist_all_reduce(d, t, TSYS_DIST_SUM) != TSYS_OK && strstr(tsys_ctx_last_error(g_ctx), "graph"), "host-staged collective while capturing: %s", tsys_ctx_last_error(g_ctx));
        tsys_ctx_clear_error(g_ctx);
        tsys_cuda_graph *g = NULL;
        tsys_cuda_graph_end(g_ctx, &g);
        tsys_cuda_graph_free(g);
        tsys_ctx_clear_error(g_ctx);
    }
    tsys_tensor_release(t); tsys_tensor_release(o);
    free(h);
}
#endif

#ifdef TSYS_WITH_CUDA
// fp32 sums on the copy engines (desc.ce_allreduce), in a second group over the same ranks: in rank order like
// the host paths (NCCL's ring gives other bits past 2 ranks), at 1 MiB (one piece), at two pieces and a short
// third, then captured once and replayed on new values; below 1 MiB the sum stays with NCCL.
static void ce_fill(tsys_tensor *t, float *h, int64_t n, int shift) {
    for (int64_t i = 0; i < n; i++) h[i] = ragged(g_rank, i + shift);
    tsys_tensor *src = tsys_tensor_from_data(g_ctx, TSYS_F32, TSYS_CUDA, 1, &n, h);
    STATUS_OK(src ? tsys_tensor_copy_from(g_ctx, t, src) : TSYS_ERR_OOM, "fill");
    tsys_tensor_release(src);
}
TSYS_TEST(ce_allreduce_sums_in_rank_order) {
    bool nccl = false;
    for (int p = 0; p < g_npaths; p++) nccl = nccl || (g_dev[p] == TSYS_CUDA && tsys_dist_engine_of(g_group[p]) == TSYS_DIST_ENGINE_NCCL);
    if (!nccl) return;   // ranks sharing a GPU: no communicator
    tsys_dist_desc cd;
    memset(&cd, 0, sizeof cd);
    cd.cuda = true; cd.engine = TSYS_DIST_ENGINE_NCCL; cd.ce_allreduce = true;
    tsys_dist *ce = tsys_dist_init(g_ctx, &cd);
    TEST_CHECK(ce != NULL, "group with desc.ce_allreduce: %s", tsys_ctx_last_error(g_ctx));
    if (!ce) return;
    TEST_CHECK(tsys_dist_get_desc(ce).ce_allreduce, "desc.ce_allreduce in effect");
    // 2 slots of a row per rank and an out-row; one rank allocates nothing
    const int64_t scratch = g_size == 1 ? 0 : 2 * (g_size + 1) * (((int64_t)128 << 20) / g_size / 256 * 256);
    TEST_CHECK(g_size == 1 ? tsys_dist_device_bytes(ce) == 0 : tsys_dist_device_bytes(ce) > scratch && tsys_dist_device_bytes(ce) < scratch + 4096,
               "device bytes: %lld with the copy engines (scratch %lld and a page of flags at most)", (long long)tsys_dist_device_bytes(ce), (long long)scratch);
    for (int p = 0; p < g_npaths; p++)
        TEST_CHECK(tsys_dist_get_desc(g_group[p]).ce_allreduce || tsys_dist_device_bytes(g_group[p]) == 0, "%s: device bytes %lld without the copy engines",
                   g_name[p], (long long)tsys_dist_device_bytes(g_group[p]));
    const int64_t piece = tsys_dist__ce_row_bytes(g_size) / 4 * g_size, sizes[] = { 1 << 18, 2 * piece + 12345 };
    float *h = (float *)hbuf(TSYS_F32, sizes[1]);
    for (int k = 0; k < 2; k++) {
        const int64_t n = sizes[k];
        tsys_tensor *t = mk(TSYS_CUDA, TSYS_F32, n, NULL);
        ce_fill(t, h, n, 0);
        STATUS_OK(tsys_dist_all_reduce(ce, t, TSYS_DIST_SUM), "copy-engine all_reduce of %lld", (long long)n);
        tsys_tensor_to_host(g_ctx, t, h);
        CHECK_VALUES(n, (double)h[i], ragged_sum(i), "copy-engine all_reduce of %lld sums in rank order", (long long)n);
        ce_fill(t, h, n, 0);
        STATUS_OK(tsys_dist_all_reduce(ce, t, TSYS_DIST_AVG), "copy-engine average of %lld", (long long)n);
        tsys_tensor_to_host(g_ctx, t, h);
        CHECK_VALUES(n, (double)h[i], (double)((float)ragged_sum(i) / (float)g_size), "copy-engine average of %lld: the sum / ranks", (long long)n);
        tsys_tensor_release(t);
    }
    tsys_tensor *t = mk(TSYS_CUDA, TSYS_F32, sizes[1], NULL);
    ce_fill(t, h, sizes[1], 0);
    STATUS_OK(tsys_cuda_graph_begin(g_ctx), "graph begin");
    STATUS_OK(tsys_dist_all_reduce(ce, t, TSYS_DIST_SUM), "all_reduce while capturing");
    tsys_cuda_graph *g = NULL;
    STATUS_OK(tsys_cuda_graph_end(g_ctx, &g), "graph end");
    for (int k = 1; k <= 2 && g; k++) {
        ce_fill(t, h, sizes[1], k);
        STATUS_OK(tsys_cuda_graph_replay(g_ctx, g), "replay %d", k);
        tsys_tensor_to_host(g_ctx, t, h);
        CHECK_VALUES(sizes[1], (double)h[i], ragged_sum(i + k), "replay %d sums in rank order", k);
    }
    tsys_cuda_graph_free(g);
    tsys_tensor_release(t);
    free(h);
    tsys_dist_free(ce);
    TEST_CHECK(tsys_ctx_status(g_ctx) == TSYS_OK, "after the group's end: %s", tsys_ctx_last_error(g_ctx));
}
#endif

// ---- failure modes (run by tests/test_dist_fail.sh) ----------------------------------------------

static int failure_mode(tsys_dist *d, bool die, int victim, bool nccl) {
    int rank = tsys_dist_rank(d);
    tsys_device dev = TSYS_CPU;
#ifdef TSYS_WITH_CUDA
    if (nccl) {   // a second group through NCCL; the collectives below carry CUDA tensors
        tsys_dist_desc cd;
        memset(&cd, 0, sizeof cd);
        cd.cuda = true;
        cd.engine = TSYS_DIST_ENGINE_NCCL;
        if (!(d = tsys_dist_init(g_ctx, &cd))) { fprintf(stderr, "rank %d: NCCL group: %s\n", rank, tsys_ctx_last_error(g_ctx)); return 1; }
        dev = TSYS_CUDA;
    }
#else
    if (nccl) { fprintf(stderr, "test_dist: --nccl needs the CUDA build\n"); return 2; }
#endif
    if (tsys_dist_barrier(d) != TSYS_OK) { fprintf(stderr, "rank %d: first barrier: %s\n", rank, tsys_ctx_last_error(g_ctx)); return 1; }
    if (rank == victim) {
        if (die) _exit(0);   // early, without a word and without tsys_dist_free / MPI_Finalize
        for (;;) sleep(1000);
    }
    int64_t n = 1000;
    tsys_tensor *t = mk(dev, TSYS_F32, n, NULL);
    for (int k = 0; k < 3; k++)   // NCCL: the collective is only enqueued; the barrier waits for it
        if (tsys_dist_all_reduce(d, t, TSYS_DIST_SUM) != TSYS_OK || (dev != TSYS_CPU && tsys_dist_barrier(d) != TSYS_OK)) {
            fprintf(stderr, "rank %d: all_reduce failed as it should: %s\n", rank, tsys_ctx_last_error(g_ctx));
            return 1;
        }
    fprintf(stderr, "rank %d: all_reduce went through with rank %d %s\n", rank, victim, die ? "gone" : "stalled");
    return 0;
}

int main(int argc, char **argv) {
    int nproc = 1, victim = -1;
    bool die = false, nccl = false;
    const char *filter = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--nproc") && i + 1 < argc) nproc = atoi(argv[++i]);
        else if ((!strcmp(argv[i], "--die") || !strcmp(argv[i], "--stall")) && i + 1 < argc) { die = !strcmp(argv[i], "--die"); victim = atoi(argv[++i]); }
        else if (!strcmp(argv[i], "--nccl")) nccl = true;
        else if (argv[i][0] == '-') { fprintf(stderr, "usage: test_dist [--nproc N] [--die R | --stall R [--nccl]] [filter]\n"); return 2; }
        else filter = argv[i];
    }
    int code = 0;
    if (tsys_dist_spawn(nproc, argc, argv, &code)) return code;
    const char *threads = getenv("OMP_NUM_THREADS");
    if (threads) snprintf(g_threads_given, sizeof g_threads_given, "%s", threads);
    g_ctx = tsys_ctx_new(NULL);
    // small shared-memory slots, so that the few-MB tensors below take many pipeline slices
    bool slice_set = getenv("TSYS_DIST_SHM_SLICE") != NULL;
    if (!slice_set && victim < 0) setenv("TSYS_DIST_SHM_SLICE", "65536", 1);
    tsys_dist *d = tsys_dist_init(g_ctx, NULL);
    if (!slice_set) unsetenv("TSYS_DIST_SHM_SLICE");
    if (!d) { fprintf(stderr, "%s\n", tsys_ctx_last_error(g_ctx)); return 1; }
    g_rank = tsys_dist_rank(d); g_size = tsys_dist_size(d);
    if (victim >= 0) return failure_mode(d, die, victim, nccl);
    g_main = d;
    g_group[0] = d; g_dev[0] = TSYS_CPU;
    g_name[0] = d->shm_base ? "shm" : tsys_dist_engine_name(tsys_dist_engine_of(d));
    g_npaths = 1;
    if (g_size > 1 && d->shm_base) {   // the same ranks without shared memory: MPI or TCP carries the data
        setenv("TSYS_DIST_SHM", "0", 1);
        tsys_dist *d2 = tsys_dist_init(g_ctx, NULL);
        unsetenv("TSYS_DIST_SHM");
        if (!d2) { fprintf(stderr, "%s\n", tsys_ctx_last_error(g_ctx)); return 1; }
        g_group[1] = d2; g_dev[1] = TSYS_CPU; g_name[1] = tsys_dist_engine_name(tsys_dist_engine_of(d2));
        g_npaths = 2;
    }
#ifdef TSYS_WITH_CUDA
    {   // CUDA tensors: through NCCL when every rank has a GPU of its own (a group of one always does),
        // and through host staging when there are several ranks (they may share a GPU)
        int gpus = tsys_cuda_device_count();
        double need = g_size > 1 && gpus > 0 && gpus < d->local_size ? 1 : 0;   // any host short of GPUs?
        tsys_dist_all_reduce_host(d, &need, 1, TSYS_DIST_MAX);
        for (int k = 0; k < 2; k++) {
            bool nccl = k == 0;
            if (nccl && need > 0) continue;
            if (!nccl && g_size == 1) continue;
            tsys_dist_desc cd;
            memset(&cd, 0, sizeof cd);
            cd.cuda = true;
            cd.engine = nccl ? TSYS_DIST_ENGINE_NCCL : tsys_dist_engine_of(d);
            tsys_dist *dc = tsys_dist_init(g_ctx, &cd);
            if (!dc) { fprintf(stderr, "%s\n", tsys_ctx_last_error(g_ctx)); return 1; }
            g_group[g_npaths] = dc; g_dev[g_npaths] = TSYS_CUDA; g_name[g_npaths] = nccl ? "nccl (cuda)" : "host-staged (cuda)";
            g_npaths++;
        }
    }
#endif
    // the hosts the group spans, as tsys sees them (each rank counts 1 / its host's local size): ranks
    // on several hosts take MPI or TCP, never shared memory, between them (tests/test_netns.sh checks it)
    double hosts = 1.0 / d->local_size;
    if (g_size > 1 && tsys_dist_all_reduce_host(d, &hosts, 1, TSYS_DIST_SUM) != TSYS_OK) { fprintf(stderr, "rank %d: %s\n", g_rank, tsys_ctx_last_error(g_ctx)); return 1; }
    if (g_rank == 0) {
        printf("test_dist: %d rank(s) on %d host(s), paths:", g_size, (int)(hosts + 0.5));
        for (int p = 0; p < g_npaths; p++) printf(" %s%s", g_name[p], p + 1 < g_npaths ? "," : "\n");
    }
    int rc = tsys_test_main_dist(filter, d);
    for (int p = g_npaths - 1; p > 0; p--) tsys_dist_free(g_group[p]);
    tsys_dist_free(d);
    tsys_ctx_free(g_ctx);
    return rc;
}
