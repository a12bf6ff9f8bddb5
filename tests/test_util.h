// test_util.h - small helpers shared by the C tests (after tsys.h).
#ifndef TSYS_TEST_UTIL_H
#define TSYS_TEST_UTIL_H
#include <stdlib.h>
#include <string.h>
#include <math.h>

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
    // AdamW inside the weight-gradient products (LINEAR_ADAMW)
    if (m && opt && ids) {
        tsys_autocast_begin(ctx, TSYS_BF16);
        tsys_tensor *logits = tsys_model_forward(m, ids), *loss = tsys_cross_entropy(ctx, logits, ids);
        tsys_autocast_end(ctx);
        tsys_optim_overlap_begin_ex(opt, TSYS_OPTIM_FUSE_UPDATE);
        tsys_backward(ctx, loss);
        tsys_optim_overlap_end(opt);
        tsys_optim_release_grads(opt);
        tsys_tensor_release(logits); tsys_tensor_release(loss);
    }
    // the ops the model does not use: layernorm with bias, linear with bias, relu, silu, mul, mse,
    // mean, flash attention, the fused linear + cross-entropy; x is used twice so its gradients accumulate (ACCUM)
    int64_t sx[2] = {6, 16}, sw[2] = {16, 16}, sb[1] = {16}, sq[3] = {2, 5, 16};
    tsys_tensor *x = test_param(ctx, dev, 2, sx, 1), *w = test_param(ctx, dev, 2, sw, 0.3f), *b = test_param(ctx, dev, 1, sb, 0.1f);
    tsys_tensor *q = test_param(ctx, dev, 3, sq, 1), *k = test_param(ctx, dev, 3, sq, 1), *v = test_param(ctx, dev, 3, sq, 1);
    tsys_tensor *ln = tsys_layernorm(ctx, x, b, b, 1e-5f), *lin = tsys_linear(ctx, ln, w, b);
    tsys_tensor *r = tsys_relu(ctx, lin), *s = tsys_silu(ctx, x), *p = tsys_mul(ctx, r, s);
    tsys_tensor *e = tsys_mse(ctx, p, x), *o = tsys_flash_attention(ctx, q, k, v, true, NULL);
    tsys_tensor *om = tsys_mean(ctx, o), *total = tsys_add(ctx, e, om);
    tsys_backward(ctx, total);
    int64_t sy[1] = {6};   // linear + cross-entropy fused: its backward scales by the loss's gradient (SCALE_BY)
    tsys_tensor *y = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 1, sy), *yd = NULL, *lce = NULL;
    if (y) { tsys_tensor_fill(ctx, y, 3.0f); yd = tsys_tensor_to(ctx, y, dev); }
    lce = yd ? tsys_linear_cross_entropy(ctx, x, w, yd, 4) : NULL;
    if (lce) tsys_backward(ctx, lce);
    tsys_tensor_release(lce); tsys_tensor_release(yd); tsys_tensor_release(y);
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
// ---- the fused head + loss against linear + cross_entropy -----------------------------------------

// The loss, d x and d w of tsys_linear_cross_entropy (out[1]) and of tsys_linear + tsys_cross_entropy
// (out[0]) on the same leaves x and w, under autocast (TSYS_F32: none), the loss scaled by scale before
// backward; each read to the host (free them). The leaves' gradients are cleared after each path.
static inline void test_lce_paths(tsys_ctx *ctx, tsys_tensor *x, tsys_tensor *w, tsys_tensor *t, tsys_dtype autocast, int64_t chunk, float scale,
                                  float *out[2][3]) {
    for (int fused = 0; fused < 2; fused++) {
        if (autocast != TSYS_F32) tsys_autocast_begin(ctx, autocast);
        tsys_tensor *logits = fused ? NULL : tsys_linear(ctx, x, w, NULL);
        tsys_tensor *loss = fused ? tsys_linear_cross_entropy(ctx, x, w, t, chunk) : tsys_cross_entropy(ctx, logits, t);
        if (autocast != TSYS_F32) tsys_autocast_end(ctx);
        tsys_tensor *scaled = !loss ? NULL : scale != 1.0f ? tsys_scale(ctx, loss, scale) : tsys_tensor_retain(loss);
        if (scaled) tsys_backward(ctx, scaled);
        out[fused][0] = loss ? test_read(ctx, loss) : NULL;
        out[fused][1] = x->grad ? test_read(ctx, x->grad) : NULL;
        out[fused][2] = w->grad ? test_read(ctx, w->grad) : NULL;
        tsys_tensor_release(logits); tsys_tensor_release(loss); tsys_tensor_release(scaled);
        tsys_tensor_release(x->grad); x->grad = NULL; tsys_tensor_release(w->grad); w->grad = NULL;
    }
}
// max |a - b| over max |b|
static inline double test_max_rel(const float *a, const float *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) { num = fmax(num, fabs((double)a[i] - b[i])); den = fmax(den, fabs((double)b[i])); }
    return num / (den + 1e-30);
}

