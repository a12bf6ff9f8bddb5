// test_guards.c - bad input never corrupts memory and out of memory is an error, not a kill:
// ops that index by tensor values reject out-of-range ids (naming the op, the value and the range)
// and write nothing; CPU allocations respect the context's budget (by default what the machine has,
// or less: what its memory cgroup, v1 or v2, leaves); memory a tensor wraps goes back to its owner
// once; misuse of the API (a storage shrunk under its tensors, tensors of two contexts, releases after
// tsys_ctx_free, NULL arguments, devices outside the enum, bad optimizer hyper-parameters and
// schedules) is an error naming the input and the rule.
#define _POSIX_C_SOURCE 200809L   // mkdtemp, mkdir, setenv
#define TSYS_IMPLEMENTATION
#include "../tsys.h"
#include "harness.h"
#include "test_util.h"
#include <sys/stat.h>
#include <unistd.h>

static tsys_tensor *ids_of(tsys_ctx *ctx, tsys_dtype dt, int n, const int64_t *vals) {
    int64_t shape[2] = {1, n};
    tsys_tensor *t = tsys_tensor_new(ctx, dt, TSYS_CPU, 2, shape);
    for (int i = 0; i < n; i++) {
        if (dt == TSYS_I64) ((int64_t *)tsys_tensor_data(t))[i] = vals[i];
        else ((int32_t *)tsys_tensor_data(t))[i] = (int32_t)vals[i];
    }
    tsys_tensor_set_name(t, "ids");
    return t;
}

static bool has(const char *msg, const char *part) { return strstr(msg, part) != NULL; }

TSYS_TEST(embedding_rejects_out_of_range_ids) {
    const int64_t bad_values[] = {-1, 10, 11, (int64_t)1 << 40, INT32_MIN};
    const char *bad_text[] = {"-1", "10", "11", "1099511627776", "-2147483648"};
    for (int dti = 0; dti < 2; dti++) {
        tsys_dtype dt = dti ? TSYS_I64 : TSYS_I32;
        for (int b = 0; b < 5; b++) {
            if (dt == TSYS_I32 && b == 3) continue;   // 2^40 does not fit an i32
            tsys_ctx *ctx = tsys_ctx_new(NULL);
            int64_t sw[2] = {10, 4};
            tsys_tensor *w = test_param(ctx, TSYS_CPU, 2, sw, 1);
            int64_t vals[4] = {1, 2, bad_values[b], 3};
            tsys_tensor *ids = ids_of(ctx, dt, 4, vals);
            tsys_tensor *y = tsys_embedding(ctx, w, ids);
            const char *msg = tsys_ctx_last_error(ctx);
            TEST_CHECK(y == NULL && tsys_ctx_status(ctx) == TSYS_ERR_INVALID_ARGS, "id %s accepted", bad_text[b]);
            TEST_CHECK(has(msg, "embedding") && has(msg, bad_text[b]) && has(msg, "[0, 10)") && has(msg, "position 2"), "message: %s", msg);
            TEST_CHECK(tsys_tape_size(ctx) == 0, "a failed op left a tape node");
            tsys_tensor_release(y); tsys_tensor_release(ids); tsys_tensor_release(w);
            tsys_ctx_free(ctx);
        }
    }
}

TSYS_TEST(embedding_backward_kernel_writes_nothing_for_a_bad_id) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t sg[2] = {10, 4}, sy[2] = {3, 4};
    tsys_tensor *dw = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 2, sg), *g = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 2, sy);
    tsys_tensor_fill(ctx, dw, 7.0f); tsys_tensor_fill(ctx, g, 1.0f);
    int64_t vals[3] = {0, 10, 1};
    int64_t s1[1] = {3};
    tsys_tensor *ids = tsys_tensor_new(ctx, TSYS_I64, TSYS_CPU, 1, s1);
    memcpy(tsys_tensor_data(ids), vals, sizeof(vals));
    tsys_kargs a;
    memset(&a, 0, sizeof(a));
    a.t[0] = dw; a.t[1] = g; a.t[2] = ids;
    TEST_CHECK(tsys_ctx_backend(ctx, TSYS_CPU)->kernel(ctx, TSYS_K_EMBED_BWD, &a) == TSYS_ERR_INVALID_ARGS, "bad id accepted by embed_bwd");
    float *v = test_read(ctx, dw);
    int changed = 0;
    for (int i = 0; i < 40; i++) changed += v[i] != 7.0f;
    TEST_CHECK(changed == 0, "%d gradient elements written before the bad id was seen", changed);
    free(v);
    tsys_tensor_release(dw); tsys_tensor_release(g); tsys_tensor_release(ids);
    tsys_ctx_free(ctx);
}

TSYS_TEST(cross_entropy_rejects_out_of_range_targets) {
    const int64_t bad[] = {-1, 6, 1000};
    for (int b = 0; b < 3; b++) {
        tsys_ctx *ctx = tsys_ctx_new(NULL);
        int64_t sl[2] = {3, 6};
        tsys_tensor *logits = test_param(ctx, TSYS_CPU, 2, sl, 1);
        int64_t vals[3] = {5, bad[b], 0}, s1[1] = {3};
        tsys_tensor *tgt = tsys_tensor_new(ctx, TSYS_I64, TSYS_CPU, 1, s1);
        memcpy(tsys_tensor_data(tgt), vals, sizeof(vals));
        tsys_tensor_set_name(tgt, "targets");
        tsys_tensor *loss = tsys_cross_entropy(ctx, logits, tgt);
        char want[32];
        snprintf(want, sizeof(want), "target %lld", (long long)bad[b]);
        const char *msg = tsys_ctx_last_error(ctx);
        TEST_CHECK(loss == NULL, "target %lld accepted", (long long)bad[b]);
        TEST_CHECK(has(msg, "cross_entropy") && has(msg, want) && has(msg, "[0, 6)"), "message: %s", msg);
        // the backward kernel, called directly, writes nothing either
        tsys_ctx_clear_error(ctx);
        int64_t one = 1;
        tsys_tensor *dl = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 2, sl), *lse = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, s1), *g = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, &one);
        tsys_tensor_fill(ctx, dl, 5.0f); tsys_tensor_fill(ctx, lse, 0.0f); tsys_tensor_fill(ctx, g, 1.0f);
        tsys_kargs a;
        memset(&a, 0, sizeof(a));
        a.t[0] = dl; a.t[1] = logits; a.t[2] = lse; a.t[3] = tgt; a.t[4] = g; a.f[0] = 1.0f / 3;
        TEST_CHECK(tsys_ctx_backend(ctx, TSYS_CPU)->kernel(ctx, TSYS_K_CE_BWD, &a) == TSYS_ERR_INVALID_ARGS, "ce_bwd accepted target %lld", (long long)bad[b]);
        float *v = test_read(ctx, dl);
        int changed = 0;
        for (int i = 0; i < 18; i++) changed += v[i] != 5.0f;
        TEST_CHECK(changed == 0, "ce_bwd wrote %d elements", changed);
        free(v);
        tsys_tensor *rel[6] = {logits, tgt, loss, dl, lse, g};
        for (int i = 0; i < 6; i++) tsys_tensor_release(rel[i]);
        tsys_ctx_free(ctx);
    }
}

