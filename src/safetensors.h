// >>safetensors -----------------------------------------------------------------------------------
//
// safetensors I/O (https://github.com/huggingface/safetensors): an 8-byte little-endian header
// length N, N bytes of JSON
//     {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
//      "__metadata__": {"key": "value", ...}}
// and the data buffer; offsets are relative to the buffer's start (byte 8 + N).
//
// The loader faces untrusted files, so it is strict, in the same places as the reference Rust
// implementation: the header is at most 100 MB and must lie inside the file; the JSON is parsed
// completely (a private recursive-descent parser with a nesting limit) and nothing but spaces may
// follow it; every tensor names a known dtype, a shape whose byte size equals its data_offsets
// range, and the ranges tile the data buffer exactly (no overlap, no gap, nothing left over); names
// are unique. Every violation is a TSYS_ERR_IO error naming the file and the tensor; no byte is read
// outside the file and no buffer larger than the file is allocated.
//
// Tensor data is streamed tensor by tensor (fseek + fread), never the whole file at once, so loading
// a 13 GB checkpoint needs one tensor of staging memory at most. Host byte order must be little
// endian, like the format (checked at run time).
//
// Fragment of tsys.h's implementation: it uses only the public API above, libc, and the
// TSYS_MALLOC/TSYS_REALLOC/TSYS_FREE macros of >>config. It defines TSYS__HAVE_SAFETENSORS, which
// switches off the "not built" placeholders, so it must come before them.
#define TSYS__HAVE_SAFETENSORS 1

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdarg.h>
#include <errno.h>
#include <limits.h>

#define TSYS__ST_MAX_HEADER   100000000u   // same limit as the Rust crate (MAX_HEADER_SIZE)
#define TSYS__ST_MAX_DEPTH    64           // JSON nesting limit: no stack overflow on "[[[[..."
#define TSYS__ST_MAX_DIMS     8            // dims the parser accepts; loading needs <= TSYS_MAX_DIMS
#define TSYS__ST_ERR_LEN      512

// Host scratch memory for headers and staging buffers (not tensor storage, so not tracked).
// Never asks for 0 bytes, whose result malloc may leave NULL.
static void *tsys__st_malloc(size_t n) { return TSYS_MALLOC(n ? n : 1); }
static void *tsys__st_realloc(void *p, size_t n) { return TSYS_REALLOC(p, n ? n : 1); }
static void tsys__st_free(void *p) { if (p) TSYS_FREE(p); }

// ---- errors ---------------------------------------------------------------------------------------

// Every message starts with "safetensors '<path>': " so the user knows which file is broken.
static tsys_status tsys__st_fail(tsys_ctx *ctx, tsys_status s, const char *path, const char *fmt, ...) {
    char msg[TSYS__ST_ERR_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return tsys_ctx_set_error(ctx, s, "safetensors '%s': %s", path, msg);
}

static bool tsys__st_host_is_le(void) {
    const uint16_t one = 1;
    unsigned char b;
    memcpy(&b, &one, 1);
    return b == 1;
}

// ---- dtypes ---------------------------------------------------------------------------------------

static const char *tsys__st_dtype_str(tsys_dtype dt) {
    switch (dt) {
    case TSYS_F32: return "F32";
    case TSYS_BF16: return "BF16";
    case TSYS_F16: return "F16";
    case TSYS_I32: return "I32";
    case TSYS_I64: return "I64";
    default: return NULL;
    }
}

static bool tsys__st_dtype_parse(const char *s, tsys_dtype *out) {
    for (int d = 0; d < TSYS_DTYPE_COUNT; d++) {
        const char *name = tsys__st_dtype_str((tsys_dtype)d);
        if (name && strcmp(s, name) == 0) { *out = (tsys_dtype)d; return true; }
    }
    return false;
}

// ---- the parsed header ----------------------------------------------------------------------------

typedef struct tsys__st_entry {
    char *name;                          // owned; may exceed TSYS_NAME_LEN (then it cannot be loaded)
    tsys_dtype dtype;
    int ndim;
    int64_t shape[TSYS__ST_MAX_DIMS];
    uint64_t begin, end;                 // byte range inside the data buffer
} tsys__st_entry;

typedef struct tsys__st_file {
    tsys_ctx *ctx;
    const char *path;
    FILE *f;
    uint64_t file_bytes;
    uint64_t data_start;                 // 8 + header length
    uint64_t data_bytes;
    tsys__st_entry *entries;
    int n, cap;
    bool has_metadata;
} tsys__st_file;

static void tsys__st_close(tsys__st_file *sf) {
    for (int i = 0; i < sf->n; i++) tsys__st_free(sf->entries[i].name);
    tsys__st_free(sf->entries);
    if (sf->f) fclose(sf->f);
    memset(sf, 0, sizeof *sf);
}

// Writes "(2, 3)" (or "()" for a scalar) into buf; used in shape-mismatch messages.
static const char *tsys__st_shape_str(char *buf, size_t len, int ndim, const int64_t *shape) {
    size_t used = (size_t)snprintf(buf, len, "(");
    for (int i = 0; i < ndim && used < len; i++)
        used += (size_t)snprintf(buf + used, len - used, i ? ", %lld" : "%lld", (long long)shape[i]);
    if (used < len) snprintf(buf + used, len - used, ")");
    return buf;
}

// ---- a strict JSON parser for the header -----------------------------------------------------------

typedef struct tsys__st_parser {
    tsys__st_file *sf;
    const char *begin, *p, *end;         // the header bytes; p never passes end
    int depth;
    const char *tensor;                  // entry being parsed, for messages (NULL at top level)
} tsys__st_parser;

static tsys_status tsys__st_syntax(tsys__st_parser *P, const char *what) {
    long at = (long)(P->p - P->begin);
    if (P->tensor)
        return tsys__st_fail(P->sf->ctx, TSYS_ERR_IO, P->sf->path, "garbled header JSON in tensor '%s': %s at byte %ld of the header",
                             P->tensor, what, at);
    return tsys__st_fail(P->sf->ctx, TSYS_ERR_IO, P->sf->path, "garbled header JSON: %s at byte %ld of the header", what, at);
}

static void tsys__st_ws(tsys__st_parser *P) {
    while (P->p < P->end && (*P->p == ' ' || *P->p == '\t' || *P->p == '\n' || *P->p == '\r')) P->p++;
}

// Skips whitespace and consumes c if it is next.
static bool tsys__st_accept(tsys__st_parser *P, char c) {
    tsys__st_ws(P);
    if (P->p < P->end && *P->p == c) { P->p++; return true; }
    return false;
}

static tsys_status tsys__st_expect(tsys__st_parser *P, char c) {
    char what[32];
    if (tsys__st_accept(P, c)) return TSYS_OK;
    snprintf(what, sizeof what, P->p < P->end ? "expected '%c'" : "expected '%c', header ended", c);
    return tsys__st_syntax(P, what);
}

static int tsys__st_hex4(const char *s) {
    int v = 0;
    for (int i = 0; i < 4; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return -1;
        v = v * 16 + d;
    }
    return v;
}

// Reads a \uXXXX escape (P->p just past the 'u'), joining surrogate pairs; returns the code point or -1.
static long tsys__st_unicode_escape(tsys__st_parser *P) {
    if (P->end - P->p < 4) return -1;
    long cp = tsys__st_hex4(P->p);
    if (cp < 0) return -1;
    P->p += 4;
    if (cp >= 0xDC00 && cp <= 0xDFFF) return -1;                      // lone low surrogate
    if (cp >= 0xD800 && cp <= 0xDBFF) {
        if (P->end - P->p < 6 || P->p[0] != '\\' || P->p[1] != 'u') return -1;
        long lo = tsys__st_hex4(P->p + 2);
        if (lo < 0xDC00 || lo > 0xDFFF) return -1;
        P->p += 6;
        cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
    }
    return cp;
}

static size_t tsys__st_utf8(long cp, char *out) {
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    if (cp < 0x800) { out[0] = (char)(0xC0 | (cp >> 6)); out[1] = (char)(0x80 | (cp & 0x3F)); return 2; }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12)); out[1] = (char)(0x80 | ((cp >> 6) & 0x3F)); out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18)); out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F)); out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

