// e2e - the end-to-end benchmark of the cs336 Transformer LM: forward, forward+backward or a full
// training step, timed after warmup, one row per configuration.
//
//   e2e --model small --context-length 256 --mode forward-backward
//   e2e --model small,medium --dtype fp32,bf16 --mode train --format csv
//
// Comma-separated lists in --model, --context-length, --mode and --dtype sweep every combination.
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
#include <ctype.h>
#include <sys/stat.h>

typedef struct e2e_opts {
    const char *device, *format, *load;
    du_list models, contexts, modes, dtypes, attns, compiles, overlaps, lowps, ckpts;
    int batch, warmup, steps;
    uint64_t seed;
    size_t mem_limit;       // bytes; 0 = the default budget
    tsys_model_desc dims;   // explicit dims (--d-model ...) override the preset's
    bool sgemm, tf32, oom_ok, dry_run, nvtx, plan;
    const char *profile;    // a folder: one profiled step per configuration (tables + Chrome trace)
    FILE *profile_log;      // where each profiled configuration's tables and trace went, printed after the results
    double cpu_gflops;      // measured CBLAS sgemm GFLOP/s on the CPU (0: not measured)
    double peak[3];         // measured GEMM TFLOP/s on the GPU, by autocast dtype (fp32, bf16, fp16)
} e2e_opts;

static void usage(FILE *f) {
    fprintf(f,
        "usage: e2e [flags]\n"
        "  --device cpu|cuda          where to run (default: cuda when a GPU is present, else cpu)\n"
        "  --model LIST               presets (%s), 'custom' with the dims below, or 'from-file': the dims\n"
        "                             of the --load checkpoint (default small)\n"
        "  --d-model N --d-ff N --num-layers N --num-heads N --vocab-size N   explicit dims\n"
        "  --context-length LIST      sequence lengths (default 256)\n"
        "  --batch-size N             (default 4)\n"
        "  --warmup N                 untimed steps first (default 5)\n"
        "  --steps N                  timed steps (default 10)\n"
        "  --mode LIST                forward | forward-backward | train (default forward-backward)\n"
        "  --dtype LIST               fp32 | bf16 | fp16 autocast (default fp32)\n"
        "  --attn LIST                naive | flash | auto (default auto: flash on cuda under bf16/fp16 autocast,\n"
        "                             naive otherwise: the fp32 flash kernel has no tensor cores and loses to naive)\n"
        "  --opt-in-backward LIST     no | yes | free: yes runs each layer's AdamW update on the side stream as soon as\n"
        "                             its gradients are final, overlapped with the rest of backward; free runs it on\n"
        "                             the compute stream and gives the layer's gradients back after it (the peak holds\n"
        "                             one layer's gradients, not all) (train mode; not with fp16, whose loss scaler\n"
        "                             needs every gradient first; default no)\n"
        "  --lowp-copies LIST         no | yes: yes has AdamW write each weight's bf16/fp16 copy in its update kernel\n"
        "                             (tsys_optim_keep_lowp) so autocast casts no weight each step; 2 bytes a\n"
        "                             parameter more, bitwise the same training (train mode under bf16/fp16; default no)\n"
        "  --compile LIST             no | yes: yes captures the whole step as a CUDA graph after warmup\n"
        "                             and replays it (cuda only; default no)\n"
        "  --checkpoint LIST          activation checkpointing: none | blocks:K | sqrt | nested[:K] | selective |\n"
        "                             blocks:K+selective, sqrt+selective, nested[:K]+selective | blocks:K+keep-attn,\n"
        "                             sqrt+keep-attn, nested[:K]+keep-attn (flash attention keeps its output: no attention\n"
        "                             forward in the recompute) | auto:BYTES (the planner\n"
        "                             picks the cheapest policy whose predicted peak fits BYTES, e.g. auto:60GiB, and\n"
        "                             prints its plan on stderr) (default none)\n"
        "  --plan                     print each configuration's checkpointing accounting (bytes a block keeps with\n"
        "                             and without checkpointing, predicted peak, recomputed FLOPs) instead of measuring\n"
        "  --format md|csv|jsonl      output rows, each printed as soon as it is measured (default md)\n"
        "  --load FILE.safetensors    weights to start from: tsys's or PyTorch's state names (_orig_mod. and\n"
        "                             module. prefixes dropped), or a Hugging Face Llama checkpoint (a directory\n"
        "                             with model.safetensors and config.json, or the file)\n"
        "  --seed N                   weights and batch seed (default 0)\n"
        DU_MEM_LIMIT_HELP
        "  --oom-ok                   out-of-memory rows do not make the exit status 1 (sweeps that expect them)\n"
        "  --no-sgemm                 skip the reference GEMM measurement (CBLAS sgemm on cpu, GEMM peaks on cuda);\n"
        "                             the MFU column is then empty\n"
        "  --tf32                     fp32 GEMMs on TF32 tensor cores (cuda; default off)\n"
        "  --dry-run                  check the flags, print the configuration, measure nothing\n"
        "  --nvtx                     NVTX ranges for nsys (cuda): warmup, forward, backward, optimizer, each layer,\n"
        "                             each op, the parts of attention\n"
        "  --profile DIR              after the timed steps, profile one more (eager) step of each configuration:\n"
        "                             DIR/<config>.md holds the op and kernel tables, DIR/<config>.json a Chrome\n"
        "                             trace (chrome://tracing, ui.perfetto.dev: ops with input shapes, flows to\n"
        "                             their kernels), DIR/summary.csv a line each; the paths print after the results\n"
        "  --help\n"
        "Lists are comma-separated (at most %d values) and every combination is measured.\n"
        "Columns that do not apply to a mode read '-' (bwd in forward mode, opt without an optimizer step,\n"
        "the phases of a compiled step).\n"
        DU_EXIT_HELP, tsys_model_preset_names(), DU_LIST_MAX);
}

