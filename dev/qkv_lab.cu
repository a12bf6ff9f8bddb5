// qkv_lab.cu - what would merging a block's q, k, v projections (and w1, w3) into fewer GEMMs save? A lab
// tool, not part of the library; public API only (tsys_matmul on bf16 tensors, no autograd, one captured
// graph per variant, replayed and timed with events). 1024 tokens (batch 4 x context 256), the CS336
// shapes of small (d 768, d_ff 3072), xl (1600, 6400) and 2.7B (2560, 10240). For each group of G
// projections that read one input (q, k, v: G = 3, width d; w1, w3: G = 2, width d_ff) and each of a
// linear's three GEMMs:
//   forward  y_i = x W_i^T            G products of N = width  | one of N = G x width (W stacked)
//                                      | one strided-batched product (x repeated G times)
//   dX       dx = sum_i dy_i W_i      G products + G - 1 adds  | one of K = G x width (not torch's sum
//                                      order: a bound) | one strided-batched product of G + G - 1 adds
//   dW       dW_i = dy_i^T x          G products of M = width  | one of M = G x width
//                                      | one strided-batched product (x repeated G times)
// Prints microseconds a replay of each variant (median of 5 timings of 50 replays).
//
//   make build/tsys_impl_cuda.o
//   nvcc -O2 -std=c++17 -gencode arch=compute_90a,code=sm_90a -I. -DTSYS_LINKED_IMPL -c dev/qkv_lab.cu -o build/qkv_lab.o
//   nvcc -gencode arch=compute_90a,code=sm_90a build/qkv_lab.o build/tsys_impl_cuda.o -o build/qkv_lab -lcublasLt -lcublas -lopenblas -lgomp
//   build/qkv_lab
#include "../tsys.h"
#include "../tsys_cuda.cuh"
#include <algorithm>
#include <stdio.h>
#include <stdlib.h>

static tsys_ctx *g_ctx;
static void check(bool ok, const char *what) {
    if (ok && tsys_ctx_status(g_ctx) == TSYS_OK) return;
    fprintf(stderr, "qkv_lab: %s: %s\n", what, tsys_ctx_last_error(g_ctx));
    exit(1);
}
static tsys_tensor *rand_bf16(int ndim, int64_t d0, int64_t d1, int64_t d2) {
    int64_t shape[3] = { d0, d1, d2 };
    tsys_tensor *t = tsys_tensor_new(g_ctx, TSYS_BF16, TSYS_CUDA, ndim, shape);
    check(t && tsys_tensor_randn(g_ctx, t, 0.02f) == TSYS_OK, "a random tensor");
    return t;
}

// What one variant launches, recorded into a graph: its outputs are released at once (the pool keeps them).
typedef void (*variant_fn)(void *user);
static double time_us(variant_fn f, void *user) {
    f(user);   // warm: cuBLASLt's plans, the pool's blocks
    tsys_cuda_graph *g = NULL;
    check(tsys_cuda_graph_begin(g_ctx) == TSYS_OK, "graph_begin");
    f(user);
    check(tsys_cuda_graph_end(g_ctx, &g) == TSYS_OK && g, "graph_end");
    double t[5];
    for (int k = 0; k < 5; k++) {
        tsys_event a = { TSYS_CUDA, TSYS_STREAM_COMPUTE, 0, NULL }, b = a;
        check(tsys_event_record(g_ctx, TSYS_CUDA, TSYS_STREAM_COMPUTE, &a) == TSYS_OK, "event");
        for (int r = 0; r < 50; r++) check(tsys_cuda_graph_replay(g_ctx, g) == TSYS_OK, "replay");
        check(tsys_event_record(g_ctx, TSYS_CUDA, TSYS_STREAM_COMPUTE, &b) == TSYS_OK, "event");
        t[k] = tsys_event_elapsed_ms(g_ctx, &a, &b) * 1e3 / 50;
        tsys_event_release(g_ctx, &a); tsys_event_release(g_ctx, &b);
    }
    tsys_cuda_graph_free(g);
    std::sort(t, t + 5);
    return t[2];
}

