// attn - the attention benchmark: naive attention (scores, softmax, final matmul, every intermediate
// kept for backward) against FlashAttention-2, forward, backward and forward+backward latency,
// TFLOP/s, memory in use before backward and peak memory, one row per configuration.
//
//   attn --sweep pytorch_attention               # CS336 problem 6: batch 8, d x seq, fp32, naive vs flash
//   attn --sweep flash_benchmarking              # CS336 problem 10: batch 1, causal, seq 128..65536, bf16 + fp32
//   attn --sweep leaderboard                     # the CS336 leaderboard shape: 16 heads x 16384 x 64, bf16, causal
//   attn --impl flash --heads 16 --seq 4096 --d 64,128 --dtype bf16 --causal 1 --format csv
//
// Comma-separated lists in --d, --seq, --dtype and --causal sweep every combination; a sweep preset
// sets everything else, and flags given explicitly (before or after --sweep) override it.
//
// Timing: host clock around each pass with tsys_sync before and after (median of --reps). One loop
// times forward and backward separately (the memory column is read between them); a second loop
// times forward+backward back to back with one sync at the end. Inputs are fresh N(0, 1) values for
// every configuration (the same for naive and flash), the output gradient too.
// FLOPs (FlashAttention convention): forward 4 * batch * heads * seq^2 * d, halved when causal;
// backward 2.5x the forward; forward+backward 3.5x.
#ifndef TSYS_LINKED_IMPL   // the Makefile's CUDA build compiles the implementations once and links them
#define TSYS_IMPLEMENTATION
#endif
#include "../tsys.h"
#ifdef TSYS_WITH_CUDA
#ifndef TSYS_LINKED_IMPL
#define TSYS_CUDA_IMPLEMENTATION
#endif
#include "../tsys_cuda.cuh"
#endif
#include "driver_util.h"

// Flags that a sweep preset may set; explicit flags are remembered so that the preset leaves them alone.
enum { F_IMPL = 1, F_BATCH = 2, F_HEADS = 4, F_D = 8, F_SEQ = 16, F_DTYPE = 32, F_CAUSAL = 64, F_WARMUP = 128, F_REPS = 256, F_GRAD = 512 };

typedef struct attn_opts {
    const char *device, *impl, *ds, *seqs, *dtypes, *causals, *format, *sweep, *grad, *flash_fp32;
    int batch, heads, warmup, reps;
    size_t mem_limit;   // bytes; 0 = the default budget
    uint64_t seed;
    bool tf32, oom_ok, dry_run;
    unsigned given;     // F_* flags set on the command line
    du_list d_list, seq_list, dtype_list, causal_list;   // the lists, split and checked
} attn_opts;

static void usage(FILE *f) {
    fprintf(f,
        "usage: attn [flags]\n"
        "  --device cpu|cuda          where to run (default: cuda when a GPU is present, else cpu)\n"
        "  --impl naive|flash|both    attention implementation(s) (default both: naive row, then flash row with speedup)\n"
        "  --batch N                  (default 8)\n"
        "  --heads N                  0 = no head dim: tensors (batch, seq, d); else (batch, heads, seq, d) (default 0)\n"
        "  --d LIST                   head dims (default 64)\n"
        "  --seq LIST                 sequence lengths (default 1024)\n"
        "  --dtype LIST               fp32 | bf16 | fp16 tensors (default fp32)\n"
        "  --causal LIST              0 | 1 (default 0)\n"
        "  --grad random|sum          backward of a random dO (backward_with), or of o.sum() (default random)\n"
        "  --warmup N                 untimed forward+backward passes first (default 5)\n"
        "  --reps N                   timed passes per loop; the median is reported (default 20)\n"
        "  --format md|csv|jsonl      output rows (default md)\n"
        "  --sweep NAME               a preset; explicit flags override it:\n"
        "                               pytorch_attention   batch 8, no heads, d 16,32,64,128 x seq 256,1024,4096,8192,16384,\n"
        "                                                   fp32, non-causal, both, warmup 5, 100 reps\n"
        "                               flash_benchmarking  batch 1, no heads, causal, seq 128..65536 (powers of 2),\n"
        "                                                   d 16..128 (powers of 2), bf16 and fp32, both, warmup 3, 20 reps\n"
        "                               leaderboard         batch 1, 16 heads x 16384 x 64, bf16, causal, backward of o.sum(),\n"
        "                                                   both, warmup 10, 100 reps\n"
        DU_MEM_LIMIT_HELP
        "                             (cuda: a cap on reserved bytes, to mimic a smaller device)\n"
        "  --oom-ok                   out-of-memory rows do not make the exit status 1 (sweeps that expect them)\n"
        "  --seed N                   input seed (default 0)\n"
        "  --tf32                     fp32 GEMMs of naive attention on TF32 tensor cores (cuda; default off)\n"
        "  --flash-fp32 tf32|exact    fp32 flash attention on TF32 tensor cores, or exact fp32 on CUDA cores\n"
        "                             (cuda; default tf32, as Triton's fp32 tl.dot; the impl column says which)\n"
        "  --dry-run                  check the flags, print the configuration, measure nothing\n"
        "  --help\n"
        "Lists are comma-separated (at most %d values); rows are printed as soon as they are measured.\n"
        DU_EXIT_HELP, DU_LIST_MAX);
}