static bool ok_mode(const char *s) { du_mode m; return du_parse_mode(s, &m); }
static bool ok_dtype(const char *s) { tsys_dtype d; return du_parse_dtype(s, &d); }
static bool ok_context(const char *s) { int t; return du_parse_int(s, 1, 1 << 20, &t); }
static bool ok_attn(const char *s) { return !strcmp(s, "naive") || !strcmp(s, "flash") || !strcmp(s, "auto"); }
static bool ok_compile(const char *s) { return !strcmp(s, "no") || !strcmp(s, "yes"); }
static bool ok_in_backward(const char *s) { return ok_compile(s) || !strcmp(s, "free"); }
// the syntax only: whether K fits a model's layers is checked per configuration (an error row)
static bool ok_ckpt(const char *s) { tsys_checkpoint_policy p; return tsys_checkpoint_policy_parse(s, 1 << 20, &p, NULL, 0) == TSYS_OK; }
static bool ok_model(const char *s) {
    tsys_model_desc d;
    return !strcmp(s, "custom") || !strcmp(s, "from-file") || tsys_model_desc_preset(s, &d, NULL, 0) == TSYS_OK;
}

static void opts_free(e2e_opts *o) {
    du_list_free(&o->models); du_list_free(&o->contexts); du_list_free(&o->modes);
    du_list_free(&o->dtypes); du_list_free(&o->attns); du_list_free(&o->compiles); du_list_free(&o->overlaps); du_list_free(&o->lowps); du_list_free(&o->ckpts);
}

// Parses and checks every flag and list; returns 0 (o then owns the lists: opts_free), DU_HELP,
// or DU_EXIT_USAGE after a message naming the flag (nothing to free). Never exits.
static int parse_args(int argc, char **argv, e2e_opts *o) {
    memset(o, 0, sizeof(*o));
    o->device = du_has_cuda() ? "cuda" : "cpu";
    const char *models = "small", *contexts = "256", *modes = "forward-backward", *dtypes = "fp32", *attn = "auto", *compile = "no", *overlap = "no", *lowp = "no", *ckpt = "none";
    o->format = "md";
    o->batch = 4; o->warmup = 5; o->steps = 10; o->sgemm = true;
    static const char *const valued[] = {"--device", "--model", "--context-length", "--mode", "--dtype", "--attn", "--compile", "--opt-in-backward", "--lowp-copies", "--format",
                                         "--load", "--batch-size", "--warmup", "--steps", "--seed", "--d-model", "--d-ff", "--num-layers",
                                         "--num-heads", "--vocab-size", "--mem-limit", "--profile", "--checkpoint"};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) return DU_HELP;
        if (!strcmp(a, "--no-sgemm")) { o->sgemm = false; continue; }
        if (!strcmp(a, "--tf32")) { o->tf32 = true; continue; }
        if (!strcmp(a, "--oom-ok")) { o->oom_ok = true; continue; }
        if (!strcmp(a, "--dry-run")) { o->dry_run = true; continue; }
        if (!strcmp(a, "--nvtx")) { o->nvtx = true; continue; }
        if (!strcmp(a, "--plan")) { o->plan = true; continue; }
        bool known = false;
        for (size_t j = 0; j < sizeof(valued) / sizeof(valued[0]); j++) known = known || !strcmp(a, valued[j]);
        if (!known) { fprintf(stderr, "e2e: unknown flag '%s'\n", a); usage(stderr); return DU_EXIT_USAGE; }
        if (i + 1 >= argc) { fprintf(stderr, "e2e: flag %s needs a value\n", a); return DU_EXIT_USAGE; }
        const char *v = argv[++i];
        bool ok = true;
        if (!strcmp(a, "--device")) o->device = v;
        else if (!strcmp(a, "--model")) models = v;
        else if (!strcmp(a, "--context-length")) contexts = v;
        else if (!strcmp(a, "--mode")) modes = v;
        else if (!strcmp(a, "--dtype")) dtypes = v;
        else if (!strcmp(a, "--attn")) attn = v;
        else if (!strcmp(a, "--compile")) compile = v;
        else if (!strcmp(a, "--opt-in-backward")) overlap = v;
        else if (!strcmp(a, "--lowp-copies")) lowp = v;
        else if (!strcmp(a, "--checkpoint")) ckpt = v;
        else if (!strcmp(a, "--format")) o->format = v;
        else if (!strcmp(a, "--load")) o->load = v;
        else if (!strcmp(a, "--mem-limit")) { if (!du_parse_gib("e2e", a, v, &o->mem_limit)) return DU_EXIT_USAGE; }
        else if (!strcmp(a, "--batch-size")) ok = du_parse_int(v, 1, 1 << 20, &o->batch);
        else if (!strcmp(a, "--warmup")) ok = du_parse_int(v, 0, 1 << 20, &o->warmup);
        else if (!strcmp(a, "--profile")) { o->profile = v; ok = *v != 0; }
        else if (!strcmp(a, "--steps")) ok = du_parse_int(v, 1, 1 << 20, &o->steps);
        else if (!strcmp(a, "--seed")) { int s; ok = du_parse_int(v, 0, 1 << 30, &s); o->seed = (uint64_t)s; }
        else if (!strcmp(a, "--d-model")) ok = du_parse_int(v, 1, 1 << 20, &o->dims.d_model);
        else if (!strcmp(a, "--d-ff")) ok = du_parse_int(v, 1, 1 << 22, &o->dims.d_ff);
        else if (!strcmp(a, "--num-layers")) ok = du_parse_int(v, 1, 1 << 12, &o->dims.num_layers);
        else if (!strcmp(a, "--num-heads")) ok = du_parse_int(v, 1, 1 << 12, &o->dims.num_heads);
        else if (!strcmp(a, "--vocab-size")) ok = du_parse_int(v, 1, 1 << 24, &o->dims.vocab_size);
        if (!ok) { fprintf(stderr, "e2e: bad value '%s' for %s\n", v, a); usage(stderr); return DU_EXIT_USAGE; }
    }
    if (strcmp(o->device, "cpu") && strcmp(o->device, "cuda")) { fprintf(stderr, "e2e: --device must be cpu or cuda, not '%s'\n", o->device); return DU_EXIT_USAGE; }
    if (!du_format_ok(o->format)) { fprintf(stderr, "e2e: --format must be md, csv or jsonl, not '%s'\n", o->format); return DU_EXIT_USAGE; }
