// flash_lab.cu - kernel lab for FlashAttention-2: the CUDA kernels (tsys_cuda.cuh, >>flash) against the
// tiled CPU reference (tsys.h), the CPU reference against naive attention in double, determinism of the
// backward, then timings of the CS336 leaderboard shape.
//
//   make build/flash_lab && build/flash_lab [test|perf|all|variants|tf32variants|tf32fwd|pad|wgvariants|wsfwd|wsfwdovl|wsdq|wsdqturns|wsdkdv|kvturns|fused|areg|parts|lb|lbfused|lbturns] [auto|ws|wgmma|mma]
//   (compute_90a/sm_90a compiles the wgmma kernels; with compute_90/sm_90 only the mma.sync ones exist.)
//   The second word picks the FlashAttention implementation for bf16/fp16 at d = 64, 128 (tsys_cuda_flash_impl,
//   set on a tsys context: asking for one this binary or device cannot run is an error). Without it, `test`
//   checks every implementation the device can run, one after the other, and the timings use auto.
//
// Every check draws fresh random inputs (never zeros) and poisons the outputs with NaN bytes first, so an
// unwritten element fails. Timings: CUDA events, median of many repetitions after warm-up; TFLOP/s in the
// FlashAttention convention (fwd 4*bh*n^2*d, halved when causal; bwd 2.5x fwd; fwd+bwd 3.5x fwd).
// The kernels live in the implementations of tsys.h (tiled CPU reference) and tsys_cuda.cuh (CUDA).
#define TSYS_IMPLEMENTATION
#include "../tsys.h"
#define TSYS_CUDA_IMPLEMENTATION
#include "../tsys_cuda.cuh"

#include <algorithm>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utility>
#include <vector>

#define CHECK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #x); exit(1); } } while (0)

static const char *dtype_name[3] = { "f32", "bf16", "f16" };
static const size_t dtype_size[3] = { 4, 2, 2 };

// The lab calls the launchers directly (stream 0, device 0); a tsys context with a CUDA backend decides which
// flash implementations this binary and device can run, and lab_impl is what the launchers are given.
static tsys_ctx *lab_ctx;
static tsys_cuda_flash_impl lab_impl = TSYS_CUDA_FLASH_MMA;
static const char *lab_impl_name = "mma";
static bool lab_use(tsys_cuda_flash_impl impl) {
    if (tsys_cuda_set_flash_impl(lab_ctx, impl) != TSYS_OK) {
        printf("  (flash implementation %s skipped: %s)\n", tsys_cuda_flash_impl_name(impl), tsys_ctx_last_error(lab_ctx));
        tsys_ctx_clear_error(lab_ctx);
        return false;
    }
    lab_impl = tsys_cuda__get(lab_ctx)->flash_run;
    lab_impl_name = tsys_cuda_flash_impl_name(impl);
    return true;
}
static bool lab_wg_available() { return tsys_cuda__get(lab_ctx)->flash_wg_ok; }
// What the wgmma launchers get: the lab's choice when it is a Hopper one, else auto (ws dQ, cp.async fallback).
static tsys_cuda_flash_impl lab_wg_impl() { return lab_impl == TSYS_CUDA_FLASH_MMA ? TSYS_CUDA_FLASH_AUTO : lab_impl; }

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
    if (dt == 0) { ((float *)dst)[i] = x; return x; }
    if (dt == 1) { __nv_bfloat16 h = __float2bfloat16(x); ((__nv_bfloat16 *)dst)[i] = h; return __bfloat162float(h); }
    __half h = __float2half(x); ((__half *)dst)[i] = h; return __half2float(h);
}
static float load_from(int dt, const void *src, size_t i) {
    if (dt == 0) return ((const float *)src)[i];
    if (dt == 1) return __bfloat162float(((const __nv_bfloat16 *)src)[i]);
    return __half2float(((const __half *)src)[i]);
}

// A tensor on both sides: fp32 host values (rounded to the dtype), raw host bytes, device bytes.
struct Buf {
    int dt; size_t n;
    std::vector<float> h;
    std::vector<unsigned char> raw;
    void *d;
    Buf(int dt_, size_t n_) : dt(dt_), n(n_), h(n_), raw(n_ * dtype_size[dt_]) { CHECK(cudaMalloc(&d, raw.size())); }
    ~Buf() { cudaFree(d); }
    void randomize() { for (size_t i = 0; i < n; i++) h[i] = round_to(dt, randn(), raw.data(), i); upload(); }
    void upload() { CHECK(cudaMemcpy(d, raw.data(), raw.size(), cudaMemcpyHostToDevice)); }
    void poison() { CHECK(cudaMemset(d, 0xff, raw.size())); }   // all-ones bytes: NaN in every dtype
    void download() {
        CHECK(cudaMemcpy(raw.data(), d, raw.size(), cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < n; i++) h[i] = load_from(dt, raw.data(), i);
    }
};

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
#include <stdarg.h>
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
    tsys__cpu_flash_fwd(q.data(), k.data(), v.data(), o.data(), l.data(), bh, n, n, d, scale, causal);
    tsys__cpu_flash_bwd(g.data(), q.data(), k.data(), v.data(), o.data(), l.data(), dq.data(), dk.data(), dv.data(), bh, n, n, d, scale, causal);
    double e[5] = { rel_err(o.data(), ro.data(), N), rel_err(l.data(), rl.data(), bh * n), rel_err(dq.data(), rdq.data(), N),
                    rel_err(dk.data(), rdk.data(), N), rel_err(dv.data(), rdv.data(), N) };
    double worst = *std::max_element(e, e + 5);
    report(worst < 1e-5, "cpu tiled vs naive(double) bh=%ld n=%ld d=%ld causal=%d: O %.1e L %.1e dQ %.1e dK %.1e dV %.1e",
           bh, n, d, causal, e[0], e[1], e[2], e[3], e[4]);
}

// Floats of backward scratch: what the entry points need with the lab's implementation (exact), and an upper
// bound for a launcher called with its own tile configuration (the row sums and 8 shares of dK, dV and dQ).
static size_t lab_scratch(int dt, long bh, long n, long d, bool causal) {
    return tsys_cuda__flash_bwd_scratch_bytes(bh, n, d, dt, causal, lab_impl) / sizeof(float);
}
static size_t lab_scratch_max(long bh, long n, long d) { return (size_t)(bh * n + 4) + (size_t)(24 * bh * n * d); }

// ---- CUDA vs CPU ------------------------------------------------------------------------------------
static void check_cuda(int dt, long bh, long n, long d, bool causal) {
    const size_t N = bh * n * d, R = bh * n;
    Buf q(dt, N), k(dt, N), v(dt, N), g(dt, N), o(dt, N), dq(dt, N), dk(dt, N), dv(dt, N), lse(0, R), scratch(0, lab_scratch(dt, bh, n, d, causal));
    Buf fsc(0, tsys_cuda__flash_fwd_scratch_bytes(bh, n, d, dt, causal, lab_impl) / sizeof(float) + 1);   // as the entry points give it
    q.randomize(); k.randomize(); v.randomize(); g.randomize();
    o.poison(); lse.poison(); dq.poison(); dk.poison(); dv.poison(); scratch.poison(); fsc.poison();
    const float scale = 1.0f / sqrtf((float)d);
    CHECK(tsys_cuda__flash_fwd(q.d, k.d, v.d, o.d, (float *)lse.d, dt, bh, n, d, scale, causal, lab_impl, 0, (float *)fsc.d));
    CHECK(tsys_cuda__flash_bwd(g.d, q.d, k.d, v.d, o.d, (float *)lse.d, dq.d, dk.d, dv.d, (float *)scratch.d, dt, bh, n, d, scale, causal, lab_impl, 0));
    CHECK(cudaDeviceSynchronize());
    o.download(); lse.download(); dq.download(); dk.download(); dv.download();
    // determinism: the backward again, into poisoned buffers, must give the same bytes
    std::vector<unsigned char> dq1 = dq.raw, dk1 = dk.raw, dv1 = dv.raw;
    dq.poison(); dk.poison(); dv.poison();
    CHECK(tsys_cuda__flash_bwd(g.d, q.d, k.d, v.d, o.d, (float *)lse.d, dq.d, dk.d, dv.d, (float *)scratch.d, dt, bh, n, d, scale, causal, lab_impl, 0));
    CHECK(cudaDeviceSynchronize());
    dq.download(); dk.download(); dv.download();
    const bool same = dq1 == dq.raw && dk1 == dk.raw && dv1 == dv.raw;
    // the CPU reference on the same (rounded) inputs
    std::vector<float> ro(N), rl(R), rdq(N), rdk(N), rdv(N);
    tsys__cpu_flash_fwd(q.h.data(), k.h.data(), v.h.data(), ro.data(), rl.data(), bh, n, n, d, scale, causal);
    tsys__cpu_flash_bwd(g.h.data(), q.h.data(), k.h.data(), v.h.data(), ro.data(), rl.data(), rdq.data(), rdk.data(), rdv.data(), bh, n, n, d, scale, causal);
    double e[5] = { rel_err(o.h.data(), ro.data(), N), rel_err(lse.h.data(), rl.data(), R), rel_err(dq.h.data(), rdq.data(), N),
                    rel_err(dk.h.data(), rdk.data(), N), rel_err(dv.h.data(), rdv.data(), N) };
    const double tol = dt == 0 ? 1e-4 : 1e-2;
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

// The CUDA checks for the implementation named on the command line, or for each one the device can run.
// The entry points' fused backward (16-bit d 128 on a grid of 2048 key blocks: 16 x 16384, where the rule takes it)
// against their 7-matmul kernels (tsys_cuda__flash_fused_off), causal and not, scratch and outputs poisoned before
// each run (the accumulator needs no clearing: each tile's first add is a copy); then the same bits from a second run.
static void check_fused_entry() {
    const long bh = 16, n = 16384, d = 128;
    const int dt = 1;
    const size_t N = bh * n * d, R = bh * n;
    const bool taken = tsys_cuda__flash_ws_split<__nv_bfloat16, 128>(bh, n).fused;
    for (int c = 0; c < 2; c++) {
        const bool causal = c == 0;
        Buf q(dt, N), k(dt, N), v(dt, N), g(dt, N), o(dt, N), lse(0, R), dq(dt, N), dk(dt, N), dv(dt, N), dq2(dt, N), dk2(dt, N), dv2(dt, N);
        Buf sc(0, lab_scratch(dt, bh, n, d, causal)), fsc(0, tsys_cuda__flash_fwd_scratch_bytes(bh, n, d, dt, causal, lab_impl) / sizeof(float) + 1);
        q.randomize(); k.randomize(); v.randomize(); g.randomize();
        const float scale = 1.0f / sqrtf((float)d);
        CHECK(tsys_cuda__flash_fwd(q.d, k.d, v.d, o.d, (float *)lse.d, dt, bh, n, d, scale, causal, lab_impl, 0, (float *)fsc.d));
        auto bwd = [&](bool fused_off, Buf &gq, Buf &gk, Buf &gv) {
            tsys_cuda__flash_fused_off = fused_off;
            gq.poison(); gk.poison(); gv.poison(); sc.poison();
            CHECK(tsys_cuda__flash_bwd(g.d, q.d, k.d, v.d, o.d, (float *)lse.d, gq.d, gk.d, gv.d, (float *)sc.d, dt, bh, n, d, scale, causal, lab_impl, 0));
            CHECK(cudaDeviceSynchronize());
            gq.download(); gk.download(); gv.download();
        };
        bwd(true, dq2, dk2, dv2);
        bwd(false, dq, dk, dv);
        const double eq = rel_err(dq.h.data(), dq2.h.data(), N), ek = rel_err(dk.h.data(), dk2.h.data(), N), ev = rel_err(dv.h.data(), dv2.h.data(), N);
        report(taken && eq < 1e-2 && ek < 1e-2 && ev < 1e-2, "entry fused backward (taken: %d) bf16 16 x 16384 d=128 causal=%d vs 7-matmul: dQ %.1e dK %.1e dV %.1e",
               taken, causal, eq, ek, ev);
        const std::vector<unsigned char> rq = dq.raw, rk = dk.raw, rv = dv.raw;
        bwd(false, dq, dk, dv);
        report(dq.raw == rq && dk.raw == rk && dv.raw == rv, "entry fused backward bf16 16 x 16384 d=128 causal=%d: the same bits from two runs", causal);
    }
    tsys_cuda__flash_fused_off = false;
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
        printf("== the fused backward through the entry points against their 7-matmul kernels\n");
        check_fused_entry();
    }
}

