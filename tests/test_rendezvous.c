// test_rendezvous.c - who may join a TCP rendezvous (torchrun-style variables). Each test forks the
// ranks of small jobs (two ranks: init, one all-reduce, free) and plays the stranger itself: idle
// connections, garbage, a hello with a wrong rank, another job on the same port, a wrong secret. Under
// torchrun (TORCHELASTIC_USE_AGENT_STORE=True) the ranks meet through the agent's TCPStore, which holds
// MASTER_PORT: a stand-in for it (a TCPStore server in C, the wire protocol torch 2.11 speaks) plays the agent.
// Runs alone (it makes its own ranks): build/test_rendezvous [filter]
#define TSYS_IMPLEMENTATION
#include "../tsys.h"
#define TSYS_DIST_IMPLEMENTATION
#include "../tsys_dist.h"
#include "harness.h"

// ---- ranks -----------------------------------------------------------------------------------------

typedef struct job_rank {
    int rank, size, port;
    const char *run_id, *secret, *addr;   // NULL: unset
    int timeout_s;
    long local_world_size;                // 0: unset
    bool agent;                           // as torchrun's workers: TORCHELASTIC_USE_AGENT_STORE=True (run id "none" unless run_id)
    int groups;                           // groups made one after the other (0: one)
} job_rank;

// A rank of a job in a child process: init, an all-reduce of ones, free (j.groups times). Exit 0 when
// each sum is the size. Its stderr goes to log (rank 0's refusals, the errors).
static pid_t start_rank(job_rank j, const char *log) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid != 0) return pid;
    int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd >= 0) { dup2(fd, 2); close(fd); }
    char v[32];
    snprintf(v, sizeof v, "%d", j.rank); setenv("RANK", v, 1);
    snprintf(v, sizeof v, "%d", j.size); setenv("WORLD_SIZE", v, 1);
    snprintf(v, sizeof v, "%d", j.port); setenv("MASTER_PORT", v, 1);
    snprintf(v, sizeof v, "%d", j.timeout_s ? j.timeout_s : 20); setenv("TSYS_DIST_TIMEOUT", v, 1);
    setenv("MASTER_ADDR", j.addr ? j.addr : "127.0.0.1", 1);
    const char *unset[] = { "TSYS_DIST_RUN_ID", "TORCHELASTIC_RUN_ID", "TSYS_DIST_SECRET", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TSYS_DIST_LISTEN_FD", "TSYS_DIST_LISTEN_ADDR",
                            "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT" };
    for (size_t i = 0; i < sizeof unset / sizeof *unset; i++) unsetenv(unset[i]);
    if (j.run_id) setenv("TSYS_DIST_RUN_ID", j.run_id, 1);
    if (j.secret) setenv("TSYS_DIST_SECRET", j.secret, 1);
    if (j.local_world_size) { snprintf(v, sizeof v, "%ld", j.local_world_size); setenv("LOCAL_WORLD_SIZE", v, 1); }
    if (j.agent) {
        setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);
        setenv("TORCHELASTIC_RESTART_COUNT", "0", 1);
        if (!j.run_id) setenv("TORCHELASTIC_RUN_ID", "none", 1);   // torchrun's default
        snprintf(v, sizeof v, "%d", j.rank); setenv("LOCAL_RANK", v, 1);
    }
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    bool ok = ctx != NULL;
    for (int g = 0; ok && g < (j.groups ? j.groups : 1); g++) {
        tsys_dist *d = tsys_dist_init(ctx, NULL);
        if (!d) { fprintf(stderr, "init: %s\n", tsys_ctx_last_error(ctx)); _exit(1); }
        double one = 1;
        ok = tsys_dist_all_reduce_host(d, &one, 1, TSYS_DIST_SUM) == TSYS_OK && one == j.size;
        if (!ok) fprintf(stderr, "all_reduce: %s (sum %g)\n", tsys_ctx_last_error(ctx), one);
        tsys_dist_free(d);
    }
    if (ctx) tsys_ctx_free(ctx);
    _exit(ok ? 0 : 1);
}

// The child's exit code, or -1 when it is still running after limit_s (then it is killed).
static int finish(pid_t pid, double limit_s) {
    double t0 = tsys_time_us();
    for (;;) {
        int st = 0;
        pid_t p = waitpid(pid, &st, WNOHANG);
        if (p == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
        if ((tsys_time_us() - t0) * 1e-6 > limit_s) { kill(pid, SIGKILL); waitpid(pid, &st, 0); return -1; }
        usleep(20000);
    }
}

static int free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0), port = 0;
    struct sockaddr_in a;
    socklen_t al = sizeof a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET; a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && getsockname(fd, (struct sockaddr *)&a, &al) == 0) port = ntohs(a.sin_port);
    if (fd >= 0) close(fd);
    return port;
}

