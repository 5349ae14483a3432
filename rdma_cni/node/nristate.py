"""Where the node agent's NRI plugin says whether it injects RDMA devices, for STATUS to read.

The plugin runs in the agent; STATUS runs in the CNI plugin, another process
started by the runtime. The file lives beside the node lock (lockFile's
directory), which both reach: one line, "registered" or why not.
"""

from __future__ import annotations

import os

STATE_FILE = "nri-state"
REGISTERED = "registered"


def state_path(lock_file: str) -> str:
    """The state file for the node lock ``lock_file``."""
    return os.path.join(os.path.dirname(lock_file), STATE_FILE)


def read_state(lock_file: str) -> str | None:
    """The plugin's last state; None when no agent wrote one (no agent, or NRI off)."""
    try:
        with open(state_path(lock_file), encoding="utf-8") as f:
            return f.read().strip() or None
    except (OSError, UnicodeDecodeError):
        return None
