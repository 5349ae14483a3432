"""`make demo` on a fresh machine: deps-check runs `make deps` exactly when a package is missing.

Run with ``make -n``: the sub-make still runs (its recipe line names $(MAKE)),
but only prints the commands it would run, so nothing is installed.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not shutil.which("dpkg-query"), reason="deps-check is for Debian: dpkg-query is not here"
)


def dry_run(*overrides: str) -> str:
    proc = subprocess.run(
        ["make", "-n", "--no-print-directory", "-C", str(ROOT), "deps-check", *overrides],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return proc.stdout


def test_missing_package_runs_make_deps() -> None:
    out = dry_run("DEMO_PACKAGES=coreutils rdma-cni-no-such-package")
    assert "deps-check: not installed: rdma-cni-no-such-package: running make deps" in out
    assert "apt-get update" in out and "install -y" in out
    assert "coreutils: running" not in out


def test_nothing_missing_installs_nothing() -> None:
    out = dry_run("DEMO_PACKAGES=coreutils dpkg")
    # -n prints the recipe itself too; what matters is that no install command follows it.
    assert "not installed: coreutils" not in out and "apt-get" not in out


def test_demo_checks_before_it_builds() -> None:
    out = subprocess.run(
        ["make", "-n", "--no-print-directory", "-C", str(ROOT), "demo", "DEMO_PACKAGES=coreutils"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert out.index("dpkg-query") < out.index("scripts/demo.py")
