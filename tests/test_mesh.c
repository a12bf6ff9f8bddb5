// test_mesh.c - sub-groups (tsys_dist_split) and the device mesh of tsys_dist.h. Run as many ranks as
// you like, on any engine:
//   build/test_mesh                      a group of one
//   mpirun -np 4 build/test_mesh         MPI ranks (sub-groups: MPI_Comm_split, shared memory on one host)
//   build/test_mesh --nproc 4            the built-in launcher (sub-groups: TCP stars, shared memory)
//   TSYS_DIST_SHM=0 ...                  the same without shared memory
//   build/test_mesh [--nproc N] [filter]
// Every check compares a sub-group's collective with the value computed from the ranks' known inputs:
// each rank of the world contributes a function of its world rank, so a result that mixed in a rank of
// another group, or missed one of its own, differs.
#define TSYS_PRELUDE_DIST
#include "../drivers/prelude.h"
#include "harness.h"
#include "harness_dist.h"

static tsys_ctx *g_ctx;
static tsys_dist *g_world;
static tsys_dist *g_cuda_world;   // CUDA builds with a GPU for every rank: the same ranks through NCCL
static int g_rank, g_size;

// the value world rank r puts at element i
static float val(int r, int64_t i) { return (float)((r + 1) * 10 + (int)(i % 7)); }

static tsys_tensor *filled(int64_t n, int r) {
    int64_t shape[1] = { n };
    tsys_tensor *t = tsys_tensor_new(g_ctx, TSYS_F32, TSYS_CPU, 1, shape);
    float *p = (float *)tsys_tensor_data(t);
    for (int64_t i = 0; i < n; i++) p[i] = val(r, i);
    return t;
}

// Whether the context's error mentions what; clears it (errors are sticky: the next check starts clean).
static bool error_says(const char *what) {
    bool yes = strstr(tsys_ctx_last_error(g_ctx), what) != NULL;
    if (!yes) printf("    rank %d: the error is '%s', not one that says '%s'\n", g_rank, tsys_ctx_last_error(g_ctx), what);
    tsys_ctx_clear_error(g_ctx);
    return yes;
}

// The world ranks of the group this rank joins with (color, key) when every world rank r passes
// (color_of(r), key_of(r)): ordered by key, then world rank. Returns the count; *me = this rank's place.
typedef int (*rank_fn)(int r);
static int members_of(rank_fn color_of, rank_fn key_of, int *members, int *me) {
    int n = 0;
    for (int r = 0; r < g_size; r++)
        if (color_of(r) == color_of(g_rank)) members[n++] = r;
    for (int i = 1; i < n; i++)   // insertion sort by key; equal keys keep world order
        for (int j = i; j > 0 && key_of(members[j - 1]) > key_of(members[j]); j--) { int t = members[j]; members[j] = members[j - 1]; members[j - 1] = t; }
    for (int i = 0; i < n; i++) if (members[i] == g_rank) *me = i;
    return n;
}

// Every collective of group s against its members' inputs.
static void check_collectives(tsys_dist *s, const int *members, int n, const char *what) {
    const int64_t count = 1001;
    // all-reduce: the sum over the members, in their order (small integers: exact)
    tsys_tensor *t = filled(count, g_rank);
    TEST_CHECK(tsys_dist_all_reduce(s, t, TSYS_DIST_SUM) == TSYS_OK, "%s: all_reduce: %s", what, tsys_ctx_last_error(g_ctx));
    int bad = 0;
    for (int64_t i = 0; i < count; i++) {
        float want = 0;
        for (int k = 0; k < n; k++) want += val(members[k], i);
        bad += ((float *)tsys_tensor_data(t))[i] != want;
    }
    TEST_CHECK(bad == 0, "%s: all_reduce: %d of %lld elements differ from the members' sum", what, bad, (long long)count);
    tsys_tensor_release(t);
    // all-gather: the members' blocks in the group's order
    tsys_tensor *in = filled(count, g_rank);
    int64_t oshape[1] = { count * n };
    tsys_tensor *out = tsys_tensor_new(g_ctx, TSYS_F32, TSYS_CPU, 1, oshape);
    TEST_CHECK(tsys_dist_all_gather(s, out, in) == TSYS_OK, "%s: all_gather: %s", what, tsys_ctx_last_error(g_ctx));
    bad = 0;
    for (int k = 0; k < n; k++)
        for (int64_t i = 0; i < count; i++) bad += ((float *)tsys_tensor_data(out))[k * count + i] != val(members[k], i);
    TEST_CHECK(bad == 0, "%s: all_gather: %d elements out of place", what, bad);
    // reduce-scatter: block k of the sum on the group's rank k
    tsys_tensor *rs_in = filled(count * n, g_rank), *rs_out = filled(count, g_rank);
    TEST_CHECK(tsys_dist_reduce_scatter(s, rs_out, rs_in, TSYS_DIST_SUM) == TSYS_OK, "%s: reduce_scatter: %s", what, tsys_ctx_last_error(g_ctx));
    bad = 0;
    const int me = tsys_dist_rank(s);
    for (int64_t i = 0; i < count; i++) {
        float want = 0;
        for (int k = 0; k < n; k++) want += val(members[k], me * count + i);
        bad += ((float *)tsys_tensor_data(rs_out))[i] != want;
    }
    TEST_CHECK(bad == 0, "%s: reduce_scatter: %d elements differ", what, bad);
    // broadcast from the group's last rank
    tsys_tensor *b = filled(count, g_rank);
    TEST_CHECK(tsys_dist_broadcast(s, b, n - 1) == TSYS_OK, "%s: broadcast: %s", what, tsys_ctx_last_error(g_ctx));
    bad = 0;
    for (int64_t i = 0; i < count; i++) bad += ((float *)tsys_tensor_data(b))[i] != val(members[n - 1], i);
    TEST_CHECK(bad == 0, "%s: broadcast from the group's rank %d (world rank %d): %d elements differ", what, n - 1, members[n - 1], bad);
    TEST_CHECK(tsys_dist_barrier(s) == TSYS_OK, "%s: barrier: %s", what, tsys_ctx_last_error(g_ctx));
    double h[2] = { (double)g_rank, 1.0 }, want_h = 0;
    for (int k = 0; k < n; k++) want_h += members[k];
    TEST_CHECK(tsys_dist_all_reduce_host(s, h, 2, TSYS_DIST_SUM) == TSYS_OK && h[0] == want_h && h[1] == n, "%s: all_reduce_host %g %g, want %g %d", what, h[0], h[1], want_h, n);
    tsys_tensor_release(in); tsys_tensor_release(out); tsys_tensor_release(rs_in); tsys_tensor_release(rs_out); tsys_tensor_release(b);
}

