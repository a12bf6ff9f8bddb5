// test_cuda.cu - the CUDA backend against the CPU reference: every kernel (fresh random inputs, CUDA
// outputs poisoned with NaN first, tolerances by dtype), GEMMs, whole-model forward/backward/AdamW,
// the caching allocator (reuse, no growth, OOM as an error), and CUDA graph capture/replay.
//
//   make test-cuda                # build/test_cuda [name-filter]
#define TSYS_IMPLEMENTATION
#include "../tsys.h"
#define TSYS_CUDA_IMPLEMENTATION
#include "../tsys_cuda.cuh"
#include "harness.h"
#include "test_util.h"
#include <stdlib.h>
#include <unistd.h>
#include <sys/stat.h>

// One context with both backends, made on first use (a test binary without a GPU fails each test).
static tsys_ctx *tc_ctx(void) {
    static tsys_ctx *ctx;
    static bool tried;
    if (!tried) {
        tried = true;
        ctx = tsys_ctx_new(NULL);
        if (tsys_cuda_init(ctx, 0) != TSYS_OK) {
            printf("\n    no CUDA backend: %s\n", tsys_ctx_last_error(ctx));
            tsys_ctx_free(ctx);
            ctx = NULL;
        } else {
            printf("\n    device: %s\n", tsys_cuda_device_name(ctx));
        }
    }
    return ctx;
}
#define TC_CTX(ctx) tsys_ctx *ctx = tc_ctx(); TEST_CHECK(ctx != NULL, "no GPU"); if (!ctx) return

static uint64_t tc_rng = 0x1234abcdull;
static float tc_uniform(void) { tc_rng = tc_rng * 6364136223846793005ull + 1442695040888963407ull; return (float)((tc_rng >> 40) * (1.0 / 16777216.0)); }
static float tc_normal(void) { float u1 = tc_uniform() + 1e-7f, u2 = tc_uniform(); return sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2); }

static double tc_tol(tsys_dtype dt) { return dt == TSYS_F32 ? 1e-5 : 1e-2; }

// ---- kernel cases ------------------------------------------------------------------------------
// A case lists the kernel's argument slots: role (input, output, or both), dtype, shape and how to
// fill it. Inputs get the same random values on both devices; outputs start as NaN on CUDA (every
// element must be written); in-out slots start equal on both.

enum { R_NONE, R_IN, R_OUT, R_INOUT };
enum { I_RANDN, I_POS, I_IDS, I_ONE };
typedef struct { int role; tsys_dtype dt; int ndim; int64_t shape[4]; int init; float scale; } tc_arg;
typedef struct { const char *name; tsys_kernel k; tc_arg t[TSYS_KARGS_MAX]; float f[8]; int64_t i[4]; double tol; } tc_case;

static tsys_tensor *tc_make(tsys_ctx *ctx, const tc_arg *a, tsys_device dev, const float *vals) {
    int64_t n = 1;
    for (int d = 0; d < a->ndim; d++) n *= a->shape[d];
    size_t es = tsys_dtype_size(a->dt);
    char *raw = (char *)malloc(es * (size_t)n + 1);
    for (int64_t i = 0; i < n; i++) {
        float v = vals[i];
        switch (a->dt) {
        case TSYS_F32: ((float *)raw)[i] = v; break;
        case TSYS_BF16: ((uint16_t *)raw)[i] = tsys_f32_to_bf16(v); break;
        case TSYS_F16: ((uint16_t *)raw)[i] = tsys_f32_to_f16(v); break;
        case TSYS_I32: ((int32_t *)raw)[i] = (int32_t)v; break;
        default: ((int64_t *)raw)[i] = (int64_t)v; break;
        }
    }
    tsys_tensor *t = tsys_tensor_from_data(ctx, a->dt, dev, a->ndim, a->shape, raw);
    free(raw);
    return t;
}

// A CUDA tensor of N(0, scale^2) values from the context's RNG.
static tsys_tensor *tc_rand(tsys_ctx *ctx, tsys_dtype dt, int ndim, const int64_t *shape, float scale) {
    tsys_tensor *t = tsys_tensor_new(ctx, dt, TSYS_CUDA, ndim, shape);
    if (t) tsys_tensor_randn(ctx, t, scale);
    return t;
}

static void tc_run_case(const tc_case *c) {
    TC_CTX(ctx);
    tsys_kargs kc, kg;
    memset(&kc, 0, sizeof kc); memset(&kg, 0, sizeof kg);
    memcpy(kc.f, c->f, sizeof kc.f); memcpy(kg.f, c->f, sizeof kg.f);
    memcpy(kc.i, c->i, sizeof kc.i); memcpy(kg.i, c->i, sizeof kg.i);
    for (int j = 0; j < TSYS_KARGS_MAX; j++) {
        const tc_arg *a = &c->t[j];
        if (a->role == R_NONE) continue;
        int64_t n = 1;
        for (int d = 0; d < a->ndim; d++) n *= a->shape[d];
        float *v = (float *)malloc(sizeof(float) * (size_t)n);
        float s = a->scale ? a->scale : 1.0f;
        for (int64_t i = 0; i < n; i++)
            v[i] = a->init == I_RANDN ? s * tc_normal() : a->init == I_POS ? 0.5f + s * fabsf(tc_normal())
                 : a->init == I_IDS ? (float)(int64_t)(tc_uniform() * s) : s;   // I_ONE: the constant `scale`
        kc.t[j] = tc_make(ctx, a, TSYS_CPU, v);
        kg.t[j] = tc_make(ctx, a, TSYS_CUDA, v);
        if (a->role == R_OUT) tsys_tensor_fill(ctx, kg.t[j], NAN);
        free(v);
    }
    const tsys_backend *cpu = tsys_ctx_backend(ctx, TSYS_CPU), *gpu = tsys_ctx_backend(ctx, TSYS_CUDA);
    tsys_status sc = cpu->kernel(ctx, c->k, &kc);
    tsys_status sg = gpu->kernel(ctx, c->k, &kg);
    if (sg == TSYS_OK) sg = gpu->sync(ctx);
    TEST_CHECK(sc == TSYS_OK && sg == TSYS_OK, "%s: cpu %d cuda %d: %s", c->name, (int)sc, (int)sg, tsys_ctx_last_error(ctx));
    for (int j = 0; j < TSYS_KARGS_MAX && sc == TSYS_OK && sg == TSYS_OK; j++) {
        const tc_arg *a = &c->t[j];
        if (a->role != R_OUT && a->role != R_INOUT) continue;
        int64_t n = tsys_tensor_numel(kc.t[j]);
        float *ref = test_read(ctx, kc.t[j]), *got = test_read(ctx, kg.t[j]);
        double tol = c->tol ? c->tol : tc_tol(a->dt);
        double err = tsys_test_rel_err(got, ref, n);
        int64_t bad = -1;
        for (int64_t i = 0; i < n && bad < 0; i++) if (isnan(got[i]) != isnan(ref[i])) bad = i;
        TEST_CHECK(err <= tol && bad < 0, "%s: t[%d] (%s, %lld elements): rel err %.3g (tol %.1g)%s", c->name, j, tsys_dtype_name(a->dt),
                   (long long)n, err, tol, bad >= 0 ? ", NaN mismatch (unwritten element?)" : "");
        free(ref); free(got);
    }
    for (int j = 0; j < TSYS_KARGS_MAX; j++) { tsys_tensor_release(kc.t[j]); tsys_tensor_release(kg.t[j]); }
    tsys_ctx_clear_error(ctx);
}

#define A1(role, dt, d0, init, sc) {role, dt, 1, {d0}, init, sc}
#define A2(role, dt, d0, d1, init, sc) {role, dt, 2, {d0, d1}, init, sc}
#define A4(role, dt, d0, d1, d2, d3, init, sc) {role, dt, 4, {d0, d1, d2, d3}, init, sc}

static const tsys_dtype tc_floats[3] = { TSYS_F32, TSYS_BF16, TSYS_F16 };

TSYS_TEST(cuda_elementwise) {
    for (int di = 0; di < 3; di++) {
        tsys_dtype T = tc_floats[di];
        const int64_t n = 4096 + 8, m = 1001;   // m: odd size, not a multiple of the vector width
        tc_case cs[] = {
            { "fill", TSYS_K_FILL, { A1(R_OUT, T, n, I_RANDN, 1) }, { 3.25f } },
            { "cast->f32", TSYS_K_CAST, { A1(R_OUT, TSYS_F32, m, I_RANDN, 1), A1(R_IN, T, m, I_RANDN, 3) } },
            { "cast<-f32", TSYS_K_CAST, { A1(R_OUT, T, n, I_RANDN, 1), A1(R_IN, TSYS_F32, n, I_RANDN, 3) } },
            { "accum f32+=T", TSYS_K_ACCUM, { A1(R_INOUT, TSYS_F32, n, I_RANDN, 1), A1(R_IN, T, n, I_RANDN, 1) }, { 0.5f } },
            { "accum T+=T", TSYS_K_ACCUM, { A1(R_INOUT, T, m, I_RANDN, 1), A1(R_IN, T, m, I_RANDN, 1) }, { -2.0f } },
            { "add", TSYS_K_ADD, { A1(R_OUT, T, n, I_RANDN, 1), A1(R_IN, T, n, I_RANDN, 1), A1(R_IN, T, n, I_RANDN, 1) } },
            { "add mixed", TSYS_K_ADD, { A1(R_OUT, TSYS_F32, m, I_RANDN, 1), A1(R_IN, T, m, I_RANDN, 1), A1(R_IN, TSYS_F32, m, I_RANDN, 1) } },
            { "mul", TSYS_K_MUL, { A1(R_OUT, T, m, I_RANDN, 1), A1(R_IN, T, m, I_RANDN, 1), A1(R_IN, T, m, I_RANDN, 1) } },
            { "scale", TSYS_K_SCALE, { A1(R_OUT, T, n, I_RANDN, 1), A1(R_IN, T, n, I_RANDN, 1) }, { 0.37f } },
            { "scale_by", TSYS_K_SCALE_BY, { A1(R_OUT, T, m, I_RANDN, 1), A1(R_IN, T, m, I_RANDN, 1), A1(R_IN, TSYS_F32, 1, I_RANDN, 1) } },
            { "add_bias", TSYS_K_ADD_BIAS, { A2(R_INOUT, T, 33, 96, I_RANDN, 1), A1(R_IN, T, 96, I_RANDN, 1) } },
            { "bias_grad", TSYS_K_BIAS_GRAD, { A1(R_INOUT, TSYS_F32, 96, I_RANDN, 1), A2(R_IN, T, 333, 96, I_RANDN, 1) } },
            { "relu_fwd", TSYS_K_RELU_FWD, { A1(R_OUT, T, m, I_RANDN, 1), A1(R_IN, T, m, I_RANDN, 1) } },
            { "relu_bwd", TSYS_K_RELU_BWD, { A1(R_OUT, T, n, I_RANDN, 1), A1(R_IN, T, n, I_RANDN, 1), A1(R_IN, T, n, I_RANDN, 1) } },
            { "silu_fwd", TSYS_K_SILU_FWD, { A1(R_OUT, T, n, I_RANDN, 1), A1(R_IN, T, n, I_RANDN, 3) } },
            { "silu_bwd", TSYS_K_SILU_BWD, { A1(R_OUT, T, m, I_RANDN, 1), A1(R_IN, T, m, I_RANDN, 1), A1(R_IN, T, m, I_RANDN, 3) } },
            { "swiglu_fwd", TSYS_K_SWIGLU_FWD, { A1(R_OUT, T, n, I_RANDN, 1), A1(R_IN, T, n, I_RANDN, 3), A1(R_IN, T, n, I_RANDN, 1) } },
            { "swiglu_bwd", TSYS_K_SWIGLU_BWD, { A1(R_OUT, T, n, I_RANDN, 1), A1(R_OUT, T, n, I_RANDN, 1), A1(R_IN, T, n, I_RANDN, 1),
                                                 A1(R_IN, T, n, I_RANDN, 3), A1(R_IN, T, n, I_RANDN, 1) } },
            { "broadcast", TSYS_K_BROADCAST, { A1(R_OUT, T, m, I_RANDN, 1), A1(R_IN, TSYS_F32, 1, I_RANDN, 1) }, { 0.25f } },
            { "sgd", TSYS_K_SGD, { A1(R_INOUT, T, n, I_RANDN, 1), A1(R_IN, T, n, I_RANDN, 1) }, { 0.01f } },
        };
        for (size_t i = 0; i < sizeof cs / sizeof *cs; i++) tc_run_case(&cs[i]);
    }
    tc_case ids = { "cast i64->i32", TSYS_K_CAST, { A1(R_OUT, TSYS_I32, 777, I_IDS, 1), A1(R_IN, TSYS_I64, 777, I_IDS, 100000) } };
    tc_run_case(&ids);
}

// Casts and accumulations between fp32 and bf16 / f16 take four elements a thread where every operand is
// aligned (ew_mix) and one where one is not (ew_any): the same bits either way.
static tsys_tensor *tc_shifted_copy(tsys_ctx *ctx, tsys_tensor *src, tsys_tensor **hold) {   // src's values one element off alignment
    int64_t n = tsys_tensor_numel(src), n1 = n + 1;
    *hold = tsys_tensor_new(ctx, src->dtype, TSYS_CUDA, 1, &n1);
    tsys_tensor *v = *hold ? tsys_tensor_view_raw(ctx, *hold, tsys_dtype_size(src->dtype), src->dtype, 1, &n) : NULL;
    if (v) tsys_tensor_copy_from(ctx, v, src);
    return v;
}
TSYS_TEST(cuda_mixed_dtype_paths_agree) {
    TC_CTX(ctx);
    const int64_t n = 4100;
    for (int di = 1; di < 3; di++) {
        tsys_dtype T = tc_floats[di];
        int differ = 0;
        for (int c = 0; c < 3; c++) {   // cast T -> f32, cast f32 -> T, f32 += T
            tsys_tensor *dst = tsys_tensor_new(ctx, c == 1 ? T : TSYS_F32, TSYS_CUDA, 1, &n), *src = tsys_tensor_new(ctx, c == 1 ? TSYS_F32 : T, TSYS_CUDA, 1, &n);
            tsys_rng_seed(ctx, 70 + c); tsys_tensor_randn(ctx, dst, 1.0f); tsys_tensor_randn(ctx, src, 3.0f);
            tsys_tensor *h0 = NULL, *h1 = NULL, *dst2 = tc_shifted_copy(ctx, dst, &h0), *src2 = tc_shifted_copy(ctx, src, &h1);
            for (int k = 0; k < 2; k++) {
                tsys_tensor *d = k ? dst2 : dst, *s = k ? src2 : src;
                if (c < 2) tsys_tensor_cast_from(ctx, d, s); else tsys_tensor_accumulate(ctx, d, s);
            }
            float *a = test_read(ctx, dst), *b = dst2 ? test_read(ctx, dst2) : NULL;
            differ += !a || !b || memcmp(a, b, sizeof(float) * (size_t)n) != 0;
            free(a); free(b);
            tsys_tensor *all[6] = {dst, src, dst2, src2, h0, h1};
            for (int i = 0; i < 6; i++) tsys_tensor_release(all[i]);
        }
        TEST_CHECK(differ == 0, "%s: %d of 3 mixed casts / accumulations differ between the aligned and the element-wise path", tsys_dtype_name(T), differ);
    }
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
}

// Widths: whole groups of four (the row-in-registers kernels), 102 (the element loops); 1100 rows at
// d 768: the weight gradient's partials fold through colsum's four-rows-in-flight loop, not only its tail.
TSYS_TEST(cuda_norms) {
    const int64_t dims[4] = { 768, 100, 2560, 102 };
    for (int di = 0; di < 3; di++)
        for (int k = 0; k < 4; k++) {
            tsys_dtype T = tc_floats[di];
            int64_t R = k == 0 ? 1100 : 70, D = dims[k];
            tc_case cs[] = {
                { "rmsnorm_fwd", TSYS_K_RMSNORM_FWD, { A2(R_OUT, T, R, D, I_RANDN, 1), A1(R_OUT, TSYS_F32, R, I_RANDN, 1),
                                                       A2(R_IN, T, R, D, I_RANDN, 2), A1(R_IN, TSYS_F32, D, I_RANDN, 1) }, { 1e-5f } },
                { "rmsnorm_bwd", TSYS_K_RMSNORM_BWD, { A2(R_OUT, T, R, D, I_RANDN, 1), A1(R_INOUT, TSYS_F32, D, I_RANDN, 1),
                                                       A2(R_IN, T, R, D, I_RANDN, 1), A2(R_IN, T, R, D, I_RANDN, 1),
                                                       A1(R_IN, TSYS_F32, D, I_RANDN, 1), A1(R_IN, TSYS_F32, R, I_POS, 1) } },
                { "rmsnorm_bwd, dw stored", TSYS_K_RMSNORM_BWD, { A2(R_OUT, T, R, D, I_RANDN, 1), A1(R_INOUT, TSYS_F32, D, I_RANDN, 1),
                                                       A2(R_IN, T, R, D, I_RANDN, 1), A2(R_IN, T, R, D, I_RANDN, 1),
                                                       A1(R_IN, TSYS_F32, D, I_RANDN, 1), A1(R_IN, TSYS_F32, R, I_POS, 1) }, { 0.0f }, { 0, 1 } },
                { "layernorm_fwd", TSYS_K_LAYERNORM_FWD, { A2(R_OUT, T, R, D, I_RANDN, 1), A1(R_OUT, TSYS_F32, R, I_RANDN, 1), A1(R_OUT, TSYS_F32, R, I_RANDN, 1),
                                                           A2(R_IN, T, R, D, I_RANDN, 2), A1(R_IN, TSYS_F32, D, I_RANDN, 1), A1(R_IN, TSYS_F32, D, I_RANDN, 1) }, { 1e-5f } },
                { "layernorm_bwd", TSYS_K_LAYERNORM_BWD, { A2(R_OUT, T, R, D, I_RANDN, 1), A1(R_INOUT, TSYS_F32, D, I_RANDN, 1), A1(R_INOUT, TSYS_F32, D, I_RANDN, 1),
                                                           A2(R_IN, T, R, D, I_RANDN, 1), A2(R_IN, T, R, D, I_RANDN, 1), A1(R_IN, TSYS_F32, D, I_RANDN, 1),
                                                           A1(R_IN, TSYS_F32, R, I_RANDN, 0.1f), A1(R_IN, TSYS_F32, R, I_POS, 1) } },
            };
            for (size_t i = 0; i < sizeof cs / sizeof *cs; i++) tc_run_case(&cs[i]);
        }
    // the norm feeding autocast's matmuls: fp32 x, bf16/f16 y; backward adding dx into a gradient
    // already there (the residual stream's), fp32
    for (int di = 1; di < 3; di++)
        for (int k = 0; k < 4; k++) {
            int64_t R = k == 0 ? 1100 : 70, D = dims[k];
            tc_case cs[] = {
                { "rmsnorm_fwd f32 -> low", TSYS_K_RMSNORM_FWD, { A2(R_OUT, tc_floats[di], R, D, I_RANDN, 1), A1(R_OUT, TSYS_F32, R, I_RANDN, 1),
                                                                  A2(R_IN, TSYS_F32, R, D, I_RANDN, 2), A1(R_IN, TSYS_F32, D, I_RANDN, 1) }, { 1e-5f } },
                { "rmsnorm_fwd x + r", TSYS_K_RMSNORM_FWD, { A2(R_OUT, tc_floats[di], R, D, I_RANDN, 1), A1(R_OUT, TSYS_F32, R, I_RANDN, 1),
                                                             A2(R_IN, TSYS_F32, R, D, I_RANDN, 2), A1(R_IN, TSYS_F32, D, I_RANDN, 1),
                                                             A2(R_IN, tc_floats[di], R, D, I_RANDN, 1), A2(R_OUT, TSYS_F32, R, D, I_RANDN, 1) }, { 1e-5f } },
                { "rmsnorm_bwd dx added", TSYS_K_RMSNORM_BWD, { A2(R_INOUT, TSYS_F32, R, D, I_RANDN, 1), A1(R_INOUT, TSYS_F32, D, I_RANDN, 1),
                                                                A2(R_IN, TSYS_F32, R, D, I_RANDN, 1), A2(R_IN, TSYS_F32, R, D, I_RANDN, 1),
                                                                A1(R_IN, TSYS_F32, D, I_RANDN, 1), A1(R_IN, TSYS_F32, R, I_POS, 1) }, { 0 }, { 1 } },
            };
            for (size_t i = 0; i < sizeof cs / sizeof *cs; i++) tc_run_case(&cs[i]);
        }
}

TSYS_TEST(cuda_rope_softmax) {
    for (int di = 0; di < 3; di++) {
        tsys_dtype T = tc_floats[di];
        tc_case cs[] = {
            { "rope fwd", TSYS_K_ROPE, { A4(R_OUT, T, 2, 3, 256, 64, I_RANDN, 1), A4(R_IN, T, 2, 3, 256, 64, I_RANDN, 1) }, { 10000.0f, 1.0f } },
            { "rope inv", TSYS_K_ROPE, { A4(R_OUT, T, 2, 3, 40, 16, I_RANDN, 1), A4(R_IN, T, 2, 3, 40, 16, I_RANDN, 1) }, { 10000.0f, -1.0f } },
            { "rope to heads", TSYS_K_ROPE, { A4(R_OUT, T, 2, 5, 40, 64, I_RANDN, 1), A4(R_IN, T, 2, 40, 5, 64, I_RANDN, 1) }, { 10000.0f, 1.0f }, { 1 } },
            { "rope from heads inv", TSYS_K_ROPE, { A4(R_OUT, T, 2, 40, 5, 64, I_RANDN, 1), A4(R_IN, T, 2, 5, 40, 64, I_RANDN, 1) }, { 10000.0f, -1.0f }, { 2 } },
            { "rope to heads d80", TSYS_K_ROPE, { A4(R_OUT, T, 2, 6, 24, 80, I_RANDN, 1), A4(R_IN, T, 2, 24, 6, 80, I_RANDN, 1) }, { 10000.0f, 1.0f }, { 1 } },
            { "rope rows, 40 a position (3 chunks of 16)", TSYS_K_ROPE, { A4(R_OUT, T, 5, 8, 12, 32, I_RANDN, 1), A4(R_IN, T, 5, 8, 12, 32, I_RANDN, 1) }, { 10000.0f, -1.0f } },
            { "rope to heads d6", TSYS_K_ROPE, { A4(R_OUT, T, 3, 4, 33, 6, I_RANDN, 1), A4(R_IN, T, 3, 33, 4, 6, I_RANDN, 1) }, { 500.0f, 1.0f }, { 1 } },
            { "softmax", TSYS_K_SOFTMAX_FWD, { A2(R_OUT, T, 37, 300, I_RANDN, 1), A2(R_IN, T, 37, 300, I_RANDN, 3) }, { 0.7f } },
            { "softmax causal", TSYS_K_SOFTMAX_FWD, { A4(R_OUT, T, 2, 3, 64, 64, I_RANDN, 1), A4(R_IN, T, 2, 3, 64, 64, I_RANDN, 3) }, { 0.125f }, { 1 } },
            { "softmax causal 1024", TSYS_K_SOFTMAX_FWD, { A4(R_OUT, T, 1, 1, 1024, 1024, I_RANDN, 1), A4(R_IN, T, 1, 1, 1024, 1024, I_RANDN, 3) }, { 0.125f }, { 1 } },
            { "softmax_bwd", TSYS_K_SOFTMAX_BWD, { A2(R_OUT, T, 64, 200, I_RANDN, 1), A2(R_IN, T, 64, 200, I_RANDN, 1), A2(R_IN, T, 64, 200, I_POS, 0.01f) }, { 0.5f } },
            // rows the register kernels do not take (odd width; wider than 4 packs a thread of 1024) run the plain ones
            { "softmax odd", TSYS_K_SOFTMAX_FWD, { A2(R_OUT, T, 5, 1001, I_RANDN, 1), A2(R_IN, T, 5, 1001, I_RANDN, 3) }, { 0.7f } },
            { "softmax wide", TSYS_K_SOFTMAX_FWD, { A2(R_OUT, T, 3, 40000, I_RANDN, 1), A2(R_IN, T, 3, 40000, I_RANDN, 3) }, { 0.7f } },
            { "softmax causal 2048", TSYS_K_SOFTMAX_FWD, { A4(R_OUT, T, 1, 2, 2048, 2048, I_RANDN, 1), A4(R_IN, T, 1, 2, 2048, 2048, I_RANDN, 3) }, { 0.125f }, { 1 } },
            { "softmax_bwd odd", TSYS_K_SOFTMAX_BWD, { A2(R_OUT, T, 9, 77, I_RANDN, 1), A2(R_IN, T, 9, 77, I_RANDN, 1), A2(R_IN, T, 9, 77, I_POS, 0.01f) }, { 0.5f } },
            { "softmax 32768 (1024 threads a row)", TSYS_K_SOFTMAX_FWD, { A2(R_OUT, T, 2, 32768, I_RANDN, 1), A2(R_IN, T, 2, 32768, I_RANDN, 3) }, { 0.7f } },
            { "softmax_bwd 32768 (1024 threads a row)", TSYS_K_SOFTMAX_BWD, { A2(R_OUT, T, 2, 32768, I_RANDN, 1), A2(R_IN, T, 2, 32768, I_RANDN, 1), A2(R_IN, T, 2, 32768, I_POS, 1e-4f) }, { 0.5f } },
            { "softmax_bwd wide", TSYS_K_SOFTMAX_BWD, { A2(R_OUT, T, 3, 40000, I_RANDN, 1), A2(R_IN, T, 3, 40000, I_RANDN, 1), A2(R_IN, T, 3, 40000, I_POS, 1e-4f) }, { 0.5f } },
        };
        for (size_t i = 0; i < sizeof cs / sizeof *cs; i++) tc_run_case(&cs[i]);
    }
}

