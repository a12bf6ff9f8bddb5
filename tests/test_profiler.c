// test_profiler.c - the built-in profiler on the CPU: every op of a training step appears with its
// call count, kernels are attributed to phases, hooks that were installed keep firing, the Chrome
// trace is well-formed JSON with nested spans and counters, a flow from each op to each kernel it
// launched and the ops' input shapes, the CPU's FLOP rates read in GFLOP/s, and profiling changes no result.
// The memory snapshot (tsys_mem_snapshot, a client of the same hooks): its pickle parses and replays
// to the tracker's peak.
#define TSYS_IMPLEMENTATION
#include "../tsys.h"
#include "harness.h"
#include "test_util.h"
#include <unistd.h>
#include <ctype.h>

static tsys_model *tiny_model(tsys_ctx *ctx) {
    tsys_model_desc d = tsys_model_desc_defaults(NULL);
    d.vocab_size = 40; d.context_length = 8; d.d_model = 16; d.num_layers = 2; d.num_heads = 2; d.d_ff = 24;
    return tsys_model_new(ctx, &d, TSYS_CPU, 11);
}

static int g_user_ops;
static void user_op(tsys_ctx *ctx, const char *name, tsys_trace_kind kind, void *u) { (void)ctx; (void)name; (void)kind; (void)u; g_user_ops++; }

// One step in the report's phases; returns the loss. tape_counts (if given) gets the recorded ops per op.
static float step(tsys_ctx *ctx, tsys_model *m, tsys_optim *opt, tsys_tensor *ids, int *tape_counts) {
    tsys_trace_begin(ctx, "forward");
    tsys_tensor *logits = tsys_model_forward(m, ids);
    tsys_tensor *loss = tsys_cross_entropy(ctx, logits, ids);
    tsys_trace_end(ctx);
    if (tape_counts) for (size_t i = 0; i < ctx->tape_len; i++) tape_counts[ctx->tape[i]->op]++;
    tsys_trace_begin(ctx, "backward");
    tsys_backward(ctx, loss);
    tsys_trace_end(ctx);
    tsys_trace_begin(ctx, "optimizer");
    tsys_optim_step(opt);
    tsys_optim_zero_grad(opt);
    tsys_trace_end(ctx);
    float l = tsys_item(ctx, loss);
    tsys_tensor_release(logits); tsys_tensor_release(loss);
    return l;
}

// Structural JSON check: balanced {} and [] outside strings, strings closed, escapes valid.
static bool json_balanced(const char *s) {
    int depth = 0;
    bool in_str = false;
    for (; *s; s++) {
        if (in_str) {
            if (*s == '\\') { s++; if (!*s) return false; }
            else if (*s == '"') in_str = false;
            else if ((unsigned char)*s < 0x20) return false;
            continue;
        }
        if (*s == '"') in_str = true;
        else if (*s == '{' || *s == '[') depth++;
        else if (*s == '}' || *s == ']') { if (--depth < 0) return false; }
    }
    return depth == 0 && !in_str;
}

