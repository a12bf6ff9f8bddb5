// memory - the memory profile of the cs336 Transformer LM (the CS336 memory_profiling problem): one
// forward pass or one full training step per configuration, after a warmup step, with every
// allocation on the tracker's timeline.
//
//   memory --model 2.7B --context-length 128,256,512 --mode forward,train --dtype fp32,bf16 --out mem
//
// Per configuration it prints a row (peak, its breakdown by category, the peak of each phase, the
// first-principles prediction beside it) and, after the table, the largest allocations grouped by
// the op that made them and the prediction term by term. With --out DIR it also writes the timeline
// as JSON and as an SVG plot (stacked areas by category, phases shaded, the peak marked).
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
#include "driver_util.h"
#include <sys/stat.h>

#define MIB (1.0 / 1048576.0)


typedef struct mem_opts {
    const char *device, *format, *out;
    du_list models, contexts, modes, dtypes, attns;
    int batch, top;
    uint64_t seed;
    size_t mem_limit;
    tsys_model_desc dims;
    bool oom_ok, dry_run;
    FILE *details;   // the per-configuration tables, printed after the results
    struct memviz *mv;   // the memory_viz snapshot's tracker (--out)
} mem_opts;

static void usage(FILE *f) {
    fprintf(f,
        "usage: memory [flags]\n"
        "  --device cpu|cuda          where to run (default: cuda when a GPU is present, else cpu)\n"
        "  --model LIST               presets (%s) or 'custom' with the dims below (default 2.7B on cuda, small on cpu)\n"
        "  --d-model N --d-ff N --num-layers N --num-heads N --vocab-size N   explicit dims\n"
        "  --context-length LIST      sequence lengths (default 128,256,512)\n"
        "  --batch-size N             (default 4)\n"
        "  --mode LIST                forward (no grad, as inference) | forward-backward | train (default forward,train)\n"
        "  --dtype LIST               fp32 | bf16 | fp16 autocast (default fp32,bf16)\n"
        "  --attn LIST                naive | flash | auto (default auto: flash on cuda under autocast, else naive)\n"
        "  --out DIR                  write DIR/<configuration>.json (the timeline) and .svg (its plot)\n"
        "  --top N                    rows of the largest-allocations table (default 8)\n"
        "  --format md|csv|jsonl      result rows (default md)\n"
        "  --seed N                   weights and batch seed (default 0)\n"
        DU_MEM_LIMIT_HELP
        "  --oom-ok                   out-of-memory rows do not make the exit status 1\n"
        "  --dry-run                  check the flags, print the configuration, measure nothing\n"
        "  --help\n"
        "Every combination of the lists is measured: a warmup step (it makes the optimizer state and the\n"
        "allocator's caches), then the recorded step. Memory is the tracker's: tensor storage, library\n"
        "workspace and kernel scratch by category; 'cached' is what the CUDA caching allocator holds free.\n"
        DU_EXIT_HELP, tsys_model_preset_names());
}

static bool ok_mode(const char *s) { du_mode m; return du_parse_mode(s, &m); }
static bool ok_dtype(const char *s) { tsys_dtype d; return du_parse_dtype(s, &d); }
static bool ok_context(const char *s) { int t; return du_parse_int(s, 1, 1 << 20, &t); }
static bool ok_attn(const char *s) { return !strcmp(s, "naive") || !strcmp(s, "flash") || !strcmp(s, "auto"); }
static bool ok_model(const char *s) { tsys_model_desc d; return !strcmp(s, "custom") || tsys_model_desc_preset(s, &d, NULL, 0) == TSYS_OK; }

static void opts_free(mem_opts *o) {
    du_list_free(&o->models); du_list_free(&o->contexts); du_list_free(&o->modes); du_list_free(&o->dtypes); du_list_free(&o->attns);
}

// Returns 0 (o owns the lists), DU_HELP or DU_EXIT_USAGE after a message naming the flag.
static int parse_args(int argc, char **argv, mem_opts *o) {
    memset(o, 0, sizeof(*o));
    o->device = du_has_cuda() ? "cuda" : "cpu";
    const char *models = NULL, *contexts = "128,256,512", *modes = "forward,train", *dtypes = "fp32,bf16", *attn = "auto";
    o->format = "md"; o->batch = 4; o->top = 8;
    static const char *const valued[] = {"--device", "--model", "--context-length", "--mode", "--dtype", "--attn", "--format", "--out", "--top",
                                         "--batch-size", "--seed", "--d-model", "--d-ff", "--num-layers", "--num-heads", "--vocab-size", "--mem-limit"};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) return DU_HELP;
        if (!strcmp(a, "--oom-ok")) { o->oom_ok = true; continue; }
        if (!strcmp(a, "--dry-run")) { o->dry_run = true; continue; }
        bool known = false;
        for (size_t j = 0; j < sizeof(valued) / sizeof(valued[0]); j++) known = known || !strcmp(a, valued[j]);
        if (!known) { fprintf(stderr, "memory: unknown flag '%s'\n", a); usage(stderr); return DU_EXIT_USAGE; }
        if (i + 1 >= argc) { fprintf(stderr, "memory: flag %s needs a value\n", a); return DU_EXIT_USAGE; }
        const char *v = argv[++i];
        bool ok = true;
        if (!strcmp(a, "--device")) o->device = v;
        else if (!strcmp(a, "--model")) models = v;
        else if (!strcmp(a, "--context-length")) contexts = v;
        else if (!strcmp(a, "--mode")) modes = v;
        else if (!strcmp(a, "--dtype")) dtypes = v;
        else if (!strcmp(a, "--attn")) attn = v;
        else if (!strcmp(a, "--format")) o->format = v;
        else if (!strcmp(a, "--out")) { o->out = v; ok = *v != 0; }
        else if (!strcmp(a, "--top")) ok = du_parse_int(v, 1, 1000, &o->top);
        else if (!strcmp(a, "--mem-limit")) { if (!du_parse_gib("memory", a, v, &o->mem_limit)) return DU_EXIT_USAGE; }
        else if (!strcmp(a, "--batch-size")) ok = du_parse_int(v, 1, 1 << 20, &o->batch);
        else if (!strcmp(a, "--seed")) { int s; ok = du_parse_int(v, 0, 1 << 30, &s); o->seed = (uint64_t)s; }
        else if (!strcmp(a, "--d-model")) ok = du_parse_int(v, 1, 1 << 20, &o->dims.d_model);
        else if (!strcmp(a, "--d-ff")) ok = du_parse_int(v, 1, 1 << 22, &o->dims.d_ff);
        else if (!strcmp(a, "--num-layers")) ok = du_parse_int(v, 1, 1 << 12, &o->dims.num_layers);
        else if (!strcmp(a, "--num-heads")) ok = du_parse_int(v, 1, 1 << 12, &o->dims.num_heads);
        else if (!strcmp(a, "--vocab-size")) ok = du_parse_int(v, 1, 1 << 24, &o->dims.vocab_size);
        if (!ok) { fprintf(stderr, "memory: bad value '%s' for %s\n", v, a); usage(stderr); return DU_EXIT_USAGE; }
    }
    if (strcmp(o->device, "cpu") && strcmp(o->device, "cuda")) { fprintf(stderr, "memory: --device must be cpu or cuda, not '%s'\n", o->device); return DU_EXIT_USAGE; }
    if (!du_format_ok(o->format)) { fprintf(stderr, "memory: --format must be md, csv or jsonl, not '%s'\n", o->format); return DU_EXIT_USAGE; }
#ifndef TSYS_WITH_CUDA
    if (!strcmp(o->device, "cuda")) { fprintf(stderr, "memory: this binary was built without CUDA; build it with 'make cuda'\n"); return DU_EXIT_USAGE; }
#endif
    if (!models) models = strcmp(o->device, "cuda") ? "small" : "2.7B";
    char rule[256];
    snprintf(rule, sizeof(rule), "a preset (%s) or custom", tsys_model_preset_names());
    if (!du_split_check(&o->models, "memory", "--model", models, ok_model, rule)
        || !du_split_check(&o->contexts, "memory", "--context-length", contexts, ok_context, "an integer from 1 to 1048576")
        || !du_split_check(&o->modes, "memory", "--mode", modes, ok_mode, "forward, forward-backward or train")
        || !du_split_check(&o->dtypes, "memory", "--dtype", dtypes, ok_dtype, "fp32, bf16 or fp16")
        || !du_split_check(&o->attns, "memory", "--attn", attn, ok_attn, "naive, flash or auto")) {
        opts_free(o);
        return DU_EXIT_USAGE;
    }
    return 0;
}

// ---- one recorded step ---------------------------------------------------------------------------

