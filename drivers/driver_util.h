// driver_util.h - what every driver shares: the flag table (--help and parsing), strict flag values, comma lists, result tables printed
// row by row as markdown, CSV or JSON lines, the exit code, progress on stderr, result files put in
// place whole and stdout checked at exit, the memory budget of ranks that share a host; and what the
// drivers of the cs336 LM share (e2e, memory, ddp): the model flags, a step in the report's phases,
// its snapshots, its timing (phase events, warmup, a captured CUDA graph), MFU against a reference
// GEMM rate, the context of the measured device. Included after tsys.h by one driver.
//
// Exit codes (every driver, documented in each --help and the README):
//   0  every row was measured (or skipped by design); with --oom-ok, out-of-memory rows count too
//   1  some row failed (an error, or out of memory without --oom-ok), or the run could not start, or
//      a result could not be written (stdout, or a file of --out / --profile)
//   2  bad usage: an unknown flag, a bad value, an empty or too long list (nothing was measured)
#ifndef TSYS_DRIVER_UTIL_H
#define TSYS_DRIVER_UTIL_H
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdarg.h>
#include <math.h>
#include <unistd.h>
#include <errno.h>
#include <stdint.h>
#include <time.h>
#include <sys/stat.h>
#ifdef _OPENMP
#include <omp.h>
#endif

enum { DU_EXIT_OK = 0, DU_EXIT_FAILED = 1, DU_EXIT_USAGE = 2 };
// What a parser returns for --help (main prints the usage on stdout and exits 0); never an exit code.
#define DU_HELP (-1)

// The exit-code paragraph every --help ends with.
#define DU_EXIT_HELP \
    "exit status: 0 every row ok (skipped rows too; OOM rows too under --oom-ok), 1 some row failed\n" \
    "             (error, or OOM without --oom-ok), the run could not start or a result could not be\n" \
    "             written (stdout, an output file), 2 bad usage\n"

static char *du_strdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = (char *)malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

// ---- flags -----------------------------------------------------------------------------------

static inline bool du_parse_int(const char *s, long lo, long hi, int *out) {
    char *end;
    errno = 0;
    if (*s == ' ' || (*s >= '\t' && *s <= '\r')) return false;   // strtol would skip it
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return false;
    *out = (int)v;
    return true;
}

// Plain decimal notation only ("1.5", "2e-3"): no "inf", "nan", hex floats or leading blanks,
// which strtod would take.
static inline bool du_parse_double(const char *s, double *out) {
    if (!*s) return false;
    for (const char *c = s; *c; c++)
        if (!strchr("0123456789.eE+-", *c)) return false;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end || errno == ERANGE || !isfinite(v)) return false;
    *out = v;
    return true;
}

#define DU_MAX_GIB 1048576.0   // 2^20 GiB = 2^50 bytes: beyond any machine, and the byte count fits size_t

// --mem-limit: a number of GiB from 0 to DU_MAX_GIB, to bytes (rounded up, so a tiny positive value is
// a tiny budget, not 0 = the default). Prints "<prog>: --mem-limit takes ..." when it is not one.
static inline bool du_parse_gib(const char *prog, const char *flag, const char *s, size_t *bytes) {
    double g = 0;
    if (!du_parse_double(s, &g) || g < 0 || g > DU_MAX_GIB) {
        fprintf(stderr, "%s: %s takes a number of GiB from 0 to %.0f (0 = the default: the memory available), not '%s'\n",
                prog, flag, DU_MAX_GIB, s);
        return false;
    }
    double b = ceil(g * 1073741824.0);
    *bytes = (size_t)b;
    return true;
}

// Element counts the drivers ask tensors for stay at most 2^62 (computed in double, exact enough
// here): beyond, the library's int64 shape products would overflow before any memory check could
// refuse them, and no machine holds such a tensor anyway.
#define DU_MAX_ELEMS 4611686018427387904.0
static inline bool du_elems_ok(double n) { return n <= DU_MAX_ELEMS; }

// fp32, bf16 or fp16 (a driver's --dtype values).
static inline bool du_parse_dtype(const char *s, tsys_dtype *d) {
    if (!strcmp(s, "fp32")) *d = TSYS_F32;
    else if (!strcmp(s, "bf16")) *d = TSYS_BF16;
    else if (!strcmp(s, "fp16")) *d = TSYS_F16;
    else return false;
    return true;
}

#define DU_LIST_MAX 64

typedef struct du_list { const char *src; char *buf; char *item[DU_LIST_MAX]; int n; } du_list;   // src: the flag's value as given

// Splits "a,b,c" into items; the list owns a copy of the string. An empty list, an empty item
// ("a,,b", "a,") or more than DU_LIST_MAX items is an error that names the flag (the list is then
// empty and needs no free).
static inline bool du_split(du_list *l, const char *prog, const char *flag, const char *s) {
    memset(l, 0, sizeof(*l));
    if (!*s) { fprintf(stderr, "%s: %s needs at least one value\n", prog, flag); return false; }
    int n = 1;
    for (const char *c = s; *c; c++) n += *c == ',';
    if (n > DU_LIST_MAX) { fprintf(stderr, "%s: %s lists %d values; at most %d\n", prog, flag, n, DU_LIST_MAX); return false; }
    l->src = s;
    l->buf = du_strdup(s);
    if (!l->buf) { fprintf(stderr, "%s: out of memory\n", prog); return false; }
    char *p = l->buf;
    for (;;) {
        char *comma = strchr(p, ',');
        if (comma) *comma = 0;
        if (!*p) {
            fprintf(stderr, "%s: empty value in %s '%s'\n", prog, flag, s);
            free(l->buf); memset(l, 0, sizeof(*l));
            return false;
        }
        l->item[l->n++] = p;
        if (!comma) break;
        p = comma + 1;
    }
    return true;
}
static inline void du_list_free(du_list *l) { free(l->buf); l->buf = NULL; l->n = 0; }
static inline bool du_list_has(const du_list *l, const char *item) {
    for (int i = 0; i < l->n; i++)
        if (!strcmp(l->item[i], item)) return true;
    return false;
}

static inline int du_num_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

static inline bool du_has_cuda(void) {
#ifdef TSYS_WITH_CUDA
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
#else
    return false;
#endif
}

// Why --device cannot run in this binary (NULL: it can): cuda needs a build with nvcc.
static inline const char *du_device_why(const char *device) {
#ifndef TSYS_WITH_CUDA
    if (!strcmp(device, "cuda")) return "--device cuda: this binary was built without CUDA; build it with 'make cuda'";
#endif
    (void)device;
    return NULL;
}

// "8.00 GiB" or "default (available memory)", for the one-line configuration.
static inline const char *du_mem_limit_str(char *buf, size_t len, size_t bytes) {
    if (!bytes) snprintf(buf, len, "default (available memory)");
    else snprintf(buf, len, "%.4g GiB", (double)bytes / 1073741824.0);
    return buf;
}

// ---- the memory budget of ranks that share a host -------------------------------------------------

// Sets and returns the CPU budget of one of local_ranks ranks on this host: cpu_limit (--mem-limit,
// bytes) when given, else the host's default (what tsys_ctx_new found: MemAvailable or the cgroup's
// room) divided among the local ranks, which would otherwise each count on all of it.
static inline size_t du_rank_cpu_budget(tsys_ctx *ctx, size_t cpu_limit, int local_ranks) {
    size_t b = cpu_limit ? cpu_limit : tsys_ctx_cpu_memory_limit(ctx);
    if (!cpu_limit && local_ranks > 1 && b != SIZE_MAX) b /= (size_t)local_ranks;
    tsys_ctx_set_cpu_memory_limit(ctx, b ? b : 1);
    return b;
}

// "2.5 GiB a rank (the host's available memory over 4 ranks)", for the configuration line.
static inline const char *du_rank_budget_str(char *buf, size_t len, size_t bytes, size_t cpu_limit, int local_ranks) {
    if (bytes == SIZE_MAX) snprintf(buf, len, "unlimited (the available memory is unknown)");
    else if (cpu_limit) snprintf(buf, len, "%.4g GiB a rank (--mem-limit)", (double)bytes / 1073741824.0);
    else snprintf(buf, len, "%.4g GiB a rank (the host's available memory over %d local rank%s)", (double)bytes / 1073741824.0, local_ranks,
                  local_ranks == 1 ? "" : "s");
    return buf;
}

// ---- writing results ---------------------------------------------------------------------------
//
// A result that cannot be written is a failure, never a silent exit 0: stdout is flushed and checked
// when main returns (du_exit), and a result file goes to a temporary beside its final name, which it
// takes (rename) only once it is written, synced and closed, so a full disk or a size limit leaves
// the old file or none under the final name, never a truncated one.

// The exit status of a driver whose work returned rc: stdout flushed and its error flag checked, then
// a close of a copy of its descriptor (where NFS reports the writes it deferred). A failure is said
// on stderr and turns 0 into 1 (a usage error keeps its 2). stdout stays open (the fuzz harness calls
// the drivers' main again).
static int du_stdout_errno;   // why a flush of stdout failed before (du_table_emit), for du_exit's message
static inline int du_exit(const char *prog, int rc) {
    errno = 0;
    bool bad = fflush(stdout) != 0 || ferror(stdout);
    int err = errno ? errno : du_stdout_errno;
    if (!bad) {
        int fd = dup(fileno(stdout));
        if (fd >= 0 && close(fd) != 0) { bad = true; err = errno; }
    }
    if (!bad) return rc;
    fprintf(stderr, "%s: writing the results to stdout failed: %s\n", prog, err ? strerror(err) : "a write failed");
    return rc == DU_EXIT_OK ? DU_EXIT_FAILED : rc;
}

