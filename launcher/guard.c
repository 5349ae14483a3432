/*
 * The IPAM guard, exec'd rather than forked (rdma_cni/node/ipam.py starts it with
 * posix_spawn). A fork of the plugin cost ~3 ms of CPU per IPAM call here:
 * page tables and copied pages of a ~37 MB Python process, for a process that
 * only waits. This one is a few pages.
 *
 * Its promises are those of the Python guard it stands in for: it runs in a
 * session of its own (the plugin spawns it so), holds the node lock it was
 * given on fd 3 until IPAM is done (IPAM outlives a killed plugin, and the
 * runtime's DEL waits for it), enforces the budget even when the plugin is
 * dead (IPAM is the leader of its own process group, and the whole group is
 * killed on overrun), and reports on fd 1 what ipam.py's _parse_report reads:
 * "<pid>\n", then "R <exit code or -signal> <timed out> <stdout bytes>
 * <stderr bytes>\n" and the bytes, or "E<why>\n" if IPAM could not start.
 * IPAM's stdin is fd 0 as given (a memfd holding the request).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "guard.h"

#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif

#define MAX_OUT (1 << 20)   /* kept of IPAM's stdout (a result is a few hundred bytes) */
#define MAX_ERR (1 << 16)   /* kept of the end of its stderr */
#define GRACE_MS 2500       /* reading what a killed group still writes, at most */

extern char **environ;

struct sink {
    int fd;
    char *data;
    size_t len;
    size_t limit;
    int keep_tail; /* stderr: the last `limit` bytes matter, not the first */
};

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void write_all(const char *buf, size_t len)
{
    while (len) {
        ssize_t n = write(1, buf, len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return; /* the plugin is gone: nobody reads the report */
        }
        buf += n;
        len -= (size_t)n;
    }
}

/* Read what is there; returns 0 at end of file (or a read error). */
static int drain(struct sink *s)
{
    char chunk[65536];
    ssize_t n = read(s->fd, chunk, sizeof chunk);
    if (n < 0)
        return errno == EINTR || errno == EAGAIN;
    if (n == 0)
        return 0;
    size_t take = (size_t)n;
    if (!s->keep_tail) {
        if (s->len >= s->limit)
            return 1;
        if (take > s->limit - s->len)
            take = s->limit - s->len;
    } else if (s->len + take > 2 * s->limit) {
        /* Keep the buffer at twice the limit: slide the last `limit` bytes to the front. */
        size_t keep = s->len > s->limit ? s->limit : s->len;
        memmove(s->data, s->data + s->len - keep, keep);
        s->len = keep;
        if (take > s->limit) {
            memcpy(s->data, chunk + take - s->limit, s->limit);
            s->len = s->limit;
            return 1;
        }
    }
    memcpy(s->data + s->len, chunk, take);
    s->len += take;
    return 1;
}

int guard_main(int argc, char **argv)
{
    if (argc < 4)
        return 2;
    long long budget = strtoll(argv[2], NULL, 10);
    const char *ipam = argv[3];
    signal(SIGPIPE, SIG_IGN); /* a dead plugin must not kill us while IPAM runs */
    signal(SIGINT, SIG_IGN);
    /* Only stdio reaches IPAM; the node lock (fd 3) stays open here, not there. */
    syscall(SYS_close_range, 3U, ~0U, CLOSE_RANGE_CLOEXEC);

    int out[2], err[2];
    if (pipe2(out, O_CLOEXEC) < 0 || pipe2(err, O_CLOEXEC) < 0) {
        dprintf(1, "E%s\n", strerror(errno));
        return 0;
    }
    posix_spawn_file_actions_t actions;
    posix_spawnattr_t attr;
    sigset_t defaults;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, out[1], 1);
    posix_spawn_file_actions_adddup2(&actions, err[1], 2);
    posix_spawnattr_init(&attr);
    sigemptyset(&defaults);
    sigaddset(&defaults, SIGPIPE);
    sigaddset(&defaults, SIGXFSZ);
    posix_spawnattr_setsigdefault(&attr, &defaults);
    posix_spawnattr_setpgroup(&attr, 0);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGDEF);
    pid_t pid;
    int rc = posix_spawn(&pid, ipam, &actions, &attr, argv + 3, environ);
    if (rc != 0) {
        dprintf(1, "E%s\n", strerror(rc));
        return 0;
    }
    close(out[1]);
    close(err[1]);
    close(0);
    dprintf(1, "%d\n", (int)pid);

    struct sink sinks[2] = {
        {out[0], malloc(MAX_OUT), 0, MAX_OUT, 0},
        {err[0], malloc(2 * MAX_ERR), 0, MAX_ERR, 1},
    };
    if (!sinks[0].data || !sinks[1].data)
        sinks[0].limit = sinks[1].limit = 0; /* keep nothing rather than fail */
    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
    int open_pipes = 2, exited = 0, reaped = 0, timed_out = 0, status = 0;
    long long deadline = now_ms() + budget;
    while (open_pipes || !exited) {
        long long left = deadline - now_ms();
        if (left <= 0) {
            if (timed_out)
                break; /* the grace after the kill is over */
            timed_out = 1;
            kill(-pid, SIGKILL); /* the whole group: a script's children hold the pipes too */
            deadline = now_ms() + GRACE_MS;
            continue;
        }
        struct pollfd fds[3] = {
            {sinks[0].fd, POLLIN, 0},
            {sinks[1].fd, POLLIN, 0},
            {exited ? -1 : pidfd, POLLIN, 0},
        };
        int wait = left > 1000000 ? 1000000 : (int)left;
        if (pidfd < 0 && !exited && !open_pipes)
            wait = wait > 10 ? 10 : wait; /* no pidfd: look for the exit now and then */
        if (poll(fds, 3, wait) < 0 && errno != EINTR)
            break;
        for (int i = 0; i < 2; i++) {
            if (sinks[i].fd >= 0 && (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) && !drain(&sinks[i])) {
                close(sinks[i].fd);
                sinks[i].fd = -1;
                open_pipes--;
            }
        }
        if (pidfd >= 0 && (fds[2].revents & POLLIN))
            exited = 1;
        if (pidfd < 0 && !exited && waitpid(pid, &status, WNOHANG) == pid)
            exited = reaped = 1;
    }
    if (!exited)
        kill(-pid, SIGKILL);
    while (!reaped && waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
    size_t err_len = sinks[1].len > MAX_ERR ? MAX_ERR : sinks[1].len;
    const char *err_tail = sinks[1].data + sinks[1].len - err_len;
    char head[128];
    int n = snprintf(head, sizeof head, "R %d %d %zu %zu\n", code, timed_out, sinks[0].len, err_len);
    write_all(head, (size_t)n);
    write_all(sinks[0].data, sinks[0].len);
    write_all(err_tail, err_len);
    return 0;
}