static bool apply_sweep(attn_opts *o) {
    unsigned g = o->given;
    if (!o->sweep) return true;
    if (!strcmp(o->sweep, "pytorch_attention")) {
        if (!(g & F_IMPL)) o->impl = "both";
        if (!(g & F_BATCH)) o->batch = 8;
        if (!(g & F_HEADS)) o->heads = 0;
        if (!(g & F_D)) o->ds = "16,32,64,128";
        if (!(g & F_SEQ)) o->seqs = "256,1024,4096,8192,16384";
        if (!(g & F_DTYPE)) o->dtypes = "fp32";
        if (!(g & F_CAUSAL)) o->causals = "0";
        if (!(g & F_WARMUP)) o->warmup = 5;
        if (!(g & F_REPS)) o->reps = 100;
    } else if (!strcmp(o->sweep, "flash_benchmarking")) {
        if (!(g & F_IMPL)) o->impl = "both";
        if (!(g & F_BATCH)) o->batch = 1;
        if (!(g & F_HEADS)) o->heads = 0;
        if (!(g & F_D)) o->ds = "16,32,64,128";
        if (!(g & F_SEQ)) o->seqs = "128,256,512,1024,2048,4096,8192,16384,32768,65536";
        if (!(g & F_DTYPE)) o->dtypes = "bf16,fp32";
        if (!(g & F_CAUSAL)) o->causals = "1";
        if (!(g & F_WARMUP)) o->warmup = 3;
        if (!(g & F_REPS)) o->reps = 20;
    } else if (!strcmp(o->sweep, "leaderboard")) {
        if (!(g & F_IMPL)) o->impl = "both";
        if (!(g & F_BATCH)) o->batch = 1;
        if (!(g & F_HEADS)) o->heads = 16;
        if (!(g & F_D)) o->ds = "64";
        if (!(g & F_SEQ)) o->seqs = "16384";
        if (!(g & F_DTYPE)) o->dtypes = "bf16";
        if (!(g & F_CAUSAL)) o->causals = "1";
        if (!(g & F_GRAD)) o->grad = "sum";
        if (!(g & F_WARMUP)) o->warmup = 10;
        if (!(g & F_REPS)) o->reps = 100;
    } else {
        return false;
    }
    return true;
}


static bool ok_dim(const char *s) { int v; return du_parse_int(s, 1, 1 << 16, &v); }
static bool ok_seq(const char *s) { int v; return du_parse_int(s, 1, 1 << 24, &v); }
static bool ok_dtype(const char *s) { tsys_dtype d; return du_parse_dtype(s, &d); }
static bool ok_causal(const char *s) { return !strcmp(s, "0") || !strcmp(s, "1"); }

static void opts_free(attn_opts *o) {
    du_list_free(&o->d_list); du_list_free(&o->seq_list); du_list_free(&o->dtype_list); du_list_free(&o->causal_list);
}

