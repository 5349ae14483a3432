"""Pruning the launcher's cache: unpacked trees of versions nobody runs any more.

The launcher (launcher/launcher.c) unpacks each version's tree (~41 MB) into
``<cache>/<id>``, ``<id>`` the payload's 16-hex content hash, marked complete
by ``.complete``, and never removes one. An old tree may still be in use after
an upgrade: a cold verb of the old binary runs from it, its warm server holds
``warm.lock`` in it until it notices the new binary, and a launcher that has
just checked ``.complete`` is about to exec it. So a tree is removed only when
all of these hold:

- it is not the caller's own tree;
- its program has not been started for ``min_idle`` seconds (its atime, which
  exec updates under relatime at least daily; with noatime, the time it was
  unpacked), which covers the launcher about to exec it;
- no process runs its program (no ``/proc/<pid>/exe`` is that file);
- no warm server holds its ``warm.lock`` (taken here, held to the end).

It is first renamed out of the way (a launcher then finds no tree and unpacks
afresh, as on a first start), then deleted. Standard library only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import shutil
import time

TREE_ID_LEN = 16  # launcher/launcher.c: ID_LEN
COMPLETE = ".complete"  # launcher/launcher.c: COMPLETE
PROGRAM = "rdma-cni"  # launcher/launcher.c: PROGRAM
WARM_LOCK = "warm.lock"  # rdma_cni.launch.warm.LOCK_NAME
PRUNING_PREFIX = ".prune-"
# A week: an upgrade rolled back within days finds its tree still unpacked.
DEFAULT_MIN_IDLE = 7 * 86400.0


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What happened to one tree: ``removed`` or kept, and why."""

    tree: str
    removed: bool
    why: str


def is_tree_name(name: str) -> bool:
    """A launcher tree's name: the payload id, 16 lowercase hex digits."""
    return len(name) == TREE_ID_LEN and all(c in "0123456789abcdef" for c in name)


def processes_in(tree: str, proc: str = "/proc") -> list[int]:
    """Pids running the tree's program, by the file's identity (device, inode), not its path.

    A path would not do: a process in another mount namespace (the host's, seen
    from a pod that mounts the host's root elsewhere) names the same file
    differently.
    """
    try:
        program = os.stat(os.path.join(tree, PROGRAM))
    except OSError:
        return []
    target = (program.st_dev, program.st_ino)
    pids = []
    for entry in os.listdir(proc) if os.path.isdir(proc) else ():
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):  # gone, or a kernel thread with no exe
            exe = os.stat(os.path.join(proc, entry, "exe"))
            if (exe.st_dev, exe.st_ino) == target:
                pids.append(int(entry))
    return pids


def last_started(tree: str) -> float | None:
    """When the tree's program last started, as far as the file system says; None without a program."""
    try:
        st = os.stat(os.path.join(tree, PROGRAM))
    except OSError:
        return None
    return max(st.st_atime, st.st_mtime)


def _remove(base: str, name: str) -> None:
    aside = os.path.join(base, f"{PRUNING_PREFIX}{name}-{os.getpid()}")
    # Not shared/atomicfile: a whole tree moved out of the launchers' way (they then unpack afresh),
    # then deleted; no fsync wanted: after a crash the tree is either still usable or an aside
    # that the next prune deletes.
    os.rename(os.path.join(base, name), aside)
    shutil.rmtree(aside, ignore_errors=True)


def prune_tree(base: str, name: str, *, now: float, min_idle: float, proc: str = "/proc") -> Outcome:
    """Remove ``<base>/<name>`` if nothing may still use it (the module's rule)."""
    tree = os.path.join(base, name)
    started = last_started(tree)
    if started is not None and now - started < min_idle:
        return Outcome(name, False, f"started {int(now - started)} s ago (kept for {int(min_idle)} s)")
    pids = processes_in(tree, proc)
    if pids:
        return Outcome(name, False, f"process {pids[0]} runs from it")
    lock_path = os.path.join(tree, WARM_LOCK)
    lock = None
    try:
        with contextlib.suppress(FileNotFoundError):
            lock = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        if lock is not None:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return Outcome(name, False, "a warm server holds it")
        _remove(base, name)
    finally:
        if lock is not None:
            os.close(lock)
    return Outcome(name, True, "not started since" if started is not None else "no program in it")


def prune(
    base: str,
    current: str | None,
    *,
    now: float | None = None,
    min_idle: float = DEFAULT_MIN_IDLE,
    proc: str = "/proc",
) -> list[Outcome]:
    """Prune every tree under ``base`` but ``current``; also what an interrupted prune left.

    An unreadable ``base`` prunes nothing. Errors on one tree are that tree's
    outcome, not an exception.
    """
    now = time.time() if now is None else now
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    outcomes = []
    for name in names:
        if name.startswith(PRUNING_PREFIX):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
            continue
        if not is_tree_name(name) or name == current:
            continue
        try:
            outcomes.append(prune_tree(base, name, now=now, min_idle=min_idle, proc=proc))
        except OSError as exc:
            outcomes.append(Outcome(name, False, f"cannot remove: {exc.strerror}"))
    return outcomes
