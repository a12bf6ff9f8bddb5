// ddp - data-parallel training of the cs336 Transformer LM (tsys_dist_trainer): the CS336 naive, flat,
// overlap and bucketed DDP benchmarks, ZeRO-1 and its accounting, and the S26 fsdp ones (--strategy fsdp),
// a row per configuration with the accounting's prediction beside what was measured. Every rank trains on
// its own batch; only rank 0 prints. Times are the slowest rank's, mean (and std) over the timed steps.
//
//   ddp --nproc 2 --model small --strategy naive,flat,overlap,bucketed,zero1 --bucket-mb 1,10,100,1000
//   mpirun -np 2 ddp --device cuda --model xl --dtype fp32,bf16 --compile no,yes
//   ddp --account --model xl --nproc 2          (the prediction table only, nothing runs)
//   ddp --plan --model xl --nproc 4 --dtype bf16  (the S26 section 8 cost model of dp, fsdp, tp and 2-D layouts)
#define _POSIX_C_SOURCE 200809L   // clock_gettime, dup (driver_util.h)
#include <ctype.h>
#define TSYS_PRELUDE_DIST
#include "prelude.h"
#include "driver_util.h"
#include "account_table.h"
#include "profile_files.h"
#include "ddp_measure.h"

typedef struct ddp_opts {
    du_common common;
    const char *device, *attn, *checkpoint, *loss, *reshard, *save_dir, *resume, *profile, *lowp_copies, *lowp_grads, *in_backward, *shard;
    du_model_flags mf;      // --model and the explicit dims (over the preset's)
    du_list strategies, buckets, comms, dtypes, contexts, compiles;
    int batch, warmup, steps, nproc, seed, save_every;
    bool account, plan, no_compute_ref;
    double plan_tflops, plan_gbps;
    FILE *profile_log;      // the paths of each profiled configuration's files, printed after the table (rank 0)
} ddp_opts;

typedef enum { S_NAIVE, S_FLAT, S_OVERLAP, S_BUCKETED, S_ZERO1, S_FSDP } strat;
static const char *const strat_names[] = {"naive", "flat", "overlap", "bucketed", "zero1", "fsdp"};
static const tsys_ddp_strategy strat_ddp[] = {TSYS_DDP_NAIVE, TSYS_DDP_FLAT, TSYS_DDP_OVERLAP, TSYS_DDP_BUCKETED, TSYS_DDP_BUCKETED, TSYS_DDP_FLAT};
static const double MiB = 1048576.0;

// One row of the sweep.
typedef struct config { const char *model; int T; tsys_dtype dt; strat s; double bucket_mb; bool comm_bf16, gather, compiled; } config;

// FSDP's rows of --grad-comm: NCCL's collectives for fp32 and bf16 (one row: its units travel in the compute dtype
// either way), then the copy engines' pulls and pushes for gather (tsys_fsdp_desc.ce_transfers); into ce[].
static int fsdp_comms(const ddp_opts *o, bool ce[2]) {
    bool nccl = false, gather = false;
    for (int i = 0; i < o->comms.n; i++) { if (!strcmp(o->comms.item[i], "gather")) gather = true; else nccl = true; }
    int n = 0;
    if (nccl) ce[n++] = false;
    if (gather) ce[n++] = true;
    return n;
}

// The rows in their order (models, contexts, dtypes, strategies, bucket sizes of bucketed and zero1,
// --grad-comm (fsdp: fsdp_comms), --compile): how many; the one numbered `want` (0-based) into *out.
static long list_configs(const ddp_opts *o, long want, config *out) {
    long n = 0;
    for (int a = 0; a < o->mf.models.n; a++)
        for (int c = 0; c < o->contexts.n; c++)
            for (int t = 0; t < o->dtypes.n; t++)
                for (int k = 0; k < o->strategies.n; k++) {
                    strat s = S_NAIVE;
                    while (strcmp(strat_names[s], o->strategies.item[k])) s = (strat)(s + 1);   // the table checked it
                    const bool bucketed = s == S_BUCKETED || s == S_ZERO1;
                    bool ce[2];
                    const int ncomms = s == S_FSDP ? fsdp_comms(o, ce) : o->comms.n;
                    for (int b = 0; b < (bucketed ? o->buckets.n : 1); b++)
                        for (int g = 0; g < ncomms * o->compiles.n; g++, n++) {   // each --grad-comm with each --compile
                            if (n != want) continue;
                            out->model = o->mf.models.item[a]; out->s = s; out->bucket_mb = 0; out->compiled = !strcmp(o->compiles.item[g % o->compiles.n], "yes");
                            out->comm_bf16 = s != S_FSDP && !strcmp(o->comms.item[g / o->compiles.n], "bf16");
                            out->gather = s == S_FSDP ? ce[g / o->compiles.n] : !strcmp(o->comms.item[g / o->compiles.n], "gather");
                            du_parse_int(o->contexts.item[c], 1, 1 << 20, &out->T); du_parse_dtype(o->dtypes.item[t], &out->dt);
                            if (bucketed) du_parse_double(o->buckets.item[b], &out->bucket_mb);
                        }
                }
    return n;
}

static tsys_fsdp_desc fsdp_desc(const ddp_opts *o, tsys_dtype dt) {
    tsys_fsdp_desc fd = {dt, false, !strcmp(o->reshard, "yes") ? TSYS_FSDP_RESHARD_YES : !strcmp(o->reshard, "no") ? TSYS_FSDP_RESHARD_NO
                                                                                                       : TSYS_FSDP_RESHARD_AUTO, false};
    return fd;
}