// ---- model shapes ------------------------------------------------------------------------------

// The model of a configuration: a preset with the non-zero fields of dims over it, or 'custom' (dims
// over the defaults); then the context length and attention. False (err filled) when it is invalid.
static inline bool du_model_desc(const tsys_model_desc *dims, const char *model_name, int T, const char *attn, tsys_model_desc *d, char *err, size_t len) {
    if (!strcmp(model_name, "custom")) *d = tsys_model_desc_defaults(dims);
    else if (tsys_model_desc_preset(model_name, d, err, len) != TSYS_OK) return false;
    else {
        if (dims->d_model) d->d_model = dims->d_model;
        if (dims->d_ff) d->d_ff = dims->d_ff;
        if (dims->num_layers) d->num_layers = dims->num_layers;
        if (dims->num_heads) d->num_heads = dims->num_heads;
        if (dims->vocab_size) d->vocab_size = dims->vocab_size;
    }
    d->context_length = T;
    d->attn = attn;
    return tsys_model_desc_validate(d, err, len) == TSYS_OK;
}

// The largest tensors of a step (logits, attention scores, the FFN activations, the weights) stay
// within DU_MAX_ELEMS; err names the sizes when they do not.
static inline bool du_model_sizes_ok(const tsys_model_desc *d, int batch, int T, char *err, size_t len) {
    double B = batch, V = d->vocab_size, D = d->d_model, F = d->d_ff, H = d->num_heads;
    if (du_elems_ok(B * T * V) && du_elems_ok(B * H * T * (double)T) && du_elems_ok(B * T * F) && du_elems_ok(V * D) && du_elems_ok(D * F)) return true;
    snprintf(err, len, "tensor sizes past 2^62 elements (batch %d x context %d with vocab %d, %d heads, d_ff %d)", batch, T, d->vocab_size, d->num_heads, d->d_ff);
    return false;
}

// The --dtype spelling of an autocast dtype (fp32, bf16, fp16).
static inline const char *du_dtype_flag(tsys_dtype d) { return d == TSYS_F32 ? "fp32" : d == TSYS_BF16 ? "bf16" : "fp16"; }

// Seconds on the monotonic clock (progress, snapshot times).
static inline double du_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// ---- one step of the cs336 LM, in the report's phases (e2e and memory) ---------------------------

typedef enum { DU_FORWARD, DU_FORWARD_BACKWARD, DU_TRAIN } du_mode;
static const char *const du_mode_names[3] = {"forward", "forward-backward", "train"};
static inline bool du_parse_mode(const char *s, du_mode *m) {
    for (int i = 0; i < 3; i++) if (!strcmp(s, du_mode_names[i])) { *m = (du_mode)i; return true; }
    return false;
}

// A model, its optimizer (train mode only: AdamW state only where a step uses it, so memory columns
// compare) and a batch; mark (optional) is called at the phase boundaries of each step: 0 start,
// 1 forward done, 2 backward done, 3 optimizer done.
typedef struct du_lm {
    tsys_ctx *ctx;
    tsys_device dev;
    tsys_model *model;
    tsys_optim *opt;
    tsys_tensor *ids, *targets;
    tsys_dtype dtype;
    du_mode mode;
    tsys_grad_scaler scaler;
    bool overlap;                          // the optimizer inside backward (tsys_optim_overlap_begin/end)
    bool free_grads;                       // ... on the compute stream, each layer's gradients given back after its update
    bool fuse_update;                      // ... with each linear weight updated inside its gradient's product (TSYS_OPTIM_FUSE_UPDATE)
    bool lowp_copies;                      // AdamW keeps the autocast dtype's weight copies (tsys_optim_keep_lowp; train, bf16/fp16)
    bool lowp_grads;                       // the linear weights' gradients in the autocast dtype (tsys_model_set_grad_dtype)
    void (*mark)(void *user, int boundary);
    void *mark_user;
    // Snapshots of the training state (train mode): du_lm_snapshots before the first step, du_lm_step_done
    // after each. Zeroed: none, and the steps are only counted.
    char save_dir[640];                    // "": no snapshots
    int save_every, keep_last;             // a snapshot after each step whose number is a multiple of save_every
    const char *const *record;             // the user record of each snapshot (tsys_state_desc.user): the
    int n_record;                          // configuration, for du_lm_resume to check
    int64_t step;                          // training steps taken, those of the snapshot resumed from included
    int saves;                             // snapshots written and the time the training thread spent in
    double save_ms;                        // them (the device sync before a synchronous one excluded)
    bool save_async;                       // through a tsys_state_saver: the files written beside training
    tsys_state_saver *saver;               // (made with the snapshots' directory)
    int64_t saved_step, reported;          // the step of the last asynchronous snapshot; snapshots reported
} du_lm;

// r zeroed, then set to run steps of mode in autocast dtype on dev (the other fields: their defaults).
static inline void du_lm_init(du_lm *r, tsys_ctx *ctx, tsys_device dev, du_mode mode, tsys_dtype dtype) {
    memset(r, 0, sizeof(*r));
    r->ctx = ctx; r->dev = dev; r->mode = mode; r->dtype = dtype;
}

static inline tsys_status du_lm_setup(du_lm *r, const tsys_model_desc *d, int batch, int T, uint64_t seed, const char *load) {
    tsys_ctx *ctx = r->ctx;
    r->model = tsys_model_new(ctx, d, r->dev, seed + 1);
    if (r->model && load) tsys_model_load(r->model, load);
    if (r->model && r->mode == DU_TRAIN) r->opt = tsys_adamw_new(ctx, tsys_model_params(r->model), tsys_model_num_tensors(r->model), NULL);
    if (r->opt && r->lowp_copies && r->dtype != TSYS_F32) tsys_optim_keep_lowp(r->opt, r->dtype);
    if (r->model && r->lowp_grads && r->dtype != TSYS_F32) tsys_model_set_grad_dtype(r->model, r->dtype);
    int64_t shape[2] = {batch, T};
    tsys_tensor *ids = tsys_tensor_new(ctx, TSYS_I64, TSYS_CPU, 2, shape), *tgt = tsys_tensor_new(ctx, TSYS_I64, TSYS_CPU, 2, shape);
    tsys_rng_seed(ctx, seed + 7);
    if (ids && tgt) { tsys_tensor_randint(ctx, ids, d->vocab_size); tsys_tensor_randint(ctx, tgt, d->vocab_size); }
    r->ids = tsys_tensor_to(ctx, ids, r->dev);
    r->targets = tsys_tensor_to(ctx, tgt, r->dev);
    tsys_tensor_release(ids); tsys_tensor_release(tgt);
    r->scaler = tsys_grad_scaler_init();
    return tsys_ctx_status(ctx);
}

static inline void du_lm_free(du_lm *r) {
    tsys_state_saver_free(r->saver);   // before the tensors it may still copy
    r->saver = NULL;
    tsys_tensor_release(r->ids); tsys_tensor_release(r->targets);
    tsys_optim_free(r->opt);
    tsys_model_free(r->model);
    r->ids = r->targets = NULL; r->opt = NULL; r->model = NULL;
}

static inline void du_lm_mark(du_lm *r, int boundary) { if (r->mark) r->mark(r->mark_user, boundary); }

// One step in the named ranges "forward", "backward", "optimizer" (NVTX and the profiler see them):
// forward under no_grad in forward mode, autocast for bf16/fp16, the fp16 loss scaler, and the
// gradients given back after the step (torch's zero_grad(set_to_none=True)). *last: the last
// boundary marked (1 in forward mode, else 3). The host does not wait.
static inline tsys_status du_lm_step(du_lm *r, int *last) {
    tsys_ctx *ctx = r->ctx;
    *last = 1;
    du_lm_mark(r, 0);
    tsys_trace_begin(ctx, "forward");
    if (r->mode == DU_FORWARD) tsys_no_grad_begin(ctx);
    if (r->dtype != TSYS_F32) tsys_autocast_begin(ctx, r->dtype);
    tsys_tensor *logits = r->mode == DU_FORWARD ? tsys_model_forward(r->model, r->ids) : NULL;
    tsys_tensor *loss = r->mode == DU_FORWARD ? NULL : tsys_model_loss(r->model, r->ids, r->targets);
    if (r->dtype != TSYS_F32) tsys_autocast_end(ctx);
    if (r->mode == DU_FORWARD) tsys_no_grad_end(ctx);
    tsys_tensor_release(logits);
    tsys_trace_end(ctx);
    du_lm_mark(r, 1);
    if (r->mode != DU_FORWARD && tsys_ctx_status(ctx) == TSYS_OK) {
        tsys_trace_begin(ctx, "backward");
        tsys_tensor *scaled = r->dtype == TSYS_F16 ? tsys_grad_scaler_scale(ctx, &r->scaler, loss) : tsys_tensor_retain(loss);
        if (r->overlap) tsys_optim_overlap_begin_ex(r->opt, (r->free_grads ? TSYS_OPTIM_FREE_GRADS : 0u) | (r->fuse_update ? TSYS_OPTIM_FUSE_UPDATE : 0u));
        tsys_backward(ctx, scaled);
        if (r->overlap) tsys_optim_overlap_end(r->opt);   // joins the background stream: the updates count in backward
        tsys_tensor_release(scaled);
        tsys_trace_end(ctx);
        du_lm_mark(r, 2);
        tsys_trace_begin(ctx, "optimizer");
        if (r->mode == DU_TRAIN && r->dtype == TSYS_F16) { tsys_grad_scaler_step(&r->scaler, r->opt); tsys_grad_scaler_update(&r->scaler); }
        else if (r->mode == DU_TRAIN && !r->overlap) tsys_optim_step(r->opt);
        if (r->opt) tsys_optim_release_grads(r->opt);   // as torch's zero_grad(set_to_none=True)
        else tsys_release_grads(ctx, tsys_model_params(r->model), tsys_model_num_tensors(r->model));
        tsys_trace_end(ctx);
        du_lm_mark(r, 3);
        *last = 3;
    }
    tsys_tensor_release(loss);
    tsys_tape_clear(ctx);
    return tsys_ctx_status(ctx);
}