// ---- memory: one recorded training step against the first-principles prediction ----------------

// What test_mem_step measured: the tracker's peak and its activations, the prediction, and the
// timeline's own consistency (allocations paired with frees of the same id and size, moves in
// pairs, shapes on the allocations of tensors).
typedef struct test_mem_result {
    int64_t peak, workspace;    // workspace at the peak: the prediction leaves library workspace out
    int64_t params_at_peak;     // the parameters category at the peak
    int64_t saved;              // the most activations (tensors the tape keeps) alive at once
    tsys_model_mem_estimate predicted;
    int unpaired_frees, bad_shapes, odd_moves, allocs;
} test_mem_result;

// A model whose activations outweigh its parameters (so the prediction's activation terms are what
// is tested), a warmup step, then one recorded step: forward (under no_grad when !backward),
// backward, AdamW when optimizer (keeping the dt weight copies when kept: tsys_optim_keep_lowp).
// vocab: the model's vocabulary (test_mem_step: 512); fused: desc.fused_loss (the loss through tsys_model_loss).
static inline tsys_status test_mem_step_ex(tsys_ctx *ctx, tsys_device dev, const char *attn, tsys_dtype dt, bool backward, bool optimizer, bool kept,
                                           bool fused, int vocab, test_mem_result *r) {
    memset(r, 0, sizeof(*r));
    tsys_model_desc d = tsys_model_desc_defaults(NULL);
    d.vocab_size = vocab; d.context_length = 128; d.d_model = 64; d.num_layers = 3; d.num_heads = 4; d.d_ff = 192; d.attn = attn; d.fused_loss = fused; d.fused_loss_chunk = fused ? 64 : 0;
    int64_t B = 2, T = 128, shape[2] = {B, T};
    tsys_model *m = tsys_model_new(ctx, &d, dev, 5);
    tsys_optim *opt = m && optimizer ? tsys_adamw_new(ctx, tsys_model_params(m), tsys_model_num_tensors(m), NULL) : NULL;
    if (opt && kept && dt != TSYS_F32) tsys_optim_keep_lowp(opt, dt);
    tsys_tensor *ids = tsys_tensor_new(ctx, TSYS_I32, dev, 2, shape);
    if (ids) tsys_tensor_randint(ctx, ids, d.vocab_size);
    for (int step = 0; step < 2 && tsys_ctx_status(ctx) == TSYS_OK; step++) {
        if (step == 1) { tsys_sync(ctx, dev); tsys_mem_clear_events(ctx); tsys_mem_record_events(ctx, true); tsys_mem_reset_peak(ctx, dev); }
        if (!backward) tsys_no_grad_begin(ctx);
        if (dt != TSYS_F32) tsys_autocast_begin(ctx, dt);
        tsys_tensor *logits = backward ? NULL : tsys_model_forward(m, ids);
        tsys_tensor *loss = backward ? tsys_model_loss(m, ids, ids) : NULL;
        if (dt != TSYS_F32) tsys_autocast_end(ctx);
        if (!backward) tsys_no_grad_end(ctx);
        tsys_tensor_release(logits);
        if (loss) tsys_backward(ctx, loss);
        if (opt) tsys_optim_step(opt);
        if (loss) tsys_release_grads(ctx, tsys_model_params(m), tsys_model_num_tensors(m));
        tsys_tensor_release(loss);
        tsys_tape_clear(ctx);
        tsys_sync(ctx, dev);
    }
    tsys_mem_record_events(ctx, false);
    tsys_mem_stats st = tsys_mem_stats_get(ctx, dev);
    r->peak = st.peak_bytes;
    r->workspace = st.peak_category_bytes[TSYS_MEM_WORKSPACE];
    r->params_at_peak = st.peak_category_bytes[TSYS_MEM_PARAMETERS];
    r->predicted = tsys_model_mem_predict_kept(&d, B, T, dt, backward, optimizer, kept);
    size_t n;
    const tsys_mem_event *ev = tsys_mem_events(ctx, &n);
    uint64_t first = UINT64_MAX;   // ids are serial: a free below the window's first allocation frees an older one
    for (size_t i = 0; i < n; i++) if (ev[i].action == TSYS_MEM_EV_ALLOC && ev[i].id && ev[i].id < first) first = ev[i].id;
    int64_t saved = 0;   // the tape is empty when the window opens
    for (size_t i = 0; i < n; i++) {
        const tsys_mem_event *e = &ev[i];
        if (e->device == dev && e->category == TSYS_MEM_ACTIVATIONS) { saved += e->delta; if (saved > r->saved) r->saved = saved; }
    }
    for (size_t i = 0; i < n; i++) {
        const tsys_mem_event *e = &ev[i];
        if (e->device != dev || !e->id) continue;
        if (e->action == TSYS_MEM_EV_ALLOC) {
            r->allocs++;
            int64_t numel = 1;
            for (int k = 0; k < e->ndim; k++) numel *= e->shape[k];
            r->bad_shapes += e->ndim < 0 || numel * (int64_t)tsys_dtype_size(e->dtype) > e->delta;
        } else if (e->action == TSYS_MEM_EV_FREE) {
            bool found = false;
            for (size_t j = 0; j < i && !found; j++) found = ev[j].action == TSYS_MEM_EV_ALLOC && ev[j].id == e->id && ev[j].delta == -e->delta;
            r->unpaired_frees += !found && e->id >= first;
        } else {
            r->odd_moves += !(i + 1 < n && ev[i + 1].action == TSYS_MEM_EV_MOVE && ev[i + 1].id == e->id && ev[i + 1].delta == -e->delta && e->delta < 0);
            i++;
        }
    }
    tsys_mem_clear_events(ctx);
    tsys_tensor_release(ids);
    tsys_optim_free(opt);
    tsys_model_free(m);
    return tsys_ctx_status(ctx);
}
static inline tsys_status test_mem_step_kept(tsys_ctx *ctx, tsys_device dev, const char *attn, tsys_dtype dt, bool backward, bool optimizer, bool kept, test_mem_result *r) {
    return test_mem_step_ex(ctx, dev, attn, dt, backward, optimizer, kept, false, 512, r);
}
static inline tsys_status test_mem_step(tsys_ctx *ctx, tsys_device dev, const char *attn, tsys_dtype dt, bool backward, bool optimizer, test_mem_result *r) {
    return test_mem_step_kept(ctx, dev, attn, dt, backward, optimizer, false, r);
}

