"""Key protocol checks against the built executable named by ``RDMA_CNI_BINARY``.

The Makefile's CI target sets ``RDMA_CNI_BINARY=dist/rdma-cni`` (the
PyInstaller build), so these tests prove the shipped binary works: that it
starts, speaks the protocol, and carries the modules config verbs need. Without
the variable they are skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from rdma_cni import __version__
from tests.support.coldstart import AGENT_ONLY, LONG_RUNNING_ONLY, loaded_from, traced_modules
from tests.support.simnode import add_netns, del_netns

SUPPORTED = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]
BINARY_ENV = "RDMA_CNI_BINARY"

pytestmark = pytest.mark.skipif(
    not os.environ.get(BINARY_ENV),
    reason=f"{BINARY_ENV} is not set: these tests run the built executable (make test sets it to "
    "dist/rdma-cni)",
)


@pytest.fixture(scope="module")
def binary() -> str:
    path = os.environ[BINARY_ENV]
    assert os.path.isfile(path) and os.access(path, os.X_OK), f"{BINARY_ENV}={path} is not an executable file"
    return os.path.abspath(path)


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    empty = tmp_path / "sys"
    empty.mkdir()
    return empty


def run(
    binary: str, sysfs: Path, *args: str, stdin: bytes = b"", **cni: str
) -> subprocess.CompletedProcess[bytes]:
    """Run the binary with a clean environment: only PATH, the fake sysfs root, and ``cni``."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "RDMA_CNI_SYSFS_ROOT": str(sysfs), **cni}
    return subprocess.run([binary, *args], input=stdin, capture_output=True, env=env, timeout=60, check=False)


def one_document(proc: subprocess.CompletedProcess[bytes]) -> dict[str, Any]:
    """stdout is exactly one JSON object on one line."""
    text = proc.stdout.decode()
    doc, end = json.JSONDecoder().raw_decode(text)
    assert text[end:] == "\n", text
    assert isinstance(doc, dict)
    return doc


def error(proc: subprocess.CompletedProcess[bytes], code: int) -> dict[str, Any]:
    assert proc.returncode != 0, proc
    doc = one_document(proc)
    assert set(doc) == {"cniVersion", "code", "msg", "details"}, doc
    assert doc["code"] == code, doc
    assert proc.stderr, "diagnostics belong on stderr"
    return doc


def conf(tmp_path: Path, **extra: Any) -> bytes:
    doc = {
        "cniVersion": "1.1.0",
        "name": "rdma-net",
        "type": "rdma-cni",
        "stateDir": str(tmp_path / "state"),
        "lockFile": str(tmp_path / "lock" / "rdma-cni.lock"),
        **extra,
    }
    return json.dumps(doc).encode()


DEL_ENV = {"CNI_COMMAND": "DEL", "CNI_CONTAINERID": "0a1b2c3d", "CNI_IFNAME": "net1"}


# Each start of a one-file build unpacks it (most of a second): keep the runs few;
# the unit tier covers the protocol in depth.


def test_version(binary: str, sysfs: Path) -> None:
    version = "0.4.0"  # the answer echoes the input's version, not the latest
    proc = run(binary, sysfs, stdin=json.dumps({"cniVersion": version}).encode(), CNI_COMMAND="VERSION")
    assert proc.returncode == 0, proc.stderr
    assert one_document(proc) == {"cniVersion": version, "supportedVersions": SUPPORTED}
    assert proc.stderr == b""


def test_version_answers_libcnis_probe(binary: str, sysfs: Path) -> None:
    """libcni's GetVersionInfo, exactly: podman drops the network unless this succeeds."""
    probe = {"CNI_COMMAND": "VERSION", "CNI_NETNS": "dummy", "CNI_IFNAME": "dummy", "CNI_PATH": "dummy"}
    proc = run(binary, sysfs, stdin=b'{"cniVersion": "1.0.0"}', **probe)
    assert proc.returncode == 0, proc.stderr
    assert one_document(proc) == {"cniVersion": "1.0.0", "supportedVersions": SUPPORTED}


def test_environment_error_answers_in_the_config_version(binary: str, sysfs: Path, tmp_path: Path) -> None:
    doc = error(run(binary, sysfs, stdin=json.dumps({"cniVersion": "1.0.0"}).encode(), CNI_COMMAND="ADD"), 4)
    assert doc["cniVersion"] == "1.0.0"
    assert "CNI_CONTAINERID" in doc["msg"]


