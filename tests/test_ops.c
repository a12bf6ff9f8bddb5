// test_ops.c - every op's backward against central finite differences, plus autograd mechanics
// (hooks, no_grad, accumulation, saved tensors released) and dtype conversions.
#define TSYS_IMPLEMENTATION
#include "../tsys.h"
#include "harness.h"
#include "test_util.h"

// ---- finite differences ----------------------------------------------------------------------
// The loss is sum(out * R) for a fixed random R, computed in double on the host; its gradient
// through backward (grad_out = R) must match central differences of that loss.

typedef tsys_tensor *(*fd_fn)(tsys_ctx *ctx, tsys_tensor **in, void *user);

static double fd_loss(tsys_ctx *ctx, fd_fn fn, tsys_tensor **in, void *user, const float *r, int64_t n_out) {
    tsys_no_grad_begin(ctx);
    tsys_tensor *out = fn(ctx, in, user);
    tsys_no_grad_end(ctx);
    if (!out) return NAN;
    float *o = test_read(ctx, out);
    double s = 0;
    for (int64_t i = 0; i < n_out; i++) s += (double)o[i] * r[i];
    free(o);
    tsys_tensor_release(out);
    return s;
}

// Checks d loss / d in[j] for every input that requires grad, on up to `probe` elements each.
static void fd_check(const char *what, fd_fn fn, tsys_tensor **in, int n_in, void *user, double eps, double tol) {
    tsys_ctx *ctx = in[0]->storage->ctx;
    tsys_tensor *out = fn(ctx, in, user);
    TEST_CHECK(out != NULL, "%s: forward failed: %s", what, tsys_ctx_last_error(ctx));
    if (!out) return;
    int64_t n_out = tsys_tensor_numel(out);
    tsys_tensor *r = tsys_tensor_new(ctx, out->dtype, TSYS_CPU, out->ndim, out->shape);
    tsys_tensor_randn(ctx, r, 1.0f);
    float *rv = test_read(ctx, r);
    for (int j = 0; j < n_in; j++) if (in[j] && in[j]->grad) tsys_tensor_fill(ctx, in[j]->grad, 0.0f);
    tsys_status st = tsys_backward_with(ctx, out, r);
    TEST_CHECK(st == TSYS_OK, "%s: backward failed: %s", what, tsys_ctx_last_error(ctx));
    tsys_tensor_release(out);
    for (int j = 0; j < n_in && st == TSYS_OK; j++) {
        if (!in[j] || !in[j]->requires_grad) continue;
        TEST_CHECK(in[j]->grad != NULL, "%s: input %d got no gradient", what, j);
        if (!in[j]->grad) continue;
        float *ga = test_read(ctx, in[j]->grad);
        float *x = (float *)tsys_tensor_data(in[j]);
        int64_t n = tsys_tensor_numel(in[j]), step = n > 300 ? n / 300 : 1;
        double num = 0, den = 0;
        for (int64_t i = 0; i < n; i += step) {
            float keep = x[i];
            x[i] = keep + (float)eps; double lp = fd_loss(ctx, fn, in, user, rv, n_out);
            x[i] = keep - (float)eps; double lm = fd_loss(ctx, fn, in, user, rv, n_out);
            x[i] = keep;
            double gn = (lp - lm) / (2 * eps);
            num += (ga[i] - gn) * (ga[i] - gn); den += gn * gn;
        }
        double rel = sqrt(num) / (sqrt(den) + 1e-12);
        TEST_CHECK(rel < tol, "%s: input %d gradient relative error %.3g (tolerance %.1g)", what, j, rel, tol);
        free(ga);
    }
    free(rv);
    tsys_tensor_release(r);
}

static tsys_tensor *leaf(tsys_ctx *ctx, int ndim, const int64_t *shape, float std) {
    tsys_tensor *t = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, ndim, shape);
    tsys_tensor_randn(ctx, t, std);
    tsys_tensor_set_requires_grad(t, true);
    return t;
}

static tsys_tensor *f_linear(tsys_ctx *c, tsys_tensor **in, void *u) { (void)u; return tsys_linear(c, in[0], in[1], in[2]); }
static tsys_tensor *f_matmul(tsys_ctx *c, tsys_tensor **in, void *u) { return tsys_matmul(c, in[0], in[1], u != NULL); }
static tsys_tensor *f_add(tsys_ctx *c, tsys_tensor **in, void *u) { (void)u; return tsys_add(c, in[0], in[1]); }
static tsys_tensor *f_mul(tsys_ctx *c, tsys_tensor **in, void *u) { (void)u; return tsys_mul(c, in[0], in[1]); }
static tsys_tensor *f_scale(tsys_ctx *c, tsys_tensor **in, void *u) { (void)u; return tsys_scale(c, in[0], -1.7f); }
static tsys_tensor *f_relu(tsys_ctx *c, tsys_tensor **in, void *u) { (void)u; return tsys_relu(c, in[0]); }
static tsys_tensor *f_silu(tsys_ctx *c, tsys_tensor **in, void *u) { (void)u; return tsys_silu(c, in[0]); }
static tsys_tensor *f_swiglu(tsys_ctx *c, tsys_tensor **in, void *u) { (void)u; return tsys_swiglu(c, in[0], in[1]); }
static tsys_tensor *f_rmsnorm(tsys_ctx *c, tsys_tensor **in, void *u) { (void)u; return tsys_rmsnorm(c, in[0], in[1], 1e-5f); }
static tsys_tensor *f_layernorm(tsys_ctx *c, tsys_tensor **in, void *u) { (void)u; return tsys_layernorm(c, in[0], in[1], in[2], 1e-5f); }
static tsys_tensor *f_rope(tsys_ctx *c, tsys_tensor **in, void *u) { (void)u; return tsys_rope(c, in[0], 10000.0f); }
static tsys_tensor *f_rope_heads(tsys_ctx *c, tsys_tensor **in, void *u) { (void)u; return tsys_rope_heads(c, in[0], 10000.0f); }
static tsys_tensor *f_softmax(tsys_ctx *c, tsys_tensor **in, void *u) { return tsys_softmax(c, in[0], 0.7f, u != NULL); }
static tsys_tensor *f_transpose(tsys_ctx *c, tsys_tensor **in, void *u) { (void)u; return tsys_transpose12(c, in[0]); }
static tsys_tensor *f_attn(tsys_ctx *c, tsys_tensor **in, void *u) { return tsys_attention_naive(c, in[0], in[1], in[2], u != NULL); }
static tsys_tensor *f_mse(tsys_ctx *c, tsys_tensor **in, void *u) { (void)u; return tsys_mse(c, in[0], in[1]); }
static tsys_tensor *f_sum(tsys_ctx *c, tsys_tensor **in, void *u) { (void)u; return tsys_sum(c, in[0]); }
static tsys_tensor *f_mean(tsys_ctx *c, tsys_tensor **in, void *u) { (void)u; return tsys_mean(c, in[0]); }
static tsys_tensor *f_ce(tsys_ctx *c, tsys_tensor **in, void *u) { (void)u; return tsys_cross_entropy(c, in[0], in[1]); }
static tsys_tensor *f_embed(tsys_ctx *c, tsys_tensor **in, void *u) { (void)u; return tsys_embedding(c, in[0], in[1]); }
static tsys_tensor *f_view(tsys_ctx *c, tsys_tensor **in, void *u) {
    (void)u;
    int64_t s[2] = {6, 4};
    tsys_tensor *v = tsys_view(c, in[0], 2, s);
    tsys_tensor *y = tsys_mul(c, v, v);   // a view feeding an op: its gradient must route back
    tsys_tensor_release(v);
    return y;
}
static tsys_tensor *f_flash(tsys_ctx *c, tsys_tensor **in, void *u) { return tsys_flash_attention(c, in[0], in[1], in[2], u != NULL, NULL); }

