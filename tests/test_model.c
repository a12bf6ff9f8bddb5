// test_model.c - the cs336 model against PyTorch fixtures (logits, loss, every gradient, AdamW),
// model configuration checks, autocast rules, loss scaling, optimizers and schedules.
#define _POSIX_C_SOURCE 200809L   // mkdtemp
#define TSYS_IMPLEMENTATION
#include "../tsys.h"
#include "harness.h"
#include "test_util.h"
#include <unistd.h>
#include <sys/stat.h>   // mkdir

#ifndef TSYS_FIXTURES
#define TSYS_FIXTURES "tests/fixtures"
#endif

static tsys_model_desc fixture_desc(void) {
    tsys_model_desc d;
    memset(&d, 0, sizeof(d));
    d.vocab_size = 256; d.context_length = 16; d.d_model = 32; d.num_layers = 2; d.num_heads = 4; d.d_ff = 64;
    return tsys_model_desc_defaults(&d);
}

// The named tensor of a loaded list, or NULL.
static tsys_tensor *find(tsys_tensor **list, int n, const char *name) {
    for (int i = 0; i < n; i++) if (!strcmp(list[i]->name, name)) return list[i];
    return NULL;
}

// ||a - b|| / ||b|| over two tensors of equal size (any dtype/device).
static double rel_err(tsys_ctx *ctx, const tsys_tensor *a, const tsys_tensor *b) {
    if (!a || !b || tsys_tensor_numel(a) != tsys_tensor_numel(b)) return INFINITY;
    float *x = test_read(ctx, a), *y = test_read(ctx, b);
    double e = tsys_test_rel_err(x, y, (long)tsys_tensor_numel(a));
    free(x); free(y);
    return e;
}

typedef struct fixture {
    tsys_ctx *ctx;
    tsys_model *model;
    tsys_tensor **batch;
    int nbatch;
    tsys_tensor *ids, *targets;
} fixture;

static bool fixture_open(fixture *f) {
    memset(f, 0, sizeof(*f));
    f->ctx = tsys_ctx_new(NULL);
    tsys_model_desc d = fixture_desc();
    f->model = tsys_model_new(f->ctx, &d, TSYS_CPU, 1);
    tsys_status s1 = tsys_model_load(f->model, TSYS_FIXTURES "/model.safetensors");
    tsys_status s2 = tsys_safetensors_load(f->ctx, TSYS_FIXTURES "/batch.safetensors", TSYS_CPU, &f->batch, &f->nbatch);
    TEST_CHECK(s1 == TSYS_OK && s2 == TSYS_OK, "loading fixtures: %s", tsys_ctx_last_error(f->ctx));
    f->ids = find(f->batch, f->nbatch, "input_ids");
    f->targets = find(f->batch, f->nbatch, "targets");
    return s1 == TSYS_OK && s2 == TSYS_OK && f->ids && f->targets;
}

static void fixture_close(fixture *f) {
    tsys_tensor_list_free(f->batch, f->nbatch);
    tsys_model_free(f->model);
    tsys_ctx_free(f->ctx);
}

TSYS_TEST(model_matches_pytorch_logits_loss_grads) {
    fixture f;
    if (!fixture_open(&f)) { fixture_close(&f); return; }
    tsys_ctx *ctx = f.ctx;
    tsys_tensor *logits = tsys_model_forward(f.model, f.ids);
    tsys_tensor *loss = tsys_cross_entropy(ctx, logits, f.targets);
    double el = rel_err(ctx, logits, find(f.batch, f.nbatch, "logits"));
    double eloss = rel_err(ctx, loss, find(f.batch, f.nbatch, "loss"));
    TEST_CHECK(el < 1e-5, "logits relative error %.3g", el);
    TEST_CHECK(eloss < 1e-5, "loss relative error %.3g (ours %.7f)", eloss, tsys_item(ctx, loss));
    TEST_CHECK(tsys_backward(ctx, loss) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    tsys_tensor **p = tsys_model_params(f.model);
    int checked = 0;
    for (int i = 0; i < tsys_model_num_tensors(f.model); i++) {
        char name[160];
        snprintf(name, sizeof(name), "grad.%s", p[i]->name);
        double e = rel_err(ctx, p[i]->grad, find(f.batch, f.nbatch, name));
        TEST_CHECK(e < 1e-4, "%s relative error %.3g", name, e);
        checked++;
    }
    TEST_CHECK(checked == 21, "checked %d gradients, the model has 21 tensors", checked);
    tsys_tensor_release(logits); tsys_tensor_release(loss);
    fixture_close(&f);
}

TSYS_TEST(model_matches_pytorch_after_3_adamw_steps) {
    fixture f;
    if (!fixture_open(&f)) { fixture_close(&f); return; }
    tsys_ctx *ctx = f.ctx;
    tsys_optim_desc od;
    memset(&od, 0, sizeof(od));
    od.lr = 1e-2f;
    tsys_optim *opt = tsys_adamw_new(ctx, tsys_model_params(f.model), tsys_model_num_tensors(f.model), &od);
    for (int step = 1; step <= 3; step++) {
        tsys_optim_zero_grad(opt);
        tsys_tensor *logits = tsys_model_forward(f.model, f.ids);
        tsys_tensor *loss = tsys_cross_entropy(ctx, logits, f.targets);
        char name[32];
        snprintf(name, sizeof(name), "loss_step%d", step);
        double e = rel_err(ctx, loss, find(f.batch, f.nbatch, name));
        TEST_CHECK(e < 1e-5, "%s relative error %.3g", name, e);
        tsys_backward(ctx, loss);
        tsys_optim_step(opt);
        tsys_tensor_release(logits); tsys_tensor_release(loss);
    }
    tsys_tensor **p = tsys_model_params(f.model);
    for (int i = 0; i < tsys_model_num_tensors(f.model); i++) {
        char name[160];
        snprintf(name, sizeof(name), "adamw3.%s", p[i]->name);
        double e = rel_err(ctx, p[i], find(f.batch, f.nbatch, name));
        TEST_CHECK(e < 1e-5, "%s relative error %.3g", name, e);
    }
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    tsys_optim_free(opt);
    fixture_close(&f);
}

TSYS_TEST(model_low_precision_loss_close_to_fp32) {
    fixture f;
    if (!fixture_open(&f)) { fixture_close(&f); return; }
    tsys_ctx *ctx = f.ctx;
    float ref = tsys_item(ctx, find(f.batch, f.nbatch, "loss"));
    tsys_dtype low[2] = {TSYS_BF16, TSYS_F16};
    for (int k = 0; k < 2; k++) {
        tsys_autocast_begin(ctx, low[k]);
        tsys_tensor *logits = tsys_model_forward(f.model, f.ids);
        tsys_tensor *loss = tsys_cross_entropy(ctx, logits, f.targets);
        tsys_autocast_end(ctx);
        TEST_CHECK(logits && logits->dtype == low[k], "logits dtype %s under %s autocast", logits ? tsys_dtype_name(logits->dtype) : "-", tsys_dtype_name(low[k]));
        TEST_CHECK(loss && loss->dtype == TSYS_F32, "loss must be fp32");
        float v = tsys_item(ctx, loss);
        TEST_CHECK(fabsf(v - ref) < 1e-2f, "%s loss %.5f vs fp32 %.5f", tsys_dtype_name(low[k]), v, ref);
        TEST_CHECK(tsys_backward(ctx, loss) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
        tsys_tensor **p = tsys_model_params(f.model);
        for (int i = 0; i < tsys_model_num_tensors(f.model); i++)
            TEST_CHECK(p[i]->dtype == TSYS_F32 && p[i]->grad->dtype == TSYS_F32, "%s: params and grads stay fp32", p[i]->name);
        tsys_zero_grads(ctx, p, tsys_model_num_tensors(f.model));
        tsys_tensor_release(logits); tsys_tensor_release(loss);
    }
    fixture_close(&f);
}

// The CS336 ToyModel: fc1 (no bias) -> relu -> LayerNorm -> fc2 (no bias), under autocast.
TSYS_TEST(autocast_toy_model_dtypes) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t sx[2] = {4, 6}, s1[2] = {10, 6}, s2[2] = {3, 10}, sln[1] = {10}, st[1] = {4};
    tsys_tensor *x = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 2, sx), *tgt = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 1, st);
    tsys_tensor *w1 = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 2, s1), *w2 = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 2, s2);
    tsys_tensor *g = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, sln), *b = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, sln);
    tsys_tensor_randn(ctx, x, 1); tsys_tensor_randn(ctx, w1, 0.3f); tsys_tensor_randn(ctx, w2, 0.3f);
    tsys_tensor_fill(ctx, g, 1); tsys_tensor_fill(ctx, b, 0); tsys_tensor_randint(ctx, tgt, 3);
    tsys_tensor *params[4] = {w1, w2, g, b};
    for (int i = 0; i < 4; i++) tsys_tensor_set_requires_grad(params[i], true);
    tsys_dtype low[2] = {TSYS_F16, TSYS_BF16};
    for (int k = 0; k < 2; k++) {
        tsys_autocast_begin(ctx, low[k]);
        tsys_tensor *h = tsys_linear(ctx, x, w1, NULL), *r = tsys_relu(ctx, h), *n = tsys_layernorm(ctx, r, g, b, 1e-5f);
        tsys_tensor *logits = tsys_linear(ctx, n, w2, NULL), *loss = tsys_cross_entropy(ctx, logits, tgt);
        tsys_autocast_end(ctx);
        TEST_CHECK(h->dtype == low[k], "fc1 output is %s", tsys_dtype_name(h->dtype));
        TEST_CHECK(n->dtype == TSYS_F32, "layernorm output is %s, expected f32", tsys_dtype_name(n->dtype));
        TEST_CHECK(logits->dtype == low[k], "logits are %s", tsys_dtype_name(logits->dtype));
        TEST_CHECK(loss->dtype == TSYS_F32, "loss is %s", tsys_dtype_name(loss->dtype));
        tsys_backward(ctx, loss);
        for (int i = 0; i < 4; i++)
            TEST_CHECK(params[i]->dtype == TSYS_F32 && params[i]->grad && params[i]->grad->dtype == TSYS_F32, "parameter %d or its grad not fp32", i);
        tsys_tensor *ts[5] = {h, r, n, logits, loss};
        for (int i = 0; i < 5; i++) tsys_tensor_release(ts[i]);
    }
    for (int i = 0; i < 4; i++) tsys_tensor_release(params[i]);
    tsys_tensor_release(x); tsys_tensor_release(tgt);
    tsys_ctx_free(ctx);
}

TSYS_TEST(grad_scaler_skips_inf_and_grows) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t s[1] = {4};
    tsys_tensor *p = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, s);
    tsys_tensor_fill(ctx, p, 1.0f);
    tsys_tensor_set_requires_grad(p, true);
    tsys_optim *opt = tsys_sgd_new(ctx, &p, 1, 0.1f);
    tsys_grad_scaler sc = tsys_grad_scaler_init();
    TEST_CHECK(sc.scale == 65536.0f && sc.growth_interval == 2000, "GradScaler defaults");
    sc.growth_interval = 3;
    // a step whose gradient overflowed: skipped, scale halves
    tsys_tensor *q = tsys_mul(ctx, p, p), *l = tsys_sum(ctx, q), *ls = tsys_grad_scaler_scale(ctx, &sc, l);
    tsys_backward(ctx, ls);
    ((float *)tsys_tensor_data(p->grad))[2] = INFINITY;
    tsys_grad_scaler_step(&sc, opt);
    tsys_grad_scaler_update(&sc);
    TEST_CHECK(sc.found_inf && ((float *)tsys_tensor_data(p))[0] == 1.0f, "step with inf was not skipped");
    TEST_CHECK(sc.scale == 32768.0f, "scale after inf %g, expected 32768", sc.scale);
    tsys_tensor_release(q); tsys_tensor_release(l); tsys_tensor_release(ls);
    // three clean steps: unscaled gradients (2p) are applied, then the scale doubles
    for (int i = 0; i < 3; i++) {
        tsys_optim_zero_grad(opt);
        float before = ((float *)tsys_tensor_data(p))[0];
        q = tsys_mul(ctx, p, p); l = tsys_sum(ctx, q); ls = tsys_grad_scaler_scale(ctx, &sc, l);
        tsys_backward(ctx, ls);
        tsys_grad_scaler_step(&sc, opt);
        tsys_grad_scaler_update(&sc);
        float after = ((float *)tsys_tensor_data(p))[0];
        TEST_CHECK(fabsf(after - (before - 0.1f * 2 * before)) < 1e-6f, "clean step %d: %g -> %g", i, before, after);
        tsys_tensor_release(q); tsys_tensor_release(l); tsys_tensor_release(ls);
    }
    TEST_CHECK(sc.scale == 65536.0f && sc.growth_tracker == 0, "scale after 3 clean steps %g", sc.scale);
    tsys_optim_free(opt);
    tsys_tensor_release(p);
    tsys_ctx_free(ctx);
}

TSYS_TEST(adamw_matches_reference_math) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t s[1] = {7};
    tsys_tensor *p = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, s);
    tsys_tensor_randn(ctx, p, 1);
    tsys_tensor_set_requires_grad(p, true);
    double ref[7], m[7] = {0}, v[7] = {0};
    for (int i = 0; i < 7; i++) ref[i] = ((float *)tsys_tensor_data(p))[i];
    tsys_optim_desc d;
    memset(&d, 0, sizeof(d));
    d.lr = 0.1f; d.weight_decay = 0.1f;
    tsys_optim *opt = tsys_adamw_new(ctx, &p, 1, &d);
    for (int t = 1; t <= 5; t++) {
        tsys_optim_zero_grad(opt);
        tsys_tensor *q = tsys_mul(ctx, p, p), *l = tsys_sum(ctx, q);   // grad 2p
        tsys_backward(ctx, l);
        tsys_optim_step(opt);
        for (int i = 0; i < 7; i++) {   // torch.optim.AdamW, in double
            double g = 2 * ref[i];
            ref[i] *= 1 - 0.1 * 0.1;
            m[i] = 0.9 * m[i] + 0.1 * g; v[i] = 0.999 * v[i] + 0.001 * g * g;
            double mh = m[i] / (1 - pow(0.9, t)), vh = v[i] / (1 - pow(0.999, t));
            ref[i] -= 0.1 * mh / (sqrt(vh) + 1e-8);
        }
        tsys_tensor_release(q); tsys_tensor_release(l);
    }
    double worst = 0;
    for (int i = 0; i < 7; i++) worst = fmax(worst, fabs(((float *)tsys_tensor_data(p))[i] - ref[i]));
    TEST_CHECK(worst < 1e-5, "AdamW differs from the reference by %g", worst);
    tsys_optim_free(opt);
    tsys_tensor_release(p);
    tsys_ctx_free(ctx);
}

