// make_seeds.c - writes the committed seed corpora of the fuzzers (make fuzz-seeds):
//   DIR/fuzz_safetensors/  valid files made by tsys_safetensors_save (the names and shapes that
//                          fuzz_safetensors.c loads into, in every dtype, so the conversions run),
//                          plus hand-written edge cases (metadata, escapes, UTF-8, zero sizes,
//                          truncation, garbage);
//   DIR/fuzz_flags/        real command lines of the drivers (from bench.sh and the README), plus
//                          bad ones, in fuzz_flags.c's format: a driver byte, then NUL-separated args.
//
//   cc -std=c11 -fopenmp -I. tests/fuzz/make_seeds.c -o /tmp/make_seeds -lopenblas -lm && /tmp/make_seeds tests/fuzz/corpus
#define TSYS_IMPLEMENTATION
#include "../../tsys.h"

#include <stdio.h>
#include <stdint.h>
#include <string.h>

static char dir[512];

static void put_file(const char *sub, const char *name, const void *data, size_t n) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s/%s", dir, sub, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, n, f) != n) { perror(path); exit(1); }
    fclose(f);
}

// ---- safetensors ------------------------------------------------------------------------------------

static tsys_tensor *mk(tsys_ctx *ctx, const char *name, tsys_dtype dt, int ndim, const int64_t *shape) {
    tsys_tensor *t = tsys_tensor_new(ctx, dt, TSYS_CPU, ndim, shape);
    if (!t) { fprintf(stderr, "%s\n", tsys_ctx_last_error(ctx)); exit(1); }
    tsys_tensor_set_name(t, "%s", name);
    // awkward values: signed zeros, infinities, NaN, subnormals, values that round in bf16/f16
    static const float v[] = { 1.0f, -0.0f, 65504.0f, 70000.0f, 1e-8f, -3.4e38f, 0.1f, 1.0f / 3.0f, 5.96e-8f, -2.5f };
    int64_t n = tsys_tensor_numel(t);
    for (int64_t i = 0; i < n; i++) {
        float f = i == 3 ? INFINITY : i == 5 ? NAN : v[i % 10];
        char *p = (char *)tsys_tensor_data(t);
        if (dt == TSYS_F32) memcpy(p + 4 * i, &f, 4);
        else if (dt == TSYS_BF16) { uint16_t h = tsys_f32_to_bf16(f); memcpy(p + 2 * i, &h, 2); }
        else if (dt == TSYS_F16) { uint16_t h = tsys_f32_to_f16(f); memcpy(p + 2 * i, &h, 2); }
        else if (dt == TSYS_I32) { int32_t x = (int32_t)(i * 7 - 3); memcpy(p + 4 * i, &x, 4); }
        else { int64_t x = i * 1000003 - 5; memcpy(p + 8 * i, &x, 8); }
    }
    return t;
}

static void save(tsys_ctx *ctx, const char *name, tsys_tensor **t, int n) {
    char path[1024];
    snprintf(path, sizeof path, "%s/fuzz_safetensors/%s", dir, name);
    if (tsys_safetensors_save(ctx, path, t, n) != TSYS_OK) { fprintf(stderr, "%s\n", tsys_ctx_last_error(ctx)); exit(1); }
    for (int i = 0; i < n; i++) tsys_tensor_release(t[i]);
}

// A raw file: the 8-byte length of hdr, hdr, then data.
static void raw(const char *name, const char *hdr, const void *data, size_t n) {
    size_t h = strlen(hdr);
    unsigned char *buf = (unsigned char *)malloc(8 + h + n);
    for (int i = 0; i < 8; i++) buf[i] = (unsigned char)((uint64_t)h >> (8 * i));
    memcpy(buf + 8, hdr, h);
    if (n) memcpy(buf + 8 + h, data, n);
    put_file("fuzz_safetensors", name, buf, 8 + h + n);
    free(buf);
}

