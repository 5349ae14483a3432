"""`make cnitool`: one pinned release, built by the project's own module, cached outside the tree."""

from __future__ import annotations

import re
import subprocess

from tests.support import cnitool

GOBUILD = cnitool.ROOT / "gobuild" / "cnitool"


def test_the_module_pins_the_release_the_makefile_names() -> None:
    """go.mod requires the cnitool version the Makefile's cache path is keyed by, and go.sum holds it."""
    version = cnitool.version()
    assert re.fullmatch(r"v\d+\.\d+\.\d+", version)
    mod = (GOBUILD / "go.mod").read_text()
    assert re.search(rf"^require github\.com/containernetworking/cni {re.escape(version)}\b", mod, re.M)
    assert "tool github.com/containernetworking/cni/cnitool" in mod
    assert f"github.com/containernetworking/cni {version} h1:" in (GOBUILD / "go.sum").read_text()
    assert cnitool.path() == f"/var/cache/rdma-cni-build/cnitool-{version}/cnitool"


def test_the_target_builds_with_go_1_26_into_the_cache() -> None:
    """Go 1.26 by its full path (Debian's Go 1.19 stays /usr/bin/go), stripped, reproducible paths."""
    recipe = subprocess.run(
        ["make", "-n", "-B", "--no-print-directory", cnitool.path()],
        cwd=cnitool.ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "/usr/local/go/bin/go build -trimpath -ldflags='-s -w'" in recipe
    assert "GOFLAGS=-mod=readonly" in recipe and "GOTOOLCHAIN=local" in recipe
    assert f"-o {cnitool.path()}.tmp" in recipe


def test_ci_builds_cnitool_before_the_tests() -> None:
    steps = [line.strip() for line in (cnitool.ROOT / ".ci" / "run").read_text().splitlines()]
    assert steps.index("make cnitool") < steps.index("make test")
