"""Logging set-up: diagnostics go to stderr and to the config's ``logFile``.

stdout is reserved for the one CNI JSON document, so no handler here ever
writes to it.
"""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s"
_root = logging.getLogger("rdma_cni")
# The format names no process: without this every record asks multiprocessing
# for one, importing it (rdma_cni.startup defers it) into every cold start.
logging.logMultiprocessing = False

# "warm" when a warm server's child runs this invocation (rdma_cni.warm); the
# per-verb log line says which, so an operator can tell the two apart.
start_kind = "cold"


def setup_stderr() -> None:
    """Send warnings and errors to stderr until the config says more."""
    if not _root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT))
        handler.setLevel(logging.WARNING)
        _root.addHandler(handler)
        _root.setLevel(logging.INFO)
        _root.propagate = False


def configure(log_file: str | None, level: str, context: str) -> None:
    """Apply the config's logFile and logLevel; ``context`` prefixes every line."""
    _root.setLevel(getattr(logging, level.upper(), logging.INFO))
    if log_file:
        try:
            os.makedirs(os.path.dirname(log_file) or "/", exist_ok=True)
            handler = logging.FileHandler(log_file, encoding="utf-8")
        except OSError as exc:
            _root.warning("cannot open logFile %s: %s", log_file, exc)
            return
        handler.setFormatter(logging.Formatter(_FORMAT.replace("%(name)s", f"%(name)s {context}")))
        _root.addHandler(handler)
