// test_checkpoint.c - activation checkpointing: checkpointed regions in the autograd (gradients bit
// for bit those of the run without them, nested regions, gradient-ready hooks once each), the model's
// policies, what the memory tracker measures against the accounting, and the planner.
#define TSYS_IMPLEMENTATION
#include "../tsys.h"
#include "harness.h"
#include "test_util.h"

// ---- a small model, run once per policy -----------------------------------------------------------

static bool g_fused_loss;   // the models below run the head and the loss fused (desc.fused_loss)

static tsys_model_desc small_desc(const char *attn, const char *policy) {
    tsys_model_desc d = tsys_model_desc_defaults(NULL);
    d.vocab_size = 61; d.context_length = 16; d.d_model = 32; d.num_layers = 4; d.num_heads = 4; d.d_ff = 80;
    d.attn = attn; d.checkpoint = policy; d.fused_loss = g_fused_loss; d.fused_loss_chunk = g_fused_loss ? 16 : 0;   // several chunks
    return d;
}

typedef struct step_result {
    float loss;
    float *grads;          // every gradient, concatenated (parameters() order)
    int64_t n;
    int64_t kept;          // bytes in the tracker's activations category after the forward
    int64_t peak;          // tracker peak over the step
    char hooks[4096];      // gradient-ready hooks in firing order
    int hook_calls;
} step_result;

static void hook_log(tsys_ctx *ctx, tsys_tensor *p, void *u) {
    (void)ctx;
    step_result *r = (step_result *)u;
    size_t o = strlen(r->hooks);
    snprintf(r->hooks + o, sizeof(r->hooks) - o, "%s ", p->name);
    r->hook_calls++;
}

// One forward + backward of the small model (weights from seed 5, batch from seed 9) under `policy`.
static bool run_step(const char *attn, const char *policy, tsys_dtype autocast, step_result *r) {
    memset(r, 0, sizeof(*r));
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_model_desc d = small_desc(attn, policy);
    tsys_model *m = tsys_model_new(ctx, &d, TSYS_CPU, 5);
    int64_t shape[2] = {3, 16};
    tsys_tensor *ids = tsys_tensor_new(ctx, TSYS_I64, TSYS_CPU, 2, shape), *tgt = tsys_tensor_new(ctx, TSYS_I64, TSYS_CPU, 2, shape);
    tsys_rng_seed(ctx, 9);
    tsys_tensor_randint(ctx, ids, d.vocab_size);
    tsys_tensor_randint(ctx, tgt, d.vocab_size);
    for (int i = 0; m && i < tsys_model_num_tensors(m); i++) tsys_tensor_add_grad_hook(tsys_model_params(m)[i], hook_log, r);
    tsys_mem_reset_peak(ctx, TSYS_CPU);
    if (autocast != TSYS_F32) tsys_autocast_begin(ctx, autocast);
    tsys_tensor *loss = m ? tsys_model_loss(m, ids, tgt) : NULL;
    if (autocast != TSYS_F32) tsys_autocast_end(ctx);
    // the ids (the embedding keeps them) and the targets (cross_entropy keeps them; the fused op does not) are inputs
    r->kept = tsys_mem_stats_get(ctx, TSYS_CPU).category_bytes[TSYS_MEM_ACTIVATIONS] - (int64_t)(tsys_tensor_bytes(ids) + (d.fused_loss ? 0 : tsys_tensor_bytes(tgt)));
    tsys_status st = tsys_backward(ctx, loss);
    r->peak = tsys_mem_stats_get(ctx, TSYS_CPU).peak_bytes;
    r->loss = tsys_item(ctx, loss);
    if (st == TSYS_OK) {
        tsys_tensor **ps = tsys_model_params(m);
        for (int i = 0; i < tsys_model_num_tensors(m); i++) r->n += tsys_tensor_numel(ps[i]);
        r->grads = (float *)malloc(sizeof(float) * (size_t)r->n);
        int64_t o = 0;
        for (int i = 0; i < tsys_model_num_tensors(m); i++) {
            tsys_tensor_to_f32(ctx, ps[i]->grad, r->grads + o);
            o += tsys_tensor_numel(ps[i]);
        }
    }
    bool ok = st == TSYS_OK && tsys_ctx_status(ctx) == TSYS_OK;
    if (!ok) printf("    [%s %s: %s] ", attn, policy, tsys_ctx_last_error(ctx));
    tsys_tensor_release(loss); tsys_tensor_release(ids); tsys_tensor_release(tgt);
    tsys_model_free(m);
    tsys_ctx_free(ctx);
    return ok;
}

static const char *const policies[] = {"blocks:1", "blocks:2", "blocks:3", "sqrt", "nested", "nested:3", "selective",
                                       "blocks:2+selective", "nested:2+selective", "blocks:4+selective", "blocks:1+keep-attn", "nested:2+keep-attn",
                                       "blocks:1+first:2", "blocks:1+keep-attn+first:3", "nested:2+selective+first:3", "blocks:2+first:1"};
#define NUM_POLICIES ((int)(sizeof(policies) / sizeof(policies[0])))

static void bitwise_every_policy(const char *attn, tsys_dtype autocast) {
    step_result ref, got;
    TEST_CHECK(run_step(attn, "none", autocast, &ref), "reference step failed");
    for (int i = 0; i < NUM_POLICIES; i++) {
        if (!run_step(attn, policies[i], autocast, &got)) { TEST_CHECK(false, "%s failed", policies[i]); continue; }
        TEST_CHECK(got.loss == ref.loss, "%s: loss %.9g vs %.9g", policies[i], got.loss, ref.loss);
        TEST_CHECK(got.n == ref.n && memcmp(got.grads, ref.grads, sizeof(float) * (size_t)ref.n) == 0,
                   "%s: gradients differ from the run without checkpointing (rel err %g)", policies[i], tsys_test_rel_err(got.grads, ref.grads, ref.n));
        TEST_CHECK(strcmp(got.hooks, ref.hooks) == 0 && got.hook_calls == ref.hook_calls, "%s: hooks fired '%.200s' (%d), without checkpointing '%.200s' (%d)",
                   policies[i], got.hooks, got.hook_calls, ref.hooks, ref.hook_calls);
        TEST_CHECK(got.kept < ref.kept, "%s keeps %lld bytes, no less than without checkpointing (%lld)", policies[i], (long long)got.kept, (long long)ref.kept);
        free(got.grads);
    }
    TEST_CHECK(ref.hook_calls == 3 + 9 * 4, "each parameter's hook fires once: %d calls for %d parameters", ref.hook_calls, 3 + 9 * 4);
    free(ref.grads);
}

