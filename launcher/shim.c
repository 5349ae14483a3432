/*
 * rdma-cni shim: the host side of the thick plugin.
 *
 * The full plugin is Python in a PyInstaller bundle, which needs the glibc it
 * was built against; hosts run glibc 2.28 (RHEL 8) and later. This program is
 * what `rdma-cni install --mode shim` puts in /opt/cni/bin instead: static,
 * no glibc name service calls, nothing unpacked. It hands each CNI verb to the
 * node agent's CNI server (rdma_cni/agent/cniserver.py) over a unix socket and
 * relays the answer, so the verb runs in the DaemonSet's own userspace.
 *
 * Request, one sendmsg (header) then the rest:
 *   struct shim_request + env (NUL-separated CNI_* variables) + stdin
 * with the pod's network namespace, opened here in the runtime's mount view,
 * attached by SCM_RIGHTS: the server never resolves CNI_NETNS itself.
 * Answer: struct shim_answer + stdout + stderr; exit with its status.
 *
 * With no server taking the call (none listening, its queue full, the call
 * dropped): VERSION is answered here; DEL is written to the spool
 * (<socket dir>/del-spool), creating any directory of that path a reboot
 * removed, and succeeds (a pod must always be deletable): the agent that
 * serves the node runs it within seconds, or when it starts
 * (rdma_cni/agent/delspool.py); ADD, CHECK, GC fail with code 11 (try again
 * later), STATUS with code 50 (plugin not available).
 *
 * The socket is $RDMA_CNI_SHIM_SOCKET, else /run/rdma-cni/agent/cni.sock.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "shim.h"

extern char **environ;

#define DEFAULT_SOCKET "/run/rdma-cni/agent/cni.sock"
#define SPOOL_NAME "del-spool"
/* Spooled DELs at most: a node has far fewer attachments than this. */
#define SPOOL_MAX 4096
/* The plugin refuses a config over 1 MiB; one byte more is enough for it to say so. */
#define MAX_STDIN ((1u << 20) + 1)
#define MAX_ENV (64u << 10)
#define MAX_ANSWER (4u << 20)
/* The server times a verb out before this (rdma_cni.agent.cniserver.VERB_TIMEOUT). */
#define ANSWER_TIMEOUT_MS (300 * 1000)
#define SEND_TIMEOUT_MS (10 * 1000)

/* Variables the server may take from a runtime: the CNI ones, nothing else. */
static const char *const FORWARDED[] = {"CNI_COMMAND", "CNI_CONTAINERID", "CNI_NETNS",
                                        "CNI_IFNAME",  "CNI_ARGS",        "CNI_PATH"};

/* text as the inside of a JSON string: quote and backslash escaped, control characters dropped. */
static void json_chars(const char *text)
{
    for (const char *p = text; *p; p++) {
        if (*p == '"' || *p == '\\')
            putchar('\\');
        if ((unsigned char)*p >= 0x20)
            putchar(*p);
    }
}

/* A CNI error document on stdout, the message on stderr; the exit status. */
static int cni_error(int code, const char *msg, const char *details)
{
    fprintf(stderr, "rdma-cni shim: %s%s%s\n", msg, details ? ": " : "", details ? details : "");
    printf("{\"cniVersion\": \"%s\", \"code\": %d, \"msg\": \"", SHIM_CNI_VERSION, code);
    json_chars(msg);
    printf("\"");
    if (details) {
        printf(", \"details\": \"");
        json_chars(details);
        printf("\"");
    }
    printf("}\n");
    fflush(stdout);
    return 1;
}

struct buf {
    char *data;
    size_t len, cap;
};

static int buf_add(struct buf *b, const void *p, size_t n)
{
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n)
            cap *= 2;
        char *d = realloc(b->data, cap);
        if (!d)
            return -1;
        b->data = d;
        b->cap = cap;
    }
    memcpy(b->data + b->len, p, n);
    b->len += n;
    return 0;
}

