// test_hooks.c - the places later features plug into: the kernel contract (every kernel runs on the
// CPU; launches that break the table are refused), trace hooks and ranges, events, and gradient-ready
// hooks that compose.
#define TSYS_IMPLEMENTATION
#include "../tsys.h"
#include "harness.h"
#include "test_util.h"

// ---- the kernel contract ----------------------------------------------------------------------

TSYS_TEST(every_kernel_runs_on_the_cpu) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    test_kernel_count c;
    tsys_status st = test_run_every_kernel(ctx, TSYS_CPU, &c);
    TEST_CHECK(st == TSYS_OK, "workload failed: %s", tsys_ctx_last_error(ctx));
    for (int k = 0; k < TSYS_K_COUNT; k++)
        TEST_CHECK(c.ok[k] > 0, "kernel %s never ran on the cpu", tsys_kernel_name((tsys_kernel)k));
    TEST_CHECK(c.ok[TSYS_K_COUNT] > 0, "no GEMM ran");
    tsys_ctx_free(ctx);
}

TSYS_TEST(launches_are_checked_against_the_contract) {
#if TSYS_DEBUG
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t n = 8;
    tsys_tensor *y = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, &n), *x = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, &n);
    tsys_tensor *ids = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 1, &n);
    tsys_tensor_set_name(y, "y"); tsys_tensor_set_name(x, "x"); tsys_tensor_set_name(ids, "ids");
    tsys_tensor_fill(ctx, x, 1.0f);
    // launches that break the table, made through the library's one launch path (the ops above it
    // check their own inputs first, so these shapes only reach it from a bug in tsys itself)
    struct { const char *what, *expect; tsys_kernel k; tsys_tensor *t[4]; } bad[] = {
        {"missing input", "t[1] is NULL", TSYS_K_SCALE, {y, NULL, NULL, NULL}},
        {"extra slot", "t[2] ('x') is given, the kernel takes 2", TSYS_K_SCALE, {y, x, x, NULL}},
        {"ids where a float goes", "t[1] ('ids') is i32, the kernel needs a float tensor", TSYS_K_RELU_FWD, {y, ids, NULL, NULL}},
        {"float targets", "t[3] ('x') is f32, the kernel needs an i32/i64 tensor", TSYS_K_CE_FWD, {y, y, x, x}},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        tsys_ctx_clear_error(ctx);
        tsys_tensor_fill(ctx, y, -3.0f);
        tsys_kargs a;
        memset(&a, 0, sizeof(a));
        for (int j = 0; j < 4; j++) a.t[j] = bad[i].t[j];
        tsys_status st = tsys__kernel(ctx, TSYS_CPU, bad[i].k, &a);
        TEST_CHECK(st == TSYS_ERR_INVALID_ARGS, "%s: status %d", bad[i].what, (int)st);
        TEST_CHECK(strstr(tsys_ctx_last_error(ctx), bad[i].expect) != NULL, "%s: message '%s'", bad[i].what, tsys_ctx_last_error(ctx));
        TEST_CHECK(strstr(tsys_ctx_last_error(ctx), tsys_kernel_name(bad[i].k)) != NULL, "%s: message does not name the kernel", bad[i].what);
        float v[8];
        tsys_tensor_to_f32(ctx, y, v);
        TEST_CHECK(v[0] == -3.0f && v[7] == -3.0f, "%s: the refused launch wrote its output (%g)", bad[i].what, v[0]);
    }
    tsys_tensor_release(y); tsys_tensor_release(x); tsys_tensor_release(ids);
    tsys_ctx_free(ctx);
#endif
}

// ---- trace hooks --------------------------------------------------------------------------------