TSYS_TEST(grad_linear) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t sx[3] = {2, 3, 5}, sw[2] = {4, 5}, sb[1] = {4};
    tsys_tensor *in[3] = {leaf(ctx, 3, sx, 1), leaf(ctx, 2, sw, 1), leaf(ctx, 1, sb, 1)};
    fd_check("linear+bias", f_linear, in, 3, NULL, 1e-2, 2e-3);
    tsys_tensor *nob[3] = {in[0], in[1], NULL};
    fd_check("linear", f_linear, nob, 3, NULL, 1e-2, 2e-3);
    for (int i = 0; i < 3; i++) tsys_tensor_release(in[i]);
    tsys_ctx_free(ctx);
}

TSYS_TEST(grad_matmul) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t sa[3] = {3, 4, 5}, sb[3] = {3, 5, 6}, sbt[3] = {3, 6, 5}, s2[2] = {5, 6};
    tsys_tensor *a = leaf(ctx, 3, sa, 1), *b = leaf(ctx, 3, sb, 1), *bt = leaf(ctx, 3, sbt, 1), *b2 = leaf(ctx, 2, s2, 1);
    tsys_tensor *in1[2] = {a, b}, *in2[2] = {a, bt}, *in3[2] = {a, b2};
    fd_check("bmm", f_matmul, in1, 2, NULL, 1e-2, 2e-3);
    fd_check("bmm trans_b", f_matmul, in2, 2, (void *)1, 1e-2, 2e-3);
    fd_check("matmul broadcast b", f_matmul, in3, 2, NULL, 1e-2, 2e-3);
    tsys_tensor_release(a); tsys_tensor_release(b); tsys_tensor_release(bt); tsys_tensor_release(b2);
    tsys_ctx_free(ctx);
}

TSYS_TEST(grad_elementwise) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t s[3] = {2, 3, 7};
    tsys_tensor *a = leaf(ctx, 3, s, 1), *b = leaf(ctx, 3, s, 1);
    tsys_tensor *in[2] = {a, b};
    fd_check("add", f_add, in, 2, NULL, 1e-2, 2e-3);
    fd_check("mul", f_mul, in, 2, NULL, 1e-2, 2e-3);
    fd_check("scale", f_scale, in, 1, NULL, 1e-2, 2e-3);
    fd_check("silu", f_silu, in, 1, NULL, 1e-2, 2e-3);
    fd_check("swiglu", f_swiglu, in, 2, NULL, 1e-2, 2e-3);
    fd_check("mse", f_mse, in, 2, NULL, 1e-2, 2e-3);
    fd_check("sum", f_sum, in, 1, NULL, 1e-2, 2e-3);
    fd_check("mean", f_mean, in, 1, NULL, 1e-2, 2e-3);
    // relu: keep inputs away from the kink so that differences are well defined
    float *x = (float *)tsys_tensor_data(a);
    for (int64_t i = 0; i < tsys_tensor_numel(a); i++) if (fabsf(x[i]) < 0.05f) x[i] = 0.3f;
    fd_check("relu", f_relu, in, 1, NULL, 1e-2, 2e-3);
    tsys_tensor_release(a); tsys_tensor_release(b);
    tsys_ctx_free(ctx);
}

TSYS_TEST(grad_norms) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t s[3] = {2, 3, 16}, sw[1] = {16};
    tsys_tensor *x = leaf(ctx, 3, s, 1), *w = leaf(ctx, 1, sw, 1), *b = leaf(ctx, 1, sw, 1);
    tsys_tensor *in[3] = {x, w, b};
    fd_check("rmsnorm", f_rmsnorm, in, 2, NULL, 1e-2, 3e-3);
    fd_check("layernorm", f_layernorm, in, 3, NULL, 1e-2, 3e-3);
    tsys_tensor *nowb[3] = {x, NULL, NULL};
    fd_check("layernorm no affine", f_layernorm, nowb, 3, NULL, 1e-2, 3e-3);
    tsys_tensor_release(x); tsys_tensor_release(w); tsys_tensor_release(b);
    tsys_ctx_free(ctx);
}

