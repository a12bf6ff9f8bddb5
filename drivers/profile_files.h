// profile_files.h - what a driver's --profile DIR writes for one profiled step: DIR/<name>.md (the
// step's phases, the op and kernel tables) and DIR/<name>.json (the Chrome trace, for Perfetto), each
// replaced whole (tsys_atomic_file), never half written; after the table the driver lists every
// profiled step's files. Included by e2e and ddp after driver_util.h.
#ifndef TSYS_PROFILE_FILES_H
#define TSYS_PROFILE_FILES_H
#include <sys/stat.h>

// --profile DIR before the sweep: the folder (made when missing) and *log, a temporary file that
// collects the paths of the files each configuration writes until the table is done. False after a
// message naming the flag.
static inline bool du_profile_open(const char *prog, const char *dir, FILE **log) {
    if (mkdir(dir, 0777) != 0 && errno != EEXIST) { fprintf(stderr, "%s: --profile: cannot make folder '%s': %s\n", prog, dir, strerror(errno)); return false; }
    if (!(*log = tmpfile())) { fprintf(stderr, "%s: --profile: no temporary file: %s\n", prog, strerror(errno)); return false; }
    return true;
}

// After the table: the paths log collected, to out (after a blank line); false, after a message, when
// they could not all be written or read back.
static inline bool du_profile_list(const char *prog, FILE *log, FILE *out) {
    char line[1400];
    rewind(log);
    fprintf(out, "\n");
    while (fgets(line, sizeof(line), log)) fputs(line, out);
    if (!ferror(log)) return true;
    fprintf(stderr, "%s: --profile: the list of profiled files could not be written or read back\n", prog);
    return false;
}

// DIR/<name>.json and DIR/<name>.md of one profiled step (p ended; t: its forward, backward, optimizer
// ms); their paths go to log as one line, "profile of <name>: <md>, <json>".
static inline tsys_status du_profile_write(tsys_ctx *ctx, const tsys_profiler *p, const char *dir, const char *name, const double *t, FILE *log) {
    char path[1200];
    snprintf(path, sizeof(path), "%s/%s.json", dir, name);
    if (tsys_profiler_write_trace(p, path) != TSYS_OK) {
        char why[600];
        snprintf(why, sizeof(why), "%s", tsys_ctx_last_error(ctx));
        tsys_ctx_clear_error(ctx);
        return tsys_ctx_set_error(ctx, TSYS_ERR_IO, "--profile: write to '%s' failed (%s)", path, why);
    }
    snprintf(path, sizeof(path), "%s/%s.md", dir, name);
    tsys_atomic_file af;
    tsys_status st = tsys_atomic_file_open(ctx, "--profile", path, &af);
    if (st != TSYS_OK) return st;
    fprintf(af.f, "### %s\n\nprofiled step: %.2f ms (forward %.2f, backward %.2f, optimizer %.2f); kernel time by phase: forward %.2f, backward %.2f, "
            "optimizer %.2f ms\n\n", name, t[0] + t[1] + t[2], t[0], t[1], t[2], tsys_profiler_kernel_ms(p, "forward"), tsys_profiler_kernel_ms(p, "backward"),
            tsys_profiler_kernel_ms(p, "optimizer"));
    tsys_profiler_print_ops(p, af.f, 40);
    fprintf(af.f, "\n");
    tsys_profiler_print_kernels(p, af.f, 40);
    fprintf(af.f, "\n");
    if ((st = tsys_atomic_file_commit(ctx, &af)) != TSYS_OK) return st;
    fprintf(log, "profile of %s: %s/%s.md, %s/%s.json\n", name, dir, name, dir, name);
    return TSYS_OK;
}
#endif
