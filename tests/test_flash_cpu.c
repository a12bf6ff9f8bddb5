// test_flash_cpu.c - the tiled CPU FlashAttention-2 of tsys.h against naive attention in double.
//
//   make build/test_flash_cpu && build/test_flash_cpu
//
// Naive = the CS336 test's reference: S = q k^T * scale, causal S = where(i >= j, S, -1e6), P = softmax(S),
// O = P v, L = logsumexp(S); gradients by the softmax Jacobian written out, all in double.
#define TSYS_IMPLEMENTATION
#include "../tsys.h"   // the tiled CPU FlashAttention lives in its implementation
#include "harness.h"

#include <stdlib.h>

static uint64_t rng_state = 0x243f6a8885a308d3ull;
static float randn(void) {   // Box-Muller on xorshift64*
    double u[2];
    for (int i = 0; i < 2; i++) {
        rng_state ^= rng_state >> 12; rng_state ^= rng_state << 25; rng_state ^= rng_state >> 27;
        u[i] = ((rng_state * 2685821657736338717ull) >> 11) * (1.0 / 9007199254740992.0);
    }
    return (float)(sqrt(-2.0 * log(u[0] + 1e-300)) * cos(6.283185307179586 * u[1]));
}
static float *rand_buf(long n) { float *p = malloc(sizeof(float) * n); for (long i = 0; i < n; i++) p[i] = randn(); return p; }
static float *poison_buf(long n) { float *p = malloc(sizeof(float) * n); for (long i = 0; i < n; i++) p[i] = NAN; return p; }

// Naive forward and backward of one problem in double; outputs fp32.
static void naive_attention(const float *q, const float *k, const float *v, const float *dout,
                            float *o, float *lse, float *dq, float *dk, float *dv,
                            long bh, long nq, long nk, long d, double scale, bool causal) {
    double *s = malloc(sizeof(double) * nk), *dp = malloc(sizeof(double) * nk);
    for (long i = 0; i < bh * nq * d; i++) dq[i] = 0;
    for (long i = 0; i < bh * nk * d; i++) dk[i] = dv[i] = 0;
    for (long b = 0; b < bh; b++) {
        const float *qb = q + b * nq * d, *kb = k + b * nk * d, *vb = v + b * nk * d, *gb = dout + b * nq * d;
        for (long i = 0; i < nq; i++) {
            double mx = -INFINITY;
            for (long j = 0; j < nk; j++) {
                double acc = 0;
                for (long c = 0; c < d; c++) acc += (double)qb[i * d + c] * kb[j * d + c];
                acc *= scale;
                if (causal && i < j) acc += -1e6;
                s[j] = acc; if (acc > mx) mx = acc;
            }
            double sum = 0;
            for (long j = 0; j < nk; j++) { s[j] = exp(s[j] - mx); sum += s[j]; }
            for (long j = 0; j < nk; j++) s[j] /= sum;                      // s is now P
            lse[b * nq + i] = (float)(mx + log(sum));
            double dsum = 0;
            for (long c = 0; c < d; c++) {
                double acc = 0;
                for (long j = 0; j < nk; j++) acc += s[j] * vb[j * d + c];
                o[(b * nq + i) * d + c] = (float)acc;
            }
            for (long j = 0; j < nk; j++) {
                double acc = 0;
                for (long c = 0; c < d; c++) acc += (double)gb[i * d + c] * vb[j * d + c];
                dp[j] = acc; dsum += s[j] * acc;
            }
            for (long j = 0; j < nk; j++) {
                double ds = s[j] * (dp[j] - dsum) * scale;
                for (long c = 0; c < d; c++) {
                    dq[(b * nq + i) * d + c] += (float)(ds * kb[j * d + c]);
                    dk[(b * nk + j) * d + c] += (float)(ds * qb[i * d + c]);
                    dv[(b * nk + j) * d + c] += (float)(s[j] * gb[i * d + c]);
                }
            }
        }
    }
    free(s); free(dp);
}

