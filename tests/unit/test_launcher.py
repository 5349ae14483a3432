"""The single-file launcher (launcher/launcher.c + scripts/pack_launcher.py) around the built binary.

Runs against the executable named by RDMA_CNI_BINARY (``make test`` sets it to
dist/rdma-cni); each test uses its own cache directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.processes import cache_id

BINARY = os.environ.get("RDMA_CNI_BINARY")
pytestmark = pytest.mark.skipif(not BINARY, reason="RDMA_CNI_BINARY is not set (make test sets it)")


def version(binary: str, cache: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ["PATH"], "CNI_COMMAND": "VERSION", "RDMA_CNI_CACHE_DIR": str(cache), **extra}
    return subprocess.run(
        [binary], input='{"cniVersion": "1.0.0"}', env=env, capture_output=True, text=True, check=False
    )


def test_first_start_unpacks_later_starts_reuse(tmp_path: Path) -> None:
    assert BINARY
    cache = tmp_path / "cache"
    first = version(BINARY, cache)
    assert first.returncode == 0 and json.loads(first.stdout)["cniVersion"] == "1.0.0", first.stderr
    tree = cache / cache_id(BINARY)
    assert (tree / ".complete").exists() and (tree / "rdma-cni").exists()
    assert oct(cache.stat().st_mode & 0o777) == "0o700"
    stamp = (tree / ".complete").stat().st_mtime_ns
    again = version(BINARY, cache)
    assert again.returncode == 0
    assert (tree / ".complete").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in cache.iterdir()) == [tree.name]


def test_concurrent_first_starts_settle_on_one_tree(tmp_path: Path) -> None:
    assert BINARY
    cache = tmp_path / "cache"
    with ThreadPoolExecutor(max_workers=8) as pool:
        runs = list(pool.map(lambda _: version(BINARY, cache), range(8)))
    assert all(r.returncode == 0 and json.loads(r.stdout)["supportedVersions"] for r in runs), [
        r.stderr for r in runs
    ]
    assert sorted(p.name for p in cache.iterdir()) == [cache_id(BINARY)]


def test_unsafe_cache_directory_is_refused_with_a_cni_error(tmp_path: Path) -> None:
    assert BINARY
    cache = tmp_path / "shared"
    cache.mkdir(mode=0o777)
    os.chmod(cache, 0o777)
    out = version(BINARY, cache)
    assert out.returncode == 1
    doc = json.loads(out.stdout)
    assert doc["code"] == 5 and "writable by no one else" in doc["msg"]
    assert list(cache.iterdir()) == []


def test_damaged_payload_is_refused(tmp_path: Path) -> None:
    assert BINARY
    broken = tmp_path / "rdma-cni"
    shutil.copy(BINARY, broken)
    with open(broken, "r+b") as f:
        f.seek(-40, os.SEEK_END)
        f.write(b"XXXXXXXX")  # the magic
    out = version(str(broken), tmp_path / "cache")
    assert out.returncode == 1 and "no embedded payload" in json.loads(out.stdout)["msg"]
    # A trailer pointing at garbage entries must not write outside the cache either.
    shutil.copy(BINARY, broken)
    size = broken.stat().st_size
    with open(broken, "r+b") as f:
        f.seek(-40, os.SEEK_END)
        trailer = f.read()
        f.seek(-40, os.SEEK_END)
        f.write(trailer[:8] + struct.pack("<QQ", size - 100, 3) + b"0123456789abcdef")
    out = version(str(broken), tmp_path / "cache2")
    msg = json.loads(out.stdout)["msg"]
    assert out.returncode == 1 and ("damaged" in msg or "unsafe path" in msg), out.stdout
    assert list((tmp_path / "cache2").iterdir()) == [], "a failed unpack must not leave its temporary tree"


def test_install_copies_the_launcher_not_the_unpacked_program(tmp_path: Path) -> None:
    assert BINARY
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("tok")
    (sa / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    bindir, confdir = tmp_path / "bin", tmp_path / "net.d"
    bindir.mkdir()
    confdir.mkdir()
    env = {
        "PATH": os.environ["PATH"],
        "RDMA_CNI_CACHE_DIR": str(tmp_path / "cache"),
        "KUBERNETES_SERVICE_HOST": "10.0.0.1",
        "KUBERNETES_SERVICE_PORT": "443",
    }
    out = subprocess.run(
        [
            BINARY,
            "install",
            "--once",
            "--cni-bin-dir",
            str(bindir),
            "--serviceaccount-dir",
            str(sa),
            "--kubeconfig-path",
            str(confdir / "kubeconfig"),
        ],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr + out.stdout

    def digest(path: str | Path) -> str:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()

    assert digest(bindir / "rdma-cni") == digest(BINARY)


def in_read_only_root(script: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` as root in a mount namespace of its own where /var/cache is an empty read-only
    filesystem and /tmp a fresh writable one: a container's read-only root, as the DaemonSet runs.

    The fresh /tmp hides whatever was under it, the checkout too when it was cloned there: the
    binary is opened before the mount and copied into the new /tmp, and ``script`` runs it as
    ``"$BIN"`` (the same bytes: the same cache id).
    """
    setup = (
        'mount --make-rprivate / && exec 3<"$RIG_BINARY" && mount -t tmpfs -o ro none /var/cache'
        " && mount -t tmpfs none /tmp && mkdir /tmp/.rig && cat <&3 >/tmp/.rig/rdma-cni && exec 3<&-"
        " && chmod 0755 /tmp/.rig/rdma-cni && BIN=/tmp/.rig/rdma-cni"
    )
    return subprocess.run(
        ["unshare", "--mount", "sh", "-euc", f"{setup}\n{script}"],
        env={"PATH": os.environ["PATH"], "RIG_BINARY": str(BINARY)},
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="root: the default cache and a mount namespace")
def test_root_on_a_read_only_root_unpacks_into_tmp() -> None:
    """root's default cache, /var/cache/rdma-cni, cannot be made on a read-only root: /tmp/rdma-cni-0 is."""
    assert BINARY
    got = in_read_only_root('"$BIN" --version\nls /tmp/rdma-cni-0\nstat -c %a /tmp/rdma-cni-0')
    assert got.returncode == 0, got.stderr
    assert got.stdout.split()[-2:] == [cache_id(BINARY), "700"], got.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="root: a mount namespace")
def test_an_explicit_cache_on_a_read_only_filesystem_is_not_replaced() -> None:
    """RDMA_CNI_CACHE_DIR is the operator's choice: an unusable one fails, naming the cause."""
    assert BINARY
    got = in_read_only_root('RDMA_CNI_CACHE_DIR=/var/cache/mine "$BIN" --version')
    assert got.returncode == 1
    assert "cannot create the cache directory: Read-only file system" in got.stderr, got.stderr