static void safetensors_seeds(void) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    const int64_t s23[2] = { 2, 3 }, s4[1] = { 4 }, s222[3] = { 2, 2, 2 }, s44[2] = { 4, 4 }, s0[1] = { 0 }, s3[1] = { 3 }, s12[2] = { 1, 2 };
    static const tsys_dtype fl[3] = { TSYS_F32, TSYS_BF16, TSYS_F16 };
    static const char *fln[3] = { "f32", "bf16", "f16" };
    for (int d = 0; d < 3; d++) {   // a, b, c in one dtype each (load_into converts them to the other two)
        char name[64];
        snprintf(name, sizeof name, "abc_%s.safetensors", fln[d]);
        tsys_tensor *t[3] = { mk(ctx, "a", fl[d], 2, s23), mk(ctx, "b", fl[d], 1, s4), mk(ctx, "c", fl[d], 3, s222) };
        save(ctx, name, t, 3);
    }
    {   // mixed dtypes, ints too
        tsys_tensor *t[5] = { mk(ctx, "a", TSYS_F32, 2, s23), mk(ctx, "b", TSYS_BF16, 1, s4), mk(ctx, "c", TSYS_F16, 3, s222),
                              mk(ctx, "d", TSYS_I32, 1, s3), mk(ctx, "e", TSYS_I64, 2, s12) };
        save(ctx, "mixed_five.safetensors", t, 5);
    }
    {   // a scalar and a zero-size tensor
        tsys_tensor *t[3] = { mk(ctx, "s", TSYS_F32, 0, s0), mk(ctx, "z", TSYS_BF16, 1, s0), mk(ctx, "b", TSYS_F16, 1, s4) };
        save(ctx, "scalar_and_empty.safetensors", t, 3);
    }
    {   // a model-like name
        tsys_tensor *t[1] = { mk(ctx, "layers.0.attn.q_proj.weight", TSYS_F16, 2, s44) };
        save(ctx, "q_proj_f16.safetensors", t, 1);
    }
    save(ctx, "no_tensors.safetensors", NULL, 0);
    tsys_ctx_free(ctx);

    static const float x2[2] = { 1.5f, -2.0f };
    static const unsigned char b8[8] = { 0x80, 0x3f, 0x00, 0x80, 0x80, 0x7f, 0xc0, 0x7f };
    raw("hand_minimal.safetensors", "{\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", x2, 8);
    raw("hand_metadata.safetensors", "{\"__metadata__\":{\"format\":\"pt\",\"n\":[1,2.5e3,-0.0,true,false,null,{\"k\":\"\\u00e9\\ud83d\\ude00\"}]},"
        "\"b\":{\"dtype\":\"BF16\",\"shape\":[4],\"data_offsets\":[0,8],\"extra\":{}}}   ", b8, 8);
    raw("hand_escaped_name.safetensors", "{\"\\u0062\":{\"dtype\":\"F16\",\"shape\":[4],\"data_offsets\":[0,8]}}", b8, 8);
    raw("hand_utf8_name.safetensors", "{\"gewicht.\xc3\xa4\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", x2, 8);
    raw("hand_bad_utf8.safetensors", "{\"b\xc3\x28\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", x2, 8);
    raw("hand_overlap.safetensors", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", x2, 8);
    raw("hand_huge_shape.safetensors", "{\"a\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904,4],\"data_offsets\":[0,8]}}", x2, 8);
    raw("hand_zero_dim.safetensors", "{\"z\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]},\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", x2, 8);
    raw("hand_ws.safetensors", " \t\r\n{ \"b\" : { \"shape\" : [ 4 ] , \"dtype\" : \"F16\" , \"data_offsets\" : [ 0 , 8 ] } } ", b8, 8);
    raw("hand_truncated.safetensors", "{\"b\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", x2, 8);
    unsigned char tiny[11] = { 3, 0, 0, 0, 0, 0, 0, 0, '{', '}', ' ' };
    put_file("fuzz_safetensors", "hand_empty_object.safetensors", tiny, sizeof tiny);
    unsigned char lie[16] = { 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f, '{', '}' };
    put_file("fuzz_safetensors", "hand_length_lies.safetensors", lie, sizeof lie);
}

