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
#ifndef TSYS_LINKED_IMPL   // the Makefile's CUDA build compiles the implementations once and links them
#define TSYS_IMPLEMENTATION
#endif
#include "../tsys.h"
#ifdef TSYS_WITH_CUDA
#ifndef TSYS_LINKED_IMPL
#define TSYS_CUDA_IMPLEMENTATION
#endif
#include "../tsys_cuda.cuh"
#endif
#define TSYS_DIST_IMPLEMENTATION
#include "../tsys_dist.h"
#include "driver_util.h"

typedef struct ar_opts {
    const char *backend, *sizes, *ops, *dtypes, *format, *shm, *buffers;
    int nproc, warmup, iters, timeout;
    size_t mem_limit;   // --mem-limit, bytes a rank (0: the host's available memory over its ranks)
    bool check, oom_ok;
} ar_opts;

static void usage(FILE *f) {
    fprintf(f,
        "usage: allreduce [flags]\n"
        "  --backend mpi|nccl       mpi: CPU tensors through the host engine (MPI under mpirun, else shared\n"
        "                           memory / TCP between --nproc ranks); nccl: CUDA tensors, one GPU per\n"
        "                           local rank (allreduce_cuda) (default mpi)\n"
        "  --nproc N                start N ranks on this host (default 1; under mpirun: mpirun's ranks)\n"
        "  --sizes LIST             buffer sizes: 1MB,10MB,100MB,1GB (KB/MB/GB = 2^10/2^20/2^30 bytes; a\n"
        "                           plain number is bytes) (default 1MB,10MB,100MB,1GB)\n"
        "  --op LIST                all_reduce, reduce_scatter, all_gather (default all_reduce)\n"
        "  --dtype LIST             fp32, bf16, fp16 (default fp32)\n"
        "  --warmup N               untimed iterations first (default 5)\n"
        "  --iters N                timed iterations (default 20)\n"
        "  --shm yes|no             host tensors through a shared-memory segment when every rank is on\n"
        "                           this host (default yes; no: through MPI or TCP)\n"
        "  --buffers plain|window   nccl: the buffers from tsys_tensor_new (plain), or NCCL symmetric\n"
        "                           windows (tsys_dist_tensor_new), which NCCL's low-latency kernels\n"
        "                           use for fp32/bf16/fp16 sums (default plain)\n"
        "  --timeout S              seconds without progress before a rank gives up (default 300)\n"
        "  --no-check               skip checking the result of the first iteration\n"
        "  --format md|csv|jsonl    output rows (default md)\n"
        "  --mem-limit GIB          memory budget in GiB for the buffers of each rank, so that running out is an\n"
        "                           OOM row, never a kill (mpi: default = the host's available memory, MemAvailable\n"
        "                           or the room its memory cgroup leaves, divided among the ranks on the host;\n"
        "                           nccl: default = the whole device); 0 = the default; a number from 0 to 1048576\n"
        "  --oom-ok                 out-of-memory rows do not make the exit status 1 (sweeps that expect them)\n"
        "  --help\n"
        "exit status: 0 every row ok (OOM rows too under --oom-ok), 1 a row failed (a wrong result, out of memory\n"
        "             without --oom-ok), the run could not start or the results could not be written, 2 bad usage\n");
}