// The pre-norm residual step under bf16 autocast, two ways: the norm's fp32 output read by three
// linears that each cast it (torch's autocast), and tsys__rmsnorm_to writing the bf16 input once with
// its gradient summed in fp32. Loss and every gradient equal bit for bit; the second casts nothing.
// And the norm's dx added in place into the residual gradient (x a node: its gradient is there) equals
// the separate add (x a leaf).
typedef struct norm_kcount { int casts, accums, dx_added; } norm_kcount;
static void norm_count(tsys_ctx *ctx, const tsys_trace_kernel *k, void *user) {
    (void)ctx;
    norm_kcount *c = (norm_kcount *)user;
    c->casts += k->kernel == TSYS_K_CAST;
    c->accums += k->kernel == TSYS_K_ACCUM;
    c->dx_added += k->kernel == TSYS_K_RMSNORM_BWD && k->args && k->args->i[0] != 0;
}
static float norm_step(tsys_ctx *ctx, tsys_tensor *x0, tsys_tensor *w, tsys_tensor **proj, bool fused, bool through_node, norm_kcount *kc) {
    tsys_trace_hooks h;
    memset(&h, 0, sizeof(h));
    h.kernel = norm_count; h.user = kc;
    tsys_ctx_set_trace_hooks(ctx, &h);
    tsys_autocast_begin(ctx, TSYS_BF16);
    tsys_tensor *x = through_node ? tsys_scale(ctx, x0, 1.0f) : tsys_tensor_retain(x0);
    tsys_tensor *hn = fused ? tsys__rmsnorm_to(ctx, x, w, 1e-5f, TSYS_BF16) : tsys_rmsnorm(ctx, x, w, 1e-5f);
    tsys_tensor *y = tsys_tensor_retain(x);
    for (int j = 0; j < 3; j++) {
        tsys_tensor *p = tsys_linear(ctx, hn, proj[j], NULL), *pf = tsys_cast(ctx, p, TSYS_F32), *s = tsys_add(ctx, y, pf);
        tsys_tensor_release(p); tsys_tensor_release(pf); tsys_tensor_release(y);
        y = s;
    }
    tsys_autocast_end(ctx);
    tsys_tensor *sq = tsys_mul(ctx, y, y), *loss = tsys_sum(ctx, sq);
    float v = tsys_item(ctx, loss);
    tsys_backward(ctx, loss);
    tsys_ctx_set_trace_hooks(ctx, NULL);
    tsys_tensor_release(x); tsys_tensor_release(hn); tsys_tensor_release(y); tsys_tensor_release(sq); tsys_tensor_release(loss);
    tsys_tape_clear(ctx);
    return v;
}
TSYS_TEST(fused_norm_matches_casts_bitwise) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t s[2] = {6, 16}, sw[1] = {16}, sp[2] = {16, 16};
    tsys_tensor *x0 = leaf(ctx, 2, s, 1), *w = leaf(ctx, 1, sw, 1), *proj[3];
    for (int j = 0; j < 3; j++) proj[j] = leaf(ctx, 2, sp, 0.3f);
    tsys_tensor *all[5] = {x0, w, proj[0], proj[1], proj[2]};
    float *ref[5] = {NULL}, loss_ref = 0;
    int casts_ref = 0;
    const struct { bool fused, node; const char *what; } runs[3] = {{false, true, "casts"}, {true, true, "fused, dx added in place"}, {true, false, "fused, x a leaf"}};
    for (int r = 0; r < 3; r++) {
        norm_kcount kc = {0, 0, 0};
        for (int i = 0; i < 5; i++) { tsys_tensor_release(all[i]->grad); all[i]->grad = NULL; }
        float loss = norm_step(ctx, x0, w, proj, runs[r].fused, runs[r].node, &kc);
        TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s: %s", runs[r].what, tsys_ctx_last_error(ctx));
        if (r == 0) loss_ref = loss;
        else TEST_CHECK(loss == loss_ref, "%s: loss %.9g, with casts %.9g", runs[r].what, loss, loss_ref);
        for (int i = 0; i < 5; i++) {
            float *g = test_read(ctx, all[i]->grad);
            size_t bytes = sizeof(float) * (size_t)tsys_tensor_numel(all[i]);
            if (r == 0) ref[i] = g;
            else { TEST_CHECK(g && ref[i] && memcmp(g, ref[i], bytes) == 0, "%s: gradient %d differs from the casts'", runs[r].what, i); free(g); }
        }
        // fused: no forward cast of the norm's output for each linear (3), and in backward no conversion in
        // place of the three casts' gradients (the first two bf16 dx are summed into fp32 in one pass)
        if (r == 0) casts_ref = kc.casts;
        else TEST_CHECK(kc.casts == casts_ref - 3 - 3, "%s: %d cast kernels, the casts' way %d", runs[r].what, kc.casts, casts_ref);
        TEST_CHECK(kc.dx_added == (runs[r].node ? 1 : 0), "%s: the norm's dx was added in place %d times", runs[r].what, kc.dx_added);
    }
    for (int i = 0; i < 5; i++) { free(ref[i]); tsys_tensor_release(all[i]); }
    TEST_CHECK(tsys__rmsnorm_to(ctx, x0 = leaf(ctx, 2, s, 1), w = leaf(ctx, 1, sw, 1), 1e-5f, TSYS_I32) == NULL && strstr(tsys_ctx_last_error(ctx), "rmsnorm: output i32"),
               "an integer output is refused: %s", tsys_ctx_last_error(ctx));
    tsys_tensor_release(x0); tsys_tensor_release(w);
    tsys_ctx_free(ctx);
}