static bool log_has(const char *log, const char *needle) {
    FILE *f = fopen(log, "r");
    if (!f) return false;
    char line[1024];
    bool found = false;
    while (!found && fgets(line, sizeof line, f)) found = strstr(line, needle) != NULL;
    fclose(f);
    return found;
}
static void log_show(const char *what, const char *log) {
    FILE *f = fopen(log, "r");
    char line[1024];
    printf("      %s:\n", what);
    while (f && fgets(line, sizeof line, f)) printf("        %s", line);
    if (f) fclose(f);
}

static char g_dir[256];
static const char *logname(const char *name) {
    static char buf[8][320];
    static int k;
    char *b = buf[k++ % 8];
    snprintf(b, 320, "%s/%s.log", g_dir, name);
    return b;
}

// Connects to the rendezvous port without saying anything (non-blocking: a full backlog cannot stall the test).
static int stranger(int port) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET; a.sin_addr.s_addr = htonl(INADDR_LOOPBACK); a.sin_port = htons((uint16_t)port);
    if (fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) != 0 && errno != EINPROGRESS) { close(fd); return -1; }
    return fd;
}
static void wait_writable(int fd, int ms) { struct pollfd pf = { fd, POLLOUT, 0 }; poll(&pf, 1, ms); }

// The address rank 0 listens on for port (from /proc/net/tcp, as "0100007F" for 127.0.0.1), or "" once
// limit_s passed without a listener.
static void listen_addr(int port, char *out, size_t n, double limit_s) {
    out[0] = 0;
    double t0 = tsys_time_us();
    while (!out[0] && (tsys_time_us() - t0) * 1e-6 < limit_s) {
        const char *files[] = { "/proc/net/tcp", "/proc/net/tcp6" };
        for (int f = 0; f < 2 && !out[0]; f++) {
            FILE *fp = fopen(files[f], "r");
            char line[512], local[64];
            unsigned lport, state;
            while (fp && fgets(line, sizeof line, fp))
                if (sscanf(line, " %*d: %63[0-9A-Fa-f]:%x %*[0-9A-Fa-f]:%*x %x", local, &lport, &state) == 3 && (int)lport == port && state == 0x0A)
                    snprintf(out, n, "%s", local);
            if (fp) fclose(fp);
        }
        if (!out[0]) usleep(20000);
    }
}

// ---- a stand-in for torchrun's agent: a TCPStore server ----------------------------------------------
// What torchrun's agent runs on MASTER_PORT, in a child process that holds the port (the wire protocol of
// torch 2.11, as the anchors give it: a command byte; keys and values as a u64 length and the bytes;
// integers raw little-endian). Each client's first message must be VALIDATE with the magic (else it is
// dropped and logged as refused); then SET, GET (a missing key: length 0, as the libuv server), ADD
// (stored as ASCII decimal), CHECK, WAIT (answered once every key exists) and PING. Every command is
// logged as one line ("SET /k = v"). With drop_prefix set, SETs of keys that start with it are ignored:
// a store where rank 0's port never shows up.
enum { ST_CLIENTS = 32, ST_KEYS = 128, ST_BUF = 4096, ST_STR = 256 };
typedef struct st_client { int fd; bool validated; size_t len; uint8_t buf[ST_BUF]; int nwait; char wait[4][ST_STR]; } st_client;
typedef struct st_server {
    int nkv;
    char key[ST_KEYS][ST_STR], val[ST_KEYS][ST_STR];
    size_t vlen[ST_KEYS];
    const char *drop_prefix;
    FILE *log;
} st_server;