// ---- training-state snapshots of a du_lm (tsys_state_*, docs/design/state.md) ------------------
//
// A snapshot holds the model, AdamW (moments, step count, hyper-parameters), the fp16 loss scaler when
// the step uses it, the context's RNG and r->record; it is named after r->step ("step-000012"), the
// number of training steps taken since the run that first started from fresh weights. Every step
// counts, warmup ones too (they train): a snapshot's step is then its AdamW step count (less the
// steps the fp16 loss scaler skipped on an overflow).
//
// Under a captured CUDA graph (e2e --compile yes) this relies on three things: tsys_state_load writes
// into the live parameters, moments and AdamW's device step counter in place (the addresses stay), so
// a load before the capture is what the graph's kernels read; a replay advances only that device
// counter, which tsys_state_save reads (not the host's); and a save sees every write of the replays
// before it (its copies to the host run outside any capture, between replays: a synchronous save after
// tsys_sync, an asynchronous one's copies after an event of the compute stream, and the next replay
// waits for them).

// The snapshot flags of a training driver (e2e; ddp can take them the same way): the table's rows and
// the rules between them (du_snapshot_flags_why), for du_lm_snapshots.
typedef struct du_snapshot_flags { const char *save_dir, *resume, *save_async; int save_every, keep_last; } du_snapshot_flags;
#define DU_SNAPSHOT_FLAGS(s)                                                                                                           \
    DU_FLAG_INT("save-every", &(s)->save_every, NULL, 1, 1 << 30, "train mode: a snapshot of the training state (model, AdamW, fp16 loss\nscaler, "  \
                "RNG) into --save-dir after every step whose number is a\nmultiple of N, and after the last; steps count from the start of the\n"    \
                "first run, warmup ones included (docs/design/state.md)"),                                                            \
    DU_FLAG_STR("save-dir", &(s)->save_dir, NULL, "DIR", "where --save-every writes: DIR/step-NNNNNN, DIR/<configuration>/step-NNNNNN\n" \
                "in a sweep of several"),                                                                                              \
    DU_FLAG_INT("keep-last", &(s)->keep_last, "3", 0, 1 << 20, "snapshots kept in each directory (0: all)"),                           \
    DU_FLAG_CHOICE("save-async", &(s)->save_async, "yes", "yes|device|no", "yes: the tensors are copied (cuda: on a copy stream) and the files\n" \
                   "written by a thread while training goes on; device: the same, staged\nin a second copy in device memory first (the "      \
                   "next step waits\nmilliseconds, not the copy to the host); no: the step waits"),                                        \
    DU_FLAG_STR("resume", &(s)->resume, NULL, "DIR", "train mode: start from the newest snapshot in DIR (DIR/<configuration>\nin a "     \
                "sweep), continuing its step count; an error row when there is\nnone or it does not load")

// Why the snapshot flags given cannot run (NULL: they can): modes (NULL when the driver only trains)
// holds another mode than train, or --save-every and --save-dir come one without the other.
static inline const char *du_snapshot_flags_why(const du_snapshot_flags *s, const du_list *modes, char *buf, size_t len) {
    char given[48];
    snprintf(given, sizeof(given), "%s%s%s", s->save_every ? " --save-every" : "", s->save_dir ? " --save-dir" : "", s->resume ? " --resume" : "");
    for (int i = 0; modes && *given && i < modes->n; i++) {
        if (strcmp(modes->item[i], "train")) { snprintf(buf, len, "%s: train mode only, and --mode holds '%s'", given + 1, modes->item[i]); return buf; }
    }
    if (!s->save_every != !s->save_dir) return s->save_dir ? "--save-dir needs --save-every N" : "--save-every needs --save-dir DIR";
    return NULL;
}

// Writes r's snapshot of step r->step into r->save_dir (made when missing; its parent must exist),
// keeping the newest r->keep_last (0: all). Synchronous: the device is synchronized first, outside the
// time taken. Asynchronous: the call queues the copies and returns (it waits only for a previous
// snapshot still being written, and that wait is in the time taken); du_lm_saves_wait collects it.
// A line on stderr for an asynchronous snapshot (of step) written since the last one: where its time went.
static inline void du_lm_saves_report(du_lm *r, int64_t step) {
    tsys_state_saver_stats s = tsys_state_saver_stats_get(r->saver);
    if (s.saves == r->reported) return;
    r->reported = s.saves;
    fprintf(stderr, "snapshot step-%06lld: %.2f GB, %.1f ms in the call, copied %.0f ms after it, written %.1f s later (%.2f GB/s)\n", (long long)step,
            (double)s.bytes / 1e9, s.stage_ms, s.copy_ms, s.write_ms / 1e3, (double)s.bytes / 1e6 / (s.copy_ms + s.write_ms));
}

static inline tsys_state_desc du_lm_state_desc(du_lm *r) {
    tsys_state_desc d;
    memset(&d, 0, sizeof(d));
    d.model = r->model; d.optim = r->opt; d.scaler = r->dtype == TSYS_F16 ? &r->scaler : NULL;
    d.user = r->record; d.n_user = r->n_record; d.step = r->step; d.keep_last = r->keep_last;
    return d;
}

static inline tsys_status du_lm_save(du_lm *r) {
    tsys_status st = r->save_async ? TSYS_OK : tsys_sync(r->ctx, r->dev);
    if (st != TSYS_OK) return st;
    tsys_state_desc d = du_lm_state_desc(r);
    double t0 = du_now_s();
    int64_t prev = r->saved_step;
    st = r->save_async ? tsys_state_save_async(r->saver, r->save_dir, &d) : tsys_state_save(r->ctx, r->save_dir, &d);
    double ms = 1e3 * (du_now_s() - t0);
    r->save_ms += ms;
    r->saves++;
    r->saved_step = r->step;
    if (r->save_async) du_lm_saves_report(r, prev);   // the one before: the call waited for it
    else fprintf(stderr, "snapshot step-%06lld: %.0f ms (the step waited)\n", (long long)r->step, ms);
    return st;
}

// The last asynchronous snapshot durable in place (or its error); nothing to do for synchronous ones.
static inline tsys_status du_lm_saves_wait(du_lm *r) {
    tsys_status st = r->saver ? tsys_state_saver_wait(r->saver) : TSYS_OK;
    if (r->saver) du_lm_saves_report(r, r->saved_step);
    return st;
}

// After a training step: counts it and saves a snapshot when its number is a multiple of save_every,
// or when it is the run's last (last: so a finished run can be continued from its end).
static inline tsys_status du_lm_step_done(du_lm *r, bool last) {
    if (r->mode != DU_TRAIN) return TSYS_OK;
    r->step++;
    return r->save_dir[0] && (r->step % r->save_every == 0 || last) ? du_lm_save(r) : TSYS_OK;
}

// A line on stderr for a snapshot loaded (from the files read until the tensors were in place).
static inline void du_lm_load_report(const char *path, double seconds) {
    static const char *const files[2] = {"model.safetensors", "train_state.safetensors"};
    double bytes = 0;
    for (int i = 0; i < 2; i++) {
        char f[1024];
        struct stat sb;
        if (snprintf(f, sizeof(f), "%s/%s", path, files[i]) < (int)sizeof(f) && stat(f, &sb) == 0) bytes += (double)sb.st_size;
    }
    fprintf(stderr, "resumed from %s: %.2f GB loaded in %.2f s (%.2f GB/s)\n", path, bytes / 1e9, seconds, seconds > 0 ? bytes / 1e9 / seconds : 0.0);
}