// Parses a JSON string. With out != NULL the decoded bytes land in a new NUL-terminated buffer;
// an escaped NUL is refused there, because it would silently cut a tensor name short.
static tsys_status tsys__st_string(tsys__st_parser *P, char **out) {
    tsys_status s = tsys__st_expect(P, '"');
    if (s != TSYS_OK) return s;
    // The decoded string is never longer than its JSON form, so one allocation of that size is enough.
    const char *q = P->p;
    while (q < P->end && *q != '"') q += (*q == '\\' && q + 1 < P->end) ? 2 : 1;
    char *buf = out ? (char *)tsys__st_malloc((size_t)(q - P->p) + 1) : NULL;
    size_t n = 0;
    if (out && !buf) return tsys_ctx_set_error(P->sf->ctx, TSYS_ERR_OOM, "safetensors '%s': out of memory parsing the header", P->sf->path);
    for (;;) {
        if (P->p >= P->end) { s = tsys__st_syntax(P, "unterminated string"); break; }
        unsigned char c = (unsigned char)*P->p++;
        if (c == '"') { s = TSYS_OK; break; }
        if (c < 0x20) { P->p--; s = tsys__st_syntax(P, "control character in string"); break; }
        if (c != '\\') { if (buf) buf[n] = (char)c; n++; continue; }
        if (P->p >= P->end) { s = tsys__st_syntax(P, "unterminated escape"); break; }
        char e = *P->p++;
        static const char escaped[] = "\"\\/bfnrt", decoded[] = "\"\\/\b\f\n\r\t";
        const char *simple = e ? strchr(escaped, e) : NULL;
        if (simple) {
            if (buf) buf[n] = decoded[simple - escaped];
            n++;
            continue;
        }
        long cp = e == 'u' ? tsys__st_unicode_escape(P) : -1;
        if (cp < 0 || (cp == 0 && buf)) { s = tsys__st_syntax(P, "bad escape in string"); break; }
        char tmp[4];
        size_t k = tsys__st_utf8(cp, tmp);
        if (buf) memcpy(buf + n, tmp, k);   // fits: \uXXXX is 6 bytes for <= 3 decoded, a pair 12 for 4
        n += k;
    }
    if (s != TSYS_OK) { tsys__st_free(buf); return s; }
    if (out) { buf[n] = 0; *out = buf; }
    return TSYS_OK;
}

