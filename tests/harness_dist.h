// harness_dist.h - harness.h for programs that run as several ranks (tsys_dist.h): every rank runs
// every test; a test fails when it fails on any rank; only rank 0 prints the test names and the
// last line, "N passed, N failed" (other ranks print only their own FAIL lines).
//
//   #include "harness.h"
//   #include "harness_dist.h"
//   int main(int argc, char **argv) { ...; tsys_dist *d = tsys_dist_init(ctx, NULL); return tsys_test_main_dist(argc, argv, d); }
#ifndef TSYS_TEST_HARNESS_DIST_H
#define TSYS_TEST_HARNESS_DIST_H
#include "harness.h"

static inline void tsys__test_main_unused(void) { (void)tsys_test_main; }   // harness.h's runner is replaced here

// filter: run only the tests whose name contains it (NULL: all). The group aggregates the results;
// if it breaks (a rank died), the remaining tests are not run and count as failed.
static int tsys_test_main_dist(const char *filter, tsys_dist *d) {
    int rank = tsys_dist_rank(d), size = tsys_dist_size(d);
    int passed = 0, failed = 0;
    double *fails = (double *)calloc((size_t)size, sizeof(double));
    for (int i = 0; i < tsys__ntests; i++) {
        if (filter && !strstr(tsys__tests[i].name, filter)) continue;
        tsys__test_failed = 0;
        if (rank == 0) { printf("  %-44s ", tsys__tests[i].name); fflush(stdout); }
        tsys__tests[i].fn();
        fflush(stdout);
        for (int r = 0; r < size; r++) fails[r] = r == rank ? tsys__test_failed : 0;
        if (tsys_dist_all_reduce_host(d, fails, size, TSYS_DIST_SUM) != TSYS_OK) {
            fprintf(stderr, "rank %d: %s: %s\n", rank, tsys__tests[i].name, tsys_ctx_last_error(tsys_dist_ctx(d)));
            if (rank == 0) printf("  -> FAILED (the group broke)\n");
            failed += 1;
            for (int j = i + 1; j < tsys__ntests; j++) if (!filter || strstr(tsys__tests[j].name, filter)) failed++;
            break;
        }
        int bad = 0;
        for (int r = 0; r < size; r++) bad += fails[r] > 0;
        if (bad) {
            failed++;
            if (rank == 0) {
                printf("  -> FAILED on rank");
                for (int r = 0; r < size; r++) if (fails[r] > 0) printf(" %d", r);
                printf("\n");
            }
        } else {
            passed++;
            if (rank == 0) printf("ok\n");
        }
        if (rank == 0) fflush(stdout);
    }
    free(fails);
    if (rank == 0) { printf("%d passed, %d failed\n", passed, failed); fflush(stdout); }
    return failed ? 1 : 0;
}
#endif
