// state_dist.h - the sharded-snapshot tests that tests/test_ddp.c (ZeRO-1, DDP) and tests/test_fsdp.c
// (FSDP) share, and the captured-step test that compares through those snapshots (compiled_procedure, at
// the end): they run under a tsys_dist_trainer of the given mode, on every rank. Needs the including
// file's g_ctx, g_d, g_rank, g_world, g_dev, and a context for one-process references (alone_ctx).
//
//   resume at the same world size: 2 steps, save, 2 more; a fresh trainer (other weights) loads the
//     snapshot and takes the same 2 steps: every parameter and moment bitwise equal (both final states
//     saved and consolidated, their tensors compared byte for byte);
//   one process and back: rank 0 loads the step-2 snapshot, consolidated, into a plain model and AdamW
//     (no group) and trains on the whole batch, saving a plain snapshot at step 3; every rank loads that
//     into the mode's trainer (resharded from one process) and takes step 4;
//   other world sizes (TSYS_TEST_STATE_DIR: a directory that runs at several world sizes share, as
//     tests/run_dist.sh sets it): each run leaves its step-2 snapshot there and resumes from those of
//     the other world sizes found (2 -> 4, 4 -> 2...);
//   the consolidated model.safetensors loads with tsys_model_load;
//   a byte altered in one part fails the load on every rank, with nothing written; a failed save too.
// Across world sizes the gradient of the (fixed) global batch is summed in another order (per-rank means
// averaged over ranks, against one GEMM over all rows), so those states are equal within fp32 noise, with
// the tolerance of the FSDP tests' whole-batch comparison (parameters rtol 1e-5, atol 2e-5: after AdamW's
// normalisation a rounding in a near-zero gradient can move a weight by up to ~lr); the moments follow
// the gradients linearly (m) and squared (v): rtol 1e-4 with an atol of 1e-5 of the tensor's largest value.
#include <sys/stat.h>

#define STATE_ROWS 8   // the global batch: the same at every world size (which must divide it)

static tsys_model_desc state_model_desc(void) {
    tsys_model_desc d = tsys_model_desc_defaults(NULL);
    d.vocab_size = 97; d.context_length = 16; d.d_model = 32; d.num_layers = 2; d.num_heads = 4; d.d_ff = 64;
    return d;
}

// Rows [r0, r1) of step it's global batch (the same on every rank and world size).
static void state_batch(tsys_ctx *ctx, int it, int r0, int r1, tsys_tensor **ids, tsys_tensor **tgt) {
    const int T = 16, vocab = 97;
    int64_t hi[STATE_ROWS * 16], ht[STATE_ROWS * 16];
    uint64_t x = 0x9e3779b97f4a7c15ull * (uint64_t)(it + 1);
    for (int i = 0; i < STATE_ROWS * T; i++) {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        hi[i] = (int64_t)(x % vocab);
        ht[i] = (int64_t)((x >> 20) % vocab);
    }
    int64_t shape[2] = {r1 - r0, T};
    tsys_tensor *a = tsys_tensor_from_data(ctx, TSYS_I64, TSYS_CPU, 2, shape, hi + r0 * T);
    tsys_tensor *b = tsys_tensor_from_data(ctx, TSYS_I64, TSYS_CPU, 2, shape, ht + r0 * T);
    *ids = tsys_tensor_to(ctx, a, g_dev);
    *tgt = tsys_tensor_to(ctx, b, g_dev);
    tsys_tensor_release(a); tsys_tensor_release(b);
}

// Steps [from, to) of t: this rank's rows of the global batch (all of them when alone).
static void state_steps(tsys_ctx *ctx, tsys_dist_trainer *t, bool alone, int from, int to) {
    int r0 = alone ? 0 : STATE_ROWS * g_rank / g_world, r1 = alone ? STATE_ROWS : STATE_ROWS * (g_rank + 1) / g_world;
    for (int it = from; t && it < to; it++) {
        tsys_tensor *ids, *tgt;
        state_batch(ctx, it, r0, r1, &ids, &tgt);
        tsys_dist_trainer_step(t, ids, tgt, NULL);
        tsys_tensor_release(ids); tsys_tensor_release(tgt);
    }
}