typedef struct run {
    du_lm lm;
    double mark[4];   // ms on the timeline's clock: start, forward done, backward done, optimizer done
    int nmarks;
} run;

// The phase marks are host times, the clock of the allocations: on CUDA the host issues the work and
// allocates as it goes, which is what the caching allocator (and PyTorch's memory snapshot) sees.
static void run_mark(void *user, int i) {
    run *r = (run *)user;
    r->mark[i] = tsys_ctx_time_us(r->lm.ctx) * 1e-3;
    r->nmarks = i + 1;
}

static tsys_status run_step(run *r) {
    int last;
    r->nmarks = 0;
    tsys_status st = du_lm_step(&r->lm, &last);
    if (st == TSYS_OK) st = tsys_sync(r->lm.ctx, r->lm.dev);
    return st;
}

// ---- the timeline, replayed ---------------------------------------------------------------------

#define NCAT TSYS_MEM_CATEGORY_COUNT
#define MAX_PHASES 3

typedef struct alloc_rec {   // one allocation of the recorded window
    uint64_t id;
    int64_t bytes;
    double t_alloc, t_free;  // ms; t_free < 0: still live at the end
    int tag;
    tsys_mem_category cat;   // where it was made
    bool saved;              // the tape kept it for backward (it moved to activations)
    tsys_dtype dtype;
    int ndim;
    int64_t shape[TSYS_MAX_DIMS];
} alloc_rec;

typedef struct phase_peak { int64_t live, cat[NCAT], cached; double t; } phase_peak;

typedef struct timeline {
    const tsys_mem_event *ev;
    size_t n;
    tsys_device dev;
    int64_t start_cat[NCAT];        // live bytes by category when the window opened
    int64_t *start_tags;            // live bytes by tag then (num_tags)
    int num_tags;
    double t0, t1;                  // window, ms
    double mark[4]; int nmarks;     // phase boundaries (run.mark)
    phase_peak peak, phase[MAX_PHASES];
    int peak_phase;
    int64_t *peak_tags, *peak_tag_cat_act;   // at the peak: live bytes by tag; of those, activations
    int64_t max_reserved;           // live + cached, the largest
    long mismatches;                // events where the categories do not sum to the live bytes
    alloc_rec *allocs; size_t nallocs;
} timeline;

static int phase_of(const timeline *tl, double t) {
    for (int p = 0; p + 1 < tl->nmarks; p++) if (t < tl->mark[p + 1]) return p;
    return tl->nmarks > 1 ? tl->nmarks - 2 : 0;
}

static alloc_rec *find_alloc(timeline *tl, uint64_t id) {   // allocations are recorded in id order
    size_t lo = 0, hi = tl->nallocs;
    while (lo < hi) { size_t mid = (lo + hi) / 2; if (tl->allocs[mid].id < id) lo = mid + 1; else hi = mid; }
    return lo < tl->nallocs && tl->allocs[lo].id == id ? &tl->allocs[lo] : NULL;
}

static void note_alloc_event(timeline *tl, const tsys_mem_event *e) {
    // a storage resized back from 0 (FSDP's gathered weights) allocates again under its old id: the
    // record (if it was made in the window) lives again; the array stays sorted by id
    if (e->action == TSYS_MEM_EV_ALLOC && e->id && tl->nallocs && e->id <= tl->allocs[tl->nallocs - 1].id) {
        alloc_rec *a = find_alloc(tl, e->id);
        if (a) a->t_free = -1;
        return;
    }
    if (e->action == TSYS_MEM_EV_ALLOC && e->id) {
        alloc_rec *a = &tl->allocs[tl->nallocs++];
        memset(a, 0, sizeof(*a));
        a->id = e->id; a->bytes = e->delta; a->t_alloc = e->t_us * 1e-3; a->t_free = -1; a->tag = e->tag; a->cat = e->category;
        a->dtype = e->dtype; a->ndim = e->ndim;
        memcpy(a->shape, e->shape, sizeof(a->shape));
        return;
    }
    alloc_rec *a = e->id ? find_alloc(tl, e->id) : NULL;
    if (!a) return;
    if (e->action == TSYS_MEM_EV_FREE) a->t_free = e->t_us * 1e-3;
    else if (e->action == TSYS_MEM_EV_MOVE && e->delta > 0 && e->category == TSYS_MEM_ACTIVATIONS) a->saved = true;
}

// Replays the window's events from the state when it opened: the peak and its breakdown (by category
// and by the op that allocated), each phase's peak, the allocations. False when out of host memory.
static bool timeline_replay(timeline *tl) {
    int64_t cat[NCAT], *tags = (int64_t *)calloc((size_t)tl->num_tags, sizeof(int64_t)), *act = (int64_t *)calloc((size_t)tl->num_tags, sizeof(int64_t));
    tl->peak_tags = (int64_t *)calloc((size_t)tl->num_tags, sizeof(int64_t));
    tl->peak_tag_cat_act = (int64_t *)calloc((size_t)tl->num_tags, sizeof(int64_t));
    tl->allocs = (alloc_rec *)malloc((tl->n + 1) * sizeof(alloc_rec));
    if (!tags || !act || !tl->peak_tags || !tl->peak_tag_cat_act || !tl->allocs) { free(tags); free(act); return false; }
    memcpy(cat, tl->start_cat, sizeof(cat));
    memcpy(tags, tl->start_tags, (size_t)tl->num_tags * sizeof(int64_t));
    int64_t live = 0;
    for (int c = 0; c < NCAT; c++) live += cat[c];
    tl->peak.live = -1;
    for (int p = 0; p < MAX_PHASES; p++) tl->phase[p].live = -1;
    for (size_t i = 0; i < tl->n; i++) {
        const tsys_mem_event *e = &tl->ev[i];
        if (e->device != tl->dev) continue;
        cat[e->category] += e->delta; live += e->delta;
        if (e->tag >= 0 && e->tag < tl->num_tags) {
            tags[e->tag] += e->delta;
            if (e->category == TSYS_MEM_ACTIVATIONS) act[e->tag] += e->delta;
        }
        tl->mismatches += live != e->live;
        note_alloc_event(tl, e);
        if (live + e->cached > tl->max_reserved) tl->max_reserved = live + e->cached;
        phase_peak now;
        now.live = live; now.cached = e->cached; now.t = e->t_us * 1e-3;
        memcpy(now.cat, cat, sizeof(cat));
        int p = phase_of(tl, now.t);
        if (live > tl->phase[p].live) tl->phase[p] = now;
        if (live > tl->peak.live) {
            tl->peak = now; tl->peak_phase = p;
            memcpy(tl->peak_tags, tags, (size_t)tl->num_tags * sizeof(int64_t));
            memcpy(tl->peak_tag_cat_act, act, (size_t)tl->num_tags * sizeof(int64_t));
        }
    }
    if (tl->peak.live < 0) {   // no event: the state at the start is the peak
        tl->peak.live = live; memcpy(tl->peak.cat, cat, sizeof(cat)); tl->peak.t = tl->t0;
        memcpy(tl->peak_tags, tags, (size_t)tl->num_tags * sizeof(int64_t));
    }
    free(tags); free(act);
    return true;
}

static void timeline_free(timeline *tl) {
    free(tl->start_tags); free(tl->peak_tags); free(tl->peak_tag_cat_act); free(tl->allocs);
    memset(tl, 0, sizeof(*tl));
}

// ---- writers: the largest allocations, the prediction, JSON, SVG ------------------------------------

static void shape_str(const alloc_rec *a, char *buf, size_t len) {
    if (a->ndim < 0) { snprintf(buf, len, "-"); return; }
    size_t o = (size_t)snprintf(buf, len, "(");
    for (int i = 0; i < a->ndim && o < len; i++) o += (size_t)snprintf(buf + o, len - o, i ? ", %lld" : "%lld", (long long)a->shape[i]);
    if (o < len) snprintf(buf + o, len - o, ")");
}

static bool same_group(const alloc_rec *a, const alloc_rec *b) {
    if (a->bytes != b->bytes || a->tag != b->tag || a->dtype != b->dtype || a->ndim != b->ndim || a->saved != b->saved || a->cat != b->cat) return false;
    for (int i = 0; i < a->ndim; i++) if (a->shape[i] != b->shape[i]) return false;
    return true;
}

static int by_size_then_time(const void *x, const void *y) {
    const alloc_rec *a = (const alloc_rec *)x, *b = (const alloc_rec *)y;
    if (a->bytes != b->bytes) return a->bytes < b->bytes ? 1 : -1;
    if (a->tag != b->tag) return a->tag < b->tag ? -1 : 1;
    return a->t_alloc < b->t_alloc ? -1 : a->t_alloc > b->t_alloc;
}

