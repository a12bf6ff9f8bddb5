// e2e - the end-to-end benchmark of the cs336 Transformer LM: forward, forward+backward or a full
// training step, timed after warmup, one row per configuration.
//
//   e2e --model small --context-length 256 --mode forward-backward
//   e2e --model small,medium --dtype fp32,bf16 --mode train --format csv
//
// Comma-separated lists in --model, --context-length, --mode, --dtype ... sweep every combination.
#include "prelude.h"
#include "driver_util.h"
#include "e2e_profile.h"

typedef struct e2e_opts {
    du_common common;
    const char *device, *load, *profile;
    du_list models, contexts, modes, dtypes, attns, compiles, overlaps, lowps, ckpts;
    int batch, warmup, steps, seed, configs;
    du_snapshot_flags snap;   // --save-every, --save-dir, --keep-last, --resume
    tsys_model_desc dims;   // explicit dims (--d-model ...) override the preset's
    bool no_sgemm, tf32, nvtx, plan;
    FILE *profile_log;      // the paths of each profiled configuration's files, printed after the table
    tsys_stats ref[3];      // the reference GEMM rates by autocast dtype (fp32, bf16, fp16): GFLOP/s of the CPU's
                            // sgemm (the same for all three), TFLOP/s on cuda; max is what MFU divides by
} e2e_opts;

// One configuration of the sweep (attn: auto resolved).
typedef struct config { const char *model, *attn, *in_backward, *ckpt; int T; du_mode mode; tsys_dtype dt; bool compiled, lowp; } config;

static bool ok_context(const char *s) { int t; return du_parse_int(s, 1, 1 << 20, &t); }
// the syntax only: whether K fits a model's layers is checked per configuration (an error row)
static bool ok_ckpt(const char *s) { tsys_checkpoint_policy p; return tsys_checkpoint_policy_parse(s, 1 << 20, &p, NULL, 0) == TSYS_OK; }
static bool ok_model(const char *s) { tsys_model_desc d; return !strcmp(s, "custom") || !strcmp(s, "from-file") || tsys_model_desc_preset(s, &d, NULL, 0) == TSYS_OK; }
static int dt_index(tsys_dtype dt) { return dt == TSYS_F32 ? 0 : dt == TSYS_BF16 ? 1 : 2; }

// The lists a sweep combines, the one varying slowest first.
#define E2E_LISTS(o) {&(o)->models, &(o)->contexts, &(o)->modes, &(o)->dtypes, &(o)->compiles, &(o)->overlaps, &(o)->lowps, &(o)->attns, &(o)->ckpts}

static void opts_free(e2e_opts *o) {
    du_list *l[9] = E2E_LISTS(o);
    for (int i = 0; i < 9; i++) du_list_free(l[i]);
    if (o->profile_log) fclose(o->profile_log);
}

#define E2E_EPILOGUE \
    "Every combination of the lists is measured, one row each (--dry-run counts them). A cell that does not\n" \
    "apply reads '-' in md, is empty in csv and null in jsonl: bwd in forward mode, opt without an optimizer\n" \
    "step, the phases of a compiled step (one graph replay, timed whole), MFU under --no-sgemm.\n" \
    "MFU: percent of the reference GEMM rate measured at the start (CBLAS sgemm on cpu, best of 3; the GEMM\n" \
    "peak of the row's dtype on cuda, best of 6); note says when it is above 100% or when the reference's\n" \
    "repetitions spread more than 20% ((max - min) / median). saved_MiB: what forward kept for backward;\n" \
    "pred_MiB: the checkpointing plan's predicted peak; peak_MiB: the measured peak.\n"

#define CKPT_RULE "none, blocks:K, sqrt, nested[:K], selective, P+selective, P+keep-attn or auto:BYTES (K a positive integer, BYTES such as 60GiB)"

