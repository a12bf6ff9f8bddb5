// harness.h - the one test harness of tsys: tests register themselves, main runs them all (or those
// whose name contains argv[1]) and prints "N passed, N failed" as its last line.
//
//   TSYS_TEST(rmsnorm_grad) { ... TEST_CHECK(err < 1e-4, "err %g", err); ... }
//   int main(int argc, char **argv) { return tsys_test_main(argc, argv); }
#ifndef TSYS_TEST_HARNESS_H
#define TSYS_TEST_HARNESS_H
#include <stdio.h>
#include <string.h>
#include <math.h>

typedef void (*tsys_test_fn)(void);
typedef struct { const char *name; tsys_test_fn fn; } tsys_test_case;

#define TSYS_TEST_MAX 512
static tsys_test_case tsys__tests[TSYS_TEST_MAX];
static int tsys__ntests;
static int tsys__test_failed;   // failures in the running test

static void tsys__test_register(const char *name, tsys_test_fn fn) {
    if (tsys__ntests < TSYS_TEST_MAX) { tsys__tests[tsys__ntests].name = name; tsys__tests[tsys__ntests].fn = fn; tsys__ntests++; }
}

// Registration runs before main: a constructor in C, a static initializer in C++.
#ifdef __cplusplus
#define TSYS_TEST(name) \
    static void tsys_test_##name(void); \
    static struct tsys__reg_##name { tsys__reg_##name() { tsys__test_register(#name, tsys_test_##name); } } tsys__reg_inst_##name; \
    static void tsys_test_##name(void)
#else
#define TSYS_TEST(name) \
    static void tsys_test_##name(void); \
    __attribute__((constructor)) static void tsys__reg_##name(void) { tsys__test_register(#name, tsys_test_##name); } \
    static void tsys_test_##name(void)
#endif

// A failed check prints where and why, and marks the running test failed; the test goes on.
#define TEST_CHECK(cond, ...) do { if (!(cond)) { \
    printf("    FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); printf(__VA_ARGS__); printf("\n"); \
    tsys__test_failed++; } } while (0)

// Relative error ||a - b|| / max(||b||, tiny) over n floats.
static inline double tsys_test_rel_err(const float *a, const float *b, long n) {
    double num = 0, den = 0;
    for (long i = 0; i < n; i++) {
        double d = (double)a[i] - (double)b[i];
        if (a[i] != a[i]) return INFINITY;   // NaN never passes
        num += d * d; den += (double)b[i] * b[i];
    }
    return sqrt(num) / (den > 1e-30 ? sqrt(den) : 1e-15);
}

// Largest |a - b| / (atol + rtol |b|) over n floats; <= 1 means "close" in torch.allclose's sense.
static inline double tsys_test_close_ratio(const float *a, const float *b, long n, double rtol, double atol) {
    double worst = 0;
    for (long i = 0; i < n; i++) {
        if (a[i] != a[i] || b[i] != b[i]) return INFINITY;
        double r = fabs((double)a[i] - b[i]) / (atol + rtol * fabs((double)b[i]));
        if (r > worst) worst = r;
    }
    return worst;
}

static int tsys_test_main(int argc, char **argv) {
    const char *filter = argc > 1 ? argv[1] : NULL;
    int passed = 0, failed = 0;
    for (int i = 0; i < tsys__ntests; i++) {
        if (filter && !strstr(tsys__tests[i].name, filter)) continue;
        tsys__test_failed = 0;
        printf("  %-44s ", tsys__tests[i].name); fflush(stdout);
        tsys__tests[i].fn();
        if (tsys__test_failed) { printf("  -> FAILED\n"); failed++; }
        else { printf("ok\n"); passed++; }
        fflush(stdout);
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
#endif
