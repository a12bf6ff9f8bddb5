// memory_timeline.h - the memory driver's recorded window as tables and plots: the tracker's events
// of one step replayed from the state when the window opened (the peak and its breakdown by category
// and by the op that allocated, each phase's peak, every allocation), then written as the tables
// printed after the results (the largest allocations, the prediction term by term, the phases), a
// JSON timeline and an SVG plot. Included after tsys.h and driver_util.h by drivers/memory.c.
//
//   mt_timeline tl;
//   mt_open(&tl, ctx, dev);                    // records from now; du_lm's mark = mt_mark, mark_user = &tl
//   ... the step ...
//   mt_close(&tl, ctx);                        // stops recording and replays
//   mt_print_largest(f, ctx, &tl, 8); mt_write_svg(path, ctx, &tl, title, NULL); mt_free(&tl);
#ifndef TSYS_MEMORY_TIMELINE_H
#define TSYS_MEMORY_TIMELINE_H
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MT_NCAT TSYS_MEM_CATEGORY_COUNT
#define MT_PHASES 3
#define MT_MIB (1.0 / 1048576.0)

static const char *const mt_phase_names[MT_PHASES] = {"forward", "backward", "optimizer"};

typedef struct mt_alloc {   // one allocation of the recorded window
    uint64_t id;
    int64_t bytes;
    double t_alloc, t_free;  // ms; t_free < 0: still live at the end
    int tag;
    tsys_mem_category cat;   // where it was made
    bool saved;              // the tape kept it for backward (it moved to activations)
    tsys_dtype dtype;
    int ndim;
    int64_t shape[TSYS_MAX_DIMS];
} mt_alloc;

typedef struct mt_peak { int64_t live, cat[MT_NCAT], cached; double t; } mt_peak;

typedef struct mt_timeline {
    tsys_ctx *ctx;
    const tsys_mem_event *ev;
    size_t n;
    tsys_device dev;
    int64_t start_cat[MT_NCAT];     // live bytes by category when the window opened
    int64_t *start_tags;            // live bytes by tag then (num_tags)
    int num_tags;
    double t0, t1;                  // window, ms
    double mark[4]; int nmarks;     // phase boundaries (mt_mark)
    mt_peak peak, phase[MT_PHASES];
    int peak_phase;
    int64_t *peak_tags, *peak_tag_cat_act;   // at the peak: live bytes by tag; of those, activations
    int64_t max_reserved;           // live + cached, the largest
    long mismatches;                // events where the categories do not sum to the live bytes
    mt_alloc *allocs; size_t nallocs;
} mt_timeline;

static int mt_phase_of(const mt_timeline *tl, double t) {
    for (int p = 0; p + 1 < tl->nmarks; p++) if (t < tl->mark[p + 1]) return p;
    return tl->nmarks > 1 ? tl->nmarks - 2 : 0;
}

static mt_alloc *mt_find_alloc(mt_timeline *tl, uint64_t id) {   // allocations are recorded in id order
    size_t lo = 0, hi = tl->nallocs;
    while (lo < hi) { size_t mid = (lo + hi) / 2; if (tl->allocs[mid].id < id) lo = mid + 1; else hi = mid; }
    return lo < tl->nallocs && tl->allocs[lo].id == id ? &tl->allocs[lo] : NULL;
}

static void mt_note_alloc(mt_timeline *tl, const tsys_mem_event *e) {
    // a storage resized back from 0 (FSDP's gathered weights) allocates again under its old id: the
    // record (if it was made in the window) lives again; the array stays sorted by id
    if (e->action == TSYS_MEM_EV_ALLOC && e->id && tl->nallocs && e->id <= tl->allocs[tl->nallocs - 1].id) {
        mt_alloc *a = mt_find_alloc(tl, e->id);
        if (a) a->t_free = -1;
        return;
    }
    if (e->action == TSYS_MEM_EV_ALLOC && e->id) {
        mt_alloc *a = &tl->allocs[tl->nallocs++];
        memset(a, 0, sizeof(*a));
        a->id = e->id; a->bytes = e->delta; a->t_alloc = e->t_us * 1e-3; a->t_free = -1; a->tag = e->tag; a->cat = e->category;
        a->dtype = e->dtype; a->ndim = e->ndim;
        memcpy(a->shape, e->shape, sizeof(a->shape));
        return;
    }
    mt_alloc *a = e->id ? mt_find_alloc(tl, e->id) : NULL;
    if (!a) return;
    if (e->action == TSYS_MEM_EV_FREE) a->t_free = e->t_us * 1e-3;
    else if (e->action == TSYS_MEM_EV_MOVE && e->delta > 0 && e->category == TSYS_MEM_ACTIVATIONS) a->saved = true;
}