// The largest allocations of the window, identical ones (same op, shape, dtype, category) as one row
// with their count: "32 x (4, 32, 512, 512) f32 softmax, saved for backward".
static void print_largest(FILE *f, tsys_ctx *ctx, timeline *tl, int top) {
    qsort(tl->allocs, tl->nallocs, sizeof(alloc_rec), by_size_then_time);
    fprintf(f, "largest allocations of the step (identical ones grouped):\n\n");
    fprintf(f, "| MiB each | count | MiB total | shape | dtype | made by | category | first at (ms, phase) | lives (ms, mean) |\n");
    fprintf(f, "|---:|---:|---:|---|---|---|---|---|---:|\n");
    static const char *const phase_names[MAX_PHASES] = {"forward", "backward", "optimizer"};
    int rows = 0;
    for (size_t i = 0; i < tl->nallocs && rows < top; rows++) {
        size_t j = i;
        double life = 0;
        while (j < tl->nallocs && same_group(&tl->allocs[i], &tl->allocs[j])) {
            const alloc_rec *a = &tl->allocs[j++];
            life += (a->t_free >= 0 ? a->t_free : tl->t1) - a->t_alloc;
        }
        const alloc_rec *a = &tl->allocs[i];
        char shape[96];
        shape_str(a, shape, sizeof(shape));
        const char *cat = a->saved ? "activations (saved for backward)" : tsys_mem_category_name(a->cat);
        fprintf(f, "| %.2f | %zu | %.1f | %s | %s | %s | %s | %.2f %s | %.2f%s |\n", a->bytes * MIB, j - i, a->bytes * MIB * (double)(j - i), shape,
                a->ndim < 0 ? "-" : tsys_dtype_name(a->dtype), tsys_mem_tag_name(ctx, a->tag), cat, a->t_alloc - tl->t0,
                phase_names[phase_of(tl, a->t_alloc)], life / (double)(j - i), a->t_free < 0 && j - i == 1 ? " (live at the end)" : "");
        i = j;
    }
    fprintf(f, "\n");
}

static int by_bytes_desc(const void *x, const void *y, const int64_t *v) {
    int a = *(const int *)x, b = *(const int *)y;
    return v[a] < v[b] ? 1 : v[a] > v[b] ? -1 : a - b;
}
static const int64_t *g_sort_values;
static int cmp_tags(const void *x, const void *y) { return by_bytes_desc(x, y, g_sort_values); }

// The prediction, term by term, beside what the tracker measured at the peak; then the ops whose
// saved tensors make up the measured activations (where a difference comes from).
static void print_prediction(FILE *f, tsys_ctx *ctx, const timeline *tl, const tsys_model_mem_estimate *pe) {
    const int64_t *m = tl->peak.cat;
    fprintf(f, "predicted (from the model's shapes) vs measured at the peak, MiB:\n\n| term | predicted | measured | what |\n|---|---:|---:|---|\n");
    fprintf(f, "| parameters | %.1f | %.1f | fp32 master weights |\n", pe->params * MIB, m[TSYS_MEM_PARAMETERS] * MIB);
    fprintf(f, "| gradients | %.1f | %.1f | fp32, one per parameter, made by the first backward |\n", pe->grads * MIB, m[TSYS_MEM_GRADIENTS] * MIB);
    fprintf(f, "| optimizer state | %.1f | %.1f | AdamW m and v |\n", pe->optimizer * MIB, m[TSYS_MEM_OPTIMIZER] * MIB);
    fprintf(f, "| activations | %.1f | %.1f | saved for backward: %.1f per layer x %d + %.1f outside the layers |\n", pe->activations * MIB,
            m[TSYS_MEM_ACTIVATIONS] * MIB, pe->saved_per_layer * MIB, pe->num_layers, pe->saved_outside * MIB);
    fprintf(f, "| temporaries | %.1f | %.1f | %s |\n", pe->temporaries * MIB, m[TSYS_MEM_TEMPORARY] * MIB, pe->temporaries_what);
    fprintf(f, "| workspace | %.1f | %.1f | library workspace, kernel scratch (measured only: the prediction leaves it out) |\n", 0.0, m[TSYS_MEM_WORKSPACE] * MIB);
    fprintf(f, "| **total** | **%.1f** | **%.1f** | %+.1f %% |\n\n", pe->peak * MIB, tl->peak.live * MIB,
            pe->peak ? 100.0 * (double)(tl->peak.live - pe->peak) / (double)pe->peak : 0.0);
    int *order = (int *)malloc((size_t)tl->num_tags * sizeof(int));
    if (!order) return;
    for (int i = 0; i < tl->num_tags; i++) order[i] = i;
    g_sort_values = tl->peak_tags;
    qsort(order, (size_t)tl->num_tags, sizeof(int), cmp_tags);
    fprintf(f, "live at the peak by the op (or phase) that allocated it, MiB: ");
    for (int i = 0, shown = 0; i < tl->num_tags && shown < 12; i++) {
        int t = order[i];
        if (tl->peak_tags[t] <= 0) break;
        fprintf(f, "%s%s %.1f", shown++ ? ", " : "", tsys_mem_tag_name(ctx, t), tl->peak_tags[t] * MIB);
        if (tl->peak_tag_cat_act[t] > 0) fprintf(f, " (%.1f saved)", tl->peak_tag_cat_act[t] * MIB);
    }
    fprintf(f, "\n\n");
    free(order);
}

// Each phase's peak with its breakdown by category (and what the caching allocator held free then).
static void print_phases(FILE *f, const timeline *tl) {
    static const char *const names[MAX_PHASES] = {"forward", "backward", "optimizer"};
    fprintf(f, "peak of each phase, MiB:\n\n| phase | at ms | peak |");
    for (int c = 0; c < NCAT; c++) fprintf(f, " %s |", tsys_mem_category_name((tsys_mem_category)c));
    fprintf(f, " cached |\n|---|---:|---:|");
    for (int c = 0; c <= NCAT; c++) fprintf(f, "---:|");
    fprintf(f, "\n");
    for (int p = 0; p + 1 < tl->nmarks && p < MAX_PHASES; p++) {
        const phase_peak *ph = &tl->phase[p];
        if (ph->live < 0) continue;
        fprintf(f, "| %s | %.2f | %.1f |", names[p], ph->t - tl->t0, ph->live * MIB);
        for (int c = 0; c < NCAT; c++) fprintf(f, " %.1f |", ph->cat[c] * MIB);
        fprintf(f, " %.1f |\n", ph->cached * MIB);
    }
    fprintf(f, "\n");
}

// The reports replace their files whole (tsys_atomic_file): a failed or concurrent run never leaves
// half a file, and nothing already at the path (a symlink, say) is written through. A failure is
// also recorded in ctx, naming the path.
static bool write_json(const char *path, tsys_ctx *ctx, const timeline *tl, const char *title, const char *oom) {
    tsys_atomic_file af;
    if (tsys_atomic_file_open(ctx, "--out", path, &af) != TSYS_OK) return false;
    FILE *f = af.f;
    fprintf(f, "{\"title\": \"%s\", \"unit\": {\"time\": \"ms\", \"memory\": \"bytes\"},\n \"categories\": [", title);
    for (int c = 0; c < NCAT; c++) fprintf(f, "%s\"%s\"", c ? ", " : "", tsys_mem_category_name((tsys_mem_category)c));
    fprintf(f, "],\n \"start\": [");
    for (int c = 0; c < NCAT; c++) fprintf(f, "%s%lld", c ? ", " : "", (long long)tl->start_cat[c]);
    fprintf(f, "],\n \"phases\": [");
    static const char *const names[MAX_PHASES] = {"forward", "backward", "optimizer"};
    for (int p = 0; p + 1 < tl->nmarks; p++)
        fprintf(f, "%s{\"name\": \"%s\", \"t0\": %.3f, \"t1\": %.3f, \"peak\": %lld}", p ? ", " : "", names[p], tl->mark[p] - tl->t0, tl->mark[p + 1] - tl->t0,
                (long long)tl->phase[p].live);
    fprintf(f, "],\n \"peak\": {\"t\": %.3f, \"bytes\": %lld, \"by_category\": [", tl->peak.t - tl->t0, (long long)tl->peak.live);
    for (int c = 0; c < NCAT; c++) fprintf(f, "%s%lld", c ? ", " : "", (long long)tl->peak.cat[c]);
    fprintf(f, "]},\n \"oom\": ");
    if (oom) { fprintf(f, "\""); for (const char *s = oom; *s; s++) { if (*s == '"' || *s == '\\') fputc('\\', f); if ((unsigned char)*s >= 0x20) fputc(*s, f); } fprintf(f, "\""); }
    else fprintf(f, "null");
    fprintf(f, ",\n \"tags\": [");
    for (int t = 0; t < tl->num_tags; t++) fprintf(f, "%s\"%s\"", t ? ", " : "", tsys_mem_tag_name(ctx, t));
    // dtype and shape: the tensor an allocation was made for (null for frees, moves and memory no tensor owns)
    fprintf(f, "],\n \"columns\": [\"t\", \"delta\", \"live\", \"cached\", \"category\", \"tag\", \"id\", \"action\", \"dtype\", \"shape\"],\n \"events\": [");
    size_t k = 0;
    for (size_t i = 0; i < tl->n; i++) {
        const tsys_mem_event *e = &tl->ev[i];
        if (e->device != tl->dev) continue;
        fprintf(f, "%s\n  [%.3f, %lld, %lld, %lld, %d, %d, %llu, %d, ", k++ ? "," : "", e->t_us * 1e-3 - tl->t0, (long long)e->delta, (long long)e->live,
                (long long)e->cached, (int)e->category, e->tag, (unsigned long long)e->id, (int)e->action);
        if (e->ndim < 0) { fprintf(f, "null, null]"); continue; }
        fprintf(f, "\"%s\", [", tsys_dtype_name(e->dtype));
        for (int d = 0; d < e->ndim; d++) fprintf(f, d ? ", %lld" : "%lld", (long long)e->shape[d]);
        fprintf(f, "]]");
    }
    fprintf(f, "\n]}\n");
    return tsys_atomic_file_commit(ctx, &af) == TSYS_OK;
}