TSYS_TEST(profiler_lists_every_op_and_phase) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_model *m = tiny_model(ctx);
    tsys_optim *opt = tsys_adamw_new(ctx, tsys_model_params(m), tsys_model_num_tensors(m), NULL);
    int64_t sid[2] = {2, 8};
    tsys_tensor *ids = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 2, sid);
    tsys_tensor_randint(ctx, ids, 40);
    tsys_trace_hooks mine;
    memset(&mine, 0, sizeof(mine));
    mine.op_begin = user_op;
    tsys_ctx_set_trace_hooks(ctx, &mine);
    g_user_ops = 0;
    tsys_profiler *p = tsys_profiler_begin(ctx);
    TEST_CHECK(p != NULL, "%s", tsys_ctx_last_error(ctx));
    int tape[TSYS__OP_COUNT];
    memset(tape, 0, sizeof(tape));
    step(ctx, m, opt, ids, tape);
    TEST_CHECK(tsys_profiler_end(p) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    TEST_CHECK(g_user_ops > 0, "the hook installed before the profiler stopped firing while it ran");
    tsys_trace_hooks back = tsys_ctx_set_trace_hooks(ctx, NULL);
    TEST_CHECK(back.op_begin == user_op, "profiler_end did not give the hooks back");
    for (int op = 0; op < TSYS__OP_COUNT; op++) {
        if (!tape[op]) continue;
        int fwd = tsys_profiler_op_calls(p, tsys__op_names[op], TSYS_TRACE_FORWARD), bwd = tsys_profiler_op_calls(p, tsys__op_names[op], TSYS_TRACE_BACKWARD);
        TEST_CHECK(fwd == tape[op], "%s: %d forward calls profiled, %d on the tape", tsys__op_names[op], fwd, tape[op]);
        TEST_CHECK(bwd == tape[op], "%s: %d backward calls profiled, %d nodes on the tape", tsys__op_names[op], bwd, tape[op]);
    }
    TEST_CHECK(tape[TSYS__OP_LINEAR] == 2 * 7 + 1, "linear nodes %d", tape[TSYS__OP_LINEAR]);
    // the model marks its layers and the parts of attention (the report's names)
    TEST_CHECK(tsys_profiler_op_calls(p, "layers.1", TSYS_TRACE_REGION) == 1, "region layers.1: %d", tsys_profiler_op_calls(p, "layers.1", TSYS_TRACE_REGION));
    const char *parts[3] = {"computing attention scores", "computing softmax", "final matmul"};
    for (int i = 0; i < 3; i++)
        TEST_CHECK(tsys_profiler_op_calls(p, parts[i], TSYS_TRACE_REGION) == 2, "region '%s': %d, expected one per layer", parts[i], tsys_profiler_op_calls(p, parts[i], TSYS_TRACE_REGION));
    double f = tsys_profiler_kernel_ms(p, "forward"), b = tsys_profiler_kernel_ms(p, "backward"), o = tsys_profiler_kernel_ms(p, "optimizer"), all = tsys_profiler_kernel_ms(p, NULL);
    TEST_CHECK(f > 0 && b > 0 && o > 0, "phase kernel times %g %g %g", f, b, o);
    TEST_CHECK(fabs(f + b + o - all) <= 0.05 * all + 0.05, "phases %g + %g + %g vs all kernels %g (only tsys_item is outside)", f, b, o, all);
    // the numbers of the report's questions: the top kernels, the matmuls' share, the softmax region
    double top_ms = 0, mm = tsys_profiler_matmul_ms(p, NULL), sm = tsys_profiler_span_ms(p, "computing softmax");
    int top_calls = 0;
    const char *top_mm = tsys_profiler_top_kernel(p, NULL, 1, &top_ms, &top_calls);
    TEST_CHECK(top_mm && !strcmp(top_mm, "gemm") && fabs(top_ms - mm) <= 1e-9 && top_calls > 0, "the matmul kernel: %s, %g ms (matmuls %g), %d calls", top_mm ? top_mm : "none", top_ms, mm, top_calls);
    const char *top_other = tsys_profiler_top_kernel(p, "forward", 0, &top_ms, NULL);
    TEST_CHECK(top_other && strcmp(top_other, "gemm") && top_ms > 0 && top_ms <= f - tsys_profiler_matmul_ms(p, "forward") + 1e-9, "forward's largest non-matmul kernel: %s %g ms",
               top_other ? top_other : "none", top_ms);
    TEST_CHECK(sm > 0 && sm <= f, "the softmax regions: %g ms of %g in forward", sm, f);
    TEST_CHECK(tsys_profiler_top_kernel(p, "no such phase", -1, &top_ms, &top_calls) == NULL && top_ms == 0 && top_calls == 0, "a phase that never ran has no kernel");
    // tables print, the trace is well-formed
    FILE *tf = tmpfile();
    tsys_profiler_print_ops(p, tf, 0);
    tsys_profiler_print_kernels(p, tf, 0);
    long tlen = ftell(tf);
    TEST_CHECK(tlen > 500, "tables are %ld bytes", tlen);
    fclose(tf);
    char path[] = "/tmp/tsys_trace_XXXXXX";
    int fd = mkstemp(path);
    TEST_CHECK(fd >= 0, "mkstemp");
    if (fd >= 0) close(fd);
    TEST_CHECK(tsys_profiler_write_trace(p, path) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    FILE *jf = fopen(path, "r");
    char *json = NULL;
    long n = 0;
    if (jf) { fseek(jf, 0, SEEK_END); n = ftell(jf); fseek(jf, 0, SEEK_SET); json = (char *)malloc((size_t)n + 1); n = (long)fread(json, 1, (size_t)n, jf); json[n] = 0; fclose(jf); }
    TEST_CHECK(json && json_balanced(json), "trace is not balanced JSON");
    TEST_CHECK(json && strstr(json, "\"traceEvents\"") && strstr(json, "\"ph\": \"X\"") && strstr(json, "\"ph\": \"C\"") && strstr(json, "\"name\": \"linear\"")
               && strstr(json, "\"name\": \"reserved bytes\""), "trace lacks X spans, C counters (live and reserved bytes) or the linear op");
    free(json);
    remove(path);
    // spans nest: every span lies inside its parent
    int bad = 0;
    for (size_t i = 0; i < p->num_spans; i++) {
        const tsys__prof_span *sp = &p->spans[i];
        if (sp->t1 < sp->t0) bad++;
        if (sp->parent >= 0 && (sp->t0 < p->spans[sp->parent].t0 || sp->t1 > p->spans[sp->parent].t1)) bad++;
    }
    TEST_CHECK(bad == 0, "%d spans outside their parents", bad);
    tsys_profiler_free(p);
    tsys_tensor_release(ids);
    tsys_optim_free(opt);
    tsys_model_free(m);
    tsys_ctx_free(ctx);
}

// ---- the Chrome trace: strict JSON, flows from ops to kernels, input shapes -----------------------

// A strict JSON parser (RFC 8259's grammar, no extensions): true when *s starts with one value.
static void jskip(const char **s) { while (**s == ' ' || **s == '\n' || **s == '\t' || **s == '\r') (*s)++; }
static bool jvalue(const char **s, int depth);
static bool jstring(const char **s) {
    if (**s != '"') return false;
    for ((*s)++; **s != '"'; (*s)++) {
        if ((unsigned char)**s < 0x20) return false;
        if (**s != '\\') continue;
        (*s)++;
        if (**s == 'u') { for (int i = 1; i <= 4; i++) if (!isxdigit((unsigned char)(*s)[i])) return false; *s += 4; }
        else if (!strchr("\"\\/bfnrt", **s) || !**s) return false;
    }
    (*s)++;
    return true;
}
static bool jnumber(const char **s) {
    const char *p = *s;
    if (*p == '-') p++;
    if (*p == '0') p++;
    else if (isdigit((unsigned char)*p)) while (isdigit((unsigned char)*p)) p++;
    else return false;
    if (*p == '.') { p++; if (!isdigit((unsigned char)*p)) return false; while (isdigit((unsigned char)*p)) p++; }
    if (*p == 'e' || *p == 'E') { p++; if (*p == '+' || *p == '-') p++; if (!isdigit((unsigned char)*p)) return false; while (isdigit((unsigned char)*p)) p++; }
    *s = p;
    return true;
}
static bool jvalue(const char **s, int depth) {
    if (depth > 64) return false;
    jskip(s);
    char c = **s;
    if (c == '{' || c == '[') {
        char close = c == '{' ? '}' : ']';
        (*s)++; jskip(s);
        if (**s == close) { (*s)++; return true; }
        for (;;) {
            if (c == '{') { jskip(s); if (!jstring(s)) return false; jskip(s); if (*(*s)++ != ':') return false; }
            if (!jvalue(s, depth + 1)) return false;
            jskip(s);
            if (**s == close) { (*s)++; return true; }
            if (*(*s)++ != ',') return false;
        }
    }
    if (c == '"') return jstring(s);
    if (!strncmp(*s, "true", 4)) { *s += 4; return true; }
    if (!strncmp(*s, "false", 5)) { *s += 5; return true; }
    if (!strncmp(*s, "null", 4)) { *s += 4; return true; }
    return jnumber(s);
}
static bool json_strict(const char *s) { if (!jvalue(&s, 0)) return false; jskip(&s); return *s == 0; }

// A number field of one event (the writer puts one event on a line); false when it is not there.
static bool ev_num(const char *line, const char *key, double *v) {
    char pat[64];
    snprintf(pat, sizeof(pat), "\"%s\": ", key);
    const char *at = strstr(line, pat);
    if (!at) return false;
    *v = strtod(at + strlen(pat), NULL);
    return true;
}

static char *read_text(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = (char *)malloc((size_t)n + 1);
    n = (long)fread(buf, 1, (size_t)n, f);
    buf[n] = 0;
    fclose(f);
    return buf;
}

// Whether an event (a line) that contains `head` also contains `what`.
static bool has_event(const char *json, const char *head, const char *what) {
    for (const char *at = strstr(json, head); at; at = strstr(at + 1, head)) {
        const char *w = strstr(at, what), *end = strchr(at, '\n');
        if (w && (!end || w < end)) return true;
    }
    return false;
}

typedef struct trace_ev { char ph; double ts, dur, pid, tid, id, seq; bool bp_e, has_op; } trace_ev;

// Every flow: an "s" inside an op's slice, its "f" (same id, binding to the enclosing slice) inside the
// kernel slice of the launch; one flow per kernel launched inside an op. Returns the number of flows,
// -1 when any is wrong (msg says which).
static int check_flows(const char *json, char *msg, size_t msg_len) {
    int cap = 1 << 16, n = 0;
    trace_ev *ev = (trace_ev *)calloc((size_t)cap, sizeof(*ev));
    for (const char *line = json; line && *line && n < cap; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
        const char *ph = strstr(line, "\"ph\": \""), *end = strchr(line, '\n');
        if (!ph || (end && ph > end)) continue;
        trace_ev *e = &ev[n];
        memset(e, 0, sizeof(*e));
        e->ph = ph[7];
        if (e->ph != 'X' && e->ph != 's' && e->ph != 'f') continue;
        char one[1024];
        size_t len = end ? (size_t)(end - line) : strlen(line);
        if (len >= sizeof(one)) len = sizeof(one) - 1;
        memcpy(one, line, len); one[len] = 0;
        ev_num(one, "ts", &e->ts); ev_num(one, "dur", &e->dur); ev_num(one, "pid", &e->pid); ev_num(one, "tid", &e->tid);
        ev_num(one, "id", &e->id); ev_num(one, "seq", &e->seq);
        e->bp_e = strstr(one, "\"bp\": \"e\"") != NULL;
        e->has_op = strstr(one, "\"op\": \"\"") == NULL && strstr(one, "\"op\": \"") != NULL;
        if ((e->ph == 's' || e->ph == 'f') && (!strstr(one, "\"cat\": \"ac2g\"") || !strstr(one, "\"id\": "))) { snprintf(msg, msg_len, "flow event without cat ac2g or id: %.200s", one); free(ev); return -1; }
        n++;
    }
    int flows = 0, kernels_in_ops = 0;
    for (int i = 0; i < n; i++) {
        if (ev[i].ph == 'X' && ev[i].pid == 2 && ev[i].has_op) kernels_in_ops++;
        if (ev[i].ph != 's') continue;
        // the start lies inside an op's slice on the same track
        bool in_op = false;
        for (int j = 0; j < n && !in_op; j++) in_op = ev[j].ph == 'X' && ev[j].pid == ev[i].pid && ev[j].tid == ev[i].tid && ev[j].ts <= ev[i].ts && ev[i].ts <= ev[j].ts + ev[j].dur;
        int fin = -1, starts = 0;
        for (int j = 0; j < n; j++) {
            if (ev[j].ph == 'f' && ev[j].id == ev[i].id) fin = fin < 0 ? j : -2;
            if (ev[j].ph == 's' && ev[j].id == ev[i].id) starts++;
        }
        if (!in_op || fin < 0 || starts != 1 || !ev[fin].bp_e) {
            snprintf(msg, msg_len, "flow %.0f: start in an op %d, finishes %d, starts %d", ev[i].id, (int)in_op, fin, starts);
            free(ev);
            return -1;
        }
        bool in_kernel = false;
        for (int j = 0; j < n && !in_kernel; j++)
            in_kernel = ev[j].ph == 'X' && ev[j].pid == ev[fin].pid && ev[j].tid == ev[fin].tid && ev[j].seq == ev[i].id && ev[j].ts <= ev[fin].ts && ev[fin].ts <= ev[j].ts + ev[j].dur;
        if (!in_kernel) { snprintf(msg, msg_len, "flow %.0f: the finish at %.3f lies in no slice of its kernel", ev[i].id, ev[fin].ts); free(ev); return -1; }
        flows++;
    }
    int finishes = 0;
    for (int i = 0; i < n; i++) finishes += ev[i].ph == 'f';
    free(ev);
    if (finishes != flows || flows != kernels_in_ops) { snprintf(msg, msg_len, "%d flows, %d finishes, %d kernels launched inside ops", flows, finishes, kernels_in_ops); return -1; }
    return flows;
}

TSYS_TEST(trace_has_flows_input_shapes_and_readable_units) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_model *m = tiny_model(ctx);
    tsys_optim *opt = tsys_adamw_new(ctx, tsys_model_params(m), tsys_model_num_tensors(m), NULL);
    int64_t sid[2] = {2, 8}, sa[3] = {2, 32, 48}, sb[2] = {48, 40}, sx[2] = {6, 16};
    tsys_tensor *ids = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 2, sid);
    tsys_tensor_randint(ctx, ids, 40);
    tsys_tensor *a = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 3, sa), *b = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 2, sb);
    tsys_tensor *x = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 2, sx), *w = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, sx + 1);
    tsys_tensor_randn(ctx, a, 1.0f); tsys_tensor_randn(ctx, b, 1.0f); tsys_tensor_randn(ctx, x, 1.0f); tsys_tensor_fill(ctx, w, 1.0f);
    tsys_tensor_set_requires_grad(a, true);
    tsys_profiler *p = tsys_profiler_begin(ctx);
    TEST_CHECK(p != NULL, "%s", tsys_ctx_last_error(ctx));
    step(ctx, m, opt, ids, NULL);
    tsys_tensor *y = tsys_matmul(ctx, a, b, false);
    tsys_tensor *l = tsys_sum(ctx, y);
    TEST_CHECK(tsys_backward(ctx, l) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    tsys_tensor *ln = tsys_layernorm(ctx, x, w, NULL, 1e-5f);   // a left-out bias
    TEST_CHECK(tsys_profiler_end(p) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    char path[] = "/tmp/tsys_trace_XXXXXX";
    int fd = mkstemp(path);
    TEST_CHECK(fd >= 0, "mkstemp");
    if (fd >= 0) close(fd);
    TEST_CHECK(tsys_profiler_write_trace(p, path) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    char *json = read_text(path);
    TEST_CHECK(json && json_strict(json) && strstr(json, "\"traceEvents\": ["), "the trace is not strict JSON with traceEvents");
    char msg[512] = "";
    int flows = json ? check_flows(json, msg, sizeof(msg)) : -1;
    size_t in_ops = 0;
    for (size_t i = 0; i < p->num_kernels; i++) in_ops += p->kernels[i].span >= 0;
    TEST_CHECK(flows > 0 && (size_t)flows == in_ops, "flows: %d (%zu kernels launched inside ops): %s", flows, in_ops, msg);
    // the ops carry their inputs' shapes and dtypes, PyTorch's way; the backward node its forward op's
    const char *mm = "\"name\": \"matmul\", \"cat\": \"op\"", *mm_bwd = "\"name\": \"matmul\", \"cat\": \"backward\"";
    const char *dims = "\"args\": {\"Input Dims\": [[2, 32, 48], [48, 40]], \"Input type\": [\"f32\", \"f32\"]}";
    TEST_CHECK(json && has_event(json, mm, dims), "no matmul slice carries %s", dims);
    TEST_CHECK(json && has_event(json, mm_bwd, dims), "no matmul backward slice carries %s", dims);
    const char *ln_dims = "\"Input Dims\": [[6, 16], [16], []], \"Input type\": [\"f32\", \"f32\", \"\"]";
    TEST_CHECK(json && strstr(json, ln_dims), "the layernorm's slice lacks %s", ln_dims);
    const char *ce = json ? strstr(json, "\"name\": \"cross_entropy\", \"cat\": \"op\"") : NULL;
    TEST_CHECK(ce && strstr(ce, "\"Input type\": [\"f32\", \"i32\"]") && strstr(ce, "\"Input type\"") < strchr(ce, '\n'), "cross_entropy's input dtypes");
    const char *range = json ? strstr(json, "\"name\": \"forward\", \"cat\": \"range\"") : NULL;
    TEST_CHECK(range && (!strstr(range, "Input Dims") || strstr(range, "Input Dims") > strchr(range, '\n')), "a range has no inputs");
    // the checker catches a dropped flow
    if (json) {
        char *fin = strstr(json, "\"ph\": \"f\"");
        if (fin) { fin[7] = 'i'; TEST_CHECK(check_flows(json, msg, sizeof(msg)) < 0, "a trace without one flow's finish passed the check"); }
    }
    free(json);
    remove(path);
    // the CPU's FLOP rates in GFLOP/s, the unit that reads as more than 0.0
    FILE *tf = tmpfile();
    tsys_profiler_print_ops(p, tf, 0);
    long len = ftell(tf);
    char *tab = (char *)calloc((size_t)len + 1, 1);
    rewind(tf);
    len = (long)fread(tab, 1, (size_t)len, tf);
    fclose(tf);
    TEST_CHECK(strstr(tab, "| host ms | GFLOP/s |") && !strstr(tab, "TFLOP/s"), "the op table's FLOP column on the CPU: %.200s", tab);
    const char *row = strstr(tab, "| matmul | ");
    double gflops = 0;
    for (int col = 0; row && col < 7; col++) row = strchr(row + 1, '|');   // to the one before the FLOP rate
    if (row) gflops = strtod(row + 1, NULL);
    TEST_CHECK(gflops > 0.05, "the matmul row's GFLOP/s: %g", gflops);
    free(tab);
    tsys_tensor_release(ln); tsys_tensor_release(l); tsys_tensor_release(y);
    tsys_tensor_release(a); tsys_tensor_release(b); tsys_tensor_release(x); tsys_tensor_release(w);
    tsys_profiler_free(p);
    tsys_tensor_release(ids);
    tsys_optim_free(opt);
    tsys_model_free(m);
    tsys_ctx_free(ctx);
}

TSYS_TEST(profiling_changes_no_result) {
    float loss[2][3];
    for (int prof = 0; prof < 2; prof++) {
        tsys_ctx *ctx = tsys_ctx_new(NULL);
        tsys_model *m = tiny_model(ctx);
        tsys_optim *opt = tsys_adamw_new(ctx, tsys_model_params(m), tsys_model_num_tensors(m), NULL);
        int64_t sid[2] = {2, 8};
        tsys_tensor *ids = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 2, sid);
        tsys_rng_seed(ctx, 5);
        tsys_tensor_randint(ctx, ids, 40);
        tsys_profiler *p = prof ? tsys_profiler_begin(ctx) : NULL;
        for (int i = 0; i < 3; i++) loss[prof][i] = step(ctx, m, opt, ids, NULL);
        tsys_profiler_free(p);
        tsys_tensor_release(ids);
        tsys_optim_free(opt);
        tsys_model_free(m);
        tsys_ctx_free(ctx);
    }
    for (int i = 0; i < 3; i++) TEST_CHECK(loss[0][i] == loss[1][i], "step %d: loss %.9g unprofiled, %.9g profiled", i, loss[0][i], loss[1][i]);
}

// ---- memory categories ----------------------------------------------------------------------

static int64_t g_cat_live[TSYS_MEM_CATEGORY_COUNT];
static int g_cat_mismatch, g_cat_events;
static void cat_mem(tsys_ctx *ctx, const tsys_mem_event *e, void *u) {
    (void)u;
    g_cat_live[e->category] += e->delta;
    g_cat_events++;
    int64_t sum = 0;
    for (int c = 0; c < TSYS_MEM_CATEGORY_COUNT; c++) sum += g_cat_live[c];
    tsys_mem_stats st = tsys_mem_stats_get(ctx, e->device);
    for (int c = 0; c < TSYS_MEM_CATEGORY_COUNT; c++) g_cat_mismatch += st.category_bytes[c] != g_cat_live[c];
    g_cat_mismatch += sum != e->live;
}

TSYS_TEST(memory_categories_add_up_and_return_to_the_model_state) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_trace_hooks h;
    memset(&h, 0, sizeof(h));
    h.mem = cat_mem;
    tsys_ctx_set_trace_hooks(ctx, &h);
    memset(g_cat_live, 0, sizeof(g_cat_live));
    g_cat_mismatch = g_cat_events = 0;
    tsys_model *m = tiny_model(ctx);
    tsys_optim *opt = tsys_adamw_new(ctx, tsys_model_params(m), tsys_model_num_tensors(m), NULL);
    int64_t sid[2] = {2, 8};
    tsys_tensor *ids = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 2, sid);
    tsys_tensor_randint(ctx, ids, 40);
    int64_t pbytes = tsys_model_num_params(m) * 4;
    tsys_mem_reset_peak(ctx, TSYS_CPU);
    step(ctx, m, opt, ids, NULL);
    tsys_mem_stats st = tsys_mem_stats_get(ctx, TSYS_CPU);
    TEST_CHECK(g_cat_events > 50 && g_cat_mismatch == 0, "%d of %d events where categories do not add up to live bytes", g_cat_mismatch, g_cat_events);
    TEST_CHECK(st.category_bytes[TSYS_MEM_PARAMETERS] == pbytes && st.category_bytes[TSYS_MEM_GRADIENTS] == pbytes,
               "parameters %lld, gradients %lld, expected %lld each", (long long)st.category_bytes[TSYS_MEM_PARAMETERS], (long long)st.category_bytes[TSYS_MEM_GRADIENTS], (long long)pbytes);
    TEST_CHECK(st.category_bytes[TSYS_MEM_OPTIMIZER] == 2 * pbytes + 16, "optimizer state %lld, expected m, v, the step count and its two bias corrections", (long long)st.category_bytes[TSYS_MEM_OPTIMIZER]);
    int64_t ids_bytes = 2 * 8 * 4;
    TEST_CHECK(st.live_bytes == 4 * pbytes + 16 + ids_bytes, "after the step live %lld, expected params + grads + optimizer state + ids = %lld",
               (long long)st.live_bytes, (long long)(4 * pbytes + 16 + ids_bytes));
    TEST_CHECK(st.category_bytes[TSYS_MEM_ACTIVATIONS] == 0, "activations left after backward: %lld", (long long)st.category_bytes[TSYS_MEM_ACTIVATIONS]);
    TEST_CHECK(st.peak_category_bytes[TSYS_MEM_ACTIVATIONS] > 0, "no activations at the peak");
    int64_t peak_sum = 0;
    for (int c = 0; c < TSYS_MEM_CATEGORY_COUNT; c++) peak_sum += st.peak_category_bytes[c];
    TEST_CHECK(peak_sum == st.peak_bytes, "the peak's breakdown sums to %lld, the peak is %lld", (long long)peak_sum, (long long)st.peak_bytes);
    tsys_tensor_release(ids);
    tsys_optim_free(opt);
    tsys_model_free(m);
    TEST_CHECK(tsys_mem_stats_get(ctx, TSYS_CPU).live_bytes == 0, "live bytes after releasing everything");
    tsys_ctx_free(ctx);
}