// |measured - predicted| / predicted
static inline double test_rel_diff(int64_t measured, int64_t predicted) { return predicted ? fabs((double)(measured - predicted) / (double)predicted) : 1.0; }

// ---- tsys_optim_sum_grads against its definition ----------------------------------------------------

// Parameters of `sizes` trained two AdamW steps on dev twice: once summing rank `self`'s gradients with the
// other ranks' terms (tsys_optim_sum_grads; slots `pad` bytes longer than the gradients, which parameter i keeps
// in bf16 where bit i of `bf16` is set, in fp32 otherwise, laid out as DDP lays them), once on fp32 gradients the
// host made as that rank-ordered sum / ranks. The values are bf16's, so the bf16 gradients hold them exactly.
// Returns the elements that differ (-1 when a call failed: the context's error says which).
// places: each parameter's byte offset in a slot (tsys_optim_sum_grads_at; -1: no terms, its gradient the mean
// itself), or NULL: packed in order (tsys_optim_sum_grads).
static inline int64_t test_sum_grads_case_at(tsys_ctx *ctx, tsys_device dev, int ranks, int self, const int64_t *sizes, int n, int64_t pad, unsigned bf16, const int64_t *places) {
    enum { MAXP = 4 };
    int64_t S = 0, G = 0, diff = 0, at[MAXP];
    for (int i = 0; i < n; i++) {
        const int64_t bytes = sizes[i] * ((bf16 >> i & 1u) ? 2 : 4);
        at[i] = places ? places[i] : G;
        S += sizes[i];
        G = at[i] + bytes > G ? at[i] + bytes : G;
    }
    const int64_t stride = G + pad, tbytes = (stride * (ranks - 1) + 3) / 4 * 4;
    unsigned char *terms_h = (unsigned char *)calloc((size_t)tbytes, 1);
    float *mean = (float *)malloc(sizeof(float) * (size_t)S), *mine = (float *)malloc(sizeof(float) * (size_t)S);
    tsys_tensor *pa[MAXP], *pb[MAXP], *ca[MAXP], *cb[MAXP];
    for (int i = 0, e = 0; i < n; e += (int)sizes[i], i++)
        for (int64_t k = 0; k < sizes[i]; k++) {   // the host's sum, in rank order
            const int64_t x = e + k;
            mine[x] = tsys_bf16_to_f32(tsys_f32_to_bf16((float)((x * 53 % 997) - 498) * 1e-3f));
            float acc = 0.0f;
            if (at[i] < 0) { mean[x] = mine[x]; continue; }
            for (int r = 0; r < ranks; r++) {
                if (r == self) { acc += mine[x]; continue; }
                const float t = tsys_bf16_to_f32(tsys_f32_to_bf16((float)(((x + 7 * r) * 37 % 1001) - 500) * 1e-3f));
                unsigned char *slot = terms_h + (int64_t)(r - (r > self)) * stride + at[i];
                if (bf16 >> i & 1u) { const uint16_t h = tsys_f32_to_bf16(t); memcpy(slot + 2 * k, &h, 2); }
                else memcpy(slot + 4 * k, &t, 4);
                acc += t;
            }
            mean[x] = acc / (float)ranks;
        }
    int64_t tn = tbytes / 4, e = 0;
    tsys_tensor *terms = tsys_tensor_from_data(ctx, TSYS_F32, dev, 1, &tn, terms_h);
    for (int i = 0; i < n; i++) {
        pa[i] = test_param(ctx, dev, 1, &sizes[i], 1.0f);
        pb[i] = tsys_tensor_new(ctx, TSYS_F32, dev, 1, &sizes[i]);
        if (pa[i] && pb[i]) tsys_tensor_copy_from(ctx, pb[i], pa[i]);
        if (pa[i] && (bf16 >> i & 1u)) tsys_tensor_set_grad_dtype(ctx, pa[i], TSYS_BF16);
        tsys_tensor_set_requires_grad(pb[i], true);
        ca[i] = tsys_tensor_from_data(ctx, TSYS_F32, dev, 1, &sizes[i], mine + e);   // d sum(p * c) / dp = c, exactly
        cb[i] = tsys_tensor_from_data(ctx, TSYS_F32, dev, 1, &sizes[i], mean + e);
        e += sizes[i];
    }
    tsys_optim *oa = tsys_adamw_new(ctx, pa, n, NULL), *ob = tsys_adamw_new(ctx, pb, n, NULL);
    if (oa && terms && places) tsys_optim_sum_grads_at(oa, terms, ranks, self, stride, places);
    else if (oa && terms) tsys_optim_sum_grads(oa, terms, ranks, self, pad ? stride : 0);
    for (int step = 0; step < 2 && tsys_ctx_status(ctx) == TSYS_OK; step++) {
        for (int side = 0; side < 2; side++)
            for (int i = 0; i < n; i++) {
                tsys_tensor *pc = tsys_mul(ctx, side ? pb[i] : pa[i], side ? cb[i] : ca[i]), *l = tsys_sum(ctx, pc);
                tsys_backward(ctx, l);
                tsys_tensor_release(pc); tsys_tensor_release(l);
            }
        tsys_optim_step(oa); tsys_optim_step(ob);
        tsys_optim_zero_grad(oa); tsys_optim_zero_grad(ob);
    }
    for (int i = 0; i < n && tsys_ctx_status(ctx) == TSYS_OK; i++) {
        float *a = test_read(ctx, pa[i]), *b = test_read(ctx, pb[i]);
        for (int64_t k = 0; a && b && k < sizes[i]; k++) diff += memcmp(&a[k], &b[k], 4) != 0;
        free(a); free(b);
    }
    if (tsys_ctx_status(ctx) != TSYS_OK) diff = -1;
    tsys_optim_free(oa); tsys_optim_free(ob);
    for (int i = 0; i < n; i++) { tsys_tensor_release(pa[i]); tsys_tensor_release(pb[i]); tsys_tensor_release(ca[i]); tsys_tensor_release(cb[i]); }
    tsys_tensor_release(terms);
    free(terms_h); free(mean); free(mine);
    return diff;
}
static inline int64_t test_sum_grads_case(tsys_ctx *ctx, tsys_device dev, int ranks, int self, const int64_t *sizes, int n, int64_t pad, unsigned bf16) {
    return test_sum_grads_case_at(ctx, dev, ranks, self, sizes, n, pad, bf16, NULL);
}

