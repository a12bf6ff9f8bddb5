// test_safetensors.c - safetensors save/load: round trips of every dtype, F32 <-> BF16/F16 loading,
// every kind of corrupt or mismatched file (each must be a clear error naming the file and the
// tensor, never a crash), and files written by PyTorch (tests/fixtures, see tests/ref/make_fixtures.py).
//
//   cc -std=c11 -O1 -fopenmp -Wall -Wextra -I. tests/test_safetensors.c -o /tmp/tst -lopenblas -lm && /tmp/tst
//
// Run from the repository root (the fixtures are found at tests/fixtures, or in $TSYS_FIXTURES).
#define _POSIX_C_SOURCE 200809L   // mkdtemp
#define TSYS_IMPLEMENTATION
#include "tsys.h"
#include "harness.h"

#include <stdlib.h>
#include <stdint.h>
#include <errno.h>
#include <unistd.h>
#include <fcntl.h>
#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>   // mkfifo, mkdir
#include <sys/wait.h>
#include <sys/resource.h>   // RLIMIT_FSIZE

// ---- helpers ----------------------------------------------------------------------------------------

static char st_dir[256];   // one temp dir for the whole run

static const char *st_path(const char *name) {
    static char buf[8][512];
    static int next;
    char *p = buf[next++ % 8];
    if (!st_dir[0]) {
        strcpy(st_dir, "/tmp/tsys_st_XXXXXX");
        if (!mkdtemp(st_dir)) { perror("mkdtemp"); exit(1); }
    }
    snprintf(p, 512, "%s/%s", st_dir, name);
    return p;
}

// Writes a file made of an 8-byte length field (declared_len), the header bytes and the data bytes.
static void st_write_raw(const char *path, uint64_t declared_len, const char *hdr, size_t hdr_len, const void *data, size_t data_len) {
    FILE *f = fopen(path, "wb");
    unsigned char len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (unsigned char)(declared_len >> (8 * i));
    if (!f) { perror(path); return; }
    fwrite(len8, 1, 8, f);
    if (hdr_len) fwrite(hdr, 1, hdr_len, f);
    if (data_len) fwrite(data, 1, data_len, f);
    fclose(f);
}

// A well-formed length field around an arbitrary header text and data.
static void st_write_file(const char *path, const char *hdr, const void *data, size_t data_len) {
    st_write_raw(path, strlen(hdr), hdr, strlen(hdr), data, data_len);
}

// Checks that s is the expected failure and that the message holds each of the given strings
// (NULL-terminated list), then clears the error.
static int st_expect_error(tsys_ctx *ctx, tsys_status s, tsys_status want, const char *first, ...) {
    int ok = 1;
    const char *msg = tsys_ctx_last_error(ctx);
    TEST_CHECK(s == want, "status %d (%s), wanted %d; message: %s", (int)s, tsys_status_str(s), (int)want, msg);
    if (s != want) ok = 0;
    va_list ap;
    va_start(ap, first);
    for (const char *sub = first; sub; sub = va_arg(ap, const char *)) {
        TEST_CHECK(msg && strstr(msg, sub), "message lacks '%s': %s", sub, msg ? msg : "(null)");
        if (!msg || !strstr(msg, sub)) ok = 0;
    }
    va_end(ap);
    tsys_ctx_clear_error(ctx);
    return ok;
}

static tsys_tensor *st_tensor(tsys_ctx *ctx, const char *name, tsys_dtype dt, int ndim, const int64_t *shape, const void *data) {
    tsys_tensor *t = tsys_tensor_from_data(ctx, dt, TSYS_CPU, ndim, shape, data);
    if (t) tsys_tensor_set_name(t, "%s", name);
    return t;
}

static const tsys_tensor *st_find(tsys_tensor **list, int n, const char *name) {
    for (int i = 0; i < n; i++) if (strcmp(list[i]->name, name) == 0) return list[i];
    return NULL;
}

static float st_at(const tsys_tensor *t, int64_t i) { return ((const float *)tsys_tensor_data(t))[i]; }

static bool st_same(const tsys_tensor *a, const tsys_tensor *b) {
    return a && b && a->dtype == b->dtype && tsys_tensor_same_shape(a, b) && a->ndim == b->ndim &&
           memcmp(tsys_tensor_data(a), tsys_tensor_data(b), tsys_tensor_bytes(a)) == 0;
}

// Five tensors, one per dtype, with awkward values (negative zero, inf, subnormal-ish, extremes).
#define ST_N 5
static void st_make_five(tsys_ctx *ctx, tsys_tensor **t) {
    static const float f32[6] = { 1.5f, -0.0f, 3.0e38f, -1.0e-40f, INFINITY, 0.333333343f };
    static const uint16_t bf16[4] = { 0x3f80, 0xbf80, 0x7f80, 0x0001 };
    static const uint16_t f16[8] = { 0x3c00, 0xc000, 0x7bff, 0x0001, 0x8000, 0x3555, 0x7c00, 0x0400 };
    static const int32_t i32[3] = { INT32_MIN, -1, INT32_MAX };
    static const int64_t i64[4] = { INT64_MIN, -7, 1234567890123LL, INT64_MAX };
    const int64_t s_f32[2] = { 2, 3 }, s_bf16[1] = { 4 }, s_f16[3] = { 2, 2, 2 }, s_i32[1] = { 3 }, s_i64[4] = { 1, 2, 1, 2 };
    t[0] = st_tensor(ctx, "a.f32", TSYS_F32, 2, s_f32, f32);
    t[1] = st_tensor(ctx, "b.bf16", TSYS_BF16, 1, s_bf16, bf16);
    t[2] = st_tensor(ctx, "layers.0.c \"quoted\\\" f16", TSYS_F16, 3, s_f16, f16);   // needs JSON escaping
    t[3] = st_tensor(ctx, "d.i32", TSYS_I32, 1, s_i32, i32);
    t[4] = st_tensor(ctx, "e.i64", TSYS_I64, 4, s_i64, i64);
}

static void st_free_all(tsys_tensor **t, int n) { for (int i = 0; i < n; i++) tsys_tensor_release(t[i]); }

static long st_file_size(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fclose(f);
    return n;
}

// ---- round trips --------------------------------------------------------------------------------------

TSYS_TEST(safetensors_round_trip_all_dtypes) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_tensor *t[ST_N], **back = NULL;
    int n = 0;
    st_make_five(ctx, t);
    const char *path = st_path("five.safetensors");
    tsys_status s = tsys_safetensors_save(ctx, path, t, ST_N);
    TEST_CHECK(s == TSYS_OK, "save: %s", tsys_ctx_last_error(ctx));

    // The data buffer starts 8-byte aligned and holds exactly the tensors' bytes.
    FILE *f = fopen(path, "rb");
    unsigned char len8[8] = { 0 };
    TEST_CHECK(f && fread(len8, 1, 8, f) == 8, "cannot read back %s", path);
    if (f) fclose(f);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | len8[i];
    size_t data = 0;
    for (int i = 0; i < ST_N; i++) data += tsys_tensor_bytes(t[i]);
    TEST_CHECK(hlen % 8 == 0, "header length %llu is not a multiple of 8", (unsigned long long)hlen);
    TEST_CHECK(st_file_size(path) == (long)(8 + hlen + data), "file size %ld, wanted %llu", st_file_size(path), (unsigned long long)(8 + hlen + data));

    s = tsys_safetensors_load(ctx, path, TSYS_CPU, &back, &n);
    TEST_CHECK(s == TSYS_OK && n == ST_N, "load: %d tensors, %s", n, tsys_ctx_last_error(ctx));
    for (int i = 0; s == TSYS_OK && i < ST_N; i++) {
        const tsys_tensor *b = st_find(back, n, t[i]->name);
        TEST_CHECK(st_same(t[i], b), "tensor '%s' differs after the round trip", t[i]->name);
    }
    tsys_tensor_list_free(back, n);

    // load_into fresh zero tensors of the same shapes, in another order.
    tsys_tensor *into[ST_N];
    for (int i = 0; i < ST_N; i++) {
        into[i] = tsys_tensor_new(ctx, t[ST_N - 1 - i]->dtype, TSYS_CPU, t[ST_N - 1 - i]->ndim, t[ST_N - 1 - i]->shape);
        tsys_tensor_set_name(into[i], "%s", t[ST_N - 1 - i]->name);
    }
    s = tsys_safetensors_load_into(ctx, path, into, ST_N);
    TEST_CHECK(s == TSYS_OK, "load_into: %s", tsys_ctx_last_error(ctx));
    for (int i = 0; i < ST_N; i++) TEST_CHECK(st_same(into[i], t[ST_N - 1 - i]), "load_into '%s' differs", into[i]->name);

    // A subset is fine too: load_into asks only for what it is given.
    s = tsys_safetensors_load_into(ctx, path, into + 1, 2);
    TEST_CHECK(s == TSYS_OK, "load_into subset: %s", tsys_ctx_last_error(ctx));
    st_free_all(into, ST_N);
    st_free_all(t, ST_N);
    tsys_ctx_free(ctx);
}

