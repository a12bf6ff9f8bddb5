// account_table.h - ddp's accounting predictions (tsys_dist_accounting, tsys_fsdp_accounting_desc):
// --account's table, a row per scheme (DDP, ZeRO-1, ZeRO-2 and ZeRO-3 on paper, FSDP as tsys_fsdp does
// it) for a model, dtype and context: the bytes per rank at the peak of a step and the bytes each rank
// sends per step; and the predicted columns beside a measured row. Included after driver_util.h and
// tsys_dist.h by the ddp driver.
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

// Gives the model and FSDP's settings of one model, context and dtype of --account; false after a
// message in err (an invalid model). user: the driver's.
typedef bool (*account_desc_fn)(const void *user, const char *model, int T, tsys_dtype dt, tsys_model_desc *d, tsys_fsdp_desc *fd, char *err, size_t len);

// One table, in format fmt, of rows for every model x context x dtype of the lists (in that order), each made
// by rows_of: an invalid model is said on stderr ("<prog>: <err>") for each of its contexts and dtypes and ends
// the table after it: DU_EXIT_USAGE; else DU_EXIT_OK.
typedef void (*account_rows_fn)(du_table *tab, const char *model, const tsys_model_desc *d, const tsys_fsdp_desc *fd, tsys_dtype dt, int T, const void *how);
static inline int account_tables_print(const char *prog, const char *fmt, const char *columns, const du_list *models, const du_list *contexts, const du_list *dtypes,
                                       account_desc_fn desc, const void *user, account_rows_fn rows_of, const void *how) {
    du_table tab;
    du_table_init(&tab, columns, fmt);
    int rc = DU_EXIT_OK;
    for (int a = 0; a < models->n && rc == DU_EXIT_OK; a++)
        for (int c = 0; c < contexts->n; c++)
            for (int t = 0; t < dtypes->n; t++) {
                tsys_dtype dt = TSYS_F32;
                int T = 0;
                du_parse_dtype(dtypes->item[t], &dt); du_parse_int(contexts->item[c], 1, 1 << 20, &T);
                tsys_model_desc d;
                tsys_fsdp_desc fd;
                char err[256];
                if (!desc(user, models->item[a], T, dt, &d, &fd, err, sizeof(err))) { fprintf(stderr, "%s: %s\n", prog, err); rc = DU_EXIT_USAGE; }
                else rows_of(&tab, models->item[a], &d, &fd, dt, T, how);
            }
    du_table_free(&tab);
    return rc;
}

typedef struct account_how { int batch, ranks; double C, W; } account_how;
static inline void account_rows_of(du_table *tab, const char *model, const tsys_model_desc *d, const tsys_fsdp_desc *fd, tsys_dtype dt, int T, const void *how) {
    const account_how *h = (const account_how *)how;
    account_table_rows(tab, model, d, dt, T, h->batch, h->ranks, fd);
}

// --account: the rows of every model x context x dtype of the lists, batch sequences a rank on ranks ranks.
static inline int account_table_print(const char *prog, const char *fmt, const du_list *models, const du_list *contexts, const du_list *dtypes, int batch,
                                      int ranks, account_desc_fn desc, const void *user) {
    const account_how how = { batch, ranks, 0, 0 };
    return account_tables_print(prog, fmt, ACCOUNT_TABLE_COLUMNS, models, contexts, dtypes, desc, user, account_rows_of, &how);
}

// --plan: the S26 section 8 cost model (tsys_dist_plan_step) of every layout of `ranks` ranks: dp and fsdp over
// all of them, tp over all of them, and dp x tp, fsdp x tp for each tp that divides the ranks (and the model's
// heads, d_ff and vocabulary); batch sequences a dp replica, C FLOP/s, W bytes/s a rank.
#define PLAN_TABLE_COLUMNS "model,dtype,context,batch,ranks,layout,dp,tp,compute_ms,dp_comm_ms,tp_comm_ms,comm_ms,comm_per_compute,dp_sent_MB,tp_sent_MB,weights_MiB,peak_MiB"

