"""The DEL spool: DELs that no running agent took, kept until an agent runs them.

A runtime must always be able to delete a pod, agent or no agent. So the shim,
finding no server (or one that refuses or drops the call), writes the DEL
request (the bytes it would have sent, without the namespace fd) into
``<socket dir>/del-spool`` atomically, mode 0600, one file per attachment
(``del-<container id>-<hex of CNI_IFNAME>.req``), and tells the runtime it
succeeded; a server too busy to run a DEL at once spools it there itself. The
VFs stay held by their record meanwhile, so no ADD can be given them.

Who runs an entry, and when (:class:`Spool`):

- **The agent that owns the CNI socket**, in the background (:class:`Runner`):
  at once when it starts, within :data:`POLL_SECONDS` of an entry appearing
  while it runs, and again after a failure on a backoff of its own per
  attachment (:data:`RETRY_FIRST` doubling to :data:`RETRY_MAX`). Never on an
  ADD's path: an ADD of another attachment never waits for the spool, but for
  the node lock a spooled DEL holds, as it would for any DEL; after a DEL that
  held it long the runner waits as long before the next, so such an ADD waits
  for one at most.
- **An ADD of the same attachment** (same container id and interface) first
  settles that attachment's entries (:meth:`Spool.settle`): it waits for a run
  under way, or runs what is left itself, and is answered "try again later"
  if that DEL fails. This is what ties an entry to the attachment it undoes:
  an entry stands for the attachment that held its container id and
  interface when it was written, and no later ADD of them starts while it
  exists, so a stale entry can never release a later ADD's VFs or lease.
- **A DEL of the same attachment served directly** retires its entries
  (:meth:`Spool.retire`): they stand for the DEL that just succeeded.

A spooled DEL runs as a DEL with no ``CNI_NETNS`` (the runtime's path meant
nothing outside its moment; the plugin takes the recorded one, as after
containerd's second DEL). The plugin's DEL is idempotent, so running an entry
twice is harmless; running two DELs of one attachment at once is not needed
and never happens: before an entry runs it is *claimed*, linked to
``.run-<its name>`` (never replacing a claim), and only the process holding an
``flock`` on the claimed file, which finds it still linked, runs it. A run
that succeeds unlinks it; one that fails leaves it claimed and unlocked, for
whoever comes next. A file that disappears at any step was run (or retired)
by someone else: done, never an error. Two agents during a rollout share the
directory this way; the background runner runs only in the one that owns the
socket.
"""

from __future__ import annotations

import binascii
import contextlib
import errno
import fcntl
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from rdma_cni.agent.shimwire import (
    REQUEST_HEADER,
    Request,
    WireError,
    encode_request,
    parse_env,
    parse_header,
)
from rdma_cni.shared.atomicfile import move, write_atomic

log = logging.getLogger("rdma_cni.agent.cniserver")

SPOOL_NAME = "del-spool"
CLAIMED = ".run-"
SET_ASIDE = ".bad-"
# What a spooled request may hold (the header's own bounds, and the file's).
MAX_FILE = REQUEST_HEADER.size + (64 << 10) + (1 << 20) + 1
# The shim's own bound (launcher/shim.c SPOOL_MAX): unclaimed entries at most.
SPOOL_MAX = 4096
# How often the runner looks for entries spooled while it runs.
POLL_SECONDS = 1.0
# A failing attachment is tried again after this long, doubling up to RETRY_MAX.
RETRY_FIRST = 2.0
RETRY_MAX = 300.0
# After a DEL that ran this long (it held the node lock, in an IPAM call that hung, say), the runner
# waits as long before the next, up to YIELD_MAX: an ADD waiting for the node lock gets it first.
YIELD_AFTER = 0.5
YIELD_MAX = 10.0
# How long a lock held by another run is waited for, in a step.
_LOCK_STEP = 0.02

_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_NAME = re.compile(r"(?:\.run-)?(del-[A-Za-z0-9_.-]{1,128}-[0-9a-f]{2,128}\.req)")

Outcome = Literal["done", "failed", "busy"]
# Runs one spooled DEL within a time budget (seconds): its exit status and stderr.
RunDel = Callable[[Request, float], tuple[int, bytes]]


def spool_dir(socket_path: str) -> str:
    """Where the shim spools DELs for the server at ``socket_path``."""
    return os.path.join(os.path.dirname(socket_path), SPOOL_NAME)


def entry_name(container_id: str, ifname: str) -> str | None:
    """The spool file of an attachment, as the shim names it; None when its names cannot make one."""
    raw = ifname.encode("utf-8", "surrogateescape")
    if not _ID.fullmatch(container_id) or not 0 < len(raw) <= 64:
        return None
    return f"del-{container_id}-{binascii.hexlify(raw).decode()}.req"


