"""Minimal container images built offline: Debian's static busybox, and a glibc base for the plugin.

One layer: ``/bin/busybox`` and links for the applets the tier runs. For
containerd it is packaged as an OCI image layout archive (``ctr images
import``); podman imports the bare root filesystem tarball. :func:`glibc_base_tar`
stands in for ``debian:12-slim`` (conf/Containerfile's base, which the tier cannot
pull): the shared objects of the host's own packages that debian:12-slim has too (glibc, zlib,
libgcc, libstdc++), as the host installed them, and busybox.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
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


# Packages in debian:12-slim (dpkg's and apt's dependencies) whose shared objects the one-file
# binary may load from the system (its PyInstaller loader links zlib; glibc is never bundled),
# and what the DaemonSet's probes run (`test`; `sh` and `find`, which debian:12-slim has from dash
# and findutils, both Essential).
BASE_PACKAGES = ("libc6", "zlib1g", "libgcc-s1", "libstdc++6")
BASE_APPLETS = ("sh", "test", "cat", "ls", "sleep", "find")
BASE_DIRS = (
    "bin",
    "dev",
    "etc",
    "proc",
    "sys",
    "tmp",
    "run",
    "var",
    "var/cache",
    "usr",
    "usr/local",
    "usr/local/bin",
)


def _library_files() -> list[str]:
    """The shared objects of :data:`BASE_PACKAGES` on the host (no gconv modules), by their listed paths."""
    listed = subprocess.run(["dpkg", "-L", *BASE_PACKAGES], capture_output=True, text=True, check=True).stdout
    return [
        path
        for path in listed.splitlines()
        if path.startswith(("/lib", "/usr/lib"))
        and ".so" in os.path.basename(path)
        and "/gconv/" not in path
        and os.path.isfile(path)
    ]


def glibc_base_tar() -> bytes:
    """A Debian-like root without a registry: the base libraries (each file dereferenced, at the path
    its package lists), busybox with :data:`BASE_APPLETS`, ``/var/run -> /run`` as in Debian, root."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs = set(BASE_DIRS)
        files = sorted(set(_library_files()))
        for path in files:
            parent = os.path.dirname(path).lstrip("/")
            while parent:
                dirs.add(parent)
                parent = os.path.dirname(parent)
        for d in sorted(dirs):
            info = tarfile.TarInfo(d)
            info.type = tarfile.DIRTYPE
            info.mode = 0o1777 if d == "tmp" else 0o755
            tar.addfile(info)
        link = tarfile.TarInfo("var/run")
        link.type = tarfile.SYMTYPE
        link.linkname = "../run"
        tar.addfile(link)
        for path in files:
            with open(path, "rb") as f:
                _add(tar, path.lstrip("/"), f.read(), 0o755)
        with open(BUSYBOX, "rb") as f:
            _add(tar, "bin/busybox", f.read(), 0o755)
        for applet in BASE_APPLETS:
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type = tarfile.SYMTYPE
            info.linkname = "busybox"
            tar.addfile(info)
        _add(tar, "etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n")
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