// Loads the newest snapshot of dir (tsys_state_latest) into r and continues from its step (r->step);
// before the first step. The first n_match pairs of r->record must be the snapshot's too (what makes
// it the same run: the data); the rest may differ. path gets the snapshot's path. An error names dir or
// the snapshot and what is wrong (none there, a damaged file, another configuration); r is then only
// fit to be freed (a mismatch is found after the load wrote).
static inline tsys_status du_lm_resume(du_lm *r, const char *dir, int n_match, char *path, size_t len) {
    tsys_ctx *ctx = r->ctx;
    if (tsys_state_latest(ctx, dir, path, len) != TSYS_OK) return tsys_ctx_status(ctx);
    if (!*path) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "--resume '%s': no complete snapshot there (a step-NNNNNN directory with its MANIFEST)", dir);
    tsys_state_desc d;
    tsys_state_info *info = (tsys_state_info *)malloc(sizeof(*info));   // 10 KB of user record: not on the stack
    memset(&d, 0, sizeof(d));
    d.model = r->model; d.optim = r->opt; d.scaler = r->dtype == TSYS_F16 ? &r->scaler : NULL;
    if (!info) return tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "--resume '%s': out of host memory", path);
    double t0 = du_now_s();
    tsys_status st = tsys_state_load(ctx, path, &d, info);
    if (st == TSYS_OK) st = tsys_sync(ctx, r->dev);
    if (st == TSYS_OK) du_lm_load_report(path, du_now_s() - t0);
    for (int i = 0; st == TSYS_OK && i < n_match && i < r->n_record; i++) {
        const char *key = r->record[2 * i], *want = r->record[2 * i + 1], *got = tsys_state_info_get(info, key);
        if (!got || strcmp(got, want))
            st = tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "--resume '%s': saved with %s %s, this run has %s %s", path, key, got ? got : "(none)", key, want);
    }
    if (st == TSYS_OK) r->step = info->step;
    free(info);
    return st;
}

// Sets r's snapshots up before the first step as the flags say: into --save-dir, and a load from
// --resume (du_lm_resume: n_match and path as there); both in their subdirectory sub unless sub is ""
// (a sweep's configuration: --save-dir is then made if missing).
static inline tsys_status du_lm_snapshots(du_lm *r, const du_snapshot_flags *f, const char *sub, int n_match, char *path, size_t len) {
    tsys_ctx *ctx = r->ctx;
    const char *slash = *sub ? "/" : "", *save_dir = f->save_dir, *resume = f->resume;
    char dir[640];
    if (save_dir) {
        if (*sub && mkdir(save_dir, 0777) != 0 && errno != EEXIST) return tsys_ctx_set_error(ctx, TSYS_ERR_IO, "--save-dir '%s': cannot make it: %s", save_dir, strerror(errno));
        if (snprintf(r->save_dir, sizeof(r->save_dir), "%s%s%s", save_dir, slash, sub) >= (int)sizeof(r->save_dir))
            return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "--save-dir '%s': the path is too long", save_dir);
        r->save_every = f->save_every; r->keep_last = f->keep_last;
        r->save_async = !f->save_async || strcmp(f->save_async, "no") != 0;
        tsys_state_desc d = du_lm_state_desc(r);   // the saver's staging memory now, not at the first save
        if (r->save_async && !(r->saver = tsys_state_saver_new(ctx))) return tsys_ctx_status(ctx);
        if (r->saver && f->save_async && !strcmp(f->save_async, "device")) tsys_state_saver_stage_on_device(r->saver, true);
        if (r->saver && tsys_state_saver_reserve(r->saver, &d) != TSYS_OK) return tsys_ctx_status(ctx);
    }
    if (!resume) return TSYS_OK;
    if (snprintf(dir, sizeof(dir), "%s%s%s", resume, slash, sub) >= (int)sizeof(dir)) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "--resume '%s': the path is too long", resume);
    return du_lm_resume(r, dir, n_match, path, len);
}

// The record of a training driver's snapshots (r->record): the batch, the context and the seed (what a
// resumed run must share: du_lm_resume with n_match 3 checks them), then the configuration's name.
// rec keeps the strings while r runs.
typedef struct du_lm_record { char value[4][300]; const char *pairs[8]; } du_lm_record;
static inline void du_lm_record_set(du_lm *r, du_lm_record *rec, int batch, int T, int seed, const char *config) {
    static const char *const keys[4] = {"batch", "context", "seed", "config"};
    snprintf(rec->value[0], 300, "%d", batch); snprintf(rec->value[1], 300, "%d", T); snprintf(rec->value[2], 300, "%d", seed);
    snprintf(rec->value[3], 300, "%s", config);
    for (int i = 0; i < 4; i++) { rec->pairs[2 * i] = keys[i]; rec->pairs[2 * i + 1] = rec->value[i]; }
    r->record = rec->pairs; r->n_record = 4;
}

// ---- progress on stderr: --progress auto|on|off --------------------------------------------------
//
// "e2e: configuration 3 of 8 (small T=256 train), step 4 of 10, ETA 1m05s". On a terminal the line
// is rewritten in place; elsewhere (--progress on into a log) a line is written when a configuration
// starts and at most once every few seconds after. The ETA takes the remaining steps of this
// configuration at its own rate, and each remaining configuration at the mean time of the finished
// ones (of this one's projected total before any has finished).

typedef struct du_progress_state {
    bool on, tty;
    const char *prog;
    int configs, config;           // N and k (1-based; 0 before the first)
    char what[160];                // the configuration, in words
    double t_start, t_config;      // seconds (monotonic): the first configuration, this one
    double done_s;                 // time spent in finished configurations
    double last_line;              // when a line was last written (non-terminal output)
} du_progress_state;
static du_progress_state du_prog;

// --progress's value (checked by the flag table: auto, on or off).
static inline void du_progress_setup(const char *prog, const char *mode) {
    memset(&du_prog, 0, sizeof(du_prog));
    du_prog.prog = prog;
    du_prog.tty = isatty(2) != 0;
    du_prog.on = !strcmp(mode, "on") || (!strcmp(mode, "auto") && du_prog.tty);
}

// The sweep will run `configs` configurations.
static inline void du_progress_begin(int configs) {
    du_prog.configs = configs;
    du_prog.config = 0;
    du_prog.done_s = 0;
    du_prog.t_start = du_now_s();
}

static inline void du_eta_str(char *buf, size_t len, double s) {
    if (!(s >= 0) || s > 359999) { snprintf(buf, len, "unknown"); return; }
    long v = (long)(s + 0.5);
    if (v >= 3600) snprintf(buf, len, "%ldh%02ldm", v / 3600, v / 60 % 60);
    else if (v >= 60) snprintf(buf, len, "%ldm%02lds", v / 60, v % 60);
    else snprintf(buf, len, "%lds", v);
}

static inline void du_progress_line(const char *line, bool force) {
    if (!du_prog.on) return;
    double now = du_now_s();
    if (du_prog.tty) fprintf(stderr, "\r\033[K%s", line);
    else if (force || now - du_prog.last_line >= 5.0) fprintf(stderr, "%s\n", line);
    else return;
    du_prog.last_line = now;
    fflush(stderr);
}

// Configuration k (1-based) starts; what names it ("small T=256 train").
static inline void du_progress_config(int k, const char *fmt, ...) {
    double now = du_now_s();
    if (du_prog.config > 0) du_prog.done_s += now - du_prog.t_config;
    du_prog.config = k;
    du_prog.t_config = now;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(du_prog.what, sizeof(du_prog.what), fmt, ap);
    va_end(ap);
    char line[320];
    snprintf(line, sizeof(line), "%s: configuration %d of %d (%s)", du_prog.prog, k, du_prog.configs, du_prog.what);
    du_progress_line(line, true);
}

// Step s (1-based) of S of the running configuration is done; phase says which ("warmup", "timed").
static inline void du_progress_step(const char *phase, int s, int S) {
    if (!du_prog.on || S <= 0) return;
    double in_config = du_now_s() - du_prog.t_config;
    double config_total = s > 0 ? in_config / s * S : 0;
    int finished = du_prog.config - 1, left = du_prog.configs - du_prog.config;
    double per_config = finished > 0 ? du_prog.done_s / finished : config_total;
    char eta[32], line[400];
    du_eta_str(eta, sizeof(eta), s > 0 ? fmax(0.0, config_total - in_config) + left * per_config : -1);   // (rounding: never below 0)
    snprintf(line, sizeof(line), "%s: configuration %d of %d (%s), %s step %d of %d, ETA %s", du_prog.prog, du_prog.config, du_prog.configs, du_prog.what,
             phase, s, S, eta);
    du_progress_line(line, s == S);
}

// The sweep is over: a terminal's line is cleared.
static inline void du_progress_end(void) {
    if (du_prog.on && du_prog.tty) fprintf(stderr, "\r\033[K");
    if (du_prog.on) fflush(stderr);
}

// ---- the flag table: one table parses the command line and prints --help -----------------------
//
// Each driver lists its flags once: name, kind, where the value goes, the default as typed, and the
// help. du_flags_parse takes "--flag value" and "--flag=value", checks every value (a message names
// the flag, the value and the rule), and fills the destinations; du_flags_usage prints the same
// table. Lists (DU_LIST) are comma-separated and owned by the destination du_list (du_flags_free).

typedef enum {
    DU_BOOL,     // bool *: present or not; takes no value
    DU_INT,      // int *: an integer in [lo, hi]
    DU_GIB,      // size_t *: GiB from 0 to DU_MAX_GIB, to bytes
    DU_NUM,      // double *: a decimal number in [lo, hi]
    DU_STR,      // const char **: any non-empty string, or one of `choices`, or one that `check` takes
    DU_LIST      // du_list *: comma-separated items, each one of `choices` or taken by `check`
} du_flag_kind;