// ---- flags ---------------------------------------------------------------------------------------------

static int nflags;

// A NULL-terminated argv for driver d (0 e2e, 1 attn, 2 precision).
static void flags(int d, const char *const *argv) {
    char buf[2048];
    size_t n = 0;
    buf[n++] = (char)d;
    for (int i = 0; argv[i]; i++) {
        size_t k = strlen(argv[i]);
        if (i) buf[n++] = 0;
        memcpy(buf + n, argv[i], k);
        n += k;
    }
    char name[64];
    snprintf(name, sizeof name, "%s_%02d", d == 0 ? "e2e" : d == 1 ? "attn" : "precision", nflags++);
    put_file("fuzz_flags", name, buf, n);
}
#define FLAGS(d, ...) do { static const char *const a_[] = { __VA_ARGS__, NULL }; flags(d, a_); } while (0)

static void flag_seeds(void) {
    // e2e: bench.sh and the README
    FLAGS(0, "--device", "cpu", "--model", "small", "--context-length", "256", "--mode", "forward,forward-backward,train", "--compile", "no",
             "--dtype", "fp32,bf16", "--warmup", "5", "--steps", "10", "--format", "md", "--oom-ok");
    FLAGS(0, "--device", "cpu", "--model", "small", "--context-length", "256", "--mode", "forward-backward", "--warmup", "0", "--steps", "10",
             "--format", "csv", "--no-sgemm");
    FLAGS(0, "--model", "custom", "--d-model", "16", "--num-layers", "1", "--num-heads", "2", "--d-ff", "32", "--vocab-size", "64",
             "--batch-size", "1", "--context-length", "8,2048", "--mem-limit", "0.01", "--attn", "naive,flash,auto", "--seed", "3");
    FLAGS(0, "--model", "small,medium,large,xl,2.7B", "--context-length", "128,256,512,1024", "--compile", "no,yes", "--tf32", "--format", "jsonl",
             "--load", "weights.safetensors", "--mem-limit", "1e-3");
    FLAGS(0, "--help");
    FLAGS(0, "--bogus", "--model");
    FLAGS(0, "--context-length", "", "--model", "x,,y", "--mem-limit", "inf");
    FLAGS(0, "--device", "cuda", "--dtype", "fp16", "--mode", "train", "--compile", "yes");
    // attn
    FLAGS(1, "--device", "cpu", "--sweep", "pytorch_attention", "--batch", "2", "--seq", "256,1024", "--d", "16,64", "--warmup", "1", "--reps", "3",
             "--format", "md", "--oom-ok");
    FLAGS(1, "--sweep", "flash_benchmarking", "--seq", "128,256,512,1024", "--d", "16,64", "--dtype", "fp32", "--warmup", "1", "--reps", "3");
    FLAGS(1, "--sweep", "leaderboard", "--seq", "512", "--dtype", "fp32", "--warmup", "1", "--reps", "3", "--grad", "sum");
    FLAGS(1, "--impl", "flash", "--heads", "16", "--seq", "4096", "--d", "64,128", "--dtype", "bf16", "--causal", "1", "--format", "csv",
             "--mem-limit", "2.5", "--tf32", "--seed", "7");
    FLAGS(1, "--mem-limit", "nan", "--causal", "0,2", "--sweep", "nope");
    // precision
    FLAGS(2, "--mem-limit", "0.5");
    FLAGS(2, "--help");
    FLAGS(2, "--mem-limit");
}

int main(int argc, char **argv) {
    if (argc != 2) { fprintf(stderr, "usage: make_seeds DIR   (writes DIR/fuzz_safetensors/*, DIR/fuzz_flags/*)\n"); return 2; }
    snprintf(dir, sizeof dir, "%s", argv[1]);
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "mkdir -p '%s/fuzz_safetensors' '%s/fuzz_flags'", dir, dir);
    if (system(cmd) != 0) return 1;
    safetensors_seeds();
    flag_seeds();
    return 0;
}