TSYS_TEST(cuda_losses) {
    for (int di = 0; di < 3; di++)
        for (int idt = 0; idt < 2; idt++) {
            tsys_dtype T = tc_floats[di], I = idt ? TSYS_I64 : TSYS_I32;
            int64_t R = 300, V = 10000;
            tc_case cs[] = {
                { "ce_fwd", TSYS_K_CE_FWD, { A1(R_OUT, TSYS_F32, 1, I_RANDN, 1), A1(R_OUT, TSYS_F32, R, I_RANDN, 1), A2(R_IN, T, R, V, I_RANDN, 3), A1(R_IN, I, R, I_IDS, (float)V) } },
                { "ce_bwd", TSYS_K_CE_BWD, { A2(R_OUT, T, R, V, I_RANDN, 1), A2(R_IN, T, R, V, I_RANDN, 3), A1(R_IN, TSYS_F32, R, I_POS, 10),
                                             A1(R_IN, I, R, I_IDS, (float)V), A1(R_IN, TSYS_F32, 1, I_POS, 1) }, { 1.0f / 300 } },
                { "ce_bwd f32 grad", TSYS_K_CE_BWD, { A2(R_OUT, TSYS_F32, R, 77, I_RANDN, 1), A2(R_IN, T, R, 77, I_RANDN, 3), A1(R_IN, TSYS_F32, R, I_POS, 3),
                                                      A1(R_IN, I, R, I_IDS, 77.0f), A1(R_IN, TSYS_F32, 1, I_POS, 1) }, { 1.0f / 300 } },
                { "mse_fwd", TSYS_K_MSE_FWD, { A1(R_OUT, TSYS_F32, 1, I_RANDN, 1), A2(R_IN, T, 30, 101, I_RANDN, 1), A2(R_IN, T, 30, 101, I_RANDN, 1) } },
                { "mse_bwd", TSYS_K_MSE_BWD, { A2(R_OUT, T, 30, 101, I_RANDN, 1), A2(R_OUT, T, 30, 101, I_RANDN, 1), A2(R_IN, T, 30, 101, I_RANDN, 1),
                                               A2(R_IN, T, 30, 101, I_RANDN, 1), A1(R_IN, TSYS_F32, 1, I_POS, 1) } },
                { "mse_bwd da only", TSYS_K_MSE_BWD, { A2(R_OUT, T, 30, 101, I_RANDN, 1), {R_NONE}, A2(R_IN, T, 30, 101, I_RANDN, 1),
                                                       A2(R_IN, T, 30, 101, I_RANDN, 1), A1(R_IN, TSYS_F32, 1, I_POS, 1) } },
                { "sum", TSYS_K_SUM, { A1(R_OUT, TSYS_F32, 1, I_RANDN, 1), A2(R_IN, T, 1000, 333, I_RANDN, 1) }, { 0.5f }, {0}, 1e-4 },
                { "sumsq", TSYS_K_SUMSQ, { A1(R_INOUT, TSYS_F32, 1, I_POS, 1), A2(R_IN, T, 1000, 333, I_RANDN, 1) } },
                { "nonfinite (clean)", TSYS_K_NONFINITE, { A1(R_INOUT, TSYS_F32, 1, I_RANDN, 1), A2(R_IN, T, 100, 333, I_RANDN, 1) } },
            };
            for (size_t i = 0; i < sizeof cs / sizeof *cs; i++) tc_run_case(&cs[i]);
        }
}

// tsys_optim_sum_grads on the GPU: the AdamW kernel summing the ranks' gradients (float4 loads with 2 and 3 ranks,
// the element path for a run 4 bytes off 16 and for 4 ranks' slots 3 elements longer than the parameters; bf16
// gradients among fp32 ones, as DDP lays them out; places given, out of order, one parameter without terms, as FSDP's
// copy engines lay them out) gives the bits of the same kernel on the host's sum.
TSYS_TEST(cuda_adamw_sums_ranks_gradients) {
    TC_CTX(ctx);
    const int64_t vec[3] = {1024, 1004, 36}, odd[3] = {1024, 1003, 37};
    const int64_t d2 = test_sum_grads_case(ctx, TSYS_CUDA, 2, 1, vec, 3, 0, 0u), d3 = test_sum_grads_case(ctx, TSYS_CUDA, 3, 1, odd, 3, 32, 0u),
                  d4 = test_sum_grads_case(ctx, TSYS_CUDA, 4, 0, odd, 2, 12, 0u);
    TEST_CHECK(d2 == 0 && d3 == 0 && d4 == 0, "elements apart from AdamW on the host's sum: %lld (2 ranks), %lld (3), %lld (4): %s", (long long)d2, (long long)d3,
               (long long)d4, tsys_ctx_last_error(ctx));
    const int64_t b2 = test_sum_grads_case(ctx, TSYS_CUDA, 2, 0, vec, 3, 0, 3u), b3 = test_sum_grads_case(ctx, TSYS_CUDA, 3, 2, vec, 3, 8, 5u);
    TEST_CHECK(b2 == 0 && b3 == 0, "bf16 gradients among fp32 ones: %lld (2 ranks), %lld (3) elements apart: %s", (long long)b2, (long long)b3, tsys_ctx_last_error(ctx));
    const int64_t rev[3] = {4144, -1, 0}, mix[3] = {-1, 8192, 64};   // places given (tsys_optim_sum_grads_at): FSDP's shards
    const int64_t p2 = test_sum_grads_case_at(ctx, TSYS_CUDA, 2, 1, vec, 3, 0, 0u, rev), p3 = test_sum_grads_case_at(ctx, TSYS_CUDA, 3, 0, vec, 3, 16, 5u, mix);
    TEST_CHECK(p2 == 0 && p3 == 0, "places given: %lld (2 ranks), %lld (3, bf16 among fp32) elements apart: %s", (long long)p2, (long long)p3, tsys_ctx_last_error(ctx));
}

// TSYS_OPTIM_CALLER_READY on the GPU: updates on the background stream after the side or the compute stream's
// work, as the caller says, give the bits of the step after backward (with and without the ranks' terms).
TSYS_TEST(cuda_overlap_ready_updates_what_it_is_told) {
    TC_CTX(ctx);
    const int64_t plain = test_caller_ready_case(ctx, TSYS_CUDA, false), summed = test_caller_ready_case(ctx, TSYS_CUDA, true);
    TEST_CHECK(plain == 0 && summed == 0, "elements apart from the step after backward: %lld, %lld with terms: %s", (long long)plain, (long long)summed, tsys_ctx_last_error(ctx));
}

TSYS_TEST(cuda_embedding_transpose_adamw) {
    for (int di = 0; di < 3; di++)
        for (int idt = 0; idt < 2; idt++) {
            tsys_dtype T = tc_floats[di], I = idt ? TSYS_I64 : TSYS_I32;
            tc_case cs[] = {
                { "embed_fwd", TSYS_K_EMBED_FWD, { A2(R_OUT, T, 500, 96, I_RANDN, 1), A2(R_IN, T, 1000, 96, I_RANDN, 1), A1(R_IN, I, 500, I_IDS, 1000) } },
                // few distinct ids: many repeats per row, the case atomics would make nondeterministic
                { "embed_bwd", TSYS_K_EMBED_BWD, { A2(R_INOUT, TSYS_F32, 50, 96, I_RANDN, 1), A2(R_IN, T, 2048, 96, I_RANDN, 1), A1(R_IN, I, 2048, I_IDS, 50) } },
                { "embed_bwd wide", TSYS_K_EMBED_BWD, { A2(R_INOUT, TSYS_F32, 10000, 72, I_RANDN, 1), A2(R_IN, T, 1024, 72, I_RANDN, 1), A1(R_IN, I, 1024, I_IDS, 10000) } },
                { "transpose12", TSYS_K_TRANSPOSE12, { A4(R_OUT, T, 2, 7, 5, 64, I_RANDN, 1), A4(R_IN, T, 2, 5, 7, 64, I_RANDN, 1) } },
                { "transpose12 odd", TSYS_K_TRANSPOSE12, { A4(R_OUT, T, 3, 4, 2, 5, I_RANDN, 1), A4(R_IN, T, 3, 2, 4, 5, I_RANDN, 1) } },
            };
            for (size_t i = 0; i < sizeof cs / sizeof *cs; i++) tc_run_case(&cs[i]);
        }
    // the step count lives on the device (I64 scalar), here step 3
    tc_case adam = { "adamw", TSYS_K_ADAMW, { A1(R_INOUT, TSYS_F32, 10007, I_RANDN, 1), A1(R_IN, TSYS_F32, 10007, I_RANDN, 1),
                                              A1(R_INOUT, TSYS_F32, 10007, I_RANDN, 0.1f), A1(R_INOUT, TSYS_F32, 10007, I_POS, 0.01f),
                                              A1(R_IN, TSYS_I64, 1, I_IDS, 0) },
                     { 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f } };
    for (int step = 1; step <= 1000; step *= 10) {
        adam.t[4].init = I_ONE; adam.t[4].scale = (float)step;
        tc_run_case(&adam);
    }
    tc_case adam4 = adam;
    adam4.name = "adamw (multiple of 4)";
    adam4.t[0].shape[0] = adam4.t[1].shape[0] = adam4.t[2].shape[0] = adam4.t[3].shape[0] = 4096;
    tc_run_case(&adam4);
    // with the kept low-precision copy t[6] (tsys_optim_keep_lowp): the one-by-one and the vector path
    for (int di = 1; di < 3; di++)
        for (int n4 = 0; n4 < 2; n4++) {
            tc_case al = n4 ? adam4 : adam;
            al.name = n4 ? "adamw + kept copy (multiple of 4)" : "adamw + kept copy";
            al.t[6] = A1(R_OUT, tc_floats[di], al.t[0].shape[0], I_RANDN, 1);
            tc_run_case(&al);
        }
    for (int di = 0; di < 3; di++) {
        tc_case rn = { "randn", TSYS_K_RANDN, { A1(R_OUT, tc_floats[di], 10001, I_RANDN, 1) }, { 0.02f, 0.0f, 0.0f }, { 12345 } };
        tc_run_case(&rn);
        tc_case tn = { "trunc normal", TSYS_K_RANDN, { A1(R_OUT, tc_floats[di], 10001, I_RANDN, 1) }, { 1.0f, -1.0f, 1.5f }, { 777 } };
        tc_run_case(&tn);
    }
    tc_case inc = { "step_inc", TSYS_K_STEP_INC, { A1(R_INOUT, TSYS_I64, 1, I_ONE, 41) } };
    tc_run_case(&inc);
    tc_case incb = { "step_inc + corrections", TSYS_K_STEP_INC, { A1(R_INOUT, TSYS_I64, 1, I_ONE, 41), A1(R_OUT, TSYS_F32, 2, I_RANDN, 1) }, { 0.9f, 0.95f } };
    tc_run_case(&incb);
    tc_case adamb = adam;   // the corrections given (any values: CPU and CUDA read the same ones)
    adamb.name = "adamw, corrections given";
    adamb.t[8] = A1(R_IN, TSYS_F32, 2, I_POS, 0.1f);
    tc_run_case(&adamb);
}

// NONFINITE must notice one inf or nan anywhere; a clean tensor leaves the flag alone.
TSYS_TEST(cuda_nonfinite) {
    TC_CTX(ctx);
    const float specials[2] = { INFINITY, NAN };
    for (int s = 0; s < 2; s++) {
        int64_t n = 100003;
        float *v = (float *)malloc(sizeof(float) * n);
        for (int64_t i = 0; i < n; i++) v[i] = tc_normal();
        v[n - 17] = specials[s];
        tsys_tensor *x = tsys_tensor_from_data(ctx, TSYS_F32, TSYS_CUDA, 1, &n, v);
        int64_t one = 1;
        tsys_tensor *flag = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 1, &one);
        tsys_tensor_fill(ctx, flag, 0.0f);
        tsys_kargs a;
        memset(&a, 0, sizeof a);
        a.t[0] = flag; a.t[1] = x;
        tsys_ctx_backend(ctx, TSYS_CUDA)->kernel(ctx, TSYS_K_NONFINITE, &a);
        TEST_CHECK(tsys_item(ctx, flag) == 1.0f, "nonfinite missed a %s", s ? "nan" : "inf");
        tsys_tensor_release(x); tsys_tensor_release(flag); free(v);
    }
}

// ---- GEMM --------------------------------------------------------------------------------------

static void tc_gemm_case(tsys_ctx *ctx, tsys_dtype ab, tsys_dtype cdt, bool ta, bool tb, int64_t m, int64_t n, int64_t k, int64_t batch,
                         bool bcast_b, float alpha, float beta, double tol) {
    int64_t sa = m * k, sb = bcast_b ? 0 : k * n, sc = m * n;
    int64_t na = sa * batch, nb = bcast_b ? k * n : sb * batch, nc = sc * batch;
    tc_arg aa = A1(R_IN, ab, na, I_RANDN, 1), ba = A1(R_IN, ab, nb, I_RANDN, 1), ca = A1(R_INOUT, cdt, nc, I_RANDN, 1);
    float *va = (float *)malloc(sizeof(float) * na), *vb = (float *)malloc(sizeof(float) * nb), *vc = (float *)malloc(sizeof(float) * nc);
    for (int64_t i = 0; i < na; i++) va[i] = tc_normal();
    for (int64_t i = 0; i < nb; i++) vb[i] = tc_normal();
    for (int64_t i = 0; i < nc; i++) vc[i] = tc_normal();
    tsys_tensor *A[2], *B[2], *C[2];
    for (int d = 0; d < 2; d++) {
        A[d] = tc_make(ctx, &aa, (tsys_device)d, va); B[d] = tc_make(ctx, &ba, (tsys_device)d, vb); C[d] = tc_make(ctx, &ca, (tsys_device)d, vc);
    }
    if (beta == 0.0f) tsys_tensor_fill(ctx, C[1], NAN);   // beta 0 must not read C
    tsys_status s[2];
    for (int d = 0; d < 2; d++) {
        tsys_gemm_args g;
        memset(&g, 0, sizeof g);
        g.a = A[d]; g.b = B[d]; g.c = C[d]; g.trans_a = ta; g.trans_b = tb;
        g.m = m; g.n = n; g.k = k; g.batch = batch; g.stride_a = sa; g.stride_b = sb; g.stride_c = sc;
        g.alpha = alpha; g.beta = beta;
        s[d] = tsys_ctx_backend(ctx, (tsys_device)d)->gemm(ctx, &g);
    }
    TEST_CHECK(s[0] == TSYS_OK && s[1] == TSYS_OK, "gemm %s->%s: %s", tsys_dtype_name(ab), tsys_dtype_name(cdt), tsys_ctx_last_error(ctx));
    if (s[0] == TSYS_OK && s[1] == TSYS_OK) {
        float *ref = test_read(ctx, C[0]), *got = test_read(ctx, C[1]);
        double err = tsys_test_rel_err(got, ref, nc);
        TEST_CHECK(err <= tol, "gemm %s x %s -> %s ta=%d tb=%d m=%lld n=%lld k=%lld batch=%lld bcast=%d beta=%g: rel err %.3g (tol %.1g)",
                   tsys_dtype_name(ab), tsys_dtype_name(ab), tsys_dtype_name(cdt), ta, tb, (long long)m, (long long)n, (long long)k,
                   (long long)batch, bcast_b, beta, err, tol);
        free(ref); free(got);
    }
    for (int d = 0; d < 2; d++) { tsys_tensor_release(A[d]); tsys_tensor_release(B[d]); tsys_tensor_release(C[d]); }
    free(va); free(vb); free(vc);
    tsys_ctx_clear_error(ctx);
}

TSYS_TEST(cuda_gemm) {
    TC_CTX(ctx);
    for (int di = 0; di < 3; di++)
        for (int t = 0; t < 4; t++) {
            tsys_dtype ab = tc_floats[di];
            bool ta = t & 1, tb = t & 2;
            tc_gemm_case(ctx, ab, TSYS_F32, ta, tb, 67, 45, 129, 1, false, 1.0f, 0.0f, 1e-5);
            tc_gemm_case(ctx, ab, ab, ta, tb, 64, 96, 128, 3, false, 0.5f, 0.0f, tc_tol(ab));
            tc_gemm_case(ctx, ab, TSYS_F32, ta, tb, 33, 17, 65, 4, true, 1.0f, 1.0f, 1e-5);   // B broadcast, accumulate
            tc_gemm_case(ctx, ab, ab, ta, tb, 8, 8, 8, 2, false, 1.0f, 1.0f, tc_tol(ab));
        }
    tc_gemm_case(ctx, TSYS_F32, TSYS_F32, false, true, 512, 768, 768, 1, false, 1.0f, 0.0f, 1e-5);
    tsys_cuda_set_tf32(ctx, true);
    tc_gemm_case(ctx, TSYS_F32, TSYS_F32, false, true, 512, 768, 768, 1, false, 1.0f, 0.0f, 1e-3);
    tsys_cuda_set_tf32(ctx, false);
}

// tsys_linears on the GPU against separate tsys_linear calls at the CS336 small model's shapes (1024 rows):
// the same bits forward and backward while its products run batched (each item with the algorithm it gets
// alone: gemm as_items); q, k, v back to back, w1, w3 two blocks apart; bf16 and fp32.
static void tc_lin_kernel(tsys_ctx *, const tsys_trace_kernel *k, void *user) { if (k->gemm && k->gemm->batch > 1) ++*(int *)user; }
static void tc_linears_case(tsys_ctx *ctx, tsys_dtype dt, int n, int64_t d_out, int stride, int want_batched) {
    const int64_t K = 768, blocks = (n - 1) * stride + 1;
    int64_t sx[3] = {4, 256, K}, sb[3] = {blocks, d_out, K}, sw[2] = {d_out, K}, sy[3] = {4, 256, d_out};
    const size_t bytes = (size_t)(d_out * K) * tsys_dtype_size(dt);
    tsys_tensor *x = tsys_tensor_new(ctx, dt, TSYS_CUDA, 3, sx), *block = tsys_tensor_new(ctx, dt, TSYS_CUDA, 3, sb), *w[3], *r[3];
    tsys_tensor_randn(ctx, x, 1.0f);
    tsys_tensor_randn(ctx, block, 0.02f);
    tsys_tensor_set_requires_grad(x, true);
    for (int i = 0; i < n; i++) {
        w[i] = tsys_tensor_view_raw(ctx, block, (size_t)(i * stride) * bytes, dt, 2, sw);
        tsys_tensor_set_requires_grad(w[i], true);
        r[i] = tsys_tensor_new(ctx, dt, TSYS_CUDA, 3, sy);
        tsys_tensor_randn(ctx, r[i], 1.0f);
    }
    float *got[2][5] = {{NULL}};
    for (int grouped = 0; grouped < 2; grouped++) {
        tsys_tensor *gblock = tsys_tensor_new(ctx, dt, TSYS_CUDA, 3, sb);
        tsys_tensor_fill(ctx, gblock, 0.0f);
        for (int i = 0; i < n; i++) { tsys_tensor_release(w[i]->grad); w[i]->grad = tsys_tensor_view_raw(ctx, gblock, (size_t)(i * stride) * bytes, dt, 2, sw); }
        tsys_tensor_release(gblock);
        tsys_tensor_release(x->grad); x->grad = NULL;
        int batched = 0;
        tsys_trace_hooks h;
        memset(&h, 0, sizeof h);
        h.kernel = tc_lin_kernel; h.user = &batched;
        tsys_ctx_set_trace_hooks(ctx, &h);
        tsys_tensor *out[3] = {NULL, NULL, NULL}, *loss = NULL;
        if (grouped) tsys_linears(ctx, x, n, w, out);
        else for (int i = 0; i < n; i++) out[i] = tsys_linear(ctx, x, w[i], NULL);
        for (int i = 0; i < n; i++) {
            tsys_tensor *p = tsys_mul(ctx, out[i], r[i]), *s = tsys_sum(ctx, p), *l = loss ? tsys_add(ctx, loss, s) : tsys_tensor_retain(s);
            tsys_tensor_release(p); tsys_tensor_release(s); tsys_tensor_release(loss);
            loss = l;
        }
        tsys_tensor *lf = tsys_cast(ctx, loss, TSYS_F32);
        TEST_CHECK(tsys_backward(ctx, lf) == TSYS_OK, "%s n %d: %s", tsys_dtype_name(dt), n, tsys_ctx_last_error(ctx));
        tsys_ctx_set_trace_hooks(ctx, NULL);
        got[grouped][0] = test_read(ctx, out[0]);
        got[grouped][1] = test_read(ctx, x->grad);
        for (int i = 0; i < n; i++) got[grouped][2 + i] = test_read(ctx, w[i]->grad);
        for (int i = 0; i < n; i++) tsys_tensor_release(out[i]);
        tsys_tensor_release(loss); tsys_tensor_release(lf);
        tsys_tape_clear(ctx);
        TEST_CHECK(batched == (grouped ? want_batched : 0), "%s n %d: %d batched GEMMs, expected %d", tsys_dtype_name(dt), n, batched, grouped ? want_batched : 0);
    }
    const char *what[5] = {"the first output", "dX", "dW 0", "dW 1", "dW 2"};
    for (int j = 0; j < 2 + n; j++) {
        size_t count = j == 0 ? 1024 * (size_t)d_out : j == 1 ? 1024 * (size_t)K : (size_t)(d_out * K);
        TEST_CHECK(got[0][j] && got[1][j] && memcmp(got[0][j], got[1][j], count * sizeof(float)) == 0, "%s n %d (%lld x %lld): %s differs from separate linears'",
                   tsys_dtype_name(dt), n, (long long)d_out, (long long)K, what[j]);
        free(got[0][j]); free(got[1][j]);
    }
    for (int i = 0; i < n; i++) { tsys_tensor_release(w[i]->grad); w[i]->grad = NULL; tsys_tensor_release(w[i]); tsys_tensor_release(r[i]); }
    tsys_tensor_release(x); tsys_tensor_release(block);
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
}
TSYS_TEST(cuda_linears_bits_as_separate) {
    TC_CTX(ctx);
    for (tsys_dtype dt : {TSYS_BF16, TSYS_F32}) {
        tc_linears_case(ctx, dt, 3, 768, 1, 3);    // q, k, v: forward, dX, dW
        tc_linears_case(ctx, dt, 2, 3072, 2, 2);   // w1, w3: forward, dX (their gradients lie apart)
    }
}

// ---- the whole model ----------------------------------------------------------------------------

static tsys_model_desc tc_model_desc(void) {
    tsys_model_desc d;
    memset(&d, 0, sizeof d);
    d.vocab_size = 211; d.context_length = 32; d.d_model = 64; d.num_layers = 2; d.num_heads = 4; d.d_ff = 160;
    return tsys_model_desc_defaults(&d);
}

