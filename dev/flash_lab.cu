// flash_lab.cu - kernel lab for FlashAttention-2, through the public API only: the CUDA kernels (tsys_cuda.cuh,
// >>flash, launched as TSYS_K_FLASH_FWD/BWD by the context's CUDA backend) against the tiled CPU reference (the
// same kernels of the CPU backend), the CPU reference against naive attention in double, determinism of the
// backward, then timings of the CS336 leaderboard shape and the comparisons behind the kernels' choices.
//
//   make build/flash_lab && build/flash_lab [test|perf|all|lb|tf32fwd|pad|lbfused|pdl|nondet] [auto|ws|wgmma|mma]
//   (compute_90a/sm_90a compiles the wgmma kernels; with compute_90/sm_90 only the mma.sync ones exist.)
//   The second word picks the FlashAttention implementation for bf16/fp16 at d = 64, 128 (tsys_cuda_desc.flash:
//   asking for one this binary or device cannot run is an error). Without it, `test` checks every implementation
//   the device can run, one after the other, and the timings use auto.
//
//   test     CUDA vs CPU reference for fp32 (exact), bf16, fp16 at every head dim, causal and not, odd lengths;
//            the backward run twice for the same bytes; the fused backward, its dQ in arrival order and the
//            tail-launched dK/dV kernel against the backward without them (tsys_cuda_desc.flash_no_fused,
//            flash_nondeterministic, flash_no_pdl)
//   perf     forward, backward, forward + backward at the leaderboard and a few other shapes; `lb`: the two
//            leaderboard rows only
//   tf32fwd  the TF32 forward (fp32 inputs) against the CPU reference and mma.sync, then timed at batch 1
//   pad      d 16 / 32 / 80 / 96 zero-padded onto the Hopper kernels (ws) against mma.sync
//   lbfused  forward + backward with the fused backward and with the two 7-matmul kernels, alternating
//   pdl      the backward with the dK/dV kernel launched in the dQ kernel's tail and without, alternating
//   nondet   the fused backward's dQ added in a fixed order and in arrival order (desc.flash_nondeterministic)
//
// Every check draws fresh random inputs (never zeros) and poisons the outputs with NaN bytes first, so an
// unwritten element fails. Timings: CUDA events on the context's stream, median of many repetitions after
// warm-up; TFLOP/s in the FlashAttention convention (fwd 4*bh*n^2*d, halved when causal; bwd 2.5x fwd; fwd+bwd
// 3.5x fwd).
#define TSYS_IMPLEMENTATION
#include "../tsys.h"
#define TSYS_CUDA_IMPLEMENTATION
#include "../tsys_cuda.cuh"

#include <algorithm>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utility>
#include <vector>

#define CHECK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #x); exit(1); } } while (0)

// Lab dtypes: 0 fp32 on the exact SIMT kernels, 1 bf16, 2 fp16, 3 fp32 on TF32 tensor cores.
enum { LAB_F32 = 0, LAB_BF16 = 1, LAB_F16 = 2, LAB_TF32 = 3 };
static const char *dtype_name[4] = { "f32", "bf16", "f16", "tf32" };
static const size_t dtype_size[4] = { 4, 2, 2, 4 };
static const tsys_dtype dtype_tsys[4] = { TSYS_F32, TSYS_BF16, TSYS_F16, TSYS_F32 };

// One context; its CUDA backend runs the kernels, its CPU backend the reference.
static tsys_ctx *lab_ctx;
static cudaStream_t lab_stream;
// The implementation the lab asked the context for (lab_use), and its name.
static tsys_cuda_flash_impl lab_impl = TSYS_CUDA_FLASH_AUTO;
static const char *lab_impl_name = "auto";
static bool lab_use(tsys_cuda_flash_impl impl) {
    if (tsys_cuda_set_flash_impl(lab_ctx, impl) != TSYS_OK) {
        printf("  (flash implementation %s skipped: %s)\n", tsys_cuda_flash_impl_name(impl), tsys_ctx_last_error(lab_ctx));
        tsys_ctx_clear_error(lab_ctx);
        return false;
    }
    lab_impl = impl;
    lab_impl_name = tsys_cuda_flash_impl_name(impl);
    return true;
}
static void lab_status(tsys_status s, const char *what) {
    if (s == TSYS_OK) return;
    fprintf(stderr, "flash_lab: %s: %s\n", what, tsys_ctx_last_error(lab_ctx));
    exit(1);
}

// ---- host data ------------------------------------------------------------------------------------
static uint64_t rng = 0x9e3779b97f4a7c15ull;
static float randn() {
    double u[2];
    for (int i = 0; i < 2; i++) {
        rng ^= rng >> 12; rng ^= rng << 25; rng ^= rng >> 27;
        u[i] = ((rng * 2685821657736338717ull) >> 11) * (1.0 / 9007199254740992.0);
    }
    return (float)(sqrt(-2.0 * log(u[0] + 1e-300)) * cos(6.283185307179586 * u[1]));
}