// Splits the world by (color_of, key_of) and checks the group's shape and collectives.
static void check_split(rank_fn color_of, rank_fn key_of, const char *what) {
    int members[64], me = -1;
    const int n = members_of(color_of, key_of, members, &me);
    tsys_dist *s = tsys_dist_split(g_world, color_of(g_rank), key_of(g_rank), what);
    TEST_CHECK(s != NULL, "%s: %s", what, tsys_ctx_last_error(g_ctx));
    if (!s) return;
    TEST_CHECK(tsys_dist_size(s) == n && tsys_dist_rank(s) == me, "%s: rank %d of %d, want %d of %d", what, tsys_dist_rank(s), tsys_dist_size(s), me, n);
    TEST_CHECK(tsys_dist_local_size(s) >= 1 && tsys_dist_local_size(s) <= n && tsys_dist_local_rank(s) < tsys_dist_local_size(s), "%s: local rank %d of %d",
               what, tsys_dist_local_rank(s), tsys_dist_local_size(s));
    TEST_CHECK(n > 1 ? tsys_dist_engine_of(s) == tsys_dist_engine_of(g_world) : tsys_dist_engine_of(s) == TSYS_DIST_ENGINE_SELF || tsys_dist_engine_of(s) == TSYS_DIST_ENGINE_MPI,
               "%s: engine %s (the world's: %s)", what, tsys_dist_engine_name(tsys_dist_engine_of(s)), tsys_dist_engine_name(tsys_dist_engine_of(g_world)));
    if (tsys_dist_rank(s) == tsys_dist_size(s) - 1) TEST_CHECK(members[n - 1] == g_rank, "%s: last member", what);
    check_collectives(s, members, n, what);
    tsys_dist_free(s);
}

static int parity(int r) { return r % 2; }
static int reversed(int r) { return g_size - r; }
static int zero(int r) { (void)r; return 0; }
static int itself(int r) { return r; }
static int halves(int r) { return r < g_size / 2; }
static int same_key(int r) { (void)r; return 5; }

// ---- tests ---------------------------------------------------------------------------------------

TSYS_TEST(split_by_parity_reversed) { check_split(parity, reversed, "parity"); }
TSYS_TEST(split_one_group_keeps_order) { check_split(zero, itself, "all"); }
TSYS_TEST(split_equal_keys_keep_world_order) { check_split(halves, same_key, "halves"); }
TSYS_TEST(split_groups_of_one) { check_split(itself, zero, "self"); }

TSYS_TEST(split_then_split_again) {   // a group of a group: the halves, then parity within each
    int members[64], me = -1;
    tsys_dist *h = tsys_dist_split(g_world, halves(g_rank), g_rank, "half");
    TEST_CHECK(h != NULL, "%s", tsys_ctx_last_error(g_ctx));
    if (!h) return;
    tsys_dist *q = tsys_dist_split(h, tsys_dist_rank(h) % 2, 0, "quarter");
    TEST_CHECK(q != NULL, "%s", tsys_ctx_last_error(g_ctx));
    if (q) {   // the world ranks of this rank's half with the same parity of rank in the half
        int hm[64], hn = members_of(halves, itself, hm, &me), n = 0;
        for (int k = 0; k < hn; k++) if (k % 2 == tsys_dist_rank(h) % 2) members[n++] = hm[k];
        TEST_CHECK(tsys_dist_size(q) == n, "size %d, want %d", tsys_dist_size(q), n);
        check_collectives(q, members, n, "quarter");
        tsys_dist_free(q);
    }
    tsys_dist_free(h);
}

TSYS_TEST(groups_are_independent) {   // a group's collectives in flight while the world runs its own
    int members[64], me = -1;
    const int n = members_of(parity, itself, members, &me);
    tsys_dist *s = tsys_dist_split(g_world, parity(g_rank), g_rank, "async");
    TEST_CHECK(s != NULL, "%s", tsys_ctx_last_error(g_ctx));
    if (!s) return;
    tsys_tensor *a = filled(70000, g_rank), *w = filled(5000, g_rank);
    tsys_dist_work *wk = tsys_dist_all_reduce_async(s, a, TSYS_DIST_SUM);
    TEST_CHECK(wk != NULL, "%s", tsys_ctx_last_error(g_ctx));
    TEST_CHECK(tsys_dist_all_reduce(g_world, w, TSYS_DIST_SUM) == TSYS_OK, "%s", tsys_ctx_last_error(g_ctx));
    if (wk) TEST_CHECK(tsys_dist_wait(wk) == TSYS_OK, "%s", tsys_ctx_last_error(g_ctx));
    int bad = 0;
    for (int64_t i = 0; i < 70000; i++) { float want = 0; for (int k = 0; k < n; k++) want += val(members[k], i); bad += ((float *)tsys_tensor_data(a))[i] != want; }
    for (int64_t i = 0; i < 5000; i++) { float want = 0; for (int r = 0; r < g_size; r++) want += val(r, i); bad += ((float *)tsys_tensor_data(w))[i] != want; }
    TEST_CHECK(bad == 0, "%d elements differ", bad);
    tsys_tensor_release(a); tsys_tensor_release(w);
    tsys_dist_free(s);
}

TSYS_TEST(split_refuses_bad_input_on_every_rank) {
    // the last rank passes a negative color: every rank gets NULL, naming it, and the world stays in step
    tsys_dist *s = tsys_dist_split(g_world, g_rank == g_size - 1 ? -1 : 0, 0, NULL);
    TEST_CHECK(s == NULL, "a negative color was accepted");
    char want[64];
    snprintf(want, sizeof want, "rank %d passed color -1", g_size - 1);
    TEST_CHECK(error_says(want), "negative color");
    tsys_dist_free(s);
    s = tsys_dist_split(g_world, 0, 0, g_rank == 0 ? "a_name_that_is_longer_than_31_characters" : "ok");
    TEST_CHECK(s == NULL && error_says("rank 0 passed a name of 40 characters"), "long name");
    tsys_dist_free(s);
    TEST_CHECK(tsys_dist_barrier(g_world) == TSYS_OK, "the world after refused splits: %s", tsys_ctx_last_error(g_ctx));
}

TSYS_TEST(split_errors_carry_the_group_name) {   // a sub-group's own errors say which group
    tsys_dist *s = tsys_dist_split(g_world, 0, 0, "tp");
    TEST_CHECK(s != NULL, "%s", tsys_ctx_last_error(g_ctx));
    if (!s) return;
    TEST_CHECK(tsys_dist_broadcast(s, NULL, 0) != TSYS_OK && error_says("group 'tp' rank"), "a sub-group's error");
    tsys_dist_free(s);
}

// The mesh that fits this many ranks: 2 x size/2 when even (dp x tp), else size x 1.
static void mesh_shape(int *shape) { shape[0] = g_size % 2 == 0 ? g_size / 2 : g_size; shape[1] = g_size % 2 == 0 ? 2 : 1; }

TSYS_TEST(mesh_2d_groups) {
    int shape[2];
    mesh_shape(shape);
    const char *names[2] = { "dp", "tp" };
    tsys_dist_mesh *m = tsys_dist_mesh_new(g_world, 2, shape, names);
    TEST_CHECK(m != NULL, "%s", tsys_ctx_last_error(g_ctx));
    if (!m) return;
    const int dp = g_rank / shape[1], tp = g_rank % shape[1];   // row-major: the last dimension fastest
    TEST_CHECK(tsys_dist_mesh_ndim(m) == 2 && tsys_dist_mesh_coord(m, "dp") == dp && tsys_dist_mesh_coord(m, "tp") == tp, "coords %d %d, want %d %d",
               tsys_dist_mesh_coord(m, "dp"), tsys_dist_mesh_coord(m, "tp"), dp, tp);
    TEST_CHECK(tsys_dist_mesh_dim_size(m, "dp") == shape[0] && tsys_dist_mesh_dim_size(m, "tp") == shape[1] && tsys_dist_mesh_dim_size(m, "pp") == -1, "dim sizes");
    TEST_CHECK(tsys_dist_mesh_coord(m, "pp") == -1 && tsys_dist_mesh_group(m, "pp") == NULL && error_says("no dimension 'pp'"), "unknown dimension");
    tsys_dist *gt = tsys_dist_mesh_group(m, "tp"), *gd = tsys_dist_mesh_group(m, "dp");
    TEST_CHECK(gt && gd && tsys_dist_rank(gt) == tp && tsys_dist_size(gt) == shape[1] && tsys_dist_rank(gd) == dp && tsys_dist_size(gd) == shape[0], "group ranks");
    int mt[64], md[64];
    for (int k = 0; k < shape[1]; k++) mt[k] = dp * shape[1] + k;   // my row
    for (int k = 0; k < shape[0]; k++) md[k] = k * shape[1] + tp;   // my column
    if (gt) check_collectives(gt, mt, shape[1], "mesh tp");
    if (gd) check_collectives(gd, md, shape[0], "mesh dp");
    tsys_dist_mesh_free(m);
}