// Parses and checks every flag and list; returns 0 (o then owns the lists: opts_free), DU_HELP,
// or DU_EXIT_USAGE after a message naming the flag (nothing to free). Never exits.
static int parse_args(int argc, char **argv, attn_opts *o) {
    memset(o, 0, sizeof(*o));
    o->device = du_has_cuda() ? "cuda" : "cpu";
    o->impl = "both"; o->ds = "64"; o->seqs = "1024"; o->dtypes = "fp32"; o->causals = "0"; o->format = "md"; o->grad = "random";
    o->flash_fp32 = "tf32";
    o->batch = 8; o->heads = 0; o->warmup = 5; o->reps = 20;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) return DU_HELP;
        if (!strcmp(a, "--tf32")) { o->tf32 = true; continue; }
        if (!strcmp(a, "--oom-ok")) { o->oom_ok = true; continue; }
        if (!strcmp(a, "--dry-run")) { o->dry_run = true; continue; }
        static const char *const valued[] = {"--device", "--impl", "--batch", "--heads", "--d", "--seq", "--dtype", "--causal", "--grad",
                                             "--warmup", "--reps", "--format", "--sweep", "--mem-limit", "--seed", "--flash-fp32"};
        bool known = false;
        for (size_t j = 0; j < sizeof(valued) / sizeof(valued[0]); j++) known = known || !strcmp(a, valued[j]);
        if (!known) { fprintf(stderr, "attn: unknown flag '%s'\n", a); usage(stderr); return DU_EXIT_USAGE; }
        if (i + 1 >= argc) { fprintf(stderr, "attn: flag %s needs a value\n", a); return DU_EXIT_USAGE; }
        const char *v = argv[++i];
        bool ok = true;
        if (!strcmp(a, "--device")) o->device = v;
        else if (!strcmp(a, "--impl")) { o->impl = v; o->given |= F_IMPL; }
        else if (!strcmp(a, "--batch")) { ok = du_parse_int(v, 1, 1 << 20, &o->batch); o->given |= F_BATCH; }
        else if (!strcmp(a, "--heads")) { ok = du_parse_int(v, 0, 1 << 16, &o->heads); o->given |= F_HEADS; }
        else if (!strcmp(a, "--d")) { o->ds = v; o->given |= F_D; }
        else if (!strcmp(a, "--seq")) { o->seqs = v; o->given |= F_SEQ; }
        else if (!strcmp(a, "--dtype")) { o->dtypes = v; o->given |= F_DTYPE; }
        else if (!strcmp(a, "--causal")) { o->causals = v; o->given |= F_CAUSAL; }
        else if (!strcmp(a, "--grad")) { o->grad = v; o->given |= F_GRAD; }
        else if (!strcmp(a, "--warmup")) { ok = du_parse_int(v, 0, 1 << 20, &o->warmup); o->given |= F_WARMUP; }
        else if (!strcmp(a, "--reps")) { ok = du_parse_int(v, 1, 1 << 20, &o->reps); o->given |= F_REPS; }
        else if (!strcmp(a, "--format")) o->format = v;
        else if (!strcmp(a, "--flash-fp32")) o->flash_fp32 = v;
        else if (!strcmp(a, "--sweep")) o->sweep = v;
        else if (!strcmp(a, "--mem-limit")) { if (!du_parse_gib("attn", a, v, &o->mem_limit)) return DU_EXIT_USAGE; }
        else if (!strcmp(a, "--seed")) { int s; ok = du_parse_int(v, 0, 1 << 30, &s); o->seed = (uint64_t)s; }
        if (!ok) { fprintf(stderr, "attn: bad value '%s' for %s\n", v, a); usage(stderr); return DU_EXIT_USAGE; }
    }
    if (!apply_sweep(o)) { fprintf(stderr, "attn: unknown sweep '%s' (pytorch_attention, flash_benchmarking, leaderboard)\n", o->sweep); return DU_EXIT_USAGE; }
    if (strcmp(o->device, "cpu") && strcmp(o->device, "cuda")) { fprintf(stderr, "attn: --device must be cpu or cuda, not '%s'\n", o->device); return DU_EXIT_USAGE; }
    if (strcmp(o->impl, "naive") && strcmp(o->impl, "flash") && strcmp(o->impl, "both")) { fprintf(stderr, "attn: --impl must be naive, flash or both, not '%s'\n", o->impl); return DU_EXIT_USAGE; }
    if (strcmp(o->flash_fp32, "tf32") && strcmp(o->flash_fp32, "exact")) { fprintf(stderr, "attn: --flash-fp32 must be tf32 or exact, not '%s'\n", o->flash_fp32); return DU_EXIT_USAGE; }
    if (strcmp(o->grad, "random") && strcmp(o->grad, "sum")) { fprintf(stderr, "attn: --grad must be random or sum, not '%s'\n", o->grad); return DU_EXIT_USAGE; }
    if (!du_format_ok(o->format)) { fprintf(stderr, "attn: --format must be md, csv or jsonl, not '%s'\n", o->format); return DU_EXIT_USAGE; }