// The model and FSDP's settings of one model, context and dtype; false after err (the account_desc_fn of
// --account's account_table_print too).
static bool config_desc(const void *user, const char *model, int T, tsys_dtype dt, tsys_model_desc *d, tsys_fsdp_desc *fd, char *err, size_t len) {
    const ddp_opts *o = (const ddp_opts *)user;
    *fd = fsdp_desc(o, dt);
    const char *attn = du_attn_resolve(o->attn, strcmp(o->device, "cuda") ? TSYS_CPU : TSYS_CUDA, dt);
    if (!du_model_config(&o->mf, model, T, attn, d, err, len)) return false;
    d->checkpoint = o->checkpoint;
    tsys_checkpoint_policy p;
    return tsys_checkpoint_policy_parse(o->checkpoint, d->num_layers, &p, err, len) == TSYS_OK;
}

// ---- one configuration -------------------------------------------------------------------------------

// ZeRO-1 with AdamW inside backward (gathered gradients): the gathered DDP whose buckets are each updated by their
// owner, which alone keeps their moments (tsys_ddp_desc.shard_updates, shard_state).
static bool zero1_owners(const ddp_opts *o, const config *cf) { return cf->s == S_ZERO1 && cf->gather && !strcmp(o->in_backward, "yes"); }

// What a configuration trains: the trainer's settings.
static tsys_dist_trainer_desc trainer_desc(const ddp_opts *o, const config *cf) {
    const strat s = cf->s;
    const bool owners = zero1_owners(o, cf);
    tsys_dist_trainer_desc td;
    memset(&td, 0, sizeof(td));
    td.mode = s == S_FSDP ? TSYS_TRAIN_FSDP : s == S_ZERO1 && !owners ? TSYS_TRAIN_ZERO1 : TSYS_TRAIN_DDP;
    td.ddp.strategy = owners ? TSYS_DDP_BUCKETED : strat_ddp[s]; td.ddp.bucket_mb = cf->bucket_mb; td.ddp.comm_bf16 = cf->comm_bf16;
    td.ddp.ce_gather = cf->gather && s != S_FSDP;
    td.fsdp = fsdp_desc(o, cf->dt); td.autocast = cf->dt;
    td.fsdp.ce_transfers = cf->gather && s == S_FSDP;
    td.loss_scale = !strcmp(o->loss, "sum") ? (float)((double)o->batch * cf->T) : 1.0f;   // the summed loss: the mean times the tokens
    td.save_dir = o->save_dir; td.save_every = o->save_every;
    td.lowp_copies = !strcmp(o->lowp_copies, "yes"); td.lowp_grads = !strcmp(o->lowp_grads, "yes"); td.opt_in_backward = !strcmp(o->in_backward, "yes");
    td.ddp.shard_updates = (strcmp(o->shard, "no") && s == S_BUCKETED && cf->gather) || owners;
    td.ddp.shard_masters = td.ddp.shard_updates && !strcmp(o->shard, "masters");
    td.ddp.shard_state = owners;
    return td;
}

// The predictions and measurements (ddp_measure's) of an ok row: the model desc, FSDP's settings fd.
static void fill_measured(du_row *row, const ddp_opts *o, const config *cf, const tsys_model_desc *desc, const tsys_fsdp_desc *fd, int world,
                          const ddp_measured *m, double compute_ms, tsys_dist_link_model link, tsys_fsdp_links fsdp_links) {
    const int n = o->steps;
    const strat s = cf->s;
    const double *tm = m->tm, alone = m->alone;
    const tsys_ddp_stats ds = m->ds;
    tsys_stats ss = tsys_stats_of(tm, n), sb = tsys_stats_of(tm + n, n), so = tsys_stats_of(tm + 2 * n, n), se = tsys_stats_of(tm + 3 * n, n);
    du_row_num(row, "step_ms", "%.2f", ss.mean); du_row_num(row, "step_std", "%.2f", ss.std);
    du_row_num(row, "bwd_comm_ms", "%.2f", sb.mean); du_row_num(row, "opt_ms", "%.2f", so.mean); du_row_num(row, "comm_ms", "%.2f", alone);
    const double pred = s == S_FSDP && cf->gather ? NAN   // the copy engines' pulls and pushes: not priced
                        : s == S_FSDP ? tsys_fsdp_link_time_ms(&m->fst, world, fsdp_links)
                        : cf->gather ? m->pred_pull_ms
                        : tsys_dist_link_time_ms(link, ds.num_buckets, tsys_dist_ring_sent(world, (double)ds.bytes_per_step));
    if (!isnan(pred)) du_row_num(row, "pred_comm_ms", "%.2f", pred);
    if (cf->gather && m->pulls.all.beta_bytes_per_ms > 0) {   // the links the pulls were predicted on
        du_row_num(row, "pull_us", "%.1f", m->pulls.all.alpha_ms * 1e3); du_row_num(row, "pull_GBps", "%.1f", m->pulls.all.beta_bytes_per_ms * 1e-6);
        du_row_num(row, "pull_one_GBps", "%.1f", m->pulls.one.beta_bytes_per_ms * 1e-6);
    }
    du_row_num(row, "comm_frac", "%.3f", ss.mean > 0 ? alone / ss.mean : 0);
    if (!isnan(se.mean)) {   // --no-compute-ref: nothing to compare with
        double hidden = alone > 0 ? 1.0 - se.mean / alone : 0;
        du_row_num(row, "exposed_ms", "%.2f", se.mean); du_row_num(row, "hidden", "%.2f", hidden < 0 ? 0 : hidden > 1 ? 1 : hidden);
    }
    du_row_num(row, "compute_ms", "%.2f", compute_ms);
    du_row_set(row, "buckets", "%d", s == S_FSDP ? m->fst.num_units : ds.num_buckets);
    if (s != S_FSDP) du_row_set(row, "copied_buckets", "%d", ds.copied_buckets);
    du_row_num(row, "MB_per_step", "%.1f", (s == S_FSDP ? (double)(m->fst.gathered_bytes + m->fst.reduced_bytes) : (double)ds.bytes_per_step) / 1e6);
    du_row_num(row, "mem_init_MiB", "%.1f", m->mem[0] / MiB); du_row_num(row, "mem_pre_opt_MiB", "%.1f", m->mem[1] / MiB);
    du_row_num(row, "mem_post_opt_MiB", "%.1f", m->mem[2] / MiB); du_row_num(row, "state_MiB", "%.1f", m->mem[3] / MiB);
    account_predicted(row, desc, cf->dt, cf->T, o->batch, world, s == S_FSDP, fd, s == S_ZERO1 ? TSYS_SCHEME_ZERO1 : TSYS_SCHEME_DDP, cf->comm_bf16, cf->gather && s != S_FSDP,
                      zero1_owners(o, cf),
                      (!strcmp(o->lowp_copies, "yes") ? TSYS_PLAN_KEPT_COPIES : 0u) | (!strcmp(o->lowp_grads, "yes") ? TSYS_PLAN_LOWP_GRADS : 0u));
    du_row_set(row, "status", "ok");
}

