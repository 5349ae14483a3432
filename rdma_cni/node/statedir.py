"""Who may own the plugin's state directory and lock file: only the plugin (code 5 otherwise).

A ``stateDir`` or ``lockFile`` placed where another user can create things
would let that user plant records, swap ``attachments/`` for a directory of
their own, or hold the node lock for ever. So, as the launcher does for its
cache directory, every verb checks before it reads or writes anything:

- the plugin's own paths (``stateDir``, its ``attachments/``, ``quarantine/``
  and ``ipam-pending/``, and the ``lockFile``) are not symbolic links, are of
  the right type (directory, regular file), are owned by the plugin's
  effective user and are writable by no one else (no group or other write
  bit). A path that does not exist yet is fine: the plugin creates it 0700
  (directories) or 0600 (the lock file), whatever the caller's umask;
- the directory holding ``stateDir`` and the one holding ``lockFile`` (which
  may be a system directory such as ``/run``) are owned by the plugin's user
  or root, and are writable by others only with the sticky bit (``/tmp``):
  there no other user can rename or remove what the plugin put in them, and a
  file they planted first fails the owner check above;
- a ``stateDir`` or ``lockFile`` on a pseudo file system (procfs, sysfs,
  cgroup, debugfs and the like: ``/proc/self/status`` locks a copy per
  process, and nothing written there is kept) is refused, wherever it is
  mounted (``/host/proc`` too): the kernel's own name for the file system
  (``statfs``'s ``f_type``) is checked, not the path's prefix.

Each path costs one ``lstat`` (or ``fstat`` on the opened lock file), and
the file system check one or two ``statfs``. Violations are
:class:`IOFailure` (code 5) naming the path and its owner or file system.
"""

from __future__ import annotations

import errno
import os
import stat

from rdma_cni.cni.errors import IOFailure

# The directories under stateDir the plugin uses.
SUBDIRS = ("attachments", "quarantine", "ipam-pending")

# Pseudo file systems (statfs f_type, from linux/magic.h) where a lock or a record makes no sense:
# their files are made up by the kernel on each open (a lock on one locks nothing shared) and they
# keep nothing written to them.
PSEUDO_FS = {
    0x9FA0: "procfs",
    0x62656572: "sysfs",
    0x27E0EB: "cgroup",
    0x63677270: "cgroup2",
    0x64626720: "debugfs",
    0x74726163: "tracefs",
    0x73636673: "securityfs",
    0x62656570: "configfs",
    0xCAFE4A11: "bpf",
    0xF97CFF8C: "selinuxfs",
    0x6165676C: "pstore",
    0xDE5E81E4: "efivarfs",
    0x42494E4D: "binfmt_misc",
    0x65735543: "fusectl",
    0x6E736673: "nsfs",
}
# struct statfs is 120 bytes on 64-bit Linux (84 on 32-bit); f_type, a C long, comes first.
_STATFS_SIZE = 256


def _owner(uid: int) -> str:
    try:
        import pwd  # here: only a refusal needs the name

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def check_owned(path: str, st: os.stat_result, what: str, want_dir: bool) -> None:
    """Code 5 unless ``st`` (of ``path``, not followed) is ours, of the right type, writable only by us."""
    if stat.S_ISLNK(st.st_mode):
        raise IOFailure(f"{what} {path} is a symbolic link (owner {_owner(st.st_uid)}); give its real path")
    kind_ok = stat.S_ISDIR(st.st_mode) if want_dir else stat.S_ISREG(st.st_mode)
    if not kind_ok:
        raise IOFailure(f"{what} {path} is not a {'directory' if want_dir else 'regular file'}")
    euid = os.geteuid()
    if st.st_uid != euid:
        raise IOFailure(
            f"{what} {path} is owned by {_owner(st.st_uid)}, not by this plugin ({_owner(euid)}); "
            "refusing to trust it"
        )
    if st.st_mode & 0o022:
        raise IOFailure(
            f"{what} {path} (owner {_owner(st.st_uid)}, mode {stat.S_IMODE(st.st_mode):04o}) is writable "
            "by other users; refusing to trust it"
        )