static int parse_args(int argc, char **argv, ar_opts *o) {
    memset(o, 0, sizeof(*o));
    o->backend = "mpi"; o->sizes = "1MB,10MB,100MB,1GB"; o->ops = "all_reduce"; o->dtypes = "fp32"; o->format = "md"; o->shm = "yes"; o->buffers = "plain";
    o->nproc = 1; o->warmup = 5; o->iters = 20; o->check = true;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) return DU_HELP;
        if (!strcmp(a, "--no-check")) { o->check = false; continue; }
        if (!strcmp(a, "--oom-ok")) { o->oom_ok = true; continue; }
        if (i + 1 >= argc) { fprintf(stderr, "allreduce: flag %s needs a value\n", a); usage(stderr); return 2; }
        const char *v = argv[++i];
        bool ok = true;
        if (!strcmp(a, "--backend")) o->backend = v;
        else if (!strcmp(a, "--sizes")) o->sizes = v;
        else if (!strcmp(a, "--op")) o->ops = v;
        else if (!strcmp(a, "--dtype")) o->dtypes = v;
        else if (!strcmp(a, "--format")) o->format = v;
        else if (!strcmp(a, "--shm")) o->shm = v;
        else if (!strcmp(a, "--buffers")) o->buffers = v;
        else if (!strcmp(a, "--mem-limit")) { if (!du_parse_gib("allreduce", a, v, &o->mem_limit)) return 2; }
        else if (!strcmp(a, "--nproc")) ok = du_parse_int(v, 1, 1024, &o->nproc);
        else if (!strcmp(a, "--warmup")) ok = du_parse_int(v, 0, 1 << 20, &o->warmup);
        else if (!strcmp(a, "--iters")) ok = du_parse_int(v, 1, 1 << 20, &o->iters);
        else if (!strcmp(a, "--timeout")) ok = du_parse_int(v, 1, 1 << 30, &o->timeout);
        else { fprintf(stderr, "allreduce: unknown flag '%s'\n", a); usage(stderr); return 2; }
        if (!ok) { fprintf(stderr, "allreduce: bad value '%s' for %s\n", v, a); usage(stderr); return 2; }
    }
    if (strcmp(o->backend, "mpi") && strcmp(o->backend, "nccl")) { fprintf(stderr, "allreduce: --backend must be mpi or nccl, not '%s'\n", o->backend); usage(stderr); return 2; }
    if (strcmp(o->shm, "yes") && strcmp(o->shm, "no")) { fprintf(stderr, "allreduce: --shm must be yes or no, not '%s'\n", o->shm); usage(stderr); return 2; }
    if (strcmp(o->buffers, "plain") && strcmp(o->buffers, "window")) { fprintf(stderr, "allreduce: --buffers must be plain or window, not '%s'\n", o->buffers); usage(stderr); return 2; }
    if (!du_format_ok(o->format)) { fprintf(stderr, "allreduce: --format must be md, csv or jsonl, not '%s'\n", o->format); usage(stderr); return 2; }
#ifndef TSYS_WITH_CUDA
    if (!strcmp(o->backend, "nccl")) { fprintf(stderr, "allreduce: --backend nccl needs the CUDA build (make cuda: build/allreduce_cuda)\n"); return 2; }
#endif
    return 0;
}

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

enum { OP_AR, OP_RS, OP_AG };
static bool parse_op(const char *s, int *op) {
    if (!strcmp(s, "all_reduce")) *op = OP_AR;
    else if (!strcmp(s, "reduce_scatter")) *op = OP_RS;
    else if (!strcmp(s, "all_gather")) *op = OP_AG;
    else return false;
    return true;
}

static void die(tsys_dist *d, const char *what) {
    fprintf(stderr, "allreduce: rank %d: %s: %s\n", tsys_dist_rank(d), what, tsys_ctx_last_error(tsys_dist_ctx(d)));
    exit(1);   // ends the job (under mpirun the others are stopped; under --nproc the launcher stops them)
}

static double get_f32(tsys_ctx *ctx, tsys_tensor *t, int64_t i, float *scratch, int64_t n) {
    (void)i; (void)n;
    tsys_tensor_to_f32(ctx, t, scratch);
    return scratch[i];
}

// A buffer of n elements: NCCL symmetric-window memory with --buffers window, else tsys_tensor_new's.
static tsys_tensor *buffer(tsys_dist *d, const ar_opts *o, tsys_dtype dt, tsys_device dev, int64_t n) {
    int64_t shape[1] = { n };
    return !strcmp(o->buffers, "window") ? tsys_dist_tensor_new(d, dt, dev, 1, shape) : tsys_tensor_new(tsys_dist_ctx(d), dt, dev, 1, shape);
}