// The first-principles prediction (tsys_model_mem_predict, from the shapes) against the tracker's
// peak, for each kind of step: within 10 % in total and in the most the tape keeps at once; the timeline
// pairs every free with its allocation, carries the shapes, and moves bytes between categories in pairs.
static void mem_prediction_case(const char *attn, tsys_dtype dt, bool backward, bool optimizer) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    test_mem_result r;
    tsys_status st = test_mem_step(ctx, TSYS_CPU, attn, dt, backward, optimizer, &r);
    const char *what = !backward ? "forward" : optimizer ? "train" : "forward-backward";
    TEST_CHECK(st == TSYS_OK, "%s %s: %s", what, tsys_dtype_name(dt), tsys_ctx_last_error(ctx));
    TEST_CHECK(r.workspace == 0 && test_rel_diff(r.peak, r.predicted.peak) <= 0.10, "%s %s: peak %lld, predicted %lld", what, tsys_dtype_name(dt), (long long)r.peak, (long long)r.predicted.peak);
    if (backward)
        TEST_CHECK(test_rel_diff(r.saved, r.predicted.saved_per_layer * r.predicted.num_layers + r.predicted.saved_outside) <= 0.10,
                   "%s %s: the tape kept at most %lld bytes, predicted %lld", what, tsys_dtype_name(dt), (long long)r.saved,
                   (long long)(r.predicted.saved_per_layer * r.predicted.num_layers + r.predicted.saved_outside));
    TEST_CHECK(r.allocs > 20 && r.unpaired_frees == 0 && r.bad_shapes == 0 && r.odd_moves == 0, "%s: %d allocations, %d frees without one, %d without a shape, %d unpaired moves",
               what, r.allocs, r.unpaired_frees, r.bad_shapes, r.odd_moves);
    TEST_CHECK(tsys_mem_stats_get(ctx, TSYS_CPU).live_bytes == 0, "live bytes after the model is freed");
    tsys_ctx_free(ctx);
}
// The head and the loss fused (desc.fused_loss), a vocabulary of 16384 so that the logits matter (16 MiB of fp32
// logits and as much for their gradient): the prediction follows the fused head (within 10 % of the tracker,
// in the peak and in what the tape keeps) and differs from the logits path's prediction by more than that.
static void mem_prediction_fused_case(tsys_dtype dt) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    test_mem_result r;
    tsys_status st = test_mem_step_ex(ctx, TSYS_CPU, "naive", dt, true, true, false, true, 16384, &r);
    TEST_CHECK(st == TSYS_OK, "%s: %s", tsys_dtype_name(dt), tsys_ctx_last_error(ctx));
    const int64_t kept = r.predicted.saved_per_layer * r.predicted.num_layers + r.predicted.saved_outside;
    TEST_CHECK(r.workspace == 0 && test_rel_diff(r.peak, r.predicted.peak) <= 0.10, "fused %s: peak %lld, predicted %lld", tsys_dtype_name(dt), (long long)r.peak, (long long)r.predicted.peak);
    TEST_CHECK(test_rel_diff(r.saved, kept) <= 0.10, "fused %s: the tape kept at most %lld bytes, predicted %lld", tsys_dtype_name(dt), (long long)r.saved, (long long)kept);
    tsys_model_desc d = tsys_model_desc_defaults(NULL);
    d.vocab_size = 16384; d.context_length = 128; d.d_model = 64; d.num_layers = 3; d.num_heads = 4; d.d_ff = 192;   // test_mem_step_ex's model
    // (its fused steps take chunks of 64 of the 256 rows)
    tsys_model_mem_estimate plain = tsys_model_mem_predict(&d, 2, 128, dt, true, true);
    TEST_CHECK(test_rel_diff(plain.peak, r.predicted.peak) > 0.20, "fused %s: predicted %lld, with the logits %lld: the prediction does not see the fusion",
               tsys_dtype_name(dt), (long long)r.predicted.peak, (long long)plain.peak);
    tsys_ctx_free(ctx);
}
TSYS_TEST(predicted_peak_matches_the_tracker_fused_loss) { mem_prediction_fused_case(TSYS_F32); mem_prediction_fused_case(TSYS_BF16); }