// tsys_optim_sum_grads (DDP's ce_gather): AdamW reading the ranks' gradients summed in rank order gives the
// bits of AdamW on the host's sum, fp32 gradients or some kept in bf16 among fp32 ones; and what it refuses,
// each with a message naming the rule.
TSYS_TEST(adamw_sums_ranks_gradients) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    const int64_t vec[3] = {1024, 1004, 36}, odd[3] = {1024, 1003, 37};
    const int64_t d2 = test_sum_grads_case(ctx, TSYS_CPU, 2, 1, vec, 3, 0, 0u), d3 = test_sum_grads_case(ctx, TSYS_CPU, 3, 1, odd, 3, 32, 0u),
                  d4 = test_sum_grads_case(ctx, TSYS_CPU, 4, 0, odd, 2, 12, 0u);
    TEST_CHECK(d2 == 0 && d3 == 0 && d4 == 0, "elements apart from AdamW on the host's sum: %lld (2 ranks), %lld (3), %lld (4): %s", (long long)d2, (long long)d3,
               (long long)d4, tsys_ctx_last_error(ctx));
    const int64_t b2 = test_sum_grads_case(ctx, TSYS_CPU, 2, 0, vec, 3, 0, 3u), b3 = test_sum_grads_case(ctx, TSYS_CPU, 3, 2, vec, 3, 8, 5u);
    TEST_CHECK(b2 == 0 && b3 == 0, "bf16 gradients among fp32 ones: %lld (2 ranks), %lld (3) elements apart: %s", (long long)b2, (long long)b3, tsys_ctx_last_error(ctx));
    // places given (tsys_optim_sum_grads_at, FSDP's shards): out of order, one parameter without terms (its own
    // gradient the mean), bf16 terms beside fp32 ones
    const int64_t rev[3] = {4144, -1, 0}, mix[3] = {-1, 8192, 64};
    const int64_t p2 = test_sum_grads_case_at(ctx, TSYS_CPU, 2, 1, vec, 3, 0, 0u, rev), p3 = test_sum_grads_case_at(ctx, TSYS_CPU, 3, 0, vec, 3, 16, 5u, mix);
    TEST_CHECK(p2 == 0 && p3 == 0, "places given: %lld (2 ranks), %lld (3, bf16 among fp32) elements apart: %s", (long long)p2, (long long)p3, tsys_ctx_last_error(ctx));
    int64_t n = 8, seven = 7, two = 16, three = 24;
    tsys_tensor *p = test_param(ctx, TSYS_CPU, 1, &n, 1.0f), *t2 = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, &two), *t3 = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, &three);
    tsys_tensor *odd_bf16[2] = {test_param(ctx, TSYS_CPU, 1, &seven, 1.0f), test_param(ctx, TSYS_CPU, 1, &n, 1.0f)};
    tsys_tensor_set_grad_dtype(ctx, odd_bf16[0], TSYS_BF16);   // 14 bytes: the fp32 gradient after it would start 2 bytes off
    tsys_optim *adam = tsys_adamw_new(ctx, &p, 1, NULL), *sgd = tsys_sgd_new(ctx, &p, 1, 0.1f), *skew = tsys_adamw_new(ctx, odd_bf16, 2, NULL);
    struct { tsys_optim *o; tsys_tensor *t; int ranks, self; int64_t stride; const char *says; } bad[] = {
        {sgd, t2, 3, 0, 0, "only AdamW"}, {adam, t2, 1, 0, 0, "2 or more ranks"}, {adam, t2, 3, 3, 0, "self one of them"},
        {adam, t2, 4, 0, 0, "(64 bytes on cpu; 4 ranks - 1 slots 32 bytes apart of the 32 gradient bytes) holds fewer bytes"},
        {adam, t2, 3, 0, 36, "holds fewer bytes than the slots"}, {adam, t2, 2, 0, 28, "28 bytes apart of the 32 gradient bytes) is less than"},
        {skew, t3, 2, 0, 0, "at byte 14 of a slot 0 bytes apart) would start its gradient's terms off its element size"}};
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        tsys_status st = tsys_optim_sum_grads(bad[k].o, bad[k].t, bad[k].ranks, bad[k].self, bad[k].stride);
        TEST_CHECK(st != TSYS_OK && strstr(tsys_ctx_last_error(ctx), bad[k].says), "case %zu: status %d, '%s'", k, (int)st, tsys_ctx_last_error(ctx));
        tsys_ctx_clear_error(ctx);
    }
    const int64_t at0[1] = {0}, at8[1] = {8}, at_skew[2] = {0, 16}, at_over[2] = {0, 12};
    struct { tsys_optim *o; int64_t stride; const int64_t *at; const char *says; } bad_at[] = {
        {adam, 0, at0, "stride_bytes 0 (it must be > 0)"}, {adam, 32, NULL, "no places"}, {adam, 32, at8, "at byte 8 of a slot 32 bytes apart) would end its terms past the slot"},
        {skew, 64, at_over, "at byte 12 of a slot 64 bytes apart) has terms that overlap another"}, {skew, 64, at_skew, NULL}};
    for (size_t k = 0; k < sizeof bad_at / sizeof bad_at[0]; k++) {
        tsys_status st = tsys_optim_sum_grads_at(bad_at[k].o, t3, 2, 0, bad_at[k].stride, bad_at[k].at);
        TEST_CHECK(bad_at[k].says ? st != TSYS_OK && strstr(tsys_ctx_last_error(ctx), bad_at[k].says) : st == TSYS_OK, "places case %zu: status %d, '%s'", k, (int)st,
                   tsys_ctx_last_error(ctx));
        tsys_ctx_clear_error(ctx);
    }
    TEST_CHECK(tsys_optim_sum_grads(adam, t3, 4, 3, 0) == TSYS_OK && tsys_optim_sum_grads(adam, t2, 2, 0, 64) == TSYS_OK, "4 ranks, 2 ranks with a stride: %s",
               tsys_ctx_last_error(ctx));
    TEST_CHECK(tsys_optim_overlap_begin(adam) != TSYS_OK && strstr(tsys_ctx_last_error(ctx), "sums ranks' gradients"), "overlap allowed: '%s'", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(tsys_optim_sum_grads(adam, NULL, 0, 0, 0) == TSYS_OK && tsys_optim_overlap_begin(adam) == TSYS_OK && tsys_optim_overlap_end(adam) == TSYS_OK,
               "plain gradients again: %s", tsys_ctx_last_error(ctx));
    tsys_optim_free(adam); tsys_optim_free(sgd); tsys_optim_free(skew);
    tsys_tensor_release(p); tsys_tensor_release(t2); tsys_tensor_release(t3); tsys_tensor_release(odd_bf16[0]); tsys_tensor_release(odd_bf16[1]);
    tsys_ctx_free(ctx);
}

// TSYS_OPTIM_CALLER_READY: parameters updated inside backward when the caller says their gradients are in
// (a run of one gradient arena cut by the caller's range, one told twice, one never) give the bits of the step
// after backward, with and without the ranks' terms; what tsys_optim_overlap_ready refuses, naming the rule.
TSYS_TEST(overlap_ready_updates_what_it_is_told) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    const int64_t plain = test_caller_ready_case(ctx, TSYS_CPU, false), summed = test_caller_ready_case(ctx, TSYS_CPU, true);
    TEST_CHECK(plain == 0 && summed == 0, "elements apart from the step after backward: %lld, %lld with terms: %s", (long long)plain, (long long)summed, tsys_ctx_last_error(ctx));
    int64_t n = 8;
    tsys_tensor *p = test_param(ctx, TSYS_CPU, 1, &n, 1.0f), *q = test_param(ctx, TSYS_CPU, 1, &n, 1.0f);
    tsys_optim *adam = tsys_adamw_new(ctx, &p, 1, NULL);
    TEST_CHECK(tsys_optim_overlap_ready(adam, &p, 1, TSYS_STREAM_COMPUTE) != TSYS_OK && strstr(tsys_ctx_last_error(ctx), "outside tsys_optim_overlap_begin_ex(opt, TSYS_OPTIM_CALLER_READY)"),
               "told outside: '%s'", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(tsys_optim_overlap_begin_ex(adam, TSYS_OPTIM_CALLER_READY | TSYS_OPTIM_FREE_GRADS) != TSYS_OK && strstr(tsys_ctx_last_error(ctx), "goes with neither"),
               "with FREE_GRADS: '%s'", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(tsys_optim_overlap_begin_ex(adam, TSYS_OPTIM_CALLER_READY) == TSYS_OK && tsys_optim_overlap_ready(adam, &q, 1, TSYS_STREAM_COMPUTE) != TSYS_OK &&
               strstr(tsys_ctx_last_error(ctx), "is not this optimizer's parameter"), "another tensor: '%s'", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    tsys_optim_overlap_end(adam);
    tsys_ctx_clear_error(ctx);
    tsys_optim_free(adam);
    tsys_tensor_release(p); tsys_tensor_release(q);
    tsys_ctx_free(ctx);
}

// tsys_optim_overlap_skip: a parameter skipped inside a CALLER_READY overlap keeps its value and its moments
// (overlap_end does not update it) while the one told is updated as AdamW over it alone would; skipping one
// already updated, or outside the overlap, is refused, naming the rule.
TSYS_TEST(overlap_skip_leaves_a_parameter_alone) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t n = 8;
    tsys_tensor *p = test_param(ctx, TSYS_CPU, 1, &n, 1.0f), *q = test_param(ctx, TSYS_CPU, 1, &n, 1.0f), *r = test_param(ctx, TSYS_CPU, 1, &n, 1.0f);
    tsys_tensor *ps[2] = {p, q};
    for (int i = 0; i < 3; i++) {   // gradients: 0.25 * (k + 1) for element k, the same for r (p's twin)
        tsys_tensor *t = i == 0 ? p : i == 1 ? q : r;
        t->grad = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, &n);
        for (int k = 0; k < n; k++) ((float *)tsys_tensor_data(t->grad))[k] = 0.25f * (float)(k + 1);
    }
    memcpy(tsys_tensor_data(r), tsys_tensor_data(p), (size_t)n * sizeof(float));
    float q0[8];
    memcpy(q0, tsys_tensor_data(q), sizeof q0);
    tsys_optim *both = tsys_adamw_new(ctx, ps, 2, NULL), *alone = tsys_adamw_new(ctx, &r, 1, NULL);
    TEST_CHECK(tsys_optim_overlap_skip(both, &q, 1) != TSYS_OK && strstr(tsys_ctx_last_error(ctx), "outside tsys_optim_overlap_begin_ex"), "skipped outside: '%s'",
               tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(tsys_optim_overlap_begin_ex(both, TSYS_OPTIM_CALLER_READY) == TSYS_OK && tsys_optim_overlap_ready(both, &p, 1, TSYS_STREAM_COMPUTE) == TSYS_OK &&
               tsys_optim_overlap_skip(both, &q, 1) == TSYS_OK, "ready and skip: %s", tsys_ctx_last_error(ctx));
    TEST_CHECK(tsys_optim_overlap_skip(both, &p, 1) != TSYS_OK && strstr(tsys_ctx_last_error(ctx), "already updated or skipped"), "p skipped after its update: '%s'",
               tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(tsys_optim_overlap_end(both) == TSYS_OK && tsys_optim_step(alone) == TSYS_OK, "end: %s", tsys_ctx_last_error(ctx));
    TEST_CHECK(!memcmp(tsys_tensor_data(p), tsys_tensor_data(r), (size_t)n * sizeof(float)), "p is not AdamW's update of it alone");
    TEST_CHECK(!memcmp(tsys_tensor_data(q), q0, sizeof q0), "q moved though skipped");
    tsys_tensor *mq = tsys_optim_state(both, 1, 0), *vq = tsys_optim_state(both, 1, 1);   // views: ours to release
    const float *m = (const float *)tsys_tensor_data(mq), *v = (const float *)tsys_tensor_data(vq);
    double moved = 0;
    for (int k = 0; m && v && k < n; k++) moved += fabs(m[k]) + fabs(v[k]);
    TEST_CHECK(m && v && moved == 0, "q's moments moved though skipped (sum of |m| + |v| %g)", moved);
    tsys_tensor_release(mq); tsys_tensor_release(vq);
    tsys_optim_free(both); tsys_optim_free(alone);
    tsys_tensor_release(p); tsys_tensor_release(q); tsys_tensor_release(r);
    tsys_ctx_free(ctx);
}

// Three fp32 parameters of 8 (a), their clones named p0..p2 (b), each with an fp32 gradient buffer.
static void shard_pair(tsys_ctx *ctx, tsys_tensor **a, tsys_tensor **b, int64_t n) {
    for (int i = 0; i < 3; i++) {
        a[i] = test_param(ctx, TSYS_CPU, 1, &n, 1.0f);
        b[i] = tsys_tensor_clone(ctx, a[i]);
        tsys_tensor_set_name(a[i], "p%d", i); tsys_tensor_set_name(b[i], "p%d", i);
        a[i]->grad = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, &n);
        b[i]->grad = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, &n);
    }
}

// desc.sharded_state: AdamW makes no moments at construction (the whole never exists), refuses to update before
// tsys_optim_shard_state, then holds exactly the listed parameters' moments and updates them with the bits of an
// AdamW holding every moment.
TSYS_TEST(optim_sharded_state_from_construction) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t n = 8;
    tsys_tensor *a[3], *b[3];
    shard_pair(ctx, a, b, n);
    for (int i = 0; i < 3; i++) {
        for (int k = 0; k < n; k++) ((float *)tsys_tensor_data(a[i]->grad))[k] = ((float *)tsys_tensor_data(b[i]->grad))[k] = 0.25f * (float)(k + 1) * (float)(i + 1);
    }
    tsys_optim *full = tsys_adamw_new(ctx, a, 3, NULL);
    const int64_t before = tsys_mem_stats_get(ctx, TSYS_CPU).category_bytes[TSYS_MEM_OPTIMIZER];
    tsys_optim_desc sharded;
    memset(&sharded, 0, sizeof sharded);
    sharded.sharded_state = true;
    tsys_optim *part = tsys_adamw_new(ctx, b, 3, &sharded);
    const int64_t made = tsys_mem_stats_get(ctx, TSYS_CPU).category_bytes[TSYS_MEM_OPTIMIZER] - before;
    TEST_CHECK(part && made < 2 * n * 4, "construction holds %lld bytes of optimizer state (less than one parameter's moments expected)", (long long)made);
    float p0[8];
    memcpy(p0, tsys_tensor_data(b[0]), sizeof p0);
    TEST_CHECK(tsys_optim_step(part) != TSYS_OK && strstr(tsys_ctx_last_error(ctx), "'p0' has no moments here") && tsys_optim_steps(part) == 0 &&
               !memcmp(tsys_tensor_data(b[0]), p0, sizeof p0), "a step before shard_state: '%s', %lld steps", tsys_ctx_last_error(ctx), (long long)tsys_optim_steps(part));
    tsys_ctx_clear_error(ctx);
    tsys_tensor *held[2] = {b[0], b[2]};
    TEST_CHECK(tsys_optim_shard_state(part, held, 2) == TSYS_OK, "shard: %s", tsys_ctx_last_error(ctx));
    const int64_t kept = tsys_mem_stats_get(ctx, TSYS_CPU).category_bytes[TSYS_MEM_OPTIMIZER] - before - made;
    TEST_CHECK(kept == 2 * 2 * n * 4, "the optimizer state grew by %lld bytes, expected %lld (two parameters' moments)", (long long)kept, (long long)(2 * 2 * n * 4));
    TEST_CHECK(tsys_optim_overlap_begin_ex(part, TSYS_OPTIM_CALLER_READY) == TSYS_OK && tsys_optim_overlap_ready(part, held, 2, TSYS_STREAM_COMPUTE) == TSYS_OK &&
               tsys_optim_overlap_skip(part, &b[1], 1) == TSYS_OK && tsys_optim_overlap_end(part) == TSYS_OK && tsys_optim_step(full) == TSYS_OK, "step: %s",
               tsys_ctx_last_error(ctx));
    for (int i = 0; i < 3; i += 2)
        TEST_CHECK(!memcmp(tsys_tensor_data(a[i]), tsys_tensor_data(b[i]), (size_t)n * 4), "p%d is not what AdamW holding every moment makes of it", i);
    tsys_optim_free(full); tsys_optim_free(part);
    for (int i = 0; i < 3; i++) { tsys_tensor_release(a[i]); tsys_tensor_release(b[i]); }
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    tsys_ctx_free(ctx);
}