def test_config_error_is_code_7(binary: str, sysfs: Path, tmp_path: Path) -> None:
    doc = error(run(binary, sysfs, stdin=conf(tmp_path, vlan=5000), **DEL_ENV), 7)
    assert "vlan" in doc["msg"]


def test_bad_version_is_code_1(binary: str, sysfs: Path, tmp_path: Path) -> None:
    doc = error(run(binary, sysfs, stdin=conf(tmp_path, cniVersion="0.2.0"), **DEL_ENV), 1)
    assert all(v in doc["msg"] for v in SUPPORTED)


def test_non_json_stdin_is_code_6(binary: str, sysfs: Path) -> None:
    error(run(binary, sysfs, stdin=b"this is not json", **DEL_ENV), 6)


def test_del_without_record_succeeds(binary: str, sysfs: Path, tmp_path: Path) -> None:
    """Exercises the config model, the lock and the record store inside the binary."""
    for _ in range(2):
        proc = run(binary, sysfs, stdin=conf(tmp_path, cniVersion="0.4.0"), **DEL_ENV)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == b""


def test_status_without_pfs_is_code_50(binary: str, sysfs: Path, tmp_path: Path) -> None:
    doc = error(run(binary, sysfs, stdin=conf(tmp_path), CNI_COMMAND="STATUS"), 50)
    assert "no SR-IOV PF" in doc["msg"]


def test_version_flag(binary: str, sysfs: Path) -> None:
    proc = run(binary, sysfs, "--version")
    assert proc.returncode == 0
    assert proc.stdout.decode() == f"rdma-cni {__version__}\n"


def test_help(binary: str, sysfs: Path) -> None:
    proc = run(binary, sysfs, "--help")
    assert proc.returncode == 0
    text = proc.stdout.decode()
    assert "CNI_COMMAND" in text and "inventory" in text and "rdma-cni nodes [--fits JSON]" in text


def test_unknown_subcommand_exits_2(binary: str, sysfs: Path) -> None:
    proc = run(binary, sysfs, "frobnicate")
    assert proc.returncode == 2
    assert proc.stdout == b""
    assert b"frobnicate" in proc.stderr


@pytest.mark.parametrize("lock_file", ["/proc/rdma-cni-test.lock", "DIR", "FIFO"])
def test_lock_file_that_cannot_be_locked_is_code_5_at_once(
    binary: str, sysfs: Path, tmp_path: Path, lock_file: str
) -> None:
    if lock_file == "DIR":
        lock_file = str(tmp_path)
    elif lock_file == "FIFO":
        lock_file = str(tmp_path / "fifo")
        os.mkfifo(lock_file)
    started = time.monotonic()
    proc = run(binary, sysfs, stdin=conf(tmp_path, lockFile=lock_file, lockTimeoutSeconds=30), **DEL_ENV)
    elapsed = time.monotonic() - started
    doc = error(proc, 5)
    assert lock_file in doc["msg"]
    assert elapsed < 10  # not the 30 s lock timeout


def test_oversized_config_is_refused_quickly_naming_the_limit(
    binary: str, sysfs: Path, tmp_path: Path
) -> None:
    # 10 MB of unknown keys: refused by size, without parsing it.
    doc = json.loads(conf(tmp_path))
    doc.update({f"unknown{i}": 0 for i in range(800_000)})
    started = time.monotonic()
    proc = run(binary, sysfs, stdin=json.dumps(doc).encode(), **DEL_ENV)
    assert time.monotonic() - started < 10
    assert "1048576 bytes" in error(proc, 7)["msg"]


def test_many_unknown_keys_under_the_limit_cost_little(binary: str, sysfs: Path, tmp_path: Path) -> None:
    doc = json.loads(conf(tmp_path))
    doc.update({f"x-custom-key-{i}": i for i in range(30_000)})
    raw = json.dumps(doc).encode()
    assert len(raw) < 1 << 20
    started = time.monotonic()
    proc = run(binary, sysfs, stdin=raw, **DEL_ENV)
    assert proc.returncode == 0, proc.stdout
    assert time.monotonic() - started < 10


# ---------------------------------------------------------------------------
# What a cold start of the built binary loads (docs/architecture.md), seen from
# outside: every compiled module the process opens, through strace. The tree
# keeps plain .pyc files (build.spec: noarchive), so each import is one open.