static int write_all(int fd, const char *p, size_t n)
{
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* Read stdin up to MAX_STDIN bytes (the plugin reports an oversized config). */
static int read_stdin(struct buf *in)
{
    char chunk[65536];
    while (in->len < MAX_STDIN) {
        size_t want = MAX_STDIN - in->len < sizeof chunk ? MAX_STDIN - in->len : sizeof chunk;
        ssize_t n = read(0, chunk, want);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno == EBADF)
            return 0; /* a closed stdin reads as empty, as for the plugin */
        if (n < 0)
            return -1;
        if (n == 0)
            break;
        if (buf_add(in, chunk, (size_t)n) < 0)
            return -1;
    }
    return 0;
}

static int collect_env(struct buf *env)
{
    for (size_t i = 0; i < sizeof FORWARDED / sizeof *FORWARDED; i++) {
        const char *v = getenv(FORWARDED[i]);
        if (!v)
            continue;
        size_t kl = strlen(FORWARDED[i]), vl = strlen(v);
        if (env->len + kl + vl + 2 > MAX_ENV)
            return -1;
        if (buf_add(env, FORWARDED[i], kl) < 0 || buf_add(env, "=", 1) < 0 || buf_add(env, v, vl + 1) < 0)
            return -1;
    }
    return 0;
}

static const char *socket_path(void)
{
    const char *p = getenv("RDMA_CNI_SHIM_SOCKET");
    return p && *p ? p : DEFAULT_SOCKET;
}

/* Wait for fd to be ready for `events`, up to the deadline (monotonic ms). */
static int wait_fd(int fd, short events, long long deadline)
{
    for (;;) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        long long left = deadline - (ts.tv_sec * 1000LL + ts.tv_nsec / 1000000);
        if (left <= 0)
            return -1;
        struct pollfd p = {.fd = fd, .events = events};
        int r = poll(&p, 1, (int)(left > 60000 ? 60000 : left));
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return -1;
        if (r > 0)
            return 0;
    }
}

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

