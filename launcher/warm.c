/*
 * Warm start, the launcher's half (the server is rdma_cni/launch/warm.py).
 *
 * Most of a cold start is Python importing pydantic, requests and pyroute2,
 * which kubelet would pay for every pod. A warm server, started from the
 * cached tree on first use, has imported them once and forks a child per
 * CNI invocation. The launcher hands the child its stdin, stdout and stderr
 * and relays the child's exit status, so to the runtime nothing differs but
 * the time taken.
 *
 * Handshake over <tree>/warm.sock (mode 0600, in the private cache):
 *   launcher -> server  "RDMACNI-WARM-1"
 *   server -> launcher  'R'  it will serve this caller (same user and
 *                            namespaces; it read argv, environment, cwd and
 *                            umask from /proc/<pid>)
 *   launcher -> server  'G' with fds 0, 1, 2 attached: go; from here on the
 *                            launcher never runs the command itself
 *   server -> launcher  'S'  the child runs (sent by the child; or 'F' from
 *                            the server: fork failed, nothing ran)
 *   server -> launcher  'X' + int32 wait status when the child is done: sent
 *                            by the child itself once its stdio is closed
 *                            (its exit code), or by the server when it reaps
 *                            a child that could not (killed by a signal).
 * Anything else before 'G' (no server, refusal, a slow or odd reply) makes
 * the launcher run the command cold, as if there were no server, so a warm
 * server can only make a start faster, never make it fail. If the launcher
 * dies, the server kills the child's process group, as a runtime killing a
 * cold plugin would. If the server dies, the child still reports; only when
 * both are gone without an 'X' is the outcome unknown (exit 1). The stdio
 * fds travel only after 'R': fds in flight to a
 * server that is stuck would keep the runtime's stdout pipe open, and the
 * runtime waits for its EOF.
 */
#define _GNU_SOURCE
#include "warm.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#define HELLO "RDMACNI-WARM-1"
#define SOCKET_NAME "warm.sock"
/* How long the server may take to accept the caller before a cold start. */
#define READY_TIMEOUT_MS 2000

int warm_enabled(void)
{
    const char *v = getenv("RDMA_CNI_WARM");
    if (!v || !*v)
        return 1;
    return !(strcmp(v, "0") == 0 || strcmp(v, "off") == 0 || strcmp(v, "false") == 0 || strcmp(v, "no") == 0);
}

static int read_byte(int fd, int timeout_ms, char *out)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    for (;;) {
        int r = poll(&p, 1, timeout_ms);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        ssize_t n = read(fd, out, 1);
        if (n < 0 && errno == EINTR)
            continue;
        return n == 1 ? 0 : -1;
    }
}

static int read_exact(int fd, void *buf, size_t len)
{
    char *p = buf;
    while (len) {
        ssize_t n = read(fd, p, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

/* The socket is addressed through an fd of its directory: the cache path may
 * be longer than sun_path allows. */
static void socket_address(int dirfd, struct sockaddr_un *addr)
{
    memset(addr, 0, sizeof *addr);
    addr->sun_family = AF_UNIX;
    snprintf(addr->sun_path, sizeof addr->sun_path, "/proc/self/fd/%d/%s", dirfd, SOCKET_NAME);
}

static void exit_like(int status)
{
    if (WIFEXITED(status))
        exit(WEXITSTATUS(status));
    if (WIFSIGNALED(status)) {
        int sig = WTERMSIG(status);
        signal(sig, SIG_DFL);
        raise(sig);
        exit(128 + sig);
    }
    exit(1);
}

enum warm_outcome warm_run(const char *tree)
{
    int dirfd = open(tree, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dirfd < 0)
        return WARM_NO_SERVER;
    struct sockaddr_un addr;
    socket_address(dirfd, &addr);
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0) {
        close(dirfd);
        return WARM_NOT_SERVED;
    }
    if (connect(s, (struct sockaddr *)&addr, sizeof addr) < 0) {
        int err = errno;
        close(s);
        close(dirfd);
        return (err == ENOENT || err == ECONNREFUSED) ? WARM_NO_SERVER : WARM_NOT_SERVED;
    }
    close(dirfd);

    char reply = 0;
    if (send(s, HELLO, sizeof HELLO - 1, MSG_NOSIGNAL) != (ssize_t)(sizeof HELLO - 1) ||
        read_byte(s, READY_TIMEOUT_MS, &reply) < 0 || reply != 'R') {
        close(s);
        return WARM_NOT_SERVED;
    }
    int fds[3] = {0, 1, 2};
    char control[CMSG_SPACE(sizeof fds)];
    memset(control, 0, sizeof control);
    struct iovec iov = {.iov_base = "G", .iov_len = 1};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control, .msg_controllen = sizeof control};
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof fds);
    memcpy(CMSG_DATA(c), fds, sizeof fds);
    /* A closed stdin/stdout/stderr cannot be passed (EBADF): run cold. */
    if (sendmsg(s, &msg, MSG_NOSIGNAL) != 1) {
        close(s);
        return WARM_NOT_SERVED;
    }
    /* Committed: the server may already be forking. */
    if (read_exact(s, &reply, 1) == 0 && reply == 'F') {
        close(s);
        return WARM_NOT_SERVED;
    }
    int32_t status;
    char tag;
    if (reply != 'S' || read_exact(s, &tag, 1) < 0 || tag != 'X' || read_exact(s, &status, sizeof status) < 0) {
        /* Whether the command ran, and how far, is unknown: never run it again. */
        fprintf(stderr, "rdma-cni launcher: the warm server went away while running this command; "
                        "its outcome is unknown\n");
        exit(1);
    }
    exit_like(status);
    return WARM_NOT_SERVED; /* not reached */
}

void warm_spawn(const char *program, const char *launcher)
{
    pid_t pid = fork();
    if (pid < 0)
        return;
    if (pid > 0) {
        while (waitpid(pid, NULL, 0) < 0 && errno == EINTR)
            ;
        return;
    }
    /* A session and a second fork of its own, so the server is nobody's
     * child and shares no terminal or process group with the runtime. */
    if (setsid() < 0 || fork() != 0)
        _exit(0);
    /* The runtime reads our stdout to EOF: the server must not hold it. */
    int null = open("/dev/null", O_RDWR);
    if (null < 0)
        _exit(1);
    dup2(null, 0);
    dup2(null, 1);
    dup2(null, 2);
    close_range(3, ~0U, 0);
    char idle[64] = "";
    const char *v = getenv("RDMA_CNI_WARM_IDLE");
    if (v && strlen(v) < sizeof idle - 20)
        snprintf(idle, sizeof idle, "RDMA_CNI_WARM_IDLE=%s", v);
    /* The server exits once no launcher it serves carries its payload any
     * more (an upgrade): it starts out knowing this one. */
    char self[PATH_MAX + 32] = "";
    if (strlen(launcher) < PATH_MAX)
        snprintf(self, sizeof self, "RDMA_CNI_LAUNCHER=%s", launcher);
    char *envp[3] = {NULL, NULL, NULL};
    int n = 0;
    if (self[0])
        envp[n++] = self;
    if (idle[0])
        envp[n++] = idle;
    char *args[] = {(char *)program, "warm-server", NULL};
    execve(program, args, envp);
    _exit(127);
}