typedef struct du_flag {
    const char *name;                 // without the dashes: "model" is --model
    du_flag_kind kind;
    void *dest;
    const char *def;                  // the default as it would be typed (NULL: none, the driver decides)
    const char *meta;                 // the value in the help: "N", "LIST", "DIR"
    const char *help;                 // '\n' starts an indented continuation line
    const char *choices;              // DU_STR, DU_LIST: "md|csv|jsonl" (NULL: any, or check)
    bool (*check)(const char *item);  // DU_STR, DU_LIST: what an item must satisfy (NULL: choices or anything)
    const char *rule;                 // the rule in words for check's errors ("an integer from 1 to 1048576")
    double lo, hi;                    // DU_INT, DU_NUM
} du_flag;

// Table rows, in du_flag's order (no designated initializers: the drivers also compile as C++).
#define DU_FLAG_BOOL(name, dest, help) {name, DU_BOOL, dest, NULL, NULL, help, NULL, NULL, NULL, 0, 0}
#define DU_FLAG_INT(name, dest, def, lo, hi, help) {name, DU_INT, dest, def, "N", help, NULL, NULL, NULL, lo, hi}
#define DU_FLAG_NUM(name, dest, def, lo, hi, meta, help) {name, DU_NUM, dest, def, meta, help, NULL, NULL, NULL, lo, hi}
#define DU_FLAG_GIB(name, dest, help) {name, DU_GIB, dest, "0", "GIB", help, NULL, NULL, NULL, 0, DU_MAX_GIB}
#define DU_FLAG_STR(name, dest, def, meta, help) {name, DU_STR, dest, def, meta, help, NULL, NULL, NULL, 0, 0}
#define DU_FLAG_CHOICE(name, dest, def, choices, help) {name, DU_STR, dest, def, choices, help, choices, NULL, NULL, 0, 0}
#define DU_FLAG_CHECKED(name, dest, def, meta, check, rule, help) {name, DU_STR, dest, def, meta, help, NULL, check, rule, 0, 0}
#define DU_FLAG_LIST(name, dest, def, choices, help) {name, DU_LIST, dest, def, "LIST", help, choices, NULL, NULL, 0, 0}
#define DU_FLAG_LIST_CHECKED(name, dest, def, check, rule, help) {name, DU_LIST, dest, def, "LIST", help, NULL, check, rule, 0, 0}

// What every driver takes (DU_COMMON_FLAGS adds them to its table).
typedef struct du_common {
    const char *format;     // md, csv or jsonl
    const char *progress;   // auto, on or off
    size_t mem_limit;       // bytes; 0 = the default budget
    bool dry_run, oom_ok;
} du_common;

#define DU_FORMAT_HELP "output rows, each printed as soon as it is measured; csv and jsonl keep stdout\n" \
                       "for the rows (the configuration lines go to stderr) and write not-applicable\n" \
                       "cells as empty (csv) or null (jsonl); md writes them as '-'"
#define DU_PROGRESS_HELP "a progress line on stderr: 'configuration k of N, step s of S, ETA'; auto: when\n" \
                         "stderr is a terminal"
#define DU_COMMON_FLAGS(c, mem_help)                                                                              \
    DU_FLAG_CHOICE("format", &(c)->format, "md", "md|csv|jsonl", DU_FORMAT_HELP),                                  \
    DU_FLAG_CHOICE("progress", &(c)->progress, "auto", "auto|on|off", DU_PROGRESS_HELP),                           \
    DU_FLAG_GIB("mem-limit", &(c)->mem_limit, mem_help),                                                           \
    DU_FLAG_BOOL("oom-ok", &(c)->oom_ok, "out-of-memory rows do not make the exit status 1 (sweeps that expect them)"), \
    DU_FLAG_BOOL("dry-run", &(c)->dry_run, "check the flags, print the configuration and how many configurations\nwould run; measure nothing")

// The S26 section 8 plan's rates (ddp --plan, mesh), whose: how the help names the plan.
#define DU_PLAN_RATE_FLAGS(tflops, gbps, whose)                                                                      \
    DU_FLAG_NUM("plan-tflops", tflops, "650", 1e-3, 1e6, "C", whose " compute rate C in TFLOP/s (650: bf16 GEMMs measured on an H100)"), \
    DU_FLAG_NUM("plan-gbps", gbps, "340", 1e-3, 1e6, "W", whose " link rate W in GB/s a rank sends (340: NCCL's 1 GB all-reduce\nbusbw measured on 4 H100s)")

#define DU_MEM_LIMIT_TEXT \
    "memory budget for the tensors of the device measured, so that running out is an\n" \
    "OOM row, never a kill (cpu: default = the memory available on this machine,\n" \
    "MemAvailable, or less: the room left in the memory cgroup of a container or a\n" \
    "Slurm job; cuda: default = the whole device); 0 = the default; 0 to 1048576"
#define DU_MEM_LIMIT_RANKS_TEXT DU_MEM_LIMIT_TEXT "\n" \
    "(per rank: without it, the ranks on one host share the host's memory, each\n" \
    "getting the available memory divided by the number of ranks on the host)"

#define DU_HELP_COL 29   // where the help text starts

static inline bool du_choice_ok(const char *choices, const char *v) {
    size_t n = strlen(v);
    for (const char *c = choices; *c;) {
        const char *bar = strchr(c, '|');
        size_t len = bar ? (size_t)(bar - c) : strlen(c);
        if (len == n && !strncmp(c, v, n)) return true;
        if (!bar) break;
        c = bar + 1;
    }
    return false;
}

// "md, csv or jsonl" from "md|csv|jsonl"
static inline const char *du_choices_words(char *buf, size_t len, const char *choices) {
    size_t o = 0;
    int n = 1;
    for (const char *c = choices; *c; c++) n += *c == '|';
    int k = 0;
    buf[0] = 0;
    for (const char *c = choices; *c && o + 8 < len; c++) {
        if (*c != '|') { buf[o++] = *c; continue; }
        k++;
        const char *sep = k == n - 1 ? " or " : ", ";
        for (const char *s = sep; *s && o + 1 < len; s++) buf[o++] = *s;
    }
    buf[o] = 0;
    return buf;
}

static inline void du_flags_usage(FILE *f, const char *prog, const char *synopsis, const du_flag *flags, int n, const char *epilogue) {
    fprintf(f, "usage: %s [flags]%s%s\n", prog, synopsis && *synopsis ? "\n" : "", synopsis ? synopsis : "");
    for (int i = 0; i < n; i++) {
        const du_flag *fl = &flags[i];
        char head[96];
        int w = snprintf(head, sizeof(head), "  --%s%s%s", fl->name, fl->meta ? " " : "", fl->meta ? fl->meta : "");
        fprintf(f, "%s%*s", head, w < DU_HELP_COL ? DU_HELP_COL - w : 1, "");
        if (w >= DU_HELP_COL) fprintf(f, "\n%*s", DU_HELP_COL, "");
        for (const char *c = fl->help; *c; c++) {
            fputc(*c, f);
            if (*c == '\n') fprintf(f, "%*s", DU_HELP_COL, "");
        }
        if (fl->def && *fl->def && fl->kind != DU_BOOL && fl->kind != DU_GIB)   // --mem-limit says its default in words
            fprintf(f, " (default %s)", fl->def);
        fputc('\n', f);
    }
    fprintf(f, "  --help                     this text\n");
    fprintf(f, "Flags take their value as '--flag value' or '--flag=value'; lists are comma-separated (at most %d values).\n", DU_LIST_MAX);
    if (epilogue) fputs(epilogue, f);
    fputs(DU_EXIT_HELP, f);
}

// One value into its destination; false after a message naming the flag, the value and the rule.
static inline bool du_flag_set(const char *prog, const du_flag *fl, const char *v) {
    char flag[80], words[200];
    snprintf(flag, sizeof(flag), "--%s", fl->name);
    switch (fl->kind) {
    case DU_BOOL: *(bool *)fl->dest = true; return true;
    case DU_INT:
        if (du_parse_int(v, (long)fl->lo, (long)fl->hi, (int *)fl->dest)) return true;
        fprintf(stderr, "%s: %s takes an integer from %.0f to %.0f, not '%s'\n", prog, flag, fl->lo, fl->hi, v);
        return false;
    case DU_NUM: {
        double x;
        if (du_parse_double(v, &x) && x >= fl->lo && x <= fl->hi) { *(double *)fl->dest = x; return true; }
        fprintf(stderr, "%s: %s takes a number from %g to %g, not '%s'\n", prog, flag, fl->lo, fl->hi, v);
        return false;
    }
    case DU_GIB: return du_parse_gib(prog, flag, v, (size_t *)fl->dest);
    case DU_STR:
        if (!*v) { fprintf(stderr, "%s: %s needs a non-empty value\n", prog, flag); return false; }
        if (fl->choices && !du_choice_ok(fl->choices, v)) {
            fprintf(stderr, "%s: %s takes %s, not '%s'\n", prog, flag, du_choices_words(words, sizeof(words), fl->choices), v);
            return false;
        }
        if (fl->check && !fl->check(v)) { fprintf(stderr, "%s: %s takes %s, not '%s'\n", prog, flag, fl->rule, v); return false; }
        *(const char **)fl->dest = v;
        return true;
    case DU_LIST: {
        du_list *l = (du_list *)fl->dest;
        du_list_free(l);
        if (!du_split(l, prog, flag, v)) return false;
        for (int i = 0; i < l->n; i++) {
            bool ok = fl->choices ? du_choice_ok(fl->choices, l->item[i]) : fl->check ? fl->check(l->item[i]) : true;
            if (ok) continue;
            fprintf(stderr, "%s: bad value '%s' in %s (%s)\n", prog, l->item[i], flag, fl->choices ? du_choices_words(words, sizeof(words), fl->choices) : fl->rule);
            du_list_free(l);
            return false;
        }
        return true;
    }
    }
    return false;
}