// AdamW keeping the bf16 weight copies (tsys_optim_keep_lowp): the peak within 10 % as above, and the
// parameters at the peak exactly the fp32 weights and an aligned copy of each (held all along, in place of
// the step's copies of the matrices, which the prediction without kept copies counts).
TSYS_TEST(predicted_peak_matches_the_tracker_kept_copies) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    test_mem_result r;
    tsys_status st = test_mem_step_kept(ctx, TSYS_CPU, "naive", TSYS_BF16, true, true, true, &r);
    TEST_CHECK(st == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    TEST_CHECK(r.workspace == 0 && test_rel_diff(r.peak, r.predicted.peak) <= 0.10, "peak %lld, predicted %lld", (long long)r.peak, (long long)r.predicted.peak);
    tsys_model_desc d = tsys_model_desc_defaults(NULL);
    d.vocab_size = 512; d.context_length = 128; d.d_model = 64; d.num_layers = 3; d.num_heads = 4; d.d_ff = 192;   // test_mem_step's model
    // each tensor's copy starts 256-byte aligned (GEMM plans follow the operands' alignment)
    tsys_ctx *c2 = tsys_ctx_new(NULL);
    tsys_model *m = tsys_model_new(c2, &d, TSYS_CPU, 1);
    int64_t P = tsys_model_desc_num_params(&d), copies = 0;
    for (int i = 0; m && i < tsys_model_num_tensors(m); i++) copies += (tsys_tensor_numel(tsys_model_params(m)[i]) * 2 + 255) / 256 * 256;
    tsys_model_free(m);
    tsys_ctx_free(c2);
    TEST_CHECK(copies >= 2 * P && r.predicted.params == 4 * P + copies, "predicted parameters %lld, expected 4 x %lld + %lld of copies", (long long)r.predicted.params, (long long)P, (long long)copies);
    TEST_CHECK(r.params_at_peak == r.predicted.params, "parameters at the peak %lld, predicted %lld", (long long)r.params_at_peak, (long long)r.predicted.params);
    tsys_model_mem_estimate plain = tsys_model_mem_predict(&d, 2, 128, TSYS_BF16, true, true);
    TEST_CHECK(plain.params != r.predicted.params, "the prediction does not see the kept copies");
    tsys_ctx_free(ctx);
}

