// ddp_measure.h - how ddp measures one configuration on every rank: the model, its tsys_dist_trainer
// and this rank's own batch (ddp_run); the warmup and timed steps with the memory peaks (eager, or the
// step captured as one CUDA graph after warmup and replayed: --compile), then the step's collectives
// timed alone, the slowest rank's numbers, rank 0's profile of one more step (ddp_measure); and the
// same step without sharding or communication (ddp_plain_step_ms, fsdp's compute reference). Included by ddp after
// driver_util.h, profile_files.h and tsys_dist.h.
#ifndef TSYS_DDP_MEASURE_H
#define TSYS_DDP_MEASURE_H

// What the steps of a configuration take from the flags: batch sequences a rank, the seed of the
// weights and batches, the untimed and timed steps, the snapshot to resume from (NULL: none), whether
// the timed steps are replays of the step captured as a CUDA graph (compiled), and where rank 0's
// profile of one more eager step goes (profile_dir NULL: none; profile_files.h's files under
// profile_name, their paths to profile_log).
typedef struct ddp_steps {
    int batch, seed, warmup, steps;
    const char *resume;
    bool compiled;
    const char *profile_dir, *profile_name;
    FILE *profile_log;
} ddp_steps;

// A model, its trainer and this rank's own batch.
typedef struct ddp_run { tsys_model *model; tsys_dist_trainer *tr; tsys_tensor *ids, *targets; } ddp_run;

static inline tsys_status ddp_run_new(ddp_run *r, tsys_ctx *ctx, tsys_dist *d, int rank, tsys_device dev, const ddp_steps *p, const tsys_model_desc *desc,
                                      const tsys_dist_trainer_desc *td) {
    memset(r, 0, sizeof(*r));
    int64_t shape[2] = {p->batch, desc->context_length};
    tsys_tensor *ids = tsys_tensor_new(ctx, TSYS_I64, TSYS_CPU, 2, shape), *tgt = tsys_tensor_new(ctx, TSYS_I64, TSYS_CPU, 2, shape);
    tsys_rng_seed(ctx, (uint64_t)p->seed * 1000003u + 7u + (uint64_t)rank);   // each rank its own batch
    if (ids && tgt) { tsys_tensor_randint(ctx, ids, desc->vocab_size); tsys_tensor_randint(ctx, tgt, desc->vocab_size); }
    r->ids = tsys_tensor_to(ctx, ids, dev);
    r->targets = tsys_tensor_to(ctx, tgt, dev);
    tsys_tensor_release(ids); tsys_tensor_release(tgt);
    // every rank builds the model from the same seed (the broadcast makes them equal regardless); one that
    // could not (out of memory) must not leave the others in the broadcast
    r->model = tsys_model_new(ctx, desc, dev, (uint64_t)p->seed + 1);
    tsys_status st = r->model && r->ids && r->targets ? TSYS_OK : tsys_ctx_status(ctx) != TSYS_OK ? tsys_ctx_status(ctx) : TSYS_ERR_OOM;
    if (td->mode == TSYS_TRAIN_ALONE ? st == TSYS_OK : !tsys_dist_any_failed(d, st)) r->tr = tsys_dist_trainer_new(ctx, d, r->model, dev, td);
    if (d) tsys_dist_sync(d);
    return r->tr ? TSYS_OK : tsys_ctx_status(ctx) != TSYS_OK ? tsys_ctx_status(ctx) : TSYS_ERR_OOM;
}

static inline void ddp_run_free(ddp_run *r, tsys_ctx *ctx) {
    tsys_tape_clear(ctx);
    tsys_dist_trainer_free(r->tr);
    tsys_tensor_release(r->ids); tsys_tensor_release(r->targets);
    tsys_model_free(r->model);
    tsys_ctx_clear_error(ctx);
}

// The same local step with no sharding and no communication: a plain model and AdamW on each rank of d
// (bf16 under autocast), mean ms over the timed steps, the slowest rank's (NAN when it fails, e.g. out
// of memory).
static inline double ddp_plain_step_ms(tsys_ctx *ctx, tsys_dist *d, tsys_device dev, const ddp_steps *p, const tsys_model_desc *desc,
                                       tsys_dist_trainer_desc td) {
    ddp_run r;
    td.mode = TSYS_TRAIN_ALONE; td.save_every = 0;   // a reference: it saves nothing
    tsys_status st = ddp_run_new(&r, ctx, NULL, tsys_dist_rank(d), dev, p, desc, &td);
    double sum = 0;
    for (int i = 0; st == TSYS_OK && i < p->warmup + p->steps; i++) {
        tsys_dist_step_times t;
        st = tsys_dist_trainer_step(r.tr, r.ids, r.targets, &t);
        if (i >= p->warmup) sum += t.step_ms;
    }
    ddp_run_free(&r, ctx);
    double ms = st == TSYS_OK ? sum / p->steps : NAN;
    tsys_dist_all_reduce_host(d, &ms, 1, TSYS_DIST_MAX);
    return ms;
}