// A non-negative JSON integer without sign, fraction or exponent, below 2^63 (shapes, offsets).
static tsys_status tsys__st_uint(tsys__st_parser *P, uint64_t *out) {
    tsys__st_ws(P);
    if (P->p >= P->end || *P->p < '0' || *P->p > '9') return tsys__st_syntax(P, "expected a non-negative integer");
    if (*P->p == '0' && P->p + 1 < P->end && P->p[1] >= '0' && P->p[1] <= '9') return tsys__st_syntax(P, "leading zero in integer");
    uint64_t v = 0;
    while (P->p < P->end && *P->p >= '0' && *P->p <= '9') {
        uint64_t d = (uint64_t)(*P->p - '0');
        if (v > ((uint64_t)INT64_MAX - d) / 10) return tsys__st_syntax(P, "integer too large");
        v = v * 10 + d;
        P->p++;
    }
    if (P->p < P->end && (*P->p == '.' || *P->p == 'e' || *P->p == 'E')) return tsys__st_syntax(P, "expected an integer, found a fraction");
    *out = v;
    return TSYS_OK;
}

static tsys_status tsys__st_skip_value(tsys__st_parser *P);

// Any JSON number, validated and discarded (only __metadata__ and unknown fields get here).
static tsys_status tsys__st_skip_number(tsys__st_parser *P) {
#define TSYS__ST_DIGITS(min) do { const char *d0 = P->p; \
        while (P->p < P->end && *P->p >= '0' && *P->p <= '9') P->p++; \
        if (P->p - d0 < (min)) return tsys__st_syntax(P, "bad number"); } while (0)
    if (P->p < P->end && *P->p == '-') P->p++;
    if (P->end - P->p >= 2 && P->p[0] == '0' && P->p[1] >= '0' && P->p[1] <= '9') return tsys__st_syntax(P, "leading zero in number");
    TSYS__ST_DIGITS(1);
    if (P->p < P->end && *P->p == '.') { P->p++; TSYS__ST_DIGITS(1); }
    if (P->p < P->end && (*P->p == 'e' || *P->p == 'E')) {
        P->p++;
        if (P->p < P->end && (*P->p == '+' || *P->p == '-')) P->p++;
        TSYS__ST_DIGITS(1);
    }
#undef TSYS__ST_DIGITS
    return TSYS_OK;
}

static tsys_status tsys__st_skip_literal(tsys__st_parser *P, const char *word) {
    size_t n = strlen(word);
    if ((size_t)(P->end - P->p) < n || memcmp(P->p, word, n) != 0) return tsys__st_syntax(P, "unexpected character");
    P->p += n;
    return TSYS_OK;
}

// Arrays and objects, element by element; `close` is ']' or '}'.
static tsys_status tsys__st_skip_container(tsys__st_parser *P, char close) {
    tsys_status s;
    P->p++;   // the opening bracket
    if (++P->depth > TSYS__ST_MAX_DEPTH) return tsys__st_syntax(P, "nesting too deep");
    if (tsys__st_accept(P, close)) { P->depth--; return TSYS_OK; }
    do {
        if (close == '}') {
            if ((s = tsys__st_string(P, NULL)) != TSYS_OK) return s;
            if ((s = tsys__st_expect(P, ':')) != TSYS_OK) return s;
        }
        if ((s = tsys__st_skip_value(P)) != TSYS_OK) return s;
    } while (tsys__st_accept(P, ','));
    P->depth--;
    return tsys__st_expect(P, close);
}

static tsys_status tsys__st_skip_value(tsys__st_parser *P) {
    tsys__st_ws(P);
    if (P->p >= P->end) return tsys__st_syntax(P, "expected a value, header ended");
    switch (*P->p) {
    case '"': return tsys__st_string(P, NULL);
    case '{': return tsys__st_skip_container(P, '}');
    case '[': return tsys__st_skip_container(P, ']');
    case 't': return tsys__st_skip_literal(P, "true");
    case 'f': return tsys__st_skip_literal(P, "false");
    case 'n': return tsys__st_skip_literal(P, "null");
    default: return tsys__st_skip_number(P);
    }
}

// [a, b, ...] of non-negative integers, at most max of them.
static tsys_status tsys__st_uint_array(tsys__st_parser *P, uint64_t *vals, int max, int *count) {
    tsys_status s = tsys__st_expect(P, '[');
    *count = 0;
    if (s != TSYS_OK || tsys__st_accept(P, ']')) return s;
    do {
        if (*count == max) return tsys__st_syntax(P, "too many elements in array");
        if ((s = tsys__st_uint(P, &vals[(*count)++])) != TSYS_OK) return s;
    } while (tsys__st_accept(P, ','));
    return tsys__st_expect(P, ']');
}

