// driver_util.h - what every driver shares: strict flag values, comma lists, result tables printed
// as markdown, CSV or JSON lines, and progress on stderr. Included after tsys.h by one driver.
#ifndef TSYS_DRIVER_UTIL_H
#define TSYS_DRIVER_UTIL_H
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdarg.h>
#include <unistd.h>
#include <errno.h>
#ifdef _OPENMP
#include <omp.h>
#endif

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
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return false;
    *out = (int)v;
    return true;
}

static inline bool du_parse_double(const char *s, double *out) {
    char *end;
    double v = strtod(s, &end);
    if (end == s || *end) return false;
    *out = v;
    return true;
}

static inline bool du_format_ok(const char *f) { return !strcmp(f, "md") || !strcmp(f, "csv") || !strcmp(f, "jsonl"); }

typedef struct du_list { char *buf; char *item[64]; int n; } du_list;

// Splits "a,b,c" into items (at most 64); the list owns a copy of the string.
static inline du_list du_split(const char *s) {
    du_list l;
    memset(&l, 0, sizeof(l));
    l.buf = du_strdup(s);
    for (char *tok = strtok(l.buf, ","); tok && l.n < 64; tok = strtok(NULL, ",")) l.item[l.n++] = tok;
    return l;
}
static inline void du_list_free(du_list *l) { free(l->buf); l->buf = NULL; l->n = 0; }

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

// ---- progress on stderr (only when it is a terminal or TSYS_PROGRESS=1) -------------------------

static inline bool du_progress_on(void) {
    const char *e = getenv("TSYS_PROGRESS");
    if (e) return strcmp(e, "0") != 0;
    return isatty(2);
}

static inline void du_progress(const char *fmt, ...) {
    if (!du_progress_on()) return;
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "\r\033[K");
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fflush(stderr);
}
static inline void du_progress_done(void) { if (du_progress_on()) fprintf(stderr, "\r\033[K"); }

// ---- result tables ---------------------------------------------------------------------------

#define DU_MAX_COLS 32
#define DU_CELL 160

typedef struct du_row { char cell[DU_MAX_COLS][DU_CELL]; const char *const *cols; int ncols; } du_row;
typedef struct du_table {
    char *colbuf;
    const char *cols[DU_MAX_COLS];
    int ncols;
    du_row *rows;
    int nrows, cap;
    bool header_done;
} du_table;

static inline void du_table_init(du_table *t, const char *columns) {
    memset(t, 0, sizeof(*t));
    t->colbuf = du_strdup(columns);
    for (char *tok = strtok(t->colbuf, ","); tok && t->ncols < DU_MAX_COLS; tok = strtok(NULL, ",")) t->cols[t->ncols++] = tok;
}

static inline du_row *du_table_row(du_table *t) {
    if (t->nrows == t->cap) {
        t->cap = t->cap ? t->cap * 2 : 16;
        t->rows = (du_row *)realloc(t->rows, sizeof(du_row) * (size_t)t->cap);
    }
    du_row *r = &t->rows[t->nrows++];
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
        for (char *c = r->cell[i]; *c; c++) if (*c == '\n' || *c == '|') *c = ' ';
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
    strtod(s, &end);
    return *end == 0;
}

static inline void du_print_row(const du_table *t, const du_row *r, const char *fmt) {
    if (!strcmp(fmt, "csv")) {
        for (int i = 0; i < t->ncols; i++) {
            bool quote = strchr(r->cell[i], ',') || strchr(r->cell[i], '"');
            printf("%s%s%s%s", i ? "," : "", quote ? "\"" : "", r->cell[i], quote ? "\"" : "");
        }
        printf("\n");
    } else if (!strcmp(fmt, "jsonl")) {
        printf("{");
        for (int i = 0; i < t->ncols; i++) {
            printf("%s\"%s\": ", i ? ", " : "", t->cols[i]);
            if (du_is_number(r->cell[i])) printf("%s", r->cell[i]);
            else {
                printf("\"");
                for (const char *c = r->cell[i]; *c; c++) printf(*c == '"' || *c == '\\' ? "\\%c" : "%c", *c);
                printf("\"");
            }
        }
        printf("}\n");
    } else {
        printf("|");
        for (int i = 0; i < t->ncols; i++) printf(" %s |", r->cell[i]);
        printf("\n");
    }
}

// Prints the row just added (csv and jsonl stream row by row; md waits for the whole table).
static inline void du_table_print_last(du_table *t, const char *fmt) {
    if (!strcmp(fmt, "md") || t->nrows == 0) return;
    if (!strcmp(fmt, "csv") && !t->header_done) {
        for (int i = 0; i < t->ncols; i++) printf("%s%s", i ? "," : "", t->cols[i]);
        printf("\n");
    }
    t->header_done = true;
    du_print_row(t, &t->rows[t->nrows - 1], fmt);
    fflush(stdout);
}

static inline void du_table_print(const du_table *t, const char *fmt) {
    if (strcmp(fmt, "md")) { for (int r = 0; r < t->nrows; r++) du_print_row(t, &t->rows[r], fmt); return; }
    printf("|");
    for (int i = 0; i < t->ncols; i++) printf(" %s |", t->cols[i]);
    printf("\n|");
    for (int i = 0; i < t->ncols; i++) printf("---|");
    printf("\n");
    for (int r = 0; r < t->nrows; r++) du_print_row(t, &t->rows[r], fmt);
    fflush(stdout);
}

static inline void du_table_free(du_table *t) { free(t->colbuf); free(t->rows); memset(t, 0, sizeof(*t)); }

#endif
