// ddp - data-parallel training of the cs336 Transformer LM: the CS336 naive_ddp_benchmarking,
// minimal_ddp_flat_benchmarking, ddp_overlap_individual_parameters_benchmarking,
// ddp_bucketed_benchmarking and optimizer_state_sharding_accounting measurements, and the S26 fsdp /
// fsdp_accounting ones (--strategy fsdp), one row per configuration, with the accounting prediction
// beside what was measured.
//
//   ddp --nproc 2 --model small --strategy naive,flat,overlap,bucketed,zero1 --bucket-mb 1,10,100,1000
//   mpirun -np 2 ddp --device cuda --model xl --dtype fp32,bf16
//   ddp --account --model xl --nproc 2          (the prediction table only, nothing runs)
//
// Every rank trains on its own batch of --batch-size sequences (gradients averaged, AdamW); only
// rank 0 prints. Times are the slowest rank's, mean (and std) over the timed steps.
#define _POSIX_C_SOURCE 200809L   // setenv
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
#ifndef TSYS_DIST_LINKED_IMPL
#define TSYS_DIST_IMPLEMENTATION
#endif
#include "../tsys_dist.h"
#include "driver_util.h"

typedef struct ddp_opts {
    const char *device, *models, *strategies, *buckets, *dtypes, *contexts, *format, *attn, *checkpoint, *comms;
    int batch, warmup, steps, nproc, seed;
    size_t mem_limit;       // --mem-limit, bytes a rank (0: the host's available memory over its ranks)
    bool account, loss_sum, compute_ref;
    tsys_fsdp_reshard fsdp_reshard;
    tsys_model_desc dims;   // explicit dims (--d-model ...) override the preset's
} ddp_opts;

// FSDP as the flags ask: compute in dt, prefetching, the reshard choice, the group-of-one shortcut.
static tsys_fsdp_desc fsdp_desc(const ddp_opts *o, tsys_dtype dt) {
    tsys_fsdp_desc fd = {dt, false, o->fsdp_reshard, false};
    return fd;
}

static void usage(FILE *f) {
    fprintf(f,
        "usage: ddp [flags]\n"
        "  --device cpu|cuda          where each rank computes (default: cuda when a GPU is present, else cpu)\n"
        "  --model LIST               presets (%s) or 'custom' with the dims below\n"
        "                             (default: xl on cuda, small on cpu)\n"
        "  --d-model N --d-ff N --num-layers N --num-heads N --vocab-size N   explicit dims\n"
        "  --strategy LIST            naive | flat | overlap | bucketed | zero1 | fsdp (default: the first five)\n"
        "                             zero1 = bucketed gradient all-reduce (each --bucket-mb) + ZeRO-1 sharded AdamW;\n"
        "                             fsdp = ZeRO-3\n"
        "                             (tsys_fsdp: sharded weights, gradients and AdamW state; bf16 = its compute_dtype)\n"
        "  --bucket-mb LIST           bucket sizes of 'bucketed' in MB (2^20 bytes; default 1,10,100,1000)\n"
        "  --grad-comm LIST           fp32 | bf16: how DDP's fp32 gradients travel (bf16: tsys_ddp_desc.comm_bf16,\n"
        "                             torch's bf16_compress_hook; half the bytes) (default fp32)\n"
        "  --dtype LIST               fp32 | bf16 autocast (fsdp: bf16 weights and gradients on the wire,\n"
        "                             bf16 compute, fp32 masters) (default fp32)\n"
        "  --batch-size N             sequences per rank (default 4)\n"
        "  --context-length LIST      (default 256)\n"
        "  --attn naive|flash|auto    attention (default auto: flash on cuda under bf16, else naive)\n"
        "  --checkpoint POLICY        activation checkpointing of the model (none, blocks:K, sqrt, nested[:K], selective,\n"
        "                             P+selective; see e2e --help; default none)\n"
        "  --loss mean|sum            cross-entropy's mean over the tokens, or its sum (the S26 leaderboard's) (default mean)\n"
        "  --fsdp-reshard auto|yes|no fsdp: free each unit's gathered weights after its forward and gather them again\n"
        "                             for its backward (yes), or keep them through the backward (no: one all-gather per\n"
        "                             unit and step, ZeRO-2's traffic); auto: yes with several ranks (default auto)\n"
        "  --no-compute-ref           fsdp: skip the same step without sharding (compute_ms; exposed_ms and hidden read '-'),\n"
        "                             for models that do not fit one device unsharded\n"
        "  --warmup N                 untimed steps first (default 5)\n"
        "  --steps N                  timed steps (default 10)\n"
        "  --nproc N                  start N local ranks (built-in launcher); not needed under mpirun/torchrun\n"
        "  --account                  print the accounting prediction (DDP, ZeRO-1/2/3) for --nproc ranks; run nothing\n"
        "  --format md|csv|jsonl      output rows (default md)\n"
        "  --seed N                   weights and batch seed (default 0)\n"
        DU_MEM_LIMIT_HELP
        DU_MEM_LIMIT_RANKS_HELP
        "  --help\n"
        "exit status: 0 every row ok, 1 some row failed (error or OOM), the run could not start or the results\n"
        "             could not be written, 2 bad usage\n"
        "columns: step_ms the slowest rank's step (mean, std over steps); bwd_comm_ms backward + gradient\n"
        "  synchronization; opt_ms the optimizer step (ZeRO-1: its update and broadcasts); comm_ms the step's\n"
        "  gradient all-reduces timed alone (nothing to overlap); comm_frac comm_ms / step_ms; exposed_ms what\n"
        "  the step waited for communication after backward (it includes waiting for a slower rank);\n"
        "  hidden 1 - exposed_ms / comm_ms, clipped to [0, 1]; pred_comm_ms the same all-reduces predicted from\n"
        "  the accounting's bytes and a link model measured at start (max of n alpha and bytes / beta); fsdp: comm_ms its all-gathers, reduce-scatters\n"
        "  and all-reduces alone, exposed_ms step_ms - compute_ms, compute_ms the same local step without\n"
        "  sharding or communication (a plain model on each rank; bf16 under autocast); mem_* the peak\n"
        "  bytes per rank (largest rank) after init, before the first optimizer step, after it; state_MiB live\n"
        "  bytes after a step (parameters, gradients, optimizer state) against pred_state_MiB; pred_peak_MiB\n"
        "  adds the predicted activations; pred_sent_MB bytes each rank sends per step (ring algorithms).\n",
        tsys_model_preset_names());
}