// {"dtype": .., "shape": [..], "data_offsets": [b, e]}; other fields are checked as JSON and
// ignored, as the reference implementation does.
static tsys_status tsys__st_tensor_info(tsys__st_parser *P, tsys__st_entry *e) {
    tsys_status s = tsys__st_expect(P, '{');
    bool seen_dtype = false, seen_shape = false, seen_offsets = false;
    if (s != TSYS_OK) return s;
    if (!tsys__st_accept(P, '}')) do {
        char *key = NULL;
        if ((s = tsys__st_string(P, &key)) != TSYS_OK) return s;
        if ((s = tsys__st_expect(P, ':')) != TSYS_OK) { tsys__st_free(key); return s; }
        bool *seen = strcmp(key, "dtype") == 0 ? &seen_dtype : strcmp(key, "shape") == 0 ? &seen_shape
                   : strcmp(key, "data_offsets") == 0 ? &seen_offsets : NULL;
        if (seen && *seen) { tsys__st_free(key); return tsys__st_syntax(P, "duplicate field"); }
        if (seen) *seen = true;
        if (seen == &seen_dtype) {
            char *dt = NULL;
            if ((s = tsys__st_string(P, &dt)) == TSYS_OK && !tsys__st_dtype_parse(dt, &e->dtype))
                s = tsys__st_fail(P->sf->ctx, TSYS_ERR_IO, P->sf->path, "tensor '%s': unknown dtype '%.16s' (tsys reads F32, BF16, F16, I32, I64)", e->name, dt);
            tsys__st_free(dt);
        } else if (seen == &seen_shape) {
            uint64_t dims[TSYS__ST_MAX_DIMS];
            s = tsys__st_uint_array(P, dims, TSYS__ST_MAX_DIMS, &e->ndim);
            for (int i = 0; s == TSYS_OK && i < e->ndim; i++) e->shape[i] = (int64_t)dims[i];
        } else if (seen == &seen_offsets) {
            uint64_t off[3];
            int n = 0;
            s = tsys__st_uint_array(P, off, 3, &n);
            if (s == TSYS_OK && n != 2) s = tsys__st_syntax(P, "data_offsets must hold 2 integers");
            if (s == TSYS_OK) { e->begin = off[0]; e->end = off[1]; }
        } else {
            s = tsys__st_skip_value(P);
        }
        tsys__st_free(key);
        if (s != TSYS_OK) return s;
    } while (tsys__st_accept(P, ','));
    if ((s = tsys__st_expect(P, '}')) != TSYS_OK) return s;
    if (!seen_dtype || !seen_shape || !seen_offsets)
        return tsys__st_fail(P->sf->ctx, TSYS_ERR_IO, P->sf->path, "tensor '%s': header entry lacks %s", e->name,
                             !seen_dtype ? "\"dtype\"" : !seen_shape ? "\"shape\"" : "\"data_offsets\"");
    return TSYS_OK;
}

static int tsys__st_find(const tsys__st_file *sf, const char *name) {
    for (int i = 0; i < sf->n; i++)
        if (strcmp(sf->entries[i].name, name) == 0) return i;
    return -1;
}

// "__metadata__": an object, validated and ignored; at most one.
static tsys_status tsys__st_metadata(tsys__st_parser *P) {
    tsys_status s;
    if (P->sf->has_metadata) return tsys__st_fail(P->sf->ctx, TSYS_ERR_IO, P->sf->path, "'__metadata__' appears twice in the header");
    P->sf->has_metadata = true;
    if ((s = tsys__st_expect(P, ':')) != TSYS_OK) return s;
    tsys__st_ws(P);
    if (P->p >= P->end || *P->p != '{') return tsys__st_syntax(P, "__metadata__ must be an object");
    return tsys__st_skip_value(P);
}

// One "name": {...} member of the top-level object; takes ownership of name.
static tsys_status tsys__st_member(tsys__st_parser *P, char *name) {
    tsys__st_file *sf = P->sf;
    tsys_status s;
    if (tsys__st_find(sf, name) >= 0) {
        s = tsys__st_fail(sf->ctx, TSYS_ERR_IO, sf->path, "tensor '%s' appears twice in the header", name);
        tsys__st_free(name);
        return s;
    }
    if (sf->n == sf->cap) {
        int cap = sf->cap ? 2 * sf->cap : 64;
        tsys__st_entry *grown = (tsys__st_entry *)tsys__st_realloc(sf->entries, (size_t)cap * sizeof *grown);
        if (!grown) { tsys__st_free(name); return tsys_ctx_set_error(sf->ctx, TSYS_ERR_OOM, "safetensors '%s': out of memory parsing the header", sf->path); }
        sf->entries = grown; sf->cap = cap;
    }
    tsys__st_entry *e = &sf->entries[sf->n++];
    memset(e, 0, sizeof *e);
    e->name = name;   // owned by the file from here on, freed by tsys__st_close
    P->tensor = name;
    if ((s = tsys__st_expect(P, ':')) == TSYS_OK) s = tsys__st_tensor_info(P, e);
    P->tensor = NULL;
    return s;
}

// The top-level object: one member per tensor, plus an optional "__metadata__"; nothing but
// whitespace may follow it (the writer pads with spaces).
static tsys_status tsys__st_header(tsys__st_parser *P) {
    tsys_status s = tsys__st_expect(P, '{');
    if (s != TSYS_OK) return s;
    if (!tsys__st_accept(P, '}')) {
        do {
            char *name = NULL;
            if ((s = tsys__st_string(P, &name)) != TSYS_OK) return s;
            if (strcmp(name, "__metadata__") == 0) { tsys__st_free(name); s = tsys__st_metadata(P); }
            else s = tsys__st_member(P, name);
            if (s != TSYS_OK) return s;
        } while (tsys__st_accept(P, ','));
        if ((s = tsys__st_expect(P, '}')) != TSYS_OK) return s;
    }
    tsys__st_ws(P);
    if (P->p != P->end) return tsys__st_syntax(P, "unexpected bytes after the header object");
    return TSYS_OK;
}

// ---- layout checks --------------------------------------------------------------------------------

// numel * dtype size, or false on overflow. A zero dim makes the product 0 whatever the others are.
static bool tsys__st_entry_bytes(const tsys__st_entry *e, uint64_t *bytes) {
    uint64_t n = tsys_dtype_size(e->dtype);
    *bytes = 0;
    for (int i = 0; i < e->ndim; i++)
        if (e->shape[i] == 0) return true;
    for (int i = 0; i < e->ndim; i++) {
        uint64_t d = (uint64_t)e->shape[i];
        if (d && n > UINT64_MAX / d) return false;
        n *= d;
    }
    *bytes = n;
    return true;
}

