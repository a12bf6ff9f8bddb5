// mesh - the cs336 LM on a device mesh: tensor parallelism (tsys_tp_model), dp x tp (DDP), fsdp x tp, HSDP and
// FSDP or DDP over every rank, a row per model x context x dtype x layout: the measured step, memory and
// communication beside the S26 section 8 plan (tsys_dist_plan_step at --plan-tflops and --plan-gbps, and the same
// collectives priced on each group's fitted link). Every rank of a tp group trains on the same batch, each dp
// replica on its own; only rank 0 prints. Times are the slowest rank's, mean (and std) over the timed steps.
//
//   mesh --nproc 4 --model small --layout tp:4,tp_sp:4,fsdp_tp:2,hsdp:2,fsdp
//   mpirun -np 4 mesh --device cuda --model 2.7B --context-length 1024,4096 --dtype bf16
#define _POSIX_C_SOURCE 200809L   // clock_gettime, dup (driver_util.h)
#define TSYS_PRELUDE_DIST
#include "prelude.h"
#include "driver_util.h"

typedef struct mesh_opts {
    du_common common;
    const char *device, *attn;
    du_model_flags mf;
    du_list layouts, dtypes, contexts;
    int batch, warmup, steps, nproc, seed;
    double plan_tflops, plan_gbps;
} mesh_opts;

// A layout of the list: "tp:4", "dp_tp:2", "fsdp_tp:2" (each with "_sp" for sequence parallelism: "tp_sp:4"),
// "hsdp:2" (the shard group's size), "fsdp", "dp".
typedef enum { L_TP, L_DP_TP, L_FSDP_TP, L_HSDP, L_FSDP, L_DP, L_COUNT } layout_kind;
static const char *const layout_names[L_COUNT] = {"tp", "dp_tp", "fsdp_tp", "hsdp", "fsdp", "dp"};
typedef struct layout { layout_kind kind; int split; bool sp; } layout;   // split: tp's size, or hsdp's shard group's (1 for fsdp, dp)

static bool layout_parse(const char *s, layout *out) {
    const char *colon = strchr(s, ':');
    size_t n = colon ? (size_t)(colon - s) : strlen(s);
    out->sp = n > 3 && !strncmp(s + n - 3, "_sp", 3);
    if (out->sp) n -= 3;
    for (int k = 0; k < L_COUNT; k++) {
        if (strlen(layout_names[k]) != n || strncmp(s, layout_names[k], n)) continue;
        out->kind = (layout_kind)k;
        out->split = 1;
        if (out->sp && k != L_TP && k != L_DP_TP && k != L_FSDP_TP) return false;   // sequence parallelism is tensor parallelism's
        if (k == L_FSDP || k == L_DP) return !colon;
        return colon && du_parse_int(colon + 1, 1, 1 << 20, &out->split);
    }
    return false;
}
static bool layout_ok(const char *s) { layout l; return layout_parse(s, &l); }

static const double MiB = 1048576.0;

// ---- one configuration -------------------------------------------------------------------------------

// What a row trains, made on every rank and freed by mesh_run_free.
typedef struct mesh_run {
    tsys_ctx *ctx;
    tsys_dist_mesh *mesh;
    tsys_dist *dp, *tp;   // the groups the layout syncs over (NULL: none); hsdp: replicate, shard
    tsys_model *model;
    tsys_tp_model *tpm;
    tsys_ddp *ddp;
    tsys_fsdp *fsdp;
    tsys_optim *opt;
    tsys_tensor *ids, *targets;
    tsys_dtype autocast;   // TSYS_F32: none (fsdp layouts compute in their compute dtype)
} mesh_run;

static void mesh_run_free(mesh_run *r) {
    tsys_tensor_release(r->ids); tsys_tensor_release(r->targets);
    tsys_optim_free(r->opt);
    tsys_ddp_free(r->ddp);
    tsys_fsdp_free(r->fsdp);
    tsys_tp_model_free(r->tpm);
    tsys_model_free(r->model);
    tsys_dist_mesh_free(r->mesh);
    memset(r, 0, sizeof(*r));
}