TSYS_TEST(policies_fp32_naive_bitwise) { bitwise_every_policy("naive", TSYS_F32); }
TSYS_TEST(policies_fp32_flash_bitwise) { bitwise_every_policy("flash", TSYS_F32); }
TSYS_TEST(policies_bf16_autocast_bitwise) { bitwise_every_policy("naive", TSYS_BF16); }


// ---- regions by hand: nested, crossing inputs, constants, autocast ----------------------------------

typedef struct chain { tsys_tensor *x, *w[3], *g, *c, *tgt; } chain;

static void chain_make(tsys_ctx *ctx, chain *k) {
    int64_t sx[3] = {2, 6, 8}, sw[2] = {8, 8}, sg[1] = {8}, ss[3] = {2, 6, 6};
    tsys_rng_seed(ctx, 77);
    k->x = test_param(ctx, TSYS_CPU, 3, sx, 1.0f);
    for (int i = 0; i < 3; i++) { k->w[i] = test_param(ctx, TSYS_CPU, 2, sw, 0.4f); tsys_tensor_set_name(k->w[i], "w%d", i); }
    k->g = test_param(ctx, TSYS_CPU, 1, sg, 1.0f);
    tsys_tensor_set_name(k->x, "x"); tsys_tensor_set_name(k->g, "g");
    k->c = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 3, sx);   // a constant (no grad) used inside a region
    tsys_tensor_randn(ctx, k->c, 1.0f);
    k->tgt = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 3, ss);
    tsys_tensor_randn(ctx, k->tgt, 1.0f);
}
static void chain_free(chain *k) {
    tsys_tensor *t[7] = {k->x, k->w[0], k->w[1], k->w[2], k->g, k->c, k->tgt};
    for (int i = 0; i < 7; i++) tsys_tensor_release(t[i]);
}

// A forward through nested regions when `regions` (else the same ops without): w0 is used in two
// regions and outside them (tied), x enters the outer region and is used again after it.
static tsys_tensor *chain_forward(tsys_ctx *ctx, chain *k, bool regions, tsys_dtype ac) {
    if (ac != TSYS_F32) tsys_autocast_begin(ctx, ac);
    if (regions) tsys_checkpoint_begin(ctx);                       // outer
    tsys_tensor *a = tsys_linear(ctx, k->x, k->w[0], NULL);
    if (regions) tsys_checkpoint_begin(ctx);                       //   inner 1
    tsys_tensor *b = tsys_silu(ctx, a);
    tsys_tensor *c = tsys_rmsnorm(ctx, b, k->g, 1e-5f);
    if (regions) tsys_checkpoint_end(ctx);
    if (regions) tsys_checkpoint_begin(ctx);                       //   inner 2
    tsys_tensor *d = tsys_linear(ctx, c, k->w[1], NULL);
    tsys_tensor *e = tsys_mul(ctx, d, k->c);                       //   a constant from outside
    tsys_tensor *ea = tsys_add(ctx, e, a);                         //   a from the outer region
    if (regions) tsys_checkpoint_begin(ctx);                       //     inner 3, inside inner 2
    tsys_tensor *f = tsys_matmul(ctx, ea, ea, true);               //     (2, 6, 6)
    tsys_tensor *p = tsys_softmax(ctx, f, 0.3f, true);
    if (regions) tsys_checkpoint_end(ctx);
    tsys_tensor *q = tsys_matmul(ctx, p, ea, false);
    if (regions) tsys_checkpoint_end(ctx);
    tsys_tensor *h = tsys_layernorm(ctx, q, k->g, NULL, 1e-5f);
    tsys_tensor *r = tsys_linear(ctx, h, k->w[0], NULL);           // w0 again, in the outer region
    if (regions) tsys_checkpoint_end(ctx);
    tsys_tensor *s = tsys_add(ctx, r, k->x);                       // x again, outside
    tsys_tensor *o = tsys_linear(ctx, s, k->w[2], NULL);
    tsys_tensor *o2 = tsys_matmul(ctx, o, o, true);
    if (ac != TSYS_F32) tsys_autocast_end(ctx);
    tsys_tensor *loss = tsys_mse(ctx, o2, k->tgt);
    tsys_tensor *tl[13] = {a, b, c, d, e, ea, f, p, q, h, r, s, o};
    for (int i = 0; i < 13; i++) tsys_tensor_release(tl[i]);
    tsys_tensor_release(o2);
    return loss;
}