// Round a float to the dtype and back, and store it in the dtype's bytes.
static float round_to(int dt, float x, void *dst, size_t i) {
    if (dt == 0 || dt == 3) { ((float *)dst)[i] = x; return x; }
    if (dt == 1) { __nv_bfloat16 h = __float2bfloat16(x); ((__nv_bfloat16 *)dst)[i] = h; return __bfloat162float(h); }
    __half h = __float2half(x); ((__half *)dst)[i] = h; return __half2float(h);
}
static float load_from(int dt, const void *src, size_t i) {
    if (dt == 0 || dt == 3) return ((const float *)src)[i];
    if (dt == 1) return __bfloat162float(((const __nv_bfloat16 *)src)[i]);
    return __half2float(((const __half *)src)[i]);
}

// A (bh, n, d) tensor on both sides: fp32 host values (rounded to the dtype), raw host bytes, a CUDA tensor.
struct Buf {
    int dt; size_t n;
    std::vector<float> h;
    std::vector<unsigned char> raw;
    tsys_tensor *t;
    Buf(int dt_, long bh, long rows, long cols = 1) : dt(dt_), n((size_t)(bh * rows * cols)), h(n), raw(n * dtype_size[dt_]) {
        const int64_t shape[3] = { bh, rows, cols };
        t = tsys_tensor_new(lab_ctx, dtype_tsys[dt], TSYS_CUDA, cols == 1 ? 2 : 3, shape);
        if (!t) lab_status(tsys_ctx_status(lab_ctx) != TSYS_OK ? tsys_ctx_status(lab_ctx) : TSYS_ERR_OOM, "tensor");
    }
    ~Buf() { tsys_tensor_release(t); }
    Buf(const Buf &) = delete;
    Buf &operator=(const Buf &) = delete;
    void randomize() {
        for (size_t i = 0; i < n; i++) h[i] = round_to(dt, randn(), raw.data(), i);
        CHECK(cudaMemcpyAsync(tsys_tensor_data(t), raw.data(), raw.size(), cudaMemcpyHostToDevice, lab_stream));
        CHECK(cudaStreamSynchronize(lab_stream));
    }
    void poison() { CHECK(cudaMemsetAsync(tsys_tensor_data(t), 0xff, raw.size(), lab_stream)); }   // NaN in every dtype
    void download() {
        lab_status(tsys_tensor_to_host(lab_ctx, t, raw.data()), "download");
        for (size_t i = 0; i < n; i++) h[i] = load_from(dt, raw.data(), i);
    }
};

// The CUDA backend's kernels, as tsys.h's ops launch them (the kernel contract: tsys.h, TSYS_K_FLASH_FWD/BWD).
// fp32 tensors run the exact SIMT kernels for LAB_F32 and the TF32 ones for LAB_TF32.
static void lab_kernel(tsys_device dev, tsys_kernel k, tsys_kargs *a, int dt) {
    if (dev == TSYS_CUDA) tsys_cuda_set_flash_fp32_exact(lab_ctx, dt == LAB_F32);
    lab_status(tsys_ctx_backend(lab_ctx, dev)->kernel(lab_ctx, k, a), tsys_kernel_name(k));
}
static void flash_fwd(Buf &q, Buf &k, Buf &v, Buf &o, Buf &lse, bool causal, float scale) {
    tsys_kargs a; memset(&a, 0, sizeof a);
    a.t[0] = o.t; a.t[1] = lse.t; a.t[2] = q.t; a.t[3] = k.t; a.t[4] = v.t; a.i[0] = causal; a.f[0] = scale;
    lab_kernel(TSYS_CUDA, TSYS_K_FLASH_FWD, &a, q.dt);
}
static void flash_bwd(Buf &g, Buf &q, Buf &k, Buf &v, Buf &o, Buf &lse, Buf &dq, Buf &dk, Buf &dv, bool causal, float scale) {
    tsys_kargs a; memset(&a, 0, sizeof a);
    a.t[0] = dq.t; a.t[1] = dk.t; a.t[2] = dv.t; a.t[3] = g.t; a.t[4] = q.t; a.t[5] = k.t; a.t[6] = v.t; a.t[7] = o.t; a.t[8] = lse.t;
    a.i[0] = causal; a.f[0] = scale;
    lab_kernel(TSYS_CUDA, TSYS_K_FLASH_BWD, &a, q.dt);
}