// The mesh (dp x tp, or replicate x shard), the model as the layout holds it, its optimizer and this replica's
// batch (seeded by the replica's index: the ranks of a tp group share it).
static tsys_status mesh_run_new(mesh_run *r, tsys_ctx *ctx, tsys_dist *world, tsys_device dev, const layout *l, const tsys_model_desc *desc, tsys_dtype dt,
                                int batch, int seed) {
    memset(r, 0, sizeof(*r));
    r->ctx = ctx;
    const int n = tsys_dist_size(world);
    if (n % l->split)
        return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "--layout %s:%d: %d does not divide the %d ranks", layout_names[l->kind], l->split, l->split, n);
    const bool hsdp = l->kind == L_HSDP, with_tp = l->kind == L_TP || l->kind == L_DP_TP || l->kind == L_FSDP_TP;
    int shape[2] = { n / l->split, l->split };
    const char *names[2] = { hsdp ? "replicate" : "dp", hsdp ? "shard" : "tp" };
    if (!(r->mesh = tsys_dist_mesh_new(world, 2, shape, names))) return tsys_ctx_status(ctx);
    tsys_dist *outer = tsys_dist_mesh_group(r->mesh, names[0]), *inner = tsys_dist_mesh_group(r->mesh, names[1]);
    if (!(r->model = tsys_model_new(ctx, desc, dev, (uint64_t)seed + 1))) return tsys_ctx_status(ctx);
    tsys_tensor **params = tsys_model_params(r->model);
    int np = tsys_model_num_tensors(r->model);
    if (with_tp) {
        if (!(r->tpm = tsys_tp_model_new(inner, r->model))) return tsys_ctx_status(ctx);
        tsys_tp_model_set_sequence_parallel(r->tpm, l->sp);
        tsys_model_free(r->model);   // the shards are copies
        r->model = NULL;
        params = tsys_tp_model_params(r->tpm);
        np = tsys_tp_model_num_tensors(r->tpm);
        r->tp = inner;
    }
    tsys_fsdp_desc fd;
    memset(&fd, 0, sizeof(fd));
    fd.compute_dtype = dt;
    tsys_ddp_desc dd;
    memset(&dd, 0, sizeof(dd));
    dd.strategy = TSYS_DDP_BUCKETED;
    dd.bucket_mb = 100;
    switch (l->kind) {
    case L_FSDP_TP: r->fsdp = tsys_fsdp_new(r->dp = outer, params, np, &fd); break;
    case L_FSDP: r->fsdp = tsys_fsdp_new(r->dp = world, params, np, &fd); break;
    case L_HSDP: r->fsdp = tsys_fsdp_new(r->tp = inner, params, np, &fd); break;   // FSDP over the shard group, DDP of its shards below
    default: break;
    }
    if ((l->kind == L_FSDP_TP || l->kind == L_FSDP || hsdp) && !r->fsdp) return tsys_ctx_status(ctx);
    if (r->fsdp) { params = tsys_fsdp_params(r->fsdp); np = tsys_fsdp_num_params(r->fsdp); }
    if (l->kind == L_DP_TP || l->kind == L_DP || hsdp) {
        if (hsdp) dd.strategy = TSYS_DDP_FLAT;
        if (!(r->ddp = tsys_ddp_new(r->dp = l->kind == L_DP ? world : outer, params, np, &dd))) return tsys_ctx_status(ctx);
    }
    r->autocast = r->fsdp ? TSYS_F32 : dt;
    if (!(r->opt = tsys_adamw_new(ctx, params, np, NULL))) return tsys_ctx_status(ctx);
    const int replica = with_tp ? tsys_dist_rank(outer) : tsys_dist_rank(world);
    int64_t bt[2] = { batch, desc->context_length };
    r->ids = tsys_tensor_new(ctx, TSYS_I32, dev, 2, bt);
    r->targets = tsys_tensor_new(ctx, TSYS_I32, dev, 2, bt);
    if (!r->ids || !r->targets) return tsys_ctx_status(ctx);
    tsys_rng_seed(ctx, (uint64_t)seed * 1000003u + (uint64_t)replica + 17u);
    tsys_status st = tsys_tensor_randint(ctx, r->ids, desc->vocab_size);
    return st == TSYS_OK ? tsys_tensor_randint(ctx, r->targets, desc->vocab_size) : st;
}