static int tsys__st_cmp_range(const void *a, const void *b) {
    const tsys__st_entry *x = *(const tsys__st_entry *const *)a, *y = *(const tsys__st_entry *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

// Each tensor's range matches its shape and dtype and lies in the buffer; sorted by offset, the
// ranges tile the buffer exactly. A hole or overlap means a damaged or hand-edited file.
static tsys_status tsys__st_check_layout(tsys__st_file *sf) {
    for (int i = 0; i < sf->n; i++) {
        const tsys__st_entry *e = &sf->entries[i];
        uint64_t bytes = 0;
        char sh[160];
        if (e->begin > e->end || e->end > sf->data_bytes)
            return tsys__st_fail(sf->ctx, TSYS_ERR_IO, sf->path, "tensor '%s': data_offsets [%llu, %llu] %s the %llu-byte data buffer",
                                 e->name, (unsigned long long)e->begin, (unsigned long long)e->end,
                                 e->begin > e->end ? "are reversed; they must be a range in" : "lie outside", (unsigned long long)sf->data_bytes);
        if (!tsys__st_entry_bytes(e, &bytes))
            return tsys__st_fail(sf->ctx, TSYS_ERR_IO, sf->path, "tensor '%s': %s %s overflows 64-bit sizes", e->name,
                                 tsys__st_dtype_str(e->dtype), tsys__st_shape_str(sh, sizeof sh, e->ndim, e->shape));
        if (bytes != e->end - e->begin)
            return tsys__st_fail(sf->ctx, TSYS_ERR_IO, sf->path, "tensor '%s': data_offsets [%llu, %llu] hold %llu bytes, but %s %s needs %llu",
                                 e->name, (unsigned long long)e->begin, (unsigned long long)e->end, (unsigned long long)(e->end - e->begin),
                                 tsys__st_dtype_str(e->dtype), tsys__st_shape_str(sh, sizeof sh, e->ndim, e->shape), (unsigned long long)bytes);
    }
    const tsys__st_entry **order = (const tsys__st_entry **)tsys__st_malloc((size_t)sf->n * sizeof *order);
    if (!order) return tsys_ctx_set_error(sf->ctx, TSYS_ERR_OOM, "safetensors '%s': out of memory checking the layout", sf->path);
    for (int i = 0; i < sf->n; i++) order[i] = &sf->entries[i];
    qsort(order, (size_t)sf->n, sizeof *order, tsys__st_cmp_range);
    uint64_t at = 0;
    tsys_status s = TSYS_OK;
    for (int i = 0; i < sf->n && s == TSYS_OK; i++) {
        if (order[i]->begin != at)
            s = tsys__st_fail(sf->ctx, TSYS_ERR_IO, sf->path, "tensor '%s': data_offsets start at %llu, but the previous tensor ends at %llu (%s)",
                              order[i]->name, (unsigned long long)order[i]->begin, (unsigned long long)at, order[i]->begin < at ? "overlap" : "gap");
        at = order[i]->end;
    }
    if (s == TSYS_OK && at != sf->data_bytes)
        s = tsys__st_fail(sf->ctx, TSYS_ERR_IO, sf->path, "tensors cover %llu bytes of the %llu-byte data buffer (trailing bytes)",
                          (unsigned long long)at, (unsigned long long)sf->data_bytes);
    tsys__st_free(order);
    return s;
}

// ---- opening a file -------------------------------------------------------------------------------

// Opens, reads and parses the header, validates the layout. On error the file is closed.
static tsys_status tsys__st_open(tsys_ctx *ctx, const char *path, tsys__st_file *sf) {
    memset(sf, 0, sizeof *sf);
    sf->ctx = ctx; sf->path = path;
    if (!tsys__st_host_is_le()) return tsys__st_fail(ctx, TSYS_ERR_UNSUPPORTED, path, "big-endian hosts are not supported");
    sf->f = fopen(path, "rb");
    if (!sf->f) return tsys__st_fail(ctx, TSYS_ERR_IO, path, "cannot open: %s", strerror(errno));
    long size = -1;
    if (fseek(sf->f, 0, SEEK_END) == 0) size = ftell(sf->f);
    if (size < 0 || fseek(sf->f, 0, SEEK_SET) != 0) { tsys__st_close(sf); return tsys__st_fail(ctx, TSYS_ERR_IO, path, "cannot determine the file size"); }
    sf->file_bytes = (uint64_t)size;
    unsigned char len8[8];
    if (sf->file_bytes < 8 || fread(len8, 1, 8, sf->f) != 8) {
        tsys__st_close(sf);
        return tsys__st_fail(ctx, TSYS_ERR_IO, path, "file is %llu bytes, too short for the 8-byte header length", (unsigned long long)size);
    }
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | len8[i];
    if (hlen > sf->file_bytes - 8) {
        tsys__st_close(sf);
        return tsys__st_fail(ctx, TSYS_ERR_IO, path, "header length %llu runs past the end of the file (%llu bytes): truncated or not a safetensors file",
                             (unsigned long long)hlen, (unsigned long long)size);
    }
    if (hlen > TSYS__ST_MAX_HEADER || hlen < 2) {
        tsys__st_close(sf);
        return tsys__st_fail(ctx, TSYS_ERR_IO, path, "header length %llu is outside [2, %u]", (unsigned long long)hlen, TSYS__ST_MAX_HEADER);
    }
    char *hdr = (char *)tsys__st_malloc((size_t)hlen);
    if (!hdr) { tsys__st_close(sf); return tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "safetensors '%s': out of memory for a %llu-byte header", path, (unsigned long long)hlen); }
    tsys_status s = TSYS_OK;
    if (fread(hdr, 1, (size_t)hlen, sf->f) != (size_t)hlen) s = tsys__st_fail(ctx, TSYS_ERR_IO, path, "short read in the header");
    sf->data_start = 8 + hlen;
    sf->data_bytes = sf->file_bytes - sf->data_start;
    if (s == TSYS_OK) {
        tsys__st_parser P;
        memset(&P, 0, sizeof P);
        P.sf = sf; P.begin = P.p = hdr; P.end = hdr + hlen;
        s = tsys__st_header(&P);
    }
    tsys__st_free(hdr);
    if (s == TSYS_OK) s = tsys__st_check_layout(sf);
    if (s != TSYS_OK) tsys__st_close(sf);
    return s;
}

// Reads entry e's bytes into dst (e->end - e->begin bytes).
static tsys_status tsys__st_read(tsys__st_file *sf, const tsys__st_entry *e, void *dst) {
    size_t n = (size_t)(e->end - e->begin);
    uint64_t at = sf->data_start + e->begin;
    if (n == 0) return TSYS_OK;
    if (at > (uint64_t)LONG_MAX) return tsys__st_fail(sf->ctx, TSYS_ERR_IO, sf->path, "tensor '%s': offset past what fseek reaches here", e->name);
    if (fseek(sf->f, (long)at, SEEK_SET) != 0 || fread(dst, 1, n, sf->f) != n)
        return tsys__st_fail(sf->ctx, TSYS_ERR_IO, sf->path, "tensor '%s': short read (file changed or truncated?)", e->name);
    return TSYS_OK;
}

// ---- host <-> tensor --------------------------------------------------------------------------------

// Puts host bytes (t's dtype, t's size) into t on its device: CPU directly, other devices through a
// temporary CPU tensor and the backend's copy.
static tsys_status tsys__st_upload(tsys_ctx *ctx, tsys_tensor *t, const void *host) {
    if (t->device == TSYS_CPU) {
        memcpy(tsys_tensor_data(t), host, tsys_tensor_bytes(t));
        return TSYS_OK;
    }
    tsys_tensor *tmp = tsys_tensor_from_data(ctx, t->dtype, TSYS_CPU, t->ndim, t->shape, host);
    if (!tmp) return tsys_ctx_status(ctx) != TSYS_OK ? tsys_ctx_status(ctx) : TSYS_ERR_OOM;
    tsys_status s = tsys_tensor_copy_from(ctx, t, tmp);
    tsys_tensor_release(tmp);
    return s;
}

// Element-wise float conversion between F32 and BF16/F16 (the pairs load_into accepts).
static void tsys__st_convert(void *dst, tsys_dtype dd, const void *src, tsys_dtype sd, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        float f;
        uint16_t h;
        if (sd == TSYS_F32) memcpy(&f, (const char *)src + 4 * i, 4);
        else { memcpy(&h, (const char *)src + 2 * i, 2); f = sd == TSYS_BF16 ? tsys_bf16_to_f32(h) : tsys_f16_to_f32(h); }
        if (dd == TSYS_F32) memcpy((char *)dst + 4 * i, &f, 4);
        else { h = dd == TSYS_BF16 ? tsys_f32_to_bf16(f) : tsys_f32_to_f16(f); memcpy((char *)dst + 2 * i, &h, 2); }
    }
}