// Ticks at 1, 2 or 5 times a power of ten, about n of them over [0, hi].
static double nice_step(double hi, int n) {
    double raw = hi / n, p = pow(10.0, floor(log10(raw > 0 ? raw : 1)));
    return raw <= p ? p : raw <= 2 * p ? 2 * p : raw <= 5 * p ? 5 * p : 10 * p;
}

// The timeline as an SVG plot: live bytes stacked by category over time (each pixel column shows the
// state at its highest point, so no peak is lost), the reserved line, phases shaded, the peak marked,
// the out-of-memory point if the step hit one.
#define SVG_W 960
#define SVG_H 440
#define PL 70
#define PR 190
#define PT 40
#define PB 50
static bool write_svg(const char *path, tsys_ctx *ctx, const timeline *tl, const char *title, const char *oom) {
    static const char *const colors[NCAT] = {"#2e7d32", "#8e44ad", "#f1c40f", "#d35400", "#3498db", "#7f8c8d"};
    static const int stack_order[NCAT] = {TSYS_MEM_PARAMETERS, TSYS_MEM_OPTIMIZER, TSYS_MEM_GRADIENTS, TSYS_MEM_ACTIVATIONS, TSYS_MEM_TEMPORARY, TSYS_MEM_WORKSPACE};
    enum { COLS = SVG_W - PL - PR };
    static int64_t col_cat[COLS][NCAT], col_res[COLS];
    double span = tl->t1 - tl->t0 > 1e-6 ? tl->t1 - tl->t0 : 1e-6;
    int64_t top_bytes = tl->max_reserved > tl->peak.live ? tl->max_reserved : tl->peak.live;
    bool in_gib = top_bytes >= (1ll << 30);   // GiB for model-sized plots, MiB for small ones
    double gib = in_gib ? 1.0 / 1073741824.0 : MIB;
    const char *unit = in_gib ? "GiB" : "MiB";
    int64_t cat[NCAT], best[COLS];
    memcpy(cat, tl->start_cat, sizeof(cat));
    int64_t live = 0, cached = 0;
    for (int c = 0; c < NCAT; c++) live += cat[c];
    for (int x = 0; x < COLS; x++) best[x] = -1;
    size_t i = 0;
    for (int x = 0; x < COLS; x++) {   // the state at each column's highest event (or the one before)
        double t_end = tl->t0 + span * (x + 1) / COLS;
        memcpy(col_cat[x], cat, sizeof(cat)); col_res[x] = live + cached; best[x] = live;
        for (; i < tl->n && tl->ev[i].t_us * 1e-3 <= t_end; i++) {
            const tsys_mem_event *e = &tl->ev[i];
            if (e->device != tl->dev) continue;
            cat[e->category] += e->delta; live += e->delta; cached = e->cached;
            if (live > best[x]) { best[x] = live; memcpy(col_cat[x], cat, sizeof(cat)); }
            if (live + cached > col_res[x]) col_res[x] = live + cached;
        }
    }
    double ymax = (double)top_bytes * gib * 1.08;
    if (ymax <= 0) ymax = 1;
    double ystep = nice_step(ymax, 5), xstep = nice_step(span, 8);
    ymax = ceil(ymax / ystep) * ystep;
    int ph = SVG_H - PT - PB;
#define SX(t) (PL + ((t) - tl->t0) / span * COLS)
#define SY(b) (PT + ph - (double)(b) * gib / ymax * ph)
    tsys_atomic_file af;
    if (tsys_atomic_file_open(ctx, "--out", path, &af) != TSYS_OK) return false;
    FILE *f = af.f;
    fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" font-family=\"sans-serif\" font-size=\"12\">\n",
            SVG_W, SVG_H, SVG_W, SVG_H);
    fprintf(f, "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n<text x=\"%d\" y=\"22\" font-size=\"15\">", PL);
    for (const char *s = title; *s; s++) { if (*s == 0x3c) fputs("&lt;", f); else if (*s == 0x3e) fputs("&gt;", f); else if (*s == 0x26) fputs("&amp;", f); else fputc(*s, f); }
    fprintf(f, "</text>\n");
    static const char *const phase_names[MAX_PHASES] = {"forward", "backward", "optimizer"};
    for (int p = 0; p + 1 < tl->nmarks; p++) {   // phases: shaded bands, named at the top where there is room
        double x0 = SX(tl->mark[p]), w = SX(tl->mark[p + 1]) - x0;
        fprintf(f, "<g class=\"phase\"><title>%s %.2f-%.2f ms</title><rect x=\"%.1f\" y=\"%d\" width=\"%.1f\" height=\"%d\" fill=\"%s\"/>", phase_names[p],
                tl->mark[p] - tl->t0, tl->mark[p + 1] - tl->t0, x0, PT, w, ph, p % 2 ? "#ececec" : "#f7f7f7");
        if (w > 8.0 * (double)strlen(phase_names[p])) fprintf(f, "<text x=\"%.1f\" y=\"%d\" fill=\"#555\">%s</text>", x0 + 4, PT + 14, phase_names[p]);
        fprintf(f, "</g>\n");
    }
    for (double y = 0; y <= ymax + 1e-9; y += ystep)   // grid under the areas
        fprintf(f, "<line x1=\"%d\" x2=\"%d\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n", PL, PL + COLS, SY(y / gib), SY(y / gib));
    for (int k = NCAT - 1; k >= 0; k--) {   // stacked areas, drawn top layer first so each covers the ones above it... by cumulative height
        int c = stack_order[k];
        fprintf(f, "<path class=\"series\" data-category=\"%s\" fill=\"%s\" fill-opacity=\"0.85\" d=\"M%d %.1f", tsys_mem_category_name((tsys_mem_category)c), colors[c], PL, SY(0));
        for (int x = 0; x < COLS; x++) {
            int64_t top = 0;
            for (int j = 0; j <= k; j++) top += col_cat[x][stack_order[j]];
            fprintf(f, " L%d %.1f L%d %.1f", PL + x, SY(top), PL + x + 1, SY(top));
        }
        fprintf(f, " L%d %.1f Z\"/>\n", PL + COLS, SY(0));
    }
    fprintf(f, "<path class=\"series\" data-category=\"reserved\" fill=\"none\" stroke=\"#222\" stroke-dasharray=\"4 3\" d=\"M%d %.1f", PL, SY(col_res[0]));
    for (int x = 0; x < COLS; x++) fprintf(f, " L%d %.1f L%d %.1f", PL + x, SY(col_res[x]), PL + x + 1, SY(col_res[x]));
    fprintf(f, "\"/>\n");
    // axes and ticks
    fprintf(f, "<g stroke=\"#333\"><line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\"/><line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\"/></g>\n", PL, PT, PL, PT + ph, PL, PT + ph, PL + COLS, PT + ph);
    for (double y = 0; y <= ymax + 1e-9; y += ystep)
        fprintf(f, "<g class=\"ytick\"><line x1=\"%d\" x2=\"%d\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#333\"/><text x=\"%d\" y=\"%.1f\" text-anchor=\"end\">%g</text></g>\n",
                PL - 5, PL, SY(y / gib), SY(y / gib), PL - 8, SY(y / gib) + 4, y);
    for (double t = 0; t <= span + 1e-9; t += xstep)
        fprintf(f, "<g class=\"xtick\"><line x1=\"%.1f\" x2=\"%.1f\" y1=\"%d\" y2=\"%d\" stroke=\"#333\"/><text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">%g</text></g>\n",
                SX(tl->t0 + t), SX(tl->t0 + t), PT + ph, PT + ph + 5, SX(tl->t0 + t), PT + ph + 18, t);
    fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\">time (ms, host clock)</text>\n", PL + COLS / 2, SVG_H - 10);
    fprintf(f, "<text transform=\"translate(18 %d) rotate(-90)\" text-anchor=\"middle\">memory (%s)</text>\n", PT + ph / 2, unit);
    // the peak, its label inside the plot: left of the mark where it would run into the legend
    char label[96];
    int llen = snprintf(label, sizeof(label), "peak %.2f %s at %.1f ms", tl->peak.live * gib, unit, tl->peak.t - tl->t0);
    double px = SX(tl->peak.t), lw = 7.0 * llen;   // 12px sans-serif: at most about 7px a character
    bool left = px + 6 + lw > PL + COLS && px - 6 - lw >= PL;
    fprintf(f, "<g class=\"peak\"><circle cx=\"%.1f\" cy=\"%.1f\" r=\"4\" fill=\"none\" stroke=\"#c0392b\" stroke-width=\"2\"/>"
               "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"%s\" fill=\"#c0392b\">%s</text></g>\n",
            px, SY(tl->peak.live), left ? px - 6 : px + 6, SY(tl->peak.live) - 6 < PT + 12 ? PT + 28.0 : SY(tl->peak.live) - 6, left ? "end" : "start", label);
    if (oom) fprintf(f, "<g class=\"oom\"><line x1=\"%.1f\" x2=\"%.1f\" y1=\"%d\" y2=\"%d\" stroke=\"#c0392b\" stroke-width=\"2\"/><text x=\"%.1f\" y=\"%d\" fill=\"#c0392b\">out of memory here</text></g>\n",
                     SX(tl->t1), SX(tl->t1), PT, PT + ph, SX(tl->t1) - 4, PT + ph - 6);
    // legend, top layer first
    int ly = PT + 4;
    for (int k = NCAT - 1; k >= 0; k--, ly += 20) {
        int c = stack_order[k];
        fprintf(f, "<g class=\"legend\"><rect x=\"%d\" y=\"%d\" width=\"14\" height=\"14\" fill=\"%s\"/><text x=\"%d\" y=\"%d\">%s %.2f %s</text></g>\n", PL + COLS + 16, ly,
                colors[c], PL + COLS + 36, ly + 11, tsys_mem_category_name((tsys_mem_category)c), tl->peak.cat[c] * gib, unit);
    }
    fprintf(f, "<g class=\"legend\"><line x1=\"%d\" x2=\"%d\" y1=\"%d\" y2=\"%d\" stroke=\"#222\" stroke-dasharray=\"4 3\"/><text x=\"%d\" y=\"%d\">reserved (live + cached)</text></g>\n",
            PL + COLS + 16, PL + COLS + 30, ly + 7, ly + 7, PL + COLS + 36, ly + 11);
    fprintf(f, "<text x=\"%d\" y=\"%d\" fill=\"#555\">at the peak, by category</text>\n", PL + COLS + 16, ly + 34);
    fprintf(f, "</svg>\n");