typedef struct chain_out { float grads[5][128]; float loss; int64_t kept, after; char hooks[256]; } chain_out;
static void chain_hook(tsys_ctx *ctx, tsys_tensor *p, void *u) {
    (void)ctx;
    chain_out *r = (chain_out *)u;
    size_t o = strlen(r->hooks);
    snprintf(r->hooks + o, sizeof(r->hooks) - o, "%s ", p->name);
}
static bool chain_run(bool regions, tsys_dtype ac, chain_out *r) {
    memset(r, 0, sizeof(*r));
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    chain k;
    chain_make(ctx, &k);
    tsys_tensor *leaves[5] = {k.x, k.w[0], k.w[1], k.w[2], k.g};
    for (int i = 0; i < 5; i++) tsys_tensor_add_grad_hook(leaves[i], chain_hook, r);
    tsys_tensor *loss = chain_forward(ctx, &k, regions, ac);
    r->kept = tsys_mem_stats_get(ctx, TSYS_CPU).category_bytes[TSYS_MEM_ACTIVATIONS];
    tsys_status st = tsys_backward(ctx, loss);
    r->after = tsys_mem_stats_get(ctx, TSYS_CPU).category_bytes[TSYS_MEM_ACTIVATIONS];
    r->loss = tsys_item(ctx, loss);
    for (int i = 0; st == TSYS_OK && i < 5; i++) tsys_tensor_to_f32(ctx, leaves[i]->grad, r->grads[i]);
    bool ok = st == TSYS_OK && tsys_ctx_status(ctx) == TSYS_OK;
    if (!ok) printf("    [%s] ", tsys_ctx_last_error(ctx));
    tsys_tensor_release(loss);
    chain_free(&k);
    tsys_ctx_free(ctx);
    return ok;
}

static void nested_case(tsys_dtype ac) {
    chain_out ref, got;
    TEST_CHECK(chain_run(false, ac, &ref), "reference failed");
    TEST_CHECK(chain_run(true, ac, &got), "nested regions failed");
    TEST_CHECK(got.loss == ref.loss, "loss %.9g vs %.9g", got.loss, ref.loss);
    TEST_CHECK(memcmp(got.grads, ref.grads, sizeof(ref.grads)) == 0, "gradients differ from the run without regions");
    TEST_CHECK(strcmp(got.hooks, ref.hooks) == 0, "hooks '%s' vs '%s' without regions", got.hooks, ref.hooks);
    const char *names[5] = {"x ", "w0 ", "w1 ", "w2 ", "g "};
    for (int i = 0; i < 5; i++) {
        const char *at = strstr(got.hooks, names[i]);
        bool once = at && (at == got.hooks || at[-1] == ' ') && !strstr(at + 1, names[i]);
        TEST_CHECK(once, "hook of %s did not fire exactly once: '%s'", names[i], got.hooks);
    }
    // w2 is last used first; x and the tied w0 are last used by the first op, so they fire last
    const char *w0 = strstr(got.hooks, "w0 "), *x = strstr(got.hooks, "x "), *w1 = strstr(got.hooks, "w1 "), *g = strstr(got.hooks, "g ");
    TEST_CHECK(strncmp(got.hooks, "w2 ", 3) == 0 && w0 && x && w1 && g && w0 > w1 && w0 > g && x > w1 && x > g,
               "w2 fires first, x and tied w0 after their last uses: '%s'", got.hooks);
    TEST_CHECK(got.kept < ref.kept, "the regions keep %lld bytes, without them %lld", (long long)got.kept, (long long)ref.kept);
    TEST_CHECK(got.after == 0 && ref.after == 0, "activations left after backward: %lld, %lld", (long long)got.after, (long long)ref.after);
}
TSYS_TEST(nested_regions_by_hand_fp32) { nested_case(TSYS_F32); }
TSYS_TEST(nested_regions_by_hand_bf16) { nested_case(TSYS_BF16); }

// ---- what runs again: one block region reruns each block's forward except its last GEMM ------------

