// test_attention.c - the CS336 FlashAttention-2 contract (tests/test_attention.py of the assignment)
// through the op layer on the CPU: tsys_flash_attention's O, L and dQ/dK/dV (tsys_backward_with a
// random dO) against tsys_attention_naive and an L computed in double from the -1e6-masked scores;
// odd sequence lengths, d 80, 4-D (batch, heads, seq, d) inputs, bit-identical repeated backward
// passes, bad inputs, and memory that grows linearly with seq (naive: quadratically).
//
//   make build/test_attention && build/test_attention [name-filter]
#define TSYS_IMPLEMENTATION
#include "../tsys.h"
#include "harness.h"
#include "test_util.h"

#include <stdlib.h>

// Both flash and naive are fp32 here, so the handout's rtol = atol = 1e-2 is far too loose: elements
// must agree to 1e-4 relative (plus a small absolute floor for elements near 0), and the handout's
// criterion is checked as well.
#define TA_RTOL 1e-4
#define TA_ATOL 1e-5

// One run of an attention implementation: O, L (flash only) and the three gradients, on the host.
typedef struct ta_out { float *o, *l, *dq, *dk, *dv; int64_t n_o, n_l, n_kv; } ta_out;

static void ta_out_free(ta_out *r) { free(r->o); free(r->l); free(r->dq); free(r->dk); free(r->dv); memset(r, 0, sizeof(*r)); }

typedef struct ta_inputs { tsys_tensor *q, *k, *v, *dout; int nd; int64_t shape[4]; } ta_inputs;

// Seeded random (.., seq, d) fp32 q, k, v (requiring grad) and dO, made in that order like the handout's.
static ta_inputs ta_make(tsys_ctx *ctx, int nd, const int64_t *shape, uint64_t seed) {
    ta_inputs in;
    memset(&in, 0, sizeof(in));
    in.nd = nd;
    memcpy(in.shape, shape, sizeof(int64_t) * (size_t)nd);
    tsys_rng_seed(ctx, seed);
    tsys_tensor **t[4] = {&in.q, &in.k, &in.v, &in.dout};
    for (int i = 0; i < 4; i++) {
        *t[i] = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, nd, shape);
        if (*t[i]) tsys_tensor_randn(ctx, *t[i], 1.0f);
        if (*t[i] && i < 3) tsys_tensor_set_requires_grad(*t[i], true);
    }
    return in;
}

static void ta_drop_grads(ta_inputs *in) {
    tsys_tensor *t[3] = {in->q, in->k, in->v};
    for (int i = 0; i < 3; i++) if (t[i]) { tsys_tensor_release(t[i]->grad); t[i]->grad = NULL; }
}

static void ta_free(ta_inputs *in) {
    ta_drop_grads(in);
    tsys_tensor_release(in->q); tsys_tensor_release(in->k); tsys_tensor_release(in->v); tsys_tensor_release(in->dout);
    memset(in, 0, sizeof(*in));
}

// Forward (flash or naive), backward with dO; the gradients are taken out of q, k, v and dropped.
static bool ta_run(tsys_ctx *ctx, ta_inputs *in, bool flash, bool causal, ta_out *r) {
    memset(r, 0, sizeof(*r));
    tsys_tensor *lse = NULL;
    tsys_tensor *o = flash ? tsys_flash_attention(ctx, in->q, in->k, in->v, causal, &lse) : tsys_attention_naive(ctx, in->q, in->k, in->v, causal);
    if (o) {
        r->o = test_read(ctx, o); r->n_o = tsys_tensor_numel(o);
        if (lse) { r->l = test_read(ctx, lse); r->n_l = tsys_tensor_numel(lse); }
        tsys_backward_with(ctx, o, in->dout);
    }
    if (tsys_ctx_status(ctx) == TSYS_OK && in->q->grad && in->k->grad && in->v->grad) {
        r->dq = test_read(ctx, in->q->grad); r->dk = test_read(ctx, in->k->grad); r->dv = test_read(ctx, in->v->grad);
        r->n_kv = tsys_tensor_numel(in->k);
    }
    tsys_tensor_release(o); tsys_tensor_release(lse);
    ta_drop_grads(in);
    bool ok = tsys_ctx_status(ctx) == TSYS_OK && r->o && r->dq && r->dk && r->dv && (!flash || r->l);
    TEST_CHECK(ok, "%s %s run failed: %s", flash ? "flash" : "naive", causal ? "causal" : "non-causal", tsys_ctx_last_error(ctx));
    TEST_CHECK(tsys_tape_size(ctx) == 0, "tape not empty after backward (%zu nodes)", tsys_tape_size(ctx));
    tsys_tape_clear(ctx);
    tsys_ctx_clear_error(ctx);
    return ok;
}