// tsys_linears against separate tsys_linear calls on the CPU: the same loss and gradients, bit for bit, in
// every layout: weights back to back (q, k, v: one product each way), a stride of two blocks apart (w1, w3: dW
// one product each), apart in memory (separate products), bf16, an output read twice (its gradient then
// sums apart from the group's block: each member's own backward), and under a checkpointed region (no batching).
// The batched products show as GEMMs of batch n; hooks see n linears forward and n backward either way.
typedef struct lin_count { int gemms, batched, fwd, bwd; } lin_count;
static void lin_kernel(tsys_ctx *ctx, const tsys_trace_kernel *k, void *user) {
    (void)ctx;
    lin_count *c = (lin_count *)user;
    if (!k->gemm) return;
    c->gemms++;
    c->batched += k->gemm->batch > 1;
}
static void lin_op(tsys_ctx *ctx, const char *name, tsys_trace_kind kind, void *user) {
    lin_count *c = (lin_count *)user;
    if (strcmp(name, "linear") || !tsys_trace_weight(ctx)) return;
    c->fwd += kind == TSYS_TRACE_FORWARD;
    c->bwd += kind == TSYS_TRACE_BACKWARD;
}
enum { LIN_BLOCKS = 5, LIN_N = 12, LIN_K = 8 };
typedef struct lin_case { const char *what; int n, at[3]; bool apart, bf16, twice, region, autocast; int gemms, batched; } lin_case;
// loss = sum_i sum(view(out_i) * r_i) (+ sum(out_0 * r_0) again when twice); x = x0 * 1 (a node)
static float lin_step(tsys_ctx *ctx, const lin_case *c, bool grouped, tsys_tensor *x0, tsys_tensor **w, tsys_tensor **r, lin_count *cnt) {
    tsys_trace_hooks h;
    memset(&h, 0, sizeof(h));
    h.kernel = lin_kernel; h.op_begin = lin_op; h.user = cnt;
    tsys_ctx_set_trace_hooks(ctx, &h);
    if (c->region) tsys_checkpoint_begin(ctx);
    if (c->autocast) tsys_autocast_begin(ctx, TSYS_BF16);
    tsys_tensor *x0s = tsys_scale(ctx, x0, 1.0f), *x = c->autocast ? tsys_cast(ctx, x0s, TSYS_BF16) : tsys_tensor_retain(x0s), *out[3] = {NULL, NULL, NULL};
    tsys_tensor_release(x0s);
    if (grouped) TEST_CHECK(tsys_linears(ctx, x, c->n, w, out) == TSYS_OK, "%s: %s", c->what, tsys_ctx_last_error(ctx));
    else for (int i = 0; i < c->n; i++) out[i] = tsys_linear(ctx, x, w[i], NULL);
    if (c->autocast) tsys_autocast_end(ctx);
    if (c->region) tsys_checkpoint_end(ctx);
    tsys_tensor *loss = NULL;
    for (int i = 0; i < c->n + (c->twice ? 1 : 0); i++) {
        int64_t flat[2] = {10, LIN_N};
        tsys_tensor *v = tsys_view(ctx, out[i % c->n], 2, flat), *p = tsys_mul(ctx, v, r[i % c->n]), *s = tsys_sum(ctx, p);
        tsys_tensor *l = loss ? tsys_add(ctx, loss, s) : tsys_tensor_retain(s);
        tsys_tensor_release(v); tsys_tensor_release(p); tsys_tensor_release(s); tsys_tensor_release(loss);
        loss = l;
    }
    for (int i = 0; i < c->n; i++) tsys_tensor_release(out[i]);
    tsys_tensor *lf = tsys_cast(ctx, loss, TSYS_F32);
    float v = tsys_item(ctx, lf);
    tsys_backward(ctx, lf);
    tsys_ctx_set_trace_hooks(ctx, NULL);
    tsys_tensor_release(x); tsys_tensor_release(loss); tsys_tensor_release(lf);
    tsys_tape_clear(ctx);
    return v;
}
TSYS_TEST(linears_match_separate_linears) {
    const lin_case cases[] = {
        {"back to back", 3, {0, 1, 2}, false, false, false, false, false, 2 + 1, 3},   // forward, dX, dW batched
        {"two blocks apart", 2, {2, 4, 0}, false, false, false, false, false, 2 + 2, 2},   // dW one each
        {"apart in memory", 3, {0, 1, 2}, true, false, false, false, false, 9, 0},
        {"bf16", 3, {0, 1, 2}, false, true, false, false, false, 3, 3},
        {"an output read twice", 3, {0, 1, 2}, false, false, true, false, false, 1 + 6, 1},   // batched forward only
        {"inside a checkpointed region", 3, {0, 1, 2}, false, false, false, true, false, 9, 0},   // (the recompute reruns x only)
        {"bf16 autocast of fp32 weights", 3, {0, 1, 2}, false, false, false, false, true, 3, 3},   // their copies made side by side
        {"bf16 autocast, two blocks apart", 2, {2, 4, 0}, false, false, false, false, true, 2 + 2, 2},
    };
    for (size_t ci = 0; ci < sizeof(cases) / sizeof(cases[0]); ci++) {
        const lin_case *c = &cases[ci];
        tsys_ctx *ctx = tsys_ctx_new(NULL);
        tsys_dtype dt = c->bf16 ? TSYS_BF16 : TSYS_F32;
        int64_t sx[3] = {2, 5, LIN_K}, sb[3] = {LIN_BLOCKS, LIN_N, LIN_K}, sw[2] = {LIN_N, LIN_K}, sr[2] = {10, LIN_N};
        tsys_tensor *x0 = tsys_tensor_new(ctx, dt, TSYS_CPU, 3, sx), *block = tsys_tensor_new(ctx, dt, TSYS_CPU, 3, sb), *w[3] = {NULL, NULL, NULL}, *r[3];
        tsys_tensor_randn(ctx, x0, 1.0f);
        tsys_tensor_randn(ctx, block, 0.3f);
        tsys_tensor_set_requires_grad(x0, true);
        for (int i = 0; i < c->n; i++) {
            size_t at = (size_t)c->at[i] * LIN_N * LIN_K * tsys_dtype_size(dt);
            tsys_tensor *view = tsys_tensor_view_raw(ctx, block, at, dt, 2, sw);
            w[i] = c->apart ? tsys_tensor_clone(ctx, view) : tsys_tensor_retain(view);
            tsys_tensor_release(view);
            tsys_tensor_set_requires_grad(w[i], true);
            r[i] = tsys_tensor_new(ctx, c->autocast ? TSYS_BF16 : dt, TSYS_CPU, 2, sr);
            tsys_tensor_randn(ctx, r[i], 1.0f);
        }
        float *ref[4] = {NULL}, loss_ref = 0;
        for (int grouped = 0; grouped < 2; grouped++) {
            lin_count cnt = {0, 0, 0, 0};
            tsys_tensor_release(x0->grad); x0->grad = NULL;
            tsys_tensor *gblock = tsys_tensor_new(ctx, dt, TSYS_CPU, 3, sb);   // the weights' gradients laid out like them
            tsys_tensor_fill(ctx, gblock, 0.0f);
            for (int i = 0; i < c->n; i++) {
                tsys_tensor_release(w[i]->grad);
                w[i]->grad = tsys_tensor_view_raw(ctx, gblock, (size_t)c->at[i] * LIN_N * LIN_K * tsys_dtype_size(dt), dt, 2, sw);
            }
            tsys_tensor_release(gblock);
            float loss = lin_step(ctx, c, grouped, x0, w, r, &cnt);
            TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s: %s", c->what, tsys_ctx_last_error(ctx));
            TEST_CHECK(cnt.fwd == c->n && cnt.bwd == c->n, "%s: hooks saw %d linears forward, %d backward", c->what, cnt.fwd, cnt.bwd);
            if (!grouped) { loss_ref = loss; TEST_CHECK(cnt.batched == 0, "%s: separate linears batched", c->what); }
            else {
                TEST_CHECK(loss == loss_ref, "%s: loss %.9g, separate linears %.9g", c->what, loss, loss_ref);
                TEST_CHECK(cnt.gemms == c->gemms && cnt.batched == c->batched, "%s: %d GEMMs (%d batched), expected %d (%d)", c->what, cnt.gemms, cnt.batched,
                           c->gemms, c->batched);
            }
            for (int i = 0; i <= c->n; i++) {
                tsys_tensor *g = i < c->n ? w[i]->grad : x0->grad;
                float *v = g ? test_read(ctx, g) : NULL;
                TEST_CHECK(v != NULL, "%s: input %d has no gradient", c->what, i);
                size_t bytes = sizeof(float) * (size_t)(i < c->n ? LIN_N * LIN_K : 10 * LIN_K);
                if (!grouped) ref[i] = v;
                else { TEST_CHECK(v && ref[i] && memcmp(v, ref[i], bytes) == 0, "%s: gradient of input %d differs from separate linears'", c->what, i); free(v); }
            }
        }
        for (int i = 0; i <= c->n; i++) free(ref[i]);
        for (int i = 0; i < c->n; i++) { tsys_tensor_release(w[i]->grad); w[i]->grad = NULL; tsys_tensor_release(w[i]); tsys_tensor_release(r[i]); }
        tsys_tensor_release(x0); tsys_tensor_release(block);
        tsys_ctx_free(ctx);
    }
}
TSYS_TEST(linears_refuse_bad_input) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t sx[2] = {4, 8}, sw[2] = {6, 8}, sv[2] = {6, 7};
    tsys_tensor *x = leaf(ctx, 2, sx, 1), *w = leaf(ctx, 2, sw, 1), *v = leaf(ctx, 2, sv, 1), *out[5];
    tsys_tensor *five[5] = {w, w, w, w, w}, *mixed[2] = {w, v}, *holes[2] = {w, NULL};
    const struct { int n; tsys_tensor **ws; const char *msg; } bad[] = {
        {0, five, "linears: n is 0, must be 1 to 4"}, {5, five, "linears: n is 5, must be 1 to 4"},
        {2, mixed, "linears: weights[1] '' must have the shape of weights[0] '' (2-D, 6 x 8)"}, {2, holes, "linears: weights[1] is NULL"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        tsys_ctx_clear_error(ctx);
        tsys_status st = tsys_linears(ctx, x, bad[i].n, bad[i].ws, out);
        TEST_CHECK(st == TSYS_ERR_INVALID_ARGS && strstr(tsys_ctx_last_error(ctx), bad[i].msg), "case %zu: status %d, %s", i, (int)st, tsys_ctx_last_error(ctx));
    }
    tsys_ctx_clear_error(ctx);
    tsys_tensor *wide[2] = {v, v};   // in features 7 against x's 8: tsys_linear's own error, every out NULL
    TEST_CHECK(tsys_linears(ctx, x, 2, wide, out) != TSYS_OK && !out[0] && !out[1] && strstr(tsys_ctx_last_error(ctx), "does not match weight"),
               "a mismatched input: %s", tsys_ctx_last_error(ctx));
    tsys_tensor_release(x); tsys_tensor_release(w); tsys_tensor_release(v);
    tsys_ctx_free(ctx);
}