// Parses the flags into o; 0 (o owns its lists: opts_free), DU_HELP, or DU_EXIT_USAGE after a message.
static int parse_flags(int argc, char **argv, e2e_opts *o) {
    memset(o, 0, sizeof(*o));
    char model_help[300], model_rule[200];
    snprintf(model_help, sizeof(model_help), "presets (%s), 'custom' with the dims below,\nor 'from-file': the dims of the --load checkpoint", tsys_model_preset_names());
    snprintf(model_rule, sizeof(model_rule), "a preset (%s), custom or from-file", tsys_model_preset_names());
    du_flag flags[] = {
        DU_FLAG_CHOICE("device", &o->device, NULL, "cpu|cuda", "where to run (default: cuda when a GPU is present, else cpu)"),
        DU_FLAG_LIST_CHECKED("model", &o->models, "small", ok_model, model_rule, model_help),
        DU_FLAG_INT("d-model", &o->dims.d_model, NULL, 1, 1 << 20, "explicit dims, over the preset's (or the defaults' for custom)"),
        DU_FLAG_INT("d-ff", &o->dims.d_ff, NULL, 1, 1 << 22, "(explicit dims)"),
        DU_FLAG_INT("num-layers", &o->dims.num_layers, NULL, 1, 1 << 12, "(explicit dims)"),
        DU_FLAG_INT("num-heads", &o->dims.num_heads, NULL, 1, 1 << 12, "(explicit dims)"),
        DU_FLAG_INT("vocab-size", &o->dims.vocab_size, NULL, 1, 1 << 24, "(explicit dims)"),
        DU_FLAG_LIST_CHECKED("context-length", &o->contexts, "256", ok_context, "an integer from 1 to 1048576", "sequence lengths"),
        DU_FLAG_INT("batch-size", &o->batch, "4", 1, 1 << 20, "sequences a step"),
        DU_FLAG_INT("warmup", &o->warmup, "5", 0, 1 << 20, "untimed steps first"),
        DU_FLAG_INT("steps", &o->steps, "10", 1, 1 << 20, "timed steps"),
        DU_FLAG_LIST("mode", &o->modes, "forward-backward", "forward|forward-backward|train", "forward, forward-backward or train"),
        DU_FLAG_LIST("dtype", &o->dtypes, "fp32", "fp32|bf16|fp16", "fp32, bf16 or fp16 autocast"),
        DU_FLAG_LIST("attn", &o->attns, "auto", "naive|flash|auto", "naive, flash or auto: flash on cuda under bf16/fp16 autocast, naive\notherwise (the fp32 flash kernel has no tensor cores and loses to naive)"),
        DU_FLAG_LIST("opt-in-backward", &o->overlaps, "no", "no|yes|free", "no, yes or free: yes runs each layer's AdamW update on the side stream as\nsoon as its "
                     "gradients are final, overlapped with the rest of backward;\nfree runs it on the compute stream and gives the layer's gradients back after\nit "
                     "(the peak holds one layer's gradients, not all) (train mode; not with fp16,\nwhose loss scaler needs every gradient first)"),
        DU_FLAG_LIST("lowp-copies", &o->lowps, "no", "no|yes", "no or yes: yes has AdamW write each weight's bf16/fp16 copy in its update\n"
                     "kernel (tsys_optim_keep_lowp) so autocast casts no weight each step; 2 bytes\na parameter more, bitwise the same training (train mode under bf16/fp16)"),
        DU_FLAG_LIST("compile", &o->compiles, "no", "no|yes", "no or yes: yes captures the whole step as a CUDA graph after warmup and\nreplays it (cuda only)"),
        DU_FLAG_LIST_CHECKED("checkpoint", &o->ckpts, "none", ok_ckpt, CKPT_RULE, "activation checkpointing: none | blocks:K | sqrt | nested[:K] |\nselective | "
                             "P+selective (P one of the four before) | P+keep-attn (flash\nattention keeps its output: no attention forward in the recompute) |\nauto:BYTES "
                             "(the planner picks the cheapest policy whose predicted peak fits\nBYTES, e.g. auto:60GiB, and prints its plan on stderr)"),
        DU_FLAG_BOOL("plan", &o->plan, "print each configuration's checkpointing accounting (bytes a block keeps\nwith and without checkpointing, "
                     "predicted peak, recomputed FLOPs in percent\nof the step's) instead of measuring"),
        DU_FLAG_STR("load", &o->load, NULL, "FILE.safetensors", "weights to start from: tsys's or PyTorch's state names (_orig_mod. and\n"
                    "module. prefixes dropped), or a Hugging Face Llama checkpoint (a directory\nwith model.safetensors and config.json, or the file)"),
        DU_FLAG_INT("seed", &o->seed, "0", 0, 1 << 30, "weights and batch seed"),
        DU_FLAG_BOOL("no-sgemm", &o->no_sgemm, "skip the reference GEMM measurement (CBLAS sgemm on cpu, GEMM peaks on\ncuda); the MFU column is then empty"),
        DU_FLAG_BOOL("tf32", &o->tf32, "fp32 GEMMs on TF32 tensor cores (cuda; default off)"),
        DU_FLAG_BOOL("nvtx", &o->nvtx, "NVTX ranges for nsys (cuda): warmup, forward, backward, optimizer, each\nlayer, each op, the parts of attention"),
        DU_FLAG_STR("profile", &o->profile, NULL, "DIR", "after the timed steps, profile one more (eager) step of each configuration:\nDIR/<config>.md holds "
                    "the op and kernel tables, DIR/<config>.json a Chrome\ntrace (chrome://tracing, ui.perfetto.dev: ops with input shapes, flows to\ntheir kernels), "
                    "DIR/summary.csv a line each (added to what it holds); after\nthe table, one line per profiled configuration names its .md and .json (on\nstdout under md, on stderr under csv and jsonl)"),
        DU_SNAPSHOT_FLAGS(&o->snap),
        DU_COMMON_FLAGS(&o->common, DU_MEM_LIMIT_TEXT),
    };
    int rc = du_flags_parse("e2e", flags, (int)(sizeof(flags) / sizeof(flags[0])), argc, argv, NULL, E2E_EPILOGUE);
    if (rc) return rc;
    if (!o->device) o->device = du_has_cuda() ? "cuda" : "cpu";
    const tsys_model_desc *x = &o->dims;
    const char *why = NULL;   // the rules between flags
#ifndef TSYS_WITH_CUDA
    if (!strcmp(o->device, "cuda")) why = "--device cuda: this binary was built without CUDA; build it with 'make cuda'";
#endif
    for (int i = 0; i < o->models.n && !why; i++) {
        if (strcmp(o->models.item[i], "from-file")) continue;
        if (!o->load) why = "--model from-file needs --load FILE (the checkpoint whose dims it takes)";
        else if (x->d_model || x->d_ff || x->num_layers || x->num_heads || x->vocab_size)
            why = "--model from-file takes its dims from the file: drop --d-model, --d-ff, --num-layers, --num-heads and --vocab-size";
    }
    char buf[200];
    if (!why) why = du_snapshot_flags_why(&o->snap, &o->modes, buf, sizeof(buf));
    if (!why && o->plan && (o->snap.save_every || o->snap.resume)) why = "--plan trains nothing: drop --save-every, --save-dir and --resume";
    const du_list *l[9] = E2E_LISTS(o);
    double rows = 1;   // a sweep is numbered by int: 9 lists of 64 would overflow it
    for (int i = 0; i < 9; i++) rows *= l[i]->n;
    if (!why && rows > (1 << 20)) why = "the lists make more than 1048576 configurations together (their sizes multiply)";
    if (!why) return 0;
    fprintf(stderr, "e2e: %s\n", why);
    opts_free(o);
    return DU_EXIT_USAGE;
}