/* Send (events POLLOUT) or receive (POLLIN) all n bytes at p on s by the deadline (monotonic ms). */
static int transfer(int s, char *p, size_t n, short events, long long deadline)
{
    while (n) {
        if (wait_fd(s, events, deadline) < 0)
            return -1;
        ssize_t k = events == POLLOUT ? send(s, p, n, MSG_NOSIGNAL | MSG_DONTWAIT) : recv(s, p, n, MSG_DONTWAIT);
        if (k < 0 && (errno == EINTR || errno == EAGAIN))
            continue;
        if (k <= 0)
            return -1;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

/* Connect; -1 with errno when no server takes the call. Non-blocking: a server
 * whose backlog is full (hung) answers EAGAIN at once instead of holding the runtime. */
static int connect_server(const char *path)
{
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    if (strlen(path) >= sizeof addr.sun_path) {
        errno = ENAMETOOLONG;
        return -1;
    }
    strcpy(addr.sun_path, path);
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (s < 0)
        return -1;
    if (connect(s, (struct sockaddr *)&addr, sizeof addr) < 0) {
        int err = errno;
        close(s);
        errno = err;
        return -1;
    }
    return s;
}

enum sent { SENT_NONE, SENT_PART, SENT_ALL };

/* Send the request; how much of it went (the verb may run once any of it went). */
static enum sent send_request(int s, struct shim_request *h, const struct buf *env, const struct buf *in, int netns_fd)
{
    long long deadline = now_ms() + SEND_TIMEOUT_MS;
    struct iovec iov = {.iov_base = h, .iov_len = sizeof *h};
    char control[CMSG_SPACE(sizeof(int))];
    memset(control, 0, sizeof control);
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    if (netns_fd >= 0) {
        msg.msg_control = control;
        msg.msg_controllen = sizeof control;
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &netns_fd, sizeof(int));
    }
    /* The header is far smaller than a socket buffer: it goes whole or not at all. */
    if (wait_fd(s, POLLOUT, deadline) < 0 || sendmsg(s, &msg, MSG_NOSIGNAL) != (ssize_t)sizeof *h)
        return SENT_NONE;
    if (transfer(s, env->data ? env->data : "", env->len, POLLOUT, deadline) < 0 ||
        transfer(s, in->data ? in->data : "", in->len, POLLOUT, deadline) < 0)
        return SENT_PART;
    return SENT_ALL;
}

/* Relay the answer; -1 when none came whole. */
static int relay_answer(int s, int *status)
{
    long long deadline = now_ms() + ANSWER_TIMEOUT_MS;
    struct shim_answer a;
    if (transfer(s, (char *)&a, sizeof a, POLLIN, deadline) < 0 || memcmp(a.magic, SHIM_ANSWER_MAGIC, sizeof a.magic) != 0 ||
        a.stdout_len > MAX_ANSWER || a.stderr_len > MAX_ANSWER || a.status < 0 || a.status > 255)
        return -1;
    char *out = malloc((size_t)a.stdout_len + a.stderr_len + 1);
    if (!out || transfer(s, out, (size_t)a.stdout_len + a.stderr_len, POLLIN, deadline) < 0)
        return -1;
    /* The runtime may have closed its ends; the status still counts. */
    write_all(2, out + a.stdout_len, a.stderr_len);
    write_all(1, out, a.stdout_len);
    free(out);
    *status = (int)a.status;
    return 0;
}

static int valid_container_id(const char *id)
{
    size_t n = strlen(id);
    if (n == 0 || n > 128)
        return 0;
    for (const char *p = id; *p; p++) {
        char c = *p;
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' ||
              c == '.'))
            return 0;
    }
    return 1;
}

static char why_buf[512];

/* Every directory above the agent's, from the root down, as the plugin trusts the lock's
 * directory (rdma_cni/node/statedir.py): a directory owned by root (or us) that no one else
 * can write into, unless sticky. One that is missing (a reboot emptied /run) is created 0755,
 * as the plugin and kubelet's hostPath create it. */
static int trusted_parents(const char *dir, const char **why)
{
    char path[256];
    if (snprintf(path, sizeof path, "%s", dir) >= (int)sizeof path) {
        *why = "the socket path is too long";
        return -1;
    }
    for (char *p = path + 1;; p++) {
        if (*p != '/' && *p != '\0')
            continue;
        char saved = *p;
        *p = '\0';
        struct stat st;
        if (stat(path, &st) < 0 && (errno != ENOENT || (mkdir(path, 0755) < 0 && errno != EEXIST) || stat(path, &st) < 0)) {
            snprintf(why_buf, sizeof why_buf, "cannot create %s: %s", path, strerror(errno));
            *why = why_buf;
            return -1;
        }
        if (!S_ISDIR(st.st_mode) || (st.st_uid != 0 && st.st_uid != geteuid()) ||
            ((st.st_mode & 022) && !(st.st_mode & S_ISVTX))) {
            snprintf(why_buf, sizeof why_buf,
                     "%s is not a directory owned by root that only root can write into (owner %u, mode %04o)", path,
                     (unsigned)st.st_uid, (unsigned)(st.st_mode & 07777));
            *why = why_buf;
            return -1;
        }
        *p = saved;
        if (saved == '\0')
            return 0;
    }
}

/* The agent's directory and the spool in it: ours and private (0700), as the server makes them. */
static int private_dir(const char *dir, const char **why)
{
    if (mkdir(dir, 0700) < 0 && errno != EEXIST) {
        snprintf(why_buf, sizeof why_buf, "cannot create %s: %s", dir, strerror(errno));
        *why = why_buf;
        return -1;
    }
    struct stat st;
    if (lstat(dir, &st) < 0 || !S_ISDIR(st.st_mode) || st.st_uid != geteuid() || (st.st_mode & 077)) {
        snprintf(why_buf, sizeof why_buf, "%s is not a private directory of root (mode 0700, owned by root)", dir);
        *why = why_buf;
        return -1;
    }
    return 0;
}