// AdamW's moments of some parameters only (tsys_optim_shard_state, ZeRO-1's memory): two steps updating the held
// ones (and skipping the others) give them the bits of an AdamW that holds every moment; the others stay as they
// were; the optimizer state takes their bytes alone; their moments are NULL; a step that reaches one, a save of the
// optimizer and a shard after the first step are refused, naming what.
TSYS_TEST(optim_shard_state_keeps_only_its_moments) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t n = 8;
    tsys_tensor *a[3], *b[3];
    shard_pair(ctx, a, b, n);
    float q0[8];
    memcpy(q0, tsys_tensor_data(b[1]), sizeof q0);
    tsys_optim *full = tsys_adamw_new(ctx, a, 3, NULL), *part = tsys_adamw_new(ctx, b, 3, NULL);
    const int64_t before = tsys_mem_stats_get(ctx, TSYS_CPU).category_bytes[TSYS_MEM_OPTIMIZER];
    tsys_tensor *held[2] = {b[0], b[2]};
    TEST_CHECK(tsys_optim_shard_state(part, &a[0], 1) != TSYS_OK && strstr(tsys_ctx_last_error(ctx), "'p0' is not this optimizer's parameter"), "another's: '%s'",
               tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(tsys_optim_shard_state(part, held, 2) == TSYS_OK, "shard: %s", tsys_ctx_last_error(ctx));
    const int64_t after = tsys_mem_stats_get(ctx, TSYS_CPU).category_bytes[TSYS_MEM_OPTIMIZER];
    TEST_CHECK(before - after == 2 * n * 4, "the optimizer state shrank by %lld bytes, expected %lld (one parameter's two moments)", (long long)(before - after), (long long)(2 * n * 4));
    for (int step = 0; step < 2; step++) {
        for (int i = 0; i < 3; i++)   // the same gradients for both
            for (int k = 0; k < n; k++) ((float *)tsys_tensor_data(a[i]->grad))[k] = ((float *)tsys_tensor_data(b[i]->grad))[k] = 0.125f * (float)(k + 1 + step) * (float)(i + 1);
        TEST_CHECK(tsys_optim_overlap_begin_ex(part, TSYS_OPTIM_CALLER_READY) == TSYS_OK && tsys_optim_overlap_ready(part, held, 2, TSYS_STREAM_COMPUTE) == TSYS_OK &&
                   tsys_optim_overlap_skip(part, &b[1], 1) == TSYS_OK && tsys_optim_overlap_end(part) == TSYS_OK && tsys_optim_step(full) == TSYS_OK,
                   "step %d: %s", step, tsys_ctx_last_error(ctx));
    }
    for (int i = 0; i < 3; i += 2)
        TEST_CHECK(!memcmp(tsys_tensor_data(a[i]), tsys_tensor_data(b[i]), (size_t)n * 4), "p%d is not what AdamW holding every moment makes of it", i);
    TEST_CHECK(!memcmp(tsys_tensor_data(b[1]), q0, sizeof q0), "p1 moved though its moments are elsewhere");
    tsys_tensor *m1 = tsys_optim_state(part, 1, 0), *m2 = tsys_optim_state(part, 2, 1), *f2 = tsys_optim_state(full, 2, 1);
    TEST_CHECK(!m1 && m2 && f2 && !memcmp(tsys_tensor_data(m2), tsys_tensor_data(f2), (size_t)n * 4), "moments: p1's %s, p2's v %s", m1 ? "given" : "NULL",
               m2 && f2 && !memcmp(tsys_tensor_data(m2), tsys_tensor_data(f2), (size_t)n * 4) ? "equal to the full optimizer's" : "differs");
    tsys_tensor_release(m1); tsys_tensor_release(m2); tsys_tensor_release(f2);
    float p0[8];
    memcpy(p0, tsys_tensor_data(b[0]), sizeof p0);
    TEST_CHECK(tsys_optim_step(part) != TSYS_OK && strstr(tsys_ctx_last_error(ctx), "'p1' has no moments here"), "a step over p1: '%s'", tsys_ctx_last_error(ctx));
    TEST_CHECK(!memcmp(tsys_tensor_data(b[0]), p0, sizeof p0) && tsys_optim_steps(part) == 2, "the refused step updated p0 or counted itself (%lld steps)",
               (long long)tsys_optim_steps(part));
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(tsys_optim_shard_state(part, b, 3) != TSYS_OK && strstr(tsys_ctx_last_error(ctx), "before the first step"), "a shard after steps: '%s'", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    char dir[] = "/tmp/tsys_shardstate_XXXXXX";
    if (mkdtemp(dir)) {
        tsys_state_desc sd;
        memset(&sd, 0, sizeof sd);
        sd.optim = part; sd.tensors = b; sd.n_tensors = 3; sd.step = 2;
        TEST_CHECK(tsys_state_save(ctx, dir, &sd) != TSYS_OK && strstr(tsys_ctx_last_error(ctx), "holds no moments of 'p1' here"), "a save: '%s'", tsys_ctx_last_error(ctx));
        tsys_ctx_clear_error(ctx);
        char cmd[64];
        snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
        TEST_CHECK(system(cmd) == 0, "rm");
    }
    tsys_optim_free(full); tsys_optim_free(part);
    for (int i = 0; i < 3; i++) { tsys_tensor_release(a[i]); tsys_tensor_release(b[i]); }
    tsys_ctx_free(ctx);
}

// zero_grad only marks gradients as zero: the next backward must overwrite them, and a parameter
// the backward never reaches must still see zeros in the optimizer, not last step's values.
TSYS_TEST(lazy_zero_grad_overwrites_and_settles) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t s[2] = {3, 3};
    tsys_tensor *used = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 2, s), *unused = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 2, s);
    tsys_tensor *x = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 2, s);
    tsys_tensor_randn(ctx, used, 1); tsys_tensor_randn(ctx, unused, 1); tsys_tensor_randn(ctx, x, 1);
    tsys_tensor *ps[2] = {used, unused};
    for (int i = 0; i < 2; i++) tsys_tensor_set_requires_grad(ps[i], true);
    tsys_optim *opt = tsys_sgd_new(ctx, ps, 2, 0.5f);
    // step 1 uses both parameters, so both hold non-zero gradients afterwards
    tsys_tensor *h = tsys_linear(ctx, x, used, NULL), *h2 = tsys_linear(ctx, h, unused, NULL), *l = tsys_sum(ctx, h2);
    tsys_backward(ctx, l);
    tsys_optim_step(opt);
    tsys_tensor_release(h); tsys_tensor_release(h2); tsys_tensor_release(l);
    tsys_optim_zero_grad(opt);
    float before_unused[9], before_used[9], g_expect[9];
    memcpy(before_unused, tsys_tensor_data(unused), sizeof(before_unused));
    memcpy(before_used, tsys_tensor_data(used), sizeof(before_used));
    // step 2 reaches only `used`: d sum(x W^T) / dW = column sums of x, for every row of W
    h = tsys_linear(ctx, x, used, NULL); l = tsys_sum(ctx, h);
    tsys_backward(ctx, l);
    const float *xv = (const float *)tsys_tensor_data(x);
    for (int r = 0; r < 3; r++) for (int c = 0; c < 3; c++) g_expect[r * 3 + c] = xv[c] + xv[3 + c] + xv[6 + c];
    tsys_optim_step(opt);
    double worst_used = 0;
    for (int i = 0; i < 9; i++) worst_used = fmax(worst_used, fabs(((float *)tsys_tensor_data(used))[i] - (before_used[i] - 0.5f * g_expect[i])));
    TEST_CHECK(worst_used < 1e-5, "the new gradient was added to the old one: error %g", worst_used);
    TEST_CHECK(memcmp(before_unused, tsys_tensor_data(unused), sizeof(before_unused)) == 0, "an unreached parameter moved with a stale gradient");
    tsys_tensor_release(h); tsys_tensor_release(l);
    tsys_optim_free(opt);
    for (int i = 0; i < 2; i++) tsys_tensor_release(ps[i]);
    tsys_tensor_release(x);
    tsys_ctx_free(ctx);
}

// Casting and accumulating into existing tensors (what FSDP's group of one does instead of a
// collective): the bits of tsys_cast, and of an fp32 sum after a cast; bad sizes are refused.
TSYS_TEST(cast_from_and_accumulate_match_cast_and_add) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t n = 4099;
    tsys_tensor *x = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, &n), *g = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, &n);
    tsys_tensor_randn(ctx, x, 3); tsys_tensor_randn(ctx, g, 1);
    tsys_dtype lows[2] = {TSYS_BF16, TSYS_F16};
    for (int i = 0; i < 2; i++) {
        tsys_tensor *ref = tsys_cast(ctx, x, lows[i]), *into = tsys_tensor_new(ctx, lows[i], TSYS_CPU, 1, &n);
        TEST_CHECK(tsys_tensor_cast_from(ctx, into, x) == TSYS_OK && memcmp(tsys_tensor_data(ref), tsys_tensor_data(into), tsys_tensor_bytes(ref)) == 0, "%s: cast_from differs from tsys_cast", tsys_dtype_name(lows[i]));
        tsys_tensor *up = tsys_cast(ctx, ref, TSYS_F32), *sum = tsys_add(ctx, g, up), *acc = tsys_tensor_clone(ctx, g);
        TEST_CHECK(tsys_tensor_accumulate(ctx, acc, ref) == TSYS_OK && memcmp(tsys_tensor_data(sum), tsys_tensor_data(acc), tsys_tensor_bytes(sum)) == 0, "%s: accumulate differs from add after a cast", tsys_dtype_name(lows[i]));
        tsys_tensor *back = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, &n);
        TEST_CHECK(tsys_tensor_cast_from(ctx, back, ref) == TSYS_OK && memcmp(tsys_tensor_data(up), tsys_tensor_data(back), tsys_tensor_bytes(up)) == 0, "%s: cast_from to fp32", tsys_dtype_name(lows[i]));
        tsys_tensor *tl[6] = {ref, into, up, sum, acc, back};
        for (int k = 0; k < 6; k++) tsys_tensor_release(tl[k]);
    }
    int64_t m = n - 1;
    tsys_tensor *short_one = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, &m);
    TEST_CHECK(tsys_tensor_accumulate(ctx, short_one, x) == TSYS_ERR_INVALID_ARGS && strstr(tsys_ctx_last_error(ctx), "accumulate") != NULL, "sizes differ: %s", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    tsys_tensor_release(short_one); tsys_tensor_release(x); tsys_tensor_release(g);
    tsys_ctx_free(ctx);
}

// Giving a model's gradients back after each step (torch's zero_grad(set_to_none=True)) trains
// exactly as keeping them marked zero: the same parameters, bit for bit, after three AdamW steps; in
// between, the model holds no gradient memory, and backward makes it again layer by layer.
TSYS_TEST(release_grads_trains_like_zero_grad) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_model_desc d = tsys_model_desc_defaults(NULL);
    d.vocab_size = 50; d.context_length = 16; d.d_model = 16; d.num_layers = 3; d.num_heads = 2; d.d_ff = 40;
    tsys_model *m[2] = {tsys_model_new(ctx, &d, TSYS_CPU, 9), tsys_model_new(ctx, &d, TSYS_CPU, 9)};
    tsys_optim *o[2] = {tsys_adamw_new(ctx, tsys_model_params(m[0]), tsys_model_num_tensors(m[0]), NULL),
                        tsys_adamw_new(ctx, tsys_model_params(m[1]), tsys_model_num_tensors(m[1]), NULL)};
    int64_t shape[2] = {2, 16};
    tsys_tensor *ids = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 2, shape);
    tsys_tensor_randint(ctx, ids, d.vocab_size);
    int64_t grad_peak = 0, grad_bytes = tsys_model_num_params(m[1]) * 4;
    for (int step = 0; step < 3; step++) {
        for (int k = 0; k < 2; k++) {
            int64_t before = tsys_mem_stats_get(ctx, TSYS_CPU).category_bytes[TSYS_MEM_GRADIENTS];
            tsys_mem_reset_peak(ctx, TSYS_CPU);
            tsys_tensor *logits = tsys_model_forward(m[k], ids), *loss = tsys_cross_entropy(ctx, logits, ids);
            tsys_backward(ctx, loss);
            tsys_optim_step(o[k]);
            if (k == 0) tsys_optim_zero_grad(o[k]);
            else {
                tsys_optim_release_grads(o[k]);
                grad_peak = tsys_mem_stats_get(ctx, TSYS_CPU).peak_category_bytes[TSYS_MEM_GRADIENTS] - before;
                TEST_CHECK(tsys_mem_stats_get(ctx, TSYS_CPU).category_bytes[TSYS_MEM_GRADIENTS] == before, "step %d: gradient memory left after release", step);
                TEST_CHECK(tsys_model_params(m[1])[0]->grad == NULL, "step %d: a released gradient is still there", step);
            }
            tsys_tensor_release(logits); tsys_tensor_release(loss);
        }
    }
    TEST_CHECK(grad_peak <= grad_bytes, "gradients at the peak %lld > all of them %lld", (long long)grad_peak, (long long)grad_bytes);
    int differ = 0;
    for (int i = 0; i < tsys_model_num_tensors(m[0]); i++)
        differ += memcmp(tsys_tensor_data(tsys_model_params(m[0])[i]), tsys_tensor_data(tsys_model_params(m[1])[i]), tsys_tensor_bytes(tsys_model_params(m[0])[i])) != 0;
    TEST_CHECK(differ == 0, "%d parameter tensors differ between zero_grad and release_grads training", differ);
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    tsys_tensor_release(ids);
    for (int k = 0; k < 2; k++) { tsys_optim_free(o[k]); tsys_model_free(m[k]); }
    TEST_CHECK(tsys_mem_stats_get(ctx, TSYS_CPU).live_bytes == 0, "live bytes after everything is freed: %lld", (long long)tsys_mem_stats_get(ctx, TSYS_CPU).live_bytes);
    tsys_ctx_free(ctx);
}

// desc.fused_loss: tsys_model_loss fuses the LM head and the loss (chunks of 32 rows). 3 AdamW steps from the same weights as the
// logits path (tsys_model_forward + tsys_cross_entropy): the losses within 1e-6, the parameters within 1e-5 of
// their size (the fused op sums d w chunk by chunk); and the step's peak lower by at least the (N, V) logits plus
// what the fused op keeps instead (d x and d w, fp32): no (N, V) tensor is ever made whole.
TSYS_TEST(model_fused_loss_trains_like_the_logits) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_model_desc d = tsys_model_desc_defaults(NULL);
    d.vocab_size = 512; d.context_length = 32; d.d_model = 16; d.num_layers = 2; d.num_heads = 2; d.d_ff = 40;
    tsys_model_desc fd = d;
    fd.fused_loss = true; fd.fused_loss_chunk = 32;   // 4 chunks of the 128 rows
    tsys_model *m[2] = {tsys_model_new(ctx, &d, TSYS_CPU, 5), tsys_model_new(ctx, &fd, TSYS_CPU, 5)};
    tsys_optim *o[2] = {tsys_adamw_new(ctx, tsys_model_params(m[0]), tsys_model_num_tensors(m[0]), NULL),
                        tsys_adamw_new(ctx, tsys_model_params(m[1]), tsys_model_num_tensors(m[1]), NULL)};
    const int64_t B = 4, T = 32, N = B * T;
    int64_t shape[2] = {B, T};
    tsys_tensor *ids = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 2, shape), *tgt = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 2, shape);
    tsys_tensor_randint(ctx, ids, d.vocab_size); tsys_tensor_randint(ctx, tgt, d.vocab_size);
    int64_t peak[2] = {0, 0};
    for (int step = 0; step < 3; step++) {
        float loss_of[2] = {0, 0};
        for (int k = 0; k < 2; k++) {
            int64_t before = tsys_mem_stats_get(ctx, TSYS_CPU).live_bytes;
            tsys_mem_reset_peak(ctx, TSYS_CPU);
            tsys_tensor *loss = k ? tsys_model_loss(m[k], ids, tgt) : NULL, *logits = k ? NULL : tsys_model_forward(m[k], ids);
            if (!k) loss = tsys_cross_entropy(ctx, logits, tgt);
            tsys_tensor_release(logits);
            loss_of[k] = tsys_item(ctx, loss);
            tsys_backward(ctx, loss);
            tsys_tensor_release(loss);
            tsys_optim_step(o[k]);
            tsys_optim_release_grads(o[k]);
            peak[k] = tsys_mem_stats_get(ctx, TSYS_CPU).peak_bytes - before;
        }
        TEST_CHECK(fabsf(loss_of[1] - loss_of[0]) <= 1e-6f * fabsf(loss_of[0]), "step %d: fused loss %.9g, logits %.9g", step, loss_of[1], loss_of[0]);
    }
    double worst = 0;
    const char *which = "";
    for (int i = 0; i < tsys_model_num_tensors(m[0]); i++) {
        tsys_tensor *a = tsys_model_params(m[0])[i], *b = tsys_model_params(m[1])[i];
        const float *pa = (const float *)tsys_tensor_data(a), *pb = (const float *)tsys_tensor_data(b);
        double num = 0, den = 0;
        for (int64_t j = 0; j < tsys_tensor_numel(a); j++) { num = fmax(num, fabs((double)pa[j] - pb[j])); den = fmax(den, fabs((double)pa[j])); }
        if (num / (den + 1e-30) > worst) { worst = num / (den + 1e-30); which = a->name; }
    }
    TEST_CHECK(worst <= 1e-5, "parameters after 3 steps: %.2e in %s", worst, which);
    const int64_t V = d.vocab_size, D = d.d_model, saved = N * V * 4 + (N * D + V * D) * 4;   // measured: 2 N V 4 - 35520
    TEST_CHECK(peak[0] - peak[1] >= saved, "peak %lld with the logits, %lld fused: %lld less, want at least %lld", (long long)peak[0], (long long)peak[1],
               (long long)(peak[0] - peak[1]), (long long)saved);
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    tsys_tensor_release(ids); tsys_tensor_release(tgt);
    for (int k = 0; k < 2; k++) { tsys_optim_free(o[k]); tsys_model_free(m[k]); }
    tsys_ctx_free(ctx);
}

