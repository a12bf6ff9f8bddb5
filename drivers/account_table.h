// account_table.h - ddp --account: the accounting's prediction as a table, a row per scheme (DDP,
// ZeRO-1, ZeRO-2 and ZeRO-3 on paper, FSDP as tsys_fsdp does it) for a model, dtype and context: the
// bytes per rank at the peak of a step and the bytes each rank sends per step. Included after
// driver_util.h and tsys_dist.h by the ddp driver.
#ifndef TSYS_ACCOUNT_TABLE_H
#define TSYS_ACCOUNT_TABLE_H

#define ACCOUNT_TABLE_COLUMNS "model,params,dtype,context,batch,ranks,scheme,param_MiB,grad_MiB,optim_MiB,act_MiB,total_MiB,sent_MB_per_step"
#define ACCOUNT_TABLE_SCHEMES 5   // rows per model, dtype and context

// The rows of the model d (named model) trained in dtype dt at context T, batch sequences a rank, on
// ranks ranks; fd: FSDP's settings.
static inline void account_table_rows(du_table *tab, const char *model, const tsys_model_desc *d, tsys_dtype dt, int T, int batch, int ranks,
                                      const tsys_fsdp_desc *fd) {
    const double MiB = 1048576.0;
    for (int s = TSYS_SCHEME_DDP; s <= TSYS_SCHEME_ZERO3 + 1; s++) {   // + 1: FSDP as tsys_fsdp does it
        const bool fsdp = s > TSYS_SCHEME_ZERO3;
        tsys_dist_account acc = fsdp ? tsys_fsdp_accounting_desc(d, fd, batch, T, ranks) : tsys_dist_accounting(d, dt, batch, T, ranks, (tsys_dist_scheme)s);
        du_row *r = du_table_row(tab);
        du_row_set(r, "model", "%s", model);
        du_row_set(r, "params", "%.3g", (double)tsys_model_desc_num_params(d));
        du_row_set(r, "dtype", "%s", du_dtype_flag(dt));
        du_row_set(r, "context", "%d", T);
        du_row_set(r, "batch", "%d", batch);
        du_row_set(r, "ranks", "%d", ranks);
        if (fsdp) du_row_set(r, "scheme", "fsdp (tsys_fsdp)");
        else du_row_set(r, "scheme", "%s%s", tsys_dist_scheme_name((tsys_dist_scheme)s), s >= TSYS_SCHEME_ZERO2 ? " (paper)" : "");
        du_row_set(r, "param_MiB", "%.1f", acc.param_bytes / MiB);
        du_row_set(r, "grad_MiB", "%.1f", acc.grad_bytes / MiB);
        du_row_set(r, "optim_MiB", "%.1f", acc.optim_bytes / MiB);
        du_row_set(r, "act_MiB", "%.1f", acc.act_bytes / MiB);
        du_row_set(r, "total_MiB", "%.1f", acc.total_bytes / MiB);
        du_row_set(r, "sent_MB_per_step", "%.1f", acc.sent_bytes / 1e6);
        du_table_emit(tab);
    }
}

#endif