static int parse_args(int argc, char **argv, ddp_opts *o) {
    memset(o, 0, sizeof(*o));
    o->device = du_has_cuda() ? "cuda" : "cpu";
    o->models = NULL; o->strategies = "naive,flat,overlap,bucketed,zero1"; o->buckets = "1,10,100,1000";
    o->dtypes = "fp32"; o->contexts = "256"; o->comms = "fp32"; o->format = "md"; o->attn = "auto";
    o->batch = 4; o->warmup = 5; o->steps = 10; o->nproc = 1; o->checkpoint = "none"; o->compute_ref = true;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) return DU_HELP;
        if (!strcmp(a, "--account")) { o->account = true; continue; }
        if (!strcmp(a, "--no-compute-ref")) { o->compute_ref = false; continue; }
        if (i + 1 >= argc) { fprintf(stderr, "ddp: flag %s needs a value\n", a); usage(stderr); return 2; }
        const char *v = argv[++i];
        bool ok = true;
        if (!strcmp(a, "--device")) o->device = v;
        else if (!strcmp(a, "--model")) o->models = v;
        else if (!strcmp(a, "--strategy")) o->strategies = v;
        else if (!strcmp(a, "--bucket-mb")) o->buckets = v;
        else if (!strcmp(a, "--grad-comm")) o->comms = v;
        else if (!strcmp(a, "--dtype")) o->dtypes = v;
        else if (!strcmp(a, "--context-length")) o->contexts = v;
        else if (!strcmp(a, "--attn")) o->attn = v;
        else if (!strcmp(a, "--checkpoint")) { tsys_checkpoint_policy p; o->checkpoint = v; ok = tsys_checkpoint_policy_parse(v, 1 << 20, &p, NULL, 0) == TSYS_OK && strncmp(v, "auto:", 5); }
        else if (!strcmp(a, "--fsdp-reshard")) {
            ok = !strcmp(v, "auto") || !strcmp(v, "yes") || !strcmp(v, "no");
            o->fsdp_reshard = !strcmp(v, "yes") ? TSYS_FSDP_RESHARD_YES : !strcmp(v, "no") ? TSYS_FSDP_RESHARD_NO : TSYS_FSDP_RESHARD_AUTO;
        }
        else if (!strcmp(a, "--loss")) { ok = !strcmp(v, "mean") || !strcmp(v, "sum"); o->loss_sum = !strcmp(v, "sum"); }
        else if (!strcmp(a, "--format")) o->format = v;
        else if (!strcmp(a, "--mem-limit")) { if (!du_parse_gib("ddp", a, v, &o->mem_limit)) return 2; }
        else if (!strcmp(a, "--batch-size")) ok = du_parse_int(v, 1, 1 << 20, &o->batch);
        else if (!strcmp(a, "--warmup")) ok = du_parse_int(v, 0, 1 << 20, &o->warmup);
        else if (!strcmp(a, "--steps")) ok = du_parse_int(v, 1, 1 << 20, &o->steps);
        else if (!strcmp(a, "--nproc")) ok = du_parse_int(v, 1, 1024, &o->nproc);
        else if (!strcmp(a, "--seed")) ok = du_parse_int(v, 0, 1 << 30, &o->seed);
        else if (!strcmp(a, "--d-model")) ok = du_parse_int(v, 1, 1 << 20, &o->dims.d_model);
        else if (!strcmp(a, "--d-ff")) ok = du_parse_int(v, 1, 1 << 22, &o->dims.d_ff);
        else if (!strcmp(a, "--num-layers")) ok = du_parse_int(v, 1, 1 << 12, &o->dims.num_layers);
        else if (!strcmp(a, "--num-heads")) ok = du_parse_int(v, 1, 1 << 12, &o->dims.num_heads);
        else if (!strcmp(a, "--vocab-size")) ok = du_parse_int(v, 1, 1 << 24, &o->dims.vocab_size);
        else { fprintf(stderr, "ddp: unknown flag '%s'\n", a); usage(stderr); return 2; }
        if (!ok) { fprintf(stderr, "ddp: bad value '%s' for %s\n", v, a); usage(stderr); return 2; }
    }
    if (strcmp(o->device, "cpu") && strcmp(o->device, "cuda")) { fprintf(stderr, "ddp: --device must be cpu or cuda, not '%s'\n", o->device); usage(stderr); return 2; }
    if (!du_format_ok(o->format)) { fprintf(stderr, "ddp: --format must be md, csv or jsonl, not '%s'\n", o->format); usage(stderr); return 2; }
    if (strcmp(o->attn, "naive") && strcmp(o->attn, "flash") && strcmp(o->attn, "auto")) { fprintf(stderr, "ddp: --attn takes naive, flash or auto, not '%s'\n", o->attn); usage(stderr); return 2; }
    if (!o->models) o->models = strcmp(o->device, "cuda") ? "small" : "xl";
#ifndef TSYS_WITH_CUDA
    if (!strcmp(o->device, "cuda")) { fprintf(stderr, "ddp: this binary was built without CUDA; build it with nvcc (make cuda)\n"); return 2; }
#endif
    return 0;
}

typedef enum { S_NAIVE, S_FLAT, S_OVERLAP, S_BUCKETED, S_ZERO1, S_FSDP } strat;
static const char *strat_names[] = {"naive", "flat", "overlap", "bucketed", "zero1", "fsdp"};