#ifndef TSYS_WITH_CUDA
    if (!strcmp(o->device, "cuda")) { fprintf(stderr, "e2e: this binary was built without CUDA; build it with 'make cuda'\n"); return DU_EXIT_USAGE; }
#endif
    char rule[256];
    snprintf(rule, sizeof(rule), "a preset (%s), custom or from-file", tsys_model_preset_names());
    if (!du_split_check(&o->models, "e2e", "--model", models, ok_model, rule)
        || !du_split_check(&o->contexts, "e2e", "--context-length", contexts, ok_context, "an integer from 1 to 1048576")
        || !du_split_check(&o->modes, "e2e", "--mode", modes, ok_mode, "forward, forward-backward or train")
        || !du_split_check(&o->dtypes, "e2e", "--dtype", dtypes, ok_dtype, "fp32, bf16 or fp16")
        || !du_split_check(&o->attns, "e2e", "--attn", attn, ok_attn, "naive, flash or auto")
        || !du_split_check(&o->compiles, "e2e", "--compile", compile, ok_compile, "no or yes")
        || !du_split_check(&o->overlaps, "e2e", "--opt-in-backward", overlap, ok_in_backward, "no, yes or free")
        || !du_split_check(&o->lowps, "e2e", "--lowp-copies", lowp, ok_compile, "no or yes")
        || !du_split_check(&o->ckpts, "e2e", "--checkpoint", ckpt, ok_ckpt,
                           "none, blocks:K, sqrt, nested[:K], selective, P+selective, P+keep-attn or auto:BYTES (K a positive integer, BYTES such as 60GiB)")) {
        opts_free(o);
        return DU_EXIT_USAGE;
    }
    for (int i = 0; i < o->models.n; i++) {
        if (strcmp(o->models.item[i], "from-file")) continue;
        const tsys_model_desc *x = &o->dims;
        const char *why = !o->load ? "needs --load FILE (the checkpoint whose dims it takes)"
                        : x->d_model || x->d_ff || x->num_layers || x->num_heads || x->vocab_size ? "takes its dims from the file: drop --d-model, --d-ff, --num-layers, --num-heads and --vocab-size" : NULL;
        if (why) { fprintf(stderr, "e2e: --model from-file %s\n", why); opts_free(o); return DU_EXIT_USAGE; }
    }
    return 0;
}


// Everything one configuration needs, built once, released by bench_free.
typedef struct bench {
    du_lm lm;         // the model, its optimizer, the batch, the step
    bool capturing;   // inside CUDA graph capture: no host synchronization allowed
    int64_t saved;    // bytes the forward kept for backward (the tracker's activations after it)
    tsys_event ev[4]; // the phase boundaries of a step: start, forward done, backward done, optimizer done
} bench;

// Marks a phase boundary on the compute stream (nothing while capturing: a graph is timed whole).
// At the end of forward it also takes the bytes the forward kept (the batch is the caller's: the
// embedding and the loss keep it too).
static void bench_mark(void *user, int i) {
    bench *b = (bench *)user;
    du_lm *lm = &b->lm;
    if (i == 1 && lm->mode != DU_FORWARD)
        b->saved = tsys_mem_stats_get(lm->ctx, lm->dev).category_bytes[TSYS_MEM_ACTIVATIONS] - (int64_t)(tsys_tensor_bytes(lm->ids) + tsys_tensor_bytes(lm->targets));
    if (!b->capturing) tsys_event_record(lm->ctx, lm->dev, TSYS_STREAM_COMPUTE, &b->ev[i]);
}

static void bench_free(bench *b) {
    for (int i = 0; i < 4; i++) tsys_event_release(b->lm.ctx, &b->ev[i]);
    du_lm_free(&b->lm);
}

// One step (du_lm_step); adds the phase times (ms, from backend events: cudaEvents on the GPU, the
// host clock on the CPU) to t[0..2]. The host waits only at the end of the step.
static tsys_status bench_step(bench *b, double *t) {
    int last;
    tsys_status st = du_lm_step(&b->lm, &last);
    if (!b->capturing && st == TSYS_OK)
        for (int i = 0; i < last; i++) t[i] += tsys_event_elapsed_ms(b->lm.ctx, &b->ev[i], &b->ev[i + 1]);
    return tsys_ctx_status(b->lm.ctx);
}

// Times `steps` replays of the step captured as a CUDA graph; per-step totals go to tot[].
static tsys_status bench_compiled(bench *b, int steps, double *tot) {
#ifdef TSYS_WITH_CUDA
    double t[3] = {0, 0, 0};
    tsys_cuda_graph *g = NULL;
    tsys_status st = tsys_cuda_graph_begin(b->lm.ctx);
    if (st == TSYS_OK) {
        b->capturing = true;
        tsys_status step_st = bench_step(b, t);
        b->capturing = false;
        st = tsys_cuda_graph_end(b->lm.ctx, &g);
        if (step_st != TSYS_OK) st = step_st;
    }
    for (int i = 0; st == TSYS_OK && i < steps; i++) {
        bench_mark(b, 0);
        st = tsys_cuda_graph_replay(b->lm.ctx, g);
        bench_mark(b, 3);
        tot[i] = tsys_event_elapsed_ms(b->lm.ctx, &b->ev[0], &b->ev[3]);
        if (st == TSYS_OK) st = tsys_ctx_status(b->lm.ctx);
    }
    tsys_cuda_graph_free(g);
    return st;
#else
    (void)b; (void)steps; (void)tot;
    return tsys_ctx_set_error(b->lm.ctx, TSYS_ERR_UNSUPPORTED, "--compile needs the CUDA build");
#endif
}

