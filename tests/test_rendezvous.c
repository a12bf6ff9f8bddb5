// test_rendezvous.c - who may join a TCP rendezvous (torchrun-style variables). Each test forks the
// ranks of small jobs (two ranks: init, one all-reduce, free) and plays the stranger itself: idle
// connections, garbage, a hello with a wrong rank, another job on the same port, a wrong secret.
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
} job_rank;

// A rank of a job in a child process: init, an all-reduce of ones, free. Exit 0 when the sum is the
// size. Its stderr goes to log (rank 0's refusals, the errors).
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
    const char *unset[] = { "TSYS_DIST_RUN_ID", "TORCHELASTIC_RUN_ID", "TSYS_DIST_SECRET", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TSYS_DIST_LISTEN_FD", "TSYS_DIST_LISTEN_ADDR" };
    for (size_t i = 0; i < sizeof unset / sizeof *unset; i++) unsetenv(unset[i]);
    if (j.run_id) setenv("TSYS_DIST_RUN_ID", j.run_id, 1);
    if (j.secret) setenv("TSYS_DIST_SECRET", j.secret, 1);
    if (j.local_world_size) { snprintf(v, sizeof v, "%ld", j.local_world_size); setenv("LOCAL_WORLD_SIZE", v, 1); }
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_dist *d = ctx ? tsys_dist_init(ctx, NULL) : NULL;
    if (!d) { fprintf(stderr, "init: %s\n", ctx ? tsys_ctx_last_error(ctx) : "no context"); _exit(1); }
    double one = 1;
    bool ok = tsys_dist_all_reduce_host(d, &one, 1, TSYS_DIST_SUM) == TSYS_OK && one == j.size;
    if (!ok) fprintf(stderr, "all_reduce: %s (sum %g)\n", tsys_ctx_last_error(ctx), one);
    tsys_dist_free(d);
    tsys_ctx_free(ctx);
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
    printf("      %s's stderr:\n", what);
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
    job_rank r0 = { 0, 2, port, "job-a", NULL, "127.0.0.1", 20, 0 }, r1 = r0;
    r1.rank = 1;
    pid_t p0 = start_rank(r0, logname("listen_r0"));
    char local[64];
    listen_addr(port, local, sizeof local, 10);
    TEST_CHECK(!strcmp(local, "0100007F"), "rank 0 listens on %s (hex, /proc/net/tcp), not 127.0.0.1 = 0100007F", local[0] ? local : "nothing");
    pid_t p1 = start_rank(r1, logname("listen_r1"));
    int c0 = finish(p0, 30), c1 = finish(p1, 30);
    TEST_CHECK(c0 == 0 && c1 == 0, "exit codes %d %d", c0, c1);
    if (c0 || c1) { log_show("rank 0", logname("listen_r0")); log_show("rank 1", logname("listen_r1")); }
}

TSYS_TEST(loopback_master_addr_refused_across_hosts) {   // LOCAL_WORLD_SIZE < WORLD_SIZE: the others could not reach it
    job_rank r0 = { 0, 2, free_port(), "job-a", NULL, "127.0.0.1", 5, 1 };
    pid_t p0 = start_rank(r0, logname("loop_r0"));
    int c0 = finish(p0, 10);
    TEST_CHECK(c0 == 1 && log_has(logname("loop_r0"), "loopback address"), "exit %d, and the reason named", c0);
    if (c0 != 1) log_show("rank 0", logname("loop_r0"));
}

// Idle connections (more than rank 0 keeps waiting), garbage, a hello of this job with a wrong rank: each
// refused and logged, and the real rank 1 still joins.
TSYS_TEST(strangers_do_not_stop_the_rendezvous) {
    int port = free_port();
    job_rank r0 = { 0, 2, port, "job-a", NULL, "127.0.0.1", 20, 0 }, r1 = r0;
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
    if (c0 || c1) { log_show("rank 0", logname("strangers_r0")); log_show("rank 1", logname("strangers_r1")); }
    for (int i = 0; i < IDLE; i++) if (idle[i] >= 0) close(idle[i]);
    for (int i = 0; i < GARBAGE; i++) if (junk[i] >= 0) close(junk[i]);
    close(bad);
}

// Job A's rank 0 and job B's rank 1 on one MASTER_PORT: they must not form a group.
TSYS_TEST(two_jobs_on_one_port_do_not_mix) {
    int port = free_port();
    job_rank a0 = { 0, 2, port, "job-a", NULL, "127.0.0.1", 20, 0 }, a1 = a0, b1 = a0;
    a1.rank = 1;
    b1.rank = 1; b1.run_id = "job-b"; b1.timeout_s = 4;
    pid_t pa0 = start_rank(a0, logname("jobs_a0"));
    char local[64];
    listen_addr(port, local, sizeof local, 10);
    pid_t pb1 = start_rank(b1, logname("jobs_b1"));
    int cb1 = finish(pb1, 20);
    pid_t pa1 = start_rank(a1, logname("jobs_a1"));
    int ca0 = finish(pa0, 30), ca1 = finish(pa1, 30);
    TEST_CHECK(cb1 == 1 && log_has(logname("jobs_b1"), "another job"), "job B's rank 1: exit %d, must fail naming the other job", cb1);
    TEST_CHECK(ca0 == 0 && ca1 == 0, "job A: exit codes %d %d", ca0, ca1);
    if (cb1 != 1 || ca0 || ca1) { log_show("job A rank 0", logname("jobs_a0")); log_show("job B rank 1", logname("jobs_b1")); }
}

// A rank without the job's secret is refused (and cannot see the others' secret: only MACs cross).
TSYS_TEST(wrong_secret_is_refused) {
    int port = free_port();
    job_rank a0 = { 0, 2, port, "job-a", "s3cret", "127.0.0.1", 20, 0 }, a1 = a0, x1 = a0;
    a1.rank = 1;
    x1.rank = 1; x1.secret = "guess"; x1.timeout_s = 4;
    pid_t pa0 = start_rank(a0, logname("secret_a0"));
    char local[64];
    listen_addr(port, local, sizeof local, 10);
    pid_t px1 = start_rank(x1, logname("secret_x1"));
    int cx1 = finish(px1, 20);
    pid_t pa1 = start_rank(a1, logname("secret_a1"));
    int ca0 = finish(pa0, 30), ca1 = finish(pa1, 30);
    TEST_CHECK(cx1 == 1 && log_has(logname("secret_x1"), "authentication"), "the rank with a wrong secret: exit %d", cx1);
    TEST_CHECK(log_has(logname("secret_a0"), "failed authentication"), "rank 0 logs it");
    TEST_CHECK(ca0 == 0 && ca1 == 0, "the job: exit codes %d %d", ca0, ca1);
    if (cx1 != 1 || ca0 || ca1) { log_show("rank 0", logname("secret_a0")); log_show("impostor", logname("secret_x1")); }
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