static int st_find(st_server *sv, const char *k) { for (int i = 0; i < sv->nkv; i++) if (!strcmp(sv->key[i], k)) return i; return -1; }
static void st_set(st_server *sv, const char *k, const char *v, size_t vl) {
    int i = st_find(sv, k);
    if (i < 0 && sv->nkv < ST_KEYS) { i = sv->nkv++; snprintf(sv->key[i], ST_STR, "%s", k); }
    if (i >= 0) { memcpy(sv->val[i], v, vl); sv->vlen[i] = vl; }
}
static void st_send(int fd, const void *p, size_t n) {   // replies are small: a blocking send
    const char *c = (const char *)p;
    while (n > 0) { ssize_t k = send(fd, c, n, MSG_NOSIGNAL); if (k <= 0) return; c += k; n -= (size_t)k; }
}
static void st_send_u64(int fd, uint64_t v) { uint8_t b[8]; for (int i = 0; i < 8; i++) b[i] = (uint8_t)(v >> (8 * i)); st_send(fd, b, 8); }
// Reads a little-endian integer of n bytes at *at; false when the message is not complete yet.
static bool st_int(const st_client *c, size_t *at, int n, uint64_t *v) {
    if (*at + (size_t)n > c->len) return false;
    *v = 0;
    for (int i = 0; i < n; i++) *v |= (uint64_t)c->buf[*at + (size_t)i] << (8 * i);
    *at += (size_t)n;
    return true;
}
// Reads a key or value; *bad when it is too long for this stand-in.
static bool st_str(const st_client *c, size_t *at, char *out, size_t *len, bool *bad) {
    uint64_t n;
    size_t a = *at;
    if (!st_int(c, &a, 8, &n)) return false;
    if (n >= ST_STR) { *bad = true; return false; }
    if (a + n > c->len) return false;
    memcpy(out, c->buf + a, n);
    out[n] = 0;
    if (len) *len = (size_t)n;
    *at = a + n;
    return true;
}
static bool st_ready(st_server *sv, const st_client *c) { for (int i = 0; i < c->nwait; i++) if (st_find(sv, c->wait[i]) < 0) return false; return true; }

// Serves one complete message at the start of c->buf: its length, 0 when incomplete, -1 to drop the client.
static long st_serve_one(st_server *sv, st_client *c) {
    size_t at = 1;
    uint64_t x, n;
    char k[ST_STR], v[ST_STR];
    size_t vl = 0;
    bool bad = false;
    if (c->len == 0) return 0;
    const int cmd = c->buf[0];
    if (!c->validated) {
        if (cmd != 0) { fprintf(sv->log, "refused: first message is command %d, not VALIDATE\n", cmd); return -1; }
        if (!st_int(c, &at, 4, &x)) return 0;
        if (x != 0x3C85F7CEu) { fprintf(sv->log, "refused: VALIDATE magic 0x%08llx\n", (unsigned long long)x); return -1; }
        fprintf(sv->log, "VALIDATE ok\n");
        c->validated = true;
        return (long)at;
    }
    switch (cmd) {
    case 1:   // SET key value
        if (!st_str(c, &at, k, NULL, &bad) || !st_str(c, &at, v, &vl, &bad)) return bad ? -1 : 0;
        if (sv->drop_prefix && !strncmp(k, sv->drop_prefix, strlen(sv->drop_prefix))) { fprintf(sv->log, "SET %s = %.*s (dropped)\n", k, (int)vl, v); break; }
        st_set(sv, k, v, vl);
        fprintf(sv->log, "SET %s = %.*s\n", k, (int)vl, v);
        break;
    case 3: {   // GET key -> value (length 0 when missing)
        if (!st_str(c, &at, k, NULL, &bad)) return bad ? -1 : 0;
        int i = st_find(sv, k);
        fprintf(sv->log, "GET %s%s\n", k, i < 0 ? " (missing)" : "");
        st_send_u64(c->fd, i < 0 ? 0 : sv->vlen[i]);
        if (i >= 0) st_send(c->fd, sv->val[i], sv->vlen[i]);
        break;
    }
    case 4: {   // ADD key i64 -> i64
        if (!st_str(c, &at, k, NULL, &bad)) return bad ? -1 : 0;
        if (!st_int(c, &at, 8, &x)) return 0;
        int i = st_find(sv, k);
        long long sum = (i >= 0 ? atoll(sv->val[i]) : 0) + (long long)(int64_t)x;
        int l = snprintf(v, sizeof v, "%lld", sum);
        st_set(sv, k, v, (size_t)l);
        fprintf(sv->log, "ADD %s %lld -> %lld\n", k, (long long)(int64_t)x, sum);
        st_send_u64(c->fd, (uint64_t)sum);
        break;
    }
    case 5: case 6: {   // CHECK / WAIT: u64 n, n keys
        if (!st_int(c, &at, 8, &n)) return 0;
        if (n < 1 || n > 4) { fprintf(sv->log, "refused: %s of %llu keys\n", cmd == 5 ? "CHECK" : "WAIT", (unsigned long long)n); return -1; }
        char keys[4][ST_STR];
        for (uint64_t i = 0; i < n; i++) if (!st_str(c, &at, keys[i], NULL, &bad)) return bad ? -1 : 0;
        c->nwait = 0;
        for (uint64_t i = 0; i < n; i++) memcpy(c->wait[c->nwait++], keys[i], ST_STR);
        const bool ready = st_ready(sv, c);
        fprintf(sv->log, "%s %s%s\n", cmd == 5 ? "CHECK" : "WAIT", keys[0], ready ? " (ready)" : cmd == 5 ? " (not ready)" : " (waiting)");
        if (cmd == 5 || ready) { uint8_t r = cmd == 5 && !ready ? 1 : 0; st_send(c->fd, &r, 1); c->nwait = 0; }
        break;
    }
    case 13: {   // PING u32 -> the same u32
        uint8_t b[4];
        if (!st_int(c, &at, 4, &x)) return 0;
        for (int i = 0; i < 4; i++) b[i] = (uint8_t)(x >> (8 * i));
        fprintf(sv->log, "PING\n");
        st_send(c->fd, b, 4);
        break;
    }
    default:
        fprintf(sv->log, "refused: command %d\n", cmd);
        return -1;
    }
    return (long)at;
}