static bool parse_strategy(const char *s, strat *out) {
    for (int i = 0; i < 6; i++) if (!strcmp(s, strat_names[i])) { *out = (strat)i; return true; }
    return false;
}
static bool parse_dtype(const char *s, tsys_dtype *d) {
    if (!strcmp(s, "fp32")) *d = TSYS_F32;
    else if (!strcmp(s, "bf16")) *d = TSYS_BF16;
    else return false;
    return true;
}

static bool config_desc(const ddp_opts *o, const char *model_name, int T, const char *attn, tsys_model_desc *d, char *err, size_t len) {
    if (!du_model_desc(&o->dims, model_name, T, attn, d, err, len)) return false;
    d->checkpoint = o->checkpoint;
    tsys_checkpoint_policy p;
    return tsys_checkpoint_policy_parse(o->checkpoint, d->num_layers, &p, err, len) == TSYS_OK;
}

static const double MiB = 1048576.0;

// ---- --account: the prediction table ---------------------------------------------------------------

static int print_account(const ddp_opts *o, du_list *models, du_list *dtypes, du_list *ctxs) {
    du_table tab;
    du_table_init(&tab, "model,params,dtype,context,batch,ranks,scheme,param_MiB,grad_MiB,optim_MiB,act_MiB,total_MiB,sent_MB_per_step", o->format);
    for (int a = 0; a < models->n; a++)
        for (int c = 0; c < ctxs->n; c++)
            for (int t = 0; t < dtypes->n; t++) {
                tsys_dtype dt = TSYS_F32;
                int T = 0;
                parse_dtype(dtypes->item[t], &dt);
                du_parse_int(ctxs->item[c], 1, 1 << 20, &T);
                const char *attn = strcmp(o->attn, "auto") ? o->attn : (!strcmp(o->device, "cuda") && dt != TSYS_F32) ? "flash" : "naive";
                tsys_model_desc d;
                char err[256];
                if (!config_desc(o, models->item[a], T, attn, &d, err, sizeof(err))) { fprintf(stderr, "ddp: %s\n", err); du_table_free(&tab); return 2; }
                for (int s = TSYS_SCHEME_DDP; s <= TSYS_SCHEME_ZERO3 + 1; s++) {   // + 1: FSDP as tsys_fsdp does it
                    bool fs = s > TSYS_SCHEME_ZERO3;
                    const tsys_fsdp_desc fd = fsdp_desc(o, dt);
                    tsys_dist_account acc = fs ? tsys_fsdp_accounting_desc(&d, &fd, o->batch, T, o->nproc) : tsys_dist_accounting(&d, dt, o->batch, T, o->nproc, (tsys_dist_scheme)s);
                    du_row *r = du_table_row(&tab);
                    du_row_set(r, "model", "%s", models->item[a]);
                    du_row_set(r, "params", "%.3g", (double)tsys_model_desc_num_params(&d));
                    du_row_set(r, "dtype", "%s", dtypes->item[t]);
                    du_row_set(r, "context", "%d", T);
                    du_row_set(r, "batch", "%d", o->batch);
                    du_row_set(r, "ranks", "%d", o->nproc);
                    if (fs) du_row_set(r, "scheme", "fsdp (tsys_fsdp)");
                    else du_row_set(r, "scheme", "%s%s", tsys_dist_scheme_name((tsys_dist_scheme)s), s >= TSYS_SCHEME_ZERO2 ? " (paper)" : "");
                    du_row_set(r, "param_MiB", "%.1f", acc.param_bytes / MiB);
                    du_row_set(r, "grad_MiB", "%.1f", acc.grad_bytes / MiB);
                    du_row_set(r, "optim_MiB", "%.1f", acc.optim_bytes / MiB);
                    du_row_set(r, "act_MiB", "%.1f", acc.act_bytes / MiB);
                    du_row_set(r, "total_MiB", "%.1f", acc.total_bytes / MiB);
                    du_row_set(r, "sent_MB_per_step", "%.1f", acc.sent_bytes / 1e6);
                    du_table_emit(&tab);
                }
            }
    du_table_free(&tab);
    return 0;
}

// ---- one configuration -------------------------------------------------------------------------------

typedef struct run {
    tsys_ctx *ctx;
    tsys_dist *d;
    tsys_device dev;
    tsys_model *model;
    tsys_ddp *ddp;
    tsys_optim *opt;
    tsys_zero1 *zero1;
    tsys_fsdp *fsdp;
    tsys_tensor *ids, *targets;
    tsys_dtype dtype;
    float loss_scale;   // 1: cross-entropy's mean; batch x context: its sum (--loss sum)
} run;

static void run_free(run *r) {
    tsys_ddp_free(r->ddp); tsys_zero1_free(r->zero1); tsys_optim_free(r->opt); tsys_fsdp_free(r->fsdp);
    tsys_tensor_release(r->ids); tsys_tensor_release(r->targets);
    tsys_model_free(r->model);
    r->ddp = NULL; r->zero1 = NULL; r->opt = NULL; r->fsdp = NULL; r->ids = r->targets = NULL; r->model = NULL;
}

static double peak_now(run *r) { return (double)tsys_mem_stats_get(r->ctx, r->dev).peak_bytes; }

