"""What a second agent on a node waits for, taken over in the background when the first lets go.

During a rolling update with surge (``maxSurge: 1, maxUnavailable: 0``) the new
agent pod runs beside the old one until it is Ready, and kubelet deletes the
old pod only then. So the new agent must become Ready without what the old one
still holds (the host-network metrics port, the CNI server's socket, the NRI
registration): it asks for each at start, and for what is busy keeps asking in
a background thread, quickly at first and then at most every ``max_poll``
seconds, until it has it or the agent stops. Each wait is logged once when it
begins, once if it lasts longer than :data:`LONG_WAIT` (an old agent that never
stops: the rollout is stuck elsewhere), and once when it ends; never per try.

Which parts are held is kept in :data:`HELD` (``part -> bool``), which the
agent's metrics report as ``rdma_cni_agent_serving``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("rdma_cni.agent")

# After this long an agent still waiting says so once more, as an error: the other agent has not stopped.
LONG_WAIT = 300.0
# The parts, as the metric labels them, and as the log names them.
PARTS = {"cni": "the CNI server's socket", "metrics": "the metrics port", "nri": "the NRI registration"}
# part -> whether this agent holds it now (False: waiting for the other agent to let go).
HELD: dict[str, bool] = {}


def take_over(
    part: str,
    attempt: Callable[[], bool],
    stop: threading.Event,
    *,
    poll: float = 0.1,
    max_poll: float = 1.0,
    long_wait: float | None = None,
) -> bool:
    """Call ``attempt`` until ``part`` (a key of :data:`PARTS`) is ours (True) or ``stop`` is set (False).

    ``attempt`` returns False while another agent holds ``part``; what it raises ends the wait
    (logged, False): a fault of this node, not a matter of waiting.
    """
    what = PARTS[part]
    started = time.monotonic()
    delay = poll
    said_long = False
    waited = False
    limit = LONG_WAIT if long_wait is None else long_wait
    while not stop.is_set():
        try:
            taken = attempt()
        except Exception as exc:  # the part cannot be taken at all: say so, stop trying
            log.error("%s: cannot take it over: %s", what, exc)
            HELD[part] = False
            return False
        if taken:
            HELD[part] = True
            if waited:
                log.info("%s: taken over after %.1f s", what, time.monotonic() - started)
            return True
        if not waited:
            log.warning("%s: held by another agent on this node; taking it over when it lets go", what)
            waited = True
            HELD[part] = False
        if not said_long and time.monotonic() - started >= limit:
            log.error("%s: still held by another agent after %.0f s; still waiting", what, limit)
            said_long = True
        stop.wait(delay)
        delay = min(delay * 2, max_poll)
    return False


def in_background(name: str, target: Callable[[], Any]) -> threading.Thread:
    """Run ``target`` in a daemon thread named ``name`` (a wait must never hold up readiness)."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


class FileLock:
    """An exclusive ``flock`` on a file, tried without blocking; released by :meth:`release` or exit."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = -1

    def try_acquire(self) -> bool:
        """True once held; False while another process holds it; OSError when the file cannot be opened."""
        if self.fd < 0:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def release(self) -> None:
        """Let go (closing the file releases the lock)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class MetricsPort:
    """The agent's ``/metrics`` listener: served at once, or once the other agent frees the port."""

    def __init__(self, address: tuple[str, int], serve: Callable[[tuple[str, int]], Any]) -> None:
        self.address = address
        self._serve = serve
        self.server: Any = None
        self._lock = threading.Lock()
        self._closed = False

    def _attempt(self) -> bool:
        try:
            server = self._serve(self.address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
        with self._lock:
            if self._closed:  # stopped while binding: let go at once
                _shut(server)
                return True
            self.server = server
        return True

    def start(self, stop: threading.Event) -> bool:
        """Serve now (True), or wait for the port in the background (False); OSError for any other fault.

        A port that is busy is another agent's (the old one of a rollout with surge): waited for.
        Anything else (an address the node does not have, no permission) is the operator's to fix.
        """
        if self._attempt():
            HELD["metrics"] = True
            return True

        def wait() -> None:
            take_over("metrics", self._attempt, stop, poll=0.1, max_poll=0.5)

        HELD["metrics"] = False
        in_background("metrics-takeover", wait)
        return False

    def close(self) -> None:
        """Stop serving and free the port (the next agent's to take); waiting stops with ``stop``."""
        with self._lock:
            self._closed = True
            server, self.server = self.server, None
        if server is not None:
            _shut(server)
        HELD.pop("metrics", None)


def _shut(server: Any) -> None:
    with contextlib.suppress(OSError):
        server.shutdown()
        server.server_close()