typedef struct trace_log {
    int depth, max_depth, begins, ends, backward_nodes, kernels, mem_events;
    int64_t mem_sum;
    char seq[2048];
} trace_log;
static void tl_begin(tsys_ctx *ctx, const char *name, tsys_trace_kind kind, void *u) {
    (void)ctx;
    trace_log *l = (trace_log *)u;
    l->begins++; l->depth++;
    if (l->depth > l->max_depth) l->max_depth = l->depth;
    if (kind == TSYS_TRACE_BACKWARD) l->backward_nodes++;
    size_t o = strlen(l->seq);
    snprintf(l->seq + o, sizeof(l->seq) - o, "%s%s%s ", kind == TSYS_TRACE_BACKWARD ? "~" : "", kind == TSYS_TRACE_RANGE ? "[" : "", name);
}
static void tl_end(tsys_ctx *ctx, const char *name, tsys_trace_kind kind, void *u) { (void)ctx; (void)name; (void)kind; trace_log *l = (trace_log *)u; l->ends++; l->depth--; }
static void tl_kernel(tsys_ctx *ctx, const tsys_trace_kernel *k, void *u) { (void)ctx; trace_log *l = (trace_log *)u; l->kernels++; if (k->t_end_us < k->t_begin_us) l->kernels = -1000; }
static void tl_mem(tsys_ctx *ctx, const tsys_mem_event *e, void *u) { (void)ctx; trace_log *l = (trace_log *)u; l->mem_events++; l->mem_sum += e->delta; }

TSYS_TEST(trace_hooks_see_ops_backward_nodes_ranges_kernels_and_memory) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    trace_log log;
    memset(&log, 0, sizeof(log));
    tsys_trace_hooks h = {tl_begin, tl_end, tl_kernel, tl_mem, &log, NULL};
    tsys_trace_hooks prev = tsys_ctx_set_trace_hooks(ctx, &h);
    TEST_CHECK(prev.op_begin == NULL && prev.kernel == NULL, "a fresh context has hooks installed");
    int64_t sx[2] = {4, 8}, sw[2] = {8, 8};
    tsys_tensor *x = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 2, sx), *w = test_param(ctx, TSYS_CPU, 2, sw, 0.3f);
    tsys_tensor_randn(ctx, x, 1);
    int64_t live0 = tsys_mem_stats_get(ctx, TSYS_CPU).live_bytes, sum0 = log.mem_sum;
    tsys_trace_begin(ctx, "forward");
    tsys_tensor *y = tsys_linear(ctx, x, w, NULL), *z = tsys_silu(ctx, y), *loss = tsys_sum(ctx, z);
    tsys_trace_end(ctx);
    tsys_trace_begin(ctx, "backward");
    TEST_CHECK(tsys_backward(ctx, loss) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    tsys_trace_end(ctx);
    TEST_CHECK(strstr(log.seq, "[forward linear silu sum [backward ~sum ~silu ~linear") == log.seq ||
               strstr(log.seq, "[forward linear silu sum ") != NULL, "sequence: %s", log.seq);
    TEST_CHECK(strstr(log.seq, "[backward ~sum ~silu ~linear ") != NULL, "backward nodes in reverse: %s", log.seq);
    TEST_CHECK(log.begins == log.ends && log.depth == 0, "begins %d, ends %d", log.begins, log.ends);
    TEST_CHECK(log.max_depth == 2, "ops nest inside ranges: depth %d", log.max_depth);
    TEST_CHECK(log.backward_nodes == 3, "backward nodes %d, expected 3", log.backward_nodes);
    TEST_CHECK(log.kernels >= 6, "kernel hook calls %d (3 forward launches, 3+ backward)", log.kernels);
    TEST_CHECK(log.mem_sum - sum0 == tsys_mem_stats_get(ctx, TSYS_CPU).live_bytes - live0, "memory hook deltas %lld vs live change %lld",
               (long long)(log.mem_sum - sum0), (long long)(tsys_mem_stats_get(ctx, TSYS_CPU).live_bytes - live0));
    // ranges tag what they allocate
    tsys_trace_begin(ctx, "my phase");
    tsys_tensor *t = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 2, sx);
    tsys_trace_end(ctx);
    TEST_CHECK(tsys_mem_tag_bytes(ctx, tsys_mem_tag(ctx, "my phase"), TSYS_CPU) == 4 * 8 * 4, "range tag bytes %lld",
               (long long)tsys_mem_tag_bytes(ctx, tsys_mem_tag(ctx, "my phase"), TSYS_CPU));
    // removing returns what was installed; nothing fires afterwards
    tsys_trace_hooks mine = tsys_ctx_set_trace_hooks(ctx, NULL);
    TEST_CHECK(mine.op_begin == tl_begin && mine.user == &log, "set_trace_hooks did not return the installed hooks");
    int before = log.begins;
    tsys_tensor *z2 = tsys_silu(ctx, x);
    TEST_CHECK(log.begins == before, "a hook fired after removal");
    tsys_tensor *rel[7] = {x, w, y, z, loss, t, z2};
    for (int i = 0; i < 7; i++) tsys_tensor_release(rel[i]);
    tsys_ctx_free(ctx);
}

