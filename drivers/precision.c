// precision - the mixed-precision experiments of the CS336 handout:
//   1. mixed_precision_accumulation: 1000 additions of 0.01 in four precision mixes;
//   2. the ToyModel (fc1 -> relu -> LayerNorm -> fc2) under fp16 and bf16 autocast: which dtype
//      each parameter, activation, the loss and the gradients end up in.
#define TSYS_IMPLEMENTATION
#include "../tsys.h"
#include "driver_util.h"

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

static void accumulation_experiment(void) {
    printf("## mixed_precision_accumulation: s = 0; 1000 times s += 0.01 (exact answer 10)\n\n");
    printf("| accumulator | increment | result | error |\n|---|---|---:|---:|\n");
    struct { const char *acc, *inc; tsys_dtype a, i; } rows[4] = {
        {"fp32", "fp32", TSYS_F32, TSYS_F32}, {"fp16", "fp16", TSYS_F16, TSYS_F16},
        {"fp32", "fp16", TSYS_F32, TSYS_F16}, {"fp32", "fp16 cast to fp32", TSYS_F32, TSYS_F16}};
    double err[4];
    for (int r = 0; r < 4; r++) {
        float v = accumulate(rows[r].a, rows[r].i);
        err[r] = v - 10.0;
        printf("| %s | %s | %.7f | %+.2e |\n", rows[r].acc, rows[r].inc, v, err[r]);
    }
    // The prose quotes the errors measured above, so it cannot disagree with the table.
    float inc16 = round_to(TSYS_F16, 0.01f);
    printf("\nfp16 keeps 11 significant bits: near 10 its spacing is 2^-7 = 0.0078, so each += 0.01 rounds and\n"
           "the error grows with every step (%+.2e). An fp32 accumulator rounds too (its spacing near 10 is\n"
           "2^-20 = 9.5e-7, and the 1000 roundings do not cancel): it ends %.2e from the true sum. With an fp16\n"
           "increment, what is left beyond that is 0.01's own fp16 rounding (%.9f), which the fp32 sum carries\n"
           "1000 times (%+.2e).\n\n", err[1], fabs(err[0]), inc16, err[2]);
}

// Returns false when the context reported an error (out of memory under --mem-limit, ...).
static bool toy_model_report(tsys_dtype low, size_t mem_limit) {
    tsys_ctx_desc cd;
    memset(&cd, 0, sizeof(cd));
    cd.cpu_memory_limit = mem_limit;
    tsys_ctx *ctx = tsys_ctx_new(&cd);
    if (!ctx) { fprintf(stderr, "precision: out of memory creating the context\n"); return false; }
    int64_t sx[2] = {8, 16}, s1[2] = {10, 16}, s2[2] = {4, 10}, sln[1] = {10}, st[1] = {8};
    tsys_tensor *x = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 2, sx), *tgt = tsys_tensor_new(ctx, TSYS_I32, TSYS_CPU, 1, st);
    tsys_tensor *w1 = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 2, s1), *w2 = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 2, s2);
    tsys_tensor *g = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, sln), *b = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, sln);
    tsys_tensor *params[4] = {w1, g, b, w2};
    const char *names[4] = {"fc1.weight", "ln.weight", "ln.bias", "fc2.weight"};
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
    bool ok = tsys_ctx_status(ctx) == TSYS_OK;
    if (ok) {
        printf("| %s autocast | dtype |\n|---|---|\n", tsys_dtype_name(low));
        for (int i = 0; i < 4; i++) printf("| parameter %s | %s |\n", names[i], tsys_dtype_name(params[i]->dtype));
        printf("| fc1 output | %s |\n| LayerNorm output | %s |\n| logits | %s |\n| loss | %s |\n", tsys_dtype_name(h->dtype),
               tsys_dtype_name(n->dtype), tsys_dtype_name(logits->dtype), tsys_dtype_name(loss->dtype));
        for (int i = 0; i < 4; i++) printf("| gradient of %s | %s |\n", names[i], params[i]->grad ? tsys_dtype_name(params[i]->grad->dtype) : "none");
        printf("\n");
    } else {
        printf("| %s autocast | %s: %s |\n\n", tsys_dtype_name(low), tsys_ctx_status(ctx) == TSYS_ERR_OOM ? "OOM" : "error", tsys_ctx_last_error(ctx));
        fprintf(stderr, "precision: %s\n", tsys_ctx_last_error(ctx));
    }
    fflush(stdout);
    tsys_tensor *ts[7] = {h, r, n, logits, loss, x, tgt};
    for (int i = 0; i < 7; i++) tsys_tensor_release(ts[i]);
    for (int i = 0; i < 4; i++) tsys_tensor_release(params[i]);
    tsys_ctx_free(ctx);
    return ok;
}

static void usage(FILE *f) {
    fprintf(f,
        "usage: precision [flags]\n"
        "  prints the mixed_precision_accumulation experiment and the ToyModel autocast dtype tables\n"
        DU_MEM_LIMIT_HELP
        "  --dry-run                  check the flags, print nothing else\n"
        "  --help\n"
        "exit status: 0 every table printed, 1 a ToyModel run failed (error or out of memory) or the tables could\n"
        "             not be written, 2 bad usage\n");
}

// Returns 0, DU_HELP or DU_EXIT_USAGE (after a message naming the flag); never exits.
static int parse_args(int argc, char **argv, size_t *mem_limit, bool *dry_run) {
    *mem_limit = 0; *dry_run = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) return DU_HELP;
        if (!strcmp(a, "--dry-run")) { *dry_run = true; continue; }
        if (strcmp(a, "--mem-limit")) { fprintf(stderr, "precision: unknown flag '%s'\n", a); usage(stderr); return DU_EXIT_USAGE; }
        if (i + 1 >= argc) { fprintf(stderr, "precision: flag %s needs a value\n", a); return DU_EXIT_USAGE; }
        if (!du_parse_gib("precision", a, argv[++i], mem_limit)) return DU_EXIT_USAGE;
    }
    return 0;
}

static int driver_main(int argc, char **argv) {
    size_t mem_limit;
    bool dry_run;
    int rc = parse_args(argc, argv, &mem_limit, &dry_run);
    if (rc == DU_HELP) { usage(stdout); return DU_EXIT_OK; }
    if (rc || dry_run) return rc;
    accumulation_experiment();
    printf("## ToyModel under autocast (fc1 -> relu -> LayerNorm -> fc2, cross-entropy)\n\n");
    bool ok = toy_model_report(TSYS_F16, mem_limit);
    ok = toy_model_report(TSYS_BF16, mem_limit) && ok;
    printf("Matmuls run in the low precision (fp32 accumulation); LayerNorm computes its mean and variance in\n"
           "fp32 and returns fp32, because squaring and summing small activations underflows or loses bits in\n"
           "fp16. bf16 has fp32's exponent range, so overflow is no concern, but its 8-bit mantissa still makes\n"
           "the variance sum imprecise: keeping norms in fp32 remains the safe rule.\n");
    return ok ? DU_EXIT_OK : DU_EXIT_FAILED;
}

int main(int argc, char **argv) { return du_exit("precision", driver_main(argc, argv)); }
