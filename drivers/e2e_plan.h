// e2e_plan.h - e2e's activation checkpointing plans (tsys_checkpoint_plan, docs/design/checkpointing.md):
// the plan of a configuration under its --checkpoint policy, auto:BYTES resolved to the policy the
// planner picks, and the row --plan prints for it instead of measuring. Included by e2e after
// driver_util.h.
#ifndef TSYS_E2E_PLAN_H
#define TSYS_E2E_PLAN_H

#define E2E_PLAN_COLS "model,context,batch,mode,dtype,attn,ckpt,block_MiB,kept_block_MiB,kept_blocks_MiB,kept_MiB,pred_peak_MiB,recompute_pct,fits,status"

// The plan of the model d under the policy ckpt for a step of mode on batch sequences of T tokens in
// autocast dt: what the step holds (AdamW state only in train mode; extra: TSYS_PLAN_KEPT_COPIES /
// TSYS_PLAN_FREE_GRADS when the step runs with them). name gets the policy's name ("... (auto)" for
// auto:BYTES) and d->checkpoint the policy run. False (err filled) when the policy cannot run.
static inline bool e2e_plan_make(tsys_model_desc *d, const char *ckpt, du_mode mode, int batch, int T, tsys_dtype dt, unsigned extra,
                                 tsys_checkpoint_plan *plan, char *name, size_t name_len, char *err, size_t len) {
    d->checkpoint = ckpt;
    unsigned flags = mode == DU_TRAIN ? TSYS_PLAN_OPTIMIZER | extra : 0u;
    if (tsys_checkpoint_plan_make_ex(d, ckpt, batch, T, dt, flags, plan, err, len) != TSYS_OK) return false;
    bool is_auto = !strncmp(ckpt, "auto:", 5);
    snprintf(name, name_len, "%s%s", plan->name, is_auto ? " (auto)" : "");
    if (is_auto) d->checkpoint = plan->name;
    return true;
}

// --plan's cells of one configuration (E2E_PLAN_COLS): the accounting of plan p of the model d, whose
// policy is called name.
static inline void e2e_plan_row(du_row *row, const tsys_model_desc *d, const tsys_checkpoint_plan *p, const char *name) {
    const double MiB = 1048576.0;
    du_row_set(row, "ckpt", "%s", name);
    du_row_set(row, "block_MiB", "%.2f", p->block_bytes / MiB);
    du_row_set(row, "kept_block_MiB", "%.2f", p->kept_block_bytes / MiB);
    du_row_set(row, "kept_blocks_MiB", "%.2f", p->kept_block_bytes * d->num_layers / MiB);
    du_row_set(row, "kept_MiB", "%.1f", p->kept_bytes / MiB);
    du_row_set(row, "pred_peak_MiB", "%.1f", p->peak_bytes / MiB);
    du_row_set(row, "recompute_pct", "%.1f", p->step_flops > 0 ? 100.0 * p->recompute_flops / p->step_flops : 0.0);
    du_row_set(row, "fits", "%s", p->budget > 0 ? (p->fits ? "yes" : "no: least peak") : DU_NA);
    du_row_set(row, "status", "ok");
}

// The plan that auto:BYTES picked, on stderr; its recompute time is estimated from ref[3] (the reference
// GEMM rates of du_mfu_reference; max 0: not measured) and a nominal memory bandwidth.
static inline void e2e_plan_print(const tsys_checkpoint_plan *plan, const tsys_stats *ref, tsys_dtype dt, bool cuda) {
    double peak = ref[du_dtype_index(dt)].max > 0 ? ref[du_dtype_index(dt)].max : 0;
    tsys_checkpoint_plan_print(plan, stderr, cuda ? peak : peak / 1e3, cuda && ref[0].max > 0 ? 2000.0 : 10.0);   // GPU HBM / CPU DRAM GB/s, nominal
}

#endif