#undef SX
#undef SY
    return tsys_atomic_file_commit(ctx, &af) == TSYS_OK;
}

// ---- the memory_viz snapshot ----------------------------------------------------------------------
//
// With --out, DIR/<configuration>.pickle is the step as torch.cuda.memory._snapshot() would describe
// it, for pytorch.org/memory_viz and python -m torch.cuda._memory_viz (trace_plot, segment_plot, stats):
//   {'segments': [{'device', 'address', 'total_size', 'allocated_size', 'active_size', 'requested_size',
//                  'stream', 'segment_type', 'is_expandable', 'frames',
//                  'blocks': [{'address', 'size', 'requested_size', 'state', 'frames'}]}],
//    'device_traces': [[{'action', 'addr', 'size', 'stream', 'time_us', 'frames'}]]}
// Each allocation is its own segment (a caching allocator that never caches, expandable_segments off):
// segment_alloc + alloc when it is made, free_requested + free_completed + segment_free when it goes.
// The trace opens with what was live when the step began (the parameters, the optimizer state...), so
// replaying it alone gives the tracker's peak, and the segments are what is live at its end.
// Addresses are virtual: the tracker's events carry no pointer (and on the CPU there is no device
// address space to speak of), so each live allocation gets one first-fit over the live set, aligned to
// 512 bytes as the CUDA caching allocator's blocks are; live ones never overlap and a freed range is
// used again, as a real allocator would. Sizes are the tracker's bytes, exact.
// Frames, innermost first (memory_viz prints them as filename:line:name): the category and the op that
// allocated with the tensor's shape and dtype ("temporaries:0:linear [2, 32, 128] f32"), then the
// scopes open at the time: ops and backward ops, the model's regions ("layers.3"), and the phase.

// A pickle, protocol 2, with only the opcodes both Python's unpickler and memory_viz's own read.
static void pk_u32(FILE *f, uint32_t v) { for (int i = 0; i < 4; i++) fputc((int)(v >> (8 * i)) & 0xff, f); }
static void pk_int(FILE *f, int64_t v) {
    if (v >= INT32_MIN && v <= INT32_MAX) { fputc('J', f); pk_u32(f, (uint32_t)(int32_t)v); return; }   // BININT
    fputc(0x8a, f); fputc(8, f);   // LONG1, 8 bytes little-endian two's complement
    for (int i = 0; i < 8; i++) fputc((int)((uint64_t)v >> (8 * i)) & 0xff, f);
}
static void pk_str(FILE *f, const char *s, size_t n) { fputc('X', f); pk_u32(f, (uint32_t)n); fwrite(s, 1, n, f); }   // BINUNICODE
static void pk_key(FILE *f, const char *s) { pk_str(f, s, strlen(s)); }
static void pk_begin_dict(FILE *f) { fputc('}', f); fputc('(', f); }   // EMPTY_DICT MARK ... SETITEMS
static void pk_begin_list(FILE *f) { fputc(']', f); fputc('(', f); }   // EMPTY_LIST MARK ... APPENDS
static void pk_end_dict(FILE *f) { fputc('u', f); }
static void pk_end_list(FILE *f) { fputc('e', f); }

#define MV_DEPTH 32
#define MV_BASE 0x7f0000000000ll   // where the virtual addresses start
#define MV_ALIGN 512

typedef struct mv_live { uint64_t id; int64_t addr, bytes; int frames; } mv_live;
typedef struct mv_entry { bool alloc; int64_t addr, bytes; int frames; double t_us; } mv_entry;

typedef struct memviz {
    tsys_device dev;                          // the device whose allocations it follows
    const char *scope[MV_DEPTH]; tsys_trace_kind kind[MV_DEPTH]; int depth;   // open scopes (trace hooks)
    mv_live *live; size_t nlive, cap_live;    // sorted by address
    mv_entry *tr; size_t ntr, cap_tr;         // the window: allocations and frees
    char **keys; int nkeys; size_t cap_keys;  // frame stacks, interned (each the text of its frames)
    int *slot; int nslots;                    // hash table over keys
    bool broken;                              // out of host memory: no snapshot
    long unmatched;                           // frees of allocations it never saw
} memviz;

static void *mv_grow(memviz *mv, void *p, size_t *cap, size_t need, size_t size) {
    if (need <= *cap) return p;
    size_t c = *cap ? *cap * 2 : 256;
    while (c < need) c *= 2;
    void *q = realloc(p, c * size);
    if (!q) { mv->broken = true; return p; }
    *cap = c;
    return q;
}

static uint32_t mv_hash(const char *s) { uint32_t h = 2166136261u; for (; *s; s++) h = (h ^ (unsigned char)*s) * 16777619u; return h; }

