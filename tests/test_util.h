// test_util.h - small helpers shared by the C tests (after tsys.h).
#ifndef TSYS_TEST_UTIL_H
#define TSYS_TEST_UTIL_H
#include <stdlib.h>

// A tensor's elements as a malloc'd fp32 array (any dtype, any device).
static float *test_read(tsys_ctx *ctx, const tsys_tensor *t) {
    int64_t n = tsys_tensor_numel(t);
    float *v = (float *)malloc(sizeof(float) * (size_t)(n ? n : 1));
    if (v && tsys_tensor_to_f32(ctx, t, v) != TSYS_OK) { free(v); return NULL; }
    return v;
}
#endif