// Frees the lists the table's DU_LIST flags hold.
static inline void du_flags_free(const du_flag *flags, int n) {
    for (int i = 0; i < n; i++)
        if (flags[i].kind == DU_LIST) du_list_free((du_list *)flags[i].dest);
}

// Parses argv against the table: 0 (every destination filled: the value given, else the default;
// the lists then need du_flags_free), DU_HELP (the usage was printed on stdout), or DU_EXIT_USAGE
// after a message on stderr (nothing to free). Never exits. A flag given twice takes the last value.
static inline int du_flags_parse(const char *prog, const du_flag *flags, int n, int argc, char **argv, const char *synopsis, const char *epilogue) {
    enum { MAXF = 96 };
    const char *given[MAXF] = {0};
    if (n > MAXF) { fprintf(stderr, "%s: too many flags in the table\n", prog); return DU_EXIT_USAGE; }
    for (int i = 0; i < n; i++)
        if (flags[i].kind == DU_LIST) memset(flags[i].dest, 0, sizeof(du_list));
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { du_flags_usage(stdout, prog, synopsis, flags, n, epilogue); return DU_HELP; }
        if (strncmp(a, "--", 2) || !a[2]) {
            fprintf(stderr, "%s: unexpected argument '%s': every value follows its flag ('%s --help' lists them)\n", prog, a, prog);
            return DU_EXIT_USAGE;
        }
        const char *eq = strchr(a, '=');
        size_t len = eq ? (size_t)(eq - a - 2) : strlen(a + 2);
        int k = -1;
        for (int j = 0; j < n && k < 0; j++)
            if (strlen(flags[j].name) == len && !strncmp(flags[j].name, a + 2, len)) k = j;
        if (k < 0) {
            fprintf(stderr, "%s: unknown flag '%.*s' ('%s --help' lists the flags)\n", prog, (int)(len + 2), a, prog);
            return DU_EXIT_USAGE;
        }
        if (flags[k].kind == DU_BOOL) {
            if (eq) { fprintf(stderr, "%s: --%s takes no value (given '%s')\n", prog, flags[k].name, eq + 1); return DU_EXIT_USAGE; }
            given[k] = "";
        } else if (eq) given[k] = eq + 1;
        else if (i + 1 < argc) given[k] = argv[++i];
        else { fprintf(stderr, "%s: --%s needs a value (%s)\n", prog, flags[k].name, flags[k].meta ? flags[k].meta : "see --help"); return DU_EXIT_USAGE; }
    }
    for (int i = 0; i < n; i++) {
        const char *v = given[i] ? given[i] : flags[i].kind == DU_BOOL ? NULL : flags[i].def;
        if (v && !du_flag_set(prog, &flags[i], v)) { du_flags_free(flags, n); return DU_EXIT_USAGE; }
    }
    return 0;
}

// Where the configuration lines go: stdout beside markdown rows, stderr when stdout holds csv or jsonl.
static inline FILE *du_preamble(const du_common *c) { return strcmp(c->format, "md") ? stderr : stdout; }

// --dry-run's last line: how many configurations a run would measure.
static inline int du_dry_run_done(const du_common *c, const char *prog, int configs) {
    FILE *f = du_preamble(c);
    fprintf(f, "%s: dry run: %d configuration%s would run\n", prog, configs, configs == 1 ? "" : "s");
    fflush(f);
    return DU_EXIT_OK;
}

// ---- result tables ---------------------------------------------------------------------------
//
// Rows are printed the moment they are measured, in every format (markdown: the header before the
// first row), and flushed, so a sweep that is killed keeps every finished row. The table counts
// the rows by their status cell ("ok", "skipped: ...", "OOM: ...", anything else is a failure),
// which gives the exit code.

#define DU_MAX_COLS 40   // ddp has 33; a column past the last would be dropped
#define DU_CELL 320

typedef struct du_row { char cell[DU_MAX_COLS][DU_CELL]; const char *const *cols; int ncols; } du_row;
typedef struct du_table {
    char *colbuf;
    const char *cols[DU_MAX_COLS];
    int ncols;
    const char *fmt;          // md, csv or jsonl
    du_row row;               // the row being filled
    bool header_done;
    int rows, ok, skipped, oom, failed;
} du_table;

static inline void du_table_init(du_table *t, const char *columns, const char *fmt) {
    memset(t, 0, sizeof(*t));
    t->fmt = fmt;
    t->colbuf = du_strdup(columns);
    for (char *tok = t->colbuf ? strtok(t->colbuf, ",") : NULL; tok && t->ncols < DU_MAX_COLS; tok = strtok(NULL, ",")) t->cols[t->ncols++] = tok;
}

// A fresh, empty row; it is printed by du_table_emit.
static inline du_row *du_table_row(du_table *t) {
    du_row *r = &t->row;
    memset(r, 0, sizeof(*r));
    r->cols = t->cols; r->ncols = t->ncols;
    return r;
}

static inline void du_row_set(du_row *r, const char *col, const char *fmt, ...) {
    for (int i = 0; i < r->ncols; i++) {
        if (strcmp(r->cols[i], col)) continue;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(r->cell[i], DU_CELL, fmt, ap);
        va_end(ap);
        for (char *c = r->cell[i]; *c; c++) if (*c == '\n' || *c == '\r' || *c == '|') *c = ' ';
        return;
    }
}
static inline const char *du_row_get(const du_row *r, const char *col) {
    for (int i = 0; i < r->ncols; i++) if (!strcmp(r->cols[i], col)) return r->cell[i];
    return "";
}

static inline bool du_is_number(const char *s) {
    if (!*s) return false;
    char *end;
    double v = strtod(s, &end);
    return *end == 0 && isfinite(v) && strchr("-0123456789", *s);   // what JSON calls a number
}

// A cell that does not apply ("-", or never set) is written as '-' in markdown, empty in csv and null
// in jsonl, so a column of numbers stays numeric for pandas and jq.
#define DU_NA "-"
static inline bool du_is_na(const char *s) { return !*s || !strcmp(s, DU_NA); }

static inline void du_print_row(const du_table *t, const du_row *r) {
    if (!strcmp(t->fmt, "csv")) {
        for (int i = 0; i < t->ncols; i++) {
            if (du_is_na(r->cell[i])) { printf("%s", i ? "," : ""); continue; }
            bool quote = strchr(r->cell[i], ',') || strchr(r->cell[i], '"');
            printf("%s", i ? "," : "");
            if (!quote) { printf("%s", r->cell[i]); continue; }
            printf("\"");
            for (const char *c = r->cell[i]; *c; c++) printf(*c == '"' ? "\"\"" : "%c", *c);
            printf("\"");
        }
        printf("\n");
    } else if (!strcmp(t->fmt, "jsonl")) {
        printf("{");
        for (int i = 0; i < t->ncols; i++) {
            printf("%s\"%s\": ", i ? ", " : "", t->cols[i]);
            if (du_is_na(r->cell[i])) printf("null");
            else if (du_is_number(r->cell[i])) printf("%s", r->cell[i]);
            else {
                printf("\"");
                for (const char *c = r->cell[i]; *c; c++) {
                    if (*c == '"' || *c == '\\') printf("\\%c", *c);
                    else if ((unsigned char)*c < 0x20) printf("\\u%04x", (unsigned char)*c);
                    else printf("%c", *c);
                }
                printf("\"");
            }
        }
        printf("}\n");
    } else {
        printf("|");
        for (int i = 0; i < t->ncols; i++) printf(" %s |", du_is_na(r->cell[i]) ? DU_NA : r->cell[i]);
        printf("\n");
    }
}

// Prints the current row (the header first, for md and csv), flushes, and counts its status.
static inline void du_table_emit(du_table *t) {
    if (!t->header_done) {
        if (!strcmp(t->fmt, "md")) {
            printf("|");
            for (int i = 0; i < t->ncols; i++) printf(" %s |", t->cols[i]);
            printf("\n|");
            for (int i = 0; i < t->ncols; i++) printf("---|");
            printf("\n");
        } else if (!strcmp(t->fmt, "csv")) {
            for (int i = 0; i < t->ncols; i++) printf("%s%s", i ? "," : "", t->cols[i]);
            printf("\n");
        }
        t->header_done = true;
    }
    du_print_row(t, &t->row);
    errno = 0;
    if (fflush(stdout) != 0 && errno) du_stdout_errno = errno;   // reported when main returns (du_exit)
    const char *st = du_row_get(&t->row, "status");
    t->rows++;
    if (!strcmp(st, "ok")) t->ok++;
    else if (!strncmp(st, "skipped", 7)) t->skipped++;
    else if (!strncmp(st, "OOM", 3)) t->oom++;
    else t->failed++;
}

