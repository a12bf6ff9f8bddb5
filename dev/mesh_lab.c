// mesh_lab.c - first timings of the 2-D layouts on GPUs: one training step (forward, loss, backward, AdamW)
// of a cs336 model under tensor parallelism, dp x tp (DDP), fsdp x tp, HSDP or plain FSDP / DDP, beside the
// cost model's prediction (tsys_dist_plan_step). A lab tool (public API only), not a driver: one row a run.
//
//   build: the nvcc lines at the top of dev/gpu_mesh.sh (against the one compiled tsys_impl_cuda.o)
//   mpirun -np 4 build/g8/mesh_lab LAYOUT TP MODEL CONTEXT BATCH [STEPS]
//     LAYOUT  tp | dp_tp | fsdp_tp | hsdp | fsdp | dp      (hsdp: TP is the shard group's size)
//     bf16: autocast for tp, dp_tp, hsdp's DDP side and dp; FSDP's compute dtype for fsdp, fsdp_tp, hsdp
#define TSYS_PRELUDE_DIST
#include "../drivers/prelude.h"
#include <time.h>

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static void die(tsys_ctx *ctx, const char *what) {
    fprintf(stderr, "mesh_lab: %s: %s\n", what, tsys_ctx_last_error(ctx));
    exit(1);
}

typedef struct run {
    tsys_ctx *ctx;
    tsys_dist *world;
    tsys_dist_mesh *mesh;
    tsys_model *model;
    tsys_tp_model *tpm;
    tsys_ddp *ddp;
    tsys_fsdp *fsdp;
    tsys_optim *opt;
    bool autocast;
} run;

static tsys_tensor *step_loss(run *r, tsys_tensor *ids, tsys_tensor *targets) {
    if (r->tpm) return tsys_tp_model_loss(r->tpm, ids, targets);
    tsys_tensor *logits = tsys_model_forward(r->model, ids), *loss = tsys_cross_entropy(r->ctx, logits, targets);
    tsys_tensor_release(logits);
    return loss;
}

static void step(run *r, tsys_tensor *ids, tsys_tensor *targets) {
    if (r->ddp) tsys_ddp_start_step(r->ddp);
    if (r->autocast) tsys_autocast_begin(r->ctx, TSYS_BF16);
    tsys_tensor *loss = step_loss(r, ids, targets);
    if (r->autocast) tsys_autocast_end(r->ctx);
    if (!loss || tsys_backward(r->ctx, loss) != TSYS_OK) die(r->ctx, "step");
    tsys_tensor_release(loss);
    if (r->fsdp && tsys_fsdp_finish(r->fsdp) != TSYS_OK) die(r->ctx, "fsdp finish");
    if (r->ddp && tsys_ddp_finish(r->ddp) != TSYS_OK) die(r->ctx, "ddp finish");
    if (tsys_optim_step(r->opt) != TSYS_OK) die(r->ctx, "optimizer");
    tsys_optim_release_grads(r->opt);
}

// DDP's all-reduces alone: the fp32 gradients of n parameters (their element count) over g in 100 MB buckets.
static double time_ddp_comm(tsys_ctx *ctx, tsys_dist *g, tsys_tensor **params, int n) {
    int64_t total = 0, bucket = 25 * 1000 * 1000;
    for (int i = 0; i < n; i++) total += tsys_tensor_numel(params[i]);
    tsys_tensor *b = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 1, &bucket);
    if (!b || tsys_tensor_fill(ctx, b, 0.0f) != TSYS_OK || tsys_dist_sync(g) != TSYS_OK || tsys_dist_barrier(g) != TSYS_OK) die(ctx, "ddp comm");
    double t0 = now_ms();
    for (int64_t done = 0; done < total; done += bucket) {
        int64_t k = total - done < bucket ? total - done : bucket;
        tsys_tensor *v = tsys_tensor_view_raw(ctx, b, 0, TSYS_F32, 1, &k);
        if (!v || tsys_dist_all_reduce(g, v, TSYS_DIST_AVG) != TSYS_OK) die(ctx, "ddp comm");
        tsys_tensor_release(v);
    }
    if (tsys_dist_sync(g) != TSYS_OK) die(ctx, "ddp comm");
    tsys_tensor_release(b);
    return now_ms() - t0;
}

static tsys_dist_layout layout_of(const char *s) {
    return !strcmp(s, "tp") ? TSYS_LAYOUT_TP : !strcmp(s, "dp_tp") ? TSYS_LAYOUT_DP_TP : !strcmp(s, "fsdp_tp") ? TSYS_LAYOUT_FSDP_TP
         : !strcmp(s, "fsdp") || !strcmp(s, "hsdp") ? TSYS_LAYOUT_FSDP : TSYS_LAYOUT_DP;
}