TSYS_TEST(grad_rope_softmax_transpose) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t s[4] = {2, 3, 5, 8}, ss[3] = {2, 6, 6};
    tsys_tensor *x = leaf(ctx, 4, s, 1), *sc = leaf(ctx, 3, ss, 1);
    fd_check("rope", f_rope, &x, 1, NULL, 1e-2, 2e-3);
    fd_check("rope_heads", f_rope_heads, &x, 1, NULL, 1e-2, 2e-3);
    fd_check("transpose12", f_transpose, &x, 1, NULL, 1e-2, 2e-3);
    {   // rope_heads is rope(transpose12(x)) in one pass: the same values, bit for bit, and the same gradient
        tsys_tensor *t = tsys_transpose12(ctx, x), *r1 = tsys_rope(ctx, t, 10000.0f), *r2 = tsys_rope_heads(ctx, x, 10000.0f);
        float *a1 = test_read(ctx, r1), *a2 = test_read(ctx, r2);
        TEST_CHECK(r1 && r2 && r2->shape[1] == 5 && r2->shape[2] == 3 && memcmp(a1, a2, sizeof(float) * (size_t)tsys_tensor_numel(r1)) == 0, "rope_heads differs from rope(transpose12)");
        free(a1); free(a2);
        tsys_tensor_release(t); tsys_tensor_release(r1); tsys_tensor_release(r2);
        tsys_tape_clear(ctx);
        int64_t s3[3] = {2, 5, 8};
        tsys_tensor *bad = leaf(ctx, 3, s3, 1);
        TEST_CHECK(tsys_rope_heads(ctx, bad, 10000.0f) == NULL && strstr(tsys_ctx_last_error(ctx), "needs (B, T, H, D)"), "a 3-D input is refused: %s", tsys_ctx_last_error(ctx));
        tsys_ctx_clear_error(ctx);
        tsys_tensor_release(bad);
    }
    fd_check("softmax", f_softmax, &sc, 1, NULL, 1e-2, 3e-3);
    fd_check("softmax causal", f_softmax, &sc, 1, (void *)1, 1e-2, 3e-3);
    int64_t sv[3] = {2, 3, 4};
    tsys_tensor *v = leaf(ctx, 3, sv, 1);
    fd_check("view", f_view, &v, 1, NULL, 1e-2, 2e-3);
    tsys_tensor_release(x); tsys_tensor_release(sc); tsys_tensor_release(v);
    tsys_ctx_free(ctx);
}

TSYS_TEST(grad_attention) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t s[4] = {2, 2, 7, 8};
    tsys_tensor *in[3] = {leaf(ctx, 4, s, 1), leaf(ctx, 4, s, 1), leaf(ctx, 4, s, 1)};
    fd_check("attention", f_attn, in, 3, NULL, 1e-2, 3e-3);
    fd_check("attention causal", f_attn, in, 3, (void *)1, 1e-2, 3e-3);
    for (int i = 0; i < 3; i++) tsys_tensor_release(in[i]);
    tsys_ctx_free(ctx);
}

TSYS_TEST(grad_flash_attention) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t s[3] = {2, 19, 16};
    tsys_tensor *in[3] = {leaf(ctx, 3, s, 1), leaf(ctx, 3, s, 1), leaf(ctx, 3, s, 1)};
    fd_check("flash attention", f_flash, in, 3, NULL, 1e-2, 3e-3);
    fd_check("flash attention causal", f_flash, in, 3, (void *)1, 1e-2, 3e-3);
    for (int i = 0; i < 3; i++) tsys_tensor_release(in[i]);
    tsys_ctx_free(ctx);
}

TSYS_TEST(grad_losses_embedding) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t sl[2] = {6, 11}, st[1] = {6}, sw[2] = {11, 5}, si[2] = {2, 4};
    tsys_tensor *logits = leaf(ctx, 2, sl, 2), *tgt = tsys_tensor_new(ctx, TSYS_I64, TSYS_CPU, 1, st);
    tsys_tensor_randint(ctx, tgt, 11);
    tsys_tensor *in[2] = {logits, tgt};
    fd_check("cross_entropy", f_ce, in, 2, NULL, 1e-2, 2e-3);
    tsys_tensor *w = leaf(ctx, 2, sw, 1), *ids = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 2, si);
    tsys_tensor_randint(ctx, ids, 11);
    ((int32_t *)tsys_tensor_data(ids))[1] = ((int32_t *)tsys_tensor_data(ids))[0];   // a repeated id accumulates
    tsys_tensor *ein[2] = {w, ids};
    fd_check("embedding", f_embed, ein, 2, NULL, 1e-2, 2e-3);
    tsys_tensor_release(logits); tsys_tensor_release(tgt); tsys_tensor_release(w); tsys_tensor_release(ids);
    tsys_ctx_free(ctx);
}

// ---- linear + cross-entropy, chunked ----------------------------------------------------------

static tsys_tensor *f_lce(tsys_ctx *c, tsys_tensor **in, void *u) { return tsys_linear_cross_entropy(c, in[0], in[1], in[2], *(int64_t *)u); }

TSYS_TEST(grad_linear_cross_entropy) {   // against finite differences: one chunk, uneven chunks, a 3-D x
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t sx[2] = {5, 4}, sx3[3] = {2, 3, 4}, sw[2] = {7, 4}, st[1] = {5}, st6[1] = {6};
    tsys_tensor *x = leaf(ctx, 2, sx, 1), *x3 = leaf(ctx, 3, sx3, 1), *w = leaf(ctx, 2, sw, 0.7f);
    tsys_tensor *t = tsys_tensor_new(ctx, TSYS_I64, TSYS_CPU, 1, st), *t6 = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 1, st6);
    tsys_tensor_randint(ctx, t, 7); tsys_tensor_randint(ctx, t6, 7);
    int64_t chunks[3] = {0, 2, 5};
    for (int i = 0; i < 3; i++) {
        tsys_tensor *in[3] = {x, w, t};
        fd_check(chunks[i] == 2 ? "linear_cross_entropy, chunks of 2 rows" : "linear_cross_entropy, one chunk", f_lce, in, 3, &chunks[i], 1e-2, 2e-3);
    }
    int64_t four = 4;
    tsys_tensor *in3[3] = {x3, w, t6};
    fd_check("linear_cross_entropy, (2, 3, d) x in chunks of 4 rows", f_lce, in3, 3, &four, 1e-2, 2e-3);
    tsys_tensor *all[5] = {x, x3, w, t, t6};
    for (int i = 0; i < 5; i++) tsys_tensor_release(all[i]);
    tsys_ctx_free(ctx);
}