// One training step; t[0..3] = forward, backward + gradient synchronization, optimizer, whole (ms).
// mem[0..1] (when not NULL) = the peak before and after the optimizer step.
static tsys_status step(run *r, double *t, double *mem) {
    tsys_ctx *ctx = r->ctx;
    double t0 = tsys_time_us();
    if (r->ddp) tsys_ddp_start_step(r->ddp);
    if (r->zero1) tsys_zero1_zero_grad(r->zero1); else tsys_optim_zero_grad(r->opt);
    bool ac = r->dtype != TSYS_F32 && !r->fsdp;   // FSDP computes in its compute_dtype itself
    if (ac) tsys_autocast_begin(ctx, r->dtype);
    tsys_tensor *logits = tsys_model_forward(r->model, r->ids);
    tsys_tensor *loss = tsys_cross_entropy(ctx, logits, r->targets);
    if (r->loss_scale != 1.0f) {   // --loss sum: the mean times the tokens
        tsys_tensor *sum = tsys_scale(ctx, loss, r->loss_scale);
        tsys_tensor_release(loss);
        loss = sum;
    }
    if (ac) tsys_autocast_end(ctx);
    tsys_tensor_release(logits);
    tsys_dist_sync(r->d);   // bounded: a peer that dies mid-step is an error, not a hang
    double t1 = tsys_time_us();
    tsys_backward(ctx, loss);
    tsys_tensor_release(loss);
    if (r->ddp) tsys_ddp_finish(r->ddp);
    if (r->fsdp) tsys_fsdp_finish(r->fsdp);
    tsys_dist_sync(r->d);
    double t2 = tsys_time_us();
    if (mem) mem[0] = peak_now(r);
    if (r->zero1) tsys_zero1_step(r->zero1); else tsys_optim_step(r->opt);
    tsys_dist_sync(r->d);
    double t3 = tsys_time_us();
    if (mem) mem[1] = peak_now(r);
    tsys_tape_clear(ctx);
    t[0] = (t1 - t0) * 1e-3; t[1] = (t2 - t1) * 1e-3; t[2] = (t3 - t2) * 1e-3; t[3] = (t3 - t0) * 1e-3;
    return tsys_ctx_status(ctx);
}

// Did any rank fail? (every rank calls this at the same points, so a failure stops all of them)
static bool any_failed(tsys_dist *d, tsys_status st) {
    double bad = st != TSYS_OK;
    if (tsys_dist_all_reduce_host(d, &bad, 1, TSYS_DIST_MAX) != TSYS_OK) return true;
    return bad != 0;
}

static void max_over_ranks(tsys_dist *d, double *v, int n) { tsys_dist_all_reduce_host(d, v, n, TSYS_DIST_MAX); }

// The link as an alpha-beta model, for the predicted communication time: all-reduces of 64 KiB (20 back to
// back, one wait at the end, as DDP issues its buckets) and of 256 MiB (32 MiB on CPU ranks), each the
// slowest rank's mean of 5 after 2 warm-ups; alpha is the fixed cost of one collective, beta the bytes a
// rank sends per ms (a ring all-reduce sends 2(n-1)/n of the tensor). Zeros (no prediction) in a group of
// one or when the probes fail.
typedef struct link_model { double alpha_ms, beta_bytes_per_ms; } link_model;
// n collectives issued back to back sending `sent` bytes a rank: one's launch and sync overlap another's
// transfer, so the time is bounded below by both n alpha and sent / beta, and lies near the larger
// (2 x H100, xl, bf16: naive's 435 all-reduces 39.9 ms measured, 39.8 predicted; flat 23.3 / 28.0, bucketed
// 100 MB 30.2 / 28.0: beta from one 256 MiB probe moved between 286 and 357 GB/s from call to call).
static double link_time_ms(link_model m, int n, double sent) { return fmax(n * m.alpha_ms, sent / m.beta_bytes_per_ms); }
static double ring_sent(int world, double bytes) { return 2.0 * (world - 1) / world * bytes; }
static link_model calibrate_link(tsys_ctx *ctx, tsys_dist *d, tsys_device dev) {
    link_model m = {0, 0};
    const int world = tsys_dist_size(d);
    if (world < 2) return m;
    const int64_t floats[2] = {16384, dev == TSYS_CUDA ? (int64_t)64 << 20 : (int64_t)8 << 20};
    double t[2];
    tsys_status st = TSYS_OK;
    for (int k = 0; k < 2; k++) {
        tsys_tensor *x = tsys_tensor_new(ctx, TSYS_F32, dev, 1, &floats[k]);
        if (!x || tsys_tensor_fill(ctx, x, 1.0f) != TSYS_OK) st = TSYS_ERR_OOM;
        double sum = 0;
        for (int it = 0; st == TSYS_OK && it < 7; it++) {
            if ((st = tsys_dist_barrier(d)) != TSYS_OK) break;
            const int reps = k == 0 ? 20 : 1;
            double t0 = tsys_time_us();
            for (int r = 0; st == TSYS_OK && r < reps; r++) st = tsys_dist_all_reduce(d, x, TSYS_DIST_SUM);
            if (st == TSYS_OK) st = tsys_dist_sync(d);
            if (it >= 2) sum += (tsys_time_us() - t0) * 1e-3 / reps;
        }
        tsys_tensor_release(x);
        t[k] = sum / 5;
    }
    if (any_failed(d, st)) { tsys_ctx_clear_error(ctx); return m; }
    max_over_ranks(d, t, 2);
    const double s0 = ring_sent(world, 4.0 * floats[0]), s1 = ring_sent(world, 4.0 * floats[1]);
    if (!(t[1] > t[0])) return m;
    m.beta_bytes_per_ms = (s1 - s0) / (t[1] - t[0]);
    m.alpha_ms = fmax(0.0, t[0] - s0 / m.beta_bytes_per_ms);
    return m;
}

