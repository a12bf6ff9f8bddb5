// test_ddp.c - DDP (every strategy), ZeRO-1 and the memory/communication accounting, run by every
// rank of a group (mpirun -np 2 / -np 4, or the built-in launcher). Rank 0 prints one line per test
// (a test fails when it fails on any rank) and the "N passed, N failed" last line; the other ranks
// print their failed checks on stderr.
//
//   mpirun --oversubscribe -np 2 build/test_ddp [name-filter]
//   build/test_ddp --nproc 2 [name-filter]          (the built-in launcher)
//
// The same file builds with nvcc as test_ddp_cuda (TSYS_WITH_CUDA): the tensors live on the GPU;
// 2 ranks share one GPU through MPI with host staging, world size 1 runs through NCCL.
#define TSYS_PRELUDE_DIST
#include "../drivers/prelude.h"
#include "harness.h"
#include "test_util.h"
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static tsys_ctx *g_ctx;
static tsys_dist *g_d;
static int g_rank, g_world;
static tsys_device g_dev = TSYS_CPU;

// ---- helpers -------------------------------------------------------------------------------------

// A tensor on the test device from host floats.
static tsys_tensor *dev_tensor(int ndim, const int64_t *shape, const float *host) {
    tsys_tensor *h = tsys_tensor_from_data(g_ctx, TSYS_F32, TSYS_CPU, ndim, shape, host);
    if (!h || g_dev == TSYS_CPU) return h;
    tsys_tensor *t = tsys_tensor_to(g_ctx, h, g_dev);
    tsys_tensor_release(h);
    return t;
}

// n floats ~ N(0, std) (or uniform [0, 1) when std < 0) from the context RNG.
static void fill_host(float *x, int64_t n, float std) {
    for (int64_t i = 0; i < n; i++) x[i] = std < 0 ? tsys_rng_uniform(g_ctx) : std * tsys_rng_normal(g_ctx);
}

// Largest allclose ratio between two tensors (any device); <= 1 means close.
static double close_ratio(const tsys_tensor *a, const tsys_tensor *b, double rtol, double atol) {
    float *x = test_read(g_ctx, a), *y = test_read(g_ctx, b);
    double r = (x && y) ? tsys_test_close_ratio(x, y, (long)tsys_tensor_numel(a), rtol, atol) : INFINITY;
    free(x); free(y);
    return r;
}
static bool same_bits(const tsys_tensor *a, const tsys_tensor *b) {
    float *x = test_read(g_ctx, a), *y = test_read(g_ctx, b);
    bool same = x && y && tsys_tensor_numel(a) == tsys_tensor_numel(b) && memcmp(x, y, tsys_tensor_bytes(a)) == 0;
    free(x); free(y);
    return same;
}

// Is t the same on every rank? Compares with rank 0's copy (broadcast into a clone).
static bool same_on_all_ranks(tsys_tensor *t) {
    tsys_tensor *c = tsys_tensor_clone(g_ctx, t);
    bool ok = c && tsys_dist_broadcast(g_d, c, 0) == TSYS_OK && same_bits(c, t);
    tsys_tensor_release(c);
    double bad = ok ? 0 : 1;
    tsys_dist_all_reduce_host(g_d, &bad, 1, TSYS_DIST_SUM);
    return bad == 0;
}

// A fixed permutation of 0..n-1 from seed (the same on every rank).
static void permutation(int *perm, int n, uint64_t seed) {
    tsys_rng_seed(g_ctx, seed);
    for (int i = 0; i < n; i++) perm[i] = i;
    for (int i = n - 1; i > 0; i--) {
        int j = (int)(tsys_rng_next(g_ctx) % (uint64_t)(i + 1)), t = perm[i];
        perm[i] = perm[j]; perm[j] = t;
    }
}

// ---- the CS336 toy models ------------------------------------------------------------------------
// ToyModel: fc1 (10->10, no bias), fc2 (10->50, bias that does not require grad), fc3 (50->5, no
// bias), no_grad_fixed_param = [2, 2]; forward fc3(relu(fc2(relu(fc1 x)))). Parameters in torch's
// order: fc1.weight, fc2.fc.weight, fc2.fc.bias, fc3.weight, no_grad_fixed_param.
// ToyModelWithTiedWeights: fc1 (10->10), fc2 (10->50), fc3 (50->10), fc4 (10->50) = fc2, fc5 (50->5),
// no biases; relu after fc1..fc4. Parameters: fc1, fc2, fc3, fc5 (fc4 is fc2).
// `unused` adds a trainable parameter the forward never touches (reduced as zeros).
typedef struct toy {
    bool tied;
    tsys_tensor *p[6];
    int n;
} toy;

static void toy_init(toy *m, bool tied, uint64_t seed, bool unused) {
    memset(m, 0, sizeof(*m));
    m->tied = tied;
    tsys_rng_seed(g_ctx, seed);
    static const int64_t plain[5][2] = {{10, 10}, {50, 10}, {50, 0}, {5, 50}, {2, 0}};
    static const int64_t tie[4][2] = {{10, 10}, {50, 10}, {10, 50}, {5, 50}};
    int n = tied ? 4 : 5;
    for (int i = 0; i < n; i++) {
        const int64_t *s = tied ? tie[i] : plain[i];
        int ndim = s[1] ? 2 : 1;
        int64_t numel = s[0] * (s[1] ? s[1] : 1);
        float host[500];
        float bound = s[1] ? 1.0f / sqrtf((float)s[1]) : 0.3f;   // torch Linear: U(-1/sqrt(in), 1/sqrt(in))
        for (int64_t k = 0; k < numel; k++) host[k] = bound * (2.0f * tsys_rng_uniform(g_ctx) - 1.0f);
        if (!tied && i == 4) host[0] = host[1] = 2.0f;   // no_grad_fixed_param
        m->p[i] = dev_tensor(ndim, s, host);
        bool grad = tied || (i != 2 && i != 4);
        tsys_tensor_set_requires_grad(m->p[i], grad);
    }
    const char *names_plain[5] = {"fc1.weight", "fc2.fc.weight", "fc2.fc.bias", "fc3.weight", "no_grad_fixed_param"};
    const char *names_tied[4] = {"fc1.weight", "fc2.weight", "fc3.weight", "fc5.weight"};
    for (int i = 0; i < n; i++) tsys_tensor_set_name(m->p[i], "%s", tied ? names_tied[i] : names_plain[i]);
    m->n = n;
    if (unused) {
        int64_t s = 3;
        float host[3] = {0.5f, -0.25f, 1.0f};
        m->p[n] = dev_tensor(1, &s, host);
        tsys_tensor_set_requires_grad(m->p[n], true);
        tsys_tensor_set_name(m->p[n], "unused");
        m->n = n + 1;
    }
}

static void toy_free(toy *m) { for (int i = 0; i < m->n; i++) tsys_tensor_release(m->p[i]); }

static tsys_tensor *relu_linear(tsys_tensor *x, tsys_tensor *w, tsys_tensor *b, bool relu) {
    tsys_tensor *y = tsys_linear(g_ctx, x, w, b);
    if (!relu) return y;
    tsys_tensor *r = tsys_relu(g_ctx, y);
    tsys_tensor_release(y);
    return r;
}

static tsys_tensor *toy_forward(toy *m, tsys_tensor *x) {
    tsys_tensor *h1, *h2, *out;
    if (!m->tied) {
        h1 = relu_linear(x, m->p[0], NULL, true);
        h2 = relu_linear(h1, m->p[1], m->p[2], true);
        out = relu_linear(h2, m->p[3], NULL, false);
    } else {
        h1 = relu_linear(x, m->p[0], NULL, true);
        h2 = relu_linear(h1, m->p[1], NULL, true);
        tsys_tensor *h3 = relu_linear(h2, m->p[2], NULL, true);
        tsys_tensor *h4 = relu_linear(h3, m->p[1], NULL, true);   // fc4 = fc2
        out = relu_linear(h4, m->p[3], NULL, false);
        tsys_tensor_release(h3); tsys_tensor_release(h4);
    }
    tsys_tensor_release(h1); tsys_tensor_release(h2);
    return out;
}

// Rows [r0, r1) of the 20 x 10 inputs and 20 x 5 labels, in the order perm gives.
#define TOY_MAX_ROWS 64
static void toy_batch(const float *x, const float *y, const int *perm, int r0, int r1, tsys_tensor **bx, tsys_tensor **by) {
    float hx[TOY_MAX_ROWS * 10], hy[TOY_MAX_ROWS * 5];
    for (int r = r0; r < r1; r++) {
        memcpy(hx + (r - r0) * 10, x + perm[r] * 10, 10 * sizeof(float));
        memcpy(hy + (r - r0) * 5, y + perm[r] * 5, 5 * sizeof(float));
    }
    int64_t sx[2] = {r1 - r0, 10}, sy[2] = {r1 - r0, 5};
    *bx = dev_tensor(2, sx, hx);
    *by = dev_tensor(2, sy, hy);
}

// One step of forward, mean-MSE loss and backward on (x, y).
static void toy_backward(toy *m, tsys_tensor *x, tsys_tensor *y) {
    tsys_tensor *out = toy_forward(m, x);
    tsys_tensor *loss = tsys_mse(g_ctx, out, y);
    tsys_backward(g_ctx, loss);
    tsys_tensor_release(out); tsys_tensor_release(loss);
}

static int user_hook_calls;
static void count_hook(tsys_ctx *ctx, tsys_tensor *p, void *user) { (void)ctx; (void)p; (void)user; user_hook_calls++; }

// The CS336 DDP procedure (tests/test_ddp.py, test_ddp_individual_parameters.py): each rank starts
// from its own init (seed = rank); after construction every parameter equals rank 0's; five SGD
// (lr 0.1) steps on this rank's share of 20 shuffled rows equal single-process training on all 20.
// (The mean of the ranks' mean losses is the mean loss only for equal shares: with a world size
// that does not divide 20, the data has the next multiple of it rows.)
// pregrad: the parameters already have separate gradients (no arena), so flat and multi-parameter
// buckets go through the scratch copy. Returns the number of buckets.
static int ddp_procedure(bool tied, tsys_ddp_strategy strategy, double bucket_mb, bool pregrad, bool unused) {
    toy ref, mine;
    toy_init(&ref, tied, 0, unused);                 // what rank 0 starts from
    toy_init(&mine, tied, (uint64_t)g_rank, unused);
    int rows = (20 + g_world - 1) / g_world * g_world;
    float x[TOY_MAX_ROWS * 10], y[TOY_MAX_ROWS * 5];
    tsys_rng_seed(g_ctx, 1234);
    fill_host(x, rows * 10, 1.0f);
    fill_host(y, rows * 5, 1.0f);
    int perm[TOY_MAX_ROWS];
    for (int i = 0; i < rows; i++) perm[i] = i;
    if (pregrad) {   // a throwaway backward gives every trainable parameter its own gradient tensor
        tsys_tensor *bx, *by;
        toy_batch(x, y, perm, 0, 2, &bx, &by);
        toy_backward(&mine, bx, by);
        tsys_tensor_release(bx); tsys_tensor_release(by);
    }
    // before the broadcast: rank 0 equals the reference, other ranks differ except the fixed parameter
    for (int i = 0; i < mine.n; i++) {
        bool fixed = !tied && i == 4;
        bool unused_p = unused && i == mine.n - 1;
        bool eq = same_bits(mine.p[i], ref.p[i]);
        if (g_rank == 0 || fixed || unused_p) TEST_CHECK(eq, "rank %d: %s differs from rank 0's before the broadcast", g_rank, mine.p[i]->name);
        else TEST_CHECK(!eq, "rank %d: %s equals rank 0's before the broadcast (inits should differ)", g_rank, mine.p[i]->name);
    }
    if (!tied) tsys_tensor_add_grad_hook(mine.p[0], count_hook, NULL);   // a user hook beside DDP's
    tsys_ddp_desc desc = {strategy, bucket_mb};
    tsys_ddp *ddp = tsys_ddp_new(g_d, mine.p, mine.n, &desc);
    TEST_CHECK(ddp != NULL, "tsys_ddp_new: %s", tsys_ctx_last_error(g_ctx));
    int nb = ddp ? tsys_ddp_stats_get(ddp).num_buckets : -1;
    for (int i = 0; ddp && i < mine.n; i++) {
        TEST_CHECK(same_bits(mine.p[i], ref.p[i]), "rank %d: %s differs from rank 0's after the broadcast", g_rank, mine.p[i]->name);
        TEST_CHECK(same_on_all_ranks(mine.p[i]), "%s differs across ranks after the broadcast", mine.p[i]->name);
    }
    tsys_optim *ref_opt = tsys_sgd_new(g_ctx, ref.p, ref.n, 0.1f), *opt = tsys_sgd_new(g_ctx, mine.p, mine.n, 0.1f);
    int r0 = rows / g_world * g_rank, r1 = r0 + rows / g_world;
    user_hook_calls = 0;
    for (int it = 0; ddp && it < 5; it++) {
        permutation(perm, rows, 42 + (uint64_t)it);
        tsys_tensor *ax, *ay, *bx, *by;
        toy_batch(x, y, perm, 0, rows, &ax, &ay);
        toy_batch(x, y, perm, r0, r1, &bx, &by);
        tsys_optim_zero_grad(ref_opt);
        toy_backward(&ref, ax, ay);
        tsys_optim_step(ref_opt);
        tsys_ddp_start_step(ddp);
        tsys_optim_zero_grad(opt);
        toy_backward(&mine, bx, by);
        // overlap and bucketed have launched every bucket from the hooks by the end of backward
        // (a bucket with the unused parameter waits for finish); naive and flat launch nothing early
        bool hooked = strategy == TSYS_DDP_OVERLAP || strategy == TSYS_DDP_BUCKETED;
        int expect = !hooked ? 0 : !unused ? nb : nb - 1;
        TEST_CHECK(ddp->nlaunched == expect, "%s: %d of %d buckets launched during backward, expected %d", tsys_ddp_strategy_name(strategy), ddp->nlaunched, nb, expect);
        TEST_CHECK(tsys_ddp_finish(ddp) == TSYS_OK, "finish: %s", tsys_ctx_last_error(g_ctx));
        tsys_optim_step(opt);
        for (int i = 0; i < mine.n; i++) {
            double r = close_ratio(mine.p[i], ref.p[i], 1e-5, 1e-8);
            TEST_CHECK(r <= 1.0, "rank %d step %d: %s differs from single-process training (allclose ratio %g)", g_rank, it, mine.p[i]->name, r);
        }
        tsys_tensor_release(ax); tsys_tensor_release(ay); tsys_tensor_release(bx); tsys_tensor_release(by);
    }
    if (ddp && !tied) TEST_CHECK(user_hook_calls == 5, "the user's hook on fc1.weight fired %d times in 5 backwards", user_hook_calls);
    if (ddp) {
        tsys_ddp_stats s = tsys_ddp_stats_get(ddp);
        int64_t trainable = 0;
        for (int i = 0; i < mine.n; i++) if (mine.p[i]->requires_grad) trainable += (int64_t)tsys_tensor_bytes(mine.p[i]);
        TEST_CHECK(s.bytes_per_step == trainable, "bytes per step %lld, trainable parameters hold %lld", (long long)s.bytes_per_step, (long long)trainable);
        // exposed is timed on the compute stream and also holds the wait for a slower rank and the event
        // latencies, so on GPUs it can pass comm by a little when nothing is hidden (naive, flat)
        TEST_CHECK(s.comm_ms >= 0 && s.exposed_ms >= 0 && s.exposed_ms <= 1.25 * s.comm_ms + 0.5, "comm %g ms, exposed %g ms", s.comm_ms, s.exposed_ms);
        // DDP's own gradients are one arena (no copies); separate gradients given by the user are
        // copied when several share a bucket
        int multi = 0;   // buckets over several separate gradient tensors
        for (int i = 0; i < ddp->nb; i++) multi += ddp->b[i].count > 1;
        if (!pregrad) TEST_CHECK(s.copied_buckets == 0, "%d buckets copied with DDP's gradient arena", s.copied_buckets);
        else TEST_CHECK(s.copied_buckets == multi, "separate gradients: %d copied buckets, %d hold several parameters", s.copied_buckets, multi);
    }
    tsys_ddp_free(ddp);
    if (!tied) tsys_tensor_remove_grad_hook(mine.p[0], count_hook, NULL);
    tsys_optim_free(ref_opt); tsys_optim_free(opt);
    toy_free(&ref); toy_free(&mine);
    tsys_tape_clear(g_ctx);
    TEST_CHECK(tsys_ctx_status(g_ctx) == TSYS_OK, "%s", tsys_ctx_last_error(g_ctx));
    return nb;
}