TSYS_TEST(predicted_peak_matches_the_tracker_train) { mem_prediction_case("naive", TSYS_F32, true, true); mem_prediction_case("naive", TSYS_BF16, true, true); }
TSYS_TEST(predicted_peak_matches_the_tracker_forward_backward) { mem_prediction_case("naive", TSYS_F32, true, false); mem_prediction_case("flash", TSYS_F32, true, false); }
TSYS_TEST(predicted_peak_matches_the_tracker_forward) { mem_prediction_case("naive", TSYS_F32, false, false); mem_prediction_case("naive", TSYS_BF16, false, false); }

// ---- tsys_mem_snapshot: the memory_viz pickle ------------------------------------------------------

// What a walk of a snapshot pickle found: the opcodes are those tsys_mem_snapshot writes (the ones
// memory_viz's own reader knows), every SETITEMS closes a dict of key-value pairs with string keys,
// every APPENDS a list, every memo fetch names a list put before, and STOP leaves one dict.
typedef struct pk_walk { bool ok; int allocs, frees_completed, segments; const char *why; } pk_walk;

static pk_walk pk_walk_check(const unsigned char *p, size_t n, int *stack, int *memo) {
    enum { DICT = 1, LIST, STR, INT, MARK, BOOL_ };
    pk_walk w = {false, 0, 0, 0, "truncated"};
    int sp = 0, nmemo = 0;   // stack and memo: room for n entries (each takes an opcode byte at least)
    const unsigned char *str = NULL; uint32_t slen = 0;   // the last string, for the counts
    bool action_key = false, segments_key = false;
    if (n < 2 || p[0] != 0x80 || p[1] != 2) { w.why = "no PROTO 2"; return w; }
    for (size_t i = 2; i < n;) {
        unsigned char op = p[i++];
        uint32_t u = 0;
        if (op == 'J' || op == 'X' || op == 'r' || op == 'j') {
            if (i + 4 > n) return w;
            u = (uint32_t)p[i] | (uint32_t)p[i + 1] << 8 | (uint32_t)p[i + 2] << 16 | (uint32_t)p[i + 3] << 24;
            i += 4;
        }
        switch (op) {
        case '}': stack[sp++] = DICT; break;
        case ']': stack[sp++] = LIST; break;
        case '(': stack[sp++] = MARK; break;
        case 'J': stack[sp++] = INT; break;
        case 0x89: stack[sp++] = BOOL_; break;
        case 0x8a: if (i >= n || p[i] != 8 || i + 9 > n) { w.why = "LONG1 of other than 8 bytes"; return w; } i += 9; stack[sp++] = INT; break;
        case 'X':
            if (i + u > n) return w;
            str = p + i; slen = u; i += u;
            if (action_key && slen == 5 && !memcmp(str, "alloc", 5)) w.allocs++;
            if (action_key && slen == 14 && !memcmp(str, "free_completed", 14)) w.frees_completed++;
            action_key = slen == 6 && !memcmp(str, "action", 6);
            stack[sp++] = STR;
            break;
        case 'r': if (sp == 0 || stack[sp - 1] != LIST || u != (uint32_t)nmemo) { w.why = "bad memo put"; return w; } memo[nmemo++] = LIST; break;
        case 'j': if (u >= (uint32_t)nmemo) { w.why = "memo fetch of nothing"; return w; } stack[sp++] = memo[u]; break;
        case 'u': case 'e': {
            int m = sp - 1;
            while (m >= 0 && stack[m] != MARK) m--;
            int items = sp - 1 - m;
            if (m < 1 || stack[m - 1] != (op == 'u' ? DICT : LIST) || (op == 'u' && items % 2)) { w.why = op == 'u' ? "bad SETITEMS" : "bad APPENDS"; return w; }
            for (int k = m + 1; op == 'u' && k < sp; k += 2) if (stack[k] != STR) { w.why = "a key that is not a string"; return w; }
            if (op == 'e' && segments_key && m == 4) { w.segments += items; segments_key = false; }   // the list under the top dict's key
            sp = m;
            break;
        }
        case '.':
            if (i != n || sp != 1 || stack[0] != DICT) { w.why = "STOP with other than one dict, or bytes after it"; return w; }
            w.ok = true; w.why = "";
            return w;
        default: w.why = "an opcode tsys_mem_snapshot does not write"; return w;
        }
        if (op == 'X' && slen == 8 && !memcmp(str, "segments", 8) && sp == 3) segments_key = true;   // the top dict's key
    }
    return w;
}

