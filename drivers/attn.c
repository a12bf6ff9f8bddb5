// attn - the attention benchmark: naive attention (scores, softmax, final matmul, every intermediate
// kept for backward) against FlashAttention-2, forward, backward and forward+backward latency,
// TFLOP/s, memory in use before backward and peak memory, one row per configuration.
//
//   attn --sweep pytorch_attention               # CS336 problem 6: batch 8, d x seq, fp32, naive vs flash
//   attn --sweep flash_benchmarking              # CS336 problem 10: batch 1, causal, seq 128..65536, bf16 + fp32
//   attn --sweep leaderboard                     # the CS336 leaderboard shape: 16 heads x 16384 x 64, bf16, causal
//   attn --impl flash --heads 16 --seq 4096 --d 64,128 --dtype bf16 --causal 1 --format csv
#include "prelude.h"
#include "driver_util.h"

// A sweep preset: the values of the flags it sets; flags given on the command line win. The first
// row is what a run without --sweep uses. (--impl is both in every preset, as by default.)
typedef struct attn_preset { const char *name, *d, *seq, *dtype, *causal, *grad; int batch, heads, warmup, reps; } attn_preset;
static const attn_preset attn_presets[] = {
    {"default", "64", "1024", "fp32", "0", "random", 8, 0, 5, 20},
    {"pytorch_attention", "16,32,64,128", "256,1024,4096,8192,16384", "fp32", "0", "random", 8, 0, 5, 100},
    {"flash_benchmarking", "16,32,64,128", "128,256,512,1024,2048,4096,8192,16384,32768,65536", "bf16,fp32", "1", "random", 1, 0, 3, 20},
    {"leaderboard", "64", "16384", "bf16", "1", "sum", 1, 16, 10, 100},
};

typedef struct attn_opts {
    const char *device, *impl, *sweep, *grad, *flash_fp32;
    int batch, heads, warmup, reps, seed;   // -1 until the command line or the preset sets them
    bool tf32;
    du_list d, seq, dtype, causal;          // empty until the command line or the preset fills them
    du_common common;
} attn_opts;

#define ATTN_EPILOGUE \
    "Sweep presets (flags given explicitly, before or after --sweep, override them):\n" \
    "  pytorch_attention   batch 8, d 16,32,64,128 x seq 256,1024,4096,8192,16384, fp32, warmup 5, 100 reps\n" \
    "  flash_benchmarking  batch 1, causal, d 16..128 x seq 128..65536 (powers of 2), bf16 and fp32, warmup 3\n" \
    "  leaderboard         batch 1, 16 heads, d 64, seq 16384, bf16, causal, --grad sum, warmup 10, 100 reps\n" \
    "Columns: median ms of forward, backward and both back to back; FLOP/s (GFLOP/s on the cpu, TFLOP/s on\n" \
    "cuda; forward 4 * batch * heads * seq^2 * d, halved when causal, backward 2.5x, both 3.5x); MiB in use\n" \
    "before backward, peak MiB; speedup: naive's fwd+bwd over flash's (--impl both).\n"

static bool ok_dim(const char *s) { int v; return du_parse_int(s, 1, 1 << 16, &v); }
static bool ok_seq(const char *s) { int v; return du_parse_int(s, 1, 1 << 24, &v); }

static void opts_free(attn_opts *o) { du_list_free(&o->d); du_list_free(&o->seq); du_list_free(&o->dtype); du_list_free(&o->causal); }