// Fills t from entry e, converting F32 <-> BF16/F16 when the dtypes differ. CPU tensors of the
// file's dtype are read straight into their storage; everything else goes through staging.
static tsys_status tsys__st_fill(tsys__st_file *sf, const tsys__st_entry *e, tsys_tensor *t) {
    if (t->dtype == e->dtype && t->device == TSYS_CPU) return tsys__st_read(sf, e, tsys_tensor_data(t));
    size_t file_bytes = (size_t)(e->end - e->begin);
    size_t conv_bytes = t->dtype == e->dtype ? 0 : tsys_tensor_bytes(t);
    char *buf = (char *)tsys__st_malloc(file_bytes + conv_bytes);
    if (!buf) return tsys_ctx_set_error(sf->ctx, TSYS_ERR_OOM, "safetensors '%s': tensor '%s': out of memory for %llu staging bytes",
                                        sf->path, e->name, (unsigned long long)(file_bytes + conv_bytes));
    tsys_status s = tsys__st_read(sf, e, buf);
    if (s == TSYS_OK && conv_bytes) tsys__st_convert(buf + file_bytes, t->dtype, buf, e->dtype, tsys_tensor_numel(t));
    if (s == TSYS_OK) s = tsys__st_upload(sf->ctx, t, buf + (conv_bytes ? file_bytes : 0));
    tsys__st_free(buf);
    return s;
}

static bool tsys__st_convertible(tsys_dtype file, tsys_dtype tensor) {
    if (file == tensor) return true;
    return (file == TSYS_F32 && (tensor == TSYS_BF16 || tensor == TSYS_F16)) ||
           (tensor == TSYS_F32 && (file == TSYS_BF16 || file == TSYS_F16));
}

// ---- public entry points ----------------------------------------------------------------------------

TSYSDEF void tsys_tensor_list_free(tsys_tensor **list, int n) {
    if (!list) return;
    for (int i = 0; i < n; i++) tsys_tensor_release(list[i]);
    tsys__st_free(list);
}