// The fused op against the two ops it replaces, on the same leaves: loss, d x and d w. One chunk runs the same
// kernels on the same values, so it gives the same bits (f32, and under bf16 autocast); more chunks sum the
// loss and d w chunk by chunk. scale: the loss's gradient (the summed loss multiplies it by the tokens).
static void lce_against_unfused(tsys_dtype autocast, int64_t chunk, float scale, bool bitwise, double tol) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    const int64_t R = 37, d = 24, V = 61;
    int64_t sx[2] = {R, d}, sw[2] = {V, d}, st[1] = {R};
    tsys_tensor *x = leaf(ctx, 2, sx, 1), *w = leaf(ctx, 2, sw, 0.3f), *t = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 1, st);
    tsys_tensor_randint(ctx, t, V);
    float *out[2][3];
    test_lce_paths(ctx, x, w, t, autocast, chunk, scale, out);
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    const char *names[3] = {"loss", "d x", "d w"};
    const int64_t n[3] = {1, R * d, V * d};
    for (int k = 0; k < 3; k++) {
        float *got = out[1][k], *want = out[0][k];
        TEST_CHECK(got && want, "%s missing", names[k]);
        if (!got || !want) continue;
        if (bitwise) TEST_CHECK(!memcmp(got, want, sizeof(float) * (size_t)n[k]), "%s (%s, chunk %lld, x %g): not the unfused bits (max relative %.2e)",
                                names[k], tsys_dtype_name(autocast), (long long)chunk, scale, test_max_rel(got, want, n[k]));
        else TEST_CHECK(test_max_rel(got, want, n[k]) <= tol, "%s (%s, chunk %lld, x %g): %.2e from the unfused, tolerance %.0e",
                        names[k], tsys_dtype_name(autocast), (long long)chunk, scale, test_max_rel(got, want, n[k]), tol);
    }
    for (int k = 0; k < 6; k++) free(out[k / 3][k % 3]);
    tsys_tensor_release(x); tsys_tensor_release(w); tsys_tensor_release(t);
    tsys_ctx_free(ctx);
}
TSYS_TEST(linear_cross_entropy_matches_linear_then_cross_entropy) {
    lce_against_unfused(TSYS_F32, 37, 1.0f, true, 0);     // one chunk: the same bits
    lce_against_unfused(TSYS_F32, 0, 1.0f, true, 0);      // the default chunk (2048 rows at least) takes all 37
    lce_against_unfused(TSYS_BF16, 37, 1.0f, true, 0);
    lce_against_unfused(TSYS_F32, 37, 4.0f, true, 0);     // a power of two scales exactly
    lce_against_unfused(TSYS_F32, 8, 1.0f, false, 1e-6);  // 5 chunks, the last of 5 rows
    lce_against_unfused(TSYS_F32, 1, 3.0f, false, 1e-6);
    lce_against_unfused(TSYS_BF16, 10, 1.0f, false, 1e-2);   // bf16 logits: d w's chunk sums round differently
}

// Only one input needs a gradient: the op makes that one alone (the other stays NULL), equal to the unfused one's.
TSYS_TEST(linear_cross_entropy_one_input_needs_grad) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t sx[2] = {9, 6}, sw[2] = {13, 6}, st[1] = {9};
    tsys_tensor *x = leaf(ctx, 2, sx, 1), *w = leaf(ctx, 2, sw, 0.5f), *t = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 1, st);
    tsys_tensor_randint(ctx, t, 13);
    for (int frozen = 0; frozen < 2; frozen++) {   // 0: x frozen, 1: w frozen
        tsys_tensor_set_requires_grad(x, frozen != 0); tsys_tensor_set_requires_grad(w, frozen == 0);
        float *out[2][3];
        test_lce_paths(ctx, x, w, t, TSYS_F32, 4, 1.0f, out);
        const int k = frozen ? 1 : 2;   // the gradient that exists
        const int64_t n = frozen ? 9 * 6 : 13 * 6;
        TEST_CHECK(out[1][3 - k] == NULL && out[0][3 - k] == NULL, "%s frozen: it has a gradient", frozen ? "w" : "x");
        TEST_CHECK(out[1][k] && out[0][k] && test_max_rel(out[1][k], out[0][k], n) <= 1e-6, "%s frozen: the other's gradient %.2e from the unfused",
                   frozen ? "w" : "x", out[1][k] && out[0][k] ? test_max_rel(out[1][k], out[0][k], n) : -1.0);
        for (int i = 0; i < 6; i++) free(out[i / 3][i % 3]);
    }
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    tsys_tensor_release(x); tsys_tensor_release(w); tsys_tensor_release(t);
    tsys_ctx_free(ctx);
}