// One training step; *loss the step's loss averaged over the replicas (NULL: not read, no host sync).
static tsys_status mesh_step(mesh_run *r, double *loss) {
    tsys_ctx *ctx = r->ctx;
    if (r->ddp) tsys_ddp_start_step(r->ddp);
    if (r->autocast != TSYS_F32) tsys_autocast_begin(ctx, r->autocast);
    tsys_tensor *l = NULL;
    if (r->tpm) l = tsys_tp_model_loss(r->tpm, r->ids, r->targets);
    else l = tsys_model_loss(r->model, r->ids, r->targets);
    if (r->autocast != TSYS_F32) tsys_autocast_end(ctx);
    tsys_status st = l ? tsys_backward(ctx, l) : tsys_ctx_status(ctx);
    if (st == TSYS_OK && loss) *loss = tsys_item(ctx, l);
    tsys_tensor_release(l);
    if (st == TSYS_OK && r->fsdp) st = tsys_fsdp_finish(r->fsdp);
    if (st == TSYS_OK && r->ddp) st = tsys_ddp_finish(r->ddp);
    if (st == TSYS_OK) st = tsys_optim_step(r->opt);
    if (st == TSYS_OK) tsys_optim_release_grads(r->opt);
    return st == TSYS_OK ? tsys_ctx_status(ctx) : st;
}

// The row's measurements: per step (slowest rank's), the peak, the first and last step's loss, the collectives
// alone over tp (tensor parallelism's, or HSDP's FSDP) and over dp.
typedef struct mesh_measured {
    double *tm, peak, loss_first, loss_last, tp_comm, dp_comm;
    tsys_dist_link_model l_dp, l_tp;
    tsys_dist_link_model l_dp_ag, l_dp_rs, l_tp_ag, l_tp_rs;   // the all-gathers' and reduce-scatters' own, where the layout has them
    char why[DU_CELL];
} mesh_measured;