TSYS_TEST(model_forward_and_loss_reject_bad_token_ids) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_model_desc d = tsys_model_desc_defaults(NULL);
    d.vocab_size = 32; d.context_length = 4; d.d_model = 16; d.num_layers = 1; d.num_heads = 2; d.d_ff = 24;
    tsys_model *m = tsys_model_new(ctx, &d, TSYS_CPU, 1);
    float before = ((float *)tsys_tensor_data(tsys_model_params(m)[0]))[0];
    int64_t vals[4] = {0, 1, 32, 3};   // the vocabulary size itself: one past the last row
    tsys_tensor *ids = ids_of(ctx, TSYS_I32, 4, vals);
    tsys_tensor *logits = tsys_model_forward(m, ids);
    TEST_CHECK(logits == NULL && has(tsys_ctx_last_error(ctx), "token id 32"), "forward: %s", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    vals[2] = 2;
    tsys_tensor *ok_ids = ids_of(ctx, TSYS_I32, 4, vals);
    logits = tsys_model_forward(m, ok_ids);
    int64_t tv[4] = {0, 1, 2, 32};
    tsys_tensor *tgt = ids_of(ctx, TSYS_I32, 4, tv);
    tsys_tensor *loss = tsys_cross_entropy(ctx, logits, tgt);
    TEST_CHECK(loss == NULL && has(tsys_ctx_last_error(ctx), "target 32"), "loss: %s", tsys_ctx_last_error(ctx));
    TEST_CHECK(before == ((float *)tsys_tensor_data(tsys_model_params(m)[0]))[0], "a parameter changed");
    tsys_tensor_release(loss); tsys_tensor_release(logits); tsys_tensor_release(tgt); tsys_tensor_release(ok_ids); tsys_tensor_release(ids);
    tsys_tape_clear(ctx);
    tsys_model_free(m);
    tsys_ctx_free(ctx);
}

// ---- the CPU budget -----------------------------------------------------------------------------

TSYS_TEST(cpu_allocations_respect_the_budget) {
    tsys_ctx_desc desc;
    memset(&desc, 0, sizeof(desc));
    desc.cpu_memory_limit = (size_t)1 << 20;
    tsys_ctx *ctx = tsys_ctx_new(&desc);
    int64_t n = 200000;   // 800 KB: fits
    tsys_tensor *a = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, &n);
    TEST_CHECK(a != NULL, "%s", tsys_ctx_last_error(ctx));
    tsys_tensor *b = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, &n);   // 1.6 MB live: over
    TEST_CHECK(b == NULL && tsys_ctx_status(ctx) == TSYS_ERR_OOM, "second tensor allocated past the budget");
    TEST_CHECK(has(tsys_ctx_last_error(ctx), "budget"), "message: %s", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    tsys_tensor_release(a);
    b = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, &n);
    TEST_CHECK(b != NULL, "freed memory did not return to the budget");
    tsys_tensor_release(b);
    // a model too large for the budget is an OOM error, never a kill
    tsys_model_desc d;
    tsys_model_desc_preset("2.7B", &d, NULL, 0);
    tsys_model *m = tsys_model_new(ctx, &d, TSYS_CPU, 1);
    TEST_CHECK(m == NULL && tsys_ctx_status(ctx) == TSYS_ERR_OOM, "2.7B model in 1 MiB: status %d", (int)tsys_ctx_status(ctx));
    tsys_ctx_free(ctx);
}

TSYS_TEST(default_budget_is_the_memory_the_machine_has) {
    // MemAvailable moves while other processes run (a parallel build): the budget is what it was when the
    // context was made, so it must lie between the readings just before and just after (give or take
    // 256 MiB for what moved in between; the machine has gigabytes, so another quantity cannot pass)
    size_t before = tsys__host_mem_available();
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    size_t avail = tsys__host_mem_available();
    const size_t slack = (size_t)256 << 20;
    size_t lo = before < avail ? before : avail, hi = before < avail ? avail : before;
    lo = lo > slack ? lo - slack : 0;
    hi = hi < SIZE_MAX - slack ? hi + slack : SIZE_MAX;
    TEST_CHECK(ctx->cpu_memory_limit >= lo && ctx->cpu_memory_limit <= hi, "default budget %zu, MemAvailable %zu before and %zu after",
               ctx->cpu_memory_limit, before, avail);
    if (avail != SIZE_MAX) {
        // more than the machine has: refused up front instead of overcommitted and killed later
        int64_t n = (int64_t)(avail / 4) + ((int64_t)1 << 28);
        tsys_tensor *t = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, &n);
        TEST_CHECK(t == NULL && tsys_ctx_status(ctx) == TSYS_ERR_OOM, "a tensor larger than MemAvailable was allocated");
        tsys_tensor_release(t);
    }
    tsys_ctx_free(ctx);
    tsys_ctx_desc unlimited;
    memset(&unlimited, 0, sizeof(unlimited));
    unlimited.cpu_memory_limit = SIZE_MAX;
    ctx = tsys_ctx_new(&unlimited);
    TEST_CHECK(ctx->cpu_memory_limit == SIZE_MAX, "SIZE_MAX is not unlimited");
    int64_t n = 1000;
    tsys_tensor *t = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, &n);
    TEST_CHECK(t != NULL, "%s", tsys_ctx_last_error(ctx));
    tsys_tensor_release(t);
    tsys_ctx_free(ctx);
}

// A fake file system under root: each path (relative to root) with its text, directories made.
static void cg_file(const char *root, const char *rel, const char *text) {
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", root, rel);
    for (char *c = path + strlen(root) + 1; *c; c++)
        if (*c == '/') { *c = 0; mkdir(path, 0777); *c = '/'; }
    FILE *f = fopen(path, "w");
    TEST_CHECK(f != NULL, "cannot write %s", path);
    if (f) { fputs(text, f); fclose(f); }
}
static void cg_clear(const char *root) {
    char cmd[600];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", root);
    TEST_CHECK(system(cmd) == 0, "%s", cmd);
}
#define CG_MIB(n) ((size_t)(n) << 20)

