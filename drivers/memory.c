// memory - the memory profile of the cs336 Transformer LM (the CS336 memory_profiling problem): one
// forward pass or one full training step per configuration, after a warmup step, with every
// allocation on the tracker's timeline.
//
//   memory --model 2.7B --context-length 128,256,512 --mode forward,train --dtype fp32,bf16 --out mem
//
// Per configuration it prints a row (peak, its breakdown by category, the peak of each phase, the
// first-principles prediction beside it) and, after the table, the largest allocations grouped by
// the op that made them and the prediction term by term (drivers/memory_timeline.h). With --out DIR
// it also writes the timeline as JSON and as an SVG plot (stacked areas by category, phases shaded,
// the peak marked), and the step as a memory_viz snapshot (tsys_mem_snapshot, tsys.h).
#include "prelude.h"
#include "driver_util.h"
#include "memory_timeline.h"
#include <sys/stat.h>

typedef struct mem_opts {
    const char *device, *out;
    du_model_flags mf;         // --model and the explicit dims (over the preset's)
    du_list contexts, modes, dtypes, attns;
    int batch, top, seed;
    du_common c;
    FILE *details;             // the per-configuration tables, printed after the results
    tsys_mem_snapshot *snap;   // the memory_viz snapshot (--out)
} mem_opts;

static const char *const epilogue =
    "Every combination of the lists is measured: a warmup step (it makes the optimizer state and the\n"
    "allocator's caches), then the recorded step. Memory is the tracker's: tensor storage, library\n"
    "workspace and kernel scratch by category; 'cached' is what the CUDA caching allocator holds free.\n"
    "Columns: peak_MiB (the recorded step's peak), predicted_MiB (from the model's shapes), diff_pct\n"
    "(the peak against the prediction, in percent), the peak by category, the peak of each phase\n"
    "(fwd, bwd, opt; not applicable where the mode has no such phase), peak_in (the peak's phase),\n"
    "residual_MiB (one fp32 residual stream: batch x context x d_model). After the table, for each\n"
    "configuration: the prediction term by term, each phase's peak, the largest allocations.\n";

static void opts_free(mem_opts *o) {
    du_list_free(&o->mf.models); du_list_free(&o->contexts); du_list_free(&o->modes); du_list_free(&o->dtypes); du_list_free(&o->attns);
}

// Returns 0 (o owns the lists), DU_HELP (the usage is printed) or DU_EXIT_USAGE after a message naming the flag.
static int parse_args(int argc, char **argv, mem_opts *o) {
    memset(o, 0, sizeof(*o));
    o->device = du_has_cuda() ? "cuda" : "cpu";
    du_model_flags_texts(&o->mf, "presets (%s) or 'custom' with the dims below\n(default 2.7B on cuda, small on cpu)", "a preset (%s) or custom");
    du_flag flags[] = {
        DU_FLAG_CHOICE("device", &o->device, NULL, "cpu|cuda", "where to run (default: cuda when a GPU is present, else cpu)"),
        DU_MODEL_FLAGS(&o->mf, NULL, du_ok_model),
        DU_CONTEXT_FLAG(&o->contexts, "128,256,512", "sequence lengths"),
        DU_FLAG_INT("batch-size", &o->batch, "4", 1, 1 << 20, "sequences a step"),
        DU_FLAG_LIST("mode", &o->modes, "forward,train", "forward|forward-backward|train", "forward (no grad), forward-backward, train"),
        DU_FLAG_LIST("dtype", &o->dtypes, "fp32,bf16", "fp32|bf16|fp16", "autocast dtype; fp32 = no autocast"),
        DU_FLAG_LIST("attn", &o->attns, "auto", "naive|flash|auto", "attention; auto = flash on cuda under autocast, else naive"),
        DU_FLAG_STR("out", &o->out, NULL, "DIR",
                    "write DIR/<configuration>.json (the timeline), .svg (its plot) and\n.pickle (the memory_viz snapshot)"),
        DU_FLAG_INT("top", &o->top, "8", 1, 1000, "rows of the largest-allocations table"),
        DU_FLAG_INT("seed", &o->seed, "0", 0, 1 << 30, "weights and batch seed"),
        DU_COMMON_FLAGS(&o->c, DU_MEM_LIMIT_TEXT),
    };
    int rc = du_flags_parse("memory", flags, (int)(sizeof(flags) / sizeof(flags[0])), argc, argv, NULL, epilogue);
    if (rc) return rc;
    const char *why = du_device_why(o->device);
    if (why) fprintf(stderr, "memory: %s\n", why);
    else if (o->mf.models.n || du_split(&o->mf.models, "memory", "--model", strcmp(o->device, "cuda") ? "small" : "2.7B")) return 0;
    opts_free(o);
    return DU_EXIT_USAGE;
}