// ---- events -------------------------------------------------------------------------------------

TSYS_TEST(cpu_events_time_with_the_host_clock) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_event a, b;
    memset(&a, 0, sizeof(a)); memset(&b, 0, sizeof(b));
    TEST_CHECK(tsys_event_record(ctx, TSYS_CPU, TSYS_STREAM_COMPUTE, &a) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    double t0 = tsys_time_us();
    int64_t n = 1 << 20;
    tsys_tensor *x = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, &n);
    for (int i = 0; i < 20; i++) tsys_tensor_fill(ctx, x, (float)i);
    double host_ms = (tsys_time_us() - t0) * 1e-3;
    TEST_CHECK(tsys_event_record(ctx, TSYS_CPU, TSYS_STREAM_SIDE, &b) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    TEST_CHECK(tsys_event_wait(ctx, &b, TSYS_STREAM_COMPUTE) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    double ms = tsys_event_elapsed_ms(ctx, &a, &b);
    TEST_CHECK(ms >= host_ms && ms < host_ms + 50.0, "elapsed %g ms, host clock %g ms", ms, host_ms);
    TEST_CHECK(tsys_set_stream(ctx, TSYS_CPU, TSYS_STREAM_SIDE) == TSYS_STREAM_COMPUTE, "cpu has one stream");
    TEST_CHECK(tsys_event_record(ctx, TSYS_CPU, (tsys_stream)7, &a) == TSYS_ERR_INVALID_ARGS, "stream 7 accepted");
    tsys_ctx_clear_error(ctx);
    tsys_event_release(ctx, &a); tsys_event_release(ctx, &b);
    tsys_tensor_release(x);
    tsys_ctx_free(ctx);
}

// ---- gradient-ready hooks that compose ----------------------------------------------------------

typedef struct grad_log { char seq[256]; float grad_seen[4]; int ends; } grad_log;
typedef struct hook_tag { grad_log *log; const char *name; int slot; } hook_tag;
static void gh(tsys_ctx *ctx, tsys_tensor *p, void *u) {
    hook_tag *t = (hook_tag *)u;
    size_t o = strlen(t->log->seq);
    snprintf(t->log->seq + o, sizeof(t->log->seq) - o, "%s ", t->name);
    float *g = test_read(ctx, p->grad);
    t->log->grad_seen[t->slot] = g ? g[0] : NAN;
    free(g);
}
static void end_hook(tsys_ctx *ctx, void *u) {
    (void)ctx;
    grad_log *l = (grad_log *)u;
    l->ends++;
    size_t o = strlen(l->seq);
    snprintf(l->seq + o, sizeof(l->seq) - o, "END ");
}

TSYS_TEST(grad_hooks_compose_in_order_once_per_backward) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    grad_log log;
    memset(&log, 0, sizeof(log));
    int64_t sx[2] = {3, 4}, sw[2] = {4, 4};
    tsys_tensor *x = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 2, sx), *w0 = test_param(ctx, TSYS_CPU, 2, sw, 0.5f), *w1 = test_param(ctx, TSYS_CPU, 2, sw, 0.5f);
    tsys_tensor_randn(ctx, x, 1);
    hook_tag a = {&log, "w1.a", 0}, b = {&log, "w1.b", 1}, c = {&log, "w0", 2}, dead = {&log, "removed", 3};
    TEST_CHECK(tsys_tensor_add_grad_hook(w1, gh, &a) == TSYS_OK, "add");
    TEST_CHECK(tsys_tensor_add_grad_hook(w1, gh, &dead) == TSYS_OK, "add");
    TEST_CHECK(tsys_tensor_add_grad_hook(w1, gh, &b) == TSYS_OK, "add");
    TEST_CHECK(tsys_tensor_add_grad_hook(w0, gh, &c) == TSYS_OK, "add");
    TEST_CHECK(tsys_tensor_remove_grad_hook(w1, gh, &dead), "remove did not find the hook");
    TEST_CHECK(!tsys_tensor_remove_grad_hook(w1, gh, &dead), "removed twice");
    TEST_CHECK(tsys_ctx_add_backward_hook(ctx, end_hook, &log) == TSYS_OK, "backward hook");
    // w1 is used twice (tied): its hooks wait for the earlier use, then see the summed gradient
    tsys_tensor *h1 = tsys_linear(ctx, x, w1, NULL), *h2 = tsys_linear(ctx, h1, w0, NULL), *h3 = tsys_linear(ctx, h2, w1, NULL);
    tsys_tensor *loss = tsys_sum(ctx, h3);
    TEST_CHECK(tsys_backward(ctx, loss) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    TEST_CHECK(strcmp(log.seq, "w0 w1.a w1.b END ") == 0, "order '%s', expected 'w0 w1.a w1.b END '", log.seq);
    float *g1 = test_read(ctx, w1->grad), *g0 = test_read(ctx, w0->grad);
    TEST_CHECK(log.grad_seen[0] == g1[0] && log.grad_seen[1] == g1[0], "w1 hooks saw %g, %g; final %g", log.grad_seen[0], log.grad_seen[1], g1[0]);
    TEST_CHECK(log.grad_seen[2] == g0[0], "w0 hook saw %g, final %g", log.grad_seen[2], g0[0]);
    free(g1); free(g0);
    // a second backward fires each once more; set_grad_hook replaces all of a tensor's hooks
    tsys_tensor_set_grad_hook(w0, NULL, NULL);
    log.seq[0] = 0;
    tsys_tensor *h4 = tsys_linear(ctx, x, w1, NULL), *h5 = tsys_linear(ctx, h4, w0, NULL), *loss2 = tsys_sum(ctx, h5);
    TEST_CHECK(tsys_backward(ctx, loss2) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    TEST_CHECK(strcmp(log.seq, "w1.a w1.b END ") == 0, "second backward '%s'", log.seq);
    TEST_CHECK(log.ends == 2, "end hook ran %d times", log.ends);
    TEST_CHECK(tsys_ctx_remove_backward_hook(ctx, end_hook, &log), "remove backward hook");
    tsys_tensor *rel[10] = {x, w0, w1, h1, h2, h3, loss, h4, h5, loss2};
    for (int i = 0; i < 10; i++) tsys_tensor_release(rel[i]);
    tsys_ctx_free(ctx);
}

int main(int argc, char **argv) { return tsys_test_main(argc, argv); }

// ---- custom ops ---------------------------------------------------------------------------------

// cube: y = x^3, keeping x^2 for backward (its own value); double_it: y = 2x, keeping nothing.
static int g_cube_forwards;
static tsys_tensor *cube_fwd(tsys_ctx *ctx, tsys_tensor *const *ins, int n, tsys_tensor **saved, void *user) {
    (void)n; (void)user;
    g_cube_forwards++;
    *saved = tsys_mul(ctx, ins[0], ins[0]);
    return tsys_mul(ctx, *saved, ins[0]);
}
static tsys_status cube_bwd(tsys_ctx *ctx, tsys_tensor *g, tsys_tensor *const *ins, int n, tsys_tensor *saved, const bool *needs, tsys_tensor **grads, void *user) {
    (void)ins; (void)n; (void)user;
    if (!needs[0]) return TSYS_OK;
    tsys_tensor *t = tsys_mul(ctx, g, saved);
    grads[0] = tsys_scale(ctx, t, 3.0f);
    tsys_tensor_release(t);
    return ctx ? tsys_ctx_status(ctx) : TSYS_ERR_INVALID_ARGS;
}
static const tsys_custom_op cube_op = { "cube", cube_fwd, cube_bwd, 0, NULL };
static tsys_tensor *double_fwd(tsys_ctx *ctx, tsys_tensor *const *ins, int n, tsys_tensor **saved, void *user) { (void)n; (void)saved; (void)user; return tsys_scale(ctx, ins[0], 2.0f); }
static tsys_status double_bwd(tsys_ctx *ctx, tsys_tensor *g, tsys_tensor *const *ins, int n, tsys_tensor *saved, const bool *needs, tsys_tensor **grads, void *user) {
    (void)ins; (void)n; (void)saved; (void)user;
    if (needs[0]) grads[0] = tsys_scale(ctx, g, 2.0f);
    return TSYS_OK;
}
static const tsys_custom_op double_op = { "double", double_fwd, double_bwd, 0, NULL };
// product: y = a * b, keeping both inputs
static tsys_tensor *prod_fwd(tsys_ctx *ctx, tsys_tensor *const *ins, int n, tsys_tensor **saved, void *user) { (void)n; (void)saved; (void)user; return tsys_mul(ctx, ins[0], ins[1]); }
static tsys_status prod_bwd(tsys_ctx *ctx, tsys_tensor *g, tsys_tensor *const *ins, int n, tsys_tensor *saved, const bool *needs, tsys_tensor **grads, void *user) {
    (void)n; (void)saved; (void)user;
    if (needs[0]) grads[0] = tsys_mul(ctx, g, ins[1]);
    if (needs[1]) grads[1] = tsys_mul(ctx, g, ins[0]);
    return TSYS_OK;
}
static const tsys_custom_op prod_op = { "product", prod_fwd, prod_bwd, 3u, NULL };

// sum(double(cube(x)) * product(x, w)), its gradients by x and w
static void custom_grads(tsys_ctx *ctx, tsys_tensor *x, tsys_tensor *w, bool region, float *gx, float *gw, float *loss) {
    tsys_tensor *xw0[2] = { x, w };
    tsys_zero_grads(ctx, xw0, 2);
    if (region) tsys_checkpoint_begin(ctx);
    tsys_tensor *c = tsys_custom(ctx, &cube_op, &x, 1), *d = tsys_custom(ctx, &double_op, &c, 1);
    tsys_tensor *xw[2] = { x, w }, *p = tsys_custom(ctx, &prod_op, xw, 2), *m = tsys_mul(ctx, d, p);
    if (region) tsys_checkpoint_end(ctx);
    tsys_tensor *l = tsys_sum(ctx, m);
    *loss = tsys_item(ctx, l);
    tsys_backward(ctx, l);
    tsys_tensor_to_f32(ctx, x->grad, gx);
    tsys_tensor_to_f32(ctx, w->grad, gw);
    tsys_tensor_release(c); tsys_tensor_release(d); tsys_tensor_release(p); tsys_tensor_release(m); tsys_tensor_release(l);
}

TSYS_TEST(custom_ops_against_the_chain_rule_and_under_checkpointing) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t n = 37;
    tsys_tensor *x = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, &n), *w = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, &n);
    tsys_tensor_randn(ctx, x, 1.0f); tsys_tensor_randn(ctx, w, 1.0f);
    tsys_tensor_set_requires_grad(x, true); tsys_tensor_set_requires_grad(w, true);
    float xs[37], ws[37], gx[37], gw[37], gx2[37], gw2[37], loss, loss2;
    tsys_tensor_to_f32(ctx, x, xs); tsys_tensor_to_f32(ctx, w, ws);
    g_cube_forwards = 0;
    custom_grads(ctx, x, w, false, gx, gw, &loss);
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK && g_cube_forwards == 1, "%s (forwards %d)", tsys_ctx_last_error(ctx), g_cube_forwards);
    // loss = sum 2 x^4 w: d/dx = 8 x^3 w, d/dw = 2 x^4 (in double)
    double want = 0, ex = 0, ew = 0;
    for (int i = 0; i < 37; i++) {
        double a = xs[i], b = ws[i];
        want += 2 * a * a * a * a * b;
        ex = fmax(ex, fabs(gx[i] - 8 * a * a * a * b) / (1 + fabs(8 * a * a * a * b)));
        ew = fmax(ew, fabs(gw[i] - 2 * a * a * a * a) / (1 + fabs(2 * a * a * a * a)));
    }
    TEST_CHECK(fabs(loss - want) < 1e-5 * (1 + fabs(want)) && ex < 1e-5 && ew < 1e-5, "loss %g want %g; grad errors %g %g", loss, want, ex, ew);
    // in a checkpointed region the forward runs again in backward, and the gradients are the same bits
    g_cube_forwards = 0;
    custom_grads(ctx, x, w, true, gx2, gw2, &loss2);
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK && g_cube_forwards == 2, "%s (forwards %d, want 2)", tsys_ctx_last_error(ctx), g_cube_forwards);
    TEST_CHECK(loss2 == loss && !memcmp(gx, gx2, sizeof gx) && !memcmp(gw, gw2, sizeof gw), "checkpointed: loss %g vs %g, gradients differ", loss2, loss);
    tsys_tensor_release(x); tsys_tensor_release(w);
    tsys_ctx_free(ctx);
}