// One line per profiled configuration in DIR/summary.csv (the header when the file is new), the
// numbers the report's nsys_profile questions ask for: the kernel that takes the most time in forward
// and in the whole step, the matmuls' share, the largest non-matmul kernel, and attention's softmax
// against its two matmuls (naive attention's regions).
static tsys_status profile_summary(tsys_ctx *ctx, const tsys_profiler *p, const char *dir, const char *config, const double *t) {
    char path[600];
    snprintf(path, sizeof(path), "%s/summary.csv", dir);
    tsys_atomic_file af;   // the lines so far and this one, put in place whole
    tsys_status st = tsys_atomic_file_open(ctx, "--profile", path, &af);
    if (st != TSYS_OK) return st;
    FILE *f = af.f, *old = fopen(path, "r");
    if (old) {   // the lines of earlier runs first
        char buf[8192];
        size_t n;
        while ((n = fread(buf, 1, sizeof(buf), old)) > 0) fwrite(buf, 1, n, f);
        bool bad = ferror(old) != 0;
        fclose(old);
        if (bad) { tsys_atomic_file_abort(&af); return tsys_ctx_set_error(ctx, TSYS_ERR_IO, "--profile: cannot read '%s' to add a line", path); }
    }
    if (ftell(f) == 0)
        fprintf(f, "config,step_ms,fwd_ms,bwd_ms,opt_ms,kernel_ms,fwd_kernel_ms,fwd_top_kernel,fwd_top_ms,fwd_top_calls,step_top_kernel,step_top_ms,"
                   "step_top_calls,fwd_matmul_pct,step_matmul_pct,fwd_top_other,fwd_top_other_ms,softmax_ms,attn_matmul_ms\n");
    double all = tsys_profiler_kernel_ms(p, NULL), fwd = tsys_profiler_kernel_ms(p, "forward"), fwd_top = 0, step_top = 0, other = 0;
    int fwd_calls = 0, step_calls = 0;
    const char *fk = tsys_profiler_top_kernel(p, "forward", -1, &fwd_top, &fwd_calls), *sk = tsys_profiler_top_kernel(p, NULL, -1, &step_top, &step_calls);
    const char *ok = tsys_profiler_top_kernel(p, "forward", 0, &other, NULL);
    fprintf(f, "%s,%.3f,%.3f,%.3f,%.3f,%.3f,%.3f,%s,%.3f,%d,%s,%.3f,%d,%.1f,%.1f,%s,%.3f,%.3f,%.3f\n", config, t[0] + t[1] + t[2], t[0], t[1], t[2], all, fwd,
            fk ? fk : "-", fwd_top, fwd_calls, sk ? sk : "-", step_top, step_calls, fwd > 0 ? 100.0 * tsys_profiler_matmul_ms(p, "forward") / fwd : 0.0,
            all > 0 ? 100.0 * tsys_profiler_matmul_ms(p, NULL) / all : 0.0, ok ? ok : "-", other, tsys_profiler_span_ms(p, "computing softmax"),
            tsys_profiler_span_ms(p, "computing attention scores") + tsys_profiler_span_ms(p, "final matmul"));
    return tsys_atomic_file_commit(ctx, &af);   // a failed write of the copy or the line fails here
}

// One more step under the profiler; its tables and Chrome trace go to DIR/<configuration>.{md,json}.
static tsys_status bench_profile(bench *b, const char *dir, FILE *log, const du_row *row) {
    char base[512], path[600], ckpt[64] = "";
    if (strcmp(du_row_get(row, "ckpt"), "none")) {   // "_ckpt-blocks-1-selective" (a file name's characters)
        snprintf(ckpt, sizeof(ckpt), "_ckpt-%s", du_row_get(row, "ckpt"));
        for (char *c = ckpt + 6; *c; c++) if (!isalnum((unsigned char)*c)) *c = '-';
    }
    snprintf(base, sizeof(base), "%s/%s_%s_T%s_%s_%s_%s%s%s%s", dir, du_row_get(row, "device"), du_row_get(row, "model"), du_row_get(row, "context"),
             du_row_get(row, "mode"), du_row_get(row, "dtype"), du_row_get(row, "attn"), strcmp(du_row_get(row, "compiled"), "yes") ? "" : "_compiled",
             !strcmp(du_row_get(row, "opt_in_bwd"), "yes") ? "_opt-in-bwd" : !strcmp(du_row_get(row, "opt_in_bwd"), "free") ? "_opt-in-bwd-free" : "", ckpt);
    tsys_profiler *p = tsys_profiler_begin(b->lm.ctx);
    double t[3] = {0, 0, 0};
    tsys_status st = p ? bench_step(b, t) : tsys_ctx_status(b->lm.ctx);
    if (p && tsys_profiler_end(p) != TSYS_OK && st == TSYS_OK) st = tsys_ctx_status(b->lm.ctx);
    // each file replaced whole (tsys_atomic_file): never half a table, never written through a symlink
    snprintf(path, sizeof(path), "%s.json", base);
    if (st == TSYS_OK && tsys_profiler_write_trace(p, path) != TSYS_OK) {
        char why[600];
        snprintf(why, sizeof(why), "%s", tsys_ctx_last_error(b->lm.ctx));
        tsys_ctx_clear_error(b->lm.ctx);
        st = tsys_ctx_set_error(b->lm.ctx, TSYS_ERR_IO, "--profile: write to '%s' failed (%s)", path, why);
    }
    snprintf(path, sizeof(path), "%s.md", base);
    tsys_atomic_file af;
    if (st == TSYS_OK) st = tsys_atomic_file_open(b->lm.ctx, "--profile", path, &af);
    if (st == TSYS_OK) {
        FILE *f = af.f;
        fprintf(f, "### %s\n\nprofiled step: %.2f ms (forward %.2f, backward %.2f, optimizer %.2f); kernel time by phase: forward %.2f, backward %.2f, optimizer %.2f ms\n\n",
                base + strlen(dir) + 1, t[0] + t[1] + t[2], t[0], t[1], t[2], tsys_profiler_kernel_ms(p, "forward"), tsys_profiler_kernel_ms(p, "backward"),
                tsys_profiler_kernel_ms(p, "optimizer"));
        tsys_profiler_print_ops(p, f, 40);
        fprintf(f, "\n");
        tsys_profiler_print_kernels(p, f, 40);
        fprintf(f, "\n");
        st = tsys_atomic_file_commit(b->lm.ctx, &af);
    }
    if (st == TSYS_OK) {
        fprintf(log, "profile of %s: %s.md, %s.json\n", base + strlen(dir) + 1, base, base);
        st = profile_summary(b->lm.ctx, p, dir, base + strlen(dir) + 1, t);
    }
    tsys_profiler_free(p);
    return st;
}