// L as the handout's reference computes it: logsumexp over every key of the scores, the causally
// masked ones set to -1e6 (they contribute exp(-1e6 - max) = 0), in double from the fp32 inputs.
static float *ta_lse_ref(tsys_ctx *ctx, const ta_inputs *in, bool causal) {
    int64_t d = in->shape[in->nd - 1], n = in->shape[in->nd - 2], bh = tsys_tensor_numel(in->q) / (n * d);
    float *q = test_read(ctx, in->q), *k = test_read(ctx, in->k), *l = (float *)malloc(sizeof(float) * (size_t)(bh * n));
    double *s = (double *)malloc(sizeof(double) * (size_t)n), scale = 1.0 / sqrt((double)d);
    for (int64_t b = 0; b < bh; b++)
        for (int64_t i = 0; i < n; i++) {
            double mx = -INFINITY, sum = 0;
            for (int64_t j = 0; j < n; j++) {
                double acc = 0;
                for (int64_t c = 0; c < d; c++) acc += (double)q[(b * n + i) * d + c] * k[(b * n + j) * d + c];
                s[j] = (causal && i < j) ? -1e6 : acc * scale;
                if (s[j] > mx) mx = s[j];
            }
            for (int64_t j = 0; j < n; j++) sum += exp(s[j] - mx);
            l[b * n + i] = (float)(mx + log(sum));
        }
    free(q); free(k); free(s);
    return l;
}

static void ta_expect_close(const char *what, const float *got, const float *ref, int64_t n, const char *cfg) {
    double r = tsys_test_close_ratio(got, ref, n, TA_RTOL, TA_ATOL);
    double handout = tsys_test_close_ratio(got, ref, n, 1e-2, 1e-2);
    TEST_CHECK(r <= 1.0, "%s: %s off by %.3g x (rtol %.0e, atol %.0e); rel err %.3g", cfg, what, r, TA_RTOL, TA_ATOL, tsys_test_rel_err(got, ref, n));
    TEST_CHECK(handout <= 1.0, "%s: %s fails the handout's assert_close(rtol 1e-2, atol 1e-2)", cfg, what);
}

// The whole contract for one shape: flash vs naive for O, dQ, dK, dV; flash L vs the double L.
static void ta_contract(int nd, const int64_t *shape, bool causal, uint64_t seed) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    ta_inputs in = ta_make(ctx, nd, shape, seed);
    char cfg[96];
    int len = snprintf(cfg, sizeof(cfg), "(");
    for (int i = 0; i < nd; i++) len += snprintf(cfg + len, sizeof(cfg) - (size_t)len, "%s%lld", i ? "," : "", (long long)shape[i]);
    snprintf(cfg + len, sizeof(cfg) - (size_t)len, ")%s", causal ? " causal" : "");
    ta_out f, nv;
    bool okf = ta_run(ctx, &in, true, causal, &f), okn = okf && ta_run(ctx, &in, false, causal, &nv);
    if (okf && okn) {
        int64_t n = shape[nd - 2], bh = tsys_tensor_numel(in.q) / (n * shape[nd - 1]);
        TEST_CHECK(f.n_l == bh * n, "%s: L has %lld elements, expected (batch*heads, seq) = %lld", cfg, (long long)f.n_l, (long long)(bh * n));
        float *lref = ta_lse_ref(ctx, &in, causal);
        ta_expect_close("O", f.o, nv.o, f.n_o, cfg);
        ta_expect_close("L", f.l, lref, f.n_l, cfg);
        ta_expect_close("dQ", f.dq, nv.dq, f.n_o, cfg);
        ta_expect_close("dK", f.dk, nv.dk, f.n_kv, cfg);
        ta_expect_close("dV", f.dv, nv.dv, f.n_kv, cfg);
        free(lref);
        ta_out_free(&nv);
    }
    if (okf) ta_out_free(&f);
    ta_free(&in);
    TEST_CHECK(tsys_mem_stats_get(ctx, TSYS_CPU).live_bytes == 0, "%s: %lld bytes still live", cfg, (long long)tsys_mem_stats_get(ctx, TSYS_CPU).live_bytes);
    tsys_ctx_free(ctx);
}

// The handout's test: q, k, v, dO of shape (4, 128, 64), fp32, no head dim.
TSYS_TEST(attention_cs336_contract) { int64_t s[3] = {4, 128, 64}; ta_contract(3, s, false, 0); }
TSYS_TEST(attention_cs336_contract_causal) { int64_t s[3] = {4, 128, 64}; ta_contract(3, s, true, 0); }

