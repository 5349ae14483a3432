"""The allocation record (which VF belongs to which attachment), the node-wide lock and each attachment's.

One JSON file per (CNI_CONTAINERID, CNI_IFNAME) under ``<stateDir>/attachments``,
named ``<containerID>@<ifname>.json`` (container IDs cannot contain '@', so
the name is unambiguous). Files are 0600 and replaced atomically: write a
temporary file, fsync, rename, fsync the directory. A VF is reserved exactly
while some record lists its PCI address, so the record is written *before*
the first kernel change of an ADD (state ``adding``) and removed only after
DEL has undone everything. Every record is read strictly. A file that cannot
be parsed is set aside into ``<stateDir>/quarantine/`` (kept for the
operator, logged) by the verbs that hold the node lock, so one bad file does
not stop the node; its VFs are then judged from the kernel's view (a VF that
is not proven home in the host is not free, see :mod:`rdma_cni.kernel.identity`),
so setting it aside never hands its VFs to another pod.

The state directory and the lock file are trusted only when the plugin owns
them and no one else can write them (:mod:`rdma_cni.node.statedir`): a
:class:`RecordStore` checks ``stateDir`` when it is made, :func:`node_lock`
the lock file before it waits for it.

Two locks, on the same lock file (docs/protocol.md, "the node lock"):

- :func:`node_lock`, an ``flock`` of the whole file: what decides which VFs
  are free and gives them to an attachment (reading the records and the
  node, placing, writing the intent record), and every removal of a record;
- :func:`attachment_lock`, an open-file-description write lock on one byte of
  the file, at an offset derived from the attachment's container id and
  interface: held by ADD and DEL of that attachment for their whole run (the
  namespace moves and IPAM included, which run outside the node lock once the
  intent record names the VFs), and taken without waiting by GC and the
  release of an earlier boot before they release it (one held is left for
  later). Always taken before the node lock, never after: no two verbs wait
  for each other's. Independent of ``flock``: an ``flock`` never conflicts
  with a byte-range lock on Linux.

A writer killed between creating its temporary file and renaming it leaves
``.tmp-<pid>-...`` behind; :func:`remove_orphaned_temporaries` (run by GC)
removes them once the writer is gone or the file is old.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import logging
import os
import signal
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Generic, TypeVar

from rdma_cni.cni.errors import IOFailure, TryAgainLater
from rdma_cni.node import boot, statedir
from rdma_cni.shared import atomicfile

log = logging.getLogger("rdma_cni.record")

SCHEMA = 3
# A version reads the next version's records too, so a rollback releases what the newer version
# allocated: the next schema (SCHEMA + 1) may only add keys, each one a reader of this schema may
# ignore when it releases the attachment (DEL, GC) and, when absent, defaulted by the newer reader.
# A change an older reader must not ignore skips a number, making its records unreadable here.
# Records are only ever rewritten by the ADD that created them, so no reader drops a key it ignored.
NEXT_SCHEMA = SCHEMA + 1
# The versions before wrote schemas 1 and 2: read strictly, the keys added since taking their
# defaults. (Schema 2 added boot_id, ipam_conf and cni_path; schema 3 netns_id; each one its
# readers before ignore as the rule says.)
PREVIOUS_SCHEMA = SCHEMA - 1
OLDEST_SCHEMA = 1
# What a record's ipam_conf may hold: the operator's network configuration, never what a pod or
# the runtime added for one call (cni-args, runtimeConfig, a chained prevResult).
_NOT_IPAM_CONF = ("args", "runtimeConfig", "prevResult")
_SUFFIX = ".json"
T = TypeVar("T")


@dataclass
class VfRecord:
    """One VF of an attachment and everything needed to give it back."""

    pf: str
    vf: int
    pci: str
    host_name: str  # the netdev's name in the host before ADD
    host_mac: str
    host_mtu: int
    pod_name: str  # its name inside the pod
    min_tx_rate: int = 0
    max_tx_rate: int = 0
    # PF-side settings ADD changes, with the values they had before (to restore on DEL).
    pf_original: dict[str, Any] = field(default_factory=dict)
    pf_applied: dict[str, Any] = field(default_factory=dict)
    mac: str = ""  # MAC set inside the pod, if ADD changed it
    mtu: int | None = None  # MTU set inside the pod, if ADD changed it
    ipam: dict[str, Any] | None = None  # the IPAM result for this interface
    rdma_device: str = ""  # the VF's RDMA device, if it has one
    rdma_action: str = ""  # "moved" into the pod, "shared" (left in host), or "" (none/off)
    # Its ifindex inside the pod, as the kernel reported it after the move
    # (0: not known yet, or a record written before this field existed).
    # Where to ask first; identity still decides (rdma_cni.kernel.identity).
    pod_index: int = 0


@dataclass
class PodInfo:
    namespace: str
    name: str
    uid: str = ""


@dataclass
class Attachment:
    """The record of one (container ID, ifname) attachment."""

    container_id: str
    ifname: str
    network: str
    netns: str
    cni_version: str
    state: str = "adding"  # "adding" until ADD finished, then "ready"
    pod: PodInfo | None = None
    created_at: float = 0.0
    vfs: list[VfRecord] = field(default_factory=list)
    result: dict[str, Any] | None = None
    schema: int = SCHEMA
    # The kernel's boot id when ADD wrote it ("" in schema 1 records): a record of another boot
    # holds nothing (rdma_cni.node.boot), and is released by the first verb of the next one.
    boot_id: str = ""
    # What IPAM DEL needs when no verb of this network hands its configuration over (a previous
    # boot's record released at the agent's start): the network configuration less what a pod or
    # the runtime added for one call (see ipam_release_conf), and CNI_PATH. None/[]: no IPAM, or
    # a schema 1 record.
    ipam_conf: dict[str, Any] | None = None
    cni_path: list[str] = field(default_factory=list)
    # The pod's network namespace by kernel identity, as ADD opened it: [st_dev, st_ino] of its
    # nsfs file ([] in records before schema 3). What tells, in this boot, whether the namespace
    # the record names still exists (rdma_cni.node.orphans); the path alone may outlive it.
    netns_id: list[int] = field(default_factory=list)

    @property
    def key(self) -> tuple[str, str]:
        return (self.container_id, self.ifname)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)


@functools.cache
def _field_names(cls: type) -> frozenset[str]:
    # dataclasses.fields() walks the class on every call: a third of parsing the records under
    # the node lock, for an answer that never changes.
    return frozenset(f.name for f in fields(cls))


def _build(cls: type, data: Any, where: str, *, newer: bool = False) -> Any:
    """Construct a record dataclass from JSON, strictly (unknown or missing keys are errors).

    ``newer``: the record is of the next schema, whose added keys are left out (see NEXT_SCHEMA).
    """
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected an object")
    names = _field_names(cls)
    unknown = set(data) - names
    if unknown and not newer:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    return cls(**{k: v for k, v in data.items() if k in names})


def parse_attachment(text: str) -> Attachment:
    """Parse a record file's content; ValueError/TypeError on anything malformed.

    Records of this schema are read strictly; those of the next one (a newer
    version's, read after a rollback) without the keys it added.
    """
    data = json.loads(text)
    # The first schema-1 writers wrote no schema key.
    schema = data.get("schema", OLDEST_SCHEMA) if isinstance(data, dict) else None
    if type(schema) is not int or not OLDEST_SCHEMA <= schema <= NEXT_SCHEMA:
        raise ValueError(
            f"record schema {schema!r} is not {SCHEMA} (or {OLDEST_SCHEMA} to {PREVIOUS_SCHEMA} and "
            f"{NEXT_SCHEMA}, read back)"
        )
    later = set(data) & {key for added, keys in _ADDED_IN_SCHEMA.items() if added > schema for key in keys}
    if later:
        raise ValueError(f"unknown keys {sorted(later)} in a schema {schema} record")
    newer = schema == NEXT_SCHEMA
    att = _build(Attachment, data, "attachment", newer=newer)
    if att.state not in ("adding", "ready"):
        raise ValueError(f"unknown state {att.state!r}")
    att.pod = _build(PodInfo, att.pod, "pod", newer=newer) if att.pod is not None else None
    att.vfs = [_build(VfRecord, v, f"vfs[{i}]", newer=newer) for i, v in enumerate(att.vfs)]
    for v in att.vfs:
        if not isinstance(v.pci, str) or not isinstance(v.vf, int) or not isinstance(v.pf, str):
            raise TypeError("vf entries need pf (str), vf (int) and pci (str)")
        if type(v.pod_index) is not int or not 0 <= v.pod_index < 1 << 31:
            raise TypeError(f"vf {v.pci}: pod_index must be an ifindex (an integer from 0 to 2^31-1)")
    if att.boot_id and not boot.is_boot_id(att.boot_id):
        raise ValueError("boot_id must be a boot id (a lower-case UUID) or empty")
    if att.ipam_conf is not None and not isinstance(att.ipam_conf, dict):
        raise TypeError("ipam_conf must be an object or null")
    if not isinstance(att.cni_path, list) or not all(isinstance(p, str) for p in att.cni_path):
        raise TypeError("cni_path must be a list of directories")
    if not isinstance(att.created_at, int | float) or isinstance(att.created_at, bool):
        raise TypeError("created_at must be a number")
    if not isinstance(att.netns_id, list) or (
        att.netns_id and (len(att.netns_id) != 2 or not all(type(n) is int and n >= 0 for n in att.netns_id))
    ):
        raise TypeError("netns_id must be [] or [st_dev, st_ino] (two non-negative integers)")
    att.schema = schema
    return att


# The keys each schema added: a record of an earlier schema holding one is corrupt.
_ADDED_IN_SCHEMA = {
    2: frozenset({"boot_id", "ipam_conf", "cni_path"}),
    3: frozenset({"netns_id"}),
}


def ipam_release_conf(doc: dict[str, Any]) -> dict[str, Any]:
    """What of a network configuration a record keeps for IPAM DEL (see ``Attachment.ipam_conf``)."""
    return {k: v for k, v in doc.items() if k not in _NOT_IPAM_CONF}


class RecordStore:
    """The attachments directory under ``stateDir``."""

    def __init__(self, state_dir: str) -> None:
        """Code 5 at once for a ``state_dir`` another user owns or can write (see :mod:`.statedir`).

        Every verb and the agent open the state through here, first: one
        check per verb, before anything is read or changed.
        """
        statedir.check_state_dir(state_dir)
        self.dir = os.path.join(state_dir, "attachments")

    def ensure(self) -> None:
        """Create the directory (0700, and stateDir 0700) if needed; code 5 if impossible.

        A directory made now holds nothing an earlier boot wrote: this boot is noted as checked
        (:mod:`rdma_cni.node.boot`), so the next verb makes no pass over it under the lock.
        """
        if os.path.isdir(self.dir):
            return
        try:
            statedir.make_dirs(os.path.dirname(self.dir))
            statedir.make_dirs(self.dir)
        except OSError as exc:
            raise IOFailure(f"cannot create state directory {self.dir}: {exc.strerror}") from exc
        boot.mark_checked(os.path.dirname(self.dir), boot.current(time.time()))

    def path(self, container_id: str, ifname: str) -> str:
        # Both parts were validated by the protocol layer; this is the only
        # place a record path is formed.
        return os.path.join(self.dir, f"{container_id}@{ifname}{_SUFFIX}")

    def _read(self, path: str) -> Attachment:
        return self._parse(path, self._read_bytes(path))

    @staticmethod
    def _read_bytes(path: str) -> bytes:
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as exc:
            raise IOFailure(f"cannot read allocation record {path}: {exc.strerror}") from exc

    @staticmethod
    def _parse(path: str, data: bytes) -> Attachment:
        try:
            return parse_attachment(data.decode("utf-8"))
        except (ValueError, TypeError) as exc:  # UnicodeDecodeError is a ValueError
            raise IOFailure(
                f"allocation record {path} is corrupt: fix or remove it by hand after checking which "
                "VFs it holds",
                str(exc),
            ) from exc

    def get(self, container_id: str, ifname: str, *, set_aside: bool = False) -> Attachment | None:
        """The record of one attachment, or None.

        A corrupt record raises (code 5), or with ``set_aside`` (node lock
        held) is quarantined and reads as None.
        """
        path = self.path(container_id, ifname)
        if not os.path.exists(path):
            return None
        try:
            return self._read(path)
        except IOFailure as exc:
            if not set_aside:
                raise
            self._set_aside(path, exc)
            return None

    def _set_aside(self, path: str, exc: IOFailure) -> str:
        target = self.quarantine(path)
        log.error(
            "allocation record %s is corrupt (%s); set aside as %s. Its VFs count as held until the "
            "kernel shows them home in the host",
            path,
            exc.details or exc.msg,
            target,
        )
        return target

    def all(self, errors: list[str] | None = None, *, set_aside: bool = False) -> list[Attachment]:
        """Every record.

        A corrupt one raises (code 5); with ``errors`` it is reported there
        instead; with ``set_aside`` (node lock held) it is also quarantined.
        """
        out = []
        for name, _cid, _ifname in attachment_files(self.dir, "state directory"):
            path = os.path.join(self.dir, name)
            try:
                out.append(self._read(path))
            except IOFailure as exc:
                if set_aside:
                    target = self._set_aside(path, exc)
                    if errors is not None:
                        errors.append(f"{exc.msg}; set aside as {target}")
                    continue
                if errors is None:
                    raise
                errors.append(exc.msg)
        return out

    def derived(self, memo: ParsedRecords[T], *, set_aside: bool = False) -> list[T]:
        """What ``memo`` derives from each record, as :meth:`all` reads them (corrupt ones raise, or are
        set aside with ``set_aside``): every file is read, and only content ``memo`` has not seen parsed.
        """
        out = []
        seen: dict[bytes, T] = {}
        known = memo.known(self.dir)
        for name, _cid, _ifname in attachment_files(self.dir, "state directory"):
            path = os.path.join(self.dir, name)
            try:
                data = self._read_bytes(path)
                value = seen.get(data, known.get(data))
                if value is None:
                    value = memo.derive(self._parse(path, data))
                    memo.parsed += 1
            except IOFailure as exc:  # unreadable or corrupt, as all() treats them
                if not set_aside:
                    raise
                self._set_aside(path, exc)
                continue
            seen[data] = value
            out.append(value)
        memo.keep(self.dir, seen)
        return out

    def quarantined(self) -> list[str]:
        """Names of the records set aside so far."""
        try:
            return sorted(os.listdir(os.path.join(os.path.dirname(self.dir), QUARANTINE)))
        except OSError:
            return []

    def write(
        self, att: Attachment, *, new_name: bool = True, sync_dir: bool | None = None, flush: bool = True
    ) -> None:
        """Atomically replace the record of ``att`` (0600, fsynced).

        ``new_name=False`` says a record of this attachment is already on disk
        (ADD marking it ready): the directory is then not fsynced, since after a
        crash either version is a record DEL can finish from (one directory
        fsync less per pod, milliseconds on a busy disk). ``sync_dir=False``
        leaves a new name's directory fsync to the caller (:meth:`sync_dir`):
        ADD's intent record, whose fsync need not keep the node lock. ``flush=False`` leaves
        both fsyncs, the file's and its directory's, to the caller (:meth:`flush`): ADD's intent
        record again, which other verbs read from the page cache at once, and which only a crash
        of the machine before the flush could lose (or leave empty, then set aside as corrupt):
        a choice nothing had acted on, since ADD flushes it before its first change.
        """
        self.ensure()
        write_atomic(
            self.dir,
            f"{att.container_id}@{att.ifname}{_SUFFIX}",
            att.to_json(),
            "allocation record",
            sync_dir=flush and (new_name if sync_dir is None else sync_dir),
            fsync=flush,
        )

    def flush(self, container_id: str, ifname: str) -> None:
        """Make a record written with ``flush=False`` durable, its name included; code 5 if it cannot be."""
        path = self.path(container_id, ifname)
        try:
            _fsync_file(path)
        except OSError as exc:
            raise IOFailure(f"cannot flush allocation record {path}: {exc.strerror}") from exc
        self.sync_dir()

    def sync_dir(self) -> None:
        """Make the names written without a directory fsync durable; code 5 if the fsync fails."""
        try:
            self._sync_dir()
        except OSError as exc:
            raise IOFailure(f"cannot flush state directory {self.dir}: {exc.strerror}") from exc

    def delete(self, container_id: str, ifname: str) -> None:
        """Remove a record (missing is fine)."""
        path = self.path(container_id, ifname)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise IOFailure(f"cannot remove allocation record {path}: {exc.strerror}") from exc
        self._sync_dir()

    def _sync_dir(self) -> None:
        _sync_dir(self.dir)

    def quarantine(self, path: str) -> str:
        """Move a corrupt record into ``<stateDir>/quarantine/`` (kept for the operator); its new path."""
        return quarantine(path, os.path.join(os.path.dirname(self.dir), QUARANTINE))


class ParsedRecords(Generic[T]):
    """What :meth:`RecordStore.derived` derives from each record, kept by the record file's exact bytes.

    A verb worker serves many verbs (:mod:`rdma_cni.agent.verbworker`), and under the node lock
    ADD read and parsed every record of the node each time, a cost growing with the pods. Every
    file is still read each time (cheap); only content not seen before is parsed. The key is the
    whole content, so what is kept can never be stale: a record changed in any byte is a new key.
    ``derive`` should make something immutable (the value is shared by every later read of the
    same bytes). Only the values of the last read of each directory are kept: bounded by the
    records on disk.
    """

    def __init__(self, derive: Callable[[Attachment], T]) -> None:
        self.derive = derive
        self._by_dir: dict[str, dict[bytes, T]] = {}
        self.parsed = 0  # how many records were parsed (for tests and profiles)

    def known(self, directory: str) -> dict[bytes, T]:
        return self._by_dir.get(directory, {})

    def keep(self, directory: str, values: dict[bytes, T]) -> None:
        self._by_dir[directory] = values


QUARANTINE = "quarantine"
TMP_PREFIX = atomicfile.TMP_PREFIX
ORPHAN_AGE_SECONDS = 60


def _sync_dir(directory: str) -> None:
    atomicfile.fsync_dir(directory)


def _fsync_file(path: str) -> None:
    atomicfile.fsync_file(path)


def attachment_files(directory: str, what: str) -> list[tuple[str, str, str]]:
    """``(file name, container ID, ifname)`` of each ``<containerID>@<ifname>.json`` in ``directory``.

    Sorted; temporary files (their names start with a dot) are left out; a
    missing directory has none; one that cannot be listed is code 5 naming
    ``what`` it is.
    """
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise IOFailure(f"cannot list {what} {directory}: {exc.strerror}") from exc
    out = []
    for name in names:
        if name.endswith(_SUFFIX) and "@" in name and not name.startswith("."):
            cid, _, ifname = name[: -len(_SUFFIX)].partition("@")
            out.append((name, cid, ifname))
    return out


def write_atomic(
    directory: str, name: str, text: str, what: str, *, sync_dir: bool = True, fsync: bool = True
) -> None:
    """Replace ``directory/name`` with ``text``, 0600 (:mod:`rdma_cni.shared.atomicfile`); code 5 on failure.

    The temporary file is ``.tmp-<pid>-<name>``, so an orphan names its writer.
    ``sync_dir=False`` skips the directory fsync, for a file whose old version
    is as good as the new one after a crash; ``fsync=False`` skips the file's own fsync too (the
    caller flushes it later).
    """
    path = os.path.join(directory, name)
    try:
        atomicfile.write_atomic(path, text, sync_dir=False, fsync=fsync)
        if sync_dir:
            _sync_dir(directory)
    except OSError as exc:
        raise IOFailure(f"cannot write {what} {path}: {exc.strerror}") from exc


def quarantine(path: str, directory: str) -> str:
    """Move ``path`` into ``directory`` under a new, unique name; returns it."""
    try:
        statedir.make_dirs(directory)
        target = os.path.join(directory, f"{os.path.basename(path)}.{time.time_ns()}")
        atomicfile.move(path, target)
    except OSError as exc:
        raise IOFailure(f"cannot set corrupt record {path} aside into {directory}: {exc.strerror}") from exc
    return target


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_orphaned_temporaries(directory: str, now: float | None = None) -> list[str]:
    """Remove ``.tmp-<pid>-*`` files whose writer is gone or that are older than a minute.

    Call it under the node lock: every writer holds it, so a temporary file
    found then belongs to no write in progress; the pid and age tests keep a
    file safe should a writer ever run without the lock.
    """
    now = time.time() if now is None else now
    removed = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise IOFailure(f"cannot list {directory}: {exc.strerror}") from exc
    for name in names:
        if not name.startswith(TMP_PREFIX):
            continue
        path = os.path.join(directory, name)
        pid_text = name[len(TMP_PREFIX) :].split("-", 1)[0]
        try:
            age = now - os.lstat(path).st_mtime
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise IOFailure(f"cannot inspect {path}: {exc.strerror}") from exc
        writer_gone = not pid_text.isdigit() or not _pid_alive(int(pid_text))
        if writer_gone or age > ORPHAN_AGE_SECONDS:
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise IOFailure(f"cannot remove orphaned temporary file {path}: {exc.strerror}") from exc
            log.info(
                "removed orphaned temporary file %s (%s)", path, "writer gone" if writer_gone else "stale"
            )
            removed.append(path)
    return removed


class _LockWaitOver(Exception):
    pass


def _flock(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_EX)


def _flock_now(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _wait_for_lock(
    fd: int, timeout: float, lock: Callable[[int], None], lock_now: Callable[[int], None]
) -> bool:
    """Block in ``lock`` (flock(2), or a byte-range lock) until it is ours or ``timeout`` seconds pass;
    False on timeout. ``lock_now`` is the same lock taken without waiting (BlockingIOError if held).

    A blocking flock lets the kernel hand the lock over the moment it is
    released. Polling (what filelock does, every 50 ms) left the node idle
    between verbs: 64 pods at once spent seconds in those gaps. The wait is
    bounded with a one-shot timer signal, or by short polls off the main
    thread, where signals cannot be had.
    """
    if threading.current_thread() is not threading.main_thread():
        deadline = time.monotonic() + timeout
        while True:
            try:
                lock_now(fd)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.005)

    def expire(_signo: int, _frame: object) -> None:
        raise _LockWaitOver

    previous = signal.signal(signal.SIGALRM, expire)
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            lock(fd)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        return True
    except _LockWaitOver:
        return False
    finally:
        signal.signal(signal.SIGALRM, previous)


# Descriptors of the locks (node, attachment) this process holds now (innermost last): an
# IPAM guard that is exec'd rather than forked is handed the lock explicitly.
_held: list[int] = []


def held_lock() -> int | None:
    """The descriptor of the innermost lock this process holds (node or attachment), if it holds one.

    What an IPAM guard keeps holding while IPAM runs: the attachment's lock in ADD and DEL
    (IPAM runs outside the node lock), so that the DEL of a killed ADD waits for its IPAM.
    """
    return _held[-1] if _held else None


def _open_lock_file(lock_file: str) -> int:
    """``lock_file`` opened for locking, after the checks of :mod:`rdma_cni.node.statedir` (code 5 if not)."""
    statedir.check_lock_path(lock_file)
    try:
        statedir.make_dirs(os.path.dirname(lock_file), mode=0o755)
    except OSError as exc:
        raise IOFailure(f"cannot create the directory of lockFile {lock_file}: {exc.strerror}") from exc
    try:
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise IOFailure(f"lockFile {lock_file} is a symbolic link; give its real path") from exc
        raise IOFailure(f"cannot open lockFile {lock_file}: {exc.strerror}") from exc
    try:
        statedir.check_owned(lock_file, os.fstat(fd), "lockFile", want_dir=False)
    except BaseException:
        os.close(fd)
        raise
    return fd


# The nice value of a node lock holder. In a burst every other ADD queues on this lock while the
# verbs that passed it (namespace moves, IPAM) take the cores: a holder sharing them ran three to
# five times longer than alone, and the queue drained at that pace (a lock convoy). Ahead of them,
# it leaves the lock sooner and they lose nothing they were not waiting for anyway.
HOLDER_NICE = -10


@contextlib.contextmanager
def _ahead() -> Iterator[None]:
    """Run this thread at :data:`HOLDER_NICE` (if it is not already higher) for the block.

    Without CAP_SYS_NICE (an unprivileged run) the nice value stays as it was: the lock works
    the same, a burst only drains more slowly.
    """
    try:
        before = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, 0, min(before, HOLDER_NICE))
    except OSError:
        before = None
    try:
        yield
    finally:
        if before is not None:
            with contextlib.suppress(OSError):  # raising one's own nice value is always allowed
                os.setpriority(os.PRIO_PROCESS, 0, before)


@contextlib.contextmanager
def node_lock(lock_file: str, timeout: float) -> Iterator[None]:
    """Hold the node-wide lock (flock on ``lock_file``); code 11 after ``timeout`` seconds, code 5 at once
    for a lockFile that can never be locked (on procfs, sysfs or another pseudo file system, a directory,
    a FIFO) or that another user owns or can write, or a symbolic link (see :mod:`rdma_cni.node.statedir`).

    The lock lives on this process's open file description, so an IPAM guard
    forked while it is held keeps holding it after this process is killed
    (see rdma_cni.node.ipam). Leaving the block closes our descriptor (it never
    unlocks explicitly, which would free the guard's share too): the lock is
    free as soon as no guard shares it either.

    flock is what earlier versions took through filelock, so versions side by
    side during an upgrade still exclude each other.
    """
    fd = _open_lock_file(lock_file)
    try:
        waited = time.monotonic()
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if timeout <= 0 or not _wait_for_lock(fd, timeout, _flock, _flock_now):
                    raise TryAgainLater(
                        f"node lock {lock_file} is held by another rdma-cni for more than {timeout:g} s; "
                        "try again later"
                    ) from None
        except OSError as exc:
            raise IOFailure(f"cannot lock lockFile {lock_file}: {exc.strerror}") from exc
        acquired = time.monotonic()
        _held.append(fd)
        try:
            with _ahead():
                yield
        finally:
            _held.remove(fd)
            log.info(
                "node lock: waited %.1f ms, held %.1f ms",
                (acquired - waited) * 1000,
                (time.monotonic() - acquired) * 1000,
            )
    finally:
        os.close(fd)


def attachment_offset(container_id: str, ifname: str) -> int:
    """The byte of the lock file that stands for attachment (``container_id``, ``ifname``).

    Two attachments that share one (a CRC-32 collision) only wait for each other.
    """
    return zlib.crc32(f"{container_id}@{ifname}".encode("utf-8", "surrogateescape"))


def _ofd_lock(offset: int, *, wait: bool) -> Callable[[int], None]:
    """A write lock on byte ``offset`` of an open lock file, owned by its open file description.

    Like an ``flock``, it is shared by every descriptor of that open file (an IPAM guard's copy
    included) and free once the last is closed; unlike one, it covers a byte, not the file.
    """
    request = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0)
    command = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK

    def lock(fd: int) -> None:
        try:
            fcntl.fcntl(fd, command, request)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise BlockingIOError(exc.errno, exc.strerror) from None
            raise

    return lock


@contextlib.contextmanager
def attachment_lock(lock_file: str, container_id: str, ifname: str, timeout: float) -> Iterator[None]:
    """Hold the lock of one attachment (see the module's text); code 11 after ``timeout`` seconds.

    Taken before the node lock, never while holding it: an ADD or DEL of the attachment, or
    the IPAM guard of one that was killed, may hold it for as long as an IPAM call takes.
    """
    fd = _open_lock_file(lock_file)
    offset = attachment_offset(container_id, ifname)
    try:
        try:
            try:
                _ofd_lock(offset, wait=False)(fd)
            except BlockingIOError:
                if timeout <= 0 or not _wait_for_lock(
                    fd, timeout, _ofd_lock(offset, wait=True), _ofd_lock(offset, wait=False)
                ):
                    raise TryAgainLater(
                        f"another rdma-cni has been changing {container_id}/{ifname} for more than "
                        f"{timeout:g} s (its ADD or DEL, or the IPAM call of one that was killed); "
                        "try again later"
                    ) from None
        except OSError as exc:
            raise IOFailure(f"cannot lock lockFile {lock_file}: {exc.strerror}") from exc
        _held.append(fd)
        try:
            yield
        finally:
            _held.remove(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def attachment_lock_if_free(lock_file: str, container_id: str, ifname: str) -> Iterator[bool]:
    """The attachment's lock if no one holds it now (True inside), else False at once: for GC and the
    release of an earlier boot, which hold the node lock and must not wait for an attachment's."""
    fd = _open_lock_file(lock_file)
    try:
        try:
            _ofd_lock(attachment_offset(container_id, ifname), wait=False)(fd)
        except BlockingIOError:
            yield False
            return
        except OSError as exc:
            raise IOFailure(f"cannot lock lockFile {lock_file}: {exc.strerror}") from exc
        _held.append(fd)
        try:
            yield True
        finally:
            _held.remove(fd)
    finally:
        os.close(fd)