TSYSDEF tsys_status tsys_safetensors_load(tsys_ctx *ctx, const char *path, tsys_device dev, tsys_tensor ***out, int *n) {
    if (!ctx || !path || !out || !n) return ctx ? tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "tsys_safetensors_load: NULL argument") : TSYS_ERR_INVALID_ARGS;
    *out = NULL; *n = 0;
    tsys__st_file sf;
    tsys_status s = tsys__st_open(ctx, path, &sf);
    if (s != TSYS_OK) return s;
    tsys_tensor **list = (tsys_tensor **)tsys__st_malloc((size_t)sf.n * sizeof *list);
    int made = 0;
    if (!list) s = tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "safetensors '%s': out of memory", path);
    for (int i = 0; s == TSYS_OK && i < sf.n; i++) {
        const tsys__st_entry *e = &sf.entries[i];
        if (e->ndim > TSYS_MAX_DIMS) { s = tsys__st_fail(ctx, TSYS_ERR_UNSUPPORTED, path, "tensor '%s' has %d dims; tsys tensors have at most %d", e->name, e->ndim, TSYS_MAX_DIMS); break; }
        if (strlen(e->name) >= TSYS_NAME_LEN) { s = tsys__st_fail(ctx, TSYS_ERR_UNSUPPORTED, path, "tensor name '%s' is longer than %d bytes", e->name, TSYS_NAME_LEN - 1); break; }
        tsys_tensor *t = tsys_tensor_new(ctx, e->dtype, dev, e->ndim, e->shape);
        if (!t) { s = tsys_ctx_status(ctx) != TSYS_OK ? tsys_ctx_status(ctx) : TSYS_ERR_OOM; break; }
        list[made++] = t;
        tsys_tensor_set_name(t, "%s", e->name);
        s = tsys__st_fill(&sf, e, t);
    }
    tsys__st_close(&sf);
    if (s != TSYS_OK) { tsys_tensor_list_free(list, made); return s; }
    *out = list; *n = made;
    return TSYS_OK;
}

TSYSDEF tsys_status tsys_safetensors_load_into(tsys_ctx *ctx, const char *path, tsys_tensor **tensors, int n) {
    if (!ctx || !path || (n > 0 && !tensors) || n < 0) return ctx ? tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "tsys_safetensors_load_into: bad arguments") : TSYS_ERR_INVALID_ARGS;
    tsys__st_file sf;
    tsys_status s = tsys__st_open(ctx, path, &sf);
    if (s != TSYS_OK) return s;
    int *match = (int *)tsys__st_malloc((size_t)n * sizeof *match);
    if (!match) { tsys__st_close(&sf); return tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "safetensors '%s': out of memory", path); }
    // Check every tensor before writing any, so a mismatch leaves all of them untouched.
    for (int i = 0; s == TSYS_OK && i < n; i++) {
        tsys_tensor *t = tensors[i];
        if (!t) { s = tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "tsys_safetensors_load_into: tensors[%d] is NULL", i); break; }
        int k = match[i] = tsys__st_find(&sf, t->name);
        if (k < 0) { s = tsys__st_fail(ctx, TSYS_ERR_IO, path, "tensor '%s' is missing from the file (it holds %d tensors)", t->name, sf.n); break; }
        const tsys__st_entry *e = &sf.entries[k];
        bool same = e->ndim == t->ndim;
        for (int d = 0; same && d < e->ndim; d++) same = e->shape[d] == t->shape[d];
        if (!same) {
            char a[160], b[160];
            s = tsys__st_fail(ctx, TSYS_ERR_IO, path, "tensor '%s': shape mismatch: file %s, tensor %s", t->name,
                              tsys__st_shape_str(a, sizeof a, e->ndim, e->shape), tsys__st_shape_str(b, sizeof b, t->ndim, t->shape));
        } else if (!tsys__st_convertible(e->dtype, t->dtype)) {
            s = tsys__st_fail(ctx, TSYS_ERR_IO, path, "tensor '%s': dtype mismatch: file %s, tensor %s", t->name,
                              tsys__st_dtype_str(e->dtype), tsys_dtype_name(t->dtype));
        }
    }
    for (int i = 0; s == TSYS_OK && i < n; i++) s = tsys__st_fill(&sf, &sf.entries[match[i]], tensors[i]);
    tsys__st_free(match);
    tsys__st_close(&sf);
    return s;
}

// ---- saving ---------------------------------------------------------------------------------------

typedef struct tsys__st_buf { char *p; size_t len, cap; bool oom; } tsys__st_buf;

static void tsys__st_put(tsys__st_buf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 1024;
        while (cap < b->len + n) cap *= 2;
        char *p = (char *)tsys__st_realloc(b->p, cap);
        if (!p) { b->oom = true; return; }
        b->p = p; b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
}

static void tsys__st_putf(tsys__st_buf *b, const char *fmt, ...) {
    char tmp[128];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n > 0) tsys__st_put(b, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}

// A JSON string literal: quotes, backslashes and control bytes escaped, everything else verbatim.
static void tsys__st_put_json_string(tsys__st_buf *b, const char *s) {
    tsys__st_put(b, "\"", 1);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') { char e[2] = { '\\', (char)c }; tsys__st_put(b, e, 2); }
        else if (c < 0x20) tsys__st_putf(b, "\\u%04x", c);
        else tsys__st_put(b, (const char *)&c, 1);
    }
    tsys__st_put(b, "\"", 1);
}