static tsys_model *tc_model_copy(tsys_ctx *ctx, tsys_model *src, tsys_device dev) {
    tsys_model_desc d = *tsys_model_get_desc(src);
    tsys_model *m = tsys_model_new(ctx, &d, dev, 99);
    if (!m) return NULL;
    tsys_tensor **ps = tsys_model_params(src), **pd = tsys_model_params(m);
    for (int i = 0; i < tsys_model_num_tensors(m); i++) tsys_tensor_copy_from(ctx, pd[i], ps[i]);
    return m;
}

static tsys_tensor *tc_ids(tsys_ctx *ctx, tsys_device dev, int64_t B, int64_t T, int64_t V, uint64_t seed) {
    int64_t shape[2] = { B, T };
    int32_t *v = (int32_t *)malloc(sizeof(int32_t) * B * T);
    uint64_t r = seed;
    for (int64_t i = 0; i < B * T; i++) { r = r * 6364136223846793005ull + 1442695040888963407ull; v[i] = (int32_t)((r >> 33) % (uint64_t)V); }
    tsys_tensor *t = tsys_tensor_from_data(ctx, TSYS_I32, dev, 2, shape, v);
    free(v);
    return t;
}

static double tc_compare(tsys_ctx *ctx, const tsys_tensor *got, const tsys_tensor *ref) {
    int64_t n = tsys_tensor_numel(ref);
    float *g = test_read(ctx, got), *r = test_read(ctx, ref);
    double e = (g && r) ? tsys_test_rel_err(g, r, n) : INFINITY;
    free(g); free(r);
    return e;
}

// Forward, loss, every gradient, and the parameters after two AdamW steps: CUDA against CPU.
static void tc_model_check(tsys_dtype autocast, double tol_logits, double tol_grad, double tol_param) {
    TC_CTX(ctx);
    tsys_model_desc d = tc_model_desc();
    tsys_model *mc = tsys_model_new(ctx, &d, TSYS_CPU, 7);
    tsys_model *mg = mc ? tc_model_copy(ctx, mc, TSYS_CUDA) : NULL;
    TEST_CHECK(mc && mg, "model creation: %s", tsys_ctx_last_error(ctx));
    if (!mc || !mg) return;
    int n = tsys_model_num_tensors(mc);
    tsys_optim *oc = tsys_adamw_new(ctx, tsys_model_params(mc), n, NULL), *og = tsys_adamw_new(ctx, tsys_model_params(mg), n, NULL);
    for (int step = 0; step < 2; step++) {
        tsys_tensor *ids[2], *tg[2], *logits[2], *loss[2];
        for (int dv = 0; dv < 2; dv++) {
            tsys_model *m = dv ? mg : mc;
            ids[dv] = tc_ids(ctx, (tsys_device)dv, 2, 32, d.vocab_size, 11 + step);
            tg[dv] = tc_ids(ctx, (tsys_device)dv, 2, 32, d.vocab_size, 23 + step);
            if (autocast != TSYS_F32) tsys_autocast_begin(ctx, autocast);
            logits[dv] = tsys_model_forward(m, ids[dv]);
            loss[dv] = tsys_cross_entropy(ctx, logits[dv], tg[dv]);
            if (autocast != TSYS_F32) tsys_autocast_end(ctx);
            tsys_backward(ctx, loss[dv]);
        }
        TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "step %d: %s", step, tsys_ctx_last_error(ctx));
        if (tsys_ctx_status(ctx) != TSYS_OK) break;
        double el = tc_compare(ctx, logits[1], logits[0]);
        float lc = tsys_item(ctx, loss[0]), lg = tsys_item(ctx, loss[1]);
        TEST_CHECK(el <= tol_logits, "step %d: logits rel err %.3g (tol %.1g)", step, el, tol_logits);
        TEST_CHECK(fabsf(lc - lg) <= tol_logits * fabsf(lc) + 1e-6f, "step %d: loss cpu %.7f cuda %.7f", step, lc, lg);
        tsys_tensor **pc = tsys_model_params(mc), **pg = tsys_model_params(mg);
        for (int i = 0; i < n; i++) {
            double e = tc_compare(ctx, pg[i]->grad, pc[i]->grad);
            TEST_CHECK(e <= tol_grad, "step %d: grad of %s rel err %.3g (tol %.1g)", step, pc[i]->name, e, tol_grad);
        }
        tsys_optim_step(oc); tsys_optim_step(og);
        tsys_optim_zero_grad(oc); tsys_optim_zero_grad(og);
        for (int i = 0; i < n; i++) {
            double e = tc_compare(ctx, pg[i], pc[i]);
            TEST_CHECK(e <= tol_param, "step %d: %s after AdamW rel err %.3g (tol %.1g)", step, pc[i]->name, e, tol_param);
        }
        for (int dv = 0; dv < 2; dv++) { tsys_tensor_release(ids[dv]); tsys_tensor_release(tg[dv]); tsys_tensor_release(logits[dv]); tsys_tensor_release(loss[dv]); }
    }
    tsys_optim_free(oc); tsys_optim_free(og);
    tsys_model_free(mc); tsys_model_free(mg);
    tsys_ctx_clear_error(ctx);
}

// Parameters after AdamW get 1e-4: Adam's first steps move every element by ~lr * sign(g), so an
// element whose gradient is ~0 can flip on rounding noise (the AdamW kernel alone matches to 1e-5).
TSYS_TEST(cuda_model_fp32) { tc_model_check(TSYS_F32, 1e-5, 1e-4, 1e-4); }
TSYS_TEST(cuda_model_bf16_autocast) { tc_model_check(TSYS_BF16, 2e-2, 5e-2, 1e-3); }
TSYS_TEST(cuda_model_fp16_autocast) { tc_model_check(TSYS_F16, 1e-2, 3e-2, 1e-3); }

// ---- allocator ---------------------------------------------------------------------------------

TSYS_TEST(cuda_alloc_reuse) {
    TC_CTX(ctx);
    const tsys_backend *b = tsys_ctx_backend(ctx, TSYS_CUDA);
    const size_t sizes[5] = { 4, 1000, 513, (size_t)3 << 20, (size_t)64 << 20 };
    void *p[5], *q[5];
    for (int i = 0; i < 5; i++) p[i] = b->alloc(ctx, sizes[i]);
    for (int i = 4; i >= 0; i--) b->free(ctx, p[i], sizes[i]);
    tsys_cuda_mem_info before = tsys_cuda_mem_info_get(ctx);
    for (int i = 0; i < 5; i++) q[i] = b->alloc(ctx, sizes[i]);
    tsys_cuda_mem_info after = tsys_cuda_mem_info_get(ctx);
    for (int i = 0; i < 5; i++) TEST_CHECK(p[i] && p[i] == q[i], "size %zu: block not reused (%p then %p)", sizes[i], p[i], q[i]);
    TEST_CHECK(after.num_device_mallocs == before.num_device_mallocs, "cudaMalloc called %lld times on reuse",
               (long long)(after.num_device_mallocs - before.num_device_mallocs));
    TEST_CHECK(after.allocated_bytes >= before.allocated_bytes + ((size_t)67 << 20), "allocated bytes not counted");
    for (int i = 0; i < 5; i++) b->free(ctx, q[i], sizes[i]);
    TEST_CHECK(tsys_cuda_empty_cache(ctx) == TSYS_OK, "empty_cache: %s", tsys_ctx_last_error(ctx));
    TEST_CHECK(tsys_cuda_mem_reserved(ctx) <= before.reserved_bytes - ((size_t)67 << 20), "empty_cache kept the free blocks");
}

TSYS_TEST(cuda_alloc_oom) {
    TC_CTX(ctx);
    int64_t huge[2] = { (int64_t)1 << 24, (int64_t)1 << 22 };   // 256 TiB of fp32
    tsys_tensor *t = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 2, huge);
    TEST_CHECK(t == NULL && tsys_ctx_status(ctx) == TSYS_ERR_OOM, "absurd request: tensor %p, status %d", (void *)t, (int)tsys_ctx_status(ctx));
    tsys_ctx_clear_error(ctx);
    // a memory cap makes an ordinary request fail too, and lifting it makes it work again
    tsys_cuda_set_memory_limit(ctx, tsys_cuda_mem_reserved(ctx) + ((size_t)8 << 20));
    int64_t big = (int64_t)64 << 20;
    t = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 1, &big);
    TEST_CHECK(t == NULL && tsys_ctx_status(ctx) == TSYS_ERR_OOM, "capped request: tensor %p, status %d", (void *)t, (int)tsys_ctx_status(ctx));
    tsys_ctx_clear_error(ctx);
    tsys_cuda_set_memory_limit(ctx, 0);
    t = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 1, &big);
    TEST_CHECK(t != NULL, "after lifting the cap: %s", tsys_ctx_last_error(ctx));
    // the failed cudaMalloc must not poison later launches
    if (t) TEST_CHECK(tsys_tensor_fill(ctx, t, 1.0f) == TSYS_OK && tsys_sync(ctx, TSYS_CUDA) == TSYS_OK, "launch after OOM: %s", tsys_ctx_last_error(ctx));
    tsys_tensor_release(t);
    tsys_ctx_clear_error(ctx);
}

// One training step of the small model; returns the loss (host copy).
// One AdamW step; release: give the model's gradients back after it (torch's set_to_none) instead
// of marking them zero.
static float tc_train_step_ex(tsys_ctx *ctx, tsys_model *m, tsys_optim *o, tsys_tensor *ids, tsys_tensor *tg, tsys_tensor **loss_out, bool release) {
    tsys_tensor *logits = tsys_model_forward(m, ids);
    tsys_tensor *loss = tsys_cross_entropy(ctx, logits, tg);
    tsys_backward(ctx, loss);
    tsys_optim_step(o);
    if (release) tsys_optim_release_grads(o);
    else tsys_optim_zero_grad(o);
    tsys_tensor_release(logits);
    if (loss_out) { *loss_out = loss; return 0.0f; }
    float l = tsys_item(ctx, loss);
    tsys_tensor_release(loss);
    return l;
}
static float tc_train_step(tsys_ctx *ctx, tsys_model *m, tsys_optim *o, tsys_tensor *ids, tsys_tensor *tg, tsys_tensor **loss_out) {
    return tc_train_step_ex(ctx, m, o, ids, tg, loss_out, false);
}

TSYS_TEST(cuda_alloc_steady_state) {
    TC_CTX(ctx);
    tsys_model_desc d = tc_model_desc();
    tsys_model *m = tsys_model_new(ctx, &d, TSYS_CUDA, 5);
    tsys_optim *o = m ? tsys_adamw_new(ctx, tsys_model_params(m), tsys_model_num_tensors(m), NULL) : NULL;
    tsys_tensor *ids = tc_ids(ctx, TSYS_CUDA, 2, 32, d.vocab_size, 1), *tg = tc_ids(ctx, TSYS_CUDA, 2, 32, d.vocab_size, 2);
    TEST_CHECK(m && o && ids && tg, "setup: %s", tsys_ctx_last_error(ctx));
    if (!m || !o) return;
    for (int i = 0; i < 2; i++) tc_train_step(ctx, m, o, ids, tg, NULL);   // warmup: optimizer state, plans, cache
    tsys_cuda_mem_info a = tsys_cuda_mem_info_get(ctx);
    for (int i = 0; i < 5; i++) tc_train_step(ctx, m, o, ids, tg, NULL);
    tsys_cuda_mem_info b = tsys_cuda_mem_info_get(ctx);
    TEST_CHECK(b.num_device_mallocs == a.num_device_mallocs, "steady state called cudaMalloc %lld times", (long long)(b.num_device_mallocs - a.num_device_mallocs));
    TEST_CHECK(b.reserved_bytes == a.reserved_bytes, "reserved grew from %zu to %zu", a.reserved_bytes, b.reserved_bytes);
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    printf("(%lld allocs/step, %.1f MiB reserved) ", (long long)((b.num_allocs - a.num_allocs) / 5), b.reserved_bytes / 1048576.0);
    tsys_tensor_release(ids); tsys_tensor_release(tg);
    tsys_optim_free(o); tsys_model_free(m);
    tsys_ctx_clear_error(ctx);
}

// ---- CUDA graphs -------------------------------------------------------------------------------

// A kernel-level chain (rmsnorm -> gemm -> cross-entropy fwd+bwd) captured once and replayed twice
// must give exactly the eager results, including the loss read back from its device scalar.
TSYS_TEST(cuda_graph_kernels) {
    TC_CTX(ctx);
    const tsys_backend *b = tsys_ctx_backend(ctx, TSYS_CUDA);
    int64_t R = 128, D = 256, V = 1000;
    tc_arg ax = A2(R_IN, TSYS_F32, R, D, I_RANDN, 1), aw = A2(R_IN, TSYS_F32, V, D, I_RANDN, 0.05f), ag = A1(R_IN, TSYS_F32, D, I_POS, 1);
    float *vx = (float *)malloc(sizeof(float) * R * D), *vw = (float *)malloc(sizeof(float) * V * D), *vg = (float *)malloc(sizeof(float) * D);
    for (int64_t i = 0; i < R * D; i++) vx[i] = tc_normal();
    for (int64_t i = 0; i < V * D; i++) vw[i] = 0.05f * tc_normal();
    for (int64_t i = 0; i < D; i++) vg[i] = 1.0f + 0.1f * tc_normal();
    tsys_tensor *x = tc_make(ctx, &ax, TSYS_CUDA, vx), *w = tc_make(ctx, &aw, TSYS_CUDA, vw), *g = tc_make(ctx, &ag, TSYS_CUDA, vg);
    tsys_tensor *tg = tc_ids(ctx, TSYS_CUDA, 1, R, V, 3);
    int64_t one = 1, rv[2] = { R, V }, rd[2] = { R, D };
    tsys_tensor *dloss = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 1, &one);
    tsys_tensor_fill(ctx, dloss, 1.0f);
    float loss_eager = 0, loss_graph[2] = { 0, 0 };
    float *dl_eager = (float *)malloc(sizeof(float) * R * V), *dl_graph = (float *)malloc(sizeof(float) * R * V);
    tsys_tensor *keep_loss = NULL, *keep_dl = NULL;
    for (int mode = 0; mode < 2; mode++) {
        tsys_cuda_graph *graph = NULL;
        if (mode == 1) TEST_CHECK(tsys_cuda_graph_begin(ctx) == TSYS_OK, "begin: %s", tsys_ctx_last_error(ctx));
        // everything below allocates inside the capture: the graph's private pool
        tsys_tensor *y = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 2, rd), *rstd = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 1, &R);
        tsys_tensor *logits = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 2, rv), *lse = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 1, &R);
        tsys_tensor *loss = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 1, &one), *dl = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 2, rv);
        tsys_kargs a;
        memset(&a, 0, sizeof a); a.t[0] = y; a.t[1] = rstd; a.t[2] = x; a.t[3] = g; a.f[0] = 1e-5f;
        b->kernel(ctx, TSYS_K_RMSNORM_FWD, &a);
        tsys_gemm_args ga;
        memset(&ga, 0, sizeof ga);
        ga.a = y; ga.b = w; ga.c = logits; ga.trans_b = true; ga.m = R; ga.n = V; ga.k = D; ga.batch = 1; ga.alpha = 1; ga.beta = 0;
        b->gemm(ctx, &ga);
        memset(&a, 0, sizeof a); a.t[0] = loss; a.t[1] = lse; a.t[2] = logits; a.t[3] = tg;
        b->kernel(ctx, TSYS_K_CE_FWD, &a);
        memset(&a, 0, sizeof a); a.t[0] = dl; a.t[1] = logits; a.t[2] = lse; a.t[3] = tg; a.t[4] = dloss; a.f[0] = 1.0f / R;
        b->kernel(ctx, TSYS_K_CE_BWD, &a);
        tsys_tensor_release(y); tsys_tensor_release(rstd); tsys_tensor_release(logits); tsys_tensor_release(lse);
        if (mode == 0) {
            loss_eager = tsys_item(ctx, loss);
            tsys_tensor_to_f32(ctx, dl, dl_eager);
            tsys_tensor_release(loss); tsys_tensor_release(dl);
        } else {
            TEST_CHECK(tsys_cuda_graph_end(ctx, &graph) == TSYS_OK && graph, "end: %s", tsys_ctx_last_error(ctx));
            keep_loss = loss; keep_dl = dl;
            for (int r = 0; r < 2 && graph; r++) {
                tsys_tensor_fill(ctx, keep_loss, NAN);   // replay must rewrite it
                TEST_CHECK(tsys_cuda_graph_replay(ctx, graph) == TSYS_OK, "replay: %s", tsys_ctx_last_error(ctx));
                // an eager allocation between replays must not alias the graph's temporaries
                tsys_tensor *other = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 2, rv);
                tsys_tensor_fill(ctx, other, 123.0f);
                tsys_tensor_release(other);
                loss_graph[r] = tsys_item(ctx, keep_loss);
            }
            tsys_tensor_to_f32(ctx, keep_dl, dl_graph);
            tsys_tensor_release(keep_loss); tsys_tensor_release(keep_dl);
            tsys_cuda_graph_free(graph);
        }
    }
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    TEST_CHECK(loss_graph[0] == loss_eager && loss_graph[1] == loss_eager, "loss eager %.8f, replays %.8f %.8f", loss_eager, loss_graph[0], loss_graph[1]);
    TEST_CHECK(memcmp(dl_eager, dl_graph, sizeof(float) * R * V) == 0, "dlogits of the replay differ from eager");
    tsys_tensor_release(x); tsys_tensor_release(w); tsys_tensor_release(g); tsys_tensor_release(tg); tsys_tensor_release(dloss);
    free(vx); free(vw); free(vg); free(dl_eager); free(dl_graph);
    tsys_ctx_clear_error(ctx);
}

// A whole training step (forward, loss, backward, AdamW, zero_grad) captured after one eager warmup
// step and replayed 5 times: the losses must equal those of eager steps on a copy of the model
// (AdamW reads its step count on the device, so replays apply the right bias corrections).
TSYS_TEST(cuda_graph_train_step) {
    TC_CTX(ctx);
    tsys_model_desc d = tc_model_desc();
    tsys_model *me = tsys_model_new(ctx, &d, TSYS_CUDA, 5);
    tsys_model *mg = me ? tc_model_copy(ctx, me, TSYS_CUDA) : NULL;
    TEST_CHECK(me && mg, "setup: %s", tsys_ctx_last_error(ctx));
    if (!me || !mg) return;
    int n = tsys_model_num_tensors(me);
    tsys_optim_desc od;
    memset(&od, 0, sizeof(od));
    od.lr = 1e-3f;
    tsys_optim *oe = tsys_adamw_new(ctx, tsys_model_params(me), n, &od), *og = tsys_adamw_new(ctx, tsys_model_params(mg), n, &od);
    tsys_tensor *ids = tc_ids(ctx, TSYS_CUDA, 2, 32, d.vocab_size, 1), *tg = tc_ids(ctx, TSYS_CUDA, 2, 32, d.vocab_size, 2);
    float eager[6], graph[6];
    for (int i = 0; i < 6; i++) eager[i] = tc_train_step(ctx, me, oe, ids, tg, NULL);
    // the captured model gives its gradients back each step: they are made and freed inside the graph
    graph[0] = tc_train_step_ex(ctx, mg, og, ids, tg, NULL, true);
    tsys_tensor *loss = NULL;
    tsys_cuda_graph *gr = NULL;
    TEST_CHECK(tsys_cuda_graph_begin(ctx) == TSYS_OK, "begin: %s", tsys_ctx_last_error(ctx));
    tc_train_step_ex(ctx, mg, og, ids, tg, &loss, true);
    tsys_status s = tsys_cuda_graph_end(ctx, &gr);
    TEST_CHECK(s == TSYS_OK && gr && loss, "capture of a training step: %s", tsys_ctx_last_error(ctx));
    for (int i = 1; i < 6 && gr && loss; i++) {
        tsys_cuda_graph_replay(ctx, gr);
        graph[i] = tsys_item(ctx, loss);
    }
    if (gr && loss)
        for (int i = 0; i < 6; i++) TEST_CHECK(graph[i] == eager[i], "step %d: eager loss %.8f, graph %.8f", i, eager[i], graph[i]);
    tsys_cuda_graph_free(gr);
    tsys_tensor_release(loss); tsys_tensor_release(ids); tsys_tensor_release(tg);
    tsys_optim_free(oe); tsys_optim_free(og);
    tsys_model_free(me); tsys_model_free(mg);
    tsys_ctx_clear_error(ctx);
}

// ---- AdamW's scalars --------------------------------------------------------------------------------

// An ill-conditioned toy (4096 weights, gradients of scales 1e-3 to 1e3, lr 0.1, wd 0.01, 10 steps) on
// CUDA against the CPU AdamW: within the CPU's own distance to torch.optim.AdamW on the same toy
// (2.98e-7 at most, measured with torch 2.15 on the CPU). Bias corrections in fp32 (powf) put the CUDA
// weights ~1e-6 away: 1 - 0.999^t cancels, and powf's last bit becomes a 1e-4 relative error.
static float tc_toy_p0(int i) { return 0.5f * sinf((float)i); }
static float tc_toy_g(int t, int i) { return cosf(0.37f * (float)i + (float)t) * powf(10.0f, (float)(i % 7 - 3)); }
static void tc_toy_adamw(tsys_ctx *ctx, tsys_device dev, float *out) {
    int64_t n = 4096;
    float *h = (float *)malloc(sizeof(float) * (size_t)n);
    for (int i = 0; i < n; i++) h[i] = tc_toy_p0(i);
    tsys_tensor *p = tsys_tensor_from_data(ctx, TSYS_F32, dev, 1, &n, h);
    tsys_optim_desc od;
    memset(&od, 0, sizeof od);
    od.lr = 0.1f; od.beta1 = 0.9f; od.beta2 = 0.999f; od.eps = 1e-8f; od.weight_decay = 0.01f;
    tsys_optim *o = tsys_adamw_new(ctx, &p, 1, &od);
    for (int t = 0; t < 10 && o; t++) {
        for (int i = 0; i < n; i++) h[i] = tc_toy_g(t, i);
        tsys_tensor_release(p->grad);
        p->grad = tsys_tensor_from_data(ctx, TSYS_F32, dev, 1, &n, h);
        tsys_optim_step(o);
    }
    tsys_tensor_to_host(ctx, p, out);
    tsys_optim_free(o);
    tsys_tensor_release(p);
    free(h);
}

TSYS_TEST(cuda_adamw_bias_corrections_as_torch) {
    TC_CTX(ctx);
    tsys_ctx *cpu = tsys_ctx_new(NULL);
    static float a[4096], b[4096];
    tc_toy_adamw(cpu, TSYS_CPU, a);
    tc_toy_adamw(ctx, TSYS_CUDA, b);
    double worst = 0;
    for (int i = 0; i < 4096; i++) worst = fmax(worst, fabs((double)a[i] - (double)b[i]));
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK && tsys_ctx_status(cpu) == TSYS_OK, "%s %s", tsys_ctx_last_error(ctx), tsys_ctx_last_error(cpu));
    TEST_CHECK(worst <= 2.98e-7, "CUDA AdamW is %.3g from the CPU's after 10 steps (the CPU is 2.98e-7 from torch)", worst);
    tsys_ctx_free(cpu);
}

// ---- asynchronous snapshots ------------------------------------------------------------------------

static bool tc_same_file(const char *a, const char *b, const char *file) {
    char pa[512], pb[512];
    snprintf(pa, sizeof pa, "%s/%s", a, file);
    snprintf(pb, sizeof pb, "%s/%s", b, file);
    FILE *fa = fopen(pa, "rb"), *fb = fopen(pb, "rb");
    bool same = fa && fb;
    for (int x = 0, y = 0; same && (x != EOF || y != EOF);) { x = fgetc(fa); y = fgetc(fb); same = x == y; }
    if (fa) fclose(fa);
    if (fb) fclose(fb);
    if (!same) printf("    %s differs between %s and %s\n", file, a, b);
    return same;
}

static void CUDART_CB tc_hold_300ms(void *) { usleep(300000); }

