// test_state.c - training-state snapshots (tsys_state_save / load / latest): bit-exact resume of a
// cs336 model under AdamW (fp32; fp16 autocast with the loss scaler and kept copies) and SGD, the
// RNG and the user record carried over, every corrupted byte and truncated file detected and named
// with nothing written, strict name/shape/dtype checks, keep_last, replacing a snapshot, temporaries.
//
// Two more modes serve tests/test_state_fault.sh (kill -9 at random moments):
//   test_state --fault-writer DIR [SAVES]   resumes from DIR's newest snapshot and saves snapshots of
//                                           known content (a function of the step) until killed
//   test_state --fault-check DIR MINSTEP    loads DIR's newest snapshot and checks it whole: prints
//                                           "step N", exits 1 on any error
// and one tests/ref/state_resume_torch.py reads (PyTorch continues the run from a tsys snapshot):
//   test_state --export-torch DIR           DIR/step-000003 and what the next step saw (expect.safetensors)
#define _POSIX_C_SOURCE 200809L   // mkdtemp, truncate, fork
#include "../drivers/prelude.h"
#include "harness.h"
#include "test_util.h"

#include <stdlib.h>
#include <stdint.h>
#include <unistd.h>
#include <dirent.h>
#include <signal.h>
#include <errno.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <sys/resource.h>   // RLIMIT_FSIZE

// ---- helpers ----------------------------------------------------------------------------------------

static char ts_root[256];   // one temporary directory for the run

static const char *ts_dir(const char *name) {
    static char buf[8][512];
    static int next;
    char *p = buf[next++ % 8];
    if (!ts_root[0]) {
        snprintf(ts_root, sizeof ts_root, "%s/tsys_state_XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
        if (!mkdtemp(ts_root)) { perror("mkdtemp"); exit(1); }
    }
    snprintf(p, 512, "%s/%s", ts_root, name);
    return p;
}

static void ts_rm_rf(const char *path) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", path);
    if (system(cmd) != 0) printf("    (could not remove %s)\n", path);
}

static bool ts_exists(const char *dir, const char *name) {
    char p[1024];
    struct stat st;
    snprintf(p, sizeof p, "%s/%s", dir, name);
    return stat(p, &st) == 0;
}

// Entries of dir whose name starts with prefix.
static int ts_count(const char *dir, const char *prefix) {
    DIR *d = opendir(dir);
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d));) n += strncmp(e->d_name, prefix, strlen(prefix)) == 0 && strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    if (d) closedir(d);
    return n;
}

// Expects status s to be an error whose message holds every given string; clears it.
static int ts_expect_error(tsys_ctx *ctx, tsys_status s, const char *a, const char *b) {
    const char *msg = tsys_ctx_last_error(ctx);
    int ok = s != TSYS_OK && (!a || strstr(msg, a)) && (!b || strstr(msg, b));
    if (!ok) printf("    expected an error naming '%s'%s%s, got %d: %s\n", a ? a : "", b ? " and " : "", b ? b : "", (int)s, msg);
    tsys_ctx_clear_error(ctx);
    return ok;
}

static tsys_model_desc ts_model_desc(int d_ff) {
    tsys_model_desc d = tsys_model_desc_defaults(NULL);
    d.vocab_size = 37; d.context_length = 8; d.d_model = 16; d.num_layers = 2; d.num_heads = 2; d.d_ff = d_ff;
    return d;
}

// A training run's objects.
typedef struct ts_run {
    tsys_ctx *ctx;
    tsys_model *m;
    tsys_optim *opt;
    tsys_grad_scaler scaler;
    bool fp16;   // autocast fp16 with the loss scaler and kept fp16 copies
} ts_run;

static ts_run ts_run_new(uint64_t seed, bool sgd, bool fp16, int d_ff) {
    ts_run r;
    memset(&r, 0, sizeof r);
    r.ctx = tsys_ctx_new(NULL);
    tsys_rng_seed(r.ctx, seed);
    tsys_model_desc d = ts_model_desc(d_ff);
    r.m = tsys_model_new(r.ctx, &d, TSYS_CPU, seed);
    tsys_optim_desc od;
    memset(&od, 0, sizeof od);
    od.lr = 0.25f; od.beta2 = 0.95f; od.weight_decay = 0.05f;   // the loaded snapshot's replace them
    r.opt = sgd ? tsys_sgd_new(r.ctx, tsys_model_params(r.m), tsys_model_num_tensors(r.m), 0.5f)
                : tsys_adamw_new(r.ctx, tsys_model_params(r.m), tsys_model_num_tensors(r.m), &od);
    r.scaler = tsys_grad_scaler_init();
    r.fp16 = fp16;
    if (fp16 && !sgd) tsys_optim_keep_lowp(r.opt, TSYS_F16);
    return r;
}

static void ts_run_free(ts_run *r) {
    tsys_optim_free(r->opt);
    tsys_model_free(r->m);
    tsys_ctx_free(r->ctx);
}

// One training step at iteration it: a batch drawn from the context's RNG (so the RNG must resume
// too), the cosine schedule, clipping; the loss.
static float ts_step(ts_run *r, int64_t it) {
    tsys_ctx *ctx = r->ctx;
    int64_t shape[2] = {2, 8};
    tsys_tensor *ids = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 2, shape), *tgt = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 2, shape);
    tsys_tensor_randint(ctx, ids, 37);
    tsys_tensor_randint(ctx, tgt, 37);
    tsys_optim_set_lr(r->opt, (float)tsys_cosine_lr(it, 3e-2, 3e-3, 2, 12));
    if (r->fp16) tsys_autocast_begin(ctx, TSYS_F16);
    tsys_tensor *logits = tsys_model_forward(r->m, ids);
    tsys_tensor *loss = tsys_cross_entropy(ctx, logits, tgt);
    if (r->fp16) tsys_autocast_end(ctx);
    float value = NAN;
    tsys_tensor_to_f32(ctx, loss, &value);
    if (r->fp16) {
        tsys_tensor *scaled = tsys_grad_scaler_scale(ctx, &r->scaler, loss);
        tsys_backward(ctx, scaled);
        tsys_grad_scaler_step(&r->scaler, r->opt);
        tsys_grad_scaler_update(&r->scaler);
        tsys_tensor_release(scaled);
    } else {
        tsys_backward(ctx, loss);
        tsys_clip_grad_norm(ctx, tsys_model_params(r->m), tsys_model_num_tensors(r->m), 1.0);
        tsys_optim_step(r->opt);
    }
    tsys_optim_zero_grad(r->opt);
    tsys_tensor *tl[4] = {ids, tgt, logits, loss};
    for (int i = 0; i < 4; i++) tsys_tensor_release(tl[i]);
    return value;
}

// Every parameter, then AdamW's m and v, as raw bytes (malloc'd); *bytes their size.
static unsigned char *ts_values(ts_run *r, size_t *bytes) {
    int n = tsys_model_num_tensors(r->m);
    tsys_tensor **p = tsys_model_params(r->m);
    size_t total = 0;
    for (int i = 0; i < n; i++) total += tsys_tensor_bytes(p[i]);
    tsys_tensor *probe = tsys_optim_state(r->opt, 0, 0);   // NULL for SGD
    bool adamw = probe != NULL;
    tsys_tensor_release(probe);
    unsigned char *v = (unsigned char *)malloc(total * (adamw ? 3 : 1)), *at = v;
    for (int which = -1; which < (adamw ? 2 : 0); which++)
        for (int i = 0; i < n; i++) {
            tsys_tensor *t = which < 0 ? tsys_tensor_retain(p[i]) : tsys_optim_state(r->opt, i, which);
            tsys_tensor_to_host(r->ctx, t, at);
            at += tsys_tensor_bytes(t);
            tsys_tensor_release(t);
        }
    *bytes = (size_t)(at - v);
    return v;
}

static tsys_state_desc ts_desc(ts_run *r, int64_t step) {
    tsys_state_desc d;
    memset(&d, 0, sizeof d);
    d.model = r->m; d.optim = r->opt; d.step = step;
    if (r->fp16) d.scaler = &r->scaler;
    return d;
}

