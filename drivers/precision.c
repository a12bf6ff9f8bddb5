// precision - the mixed-precision experiments of the CS336 handout:
//   1. mixed_precision_accumulation: 1000 additions of 0.01 in four precision mixes;
//   2. the ToyModel (fc1 -> relu -> LayerNorm -> fc2) under fp16 and bf16 autocast: which dtype
//      each parameter, activation, the loss and the gradients end up in.
// --format md prints the tables with the prose that reads them; csv and jsonl print one table of
// rows (experiment accumulation: accumulator, increment, result, error; experiment toymodel:
// autocast, tensor, dtype) and nothing else on stdout.
#include "prelude.h"
#include "driver_util.h"

#define TOY_TENSORS 12
#define ROWS (4 + 2 * TOY_TENSORS)   // what a run prints: the accumulation rows, the ToyModel's for each autocast dtype

static float round_to(tsys_dtype dt, float v) {
    return dt == TSYS_F16 ? tsys_f16_to_f32(tsys_f32_to_f16(v)) : dt == TSYS_BF16 ? tsys_bf16_to_f32(tsys_f32_to_bf16(v)) : v;
}

// s += x, 1000 times: the accumulator is rounded to acc_dt after every addition, the increment 0.01
// is first rounded to inc_dt (promotion computes the sum in fp32, as torch does).
static float accumulate(tsys_dtype acc_dt, tsys_dtype inc_dt) {
    float s = round_to(acc_dt, 0.0f), inc = round_to(inc_dt, 0.01f);
    for (int i = 0; i < 1000; i++) s = round_to(acc_dt, s + inc);
    return s;
}

static void accumulation_experiment(bool md, du_table *tab, int *config) {
    if (md) printf("## mixed_precision_accumulation: s = 0; 1000 times s += 0.01 (exact answer 10)\n\n"
                   "| accumulator | increment | result | error |\n|---|---|---:|---:|\n");
    struct { const char *acc, *inc; tsys_dtype a, i; } rows[4] = {
        {"fp32", "fp32", TSYS_F32, TSYS_F32}, {"fp16", "fp16", TSYS_F16, TSYS_F16},
        {"fp32", "fp16", TSYS_F32, TSYS_F16}, {"fp32", "fp16 cast to fp32", TSYS_F32, TSYS_F16}};
    double err[4];
    for (int r = 0; r < 4; r++) {
        du_progress_config(++*config, "accumulation: %s += %s", rows[r].acc, rows[r].inc);
        float v = accumulate(rows[r].a, rows[r].i);
        err[r] = v - 10.0;
        if (md) { printf("| %s | %s | %.7f | %+.2e |\n", rows[r].acc, rows[r].inc, v, err[r]); continue; }
        du_row *row = du_table_row(tab);
        du_row_set(row, "experiment", "accumulation");
        du_row_set(row, "accumulator", "%s", rows[r].acc);
        du_row_set(row, "increment", "%s", rows[r].inc);
        du_row_set(row, "result", "%.7f", v);
        du_row_set(row, "error", "%.2e", err[r]);   // no '+': JSON numbers have none
        du_row_set(row, "status", "ok");
        du_table_emit(tab);
    }
    if (!md) return;
    // The prose quotes the errors measured above, so it cannot disagree with the table.
    float inc16 = round_to(TSYS_F16, 0.01f);
    printf("\nfp16 keeps 11 significant bits: near 10 its spacing is 2^-7 = 0.0078, so each += 0.01 rounds and\n"
           "the error grows with every step (%+.2e). An fp32 accumulator rounds too (its spacing near 10 is\n"
           "2^-20 = 9.5e-7, and the 1000 roundings do not cancel): it ends %.2e from the true sum. With an fp16\n"
           "increment, what is left beyond that is 0.01's own fp16 rounding (%.9f), which the fp32 sum carries\n"
           "1000 times (%+.2e).\n\n", err[1], fabs(err[0]), inc16, err[2]);
}

// The ToyModel's tensors after one autocast step: their names in the table and their dtypes (has: a
// gradient was made).
typedef struct toy_result { const char *tensor[TOY_TENSORS]; tsys_dtype dtype[TOY_TENSORS]; bool has[TOY_TENSORS]; } toy_result;

