// test_checkpoint.c - activation checkpointing: checkpointed regions in the autograd (gradients bit
// for bit those of the run without them, nested regions, gradient-ready hooks once each), the model's
// policies, what the memory tracker measures against the accounting, and the planner.
#define TSYS_IMPLEMENTATION
#include "../tsys.h"
#include "harness.h"
#include "test_util.h"

// ---- a small model, run once per policy -----------------------------------------------------------

static tsys_model_desc small_desc(const char *attn, const char *policy) {
    tsys_model_desc d = tsys_model_desc_defaults(NULL);
    d.vocab_size = 61; d.context_length = 16; d.d_model = 32; d.num_layers = 4; d.num_heads = 4; d.d_ff = 80;
    d.attn = attn; d.checkpoint = policy;
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
    tsys_tensor *logits = m ? tsys_model_forward(m, ids) : NULL;
    tsys_tensor *loss = tsys_cross_entropy(ctx, logits, tgt);
    if (autocast != TSYS_F32) tsys_autocast_end(ctx);
    tsys_tensor_release(logits);
    r->kept = tsys_mem_stats_get(ctx, TSYS_CPU).category_bytes[TSYS_MEM_ACTIVATIONS] - (int64_t)(tsys_tensor_bytes(ids) + tsys_tensor_bytes(tgt));
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
                                       "blocks:2+selective", "nested:2+selective", "blocks:4+selective"};
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

int main(int argc, char **argv) { return tsys_test_main(argc, argv); }
