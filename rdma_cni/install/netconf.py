"""The optional network configuration written into the CNI conf directory (``--write-conf``)."""

from __future__ import annotations

import json
import os
from typing import Any, TextIO

from rdma_cni.cni.config import DEFAULT_NETWORK_NAME
from rdma_cni.install.common import DEFAULT_KUBECONFIG_PATH, InstallError, Options, say, write_bytes_atomic

# Extensions libcni loads from a conf directory; anything else is ignored silently.
_CONF_EXTENSIONS = (".conflist", ".conf", ".json")


def default_conflist(kubeconfig_path: str = DEFAULT_KUBECONFIG_PATH) -> dict[str, Any]:
    """The built-in conflist written by ``--write-conf`` without ``--conf-source``.

    Kept identical to conf/rdma-cni.conflist (a test checks it).
    """
    return {
        "cniVersion": "1.0.0",
        "name": DEFAULT_NETWORK_NAME,
        "plugins": [
            {
                "type": "rdma-cni",
                # containerd's CRI then passes the pod's annotations itself.
                "capabilities": {"io.kubernetes.cri.pod-annotations": True},
                "kubeconfig": kubeconfig_path,
                "annotation": "rdma_interfaces_required",
                "defaultRequest": [{}],
                "rdmaIsolation": "auto",
                "stateDir": "/var/lib/cni/rdma-cni",
                "lockFile": "/run/rdma-cni/rdma-cni.lock",
                "lockTimeoutSeconds": 60,
                "logFile": "/var/log/rdma-cni/rdma-cni.log",
                "logLevel": "info",
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": "192.168.128.0/20"}]],
                },
            }
        ],
    }


def _check_netconf(doc: Any, filename: str, origin: str) -> None:
    """Reject a configuration a runtime would refuse or ignore; the plugin itself validates the rest."""
    if not isinstance(doc, dict):
        raise InstallError(f"{origin}: not a JSON object")
    for key in ("cniVersion", "name"):
        if not isinstance(doc.get(key), str) or not doc[key]:
            raise InstallError(f"{origin}: {key} is missing")
    if filename.endswith(".conflist"):
        plugins = doc.get("plugins")
        if not isinstance(plugins, list) or not plugins:
            raise InstallError(f"{origin}: a .conflist needs a non-empty 'plugins' list")
        entries = plugins
    else:
        if "plugins" in doc:
            raise InstallError(f"{origin}: has 'plugins', so it must be written as a .conflist file")
        entries = [doc]
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("type"), str) or not entry["type"]:
            raise InstallError(f"{origin}: plugin entry {i} has no 'type'")


def write_conf(opts: Options, out: TextIO) -> str:
    """Write the ``--write-conf`` file; return "installed", "replaced" or "unchanged"."""
    filename = opts.write_conf or ""
    if not filename or "/" in filename or filename.startswith("."):
        raise InstallError(f"--write-conf takes a file name inside --cni-conf-dir, not {filename!r}")
    if not filename.endswith(_CONF_EXTENSIONS):
        raise InstallError(
            f"--write-conf {filename}: runtimes only load files ending in {', '.join(_CONF_EXTENSIONS)}"
        )
    if opts.conf_source:
        origin = opts.conf_source
        try:
            with open(opts.conf_source, "rb") as f:
                raw = f.read()
            doc = json.loads(raw)
        except OSError as exc:
            raise InstallError(f"cannot read --conf-source {origin}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise InstallError(f"--conf-source {origin} is not valid JSON: {exc}") from None
    else:
        origin = "the built-in default configuration"
        # The plugin insists on an absolute kubeconfig path.
        doc = default_conflist(os.path.abspath(opts.kubeconfig_path))
        raw = (json.dumps(doc, indent=2) + "\n").encode("utf-8")
    _check_netconf(doc, filename, origin)

    target = os.path.join(opts.cni_conf_dir, filename)
    status = "installed"
    if os.path.lexists(target):
        try:
            with open(target, "rb") as f:
                existing: Any = json.loads(f.read())
        except (OSError, ValueError):
            existing = None  # unreadable or not JSON: certainly different
        if existing == doc:
            return "unchanged"
        if not opts.force:
            raise InstallError(
                f"{target} exists with different content; refusing to overwrite it: "
                "remove it, or pass --force to replace it"
            )
        say(out, f"--force: replacing {target}")
        status = "replaced"
    write_bytes_atomic(target, raw, 0o644)
    return status