// The same local step with no sharding and no communication: a plain model and AdamW on this rank
// (bf16 under autocast), mean ms over the timed steps (NAN when it fails, e.g. out of memory).
static double plain_step_ms(tsys_ctx *ctx, tsys_device dev, const ddp_opts *o, const tsys_model_desc *desc, tsys_dtype dt, tsys_tensor *ids, tsys_tensor *tgt) {
    run r;
    memset(&r, 0, sizeof(r));
    r.ctx = ctx; r.dev = dev; r.dtype = dt; r.loss_scale = o->loss_sum ? (float)((double)o->batch * desc->context_length) : 1.0f;
    r.model = tsys_model_new(ctx, desc, dev, (uint64_t)o->seed + 1);
    r.opt = r.model ? tsys_adamw_new(ctx, tsys_model_params(r.model), tsys_model_num_tensors(r.model), NULL) : NULL;
    r.ids = tsys_tensor_retain(ids); r.targets = tsys_tensor_retain(tgt);
    double sum = 0;
    tsys_status st = r.opt ? TSYS_OK : TSYS_ERR_OOM;
    for (int i = 0; st == TSYS_OK && i < o->warmup + o->steps; i++) {
        double t[4];
        st = step(&r, t, NULL);
        if (i >= o->warmup) sum += t[3];
    }
    tsys_tape_clear(ctx);
    run_free(&r);
    tsys_ctx_clear_error(ctx);
    return st == TSYS_OK ? sum / o->steps : NAN;
}