TSYS_TEST(mesh_3d_of_ones) {   // dimensions of size 1 are groups of one
    int shape[3] = { 1, g_size, 1 };
    const char *names[3] = { "pp", "dp", "tp" };
    tsys_dist_mesh *m = tsys_dist_mesh_new(g_world, 3, shape, names);
    TEST_CHECK(m != NULL, "%s", tsys_ctx_last_error(g_ctx));
    if (!m) return;
    TEST_CHECK(tsys_dist_size(tsys_dist_mesh_group(m, "pp")) == 1 && tsys_dist_size(tsys_dist_mesh_group(m, "tp")) == 1 &&
               tsys_dist_size(tsys_dist_mesh_group(m, "dp")) == g_size && tsys_dist_rank(tsys_dist_mesh_group(m, "dp")) == g_rank, "sizes");
    int all[64];
    for (int r = 0; r < g_size; r++) all[r] = r;
    check_collectives(tsys_dist_mesh_group(m, "dp"), all, g_size, "mesh 1 x n x 1");
    tsys_dist_mesh_free(m);
}

TSYS_TEST(mesh_refuses_bad_shapes) {   // on every rank alike, naming the input
    const char *names[2] = { "dp", "tp" }, *same[2] = { "dp", "dp" }, *bad[2] = { "dp", "t-p" };
    int over[2] = { g_size, 2 }, shape[2], zero_dim[2] = { g_size, 0 };
    mesh_shape(shape);
    struct { int ndim; const int *shape; const char *const *names; const char *says; } cases[] = {
        { 2, over, names, "is not the group's" }, { 0, shape, names, "ndim 0" }, { 5, shape, names, "ndim 5" }, { 2, shape, same, "are both 'dp'" },
        { 2, shape, bad, "names[1] 't-p'" }, { 2, zero_dim, names, "shape[1] = 0" }, { 2, NULL, names, "must not be NULL" },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        tsys_dist_mesh *m = tsys_dist_mesh_new(g_world, cases[i].ndim, cases[i].shape, cases[i].names);
        TEST_CHECK(m == NULL && error_says(cases[i].says), "case %zu %s", i, m ? "accepted" : "refused");
        tsys_dist_mesh_free(m);
    }
    // ranks that disagree on the names: every rank refuses
    const char *mine[2] = { "dp", g_rank == 0 ? "tp" : "mp" };
    tsys_dist_mesh *m = tsys_dist_mesh_new(g_world, 2, shape, mine);
    TEST_CHECK(g_size == 1 ? m != NULL : m == NULL && error_says("different shapes or names"), "ranks that disagree: %s", m ? "accepted" : "refused");
    tsys_dist_mesh_free(m);
    TEST_CHECK(tsys_dist_barrier(g_world) == TSYS_OK, "the world after refused meshes: %s", tsys_ctx_last_error(g_ctx));
}

// ---- tensor parallelism --------------------------------------------------------------------------

// A model whose heads (12), d_ff (96) and vocabulary (96) split over 1, 2, 3 or 4 ranks.
static tsys_model_desc tiny_desc(void) {
    tsys_model_desc d;
    memset(&d, 0, sizeof d);
    d.vocab_size = 96; d.context_length = 16; d.d_model = 48; d.num_layers = 2; d.num_heads = 12; d.d_ff = 96; d.attn = "naive";
    return d;
}
enum { TP_STEPS = 5, TP_B = 2, TP_T = 16 };
static tsys_dtype g_autocast = TSYS_F32;   // the runs below under bf16 autocast when set
static bool g_sequence_parallel;           // and with sequence parallelism when set

// Batch `which` of the run (every rank makes the same ones).
static void tp_batch(int which, tsys_tensor **ids, tsys_tensor **targets, int b, tsys_device dev) {
    int64_t shape[2] = { b, TP_T };
    int32_t v[2][64 * TP_T];
    uint64_t x = 0x9e3779b97f4a7c15ull * (uint64_t)(which + 1);
    for (int i = 0; i < b * TP_T; i++)
        for (int k = 0; k < 2; k++) { x ^= x << 13; x ^= x >> 7; x ^= x << 17; v[k][i] = (int32_t)(x % 96); }
    *ids = tsys_tensor_from_data(g_ctx, TSYS_I32, dev, 2, shape, v[0]);
    *targets = tsys_tensor_from_data(g_ctx, TSYS_I32, dev, 2, shape, v[1]);
}

// One process: TP_STEPS AdamW steps of the full model on the whole batch of each step (dp replicas' micro-batches
// side by side): the losses, and the model after them.
// AdamW (lr 1e-3) or SGD (lr 0.1): SGD's update is linear in the gradient, AdamW divides each by its own size
static tsys_optim *make_optim(tsys_tensor **params, int n, bool sgd) { return sgd ? tsys_sgd_new(g_ctx, params, n, 0.1f) : tsys_adamw_new(g_ctx, params, n, NULL); }

// parts > 1: each step's batch in `parts` slices of rows, each slice's loss / parts run backward on its own and
// the gradients accumulated: the same step in exact arithmetic, summed in another order (the reference's own
// rounding noise).
static tsys_model *reference_run_ex(int dp, bool sgd, tsys_device dev, float *losses, int parts) {
    tsys_model_desc d = tiny_desc();
    tsys_model *m = tsys_model_new(g_ctx, &d, dev, 7);
    tsys_optim *opt = make_optim(tsys_model_params(m), tsys_model_num_tensors(m), sgd);
    for (int s = 0; s < TP_STEPS; s++) {
        tsys_tensor *ids, *targets;
        tp_batch(s, &ids, &targets, TP_B * dp, dev);
        const int64_t rows = TP_B * dp / parts;
        int64_t shape[2] = { rows, TP_T };
        losses[s] = 0;
        for (int p = 0; p < parts; p++) {
            tsys_tensor *pi = tsys_tensor_view_raw(g_ctx, ids, (size_t)(p * rows * TP_T * 4), TSYS_I32, 2, shape),
                        *pt = tsys_tensor_view_raw(g_ctx, targets, (size_t)(p * rows * TP_T * 4), TSYS_I32, 2, shape);
            if (g_autocast != TSYS_F32) tsys_autocast_begin(g_ctx, g_autocast);
            tsys_tensor *logits = tsys_model_forward(m, pi), *mean = tsys_cross_entropy(g_ctx, logits, pt), *loss = parts > 1 ? tsys_scale(g_ctx, mean, 1.0f / parts) : mean;
            if (g_autocast != TSYS_F32) tsys_autocast_end(g_ctx);
            losses[s] += tsys_item(g_ctx, loss);
            tsys_backward(g_ctx, loss);
            if (loss != mean) tsys_tensor_release(loss);
            tsys_tensor_release(logits); tsys_tensor_release(mean); tsys_tensor_release(pi); tsys_tensor_release(pt);
        }
        tsys_optim_step(opt);
        tsys_optim_zero_grad(opt);
        tsys_tensor_release(ids); tsys_tensor_release(targets);
    }
    tsys_optim_free(opt);
    return m;
}
static tsys_model *reference_run(int dp, bool sgd, tsys_device dev, float *losses) { return reference_run_ex(dp, sgd, dev, losses, 1); }