# A cold VERSION loads the plugin's entry point and nothing of what
# PyInstaller's runtime hooks used to import (build.spec drops them; inspect
# stays, dataclasses imports it).
NOT_AT_START = ("zipfile", "pkgutil", "multiprocessing", "pydantic", "pyroute2", "prometheus_client")
# A config verb loads pydantic but not importlib.metadata and what it brings,
# nor the other modules rdma_cni.launch.startup defers (secrets and hashlib for
# pydantic.types, multiprocessing for pyroute2.config), nor PyInstaller's
# hooks' zipfile (pkgutil, which pyroute2 imports itself, may load).
NOT_IN_CONFIG_VERBS = (
    "importlib.metadata",
    "email",
    "zipfile",
    "secrets",
    "hashlib",
    "multiprocessing",
    "difflib",  # only a config with an unknown key needs it (rdma_cni.cni.config.suggest_field)
)


def modules_loaded(binary: str, sysfs: Path, tmp_path: Path, stdin: bytes, **cni: str) -> set[str]:
    """Run one cold start under strace; the module names of the .pyc files it opened from its tree."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "RDMA_CNI_SYSFS_ROOT": str(sysfs),
        "RDMA_CNI_WARM": "0",
        **cni,
    }
    return traced_modules([binary], stdin, env, str(tmp_path / "openat.trace"))


def test_cold_version_loads_no_runtime_hook_modules(binary: str, sysfs: Path, tmp_path: Path) -> None:
    modules = modules_loaded(binary, sysfs, tmp_path, b'{"cniVersion": "1.0.0"}', CNI_COMMAND="VERSION")
    assert "rdma_cni.cli.main" in modules  # the trace does see the plugin's imports
    assert loaded_from(modules, NOT_AT_START + AGENT_ONLY) == []


def test_cold_config_verb_does_not_load_importlib_metadata(binary: str, sysfs: Path, tmp_path: Path) -> None:
    # A DEL of a recorded VF asks the pod's namespace for the link at the
    # recorded index over netlink (so pyroute2 loads), and walks the namespace
    # for stray VFs: here a new, empty one of the test's own.
    from rdma_cni.node.record import Attachment, VfRecord

    name = f"cb{os.getpid()}"
    netns = add_netns(name)
    att = Attachment(DEL_ENV["CNI_CONTAINERID"], "net1", "rdma-net", netns, "1.1.0", state="ready")
    att.vfs.append(VfRecord("pf0", 0, "0000:3b:02.1", "vf0", "", 1500, "net1", pod_index=1))
    records = tmp_path / "state" / "attachments"
    records.mkdir(parents=True, mode=0o700)
    (tmp_path / "state").chmod(0o700)
    (records / "0a1b2c3d@net1.json").write_text(att.to_json())
    (records / "0a1b2c3d@net1.json").chmod(0o600)
    try:
        modules = modules_loaded(binary, sysfs, tmp_path, conf(tmp_path), **DEL_ENV, CNI_NETNS=netns)
    finally:
        del_netns(name)
    assert not (records / "0a1b2c3d@net1.json").exists()  # the DEL ran through
    assert {"rdma_cni.cni.config", "pydantic.types", "pyroute2.config"} <= modules
    assert loaded_from(modules, NOT_IN_CONFIG_VERBS + AGENT_ONLY + LONG_RUNNING_ONLY) == []


def test_the_tree_carries_the_agents_protobuf(binary: str) -> None:
    # The other half of AGENT_ONLY: what the agent's NRI plugin needs is packed (build.spec).
    internal = Path(os.path.realpath(binary)).parent / "rdma-cni-dir" / "_internal"
    if not internal.is_dir():
        pytest.skip(f"no one-dir tree next to {binary}")
    assert (internal / "rdma_cni" / "agent" / "nri" / "nri_api_pb2.pyc").is_file()
    assert (internal / "rdma_cni" / "agent" / "nri" / "ttrpc_pb2.pyc").is_file()
    assert (internal / "google" / "protobuf" / "message.pyc").is_file()
    assert list((internal / "google" / "_upb").glob("_message*.so"))
    # And what its DRA plugin needs (docs/dra.md): kubelet's messages and grpcio.
    assert (internal / "rdma_cni" / "agent" / "dra" / "dra_v1_pb2.pyc").is_file()
    assert (internal / "rdma_cni" / "agent" / "dra" / "registration_v1_pb2.pyc").is_file()
    assert list((internal / "grpc" / "_cython").glob("cygrpc*.so"))