// Parses and checks every flag; returns 0 (o then owns the lists: opts_free), DU_HELP, or DU_EXIT_USAGE
// after a message naming the flag (DU_EXIT_FAILED: out of memory; nothing to free). Never exits.
static int parse_args(int argc, char **argv, attn_opts *o) {
    memset(o, 0, sizeof(*o));
    o->batch = o->heads = o->warmup = o->reps = -1;
    du_flag flags[] = {
        DU_FLAG_CHOICE("device", &o->device, NULL, "cpu|cuda", "where to run (default: cuda when a GPU is present, else cpu)"),
        DU_FLAG_CHOICE("impl", &o->impl, "both", "naive|flash|both",
                       "attention implementation(s); both: a naive row, then a flash row\nwith the speedup"),
        DU_FLAG_INT("batch", &o->batch, NULL, 1, 1 << 20, "batch size (default 8)"),
        DU_FLAG_INT("heads", &o->heads, NULL, 0, 1 << 16, "0 = no head dim: tensors (batch, seq, d); else (batch, heads, seq, d)\n(default 0)"),
        DU_FLAG_LIST_CHECKED("d", &o->d, NULL, ok_dim, "an integer from 1 to 65536", "head dims (default 64)"),
        DU_FLAG_LIST_CHECKED("seq", &o->seq, NULL, ok_seq, "an integer from 1 to 16777216", "sequence lengths (default 1024)"),
        DU_FLAG_LIST("dtype", &o->dtype, NULL, "fp32|bf16|fp16", "fp32, bf16 or fp16 tensors (default fp32)"),
        DU_FLAG_LIST("causal", &o->causal, NULL, "0|1", "0 (no mask) or 1 (causal mask) (default 0)"),
        DU_FLAG_CHOICE("grad", &o->grad, NULL, "random|sum", "backward of a random dO (backward_with), or of o.sum() (default random)"),
        DU_FLAG_INT("warmup", &o->warmup, NULL, 0, 1 << 20, "untimed forward+backward passes first (default 5)"),
        DU_FLAG_INT("reps", &o->reps, NULL, 1, 1 << 20, "timed passes per loop; the median is reported (default 20)"),
        DU_FLAG_CHOICE("sweep", &o->sweep, NULL, "pytorch_attention|flash_benchmarking|leaderboard", "a preset (below); explicit flags override it"),
        DU_FLAG_INT("seed", &o->seed, "0", 0, 1 << 30, "input seed"),
        DU_FLAG_BOOL("tf32", &o->tf32, "fp32 GEMMs of naive attention on TF32 tensor cores (cuda; default off)"),
        DU_FLAG_CHOICE("flash-fp32", &o->flash_fp32, "tf32", "tf32|exact", "fp32 flash attention on TF32 tensor cores (as Triton's fp32 tl.dot),\n"
                       "or exact fp32 on CUDA cores (cuda; the impl column says which)"),
        DU_COMMON_FLAGS(&o->common, DU_MEM_LIMIT_TEXT "\n(cuda: a cap on reserved bytes, to mimic a smaller device)"),
    };
    const int n = (int)(sizeof(flags) / sizeof(flags[0]));
    int rc = du_flags_parse("attn", flags, n, argc, argv, NULL, ATTN_EPILOGUE);
    if (rc) return rc;
    // what the command line left unset: from the preset of --sweep, or the defaults
    const attn_preset *p = &attn_presets[0];
    for (size_t i = 1; o->sweep && i < sizeof(attn_presets) / sizeof(attn_presets[0]); i++)
        if (!strcmp(o->sweep, attn_presets[i].name)) p = &attn_presets[i];
    if (o->batch < 0) o->batch = p->batch;
    if (o->heads < 0) o->heads = p->heads;
    if (o->warmup < 0) o->warmup = p->warmup;
    if (o->reps < 0) o->reps = p->reps;
    if (!o->grad) o->grad = p->grad;
    if (!o->device) o->device = du_has_cuda() ? "cuda" : "cpu";
    if (!(o->d.n || du_split(&o->d, "attn", "--d", p->d)) || !(o->seq.n || du_split(&o->seq, "attn", "--seq", p->seq))
        || !(o->dtype.n || du_split(&o->dtype, "attn", "--dtype", p->dtype))
        || !(o->causal.n || du_split(&o->causal, "attn", "--causal", p->causal))) {
        du_flags_free(flags, n);
        return DU_EXIT_FAILED;   // out of memory
    }
    // every tensor a configuration makes (q, k, v, dO, naive's scores) below 2^62 elements
    double S = 0, D = 0;   // the largest --seq and --d
    for (int i = 0; i < o->seq.n; i++) S = fmax(S, atof(o->seq.item[i]));
    for (int i = 0; i < o->d.n; i++) D = fmax(D, atof(o->d.item[i]));
    const double worst = (double)o->batch * (o->heads > 0 ? o->heads : 1) * S * fmax(S, D);
    if (!du_elems_ok(worst)) {
        fprintf(stderr, "attn: --batch x --heads x --seq x max(--seq, --d) is %.3g elements; one tensor holds at most 2^62\n", worst);
        rc = DU_EXIT_USAGE;
    }
#ifndef TSYS_WITH_CUDA
    if (!strcmp(o->device, "cuda")) {
        fprintf(stderr, "attn: --device cuda: this binary was built without CUDA; build build/attn_cuda with 'make cuda'\n");
        rc = DU_EXIT_USAGE;
    }
#endif
    if (rc) du_flags_free(flags, n);
    return rc;
}