// ||a - b|| / ||b|| over all the models' parameters (*worst: the largest over single tensors, *which its name).
static double model_rel_diff(tsys_model *a, tsys_model *b, double *worst, const char **which) {
    double num_all = 0, den_all = 0;
    *worst = 0;
    for (int i = 0; i < tsys_model_num_tensors(a); i++) {
        tsys_tensor *x = tsys_model_params(a)[i], *y = tsys_model_params(b)[i];
        int64_t n = tsys_tensor_numel(x);
        float *p = (float *)malloc(sizeof(float) * (size_t)n), *q = (float *)malloc(sizeof(float) * (size_t)n);
        tsys_tensor_to_f32(g_ctx, x, p); tsys_tensor_to_f32(g_ctx, y, q);
        double num = 0, den = 0;
        for (int64_t k = 0; k < n; k++) { num += ((double)p[k] - q[k]) * ((double)p[k] - q[k]); den += (double)q[k] * q[k]; }
        if (sqrt(num) / (sqrt(den) + 1e-30) > *worst) { *worst = sqrt(num) / (sqrt(den) + 1e-30); *which = x->name; }
        num_all += num; den_all += den;
        free(p); free(q);
    }
    return sqrt(num_all) / (sqrt(den_all) + 1e-30);
}

// Tensor parallelism over tp (with data parallelism over dp through DDP when dp is given): TP_STEPS steps against
// the one-process run on the combined batch, losses within relative 1e-6 and parameters within fp32 noise.
// SGD, linear in the gradient, is held to 1e-6 per tensor (measured 3e-8: the gradients agree). AdamW divides each
// gradient by its own running size, so an element whose gradients nearly cancel across steps carries the
// reduction-order noise of the split matmuls up to lr x its relative size: held to 3e-6 over the model and 3e-5
// per tensor. Measured on the 2 x 48-wide model: tp over 2 and 4 ranks 1.2e-6 over the model and 1.1e-5 in one
// tensor (layers.0's w2), on 1 and 2 OpenBLAS threads alike; dp x tp and fsdp x tp (2 x 2, twice the batch)
// 1.3e-8 and 5.8e-8; the one process against itself with its batch summed row by row (the message's floor) 2.1e-7.
static void check_tp_ex(tsys_dist *tp, tsys_dist *dp, bool fsdp, bool sgd, tsys_device dev, const char *what);
static void check_tp(tsys_dist *tp, tsys_dist *dp, bool sgd, tsys_device dev, const char *what) { check_tp_ex(tp, dp, false, sgd, dev, what); }
// dp (DDP, or FSDP with fsdp) over tensor-parallel replicas
static void check_tp_ex(tsys_dist *tp, tsys_dist *dp, bool fsdp, bool sgd, tsys_device dev, const char *what) {
    const int ndp = dp ? tsys_dist_size(dp) : 1, rdp = dp ? tsys_dist_rank(dp) : 0;
    float want[TP_STEPS], got[TP_STEPS];
    tsys_model *ref = reference_run(ndp, sgd, dev, want);
    tsys_model_desc d = tiny_desc();
    tsys_model *full = tsys_model_new(g_ctx, &d, dev, 7);
    tsys_tp_model *m = tsys_tp_model_new(tp, full);
    TEST_CHECK(m != NULL, "%s: %s", what, tsys_ctx_last_error(g_ctx));
    if (!m) { tsys_model_free(ref); tsys_model_free(full); return; }
    tsys_tp_model_set_sequence_parallel(m, g_sequence_parallel);
    tsys_ddp_desc dd;
    memset(&dd, 0, sizeof dd);
    dd.strategy = TSYS_DDP_BUCKETED;
    tsys_ddp *ddp = dp && !fsdp ? tsys_ddp_new(dp, tsys_tp_model_params(m), tsys_tp_model_num_tensors(m), &dd) : NULL;
    tsys_fsdp *fs = dp && fsdp ? tsys_fsdp_new(dp, tsys_tp_model_params(m), tsys_tp_model_num_tensors(m), NULL) : NULL;
    TEST_CHECK(!dp || ddp || fs, "%s: %s", what, tsys_ctx_last_error(g_ctx));
    tsys_optim *opt = fs ? make_optim(tsys_fsdp_params(fs), tsys_fsdp_num_params(fs), sgd) : make_optim(tsys_tp_model_params(m), tsys_tp_model_num_tensors(m), sgd);
    for (int s = 0; s < TP_STEPS; s++) {
        tsys_tensor *ids, *targets, *mids, *mtargets;
        tp_batch(s, &ids, &targets, TP_B * ndp, dev);   // this replica's rows of the combined batch
        int64_t shape[2] = { TP_B, TP_T };
        mids = tsys_tensor_view_raw(g_ctx, ids, (size_t)rdp * TP_B * TP_T * 4, TSYS_I32, 2, shape);
        mtargets = tsys_tensor_view_raw(g_ctx, targets, (size_t)rdp * TP_B * TP_T * 4, TSYS_I32, 2, shape);
        if (ddp) tsys_ddp_start_step(ddp);
        if (g_autocast != TSYS_F32) tsys_autocast_begin(g_ctx, g_autocast);
        tsys_tensor *loss = tsys_tp_model_loss(m, mids, mtargets);
        if (g_autocast != TSYS_F32) tsys_autocast_end(g_ctx);
        double l = loss ? tsys_item(g_ctx, loss) : NAN;
        if (dp) tsys_dist_all_reduce_host(dp, &l, 1, TSYS_DIST_AVG);
        got[s] = (float)l;
        tsys_backward(g_ctx, loss);
        if (ddp) tsys_ddp_finish(ddp);
        if (fs) tsys_fsdp_finish(fs);
        tsys_optim_step(opt);
        tsys_optim_zero_grad(opt);
        tsys_tensor_release(loss); tsys_tensor_release(ids); tsys_tensor_release(targets); tsys_tensor_release(mids); tsys_tensor_release(mtargets);
    }
    TEST_CHECK(tsys_ctx_status(g_ctx) == TSYS_OK, "%s: %s", what, tsys_ctx_last_error(g_ctx));
    const double tol = g_autocast == TSYS_F32 ? 1e-6 : 2e-3;   // bf16: measured 3e-4 at 1-4 ranks (the row-parallel sums and the bf16 input gradients round differently)
    for (int s = 0; s < TP_STEPS; s++)
        TEST_CHECK(fabs(got[s] - want[s]) <= tol * fabs(want[s]), "%s: step %d loss %.9g, one process %.9g (relative %.2e)", what, s, got[s], want[s], fabs(got[s] - want[s]) / fabs(want[s]));
    tsys_optim_free(opt);
    tsys_fsdp_free(fs);   // the tensor-parallel parameters whole again
    TEST_CHECK(tsys_tp_model_gather(m, full) == TSYS_OK, "%s: gather: %s", what, tsys_ctx_last_error(g_ctx));
    double worst = 0;
    const char *which = "";
    double diff = model_rel_diff(full, ref, &worst, &which);
    if (g_autocast == TSYS_F32) {
        float again[TP_STEPS];
        double floor_worst = 0;
        const char *floor_which = "";
        tsys_model *reordered = reference_run_ex(ndp, sgd, dev, again, TP_B * ndp);
        const double floor = model_rel_diff(reordered, ref, &floor_worst, &floor_which);
        tsys_model_free(reordered);
        TEST_CHECK(diff <= (sgd ? 1e-6 : 3e-6) && worst <= (sgd ? 1e-6 : 3e-5),
                   "%s: parameters after %d %s steps differ from one process's by %.2e over the model, %.2e in %s (relative; the one "
                   "process's own noise, its batch summed row by row: %.2e, %.2e in %s)", what, TP_STEPS, sgd ? "SGD" : "AdamW", diff, worst, which, floor, floor_worst, floor_which);
    }
    tsys_ddp_free(ddp);
    tsys_tp_model_free(m);
    tsys_model_free(full); tsys_model_free(ref);
}