static void row_header(du_row *row, tsys_device dev, const e2e_opts *o, const char *model_name, int T, du_mode mode, tsys_dtype dt, bool compiled, const char *overlap, bool lowp,
                       const char *attn, const char *ckpt) {
    du_row_set(row, "device", "%s", dev == TSYS_CPU ? "cpu" : "cuda");
    du_row_set(row, "model", "%s", model_name);
    du_row_set(row, "context", "%d", T);
    du_row_set(row, "batch", "%d", o->batch);
    du_row_set(row, "mode", "%s", du_mode_names[mode]);
    du_row_set(row, "dtype", "%s", dt == TSYS_F32 ? "fp32" : dt == TSYS_BF16 ? "bf16" : "fp16");
    du_row_set(row, "attn", "%s", attn);
    du_row_set(row, "compiled", "%s", compiled ? "yes" : "no");
    du_row_set(row, "opt_in_bwd", "%s", overlap);
    du_row_set(row, "lowp_copies", "%s", lowp ? "yes" : "no");
    du_row_set(row, "ckpt", "%s", ckpt);
    du_row_set(row, "warmup", "%d", o->warmup);
}

// The model shape of a configuration: a preset (explicit dims override it), 'custom', or 'from-file'
// (the --load checkpoint's dims; the context is the configuration's, as RoPE has no length limit).
static bool config_desc(const e2e_opts *o, const char *model_name, int T, const char *attn, tsys_model_desc *d, char *err, size_t len) {
    if (!strcmp(model_name, "from-file")) {
        if (tsys_model_desc_from_file(o->load, d, err, len) != TSYS_OK) return false;
        d->context_length = T;
        d->attn = attn;
        return tsys_model_desc_validate(d, err, len) == TSYS_OK && du_model_sizes_ok(d, o->batch, T, err, len);
    }
    return du_model_desc(&o->dims, model_name, T, attn, d, err, len) && du_model_sizes_ok(d, o->batch, T, err, len);
}

// The checkpointing plan of a configuration; auto:BYTES is resolved here with what the step holds
// (AdamW state only in train mode) and its plan printed on stderr. d->checkpoint becomes the policy run.
// extra: TSYS_PLAN_KEPT_COPIES / TSYS_PLAN_FREE_GRADS when the step runs with them.
static bool config_plan(const e2e_opts *o, tsys_model_desc *d, const char *ckpt, int T, du_mode mode, tsys_dtype dt, unsigned extra, tsys_checkpoint_plan *plan,
                        char *name, size_t name_len, char *err, size_t len, bool quiet) {
    d->checkpoint = ckpt;
    unsigned flags = mode == DU_TRAIN ? TSYS_PLAN_OPTIMIZER | extra : 0u;
    if (tsys_checkpoint_plan_make_ex(d, ckpt, o->batch, T, dt, flags, plan, err, len) != TSYS_OK) return false;
    snprintf(name, name_len, "%s%s", plan->name, strncmp(ckpt, "auto:", 5) ? "" : " (auto)");
    if (strncmp(ckpt, "auto:", 5)) return true;
    d->checkpoint = plan->name;
    if (quiet) return true;
    double tflops = o->peak[dt == TSYS_F32 ? 0 : dt == TSYS_BF16 ? 1 : 2], gbps = o->peak[0] > 0 ? 2000.0 : 10.0;   // GPU HBM / CPU DRAM, nominal
    if (!(tflops > 0)) tflops = o->cpu_gflops > 0 ? o->cpu_gflops / 1e3 : 0;
    tsys_checkpoint_plan_print(plan, stderr, tflops, gbps);
    return true;
}

// --plan: the accounting of one configuration, no model built.
static void plan_config(const e2e_opts *o, const char *model_name, int T, du_mode mode, tsys_dtype dt, const char *attn, const char *ckpt, du_table *tab) {
    char err[256] = "", name[64] = "";
    tsys_model_desc d;
    tsys_checkpoint_plan p;
    du_row *row = du_table_row(tab);
    du_row_set(row, "model", "%s", model_name); du_row_set(row, "context", "%d", T); du_row_set(row, "batch", "%d", o->batch);
    du_row_set(row, "mode", "%s", du_mode_names[mode]);
    du_row_set(row, "dtype", "%s", dt == TSYS_F32 ? "fp32" : dt == TSYS_BF16 ? "bf16" : "fp16"); du_row_set(row, "attn", "%s", attn);
    du_row_set(row, "ckpt", "%s", ckpt);
    if (!config_desc(o, model_name, T, attn, &d, err, sizeof(err)) || !config_plan(o, &d, ckpt, T, mode, dt, 0u, &p, name, sizeof(name), err, sizeof(err), true)) {
        du_row_set(row, "status", "error: %s", err);
        return;
    }
    const double MiB = 1048576.0;
    du_row_set(row, "ckpt", "%s", name);
    du_row_set(row, "block_MiB", "%.2f", p.block_bytes / MiB);
    du_row_set(row, "kept_block_MiB", "%.2f", p.kept_block_bytes / MiB);
    du_row_set(row, "kept_blocks_MiB", "%.2f", p.kept_block_bytes * d.num_layers / MiB);
    du_row_set(row, "kept_MiB", "%.1f", p.kept_bytes / MiB);
    du_row_set(row, "pred_peak_MiB", "%.1f", p.peak_bytes / MiB);
    du_row_set(row, "recompute", "+%.1f%%", p.step_flops > 0 ? 100.0 * p.recompute_flops / p.step_flops : 0.0);
    du_row_set(row, "fits", "%s", p.budget > 0 ? (p.fits ? "yes" : "no: least peak") : "-");
    du_row_set(row, "status", "ok");
}