// The CPU backend's tiled reference on fp32 host arrays (bh, n, d): forward (o, lse) and, with g, the backward.
static void cpu_flash(const float *q, const float *k, const float *v, const float *g, float *o, float *lse, float *dq, float *dk,
                      float *dv, long bh, long n, long d, float scale, bool causal) {
    const int64_t s3[3] = { bh, n, d }, s2[2] = { bh, n };
    tsys_tensor *t[9];
    const float *in[4] = { q, k, v, g };
    for (int i = 0; i < 4; i++) t[i] = in[i] ? tsys_tensor_from_data(lab_ctx, TSYS_F32, TSYS_CPU, 3, s3, in[i]) : NULL;
    t[4] = tsys_tensor_new(lab_ctx, TSYS_F32, TSYS_CPU, 3, s3);   // o
    t[5] = tsys_tensor_new(lab_ctx, TSYS_F32, TSYS_CPU, 2, s2);   // lse
    for (int i = 6; i < 9; i++) t[i] = g ? tsys_tensor_new(lab_ctx, TSYS_F32, TSYS_CPU, 3, s3) : NULL;
    tsys_kargs a; memset(&a, 0, sizeof a);
    a.t[0] = t[4]; a.t[1] = t[5]; a.t[2] = t[0]; a.t[3] = t[1]; a.t[4] = t[2]; a.i[0] = causal; a.f[0] = scale;
    lab_kernel(TSYS_CPU, TSYS_K_FLASH_FWD, &a, LAB_F32);
    if (g) {
        memset(&a, 0, sizeof a);
        a.t[0] = t[6]; a.t[1] = t[7]; a.t[2] = t[8]; a.t[3] = t[3]; a.t[4] = t[0]; a.t[5] = t[1]; a.t[6] = t[2]; a.t[7] = t[4]; a.t[8] = t[5];
        a.i[0] = causal; a.f[0] = scale;
        lab_kernel(TSYS_CPU, TSYS_K_FLASH_BWD, &a, LAB_F32);
    }
    const size_t N = (size_t)(bh * n * d);
    memcpy(o, tsys_tensor_data(t[4]), N * sizeof(float));
    memcpy(lse, tsys_tensor_data(t[5]), (size_t)(bh * n) * sizeof(float));
    if (g) {
        memcpy(dq, tsys_tensor_data(t[6]), N * sizeof(float));
        memcpy(dk, tsys_tensor_data(t[7]), N * sizeof(float));
        memcpy(dv, tsys_tensor_data(t[8]), N * sizeof(float));
    }
    for (int i = 0; i < 9; i++) tsys_tensor_release(t[i]);
}

// ||a - b|| / ||b||; NaN anywhere -> inf.
static double rel_err(const float *a, const float *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (a[i] != a[i] || b[i] != b[i]) return INFINITY;
        double d = (double)a[i] - b[i]; num += d * d; den += (double)b[i] * b[i];
    }
    // floor: a reference that is (nearly) all zeros, e.g. dQ and dK at n = 1, is judged in absolute terms
    return sqrt(num) / std::max(sqrt(den), 1e-2 * sqrt((double)n));
}