// state_owners: DDP's trainers gather bf16 gradients, each bucket updated by its owner inside backward, which alone
// keeps its moments and fp32 weights (desc.ddp.shard_updates, shard_state, shard_masters): sharded snapshots.
static bool state_owners = false;
static tsys_dist_trainer *state_trainer(tsys_ctx *ctx, tsys_dist_train_mode mode, uint64_t seed, tsys_model **m) {
    tsys_model_desc d = state_model_desc();
    *m = tsys_model_new(ctx, &d, g_dev, seed);
    tsys_dist_trainer_desc td;
    memset(&td, 0, sizeof(td));
    td.mode = mode; td.ddp.strategy = TSYS_DDP_FLAT; td.fsdp.compute_dtype = TSYS_F32; td.autocast = TSYS_F32;
    if (state_owners) {
        td.ddp.strategy = TSYS_DDP_BUCKETED; td.ddp.bucket_mb = 0.01; td.ddp.ce_gather = true; td.ddp.shard_updates = td.ddp.shard_state = td.ddp.shard_masters = true;
        td.autocast = TSYS_BF16; td.lowp_copies = td.lowp_grads = td.opt_in_backward = true;
    }
    return *m ? tsys_dist_trainer_new(ctx, mode == TSYS_TRAIN_ALONE ? NULL : g_d, *m, g_dev, &td) : NULL;
}

static void state_drop(tsys_dist_trainer *t, tsys_model *m) { tsys_dist_trainer_free(t); tsys_model_free(m); }

// Every rank agrees: true when ok on all of them.
static bool state_all(bool ok) {
    double bad = ok ? 0 : 1;
    return tsys_dist_all_reduce_host(g_d, &bad, 1, TSYS_DIST_SUM) == TSYS_OK && bad == 0;
}

static tsys_status state_save(tsys_dist_trainer *t, const char *dir, const char *name, int step) {
    tsys_state_desc sd;
    memset(&sd, 0, sizeof(sd));
    sd.name = name; sd.step = step;
    return tsys_dist_trainer_state_save(t, dir, &sd);
}

static tsys_status state_load(tsys_dist_trainer *t, const char *dir, const char *name, int64_t *step) {
    char path[1024];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    tsys_state_desc sd;
    memset(&sd, 0, sizeof(sd));
    tsys_state_info info;
    tsys_status s = tsys_dist_trainer_state_load(t, path, &sd, &info);
    *step = s == TSYS_OK ? info.step : -1;
    return s;
}

// The tensors of dir/name consolidated into dir/plain (one process): model.safetensors, then train_state's.
static int state_plain(tsys_ctx *ctx, const char *dir, const char *name, tsys_tensor ***out) {
    char src[600], dst[600], file[700];
    snprintf(src, sizeof(src), "%s/%s", dir, name);
    snprintf(dst, sizeof(dst), "%s/plain", dir);
    *out = NULL;
    if (tsys_state_consolidate(ctx, src, dst) != TSYS_OK) return -1;
    tsys_tensor **a = NULL, **b = NULL, **all;
    int na = 0, nb = 0;
    snprintf(file, sizeof(file), "%s/%s/model.safetensors", dst, name);
    if (tsys_safetensors_load(ctx, file, TSYS_CPU, &a, &na) != TSYS_OK) return -1;
    snprintf(file, sizeof(file), "%s/%s/train_state.safetensors", dst, name);
    if (tsys_safetensors_load(ctx, file, TSYS_CPU, &b, &nb) != TSYS_OK) { tsys_tensor_list_free(a, na); return -1; }
    all = (tsys_tensor **)malloc(sizeof(tsys_tensor *) * (size_t)(na + nb + 1));
    if (!all) { tsys_tensor_list_free(a, na); tsys_tensor_list_free(b, nb); return -1; }
    memcpy(all, a, sizeof(tsys_tensor *) * (size_t)na);
    memcpy(all + na, b, sizeof(tsys_tensor *) * (size_t)nb);
    free(a); free(b);   // the lists' memory (tsys_tensor_list_free would release the tensors too)
    *out = all;
    return na + nb;
}

