// allreduce - the CS336 distributed_communication_single_node benchmark: all-reduce (and
// reduce-scatter, all-gather) of float32 tensors of several sizes across ranks, timed after warmup.
//
//   allreduce --nproc 2 --sizes 1MB,10MB,100MB,1GB                   CPU ranks (the role of Gloo)
//   mpirun -np 4 allreduce --sizes 1MB,1GB --op all_reduce,all_gather
//   allreduce_cuda --backend nccl --nproc 2                          one GPU per rank
//
// One row per (op, dtype, size): min/mean/max time over iterations and ranks (gathered on rank 0),
// and algbw/busbw in the nccl-tests convention, from the mean over iterations of the slowest rank:
// algbw = bytes / time; busbw = algbw x 2(n-1)/n for all-reduce, x (n-1)/n for reduce-scatter and
// all-gather (bytes = the whole buffer: the all-reduced tensor, the reduce-scatter input, the
// all-gather output). Sizes: B, KB, MB, GB are powers of 1024 (1MB = 2^20 bytes, as in the CS336
// scripts and the torch baseline); a plain number is bytes. Only rank 0 prints. Buffers that do not
// fit the memory budget (--mem-limit, else the host's available memory shared by its ranks) are an
// OOM row.
#ifndef _GNU_SOURCE
#define _GNU_SOURCE   // tsys_dist.h pins ranks to cores (sched_setaffinity), also in builds without the Makefile's flags
#endif
#define TSYS_PRELUDE_DIST
#include "prelude.h"
#include "driver_util.h"

typedef struct ar_opts {
    const char *backend, *shm, *buffers;
    du_list sizes, ops, dtypes;
    int nproc, warmup, iters, timeout;   // timeout 0: TSYS_DIST_TIMEOUT, else the library's 300 s
    bool no_check;
    du_common common;
} ar_opts;

// "1MB" -> 1048576; false on anything else
static bool parse_size(const char *s, int64_t *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || v < 0) return false;
    double mul = 1;
    if (!strcmp(end, "") || !strcmp(end, "B")) mul = 1;
    else if (!strcmp(end, "KB") || !strcmp(end, "KiB") || !strcmp(end, "K")) mul = 1024.0;
    else if (!strcmp(end, "MB") || !strcmp(end, "MiB") || !strcmp(end, "M")) mul = 1048576.0;
    else if (!strcmp(end, "GB") || !strcmp(end, "GiB") || !strcmp(end, "G")) mul = 1073741824.0;
    else return false;
    double b = v * mul;
    if (b > 1e15 || b != floor(b)) return false;
    *out = (int64_t)b;
    return true;
}
static bool size_ok(const char *s) { int64_t b; return parse_size(s, &b) && b > 0; }

enum { OP_AR, OP_RS, OP_AG };
static const char *const op_names[3] = { "all_reduce", "reduce_scatter", "all_gather" };
// (the flag table checked the name)
static int parse_op(const char *s) { return !strcmp(s, "reduce_scatter") ? OP_RS : !strcmp(s, "all_gather") ? OP_AG : OP_AR; }

static void die(tsys_dist *d, const char *what) {
    fprintf(stderr, "allreduce: rank %d: %s: %s\n", tsys_dist_rank(d), what, tsys_ctx_last_error(tsys_dist_ctx(d)));
    exit(1);   // ends the job (under mpirun the others are stopped; under --nproc the launcher stops them)
}

// A buffer of n elements: NCCL symmetric-window memory with --buffers window, else tsys_tensor_new's.
static tsys_tensor *buffer(tsys_dist *d, const ar_opts *o, tsys_dtype dt, tsys_device dev, int64_t n) {
    int64_t shape[1] = { n };
    return !strcmp(o->buffers, "window") ? tsys_dist_tensor_new(d, dt, dev, 1, shape) : tsys_tensor_new(tsys_dist_ctx(d), dt, dev, 1, shape);
}

static void row_names(du_row *row, int op, tsys_dtype dt, const char *label, int64_t bytes, int n) {
    du_row_set(row, "op", "%s", op_names[op]);
    du_row_set(row, "dtype", "%s", du_dtype_flag(dt));
    du_row_set(row, "size", "%s", label);
    du_row_set(row, "bytes", "%lld", (long long)bytes);
    du_row_set(row, "ranks", "%d", n);
}