static bool mesh_measure(mesh_measured *m, tsys_ctx *ctx, tsys_dist *world, tsys_device dev, const mesh_opts *o, const layout *l, const tsys_model_desc *desc, tsys_dtype dt) {
    memset(m, 0, sizeof(*m));
    const int n = o->steps, total = o->warmup + n;
    mesh_run r;
    tsys_status st = mesh_run_new(&r, ctx, world, dev, l, desc, dt, o->batch, o->seed);
    m->tm = (double *)calloc((size_t)n, sizeof(double));
    if (st == TSYS_OK && !m->tm) st = TSYS_ERR_OOM;
    tsys_mem_reset_peak(ctx, dev);   // the whole model existed until the layout split it: the step's peak is what counts
    bool failed = tsys_dist_any_failed(world, st);
    for (int i = 0; !failed && i < total; i++) {
        const int j = i - o->warmup;
        const double t0 = du_now_s();
        double loss = 0;
        st = mesh_step(&r, i == 0 || j == n - 1 ? &loss : NULL);
        if (st == TSYS_OK) st = tsys_dist_sync(world);
        if (j >= 0) m->tm[j] = 1e3 * (du_now_s() - t0);
        if (i == 0) m->loss_first = loss;
        if (j == n - 1) m->loss_last = loss;
        du_progress_step(j < 0 ? "warmup" : "timed", j < 0 ? i + 1 : j + 1, j < 0 ? o->warmup : n);
        failed = tsys_dist_any_failed(world, st);
    }
    m->peak = (double)tsys_mem_stats_get(ctx, dev).peak_bytes;
    if (!failed && r.tpm) failed = tsys_dist_any_failed(world, st = tsys_tp_model_time_collectives(r.tpm, o->batch, desc->context_length, dt, &m->tp_comm));
    if (!failed && r.fsdp) failed = tsys_dist_any_failed(world, st = tsys_fsdp_time_collectives(r.fsdp, l->kind == L_HSDP ? &m->tp_comm : &m->dp_comm));
    if (!failed && r.ddp) {   // DDP's own buckets, all at once (a finish with no backward before it), as tsys_dist_trainer times them
        tsys_ddp_start_step(r.ddp);
        st = tsys_ddp_finish(r.ddp);
        if (st == TSYS_OK) st = tsys_dist_sync(r.dp);
        m->dp_comm += tsys_ddp_stats_get(r.ddp).comm_ms;
        failed = tsys_dist_any_failed(world, st);
    }
    if (!failed) {   // each group's link, fitted (every rank calls both: the groups calibrate side by side)
        m->l_dp = r.dp ? tsys_dist_calibrate_link(r.dp, dev) : (tsys_dist_link_model){ 0, 0 };
        m->l_tp = r.tp ? tsys_dist_calibrate_link(r.tp, dev) : (tsys_dist_link_model){ 0, 0 };
        // FSDP's gathers and reduce-scatters (over its shard group: tp for hsdp), sequence parallelism's over tp
        tsys_dist *shards = l->kind == L_HSDP ? r.tp : l->kind == L_FSDP || l->kind == L_FSDP_TP ? r.dp : NULL, *sp = l->sp ? r.tp : NULL;
        if (shards) {
            tsys_dist_link_model *ag = shards == r.tp ? &m->l_tp_ag : &m->l_dp_ag, *rs = shards == r.tp ? &m->l_tp_rs : &m->l_dp_rs;
            *ag = tsys_dist_calibrate_link_of(shards, dev, TSYS_DIST_ALL_GATHER); *rs = tsys_dist_calibrate_link_of(shards, dev, TSYS_DIST_REDUCE_SCATTER);
        }
        if (sp && sp != shards) { m->l_tp_ag = tsys_dist_calibrate_link_of(sp, dev, TSYS_DIST_ALL_GATHER); m->l_tp_rs = tsys_dist_calibrate_link_of(sp, dev, TSYS_DIST_REDUCE_SCATTER); }
    }
    if (!failed) {
        double v[4] = { m->peak, m->tp_comm, m->dp_comm, 0 };
        tsys_dist_all_reduce_host(world, m->tm, n, TSYS_DIST_MAX);
        tsys_dist_all_reduce_host(world, v, 4, TSYS_DIST_MAX);
        m->peak = v[0]; m->tp_comm = v[1]; m->dp_comm = v[2];
        double losses[2] = { m->loss_first, m->loss_last };   // every rank of a tp group has its replica's loss
        tsys_dist_all_reduce_host(world, losses, 2, TSYS_DIST_AVG);
        m->loss_first = losses[0]; m->loss_last = losses[1];
    } else {
        double e = st == TSYS_ERR_OOM ? 1 : 0;
        tsys_dist_all_reduce_host(world, &e, 1, TSYS_DIST_MAX);
        snprintf(m->why, sizeof(m->why), "%s: %s", e > 0 ? "OOM" : "error", st != TSYS_OK ? tsys_ctx_last_error(ctx) : "on another rank");
        tsys_ctx_clear_error(ctx);
    }
    mesh_run_free(&r);
    return !failed;
}