// ---- one configuration ----------------------------------------------------------------------------

typedef struct config { const char *model; int T; du_mode mode; tsys_dtype dt; const char *attn; tsys_model_desc d; } config;

static void config_name(const config *c, tsys_device dev, char *buf, size_t len) {
    snprintf(buf, len, "%s_%s_ctx%d_%s_%s_%s", dev == TSYS_CPU ? "cpu" : "cuda", c->model, c->T, du_mode_names[c->mode], du_dtype_flag(c->dt),
             c->attn);
}

static tsys_status run_step(du_lm *lm) {
    int last;
    tsys_status st = du_lm_step(lm, &last);
    return st == TSYS_OK ? tsys_sync(lm->ctx, lm->dev) : st;
}

static void fill_row(du_row *row, const mt_timeline *tl, const tsys_model_mem_estimate *pe, const config *c, const mem_opts *o, bool ok) {
    static const char *const cols[MT_NCAT] = {"params_MiB", "grads_MiB", "optim_MiB", "activ_MiB", "temp_MiB", "workspace_MiB"};
    static const char *const phase_cols[MT_PHASES] = {"fwd_peak_MiB", "bwd_peak_MiB", "opt_peak_MiB"};
    du_row_set(row, "peak_MiB", "%.1f", tl->peak.live * MT_MIB);
    du_row_set(row, "predicted_MiB", "%.1f", pe->peak * MT_MIB);
    if (ok) du_row_set(row, "diff_pct", "%.1f", pe->peak ? 100.0 * (double)(tl->peak.live - pe->peak) / (double)pe->peak : 0.0);
    else du_row_set(row, "diff_pct", DU_NA);   // the step stopped early: its peak is where it failed
    for (int c = 0; c < MT_NCAT; c++) du_row_set(row, cols[c], "%.1f", tl->peak.cat[c] * MT_MIB);
    du_row_set(row, "cached_MiB", "%.1f", tl->peak.cached * MT_MIB);
    for (int p = 0; p < MT_PHASES; p++) {
        if (p + 1 < tl->nmarks && tl->phase[p].live >= 0) du_row_set(row, phase_cols[p], "%.1f", tl->phase[p].live * MT_MIB);
        else du_row_set(row, phase_cols[p], DU_NA);
    }
    du_row_set(row, "peak_in", "%s", mt_phase_names[tl->peak_phase]);
    du_row_set(row, "residual_MiB", "%.2f", (double)o->batch * c->T * c->d.d_model * 4 * MT_MIB);
}

// --out: the timeline, its plot and the snapshot; false (the reason in ctx, naming the file) when one
// of them could not be written.
static bool write_out(tsys_ctx *ctx, const mem_opts *o, const config *c, tsys_device dev, const mt_timeline *tl, const char *name, const char *oom) {
    char path[1024], title[320];
    snprintf(title, sizeof(title), "%s, context %d, batch %d, %s, %s (%s)%s", c->model, c->T, o->batch, du_mode_names[c->mode], du_dtype_flag(c->dt),
             dev == TSYS_CPU ? "cpu" : "cuda", oom ? ": out of memory" : "");
    snprintf(path, sizeof(path), "%s/%s.json", o->out, name);
    bool ok = mt_write_json(path, ctx, tl, title, oom);
    snprintf(path, sizeof(path), "%s/%s.svg", o->out, name);
    ok = mt_write_svg(path, ctx, tl, title, oom) && ok;
    snprintf(path, sizeof(path), "%s/%s.pickle", o->out, name);
    ok = ok && tsys_mem_snapshot_write(o->snap, path) == TSYS_OK;
    tsys_mem_snapshot_stats ss = tsys_mem_snapshot_stats_get(o->snap);
    if (ss.unmatched) fprintf(stderr, "memory: %s: %ld frees of allocations the snapshot never saw\n", name, ss.unmatched);
    return ok;
}