TSYS_TEST(safetensors_empty_and_zero_size) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_tensor **back = NULL;
    int n = -1;
    const char *path = st_path("empty.safetensors");
    TEST_CHECK(tsys_safetensors_save(ctx, path, NULL, 0) == TSYS_OK, "save of nothing: %s", tsys_ctx_last_error(ctx));
    TEST_CHECK(tsys_safetensors_load(ctx, path, TSYS_CPU, &back, &n) == TSYS_OK && n == 0, "load of nothing: n %d, %s", n, tsys_ctx_last_error(ctx));
    tsys_tensor_list_free(back, n);

    // A tensor with a zero dimension has an empty range [k, k]; a 0-dim scalar has shape [].
    float one = 2.5f;
    const int64_t s0[2] = { 0, 3 }, s1[1] = { 1 };
    tsys_tensor *t[3] = { st_tensor(ctx, "nothing", TSYS_F32, 2, s0, &one), st_tensor(ctx, "one", TSYS_F32, 1, s1, &one),
                          st_tensor(ctx, "scalar", TSYS_F32, 0, s1, &one) };
    path = st_path("zero.safetensors");
    TEST_CHECK(tsys_safetensors_save(ctx, path, t, 3) == TSYS_OK, "save: %s", tsys_ctx_last_error(ctx));
    TEST_CHECK(tsys_safetensors_load(ctx, path, TSYS_CPU, &back, &n) == TSYS_OK && n == 3, "load: %s", tsys_ctx_last_error(ctx));
    if (n == 3) {
        TEST_CHECK(st_same(st_find(back, n, "nothing"), t[0]), "zero-size tensor differs");
        TEST_CHECK(st_same(st_find(back, n, "one"), t[1]), "tensor after a zero-size one differs");
        TEST_CHECK(st_same(st_find(back, n, "scalar"), t[2]) && st_find(back, n, "scalar")->ndim == 0, "0-dim tensor differs");
    }
    tsys_tensor_list_free(back, n);
    st_free_all(t, 3);
    tsys_ctx_free(ctx);
}

TSYS_TEST(safetensors_load_into_converts_f32_bf16_f16) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    static const float v[5] = { 1.0f, -2.75f, 0.1f, 65504.0f, 3.14159265f };
    const int64_t shape[1] = { 5 };
    tsys_tensor *f32 = st_tensor(ctx, "w", TSYS_F32, 1, shape, v);
    const char *path = st_path("conv.safetensors");
    TEST_CHECK(tsys_safetensors_save(ctx, path, &f32, 1) == TSYS_OK, "save: %s", tsys_ctx_last_error(ctx));

    // F32 file -> BF16 and F16 tensors: round to nearest even, like tsys_f32_to_bf16/f16.
    tsys_tensor *bf = tsys_tensor_new(ctx, TSYS_BF16, TSYS_CPU, 1, shape), *hf = tsys_tensor_new(ctx, TSYS_F16, TSYS_CPU, 1, shape);
    tsys_tensor_set_name(bf, "w");
    tsys_tensor_set_name(hf, "w");
    TEST_CHECK(tsys_safetensors_load_into(ctx, path, &bf, 1) == TSYS_OK, "into bf16: %s", tsys_ctx_last_error(ctx));
    TEST_CHECK(tsys_safetensors_load_into(ctx, path, &hf, 1) == TSYS_OK, "into f16: %s", tsys_ctx_last_error(ctx));
    for (int i = 0; i < 5; i++) {
        uint16_t b = ((const uint16_t *)tsys_tensor_data(bf))[i], h = ((const uint16_t *)tsys_tensor_data(hf))[i];
        TEST_CHECK(b == tsys_f32_to_bf16(v[i]), "bf16[%d] = 0x%04x, wanted 0x%04x", i, b, tsys_f32_to_bf16(v[i]));
        TEST_CHECK(h == tsys_f32_to_f16(v[i]), "f16[%d] = 0x%04x, wanted 0x%04x", i, h, tsys_f32_to_f16(v[i]));
    }

    // BF16 file -> F32 tensor: exact widening.
    path = st_path("conv_bf16.safetensors");
    TEST_CHECK(tsys_safetensors_save(ctx, path, &bf, 1) == TSYS_OK, "save bf16: %s", tsys_ctx_last_error(ctx));
    tsys_tensor *back = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, shape);
    tsys_tensor_set_name(back, "w");
    TEST_CHECK(tsys_safetensors_load_into(ctx, path, &back, 1) == TSYS_OK, "bf16 into f32: %s", tsys_ctx_last_error(ctx));
    for (int i = 0; i < 5; i++) {
        float got = ((const float *)tsys_tensor_data(back))[i], want = tsys_bf16_to_f32(tsys_f32_to_bf16(v[i]));
        TEST_CHECK(got == want, "f32[%d] = %.9g, wanted %.9g", i, got, want);
    }

    // Integer data never converts, and BF16 <-> F16 is not offered.
    tsys_tensor *i32 = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 1, shape);
    tsys_tensor_set_name(i32, "w");
    st_expect_error(ctx, tsys_safetensors_load_into(ctx, path, &i32, 1), TSYS_ERR_IO, "conv_bf16.safetensors", "'w'", "dtype mismatch", NULL);
    st_expect_error(ctx, tsys_safetensors_load_into(ctx, path, &hf, 1), TSYS_ERR_IO, "'w'", "dtype mismatch", NULL);
    tsys_tensor_release(i32);
    tsys_tensor_release(back);
    tsys_tensor_release(bf);
    tsys_tensor_release(hf);
    tsys_tensor_release(f32);
    tsys_ctx_free(ctx);
}

// ---- bad calls to save --------------------------------------------------------------------------------

TSYS_TEST(safetensors_save_rejects_bad_names) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    float v[2] = { 1, 2 };
    const int64_t shape[1] = { 2 };
    tsys_tensor *t[2] = { st_tensor(ctx, "same", TSYS_F32, 1, shape, v), st_tensor(ctx, "same", TSYS_F32, 1, shape, v) };
    const char *path = st_path("dup_save.safetensors");
    st_expect_error(ctx, tsys_safetensors_save(ctx, path, t, 2), TSYS_ERR_INVALID_ARGS, "dup_save.safetensors", "'same'", "twice", NULL);
    TEST_CHECK(st_file_size(path) < 0, "a failed save left a file behind");
    tsys_tensor_set_name(t[1], "%s", "");
    st_expect_error(ctx, tsys_safetensors_save(ctx, path, t, 2), TSYS_ERR_INVALID_ARGS, "tensors[1]", "no name", NULL);
    tsys_tensor_set_name(t[1], "__metadata__");
    st_expect_error(ctx, tsys_safetensors_save(ctx, path, t, 2), TSYS_ERR_INVALID_ARGS, "__metadata__", NULL);
    st_expect_error(ctx, tsys_safetensors_save(ctx, "/nonexistent-dir/x.safetensors", t, 1), TSYS_ERR_IO, "/nonexistent-dir/x.safetensors", NULL);
    st_free_all(t, 2);
    tsys_ctx_free(ctx);
}

// ---- saving never clobbers: a unique temporary, written fully, renamed into place ----------------------

// A fresh directory of its own for a test that counts the files it leaves.
static const char *st_subdir(const char *name) {
    const char *dir = st_path(name);
    if (mkdir(dir, 0700) != 0 && errno != EEXIST) TEST_CHECK(0, "mkdir %s: %s", dir, strerror(errno));
    return dir;
}

// Entries of dir other than "." and ".." whose names start with prefix.
static int st_count_entries(const char *dir, const char *prefix) {
    DIR *d = opendir(dir);
    int n = 0;
    if (!d) return -1;
    for (struct dirent *e; (e = readdir(d)) != NULL; )
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..") && strncmp(e->d_name, prefix, strlen(prefix)) == 0) n++;
    closedir(d);
    return n;
}

// The whole of a small file as a NUL-terminated string in buf ("" when it cannot be read).
static const char *st_slurp(const char *path, char *buf, size_t len) {
    FILE *f = fopen(path, "rb");
    size_t n = f ? fread(buf, 1, len - 1, f) : 0;
    if (f) fclose(f);
    buf[n] = 0;
    return buf;
}

static void st_write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    if (!f) { TEST_CHECK(0, "cannot write %s: %s", path, strerror(errno)); return; }
    fputs(text, f);
    fclose(f);
}

// Saves one F32 tensor "w" of n elements, each equal to v.
static tsys_status st_save_filled(tsys_ctx *ctx, const char *path, int64_t n, float v) {
    float *data = (float *)malloc((size_t)n * sizeof *data);
    if (!data) return TSYS_ERR_OOM;
    for (int64_t i = 0; i < n; i++) data[i] = v;
    tsys_tensor *t = st_tensor(ctx, "w", TSYS_F32, 1, &n, data);
    tsys_status s = t ? tsys_safetensors_save(ctx, path, &t, 1) : TSYS_ERR_OOM;
    tsys_tensor_release(t);
    free(data);
    return s;
}

// Loads path, expecting one F32 tensor "w" whose elements all equal one value; returns that value
// and its element count, or -1 when the file is not such a file (a torn or mixed write).
static float st_load_filled(tsys_ctx *ctx, const char *path, int64_t *n) {
    tsys_tensor **list = NULL;
    int count = 0;
    float v = -1;
    *n = 0;
    if (tsys_safetensors_load(ctx, path, TSYS_CPU, &list, &count) == TSYS_OK && count == 1 && strcmp(list[0]->name, "w") == 0) {
        const float *d = (const float *)tsys_tensor_data(list[0]);
        *n = tsys_tensor_numel(list[0]);
        v = *n ? d[0] : -1;
        for (int64_t i = 1; i < *n; i++) if (d[i] != v) { v = -1; break; }
    }
    tsys_ctx_clear_error(ctx);
    tsys_tensor_list_free(list, count);
    return v;
}