// Why --lowp-copies / --lowp-grads / --opt-in-backward do not apply to a configuration (NULL: they do, or are off).
static const char *lowp_skip(const ddp_opts *o, const config *cf, const tsys_dist *d, tsys_device dev) {
    if (strcmp(o->shard, "no") && ((cf->s != S_BUCKETED && cf->s != S_ZERO1) || !cf->gather || strcmp(o->in_backward, "yes")))
        return "--shard-updates needs --strategy bucketed or zero1, --grad-comm gather, --opt-in-backward yes";
    if (!strcmp(o->shard, "masters") && strcmp(o->lowp_copies, "yes")) return "--shard-updates masters needs --lowp-copies yes";
    const bool owners = zero1_owners(o, cf);
    if (cf->s == S_FSDP && cf->gather) {   // tsys_fsdp_desc.ce_transfers
        if (tsys_dist_size(d) < 2) return "--strategy fsdp --grad-comm gather needs 2 or more ranks (a group of one moves nothing)";
        if (strcmp(o->in_backward, "yes") || strcmp(o->reshard, "no"))
            return "--strategy fsdp --grad-comm gather needs --opt-in-backward yes and --fsdp-reshard no (each unit updated inside backward, its weights kept)";
        if (dev != TSYS_CUDA || tsys_dist_engine_of(d) != TSYS_DIST_ENGINE_NCCL) return "--strategy fsdp --grad-comm gather needs --device cuda with NCCL";
    }
    if (!strcmp(o->in_backward, "yes") && cf->s != S_FSDP) {   // FSDP's units are summed on the compute stream: any device, any engine
        if (cf->s == S_ZERO1 && !owners) return "--opt-in-backward under zero1 needs --grad-comm gather (each bucket's owner updates it inside backward)";
        if (cf->s != S_BUCKETED && cf->s != S_OVERLAP && !owners) return "--opt-in-backward needs a strategy that sends gradients during backward (bucketed, overlap)";
        if (dev != TSYS_CUDA || (tsys_dist_engine_of(d) != TSYS_DIST_ENGINE_NCCL && tsys_dist_size(d) > 1)) return "--opt-in-backward needs --device cuda with NCCL";
    }
    const bool copies = !strcmp(o->lowp_copies, "yes"), grads = !strcmp(o->lowp_grads, "yes");
    if (!copies && !grads) return NULL;
    if (cf->dt == TSYS_F32) return "--lowp-copies and --lowp-grads apply under --dtype bf16";
    if (cf->s == S_FSDP) return "--lowp-copies and --lowp-grads are for the DDP strategies and ZeRO-1";
    if (copies && cf->s == S_ZERO1 && !owners) return "--lowp-copies is for the DDP strategies and zero1 with --opt-in-backward yes (ZeRO-1's AdamW holds only its own parameters)";
    if (grads && !cf->gather && tsys_dist_size(d) > 1) return "--lowp-grads needs --grad-comm gather (AdamW sums the ranks' bf16 gradients in fp32)";
    return NULL;
}

// The configuration of a row as a file name (--profile's): "cuda_xl_T256_bf16_fsdp_2ranks", then
// "_bucket-<MB>", "_grad-bf16", "_lowp-copies", "_lowp-grads", "_opt-in-bwd", "_compiled", "_ckpt-<policy>[-auto]" where they apply.
static void profile_name(char *name, size_t len, const du_row *row, int world) {
    char ckpt[80] = "", bucket[48] = "";
    const char *policy = du_row_get(row, "ckpt"), *chosen = strstr(policy, " (auto)");   // auto's choice: "<policy>-auto"
    if (strcmp(policy, "none")) snprintf(ckpt, sizeof(ckpt), "_ckpt-%.*s%s", chosen ? (int)(chosen - policy) : (int)strlen(policy), policy, chosen ? "-auto" : "");
    if (*du_row_get(row, "bucket_mb")) snprintf(bucket, sizeof(bucket), "_bucket-%s", du_row_get(row, "bucket_mb"));
    snprintf(name, len, "%s_%s_T%s_%s_%s_%dranks%s%s%s%s%s%s%s", du_row_get(row, "device"), du_row_get(row, "model"), du_row_get(row, "context"),
             du_row_get(row, "dtype"), du_row_get(row, "strategy"), world, bucket, !strcmp(du_row_get(row, "grad_comm"), "bf16") ? "_grad-bf16" : "",
             strcmp(du_row_get(row, "lowp_copies"), "yes") ? "" : "_lowp-copies", strcmp(du_row_get(row, "lowp_grads"), "yes") ? "" : "_lowp-grads",
             strcmp(du_row_get(row, "opt_in_bwd"), "yes") ? "" : "_opt-in-bwd",
             strcmp(du_row_get(row, "compiled"), "yes") ? "" : "_compiled", ckpt);
    for (char *c = name; *c; c++) if (!isalnum((unsigned char)*c) && *c != '_' && *c != '-' && *c != '.') *c = '-';
}

