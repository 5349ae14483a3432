"""A minimal container image built offline from Debian's static busybox.

One layer: ``/bin/busybox`` and links for the applets the tier runs. For
containerd it is packaged as an OCI image layout archive (``ctr images
import``); podman imports the bare root filesystem tarball.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from typing import Any

BUSYBOX = "/bin/busybox"  # Debian's busybox-static
APPLETS = ("sh", "sleep", "ip", "cat", "ls")
DIRS = ("bin", "dev", "etc", "proc", "sys", "tmp", "run", "var")
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar"


def _add(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    tar.addfile(info, io.BytesIO(data))


def rootfs_tar() -> bytes:
    """The root filesystem as an uncompressed tar, reproducibly (fixed times, root-owned)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in DIRS:
            info = tarfile.TarInfo(d)
            info.type = tarfile.DIRTYPE
            info.mode = 0o1777 if d == "tmp" else 0o755
            tar.addfile(info)
        with open(BUSYBOX, "rb") as f:
            _add(tar, "bin/busybox", f.read(), 0o755)
        for applet in APPLETS:
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type = tarfile.SYMTYPE
            info.linkname = "busybox"
            tar.addfile(info)
        _add(tar, "etc/passwd", b"root:x:0:0:root:/:/bin/sh\n")
        _add(tar, "etc/group", b"root:x:0:\n")
    return buf.getvalue()


def _blob(tar: tarfile.TarFile, data: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    _add(tar, "blobs/sha256/" + digest.split(":", 1)[1], data)
    return digest


def _json(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def oci_archive(path: str, name: str, cmd: list[str]) -> None:
    """Write an OCI image layout tarball holding one image, named ``name`` for containerd."""
    layer = rootfs_tar()
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    config = _json(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Cmd": cmd, "Env": ["PATH=/bin"], "WorkingDir": "/"},
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        }
    )
    with tarfile.open(path, "w") as tar:
        layer_digest = _blob(tar, layer)
        config_digest = _blob(tar, config)
        manifest = _json(
            {
                "schemaVersion": 2,
                "mediaType": MEDIA_MANIFEST,
                "config": {"mediaType": MEDIA_CONFIG, "digest": config_digest, "size": len(config)},
                "layers": [{"mediaType": MEDIA_LAYER, "digest": layer_digest, "size": len(layer)}],
            }
        )
        manifest_digest = _blob(tar, manifest)
        index = {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": MEDIA_MANIFEST,
                    "digest": manifest_digest,
                    "size": len(manifest),
                    "annotations": {
                        "io.containerd.image.name": name,
                        "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1],
                    },
                    "platform": {"architecture": "amd64", "os": "linux"},
                }
            ],
        }
        _add(tar, "index.json", _json(index))
        _add(tar, "oci-layout", _json({"imageLayoutVersion": "1.0.0"}))