// Saves the state of (m, o) at step as tsys_state_save does into sync_dir and through the saver into
// async_dir, with the copy stream held back 300 ms (a host function queued on it first); then
// `writes` writes the tensors (eager steps or graph replays) before the saver is waited for. The
// library's fences must order those writes after the copies: both snapshots are the same bytes. The
// writes wait for the held copies, unless the saver stages on the device: then they must not.
static void tc_async_case(tsys_ctx *ctx, tsys_state_saver *sv, tsys_model *m, tsys_optim *o, int64_t step, const char *root, void (*writes)(void *), void *user,
                          bool staged) {
    char sync_dir[256], async_dir[256], a[300], b[300];
    TEST_CHECK(mkdir(root, 0755) == 0, "mkdir %s", root);
    snprintf(sync_dir, sizeof sync_dir, "%s/sync", root);
    snprintf(async_dir, sizeof async_dir, "%s/async", root);
    tsys_state_desc d;
    memset(&d, 0, sizeof d);
    d.model = m; d.optim = o; d.step = step;
    TEST_CHECK(tsys_state_save(ctx, sync_dir, &d) == TSYS_OK, "save: %s", tsys_ctx_last_error(ctx));
    cudaStream_t copy = (cudaStream_t)tsys_cuda_stream_of(ctx, TSYS_STREAM_COPY);
    TEST_CHECK(copy && cudaLaunchHostFunc(copy, tc_hold_300ms, NULL) == cudaSuccess, "hold the copy stream");
    double t0 = tsys_time_us();
    TEST_CHECK(tsys_state_save_async(sv, async_dir, &d) == TSYS_OK, "save_async: %s", tsys_ctx_last_error(ctx));
    double call_ms = (tsys_time_us() - t0) / 1000.0;
    TEST_CHECK(call_ms < 250, "save_async returned after %.0f ms: it waited for the copies", call_ms);
    writes(user);
    cudaStream_t compute = (cudaStream_t)tsys_cuda_stream_of(ctx, TSYS_STREAM_COMPUTE);   // not tsys_sync: it waits for the copy stream too
    TEST_CHECK(compute && cudaStreamSynchronize(compute) == cudaSuccess, "the compute stream");
    double writes_ms = (tsys_time_us() - t0) / 1000.0;
    if (staged) TEST_CHECK(writes_ms < 250, "staged on the device, the writes still waited for the copy to the host (%.0f ms)", writes_ms);
    else TEST_CHECK(writes_ms >= 250, "the writes were done after %.0f ms, before the held copies could have read the tensors", writes_ms);
    TEST_CHECK(tsys_state_saver_wait(sv) == TSYS_OK, "wait: %s", tsys_ctx_last_error(ctx));
    snprintf(a, sizeof a, "%s/step-%06lld", sync_dir, (long long)step);
    snprintf(b, sizeof b, "%s/step-%06lld", async_dir, (long long)step);
    TEST_CHECK(tc_same_file(a, b, "model.safetensors") && tc_same_file(a, b, "train_state.safetensors"), "step %lld: the asynchronous snapshot is not the state at the call", (long long)step);
    TEST_CHECK(tsys_state_saver_stats_get(sv).copy_ms >= 250, "the copies took %.0f ms, yet the stream was held 300 ms", tsys_state_saver_stats_get(sv).copy_ms);
}

typedef struct tc_async_run { tsys_ctx *ctx; tsys_model *m; tsys_optim *o; tsys_tensor *ids, *tg, *loss; tsys_cuda_graph *g; } tc_async_run;
static void tc_async_eager(void *p) { tc_async_run *r = (tc_async_run *)p; for (int i = 0; i < 2; i++) tc_train_step_ex(r->ctx, r->m, r->o, r->ids, r->tg, NULL, true); }
static void tc_async_replay(void *p) { tc_async_run *r = (tc_async_run *)p; for (int i = 0; i < 2; i++) tsys_cuda_graph_replay(r->ctx, r->g); }

TSYS_TEST(cuda_state_save_async_fenced) {
    TC_CTX(ctx);
    char root[] = "/tmp/tsys_cuda_async_XXXXXX";
    TEST_CHECK(mkdtemp(root) != NULL, "mkdtemp");
    tsys_model_desc d = tc_model_desc();
    tc_async_run r;
    memset(&r, 0, sizeof r);
    r.ctx = ctx;
    r.m = tsys_model_new(ctx, &d, TSYS_CUDA, 9);
    tsys_optim_desc od;
    memset(&od, 0, sizeof od);
    od.lr = 1e-3f;
    r.o = r.m ? tsys_adamw_new(ctx, tsys_model_params(r.m), tsys_model_num_tensors(r.m), &od) : NULL;
    r.ids = tc_ids(ctx, TSYS_CUDA, 2, 32, d.vocab_size, 3); r.tg = tc_ids(ctx, TSYS_CUDA, 2, 32, d.vocab_size, 4);
    tsys_state_saver *sv = tsys_state_saver_new(ctx);
    TEST_CHECK(r.o && sv, "setup: %s", tsys_ctx_last_error(ctx));
    if (!r.o || !sv) return;
    tc_async_eager(&r);
    char sub[300];
    snprintf(sub, sizeof sub, "%s/eager", root);
    tc_async_case(ctx, sv, r.m, r.o, 2, sub, tc_async_eager, &r, false);   // eager steps: tsys_optim_step fences
    TEST_CHECK(tsys_cuda_graph_begin(ctx) == TSYS_OK, "begin: %s", tsys_ctx_last_error(ctx));
    tc_train_step_ex(ctx, r.m, r.o, r.ids, r.tg, &r.loss, true);
    TEST_CHECK(tsys_cuda_graph_end(ctx, &r.g) == TSYS_OK && r.g, "capture: %s", tsys_ctx_last_error(ctx));
    snprintf(sub, sizeof sub, "%s/graph", root);
    if (r.g) tc_async_case(ctx, sv, r.m, r.o, 5, sub, tc_async_replay, &r, false);   // replays: the launch fences
    TEST_CHECK(tsys_state_saver_stage_on_device(sv, true) == TSYS_OK, "stage on the device");
    snprintf(sub, sizeof sub, "%s/graph-staged", root);
    if (r.g) tc_async_case(ctx, sv, r.m, r.o, 8, sub, tc_async_replay, &r, true);
    snprintf(sub, sizeof sub, "%s/eager-staged", root);
    tc_async_case(ctx, sv, r.m, r.o, 11, sub, tc_async_eager, &r, true);
    tsys_state_saver_free(sv);
    tsys_cuda_graph_free(r.g);
    tsys_tensor_release(r.loss); tsys_tensor_release(r.ids); tsys_tensor_release(r.tg);
    tsys_optim_free(r.o);
    tsys_model_free(r.m);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
    if (system(cmd) != 0) printf("    (could not remove %s)\n", root);
    tsys_ctx_clear_error(ctx);
}

// ---- activation checkpointing --------------------------------------------------------------------

// One forward + backward of the small model on CUDA under `policy`: the loss, every gradient (host
// copies, parameters() order) and the bytes the forward kept (the tracker's activations, batch aside).
typedef struct tc_ckpt_out { float loss; float *grads; int64_t n, kept, peak; } tc_ckpt_out;
static bool tc_ckpt_run(tsys_ctx *ctx, const char *attn, const char *policy, tsys_dtype ac, tc_ckpt_out *r) {
    memset(r, 0, sizeof(*r));
    tsys_model_desc d = tc_model_desc();
    d.attn = attn; d.checkpoint = policy;
    tsys_model *m = tsys_model_new(ctx, &d, TSYS_CUDA, 7);
    tsys_tensor *ids = tc_ids(ctx, TSYS_CUDA, 2, 32, d.vocab_size, 11), *tg = tc_ids(ctx, TSYS_CUDA, 2, 32, d.vocab_size, 23);
    tsys_sync(ctx, TSYS_CUDA);
    tsys_mem_reset_peak(ctx, TSYS_CUDA);
    if (ac != TSYS_F32) tsys_autocast_begin(ctx, ac);
    tsys_tensor *logits = m ? tsys_model_forward(m, ids) : NULL, *loss = tsys_cross_entropy(ctx, logits, tg);
    if (ac != TSYS_F32) tsys_autocast_end(ctx);
    tsys_tensor_release(logits);
    r->kept = tsys_mem_stats_get(ctx, TSYS_CUDA).category_bytes[TSYS_MEM_ACTIVATIONS] - (int64_t)(tsys_tensor_bytes(ids) + tsys_tensor_bytes(tg));
    tsys_backward(ctx, loss);
    r->peak = tsys_mem_stats_get(ctx, TSYS_CUDA).peak_bytes;
    bool ok = tsys_ctx_status(ctx) == TSYS_OK;
    if (ok) {
        r->loss = tsys_item(ctx, loss);
        tsys_tensor **ps = tsys_model_params(m);
        for (int i = 0; i < tsys_model_num_tensors(m); i++) r->n += tsys_tensor_numel(ps[i]);
        r->grads = (float *)malloc(sizeof(float) * (size_t)r->n);
        for (int i = 0, o = 0; i < tsys_model_num_tensors(m); o += (int)tsys_tensor_numel(ps[i]), i++) tsys_tensor_to_f32(ctx, ps[i]->grad, r->grads + o);
    } else {
        printf("[%s %s: %s] ", attn, policy, tsys_ctx_last_error(ctx));
    }
    tsys_tensor_release(loss); tsys_tensor_release(ids); tsys_tensor_release(tg);
    tsys_model_free(m);
    tsys_ctx_clear_error(ctx);
    return ok;
}

// Every policy against the run without checkpointing on the GPU: the recompute launches the same
// kernels on the same values in the same order, so loss and gradients are equal bit for bit (fp32
// and bf16 autocast, naive and flash attention); the bytes kept are the accounting's.
TSYS_TEST(cuda_checkpoint_policies_bitwise) {
    TC_CTX(ctx);
    const char *const attns[2] = {"naive", "flash"};
    const tsys_dtype dts[2] = {TSYS_F32, TSYS_BF16};
    const char *const pols[6] = {"blocks:1", "blocks:2", "nested:2", "selective", "nested:2+selective", "blocks:1+keep-attn"};
    for (int a = 0; a < 2; a++)
        for (int t = 0; t < 2; t++) {
            tc_ckpt_out ref, got;
            if (!tc_ckpt_run(ctx, attns[a], "none", dts[t], &ref)) { TEST_CHECK(false, "%s %s none failed", attns[a], tsys_dtype_name(dts[t])); continue; }
            for (int i = 0; i < 6; i++) {
                if (!tc_ckpt_run(ctx, attns[a], pols[i], dts[t], &got)) { TEST_CHECK(false, "%s failed", pols[i]); continue; }
                TEST_CHECK(got.loss == ref.loss, "%s %s %s: loss %.9g vs %.9g", attns[a], tsys_dtype_name(dts[t]), pols[i], got.loss, ref.loss);
                TEST_CHECK(memcmp(got.grads, ref.grads, sizeof(float) * (size_t)ref.n) == 0, "%s %s %s: gradients differ (rel err %.3g)", attns[a],
                           tsys_dtype_name(dts[t]), pols[i], tsys_test_rel_err(got.grads, ref.grads, ref.n));
                tsys_model_desc d = tc_model_desc();
                d.attn = attns[a];
                tsys_checkpoint_plan p;
                tsys_checkpoint_plan_make(&d, pols[i], 2, 32, dts[t], false, &p, NULL, 0);
                TEST_CHECK((double)got.kept == p.kept_bytes, "%s %s %s: kept %lld bytes, accounting %.0f", attns[a], tsys_dtype_name(dts[t]), pols[i],
                           (long long)got.kept, p.kept_bytes);
                TEST_CHECK(got.kept < ref.kept, "%s keeps %lld, none %lld", pols[i], (long long)got.kept, (long long)ref.kept);
                free(got.grads);
            }
            free(ref.grads);
        }
}

// The recompute inside a captured CUDA graph: a training step with blocks:1 (and with
// nested:2+selective) captured after one eager step and replayed gives the losses of eager steps
// without checkpointing, bit for bit.
// A training step with the forward under autocast `ac`, ended before backward as e2e does (so the
// recompute casts the weights again, inside the capture when there is one).
static float tc_ac_step(tsys_ctx *ctx, tsys_model *m, tsys_optim *o, tsys_tensor *ids, tsys_tensor *tg, tsys_dtype ac, tsys_tensor **loss_out) {
    if (ac != TSYS_F32) tsys_autocast_begin(ctx, ac);
    tsys_tensor *logits = tsys_model_forward(m, ids), *loss = tsys_cross_entropy(ctx, logits, tg);
    if (ac != TSYS_F32) tsys_autocast_end(ctx);
    tsys_backward(ctx, loss);
    tsys_optim_step(o);
    tsys_optim_zero_grad(o);
    tsys_tensor_release(logits);
    if (loss_out) { *loss_out = loss; return 0.0f; }
    float l = tsys_item(ctx, loss);
    tsys_tensor_release(loss);
    return l;
}
static void tc_ckpt_graph(const char *policy, tsys_dtype ac) {
    TC_CTX(ctx);
    tsys_model_desc d = tc_model_desc(), dc = d;
    dc.checkpoint = policy;
    tsys_model *me = tsys_model_new(ctx, &d, TSYS_CUDA, 5), *mg = tsys_model_new(ctx, &dc, TSYS_CUDA, 5);
    TEST_CHECK(me && mg, "setup: %s", tsys_ctx_last_error(ctx));
    if (!me || !mg) return;
    int n = tsys_model_num_tensors(me);
    tsys_optim *oe = tsys_adamw_new(ctx, tsys_model_params(me), n, NULL), *og = tsys_adamw_new(ctx, tsys_model_params(mg), n, NULL);
    tsys_tensor *ids = tc_ids(ctx, TSYS_CUDA, 2, 32, d.vocab_size, 1), *tg = tc_ids(ctx, TSYS_CUDA, 2, 32, d.vocab_size, 2);
    float eager[5], graph[5];
    for (int i = 0; i < 5; i++) eager[i] = tc_ac_step(ctx, me, oe, ids, tg, ac, NULL);
    graph[0] = tc_ac_step(ctx, mg, og, ids, tg, ac, NULL);
    TEST_CHECK(graph[0] == eager[0], "%s eager step: loss %.8f, without checkpointing %.8f", policy, graph[0], eager[0]);
    tsys_tensor *loss = NULL;
    tsys_cuda_graph *gr = NULL;
    TEST_CHECK(tsys_cuda_graph_begin(ctx) == TSYS_OK, "begin: %s", tsys_ctx_last_error(ctx));
    tc_ac_step(ctx, mg, og, ids, tg, ac, &loss);
    tsys_status s = tsys_cuda_graph_end(ctx, &gr);
    TEST_CHECK(s == TSYS_OK && gr && loss, "capture of a checkpointed training step (%s): %s", policy, tsys_ctx_last_error(ctx));
    for (int i = 1; i < 5 && gr && loss; i++) {
        tsys_cuda_graph_replay(ctx, gr);
        graph[i] = tsys_item(ctx, loss);
        TEST_CHECK(graph[i] == eager[i], "%s step %d: eager loss %.8f (no checkpointing), graph %.8f", policy, i, eager[i], graph[i]);
    }
    tsys_cuda_graph_free(gr);
    tsys_tensor_release(loss); tsys_tensor_release(ids); tsys_tensor_release(tg);
    tsys_optim_free(oe); tsys_optim_free(og);
    tsys_model_free(me); tsys_model_free(mg);
    tsys_ctx_clear_error(ctx);
}
TSYS_TEST(cuda_checkpoint_in_a_captured_graph) {
    tc_ckpt_graph("blocks:1", TSYS_F32);
    tc_ckpt_graph("nested:2+selective", TSYS_F32);
    tc_ckpt_graph("blocks:1", TSYS_BF16);
}
// The optimizer inside backward on the GPU: each layer's AdamW on the background stream from its gradients'
// hooks gives the ordinary step's parameters bit for bit, eagerly and replayed from a captured graph
// (the events become the graph's fork and join); so does TSYS_OPTIM_FREE_GRADS (updates on the
// compute stream, each layer's gradients given back after its update), eagerly and captured.
static void tc_overlap_step_ex(tsys_ctx *ctx, tsys_model *m, tsys_optim *o, tsys_tensor *ids, tsys_tensor *tg, unsigned flags) {
    tsys_tensor *logits = tsys_model_forward(m, ids), *loss = tsys_cross_entropy(ctx, logits, tg);
    tsys_optim_overlap_begin_ex(o, flags);
    tsys_backward(ctx, loss);
    tsys_optim_overlap_end(o);
    tsys_optim_release_grads(o);
    tsys_tensor_release(logits); tsys_tensor_release(loss);
}
static void tc_overlap_step(tsys_ctx *ctx, tsys_model *m, tsys_optim *o, tsys_tensor *ids, tsys_tensor *tg) { tc_overlap_step_ex(ctx, m, o, ids, tg, 0); }
// Where the AdamW launches went: the background stream, or another.
typedef struct { int background, elsewhere; } tc_adamw_streams;
static void tc_count_adamw_streams(tsys_ctx *ctx, const tsys_trace_kernel *k, void *user) {
    tc_adamw_streams *c = (tc_adamw_streams *)user;
    if (k->kernel != TSYS_K_ADAMW) return;
    if (tsys_cuda_stream(ctx) == tsys_cuda_stream_of(ctx, TSYS_STREAM_BACKGROUND)) c->background++; else c->elsewhere++;
}
static int tc_stream_priority(tsys_ctx *ctx, tsys_stream s) {
    int p = 0;
    TEST_CHECK(cudaStreamGetPriority((cudaStream_t)tsys_cuda_stream_of(ctx, s), &p) == cudaSuccess, "cudaStreamGetPriority of stream %d", (int)s);
    return p;
}
// The updates inside backward go on the background stream, whose blocks the GPU schedules only where
// the compute and side streams' blocks are not waiting (a lower priority; ordinary steps' AdamW stays
// on the compute stream).
TSYS_TEST(cuda_optimizer_in_backward_streams) {
    TC_CTX(ctx);
    int least = 0, greatest = 0;
    TEST_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest) == cudaSuccess && greatest < least, "the device offers no stream priorities (%d .. %d)", least, greatest);
    int compute = tc_stream_priority(ctx, TSYS_STREAM_COMPUTE), side = tc_stream_priority(ctx, TSYS_STREAM_SIDE), bg = tc_stream_priority(ctx, TSYS_STREAM_BACKGROUND);
    TEST_CHECK(compute == greatest && side == greatest && bg == least, "priorities: compute %d, side %d, background %d (greatest %d, least %d)", compute, side, bg, greatest, least);
    tsys_model_desc d = tc_model_desc();
    tsys_model *m = tsys_model_new(ctx, &d, TSYS_CUDA, 5);
    tsys_optim *o = m ? tsys_adamw_new(ctx, tsys_model_params(m), tsys_model_num_tensors(m), NULL) : NULL;
    tsys_tensor *ids = tc_ids(ctx, TSYS_CUDA, 2, 32, d.vocab_size, 1), *tg = tc_ids(ctx, TSYS_CUDA, 2, 32, d.vocab_size, 2);
    TEST_CHECK(m && o && ids && tg, "setup: %s", tsys_ctx_last_error(ctx));
    if (!m || !o || !ids || !tg) return;
    tc_adamw_streams in_backward = {0, 0}, after = {0, 0};
    tsys_trace_hooks h;
    memset(&h, 0, sizeof h);
    h.kernel = tc_count_adamw_streams; h.user = &in_backward;
    tsys_trace_hooks prev = tsys_ctx_set_trace_hooks(ctx, &h);
    tc_overlap_step(ctx, m, o, ids, tg);
    h.user = &after;
    tsys_ctx_set_trace_hooks(ctx, &h);
    tc_train_step_ex(ctx, m, o, ids, tg, NULL, true);
    tsys_ctx_set_trace_hooks(ctx, &prev);
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "steps: %s", tsys_ctx_last_error(ctx));
    TEST_CHECK(in_backward.background > 0 && in_backward.elsewhere == 0, "in backward: %d AdamW launches on the background stream, %d elsewhere", in_backward.background,
               in_backward.elsewhere);
    TEST_CHECK(after.background == 0 && after.elsewhere > 0, "ordinary step: %d AdamW launches on the background stream, %d elsewhere", after.background, after.elsewhere);
    tsys_tensor_release(ids); tsys_tensor_release(tg);
    tsys_optim_free(o); tsys_model_free(m);
    tsys_ctx_clear_error(ctx);
}
TSYS_TEST(cuda_optimizer_in_backward) {
    TC_CTX(ctx);
    tsys_model_desc d = tc_model_desc();
    enum { NM = 5 };
    tsys_model *m[NM];
    m[0] = tsys_model_new(ctx, &d, TSYS_CUDA, 5);
    for (int k = 1; k < NM; k++) m[k] = m[0] ? tc_model_copy(ctx, m[0], TSYS_CUDA) : NULL;
    bool made = true;
    for (int k = 0; k < NM; k++) made = made && m[k];
    TEST_CHECK(made, "setup: %s", tsys_ctx_last_error(ctx));
    if (!made) return;
    int n = tsys_model_num_tensors(m[0]);
    tsys_optim *o[NM];
    for (int k = 0; k < NM; k++) o[k] = tsys_adamw_new(ctx, tsys_model_params(m[k]), n, NULL);
    tsys_tensor *ids = tc_ids(ctx, TSYS_CUDA, 2, 32, d.vocab_size, 1), *tg = tc_ids(ctx, TSYS_CUDA, 2, 32, d.vocab_size, 2);
    for (int i = 0; i < 4; i++) tc_train_step_ex(ctx, m[0], o[0], ids, tg, NULL, true);   // the ordinary step
    for (int i = 0; i < 4; i++) tc_overlap_step(ctx, m[1], o[1], ids, tg);               // eager, in backward
    tc_overlap_step(ctx, m[2], o[2], ids, tg);                                         // one eager step, then a graph of one
    tsys_cuda_graph *gr = NULL;
    TEST_CHECK(tsys_cuda_graph_begin(ctx) == TSYS_OK, "begin: %s", tsys_ctx_last_error(ctx));
    tc_overlap_step(ctx, m[2], o[2], ids, tg);
    TEST_CHECK(tsys_cuda_graph_end(ctx, &gr) == TSYS_OK && gr, "capture: %s", tsys_ctx_last_error(ctx));
    for (int i = 0; gr && i < 3; i++) tsys_cuda_graph_replay(ctx, gr);   // steps 2, 3 and 4 (capturing runs nothing)
    tsys_cuda_graph_free(gr);
    gr = NULL;
    for (int i = 0; i < 4; i++) tc_overlap_step_ex(ctx, m[3], o[3], ids, tg, TSYS_OPTIM_FREE_GRADS);
    TEST_CHECK(tsys_model_params(m[3])[0]->grad == NULL && tsys_mem_stats_get(ctx, TSYS_CUDA).category_bytes[TSYS_MEM_GRADIENTS] == 0,
               "free_grads: gradients left after the step (%lld bytes)", (long long)tsys_mem_stats_get(ctx, TSYS_CUDA).category_bytes[TSYS_MEM_GRADIENTS]);
    tc_overlap_step_ex(ctx, m[4], o[4], ids, tg, TSYS_OPTIM_FREE_GRADS);
    TEST_CHECK(tsys_cuda_graph_begin(ctx) == TSYS_OK, "begin: %s", tsys_ctx_last_error(ctx));
    tc_overlap_step_ex(ctx, m[4], o[4], ids, tg, TSYS_OPTIM_FREE_GRADS);
    TEST_CHECK(tsys_cuda_graph_end(ctx, &gr) == TSYS_OK && gr, "capture (free_grads): %s", tsys_ctx_last_error(ctx));
    for (int i = 0; gr && i < 3; i++) tsys_cuda_graph_replay(ctx, gr);
    tsys_sync(ctx, TSYS_CUDA);
    const char *what[NM] = {"", "eager", "graph", "free_grads eager", "free_grads graph"};
    for (int k = 1; k < NM; k++) {
        int differ = 0;
        for (int i = 0; i < n; i++) {
            tsys_tensor *a = tsys_model_params(m[0])[i], *b = tsys_model_params(m[k])[i];
            float *va = test_read(ctx, a), *vb = test_read(ctx, b);
            differ += !va || !vb || memcmp(va, vb, sizeof(float) * (size_t)tsys_tensor_numel(a)) != 0;
            free(va); free(vb);
        }
        TEST_CHECK(differ == 0, "%s: %d parameter tensors differ from the ordinary step after 4 steps", what[k], differ);
    }
    tsys_cuda_graph_free(gr);
    tsys_tensor_release(ids); tsys_tensor_release(tg);
    for (int k = 0; k < NM; k++) { tsys_optim_free(o[k]); tsys_model_free(m[k]); }
    tsys_ctx_clear_error(ctx);
}