// One (op, dtype, size): returns false when the first iteration's result was wrong or the buffers
// did not fit (an OOM row on every rank: they agree before any collective) and --oom-ok is not given.
static bool run_one(tsys_dist *d, tsys_device dev, const ar_opts *o, int op, tsys_dtype dt, const char *label, int64_t bytes, du_table *tab) {
    tsys_ctx *ctx = tsys_dist_ctx(d);
    int n = tsys_dist_size(d), rank = tsys_dist_rank(d);
    int64_t es = (int64_t)tsys_dtype_size(dt);
    int64_t count = bytes / es;
    if (op != OP_AR) count = count / n * n;   // the whole buffer splits into n blocks
    if (count < (op == OP_AR ? 1 : n)) count = op == OP_AR ? 1 : n;
    tsys_tensor *a = buffer(d, o, dt, dev, op == OP_AG ? count / n : count);   // AR: the tensor; RS: in; AG: in
    tsys_tensor *b = a && op != OP_AR ? buffer(d, o, dt, dev, op == OP_RS ? count / n : count) : NULL;
    double bad = (!a || (op != OP_AR && !b)) ? (tsys_ctx_status(ctx) == TSYS_ERR_OOM ? 2 : 1) : 0;
    if (tsys_dist_all_reduce_host(d, &bad, 1, TSYS_DIST_MAX) != TSYS_OK) die(d, "agreeing on the buffers");
    if (bad) {   // out of memory here or on another rank: a row that says so, and on to the next size
        du_row *row = du_table_row(tab);
        row_names(row, op, dt, label, count * es, n);
        const char *why = tsys_ctx_status(ctx) != TSYS_OK ? tsys_ctx_last_error(ctx) : "on another rank";
        du_row_set(row, "status", "%s: allocating the buffers: %s", bad == 2 ? "OOM" : "error", why);
        tsys_tensor_release(a); tsys_tensor_release(b);
        tsys_ctx_clear_error(ctx);
        return bad == 2 && o->common.oom_ok;
    }
    // GPUs: the ranks are lined up on the devices before each timed call, as torch's NCCL barrier does (a
    // one-element all-reduce, waited for): the host barrier alone releases ranks tens of microseconds
    // apart, and the early one would time the wait for its peer inside the collective
    int64_t one[1] = { 1 };
    tsys_tensor *tick = dev != TSYS_CPU ? tsys_tensor_new(ctx, TSYS_F32, dev, 1, one) : NULL;
    if (dev != TSYS_CPU && (!tick || tsys_tensor_fill(ctx, tick, 0.0f) != TSYS_OK)) die(d, "allocating the device barrier");
    bool ok = true;
    double *t = (double *)calloc((size_t)o->iters, sizeof(double));
    if (!t) { fprintf(stderr, "allreduce: rank %d: out of memory for %d times\n", rank, o->iters); exit(1); }
    const int steps = o->warmup + o->iters;
    for (int it = 0; it < steps; it++) {
        bool check = !o->no_check && it == 0;
        if (check) tsys_tensor_fill(ctx, a, (float)(rank + 1));
        if (tsys_dist_barrier(d) != TSYS_OK) die(d, "barrier");
        if (tick && (tsys_dist_all_reduce(d, tick, TSYS_DIST_SUM) != TSYS_OK || tsys_sync(ctx, dev) != TSYS_OK)) die(d, "device barrier");
        double t0 = tsys_time_us();
        tsys_status st = op == OP_AR ? tsys_dist_all_reduce(d, a, TSYS_DIST_SUM)
                       : op == OP_RS ? tsys_dist_reduce_scatter(d, b, a, TSYS_DIST_SUM) : tsys_dist_all_gather(d, b, a);
        if (st == TSYS_OK && dev != TSYS_CPU) st = tsys_sync(ctx, dev);
        double us = tsys_time_us() - t0;
        if (st != TSYS_OK) die(d, op_names[op]);
        if (it >= o->warmup) t[it - o->warmup] = us * 1e-3;
        if (check) {   // a few elements of the result against what they must be
            tsys_tensor *res = op == OP_AR ? a : b;
            int64_t rn = tsys_tensor_numel(res);
            float *h = (float *)malloc(sizeof(float) * (size_t)rn);
            if (!h || tsys_tensor_to_f32(ctx, res, h) != TSYS_OK) die(d, "reading the result back to check it (--no-check skips it)");
            int64_t idx[4] = { 0, rn / 3, rn / 2, rn - 1 };
            for (int k = 0; k < 4; k++) {
                double want = op == OP_AG ? (double)(idx[k] / (rn / n) + 1) : n * (n + 1) / 2.0;
                if (h[idx[k]] != want) ok = false;
            }
            free(h);
        }
        du_progress_step(it < o->warmup ? "warmup" : "timed", it + 1, steps);
    }
    // min / mean / max over iterations and ranks; the slowest rank per iteration for the bandwidth
    double lo = 1e300, hi = 0, sum = 0;
    for (int i = 0; i < o->iters; i++) { lo = t[i] < lo ? t[i] : lo; hi = t[i] > hi ? t[i] : hi; sum += t[i]; }
    double agg[3] = { -lo, hi, sum };
    double okv = ok ? 0 : 1;
    if (tsys_dist_all_reduce_host(d, agg, 2, TSYS_DIST_MAX) != TSYS_OK || tsys_dist_all_reduce_host(d, agg + 2, 1, TSYS_DIST_SUM) != TSYS_OK ||
        tsys_dist_all_reduce_host(d, t, o->iters, TSYS_DIST_MAX) != TSYS_OK || tsys_dist_all_reduce_host(d, &okv, 1, TSYS_DIST_MAX) != TSYS_OK)
        die(d, "gathering the times");
    double slow = 0;
    for (int i = 0; i < o->iters; i++) slow += t[i];
    slow /= o->iters;
    int64_t buf_bytes = count * es;
    double algbw = buf_bytes / (slow * 1e-3) / 1e9;
    double factor = op == OP_AR ? 2.0 * (n - 1) / n : (double)(n - 1) / n;
    du_row *row = du_table_row(tab);
    row_names(row, op, dt, label, buf_bytes, n);
    du_row_set(row, "min_ms", "%.4f", -agg[0]);
    du_row_set(row, "mean_ms", "%.4f", agg[2] / ((double)o->iters * n));
    du_row_set(row, "max_ms", "%.4f", agg[1]);
    du_row_set(row, "time_ms", "%.4f", slow);
    if (slow > 0) {   // a call faster than the clock's tick has no bandwidth to report (NA, not inf)
        du_row_set(row, "algbw_GB/s", "%.3f", algbw);
        du_row_set(row, "busbw_GB/s", "%.3f", algbw * factor);
    }
    du_row_set(row, "check", "%s", o->no_check ? "skipped" : okv == 0 ? "ok" : "WRONG");
    du_row_set(row, "status", "%s", okv == 0 ? "ok" : "error: a wrong result (check)");
    free(t);
    tsys_tensor_release(a);
    tsys_tensor_release(tick);
    tsys_tensor_release(b);
    return okv == 0;
}

