"""The executable: copied into the CNI bin directory atomically, next to a marker of what was installed.

A runtime never executes a half-written file (the copy is renamed into
place), and a file this installer did not write is never clobbered without
``--force``: the marker keeps the hashes of what it wrote.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
from typing import BinaryIO, TextIO

from rdma_cni import __version__
from rdma_cni.install.common import InstallError, atomic_write, say, write_bytes_atomic

# Hashes of earlier installs kept in the marker: a crash between writing the
# marker and renaming the binary leaves the previous file in place, and it
# must still be recognised as ours on the next start.
_MARKER_HISTORY = 8
_CHUNK = 1 << 20


def sha256_file(path: str) -> str:
    """The hex SHA-256 of a file's contents."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def marker_path(bin_dir: str, name: str) -> str:
    """The sidecar file recording what this installer wrote as ``bin_dir/name``."""
    return os.path.join(bin_dir, f".{name}.installed")


def _read_marker(path: str, out: TextIO) -> list[str]:
    """Hashes of files this installer wrote, newest first; empty when there is no usable marker."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        say(out, f"ignoring unreadable install marker {path}: {exc.__class__.__name__}")
        return []
    if not isinstance(doc, dict):
        return []
    hashes = [doc.get("sha256"), *(doc.get("previous") or [])]
    return [h for h in hashes if isinstance(h, str) and re.fullmatch(r"[0-9a-f]{64}", h)]


def install_binary(source: str, bin_dir: str, name: str, *, force: bool, out: TextIO) -> str:
    """Copy ``source`` to ``bin_dir/name`` atomically; return "installed", "replaced" or "unchanged".

    An existing target is replaced only when it is a file this installer
    wrote (its hash is in the marker), already has the new content, or
    ``force`` is set. Raises :class:`InstallError` otherwise.
    """
    target = os.path.join(bin_dir, name)
    if not os.path.isfile(source):
        raise InstallError(f"source binary {source} does not exist or is not a regular file")
    try:
        new_sha = sha256_file(source)
    except OSError as exc:
        raise InstallError(f"cannot read source binary {source}: {exc.strerror or exc}") from None
    marker = marker_path(bin_dir, name)
    known = _read_marker(marker, out)

    status = "installed"
    if os.path.lexists(target):
        if os.path.isdir(target) and not os.path.islink(target):
            raise InstallError(f"{target} is a directory; remove it before installing")
        old_sha = sha256_file(target) if os.path.isfile(target) else None
        if old_sha == new_sha:
            # Same content: rewriting would only churn the inode under kubelet.
            _write_marker(marker, name, new_sha, known, source)
            return "unchanged"
        if old_sha not in known:
            if not force:
                raise InstallError(
                    f"{target} exists and was not installed by rdma-cni install "
                    f"(no matching sha256 in {marker}); refusing to overwrite it: "
                    "remove it, or pass --force to replace it"
                )
            say(out, f"--force: replacing {target}, which rdma-cni install did not write")
        status = "replaced"

    def copy(dst: BinaryIO) -> None:
        digest = hashlib.sha256()
        with open(source, "rb") as src:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                dst.write(chunk)
        if digest.hexdigest() != new_sha:
            raise InstallError(f"source binary {source} changed while it was being copied")

    os.makedirs(bin_dir, exist_ok=True)
    # Marker first: if we die before the rename, the old file is still listed in it.
    _write_marker(marker, name, new_sha, known, source)
    atomic_write(target, copy, 0o755)
    return status


def _write_marker(path: str, name: str, sha: str, known: list[str], source: str) -> None:
    if known and known[0] == sha:
        # Nothing new to record: leave the file alone rather than rewrite it on every start.
        return
    previous = [h for h in known if h != sha][:_MARKER_HISTORY]
    doc = {
        "name": name,
        "sha256": sha,
        "previous": previous,
        "version": __version__,
        "source": source,
        "installedAt": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    write_bytes_atomic(path, (json.dumps(doc, indent=2) + "\n").encode(), 0o644)