#ifndef TSYS_WITH_CUDA
    if (!strcmp(o->device, "cuda")) { fprintf(stderr, "attn: this binary was built without CUDA; build build/attn_cuda with 'make cuda'\n"); return DU_EXIT_USAGE; }
#endif
    if (!du_split_check(&o->d_list, "attn", "--d", o->ds, ok_dim, "an integer from 1 to 65536")
        || !du_split_check(&o->seq_list, "attn", "--seq", o->seqs, ok_seq, "an integer from 1 to 16777216")
        || !du_split_check(&o->dtype_list, "attn", "--dtype", o->dtypes, ok_dtype, "fp32, bf16 or fp16")
        || !du_split_check(&o->causal_list, "attn", "--causal", o->causals, ok_causal, "0 or 1")) {
        opts_free(o);
        return DU_EXIT_USAGE;
    }
    // every tensor a configuration makes (q, k, v, dO, naive's scores) below 2^62 elements
    double bh = (double)o->batch * (o->heads > 0 ? o->heads : 1), worst = 0;
    for (int si = 0; si < o->seq_list.n; si++)
        for (int di = 0; di < o->d_list.n; di++) {
            double seq = atof(o->seq_list.item[si]), d = atof(o->d_list.item[di]);
            double n = bh * seq * (seq > d ? seq : d);
            if (n > worst) worst = n;
        }
    if (!du_elems_ok(worst)) {
        fprintf(stderr, "attn: --batch x --heads x --seq x max(--seq, --d) is %.3g elements; one tensor holds at most 2^62\n", worst);
        opts_free(o);
        return DU_EXIT_USAGE;
    }
    return 0;
}

// One configuration: its inputs and what one pass needs.
typedef struct attn_case {
    tsys_ctx *ctx;
    tsys_device dev;
    bool flash, causal, sum_loss;
    tsys_tensor *q, *k, *v, *dout;
} attn_case;

static tsys_tensor *case_forward(attn_case *c) {
    return c->flash ? tsys_flash_attention(c->ctx, c->q, c->k, c->v, c->causal, NULL)
                    : tsys_attention_naive(c->ctx, c->q, c->k, c->v, c->causal);
}

// Drops the gradients that backward left in q, k, v: every pass starts from none (no accumulation,
// and the memory column does not carry the last pass's gradients).
static void case_drop_grads(attn_case *c) {
    tsys_tensor *in[3] = {c->q, c->k, c->v};
    for (int i = 0; i < 3; i++) { tsys_tensor_release(in[i]->grad); in[i]->grad = NULL; }
}

// Backward from o (consumes it): o.sum().backward() or o.backward(dO).
static tsys_status case_backward(attn_case *c, tsys_tensor *o) {
    tsys_status st;
    if (c->sum_loss) {
        tsys_tensor *loss = tsys_sum(c->ctx, o);
        st = tsys_backward(c->ctx, loss);
        tsys_tensor_release(loss);
    } else {
        st = tsys_backward_with(c->ctx, o, c->dout);
    }
    tsys_tensor_release(o);
    return st;
}

// After a pass: free the gradients; on failure, also drop whatever the tape still holds.
static tsys_status case_pass_end(attn_case *c, tsys_status st) {
    case_drop_grads(c);
    if (st != TSYS_OK || tsys_ctx_status(c->ctx) != TSYS_OK) tsys_tape_clear(c->ctx);
    return st != TSYS_OK ? st : tsys_ctx_status(c->ctx);
}

static void case_free(attn_case *c) {
    if (c->q) case_drop_grads(c);
    tsys_tensor_release(c->q); tsys_tensor_release(c->k); tsys_tensor_release(c->v); tsys_tensor_release(c->dout);
    c->q = c->k = c->v = c->dout = NULL;
}

static double median_of(double *x, int n) { return n > 0 ? tsys_stats_of(x, n).median : 0.0; }

// Results of one configuration (what a flash row needs from the naive row before it).
typedef struct attn_result { bool ok; double fwd, bwd, total; } attn_result;

static const char *dtype_str(tsys_dtype dt) { return dt == TSYS_F32 ? "fp32" : dt == TSYS_BF16 ? "bf16" : "fp16"; }