// The plan of a row: the layout's section 8 form and the same priced on the fitted links (hsdp: FSDP over its
// shard group, then DDP's all-reduce of the shards over the replicas and DDP's gradient arena).
static void mesh_plan(const mesh_opts *o, const layout *l, const tsys_model_desc *d, tsys_dtype dt, int world, const mesh_measured *m, tsys_dist_plan *p, tsys_dist_plan *f) {
    static const tsys_dist_layout of[L_COUNT] = { TSYS_LAYOUT_TP, TSYS_LAYOUT_DP_TP, TSYS_LAYOUT_FSDP_TP, TSYS_LAYOUT_FSDP, TSYS_LAYOUT_FSDP, TSYS_LAYOUT_DP };
    const double C = o->plan_tflops * 1e12, W = o->plan_gbps * 1e9;
    const int T = d->context_length;
    tsys_dist_plan_in in;
    memset(&in, 0, sizeof(in));
    in.model = d; in.layout = of[l->kind]; in.dp = l->kind == L_HSDP ? l->split : world / l->split; in.tp = l->kind == L_HSDP ? 1 : l->split;
    in.batch = o->batch; in.context = T; in.dtype = dt; in.flops_per_s = C; in.sequence_parallel = l->sp;
    in.dp_link = in.tp_link = (tsys_dist_link_model){ 0.0, W * 1e-3 };   // section 8's form: every byte at W
    *p = tsys_dist_plan_of(&in);
    in.dp_link = l->kind == L_HSDP ? m->l_tp : m->l_dp; in.tp_link = m->l_tp;
    in.dp_gather = l->kind == L_HSDP ? m->l_tp_ag : m->l_dp_ag; in.dp_scatter = l->kind == L_HSDP ? m->l_tp_rs : m->l_dp_rs;
    in.tp_gather = m->l_tp_ag; in.tp_scatter = m->l_tp_rs;
    *f = tsys_dist_plan_of(&in);
    if (l->kind != L_HSDP) return;
    const int replicas = world / l->split;
    const tsys_dist_plan q = tsys_dist_plan_step(d, TSYS_LAYOUT_DP, replicas, 1, o->batch, T, dt, C, W),
                         qf = tsys_dist_plan_step_links(d, TSYS_LAYOUT_DP, replicas, 1, o->batch, T, dt, C, m->l_dp, m->l_dp);
    p->tp_comm_ms = p->dp_comm_ms; f->tp_comm_ms = f->dp_comm_ms;   // FSDP's, over the shard group
    p->dp_comm_ms = q.dp_comm_ms / l->split; f->dp_comm_ms = qf.dp_comm_ms / l->split;
    p->tp_sent_bytes = p->dp_sent_bytes; p->dp_sent_bytes = q.dp_sent_bytes / l->split;
    p->peak_bytes += 4.0 * (double)tsys_model_desc_num_params(d) / l->split;
}

static void fill_row(du_row *row, const mesh_opts *o, const layout *l, const tsys_model_desc *d, tsys_dtype dt, int world, const mesh_measured *m) {
    const int n = o->steps, replicas = l->kind == L_TP || l->kind == L_DP_TP || l->kind == L_FSDP_TP ? world / l->split : world;
    tsys_stats ss = tsys_stats_of(m->tm, n);
    tsys_dist_plan p, f;
    mesh_plan(o, l, d, dt, world, m, &p, &f);
    const double tokens = (double)replicas * o->batch * d->context_length;
    du_row_set(row, "tokens", "%.0f", tokens);
    du_row_num(row, "step_ms", "%.2f", ss.mean); du_row_num(row, "step_std", "%.2f", ss.std);
    du_row_num(row, "tokens_per_s", "%.0f", ss.mean > 0 ? tokens / ss.mean * 1e3 : 0);
    du_row_num(row, "peak_MiB", "%.1f", m->peak / MiB); du_row_num(row, "pred_peak_MiB", "%.1f", p.peak_bytes / MiB);
    du_row_num(row, "pred_compute_ms", "%.2f", p.compute_ms);
    const bool whole = l->kind == L_FSDP || l->kind == L_DP;   // over every rank, no inner group
    const bool has_tp = !whole && l->split > 1, has_dp = whole ? world > 1 : l->kind != L_TP && world / l->split > 1;
    if (has_tp) {
        du_row_num(row, "tp_comm_ms", "%.2f", m->tp_comm); du_row_num(row, "pred_tp_comm_ms", "%.2f", p.tp_comm_ms); du_row_num(row, "fit_tp_comm_ms", "%.2f", f.tp_comm_ms);
        du_row_num(row, "tp_alpha_ms", "%.4f", m->l_tp.alpha_ms); du_row_num(row, "tp_beta_GBps", "%.1f", m->l_tp.beta_bytes_per_ms * 1e-6);
    }
    if (has_dp) {
        du_row_num(row, "dp_comm_ms", "%.2f", m->dp_comm); du_row_num(row, "pred_dp_comm_ms", "%.2f", p.dp_comm_ms); du_row_num(row, "fit_dp_comm_ms", "%.2f", f.dp_comm_ms);
        du_row_num(row, "dp_alpha_ms", "%.4f", m->l_dp.alpha_ms); du_row_num(row, "dp_beta_GBps", "%.1f", m->l_dp.beta_bytes_per_ms * 1e-6);
    }
    du_row_num(row, "loss_first", "%.6f", m->loss_first); du_row_num(row, "loss_last", "%.6f", m->loss_last);
    du_row_set(row, "status", "ok");
}