// The configuration line of rank 0: the group, its data path, the host, the budgets.
static void preamble(FILE *f, tsys_dist *d, const ar_opts *o, tsys_device dev, size_t cpu_budget) {
    char path[200], lim[160];
    int n = tsys_dist_size(d), local = tsys_dist_local_size(d);
    size_t mem = o->common.mem_limit;
    // the host data path (tsys_dist internals: this driver includes the implementation)
    if (dev == TSYS_CUDA) {
        int v = 0;
#ifdef TSYS_DIST_NCCL
        if (ncclGetVersion(&v) != ncclSuccess) v = 0;
#endif
        snprintf(path, sizeof path, "CUDA tensors through NCCL %d.%d.%d, %s buffers", v / 10000, v / 100 % 100, v % 100,
                 !strcmp(o->buffers, "window") ? "symmetric-window" : "plain");
    }
    else if (n == 1) snprintf(path, sizeof path, "a group of one: nothing moves");
    else if (d->shm_base) snprintf(path, sizeof path, "shared memory (2 x %zu KiB slots per rank)", d->slice >> 10);
    else snprintf(path, sizeof path, "%s (%s)", tsys_dist_engine_name(tsys_dist_engine_of(d)), d->shm_note);
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    fprintf(f, "allreduce: world %d, engine %s, data path: %s; host %s, %ld cpus; %d warmup + %d timed iterations; cpu memory budget %s",
            n, tsys_dist_engine_name(tsys_dist_engine_of(d)), path, d->hostname, cpus, o->warmup, o->iters,
            du_rank_budget_str(lim, sizeof(lim), cpu_budget, dev == TSYS_CPU ? mem : 0, local));
    if (dev == TSYS_CUDA) fprintf(f, "; device memory %s", mem ? du_mem_limit_str(lim, sizeof(lim), mem) : "the whole device");
    fprintf(f, f == stdout ? "\n\n" : "\n");   // a blank line before a markdown table
    fflush(f);
}