// Configuration k (0-based) into c; returns how many the sweep has. The last list (--checkpoint) varies
// fastest, the first (--model) slowest; --plan sweeps only the lists that change the accounting.
static int sweep_at(const e2e_opts *o, tsys_device dev, int k, config *c) {
    const du_list *ax[9] = E2E_LISTS(o);
    const char *v[9];
    int total = 1;
    for (int i = 8; i >= 0; i--) {
        int n = o->plan && i >= 4 && i <= 6 ? 1 : ax[i]->n;
        v[i] = ax[i]->item[k % n];
        k /= n;
        total *= n;
    }
    memset(c, 0, sizeof(*c));
    c->model = v[0]; c->in_backward = v[5]; c->ckpt = v[8];
    du_parse_int(v[1], 1, 1 << 20, &c->T); du_parse_mode(v[2], &c->mode); du_parse_dtype(v[3], &c->dt);
    c->compiled = !strcmp(v[4], "yes"); c->lowp = !strcmp(v[6], "yes");
    c->attn = strcmp(v[7], "auto") ? v[7] : dev == TSYS_CUDA && c->dt != TSYS_F32 ? "flash" : "naive";
    return total;
}

// Everything one configuration needs, built once, released by bench_free.
typedef struct bench {
    du_lm lm;         // the model, its optimizer, the batch, the step, the snapshots
    char record_value[4][300];
    const char *record[8];   // what each snapshot records (lm.record)
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

#ifdef TSYS_WITH_CUDA
// Times `steps` replays of the step captured as a CUDA graph; per-step totals go to tot[].
static tsys_status bench_compiled(bench *b, int steps, double *tot) {
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
        if (st == TSYS_OK) st = du_lm_step_done(&b->lm, i == steps - 1);   // between replays (du_lm_save says why it may)
        du_progress_step("timed", i + 1, steps);
    }
    tsys_cuda_graph_free(g);
    return st;
}
#else   // not reached: --device cuda is refused without CUDA, and --compile is skipped on the CPU
static tsys_status bench_compiled(bench *b, int steps, double *tot) { (void)steps; (void)tot; return tsys_ctx_set_error(b->lm.ctx, TSYS_ERR_UNSUPPORTED, "--compile needs CUDA"); }
#endif

