"""Multus installed the way its quick start does: its own thick-plugin manifest, applied with kubectl.

The manifest is read from the Multus module the node's build pins (gobuild/multus/go.mod;
nothing of it is kept here), and only its image is changed: to the image made from the
binaries built from that module, in the layout Multus' own thick image has
(tests/support/node/images.py). Its DaemonSet then does on the node what it does anywhere:
``install_multus`` copies ``multus-shim`` and ``passthru`` into ``/opt/cni/bin``, and
``multus-daemon`` writes ``/etc/cni/net.d/00-multus.conf`` from the node's first network
configuration (the default network) and serves the shim on ``/run/multus``, running delegates
chrooted into the host's root (``chrootDir: /hostroot``), where ``/opt/cni/bin/rdma-cni`` is
the shim rdma-cni's agent installed.
"""

from __future__ import annotations

import os
import subprocess
from typing import Any

import yaml

from tests.support.kube.controlplane import REPO

MODULE = "gopkg.in/k8snetworkplumbingwg/multus-cni.v4"
THICK_MANIFEST = "deployments/multus-daemonset-thick.yml"
THIN_MANIFEST = "deployments/multus-daemonset.yml"
UPSTREAM_IMAGE = "ghcr.io/k8snetworkplumbingwg/multus-cni:snapshot-thick"
UPSTREAM_THIN_IMAGE = "ghcr.io/k8snetworkplumbingwg/multus-cni:snapshot"


def module_dir(go: str = "/usr/local/go/bin/go") -> str:
    """Where the Go module cache holds the pinned Multus module (downloaded by its build)."""
    out = subprocess.run(
        [go, "list", "-m", "-f", "{{.Dir}}", MODULE],
        cwd=os.path.join(REPO, "gobuild", "multus"),
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "GOFLAGS": "-mod=readonly", "GOTOOLCHAIN": "local"},
    ).stdout.strip()
    assert out and os.path.isdir(out), f"the {MODULE} module is not in the module cache: make node-components"
    return out


def thick_manifest(image: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Multus' thick-plugin manifest with ``image`` for its own; returns the documents and
    every image reference replaced (the test checks there was nothing else to change)."""
    return manifest(THICK_MANIFEST, image)


def thin_manifest(image: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Multus' thin-plugin manifest (``multus`` itself the node's CNI plugin, no daemon) with
    ``image`` for its own; as :func:`thick_manifest`."""
    return manifest(THIN_MANIFEST, image)


def manifest(name: str, image: str) -> tuple[list[dict[str, Any]], list[str]]:
    """One of Multus' deployment manifests with ``image`` for every container's."""
    with open(os.path.join(module_dir(), name)) as f:
        docs = [doc for doc in yaml.safe_load_all(f) if doc]
    replaced = []
    for doc in docs:
        if doc.get("kind") != "DaemonSet":
            continue
        spec = doc["spec"]["template"]["spec"]
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            replaced.append(container["image"])
            container["image"] = image
    return docs, replaced
