/*
 * rdma-cni launcher: makes the PyInstaller one-dir build a single executable
 * that starts as fast as the one-dir build itself.
 *
 * PyInstaller's one-file mode unpacks ~25 MB into a fresh temporary directory
 * on every start, and kubelet starts the plugin for every pod. Here the
 * one-dir tree is appended to this program (see scripts/pack_launcher.py); it
 * is unpacked once into <cache>/<id>, where <id> is the payload's content
 * hash, and every start after that is a single execv() of the cached
 * program.
 *
 * Cache: $RDMA_CNI_CACHE_DIR, else /var/cache/rdma-cni for root (/tmp/rdma-cni-0
 * when that is on a read-only filesystem), else /tmp/rdma-cni-<uid>. It must be a directory owned by us and not writable by
 * group or others, or nothing runs from it. A tree is unpacked into a private
 * temporary directory, flushed, and renamed into place, so a reader never
 * sees a half-written tree and concurrent first starts settle on one copy.
 *
 * Failures are reported as a CNI error document on stdout when CNI_COMMAND
 * is set (a runtime expects one), and on stderr in any case.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/types.h>
#include <unistd.h>

#include "guard.h"
#include "warm.h"

#define MAGIC "RDMACNI\001"
#define ID_LEN 16
#define PROGRAM "rdma-cni"
#define COMPLETE ".complete"

struct trailer {
    char magic[8];
    uint64_t offset; /* where the first entry starts, from the start of the file */
    uint64_t count;  /* number of entries */
    char id[ID_LEN]; /* hex content hash, not NUL-terminated */
};

struct entry_header {
    uint32_t path_len;
    uint32_t mode;
    uint64_t size;
};

static int remove_entry(const char *path, const struct stat *st, int type, struct FTW *ftw);

/* The private directory being unpacked into, removed if unpacking fails. */
static char unpacking[PATH_MAX];