// The optimizer inside backward (each layer's update launched from its gradients' hooks) gives the
// parameters of the ordinary step bit for bit, AdamW and SGD, with gradients released or kept. With
// TSYS_OPTIM_FREE_GRADS each layer's gradients are given back after its update: one layer's gradients
// are alive at a time (a layer's update runs when backward leaves it, before the next layer's are
// made), and after the step the model holds none, the memory back to what it held before backward.
static void overlap_case(bool adamw, bool release, bool free_grads) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_model_desc d = tsys_model_desc_defaults(NULL);
    d.vocab_size = 50; d.context_length = 16; d.d_model = 16; d.num_layers = 3; d.num_heads = 2; d.d_ff = 40;
    tsys_model *m[2] = {tsys_model_new(ctx, &d, TSYS_CPU, 9), tsys_model_new(ctx, &d, TSYS_CPU, 9)};
    int n = tsys_model_num_tensors(m[0]);
    tsys_optim *o[2];
    for (int k = 0; k < 2; k++) o[k] = adamw ? tsys_adamw_new(ctx, tsys_model_params(m[k]), n, NULL) : tsys_sgd_new(ctx, tsys_model_params(m[k]), n, 0.05f);
    int64_t shape[2] = {2, 16};
    tsys_tensor *ids = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 2, shape);
    tsys_tensor_randint(ctx, ids, d.vocab_size);
    int64_t largest_group = 0, group = 0;   // fp32 bytes of the biggest run of one layer's parameters
    for (int i = 0; i < n; i++) {
        tsys_tensor *p = tsys_model_params(m[1])[i];
        bool joins = i > 0 && strncmp(p->name, tsys_model_params(m[1])[i - 1]->name, 9) == 0 && strncmp(p->name, "layers.", 7) == 0;
        group = (joins ? group : 0) + (int64_t)tsys_tensor_bytes(p);
        if (group > largest_group) largest_group = group;
    }
    for (int step = 0; step < 3; step++)
        for (int k = 0; k < 2; k++) {
            tsys_tensor *logits = tsys_model_forward(m[k], ids), *loss = tsys_cross_entropy(ctx, logits, ids);
            int64_t live_before = tsys_mem_stats_get(ctx, TSYS_CPU).live_bytes, grads_before = tsys_mem_stats_get(ctx, TSYS_CPU).category_bytes[TSYS_MEM_GRADIENTS];
            tsys_mem_clear_events(ctx);
            tsys_mem_record_events(ctx, k == 1);
            if (k == 1) TEST_CHECK(tsys_optim_overlap_begin_ex(o[k], free_grads ? TSYS_OPTIM_FREE_GRADS : 0) == TSYS_OK, "overlap_begin: %s", tsys_ctx_last_error(ctx));
            tsys_backward(ctx, loss);
            if (k == 0) tsys_optim_step(o[k]);
            else TEST_CHECK(tsys_optim_overlap_end(o[k]) == TSYS_OK, "overlap_end: %s", tsys_ctx_last_error(ctx));
            tsys_mem_record_events(ctx, false);
            if (k == 1 && free_grads) {
                tsys_mem_stats ms = tsys_mem_stats_get(ctx, TSYS_CPU);
                size_t ne;
                const tsys_mem_event *ev = tsys_mem_events(ctx, &ne);
                int64_t grads = 0, grad_peak = 0;   // gradient bytes made in this backward, at their most
                for (size_t e = 0; e < ne; e++) {
                    if (ev[e].category != TSYS_MEM_GRADIENTS) continue;
                    grads += ev[e].delta;
                    if (grads > grad_peak) grad_peak = grads;
                }
                TEST_CHECK(grad_peak > 0, "step %d: no gradient memory was made", step);
                TEST_CHECK(grad_peak <= largest_group, "step %d: %lld bytes of gradients at once, more than one layer's %lld", step, (long long)grad_peak, (long long)largest_group);
                TEST_CHECK(ms.category_bytes[TSYS_MEM_GRADIENTS] == grads_before && tsys_model_params(m[1])[0]->grad == NULL, "step %d: %lld bytes of gradients left after the step (%lld before)", step,
                           (long long)ms.category_bytes[TSYS_MEM_GRADIENTS], (long long)grads_before);
                // what backward freed (the activations) aside, the memory is back: the step added nothing
                TEST_CHECK(ms.live_bytes <= live_before, "step %d: %lld bytes live after the step, %lld before backward", step, (long long)ms.live_bytes, (long long)live_before);
            }
            if (release) tsys_optim_release_grads(o[k]); else tsys_optim_zero_grad(o[k]);
            tsys_tensor_release(logits); tsys_tensor_release(loss);
        }
    int differ = 0;
    for (int i = 0; i < n; i++)
        differ += memcmp(tsys_tensor_data(tsys_model_params(m[0])[i]), tsys_tensor_data(tsys_model_params(m[1])[i]), tsys_tensor_bytes(tsys_model_params(m[0])[i])) != 0;
    TEST_CHECK(differ == 0, "%s, %s%s: %d parameter tensors differ between the step and the optimizer in backward", adamw ? "adamw" : "sgd", release ? "released" : "kept",
               free_grads ? ", freed in backward" : "", differ);
    TEST_CHECK(tsys_optim_steps(o[1]) == 3, "step count %lld", (long long)tsys_optim_steps(o[1]));
    TEST_CHECK(tsys_optim_overlap_end(o[1]) == TSYS_ERR_INVALID_ARGS && strstr(tsys_ctx_last_error(ctx), "without tsys_optim_overlap_begin"), "an end without a begin is an error");
    tsys_ctx_clear_error(ctx);
    tsys_tensor_release(ids);
    for (int k = 0; k < 2; k++) tsys_optim_free(o[k]);
    // the hooks went with the optimizer: a backward after it is freed runs no update
    ids = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 2, shape);
    tsys_tensor_randint(ctx, ids, d.vocab_size);
    tsys_tensor *logits = tsys_model_forward(m[1], ids), *loss = tsys_cross_entropy(ctx, logits, ids);
    tsys_backward(ctx, loss);
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    tsys_tensor_release(logits); tsys_tensor_release(loss); tsys_tensor_release(ids);
    for (int k = 0; k < 2; k++) tsys_model_free(m[k]);
    tsys_ctx_free(ctx);
}
TSYS_TEST(optimizer_in_backward_matches_the_step) {
    overlap_case(true, true, false); overlap_case(true, false, false); overlap_case(false, true, false);
    overlap_case(true, false, true); overlap_case(false, true, true);
}

// ---- kept low-precision weights (tsys_optim_keep_lowp) ----
// The reference is always the same model trained without them: autocast then casts every weight at
// every use, so equal losses and parameters bit for bit say the copies AdamW writes are the casts.

static tsys_model_desc lowp_desc(void) {
    tsys_model_desc d = tsys_model_desc_defaults(NULL);
    d.vocab_size = 50; d.context_length = 16; d.d_model = 16; d.num_layers = 3; d.num_heads = 2; d.d_ff = 40;
    return d;
}

// Counts CAST launches that read one of a model's parameters (autocast casting a weight).
typedef struct lowp_casts { tsys_tensor **params; int n, casts; } lowp_casts;
static void lowp_count_cast(tsys_ctx *ctx, const tsys_trace_kernel *k, void *user) {
    (void)ctx;
    lowp_casts *c = (lowp_casts *)user;
    if (k->kernel != TSYS_K_CAST || !k->args) return;
    for (int i = 0; i < c->n; i++) c->casts += k->args->t[1] == c->params[i];
}

// One training step under autocast dt: forward, loss, backward, AdamW (in backward when overlap).
static float lowp_step(tsys_ctx *ctx, tsys_model *m, tsys_optim *o, tsys_tensor *ids, tsys_dtype dt, bool overlap) {
    tsys_autocast_begin(ctx, dt);
    tsys_tensor *logits = tsys_model_forward(m, ids), *loss = tsys_cross_entropy(ctx, logits, ids);
    tsys_autocast_end(ctx);
    float v = tsys_item(ctx, loss);
    if (overlap) tsys_optim_overlap_begin(o);
    tsys_backward(ctx, loss);
    if (overlap) tsys_optim_overlap_end(o); else tsys_optim_step(o);
    tsys_optim_release_grads(o);
    tsys_tensor_release(logits); tsys_tensor_release(loss);
    return v;
}

static int lowp_params_differ(tsys_model *a, tsys_model *b) {
    int differ = 0;
    for (int i = 0; i < tsys_model_num_tensors(a); i++)
        differ += memcmp(tsys_tensor_data(tsys_model_params(a)[i]), tsys_tensor_data(tsys_model_params(b)[i]), tsys_tensor_bytes(tsys_model_params(a)[i])) != 0;
    return differ;
}

// Two models of lowp_desc from one seed, AdamW over each (the second keeping bf16 copies), two steps of each on ids.
typedef struct lowp_pair { tsys_model *m[2]; tsys_optim *o[2]; tsys_tensor *ids; int n; } lowp_pair;
static lowp_pair lowp_pair_trained(tsys_ctx *ctx) {
    tsys_model_desc d = lowp_desc();
    lowp_pair p;
    for (int k = 0; k < 2; k++) p.m[k] = tsys_model_new(ctx, &d, TSYS_CPU, 9);
    p.n = tsys_model_num_tensors(p.m[0]);
    for (int k = 0; k < 2; k++) p.o[k] = tsys_adamw_new(ctx, tsys_model_params(p.m[k]), p.n, NULL);
    tsys_optim_keep_lowp(p.o[1], TSYS_BF16);
    int64_t shape[2] = {2, 16};
    p.ids = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 2, shape);
    tsys_tensor_randint(ctx, p.ids, d.vocab_size);
    for (int step = 0; step < 2; step++)
        for (int k = 0; k < 2; k++) lowp_step(ctx, p.m[k], p.o[k], p.ids, TSYS_BF16, false);
    return p;
}
static void lowp_pair_free(lowp_pair *p) {
    for (int k = 0; k < 2; k++) { tsys_optim_free(p->o[k]); tsys_model_free(p->m[k]); }
    tsys_tensor_release(p->ids);
}

// Five steps with the copies (ordinary step, or in backward when overlap) against five without:
// the same losses and parameters bit for bit; after the first step no weight is cast any more; each
// kept copy equals a fresh cast of its parameter.
static void lowp_train_case(tsys_dtype dt, bool overlap) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_model_desc d = lowp_desc();
    tsys_model *m[2] = {tsys_model_new(ctx, &d, TSYS_CPU, 9), tsys_model_new(ctx, &d, TSYS_CPU, 9)};
    int n = tsys_model_num_tensors(m[0]);
    tsys_optim *o[2] = {tsys_adamw_new(ctx, tsys_model_params(m[0]), n, NULL), tsys_adamw_new(ctx, tsys_model_params(m[1]), n, NULL)};
    TEST_CHECK(tsys_optim_keep_lowp(o[1], dt) == TSYS_OK && tsys_optim_lowp(o[1]) == dt && tsys_optim_lowp(o[0]) == TSYS_F32, "keep_lowp: %s", tsys_ctx_last_error(ctx));
    int64_t shape[2] = {2, 16};
    tsys_tensor *ids = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 2, shape);
    tsys_tensor_randint(ctx, ids, d.vocab_size);
    lowp_casts cc = {tsys_model_params(m[1]), n, 0};
    tsys_trace_hooks h;
    memset(&h, 0, sizeof(h));
    h.kernel = lowp_count_cast; h.user = &cc;
    const char *what = overlap ? "in backward" : "step";
    for (int step = 0; step < 5; step++) {
        float ref = lowp_step(ctx, m[0], o[0], ids, dt, false);
        cc.casts = 0;
        tsys_ctx_set_trace_hooks(ctx, &h);
        float got = lowp_step(ctx, m[1], o[1], ids, dt, overlap);
        tsys_ctx_set_trace_hooks(ctx, NULL);
        TEST_CHECK(got == ref, "%s %s step %d: loss %.9g with kept copies, %.9g without", tsys_dtype_name(dt), what, step, got, ref);
        // step 0 casts each matrix once into its copy (7 per layer... every linear weight), later steps none
        if (step == 0) TEST_CHECK(cc.casts == 7 * d.num_layers + 1, "%s %s: the first step cast %d weights, expected %d", tsys_dtype_name(dt), what, cc.casts, 7 * d.num_layers + 1);
        else TEST_CHECK(cc.casts == 0, "%s %s step %d: %d weights cast although AdamW wrote their copies", tsys_dtype_name(dt), what, step, cc.casts);
    }
    TEST_CHECK(lowp_params_differ(m[0], m[1]) == 0, "%s %s: %d parameter tensors differ after 5 steps", tsys_dtype_name(dt), what, lowp_params_differ(m[0], m[1]));
    int bad = 0;
    tsys_no_grad_begin(ctx);
    for (int i = 0; i < n; i++) {
        tsys_tensor *p = tsys_model_params(m[1])[i], *cast = tsys_cast(ctx, p, dt);
        bad += !p->lowp || !cast || memcmp(tsys_tensor_data(p->lowp), tsys_tensor_data(cast), tsys_tensor_bytes(cast)) != 0;
        tsys_tensor_release(cast);
    }
    tsys_no_grad_end(ctx);
    TEST_CHECK(bad == 0, "%s %s: %d kept copies differ from a cast of their parameter", tsys_dtype_name(dt), what, bad);
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    tsys_tensor_release(ids);
    for (int k = 0; k < 2; k++) tsys_optim_free(o[k]);
    TEST_CHECK(tsys_model_params(m[1])[0]->lowp == NULL, "the copies outlived their optimizer");
    for (int k = 0; k < 2; k++) tsys_model_free(m[k]);
    TEST_CHECK(tsys_mem_stats_get(ctx, TSYS_CPU).live_bytes == 0, "live bytes after everything is freed: %lld", (long long)tsys_mem_stats_get(ctx, TSYS_CPU).live_bytes);
    tsys_ctx_free(ctx);
}
TSYS_TEST(kept_lowp_copies_train_bitwise) { lowp_train_case(TSYS_BF16, false); lowp_train_case(TSYS_F16, false); }
TSYS_TEST(kept_lowp_copies_in_backward_bitwise) { lowp_train_case(TSYS_BF16, true); lowp_train_case(TSYS_F16, true); }