static void run_config(tsys_ctx *ctx, tsys_dist *world, tsys_device dev, const mesh_opts *o, const char *model, int T, tsys_dtype dt, const layout *l, du_row *row) {
    const int n = tsys_dist_size(world);
    du_row_set(row, "device", "%s", dev == TSYS_CPU ? "cpu" : "cuda"); du_row_set(row, "model", "%s", model);
    du_row_set(row, "ranks", "%d", n);
    if (l->kind == L_FSDP || l->kind == L_DP) du_row_set(row, "layout", "%s", layout_names[l->kind]);
    else du_row_set(row, "layout", "%s%s:%d", layout_names[l->kind], l->sp ? "_sp" : "", l->split);
    const bool hsdp = l->kind == L_HSDP;
    if (n % l->split == 0) du_row_set(row, hsdp ? "replicate" : "dp", "%d", n / l->split);
    du_row_set(row, hsdp ? "shard" : "tp", "%d", l->split);
    du_row_set(row, "dtype", "%s", du_dtype_flag(dt)); du_row_set(row, "context", "%d", T); du_row_set(row, "batch", "%d", o->batch);
    tsys_model_desc desc;
    char err[256] = "";
    if (!du_model_config(&o->mf, model, T, du_attn_resolve(o->attn, dev, dt), &desc, err, sizeof(err))) { du_row_set(row, "status", "error: %s", err); return; }
    mesh_measured m;
    if (mesh_measure(&m, ctx, world, dev, o, l, &desc, dt)) fill_row(row, o, l, &desc, dt, n, &m);
    else du_row_set(row, "status", "%s", m.why);
    free(m.tm);
}