static attn_result run_config(tsys_ctx *ctx, tsys_device dev, const attn_opts *o, bool flash, tsys_dtype dt, int d, int seq, bool causal,
                              const attn_result *naive, du_table *tab) {
    attn_result res = {false, 0, 0, 0};
    du_row *row = du_table_row(tab);
    const char *flops_col[3] = { dev == TSYS_CPU ? "fwd_GFLOP/s" : "fwd_TFLOP/s", dev == TSYS_CPU ? "bwd_GFLOP/s" : "bwd_TFLOP/s",
                                 dev == TSYS_CPU ? "fwd+bwd_GFLOP/s" : "fwd+bwd_TFLOP/s" };
    du_row_set(row, "device", "%s", dev == TSYS_CPU ? "cpu" : "cuda");
    // fp32 on the GPU: which kernel multiplied (flash: --flash-fp32; naive: cuBLAS, --tf32)
    const bool f32_gpu = dev == TSYS_CUDA && dt == TSYS_F32;
    du_row_set(row, "impl", "%s%s", flash ? "flash" : "naive",
               !f32_gpu ? "" : flash ? (!strcmp(o->flash_fp32, "exact") ? " (exact)" : " (tf32)") : o->tf32 ? " (tf32)" : " (exact)");
    du_row_set(row, "batch", "%d", o->batch);
    du_row_set(row, "heads", "%d", o->heads);
    du_row_set(row, "seq", "%d", seq);
    du_row_set(row, "d", "%d", d);
    du_row_set(row, "dtype", "%s", dtype_str(dt));
    du_row_set(row, "causal", "%d", causal ? 1 : 0);

    attn_case c;
    memset(&c, 0, sizeof(c));
    c.ctx = ctx; c.dev = dev; c.flash = flash; c.causal = causal; c.sum_loss = !strcmp(o->grad, "sum");
    int64_t shape[4];
    int nd = 0;
    shape[nd++] = o->batch;
    if (o->heads > 0) shape[nd++] = o->heads;
    shape[nd++] = seq; shape[nd++] = d;
    // the same inputs for naive and flash: the seed depends on the configuration only
    tsys_rng_seed(ctx, o->seed * 1000003u + (uint64_t)seq * 131u + (uint64_t)d * 7u + (uint64_t)dt * 3u + (causal ? 1u : 0u));
    tsys_tensor **in[4] = {&c.q, &c.k, &c.v, &c.dout};
    const char *names[4] = {"q", "k", "v", "dO"};
    for (int i = 0; i < 4; i++) {
        *in[i] = tsys_tensor_new(ctx, dt, dev, nd, shape);
        if (*in[i]) { tsys_tensor_set_name(*in[i], "%s", names[i]); tsys_tensor_randn(ctx, *in[i], 1.0f); }
    }
    tsys_status st = tsys_ctx_status(ctx);
    if (st == TSYS_OK) for (int i = 0; i < 3; i++) tsys_tensor_set_requires_grad(*in[i], true);
    tsys_sync(ctx, dev);
    tsys_mem_reset_peak(ctx, dev);

    int n = o->reps;
    double *tf = (double *)calloc((size_t)n, sizeof(double)), *tb = (double *)calloc((size_t)n, sizeof(double)), *tt = (double *)calloc((size_t)n, sizeof(double));
    if (st == TSYS_OK && !(tf && tb && tt)) st = tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "out of host memory for %d timings", n);
    int64_t live_before_bwd = 0;
    const char *label = flash ? "flash" : "naive";
    // warmup: whole passes, untimed
    for (int i = 0; st == TSYS_OK && i < o->warmup; i++) {
        du_progress("%s %s seq %d d %d: warmup %d/%d", label, dtype_str(dt), seq, d, i + 1, o->warmup);
        tsys_tensor *out = case_forward(&c);
        st = case_pass_end(&c, out ? case_backward(&c, out) : tsys_ctx_status(ctx));
        if (st == TSYS_OK) st = tsys_sync(ctx, dev);
    }
    // loop 1: forward and backward timed separately (backend events: cudaEvents on the GPU, the host
    // clock on the CPU); the memory in use is read between them
    tsys_event ev[3];
    memset(ev, 0, sizeof(ev));
    for (int i = 0; st == TSYS_OK && i < n; i++) {
        du_progress("%s %s seq %d d %d: fwd/bwd %d/%d", label, dtype_str(dt), seq, d, i + 1, n);
        tsys_event_record(ctx, dev, TSYS_STREAM_COMPUTE, &ev[0]);
        tsys_tensor *out = case_forward(&c);
        tsys_event_record(ctx, dev, TSYS_STREAM_COMPUTE, &ev[1]);
        if (!out) st = tsys_ctx_status(ctx);
        live_before_bwd = tsys_mem_stats_get(ctx, dev).live_bytes;
        if (st == TSYS_OK) st = case_backward(&c, out);
        else tsys_tensor_release(out);
        tsys_event_record(ctx, dev, TSYS_STREAM_COMPUTE, &ev[2]);
        if (st == TSYS_OK) { tf[i] = tsys_event_elapsed_ms(ctx, &ev[0], &ev[1]); tb[i] = tsys_event_elapsed_ms(ctx, &ev[1], &ev[2]); st = tsys_ctx_status(ctx); }
        st = case_pass_end(&c, st);
    }
    // loop 2: forward+backward back to back, the host waits only at the end
    for (int i = 0; st == TSYS_OK && i < n; i++) {
        du_progress("%s %s seq %d d %d: fwd+bwd %d/%d", label, dtype_str(dt), seq, d, i + 1, n);
        tsys_event_record(ctx, dev, TSYS_STREAM_COMPUTE, &ev[0]);
        tsys_tensor *out = case_forward(&c);
        st = out ? case_backward(&c, out) : tsys_ctx_status(ctx);
        tsys_event_record(ctx, dev, TSYS_STREAM_COMPUTE, &ev[1]);
        if (st == TSYS_OK) { tt[i] = tsys_event_elapsed_ms(ctx, &ev[0], &ev[1]); st = tsys_ctx_status(ctx); }
        st = case_pass_end(&c, st);
    }
    for (int i = 0; i < 3; i++) tsys_event_release(ctx, &ev[i]);
    du_progress_done();
    if (st == TSYS_OK) {
        res.ok = true;
        res.fwd = median_of(tf, n); res.bwd = median_of(tb, n); res.total = median_of(tt, n);
        double heads = o->heads > 0 ? o->heads : 1;
        double fwd_flops = 4.0 * o->batch * heads * (double)seq * seq * d * (causal ? 0.5 : 1.0);
        double unit = dev == TSYS_CPU ? 1e6 : 1e9;   // FLOP per ms -> GFLOP/s or TFLOP/s
        du_row_set(row, "fwd_ms", "%.3f", res.fwd);
        du_row_set(row, "bwd_ms", "%.3f", res.bwd);
        du_row_set(row, "fwd+bwd_ms", "%.3f", res.total);
        du_row_set(row, flops_col[0], "%.1f", fwd_flops / res.fwd / unit);
        du_row_set(row, flops_col[1], "%.1f", 2.5 * fwd_flops / res.bwd / unit);
        du_row_set(row, flops_col[2], "%.1f", 3.5 * fwd_flops / res.total / unit);
        du_row_set(row, "mem_before_bwd_MiB", "%.1f", (double)live_before_bwd / 1048576.0);
        du_row_set(row, "peak_MiB", "%.1f", (double)tsys_mem_stats_get(ctx, dev).peak_bytes / 1048576.0);
        if (flash && naive && naive->ok) du_row_set(row, "speedup", "%.2f", naive->total / res.total);
        du_row_set(row, "status", "ok");
    } else {
        du_row_set(row, "status", "%s: %s", st == TSYS_ERR_OOM ? "OOM" : "error", tsys_ctx_last_error(ctx));
    }
    free(tf); free(tb); free(tt);
    tsys_tape_clear(ctx);
    case_free(&c);
    tsys_ctx_clear_error(ctx);