// A parameter written by anything but its optimizer after a step: the next forward reads the new
// values (the logits of a model with copies equal those of one without, given the same write). The
// write through tsys_tensor_data without tsys_tensor_mark_written is the control: the stale copy is
// used, so the comparison can tell.
typedef enum { W_FILL, W_COPY, W_LOAD, W_RAW_MARKED, W_REBIND, W_RESIZE, W_RAW_UNMARKED, W_COUNT } lowp_writer;
static const char *const lowp_writer_names[W_COUNT] = {"fill", "copy_from", "safetensors load_into", "raw + mark_written", "rebind", "resize + copy", "raw, unmarked"};

static void lowp_write(tsys_ctx *ctx, tsys_model *m, lowp_writer w, const char *path, tsys_tensor *src, tsys_tensor *ids) {
    tsys_tensor *p = tsys_model_param(m, "layers.1.attn.q_proj.weight");
    switch (w) {
    case W_FILL: tsys_tensor_fill(ctx, p, 0.03125f); break;
    case W_COPY: tsys_tensor_copy_from(ctx, p, src); break;
    case W_LOAD: tsys_safetensors_load_into(ctx, path, &p, 1); break;
    case W_RAW_MARKED: case W_RAW_UNMARKED:
        memcpy(tsys_tensor_data(p), tsys_tensor_data(src), tsys_tensor_bytes(p));
        if (w == W_RAW_MARKED) tsys_tensor_mark_written(p);
        break;
    case W_REBIND: tsys_tensor_rebind(ctx, p, src, 0); break;
    case W_RESIZE: {
        // a sharded parameter's storage given back and taken again (FSDP), then filled as a
        // collective fills it, unmarked. First the parameter alone in a storage, its copy made from it.
        tsys_tensor *lone = tsys_tensor_clone(ctx, p);
        tsys_tensor_rebind(ctx, p, lone, 0);
        tsys_tensor_release(lone);
        tsys_no_grad_begin(ctx);
        tsys_autocast_begin(ctx, TSYS_BF16);
        tsys_tensor_release(tsys_model_forward(m, ids));
        tsys_autocast_end(ctx);
        tsys_no_grad_end(ctx);
        tsys_storage_resize(ctx, p, 0);
        tsys_storage_resize(ctx, p, tsys_tensor_bytes(p));
        memcpy(tsys_tensor_data(p), tsys_tensor_data(src), tsys_tensor_bytes(p));
        break;
    }
    default: break;
    }
}

TSYS_TEST(kept_lowp_copies_follow_other_writes) {
    char path[] = "/tmp/tsys_lowp_XXXXXX";   // its own file: the sanitizer build runs beside this one
    int fd = mkstemp(path);
    TEST_CHECK(fd >= 0, "mkstemp failed");
    if (fd < 0) return;
    close(fd);
    for (int w = 0; w < W_COUNT; w++) {
        tsys_ctx *ctx = tsys_ctx_new(NULL);
        tsys_model_desc d = lowp_desc();
        lowp_pair pair = lowp_pair_trained(ctx);
        tsys_model **m = pair.m;
        tsys_tensor *ids = pair.ids;
        // the new values: another model's tensor of that name (in a file for load_into)
        tsys_model *other = tsys_model_new(ctx, &d, TSYS_CPU, 77);
        tsys_tensor *src = tsys_model_param(other, "layers.1.attn.q_proj.weight");
        if (w == W_LOAD) tsys_safetensors_save(ctx, path, &src, 1);
        for (int k = 0; k < 2; k++) lowp_write(ctx, m[k], (lowp_writer)w, path, src, ids);
        tsys_tensor *logits[2];
        tsys_autocast_begin(ctx, TSYS_BF16);
        for (int k = 0; k < 2; k++) logits[k] = tsys_model_forward(m[k], ids);
        tsys_autocast_end(ctx);
        bool same = logits[0] && logits[1] && memcmp(tsys_tensor_data(logits[0]), tsys_tensor_data(logits[1]), tsys_tensor_bytes(logits[0])) == 0;
        if (w == W_RAW_UNMARKED) TEST_CHECK(!same, "an unmarked write did not leave the copy stale: this test could not tell a stale copy");
        else TEST_CHECK(same, "after %s the model with kept copies computes other logits than a fresh cast", lowp_writer_names[w]);
        TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s: %s", lowp_writer_names[w], tsys_ctx_last_error(ctx));
        tsys_tape_clear(ctx);
        for (int k = 0; k < 2; k++) tsys_tensor_release(logits[k]);
        lowp_pair_free(&pair);
        tsys_model_free(other);
        tsys_ctx_free(ctx);
    }
    remove(path);
}

// Parameters written in bulk (tsys_params_mark_written): the model with kept copies computes the logits of
// one without, and casts only what it must - none when the written copies came with the weights, the written
// parameter alone when they did not. tsys_tensor_mark_written of that one parameter, the control, makes every
// copy on the model's storage stale (so the count can tell).
TSYS_TEST(params_mark_written_keeps_unchanged_copies) {
    const char *name = "layers.1.attn.q_proj.weight";
    tsys_model_desc d = lowp_desc();
    const int all = 7 * d.num_layers + 1;
    for (int how = 0; how < 3; how++) {   // 0: copies written too, 1: weights alone, 2: mark_written (control)
        tsys_ctx *ctx = tsys_ctx_new(NULL);
        lowp_pair pair = lowp_pair_trained(ctx);
        tsys_model **m = pair.m;
        tsys_tensor *ids = pair.ids;
        const int n = pair.n;
        tsys_model *other = tsys_model_new(ctx, &d, TSYS_CPU, 77);
        tsys_tensor *src = tsys_model_param(other, name), *src_low = tsys_cast(ctx, src, TSYS_BF16);
        bool *written = (bool *)calloc((size_t)n, sizeof(bool));
        for (int i = 0; i < n; i++) written[i] = tsys_model_params(m[1])[i] == tsys_model_param(m[1], name);
        for (int k = 0; k < 2; k++) {
            tsys_tensor *p = tsys_model_param(m[k], name);
            memcpy(tsys_tensor_data(p), tsys_tensor_data(src), tsys_tensor_bytes(p));
            if (k == 0) { tsys_tensor_mark_written(p); continue; }
            if (how == 0) memcpy(tsys_tensor_data(p->lowp), tsys_tensor_data(src_low), tsys_tensor_bytes(src_low));
            if (how < 2) tsys_params_mark_written(tsys_model_params(m[1]), n, written, how == 0);
            else tsys_tensor_mark_written(p);
        }
        lowp_casts cc = {tsys_model_params(m[1]), n, 0};
        tsys_trace_hooks h;
        memset(&h, 0, sizeof(h));
        h.kernel = lowp_count_cast; h.user = &cc;
        tsys_tensor *logits[2];
        tsys_autocast_begin(ctx, TSYS_BF16);
        logits[0] = tsys_model_forward(m[0], ids);
        tsys_ctx_set_trace_hooks(ctx, &h);
        logits[1] = tsys_model_forward(m[1], ids);
        tsys_ctx_set_trace_hooks(ctx, NULL);
        tsys_autocast_end(ctx);
        const int expect = how == 0 ? 0 : how == 1 ? 1 : all;
        TEST_CHECK(logits[0] && logits[1] && !memcmp(tsys_tensor_data(logits[0]), tsys_tensor_data(logits[1]), tsys_tensor_bytes(logits[0])),
                   "case %d: the model with kept copies computes other logits than a fresh cast", how);
        TEST_CHECK(cc.casts == expect, "case %d: %d weights cast, expected %d", how, cc.casts, expect);
        TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "case %d: %s", how, tsys_ctx_last_error(ctx));
        tsys_tape_clear(ctx);
        free(written);
        tsys_tensor_release(src_low);
        for (int k = 0; k < 2; k++) tsys_tensor_release(logits[k]);
        lowp_pair_free(&pair);
        tsys_model_free(other);
        tsys_ctx_free(ctx);
    }
}

// A parameter marked stale (tsys_params_mark_stale: its values held elsewhere, as tsys_ddp's shard_masters leaves
// them) is read only through its valid kept copy: a cast of it, an fp32 forward (which reads it through the q, k, v
// block's view), a read to the host and a save fail naming it; a copy into it makes it current.
TSYS_TEST(stale_parameter_refuses_reads_until_written) {
    const char *name = "layers.1.attn.q_proj.weight";
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_model_desc d = lowp_desc();
    tsys_model *m = tsys_model_new(ctx, &d, TSYS_CPU, 9), *other = tsys_model_new(ctx, &d, TSYS_CPU, 77);
    int n = tsys_model_num_tensors(m);
    tsys_optim *o = tsys_adamw_new(ctx, tsys_model_params(m), n, NULL);
    tsys_optim_keep_lowp(o, TSYS_BF16);
    int64_t shape[2] = {2, 16};
    tsys_tensor *ids = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 2, shape);
    tsys_tensor_randint(ctx, ids, d.vocab_size);
    lowp_step(ctx, m, o, ids, TSYS_BF16, false);
    tsys_tensor *p = tsys_model_param(m, name), *logits;
    bool *stale = (bool *)calloc((size_t)n, sizeof(bool));
    for (int i = 0; i < n; i++) stale[i] = tsys_model_params(m)[i] == p;
    TEST_CHECK(tsys_params_mark_stale(ctx, tsys_model_params(m), n, stale) == TSYS_OK, "mark_stale: %s", tsys_ctx_last_error(ctx));
    free(stale);
    char path[] = "/tmp/tsys_stale_XXXXXX";
    int fd = mkstemp(path);
    if (fd >= 0) close(fd);
    tsys_no_grad_begin(ctx);
    tsys_autocast_begin(ctx, TSYS_BF16);
    logits = tsys_model_forward(m, ids);
    tsys_autocast_end(ctx);
    TEST_CHECK(logits && tsys_ctx_status(ctx) == TSYS_OK, "a forward through the valid copy failed: %s", tsys_ctx_last_error(ctx));
    tsys_tensor_release(logits);
    tsys_tensor_mark_written(tsys_model_param(m, "layers.0.attn.q_proj.weight"));   // every copy on the storage is stale now
    for (int k = 0; k < 4; k++) {   // a cast of it (autocast), an fp32 forward, a read to the host, a save
        float host[1];
        tsys_status s = TSYS_OK;
        if (k < 2) {
            if (k == 0) tsys_autocast_begin(ctx, TSYS_BF16);
            tsys_tensor *l = tsys_model_forward(m, ids);
            if (k == 0) tsys_autocast_end(ctx);
            s = tsys_ctx_status(ctx);   // the forward goes on past a failed launch; the context keeps its error
            tsys_tensor_release(l);
        } else s = k == 2 ? tsys_tensor_to_host(ctx, p, host) : tsys_safetensors_save(ctx, path, &p, 1);
        TEST_CHECK(s != TSYS_OK && strstr(tsys_ctx_last_error(ctx), name) && strstr(tsys_ctx_last_error(ctx), "out of date"), "case %d: %s (wanted a refusal naming '%s')", k,
                   s == TSYS_OK ? "went through" : tsys_ctx_last_error(ctx), name);
        tsys_ctx_clear_error(ctx);
    }
    TEST_CHECK(tsys_tensor_copy_from(ctx, p, tsys_model_param(other, name)) == TSYS_OK, "a copy into it: %s", tsys_ctx_last_error(ctx));
    logits = tsys_model_forward(m, ids);
    TEST_CHECK(logits && tsys_safetensors_save(ctx, path, &p, 1) == TSYS_OK, "after the copy: %s", tsys_ctx_last_error(ctx));
    tsys_tensor_release(logits);
    tsys_no_grad_end(ctx);
    remove(path);
    tsys_tensor_release(ids);
    tsys_optim_free(o);
    tsys_model_free(m); tsys_model_free(other);
    tsys_ctx_free(ctx);
}

// The options: only AdamW writes copies, only of bf16/f16; f32 gives them back (memory included).
TSYS_TEST(kept_lowp_copies_options_and_memory) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_model_desc d = lowp_desc();
    tsys_model *m = tsys_model_new(ctx, &d, TSYS_CPU, 9);
    int n = tsys_model_num_tensors(m);
    tsys_optim *sgd = tsys_sgd_new(ctx, tsys_model_params(m), n, 0.1f);
    TEST_CHECK(tsys_optim_keep_lowp(sgd, TSYS_BF16) == TSYS_ERR_UNSUPPORTED, "SGD accepted kept copies");
    tsys_ctx_clear_error(ctx);
    tsys_optim_free(sgd);
    tsys_optim *o = tsys_adamw_new(ctx, tsys_model_params(m), n, NULL);
    TEST_CHECK(tsys_optim_keep_lowp(o, TSYS_I32) == TSYS_ERR_INVALID_ARGS, "i32 copies accepted");
    tsys_ctx_clear_error(ctx);
    // each copy starts 256-byte aligned, as a fresh allocation does (GEMM plans follow alignment)
    int64_t before = tsys_mem_stats_get(ctx, TSYS_CPU).category_bytes[TSYS_MEM_PARAMETERS], expect = 0;
    for (int i = 0; i < n; i++) expect += (tsys_tensor_numel(tsys_model_params(m)[i]) * 2 + 255) / 256 * 256;
    tsys_optim_keep_lowp(o, TSYS_F16);
    int64_t with = tsys_mem_stats_get(ctx, TSYS_CPU).category_bytes[TSYS_MEM_PARAMETERS];
    TEST_CHECK(with - before == expect, "kept copies hold %lld parameter bytes, expected %lld", (long long)(with - before), (long long)expect);
    TEST_CHECK(tsys_mem_tag_bytes(ctx, tsys_mem_tag(ctx, "kept weight copies"), TSYS_CPU) == expect, "the copies are not under their tag");
    int misaligned = 0;
    for (int i = 0; i < n; i++) misaligned += (tsys_model_params(m)[i]->lowp->offset & 255) != 0;   // in the block (CUDA's is 512-byte aligned)
    TEST_CHECK(misaligned == 0, "%d copies do not start 256-byte aligned in their block", misaligned);
    tsys_optim_keep_lowp(o, TSYS_F32);
    TEST_CHECK(tsys_mem_stats_get(ctx, TSYS_CPU).category_bytes[TSYS_MEM_PARAMETERS] == before && tsys_optim_lowp(o) == TSYS_F32, "f32 did not give the copies back");
    TEST_CHECK(tsys_model_params(m)[3]->lowp == NULL, "a parameter still points at a copy");
    tsys_optim_free(o);
    tsys_model_free(m);
    tsys_ctx_free(ctx);
}

