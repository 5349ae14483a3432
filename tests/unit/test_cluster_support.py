"""The cluster tier's own machinery, without a cluster: the component build script and process start-up.

Each error path the tier relies on to fail loudly is reached here: a build
script that cannot read its pins or whose build fails, a warm cache that must
not build, a component that is missing, exits, or never gets ready.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.kube import controlplane
from tests.support.kube.process import ComponentFailed, start_component

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "build_components.sh"
NAMES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")


def _copy_tree(tmp: Path) -> Path:
    """The build script and our go.mod files in a tree of their own."""
    root = tmp / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, root / "scripts")
    for module in ("kube", "etcd"):
        (root / "gobuild" / module).mkdir(parents=True)
        shutil.copy(REPO / "gobuild" / module / "go.mod", root / "gobuild" / module)
    return root


def _run(root: Path, cache: Path, *args: str, go: str = "/bin/false") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RDMA_CNI_BUILD_CACHE": str(cache), "GO": go}
    return subprocess.run(
        ["bash", str(root / "scripts" / "build_components.sh"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _pinned(module: str, path: str) -> str:
    for line in (REPO / "gobuild" / module / "go.mod").read_text().splitlines():
        words = line.split("//")[0].replace("require", "").split()
        if len(words) == 2 and words[0] == path:
            return words[1]
    raise AssertionError(f"{path} is not pinned in gobuild/{module}/go.mod")


def test_list_names_every_component_at_its_pinned_version_without_building(tmp_path: Path) -> None:
    out = _run(REPO, tmp_path / "cache", "--list")
    assert out.returncode == 0, out.stderr
    lines = [line.split() for line in out.stdout.splitlines()]
    assert [name for name, _, _ in lines] == list(NAMES)
    kube, etcd = _pinned("kube", "k8s.io/kubernetes"), _pinned("etcd", "go.etcd.io/etcd/server/v3")
    assert kube.startswith("v1.37.") and etcd.startswith(("v3.6.", "v3.7."))
    for name, version, path in lines:
        assert version == (etcd if name == "etcd" else kube)
        assert path == str(tmp_path / "cache" / f"{name}-{version}" / name)
    assert not (tmp_path / "cache").exists()


def test_every_staging_module_is_pinned_to_the_kubernetes_release() -> None:
    text = (REPO / "gobuild" / "kube" / "go.mod").read_text()
    minor = _pinned("kube", "k8s.io/kubernetes").removeprefix("v1.")
    replaces = [line.split() for line in text.splitlines() if "=>" in line]
    assert len(replaces) > 25
    for left, _, right, version in replaces:
        assert left == right and left.startswith("k8s.io/") and version == f"v0.{minor}"


def test_a_warm_cache_builds_nothing(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    listed = _run(REPO, cache, "--list").stdout.split("\n")
    for line in filter(None, listed):
        path = Path(line.split()[2])
        path.parent.mkdir(parents=True)
        path.write_text("#!/bin/sh\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    # GO=/bin/false: any build would fail the run.
    out = _run(REPO, cache)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n") == listed


def test_a_failed_build_fails_and_leaves_nothing_that_looks_built(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    out = _run(REPO, cache)
    assert out.returncode == 1
    assert "build failed (kubernetes: 1, etcd: 1)" in out.stderr
    assert not [p for p in cache.rglob("*") if p.is_file()]


def test_unreadable_pins_fail_before_building(tmp_path: Path) -> None:
    root = _copy_tree(tmp_path)
    go_mod = root / "gobuild" / "kube" / "go.mod"
    go_mod.write_text("\n".join(x for x in go_mod.read_text().splitlines() if "k8s.io/kubernetes v" not in x))
    out = _run(root, tmp_path / "cache", "--list")
    assert out.returncode == 1 and "cannot read the pinned versions" in out.stderr


def test_a_missing_component_names_make_components(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RDMA_CNI_BUILD_CACHE", str(tmp_path))
    with pytest.raises(ComponentFailed, match=r"is not built .*run `make components`"):
        controlplane.binaries()


def test_a_component_that_exits_fails_with_its_log(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import sys; print('bad flag --nope'); sys.exit(3)"]
    with pytest.raises(ComponentFailed) as caught:
        start_component("broken", argv, str(tmp_path), lambda: False, timeout=30)
    assert "broken exited with 3 before it was ready" in str(caught.value)
    assert "bad flag --nope" in str(caught.value)


def test_a_component_never_ready_is_stopped_and_fails_with_its_log(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import time; print('waiting for etcd', flush=True); time.sleep(60)"]
    with pytest.raises(ComponentFailed) as caught:
        start_component("stuck", argv, str(tmp_path), lambda: False, timeout=1.5)
    assert "stuck was not ready after 2 s" in str(caught.value)
    assert "waiting for etcd" in str(caught.value)