// --checkpoint auto:BYTES: the policy with the least recomputation whose predicted peak a rank fits
// BYTES under this configuration's strategy and world (tsys_dist_checkpoint_auto) goes into desc, and
// the row says "<policy> (auto)". When nothing fits, the least peak runs (out of memory is then the
// row's, if it happens). False, with the row's status, when the budget cannot be read.
static bool resolve_auto(const ddp_opts *o, const config *cf, const tsys_dist *d, tsys_model_desc *desc, const tsys_fsdp_desc *fd, char *policy, size_t len,
                         du_row *row) {
    tsys_checkpoint_policy p;
    if (tsys_checkpoint_policy_parse(o->checkpoint, desc->num_layers, &p, NULL, 0) != TSYS_OK || p.budget <= 0) return true;
    const tsys_dist_scheme scheme = cf->s == S_FSDP ? TSYS_SCHEME_ZERO3 : cf->s == S_ZERO1 ? TSYS_SCHEME_ZERO1 : TSYS_SCHEME_DDP;
    double peak = 0;
    tsys_status st = tsys_dist_checkpoint_auto(desc, cf->s == S_FSDP ? fd : NULL, scheme, cf->dt, o->batch, cf->T, tsys_dist_size(d), p.budget, policy, len, &peak);
    if (st != TSYS_OK && st != TSYS_ERR_OOM) { du_row_set(row, "status", "error: %s: no plan for this configuration", o->checkpoint); return false; }
    desc->checkpoint = policy;
    du_row_set(row, "ckpt", "%s (auto)", policy);
    if (st == TSYS_ERR_OOM && tsys_dist_rank(d) == 0)
        fprintf(stderr, "ddp: %s: no policy fits; %s has the least predicted peak (%.1f MiB a rank)\n", o->checkpoint, policy, peak / MiB);
    return true;
}

// Runs one configuration on every rank and fills its row (rank 0 prints it).
static void run_config(tsys_ctx *ctx, tsys_dist *d, tsys_device dev, const ddp_opts *o, const config *cf, tsys_dist_link_model link, tsys_fsdp_links fsdp_links,
                       du_row *row) {
    const strat s = cf->s;
    du_row_set(row, "device", "%s", dev == TSYS_CPU ? "cpu" : "cuda"); du_row_set(row, "model", "%s", cf->model);
    du_row_set(row, "ranks", "%d", tsys_dist_size(d));
    const char *reshard = s != S_FSDP || !strcmp(o->reshard, "auto") ? "" : !strcmp(o->reshard, "yes") ? ":reshard" : ":keep";
    du_row_set(row, "strategy", "%s%s", strat_names[s], reshard);
    if (s == S_BUCKETED || s == S_ZERO1) du_row_set(row, "bucket_mb", "%g", cf->bucket_mb);
    if (s == S_FSDP && cf->gather) du_row_set(row, "grad_comm", "gather");   // the units on the copy engines
    if (s != S_FSDP) du_row_set(row, "grad_comm", "%s", cf->comm_bf16 ? "bf16" : cf->gather && !strcmp(o->shard, "yes") ? "gather+shard"
                                                    : cf->gather && !strcmp(o->shard, "masters") ? "gather+masters"
                                                    : zero1_owners(o, cf) ? "gather+owners" : cf->gather ? "gather" : "fp32");
    du_row_set(row, "dtype", "%s", du_dtype_flag(cf->dt)); du_row_set(row, "context", "%d", cf->T); du_row_set(row, "compiled", "%s", cf->compiled ? "yes" : "no");
    du_row_set(row, "batch", "%d", o->batch); du_row_set(row, "ckpt", "%s", o->checkpoint); du_row_set(row, "loss", "%s", o->loss);
    du_row_set(row, "lowp_copies", "%s", o->lowp_copies); du_row_set(row, "lowp_grads", "%s", o->lowp_grads);
    if (cf->compiled && ddp_compile_skip(d, dev)) { du_row_set(row, "status", "skipped: %s", ddp_compile_skip(d, dev)); return; }
    du_row_set(row, "opt_in_bwd", "%s", o->in_backward);
    if (lowp_skip(o, cf, d, dev)) { du_row_set(row, "status", "skipped: %s", lowp_skip(o, cf, d, dev)); return; }
    tsys_model_desc desc;
    tsys_fsdp_desc fd;
    char err[256] = "";
    if (!config_desc(o, cf->model, cf->T, cf->dt, &desc, &fd, err, sizeof(err))) { du_row_set(row, "status", "error: %s", err); return; }
    fd.ce_transfers = s == S_FSDP && cf->gather;
    char policy[64];
    if (!resolve_auto(o, cf, d, &desc, &fd, policy, sizeof(policy), row)) return;
    const tsys_dist_trainer_desc td = trainer_desc(o, cf);
    char name[256];
    profile_name(name, sizeof(name), row, tsys_dist_size(d));
    const ddp_steps steps = {o->batch, o->seed, o->warmup, o->steps, o->resume, cf->compiled, o->profile, name, o->profile_log};
    double compute_ms = NAN;
    if (s == S_FSDP && !o->no_compute_ref)   // the compute alone first (its memory is gone before the peaks are reset)
        compute_ms = ddp_plain_step_ms(ctx, d, dev, &steps, &desc, td);
    ddp_measured m;
    if (ddp_measure(&m, ctx, d, dev, &steps, &desc, &td, s == S_FSDP, compute_ms))
        fill_measured(row, o, cf, &desc, &fd, tsys_dist_size(d), &m, compute_ms, link, fsdp_links);
    else du_row_set(row, "status", "%s", m.why);
    free(m.tm);
}