static int n_pass = 0, n_fail = 0;
static void report(bool ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void report(bool ok, const char *fmt, ...) {
    va_list ap; va_start(ap, fmt);
    printf("%s ", ok ? "  ok  " : "  FAIL");
    vprintf(fmt, ap); printf("\n"); va_end(ap);
    (ok ? n_pass : n_fail)++;
}

// ---- naive attention in double (to check the CPU reference) -----------------------------------------
static void naive_attention(const float *q, const float *k, const float *v, const float *g, float *o, float *lse,
                            float *dq, float *dk, float *dv, long bh, long n, long d, double scale, bool causal) {
    std::vector<double> p(n), dp(n);
    std::fill(dq, dq + bh * n * d, 0.0f); std::fill(dk, dk + bh * n * d, 0.0f); std::fill(dv, dv + bh * n * d, 0.0f);
    for (long b = 0; b < bh; b++) {
        const float *qb = q + b * n * d, *kb = k + b * n * d, *vb = v + b * n * d, *gb = g + b * n * d;
        for (long i = 0; i < n; i++) {
            double mx = -INFINITY;
            for (long j = 0; j < n; j++) {
                double s = 0; for (long c = 0; c < d; c++) s += (double)qb[i * d + c] * kb[j * d + c];
                s *= scale; if (causal && i < j) s += -1e6;
                p[j] = s; mx = std::max(mx, s);
            }
            double sum = 0; for (long j = 0; j < n; j++) { p[j] = exp(p[j] - mx); sum += p[j]; }
            for (long j = 0; j < n; j++) p[j] /= sum;
            lse[b * n + i] = (float)(mx + log(sum));
            for (long c = 0; c < d; c++) { double a = 0; for (long j = 0; j < n; j++) a += p[j] * vb[j * d + c]; o[(b * n + i) * d + c] = (float)a; }
            double dsum = 0;
            for (long j = 0; j < n; j++) { double a = 0; for (long c = 0; c < d; c++) a += (double)gb[i * d + c] * vb[j * d + c]; dp[j] = a; dsum += p[j] * a; }
            for (long j = 0; j < n; j++) {
                double ds = p[j] * (dp[j] - dsum) * scale;
                for (long c = 0; c < d; c++) {
                    dq[(b * n + i) * d + c] += (float)(ds * kb[j * d + c]);
                    dk[(b * n + j) * d + c] += (float)(ds * qb[i * d + c]);
                    dv[(b * n + j) * d + c] += (float)(p[j] * gb[i * d + c]);
                }
            }
        }
    }
}

static void check_cpu_vs_naive(long bh, long n, long d, bool causal) {
    const size_t N = bh * n * d;
    std::vector<float> q(N), k(N), v(N), g(N), o(N, NAN), l(bh * n, NAN), dq(N, NAN), dk(N, NAN), dv(N, NAN);
    std::vector<float> ro(N), rl(bh * n), rdq(N), rdk(N), rdv(N);
    for (size_t i = 0; i < N; i++) { q[i] = randn(); k[i] = randn(); v[i] = randn(); g[i] = randn(); }
    const float scale = 1.0f / sqrtf((float)d);
    naive_attention(q.data(), k.data(), v.data(), g.data(), ro.data(), rl.data(), rdq.data(), rdk.data(), rdv.data(), bh, n, d, scale, causal);
    cpu_flash(q.data(), k.data(), v.data(), g.data(), o.data(), l.data(), dq.data(), dk.data(), dv.data(), bh, n, d, scale, causal);
    double e[5] = { rel_err(o.data(), ro.data(), N), rel_err(l.data(), rl.data(), bh * n), rel_err(dq.data(), rdq.data(), N),
                    rel_err(dk.data(), rdk.data(), N), rel_err(dv.data(), rdv.data(), N) };
    double worst = *std::max_element(e, e + 5);
    report(worst < 1e-5, "cpu tiled vs naive(double) bh=%ld n=%ld d=%ld causal=%d: O %.1e L %.1e dQ %.1e dK %.1e dV %.1e",
           bh, n, d, causal, e[0], e[1], e[2], e[3], e[4]);
}

// ---- CUDA vs CPU ------------------------------------------------------------------------------------
static void check_cuda(int dt, long bh, long n, long d, bool causal) {
    const size_t N = bh * n * d, R = bh * n;
    Buf q(dt, bh, n, d), k(dt, bh, n, d), v(dt, bh, n, d), g(dt, bh, n, d), o(dt, bh, n, d), dq(dt, bh, n, d), dk(dt, bh, n, d),
        dv(dt, bh, n, d), lse(LAB_F32, bh, n);
    q.randomize(); k.randomize(); v.randomize(); g.randomize();
    o.poison(); lse.poison(); dq.poison(); dk.poison(); dv.poison();
    const float scale = 1.0f / sqrtf((float)d);
    flash_fwd(q, k, v, o, lse, causal, scale);
    flash_bwd(g, q, k, v, o, lse, dq, dk, dv, causal, scale);
    o.download(); lse.download(); dq.download(); dk.download(); dv.download();
    // determinism: the backward again, into poisoned buffers, must give the same bytes
    std::vector<unsigned char> dq1 = dq.raw, dk1 = dk.raw, dv1 = dv.raw;
    dq.poison(); dk.poison(); dv.poison();
    flash_bwd(g, q, k, v, o, lse, dq, dk, dv, causal, scale);
    dq.download(); dk.download(); dv.download();
    const bool same = dq1 == dq.raw && dk1 == dk.raw && dv1 == dv.raw;
    // the CPU reference on the same (rounded) inputs
    std::vector<float> ro(N), rl(R), rdq(N), rdk(N), rdv(N);
    cpu_flash(q.h.data(), k.h.data(), v.h.data(), g.h.data(), ro.data(), rl.data(), rdq.data(), rdk.data(), rdv.data(), bh, n, d, scale, causal);
    double e[5] = { rel_err(o.h.data(), ro.data(), N), rel_err(lse.h.data(), rl.data(), R), rel_err(dq.h.data(), rdq.data(), N),
                    rel_err(dk.h.data(), rdk.data(), N), rel_err(dv.h.data(), rdv.data(), N) };
    const double tol = dt == LAB_F32 ? 1e-4 : 1e-2;
    double worst = *std::max_element(e, e + 5);
    report(worst < tol && same, "cuda %-5s %-4s bh=%ld n=%-5ld d=%-3ld causal=%d: O %.1e L %.1e dQ %.1e dK %.1e dV %.1e  deterministic=%s",
           lab_impl_name, dtype_name[dt], bh, n, d, causal, e[0], e[1], e[2], e[3], e[4], same ? "yes" : "NO");
}

static void run_cuda_tests() {
    for (int dt = 0; dt < 3; dt++)
        for (int c = 0; c < 2; c++) check_cuda(dt, 4, 128, 64, c);   // the CS336 contract shape
    static const long ns[] = { 1, 17, 100, 257 };
    static const long ds[] = { 16, 32, 64, 80, 96, 128 };
    for (int dt = 0; dt < 3; dt++)
        for (long n : ns)
            for (int c = 0; c < 2; c++) check_cuda(dt, 3, n, 64, c);
    for (int dt = 0; dt < 3; dt++)
        for (long d : ds)
            for (int c = 0; c < 2; c++) check_cuda(dt, 2, d == 80 || d == 96 ? 257 : 100, d, c);
    for (int dt = 1; dt < 3; dt++) check_cuda(dt, 2, 1000, 64, true), check_cuda(dt, 2, 1000, 128, false);
    check_cuda(0, 1, 700, 80, true);
}

// The backward with and without one of its choices (set(ctx, true) turns it off): the fused backward (16-bit
// d 128 from 16384 rows, where the rule takes it; at batch 1 the kernels it replaces split) against the 7-matmul
// kernels, and the dK/dV kernel launched in the dQ kernel's tail against an ordinary launch (d 64 and 128), causal
// and not, outputs poisoned before each run; `same`: the two must give the same bits (else the same results to
// 1e-2); then the same bits from a second run.
static void check_switch(const char *what, void (*set)(tsys_ctx *, bool), long bh, long n, long d, bool same_bits) {
    const size_t N = bh * n * d;
    for (int c = 0; c < 2; c++) {
        const bool causal = c == 0;
        Buf q(LAB_BF16, bh, n, d), k(LAB_BF16, bh, n, d), v(LAB_BF16, bh, n, d), g(LAB_BF16, bh, n, d), o(LAB_BF16, bh, n, d), lse(LAB_F32, bh, n);
        Buf dq(LAB_BF16, bh, n, d), dk(LAB_BF16, bh, n, d), dv(LAB_BF16, bh, n, d), dq2(LAB_BF16, bh, n, d), dk2(LAB_BF16, bh, n, d), dv2(LAB_BF16, bh, n, d);
        q.randomize(); k.randomize(); v.randomize(); g.randomize();
        const float scale = 1.0f / sqrtf((float)d);
        flash_fwd(q, k, v, o, lse, causal, scale);
        auto bwd = [&](bool off, Buf &gq, Buf &gk, Buf &gv) {
            set(lab_ctx, off);
            gq.poison(); gk.poison(); gv.poison();
            flash_bwd(g, q, k, v, o, lse, gq, gk, gv, causal, scale);
            gq.download(); gk.download(); gv.download();
        };
        bwd(true, dq2, dk2, dv2);
        bwd(false, dq, dk, dv);
        const double eq = rel_err(dq.h.data(), dq2.h.data(), N), ek = rel_err(dk.h.data(), dk2.h.data(), N), ev = rel_err(dv.h.data(), dv2.h.data(), N);
        const bool bits = dq.raw == dq2.raw && dk.raw == dk2.raw && dv.raw == dv2.raw;
        report(same_bits ? bits : eq < 1e-2 && ek < 1e-2 && ev < 1e-2, "%s bf16 %ld x %ld d=%ld causal=%d, on against off: dQ %.1e dK %.1e dV %.1e (same bits: %s)",
               what, bh, n, d, causal, eq, ek, ev, bits ? "yes" : "no");
        const std::vector<unsigned char> rq = dq.raw, rk = dk.raw, rv = dv.raw;
        bwd(false, dq, dk, dv);
        report(dq.raw == rq && dk.raw == rk && dv.raw == rv, "%s bf16 %ld x %ld d=%ld causal=%d: the same bits from two runs", what, bh, n, d, causal);
    }
    set(lab_ctx, false);
}

static void run_tests(const char *impl_arg) {
    printf("== CPU tiled reference vs naive attention (double)\n");
    check_cpu_vs_naive(4, 128, 64, false);
    check_cpu_vs_naive(4, 128, 64, true);
    check_cpu_vs_naive(2, 257, 80, true);
    check_cpu_vs_naive(2, 17, 16, false);
    static const tsys_cuda_flash_impl all[3] = { TSYS_CUDA_FLASH_MMA, TSYS_CUDA_FLASH_WGMMA, TSYS_CUDA_FLASH_WS };
    for (int i = 0; i < 3; i++) {
        if (impl_arg && strcmp(impl_arg, tsys_cuda_flash_impl_name(all[i]))) continue;
        printf("== CUDA vs CPU tiled reference, flash implementation %s\n", tsys_cuda_flash_impl_name(all[i]));
        if (lab_use(all[i])) run_cuda_tests();
    }
    if (impl_arg && !strcmp(impl_arg, "auto")) {
        printf("== CUDA vs CPU tiled reference, flash implementation auto\n");
        if (lab_use(TSYS_CUDA_FLASH_AUTO)) run_cuda_tests();
    }
    if ((!impl_arg || !strcmp(impl_arg, "ws")) && lab_use(TSYS_CUDA_FLASH_WS)) {
        printf("== the warp-specialized backward with and without the fused kernel and the tail launch\n");
        check_switch("fused backward (desc.flash_no_fused)", tsys_cuda_set_flash_no_fused, 16, 16384, 128, false);
        check_switch("fused backward (desc.flash_no_fused)", tsys_cuda_set_flash_no_fused, 1, 32768, 128, false);
        check_switch("fused backward's dQ in order (desc.flash_nondeterministic)", tsys_cuda_set_flash_nondeterministic, 16, 16384, 128, false);
        check_switch("tail-launched dK/dV (desc.flash_no_pdl)", tsys_cuda_set_flash_no_pdl, 16, 16384, 64, true);
        check_switch("tail-launched dK/dV (desc.flash_no_pdl)", tsys_cuda_set_flash_no_pdl, 16, 16384, 128, true);
    }
}

// ---- timing --------------------------------------------------------------------------------------------
template <typename F> static float time_ms(F f, int warm, int reps) {
    cudaEvent_t a, b; CHECK(cudaEventCreate(&a)); CHECK(cudaEventCreate(&b));
    std::vector<float> t;
    for (int i = 0; i < warm; i++) f();
    for (int i = 0; i < reps; i++) {
        CHECK(cudaEventRecord(a, lab_stream)); f(); CHECK(cudaEventRecord(b, lab_stream)); CHECK(cudaEventSynchronize(b));
        float ms; CHECK(cudaEventElapsedTime(&ms, a, b)); t.push_back(ms);
    }
    CHECK(cudaGetLastError());
    std::sort(t.begin(), t.end());
    cudaEventDestroy(a); cudaEventDestroy(b);
    return t[t.size() / 2];
}

// Medians of fa and fb timed in alternation, one run of each in turn (drift in the clocks then touches both alike).
template <typename FA, typename FB> static std::pair<float, float> time_ab(FA fa, FB fb, int warm, int reps) {
    cudaEvent_t e[3]; for (auto &x : e) CHECK(cudaEventCreate(&x));
    std::vector<float> ta, tb;
    for (int i = 0; i < warm; i++) fa(), fb();
    for (int i = 0; i < reps; i++) {
        CHECK(cudaEventRecord(e[0], lab_stream)); fa(); CHECK(cudaEventRecord(e[1], lab_stream)); fb();
        CHECK(cudaEventRecord(e[2], lab_stream)); CHECK(cudaEventSynchronize(e[2]));
        float a, b; CHECK(cudaEventElapsedTime(&a, e[0], e[1])); CHECK(cudaEventElapsedTime(&b, e[1], e[2]));
        ta.push_back(a); tb.push_back(b);
    }
    CHECK(cudaGetLastError());
    std::sort(ta.begin(), ta.end()); std::sort(tb.begin(), tb.end());
    for (auto &x : e) cudaEventDestroy(x);
    return { ta[ta.size() / 2], tb[tb.size() / 2] };
}

// The leaderboard-style problem: random q, k, v, dO of one dtype; outputs and gradients.
struct Problem {
    long bh, n, d; bool causal; float scale;
    Buf q, k, v, g, o, dq, dk, dv, lse;
    Problem(int dt, long bh_, long n_, long d_, bool causal_)
        : bh(bh_), n(n_), d(d_), causal(causal_), scale(1.0f / sqrtf((float)d_)), q(dt, bh_, n_, d_), k(dt, bh_, n_, d_), v(dt, bh_, n_, d_),
          g(dt, bh_, n_, d_), o(dt, bh_, n_, d_), dq(dt, bh_, n_, d_), dk(dt, bh_, n_, d_), dv(dt, bh_, n_, d_), lse(LAB_F32, bh_, n_) {
        q.randomize(); k.randomize(); v.randomize(); g.randomize();
    }
    void fwd() { flash_fwd(q, k, v, o, lse, causal, scale); }
    void bwd() { flash_bwd(g, q, k, v, o, lse, dq, dk, dv, causal, scale); }
    double flops() const { return 4.0 * bh * n * n * d / (causal ? 2 : 1); }
};

static void bench(int dt, long bh, long n, long d, bool causal) {
    Problem p(dt, bh, n, d, causal);
    const int reps = n >= 8192 || dt == LAB_F32 ? 30 : 100;
    float tf = time_ms([&] { p.fwd(); }, 5, reps), tb = time_ms([&] { p.bwd(); }, 5, reps), tfb = time_ms([&] { p.fwd(); p.bwd(); }, 5, reps);
    const double f = p.flops();
    printf("  %-4s %-5s bh=%ld n=%ld d=%ld causal=%d: fwd %.3f ms (%.1f TFLOP/s)  bwd %.3f ms (%.1f)  fwd+bwd %.3f ms (%.1f)\n",
           dtype_name[dt], lab_impl_name, bh, n, d, causal, tf, f / tf / 1e9, tb, 2.5 * f / tb / 1e9, tfb, 3.5 * f / tfb / 1e9);
    fflush(stdout);
}

static void run_perf() {
    cudaDeviceProp p; CHECK(cudaGetDeviceProperties(&p, 0));
    printf("== timings on %s (%d SMs), bf16/fp16 d=64/128 flash implementation: %s (asked for %s)\n", p.name, p.multiProcessorCount,
           tsys_cuda_flash_impl_name(tsys_cuda_get_desc(lab_ctx).flash), lab_impl_name);
    bench(LAB_BF16, 16, 16384, 64, true);    // the CS336 leaderboard shape
    bench(LAB_BF16, 16, 16384, 128, true);
    bench(LAB_F16, 16, 16384, 64, true);
    bench(LAB_BF16, 16, 16384, 64, false);
    bench(LAB_BF16, 16, 4096, 64, true);
    bench(LAB_BF16, 32, 2048, 80, true);
    bench(LAB_F32, 16, 2048, 64, true);      // fp32 SIMT path, for the record
}

// The TF32 forward (fp32 inputs) of the lab's implementation against the CPU reference and against the mma.sync
// TF32 forward; run twice for the same bytes. Then timed beside the mma.sync forward at batch 1 (the sweep's shape).
static void tf32_fwd_check(long bh, long n, bool causal, long d) {
    const size_t N = bh * n * d, R = bh * n;
    const tsys_cuda_flash_impl keep = lab_impl;
    Buf q(LAB_TF32, bh, n, d), k(LAB_TF32, bh, n, d), v(LAB_TF32, bh, n, d), o(LAB_TF32, bh, n, d), lse(LAB_F32, bh, n), o2(LAB_TF32, bh, n, d), lse2(LAB_F32, bh, n);
    q.randomize(); k.randomize(); v.randomize();
    o.poison(); lse.poison(); o2.poison(); lse2.poison();
    const float scale = 1.0f / sqrtf((float)d);
    flash_fwd(q, k, v, o, lse, causal, scale);
    lab_use(TSYS_CUDA_FLASH_MMA);
    flash_fwd(q, k, v, o2, lse2, causal, scale);
    lab_use(keep);
    o.download(); lse.download(); o2.download(); lse2.download();
    std::vector<unsigned char> o1 = o.raw;
    o.poison();
    flash_fwd(q, k, v, o, lse, causal, scale);
    o.download();
    const bool same = o1 == o.raw;
    std::vector<float> ro(N), rl(R);
    cpu_flash(q.h.data(), k.h.data(), v.h.data(), NULL, ro.data(), rl.data(), NULL, NULL, NULL, bh, n, d, scale, causal);
    const double eo = rel_err(o.h.data(), ro.data(), N), el = rel_err(lse.h.data(), rl.data(), R);
    const double mo = rel_err(o2.h.data(), ro.data(), N), ml = rel_err(lse2.h.data(), rl.data(), R), xo = rel_err(o.h.data(), o2.h.data(), N);
    report(std::max(eo, el) < 3e-3 && same, "tf32 fwd %-4s bh=%ld n=%-5ld d=%-3ld causal=%d: O %.1e L %.1e (mma.sync: O %.1e L %.1e; the two %.1e) deterministic=%s",
           lab_impl_name, bh, n, d, causal, eo, el, mo, ml, xo, same ? "yes" : "NO");
}
static void run_tf32_fwd() {
    printf("== TF32 forward (fp32 inputs, d 64 and 128): %s against the CPU reference and mma.sync\n", lab_impl_name);
    for (long d : { 64L, 128L }) {
        for (int c = 0; c < 2; c++)
            for (long n : { 1L, 17L, 100L, 300L, 1000L }) tf32_fwd_check(3, n, c, d);
        tf32_fwd_check(1, 4096, true, d);    // split into shares at batch 1
        tf32_fwd_check(1, 3001, false, d);
    }
    const tsys_cuda_flash_impl keep = lab_impl;
    const char *name = lab_impl_name;
    for (long d : { 64L, 128L })
        for (long n : { 1024L, 2048L, 4096L, 8192L, 16384L, 65536L })
            for (int pass = 0; pass < 2; pass++) {
                if (pass) lab_use(TSYS_CUDA_FLASH_MMA);
                Problem p(LAB_TF32, 1, n, d, true);
                const float t = time_ms([&] { p.fwd(); }, 5, 50);
                printf("  tf32 fwd %-4s bh=1 n=%-5ld d=%-3ld causal: %.3f ms (%.1f TFLOP/s)\n", pass ? "mma" : name, n, d, t, 2.0 * n * n * d / t / 1e9);
                fflush(stdout);
                if (pass) lab_use(keep);
            }
}

// bf16 at d 16, 32 (padded to 64), 80 and 96 (padded to 128) on the Hopper kernels against the mma.sync kernels,
// causal: first checked against the CPU reference with the lab's implementation (auto pads d 16 and 32 from
// 16384 rows) and with ws (which always pads), then timed, ws against mma, at batch 1 and at two batched shapes.
static void run_pad() {
    printf("== d 16 / 32 / 80 / 96 zero-padded onto the Hopper kernels against mma.sync, bf16, causal\n");
    for (long d : { 16L, 32L }) check_cuda(LAB_BF16, 1, 16384, d, true);
    const tsys_cuda_flash_impl keep = lab_impl;
    if (!lab_use(TSYS_CUDA_FLASH_WS)) return;
    check_cuda(LAB_BF16, 2, 3000, 80, true); check_cuda(LAB_BF16, 2, 1000, 80, false);
    check_cuda(LAB_BF16, 2, 3000, 96, true); check_cuda(LAB_BF16, 2, 1000, 96, false);
    struct { long bh, n; } shapes[] = { { 1, 4096 }, { 1, 8192 }, { 1, 16384 }, { 1, 32768 }, { 1, 65536 }, { 128, 256 }, { 32, 2048 } };
    for (long d : { 16L, 32L, 80L, 96L })
        for (auto sh : shapes) {
            lab_use(TSYS_CUDA_FLASH_WS); bench(LAB_BF16, sh.bh, sh.n, d, true);
            lab_use(TSYS_CUDA_FLASH_MMA); bench(LAB_BF16, sh.bh, sh.n, d, true);
        }
    lab_use(keep);
}

// Forward + backward (or the backward alone) with one of the backward's choices on and off (set(ctx, true) turns it
// off), in alternation (two rounds), then each in a run of its own (the clocks then settle to what that
// configuration draws), A B B A.
static void ab_switch(const char *what, void (*set)(tsys_ctx *, bool), long bh, long n, long d, bool causal, bool with_fwd) {
    Problem p(LAB_BF16, bh, n, d, causal);
    p.fwd();
    auto step = [&](bool off) { set(lab_ctx, off); if (with_fwd) p.fwd(); p.bwd(); };
    const char *part = with_fwd ? "fwd + bwd" : "bwd";
    for (int round = 0; round < 2; round++) {
        const auto t = time_ab([&] { step(false); }, [&] { step(true); }, 3, 20);
        printf("  %s bh=%ld n=%ld d=%ld causal=%d, alternating: %s %.3f  without %.3f  (%.3fx)\n", part, bh, n, d, causal, what, t.first, t.second,
               t.second / t.first);
        fflush(stdout);
    }
    const float a1 = time_ms([&] { step(false); }, 5, 30), b1 = time_ms([&] { step(true); }, 5, 30);
    const float b2 = time_ms([&] { step(true); }, 5, 30), a2 = time_ms([&] { step(false); }, 5, 30);
    printf("  %s bh=%ld n=%ld d=%ld causal=%d, runs of 30: %s %.3f / %.3f  without %.3f / %.3f\n", part, bh, n, d, causal, what, a1, a2, b1, b2);
    fflush(stdout);
    set(lab_ctx, false);
}

// The entry points' forward + backward with the fused backward and with the two 7-matmul kernels
// (desc.flash_no_fused), at d 128 shapes where the entry points take the fused kernel.
static void run_lb_fused() {
    printf("== fwd + bwd, bf16, d 128: fused backward / 7-matmul kernels (ms)\n");
    const long shapes[][3] = { { 1, 16384, 1 }, { 1, 32768, 1 }, { 1, 65536, 1 }, { 16, 16384, 1 }, { 8, 32768, 1 },
                               { 32, 16384, 1 }, { 16, 16384, 0 }, { 32, 32768, 1 } };   // last: S26's
    for (auto &sh : shapes) ab_switch("fused", tsys_cuda_set_flash_no_fused, sh[0], sh[1], 128, sh[2] != 0, true);
}

// The fused backward with its dQ parts added in a fixed order (the default) and in arrival order
// (desc.flash_nondeterministic), at the leaderboard's d 128 shape and the S26 step's.
static void run_nondet() {
    printf("== bwd, bf16, d 128, causal: the fused backward's dQ in a fixed order / in arrival order (ms)\n");
    const long shapes[][2] = { { 16, 16384 }, { 32, 32768 } };
    for (auto &sh : shapes) ab_switch("ordered", tsys_cuda_set_flash_nondeterministic, sh[0], sh[1], 128, true, false);
}

// The backward, and forward + backward, with the dK/dV kernel launched in the dQ kernel's tail (programmatic
// dependent launch) and with ordinary launches (desc.flash_no_pdl), at the leaderboard shapes.
static void run_pdl() {
    printf("== bwd and fwd + bwd, bf16, causal, 16 x 16384: dK/dV tail-launched / ordinary launches (ms)\n");
    for (long d : { 64L, 128L }) {
        ab_switch("tail-launched", tsys_cuda_set_flash_no_pdl, 16, 16384, d, true, false);
        ab_switch("tail-launched", tsys_cuda_set_flash_no_pdl, 16, 16384, d, true, true);
    }
}

// True when `mode` is `name` and the warp-specialized kernels can run here; says why not when they cannot.
static bool ws_mode(const char *mode, const char *name) {
    if (strcmp(mode, name)) return false;
    if (tsys_cuda_set_flash_impl(lab_ctx, TSYS_CUDA_FLASH_WS) == TSYS_OK) {
        lab_use(lab_impl);
        return true;
    }
    tsys_ctx_clear_error(lab_ctx);
    printf("== %s: the warp-specialized kernels cannot run here\n", name);
    return false;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "all", *impl_arg = argc > 2 ? argv[2] : NULL;
    tsys_cuda_desc cd;
    memset(&cd, 0, sizeof cd);
    if (impl_arg) {
        int i = 0;
        while (i < 4 && strcmp(impl_arg, tsys_cuda_flash_impl_name((tsys_cuda_flash_impl)i))) i++;
        if (i == 4) { fprintf(stderr, "flash_lab: unknown implementation '%s' (auto, ws, wgmma, mma)\n", impl_arg); return 2; }
        cd.flash = (tsys_cuda_flash_impl)i;
    }
    static const char *const modes[] = { "test", "perf", "all", "lb", "tf32fwd", "pad", "lbfused", "pdl", "nondet" };
    bool known = false;
    for (const char *m : modes) known = known || !strcmp(mode, m);
    if (!known) { fprintf(stderr, "flash_lab: unknown mode '%s' (test, perf, all, lb, tf32fwd, pad, lbfused, pdl, nondet)\n", mode); return 2; }
    lab_ctx = tsys_ctx_new(NULL);
    if (tsys_cuda_init_desc(lab_ctx, &cd) != TSYS_OK) { fprintf(stderr, "flash_lab: %s\n", tsys_ctx_last_error(lab_ctx)); return 1; }
    lab_stream = (cudaStream_t)tsys_cuda_stream(lab_ctx);
    // what the context was given: the argument, or auto or what the environment made of it (get_desc reports
    // auto as the implementation it runs, ws where the warp-specialized kernels can run)
    const tsys_cuda_flash_impl runs = tsys_cuda_get_desc(lab_ctx).flash;
    const tsys_cuda_flash_impl asked = impl_arg ? cd.flash : runs == TSYS_CUDA_FLASH_WS ? TSYS_CUDA_FLASH_AUTO : runs;
    lab_use(asked);
    printf("device %s; flash implementation %s (runs %s)\n", tsys_cuda_device_name(lab_ctx), lab_impl_name, tsys_cuda_flash_impl_name(runs));
    if (!strcmp(mode, "test") || !strcmp(mode, "all")) {
        run_tests(impl_arg);
        lab_use(asked);   // the timings use the context's choice again
    }
    if (!strcmp(mode, "tf32fwd")) run_tf32_fwd();
    if (!strcmp(mode, "pad")) run_pad();
    if (!strcmp(mode, "perf") || !strcmp(mode, "all")) run_perf();
    if (ws_mode(mode, "lbfused")) run_lb_fused();
    if (ws_mode(mode, "pdl")) run_pdl();
    if (ws_mode(mode, "nondet")) run_nondet();
    if (!strcmp(mode, "lb")) bench(LAB_BF16, 16, 16384, 64, true), bench(LAB_BF16, 16, 16384, 128, true);   // leaderboard rows only
    tsys_cuda_shutdown(lab_ctx);
    tsys_ctx_free(lab_ctx);
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}