TSYS_TEST(tp_adamw_steps_equal_one_process) { check_tp(g_world, NULL, false, TSYS_CPU, "tp over the world"); }
TSYS_TEST(tp_sgd_steps_equal_one_process) { check_tp(g_world, NULL, true, TSYS_CPU, "tp over the world"); }
// Under bf16 autocast (the normed inputs cast once, their gradients all-reduced in bf16): the losses follow the
// one-process run's within bf16 rounding.
TSYS_TEST(tp_bf16_autocast_follows_one_process) {
    g_autocast = TSYS_BF16;
    check_tp(g_world, NULL, false, TSYS_CPU, "tp under bf16 autocast");
    g_autocast = TSYS_F32;
}

// Sequence parallelism: the norms and residual adds on each rank's rows of the batch, all-gathered into the
// tensor-parallel regions and reduce-scattered out of them; the same steps as the all-reduces' within fp32 noise.
// With tokens (2 x 16) that do not split over the ranks (3) the loss is refused on every rank, naming them.
static void check_tp_sp(tsys_dist *world, bool sgd, tsys_device dev, const char *what) {
    if ((TP_B * TP_T) % tsys_dist_size(world)) {
        tsys_model_desc d = tiny_desc();
        tsys_model *full = tsys_model_new(g_ctx, &d, dev, 7);
        tsys_tp_model *m = full ? tsys_tp_model_new(world, full) : NULL;
        tsys_tensor *ids, *targets;
        tp_batch(0, &ids, &targets, TP_B, dev);
        tsys_tp_model_set_sequence_parallel(m, true);
        tsys_tensor *loss = m ? tsys_tp_model_loss(m, ids, targets) : NULL;
        TEST_CHECK(m && !loss && error_says("sequence parallelism splits the 32 tokens (batch 2 x sequence 16) over 3 ranks"), "%s: %s", what, tsys_ctx_last_error(g_ctx));
        tsys_ctx_clear_error(g_ctx);
        tsys_tensor_release(loss); tsys_tensor_release(ids); tsys_tensor_release(targets);
        tsys_tp_model_free(m); tsys_model_free(full);
        return;
    }
    g_sequence_parallel = true;
    check_tp(world, NULL, sgd, dev, what);
    g_sequence_parallel = false;
}
TSYS_TEST(tp_sequence_parallel_adamw_equals_one_process) { check_tp_sp(g_world, false, TSYS_CPU, "tp + sequence parallelism"); }
TSYS_TEST(tp_sequence_parallel_sgd_equals_one_process) { check_tp_sp(g_world, true, TSYS_CPU, "tp + sequence parallelism, SGD"); }
TSYS_TEST(tp_sequence_parallel_bf16_follows_one_process) {
    g_autocast = TSYS_BF16;
    check_tp_sp(g_world, false, TSYS_CPU, "tp + sequence parallelism under bf16 autocast");
    g_autocast = TSYS_F32;
}

// The dp x tp mesh of mesh_shape over world (NULL after a failed check).
static tsys_dist_mesh *dp_tp_mesh(tsys_dist *world) {
    int shape[2];
    mesh_shape(shape);
    const char *names[2] = { "dp", "tp" };
    tsys_dist_mesh *mesh = tsys_dist_mesh_new(world, 2, shape, names);
    TEST_CHECK(mesh != NULL, "dp x tp mesh: %s", tsys_ctx_last_error(g_ctx));
    return mesh;
}

// dp x tp: DDP (or FSDP) over dp of tensor-parallel replicas
static void check_dp_tp_ex(tsys_dist *world, bool fsdp, tsys_device dev, const char *what) {
    tsys_dist_mesh *mesh = dp_tp_mesh(world);
    if (!mesh) return;
    check_tp_ex(tsys_dist_mesh_group(mesh, "tp"), tsys_dist_mesh_group(mesh, "dp"), fsdp, false, dev, what);
    tsys_dist_mesh_free(mesh);
}
static void check_dp_tp(tsys_dist *world, tsys_device dev, const char *what) { check_dp_tp_ex(world, false, dev, what); }
static void check_hsdp(tsys_dist *world, tsys_device dev);   // below, with its test
TSYS_TEST(tp_inside_dp_mesh_equals_one_process) { check_dp_tp(g_world, TSYS_CPU, "dp x tp"); }
TSYS_TEST(tp_inside_fsdp_mesh_equals_one_process) { check_dp_tp_ex(g_world, true, TSYS_CPU, "fsdp x tp"); }
TSYS_TEST(tp_sequence_parallel_inside_fsdp_mesh_equals_one_process) {
    g_sequence_parallel = true;
    check_dp_tp_ex(g_world, true, TSYS_CPU, "fsdp x (tp + sequence parallelism)");
    g_sequence_parallel = false;
}

#ifdef TSYS_WITH_CUDA
// The same through NCCL, CUDA tensors, one GPU a rank, against one GPU.
TSYS_TEST(tp_nccl_equals_one_gpu) {
    TEST_CHECK(g_cuda_world != NULL, "no GPU for every rank (test_mesh_cuda runs on a GPU machine)");
    if (!g_cuda_world) return;
    TEST_CHECK(tsys_dist_engine_of(g_cuda_world) == TSYS_DIST_ENGINE_NCCL || g_size == 1, "engine %s", tsys_dist_engine_name(tsys_dist_engine_of(g_cuda_world)));
    check_tp(g_cuda_world, NULL, false, TSYS_CUDA, "tp through NCCL");
    check_tp(g_cuda_world, NULL, true, TSYS_CUDA, "tp through NCCL, SGD");
    check_dp_tp(g_cuda_world, TSYS_CUDA, "dp x tp through NCCL");
    check_dp_tp_ex(g_cuda_world, true, TSYS_CUDA, "fsdp x tp through NCCL");
    check_hsdp(g_cuda_world, TSYS_CUDA);
    check_tp_sp(g_cuda_world, false, TSYS_CUDA, "tp + sequence parallelism through NCCL");
    g_autocast = TSYS_BF16;
    check_tp_sp(g_cuda_world, false, TSYS_CUDA, "tp + sequence parallelism through NCCL under bf16 autocast");
    g_autocast = TSYS_F32;
}