static void st_serve(int lfd, const char *drop_prefix, const char *log) {
    static st_server sv;
    static st_client cl[ST_CLIENTS];
    sv.drop_prefix = drop_prefix;
    sv.log = fopen(log, "w");
    if (!sv.log) _exit(1);
    setvbuf(sv.log, NULL, _IOLBF, 0);
    for (int i = 0; i < ST_CLIENTS; i++) cl[i].fd = -1;
    for (;;) {
        struct pollfd pf[ST_CLIENTS + 1];
        pf[0].fd = lfd; pf[0].events = POLLIN; pf[0].revents = 0;
        for (int i = 0; i < ST_CLIENTS; i++) { pf[1 + i].fd = cl[i].fd; pf[1 + i].events = POLLIN; pf[1 + i].revents = 0; }
        if (poll(pf, ST_CLIENTS + 1, 1000) < 0 && errno != EINTR) _exit(1);
        if (pf[0].revents & POLLIN) {
            int fd = accept(lfd, NULL, NULL);
            for (int i = 0; fd >= 0 && i < ST_CLIENTS; i++)
                if (cl[i].fd < 0) { memset(&cl[i], 0, sizeof cl[i]); cl[i].fd = fd; fd = -1; }
            if (fd >= 0) close(fd);
        }
        for (int i = 0; i < ST_CLIENTS; i++) {
            st_client *c = &cl[i];
            if (c->fd < 0 || !pf[1 + i].revents) continue;
            ssize_t k = recv(c->fd, c->buf + c->len, ST_BUF - c->len, 0);
            if (k <= 0) { close(c->fd); c->fd = -1; continue; }
            c->len += (size_t)k;
            long used;
            while ((used = st_serve_one(&sv, c)) > 0) { memmove(c->buf, c->buf + used, c->len - (size_t)used); c->len -= (size_t)used; }
            if (used < 0 || c->len == ST_BUF) { close(c->fd); c->fd = -1; continue; }
            for (int w = 0; w < ST_CLIENTS; w++)   // a SET or ADD may end someone's WAIT
                if (cl[w].fd >= 0 && cl[w].nwait && st_ready(&sv, &cl[w])) { uint8_t r = 0; st_send(cl[w].fd, &r, 1); cl[w].nwait = 0; }
        }
    }
}

// Starts the stand-in on a port of the system's choosing (*port); it holds the port until stop_store.
static pid_t start_store(const char *drop_prefix, const char *log, int *port) {
    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a;
    socklen_t al = sizeof a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET; a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    *port = 0;
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&a, sizeof a) != 0 || listen(lfd, 64) != 0 || getsockname(lfd, (struct sockaddr *)&a, &al) != 0) {
        if (lfd >= 0) close(lfd);
        return -1;
    }
    *port = ntohs(a.sin_port);
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) { prctl(PR_SET_PDEATHSIG, SIGKILL); st_serve(lfd, drop_prefix, log); _exit(0); }
    close(lfd);
    return pid;
}
static void stop_store(pid_t pid) { int st; if (pid > 0) { kill(pid, SIGKILL); waitpid(pid, &st, 0); } }

// Lines of log that contain needle.
static int log_count(const char *log, const char *needle) {
    FILE *f = fopen(log, "r");
    char line[1024];
    int n = 0;
    while (f && fgets(line, sizeof line, f)) n += strstr(line, needle) != NULL;
    if (f) fclose(f);
    return n;
}

// ---- tests -------------------------------------------------------------------------------------------