// Starts the ranks (or is one), runs every row; the exit code, the same on every rank.
static int run_sweep(mesh_opts *o, int argc, char **argv) {
    const bool cuda = !strcmp(o->device, "cuda");
    const tsys_device dev = cuda ? TSYS_CUDA : TSYS_CPU;
    int code = 0;
    if (tsys_dist_spawn(o->nproc, argc, argv, &code)) return code;   // this was the launcher
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_dist_desc dd;
    memset(&dd, 0, sizeof(dd));
    dd.cuda = cuda;
    tsys_dist *world = ctx ? tsys_dist_init(ctx, &dd) : NULL;
    if (!world) { fprintf(stderr, "mesh: %s\n", ctx ? tsys_ctx_last_error(ctx) : "out of memory"); tsys_ctx_free(ctx); return DU_EXIT_FAILED; }
    const int rank = tsys_dist_rank(world);
    du_rank_cpu_budget(ctx, cuda ? 0 : o->common.mem_limit, tsys_dist_local_size(world));
#ifdef TSYS_WITH_CUDA
    if (cuda && o->common.mem_limit) tsys_cuda_set_memory_limit(ctx, o->common.mem_limit);
#endif
    FILE *f = du_preamble(&o->common);
    if (rank == 0) {
        fprintf(f, "mesh: %d ranks (%s), %s", tsys_dist_size(world), tsys_dist_engine_name(tsys_dist_engine_of(world)), o->device);
#ifdef TSYS_WITH_CUDA
        if (cuda) fprintf(f, " (%s)", tsys_cuda_device_name(ctx));
#endif
        fprintf(f, ", batch %d per dp replica, warmup %d, %d steps, AdamW; plan at %g TFLOP/s and %g GB/s\n\n", o->batch, o->warmup, o->steps, o->plan_tflops, o->plan_gbps);
        fflush(f);
    }
    du_table tab;
    du_table_init(&tab, "device,model,ranks,layout,dp,tp,replicate,shard,dtype,context,batch,tokens,step_ms,step_std,tokens_per_s,peak_MiB,pred_peak_MiB,"
                        "pred_compute_ms,tp_comm_ms,pred_tp_comm_ms,fit_tp_comm_ms,dp_comm_ms,pred_dp_comm_ms,fit_dp_comm_ms,tp_alpha_ms,tp_beta_GBps,dp_alpha_ms,dp_beta_GBps,"
                        "loss_first,loss_last,status", o->common.format);
    const int nconfigs = o->mf.models.n * o->contexts.n * o->dtypes.n * o->layouts.n;
    du_progress_setup("mesh", rank == 0 ? o->common.progress : "off");
    du_progress_begin(nconfigs);
    int k = 0;
    for (int a = 0; a < o->mf.models.n; a++)
        for (int c = 0; c < o->contexts.n; c++)
            for (int t = 0; t < o->dtypes.n; t++)
                for (int y = 0; y < o->layouts.n; y++) {
                    int T = 0;
                    tsys_dtype dt = TSYS_F32;
                    layout l;
                    du_parse_int(o->contexts.item[c], 1, 1 << 20, &T); du_parse_dtype(o->dtypes.item[t], &dt); layout_parse(o->layouts.item[y], &l);   // the flags checked them
                    du_progress_config(++k, "%s T=%d %s %s", o->mf.models.item[a], T, du_dtype_flag(dt), o->layouts.item[y]);
                    run_config(ctx, world, dev, o, o->mf.models.item[a], T, dt, &l, du_table_row(&tab));
                    if (rank == 0) du_table_emit(&tab);
                }
    du_progress_end();
    double rc = rank == 0 ? du_table_exit_code(&tab, "mesh", o->common.oom_ok) : 0;
    tsys_dist_all_reduce_host(world, &rc, 1, TSYS_DIST_MAX);   // every rank exits as rank 0 does
    du_table_free(&tab);
    tsys_dist_free(world);
    tsys_ctx_free(ctx);
    return (int)rc;
}

#define SYNOPSIS "  the cs336 LM on a device mesh, a row per model x context x dtype x layout, measured beside the S26 section 8 plan"
#define EPILOGUE \
    "layouts: tp:N tensor parallelism over groups of N ranks (Megatron: heads, d_ff and the vocabulary split;\n" \
    "  every rank of a group on the same batch; several groups train independently); dp_tp:N the same with\n" \
    "  DDP over the groups; fsdp_tp:N FSDP over the groups; tp_sp:N, dp_tp_sp:N, fsdp_tp_sp:N the same with\n" \
    "  sequence parallelism (the norms on 1/N of the tokens each); hsdp:N FSDP inside groups of N ranks and DDP of\n" \
    "  the shards across them; fsdp, dp over every rank. bf16: autocast (tp, dp_tp, dp) or FSDP's compute dtype.\n" \
    "columns: tokens a step over all replicas; step_ms the slowest rank's (mean, step_std); peak_MiB the\n" \
    "  largest rank's peak during the steps, pred_peak_MiB the plan's (tsys_dist_plan.peak_bytes);\n" \
    "  pred_compute_ms the plan's matmul FLOPs at --plan-tflops; *_comm_ms the step's collectives over tp\n" \
    "  (hsdp: FSDP's over its shard group) and over dp timed alone, pred_* the section 8 form at --plan-gbps,\n" \
    "  fit_* the same collectives priced on each group's fitted link (tsys_dist_calibrate_link: *_alpha_ms a\n" \
    "  collective, *_beta_GBps the bytes a rank sends; n alpha + bytes / beta), FSDP's and sequence\n" \
    "  parallelism's all-gathers and reduce-scatters on links of their own (tsys_dist_calibrate_link_of);\n" \
    "  loss_first, loss_last the first and last step's loss averaged over the replicas.\n"