// forward returning its input; backward giving the wrong size
static tsys_tensor *same_fwd(tsys_ctx *ctx, tsys_tensor *const *ins, int n, tsys_tensor **saved, void *user) { (void)ctx; (void)n; (void)saved; (void)user; return tsys_tensor_retain(ins[0]); }
static tsys_status short_bwd(tsys_ctx *ctx, tsys_tensor *g, tsys_tensor *const *ins, int n, tsys_tensor *saved, const bool *needs, tsys_tensor **grads, void *user) {
    (void)g; (void)ins; (void)n; (void)saved; (void)needs; (void)user;
    int64_t k = 3;
    grads[0] = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, &k);
    return TSYS_OK;
}

TSYS_TEST(custom_ops_refuse_bad_contracts) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t n = 5;
    tsys_tensor *x = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, &n);
    tsys_tensor_fill(ctx, x, 1.0f);
    tsys_tensor_set_requires_grad(x, true);
    const tsys_custom_op same = { "same", same_fwd, double_bwd, 0, NULL }, short_grad = { "short", double_fwd, short_bwd, 0, NULL }, none = { "none", NULL, NULL, 0, NULL };
    tsys_tensor *y = tsys_custom(ctx, &same, &x, 1);
    TEST_CHECK(!y && strstr(tsys_ctx_last_error(ctx), "same: forward returned its input 0"), "%s", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(!tsys_custom(ctx, &none, &x, 1) && strstr(tsys_ctx_last_error(ctx), "none: forward and backward must both be given"), "%s", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(!tsys_custom(ctx, &double_op, &x, 0) && strstr(tsys_ctx_last_error(ctx), "double: 0 inputs, it takes 1 to 4"), "%s", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    y = tsys_custom(ctx, &short_grad, &x, 1);
    tsys_tensor *l = tsys_sum(ctx, y);
    TEST_CHECK(tsys_backward(ctx, l) != TSYS_OK && strstr(tsys_ctx_last_error(ctx), "short: backward's gradient for input 0 has 3 f32 elements, the input 5"), "%s", tsys_ctx_last_error(ctx));
    tsys_tensor_release(y); tsys_tensor_release(l); tsys_tensor_release(x);
    tsys_ctx_free(ctx);
}