int main(int argc, char **argv) {
    if (argc < 6) { fprintf(stderr, "usage: mesh_lab tp|dp_tp|fsdp_tp|hsdp|fsdp|dp TP MODEL CONTEXT BATCH [STEPS]\n"); return 2; }
    const char *layout = argv[1], *model = argv[3];
    const int tp = atoi(argv[2]), T = atoi(argv[4]), B = atoi(argv[5]), steps = argc > 6 ? atoi(argv[6]) : 5;
    run r;
    memset(&r, 0, sizeof r);
    r.ctx = tsys_ctx_new(NULL);
    tsys_dist_desc dd;
    memset(&dd, 0, sizeof dd);
    dd.cuda = true;
    r.world = tsys_dist_init(r.ctx, &dd);
    if (!r.world) die(r.ctx, "group");
    const int n = tsys_dist_size(r.world), rank = tsys_dist_rank(r.world);
    if (tp < 1 || n % tp || T < 1 || B < 1 || steps < 1) { fprintf(stderr, "mesh_lab: TP %d must divide the %d ranks; CONTEXT, BATCH, STEPS >= 1\n", tp, n); return 2; }
    int shape[2] = { n / tp, tp };
    const char *names[2] = { "dp", "tp" };
    r.mesh = tsys_dist_mesh_new(r.world, 2, shape, names);
    if (!r.mesh) die(r.ctx, "mesh");
    tsys_dist *g_dp = tsys_dist_mesh_group(r.mesh, "dp"), *g_tp = tsys_dist_mesh_group(r.mesh, "tp");
    tsys_model_desc d;
    char err[200];
    if (tsys_model_desc_preset(model, &d, err, sizeof err) != TSYS_OK) { fprintf(stderr, "mesh_lab: %s\n", err); return 2; }
    d.context_length = T;
    d.attn = "flash";
    r.model = tsys_model_new(r.ctx, &d, TSYS_CUDA, 1);
    if (!r.model) die(r.ctx, "model");
    tsys_fsdp_desc fd;
    memset(&fd, 0, sizeof fd);
    fd.compute_dtype = TSYS_BF16;
    tsys_ddp_desc ddp;
    memset(&ddp, 0, sizeof ddp);
    ddp.strategy = TSYS_DDP_BUCKETED;
    ddp.bucket_mb = 100;
    tsys_tensor **params = tsys_model_params(r.model);
    int np = tsys_model_num_tensors(r.model);
    const bool with_tp = !strcmp(layout, "tp") || !strcmp(layout, "dp_tp") || !strcmp(layout, "fsdp_tp");
    if (with_tp) {
        r.tpm = tsys_tp_model_new(g_tp, r.model);
        if (!r.tpm) die(r.ctx, "tp model");
        tsys_model_free(r.model);   // the shards are copies
        r.model = NULL;
        params = tsys_tp_model_params(r.tpm);
        np = tsys_tp_model_num_tensors(r.tpm);
    }
    if (!strcmp(layout, "fsdp_tp") || !strcmp(layout, "fsdp")) r.fsdp = tsys_fsdp_new(!strcmp(layout, "fsdp") ? r.world : g_dp, params, np, &fd);
    else if (!strcmp(layout, "hsdp")) r.fsdp = tsys_fsdp_new(g_tp, params, np, &fd);   // the shard group; DDP over the replicas below
    if ((r.fsdp == NULL) != (strcmp(layout, "fsdp_tp") && strcmp(layout, "fsdp") && strcmp(layout, "hsdp"))) die(r.ctx, "fsdp");
    if (r.fsdp) { params = tsys_fsdp_params(r.fsdp); np = tsys_fsdp_num_params(r.fsdp); }
    if (!strcmp(layout, "dp_tp") || !strcmp(layout, "dp") || !strcmp(layout, "hsdp")) {
        ddp.strategy = !strcmp(layout, "hsdp") ? TSYS_DDP_FLAT : TSYS_DDP_BUCKETED;
        r.ddp = tsys_ddp_new(!strcmp(layout, "dp") ? r.world : g_dp, params, np, &ddp);
        if (!r.ddp) die(r.ctx, "ddp");
    }
    r.autocast = !r.fsdp;
    r.opt = tsys_adamw_new(r.ctx, params, np, NULL);
    if (!r.opt) die(r.ctx, "optimizer");
    int64_t bt[2] = { B, T };
    tsys_tensor *ids = tsys_tensor_new(r.ctx, TSYS_I32, TSYS_CUDA, 2, bt), *targets = tsys_tensor_new(r.ctx, TSYS_I32, TSYS_CUDA, 2, bt);
    tsys_tensor_randint(r.ctx, ids, d.vocab_size);
    tsys_tensor_randint(r.ctx, targets, d.vocab_size);
    for (int s = 0; s < 2; s++) step(&r, ids, targets);
    if (tsys_dist_sync(r.world) != TSYS_OK || tsys_dist_barrier(r.world) != TSYS_OK) die(r.ctx, "warmup");
    double t0 = now_ms();
    for (int s = 0; s < steps; s++) step(&r, ids, targets);
    if (tsys_dist_sync(r.world) != TSYS_OK) die(r.ctx, "sync");
    double ms[4] = { (now_ms() - t0) / steps, (double)tsys_mem_stats_get(r.ctx, TSYS_CUDA).peak_bytes, 0, 0 };
    // the communication alone: over tp (its all-reduces), over dp (FSDP's collectives, or DDP's all-reduces)
    if (r.tpm && tsys_tp_model_time_collectives(r.tpm, B, T, TSYS_BF16, &ms[2]) != TSYS_OK) die(r.ctx, "tp comm");
    if (r.fsdp && tsys_fsdp_time_collectives(r.fsdp, &ms[3]) != TSYS_OK) die(r.ctx, "fsdp comm");
    if (r.ddp) ms[3] += time_ddp_comm(r.ctx, !strcmp(layout, "dp") ? r.world : g_dp, params, np);
    tsys_dist_all_reduce_host(r.world, ms, 4, TSYS_DIST_MAX);
    // each group's link, fitted (every rank of the world calls both: the groups calibrate side by side)
    const tsys_dist_link_model l_dp = tsys_dist_calibrate_link(!strcmp(layout, "fsdp") || !strcmp(layout, "dp") ? r.world : g_dp, TSYS_CUDA);
    const tsys_dist_link_model l_tp = tsys_dist_calibrate_link(g_tp, TSYS_CUDA);
    const int ndp = with_tp || !strcmp(layout, "hsdp") ? n / tp : n, ntp = with_tp ? tp : 1;
    // hsdp: FSDP's traffic over its shard group (the "tp" dimension here), then DDP's of the shards over the replicas
    const int plan_dp = !strcmp(layout, "hsdp") ? tp : ndp;
    tsys_dist_plan p = tsys_dist_plan_step(&d, layout_of(layout), plan_dp, ntp, B, T, TSYS_BF16, 650e12, 340e9);
    tsys_dist_plan f = tsys_dist_plan_step_links(&d, layout_of(layout), plan_dp, ntp, B, T, TSYS_BF16, 650e12, !strcmp(layout, "hsdp") ? l_tp : l_dp, l_tp);
    if (!strcmp(layout, "hsdp")) {   // + DDP's all-reduce of the shards over the replicas, and its fp32 gradient arena
        tsys_dist_plan q = tsys_dist_plan_step(&d, TSYS_LAYOUT_DP, n / tp, 1, B, T, TSYS_BF16, 650e12, 340e9), qf = tsys_dist_plan_step_links(&d, TSYS_LAYOUT_DP, n / tp, 1, B, T, TSYS_BF16, 650e12, l_dp, l_dp);
        p.dp_comm_ms += q.dp_comm_ms / tp;
        f.dp_comm_ms += qf.dp_comm_ms / tp;
        f.tp_comm_ms = p.tp_comm_ms = 0;
        p.peak_bytes += 4.0 * (double)tsys_model_desc_num_params(&d) / tp;
    }
    if (rank == 0)
        printf("| %s | %d | %d | %s | %d | %d | %.1f | %.0f | %.0f | %.1f | %.1f / %.1f / %.1f | %.1f / %.1f / %.1f | %.3f+%.0f / %.3f+%.0f |\n", layout, !strcmp(layout, "hsdp") ? n / tp : ndp,
               !strcmp(layout, "hsdp") ? tp : ntp, model, T, B, ms[0], ms[1] / 1048576.0, p.peak_bytes / 1048576.0, p.compute_ms, p.tp_comm_ms, f.tp_comm_ms, ms[2], p.dp_comm_ms, f.dp_comm_ms, ms[3],
               l_dp.alpha_ms, l_dp.beta_bytes_per_ms * 1e-6, l_tp.alpha_ms, l_tp.beta_bytes_per_ms * 1e-6);
    tsys_tensor_release(ids); tsys_tensor_release(targets);
    tsys_optim_free(r.opt);
    tsys_ddp_free(r.ddp);
    tsys_fsdp_free(r.fsdp);
    tsys_tp_model_free(r.tpm);
    tsys_model_free(r.model);
    tsys_dist_mesh_free(r.mesh);
    tsys_dist_free(r.world);
    tsys_ctx_free(r.ctx);
    return 0;
}