// L is returned as exactly one fp32 tensor of shape (batch, n_queries), like the one extra tensor the
// handout's autograd Function must save.
TSYS_TEST(attention_lse_shape) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t s[3] = {4, 128, 64};
    ta_inputs in = ta_make(ctx, 3, s, 1);
    tsys_tensor *lse = NULL, *o = tsys_flash_attention(ctx, in.q, in.k, in.v, false, &lse);
    TEST_CHECK(o && lse, "flash: %s", tsys_ctx_last_error(ctx));
    if (o && lse) {
        TEST_CHECK(o->ndim == 3 && o->shape[0] == 4 && o->shape[1] == 128 && o->shape[2] == 64 && o->dtype == TSYS_F32, "O must be (4, 128, 64) fp32");
        TEST_CHECK(lse->ndim == 2 && lse->shape[0] == 4 && lse->shape[1] == 128 && lse->dtype == TSYS_F32, "L must be (4, 128) fp32, is %dD %s",
                   lse->ndim, tsys_dtype_name(lse->dtype));
        TEST_CHECK(o->requires_grad && tsys_tape_size(ctx) == 1, "flash must record exactly one node (tape %zu)", tsys_tape_size(ctx));
    }
    tsys_tensor_release(o); tsys_tensor_release(lse);
    tsys_tape_clear(ctx);
    ta_free(&in);
    tsys_ctx_free(ctx);
}

TSYS_TEST(attention_odd_lengths) {
    static const int64_t ns[] = {1, 17, 100, 257};
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < 2; c++) { int64_t s[3] = {2, ns[i], 64}; ta_contract(3, s, c == 1, 10 + (uint64_t)i); }
}

TSYS_TEST(attention_d80) {   // the 2.7B model's head dim: not a power of two
    for (int c = 0; c < 2; c++) {
        int64_t s[3] = {3, 100, 80}; ta_contract(3, s, c == 1, 20);
        int64_t t[3] = {1, 257, 80}; ta_contract(3, t, c == 1, 21);
    }
}

TSYS_TEST(attention_head_dims) {
    static const int64_t ds[] = {16, 32, 128};
    for (int i = 0; i < 3; i++) for (int c = 0; c < 2; c++) { int64_t s[3] = {2, 65, ds[i]}; ta_contract(3, s, c == 1, 30 + (uint64_t)i); }
}

// (batch, heads, seq, d) inputs: the contract holds, and the result is the (batch*heads, seq, d) one bit for bit.
TSYS_TEST(attention_4d) {
    int64_t s4[4] = {2, 3, 65, 32}, s3[3] = {6, 65, 32};
    for (int c = 0; c < 2; c++) ta_contract(4, s4, c == 1, 40);
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    ta_inputs a = ta_make(ctx, 4, s4, 41), b = ta_make(ctx, 3, s3, 41);   // same seed: same values
    for (int c = 0; c < 2; c++) {
        ta_out ra, rb;
        if (ta_run(ctx, &a, true, c == 1, &ra) && ta_run(ctx, &b, true, c == 1, &rb)) {
            bool same = ra.n_o == rb.n_o && ra.n_l == rb.n_l && !memcmp(ra.o, rb.o, sizeof(float) * (size_t)ra.n_o) && !memcmp(ra.l, rb.l, sizeof(float) * (size_t)ra.n_l)
                     && !memcmp(ra.dq, rb.dq, sizeof(float) * (size_t)ra.n_o) && !memcmp(ra.dk, rb.dk, sizeof(float) * (size_t)ra.n_kv)
                     && !memcmp(ra.dv, rb.dv, sizeof(float) * (size_t)ra.n_kv);
            TEST_CHECK(same, "4-D and flattened 3-D flash differ (causal %d)", c);
            ta_out_free(&ra); ta_out_free(&rb);
        }
    }
    ta_free(&a); ta_free(&b);
    tsys_ctx_free(ctx);
}