// ---- timing --------------------------------------------------------------------------------------------
template <typename F> static float time_ms(F f, int warm, int reps) {
    cudaEvent_t a, b; CHECK(cudaEventCreate(&a)); CHECK(cudaEventCreate(&b));
    std::vector<float> t;
    for (int i = 0; i < warm; i++) f();
    for (int i = 0; i < reps; i++) {
        CHECK(cudaEventRecord(a)); f(); CHECK(cudaEventRecord(b)); CHECK(cudaEventSynchronize(b));
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
        CHECK(cudaEventRecord(e[0])); fa(); CHECK(cudaEventRecord(e[1])); fb(); CHECK(cudaEventRecord(e[2])); CHECK(cudaEventSynchronize(e[2]));
        float a, b; CHECK(cudaEventElapsedTime(&a, e[0], e[1])); CHECK(cudaEventElapsedTime(&b, e[1], e[2]));
        ta.push_back(a); tb.push_back(b);
    }
    CHECK(cudaGetLastError());
    std::sort(ta.begin(), ta.end()); std::sort(tb.begin(), tb.end());
    for (auto &x : e) cudaEventDestroy(x);
    return { ta[ta.size() / 2], tb[tb.size() / 2] };
}

// Tile-shape variants of the bf16 causal kernels: each is checked against the default configuration's
// outputs on a 300-row problem, then timed part by part on the benchmark shape.
#define CFG(NAME, A, B, C_, E, F, G, H, I, J) struct NAME { \
    static constexpr int FWD_MT = A, FWD_BK = B, FWD_NW = C_, DKDV_MK = E, DKDV_BQ = F, DKDV_NW = G, DQ_MQ = H, DQ_BK = I, DQ_NW = J; };
CFG(v64a, 2, 64, 4, 1, 64, 8, 1, 64, 8)
CFG(v64b, 1, 64, 8, 2, 32, 4, 2, 32, 4)
CFG(v64c, 2, 32, 4, 2, 64, 4, 2, 64, 4)
CFG(v64d, 1, 128, 4, 2, 32, 8, 1, 128, 8)
CFG(v128a, 1, 64, 4, 1, 32, 8, 1, 32, 8)
CFG(v128b, 2, 32, 4, 1, 64, 8, 1, 64, 8)
CFG(v128c, 1, 64, 8, 1, 32, 4, 1, 32, 4)
CFG(v128d, 1, 32, 4, 1, 32, 4, 1, 64, 4)

// T: __nv_bfloat16, or float for the TF32 kernels (the launchers' dtype TSYS_CUDA__FLASH_TF32).
template <int D, typename C, typename T = __nv_bfloat16> static void variant(const char *name, long bh, long n) {
    constexpr bool tf32 = sizeof(T) == 4;
    const int bt = tf32 ? 0 : 1, ldt = tf32 ? TSYS_CUDA__FLASH_TF32 : 1;   // Buf dtype, launcher dtype
    const float scale = 1.0f / sqrtf((float)D);
    // correctness against the default configuration
    {
        const long sb = 2, sn = 300; const size_t N = sb * sn * D, R = sb * sn;
        Buf q(bt, N), k(bt, N), v(bt, N), g(bt, N), o(bt, N), dq(bt, N), dk(bt, N), dv(bt, N), lse(0, R), sc(0, lab_scratch_max(sb, sn, D));
        Buf o2(bt, N), dq2(bt, N), dk2(bt, N), dv2(bt, N), lse2(0, R);
        q.randomize(); k.randomize(); v.randomize(); g.randomize();
        o2.poison(); dq2.poison(); dk2.poison(); dv2.poison(); lse2.poison();
        CHECK(tsys_cuda__flash_fwd(q.d, k.d, v.d, o.d, (float *)lse.d, ldt, sb, sn, D, scale, true, lab_impl, 0));
        CHECK(tsys_cuda__flash_bwd(g.d, q.d, k.d, v.d, o.d, (float *)lse.d, dq.d, dk.d, dv.d, (float *)sc.d, ldt, sb, sn, D, scale, true, lab_impl, 0));
        CHECK((tsys_cuda__flash_fwd_tc<T, D, true, C>((T *)q.d, (T *)k.d, (T *)v.d, (T *)o2.d, (float *)lse2.d, sb, sn, scale, 0)));
        CHECK((tsys_cuda__flash_bwd_tc<T, D, true, C>((T *)g.d, (T *)q.d, (T *)k.d, (T *)v.d, (T *)o.d, (float *)lse.d, (T *)dq2.d, (T *)dk2.d, (T *)dv2.d, (float *)sc.d, sb, sn, scale, 0)));
        CHECK(cudaDeviceSynchronize());
        o.download(); lse.download(); dq.download(); dk.download(); dv.download();
        o2.download(); lse2.download(); dq2.download(); dk2.download(); dv2.download();
        double e = std::max({ rel_err(o2.h.data(), o.h.data(), N), rel_err(lse2.h.data(), lse.h.data(), R), rel_err(dq2.h.data(), dq.h.data(), N),
                              rel_err(dk2.h.data(), dk.h.data(), N), rel_err(dv2.h.data(), dv.h.data(), N) });
        report(e < 1e-2, "variant %s d=%d matches the default (worst rel err %.1e)", name, D, e);
    }
    const size_t N = bh * n * D, R = bh * n;
    Buf q(bt, N), k(bt, N), v(bt, N), g(bt, N), o(bt, N), dq(bt, N), dk(bt, N), dv(bt, N), lse(0, R), sc(0, lab_scratch_max(bh, n, D));
    q.randomize(); k.randomize(); v.randomize(); g.randomize();
    auto fwd = [&] { CHECK((tsys_cuda__flash_fwd_tc<T, D, true, C>((T *)q.d, (T *)k.d, (T *)v.d, (T *)o.d, (float *)lse.d, bh, n, scale, 0))); };
    auto part = [&](int p) { CHECK((tsys_cuda__flash_bwd_tc<T, D, true, C>((T *)g.d, (T *)q.d, (T *)k.d, (T *)v.d, (T *)o.d, (float *)lse.d, (T *)dq.d, (T *)dk.d, (T *)dv.d, (float *)sc.d, bh, n, scale, 0, p))); };
    fwd(); part(1);
    float tf = time_ms(fwd, 3, 20), tdot = time_ms([&] { part(1); }, 3, 20), tkv = time_ms([&] { part(2); }, 3, 20), tq = time_ms([&] { part(4); }, 3, 20);
    const double f = 4.0 * bh * n * n * D / 2;
    printf("  variant %-6s %s bh=%ld n=%ld d=%d causal: fwd %.3f ms (%.0f TFLOP/s)  D %.3f  dkdv %.3f (%.0f of 4 mm)  dq %.3f (%.0f of 3 mm)  total %.3f ms\n",
           name, tf32 ? "tf32" : "bf16", bh, n, D, tf, f / tf / 1e9, tdot, tkv, 2 * f / tkv / 1e9, tq, 1.5 * f / tq / 1e9, tf + tdot + tkv + tq);
    fflush(stdout);
}

static void run_variants() {
    printf("== tile variants (bf16, causal, 16 x 16384)\n");
    variant<64, v64a>("64a", 16, 16384); variant<64, v64b>("64b", 16, 16384);
    variant<64, v64c>("64c", 16, 16384); variant<64, v64d>("64d", 16, 16384);
    variant<128, v128a>("128a", 16, 16384); variant<128, v128b>("128b", 16, 16384);
    variant<128, v128c>("128c", 16, 16384); variant<128, v128d>("128d", 16, 16384);
}