// The exit code of a sweep (see the top of this file); says on stderr why it is not 0.
static inline int du_table_exit_code(const du_table *t, const char *prog, bool oom_ok) {
    int bad = t->failed + (oom_ok ? 0 : t->oom);
    if (!bad) return DU_EXIT_OK;
    fprintf(stderr, "%s: %d of %d rows failed (errors: %d, out of memory: %d%s)\n", prog, bad, t->rows, t->failed, t->oom,
            t->oom && !oom_ok ? "; --oom-ok accepts out-of-memory rows" : "");
    return DU_EXIT_FAILED;
}

static inline void du_table_free(du_table *t) { free(t->colbuf); memset(t, 0, sizeof(*t)); }

// ---- the model flags of the LM drivers: --model, the explicit dims, --context-length --------------
//
// e2e, memory and ddp name the model the same way: --model lists presets, 'custom' (the explicit dims
// over the defaults) and, where the driver loads weights (e2e --load), 'from-file' (the checkpoint's
// dims); --d-model, --d-ff, --num-layers, --num-heads and --vocab-size override the preset's. The
// driver fills the texts of --model (du_model_flags_texts), puts DU_MODEL_FLAGS in its table and takes
// each configuration's model from du_model_config.

typedef struct du_model_flags {
    du_list models;              // --model
    tsys_model_desc dims;        // the explicit dims: the non-zero fields override the preset's
    const char *load;            // the checkpoint whose dims 'from-file' takes (NULL: none)
    bool fused_loss;             // --fused-loss: tsys_model_desc.fused_loss
    char help[320], rule[256];   // --model's help and its rule in words
} du_model_flags;

// --model's help and rule: formats with one %s, the names of the presets.
static inline void du_model_flags_texts(du_model_flags *m, const char *help_fmt, const char *rule_fmt) {
    snprintf(m->help, sizeof(m->help), help_fmt, tsys_model_preset_names());
    snprintf(m->rule, sizeof(m->rule), rule_fmt, tsys_model_preset_names());
}

static inline bool du_ok_context(const char *s) { int t; return du_parse_int(s, 1, 1 << 20, &t); }
static inline bool du_ok_model(const char *s) { tsys_model_desc d; return !strcmp(s, "custom") || tsys_model_desc_preset(s, &d, NULL, 0) == TSYS_OK; }
static inline bool du_ok_model_or_file(const char *s) { return !strcmp(s, "from-file") || du_ok_model(s); }

// The table's rows: --model (default def, each item taken by check: du_ok_model, or du_ok_model_or_file
// where 'from-file' is one) and the explicit dims.
#define DU_MODEL_FLAGS(m, def, check)                                                                                  \
    DU_FLAG_LIST_CHECKED("model", &(m)->models, def, check, (m)->rule, (m)->help),                                     \
    DU_FLAG_INT("d-model", &(m)->dims.d_model, NULL, 1, 1 << 20,                                                       \
                "d_model: explicit dims override the preset's ('custom': the defaults')"),                             \
    DU_FLAG_INT("d-ff", &(m)->dims.d_ff, NULL, 1, 1 << 22, "d_ff, the feed-forward width (explicit dims)"),            \
    DU_FLAG_INT("num-layers", &(m)->dims.num_layers, NULL, 1, 1 << 12, "Transformer blocks (explicit dims)"),          \
    DU_FLAG_INT("num-heads", &(m)->dims.num_heads, NULL, 1, 1 << 12, "attention heads (explicit dims)"),               \
    DU_FLAG_INT("vocab-size", &(m)->dims.vocab_size, NULL, 1, 1 << 24, "vocabulary size (explicit dims)"),            \
    DU_FLAG_BOOL("fused-loss", &(m)->fused_loss, "the LM head and the cross-entropy fused (tsys_linear_cross_entropy): the\n"  \
                 "logits are made a chunk of rows at a time, never whole (the same training up to fp32\n"                   \
                 "rounding; tensor-parallel layouts have their own vocabulary-parallel loss)")
#define DU_CONTEXT_FLAG(list, def, help) \
    DU_FLAG_LIST_CHECKED("context-length", list, def, du_ok_context, "an integer from 1 to 1048576", help)

// Why the model flags cannot run (NULL: they can): 'from-file' without m->load, or with explicit dims.
static inline const char *du_model_flags_why(const du_model_flags *m) {
    const tsys_model_desc *x = &m->dims;
    for (int i = 0; i < m->models.n; i++) {
        if (strcmp(m->models.item[i], "from-file")) continue;
        if (!m->load) return "--model from-file needs --load FILE (the checkpoint whose dims it takes)";
        if (x->d_model || x->d_ff || x->num_layers || x->num_heads || x->vocab_size)
            return "--model from-file takes its dims from the file: drop --d-model, --d-ff, --num-layers, --num-heads and --vocab-size";
    }
    return NULL;
}

// The model of a configuration: a preset or 'custom' (du_model_desc), or 'from-file' (m->load's dims;
// the context is the configuration's, as RoPE has no length limit). False (err filled) when invalid.
static inline bool du_model_config(const du_model_flags *m, const char *model, int T, const char *attn, tsys_model_desc *d, char *err, size_t len) {
    if (strcmp(model, "from-file")) {
        if (!du_model_desc(&m->dims, model, T, attn, d, err, len)) return false;
    } else {
        if (tsys_model_desc_from_file(m->load, d, err, len) != TSYS_OK) return false;
        d->context_length = T;
        d->attn = attn;
        if (tsys_model_desc_validate(d, err, len) != TSYS_OK) return false;
    }
    d->fused_loss = m->fused_loss;
    return true;
}

// --attn auto: flash on cuda under bf16/fp16 autocast, naive otherwise (the fp32 flash kernel has no
// tensor cores and loses to naive).
static inline const char *du_attn_resolve(const char *attn, tsys_device dev, tsys_dtype dt) {
    return strcmp(attn, "auto") ? attn : dev == TSYS_CUDA && dt != TSYS_F32 ? "flash" : "naive";
}

// The columns that name a step's configuration (a table lacking one ignores it).
static inline void du_row_lm_config(du_row *row, tsys_device dev, const char *model, int T, int batch, du_mode mode, tsys_dtype dt, const char *attn) {
    du_row_set(row, "device", "%s", dev == TSYS_CPU ? "cpu" : "cuda");
    du_row_set(row, "model", "%s", model); du_row_set(row, "context", "%d", T); du_row_set(row, "batch", "%d", batch);
    du_row_set(row, "mode", "%s", du_mode_names[mode]); du_row_set(row, "dtype", "%s", du_dtype_flag(dt)); du_row_set(row, "attn", "%s", attn);
}

// A number, or not applicable (NAN, inf) when it is not finite.
static inline void du_row_num(du_row *r, const char *col, const char *fmt, double v) { if (isfinite(v)) du_row_set(r, col, fmt, v); }

// ---- timing a training step of a du_lm: the phases by events, warmup, a captured CUDA graph -------
//
// du_timed's mark records an event on the compute stream at each phase boundary of a step (cudaEvents
// on the GPU, the host clock on the CPU), so the host waits only at the end of a step; the phase times
// come from the events after it. A step captured as a CUDA graph is replayed and timed whole.

typedef struct du_timed {
    du_lm lm;          // the model, its optimizer, the batch, the step, the snapshots
    bool capturing;    // inside CUDA graph capture: no host synchronization allowed
    int64_t saved;     // bytes the forward kept for backward (the tracker's activations after it)
    tsys_event ev[4];  // the phase boundaries of a step: start, forward done, backward done, optimizer done
    double wall_ms;    // host clock over the timed steps, their snapshots' calls included (a wait anywhere counts)
} du_timed;

// The du_lm mark of a du_timed (user): an event at the phase boundary i (nothing while capturing: a
// graph is timed whole). At the end of forward it also takes the bytes the forward kept (the batch is
// the caller's: the embedding and the loss keep it too).
static inline void du_timed_mark(void *user, int i) {
    du_timed *t = (du_timed *)user;
    du_lm *lm = &t->lm;
    if (i == 1 && lm->mode != DU_FORWARD)
        t->saved = tsys_mem_stats_get(lm->ctx, lm->dev).category_bytes[TSYS_MEM_ACTIVATIONS] - (int64_t)(tsys_tensor_bytes(lm->ids) + tsys_tensor_bytes(lm->targets));
    if (!t->capturing) tsys_event_record(lm->ctx, lm->dev, TSYS_STREAM_COMPUTE, &t->ev[i]);
}

// t zeroed, its du_lm set up as du_lm_init does, with du_timed_mark as its mark.
static inline void du_timed_init(du_timed *t, tsys_ctx *ctx, tsys_device dev, du_mode mode, tsys_dtype dtype) {
    memset(t, 0, sizeof(*t));
    du_lm_init(&t->lm, ctx, dev, mode, dtype);
    t->lm.mark = du_timed_mark; t->lm.mark_user = t;
}