typedef struct op_count { int linear_in_backward, cast_in_backward, cast_kernels_in_backward, flash_in_backward, ops_in_backward; bool in_bwd; } op_count;
static void oc_begin(tsys_ctx *ctx, const char *name, tsys_trace_kind kind, void *u) {
    (void)ctx;
    op_count *c = (op_count *)u;
    if (kind == TSYS_TRACE_RANGE && !strcmp(name, "backward")) c->in_bwd = true;
    if (kind == TSYS_TRACE_FORWARD && c->in_bwd) {
        c->ops_in_backward++;
        c->linear_in_backward += !strcmp(name, "linear");
        c->cast_in_backward += !strcmp(name, "cast");
        c->flash_in_backward += !strcmp(name, "flash_attention");
    }
}
static void oc_kernel(tsys_ctx *ctx, const tsys_trace_kernel *k, void *u) {
    (void)ctx;
    op_count *c = (op_count *)u;
    if (c->in_bwd && !strcmp(k->name, "cast")) c->cast_kernels_in_backward++;   // the ops' and the weight copies'
}
static void oc_end(tsys_ctx *ctx, const char *name, tsys_trace_kind kind, void *u) {
    (void)ctx;
    if (kind == TSYS_TRACE_RANGE && !strcmp(name, "backward")) ((op_count *)u)->in_bwd = false;
}
static op_count count_recompute_attn(const char *attn, const char *policy, tsys_dtype ac) {
    op_count c;
    memset(&c, 0, sizeof(c));
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_model_desc d = small_desc(attn, policy);
    tsys_model *m = tsys_model_new(ctx, &d, TSYS_CPU, 5);
    int64_t shape[2] = {2, 8};
    tsys_tensor *ids = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 2, shape);
    tsys_tensor_randint(ctx, ids, d.vocab_size);
    tsys_trace_hooks h;
    memset(&h, 0, sizeof(h));
    h.op_begin = oc_begin; h.op_end = oc_end; h.kernel = oc_kernel; h.user = &c;
    tsys_ctx_set_trace_hooks(ctx, &h);
    if (ac != TSYS_F32) tsys_autocast_begin(ctx, ac);
    tsys_tensor *logits = tsys_model_forward(m, ids), *loss = tsys_cross_entropy(ctx, logits, ids);
    if (ac != TSYS_F32) tsys_autocast_end(ctx);   // as the drivers do: the weight-copy cache goes
    tsys_trace_begin(ctx, "backward");
    tsys_backward(ctx, loss);
    tsys_trace_end(ctx);
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s: %s", policy, tsys_ctx_last_error(ctx));
    tsys_tensor_release(logits); tsys_tensor_release(loss); tsys_tensor_release(ids);
    tsys_model_free(m);
    tsys_ctx_free(ctx);
    return c;
}
static op_count count_recompute_ac(const char *policy, tsys_dtype ac) { return count_recompute_attn("naive", policy, ac); }
static op_count count_recompute(const char *policy) { return count_recompute_ac(policy, TSYS_F32); }
TSYS_TEST(recompute_reruns_what_backward_needs_once) {
    op_count none = count_recompute("none"), b1 = count_recompute("blocks:1"), b2 = count_recompute("blocks:2");
    op_count nested = count_recompute("nested:2"), sel = count_recompute("selective");
    TEST_CHECK(none.ops_in_backward == 0, "without checkpointing backward runs %d forward ops", none.ops_in_backward);
    // q, k, v, output projection, w1, w3 per block; a region's last w2 is not rerun (its output leaves
    // the region; only its input is kept), a w2 whose output feeds the next block in the region is
    TEST_CHECK(b1.linear_in_backward == 6 * 4, "blocks:1 reruns %d linears, expected %d", b1.linear_in_backward, 6 * 4);
    TEST_CHECK(b2.linear_in_backward == 6 * 4 + 2, "blocks:2 reruns %d linears, expected %d", b2.linear_in_backward, 6 * 4 + 2);
    // nested:2: each segment's first block runs in full once more (its output is the next block's input)
    TEST_CHECK(nested.linear_in_backward == 6 * 4 + 7 * 2, "nested:2 reruns %d linears, expected %d", nested.linear_in_backward, 6 * 4 + 7 * 2);
    // selective reruns no linear: the projections in the norm regions only get their inputs back
    TEST_CHECK(sel.linear_in_backward == 0 && sel.ops_in_backward > 0, "selective reruns %d linears, %d ops", sel.linear_in_backward, sel.ops_in_backward);
    // under autocast selective's projections keep the weight copies of the forward, and the norms
    // write the projections' bf16 inputs themselves: selective reruns no cast at all, while a block
    // region casts its weights again
    op_count sel16 = count_recompute_ac("selective", TSYS_BF16), b116 = count_recompute_ac("blocks:1", TSYS_BF16);
    TEST_CHECK(sel16.cast_in_backward == 0, "selective bf16 reruns %d casts, expected none", sel16.cast_in_backward);
    TEST_CHECK(sel16.cast_kernels_in_backward == sel16.cast_in_backward + count_recompute_ac("none", TSYS_BF16).cast_kernels_in_backward,
               "selective bf16: %d cast kernels in backward for %d recomputed casts (weights cast again?)", sel16.cast_kernels_in_backward, sel16.cast_in_backward);
    // +keep-attn: the block recompute runs every linear it ran before, but no attention forward
    op_count fb1 = count_recompute_attn("flash", "blocks:1", TSYS_F32), fka = count_recompute_attn("flash", "blocks:1+keep-attn", TSYS_F32);
    TEST_CHECK(fb1.flash_in_backward == 4 && fka.flash_in_backward == 0, "flash forwards rerun: blocks:1 %d (want 4), +keep-attn %d (want 0)", fb1.flash_in_backward, fka.flash_in_backward);
    TEST_CHECK(fka.linear_in_backward == fb1.linear_in_backward, "+keep-attn reruns %d linears, blocks:1 %d", fka.linear_in_backward, fb1.linear_in_backward);
    TEST_CHECK(b116.cast_kernels_in_backward >= b116.cast_in_backward + 6 * 4, "blocks:1 bf16: %d cast kernels, %d recomputed casts: its 6 rerun linears a block cast their weights",
               b116.cast_kernels_in_backward, b116.cast_in_backward);
}

// ---- gradient-ready hooks: once each, after the last use, with the final gradient ---------------------

typedef struct seen { tsys_tensor *p; float first; int calls; } seen;
static void seen_hook(tsys_ctx *ctx, tsys_tensor *p, void *u) {
    seen *s = (seen *)u;
    float *g = test_read(ctx, p->grad);
    if (s->calls++ == 0) s->first = g ? g[0] : NAN;
    free(g);
}
TSYS_TEST(hooks_see_the_final_gradient_once_per_backward) {
    const char *const pols[3] = {"blocks:1", "nested:2+selective", "selective"};
    for (int pi = 0; pi < 3; pi++) {
        tsys_ctx *ctx = tsys_ctx_new(NULL);
        tsys_model_desc d = small_desc("naive", pols[pi]);
        tsys_model *m = tsys_model_new(ctx, &d, TSYS_CPU, 5);
        int n = tsys_model_num_tensors(m);
        seen *s = (seen *)calloc((size_t)n, sizeof(seen));
        for (int i = 0; i < n; i++) tsys_tensor_add_grad_hook(tsys_model_params(m)[i], seen_hook, &s[i]);
        int64_t shape[2] = {2, 8};
        tsys_tensor *ids = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 2, shape);
        tsys_tensor_randint(ctx, ids, d.vocab_size);
        for (int step = 0; step < 2; step++) {
            tsys_tensor *logits = tsys_model_forward(m, ids), *loss = tsys_cross_entropy(ctx, logits, ids);
            tsys_backward(ctx, loss);
            tsys_tensor_release(logits); tsys_tensor_release(loss);
        }
        int wrong_count = 0, wrong_value = 0;
        for (int i = 0; i < n; i++) {
            float *g = test_read(ctx, tsys_model_params(m)[i]->grad);
            if (s[i].calls != 2) wrong_count++;
            if (g && s[i].first * 2.0f != g[0] && fabsf(s[i].first * 2.0f - g[0]) > 1e-6f * fabsf(g[0])) wrong_value++;   // two backwards accumulate
            free(g);
        }
        TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s: %s", pols[pi], tsys_ctx_last_error(ctx));
        TEST_CHECK(wrong_count == 0, "%s: %d parameters' hooks did not fire once per backward", pols[pi], wrong_count);
        TEST_CHECK(wrong_value == 0, "%s: %d hooks saw a gradient that was not final", pols[pi], wrong_value);
        free(s);
        tsys_tensor_release(ids);
        tsys_model_free(m);
        tsys_ctx_free(ctx);
    }
}

