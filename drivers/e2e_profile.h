// e2e_profile.h - what e2e --profile DIR writes for one profiled step: profile_files.h's
// DIR/<config>.md and DIR/<config>.json under the configuration's name, and a line in
// DIR/summary.csv (replaced whole: tsys_atomic_file). Included by e2e after driver_util.h.
#ifndef TSYS_E2E_PROFILE_H
#define TSYS_E2E_PROFILE_H
#include <ctype.h>
#include "profile_files.h"

// The configuration of a row as a file name: "cpu_small_T128_train_fp32_naive", then "_compiled",
// "_opt-in-bwd[-free]", "_lowp-copies", "_lowp-grads" and "_ckpt-<policy>" (a file name's characters) where they
// apply: every list of the sweep, so no two configurations share a name (--save-dir's directories).
static inline void e2e_profile_name(char *name, size_t len, const du_row *row) {
    char ckpt[64] = "";
    const char *in_bwd = du_row_get(row, "opt_in_bwd");
    if (strcmp(du_row_get(row, "ckpt"), "none")) {
        snprintf(ckpt, sizeof(ckpt), "_ckpt-%s", du_row_get(row, "ckpt"));
        for (char *c = ckpt + 6; *c; c++) if (!isalnum((unsigned char)*c)) *c = '-';
    }
    snprintf(name, len, "%s_%s_T%s_%s_%s_%s%s%s%s%s%s", du_row_get(row, "device"), du_row_get(row, "model"), du_row_get(row, "context"),
             du_row_get(row, "mode"), du_row_get(row, "dtype"), du_row_get(row, "attn"), strcmp(du_row_get(row, "compiled"), "yes") ? "" : "_compiled",
             !strcmp(in_bwd, "yes") ? "_opt-in-bwd" : !strcmp(in_bwd, "free") ? "_opt-in-bwd-free" : "",
             strcmp(du_row_get(row, "lowp_copies"), "yes") ? "" : "_lowp-copies", strcmp(du_row_get(row, "lowp_grads"), "yes") ? "" : "_lowp-grads", ckpt);
}

// One line per profiled configuration in DIR/summary.csv (the header when the file is new), the
// numbers the report's nsys_profile questions ask for: the kernel that takes the most time in forward
// and in the whole step, the matmuls' share, the largest non-matmul kernel, and attention's softmax
// against its two matmuls (naive attention's regions). t: the step's forward, backward, optimizer ms.
static inline tsys_status e2e_profile_summary(tsys_ctx *ctx, const tsys_profiler *p, const char *dir, const char *config, const double *t) {
    char path[600];
    snprintf(path, sizeof(path), "%s/summary.csv", dir);
    tsys_atomic_file af;   // the lines so far and this one, put in place whole
    tsys_status st = tsys_atomic_file_open(ctx, "--profile", path, &af);
    if (st != TSYS_OK) return st;
    FILE *f = af.f, *old = fopen(path, "r");
    if (old) {   // the lines of earlier runs first
        char buf[8192];
        size_t n;
        while ((n = fread(buf, 1, sizeof(buf), old)) > 0) fwrite(buf, 1, n, f);
        bool bad = ferror(old) != 0;
        fclose(old);
        if (bad) { tsys_atomic_file_abort(&af); return tsys_ctx_set_error(ctx, TSYS_ERR_IO, "--profile: cannot read '%s' to add a line", path); }
    }
    if (ftell(f) == 0)
        fprintf(f, "config,step_ms,fwd_ms,bwd_ms,opt_ms,kernel_ms,fwd_kernel_ms,fwd_top_kernel,fwd_top_ms,fwd_top_calls,step_top_kernel,step_top_ms,"
                   "step_top_calls,fwd_matmul_pct,step_matmul_pct,fwd_top_other,fwd_top_other_ms,softmax_ms,attn_matmul_ms\n");
    double all = tsys_profiler_kernel_ms(p, NULL), fwd = tsys_profiler_kernel_ms(p, "forward"), fwd_top = 0, step_top = 0, other = 0;
    int fwd_calls = 0, step_calls = 0;
    const char *fk = tsys_profiler_top_kernel(p, "forward", -1, &fwd_top, &fwd_calls), *sk = tsys_profiler_top_kernel(p, NULL, -1, &step_top, &step_calls);
    const char *ok = tsys_profiler_top_kernel(p, "forward", 0, &other, NULL);
    fprintf(f, "%s,%.3f,%.3f,%.3f,%.3f,%.3f,%.3f,%s,%.3f,%d,%s,%.3f,%d,%.1f,%.1f,%s,%.3f,%.3f,%.3f\n", config, t[0] + t[1] + t[2], t[0], t[1], t[2], all, fwd,
            fk ? fk : "-", fwd_top, fwd_calls, sk ? sk : "-", step_top, step_calls, fwd > 0 ? 100.0 * tsys_profiler_matmul_ms(p, "forward") / fwd : 0.0,
            all > 0 ? 100.0 * tsys_profiler_matmul_ms(p, NULL) / all : 0.0, ok ? ok : "-", other, tsys_profiler_span_ms(p, "computing softmax"),
            tsys_profiler_span_ms(p, "computing attention scores") + tsys_profiler_span_ms(p, "final matmul"));
    return tsys_atomic_file_commit(ctx, &af);   // a failed write of the copy or the line fails here
}

// The files of one profiled step (p ended; t: its forward, backward, optimizer ms) of the row's
// configuration (du_profile_write's), and its line in DIR/summary.csv.
static inline tsys_status e2e_profile_write(tsys_ctx *ctx, const tsys_profiler *p, const char *dir, const du_row *row, const double *t, FILE *log) {
    char name[512];
    e2e_profile_name(name, sizeof(name), row);
    tsys_status st = du_profile_write(ctx, p, dir, name, t, log);
    return st == TSYS_OK ? e2e_profile_summary(ctx, p, dir, name, t) : st;
}

// One more step of t under the profiler (it has taken its timed steps); its files go under dir as
// e2e_profile_write says.
static inline tsys_status e2e_profile_step(du_timed *t, const char *dir, const du_row *row, FILE *log) {
    tsys_profiler *p = tsys_profiler_begin(t->lm.ctx);
    double ms[3] = {0, 0, 0};
    tsys_status st = p ? du_timed_step(t, ms) : tsys_ctx_status(t->lm.ctx);
    if (p && tsys_profiler_end(p) != TSYS_OK && st == TSYS_OK) st = tsys_ctx_status(t->lm.ctx);
    if (st == TSYS_OK) st = e2e_profile_write(t->lm.ctx, p, dir, row, ms, log);
    tsys_profiler_free(p);
    return st;
}
#endif