static int spool_count(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return 0;
    int n = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;)
        n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

/* Write the DEL request to the spool, atomically, mode 0600. 0, or -1 with a reason. */
static int spool_del(const struct shim_request *h, const struct buf *env, const struct buf *in, const char **why)
{
    const char *id = getenv("CNI_CONTAINERID");
    const char *ifname = getenv("CNI_IFNAME");
    if (!id || !valid_container_id(id) || !ifname || !*ifname || strlen(ifname) > 64) {
        *why = "CNI_CONTAINERID or CNI_IFNAME is missing or not valid";
        return -1;
    }
    /* A unix socket path fits in 108 bytes, so these cannot overflow. */
    char sock[128], dir[256], name[512], tmp[512];
    if (strlen(socket_path()) >= sizeof sock) {
        *why = "the socket path is too long";
        return -1;
    }
    snprintf(sock, sizeof sock, "%s", socket_path());
    char *slash = strrchr(sock, '/');
    if (!slash) {
        *why = "the socket path has no directory";
        return -1;
    }
    *slash = '\0';
    /* The socket's directory too: the spool must not appear in a directory others can write. */
    char *up = strrchr(sock, '/');
    if (up && up != sock) {
        *up = '\0';
        int bad = trusted_parents(sock, why);
        *up = '/';
        if (bad)
            return -1;
    }
    if (*sock && private_dir(sock, why) < 0)
        return -1;
    snprintf(dir, sizeof dir, "%s/%s", sock, SPOOL_NAME);
    if (private_dir(dir, why) < 0)
        return -1;
    char hex[2 * 64 + 1];
    for (size_t i = 0; ifname[i]; i++)
        snprintf(hex + 2 * i, 3, "%02x", (unsigned char)ifname[i]);
    hex[2 * strlen(ifname)] = '\0';
    /* One file per attachment: a repeated DEL replaces its own request. */
    int n = snprintf(name, sizeof name, "%s/del-%s-%s.req", dir, id, hex);
    int m = snprintf(tmp, sizeof tmp, "%s/.tmp-%ld", dir, (long)getpid());
    if (n < 0 || (size_t)n >= sizeof name || m < 0 || (size_t)m >= sizeof tmp) {
        *why = "the spool path is too long";
        return -1;
    }
    if (access(name, F_OK) < 0 && spool_count(dir) >= SPOOL_MAX) {
        *why = "the spool is full";
        return -1;
    }
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {
        *why = "cannot write into the spool";
        return -1;
    }
    struct shim_request spooled = *h;
    spooled.flags = 0; /* no namespace travels with a spooled request */
    spooled.netns_errno = 0;
    if (write_all(fd, (const char *)&spooled, sizeof spooled) < 0 || write_all(fd, env->data ? env->data : "", env->len) < 0 ||
        write_all(fd, in->data ? in->data : "", in->len) < 0 || fsync(fd) < 0 || close(fd) < 0) {
        unlink(tmp);
        *why = "cannot write into the spool";
        return -1;
    }
    if (rename(tmp, name) < 0) {
        unlink(tmp);
        *why = "cannot write into the spool";
        return -1;
    }
    int fdir = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fdir >= 0) {
        fsync(fdir);
        close(fdir);
    }
    return 0;
}