// ---- memory: the tracker against the accounting --------------------------------------------------------

static void saved_bytes_case(void);
TSYS_TEST(saved_bytes_match_the_accounting) { saved_bytes_case(); }
// the head and the loss fused: it keeps d x and d w (fp32) where the plain head keeps its input, the logits and
// their log-sum-exp; the accounting follows (to the byte), under every policy
TSYS_TEST(saved_bytes_match_the_accounting_fused_loss) { g_fused_loss = true; saved_bytes_case(); g_fused_loss = false; }
static void saved_bytes_case(void) {
    const char *const pols[11] = {"none", "selective", "blocks:1", "blocks:3", "nested:2", "nested:2+selective", "blocks:1+keep-attn", "nested:2+keep-attn",
                                  "blocks:1+first:2", "blocks:1+keep-attn+first:3", "nested:2+selective+first:3"};
    const char *const attns[2] = {"naive", "flash"};
    const tsys_dtype dts[2] = {TSYS_F32, TSYS_BF16};
    step_result r;
    for (int a = 0; a < 2; a++)
        for (int t = 0; t < 2; t++)
            for (int i = 0; i < 11; i++) {
                if (a == 1 && t == 1) continue;   // the CPU flash kernel is fp32
                if (!run_step(attns[a], pols[i], dts[t], &r)) { TEST_CHECK(false, "%s failed", pols[i]); continue; }
                tsys_model_desc d = small_desc(attns[a], pols[i]);
                tsys_checkpoint_plan p;
                char err[256];
                TEST_CHECK(tsys_checkpoint_plan_make(&d, pols[i], 3, 16, dts[t], false, &p, err, sizeof(err)) == TSYS_OK, "%s", err);
                TEST_CHECK((double)r.kept == p.kept_bytes, "%s %s %s: the tracker counts %lld bytes kept, the accounting %.0f", attns[a],
                           tsys_dtype_name(dts[t]), pols[i], (long long)r.kept, p.kept_bytes);
                free(r.grads);
            }
    // per block: a block region keeps one residual (E x d fp32), a block without one all of the table
    tsys_model_desc d = small_desc("naive", "none");
    tsys_checkpoint_plan none, b1;
    tsys_checkpoint_plan_make(&d, "none", 3, 16, TSYS_F32, false, &none, NULL, 0);
    tsys_checkpoint_plan_make(&d, "blocks:1", 3, 16, TSYS_F32, false, &b1, NULL, 0);
    TEST_CHECK(b1.kept_block_bytes == 4.0 * 3 * 16 * 32, "blocks:1 keeps %.0f bytes per block", b1.kept_block_bytes);
    TEST_CHECK(none.kept_block_bytes == none.block_bytes && none.block_bytes > 10 * b1.kept_block_bytes, "a block keeps %.0f bytes", none.block_bytes);
}

// TSYS_PLAN_PURE (a model computing in its 16-bit dtype throughout, as under FSDP): each region's input and the
// final norm's, the residual stream, kept in 2 bytes instead of fp32's 4, and no weight cast at the end of forward;
// fp32 unchanged; an unknown flag is refused, named.
TSYS_TEST(plan_pure_keeps_the_residual_in_dtype) {
    tsys_model_desc d = small_desc("naive", "blocks:1");
    tsys_checkpoint_plan ac, pure, f32, f32p;
    char err[256];
    TEST_CHECK(tsys_checkpoint_plan_make_ex(&d, "blocks:1", 3, 16, TSYS_BF16, TSYS_PLAN_OPTIMIZER, &ac, err, sizeof err) == TSYS_OK, "%s", err);
    TEST_CHECK(tsys_checkpoint_plan_make_ex(&d, "blocks:1", 3, 16, TSYS_BF16, TSYS_PLAN_OPTIMIZER | TSYS_PLAN_PURE, &pure, err, sizeof err) == TSYS_OK, "%s", err);
    const double E = 3 * 16, residual = (d.num_layers + 1) * E * d.d_model;   // one region input a block, the final norm's input
    TEST_CHECK(ac.kept_bytes - pure.kept_bytes == 2 * residual, "kept %.0f under autocast, %.0f pure: not 2 bytes less a residual element",
               ac.kept_bytes, pure.kept_bytes);
    TEST_CHECK(pure.peak_bytes < ac.peak_bytes, "pure peak %.0f not below autocast's %.0f", pure.peak_bytes, ac.peak_bytes);
    tsys_checkpoint_plan_make_ex(&d, "blocks:1", 3, 16, TSYS_F32, TSYS_PLAN_OPTIMIZER, &f32, NULL, 0);
    tsys_checkpoint_plan_make_ex(&d, "blocks:1", 3, 16, TSYS_F32, TSYS_PLAN_OPTIMIZER | TSYS_PLAN_PURE, &f32p, NULL, 0);
    TEST_CHECK(f32.kept_bytes == f32p.kept_bytes && f32.peak_bytes == f32p.peak_bytes, "fp32: pure changed the plan");
    TEST_CHECK(tsys_checkpoint_plan_make_ex(&d, "blocks:1", 3, 16, TSYS_BF16, 32u, &pure, err, sizeof err) == TSYS_ERR_INVALID_ARGS &&
                   strstr(err, "unknown flags 0x20"), "flag 32: '%s'", err);
}