static void die(const char *what, int err)
{
    if (unpacking[0])
        nftw(unpacking, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    char msg[PATH_MAX + 256];
    snprintf(msg, sizeof msg, "rdma-cni launcher: %s%s%s", what, err ? ": " : "", err ? strerror(err) : "");
    fprintf(stderr, "%s\n", msg);
    if (getenv("CNI_COMMAND")) {
        /* The message holds no quotes or backslashes of its own; paths could. */
        printf("{\"cniVersion\": \"1.0.0\", \"code\": 5, \"msg\": \"");
        for (const char *p = msg; *p; p++) {
            if (*p == '"' || *p == '\\')
                putchar('\\');
            if ((unsigned char)*p >= 0x20)
                putchar(*p);
        }
        printf("\"}\n");
    }
    exit(1);
}

/* snprintf into a PATH_MAX buffer, refusing to run with a truncated path. */
__attribute__((format(printf, 2, 3))) static void path_printf(char *out, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(out, PATH_MAX, fmt, ap);
    va_end(ap);
    if (n < 0 || n >= PATH_MAX)
        die("a cache path is too long", ENAMETOOLONG);
}

static int read_full(int fd, void *buf, size_t len, off_t at)
{
    char *p = buf;
    while (len) {
        ssize_t n = pread(fd, p, len, at);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        p += n;
        len -= (size_t)n;
        at += n;
    }
    return 0;
}

static int copy_range(int in, off_t at, int out, uint64_t size)
{
    char buf[1 << 16];
    while (size) {
        size_t chunk = size < sizeof buf ? (size_t)size : sizeof buf;
        if (read_full(in, buf, chunk, at) < 0)
            return -1;
        for (size_t done = 0; done < chunk;) {
            ssize_t n = write(out, buf + done, chunk - done);
            if (n < 0 && errno == EINTR)
                continue;
            if (n < 0)
                return -1;
            done += (size_t)n;
        }
        at += (off_t)chunk;
        size -= chunk;
    }
    return 0;
}

/* Entry paths come from our own build, but are checked anyway: relative, no "..". */
static int safe_path(const char *path)
{
    if (!*path || path[0] == '/')
        return 0;
    for (const char *seg = path; seg; seg = strchr(seg, '/') ? strchr(seg, '/') + 1 : NULL) {
        if (!strncmp(seg, "..", 2) && (seg[2] == '/' || seg[2] == '\0'))
            return 0;
    }
    return 1;
}

static void make_parents(int dirfd, char *path)
{
    for (char *slash = strchr(path, '/'); slash; slash = strchr(slash + 1, '/')) {
        *slash = '\0';
        if (mkdirat(dirfd, path, 0755) < 0 && errno != EEXIST)
            die("cannot create a directory in the cache", errno);
        *slash = '/';
    }
}

static int remove_entry(const char *path, const struct stat *st, int type, struct FTW *ftw)
{
    (void)st;
    (void)type;
    (void)ftw;
    return remove(path);
}

static void check_private_dir(const char *dir)
{
    struct stat st;
    if (lstat(dir, &st) < 0)
        die("cannot inspect the cache directory", errno);
    if (!S_ISDIR(st.st_mode) || st.st_uid != geteuid() || (st.st_mode & 022))
        die("the cache directory must be a directory owned by this user and writable by no one else "
            "(set RDMA_CNI_CACHE_DIR to another)", 0);
}

/* Whether PATH, or the nearest of its parents that exists, is on a read-only
 * filesystem. A container run with a read-only root (the DaemonSet's
 * readOnlyRootFilesystem, podman --read-only) can neither create nor fill
 * /var/cache/rdma-cni, and no writable volume is mounted there. */
static int on_read_only_fs(const char *path)
{
    char at[PATH_MAX];
    path_printf(at, "%s", path);
    for (;;) {
        struct statvfs fs;
        if (statvfs(at, &fs) == 0)
            return (fs.f_flag & ST_RDONLY) != 0;
        char *slash = strrchr(at, '/');
        if (errno != ENOENT || !slash || !strcmp(at, "/"))
            return 0;
        slash[slash == at] = '\0'; /* "/var" -> "/" */
    }
}

static void unpack(int self, const struct trailer *t, const char *base, const char *target)
{
    char tmp[PATH_MAX];
    path_printf(tmp, "%s/.tmp-%.*s-%ld", base, ID_LEN, t->id, (long)getpid());
    if (mkdir(tmp, 0755) < 0)
        die("cannot create a temporary directory in the cache", errno);
    memcpy(unpacking, tmp, sizeof unpacking);
    int dirfd = open(tmp, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dirfd < 0)
        die("cannot open the temporary directory", errno);
    off_t at = (off_t)t->offset;
    for (uint64_t i = 0; i < t->count; i++) {
        struct entry_header h;
        char path[PATH_MAX];
        if (read_full(self, &h, sizeof h, at) < 0 || h.path_len == 0 || h.path_len >= sizeof path)
            die("the embedded payload is damaged (entry header)", 0);
        at += sizeof h;
        if (read_full(self, path, h.path_len, at) < 0)
            die("the embedded payload is damaged (entry path)", 0);
        path[h.path_len] = '\0';
        at += h.path_len;
        if (!safe_path(path))
            die("the embedded payload has an unsafe path", 0);
        make_parents(dirfd, path);
        int out = openat(dirfd, path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, h.mode & 0755);
        if (out < 0)
            die("cannot create a file in the cache", errno);
        if (copy_range(self, at, out, h.size) < 0)
            die("cannot unpack the embedded payload", errno ? errno : EIO);
        if (close(out) < 0)
            die("cannot write a file in the cache", errno);
        at += (off_t)h.size;
    }
    int done = openat(dirfd, COMPLETE, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (done < 0)
        die("cannot mark the unpacked tree complete", errno);
    close(done);
    /* The tree must be on disk before its name is: a crash must not leave a
     * "complete" tree with empty files behind. This rename publishes a whole
     * directory, before any Python runs: not rdma_cni/shared/atomicfile's
     * one-file write, whose guarantee (one file flushed, then renamed) it
     * extends to a tree with one syncfs. */
    if (syncfs(dirfd) < 0)
        die("cannot flush the unpacked tree", errno);
    close(dirfd);
    if (rename(tmp, target) < 0) {
        int err = errno;
        /* Another start unpacked the same payload first: use that one. */
        if (err != EEXIST && err != ENOTEMPTY)
            die("cannot move the unpacked tree into place", err);
        nftw(tmp, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    }
    unpacking[0] = '\0';
}

int main(int argc, char **argv)
{
    /* Started by the plugin itself to guard an IPAM call: no payload, no cache. */
    if (argc >= 2 && strcmp(argv[1], GUARD_ARG) == 0)
        return guard_main(argc, argv);
    char self_path[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self_path, sizeof self_path - 1);
    if (n < 0)
        die("cannot find this executable (/proc/self/exe)", errno);
    self_path[n] = '\0';
    int self = open(self_path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (self < 0 || fstat(self, &st) < 0)
        die("cannot open this executable", errno);
    struct trailer t;
    if (st.st_size < (off_t)sizeof t || read_full(self, &t, sizeof t, st.st_size - (off_t)sizeof t) < 0 ||
        memcmp(t.magic, MAGIC, sizeof t.magic) != 0 || t.offset >= (uint64_t)st.st_size)
        die("no embedded payload: this launcher was not packed (make build)", 0);
    for (int i = 0; i < ID_LEN; i++) {
        char c = t.id[i];
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f')))
            die("the embedded payload is damaged (id)", 0);
    }

    char base[PATH_MAX];
    const char *env_base = getenv("RDMA_CNI_CACHE_DIR");
    if (env_base && *env_base)
        path_printf(base, "%s", env_base);
    else if (geteuid() == 0 && !on_read_only_fs("/var/cache/rdma-cni"))
        path_printf(base, "/var/cache/rdma-cni");
    else
        path_printf(base, "/tmp/rdma-cni-%u", (unsigned)geteuid());
    if (mkdir(base, 0700) < 0 && errno != EEXIST)
        die("cannot create the cache directory", errno);
    check_private_dir(base);

    char target[PATH_MAX], complete[PATH_MAX], program[PATH_MAX];
    path_printf(target, "%s/%.*s", base, ID_LEN, t.id);
    path_printf(complete, "%s/%s", target, COMPLETE);
    path_printf(program, "%s/%s", target, PROGRAM);
    if (access(complete, F_OK) < 0)
        unpack(self, &t, base, target);
    close(self);
    /* CNI verbs only: operator subcommands (install runs for the life of a
     * DaemonSet pod and handles its own signals) always start cold. */
    if (argc == 1 && getenv("CNI_COMMAND") && warm_enabled()) {
        if (warm_run(target) == WARM_NO_SERVER)
            warm_spawn(program, self_path);
    }
    /* `rdma-cni install` copies this file, not the cached program. */
    setenv("RDMA_CNI_LAUNCHER", self_path, 1);
    execv(program, argv);
    die("cannot execute the unpacked program", errno);
    return 1;
}