/* What a verb gets when no server takes it; `state` says why in a few words ("is not running"). */
static int server_down(const char *command, const struct shim_request *h, const struct buf *env,
                       const struct buf *in, const char *state, const char *reason)
{
    char msg[256];
    if (strcmp(command, "VERSION") == 0) {
        printf("{\"cniVersion\": \"%s\", \"supportedVersions\": [%s]}\n", SHIM_CNI_VERSION, SHIM_SUPPORTED_VERSIONS);
        return 0;
    }
    if (strcmp(command, "DEL") == 0) {
        const char *why = NULL;
        if (spool_del(h, env, in, &why) < 0) {
            snprintf(msg, sizeof msg, "the rdma-cni agent %s and this DEL could not be spooled; try again later", state);
            return cni_error(11, msg, why);
        }
        fprintf(stderr,
                "rdma-cni shim: the agent %s (%s): DEL spooled; the agent serving this node runs it within seconds, "
                "or when it starts\n",
                state, reason);
        return 0;
    }
    if (strcmp(command, "STATUS") == 0) {
        snprintf(msg, sizeof msg, "the rdma-cni agent %s: the plugin is not available", state);
        return cni_error(50, msg, reason);
    }
    snprintf(msg, sizeof msg, "the rdma-cni agent %s; try again later", state);
    return cni_error(11, msg, reason);
}

int main(int argc, char **argv)
{
    (void)argv;
    const char *command = getenv("CNI_COMMAND");
    if (argc > 1 || !command || !*command) {
        fprintf(stderr, "rdma-cni shim %s: runs CNI verbs (CNI_COMMAND) in the rdma-cni node agent through %s\n",
                SHIM_VERSION, socket_path());
        return argc > 1 && (strcmp(argv[1], "--version") == 0 || strcmp(argv[1], "--help") == 0) ? 0 : 1;
    }
    struct buf env = {0}, in = {0};
    if (collect_env(&env) < 0)
        return cni_error(4, "the CNI_* environment is too large", NULL);
    if (read_stdin(&in) < 0)
        return cni_error(6, "cannot read the network configuration on stdin", strerror(errno));

    struct shim_request h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, SHIM_REQUEST_MAGIC, sizeof h.magic);
    h.env_len = (uint32_t)env.len;
    h.stdin_len = (uint32_t)in.len;
    int netns_fd = -1;
    const char *netns = getenv("CNI_NETNS");
    /* Opened here, in the runtime's mount view; the plugin checks what it is. */
    if (netns && *netns && strcmp(command, "VERSION") != 0) {
        netns_fd = open(netns, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
        if (netns_fd >= 0)
            h.flags |= SHIM_FLAG_NETNS;
        else
            h.netns_errno = errno;
    }

    char reason[256];
    int s = connect_server(socket_path());
    if (s < 0) {
        /* A full queue of calls (EAGAIN) is a busy agent, not a missing one. */
        const char *state = errno == EAGAIN ? "is busy (its queue of calls is full)" : "is not running";
        snprintf(reason, sizeof reason, "%s: %s", socket_path(), strerror(errno));
        return server_down(command, &h, &env, &in, state, reason);
    }
    enum sent sent = send_request(s, &h, &env, &in, netns_fd);
    if (netns_fd >= 0)
        close(netns_fd);
    int status = 1;
    if (sent == SENT_NONE) {
        snprintf(reason, sizeof reason, "%s did not take the request", socket_path());
        return server_down(command, &h, &env, &in, "did not take the call", reason);
    }
    if (sent == SENT_ALL && relay_answer(s, &status) == 0)
        return status;
    /* The verb may have run, in part: a DEL is safe to run again later, nothing else is. */
    snprintf(reason, sizeof reason, "%s went away during the call", socket_path());
    const char *dropped = "closed the call without an answer (too busy, or stopping)";
    if (strcmp(command, "DEL") == 0)
        return server_down(command, &h, &env, &in, dropped, reason);
    if (strcmp(command, "VERSION") == 0)
        return server_down(command, &h, &env, &in, dropped, reason);
    return cni_error(11, "the rdma-cni agent went away during the call; its outcome is unknown, try again later",
                     reason);
}
