"""The allocation record (which VF belongs to which attachment) and the node-wide lock.

One JSON file per (CNI_CONTAINERID, CNI_IFNAME) under ``<stateDir>/attachments``,
named ``<containerID>@<ifname>.json`` (container IDs cannot contain '@', so
the name is unambiguous). Files are 0600 and replaced atomically: write a
temporary file, fsync, rename, fsync the directory. A VF is reserved exactly
while some record lists its PCI address, so the record is written *before*
the first kernel change of an ADD (state ``adding``) and removed only after
DEL has undone everything. Every record is read strictly: a file that cannot
be parsed is an error naming it (code 5), never skipped, because skipping it
would hand its VFs to another pod.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from rdma_cni.errors import IOFailure, TryAgainLater

log = logging.getLogger("rdma_cni.record")

SCHEMA = 1
_SUFFIX = ".json"


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

    @property
    def key(self) -> tuple[str, str]:
        return (self.container_id, self.ifname)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)


def _build(cls: type, data: Any, where: str) -> Any:
    """Construct a record dataclass from JSON, strictly (unknown or missing keys are errors)."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected an object")
    names = {f.name for f in fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    return cls(**data)


def parse_attachment(text: str) -> Attachment:
    """Parse a record file's content; ValueError/TypeError on anything malformed."""
    data = json.loads(text)
    att = _build(Attachment, data, "attachment")
    if att.schema != SCHEMA:
        raise ValueError(f"record schema {att.schema} is not {SCHEMA}")
    if att.state not in ("adding", "ready"):
        raise ValueError(f"unknown state {att.state!r}")
    att.pod = _build(PodInfo, att.pod, "pod") if att.pod is not None else None
    att.vfs = [_build(VfRecord, v, f"vfs[{i}]") for i, v in enumerate(att.vfs)]
    for v in att.vfs:
        if not isinstance(v.pci, str) or not isinstance(v.vf, int) or not isinstance(v.pf, str):
            raise TypeError("vf entries need pf (str), vf (int) and pci (str)")
    return att


class RecordStore:
    """The attachments directory under ``stateDir``."""

    def __init__(self, state_dir: str) -> None:
        self.dir = os.path.join(state_dir, "attachments")

    def ensure(self) -> None:
        """Create the directory (0700) if needed; code 5 if impossible."""
        try:
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise IOFailure(f"cannot create state directory {self.dir}: {exc.strerror}") from exc

    def path(self, container_id: str, ifname: str) -> str:
        # Both parts were validated by the protocol layer; this is the only
        # place a record path is formed.
        return os.path.join(self.dir, f"{container_id}@{ifname}{_SUFFIX}")

    def _read(self, path: str) -> Attachment:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise IOFailure(f"cannot read allocation record {path}: {exc.strerror}") from exc
        try:
            return parse_attachment(text)
        except (ValueError, TypeError) as exc:
            raise IOFailure(
                f"allocation record {path} is corrupt: fix or remove it by hand after checking which "
                "VFs it holds",
                str(exc),
            ) from exc

    def get(self, container_id: str, ifname: str) -> Attachment | None:
        """The record of one attachment, or None."""
        path = self.path(container_id, ifname)
        if not os.path.exists(path):
            return None
        return self._read(path)

    def all(self, errors: list[str] | None = None) -> list[Attachment]:
        """Every record. A corrupt one raises (code 5), or, when ``errors`` is given, is reported there."""
        try:
            names = sorted(os.listdir(self.dir))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise IOFailure(f"cannot list state directory {self.dir}: {exc.strerror}") from exc
        out = []
        for name in names:
            if not name.endswith(_SUFFIX) or "@" not in name:
                continue
            try:
                out.append(self._read(os.path.join(self.dir, name)))
            except IOFailure as exc:
                if errors is None:
                    raise
                errors.append(exc.msg)
        return out

    def write(self, att: Attachment) -> None:
        """Atomically replace the record of ``att`` (0600, fsynced)."""
        self.ensure()
        path = self.path(att.container_id, att.ifname)
        tmp = os.path.join(self.dir, f".tmp-{os.getpid()}-{att.container_id}@{att.ifname}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, att.to_json().encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, path)
            self._sync_dir()
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise IOFailure(f"cannot write allocation record {path}: {exc.strerror}") from exc

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
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def node_lock(lock_file: str, timeout: float) -> Iterator[None]:
    """Hold the node-wide lock (flock on ``lock_file``); code 11 after ``timeout`` seconds, code 5 at once
    for a lockFile that can never be locked (under /proc, a directory, a FIFO).

    The lock lives on this process's open file description, so an IPAM guard
    forked while it is held keeps holding it after this process is killed
    (see rdma_cni.ipam). Leaving the block closes our descriptor: the lock is
    free as soon as no guard shares it either.
    """
    import fcntl

    try:
        os.makedirs(os.path.dirname(lock_file), mode=0o755, exist_ok=True)
    except OSError as exc:
        raise IOFailure(f"cannot create the directory of lockFile {lock_file}: {exc.strerror}") from exc
    try:
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise IOFailure(f"cannot open lockFile {lock_file}: {exc.strerror}") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise IOFailure(f"lockFile {lock_file} is not a regular file")
        waited = time.monotonic()
        pause = 0.002
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                left = waited + timeout - time.monotonic()
                if left <= 0:
                    raise TryAgainLater(
                        f"node lock {lock_file} is held by another rdma-cni for more than {timeout:g} s; "
                        "try again later"
                    ) from None
                time.sleep(min(pause, left))
                pause = min(pause * 2, 0.05)
            except OSError as exc:
                raise IOFailure(f"cannot lock lockFile {lock_file}: {exc.strerror}") from exc
        acquired = time.monotonic()
        try:
            yield
        finally:
            log.info(
                "node lock: waited %.1f ms, held %.1f ms",
                (acquired - waited) * 1000,
                (time.monotonic() - acquired) * 1000,
            )
    finally:
        os.close(fd)