// Kept low-precision weights (tsys_optim_keep_lowp) on the GPU: AdamW's kernel writes each copy, the
// next forward reads it. Against the same model trained without them (autocast casting every weight
// at every use), bf16 and fp16, ordinary step and optimizer in backward: eager steps with the copies,
// and one eager step then a captured step replayed three times, give the losses of every step and the
// final parameters bit for bit; the captured forward casts no weight (it reads the copies the eager
// step's AdamW wrote, and the captured AdamW writes them for the replays); every copy equals a cast.
static tsys_tensor *tc_lowp_step(tsys_ctx *ctx, tsys_model *m, tsys_optim *o, tsys_tensor *ids, tsys_tensor *tg, tsys_dtype dt, bool overlap) {
    tsys_autocast_begin(ctx, dt);
    tsys_tensor *logits = tsys_model_forward(m, ids), *loss = tsys_cross_entropy(ctx, logits, tg);
    tsys_autocast_end(ctx);
    if (overlap) tsys_optim_overlap_begin(o);
    tsys_backward(ctx, loss);
    if (overlap) tsys_optim_overlap_end(o); else tsys_optim_step(o);
    tsys_optim_release_grads(o);
    tsys_tensor_release(logits);
    return loss;
}
static float tc_lowp_loss(tsys_ctx *ctx, tsys_tensor *loss) { float v = tsys_item(ctx, loss); tsys_tensor_release(loss); return v; }
typedef struct { tsys_tensor **params; int n, casts; } tc_casts;
static void tc_count_weight_casts(tsys_ctx *, const tsys_trace_kernel *k, void *user) {
    tc_casts *c = (tc_casts *)user;
    if (k->kernel != TSYS_K_CAST || !k->args) return;
    for (int i = 0; i < c->n; i++) c->casts += k->args->t[1] == c->params[i];
}
// Three equal models of tc_model_desc on the GPU; false (and a failed check) when one could not be made.
static bool tc_three_models(tsys_ctx *ctx, const tsys_model_desc *d, tsys_model *m[3]) {
    m[0] = tsys_model_new(ctx, d, TSYS_CUDA, 5);
    m[1] = m[0] ? tc_model_copy(ctx, m[0], TSYS_CUDA) : NULL;
    m[2] = m[0] ? tc_model_copy(ctx, m[0], TSYS_CUDA) : NULL;
    TEST_CHECK(m[0] && m[1] && m[2], "setup: %s", tsys_ctx_last_error(ctx));
    return m[0] && m[1] && m[2];
}
static void tc_lowp_case(tsys_dtype dt, bool overlap) {
    TC_CTX(ctx);
    const char *what = overlap ? "in backward" : "step";
    tsys_model_desc d = tc_model_desc();
    tsys_model *m[3];
    if (!tc_three_models(ctx, &d, m)) return;
    int n = tsys_model_num_tensors(m[0]);
    tsys_optim *o[3];
    for (int k = 0; k < 3; k++) o[k] = tsys_adamw_new(ctx, tsys_model_params(m[k]), n, NULL);
    for (int k = 1; k < 3; k++) TEST_CHECK(tsys_optim_keep_lowp(o[k], dt) == TSYS_OK, "keep_lowp: %s", tsys_ctx_last_error(ctx));
    tsys_tensor *ids = tc_ids(ctx, TSYS_CUDA, 2, 32, d.vocab_size, 1), *tg = tc_ids(ctx, TSYS_CUDA, 2, 32, d.vocab_size, 2);
    float ref[4], eager[4], graph[4] = {0, 0, 0, 0};
    for (int i = 0; i < 4; i++) ref[i] = tc_lowp_loss(ctx, tc_lowp_step(ctx, m[0], o[0], ids, tg, dt, false));
    for (int i = 0; i < 4; i++) eager[i] = tc_lowp_loss(ctx, tc_lowp_step(ctx, m[1], o[1], ids, tg, dt, overlap));
    graph[0] = tc_lowp_loss(ctx, tc_lowp_step(ctx, m[2], o[2], ids, tg, dt, overlap));
    tc_casts cc = { tsys_model_params(m[2]), n, 0 };
    tsys_trace_hooks h;
    memset(&h, 0, sizeof h);
    h.kernel = tc_count_weight_casts; h.user = &cc;
    tsys_cuda_graph *gr = NULL;
    TEST_CHECK(tsys_cuda_graph_begin(ctx) == TSYS_OK, "begin: %s", tsys_ctx_last_error(ctx));
    tsys_trace_hooks prev = tsys_ctx_set_trace_hooks(ctx, &h);
    tsys_tensor *loss = tc_lowp_step(ctx, m[2], o[2], ids, tg, dt, overlap);
    tsys_ctx_set_trace_hooks(ctx, &prev);
    TEST_CHECK(tsys_cuda_graph_end(ctx, &gr) == TSYS_OK && gr && loss, "capture: %s", tsys_ctx_last_error(ctx));
    TEST_CHECK(cc.casts == 0, "%s %s: the captured forward cast %d weights instead of reading the kept copies", tsys_dtype_name(dt), what, cc.casts);
    for (int i = 1; i < 4 && gr && loss; i++) { tsys_cuda_graph_replay(ctx, gr); graph[i] = tsys_item(ctx, loss); }
    tsys_sync(ctx, TSYS_CUDA);
    for (int i = 0; i < 4; i++)
        TEST_CHECK(eager[i] == ref[i] && graph[i] == ref[i], "%s %s step %d: loss %.9g without copies, %.9g eager with, %.9g graph with", tsys_dtype_name(dt), what, i,
                   ref[i], eager[i], graph[i]);
    for (int k = 1; k < 3; k++) {
        int differ = 0, stale = 0;
        tsys_no_grad_begin(ctx);
        for (int i = 0; i < n; i++) {
            tsys_tensor *a = tsys_model_params(m[0])[i], *b = tsys_model_params(m[k])[i], *cast = tsys_cast(ctx, b, dt);
            float *va = test_read(ctx, a), *vb = test_read(ctx, b), *vc = cast ? test_read(ctx, cast) : NULL, *vl = b->lowp ? test_read(ctx, b->lowp) : NULL;
            size_t bytes = sizeof(float) * (size_t)tsys_tensor_numel(a);
            differ += !va || !vb || memcmp(va, vb, bytes) != 0;
            stale += !vc || !vl || memcmp(vc, vl, bytes) != 0;
            free(va); free(vb); free(vc); free(vl);
            tsys_tensor_release(cast);
        }
        tsys_no_grad_end(ctx);
        TEST_CHECK(differ == 0, "%s %s, %s: %d parameter tensors differ from training without copies", tsys_dtype_name(dt), what, k == 1 ? "eager" : "graph", differ);
        TEST_CHECK(stale == 0, "%s %s, %s: %d kept copies differ from a cast of their parameter", tsys_dtype_name(dt), what, k == 1 ? "eager" : "graph", stale);
    }
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    tsys_cuda_graph_free(gr);
    tsys_tensor_release(loss); tsys_tensor_release(ids); tsys_tensor_release(tg);
    for (int k = 0; k < 3; k++) { tsys_optim_free(o[k]); tsys_model_free(m[k]); }
    tsys_ctx_clear_error(ctx);
}
TSYS_TEST(cuda_kept_lowp_copies) { tc_lowp_case(TSYS_BF16, false); tc_lowp_case(TSYS_F16, false); }
TSYS_TEST(cuda_kept_lowp_copies_in_backward) { tc_lowp_case(TSYS_BF16, true); tc_lowp_case(TSYS_F16, true); }

// AdamW reading bf16 / f16 gradients (tsys_tensor_set_grad_dtype) against the same values in fp32: the same
// bits, on the vector path (aligned, whole groups), the element path (a tail of 3; a gradient 2 bytes off its
// alignment) and with the kept copies written beside.
static void tc_adamw_lowp_grad_case(tsys_dtype gdt, bool copies) {
    TC_CTX(ctx);
    const int64_t sizes[3] = {4099, 7, 1000};
    tsys_tensor *p[2][3], *big = NULL;
    for (int k = 0; k < 2; k++)
        for (int j = 0; j < 3; j++) {
            p[k][j] = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 1, &sizes[j]);
            tsys_rng_seed(ctx, 40 + j);
            tsys_tensor_randn(ctx, p[k][j], 1.0f);
            tsys_tensor_set_requires_grad(p[k][j], true);
        }
    int64_t bign = sizes[2] + 1;
    big = tsys_tensor_new(ctx, gdt, TSYS_CUDA, 1, &bign);
    tsys_rng_seed(ctx, 50);
    tsys_tensor_randn(ctx, big, 0.5f);
    for (int j = 0; j < 3; j++) {   // the low-precision gradients, then the same values in fp32
        tsys_tensor *g = j == 2 ? tsys_tensor_view_raw(ctx, big, 2, gdt, 1, &sizes[j]) : tsys_tensor_new(ctx, gdt, TSYS_CUDA, 1, &sizes[j]);
        if (j < 2) { tsys_rng_seed(ctx, 60 + j); tsys_tensor_randn(ctx, g, 0.5f); }
        p[1][j]->grad = g;
        p[0][j]->grad = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 1, &sizes[j]);
        tsys_tensor_cast_from(ctx, p[0][j]->grad, g);
    }
    tsys_optim *o[2];
    for (int k = 0; k < 2; k++) {
        o[k] = tsys_adamw_new(ctx, p[k], 3, NULL);
        if (copies) tsys_optim_keep_lowp(o[k], TSYS_BF16);
        for (int s = 0; s < 3; s++) tsys_optim_step(o[k]);
    }
    int differ = 0;
    for (int j = 0; j < 3; j++)
        for (int w = 0; w < 3; w++) {
            tsys_tensor *a = w == 2 ? p[0][j] : tsys_optim_state(o[0], j, w), *b = w == 2 ? p[1][j] : tsys_optim_state(o[1], j, w);
            float *va = test_read(ctx, a), *vb = test_read(ctx, b);
            differ += !va || !vb || memcmp(va, vb, sizeof(float) * (size_t)sizes[j]) != 0;
            free(va); free(vb);
            if (w < 2) { tsys_tensor_release(a); tsys_tensor_release(b); }
        }
    TEST_CHECK(differ == 0, "%s gradients%s: %d of p, m, v differ from AdamW on the same values in fp32", tsys_dtype_name(gdt), copies ? ", copies" : "", differ);
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    for (int k = 0; k < 2; k++) { tsys_optim_free(o[k]); for (int j = 0; j < 3; j++) tsys_tensor_release(p[k][j]); }
    tsys_tensor_release(big);
}
TSYS_TEST(cuda_adamw_reads_lowp_grads) {
    tc_adamw_lowp_grad_case(TSYS_BF16, false); tc_adamw_lowp_grad_case(TSYS_F16, false); tc_adamw_lowp_grad_case(TSYS_BF16, true);
}

// The step's bias corrections written once by STEP_INC (t[1]) and read by AdamW (t[8]) against each thread
// computing them from the step count: the same bits of p, m, v and the copy, at steps 1 to 1000, on a size past
// the capped grid's reach (so one group a thread runs a grid of its own shape), a ragged tail, and fp32 / bf16
// gradients; and the corrections themselves equal 1 - beta^t as the CPU computes them.
static tsys_tensor *tc_adamw_clone(tsys_ctx *ctx, tsys_tensor *t) {
    tsys_tensor *c = t ? tsys_tensor_new(ctx, t->dtype, TSYS_CUDA, t->ndim, t->shape) : NULL;
    if (c) tsys_tensor_copy_from(ctx, c, t);
    return c;
}
static void tc_adamw_corrections_case(int64_t n, tsys_dtype gdt, bool copies) {
    TC_CTX(ctx);
    const tsys_backend *gpu = tsys_ctx_backend(ctx, TSYS_CUDA), *cpu = tsys_ctx_backend(ctx, TSYS_CPU);
    int64_t one = 1, two = 2, zero = 0;
    tsys_tensor *x[2][5];   // p, g, m, v, copy: [0] corrections given, [1] computed by each thread
    x[0][0] = tc_rand(ctx, TSYS_F32, 1, &n, 1); x[0][1] = tc_rand(ctx, gdt, 1, &n, 0.5f);
    x[0][2] = tc_rand(ctx, TSYS_F32, 1, &n, 0.1f); x[0][3] = tc_rand(ctx, TSYS_F32, 1, &n, 0.1f);
    x[0][4] = copies ? tsys_tensor_new(ctx, TSYS_BF16, TSYS_CUDA, 1, &n) : NULL;
    tsys_kargs sq; memset(&sq, 0, sizeof sq); sq.t[0] = sq.t[1] = sq.t[2] = x[0][3];   // v >= 0
    gpu->kernel(ctx, TSYS_K_MUL, &sq);
    for (int j = 0; j < 5; j++) x[1][j] = tc_adamw_clone(ctx, x[0][j]);
    tsys_tensor *step[2] = {tsys_tensor_from_data(ctx, TSYS_I64, TSYS_CUDA, 1, &one, &zero), tsys_tensor_from_data(ctx, TSYS_I64, TSYS_CUDA, 1, &one, &zero)};
    tsys_tensor *bias = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 1, &two);
    int differ = 0, wrong_bias = 0;
    for (int t = 1; t <= 1000; t++) {
        for (int k = 0; k < 2; k++) {
            tsys_kargs inc; memset(&inc, 0, sizeof inc);
            inc.t[0] = step[k]; inc.t[1] = k ? NULL : bias; inc.f[0] = 0.9f; inc.f[1] = 0.999f;
            gpu->kernel(ctx, TSYS_K_STEP_INC, &inc);
            if (t != 1 && t != 2 && t != 10 && t != 1000) continue;
            tsys_kargs a; memset(&a, 0, sizeof a);
            a.t[0] = x[k][0]; a.t[1] = x[k][1]; a.t[2] = x[k][2]; a.t[3] = x[k][3]; a.t[4] = step[k]; a.t[6] = x[k][4]; a.t[8] = k ? NULL : bias;
            a.f[0] = 1e-3f; a.f[1] = 0.9f; a.f[2] = 0.999f; a.f[3] = 1e-8f; a.f[4] = 0.01f;
            TEST_CHECK(gpu->kernel(ctx, TSYS_K_ADAMW, &a) == TSYS_OK, "adamw: %s", tsys_ctx_last_error(ctx));
        }
        if (t != 1 && t != 2 && t != 10 && t != 1000) continue;
        float *b = test_read(ctx, bias), want[2];   // the CPU's corrections for this step
        tsys_tensor *hs = tsys_tensor_from_data(ctx, TSYS_I64, TSYS_CPU, 1, &one, &zero), *hb = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, &two);
        ((int64_t *)tsys_tensor_data(hs))[0] = t - 1;
        tsys_kargs inc; memset(&inc, 0, sizeof inc);
        inc.t[0] = hs; inc.t[1] = hb; inc.f[0] = 0.9f; inc.f[1] = 0.999f;
        cpu->kernel(ctx, TSYS_K_STEP_INC, &inc);
        memcpy(want, tsys_tensor_data(hb), sizeof want);
        wrong_bias += !b || b[0] != want[0] || b[1] != want[1];
        free(b); tsys_tensor_release(hs); tsys_tensor_release(hb);
        for (int j = 0; j < 5; j++) {
            if (!x[0][j] || j == 1) continue;
            size_t bytes = tsys_tensor_bytes(x[0][j]);
            char *va = (char *)malloc(bytes), *vb = (char *)malloc(bytes);
            differ += tsys_tensor_to_host(ctx, x[0][j], va) != TSYS_OK || tsys_tensor_to_host(ctx, x[1][j], vb) != TSYS_OK || memcmp(va, vb, bytes) != 0;
            free(va); free(vb);
        }
    }
    TEST_CHECK(wrong_bias == 0, "n %lld: %d steps' corrections differ from the CPU's", (long long)n, wrong_bias);
    TEST_CHECK(differ == 0, "n %lld, %s gradients%s: %d of p, m, v (and copies) differ with the corrections given", (long long)n, tsys_dtype_name(gdt), copies ? ", copies" : "", differ);
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    for (int k = 0; k < 2; k++) { for (int j = 0; j < 5; j++) tsys_tensor_release(x[k][j]); tsys_tensor_release(step[k]); }
    tsys_tensor_release(bias);
    tsys_ctx_clear_error(ctx);
}
TSYS_TEST(cuda_adamw_step_corrections) {
    tc_adamw_corrections_case((int64_t)1200 * 4096 + 4, TSYS_F32, false);
    tc_adamw_corrections_case((int64_t)1200 * 4096 + 4, TSYS_BF16, true);
    tc_adamw_corrections_case(10007, TSYS_F32, true);
    tc_adamw_corrections_case(10007, TSYS_BF16, false);
}

// How many of two same-shaped models' parameter tensors differ in any bit.
static int tc_params_differ(tsys_ctx *ctx, tsys_model *x, tsys_model *y) {
    int differ = 0;
    for (int i = 0; i < tsys_model_num_tensors(x); i++) {
        float *a = test_read(ctx, tsys_model_params(x)[i]), *b = test_read(ctx, tsys_model_params(y)[i]);
        differ += !a || !b || memcmp(a, b, sizeof(float) * (size_t)tsys_tensor_numel(tsys_model_params(x)[i])) != 0;
        free(a); free(b);
    }
    return differ;
}

// The model with bf16 linear-weight gradients on the GPU (and the kept copies, as the benchmarks run it): each
// kept gradient is the fp32 one rounded, within one bf16 step (cuBLASLt may sum a bf16-output GEMM in another
// order); the rest stay fp32; four steps train as with fp32 gradients (losses within 1e-3), and the captured
// step replays the eager one bit for bit.
static bool tc_within_bf16_step(float a, float b) {
    float m = fabsf(a) > fabsf(b) ? fabsf(a) : fabsf(b);
    int e;
    frexpf(m, &e);
    return fabsf(a - b) <= ldexpf(1.0f, e - 8);
}
TSYS_TEST(cuda_lowp_grads_train) {
    TC_CTX(ctx);
    tsys_model_desc d = tc_model_desc();
    tsys_model *m[3];
    if (!tc_three_models(ctx, &d, m)) return;
    int n = tsys_model_num_tensors(m[0]);
    tsys_optim *o[3];
    for (int k = 0; k < 3; k++) {
        o[k] = tsys_adamw_new(ctx, tsys_model_params(m[k]), n, NULL);
        tsys_optim_keep_lowp(o[k], TSYS_BF16);
        if (k) TEST_CHECK(tsys_model_set_grad_dtype(m[k], TSYS_BF16) == TSYS_OK, "set_grad_dtype: %s", tsys_ctx_last_error(ctx));
    }
    tsys_tensor *ids = tc_ids(ctx, TSYS_CUDA, 2, 32, d.vocab_size, 1), *tg = tc_ids(ctx, TSYS_CUDA, 2, 32, d.vocab_size, 2);
    for (int k = 0; k < 2; k++) {   // the gradients alone first
        tsys_autocast_begin(ctx, TSYS_BF16);
        tsys_tensor *logits = tsys_model_forward(m[k], ids), *loss = tsys_cross_entropy(ctx, logits, tg);
        tsys_autocast_end(ctx);
        tsys_backward(ctx, loss);
        tsys_tensor_release(logits); tsys_tensor_release(loss);
    }
    int wrong_dtype = 0, outside = 0, inexact = 0;
    int64_t total = 0;
    for (int i = 0; i < n; i++) {
        tsys_tensor *p0 = tsys_model_params(m[0])[i], *p1 = tsys_model_params(m[1])[i];
        bool linear = p0->ndim == 2 && i > 0;
        wrong_dtype += !p1->grad || p1->grad->dtype != (linear ? TSYS_BF16 : TSYS_F32);
        if (!p0->grad || !p1->grad) continue;
        tsys_tensor *r = tsys_tensor_new(ctx, p1->grad->dtype, TSYS_CUDA, p0->ndim, p0->shape);
        tsys_tensor_cast_from(ctx, r, p0->grad);
        float *a = test_read(ctx, r), *b = test_read(ctx, p1->grad);
        for (int64_t e = 0; a && b && e < tsys_tensor_numel(r); e++) { outside += !tc_within_bf16_step(a[e], b[e]); inexact += a[e] != b[e]; }
        total += tsys_tensor_numel(r);
        free(a); free(b);
        tsys_tensor_release(r);
    }
    TEST_CHECK(wrong_dtype == 0, "%d gradients are not in the dtype asked for", wrong_dtype);
    TEST_CHECK(outside == 0, "%d of %lld gradient elements are more than one bf16 step from the rounded fp32 gradient (%d not equal)", outside, (long long)total, inexact);
    for (int k = 0; k < 2; k++) tsys_optim_release_grads(o[k]);
    float ref[4], eager[4], graph[4] = {0, 0, 0, 0};
    for (int i = 0; i < 4; i++) ref[i] = tc_lowp_loss(ctx, tc_lowp_step(ctx, m[0], o[0], ids, tg, TSYS_BF16, false));
    for (int i = 0; i < 4; i++) eager[i] = tc_lowp_loss(ctx, tc_lowp_step(ctx, m[1], o[1], ids, tg, TSYS_BF16, false));
    graph[0] = tc_lowp_loss(ctx, tc_lowp_step(ctx, m[2], o[2], ids, tg, TSYS_BF16, false));
    tsys_cuda_graph *gr = NULL;
    TEST_CHECK(tsys_cuda_graph_begin(ctx) == TSYS_OK, "begin: %s", tsys_ctx_last_error(ctx));
    tsys_tensor *loss = tc_lowp_step(ctx, m[2], o[2], ids, tg, TSYS_BF16, false);
    TEST_CHECK(tsys_cuda_graph_end(ctx, &gr) == TSYS_OK && gr && loss, "capture: %s", tsys_ctx_last_error(ctx));
    for (int i = 1; i < 4 && gr && loss; i++) { tsys_cuda_graph_replay(ctx, gr); graph[i] = tsys_item(ctx, loss); }
    tsys_sync(ctx, TSYS_CUDA);
    for (int i = 0; i < 4; i++)
        TEST_CHECK(fabsf(eager[i] - ref[i]) <= 1e-3f * fabsf(ref[i]) && graph[i] == eager[i], "step %d: loss %.9g with fp32 gradients, %.9g with bf16 ones eager, %.9g captured",
                   i, ref[i], eager[i], graph[i]);
    const int differ = tc_params_differ(ctx, m[1], m[2]);
    TEST_CHECK(differ == 0, "%d parameter tensors of the captured run differ from the eager one", differ);
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    tsys_cuda_graph_free(gr);
    tsys_tensor_release(loss); tsys_tensor_release(ids); tsys_tensor_release(tg);
    for (int k = 0; k < 3; k++) { tsys_optim_free(o[k]); tsys_model_free(m[k]); }
}

// Two contexts, each with its own backend state, used side by side.
TSYS_TEST(cuda_two_contexts) {
    TC_CTX(ctx);
    tsys_ctx *c2 = tsys_ctx_new(NULL);
    TEST_CHECK(tsys_cuda_init(c2, 0) == TSYS_OK, "second context: %s", tsys_ctx_last_error(c2));
    TEST_CHECK(tsys_cuda_stream(c2) != tsys_cuda_stream(ctx), "contexts share a stream");
    int64_t n = 1000;
    tsys_tensor *a = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 1, &n), *b = tsys_tensor_new(c2, TSYS_F32, TSYS_CUDA, 1, &n);
    tsys_tensor_fill(ctx, a, 2.0f); tsys_tensor_fill(c2, b, 3.0f);
    tsys_tensor *sa = tsys_sum(ctx, a), *sb = tsys_sum(c2, b);
    TEST_CHECK(sa && sb && tsys_item(ctx, sa) == 2000.0f && tsys_item(c2, sb) == 3000.0f, "sums: %s / %s", tsys_ctx_last_error(ctx), tsys_ctx_last_error(c2));
    tsys_tensor_release(sa); tsys_tensor_release(sb); tsys_tensor_release(a); tsys_tensor_release(b);
    tsys_cuda_shutdown(c2);
    tsys_ctx_free(c2);
}

// ---- the kernel contract, bad ids, events -------------------------------------------------------