static void row_names(du_row *row, int op, tsys_dtype dt, const char *label, int64_t bytes, int n) {
    du_row_set(row, "op", "%s", op == OP_AR ? "all_reduce" : op == OP_RS ? "reduce_scatter" : "all_gather");
    du_row_set(row, "dtype", "%s", dt == TSYS_F32 ? "fp32" : dt == TSYS_BF16 ? "bf16" : "fp16");
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
        du_row_set(row, "check", "-");
        du_row_set(row, "status", "%s: allocating the buffers: %s", bad == 2 ? "OOM" : "error", why);
        tsys_tensor_release(a); tsys_tensor_release(b);
        tsys_ctx_clear_error(ctx);
        return bad == 2 && o->oom_ok;
    }
    // GPUs: the ranks are lined up on the devices before each timed call, as torch's NCCL barrier does (a
    // one-element all-reduce, waited for): the host barrier alone releases ranks tens of microseconds
    // apart, and the early one would time the wait for its peer inside the collective
    int64_t one[1] = { 1 };
    tsys_tensor *tick = dev != TSYS_CPU ? tsys_tensor_new(ctx, TSYS_F32, dev, 1, one) : NULL;
    if (dev != TSYS_CPU && (!tick || tsys_tensor_fill(ctx, tick, 0.0f) != TSYS_OK)) die(d, "allocating the device barrier");
    bool ok = true;
    double *t = (double *)calloc((size_t)o->iters, sizeof(double));
    for (int it = 0; it < o->warmup + o->iters || it == 0; it++) {
        bool check = o->check && it == 0;
        if (check) tsys_tensor_fill(ctx, a, (float)(rank + 1));
        if (tsys_dist_barrier(d) != TSYS_OK) die(d, "barrier");
        if (tick && (tsys_dist_all_reduce(d, tick, TSYS_DIST_SUM) != TSYS_OK || tsys_sync(ctx, dev) != TSYS_OK)) die(d, "device barrier");
        double t0 = tsys_time_us();
        tsys_status st = op == OP_AR ? tsys_dist_all_reduce(d, a, TSYS_DIST_SUM) : op == OP_RS ? tsys_dist_reduce_scatter(d, b, a, TSYS_DIST_SUM) : tsys_dist_all_gather(d, b, a);
        if (st == TSYS_OK && dev != TSYS_CPU) st = tsys_sync(ctx, dev);
        double us = tsys_time_us() - t0;
        if (st != TSYS_OK) die(d, op == OP_AR ? "all_reduce" : op == OP_RS ? "reduce_scatter" : "all_gather");
        if (it >= o->warmup && it - o->warmup < o->iters) t[it - o->warmup] = us * 1e-3;
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
    }
    (void)get_f32;
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
    du_row_set(row, "algbw_GB/s", "%.3f", algbw);
    du_row_set(row, "busbw_GB/s", "%.3f", algbw * factor);
    du_row_set(row, "check", "%s", !o->check ? "skipped" : okv == 0 ? "ok" : "WRONG");
    du_row_set(row, "status", "%s", okv == 0 ? "ok" : "error: a wrong result (check)");
    free(t);
    tsys_tensor_release(a);
    tsys_tensor_release(tick);
    tsys_tensor_release(b);
    return okv == 0;
}