// TF32 (fp32 inputs) tile variants at batch 1, where the grid is small: the default (t64a), then smaller and
// wider tiles.
CFG(t64a, 2, 64, 4, 2, 64, 4, 1, 128, 8)
CFG(t64b, 1, 64, 4, 1, 64, 4, 1, 64, 4)
CFG(t64c, 1, 32, 4, 1, 32, 4, 1, 32, 4)
CFG(t64d, 2, 32, 4, 2, 32, 4, 1, 64, 4)
CFG(t64e, 1, 64, 8, 1, 64, 8, 1, 64, 8)
static void run_tf32_variants() {
    printf("== TF32 tile variants (fp32 inputs, causal, batch 1)\n");
    for (long n : { 16384L, 4096L }) {
        variant<64, t64a, float>("t64a", 1, n); variant<64, t64b, float>("t64b", 1, n); variant<64, t64c, float>("t64c", 1, n);
        variant<64, t64d, float>("t64d", 1, n); variant<64, t64e, float>("t64e", 1, n);
    }
}

// Hopper (wgmma) tile variants: checked against the mma.sync kernels (the default tile configuration, called
// directly) on a 300-row problem, then timed part by part. Only when the binary was built for sm_90a.
#define WCFG(NAME, A, B, C_, E, F, G, H, I, J) struct NAME { \
    static constexpr int FWD_BK = A, FWD_WG = B, FWD_MINB = C_, DKDV_BQ = E, DKDV_WG = F, DKDV_MINB = G, DQ_BK = H, DQ_WG = I, DQ_MINB = J; };
WCFG(w64a, 128, 3, 1, 128, 2, 1, 128, 2, 1)
WCFG(w64b, 128, 2, 1, 128, 2, 1, 64, 2, 2)    // dq as the default
WCFG(w64c, 64, 3, 1, 128, 2, 1, 64, 3, 1)
WCFG(w64d, 64, 2, 2, 128, 2, 1, 64, 2, 1)
WCFG(w128b, 128, 2, 1, 64, 2, 1, 64, 3, 1)
WCFG(w128c, 64, 2, 2, 64, 1, 2, 64, 2, 2)

template <int D, typename W, bool CAUSAL = true> static void wgvariant(const char *name, long bh, long n) {
    typedef __nv_bfloat16 T;
    const float scale = 1.0f / sqrtf((float)D);
    for (int c = 0; c < 2; c++) {
        const bool causal = c == 0;
        const long sb = 2, sn = 300; const size_t N = sb * sn * D, R = sb * sn;
        Buf q(1, N), k(1, N), v(1, N), g(1, N), o(1, N), dq(1, N), dk(1, N), dv(1, N), lse(0, R), sc(0, lab_scratch_max(sb, sn, D));
        Buf o2(1, N), dq2(1, N), dk2(1, N), dv2(1, N), lse2(0, R);
        q.randomize(); k.randomize(); v.randomize(); g.randomize();
        o2.poison(); dq2.poison(); dk2.poison(); dv2.poison(); lse2.poison();
        if (causal) {
            CHECK((tsys_cuda__flash_fwd_tc<T, D, true>((T *)q.d, (T *)k.d, (T *)v.d, (T *)o.d, (float *)lse.d, sb, sn, scale, 0)));
            CHECK((tsys_cuda__flash_bwd_tc<T, D, true>((T *)g.d, (T *)q.d, (T *)k.d, (T *)v.d, (T *)o.d, (float *)lse.d, (T *)dq.d, (T *)dk.d, (T *)dv.d, (float *)sc.d, sb, sn, scale, 0)));
            CHECK((tsys_cuda__flash_fwd_wg<T, D, true, W>((T *)q.d, (T *)k.d, (T *)v.d, (T *)o2.d, (float *)lse2.d, sb, sn, scale, 0)));
            CHECK((tsys_cuda__flash_bwd_wg<T, D, true, W>((T *)g.d, (T *)q.d, (T *)k.d, (T *)v.d, (T *)o.d, (float *)lse.d, (T *)dq2.d, (T *)dk2.d, (T *)dv2.d, (float *)sc.d, sb, sn, scale, 0, 7, lab_wg_impl())));
        } else {
            CHECK((tsys_cuda__flash_fwd_tc<T, D, false>((T *)q.d, (T *)k.d, (T *)v.d, (T *)o.d, (float *)lse.d, sb, sn, scale, 0)));
            CHECK((tsys_cuda__flash_bwd_tc<T, D, false>((T *)g.d, (T *)q.d, (T *)k.d, (T *)v.d, (T *)o.d, (float *)lse.d, (T *)dq.d, (T *)dk.d, (T *)dv.d, (float *)sc.d, sb, sn, scale, 0)));
            CHECK((tsys_cuda__flash_fwd_wg<T, D, false, W>((T *)q.d, (T *)k.d, (T *)v.d, (T *)o2.d, (float *)lse2.d, sb, sn, scale, 0)));
            CHECK((tsys_cuda__flash_bwd_wg<T, D, false, W>((T *)g.d, (T *)q.d, (T *)k.d, (T *)v.d, (T *)o.d, (float *)lse.d, (T *)dq2.d, (T *)dk2.d, (T *)dv2.d, (float *)sc.d, sb, sn, scale, 0, 7, lab_wg_impl())));
        }
        CHECK(cudaDeviceSynchronize());
        o.download(); lse.download(); dq.download(); dk.download(); dv.download();
        o2.download(); lse2.download(); dq2.download(); dk2.download(); dv2.download();
        double e[5] = { rel_err(o2.h.data(), o.h.data(), N), rel_err(lse2.h.data(), lse.h.data(), R), rel_err(dq2.h.data(), dq.h.data(), N),
                        rel_err(dk2.h.data(), dk.h.data(), N), rel_err(dv2.h.data(), dv.h.data(), N) };
        report(*std::max_element(e, e + 5) < 1e-2, "wg variant %s d=%d causal=%d vs mma.sync: O %.1e L %.1e dQ %.1e dK %.1e dV %.1e",
               name, D, causal, e[0], e[1], e[2], e[3], e[4]);
    }
    const size_t N = bh * n * D, R = bh * n;
    Buf q(1, N), k(1, N), v(1, N), g(1, N), o(1, N), dq(1, N), dk(1, N), dv(1, N), lse(0, R), sc(0, lab_scratch_max(bh, n, D));
    q.randomize(); k.randomize(); v.randomize(); g.randomize();
    auto fwd = [&] { CHECK((tsys_cuda__flash_fwd_wg<T, D, CAUSAL, W>((T *)q.d, (T *)k.d, (T *)v.d, (T *)o.d, (float *)lse.d, bh, n, scale, 0))); };
    auto part = [&](int p) { CHECK((tsys_cuda__flash_bwd_wg<T, D, CAUSAL, W>((T *)g.d, (T *)q.d, (T *)k.d, (T *)v.d, (T *)o.d, (float *)lse.d, (T *)dq.d, (T *)dk.d, (T *)dv.d, (float *)sc.d, bh, n, scale, 0, p, lab_wg_impl()))); };
    fwd(); part(1);
    float tf = time_ms(fwd, 3, 20), tdot = time_ms([&] { part(1); }, 3, 20), tkv = time_ms([&] { part(2); }, 3, 20), tq = time_ms([&] { part(4); }, 3, 20);
    const double f = 4.0 * bh * n * n * D / 2;
    printf("  wg %-6s bf16 bh=%ld n=%ld d=%d causal: fwd %.3f ms (%.0f TFLOP/s)  D %.3f  dkdv %.3f (%.0f of 4 mm)  dq %.3f (%.0f of 3 mm)  total %.3f ms\n",
           name, bh, n, D, tf, f / tf / 1e9, tdot, tkv, 2 * f / tkv / 1e9, tq, 1.5 * f / tq / 1e9, tf + tdot + tkv + tq);
    fflush(stdout);
}

static void run_wgvariants() {
    printf("== wgmma tile variants (bf16, causal, 16 x 16384); wgmma compiled in: %s; dQ: %s\n", lab_wg_available() ? "yes" : "NO",
           lab_wg_impl() == TSYS_CUDA_FLASH_WGMMA ? "cp.async wgmma" : "warp-specialized");
    if (!lab_wg_available()) return;
    wgvariant<64, w64a>("64a", 16, 16384); wgvariant<64, w64b>("64b", 16, 16384);
    wgvariant<64, w64c>("64c", 16, 16384); wgvariant<64, w64d>("64d", 16, 16384);
    wgvariant<128, w128b>("128b", 16, 16384); wgvariant<128, w128c>("128c", 16, 16384);
}

// A bf16 (bh, n, D) problem for the Hopper kernel variants: random q, k, v and dO; outputs, lse and scratch
// enough for any launcher.
// dq, dk, dv: the reference's gradients (lab_mma_reference); dq2, dk2, dv2 (poisoned): the variant's.
struct LabProblem {
    Buf q, k, v, g, o, dq, dk, dv, lse, sc, dq2, dk2, dv2;
    LabProblem(long bh, long n, int D)
        : q(1, bh * n * D), k(1, bh * n * D), v(1, bh * n * D), g(1, bh * n * D), o(1, bh * n * D), dq(1, bh * n * D), dk(1, bh * n * D),
          dv(1, bh * n * D), lse(0, bh * n), sc(0, lab_scratch_max(bh, n, D)), dq2(1, bh * n * D), dk2(1, bh * n * D), dv2(1, bh * n * D) {
        q.randomize(); k.randomize(); v.randomize(); g.randomize();
        dq2.poison(); dk2.poison(); dv2.poison();
    }
};

