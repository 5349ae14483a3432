"""The CNI server's same-boot release of attachments whose pod namespace is gone but no DEL came.

Every :data:`INTERVAL` seconds, in a thread of the server that owns the
socket, for each state directory the server is told about (the same as the
boot release's, :mod:`rdma_cni.agent.bootrelease`):

1. **A screen, here, without the node lock**: each record's ``netns`` path is
   stat'ed and compared with the ``netns_id`` ADD kept. While every record's
   namespace is still at its path (the case of every live pod) nothing else is
   done: a directory listing and a small read and a stat per record.
2. **Otherwise the pass, as the plugin** (``rdma-cni release-orphans``, run as
   every verb is run, with its node lock, records and IPAM guard): the
   plugin decides under the node lock (:func:`rdma_cni.node.orphans.judge`:
   namespace gone by kernel identity, every VF proven home, no verb under
   way) and releases at most a few records per pass as a DEL without
   ``CNI_NETNS`` would (:func:`rdma_cni.verbs.gc.release_orphans`).

Each release is logged by the plugin and counted here
(``rdma_cni_agent_orphans_released_total``). Nothing here is fatal.

A pass that changed nothing (the plugin kept every suspect: a VF that is not
home, a namespace still alive elsewhere) is not run again for the same
suspects until twice the wait before it has passed, up to :data:`MAX_BACKOFF`:
a record kept for good costs a plugin run and a node lock hold every few
minutes, not every :data:`INTERVAL`. A new suspect, or one gone, starts over.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence

log = logging.getLogger("rdma_cni.agent.cniserver")

HOST_NETNS_PATH = "/proc/self/ns/net"  # its st_dev is nsfs's (the agent does not import the plugin)
BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
INTERVAL = 10.0
# A pass holds the node lock for a few releases at most; its process is given this long.
PASS_TIMEOUT = 120.0
# A record larger than this is no record ADD wrote: the plugin judges it (and refuses it).
MAX_RECORD = 1 << 20
ANSWER_TAIL = 4096
# Seconds: the longest wait before a pass that changed nothing is run again for the same suspects.
MAX_BACKOFF = 320.0


def suspects(state_dir: str) -> list[str]:
    """Records of ``state_dir`` whose namespace is not surely still at its path (``containerID@ifname``).

    Only a hint for whether to run the pass: the plugin decides, under the node lock. A record
    this cannot read is left out (the plugin never releases one it cannot read either).
    """
    directory = os.path.join(state_dir, "attachments")
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".json") and not n.startswith("."))
    except OSError:
        return []
    nsfs_dev = os.stat(HOST_NETNS_PATH).st_dev
    this_boot = _boot_id()
    out = []
    for name in names:
        try:
            with open(os.path.join(directory, name), "rb") as f:
                doc = json.loads(f.read(MAX_RECORD + 1)[:MAX_RECORD])
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict):
            continue
        if this_boot and doc.get("boot_id") not in ("", None, this_boot):
            continue  # an earlier boot's: the boot release's (the pass would keep it too)
        path, ident = doc.get("netns"), doc.get("netns_id")
        if not isinstance(path, str) or not path:
            continue
        try:
            st = os.stat(path)
        except OSError:
            out.append(name[: -len(".json")])
            continue
        if isinstance(ident, list) and len(ident) == 2:
            if [st.st_dev, st.st_ino] != ident:
                out.append(name[: -len(".json")])
        elif st.st_dev != nsfs_dev:
            # No identity kept (a record before schema 3): only a namespace file at its path keeps it.
            out.append(name[: -len(".json")])
    return out


def _boot_id() -> str:
    """This boot's id (rdma_cni.node.boot.boot_id; the agent does not import the plugin), or ""."""
    try:
        with open(BOOT_ID_FILE, encoding="ascii") as f:
            return f.read(64).strip()
    except (OSError, ValueError):
        return ""