// --dry-run: what is known before any rank starts (the group, its data path and the budgets come with it).
static int dry_run(const ar_opts *o) {
    const du_common *c = &o->common;
    char lim[160];
    if (c->mem_limit) snprintf(lim, sizeof lim, "%.4g GiB a rank (--mem-limit)", (double)c->mem_limit / 1073741824.0);
    fprintf(du_preamble(c), "allreduce: backend %s, --nproc %d; op %s; dtype %s; sizes %s; %d warmup + %d timed iterations; memory budget %s\n",
            o->backend, o->nproc, o->ops.src, o->dtypes.src, o->sizes.src, o->warmup, o->iters,
            c->mem_limit ? lim : !strcmp(o->backend, "nccl") ? "the whole device" : "the host's available memory over its ranks");
    return du_dry_run_done(c, "allreduce", o->ops.n * o->dtypes.n * o->sizes.n);
}

// The sweep on every rank: the group, then one row per (op, dtype, size), printed by rank 0.
static int sweep(const ar_opts *o, int argc, char **argv) {
    int code = 0;
    if (tsys_dist_spawn(o->nproc, argc, argv, &code)) return code;
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    if (!ctx) { fprintf(stderr, "allreduce: out of memory creating the context\n"); return DU_EXIT_FAILED; }
    tsys_dist_desc desc;
    memset(&desc, 0, sizeof desc);
    desc.timeout_s = o->timeout;
    desc.no_shm = !strcmp(o->shm, "no");
    tsys_device dev = TSYS_CPU;
    if (!strcmp(o->backend, "nccl")) { desc.cuda = true; desc.engine = TSYS_DIST_ENGINE_NCCL; dev = TSYS_CUDA; }
    tsys_dist *d = tsys_dist_init(ctx, &desc);
    if (!d) { fprintf(stderr, "allreduce: %s\n", tsys_ctx_last_error(ctx)); tsys_ctx_free(ctx); return DU_EXIT_FAILED; }
    const int rank = tsys_dist_rank(d);
    const size_t mem = o->common.mem_limit;
    // the ranks on this host share its memory: each gets its part as its CPU budget (or --mem-limit);
    // nccl: --mem-limit caps each rank's device instead
    size_t cpu_budget = du_rank_cpu_budget(ctx, dev == TSYS_CPU ? mem : 0, tsys_dist_local_size(d));
#ifdef TSYS_WITH_CUDA
    if (dev == TSYS_CUDA && mem) tsys_cuda_set_memory_limit(ctx, mem);
#endif
    if (rank == 0) preamble(du_preamble(&o->common), d, o, dev, cpu_budget);
    du_progress_setup("allreduce", rank == 0 ? o->common.progress : "off");
    du_table tab;
    du_table_init(&tab, "op,dtype,size,bytes,ranks,min_ms,mean_ms,max_ms,time_ms,algbw_GB/s,busbw_GB/s,check,status", o->common.format);
    bool all_ok = true;
    int k = 0;
    du_progress_begin(o->ops.n * o->dtypes.n * o->sizes.n);
    for (int i = 0; i < o->ops.n; i++)
        for (int j = 0; j < o->dtypes.n; j++)
            for (int s = 0; s < o->sizes.n; s++) {
                int op = parse_op(o->ops.item[i]);
                tsys_dtype dt = TSYS_F32;
                int64_t b = 0;
                du_parse_dtype(o->dtypes.item[j], &dt); parse_size(o->sizes.item[s], &b);   // checked by the flag table
                du_progress_config(++k, "%s %s %s", o->ops.item[i], o->dtypes.item[j], o->sizes.item[s]);
                if (!run_one(d, dev, o, op, dt, o->sizes.item[s], b, &tab)) all_ok = false;
                if (rank == 0) du_table_emit(&tab);
            }
    du_progress_end();
    if (rank == 0) du_table_exit_code(&tab, "allreduce", o->common.oom_ok);   // says on stderr which rows failed
    du_table_free(&tab);
    tsys_dist_free(d);
    tsys_ctx_free(ctx);
    return all_ok ? DU_EXIT_OK : DU_EXIT_FAILED;   // every rank: the rows' outcomes were agreed on
}