// The --dtype spelling (fp32, bf16, fp16) in csv and jsonl, as the accumulation rows write it; md keeps
// the library's names.
static const char *dtype_word(tsys_dtype d, bool md) {
    return !md && (d == TSYS_F32 || d == TSYS_BF16 || d == TSYS_F16) ? du_dtype_flag(d) : tsys_dtype_name(d);
}

// One forward and backward under autocast to low; the context's status (out of memory under --mem-limit, ...).
static tsys_status toy_model_run(tsys_dtype low, size_t mem_limit, toy_result *res, char *err, size_t len) {
    tsys_ctx_desc cd;
    memset(&cd, 0, sizeof(cd));
    cd.cpu_memory_limit = mem_limit;
    tsys_ctx *ctx = tsys_ctx_new(&cd);
    if (!ctx) { snprintf(err, len, "out of memory creating the context"); return TSYS_ERR_OOM; }
    int64_t sx[2] = {8, 16}, s1[2] = {10, 16}, s2[2] = {4, 10}, sln[1] = {10}, st[1] = {8};
    tsys_tensor *x = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 2, sx), *tgt = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 1, st);
    tsys_tensor *w1 = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 2, s1), *w2 = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 2, s2);
    tsys_tensor *g = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, sln), *b = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, sln);
    tsys_tensor *params[4] = {w1, g, b, w2};
    static const char *const names[TOY_TENSORS] = {"parameter fc1.weight", "parameter ln.weight", "parameter ln.bias", "parameter fc2.weight",
        "fc1 output", "LayerNorm output", "logits", "loss",
        "gradient of fc1.weight", "gradient of ln.weight", "gradient of ln.bias", "gradient of fc2.weight"};
    if (tsys_ctx_status(ctx) == TSYS_OK) {   // (the fill functions want real tensors; the ops below pass NULL on)
        tsys_tensor_randn(ctx, x, 1); tsys_tensor_randn(ctx, w1, 0.25f); tsys_tensor_randn(ctx, w2, 0.3f);
        tsys_tensor_fill(ctx, g, 1); tsys_tensor_fill(ctx, b, 0); tsys_tensor_randint(ctx, tgt, 4);
        for (int i = 0; i < 4; i++) tsys_tensor_set_requires_grad(params[i], true);
    }
    tsys_autocast_begin(ctx, low);
    tsys_tensor *h = tsys_linear(ctx, x, w1, NULL), *r = tsys_relu(ctx, h), *n = tsys_layernorm(ctx, r, g, b, 1e-5f);
    tsys_tensor *logits = tsys_linear(ctx, n, w2, NULL), *loss = tsys_cross_entropy(ctx, logits, tgt);
    tsys_autocast_end(ctx);
    tsys_backward(ctx, loss);
    tsys_status status = tsys_ctx_status(ctx);
    if (status == TSYS_OK) {
        tsys_tensor *acts[4] = {h, n, logits, loss};
        for (int i = 0; i < TOY_TENSORS; i++) { res->tensor[i] = names[i]; res->has[i] = true; }
        for (int i = 0; i < 4; i++) {
            res->dtype[i] = params[i]->dtype;
            res->dtype[4 + i] = acts[i]->dtype;
            res->has[8 + i] = params[i]->grad != NULL;
            if (params[i]->grad) res->dtype[8 + i] = params[i]->grad->dtype;
        }
    } else snprintf(err, len, "%s", tsys_ctx_last_error(ctx));
    tsys_tensor *ts[7] = {h, r, n, logits, loss, x, tgt};
    for (int i = 0; i < 7; i++) tsys_tensor_release(ts[i]);
    for (int i = 0; i < 4; i++) tsys_tensor_release(params[i]);
    tsys_ctx_free(ctx);
    return status;
}

