// test_util.h - small helpers shared by the C tests (after tsys.h).
#ifndef TSYS_TEST_UTIL_H
#define TSYS_TEST_UTIL_H
#include <stdlib.h>
#include <string.h>

// A tensor's elements as a malloc'd fp32 array (any dtype, any device).
static inline float *test_read(tsys_ctx *ctx, const tsys_tensor *t) {
    int64_t n = tsys_tensor_numel(t);
    float *v = (float *)malloc(sizeof(float) * (size_t)(n ? n : 1));
    if (v && tsys_tensor_to_f32(ctx, t, v) != TSYS_OK) { free(v); return NULL; }
    return v;
}

// ---- kernel coverage: launches that succeeded, per kernel, counted through the trace hooks ------

typedef struct test_kernel_count { tsys_device device; int ok[TSYS_K_COUNT + 1]; } test_kernel_count;
static inline void test_count_kernel(tsys_ctx *ctx, const tsys_trace_kernel *k, void *user) {
    (void)ctx;
    test_kernel_count *c = (test_kernel_count *)user;
    if (k->device == c->device && k->status == TSYS_OK) c->ok[k->kernel]++;
}

static inline tsys_tensor *test_param(tsys_ctx *ctx, tsys_device dev, int ndim, const int64_t *shape, float std) {
    tsys_tensor *t = tsys_tensor_new(ctx, TSYS_F32, dev, ndim, shape);
    if (t) { tsys_tensor_randn(ctx, t, std); tsys_tensor_set_requires_grad(t, true); }
    return t;
}

// Runs every op, forward and backward, the optimizers, clipping, loss scaling and autocast on dev:
// together they launch every kernel of the TSYS_KERNELS table. Fills `count` through the kernel
// hook (the context's other hooks are kept and restored) and returns the context's status.
static inline tsys_status test_run_every_kernel(tsys_ctx *ctx, tsys_device dev, test_kernel_count *count) {
    memset(count, 0, sizeof(*count));
    count->device = dev;
    tsys_trace_hooks mine;
    memset(&mine, 0, sizeof(mine));
    mine.kernel = test_count_kernel; mine.user = count;
    tsys_trace_hooks h = tsys_ctx_set_trace_hooks(ctx, &mine);
    // a two-layer model on naive attention: embedding, linear, rmsnorm, rope, transpose, matmul,
    // softmax, swiglu, add, view, cross-entropy; then AdamW, clipping and the fp16 loss scaler
    tsys_model_desc d = tsys_model_desc_defaults(NULL);
    d.vocab_size = 50; d.context_length = 8; d.d_model = 32; d.num_layers = 2; d.num_heads = 2; d.d_ff = 48;
    tsys_model *m = tsys_model_new(ctx, &d, dev, 3);
    int64_t sid[2] = {2, 8};
    tsys_tensor *ids_h = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 2, sid);
    if (ids_h) tsys_tensor_randint(ctx, ids_h, d.vocab_size);
    tsys_tensor *ids = tsys_tensor_to(ctx, ids_h, dev);
    tsys_optim *opt = m ? tsys_adamw_new(ctx, tsys_model_params(m), tsys_model_num_tensors(m), NULL) : NULL;
    tsys_grad_scaler scaler = tsys_grad_scaler_init();
    for (int autocast = 0; autocast < 2 && m && opt && ids; autocast++) {
        if (autocast) tsys_autocast_begin(ctx, TSYS_F16);   // casts the weights: CAST
        tsys_tensor *logits = tsys_model_forward(m, ids);
        tsys_tensor *loss = tsys_cross_entropy(ctx, logits, ids);
        if (autocast) tsys_autocast_end(ctx);
        tsys_tensor *scaled = tsys_grad_scaler_scale(ctx, &scaler, loss);
        tsys_backward(ctx, scaled);
        tsys_grad_scaler_step(&scaler, opt);   // NONFINITE, SCALE, STEP_INC, ADAMW
        tsys_grad_scaler_update(&scaler);
        tsys_clip_grad_norm(ctx, tsys_model_params(m), tsys_model_num_tensors(m), 0.5);   // SUMSQ
        tsys_optim_zero_grad(opt);
        tsys_tensor_release(logits); tsys_tensor_release(loss); tsys_tensor_release(scaled);
    }
    // the ops the model does not use: layernorm with bias, linear with bias, relu, silu, mul, mse,
    // mean, flash attention; x is used twice so its gradients accumulate (ACCUM)
    int64_t sx[2] = {6, 16}, sw[2] = {16, 16}, sb[1] = {16}, sq[3] = {2, 5, 16};
    tsys_tensor *x = test_param(ctx, dev, 2, sx, 1), *w = test_param(ctx, dev, 2, sw, 0.3f), *b = test_param(ctx, dev, 1, sb, 0.1f);
    tsys_tensor *q = test_param(ctx, dev, 3, sq, 1), *k = test_param(ctx, dev, 3, sq, 1), *v = test_param(ctx, dev, 3, sq, 1);
    tsys_tensor *ln = tsys_layernorm(ctx, x, b, b, 1e-5f), *lin = tsys_linear(ctx, ln, w, b);
    tsys_tensor *r = tsys_relu(ctx, lin), *s = tsys_silu(ctx, x), *p = tsys_mul(ctx, r, s);
    tsys_tensor *e = tsys_mse(ctx, p, x), *o = tsys_flash_attention(ctx, q, k, v, true, NULL);
    tsys_tensor *om = tsys_mean(ctx, o), *total = tsys_add(ctx, e, om);
    tsys_backward(ctx, total);
    tsys_tensor *params[3] = {x, w, b};
    tsys_optim *sgd = tsys_sgd_new(ctx, params, 3, 0.1f);
    tsys_optim_step(sgd);
    tsys_tensor *tl[12] = {ln, lin, r, s, p, e, o, om, total, q, k, v};
    for (int i = 0; i < 12; i++) tsys_tensor_release(tl[i]);
    for (int i = 0; i < 3; i++) tsys_tensor_release(params[i]);
    tsys_optim_free(sgd);
    tsys_optim_free(opt);
    tsys_tensor_release(ids); tsys_tensor_release(ids_h);
    tsys_model_free(m);
    tsys_sync(ctx, dev);
    tsys_ctx_set_trace_hooks(ctx, &h);
    return tsys_ctx_status(ctx);
}
#endif
