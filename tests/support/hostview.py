"""The host's links as the kernel reports them, to prove a plugin run left them alone.

The machine is shared by parallel test sessions whose veths come and go, so a
snapshot covers the host's own links (everything that is not a veth) plus the
veths of one simulated node (by its name prefix), and a comparison only asks
that what existed before is still there, unchanged.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any


def host_links(prefix: str) -> dict[str, tuple[Any, ...]]:
    """``{name: attributes}`` of the host's non-veth links and of the veths named ``prefix...``."""
    out = subprocess.run(
        ["ip", "-j", "-d", "link", "show"], capture_output=True, text=True, check=True
    ).stdout
    snap: dict[str, tuple[Any, ...]] = {}
    for link in json.loads(out):
        kind = link.get("linkinfo", {}).get("info_kind")
        name = link["ifname"]
        if kind == "veth" and not name.startswith(prefix):
            continue
        # Carrier follows the peer's state, which the plugin legitimately changes:
        # compare the administrative flags only.
        flags = sorted(f for f in link.get("flags", []) if f not in ("LOWER_UP", "NO-CARRIER", "M-DOWN"))
        snap[name] = (kind, link.get("mtu"), link.get("address"), tuple(flags), link.get("ifalias", ""))
    return snap


def changed_links(before: dict[str, tuple[Any, ...]], after: dict[str, tuple[Any, ...]]) -> list[str]:
    """What happened to the links of ``before``: gone or changed (new links are other sessions')."""
    problems = []
    for name, attrs in sorted(before.items()):
        if name not in after:
            problems.append(f"{name} is gone from the host")
        elif after[name] != attrs:
            problems.append(f"{name} changed: {attrs} -> {after[name]}")
    return problems
