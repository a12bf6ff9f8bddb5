// fuzz_safetensors.c - libFuzzer harness for the safetensors loader.
//
// Each input is a whole file (kept in a memfd, read through /proc/self/fd/N like any path). It goes
// through tsys_safetensors_load, then through tsys_safetensors_load_into into tensors named and
// shaped from a small fixed set, in F32, BF16 and F16, so that files the fuzzer makes (the seeds
// hold these names) reach the F32 <-> BF16/F16 conversion paths and the data reads. A file may load
// or fail; it must never crash, read out of bounds, leak, hang, or trip UBSan.
//
//   make fuzz                         (FUZZ_SECONDS=60 by default; the seeds: tests/fuzz/corpus/fuzz_safetensors)
//   build/fuzz/fuzz_safetensors -max_total_time=600 build/fuzz/corpus_fuzz_safetensors tests/fuzz/corpus/fuzz_safetensors
#define _GNU_SOURCE   // memfd_create
#define TSYS_IMPLEMENTATION
#include "../../tsys.h"

#include <stdio.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

// The targets of load_into: the names and shapes the seeds (tests/fuzz/make_seeds.c) use.
static const struct { const char *name; int ndim; int64_t shape[3]; } fz_targets[] = {
    { "a", 2, { 2, 3 } }, { "b", 1, { 4 } }, { "c", 3, { 2, 2, 2 } }, { "s", 0, { 0 } }, { "z", 1, { 0 } },
    { "layers.0.attn.q_proj.weight", 2, { 4, 4 } },
};
#define FZ_NT (int)(sizeof fz_targets / sizeof fz_targets[0])

static tsys_tensor *fz_tensor(tsys_ctx *ctx, int i, tsys_dtype dt) {
    tsys_tensor *t = tsys_tensor_new(ctx, dt, TSYS_CPU, fz_targets[i].ndim, fz_targets[i].shape);
    if (!t) return NULL;
    tsys_tensor_set_name(t, "%s", fz_targets[i].name);
    memset(tsys_tensor_data(t), 0xA5, tsys_tensor_bytes(t));   // poison: a short fill would show as garbage, not zeros
    return t;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static int fd = -1;
    static char path[64];
    if (fd < 0) {
        fd = memfd_create("fuzz.safetensors", 0);
        if (fd < 0) { perror("memfd_create"); abort(); }
        snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    }
    if (ftruncate(fd, 0) != 0 || (size && pwrite(fd, data, size, 0) != (ssize_t)size)) { perror("memfd write"); abort(); }

    tsys_ctx_desc cd;
    memset(&cd, 0, sizeof cd);
    cd.cpu_memory_limit = (size_t)64 << 20;   // tensors are bounded by the file anyway; this keeps it explicit
    tsys_ctx *ctx = tsys_ctx_new(&cd);
    if (!ctx) return 0;

    tsys_tensor **list = NULL;
    int n = 0;
    if (tsys_safetensors_load(ctx, path, TSYS_CPU, &list, &n) == TSYS_OK) tsys_tensor_list_free(list, n);
    else if (list || n) abort();   // a failed load returns nothing
    tsys_ctx_clear_error(ctx);

    static const tsys_dtype dts[3] = { TSYS_F32, TSYS_BF16, TSYS_F16 };
    for (int i = 0; i < FZ_NT; i++)
        for (int d = 0; d < 3; d++) {
            tsys_tensor *t = fz_tensor(ctx, i, dts[d]);
            if (t) tsys_safetensors_load_into(ctx, path, &t, 1);
            tsys_tensor_release(t);
            tsys_ctx_clear_error(ctx);
        }
    // two at once, in mixed dtypes: the all-or-nothing check before any write
    tsys_tensor *pair[2] = { fz_tensor(ctx, 0, TSYS_BF16), fz_tensor(ctx, 1, TSYS_F32) };
    if (pair[0] && pair[1]) tsys_safetensors_load_into(ctx, path, pair, 2);
    tsys_tensor_release(pair[0]);
    tsys_tensor_release(pair[1]);
    tsys_ctx_free(ctx);
    return 0;
}
