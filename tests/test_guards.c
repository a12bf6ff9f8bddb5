// test_guards.c - bad input never corrupts memory and out of memory is an error, not a kill:
// ops that index by tensor values reject out-of-range ids (naming the op, the value and the range)
// and write nothing; CPU allocations respect the context's budget (by default what the machine has,
// or less: what its memory cgroup, v1 or v2, leaves);
// memory a tensor wraps goes back to its owner once.
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

int main(int argc, char **argv) { return tsys_test_main(argc, argv); }