static void run_config(tsys_ctx *ctx, tsys_device dev, const e2e_opts *o, const char *model_name, int T, du_mode mode, tsys_dtype dt, bool compiled, const char *in_backward,
                       bool lowp, const char *attn_flag, const char *ckpt, du_table *tab) {
    char err[256] = "", ckpt_name[64] = "";
    tsys_model_desc d;
    tsys_checkpoint_plan plan;
    du_row *row = du_table_row(tab);
    const char *attn = strcmp(attn_flag, "auto") ? attn_flag : (dev == TSYS_CUDA && dt != TSYS_F32) ? "flash" : "naive";
    row_header(row, dev, o, model_name, T, mode, dt, compiled, in_backward, lowp, attn, ckpt);
    bool overlap = strcmp(in_backward, "no") != 0;
    if (!config_desc(o, model_name, T, attn, &d, err, sizeof(err))) { du_row_set(row, "status", "error: %s", err); return; }
    unsigned step_flags = (lowp && dt != TSYS_F32 ? TSYS_PLAN_KEPT_COPIES : 0u) | (!strcmp(in_backward, "free") ? TSYS_PLAN_FREE_GRADS : 0u);
    if (!config_plan(o, &d, ckpt, T, mode, dt, step_flags, &plan, ckpt_name, sizeof(ckpt_name), err, sizeof(err), false)) { du_row_set(row, "status", "error: %s", err); return; }
    du_row_set(row, "ckpt", "%s", ckpt_name);
    if (compiled && dev != TSYS_CUDA) { du_row_set(row, "status", "skipped: --compile needs --device cuda"); return; }
    if (compiled && dt == TSYS_F16 && mode == DU_TRAIN) { du_row_set(row, "status", "skipped: fp16 loss scaling reads the overflow flag on the host"); return; }
    if (overlap && mode != DU_TRAIN) { du_row_set(row, "status", "skipped: --opt-in-backward applies to train mode"); return; }
    if (overlap && dt == TSYS_F16) { du_row_set(row, "status", "skipped: fp16 loss scaling needs every gradient before any update"); return; }
    if (lowp && (mode != DU_TRAIN || dt == TSYS_F32)) { du_row_set(row, "status", "skipped: --lowp-copies applies to train mode under bf16/fp16"); return; }
    bench b;
    memset(&b, 0, sizeof(b));
    b.lm.ctx = ctx; b.lm.dev = dev; b.lm.mode = mode; b.lm.dtype = dt; b.lm.overlap = overlap; b.lm.free_grads = !strcmp(in_backward, "free"); b.lm.lowp_copies = lowp; b.lm.mark = bench_mark; b.lm.mark_user = &b;
    tsys_mem_reset_peak(ctx, dev);
    int n = o->steps, total = (compiled && o->warmup < 1 ? 1 : o->warmup) + (compiled ? 0 : n);   // a graph is captured after at least one eager step
    double *fwd = (double *)calloc((size_t)n, sizeof(double)), *bwd = (double *)calloc((size_t)n, sizeof(double));
    double *opt = (double *)calloc((size_t)n, sizeof(double)), *tot = (double *)calloc((size_t)n, sizeof(double));
    tsys_status st = fwd && bwd && opt && tot ? du_lm_setup(&b.lm, &d, o->batch, T, o->seed, o->load)
                                              : tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "out of host memory for %d step timings", n);
    int warm = total - (compiled ? 0 : n);
    bool in_warmup = warm > 0;
    if (in_warmup) tsys_trace_begin(ctx, "warmup");   // nsys can skip it
    for (int i = 0; st == TSYS_OK && i < total; i++) {   // eager steps: warmup, then (eager) timed
        double t[3] = {0, 0, 0};
        if (i == warm && in_warmup) { tsys_trace_end(ctx); in_warmup = false; }
        st = bench_step(&b, t);
        du_progress("%s T=%d %s: step %d/%d (%.1f ms)", model_name, T, du_row_get(row, "mode"), i + 1, total, t[0] + t[1] + t[2]);
        int j = i - (total - (compiled ? 0 : n));
        if (j >= 0) { fwd[j] = t[0]; bwd[j] = t[1]; opt[j] = t[2]; tot[j] = t[0] + t[1] + t[2]; }
    }
    if (in_warmup) tsys_trace_end(ctx);
    if (st == TSYS_OK && compiled) st = bench_compiled(&b, n, tot);
    if (st == TSYS_OK && o->profile) st = bench_profile(&b, o->profile, o->profile_log, row);
    du_progress_done();
    if (st == TSYS_OK) {
        tsys_stats s = tsys_stats_of(tot, n);
        // phases a mode does not have read '-' (not 0.00): no backward in forward mode, no optimizer
        // step outside train mode (its zero_grad time still counts in total_ms), and a compiled step
        // is one graph replay, timed as a whole
        static const char *const phase_cols[5] = {"fwd_ms", "fwd_std", "bwd_ms", "bwd_std", "opt_ms"};
        for (int i = 0; i < 5; i++) du_row_set(row, phase_cols[i], "-");
        if (!compiled) {
            tsys_stats sf = tsys_stats_of(fwd, n), sb = tsys_stats_of(bwd, n), so = tsys_stats_of(opt, n);
            du_row_set(row, "fwd_ms", "%.2f", sf.mean); du_row_set(row, "fwd_std", "%.2f", sf.std);
            if (mode != DU_FORWARD) { du_row_set(row, "bwd_ms", "%.2f", sb.mean); du_row_set(row, "bwd_std", "%.2f", sb.std); }
            if (mode == DU_TRAIN) du_row_set(row, "opt_ms", "%.2f", so.mean);
        }
        du_row_set(row, "total_ms", "%.2f", s.mean); du_row_set(row, "total_std", "%.2f", s.std);
        double flops = tsys_model_flops(&d, o->batch, T, mode != DU_FORWARD);
        double ms = s.mean;   // over the whole step, as the PyTorch baseline counts it
        du_row_set(row, dev == TSYS_CPU ? "GFLOP/s" : "TFLOP/s", dev == TSYS_CPU ? "%.1f" : "%.1f", flops / ms / (dev == TSYS_CPU ? 1e6 : 1e9));
        double peak = o->peak[dt == TSYS_F32 ? 0 : dt == TSYS_BF16 ? 1 : 2];
        if (dev == TSYS_CUDA && peak > 0) du_row_set(row, "MFU", "%.1f%%", 100.0 * flops / ms / 1e9 / peak);
        if (dev == TSYS_CPU && o->cpu_gflops > 0) du_row_set(row, "MFU", "%.1f%%", 100.0 * flops / ms / 1e6 / o->cpu_gflops);
        if (mode == DU_FORWARD) { du_row_set(row, "saved_MiB", "-"); du_row_set(row, "pred_MiB", "-"); }   // the plan models a step with backward
        else { du_row_set(row, "saved_MiB", "%.0f", (double)b.saved / 1048576.0); du_row_set(row, "pred_MiB", "%.0f", plan.peak_bytes / 1048576.0); }
        du_row_set(row, "peak_MiB", "%.0f", (double)tsys_mem_stats_get(ctx, dev).peak_bytes / 1048576.0);
        du_row_set(row, "status", "ok");
    } else {
        du_row_set(row, "status", "%s: %s", st == TSYS_ERR_OOM ? "OOM" : "error", tsys_ctx_last_error(ctx));
    }
    tsys_tape_clear(ctx);
    bench_free(&b);
    tsys_ctx_clear_error(ctx);
    free(fwd); free(bwd); free(opt); free(tot);
}