TSYS_TEST(cgroup_room_bounds_the_budget) {
    char root[64] = "/tmp/tsys_cgroup_XXXXXX", line[128];
    if (!mkdtemp(root)) { TEST_CHECK(false, "mkdtemp"); return; }
    // no cgroup files at all: no limit from there
    TEST_CHECK(tsys__cgroup_room(root) == SIZE_MAX, "no /proc/self/cgroup: %zu", tsys__cgroup_room(root));
    // cgroup v2: a job with 1 GiB of which 900 MiB are used (100 MiB of it inactive page cache, which
    // counts as room), its step unlimited: the parent's limit binds the step
    cg_file(root, "proc/self/cgroup", "0::/job/step\n");
    cg_file(root, "proc/self/mountinfo", "25 1 0:22 / /proc rw - proc proc rw\n30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n");
    snprintf(line, sizeof(line), "%zu\n", CG_MIB(1024)); cg_file(root, "sys/fs/cgroup/job/memory.max", line);
    snprintf(line, sizeof(line), "%zu\n", CG_MIB(900)); cg_file(root, "sys/fs/cgroup/job/memory.current", line);
    snprintf(line, sizeof(line), "anon 1\ninactive_anon 5\ninactive_file %zu\nactive_file 7\n", CG_MIB(100)); cg_file(root, "sys/fs/cgroup/job/memory.stat", line);
    cg_file(root, "sys/fs/cgroup/job/step/memory.max", "max\n");
    snprintf(line, sizeof(line), "%zu\n", CG_MIB(850)); cg_file(root, "sys/fs/cgroup/job/step/memory.current", line);
    cg_file(root, "sys/fs/cgroup/memory.current", "123456789012\n");   // the root cgroup: no memory.max
    TEST_CHECK(tsys__cgroup_room(root) == CG_MIB(224), "v2, the parent's limit: %zu MiB, wanted 224", tsys__cgroup_room(root) >> 20);
    // the step's own limit, tighter: the least room wins
    snprintf(line, sizeof(line), "%zu\n", CG_MIB(860)); cg_file(root, "sys/fs/cgroup/job/step/memory.max", line);
    TEST_CHECK(tsys__cgroup_room(root) == CG_MIB(10), "v2, the step's limit: %zu MiB, wanted 10", tsys__cgroup_room(root) >> 20);
    // over its limit already (usage can pass it briefly): no room, not a wrapped huge number
    snprintf(line, sizeof(line), "%zu\n", CG_MIB(870)); cg_file(root, "sys/fs/cgroup/job/step/memory.current", line);
    TEST_CHECK(tsys__cgroup_room(root) == 0, "v2, over the limit: %zu", tsys__cgroup_room(root));
    // the budget of a new context is that room when it is below MemAvailable (the files from TSYS_CGROUP_ROOT)
    snprintf(line, sizeof(line), "%zu\n", CG_MIB(800)); cg_file(root, "sys/fs/cgroup/job/step/memory.current", line);
    setenv("TSYS_CGROUP_ROOT", root, 1);
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    TEST_CHECK(ctx->cpu_memory_limit == CG_MIB(60) && tsys_ctx_cpu_memory_limit(ctx) == CG_MIB(60), "budget %zu MiB, wanted the step's 60", ctx->cpu_memory_limit >> 20);
    TEST_CHECK(tsys_cpu_memory_available() == CG_MIB(60), "tsys_cpu_memory_available: %zu", tsys_cpu_memory_available());
    int64_t n = (int64_t)CG_MIB(64) / 4;   // 64 MiB: more than the cgroup leaves
    tsys_tensor *t = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, &n);
    TEST_CHECK(t == NULL && tsys_ctx_status(ctx) == TSYS_ERR_OOM, "64 MiB allocated in a cgroup with 60 MiB of room");
    tsys_ctx_clear_error(ctx);
    tsys_ctx_set_cpu_memory_limit(ctx, CG_MIB(1));
    TEST_CHECK(tsys_ctx_cpu_memory_limit(ctx) == CG_MIB(1), "set to 1 MiB: %zu", tsys_ctx_cpu_memory_limit(ctx));
    snprintf(line, sizeof(line), "%zu\n", CG_MIB(830)); cg_file(root, "sys/fs/cgroup/job/step/memory.current", line);
    tsys_ctx_set_cpu_memory_limit(ctx, 0);   // the default again, read now
    TEST_CHECK(tsys_ctx_cpu_memory_limit(ctx) == CG_MIB(30), "0 = the room now: %zu MiB, wanted 30", tsys_ctx_cpu_memory_limit(ctx) >> 20);
    tsys_ctx_free(ctx);
    unsetenv("TSYS_CGROUP_ROOT");
    cg_clear(root);
    // a container's view: the mount's root is the container's own cgroup, which /proc/self/cgroup names too
    if (!mkdtemp(strcpy(root, "/tmp/tsys_cgroup_XXXXXX"))) { TEST_CHECK(false, "mkdtemp"); return; }
    cg_file(root, "proc/self/cgroup", "0::/docker/abc\n");
    cg_file(root, "proc/self/mountinfo", "30 23 0:26 /docker/abc /sys/fs/cgroup ro,nosuid - cgroup2 cgroup rw\n");
    snprintf(line, sizeof(line), "%zu\n", CG_MIB(512)); cg_file(root, "sys/fs/cgroup/memory.max", line);
    snprintf(line, sizeof(line), "%zu\n", CG_MIB(12)); cg_file(root, "sys/fs/cgroup/memory.current", line);
    TEST_CHECK(tsys__cgroup_room(root) == CG_MIB(500), "v2 in a container: %zu MiB, wanted 500", tsys__cgroup_room(root) >> 20);
    cg_clear(root);
    // cgroup v1 (a hybrid host: the unified hierarchy holds no memory controller): the memory
    // controller's mount, a Slurm job's limit, its parents unlimited (v1 writes a huge number)
    if (!mkdtemp(strcpy(root, "/tmp/tsys_cgroup_XXXXXX"))) { TEST_CHECK(false, "mkdtemp"); return; }
    cg_file(root, "proc/self/cgroup", "9:name=systemd:/\n5:cpu,cpuacct:/\n4:memory:/slurm/uid_0/job_7\n0::/\n");
    cg_file(root, "proc/self/mountinfo", "31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
                                         "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n");
    snprintf(line, sizeof(line), "%zu\n", CG_MIB(512)); cg_file(root, "sys/fs/cgroup/memory/slurm/uid_0/job_7/memory.limit_in_bytes", line);
    snprintf(line, sizeof(line), "%zu\n", CG_MIB(112)); cg_file(root, "sys/fs/cgroup/memory/slurm/uid_0/job_7/memory.usage_in_bytes", line);
    snprintf(line, sizeof(line), "cache 1\ninactive_file 999\ntotal_inactive_file %zu\n", CG_MIB(12)); cg_file(root, "sys/fs/cgroup/memory/slurm/uid_0/job_7/memory.stat", line);
    cg_file(root, "sys/fs/cgroup/memory/slurm/memory.limit_in_bytes", "9223372036854771712\n");
    cg_file(root, "sys/fs/cgroup/memory/slurm/memory.usage_in_bytes", "2000000000\n");
    cg_file(root, "sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
    cg_file(root, "sys/fs/cgroup/memory/memory.usage_in_bytes", "9000000000\n");
    TEST_CHECK(tsys__cgroup_room(root) == CG_MIB(412), "v1: %zu MiB, wanted 412", tsys__cgroup_room(root) >> 20);
    cg_clear(root);
}