static int mv_intern(memviz *mv, const char *key) {
    if (mv->nkeys * 2 >= mv->nslots) {   // keep the table at most half full
        int n = mv->nslots ? mv->nslots * 2 : 1024, *s = (int *)malloc((size_t)n * sizeof(int));
        if (!s) { mv->broken = true; return 0; }
        for (int i = 0; i < n; i++) s[i] = -1;
        for (int k = 0; k < mv->nkeys; k++) {
            uint32_t h = mv_hash(mv->keys[k]) & (uint32_t)(n - 1);
            while (s[h] >= 0) h = (h + 1) & (uint32_t)(n - 1);
            s[h] = k;
        }
        free(mv->slot); mv->slot = s; mv->nslots = n;
    }
    uint32_t h = mv_hash(key) & (uint32_t)(mv->nslots - 1);
    for (; mv->slot[h] >= 0; h = (h + 1) & (uint32_t)(mv->nslots - 1))
        if (!strcmp(mv->keys[mv->slot[h]], key)) return mv->slot[h];
    mv->keys = (char **)mv_grow(mv, mv->keys, &mv->cap_keys, (size_t)mv->nkeys + 1, sizeof(char *));
    char *k = mv->broken ? NULL : strdup(key);
    if (!k) { mv->broken = true; return 0; }
    mv->keys[mv->nkeys] = k;
    mv->slot[h] = mv->nkeys;
    return mv->nkeys++;
}

static void mv_on_begin(tsys_ctx *ctx, const char *name, tsys_trace_kind kind, void *user) {
    (void)ctx;
    memviz *mv = (memviz *)user;
    if (mv->depth < MV_DEPTH) { mv->scope[mv->depth] = name; mv->kind[mv->depth] = kind; }
    mv->depth++;
}
static void mv_on_end(tsys_ctx *ctx, const char *name, tsys_trace_kind kind, void *user) {
    (void)ctx; (void)name; (void)kind;
    memviz *mv = (memviz *)user;
    if (mv->depth > 0) mv->depth--;
}

// The frames of an allocation, as text: a "filename\tname" line each, innermost first.
static int mv_frames(memviz *mv, tsys_ctx *ctx, const tsys_mem_event *e) {
    char key[2048];
    const char *tag = tsys_mem_tag_name(ctx, e->tag);
    size_t o = (size_t)snprintf(key, sizeof(key), "%s\t%s", tsys_mem_category_name(e->category), tag);
    if (e->ndim >= 0) {
        o += (size_t)snprintf(key + o, sizeof(key) - o, " [");
        for (int i = 0; i < e->ndim && o < sizeof(key); i++) o += (size_t)snprintf(key + o, sizeof(key) - o, i ? ", %lld" : "%lld", (long long)e->shape[i]);
        if (o < sizeof(key)) o += (size_t)snprintf(key + o, sizeof(key) - o, "] %s", tsys_dtype_name(e->dtype));
    }
    bool phase = false;
    for (int i = (mv->depth < MV_DEPTH ? mv->depth : MV_DEPTH) - 1; i >= 0 && o < sizeof(key); i--) {
        tsys_trace_kind k = mv->kind[i];
        if (i == mv->depth - 1 && (k == TSYS_TRACE_FORWARD || k == TSYS_TRACE_BACKWARD) && !strcmp(mv->scope[i], tag)) continue;   // the op the first frame names
        phase = phase || k == TSYS_TRACE_RANGE;
        o += (size_t)snprintf(key + o, sizeof(key) - o, "\n%s\t%s", k == TSYS_TRACE_FORWARD ? "op" : k == TSYS_TRACE_BACKWARD ? "backward op" :
                              k == TSYS_TRACE_RANGE ? "phase" : "region", mv->scope[i]);
    }
    if (!phase && o < sizeof(key)) snprintf(key + o, sizeof(key) - o, "\nphase\tsetup");   // before the step: the model, its inputs
    return mv_intern(mv, key);
}

static void mv_push(memviz *mv, bool alloc, const mv_live *b, double t_us) {
    mv->tr = (mv_entry *)mv_grow(mv, mv->tr, &mv->cap_tr, mv->ntr + 1, sizeof(mv_entry));
    if (mv->broken) return;
    mv_entry *x = &mv->tr[mv->ntr++];
    x->alloc = alloc; x->addr = b->addr; x->bytes = b->bytes; x->frames = b->frames; x->t_us = t_us;
}

static void mv_on_mem(tsys_ctx *ctx, const tsys_mem_event *e, void *user) {
    memviz *mv = (memviz *)user;
    if (e->device != mv->dev || e->action == TSYS_MEM_EV_MOVE || mv->broken) return;
    if (e->action == TSYS_MEM_EV_ALLOC) {   // first fit over the live set (sorted by address)
        int64_t addr = MV_BASE;
        size_t i = 0;
        for (; i < mv->nlive && mv->live[i].addr < addr + e->delta; i++) {
            int64_t end = mv->live[i].addr + mv->live[i].bytes;
            end = (end + MV_ALIGN - 1) / MV_ALIGN * MV_ALIGN;
            if (end > addr) addr = end;
        }
        mv->live = (mv_live *)mv_grow(mv, mv->live, &mv->cap_live, mv->nlive + 1, sizeof(mv_live));
        if (mv->broken) return;
        memmove(mv->live + i + 1, mv->live + i, (mv->nlive - i) * sizeof(mv_live));
        mv_live *b = &mv->live[i];
        b->id = e->id; b->addr = addr; b->bytes = e->delta; b->frames = mv_frames(mv, ctx, e);
        mv->nlive++;
        mv_push(mv, true, b, e->t_us);
        return;
    }
    // a free: the storage's allocation; memory a backend notes itself (id 0) pairs with the latest of its size
    size_t i = mv->nlive;
    for (size_t j = mv->nlive; j-- > 0;)
        if (mv->live[j].id == e->id && (e->id || mv->live[j].bytes == -e->delta)) { i = j; break; }
    if (i == mv->nlive) { mv->unmatched++; return; }
    mv_push(mv, false, &mv->live[i], e->t_us);
    memmove(mv->live + i, mv->live + i + 1, (mv->nlive - i - 1) * sizeof(mv_live));
    mv->nlive--;
}

// The window opens: the trace starts again with what is live now.
static void mv_window_begin(memviz *mv, tsys_ctx *ctx) {
    mv->ntr = 0;
    double t = tsys_ctx_time_us(ctx);
    for (size_t i = 0; i < mv->nlive; i++) mv_push(mv, true, &mv->live[i], t);
}

static void mv_free(memviz *mv) {
    for (int k = 0; k < mv->nkeys; k++) free(mv->keys[k]);
    free(mv->keys); free(mv->slot); free(mv->live); free(mv->tr);
    memset(mv, 0, sizeof(*mv));
}

// A frames list: written once, then fetched from the pickle's memo (LONG_BINPUT / LONG_BINGET).
static void pk_frames(FILE *f, const memviz *mv, int k, int32_t *memo, uint32_t *next_memo) {
    if (memo[k] >= 0) { fputc('j', f); pk_u32(f, (uint32_t)memo[k]); return; }
    fputc(']', f);
    fputc('r', f); pk_u32(f, *next_memo); memo[k] = (int32_t)(*next_memo)++;
    fputc('(', f);
    for (const char *s = mv->keys[k]; *s;) {
        const char *tab = strchr(s, '\t'), *nl = strchr(tab, '\n');
        size_t end = nl ? (size_t)(nl - tab - 1) : strlen(tab + 1);
        pk_begin_dict(f);
        pk_key(f, "filename"); pk_str(f, s, (size_t)(tab - s));
        pk_key(f, "line"); pk_int(f, 0);
        pk_key(f, "name"); pk_str(f, tab + 1, end);
        pk_end_dict(f);
        s = nl ? nl + 1 : tab + 1 + end;
    }
    pk_end_list(f);
}

static void pk_event(FILE *f, const char *action, const mv_entry *x, const memviz *mv, int32_t *memo, uint32_t *next_memo) {
    pk_begin_dict(f);
    pk_key(f, "action"); pk_key(f, action);
    pk_key(f, "addr"); pk_int(f, x->addr);
    pk_key(f, "size"); pk_int(f, x->bytes);
    pk_key(f, "stream"); pk_int(f, 0);
    pk_key(f, "time_us"); pk_int(f, (int64_t)x->t_us);
    pk_key(f, "frames"); pk_frames(f, mv, x->frames, memo, next_memo);
    pk_end_dict(f);
}

