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
#include "e2e_plan.h"

typedef struct e2e_opts {
    du_common common;
    const char *device, *profile;
    du_model_flags mf;        // --model, the explicit dims (over the preset's), --load
    du_list contexts, modes, dtypes, attns, compiles, overlaps, lowps, lowp_grads, ckpts;
    int batch, warmup, steps, seed, configs;
    du_snapshot_flags snap;   // --save-every, --save-dir, --keep-last, --resume
    bool no_sgemm, tf32, nvtx, plan;
    FILE *profile_log;      // the paths of each profiled configuration's files, printed after the table
    tsys_stats ref[3];      // the reference GEMM rates MFU divides by, by autocast dtype (du_mfu_reference)
} e2e_opts;

// One configuration of the sweep (attn: auto resolved).
typedef struct config { const char *model, *attn, *in_backward, *ckpt; int T; du_mode mode; tsys_dtype dt; bool compiled, lowp, lowp_grads; } config;

// the syntax only: whether K fits a model's layers is checked per configuration (an error row)
static bool ok_ckpt(const char *s) { tsys_checkpoint_policy p; return tsys_checkpoint_policy_parse(s, 1 << 20, &p, NULL, 0) == TSYS_OK; }

// The lists a sweep combines, the one varying slowest first.
#define E2E_LISTS(o) {&(o)->mf.models, &(o)->contexts, &(o)->modes, &(o)->dtypes, &(o)->compiles, &(o)->overlaps, &(o)->lowps, &(o)->lowp_grads, &(o)->attns, &(o)->ckpts}