// Anything at the old fixed temporary name "<path>.tmp" is someone else's: a symlink planted there
// must not be followed (its target would be overwritten), and a regular file there must not be
// truncated or renamed away.
TSYS_TEST(safetensors_save_ignores_planted_tmp) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    const char *dir = st_subdir("planted");
    char path[512], tmp[520], victim[512], buf[64];
    snprintf(path, sizeof path, "%s/ck.safetensors", dir);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    snprintf(victim, sizeof victim, "%s/victim.txt", dir);
    st_write_text(victim, "precious");
    TEST_CHECK(symlink(victim, tmp) == 0, "symlink %s: %s", tmp, strerror(errno));
    TEST_CHECK(st_save_filled(ctx, path, 4, 1.0f) == TSYS_OK, "save beside a planted symlink: %s", tsys_ctx_last_error(ctx));
    TEST_CHECK(strcmp(st_slurp(victim, buf, sizeof buf), "precious") == 0, "the symlink's target was overwritten: '%s'", buf);
    struct stat st;
    TEST_CHECK(lstat(path, &st) == 0 && S_ISREG(st.st_mode), "%s is not a regular file after the save", path);
    TEST_CHECK(lstat(tmp, &st) == 0 && S_ISLNK(st.st_mode), "the planted symlink %s was moved", tmp);
    int64_t n = 0;
    TEST_CHECK(st_load_filled(ctx, path, &n) == 1.0f && n == 4, "the saved file does not load back");

    // A regular file at the old name stays as it is, too.
    unlink(tmp);
    st_write_text(tmp, "not yours");
    TEST_CHECK(st_save_filled(ctx, path, 4, 2.0f) == TSYS_OK, "save beside a file named .tmp: %s", tsys_ctx_last_error(ctx));
    TEST_CHECK(strcmp(st_slurp(tmp, buf, sizeof buf), "not yours") == 0, "%s was overwritten: '%s'", tmp, buf);
    TEST_CHECK(st_load_filled(ctx, path, &n) == 2.0f && n == 4, "the second save does not load back");
    TEST_CHECK(st_count_entries(dir, "ck.safetensors.tmp") == 1, "%d names start with ck.safetensors.tmp, wanted the planted file alone",
               st_count_entries(dir, "ck.safetensors.tmp"));
    tsys_ctx_free(ctx);
}

// One child of the concurrent test: waits for the start signal (the pipe closing), saves its own
// content (child c: (c + 1) * 16384 elements, each c + 1), exits 0 on success.
static void st_save_child(int start_fd, const char *path, int c) {
    char b;
    while (read(start_fd, &b, 1) < 0 && errno == EINTR) { }
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_status s = ctx ? st_save_filled(ctx, path, (int64_t)(c + 1) * 16384, (float)(c + 1)) : TSYS_ERR_OOM;
    if (s != TSYS_OK) fprintf(stderr, "    child %d: %s\n", c, ctx ? tsys_ctx_last_error(ctx) : "no context");
    tsys_ctx_free(ctx);
    _exit(s == TSYS_OK ? 0 : 1);   // never return into the harness: the parent runs the rest
}

// Several processes saving one path at once: every save succeeds and, each round, the file left is
// exactly one child's content (never a mix, never truncated).
TSYS_TEST(safetensors_concurrent_saves_of_one_path) {
    enum { CHILDREN = 4, ROUNDS = 40 };
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    const char *dir = st_subdir("concurrent");
    char path[512];
    snprintf(path, sizeof path, "%s/shared.safetensors", dir);
    int bad_rounds = 0, failed_saves = 0;
    for (int round = 0; round < ROUNDS; round++) {
        int start[2];
        if (pipe(start) != 0) { TEST_CHECK(0, "pipe: %s", strerror(errno)); break; }
        fflush(stdout);
        pid_t kids[CHILDREN];
        int forked = 0;
        for (int c = 0; c < CHILDREN; c++) {
            kids[c] = fork();
            if (kids[c] == 0) { close(start[1]); st_save_child(start[0], path, c); }
            if (kids[c] > 0) forked++;
        }
        close(start[0]);
        close(start[1]);   // all children start writing now
        for (int c = 0; c < CHILDREN; c++) {
            int status = 0;
            if (kids[c] <= 0) continue;
            while (waitpid(kids[c], &status, 0) < 0 && errno == EINTR) { }
            if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) failed_saves++;
        }
        TEST_CHECK(forked == CHILDREN, "fork: %s", strerror(errno));
        int64_t n = 0;
        float v = st_load_filled(ctx, path, &n);
        bool one_child = v >= 1 && v <= CHILDREN && n == (int64_t)v * 16384;
        if (!one_child) bad_rounds++;
    }
    TEST_CHECK(failed_saves == 0, "%d of %d saves failed", failed_saves, CHILDREN * ROUNDS);
    TEST_CHECK(bad_rounds == 0, "%d of %d rounds left a file that is not one child's content", bad_rounds, ROUNDS);
    TEST_CHECK(st_count_entries(dir, "shared.safetensors.tmp") == 0, "%d temporaries left behind", st_count_entries(dir, "shared.safetensors.tmp"));
    tsys_ctx_free(ctx);
}

// A save that fails leaves the final name as it was and no temporary behind, and says which path.
TSYS_TEST(safetensors_failed_save_leaves_nothing) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    const char *dir = st_subdir("failing");
    char path[512], tmp[520], buf[64];

    // The path is a directory: the rename cannot replace it. A file that happens to be called
    // "<path>.tmp" is not the save's to truncate or delete.
    snprintf(path, sizeof path, "%s/is_a_dir.safetensors", dir);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    TEST_CHECK(mkdir(path, 0700) == 0, "mkdir %s: %s", path, strerror(errno));
    st_write_text(tmp, "not yours");
    st_expect_error(ctx, st_save_filled(ctx, path, 4, 1.0f), TSYS_ERR_IO, path, NULL);
    struct stat st;
    TEST_CHECK(stat(path, &st) == 0 && S_ISDIR(st.st_mode), "the directory %s changed", path);
    TEST_CHECK(strcmp(st_slurp(tmp, buf, sizeof buf), "not yours") == 0, "a failed save clobbered %s: '%s'", tmp, buf);
    TEST_CHECK(st_count_entries(dir, "is_a_dir.safetensors.tmp") == 1, "%d names start with is_a_dir.safetensors.tmp, wanted the planted file alone",
               st_count_entries(dir, "is_a_dir.safetensors.tmp"));

    // A write that fails half way (here the file size limit, as a full disk would): the old file
    // stays whole. In a child, so the limit does not outlive the test.
    snprintf(path, sizeof path, "%s/full_disk.safetensors", dir);
    TEST_CHECK(st_save_filled(ctx, path, 4, 3.0f) == TSYS_OK, "first save: %s", tsys_ctx_last_error(ctx));
    fflush(stdout);
    pid_t kid = fork();
    if (kid == 0) {
        struct rlimit lim = { 64 * 1024, 64 * 1024 };
        signal(SIGXFSZ, SIG_IGN);   // write() then fails with EFBIG instead of killing the process
        tsys_ctx *c = tsys_ctx_new(NULL);
        bool ok = c && setrlimit(RLIMIT_FSIZE, &lim) == 0;
        tsys_status s = ok ? st_save_filled(c, path, 1 << 20, 4.0f) : TSYS_OK;
        const char *msg = c ? tsys_ctx_last_error(c) : "";
        if (ok && (s != TSYS_ERR_IO || !strstr(msg, path))) fprintf(stderr, "    child: status %d, message %s\n", (int)s, msg);
        _exit(!ok ? 2 : s == TSYS_ERR_IO && strstr(msg, path) ? 0 : 1);
    }
    int status = -1;
    if (kid > 0) while (waitpid(kid, &status, 0) < 0 && errno == EINTR) { }
    TEST_CHECK(kid > 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0, "a save past the file size limit must fail naming the path (status %d)", status);
    int64_t n = 0;
    TEST_CHECK(st_load_filled(ctx, path, &n) == 3.0f && n == 4, "the failed save changed %s", path);
    TEST_CHECK(st_count_entries(dir, "full_disk.safetensors.") == 0, "temporaries left behind: %d", st_count_entries(dir, "full_disk.safetensors."));
    tsys_ctx_free(ctx);
}

// ---- corrupt files ------------------------------------------------------------------------------------

// Loads path both ways (load and load_into a tensor "x" of shape (2,) F32) and expects the same error.
static void st_expect_bad_file(tsys_ctx *ctx, const char *path, const char *sub1, const char *sub2) {
    tsys_tensor **list = (tsys_tensor **)0x1;
    int n = -1;
    const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    tsys_status s = tsys_safetensors_load(ctx, path, TSYS_CPU, &list, &n);
    if (!st_expect_error(ctx, s, TSYS_ERR_IO, base, sub1, sub2, NULL)) printf("    (file %s, via load)\n", base);
    TEST_CHECK(list == NULL && n == 0, "a failed load must return no tensors (n %d)", n);
    const int64_t shape[1] = { 2 };
    float keep[2] = { 7, 7 };
    tsys_tensor *x = st_tensor(ctx, "x", TSYS_F32, 1, shape, keep);
    s = tsys_safetensors_load_into(ctx, path, &x, 1);
    if (!st_expect_error(ctx, s, TSYS_ERR_IO, base, sub1, sub2, NULL)) printf("    (file %s, via load_into)\n", base);
    TEST_CHECK(memcmp(tsys_tensor_data(x), keep, sizeof keep) == 0, "a failed load_into changed the tensor");
    tsys_tensor_release(x);
}

static const float st_x_data[2] = { 1.0f, 2.0f };
#define ST_X_OK "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}"

TSYS_TEST(safetensors_corrupt_file_size) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    // Sanity: the well-formed variant loads.
    const char *path = st_path("good.safetensors");
    st_write_file(path, ST_X_OK, st_x_data, 8);
    tsys_tensor **list = NULL;
    int n = 0;
    TEST_CHECK(tsys_safetensors_load(ctx, path, TSYS_CPU, &list, &n) == TSYS_OK && n == 1, "good file: %s", tsys_ctx_last_error(ctx));
    if (n == 1) TEST_CHECK(((const float *)tsys_tensor_data(list[0]))[1] == 2.0f, "good file: wrong data");
    tsys_tensor_list_free(list, n);

    st_expect_bad_file(ctx, st_path("does_not_exist.safetensors"), "cannot open", NULL);
    path = st_path("empty_file.safetensors");
    st_write_raw(path, 0, NULL, 0, NULL, 0);
    { FILE *f = fopen(path, "wb"); if (f) fclose(f); }   // 0 bytes
    st_expect_bad_file(ctx, path, "too short", NULL);
    path = st_path("three_bytes.safetensors");
    { FILE *f = fopen(path, "wb"); if (f) { fwrite("abc", 1, 3, f); fclose(f); } }
    st_expect_bad_file(ctx, path, "too short", NULL);
    path = st_path("header_past_end.safetensors");
    st_write_raw(path, 1000, ST_X_OK, strlen(ST_X_OK), st_x_data, 8);
    st_expect_bad_file(ctx, path, "header length 1000", "past the end");
    path = st_path("huge_len.safetensors");
    st_write_raw(path, UINT64_MAX, ST_X_OK, strlen(ST_X_OK), st_x_data, 8);
    st_expect_bad_file(ctx, path, "past the end", NULL);
    path = st_path("truncated_data.safetensors");   // the header promises 8 bytes, the file has 5
    st_write_file(path, ST_X_OK, st_x_data, 5);
    st_expect_bad_file(ctx, path, "'x'", "outside the 5-byte data buffer");
    path = st_path("trailing_data.safetensors");
    { char data[12] = { 0 }; st_write_file(path, ST_X_OK, data, 12); }
    st_expect_bad_file(ctx, path, "trailing", NULL);
    path = st_path("zero_len.safetensors");
    st_write_raw(path, 0, NULL, 0, NULL, 0);
    st_expect_bad_file(ctx, path, "header length 0", NULL);
    tsys_ctx_free(ctx);
}