static void run_config(tsys_ctx *ctx, tsys_dist *d, tsys_device dev, const ddp_opts *o, const char *model_name, int T, strat s, double bucket_mb,
                       bool comm_bf16, tsys_dtype dt, link_model link, du_table *tab) {
    int rank = tsys_dist_rank(d), world = tsys_dist_size(d);
    char err[256] = "";
    const char *attn = strcmp(o->attn, "auto") ? o->attn : (dev == TSYS_CUDA && dt != TSYS_F32) ? "flash" : "naive";
    du_row *row = du_table_row(tab);
    du_row_set(row, "device", "%s", dev == TSYS_CPU ? "cpu" : "cuda");
    du_row_set(row, "model", "%s", model_name);
    du_row_set(row, "ranks", "%d", world);
    du_row_set(row, "strategy", "%s%s", strat_names[s], s != S_FSDP || o->fsdp_reshard == TSYS_FSDP_RESHARD_AUTO ? ""
                                                     : o->fsdp_reshard == TSYS_FSDP_RESHARD_YES ? ":reshard" : ":keep");
    du_row_set(row, "bucket_mb", s == S_BUCKETED || s == S_ZERO1 ? "%g" : "-", bucket_mb);
    du_row_set(row, "grad_comm", "%s", s == S_FSDP ? "-" : comm_bf16 ? "bf16" : "fp32");
    du_row_set(row, "dtype", "%s", dt == TSYS_F32 ? "fp32" : "bf16");
    du_row_set(row, "context", "%d", T);
    du_row_set(row, "batch", "%d", o->batch);
    du_row_set(row, "ckpt", "%s", o->checkpoint);
    du_row_set(row, "loss", "%s", o->loss_sum ? "sum" : "mean");
    tsys_model_desc desc;
    if (!config_desc(o, model_name, T, attn, &desc, err, sizeof(err))) { du_row_set(row, "status", "error: %s", err); return; }
    run r;
    memset(&r, 0, sizeof(r));
    r.ctx = ctx; r.d = d; r.dev = dev; r.dtype = dt; r.loss_scale = o->loss_sum ? (float)((double)o->batch * T) : 1.0f;
    double compute_ms = NAN;
    if (s == S_FSDP && o->compute_ref) {   // the compute alone first (its memory is gone before the peaks are reset)
        int64_t sh[2] = {o->batch, T};
        tsys_tensor *hi = tsys_tensor_new(ctx, TSYS_I64, TSYS_CPU, 2, sh), *ht = tsys_tensor_new(ctx, TSYS_I64, TSYS_CPU, 2, sh);
        tsys_rng_seed(ctx, (uint64_t)o->seed * 1000003u + 7u + (uint64_t)rank);
        if (hi && ht) { tsys_tensor_randint(ctx, hi, desc.vocab_size); tsys_tensor_randint(ctx, ht, desc.vocab_size); }
        tsys_tensor *di = tsys_tensor_to(ctx, hi, dev), *dtg = tsys_tensor_to(ctx, ht, dev);
        if (rank == 0) du_progress("%s fsdp T=%d: the compute alone", model_name, T);
        compute_ms = (di && dtg) ? plain_step_ms(ctx, dev, o, &desc, dt, di, dtg) : NAN;
        tsys_tensor_release(hi); tsys_tensor_release(ht); tsys_tensor_release(di); tsys_tensor_release(dtg);
        max_over_ranks(d, &compute_ms, 1);
    }
    tsys_mem_reset_peak(ctx, dev);
    double base_live = (double)tsys_mem_stats_get(ctx, dev).live_bytes;
    int n = o->steps, total = o->warmup + n;
    double *tstep = (double *)calloc((size_t)n, sizeof(double)), *tbwd = (double *)calloc((size_t)n, sizeof(double));
    double *topt = (double *)calloc((size_t)n, sizeof(double)), *texp = (double *)calloc((size_t)n, sizeof(double));
    double mem[4] = {0, 0, 0, 0};   // peak after init, before / after the first optimizer step, live after a step
    // every rank builds the model from the same seed; the broadcast makes them equal regardless
    r.model = tsys_model_new(ctx, &desc, dev, (uint64_t)o->seed + 1);
    tsys_ddp_desc dd = {s == S_NAIVE ? TSYS_DDP_NAIVE : s == S_OVERLAP ? TSYS_DDP_OVERLAP : s == S_BUCKETED || s == S_ZERO1 ? TSYS_DDP_BUCKETED : TSYS_DDP_FLAT,
                        bucket_mb, comm_bf16};
    // a rank that could not build the model (out of memory) must not leave the others in the broadcast
    if (!any_failed(d, r.model ? TSYS_OK : tsys_ctx_status(ctx) != TSYS_OK ? tsys_ctx_status(ctx) : TSYS_ERR_OOM)) {
        if (s == S_FSDP) {
            const tsys_fsdp_desc fd = fsdp_desc(o, dt);
            r.fsdp = tsys_fsdp_new(d, tsys_model_params(r.model), tsys_model_num_tensors(r.model), &fd);
            if (r.fsdp) r.opt = tsys_adamw_new(ctx, tsys_fsdp_params(r.fsdp), tsys_fsdp_num_params(r.fsdp), NULL);
        } else r.ddp = tsys_ddp_new(d, tsys_model_params(r.model), tsys_model_num_tensors(r.model), &dd);
    }
    if (r.fsdp) {
    } else if (r.ddp && s == S_ZERO1) r.zero1 = tsys_zero1_new(d, tsys_model_params(r.model), tsys_model_num_tensors(r.model), NULL);
    else if (r.ddp) r.opt = tsys_adamw_new(ctx, tsys_model_params(r.model), tsys_model_num_tensors(r.model), NULL);
    int64_t shape[2] = {o->batch, T};
    tsys_tensor *ids = tsys_tensor_new(ctx, TSYS_I64, TSYS_CPU, 2, shape), *tgt = tsys_tensor_new(ctx, TSYS_I64, TSYS_CPU, 2, shape);
    tsys_rng_seed(ctx, (uint64_t)o->seed * 1000003u + 7u + (uint64_t)rank);   // each rank its own batch
    if (ids && tgt) { tsys_tensor_randint(ctx, ids, desc.vocab_size); tsys_tensor_randint(ctx, tgt, desc.vocab_size); }
    r.ids = tsys_tensor_to(ctx, ids, dev);
    r.targets = tsys_tensor_to(ctx, tgt, dev);
    tsys_tensor_release(ids); tsys_tensor_release(tgt);
    tsys_dist_sync(d);
    mem[0] = peak_now(&r);
    if (r.fsdp) tsys_mem_reset_peak(ctx, dev);   // the whole model existed until it was sharded: the step's peak is what counts
    tsys_status st = tsys_ctx_status(ctx);
    bool failed = any_failed(d, st);
    for (int i = 0; !failed && i < total; i++) {
        double t[4];
        double m2[2];
        st = step(&r, t, i == 0 ? m2 : NULL);
        if (i == 0) { mem[1] = m2[0]; mem[2] = m2[1]; mem[3] = (double)tsys_mem_stats_get(ctx, dev).live_bytes - base_live; }
        int j = i - o->warmup;
        if (j >= 0) {
            tstep[j] = t[3]; tbwd[j] = t[1]; topt[j] = t[2];
            texp[j] = r.fsdp ? (isnan(compute_ms) ? NAN : fmax(0.0, t[3] - compute_ms)) : tsys_ddp_stats_get(r.ddp).exposed_ms;
        }
        if (rank == 0) du_progress("%s %s%s T=%d: step %d/%d (%.1f ms)", model_name, strat_names[s], s == S_BUCKETED ? " bucketed" : "", T, i + 1, total, t[3]);
        failed = any_failed(d, st);
    }
    // the step's all-reduces alone: finish with no backward reduces every bucket at once
    double alone = 0;
    tsys_fsdp_stats fst;
    memset(&fst, 0, sizeof(fst));
    if (r.fsdp) fst = tsys_fsdp_stats_get(r.fsdp);   // the last step's, before the timing below
    for (int k = 0; !failed && k < 3; k++) {
        tsys_dist_barrier(d);
        if (r.fsdp) {
            double ms = 0;
            st = tsys_fsdp_time_collectives(r.fsdp, &ms);
            alone += ms / 3;
        } else {
            tsys_ddp_start_step(r.ddp);
            st = tsys_ddp_finish(r.ddp);
            tsys_dist_sync(d);
            alone += tsys_ddp_stats_get(r.ddp).comm_ms / 3;
        }
        failed = any_failed(d, st);
    }
    if (rank == 0) du_progress_done();
    if (!failed) {
        max_over_ranks(d, tstep, n); max_over_ranks(d, tbwd, n); max_over_ranks(d, topt, n); max_over_ranks(d, texp, n);
        max_over_ranks(d, mem, 4); max_over_ranks(d, &alone, 1);
        tsys_stats ss = tsys_stats_of(tstep, n), sb = tsys_stats_of(tbwd, n), so = tsys_stats_of(topt, n), se = tsys_stats_of(texp, n);
        tsys_ddp_stats ds = tsys_ddp_stats_get(r.ddp);
        const tsys_fsdp_desc fdesc = fsdp_desc(o, dt);
        tsys_dist_account acc = s == S_FSDP ? tsys_fsdp_accounting_desc(&desc, &fdesc, o->batch, T, world)
                                            : tsys_dist_accounting(&desc, dt, o->batch, T, world, s == S_ZERO1 ? TSYS_SCHEME_ZERO1 : TSYS_SCHEME_DDP);
        du_row_set(row, "step_ms", "%.2f", ss.mean); du_row_set(row, "step_std", "%.2f", ss.std);
        du_row_set(row, "bwd_comm_ms", "%.2f", sb.mean);
        du_row_set(row, "opt_ms", "%.2f", so.mean);
        du_row_set(row, "comm_ms", "%.2f", alone);
        if (r.fsdp || link.beta_bytes_per_ms <= 0) du_row_set(row, "pred_comm_ms", "-");
        else du_row_set(row, "pred_comm_ms", "%.2f", link_time_ms(link, ds.num_buckets, ring_sent(world, (double)ds.bytes_per_step)));
        du_row_set(row, "comm_frac", "%.3f", ss.mean > 0 ? alone / ss.mean : 0);
        double hidden = alone > 0 ? 1.0 - se.mean / alone : 0;
        if (isnan(se.mean)) { du_row_set(row, "exposed_ms", "-"); du_row_set(row, "hidden", "-"); }   // --no-compute-ref: nothing to compare with
        else { du_row_set(row, "exposed_ms", "%.2f", se.mean); du_row_set(row, "hidden", "%.2f", hidden < 0 ? 0 : hidden > 1 ? 1 : hidden); }
        if (r.fsdp) {
            du_row_set(row, "buckets", "%d units", fst.num_units);
            du_row_set(row, "MB_per_step", "%.1f", (double)(fst.gathered_bytes + fst.reduced_bytes) / 1e6);
            if (isnan(compute_ms)) du_row_set(row, "compute_ms", "-");
            else du_row_set(row, "compute_ms", "%.2f", compute_ms);
        } else {
            du_row_set(row, "buckets", "%d%s", ds.num_buckets, ds.copied_buckets ? " (copied)" : "");
            du_row_set(row, "MB_per_step", "%.1f", (double)ds.bytes_per_step / 1e6);
            du_row_set(row, "compute_ms", "-");
        }
        du_row_set(row, "mem_init_MiB", "%.1f", mem[0] / MiB);
        du_row_set(row, "mem_pre_opt_MiB", "%.1f", mem[1] / MiB);
        du_row_set(row, "mem_post_opt_MiB", "%.1f", mem[2] / MiB);
        du_row_set(row, "state_MiB", "%.1f", mem[3] / MiB);
        if (s == S_FSDP) du_row_set(row, "pred_state_MiB", "%.1f", (acc.param_bytes + acc.grad_bytes + acc.optim_bytes - acc.work_bytes) / MiB);
        else du_row_set(row, "pred_state_MiB", "%.1f", (acc.param_bytes + acc.grad_bytes + acc.optim_bytes - (dt != TSYS_F32 ? acc.param_bytes - 4.0 * (double)tsys_model_desc_num_params(&desc) : 0)) / MiB);
        du_row_set(row, "pred_peak_MiB", "%.1f", acc.total_bytes / MiB);
        // comm_bf16 halves the gradients' all-reduce (DDP: all of it; ZeRO-1: 2 of its 3 parts, the broadcast stays fp32)
        double sent = acc.sent_bytes * (!comm_bf16 || s == S_FSDP ? 1.0 : s == S_ZERO1 ? 2.0 / 3.0 : 0.5);
        du_row_set(row, "pred_sent_MB", "%.1f", sent / 1e6);
        du_row_set(row, "status", "ok");
    } else {
        double e = st == TSYS_ERR_OOM ? 1 : 0;
        tsys_dist_all_reduce_host(d, &e, 1, TSYS_DIST_MAX);
        du_row_set(row, "status", "%s: %s", e > 0 ? "OOM" : "error", st != TSYS_OK ? tsys_ctx_last_error(ctx) : "on another rank");
    }
    tsys_tape_clear(ctx);
    run_free(&r);
    tsys_ctx_clear_error(ctx);
    free(tstep); free(tbwd); free(topt); free(texp);
}