// Replays the window's events from the state when it opened: the peak and its breakdown (by category
// and by the op that allocated), each phase's peak, the allocations. False when out of host memory.
static bool mt_replay(mt_timeline *tl) {
    int64_t cat[MT_NCAT], *tags = (int64_t *)calloc((size_t)tl->num_tags, sizeof(int64_t));
    int64_t *act = (int64_t *)calloc((size_t)tl->num_tags, sizeof(int64_t));
    tl->peak_tags = (int64_t *)calloc((size_t)tl->num_tags, sizeof(int64_t));
    tl->peak_tag_cat_act = (int64_t *)calloc((size_t)tl->num_tags, sizeof(int64_t));
    tl->allocs = (mt_alloc *)malloc((tl->n + 1) * sizeof(mt_alloc));
    if (!tags || !act || !tl->peak_tags || !tl->peak_tag_cat_act || !tl->allocs) { free(tags); free(act); return false; }
    memcpy(cat, tl->start_cat, sizeof(cat));
    memcpy(tags, tl->start_tags, (size_t)tl->num_tags * sizeof(int64_t));
    int64_t live = 0;
    for (int c = 0; c < MT_NCAT; c++) live += cat[c];
    tl->peak.live = -1;
    for (int p = 0; p < MT_PHASES; p++) tl->phase[p].live = -1;
    for (size_t i = 0; i < tl->n; i++) {
        const tsys_mem_event *e = &tl->ev[i];
        if (e->device != tl->dev) continue;
        cat[e->category] += e->delta; live += e->delta;
        if (e->tag >= 0 && e->tag < tl->num_tags) {
            tags[e->tag] += e->delta;
            if (e->category == TSYS_MEM_ACTIVATIONS) act[e->tag] += e->delta;
        }
        tl->mismatches += live != e->live;
        mt_note_alloc(tl, e);
        if (live + e->cached > tl->max_reserved) tl->max_reserved = live + e->cached;
        mt_peak now;
        now.live = live; now.cached = e->cached; now.t = e->t_us * 1e-3;
        memcpy(now.cat, cat, sizeof(cat));
        int p = mt_phase_of(tl, now.t);
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

static void mt_free(mt_timeline *tl) {
    free(tl->start_tags); free(tl->peak_tags); free(tl->peak_tag_cat_act); free(tl->allocs);
    memset(tl, 0, sizeof(*tl));
}

// Opens the recorded window: the state by category and by tag when it starts, the clock.
static bool mt_open(mt_timeline *tl, tsys_ctx *ctx, tsys_device dev) {
    memset(tl, 0, sizeof(*tl));
    tl->ctx = ctx; tl->dev = dev;
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

// A du_lm mark callback (user: the timeline): the phase boundaries on the timeline's clock. They are
// host times, the clock of the allocations: on CUDA the host issues the work and allocates as it goes,
// which is what the caching allocator (and PyTorch's memory snapshot) sees.
static void mt_mark(void *user, int boundary) {
    mt_timeline *tl = (mt_timeline *)user;
    if (boundary < 0 || boundary >= 4) return;
    tl->mark[boundary] = tsys_ctx_time_us(tl->ctx) * 1e-3;
    tl->nmarks = boundary + 1;
}

// Closes the window and replays it (mt_replay); false when out of host memory.
static bool mt_close(mt_timeline *tl, tsys_ctx *ctx) {
    tsys_mem_record_events(ctx, false);
    tl->ev = tsys_mem_events(ctx, &tl->n);
    if (tl->nmarks == 0) { tl->mark[0] = tl->t0; tl->nmarks = 1; }
    // the window ends at the step's last mark or event, not after the final sync (the device
    // finishing its queue allocates nothing and would stretch the plot)
    tl->t1 = tl->mark[tl->nmarks - 1];
    if (tl->n && tl->ev[tl->n - 1].t_us * 1e-3 > tl->t1) tl->t1 = tl->ev[tl->n - 1].t_us * 1e-3;
    if (tl->t1 <= tl->t0) tl->t1 = tsys_ctx_time_us(ctx) * 1e-3;
    int n = tsys_mem_num_tags(ctx);
    if (n > tl->num_tags) n = tl->num_tags;   // more new ops than room: their bytes show under no tag
    tl->num_tags = n;
    return mt_replay(tl);
}

// ---- writers: the largest allocations, the prediction, JSON, SVG ------------------------------------

static void mt_shape_str(const mt_alloc *a, char *buf, size_t len) {
    if (a->ndim < 0) { snprintf(buf, len, "-"); return; }
    size_t o = (size_t)snprintf(buf, len, "(");
    for (int i = 0; i < a->ndim && o < len; i++) o += (size_t)snprintf(buf + o, len - o, i ? ", %lld" : "%lld", (long long)a->shape[i]);
    if (o < len) snprintf(buf + o, len - o, ")");
}

static bool mt_same_group(const mt_alloc *a, const mt_alloc *b) {
    if (a->bytes != b->bytes || a->tag != b->tag || a->dtype != b->dtype || a->ndim != b->ndim) return false;
    if (a->saved != b->saved || a->cat != b->cat) return false;
    for (int i = 0; i < a->ndim; i++) if (a->shape[i] != b->shape[i]) return false;
    return true;
}

static int mt_by_size_then_time(const void *x, const void *y) {
    const mt_alloc *a = (const mt_alloc *)x, *b = (const mt_alloc *)y;
    if (a->bytes != b->bytes) return a->bytes < b->bytes ? 1 : -1;
    if (a->tag != b->tag) return a->tag < b->tag ? -1 : 1;
    return a->t_alloc < b->t_alloc ? -1 : a->t_alloc > b->t_alloc;
}

// The largest allocations of the window, identical ones (same op, shape, dtype, category) as one row
// with their count: "32 x (4, 32, 512, 512) f32 softmax, saved for backward".
static void mt_print_largest(FILE *f, tsys_ctx *ctx, mt_timeline *tl, int top) {
    qsort(tl->allocs, tl->nallocs, sizeof(mt_alloc), mt_by_size_then_time);
    fprintf(f, "largest allocations of the step (identical ones grouped):\n\n");
    fprintf(f, "| MiB each | count | MiB total | shape | dtype | made by | category | first at (ms, phase) | lives (ms, mean) |\n");
    fprintf(f, "|---:|---:|---:|---|---|---|---|---|---:|\n");
    int rows = 0;
    for (size_t i = 0; i < tl->nallocs && rows < top; rows++) {
        size_t j = i;
        double life = 0;
        while (j < tl->nallocs && mt_same_group(&tl->allocs[i], &tl->allocs[j])) {
            const mt_alloc *a = &tl->allocs[j++];
            life += (a->t_free >= 0 ? a->t_free : tl->t1) - a->t_alloc;
        }
        const mt_alloc *a = &tl->allocs[i];
        char shape[96];
        mt_shape_str(a, shape, sizeof(shape));
        const char *cat = a->saved ? "activations (saved for backward)" : tsys_mem_category_name(a->cat);
        fprintf(f, "| %.2f | %zu | %.1f | %s | %s | %s | %s | %.2f %s | %.2f%s |\n", a->bytes * MT_MIB, j - i,
                a->bytes * MT_MIB * (double)(j - i), shape,
                a->ndim < 0 ? "-" : tsys_dtype_name(a->dtype), tsys_mem_tag_name(ctx, a->tag), cat, a->t_alloc - tl->t0,
                mt_phase_names[mt_phase_of(tl, a->t_alloc)], life / (double)(j - i), a->t_free < 0 && j - i == 1 ? " (live at the end)" : "");
        i = j;
    }
    fprintf(f, "\n");
}

static int mt_by_bytes_desc(const void *x, const void *y, const int64_t *v) {
    int a = *(const int *)x, b = *(const int *)y;
    return v[a] < v[b] ? 1 : v[a] > v[b] ? -1 : a - b;
}
static const int64_t *mt_sort_values;
static int mt_cmp_tags(const void *x, const void *y) { return mt_by_bytes_desc(x, y, mt_sort_values); }

// The prediction, term by term, beside what the tracker measured at the peak; then the ops whose
// saved tensors make up the measured activations (where a difference comes from).
static void mt_print_prediction(FILE *f, tsys_ctx *ctx, const mt_timeline *tl, const tsys_model_mem_estimate *pe) {
    const int64_t *m = tl->peak.cat;
    fprintf(f, "predicted (from the model's shapes) vs measured at the peak, MiB:\n\n| term | predicted | measured | what |\n|---|---:|---:|---|\n");
    fprintf(f, "| parameters | %.1f | %.1f | fp32 master weights |\n", pe->params * MT_MIB, m[TSYS_MEM_PARAMETERS] * MT_MIB);
    fprintf(f, "| gradients | %.1f | %.1f | fp32, one per parameter, made by the first backward |\n", pe->grads * MT_MIB,
            m[TSYS_MEM_GRADIENTS] * MT_MIB);
    fprintf(f, "| optimizer state | %.1f | %.1f | AdamW m and v |\n", pe->optimizer * MT_MIB, m[TSYS_MEM_OPTIMIZER] * MT_MIB);
    fprintf(f, "| activations | %.1f | %.1f | saved for backward: %.1f per layer x %d + %.1f outside the layers |\n", pe->activations * MT_MIB,
            m[TSYS_MEM_ACTIVATIONS] * MT_MIB, pe->saved_per_layer * MT_MIB, pe->num_layers, pe->saved_outside * MT_MIB);
    fprintf(f, "| temporaries | %.1f | %.1f | %s |\n", pe->temporaries * MT_MIB, m[TSYS_MEM_TEMPORARY] * MT_MIB, pe->temporaries_what);
    fprintf(f, "| workspace | %.1f | %.1f | library workspace, kernel scratch (measured only: the prediction leaves it out) |\n", 0.0,
            m[TSYS_MEM_WORKSPACE] * MT_MIB);
    fprintf(f, "| **total** | **%.1f** | **%.1f** | %+.1f %% |\n\n", pe->peak * MT_MIB, tl->peak.live * MT_MIB,
            pe->peak ? 100.0 * (double)(tl->peak.live - pe->peak) / (double)pe->peak : 0.0);
    int *order = (int *)malloc((size_t)tl->num_tags * sizeof(int));
    if (!order) return;
    for (int i = 0; i < tl->num_tags; i++) order[i] = i;
    mt_sort_values = tl->peak_tags;
    qsort(order, (size_t)tl->num_tags, sizeof(int), mt_cmp_tags);
    fprintf(f, "live at the peak by the op (or phase) that allocated it, MiB: ");
    for (int i = 0, shown = 0; i < tl->num_tags && shown < 12; i++) {
        int t = order[i];
        if (tl->peak_tags[t] <= 0) break;
        fprintf(f, "%s%s %.1f", shown++ ? ", " : "", tsys_mem_tag_name(ctx, t), tl->peak_tags[t] * MT_MIB);
        if (tl->peak_tag_cat_act[t] > 0) fprintf(f, " (%.1f saved)", tl->peak_tag_cat_act[t] * MT_MIB);
    }
    fprintf(f, "\n\n");
    free(order);
}

// Each phase's peak with its breakdown by category (and what the caching allocator held free then).
static void mt_print_phases(FILE *f, const mt_timeline *tl) {
    fprintf(f, "peak of each phase, MiB:\n\n| phase | at ms | peak |");
    for (int c = 0; c < MT_NCAT; c++) fprintf(f, " %s |", tsys_mem_category_name((tsys_mem_category)c));
    fprintf(f, " cached |\n|---|---:|---:|");
    for (int c = 0; c <= MT_NCAT; c++) fprintf(f, "---:|");
    fprintf(f, "\n");
    for (int p = 0; p + 1 < tl->nmarks && p < MT_PHASES; p++) {
        const mt_peak *ph = &tl->phase[p];
        if (ph->live < 0) continue;
        fprintf(f, "| %s | %.2f | %.1f |", mt_phase_names[p], ph->t - tl->t0, ph->live * MT_MIB);
        for (int c = 0; c < MT_NCAT; c++) fprintf(f, " %.1f |", ph->cat[c] * MT_MIB);
        fprintf(f, " %.1f |\n", ph->cached * MT_MIB);
    }
    fprintf(f, "\n");
}

// The reports replace their files whole (tsys_atomic_file): a failed or concurrent run never leaves
// half a file, and nothing already at the path (a symlink, say) is written through. A failure is
// also recorded in ctx, naming the path.
static bool mt_write_json(const char *path, tsys_ctx *ctx, const mt_timeline *tl, const char *title, const char *oom) {
    tsys_atomic_file af;
    if (tsys_atomic_file_open(ctx, "--out", path, &af) != TSYS_OK) return false;
    FILE *f = af.f;
    fprintf(f, "{\"title\": \"%s\", \"unit\": {\"time\": \"ms\", \"memory\": \"bytes\"},\n \"categories\": [", title);
    for (int c = 0; c < MT_NCAT; c++) fprintf(f, "%s\"%s\"", c ? ", " : "", tsys_mem_category_name((tsys_mem_category)c));
    fprintf(f, "],\n \"start\": [");
    for (int c = 0; c < MT_NCAT; c++) fprintf(f, "%s%lld", c ? ", " : "", (long long)tl->start_cat[c]);
    fprintf(f, "],\n \"phases\": [");
    for (int p = 0; p + 1 < tl->nmarks; p++)
        fprintf(f, "%s{\"name\": \"%s\", \"t0\": %.3f, \"t1\": %.3f, \"peak\": %lld}", p ? ", " : "", mt_phase_names[p], tl->mark[p] - tl->t0,
                tl->mark[p + 1] - tl->t0, (long long)tl->phase[p].live);
    fprintf(f, "],\n \"peak\": {\"t\": %.3f, \"bytes\": %lld, \"by_category\": [", tl->peak.t - tl->t0, (long long)tl->peak.live);
    for (int c = 0; c < MT_NCAT; c++) fprintf(f, "%s%lld", c ? ", " : "", (long long)tl->peak.cat[c]);
    fprintf(f, "]},\n \"oom\": ");
    if (oom) {   // a JSON string: quotes and backslashes escaped, control characters left out
        fputc('"', f);
        for (const char *s = oom; *s; s++) {
            if (*s == '"' || *s == '\\') fputc('\\', f);
            if ((unsigned char)*s >= 0x20) fputc(*s, f);
        }
        fputc('"', f);
    } else fprintf(f, "null");
    fprintf(f, ",\n \"tags\": [");
    for (int t = 0; t < tl->num_tags; t++) fprintf(f, "%s\"%s\"", t ? ", " : "", tsys_mem_tag_name(ctx, t));
    // dtype and shape: the tensor an allocation was made for (null for frees, moves and memory no tensor owns)
    fprintf(f, "],\n \"columns\": [\"t\", \"delta\", \"live\", \"cached\", \"category\", \"tag\", \"id\", \"action\", \"dtype\", \"shape\"],\n"
               " \"events\": [");
    size_t k = 0;
    for (size_t i = 0; i < tl->n; i++) {
        const tsys_mem_event *e = &tl->ev[i];
        if (e->device != tl->dev) continue;
        fprintf(f, "%s\n  [%.3f, %lld, %lld, %lld, %d, %d, %llu, %d, ", k++ ? "," : "", e->t_us * 1e-3 - tl->t0, (long long)e->delta,
                (long long)e->live, (long long)e->cached, (int)e->category, e->tag, (unsigned long long)e->id, (int)e->action);
        if (e->ndim < 0) { fprintf(f, "null, null]"); continue; }
        fprintf(f, "\"%s\", [", tsys_dtype_name(e->dtype));
        for (int d = 0; d < e->ndim; d++) fprintf(f, d ? ", %lld" : "%lld", (long long)e->shape[d]);
        fprintf(f, "]]");
    }
    fprintf(f, "\n]}\n");
    return tsys_atomic_file_commit(ctx, &af) == TSYS_OK;
}

// Ticks at 1, 2 or 5 times a power of ten, about n of them over [0, hi].
static double mt_nice_step(double hi, int n) {
    double raw = hi / n, p = pow(10.0, floor(log10(raw > 0 ? raw : 1)));
    return raw <= p ? p : raw <= 2 * p ? 2 * p : raw <= 5 * p ? 5 * p : 10 * p;
}

// The timeline as an SVG plot: live bytes stacked by category over time (each pixel column shows the
// state at its highest point, so no peak is lost), the reserved line, phases shaded, the peak marked,
// the out-of-memory point if the step hit one.
static bool mt_write_svg(const char *path, tsys_ctx *ctx, const mt_timeline *tl, const char *title, const char *oom) {
    enum { SVG_W = 960, SVG_H = 440, PL = 70, PR = 190, PT = 40, PB = 50 };   // the picture and its margins
    static const char *const colors[MT_NCAT] = {"#2e7d32", "#8e44ad", "#f1c40f", "#d35400", "#3498db", "#7f8c8d"};
    static const int stack_order[MT_NCAT] = {TSYS_MEM_PARAMETERS, TSYS_MEM_OPTIMIZER, TSYS_MEM_GRADIENTS, TSYS_MEM_ACTIVATIONS,
                                             TSYS_MEM_TEMPORARY, TSYS_MEM_WORKSPACE};
    enum { COLS = SVG_W - PL - PR };
    static int64_t col_cat[COLS][MT_NCAT], col_res[COLS];
    double span = tl->t1 - tl->t0 > 1e-6 ? tl->t1 - tl->t0 : 1e-6;
    int64_t top_bytes = tl->max_reserved > tl->peak.live ? tl->max_reserved : tl->peak.live;
    bool in_gib = top_bytes >= (1ll << 30);   // GiB for model-sized plots, MiB for small ones
    double gib = in_gib ? 1.0 / 1073741824.0 : MT_MIB;
    const char *unit = in_gib ? "GiB" : "MiB";
    int64_t cat[MT_NCAT], best[COLS];
    memcpy(cat, tl->start_cat, sizeof(cat));
    int64_t live = 0, cached = 0;
    for (int c = 0; c < MT_NCAT; c++) live += cat[c];
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
    double ystep = mt_nice_step(ymax, 5), xstep = mt_nice_step(span, 8);
    ymax = ceil(ymax / ystep) * ystep;
    int ph = SVG_H - PT - PB;
#define SX(t) (PL + ((t) - tl->t0) / span * COLS)
#define SY(b) (PT + ph - (double)(b) * gib / ymax * ph)
    tsys_atomic_file af;
    if (tsys_atomic_file_open(ctx, "--out", path, &af) != TSYS_OK) return false;
    FILE *f = af.f;
    fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" "
               "font-family=\"sans-serif\" font-size=\"12\">\n",
            SVG_W, SVG_H, SVG_W, SVG_H);
    fprintf(f, "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n<text x=\"%d\" y=\"22\" font-size=\"15\">", PL);
    for (const char *s = title; *s; s++) {   // XML text: <, > and & escaped
        if (*s == 0x3c) fputs("&lt;", f);
        else if (*s == 0x3e) fputs("&gt;", f);
        else if (*s == 0x26) fputs("&amp;", f);
        else fputc(*s, f);
    }
    fprintf(f, "</text>\n");
    for (int p = 0; p + 1 < tl->nmarks; p++) {   // phases: shaded bands, named at the top where there is room
        double x0 = SX(tl->mark[p]), w = SX(tl->mark[p + 1]) - x0;
        fprintf(f, "<g class=\"phase\"><title>%s %.2f-%.2f ms</title><rect x=\"%.1f\" y=\"%d\" width=\"%.1f\" height=\"%d\" fill=\"%s\"/>",
                mt_phase_names[p],
                tl->mark[p] - tl->t0, tl->mark[p + 1] - tl->t0, x0, PT, w, ph, p % 2 ? "#ececec" : "#f7f7f7");
        if (w > 8.0 * (double)strlen(mt_phase_names[p]))
            fprintf(f, "<text x=\"%.1f\" y=\"%d\" fill=\"#555\">%s</text>", x0 + 4, PT + 14, mt_phase_names[p]);
        fprintf(f, "</g>\n");
    }
    for (double y = 0; y <= ymax + 1e-9; y += ystep)   // grid under the areas
        fprintf(f, "<line x1=\"%d\" x2=\"%d\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n", PL, PL + COLS, SY(y / gib), SY(y / gib));
    for (int k = MT_NCAT - 1; k >= 0; k--) {   // stacked areas, the top layer first: each next one, lower, is drawn over it
        int c = stack_order[k];
        fprintf(f, "<path class=\"series\" data-category=\"%s\" fill=\"%s\" fill-opacity=\"0.85\" d=\"M%d %.1f",
                tsys_mem_category_name((tsys_mem_category)c), colors[c], PL, SY(0));
        for (int x = 0; x < COLS; x++) {
            int64_t top = 0;
            for (int j = 0; j <= k; j++) top += col_cat[x][stack_order[j]];
            fprintf(f, " L%d %.1f L%d %.1f", PL + x, SY(top), PL + x + 1, SY(top));
        }
        fprintf(f, " L%d %.1f Z\"/>\n", PL + COLS, SY(0));
    }
    fprintf(f, "<path class=\"series\" data-category=\"reserved\" fill=\"none\" stroke=\"#222\" stroke-dasharray=\"4 3\" d=\"M%d %.1f", PL,
            SY(col_res[0]));
    for (int x = 0; x < COLS; x++) fprintf(f, " L%d %.1f L%d %.1f", PL + x, SY(col_res[x]), PL + x + 1, SY(col_res[x]));
    fprintf(f, "\"/>\n");
    // axes and ticks
    fprintf(f, "<g stroke=\"#333\"><line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\"/><line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\"/></g>\n",
            PL, PT, PL, PT + ph, PL, PT + ph, PL + COLS, PT + ph);
    for (double y = 0; y <= ymax + 1e-9; y += ystep)
        fprintf(f, "<g class=\"ytick\"><line x1=\"%d\" x2=\"%d\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#333\"/>"
                   "<text x=\"%d\" y=\"%.1f\" text-anchor=\"end\">%g</text></g>\n",
                PL - 5, PL, SY(y / gib), SY(y / gib), PL - 8, SY(y / gib) + 4, y);
    for (double t = 0; t <= span + 1e-9; t += xstep)
        fprintf(f, "<g class=\"xtick\"><line x1=\"%.1f\" x2=\"%.1f\" y1=\"%d\" y2=\"%d\" stroke=\"#333\"/>"
                   "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">%g</text></g>\n",
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
            px, SY(tl->peak.live), left ? px - 6 : px + 6, SY(tl->peak.live) - 6 < PT + 12 ? PT + 28.0 : SY(tl->peak.live) - 6,
            left ? "end" : "start", label);
    if (oom) fprintf(f, "<g class=\"oom\"><line x1=\"%.1f\" x2=\"%.1f\" y1=\"%d\" y2=\"%d\" stroke=\"#c0392b\" stroke-width=\"2\"/>"
                        "<text x=\"%.1f\" y=\"%d\" fill=\"#c0392b\">out of memory here</text></g>\n",
                     SX(tl->t1), SX(tl->t1), PT, PT + ph, SX(tl->t1) - 4, PT + ph - 6);
    // legend, top layer first
    int ly = PT + 4;
    for (int k = MT_NCAT - 1; k >= 0; k--, ly += 20) {
        int c = stack_order[k];
        fprintf(f, "<g class=\"legend\"><rect x=\"%d\" y=\"%d\" width=\"14\" height=\"14\" fill=\"%s\"/>"
                   "<text x=\"%d\" y=\"%d\">%s %.2f %s</text></g>\n",
                PL + COLS + 16, ly,
                colors[c], PL + COLS + 36, ly + 11, tsys_mem_category_name((tsys_mem_category)c), tl->peak.cat[c] * gib, unit);
    }
    fprintf(f, "<g class=\"legend\"><line x1=\"%d\" x2=\"%d\" y1=\"%d\" y2=\"%d\" stroke=\"#222\" stroke-dasharray=\"4 3\"/>"
               "<text x=\"%d\" y=\"%d\">reserved (live + cached)</text></g>\n",
            PL + COLS + 16, PL + COLS + 30, ly + 7, ly + 7, PL + COLS + 36, ly + 11);
    fprintf(f, "<text x=\"%d\" y=\"%d\" fill=\"#555\">at the peak, by category</text>\n", PL + COLS + 16, ly + 34);
    fprintf(f, "</svg>\n");
#undef SX
#undef SY
    return tsys_atomic_file_commit(ctx, &af) == TSYS_OK;
}

#endif