TSYS_TEST(safetensors_corrupt_json) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    static const char *bad[] = {
        "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}",        // unterminated object
        "{\"x\" {\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",       // missing colon
        "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}xyz",    // trailing garbage
        "{\"x\":{\"dtype\":\"F32\",\"shape\":[2,],\"data_offsets\":[0,8]}}",      // trailing comma
        "{\"x\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}",      // negative dim
        "{\"x\":{\"dtype\":\"F32\",\"shape\":[02],\"data_offsets\":[0,8]}}",      // leading zero
        "{\"x\":{\"dtype\":\"F32\",\"shape\":[2.0],\"data_offsets\":[0,8]}}",     // fraction
        "{\"x\":{\"dtype\":\"F32\",\"shape\":[99999999999999999999],\"data_offsets\":[0,8]}}",   // overflow
        "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}",         // one offset
        "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8,9]}}",     // three offsets
        "{\"x\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,2],\"data_offsets\":[0,8]}}",   // 9 dims
        "{\"x\":{\"dtype\":F32,\"shape\":[2],\"data_offsets\":[0,8]}}",           // unquoted string
        "{\"x\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",   // field twice
        "{\"x\":{\"dtype\":\"F\\q32\",\"shape\":[2],\"data_offsets\":[0,8]}}",    // bad escape
        "{\"x\\u0000y\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",   // NUL in a name
        "{\"x\\ud800\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",    // lone surrogate
        "{\"x\":[1,2]}",                                                          // entry not an object
        "{\"__metadata__\":[1],\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",
        "{\"__metadata__\":{\"a\":tru},\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",
        "{\"__metadata__\":{\"a\":1e},\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",
        "[]",
        "",
        "  ",
        "\"x\"",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char name[64];
        snprintf(name, sizeof name, "garbled_%zu.safetensors", i);
        const char *path = st_path(name);
        st_write_file(path, bad[i], st_x_data, 8);
        st_expect_bad_file(ctx, path, strlen(bad[i]) < 2 ? "header length" : "garbled header JSON", NULL);
    }
    // The message names the tensor being parsed when there is one.
    const char *path = st_path("garbled_named.safetensors");
    st_write_file(path, "{\"layers.3.ffn.w1.weight\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8}}", st_x_data, 8);
    st_expect_bad_file(ctx, path, "garbled header JSON in tensor 'layers.3.ffn.w1.weight'", NULL);

    // 100 000 nested arrays in the metadata: refused by the depth limit, not by a stack overflow.
    size_t deep = 100000;
    char *hdr = (char *)malloc(2 * deep + 64);
    if (hdr) {
        size_t k = (size_t)sprintf(hdr, "{\"__metadata__\":{\"a\":");
        for (size_t i = 0; i < deep; i++) hdr[k++] = '[';
        for (size_t i = 0; i < deep; i++) hdr[k++] = ']';
        strcpy(hdr + k, "}}");
        path = st_path("deep.safetensors");
        st_write_file(path, hdr, NULL, 0);
        st_expect_bad_file(ctx, path, "nesting too deep", NULL);
        free(hdr);
    }
    tsys_ctx_free(ctx);
}

TSYS_TEST(safetensors_corrupt_entries) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    static const struct { const char *hdr; const char *sub1, *sub2; } cases[] = {
        { "{\"x\":{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[0,8]}}", "'x'", "unknown dtype 'F64'" },
        { "{\"x\":{\"dtype\":\"Q4_K\",\"shape\":[2],\"data_offsets\":[0,8]}}", "'x'", "unknown dtype 'Q4_K'" },
        { "{\"x\":{\"dtype\":\"f32\",\"shape\":[2],\"data_offsets\":[0,8]}}", "'x'", "unknown dtype" },
        { "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,16]}}", "'x'", "outside the 8-byte data buffer" },
        { "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", "'x'", "reversed" },
        { "{\"x\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", "'x'", "needs 12" },
        { "{\"x\":{\"dtype\":\"I64\",\"shape\":[2],\"data_offsets\":[0,8]}}", "'x'", "I64 (2) needs 16" },
        { "{\"x\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904,4],\"data_offsets\":[0,8]}}", "'x'", "overflows" },
        { "{\"x\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904,0,4],\"data_offsets\":[0,8]}}", "'x'", "needs 0" },
        // partial products must fit int64 (tsys_tensor_numel's arithmetic), even when a later dim is 0
        { "{\"x\":{\"dtype\":\"F32\",\"shape\":[4,4611686018427387904,0],\"data_offsets\":[0,0]},"
          "\"y\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", "'x'", "overflows" },
        { "{\"x\":{\"dtype\":\"F32\",\"shape\":[2]}}", "'x'", "lacks \"data_offsets\"" },
        { "{\"x\":{\"shape\":[2],\"data_offsets\":[0,8]}}", "'x'", "lacks \"dtype\"" },
        { "{\"x\":{\"dtype\":\"F32\",\"data_offsets\":[0,8]}}", "'x'", "lacks \"shape\"" },
        { "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",
          "'x'", "appears twice" },
        { "{\"__metadata__\":{},\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},\"__metadata__\":{}}", "__metadata__", "twice" },
        { "{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},\"y\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
          "data_offsets start at 0", "overlap" },
        { "{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", "'x'", "gap" },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char name[64];
        snprintf(name, sizeof name, "bad_entry_%zu.safetensors", i);
        const char *path = st_path(name);
        st_write_file(path, cases[i].hdr, st_x_data, 8);
        st_expect_bad_file(ctx, path, cases[i].sub1, cases[i].sub2);
    }
    tsys_ctx_free(ctx);
}

// ---- large headers: checks and lookups in linear time ---------------------------------------------------

#define ST_MANY 200000
// The bound on each load: 5 s, or 20 s under AddressSanitizer (its malloc records a stack per call,
// which makes 200 000 tensors several times slower). The pairwise checks took about 290 s without it.
#if defined(__SANITIZE_ADDRESS__)
#define ST_MANY_SECONDS 20.0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ST_MANY_SECONDS 20.0
#endif
#endif
#ifndef ST_MANY_SECONDS
#define ST_MANY_SECONDS 5.0
#endif

// A header of n one-element F32 tensors "t000000".. in file order, with tensor i at byte 4 i; with
// dup_of >= 0 the last tensor takes the name of tensor dup_of. The data holds i at element i.
static bool st_write_many(const char *path, int n, int dup_of) {
    size_t cap = (size_t)n * 80 + 16, len = 0;
    char *hdr = (char *)malloc(cap);
    float *data = (float *)malloc((size_t)n * sizeof *data);
    if (!hdr || !data) { free(hdr); free(data); return false; }
    hdr[len++] = '{';
    for (int i = 0; i < n; i++) {
        int name = i == n - 1 && dup_of >= 0 ? dup_of : i;
        len += (size_t)snprintf(hdr + len, cap - len, "%s\"t%06d\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[%d,%d]}",
                                i ? "," : "", name, 4 * i, 4 * i + 4);
        data[i] = (float)i;
    }
    hdr[len++] = '}';
    hdr[len] = 0;
    st_write_file(path, hdr, data, (size_t)n * sizeof *data);
    free(hdr);
    free(data);
    return true;
}

// 200 000 tensors: the header's duplicate check and load_into's name lookups must not be pairwise
// (that took minutes; the reference Rust implementation needs under a second).
TSYS_TEST(safetensors_many_tensors_load_fast) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    const char *path = st_path("many.safetensors");
    TEST_CHECK(st_write_many(path, ST_MANY, -1), "out of memory writing %s", path);
    tsys_tensor **list = NULL;
    int n = 0;
    double t0 = tsys_time_us();
    tsys_status s = tsys_safetensors_load(ctx, path, TSYS_CPU, &list, &n);
    double load_s = (tsys_time_us() - t0) * 1e-6;
    TEST_CHECK(s == TSYS_OK && n == ST_MANY, "load: %d tensors, %s", n, tsys_ctx_last_error(ctx));
    TEST_CHECK(load_s < ST_MANY_SECONDS, "loading %d tensors took %.1f s", ST_MANY, load_s);
    if (n == ST_MANY) {
        const tsys_tensor *last = st_find(list, n, "t199999");
        TEST_CHECK(last && st_at(last, 0) == 199999.0f, "tensor t199999 is missing or wrong");
    }
    if (s != TSYS_OK || load_s >= ST_MANY_SECONDS) { tsys_tensor_list_free(list, n); tsys_ctx_free(ctx); return; }

    // load_into the same tensors in reverse order: one lookup per tensor.
    tsys_tensor **into = (tsys_tensor **)malloc((size_t)n * sizeof *into);
    for (int i = 0; into && i < n; i++) into[i] = list[n - 1 - i];
    for (int i = 0; into && i < n; i++) ((float *)tsys_tensor_data(into[i]))[0] = -1.0f;
    t0 = tsys_time_us();
    s = into ? tsys_safetensors_load_into(ctx, path, into, n) : TSYS_ERR_OOM;
    double into_s = (tsys_time_us() - t0) * 1e-6;
    TEST_CHECK(s == TSYS_OK, "load_into: %s", tsys_ctx_last_error(ctx));
    TEST_CHECK(into_s < ST_MANY_SECONDS, "load_into of %d tensors took %.1f s", n, into_s);
    int wrong = 0;
    for (int i = 0; s == TSYS_OK && i < n; i++) wrong += st_at(list[i], 0) != (float)i;
    TEST_CHECK(wrong == 0, "%d tensors hold the wrong value after load_into", wrong);
    free(into);
    tsys_tensor_list_free(list, n);
    tsys_ctx_free(ctx);
}