// The CS336 (S26) numbers: the xl block (2560 wide, 10240 FFN, 32 heads) at context 2048, batch 4,
// fp32, naive attention keeps 3651.31 MiB in torch; four blocks 14605.25 MiB; two checkpointed pairs 160.
TSYS_TEST(accounting_of_the_cs336_xl_block) {
    tsys_model_desc d;
    tsys_model_desc_preset("2.7B", &d, NULL, 0);   // the S26 xl shape
    d.num_layers = 4; d.context_length = 2048;
    tsys_checkpoint_plan none, pairs;
    TEST_CHECK(tsys_checkpoint_plan_make(&d, "none", 4, 2048, TSYS_F32, false, &none, NULL, 0) == TSYS_OK, "plan");
    TEST_CHECK(tsys_checkpoint_plan_make(&d, "blocks:2", 4, 2048, TSYS_F32, false, &pairs, NULL, 0) == TSYS_OK, "plan");
    double MiB = 1048576.0;
    TEST_CHECK(fabs(none.block_bytes / MiB - 3651.31) / 3651.31 < 0.002, "a block keeps %.2f MiB (torch: 3651.31)", none.block_bytes / MiB);
    TEST_CHECK(fabs(4 * none.kept_block_bytes / MiB - 14605.25) / 14605.25 < 0.002, "four blocks keep %.2f MiB (torch: 14605.25)", 4 * none.kept_block_bytes / MiB);
    TEST_CHECK(4 * pairs.kept_block_bytes / MiB == 160.0, "two checkpointed pairs keep %.2f MiB (torch: 160.00)", 4 * pairs.kept_block_bytes / MiB);
}

// ---- the planner -------------------------------------------------------------------------------------

static int64_t measured_train_peak(const char *policy, tsys_dtype ac, int64_t *budget_seen) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_model_desc d = small_desc("naive", policy);
    d.context_length = 64; d.num_layers = 6; d.vocab_size = 97;
    tsys_model *m = tsys_model_new(ctx, &d, TSYS_CPU, 5);
    tsys_optim *opt = m ? tsys_adamw_new(ctx, tsys_model_params(m), tsys_model_num_tensors(m), NULL) : NULL;
    int64_t shape[2] = {2, 64};
    tsys_tensor *ids = tsys_tensor_new(ctx, TSYS_I64, TSYS_CPU, 2, shape), *tgt = tsys_tensor_new(ctx, TSYS_I64, TSYS_CPU, 2, shape);
    tsys_tensor_randint(ctx, ids, d.vocab_size); tsys_tensor_randint(ctx, tgt, d.vocab_size);
    tsys_mem_reset_peak(ctx, TSYS_CPU);
    if (ac != TSYS_F32) tsys_autocast_begin(ctx, ac);
    tsys_tensor *loss = m ? tsys_model_loss(m, ids, tgt) : NULL;
    if (ac != TSYS_F32) tsys_autocast_end(ctx);
    tsys_backward(ctx, loss);
    tsys_optim_step(opt);
    int64_t peak = tsys_ctx_status(ctx) == TSYS_OK ? tsys_mem_stats_get(ctx, TSYS_CPU).peak_bytes : -1;
    if (budget_seen) *budget_seen = m && tsys_model_checkpoint_plan(m) ? (int64_t)tsys_model_checkpoint_plan(m)->peak_bytes : -1;
    tsys_tensor_release(loss); tsys_tensor_release(ids); tsys_tensor_release(tgt);
    tsys_optim_free(opt);
    tsys_model_free(m);
    tsys_ctx_free(ctx);
    return peak;
}

static void predicted_peak_case(void);
TSYS_TEST(predicted_peak_within_10_percent_of_measured) { predicted_peak_case(); }
TSYS_TEST(predicted_peak_within_10_percent_of_measured_fused_loss) { g_fused_loss = true; predicted_peak_case(); g_fused_loss = false; }
static void predicted_peak_case(void) {
    const char *const pols[11] = {"none", "selective", "blocks:1", "blocks:2", "sqrt", "nested:2", "nested:3+selective", "blocks:2+selective",
                                  "blocks:1+first:4", "blocks:2+first:2", "nested:2+selective+first:4"};
    for (int t = 0; t < 2; t++)
        for (int i = 0; i < 11; i++) {
            tsys_dtype ac = t ? TSYS_BF16 : TSYS_F32;
            int64_t predicted = 0, measured = measured_train_peak(pols[i], ac, &predicted);
            TEST_CHECK(measured > 0, "%s failed", pols[i]);
            double err = (double)(predicted - measured) / (double)measured;
            TEST_CHECK(fabs(err) <= 0.10, "%s %s: predicted %lld, measured %lld (%+.1f%%)", pols[i], tsys_dtype_name(ac), (long long)predicted, (long long)measured, 100 * err);
        }
}