#ifdef TSYS_WITH_CUDA
    if (dev == TSYS_CUDA) tsys_cuda_empty_cache(ctx);   // the next configuration starts from an empty cache
#endif
    tsys_ctx_clear_error(ctx);
    return res;
}

static int driver_main(int argc, char **argv) {
    attn_opts o;
    int rc = parse_args(argc, argv, &o);
    if (rc == DU_HELP) { usage(stdout); return DU_EXIT_OK; }
    if (rc) return rc;
    tsys_device dev = strcmp(o.device, "cuda") ? TSYS_CPU : TSYS_CUDA;
    // the budget applies to the device measured; the other keeps its default
    tsys_ctx_desc cd;
    memset(&cd, 0, sizeof(cd));
    if (dev == TSYS_CPU) cd.cpu_memory_limit = o.mem_limit;
    tsys_ctx *ctx = o.dry_run ? NULL : tsys_ctx_new(&cd);
    if (!o.dry_run && !ctx) { fprintf(stderr, "attn: out of memory creating the context\n"); opts_free(&o); return DU_EXIT_FAILED; }
    char where[160], lim[64];
    snprintf(where, sizeof(where), "%s, %d threads", o.device, du_num_threads());
#ifdef TSYS_WITH_CUDA
    if (dev == TSYS_CUDA && ctx) {
        if (tsys_cuda_init(ctx, 0) != TSYS_OK) { fprintf(stderr, "attn: %s\n", tsys_ctx_last_error(ctx)); tsys_ctx_free(ctx); opts_free(&o); return DU_EXIT_FAILED; }
        tsys_cuda_set_tf32(ctx, o.tf32);
        tsys_cuda_set_flash_fp32_exact(ctx, !strcmp(o.flash_fp32, "exact"));
        if (o.mem_limit) tsys_cuda_set_memory_limit(ctx, o.mem_limit);
        snprintf(where, sizeof(where), "cuda, %.120s", tsys_cuda_device_name(ctx));
    }
#endif
    // the effective configuration on one line (stdout for md, stderr for the machine formats)
    FILE *cfg = strcmp(o.format, "md") ? stderr : stdout;
    fprintf(cfg, "attn: %s; sweep %s; impl %s; batch %d; heads %d; d %s; seq %s; dtype %s; causal %s; grad %s; flash fp32 %s; naive tf32 %s; warmup %d; reps %d; memory limit %s\n",
            where, o.sweep ? o.sweep : "-", o.impl, o.batch, o.heads, o.ds, o.seqs, o.dtypes, o.causals, o.grad, o.flash_fp32, o.tf32 ? "on" : "off", o.warmup, o.reps,
            dev == TSYS_CUDA && !o.mem_limit ? "the whole device" : du_mem_limit_str(lim, sizeof(lim), o.mem_limit));
    if (o.dry_run) { opts_free(&o); return DU_EXIT_OK; }
    if (cfg == stdout) printf("\n");   // markdown: a blank line before the table
    fflush(stdout);
    du_table tab;
    du_table_init(&tab, dev == TSYS_CPU
        ? "device,impl,batch,heads,seq,d,dtype,causal,fwd_ms,bwd_ms,fwd+bwd_ms,fwd_GFLOP/s,bwd_GFLOP/s,fwd+bwd_GFLOP/s,mem_before_bwd_MiB,peak_MiB,speedup,status"
        : "device,impl,batch,heads,seq,d,dtype,causal,fwd_ms,bwd_ms,fwd+bwd_ms,fwd_TFLOP/s,bwd_TFLOP/s,fwd+bwd_TFLOP/s,mem_before_bwd_MiB,peak_MiB,speedup,status",
        o.format);
    bool both = !strcmp(o.impl, "both");
    for (int t = 0; t < o.dtype_list.n; t++)
        for (int c = 0; c < o.causal_list.n; c++)
            for (int di = 0; di < o.d_list.n; di++)
                for (int si = 0; si < o.seq_list.n; si++) {
                    tsys_dtype dt = TSYS_F32; int d = 0, seq = 0;
                    du_parse_dtype(o.dtype_list.item[t], &dt); du_parse_int(o.d_list.item[di], 1, 1 << 16, &d); du_parse_int(o.seq_list.item[si], 1, 1 << 24, &seq);
                    bool causal = !strcmp(o.causal_list.item[c], "1");
                    attn_result naive = {false, 0, 0, 0};
                    if (both || !strcmp(o.impl, "naive")) {
                        naive = run_config(ctx, dev, &o, false, dt, d, seq, causal, NULL, &tab);
                        du_table_emit(&tab);
                    }
                    if (both || !strcmp(o.impl, "flash")) {
                        run_config(ctx, dev, &o, true, dt, d, seq, causal, both ? &naive : NULL, &tab);
                        du_table_emit(&tab);
                    }
                }
    rc = du_table_exit_code(&tab, "attn", o.oom_ok);
    du_table_free(&tab);
    opts_free(&o);
    tsys_ctx_free(ctx);   // also shuts the CUDA backend down
    return rc;
}

int main(int argc, char **argv) { return du_exit("attn", driver_main(argc, argv)); }