// tsys_optim_keep_lowp_into (FSDP's copy engines: each shard's copy is a window of the unit's gathered weights):
// copies given for some parameters (windows of one tensor, in another order, one 2 bytes off any alignment) are
// written by the update with the bits the optimizer's own block gets, and the training is the same; what it
// refuses, naming the rule; f32 gives the given copies back and leaves the caller's memory alone.
TSYS_TEST(kept_lowp_copies_given) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    enum { N = 3 };
    const int64_t sizes[N] = {1000, 37, 512};
    int64_t room = 1 + 37 + 1000 + 8;
    tsys_tensor *pa[N], *pb[N], *coef[N], *copies[N] = {NULL, NULL, NULL};
    tsys_tensor *hold = tsys_tensor_new(ctx, TSYS_BF16, TSYS_CPU, 1, &room);   // the caller's memory: [pad 1][p1's][p0's]
    tsys_tensor_fill(ctx, hold, 7.0f);
    for (int i = 0; i < N; i++) {
        pa[i] = test_param(ctx, TSYS_CPU, 1, &sizes[i], 1.0f);
        pb[i] = tsys_tensor_clone(ctx, pa[i]);
        tsys_tensor_set_requires_grad(pb[i], true);
        tsys_tensor_set_name(pb[i], "p%d", i);
        coef[i] = test_param(ctx, TSYS_CPU, 1, &sizes[i], 1.0f);
    }
    copies[1] = tsys_tensor_view_raw(ctx, hold, 2, TSYS_BF16, 1, &sizes[1]);
    copies[0] = tsys_tensor_view_raw(ctx, hold, 2 * (1 + 37), TSYS_BF16, 1, &sizes[0]);
    tsys_optim *oa = tsys_adamw_new(ctx, pa, N, NULL), *ob = tsys_adamw_new(ctx, pb, N, NULL);
    TEST_CHECK(tsys_optim_keep_lowp(oa, TSYS_BF16) == TSYS_OK && tsys_optim_keep_lowp_into(ob, copies) == TSYS_OK && tsys_optim_lowp(ob) == TSYS_BF16, "keep: %s",
               tsys_ctx_last_error(ctx));
    TEST_CHECK(pb[2]->lowp == NULL && pb[0]->lowp && tsys_tensor_data(pb[0]->lowp) == tsys_tensor_data(copies[0]), "the given copies are the parameters' copies");
    for (int step = 0; step < 3 && tsys_ctx_status(ctx) == TSYS_OK; step++) {
        for (int side = 0; side < 2; side++)
            for (int i = 0; i < N; i++) {
                tsys_tensor *pc = tsys_mul(ctx, side ? pb[i] : pa[i], coef[i]), *l = tsys_sum(ctx, pc);
                tsys_backward(ctx, l);
                tsys_tensor_release(pc); tsys_tensor_release(l);
            }
        tsys_optim_step(oa); tsys_optim_step(ob);
        tsys_optim_zero_grad(oa); tsys_optim_zero_grad(ob);
    }
    long apart = 0, copy_apart = 0;
    for (int i = 0; i < N; i++) {
        float *a = test_read(ctx, pa[i]), *b = test_read(ctx, pb[i]);
        apart += a && b ? memcmp(a, b, sizeof(float) * (size_t)sizes[i]) != 0 : 1;
        if (copies[i]) {   // the update's copy in the caller's memory: the bits of the block's copy
            float *x = test_read(ctx, pa[i]->lowp), *y = test_read(ctx, copies[i]);
            copy_apart += x && y ? memcmp(x, y, sizeof(float) * (size_t)sizes[i]) != 0 : 1;
            free(x); free(y);
        }
        free(a); free(b);
    }
    TEST_CHECK(apart == 0 && copy_apart == 0, "after 3 steps: %ld parameters and %ld given copies differ from the block's run", apart, copy_apart);
    float *edge = test_read(ctx, hold);
    TEST_CHECK(edge && edge[0] == 7.0f && edge[room - 1] == 7.0f, "the update wrote outside the given copies");
    free(edge);
    int64_t eight = 8;
    tsys_tensor *f32 = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, &sizes[1]), *f16 = tsys_tensor_new(ctx, TSYS_F16, TSYS_CPU, 1, &sizes[1]);
    tsys_tensor *shorter = tsys_tensor_new(ctx, TSYS_BF16, TSYS_CPU, 1, &eight);
    tsys_optim *sgd = tsys_sgd_new(ctx, pb, N, 0.1f);
    struct { tsys_optim *o; tsys_tensor *c0, *c1; const char *says; } bad[] = {
        {ob, NULL, f32, "the copy of 'p1'"}, {ob, NULL, shorter, "has another number of elements"}, {ob, copies[0], f16, "has another dtype than the first copy"},
        {ob, NULL, NULL, "every copy is NULL"}, {sgd, copies[0], NULL, "only AdamW"}};
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        tsys_tensor *given[N] = {bad[k].c0, bad[k].c1, NULL};
        tsys_status st = tsys_optim_keep_lowp_into(bad[k].o, given);
        TEST_CHECK(st != TSYS_OK && strstr(tsys_ctx_last_error(ctx), bad[k].says), "case %zu: status %d, '%s'", k, (int)st, tsys_ctx_last_error(ctx));
        tsys_ctx_clear_error(ctx);
    }
    TEST_CHECK(tsys_optim_lowp(ob) == TSYS_BF16 && pb[0]->lowp, "a refused call gave the copies back");
    TEST_CHECK(tsys_optim_keep_lowp(ob, TSYS_F32) == TSYS_OK && !pb[0]->lowp && !pb[1]->lowp && tsys_optim_lowp(ob) == TSYS_F32, "f32 did not give the copies back");
    tsys_optim_free(sgd); tsys_optim_free(oa); tsys_optim_free(ob);
    for (int i = 0; i < N; i++) { tsys_tensor_release(pa[i]); tsys_tensor_release(pb[i]); tsys_tensor_release(coef[i]); tsys_tensor_release(copies[i]); }
    tsys_tensor_release(hold); tsys_tensor_release(f32); tsys_tensor_release(f16); tsys_tensor_release(shorter);
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    tsys_ctx_free(ctx);
}

// ---- AdamW inside the weight-gradient products (TSYS_OPTIM_FUSE_UPDATE) ----
// On the CPU the fused launch makes the gradient as the product would and runs AdamW's update on it, so
// training with the flag must give the ordinary step's parameters (and kept copies) bit for bit, while every
// linear weight (7 a layer and the head) is updated in its product and none of them gets a written gradient.
typedef struct fused_count { int fused, adamw_linear; tsys_tensor **params; int n; } fused_count;
static void fused_count_kernel(tsys_ctx *ctx, const tsys_trace_kernel *k, void *user) {
    (void)ctx;
    fused_count *c = (fused_count *)user;
    if (k->kernel == TSYS_K_LINEAR_ADAMW) c->fused++;
    if (k->kernel != TSYS_K_ADAMW || !k->args) return;
    for (int i = 0; i < c->n; i++)   // an ordinary launch that starts at a matrix (a linear weight) updates it again
        c->adamw_linear += k->args->t[0]->storage == c->params[i]->storage && k->args->t[0]->offset == c->params[i]->offset && c->params[i]->ndim == 2 &&
                           strstr(c->params[i]->name, "embed") == NULL;
}
static void fused_update_case(tsys_dtype autocast, bool copies, tsys_dtype grad_dt, unsigned flags) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_model_desc d = lowp_desc();
    tsys_model *m[2] = {tsys_model_new(ctx, &d, TSYS_CPU, 9), tsys_model_new(ctx, &d, TSYS_CPU, 9)};
    int n = tsys_model_num_tensors(m[0]);
    tsys_optim *o[2];
    for (int k = 0; k < 2; k++) {
        o[k] = tsys_adamw_new(ctx, tsys_model_params(m[k]), n, NULL);
        if (copies) tsys_optim_keep_lowp(o[k], autocast);
        if (grad_dt != TSYS_F32) tsys_model_set_grad_dtype(m[k], grad_dt);
    }
    int64_t shape[2] = {2, 16};
    tsys_tensor *ids = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 2, shape);
    tsys_tensor_randint(ctx, ids, d.vocab_size);
    fused_count fc = {0, 0, tsys_model_params(m[1]), n};
    tsys_trace_hooks h;
    memset(&h, 0, sizeof(h));
    h.kernel = fused_count_kernel; h.user = &fc;
    char what[96];
    snprintf(what, sizeof what, "autocast %s, copies %d, gradients %s, flags %u", tsys_dtype_name(autocast), copies, tsys_dtype_name(grad_dt), flags);
    for (int step = 0; step < 3; step++)
        for (int k = 0; k < 2; k++) {
            if (autocast != TSYS_F32) tsys_autocast_begin(ctx, autocast);
            tsys_tensor *logits = tsys_model_forward(m[k], ids), *loss = tsys_cross_entropy(ctx, logits, ids);
            if (autocast != TSYS_F32) tsys_autocast_end(ctx);
            if (k == 1) {
                TEST_CHECK(tsys_optim_overlap_begin_ex(o[1], flags) == TSYS_OK, "%s: overlap_begin: %s", what, tsys_ctx_last_error(ctx));
                tsys_ctx_set_trace_hooks(ctx, &h);
            }
            tsys_backward(ctx, loss);
            if (k == 0) tsys_optim_step(o[0]);
            else TEST_CHECK(tsys_optim_overlap_end(o[1]) == TSYS_OK, "%s: overlap_end: %s", what, tsys_ctx_last_error(ctx));
            tsys_ctx_set_trace_hooks(ctx, NULL);
            tsys_optim_release_grads(o[k]);
            tsys_tensor_release(logits); tsys_tensor_release(loss);
        }
    TEST_CHECK(fc.fused == 3 * (7 * d.num_layers + 1), "%s: %d updates in products over 3 steps, expected %d", what, fc.fused, 3 * (7 * d.num_layers + 1));
    TEST_CHECK(fc.adamw_linear == 0, "%s: %d ordinary AdamW launches started at a linear weight", what, fc.adamw_linear);
    TEST_CHECK(lowp_params_differ(m[0], m[1]) == 0, "%s: %d parameter tensors differ from the ordinary step", what, lowp_params_differ(m[0], m[1]));
    int bad = 0;
    for (int i = 0; copies && i < n; i++) {
        tsys_tensor *a = tsys_model_params(m[0])[i]->lowp, *b = tsys_model_params(m[1])[i]->lowp;
        bad += !a || !b || memcmp(tsys_tensor_data(a), tsys_tensor_data(b), tsys_tensor_bytes(a)) != 0;
    }
    TEST_CHECK(bad == 0, "%s: %d kept copies differ from the ordinary step's", what, bad);
    TEST_CHECK(tsys_optim_steps(o[1]) == 3 && tsys_ctx_status(ctx) == TSYS_OK, "%s: steps %lld, %s", what, (long long)tsys_optim_steps(o[1]), tsys_ctx_last_error(ctx));
    // after a fused step the ordinary step updates every parameter again (nothing stays marked)
    tsys_tensor *logits = tsys_model_forward(m[1], ids), *loss = tsys_cross_entropy(ctx, logits, ids);
    tsys_backward(ctx, loss);
    tsys_tensor *w = NULL;
    for (int i = 0; i < n && !w; i++) if (tsys_model_params(m[1])[i]->ndim == 2 && !strstr(tsys_model_params(m[1])[i]->name, "embed")) w = tsys_model_params(m[1])[i];
    float *before = w ? (float *)malloc(tsys_tensor_bytes(w)) : NULL;
    if (before) memcpy(before, tsys_tensor_data(w), tsys_tensor_bytes(w));
    tsys_optim_step(o[1]);
    TEST_CHECK(w && before && memcmp(before, tsys_tensor_data(w), tsys_tensor_bytes(w)) != 0, "%s: the ordinary step after a fused one left '%s' as it was", what, w ? w->name : "?");
    free(before);
    tsys_tensor_release(logits); tsys_tensor_release(loss); tsys_tensor_release(ids);
    for (int k = 0; k < 2; k++) { tsys_optim_free(o[k]); tsys_model_free(m[k]); }
    tsys_ctx_free(ctx);
}
TSYS_TEST(fused_update_matches_the_step) {
    fused_update_case(TSYS_F32, false, TSYS_F32, TSYS_OPTIM_FUSE_UPDATE);
    fused_update_case(TSYS_BF16, true, TSYS_BF16, TSYS_OPTIM_FUSE_UPDATE);
    fused_update_case(TSYS_BF16, true, TSYS_F32, TSYS_OPTIM_FUSE_UPDATE | TSYS_OPTIM_FREE_GRADS);
    fused_update_case(TSYS_F16, false, TSYS_F16, TSYS_OPTIM_FUSE_UPDATE | TSYS_OPTIM_FREE_GRADS);
}
TSYS_TEST(fused_update_rules) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_model_desc d = lowp_desc();
    tsys_model *m = tsys_model_new(ctx, &d, TSYS_CPU, 9);
    tsys_optim *sgd = tsys_sgd_new(ctx, tsys_model_params(m), tsys_model_num_tensors(m), 0.1f);
    TEST_CHECK(tsys_optim_overlap_begin_ex(sgd, TSYS_OPTIM_FUSE_UPDATE) == TSYS_ERR_UNSUPPORTED && strstr(tsys_ctx_last_error(ctx), "AdamW"), "SGD: %s", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(tsys_optim_overlap_begin_ex(sgd, 8u) == TSYS_ERR_INVALID_ARGS && strstr(tsys_ctx_last_error(ctx), "unknown flags 0x8"), "flag 8: %s", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    tsys_optim_free(sgd);
    tsys_model_free(m);
    tsys_ctx_free(ctx);
}

// ---- gradients kept in the autocast dtype (tsys_model_set_grad_dtype) ----

static bool lowpg_linear(tsys_model *m, int i) { return tsys_model_params(m)[i]->ndim == 2 && i > 0; }   // params[0]: the embedding

// fp32 gradients rounded to dt in place: the values a low-precision gradient holds.
static void lowpg_round(tsys_ctx *ctx, tsys_model *m, tsys_dtype dt) {
    for (int i = 0; i < tsys_model_num_tensors(m); i++) {
        tsys_tensor *g = tsys_model_params(m)[i]->grad;
        if (!lowpg_linear(m, i) || !g) continue;
        tsys_tensor *r = tsys_tensor_new(ctx, dt, TSYS_CPU, g->ndim, g->shape);
        tsys_tensor_cast_from(ctx, r, g);
        tsys_tensor_cast_from(ctx, g, r);
        tsys_tensor_release(r);
    }
}

// One AdamW step under autocast of dt (the fp32 model's gradients rounded first when `round`); the loss.
static float lowpg_step(tsys_ctx *ctx, tsys_model *m, tsys_optim *o, tsys_tensor *ids, tsys_dtype dt, bool round, bool overlap) {
    tsys_autocast_begin(ctx, dt);
    tsys_tensor *loss = tsys_model_loss(m, ids, ids);
    tsys_autocast_end(ctx);
    float v = tsys_item(ctx, loss);
    if (overlap) tsys_optim_overlap_begin(o);
    tsys_backward(ctx, loss);
    if (round) lowpg_round(ctx, m, dt);
    if (overlap) tsys_optim_overlap_end(o); else tsys_optim_step(o);
    tsys_optim_release_grads(o);
    tsys_tensor_release(loss);
    return v;
}

// Five steps with the linear weights' gradients kept in dt against five with fp32 gradients rounded to
// dt after backward: the weight-gradient GEMM rounds its fp32 sum once either way and AdamW reads the
// same values, so the losses and every parameter agree bit for bit; the kept gradients have dt, the
// embedding's and the norms' stay fp32, and the gradient memory shrinks by what the dtype saves.
// fused: lm_head's gradient comes from the fused head + loss (made in fp32 and rounded into its place).
static void lowpg_train_case(tsys_dtype dt, bool fused, bool overlap) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_model_desc d = lowp_desc();
    d.fused_loss = fused;
    tsys_model *m[2] = {tsys_model_new(ctx, &d, TSYS_CPU, 9), tsys_model_new(ctx, &d, TSYS_CPU, 9)};
    int n = tsys_model_num_tensors(m[0]);
    tsys_optim *o[2] = {tsys_adamw_new(ctx, tsys_model_params(m[0]), n, NULL), tsys_adamw_new(ctx, tsys_model_params(m[1]), n, NULL)};
    TEST_CHECK(tsys_model_set_grad_dtype(m[1], dt) == TSYS_OK, "set_grad_dtype: %s", tsys_ctx_last_error(ctx));
    int64_t shape[2] = {2, 16};
    tsys_tensor *ids = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 2, shape);
    tsys_tensor_randint(ctx, ids, d.vocab_size);
    const char *what = fused ? (overlap ? "fused loss, in backward" : "fused loss") : overlap ? "in backward" : "step";
    int64_t linear = 0, other = 0;
    for (int i = 0; i < n; i++) *(lowpg_linear(m[1], i) ? &linear : &other) += tsys_tensor_numel(tsys_model_params(m[1])[i]);
    for (int step = 0; step < 5; step++) {
        float ref = lowpg_step(ctx, m[0], o[0], ids, dt, true, false);   // the optimizer in backward: the same bits as after it
        if (step == 0) {   // the gradients of the model whose linear weights keep them in dt, before its step
            tsys_autocast_begin(ctx, dt);
            tsys_tensor *loss = tsys_model_loss(m[1], ids, ids);
            tsys_autocast_end(ctx);
            tsys_backward(ctx, loss);
            int wrong = 0;
            for (int i = 0; i < n; i++) {
                tsys_tensor *g = tsys_model_params(m[1])[i]->grad;
                wrong += !g || g->dtype != (lowpg_linear(m[1], i) ? dt : TSYS_F32) || tsys_tensor_grad_dtype(tsys_model_params(m[1])[i]) != g->dtype;
            }
            TEST_CHECK(wrong == 0, "%s %s: %d gradients are not in the dtype asked for", tsys_dtype_name(dt), what, wrong);
            int64_t bytes = tsys_mem_stats_get(ctx, TSYS_CPU).category_bytes[TSYS_MEM_GRADIENTS], want = 2 * linear + 4 * other;
            TEST_CHECK(bytes >= want && bytes <= want + 256 * 4 * (d.num_layers + 2), "%s %s: gradients hold %lld bytes, expected %lld and the alignment",
                       tsys_dtype_name(dt), what, (long long)bytes, (long long)want);
            tsys_release_grads(ctx, tsys_model_params(m[1]), n);
            tsys_tensor_release(loss);
        }
        float got = lowpg_step(ctx, m[1], o[1], ids, dt, false, overlap);
        TEST_CHECK(got == ref, "%s %s step %d: loss %.9g with %s gradients, %.9g with rounded fp32 ones", tsys_dtype_name(dt), what, step, got, tsys_dtype_name(dt), ref);
    }
    TEST_CHECK(lowp_params_differ(m[0], m[1]) == 0, "%s %s: %d parameter tensors differ after 5 steps", tsys_dtype_name(dt), what, lowp_params_differ(m[0], m[1]));
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    tsys_tensor_release(ids);
    for (int k = 0; k < 2; k++) { tsys_optim_free(o[k]); tsys_model_free(m[k]); }
    tsys_ctx_free(ctx);
}
TSYS_TEST(lowp_grads_train_as_rounded_fp32_grads) {
    lowpg_train_case(TSYS_BF16, false, false); lowpg_train_case(TSYS_F16, false, false);
    lowpg_train_case(TSYS_BF16, true, false); lowpg_train_case(TSYS_BF16, false, true);
}