// dir/a and dir/b hold the same tensors: bitwise (rtol < 0), or within the tolerances above. Rank 0
// consolidates and compares; every rank gets the answer.
static bool state_same(tsys_ctx *ctx, const char *dir, const char *a, const char *b, double rtol, const char *what) {
    bool ok = true;
    if (g_rank == 0) {
        tsys_tensor **x, **y;
        int nx = state_plain(ctx, dir, a, &x), ny = state_plain(ctx, dir, b, &y);
        ok = nx > 0 && nx == ny && x && y;
        TEST_CHECK(ok, "%s: consolidating %s (%d tensors) and %s (%d): %s", what, a, nx, b, ny, tsys_ctx_last_error(ctx));
        for (int i = 0; ok && i < nx; i++) {
            long n = (long)tsys_tensor_numel(x[i]);
            const float *p = (const float *)tsys_tensor_data(x[i]), *q = (const float *)tsys_tensor_data(y[i]);
            bool moment = strncmp(x[i]->name, "optim.state.", 12) == 0;
            double mx = 0;
            for (long k = 0; k < n; k++) mx = fmax(mx, fabs(q[k]));
            bool named = true;   // (a loop: gcc -O1 takes the lists for empty ones and warns on strcmp)
            for (int k = 0; named && k < TSYS_NAME_LEN && (x[i]->name[k] || y[i]->name[k]); k++) named = x[i]->name[k] == y[i]->name[k];
            bool same = named && n == (long)tsys_tensor_numel(y[i]) &&
                        (rtol < 0 ? memcmp(p, q, sizeof(float) * (size_t)n) == 0
                                  : tsys_test_close_ratio(p, q, n, moment ? 1e-4 : rtol, moment ? 1e-5 * mx + 1e-30 : 2e-5) <= 1.0);
            TEST_CHECK(same, "%s: tensor '%s' of %s differs from %s's (%s)", what, x[i]->name, b, a, rtol < 0 ? "bitwise" : "allclose");
            ok = same;
        }
        if (nx > 0) { for (int i = 0; i < nx; i++) tsys_tensor_release(x[i]); free(x); }
        if (ny > 0) { for (int i = 0; i < ny; i++) tsys_tensor_release(y[i]); free(y); }
    }
    return state_all(ok);
}

// Resumes from dir/name (saved at step 2 by any world size, or one process) under mode, to step 4,
// saving it as dir/out.
static bool state_resume(tsys_ctx *ctx, tsys_dist_train_mode mode, const char *from_dir, const char *name, const char *dir, const char *out) {
    tsys_model *m;
    tsys_dist_trainer *t = state_trainer(ctx, mode, 99 + (uint64_t)g_rank, &m);   // other weights (rank 0's are broadcast)
    int64_t step = -1;
    tsys_status s = t ? state_load(t, from_dir, name, &step) : tsys_ctx_status(ctx);
    TEST_CHECK(s == TSYS_OK && step >= 0, "rank %d: loading %s/%s: %s", g_rank, from_dir, name, tsys_ctx_last_error(ctx));
    if (s == TSYS_OK) state_steps(ctx, t, false, (int)step, 4);
    s = s == TSYS_OK ? state_save(t, dir, out, 4) : s;
    TEST_CHECK(s == TSYS_OK, "rank %d: saving %s: %s", g_rank, out, tsys_ctx_last_error(ctx));
    state_drop(t, m);
    return state_all(s == TSYS_OK);
}