// Ranks on one host share its cores: unless the user says otherwise, each gets cores / ranks threads.
static void share_cores(int ranks) {
    if (getenv("OMP_NUM_THREADS") || ranks <= 1) return;
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int per = (int)(cores / ranks > 1 ? cores / ranks : 1);
    char v[16];
    snprintf(v, sizeof(v), "%d", per);
    setenv("OMP_NUM_THREADS", v, 0);
    setenv("OPENBLAS_NUM_THREADS", v, 0);
#ifdef _OPENMP
    omp_set_num_threads(per);
#endif
#ifdef OPENBLAS_VERSION
    openblas_set_num_threads(per);
#endif
}

static int driver_main(int argc, char **argv) {
    ddp_opts o;
    int rc = parse_args(argc, argv, &o);
    if (rc == DU_HELP) { usage(stdout); return 0; }
    if (rc) return rc;
    du_list models, strategies, buckets, dtypes, ctxs;
    memset(&strategies, 0, sizeof(du_list)); memset(&buckets, 0, sizeof(du_list)); memset(&dtypes, 0, sizeof(du_list)); memset(&ctxs, 0, sizeof(du_list));
    if (!du_split(&models, "ddp", "--model", o.models) || !du_split(&strategies, "ddp", "--strategy", o.strategies) ||
        !du_split(&buckets, "ddp", "--bucket-mb", o.buckets) || !du_split(&dtypes, "ddp", "--dtype", o.dtypes) ||
        !du_split(&ctxs, "ddp", "--context-length", o.contexts)) {
        du_list_free(&models); du_list_free(&strategies); du_list_free(&buckets); du_list_free(&dtypes); du_list_free(&ctxs);
        return 2;
    }
    bool comm_bf16[2];   // --grad-comm, in the order given
    int ncomm = 0;
    du_list comms;
    if (!du_split(&comms, "ddp", "--grad-comm", o.comms)) return 2;
    for (int i = 0; i < comms.n; i++) {
        bool fp32 = !strcmp(comms.item[i], "fp32"), bf16 = !strcmp(comms.item[i], "bf16");
        if ((!fp32 && !bf16) || ncomm == 2) { fprintf(stderr, "ddp: --grad-comm takes fp32 and/or bf16, not '%s'\n", o.comms); du_list_free(&comms); usage(stderr); return 2; }
        comm_bf16[ncomm++] = bf16;
    }
    du_list_free(&comms);
    if (ncomm == 0) { fprintf(stderr, "ddp: an empty --grad-comm\n"); usage(stderr); return 2; }
    for (int i = 0; i < strategies.n; i++) { strat s; if (!parse_strategy(strategies.item[i], &s)) { fprintf(stderr, "ddp: unknown strategy '%s' (naive, flat, overlap, bucketed, zero1, fsdp)\n", strategies.item[i]); usage(stderr); return 2; } }
    for (int i = 0; i < buckets.n; i++) { double b; if (!du_parse_double(buckets.item[i], &b) || !(b >= 0) || b > 1e9) { fprintf(stderr, "ddp: bad bucket size '%s' (MB, >= 0)\n", buckets.item[i]); usage(stderr); return 2; } }
    for (int i = 0; i < dtypes.n; i++) { tsys_dtype t; if (!parse_dtype(dtypes.item[i], &t)) { fprintf(stderr, "ddp: unknown dtype '%s' (fp32, bf16)\n", dtypes.item[i]); usage(stderr); return 2; } }
    for (int i = 0; i < ctxs.n; i++) { int t; if (!du_parse_int(ctxs.item[i], 1, 1 << 20, &t)) { fprintf(stderr, "ddp: bad context length '%s'\n", ctxs.item[i]); usage(stderr); return 2; } }
    for (int i = 0; i < models.n; i++) {
        tsys_model_desc d;
        char err[256];
        if (strcmp(models.item[i], "custom") && tsys_model_desc_preset(models.item[i], &d, err, sizeof(err)) != TSYS_OK) { fprintf(stderr, "ddp: %s\n", err); usage(stderr); return 2; }
    }
    if (models.n == 0 || strategies.n == 0 || buckets.n == 0 || dtypes.n == 0 || ctxs.n == 0) { fprintf(stderr, "ddp: an empty list\n"); usage(stderr); return 2; }
    if (o.account) {
        rc = print_account(&o, &models, &dtypes, &ctxs);
        du_list_free(&models); du_list_free(&strategies); du_list_free(&buckets); du_list_free(&dtypes); du_list_free(&ctxs);
        return rc;
    }
    bool cuda = !strcmp(o.device, "cuda");
    if (!cuda) share_cores(o.nproc);
    int exit_code = 0;
    if (tsys_dist_spawn(o.nproc, argc, argv, &exit_code)) return exit_code;   // this was the launcher
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_dist_desc dd;
    memset(&dd, 0, sizeof(dd));
    dd.cuda = cuda;
    tsys_dist *d = tsys_dist_init(ctx, &dd);
    if (!d) { fprintf(stderr, "ddp: %s\n", tsys_ctx_last_error(ctx)); tsys_ctx_free(ctx); return 1; }
    int rank = tsys_dist_rank(d), world = tsys_dist_size(d);
    if (!cuda) share_cores(world);
    tsys_device dev = cuda ? TSYS_CUDA : TSYS_CPU;
    // the ranks on this host share its memory: each gets its part as its CPU budget (or --mem-limit);
    // on cuda, --mem-limit caps each rank's device instead
    const int local = tsys_dist_local_size(d);
    size_t cpu_budget = du_rank_cpu_budget(ctx, cuda ? 0 : o.mem_limit, local);
#ifdef TSYS_WITH_CUDA
    if (cuda && o.mem_limit) tsys_cuda_set_memory_limit(ctx, o.mem_limit);
#endif
    char lim[160];
    if (rank == 0) {
        printf("ddp: %d ranks (%s), %s", world, tsys_dist_engine_name(tsys_dist_engine_of(d)), cuda ? "cuda" : "cpu");
#ifdef TSYS_WITH_CUDA
        if (cuda) printf(" (%s)", tsys_cuda_device_name(ctx));
#endif
        if (!cuda) printf(", %d threads per rank", du_num_threads());
        printf(", batch %d per rank, warmup %d, %d steps, AdamW; cpu memory budget %s", o.batch, o.warmup, o.steps,
               du_rank_budget_str(lim, sizeof(lim), cpu_budget, cuda ? 0 : o.mem_limit, local));
        if (cuda) printf("; device memory %s", o.mem_limit ? du_mem_limit_str(lim, sizeof(lim), o.mem_limit) : "the whole device");
        printf("\n");
        fflush(stdout);
    }
    const link_model link = calibrate_link(ctx, d, dev);
    if (rank == 0) {
        if (link.beta_bytes_per_ms > 0)
            printf("link model (all-reduces of 64 KiB, 20 back to back, and of %d MiB): %.1f us a collective + bytes sent a rank at %.2f GB/s\n", cuda ? 256 : 32,
                   link.alpha_ms * 1e3, link.beta_bytes_per_ms * 1e-6);
        printf("\n");
        fflush(stdout);
    }
    du_table tab;
    du_table_init(&tab, "device,model,ranks,strategy,bucket_mb,grad_comm,dtype,context,batch,ckpt,loss,step_ms,step_std,bwd_comm_ms,opt_ms,comm_ms,pred_comm_ms,comm_frac,exposed_ms,hidden,compute_ms,"
                        "buckets,MB_per_step,mem_init_MiB,mem_pre_opt_MiB,mem_post_opt_MiB,state_MiB,pred_state_MiB,pred_peak_MiB,pred_sent_MB,status", o.format);
    int failures = 0;
    for (int a = 0; a < models.n; a++)
        for (int c = 0; c < ctxs.n; c++)
            for (int t = 0; t < dtypes.n; t++)
                for (int k = 0; k < strategies.n; k++) {
                    strat s = S_NAIVE;
                    tsys_dtype dt = TSYS_F32;
                    int T = 0;
                    parse_strategy(strategies.item[k], &s); parse_dtype(dtypes.item[t], &dt); du_parse_int(ctxs.item[c], 1, 1 << 20, &T);
                    const bool bucketed = s == S_BUCKETED || s == S_ZERO1;
                    for (int b = 0; b < (bucketed ? buckets.n : 1); b++) {
                        double mb = 0;
                        if (bucketed) du_parse_double(buckets.item[b], &mb);
                        for (int g = 0; g < (s == S_FSDP ? 1 : ncomm); g++) {
                            run_config(ctx, d, dev, &o, models.item[a], T, s, mb, comm_bf16[g], dt, link, &tab);
                            if (strcmp(du_row_get(&tab.row, "status"), "ok")) failures++;
                            if (rank == 0) du_table_emit(&tab);
                        }
                    }
                }
    du_table_free(&tab);
    du_list_free(&models); du_list_free(&strategies); du_list_free(&buckets); du_list_free(&dtypes); du_list_free(&ctxs);
    tsys_dist_free(d);
    tsys_ctx_free(ctx);   // also shuts the CUDA backend down
    return failures ? 1 : 0;
}

int main(int argc, char **argv) { return du_exit("ddp", driver_main(argc, argv)); }