// The mma.sync forward and backward of a small problem: what the Hopper kernel variants are checked against.
template <typename T, int D>
static void lab_mma_reference(bool causal, LabProblem &p, long sb, long sn, float scale) {
    Buf &q = p.q, &k = p.k, &v = p.v, &g = p.g, &o = p.o, &dq = p.dq, &dk = p.dk, &dv = p.dv, &lse = p.lse, &sc = p.sc;
    if (causal) {
        CHECK((tsys_cuda__flash_fwd_tc<T, D, true>((T *)q.d, (T *)k.d, (T *)v.d, (T *)o.d, (float *)lse.d, sb, sn, scale, 0)));
        CHECK((tsys_cuda__flash_bwd_tc<T, D, true>((T *)g.d, (T *)q.d, (T *)k.d, (T *)v.d, (T *)o.d, (float *)lse.d, (T *)dq.d, (T *)dk.d, (T *)dv.d, (float *)sc.d, sb, sn, scale, 0)));
    } else {
        CHECK((tsys_cuda__flash_fwd_tc<T, D, false>((T *)q.d, (T *)k.d, (T *)v.d, (T *)o.d, (float *)lse.d, sb, sn, scale, 0)));
        CHECK((tsys_cuda__flash_bwd_tc<T, D, false>((T *)g.d, (T *)q.d, (T *)k.d, (T *)v.d, (T *)o.d, (float *)lse.d, (T *)dq.d, (T *)dk.d, (T *)dv.d, (float *)sc.d, sb, sn, scale, 0)));
    }
}

// The checks a kernel variant goes through: a 2 x 300-row problem, causal and not, with the mma.sync kernels'
// outputs in p as the reference. launch(causal, p) runs the variant (into p's second buffers) and returns its
// error; compare(causal, p) downloads and reports. false: the variant did not run (reported).
static const long lab_check_bh = 2, lab_check_n = 300;   // the variants' check problem
template <int D, typename L, typename C> static bool lab_variant_checks(const char *name, L launch, C compare) {
    const long sb = lab_check_bh, sn = lab_check_n;
    for (int c = 0; c < 2; c++) {
        const bool causal = c == 0;
        LabProblem p(sb, sn, D);
        lab_mma_reference<__nv_bfloat16, D>(causal, p, sb, sn, 1.0f / sqrtf((float)D));
        const cudaError_t e1 = launch(causal, p), e2 = cudaDeviceSynchronize();
        if (e1 != cudaSuccess || e2 != cudaSuccess) { report(false, "%s d=%d: %s / %s", name, D, cudaGetErrorString(e1), cudaGetErrorString(e2)); return false; }
        compare(causal, p);
    }
    return true;
}

// Warp-specialized dQ variants (BK keys per tile, CW consumer warpgroups): checked against the mma.sync dQ on a
// 300-row problem, causal and not, then timed on the benchmark shape.
template <int D, int BK, int CW, bool PP = false> static void wsdq_variant(long bh, long n) {
    typedef __nv_bfloat16 T;
    const float scale = 1.0f / sqrtf((float)D);
    char name[64];
    snprintf(name, sizeof name, "ws dq BK=%d CW=%d%s", BK, CW, PP ? " turns" : "");
    auto launch = [&](bool causal, LabProblem &p) {
        return causal ? tsys_cuda__flash_bwd_dq_ws<T, D, true, BK, CW, PP>((T *)p.g.d, (T *)p.q.d, (T *)p.k.d, (T *)p.v.d, (float *)p.lse.d, (float *)p.sc.d, (T *)p.dq2.d, lab_check_bh, lab_check_n, scale, 0)
                      : tsys_cuda__flash_bwd_dq_ws<T, D, false, BK, CW, PP>((T *)p.g.d, (T *)p.q.d, (T *)p.k.d, (T *)p.v.d, (float *)p.lse.d, (float *)p.sc.d, (T *)p.dq2.d, lab_check_bh, lab_check_n, scale, 0);
    };
    auto compare = [&](bool causal, LabProblem &p) {
        p.dq.download(); p.dq2.download();
        const double e = rel_err(p.dq2.h.data(), p.dq.h.data(), p.dq.n);
        report(e < 1e-2, "%s d=%d causal=%d vs mma.sync: dQ %.1e", name, D, causal, e);
    };
    if (!lab_variant_checks<D>(name, launch, compare)) return;
    const size_t N = bh * n * D, R = bh * n;
    Buf q(1, N), k(1, N), v(1, N), g(1, N), dq(1, N), lse(0, R), sc(0, lab_scratch_max(bh, n, D));
    CHECK(cudaMemset(lse.d, 0, R * 4)); CHECK(cudaMemset(sc.d, 0, R * 4));
    auto run = [&] { CHECK((tsys_cuda__flash_bwd_dq_ws<T, D, true, BK, CW, PP>((T *)g.d, (T *)q.d, (T *)k.d, (T *)v.d, (float *)lse.d, (float *)sc.d, (T *)dq.d, bh, n, scale, 0))); };
    const float t = time_ms(run, 3, 20);
    const double f = 4.0 * bh * n * n * D / 2;
    printf("  %s bf16 bh=%ld n=%ld d=%d causal: %.3f ms (%.0f TFLOP/s of 3 mm)\n", name, bh, n, D, t, 1.5 * f / t / 1e9);
    fflush(stdout);
}

// Warp-specialized forward variants (BK keys a tile, CW consumer warpgroups): O and lse against the mma.sync
// forward on a 300-row problem, causal and not, then the benchmark shape timed (causal).
template <int D, int BK, int CW, bool OVL = false, bool PP = false> static void wsfwd_variant(long bh, long n) {
    typedef __nv_bfloat16 T;
    const float scale = 1.0f / sqrtf((float)D);
    char name[64];
    snprintf(name, sizeof name, "ws fwd BK=%d CW=%d%s%s", BK, CW, OVL ? " overlap" : "", PP ? " turns" : "");
    Buf lse2(0, lab_check_bh * lab_check_n);   // O goes to dq2 (NaN-poisoned), lse here
    auto launch = [&](bool causal, LabProblem &p) {
        lse2.poison();
        return causal ? tsys_cuda__flash_fwd_ws<T, D, true, BK, CW, OVL, PP>((T *)p.q.d, (T *)p.k.d, (T *)p.v.d, (T *)p.dq2.d, (float *)lse2.d, lab_check_bh, lab_check_n, scale, 0)
                      : tsys_cuda__flash_fwd_ws<T, D, false, BK, CW, OVL, PP>((T *)p.q.d, (T *)p.k.d, (T *)p.v.d, (T *)p.dq2.d, (float *)lse2.d, lab_check_bh, lab_check_n, scale, 0);
    };
    auto compare = [&](bool causal, LabProblem &p) {
        p.o.download(); p.dq2.download(); p.lse.download(); lse2.download();
        const double eo = rel_err(p.dq2.h.data(), p.o.h.data(), p.o.n), el = rel_err(lse2.h.data(), p.lse.h.data(), p.lse.n);
        report(eo < 1e-2 && el < 1e-5, "%s d=%d causal=%d vs mma.sync: O %.1e lse %.1e", name, D, causal, eo, el);
    };
    if (!lab_variant_checks<D>(name, launch, compare)) return;
    const size_t N = bh * n * D;
    Buf q(1, N), k(1, N), v(1, N), o(1, N), lse(0, bh * n);
    q.randomize(); k.randomize(); v.randomize();
    auto run = [&] { CHECK((tsys_cuda__flash_fwd_ws<T, D, true, BK, CW, OVL, PP>((T *)q.d, (T *)k.d, (T *)v.d, (T *)o.d, (float *)lse.d, bh, n, scale, 0))); };
    const float t = time_ms(run, 3, 20);
    printf("  %s bf16 bh=%ld n=%ld d=%d causal: %.3f ms (%.0f TFLOP/s)\n", name, bh, n, D, t, 2.0 * bh * n * n * D / t / 1e9);
    fflush(stdout);
}

// Warp-specialized dK/dV variants (BQ query rows per tile, CW consumer warpgroups): checked against the mma.sync
// dK/dV on a 300-row problem, causal and not, then timed on the benchmark shape beside the cp.async kernel.
template <int D, int BQ, int CW> static void wsdkdv_variant(long bh, long n) {
    typedef __nv_bfloat16 T;
    const float scale = 1.0f / sqrtf((float)D);
    char name[64];
    snprintf(name, sizeof name, "ws dkdv BQ=%d CW=%d", BQ, CW);
    auto launch = [&](bool causal, LabProblem &p) {
        return causal ? tsys_cuda__flash_bwd_dkdv_ws<T, D, true, BQ, CW>((T *)p.g.d, (T *)p.q.d, (T *)p.k.d, (T *)p.v.d, (float *)p.lse.d, (float *)p.sc.d, (T *)p.dk2.d, (T *)p.dv2.d, lab_check_bh, lab_check_n, scale, 0)
                      : tsys_cuda__flash_bwd_dkdv_ws<T, D, false, BQ, CW>((T *)p.g.d, (T *)p.q.d, (T *)p.k.d, (T *)p.v.d, (float *)p.lse.d, (float *)p.sc.d, (T *)p.dk2.d, (T *)p.dv2.d, lab_check_bh, lab_check_n, scale, 0);
    };
    auto compare = [&](bool causal, LabProblem &p) {
        p.dk.download(); p.dv.download(); p.dk2.download(); p.dv2.download();
        const double ek = rel_err(p.dk2.h.data(), p.dk.h.data(), p.dk.n), ev = rel_err(p.dv2.h.data(), p.dv.h.data(), p.dv.n);
        report(ek < 1e-2 && ev < 1e-2, "%s d=%d causal=%d vs mma.sync: dK %.1e dV %.1e", name, D, causal, ek, ev);
    };
    if (!lab_variant_checks<D>(name, launch, compare)) return;
    LabProblem p(bh, n, D);
    Buf &q = p.q, &k = p.k, &v = p.v, &g = p.g, &o = p.o, &dq = p.dq, &dk = p.dk, &dv = p.dv, &lse = p.lse, &sc = p.sc;
    CHECK((tsys_cuda__flash_fwd_wg<T, D, true>((T *)q.d, (T *)k.d, (T *)v.d, (T *)o.d, (float *)lse.d, bh, n, scale, 0)));
    CHECK((tsys_cuda__flash_bwd_wg<T, D, true>((T *)g.d, (T *)q.d, (T *)k.d, (T *)v.d, (T *)o.d, (float *)lse.d, (T *)dq.d, (T *)dk.d, (T *)dv.d, (float *)sc.d, bh, n, scale, 0, 1)));
    auto ws = [&] { CHECK((tsys_cuda__flash_bwd_dkdv_ws<T, D, true, BQ, CW>((T *)g.d, (T *)q.d, (T *)k.d, (T *)v.d, (float *)lse.d, (float *)sc.d, (T *)dk.d, (T *)dv.d, bh, n, scale, 0))); };
    auto cp = [&] { CHECK((tsys_cuda__flash_bwd_wg<T, D, true>((T *)g.d, (T *)q.d, (T *)k.d, (T *)v.d, (T *)o.d, (float *)lse.d, (T *)dq.d, (T *)dk.d, (T *)dv.d, (float *)sc.d, bh, n, scale, 0, 2, TSYS_CUDA_FLASH_WGMMA))); };
    const float t = time_ms(ws, 3, 20), t0 = time_ms(cp, 3, 20);
    const double f = 4.0 * bh * n * n * D / 2;
    printf("  ws dkdv BQ=%d CW=%d bf16 bh=%ld n=%ld d=%d causal: %.3f ms (%.0f TFLOP/s of 4 mm); cp.async kernel %.3f ms (%.0f)\n", BQ, CW, bh, n, D,
           t, 2 * f / t / 1e9, t0, 2 * f / t0 / 1e9);
    fflush(stdout);
}