static void state_dir(char *dir, size_t len, const char *what) {
    double pid = g_rank == 0 ? (double)getpid() : 0;   // rank 0's pid names the directory
    tsys_dist_all_reduce_host(g_d, &pid, 1, TSYS_DIST_SUM);
    snprintf(dir, len, "%s/tsys_%s_state_%.0f", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp", what, pid);
}

// One process: rank 0 resumes the consolidated step-2 snapshot without a group, saves a plain
// snapshot at step 3, takes step 4 and saves it as dir/alone-4.
static bool state_alone(tsys_ctx *alone_ctx, const char *dir) {
    bool ok = true;
    if (g_rank == 0) {
        char plain[600];
        snprintf(plain, sizeof(plain), "%s/plain", dir);
        tsys_model *m;
        tsys_dist_trainer *t = state_trainer(alone_ctx, TSYS_TRAIN_ALONE, 5, &m);
        int64_t step = -1;
        char src[600];
        snprintf(src, sizeof(src), "%s/a", dir);
        ok = t && tsys_state_consolidate(alone_ctx, src, plain) == TSYS_OK && state_load(t, plain, "a", &step) == TSYS_OK && step == 2;
        state_steps(alone_ctx, t, true, 2, 3);
        ok = ok && state_save(t, dir, "alone-3", 3) == TSYS_OK;
        state_steps(alone_ctx, t, true, 3, 4);
        ok = ok && state_save(t, dir, "alone-4", 4) == TSYS_OK;
        TEST_CHECK(ok, "one process from the consolidated snapshot: %s", tsys_ctx_last_error(alone_ctx));
        // the consolidated model file is a plain model file
        tsys_model_desc d;
        char file[700];
        snprintf(file, sizeof(file), "%s/a/model.safetensors", plain);
        char err[200] = "";
        tsys_model *c = tsys_model_desc_from_file(file, &d, err, sizeof(err)) == TSYS_OK ? tsys_model_new(alone_ctx, &d, TSYS_CPU, 1) : NULL;
        TEST_CHECK(c && tsys_model_load(c, file) == TSYS_OK, "tsys_model_load of the consolidated %s: %s%s", file, err, tsys_ctx_last_error(alone_ctx));
        tsys_model_free(c);
        state_drop(t, m);
        tsys_ctx_clear_error(alone_ctx);
    }
    return state_all(ok);
}

// Other world sizes' step-2 snapshots of this mode in TSYS_TEST_STATE_DIR: resumed here, against a.
static void state_other_worlds(tsys_ctx *ctx, tsys_dist_train_mode mode, const char *tag, const char *dir) {
    const char *shared = getenv("TSYS_TEST_STATE_DIR");
    if (!shared || !shared[0]) return;
    for (int w = 1; w <= 8; w *= 2) {
        char name[64], path[700], out[80];
        snprintf(name, sizeof(name), "%s-w%d", tag, w);
        snprintf(path, sizeof(path), "%s/%s/MANIFEST", shared, name);
        struct stat st;
        double here = w != g_world && stat(path, &st) == 0 ? 1 : 0;   // what rank 0 sees decides
        tsys_dist_all_reduce_host(g_d, &here, 1, TSYS_DIST_MAX);
        if (!here) continue;
        snprintf(out, sizeof(out), "from-w%d", w);
        if (g_rank == 0) printf("[%d -> %d] ", w, g_world);
        if (state_resume(ctx, mode, shared, name, dir, out)) state_same(ctx, dir, "a-4", out, 1e-5, "resharded from another world size");
    }
}

// Failures are every rank's: a byte altered in one part (the last rank's, read by some ranks only) fails
// the load on all of them, none having written anything (a rank's first parameter is checked untouched);
// a save whose directory rank 0 cannot make fails on all of them too.
static void state_failures(tsys_ctx *ctx, tsys_dist_train_mode mode, const char *dir) {
    char part[700];
    snprintf(part, sizeof(part), "%s/a/rank-%05d.safetensors", dir, g_world - 1);
    struct stat st;
    if (stat(part, &st) != 0) snprintf(part, sizeof(part), "%s/a/train_state.safetensors", dir);   // DDP: a plain snapshot
    if (g_rank == 0 && stat(part, &st) == 0) {
        FILE *f = fopen(part, "r+b");
        int c = EOF;
        if (f && fseek(f, (long)st.st_size - 5, SEEK_SET) == 0) c = fgetc(f);
        if (c != EOF && fseek(f, (long)st.st_size - 5, SEEK_SET) == 0) fputc(c ^ 0x10, f);
        if (f) fclose(f);
        TEST_CHECK(c != EOF, "cannot alter %s", part);
    }
    tsys_dist_barrier(g_d);
    tsys_model *m;
    tsys_dist_trainer *t = state_trainer(ctx, mode, 99, &m);
    tsys_tensor *first = mode == TSYS_TRAIN_FSDP ? tsys_fsdp_params(tsys_dist_trainer_fsdp(t))[0] : tsys_model_params(m)[0];
    float *before = test_read(ctx, first);
    int64_t step = 0;
    tsys_status s = t ? state_load(t, dir, "a", &step) : TSYS_ERR_INVALID_ARGS;
    bool named = strstr(tsys_ctx_last_error(ctx), "altered") || strstr(tsys_ctx_last_error(ctx), "failed on");
    TEST_CHECK(s != TSYS_OK && named, "rank %d: the load of an altered snapshot: %s", g_rank, s == TSYS_OK ? "succeeded" : tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    float *after = test_read(ctx, first);
    TEST_CHECK(before && after && memcmp(before, after, tsys_tensor_bytes(first)) == 0, "rank %d: a failed load wrote parameters", g_rank);
    free(before); free(after);
    char bad[700];
    snprintf(bad, sizeof(bad), "%s/a/MANIFEST/x", dir);   // under a file: rank 0 cannot make it
    s = t ? state_save(t, bad, "x", 2) : TSYS_ERR_INVALID_ARGS;
    TEST_CHECK(s != TSYS_OK, "rank %d: a save into %s succeeded", g_rank, bad);
    tsys_ctx_clear_error(ctx);
    state_drop(t, m);
}

// The end of a procedure: every rank done with dir, rank 0 removes it; the context's status is checked.
static void state_procedure_end(tsys_ctx *ctx, const char *dir) {
    tsys_dist_barrier(g_d);
    if (g_rank == 0) {
        char cmd[600];
        snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
        TEST_CHECK(system(cmd) == 0, "cannot remove %s", dir);
    }
    tsys_tape_clear(ctx);
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
}

// The whole procedure for a mode; alone_ctx: the one-process references' context.
static void state_procedure(tsys_ctx *ctx, tsys_ctx *alone_ctx, tsys_dist_train_mode mode, const char *tag) {
    if (STATE_ROWS % g_world) { if (g_rank == 0) printf("(skipped: %d ranks do not divide %d rows) ", g_world, STATE_ROWS); return; }
    char dir[512];
    state_dir(dir, sizeof(dir), tag);
    tsys_model *m;
    tsys_dist_trainer *t = state_trainer(ctx, mode, 7, &m);
    TEST_CHECK(t, "trainer: %s", tsys_ctx_last_error(ctx));
    if (!state_all(t != NULL)) { state_drop(t, m); return; }
    state_steps(ctx, t, false, 0, 2);
    tsys_status s = state_save(t, dir, "a", 2);
    TEST_CHECK(s == TSYS_OK, "rank %d: save: %s", g_rank, tsys_ctx_last_error(ctx));
    const char *shared = getenv("TSYS_TEST_STATE_DIR");
    if (shared && shared[0]) {
        char name[64];
        snprintf(name, sizeof(name), "%s-w%d", tag, g_world);
        TEST_CHECK(state_save(t, shared, name, 2) == TSYS_OK, "rank %d: save into %s: %s", g_rank, shared, tsys_ctx_last_error(ctx));
    }
    state_steps(ctx, t, false, 2, 4);
    s = state_save(t, dir, "a-4", 4);
    TEST_CHECK(s == TSYS_OK, "rank %d: save at step 4: %s", g_rank, tsys_ctx_last_error(ctx));
    state_drop(t, m);   // one FSDP per context: the next trainer's
    if (!state_all(s == TSYS_OK)) return;
    if (state_resume(ctx, mode, dir, "a", dir, "b-4")) state_same(ctx, dir, "a-4", "b-4", -1, "resumed at the same world size");
    if (state_alone(alone_ctx, dir)) {
        state_same(ctx, dir, "a-4", "alone-4", 1e-5, "one process from the snapshot");
        if (state_resume(ctx, mode, dir, "alone-3", dir, "c-4")) state_same(ctx, dir, "a-4", "c-4", 1e-5, "resharded from one process");
    }
    state_other_worlds(ctx, mode, tag, dir);
    state_failures(ctx, mode, dir);
    state_procedure_end(ctx, dir);
}

// ---- a captured step (tsys_dist_trainer_capture) --------------------------------------------------
//
// Four eager steps of a trainer against one eager step, a capture and three replays of another from the
// same weights, each replay's batch copied into the device tensors given at capture: the parameters and
// AdamW's moments (both final states saved and consolidated) bitwise equal, and the step counts (the
// trainer's, and the optimizer's that the snapshot records: AdamW counts on the device inside a replay).
// While captured, an eager step and the collectives' timing are refused; a capture before any eager step
// and a second capture too; after uncapture an eager step runs again. Where the step cannot be captured
// (the CPU; ranks sharing a GPU through host staging) the capture is refused on every rank, naming why,
// and the other trainer goes on eagerly: the refusal must leave it as it was (the same comparison).

// compiled_gather: the captured run's DDP copies its gradients to the peers and AdamW sums them (desc.ce_gather);
// the eager reference all-reduces them.
static bool compiled_gather = false;
// compiled_lowp: both runs under bf16 autocast with the linear weights' gradients in bf16 and (but ZeRO-1)
// AdamW's kept copies (desc.lowp_grads, lowp_copies), both gathering (the mode that takes bf16 gradients).
static bool compiled_lowp = false;
// compiled_in_backward: the captured run's AdamW runs inside backward (desc.opt_in_backward); the eager
// reference's after it.
static bool compiled_in_backward = false;
// compiled_fsdp_keep: FSDP keeps each unit gathered from its forward through its backward (with AdamW inside backward:
// gathered for the next forward in backward, at addresses the captured step keeps).
static bool compiled_fsdp_keep = false;
// compiled_shard: the captured run's gathered DDP updates each bucket on its owner only (desc.ddp.shard_updates, with
// AdamW inside backward), the owner pushing the new parameters to its peers.
static bool compiled_shard = false;
// compiled_masters: with compiled_shard and compiled_lowp, the matmul weights travel as their kept copies alone
// (desc.ddp.shard_masters); the trainer's saves sync the fp32 weights.
static bool compiled_masters = false;
// compiled_state: with compiled_shard, each rank's AdamW keeps its buckets' moments alone (desc.ddp.shard_state):
// the captured run's snapshots are sharded.
static bool compiled_state = false;
// compiled_fsdp_ce: FSDP's units on the copy engines in the run with AdamW inside backward (desc.fsdp.ce_transfers);
// compiled_rtol: how close its replays must come to the eager steps (-1: bit for bit)
static bool compiled_fsdp_ce = false;
static double compiled_rtol = -1;
static tsys_dist_trainer *compiled_trainer(tsys_ctx *ctx, tsys_dist_train_mode mode, tsys_ddp_strategy strategy, tsys_model **m, bool gather, bool in_backward) {
    tsys_model_desc d = state_model_desc();
    *m = tsys_model_new(ctx, &d, g_dev, 21);
    tsys_dist_trainer_desc td;
    memset(&td, 0, sizeof(td));
    td.mode = mode; td.ddp.strategy = strategy; td.ddp.bucket_mb = 0.01; td.fsdp.compute_dtype = TSYS_F32; td.autocast = compiled_lowp ? TSYS_BF16 : TSYS_F32;
    td.fsdp.reshard_after_forward = compiled_fsdp_keep ? TSYS_FSDP_RESHARD_NO : TSYS_FSDP_RESHARD_AUTO;
    td.ddp.ce_gather = gather || compiled_lowp; td.lowp_grads = compiled_lowp; td.opt_in_backward = in_backward;
    td.ddp.shard_updates = compiled_shard && in_backward && mode == TSYS_TRAIN_DDP;
    td.ddp.shard_masters = td.ddp.shard_updates && compiled_masters && compiled_lowp;
    td.ddp.shard_state = td.ddp.shard_updates && compiled_state;
    td.lowp_copies = compiled_lowp && mode != TSYS_TRAIN_ZERO1;   // ZeRO-1 keeps none
    td.fsdp.ce_transfers = compiled_fsdp_ce && in_backward && mode == TSYS_TRAIN_FSDP;
    return *m ? tsys_dist_trainer_new(ctx, g_d, *m, g_dev, &td) : NULL;
}

// The optimizer's step count in the metadata of dir/plain/name's train_state.safetensors (state_same
// consolidated it there on rank 0); -1 when it cannot be read.
static long long compiled_optim_step(const char *dir, const char *name) {
    char path[700];
    snprintf(path, sizeof(path), "%s/plain/%s/train_state.safetensors", dir, name);
    FILE *f = fopen(path, "rb");
    unsigned char len8[8];
    long long step = -1;
    if (f && fread(len8, 1, 8, f) == 8) {
        uint64_t n = 0;
        for (int i = 7; i >= 0; i--) n = n << 8 | len8[i];
        char *json = n < (1u << 24) ? (char *)calloc((size_t)n + 1, 1) : NULL;
        const char *at = json && fread(json, 1, (size_t)n, f) == (size_t)n ? strstr(json, "\"optim.step\"") : NULL;
        if (at) {
            at += strlen("\"optim.step\"");
            while (*at && (*at < '0' || *at > '9')) at++;
            if (*at) step = strtoll(at, NULL, 10);
        }
        free(json);
    }
    if (f) fclose(f);
    return step;
}

// Expected where the step can be captured: the trainer's device is CUDA and its collectives stay there.
static bool compiled_capturable(void) {
    tsys_dist_engine e = tsys_dist_engine_of(g_d);
    return g_dev == TSYS_CUDA && (e == TSYS_DIST_ENGINE_NCCL || e == TSYS_DIST_ENGINE_SELF);
}

// What a refused capture must say: the reason, on every rank.
static void compiled_refused(tsys_ctx *ctx, tsys_status s, const char *why, const char *when) {
    TEST_CHECK(s == TSYS_ERR_UNSUPPORTED && strstr(tsys_ctx_last_error(ctx), why), "rank %d: capture %s: %s (wanted a refusal naming '%s')", g_rank, when,
               s == TSYS_OK ? "succeeded" : tsys_ctx_last_error(ctx), why);
    tsys_ctx_clear_error(ctx);
}

// Steps 1..3 of the second trainer: each batch copied into ids/tgt, then a replay (or, where the capture
// was refused, an eager step on them).
static void compiled_replays(tsys_ctx *ctx, tsys_dist_trainer *t, tsys_tensor *ids, tsys_tensor *tgt, int r0, int r1, bool captured) {
    for (int it = 1; it < 4; it++) {
        tsys_tensor *bi, *bt;
        state_batch(ctx, it, r0, r1, &bi, &bt);
        tsys_status s = bi && bt ? tsys_tensor_copy_from(ctx, ids, bi) : tsys_ctx_status(ctx);
        if (s == TSYS_OK) s = tsys_tensor_copy_from(ctx, tgt, bt);
        tsys_tensor_release(bi); tsys_tensor_release(bt);
        tsys_dist_step_times tm;
        memset(&tm, 0, sizeof(tm));
        if (s == TSYS_OK) s = captured ? tsys_dist_trainer_replay(t, &tm) : tsys_dist_trainer_step(t, ids, tgt, &tm);
        TEST_CHECK(s == TSYS_OK, "rank %d: %s %d: %s", g_rank, captured ? "replay" : "eager step", it, tsys_ctx_last_error(ctx));
        if (captured)
            TEST_CHECK(tm.step_ms > 0 && isnan(tm.forward_ms) && isnan(tm.exposed_ms) && isnan(tm.peak_pre_optim), "rank %d: replay %d's times: step %g ms, "
                       "forward %g ms, exposed %g ms (wanted a positive step time, the host-clock ones NAN)", g_rank, it, tm.step_ms, tm.forward_ms, tm.exposed_ms);
    }
}

// The captured trainer's own checks while it holds its graph: what it must refuse.
static void compiled_refusals_held(tsys_ctx *ctx, tsys_dist_trainer *t, tsys_tensor *ids, tsys_tensor *tgt) {
    compiled_refused(ctx, tsys_dist_trainer_capture(t, ids, tgt), "already captured", "a second time");
    tsys_status s = tsys_dist_trainer_step(t, ids, tgt, NULL);
    TEST_CHECK(s != TSYS_OK && strstr(tsys_ctx_last_error(ctx), "captured"), "rank %d: an eager step while captured: %s", g_rank,
               s == TSYS_OK ? "ran" : tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    double ms = 0;
    s = tsys_dist_trainer_time_collectives(t, &ms);
    TEST_CHECK(s != TSYS_OK && strstr(tsys_ctx_last_error(ctx), "uncapture"), "rank %d: timing the collectives while captured: %s", g_rank,
               s == TSYS_OK ? "ran" : tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
}

// The second trainer: one eager step, the capture (or its refusal), three replays; saved as dir/name.
static void compiled_run(tsys_ctx *ctx, tsys_dist_train_mode mode, tsys_ddp_strategy strategy, const char *dir, const char *name, int64_t *steps) {
    const int r0 = STATE_ROWS * g_rank / g_world, r1 = STATE_ROWS * (g_rank + 1) / g_world;
    const bool can = compiled_capturable();
    tsys_model *m;
    tsys_dist_trainer *t = compiled_trainer(ctx, mode, strategy, &m, compiled_gather, compiled_in_backward);
    tsys_tensor *ids = NULL, *tgt = NULL;
    state_batch(ctx, 0, r0, r1, &ids, &tgt);
    TEST_CHECK(t && ids && tgt, "rank %d: trainer: %s", g_rank, tsys_ctx_last_error(ctx));
    if (!state_all(t && ids && tgt)) { tsys_tensor_release(ids); tsys_tensor_release(tgt); state_drop(t, m); return; }
    if (can) compiled_refused(ctx, tsys_dist_trainer_capture(t, ids, tgt), "no eager step", "before an eager step");
    TEST_CHECK(tsys_dist_trainer_step(t, ids, tgt, NULL) == TSYS_OK, "rank %d: eager step 0: %s", g_rank, tsys_ctx_last_error(ctx));
    tsys_status s = tsys_dist_trainer_capture(t, ids, tgt);
    if (can) TEST_CHECK(s == TSYS_OK && tsys_dist_trainer_captured(t), "rank %d: capture: %s", g_rank, tsys_ctx_last_error(ctx));
    else compiled_refused(ctx, s, g_dev == TSYS_CPU ? "the CPU" : "host memory", "where it cannot be");
    const bool captured = s == TSYS_OK;
    if (!state_all(captured == can)) { tsys_tensor_release(ids); tsys_tensor_release(tgt); state_drop(t, m); return; }
    if (captured) compiled_refusals_held(ctx, t, ids, tgt);
    compiled_replays(ctx, t, ids, tgt, r0, r1, captured);
    *steps = tsys_dist_trainer_steps(t);
    TEST_CHECK(state_save(t, dir, name, (int)*steps) == TSYS_OK, "rank %d: save %s: %s", g_rank, name, tsys_ctx_last_error(ctx));
    tsys_dist_trainer_uncapture(t);
    TEST_CHECK(!tsys_dist_trainer_captured(t), "rank %d: still captured after uncapture", g_rank);
    TEST_CHECK(tsys_dist_trainer_step(t, ids, tgt, NULL) == TSYS_OK && tsys_dist_trainer_steps(t) == *steps + 1, "rank %d: an eager step after "
               "uncapture: %s", g_rank, tsys_ctx_last_error(ctx));   // the graph's memory back in general use
    tsys_tensor_release(ids); tsys_tensor_release(tgt);
    state_drop(t, m);
}

static void compiled_procedure(tsys_ctx *ctx, tsys_dist_train_mode mode, tsys_ddp_strategy strategy, const char *tag) {
    if (STATE_ROWS % g_world) { if (g_rank == 0) printf("(skipped: %d ranks do not divide %d rows) ", g_world, STATE_ROWS); return; }
    char dir[512];
    state_dir(dir, sizeof(dir), tag);
    tsys_model *m;
    tsys_dist_trainer *t = compiled_trainer(ctx, mode, strategy, &m, false, false);   // the eager reference: steps 0..3
    TEST_CHECK(t, "rank %d: trainer: %s", g_rank, tsys_ctx_last_error(ctx));
    state_steps(ctx, t, false, 0, 4);
    const int64_t eager_steps = tsys_dist_trainer_steps(t);
    TEST_CHECK(t && state_save(t, dir, "eager", (int)eager_steps) == TSYS_OK, "rank %d: save: %s", g_rank, tsys_ctx_last_error(ctx));
    state_drop(t, m);   // one FSDP per context: the next trainer's
    int64_t replayed_steps = -1;
    compiled_run(ctx, mode, strategy, dir, "replayed", &replayed_steps);
    TEST_CHECK(eager_steps == 4 && replayed_steps == 4, "rank %d: the trainers count %lld and %lld steps (wanted 4)", g_rank, (long long)eager_steps,
               (long long)replayed_steps);
    if (state_all(tsys_ctx_status(ctx) == TSYS_OK) && state_same(ctx, dir, "eager", "replayed", compiled_rtol, "replayed against eager") && g_rank == 0) {
        long long a = compiled_optim_step(dir, "eager"), b = compiled_optim_step(dir, "replayed");
        TEST_CHECK(a == 4 && b == 4, "the optimizer's step counts: %lld eager, %lld replayed (wanted 4)", a, b);
    }
    state_procedure_end(ctx, dir);
}