// Starts the ranks (or is one), runs every configuration; the exit code, the same on every rank.
static int run_sweep(ddp_opts *o, int nconfigs, int argc, char **argv) {
    const bool cuda = !strcmp(o->device, "cuda");
    const tsys_device dev = cuda ? TSYS_CUDA : TSYS_CPU;
    int code = 0;
    if (tsys_dist_spawn(o->nproc, argc, argv, &code)) return code;   // this was the launcher
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_dist_desc dd;
    memset(&dd, 0, sizeof(dd));
    dd.cuda = cuda;
    tsys_dist *d = ctx ? tsys_dist_init(ctx, &dd) : NULL;
    if (!d) { fprintf(stderr, "ddp: %s\n", ctx ? tsys_ctx_last_error(ctx) : "out of memory"); tsys_ctx_free(ctx); return DU_EXIT_FAILED; }
    const int rank = tsys_dist_rank(d);
    double no_profile = rank == 0 && o->profile && !du_profile_open("ddp", o->profile, &o->profile_log);
    tsys_dist_all_reduce_host(d, &no_profile, 1, TSYS_DIST_MAX);   // every rank stops when rank 0 cannot profile
    if (no_profile > 0) { tsys_dist_free(d); tsys_ctx_free(ctx); return DU_EXIT_FAILED; }
    // the ranks on this host share its memory: each gets its part as its CPU budget (or --mem-limit);
    // on cuda, --mem-limit caps each rank's device instead
    size_t cpu_budget = du_rank_cpu_budget(ctx, cuda ? 0 : o->common.mem_limit, tsys_dist_local_size(d));
    FILE *f = du_preamble(&o->common);
    char lim[160];
    if (rank == 0) {
        fprintf(f, "ddp: %d ranks (%s), %s", tsys_dist_size(d), tsys_dist_engine_name(tsys_dist_engine_of(d)), o->device);
#ifdef TSYS_WITH_CUDA
        if (cuda) fprintf(f, " (%s)", tsys_cuda_device_name(ctx));
#endif
        if (tsys_dist_get_desc(d).ce_allreduce)   // not in mem_* nor pred_*: the group's own, like NCCL's buffers
            fprintf(f, ", fp32 all-reduces on the copy engines (%.0f MiB of scratch a rank)", (double)tsys_dist_device_bytes(d) / 1048576.0);
        if (!cuda) fprintf(f, ", %d threads per rank", du_num_threads());
        fprintf(f, ", batch %d per rank, warmup %d, %d steps, AdamW; cpu memory budget %s", o->batch, o->warmup, o->steps,
                du_rank_budget_str(lim, sizeof(lim), cpu_budget, cuda ? 0 : o->common.mem_limit, tsys_dist_local_size(d)));
        if (cuda)
            fprintf(f, "; device memory %s", o->common.mem_limit ? du_mem_limit_str(lim, sizeof(lim), o->common.mem_limit) : "the whole device");
        fprintf(f, "\n");
    }
#ifdef TSYS_WITH_CUDA
    if (cuda && o->common.mem_limit) tsys_cuda_set_memory_limit(ctx, o->common.mem_limit);
#endif
    const tsys_dist_link_model link = tsys_dist_calibrate_link(d, dev);
    if (rank == 0 && link.beta_bytes_per_ms > 0)
        fprintf(f, "link model (all-reduces back to back, 20 of 64 KiB and 4 of %d MiB, medians): %.1f us a collective + bytes sent a rank at %.2f GB/s\n",
                cuda ? 64 : 8, link.alpha_ms * 1e3, link.beta_bytes_per_ms * 1e-6);
    tsys_fsdp_links fsdp_links = {link, link, link};
    if (du_list_has(&o->strategies, "fsdp")) {   // FSDP's collectives, each kind on its own link
        fsdp_links.all_gather = tsys_dist_calibrate_link_of(d, dev, TSYS_DIST_ALL_GATHER);
        fsdp_links.reduce_scatter = tsys_dist_calibrate_link_of(d, dev, TSYS_DIST_REDUCE_SCATTER);
        if (rank == 0 && fsdp_links.all_gather.beta_bytes_per_ms > 0 && fsdp_links.reduce_scatter.beta_bytes_per_ms > 0)
            fprintf(f, "fsdp's links (the same sizes, bytes sent a rank): all-gathers %.1f us + %.2f GB/s, reduce-scatters %.1f us + %.2f GB/s\n",
                    fsdp_links.all_gather.alpha_ms * 1e3, fsdp_links.all_gather.beta_bytes_per_ms * 1e-6, fsdp_links.reduce_scatter.alpha_ms * 1e3,
                    fsdp_links.reduce_scatter.beta_bytes_per_ms * 1e-6);
    }
    if (rank == 0) { fprintf(f, "\n"); fflush(f); }
    du_table tab;
    du_table_init(&tab, "device,model,ranks,strategy,bucket_mb,grad_comm,dtype,context,batch,ckpt,loss,compiled,lowp_copies,lowp_grads,opt_in_bwd,step_ms,step_std,bwd_comm_ms,opt_ms,comm_ms,"
                        "pred_comm_ms,pull_us,pull_GBps,pull_one_GBps,comm_frac,exposed_ms,hidden,compute_ms,buckets,copied_buckets,MB_per_step,mem_init_MiB,mem_pre_opt_MiB,"
                        "mem_post_opt_MiB,state_MiB,pred_state_MiB,pred_peak_MiB,pred_sent_MB,status", o->common.format);
    du_progress_setup("ddp", rank == 0 ? o->common.progress : "off");   // only rank 0 reports
    du_progress_begin(nconfigs);
    for (int k = 0; k < nconfigs; k++) {
        config cf;
        list_configs(o, k, &cf);
        char mb[32] = "";
        if (cf.s == S_BUCKETED || cf.s == S_ZERO1) snprintf(mb, sizeof(mb), " %g MB", cf.bucket_mb);
        du_progress_config(k + 1, "%s T=%d %s %s%s%s%s", cf.model, cf.T, du_dtype_flag(cf.dt), strat_names[cf.s], mb, cf.comm_bf16 ? " bf16 wire" : cf.gather ? " gathered" : "",
                           cf.compiled ? " compiled" : "");
        run_config(ctx, d, dev, o, &cf, link, fsdp_links, du_table_row(&tab));
        if (rank == 0) du_table_emit(&tab);
    }
    du_progress_end();
    double rc = rank == 0 ? du_table_exit_code(&tab, "ddp", o->common.oom_ok) : 0;
    if (o->profile_log) {   // the paths of the profiles after the table (stdout under md, stderr under csv and jsonl)
        if (!du_profile_list("ddp", o->profile_log, f) && rc == 0) rc = DU_EXIT_FAILED;
        fclose(o->profile_log);
    }
    tsys_dist_all_reduce_host(d, &rc, 1, TSYS_DIST_MAX);   // every rank exits as rank 0 does
    du_table_free(&tab);
    tsys_dist_free(d);
    tsys_ctx_free(ctx);   // also shuts the CUDA backend down
    return (int)rc;
}