static inline void plan_table_rows(du_table *tab, const char *model, const tsys_model_desc *d, tsys_dtype dt, int T, int batch, int ranks, double C, double W) {
    for (int tp = 1; tp <= ranks; tp++) {
        if (ranks % tp || d->num_heads % tp || d->d_ff % tp || d->vocab_size % tp) continue;
        const int dp = ranks / tp;
        for (int l = 0; l < TSYS_LAYOUT_COUNT; l++) {
            const tsys_dist_layout lay = (tsys_dist_layout)l;
            const bool fits = tp == 1 ? lay == TSYS_LAYOUT_DP || lay == TSYS_LAYOUT_FSDP : dp == 1 ? lay == TSYS_LAYOUT_TP : lay == TSYS_LAYOUT_DP_TP || lay == TSYS_LAYOUT_FSDP_TP;
            if (!fits) continue;
            tsys_dist_plan p = tsys_dist_plan_step(d, lay, dp, tp, batch, T, dt, C, W);
            du_row *r = du_table_row(tab);
            du_row_set(r, "model", "%s", model);
            du_row_set(r, "dtype", "%s", du_dtype_flag(dt));
            du_row_set(r, "context", "%d", T);
            du_row_set(r, "batch", "%d", batch);
            du_row_set(r, "ranks", "%d", ranks);
            du_row_set(r, "layout", "%s", tsys_dist_layout_name(lay));
            du_row_set(r, "dp", "%d", dp);
            du_row_set(r, "tp", "%d", tp);
            du_row_set(r, "compute_ms", "%.2f", p.compute_ms);
            du_row_set(r, "dp_comm_ms", "%.2f", p.dp_comm_ms);
            du_row_set(r, "tp_comm_ms", "%.2f", p.tp_comm_ms);
            du_row_set(r, "comm_ms", "%.2f", p.comm_ms);
            du_row_set(r, "comm_per_compute", "%.3f", p.comm_ms / p.compute_ms);
            du_row_set(r, "dp_sent_MB", "%.1f", p.dp_sent_bytes / 1e6);
            du_row_set(r, "tp_sent_MB", "%.1f", p.tp_sent_bytes / 1e6);
            du_row_set(r, "weights_MiB", "%.1f", p.weight_bytes / 1048576.0);
            du_row_set(r, "peak_MiB", "%.1f", p.peak_bytes / 1048576.0);
            du_table_emit(tab);
        }
    }
}

static inline void plan_rows_of(du_table *tab, const char *model, const tsys_model_desc *d, const tsys_fsdp_desc *fd, tsys_dtype dt, int T, const void *how) {
    (void)fd;
    const account_how *h = (const account_how *)how;
    plan_table_rows(tab, model, d, dt, T, h->batch, h->ranks, h->C, h->W);
}

static inline int plan_table_print(const char *prog, const char *fmt, const du_list *models, const du_list *contexts, const du_list *dtypes, int batch, int ranks,
                                   double C, double W, account_desc_fn desc, const void *user) {
    const account_how how = { batch, ranks, C, W };
    return account_tables_print(prog, fmt, PLAN_TABLE_COLUMNS, models, contexts, dtypes, desc, user, plan_rows_of, &how);
}

// The predicted columns of a measured row: the model d trained in dtype dt at context T, batch sequences
// a rank, on ranks ranks, under FSDP (fsdp, with fd) or else DDP's or ZeRO-1's scheme; comm_bf16: the
// gradients travel as bf16; gather: they are gathered (tsys_ddp_desc.ce_gather), into a receive buffer of the
// other ranks' fp32 gradients (under ZeRO-1 their part this rank owns; owners: ZeRO-1 as the gathered DDP's bucket
// owners, tsys_ddp_desc.shard_state, which receive them whole). pred_state_MiB what a rank keeps between steps,
// pred_peak_MiB the peak, pred_sent_MB the bytes a rank sends per step.
static inline void account_predicted(du_row *row, const tsys_model_desc *d, tsys_dtype dt, int T, int batch, int ranks, bool fsdp, const tsys_fsdp_desc *fd,
                                     tsys_dist_scheme scheme, bool comm_bf16, bool gather, bool owners, unsigned plan_flags) {
    const double MiB = 1048576.0;
    tsys_dist_account acc = fsdp ? tsys_fsdp_accounting_desc(d, fd, batch, T, ranks) : tsys_dist_accounting_ex(d, dt, batch, T, ranks, scheme, plan_flags);
    // autocast's weight copies live only within a step (fsdp: its gathered working set), unless AdamW keeps them
    double transient = fsdp ? acc.work_bytes : dt != TSYS_F32 && !(plan_flags & TSYS_PLAN_KEPT_COPIES) ? acc.param_bytes - 4.0 * (double)tsys_model_desc_num_params(d) : 0;
    const double recv = gather ? acc.grad_bytes * (ranks - 1) / (scheme == TSYS_SCHEME_ZERO1 && !owners ? ranks : 1) : 0;
    du_row_num(row, "pred_state_MiB", "%.1f", (acc.param_bytes + acc.grad_bytes + acc.optim_bytes - transient + recv) / MiB);
    du_row_num(row, "pred_peak_MiB", "%.1f", (acc.total_bytes + recv) / MiB);
    // comm_bf16 halves the gradients' all-reduce (DDP: all of it; ZeRO-1: 2 of its 3 parts, the broadcast stays fp32)
    double sent = acc.sent_bytes * (!comm_bf16 ? 1.0 : scheme == TSYS_SCHEME_ZERO1 ? 2.0 / 3.0 : 0.5);
    if (gather)   // every peer pulls its part of my gradients (all of them under DDP); ZeRO-1's broadcast as before
        sent = recv + (scheme == TSYS_SCHEME_ZERO1 ? acc.sent_bytes / 3.0 : 0.0);
    du_row_num(row, "pred_sent_MB", "%.1f", sent / 1e6);
}

#endif