TSYS_TEST(split_nccl_groups_reduce_their_members) {   // CUDA tensors through the sub-groups' own communicators
    TEST_CHECK(g_cuda_world != NULL, "no GPU for every rank");
    if (!g_cuda_world) return;
    int members[64], me = -1;
    const int n = members_of(parity, reversed, members, &me);
    tsys_dist *s = tsys_dist_split(g_cuda_world, parity(g_rank), reversed(g_rank), "gpu parity");
    TEST_CHECK(s != NULL, "%s", tsys_ctx_last_error(g_ctx));
    if (!s) return;
    TEST_CHECK(tsys_dist_engine_of(s) == (n > 1 ? TSYS_DIST_ENGINE_NCCL : TSYS_DIST_ENGINE_SELF), "engine %s", tsys_dist_engine_name(tsys_dist_engine_of(s)));
    tsys_tensor *h = filled(100000, g_rank), *t = tsys_tensor_to(g_ctx, h, TSYS_CUDA);
    TEST_CHECK(tsys_dist_all_reduce(s, t, TSYS_DIST_SUM) == TSYS_OK, "%s", tsys_ctx_last_error(g_ctx));
    TEST_CHECK(tsys_tensor_to_f32(g_ctx, t, (float *)tsys_tensor_data(h)) == TSYS_OK, "%s", tsys_ctx_last_error(g_ctx));
    int bad = 0;
    for (int64_t i = 0; i < 100000; i++) { float want = 0; for (int k = 0; k < n; k++) want += val(members[k], i); bad += ((float *)tsys_tensor_data(h))[i] != want; }
    TEST_CHECK(bad == 0, "%d elements differ from the members' sum", bad);
    tsys_tensor_release(h); tsys_tensor_release(t);
    tsys_dist_free(s);
}
#endif

TSYS_TEST(tp_refuses_shapes_it_cannot_split) {
    if (g_size == 1) return;   // everything splits over one rank
    tsys_model_desc d = tiny_desc();
    d.num_heads = g_size == 2 ? 3 : 2; d.d_model = 6 * d.num_heads; d.d_ff = 5 * g_size + 1;   // heads or d_ff not a multiple
    tsys_model *full = tsys_model_new(g_ctx, &d, TSYS_CPU, 7);
    tsys_tp_model *m = tsys_tp_model_new(g_world, full);
    TEST_CHECK(m == NULL && error_says("is not a multiple of the tensor-parallel size"), "%s", m ? "accepted" : "refused");
    tsys_tp_model_free(m);
    tsys_model_free(full);
}

// HSDP: FSDP inside each "shard" group, its shards' gradients averaged over the "replicate" groups by DDP;
// every rank its own micro-batch, against one process on all of them.
TSYS_TEST(hsdp_equals_one_process) { check_hsdp(g_world, TSYS_CPU); }
static void check_hsdp(tsys_dist *world, tsys_device dev) {
    int shape[2];
    mesh_shape(shape);
    const char *names[2] = { "replicate", "shard" };
    tsys_dist_mesh *mesh = tsys_dist_mesh_new(world, 2, shape, names);
    TEST_CHECK(mesh != NULL, "%s", tsys_ctx_last_error(g_ctx));
    if (!mesh) return;
    float want[TP_STEPS], got[TP_STEPS];
    tsys_model *ref = reference_run(g_size, false, dev, want);
    tsys_model_desc d = tiny_desc();
    tsys_model *m = tsys_model_new(g_ctx, &d, dev, 7);
    tsys_fsdp *fs = tsys_fsdp_new(tsys_dist_mesh_group(mesh, "shard"), tsys_model_params(m), tsys_model_num_tensors(m), NULL);
    tsys_ddp_desc dd;
    memset(&dd, 0, sizeof dd);
    dd.strategy = TSYS_DDP_FLAT;
    tsys_ddp *ddp = fs ? tsys_ddp_new(tsys_dist_mesh_group(mesh, "replicate"), tsys_fsdp_params(fs), tsys_fsdp_num_params(fs), &dd) : NULL;
    TEST_CHECK(fs && ddp, "%s", tsys_ctx_last_error(g_ctx));
    tsys_optim *opt = ddp ? make_optim(tsys_fsdp_params(fs), tsys_fsdp_num_params(fs), false) : NULL;
    for (int s = 0; opt && s < TP_STEPS; s++) {
        tsys_tensor *ids, *targets;
        tp_batch(s, &ids, &targets, TP_B * g_size, dev);
        int64_t sh[2] = { TP_B, TP_T };
        tsys_tensor *mids = tsys_tensor_view_raw(g_ctx, ids, (size_t)g_rank * TP_B * TP_T * 4, TSYS_I32, 2, sh);
        tsys_tensor *mtargets = tsys_tensor_view_raw(g_ctx, targets, (size_t)g_rank * TP_B * TP_T * 4, TSYS_I32, 2, sh);
        tsys_ddp_start_step(ddp);
        tsys_tensor *logits = tsys_model_forward(m, mids), *loss = tsys_cross_entropy(g_ctx, logits, mtargets);
        double l = loss ? tsys_item(g_ctx, loss) : NAN;
        tsys_dist_all_reduce_host(world, &l, 1, TSYS_DIST_AVG);
        got[s] = (float)l;
        tsys_backward(g_ctx, loss);
        tsys_fsdp_finish(fs);
        tsys_ddp_finish(ddp);
        tsys_optim_step(opt);
        tsys_optim_zero_grad(opt);
        tsys_tensor_release(logits); tsys_tensor_release(loss); tsys_tensor_release(ids); tsys_tensor_release(targets); tsys_tensor_release(mids); tsys_tensor_release(mtargets);
    }
    TEST_CHECK(tsys_ctx_status(g_ctx) == TSYS_OK, "%s", tsys_ctx_last_error(g_ctx));
    for (int s = 0; opt && s < TP_STEPS; s++)
        TEST_CHECK(fabs(got[s] - want[s]) <= 1e-6 * fabs(want[s]), "step %d loss %.9g, one process %.9g", s, got[s], want[s]);
    tsys_optim_free(opt);
    tsys_ddp_free(ddp);
    tsys_fsdp_free(fs);   // the model whole again
    double worst = 0;
    const char *which = "";
    double diff = model_rel_diff(m, ref, &worst, &which);
    TEST_CHECK(diff <= 1e-6 && worst <= 1e-5, "parameters differ from one process's by %.2e over the model, %.2e in %s", diff, worst, which);
    tsys_model_free(m); tsys_model_free(ref);
    tsys_dist_mesh_free(mesh);
}

// ---- the cost model ------------------------------------------------------------------------------