static pk_walk pk_walk_of(const unsigned char *p, size_t n) {
    int *stack = (int *)malloc(n * sizeof(int)), *memo = (int *)malloc(n * sizeof(int));
    pk_walk w = {false, 0, 0, 0, "out of memory"};
    if (stack && memo) w = pk_walk_check(p, n, stack, memo);
    free(stack); free(memo);
    return w;
}

static unsigned char *read_whole(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *buf = len > 0 ? (unsigned char *)malloc((size_t)len) : NULL;
    *n = buf ? fread(buf, 1, (size_t)len, f) : 0;
    fclose(f);
    return buf;
}

// A warmup step, a restart, the recorded step: the trace replays to the tracker's peak of that step,
// its counts are the file's, what is live at the end is the tracker's live bytes and the segments, and
// the hooks installed before keep firing and come back after.
TSYS_TEST(mem_snapshot_of_a_training_step) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_trace_hooks mine;
    memset(&mine, 0, sizeof(mine));
    mine.op_begin = user_op;
    tsys_ctx_set_trace_hooks(ctx, &mine);
    tsys_mem_snapshot *s = tsys_mem_snapshot_begin(ctx, TSYS_CPU);
    TEST_CHECK(s != NULL, "%s", tsys_ctx_last_error(ctx));
    tsys_model *m = tiny_model(ctx);
    tsys_optim *opt = tsys_adamw_new(ctx, tsys_model_params(m), tsys_model_num_tensors(m), NULL);
    int64_t sid[2] = {2, 8};
    tsys_tensor *ids = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 2, sid);
    tsys_tensor_randint(ctx, ids, 40);
    step(ctx, m, opt, ids, NULL);
    tsys_mem_snapshot_restart(s);
    tsys_mem_reset_peak(ctx, TSYS_CPU);
    g_user_ops = 0;
    step(ctx, m, opt, ids, NULL);
    TEST_CHECK(g_user_ops > 0, "the hook installed before the snapshot stopped firing");
    tsys_mem_snapshot_stats st = tsys_mem_snapshot_stats_get(s);
    tsys_mem_stats t = tsys_mem_stats_get(ctx, TSYS_CPU);
    TEST_CHECK(st.complete && st.unmatched == 0, "complete %d, unmatched frees %ld", st.complete, st.unmatched);
    TEST_CHECK(st.peak_bytes == t.peak_bytes && st.live_bytes == t.live_bytes, "trace peak %lld live %lld, tracker peak %lld live %lld",
               (long long)st.peak_bytes, (long long)st.live_bytes, (long long)t.peak_bytes, (long long)t.live_bytes);
    TEST_CHECK(st.allocs > 20 && st.frees > 10 && st.peak_bytes > st.live_bytes, "allocs %zu, frees %zu, peak %lld", st.allocs, st.frees, (long long)st.peak_bytes);
    char path[] = "/tmp/tsys_snapshot_XXXXXX";
    int fd = mkstemp(path);
    TEST_CHECK(fd >= 0, "mkstemp");
    if (fd >= 0) close(fd);
    TEST_CHECK(tsys_mem_snapshot_write(s, path) == TSYS_OK, "%s", tsys_ctx_last_error(ctx));
    size_t n = 0;
    unsigned char *buf = read_whole(path, &n);
    pk_walk w = buf ? pk_walk_of(buf, n) : (pk_walk){false, 0, 0, 0, "unreadable"};
    TEST_CHECK(w.ok, "the pickle does not parse: %s", w.why);
    TEST_CHECK(w.allocs == (int)st.allocs && w.frees_completed == (int)st.frees, "the file has %d allocs and %d frees, the stats %zu and %zu",
               w.allocs, w.frees_completed, st.allocs, st.frees);
    TEST_CHECK(w.segments == (int)(st.allocs - st.frees), "%d segments, %zu blocks live", w.segments, st.allocs - st.frees);
    free(buf);
    remove(path);
    tsys_mem_snapshot_free(s);
    tsys_trace_hooks back = tsys_ctx_set_trace_hooks(ctx, NULL);
    TEST_CHECK(back.op_begin == user_op && back.mem == NULL, "tsys_mem_snapshot_free did not give the hooks back");
    tsys_tensor_release(ids);
    tsys_optim_free(opt);
    tsys_model_free(m);
    tsys_ctx_free(ctx);
}