// One configuration (one row): what it measures, its inputs.
typedef struct attn_case {
    tsys_ctx *ctx;
    const attn_opts *o;
    tsys_device dev; tsys_dtype dt; int d, seq; bool flash, causal;
    tsys_tensor *q, *k, *v, *dout;   // made by case_inputs, released by run_config
} attn_case;

// q, k, v (requiring gradients) and dO, fresh N(0, 1) values; the seed depends on the configuration
// only, so naive and flash see the same inputs.
static tsys_status case_inputs(attn_case *c) {
    const attn_opts *o = c->o;
    int64_t shape[4] = {o->batch, o->heads, c->seq, c->d};
    const int nd = o->heads > 0 ? 4 : 3;
    if (nd == 3) { shape[1] = c->seq; shape[2] = c->d; }   // --heads 0: (batch, seq, d)
    tsys_rng_seed(c->ctx, (uint64_t)o->seed * 1000003u + (uint64_t)c->seq * 131u + (uint64_t)c->d * 7u + (uint64_t)c->dt * 3u
                          + (c->causal ? 1u : 0u));
    tsys_tensor **in[4] = {&c->q, &c->k, &c->v, &c->dout};
    const char *names[4] = {"q", "k", "v", "dO"};
    for (int i = 0; i < 4; i++) {
        *in[i] = tsys_tensor_new(c->ctx, c->dt, c->dev, nd, shape);
        if (*in[i]) { tsys_tensor_set_name(*in[i], "%s", names[i]); tsys_tensor_randn(c->ctx, *in[i], 1.0f); }
    }
    tsys_status st = tsys_ctx_status(c->ctx);
    if (st == TSYS_OK) for (int i = 0; i < 3; i++) tsys_tensor_set_requires_grad(*in[i], true);
    return st;
}

// Drops the gradients that backward left in q, k, v: every pass starts from none (no accumulation,
// and the memory column does not carry the last pass's gradients).
static void case_drop_grads(attn_case *c) {
    tsys_tensor *in[3] = {c->q, c->k, c->v};
    for (int i = 0; i < 3; i++) if (in[i]) { tsys_tensor_release(in[i]->grad); in[i]->grad = NULL; }
}