static bool write_pickle(const char *path, tsys_ctx *ctx, const memviz *mv) {
    if (mv->broken) { tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "--out: out of host memory for the memory_viz snapshot of %s", path); return false; }
    int32_t *memo = (int32_t *)malloc(((size_t)mv->nkeys + 1) * sizeof(int32_t));
    if (!memo) { tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "--out: out of host memory writing %s", path); return false; }
    for (int k = 0; k < mv->nkeys; k++) memo[k] = -1;
    uint32_t next_memo = 0;
    tsys_atomic_file af;
    if (tsys_atomic_file_open(ctx, "--out", path, &af) != TSYS_OK) { free(memo); return false; }
    FILE *f = af.f;
    fputc(0x80, f); fputc(2, f);   // PROTO 2
    pk_begin_dict(f);
    pk_key(f, "segments");
    pk_begin_list(f);
    for (size_t i = 0; i < mv->nlive; i++) {   // what is live at the end, a segment each
        const mv_live *b = &mv->live[i];
        pk_begin_dict(f);
        pk_key(f, "device"); pk_int(f, 0);
        pk_key(f, "address"); pk_int(f, b->addr);
        pk_key(f, "total_size"); pk_int(f, b->bytes);
        pk_key(f, "allocated_size"); pk_int(f, b->bytes);
        pk_key(f, "active_size"); pk_int(f, b->bytes);
        pk_key(f, "requested_size"); pk_int(f, b->bytes);
        pk_key(f, "stream"); pk_int(f, 0);
        pk_key(f, "segment_type"); pk_key(f, "large");
        pk_key(f, "is_expandable"); fputc(0x89, f);   // NEWFALSE
        pk_key(f, "frames"); pk_frames(f, mv, b->frames, memo, &next_memo);
        pk_key(f, "blocks");
        pk_begin_list(f);
        pk_begin_dict(f);
        pk_key(f, "address"); pk_int(f, b->addr);
        pk_key(f, "size"); pk_int(f, b->bytes);
        pk_key(f, "requested_size"); pk_int(f, b->bytes);
        pk_key(f, "state"); pk_key(f, "active_allocated");
        pk_key(f, "frames"); pk_frames(f, mv, b->frames, memo, &next_memo);
        pk_end_dict(f);
        pk_end_list(f);
        pk_end_dict(f);
    }
    pk_end_list(f);
    pk_key(f, "device_traces");
    pk_begin_list(f);
    pk_begin_list(f);
    for (size_t i = 0; i < mv->ntr; i++) {
        const mv_entry *x = &mv->tr[i];
        if (x->alloc) { pk_event(f, "segment_alloc", x, mv, memo, &next_memo); pk_event(f, "alloc", x, mv, memo, &next_memo); }
        else { pk_event(f, "free_requested", x, mv, memo, &next_memo); pk_event(f, "free_completed", x, mv, memo, &next_memo); pk_event(f, "segment_free", x, mv, memo, &next_memo); }
        if (i % 1000 == 999) { pk_end_list(f); fputc('(', f); }   // APPENDS in batches, as pickle does
    }
    pk_end_list(f);
    pk_end_list(f);
    pk_end_dict(f);
    fputc('.', f);   // STOP
    free(memo);
    return tsys_atomic_file_commit(ctx, &af) == TSYS_OK;
}

// ---- one configuration ----------------------------------------------------------------------------

typedef struct config { const char *model; int T; du_mode mode; tsys_dtype dt; const char *attn; tsys_model_desc d; } config;

static void config_name(const config *c, tsys_device dev, char *buf, size_t len) {
    snprintf(buf, len, "%s_%s_ctx%d_%s_%s_%s", dev == TSYS_CPU ? "cpu" : "cuda", c->model, c->T, du_mode_names[c->mode], du_dtype_flag(c->dt), c->attn);
}

// Opens the recorded window: the state by category and by tag when it starts, the clock.
static bool timeline_open(timeline *tl, tsys_ctx *ctx, tsys_device dev) {
    memset(tl, 0, sizeof(*tl));
    tl->dev = dev;
    tl->num_tags = tsys_mem_num_tags(ctx) + 64;   // ops met for the first time in the window add tags
    tl->start_tags = (int64_t *)calloc((size_t)tl->num_tags, sizeof(int64_t));
    if (!tl->start_tags) return false;
    for (int t = 0; t < tsys_mem_num_tags(ctx); t++) tl->start_tags[t] = tsys_mem_tag_bytes(ctx, t, dev);
    tsys_mem_stats s = tsys_mem_stats_get(ctx, dev);
    memcpy(tl->start_cat, s.category_bytes, sizeof(tl->start_cat));
    tsys_mem_clear_events(ctx);
    tsys_mem_record_events(ctx, true);
    tl->t0 = tsys_ctx_time_us(ctx) * 1e-3;
    return true;
}

static bool timeline_close(timeline *tl, tsys_ctx *ctx, const run *r) {
    tsys_mem_record_events(ctx, false);
    tl->ev = tsys_mem_events(ctx, &tl->n);
    tl->nmarks = r->nmarks;
    memcpy(tl->mark, r->mark, sizeof(tl->mark));
    if (tl->nmarks == 0) { tl->mark[0] = tl->t0; tl->nmarks = 1; }
    // the window ends at the step's last mark or event, not after the final sync (the device
    // finishing its queue allocates nothing and would stretch the plot)
    tl->t1 = tl->mark[tl->nmarks - 1];
    if (tl->n && tl->ev[tl->n - 1].t_us * 1e-3 > tl->t1) tl->t1 = tl->ev[tl->n - 1].t_us * 1e-3;
    if (tl->t1 <= tl->t0) tl->t1 = tsys_ctx_time_us(ctx) * 1e-3;
    int n = tsys_mem_num_tags(ctx);
    if (n > tl->num_tags) n = tl->num_tags;   // more new ops than room: their bytes show under no tag
    tl->num_tags = n;
    return timeline_replay(tl);
}

static void fill_row(du_row *row, const timeline *tl, const tsys_model_mem_estimate *pe, const tsys_model_desc *d, const mem_opts *o, int T, bool ok) {
    static const char *const cols[NCAT] = {"params_MiB", "grads_MiB", "optim_MiB", "activ_MiB", "temp_MiB", "workspace_MiB"};
    static const char *const phase_cols[MAX_PHASES] = {"fwd_peak_MiB", "bwd_peak_MiB", "opt_peak_MiB"};
    static const char *const phase_names[MAX_PHASES] = {"forward", "backward", "optimizer"};
    du_row_set(row, "peak_MiB", "%.1f", tl->peak.live * MIB);
    du_row_set(row, "predicted_MiB", "%.1f", pe->peak * MIB);
    if (ok) du_row_set(row, "diff", "%+.1f%%", pe->peak ? 100.0 * (double)(tl->peak.live - pe->peak) / (double)pe->peak : 0.0);
    else du_row_set(row, "diff", "-");   // the step stopped early: its peak is where it failed
    for (int c = 0; c < NCAT; c++) du_row_set(row, cols[c], "%.1f", tl->peak.cat[c] * MIB);
    du_row_set(row, "cached_MiB", "%.1f", tl->peak.cached * MIB);
    for (int p = 0; p < MAX_PHASES; p++) {
        if (p + 1 < tl->nmarks && tl->phase[p].live >= 0) du_row_set(row, phase_cols[p], "%.1f", tl->phase[p].live * MIB);
        else du_row_set(row, phase_cols[p], "-");
    }
    du_row_set(row, "peak_in", "%s", phase_names[tl->peak_phase]);
    du_row_set(row, "residual_MiB", "%.2f", (double)o->batch * T * d->d_model * 4 * MIB);
}