// Trains N steps, saves, trains M more (run A); then a fresh run with other weights, other
// hyper-parameters and another RNG loads the snapshot and trains M steps (run B): every parameter and
// moment, every loss, the step counts, the scaler and the next RNG draw must be bitwise A's.
static void ts_resume(bool sgd, bool fp16) {
    enum { N = 3, M = 4 };
    const char *dir = ts_dir(sgd ? "resume_sgd" : fp16 ? "resume_fp16" : "resume_adamw");
    ts_run a = ts_run_new(1234, sgd, fp16, 32);
    for (int it = 0; it < N; it++) ts_step(&a, it);
    tsys_state_desc sd = ts_desc(&a, N);
    char pos[32];
    snprintf(pos, sizeof pos, "%d", N * 16);
    const char *user[4] = {"data_pos", pos, "run", "resume-test"};
    sd.user = user; sd.n_user = 2;
    tsys_status s = tsys_state_save(a.ctx, dir, &sd);
    TEST_CHECK(s == TSYS_OK, "save: %s", tsys_ctx_last_error(a.ctx));
    float loss_a[M], loss_b[M];
    for (int it = N; it < N + M; it++) loss_a[it - N] = ts_step(&a, it);

    ts_run b = ts_run_new(99, sgd, fp16, 32);
    char latest[1024];
    TEST_CHECK(tsys_state_latest(b.ctx, dir, latest, sizeof latest) == TSYS_OK && strstr(latest, "/step-000003"), "latest: '%s' %s", latest, tsys_ctx_last_error(b.ctx));
    tsys_state_info info;
    tsys_state_desc ld = ts_desc(&b, 0);
    s = tsys_state_load(b.ctx, latest, &ld, &info);
    TEST_CHECK(s == TSYS_OK, "load: %s", tsys_ctx_last_error(b.ctx));
    TEST_CHECK(info.step == N && info.serial == 1, "step %lld serial %lld", (long long)info.step, (long long)info.serial);
    const char *got = tsys_state_info_get(&info, "data_pos"), *run = tsys_state_info_get(&info, "run");
    TEST_CHECK(got && strcmp(got, pos) == 0 && run && strcmp(run, "resume-test") == 0 && info.n_user == 2, "user record: %s %s (%d)", got ? got : "NULL", run ? run : "NULL", info.n_user);
    TEST_CHECK(!tsys_state_info_get(&info, "missing"), "an absent key");
    for (int it = (int)info.step; it < N + M; it++) loss_b[it - N] = ts_step(&b, it);

    size_t na, nb;
    unsigned char *va = ts_values(&a, &na), *vb = ts_values(&b, &nb);
    TEST_CHECK(na == nb && memcmp(va, vb, na) == 0, "parameters and moments differ after resume (%zu / %zu bytes)", na, nb);
    TEST_CHECK(memcmp(loss_a, loss_b, sizeof loss_a) == 0, "losses differ: %.9g vs %.9g", (double)loss_a[M - 1], (double)loss_b[M - 1]);
    TEST_CHECK(tsys_optim_steps(a.opt) == tsys_optim_steps(b.opt) && tsys_optim_steps(b.opt) == (fp16 ? tsys_optim_steps(a.opt) : N + M),
               "optimizer steps %lld vs %lld", (long long)tsys_optim_steps(a.opt), (long long)tsys_optim_steps(b.opt));
    TEST_CHECK(memcmp(&a.scaler, &b.scaler, sizeof a.scaler) == 0, "scaler: scale %g/%g tracker %d/%d", (double)a.scaler.scale, (double)b.scaler.scale,
               a.scaler.growth_tracker, b.scaler.growth_tracker);
    TEST_CHECK(tsys_rng_next(a.ctx) == tsys_rng_next(b.ctx), "the RNG does not continue identically");
    TEST_CHECK(tsys_ctx_status(a.ctx) == TSYS_OK && tsys_ctx_status(b.ctx) == TSYS_OK, "%s %s", tsys_ctx_last_error(a.ctx), tsys_ctx_last_error(b.ctx));
    if (fp16) TEST_CHECK(tsys_optim_lowp(b.opt) == TSYS_F16, "the kept copies stay on");
    free(va); free(vb);
    ts_run_free(&a); ts_run_free(&b);
}

TSYS_TEST(state_resume_adamw_bit_exact) { ts_resume(false, false); }
TSYS_TEST(state_resume_sgd_bit_exact) { ts_resume(true, false); }
TSYS_TEST(state_resume_fp16_scaler_kept_copies_bit_exact) { ts_resume(false, true); }

// ---- asynchronous saving ------------------------------------------------------------------------------