// Why a compiled configuration is not run here (NULL: it is): a CUDA graph holds CUDA work only, and
// only collectives that stay on the device (NCCL, or a group of one); host staging copies through host
// memory and waits for it.
static inline const char *ddp_compile_skip(const tsys_dist *d, tsys_device dev) {
    const tsys_dist_engine e = tsys_dist_engine_of(d);
    if (dev != TSYS_CUDA) return "--compile needs --device cuda";
    if (e != TSYS_DIST_ENGINE_NCCL && e != TSYS_DIST_ENGINE_SELF) return "--compile needs NCCL (this engine stages CUDA collectives through host memory)";
    return NULL;
}

// Timed step j of a configuration (j < 0: warmup): eager, or compiled from the first timed one on, a
// replay of the step captured just before it (the capture's status is the same on every rank).
static inline tsys_status ddp_step(ddp_run *r, const ddp_steps *p, int j, tsys_dist_step_times *t) {
    if (!p->compiled || j < 0) return tsys_dist_trainer_step(r->tr, r->ids, r->targets, t);
    tsys_status st = j == 0 ? tsys_dist_trainer_capture(r->tr, r->ids, r->targets) : TSYS_OK;
    return st == TSYS_OK ? tsys_dist_trainer_replay(r->tr, t) : st;
}

// One more eager step on every rank, rank 0's under the profiler, its files written as p says. The
// ranks agree that the profiler started before any steps (a rank alone in a collective would hang).
static inline tsys_status ddp_profile_step(ddp_run *r, tsys_ctx *ctx, tsys_dist *d, const ddp_steps *p) {
    tsys_profiler *prof = tsys_dist_rank(d) == 0 ? tsys_profiler_begin(ctx) : NULL;
    tsys_status st = tsys_dist_rank(d) == 0 && !prof ? tsys_ctx_status(ctx) : TSYS_OK;
    if (tsys_dist_any_failed(d, st)) { tsys_profiler_free(prof); return st != TSYS_OK ? st : TSYS_ERR_INVALID_ARGS; }
    tsys_dist_step_times t;
    memset(&t, 0, sizeof(t));
    st = tsys_dist_trainer_step(r->tr, r->ids, r->targets, &t);
    if (prof && tsys_profiler_end(prof) != TSYS_OK && st == TSYS_OK) st = tsys_ctx_status(ctx);
    const double ms[3] = {t.forward_ms, t.backward_ms, t.optim_ms};
    if (prof && st == TSYS_OK) st = du_profile_write(ctx, prof, p->profile_dir, p->profile_name, ms, p->profile_log);
    tsys_profiler_free(prof);
    return st;
}

// What the steps of one configuration measured: the slowest rank's numbers (max over the ranks).
typedef struct ddp_measured {
    double *tm;             // steps each of step, backward + sync, optimizer and exposed ms (the caller frees it)
    double mem[4];          // the peak after init, before and after the first optimizer step, the live bytes after it
    double alone;           // the step's collectives timed alone (nothing to overlap), ms, mean of 3
    tsys_fsdp_stats fst;    // fsdp's, of the last step
    tsys_ddp_stats ds;      // DDP's buckets and bytes
    tsys_dist_pull_links pulls;   // desc.ce_gather: the copy engines' pulls measured on the DDP's buffers (zeros: none)
    double pred_pull_ms;    // the step's pulls predicted on them (NAN: none)
    char why[DU_CELL];      // what failed, as the row's status says it: "OOM: ...", "error: ..."
} ddp_measured;

