"""Small IPAM plugins that misbehave on purpose (test fixtures, not plugin code).

Each is a shell script written into a directory that goes first on CNI_PATH.
VERSION is always answered properly (the plugin asks it before anything
else); the other verbs do what the test wants: fail, hang, lie or crash, or
hand over to Debian's real host-local.
"""

from __future__ import annotations

import json
import os
from typing import Any

HOST_LOCAL = "/usr/lib/cni/host-local"
_VERSION = json.dumps({"cniVersion": "1.0.0", "supportedVersions": ["0.3.0", "0.3.1", "0.4.0", "1.0.0"]})


def write_ipam(bindir: str, name: str, per_verb: dict[str, str], default: str | None = None) -> str:
    """Write IPAM plugin ``name``: ``per_verb`` maps a verb to shell code; others run ``default``.

    ``default`` None means host-local. Returns the script's path.
    """
    os.makedirs(bindir, exist_ok=True)
    lines = ["#!/bin/sh", f"if [ \"$CNI_COMMAND\" = VERSION ]; then echo '{_VERSION}'; exit 0; fi"]
    for verb, code in per_verb.items():
        lines.append(f'if [ "$CNI_COMMAND" = {verb} ]; then')
        lines.append(code)
        lines.append("fi")
    lines.append(default if default is not None else f"exec {HOST_LOCAL}")
    path = os.path.join(bindir, name)
    with open(path + ".tmp", "w") as f:
        f.write("\n".join(lines) + "\n")
    os.chmod(path + ".tmp", 0o755)
    os.rename(path + ".tmp", path)  # a running copy keeps its own text
    return path


def prints(doc: Any, status: int = 0) -> str:
    """Shell code that prints ``doc`` (JSON) and exits with ``status``."""
    text = json.dumps(doc).replace("'", "'\\''")
    return f"cat >/dev/null; printf '%s\\n' '{text}'; exit {status}"


def sleeper(bindir: str, tag: str) -> str:
    """A ``sleep`` whose command line names ``tag`` (a symlink), to find the processes it runs."""
    os.makedirs(bindir, exist_ok=True)
    path = os.path.join(bindir, tag)
    if not os.path.lexists(path):
        os.symlink("/bin/sleep", path)
    return path


def hangs(sleeper_path: str, seconds: int = 300) -> str:
    """Shell code that leaves a grandchild behind and then hangs, both running ``sleeper_path``."""
    return f"{sleeper_path} {seconds} & exec {sleeper_path} {seconds}"


def crashes() -> str:
    """Shell code that dies of SIGSEGV."""
    return "kill -SEGV $$; sleep 5"


def sleeps_then_host_local(seconds: float, marker: str) -> str:
    """Shell code that marks its start, waits, then runs host-local (a window to kill the caller in)."""
    return f"touch {marker}; sleep {seconds}; exec {HOST_LOCAL}"