// The dK/dV kernel with K and V in registers (AREG, d 64: RS wgmmas for S^T and dP^T, the entry points' choice)
// against the kernel without it: the same bits (and the mma.sync accuracy) on 300- and 1000-row problems, causal
// and not; then both timed twice on the benchmark shape (causal).
template <bool CAUSAL, bool AREG>
static void areg_dkdv(LabProblem &p, Buf &dk, Buf &dv, long bh, long n, float scale) {
    typedef __nv_bfloat16 T;
    CHECK((tsys_cuda__flash_bwd_dkdv_ws<T, 64, CAUSAL, 64, 2, AREG>((T *)p.g.d, (T *)p.q.d, (T *)p.k.d, (T *)p.v.d, (float *)p.lse.d, (float *)p.sc.d,
                                                                   (T *)dk.d, (T *)dv.d, bh, n, scale, 0)));
}
template <bool CAUSAL> static void areg_check(long sn, float scale) {
    typedef __nv_bfloat16 T;
    const long sb = 2;
    const size_t N = sb * sn * 64;
    LabProblem p(sb, sn, 64);
    lab_mma_reference<T, 64>(CAUSAL, p, sb, sn, scale);   // p.sc holds D = rowsum(dO o O) first
    Buf dk1(1, N), dv1(1, N);
    dk1.poison(); dv1.poison();
    areg_dkdv<CAUSAL, false>(p, dk1, dv1, sb, sn, scale);
    areg_dkdv<CAUSAL, true>(p, p.dk2, p.dv2, sb, sn, scale);
    CHECK(cudaDeviceSynchronize());
    for (Buf *b : { &p.dk, &p.dv, &dk1, &dv1, &p.dk2, &p.dv2 }) b->download();
    const double ek = rel_err(p.dk2.h.data(), p.dk.h.data(), N), ev = rel_err(p.dv2.h.data(), p.dv.h.data(), N);
    const bool same = dk1.raw == p.dk2.raw && dv1.raw == p.dv2.raw;
    report(same && ek < 1e-2 && ev < 1e-2, "areg dK/dV n=%ld causal=%d: the shared-memory kernel's bits %s; vs mma.sync dK %.1e dV %.1e", sn,
           CAUSAL, same ? "yes" : "NO", ek, ev);
}
static void run_areg() {
    typedef __nv_bfloat16 T;
    const float scale = 0.125f;
    printf("== dK/dV with K and V in registers against the kernel without it, d 64\n");
    for (long sn : { 300L, 1000L }) areg_check<true>(sn, scale), areg_check<false>(sn, scale);
    const long bh = 16, n = 16384;
    LabProblem p(bh, n, 64);
    CHECK((tsys_cuda__flash_fwd_wg<T, 64, true>((T *)p.q.d, (T *)p.k.d, (T *)p.v.d, (T *)p.o.d, (float *)p.lse.d, bh, n, scale, 0)));
    CHECK((tsys_cuda__flash_bwd_wg<T, 64, true>((T *)p.g.d, (T *)p.q.d, (T *)p.k.d, (T *)p.v.d, (T *)p.o.d, (float *)p.lse.d, (T *)p.dq.d, (T *)p.dk.d, (T *)p.dv.d, (float *)p.sc.d, bh, n, scale, 0, 1)));
    float t[2][2];
    for (int r = 0; r < 2; r++) {
        t[0][r] = time_ms([&] { areg_dkdv<true, false>(p, p.dk2, p.dv2, bh, n, scale); }, 3, 20);
        t[1][r] = time_ms([&] { areg_dkdv<true, true>(p, p.dk2, p.dv2, bh, n, scale); }, 3, 20);
    }
    printf("  dK/dV bf16 %ld x %ld x 64 causal, ms (two rounds): shared-memory K and V %.3f / %.3f, in registers %.3f / %.3f\n", bh, n,
           t[0][0], t[0][1], t[1][0], t[1][1]);
    fflush(stdout);
}

// The backward part by part at the leaderboard shapes (bf16, causal, 16 x 16384), with the dK/dV kernel launched
// in the dQ kernel's tail (programmatic dependent launch) and without: first the same bits both ways, then each
// part alone (D pre-pass, dQ, dK/dV), the two together, the whole backward and forward + backward, interleaved.
template <int D> static void parts_one() {
    typedef __nv_bfloat16 T;
    const long bh = 16, n = 16384;
    const float scale = 1.0f / sqrtf((float)D);
    LabProblem p(bh, n, D);
    const tsys_cuda_flash_impl impl = lab_wg_impl();
    auto fwd = [&] { CHECK((tsys_cuda__flash_fwd_pick<T, D, true>((T *)p.q.d, (T *)p.k.d, (T *)p.v.d, (T *)p.o.d, (float *)p.lse.d, bh, n, scale, impl, 0, (float *)p.sc.d))); };
    auto part = [&](int parts, Buf &dq, Buf &dk, Buf &dv) {
        CHECK((tsys_cuda__flash_bwd_wg<T, D, true>((T *)p.g.d, (T *)p.q.d, (T *)p.k.d, (T *)p.v.d, (T *)p.o.d, (float *)p.lse.d, (T *)dq.d, (T *)dk.d, (T *)dv.d,
                                                   (float *)p.sc.d, bh, n, scale, 0, parts, impl)));
    };
    fwd();
    tsys_cuda__flash_pdl_off = true; part(7, p.dq, p.dk, p.dv);
    tsys_cuda__flash_pdl_off = false; part(7, p.dq2, p.dk2, p.dv2);
    CHECK(cudaDeviceSynchronize());
    for (Buf *a : { &p.dq, &p.dk, &p.dv, &p.dq2, &p.dk2, &p.dv2 }) a->download();
    const bool same = p.dq.raw == p.dq2.raw && p.dk.raw == p.dk2.raw && p.dv.raw == p.dv2.raw;
    report(same, "d=%d backward with the dK/dV kernel in the dQ kernel's tail: the same bits as without", D);
    // D: the 16-byte-load kernel against the warp-per-row one (the same sums in another order)
    const long rows = bh * n;
    Buf d1(0, rows), d2(0, rows);
    auto dot_row = [&] { tsys_cuda__flash_bwd_dot_kernel<T><<<(unsigned)((rows + 7) / 8), 256>>>((T *)p.g.d, (T *)p.o.d, (float *)d1.d, rows, D); };
    auto dot_vec = [&] { tsys_cuda__flash_bwd_dot<T, D>((T *)p.g.d, (T *)p.o.d, (float *)d2.d, rows, 0); };
    dot_row(); dot_vec(); CHECK(cudaDeviceSynchronize()); d1.download(); d2.download();
    report(rel_err(d2.h.data(), d1.h.data(), rows) < 1e-6, "d=%d D from 16-byte loads matches the warp-per-row kernel (rel err %.1e)", D,
           rel_err(d2.h.data(), d1.h.data(), rows));
    const auto td = time_ab(dot_row, dot_vec, 3, 30);
    printf("  d=%d D pre-pass: warp per row %.4f ms, 16-byte loads %.4f ms\n", D, td.first, td.second);
    // each part with ordinary launches (a) and with the dK/dV kernel tail-launched (b), alternating run by run
    auto ab = [&](auto f) { return time_ab([&] { tsys_cuda__flash_pdl_off = true; f(); }, [&] { tsys_cuda__flash_pdl_off = false; f(); }, 3, 30); };
    for (int round = 0; round < 2; round++) {
        const auto tf = ab(fwd), tq = ab([&] { part(4, p.dq, p.dk, p.dv); }), tkv = ab([&] { part(2, p.dq, p.dk, p.dv); });
        const auto tqkv = ab([&] { part(6, p.dq, p.dk, p.dv); }), tb = ab([&] { part(7, p.dq, p.dk, p.dv); });
        const auto tfb = ab([&] { fwd(); part(7, p.dq, p.dk, p.dv); });
        printf("  d=%d ordinary / tail-launched, ms: fwd %.3f / %.3f  dQ %.3f / %.3f  dK/dV %.3f / %.3f  dQ+dK/dV %.3f / %.3f  bwd %.3f / %.3f  "
               "fwd+bwd %.3f / %.3f\n", D, tf.first, tf.second, tq.first, tq.second, tkv.first, tkv.second, tqkv.first, tqkv.second,
               tb.first, tb.second, tfb.first, tfb.second);
        fflush(stdout);
    }
    tsys_cuda__flash_pdl_off = false;
}
static void run_parts() {
    printf("== the backward part by part, bf16, causal, 16 x 16384 (ms)\n");
    parts_one<64>(); parts_one<128>();
}