TSYS_TEST(linear_cross_entropy_refuses_bad_input) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t sx[2] = {4, 3}, sw[2] = {5, 3}, sw2[2] = {5, 2}, st[1] = {4}, st3[1] = {3};
    tsys_tensor *x = leaf(ctx, 2, sx, 1), *w = leaf(ctx, 2, sw, 1), *w2 = leaf(ctx, 2, sw2, 1);
    tsys_tensor *t = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 1, st), *t3 = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 1, st3), *tf = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, st);
    tsys_tensor_set_name(x, "hidden"); tsys_tensor_set_name(w2, "head"); tsys_tensor_set_name(tf, "labels");
    tsys_tensor_fill(ctx, t, 1.0f); tsys_tensor_fill(ctx, t3, 1.0f);
    struct { tsys_tensor *w, *t; int64_t chunk; const char *says; } bad[] = {
        {w2, t, 0, "input 'hidden' last dim 3 does not match weight 'head' (5, 2)"},
        {w, t3, 0, "3 targets for 4 rows of 'hidden'"},
        {w, tf, 0, "targets 'labels' must be i32 or i64"},
        {w, t, -2, "chunk_rows -2 must be >= 0"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        tsys_tensor *y = tsys_linear_cross_entropy(ctx, x, bad[i].w, bad[i].t, bad[i].chunk);
        TEST_CHECK(!y && strstr(tsys_ctx_last_error(ctx), bad[i].says), "case %zu: %s", i, tsys_ctx_last_error(ctx));
        tsys_tensor_release(y);
        tsys_ctx_clear_error(ctx);
    }
    tsys_checkpoint_begin(ctx);
    tsys_tensor *y = tsys_linear_cross_entropy(ctx, x, w, t, 0);
    TEST_CHECK(!y && strstr(tsys_ctx_last_error(ctx), "not inside a checkpoint region"), "in a region: %s", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    tsys_checkpoint_end(ctx);
    tsys_no_grad_begin(ctx);   // no gradients wanted: the loss alone, nothing recorded
    y = tsys_linear_cross_entropy(ctx, x, w, t, 2);
    tsys_no_grad_end(ctx);
    TEST_CHECK(y && !y->grad_fn, "no_grad: %s", tsys_ctx_last_error(ctx));
    tsys_tensor_release(y);
    tsys_tensor *all[6] = {x, w, w2, t, t3, tf};
    for (int i = 0; i < 6; i++) tsys_tensor_release(all[i]);
    tsys_ctx_free(ctx);
}

// ---- autograd mechanics ----------------------------------------------------------------------

typedef struct { int order[16]; int n; int calls[16]; } hook_log;
static void log_hook(tsys_ctx *ctx, tsys_tensor *p, void *user) {
    (void)ctx;
    hook_log *log = (hook_log *)user;
    int id = p->name[1] - '0';
    log->calls[id]++;
    if (log->n < 16) log->order[log->n++] = id;
}

TSYS_TEST(hooks_fire_once_in_reverse_order_with_tied_weights) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t sx[2] = {4, 6}, sw[2] = {6, 6};
    tsys_tensor *x = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 2, sx);
    tsys_tensor_randn(ctx, x, 1);
    tsys_tensor *w[3];
    hook_log log;
    memset(&log, 0, sizeof(log));
    for (int i = 0; i < 3; i++) {
        w[i] = leaf(ctx, 2, sw, 0.3f);
        tsys_tensor_set_name(w[i], "w%d", i);
        tsys_tensor_set_grad_hook(w[i], log_hook, &log);
    }
    // w1 is tied: used by the second and the fourth layer; its hook must wait for the earlier use
    tsys_tensor *h1 = tsys_linear(ctx, x, w[0], NULL), *h2 = tsys_linear(ctx, h1, w[1], NULL);
    tsys_tensor *h3 = tsys_linear(ctx, h2, w[2], NULL), *h4 = tsys_linear(ctx, h3, w[1], NULL);
    tsys_tensor *loss = tsys_sum(ctx, h4);
    TEST_CHECK(tsys_backward(ctx, loss) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    TEST_CHECK(log.calls[0] == 1 && log.calls[1] == 1 && log.calls[2] == 1, "hook calls %d %d %d, expected 1 each", log.calls[0], log.calls[1], log.calls[2]);
    TEST_CHECK(log.n == 3 && log.order[0] == 2 && log.order[1] == 1 && log.order[2] == 0, "order %d %d %d, expected 2 1 0", log.order[0], log.order[1], log.order[2]);
    TEST_CHECK(tsys_tape_size(ctx) == 0, "tape not empty after backward");
    tsys_tensor *ts[6] = {h1, h2, h3, h4, loss, x};
    for (int i = 0; i < 6; i++) tsys_tensor_release(ts[i]);
    for (int i = 0; i < 3; i++) tsys_tensor_release(w[i]);
    tsys_ctx_free(ctx);
}

TSYS_TEST(no_grad_and_accumulation) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t s[1] = {5};
    tsys_tensor *a = leaf(ctx, 1, s, 1);
    tsys_no_grad_begin(ctx);
    tsys_tensor *y = tsys_mul(ctx, a, a);
    tsys_no_grad_end(ctx);
    TEST_CHECK(tsys_tape_size(ctx) == 0 && !y->requires_grad, "no_grad recorded %zu nodes", tsys_tape_size(ctx));
    tsys_tensor_release(y);
    for (int rep = 0; rep < 2; rep++) {   // two backward passes accumulate: grad = 2 * (2a)
        tsys_tensor *q = tsys_mul(ctx, a, a), *l = tsys_sum(ctx, q);
        tsys_backward(ctx, l);
        tsys_tensor_release(q); tsys_tensor_release(l);
    }
    float *g = test_read(ctx, a->grad), *av = (float *)tsys_tensor_data(a);
    double worst = 0;
    for (int i = 0; i < 5; i++) worst = fmax(worst, fabs(g[i] - 4 * av[i]));
    TEST_CHECK(worst < 1e-5, "accumulated gradient off by %g", worst);
    free(g);
    tsys_tensor_release(a);
    tsys_ctx_free(ctx);
}

static int64_t g_live_in_hook;
static void live_hook(tsys_ctx *ctx, tsys_tensor *p, void *u) { (void)p; (void)u; g_live_in_hook = tsys_mem_stats_get(ctx, TSYS_CPU).live_bytes; }

TSYS_TEST(saved_tensors_released_during_backward) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t sx[2] = {64, 64}, sw[2] = {64, 64};
    tsys_tensor *x = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 2, sx);
    tsys_tensor_randn(ctx, x, 1);
    tsys_tensor *w0 = leaf(ctx, 2, sw, 0.1f), *w = leaf(ctx, 2, sw, 0.1f);
    tsys_tensor_set_grad_hook(w0, live_hook, NULL);
    tsys_tensor *h = tsys_linear(ctx, x, w0, NULL);
    for (int i = 0; i < 20; i++) {   // 20 saved activations of 16 KiB each
        tsys_tensor *n = tsys_silu(ctx, h);
        tsys_tensor_release(h);
        h = tsys_linear(ctx, n, w, NULL);
        tsys_tensor_release(n);
    }
    tsys_tensor *loss = tsys_sum(ctx, h);
    tsys_tensor_release(h);
    int64_t before = tsys_mem_stats_get(ctx, TSYS_CPU).live_bytes;
    tsys_backward(ctx, loss);
    // when w0's hook fires (the last node) nearly all 40 saved activations must be gone
    TEST_CHECK(g_live_in_hook < before - 30 * 64 * 64 * 4, "live bytes at the end of backward %lld, before %lld", (long long)g_live_in_hook, (long long)before);
    tsys_tensor_release(loss); tsys_tensor_release(x); tsys_tensor_release(w0); tsys_tensor_release(w);
    TEST_CHECK(tsys_mem_stats_get(ctx, TSYS_CPU).live_bytes == 0, "leak: %lld bytes live after releasing everything", (long long)tsys_mem_stats_get(ctx, TSYS_CPU).live_bytes);
    tsys_ctx_free(ctx);
}