// ---- the optimizer told when gradients are in (TSYS_OPTIM_CALLER_READY) ------------------------------

// Four parameters and their gradients back to back in one storage each (a model's, and DDP's arena), trained two AdamW steps
// twice from the same values: once inside backward, told by tsys_optim_overlap_ready (the middle two as of
// the side stream, a run the arena would continue, the first as of the compute stream, one of them told
// twice, the last never: overlap_end updates it), once by tsys_optim_step after backward. terms: both also
// sum a second rank's gradients (tsys_optim_sum_grads). Returns the elements that differ (-1 when a call
// failed: the context's error says which).
static inline int64_t test_caller_ready_case(tsys_ctx *ctx, tsys_device dev, bool terms) {
    enum { NP = 4 };
    const int64_t sizes[NP] = {64, 40, 24, 8};
    int64_t total = 0, diff = 0;
    for (int i = 0; i < NP; i++) total += sizes[i];
    tsys_tensor *p[2][NP], *c[NP], *arena[2], *flat[2], *t = NULL;
    tsys_optim *o[2];
    for (int side = 0; side < 2; side++) {
        arena[side] = tsys_tensor_new(ctx, TSYS_F32, dev, 1, &total);
        flat[side] = tsys_tensor_new(ctx, TSYS_F32, dev, 1, &total);
        if (flat[side] && side == 0) tsys_tensor_randn(ctx, flat[0], 1.0f);
        if (flat[side] && side == 1 && flat[0]) tsys_tensor_copy_from(ctx, flat[1], flat[0]);
        for (int i = 0, at = 0; i < NP; at += (int)sizes[i], i++) {
            p[side][i] = flat[side] ? tsys_tensor_view_raw(ctx, flat[side], (size_t)at * 4, TSYS_F32, 1, &sizes[i]) : NULL;
            tsys_tensor_set_requires_grad(p[side][i], true);
            if (p[side][i] && arena[side]) { p[side][i]->grad = tsys_tensor_view_raw(ctx, arena[side], (size_t)at * 4, TSYS_F32, 1, &sizes[i]); p[side][i]->grad_zero = true; }
        }
        o[side] = tsys_adamw_new(ctx, p[side], NP, NULL);
    }
    for (int i = 0; i < NP; i++) { c[i] = tsys_tensor_new(ctx, TSYS_F32, dev, 1, &sizes[i]); tsys_tensor_randn(ctx, c[i], 1.0f); }
    if (terms) {
        t = tsys_tensor_new(ctx, TSYS_F32, dev, 1, &total);
        tsys_tensor_randn(ctx, t, 1.0f);
        for (int side = 0; side < 2; side++) tsys_optim_sum_grads(o[side], t, 2, side, 0);   // rank 0 and rank 1 of the same two
    }
    for (int step = 0; step < 2 && tsys_ctx_status(ctx) == TSYS_OK; step++)
        for (int side = 0; side < 2; side++) {
            tsys_optim_zero_grad(o[side]);
            if (side == 0) tsys_optim_overlap_begin_ex(o[0], TSYS_OPTIM_CALLER_READY);
            for (int i = 0; i < NP; i++) {
                tsys_tensor *pc = tsys_mul(ctx, p[side][i], c[i]), *l = tsys_sum(ctx, pc);
                tsys_backward(ctx, l);
                tsys_tensor_release(pc); tsys_tensor_release(l);
            }
            if (side == 1) { tsys_optim_step(o[1]); continue; }
            tsys_tensor *middle[2] = {p[0][1], p[0][2]}, *again[2] = {p[0][2], p[0][0]};
            tsys_optim_overlap_ready(o[0], middle, 2, TSYS_STREAM_SIDE);
            tsys_optim_overlap_ready(o[0], again, 2, TSYS_STREAM_COMPUTE);
            tsys_optim_overlap_end(o[0]);
        }
    for (int i = 0; i < NP && tsys_ctx_status(ctx) == TSYS_OK; i++) {
        float *a = test_read(ctx, p[0][i]), *b = test_read(ctx, p[1][i]);
        for (int64_t k = 0; a && b && k < sizes[i]; k++) diff += memcmp(&a[k], &b[k], 4) != 0;
        free(a); free(b);
    }
    if (tsys_ctx_status(ctx) != TSYS_OK) diff = -1;
    for (int side = 0; side < 2; side++) {
        tsys_optim_free(o[side]);
        for (int i = 0; i < NP; i++) tsys_tensor_release(p[side][i]);
        tsys_tensor_release(arena[side]); tsys_tensor_release(flat[side]);
    }
    for (int i = 0; i < NP; i++) tsys_tensor_release(c[i]);
    tsys_tensor_release(t);
    return diff;
}

#endif