static void run_config(tsys_ctx *ctx, tsys_device dev, const mem_opts *o, config *c, du_table *tab) {
    static const char *const no_room = "out of host memory for the timeline";
    char err[256] = "", name[192];
    du_row *row = du_table_row(tab);
    du_row_lm_config(row, dev, c->model, c->T, o->batch, c->mode, c->dt, c->attn);
    if (!du_model_config(&o->mf, c->model, c->T, c->attn, &c->d, err, sizeof(err)) || !du_model_sizes_ok(&c->d, o->batch, c->T, err, sizeof(err))) {
        du_row_set(row, "status", "error: %s", err);
        return;
    }
    config_name(c, dev, name, sizeof(name));
    mt_timeline tl;
    memset(&tl, 0, sizeof(tl));
    du_lm lm;
    du_lm_init(&lm, ctx, dev, c->mode, c->dt);
    lm.mark = mt_mark; lm.mark_user = &tl;
    // Setup and the warmup step are recorded too: when they fail, that timeline shows where. When
    // they succeed (the optimizer state, the autocast copies and the caches are made), the recorded
    // window starts again with the measured step.
    bool opened = mt_open(&tl, ctx, dev);
    if (o->snap) tsys_mem_snapshot_restart(o->snap);
    tsys_status st = opened ? du_lm_setup(&lm, &c->d, o->batch, c->T, (uint64_t)o->seed, NULL) : tsys_ctx_set_error(ctx, TSYS_ERR_OOM, no_room);
    if (st == TSYS_OK) st = run_step(&lm);
    du_progress_step("warmup", 1, 2);   // the two steps of a configuration: warmup, then the recorded one
    if (st == TSYS_OK) {
        mt_free(&tl);
        opened = mt_open(&tl, ctx, dev);
        if (o->snap) tsys_mem_snapshot_restart(o->snap);
        tsys_mem_reset_peak(ctx, dev);
        st = opened ? run_step(&lm) : tsys_ctx_set_error(ctx, TSYS_ERR_OOM, no_room);
        du_progress_step("recorded", 2, 2);
    }
    const char *oom = st == TSYS_ERR_OOM ? tsys_ctx_last_error(ctx) : NULL;
    if (opened && !mt_close(&tl, ctx) && st == TSYS_OK) st = tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "out of host memory replaying the timeline");
    tsys_model_mem_estimate pe = tsys_model_mem_predict(&c->d, o->batch, c->T, c->dt, c->mode != DU_FORWARD, c->mode == DU_TRAIN);
    if (opened) {
        fill_row(row, &tl, &pe, c, o, st == TSYS_OK);
        if (tl.mismatches)
            fprintf(stderr, "memory: %s: %ld timeline events where the categories do not add up to the live bytes\n", name, tl.mismatches);
        fprintf(o->details, "### %s\n\n", name);
        mt_print_prediction(o->details, ctx, &tl, &pe);
        mt_print_phases(o->details, &tl);
        mt_print_largest(o->details, ctx, &tl, o->top);
        if (o->out && !write_out(ctx, o, c, dev, &tl, name, oom)) {   // a lost result fails the row, whatever the step did (an OOM row's plot too)
            char why[600] = "a write failed", was[600] = "";
            if (st == TSYS_OK) snprintf(why, sizeof(why), "%s", tsys_ctx_last_error(ctx));   // tsys_atomic_file's: the file and why
            else snprintf(was, sizeof(was), " (and the step: %s: %s)", st == TSYS_ERR_OOM ? "OOM" : "error", tsys_ctx_last_error(ctx));
            tsys_ctx_clear_error(ctx);
            st = tsys_ctx_set_error(ctx, TSYS_ERR_IO, "--out: cannot write %s/%s.{json,svg,pickle}: %s%s", o->out, name, why, was);
        } else if (o->out) {
            fprintf(o->details, "timeline: %s/%s.json, plot: %s/%s.svg\nmemory_viz snapshot: %s/%s.pickle (pytorch.org/memory_viz)\n\n",
                    o->out, name, o->out, name, o->out, name);
        }
    }
    if (st == TSYS_OK) du_row_set(row, "status", "ok");
    else du_row_set(row, "status", "%s: %s", st == TSYS_ERR_OOM ? "OOM" : "error", tsys_ctx_last_error(ctx));
    mt_free(&tl);
    tsys_tape_clear(ctx);
    du_lm_free(&lm);
    tsys_ctx_clear_error(ctx);
#ifdef TSYS_WITH_CUDA
    if (dev == TSYS_CUDA) tsys_cuda_empty_cache(ctx);   // the next configuration starts from an empty cache
#endif
}

// ---- the sweep ------------------------------------------------------------------------------------