TSYS_TEST(sha256_and_hmac_known_answers) {   // FIPS 180-2 "abc" and a million 'a'; RFC 4231 test case 1
    uint8_t o[32];
    char hex[65];
    tsys_dist__sha256 s;
    tsys_dist__sha256_init(&s); tsys_dist__sha256_add(&s, "abc", 3); tsys_dist__sha256_end(&s, o);
    for (int i = 0; i < 32; i++) snprintf(hex + 2 * i, 3, "%02x", o[i]);
    TEST_CHECK(!strcmp(hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"), "sha256(abc) = %s", hex);
    char a[1000];
    memset(a, 'a', sizeof a);
    tsys_dist__sha256_init(&s);
    for (int i = 0; i < 1000; i++) tsys_dist__sha256_add(&s, a, sizeof a);
    tsys_dist__sha256_end(&s, o);
    for (int i = 0; i < 32; i++) snprintf(hex + 2 * i, 3, "%02x", o[i]);
    TEST_CHECK(!strcmp(hex, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"), "sha256(10^6 x a) = %s", hex);
    uint8_t key[20];
    memset(key, 0x0b, sizeof key);
    tsys_dist__hmac(key, sizeof key, "Hi ", 3, "There", 5, o);
    for (int i = 0; i < 32; i++) snprintf(hex + 2 * i, 3, "%02x", o[i]);
    TEST_CHECK(!strcmp(hex, "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"), "hmac = %s", hex);
}

TSYS_TEST(rank0_listens_where_master_addr_points) {   // not on every interface
    int port = free_port();
    job_rank r0 = { 0, 2, port, "job-a", NULL, "127.0.0.1", 20, 0, false, 1 }, r1 = r0;
    r1.rank = 1;
    pid_t p0 = start_rank(r0, logname("listen_r0"));
    char local[64];
    listen_addr(port, local, sizeof local, 10);
    TEST_CHECK(!strcmp(local, "0100007F"), "rank 0 listens on %s (hex, /proc/net/tcp), not 127.0.0.1 = 0100007F", local[0] ? local : "nothing");
    pid_t p1 = start_rank(r1, logname("listen_r1"));
    int c0 = finish(p0, 30), c1 = finish(p1, 30);
    TEST_CHECK(c0 == 0 && c1 == 0, "exit codes %d %d", c0, c1);
    if (c0 || c1) { log_show("rank 0's stderr", logname("listen_r0")); log_show("rank 1's stderr", logname("listen_r1")); }
}

TSYS_TEST(loopback_master_addr_refused_across_hosts) {   // LOCAL_WORLD_SIZE < WORLD_SIZE: the others could not reach it
    job_rank r0 = { 0, 2, free_port(), "job-a", NULL, "127.0.0.1", 5, 1, false, 1 };
    pid_t p0 = start_rank(r0, logname("loop_r0"));
    int c0 = finish(p0, 10);
    TEST_CHECK(c0 == 1 && log_has(logname("loop_r0"), "loopback address"), "exit %d, and the reason named", c0);
    if (c0 != 1) log_show("rank 0's stderr", logname("loop_r0"));
}

// Idle connections (more than rank 0 keeps waiting), garbage, a hello of this job with a wrong rank: each
// refused and logged, and the real rank 1 still joins.
TSYS_TEST(strangers_do_not_stop_the_rendezvous) {
    int port = free_port();
    job_rank r0 = { 0, 2, port, "job-a", NULL, "127.0.0.1", 20, 0, false, 1 }, r1 = r0;
    r1.rank = 1;
    pid_t p0 = start_rank(r0, logname("strangers_r0"));
    char local[64];
    listen_addr(port, local, sizeof local, 10);
    enum { IDLE = TSYS_DIST__PENDING + 6, GARBAGE = 4 };
    int idle[IDLE], junk[GARBAGE];
    for (int i = 0; i < IDLE; i++) idle[i] = stranger(port);
    for (int i = 0; i < GARBAGE; i++) {
        junk[i] = stranger(port);
        wait_writable(junk[i], 1000);
        char g[300];
        for (size_t k = 0; k < sizeof g; k++) g[k] = (char)(k * 37 + i);
        if (send(junk[i], g, sizeof g, MSG_NOSIGNAL) < 0) { /* refused early: fine */ }
    }
    // a well-formed hello of this job claiming rank 7 of 2
    int bad = stranger(port);
    wait_writable(bad, 1000);
    tsys_dist__challenge ch;
    tsys_dist__err e;
    memset(&e, 0, sizeof e);
    int fl = fcntl(bad, F_GETFL);
    fcntl(bad, F_SETFL, fl | O_NONBLOCK);
    bool heard = tsys_dist__sock_io(bad, &ch, sizeof ch, false, 10, "rank 0", &e);
    TEST_CHECK(heard && ch.magic == TSYS_DIST__MAGIC && !strcmp(ch.run_id, "job-a"), "rank 0's challenge: %s", e.msg);
    tsys_dist__hello h;
    memset(&h, 0, sizeof h);
    h.magic = TSYS_DIST__MAGIC; h.version = TSYS_DIST__PROTOCOL; h.rank = 7; h.size = 2;
    snprintf(h.run_id, sizeof h.run_id, "job-a");
    if (heard) tsys_dist__sock_io(bad, &h, sizeof h, true, 5, "rank 0", &e);
    pid_t p1 = start_rank(r1, logname("strangers_r1"));
    int c0 = finish(p0, 40), c1 = finish(p1, 40);
    TEST_CHECK(c0 == 0 && c1 == 0, "exit codes %d %d (rank 0 must admit rank 1 despite the strangers)", c0, c1);
    TEST_CHECK(log_has(logname("strangers_r0"), "refused a connection") && log_has(logname("strangers_r0"), "RANK=7"), "rank 0 logs the refusals");
    if (c0 || c1) { log_show("rank 0's stderr", logname("strangers_r0")); log_show("rank 1's stderr", logname("strangers_r1")); }
    for (int i = 0; i < IDLE; i++) if (idle[i] >= 0) close(idle[i]);
    for (int i = 0; i < GARBAGE; i++) if (junk[i] >= 0) close(junk[i]);
    close(bad);
}

// Rank 0 of a job, then an intruder that must be turned away (its exit code is returned), then the
// job's real rank 1; *c0 and *c1 get the job's exit codes.
static int intruder_between(job_rank r0, job_rank intruder, const char *tag, int *c0, int *c1) {
    char l0[64], li[64], l1[64];
    snprintf(l0, sizeof l0, "%s_r0", tag); snprintf(li, sizeof li, "%s_intruder", tag); snprintf(l1, sizeof l1, "%s_r1", tag);
    job_rank r1 = r0;
    r1.rank = 1;
    pid_t p0 = start_rank(r0, logname(l0));
    char local[64];
    listen_addr(r0.port, local, sizeof local, 10);
    int ci = finish(start_rank(intruder, logname(li)), 20);
    pid_t p1 = start_rank(r1, logname(l1));
    *c0 = finish(p0, 30);
    *c1 = finish(p1, 30);
    if (ci != 1 || *c0 || *c1) { log_show("rank 0's stderr", logname(l0)); log_show("the intruder's stderr", logname(li)); }
    return ci;
}

// Job A's rank 0 and job B's rank 1 on one MASTER_PORT: they must not form a group.
TSYS_TEST(two_jobs_on_one_port_do_not_mix) {
    job_rank a0 = { 0, 2, free_port(), "job-a", NULL, "127.0.0.1", 20, 0, false, 1 }, b1 = a0;
    b1.rank = 1; b1.run_id = "job-b"; b1.timeout_s = 4;
    int c0, c1, cb1 = intruder_between(a0, b1, "jobs", &c0, &c1);
    TEST_CHECK(cb1 == 1 && log_has(logname("jobs_intruder"), "another job"), "job B's rank 1: exit %d, must fail naming the other job", cb1);
    TEST_CHECK(c0 == 0 && c1 == 0, "job A: exit codes %d %d", c0, c1);
}

// A rank without the job's secret is refused (and cannot see the others' secret: only MACs cross).
TSYS_TEST(wrong_secret_is_refused) {
    job_rank a0 = { 0, 2, free_port(), "job-a", "s3cret", "127.0.0.1", 20, 0, false, 1 }, x1 = a0;
    x1.rank = 1; x1.secret = "guess"; x1.timeout_s = 4;
    int c0, c1, cx1 = intruder_between(a0, x1, "secret", &c0, &c1);
    TEST_CHECK(cx1 == 1 && log_has(logname("secret_intruder"), "authentication"), "the rank with a wrong secret: exit %d", cx1);
    TEST_CHECK(log_has(logname("secret_r0"), "failed authentication"), "rank 0 logs it");
    TEST_CHECK(c0 == 0 && c1 == 0, "the job: exit codes %d %d", c0, c1);
}

// ---- under torchrun: the agent's store ---------------------------------------------------------------

// The stand-in answers as the anchors say torch 2.11's TCPStore does (ADD returns 1 then 2, PING echoes,
// a missing key reads as length 0), and tsys_dist's store client publishes and finds a port through it.
TSYS_TEST(stand_in_store_speaks_the_wire_protocol) {
    int port = 0;
    pid_t sp = start_store(NULL, logname("wire_store"), &port);
    TEST_CHECK(sp > 0, "the stand-in store started");
    if (sp <= 0) return;
    tsys_dist__store s;
    tsys_dist__err e;
    memset(&e, 0, sizeof e);
    bool ok = tsys_dist__store_open(&s, "127.0.0.1", port, tsys_time_us() + 5e6, 5, &e);
    TEST_CHECK(ok, "open: %s", e.msg);
    if (ok) {
        // raw ADD key 1, twice; PING; GET of a missing key
        uint8_t add[1 + 8 + 5 + 8] = { 4, 5, 0, 0, 0, 0, 0, 0, 0, 'i', 'n', 'i', 't', '/', 1, 0, 0, 0, 0, 0, 0, 0 };
        uint8_t r8[8], ping[5] = { 13, 0x78, 0x56, 0x34, 0x12 }, r4[4];
        for (int k = 1; k <= 2; k++) {
            ok = tsys_dist__store_io(&s, add, sizeof add, true, "ADD", &e) && tsys_dist__store_io(&s, r8, 8, false, "ADD's reply", &e);
            TEST_CHECK(ok && r8[0] == k && !r8[1] && !r8[7], "ADD #%d: %s reply %u", k, e.msg, r8[0]);
        }
        ok = tsys_dist__store_io(&s, ping, sizeof ping, true, "PING", &e) && tsys_dist__store_io(&s, r4, 4, false, "PING's reply", &e);
        TEST_CHECK(ok && !memcmp(r4, ping + 1, 4), "PING echoes its u32: %s", e.msg);
        uint8_t ready = 9;
        ok = tsys_dist__store_cmd(&s, TSYS_DIST__STORE_CHECK, "/missing", NULL, &ready, &e);
        TEST_CHECK(ok && ready == 1, "CHECK of a missing key: %u (%s)", ready, e.msg);
        ok = tsys_dist__store_cmd(&s, TSYS_DIST__STORE_GET, "/missing", NULL, NULL, &e) && tsys_dist__store_io(&s, r8, 8, false, "GET's reply", &e);
        TEST_CHECK(ok && !memcmp(r8, "\0\0\0\0\0\0\0\0", 8), "GET of a missing key: length 0 (%s)", e.msg);
        ok = tsys_dist__store_publish(&s, "/tsys/x/0/7/rank0", 4242, &e);
        TEST_CHECK(ok, "publish: %s", e.msg);
        close(s.fd);
    }
    tsys_dist__store s2;
    int got = 0;
    memset(&e, 0, sizeof e);
    ok = tsys_dist__store_open(&s2, "127.0.0.1", port, tsys_time_us() + 5e6, 5, &e) && tsys_dist__store_lookup(&s2, "/tsys/x/0/7/rank0", &got, &e);
    TEST_CHECK(ok && got == 4242, "lookup from another connection: %d (%s)", got, e.msg);
    if (ok) close(s2.fd);
    // a client whose first message is not VALIDATE is dropped (and logged)
    int raw = stranger(port);
    wait_writable(raw, 1000);
    uint8_t get[1 + 8 + 2] = { 3, 2, 0, 0, 0, 0, 0, 0, 0, '/', 'k' };
    if (send(raw, get, sizeof get, MSG_NOSIGNAL) < 0) { /* dropped already: fine */ }
    struct pollfd pf = { raw, POLLIN, 0 };
    char c;
    TEST_CHECK(poll(&pf, 1, 5000) == 1 && recv(raw, &c, 1, 0) <= 0, "a client without VALIDATE is closed");
    close(raw);
    stop_store(sp);
    TEST_CHECK(log_count(logname("wire_store"), "refused: first message is command 3") == 1 && log_count(logname("wire_store"), "VALIDATE ok") == 2, "the store's log");
    if (tsys__test_failed) log_show("the store's log", logname("wire_store"));
}

// (a) Two ranks as torchrun starts them: the agent's store holds MASTER_PORT (binding it fails with
// "Address already in use", which is how rank 0 failed before it used the store), rank 0 publishes a
// port of its own there and rank 1, started first, waits for it. Two groups one after the other (one
// key each), with a secret: the hellos are the usual ones.
TSYS_TEST(agent_store_rendezvous) {
    int port = 0;
    pid_t sp = start_store(NULL, logname("agent_store"), &port);
    TEST_CHECK(sp > 0, "the stand-in store started");
    if (sp <= 0) return;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1;
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET; a.sin_addr.s_addr = htonl(INADDR_LOOPBACK); a.sin_port = htons((uint16_t)port);
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    int brc = bind(fd, (struct sockaddr *)&a, sizeof a), berr = errno;
    close(fd);
    TEST_CHECK(brc != 0 && berr == EADDRINUSE, "MASTER_PORT is held by the store: bind %d (%s)", brc, strerror(berr));
    job_rank r0 = { 0, 2, port, NULL, "s3cret", "127.0.0.1", 20, 2, true, 2 }, r1 = r0;
    r1.rank = 1;
    pid_t p1 = start_rank(r1, logname("agent_r1"));
    usleep(300000);
    pid_t p0 = start_rank(r0, logname("agent_r0"));
    int c0 = finish(p0, 40), c1 = finish(p1, 40);
    stop_store(sp);
    TEST_CHECK(c0 == 0 && c1 == 0, "exit codes %d %d", c0, c1);
    TEST_CHECK(log_count(logname("agent_store"), "SET /tsys/none/0/0/rank0 = ") == 1 && log_count(logname("agent_store"), "SET /tsys/none/0/1/rank0 = ") == 1,
               "rank 0 published one key per group");
    TEST_CHECK(log_count(logname("agent_store"), "VALIDATE ok") == 4 && log_count(logname("agent_store"), "refused") == 0, "every client validated first");
    TEST_CHECK(log_count(logname("agent_store"), "WAIT /tsys/none/0/0/rank0") == 1, "rank 1 waited for the key");
    if (c0 || c1 || tsys__test_failed) { log_show("rank 0's stderr", logname("agent_r0")); log_show("rank 1's stderr", logname("agent_r1")); log_show("the store's log", logname("agent_store")); }
}

// (b) A store where rank 0's port never shows up (its SETs are dropped): rank 0 sees that the store
// did not take the key; rank 1 gives up within the timeout, naming the store and the key.
TSYS_TEST(agent_store_without_the_key) {
    int port = 0;
    pid_t sp = start_store("/tsys/", logname("nokey_store"), &port);
    TEST_CHECK(sp > 0, "the stand-in store started");
    if (sp <= 0) return;
    job_rank r0 = { 0, 2, port, "job-a", NULL, "127.0.0.1", 3, 2, true, 1 }, r1 = r0;
    r1.rank = 1;
    double t0 = tsys_time_us();
    pid_t p1 = start_rank(r1, logname("nokey_r1")), p0 = start_rank(r0, logname("nokey_r0"));
    int c0 = finish(p0, 20), c1 = finish(p1, 20);
    double el = (tsys_time_us() - t0) * 1e-6;
    stop_store(sp);
    char want[128];
    snprintf(want, sizeof want, "store at 127.0.0.1:%d: WAIT of key '/tsys/job-a/0/0/rank0'", port);
    TEST_CHECK(c1 == 1 && log_has(logname("nokey_r1"), want) && log_has(logname("nokey_r1"), "never published"), "rank 1: exit %d, must name the store and the key", c1);
    TEST_CHECK(c0 == 1 && log_has(logname("nokey_r0"), "CHECK of key '/tsys/job-a/0/0/rank0'"), "rank 0: exit %d, must say the store did not take the key", c0);
    TEST_CHECK(el < 3 + 4, "they gave up after %.1f s (timeout 3 s)", el);
    if (tsys__test_failed) { log_show("rank 0's stderr", logname("nokey_r0")); log_show("rank 1's stderr", logname("nokey_r1")); log_show("the store's log", logname("nokey_store")); }
}

// Nothing on MASTER_PORT under torchrun's variables: an error naming the store's address, in time.
TSYS_TEST(agent_store_unreachable) {
    int port = free_port();
    job_rank r1 = { 1, 2, port, "job-a", NULL, "127.0.0.1", 2, 2, true, 1 };
    double t0 = tsys_time_us();
    int c1 = finish(start_rank(r1, logname("unreach_r1")), 20);
    double el = (tsys_time_us() - t0) * 1e-6;
    char want[96];
    snprintf(want, sizeof want, "cannot reach torchrun's agent store at 127.0.0.1:%d", port);
    TEST_CHECK(c1 == 1 && log_has(logname("unreach_r1"), want) && el < 2 + 4, "exit %d after %.1f s", c1, el);
    if (tsys__test_failed) log_show("rank 1's stderr", logname("unreach_r1"));
}

TSYS_TEST(local_world_size_is_checked) {   // 1 <= LOCAL_WORLD_SIZE <= WORLD_SIZE, before any connection
    job_rank r0 = { 0, 2, free_port(), "job-a", NULL, "127.0.0.1", 20, 3, false, 1 };
    int c0 = finish(start_rank(r0, logname("lws_r0")), 10);
    TEST_CHECK(c0 == 1 && log_has(logname("lws_r0"), "LOCAL_WORLD_SIZE='3'"), "exit %d, and LOCAL_WORLD_SIZE named", c0);
    if (tsys__test_failed) log_show("rank 0's stderr", logname("lws_r0"));
}

int main(int argc, char **argv) {
    snprintf(g_dir, sizeof g_dir, "/tmp/tsys_rendezvous.XXXXXX");
    if (!mkdtemp(g_dir)) { perror("mkdtemp"); return 1; }
    signal(SIGPIPE, SIG_IGN);
    int rc = tsys_test_main(argc, argv);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (system(cmd) != 0) { /* a leftover temp dir is harmless */ }
    return rc;
}
