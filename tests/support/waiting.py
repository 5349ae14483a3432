"""Waiting for a condition with a deadline, saying what was awaited when it never came."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.25) -> Any:
    """``check()``'s first truthy value, polled every ``interval`` s; AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