// --save-dir and --resume of one configuration: DIR, or DIR/<configuration> in a sweep of several. Each
// snapshot records the batch, context and seed (a resumed run must train on the same batch: checked)
// and the configuration's name.
static tsys_status bench_snapshots(bench *b, const e2e_opts *o, const config *c, const du_row *row) {
    static const char *const keys[4] = {"batch", "context", "seed", "config"};
    char (*v)[300] = b->record_value, path[700];
    snprintf(v[0], 300, "%d", o->batch); snprintf(v[1], 300, "%d", c->T); snprintf(v[2], 300, "%d", o->seed); e2e_profile_name(v[3], 300, row);
    for (int i = 0; i < 4; i++) { b->record[2 * i] = keys[i]; b->record[2 * i + 1] = v[i]; }
    b->lm.record = b->record; b->lm.n_record = 4;
    tsys_status st = du_lm_snapshots(&b->lm, &o->snap, o->configs > 1 ? v[3] : "", 3, path, sizeof(path));
    if (st == TSYS_OK && o->snap.resume) fprintf(stderr, "e2e: resumed from %s: step %lld\n", path, (long long)b->lm.step);
    return st;
}

// One more step under the profiler; its files go under --profile DIR (e2e_profile.h).
static tsys_status bench_profile(bench *b, const e2e_opts *o, const du_row *row) {
    tsys_profiler *p = tsys_profiler_begin(b->lm.ctx);
    double t[3] = {0, 0, 0};
    tsys_status st = p ? bench_step(b, t) : tsys_ctx_status(b->lm.ctx);
    if (p && tsys_profiler_end(p) != TSYS_OK && st == TSYS_OK) st = tsys_ctx_status(b->lm.ctx);
    if (st == TSYS_OK) st = e2e_profile_write(b->lm.ctx, p, o->profile, row, t, o->profile_log);
    tsys_profiler_free(p);
    return st;
}

// The columns that name the configuration (a table lacking one ignores it).
static void row_header(du_row *row, tsys_device dev, const e2e_opts *o, const config *c) {
    du_row_set(row, "device", "%s", dev == TSYS_CPU ? "cpu" : "cuda");
    du_row_set(row, "model", "%s", c->model); du_row_set(row, "context", "%d", c->T); du_row_set(row, "batch", "%d", o->batch);
    du_row_set(row, "mode", "%s", du_mode_names[c->mode]); du_row_set(row, "dtype", "%s", du_dtype_flag(c->dt)); du_row_set(row, "attn", "%s", c->attn);
    du_row_set(row, "compiled", "%s", c->compiled ? "yes" : "no"); du_row_set(row, "opt_in_bwd", "%s", c->in_backward);
    du_row_set(row, "lowp_copies", "%s", c->lowp ? "yes" : "no"); du_row_set(row, "ckpt", "%s", c->ckpt); du_row_set(row, "warmup", "%d", o->warmup);
}

// The model shape of a configuration: a preset (explicit dims override it), 'custom', or 'from-file'
// (the --load checkpoint's dims; the context is the configuration's, as RoPE has no length limit).
static bool config_desc(const e2e_opts *o, const config *c, tsys_model_desc *d, char *err, size_t len) {
    if (strcmp(c->model, "from-file")) return du_model_desc(&o->dims, c->model, c->T, c->attn, d, err, len) && du_model_sizes_ok(d, o->batch, c->T, err, len);
    if (tsys_model_desc_from_file(o->load, d, err, len) != TSYS_OK) return false;
    d->context_length = c->T;
    d->attn = c->attn;
    return tsys_model_desc_validate(d, err, len) == TSYS_OK && du_model_sizes_ok(d, o->batch, c->T, err, len);
}

