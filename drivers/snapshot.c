// snapshot - training-state snapshots from the shell: what a directory holds, and a sharded snapshot
// (ZeRO-1, FSDP: one part per rank) made into a plain one that tsys_model_load, tsys_state_load and
// PyTorch (safetensors) read. Exit status: 0 done, 1 a snapshot that cannot be read or written
// (the message names it), 2 bad usage.
//
//   snapshot info runs/ckpt                      every snapshot there, oldest first
//   snapshot info runs/ckpt/step-000400          one
//   snapshot consolidate runs/ckpt/step-000400 runs/plain
#include "prelude.h"

#include <dirent.h>
#include <sys/stat.h>

static const char *const usage =
    "usage: snapshot info PATH\n"
    "       snapshot consolidate SNAPSHOT DIR\n"
    "\n"
    "  info PATH            PATH is a snapshot (DIR/step-NNNNNN) or a directory of them: for each, its\n"
    "                       name, step, world size (0: plain), tensors; newest: the one tsys_state_latest\n"
    "                       and --resume take\n"
    "  consolidate SNAPSHOT DIR\n"
    "                       SNAPSHOT (sharded or plain) as a plain snapshot of the same name in DIR (made\n"
    "                       if missing), every tensor whole; every file read is checked against its\n"
    "                       CRC-32C first\n"
    "\n"
    "exit status: 0 done, 1 a snapshot could not be read or written, 2 bad usage\n";

static bool is_dir(const char *p) { struct stat st; return stat(p, &st) == 0 && S_ISDIR(st.st_mode); }
static bool has_manifest(const char *dir) {
    char p[4400];   // a path of the directory buffers below, and "/MANIFEST"
    struct stat st;
    snprintf(p, sizeof(p), "%s/MANIFEST", dir);
    return stat(p, &st) == 0;
}

// One row: the snapshot at path; false when it does not open (the row says why).
static bool info_row(tsys_ctx *ctx, const char *path, const char *name, const char *newest) {
    tsys_state_reader *r = tsys_state_open(ctx, path);
    if (!r) {
        printf("| %s | - | - | - | damaged: %s |\n", name, tsys_ctx_last_error(ctx));
        tsys_ctx_clear_error(ctx);
        return false;
    }
    printf("| %s | %lld | %d | %d | ok%s |\n", name, (long long)tsys_state_reader_step(r), tsys_state_reader_world(r), tsys_state_reader_count(r),
           newest && !strcmp(newest, path) ? ", newest" : "");
    tsys_state_close(r);
    return true;
}

static int cmp_names(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static int info(tsys_ctx *ctx, const char *path) {
    if (!is_dir(path)) { fprintf(stderr, "snapshot: '%s' is not a directory\n", path); return 1; }
    printf("| snapshot | step | world | tensors | status |\n|---|---:|---:|---:|---|\n");
    if (has_manifest(path)) return info_row(ctx, path, path, NULL) ? 0 : 1;
    char newest[4200] = "";
    if (tsys_state_latest(ctx, path, newest, sizeof(newest)) != TSYS_OK) { fprintf(stderr, "snapshot: %s\n", tsys_ctx_last_error(ctx)); return 1; }
    DIR *d = opendir(path);
    if (!d) { fprintf(stderr, "snapshot: cannot read '%s': %s\n", path, strerror(errno)); return 1; }
    char **names = NULL;
    int n = 0, ok = 1;
    for (struct dirent *e; (e = readdir(d));) {
        char p[4200];
        if (snprintf(p, sizeof(p), "%s/%s", path, e->d_name) >= (int)sizeof(p)) continue;   // too long to be one of ours
        if (e->d_name[0] == '.' || !is_dir(p) || !has_manifest(p)) continue;   // temporaries, other files
        char **grown = (char **)realloc(names, sizeof(char *) * (size_t)(n + 1));
        if (!grown || !(grown[n] = strdup(e->d_name))) { names = grown ? grown : names; ok = 0; break; }
        names = grown; n++;
    }
    closedir(d);
    qsort(names, (size_t)n, sizeof(char *), cmp_names);   // step-NNNNNN names sort by step
    for (int i = 0; i < n; i++) {
        char p[4200];
        snprintf(p, sizeof(p), "%s/%s", path, names[i]);
        ok &= info_row(ctx, p, names[i], newest);
        free(names[i]);
    }
    free(names);
    if (!n) fprintf(stderr, "snapshot: no snapshot in '%s'\n", path);
    return ok && n ? 0 : 1;
}

static int consolidate(tsys_ctx *ctx, const char *src, const char *dst) {
    if (mkdir(dst, 0755) != 0 && errno != EEXIST) { fprintf(stderr, "snapshot: cannot make '%s': %s\n", dst, strerror(errno)); return 1; }
    if (tsys_state_consolidate(ctx, src, dst) != TSYS_OK) { fprintf(stderr, "snapshot: %s\n", tsys_ctx_last_error(ctx)); return 1; }
    const char *name = strrchr(src, '/');
    printf("%s -> %s/%s\n", src, dst, name ? name + 1 : src);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) { fputs(usage, stdout); return 0; }
    bool is_info = argc == 3 && !strcmp(argv[1], "info"), is_cons = argc == 4 && !strcmp(argv[1], "consolidate");
    if (!is_info && !is_cons) {
        fprintf(stderr, "snapshot: %s\n%s", argc < 2 ? "a command is needed" : "unknown command or wrong number of arguments", usage);
        return 2;
    }
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    if (!ctx) { fprintf(stderr, "snapshot: out of memory\n"); return 1; }
    int rc = is_info ? info(ctx, argv[2]) : consolidate(ctx, argv[2], argv[3]);
    tsys_ctx_free(ctx);
    return rc;
}