enum { MAXG = 3 };
typedef struct group {
    int G;
    tsys_tensor *x, *w[MAXG], *w_all, *dy[MAXG], *dy_all, *dy_b, *w_b, *dyt[MAXG], *dyt_all, *x_b, *dyt_b;
} group;
static void run(tsys_tensor *y) { check(y != NULL, "matmul"); tsys_tensor_release(y); }
static void fwd_apart(void *u) { group *g = (group *)u; for (int i = 0; i < g->G; i++) run(tsys_matmul(g_ctx, g->x, g->w[i], true)); }
static void fwd_merged(void *u) { group *g = (group *)u; run(tsys_matmul(g_ctx, g->x, g->w_all, true)); }
static void fwd_batched(void *u) { group *g = (group *)u; run(tsys_matmul(g_ctx, g->x_b, g->w_b, true)); }
static void sum_into(tsys_tensor **parts, int G) {
    tsys_tensor *s = tsys_add(g_ctx, parts[0], parts[1]);
    for (int i = 2; i < G; i++) { tsys_tensor *t = tsys_add(g_ctx, s, parts[i]); tsys_tensor_release(s); s = t; }
    run(s);
}
static void dx_apart(void *u) {
    group *g = (group *)u;
    tsys_tensor *p[MAXG];
    for (int i = 0; i < g->G; i++) p[i] = tsys_matmul(g_ctx, g->dy[i], g->w[i], false);
    sum_into(p, g->G);
    for (int i = 0; i < g->G; i++) tsys_tensor_release(p[i]);
}
static void dx_merged(void *u) { group *g = (group *)u; run(tsys_matmul(g_ctx, g->dy_all, g->w_all, false)); }
static void dx_batched(void *u) {
    group *g = (group *)u;
    tsys_tensor *y = tsys_matmul(g_ctx, g->dy_b, g->w_b, false);   // (G, tokens, d)
    check(y != NULL, "batched matmul");
    tsys_tensor *p[MAXG];
    int64_t rows = y->shape[1], d = y->shape[2];
    for (int i = 0; i < g->G; i++) {
        int64_t shape[2] = { rows, d };
        p[i] = tsys_tensor_view_raw(g_ctx, y, (size_t)i * rows * d * 2, TSYS_BF16, 2, shape);
    }
    sum_into(p, g->G);
    for (int i = 0; i < g->G; i++) tsys_tensor_release(p[i]);
    tsys_tensor_release(y);
}
static void dw_apart(void *u) { group *g = (group *)u; for (int i = 0; i < g->G; i++) run(tsys_matmul(g_ctx, g->dyt[i], g->x, false)); }
static void dw_merged(void *u) { group *g = (group *)u; run(tsys_matmul(g_ctx, g->dyt_all, g->x, false)); }
static void dw_batched(void *u) { group *g = (group *)u; run(tsys_matmul(g_ctx, g->dyt_b, g->x_b, false)); }

static void measure(const char *model, const char *name, int G, int64_t tokens, int64_t d, int64_t width) {
    group g;
    memset(&g, 0, sizeof g);
    g.G = G;
    g.x = rand_bf16(2, tokens, d, 0);
    for (int i = 0; i < G; i++) { g.w[i] = rand_bf16(2, width, d, 0); g.dy[i] = rand_bf16(2, tokens, width, 0); g.dyt[i] = rand_bf16(2, width, tokens, 0); }
    g.w_all = rand_bf16(2, G * width, d, 0); g.dy_all = rand_bf16(2, tokens, G * width, 0); g.dyt_all = rand_bf16(2, G * width, tokens, 0);
    g.dy_b = rand_bf16(3, G, tokens, width); g.w_b = rand_bf16(3, G, width, d);
    g.x_b = rand_bf16(3, G, tokens, d); g.dyt_b = rand_bf16(3, G, width, tokens);
    double f0 = time_us(fwd_apart, &g), f1 = time_us(fwd_merged, &g), f2 = time_us(fwd_batched, &g);
    double x0 = time_us(dx_apart, &g), x1 = time_us(dx_merged, &g), x2 = time_us(dx_batched, &g);
    double w0 = time_us(dw_apart, &g), w1 = time_us(dw_merged, &g), w2 = time_us(dw_batched, &g);
    printf("| %s | %s | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f |\n", model, name, f0, f1, f2, x0, x1,
           x2, w0, w1, w2, (f0 + x0 + w0) - (f1 + x2 + w1), (f0 + x0 + w0) - (f2 + x2 + w2));
    tsys_tensor *all[] = { g.x, g.w_all, g.dy_all, g.dyt_all, g.dy_b, g.w_b, g.x_b, g.dyt_b };
    for (tsys_tensor *t : all) tsys_tensor_release(t);
    for (int i = 0; i < G; i++) { tsys_tensor_release(g.w[i]); tsys_tensor_release(g.dy[i]); tsys_tensor_release(g.dyt[i]); }
}

int main(void) {
    g_ctx = tsys_ctx_new(NULL);
    check(g_ctx && tsys_cuda_init(g_ctx, 0) == TSYS_OK, "tsys_cuda_init");
    tsys_no_grad_begin(g_ctx);
    printf("%s, 1024 tokens, bf16, us a replay (apart | merged; dX also strided-batched + adds)\n\n", tsys_cuda_device_name(g_ctx));
    printf("| model | group | fwd apart | fwd merged | fwd batched | dX apart | dX one K | dX batched | dW apart | dW merged | dW batched | saved (merged fwd, dW) | saved (all batched) |\n");
    printf("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    struct { const char *name; int64_t d, ff; } models[] = { { "small", 768, 3072 }, { "xl", 1600, 6400 }, { "2.7B", 2560, 10240 } };
    for (auto &m : models) {
        measure(m.name, "q, k, v", 3, 1024, m.d, m.d);
        measure(m.name, "w1, w3", 2, 1024, m.d, m.ff);
    }
    tsys_no_grad_end(g_ctx);
    tsys_ctx_free(g_ctx);
    return 0;
}