// A duplicate name among 200 000 (the last tensor takes the first one's name) is still found, by name.
TSYS_TEST(safetensors_many_tensors_duplicate_found) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    const char *path = st_path("many_dup.safetensors");
    TEST_CHECK(st_write_many(path, ST_MANY, 0), "out of memory writing %s", path);
    double t0 = tsys_time_us();
    st_expect_bad_file(ctx, path, "'t000000'", "appears twice");
    double both_s = (tsys_time_us() - t0) * 1e-6;   // load and load_into
    TEST_CHECK(both_s < 2 * ST_MANY_SECONDS, "refusing the duplicate (twice) took %.1f s", both_s);
    tsys_ctx_free(ctx);
}

// JSON text is UTF-8: a raw byte sequence that is not (a stray continuation byte, an overlong form,
// a UTF-16 surrogate, a code point past U+10FFFF, a sequence cut short) is refused in a tensor name,
// a field name or a metadata string; valid multi-byte names load and save.
TSYS_TEST(safetensors_names_must_be_utf8) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    static const char *bad_names[] = { "x\x80", "\xc0\xaf", "\xc1\xbf", "\xed\xa0\x80", "\xf5\x80\x80\x80", "\xf4\x90\x80\x80",
                                       "x\xe2\x82", "\xe0\x80\xaf", "\xf0\x80\x80\xaf", "\xff", "a\xc3" };
    for (size_t i = 0; i < sizeof bad_names / sizeof bad_names[0]; i++) {
        char hdr[256], name[64];
        snprintf(hdr, sizeof hdr, "{\"%s\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", bad_names[i]);
        snprintf(name, sizeof name, "bad_utf8_name_%zu.safetensors", i);
        const char *path = st_path(name);
        st_write_file(path, hdr, st_x_data, 8);
        st_expect_bad_file(ctx, path, "invalid UTF-8", NULL);
    }
    const char *path = st_path("bad_utf8_metadata.safetensors");
    st_write_file(path, "{\"__metadata__\":{\"k\":\"v\xc3\x28\"},\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", st_x_data, 8);
    st_expect_bad_file(ctx, path, "invalid UTF-8", NULL);
    path = st_path("bad_utf8_field.safetensors");
    st_write_file(path, "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"\xbf\":1}}", st_x_data, 8);
    st_expect_bad_file(ctx, path, "invalid UTF-8", NULL);

    // Two-, three- and four-byte names (and the same name escaped as \u) round trip.
    static const char *good[] = { "gewicht.\xc3\xa4", "\xe5\xb1\x82.0", "emoji.\xf0\x9f\x98\x80", "max.\xf4\x8f\xbf\xbf" };
    float v[2] = { 3, 4 };
    const int64_t shape[1] = { 2 };
    tsys_tensor *t[4];
    for (int i = 0; i < 4; i++) t[i] = st_tensor(ctx, good[i], TSYS_F32, 1, shape, v);
    path = st_path("good_utf8.safetensors");
    TEST_CHECK(tsys_safetensors_save(ctx, path, t, 4) == TSYS_OK, "save: %s", tsys_ctx_last_error(ctx));
    tsys_tensor **back = NULL;
    int n = 0;
    TEST_CHECK(tsys_safetensors_load(ctx, path, TSYS_CPU, &back, &n) == TSYS_OK && n == 4, "load: %s", tsys_ctx_last_error(ctx));
    for (int i = 0; i < n && i < 4; i++) TEST_CHECK(st_same(t[i], st_find(back, n, good[i])), "'%s' differs after the round trip", good[i]);
    tsys_tensor_list_free(back, n);
    path = st_path("escaped_utf8.safetensors");
    st_write_file(path, "{\"gewicht.\\u00e4\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", v, 8);
    TEST_CHECK(tsys_safetensors_load_into(ctx, path, &t[0], 1) == TSYS_OK, "\\u00e4 is the same name as its UTF-8 bytes: %s", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);

    // Saving refuses a name the loader would refuse to read back.
    tsys_tensor_set_name(t[1], "bad.\xc3");
    st_expect_error(ctx, tsys_safetensors_save(ctx, st_path("bad_name_save.safetensors"), t, 2), TSYS_ERR_INVALID_ARGS,
                    "tensors[1]", "not valid UTF-8", NULL);
    st_free_all(t, 4);
    tsys_ctx_free(ctx);
}

// Only regular files: a FIFO must be refused at once (a plain fopen waits for a writer forever), a
// directory must be refused by name (a plain fopen "opens" it with a size of LONG_MAX), and so must
// a device.
TSYS_TEST(safetensors_rejects_fifo_directory_device) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    const char *fifo = st_path("pipe.safetensors");
    unlink(fifo);
    if (mkfifo(fifo, 0600) != 0) { TEST_CHECK(0, "mkfifo %s: %s", fifo, strerror(errno)); tsys_ctx_free(ctx); return; }
    alarm(20);   // a hang kills the test binary (the runner then reports it) instead of stalling make test
    double t0 = tsys_time_us();
    st_expect_bad_file(ctx, fifo, "FIFO", "regular file");
    TEST_CHECK(tsys_time_us() - t0 < 5e6, "rejecting a FIFO took %.1f s", (tsys_time_us() - t0) * 1e-6);
    alarm(0);
    unlink(fifo);

    const char *dir = st_path("dir.safetensors");
    TEST_CHECK(mkdir(dir, 0700) == 0, "mkdir %s: %s", dir, strerror(errno));
    tsys_tensor **list = NULL;
    int n = 0;
    tsys_status s = tsys_safetensors_load(ctx, dir, TSYS_CPU, &list, &n);
    const char *msg = tsys_ctx_last_error(ctx);
    TEST_CHECK(s == TSYS_ERR_IO && strstr(msg, "is a directory") && strstr(msg, "dir.safetensors"), "directory: %s", msg);
    TEST_CHECK(!strstr(msg, "9223372036854775807"), "a directory reported as a huge file: %s", msg);
    tsys_ctx_clear_error(ctx);
    st_expect_bad_file(ctx, dir, "directory", NULL);
    rmdir(dir);

    st_expect_bad_file(ctx, "/dev/null", "device", NULL);
    tsys_ctx_free(ctx);
}

TSYS_TEST(safetensors_mismatched_tensors) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    float v[6] = { 1, 2, 3, 4, 5, 6 };
    const int64_t s23[2] = { 2, 3 }, s32[2] = { 3, 2 }, s6[1] = { 6 };
    tsys_tensor *w = st_tensor(ctx, "layers.0.attn.q_proj.weight", TSYS_F32, 2, s23, v);
    const char *path = st_path("mismatch.safetensors");
    TEST_CHECK(tsys_safetensors_save(ctx, path, &w, 1) == TSYS_OK, "save: %s", tsys_ctx_last_error(ctx));

    float zero[6] = { 0 };
    tsys_tensor *ok = st_tensor(ctx, "layers.0.attn.q_proj.weight", TSYS_F32, 2, s23, zero);
    tsys_tensor *missing = st_tensor(ctx, "layers.0.attn.k_proj.weight", TSYS_F32, 2, s23, zero);
    tsys_tensor *t32 = st_tensor(ctx, "layers.0.attn.q_proj.weight", TSYS_F32, 2, s32, zero);
    tsys_tensor *t6 = st_tensor(ctx, "layers.0.attn.q_proj.weight", TSYS_F32, 1, s6, zero);
    tsys_tensor *pair[2] = { ok, missing };
    st_expect_error(ctx, tsys_safetensors_load_into(ctx, path, pair, 2), TSYS_ERR_IO,
                    "mismatch.safetensors", "'layers.0.attn.k_proj.weight'", "missing", NULL);
    TEST_CHECK(memcmp(tsys_tensor_data(ok), zero, sizeof zero) == 0, "a failed load_into filled the tensors before the bad one");
    st_expect_error(ctx, tsys_safetensors_load_into(ctx, path, &t32, 1), TSYS_ERR_IO,
                    "mismatch.safetensors", "'layers.0.attn.q_proj.weight'", "file (2, 3), tensor (3, 2)", NULL);
    st_expect_error(ctx, tsys_safetensors_load_into(ctx, path, &t6, 1), TSYS_ERR_IO, "file (2, 3), tensor (6)", NULL);
    TEST_CHECK(tsys_safetensors_load_into(ctx, path, &ok, 1) == TSYS_OK, "good load_into: %s", tsys_ctx_last_error(ctx));
    TEST_CHECK(memcmp(tsys_tensor_data(ok), v, sizeof v) == 0, "good load_into: wrong data");
    tsys_tensor_release(w);
    tsys_tensor_release(ok);
    tsys_tensor_release(missing);
    tsys_tensor_release(t32);
    tsys_tensor_release(t6);
    tsys_ctx_free(ctx);
}