// One forward+backward pass (backward of o.sum(), or of dO) between backend events ev[0] and ev[2]
// (cudaEvents on the GPU, the host clock on the CPU), reused from pass to pass. split: forward and
// backward timed apart (ms[0], ms[1]; an event between them, where the memory in use is read into
// *live), else back to back (ms[0]). Leaves no gradients; on failure, no tape either.
static tsys_status case_pass(attn_case *c, tsys_event ev[3], bool split, double ms[2], int64_t *live) {
    tsys_ctx *ctx = c->ctx;
    tsys_event_record(ctx, c->dev, TSYS_STREAM_COMPUTE, &ev[0]);
    tsys_tensor *out = c->flash ? tsys_flash_attention(ctx, c->q, c->k, c->v, c->causal, NULL)
                                : tsys_attention_naive(ctx, c->q, c->k, c->v, c->causal);
    if (split) {
        tsys_event_record(ctx, c->dev, TSYS_STREAM_COMPUTE, &ev[1]);
        *live = tsys_mem_stats_get(ctx, c->dev).live_bytes;
    }
    const bool sum = !strcmp(c->o->grad, "sum");
    tsys_tensor *loss = out && sum ? tsys_sum(ctx, out) : NULL;
    tsys_status st = !out || (sum && !loss) ? tsys_ctx_status(ctx) : sum ? tsys_backward(ctx, loss) : tsys_backward_with(ctx, out, c->dout);
    tsys_tensor_release(loss);
    tsys_tensor_release(out);
    tsys_event_record(ctx, c->dev, TSYS_STREAM_COMPUTE, &ev[2]);
    if (st == TSYS_OK) ms[0] = tsys_event_elapsed_ms(ctx, &ev[0], &ev[split ? 1 : 2]);
    if (st == TSYS_OK && split) ms[1] = tsys_event_elapsed_ms(ctx, &ev[1], &ev[2]);
    case_drop_grads(c);
    if (st == TSYS_OK) st = tsys_ctx_status(ctx);
    if (st != TSYS_OK) tsys_tape_clear(ctx);
    return st;
}

// Results of one configuration (what a flash row needs from the naive row before it).
typedef struct attn_result { bool ok; double fwd, bwd, total; } attn_result;

// The row's numbers from the timings (t: reps forward, reps backward, reps forward+backward).
static attn_result fill_row(const attn_case *c, du_row *row, const double *t, int64_t live_before_bwd, const attn_result *naive) {
    const attn_opts *o = c->o;
    const int n = o->reps;
    attn_result r = {true, tsys_stats_of(t, n).median, tsys_stats_of(t + n, n).median, tsys_stats_of(t + 2 * n, n).median};
    double fwd_flops = 4.0 * o->batch * (o->heads > 0 ? o->heads : 1) * (double)c->seq * c->seq * c->d * (c->causal ? 0.5 : 1.0);
    const bool cpu = c->dev == TSYS_CPU;
    double unit = cpu ? 1e6 : 1e9;   // FLOP per ms -> GFLOP/s or TFLOP/s
    du_row_set(row, "fwd_ms", "%.3f", r.fwd); du_row_set(row, "bwd_ms", "%.3f", r.bwd); du_row_set(row, "fwd+bwd_ms", "%.3f", r.total);
    du_row_set(row, cpu ? "fwd_GFLOP/s" : "fwd_TFLOP/s", "%.1f", fwd_flops / r.fwd / unit);
    du_row_set(row, cpu ? "bwd_GFLOP/s" : "bwd_TFLOP/s", "%.1f", 2.5 * fwd_flops / r.bwd / unit);
    du_row_set(row, cpu ? "fwd+bwd_GFLOP/s" : "fwd+bwd_TFLOP/s", "%.1f", 3.5 * fwd_flops / r.total / unit);
    du_row_set(row, "mem_before_bwd_MiB", "%.1f", (double)live_before_bwd / 1048576.0);
    du_row_set(row, "peak_MiB", "%.1f", (double)tsys_mem_stats_get(c->ctx, c->dev).peak_bytes / 1048576.0);
    if (naive && naive->ok) du_row_set(row, "speedup", "%.2f", naive->total / r.total);
    du_row_set(row, "status", "ok");
    return r;
}