// The JSON header, padded with spaces so the data buffer starts 8-byte aligned.
static tsys_status tsys__st_build_header(tsys_ctx *ctx, const char *path, tsys_tensor **tensors, int n, tsys__st_buf *b) {
    uint64_t at = 0;
    static const char meta[] = "{\"__metadata__\":{\"format\":\"pt\"}";
    tsys__st_put(b, meta, sizeof meta - 1);
    for (int i = 0; i < n; i++) {
        const tsys_tensor *t = tensors[i];
        if (!t) return tsys__st_fail(ctx, TSYS_ERR_INVALID_ARGS, path, "cannot save: tensors[%d] is NULL", i);
        if (!t->name[0]) return tsys__st_fail(ctx, TSYS_ERR_INVALID_ARGS, path, "cannot save: tensors[%d] has no name", i);
        if (strcmp(t->name, "__metadata__") == 0) return tsys__st_fail(ctx, TSYS_ERR_INVALID_ARGS, path, "cannot save: '__metadata__' is reserved");
        for (int j = 0; j < i; j++)
            if (strcmp(tensors[j]->name, t->name) == 0)
                return tsys__st_fail(ctx, TSYS_ERR_INVALID_ARGS, path, "cannot save: tensor name '%s' used twice (tensors[%d] and [%d])", t->name, j, i);
        if (!tsys__st_dtype_str(t->dtype)) return tsys__st_fail(ctx, TSYS_ERR_INVALID_ARGS, path, "cannot save tensor '%s': bad dtype %d", t->name, (int)t->dtype);
        uint64_t bytes = tsys_tensor_bytes(t);
        tsys__st_put(b, ",", 1);
        tsys__st_put_json_string(b, t->name);
        tsys__st_putf(b, ":{\"dtype\":\"%s\",\"shape\":[", tsys__st_dtype_str(t->dtype));
        for (int d = 0; d < t->ndim; d++) tsys__st_putf(b, d ? ",%lld" : "%lld", (long long)t->shape[d]);
        tsys__st_putf(b, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)at, (unsigned long long)(at + bytes));
        at += bytes;
    }
    tsys__st_put(b, "}", 1);
    while (!b->oom && b->len % 8) tsys__st_put(b, " ", 1);
    if (b->oom) return tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "safetensors '%s': out of memory building the header", path);
    return TSYS_OK;
}

// Header length, header, then each tensor's bytes (fetched to the host if it lives elsewhere).
static tsys_status tsys__st_write(tsys_ctx *ctx, const char *path, FILE *f, const tsys__st_buf *hdr, tsys_tensor **tensors, int n) {
    unsigned char len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)hdr->len >> (8 * i));
    if (fwrite(len8, 1, 8, f) != 8 || fwrite(hdr->p, 1, hdr->len, f) != hdr->len)
        return tsys__st_fail(ctx, TSYS_ERR_IO, path, "write failed: %s", strerror(errno));
    void *stage = NULL;
    size_t stage_bytes = 0;
    tsys_status s = TSYS_OK;
    for (int i = 0; s == TSYS_OK && i < n; i++) {
        const tsys_tensor *t = tensors[i];
        size_t bytes = tsys_tensor_bytes(t);
        const void *src = t->device == TSYS_CPU ? tsys_tensor_data(t) : NULL;
        if (!src && bytes > stage_bytes) {
            void *p = tsys__st_realloc(stage, bytes);
            if (!p) { s = tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "safetensors '%s': tensor '%s': out of memory staging %zu bytes", path, t->name, bytes); break; }
            stage = p; stage_bytes = bytes;
        }
        if (!src && (s = tsys_tensor_to_host(ctx, t, stage)) != TSYS_OK) break;
        if (bytes && fwrite(src ? src : stage, 1, bytes, f) != bytes)
            s = tsys__st_fail(ctx, TSYS_ERR_IO, path, "tensor '%s': write failed: %s", t->name, strerror(errno));
    }
    tsys__st_free(stage);
    return s;
}

// Writes to "<path>.tmp" and renames it over path, so a failed save never leaves half a file.
TSYSDEF tsys_status tsys_safetensors_save(tsys_ctx *ctx, const char *path, tsys_tensor **tensors, int n) {
    if (!ctx || !path || n < 0 || (n > 0 && !tensors)) return ctx ? tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "tsys_safetensors_save: bad arguments") : TSYS_ERR_INVALID_ARGS;
    if (!tsys__st_host_is_le()) return tsys__st_fail(ctx, TSYS_ERR_UNSUPPORTED, path, "big-endian hosts are not supported");
    tsys__st_buf hdr;
    memset(&hdr, 0, sizeof hdr);
    tsys_status s = tsys__st_build_header(ctx, path, tensors, n, &hdr);
    size_t plen = strlen(path);
    char *tmp = s == TSYS_OK ? (char *)tsys__st_malloc(plen + 5) : NULL;
    if (s == TSYS_OK && !tmp) s = tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "safetensors '%s': out of memory", path);
    if (s == TSYS_OK) {
        memcpy(tmp, path, plen);
        memcpy(tmp + plen, ".tmp", 5);
        FILE *f = fopen(tmp, "wb");
        if (!f) s = tsys__st_fail(ctx, TSYS_ERR_IO, path, "cannot create '%s': %s", tmp, strerror(errno));
        if (f) {
            s = tsys__st_write(ctx, path, f, &hdr, tensors, n);
            if (fclose(f) != 0 && s == TSYS_OK) s = tsys__st_fail(ctx, TSYS_ERR_IO, path, "write failed on close: %s", strerror(errno));
            if (s == TSYS_OK && rename(tmp, path) != 0) s = tsys__st_fail(ctx, TSYS_ERR_IO, path, "cannot rename '%s' into place: %s", tmp, strerror(errno));
            if (s != TSYS_OK) remove(tmp);
        }
    }
    tsys__st_free(tmp);
    tsys__st_free(hdr.p);
    return s;
}