// The fused linear + cross-entropy on the GPU against linear + cross_entropy on the GPU (the ops the CPU tests
// hold to finite differences and to the fused op there): one chunk runs the same kernels on the same values,
// so the same bits; chunks of 48 of 300 rows sum the loss and d w chunk by chunk.
static void tc_lce_case(tsys_dtype autocast, int64_t chunk, bool bitwise, double tol) {
    TC_CTX(ctx);
    const int64_t R = 300, d = 64, V = 1000;
    int64_t sx[2] = {R, d}, sw[2] = {V, d}, st[1] = {R};
    tsys_tensor *xh = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 2, sx), *wh = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 2, sw), *th = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 1, st);
    tsys_tensor_randn(ctx, xh, 1.0f); tsys_tensor_randn(ctx, wh, 0.2f); tsys_tensor_randint(ctx, th, V);
    tsys_tensor *x = tsys_tensor_to(ctx, xh, TSYS_CUDA), *w = tsys_tensor_to(ctx, wh, TSYS_CUDA), *t = tsys_tensor_to(ctx, th, TSYS_CUDA);
    tsys_tensor_set_requires_grad(x, true); tsys_tensor_set_requires_grad(w, true);
    float *out[2][3];
    test_lce_paths(ctx, x, w, t, autocast, chunk, 1.0f, out);
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    const char *names[3] = {"loss", "d x", "d w"};
    const int64_t n[3] = {1, R * d, V * d};
    for (int k = 0; k < 3; k++) {
        float *got = out[1][k], *want = out[0][k];
        TEST_CHECK(got && want, "%s missing: %s", names[k], tsys_ctx_last_error(ctx));
        if (!got || !want) continue;
        const double rel = test_max_rel(got, want, n[k]);
        if (bitwise) TEST_CHECK(!memcmp(got, want, sizeof(float) * (size_t)n[k]), "%s (%s, one chunk): not the unfused bits (%.2e)", names[k], tsys_dtype_name(autocast), rel);
        else TEST_CHECK(rel <= tol, "%s (%s, chunk %lld): %.2e from the unfused, tolerance %.0e", names[k], tsys_dtype_name(autocast), (long long)chunk, rel, tol);
    }
    for (int k = 0; k < 6; k++) free(out[k / 3][k % 3]);
    tsys_tensor *all[6] = {xh, wh, th, x, w, t};
    for (int i = 0; i < 6; i++) tsys_tensor_release(all[i]);
}
TSYS_TEST(cuda_linear_cross_entropy) {
    tc_lce_case(TSYS_F32, 300, true, 0);
    tc_lce_case(TSYS_BF16, 300, true, 0);
    tc_lce_case(TSYS_F32, 48, false, 1e-5);
    tc_lce_case(TSYS_BF16, 48, false, 2e-2);
}

// AdamW inside the weight-gradient product (TSYS_K_LINEAR_ADAMW) against the CPU's (the product, then ADAMW):
// p, m, v and the copy after the update, for shapes the fused Hopper kernel takes (whole tiles, ragged tiles
// and positions) and one it leaves to the two-launch path (dimensions under a tile), with f32 and 16-bit
// gradients; which path ran is read off the allocator (the two-launch path makes the gradient, the fused
// kernel allocates nothing); run twice, the fused kernel gives the same bits.
static void tc_linear_adamw_case(int64_t rows, int64_t d_out, int64_t d_in, tsys_dtype dt, tsys_dtype gdt, bool copies, bool fused) {
    TC_CTX(ctx);
    const tsys_backend *gpu = tsys_ctx_backend(ctx, TSYS_CUDA), *cpu = tsys_ctx_backend(ctx, TSYS_CPU);
    int64_t sdy[2] = {rows, d_out}, sx[2] = {rows, d_in}, sp[2] = {d_out, d_in}, one = 1, five = 5;
    tsys_tensor *dy = tc_rand(ctx, dt, 2, sdy, 0.5f), *x = tc_rand(ctx, dt, 2, sx, 1.0f);
    tsys_tensor *p0 = tc_rand(ctx, TSYS_F32, 2, sp, 1.0f), *m0 = tc_rand(ctx, TSYS_F32, 2, sp, 0.5f), *v0 = tc_rand(ctx, TSYS_F32, 2, sp, 1.0f);
    tsys_kargs sq; memset(&sq, 0, sizeof sq); sq.t[0] = sq.t[1] = sq.t[2] = v0;   // v >= 0
    gpu->kernel(ctx, TSYS_K_MUL, &sq);
    tsys_tensor *step = tsys_tensor_from_data(ctx, TSYS_I64, TSYS_CUDA, 1, &one, &five);
    tsys_tensor *dev[3][4], *host[4];   // p, m, v, copy: two GPU runs, the CPU's
    for (int r = 0; r < 2; r++) {
        dev[r][0] = tc_adamw_clone(ctx, p0); dev[r][1] = tc_adamw_clone(ctx, m0); dev[r][2] = tc_adamw_clone(ctx, v0);
        dev[r][3] = copies ? tsys_tensor_new(ctx, TSYS_BF16, TSYS_CUDA, 2, sp) : NULL;
    }
    tsys_tensor *hdy = tsys_tensor_to(ctx, dy, TSYS_CPU), *hx = tsys_tensor_to(ctx, x, TSYS_CPU), *hstep = tsys_tensor_to(ctx, step, TSYS_CPU);
    host[0] = tsys_tensor_to(ctx, p0, TSYS_CPU); host[1] = tsys_tensor_to(ctx, m0, TSYS_CPU); host[2] = tsys_tensor_to(ctx, v0, TSYS_CPU);
    host[3] = copies ? tsys_tensor_new(ctx, TSYS_BF16, TSYS_CPU, 2, sp) : NULL;
    char what[128];
    snprintf(what, sizeof what, "%lld x %lld x %lld, %s, %s gradient%s", (long long)rows, (long long)d_out, (long long)d_in, tsys_dtype_name(dt), tsys_dtype_name(gdt),
             copies ? ", copies" : "");
    for (int r = 0; r < 3; r++) {
        tsys_kargs a; memset(&a, 0, sizeof a);
        tsys_tensor **t = r < 2 ? dev[r] : host;
        a.t[0] = t[0]; a.t[1] = t[1]; a.t[2] = t[2]; a.t[3] = t[3];
        a.t[4] = r < 2 ? dy : hdy; a.t[5] = r < 2 ? x : hx; a.t[6] = r < 2 ? step : hstep;
        a.i[0] = gdt; a.f[0] = 1e-2f; a.f[1] = 0.9f; a.f[2] = 0.999f; a.f[3] = 1e-8f; a.f[4] = 0.01f;
        tsys_sync(ctx, TSYS_CUDA);
        int64_t allocs = tsys_mem_stats_get(ctx, TSYS_CUDA).num_allocs;
        TEST_CHECK((r < 2 ? gpu : cpu)->kernel(ctx, TSYS_K_LINEAR_ADAMW, &a) == TSYS_OK, "%s: run %d: %s", what, r, tsys_ctx_last_error(ctx));
        if (r == 0) {
            int64_t made = tsys_mem_stats_get(ctx, TSYS_CUDA).num_allocs - allocs;
            TEST_CHECK(fused ? made == 0 : made == 1, "%s: %lld allocations: the %s path was expected", what, (long long)made, fused ? "fused" : "two-launch");
        }
    }
    const char *names[4] = {"p", "m", "v", "copy"};
    // a 16-bit gradient rounded the other way at one element moves m, v by an ulp of it and p by ~lr x 1e-3
    const double tol[4] = {gdt == TSYS_F32 ? 1e-5 : 1e-4, gdt == TSYS_F32 ? 1e-5 : 2e-3, gdt == TSYS_F32 ? 1e-5 : 2e-3, 8e-3};
    for (int j = 0; j < 4; j++) {
        if (!host[j]) continue;
        float *g0 = test_read(ctx, dev[0][j]), *g1 = test_read(ctx, dev[1][j]), *want = test_read(ctx, host[j]);
        float *start = j < 3 ? test_read(ctx, j == 0 ? p0 : j == 1 ? m0 : v0) : NULL;
        const int64_t n = d_out * d_in;
        TEST_CHECK(g0 && g1 && want, "%s: read back %s", what, names[j]);
        if (g0 && g1 && want) {
            double rel = test_max_rel(g0, want, n);
            TEST_CHECK(rel <= tol[j], "%s: %s %.2e from the CPU's, tolerance %.0e", what, names[j], rel, tol[j]);
            TEST_CHECK(memcmp(g0, g1, sizeof(float) * (size_t)n) == 0, "%s: %s differs between two runs", what, names[j]);
            const double moved = start ? test_max_rel(start, want, n) : 1.0;   // the update is far larger than the GPU's distance to the CPU
            TEST_CHECK(moved > 0 && moved > 10 * rel, "%s: the update moved %s by %.2e, the GPU is %.2e from the CPU", what, names[j], moved, rel);
        }
        free(g0); free(g1); free(want); free(start);
    }
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s: %s", what, tsys_ctx_last_error(ctx));
    tsys_tensor *all[] = {dy, x, p0, m0, v0, step, hdy, hx, hstep};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tsys_tensor_release(all[i]);
    for (int j = 0; j < 4; j++) { tsys_tensor_release(dev[0][j]); tsys_tensor_release(dev[1][j]); tsys_tensor_release(host[j]); }
    tsys_ctx_clear_error(ctx);
}
TSYS_TEST(cuda_linear_adamw_matches_cpu) {
    tc_linear_adamw_case(256, 256, 384, TSYS_BF16, TSYS_BF16, true, true);
    tc_linear_adamw_case(256, 256, 384, TSYS_BF16, TSYS_F32, false, true);
    tc_linear_adamw_case(100, 200, 136, TSYS_BF16, TSYS_BF16, true, true);   // ragged tiles and positions
    tc_linear_adamw_case(1024, 640, 256, TSYS_F16, TSYS_F16, false, true);
    tc_linear_adamw_case(64, 48, 40, TSYS_BF16, TSYS_BF16, true, false);     // under a tile: two launches
    tc_linear_adamw_case(32, 24, 16, TSYS_F32, TSYS_F32, false, false);
}

// Training with AdamW in the weight-gradient products (TSYS_OPTIM_FUSE_UPDATE) against the ordinary step,
// bf16 autocast with kept copies and bf16 gradients: the losses stay within the rounding of the products'
// other order of sums, the model trains, and one eager step then a captured one replayed three times give
// the eager fused steps' parameters bit for bit.
static float tc_fused_step(tsys_ctx *ctx, tsys_model *m, tsys_optim *o, tsys_tensor *ids, tsys_tensor *tg, bool fused) {
    tsys_autocast_begin(ctx, TSYS_BF16);
    tsys_tensor *logits = tsys_model_forward(m, ids), *l = tsys_cross_entropy(ctx, logits, tg);
    tsys_autocast_end(ctx);
    if (fused) tsys_optim_overlap_begin_ex(o, TSYS_OPTIM_FUSE_UPDATE);
    tsys_backward(ctx, l);
    if (fused) tsys_optim_overlap_end(o); else tsys_optim_step(o);
    tsys_optim_release_grads(o);
    float v = tsys_cuda_capturing(ctx) ? 0.0f : tsys_item(ctx, l);
    tsys_tensor_release(logits); tsys_tensor_release(l);
    return v;
}
TSYS_TEST(cuda_fused_update_trains_as_the_step) {
    TC_CTX(ctx);
    tsys_model_desc d = tc_model_desc();
    d.d_model = 128; d.d_ff = 384; d.num_heads = 2; d.context_length = 64;
    tsys_model *m[3];
    tsys_optim *o[3];
    bool made = true;
    for (int k = 0; k < 3; k++) {
        m[k] = tsys_model_new(ctx, &d, TSYS_CUDA, 5);
        o[k] = m[k] ? tsys_adamw_new(ctx, tsys_model_params(m[k]), tsys_model_num_tensors(m[k]), NULL) : NULL;
        made = made && o[k] && tsys_optim_keep_lowp(o[k], TSYS_BF16) == TSYS_OK && tsys_model_set_grad_dtype(m[k], TSYS_BF16) == TSYS_OK;
    }
    tsys_tensor *ids = tc_ids(ctx, TSYS_CUDA, 4, 64, d.vocab_size, 1), *tg = tc_ids(ctx, TSYS_CUDA, 4, 64, d.vocab_size, 2);
    TEST_CHECK(made && ids && tg, "setup: %s", tsys_ctx_last_error(ctx));
    if (!made || !ids || !tg) return;
    float loss[2][4];
    for (int step = 0; step < 4; step++) {
        loss[0][step] = tc_fused_step(ctx, m[0], o[0], ids, tg, false);
        loss[1][step] = tc_fused_step(ctx, m[1], o[1], ids, tg, true);
        TEST_CHECK(fabsf(loss[0][step] - loss[1][step]) <= 2e-3f * fabsf(loss[0][step]), "step %d: loss %.6f fused, %.6f ordinary", step, loss[1][step], loss[0][step]);
    }
    TEST_CHECK(loss[1][3] < loss[1][0] - 0.01f, "the fused steps did not train: loss %.6f -> %.6f", loss[1][0], loss[1][3]);
    tc_fused_step(ctx, m[2], o[2], ids, tg, true);
    tsys_cuda_graph *gr = NULL;
    TEST_CHECK(tsys_cuda_graph_begin(ctx) == TSYS_OK, "begin: %s", tsys_ctx_last_error(ctx));
    tc_fused_step(ctx, m[2], o[2], ids, tg, true);
    TEST_CHECK(tsys_cuda_graph_end(ctx, &gr) == TSYS_OK && gr, "capture: %s", tsys_ctx_last_error(ctx));
    for (int i = 0; gr && i < 3; i++) tsys_cuda_graph_replay(ctx, gr);
    tsys_sync(ctx, TSYS_CUDA);
    const int differ = tc_params_differ(ctx, m[1], m[2]);
    TEST_CHECK(differ == 0, "%d parameter tensors differ between the eager and the captured fused steps", differ);
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    tsys_cuda_graph_free(gr);
    tsys_tensor_release(ids); tsys_tensor_release(tg);
    for (int k = 0; k < 3; k++) { tsys_optim_free(o[k]); tsys_model_free(m[k]); }
    tsys_ctx_clear_error(ctx);
}

// Every kernel of the TSYS_KERNELS table has a CUDA case that runs (the cases above compare them
// with the CPU): a kernel added to the table without one fails here.
TSYS_TEST(cuda_every_kernel_runs) {
    TC_CTX(ctx);
    test_kernel_count c;
    tsys_status st = test_run_every_kernel(ctx, TSYS_CUDA, &c);
    TEST_CHECK(st == TSYS_OK, "workload failed: %s", tsys_ctx_last_error(ctx));
    for (int k = 0; k < TSYS_K_COUNT; k++)
        TEST_CHECK(c.ok[k] > 0, "kernel %s never ran on cuda", tsys_kernel_name((tsys_kernel)k));
    tsys_ctx_clear_error(ctx);
}

// Out-of-range ids on the GPU: nothing out of bounds is read or written (the kernels skip them), and
// the first one becomes the context's error at the next synchronization, naming the op and the value.
TSYS_TEST(cuda_bad_ids_are_reported_at_the_next_sync) {
    TC_CTX(ctx);
    int64_t sw[2] = {10, 8}, sid[1] = {4};
    tsys_tensor *w = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 2, sw);
    tsys_tensor_fill(ctx, w, 1.0f);
    tsys_tensor_set_requires_grad(w, true);
    const int64_t bad[3] = {10, -1, (int64_t)1 << 33};
    for (int b = 0; b < 3; b++) {
        int64_t vals[4] = {1, 2, 3, bad[b]};
        tsys_tensor *ids = tsys_tensor_from_data(ctx, TSYS_I64, TSYS_CUDA, 1, sid, vals);
        tsys_tensor *y = tsys_embedding(ctx, w, ids);
        tsys_status st = tsys_sync(ctx, TSYS_CUDA);
        char want[64];
        snprintf(want, sizeof want, "token id %lld at position 3", (long long)bad[b]);
        TEST_CHECK(st == TSYS_ERR_INVALID_ARGS && strstr(tsys_ctx_last_error(ctx), want) && strstr(tsys_ctx_last_error(ctx), "embedding"),
                   "embedding id %lld: status %d, '%s'", (long long)bad[b], (int)st, tsys_ctx_last_error(ctx));
        tsys_ctx_clear_error(ctx);
        tsys_tape_clear(ctx);
        tsys_tensor_release(y); tsys_tensor_release(ids);
    }
    // cross-entropy: forward and backward meet the bad target; the error comes with the loss read
    int64_t sl[2] = {4, 10};
    tsys_tensor *logits = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 2, sl);
    tsys_tensor_randn(ctx, logits, 1);
    tsys_tensor_set_requires_grad(logits, true);
    int64_t tv[4] = {0, 9, 10, 2};
    tsys_tensor *tg = tsys_tensor_from_data(ctx, TSYS_I64, TSYS_CUDA, 1, sid, tv);
    tsys_tensor *loss = tsys_cross_entropy(ctx, logits, tg);
    float l = tsys_item(ctx, loss);
    (void)l;
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_ERR_INVALID_ARGS && strstr(tsys_ctx_last_error(ctx), "target 10 at position 2"),
               "cross-entropy: '%s'", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    tsys_tape_clear(ctx);
    TEST_CHECK(tsys_sync(ctx, TSYS_CUDA) == TSYS_OK, "the fault was not cleared after it was reported: %s", tsys_ctx_last_error(ctx));
    tsys_tensor_release(loss); tsys_tensor_release(tg); tsys_tensor_release(logits); tsys_tensor_release(w);
    tsys_ctx_clear_error(ctx);
}

// Events time GPU work; work on the side stream is ordered against the compute stream by an event.
TSYS_TEST(cuda_events_and_the_side_stream) {
    TC_CTX(ctx);
    int64_t n = (int64_t)1 << 26;   // 256 MB: a fill takes ~0.1 ms
    tsys_tensor *x = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 1, &n), *y = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 1, &n);
    tsys_event e0, e1, side_done;
    memset(&e0, 0, sizeof e0); memset(&e1, 0, sizeof e1); memset(&side_done, 0, sizeof side_done);
    tsys_event_record(ctx, TSYS_CUDA, TSYS_STREAM_COMPUTE, &e0);
    for (int i = 0; i < 10; i++) tsys_tensor_fill(ctx, x, (float)i);
    tsys_event_record(ctx, TSYS_CUDA, TSYS_STREAM_COMPUTE, &e1);
    double ms = tsys_event_elapsed_ms(ctx, &e0, &e1);
    TEST_CHECK(ms > 0.05 && ms < 1000, "10 fills of 256 MB took %g ms by the events", ms);
    // side stream: y = 3 there, then the compute stream waits and scales it; without the wait the
    // compute stream could read y before the side stream wrote it
    tsys_tensor_fill(ctx, y, 0.0f);
    tsys_event y_zero;
    memset(&y_zero, 0, sizeof y_zero);
    tsys_event_record(ctx, TSYS_CUDA, TSYS_STREAM_COMPUTE, &y_zero);
    tsys_event_wait(ctx, &y_zero, TSYS_STREAM_SIDE);   // the side stream writes y after the zero fill
    tsys_stream prev = tsys_set_stream(ctx, TSYS_CUDA, TSYS_STREAM_SIDE);
    TEST_CHECK(prev == TSYS_STREAM_COMPUTE, "previous stream %d", (int)prev);
    for (int i = 0; i < 5; i++) tsys_tensor_fill(ctx, y, 3.0f);
    tsys_event_record(ctx, TSYS_CUDA, TSYS_STREAM_SIDE, &side_done);
    TEST_CHECK(tsys_set_stream(ctx, TSYS_CUDA, prev) == TSYS_STREAM_SIDE, "set_stream did not return the side stream");
    tsys_event_wait(ctx, &side_done, TSYS_STREAM_COMPUTE);
    tsys_tensor *s = tsys_sum(ctx, y);
    float v = tsys_item(ctx, s);
    TEST_CHECK(fabs(v - 3.0 * (double)n) <= 1e-5 * 3.0 * (double)n, "sum after the side stream %g, expected %g: %s", v, 3.0f * (float)n, tsys_ctx_last_error(ctx));
    tsys_event_release(ctx, &e0); tsys_event_release(ctx, &e1); tsys_event_release(ctx, &side_done); tsys_event_release(ctx, &y_zero);
    tsys_tensor_release(s); tsys_tensor_release(x); tsys_tensor_release(y);
    tsys_ctx_clear_error(ctx);
}

static void tc_count_op(tsys_ctx *ctx, const char *name, tsys_trace_kind kind, void *user) { (void)ctx; (void)name; (void)kind; (*(int *)user)++; }

// NVTX ranges come through the trace hooks and chain to the hooks that were there before.
TSYS_TEST(cuda_nvtx_through_the_trace_hooks) {
    TC_CTX(ctx);
    int ops = 0;
    tsys_trace_hooks mine;
    memset(&mine, 0, sizeof mine);
    mine.op_begin = tc_count_op; mine.user = &ops;
    tsys_trace_hooks before = tsys_ctx_set_trace_hooks(ctx, &mine);
    TEST_CHECK(tsys_cuda_set_nvtx(ctx, true) == TSYS_OK && tsys_cuda_nvtx(ctx), "%s", tsys_ctx_last_error(ctx));
    int64_t n = 64;
    tsys_tensor *x = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 1, &n);
    tsys_tensor_fill(ctx, x, 1.0f);
    tsys_trace_begin(ctx, "a range");
    tsys_tensor *y = tsys_silu(ctx, x);
    tsys_trace_end(ctx);
    TEST_CHECK(ops == 2, "the chained hook saw %d begins, expected 2 (range, silu)", ops);
    TEST_CHECK(tsys_cuda_set_nvtx(ctx, false) == TSYS_OK && !tsys_cuda_nvtx(ctx), "nvtx off");
    tsys_trace_hooks now = tsys_ctx_set_trace_hooks(ctx, &before);
    TEST_CHECK(now.op_begin == tc_count_op && now.user == &ops, "turning NVTX off did not give back the previous hooks");
    tsys_tensor_release(x); tsys_tensor_release(y);
    tsys_ctx_clear_error(ctx);
}

// ---- speed (not a correctness check: prints what the memory-bound kernels reach) ---------------
// GB/s = the fewest bytes each kernel must move / median time; compare with the D2D copy line.

// Median of 5 timings of `iters` launches of one kernel (or GEMM when g != NULL), in microseconds.
static double tc_time(tsys_ctx *ctx, tsys_kernel k, const tsys_kargs *a, const tsys_gemm_args *g, int iters) {
    const tsys_backend *b = tsys_ctx_backend(ctx, TSYS_CUDA);
    tsys_event e0, e1;
    memset(&e0, 0, sizeof e0); memset(&e1, 0, sizeof e1);
    double t[5];
    for (int i = 0; i < 2; i++) { if (g) b->gemm(ctx, g); else b->kernel(ctx, k, a); }
    for (int r = 0; r < 5; r++) {
        tsys_event_record(ctx, TSYS_CUDA, TSYS_STREAM_COMPUTE, &e0);
        for (int i = 0; i < iters; i++) { if (g) b->gemm(ctx, g); else b->kernel(ctx, k, a); }
        tsys_event_record(ctx, TSYS_CUDA, TSYS_STREAM_COMPUTE, &e1);
        t[r] = 1000.0 * tsys_event_elapsed_ms(ctx, &e0, &e1) / iters;
    }
    tsys_event_release(ctx, &e0); tsys_event_release(ctx, &e1);
    for (int i = 0; i < 5; i++) for (int j = i + 1; j < 5; j++) if (t[j] < t[i]) { double x = t[i]; t[i] = t[j]; t[j] = x; }
    return t[2];
}