static int driver_main(int argc, char **argv) {
    mesh_opts o;
    memset(&o, 0, sizeof(o));
    o.device = du_has_cuda() ? "cuda" : "cpu";
    du_model_flags_texts(&o.mf, "presets (%s) or 'custom' with the dims below\n(default: 2.7B on cuda, small on cpu)", "a preset (%s) or 'custom'");
    du_flag flags[] = {
        DU_FLAG_CHOICE("device", &o.device, NULL, "cpu|cuda", "where each rank computes (default: cuda when a GPU is present, else cpu)"),
        DU_MODEL_FLAGS(&o.mf, NULL, du_ok_model),
        DU_FLAG_LIST_CHECKED("layout", &o.layouts, "tp:2,fsdp", layout_ok, "tp:N, dp_tp:N, fsdp_tp:N (each also _sp: tp_sp:N), hsdp:N (N from 1), fsdp or dp",
                             "the layouts (see below); N must divide the ranks"),
        DU_FLAG_LIST("dtype", &o.dtypes, "fp32", "fp32|bf16", "autocast, or FSDP's compute dtype"),
        DU_FLAG_INT("batch-size", &o.batch, "4", 1, 1 << 20, "sequences per dp replica"),
        DU_CONTEXT_FLAG(&o.contexts, "256", "context lengths"),
        DU_FLAG_CHOICE("attn", &o.attn, "auto", "naive|flash|auto", "attention (auto: flash on cuda under bf16, else naive)"),
        DU_FLAG_INT("warmup", &o.warmup, "2", 0, 1 << 20, "untimed steps first"),
        DU_FLAG_INT("steps", &o.steps, "5", 1, 1 << 20, "timed steps"),
        DU_FLAG_INT("nproc", &o.nproc, "1", 1, 1024, "start N local ranks (built-in launcher); not needed under mpirun/torchrun"),
        DU_PLAN_RATE_FLAGS(&o.plan_tflops, &o.plan_gbps, "the plan's"),
        DU_FLAG_INT("seed", &o.seed, "0", 0, 1 << 30, "weights and batch seed"),
        DU_COMMON_FLAGS(&o.common, DU_MEM_LIMIT_RANKS_TEXT),
    };
    const int nflags = (int)(sizeof(flags) / sizeof(flags[0]));
    int rc = du_flags_parse("mesh", flags, nflags, argc, argv, SYNOPSIS, EPILOGUE);
    if (rc) return rc == DU_HELP ? DU_EXIT_OK : rc;
    const bool cuda = !strcmp(o.device, "cuda");
    if (du_device_why(o.device)) {
        fprintf(stderr, "mesh: %s\n", du_device_why(o.device));
        du_flags_free(flags, nflags);
        return DU_EXIT_USAGE;
    }
    if (!o.mf.models.n && !du_split(&o.mf.models, "mesh", "--model", cuda ? "2.7B" : "small")) { du_flags_free(flags, nflags); return DU_EXIT_FAILED; }
    const long nconfigs = (long)o.mf.models.n * o.contexts.n * o.dtypes.n * o.layouts.n;
    if (nconfigs > 1000000) {
        fprintf(stderr, "mesh: the lists make %ld configurations; at most 1000000\n", nconfigs);
        rc = DU_EXIT_USAGE;
    } else if (o.common.dry_run) {
        fprintf(du_preamble(&o.common), "mesh: %d rank%s (--nproc; mpirun's or torchrun's under them), %s, batch %d per dp replica, warmup %d, %d steps, AdamW\n",
                o.nproc, o.nproc == 1 ? "" : "s", o.device, o.batch, o.warmup, o.steps);
        rc = du_dry_run_done(&o.common, "mesh", (int)nconfigs);
    } else rc = run_sweep(&o, argc, argv);
    du_flags_free(flags, nflags);
    return rc;
}

int main(int argc, char **argv) { return du_exit("mesh", driver_main(argc, argv)); }