static int driver_main(int argc, char **argv) {
    ar_opts o;
    memset(&o, 0, sizeof o);
    du_flag flags[] = {
        DU_FLAG_CHOICE("backend", &o.backend, "mpi", "mpi|nccl", "mpi: CPU tensors through the host engine (MPI under mpirun, else shared\n"
                       "memory / TCP between --nproc ranks); nccl: CUDA tensors, one GPU per local\nrank (allreduce_cuda)"),
        DU_FLAG_INT("nproc", &o.nproc, "1", 1, 1024, "start N ranks on this host (under mpirun: mpirun's ranks)"),
        DU_FLAG_LIST_CHECKED("sizes", &o.sizes, "1MB,10MB,100MB,1GB", size_ok, "a size above 0 in bytes, or with B, KB, MB or GB: 4KB, 1MB",
                             "buffer sizes (KB/MB/GB = 2^10/2^20/2^30 bytes; a plain number is\nbytes)"),
        DU_FLAG_LIST("op", &o.ops, "all_reduce", "all_reduce|reduce_scatter|all_gather", "the collectives: all_reduce, reduce_scatter, all_gather"),
        DU_FLAG_LIST("dtype", &o.dtypes, "fp32", "fp32|bf16|fp16", "the element types: fp32, bf16, fp16"),
        DU_FLAG_INT("warmup", &o.warmup, "5", 0, 1 << 20, "untimed iterations first"),
        DU_FLAG_INT("iters", &o.iters, "20", 1, 1 << 20, "timed iterations"),
        DU_FLAG_CHOICE("shm", &o.shm, "yes", "yes|no",
                       "host tensors through a shared-memory segment when every rank is on this\nhost (no: through MPI or TCP)"),
        DU_FLAG_CHOICE("buffers", &o.buffers, "plain", "plain|window", "nccl: the buffers from tsys_tensor_new (plain), or NCCL symmetric windows\n"
                       "(tsys_dist_tensor_new), which NCCL's low-latency kernels use for\nfp32/bf16/fp16 sums"),
        DU_FLAG_INT("timeout", &o.timeout, NULL, 1, 1 << 30,
                    "seconds without progress before a rank gives up (default TSYS_DIST_TIMEOUT,\nelse 300)"),
        DU_FLAG_BOOL("no-check", &o.no_check, "skip checking the result of the first iteration"),
        DU_COMMON_FLAGS(&o.common, DU_MEM_LIMIT_RANKS_TEXT),
    };
    const int nflags = (int)(sizeof flags / sizeof flags[0]);
    int rc = du_flags_parse("allreduce", flags, nflags, argc, argv, NULL,
                            "columns: min/mean/max_ms over iterations and ranks; time_ms the mean of the slowest rank per\n"
                            "iteration; algbw = bytes / time_ms; busbw = algbw x 2(n-1)/n (all_reduce) or (n-1)/n; check:\n"
                            "a few elements of the first iteration's result (ok, WRONG, skipped).\n");
    if (rc == DU_HELP) return DU_EXIT_OK;
    if (rc) return rc;
#ifndef TSYS_WITH_CUDA
    if (!strcmp(o.backend, "nccl")) {
        fprintf(stderr, "allreduce: --backend nccl needs the CUDA build (make cuda: build/allreduce_cuda)\n");
        rc = DU_EXIT_USAGE;
    }
#endif
    if (!rc) rc = o.common.dry_run ? dry_run(&o) : sweep(&o, argc, argv);
    du_flags_free(flags, nflags);
    return rc;
}

int main(int argc, char **argv) { return du_exit("allreduce", driver_main(argc, argv)); }