static bool bucket_ok(const char *s) { double b; return du_parse_double(s, &b) && b >= 0 && b <= 1e9; }
static bool checkpoint_ok(const char *s) {
    tsys_checkpoint_policy p;
    return tsys_checkpoint_policy_parse(s, 1 << 20, &p, NULL, 0) == TSYS_OK;
}

#define SYNOPSIS "  data-parallel training of the cs336 LM, a row per model x context x dtype x strategy (x bucket size x gradient dtype)"
#define EPILOGUE \
    "columns: step_ms the slowest rank's step (mean, step_std over steps); bwd_comm_ms backward + gradient\n" \
    "  synchronization; opt_ms the optimizer step (ZeRO-1: its update and broadcasts); comm_ms the step's\n" \
    "  gradient all-reduces timed alone (nothing to overlap); comm_frac comm_ms / step_ms; exposed_ms what\n" \
    "  the step waited for communication after backward (it includes waiting for a slower rank);\n" \
    "  hidden 1 - exposed_ms / comm_ms, clipped to [0, 1]; pred_comm_ms the same all-reduces predicted from\n" \
    "  the accounting's bytes and a link model measured at start (max of n alpha and bytes / beta); fsdp:\n" \
    "  its collectives one after another, each kind on its own link (all-gathers and reduce-scatters\n" \
    "  measured at start too; n alpha + bytes / beta; with --grad-comm gather not priced); --grad-comm gather: the\n" \
    "  pulls bucket after bucket on the copy engines' links, measured after the row's steps on its own\n" \
    "  buffers (pull_us a bucket, pull_GBps the bytes a rank receives with every rank pulling,\n" \
    "  pull_one_GBps with one rank pulling: a ZeRO-1 bucket inside one rank's part);\n" \
    "  buckets DDP's gradient buckets (fsdp: its units), copied_buckets those not a view of the gradients;\n" \
    "  fsdp: comm_ms its all-gathers, reduce-scatters and all-reduces alone, exposed_ms step_ms - compute_ms,\n" \
    "  compute_ms the same local step without sharding or communication (a plain model on each rank; bf16\n" \
    "  under autocast); mem_* the peak bytes per rank (largest rank) after init, before the first optimizer\n" \
    "  step, after it; state_MiB live bytes after a step (parameters, gradients, optimizer state) against\n" \
    "  pred_state_MiB; pred_peak_MiB adds the predicted activations; pred_sent_MB bytes each rank sends per\n" \
    "  step (ring algorithms). --account prints the prediction table (DDP, ZeRO-1/2/3, FSDP) for --nproc\n" \
    "  ranks instead; under mpirun or torchrun the ranks come from the launcher (no --nproc). compiled yes:\n" \
    "  step_ms times replays of the step captured as one CUDA graph (device events; no phase columns).\n"

