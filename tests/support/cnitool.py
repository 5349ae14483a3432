"""cnitool, the CNI project's command-line runtime (``make cnitool``), as the tests run it.

cnitool v1.3.0 reads its network by name from ``NETCONFPATH`` (``.conf``, ``.conflist``
and ``.json`` files; ``/etc/cni/net.d`` without it), plugins from ``CNI_PATH``, the
interface name from ``CNI_IFNAME`` (``eth0`` when unset), runtime arguments from
``CNI_ARGS`` (``K=V;K=V``, each key and value non-empty) and capability arguments
from ``CAP_ARGS`` (JSON). Its netns argument is a path, made absolute; the container
ID is ``cnitool-`` and a hash of that path, so one netns is one attachment. libcni
caches each ADD's result under ``/var/lib/cni`` (CHECK and DEL read it back), and GC
passes no valid attachments: it DELs every cached attachment of the network, then
runs the plugins' GC. Give each test a network name of its own.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def version() -> str:
    """The cnitool release the Makefile builds (``CNITOOL_VERSION``)."""
    m = re.search(r"^CNITOOL_VERSION\s*:=\s*(\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert m, "no CNITOOL_VERSION in the Makefile"
    return m.group(1)


def path() -> str:
    """Where ``make cnitool`` puts the binary (the build cache, keyed by version)."""
    return f"/var/cache/rdma-cni-build/cnitool-{version()}/cnitool"


@dataclass
class CniTool:
    """One network under ``netconfpath``, run by cnitool with the plugins of ``cni_path``."""

    netconfpath: str
    cni_path: str
    extra_env: dict[str, str]

    def run(
        self,
        verb: str,
        network: str,
        netns: str,
        *,
        ifname: str = "net1",
        cni_args: str | None = None,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        """``cnitool VERB NETWORK NETNS``; the exit code and output are the caller's to judge."""
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            **self.extra_env,
            "NETCONFPATH": self.netconfpath,
            "CNI_PATH": self.cni_path,
            "CNI_IFNAME": ifname,
        }
        if cni_args is not None:
            env["CNI_ARGS"] = cni_args
        return subprocess.run(
            [path(), verb, network, netns],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