// The checkpointing plan of a configuration; auto:BYTES is resolved here with what the step holds
// (AdamW state only in train mode) and its plan printed on stderr unless quiet. d->checkpoint becomes
// the policy run. extra: TSYS_PLAN_KEPT_COPIES / TSYS_PLAN_FREE_GRADS when the step runs with them.
static bool config_plan(const e2e_opts *o, const config *c, tsys_model_desc *d, unsigned extra, tsys_checkpoint_plan *plan, char *name, size_t name_len,
                        char *err, size_t len, bool quiet) {
    d->checkpoint = c->ckpt;
    unsigned flags = c->mode == DU_TRAIN ? TSYS_PLAN_OPTIMIZER | extra : 0u;
    if (tsys_checkpoint_plan_make_ex(d, c->ckpt, o->batch, c->T, c->dt, flags, plan, err, len) != TSYS_OK) return false;
    bool is_auto = !strncmp(c->ckpt, "auto:", 5);
    snprintf(name, name_len, "%s%s", plan->name, is_auto ? " (auto)" : "");
    if (!is_auto) return true;
    d->checkpoint = plan->name;
    if (quiet) return true;
    bool cuda = !strcmp(o->device, "cuda");
    double peak = o->ref[dt_index(c->dt)].max > 0 ? o->ref[dt_index(c->dt)].max : 0;
    tsys_checkpoint_plan_print(plan, stderr, cuda ? peak : peak / 1e3, cuda && o->ref[0].max > 0 ? 2000.0 : 10.0);   // GPU HBM / CPU DRAM GB/s, nominal
    return true;
}

// --plan: the accounting of one configuration, no model built.
static void plan_config(const e2e_opts *o, const config *c, du_row *row) {
    char err[256] = "", name[64] = "";
    tsys_model_desc d;
    tsys_checkpoint_plan p;
    if (!config_desc(o, c, &d, err, sizeof(err)) || !config_plan(o, c, &d, 0u, &p, name, sizeof(name), err, sizeof(err), true)) {
        du_row_set(row, "status", "error: %s", err);
        return;
    }
    const double MiB = 1048576.0;
    du_row_set(row, "ckpt", "%s", name);
    du_row_set(row, "block_MiB", "%.2f", p.block_bytes / MiB); du_row_set(row, "kept_block_MiB", "%.2f", p.kept_block_bytes / MiB);
    du_row_set(row, "kept_blocks_MiB", "%.2f", p.kept_block_bytes * d.num_layers / MiB); du_row_set(row, "kept_MiB", "%.1f", p.kept_bytes / MiB);
    du_row_set(row, "pred_peak_MiB", "%.1f", p.peak_bytes / MiB);
    du_row_set(row, "recompute_pct", "%.1f", p.step_flops > 0 ? 100.0 * p.recompute_flops / p.step_flops : 0.0);
    du_row_set(row, "fits", "%s", p.budget > 0 ? (p.fits ? "yes" : "no: least peak") : DU_NA);
    du_row_set(row, "status", "ok");
}

// Why a configuration is not run (NULL: it is).
static const char *skip_reason(tsys_device dev, const config *c) {
    bool overlap = strcmp(c->in_backward, "no") != 0;
    if (c->compiled && dev != TSYS_CUDA) return "--compile needs --device cuda";
    if (c->compiled && c->dt == TSYS_F16 && c->mode == DU_TRAIN) return "fp16 loss scaling reads the overflow flag on the host";
    if (overlap && c->mode != DU_TRAIN) return "--opt-in-backward applies to train mode";
    if (overlap && c->dt == TSYS_F16) return "fp16 loss scaling needs every gradient before any update";
    if (c->lowp && (c->mode != DU_TRAIN || c->dt == TSYS_F32)) return "--lowp-copies applies to train mode under bf16/fp16";
    return NULL;
}