// One case: fresh random inputs, poisoned outputs, tiled vs naive.
static void check_case(long bh, long nq, long nk, long d, bool causal) {
    const float scale = 1.0f / sqrtf((float)d);
    float *q = rand_buf(bh * nq * d), *k = rand_buf(bh * nk * d), *v = rand_buf(bh * nk * d), *g = rand_buf(bh * nq * d);
    float *o = poison_buf(bh * nq * d), *l = poison_buf(bh * nq);
    float *dq = poison_buf(bh * nq * d), *dk = poison_buf(bh * nk * d), *dv = poison_buf(bh * nk * d);
    float *ro = malloc(sizeof(float) * bh * nq * d), *rl = malloc(sizeof(float) * bh * nq);
    float *rdq = malloc(sizeof(float) * bh * nq * d), *rdk = malloc(sizeof(float) * bh * nk * d), *rdv = malloc(sizeof(float) * bh * nk * d);
    naive_attention(q, k, v, g, ro, rl, rdq, rdk, rdv, bh, nq, nk, d, scale, causal);
    tsys__cpu_flash_fwd(q, k, v, o, l, bh, nq, nk, d, scale, causal);
    tsys__cpu_flash_bwd(g, q, k, v, o, l, dq, dk, dv, bh, nq, nk, d, scale, causal);
    double e[5] = { tsys_test_rel_err(o, ro, bh * nq * d), tsys_test_rel_err(l, rl, bh * nq),
                    tsys_test_rel_err(dq, rdq, bh * nq * d), tsys_test_rel_err(dk, rdk, bh * nk * d),
                    tsys_test_rel_err(dv, rdv, bh * nk * d) };
    const char *names[5] = { "O", "L", "dQ", "dK", "dV" };
    for (int i = 0; i < 5; i++)
        TEST_CHECK(e[i] < 1e-5, "%s rel err %.3g (bh %ld nq %ld nk %ld d %ld causal %d)", names[i], e[i], bh, nq, nk, d, causal);
    // the CS336 test's own criterion too: allclose(rtol 1e-2, atol 1e-2)
    TEST_CHECK(tsys_test_close_ratio(o, ro, bh * nq * d, 1e-2, 1e-2) <= 1, "O not allclose");
    TEST_CHECK(tsys_test_close_ratio(dq, rdq, bh * nq * d, 1e-2, 1e-2) <= 1, "dQ not allclose");
    free(q); free(k); free(v); free(g); free(o); free(l); free(dq); free(dk); free(dv);
    free(ro); free(rl); free(rdq); free(rdk); free(rdv);
}

TSYS_TEST(flash_cpu_cs336_contract) { check_case(4, 128, 128, 64, false); }
TSYS_TEST(flash_cpu_cs336_contract_causal) { check_case(4, 128, 128, 64, true); }
TSYS_TEST(flash_cpu_odd_lengths) {
    static const long ns[] = { 1, 17, 100, 257 };
    for (int i = 0; i < 4; i++) { check_case(2, ns[i], ns[i], 32, false); check_case(2, ns[i], ns[i], 32, true); }
}
TSYS_TEST(flash_cpu_d80) { check_case(3, 100, 100, 80, false); check_case(3, 100, 100, 80, true); }
TSYS_TEST(flash_cpu_head_dims) {
    static const long ds[] = { 16, 32, 128 };
    for (int i = 0; i < 3; i++) { check_case(2, 65, 65, ds[i], true); check_case(1, 64, 64, ds[i], false); }
}
TSYS_TEST(flash_cpu_cross_lengths) {   // n_q != n_k (not used by the model; the CPU code allows it)
    check_case(2, 40, 77, 16, false); check_case(2, 77, 40, 16, true);
}
// The naive reference's L must equal torch.logsumexp of the -1e6-masked scores: a causal row 0 has one
// kept key, so L[0] = scale * q0.k0 exactly.
TSYS_TEST(flash_cpu_causal_lse_row0) {
    const long d = 16;
    float *q = rand_buf(4 * d), *k = rand_buf(4 * d), *v = rand_buf(4 * d), o[4 * 16], l[4];
    tsys__cpu_flash_fwd(q, k, v, o, l, 1, 4, 4, d, 0.25f, true);
    float s = 0; for (long c = 0; c < d; c++) s += q[c] * k[c];
    TEST_CHECK(fabsf(l[0] - 0.25f * s) < 1e-5f, "L[0] %g vs %g", l[0], 0.25f * s);
    for (long c = 0; c < d; c++) TEST_CHECK(o[c] == v[c], "O row 0 must be v row 0");
    free(q); free(k); free(v);
}

int main(int argc, char **argv) { return tsys_test_main(argc, argv); }