// Measures one configuration into a row, on fresh inputs: --warmup untimed passes (each waited for),
// then --reps passes timed forward and backward apart (the memory column is read between them), then
// --reps timed forward+backward back to back; the medians. Progress counts the passes.
static attn_result run_config(attn_case *c, const attn_result *naive, du_row *row) {
    const attn_opts *o = c->o;
    tsys_ctx *ctx = c->ctx;
    du_row_set(row, "device", "%s", c->dev == TSYS_CPU ? "cpu" : "cuda");
    // fp32 on the GPU: which kernel multiplied (flash: --flash-fp32; naive: cuBLAS, --tf32)
    const bool f32_gpu = c->dev == TSYS_CUDA && c->dt == TSYS_F32, tf32 = c->flash ? !strcmp(o->flash_fp32, "tf32") : o->tf32;
    du_row_set(row, "impl", "%s%s", c->flash ? "flash" : "naive", !f32_gpu ? "" : tf32 ? " (tf32)" : " (exact)");
    du_row_set(row, "batch", "%d", o->batch); du_row_set(row, "heads", "%d", o->heads);
    du_row_set(row, "seq", "%d", c->seq); du_row_set(row, "d", "%d", c->d);
    du_row_set(row, "dtype", "%s", du_dtype_flag(c->dt)); du_row_set(row, "causal", "%d", c->causal ? 1 : 0);
    tsys_status st = case_inputs(c);
    tsys_sync(ctx, c->dev);
    tsys_mem_reset_peak(ctx, c->dev);
    const int n = o->reps, steps = o->warmup + 2 * n;
    double *t = (double *)calloc(3 * (size_t)n, sizeof(double));   // forward, backward, forward+backward
    if (st == TSYS_OK && !t) st = tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "out of host memory for %d timings", 3 * n);
    int64_t live_before_bwd = 0;
    tsys_event ev[3];
    memset(ev, 0, sizeof(ev));
    for (int s = 1; st == TSYS_OK && s <= steps; s++) {
        const int i = s - 1 - o->warmup;   // < 0: warmup; [0, n): forward and backward apart; [n, 2n): back to back
        double ms[2] = {0, 0};
        st = case_pass(c, ev, i >= 0 && i < n, ms, &live_before_bwd);
        if (i < 0 && st == TSYS_OK) st = tsys_sync(ctx, c->dev);
        if (i >= 0 && i < n) { t[i] = ms[0]; t[n + i] = ms[1]; }
        if (i >= n) t[n + i] = ms[0];
        du_progress_step(i < 0 ? "warmup" : "timed", s, steps);
    }
    for (int i = 0; i < 3; i++) tsys_event_release(ctx, &ev[i]);
    attn_result res = {false, 0, 0, 0};
    if (st == TSYS_OK) res = fill_row(c, row, t, live_before_bwd, c->flash ? naive : NULL);
    else du_row_set(row, "status", "%s: %s", st == TSYS_ERR_OOM ? "OOM" : "error", tsys_ctx_last_error(ctx));
    free(t);
    tsys_tape_clear(ctx);
    case_drop_grads(c);
    tsys_tensor_release(c->q); tsys_tensor_release(c->k); tsys_tensor_release(c->v); tsys_tensor_release(c->dout);
    c->q = c->k = c->v = c->dout = NULL;
    tsys_ctx_clear_error(ctx);
#ifdef TSYS_WITH_CUDA
    // the next configuration starts from an empty cache
    if (c->dev == TSYS_CUDA) { tsys_cuda_empty_cache(ctx); tsys_ctx_clear_error(ctx); }
#endif
    return res;
}

