"""What Multus passes to an rdma-cni delegate, recorded on the node as it happens.

A NetworkAttachmentDefinition of type ``rdma-cni-capture`` (conf/'s network under another name
and subnet) makes Multus run :data:`SCRIPT` from ``/opt/cni/bin`` (chrooted into the node's
root, as it runs every delegate): it writes the ``CNI_*`` variables and stdin it was given to
``/run/rdma-cni-capture``, then runs ``/opt/cni/bin/rdma-cni`` (the shim the agent installed)
with exactly those, so the pod is served as any other. The plugin never looks at ``type``.
:func:`normalized` replaces what differs from run to run (ids, paths, addresses), so a run's
record compares with the fixture in tests/unit/data/multus/.
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Any

DIR = "/run/rdma-cni-capture"
TYPE = "rdma-cni-capture"
SCRIPT = """#!/bin/sh
# Records what Multus passes to this delegate (CNI_* variables and stdin; written by the node
# tier, tests/support/node/capture.py), then runs rdma-cni with exactly the same.
d=/run/rdma-cni-capture
mkdir -p "$d"
n=$(date +%s%N)-$$
cat > "$d/$n.stdin"
env | grep '^CNI_' | sort > "$d/$n.env"
exec /opt/cni/bin/rdma-cni < "$d/$n.stdin"
"""


def install() -> None:
    """Put the capturing delegate in the node's CNI bin dir."""
    path = "/opt/cni/bin/" + TYPE
    with open(path, "w") as f:
        f.write(SCRIPT)
    os.chmod(path, 0o755)


def calls() -> list[dict[str, Any]]:
    """Every call recorded so far, in order: ``{"env": {...}, "stdin": {...}}``."""
    out = []
    for env_path in sorted(
        glob.glob(os.path.join(DIR, "*.env")), key=lambda p: int(os.path.basename(p).split("-")[0])
    ):
        with open(env_path) as f:
            env = dict(line.rstrip("\n").split("=", 1) for line in f if "=" in line)
        with open(env_path[: -len(".env")] + ".stdin") as f:
            out.append({"env": env, "stdin": json.load(f)})
    return out


def normalized(call: dict[str, Any], sandbox: str, uid: str, namespace: str) -> dict[str, Any]:
    """``call`` with the sandbox id, pod uid and namespace, the network namespace's path, MACs and
    addresses as placeholders, and ``CNI_ARGS``' items in order."""
    text = json.dumps(call, sort_keys=True)
    text = text.replace(sandbox, "<sandbox>").replace(uid, "<pod-uid>")
    # Wherever the item falls in CNI_ARGS, the last one included (no ';' after it).
    text = re.sub(
        rf"K8S_POD_NAMESPACE={re.escape(namespace)}(?=[;\"])", "K8S_POD_NAMESPACE=<namespace>", text
    )
    text = re.sub(r"/var/run/netns/cni-[0-9a-f-]+", "<netns>", text)
    text = re.sub(r'"([0-9a-f]{2}:){5}[0-9a-f]{2}"', '"<mac>"', text)
    text = re.sub(r'("address": )"[0-9.]+/\d+"', r'\1"<address>"', text)
    out = dict(json.loads(text))
    # containerd's CNI_ARGS come from a map (their order varies), and the thin plugin passes
    # them on after its own: the items sorted, repeats kept.
    out["env"]["CNI_ARGS"] = ";".join(sorted(out["env"]["CNI_ARGS"].split(";")))
    return out