static void run_config(tsys_ctx *ctx, tsys_device dev, const mem_opts *o, config *c, du_table *tab) {
    char err[256] = "", name[192];
    du_row *row = du_table_row(tab);
    du_row_set(row, "device", "%s", dev == TSYS_CPU ? "cpu" : "cuda");
    du_row_set(row, "model", "%s", c->model); du_row_set(row, "context", "%d", c->T); du_row_set(row, "batch", "%d", o->batch);
    du_row_set(row, "mode", "%s", du_mode_names[c->mode]); du_row_set(row, "dtype", "%s", du_dtype_flag(c->dt)); du_row_set(row, "attn", "%s", c->attn);
    if (!du_model_desc(&o->dims, c->model, c->T, c->attn, &c->d, err, sizeof(err)) || !du_model_sizes_ok(&c->d, o->batch, c->T, err, sizeof(err))) {
        du_row_set(row, "status", "error: %s", err);
        return;
    }
    config_name(c, dev, name, sizeof(name));
    run r;
    memset(&r, 0, sizeof(r));
    r.lm.ctx = ctx; r.lm.dev = dev; r.lm.mode = c->mode; r.lm.dtype = c->dt; r.lm.mark = run_mark; r.lm.mark_user = &r;
    timeline tl;
    memset(&tl, 0, sizeof(tl));
    // Setup and the warmup step are recorded too: when they fail, that timeline shows where. When
    // they succeed (the optimizer state, the autocast copies and the caches are made), the recorded
    // window starts again with the measured step.
    du_progress("%s: setup and warmup step", name);
    bool opened = timeline_open(&tl, ctx, dev);
    if (o->mv) mv_window_begin(o->mv, ctx);
    tsys_status st = opened ? du_lm_setup(&r.lm, &c->d, o->batch, c->T, o->seed, NULL) : tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "out of host memory for the timeline");
    if (st == TSYS_OK) st = run_step(&r);
    if (st == TSYS_OK) {
        timeline_free(&tl);
        opened = timeline_open(&tl, ctx, dev);
        if (o->mv) mv_window_begin(o->mv, ctx);
        tsys_mem_reset_peak(ctx, dev);
        du_progress("%s: recorded step", name);
        st = opened ? run_step(&r) : tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "out of host memory for the timeline");
    }
    const char *oom = st == TSYS_ERR_OOM ? tsys_ctx_last_error(ctx) : NULL;
    if (opened && !timeline_close(&tl, ctx, &r) && st == TSYS_OK) st = tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "out of host memory replaying the timeline");
    du_progress_done();
    tsys_model_mem_estimate pe = tsys_model_mem_predict(&c->d, o->batch, c->T, c->dt, c->mode != DU_FORWARD, c->mode == DU_TRAIN);
    if (opened) {
        fill_row(row, &tl, &pe, &c->d, o, c->T, st == TSYS_OK);
        if (tl.mismatches) fprintf(stderr, "memory: %s: %ld timeline events where the categories do not add up to the live bytes\n", name, tl.mismatches);
        if (o->details) {
            fprintf(o->details, "### %s\n\n", name);
            print_prediction(o->details, ctx, &tl, &pe);
            print_phases(o->details, &tl);
            print_largest(o->details, ctx, &tl, o->top);
        }
        if (o->out) {
            char path[1024], title[320];
            snprintf(title, sizeof(title), "%s, context %d, batch %d, %s, %s (%s)%s", c->model, c->T, o->batch, du_mode_names[c->mode], du_dtype_flag(c->dt),
                     dev == TSYS_CPU ? "cpu" : "cuda", oom ? ": out of memory" : "");
            snprintf(path, sizeof(path), "%s/%s.json", o->out, name);
            bool ok = write_json(path, ctx, &tl, title, oom);
            snprintf(path, sizeof(path), "%s/%s.svg", o->out, name);
            ok = write_svg(path, ctx, &tl, title, oom) && ok;
            snprintf(path, sizeof(path), "%s/%s.pickle", o->out, name);
            ok = ok && write_pickle(path, ctx, o->mv);
            if (o->mv->unmatched) fprintf(stderr, "memory: %s: %ld frees of allocations the snapshot never saw\n", name, o->mv->unmatched);
            if (!ok) {   // a lost result fails the row, whatever the step did (an OOM row's plot too)
                char why[600] = "a write failed", was[600] = "";
                if (st == TSYS_OK) snprintf(why, sizeof(why), "%s", tsys_ctx_last_error(ctx));   // tsys_atomic_file's: the file and why
                else snprintf(was, sizeof(was), " (and the step: %s: %s)", st == TSYS_ERR_OOM ? "OOM" : "error", tsys_ctx_last_error(ctx));
                tsys_ctx_clear_error(ctx);
                st = tsys_ctx_set_error(ctx, TSYS_ERR_IO, "--out: cannot write %s/%s.{json,svg,pickle}: %s%s", o->out, name, why, was);
                oom = NULL;
            }
            else if (o->details) fprintf(o->details, "timeline: %s/%s.json, plot: %s/%s.svg\nmemory_viz snapshot: %s/%s.pickle (pytorch.org/memory_viz)\n\n",
                                         o->out, name, o->out, name, o->out, name);
        }
    }
    if (st == TSYS_OK) du_row_set(row, "status", "ok");
    else du_row_set(row, "status", "%s: %s", st == TSYS_ERR_OOM ? "OOM" : "error", tsys_ctx_last_error(ctx));
    timeline_free(&tl);
    tsys_tape_clear(ctx);
    du_lm_free(&r.lm);
    tsys_ctx_clear_error(ctx);
#ifdef TSYS_WITH_CUDA
    if (dev == TSYS_CUDA) tsys_cuda_empty_cache(ctx);   // the next configuration starts from an empty cache
#endif
}

static int driver_main(int argc, char **argv) {
    mem_opts o;
    int rc = parse_args(argc, argv, &o);
    if (rc == DU_HELP) { usage(stdout); return DU_EXIT_OK; }
    if (rc) return rc;
    tsys_device dev = strcmp(o.device, "cuda") ? TSYS_CPU : TSYS_CUDA;
    char lim[64];
    FILE *cfg = strcmp(o.format, "md") ? stderr : stdout;
    fprintf(cfg, "memory: device %s; model %s; context %s; batch %d; mode %s; dtype %s; attn %s; memory limit %s%s%s\n", o.device, o.models.src,
            o.contexts.src, o.batch, o.modes.src, o.dtypes.src, o.attns.src, du_mem_limit_str(lim, sizeof(lim), o.mem_limit), o.out ? "; out " : "", o.out ? o.out : "");
    if (o.dry_run) { opts_free(&o); return DU_EXIT_OK; }
    if (o.out && mkdir(o.out, 0777) != 0 && errno != EEXIST) { fprintf(stderr, "memory: --out: cannot make folder '%s': %s\n", o.out, strerror(errno)); opts_free(&o); return DU_EXIT_USAGE; }
    o.details = tmpfile();
    if (!o.details) { fprintf(stderr, "memory: no temporary file: %s\n", strerror(errno)); opts_free(&o); return DU_EXIT_FAILED; }
    tsys_ctx_desc cd;
    memset(&cd, 0, sizeof(cd));
    if (dev == TSYS_CPU) cd.cpu_memory_limit = o.mem_limit;
    tsys_ctx *ctx = tsys_ctx_new(&cd);
    if (!ctx) { fprintf(stderr, "memory: out of memory creating the context\n"); opts_free(&o); return DU_EXIT_FAILED; }
    memviz mv;   // follows every allocation on the device from the start, so the snapshot knows what is live
    memset(&mv, 0, sizeof(mv));
    mv.dev = dev;
    if (o.out) {
        tsys_trace_hooks hooks;
        memset(&hooks, 0, sizeof(hooks));
        hooks.op_begin = mv_on_begin; hooks.op_end = mv_on_end; hooks.mem = mv_on_mem; hooks.user = &mv;
        tsys_ctx_set_trace_hooks(ctx, &hooks);
        o.mv = &mv;
    }
#ifdef TSYS_WITH_CUDA
    if (dev == TSYS_CUDA) {
        if (tsys_cuda_init(ctx, 0) != TSYS_OK) { fprintf(stderr, "memory: %s\n", tsys_ctx_last_error(ctx)); tsys_ctx_free(ctx); mv_free(&mv); opts_free(&o); return DU_EXIT_FAILED; }
        if (o.mem_limit) tsys_cuda_set_memory_limit(ctx, o.mem_limit);
        fprintf(cfg, "cuda: %s\n", tsys_cuda_device_name(ctx));
    }
#endif
    if (cfg == stdout) printf("\n");
    fflush(stdout);
    du_table tab;
    du_table_init(&tab, "device,model,context,batch,mode,dtype,attn,peak_MiB,predicted_MiB,diff,params_MiB,grads_MiB,optim_MiB,activ_MiB,temp_MiB,"
                        "workspace_MiB,cached_MiB,fwd_peak_MiB,bwd_peak_MiB,opt_peak_MiB,peak_in,residual_MiB,status", o.format);
    for (int a = 0; a < o.models.n; a++)
        for (int c = 0; c < o.contexts.n; c++)
            for (int m = 0; m < o.modes.n; m++)
                for (int t = 0; t < o.dtypes.n; t++)
                    for (int at = 0; at < o.attns.n; at++) {
                        config cf;
                        memset(&cf, 0, sizeof(cf));
                        cf.model = o.models.item[a];
                        du_parse_mode(o.modes.item[m], &cf.mode); du_parse_dtype(o.dtypes.item[t], &cf.dt); du_parse_int(o.contexts.item[c], 1, 1 << 20, &cf.T);
                        cf.attn = strcmp(o.attns.item[at], "auto") ? o.attns.item[at] : (dev == TSYS_CUDA && cf.dt != TSYS_F32) ? "flash" : "naive";
                        run_config(ctx, dev, &o, &cf, &tab);
                        du_table_emit(&tab);
                    }
    rewind(o.details);   // the tables of each configuration, after the results
    char line[1024];
    fprintf(cfg, "\n");
    while (fgets(line, sizeof(line), o.details)) fputs(line, cfg);
    fclose(o.details);
    rc = du_table_exit_code(&tab, "memory", o.oom_ok);
    du_table_free(&tab);
    opts_free(&o);
    tsys_ctx_free(ctx);
    mv_free(&mv);
    return rc;
}

int main(int argc, char **argv) { return du_exit("memory", driver_main(argc, argv)); }