// The timing columns of a measured row: tm holds n forward, backward, optimizer and total ms. Phases a
// row lacks stay not applicable: no backward in forward mode, no optimizer step outside train mode (its
// zero_grad time still counts in total_ms), and a compiled step is one graph replay, timed whole.
static void row_timings(du_row *row, const e2e_opts *o, tsys_device dev, const config *c, const tsys_model_desc *d, const double *tm, int n) {
    tsys_stats sf = tsys_stats_of(tm, n), sb = tsys_stats_of(tm + n, n), so = tsys_stats_of(tm + 2 * n, n), s = tsys_stats_of(tm + 3 * n, n);
    if (!c->compiled) {
        du_row_set(row, "fwd_ms", "%.2f", sf.mean); du_row_set(row, "fwd_std", "%.2f", sf.std);
        if (c->mode != DU_FORWARD) { du_row_set(row, "bwd_ms", "%.2f", sb.mean); du_row_set(row, "bwd_std", "%.2f", sb.std); }
        if (c->mode == DU_TRAIN) du_row_set(row, "opt_ms", "%.2f", so.mean);
    }
    du_row_set(row, "total_ms", "%.2f", s.mean); du_row_set(row, "total_std", "%.2f", s.std);
    // over the whole step, as the PyTorch baseline counts it: GFLOP/s on cpu, TFLOP/s on cuda, as the reference
    double rate = tsys_model_flops(d, o->batch, c->T, c->mode != DU_FORWARD) / s.mean / (dev == TSYS_CPU ? 1e6 : 1e9);
    du_row_set(row, dev == TSYS_CPU ? "GFLOP/s" : "TFLOP/s", "%.1f", rate);
    const tsys_stats *ref = &o->ref[dt_index(c->dt)];
    if (!(ref->max > 0)) return;
    double mfu = 100.0 * rate / ref->max, spread = ref->median > 0 ? (ref->max - ref->min) / ref->median : 0;
    char note[200] = "";
    du_row_set(row, "MFU", "%.1f", mfu);
    if (mfu > 100) snprintf(note, sizeof(note), "MFU above 100%%: the reference GEMM ran slower than the step's GEMMs (a loaded machine?)");
    if (spread > 0.2) snprintf(note + strlen(note), sizeof(note) - strlen(note), "%sreference GEMM spread %.0f%%", *note ? "; " : "", 100 * spread);
    if (*note) du_row_set(row, "note", "%s", note);
}

static void run_config(tsys_ctx *ctx, tsys_device dev, const e2e_opts *o, const config *c, du_row *row) {
    char err[256] = "", ckpt_name[64] = "";
    tsys_model_desc d;
    tsys_checkpoint_plan plan;
    if (!config_desc(o, c, &d, err, sizeof(err))) { du_row_set(row, "status", "error: %s", err); return; }
    bool free_grads = !strcmp(c->in_backward, "free");
    unsigned step_flags = (c->lowp && c->dt != TSYS_F32 ? TSYS_PLAN_KEPT_COPIES : 0u) | (free_grads ? TSYS_PLAN_FREE_GRADS : 0u);
    if (!config_plan(o, c, &d, step_flags, &plan, ckpt_name, sizeof(ckpt_name), err, sizeof(err), false)) { du_row_set(row, "status", "error: %s", err); return; }
    du_row_set(row, "ckpt", "%s", ckpt_name);
    const char *skip = skip_reason(dev, c);
    if (skip) { du_row_set(row, "status", "skipped: %s", skip); return; }
    bench b;
    memset(&b, 0, sizeof(b));
    b.lm.ctx = ctx; b.lm.dev = dev; b.lm.mode = c->mode; b.lm.dtype = c->dt; b.lm.overlap = strcmp(c->in_backward, "no") != 0;
    b.lm.free_grads = free_grads; b.lm.lowp_copies = c->lowp; b.lm.mark = bench_mark; b.lm.mark_user = &b;
    tsys_mem_reset_peak(ctx, dev);
    // eager steps: warmup (a graph is captured after at least one eager step), then the timed ones unless compiled
    int n = o->steps, warm = c->compiled && o->warmup < 1 ? 1 : o->warmup, eager = warm + (c->compiled ? 0 : n);
    double *tm = (double *)calloc(4 * (size_t)n, sizeof(double));   // forward, backward, optimizer, total: n each
    tsys_status st = tm ? du_lm_setup(&b.lm, &d, o->batch, c->T, (uint64_t)o->seed, o->load)
                        : tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "out of host memory for %d step timings", n);
    if (st == TSYS_OK) st = bench_snapshots(&b, o, c, row);   // a load before any capture: the graph's tensors stay where they are
    bool in_warmup = warm > 0;
    if (in_warmup) tsys_trace_begin(ctx, "warmup");   // nsys can skip it
    for (int i = 0; st == TSYS_OK && i < eager; i++) {
        double t[3] = {0, 0, 0};
        if (i == warm && in_warmup) { tsys_trace_end(ctx); in_warmup = false; }
        st = bench_step(&b, t);
        if (st == TSYS_OK) st = du_lm_step_done(&b.lm, i == eager - 1 && !c->compiled);   // after the step's timing: a save is not in it
        if (i < warm) { du_progress_step("warmup", i + 1, warm); continue; }
        du_progress_step("timed", i - warm + 1, n);
        for (int k = 0; k < 3; k++) tm[k * n + i - warm] = t[k];
        tm[3 * n + i - warm] = t[0] + t[1] + t[2];
    }
    if (in_warmup) tsys_trace_end(ctx);
    if (st == TSYS_OK && c->compiled) st = bench_compiled(&b, n, tm + 3 * n);
    if (st == TSYS_OK && o->profile) st = bench_profile(&b, o, row);
    if (st == TSYS_OK) {
        row_timings(row, o, dev, c, &d, tm, n);
        if (c->mode != DU_FORWARD) {   // the plan models a step with backward
            du_row_set(row, "saved_MiB", "%.0f", (double)b.saved / 1048576.0); du_row_set(row, "pred_MiB", "%.0f", plan.peak_bytes / 1048576.0);
        }
        du_row_set(row, "peak_MiB", "%.0f", (double)tsys_mem_stats_get(ctx, dev).peak_bytes / 1048576.0);
        if (b.lm.saves) du_row_set(row, "save_ms", "%.1f", b.lm.save_ms / b.lm.saves);
        du_row_set(row, "status", "ok");
    } else {
        du_row_set(row, "status", "%s: %s", st == TSYS_ERR_OOM ? "OOM" : "error", tsys_ctx_last_error(ctx));
    }
    tsys_tape_clear(ctx);
    bench_free(&b);
    tsys_ctx_clear_error(ctx);
    free(tm);
}