// Two forward+backward passes on the same inputs give the same bits.
TSYS_TEST(attention_deterministic) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t s[3] = {4, 257, 64};
    ta_inputs in = ta_make(ctx, 3, s, 50);
    for (int c = 0; c < 2; c++) {
        ta_out r1, r2;
        if (ta_run(ctx, &in, true, c == 1, &r1) && ta_run(ctx, &in, true, c == 1, &r2)) {
            TEST_CHECK(!memcmp(r1.o, r2.o, sizeof(float) * (size_t)r1.n_o) && !memcmp(r1.l, r2.l, sizeof(float) * (size_t)r1.n_l), "forward not bit-identical (causal %d)", c);
            TEST_CHECK(!memcmp(r1.dq, r2.dq, sizeof(float) * (size_t)r1.n_o), "dQ not bit-identical (causal %d)", c);
            TEST_CHECK(!memcmp(r1.dk, r2.dk, sizeof(float) * (size_t)r1.n_kv) && !memcmp(r1.dv, r2.dv, sizeof(float) * (size_t)r1.n_kv),
                       "dK/dV not bit-identical (causal %d)", c);
            ta_out_free(&r1); ta_out_free(&r2);
        }
    }
    ta_free(&in);
    tsys_ctx_free(ctx);
}

// Bad inputs are errors with a message naming the rule, never a crash.
TSYS_TEST(attention_bad_inputs) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t sq[3] = {2, 16, 32}, sk[3] = {2, 16, 16}, s4[4] = {1, 2, 16, 32}, sb[3] = {3, 16, 32};
    tsys_tensor *q = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 3, sq), *k = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 3, sk);
    tsys_tensor *k4 = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 4, s4), *kb = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 3, sb);
    tsys_tensor_fill(ctx, q, 0.5f); tsys_tensor_fill(ctx, k, 0.5f); tsys_tensor_fill(ctx, k4, 0.5f); tsys_tensor_fill(ctx, kb, 0.5f);
    struct { tsys_tensor *k, *v; const char *needle; } cases[3] = {
        {k, k, "head dim"}, {k4, k4, "number of dims"}, {kb, kb, "batch"},
    };
    for (int i = 0; i < 3; i++) {
        tsys_tensor *o = tsys_flash_attention(ctx, q, cases[i].k, cases[i].v, false, NULL);
        TEST_CHECK(o == NULL && tsys_ctx_status(ctx) == TSYS_ERR_INVALID_ARGS, "case %d: expected INVALID_ARGS, got %d", i, (int)tsys_ctx_status(ctx));
        TEST_CHECK(strstr(tsys_ctx_last_error(ctx), cases[i].needle) != NULL, "case %d: message '%s' does not mention '%s'", i, tsys_ctx_last_error(ctx), cases[i].needle);
        tsys_tensor_release(o);
        tsys_ctx_clear_error(ctx);
    }
    TEST_CHECK(tsys_flash_attention(ctx, NULL, k, k, false, NULL) == NULL, "NULL input must give NULL");
    tsys_tensor_release(q); tsys_tensor_release(k); tsys_tensor_release(k4); tsys_tensor_release(kb);
    tsys_ctx_clear_error(ctx);
    tsys_ctx_free(ctx);
}

// Memory past the inputs during forward+backward (peak - inputs), from the tracker.
static int64_t ta_extra_bytes(bool flash, int64_t n) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t s[3] = {2, n, 16};
    ta_inputs in = ta_make(ctx, 3, s, 60);
    int64_t base = tsys_mem_stats_get(ctx, TSYS_CPU).live_bytes;
    tsys_mem_reset_peak(ctx, TSYS_CPU);
    tsys_tensor *o = flash ? tsys_flash_attention(ctx, in.q, in.k, in.v, true, NULL) : tsys_attention_naive(ctx, in.q, in.k, in.v, true);
    tsys_backward_with(ctx, o, in.dout);
    tsys_tensor_release(o);
    int64_t extra = tsys_mem_stats_get(ctx, TSYS_CPU).peak_bytes - base;
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    ta_free(&in);
    tsys_ctx_free(ctx);
    return extra;
}

// Flash keeps O(batch * seq) extra memory (O, L, the gradients); naive keeps the (seq x seq) scores.
TSYS_TEST(attention_memory_linear) {
    int64_t f1 = ta_extra_bytes(true, 256), f2 = ta_extra_bytes(true, 512), n1 = ta_extra_bytes(false, 256), n2 = ta_extra_bytes(false, 512);
    TEST_CHECK(f1 > 0 && (double)f2 / (double)f1 <= 2.1, "flash extra memory %lld -> %lld bytes when seq doubles (want <= 2.1x)", (long long)f1, (long long)f2);
    TEST_CHECK(n1 > 0 && (double)n2 / (double)n1 >= 3.5, "naive extra memory %lld -> %lld bytes when seq doubles (want ~4x)", (long long)n1, (long long)n2);
    TEST_CHECK(f2 < n2 / 8, "flash (%lld bytes) should need far less than naive (%lld) at seq 512", (long long)f2, (long long)n2);
}

int main(int argc, char **argv) { return tsys_test_main(argc, argv); }