// Every prefix of a valid file, and every single-byte corruption of its header, must fail cleanly or
// load; never crash or read out of bounds (run under -fsanitize=address to make that strict).
TSYS_TEST(safetensors_fuzz_prefixes_and_bytes) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_tensor *t[ST_N];
    st_make_five(ctx, t);
    const char *good = st_path("fuzz_src.safetensors");
    TEST_CHECK(tsys_safetensors_save(ctx, good, t, ST_N) == TSYS_OK, "save: %s", tsys_ctx_last_error(ctx));
    st_free_all(t, ST_N);
    long size = st_file_size(good);
    unsigned char *bytes = (unsigned char *)malloc((size_t)size);
    FILE *f = fopen(good, "rb");
    TEST_CHECK(f && bytes && fread(bytes, 1, (size_t)size, f) == (size_t)size, "read back");
    if (f) fclose(f);
    const char *path = st_path("fuzz.safetensors");
    int loaded = 0, failed = 0;
    for (long cut = 0; bytes && cut < size; cut++) {
        FILE *g = fopen(path, "wb");
        fwrite(bytes, 1, (size_t)cut, g);
        fclose(g);
        tsys_tensor **list = NULL;
        int n = 0;
        tsys_status s = tsys_safetensors_load(ctx, path, TSYS_CPU, &list, &n);
        if (s == TSYS_OK) loaded++; else failed++;
        tsys_ctx_clear_error(ctx);
        tsys_tensor_list_free(list, n);
    }
    TEST_CHECK(loaded == 0 && failed == size, "every proper prefix must fail (%d loaded)", loaded);
    static const unsigned char junk[] = { 0, '"', '\\', '{', '}', '[', ']', ',', ':', '9', '-', 'e', 0xff };
    uint64_t hlen = 0;
    for (int i = 7; bytes && i >= 0; i--) hlen = hlen << 8 | bytes[i];
    for (uint64_t at = 8; bytes && at < 8 + hlen; at++) {
        for (size_t j = 0; j < sizeof junk; j++) {
            unsigned char keep = bytes[at];
            bytes[at] = junk[j];
            FILE *g = fopen(path, "wb");
            fwrite(bytes, 1, (size_t)size, g);
            fclose(g);
            bytes[at] = keep;
            tsys_tensor **list = NULL;
            int n = 0;
            tsys_status s = tsys_safetensors_load(ctx, path, TSYS_CPU, &list, &n);
            TEST_CHECK(s == TSYS_OK || s == TSYS_ERR_IO || s == TSYS_ERR_UNSUPPORTED, "unexpected status %d", (int)s);
            TEST_CHECK(s != TSYS_OK || n > 0, "a load that succeeds returns tensors");
            tsys_ctx_clear_error(ctx);
            tsys_tensor_list_free(list, n);
        }
    }
    free(bytes);
    tsys_ctx_free(ctx);
}

// ---- files written by PyTorch (tests/ref/make_fixtures.py) ----------------------------------------------

static const char *st_fixture(const char *name) {
    static char buf[512];
    const char *dir = getenv("TSYS_FIXTURES");
    snprintf(buf, sizeof buf, "%s/%s", dir ? dir : "tests/fixtures", name);
    return buf;
}

TSYS_TEST(safetensors_reads_pytorch_model) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_tensor **w = NULL;
    int n = 0;
    tsys_status s = tsys_safetensors_load(ctx, st_fixture("model.safetensors"), TSYS_CPU, &w, &n);
    TEST_CHECK(s == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    TEST_CHECK(n == 3 + 2 * 9, "%d tensors, wanted 21", n);
    static const struct { const char *name; int ndim; int64_t d0, d1; } want[] = {
        { "token_embeddings.weight", 2, 256, 32 }, { "lm_head.weight", 2, 256, 32 }, { "ln_final.weight", 1, 32, 0 },
        { "layers.0.attn.q_proj.weight", 2, 32, 32 }, { "layers.0.attn.k_proj.weight", 2, 32, 32 },
        { "layers.0.attn.v_proj.weight", 2, 32, 32 }, { "layers.0.attn.output_proj.weight", 2, 32, 32 },
        { "layers.1.ffn.w1.weight", 2, 64, 32 }, { "layers.1.ffn.w2.weight", 2, 32, 64 }, { "layers.1.ffn.w3.weight", 2, 64, 32 },
        { "layers.1.ln1.weight", 1, 32, 0 }, { "layers.1.ln2.weight", 1, 32, 0 },
    };
    for (size_t i = 0; s == TSYS_OK && i < sizeof want / sizeof want[0]; i++) {
        const tsys_tensor *t = st_find(w, n, want[i].name);
        TEST_CHECK(t != NULL, "'%s' missing", want[i].name);
        if (!t) continue;
        TEST_CHECK(t->dtype == TSYS_F32 && t->ndim == want[i].ndim && t->shape[0] == want[i].d0 && (t->ndim == 1 || t->shape[1] == want[i].d1),
                   "'%s': dtype %d, %d dims (%lld, %lld)", want[i].name, (int)t->dtype, t->ndim, (long long)t->shape[0], (long long)t->shape[1]);
    }
    // Values printed by python (torch.manual_seed(0)); %.9g round-trips fp32 exactly.
    const tsys_tensor *e = st_find(w, n, "token_embeddings.weight"), *q = st_find(w, n, "layers.0.attn.q_proj.weight");
    const tsys_tensor *lm = st_find(w, n, "lm_head.weight"), *w2 = st_find(w, n, "layers.1.ffn.w2.weight"), *lnf = st_find(w, n, "ln_final.weight");
    if (e && q && lm && w2 && lnf) {
        TEST_CHECK(st_at(e, 0) == -1.12583983f && st_at(e, 1) == -1.1523602f && st_at(e, 2) == -0.250578582f && st_at(e, 256 * 32 - 1) == -0.185628295f,
                   "token_embeddings: %.9g %.9g %.9g .. %.9g", st_at(e, 0), st_at(e, 1), st_at(e, 2), st_at(e, 256 * 32 - 1));
        TEST_CHECK(st_at(q, 0) == 0.0690969005f && st_at(q, 1) == 0.135308757f && st_at(q, 32 * 32 - 1) == 0.0717968196f, "q_proj: %.9g", st_at(q, 0));
        TEST_CHECK(st_at(lm, 0) == 0.0556300357f && st_at(lm, 256 * 32 - 1) == 0.153317511f, "lm_head: %.9g", st_at(lm, 0));
        TEST_CHECK(st_at(w2, 0) == -0.0453625321f && st_at(w2, 5 * 64 + 7) == 0.0462231003f && st_at(w2, 31 * 64 + 63) == -0.0669946373f,
                   "ffn.w2: %.9g", st_at(w2, 0));
        TEST_CHECK(st_at(lnf, 0) == 1.0f && st_at(lnf, 31) == 1.0f, "ln_final: %.9g", st_at(lnf, 0));
    }

    // Saved again by tsys and reloaded, every tensor is bit-identical.
    const char *path = st_path("model_again.safetensors");
    TEST_CHECK(tsys_safetensors_save(ctx, path, w, n) == TSYS_OK, "save: %s", tsys_ctx_last_error(ctx));
    tsys_tensor **w_again = NULL;
    int n_again = 0;
    TEST_CHECK(tsys_safetensors_load(ctx, path, TSYS_CPU, &w_again, &n_again) == TSYS_OK && n_again == n, "reload: %s", tsys_ctx_last_error(ctx));
    for (int i = 0; i < n && n_again == n; i++) TEST_CHECK(st_same(w[i], st_find(w_again, n_again, w[i]->name)), "'%s' changed", w[i]->name);
    tsys_tensor_list_free(w_again, n_again);
    tsys_tensor_list_free(w, n);
    tsys_ctx_free(ctx);
}

TSYS_TEST(safetensors_reads_pytorch_batch) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    const int64_t s_ids[2] = { 2, 16 }, s_logits[3] = { 2, 16, 256 }, s_loss[1] = { 1 };
    tsys_tensor *ids = tsys_tensor_new(ctx, TSYS_I64, TSYS_CPU, 2, s_ids), *tg = tsys_tensor_new(ctx, TSYS_I64, TSYS_CPU, 2, s_ids);
    tsys_tensor *logits = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 3, s_logits), *loss = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, s_loss);
    tsys_tensor *bf_logits = tsys_tensor_new(ctx, TSYS_BF16, TSYS_CPU, 3, s_logits);
    tsys_tensor_set_name(ids, "input_ids");
    tsys_tensor_set_name(tg, "targets");
    tsys_tensor_set_name(logits, "logits");
    tsys_tensor_set_name(bf_logits, "logits");
    tsys_tensor_set_name(loss, "loss");
    tsys_tensor *all[5] = { ids, tg, logits, loss, bf_logits };
    tsys_status s = tsys_safetensors_load_into(ctx, st_fixture("batch.safetensors"), all, 5);
    TEST_CHECK(s == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    if (s == TSYS_OK) {
        const int64_t *i = (const int64_t *)tsys_tensor_data(ids), *t = (const int64_t *)tsys_tensor_data(tg);
        TEST_CHECK(i[0] == 37 && i[1] == 235 && i[2] == 140 && i[3] == 72, "input_ids %lld %lld %lld %lld", (long long)i[0], (long long)i[1], (long long)i[2], (long long)i[3]);
        TEST_CHECK(t[0] == 215 && t[1] == 215 && t[2] == 233 && t[3] == 241, "targets %lld ..", (long long)t[0]);
        TEST_CHECK(st_at(loss, 0) == 5.734121799468994f, "loss %.9g", st_at(loss, 0));
        enum { NL = 2 * 16 * 256 };
        static float widened[NL];
        int bad = 0;
        for (int64_t k = 0; k < NL; k++) {
            uint16_t h = ((const uint16_t *)tsys_tensor_data(bf_logits))[k];
            bad += h != tsys_f32_to_bf16(st_at(logits, k));
            widened[k] = tsys_bf16_to_f32(h);
        }
        TEST_CHECK(bad == 0, "%d bf16 logits differ from the rounded fp32 ones", bad);
        // bf16 keeps 8 significant bits: each element within 2^-8 relative, the whole within less.
        const float *ref = (const float *)tsys_tensor_data(logits);
        double worst = tsys_test_close_ratio(widened, ref, NL, 1.0 / 256, 0.0), rel = tsys_test_rel_err(widened, ref, NL);
        TEST_CHECK(worst <= 1.0 && rel < 1.0 / 256, "bf16 logits: close ratio %g, relative error %g", worst, rel);
    }
    for (int k = 0; k < 5; k++) tsys_tensor_release(all[k]);
    tsys_ctx_free(ctx);
}