static int driver_main(int argc, char **argv) {
    ar_opts o;
    int rc = parse_args(argc, argv, &o);
    if (rc == DU_HELP) { usage(stdout); return 0; }
    if (rc) return rc;
    du_list sizes, ops, dtypes;
    if (!du_split(&sizes, "allreduce", "--sizes", o.sizes)) return 2;
    if (!du_split(&ops, "allreduce", "--op", o.ops)) { du_list_free(&sizes); return 2; }
    if (!du_split(&dtypes, "allreduce", "--dtype", o.dtypes)) { du_list_free(&sizes); du_list_free(&ops); return 2; }
    for (int i = 0; i < sizes.n; i++) { int64_t b; if (!parse_size(sizes.item[i], &b) || b == 0) { fprintf(stderr, "allreduce: bad size '%s' (e.g. 4KB, 1MB, 1GB, 1000)\n", sizes.item[i]); usage(stderr); return 2; } }
    for (int i = 0; i < ops.n; i++) { int op; if (!parse_op(ops.item[i], &op)) { fprintf(stderr, "allreduce: unknown op '%s' (all_reduce, reduce_scatter, all_gather)\n", ops.item[i]); usage(stderr); return 2; } }
    for (int i = 0; i < dtypes.n; i++) { tsys_dtype dt; if (!du_parse_dtype(dtypes.item[i], &dt)) { fprintf(stderr, "allreduce: unknown dtype '%s' (fp32, bf16, fp16)\n", dtypes.item[i]); usage(stderr); return 2; } }
    if (!sizes.n || !ops.n || !dtypes.n) { fprintf(stderr, "allreduce: empty list\n"); usage(stderr); return 2; }
    int code = 0;
    if (tsys_dist_spawn(o.nproc, argc, argv, &code)) return code;
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_dist_desc desc;
    memset(&desc, 0, sizeof desc);
    desc.timeout_s = o.timeout;
    desc.no_shm = !strcmp(o.shm, "no");
    tsys_device dev = TSYS_CPU;
    if (!strcmp(o.backend, "nccl")) { desc.cuda = true; desc.engine = TSYS_DIST_ENGINE_NCCL; dev = TSYS_CUDA; }
    tsys_dist *d = tsys_dist_init(ctx, &desc);
    if (!d) { fprintf(stderr, "allreduce: %s\n", tsys_ctx_last_error(ctx)); return 1; }
    int rank = tsys_dist_rank(d), n = tsys_dist_size(d);
    // the ranks on this host share its memory: each gets its part as its CPU budget (or --mem-limit);
    // nccl: --mem-limit caps each rank's device instead
    const int local = tsys_dist_local_size(d);
    char lim[160];
    size_t cpu_budget = du_rank_cpu_budget(ctx, dev == TSYS_CPU ? o.mem_limit : 0, local);
#ifdef TSYS_WITH_CUDA
    if (dev == TSYS_CUDA && o.mem_limit) tsys_cuda_set_memory_limit(ctx, o.mem_limit);
#endif
    if (rank == 0) {
        char path[200];
        // the host data path (tsys_dist internals: this driver includes the implementation)
        if (dev == TSYS_CUDA) {
            int v = 0;
#ifdef TSYS_DIST_NCCL
            if (ncclGetVersion(&v) != ncclSuccess) v = 0;
#endif
            snprintf(path, sizeof path, "CUDA tensors through NCCL %d.%d.%d, %s buffers", v / 10000, v / 100 % 100, v % 100,
                     !strcmp(o.buffers, "window") ? "symmetric-window" : "plain");
        }
        else if (n == 1) snprintf(path, sizeof path, "a group of one: nothing moves");
        else if (d->shm_base) snprintf(path, sizeof path, "shared memory (2 x %zu KiB slots per rank)", d->slice >> 10);
        else snprintf(path, sizeof path, "%s (%s)", tsys_dist_engine_name(tsys_dist_engine_of(d)), d->shm_note);
        long cpus = sysconf(_SC_NPROCESSORS_ONLN);
        printf("allreduce: world %d, engine %s, data path: %s; host %s, %ld cpus; %d warmup + %d timed iterations; cpu memory budget %s",
               n, tsys_dist_engine_name(tsys_dist_engine_of(d)), path, d->hostname, cpus, o.warmup, o.iters,
               du_rank_budget_str(lim, sizeof(lim), cpu_budget, dev == TSYS_CPU ? o.mem_limit : 0, local));
        if (dev == TSYS_CUDA) printf("; device memory %s", o.mem_limit ? du_mem_limit_str(lim, sizeof(lim), o.mem_limit) : "the whole device");
        printf("\n\n");
        fflush(stdout);
    }
    du_table tab;
    du_table_init(&tab, "op,dtype,size,bytes,ranks,min_ms,mean_ms,max_ms,time_ms,algbw_GB/s,busbw_GB/s,check,status", o.format);
    bool all_ok = true;
    for (int k = 0; k < ops.n; k++)
        for (int t = 0; t < dtypes.n; t++)
            for (int s = 0; s < sizes.n; s++) {
                int op = 0; tsys_dtype dt = TSYS_F32; int64_t b = 0;
                parse_op(ops.item[k], &op); du_parse_dtype(dtypes.item[t], &dt); parse_size(sizes.item[s], &b);
                if (!run_one(d, dev, &o, op, dt, sizes.item[s], b, &tab)) all_ok = false;
                if (rank == 0) du_table_emit(&tab);
            }
    if (rank == 0) du_table_exit_code(&tab, "allreduce", o.oom_ok);   // says on stderr which rows failed
    du_table_free(&tab);
    du_list_free(&sizes); du_list_free(&ops); du_list_free(&dtypes);
    tsys_dist_free(d);
    tsys_ctx_free(ctx);
    return all_ok ? 0 : 1;   // every rank: the rows' outcomes were agreed on
}

int main(int argc, char **argv) { return du_exit("allreduce", driver_main(argc, argv)); }
