// fuzz_flags.c - libFuzzer harness for the drivers' flag parsers (e2e, attn, precision, memory).
//
// The first byte of an input picks the driver (mod 4: e2e, attn, precision, memory); the rest, split on NUL
// bytes, is its argv. The driver's real main runs with --dry-run first, so everything up to the
// point where measuring would start runs (parsing, every list and value check, the configuration
// line, the error and help paths) and nothing is measured. The Makefile compiles each driver on its
// own with -Dmain=<driver>_main -DTSYS_STATIC, so the four link into this one program. The parsers
// never call exit(); a usage error must come back as status 2, and nothing may leak.
//
//   make fuzz                         (FUZZ_SECONDS=60 by default; the seeds: tests/fuzz/corpus/fuzz_flags)
//   build/fuzz/fuzz_flags -dict=tests/fuzz/flags.dict -close_fd_mask=3 build/fuzz/corpus_fuzz_flags tests/fuzz/corpus/fuzz_flags
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int e2e_main(int argc, char **argv);
int attn_main(int argc, char **argv);
int precision_main(int argc, char **argv);
int memory_main(int argc, char **argv);

#define FZ_MAX_ARGS 64

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    static const char *const names[4] = { "e2e", "attn", "precision", "memory" };
    int which = data[0] % 4;
    // one NUL-terminated copy of the rest, cut into arguments at each NUL
    char *buf = (char *)malloc(size);
    if (!buf) return 0;
    memcpy(buf, data + 1, size - 1);
    buf[size - 1] = 0;
    char *argv[FZ_MAX_ARGS + 3];
    int argc = 0;
    argv[argc++] = (char *)names[which];
    argv[argc++] = (char *)"--dry-run";
    for (size_t i = 0; i < size - 1 && argc < FZ_MAX_ARGS + 2; ) {
        argv[argc++] = buf + i;
        i += strlen(buf + i) + 1;
    }
    argv[argc] = NULL;
    int rc = which == 0 ? e2e_main(argc, argv) : which == 1 ? attn_main(argc, argv) : which == 2 ? precision_main(argc, argv) : memory_main(argc, argv);
    free(buf);
    if (rc != 0 && rc != 2) abort();   // a dry run either accepts the flags (0) or is a usage error (2)
    return 0;
}