// The context, with its budget, the snapshot's hooks (from the start, so that it knows what is live)
// and CUDA; NULL after a message.
static tsys_ctx *open_ctx(mem_opts *o, tsys_device dev) {
    tsys_ctx *ctx = du_ctx_new("memory", dev, o->c.mem_limit);
    if (!ctx) return NULL;
    if (o->out && !(o->snap = tsys_mem_snapshot_begin(ctx, dev))) {
        fprintf(stderr, "memory: %s\n", tsys_ctx_last_error(ctx));
        tsys_ctx_free(ctx);
        return NULL;
    }
#ifdef TSYS_WITH_CUDA
    if (!du_ctx_cuda("memory", ctx, dev, o->c.mem_limit)) {
        tsys_mem_snapshot_free(o->snap); o->snap = NULL;
        tsys_ctx_free(ctx);
        return NULL;
    }
    if (dev == TSYS_CUDA) fprintf(du_preamble(&o->c), "cuda: %s\n", tsys_cuda_device_name(ctx));
#endif
    return ctx;
}

static int driver_main(int argc, char **argv) {
    mem_opts o;
    int rc = parse_args(argc, argv, &o);
    if (rc == DU_HELP) return DU_EXIT_OK;
    if (rc) return rc;
    du_progress_setup("memory", o.c.progress);
    tsys_device dev = strcmp(o.device, "cuda") ? TSYS_CPU : TSYS_CUDA;
    char lim[64];
    FILE *cfg = du_preamble(&o.c);
    fprintf(cfg, "memory: device %s; model %s; context %s; batch %d; mode %s; dtype %s; attn %s; memory limit %s%s%s\n", o.device, o.mf.models.src,
            o.contexts.src, o.batch, o.modes.src, o.dtypes.src, o.attns.src, du_mem_limit_str(lim, sizeof(lim), o.c.mem_limit), o.out ? "; out " : "",
            o.out ? o.out : "");
    int configs = o.mf.models.n * o.contexts.n * o.modes.n * o.dtypes.n * o.attns.n;
    if (o.c.dry_run) { opts_free(&o); return du_dry_run_done(&o.c, "memory", configs); }
    if (o.out && mkdir(o.out, 0777) != 0 && errno != EEXIST) {
        fprintf(stderr, "memory: --out: cannot make folder '%s': %s\n", o.out, strerror(errno));
        opts_free(&o);
        return DU_EXIT_USAGE;
    }
    o.details = tmpfile();
    if (!o.details) { fprintf(stderr, "memory: no temporary file: %s\n", strerror(errno)); opts_free(&o); return DU_EXIT_FAILED; }
    tsys_ctx *ctx = open_ctx(&o, dev);
    if (!ctx) { fclose(o.details); opts_free(&o); return DU_EXIT_FAILED; }
    if (cfg == stdout) printf("\n");
    fflush(stdout);
    du_table tab;
    du_table_init(&tab, "device,model,context,batch,mode,dtype,attn,peak_MiB,predicted_MiB,diff_pct,params_MiB,grads_MiB,optim_MiB,activ_MiB,"
                        "temp_MiB,workspace_MiB,cached_MiB,fwd_peak_MiB,bwd_peak_MiB,opt_peak_MiB,peak_in,residual_MiB,status", o.c.format);
    du_progress_begin(configs);
    for (int k = 0; k < configs; k++) {   // models outermost, attention innermost
        int i = k;
        const char *attn = o.attns.item[i % o.attns.n]; i /= o.attns.n;
        config cf;
        memset(&cf, 0, sizeof(cf));
        du_parse_dtype(o.dtypes.item[i % o.dtypes.n], &cf.dt); i /= o.dtypes.n;
        du_parse_mode(o.modes.item[i % o.modes.n], &cf.mode); i /= o.modes.n;
        du_parse_int(o.contexts.item[i % o.contexts.n], 1, 1 << 20, &cf.T); i /= o.contexts.n;
        cf.model = o.mf.models.item[i];
        cf.attn = du_attn_resolve(attn, dev, cf.dt);
        du_progress_config(k + 1, "%s T=%d %s %s %s", cf.model, cf.T, du_mode_names[cf.mode], du_dtype_flag(cf.dt), cf.attn);
        run_config(ctx, dev, &o, &cf, &tab);
        du_table_emit(&tab);
    }
    du_progress_end();
    rewind(o.details);   // the tables of each configuration, after the results
    char line[1024];
    fprintf(cfg, "\n");
    while (fgets(line, sizeof(line), o.details)) fputs(line, cfg);
    fclose(o.details);
    rc = du_table_exit_code(&tab, "memory", o.c.oom_ok);
    du_table_free(&tab);
    opts_free(&o);
    tsys_mem_snapshot_free(o.snap);
    tsys_ctx_free(ctx);
    return rc;
}

int main(int argc, char **argv) { return du_exit("memory", driver_main(argc, argv)); }