#define DDP_TESTS(model, tied) \
    TSYS_TEST(ddp_##model##_naive) { TEST_CHECK(ddp_procedure(tied, TSYS_DDP_NAIVE, 0, false, false) == (tied ? 4 : 3), "buckets"); } \
    TSYS_TEST(ddp_##model##_flat) { TEST_CHECK(ddp_procedure(tied, TSYS_DDP_FLAT, 0, false, false) == 1, "buckets"); } \
    TSYS_TEST(ddp_##model##_overlap) { TEST_CHECK(ddp_procedure(tied, TSYS_DDP_OVERLAP, 0, false, false) == (tied ? 4 : 3), "buckets"); } \
    TSYS_TEST(ddp_##model##_bucketed_0_0016) { int nb = ddp_procedure(tied, TSYS_DDP_BUCKETED, 0.0016, false, false); TEST_CHECK(nb == (tied ? 4 : 3), "%d buckets", nb); } \
    TSYS_TEST(ddp_##model##_bucketed_0_0001) { int nb = ddp_procedure(tied, TSYS_DDP_BUCKETED, 0.0001, false, false); TEST_CHECK(nb == (tied ? 4 : 3), "%d buckets", nb); } \
    TSYS_TEST(ddp_##model##_bucketed_0_01) { int nb = ddp_procedure(tied, TSYS_DDP_BUCKETED, 0.01, false, false); TEST_CHECK(nb == 1, "%d buckets", nb); } \
    TSYS_TEST(ddp_##model##_bucketed_0) { int nb = ddp_procedure(tied, TSYS_DDP_BUCKETED, 0, false, false); TEST_CHECK(nb == 1, "%d buckets", nb); }

// Bucket counts. The CS336 docstring expects 2, 3 and 1 buckets for 0.0016, 0.0001 and 0.01 MB on
// ToyModel. Its trainable parameters are, in reverse order, fc3.weight 1000 B, fc2.fc.weight
// 2000 B, fc1.weight 400 B (the bias does not require grad and is never reduced). 0.0016 MB is
// 1678 B: fc2.fc.weight alone is over the limit, so under "at most bucket_mb per bucket" it is a
// bucket of its own and fc3 and fc1, which it separates, cannot share one: 3 buckets. The
// docstring's 2 comes from closing a bucket only after it has passed the limit ([fc3, fc2] = 3000 B,
// then [fc1]), which makes buckets larger than bucket_size_mb; tsys keeps the limit. 0.0001 MB
// (105 B) gives one bucket per parameter (3), 0.01 MB (10486 B) one bucket for all 3400 B.
// ToyModelWithTiedWeights (fc5 1000, fc3 2000, fc2 2000, fc1 400 B): 4, 4 and 1.
DDP_TESTS(toy, false)
DDP_TESTS(tied, true)

TSYS_TEST(ddp_toy_separate_grads) {   // gradients that exist before DDP: flat and buckets copy
    ddp_procedure(false, TSYS_DDP_FLAT, 0, true, false);
    ddp_procedure(false, TSYS_DDP_BUCKETED, 0.01, true, false);
    ddp_procedure(true, TSYS_DDP_BUCKETED, 0.0016, true, false);
    ddp_procedure(true, TSYS_DDP_OVERLAP, 0, true, false);
}

TSYS_TEST(ddp_unused_parameter) {   // a trainable parameter without a gradient is reduced as zeros
    for (int s = TSYS_DDP_NAIVE; s <= TSYS_DDP_BUCKETED; s++) {
        ddp_procedure(false, (tsys_ddp_strategy)s, 0.0016, false, true);
        ddp_procedure(true, (tsys_ddp_strategy)s, 0.0016, false, true);
    }
}

// A parameter keeping its gradient in bf16 (tsys_tensor_set_grad_dtype) is refused by DDP without ce_gather
// (but in a group of one, which averages nothing) and by FSDP, named, before anything is exchanged: they reduce
// fp32 gradients. ZeRO-1 takes it: its AdamW reads the gradients as they are (averaged bf16 ones come gathered,
// tsys_ddp_attach_zero1).
TSYS_TEST(dp_refuses_lowp_grads) {
    toy m;
    toy_init(&m, false, 0, false);
    TEST_CHECK(tsys_tensor_set_grad_dtype(g_ctx, m.p[1], TSYS_BF16) == TSYS_OK, "%s", tsys_ctx_last_error(g_ctx));
    const char *who[2] = {"ddp (without desc.ce_gather", "fsdp"};
    for (int k = 0; k < 2; k++) {
        void *made = k == 0 ? (void *)tsys_ddp_new(g_d, m.p, m.n, NULL) : (void *)tsys_fsdp_new(g_d, m.p, m.n, NULL);
        const char *e = tsys_ctx_last_error(g_ctx);
        if (k == 0 && g_world == 1) {
            TEST_CHECK(made != NULL, "a group of one refused a bf16 gradient: '%s'", e);
            tsys_ddp_free((tsys_ddp *)made);
            continue;
        }
        TEST_CHECK(!made && strstr(e, who[k]) && strstr(e, "keeps its gradient in bf16") && strstr(e, m.p[1]->name), "rank %d, %s: '%s'", g_rank, who[k], e);
        tsys_ctx_clear_error(g_ctx);
    }
    tsys_zero1 *z = tsys_zero1_new(g_d, m.p, m.n, NULL);
    TEST_CHECK(z != NULL, "rank %d: zero1 refused a bf16 gradient: %s", g_rank, tsys_ctx_last_error(g_ctx));
    tsys_zero1_free(z);
    tsys_tensor_set_grad_dtype(g_ctx, m.p[1], TSYS_F32);
    toy_free(&m);
}

TSYS_TEST(ddp_bad_desc) {
    toy m;
    toy_init(&m, false, 0, false);
    tsys_ddp_desc bad = {TSYS_DDP_BUCKETED, -1.0};
    TEST_CHECK(tsys_ddp_new(g_d, m.p, m.n, &bad) == NULL, "negative bucket size accepted");
    TEST_CHECK(strstr(tsys_ctx_last_error(g_ctx), "bucket_mb") != NULL, "error: %s", tsys_ctx_last_error(g_ctx));
    tsys_ctx_clear_error(g_ctx);
    tsys_ddp_desc bad2 = {(tsys_ddp_strategy)7, 0};
    TEST_CHECK(tsys_ddp_new(g_d, m.p, m.n, &bad2) == NULL, "unknown strategy accepted");
    tsys_ctx_clear_error(g_ctx);
    TEST_CHECK(!strcmp(tsys_ddp_strategy_name(TSYS_DDP_BUCKETED), "bucketed") && !strcmp(tsys_ddp_strategy_name(TSYS_DDP_OVERLAP), "overlap"), "names");
    // ranks that build different buckets (here: different bucket sizes) are refused at construction,
    // on every rank: the steps' all-reduces skip the per-call check because of this one
    if (g_world > 1) {   // ... and ranks where only one sends bf16
        tsys_ddp_desc wire = {TSYS_DDP_BUCKETED, 0.01, g_rank == 0};
        tsys_ddp *dw = tsys_ddp_new(g_d, m.p, m.n, &wire);
        TEST_CHECK(dw == NULL && strstr(tsys_ctx_last_error(g_ctx), "different layouts") != NULL, "rank %d: mixed comm_bf16: %s", g_rank, tsys_ctx_last_error(g_ctx));
        tsys_ddp_free(dw);
        tsys_ctx_clear_error(g_ctx);
    }
    if (g_world > 1) {
        tsys_ddp_desc mixed = {TSYS_DDP_BUCKETED, g_rank == 0 ? 0.01 : 0.0001};
        tsys_ddp *dd = tsys_ddp_new(g_d, m.p, m.n, &mixed);
        TEST_CHECK(dd == NULL && strstr(tsys_ctx_last_error(g_ctx), "different layouts") != NULL, "rank %d: mixed buckets: %s", g_rank, tsys_ctx_last_error(g_ctx));
        tsys_ddp_free(dd);
        tsys_ctx_clear_error(g_ctx);
    }
    toy_free(&m);
}

// ---- the sharded optimizer -----------------------------------------------------------------------

// tests/test_sharded_optimizer.py: the same init and data on every rank (seed 42), AdamW lr 0.1,
// weight decay 0.1, betas (0.9, 0.999), eps 1e-8; ten steps of sum-of-squares loss on rand(32, 10)
// and rand(32, 5); the sharded model equals the unsharded one exactly.
static void zero1_procedure(bool tied) {
    toy a, b;
    toy_init(&a, tied, 42, false);
    toy_init(&b, tied, 42, false);
    tsys_optim_desc od = {0.1f, 0.9f, 0.999f, 1e-8f, 0.1f, false};
    tsys_optim *plain = tsys_adamw_new(g_ctx, a.p, a.n, &od);
    tsys_zero1 *z = tsys_zero1_new(g_d, b.p, b.n, &od);
    TEST_CHECK(z != NULL, "tsys_zero1_new: %s", tsys_ctx_last_error(g_ctx));
    float fixed[2][50];
    if (!tied) { tsys_tensor_to_f32(g_ctx, b.p[2], fixed[0]); tsys_tensor_to_f32(g_ctx, b.p[4], fixed[1]); }
    for (int it = 0; z && it < 10; it++) {
        float x[320], y[160];
        tsys_rng_seed(g_ctx, 100 + (uint64_t)it);
        fill_host(x, 320, -1); fill_host(y, 160, -1);
        int64_t sx[2] = {32, 10}, sy[2] = {32, 5};
        tsys_tensor *tx = dev_tensor(2, sx, x), *ty = dev_tensor(2, sy, y);
        for (int which = 0; which < 2; which++) {
            toy *m = which ? &b : &a;
            if (which) tsys_zero1_zero_grad(z); else tsys_optim_zero_grad(plain);
            tsys_tensor *out = toy_forward(m, tx), *neg = tsys_scale(g_ctx, out, -1.0f);
            tsys_tensor *diff = tsys_add(g_ctx, ty, neg), *sq = tsys_mul(g_ctx, diff, diff), *loss = tsys_sum(g_ctx, sq);
            tsys_backward(g_ctx, loss);
            if (which) tsys_zero1_step(z); else tsys_optim_step(plain);
            tsys_tensor *tl[5] = {out, neg, diff, sq, loss};
            for (int k = 0; k < 5; k++) tsys_tensor_release(tl[k]);
        }
        for (int i = 0; i < a.n; i++)
            TEST_CHECK(same_bits(a.p[i], b.p[i]), "rank %d step %d: sharded %s differs from unsharded AdamW (ratio %g at rtol 1e-7)", g_rank, it,
                       a.p[i]->name, close_ratio(b.p[i], a.p[i], 1e-7, 0));
        tsys_tensor_release(tx); tsys_tensor_release(ty);
    }
    if (!tied && z) {   // parameters without a gradient are left alone
        float now[50];
        tsys_tensor_to_f32(g_ctx, b.p[2], now);
        TEST_CHECK(!memcmp(now, fixed[0], 50 * sizeof(float)), "fc2.fc.bias changed");
        tsys_tensor_to_f32(g_ctx, b.p[4], now);
        TEST_CHECK(!memcmp(now, fixed[1], 2 * sizeof(float)), "no_grad_fixed_param changed");
    }
    if (z) {   // each rank holds its shard's m and v: together all of them, at most total/N + the largest
        int64_t total = 0, largest = 0;
        for (int i = 0; i < b.n; i++) {
            if (!b.p[i]->requires_grad) continue;
            int64_t s = 8 * tsys_tensor_numel(b.p[i]);
            total += s;
            if (s > largest) largest = s;
        }
        double mine = (double)tsys_zero1_local_state_bytes(z), sum = mine;
        tsys_dist_all_reduce_host(g_d, &sum, 1, TSYS_DIST_SUM);
        TEST_CHECK(sum == (double)total, "local states add up to %.0f bytes, AdamW holds %lld", sum, (long long)total);
        TEST_CHECK(mine <= (double)total / g_world + (double)largest, "rank %d holds %.0f bytes of %lld over %d ranks", g_rank, mine, (long long)total, g_world);
    }
    tsys_zero1_free(z);
    tsys_optim_free(plain);
    toy_free(&a); toy_free(&b);
    tsys_tape_clear(g_ctx);
    TEST_CHECK(tsys_ctx_status(g_ctx) == TSYS_OK, "%s", tsys_ctx_last_error(g_ctx));
}

TSYS_TEST(zero1_toy) { zero1_procedure(false); }
TSYS_TEST(zero1_tied) { zero1_procedure(true); }

// ---- the cs336 model -----------------------------------------------------------------------------

static tsys_model_desc tiny_desc(void) {
    tsys_model_desc d = tsys_model_desc_defaults(NULL);
    d.vocab_size = 97; d.context_length = 16; d.d_model = 32; d.num_layers = 2; d.num_heads = 4; d.d_ff = 64;
    return d;
}

// ids and targets for rows [r0, r1) of a (rows x T) batch made from seed (the same on every rank).
static void lm_batch(uint64_t seed, int rows, int T, int vocab, int r0, int r1, tsys_tensor **ids, tsys_tensor **tgt) {
    int64_t *hi = (int64_t *)malloc(sizeof(int64_t) * (size_t)(rows * T)), *ht = (int64_t *)malloc(sizeof(int64_t) * (size_t)(rows * T));
    tsys_rng_seed(g_ctx, seed);
    for (int i = 0; i < rows * T; i++) { hi[i] = (int64_t)(tsys_rng_next(g_ctx) % (uint64_t)vocab); ht[i] = (int64_t)(tsys_rng_next(g_ctx) % (uint64_t)vocab); }
    int64_t shape[2] = {r1 - r0, T};
    tsys_tensor *a = tsys_tensor_from_data(g_ctx, TSYS_I64, TSYS_CPU, 2, shape, hi + r0 * T);
    tsys_tensor *b = tsys_tensor_from_data(g_ctx, TSYS_I64, TSYS_CPU, 2, shape, ht + r0 * T);
    *ids = tsys_tensor_to(g_ctx, a, g_dev);
    *tgt = tsys_tensor_to(g_ctx, b, g_dev);
    tsys_tensor_release(a); tsys_tensor_release(b);
    free(hi); free(ht);
}

static float lm_step_backward(tsys_model *m, tsys_tensor *ids, tsys_tensor *tgt, tsys_dtype dt) {
    if (dt != TSYS_F32) tsys_autocast_begin(g_ctx, dt);
    tsys_tensor *loss = tsys_model_loss(m, ids, tgt);   // the logits and cross-entropy, or fused when the desc says
    if (dt != TSYS_F32) tsys_autocast_end(g_ctx);
    float l = tsys_item(g_ctx, loss);
    tsys_backward(g_ctx, loss);
    tsys_tensor_release(loss);
    return l;
}

// Three AdamW steps of the tiny model under DDP on per-rank batches of 2 equal one process on the
// combined batch: parameters allclose (rtol 1e-5) in fp32; losses within 1e-3 under bf16 autocast.
static bool lm_comm_bf16;   // tsys_ddp_desc.comm_bf16 of the runs below

static void lm_ddp_run(tsys_ddp_strategy strategy, double bucket_mb, tsys_dtype dt, bool zero1, tsys_model_desc d, int T, int steps) {
    tsys_model_desc dref = d;
    dref.checkpoint = NULL;   // the reference keeps every activation
    tsys_model *ref = tsys_model_new(g_ctx, &dref, g_dev, 7);
    tsys_model *m = tsys_model_new(g_ctx, &d, g_dev, 7 + (uint64_t)g_rank);   // rank 0's init arrives by broadcast
    tsys_optim_desc od = {1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, false};
    tsys_optim *ref_opt = tsys_adamw_new(g_ctx, tsys_model_params(ref), tsys_model_num_tensors(ref), &od);
    tsys_ddp_desc dd = {strategy, bucket_mb, lm_comm_bf16};
    tsys_ddp *ddp = tsys_ddp_new(g_d, tsys_model_params(m), tsys_model_num_tensors(m), &dd);
    TEST_CHECK(ddp != NULL, "tsys_ddp_new: %s", tsys_ctx_last_error(g_ctx));
    // bf16 on the wire: each rank's gradient and their average are rounded to bf16 (8 bits), so the averaged
    // gradients hold to ~1e-2 of the tensor's largest; AdamW's normalized steps turn that into up to ~2 lr a
    // parameter a step (a sign flip of a near-zero gradient)
    const double g_rtol = lm_comm_bf16 ? 1e-2 : 1e-4, g_atol = lm_comm_bf16 ? 1e-2 : 1e-5;
    const double p_atol = lm_comm_bf16 ? 2.0 * 1e-4 * steps : 1e-8, l_tol = lm_comm_bf16 || dt != TSYS_F32 ? 1e-3 : 1e-5;
    if (ddp && lm_comm_bf16) {   // the fp32 gradients travel as bf16: half the bytes
        int64_t grads = 0;
        for (int i = 0; i < tsys_model_num_tensors(m); i++) grads += (int64_t)tsys_tensor_bytes(tsys_model_params(m)[i]);
        TEST_CHECK(tsys_ddp_stats_get(ddp).bytes_per_step * 2 == grads, "bf16 wire: %lld bytes a step for %lld bytes of fp32 gradients",
                   (long long)tsys_ddp_stats_get(ddp).bytes_per_step, (long long)grads);
    }
    tsys_optim *opt = NULL;
    tsys_zero1 *z = NULL;
    if (zero1) z = tsys_zero1_new(g_d, tsys_model_params(m), tsys_model_num_tensors(m), &od);
    else opt = tsys_adamw_new(g_ctx, tsys_model_params(m), tsys_model_num_tensors(m), &od);
    if (ddp && strategy == TSYS_DDP_FLAT) TEST_CHECK(tsys_ddp_stats_get(ddp).copied_buckets == 0, "the model's gradient arena should be reduced in place");
    int B = 2;
    for (int it = 0; ddp && it < steps; it++) {
        tsys_tensor *ai, *at, *bi, *bt;
        lm_batch(500 + (uint64_t)it, B * g_world, T, d.vocab_size, 0, B * g_world, &ai, &at);
        lm_batch(500 + (uint64_t)it, B * g_world, T, d.vocab_size, B * g_rank, B * (g_rank + 1), &bi, &bt);
        tsys_optim_zero_grad(ref_opt);
        float lref = lm_step_backward(ref, ai, at, dt);
        tsys_ddp_start_step(ddp);
        if (z) tsys_zero1_zero_grad(z); else tsys_optim_zero_grad(opt);
        double l = lm_step_backward(m, bi, bt, dt);
        TEST_CHECK(tsys_ddp_finish(ddp) == TSYS_OK, "finish: %s", tsys_ctx_last_error(g_ctx));
        if (dt == TSYS_F32) {   // the averaged gradients against the combined batch's (AdamW alone would not see a scale error)
            double worst = 0;
            const char *where = "";
            tsys_grads_settle(g_ctx, tsys_model_params(ref), tsys_model_num_tensors(ref));
            for (int i = 0; i < tsys_model_num_tensors(m); i++) {
                tsys_tensor *gm = tsys_model_params(m)[i]->grad, *gr = tsys_model_params(ref)[i]->grad;
                float *a = test_read(g_ctx, gm), *b = test_read(g_ctx, gr);
                long ne = (long)tsys_tensor_numel(gr);
                double mx = 0;
                for (long k = 0; b && k < ne; k++) mx = fmax(mx, fabs(b[k]));
                double r = (a && b) ? tsys_test_close_ratio(a, b, ne, g_rtol, g_atol * mx + 1e-12) : INFINITY;
                if (r > worst) { worst = r; where = tsys_model_params(m)[i]->name; }
                free(a); free(b);
            }
            TEST_CHECK(worst <= 1.0, "rank %d step %d: averaged gradients differ from the combined batch's (worst %s, ratio %g at rtol %g, atol %g max|g|)", g_rank, it, where, worst, g_rtol, g_atol);
            if (g_rank == 0 && getenv("TSYS_TEST_VERBOSE")) printf("[grad step %d worst %s %.3g] ", it, where, worst);
        }
        tsys_optim_step(ref_opt);
        if (z) tsys_zero1_step(z); else tsys_optim_step(opt);
        tsys_dist_all_reduce_host(g_d, &l, 1, TSYS_DIST_AVG);
        TEST_CHECK(fabs(l - lref) <= l_tol, "step %d: DDP loss %.7f, one process %.7f", it, l, lref);
        if (dt == TSYS_F32) {
            double worst = 0;
            const char *where = "";
            for (int i = 0; i < tsys_model_num_tensors(m); i++) {
                double r = close_ratio(tsys_model_params(m)[i], tsys_model_params(ref)[i], 1e-5, p_atol);
                if (r > worst) { worst = r; where = tsys_model_params(m)[i]->name; }
            }
            TEST_CHECK(worst <= 1.0, "rank %d step %d: parameters differ from one process on the combined batch (worst %s, allclose ratio %g)", g_rank, it, where, worst);
            if (g_rank == 0 && getenv("TSYS_TEST_VERBOSE")) printf("[step %d worst %s %.3g] ", it, where, worst);
        }
        tsys_tensor_release(ai); tsys_tensor_release(at); tsys_tensor_release(bi); tsys_tensor_release(bt);
    }
    TEST_CHECK(same_on_all_ranks(tsys_model_params(m)[0]) && same_on_all_ranks(tsys_model_params(m)[tsys_model_num_tensors(m) - 1]), "ranks drifted apart");
    tsys_ddp_free(ddp);
    tsys_zero1_free(z);
    tsys_optim_free(opt); tsys_optim_free(ref_opt);
    tsys_model_free(m); tsys_model_free(ref);
    tsys_tape_clear(g_ctx);
    TEST_CHECK(tsys_ctx_status(g_ctx) == TSYS_OK, "%s", tsys_ctx_last_error(g_ctx));
}

static void lm_ddp(tsys_ddp_strategy strategy, double bucket_mb, tsys_dtype dt, bool zero1) { lm_ddp_run(strategy, bucket_mb, dt, zero1, tiny_desc(), 16, 3); }

// The loss curve of 20 bf16-autocast steps against one process on the combined batch, step by step
// within 1e-3: the cs336 small model at context 128 on GPUs, the tiny one on CPU ranks (where the
// small model would take minutes a step).
TSYS_TEST(ddp_lm_bf16_loss_curve_20_steps) {
    tsys_model_desc d = tiny_desc();
    int T = 16;
    if (g_dev == TSYS_CUDA) { tsys_model_desc_preset("small", &d, NULL, 0); d.context_length = T = 128; }
    lm_ddp_run(TSYS_DDP_BUCKETED, 25, TSYS_BF16, false, d, T, 20);
}
TSYS_TEST(ddp_lm_flat_fp32) { lm_ddp(TSYS_DDP_FLAT, 0, TSYS_F32, false); }
TSYS_TEST(ddp_lm_bucketed_fp32) { lm_ddp(TSYS_DDP_BUCKETED, 0.01, TSYS_F32, false); }
TSYS_TEST(ddp_lm_overlap_fp32) { lm_ddp(TSYS_DDP_OVERLAP, 0, TSYS_F32, false); }
// fp32 gradients through bf16 buckets (tsys_ddp_desc.comm_bf16), fp32 and under bf16 autocast.
TSYS_TEST(ddp_lm_bucketed_fp32_comm_bf16) { lm_comm_bf16 = true; lm_ddp(TSYS_DDP_BUCKETED, 0.01, TSYS_F32, false); lm_comm_bf16 = false; }
TSYS_TEST(ddp_lm_overlap_bf16_comm_bf16) { lm_comm_bf16 = true; lm_ddp(TSYS_DDP_OVERLAP, 0, TSYS_BF16, false); lm_comm_bf16 = false; }
TSYS_TEST(ddp_lm_flat_bf16) { lm_ddp(TSYS_DDP_FLAT, 0, TSYS_BF16, false); }
TSYS_TEST(ddp_lm_bucketed_bf16) { lm_ddp(TSYS_DDP_BUCKETED, 0.01, TSYS_BF16, false); }
TSYS_TEST(ddp_lm_zero1_fp32) { lm_ddp(TSYS_DDP_BUCKETED, 0.005, TSYS_F32, true); }

// Activation checkpointing under DDP: the recompute runs before a parameter's gradient is final, so
// the buckets see the same gradients at the same moments; the run equals one process without it.
static void lm_ddp_checkpoint(tsys_ddp_strategy strategy, tsys_dtype dt, const char *policy) {
    tsys_model_desc d = tiny_desc();
    d.checkpoint = policy;
    lm_ddp_run(strategy, 0.01, dt, false, d, 16, 3);
}
TSYS_TEST(ddp_lm_checkpoint_blocks_fp32) { lm_ddp_checkpoint(TSYS_DDP_BUCKETED, TSYS_F32, "blocks:1"); }
TSYS_TEST(ddp_lm_checkpoint_nested_selective_overlap_fp32) { lm_ddp_checkpoint(TSYS_DDP_OVERLAP, TSYS_F32, "nested:2+selective"); }
TSYS_TEST(ddp_lm_checkpoint_selective_bf16) { lm_ddp_checkpoint(TSYS_DDP_BUCKETED, TSYS_BF16, "selective"); }

// ZeRO-1 under DDP equals DDP with a plain AdamW bit for bit (the same averaged gradients).
TSYS_TEST(zero1_lm_bitwise) {
    tsys_model_desc d = tiny_desc();
    tsys_model *a = tsys_model_new(g_ctx, &d, g_dev, 11), *b = tsys_model_new(g_ctx, &d, g_dev, 11);
    tsys_optim_desc od = {3e-3f, 0.9f, 0.999f, 1e-8f, 0.1f, false};
    tsys_ddp_desc dd = {TSYS_DDP_FLAT, 0};
    tsys_ddp *da = tsys_ddp_new(g_d, tsys_model_params(a), tsys_model_num_tensors(a), &dd);
    tsys_ddp *db = tsys_ddp_new(g_d, tsys_model_params(b), tsys_model_num_tensors(b), &dd);
    tsys_optim *plain = tsys_adamw_new(g_ctx, tsys_model_params(a), tsys_model_num_tensors(a), &od);
    tsys_zero1 *z = tsys_zero1_new(g_d, tsys_model_params(b), tsys_model_num_tensors(b), &od);
    TEST_CHECK(da && db && plain && z, "setup: %s", tsys_ctx_last_error(g_ctx));
    for (int it = 0; z && it < 3; it++) {
        tsys_tensor *ids, *tgt;
        lm_batch(900 + (uint64_t)it, 2 * g_world, 16, d.vocab_size, 2 * g_rank, 2 * (g_rank + 1), &ids, &tgt);
        tsys_optim_zero_grad(plain);
        lm_step_backward(a, ids, tgt, TSYS_F32);
        tsys_ddp_finish(da);
        tsys_optim_step(plain);
        tsys_zero1_zero_grad(z);
        lm_step_backward(b, ids, tgt, TSYS_F32);
        tsys_ddp_finish(db);
        tsys_zero1_step(z);
        int bad = 0;
        for (int i = 0; i < tsys_model_num_tensors(a); i++) bad += !same_bits(tsys_model_params(a)[i], tsys_model_params(b)[i]);
        TEST_CHECK(bad == 0, "rank %d step %d: %d tensors differ between ZeRO-1 and AdamW", g_rank, it, bad);
        tsys_tensor_release(ids); tsys_tensor_release(tgt);
    }
    if (z) {
        double mine = (double)tsys_zero1_local_state_bytes(z), sum = mine;
        tsys_dist_all_reduce_host(g_d, &sum, 1, TSYS_DIST_SUM);
        double total = 8.0 * (double)tsys_model_desc_num_params(&d);
        TEST_CHECK(sum == total, "local states add up to %.0f of %.0f bytes", sum, total);
        tsys_dist_account acc = tsys_dist_accounting(&d, TSYS_F32, 2, 16, g_world, TSYS_SCHEME_ZERO1);
        TEST_CHECK(fabs(mine - acc.optim_bytes) <= 0.25 * acc.optim_bytes, "rank %d: %.0f bytes of optimizer state, predicted %.0f", g_rank, mine, acc.optim_bytes);
    }
    tsys_zero1_free(z); tsys_optim_free(plain); tsys_ddp_free(da); tsys_ddp_free(db);
    tsys_model_free(a); tsys_model_free(b);
    tsys_tape_clear(g_ctx);
    TEST_CHECK(tsys_ctx_status(g_ctx) == TSYS_OK, "%s", tsys_ctx_last_error(g_ctx));
}

// ---- accounting ----------------------------------------------------------------------------------

// Replicated training state under DDP: rank 0 saves a snapshot (tsys_state_save: the model and
// AdamW, every rank holds the same), every rank loads it into a fresh model and optimizer (other
// weights, other hyper-parameters) and trains on: the parameters and moments equal the run that went
// on without stopping, bit for bit, on every rank. The snapshot directory is named after rank 0's pid.
static void state_values(tsys_model *m, tsys_optim *o, float **out, int64_t *n) {
    int np = tsys_model_num_tensors(m);
    int64_t total = 0;
    for (int i = 0; i < np; i++) total += tsys_tensor_numel(tsys_model_params(m)[i]);
    float *v = (float *)malloc(sizeof(float) * (size_t)total * 3);
    int64_t at = 0;
    for (int which = -1; v && which < 2; which++)
        for (int i = 0; i < np; i++) {
            tsys_tensor *t = which < 0 ? tsys_tensor_retain(tsys_model_params(m)[i]) : tsys_optim_state(o, i, which);
            if (t && tsys_tensor_to_f32(g_ctx, t, v + at) == TSYS_OK) at += tsys_tensor_numel(t);
            tsys_tensor_release(t);
        }
    *out = v; *n = at;
}

static void state_train(tsys_model *m, tsys_ddp *ddp, tsys_optim *o, int from, int to) {
    for (int it = from; it < to; it++) {
        tsys_tensor *ids, *tgt;
        lm_batch(700 + (uint64_t)it, 2 * g_world, 16, tsys_model_get_desc(m)->vocab_size, 2 * g_rank, 2 * (g_rank + 1), &ids, &tgt);
        tsys_ddp_start_step(ddp);
        tsys_optim_zero_grad(o);
        lm_step_backward(m, ids, tgt, TSYS_F32);
        tsys_ddp_finish(ddp);
        tsys_optim_step(o);
        tsys_tensor_release(ids); tsys_tensor_release(tgt);
    }
}

TSYS_TEST(ddp_state_rank0_saves_every_rank_resumes) {
    tsys_model_desc d = tiny_desc();
    tsys_optim_desc od = {2e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, false}, other = {0.5f, 0.5f, 0.5f, 1e-3f, 0.5f, false};
    tsys_ddp_desc dd = {TSYS_DDP_FLAT, 0, false};
    double pid = g_rank == 0 ? (double)getpid() : 0;   // rank 0's pid names the directory
    tsys_dist_all_reduce_host(g_d, &pid, 1, TSYS_DIST_SUM);
    char dir[256], snap[512];
    snprintf(dir, sizeof dir, "%s/tsys_ddp_state_%.0f", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp", pid);
    snprintf(snap, sizeof snap, "%s/step-000002", dir);

    tsys_model *a = tsys_model_new(g_ctx, &d, g_dev, 7 + (uint64_t)g_rank);   // rank 0's weights arrive by broadcast
    tsys_ddp *da = tsys_ddp_new(g_d, tsys_model_params(a), tsys_model_num_tensors(a), &dd);
    tsys_optim *oa = tsys_adamw_new(g_ctx, tsys_model_params(a), tsys_model_num_tensors(a), &od);
    TEST_CHECK(da && oa, "setup: %s", tsys_ctx_last_error(g_ctx));
    if (!da || !oa) return;
    state_train(a, da, oa, 0, 2);
    tsys_state_desc sd;
    memset(&sd, 0, sizeof sd);
    sd.model = a; sd.optim = oa; sd.step = 2; sd.no_rng = true;   // each rank's RNG is its own
    tsys_status s = g_rank == 0 ? tsys_state_save(g_ctx, dir, &sd) : TSYS_OK;
    TEST_CHECK(s == TSYS_OK, "rank 0 save: %s", tsys_ctx_last_error(g_ctx));
    tsys_dist_barrier(g_d);   // the snapshot is in place before anyone reads it
    state_train(a, da, oa, 2, 4);

    tsys_model *b = tsys_model_new(g_ctx, &d, g_dev, 99 + (uint64_t)g_rank);
    tsys_ddp *db = tsys_ddp_new(g_d, tsys_model_params(b), tsys_model_num_tensors(b), &dd);
    tsys_optim *ob = tsys_adamw_new(g_ctx, tsys_model_params(b), tsys_model_num_tensors(b), &other);
    tsys_state_info info;
    sd.model = b; sd.optim = ob;
    s = tsys_state_load(g_ctx, snap, &sd, &info);
    TEST_CHECK(s == TSYS_OK && info.step == 2, "rank %d load: %s", g_rank, tsys_ctx_last_error(g_ctx));
    if (db && ob && s == TSYS_OK) state_train(b, db, ob, (int)info.step, 4);
    float *va, *vb;
    int64_t na, nb;
    state_values(a, oa, &va, &na);
    state_values(b, ob, &vb, &nb);
    TEST_CHECK(na == nb && va && vb && memcmp(va, vb, sizeof(float) * (size_t)na) == 0, "rank %d: the resumed run differs from the uninterrupted one", g_rank);
    TEST_CHECK(same_on_all_ranks(tsys_model_params(b)[0]) && tsys_optim_steps(ob) == 4, "ranks drifted apart, or step count %lld", (long long)tsys_optim_steps(ob));
    free(va); free(vb);
    tsys_dist_barrier(g_d);
    if (g_rank == 0) {
        char cmd[300];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        TEST_CHECK(system(cmd) == 0, "cannot remove %s", dir);
    }
    tsys_ddp_free(da); tsys_ddp_free(db);
    tsys_optim_free(oa); tsys_optim_free(ob);
    tsys_model_free(a); tsys_model_free(b);
    tsys_tape_clear(g_ctx);
    TEST_CHECK(tsys_ctx_status(g_ctx) == TSYS_OK, "%s", tsys_ctx_last_error(g_ctx));
}

TSYS_TEST(accounting_formulas) {
    tsys_model_desc d;
    tsys_model_desc_preset("xl", &d, NULL, 0);
    double P = (double)tsys_model_desc_num_params(&d);
    tsys_dist_account ddp = tsys_dist_accounting(&d, TSYS_F32, 4, 256, 2, TSYS_SCHEME_DDP);
    tsys_dist_account z1 = tsys_dist_accounting(&d, TSYS_F32, 4, 256, 2, TSYS_SCHEME_ZERO1);
    tsys_dist_account z2 = tsys_dist_accounting(&d, TSYS_F32, 4, 256, 2, TSYS_SCHEME_ZERO2);
    tsys_dist_account z3 = tsys_dist_accounting(&d, TSYS_F32, 4, 256, 2, TSYS_SCHEME_ZERO3);
    TEST_CHECK(ddp.param_bytes == 4 * P && ddp.grad_bytes == 4 * P && ddp.optim_bytes == 8 * P, "DDP: 4 + 4 + 8 bytes per parameter");
    TEST_CHECK(z1.optim_bytes == 4 * P && z1.grad_bytes == 4 * P && z1.param_bytes == 4 * P, "ZeRO-1 at N=2: optimizer state halves");
    TEST_CHECK(z2.grad_bytes == 2 * P && z2.optim_bytes == 4 * P && z2.param_bytes == 4 * P, "ZeRO-2 at N=2");
    TEST_CHECK(z3.param_bytes == 2 * P && z3.grad_bytes == 2 * P && z3.optim_bytes == 4 * P, "ZeRO-3 at N=2");
    TEST_CHECK(ddp.act_bytes == z3.act_bytes && ddp.act_bytes > 0, "activations do not depend on the scheme");
    TEST_CHECK(ddp.sent_bytes == 4 * P && z1.sent_bytes == 6 * P && z2.sent_bytes == 4 * P && z3.sent_bytes == 6 * P, "bytes sent at N=2: ring 2(N-1)/N");
    tsys_dist_account one = tsys_dist_accounting(&d, TSYS_F32, 4, 256, 1, TSYS_SCHEME_DDP);
    TEST_CHECK(one.sent_bytes == 0, "a group of one sends nothing");
    tsys_dist_account bf = tsys_dist_accounting(&d, TSYS_BF16, 4, 256, 2, TSYS_SCHEME_DDP);
    TEST_CHECK(bf.param_bytes > ddp.param_bytes && bf.param_bytes < 6 * P && bf.act_bytes < ddp.act_bytes, "bf16: weight copies added, activations smaller");
    // bf16 gradients of the linear weights (every 2-D parameter but the embedding): 2 bytes less each, kept and sent;
    // kept copies are the casts' bytes; fp32 training keeps fp32 gradients; a flag it does not know gives zeros
    const double linear = d.num_layers * (4.0 * d.d_model * d.d_model + 3.0 * d.d_model * d.d_ff) + (double)d.vocab_size * d.d_model;
    tsys_dist_account lg = tsys_dist_accounting_ex(&d, TSYS_BF16, 4, 256, 2, TSYS_SCHEME_DDP, TSYS_PLAN_LOWP_GRADS | TSYS_PLAN_KEPT_COPIES);
    TEST_CHECK(lg.grad_bytes == 4 * P - 2 * linear && lg.sent_bytes == lg.grad_bytes && lg.param_bytes == bf.param_bytes && lg.act_bytes == bf.act_bytes,
               "bf16 gradients: %.0f gradient bytes (wanted %.0f), %.0f sent", lg.grad_bytes, 4 * P - 2 * linear, lg.sent_bytes);
    TEST_CHECK(tsys_dist_accounting_ex(&d, TSYS_F32, 4, 256, 2, TSYS_SCHEME_DDP, TSYS_PLAN_LOWP_GRADS).grad_bytes == 4 * P &&
               tsys_dist_accounting_ex(&d, TSYS_BF16, 4, 256, 2, TSYS_SCHEME_DDP, TSYS_PLAN_FREE_GRADS).total_bytes == 0, "fp32 gradients; an unknown flag");
    d.attn = "flash";
    tsys_dist_account fl = tsys_dist_accounting(&d, TSYS_F32, 4, 256, 2, TSYS_SCHEME_DDP);
    TEST_CHECK(fl.act_bytes < ddp.act_bytes, "flash keeps no T x T scores");
    TEST_CHECK(!strcmp(tsys_dist_scheme_name(TSYS_SCHEME_ZERO1), "zero1"), "scheme name");
    // the S26 xl figures: 16 bytes per parameter, 54.5 GB at N=1, ZeRO-1 at N=2 saves a quarter
    TEST_CHECK(fabs((z1.param_bytes + z1.grad_bytes + z1.optim_bytes) / (ddp.param_bytes + ddp.grad_bytes + ddp.optim_bytes) - 0.75) < 1e-12, "ZeRO-1 at N=2 = 3/4 of DDP's model state");
}

// One training step of a small model in one process: model state (parameters, gradients, AdamW)
// as tsys_mem_stats sees it after the step against the prediction (within 3%), and the peak above
// it against the predicted activations (roughly).
// fused: the head and the loss fused (desc.fused_loss) with a vocabulary of 8192, where the logits would be
// most of the activations: the prediction follows the fusion and differs from the logits path's by 20% or more.
static void accounting_measured_ex(tsys_dtype dt, const char *attn, bool fused) {
    tsys_model_desc d = tsys_model_desc_defaults(NULL);
    d.vocab_size = fused ? 8192 : 512; d.context_length = 64; d.d_model = 64; d.num_layers = 2; d.num_heads = 4; d.d_ff = 192; d.attn = attn;
    d.fused_loss = fused; d.fused_loss_chunk = fused ? 64 : 0;   // 4 chunks of the 256 rows
    int B = 4, T = 64;
    tsys_ctx *ctx = g_ctx;
    tsys_tape_clear(ctx);
    tsys_mem_stats before = tsys_mem_stats_get(ctx, g_dev);
    tsys_model *m = tsys_model_new(ctx, &d, g_dev, 3);
    tsys_optim *opt = tsys_adamw_new(ctx, tsys_model_params(m), tsys_model_num_tensors(m), NULL);
    tsys_tensor *ids, *tgt;
    lm_batch(77, B, T, d.vocab_size, 0, B, &ids, &tgt);
    int64_t base = tsys_mem_stats_get(ctx, g_dev).live_bytes;
    tsys_mem_reset_peak(ctx, g_dev);
    lm_step_backward(m, ids, tgt, dt);
    tsys_optim_step(opt);
    tsys_optim_zero_grad(opt);
    tsys_tape_clear(ctx);
    tsys_mem_stats after = tsys_mem_stats_get(ctx, g_dev);
    tsys_dist_account acc = tsys_dist_accounting(&d, dt, B, T, 1, TSYS_SCHEME_DDP);
    double state = (double)(after.live_bytes - before.live_bytes) - (double)(tsys_tensor_bytes(ids) + tsys_tensor_bytes(tgt));
    double pred_state = 4.0 * (double)tsys_model_desc_num_params(&d) * 4;   // fp32 parameters, gradients, m, v
    TEST_CHECK(fabs(acc.param_bytes + acc.grad_bytes + acc.optim_bytes - pred_state - (dt == TSYS_F32 ? 0 : acc.param_bytes - 4.0 * (double)tsys_model_desc_num_params(&d))) < 1, "state formula");
    TEST_CHECK(fabs(state - pred_state) <= 0.03 * pred_state, "%s: model state measured %.0f bytes, predicted %.0f", tsys_dtype_name(dt), state, pred_state);
    double transient = (double)(after.peak_bytes - base);
    double pred_peak = acc.act_bytes + (acc.param_bytes - 4.0 * (double)tsys_model_desc_num_params(&d));   // + autocast weight copies
    double tol = g_dev == TSYS_CPU ? 0.1 : 0.35;   // CUDA: allocator granularity, library workspaces
    TEST_CHECK(transient >= (1 - tol) * pred_peak && transient <= (1 + tol) * pred_peak, "%s %s%s: peak above the model state measured %.0f bytes, predicted activations %.0f",
               tsys_dtype_name(dt), attn, fused ? " fused" : "", transient, pred_peak);
    if (fused) {
        tsys_model_desc plain = d;
        plain.fused_loss = false;
        const double act = tsys_dist_accounting(&plain, dt, B, T, 1, TSYS_SCHEME_DDP).act_bytes;
        TEST_CHECK(acc.act_bytes < 0.8 * act, "%s fused: activations predicted %.0f, with the logits %.0f", tsys_dtype_name(dt), acc.act_bytes, act);
    }
    if (g_rank == 0 && getenv("TSYS_TEST_VERBOSE"))
        printf("\n    %s %s: state %.0f (pred %.0f), peak above state %.0f (pred act %.0f + copies %.0f) ", tsys_dtype_name(dt), attn, state, pred_state, transient, acc.act_bytes, pred_peak - acc.act_bytes);
    tsys_tensor_release(ids); tsys_tensor_release(tgt);
    tsys_optim_free(opt);
    tsys_model_free(m);
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
}

static void accounting_measured(tsys_dtype dt, const char *attn) { accounting_measured_ex(dt, attn, false); }
TSYS_TEST(accounting_vs_measured_fp32) { accounting_measured(TSYS_F32, "naive"); }
TSYS_TEST(accounting_vs_measured_fused_loss) { accounting_measured_ex(TSYS_F32, "naive", true); accounting_measured_ex(TSYS_BF16, "naive", true); }
TSYS_TEST(accounting_vs_measured_bf16) { accounting_measured(TSYS_BF16, "naive"); }
TSYS_TEST(accounting_vs_measured_flash) { accounting_measured(TSYS_F32, "flash"); }

// ---- the link model ------------------------------------------------------------------------------

TSYS_TEST(link_model) {
    const tsys_dist_link_model m = {0.01, 1e6}, none = {0, 0};   // 10 us a collective, 1 GB/s
    TEST_CHECK(fabs(tsys_dist_link_time_ms(m, 100, 1e3) - 1.0) < 1e-12, "latency-bound: %g", tsys_dist_link_time_ms(m, 100, 1e3));
    TEST_CHECK(fabs(tsys_dist_link_time_ms(m, 1, 5e6) - 5.0) < 1e-12, "bandwidth-bound: %g", tsys_dist_link_time_ms(m, 1, 5e6));
    TEST_CHECK(isnan(tsys_dist_link_time_ms(none, 1, 1e6)), "no model, no prediction");
    TEST_CHECK(tsys_dist_ring_sent(4, 100) == 150 && tsys_dist_ring_sent(1, 100) == 0, "ring bytes");
    tsys_dist_link_model got = tsys_dist_calibrate_link(g_d, g_dev);
    if (g_world < 2) TEST_CHECK(got.alpha_ms == 0 && got.beta_bytes_per_ms == 0, "a group of one has no link");
    else TEST_CHECK(got.beta_bytes_per_ms > 0 && got.alpha_ms >= 0, "alpha %g ms, beta %g B/ms", got.alpha_ms, got.beta_bytes_per_ms);
    double v[4] = {got.alpha_ms, -got.alpha_ms, got.beta_bytes_per_ms, -got.beta_bytes_per_ms};
    tsys_dist_all_reduce_host(g_d, v, 4, TSYS_DIST_MAX);
    TEST_CHECK(v[0] == -v[1] && v[2] == -v[3], "every rank has the same model");
    for (int kind = TSYS_DIST_ALL_GATHER; kind <= TSYS_DIST_REDUCE_SCATTER; kind++) {   // FSDP's kinds, each its own
        tsys_dist_link_model k = tsys_dist_calibrate_link_of(g_d, g_dev, (tsys_dist_collective)kind);
        if (g_world < 2) TEST_CHECK(k.alpha_ms == 0 && k.beta_bytes_per_ms == 0, "a group of one has no link");
        else TEST_CHECK(k.beta_bytes_per_ms > 0 && k.alpha_ms >= 0, "kind %d: alpha %g ms, beta %g B/ms", kind, k.alpha_ms, k.beta_bytes_per_ms);
        double w[2] = {k.beta_bytes_per_ms, -k.beta_bytes_per_ms};
        tsys_dist_all_reduce_host(g_d, w, 2, TSYS_DIST_MAX);
        TEST_CHECK(w[0] == -w[1], "kind %d: every rank has the same model", kind);
    }
    TEST_CHECK(tsys_ctx_status(g_ctx) == TSYS_OK, "no error left: %s", tsys_ctx_last_error(g_ctx));
}

// The copy engines' pulls, bucket after bucket (all: every rank pulls; one: a single rank does): each bucket its
// alpha and the most a rank receives of it over its link, worked out by hand.
TSYS_TEST(pull_time_model) {
    const tsys_dist_pull_links m = {{0.02, 1e6}, {0.01, 2e6}}, none = {{0, 0}, {0, 0}};
    const int64_t off[3] = {0, 1000000, 3000000}, bytes[3] = {1000000, 2000000, 0};
    const int64_t whole_lo[4] = {0, 0, 0, 0}, whole_hi[4] = {3000000, 3000000, 3000000, 3000000};
    // DDP: every rank receives (world - 1) x every bucket; the empty bucket costs its alpha
    double got = tsys_dist_pull_time_ms(m, 2, 3, off, bytes, whole_lo, whole_hi);
    TEST_CHECK(fabs(got - (3 * 0.02 + 3.0)) < 1e-9, "2 ranks: %g ms (wanted 3.06)", got);
    got = tsys_dist_pull_time_ms(m, 4, 3, off, bytes, whole_lo, whole_hi);
    TEST_CHECK(fabs(got - (3 * 0.02 + 9.0)) < 1e-9, "4 ranks: %g ms (wanted 9.06)", got);
    // ZeRO-1, 4 parts of 1 MB: [0, 0.5 MB) is rank 0's alone (one: 0.01 + 3 x 0.5 / 2), [0.5, 1.5) two ranks' halves
    // (all: 0.02 + 3 x 0.5), [1.5, 4) ranks 1-3 (the most is 1 MB: 0.02 + 3 x 1)
    const int64_t zoff[3] = {0, 500000, 1500000}, zbytes[3] = {500000, 1000000, 2500000};
    const int64_t lo[4] = {0, 1000000, 2000000, 3000000}, hi[4] = {1000000, 2000000, 3000000, 4000000};
    got = tsys_dist_pull_time_ms(m, 4, 3, zoff, zbytes, lo, hi);
    TEST_CHECK(fabs(got - (0.76 + 1.52 + 3.02)) < 1e-9, "ZeRO-1 parts: %g ms (wanted 5.30)", got);
    TEST_CHECK(isnan(tsys_dist_pull_time_ms(none, 2, 3, off, bytes, whole_lo, whole_hi)) && isnan(tsys_dist_pull_time_ms(m, 1, 3, off, bytes, whole_lo, whole_hi)),
               "no link or no peer: no prediction");
    TEST_CHECK(isnan(tsys_ddp_pull_time_ms(NULL, m)), "no DDP: no prediction");
}

// FSDP's collectives one after another: n alpha + (world - 1) / world of the gathered and reduced bytes + a ring
// all-reduce of the replicated fp32 gradients, by hand.
TSYS_TEST(fsdp_link_model) {
    tsys_fsdp_stats s;
    memset(&s, 0, sizeof s);
    s.all_gathers = 10; s.reduce_scatters = 5; s.all_reduces = 3; s.gathered_bytes = 8000000; s.reduced_bytes = 4000000; s.replicated_numel = 1000;
    const tsys_dist_link_model ag = {0.01, 1e6}, rs = {0.02, 2e6}, ar = {0.03, 1e6}, none = {0, 0};
    const tsys_fsdp_links m = {ag, rs, ar};
    double got = tsys_fsdp_link_time_ms(&s, 4, m);   // 10 x 0.01 + 0.75 x 8e6 / 1e6, 5 x 0.02 + 0.75 x 4e6 / 2e6, 3 x 0.03 + 1.5 x 4000 / 1e6
    TEST_CHECK(fabs(got - (6.1 + 1.6 + 0.096)) < 1e-9, "4 ranks: %g ms (wanted 7.796)", got);
    got = tsys_fsdp_link_time_ms(&s, 2, m);          // 0.1 + 4, 0.1 + 1, 0.09 + 0.004
    TEST_CHECK(fabs(got - 5.294) < 1e-9, "2 ranks: %g ms (wanted 5.294)", got);
    const tsys_fsdp_links no_rs = {ag, none, ar};
    TEST_CHECK(isnan(tsys_fsdp_link_time_ms(&s, 4, no_rs)) && isnan(tsys_fsdp_link_time_ms(NULL, 4, m)), "no link or no stats: no prediction");
    s.all_reduces = 0; s.replicated_numel = 0;
    const tsys_fsdp_links no_ar = {ag, rs, none};
    got = tsys_fsdp_link_time_ms(&s, 4, no_ar);
    TEST_CHECK(fabs(got - 7.7) < 1e-9, "nothing replicated needs no all-reduce link: %g ms (wanted 7.7)", got);
}

// tsys_ddp_calibrate_pulls between steps, DDP and ZeRO-1 with desc.ce_gather (GPUs through NCCL), a model of 1.6 M
// parameters in 1 MB buckets: both links measured and the same on every rank, the step's pulls predicted, and the
// training untouched: 2 steps, the probe, 2 more give the bits of 4 steps. Elsewhere (no copy engines): zeros.
static float *pulls_run(tsys_dist_train_mode mode, bool probe, tsys_dist_pull_links *links, double *pred, int64_t *numel) {
    tsys_model_desc d = tiny_desc();
    d.vocab_size = 4096; d.d_model = 128; d.d_ff = 512;
    tsys_model *m = tsys_model_new(g_ctx, &d, g_dev, 5);
    tsys_dist_trainer_desc td;
    memset(&td, 0, sizeof td);
    td.mode = mode; td.ddp.strategy = TSYS_DDP_BUCKETED; td.ddp.bucket_mb = 1; td.ddp.ce_gather = true; td.fsdp.compute_dtype = TSYS_F32; td.autocast = TSYS_F32;
    tsys_dist_trainer *t = m ? tsys_dist_trainer_new(g_ctx, g_d, m, g_dev, &td) : NULL;
    TEST_CHECK(t != NULL, "rank %d: trainer: %s", g_rank, tsys_ctx_last_error(g_ctx));
    tsys_tensor *ids = NULL, *tgt = NULL;
    lm_batch(11, 2 * g_world, 16, d.vocab_size, 2 * g_rank, 2 * g_rank + 2, &ids, &tgt);
    for (int i = 0; t && i < 4; i++) {
        tsys_dist_step_times st;
        if (i == 2 && probe) {
            *links = tsys_ddp_calibrate_pulls(tsys_dist_trainer_ddp(t));
            *pred = tsys_ddp_pull_time_ms(tsys_dist_trainer_ddp(t), *links);
        }
        TEST_CHECK(tsys_dist_trainer_step(t, ids, tgt, &st) == TSYS_OK, "rank %d: step %d: %s", g_rank, i, tsys_ctx_last_error(g_ctx));
    }
    *numel = 0;
    for (int i = 0; m && i < tsys_model_num_tensors(m); i++) *numel += tsys_tensor_numel(tsys_model_params(m)[i]);
    float *all = (float *)malloc((size_t)*numel * sizeof(float));
    for (int64_t i = 0, at = 0; m && all && i < tsys_model_num_tensors(m); i++) {
        float *p = test_read(g_ctx, tsys_model_params(m)[i]);
        const int64_t n = tsys_tensor_numel(tsys_model_params(m)[i]);
        if (p) memcpy(all + at, p, (size_t)n * sizeof(float));
        at += n;
        free(p);
    }
    tsys_tensor_release(ids); tsys_tensor_release(tgt);
    tsys_dist_trainer_free(t);
    tsys_model_free(m);
    return all;
}

static void pulls_case(tsys_dist_train_mode mode) {
    const tsys_dist_pull_links zero = tsys_ddp_calibrate_pulls(NULL);
    TEST_CHECK(zero.all.beta_bytes_per_ms == 0 && zero.one.beta_bytes_per_ms == 0, "no DDP: no links");
    if (g_dev != TSYS_CUDA || tsys_dist_engine_of(g_d) != TSYS_DIST_ENGINE_NCCL || g_world < 2) {
        if (g_rank == 0) printf("(the copy engines' pulls need GPUs through NCCL) ");
        return;
    }
    tsys_dist_pull_links links, unused;
    memset(&links, 0, sizeof links);
    double pred = NAN, unused_pred = NAN;
    int64_t n = 0, n_ref = 0;
    float *probed = pulls_run(mode, true, &links, &pred, &n), *ref = pulls_run(mode, false, &unused, &unused_pred, &n_ref);
    TEST_CHECK(links.all.beta_bytes_per_ms > 0 && links.one.beta_bytes_per_ms > 0 && links.all.alpha_ms >= 0 && links.one.alpha_ms >= 0,
               "rank %d: links all %g ms + %g B/ms, one %g ms + %g B/ms", g_rank, links.all.alpha_ms, links.all.beta_bytes_per_ms, links.one.alpha_ms, links.one.beta_bytes_per_ms);
    double v[4] = {links.all.beta_bytes_per_ms, -links.all.beta_bytes_per_ms, links.one.alpha_ms, -links.one.alpha_ms};
    tsys_dist_all_reduce_host(g_d, v, 4, TSYS_DIST_MAX);
    TEST_CHECK(v[0] == -v[1] && v[2] == -v[3], "every rank has the same links");
    TEST_CHECK(isfinite(pred) && pred > 0, "rank %d: the pulls predicted %g ms", g_rank, pred);
    TEST_CHECK(probed && ref && n == n_ref && n > 1000000 && !memcmp(probed, ref, (size_t)n * sizeof(float)), "rank %d: the probe changed the training (%lld parameters)", g_rank,
               (long long)n);
    TEST_CHECK(tsys_ctx_status(g_ctx) == TSYS_OK, "no error left: %s", tsys_ctx_last_error(g_ctx));
    free(probed); free(ref);
}
TSYS_TEST(ddp_ce_gather_pulls_probe) { pulls_case(TSYS_TRAIN_DDP); }
TSYS_TEST(zero1_ce_gather_pulls_probe) { pulls_case(TSYS_TRAIN_ZERO1); }

// ---- the trainer ---------------------------------------------------------------------------------

// Two steps of the tiny model through tsys_dist_trainer on per-rank batches of 2 equal the ALONE trainer
// on the combined batch, under DDP, ZeRO-1 and FSDP (its full weights gathered). AdamW divides each
// gradient by its own magnitude, so a scale error would not show in the weights, and an element whose
// gradient is near zero moves by a different fraction of lr when the sum order changes (4 ranks: 2e-5
// in a weight of 0.14 at lr 1e-3), and the second step's gradients are taken at those weights: DDP's
// and ZeRO-1's averaged gradients of the first step (the same weights on both sides) are compared as
// the lm test does (rtol 1e-4, atol 1e-5 max|g|), the weights after both within 0.1 lr.
// The worst allclose ratio of m's gradients against ref's (the same parameters in the same order).
static double grads_ratio(tsys_model *m, tsys_model *ref) {
    double worst = 0;
    for (int i = 0; i < tsys_model_num_tensors(m); i++) {
        tsys_tensor *gm = tsys_model_params(m)[i]->grad, *gr = tsys_model_params(ref)[i]->grad;
        float *a = gm ? test_read(g_ctx, gm) : NULL, *b = gr ? test_read(g_ctx, gr) : NULL;
        long ne = (long)tsys_tensor_numel(tsys_model_params(ref)[i]);
        double mx = 0;
        for (long k = 0; b && k < ne; k++) mx = fmax(mx, fabs(b[k]));
        worst = fmax(worst, a && b ? tsys_test_close_ratio(a, b, ne, 1e-4, 1e-5 * mx + 1e-12) : INFINITY);
        free(a); free(b);
    }
    return worst;
}

static void trainer_vs_alone(tsys_dist_train_mode mode) {
    tsys_model_desc d = tiny_desc();
    tsys_model *ref = tsys_model_new(g_ctx, &d, g_dev, 7), *m = tsys_model_new(g_ctx, &d, g_dev, 7);
    tsys_dist_trainer_desc td, rd;
    memset(&td, 0, sizeof(td));
    td.mode = mode; td.ddp.strategy = TSYS_DDP_BUCKETED; td.ddp.bucket_mb = 0.01; td.fsdp.compute_dtype = TSYS_F32; td.autocast = TSYS_F32;
    rd = td; rd.mode = TSYS_TRAIN_ALONE;
    tsys_dist_trainer *t = tsys_dist_trainer_new(g_ctx, g_d, m, g_dev, &td), *r = tsys_dist_trainer_new(g_ctx, NULL, ref, g_dev, &rd);
    TEST_CHECK(t && r, "tsys_dist_trainer_new: %s", tsys_ctx_last_error(g_ctx));
    TEST_CHECK(!t || (tsys_dist_trainer_ddp(t) != NULL) == (mode != TSYS_TRAIN_FSDP) && (tsys_dist_trainer_fsdp(t) != NULL) == (mode == TSYS_TRAIN_FSDP), "accessors");
    for (int it = 0; t && r && it < 2; it++) {
        tsys_tensor *ai, *at, *bi, *bt;
        lm_batch(900 + (uint64_t)it, 2 * g_world, 16, d.vocab_size, 0, 2 * g_world, &ai, &at);
        lm_batch(900 + (uint64_t)it, 2 * g_world, 16, d.vocab_size, 2 * g_rank, 2 * (g_rank + 1), &bi, &bt);
        tsys_dist_step_times tm;
        TEST_CHECK(tsys_dist_trainer_step(r, ai, at, NULL) == TSYS_OK && tsys_dist_trainer_step(t, bi, bt, &tm) == TSYS_OK, "step: %s", tsys_ctx_last_error(g_ctx));
        TEST_CHECK(tm.step_ms > 0 && tm.step_ms >= tm.backward_ms && tm.peak_post_optim > 0, "times: step %g ms, backward %g ms", tm.step_ms, tm.backward_ms);
        tsys_tensor_release(ai); tsys_tensor_release(at); tsys_tensor_release(bi); tsys_tensor_release(bt);
        if (it == 0 && mode != TSYS_TRAIN_FSDP) {   // from the same weights: only the sum order differs
            double g = grads_ratio(m, ref);
            TEST_CHECK(g <= 1.0, "rank %d: the averaged gradients differ from the combined batch's (allclose ratio %g)", g_rank, g);
        }
    }
    double ms = -1;
    TEST_CHECK(t && tsys_dist_trainer_time_collectives(t, &ms) == TSYS_OK && ms >= 0, "collectives alone: %s", tsys_ctx_last_error(g_ctx));
    tsys_tensor **full = tsys_model_params(m);
    int n = tsys_model_num_tensors(m);
    if (t && mode == TSYS_TRAIN_FSDP) TEST_CHECK(tsys_fsdp_gather_full_params(tsys_dist_trainer_fsdp(t), &full, &n) == TSYS_OK, "gather");
    double worst = 0;
    int matched = 0;
    for (int i = 0; full && i < n; i++)   // by name: FSDP gathers in its own order
        for (int j = 0; j < tsys_model_num_tensors(ref); j++)
            if (!strcmp(full[i]->name, tsys_model_params(ref)[j]->name)) { worst = fmax(worst, close_ratio(full[i], tsys_model_params(ref)[j], 1e-4, 1e-4)); matched++; }
    TEST_CHECK(matched == tsys_model_num_tensors(ref) && worst <= 1.0, "rank %d: %d parameters of %d compared; they differ from one process on "
               "the combined batch (allclose ratio %g)", g_rank, matched, tsys_model_num_tensors(ref), worst);
    if (mode == TSYS_TRAIN_FSDP && full) { for (int i = 0; i < n; i++) tsys_tensor_release(full[i]); TSYS_FREE(full); }
    tsys_dist_trainer_free(t); tsys_dist_trainer_free(r);
    tsys_model_free(m); tsys_model_free(ref);
    tsys_tape_clear(g_ctx);
    TEST_CHECK(tsys_ctx_status(g_ctx) == TSYS_OK, "%s", tsys_ctx_last_error(g_ctx));
}
TSYS_TEST(trainer_ddp) { trainer_vs_alone(TSYS_TRAIN_DDP); }
TSYS_TEST(trainer_zero1) { trainer_vs_alone(TSYS_TRAIN_ZERO1); }
TSYS_TEST(trainer_fsdp) { trainer_vs_alone(TSYS_TRAIN_FSDP); }

#include "state_dist.h"
// Sharded snapshots under the trainer (tests/state_dist.h): ZeRO-1's parts, DDP's plain snapshot.
TSYS_TEST(zero1_state_sharded_resume) { state_procedure(g_ctx, g_ctx, TSYS_TRAIN_ZERO1, "zero1"); }
TSYS_TEST(ddp_state_trainer_resume) { state_procedure(g_ctx, g_ctx, TSYS_TRAIN_DDP, "ddp"); }
// A step captured as one CUDA graph and replayed against eager steps (tests/state_dist.h): DDP's flat and
// bucketed all-reduces, ZeRO-1; where it cannot be captured (the CPU, host staging), the refusal.
TSYS_TEST(trainer_compiled_ddp_flat) { compiled_procedure(g_ctx, TSYS_TRAIN_DDP, TSYS_DDP_FLAT, "compiled_flat"); }
TSYS_TEST(trainer_compiled_ddp_bucketed) { compiled_procedure(g_ctx, TSYS_TRAIN_DDP, TSYS_DDP_BUCKETED, "compiled_bucketed"); }
TSYS_TEST(trainer_compiled_zero1) { compiled_procedure(g_ctx, TSYS_TRAIN_ZERO1, TSYS_DDP_BUCKETED, "compiled_zero1"); }
// desc.ce_gather (each rank's gradients copied to every peer by the copy engines, AdamW sums them): at 2 ranks
// on GPUs through NCCL, one eager step, a capture and 3 replays give the bits of 4 eager steps whose gradients
// NCCL averaged (the sum of two in rank order, halved, is NCCL's average of two), under DDP's AdamW and under
// ZeRO-1's (which receives its own parameters' part only); the receive buffer is one peer's gradients (DDP), or
// its owned part (ZeRO-1). Elsewhere: the refusal, naming the option and the rule.
static void ce_gather_case(tsys_dist_train_mode mode) {
    const bool gpus = g_dev == TSYS_CUDA && tsys_dist_engine_of(g_d) == TSYS_DIST_ENGINE_NCCL;
    tsys_model *m;
    tsys_dist_trainer *t = compiled_trainer(g_ctx, mode, TSYS_DDP_BUCKETED, &m, true, false);
    if (!gpus) {
        TEST_CHECK(!t && strstr(tsys_ctx_last_error(g_ctx), "desc.ce_gather: it needs CUDA tensors and NCCL ranks"), "rank %d: not refused: '%s'", g_rank,
                   tsys_ctx_last_error(g_ctx));
        tsys_ctx_clear_error(g_ctx);
        state_drop(t, m);
        return;
    }
    TEST_CHECK(t != NULL, "rank %d: trainer: %s", g_rank, tsys_ctx_last_error(g_ctx));
    int64_t grads = 0;
    for (int i = 0; i < tsys_model_num_tensors(m); i++) grads += (int64_t)tsys_tensor_bytes(tsys_model_params(m)[i]);
    const int64_t held = tsys_ddp_device_bytes(t ? tsys_dist_trainer_ddp(t) : NULL), want = mode == TSYS_TRAIN_ZERO1 ? grads / g_world : grads;
    // ZeRO-1: this rank's share of the bytes, give or take the parameter its cut falls in
    TEST_CHECK(held >= want * (g_world - 1) / 2 && held < (want + grads / 4) * (g_world - 1) + 65536, "rank %d: %lld bytes held for %d peers' %lld bytes of gradients",
               g_rank, (long long)held, g_world - 1, (long long)want);
    state_drop(t, m);
    if (g_world != 2) { if (g_rank == 0) printf("(bitwise against NCCL at 2 ranks only) "); return; }
    compiled_gather = true;
    compiled_procedure(g_ctx, mode, TSYS_DDP_BUCKETED, mode == TSYS_TRAIN_ZERO1 ? "ce_gather_zero1" : "ce_gather");
    compiled_gather = false;
}
TSYS_TEST(trainer_ddp_ce_gather) { ce_gather_case(TSYS_TRAIN_DDP); }

// A trainer under bf16 autocast with desc.lowp_grads and lowp_copies (mode, ddp.ce_gather): NULL and the
// context's error, the model freed, when it is refused.
static tsys_dist_trainer *lowp_trainer(tsys_dist_train_mode mode, bool gather, tsys_dtype autocast, bool grads, bool copies, tsys_model **m) {
    tsys_model_desc d = state_model_desc();
    *m = tsys_model_new(g_ctx, &d, g_dev, 21);
    tsys_dist_trainer_desc td;
    memset(&td, 0, sizeof(td));
    td.mode = mode; td.ddp.strategy = TSYS_DDP_BUCKETED; td.ddp.bucket_mb = 0.01; td.ddp.ce_gather = gather; td.fsdp.compute_dtype = TSYS_BF16;
    td.autocast = autocast; td.lowp_grads = grads; td.lowp_copies = copies;
    tsys_dist_trainer *t = *m ? tsys_dist_trainer_new(g_ctx, mode == TSYS_TRAIN_ALONE ? NULL : g_d, *m, g_dev, &td) : NULL;
    if (!t) { tsys_model_free(*m); *m = NULL; }
    return t;
}

// Part (1) of the test below under mode (DDP with kept copies, ZeRO-1 without), gathering or not (one rank).
// Captured after the first step where the step can be.
static void lowp_same_rows(tsys_dist_train_mode mode, bool gather) {
    const bool copies = mode != TSYS_TRAIN_ZERO1, cap = compiled_capturable();
    tsys_model *m, *ref;
    tsys_dist_trainer *t = lowp_trainer(mode, gather, TSYS_BF16, true, copies, &m), *r = lowp_trainer(TSYS_TRAIN_ALONE, false, TSYS_BF16, true, copies, &ref);
    TEST_CHECK(t && r, "rank %d, mode %d: trainers: %s", g_rank, (int)mode, tsys_ctx_last_error(g_ctx));
    tsys_tensor *ids = NULL, *tgt = NULL;
    state_batch(g_ctx, 0, 0, STATE_ROWS, &ids, &tgt);
    for (int it = 0; t && r && ids && tgt && it < 3; it++) {
        tsys_tensor *bi, *bt;
        state_batch(g_ctx, it, 0, STATE_ROWS, &bi, &bt);
        tsys_tensor_copy_from(g_ctx, ids, bi); tsys_tensor_copy_from(g_ctx, tgt, bt);
        tsys_status s = tsys_dist_trainer_step(r, bi, bt, NULL);
        if (s == TSYS_OK) s = it == 0 || !cap ? tsys_dist_trainer_step(t, ids, tgt, NULL) : tsys_dist_trainer_replay(t, NULL);
        if (s == TSYS_OK && it == 0 && cap) s = tsys_dist_trainer_capture(t, ids, tgt);
        TEST_CHECK(s == TSYS_OK, "rank %d, mode %d: step %d: %s", g_rank, (int)mode, it, tsys_ctx_last_error(g_ctx));
        tsys_tensor_release(bi); tsys_tensor_release(bt);
    }
    int64_t differ = 0, fp32_bytes = 0, bf16 = 0;
    for (int i = 0; t && r && i < tsys_model_num_tensors(m); i++) {
        tsys_tensor *p = tsys_model_params(m)[i];
        float *a = test_read(g_ctx, p), *b = test_read(g_ctx, tsys_model_params(ref)[i]);
        for (int64_t k = 0; a && b && k < tsys_tensor_numel(p); k++) differ += memcmp(&a[k], &b[k], 4) != 0;
        free(a); free(b);
        fp32_bytes += (int64_t)tsys_tensor_bytes(p);
        bf16 += p->grad && p->grad->dtype == TSYS_BF16;
    }
    const int64_t held = tsys_ddp_device_bytes(t ? tsys_dist_trainer_ddp(t) : NULL);
    TEST_CHECK(differ == 0, "rank %d, mode %d: %lld parameter elements apart from one process on the same rows", g_rank, (int)mode, (long long)differ);
    TEST_CHECK(bf16 == 2 * 7 + 1 && (!gather || (held > 0 && held < fp32_bytes * 3 / 4)), "rank %d, mode %d: %lld bf16 gradients (wanted the 15 linear weights'), %lld bytes "
               "received for %lld bytes of fp32 gradients", g_rank, (int)mode, (long long)bf16, (long long)held, (long long)fp32_bytes);
    tsys_tensor_release(ids); tsys_tensor_release(tgt);
    state_drop(t, m); state_drop(r, ref);
}

// desc.lowp_grads (the linear weights' gradients in bf16) and lowp_copies under DDP and (gradients only) ZeRO-1.
// Refused, naming the rule, without autocast, without ce_gather (NCCL would average bf16), copies under ZeRO-1,
// and under FSDP; a group of one keeps them without ce_gather and trains as one process. With ce_gather at 2
// ranks through NCCL, DDP and ZeRO-1: (1) both ranks on the same rows: the
// average of two equal bf16 gradients widened to fp32
// is the gradient itself, so 3 steps (one eager, a capture, 2 replays) give the bits of one process training
// those rows with the same options, which catches a term read from a wrong place, in a wrong dtype or never
// copied; the linear weights' gradients are bf16 and the receive buffer holds fewer bytes than fp32 ones;
// (2) each rank on its own rows: one eager step, a capture and 3 replays give the bits of 4 eager steps.
TSYS_TEST(trainer_ddp_ce_gather_lowp) {
    const bool gpus = g_dev == TSYS_CUDA && tsys_dist_engine_of(g_d) == TSYS_DIST_ENGINE_NCCL;
    struct { tsys_dist_train_mode mode; bool gather; tsys_dtype ac; bool grads, copies; const char *says; } bad[] = {
        {TSYS_TRAIN_DDP, true, TSYS_F32, true, false, "desc.lowp_grads needs bf16 or f16 autocast"},
        {TSYS_TRAIN_DDP, false, TSYS_BF16, true, false, "ddp (without desc.ce_gather, whose optimizer sums them in fp32): 'layers.0.attn.q_proj.weight' keeps its gradient in bf16"},
        {TSYS_TRAIN_ZERO1, true, TSYS_BF16, false, true, "desc.lowp_copies is not for ZERO1"},
        {TSYS_TRAIN_FSDP, false, TSYS_BF16, true, false, "desc.lowp_grads is FSDP's own"}};
    for (size_t k = 0; k < sizeof bad / sizeof *bad; k++) {
        tsys_model *m;
        tsys_dist_trainer *t = lowp_trainer(bad[k].mode, bad[k].gather, bad[k].ac, bad[k].grads, bad[k].copies, &m);
        if (k == 1 && g_world == 1) {   // a group of one averages nothing: it keeps them
            TEST_CHECK(t != NULL, "rank %d: one rank refused bf16 gradients: %s", g_rank, tsys_ctx_last_error(g_ctx));
            state_drop(t, m);
            continue;
        }
        TEST_CHECK(!t && strstr(tsys_ctx_last_error(g_ctx), bad[k].says), "rank %d, case %zu: %s (wanted a refusal naming '%s')", g_rank, k,
                   t ? "made" : tsys_ctx_last_error(g_ctx), bad[k].says);
        tsys_ctx_clear_error(g_ctx);
        state_drop(t, m);
    }
    if (g_world == 1) lowp_same_rows(TSYS_TRAIN_DDP, false);   // a group of one keeps bf16 gradients without gathering
    if (!gpus || g_world != 2) { if (g_rank == 0) printf("(gathered: at 2 GPU ranks through NCCL only) "); return; }
    for (int z = 0; z < 2; z++) lowp_same_rows(z ? TSYS_TRAIN_ZERO1 : TSYS_TRAIN_DDP, true);
    compiled_lowp = true;
    compiled_procedure(g_ctx, TSYS_TRAIN_DDP, TSYS_DDP_BUCKETED, "ce_gather_lowp");
    compiled_procedure(g_ctx, TSYS_TRAIN_ZERO1, TSYS_DDP_BUCKETED, "ce_gather_lowp_zero1");
    compiled_lowp = false;
}
TSYS_TEST(trainer_zero1_ce_gather) { ce_gather_case(TSYS_TRAIN_ZERO1); }

// desc.opt_in_backward under DDP: each bucket's AdamW update on the background stream once its gradients are
// in on every rank. Through NCCL: 1 eager step, a capture and 3 replays with the updates inside backward give
// the bits of 4 eager steps with AdamW after it, for buckets all-reduced and (2 ranks) for gathered bf16
// gradients with kept copies, and for gathered gradients with each bucket updated by its owner alone and pushed
// to the peer (desc.ddp.shard_updates; fp32, and bf16 with kept copies: the snapshots compared hold every
// bucket's moments; and bf16 with the matmul weights pushed as their copies alone, desc.ddp.shard_masters: the
// saves bring every rank's fp32 weights first; and with each rank's AdamW keeping its buckets' moments alone,
// desc.ddp.shard_state: sharded snapshots). Refused under ZeRO-1, and where the gradients are not in as of a stream (the CPU, host
// staging), naming the rule.
TSYS_TEST(trainer_ddp_opt_in_backward) {
    const bool nccl = g_dev == TSYS_CUDA && (tsys_dist_engine_of(g_d) == TSYS_DIST_ENGINE_NCCL || g_world == 1);
    tsys_model_desc d = state_model_desc();
    for (int k = 0; k < 2; k++) {
        tsys_model *m = tsys_model_new(g_ctx, &d, g_dev, 21);
        tsys_dist_trainer_desc td;
        memset(&td, 0, sizeof(td));
        td.mode = k ? TSYS_TRAIN_DDP : TSYS_TRAIN_ZERO1; td.ddp.strategy = TSYS_DDP_BUCKETED; td.ddp.bucket_mb = 0.01; td.autocast = TSYS_F32; td.opt_in_backward = true;
        tsys_dist_trainer *t = m ? tsys_dist_trainer_new(g_ctx, g_d, m, g_dev, &td) : NULL;
        const char *says = k ? "tsys_ddp_optim_in_backward: it needs CUDA tensors on NCCL ranks" : "desc.opt_in_backward is for DDP, FSDP and ALONE";
        if (k == 0 || !nccl) {
            TEST_CHECK(!t && strstr(tsys_ctx_last_error(g_ctx), says), "rank %d: %s (wanted a refusal naming '%s')", g_rank, t ? "made" : tsys_ctx_last_error(g_ctx), says);
            tsys_ctx_clear_error(g_ctx);
        } else TEST_CHECK(t != NULL, "rank %d: trainer: %s", g_rank, tsys_ctx_last_error(g_ctx));
        state_drop(t, m);
    }
    if (!nccl) return;
    compiled_in_backward = true;
    compiled_procedure(g_ctx, TSYS_TRAIN_DDP, TSYS_DDP_BUCKETED, "in_backward_bucketed");
    if (g_world == 2) {
        compiled_lowp = true;
        compiled_procedure(g_ctx, TSYS_TRAIN_DDP, TSYS_DDP_BUCKETED, "in_backward_gather_lowp");
        compiled_shard = true;
        compiled_procedure(g_ctx, TSYS_TRAIN_DDP, TSYS_DDP_BUCKETED, "in_backward_gather_lowp_shard");
        compiled_masters = true;
        compiled_procedure(g_ctx, TSYS_TRAIN_DDP, TSYS_DDP_BUCKETED, "in_backward_gather_lowp_masters");
        compiled_state = true;
        compiled_procedure(g_ctx, TSYS_TRAIN_DDP, TSYS_DDP_BUCKETED, "in_backward_gather_lowp_masters_state");
        compiled_masters = compiled_state = false;
        compiled_lowp = false;
        compiled_gather = true;
        compiled_procedure(g_ctx, TSYS_TRAIN_DDP, TSYS_DDP_BUCKETED, "in_backward_gather_shard");
        compiled_gather = false; compiled_shard = false;
    }
    compiled_in_backward = false;
}

// desc.ddp.shard_updates refused, naming the rule: without ce_gather (tsys_ddp_new), and in a trainer without
// AdamW inside backward; shard_masters without shard_updates or read_by_copy (tsys_ddp_new), and in a trainer
// without kept copies.
TSYS_TEST(ddp_shard_updates_refusals) {
    tsys_model_desc d = tiny_desc();
    tsys_model *m = tsys_model_new(g_ctx, &d, g_dev, 3);
    tsys_ddp_desc dd = {TSYS_DDP_BUCKETED, 0.01, false, false, true};
    tsys_ddp *ddp = m ? tsys_ddp_new(g_d, tsys_model_params(m), tsys_model_num_tensors(m), &dd) : NULL;
    TEST_CHECK(!ddp && strstr(tsys_ctx_last_error(g_ctx), "desc.shard_updates needs desc.ce_gather"), "rank %d: without ce_gather: '%s'", g_rank, tsys_ctx_last_error(g_ctx));
    tsys_ctx_clear_error(g_ctx);
    tsys_ddp_free(ddp);
    tsys_dist_trainer_desc td;
    memset(&td, 0, sizeof td);
    td.mode = TSYS_TRAIN_DDP; td.ddp.strategy = TSYS_DDP_BUCKETED; td.ddp.bucket_mb = 0.01; td.ddp.ce_gather = true; td.ddp.shard_updates = true; td.autocast = TSYS_F32;
    tsys_dist_trainer *t = m ? tsys_dist_trainer_new(g_ctx, g_d, m, g_dev, &td) : NULL;
    TEST_CHECK(!t && strstr(tsys_ctx_last_error(g_ctx), "desc.ddp.shard_updates is for DDP with ddp.ce_gather and opt_in_backward"), "rank %d: after backward: '%s'",
               g_rank, tsys_ctx_last_error(g_ctx));
    tsys_ctx_clear_error(g_ctx);
    tsys_dist_trainer_free(t);
    const int n = m ? tsys_model_num_tensors(m) : 0;
    bool *by_copy = (bool *)calloc((size_t)n + 1, sizeof(bool));
    for (int k = 0; k < 2; k++) {   // shard_masters without shard_updates; without read_by_copy
        tsys_ddp_desc md = {TSYS_DDP_BUCKETED, 0.01, false, true, k == 1, true, k == 0 ? by_copy : NULL};
        ddp = m ? tsys_ddp_new(g_d, tsys_model_params(m), n, &md) : NULL;
        const char *says = k == 0 ? "desc.shard_masters needs desc.shard_updates" : "desc.shard_masters needs desc.read_by_copy";
        TEST_CHECK(!ddp && strstr(tsys_ctx_last_error(g_ctx), says), "rank %d, case %d: '%s' (wanted a refusal naming '%s')", g_rank, k, tsys_ctx_last_error(g_ctx), says);
        tsys_ctx_clear_error(g_ctx);
        tsys_ddp_free(ddp);
    }
    free(by_copy);
    tsys_ddp_desc sd_desc = {TSYS_DDP_BUCKETED, 0.01, false, true, false, false, NULL, true};
    ddp = m ? tsys_ddp_new(g_d, tsys_model_params(m), n, &sd_desc) : NULL;
    TEST_CHECK(!ddp && strstr(tsys_ctx_last_error(g_ctx), "desc.shard_state needs desc.shard_updates"), "rank %d: shard_state alone: '%s'", g_rank, tsys_ctx_last_error(g_ctx));
    tsys_ctx_clear_error(g_ctx);
    tsys_ddp_free(ddp);
    tsys_ddp_desc flat = {TSYS_DDP_FLAT, 0};
    ddp = m ? tsys_ddp_new(g_d, tsys_model_params(m), n, &flat) : NULL;
    tsys_optim *opt = m ? tsys_adamw_new(g_ctx, tsys_model_params(m), n, NULL) : NULL;
    tsys_state_desc snap;
    memset(&snap, 0, sizeof snap);
    TEST_CHECK(ddp && opt && tsys_ddp_state_save(ddp, opt, "/nonexistent", &snap) != TSYS_OK && strstr(tsys_ctx_last_error(g_ctx), "made without desc.shard_state"),
               "rank %d: a sharded save without shard_state: '%s'", g_rank, tsys_ctx_last_error(g_ctx));
    tsys_ctx_clear_error(g_ctx);
    tsys_optim_free(opt);
    tsys_ddp_free(ddp);
    td.opt_in_backward = true; td.ddp.shard_masters = true;
    t = m ? tsys_dist_trainer_new(g_ctx, g_d, m, g_dev, &td) : NULL;
    TEST_CHECK(!t && strstr(tsys_ctx_last_error(g_ctx), "desc.ddp.shard_masters needs ddp.shard_updates and lowp_copies"), "rank %d: masters without copies: '%s'",
               g_rank, tsys_ctx_last_error(g_ctx));
    tsys_ctx_clear_error(g_ctx);
    tsys_dist_trainer_free(t);
    tsys_model_free(m);
}

// desc.ddp.shard_masters (2 GPU ranks through NCCL): after a step the matmul weights a peer updates are out of date
// here - a read of one to the host fails naming it, and only those fail (the others, the norms and the embedding,
// came as fp32) - until tsys_ddp_sync_params, after which every rank's weights are the same bits; the next step
// leaves them out of date again. Every block is checkpointed, so backward's recomputes must read the copies too
// (a read of an out-of-date weight fails the step). The bits themselves: trainer_ddp_opt_in_backward's masters case.
TSYS_TEST(ddp_shard_masters_stale_until_synced) {
    if (g_dev != TSYS_CUDA || g_world != 2 || tsys_dist_engine_of(g_d) != TSYS_DIST_ENGINE_NCCL) {
        if (g_rank == 0) printf("(at 2 GPU ranks through NCCL only) ");
        return;
    }
    tsys_model_desc d = state_model_desc();
    d.checkpoint = "blocks:1";
    tsys_model *m = tsys_model_new(g_ctx, &d, g_dev, 21);
    tsys_dist_trainer_desc td;
    memset(&td, 0, sizeof td);
    td.mode = TSYS_TRAIN_DDP; td.ddp.strategy = TSYS_DDP_BUCKETED; td.ddp.bucket_mb = 0.01; td.ddp.ce_gather = true; td.ddp.shard_updates = true;
    td.ddp.shard_masters = true; td.autocast = TSYS_BF16; td.lowp_copies = true; td.lowp_grads = true; td.opt_in_backward = true;
    tsys_dist_trainer *t = m ? tsys_dist_trainer_new(g_ctx, g_d, m, g_dev, &td) : NULL;
    const int r0 = STATE_ROWS * g_rank / g_world, r1 = STATE_ROWS * (g_rank + 1) / g_world;
    tsys_tensor *ids = NULL, *tgt = NULL;
    state_batch(g_ctx, 0, r0, r1, &ids, &tgt);
    TEST_CHECK(t && ids && tgt, "rank %d: trainer: %s", g_rank, tsys_ctx_last_error(g_ctx));
    if (!state_all(t && ids && tgt)) { tsys_tensor_release(ids); tsys_tensor_release(tgt); state_drop(t, m); return; }
    const int n = tsys_model_num_tensors(m);
    float *host = (float *)malloc(sizeof(float) * (size_t)tsys_model_num_params(m));
    for (int round = 0; round < 3; round++) {   // after a step; after the sync; after the next step
        if (round != 1) TEST_CHECK(tsys_dist_trainer_step(t, ids, tgt, NULL) == TSYS_OK, "rank %d: step: %s", g_rank, tsys_ctx_last_error(g_ctx));
        else TEST_CHECK(tsys_ddp_sync_params(tsys_dist_trainer_ddp(t)) == TSYS_OK, "rank %d: sync: %s", g_rank, tsys_ctx_last_error(g_ctx));
        int stale = 0, wrong = 0;
        double sum = 0;
        for (int i = 0; host && i < n; i++) {
            tsys_tensor *p = tsys_model_params(m)[i];
            if (tsys_tensor_to_host(g_ctx, p, host) != TSYS_OK) {
                stale++;
                wrong += !tsys_model_matmul_weight(m, p) || !strstr(tsys_ctx_last_error(g_ctx), p->name) || !strstr(tsys_ctx_last_error(g_ctx), "out of date");
                tsys_ctx_clear_error(g_ctx);
                continue;
            }
            for (int64_t k = 0; k < tsys_tensor_numel(p); k++) sum += (double)host[k] * (double)((k % 7) + 1 + i);
        }
        TEST_CHECK(round == 1 ? stale == 0 : stale > 0, "rank %d, round %d: %d weights out of date", g_rank, round, stale);
        TEST_CHECK(wrong == 0, "rank %d, round %d: %d refused reads were not of an out-of-date matmul weight, named", g_rank, round, wrong);
        double lo = -sum, hi = sum;
        tsys_dist_all_reduce_host(g_d, &lo, 1, TSYS_DIST_MAX);
        tsys_dist_all_reduce_host(g_d, &hi, 1, TSYS_DIST_MAX);
        lo = -lo;
        if (round == 1) TEST_CHECK(lo == hi, "rank %d: after the sync the ranks' weights differ (checksums %.17g .. %.17g)", g_rank, lo, hi);
    }
    free(host);
    tsys_tensor_release(ids); tsys_tensor_release(tgt);
    state_drop(t, m);
}

// desc.ddp.shard_state (2 GPU ranks through NCCL, with shard_masters): each rank's AdamW holds about half the
// moments; the trainer's snapshots are sharded, each rank writing its buckets' weights and moments; resumed from
// step 2 they give step 4's state bitwise; tsys_ddp_sync_moments is refused, naming why.
TSYS_TEST(ddp_shard_state_sharded_resume) {
    if (g_dev != TSYS_CUDA || g_world != 2 || tsys_dist_engine_of(g_d) != TSYS_DIST_ENGINE_NCCL) {
        if (g_rank == 0) printf("(at 2 GPU ranks through NCCL only) ");
        return;
    }
    char dir[512];
    state_dir(dir, sizeof(dir), "owners");
    state_owners = true;
    const int64_t before = tsys_mem_stats_get(g_ctx, TSYS_CUDA).category_bytes[TSYS_MEM_OPTIMIZER];
    tsys_model *m;
    tsys_dist_trainer *t = state_trainer(g_ctx, TSYS_TRAIN_DDP, 7, &m);
    TEST_CHECK(t, "rank %d: trainer: %s", g_rank, tsys_ctx_last_error(g_ctx));
    if (state_all(t != NULL)) {
        const double held = (double)(tsys_mem_stats_get(g_ctx, TSYS_CUDA).category_bytes[TSYS_MEM_OPTIMIZER] - before), whole = 8.0 * (double)tsys_model_num_params(m);
        TEST_CHECK(held > 0.2 * whole && held < 0.8 * whole, "rank %d: the optimizer holds %.0f bytes, AdamW's whole moments are %.0f", g_rank, held, whole);
        TEST_CHECK(tsys_ddp_sync_moments(tsys_dist_trainer_ddp(t), NULL) == TSYS_ERR_INVALID_ARGS && strstr(tsys_ctx_last_error(g_ctx), "desc.shard_state: each rank holds"),
                   "rank %d: sync_moments: '%s'", g_rank, tsys_ctx_last_error(g_ctx));
        tsys_ctx_clear_error(g_ctx);
        state_steps(g_ctx, t, false, 0, 2);
        tsys_status s = state_save(t, dir, "a", 2);
        TEST_CHECK(s == TSYS_OK, "rank %d: save: %s", g_rank, tsys_ctx_last_error(g_ctx));
        state_steps(g_ctx, t, false, 2, 4);
        s = s == TSYS_OK ? state_save(t, dir, "a-4", 4) : s;
        TEST_CHECK(s == TSYS_OK, "rank %d: save at step 4: %s", g_rank, tsys_ctx_last_error(g_ctx));
        char part[700];
        snprintf(part, sizeof(part), "%s/a/rank-%05d.safetensors", dir, g_rank);
        TEST_CHECK(access(part, R_OK) == 0, "rank %d: no part of its own in the snapshot (%s)", g_rank, part);
        state_drop(t, m);
        if (state_all(s == TSYS_OK) && state_resume(g_ctx, TSYS_TRAIN_DDP, dir, "a", dir, "b-4")) state_same(g_ctx, dir, "a-4", "b-4", -1, "resumed from the sharded snapshot");
    } else state_drop(t, m);
    state_owners = false;
    state_procedure_end(g_ctx, dir);
}

// ---- main: every rank runs every test; rank 0 reports ---------------------------------------------

int main(int argc, char **argv) {
    (void)tsys_test_main;   // the harness's one-process runner; ranks need the loop below
    // test_ddp [--nproc N] [name-filter]: --nproc starts N ranks with the built-in launcher
    const char *filter = NULL;
    int nproc = 1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--nproc") && i + 1 < argc) nproc = atoi(argv[++i]);
        else filter = argv[i];
    }
    int code = 0;
    if (nproc > 1 && tsys_dist_spawn(nproc, argc, argv, &code)) return code;
    g_ctx = tsys_ctx_new(NULL);
    tsys_dist_desc desc;
    memset(&desc, 0, sizeof(desc));
#ifdef TSYS_WITH_CUDA
    desc.cuda = true;
    g_dev = TSYS_CUDA;
    // NCCL wants a GPU per rank: more ranks than GPUs share them through MPI with host staging
    const char *ws = getenv("OMPI_COMM_WORLD_SIZE") ? getenv("OMPI_COMM_WORLD_SIZE") : getenv("WORLD_SIZE");
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess) ndev = 0;
    if (ws && atoi(ws) > ndev) desc.engine = TSYS_DIST_ENGINE_MPI;
#endif
    g_d = tsys_dist_init(g_ctx, &desc);
    if (!g_d) {
        printf("tsys_dist_init: %s\n0 passed, 1 failed\n", tsys_ctx_last_error(g_ctx));
        return 1;
    }
    g_rank = tsys_dist_rank(g_d);
    g_world = tsys_dist_size(g_d);
    if (g_world > TOY_MAX_ROWS) {
        if (g_rank == 0) printf("test_ddp: at most %d ranks\n0 passed, 1 failed\n", TOY_MAX_ROWS);
        tsys_dist_free(g_d);
        return 1;
    }
    if (g_rank != 0) dup2(2, 1);   // only rank 0 writes the report; the others' failed checks go to stderr
    else printf("ranks: %d (%s), device %s\n", g_world, tsys_dist_engine_name(tsys_dist_engine_of(g_d)), g_dev == TSYS_CPU ? "cpu" : "cuda");
    int passed = 0, failed = 0;
    for (int i = 0; i < tsys__ntests; i++) {
        if (filter && !strstr(tsys__tests[i].name, filter)) continue;
        tsys__test_failed = 0;
        if (g_rank == 0) { printf("  %-44s ", tsys__tests[i].name); fflush(stdout); }
        tsys__tests[i].fn();
        tsys_ctx_clear_error(g_ctx);
        double f = tsys__test_failed ? 1 : 0;
        if (tsys_dist_all_reduce_host(g_d, &f, 1, TSYS_DIST_SUM) != TSYS_OK) f = g_world;
        if (f > 0) failed++; else passed++;
        if (g_rank == 0) { if (f > 0) printf("  -> FAILED on %.0f rank(s)\n", f); else printf("ok\n"); fflush(stdout); }
        else if (tsys__test_failed) { fprintf(stderr, "  [rank %d] %s FAILED\n", g_rank, tsys__tests[i].name); fflush(stderr); }
    }
    fflush(stdout);
    tsys_dist_barrier(g_d);
    if (g_rank == 0) { printf("%d passed, %d failed\n", passed, failed); fflush(stdout); }
    tsys_dist_free(g_d);
    tsys_ctx_free(g_ctx);
    return failed ? 1 : 0;
}