static int driver_main(int argc, char **argv) {
    ddp_opts o;
    memset(&o, 0, sizeof(o));
    o.device = du_has_cuda() ? "cuda" : "cpu";
    du_model_flags_texts(&o.mf, "presets (%s) or 'custom' with the dims below\n(default: xl on cuda, small on cpu)", "a preset (%s) or 'custom'");
    du_flag flags[] = {
        DU_FLAG_CHOICE("device", &o.device, NULL, "cpu|cuda", "where each rank computes (default: cuda when a GPU is present, else cpu)"),
        DU_MODEL_FLAGS(&o.mf, NULL, du_ok_model),
        DU_FLAG_LIST("strategy", &o.strategies, "naive,flat,overlap,bucketed,zero1", "naive|flat|overlap|bucketed|zero1|fsdp",
                     "naive, flat, overlap, bucketed (DDP's), zero1 or fsdp; zero1 = bucketed gradient\n"
                     "all-reduce (each --bucket-mb) + ZeRO-1 sharded AdamW (with --grad-comm gather\n"
                     "--opt-in-backward yes: each bucket updated inside backward by its owner, which\n"
                     "alone keeps its moments: tsys_ddp_desc.shard_state);\n"
                     "fsdp = ZeRO-3 (tsys_fsdp: sharded weights, gradients and AdamW state; bf16 = its compute_dtype)"),
        DU_FLAG_LIST_CHECKED("bucket-mb", &o.buckets, "1,10,100,1000", bucket_ok, "MB from 0 to 1e9",
                             "bucket sizes of 'bucketed' and 'zero1' in MB (2^20 bytes)"),
        DU_FLAG_LIST("grad-comm", &o.comms, "fp32", "fp32|bf16|gather",
                     "how DDP's fp32 gradients travel (bf16: tsys_ddp_desc.comm_bf16,\ntorch's bf16_compress_hook; half the bytes; gather: "
                     "tsys_ddp_desc.ce_gather,\ncopied to every peer by the copy engines and summed by AdamW; bucketed,\nCUDA, one host; "
                     "fsdp: its units' transfers on the copy engines,\ntsys_fsdp_desc.ce_transfers, with --opt-in-backward yes --fsdp-reshard no;\n"
                     "fsdp's fp32 and bf16 are one row: NCCL in its compute dtype)"),
        DU_FLAG_CHOICE("lowp-copies", &o.lowp_copies, "no", "no|yes", "yes: AdamW keeps the weights' bf16 copies, which forward reads instead of\n"
                       "casting (tsys_dist_trainer_desc.lowp_copies; DDP strategies under --dtype bf16)"),
        DU_FLAG_CHOICE("lowp-grads", &o.lowp_grads, "no", "no|yes", "yes: the linear weights' gradients in bf16, as autocast's matmul writes them\n"
                       "(tsys_dist_trainer_desc.lowp_grads): half the bytes to send and for AdamW to read;\n"
                       "with --grad-comm gather (whose AdamW widens and sums them in fp32) or one rank"),
        DU_FLAG_CHOICE("opt-in-backward", &o.in_backward, "no", "no|yes", "yes: each bucket's (fsdp: unit's) AdamW update on a background stream as\n"
                       "soon as its gradients are in on every rank, beside the rest of backward\n"
                       "(tsys_dist_trainer_desc.opt_in_backward; bucketed or overlap on cuda with NCCL,\n"
                       "zero1 with --grad-comm gather, or fsdp); the same bits"),
        DU_FLAG_CHOICE("shard-updates", &o.shard, "no", "no|yes|masters", "yes: with --grad-comm gather and --opt-in-backward yes, each bucket pulled and\n"
                       "updated by one rank, which pushes the new weights to the others\n"
                       "(tsys_ddp_desc.shard_updates): each rank's AdamW moves 1/ranks of the bytes;\n"
                       "masters (with --lowp-copies yes): the matmul weights pushed as their bf16\n"
                       "copies alone, their fp32 values kept by the owner until a save\n"
                       "(tsys_ddp_desc.shard_masters: half the pushed bytes)"),
        DU_FLAG_LIST("compile", &o.compiles, "no", "no|yes", "yes: capture the whole step as one CUDA graph after warmup (at least one\n"
                     "step) and time its replays (cuda with NCCL only)"),
        DU_FLAG_LIST("dtype", &o.dtypes, "fp32", "fp32|bf16", "autocast (fsdp: bf16 weights and gradients on the wire, bf16 compute, fp32 masters)"),
        DU_FLAG_INT("batch-size", &o.batch, "4", 1, 1 << 20, "sequences per rank"),
        DU_CONTEXT_FLAG(&o.contexts, "256", "context lengths"),
        DU_FLAG_CHOICE("attn", &o.attn, "auto", "naive|flash|auto", "attention (auto: flash on cuda under bf16, else naive)"),
        DU_FLAG_CHECKED("checkpoint", &o.checkpoint, "none", "POLICY", checkpoint_ok, "none, blocks:K, sqrt, nested[:K], selective, P+selective, P+keep-attn, P+first:N or auto:BYTES",
                        "activation checkpointing of the model (none, blocks:K, sqrt, nested[:K], selective,\nP+selective, P+keep-attn, P+first:N; see e2e --help), or auto:BYTES: the\n"
                        "policy with the least recomputation whose predicted peak a rank fits BYTES\nunder each row's strategy and ranks (the row says which)"),
        DU_FLAG_CHOICE("loss", &o.loss, "mean", "mean|sum", "cross-entropy's mean over the tokens, or its sum (the S26 leaderboard's)"),
        DU_FLAG_CHOICE("fsdp-reshard", &o.reshard, "auto", "auto|yes|no",
                       "fsdp: free each unit's gathered weights after its forward and gather them again\nfor its backward (yes), or keep them "
                       "through the backward (no: one all-gather per\nunit and step, ZeRO-2's traffic); auto: yes with several ranks"),
        DU_FLAG_BOOL("no-compute-ref", &o.no_compute_ref, "fsdp: skip the same step without sharding (compute_ms; exposed_ms and hidden\n"
                     "are then empty), for models that do not fit one device unsharded"),
        DU_FLAG_INT("warmup", &o.warmup, "5", 0, 1 << 20, "untimed steps first"),
        DU_FLAG_INT("steps", &o.steps, "10", 1, 1 << 20, "timed steps"),
        DU_FLAG_INT("nproc", &o.nproc, "1", 1, 1024, "start N local ranks (built-in launcher); not needed under mpirun/torchrun"),
        DU_FLAG_BOOL("account", &o.account, "print the accounting prediction (DDP, ZeRO-1/2/3, FSDP) for --nproc ranks; run nothing"),
        DU_FLAG_BOOL("plan", &o.plan, "print the S26 section 8 cost model for --nproc ranks: compute and communication per step\n"
                     "of dp, fsdp, tp, dp x tp and fsdp x tp (each tp dividing the ranks); run nothing"),
        DU_PLAN_RATE_FLAGS(&o.plan_tflops, &o.plan_gbps, "--plan's"),
        DU_FLAG_INT("seed", &o.seed, "0", 0, 1 << 30, "weights and batch seed"),
        DU_FLAG_INT("save-every", &o.save_every, "0", 0, 1 << 30, "a snapshot of the training state into --save-dir every N steps (DDP:\n"
                    "rank 0's; zero1, fsdp: sharded; one configuration)"),
        DU_FLAG_STR("save-dir", &o.save_dir, NULL, "DIR", "where --save-every's snapshots go (DIR/step-000123)"),
        DU_FLAG_STR("resume", &o.resume, NULL, "DIR", "resume from the snapshot DIR, or DIR's newest (the step count goes on from it)"),
        DU_FLAG_STR("profile", &o.profile, NULL, "DIR", "after the timed steps, one more eager step of each configuration, rank 0's\n"
                    "under the profiler: DIR/<config>.md holds its phases, op and kernel tables,\n"
                    "DIR/<config>.json the Chrome trace (Perfetto); after the table, one line per\n"
                    "profiled configuration names them (stdout under md, stderr under csv and jsonl)"),
        DU_COMMON_FLAGS(&o.common, DU_MEM_LIMIT_RANKS_TEXT),
    };
    const int nflags = (int)(sizeof(flags) / sizeof(flags[0]));
    int rc = du_flags_parse("ddp", flags, nflags, argc, argv, SYNOPSIS, EPILOGUE);
    if (rc) return rc == DU_HELP ? DU_EXIT_OK : rc;
    const bool cuda = !strcmp(o.device, "cuda");
    if (du_device_why(o.device)) {
        fprintf(stderr, "ddp: %s\n", du_device_why(o.device));
        du_flags_free(flags, nflags);
        return DU_EXIT_USAGE;
    }
    if (!o.mf.models.n && !du_split(&o.mf.models, "ddp", "--model", cuda ? "xl" : "small")) { du_flags_free(flags, nflags); return DU_EXIT_FAILED; }
    const long nconfigs = o.account || o.plan ? (long)ACCOUNT_TABLE_SCHEMES * o.mf.models.n * o.contexts.n * o.dtypes.n : list_configs(&o, -1, NULL);
    if (nconfigs > 1000000) {
        fprintf(stderr, "ddp: the lists make %ld configurations; at most 1000000\n", nconfigs);
        rc = DU_EXIT_USAGE;
    } else if (o.account && o.plan) {
        fprintf(stderr, "ddp: --account and --plan print different tables: ask for one\n");
        rc = DU_EXIT_USAGE;
    } else if (o.account && !strncmp(o.checkpoint, "auto:", 5)) {
        fprintf(stderr, "ddp: --account predicts for a given --checkpoint policy; auto:BYTES is chosen per strategy when the rows run\n");
        rc = DU_EXIT_USAGE;
    } else if ((o.save_every && !o.save_dir) || ((o.save_dir || o.resume) && nconfigs != 1)) {
        fprintf(stderr, "ddp: --save-every needs --save-dir, and snapshots one configuration (the lists make %ld)\n", nconfigs);
        rc = DU_EXIT_USAGE;
    } else if (o.common.dry_run) {   // before any rank starts
        fprintf(du_preamble(&o.common), "ddp: %d rank%s (--nproc; mpirun's or torchrun's under them), %s, batch %d per rank, warmup %d, "
                "%d steps, AdamW\n", o.nproc, o.nproc == 1 ? "" : "s", o.device, o.batch, o.warmup, o.steps);
        rc = du_dry_run_done(&o.common, "ddp", (int)nconfigs);
    } else if (o.plan) rc = plan_table_print("ddp", o.common.format, &o.mf.models, &o.contexts, &o.dtypes, o.batch, o.nproc, o.plan_tflops * 1e12, o.plan_gbps * 1e9,
                                          config_desc, &o);
    else rc = o.account ? account_table_print("ddp", o.common.format, &o.mf.models, &o.contexts, &o.dtypes, o.batch, o.nproc, config_desc, &o)
                        : run_sweep(&o, (int)nconfigs, argc, argv);
    du_flags_free(flags, nflags);
    return rc;
}

int main(int argc, char **argv) { return du_exit("ddp", driver_main(argc, argv)); }