static void opts_free(e2e_opts *o) {
    du_list *l[10] = E2E_LISTS(o);
    for (int i = 0; i < 10; i++) du_list_free(l[i]);
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

#define CKPT_RULE "none, blocks:K, sqrt, nested[:K], selective, P+selective, P+keep-attn, P+first:N or auto:BYTES (K, N positive integers, BYTES such as 60GiB)"

// Parses the flags into o; 0 (o owns its lists: opts_free), DU_HELP, or DU_EXIT_USAGE after a message.
static int parse_flags(int argc, char **argv, e2e_opts *o) {
    memset(o, 0, sizeof(*o));
    du_model_flags_texts(&o->mf, "presets (%s), 'custom' with the dims below,\nor 'from-file': the dims of the --load checkpoint",
                         "a preset (%s), custom or from-file");
    du_flag flags[] = {
        DU_FLAG_CHOICE("device", &o->device, NULL, "cpu|cuda", "where to run (default: cuda when a GPU is present, else cpu)"),
        DU_MODEL_FLAGS(&o->mf, "small", du_ok_model_or_file),
        DU_CONTEXT_FLAG(&o->contexts, "256", "sequence lengths"),
        DU_FLAG_INT("batch-size", &o->batch, "4", 1, 1 << 20, "sequences a step"),
        DU_FLAG_INT("warmup", &o->warmup, "5", 0, 1 << 20, "untimed steps first"),
        DU_FLAG_INT("steps", &o->steps, "10", 1, 1 << 20, "timed steps"),
        DU_FLAG_LIST("mode", &o->modes, "forward-backward", "forward|forward-backward|train", "forward, forward-backward or train"),
        DU_FLAG_LIST("dtype", &o->dtypes, "fp32", "fp32|bf16|fp16", "fp32, bf16 or fp16 autocast"),
        DU_FLAG_LIST("attn", &o->attns, "auto", "naive|flash|auto", "naive, flash or auto: flash on cuda under bf16/fp16 autocast, naive\notherwise (the fp32 flash kernel has no tensor cores and loses to naive)"),
        DU_FLAG_LIST("opt-in-backward", &o->overlaps, "no", "no|yes|free|fused", "no, yes, free or fused: yes runs each layer's AdamW update on the background stream\n"
                     "(least priority) as soon as its gradients are final, overlapped with the rest\nof backward; free runs it on the compute stream "
                     "and gives the layer's gradients\nback after it (the peak holds one layer's gradients, not all); fused is yes\nwith each linear "
                     "weight updated inside its gradient's GEMM (TSYS_OPTIM_FUSE_UPDATE:\nthe gradient is never written; other sums' order than cuBLASLt's;\nslower than yes on the H200 so far) "
                     "(train mode; not\nwith fp16, whose loss scaler needs every gradient first)"),
        DU_FLAG_LIST("lowp-copies", &o->lowps, "no", "no|yes", "no or yes: yes has AdamW write each weight's bf16/fp16 copy in its update\n"
                     "kernel (tsys_optim_keep_lowp) so autocast casts no weight each step; 2 bytes\na parameter more, bitwise the same training (train mode under bf16/fp16)"),
        DU_FLAG_LIST("lowp-grads", &o->lowp_grads, "no", "no|yes", "no or yes: yes keeps the linear weights' gradients in the autocast dtype\n"
                     "(tsys_model_set_grad_dtype), as the weight-gradient matmul writes them and\ntorch's autocast rounds them; AdamW reads half the gradient bytes (backward\nunder bf16/fp16; not with fp16 training's loss scaler)"),
        DU_FLAG_LIST("compile", &o->compiles, "no", "no|yes", "no or yes: yes captures the whole step as a CUDA graph after warmup and\nreplays it (cuda only)"),
        DU_FLAG_LIST_CHECKED("checkpoint", &o->ckpts, "none", ok_ckpt, CKPT_RULE, "activation checkpointing: none | blocks:K | sqrt | nested[:K] |\nselective | "
                             "P+selective (P one of the four before) | P+keep-attn (flash\nattention keeps its output: no attention forward in the recompute) |\n"
                             "P+first:N (P's regions over the first N blocks; those above keep all) |\nauto:BYTES "
                             "(the planner picks the cheapest policy whose predicted peak fits\nBYTES, e.g. auto:60GiB, and prints its plan on stderr)"),
        DU_FLAG_BOOL("plan", &o->plan, "print each configuration's checkpointing accounting (bytes a block keeps\nwith and without checkpointing, "
                     "predicted peak, recomputed FLOPs in percent\nof the step's) instead of measuring"),
        DU_FLAG_STR("load", &o->mf.load, NULL, "FILE.safetensors", "weights to start from: tsys's or PyTorch's state names (_orig_mod. and\n"
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
    const char *why = du_device_why(o->device);   // the rules between flags
    if (!why) why = du_model_flags_why(&o->mf);
    char buf[200];
    if (!why) why = du_snapshot_flags_why(&o->snap, &o->modes, buf, sizeof(buf));
    if (!why && o->plan && (o->snap.save_every || o->snap.resume)) why = "--plan trains nothing: drop --save-every, --save-dir and --resume";
    const du_list *l[10] = E2E_LISTS(o);
    double rows = 1;   // a sweep is numbered by int: 10 lists of 64 would overflow it
    for (int i = 0; i < 10; i++) rows *= l[i]->n;
    if (!why && rows > (1 << 20)) why = "the lists make more than 1048576 configurations together (their sizes multiply)";
    if (!why) return 0;
    fprintf(stderr, "e2e: %s\n", why);
    opts_free(o);
    return DU_EXIT_USAGE;
}

// Configuration k (0-based) into c; returns how many the sweep has. The last list (--checkpoint) varies
// fastest, the first (--model) slowest; --plan sweeps only the lists that change the accounting.
static int sweep_at(const e2e_opts *o, tsys_device dev, int k, config *c) {
    const du_list *ax[10] = E2E_LISTS(o);
    const char *v[10];
    int total = 1;
    for (int i = 9; i >= 0; i--) {
        int n = o->plan && i >= 4 && i <= 6 ? 1 : ax[i]->n;
        v[i] = ax[i]->item[k % n];
        k /= n;
        total *= n;
    }
    memset(c, 0, sizeof(*c));
    c->model = v[0]; c->in_backward = v[5]; c->ckpt = v[9];
    du_parse_int(v[1], 1, 1 << 20, &c->T); du_parse_mode(v[2], &c->mode); du_parse_dtype(v[3], &c->dt);
    c->compiled = !strcmp(v[4], "yes"); c->lowp = !strcmp(v[6], "yes"); c->lowp_grads = !strcmp(v[7], "yes");
    c->attn = du_attn_resolve(v[8], dev, c->dt);
    return total;
}

// --save-dir and --resume of one configuration: DIR, or DIR/<configuration> in a sweep of several. Each
// snapshot records the batch, context and seed (a resumed run must train on the same batch: checked)
// and the configuration's name (rec keeps them).
static tsys_status config_snapshots(du_lm *lm, du_lm_record *rec, const e2e_opts *o, const config *c, const du_row *row) {
    char name[300], path[700];
    e2e_profile_name(name, sizeof(name), row);
    du_lm_record_set(lm, rec, o->batch, c->T, o->seed, name);
    tsys_status st = du_lm_snapshots(lm, &o->snap, o->configs > 1 ? name : "", 3, path, sizeof(path));
    if (st == TSYS_OK && o->snap.resume) fprintf(stderr, "e2e: resumed from %s: step %lld\n", path, (long long)lm->step);
    return st;
}

// The columns that name the configuration (a table lacking one ignores it).
static void row_header(du_row *row, tsys_device dev, const e2e_opts *o, const config *c) {
    du_row_lm_config(row, dev, c->model, c->T, o->batch, c->mode, c->dt, c->attn);
    du_row_set(row, "compiled", "%s", c->compiled ? "yes" : "no"); du_row_set(row, "opt_in_bwd", "%s", c->in_backward);
    du_row_set(row, "lowp_copies", "%s", c->lowp ? "yes" : "no"); du_row_set(row, "lowp_grads", "%s", c->lowp_grads ? "yes" : "no");
    du_row_set(row, "ckpt", "%s", c->ckpt); du_row_set(row, "warmup", "%d", o->warmup);
}

// The model shape of a configuration (du_model_config), its tensors within reach.
static bool config_desc(const e2e_opts *o, const config *c, tsys_model_desc *d, char *err, size_t len) {
    return du_model_config(&o->mf, c->model, c->T, c->attn, d, err, len) && du_model_sizes_ok(d, o->batch, c->T, err, len);
}

// --plan: the accounting of one configuration, no model built.
static void plan_config(const e2e_opts *o, const config *c, du_row *row) {
    char err[256] = "", name[64] = "";
    tsys_model_desc d;
    tsys_checkpoint_plan p;
    if (config_desc(o, c, &d, err, sizeof(err)) && e2e_plan_make(&d, c->ckpt, c->mode, o->batch, c->T, c->dt, 0u, &p, name, sizeof(name), err, sizeof(err)))
        e2e_plan_row(row, &d, &p, name);
    else du_row_set(row, "status", "error: %s", err);
}

// Why a configuration is not run (NULL: it is).
static const char *skip_reason(tsys_device dev, const config *c) {
    bool overlap = strcmp(c->in_backward, "no") != 0;
    if (c->compiled && dev != TSYS_CUDA) return "--compile needs --device cuda";
    if (c->compiled && c->dt == TSYS_F16 && c->mode == DU_TRAIN) return "fp16 loss scaling reads the overflow flag on the host";
    if (overlap && c->mode != DU_TRAIN) return "--opt-in-backward applies to train mode";
    if (overlap && c->dt == TSYS_F16) return "fp16 loss scaling needs every gradient before any update";
    if (c->lowp && (c->mode != DU_TRAIN || c->dt == TSYS_F32)) return "--lowp-copies applies to train mode under bf16/fp16";
    if (c->lowp_grads && (c->mode == DU_FORWARD || c->dt == TSYS_F32)) return "--lowp-grads applies to backward under bf16/fp16";
    if (c->lowp_grads && c->dt == TSYS_F16 && c->mode == DU_TRAIN) return "fp16 loss scaling unscales the gradients in place: they stay fp32";
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
    du_row_mfu(row, rate, &o->ref[du_dtype_index(c->dt)]);
}

static void run_config(tsys_ctx *ctx, tsys_device dev, const e2e_opts *o, const config *c, du_row *row) {
    char err[256] = "", ckpt_name[64] = "";
    tsys_model_desc d;
    tsys_checkpoint_plan plan;
    bool free_grads = !strcmp(c->in_backward, "free");   // the plan counts what the step holds
    unsigned step_flags = (c->lowp && c->dt != TSYS_F32 ? TSYS_PLAN_KEPT_COPIES : 0u) | (free_grads ? TSYS_PLAN_FREE_GRADS : 0u)
                        | (c->lowp_grads && c->dt != TSYS_F32 ? TSYS_PLAN_LOWP_GRADS : 0u);
    if (!config_desc(o, c, &d, err, sizeof(err))
        || !e2e_plan_make(&d, c->ckpt, c->mode, o->batch, c->T, c->dt, step_flags, &plan, ckpt_name, sizeof(ckpt_name), err, sizeof(err))) {
        du_row_set(row, "status", "error: %s", err);
        return;
    }
    if (!strncmp(c->ckpt, "auto:", 5)) e2e_plan_print(&plan, o->ref, c->dt, dev == TSYS_CUDA);
    du_row_set(row, "ckpt", "%s", ckpt_name);
    const char *skip = skip_reason(dev, c);
    if (skip) { du_row_set(row, "status", "skipped: %s", skip); return; }
    du_timed t;   // the model, its optimizer, the batch, the step, the snapshots; the phase events
    du_lm_record rec;
    du_timed_init(&t, ctx, dev, c->mode, c->dt);
    du_lm *lm = &t.lm;
    lm->overlap = strcmp(c->in_backward, "no") != 0; lm->free_grads = free_grads; lm->fuse_update = !strcmp(c->in_backward, "fused"); lm->lowp_copies = c->lowp; lm->lowp_grads = c->lowp_grads;
    tsys_mem_reset_peak(ctx, dev);
    const int n = o->steps;
    double *tm = (double *)calloc(4 * (size_t)n, sizeof(double));   // forward, backward, optimizer, total: n each
    tsys_status st = tm ? du_lm_setup(lm, &d, o->batch, c->T, (uint64_t)o->seed, o->mf.load)
                        : tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "out of host memory for %d step timings", n);
    if (st == TSYS_OK) st = config_snapshots(lm, &rec, o, c, row);   // a load before any capture: the graph's tensors stay where they are
    if (st == TSYS_OK) st = du_timed_run(&t, o->warmup, n, c->compiled, tm);
    if (st == TSYS_OK && o->profile) st = e2e_profile_step(&t, o->profile, row, o->profile_log);
    if (st == TSYS_OK) {
        row_timings(row, o, dev, c, &d, tm, n);
        if (c->mode != DU_FORWARD) {   // the plan models a step with backward
            du_row_set(row, "saved_MiB", "%.0f", (double)t.saved / 1048576.0); du_row_set(row, "pred_MiB", "%.0f", plan.peak_bytes / 1048576.0);
        }
        du_row_set(row, "peak_MiB", "%.0f", (double)tsys_mem_stats_get(ctx, dev).peak_bytes / 1048576.0);
        if (lm->saves) du_row_set(row, "save_ms", "%.1f", lm->save_ms / lm->saves);
        tsys_state_saver_stats ss = tsys_state_saver_stats_get(lm->saver);   // the last snapshot's copy and write
        if (ss.saves) du_row_set(row, "save_GBps", "%.2f", (double)ss.bytes / 1e6 / (ss.copy_ms + ss.write_ms));
        du_row_set(row, "wall_ms", "%.2f", t.wall_ms / n);   // the host's clock per timed step, snapshots included
        du_row_set(row, "status", "ok");
    } else {
        du_row_set(row, "status", "%s: %s", st == TSYS_ERR_OOM ? "OOM" : "error", tsys_ctx_last_error(ctx));
    }
    tsys_tape_clear(ctx);
    du_timed_free(&t);
    tsys_ctx_clear_error(ctx);
    free(tm);
}

// The context of the measured device: the budget applies to it, the other keeps its default; the
// reference GEMM rates that MFU is measured against (o->ref), said in the configuration lines.
static tsys_ctx *make_ctx(e2e_opts *o, tsys_device dev, FILE *cfg) {
    tsys_ctx *ctx = du_ctx_new("e2e", dev, o->common.mem_limit);
    if (!ctx) return NULL;
#ifdef TSYS_WITH_CUDA
    if (!du_ctx_cuda("e2e", ctx, dev, o->common.mem_limit)) { tsys_ctx_free(ctx); return NULL; }
    if (dev == TSYS_CUDA) tsys_cuda_set_tf32(ctx, o->tf32);
    if (dev == TSYS_CUDA && o->nvtx) tsys_cuda_set_nvtx(ctx, true);
#endif
    if (!o->no_sgemm) du_mfu_reference(ctx, dev, o->tf32, o->ref, cfg);
    return ctx;
}

#define E2E_COLS "device,model,context,batch,mode,dtype,attn,compiled,opt_in_bwd,lowp_copies,lowp_grads,ckpt,warmup,fwd_ms,fwd_std,bwd_ms,bwd_std,opt_ms,total_ms,total_std,"

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
    fprintf(cfg, "e2e: device %s; model %s; context %s; batch %d; mode %s; dtype %s; attn %s; compile %s; opt-in-backward %s; lowp-copies %s; lowp-grads %s; checkpoint %s; "
            "warmup %d; steps %d; memory limit %s%s%s", o.device, o.mf.models.src, o.contexts.src, o.batch, o.modes.src, o.dtypes.src, o.attns.src,
            o.compiles.src, o.overlaps.src, o.lowps.src, o.lowp_grads.src, o.ckpts.src, o.warmup, o.steps, du_mem_limit_str(lim, sizeof(lim), o.common.mem_limit),
            o.mf.load ? "; load " : "", o.mf.load ? o.mf.load : "");
    if (o.snap.save_dir) fprintf(cfg, "; a snapshot every %d steps into %s (keep %d, %s)", o.snap.save_every, o.snap.save_dir, o.snap.keep_last,
                                 !strcmp(o.snap.save_async, "no") ? "synchronous" : !strcmp(o.snap.save_async, "device") ? "staged on the device, written beside training" : "written beside training");
    fprintf(cfg, "%s%s\n", o.snap.resume ? "; resume " : "", o.snap.resume ? o.snap.resume : "");
    if (o.common.dry_run) { opts_free(&o); return du_dry_run_done(&o.common, "e2e", configs); }
    tsys_ctx *ctx = NULL;   // --plan builds nothing
    if (!o.plan && ((o.profile && !du_profile_open("e2e", o.profile, &o.profile_log)) || !(ctx = make_ctx(&o, dev, cfg)))) { opts_free(&o); return DU_EXIT_FAILED; }
    if (cfg == stdout) printf("\n");   // markdown: a blank line before the table
    fflush(stdout);
    du_table tab;
    char cols[400];   // save_ms only when saving: the tables without snapshots stay as they were
    snprintf(cols, sizeof(cols), E2E_COLS "%s%s,MFU,saved_MiB,pred_MiB,peak_MiB,note,status", o.snap.save_dir ? "save_ms,save_GBps,wall_ms," : "", dev == TSYS_CPU ? "GFLOP/s" : "TFLOP/s");
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
    bool listed = !o.profile_log || du_profile_list("e2e", o.profile_log, cfg);   // the paths of the tables and traces
    rc = du_table_exit_code(&tab, "e2e", o.common.oom_ok);
    if (!listed && rc == DU_EXIT_OK) rc = DU_EXIT_FAILED;
    du_table_free(&tab);
    opts_free(&o);
    tsys_ctx_free(ctx);   // also shuts the CUDA backend down
    return rc;
}

int main(int argc, char **argv) { return du_exit("e2e", driver_main(argc, argv)); }
