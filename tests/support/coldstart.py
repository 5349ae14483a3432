"""What a cold start of the built binary imports, seen from outside through strace.

The tree keeps plain .pyc files (build.spec: noarchive), so each import is one
``openat`` of a file under the tree's ``_internal/``. Shared by the unit tier's
VERSION and DEL traces and the integration tier's ADD and DEL traces.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence

# The tree's own _internal/ is the first one in the path (pydantic has one of its own).
_PYC = re.compile(r'"[^"]*?/_internal/([^"]+)\.pyc", [^)]*\) = \d+')

# The node agent's NRI plugin and its generated messages: in the tree, only the agent loads them.
AGENT_ONLY = ("google", "grpc", "rdma_cni.agent")
# The long-running components' API client, HTTP serving and /metrics: a verb's pod GET is
# rdma_cni.kube.podget.
LONG_RUNNING_ONLY = (
    "rdma_cni.kube.client",
    "rdma_cni.kube.pool",
    "rdma_cni.kube.events",
    "rdma_cni.httpd",
    "prometheus_client",
)


def traced_modules(command: Sequence[str], stdin: bytes, env: Mapping[str, str], trace: str) -> set[str]:
    """Run ``command`` once under strace (it must succeed); the modules of the .pyc files it opened."""
    strace = shutil.which("strace")
    assert strace, "strace is needed to watch the binary's imports (make deps installs it)"
    proc = subprocess.run(
        [strace, "-f", "-qq", "-e", "trace=openat", "-o", trace, *command],
        input=stdin,
        capture_output=True,
        env=dict(env),
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    modules = set()
    with open(trace) as f:
        for line in f:
            match = _PYC.search(line)
            if match:
                modules.add(match.group(1).removesuffix("/__init__").replace("/", "."))
    return modules


def loaded_from(modules: set[str], packages: Sequence[str]) -> list[str]:
    """The modules that are one of ``packages`` or inside one."""
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in packages))