// The bytes of dir/snap/file (malloc'd), *n their count; NULL when unreadable.
static unsigned char *ts_file(const char *snap, const char *file, size_t *n) {
    char p[1024];
    snprintf(p, sizeof p, "%s/%s", snap, file);
    FILE *f = fopen(p, "rb");
    unsigned char *b = NULL;
    long len = -1;
    if (f && fseek(f, 0, SEEK_END) == 0 && (len = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0 && (b = (unsigned char *)malloc((size_t)len + 1)))
        if (fread(b, 1, (size_t)len, f) != (size_t)len) { free(b); b = NULL; }
    if (f) fclose(f);
    *n = b ? (size_t)len : 0;
    return b;
}

static bool ts_same_file(const char *a, const char *b, const char *file) {
    size_t na, nb;
    unsigned char *x = ts_file(a, file, &na), *y = ts_file(b, file, &nb);
    bool same = x && y && na == nb && memcmp(x, y, na) == 0;
    if (!same) printf("    %s differs: %zu bytes in %s, %zu in %s\n", file, na, a, nb, b);
    free(x); free(y);
    return same;
}

// An asynchronous snapshot is the state at the call: the run trains on before the files are written,
// and they are byte for byte those tsys_state_save writes at the same point; a run resumed from it
// continues bit for bit. Two saves in a row (the second waits for the first), keep_last, the stats.
TSYS_TEST(state_save_async_is_the_state_at_the_call) {
    const char *sync_dir = ts_dir("async_sync"), *async_dir = ts_dir("async");
    ts_run a = ts_run_new(21, false, true, 32);   // fp16: the scaler and the kept copies too
    for (int it = 0; it < 3; it++) ts_step(&a, it);
    tsys_state_saver *sv = tsys_state_saver_new(a.ctx);
    TEST_CHECK(sv != NULL, "saver: %s", tsys_ctx_last_error(a.ctx));
    tsys_state_desc d = ts_desc(&a, 3);
    d.keep_last = 2;
    TEST_CHECK(tsys_state_save(a.ctx, sync_dir, &d) == TSYS_OK, "save: %s", tsys_ctx_last_error(a.ctx));
    TEST_CHECK(tsys_state_saver_reserve(sv, &d) == TSYS_OK, "reserve: %s", tsys_ctx_last_error(a.ctx));
    TEST_CHECK(tsys_state_save_async(sv, async_dir, &d) == TSYS_OK, "save_async: %s", tsys_ctx_last_error(a.ctx));
    float loss_a[3], loss_b[3];
    for (int it = 3; it < 6; it++) loss_a[it - 3] = ts_step(&a, it);   // writes what the snapshot copied
    TEST_CHECK(tsys_state_saver_wait(sv) == TSYS_OK, "wait: %s", tsys_ctx_last_error(a.ctx));
    char s1[1024], s2[1024];
    snprintf(s1, sizeof s1, "%s/step-000003", sync_dir);
    snprintf(s2, sizeof s2, "%s/step-000003", async_dir);
    TEST_CHECK(ts_same_file(s1, s2, "model.safetensors") && ts_same_file(s1, s2, "train_state.safetensors"), "async and sync snapshots differ");
    tsys_state_saver_stats st = tsys_state_saver_stats_get(sv);
    size_t nv;
    unsigned char *v = ts_values(&a, &nv);
    TEST_CHECK(st.saves == 1 && st.bytes == (int64_t)nv && st.stage_ms >= 0 && st.write_ms >= 0 && !tsys_state_saver_busy(sv),
               "stats: saves %lld bytes %lld (tensors %zu)", (long long)st.saves, (long long)st.bytes, nv);
    free(v);

    ts_run b = ts_run_new(77, false, true, 32);
    tsys_state_desc ld = ts_desc(&b, 0);
    TEST_CHECK(tsys_state_load(b.ctx, s2, &ld, NULL) == TSYS_OK, "load: %s", tsys_ctx_last_error(b.ctx));
    for (int it = 3; it < 6; it++) loss_b[it - 3] = ts_step(&b, it);
    size_t na, nb;
    unsigned char *va = ts_values(&a, &na), *vb = ts_values(&b, &nb);
    TEST_CHECK(na == nb && memcmp(va, vb, na) == 0 && memcmp(loss_a, loss_b, sizeof loss_a) == 0, "resumed from the asynchronous snapshot, the run differs");
    free(va); free(vb);

    // three more, back to back: each waits for the one before; keep_last 2 leaves the newest two
    for (int k = 0; k < 3; k++) {
        ts_step(&a, 6 + k);
        d.step = 7 + k;
        TEST_CHECK(tsys_state_save_async(sv, async_dir, &d) == TSYS_OK, "save_async %d: %s", k, tsys_ctx_last_error(a.ctx));
    }
    TEST_CHECK(tsys_state_saver_wait(sv) == TSYS_OK && tsys_state_saver_stats_get(sv).saves == 4, "wait: %s", tsys_ctx_last_error(a.ctx));
    TEST_CHECK(ts_count(async_dir, "step-") == 2 && ts_exists(async_dir, "step-000008") && ts_exists(async_dir, "step-000009") && ts_count(async_dir, ".") == 0,
               "keep_last 2: %d snapshots, %d temporaries", ts_count(async_dir, "step-"), ts_count(async_dir, "."));
    tsys_state_saver_free(sv);
    ts_run_free(&a); ts_run_free(&b);
}

// The writer's failure reaches the caller: at the next wait (or save) as the context's error, naming
// the path; a bad desc fails at the call, nothing started; freeing a saver with a snapshot in flight
// finishes it.
TSYS_TEST(state_save_async_errors_and_free) {
    const char *dir = ts_dir("async_err");
    ts_run a = ts_run_new(3, false, false, 32);
    ts_step(&a, 0);
    tsys_state_saver *sv = tsys_state_saver_new(a.ctx);
    TEST_CHECK(mkdir(dir, 0755) == 0, "mkdir %s", dir);
    char blocker[1024];
    snprintf(blocker, sizeof blocker, "%s/step-000001", dir);
    FILE *f = fopen(blocker, "w");   // a file where the snapshot goes: the writer's rename fails
    TEST_CHECK(f != NULL, "make %s", blocker);
    if (f) fclose(f);
    tsys_state_desc d = ts_desc(&a, 1);
    TEST_CHECK(tsys_state_save_async(sv, dir, &d) == TSYS_OK, "the call itself succeeds: %s", tsys_ctx_last_error(a.ctx));
    TEST_CHECK(ts_expect_error(a.ctx, tsys_state_saver_wait(sv), "step-000001", "not a snapshot"), "the writer's error at wait");
    TEST_CHECK(ts_count(dir, ".") == 0, "the failed snapshot's temporary is gone");
    d.step = -1;
    TEST_CHECK(ts_expect_error(a.ctx, tsys_state_save_async(sv, dir, &d), "desc.step", NULL), "a bad step fails at the call");
    d.step = 2;
    TEST_CHECK(tsys_state_save_async(sv, dir, &d) == TSYS_OK, "save_async: %s", tsys_ctx_last_error(a.ctx));
    tsys_state_saver_free(sv);   // waits: the snapshot is complete
    ts_run b = ts_run_new(4, false, false, 32);
    char snap[1024];
    snprintf(snap, sizeof snap, "%s/step-000002", dir);
    tsys_state_desc ld = ts_desc(&b, 0);
    TEST_CHECK(tsys_state_load(b.ctx, snap, &ld, NULL) == TSYS_OK, "load after free: %s", tsys_ctx_last_error(b.ctx));
    ts_run_free(&a); ts_run_free(&b);
}

// ---- the checksum -----------------------------------------------------------------------------------

#ifdef TSYS_IMPLEMENTATION
TSYS_TEST(state_crc32c_vectors) {
    tsys__crc32c c;
    tsys__crc32c_init(&c);
    unsigned char zeros[32] = {0}, ones[32], buf[4099];
    memset(ones, 0xff, sizeof ones);
    for (int pass = 0; pass < 2; pass++) {   // the instruction (when there), then the tables
        if (pass) c.hw = false;
        TEST_CHECK(tsys__crc32c_update(&c, 0, "123456789", 9) == 0xE3069283u, "check value %08x", tsys__crc32c_update(&c, 0, "123456789", 9));
        TEST_CHECK(tsys__crc32c_update(&c, 0, zeros, 32) == 0x8A9136AAu, "32 zeros (RFC 3720 B.4)");
        TEST_CHECK(tsys__crc32c_update(&c, 0, ones, 32) == 0x62A8AB43u, "32 0xff (RFC 3720 B.4)");
    }
    for (size_t i = 0; i < sizeof buf; i++) buf[i] = (unsigned char)(i * 131 + (i >> 5));
    tsys__crc32c hw = c;
    tsys__crc32c_init(&hw);
    uint32_t whole = tsys__crc32c_update(&c, 0, buf, sizeof buf), pieces = 0;
    for (size_t at = 0, k = 1; at < sizeof buf; at += k, k = k * 3 % 61 + 1) {   // odd sizes, odd alignments
        size_t n = at + k > sizeof buf ? sizeof buf - at : k;
        pieces = tsys__crc32c_update(&c, pieces, buf + at, n);
    }
    TEST_CHECK(pieces == whole, "chained %08x, whole %08x", pieces, whole);
    TEST_CHECK(tsys__crc32c_update(&hw, 0, buf + 3, sizeof buf - 3) == tsys__crc32c_update(&c, 0, buf + 3, sizeof buf - 3), "the instruction and the tables agree");
}
#endif

// ---- corruption, truncation, strict checks ------------------------------------------------------------

// A saved snapshot of a fresh run (one step trained) in dir; returns its path in snap.
static ts_run ts_saved(const char *dir, char *snap, size_t len) {
    ts_run r = ts_run_new(5, false, false, 32);
    ts_step(&r, 0);
    tsys_state_desc d = ts_desc(&r, 1);
    TEST_CHECK(tsys_state_save(r.ctx, dir, &d) == TSYS_OK, "save: %s", tsys_ctx_last_error(r.ctx));
    snprintf(snap, len, "%s/step-000001", dir);
    return r;
}

// Loads snap into a fresh run, expecting an error naming a and b, and the run untouched.
static void ts_load_fails(const char *snap, const char *a, const char *b) {
    ts_run r = ts_run_new(77, false, false, 32);
    size_t n0, n1;
    unsigned char *before = ts_values(&r, &n0);
    ts_run twin = ts_run_new(77, false, false, 32);   // the same draws from the same seed
    tsys_state_desc d = ts_desc(&r, 0);
    TEST_CHECK(ts_expect_error(r.ctx, tsys_state_load(r.ctx, snap, &d, NULL), a, b), "load of %s", snap);
    unsigned char *after = ts_values(&r, &n1);
    TEST_CHECK(n0 == n1 && memcmp(before, after, n0) == 0, "a refused load wrote tensors");
    TEST_CHECK(tsys_rng_next(r.ctx) == tsys_rng_next(twin.ctx) && tsys_optim_steps(r.opt) == 0, "a refused load set the RNG or the step count");
    free(before); free(after);
    ts_run_free(&twin);
    ts_run_free(&r);
}

static void ts_flip(const char *path, long at) {
    FILE *f = fopen(path, "r+b");
    int c;
    if (!f || fseek(f, at, SEEK_SET) != 0 || (c = fgetc(f)) == EOF || fseek(f, at, SEEK_SET) != 0 || fputc(c ^ 0x20, f) == EOF) printf("    cannot flip %s:%ld\n", path, at);
    if (f) fclose(f);
}

static long ts_size(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 ? (long)st.st_size : -1;
}

TSYS_TEST(state_every_corrupted_byte_position_detected) {
    const char *dir = ts_dir("corrupt");
    char snap[1024], path[1200];
    ts_run r = ts_saved(dir, snap, sizeof snap);
    const char *files[3] = {"MANIFEST", "model.safetensors", "train_state.safetensors"};
    for (int f = 0; f < 3; f++) {
        snprintf(path, sizeof path, "%s/%s", snap, files[f]);
        long size = ts_size(path);
        long where[5] = {0, 9, size / 3, size / 2, size - 1};
        for (int w = 0; w < 5; w++) {
            ts_flip(path, where[w]);
            ts_load_fails(snap, files[f], f == 0 ? "MANIFEST" : "altered");
            ts_flip(path, where[w]);
        }
    }
    // every byte of the manifest, one at a time
    snprintf(path, sizeof path, "%s/MANIFEST", snap);
    int missed = 0;
    for (long at = 0, size = ts_size(path); at < size; at++) {
        ts_flip(path, at);
        tsys_state_desc d = ts_desc(&r, 0);
        tsys_status s = tsys_state_load(r.ctx, snap, &d, NULL);
        missed += s == TSYS_OK || !strstr(tsys_ctx_last_error(r.ctx), "MANIFEST");
        tsys_ctx_clear_error(r.ctx);
        ts_flip(path, at);
    }
    TEST_CHECK(missed == 0, "%d flipped manifest bytes went unnoticed", missed);
    tsys_state_desc d = ts_desc(&r, 0);
    TEST_CHECK(tsys_state_load(r.ctx, snap, &d, NULL) == TSYS_OK, "the restored snapshot loads: %s", tsys_ctx_last_error(r.ctx));
    ts_run_free(&r);
}

TSYS_TEST(state_truncated_file_detected) {
    const char *dir = ts_dir("truncate");
    char snap[1024], path[1200];
    ts_run r = ts_saved(dir, snap, sizeof snap);
    const char *files[3] = {"model.safetensors", "train_state.safetensors", "MANIFEST"};
    for (int f = 0; f < 3; f++) {
        snprintf(path, sizeof path, "%s/%s", snap, files[f]);
        long size = ts_size(path);
        TEST_CHECK(truncate(path, size - 1) == 0, "truncate");
        ts_load_fails(snap, files[f], f < 2 ? "truncated" : "MANIFEST");
        char latest[1024];
        TEST_CHECK(tsys_state_latest(r.ctx, dir, latest, sizeof latest) == TSYS_OK && !latest[0], "latest skips a snapshot with a short file: '%s'", latest);
        TEST_CHECK(truncate(path, 0) == 0, "truncate");
        ts_load_fails(snap, files[f], f < 2 ? "truncated" : "MANIFEST");
        ts_rm_rf(dir);
        ts_run_free(&r);
        r = ts_saved(dir, snap, sizeof snap);
    }
    snprintf(path, sizeof path, "%s/model.safetensors", snap);
    TEST_CHECK(unlink(path) == 0, "unlink");
    ts_load_fails(snap, "model.safetensors", "missing");
    ts_run_free(&r);
}

TSYS_TEST(state_missing_or_mismatched_tensor_named) {
    const char *dir = ts_dir("strict");
    char snap[1024];
    ts_run r = ts_saved(dir, snap, sizeof snap);
    // another d_ff: the first FFN weight is named with both shapes
    ts_run other = ts_run_new(3, false, false, 48);
    tsys_state_desc d = ts_desc(&other, 0);
    TEST_CHECK(ts_expect_error(other.ctx, tsys_state_load(other.ctx, snap, &d, NULL), "layers.0.ffn.w1.weight", "(32, 16)"), "shape");
    ts_run_free(&other);
    // a tensor the snapshot lacks
    int64_t shape[1] = {5};
    tsys_tensor *extra = tsys_tensor_new(r.ctx, TSYS_F32, TSYS_CPU, 1, shape);
    tsys_tensor_set_name(extra, "ema.step");
    tsys_tensor_fill(r.ctx, extra, 3.0f);
    d = ts_desc(&r, 0);
    d.tensors = &extra; d.n_tensors = 1;
    TEST_CHECK(ts_expect_error(r.ctx, tsys_state_load(r.ctx, snap, &d, NULL), "'ema.step' is missing", "model.safetensors"), "missing");
    // saved with it, loaded without: strict
    d.step = 2;
    TEST_CHECK(tsys_state_save(r.ctx, dir, &d) == TSYS_OK, "%s", tsys_ctx_last_error(r.ctx));
    char snap2[1024];
    snprintf(snap2, sizeof snap2, "%s/step-000002", dir);
    tsys_state_desc plain = ts_desc(&r, 0);
    TEST_CHECK(ts_expect_error(r.ctx, tsys_state_load(r.ctx, snap2, &plain, NULL), "ema.step", "strict"), "unexpected");
    // a wrong dtype
    tsys_tensor *wrong = tsys_tensor_new(r.ctx, TSYS_BF16, TSYS_CPU, 1, shape);
    tsys_tensor_set_name(wrong, "ema.step");
    d.tensors = &wrong;
    TEST_CHECK(ts_expect_error(r.ctx, tsys_state_load(r.ctx, snap2, &d, NULL), "ema.step", "bf16"), "dtype");
    d.tensors = &extra;
    tsys_tensor_fill(r.ctx, extra, 0.0f);
    TEST_CHECK(tsys_state_load(r.ctx, snap2, &d, NULL) == TSYS_OK, "%s", tsys_ctx_last_error(r.ctx));
    float v[5];
    tsys_tensor_to_f32(r.ctx, extra, v);
    TEST_CHECK(v[0] == 3.0f && v[4] == 3.0f, "the extra tensor came back: %g", (double)v[0]);
    // another optimizer, a scaler that was not saved, an RNG that was not saved
    ts_run sgd = ts_run_new(3, true, false, 32);
    d = ts_desc(&sgd, 0);
    TEST_CHECK(ts_expect_error(sgd.ctx, tsys_state_load(sgd.ctx, snap, &d, NULL), "optimizer 'adamw'", "sgd"), "optimizer kind");
    ts_run_free(&sgd);
    tsys_grad_scaler g = tsys_grad_scaler_init();
    d = ts_desc(&r, 0);
    d.scaler = &g;
    TEST_CHECK(ts_expect_error(r.ctx, tsys_state_load(r.ctx, snap, &d, NULL), "no loss scaler", NULL), "scaler");
    d = ts_desc(&r, 3);
    d.no_rng = true;
    TEST_CHECK(tsys_state_save(r.ctx, dir, &d) == TSYS_OK, "%s", tsys_ctx_last_error(r.ctx));
    d.no_rng = false;
    snprintf(snap2, sizeof snap2, "%s/step-000003", dir);
    TEST_CHECK(ts_expect_error(r.ctx, tsys_state_load(r.ctx, snap2, &d, NULL), "no RNG state", NULL), "rng");
    d.no_rng = true;
    TEST_CHECK(tsys_state_load(r.ctx, snap2, &d, NULL) == TSYS_OK, "%s", tsys_ctx_last_error(r.ctx));
    // what save refuses
    d = ts_desc(&r, 4);
    const char *bad_key[2] = {"has space", "x"}, *dup[4] = {"k", "1", "k", "2"};
    d.user = bad_key; d.n_user = 1;
    TEST_CHECK(ts_expect_error(r.ctx, tsys_state_save(r.ctx, dir, &d), "user key 'has space'", NULL), "key");
    d.user = dup; d.n_user = 2;
    TEST_CHECK(ts_expect_error(r.ctx, tsys_state_save(r.ctx, dir, &d), "'k' given twice", NULL), "duplicate");
    const char *not_utf8[2] = {"note", "caf\xe9"}, *utf8[2] = {"note", "caf\xc3\xa9 \"quoted\"\n"};
    d.user = not_utf8; d.n_user = 1;
    TEST_CHECK(ts_expect_error(r.ctx, tsys_state_save(r.ctx, dir, &d), "'note'", "UTF-8"), "a value that is not UTF-8");
    d.user = utf8;   // UTF-8, quotes and control characters are fine (escaped in the JSON header)
    TEST_CHECK(tsys_state_save(r.ctx, dir, &d) == TSYS_OK, "%s", tsys_ctx_last_error(r.ctx));
    tsys_state_info info;
    snprintf(snap2, sizeof snap2, "%s/step-000004", dir);
    d.user = NULL; d.n_user = 0;
    TEST_CHECK(tsys_state_load(r.ctx, snap2, &d, &info) == TSYS_OK && tsys_state_info_get(&info, "note") &&
               strcmp(tsys_state_info_get(&info, "note"), utf8[1]) == 0, "the value comes back byte for byte: %s", tsys_ctx_last_error(r.ctx));
    d.step = 5;
    d.user = NULL; d.n_user = 0; d.name = "a/b";
    TEST_CHECK(ts_expect_error(r.ctx, tsys_state_save(r.ctx, dir, &d), "'a/b'", NULL), "name");
    d.name = ".hidden";
    TEST_CHECK(ts_expect_error(r.ctx, tsys_state_save(r.ctx, dir, &d), "'.hidden'", NULL), "name");
    d.name = NULL; d.step = -1;
    TEST_CHECK(ts_expect_error(r.ctx, tsys_state_save(r.ctx, dir, &d), "desc.step is -1", NULL), "step");
    TEST_CHECK(ts_count(dir, ".tmp-") == 0, "a refused save leaves no temporary");
    tsys_tensor_release(extra); tsys_tensor_release(wrong);
    ts_run_free(&r);
}

// ---- directories of snapshots ----------------------------------------------------------------------

// A snapshot of one tensor filled with v, named by step.
static tsys_status ts_save_value(tsys_ctx *ctx, const char *dir, int64_t step, float v, int keep_last, const char *name) {
    int64_t shape[1] = {3};
    tsys_tensor *t = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, shape);
    tsys_tensor_set_name(t, "w");
    tsys_tensor_fill(ctx, t, v);
    tsys_state_desc d;
    memset(&d, 0, sizeof d);
    d.tensors = &t; d.n_tensors = 1; d.step = step; d.keep_last = keep_last; d.name = name;
    tsys_status s = tsys_state_save(ctx, dir, &d);
    tsys_tensor_release(t);
    return s;
}