// The ToyModel's dtype table under autocast to low (md), or its rows; the run's status.
static tsys_status toy_model_report(tsys_dtype low, size_t mem_limit, bool md, du_table *tab) {
    toy_result res;
    char err[512];
    tsys_status st = toy_model_run(low, mem_limit, &res, err, sizeof err);
    const char *name = dtype_word(low, md), *fail = st == TSYS_ERR_OOM ? "OOM" : "error";
    if (st != TSYS_OK) fprintf(stderr, "precision: %s\n", err);
    if (md && st != TSYS_OK) printf("| %s autocast | %s: %s |\n\n", name, fail, err);
    else if (md) {
        printf("| %s autocast | dtype |\n|---|---|\n", name);
        for (int i = 0; i < TOY_TENSORS; i++) printf("| %s | %s |\n", res.tensor[i], res.has[i] ? dtype_word(res.dtype[i], md) : "none");
        printf("\n");
    }
    for (int i = 0; !md && i < (st == TSYS_OK ? TOY_TENSORS : 1); i++) {
        du_row *row = du_table_row(tab);
        du_row_set(row, "experiment", "toymodel");
        du_row_set(row, "autocast", "%s", name);
        if (st != TSYS_OK) { du_row_set(row, "status", "%s: %s", fail, err); du_table_emit(tab); continue; }   // one row says why
        du_row_set(row, "tensor", "%s", res.tensor[i]);
        du_row_set(row, "dtype", "%s", res.has[i] ? dtype_word(res.dtype[i], md) : DU_NA);
        du_row_set(row, "status", "ok");
        du_table_emit(tab);
    }
    fflush(stdout);
    return st;
}

static int driver_main(int argc, char **argv) {
    du_common c;
    memset(&c, 0, sizeof c);
    du_flag flags[] = { DU_COMMON_FLAGS(&c, DU_MEM_LIMIT_TEXT) };
    int rc = du_flags_parse("precision", flags, (int)(sizeof flags / sizeof flags[0]), argc, argv,
                            "  prints the mixed_precision_accumulation experiment and the ToyModel autocast dtype tables",
                            "md: the tables and the prose that reads them; csv and jsonl: one table, columns\n"
                            "experiment,accumulator,increment,result,error,autocast,tensor,dtype,status (the cells of\n"
                            "the other experiment empty); --mem-limit bounds the ToyModel's context (--oom-ok: its\n"
                            "out-of-memory runs do not fail the exit status).\n");
    if (rc == DU_HELP) return DU_EXIT_OK;
    if (rc) return rc;
    if (c.dry_run) return du_dry_run_done(&c, "precision", ROWS);
    bool md = !strcmp(c.format, "md");
    du_table tab;
    du_table_init(&tab, "experiment,accumulator,increment,result,error,autocast,tensor,dtype,status", c.format);
    du_progress_setup("precision", c.progress);
    du_progress_begin(6);   // the four accumulation mixes, the two autocast runs
    int config = 0;
    accumulation_experiment(md, &tab, &config);
    if (md) printf("## ToyModel under autocast (fc1 -> relu -> LayerNorm -> fc2, cross-entropy)\n\n");
    tsys_dtype lows[2] = {TSYS_F16, TSYS_BF16};
    int failed = 0;   // md's exit status; csv and jsonl take the table's, which also says why on stderr
    for (int i = 0; i < 2; i++) {
        du_progress_config(++config, "ToyModel under %s autocast", du_dtype_flag(lows[i]));
        tsys_status st = toy_model_report(lows[i], c.mem_limit, md, &tab);
        failed += st != TSYS_OK && !(st == TSYS_ERR_OOM && c.oom_ok);
    }
    du_progress_end();
    if (md) printf("Matmuls run in the low precision (fp32 accumulation); LayerNorm computes its mean and variance in\n"
                   "fp32 and returns fp32, because squaring and summing small activations underflows or loses bits in\n"
                   "fp16. bf16 has fp32's exponent range, so overflow is no concern, but its 8-bit mantissa still makes\n"
                   "the variance sum imprecise: keeping norms in fp32 remains the safe rule.\n");
    rc = md ? (failed ? DU_EXIT_FAILED : DU_EXIT_OK) : du_table_exit_code(&tab, "precision", c.oom_ok);
    du_table_free(&tab);
    return rc;
}

int main(int argc, char **argv) { return du_exit("precision", driver_main(argc, argv)); }