TSYS_TEST(memory_tracker_and_oom) {
    tsys_ctx_desc d;
    memset(&d, 0, sizeof(d));
    d.cpu_memory_limit = 1 << 20; d.record_events = true;
    tsys_ctx *ctx = tsys_ctx_new(&d);
    int tag = tsys_mem_tag(ctx, "mine");
    tsys_mem_set_tag(ctx, tag);
    int64_t s[1] = {1000};
    tsys_tensor *a = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, s);
    TEST_CHECK(tsys_mem_tag_bytes(ctx, tag, TSYS_CPU) == 4000, "tag bytes %lld", (long long)tsys_mem_tag_bytes(ctx, tag, TSYS_CPU));
    tsys_tensor_release(a);
    int64_t big[1] = {1 << 20};
    tsys_tensor *b = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, big);
    TEST_CHECK(b == NULL && tsys_ctx_status(ctx) == TSYS_ERR_OOM, "4 MiB past a 1 MiB limit gave status %d", tsys_ctx_status(ctx));
    TEST_CHECK(strstr(tsys_ctx_last_error(ctx), "out of memory") != NULL, "message: %s", tsys_ctx_last_error(ctx));
    // a failed op returns NULL and later ops pass NULL along without crashing
    tsys_tensor *c = tsys_relu(ctx, b);
    TEST_CHECK(c == NULL, "op on NULL input returned a tensor");
    tsys_mem_stats st = tsys_mem_stats_get(ctx, TSYS_CPU);
    TEST_CHECK(st.peak_bytes == 4000 && st.live_bytes == 0, "peak %lld live %lld", (long long)st.peak_bytes, (long long)st.live_bytes);
    size_t ne;
    const tsys_mem_event *ev = tsys_mem_events(ctx, &ne);
    TEST_CHECK(ne == 2 && ev[0].delta == 4000 && ev[1].delta == -4000 && ev[0].tag == tag, "%zu events", ne);
    tsys_ctx_free(ctx);
}

TSYS_TEST(dtype_round_to_nearest_even) {
    // bf16 keeps 8 mantissa bits: 1 + 2^-8 is a tie between 1 and 1 + 2^-7 and goes to even (1)
    TEST_CHECK(tsys_bf16_to_f32(tsys_f32_to_bf16(1.0f + 1.0f / 256)) == 1.0f, "bf16 tie");
    TEST_CHECK(tsys_bf16_to_f32(tsys_f32_to_bf16(1.0f + 3.0f / 256)) == 1.0f + 4.0f / 256, "bf16 tie to even upward");
    TEST_CHECK(tsys_bf16_to_f32(tsys_f32_to_bf16(1.0f + 1.5f / 256)) == 1.0f + 2.0f / 256, "bf16 above tie");
    TEST_CHECK(tsys_f16_to_f32(tsys_f32_to_f16(1.0f + 1.0f / 2048)) == 1.0f, "f16 tie");
    TEST_CHECK(tsys_f16_to_f32(tsys_f32_to_f16(1.0f + 3.0f / 2048)) == 1.0f + 4.0f / 2048, "f16 tie to even");
    TEST_CHECK(tsys_f16_to_f32(tsys_f32_to_f16(65504.0f)) == 65504.0f, "f16 max");
    TEST_CHECK(isinf(tsys_f16_to_f32(tsys_f32_to_f16(65520.0f))), "f16 overflow to inf");
    TEST_CHECK(tsys_f16_to_f32(tsys_f32_to_f16(5.9604645e-8f)) == 5.9604645e-8f, "f16 smallest subnormal");
    TEST_CHECK(tsys_f16_to_f32(tsys_f32_to_f16(1e-9f)) == 0.0f, "f16 underflow");
    TEST_CHECK(isnan(tsys_bf16_to_f32(tsys_f32_to_bf16(NAN))) && isnan(tsys_f16_to_f32(tsys_f32_to_f16(NAN))), "NaN survives");
    // exhaustive: every f16 value converts to f32 and back unchanged
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        if ((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu)) continue;   // NaN payloads
        if (tsys_f32_to_f16(tsys_f16_to_f32((uint16_t)h)) != h) bad++;
    }
    TEST_CHECK(bad == 0, "%d f16 values do not round-trip", bad);
}

TSYS_TEST(random_normal_statistics) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t s[1] = {200000};
    tsys_tensor *t = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, s);
    tsys_tensor_randn(ctx, t, 2.0f);
    float *x = (float *)tsys_tensor_data(t);
    double m = 0, v = 0;
    for (int i = 0; i < s[0]; i++) m += x[i];
    m /= s[0];
    for (int i = 0; i < s[0]; i++) v += (x[i] - m) * (x[i] - m);
    v /= s[0];
    TEST_CHECK(fabs(m) < 0.02 && fabs(sqrt(v) - 2.0) < 0.02, "normal(0, 2): mean %g std %g", m, sqrt(v));
    tsys_tensor_trunc_normal(ctx, t, 1.0f, -1.0f, 1.0f);
    double lo = 1, hi = -1, var = 0;
    for (int i = 0; i < s[0]; i++) { lo = fmin(lo, x[i]); hi = fmax(hi, x[i]); var += (double)x[i] * x[i]; }
    // a standard normal cut at +-1 has variance 1 - 2 phi(1) / (2 Phi(1) - 1) = 0.2911
    TEST_CHECK(lo >= -1 && hi <= 1 && fabs(var / s[0] - 0.2911) < 0.005, "truncated: range [%g, %g] variance %g", lo, hi, var / s[0]);
    tsys_tensor_release(t);
    tsys_ctx_free(ctx);
}

// The CPU backend has one entry point per kernel id, in TSYS_KERNELS order (the table's size is checked
// when tsys.h compiles, its order here); an id past the table is refused, naming it, and runs nothing.
TSYS_TEST(cpu_kernel_table_has_every_kernel_in_order) {
    for (int k = 0; k < TSYS_K_COUNT; k++)
        TEST_CHECK(tsys__cpu_kernels[k].id == (tsys_kernel)k && tsys__cpu_kernels[k].fn != NULL, "row %d holds %s, not %s", k,
                   tsys_kernel_name(tsys__cpu_kernels[k].id), tsys_kernel_name((tsys_kernel)k));
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_kargs a;
    memset(&a, 0, sizeof(a));
    tsys_status st = tsys__cpu_backend.kernel(ctx, TSYS_K_COUNT, &a);
    char want[64];
    snprintf(want, sizeof(want), "kernel %d not implemented", (int)TSYS_K_COUNT);
    TEST_CHECK(st == TSYS_ERR_UNSUPPORTED && strstr(tsys_ctx_last_error(ctx), want), "id %d: status %d, %s", (int)TSYS_K_COUNT, (int)st,
               tsys_ctx_last_error(ctx));
    tsys_ctx_free(ctx);
}

// tsys_gemm_rate times the matmul path: reps positive rates whose max is the peak, and nothing (n = 0,
// the context clean) when the tensors do not fit the budget.
TSYS_TEST(gemm_rate_measures_the_matmul_path) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_stats s = tsys_gemm_rate(ctx, TSYS_CPU, TSYS_F32, 64, 5);
    TEST_CHECK(s.n == 5 && s.min > 0 && s.max >= s.median && s.median >= s.min, "n %d, min %g, median %g, max %g", s.n, s.min, s.median, s.max);
    tsys_ctx_set_cpu_memory_limit(ctx, 1024);
    s = tsys_gemm_rate(ctx, TSYS_CPU, TSYS_F32, 64, 5);
    TEST_CHECK(s.n == 0 && !(s.max > 0) && tsys_ctx_status(ctx) == TSYS_OK, "under a 1 KiB budget: n %d, status %d", s.n, (int)tsys_ctx_status(ctx));
    tsys_ctx_free(ctx);
}

int main(int argc, char **argv) { return tsys_test_main(argc, argv); }