TSYS_TEST(auto_picks_the_cheapest_policy_that_fits) {
    tsys_model_desc d = small_desc("naive", NULL);
    d.context_length = 64; d.num_layers = 6; d.vocab_size = 97;
    tsys_checkpoint_plan none, b1, got;
    char spec[64], err[256];
    tsys_checkpoint_plan_make(&d, "none", 2, 64, TSYS_F32, true, &none, err, sizeof(err));
    tsys_checkpoint_plan_make(&d, "blocks:1", 2, 64, TSYS_F32, true, &b1, err, sizeof(err));
    // room for everything: nothing is recomputed
    snprintf(spec, sizeof(spec), "auto:%.0f", none.peak_bytes + 1);
    TEST_CHECK(tsys_checkpoint_plan_make(&d, spec, 2, 64, TSYS_F32, true, &got, err, sizeof(err)) == TSYS_OK, "%s", err);
    TEST_CHECK(got.fits && !strcmp(got.name, "none"), "a budget above the peak without checkpointing picks '%s'", got.name);
    // between blocks:1 and none: a fitting plan, and the model under auto stays within the budget
    double budget = (none.peak_bytes + b1.peak_bytes) / 2;
    snprintf(spec, sizeof(spec), "auto:%.0fB", budget);
    TEST_CHECK(tsys_checkpoint_plan_make(&d, spec, 2, 64, TSYS_F32, true, &got, err, sizeof(err)) == TSYS_OK, "%s", err);
    TEST_CHECK(got.fits && got.peak_bytes <= budget && strcmp(got.name, "none") != 0, "budget %.0f: '%s' predicted %.0f", budget, got.name, got.peak_bytes);
    TEST_CHECK(got.recompute_flops <= b1.recompute_flops, "'%s' recomputes %.3g FLOPs, more than blocks:1 (%.3g)", got.name, got.recompute_flops, b1.recompute_flops);
    int64_t predicted = 0, measured = measured_train_peak(spec, TSYS_F32, &predicted);
    TEST_CHECK(measured > 0 && (double)measured <= budget, "the model under %s peaked at %lld bytes (budget %.0f, predicted %lld)", spec, (long long)measured, budget, (long long)predicted);
    TEST_CHECK(measured_train_peak("none", TSYS_F32, NULL) > budget, "the budget must be one that needs checkpointing");
    // the budget that blocks:1 fits with a quarter of the difference to none left over buys back the
    // recomputation of the blocks above (+first:N): less than every policy over all blocks that fits
    double tight = b1.peak_bytes + (none.peak_bytes - b1.peak_bytes) / 4;
    tsys_checkpoint_plan t;
    snprintf(spec, sizeof(spec), "auto:%.0f", tight);
    TEST_CHECK(tsys_checkpoint_plan_make(&d, spec, 2, 64, TSYS_F32, true, &t, err, sizeof(err)) == TSYS_OK && t.fits && t.policy.first > 0 &&
               t.recompute_flops < b1.recompute_flops, "budget %.0f: '%s' (first %d) recomputes %.3g FLOPs against blocks:1's %.3g", tight, t.name,
               t.policy.first, t.recompute_flops, b1.recompute_flops);
    const char *const whole[3] = {"blocks:2", "blocks:3", "sqrt"};
    for (int i = 0; i < 3; i++) {
        tsys_checkpoint_plan w;
        tsys_checkpoint_plan_make(&d, whole[i], 2, 64, TSYS_F32, true, &w, NULL, 0);
        TEST_CHECK(w.peak_bytes > tight || w.recompute_flops >= t.recompute_flops, "%s fits %.0f and recomputes %.3g, less than '%s' (%.3g)", whole[i],
                   tight, w.recompute_flops, t.name, t.recompute_flops);
    }
    measured = measured_train_peak(spec, TSYS_F32, &predicted);
    TEST_CHECK(measured > 0 && (double)measured <= tight * 1.05, "the model under %s ('%s') peaked at %lld bytes (predicted %lld)", spec, t.name,
               (long long)measured, (long long)predicted);
    // nothing fits: the least peak, marked as not fitting
    TEST_CHECK(tsys_checkpoint_plan_make(&d, "auto:1K", 2, 64, TSYS_F32, true, &got, err, sizeof(err)) == TSYS_OK, "%s", err);
    TEST_CHECK(!got.fits && got.peak_bytes <= b1.peak_bytes, "auto:1K: '%s' fits %d, peak %.0f", got.name, got.fits, got.peak_bytes);
}

// The policies auto chooses from: each named once, each name parsing back to the same policy, as many as the
// loops promise for L blocks (blocks:K for K <= N under +first:N or K <= L, nested from K = 2; three suffixes
// with flash, two without) and none and selective; and the ranking's four cases.
typedef struct { int count, bad; char names[512][48]; int L; } each_seen;
static void each_record(const tsys_checkpoint_policy *p, void *user) {
    each_seen *s = (each_seen *)user;
    char name[48];
    tsys_checkpoint_policy_name(p, name, sizeof name);
    tsys_checkpoint_policy back;
    if (tsys_checkpoint_policy_parse(name, s->L, &back, NULL, 0) != TSYS_OK || memcmp(&back, p, sizeof back)) s->bad++;
    for (int i = 0; i < s->count && i < 512; i++)
        if (!strcmp(s->names[i], name)) s->bad++;
    if (s->count < 512) snprintf(s->names[s->count], sizeof s->names[0], "%s", name);
    s->count++;
}
TSYS_TEST(auto_candidates_and_ranking) {
    for (int flash = 0; flash < 2; flash++) {
        tsys_model_desc d = small_desc(flash ? "flash" : "naive", NULL);
        d.num_layers = 5;
        static each_seen s;
        memset(&s, 0, sizeof s);
        s.L = 5;
        tsys_checkpoint_policy_each(&d, each_record, &s);
        const int L = 5, blocks = L + L * (L - 1) / 2, nested = (L - 1) + (L - 1) * (L - 2) / 2;
        const int want = 2 + (flash ? 3 : 2) * (blocks + nested);
        TEST_CHECK(s.count == want && s.bad == 0, "%s: %d policies (want %d), %d named twice or not parsing back", d.attn, s.count, want, s.bad);
        TEST_CHECK(!strcmp(s.names[0], "none") && !strcmp(s.names[1], "selective"), "first two: '%s', '%s'", s.names[0], s.names[1]);
    }
    TEST_CHECK(tsys_checkpoint_candidate_better(true, 9, 9, false, 1, 1), "fitting beats not fitting");
    TEST_CHECK(!tsys_checkpoint_candidate_better(false, 1, 1, true, 9, 9), "not fitting loses to fitting");
    TEST_CHECK(tsys_checkpoint_candidate_better(true, 1, 9, true, 2, 1) && !tsys_checkpoint_candidate_better(true, 2, 1, true, 1, 9), "fitting: the cheaper");
    TEST_CHECK(tsys_checkpoint_candidate_better(true, 1, 1, true, 1, 2) && !tsys_checkpoint_candidate_better(true, 1, 2, true, 1, 2), "fitting, same cost: the smaller peak");
    TEST_CHECK(tsys_checkpoint_candidate_better(false, 9, 1, false, 1, 2) && !tsys_checkpoint_candidate_better(false, 1, 2, false, 9, 2), "not fitting: the smaller peak");
}

// ---- errors -------------------------------------------------------------------------------------------