def attachment_of(name: str) -> str | None:
    """The entry name (``del-...req``) a spool file stands for, claimed or not; None for other files."""
    m = _NAME.fullmatch(name)
    return m.group(1) if m else None


def read_spooled(where: int | str) -> Request:
    """The spooled request in open file ``where`` (an fd, or a path, not followed if a link).

    WireError unless it is a DEL the shim wrote (owner, mode, format).
    """
    if isinstance(where, str):
        fd = os.open(where, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            return read_spooled(fd)
        finally:
            os.close(fd)
    fd = where
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise WireError("not a private regular file of this user")
    if st.st_size > MAX_FILE:
        raise WireError(f"{st.st_size} bytes, more than a request can hold")
    raw = os.pread(fd, MAX_FILE + 1, 0)
    header = parse_header(raw[: REQUEST_HEADER.size])
    body = raw[REQUEST_HEADER.size :]
    if len(body) != header.env_len + header.stdin_len:
        raise WireError("truncated")
    env = parse_env(body[: header.env_len])
    if env.get("CNI_COMMAND") != "DEL":
        raise WireError(f"CNI_COMMAND is {env.get('CNI_COMMAND', '')[:20]!r}, not DEL")
    # The runtime's namespace path was valid in its view, at its time: not here, not now.
    env["CNI_NETNS"] = ""
    return Request(env=env, stdin=body[header.env_len :])


def _same_file(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (it was neither removed nor replaced)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _lock(fd: int, deadline: float) -> bool:
    """An exclusive flock on ``fd`` by ``deadline`` (monotonic); False if another holder kept it."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(_LOCK_STEP)


@dataclass
class Settled:
    """What became of an attachment's entries: ``done`` (none left), ``failed`` (its DEL failed:
    ``detail`` says why) or ``busy`` (another run held it past the deadline)."""

    outcome: Outcome
    detail: str = ""


class Spool:
    """One spool directory and how its entries are claimed, run and retired (see the module's text).

    ``run`` runs one spooled DEL within a budget in seconds and gives its exit status and stderr.
    """

    def __init__(self, directory: str, run: RunDel) -> None:
        self.directory = directory
        self.run = run

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def names(self) -> list[str]:
        """The attachments (entry names) with a file here, claimed or not; [] without a directory."""
        try:
            listed = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        return sorted({a for n in listed if (a := attachment_of(n)) is not None})

    def write(self, request: Request) -> bool:
        """Spool ``request`` (a DEL) as the shim would; False when its names make no entry or it fails."""
        name = entry_name(request.env.get("CNI_CONTAINERID", ""), request.env.get("CNI_IFNAME", ""))
        if name is None or request.command != "DEL":
            return False
        path = self._path(name)
        try:
            listed = [n for n in os.listdir(self.directory) if not n.startswith(".")]
            if not os.path.exists(path) and len(listed) >= SPOOL_MAX:
                log.error("the DEL spool %s is full: not spooling %s", self.directory, name)
                return False
            write_atomic(path, encode_request(request.env, request.stdin))
        except OSError as exc:
            log.error("cannot spool the DEL %s: %s", name, exc)
            return False
        log.info("spooled the DEL %s (the agent was too busy to run it at once)", name)
        return True

    def settle(self, name: str, budget: float, wait: float) -> Settled:
        """Run what is spooled for attachment ``name`` until none is left, within ``budget`` seconds.

        A run of it under way elsewhere is waited for up to ``wait`` seconds (``busy`` past that);
        the first DEL that fails ends it (``failed``, with its stderr's last line).
        """
        start = time.monotonic()
        deadline = start + budget
        lock_by = start + min(wait, budget)
        claimed, entry = self._path(CLAIMED + name), self._path(name)
        while True:
            outcome = self._run_claimed(claimed, name, lock_by, deadline)
            if outcome.outcome != "done":
                return outcome
            if time.monotonic() >= deadline:
                return Settled("busy", f"still being spooled again after {budget:.0f} s")
            try:
                # Claim without replacing a claim someone made meanwhile (link fails if it exists).
                os.link(entry, claimed, follow_symlinks=False)
            except FileNotFoundError:
                if not os.path.lexists(claimed):
                    return Settled("done")
                continue
            except FileExistsError:
                continue  # claimed by another: wait for that run first
            # A repeat of this DEL renamed over the entry just now is this attachment's: one run covers it.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry)

    def _run_claimed(self, claimed: str, name: str, lock_by: float, deadline: float) -> Settled:
        """Run the claimed file of ``name`` if there is one (its lock waited for until ``lock_by``,
        the run given until ``deadline``); ``done`` when none is left."""
        while True:
            try:
                fd = os.open(claimed, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            except FileNotFoundError:
                return Settled("done")
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    self._set_aside(claimed, name, "a symbolic link")
                    continue
                raise
            try:
                if not _lock(fd, lock_by):
                    return Settled("busy", "another run of this DEL is under way")
                if not _same_file(fd, claimed):
                    continue  # its runner finished (or it was replaced): look again
                try:
                    request = read_spooled(fd)
                except (OSError, WireError) as exc:
                    self._set_aside(claimed, name, str(exc))
                    continue
                status, err = self.run(request, max(deadline - time.monotonic(), 1.0))
                if status != 0:
                    lines = err.decode("utf-8", "replace").strip().splitlines()
                    return Settled("failed", lines[-1][:300] if lines else f"exit status {status}")
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(claimed)
                log.info("ran the spooled DEL %s", name)
            finally:
                os.close(fd)

    def _set_aside(self, path: str, name: str, why: str) -> None:
        log.error("spooled DEL %s is unusable (%s): set aside", name, why)
        with contextlib.suppress(FileNotFoundError):
            move(path, self._path(SET_ASIDE + name))

    def retire(self, name: str) -> None:
        """Drop what is spooled for attachment ``name``: the DEL it stands for was just served.

        A claimed file whose run is under way is left to it (it is this attachment's DEL too).
        """
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(name))
            log.info("retired the spooled DEL %s: served directly", name)
        claimed = self._path(CLAIMED + name)
        try:
            fd = os.open(claimed, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return
        try:
            if _lock(fd, time.monotonic()) and _same_file(fd, claimed):
                os.unlink(claimed)
                log.info("retired the spooled DEL %s: served directly", name)
        finally:
            os.close(fd)


class Runner:
    """Runs a :class:`Spool` in the background: at start, as entries appear, and failures on a backoff.

    ``budget``: the time one DEL may take. ``poll``: how often the directory is looked at.
    """

    def __init__(
        self,
        spool: Spool,
        budget: float,
        *,
        poll: float = POLL_SECONDS,
        retry: tuple[float, float] = (RETRY_FIRST, RETRY_MAX),
    ) -> None:
        self.spool = spool
        self.budget = budget
        self.poll = poll
        self.retry = retry
        # Attachment -> (failures so far, when it is due again): only failing ones are here.
        self.backoff: dict[str, tuple[int, float]] = {}
        self.waiting = 0
        self.failing = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._running = threading.Lock()

    def start(self) -> None:
        """Run in a daemon thread until :meth:`stop`."""
        self._thread = threading.Thread(target=self._loop, name="del-spool", daemon=True)
        self._thread.start()

    def stop(self, wait: float = 0.0) -> None:
        """Stop after the DEL under way (waited for up to ``wait`` seconds)."""
        self._stop.set()
        if self._thread is not None and wait > 0:
            self._thread.join(wait)

    def _loop(self) -> None:
        seen: int | None = None
        while not self._stop.is_set():
            try:
                mtime = os.stat(self.spool.directory).st_mtime_ns
            except OSError:
                mtime = None
            now = time.monotonic()
            due = any(at <= now for _, at in self.backoff.values())
            if mtime != seen or due:
                seen = mtime
                try:
                    self.run_once()
                except Exception:  # a fault of this node: logged, tried again at the next poll
                    log.exception("the DEL spool pass failed")
            self._stop.wait(self.poll)

    def run_once(self) -> tuple[int, int]:
        """One pass over the attachments due now, those never tried first: (run, left)."""
        with self._running:
            names = self.spool.names()
            present = set(names)
            for gone in [n for n in self.backoff if n not in present]:
                del self.backoff[gone]
            now = time.monotonic()
            order = sorted(names, key=lambda n: self.backoff.get(n, (0, 0.0))[1])
            done = left = 0
            for name in order:
                if self._stop.is_set():
                    break
                failures, due_at = self.backoff.get(name, (0, 0.0))
                if due_at > now:
                    left += 1
                    continue
                # A run held elsewhere (an ADD of this attachment settling it) is not waited for.
                began = time.monotonic()
                settled = self.spool.settle(name, self.budget, wait=0.0)
                took = time.monotonic() - began
                if took >= YIELD_AFTER:
                    # The kernel hands a free flock to whoever waits; a next DEL started at once
                    # could take the node lock ahead of an ADD again and again.
                    self._stop.wait(min(took, YIELD_MAX))
                if settled.outcome == "done":
                    self.backoff.pop(name, None)
                    done += 1
                elif settled.outcome == "busy":
                    left += 1
                else:
                    delay = min(self.retry[0] * 2**failures, self.retry[1])
                    self.backoff[name] = (failures + 1, time.monotonic() + delay)
                    left += 1
                    log.warning(
                        "the spooled DEL %s failed (%s): tried again in %.0f s", name, settled.detail, delay
                    )
            self.waiting = left
            self.failing = len(self.backoff)
            return done, left