#ifdef TSYS_WITH_CUDA
// Rate of an n x n x n product of random dt matrices through the backend's GEMM (the path the
// model's matmuls take): the ceiling that MFU is measured against.
static inline double gemm_peak_tflops(tsys_ctx *ctx, tsys_device dev, tsys_dtype dt, int n) {
    int64_t shape[2] = {n, n};
    tsys_tensor *a = tsys_tensor_new(ctx, dt, dev, 2, shape), *b = tsys_tensor_new(ctx, dt, dev, 2, shape);
    double best = 0;
    if (a && b && tsys_tensor_randn(ctx, a, 1) == TSYS_OK && tsys_tensor_randn(ctx, b, 1) == TSYS_OK) {
        tsys_no_grad_begin(ctx);
        for (int r = 0; r < 8; r++) {
            tsys_sync(ctx, dev);
            double t0 = tsys_time_us();
            tsys_tensor *c = tsys_matmul(ctx, a, b, false);
            tsys_sync(ctx, dev);
            double s = (tsys_time_us() - t0) * 1e-6;
            tsys_tensor_release(c);
            if (r >= 2 && 2.0 * n * (double)n * n / s / 1e12 > best) best = 2.0 * n * (double)n * n / s / 1e12;
        }
        tsys_no_grad_end(ctx);
    }
    tsys_tensor_release(a); tsys_tensor_release(b);
    tsys_ctx_clear_error(ctx);
    return best;
}
#endif

// --plan: one accounting row per (model, context, mode, dtype, attn, policy); nothing is built.
static int plan_all(e2e_opts *o, tsys_device dev, FILE *cfg) {
    if (cfg == stdout) printf("\n");
    du_table tab;
    du_table_init(&tab, "model,context,batch,mode,dtype,attn,ckpt,block_MiB,kept_block_MiB,kept_blocks_MiB,kept_MiB,pred_peak_MiB,recompute,fits,status", o->format);
    for (int a = 0; a < o->models.n; a++)
        for (int c = 0; c < o->contexts.n; c++)
            for (int m = 0; m < o->modes.n; m++)
                for (int t = 0; t < o->dtypes.n; t++)
                    for (int at = 0; at < o->attns.n; at++)
                        for (int cp = 0; cp < o->ckpts.n; cp++) {
                            du_mode mode = DU_FORWARD; tsys_dtype dt = TSYS_F32; int T = 0;
                            du_parse_mode(o->modes.item[m], &mode); du_parse_dtype(o->dtypes.item[t], &dt); du_parse_int(o->contexts.item[c], 1, 1 << 20, &T);
                            const char *attn = strcmp(o->attns.item[at], "auto") ? o->attns.item[at] : (dev == TSYS_CUDA && dt != TSYS_F32) ? "flash" : "naive";
                            plan_config(o, o->models.item[a], T, mode, dt, attn, o->ckpts.item[cp], &tab);
                            du_table_emit(&tab);
                        }
    int rc = du_table_exit_code(&tab, "e2e", false);
    du_table_free(&tab);
    opts_free(o);
    return rc;
}