// The profiler on CUDA: every launch gets a device time (CUPTI, else events), kernel counts per phase
// are the same in two identical steps, and the device times are real (a 8192^2 GEMM takes > 0.1 ms).
TSYS_TEST(cuda_profiler_device_times) {
    TC_CTX(ctx);
    tsys_model_desc d = tc_model_desc();
    tsys_model *m = tsys_model_new(ctx, &d, TSYS_CUDA, 5);
    tsys_optim *opt = tsys_adamw_new(ctx, tsys_model_params(m), tsys_model_num_tensors(m), NULL);
    tsys_tensor *ids = tc_ids(ctx, TSYS_CUDA, 2, d.context_length, d.vocab_size, 3);
    printf("(cupti %s) ", tsys_cuda_cupti_available() ? "loaded" : "missing: events");
    double counts[3][3];   // the first step differs (lazy zero-grad has nothing to skip yet): compare the next two
    const char *phases[3] = {"forward", "backward", "optimizer"};
    for (int rep = 0; rep < 3; rep++) {
        tsys_profiler *p = tsys_profiler_begin(ctx);
        tsys_trace_begin(ctx, "forward");
        tsys_tensor *logits = tsys_model_forward(m, ids), *loss = tsys_cross_entropy(ctx, logits, ids);
        tsys_trace_end(ctx);
        tsys_trace_begin(ctx, "backward");
        tsys_backward(ctx, loss);
        tsys_trace_end(ctx);
        tsys_trace_begin(ctx, "optimizer");
        tsys_optim_step(opt);
        tsys_optim_zero_grad(opt);
        tsys_trace_end(ctx);
        TEST_CHECK(tsys_profiler_end(p) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
        int untimed = 0;
        for (size_t i = 0; i < p->num_kernels; i++) untimed += p->kernels[i].dev == TSYS_CUDA && !p->kernels[i].timed;
        TEST_CHECK(untimed == 0, "%d of %zu launches got no device time", untimed, p->num_kernels);
        for (int ph = 0; ph < 3; ph++) {
            int n = 0;
            for (size_t i = 0; i < p->num_kernels; i++) n += p->kernels[i].phase >= 0 && !strcmp(p->names[p->phases[p->kernels[i].phase]], phases[ph]);
            counts[rep][ph] = n;
        }
        if (rep == 2) {
            tsys_profiler_print_kernels(p, stdout, 6);
            // the trace: a flow from each op to each of its kernels on the CUDA track, the ops' input shapes
            char path[] = "/tmp/tsys_cuda_trace_XXXXXX";
            int fd = mkstemp(path);
            if (fd >= 0) close(fd);
            TEST_CHECK(fd >= 0 && tsys_profiler_write_trace(p, path) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
            FILE *f = fopen(path, "r");
            char line[4096];
            size_t starts = 0, finishes = 0, in_ops = 0, dims = 0, late = 0;
            while (f && fgets(line, sizeof(line), f)) {
                starts += strstr(line, "\"ph\": \"s\"") != NULL;
                if (strstr(line, "\"ph\": \"f\"")) { finishes++; late += !strstr(line, "\"bp\": \"e\"") || !strstr(line, "\"pid\": 2, \"tid\": 2}"); }
                dims += strstr(line, "\"name\": \"linear\", \"cat\": \"op\"") && strstr(line, "\"Input Dims\": [[2, ");
            }
            if (f) fclose(f);
            remove(path);
            for (size_t i = 0; i < p->num_kernels; i++) in_ops += p->kernels[i].span >= 0;
            TEST_CHECK(starts == in_ops && finishes == in_ops && in_ops > 0 && late == 0, "%zu flow starts, %zu finishes (%zu not on the CUDA track), %zu kernels launched in ops",
                       starts, finishes, late, in_ops);
            TEST_CHECK(dims > 0, "no linear slice carries its input dims");
            // every flow starts at its launch, inside the slice of the op that launched the kernel
            for (size_t i = 0; i < p->num_kernels; i++) {
                const tsys__prof_kernel *k = &p->kernels[i];
                if (k->span < 0) continue;
                const tsys__prof_span *sp = &p->spans[k->span];
                TEST_CHECK(k->t0 >= sp->t0 && k->t0 <= sp->t1, "launch %llu at %.3f us outside its op [%.3f, %.3f]", (unsigned long long)k->seq, k->t0, sp->t0, sp->t1);
                if (k->t0 < sp->t0 || k->t0 > sp->t1) break;
            }
        }
        tsys_profiler_free(p);
        tsys_tensor_release(logits); tsys_tensor_release(loss);
    }
    for (int ph = 0; ph < 3; ph++)
        TEST_CHECK(counts[1][ph] == counts[2][ph] && counts[1][ph] > 0, "%s: %g then %g kernels", phases[ph], counts[1][ph], counts[2][ph]);
    int64_t sq[2] = {8192, 8192};
    tsys_tensor *a = tc_rand(ctx, TSYS_BF16, 2, sq, 1), *b = tc_rand(ctx, TSYS_BF16, 2, sq, 1);
    tsys_profiler *p = tsys_profiler_begin(ctx);
    tsys_no_grad_begin(ctx);
    tsys_tensor *c = tsys_matmul(ctx, a, b, false);
    tsys_no_grad_end(ctx);
    tsys_profiler_end(p);
    double ms = tsys_profiler_kernel_ms(p, NULL);
    TEST_CHECK(ms > 0.3 && ms < 50, "an 8192^3 bf16 GEMM took %g ms of device time", ms);
    tsys_profiler_free(p);
    tsys_tensor_release(a); tsys_tensor_release(b); tsys_tensor_release(c);
    tsys_tensor_release(ids);
    tsys_optim_free(opt);
    tsys_model_free(m);
    tsys_ctx_clear_error(ctx);
}

// The first-principles prediction against the tracker on CUDA (the library's workspace aside, which
// the prediction leaves out), and the caching allocator's free blocks on the timeline.
static void tc_mem_case(const char *attn, tsys_dtype dt, bool backward, bool optimizer) {
    TC_CTX(ctx);
    test_mem_result r;
    tsys_status st = test_mem_step(ctx, TSYS_CUDA, attn, dt, backward, optimizer, &r);
    TEST_CHECK(st == TSYS_OK, "%s %s: %s", attn, tsys_dtype_name(dt), tsys_ctx_last_error(ctx));
    TEST_CHECK(test_rel_diff(r.peak - r.workspace, r.predicted.peak) <= 0.10, "%s %s backward %d: peak %lld less workspace %lld, predicted %lld", attn,
               tsys_dtype_name(dt), (int)backward, (long long)r.peak, (long long)r.workspace, (long long)r.predicted.peak);
    if (backward)
        TEST_CHECK(test_rel_diff(r.saved, r.predicted.saved_per_layer * r.predicted.num_layers + r.predicted.saved_outside) <= 0.10,
                   "%s %s: the tape kept at most %lld bytes, predicted %lld", attn, tsys_dtype_name(dt), (long long)r.saved,
                   (long long)(r.predicted.saved_per_layer * r.predicted.num_layers + r.predicted.saved_outside));
    TEST_CHECK(r.allocs > 20 && r.unpaired_frees == 0 && r.bad_shapes == 0 && r.odd_moves == 0, "%d allocations, %d frees without one, %d without a shape, %d unpaired moves",
               r.allocs, r.unpaired_frees, r.bad_shapes, r.odd_moves);
}
TSYS_TEST(cuda_memory_prediction) {
    tc_mem_case("naive", TSYS_F32, true, true);
    tc_mem_case("flash", TSYS_BF16, true, true);
    tc_mem_case("naive", TSYS_BF16, false, false);
}
TSYS_TEST(cuda_memory_events_carry_the_cache) {
    TC_CTX(ctx);
    int64_t shape[1] = {1 << 20};
    tsys_mem_clear_events(ctx);
    tsys_mem_record_events(ctx, true);
    tsys_tensor *a = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 1, shape);
    tsys_tensor_release(a);   // its block goes to the cache, not back to the device
    tsys_tensor *b = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 1, shape);
    tsys_mem_record_events(ctx, false);
    size_t n;
    const tsys_mem_event *ev = tsys_mem_events(ctx, &n);
    TEST_CHECK(n == 3 && ev[1].action == TSYS_MEM_EV_FREE && ev[1].cached >= (int64_t)(4 << 20) && ev[2].cached == ev[1].cached - (int64_t)(4 << 20),
               "%zu events; cached after the free %lld, after the reuse %lld", n, n > 1 ? (long long)ev[1].cached : -1, n > 2 ? (long long)ev[2].cached : -1);
    tsys_cuda_mem_info mi = tsys_cuda_mem_info_get(ctx);
    TEST_CHECK(n == 3 && ev[2].cached == (int64_t)mi.cached_bytes, "the last event's cached %lld, the allocator's %zu", n == 3 ? (long long)ev[2].cached : -1, mi.cached_bytes);
    tsys_tensor_release(b);
    tsys_mem_clear_events(ctx);
}

TSYS_TEST(perf_kernels) {
    TC_CTX(ctx);
    printf("\n");
    {   // device-to-device copy: the bandwidth ceiling
        int64_t n = (int64_t)256 << 20;
        tsys_tensor *x = tc_rand(ctx, TSYS_F32, 1, &n, 1), *y = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 1, &n);
        tsys_kargs a; memset(&a, 0, sizeof a); a.t[0] = y; a.t[1] = x;
        double us = tc_time(ctx, TSYS_K_CAST, &a, NULL, 10);
        printf("    %-34s %9.1f us %8.0f GB/s\n", "copy f32 (cast kernel) 1 GiB", us, 2.0 * 4 * n / us / 1e3);
        tsys_tensor_release(x); tsys_tensor_release(y);
    }
    {   // AdamW over 100M fp32 parameters: reads p g m v, writes p m v
        int64_t n = 100 << 20, one = 1;
        tsys_tensor *p = tc_rand(ctx, TSYS_F32, 1, &n, 1), *g = tc_rand(ctx, TSYS_F32, 1, &n, 1), *m = tc_rand(ctx, TSYS_F32, 1, &n, 0.1f), *v = tc_rand(ctx, TSYS_F32, 1, &n, 0.1f);
        int64_t st = 5;
        tsys_tensor *step = tsys_tensor_from_data(ctx, TSYS_I64, TSYS_CUDA, 1, &one, &st);
        tsys_kargs a; memset(&a, 0, sizeof a); a.t[0] = v; a.t[1] = v; a.t[2] = v;   // v must be >= 0: square it
        tsys_ctx_backend(ctx, TSYS_CUDA)->kernel(ctx, TSYS_K_MUL, &a);
        memset(&a, 0, sizeof a); a.t[0] = p; a.t[1] = g; a.t[2] = m; a.t[3] = v; a.t[4] = step;
        a.f[0] = 1e-3f; a.f[1] = 0.9f; a.f[2] = 0.999f; a.f[3] = 1e-8f; a.f[4] = 0.01f;
        double us = tc_time(ctx, TSYS_K_ADAMW, &a, NULL, 5);
        printf("    %-34s %9.1f us %8.0f GB/s\n", "adamw 100M fp32", us, 28.0 * n / us / 1e3);
        tsys_tensor *low = tsys_tensor_new(ctx, TSYS_BF16, TSYS_CUDA, 1, &n);   // the kept bf16 copy: 2 bytes more
        a.t[6] = low;
        us = tc_time(ctx, TSYS_K_ADAMW, &a, NULL, 5);
        printf("    %-34s %9.1f us %8.0f GB/s\n", "adamw 100M fp32 + bf16 copy", us, 30.0 * n / us / 1e3);
        tsys_tensor_release(low);
        tsys_tensor_release(p); tsys_tensor_release(g); tsys_tensor_release(m); tsys_tensor_release(v); tsys_tensor_release(step);
    }
    const tsys_dtype dts[2] = { TSYS_F32, TSYS_BF16 };
    for (int di = 0; di < 2; di++) {
        tsys_dtype T = dts[di];
        double es = (double)tsys_dtype_size(T);
        int64_t R = 4096, D = 2560, rd[2] = { R, D }, dd = D;
        tsys_tensor *x = tc_rand(ctx, T, 2, rd, 1), *y = tsys_tensor_new(ctx, T, TSYS_CUDA, 2, rd), *dy = tc_rand(ctx, T, 2, rd, 1);
        tsys_tensor *w = tc_rand(ctx, TSYS_F32, 1, &dd, 1), *dw = tc_rand(ctx, TSYS_F32, 1, &dd, 1), *rstd = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 1, &R);
        tsys_kargs a; memset(&a, 0, sizeof a); a.t[0] = y; a.t[1] = rstd; a.t[2] = x; a.t[3] = w; a.f[0] = 1e-5f;
        char name[64];
        double us = tc_time(ctx, TSYS_K_RMSNORM_FWD, &a, NULL, 20);
        snprintf(name, sizeof name, "rmsnorm_fwd %s 4096x2560", tsys_dtype_name(T));
        printf("    %-34s %9.1f us %8.0f GB/s\n", name, us, 2.0 * es * R * D / us / 1e3);
        memset(&a, 0, sizeof a); a.t[0] = y; a.t[1] = dw; a.t[2] = dy; a.t[3] = x; a.t[4] = w; a.t[5] = rstd;
        us = tc_time(ctx, TSYS_K_RMSNORM_BWD, &a, NULL, 20);
        snprintf(name, sizeof name, "rmsnorm_bwd %s 4096x2560", tsys_dtype_name(T));
        printf("    %-34s %9.1f us %8.0f GB/s\n", name, us, 3.0 * es * R * D / us / 1e3);
        memset(&a, 0, sizeof a); a.t[0] = y; a.t[1] = x; a.t[2] = dy;
        us = tc_time(ctx, TSYS_K_SWIGLU_FWD, &a, NULL, 20);
        snprintf(name, sizeof name, "swiglu_fwd %s 4096x2560", tsys_dtype_name(T));
        printf("    %-34s %9.1f us %8.0f GB/s\n", name, us, 3.0 * es * R * D / us / 1e3);
        tsys_tensor_release(x); tsys_tensor_release(y); tsys_tensor_release(dy); tsys_tensor_release(w); tsys_tensor_release(dw); tsys_tensor_release(rstd);
        // cross-entropy over 1024 rows of 10000 logits
        int64_t rv[2] = { 1024, 10000 }, nr = 1024, one = 1;
        tsys_tensor *lg = tc_rand(ctx, T, 2, rv, 3), *dl = tsys_tensor_new(ctx, T, TSYS_CUDA, 2, rv), *lse = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 1, &nr);
        tsys_tensor *loss = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 1, &one), *tg = tsys_tensor_new(ctx, TSYS_I64, TSYS_CUDA, 1, &nr), *dloss = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 1, &one);
        tsys_tensor_randint(ctx, tg, 10000); tsys_tensor_fill(ctx, dloss, 1.0f);
        memset(&a, 0, sizeof a); a.t[0] = loss; a.t[1] = lse; a.t[2] = lg; a.t[3] = tg;
        us = tc_time(ctx, TSYS_K_CE_FWD, &a, NULL, 20);
        snprintf(name, sizeof name, "ce_fwd %s 1024x10000", tsys_dtype_name(T));
        printf("    %-34s %9.1f us %8.0f GB/s\n", name, us, es * 1024 * 10000 / us / 1e3);
        memset(&a, 0, sizeof a); a.t[0] = dl; a.t[1] = lg; a.t[2] = lse; a.t[3] = tg; a.t[4] = dloss; a.f[0] = 1.0f / 1024;
        us = tc_time(ctx, TSYS_K_CE_BWD, &a, NULL, 20);
        snprintf(name, sizeof name, "ce_bwd %s 1024x10000", tsys_dtype_name(T));
        printf("    %-34s %9.1f us %8.0f GB/s\n", name, us, 2.0 * es * 1024 * 10000 / us / 1e3);
        tsys_tensor_release(lg); tsys_tensor_release(dl); tsys_tensor_release(lse); tsys_tensor_release(loss); tsys_tensor_release(tg); tsys_tensor_release(dloss);
        // causal softmax over (4 x 16 heads, 256, 256)
        int64_t ss[4] = { 4, 16, 256, 256 };
        tsys_tensor *sx = tc_rand(ctx, T, 4, ss, 1), *sy = tsys_tensor_new(ctx, T, TSYS_CUDA, 4, ss);
        memset(&a, 0, sizeof a); a.t[0] = sy; a.t[1] = sx; a.f[0] = 0.125f; a.i[0] = 1;
        us = tc_time(ctx, TSYS_K_SOFTMAX_FWD, &a, NULL, 20);
        snprintf(name, sizeof name, "softmax causal %s 64x256x256", tsys_dtype_name(T));
        printf("    %-34s %9.1f us %8.0f GB/s\n", name, us, 2.0 * es * 64 * 256 * 256 / us / 1e3);
        tsys_tensor_release(sx); tsys_tensor_release(sy);
    }
    const tsys_dtype gd[3] = { TSYS_F32, TSYS_F32, TSYS_BF16 };
    for (int i = 0; i < 3; i++) {
        int64_t n = 4096, sh[2] = { n, n };
        tsys_tensor *A = tc_rand(ctx, gd[i], 2, sh, 1), *B = tc_rand(ctx, gd[i], 2, sh, 1), *C = tsys_tensor_new(ctx, gd[i], TSYS_CUDA, 2, sh);
        tsys_gemm_args g; memset(&g, 0, sizeof g);
        g.a = A; g.b = B; g.c = C; g.trans_b = true; g.m = g.n = g.k = n; g.batch = 1; g.alpha = 1;
        tsys_cuda_set_tf32(ctx, i == 1);
        double us = tc_time(ctx, TSYS_K_COUNT, NULL, &g, 10);
        printf("    %-34s %9.1f us %8.1f TFLOP/s\n", i == 0 ? "gemm f32 4096^3 (x W^T)" : i == 1 ? "gemm tf32 4096^3" : "gemm bf16 4096^3", us, 2.0 * n * n * n / us / 1e6);
        tsys_tensor_release(A); tsys_tensor_release(B); tsys_tensor_release(C);
    }
    tsys_cuda_set_tf32(ctx, false);
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
}

// ---- FlashAttention-2 ---------------------------------------------------------------------------
// The CS336 attention contract on CUDA through the public ops: tsys_flash_attention on the GPU (fp32,
// bf16, fp16 tensors) against the CPU reference op (fp32 tiled flash, itself checked against naive
// attention by tests/test_attention.c) on the same values: the low-precision inputs are rounded first,
// so only the kernels' own rounding counts. O, L and dQ/dK/dV (tsys_backward_with a random dO).
// Outputs come from a poisoned cache: just before the CUDA op runs, blocks of every output's size
// class are filled with NaN and freed, so the op's outputs land in NaN memory and an element a kernel
// forgets to write fails the check.

// Every flash test runs once per implementation of the bf16/fp16 d = 64, 128 kernels (tsys_cuda_flash_impl) that
// this binary and device can run, switched on the shared context with tsys_cuda_set_flash_impl; one that
// cannot run is skipped with a printed note, except that a test binary whose own probe finds sm_90a code on the
// device must run them all (on an H100/H200 with the Makefile's sm_90a build: mma, wgmma and ws).
static const tsys_cuda_flash_impl tc_fa_impls[3] = { TSYS_CUDA_FLASH_MMA, TSYS_CUDA_FLASH_WGMMA, TSYS_CUDA_FLASH_WS };
static const char *tc_fa_impl = "auto";   // the implementation under test, for messages

// Static shared memory only in the sm_90a body: this test binary has Hopper code for the device.
__global__ void tc_sm90a_probe(int *p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    __shared__ volatile int marker[64];
    marker[threadIdx.x & 63] = (int)threadIdx.x;
    if (p) *p = marker[0];
#endif
}
static bool tc_sm90a(void) {
    cudaFuncAttributes a;
    bool ok = cudaFuncGetAttributes(&a, tc_sm90a_probe) == cudaSuccess && a.sharedSizeBytes >= 256;
    cudaGetLastError();
    return ok;
}

template <class F> static void tc_fa_sweep(F body) {
    TC_CTX(ctx);
    const bool hopper = tc_sm90a();
    for (int i = 0; i < 3; i++) {
        tc_fa_impl = tsys_cuda_flash_impl_name(tc_fa_impls[i]);
        if (tsys_cuda_set_flash_impl(ctx, tc_fa_impls[i]) != TSYS_OK) {
            TEST_CHECK(!hopper, "flash implementation %s refused although this binary has sm_90a code for the device: %s", tc_fa_impl, tsys_ctx_last_error(ctx));
            printf("[%s skipped: %s] ", tc_fa_impl, tsys_ctx_last_error(ctx));
            tsys_ctx_clear_error(ctx);
            continue;
        }
        TEST_CHECK(tsys_cuda_get_desc(ctx).flash == tc_fa_impls[i], "get_desc reports %s after set_flash_impl(%s)",
                   tsys_cuda_flash_impl_name(tsys_cuda_get_desc(ctx).flash), tc_fa_impl);
        printf("[%s] ", tc_fa_impl);
        fflush(stdout);
        body(ctx);
    }
    tc_fa_impl = "auto";
    TEST_CHECK(tsys_cuda_set_flash_impl(ctx, TSYS_CUDA_FLASH_AUTO) == TSYS_OK, "back to auto: %s", tsys_ctx_last_error(ctx));
}

// Relative error with the denominator floored at 1e-2 * sqrt(n): at seq 1, dQ = dK = 0 exactly and a
// relative error against zero means nothing (the flash lab uses the same floor).
// Relative L2 error, with the reference's RMS taken as at least `floor`.
static double tc_fa_err_floor(const float *got, const float *ref, int64_t n, double floor) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        if (got[i] != got[i] || ref[i] != ref[i]) return INFINITY;
        double d = (double)got[i] - ref[i];
        num += d * d; den += (double)ref[i] * ref[i];
    }
    return sqrt(num) / fmax(sqrt(den), floor * sqrt((double)n));
}
static double tc_fa_err(const float *got, const float *ref, int64_t n) { return tc_fa_err_floor(got, ref, n, 1e-2); }
// L = logsumexp of a row's scores enters P = exp(s - L): its absolute error is P's relative error, so L is
// measured against an RMS of at least 1. (With one key L is that key's score, near 0 at times, and TF32's
// rounding of q and k, relative to |q||k|, would read as a large relative error of L alone.)
static double tc_fa_err_lse(const float *got, const float *ref, int64_t n) { return tc_fa_err_floor(got, ref, n, 1.0); }

// fp32 has two kernels (tsys_cuda_desc.flash_fp32_exact): exact fp32 on CUDA cores is held to 1e-5, TF32 tensor
// cores (10-bit mantissas in, fp32 sums) to 3e-3; bf16/fp16 inputs are rounded before both runs.
static bool tc_fa_exact = false;   // the fp32 kernel under test
static double tc_fa_worst_exact = 0;   // the exact fp32 kernel's worst relative error so far (printed)
static double tc_fa_tol(tsys_dtype dt) { return dt == TSYS_F32 ? (tc_fa_exact ? 1e-5 : 3e-3) : 1e-2; }

typedef struct tc_fa_out { float *o, *l, *dq, *dk, *dv; int64_t n, nl; } tc_fa_out;
static void tc_fa_out_free(tc_fa_out *r) { free(r->o); free(r->l); free(r->dq); free(r->dk); free(r->dv); memset(r, 0, sizeof *r); }

// NaN-filled blocks of the output sizes go back to the cache; the next allocations of those sizes get them.
static void tc_fa_poison(tsys_ctx *ctx, tsys_dtype dt, int64_t n, int64_t nl) {
    tsys_tensor *t[10];
    for (int i = 0; i < 10; i++) {
        t[i] = i < 8 ? tsys_tensor_new(ctx, dt, TSYS_CUDA, 1, &n) : tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 1, &nl);
        if (t[i]) tsys_tensor_fill(ctx, t[i], NAN);
    }
    for (int i = 10; i-- > 0;) tsys_tensor_release(t[i]);
}

// One forward + backward of flash attention on dev with dtype dt from the host values vals[0..3]
// (q, k, v, dO); the results come back as fp32 host arrays.
static bool tc_fa_run(tsys_ctx *ctx, tsys_device dev, tsys_dtype dt, int nd, const int64_t *shape, float *const vals[4], bool causal, tc_fa_out *r) {
    memset(r, 0, sizeof *r);
    tc_arg a;
    memset(&a, 0, sizeof a);
    a.role = R_IN; a.dt = dt; a.ndim = nd;
    for (int i = 0; i < nd; i++) a.shape[i] = shape[i];
    tsys_tensor *t[4];
    for (int i = 0; i < 4; i++) t[i] = tc_make(ctx, &a, dev, vals[i]);
    for (int i = 0; i < 3; i++) tsys_tensor_set_requires_grad(t[i], true);
    int64_t n = tsys_tensor_numel(t[0]), nl = n / shape[nd - 1];
    if (dev == TSYS_CUDA) tc_fa_poison(ctx, dt, n, nl);
    tsys_tensor *lse = NULL, *o = tsys_flash_attention(ctx, t[0], t[1], t[2], causal, &lse);
    if (o && lse) {
        r->o = test_read(ctx, o); r->l = test_read(ctx, lse); r->n = n; r->nl = tsys_tensor_numel(lse);
        if (tsys_backward_with(ctx, o, t[3]) == TSYS_OK && t[0]->grad && t[1]->grad && t[2]->grad) {
            r->dq = test_read(ctx, t[0]->grad); r->dk = test_read(ctx, t[1]->grad); r->dv = test_read(ctx, t[2]->grad);
        }
    }
    tsys_tensor_release(o); tsys_tensor_release(lse);
    for (int i = 0; i < 4; i++) { if (i < 3) { tsys_tensor_release(t[i]->grad); t[i]->grad = NULL; } tsys_tensor_release(t[i]); }
    bool ok = tsys_ctx_status(ctx) == TSYS_OK && r->o && r->l && r->dq && r->dk && r->dv;
    TEST_CHECK(ok, "flash %s %s (%s): %s", dev == TSYS_CUDA ? "cuda" : "cpu", tsys_dtype_name(dt), tc_fa_impl, tsys_ctx_last_error(ctx));
    TEST_CHECK(tsys_tape_size(ctx) == 0, "tape not empty after backward");
    tsys_tape_clear(ctx);
    tsys_ctx_clear_error(ctx);
    if (!ok) tc_fa_out_free(r);
    return ok;
}