static double spread_pct(const tsys_stats *s) { return s->median > 0 ? 100.0 * (s->max - s->min) / s->median : 0; }

// The reference GEMM rates that MFU is measured against (o->ref), said in the configuration lines.
static void measure_reference(tsys_ctx *ctx, tsys_device dev, e2e_opts *o, FILE *cfg) {
    if (dev == TSYS_CPU) {
        double r[3];
        for (int i = 0; i < 3; i++) r[i] = tsys_cpu_sgemm_gflops(1024, 1);   // each after an untimed product
        o->ref[0] = o->ref[1] = o->ref[2] = tsys_stats_of(r, 3);
        fprintf(cfg, "cpu: CBLAS sgemm %.1f GFLOP/s (1024^3, best of 3, spread %.0f%%), %d threads; MFU is measured against it\n", o->ref[0].max,
                spread_pct(&o->ref[0]), du_num_threads());
        return;
    }
#ifdef TSYS_WITH_CUDA
    for (int i = 0; i < 3; i++) o->ref[i] = tsys_gemm_rate(ctx, dev, i == 0 ? TSYS_F32 : i == 1 ? TSYS_BF16 : TSYS_F16, 8192, 6);
    fprintf(cfg, "cuda: %s; measured GEMM peaks (8192^3, random data, best of 6): %s %.1f, bf16 %.1f, fp16 %.1f TFLOP/s (spread %.0f%%, %.0f%%, "
            "%.0f%%); MFU is measured against them\n", tsys_cuda_device_name(ctx), o->tf32 ? "tf32" : "fp32", o->ref[0].max, o->ref[1].max, o->ref[2].max,
            spread_pct(&o->ref[0]), spread_pct(&o->ref[1]), spread_pct(&o->ref[2]));
#else
    (void)ctx;
#endif
}

// The context of the measured device: the budget applies to it, the other keeps its default.
static tsys_ctx *make_ctx(e2e_opts *o, tsys_device dev, FILE *cfg) {
    tsys_ctx_desc cd;
    memset(&cd, 0, sizeof(cd));
    if (dev == TSYS_CPU) cd.cpu_memory_limit = o->common.mem_limit;
    tsys_ctx *ctx = tsys_ctx_new(&cd);
    if (!ctx) { fprintf(stderr, "e2e: out of memory creating the context\n"); return NULL; }
#ifdef TSYS_WITH_CUDA
    if (dev == TSYS_CUDA) {
        if (tsys_cuda_init(ctx, 0) != TSYS_OK) { fprintf(stderr, "e2e: %s\n", tsys_ctx_last_error(ctx)); tsys_ctx_free(ctx); return NULL; }
        tsys_cuda_set_tf32(ctx, o->tf32);
        if (o->nvtx) tsys_cuda_set_nvtx(ctx, true);
        if (o->common.mem_limit) tsys_cuda_set_memory_limit(ctx, o->common.mem_limit);
    }
#endif
    if (!o->no_sgemm) measure_reference(ctx, dev, o, cfg);
    return ctx;
}