static void begin_in_hook(tsys_ctx *ctx, tsys_tensor *p, void *u) { (void)p; *(tsys_status *)u = tsys_checkpoint_begin(ctx); }

TSYS_TEST(misuse_is_reported_with_the_rule) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    TEST_CHECK(tsys_checkpoint_end(ctx) == TSYS_ERR_INVALID_ARGS && strstr(tsys_ctx_last_error(ctx), "no region is open"), "end without begin: '%s'", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    chain k;
    chain_make(ctx, &k);
    tsys_checkpoint_begin(ctx);
    TEST_CHECK(tsys_checkpoint_depth(ctx) == 1, "depth %d", tsys_checkpoint_depth(ctx));
    tsys_tensor *a = tsys_linear(ctx, k.x, k.w[0], NULL), *l = tsys_sum(ctx, a);
    TEST_CHECK(tsys_backward(ctx, l) == TSYS_ERR_INVALID_ARGS && strstr(tsys_ctx_last_error(ctx), "still open"), "backward in an open region: '%s'", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    tsys_tape_clear(ctx);   // abandons the open region with the tape
    TEST_CHECK(tsys_checkpoint_depth(ctx) == 0, "tape_clear leaves %d regions open", tsys_checkpoint_depth(ctx));
    tsys_tensor_release(a); tsys_tensor_release(l);
    tsys_status in_hook = TSYS_OK;
    tsys_tensor_add_grad_hook(k.w[0], begin_in_hook, &in_hook);
    a = tsys_linear(ctx, k.x, k.w[0], NULL); l = tsys_sum(ctx, a);
    tsys_backward(ctx, l);
    TEST_CHECK(in_hook == TSYS_ERR_INVALID_ARGS && strstr(tsys_ctx_last_error(ctx), "during backward"), "begin in a hook: '%s'", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    tsys_tensor_release(a); tsys_tensor_release(l);
    chain_free(&k);
    // policies: each bad one names itself and the rule
    struct { const char *s, *rule; } bad[] = {
        {"blocks:0", "K from 1 to num_layers (4)"}, {"blocks:5", "K from 1 to num_layers (4)"}, {"blocks:", "K from 1"}, {"blocks:2x", "K from 1"},
        {"nested:1", "K from 2 to num_layers"}, {"nested:9", "K from 2"}, {"auto:", "positive size"}, {"auto:-5G", "positive size"},
        {"auto:12Q", "positive size"}, {"auto:nan", "positive size"}, {"selective+selective", "unknown policy"}, {"+selective", "unknown policy"},
        {"auto:1G+selective", "unknown policy"}, {"everything", "unknown policy"}, {"selective+keep-attn", "block regions alone"},
        {"blocks:2+selective+keep-attn", "block regions alone"}, {"none+keep-attn", "unknown policy"}, {"blocks:1+first:0", "N from 1 to num_layers (4)"},
        {"blocks:1+first:5", "N from 1 to num_layers (4)"}, {"blocks:1+first:", "N from 1"}, {"selective+first:2", "+first:N goes with block regions"},
        {"first:2", "unknown policy"}, {"blocks:1+first:2+keep-attn", "N from 1"}};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        tsys_checkpoint_policy p;
        char err[512] = "";
        TEST_CHECK(tsys_checkpoint_policy_parse(bad[i].s, 4, &p, err, sizeof(err)) == TSYS_ERR_INVALID_ARGS, "'%s' accepted", bad[i].s);
        TEST_CHECK(strstr(err, bad[i].s) && strstr(err, bad[i].rule), "'%s': message '%s'", bad[i].s, err);
    }
    struct { const char *s; int seg, inner; bool sel; double budget; } good[] = {
        {"none", 0, 0, false, 0}, {"blocks:3", 3, 0, false, 0}, {"sqrt", 2, 0, false, 0}, {"nested", 2, 1, false, 0}, {"nested:3+selective", 3, 1, true, 0},
        {"selective", 0, 0, true, 0}, {"sqrt+selective", 2, 0, true, 0}, {"auto:1.5GiB", 0, 0, false, 1.5 * 1073741824.0}, {"auto:512M", 0, 0, false, 512.0 * 1048576}};
    for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
        tsys_checkpoint_policy p;
        char err[512] = "";
        tsys_status st = tsys_checkpoint_policy_parse(good[i].s, 4, &p, err, sizeof(err));
        TEST_CHECK(st == TSYS_OK && p.segment == good[i].seg && p.inner == good[i].inner && p.selective == good[i].sel && p.budget == good[i].budget,
                   "'%s': %s; segment %d inner %d selective %d budget %g", good[i].s, err, p.segment, p.inner, p.selective, p.budget);
    }
    tsys_checkpoint_policy fp;
    char name[48];
    TEST_CHECK(tsys_checkpoint_policy_parse("blocks:1+keep-attn+first:3", 4, &fp, NULL, 0) == TSYS_OK && fp.segment == 1 && fp.keep_attention && fp.first == 3,
               "blocks:1+keep-attn+first:3: segment %d keep %d first %d", fp.segment, fp.keep_attention, fp.first);
    tsys_checkpoint_policy_name(&fp, name, sizeof(name));
    TEST_CHECK(!strcmp(name, "blocks:1+keep-attn+first:3"), "its name reads '%s'", name);
    TEST_CHECK(tsys_checkpoint_policy_parse("nested:2+first:4", 4, &fp, NULL, 0) == TSYS_OK && fp.first == 0, "+first:N of every block is the policy alone");
    tsys_model_desc d = small_desc("naive", "blocks:7");
    TEST_CHECK(tsys_model_new(ctx, &d, TSYS_CPU, 1) == NULL && strstr(tsys_ctx_last_error(ctx), "blocks:7"), "model with blocks:7 of 4: '%s'", tsys_ctx_last_error(ctx));
    tsys_ctx_free(ctx);
}

int main(int argc, char **argv) { return tsys_test_main(argc, argv); }