// The model's own parameters, named by tsys as in PyTorch's state_dict, take the PyTorch weights.
TSYS_TEST(safetensors_pytorch_weights_into_model) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_model_desc d;
    memset(&d, 0, sizeof d);
    d.vocab_size = 256; d.context_length = 16; d.d_model = 32; d.num_layers = 2; d.num_heads = 4; d.d_ff = 64;
    d = tsys_model_desc_defaults(&d);
    tsys_model *m = tsys_model_new(ctx, &d, TSYS_CPU, 1);
    TEST_CHECK(m != NULL, "model: %s", tsys_ctx_last_error(ctx));
    if (m) {
        tsys_status s = tsys_safetensors_load_into(ctx, st_fixture("model.safetensors"), tsys_model_params(m), tsys_model_num_tensors(m));
        TEST_CHECK(s == TSYS_OK && tsys_model_num_tensors(m) == 21, "load_into model (%d tensors): %s", tsys_model_num_tensors(m), tsys_ctx_last_error(ctx));
        const tsys_tensor *e = tsys_model_param(m, "token_embeddings.weight");
        TEST_CHECK(e && st_at(e, 0) == -1.12583983f, "token_embeddings.weight[0] = %.9g", e ? st_at(e, 0) : 0.0f);
        tsys_model_free(m);
    }
    tsys_ctx_free(ctx);
}

// tsys_model_load is strict, like PyTorch's load_state_dict(strict=True): a tensor in the file that
// the model lacks is refused by name, as is one the model has and the file lacks; nothing is written.
static tsys_model *st_small_model(tsys_ctx *ctx, uint64_t seed) {
    tsys_model_desc d;
    memset(&d, 0, sizeof d);
    d.vocab_size = 64; d.context_length = 8; d.d_model = 16; d.num_layers = 1; d.num_heads = 2; d.d_ff = 32;
    d = tsys_model_desc_defaults(&d);
    return tsys_model_new(ctx, &d, TSYS_CPU, seed);
}

static bool st_model_equal(tsys_model *a, tsys_model *b) {
    for (int i = 0; i < tsys_model_num_tensors(a); i++)
        if (!st_same(tsys_model_params(a)[i], tsys_model_params(b)[i])) return false;
    return true;
}

TSYS_TEST(safetensors_model_load_refuses_unexpected) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    // src holds the file's values; dst is loaded; ref stays as dst started (the same seed).
    tsys_model *src = st_small_model(ctx, 1), *dst = st_small_model(ctx, 2), *ref = st_small_model(ctx, 2);
    TEST_CHECK(src && dst && ref, "model: %s", tsys_ctx_last_error(ctx));
    if (!src || !dst || !ref) { tsys_model_free(src); tsys_model_free(dst); tsys_model_free(ref); tsys_ctx_free(ctx); return; }
    int np = tsys_model_num_tensors(src);
    tsys_tensor **all = (tsys_tensor **)malloc((size_t)(np + 1) * sizeof *all);
    memcpy(all, tsys_model_params(src), (size_t)np * sizeof *all);
    float v[3] = { 1, 2, 3 };
    const int64_t s3[1] = { 3 };
    all[np] = st_tensor(ctx, "layers.7.extra.bias", TSYS_F32, 1, s3, v);
    const char *path = st_path("model_extra.safetensors");
    TEST_CHECK(tsys_safetensors_save(ctx, path, all, np + 1) == TSYS_OK, "save: %s", tsys_ctx_last_error(ctx));

    st_expect_error(ctx, tsys_model_load(dst, path), TSYS_ERR_IO, "model_extra.safetensors", "'layers.7.extra.bias'", "not in the model", NULL);
    TEST_CHECK(st_model_equal(dst, ref), "a refused load changed the model's parameters");
    st_expect_error(ctx, tsys_model_load_ex(dst, path, NULL), TSYS_ERR_IO, "'layers.7.extra.bias'", "not in the model", NULL);
    const tsys_model_load_desc lenient = { .allow_unexpected = true };
    TEST_CHECK(tsys_model_load_ex(dst, path, &lenient) == TSYS_OK, "with allow_unexpected: %s", tsys_ctx_last_error(ctx));
    TEST_CHECK(st_model_equal(dst, src), "with allow_unexpected the parameters are not the file's");

    // A parameter the file lacks (the last one): refused by name, or left as it was with allow_missing.
    tsys_model_free(dst);
    dst = st_small_model(ctx, 2);
    const char *short_path = st_path("model_short.safetensors");
    TEST_CHECK(tsys_safetensors_save(ctx, short_path, all, np - 1) == TSYS_OK, "save: %s", tsys_ctx_last_error(ctx));
    char quoted[80];
    snprintf(quoted, sizeof quoted, "'%s'", all[np - 1]->name);
    st_expect_error(ctx, tsys_model_load(dst, short_path), TSYS_ERR_IO, "model_short.safetensors", quoted, "missing", NULL);
    TEST_CHECK(st_model_equal(dst, ref), "a refused load changed the model's parameters");
    const tsys_model_load_desc partial = { .allow_missing = true };
    TEST_CHECK(tsys_model_load_ex(dst, short_path, &partial) == TSYS_OK, "with allow_missing: %s", tsys_ctx_last_error(ctx));
    for (int i = 0; i < np; i++) {
        const tsys_tensor *want = i < np - 1 ? tsys_model_params(src)[i] : tsys_model_params(ref)[i];
        TEST_CHECK(st_same(tsys_model_params(dst)[i], want), "with allow_missing, '%s' is not %s", want->name, i < np - 1 ? "the file's" : "kept");
    }
    tsys_tensor_release(all[np]);
    free(all);
    tsys_model_free(src);
    tsys_model_free(dst);
    tsys_model_free(ref);
    tsys_ctx_free(ctx);
}

// tsys_model_save writes the dimensions into "__metadata__"; tsys_model_desc_from_file reads them
// back, and a model made from them loads the file.
TSYS_TEST(safetensors_model_desc_round_trip) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_model_desc d;
    memset(&d, 0, sizeof d);
    d.vocab_size = 61; d.context_length = 12; d.d_model = 24; d.num_layers = 2; d.num_heads = 3; d.d_ff = 40;
    d.rope_theta = 500000.0f; d.eps = 1e-6f;
    tsys_model *m = tsys_model_new(ctx, &d, TSYS_CPU, 5);
    const char *path = st_path("dims.safetensors");
    TEST_CHECK(m && tsys_model_save(m, path) == TSYS_OK, "save: %s", tsys_ctx_last_error(ctx));
    tsys_model_desc got;
    char err[512];
    memset(&got, 0xff, sizeof got);
    tsys_status s = tsys_model_desc_from_file(path, &got, err, sizeof err);
    TEST_CHECK(s == TSYS_OK, "from_file: %s", err);
    TEST_CHECK(got.vocab_size == 61 && got.context_length == 12 && got.d_model == 24 && got.num_layers == 2 && got.num_heads == 3 && got.d_ff == 40,
               "dims %d %d %d %d %d %d", got.vocab_size, got.context_length, got.d_model, got.num_layers, got.num_heads, got.d_ff);
    TEST_CHECK(got.rope_theta == 500000.0f && got.eps == 1e-6f, "rope_theta %.9g eps %.9g", (double)got.rope_theta, (double)got.eps);
    TEST_CHECK(got.attn == NULL && got.checkpoint == NULL, "attn and checkpoint are left to the defaults");
    tsys_model *back = s == TSYS_OK ? tsys_model_new(ctx, &got, TSYS_CPU, 9) : NULL;
    TEST_CHECK(back && tsys_model_load(back, path) == TSYS_OK, "load into the model from the file's dims: %s", tsys_ctx_last_error(ctx));
    TEST_CHECK(back && m && st_model_equal(back, m), "the loaded parameters differ");
    // the metadata is there for other readers too: "format" first, then the dims as strings
    char buf[200];
    FILE *f = fopen(path, "rb");
    size_t got_n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f) fclose(f);
    buf[got_n] = 0;
    TEST_CHECK(got_n > 8 && strstr(buf + 8, "{\"__metadata__\":{\"format\":\"pt\",\"vocab_size\":\"61\",\"context_length\":\"12\""), "header: %s", buf + 8);
    tsys_model_free(back);
    tsys_model_free(m);
    tsys_ctx_free(ctx);
}