// A low-precision gradient takes one gradient a backward; a second, a rescale in place or a new dtype
// while it is held is refused by name. Without autocast the fp32 GEMM's gradient is rounded into it.
TSYS_TEST(lowp_grads_rules) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_model_desc d = lowp_desc();
    tsys_model *m = tsys_model_new(ctx, &d, TSYS_CPU, 9), *ref = tsys_model_new(ctx, &d, TSYS_CPU, 9);
    int n = tsys_model_num_tensors(m);
    tsys_tensor **p = tsys_model_params(m);
    TEST_CHECK(tsys_model_set_grad_dtype(m, TSYS_BF16) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    int64_t shape[2] = {2, 16};
    tsys_tensor *ids = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 2, shape);
    tsys_tensor_randint(ctx, ids, d.vocab_size);
    // fp32 compute: each kept gradient is the fp32 one rounded once
    tsys_tensor *loss = tsys_model_loss(m, ids, ids);
    tsys_backward(ctx, loss);
    tsys_tensor *loss_ref = tsys_model_loss(ref, ids, ids);
    tsys_backward(ctx, loss_ref);
    lowpg_round(ctx, ref, TSYS_BF16);
    int differ = 0;
    for (int i = 0; i < n; i++) {
        tsys_tensor *g = p[i]->grad, *r = tsys_tensor_new(ctx, g->dtype, TSYS_CPU, g->ndim, g->shape);
        tsys_tensor_cast_from(ctx, r, tsys_model_params(ref)[i]->grad);
        differ += memcmp(tsys_tensor_data(r), tsys_tensor_data(g), tsys_tensor_bytes(g)) != 0;
        tsys_tensor_release(r);
    }
    TEST_CHECK(differ == 0, "fp32 compute: %d kept gradients differ from the rounded fp32 ones", differ);
    TEST_CHECK(tsys_tensor_set_grad_dtype(ctx, p[1], TSYS_F32) == TSYS_ERR_INVALID_ARGS && strstr(tsys_ctx_last_error(ctx), "holds a gradient"), "%s", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(isnan(tsys_clip_grad_norm(ctx, p, n, 1.0)) && strstr(tsys_ctx_last_error(ctx), "keeps its gradient in bf16"), "clip: %s", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    tsys_tensor_release(loss);
    // a second gradient without zero_grad (accumulation) is an error naming the weight
    loss = tsys_model_loss(m, ids, ids);
    TEST_CHECK(tsys_backward(ctx, loss) == TSYS_ERR_INVALID_ARGS && strstr(tsys_ctx_last_error(ctx), "which takes one gradient a backward"), "accumulated: %s", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    tsys_tape_clear(ctx);
    tsys_tensor_release(loss);
    tsys_release_grads(ctx, p, n);
    TEST_CHECK(tsys_tensor_set_grad_dtype(ctx, p[1], TSYS_I32) == TSYS_ERR_INVALID_ARGS && strstr(tsys_ctx_last_error(ctx), "is not bf16, f16 or f32"), "%s", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(tsys_tensor_set_grad_dtype(ctx, ids, TSYS_BF16) == TSYS_ERR_INVALID_ARGS && strstr(tsys_ctx_last_error(ctx), "must be an fp32 leaf"), "%s", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(tsys_model_set_grad_dtype(m, TSYS_F32) == TSYS_OK && tsys_tensor_grad_dtype(p[1]) == TSYS_F32, "back to fp32: %s", tsys_ctx_last_error(ctx));
    tsys_tensor_release(loss_ref);
    tsys_tensor_release(ids);
    tsys_model_free(m); tsys_model_free(ref);
    TEST_CHECK(tsys_mem_stats_get(ctx, TSYS_CPU).live_bytes == 0, "live bytes after everything is freed: %lld", (long long)tsys_mem_stats_get(ctx, TSYS_CPU).live_bytes);
    tsys_ctx_free(ctx);
}

TSYS_TEST(clip_and_cosine_schedule) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t s[1] = {2};
    tsys_tensor *p = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, s);
    tsys_tensor_set_requires_grad(p, true);
    tsys_tensor_fill(ctx, p, 0);
    p->grad = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, s);
    ((float *)tsys_tensor_data(p->grad))[0] = 3; ((float *)tsys_tensor_data(p->grad))[1] = 4;
    double n = tsys_clip_grad_norm(ctx, &p, 1, 1.0);
    float *g = (float *)tsys_tensor_data(p->grad);
    TEST_CHECK(fabs(n - 5.0) < 1e-6 && fabsf(g[0] - 0.6f) < 1e-5f && fabsf(g[1] - 0.8f) < 1e-5f, "clip: norm %g grads %g %g", n, g[0], g[1]);
    TEST_CHECK(tsys_cosine_lr(0, 1, 0.1, 10, 100) == 0.0 && fabs(tsys_cosine_lr(5, 1, 0.1, 10, 100) - 0.5) < 1e-12, "warmup");
    TEST_CHECK(fabs(tsys_cosine_lr(55, 1, 0.1, 10, 100) - 0.55) < 1e-12, "cosine midpoint %g", tsys_cosine_lr(55, 1, 0.1, 10, 100));
    TEST_CHECK(tsys_cosine_lr(101, 1, 0.1, 10, 100) == 0.1, "after the cycle");
    tsys_tensor_release(p);
    tsys_ctx_free(ctx);
}

TSYS_TEST(model_config_validation_and_sizes) {
    char err[256];
    tsys_model_desc d;
    static const struct { const char *name; int64_t params; } sizes[] = {
        {"small", 128625408}, {"medium", 423183360}, {"large", 969411840}, {"xl", 1998235200}, {"2.7B", 3406809600LL}};
    for (int i = 0; i < 5; i++) {
        TEST_CHECK(tsys_model_desc_preset(sizes[i].name, &d, err, sizeof(err)) == TSYS_OK, "%s", err);
        TEST_CHECK(tsys_model_desc_num_params(&d) == sizes[i].params, "%s: %lld params", sizes[i].name, (long long)tsys_model_desc_num_params(&d));
    }
    TEST_CHECK(tsys_model_desc_preset("huge", &d, err, sizeof(err)) == TSYS_ERR_INVALID_ARGS && strstr(err, "unknown model preset 'huge'"), "%s", err);
    d = fixture_desc(); d.num_heads = 5;
    TEST_CHECK(tsys_model_desc_validate(&d, err, sizeof(err)) != TSYS_OK && strstr(err, "d_model 32 is not divisible by num_heads 5"), "%s", err);
    d = fixture_desc(); d.d_model = 36; d.num_heads = 4;
    TEST_CHECK(tsys_model_desc_validate(&d, err, sizeof(err)) != TSYS_OK && strstr(err, "head dim") && strstr(err, "odd"), "%s", err);
    d = fixture_desc(); d.fused_loss = true; d.fused_loss_chunk = -3;
    TEST_CHECK(tsys_model_desc_validate(&d, err, sizeof(err)) != TSYS_OK && strstr(err, "fused_loss_chunk -3 must be >= 0"), "%s", err);
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    d = fixture_desc();
    tsys_model *m = tsys_model_new(ctx, &d, TSYS_CPU, 3);
    TEST_CHECK(m && tsys_model_num_tensors(m) == 21 && !strcmp(tsys_model_params(m)[1]->name, "layers.0.attn.q_proj.weight"), "state names in parameters() order");
    int64_t s[2] = {1, 17};
    tsys_tensor *ids = tsys_tensor_new(ctx, TSYS_I64, TSYS_CPU, 2, s);
    tsys_tensor_fill(ctx, ids, 3);
    TEST_CHECK(tsys_check_token_ids(ctx, ids, 256, 16) != TSYS_OK && strstr(tsys_ctx_last_error(ctx), "longer than the model's context_length 16"), "%s", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(tsys_model_forward(m, ids) == NULL, "forward past the context length");
    tsys_ctx_clear_error(ctx);
    tsys_tensor_release(ids);
    s[1] = 8;
    ids = tsys_tensor_new(ctx, TSYS_I64, TSYS_CPU, 2, s);
    tsys_tensor_fill(ctx, ids, 3);
    ((int64_t *)tsys_tensor_data(ids))[5] = 256;
    TEST_CHECK(tsys_check_token_ids(ctx, ids, 256, 16) != TSYS_OK && strstr(tsys_ctx_last_error(ctx), "id 256 at position 5 is outside the vocabulary"), "%s", tsys_ctx_last_error(ctx));
    tsys_tensor_release(ids);
    tsys_model_free(m);
    tsys_ctx_free(ctx);
}

// ---- Hugging Face Llama checkpoints ------------------------------------------------------------

// The HF name of a tsys parameter and whether its rows are q/k (RoPE layout); NULL for lm_head when tied.
static const char *hf_name(const char *n, char *buf, size_t len, bool *rope) {
    static const char *const map[][2] = {
        {"attn.q_proj.weight", "self_attn.q_proj.weight"}, {"attn.k_proj.weight", "self_attn.k_proj.weight"},
        {"attn.v_proj.weight", "self_attn.v_proj.weight"}, {"attn.output_proj.weight", "self_attn.o_proj.weight"},
        {"ffn.w1.weight", "mlp.gate_proj.weight"}, {"ffn.w3.weight", "mlp.up_proj.weight"}, {"ffn.w2.weight", "mlp.down_proj.weight"},
        {"ln1.weight", "input_layernorm.weight"}, {"ln2.weight", "post_attention_layernorm.weight"},
    };
    int layer, at = 0;
    *rope = false;
    if (!strcmp(n, "token_embeddings.weight")) return "model.embed_tokens.weight";
    if (!strcmp(n, "ln_final.weight")) return "model.norm.weight";
    if (!strcmp(n, "lm_head.weight")) return "lm_head.weight";
    if (sscanf(n, "layers.%d.%n", &layer, &at) != 1 || !at) return NULL;
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
        if (!strcmp(n + at, map[i][0])) {
            snprintf(buf, len, "model.layers.%d.%s", layer, map[i][1]);
            *rope = i < 2;
            return buf;
        }
    return NULL;
}

// Writes m as save_pretrained would, into dir (model.safetensors, config.json): HF names, q/k rows in
// rotate-half order (HF row i of a head of d rows is tsys row 2i, HF row i + d/2 is tsys row 2i + 1),
// lm_head left out when tied, an inv_freq buffer as older transformers saved. kv_rows < d_model writes
// k/v projections of that many rows (grouped-query attention).
static bool hf_save(tsys_ctx *ctx, tsys_model *m, const char *dir, bool tied, int kv_rows) {
    const tsys_model_desc *d = tsys_model_get_desc(m);
    int n = tsys_model_num_tensors(m), k = 0;
    tsys_tensor **out = (tsys_tensor **)calloc((size_t)n + 1, sizeof *out);
    int64_t H = d->num_heads, hd = d->d_model / H;
    for (int i = 0; i < n; i++) {
        tsys_tensor *p = tsys_model_params(m)[i];
        char buf[160];
        bool rope;
        const char *name = hf_name(p->name, buf, sizeof buf, &rope);
        if (!name || (tied && !strcmp(name, "lm_head.weight"))) continue;
        float *v = test_read(ctx, p), *w = (float *)malloc(tsys_tensor_bytes(p));
        int64_t rows = p->ndim == 2 ? p->shape[0] : 1, cols = p->ndim == 2 ? p->shape[1] : p->shape[0];
        memcpy(w, v, tsys_tensor_bytes(p));
        if (rope)
            for (int64_t h = 0; h < H; h++)
                for (int64_t r = 0; r < hd; r++) {   // HF row r of the head from tsys row 2r or 2(r - d/2) + 1
                    int64_t src = r < hd / 2 ? 2 * r : 2 * (r - hd / 2) + 1;
                    memcpy(w + (h * hd + r) * cols, v + (h * hd + src) * cols, sizeof(float) * (size_t)cols);
                }
        int64_t shape[2] = {p->ndim == 2 ? rows : cols, cols};
        if (kv_rows && (strstr(name, ".k_proj.") || strstr(name, ".v_proj."))) shape[0] = kv_rows;
        out[k] = tsys_tensor_from_data(ctx, TSYS_F32, TSYS_CPU, p->ndim, shape, w);
        tsys_tensor_set_name(out[k++], "%s", name);
        free(v); free(w);
    }
    float inv[4] = {1, 0.1f, 0.01f, 0.001f};
    int64_t s4 = 4;
    out[k] = tsys_tensor_from_data(ctx, TSYS_F32, TSYS_CPU, 1, &s4, inv);
    tsys_tensor_set_name(out[k++], "model.layers.0.self_attn.rotary_emb.inv_freq");
    char path[600];
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    bool ok = tsys_safetensors_save(ctx, path, out, k) == TSYS_OK;
    for (int i = 0; i < k; i++) tsys_tensor_release(out[i]);
    free(out);
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    if (!f) return false;
    fprintf(f, "{\n  \"architectures\": [\"LlamaForCausalLM\"],\n  \"attention_bias\": false,\n  \"hidden_act\": \"silu\",\n  \"hidden_size\": %d,\n"
               "  \"intermediate_size\": %d,\n  \"max_position_embeddings\": %d,\n  \"model_type\": \"llama\",\n  \"num_attention_heads\": %d,\n"
               "  \"num_hidden_layers\": %d,\n  \"num_key_value_heads\": %d,\n  \"rms_norm_eps\": %.9g,\n  \"rope_scaling\": null,\n  \"rope_theta\": %.9g,\n"
               "  \"tie_word_embeddings\": %s,\n  \"torch_dtype\": \"float32\",\n  \"vocab_size\": %d\n}\n",
            d->d_model, d->d_ff, d->context_length, d->num_heads, d->num_layers, kv_rows ? kv_rows / (int)hd : d->num_heads, (double)d->eps,
            (double)d->rope_theta, tied ? "true" : "false", d->vocab_size);
    fclose(f);
    return ok;
}

static char hf_tmp[64];
static const char *hf_dir(const char *name) {
    static char buf[4][300];
    static int next;
    if (!hf_tmp[0]) { strcpy(hf_tmp, "/tmp/tsys_hf_XXXXXX"); if (!mkdtemp(hf_tmp)) return NULL; }
    char *p = buf[next++ % 4];
    snprintf(p, 300, "%s/%s", hf_tmp, name);
    return p;
}

static tsys_model_desc hf_test_desc(void) {
    tsys_model_desc d;
    memset(&d, 0, sizeof d);
    d.vocab_size = 96; d.context_length = 16; d.d_model = 32; d.num_layers = 2; d.num_heads = 4; d.d_ff = 48;
    d.rope_theta = 10000.0f; d.eps = 1e-6f;
    return d;
}

// An HF-layout checkpoint made from a tsys model loads back into the same weights and logits, bit for
// bit: the names map, q/k rows permute back, a tied lm_head comes from the embedding, and the dims come
// from config.json.
TSYS_TEST(model_loads_hf_llama_checkpoint) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_model_desc d = hf_test_desc();
    for (int tied = 0; tied < 2; tied++) {
        tsys_model *src = tsys_model_new(ctx, &d, TSYS_CPU, 11);
        if (tied) tsys_tensor_copy_from(ctx, tsys_model_param(src, "lm_head.weight"), tsys_model_param(src, "token_embeddings.weight"));
        const char *dir = hf_dir(tied ? "tied" : "untied");
        TEST_CHECK(src && dir && hf_save(ctx, src, dir, tied, 0), "hf_save: %s", tsys_ctx_last_error(ctx));
        tsys_model_desc got;
        char err[512], file[400];
        TEST_CHECK(tsys_model_desc_from_file(dir, &got, err, sizeof err) == TSYS_OK, "desc from the directory: %s", err);
        TEST_CHECK(got.vocab_size == 96 && got.context_length == 16 && got.d_model == 32 && got.num_layers == 2 && got.num_heads == 4 && got.d_ff == 48
                   && got.rope_theta == 10000.0f && got.eps == 1e-6f, "dims from config.json");
        snprintf(file, sizeof file, "%s/model.safetensors", dir);
        tsys_model_desc got2;
        TEST_CHECK(tsys_model_desc_from_file(file, &got2, err, sizeof err) == TSYS_OK && !memcmp(&got, &got2, sizeof got), "desc from the file: %s", err);
        tsys_model *dst = tsys_model_new(ctx, &got, TSYS_CPU, 99);
        TEST_CHECK(dst && tsys_model_load(dst, tied ? dir : file) == TSYS_OK, "load: %s", tsys_ctx_last_error(ctx));
        tsys_ctx_clear_error(ctx);
        for (int i = 0; dst && i < tsys_model_num_tensors(dst); i++) {
            tsys_tensor *a = tsys_model_params(src)[i], *b = tsys_model_params(dst)[i];
            TEST_CHECK(!memcmp(tsys_tensor_data(a), tsys_tensor_data(b), tsys_tensor_bytes(a)), "%s differs after the round trip", a->name);
        }
        int64_t sh[2] = {2, 16};
        tsys_tensor *ids = tsys_tensor_new(ctx, TSYS_I64, TSYS_CPU, 2, sh);
        tsys_tensor_randint(ctx, ids, d.vocab_size);
        tsys_tensor *la = tsys_model_forward(src, ids), *lb = dst ? tsys_model_forward(dst, ids) : NULL;
        TEST_CHECK(la && lb && !memcmp(tsys_tensor_data(la), tsys_tensor_data(lb), tsys_tensor_bytes(la)), "logits differ");
        tsys_tensor_release(la); tsys_tensor_release(lb); tsys_tensor_release(ids);
        tsys_model_free(dst);
        tsys_model_free(src);
    }
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    tsys_ctx_free(ctx);
}

// RoPE in HF's rotate-half convention, by hand, against tsys's RoPE on the rows the loader permutes:
// each rotated coordinate lands where the permutation says, and every score q.k is the same.
TSYS_TEST(model_hf_rope_permutation_matches_rotate_half) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_model_desc d;
    memset(&d, 0, sizeof d);
    d.vocab_size = 8; d.context_length = 8; d.d_model = 8; d.num_layers = 1; d.num_heads = 2; d.d_ff = 8; d.rope_theta = 100.0f;
    tsys_model *m = tsys_model_new(ctx, &d, TSYS_CPU, 3);
    // The checkpoint's q_proj and k_proj, in HF layout: W[r][c] = distinct small values.
    float wq[64], wk[64], x[8] = {0.3f, -1.2f, 0.7f, 2.0f, -0.4f, 1.1f, 0.05f, -0.9f};
    for (int i = 0; i < 64; i++) { wq[i] = (float)((i * 37) % 19 - 9) / 7.0f; wk[i] = (float)((i * 23) % 17 - 8) / 5.0f; }
    // hf_save permutes tsys rows into HF order; give it the inverse, so the file holds wq, wk as they are
    const int hd = 4, T = 6;
    float tq[64], tk[64];
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < hd; r++) {
            int src = r < hd / 2 ? 2 * r : 2 * (r - hd / 2) + 1;   // HF row r is tsys row src
            memcpy(tq + (h * hd + src) * 8, wq + (h * hd + r) * 8, sizeof(float) * 8);
            memcpy(tk + (h * hd + src) * 8, wk + (h * hd + r) * 8, sizeof(float) * 8);
        }
    memcpy(tsys_tensor_data(tsys_model_param(m, "layers.0.attn.q_proj.weight")), tq, sizeof tq);
    memcpy(tsys_tensor_data(tsys_model_param(m, "layers.0.attn.k_proj.weight")), tk, sizeof tk);
    const char *dir = hf_dir("rope");
    TEST_CHECK(hf_save(ctx, m, dir, false, 0), "hf_save: %s", tsys_ctx_last_error(ctx));
    // the file holds wq as given
    char file[400];
    snprintf(file, sizeof file, "%s/model.safetensors", dir);
    tsys_tensor **list = NULL;
    int nl = 0;
    TEST_CHECK(tsys_safetensors_load(ctx, file, TSYS_CPU, &list, &nl) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    for (int i = 0; i < nl; i++)
        if (!strcmp(list[i]->name, "model.layers.0.self_attn.q_proj.weight")) TEST_CHECK(!memcmp(tsys_tensor_data(list[i]), wq, sizeof wq), "file q_proj is not wq");
    tsys_tensor_list_free(list, nl);
    tsys_model *l = tsys_model_new(ctx, &d, TSYS_CPU, 4);
    TEST_CHECK(l && tsys_model_load(l, dir) == TSYS_OK, "load: %s", tsys_ctx_last_error(ctx));
    const float *lq = (const float *)tsys_tensor_data(tsys_model_param(l, "layers.0.attn.q_proj.weight"));
    const float *lk = (const float *)tsys_tensor_data(tsys_model_param(l, "layers.0.attn.k_proj.weight"));
    double worst_elem = 0, worst_score = 0;
    for (int h = 0; h < 2; h++) {
        // HF: q = Wq x per head, rotate-half RoPE at positions 0..T-1 (freq_i = theta^(-2i/d), pair (i, i + d/2))
        float hq[6][4], hk[6][4];
        int64_t shape[2] = {T, hd};
        float qin[6 * 4], kin[6 * 4];
        for (int t = 0; t < T; t++)
            for (int r = 0; r < hd; r++) {
                double aq = 0, ak = 0, bq = 0, bk = 0;
                for (int c = 0; c < 8; c++) {
                    aq += wq[(h * hd + r) * 8 + c] * x[c]; ak += wk[(h * hd + r) * 8 + c] * x[c];
                    bq += lq[(h * hd + r) * 8 + c] * x[c]; bk += lk[(h * hd + r) * 8 + c] * x[c];
                }
                hq[t][r] = (float)aq; hk[t][r] = (float)ak;
                qin[t * hd + r] = (float)bq; kin[t * hd + r] = (float)bk;   // tsys's q, k from the loaded rows
            }
        for (int t = 0; t < T; t++) {
            float q2[4], k2[4];
            for (int i = 0; i < hd / 2; i++) {
                double f = pow(100.0, -2.0 * i / hd), c = cos(t * f), s = sin(t * f);
                q2[i] = (float)(hq[t][i] * c - hq[t][i + 2] * s); q2[i + 2] = (float)(hq[t][i + 2] * c + hq[t][i] * s);
                k2[i] = (float)(hk[t][i] * c - hk[t][i + 2] * s); k2[i + 2] = (float)(hk[t][i + 2] * c + hk[t][i] * s);
            }
            memcpy(hq[t], q2, sizeof q2); memcpy(hk[t], k2, sizeof k2);
        }
        tsys_tensor *tq_in = tsys_tensor_from_data(ctx, TSYS_F32, TSYS_CPU, 2, shape, qin), *tk_in = tsys_tensor_from_data(ctx, TSYS_F32, TSYS_CPU, 2, shape, kin);
        tsys_tensor *rq = tsys_rope(ctx, tq_in, 100.0f), *rk = tsys_rope(ctx, tk_in, 100.0f);
        const float *yq = (const float *)tsys_tensor_data(rq), *yk = (const float *)tsys_tensor_data(rk);
        for (int t = 0; t < T; t++) {
            for (int i = 0; i < hd / 2; i++) {   // tsys pair (2i, 2i+1) is HF pair (i, i + d/2)
                worst_elem = fmax(worst_elem, fabs(yq[t * hd + 2 * i] - hq[t][i]) + fabs(yq[t * hd + 2 * i + 1] - hq[t][i + 2]));
                worst_elem = fmax(worst_elem, fabs(yk[t * hd + 2 * i] - hk[t][i]) + fabs(yk[t * hd + 2 * i + 1] - hk[t][i + 2]));
            }
            for (int u = 0; u < T; u++) {
                double a = 0, b = 0;
                for (int r = 0; r < hd; r++) { a += (double)hq[t][r] * hk[u][r]; b += (double)yq[t * hd + r] * yk[u * hd + r]; }
                worst_score = fmax(worst_score, fabs(a - b) / (1 + fabs(a)));
            }
        }
        tsys_tensor_release(tq_in); tsys_tensor_release(tk_in); tsys_tensor_release(rq); tsys_tensor_release(rk);
    }
    TEST_CHECK(worst_elem < 1e-5, "rotated coordinates differ by %.3g", worst_elem);
    TEST_CHECK(worst_score < 1e-5, "scores differ by %.3g (relative)", worst_score);
    tsys_model_free(l);
    tsys_model_free(m);
    tsys_ctx_free(ctx);
}