TSYS_TEST(plan_matches_hand_computed_section_8_numbers) {   // the small model: 128,625,408 parameters
    tsys_model_desc d;
    tsys_model_desc_preset("small", &d, NULL, 0);
    const double P = 128625408.0, W = 1e11, C = 1e14;
    tsys_dist_plan a = tsys_dist_plan_step(&d, TSYS_LAYOUT_DP, 4, 1, 4, 256, TSYS_F32, C, W);
    TEST_CHECK(a.dp_sent_bytes == 771752448.0 && fabs(a.dp_comm_ms - 7.71752448) < 1e-9 && a.tp_sent_bytes == 0 && a.weight_bytes == 16 * P,
               "dp: sent %.0f (all-reduce 2 x 3/4 x 4P = 771752448), %.6f ms, weights %.0f", a.dp_sent_bytes, a.dp_comm_ms, a.weight_bytes);
    a = tsys_dist_plan_step(&d, TSYS_LAYOUT_DP, 4, 1, 4, 256, TSYS_BF16, C, W);   // DDP's gradients stay fp32 under autocast
    TEST_CHECK(a.dp_sent_bytes == 771752448.0, "dp under bf16: sent %.0f, DDP all-reduces fp32 gradients", a.dp_sent_bytes);
    a = tsys_dist_plan_step(&d, TSYS_LAYOUT_FSDP, 4, 1, 4, 256, TSYS_BF16, C, W);
    TEST_CHECK(a.dp_sent_bytes == 578814336.0 && a.weight_bytes == 4 * P, "fsdp: sent %.0f (3 x 3/4 x 2P = 578814336), weights %.0f (16P/4)", a.dp_sent_bytes, a.weight_bytes);
    // tp 2: 4 all-reduces a block and the head's, each of 4 x 256 x 768 bf16 = 1572864 bytes, of which a rank sends
    // all, and the embedding's fp32 rows (twice that); a rank holds half of the matmuls and of the embedding
    // ((120926208 + 7680000) / 2) and the 25 norms' 768 gains
    a = tsys_dist_plan_step(&d, TSYS_LAYOUT_TP, 1, 2, 4, 256, TSYS_BF16, C, W);
    TEST_CHECK(a.tp_sent_bytes == 51 * 1572864.0 && a.dp_sent_bytes == 0 && a.weight_bytes == 16 * 64322304.0,
               "tp: sent %.0f (51 x 1572864), weights %.0f (16 x (128606208 / 2 + 19200))", a.tp_sent_bytes, a.weight_bytes);
    TEST_CHECK(fabs(a.flops - tsys_model_flops(&d, 4, 256, true) / 2) < 1 && fabs(a.compute_ms - a.flops / C * 1e3) < 1e-9, "tp flops %.0f", a.flops);
    // fsdp 2 x tp 2: what a tp rank holds (64322304 parameters) over dp, beside tp's traffic
    a = tsys_dist_plan_step(&d, TSYS_LAYOUT_FSDP_TP, 2, 2, 4, 256, TSYS_BF16, C, W);
    TEST_CHECK(a.dp_sent_bytes == 3 * 0.5 * 64322304.0 * 2 && a.tp_sent_bytes == 51 * 1572864.0 && fabs(a.comm_ms - (a.dp_sent_bytes + a.tp_sent_bytes) / W * 1e3) < 1e-9,
               "fsdp_tp: dp %.0f tp %.0f", a.dp_sent_bytes, a.tp_sent_bytes);
    // latency-bound links (1 ms a collective, bandwidth without limit): the layouts' collective counts
    const tsys_dist_link_model slow = { 1.0, 1e30 };
    a = tsys_dist_plan_step_links(&d, TSYS_LAYOUT_DP, 4, 1, 4, 256, TSYS_F32, C, slow, slow);
    TEST_CHECK(a.dp_comm_ms == 5.0, "dp: %g ms, want 5 (514501632 gradient bytes in 100 MiB buckets)", a.dp_comm_ms);
    a = tsys_dist_plan_step_links(&d, TSYS_LAYOUT_FSDP_TP, 2, 2, 4, 256, TSYS_BF16, C, slow, slow);
    TEST_CHECK(a.dp_comm_ms == 67.0 && a.tp_comm_ms == 52.0, "fsdp_tp: %g + %g ms, want 67 (3 x 14 units + 25 norm gains) + 52 (4 x 12 + 4)", a.dp_comm_ms, a.tp_comm_ms);
    // a finite link: each collective its alpha plus its bytes (0.5 ms, 1e8 bytes a ms)
    const tsys_dist_link_model mid = { 0.5, 1e8 };
    a = tsys_dist_plan_step_links(&d, TSYS_LAYOUT_FSDP_TP, 2, 2, 4, 256, TSYS_BF16, C, mid, mid);
    TEST_CHECK(fabs(a.tp_comm_ms - (52 * 0.5 + 51 * 1572864.0 / 1e8)) < 1e-9 && fabs(a.dp_comm_ms - (67 * 0.5 + 3 * 0.5 * 64322304.0 * 2 / 1e8)) < 1e-9,
               "fsdp_tp on a 0.5 ms + 100 GB/s link: %.6f + %.6f ms, want 52 x 0.5 + 80216064 / 1e8 and 67 x 0.5 + 192966912 / 1e8", a.tp_comm_ms, a.dp_comm_ms);
    // FSDP's gathers and reduce-scatters on links of their own: 28 all-gathers of 2 x 1/2 x 64322304 x 2 bytes in
    // all at 0.25 ms + 5e7 bytes a ms, 14 reduce-scatters of half that at 0.125 ms + 2.5e7, the 25 gains' all-reduces
    // on the group's link (0.5 ms each)
    tsys_dist_plan_in in;
    memset(&in, 0, sizeof in);
    in.model = &d; in.layout = TSYS_LAYOUT_FSDP_TP; in.dp = 2; in.tp = 2; in.batch = 4; in.context = 256; in.dtype = TSYS_BF16; in.flops_per_s = C;
    in.dp_link = in.tp_link = mid;
    in.dp_gather = (tsys_dist_link_model){ 0.25, 5e7 }; in.dp_scatter = (tsys_dist_link_model){ 0.125, 2.5e7 };
    a = tsys_dist_plan_of(&in);
    const double unit = 0.5 * 64322304.0 * 2;
    TEST_CHECK(fabs(a.dp_comm_ms - (28 * 0.25 + 2 * unit / 5e7 + 14 * 0.125 + unit / 2.5e7 + 25 * 0.5)) < 1e-9 && a.dp_sent_bytes == 3 * unit,
               "fsdp_tp with its own gather and scatter links: %.6f ms", a.dp_comm_ms);
    // sequence parallelism's over tp: 50 all-gathers and 50 reduce-scatters of half of the 51 all-reduces' bytes (and
    // the head's fp32 rows'), 27 all-reduces (the 25 gains, the loss's 2) on the group's link
    in.layout = TSYS_LAYOUT_TP; in.dp = 1; in.sequence_parallel = true; in.dp_gather = in.dp_scatter = (tsys_dist_link_model){ 0, 0 };
    in.tp_gather = (tsys_dist_link_model){ 0.25, 5e7 }; in.tp_scatter = (tsys_dist_link_model){ 0.125, 2.5e7 };
    a = tsys_dist_plan_of(&in);
    const double half = (51 * 1572864.0) / 2, gains = 25 * 768 * 4.0;
    TEST_CHECK(fabs(a.tp_comm_ms - (50 * 0.25 + half / 5e7 + 50 * 0.125 + half / 2.5e7 + 27 * 0.5 + gains / 1e8)) < 1e-9,
               "tp_sp with its own gather and scatter links: %.6f ms", a.tp_comm_ms);
    a = tsys_dist_plan_step(&d, TSYS_LAYOUT_DP, 0, 1, 4, 256, TSYS_F32, C, W);
    TEST_CHECK(a.flops == 0 && a.comm_ms == 0, "a plan for 0 ranks is all zeros");
    TEST_CHECK(!strcmp(tsys_dist_layout_name(TSYS_LAYOUT_FSDP_TP), "fsdp_tp") && !strcmp(tsys_dist_layout_name((tsys_dist_layout)99), "?"), "names");
}