#define E2E_COLS "device,model,context,batch,mode,dtype,attn,compiled,opt_in_bwd,lowp_copies,ckpt,warmup,fwd_ms,fwd_std,bwd_ms,bwd_std,opt_ms,total_ms,total_std,"
#define E2E_PLAN_COLS "model,context,batch,mode,dtype,attn,ckpt,block_MiB,kept_block_MiB,kept_blocks_MiB,kept_MiB,pred_peak_MiB,recompute_pct,fits,status"

static int driver_main(int argc, char **argv) {
    e2e_opts o;
    int rc = parse_flags(argc, argv, &o);
    if (rc) return rc == DU_HELP ? DU_EXIT_OK : rc;
    du_progress_setup("e2e", o.common.progress);
    tsys_device dev = strcmp(o.device, "cuda") ? TSYS_CPU : TSYS_CUDA;
    FILE *cfg = du_preamble(&o.common);
    char lim[64];
    config c;
    int configs = o.configs = sweep_at(&o, dev, 0, &c);
    fprintf(cfg, "e2e: device %s; model %s; context %s; batch %d; mode %s; dtype %s; attn %s; compile %s; opt-in-backward %s; lowp-copies %s; checkpoint %s; "
            "warmup %d; steps %d; memory limit %s%s%s", o.device, o.models.src, o.contexts.src, o.batch, o.modes.src, o.dtypes.src, o.attns.src,
            o.compiles.src, o.overlaps.src, o.lowps.src, o.ckpts.src, o.warmup, o.steps, du_mem_limit_str(lim, sizeof(lim), o.common.mem_limit),
            o.load ? "; load " : "", o.load ? o.load : "");
    if (o.snap.save_dir) fprintf(cfg, "; a snapshot every %d steps into %s (keep %d)", o.snap.save_every, o.snap.save_dir, o.snap.keep_last);
    fprintf(cfg, "%s%s\n", o.snap.resume ? "; resume " : "", o.snap.resume ? o.snap.resume : "");
    if (o.common.dry_run) { opts_free(&o); return du_dry_run_done(&o.common, "e2e", configs); }
    tsys_ctx *ctx = NULL;   // --plan builds nothing
    if (!o.plan && ((o.profile && !e2e_profile_open(o.profile, &o.profile_log)) || !(ctx = make_ctx(&o, dev, cfg)))) { opts_free(&o); return DU_EXIT_FAILED; }
    if (cfg == stdout) printf("\n");   // markdown: a blank line before the table
    fflush(stdout);
    du_table tab;
    char cols[400];   // save_ms only when saving: the tables without snapshots stay as they were
    snprintf(cols, sizeof(cols), E2E_COLS "%s%s,MFU,saved_MiB,pred_MiB,peak_MiB,note,status", o.snap.save_dir ? "save_ms," : "", dev == TSYS_CPU ? "GFLOP/s" : "TFLOP/s");
    du_table_init(&tab, o.plan ? E2E_PLAN_COLS : cols, o.common.format);
    du_progress_begin(configs);
    for (int k = 0; k < configs; k++) {
        sweep_at(&o, dev, k, &c);
        du_progress_config(k + 1, "%s T=%d %s %s %s%s ckpt %s", c.model, c.T, du_mode_names[c.mode], du_dtype_flag(c.dt), c.attn, c.compiled ? " compiled" : "", c.ckpt);
        du_row *row = du_table_row(&tab);
        row_header(row, dev, &o, &c);
        if (o.plan) plan_config(&o, &c, row);
        else run_config(ctx, dev, &o, &c, row);
        du_table_emit(&tab);
    }
    du_progress_end();
    bool listed = !o.profile_log || e2e_profile_list(o.profile_log, cfg);   // the paths of the tables and traces
    rc = du_table_exit_code(&tab, "e2e", o.common.oom_ok);
    if (!listed && rc == DU_EXIT_OK) rc = DU_EXIT_FAILED;
    du_table_free(&tab);
    opts_free(&o);
    tsys_ctx_free(ctx);   // also shuts the CUDA backend down
    return rc;
}

int main(int argc, char **argv) { return du_exit("e2e", driver_main(argc, argv)); }