// The fused (5-matmul) backward (the entry points take it at d 128 on large grids): dQ, dK and dV against the
// mma.sync backward at 300 and 1000 rows, causal and not; the same bits from two runs on a 4 x 4096 problem (the order of the dQ adds is
// fixed by the turns); then timed on the benchmark shape beside the 7-matmul warp-specialized kernels.
template <int D> static void fused_variant(long bh, long n) {
    typedef __nv_bfloat16 T;
    const float scale = 1.0f / sqrtf((float)D);
    auto fused = [&](bool causal, Buf &q, Buf &k, Buf &v, Buf &g, Buf &lse, Buf &sc, Buf &dq, Buf &dk, Buf &dv, long sb, long sn) {
        float *acc = (float *)sc.d + (sb * sn + 3) / 4 * 4;
        return causal ? tsys_cuda__flash_bwd_fused_ws<T, D, true>((T *)g.d, (T *)q.d, (T *)k.d, (T *)v.d, (float *)lse.d, (float *)sc.d, (T *)dq.d, (T *)dk.d, (T *)dv.d, sb, sn, scale, 0, acc)
                      : tsys_cuda__flash_bwd_fused_ws<T, D, false>((T *)g.d, (T *)q.d, (T *)k.d, (T *)v.d, (float *)lse.d, (float *)sc.d, (T *)dq.d, (T *)dk.d, (T *)dv.d, sb, sn, scale, 0, acc);
    };
    for (int c = 0; c < 4; c++) {
        const bool causal = c % 2 == 0;
        const long sb = 2, sn = c < 2 ? 300 : 1000;
        const size_t N = sb * sn * D;
        LabProblem p(sb, sn, D);
        Buf &q = p.q, &k = p.k, &v = p.v, &g = p.g, &dq = p.dq, &dk = p.dk, &dv = p.dv, &lse = p.lse, &sc = p.sc;
        Buf &dq2 = p.dq2, &dk2 = p.dk2, &dv2 = p.dv2;
        lab_mma_reference<T, D>(causal, p, sb, sn, scale);
        const cudaError_t e1 = fused(causal, q, k, v, g, lse, sc, dq2, dk2, dv2, sb, sn), e2 = cudaDeviceSynchronize();
        if (e1 != cudaSuccess || e2 != cudaSuccess) { report(false, "fused d=%d: %s / %s", D, cudaGetErrorString(e1), cudaGetErrorString(e2)); return; }
        dq.download(); dk.download(); dv.download(); dq2.download(); dk2.download(); dv2.download();
        const double eq = rel_err(dq2.h.data(), dq.h.data(), N), ek = rel_err(dk2.h.data(), dk.h.data(), N), ev = rel_err(dv2.h.data(), dv.h.data(), N);
        report(eq < 1e-2 && ek < 1e-2 && ev < 1e-2, "fused d=%d n=%ld causal=%d vs mma.sync: dQ %.1e dK %.1e dV %.1e", D, sn, causal, eq, ek, ev);
    }
    {
        const long sb = 4, sn = 4096;
        LabProblem p(sb, sn, D);
        Buf &q = p.q, &k = p.k, &v = p.v, &g = p.g, &dq = p.dq, &dk = p.dk, &dv = p.dv, &lse = p.lse, &sc = p.sc;
        Buf &dq2 = p.dq2, &dk2 = p.dk2, &dv2 = p.dv2;
        lab_mma_reference<T, D>(true, p, sb, sn, scale);
        CHECK(fused(true, q, k, v, g, lse, sc, dq, dk, dv, sb, sn));
        CHECK(fused(true, q, k, v, g, lse, sc, dq2, dk2, dv2, sb, sn));
        CHECK(cudaDeviceSynchronize());
        dq.download(); dk.download(); dv.download(); dq2.download(); dk2.download(); dv2.download();
        report(dq.raw == dq2.raw && dk.raw == dk2.raw && dv.raw == dv2.raw, "fused d=%d 4 x 4096 causal: the same bits from two runs", D);
    }
    // the benchmark shape both ways, then (d 128, where the entry points take the fused kernel on grids that need
    // no split) causal shapes from batch 1 to short sequences in large batches
    const long shapes[][3] = { { bh, n, 1 }, { bh, n, 0 }, { 8, 32768, 1 }, { 32, 16384, 1 }, { 1, 65536, 1 }, { 64, 2048, 1 } };
    for (int c = 0; c < (D == 128 ? 6 : 2); c++) {
        const bool causal = shapes[c][2] != 0;
        const long bh = shapes[c][0], n = shapes[c][1];
        LabProblem p(bh, n, D);
        Buf &q = p.q, &k = p.k, &v = p.v, &g = p.g, &o = p.o, &dq = p.dq, &dk = p.dk, &dv = p.dv, &lse = p.lse, &sc = p.sc;
        CHECK((tsys_cuda__flash_fwd_wg<T, D, true>((T *)q.d, (T *)k.d, (T *)v.d, (T *)o.d, (float *)lse.d, bh, n, scale, 0)));
        CHECK((tsys_cuda__flash_bwd_wg<T, D, true>((T *)g.d, (T *)q.d, (T *)k.d, (T *)v.d, (T *)o.d, (float *)lse.d, (T *)dq.d, (T *)dk.d, (T *)dv.d, (float *)sc.d, bh, n, scale, 0, 1)));
        auto seven = [&] {
            if (causal) {
                CHECK((tsys_cuda__flash_bwd_dq_ws<T, D, true>((T *)g.d, (T *)q.d, (T *)k.d, (T *)v.d, (float *)lse.d, (float *)sc.d, (T *)dq.d, bh, n, scale, 0)));
                CHECK((tsys_cuda__flash_bwd_dkdv_ws<T, D, true>((T *)g.d, (T *)q.d, (T *)k.d, (T *)v.d, (float *)lse.d, (float *)sc.d, (T *)dk.d, (T *)dv.d, bh, n, scale, 0)));
            } else {
                CHECK((tsys_cuda__flash_bwd_dq_ws<T, D, false>((T *)g.d, (T *)q.d, (T *)k.d, (T *)v.d, (float *)lse.d, (float *)sc.d, (T *)dq.d, bh, n, scale, 0)));
                CHECK((tsys_cuda__flash_bwd_dkdv_ws<T, D, false>((T *)g.d, (T *)q.d, (T *)k.d, (T *)v.d, (float *)lse.d, (float *)sc.d, (T *)dk.d, (T *)dv.d, bh, n, scale, 0)));
            }
        };
        // the fused kernel and the two 7-matmul kernels, alternating run by run
        const auto t = time_ab([&] { CHECK(fused(causal, q, k, v, g, lse, sc, dq, dk, dv, bh, n)); }, seven, 3, 20);
        const double f = 4.0 * bh * n * n * D / (causal ? 2 : 1);
        printf("  fused bf16 bh=%ld n=%ld d=%d causal=%d: %.3f ms (%.0f TFLOP/s of 5 mm); 7-matmul dQ + dK/dV %.3f ms\n",
               bh, n, D, causal, t.first, 2.5 * f / t.first / 1e9, t.second);
        fflush(stdout);
    }
}

// The backward kernels with their consumers issuing S and dP (S^T and dP^T) in turn, against the kernels as they
// are (bf16, 16 x 16384, causal): dK/dV checked against the mma.sync backward first; then timed in rounds, the
// variants one after the other.
template <int D> static void kv_turns() {
    typedef __nv_bfloat16 T;
    constexpr bool AREG = tsys_cuda__flash_ws_tiles<T, D>::KV_AREG;
    const long bh = 16, n = 16384;
    const float scale = 1.0f / sqrtf((float)D);
    auto launch = [&](bool causal, LabProblem &p) {
        return causal ? tsys_cuda__flash_bwd_dkdv_ws<T, D, true, 64, 2, AREG, true>((T *)p.g.d, (T *)p.q.d, (T *)p.k.d, (T *)p.v.d, (float *)p.lse.d, (float *)p.sc.d, (T *)p.dk2.d, (T *)p.dv2.d, lab_check_bh, lab_check_n, scale, 0)
                      : tsys_cuda__flash_bwd_dkdv_ws<T, D, false, 64, 2, AREG, true>((T *)p.g.d, (T *)p.q.d, (T *)p.k.d, (T *)p.v.d, (float *)p.lse.d, (float *)p.sc.d, (T *)p.dk2.d, (T *)p.dv2.d, lab_check_bh, lab_check_n, scale, 0);
    };
    auto compare = [&](bool causal, LabProblem &p) {
        p.dk.download(); p.dv.download(); p.dk2.download(); p.dv2.download();
        const double ek = rel_err(p.dk2.h.data(), p.dk.h.data(), p.dk.n), ev = rel_err(p.dv2.h.data(), p.dv.h.data(), p.dv.n);
        report(ek < 1e-2 && ev < 1e-2, "dkdv turns d=%d causal=%d vs mma.sync: dK %.1e dV %.1e", D, causal, ek, ev);
    };
    if (!lab_variant_checks<D>("dkdv turns", launch, compare)) return;
    LabProblem p(bh, n, D);
    Buf &q = p.q, &k = p.k, &v = p.v, &g = p.g, &o = p.o, &dq = p.dq, &dk = p.dk, &dv = p.dv, &lse = p.lse, &sc = p.sc;
    CHECK((tsys_cuda__flash_fwd_wg<T, D, true>((T *)q.d, (T *)k.d, (T *)v.d, (T *)o.d, (float *)lse.d, bh, n, scale, 0)));
    CHECK((tsys_cuda__flash_bwd_wg<T, D, true>((T *)g.d, (T *)q.d, (T *)k.d, (T *)v.d, (T *)o.d, (float *)lse.d, (T *)dq.d, (T *)dk.d, (T *)dv.d, (float *)sc.d, bh, n, scale, 0, 1)));
    float *acc = (float *)sc.d + (bh * n + 3) / 4 * 4;
    auto dqk = [&](bool pp) {
        if (pp) CHECK((tsys_cuda__flash_bwd_dq_ws<T, D, true, 64, tsys_cuda__flash_ws_tiles<T, D>::DQ_CW, true>((T *)g.d, (T *)q.d, (T *)k.d, (T *)v.d, (float *)lse.d, (float *)sc.d, (T *)dq.d, bh, n, scale, 0)));
        else CHECK((tsys_cuda__flash_bwd_dq_ws<T, D, true, 64, tsys_cuda__flash_ws_tiles<T, D>::DQ_CW, false>((T *)g.d, (T *)q.d, (T *)k.d, (T *)v.d, (float *)lse.d, (float *)sc.d, (T *)dq.d, bh, n, scale, 0)));
    };
    auto kvk = [&](bool pp) {
        if (pp) CHECK((tsys_cuda__flash_bwd_dkdv_ws<T, D, true, 64, 2, AREG, true>((T *)g.d, (T *)q.d, (T *)k.d, (T *)v.d, (float *)lse.d, (float *)sc.d, (T *)dk.d, (T *)dv.d, bh, n, scale, 0)));
        else CHECK((tsys_cuda__flash_bwd_dkdv_ws<T, D, true>((T *)g.d, (T *)q.d, (T *)k.d, (T *)v.d, (float *)lse.d, (float *)sc.d, (T *)dk.d, (T *)dv.d, bh, n, scale, 0)));
    };
    auto fz = [&](bool pp) {
        if (pp) CHECK((tsys_cuda__flash_bwd_fused_ws<T, D, true, 64, 2, true>((T *)g.d, (T *)q.d, (T *)k.d, (T *)v.d, (float *)lse.d, (float *)sc.d, (T *)dq.d, (T *)dk.d, (T *)dv.d, bh, n, scale, 0, acc)));
        else CHECK((tsys_cuda__flash_bwd_fused_ws<T, D, true>((T *)g.d, (T *)q.d, (T *)k.d, (T *)v.d, (float *)lse.d, (float *)sc.d, (T *)dq.d, (T *)dk.d, (T *)dv.d, bh, n, scale, 0, acc)));
    };
    for (int round = 0; round < 2; round++) {
        const float kv0 = time_ms([&] { kvk(false); }, 3, 20), kv1 = time_ms([&] { kvk(true); }, 3, 20);
        const float s00 = time_ms([&] { dqk(false); kvk(false); }, 3, 20), s11 = time_ms([&] { dqk(true); kvk(true); }, 3, 20);
        const float s10 = time_ms([&] { dqk(true); kvk(false); }, 3, 20);
        printf("  d=%d dK/dV %.3f, in turn %.3f | dQ + dK/dV %.3f, dQ in turn %.3f, both in turn %.3f", D, kv0, kv1, s00, s10, s11);
        if constexpr (D == 128) {
            const float f0 = time_ms([&] { fz(false); }, 3, 20), f1 = time_ms([&] { fz(true); }, 3, 20);
            printf(" | fused %.3f, in turn %.3f", f0, f1);
        }
        printf(" ms\n");
        fflush(stdout);
    }
}