TSYS_TEST(null_tensors_and_shapes_past_int64_are_errors) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    TEST_CHECK(tsys_tensor_fill(ctx, NULL, 1.0f) == TSYS_ERR_INVALID_ARGS, "fill of NULL");
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(tsys_tensor_randn(ctx, NULL, 1.0f) == TSYS_ERR_INVALID_ARGS, "randn of NULL");
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(tsys_tensor_randint(ctx, NULL, 10) == TSYS_ERR_INVALID_ARGS, "randint of NULL");
    tsys_ctx_clear_error(ctx);
    // an earlier failure keeps its error: a NULL from it does not replace the cause
    int64_t huge[3] = {(int64_t)1 << 31, (int64_t)1 << 31, 4};   // 2^64 elements: the count would wrap to 0
    tsys_tensor *t = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 3, huge);
    TEST_CHECK(t == NULL && strstr(tsys_ctx_last_error(ctx), "too large"), "2^64-element tensor: %s", tsys_ctx_last_error(ctx));
    TEST_CHECK(tsys_tensor_fill(ctx, t, 0.0f) != TSYS_OK && strstr(tsys_ctx_last_error(ctx), "too large"), "the first error was replaced: %s", tsys_ctx_last_error(ctx));
    tsys_ctx_free(ctx);
}

// Memory tsys did not allocate: the tensor reads and writes it, views share it, the release callback runs
// once with the pointer and size when the last reference goes, the tracker counts it, and a resize is refused.
typedef struct wrapped_mem { void *data; size_t bytes; int releases; } wrapped_mem;
static void wrapped_release(void *user, void *data, size_t bytes) {
    wrapped_mem *m = (wrapped_mem *)user;
    m->releases++;
    m->data = data; m->bytes = bytes;
}

TSYS_TEST(wrapped_memory_is_released_once_by_its_owner) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    float buf[12];
    for (int i = 0; i < 12; i++) buf[i] = (float)i;
    wrapped_mem m = { NULL, 0, 0 };
    int64_t live0 = tsys_mem_stats_get(ctx, TSYS_CPU).live_bytes;
    int64_t shape[2] = {3, 4};
    tsys_tensor *t = tsys_tensor_wrap(ctx, TSYS_F32, TSYS_CPU, 2, shape, buf, wrapped_release, &m);
    TEST_CHECK(t && tsys_tensor_data(t) == (void *)buf && tsys_tensor_bytes(t) == sizeof buf, "wrap: %s", tsys_ctx_last_error(ctx));
    TEST_CHECK(tsys_mem_stats_get(ctx, TSYS_CPU).live_bytes - live0 == (int64_t)sizeof buf, "the tracker counts the wrapped bytes");
    tsys_tensor_fill(ctx, t, 2.5f);
    TEST_CHECK(buf[0] == 2.5f && buf[11] == 2.5f, "a fill writes the caller's memory");
    int64_t row[1] = {4};
    tsys_tensor *v = tsys_tensor_view_raw(ctx, t, 4 * sizeof(float), TSYS_F32, 1, row);
    TEST_CHECK(v && tsys_tensor_data(v) == (void *)(buf + 4), "a view shares it");
    TEST_CHECK(tsys_storage_resize(ctx, t, 4) == TSYS_ERR_INVALID_ARGS && has(tsys_ctx_last_error(ctx), "tsys_tensor_wrap"), "resize refused: %s", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    tsys_tensor_release(t);
    TEST_CHECK(m.releases == 0, "released while a view still holds it");
    tsys_tensor_release(v);
    TEST_CHECK(m.releases == 1 && m.data == (void *)buf && m.bytes == sizeof buf, "released once, with its pointer and size (%d times)", m.releases);
    TEST_CHECK(tsys_mem_stats_get(ctx, TSYS_CPU).live_bytes == live0, "the tracker lets it go");
    // borrowed memory (no callback), and bad arguments named
    tsys_tensor *b = tsys_tensor_wrap(ctx, TSYS_F32, TSYS_CPU, 2, shape, buf, NULL, NULL);
    TEST_CHECK(b != NULL, "borrowed memory");
    tsys_tensor_release(b);
    TEST_CHECK(!tsys_tensor_wrap(ctx, TSYS_F32, TSYS_CPU, 2, shape, NULL, NULL, NULL) && has(tsys_ctx_last_error(ctx), "data is NULL"), "NULL data: %s", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    int64_t neg[1] = {-2};
    TEST_CHECK(!tsys_tensor_wrap(ctx, TSYS_F32, TSYS_CPU, 1, neg, buf, NULL, NULL) && has(tsys_ctx_last_error(ctx), "negative"), "negative size: %s", tsys_ctx_last_error(ctx));
    TEST_CHECK(tsys_shape_bytes(ctx, TSYS_BF16, 2, shape) == 24 && tsys_shape_bytes(ctx, TSYS_F32, 1, neg) == -1, "tsys_shape_bytes");
    tsys_ctx_free(ctx);
}

// ---- API misuse: an error naming the input and the rule, never corrupted memory -------------------

// A storage resized under tensors that still use it: shrinking below what they reach is refused; freeing
// it (0 bytes, what FSDP does between gathers) is allowed, and a later use of a tensor on it is an error.
TSYS_TEST(storage_shrink_under_live_tensors_is_refused) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t n = 100, half = 50;
    tsys_tensor *t = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, &n);
    tsys_tensor_set_name(t, "flat");
    tsys_tensor *v = tsys_tensor_view_raw(ctx, t, 50 * sizeof(float), TSYS_F32, 1, &half);   // the upper half
    tsys_tensor_set_name(v, "upper");
    tsys_tensor_release(t);   // the view alone keeps the storage now
    // were it accepted, the fill below would write bytes 200 to 400 of a 16-byte block
    tsys_status st = tsys_storage_resize(ctx, v, 16);
    const char *msg = tsys_ctx_last_error(ctx);
    TEST_CHECK(st == TSYS_ERR_INVALID_ARGS, "a shrink to 16 bytes under a 400-byte tensor was accepted");
    TEST_CHECK(has(msg, "upper") && has(msg, "16 bytes") && has(msg, "400"), "message: %s", msg);
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(tsys_tensor_fill(ctx, v, 1.0f) == TSYS_OK, "the view still works: %s", tsys_ctx_last_error(ctx));
    // 0 bytes: allowed; every use of a tensor on it is then refused, not a write through NULL
    TEST_CHECK(tsys_storage_resize(ctx, v, 0) == TSYS_OK, "free: %s", tsys_ctx_last_error(ctx));
    TEST_CHECK(tsys_tensor_fill(ctx, v, 1.0f) == TSYS_ERR_INVALID_ARGS, "fill of a freed storage");
    tsys_ctx_clear_error(ctx);
    float host[50];
    memset(host, 0, sizeof(host));
    tsys_tensor *src = tsys_tensor_from_data(ctx, TSYS_F32, TSYS_CPU, 1, &half, host);
    TEST_CHECK(tsys_tensor_copy_from(ctx, v, src) == TSYS_ERR_INVALID_ARGS && has(tsys_ctx_last_error(ctx), "upper"),
               "copy into a freed storage: %s", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(tsys_tensor_to_host(ctx, v, host) == TSYS_ERR_INVALID_ARGS, "read of a freed storage");
    tsys_ctx_clear_error(ctx);
    // back to its full size (or more): usable again
    TEST_CHECK(tsys_storage_resize(ctx, v, 400) == TSYS_OK && tsys_tensor_copy_from(ctx, v, src) == TSYS_OK, "regrown: %s", tsys_ctx_last_error(ctx));
    tsys_tensor_release(src); tsys_tensor_release(v);
    TEST_CHECK(tsys_mem_stats_get(ctx, TSYS_CPU).live_bytes == 0, "the tracker ends at 0: %lld", (long long)tsys_mem_stats_get(ctx, TSYS_CPU).live_bytes);
    tsys_ctx_free(ctx);
}