static int driver_main(int argc, char **argv) {
    e2e_opts o;
    int rc = parse_args(argc, argv, &o);
    if (rc == DU_HELP) { usage(stdout); return DU_EXIT_OK; }
    if (rc) return rc;
    tsys_device dev = strcmp(o.device, "cuda") ? TSYS_CPU : TSYS_CUDA;
    char lim[64];
    // the effective configuration on one line (stdout for md, stderr for the machine formats)
    FILE *cfg = strcmp(o.format, "md") ? stderr : stdout;
    fprintf(cfg, "e2e: device %s; model %s; context %s; batch %d; mode %s; dtype %s; attn %s; compile %s; opt-in-backward %s; lowp-copies %s; checkpoint %s; warmup %d; steps %d; memory limit %s%s%s\n",
            o.device, o.models.src, o.contexts.src, o.batch, o.modes.src, o.dtypes.src, o.attns.src, o.compiles.src, o.overlaps.src, o.lowps.src, o.ckpts.src, o.warmup, o.steps,
            du_mem_limit_str(lim, sizeof(lim), o.mem_limit), o.load ? "; load " : "", o.load ? o.load : "");
    if (o.dry_run) { opts_free(&o); return DU_EXIT_OK; }
    if (o.plan) return plan_all(&o, dev, cfg);
    if (o.profile) {
        if (mkdir(o.profile, 0777) != 0 && errno != EEXIST) { fprintf(stderr, "e2e: --profile: cannot make folder '%s': %s\n", o.profile, strerror(errno)); opts_free(&o); return DU_EXIT_USAGE; }
        o.profile_log = tmpfile();
        if (!o.profile_log) { fprintf(stderr, "e2e: --profile: no temporary file: %s\n", strerror(errno)); opts_free(&o); return DU_EXIT_FAILED; }
    }
    // the budget applies to the device measured; the other keeps its default
    tsys_ctx_desc cd;
    memset(&cd, 0, sizeof(cd));
    if (dev == TSYS_CPU) cd.cpu_memory_limit = o.mem_limit;
    tsys_ctx *ctx = tsys_ctx_new(&cd);
    if (!ctx) { fprintf(stderr, "e2e: out of memory creating the context\n"); opts_free(&o); return DU_EXIT_FAILED; }
#ifdef TSYS_WITH_CUDA
    if (dev == TSYS_CUDA) {
        if (tsys_cuda_init(ctx, 0) != TSYS_OK) { fprintf(stderr, "e2e: %s\n", tsys_ctx_last_error(ctx)); tsys_ctx_free(ctx); opts_free(&o); return DU_EXIT_FAILED; }
        tsys_cuda_set_tf32(ctx, o.tf32);
        if (o.nvtx) tsys_cuda_set_nvtx(ctx, true);
        if (o.mem_limit) tsys_cuda_set_memory_limit(ctx, o.mem_limit);
        if (o.sgemm) {
            o.peak[0] = gemm_peak_tflops(ctx, dev, TSYS_F32, 8192);
            o.peak[1] = gemm_peak_tflops(ctx, dev, TSYS_BF16, 8192);
            o.peak[2] = gemm_peak_tflops(ctx, dev, TSYS_F16, 8192);
            fprintf(cfg, "cuda: %s; measured GEMM peaks (8192^3, random data): %s %.1f, bf16 %.1f, fp16 %.1f TFLOP/s; MFU is measured against them\n",
                    tsys_cuda_device_name(ctx), o.tf32 ? "tf32" : "fp32", o.peak[0], o.peak[1], o.peak[2]);
        }
    }
#endif
    if (dev == TSYS_CPU && o.sgemm) {
        o.cpu_gflops = tsys_cpu_sgemm_gflops(1024, 3);
        fprintf(cfg, "cpu: CBLAS sgemm %.1f GFLOP/s (1024^3, best of 3), %d threads; MFU is measured against it\n", o.cpu_gflops, du_num_threads());
    }
    if (cfg == stdout) printf("\n");   // markdown: a blank line before the table
    fflush(stdout);
    du_table tab;
    du_table_init(&tab, dev == TSYS_CPU ? "device,model,context,batch,mode,dtype,attn,compiled,opt_in_bwd,lowp_copies,ckpt,warmup,fwd_ms,fwd_std,bwd_ms,bwd_std,opt_ms,total_ms,total_std,GFLOP/s,MFU,saved_MiB,pred_MiB,peak_MiB,status"
                                        : "device,model,context,batch,mode,dtype,attn,compiled,opt_in_bwd,lowp_copies,ckpt,warmup,fwd_ms,fwd_std,bwd_ms,bwd_std,opt_ms,total_ms,total_std,TFLOP/s,MFU,saved_MiB,pred_MiB,peak_MiB,status",
                  o.format);
    for (int a = 0; a < o.models.n; a++)
        for (int c = 0; c < o.contexts.n; c++)
            for (int m = 0; m < o.modes.n; m++)
                for (int t = 0; t < o.dtypes.n; t++)
                    for (int k = 0; k < o.compiles.n; k++)
                        for (int ov = 0; ov < o.overlaps.n; ov++)
                            for (int lp = 0; lp < o.lowps.n; lp++)
                            for (int at = 0; at < o.attns.n; at++)
                                for (int cp = 0; cp < o.ckpts.n; cp++) {
                                    du_mode mode = DU_FORWARD; tsys_dtype dt = TSYS_F32; int T = 0;
                                    du_parse_mode(o.modes.item[m], &mode); du_parse_dtype(o.dtypes.item[t], &dt); du_parse_int(o.contexts.item[c], 1, 1 << 20, &T);
                                    run_config(ctx, dev, &o, o.models.item[a], T, mode, dt, !strcmp(o.compiles.item[k], "yes"), o.overlaps.item[ov],
                                               !strcmp(o.lowps.item[lp], "yes"), o.attns.item[at], o.ckpts.item[cp], &tab);
                                du_table_emit(&tab);
                            }
    if (o.profile_log) {   // the paths of the tables and traces, after the results
        rewind(o.profile_log);
        char line[512];
        fprintf(cfg, "\n");
        while (fgets(line, sizeof(line), o.profile_log)) fputs(line, cfg);
        fclose(o.profile_log);
    }
    rc = du_table_exit_code(&tab, "e2e", o.oom_ok);
    du_table_free(&tab);
    opts_free(&o);
    tsys_ctx_free(ctx);   // also shuts the CUDA backend down
    return rc;
}

int main(int argc, char **argv) { return du_exit("e2e", driver_main(argc, argv)); }