// A file without the dimensions, or with a bad one, is refused naming the file and the key.
TSYS_TEST(safetensors_model_desc_from_file_errors) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_model *m = st_small_model(ctx, 1);
    const char *plain = st_path("nodims.safetensors");
    TEST_CHECK(m && tsys_safetensors_save(ctx, plain, tsys_model_params(m), tsys_model_num_tensors(m)) == TSYS_OK, "save: %s", tsys_ctx_last_error(ctx));
    tsys_model_desc d;
    char err[512];
    TEST_CHECK(tsys_model_desc_from_file(plain, &d, err, sizeof err) == TSYS_ERR_IO && strstr(err, "nodims.safetensors") && strstr(err, "\"vocab_size\"")
               && strstr(err, "tsys_model_save"), "no metadata: %s", err);
    // one key missing, the others there
    static const char *const keys[] = {"vocab_size", "context_length", "d_model", "d_ff", "num_layers", "num_heads", "rope_theta", "eps"};
    const char *vals[8] = {"64", "8", "16", "32", "1", "2", "10000", "1e-05"};
    const char *meta[16];
    for (int i = 0; i < 8; i++) { meta[2 * i] = keys[i]; meta[2 * i + 1] = vals[i]; }
    const char *p = st_path("lacks_heads.safetensors");
    TEST_CHECK(tsys_safetensors_save_ex(ctx, p, tsys_model_params(m), tsys_model_num_tensors(m), meta, 5) == TSYS_OK, "save: %s", tsys_ctx_last_error(ctx));
    TEST_CHECK(tsys_model_desc_from_file(p, &d, err, sizeof err) == TSYS_ERR_IO && strstr(err, "lacks_heads.safetensors") && strstr(err, "\"num_heads\""), "missing key: %s", err);
    // bad values: not a number, trailing junk, zero, negative, a float for an int, an overflow, a bad float
    static const struct { int key; const char *val; } bad[] = {
        {2, "abc"}, {2, "16x"}, {5, "0"}, {0, "-64"}, {4, "1.5"}, {0, "99999999999"}, {6, "nan"}, {7, "-1e-5"}, {3, ""},
    };
    for (size_t b = 0; b < sizeof bad / sizeof bad[0]; b++) {
        const char *v2[8];
        memcpy(v2, vals, sizeof v2);
        v2[bad[b].key] = bad[b].val;
        for (int i = 0; i < 8; i++) meta[2 * i + 1] = v2[i];
        p = st_path("bad_dim.safetensors");
        TEST_CHECK(tsys_safetensors_save_ex(ctx, p, tsys_model_params(m), tsys_model_num_tensors(m), meta, 8) == TSYS_OK, "save: %s", tsys_ctx_last_error(ctx));
        char key[40];
        snprintf(key, sizeof key, "\"%s\"", keys[bad[b].key]);
        tsys_status s = tsys_model_desc_from_file(p, &d, err, sizeof err);
        TEST_CHECK(s == TSYS_ERR_IO && strstr(err, "bad_dim.safetensors") && strstr(err, key), "%s = '%s': status %d, %s", keys[bad[b].key], bad[b].val, (int)s, err);
    }
    // dims that parse but make no model (d_model not a multiple of num_heads)
    for (int i = 0; i < 8; i++) meta[2 * i + 1] = vals[i];
    meta[2 * 5 + 1] = "3";
    p = st_path("no_model.safetensors");
    TEST_CHECK(tsys_safetensors_save_ex(ctx, p, tsys_model_params(m), tsys_model_num_tensors(m), meta, 8) == TSYS_OK, "save: %s", tsys_ctx_last_error(ctx));
    TEST_CHECK(tsys_model_desc_from_file(p, &d, err, sizeof err) == TSYS_ERR_IO && strstr(err, "no_model.safetensors"), "no model: %s", err);
    // a file that is not there, and non-string metadata values (skipped, as other readers do)
    TEST_CHECK(tsys_model_desc_from_file(st_path("absent.safetensors"), &d, err, sizeof err) == TSYS_ERR_IO && strstr(err, "absent.safetensors"), "absent: %s", err);
    const char *hdr = "{\"__metadata__\":{\"d_model\":16,\"format\":\"pt\"}}";
    p = st_path("numeric_meta.safetensors");
    st_write_file(p, hdr, NULL, 0);
    TEST_CHECK(tsys_model_desc_from_file(p, &d, err, sizeof err) == TSYS_ERR_IO && strstr(err, "lacks"), "numeric metadata: %s", err);
    // duplicate metadata keys are refused when saving
    meta[2] = keys[0];
    st_expect_error(ctx, tsys_safetensors_save_ex(ctx, st_path("dupmeta.safetensors"), tsys_model_params(m), 1, meta, 2), TSYS_ERR_INVALID_ARGS, "'vocab_size' given twice", NULL);
    tsys_model_free(m);
    tsys_ctx_free(ctx);
}

// State dicts of torch.compile'd ("_orig_mod.") and DDP/FSDP-wrapped ("module.") models load: the
// prefixes are dropped name by name, any number in any order; two names that collide are refused.
TSYS_TEST(safetensors_model_load_drops_wrapper_prefixes) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_model *src = st_small_model(ctx, 1), *dst = st_small_model(ctx, 2);
    TEST_CHECK(src && dst, "model: %s", tsys_ctx_last_error(ctx));
    if (!src || !dst) { tsys_model_free(src); tsys_model_free(dst); tsys_ctx_free(ctx); return; }
    static const char *const prefixes[] = {"", "_orig_mod.", "module.", "module._orig_mod.", "_orig_mod.module.module."};
    int np = tsys_model_num_tensors(src);
    tsys_tensor **renamed = (tsys_tensor **)malloc((size_t)(np + 1) * sizeof *renamed);
    for (int all = 0; all < 2; all++) {   // every name with one prefix, then a mix of all of them
        for (int pi = all ? 0 : 1; pi < (all ? 1 : 5); pi++) {
            for (int i = 0; i < np; i++) {
                const tsys_tensor *t = tsys_model_params(src)[i];
                renamed[i] = st_tensor(ctx, "", TSYS_F32, t->ndim, t->shape, tsys_tensor_data(t));
                tsys_tensor_set_name(renamed[i], "%s%s", prefixes[all ? i % 5 : pi], t->name);
            }
            const char *path = st_path("prefixed.safetensors");
            TEST_CHECK(tsys_safetensors_save(ctx, path, renamed, np) == TSYS_OK, "save: %s", tsys_ctx_last_error(ctx));
            tsys_model_free(dst);
            dst = st_small_model(ctx, 2);
            TEST_CHECK(tsys_model_load(dst, path) == TSYS_OK, "load with prefix '%s': %s", all ? "(mixed)" : prefixes[pi], tsys_ctx_last_error(ctx));
            tsys_ctx_clear_error(ctx);
            TEST_CHECK(st_model_equal(dst, src), "prefix '%s': the parameters are not the file's", all ? "(mixed)" : prefixes[pi]);
            for (int i = 0; i < np; i++) tsys_tensor_release(renamed[i]);
        }
    }
    // "module.ln_final.weight" and "ln_final.weight" both load as ln_final.weight
    for (int i = 0; i < np; i++) {
        const tsys_tensor *t = tsys_model_params(src)[i];
        renamed[i] = st_tensor(ctx, t->name, TSYS_F32, t->ndim, t->shape, tsys_tensor_data(t));
    }
    const tsys_tensor *fin = tsys_model_param(src, "ln_final.weight");
    renamed[np] = st_tensor(ctx, "module.ln_final.weight", TSYS_F32, fin->ndim, fin->shape, tsys_tensor_data(fin));
    const char *path = st_path("collide.safetensors");
    TEST_CHECK(tsys_safetensors_save(ctx, path, renamed, np + 1) == TSYS_OK, "save: %s", tsys_ctx_last_error(ctx));
    st_expect_error(ctx, tsys_model_load(dst, path), TSYS_ERR_IO, "collide.safetensors", "'ln_final.weight' and 'module.ln_final.weight' both load as 'ln_final.weight'", NULL);
    // load_into keeps exact names: prefixes are the model load's
    st_expect_error(ctx, tsys_safetensors_load_into(ctx, st_path("prefixed.safetensors"), tsys_model_params(dst) + 1, 1), TSYS_ERR_IO, "missing", NULL);
    for (int i = 0; i <= np; i++) tsys_tensor_release(renamed[i]);
    free(renamed);
    tsys_model_free(src);
    tsys_model_free(dst);
    tsys_ctx_free(ctx);
}

// The other whole-file writers go through the same tsys_atomic_file: a symlink at the final name is
// replaced, never written through (here the profiler's trace); an aborted file leaves nothing.
TSYS_TEST(safetensors_atomic_file_never_writes_through) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    const char *dir = st_subdir("atomic");
    char path[512], victim[512], buf[64];
    snprintf(path, sizeof path, "%s/trace.json", dir);
    snprintf(victim, sizeof victim, "%s/victim.txt", dir);
    st_write_text(victim, "precious");
    TEST_CHECK(symlink(victim, path) == 0, "symlink %s: %s", path, strerror(errno));
    tsys_profiler *p = tsys_profiler_begin(ctx);
    TEST_CHECK(p && tsys_profiler_end(p) == TSYS_OK, "profiler: %s", tsys_ctx_last_error(ctx));
    TEST_CHECK(p && tsys_profiler_write_trace(p, path) == TSYS_OK, "trace: %s", tsys_ctx_last_error(ctx));
    tsys_profiler_free(p);
    TEST_CHECK(strcmp(st_slurp(victim, buf, sizeof buf), "precious") == 0, "the trace was written through the symlink: '%s'", buf);
    TEST_CHECK(strncmp(st_slurp(path, buf, sizeof buf), "{\"displayTimeUnit\"", 18) == 0, "%s does not hold the trace: '%s'", path, buf);
    struct stat st;
    TEST_CHECK(lstat(path, &st) == 0 && S_ISREG(st.st_mode), "%s is still a symlink", path);

    snprintf(path, sizeof path, "%s/aborted.txt", dir);
    tsys_atomic_file af;
    TEST_CHECK(tsys_atomic_file_open(ctx, "test", path, &af) == TSYS_OK && af.f, "open: %s", tsys_ctx_last_error(ctx));
    if (af.f) fputs("half", af.f);
    tsys_atomic_file_abort(&af);
    TEST_CHECK(st_count_entries(dir, "aborted.txt") == 0, "an aborted file left %d entries", st_count_entries(dir, "aborted.txt"));
    snprintf(path, sizeof path, "%s/no/such/dir/x.txt", dir);
    st_expect_error(ctx, tsys_atomic_file_open(ctx, "test", path, &af), TSYS_ERR_IO, "test '", "/no/such/dir/x.txt'", "temporary", NULL);
    TEST_CHECK(af.f == NULL && af.path == NULL, "a failed open must leave an empty tsys_atomic_file");
    tsys_ctx_free(ctx);
}

// Removes the temp dir's files (names we made; the dir holds nothing else).
static void st_cleanup(void) {
    if (!st_dir[0]) return;
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", st_dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", st_dir);
}

int main(int argc, char **argv) {
    int rc = tsys_test_main(argc, argv);
    st_cleanup();
    return rc;
}