// The TF32 forward (fp32 inputs, d = 64) of the lab's implementation against the CPU reference and against the
// mma.sync TF32 forward, with the scratch the entry points give it (shares, rounded K, V^T) poisoned first;
// run twice for the same bytes. Then timed beside the mma.sync forward at batch 1 (the sweep's shape).
static void tf32_fwd_check(long bh, long n, bool causal, long d = 64) {
    const size_t N = bh * n * d, R = bh * n;
    const int dt = TSYS_CUDA__FLASH_TF32;
    Buf q(0, N), k(0, N), v(0, N), o(0, N), lse(0, R), o2(0, N), lse2(0, R);
    Buf sc(0, tsys_cuda__flash_fwd_scratch_bytes(bh, n, d, dt, causal, lab_impl) / sizeof(float) + 1);
    Buf sc2(0, tsys_cuda__flash_fwd_scratch_bytes(bh, n, d, dt, causal, TSYS_CUDA_FLASH_MMA) / sizeof(float) + 1);
    q.randomize(); k.randomize(); v.randomize();
    o.poison(); lse.poison(); sc.poison(); o2.poison(); lse2.poison();
    const float scale = 1.0f / sqrtf((float)d);
    CHECK(tsys_cuda__flash_fwd(q.d, k.d, v.d, o.d, (float *)lse.d, dt, bh, n, d, scale, causal, lab_impl, 0, (float *)sc.d));
    CHECK(tsys_cuda__flash_fwd(q.d, k.d, v.d, o2.d, (float *)lse2.d, dt, bh, n, d, scale, causal, TSYS_CUDA_FLASH_MMA, 0, (float *)sc2.d));
    CHECK(cudaDeviceSynchronize());
    o.download(); lse.download(); o2.download(); lse2.download();
    std::vector<unsigned char> o1 = o.raw;
    o.poison();
    CHECK(tsys_cuda__flash_fwd(q.d, k.d, v.d, o.d, (float *)lse.d, dt, bh, n, d, scale, causal, lab_impl, 0, (float *)sc.d));
    CHECK(cudaDeviceSynchronize());
    o.download();
    const bool same = o1 == o.raw;
    std::vector<float> ro(N), rl(R);
    tsys__cpu_flash_fwd(q.h.data(), k.h.data(), v.h.data(), ro.data(), rl.data(), bh, n, n, d, scale, causal);
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
    for (long d : { 64L, 128L })
        for (long n : { 1024L, 2048L, 4096L, 8192L, 16384L, 65536L })
            for (int pass = 0; pass < 2; pass++) {
                const tsys_cuda_flash_impl impl = pass ? TSYS_CUDA_FLASH_MMA : lab_impl;
                const long bh = 1; const size_t N = bh * n * d;
                const int dt = TSYS_CUDA__FLASH_TF32;
                Buf q(0, N), k(0, N), v(0, N), o(0, N), lse(0, bh * n), sc(0, tsys_cuda__flash_fwd_scratch_bytes(bh, n, d, dt, true, impl) / sizeof(float) + 1);
                q.randomize(); k.randomize(); v.randomize();
                const float scale = 1.0f / sqrtf((float)d);
                const float t = time_ms([&] { CHECK(tsys_cuda__flash_fwd(q.d, k.d, v.d, o.d, (float *)lse.d, dt, bh, n, d, scale, true, impl, 0, (float *)sc.d)); }, 5, 50);
                printf("  tf32 fwd %-4s bh=1 n=%-5ld d=%-3ld causal: %.3f ms (%.1f TFLOP/s)\n", pass ? "mma" : lab_impl_name, n, d, t, 2.0 * n * n * d / t / 1e9);
                fflush(stdout);
            }
}

static void bench(int dt, long bh, long n, long d, bool causal) {
    const size_t N = bh * n * d, R = bh * n;
    Buf q(dt, N), k(dt, N), v(dt, N), g(dt, N), o(dt, N), dq(dt, N), dk(dt, N), dv(dt, N), lse(0, R), scratch(0, lab_scratch(dt, bh, n, d, causal));
    q.randomize(); k.randomize(); v.randomize(); g.randomize();
    const float scale = 1.0f / sqrtf((float)d);
    Buf fsc(0, tsys_cuda__flash_fwd_scratch_bytes(bh, n, d, dt, causal, lab_impl) / sizeof(float) + 1);   // as the entry points give it
    auto fwd = [&] { CHECK(tsys_cuda__flash_fwd(q.d, k.d, v.d, o.d, (float *)lse.d, dt, bh, n, d, scale, causal, lab_impl, 0, (float *)fsc.d)); };
    auto bwd = [&] { CHECK(tsys_cuda__flash_bwd(g.d, q.d, k.d, v.d, o.d, (float *)lse.d, dq.d, dk.d, dv.d, (float *)scratch.d, dt, bh, n, d, scale, causal, lab_impl, 0)); };
    const int reps = n >= 8192 || dt == 0 ? 30 : 100;
    float tf = time_ms(fwd, 5, reps), tb = time_ms(bwd, 5, reps), tfb = time_ms([&] { fwd(); bwd(); }, 5, reps);
    const double f = 4.0 * bh * n * n * d / (causal ? 2 : 1);
    printf("  %-4s %-5s bh=%ld n=%ld d=%ld causal=%d: fwd %.3f ms (%.1f TFLOP/s)  bwd %.3f ms (%.1f)  fwd+bwd %.3f ms (%.1f)\n",
           dtype_name[dt], tsys_cuda_flash_impl_name(lab_impl), bh, n, d, causal, tf, f / tf / 1e9, tb, 2.5 * f / tb / 1e9, tfb, 3.5 * f / tfb / 1e9);
    fflush(stdout);
}

// The d 64 leaderboard shape's forward + backward (the entry points' backward) with the forward's consumers in turn
// (tsys_cuda__flash_ws_tiles::FWD_TURNS) and without, in alternation, then in runs of 30 (A B B A); the forwards
// alone the same ways.
static void run_lb_turns() {
    typedef __nv_bfloat16 T;
    const long bh = 16, n = 16384, d = 64;
    const size_t N = bh * n * d, R = bh * n;
    Buf q(1, N), k(1, N), v(1, N), g(1, N), o(1, N), dq(1, N), dk(1, N), dv(1, N), lse(0, R), scratch(0, lab_scratch(1, bh, n, d, true));
    q.randomize(); k.randomize(); v.randomize(); g.randomize();
    const float scale = 1.0f / sqrtf((float)d);
    auto fwd = [&](bool turns) {
        if (turns) CHECK((tsys_cuda__flash_fwd_ws<T, 64, true, 128, 3, true, true>((T *)q.d, (T *)k.d, (T *)v.d, (T *)o.d, (float *)lse.d, bh, n, scale, 0)));
        else CHECK((tsys_cuda__flash_fwd_ws<T, 64, true, 128, 3, false, false>((T *)q.d, (T *)k.d, (T *)v.d, (T *)o.d, (float *)lse.d, bh, n, scale, 0)));
    };
    auto step = [&](bool turns) {
        fwd(turns);
        CHECK(tsys_cuda__flash_bwd(g.d, q.d, k.d, v.d, o.d, (float *)lse.d, dq.d, dk.d, dv.d, (float *)scratch.d, 1, bh, n, d, scale, true, lab_impl, 0));
    };
    printf("== bf16 d 64 16 x 16384 causal: the forward's consumers in turn / as before (ms)\n");
    for (int round = 0; round < 2; round++) {
        const auto f = time_ab([&] { fwd(true); }, [&] { fwd(false); }, 3, 30);
        const auto t = time_ab([&] { step(true); }, [&] { step(false); }, 3, 30);
        printf("  alternating: fwd %.3f / %.3f (%.3fx)  fwd + bwd %.3f / %.3f (%.3fx)\n", f.first, f.second, f.second / f.first, t.first, t.second,
               t.second / t.first);
        fflush(stdout);
    }
    const float a1 = time_ms([&] { step(true); }, 5, 30), b1 = time_ms([&] { step(false); }, 5, 30);
    const float b2 = time_ms([&] { step(false); }, 5, 30), a2 = time_ms([&] { step(true); }, 5, 30);
    printf("  runs of 30, fwd + bwd: in turn %.3f / %.3f  as before %.3f / %.3f\n", a1, a2, b1, b2);
    fflush(stdout);
}