def run_pass(
    plugin: Sequence[str], env: Mapping[str, str], state_dir: str, lock_file: str, timeout: float
) -> dict[str, object] | None:
    """One ``rdma-cni release-orphans`` for ``state_dir`` through ``plugin``: its answer, or None."""
    argv = [*plugin, "release-orphans", f"--state-dir={state_dir}", f"--lock-file={lock_file}"]
    try:
        proc = subprocess.run(
            argv, env=dict(env), stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.error("release of orphaned attachments in %s: %s", state_dir, exc)
        return None
    text = proc.stdout.decode(errors="replace").strip()
    try:
        answer = json.loads(text)
    except ValueError:
        answer = None
    if proc.returncode != 0 or not isinstance(answer, dict):
        err = proc.stderr.decode(errors="replace").strip()[-ANSWER_TAIL:]
        log.error(
            "release of orphaned attachments in %s: exit %d: %s %s",
            state_dir,
            proc.returncode,
            text[-ANSWER_TAIL:],
            err,
        )
    return answer if isinstance(answer, dict) else None


def _changed_nothing(answer: Mapping[str, object]) -> bool:
    """Whether a pass released nothing and had nothing left for the next (nor gave way to a verb)."""
    return not answer.get("released") and not answer.get("left") and not answer.get("busy")


def _count(answer: Mapping[str, object]) -> None:
    released = answer.get("released")
    if not isinstance(released, list) or not released:
        return
    try:
        from rdma_cni.agent import metrics
    except ImportError:  # a CNI server without the agent's metrics (prometheus_client absent)
        return
    metrics.orphans_released(len(released))


class OrphanPass:
    """The periodic pass over ``states`` (``stateDir``, ``lockFile`` pairs); :meth:`start`, :meth:`stop`."""

    def __init__(
        self,
        plugin: Sequence[str],
        env: Mapping[str, str],
        states: Sequence[tuple[str, str]],
        interval: float = INTERVAL,
    ) -> None:
        self.plugin = list(plugin)
        self.env = dict(env)
        self.states = list(states)
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Per state directory, after a pass that changed nothing: its suspects, the wait, the next pass.
        self._quiet: dict[str, tuple[frozenset[str], float, float]] = {}

    def once(self, now: float | None = None) -> list[str]:
        """One pass over every state directory now (``now``: monotonic seconds): the attachments released."""
        now = time.monotonic() if now is None else now
        released: list[str] = []
        for state_dir, lock_file in self.states:
            if self._stop.is_set():
                break
            found = frozenset(suspects(state_dir))
            if not found:
                self._quiet.pop(state_dir, None)
                continue
            quiet = self._quiet.get(state_dir)
            if quiet is not None and quiet[0] == found and now < quiet[2] - self.interval / 2:
                continue  # the same suspects a pass could do nothing for: not yet again
            answer = run_pass(self.plugin, self.env, state_dir, lock_file, PASS_TIMEOUT)
            if answer is None or _changed_nothing(answer):
                wait = quiet[1] * 2 if quiet is not None and quiet[0] == found else self.interval * 2
                wait = min(wait, MAX_BACKOFF)
                self._quiet[state_dir] = (found, wait, now + wait)
            else:
                self._quiet.pop(state_dir, None)
            if answer is None:
                continue
            _count(answer)
            got = answer.get("released")
            if isinstance(got, list) and got:
                released += [str(k) for k in got]
                log.info(
                    "released %d attachment(s) in %s whose pod namespace is gone though no DEL came: %s",
                    len(got),
                    state_dir,
                    ", ".join(map(str, got)),
                )
        return released

    def start(self) -> None:
        if self._thread is not None or self.interval <= 0 or not self.states:
            return
        self._thread = threading.Thread(target=self._run, name="orphan-pass", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.once()
            except Exception:  # never the server's end: logged, tried again next time
                log.exception("release of orphaned attachments failed")

    def stop(self, wait: float = 0.0) -> None:
        self._stop.set()
        if self._thread is not None and wait > 0:
            self._thread.join(wait)
