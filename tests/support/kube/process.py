"""One control-plane process: started with its log in a file, awaited until ready, stopped.

A component that exits or is not ready in time raises :class:`ComponentFailed`
carrying the end of its log, so the test that needed it fails saying why.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

LOG_TAIL = 6000  # characters of a failed component's log shown in the failure


class ComponentFailed(AssertionError):
    """A component did not start (or died): the message ends with its log."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the kernel's choice, so parallel runs do not collide)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_tail(path: str, limit: int = LOG_TAIL) -> str:
    """The last ``limit`` characters of a log file ('' when there is none)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


@dataclass
class Component:
    """A running component and where its log goes."""

    name: str
    argv: list[str]
    log: str
    env: dict[str, str] | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self) -> None:
        """Start (or restart) the process, appending to its log."""
        with open(self.log, "ab") as out:
            out.write(f"\n==== start: {' '.join(self.argv)}\n".encode())
            out.flush()
            # Its own process group: stopping it never reaches the test runner.
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )

    def alive(self) -> bool:
        """True while the process runs."""
        return self.proc is not None and self.proc.poll() is None

    def failed(self, why: str) -> ComponentFailed:
        """The error for this component, with the end of its log."""
        return ComponentFailed(f"{self.name} {why}; the end of {self.log}:\n{log_tail(self.log)}")

    def wait_ready(self, ready: Callable[[], bool], timeout: float) -> None:
        """Poll ``ready`` until it holds; raise with the log if the process exits or time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.alive():
                code = self.proc.returncode if self.proc else None
                raise self.failed(f"exited with {code} before it was ready")
            try:
                if ready():
                    return
            except OSError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise self.failed(f"was not ready after {timeout:.0f} s")
            time.sleep(0.2)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        """Stop the process group (SIGKILL after ``timeout``); a no-op when it is not running."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout)


def start_component(
    name: str,
    argv: Sequence[str],
    log_dir: str,
    ready: Callable[[], bool],
    *,
    timeout: float = 90.0,
    env: dict[str, str] | None = None,
) -> Component:
    """Start ``argv`` as ``name``, logging to ``log_dir/name.log``, and wait until ``ready``."""
    component = Component(name, list(argv), os.path.join(log_dir, f"{name}.log"), env)
    component.start()
    try:
        component.wait_ready(ready, timeout)
    except BaseException:
        component.stop(signal.SIGKILL)
        raise
    return component
