"""Which boot a record belongs to, and whether this boot's records were checked yet.

After a reboot every pod's network namespace is gone and every VF is back in
the host, so no allocation record written before the current boot can still
hold anything. Two ways to tell a record's boot:

- **Exact:** the kernel's boot id (``/proc/sys/kernel/random/boot_id``, a new
  random UUID every boot, the same in every container), which ADD stores in
  the record (``boot_id``). Another boot id means another boot.
- **Fallback**, for records without one (written by the version before this
  field, or when the boot id could not be read): the record's ``created_at``
  against the boot time (``btime`` in ``/proc/stat``). Both are wall-clock
  times, and ``btime`` is computed as "now minus time since boot", so a clock
  stepped forward after a record was written moves ``btime`` past it. So the
  fallback says "previous boot" only for a record created more than
  :data:`CLOCK_SLACK_SECONDS` before the boot time; a record with no
  creation time, or one created "in the future" (the clock went back), is
  kept. When in doubt, a record is kept: a record wrongly kept holds a VF
  until a DEL or GC; a record wrongly released would hand a running pod's VF
  to another pod. (The caller adds one more guard for the fallback: a VF that
  exists and is not proven home in the host keeps its record.)

The state directory remembers the boot whose records were last checked
(``<stateDir>/boot-checked``), so every later verb of that boot costs two small
reads and no lock.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Literal, NamedTuple

from rdma_cni.shared import atomicfile

log = logging.getLogger("rdma_cni.record")

BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
STAT_FILE = "/proc/stat"
MARKER = "boot-checked"
# A forward clock step of up to this much after a record was written never makes it look older
# than the boot (NTP's first step on a node with a sane RTC is seconds; this is ten minutes).
CLOCK_SLACK_SECONDS = 600.0
_BOOT_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def is_boot_id(text: object) -> bool:
    """Whether ``text`` has the kernel's boot id form (a lower-case UUID)."""
    return isinstance(text, str) and _BOOT_ID.fullmatch(text) is not None


def _read_small(path: str, limit: int) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("ascii", errors="replace")
    except OSError:
        return None


def boot_id(path: str = BOOT_ID_FILE) -> str:
    """This boot's id, or "" when the kernel does not say (then no record is judged by it)."""
    text = (_read_small(path, 64) or "").strip()
    return text if is_boot_id(text) else ""


def boot_time(path: str = STAT_FILE) -> float | None:
    """The boot time as the wall clock now puts it (``btime``), or None when unknown."""
    text = _read_small(path, 1 << 16) or ""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "btime" and value.strip().isdigit():
            return float(value.strip())
    return None


@dataclass(frozen=True)
class Boot:
    """What is known of the current boot."""

    id: str  # "" when unknown
    time: float | None  # btime, None when unknown
    now: float  # the wall clock when it was read


def current(now: float, *, id_path: str = BOOT_ID_FILE, stat_path: str = STAT_FILE) -> Boot:
    """The current boot, read from the kernel."""
    return Boot(boot_id(id_path), boot_time(stat_path), now)


class Verdict(NamedTuple):
    """Which boot wrote a record, and how that was decided."""

    boot: Literal["previous", "current", "doubt"]  # "doubt": keep the record
    how: Literal["exact", "fallback"]


def judge(record_boot_id: str, created_at: float, boot: Boot) -> Verdict:
    """Whether a record is surely of an earlier boot, surely of this one, or in doubt (keep it).

    The boot id decides when both sides have one; otherwise the creation time, conservatively.
    """
    if record_boot_id and boot.id:
        return Verdict("current" if record_boot_id == boot.id else "previous", "exact")
    if boot.time is None or not created_at > 0:
        return Verdict("doubt", "fallback")
    if created_at > boot.now:
        return Verdict("doubt", "fallback")  # written "later than now": the clock went back since
    if created_at < boot.time - CLOCK_SLACK_SECONDS:
        return Verdict("previous", "fallback")
    if created_at >= boot.time:
        return Verdict("current", "fallback")
    return Verdict("doubt", "fallback")


def checked(state_dir: str, this_boot_id: str) -> bool:
    """Whether this boot's records in ``state_dir`` were checked already (an unknown boot: yes).

    Two small reads and no lock: what every verb after the first of a boot pays.
    """
    if not this_boot_id:
        return True  # no way to remember a check: records are judged by a later boot's verbs
    return (_read_small(os.path.join(state_dir, MARKER), 64) or "").strip() == this_boot_id


def mark_checked(state_dir: str, boot: Boot) -> None:
    """Remember that every record of an earlier boot in ``state_dir`` is gone (0600, atomic)."""
    if boot.id:
        try:
            atomicfile.write_atomic(os.path.join(state_dir, MARKER), boot.id + "\n")
        except OSError as exc:
            # Not fatal: the next verb checks again.
            log.warning("cannot write %s in %s: %s", MARKER, state_dir, exc.strerror)