// Tensors of one context given to another's ops: refused at the ops' common entry, naming the op and the
// rule; nothing lands on either tape, no tracker counts the other's bytes.
TSYS_TEST(ops_refuse_tensors_of_another_context) {
    tsys_ctx *A = tsys_ctx_new(NULL), *B = tsys_ctx_new(NULL);
    int64_t s[2] = {4, 8};
    tsys_tensor *a = test_param(A, TSYS_CPU, 2, s, 1), *b = test_param(B, TSYS_CPU, 2, s, 1);
    tsys_tensor_set_name(a, "a_of_A");
    tsys_mem_stats ma = tsys_mem_stats_get(A, TSYS_CPU), mb = tsys_mem_stats_get(B, TSYS_CPU);
    tsys_tensor *y = tsys_mul(B, a, b);
    TEST_CHECK(y == NULL && tsys_ctx_status(B) == TSYS_ERR_INVALID_ARGS, "mul of A's tensor under B accepted");
    TEST_CHECK(has(tsys_ctx_last_error(B), "mul") && has(tsys_ctx_last_error(B), "a_of_A") && has(tsys_ctx_last_error(B), "another context"), "message: %s", tsys_ctx_last_error(B));
    tsys_tensor_release(y);
    tsys_ctx_clear_error(B);
    y = tsys_relu(B, a);   // one input: the unary path
    TEST_CHECK(y == NULL && has(tsys_ctx_last_error(B), "relu") && has(tsys_ctx_last_error(B), "another context"), "relu: %s", tsys_ctx_last_error(B));
    tsys_tensor_release(y);
    tsys_ctx_clear_error(B);
    int64_t sw[2] = {3, 8};
    tsys_tensor *w = test_param(A, TSYS_CPU, 2, sw, 1);
    y = tsys_linear(B, b, w, NULL);
    TEST_CHECK(y == NULL && has(tsys_ctx_last_error(B), "linear"), "linear: %s", tsys_ctx_last_error(B));
    tsys_tensor_release(y);
    tsys_ctx_clear_error(B);
    TEST_CHECK(tsys_tape_size(A) == 0 && tsys_tape_size(B) == 0, "tapes: %zu, %zu", tsys_tape_size(A), tsys_tape_size(B));
    // functions that launch directly, and storage surgery, under the wrong context
    TEST_CHECK(tsys_tensor_fill(B, a, 1.0f) == TSYS_ERR_INVALID_ARGS && has(tsys_ctx_last_error(B), "another context"), "fill: %s", tsys_ctx_last_error(B));
    tsys_ctx_clear_error(B);
    TEST_CHECK(tsys_storage_resize(B, a, 0) == TSYS_ERR_INVALID_ARGS && has(tsys_ctx_last_error(B), "another context"), "resize: %s", tsys_ctx_last_error(B));
    tsys_ctx_clear_error(B);
    TEST_CHECK(tsys_tensor_rebind(B, b, a, 0) == TSYS_ERR_INVALID_ARGS, "rebind across contexts");
    tsys_ctx_clear_error(B);
    tsys_mem_stats ma2 = tsys_mem_stats_get(A, TSYS_CPU), mb2 = tsys_mem_stats_get(B, TSYS_CPU);
    TEST_CHECK(ma2.live_bytes == ma.live_bytes + 3 * 8 * 4 && mb2.live_bytes == mb.live_bytes, "trackers: A %lld -> %lld, B %lld -> %lld",
               (long long)ma.live_bytes, (long long)ma2.live_bytes, (long long)mb.live_bytes, (long long)mb2.live_bytes);
    for (int c = 0; c < TSYS_MEM_CATEGORY_COUNT; c++)
        TEST_CHECK(mb2.category_bytes[c] >= 0 && ma2.category_bytes[c] >= 0, "category %d: A %lld, B %lld", c, (long long)ma2.category_bytes[c], (long long)mb2.category_bytes[c]);
    // its own context still takes it
    y = tsys_mul(A, a, a);
    TEST_CHECK(y != NULL, "%s", tsys_ctx_last_error(A));
    tsys_tensor_release(y); tsys_tape_clear(A);
    tsys_tensor_release(w); tsys_tensor_release(a); tsys_tensor_release(b);
    tsys_ctx_free(A); tsys_ctx_free(B);
}

// Tensors, a model and an optimizer outlive their context: releasing them afterwards touches no freed
// memory, and memory a tensor wraps still goes back to its owner.
TSYS_TEST(release_after_ctx_free_touches_no_freed_memory) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t n = 16;
    tsys_tensor *t = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, &n);
    int64_t four = 4;
    tsys_tensor *v = tsys_tensor_view_raw(ctx, t, 0, TSYS_F32, 1, &four);
    float buf[4] = {0};
    wrapped_mem wm = { NULL, 0, 0 };
    tsys_tensor *wr = tsys_tensor_wrap(ctx, TSYS_F32, TSYS_CPU, 1, &four, buf, wrapped_release, &wm);
    tsys_model_desc d = tsys_model_desc_defaults(NULL);
    d.vocab_size = 16; d.context_length = 4; d.d_model = 8; d.num_layers = 1; d.num_heads = 2; d.d_ff = 16;
    tsys_model *m = tsys_model_new(ctx, &d, TSYS_CPU, 1);
    tsys_optim *opt = m ? tsys_adamw_new(ctx, tsys_model_params(m), tsys_model_num_tensors(m), NULL) : NULL;
    TEST_CHECK(t && v && wr && m && opt, "setup: %s", tsys_ctx_last_error(ctx));
    tsys_ctx_free(ctx);   // each release below goes through the context: its memory must still be there
    tsys_tensor_release(t);
    tsys_tensor_release(v);
    tsys_optim_free(opt);
    tsys_model_free(m);
    TEST_CHECK(wm.releases == 0, "wrapped memory released while a tensor holds it");
    tsys_tensor_release(wr);
    TEST_CHECK(wm.releases == 1 && wm.data == (void *)buf, "wrapped memory given back %d times", wm.releases);
}