// The entry points' forward + backward with the fused backward and with the two 7-matmul kernels, in alternation
// (three rounds), at d 128 shapes where the entry points take the fused kernel.
static void run_lb_fused() {
    printf("== fwd + bwd through the entry points, bf16, d 128: fused backward / 7-matmul kernels, alternating (ms)\n");
    const long shapes[][3] = { { 16, 16384, 1 }, { 8, 32768, 1 }, { 32, 16384, 1 }, { 16, 16384, 0 } };
    for (auto &sh : shapes) {
        const long bh = sh[0], n = sh[1], d = 128;
        const bool causal = sh[2] != 0;
        const size_t N = bh * n * d, R = bh * n;
        Buf q(1, N), k(1, N), v(1, N), g(1, N), o(1, N), dq(1, N), dk(1, N), dv(1, N), lse(0, R), scratch(0, lab_scratch(1, bh, n, d, causal));
        Buf fsc(0, tsys_cuda__flash_fwd_scratch_bytes(bh, n, d, 1, causal, lab_impl) / sizeof(float) + 1);
        q.randomize(); k.randomize(); v.randomize(); g.randomize();
        const float scale = 1.0f / sqrtf((float)d);
        auto step = [&](bool fused_off) {
            tsys_cuda__flash_fused_off = fused_off;
            CHECK(tsys_cuda__flash_fwd(q.d, k.d, v.d, o.d, (float *)lse.d, 1, bh, n, d, scale, causal, lab_impl, 0, (float *)fsc.d));
            CHECK(tsys_cuda__flash_bwd(g.d, q.d, k.d, v.d, o.d, (float *)lse.d, dq.d, dk.d, dv.d, (float *)scratch.d, 1, bh, n, d, scale, causal, lab_impl, 0));
        };
        for (int round = 0; round < 2; round++) {
            const auto t = time_ab([&] { step(false); }, [&] { step(true); }, 3, 20);
            printf("  bh=%ld n=%ld d=%ld causal=%d, alternating: fused %.3f  7-matmul %.3f  (%.3fx)\n", bh, n, d, causal, t.first, t.second,
                   t.second / t.first);
            fflush(stdout);
        }
        // ... and each in a run of its own (the clocks then settle to what that configuration draws), A B B A
        const float a1 = time_ms([&] { step(false); }, 5, 30), b1 = time_ms([&] { step(true); }, 5, 30);
        const float b2 = time_ms([&] { step(true); }, 5, 30), a2 = time_ms([&] { step(false); }, 5, 30);
        printf("  bh=%ld n=%ld d=%ld causal=%d, runs of 30: fused %.3f / %.3f  7-matmul %.3f / %.3f\n", bh, n, d, causal, a1, a2, b1, b2);
        fflush(stdout);
    }
    tsys_cuda__flash_fused_off = false;
}

// bf16 at d 16, 32 (padded to 64), 80 and 96 (padded to 128) on the Hopper kernels against the mma.sync kernels,
// causal: first checked against the CPU reference with the lab's implementation (auto pads d 16 and 32 from
// 16384 rows) and with ws (which always pads), then timed, ws against mma, at batch 1 and at two batched shapes.
static void run_pad() {
    printf("== d 16 / 32 / 80 / 96 zero-padded onto the Hopper kernels against mma.sync, bf16, causal\n");
    for (long d : { 16L, 32L }) check_cuda(1, 1, 16384, d, true);
    const tsys_cuda_flash_impl keep = lab_impl;
    lab_impl = TSYS_CUDA_FLASH_WS;
    check_cuda(1, 2, 3000, 80, true); check_cuda(1, 2, 1000, 80, false);
    check_cuda(1, 2, 3000, 96, true); check_cuda(1, 2, 1000, 96, false);
    struct { long bh, n; } shapes[] = { { 1, 4096 }, { 1, 8192 }, { 1, 16384 }, { 1, 32768 }, { 1, 65536 }, { 128, 256 }, { 32, 2048 } };
    for (long d : { 16L, 32L, 80L, 96L })
        for (auto sh : shapes) {
            lab_impl = TSYS_CUDA_FLASH_WS; bench(1, sh.bh, sh.n, d, true);
            lab_impl = TSYS_CUDA_FLASH_MMA; bench(1, sh.bh, sh.n, d, true);
        }
    lab_impl = keep;
}

static void run_perf() {
    cudaDeviceProp p; CHECK(cudaGetDeviceProperties(&p, 0));
    printf("== timings on %s (%d SMs), bf16/fp16 d=64/128 flash implementation: %s (asked for %s)\n", p.name, p.multiProcessorCount,
           tsys_cuda_flash_impl_name(tsys_cuda_get_desc(lab_ctx).flash), lab_impl_name);
    bench(1, 16, 16384, 64, true);    // the CS336 leaderboard shape
    bench(1, 16, 16384, 128, true);
    bench(2, 16, 16384, 64, true);
    bench(1, 16, 16384, 64, false);
    bench(1, 16, 4096, 64, true);
    bench(1, 32, 2048, 80, true);
    bench(0, 16, 2048, 64, true);     // fp32 SIMT path, for the record
}

// True when `mode` is `name` and the warp-specialized kernels can run here; says why not when they cannot.
static bool ws_mode(const char *mode, const char *name) {
    if (strcmp(mode, name)) return false;
    if (tsys_cuda__get(lab_ctx)->flash_ws_ok) return true;
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
    lab_ctx = tsys_ctx_new(NULL);
    if (tsys_cuda_init_desc(lab_ctx, &cd) != TSYS_OK) { fprintf(stderr, "flash_lab: %s\n", tsys_ctx_last_error(lab_ctx)); return 1; }
    const tsys_cuda_flash_impl asked = tsys_cuda__get(lab_ctx)->flash;   // auto, or what the environment made of it
    lab_use(asked);
    printf("device %s; flash implementation %s (runs %s)\n", tsys_cuda_device_name(lab_ctx), lab_impl_name,
           tsys_cuda_flash_impl_name(tsys_cuda_get_desc(lab_ctx).flash));
    if (!strcmp(mode, "test") || !strcmp(mode, "all") || !strcmp(mode, "tv")) {
        run_tests(impl_arg);
        lab_use(asked);   // the timings use the context's choice again
    }
    if (!strcmp(mode, "variants") || !strcmp(mode, "tv")) run_variants();
    if (!strcmp(mode, "tf32variants")) run_tf32_variants();
    if (!strcmp(mode, "tf32fwd")) run_tf32_fwd();
    if (!strcmp(mode, "pad")) run_pad();
    if (!strcmp(mode, "wgvariants")) run_wgvariants();
    if (!strcmp(mode, "perf") || !strcmp(mode, "all")) run_perf();
    if (ws_mode(mode, "wsdq"))
        wsdq_variant<64, 128, 2>(16, 16384), wsdq_variant<64, 64, 3>(16, 16384), wsdq_variant<128, 64, 2>(16, 16384);
    if (ws_mode(mode, "wsdqturns"))   // the consumers issuing S and dP in turn, against the kernels as they are
        for (int round = 0; round < 2; round++)
            wsdq_variant<64, 64, 3>(16, 16384), wsdq_variant<64, 64, 3, true>(16, 16384), wsdq_variant<128, 64, 2>(16, 16384),
                wsdq_variant<128, 64, 2, true>(16, 16384);
    if (ws_mode(mode, "wsfwd"))
        for (int round = 0; round < 3; round++)
            wsfwd_variant<128, 64, 3>(16, 16384), wsfwd_variant<128, 128, 2>(16, 16384), wsfwd_variant<64, 128, 3>(16, 16384);
    if (ws_mode(mode, "wsfwdovl"))   // the softmax beside the previous tile's P V, in turn with the kernels as they are
        for (int round = 0; round < 2; round++)
            wsfwd_variant<64, 128, 3>(16, 16384), wsfwd_variant<64, 128, 2, true>(16, 16384), wsfwd_variant<64, 128, 2, true, true>(16, 16384),
                wsfwd_variant<64, 128, 3, true, true>(16, 16384), wsfwd_variant<128, 128, 2>(16, 16384), wsfwd_variant<128, 128, 2, true, true>(16, 16384);
    if (ws_mode(mode, "wsdkdv"))
        wsdkdv_variant<64, 64, 2>(16, 16384), wsdkdv_variant<128, 64, 2>(16, 16384);
    if (ws_mode(mode, "fused")) fused_variant<64>(16, 16384), fused_variant<128>(16, 16384);
    if (ws_mode(mode, "areg")) run_areg();
    if (ws_mode(mode, "parts")) run_parts();
    if (ws_mode(mode, "lbfused")) run_lb_fused();
    if (ws_mode(mode, "lbturns")) run_lb_turns();
    if (ws_mode(mode, "kvturns")) kv_turns<64>(), kv_turns<128>();
    if (!strcmp(mode, "lb")) bench(1, 16, 16384, 64, true), bench(1, 16, 16384, 128, true);   // leaderboard rows only
    tsys_cuda_shutdown(lab_ctx);
    tsys_ctx_free(lab_ctx);
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}