// What tsys cannot run is refused by name: grouped-query attention (config and tensors), scaled RoPE.
TSYS_TEST(model_hf_refuses_gqa_and_scaled_rope) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_model_desc d = hf_test_desc();
    tsys_model *src = tsys_model_new(ctx, &d, TSYS_CPU, 11);
    const char *dir = hf_dir("gqa");
    TEST_CHECK(hf_save(ctx, src, dir, false, 16), "hf_save: %s", tsys_ctx_last_error(ctx));
    tsys_model_desc got;
    char err[512];
    TEST_CHECK(tsys_model_desc_from_file(dir, &got, err, sizeof err) == TSYS_ERR_IO && strstr(err, "config.json") && strstr(err, "num_key_value_heads")
               && strstr(err, "grouped-query"), "GQA config: %s", err);
    tsys_model *dst = tsys_model_new(ctx, &d, TSYS_CPU, 2);
    tsys_status s = tsys_model_load(dst, dir);
    const char *msg = tsys_ctx_last_error(ctx);
    TEST_CHECK(s == TSYS_ERR_UNSUPPORTED && strstr(msg, "model.layers.0.self_attn.k_proj.weight") && strstr(msg, "grouped-query"), "GQA load: %s", msg);
    tsys_ctx_clear_error(ctx);
    // scaled RoPE in config.json, and no config.json at all
    dir = hf_dir("scaled");
    TEST_CHECK(hf_save(ctx, src, dir, false, 0), "hf_save: %s", tsys_ctx_last_error(ctx));
    char path[400];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    if (f) { fputs("{\"hidden_size\": 32, \"intermediate_size\": 48, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"vocab_size\": 96,"
                   " \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0}}", f); fclose(f); }
    TEST_CHECK(tsys_model_desc_from_file(dir, &got, err, sizeof err) == TSYS_ERR_IO && strstr(err, "llama3"), "scaled RoPE: %s", err);
    if ((f = fopen(path, "w"))) { fputs("{\"hidden_size\": 32, \"intermediate_size\": 48, \"num_hidden_layers\": 2, \"vocab_size\": 96}", f); fclose(f); }
    TEST_CHECK(tsys_model_desc_from_file(dir, &got, err, sizeof err) == TSYS_ERR_IO && strstr(err, "config.json") && strstr(err, "\"num_attention_heads\""), "missing key: %s", err);
    remove(path);
    TEST_CHECK(tsys_model_desc_from_file(dir, &got, err, sizeof err) == TSYS_ERR_IO && strstr(err, "config.json") && strstr(err, "cannot open"), "no config: %s", err);
    tsys_model_free(dst);
    tsys_model_free(src);
    tsys_ctx_free(ctx);
}

// With TSYS_HF_CHECK_DIR set (tests/ref/hf_llama_check.py sets it): the checkpoint there, saved by
// transformers' save_pretrained, gives transformers' logits and loss (check.safetensors) within 1e-5.
TSYS_TEST(model_matches_transformers_llama) {
    const char *dir = getenv("TSYS_HF_CHECK_DIR");
    if (!dir || !*dir) return;   // only when the reference has been made
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_model_desc d;
    char err[512], path[600];
    TEST_CHECK(tsys_model_desc_from_file(dir, &d, err, sizeof err) == TSYS_OK, "desc: %s", err);
    tsys_model *m = tsys_model_new(ctx, &d, TSYS_CPU, 1);
    TEST_CHECK(m && tsys_model_load(m, dir) == TSYS_OK, "load: %s", tsys_ctx_last_error(ctx));
    snprintf(path, sizeof path, "%s/check.safetensors", dir);
    tsys_tensor **list = NULL;
    int n = 0;
    TEST_CHECK(tsys_safetensors_load(ctx, path, TSYS_CPU, &list, &n) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    tsys_tensor *ids = find(list, n, "input_ids"), *tgt = find(list, n, "targets"), *ref = find(list, n, "logits"), *ref_loss = find(list, n, "loss");
    if (m && ids && tgt && ref && ref_loss) {
        tsys_tensor *logits = tsys_model_forward(m, ids);
        tsys_tensor *loss = logits ? tsys_cross_entropy(ctx, logits, tgt) : NULL;
        float *a = logits ? test_read(ctx, logits) : NULL, *b = test_read(ctx, ref);
        double worst = 0, scale = 0;
        for (int64_t i = 0; a && b && i < tsys_tensor_numel(ref); i++) { worst = fmax(worst, fabs((double)a[i] - b[i])); scale = fmax(scale, fabs((double)b[i])); }
        double rel = a && b && logits && tsys_tensor_numel(logits) == tsys_tensor_numel(ref) ? worst / scale : INFINITY;
        double l = loss ? tsys_item(ctx, loss) : NAN, lr = tsys_item(ctx, ref_loss);
        printf("\n    logits max |diff| / max |ref| %.3g, loss %.8f vs transformers %.8f (rel %.3g)\n  ", rel, l, lr, fabs(l - lr) / fabs(lr));
        TEST_CHECK(rel <= 1e-5, "logits relative error %.3g", rel);
        TEST_CHECK(fabs(l - lr) <= 1e-5 * fabs(lr), "loss %.8f vs %.8f", l, lr);
        free(a); free(b);
        tsys_tensor_release(logits); tsys_tensor_release(loss);
    } else TEST_CHECK(0, "%s lacks input_ids, targets, logits or loss", path);
    tsys_tensor_list_free(list, n);
    tsys_model_free(m);
    tsys_ctx_free(ctx);
}

static void hf_cleanup(void) {
    if (!hf_tmp[0]) return;
    char cmd[200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", hf_tmp);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", hf_tmp);
}

int main(int argc, char **argv) { int rc = tsys_test_main(argc, argv); hf_cleanup(); return rc; }