static void null_hook(tsys_ctx *ctx, tsys_tensor *p, void *u) { (void)ctx; (void)p; (void)u; }

// NULL contexts, tensors, models, optimizers, names and paths: an error or a NULL, never a crash.
TSYS_TEST(null_arguments_to_public_functions_are_errors) {
    int64_t s[2] = {2, 3};
    float host[6] = {0};
    // no context: nothing to record in, the status says it
    TEST_CHECK(tsys_tensor_new(NULL, TSYS_F32, TSYS_CPU, 2, s) == NULL, "tensor_new(NULL ctx)");
    TEST_CHECK(tsys_tensor_new_2d(NULL, TSYS_F32, TSYS_CPU, 2, 3) == NULL, "tensor_new_2d(NULL ctx)");
    TEST_CHECK(tsys_tensor_from_data(NULL, TSYS_F32, TSYS_CPU, 2, s, host) == NULL, "from_data(NULL ctx)");
    TEST_CHECK(tsys_tensor_wrap(NULL, TSYS_F32, TSYS_CPU, 2, s, host, NULL, NULL) == NULL, "wrap(NULL ctx)");
    TEST_CHECK(tsys_shape_bytes(NULL, TSYS_F32, 2, NULL) == -1, "shape_bytes(NULL shape)");
    TEST_CHECK(tsys_model_new(NULL, NULL, TSYS_CPU, 1) == NULL, "model_new(NULL ctx)");
    TEST_CHECK(tsys_adamw_new(NULL, NULL, 0, NULL) == NULL && tsys_sgd_new(NULL, NULL, 0, 0.1f) == NULL, "optimizers of NULL ctx");
    TEST_CHECK(tsys_safetensors_save(NULL, "x", NULL, 0) == TSYS_ERR_INVALID_ARGS, "save(NULL ctx)");
    TEST_CHECK(tsys_ctx_status(NULL) == TSYS_ERR_INVALID_ARGS, "status(NULL)");
    tsys_ctx_clear_error(NULL);
    tsys_ctx_free(NULL);
    TEST_CHECK(tsys_add(NULL, NULL, NULL) == NULL && tsys_sum(NULL, NULL) == NULL, "ops of NULL ctx");
    TEST_CHECK(tsys_backward(NULL, NULL) == TSYS_ERR_INVALID_ARGS, "backward(NULL ctx)");
    TEST_CHECK(tsys_sync(NULL, TSYS_CPU) == TSYS_ERR_INVALID_ARGS, "sync(NULL ctx)");
    TEST_CHECK(tsys_profiler_begin(NULL) == NULL, "profiler_begin(NULL ctx)");
    tsys_tape_clear(NULL); tsys_no_grad_begin(NULL); tsys_no_grad_end(NULL); tsys_autocast_begin(NULL, TSYS_BF16); tsys_autocast_end(NULL);
    tsys_trace_begin(NULL, "x"); tsys_trace_end(NULL); tsys_mem_reset_peak(NULL, TSYS_CPU); tsys_rng_seed(NULL, 1);
    TEST_CHECK(tsys_mem_stats_get(NULL, TSYS_CPU).live_bytes == 0 && tsys_tape_size(NULL) == 0, "getters of NULL ctx");
    // a context, NULL objects
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    TEST_CHECK(tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 2, NULL) == NULL && has(tsys_ctx_last_error(ctx), "shape is NULL"), "NULL shape: %s", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    tsys_tensor *t = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 2, s);
    tsys_tensor_set_name(t, NULL);             // no name: left as it was
    tsys_tensor_set_name(NULL, "x");
    tsys_tensor_set_name(t, "kept");
    tsys_tensor_set_name(t, NULL);
    TEST_CHECK(strcmp(t->name, "kept") == 0, "name: '%s'", t->name);
    TEST_CHECK(tsys_tensor_numel(NULL) == 0 && tsys_tensor_bytes(NULL) == 0 && tsys_tensor_data(NULL) == NULL, "getters of NULL tensor");
    tsys_tensor_mark_written(NULL); tsys_tensor_set_requires_grad(NULL, true);
    TEST_CHECK(!tsys_tensor_same_shape(t, NULL), "same_shape(NULL)");
    TEST_CHECK(tsys_tensor_to_host(ctx, NULL, host) == TSYS_ERR_INVALID_ARGS, "to_host(NULL tensor)");
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(tsys_tensor_to_host(ctx, t, NULL) == TSYS_ERR_INVALID_ARGS && has(tsys_ctx_last_error(ctx), "NULL"), "to_host(NULL host): %s", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(tsys_tensor_to_f32(ctx, NULL, host) == TSYS_ERR_INVALID_ARGS, "to_f32(NULL tensor)");
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(tsys_tensor_from_data(ctx, TSYS_F32, TSYS_CPU, 2, s, NULL) == NULL && has(tsys_ctx_last_error(ctx), "NULL"), "from_data(NULL data): %s", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(tsys_tensor_copy_from(ctx, t, NULL) == TSYS_ERR_INVALID_ARGS, "copy_from(NULL)");
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(tsys_tensor_trunc_normal(ctx, NULL, 1, -1, 1) == TSYS_ERR_INVALID_ARGS, "trunc_normal(NULL)");
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(tsys_view(ctx, t, 1, NULL) == NULL && tsys_ctx_status(ctx) == TSYS_ERR_INVALID_ARGS, "view(NULL shape)");
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(tsys_tensor_add_grad_hook(NULL, null_hook, NULL) == TSYS_ERR_INVALID_ARGS, "add_grad_hook(NULL)");
    TEST_CHECK(tsys_backward(ctx, NULL) == TSYS_ERR_INVALID_ARGS, "backward(NULL loss)");
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(isnan(tsys_item(ctx, NULL)), "item(NULL)");
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(tsys_check_token_ids(NULL, NULL, 10, 4) == TSYS_ERR_INVALID_ARGS, "check_token_ids(NULL ctx)");
    TEST_CHECK(tsys_mem_tag(ctx, NULL) == 0 && tsys_mem_tag(NULL, "x") == 0, "mem_tag(NULL)");
    tsys_trace_begin(ctx, NULL);
    tsys_trace_end(ctx);
    // models
    TEST_CHECK(tsys_model_forward(NULL, t) == NULL && tsys_model_params(NULL) == NULL && tsys_model_num_tensors(NULL) == 0, "model getters of NULL");
    TEST_CHECK(tsys_model_get_desc(NULL) == NULL && tsys_model_num_params(NULL) == 0 && tsys_model_checkpoint_plan(NULL) == NULL, "model getters of NULL");
    TEST_CHECK(tsys_model_save(NULL, "x") == TSYS_ERR_INVALID_ARGS && tsys_model_load(NULL, "x") == TSYS_ERR_INVALID_ARGS, "save/load of NULL model");
    tsys_model_free(NULL);
    char err[128] = "";
    TEST_CHECK(tsys_model_desc_preset(NULL, NULL, NULL, 0) == TSYS_ERR_INVALID_ARGS && tsys_model_desc_preset("small", NULL, err, sizeof(err)) == TSYS_ERR_INVALID_ARGS,
               "preset into NULL: %s", err);
    TEST_CHECK(tsys_checkpoint_policy_parse("sqrt", 4, NULL, NULL, 0) == TSYS_ERR_INVALID_ARGS, "policy_parse into NULL");
    tsys_model_desc d = tsys_model_desc_defaults(NULL);
    d.vocab_size = 16; d.context_length = 4; d.d_model = 8; d.num_layers = 1; d.num_heads = 2; d.d_ff = 16;
    tsys_model *m = tsys_model_new(ctx, &d, TSYS_CPU, 1);
    TEST_CHECK(m && tsys_model_param(m, NULL) == NULL && tsys_model_forward(m, NULL) == NULL, "model_param / forward of NULL");
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(tsys_model_save(m, NULL) == TSYS_ERR_INVALID_ARGS && tsys_model_load(m, NULL) == TSYS_ERR_INVALID_ARGS, "save/load to a NULL path");
    tsys_ctx_clear_error(ctx);
    // optimizers
    TEST_CHECK(tsys_adamw_new(ctx, NULL, 3, NULL) == NULL && has(tsys_ctx_last_error(ctx), "params"), "adamw of NULL params: %s", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(tsys_sgd_new(ctx, tsys_model_params(m), -1, 0.1f) == NULL && has(tsys_ctx_last_error(ctx), "-1"), "sgd of -1 params: %s", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(tsys_optim_step(NULL) == TSYS_ERR_INVALID_ARGS && tsys_optim_overlap_begin(NULL) == TSYS_ERR_INVALID_ARGS && tsys_optim_overlap_end(NULL) == TSYS_ERR_INVALID_ARGS, "optim NULL");
    TEST_CHECK(tsys_optim_keep_lowp(NULL, TSYS_BF16) == TSYS_ERR_INVALID_ARGS && tsys_optim_lowp(NULL) == TSYS_F32 && tsys_optim_steps(NULL) == 0, "optim NULL");
    TEST_CHECK(tsys_optim_state(NULL, 0, 0) == NULL, "optim_state(NULL)");
    tsys_optim_zero_grad(NULL); tsys_optim_release_grads(NULL); tsys_optim_set_lr(NULL, 0.1f); tsys_optim_free(NULL);
    tsys_grad_scaler sc = tsys_grad_scaler_init();
    TEST_CHECK(tsys_grad_scaler_step(&sc, NULL) == TSYS_ERR_INVALID_ARGS && tsys_grad_scaler_step(NULL, NULL) == TSYS_ERR_INVALID_ARGS, "scaler NULL");
    TEST_CHECK(tsys_grad_scaler_scale(ctx, NULL, t) == NULL, "scaler_scale(NULL scaler)");
    tsys_ctx_clear_error(ctx);
    tsys_grad_scaler_update(NULL);
    tsys_zero_grads(ctx, NULL, 2); tsys_release_grads(ctx, NULL, 2);
    TEST_CHECK(tsys_grads_settle(ctx, NULL, 2) == TSYS_ERR_INVALID_ARGS, "grads_settle(NULL)");
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(isnan(tsys_clip_grad_norm(ctx, NULL, 2, 1.0)), "clip(NULL)");
    tsys_ctx_clear_error(ctx);
    // safetensors
    tsys_tensor **list = NULL;
    int nl = 0;
    TEST_CHECK(tsys_safetensors_load(ctx, NULL, TSYS_CPU, &list, &nl) == TSYS_ERR_INVALID_ARGS, "load(NULL path)");
    tsys_ctx_clear_error(ctx);
    tsys_tensor *two[2] = {t, NULL};
    TEST_CHECK(tsys_safetensors_save(ctx, "/tmp/tsys_null_guard.safetensors", two, 2) == TSYS_ERR_INVALID_ARGS && has(tsys_ctx_last_error(ctx), "NULL"),
               "save of a NULL tensor: %s", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    tsys_tensor_list_free(NULL, 3);
    tsys_model_free(m);
    tsys_tensor_release(t);
    tsys_ctx_free(ctx);
}

// A tsys_device outside the enum: an error naming the value, never an index past the backend table.
TSYS_TEST(device_values_out_of_range_are_errors) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t s[1] = {4};
    float host[4] = {0};
    const int bad[] = {2, 7, -1, 1000};
    for (int i = 0; i < 4; i++) {
        tsys_device dev = (tsys_device)bad[i];
        char want[32];
        snprintf(want, sizeof(want), "device %d", bad[i]);
        TEST_CHECK(tsys_tensor_new(ctx, TSYS_F32, dev, 1, s) == NULL && has(tsys_ctx_last_error(ctx), want), "tensor_new on %d: %s", bad[i], tsys_ctx_last_error(ctx));
        tsys_ctx_clear_error(ctx);
        TEST_CHECK(tsys_tensor_wrap(ctx, TSYS_F32, dev, 1, s, host, NULL, NULL) == NULL && has(tsys_ctx_last_error(ctx), want), "wrap on %d: %s", bad[i], tsys_ctx_last_error(ctx));
        tsys_ctx_clear_error(ctx);
        TEST_CHECK(tsys_model_new(ctx, NULL, dev, 1) == NULL && has(tsys_ctx_last_error(ctx), want), "model on %d: %s", bad[i], tsys_ctx_last_error(ctx));
        tsys_ctx_clear_error(ctx);
        tsys_tensor *t = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, s);
        TEST_CHECK(tsys_tensor_to(ctx, t, dev) == NULL && has(tsys_ctx_last_error(ctx), want), "tensor_to %d: %s", bad[i], tsys_ctx_last_error(ctx));
        tsys_ctx_clear_error(ctx);
        tsys_tensor_release(t);
        TEST_CHECK(tsys_sync(ctx, dev) == TSYS_ERR_INVALID_ARGS && has(tsys_ctx_last_error(ctx), want), "sync %d: %s", bad[i], tsys_ctx_last_error(ctx));
        tsys_ctx_clear_error(ctx);
        TEST_CHECK(tsys_ctx_backend(ctx, dev) == NULL, "backend of %d", bad[i]);
        tsys_ctx_set_backend(ctx, dev, tsys_ctx_backend(ctx, TSYS_CPU));
        TEST_CHECK(tsys_ctx_status(ctx) == TSYS_ERR_INVALID_ARGS && has(tsys_ctx_last_error(ctx), want), "set_backend %d: %s", bad[i], tsys_ctx_last_error(ctx));
        tsys_ctx_clear_error(ctx);
        TEST_CHECK(tsys_mem_stats_get(ctx, dev).live_bytes == 0 && tsys_mem_tag_bytes(ctx, 0, dev) == 0, "tracker of %d", bad[i]);
        tsys_mem_reset_peak(ctx, dev);
        tsys_mem_note_external(ctx, dev, TSYS_MEM_WORKSPACE, 64);
        tsys_tensor **list = NULL;
        int n = 0;
        TEST_CHECK(tsys_safetensors_load(ctx, "tests/fixtures/none.safetensors", dev, &list, &n) == TSYS_ERR_INVALID_ARGS && has(tsys_ctx_last_error(ctx), want),
                   "safetensors_load onto %d: %s", bad[i], tsys_ctx_last_error(ctx));
        tsys_ctx_clear_error(ctx);
    }
    TEST_CHECK(tsys_mem_stats_get(ctx, TSYS_CPU).live_bytes == 0, "nothing allocated");
    tsys_ctx_free(ctx);
}

// AdamW and SGD refuse hyper-parameters torch.optim refuses (and NaN): NULL, with the parameter and the rule.
TSYS_TEST(optimizers_refuse_bad_hyper_parameters) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    int64_t s[1] = {8};
    tsys_tensor *p = test_param(ctx, TSYS_CPU, 1, s, 1);
    struct { const char *field; tsys_optim_desc d; const char *rule; } bad[] = {
        {"lr", {.lr = -1e-3f}, ">= 0"},
        {"lr", {.lr = NAN}, "nan"},
        {"lr", {.lr = INFINITY}, "finite"},
        {"eps", {.eps = -1e-8f}, ">= 0"},
        {"eps", {.eps = NAN}, "nan"},
        {"beta1", {.beta1 = 1.0f}, "[0, 1)"},
        {"beta1", {.beta1 = -0.1f}, "[0, 1)"},
        {"beta2", {.beta2 = 1.5f}, "[0, 1)"},
        {"beta2", {.beta2 = NAN}, "nan"},
        {"weight_decay", {.weight_decay = -0.1f}, ">= 0"},
        {"weight_decay", {.weight_decay = NAN}, "nan"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        tsys_optim *o = tsys_adamw_new(ctx, &p, 1, &bad[i].d);
        const char *msg = tsys_ctx_last_error(ctx);
        TEST_CHECK(o == NULL && tsys_ctx_status(ctx) == TSYS_ERR_INVALID_ARGS, "adamw case %zu (%s) accepted", i, bad[i].field);
        TEST_CHECK(has(msg, "adamw") && has(msg, bad[i].field) && has(msg, bad[i].rule), "case %zu: %s", i, msg);
        tsys_optim_free(o);
        tsys_ctx_clear_error(ctx);
    }
    const float bad_lr[] = {-0.5f, NAN, -INFINITY};
    for (int i = 0; i < 3; i++) {
        tsys_optim *o = tsys_sgd_new(ctx, &p, 1, bad_lr[i]);
        TEST_CHECK(o == NULL && has(tsys_ctx_last_error(ctx), "sgd") && has(tsys_ctx_last_error(ctx), "lr"), "sgd lr %g: %s", bad_lr[i], tsys_ctx_last_error(ctx));
        tsys_optim_free(o);
        tsys_ctx_clear_error(ctx);
    }
    // the edges torch accepts
    tsys_optim_desc ok = {.lr = 0.5f, .beta1 = 0.0f, .beta2 = 0.99f, .eps = 1e-6f, .no_weight_decay = true};
    tsys_optim *o = tsys_adamw_new(ctx, &p, 1, &ok);
    TEST_CHECK(o != NULL, "valid desc: %s", tsys_ctx_last_error(ctx));
    // a bad lr set later is refused too, and the old one kept
    tsys_optim_set_lr(o, NAN);
    TEST_CHECK(tsys_ctx_status(ctx) == TSYS_ERR_INVALID_ARGS && has(tsys_ctx_last_error(ctx), "lr"), "set_lr(nan): %s", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    tsys_optim_free(o);
    o = tsys_sgd_new(ctx, &p, 1, 0.0f);
    TEST_CHECK(o != NULL, "sgd lr 0: %s", tsys_ctx_last_error(ctx));
    tsys_optim_free(o);
    tsys_tensor_release(p);
    tsys_ctx_free(ctx);
}

// The cs336 schedule: warmup, cosine, then the minimum; a cycle equal to the warmup has no cosine part.
TSYS_TEST(cosine_lr_warmup_equal_to_cycle_and_bad_inputs) {
    for (int64_t it = 0; it <= 12; it++) {
        double lr = tsys_cosine_lr(it, 1.0, 0.1, 5, 5);
        double want = it < 5 ? (double)it / 5 : 0.1;
        TEST_CHECK(lr == want, "it %lld, warmup = cycle = 5: %g, want %g", (long long)it, lr, want);
    }
    // no warmup, a one-step cycle, and the ordinary case at its edges
    TEST_CHECK(tsys_cosine_lr(0, 1.0, 0.1, 0, 0) == 0.1 && fabs(tsys_cosine_lr(0, 1.0, 0.1, 0, 10) - 1.0) < 1e-12, "no warmup");
    TEST_CHECK(tsys_cosine_lr(10, 1.0, 0.1, 2, 10) == 0.1 && fabs(tsys_cosine_lr(2, 1.0, 0.1, 2, 10) - 1.0) < 1e-12, "edges");
    TEST_CHECK(fabs(tsys_cosine_lr(6, 1.0, 0.1, 2, 10) - 0.55) < 1e-12, "middle of the cosine: %g", tsys_cosine_lr(6, 1.0, 0.1, 2, 10));
    // nonsense: NAN (which tsys_optim_set_lr refuses)
    TEST_CHECK(isnan(tsys_cosine_lr(-1, 1.0, 0.1, 2, 10)), "negative iteration");
    TEST_CHECK(isnan(tsys_cosine_lr(3, 1.0, 0.1, -2, 10)), "negative warmup");
    TEST_CHECK(isnan(tsys_cosine_lr(3, 1.0, 0.1, 10, 5)), "cycle shorter than the warmup");
    TEST_CHECK(isnan(tsys_cosine_lr(3, NAN, 0.1, 2, 10)) && isnan(tsys_cosine_lr(3, 1.0, -0.1, 2, 10)), "NaN or negative rates");
}

int main(int argc, char **argv) { return tsys_test_main(argc, argv); }