def check_container(path: str, what: str) -> None:
    """Code 5 unless directory ``path`` (if it exists) is ours or root's and others cannot replace entries."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise IOFailure(f"cannot inspect {what} {path}: {exc.strerror}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise IOFailure(f"{what} {path} is not a directory")
    if st.st_uid not in (os.geteuid(), 0):
        raise IOFailure(f"{what} {path} is owned by {_owner(st.st_uid)}, not by this plugin or root")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise IOFailure(
            f"{what} {path} (owner {_owner(st.st_uid)}, mode {stat.S_IMODE(st.st_mode):04o}) is writable "
            "by other users and not sticky; refusing to trust it"
        )


def _lstat(path: str, what: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise IOFailure(f"cannot inspect {what} {path}: {exc.strerror}") from exc


def check_state_dir(state_dir: str) -> None:
    """Check ``stateDir``, the directory holding it and the subdirectories the plugin uses (if they exist)."""
    state_dir = os.path.normpath(state_dir)
    check_state_fs(state_dir)
    check_container(os.path.dirname(state_dir) or "/", "the directory holding stateDir")
    st = _lstat(state_dir, "stateDir")
    if st is None:
        return
    check_owned(state_dir, st, "stateDir", want_dir=True)
    for name in SUBDIRS:
        path = os.path.join(state_dir, name)
        sub = _lstat(path, "state directory")
        if sub is not None:
            check_owned(path, sub, "state directory", want_dir=True)


def fs_type(path: str, what: str) -> int:
    """``statfs``'s ``f_type`` of ``path``, or of its nearest ancestor that exists."""
    import ctypes  # here, not at the top: every verb has it loaded already (kernel/netns)

    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(_STATFS_SIZE)
    while True:
        if libc.statfs(os.fsencode(path), buf) == 0:
            return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF
        err = ctypes.get_errno()
        parent = os.path.dirname(path)
        if err not in (errno.ENOENT, errno.ENOTDIR) or parent == path:
            raise IOFailure(f"cannot inspect the file system of {what} {path}: {os.strerror(err)}")
        path = parent  # not created yet: it will be on its parent's file system


def _pseudo_fs(path: str, what: str) -> str | None:
    """The name of the pseudo file system ``path`` (or the nearest existing ancestor) is on, if any."""
    return PSEUDO_FS.get(fs_type(os.path.realpath(path), what))


def check_state_fs(state_dir: str) -> None:
    """Code 5 if ``stateDir`` (or where it would be created) is on a pseudo file system."""
    name = _pseudo_fs(state_dir, "stateDir")
    if name is not None:
        raise IOFailure(
            f"stateDir {state_dir} is on {name}, where nothing written is kept; use a path under /var/lib"
        )


def check_lock_path(lock_file: str) -> None:
    """Before opening it: ``lockFile`` is not on a pseudo file system and its directory is trustworthy."""
    for path in (lock_file, os.path.dirname(os.path.normpath(lock_file)) or "/"):
        name = _pseudo_fs(path, "lockFile")
        if name is not None:
            raise IOFailure(
                f"lockFile {lock_file} is on {name}, where it cannot be locked; use a path under /run"
            )
    check_container(os.path.dirname(os.path.normpath(lock_file)) or "/", "the directory of lockFile")


def make_dirs(path: str, mode: int = 0o700, parent_mode: int = 0o755) -> None:
    """Create ``path`` (``mode``) and any missing parent (``parent_mode``), exactly, whatever the umask.

    OSError on failure. An existing directory is left as it is (the checks judge it).
    """
    missing = []
    current = os.path.normpath(path)
    while not os.path.lexists(current):
        missing.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    for directory in reversed(missing):
        wanted = mode if directory == missing[0] else parent_mode
        try:
            os.mkdir(directory, wanted)
        except FileExistsError:
            continue  # created by another process meanwhile
        os.chmod(directory, wanted)