// The plan's memory against the tracker: one fp32 AdamW step of tsys_tp_model over the world, CPU tensors. The
// model is big enough that the predicted terms dominate what the formula leaves out (the step's short-lived
// temporaries, the batch itself): within 10%.
static void check_plan_memory_ex(tsys_dist *tp, tsys_dist *dp, bool sp, const char *what);
static void check_plan_memory(tsys_dist *tp, tsys_dist *dp, const char *what) { check_plan_memory_ex(tp, dp, false, what); }
static void check_plan_memory_ex(tsys_dist *tp, tsys_dist *dp, bool sp, const char *what) {
    tsys_model_desc d;
    memset(&d, 0, sizeof d);
    d.vocab_size = 1200; d.context_length = 64; d.d_model = 96; d.num_layers = 2; d.num_heads = 12; d.d_ff = 384; d.attn = "naive";
    const int B = 12, ntp = tsys_dist_size(tp), ndp = dp ? tsys_dist_size(dp) : 1;
    tsys_model *full = tsys_model_new(g_ctx, &d, TSYS_CPU, 7);
    tsys_tp_model *m = full ? tsys_tp_model_new(tp, full) : NULL;
    tsys_model_free(full);   // the shards are copies: what a rank holds is the tp model's
    tsys_tp_model_set_sequence_parallel(m, sp);
    tsys_fsdp *fs = m && dp ? tsys_fsdp_new(dp, tsys_tp_model_params(m), tsys_tp_model_num_tensors(m), NULL) : NULL;
    TEST_CHECK(m && (!dp || fs), "%s: %s", what, tsys_ctx_last_error(g_ctx));
    if (!m || (dp && !fs)) { tsys_tp_model_free(m); return; }
    tsys_optim *opt = fs ? tsys_adamw_new(g_ctx, tsys_fsdp_params(fs), tsys_fsdp_num_params(fs), NULL) : tsys_adamw_new(g_ctx, tsys_tp_model_params(m), tsys_tp_model_num_tensors(m), NULL);
    int64_t shape[2] = { B, d.context_length };
    tsys_tensor *ids = tsys_tensor_new(g_ctx, TSYS_I32, TSYS_CPU, 2, shape), *targets = tsys_tensor_new(g_ctx, TSYS_I32, TSYS_CPU, 2, shape);
    tsys_tensor_fill(g_ctx, ids, 3.0f);
    tsys_tensor_fill(g_ctx, targets, 5.0f);
    for (int s = 0; s < 2; s++) {   // the first step allocates AdamW's moments: the peak of the second is a step's
        if (s == 1) tsys_mem_reset_peak(g_ctx, TSYS_CPU);
        tsys_tensor *loss = tsys_tp_model_loss(m, ids, targets);
        tsys_backward(g_ctx, loss);
        if (fs) tsys_fsdp_finish(fs);
        tsys_optim_step(opt);
        tsys_optim_zero_grad(opt);
        tsys_tensor_release(loss);
    }
    TEST_CHECK(tsys_ctx_status(g_ctx) == TSYS_OK, "%s: step: %s", what, tsys_ctx_last_error(g_ctx));
    const double peak = (double)tsys_mem_stats_get(g_ctx, TSYS_CPU).peak_bytes;
    tsys_dist_plan_in in;
    memset(&in, 0, sizeof in);
    in.model = &d; in.layout = dp ? TSYS_LAYOUT_FSDP_TP : TSYS_LAYOUT_TP; in.dp = ndp; in.tp = ntp; in.batch = B; in.context = d.context_length;
    in.dtype = TSYS_F32; in.flops_per_s = 1e12; in.sequence_parallel = sp;
    const tsys_dist_plan p = tsys_dist_plan_of(&in);
    // tp, with or without sequence parallelism: -0.02% to -0.07% at 1-4 ranks (the batch's ids and targets are
    // not the model's; at 4 ranks sequence parallelism's peak is 10.7% below tp's). fsdp x tp: the working set is
    // counted whole (a gathered unit beside the embedding's gradient, as tsys_fsdp_accounting counts it) while
    // the tracked peak falls where part of it is free: +3.7% at 3 x 1, +3.2% at 2 x 2 on this small model (2.7B,
    // bf16, 2 x 2 on GPUs: -0.8%)
    const double tol = dp && ndp > 1 ? 0.10 : 0.02;
    TEST_CHECK(fabs(p.peak_bytes / peak - 1) <= tol, "%s: predicted peak %.0f bytes (weights %.0f, activations %.0f), tracked %.0f (%+.2f%%)", what,
               p.peak_bytes, p.weight_bytes, p.act_bytes, peak, 100 * (p.peak_bytes / peak - 1));
    tsys_tensor_release(ids); tsys_tensor_release(targets);
    tsys_optim_free(opt);
    tsys_fsdp_free(fs);
    tsys_tp_model_free(m);
}

// The plan's memory against the tracker: two fp32 AdamW steps, CPU tensors, the second's peak.
TSYS_TEST(plan_memory_matches_the_tracked_peak_tp) { check_plan_memory(g_world, NULL, "tp over the world"); }
TSYS_TEST(plan_memory_matches_the_tracked_peak_tp_sequence_parallel) {   // the norms' activations / tp
    check_plan_memory_ex(g_world, NULL, true, "tp + sequence parallelism");
}
TSYS_TEST(plan_memory_matches_the_tracked_peak_fsdp_tp) {
    tsys_dist_mesh *mesh = dp_tp_mesh(g_world);
    if (!mesh) return;
    check_plan_memory(tsys_dist_mesh_group(mesh, "tp"), tsys_dist_mesh_group(mesh, "dp"), "fsdp x tp");
    tsys_dist_mesh_free(mesh);
}

int main(int argc, char **argv) {
    int nproc = 1;
    const char *filter = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--nproc") && i + 1 < argc) nproc = atoi(argv[++i]);
        else if (argv[i][0] == '-') { fprintf(stderr, "usage: test_mesh [--nproc N] [filter]\n"); return 2; }
        else filter = argv[i];
    }
    int code = 0;
    if (tsys_dist_spawn(nproc, argc, argv, &code)) return code;
    g_ctx = tsys_ctx_new(NULL);
    g_world = tsys_dist_init(g_ctx, NULL);
    if (!g_world) { fprintf(stderr, "%s\n", tsys_ctx_last_error(g_ctx)); return 1; }
    g_rank = tsys_dist_rank(g_world); g_size = tsys_dist_size(g_world);
    if (g_size > 64) { if (g_rank == 0) fprintf(stderr, "test_mesh: at most 64 ranks\n"); return 2; }
#ifdef TSYS_WITH_CUDA
    {   // a GPU for every rank: the same ranks again, through NCCL
        int gpus = tsys_cuda_device_count();
        double short_of_gpus = gpus > 0 && gpus >= tsys_dist_local_size(g_world) ? 0 : 1;
        tsys_dist_all_reduce_host(g_world, &short_of_gpus, 1, TSYS_DIST_MAX);
        if (short_of_gpus == 0) {
            tsys_dist_desc cd;
            memset(&cd, 0, sizeof cd);
            cd.cuda = true;
            g_cuda_world = tsys_dist_init(g_ctx, &cd);
            if (!g_cuda_world) { fprintf(stderr, "%s\n", tsys_ctx_last_error(g_ctx)); return 1; }
        }
    }
#endif
    if (g_rank == 0) printf("test_mesh: %d rank(s), engine %s%s\n", g_size, tsys_dist_engine_name(tsys_dist_engine_of(g_world)), tsys_dist_get_desc(g_world).no_shm ? ", no shared memory" : "");
    int rc = tsys_test_main_dist(filter, g_world);
    tsys_dist_free(g_cuda_world);
    tsys_dist_free(g_world);
    tsys_ctx_free(g_ctx);
    return rc;
}