static inline void du_timed_free(du_timed *t) {
    for (int i = 0; i < 4; i++) tsys_event_release(t->lm.ctx, &t->ev[i]);
    du_lm_free(&t->lm);
}

// One step (du_lm_step); adds the phase times (ms) to ms[0..2]: forward, backward, optimizer.
static inline tsys_status du_timed_step(du_timed *t, double *ms) {
    int last;
    tsys_status st = du_lm_step(&t->lm, &last);
    if (!t->capturing && st == TSYS_OK)
        for (int i = 0; i < last; i++) ms[i] += tsys_event_elapsed_ms(t->lm.ctx, &t->ev[i], &t->ev[i + 1]);
    return tsys_ctx_status(t->lm.ctx);
}

#ifdef TSYS_WITH_CUDA
// Times `steps` replays of the step captured as a CUDA graph; per-step totals go to tot[].
static inline tsys_status du_timed_compiled(du_timed *t, int steps, double *tot) {
    double ms[3] = {0, 0, 0};
    tsys_cuda_graph *g = NULL;
    tsys_status st = tsys_cuda_graph_begin(t->lm.ctx);
    if (st == TSYS_OK) {
        t->capturing = true;
        tsys_status step_st = du_timed_step(t, ms);
        t->capturing = false;
        st = tsys_cuda_graph_end(t->lm.ctx, &g);
        if (step_st != TSYS_OK) st = step_st;
    }
    for (int i = 0; st == TSYS_OK && i < steps; i++) {
        double t0 = du_now_s();
        du_timed_mark(t, 0);
        st = tsys_cuda_graph_replay(t->lm.ctx, g);
        du_timed_mark(t, 3);
        tot[i] = tsys_event_elapsed_ms(t->lm.ctx, &t->ev[0], &t->ev[3]);
        if (st == TSYS_OK) st = tsys_ctx_status(t->lm.ctx);
        if (st == TSYS_OK) st = du_lm_step_done(&t->lm, i == steps - 1);   // between replays (du_lm_save says why it may)
        t->wall_ms += 1e3 * (du_now_s() - t0);
        du_progress_step("timed", i + 1, steps);
    }
    tsys_cuda_graph_free(g);
    return st;
}
#else   // not reached by the drivers: --device cuda is refused without CUDA, and a compiled step is skipped on the CPU
static inline tsys_status du_timed_compiled(du_timed *t, int steps, double *tot) {
    (void)steps; (void)tot;
    return tsys_ctx_set_error(t->lm.ctx, TSYS_ERR_UNSUPPORTED, "--compile needs CUDA");
}
#endif

// warmup untimed steps (in the trace range "warmup", which nsys can skip; at least one before a
// capture), then `steps` timed ones: eager, or replays of the step captured as a CUDA graph (compiled).
// tm holds `steps` each of forward, backward, optimizer and total ms (a compiled step: the total only).
// Each step is counted by du_lm_step_done after its timing: a snapshot's save is not in it.
static inline tsys_status du_timed_run(du_timed *t, int warmup, int steps, bool compiled, double *tm) {
    tsys_ctx *ctx = t->lm.ctx;
    const int n = steps, warm = compiled && warmup < 1 ? 1 : warmup, eager = warm + (compiled ? 0 : n);
    tsys_status st = TSYS_OK;
    bool in_warmup = warm > 0;
    if (in_warmup) tsys_trace_begin(ctx, "warmup");
    for (int i = 0; st == TSYS_OK && i < eager; i++) {
        double ms[3] = {0, 0, 0};
        if (i == warm && in_warmup) { tsys_trace_end(ctx); in_warmup = false; }
        double t0 = du_now_s();
        st = du_timed_step(t, ms);
        if (st == TSYS_OK) st = du_lm_step_done(&t->lm, i == eager - 1 && !compiled);
        if (i < warm) { du_progress_step("warmup", i + 1, warm); continue; }
        t->wall_ms += 1e3 * (du_now_s() - t0);
        du_progress_step("timed", i - warm + 1, n);
        for (int k = 0; k < 3; k++) tm[k * n + i - warm] = ms[k];
        tm[3 * n + i - warm] = ms[0] + ms[1] + ms[2];
    }
    if (in_warmup) tsys_trace_end(ctx);
    if (st == TSYS_OK && compiled) st = du_timed_compiled(t, n, tm + 3 * n);
    if (st == TSYS_OK) st = du_lm_saves_wait(&t->lm);   // the last snapshot in place, or its error in the row
    return st;
}

// ---- MFU: the reference GEMM rates a step's FLOP rate is measured against -------------------------
//
// Measured at the start: CBLAS sgemm on cpu (1024^3, best of 3, GFLOP/s; the same for every autocast
// dtype), the GEMM peak of each dtype on cuda (8192^3, random data, best of 6, TFLOP/s). ref[3] is
// indexed by du_dtype_index (fp32, bf16, fp16); its max is what MFU divides by.

static inline int du_dtype_index(tsys_dtype dt) { return dt == TSYS_F32 ? 0 : dt == TSYS_BF16 ? 1 : 2; }
static inline double du_spread_pct(const tsys_stats *s) { return s->median > 0 ? 100.0 * (s->max - s->min) / s->median : 0; }

// Measures ref[3] on dev and says it in the configuration lines (cfg); tf32: fp32 GEMMs on TF32 cores.
static inline void du_mfu_reference(tsys_ctx *ctx, tsys_device dev, bool tf32, tsys_stats *ref, FILE *cfg) {
    if (dev == TSYS_CPU) {
        double r[3];
        for (int i = 0; i < 3; i++) r[i] = tsys_cpu_sgemm_gflops(1024, 1);   // each after an untimed product
        ref[0] = ref[1] = ref[2] = tsys_stats_of(r, 3);
        fprintf(cfg, "cpu: CBLAS sgemm %.1f GFLOP/s (1024^3, best of 3, spread %.0f%%), %d threads; MFU is measured against it\n", ref[0].max,
                du_spread_pct(&ref[0]), du_num_threads());
        return;
    }
#ifdef TSYS_WITH_CUDA
    for (int i = 0; i < 3; i++) ref[i] = tsys_gemm_rate(ctx, dev, i == 0 ? TSYS_F32 : i == 1 ? TSYS_BF16 : TSYS_F16, 8192, 6);
    fprintf(cfg, "cuda: %s; measured GEMM peaks (8192^3, random data, best of 6): %s %.1f, bf16 %.1f, fp16 %.1f TFLOP/s (spread %.0f%%, %.0f%%, "
            "%.0f%%); MFU is measured against them\n", tsys_cuda_device_name(ctx), tf32 ? "tf32" : "fp32", ref[0].max, ref[1].max, ref[2].max,
            du_spread_pct(&ref[0]), du_spread_pct(&ref[1]), du_spread_pct(&ref[2]));
#else
    (void)ctx; (void)tf32;
#endif
}

// The MFU cell of a row whose step ran at rate (in the reference's unit) against ref (nothing when
// there is none: max 0), and its note when MFU is above 100% or the reference's repetitions spread
// more than 20% ((max - min) / median).
static inline void du_row_mfu(du_row *row, double rate, const tsys_stats *ref) {
    if (!(ref->max > 0)) return;
    double mfu = 100.0 * rate / ref->max, spread = ref->median > 0 ? (ref->max - ref->min) / ref->median : 0;
    char note[200] = "";
    du_row_set(row, "MFU", "%.1f", mfu);
    if (mfu > 100) snprintf(note, sizeof(note), "MFU above 100%%: the reference GEMM ran slower than the step's GEMMs (a loaded machine?)");
    if (spread > 0.2) snprintf(note + strlen(note), sizeof(note) - strlen(note), "%sreference GEMM spread %.0f%%", *note ? "; " : "", 100 * spread);
    if (*note) du_row_set(row, "note", "%s", note);
}

// ---- the context of the measured device ------------------------------------------------------------

// A context whose CPU budget is mem_limit (bytes; 0: the default) when the CPU is measured (a measured
// GPU leaves the CPU its default); NULL after a message.
static inline tsys_ctx *du_ctx_new(const char *prog, tsys_device dev, size_t mem_limit) {
    tsys_ctx_desc cd;
    memset(&cd, 0, sizeof(cd));
    if (dev == TSYS_CPU) cd.cpu_memory_limit = mem_limit;
    tsys_ctx *ctx = tsys_ctx_new(&cd);
    if (!ctx) fprintf(stderr, "%s: out of memory creating the context\n", prog);
    return ctx;
}

#ifdef TSYS_WITH_CUDA
// CUDA on ctx when dev is it, mem_limit (0: the whole device) its budget; false after a message.
static inline bool du_ctx_cuda(const char *prog, tsys_ctx *ctx, tsys_device dev, size_t mem_limit) {
    if (dev != TSYS_CUDA) return true;
    if (tsys_cuda_init(ctx, 0) != TSYS_OK) { fprintf(stderr, "%s: %s\n", prog, tsys_ctx_last_error(ctx)); return false; }
    if (mem_limit) tsys_cuda_set_memory_limit(ctx, mem_limit);
    return true;
}
#endif

#endif