// The steps of one configuration on every rank, its run made and freed here. fsdp: the peak is reset after init (the
// whole model existed until sharded: the step's peak is what counts); fsdp's exposed time is step_ms - compute_ms (NAN: no compute reference). Compiled: at least one warmup step,
// then the replays, timed whole by device events (the phases and exposed time NAN: a host clock cannot
// see inside a replay); the graph is freed before the collectives are timed alone. True when every rank
// succeeded; else m->why says what failed (an error on another rank, or out of memory on any).
static inline bool ddp_measure(ddp_measured *m, tsys_ctx *ctx, tsys_dist *d, tsys_device dev, const ddp_steps *p, const tsys_model_desc *desc,
                               const tsys_dist_trainer_desc *td, bool fsdp, double compute_ms) {
    const int n = p->steps, warm = p->compiled && p->warmup < 1 ? 1 : p->warmup, total = warm + n;
    memset(m, 0, sizeof(*m));
    tsys_mem_reset_peak(ctx, dev);
    const double base_live = (double)tsys_mem_stats_get(ctx, dev).live_bytes;
    double *tm = m->tm = (double *)calloc((size_t)4 * n, sizeof(double)), *mem = m->mem;
    ddp_run r;
    tsys_status st = ddp_run_new(&r, ctx, d, tsys_dist_rank(d), dev, p, desc, td);
    if (p->resume && !tsys_dist_any_failed(d, st)) {   // every rank, or none
        double t0 = du_now_s();
        st = tsys_dist_trainer_resume(r.tr, p->resume, NULL);
        if (st == TSYS_OK && tsys_dist_rank(d) == 0) fprintf(stderr, "resumed from %s in %.2f s (rank 0; every rank reads its part)\n", p->resume, du_now_s() - t0);
    }
    mem[0] = (double)tsys_mem_stats_get(ctx, dev).peak_bytes;
    if (fsdp) tsys_mem_reset_peak(ctx, dev);
    bool failed = tsys_dist_any_failed(d, st = tm ? st : TSYS_ERR_OOM);
    for (int i = 0; !failed && i < total; i++) {
        tsys_dist_step_times t;
        memset(&t, 0, sizeof(t));   // a failed capture leaves it
        const int j = i - warm;
        st = ddp_step(&r, p, j, &t);
        if (i == 0) { mem[1] = t.peak_pre_optim; mem[2] = t.peak_post_optim; mem[3] = (double)tsys_mem_stats_get(ctx, dev).live_bytes - base_live; }
        if (j >= 0) {
            tm[j] = t.step_ms; tm[n + j] = t.backward_ms; tm[2 * n + j] = t.optim_ms;
            tm[3 * n + j] = !fsdp ? t.exposed_ms : isnan(compute_ms) || p->compiled ? NAN : fmax(0.0, t.step_ms - compute_ms);
        }
        du_progress_step(j < 0 ? "warmup" : "timed", j < 0 ? i + 1 : j + 1, j < 0 ? warm : n);
        if (st == TSYS_OK && t.save_ms > 0 && tsys_dist_rank(d) == 0)
            fprintf(stderr, "snapshot step-%06lld: %.2f s (rank 0; the step waited, every rank writes its part)\n", (long long)tsys_dist_trainer_steps(r.tr), t.save_ms / 1e3);
        failed = tsys_dist_any_failed(d, st);
    }
    m->fst = tsys_fsdp_stats_get(tsys_dist_trainer_fsdp(r.tr));   // the last step's, before the timing below
    tsys_dist_trainer_uncapture(r.tr);   // the collectives' timing would move the graph's buffers; the profile steps eagerly
    if (!failed && p->profile_dir) failed = tsys_dist_any_failed(d, st = ddp_profile_step(&r, ctx, d, p));
    for (int k = 0; !failed && k < 3; k++) {   // the step's collectives alone, mean of 3
        double ms = 0;
        tsys_dist_barrier(d);
        st = tsys_dist_trainer_time_collectives(r.tr, &ms);
        m->alone += ms / 3;
        failed = tsys_dist_any_failed(d, st);
    }
    m->pred_pull_ms = NAN;
    tsys_ddp *ddp = tsys_dist_trainer_ddp(r.tr);
    if (!failed && td->ddp.ce_gather && ddp && tsys_dist_size(d) > 1) {   // the same on every rank: all probe, or none
        m->pulls = tsys_ddp_calibrate_pulls(ddp);
        m->pred_pull_ms = tsys_ddp_pull_time_ms(ddp, m->pulls);
        if (tsys_ctx_status(ctx) != TSYS_OK) {   // no prediction, the row still stands
            if (tsys_dist_rank(d) == 0) fprintf(stderr, "ddp: the copy engines' pulls were not measured: %s\n", tsys_ctx_last_error(ctx));
            tsys_ctx_clear_error(ctx);
        }
    }
    if (!failed) {
        tsys_dist_all_reduce_host(d, tm, 4 * n, TSYS_DIST_MAX); tsys_dist_all_reduce_host(d, mem, 4, TSYS_DIST_MAX);
        tsys_dist_all_reduce_host(d, &m->alone, 1, TSYS_DIST_MAX);
        m->ds = tsys_ddp_stats_get(tsys_dist_trainer_ddp(r.tr));
    } else {
        double e = st == TSYS_ERR_OOM ? 1 : 0;
        tsys_dist_all_reduce_host(d, &e, 1, TSYS_DIST_MAX);
        snprintf(m->why, sizeof(m->why), "%s: %s", e > 0 ? "OOM" : "error", st != TSYS_OK ? tsys_ctx_last_error(ctx) : "on another rank");
    }
    ddp_run_free(&r, ctx);
    return !failed;
}

#endif