static int driver_main(int argc, char **argv) {
    attn_opts o;
    int rc = parse_args(argc, argv, &o);
    if (rc == DU_HELP) return DU_EXIT_OK;
    if (rc) return rc;
    const du_common *cm = &o.common;
    du_progress_setup("attn", cm->progress);
    tsys_device dev = strcmp(o.device, "cuda") ? TSYS_CPU : TSYS_CUDA;
    const bool both = !strcmp(o.impl, "both");
    const int rows = o.dtype.n * o.causal.n * o.d.n * o.seq.n * (both ? 2 : 1);
    // the budget applies to the device measured; the other keeps its default
    tsys_ctx *ctx = cm->dry_run ? NULL : du_ctx_new("attn", dev, cm->mem_limit);
    if (!cm->dry_run && !ctx) { opts_free(&o); return DU_EXIT_FAILED; }
    char where[160], lim[64];
    snprintf(where, sizeof(where), "%s, %d threads", o.device, du_num_threads());
#ifdef TSYS_WITH_CUDA
    if (dev == TSYS_CUDA && ctx) {
        if (!du_ctx_cuda("attn", ctx, dev, cm->mem_limit)) {
            tsys_ctx_free(ctx); opts_free(&o);
            return DU_EXIT_FAILED;
        }
        tsys_cuda_set_tf32(ctx, o.tf32);
        tsys_cuda_set_flash_fp32_exact(ctx, !strcmp(o.flash_fp32, "exact"));
        snprintf(where, sizeof(where), "cuda, %.120s", tsys_cuda_device_name(ctx));
    }
#endif
    FILE *pre = du_preamble(cm);
    fprintf(pre, "attn: %s; sweep %s; impl %s; batch %d; heads %d; d %s; seq %s; dtype %s; causal %s; grad %s; flash fp32 %s; naive tf32 %s; "
            "warmup %d; reps %d; memory limit %s\n", where, o.sweep ? o.sweep : "-", o.impl, o.batch, o.heads, o.d.src, o.seq.src, o.dtype.src,
            o.causal.src, o.grad, o.flash_fp32, o.tf32 ? "on" : "off", o.warmup, o.reps,
            dev == TSYS_CUDA && !cm->mem_limit ? "the whole device" : du_mem_limit_str(lim, sizeof(lim), cm->mem_limit));
    if (cm->dry_run) { opts_free(&o); return du_dry_run_done(cm, "attn", rows); }
    if (pre == stdout) printf("\n");   // markdown: a blank line before the table
    fflush(stdout);
    const char *G = dev == TSYS_CPU ? "G" : "T";
    char cols[400];
    snprintf(cols, sizeof(cols), "device,impl,batch,heads,seq,d,dtype,causal,fwd_ms,bwd_ms,fwd+bwd_ms,fwd_%sFLOP/s,bwd_%sFLOP/s,fwd+bwd_%sFLOP/s,"
             "mem_before_bwd_MiB,peak_MiB,speedup,status", G, G, G);
    du_table tab;
    du_table_init(&tab, cols, cm->format);
    du_progress_begin(rows);
    int k = 0;
    for (int t = 0; t < o.dtype.n; t++)
        for (int ci = 0; ci < o.causal.n; ci++)
            for (int di = 0; di < o.d.n; di++)
                for (int si = 0; si < o.seq.n; si++) {
                    attn_case c = {ctx, &o, dev, TSYS_F32, 0, 0, false, !strcmp(o.causal.item[ci], "1"), NULL, NULL, NULL, NULL};
                    du_parse_dtype(o.dtype.item[t], &c.dt);   // all three checked by parse_args
                    du_parse_int(o.d.item[di], 1, 1 << 16, &c.d); du_parse_int(o.seq.item[si], 1, 1 << 24, &c.seq);
                    attn_result naive = {false, 0, 0, 0};
                    for (int flash = 0; flash < 2; flash++) {
                        if (!both && strcmp(o.impl, flash ? "flash" : "naive")) continue;
                        c.flash = flash;
                        du_progress_config(++k, "%s %s d %d seq %d causal %d", flash ? "flash" : "naive", o.dtype.item[t], c.d, c.seq, c.causal);
                        attn_result r = run_config(&c, both ? &naive : NULL, du_table_row(&tab));
                        if (!flash) naive = r;
                        du_table_emit(&tab);
                    }
                }
    du_progress_end();
    rc = du_table_exit_code(&tab, "attn", cm->oom_ok);
    du_table_free(&tab);
    opts_free(&o);
    tsys_ctx_free(ctx);   // also shuts the CUDA backend down
    return rc;
}

int main(int argc, char **argv) { return du_exit("attn", driver_main(argc, argv)); }