static float ts_load_value(tsys_ctx *ctx, const char *snap, int64_t *step) {
    int64_t shape[1] = {3};
    tsys_tensor *t = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, shape);
    tsys_tensor_set_name(t, "w");
    tsys_state_desc d;
    memset(&d, 0, sizeof d);
    d.tensors = &t; d.n_tensors = 1;
    tsys_state_info info;
    float v[3] = {NAN, NAN, NAN};
    if (tsys_state_load(ctx, snap, &d, &info) == TSYS_OK) { tsys_tensor_to_f32(ctx, t, v); *step = info.step; }
    tsys_tensor_release(t);
    return v[0] == v[2] ? v[0] : NAN;
}

// Snapshots beyond keep_last left by writers that died between an install and its keep_last are removed before
// the next save writes, so that the next crash at that point leaves keep + 1 at most (tests/test_state_fault.sh
// once found 5 with keep 3). Here the save fails at its install: a file holds the new snapshot's name.
TSYS_TEST(state_keep_last_prunes_before_writing) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    const char *dir = ts_dir("keep_before");
    char path[1200];
    for (int step = 10; step <= 50; step += 10)
        TEST_CHECK(ts_save_value(ctx, dir, step, (float)step, 0, NULL) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    snprintf(path, sizeof path, "%s/step-000060", dir);
    FILE *f = fopen(path, "wb");
    if (f) { fputs("not a snapshot", f); fclose(f); }
    TEST_CHECK(ts_save_value(ctx, dir, 60, 60.0f, 2, NULL) != TSYS_OK && strstr(tsys_ctx_last_error(ctx), "not a snapshot"),
               "the save into a taken name: %s", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(!ts_exists(dir, "step-000010") && !ts_exists(dir, "step-000020") && !ts_exists(dir, "step-000030") &&
                   ts_exists(dir, "step-000040") && ts_exists(dir, "step-000050"),
               "the failed save kept the newest 2 of 5 (10: %d, 30: %d, 40: %d)", ts_exists(dir, "step-000010"), ts_exists(dir, "step-000030"),
               ts_exists(dir, "step-000040"));
    TEST_CHECK(ts_count(dir, ".") == 0, "no temporaries left");
    tsys_ctx_free(ctx);
}

TSYS_TEST(state_keep_last_removes_the_oldest) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    const char *dir = ts_dir("keep");
    char latest[1024], path[1200];
    TEST_CHECK(tsys_state_latest(ctx, dir, latest, sizeof latest) == TSYS_OK && !latest[0], "no directory: no snapshot");
    for (int step = 10; step <= 50; step += 10)
        TEST_CHECK(ts_save_value(ctx, dir, step, (float)step, 2, NULL) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    TEST_CHECK(!ts_exists(dir, "step-000010") && !ts_exists(dir, "step-000020") && !ts_exists(dir, "step-000030"), "the three oldest are gone");
    TEST_CHECK(ts_exists(dir, "step-000040") && ts_exists(dir, "step-000050"), "the two newest stay");
    TEST_CHECK(ts_count(dir, ".") == 0, "no temporaries left");
    // things that are not snapshots are neither loaded nor removed
    snprintf(path, sizeof path, "%s/notes", dir);
    mkdir(path, 0755);
    snprintf(path, sizeof path, "%s/.tmp-123@otherhost-abcdef", dir);   // another host's writer: not ours to judge
    mkdir(path, 0755);
    TEST_CHECK(ts_save_value(ctx, dir, 60, 60.0f, 2, NULL) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    TEST_CHECK(ts_exists(dir, "notes") && ts_exists(dir, ".tmp-123@otherhost-abcdef") && !ts_exists(dir, "step-000040"), "keep_last touches snapshots only");
    TEST_CHECK(tsys_state_latest(ctx, dir, latest, sizeof latest) == TSYS_OK && strstr(latest, "step-000060"), "latest '%s'", latest);
    // a temporary of a dead writer of this host is removed by the next save
    pid_t child = fork();
    if (child == 0) _exit(0);
    waitpid(child, NULL, 0);
    char host[64];
    gethostname(host, sizeof host);
    host[63] = 0;
    for (char *c = host; *c; c++) if (*c == '-' || *c == '/' || *c == '@') *c = '_';
    snprintf(path, sizeof path, "%s/.tmp-%ld@%s-Zz09Ab", dir, (long)child, host);
    mkdir(path, 0755);
    char junk[1300];
    snprintf(junk, sizeof junk, "%s/model.safetensors", path);
    FILE *f = fopen(junk, "wb");
    if (f) { fputs("half a file", f); fclose(f); }
    TEST_CHECK(ts_save_value(ctx, dir, 70, 70.0f, 0, NULL) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    TEST_CHECK(ts_count(dir, ".tmp-") == 1, "the dead writer's temporary is gone, the other host's stays (%d)", ts_count(dir, ".tmp-"));
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    tsys_ctx_free(ctx);
}

TSYS_TEST(state_newest_is_the_last_saved_and_names_are_replaced) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    const char *dir = ts_dir("rewind");
    char latest[1024];
    int64_t step = -1;
    TEST_CHECK(ts_save_value(ctx, dir, 50, 1.0f, 0, NULL) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    // a run restarted from an earlier step: its saves are the newest, whatever their step
    TEST_CHECK(ts_save_value(ctx, dir, 30, 2.0f, 0, NULL) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    TEST_CHECK(tsys_state_latest(ctx, dir, latest, sizeof latest) == TSYS_OK && strstr(latest, "step-000030"), "latest '%s'", latest);
    // the same name again: replaced whole
    TEST_CHECK(ts_save_value(ctx, dir, 50, 3.0f, 0, NULL) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    TEST_CHECK(tsys_state_latest(ctx, dir, latest, sizeof latest) == TSYS_OK && strstr(latest, "step-000050"), "latest '%s'", latest);
    TEST_CHECK(ts_load_value(ctx, latest, &step) == 3.0f && step == 50, "the replaced snapshot holds the new values (step %lld)", (long long)step);
    TEST_CHECK(ts_count(dir, ".") == 0, "nothing left aside");
    // a caller's name; something there that is not a snapshot is left alone
    TEST_CHECK(ts_save_value(ctx, dir, 60, 4.0f, 0, "final") == TSYS_OK && ts_exists(dir, "final/MANIFEST"), "%s", tsys_ctx_last_error(ctx));
    char path[1200];
    snprintf(path, sizeof path, "%s/mine", dir);
    FILE *f = fopen(path, "wb");
    if (f) { fputs("not a snapshot", f); fclose(f); }
    TEST_CHECK(ts_expect_error(ctx, ts_save_value(ctx, dir, 70, 5.0f, 0, "mine"), "mine", "not a snapshot"), "a file in the way");
    TEST_CHECK(ts_size(path) == 14 && ts_count(dir, ".") == 0, "the file stays, no temporary left");
    TEST_CHECK(tsys_state_latest(ctx, dir, latest, sizeof latest) == TSYS_OK && strstr(latest, "/final"), "latest '%s'", latest);
    char small[8];
    TEST_CHECK(ts_expect_error(ctx, tsys_state_latest(ctx, dir, small, sizeof small), "does not fit", NULL) && !small[0], "a short buffer");
    tsys_ctx_free(ctx);
}

// A save that fails half way (the file size limit, as a full disk would) leaves the earlier snapshot
// the newest, whole, and no temporary. In a child, so the limit does not outlive the test; the child
// launches no kernel (its tensor comes from host data), so no OpenMP pool runs after the fork.
TSYS_TEST(state_failed_save_leaves_the_previous_one) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    const char *dir = ts_dir("full_disk");
    char latest[1024];
    int64_t step = -1;
    TEST_CHECK(ts_save_value(ctx, dir, 1, 1.0f, 1, NULL) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    fflush(stdout);
    pid_t kid = fork();
    if (kid == 0) {
        struct rlimit lim = { 64 * 1024, 64 * 1024 };
        signal(SIGXFSZ, SIG_IGN);   // write() then fails with EFBIG instead of killing the process
        tsys_ctx *c = tsys_ctx_new(NULL);
        int64_t shape[1] = {1 << 20};
        float *host = (float *)calloc((size_t)shape[0], sizeof(float));
        tsys_tensor *t = c && host ? tsys_tensor_from_data(c, TSYS_F32, TSYS_CPU, 1, shape, host) : NULL;
        tsys_tensor_set_name(t, "w");
        tsys_state_desc d;
        memset(&d, 0, sizeof d);
        d.tensors = &t; d.n_tensors = 1; d.step = 2; d.keep_last = 1;
        bool ok = t && setrlimit(RLIMIT_FSIZE, &lim) == 0;
        tsys_status s = ok ? tsys_state_save(c, dir, &d) : TSYS_OK;
        const char *msg = c ? tsys_ctx_last_error(c) : "";
        bool named = strstr(msg, "model.safetensors") != NULL;
        if (ok && (s != TSYS_ERR_IO || !named)) fprintf(stderr, "    child: status %d, message %s\n", (int)s, msg);
        _exit(!ok ? 2 : s == TSYS_ERR_IO && named ? 0 : 1);
    }
    int status = -1;
    if (kid > 0) while (waitpid(kid, &status, 0) < 0 && errno == EINTR) { }
    TEST_CHECK(kid > 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0, "a save past the file size limit fails naming the file (status %d)", status);
    TEST_CHECK(ts_count(dir, ".") == 0 && !ts_exists(dir, "step-000002"), "no temporary, no new snapshot");
    TEST_CHECK(tsys_state_latest(ctx, dir, latest, sizeof latest) == TSYS_OK && strstr(latest, "step-000001"), "latest '%s'", latest);
    TEST_CHECK(ts_load_value(ctx, latest, &step) == 1.0f && step == 1, "the earlier snapshot is whole");
    // no such snapshot, a file for a directory, a directory that cannot be made
    char path[1200];
    snprintf(path, sizeof path, "%s/step-000009", dir);
    tsys_state_desc d;
    memset(&d, 0, sizeof d);
    TEST_CHECK(ts_expect_error(ctx, tsys_state_load(ctx, path, &d, NULL), "step-000009", "no readable MANIFEST"), "no snapshot");
    snprintf(path, sizeof path, "%s/step-000001/MANIFEST", dir);
    TEST_CHECK(ts_expect_error(ctx, tsys_state_latest(ctx, path, latest, sizeof latest), "MANIFEST", "cannot list"), "a file for a directory");
    TEST_CHECK(ts_expect_error(ctx, ts_save_value(ctx, path, 3, 3.0f, 0, NULL), "MANIFEST", NULL), "save into a file");
    snprintf(path, sizeof path, "%s/no/such/dir", dir);
    TEST_CHECK(ts_expect_error(ctx, ts_save_value(ctx, path, 3, 3.0f, 0, NULL), "no/such/dir", "cannot make the directory"), "a missing parent");
    tsys_ctx_free(ctx);
}

TSYS_TEST(state_scaler_fields_round_trip) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    const char *dir = ts_dir("scaler");
    tsys_grad_scaler g = tsys_grad_scaler_init(), back = tsys_grad_scaler_init();
    g.scale = 3.14159274f * 1024.0f; g.growth_factor = 1.75f; g.backoff_factor = 0.3f; g.growth_interval = 33; g.growth_tracker = 17;
    back.found_inf = true;
    tsys_state_desc d;
    memset(&d, 0, sizeof d);
    d.scaler = &g; d.step = 9;
    TEST_CHECK(tsys_state_save(ctx, dir, &d) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    d.scaler = &back;
    char snap[1024];
    snprintf(snap, sizeof snap, "%s/step-000009", dir);
    TEST_CHECK(tsys_state_load(ctx, snap, &d, NULL) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    TEST_CHECK(memcmp(&g, &back, sizeof g) == 0, "scale %.9g/%.9g growth %g/%g backoff %g/%g interval %d/%d tracker %d/%d found_inf %d", (double)g.scale, (double)back.scale,
               (double)g.growth_factor, (double)back.growth_factor, (double)g.backoff_factor, (double)back.backoff_factor, g.growth_interval, back.growth_interval,
               g.growth_tracker, back.growth_tracker, back.found_inf);
    tsys_ctx_free(ctx);
}

// ---- the fault modes (tests/test_state_fault.sh) --------------------------------------------------------

enum { TS_FAULT_W = 1 << 18, TS_FAULT_B = 37, TS_FAULT_KEEP = 3 };

// The content saved at step s: w, b and their AdamW moments, functions of s; the RNG seeded s.
typedef struct ts_fault { tsys_ctx *ctx; tsys_tensor *t[2]; tsys_optim *opt; } ts_fault;

static void ts_fault_free(ts_fault *f) {
    tsys_optim_free(f->opt);
    tsys_tensor_release(f->t[0]); tsys_tensor_release(f->t[1]);
    tsys_ctx_free(f->ctx);
}

static ts_fault ts_fault_new(void) {
    ts_fault f;
    f.ctx = tsys_ctx_new(NULL);
    int64_t sw[1] = {TS_FAULT_W}, sb[2] = {TS_FAULT_B, 3};
    f.t[0] = tsys_tensor_new(f.ctx, TSYS_F32, TSYS_CPU, 1, sw);
    f.t[1] = tsys_tensor_new(f.ctx, TSYS_F32, TSYS_CPU, 2, sb);
    tsys_tensor_set_name(f.t[0], "w");
    tsys_tensor_set_name(f.t[1], "layers.0.b");
    f.opt = tsys_adamw_new(f.ctx, f.t, 2, NULL);
    return f;
}

static float ts_fault_value(int64_t step, int which, int tensor, int64_t i) { return (float)(step * 8 + which * 2 + tensor) + (float)(i % 1024) * 0.25f; }

// Fills (or with check, compares) every tensor with step's values; the number of differences.
static int64_t ts_fault_fill(ts_fault *f, int64_t step, bool check) {
    int64_t bad = 0;
    for (int which = 0; which < 3; which++)
        for (int k = 0; k < 2; k++) {
            tsys_tensor *t = which ? tsys_optim_state(f->opt, k, which - 1) : tsys_tensor_retain(f->t[k]);
            float *v = (float *)tsys_tensor_data(t);
            for (int64_t i = 0, n = tsys_tensor_numel(t); i < n; i++) {
                float want = ts_fault_value(step, which, k, i);
                if (check) bad += v[i] != want;
                else v[i] = want;
            }
            tsys_tensor_mark_written(t);
            tsys_tensor_release(t);
        }
    return bad;
}

static tsys_state_desc ts_fault_desc(ts_fault *f, int64_t step, const char **user, char *pos) {
    tsys_state_desc d;
    memset(&d, 0, sizeof d);
    d.tensors = f->t; d.n_tensors = 2; d.optim = f->opt; d.step = step; d.keep_last = TS_FAULT_KEEP;
    snprintf(pos, 32, "%lld", (long long)(step * 10));
    user[0] = "data_pos"; user[1] = pos;
    d.user = user; d.n_user = 1;
    return d;
}

// Resumes from the newest snapshot (loading it, checksums and all), then saves step after step; the
// second of every three saves is of the same step again, so kills land in replacements too (the old
// snapshot moved aside, the new one renamed in, the old one removed).
static int ts_fault_writer(const char *dir, long saves) {
    ts_fault f = ts_fault_new();
    char latest[1024], pos[32];
    const char *user[2];
    int64_t step = 0;
    if (tsys_state_latest(f.ctx, dir, latest, sizeof latest) == TSYS_OK && latest[0]) {
        tsys_state_info info;
        tsys_state_desc d = ts_fault_desc(&f, 0, user, pos);
        if (tsys_state_load(f.ctx, latest, &d, &info) != TSYS_OK) { printf("resume: %s\n", tsys_ctx_last_error(f.ctx)); return 1; }
        step = info.step;
    }
    // every other save goes through the asynchronous saver (its thread writes while the next step's
    // values are filled in); one writer per directory: a synchronous save waits for it first
    tsys_state_saver *sv = tsys_state_saver_new(f.ctx);
    for (long k = 0; sv && (saves <= 0 || k < saves); k++) {
        if (k % 3 != 1) step++;
        ts_fault_fill(&f, step, false);
        tsys_rng_seed(f.ctx, (uint64_t)step);
        tsys_state_desc d = ts_fault_desc(&f, step, user, pos);
        tsys_status s = k % 2 ? tsys_state_save_async(sv, dir, &d) : tsys_state_saver_wait(sv);
        if (s == TSYS_OK && k % 2 == 0) s = tsys_state_save(f.ctx, dir, &d);
        if (s != TSYS_OK) { printf("save: %s\n", tsys_ctx_last_error(f.ctx)); return 1; }
    }
    if (!sv || tsys_state_saver_wait(sv) != TSYS_OK) { printf("saver: %s\n", tsys_ctx_last_error(f.ctx)); return 1; }
    tsys_state_saver_free(sv);
    ts_fault_free(&f);
    return 0;
}

// The newest snapshot loads, checksums verified, and holds exactly what its step saved.
static int ts_fault_check(const char *dir, long min_step) {
    ts_fault f = ts_fault_new();
    char latest[1024], pos[32];
    const char *user[2];
    if (tsys_state_latest(f.ctx, dir, latest, sizeof latest) != TSYS_OK) { printf("latest: %s\n", tsys_ctx_last_error(f.ctx)); return 1; }
    if (!latest[0]) { printf("step 0 (no snapshot yet)\n"); return min_step > 0; }
    tsys_state_info info;
    tsys_state_desc d = ts_fault_desc(&f, 0, user, pos);
    if (tsys_state_load(f.ctx, latest, &d, &info) != TSYS_OK) { printf("load %s: %s\n", latest, tsys_ctx_last_error(f.ctx)); return 1; }
    int64_t bad = ts_fault_fill(&f, info.step, true);
    tsys_ctx *ref = tsys_ctx_new(NULL);
    tsys_rng_seed(ref, (uint64_t)info.step);
    const char *p = tsys_state_info_get(&info, "data_pos");
    int snaps = ts_count(dir, "step-");
    bool ok = bad == 0 && info.step >= min_step && tsys_rng_next(ref) == tsys_rng_next(f.ctx) && p && atoll(p) == info.step * 10 && snaps <= TS_FAULT_KEEP + 1;
    if (!ok) printf("%s: step %lld (at least %ld), %lld values differ, data_pos %s, %d snapshots\n", latest, (long long)info.step, min_step, (long long)bad, p ? p : "NULL", snaps);
    printf("step %lld\n", (long long)info.step);
    tsys_ctx_free(ref);
    ts_fault_free(&f);
    return ok ? 0 : 1;
}

// ---- a snapshot for PyTorch (tests/ref/state_resume_torch.py) -------------------------------------------

// Trains the test model 3 AdamW steps (lr 1e-2, no clipping: what torch.optim.AdamW does alone),
// saves DIR/step-000003, then takes one more step on the next batch and writes what it saw to
// DIR/expect.safetensors: input_ids, targets (int64), loss, and after.<name> for every parameter.
static int ts_export_torch(const char *dir) {
    ts_run r = ts_run_new(2024, false, false, 32);
    int64_t shape[2] = {2, 8};
    tsys_optim_set_lr(r.opt, 1e-2f);
    tsys_tensor *ids = tsys_tensor_new(r.ctx, TSYS_I64, TSYS_CPU, 2, shape), *tgt = tsys_tensor_new(r.ctx, TSYS_I64, TSYS_CPU, 2, shape);
    tsys_tensor *loss = NULL;
    for (int it = 0; it < 4; it++) {
        if (it == 3) {
            tsys_state_desc d = ts_desc(&r, 3);
            if (tsys_state_save(r.ctx, dir, &d) != TSYS_OK) break;
        }
        tsys_tensor_randint(r.ctx, ids, 37);
        tsys_tensor_randint(r.ctx, tgt, 37);
        tsys_tensor *logits = tsys_model_forward(r.m, ids);
        tsys_tensor_release(loss);
        loss = tsys_cross_entropy(r.ctx, logits, tgt);
        tsys_backward(r.ctx, loss);
        tsys_optim_step(r.opt);
        tsys_optim_zero_grad(r.opt);
        tsys_tensor_release(logits);
    }
    int np = tsys_model_num_tensors(r.m);
    tsys_tensor **out = (tsys_tensor **)calloc((size_t)np + 3, sizeof *out);
    tsys_tensor_set_name(ids, "input_ids"); tsys_tensor_set_name(tgt, "targets"); tsys_tensor_set_name(loss, "loss");
    out[0] = tsys_tensor_retain(ids); out[1] = tsys_tensor_retain(tgt); out[2] = tsys_tensor_retain(loss);
    for (int i = 0; i < np; i++) {
        out[3 + i] = tsys_tensor_clone(r.ctx, tsys_model_params(r.m)[i]);
        tsys_tensor_set_name(out[3 + i], "after.%s", tsys_model_params(r.m)[i]->name);
    }
    char path[1024];
    snprintf(path, sizeof path, "%s/expect.safetensors", dir);
    tsys_status s = tsys_ctx_status(r.ctx) == TSYS_OK ? tsys_safetensors_save(r.ctx, path, out, np + 3) : tsys_ctx_status(r.ctx);
    if (s != TSYS_OK) printf("export: %s\n", tsys_ctx_last_error(r.ctx));
    else printf("wrote %s/step-000003 and %s (the loss of the step after the snapshot: %.9g)\n", dir, path, (double)tsys_item(r.ctx, loss));
    for (int i = 0; i < np + 3; i++) tsys_tensor_release(out[i]);
    tsys_tensor_release(ids); tsys_tensor_release(tgt); tsys_tensor_release(loss);
    free(out);
    ts_run_free(&r);
    return s == TSYS_OK ? 0 : 1;
}

// ---- sharded snapshots: the building blocks ----------------------------------------------------------

// A snapshot of two parts: x (3, 4) = 0..11 split at element `cut` (part 1 from `from`: a gap or an
// overlap when it differs from cut), y (2) whole in part 0.
static tsys_status ts_sharded(tsys_ctx *ctx, const char *dir, const char *name, int cut, int from) {
    float xv[12], yv[2] = {-1.0f, -2.0f};
    for (int i = 0; i < 12; i++) xv[i] = (float)i;
    int64_t n0 = cut, n1 = 12 - from, two = 2;
    tsys_tensor *a = tsys_tensor_from_data(ctx, TSYS_F32, TSYS_CPU, 1, &n0, xv), *b = tsys_tensor_from_data(ctx, TSYS_F32, TSYS_CPU, 1, &n1, xv + from);
    tsys_tensor *y = tsys_tensor_from_data(ctx, TSYS_F32, TSYS_CPU, 1, &two, yv);
    tsys_state_chunk c0[2] = {{"x", a, 2, {3, 4}, 0}, {"y", y, 1, {2}, 0}}, c1[1] = {{"x", b, 2, {3, 4}, from}};
    tsys_state_part parts[2];
    char tmp[1024];
    tsys_state_desc sd;
    memset(&sd, 0, sizeof sd);
    sd.step = 5; sd.no_rng = true;
    tsys_status s = tsys_state_begin(ctx, dir, tmp, sizeof tmp);
    if (s == TSYS_OK) s = tsys_state_part_write(ctx, tmp, "rank-00000.safetensors", c0, 2, &sd, &parts[0]);
    if (s == TSYS_OK) s = tsys_state_part_write(ctx, tmp, "rank-00001.safetensors", c1, 1, NULL, &parts[1]);
    tsys_state_commit_desc c = {name, 5, 2, "test", parts, 2, 0};
    if (s == TSYS_OK) s = tsys_state_commit(ctx, dir, tmp, &c);
    else tsys_state_abort(tmp);
    tsys_tensor_release(a); tsys_tensor_release(b); tsys_tensor_release(y);
    return s;
}

TSYS_TEST(state_sharded_parts_ranges_consolidate) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    const char *dir = ts_dir("sharded"), *plain = ts_dir("sharded_plain");
    char snap[1024], path[1100];
    TEST_CHECK(ts_sharded(ctx, dir, "s", 5, 5) == TSYS_OK, "sharded save: %s", tsys_ctx_last_error(ctx));
    snprintf(snap, sizeof snap, "%s/s", dir);
    char latest[1024];
    TEST_CHECK(tsys_state_latest(ctx, dir, latest, sizeof latest) == TSYS_OK && !strcmp(latest, snap), "latest: '%s'", latest);
    snprintf(path, sizeof path, "%s/MANIFEST", snap);
    FILE *f = fopen(path, "rb");
    char text[2048] = "";
    if (f) { text[fread(text, 1, sizeof text - 1, f)] = 0; fclose(f); }
    TEST_CHECK(strstr(text, "\nworld=2\nlayout=test\nfile=rank-00000.safetensors ") != NULL, "MANIFEST: %s", text);
    tsys_state_desc none;
    memset(&none, 0, sizeof none);
    none.no_rng = true;
    TEST_CHECK(ts_expect_error(ctx, tsys_state_load(ctx, snap, &none, NULL), "sharded snapshot of 2 processes", "tsys_state_consolidate"), "plain load refuses it");
    tsys_state_reader *r = tsys_state_open(ctx, snap);
    TEST_CHECK(r && tsys_state_reader_world(r) == 2 && tsys_state_reader_step(r) == 5 && tsys_state_reader_count(r) == 2, "reader: %s", tsys_ctx_last_error(ctx));
    int64_t six = 6, shape[2] = {3, 4};
    tsys_tensor *mid = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, &six);
    TEST_CHECK(r && tsys_state_read(r, "x", 3, mid) == TSYS_OK, "a range across both parts: %s", tsys_ctx_last_error(ctx));
    const float *m = (const float *)tsys_tensor_data(mid);
    for (int i = 0; r && i < 6; i++) TEST_CHECK(m[i] == (float)(3 + i), "x[%d] = %g", 3 + i, m[i]);
    TEST_CHECK(r && ts_expect_error(ctx, tsys_state_check_range(r, "x", 2, shape, TSYS_F32, 8, 6), "past its 12 elements", NULL), "a range past the end");
    TEST_CHECK(r && ts_expect_error(ctx, tsys_state_check_range(r, "z", 2, shape, TSYS_F32, 0, 1), "holds no tensor 'z'", NULL), "a missing tensor");
    int64_t other[2] = {4, 3};
    TEST_CHECK(r && ts_expect_error(ctx, tsys_state_check_range(r, "x", 2, other, TSYS_F32, 0, 1), "holds f32 (3, 4), the load asks for f32 (4, 3)", NULL), "another shape");
    tsys_state_close(r);
    // a gap at element 5 is named; the ranges around it still read; overlapping chunks are refused
    TEST_CHECK(ts_sharded(ctx, dir, "gap", 5, 6) == TSYS_OK && ts_sharded(ctx, dir, "overlap", 6, 5) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    snprintf(snap, sizeof snap, "%s/gap", dir);
    r = tsys_state_open(ctx, snap);
    TEST_CHECK(r && ts_expect_error(ctx, tsys_state_check_range(r, "x", 2, shape, TSYS_F32, 0, 12), "element 5 (of the range [0, 12) asked for) is in no part", NULL), "the gap");
    TEST_CHECK(r && tsys_state_check_range(r, "x", 2, shape, TSYS_F32, 6, 6) == TSYS_OK, "after the gap: %s", tsys_ctx_last_error(ctx));
    tsys_state_close(r);
    snprintf(snap, sizeof snap, "%s/overlap", dir);
    TEST_CHECK(!tsys_state_open(ctx, snap) && ts_expect_error(ctx, TSYS_ERR_IO, "chunks of rank-00000.safetensors and rank-00001.safetensors overlap at element 5", NULL), "overlap");
    // consolidated: a plain snapshot (x whole in its shape), then a byte of part 1 altered is found by the
    // reads that use part 1 only
    snprintf(snap, sizeof snap, "%s/s", dir);
    TEST_CHECK(tsys_state_consolidate(ctx, snap, plain) == TSYS_OK, "consolidate: %s", tsys_ctx_last_error(ctx));
    tsys_tensor **list = NULL;
    int n = 0;
    snprintf(path, sizeof path, "%s/s/model.safetensors", plain);
    TEST_CHECK(tsys_safetensors_load(ctx, path, TSYS_CPU, &list, &n) == TSYS_OK && n == 2 && list[0]->ndim == 2 && list[0]->shape[1] == 4 &&
               ((const float *)tsys_tensor_data(list[0]))[11] == 11.0f, "consolidated x: %s", tsys_ctx_last_error(ctx));
    tsys_tensor_list_free(list, n);
    snprintf(path, sizeof path, "%s/s", plain);
    tsys_state_reader *pr = tsys_state_open(ctx, path);
    TEST_CHECK(pr && tsys_state_reader_world(pr) == 0 && tsys_state_read(pr, "x", 4, mid) == TSYS_OK && ((const float *)tsys_tensor_data(mid))[0] == 4.0f,
               "a plain snapshot reads by ranges too: %s", tsys_ctx_last_error(ctx));
    tsys_state_close(pr);
    snprintf(path, sizeof path, "%s/rank-00001.safetensors", snap);
    ts_flip(path, ts_size(path) - 3);
    r = tsys_state_open(ctx, snap);
    int64_t four = 4;
    tsys_tensor *head = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, &four);
    TEST_CHECK(r && tsys_state_read(r, "x", 0, head) == TSYS_OK, "part 0 alone: %s", tsys_ctx_last_error(ctx));
    TEST_CHECK(r && ts_expect_error(ctx, tsys_state_read(r, "x", 3, mid), "'rank-00001.safetensors' is altered", NULL), "the altered part");
    tsys_state_close(r);
    tsys_tensor_release(mid); tsys_tensor_release(head);
    tsys_ctx_free(ctx);
}

int main(int argc, char **argv) {
    if (argc >= 3 && strcmp(argv[1], "--fault-writer") == 0) return ts_fault_writer(argv[2], argc > 3 ? atol(argv[3]) : 0);
    if (argc >= 4 && strcmp(argv[1], "--fault-check") == 0) return ts_fault_check(argv[2], atol(argv[3]));
    if (argc >= 3 && strcmp(argv[1], "--export-torch") == 0) return ts_export_torch(argv[2]);
#ifdef TS_ONLY   // the ThreadSanitizer build (Makefile): these tests alone, on one OpenMP thread
    char *only[] = {argv[0], (char *)TS_ONLY, NULL};
    if (argc == 1) { omp_set_num_threads(1); argc = 2; argv = only; }
#endif
    int rc = tsys_test_main(argc, argv);
    if (ts_root[0]) ts_rm_rf(ts_root);
    return rc;
}