// Misuse and a path that cannot be written are errors naming what and where; nothing is left behind.
TSYS_TEST(mem_snapshot_errors) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    TEST_CHECK(tsys_mem_snapshot_begin(NULL, TSYS_CPU) == NULL, "a NULL context");
    TEST_CHECK(tsys_mem_snapshot_begin(ctx, (tsys_device)7) == NULL && strstr(tsys_ctx_last_error(ctx), "not a tsys_device"), "device 7: %s", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    tsys_mem_snapshot *s = tsys_mem_snapshot_begin(ctx, TSYS_CPU);
    TEST_CHECK(tsys_mem_snapshot_write(s, NULL) == TSYS_ERR_INVALID_ARGS, "a NULL path");
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(tsys_mem_snapshot_write(s, "/proc/no/such/dir/x.pickle") == TSYS_ERR_IO && strstr(tsys_ctx_last_error(ctx), "memory snapshot '/proc/no/such/dir/x.pickle'"),
               "an unwritable path: %s", tsys_ctx_last_error(ctx));
    tsys_ctx_clear_error(ctx);
    TEST_CHECK(tsys_mem_snapshot_write(NULL, "x.pickle") == TSYS_ERR_INVALID_ARGS, "a NULL snapshot");
    tsys_mem_snapshot_stats none = tsys_mem_snapshot_stats_get(NULL);
    TEST_CHECK(none.allocs == 0 && !none.complete, "the stats of no snapshot");
    tsys_mem_snapshot_restart(NULL); tsys_mem_snapshot_end(NULL); tsys_mem_snapshot_free(NULL);
    tsys_mem_snapshot_end(s); tsys_mem_snapshot_end(s);   // twice is once
    tsys_mem_snapshot_free(s);
    tsys_ctx_free(ctx);
}

int main(int argc, char **argv) { return tsys_test_main(argc, argv); }