static float tc_round(tsys_dtype dt, float v) {
    return dt == TSYS_BF16 ? tsys_bf16_to_f32(tsys_f32_to_bf16(v)) : dt == TSYS_F16 ? tsys_f16_to_f32(tsys_f32_to_f16(v)) : v;
}

// The contract for one shape and dtype: CUDA flash against the CPU reference; with `twice`, a second
// CUDA pass must give the same bits. Returns the worst relative error (for the printed summary).
static double tc_fa_case(tsys_dtype dt, int nd, const int64_t *shape, bool causal, bool twice) {
    tsys_ctx *ctx = tc_ctx();
    TEST_CHECK(ctx != NULL, "no GPU");
    if (!ctx) return INFINITY;
    int64_t n = 1;
    for (int i = 0; i < nd; i++) n *= shape[i];
    float *vals[4];
    for (int i = 0; i < 4; i++) {
        vals[i] = (float *)malloc(sizeof(float) * (size_t)n);
        for (int64_t j = 0; j < n; j++) vals[i][j] = tc_round(dt, tc_normal());
    }
    char cfg[128];
    int len = snprintf(cfg, sizeof cfg, "%s %s (", tc_fa_impl, tsys_dtype_name(dt));
    for (int i = 0; i < nd; i++) len += snprintf(cfg + len, sizeof cfg - (size_t)len, "%s%lld", i ? "," : "", (long long)shape[i]);
    snprintf(cfg + len, sizeof cfg - (size_t)len, ")%s", causal ? " causal" : "");
    double worst = INFINITY;
    tc_fa_out ref, got, again;
    if (tc_fa_run(ctx, TSYS_CPU, TSYS_F32, nd, shape, vals, causal, &ref)) {
        for (int mode = 0; mode < (dt == TSYS_F32 ? 2 : 1); mode++) {   // fp32: TF32, then exact
        tc_fa_exact = mode == 1;
        tsys_cuda_set_flash_fp32_exact(ctx, tc_fa_exact);
        if (dt == TSYS_F32) snprintf(cfg + len, sizeof cfg - (size_t)len, ")%s %s", causal ? " causal" : "", tc_fa_exact ? "exact" : "tf32");
        if (tc_fa_run(ctx, TSYS_CUDA, dt, nd, shape, vals, causal, &got)) {
            double tol = tc_fa_tol(dt);
            if (dt != TSYS_F32 || mode == 0) worst = 0;   // fp32: the TF32 run's errors are the ones reported
            double e[5] = { tc_fa_err(got.o, ref.o, n), tc_fa_err_lse(got.l, ref.l, ref.nl), tc_fa_err(got.dq, ref.dq, n),
                            tc_fa_err(got.dk, ref.dk, n), tc_fa_err(got.dv, ref.dv, n) };
            const char *names[5] = { "O", "L", "dQ", "dK", "dV" };
            for (int i = 0; i < 5; i++) {
                TEST_CHECK(e[i] <= tol, "%s: %s rel err %.3g (tol %.0e)%s", cfg, names[i], e[i], tol, isinf(e[i]) ? " (NaN: unwritten element?)" : "");
                if (mode == 0 && e[i] > worst) worst = e[i];
                if (mode == 1 && e[i] > tc_fa_worst_exact) tc_fa_worst_exact = e[i];
            }
            TEST_CHECK(got.nl == ref.nl, "%s: L has %lld elements, cpu %lld", cfg, (long long)got.nl, (long long)ref.nl);
            if (dt == TSYS_F32) {   // the handout's own criterion
                const float *g5[5] = { got.o, got.l, got.dq, got.dk, got.dv }, *r5[5] = { ref.o, ref.l, ref.dq, ref.dk, ref.dv };
                for (int i = 0; i < 5; i++)
                    TEST_CHECK(tsys_test_close_ratio(g5[i], r5[i], i == 1 ? ref.nl : n, 1e-2, 1e-2) <= 1.0, "%s: %s fails assert_close(1e-2, 1e-2)", cfg, names[i]);
            }
            if (twice && tc_fa_run(ctx, TSYS_CUDA, dt, nd, shape, vals, causal, &again)) {
                TEST_CHECK(!memcmp(got.o, again.o, sizeof(float) * (size_t)n) && !memcmp(got.l, again.l, sizeof(float) * (size_t)got.nl), "%s: forward not bit-identical", cfg);
                TEST_CHECK(!memcmp(got.dq, again.dq, sizeof(float) * (size_t)n) && !memcmp(got.dk, again.dk, sizeof(float) * (size_t)n)
                           && !memcmp(got.dv, again.dv, sizeof(float) * (size_t)n), "%s: backward not bit-identical", cfg);
                tc_fa_out_free(&again);
            }
            tc_fa_out_free(&got);
        }
        }
        tc_fa_exact = false;
        tsys_cuda_set_flash_fp32_exact(ctx, false);
        tc_fa_out_free(&ref);
    }
    for (int i = 0; i < 4; i++) free(vals[i]);
    return worst;
}

// The handout's shape, (4, 128, 64), in every dtype, causal and not; fp32 also against the handout's tolerance.
TSYS_TEST(cuda_flash_cs336_contract) {
    tc_fa_sweep([](tsys_ctx *) {
        double w[3] = { 0, 0, 0 };
        for (int di = 0; di < 3; di++)
            for (int c = 0; c < 2; c++) { int64_t s[3] = { 4, 128, 64 }; w[di] = fmax(w[di], tc_fa_case(tc_floats[di], 3, s, c == 1, true)); }
        printf("(worst rel err fp32 tf32 %.1e, fp32 exact %.1e, bf16 %.1e, fp16 %.1e) ", w[0], tc_fa_worst_exact, w[1], w[2]);
    });
}

TSYS_TEST(cuda_flash_odd_lengths) {
    tc_fa_sweep([](tsys_ctx *) {
        static const int64_t ns[] = { 1, 17, 100, 257, 1000 };
        for (int di = 0; di < 3; di++)
            for (int i = 0; i < 5; i++)
                for (int c = 0; c < 2; c++) { int64_t s[3] = { 2, ns[i], 64 }; tc_fa_case(tc_floats[di], 3, s, c == 1, false); }
    });
}

TSYS_TEST(cuda_flash_head_dims) {   // 80: the 2.7B model's head dim, 5 tensor-core k-steps; 96: 6
    tc_fa_sweep([](tsys_ctx *) {
        static const int64_t ds[] = { 16, 32, 80, 96, 128 };
        for (int di = 0; di < 3; di++)
            for (int i = 0; i < 5; i++)
                for (int c = 0; c < 2; c++) { int64_t s[3] = { 3, 257, ds[i] }; tc_fa_case(tc_floats[di], 3, s, c == 1, false); }
    });
}

// Training's short sequences (<= 256): the one-launch backward, one block a slice (128 slices: 2.7B's 32 heads x 4
// at d 80) and two (48: small's 12 x 4; odd lengths, every head dim it takes), bit-identical run to run.
TSYS_TEST(cuda_flash_short_sequences) {
    tc_fa_sweep([](tsys_ctx *) {
        for (int di = 1; di < 3; di++)
            for (int c = 0; c < 2; c++) {
                int64_t a[4] = { 4, 32, 256, 80 }; tc_fa_case(tc_floats[di], 4, a, c == 1, true);
                int64_t b[4] = { 4, 12, 256, 64 }; tc_fa_case(tc_floats[di], 4, b, c == 1, true);
                int64_t e[3] = { 140, 200, 64 }; tc_fa_case(tc_floats[di], 3, e, c == 1, true);
                for (int64_t d : { 16, 32, 96 }) { int64_t f[3] = { 3, 129, d }; tc_fa_case(tc_floats[di], 3, f, c == 1, true); }
            }
    });
}

// (batch, heads, seq, d) inputs, and the backward bit-identical from run to run at a size with many tiles.
TSYS_TEST(cuda_flash_4d_deterministic) {
    tc_fa_sweep([](tsys_ctx *) {
        for (int di = 0; di < 3; di++)
            for (int c = 0; c < 2; c++) {
                int64_t s4[4] = { 2, 3, 100, 64 }; tc_fa_case(tc_floats[di], 4, s4, c == 1, true);
                int64_t s3[3] = { 4, 1027, 80 }; tc_fa_case(tc_floats[di], 3, s3, c == 1, true);
                int64_t s5[3] = { 2, 1027, 128 }; tc_fa_case(tc_floats[di], 3, s5, c == 1, true);   // the Hopper kernels, many tiles
            }
    });
}

// A head dim without a kernel is an error with a message, and the context works afterwards.
TSYS_TEST(cuda_flash_unsupported_head_dim) {
    tc_fa_sweep([](tsys_ctx *ctx) {
        int64_t s[3] = { 2, 64, 40 };
        tsys_tensor *q = tc_rand(ctx, TSYS_BF16, 3, s, 1);
        tsys_tensor *o = tsys_flash_attention(ctx, q, q, q, true, NULL);
        TEST_CHECK(o == NULL && tsys_ctx_status(ctx) != TSYS_OK, "head dim 40 must fail, status %d", (int)tsys_ctx_status(ctx));
        TEST_CHECK(strstr(tsys_ctx_last_error(ctx), "head dim") != NULL, "message '%s' should name the head dim", tsys_ctx_last_error(ctx));
        tsys_tensor_release(o);
        tsys_tape_clear(ctx);
        tsys_ctx_clear_error(ctx);
        TEST_CHECK(tsys_tensor_fill(ctx, q, 1.0f) == TSYS_OK && tsys_sync(ctx, TSYS_CUDA) == TSYS_OK, "context broken after the error: %s", tsys_ctx_last_error(ctx));
        tsys_tensor_release(q);
        tsys_ctx_clear_error(ctx);
    });
}

// Memory past the inputs during forward+backward, from the tracker: linear in seq for flash.
static int64_t tc_fa_extra_bytes(tsys_ctx *ctx, bool flash, int64_t n) {
    int64_t s[4] = { 1, 16, n, 64 };
    tsys_tensor *q = tc_rand(ctx, TSYS_BF16, 4, s, 1), *k = tc_rand(ctx, TSYS_BF16, 4, s, 1), *v = tc_rand(ctx, TSYS_BF16, 4, s, 1), *g = tc_rand(ctx, TSYS_BF16, 4, s, 1);
    tsys_tensor_set_requires_grad(q, true); tsys_tensor_set_requires_grad(k, true); tsys_tensor_set_requires_grad(v, true);
    int64_t base = tsys_mem_stats_get(ctx, TSYS_CUDA).live_bytes;
    tsys_mem_reset_peak(ctx, TSYS_CUDA);
    tsys_tensor *o = flash ? tsys_flash_attention(ctx, q, k, v, true, NULL) : tsys_attention_naive(ctx, q, k, v, true);
    tsys_backward_with(ctx, o, g);
    tsys_tensor_release(o);
    int64_t extra = tsys_mem_stats_get(ctx, TSYS_CUDA).peak_bytes - base;
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s n=%lld (%s): %s", flash ? "flash" : "naive", (long long)n, tc_fa_impl, tsys_ctx_last_error(ctx));
    tsys_tensor *t[3] = { q, k, v };
    for (int i = 0; i < 3; i++) { tsys_tensor_release(t[i]->grad); t[i]->grad = NULL; tsys_tensor_release(t[i]); }
    tsys_tensor_release(g);
    tsys_tape_clear(ctx);
    tsys_ctx_clear_error(ctx);
    return extra;
}

TSYS_TEST(cuda_flash_memory_linear) {
    TC_CTX(ctx);
    int64_t n1 = tc_fa_extra_bytes(ctx, false, 2048), n2 = tc_fa_extra_bytes(ctx, false, 4096);
    TEST_CHECK(n1 > 0 && (double)n2 / (double)n1 >= 3.5, "naive extra memory %lld -> %lld bytes when seq doubles (want ~4x)", (long long)n1, (long long)n2);
    printf("(naive %.1f -> %.1f MiB at 2048 -> 4096) ", n1 / 1048576.0, n2 / 1048576.0);
    tc_fa_sweep([](tsys_ctx *ctx) {
        int64_t f1 = tc_fa_extra_bytes(ctx, true, 4096), f2 = tc_fa_extra_bytes(ctx, true, 8192);
        TEST_CHECK(f1 > 0 && (double)f2 / (double)f1 <= 2.1, "%s: flash extra memory %lld -> %lld bytes when seq doubles (want <= 2.1x)", tc_fa_impl, (long long)f1, (long long)f2);
        printf("(flash %.1f -> %.1f MiB at seq 4096 -> 8192) ", f1 / 1048576.0, f2 / 1048576.0);
    });
    tsys_cuda_empty_cache(ctx);
}

// The model with attn "flash" against the same weights with attn "naive", both on CUDA: logits, loss
// and every gradient. T = 100 is not a multiple of any tile.
static void tc_fa_model_check(tsys_dtype autocast, double tol_logits, double tol_grad) {
    TC_CTX(ctx);
    tsys_model_desc d = tc_model_desc();
    d.context_length = 128;
    d.attn = "naive";
    tsys_model *mn = tsys_model_new(ctx, &d, TSYS_CUDA, 7);
    d.attn = "flash";
    tsys_model *mf = mn ? tsys_model_new(ctx, &d, TSYS_CUDA, 8) : NULL;
    TEST_CHECK(mn && mf, "model creation: %s", tsys_ctx_last_error(ctx));
    if (!mn || !mf) { tsys_model_free(mn); tsys_ctx_clear_error(ctx); return; }
    int n = tsys_model_num_tensors(mn);
    tsys_tensor **pn = tsys_model_params(mn), **pf = tsys_model_params(mf);
    for (int i = 0; i < n; i++) tsys_tensor_copy_from(ctx, pf[i], pn[i]);
    tsys_tensor *ids = tc_ids(ctx, TSYS_CUDA, 2, 100, d.vocab_size, 31), *tg = tc_ids(ctx, TSYS_CUDA, 2, 100, d.vocab_size, 37);
    tsys_tensor *logits[2], *loss[2];
    for (int m = 0; m < 2; m++) {
        if (autocast != TSYS_F32) tsys_autocast_begin(ctx, autocast);
        logits[m] = tsys_model_forward(m ? mf : mn, ids);
        loss[m] = tsys_cross_entropy(ctx, logits[m], tg);
        if (autocast != TSYS_F32) tsys_autocast_end(ctx);
        tsys_backward(ctx, loss[m]);
    }
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    if (tsys_ctx_status(ctx) == TSYS_OK) {
        float ln = tsys_item(ctx, loss[0]), lf = tsys_item(ctx, loss[1]);
        double el = tc_compare(ctx, logits[1], logits[0]);
        TEST_CHECK(el <= tol_logits, "%s: logits flash vs naive rel err %.3g (tol %.0e)", tc_fa_impl, el, tol_logits);
        TEST_CHECK(fabsf(ln - lf) <= tol_logits * fabsf(ln), "%s: loss naive %.7f flash %.7f", tc_fa_impl, ln, lf);
        double worst = 0;
        for (int i = 0; i < n; i++) {
            double e = tc_compare(ctx, pf[i]->grad, pn[i]->grad);
            TEST_CHECK(e <= tol_grad, "%s: grad of %s flash vs naive rel err %.3g (tol %.0e)", tc_fa_impl, pn[i]->name, e, tol_grad);
            if (e > worst) worst = e;
        }
        printf("(loss naive %.6f flash %.6f, worst grad rel err %.1e) ", ln, lf, worst);
    }
    for (int m = 0; m < 2; m++) { tsys_tensor_release(logits[m]); tsys_tensor_release(loss[m]); }
    tsys_tensor_release(ids); tsys_tensor_release(tg);
    tsys_model_free(mn); tsys_model_free(mf);
    tsys_ctx_clear_error(ctx);
}

TSYS_TEST(cuda_flash_model_fp32) {   // exact fp32 flash against naive at fp32 tolerances; TF32 at its own
    tc_fa_sweep([](tsys_ctx *ctx) {
        tsys_cuda_set_flash_fp32_exact(ctx, true);
        tc_fa_model_check(TSYS_F32, 1e-5, 1e-4);
        tsys_cuda_set_flash_fp32_exact(ctx, false);
        tc_fa_model_check(TSYS_F32, 3e-3, 2e-2);
    });
}
TSYS_TEST(cuda_flash_model_bf16_autocast) { tc_fa_sweep([](tsys_ctx *) { tc_fa_model_check(TSYS_BF16, 2e-2, 5e-2); }); }

// ---- backend desc ---------------------------------------------------------------------------------
// tsys_cuda_init_desc: a request that cannot be met fails with a message that names the field and its value
// and leaves no backend; tsys_cuda_get_desc reports the effective values (defaults filled in, setters' changes).
TSYS_TEST(cuda_init_desc) {
    TC_CTX(ctx);
    (void)ctx;
    tsys_ctx *c2 = tsys_ctx_new(NULL);
    tsys_cuda_desc d;
    memset(&d, 0, sizeof d);
    d.device = 999;
    TEST_CHECK(tsys_cuda_init_desc(c2, &d) == TSYS_ERR_INVALID_ARGS, "device 999: status %d", (int)tsys_ctx_status(c2));
    TEST_CHECK(strstr(tsys_ctx_last_error(c2), "desc.device = 999") != NULL, "message '%s' should name desc.device = 999", tsys_ctx_last_error(c2));
    TEST_CHECK(tsys_cuda_get_desc(c2).workspace_bytes == 0 && tsys_cuda_stream(c2) == NULL, "a failed init must leave no backend");
    tsys_ctx_clear_error(c2);
    d.device = 0;
    d.flash = (tsys_cuda_flash_impl)7;
    TEST_CHECK(tsys_cuda_init_desc(c2, &d) == TSYS_ERR_INVALID_ARGS && strstr(tsys_ctx_last_error(c2), "desc.flash = 7") != NULL,
               "flash 7: '%s'", tsys_ctx_last_error(c2));
    tsys_ctx_clear_error(c2);
    const bool hopper = tc_sm90a();
    if (!hopper) {   // Hopper kernels asked for where they cannot run: an error naming the choice, no fallback
        d.flash = TSYS_CUDA_FLASH_WGMMA;
        TEST_CHECK(tsys_cuda_init_desc(c2, &d) == TSYS_ERR_UNSUPPORTED && strstr(tsys_ctx_last_error(c2), "desc.flash = 'wgmma'") != NULL,
                   "wgmma without sm_90a: '%s'", tsys_ctx_last_error(c2));
        tsys_ctx_clear_error(c2);
    }

    // every field set
    memset(&d, 0, sizeof d);
    d.flash = TSYS_CUDA_FLASH_MMA; d.tf32 = true; d.workspace_bytes = (size_t)4 << 20; d.memory_limit = (size_t)1 << 30; d.nvtx = true;
    d.flash_fp32_exact = true; d.flash_nondeterministic = true;
    TEST_CHECK(tsys_cuda_init_desc(c2, &d) == TSYS_OK, "init_desc: %s", tsys_ctx_last_error(c2));
    tsys_cuda_desc e = tsys_cuda_get_desc(c2);
    TEST_CHECK(e.device == 0 && e.flash == TSYS_CUDA_FLASH_MMA && e.tf32 && e.workspace_bytes == ((size_t)4 << 20) &&
               e.memory_limit == ((size_t)1 << 30) && e.nvtx && e.flash_fp32_exact && e.flash_nondeterministic,
               "effective desc: device %d flash %s tf32 %d workspace %zu limit %zu nvtx %d", e.device, tsys_cuda_flash_impl_name(e.flash),
               (int)e.tf32, e.workspace_bytes, e.memory_limit, (int)e.nvtx);
    TEST_CHECK(tsys_cuda_tf32(c2), "tsys_cuda_tf32 after desc.tf32");
    // the setters change the same state
    tsys_cuda_set_tf32(c2, false);
    tsys_cuda_set_memory_limit(c2, 0);
    tsys_cuda_set_flash_fp32_exact(c2, false);
    TEST_CHECK(!tsys_cuda_get_desc(c2).flash_fp32_exact, "set_flash_fp32_exact(false) not in the desc");
    tsys_cuda_set_flash_nondeterministic(c2, false);
    TEST_CHECK(!tsys_cuda_get_desc(c2).flash_nondeterministic, "set_flash_nondeterministic(false) not in the desc");
    TEST_CHECK(tsys_cuda_set_flash_impl(c2, TSYS_CUDA_FLASH_AUTO) == TSYS_OK, "set auto: %s", tsys_ctx_last_error(c2));
    e = tsys_cuda_get_desc(c2);
    const tsys_cuda_flash_impl want = hopper ? TSYS_CUDA_FLASH_WS : TSYS_CUDA_FLASH_MMA;
    TEST_CHECK(!e.tf32 && e.memory_limit == 0 && e.flash == want, "after the setters: tf32 %d limit %zu flash %s (want %s)", (int)e.tf32,
               e.memory_limit, tsys_cuda_flash_impl_name(e.flash), tsys_cuda_flash_impl_name(want));
    TEST_CHECK(tsys_cuda_set_flash_impl(c2, (tsys_cuda_flash_impl)9) == TSYS_ERR_INVALID_ARGS && strstr(tsys_ctx_last_error(c2), "impl = 9") != NULL,
               "set_flash_impl(9): '%s'", tsys_ctx_last_error(c2));
    TEST_CHECK(tsys_cuda_get_desc(c2).flash == want, "a refused set_flash_impl must keep the choice");
    tsys_ctx_clear_error(c2);
    if (!hopper) {
        TEST_CHECK(tsys_cuda_set_flash_impl(c2, TSYS_CUDA_FLASH_WS) == TSYS_ERR_UNSUPPORTED && strstr(tsys_ctx_last_error(c2), "'ws'") != NULL,
                   "ws without sm_90a: '%s'", tsys_ctx_last_error(c2));
        tsys_ctx_clear_error(c2);
    }
    tsys_cuda_shutdown(c2);

    // all defaults: NULL desc and the tsys_cuda_init shorthand
    for (int k = 0; k < 2; k++) {
        TEST_CHECK((k ? tsys_cuda_init(c2, 0) : tsys_cuda_init_desc(c2, NULL)) == TSYS_OK, "init (%d): %s", k, tsys_ctx_last_error(c2));
        e = tsys_cuda_get_desc(c2);
        TEST_CHECK(e.device == 0 && !e.tf32 && e.workspace_bytes == TSYS_CUDA_WORKSPACE_BYTES && e.memory_limit == 0 && !e.nvtx &&
                   e.flash != TSYS_CUDA_FLASH_AUTO && !e.flash_nondeterministic,
                   "defaults (%d): device %d tf32 %d workspace %zu limit %zu nvtx %d flash %s", k, e.device, (int)e.tf32, e.workspace_bytes,
                   e.memory_limit, (int)e.nvtx, tsys_cuda_flash_impl_name(e.flash));
        tsys_cuda_shutdown(c2);
    }
    TEST_CHECK(!strcmp(tsys_cuda_flash_impl_name(TSYS_CUDA_FLASH_AUTO), "auto") && !strcmp(tsys_cuda_flash_impl_name(TSYS_CUDA_FLASH_WS), "ws") &&
               !strcmp(tsys_cuda_flash_impl_name(TSYS_CUDA_FLASH_WGMMA), "wgmma") && !strcmp(tsys_cuda_flash_impl_name(TSYS_CUDA_FLASH_MMA), "mma"),
               "implementation names");
    tsys_ctx_free(c2);
}

int main(int argc, char **argv) {
    int rc = tsys_test_main(argc, argv);
    tsys_ctx *ctx = tc_ctx();
    if (ctx) { tsys_cuda_shutdown(ctx); tsys_ctx_free(ctx); }
    return rc;
}
