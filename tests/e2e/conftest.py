"""Fixtures for the QEMU end-to-end tier (``pytest -m e2e tests/e2e``).

The cache is built on first use (1.5-3 min, then about a second), so CI needs no separate
step; only a non-root run is skipped. Set ``RDMA_CNI_E2E_CACHE`` to put the cache
elsewhere than ``<repo>/.e2e-cache``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from guest import BootFn, FileSource, GuestError, GuestRun, boot

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

_RUNS = pytest.StashKey[list[GuestRun]]()


def _cache_dir() -> Path:
    return Path(os.environ.get("RDMA_CNI_E2E_CACHE") or REPO / ".e2e-cache").resolve()


@pytest.fixture(scope="session")
def e2e_cache() -> Path:
    """The prepared cache (trixie root, initramfs, cnirun), built if missing."""
    if os.geteuid() != 0:
        pytest.skip("the QEMU tier needs root (debootstrap, chroot, mount namespaces)")
    cache = _cache_dir()
    proc = subprocess.run(
        [str(HERE / "prepare.sh"), str(cache)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
    )
    # Kept for the record: the timings of the last preparation live there.
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "prepare.log").write_text(proc.stdout)
    if proc.returncode != 0:
        # A broken cache must fail the tier loudly, never skip it.
        pytest.fail(f"prepare.sh failed ({proc.returncode}):\n{proc.stdout}", pytrace=False)
    return cache


def _fresh_share(cache: Path, node: pytest.Item | pytest.Collector) -> Path:
    """An empty share directory named after a test or module, under the cache.

    Kept after the run for inspection; leftovers stay bounded by the number of tests
    and are ignored by git along with the cache.
    """
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", node.nodeid).strip("_")
    share = cache / "shares" / name
    shutil.rmtree(share, ignore_errors=True)
    share.mkdir(parents=True)
    return share


def _boot_fn(cache: Path, share: Path, node: pytest.Item | pytest.Collector) -> BootFn:
    """A boot() bound to one cache and share that remembers its runs on ``node``."""
    runs = node.stash.setdefault(_RUNS, [])

    def run(scenario: str, files: Mapping[str, FileSource] | None = None, timeout: float = 600.0) -> GuestRun:
        result = boot(cache, share, scenario, files=files, timeout=timeout)
        runs.append(result)
        return result

    return run


@pytest.fixture
def e2e_share(request: pytest.FixtureRequest, e2e_cache: Path) -> Path:
    """A fresh share directory for this test (``shares/<test id>`` in the cache)."""
    return _fresh_share(e2e_cache, request.node)


@pytest.fixture
def e2e_boot(request: pytest.FixtureRequest, e2e_cache: Path, e2e_share: Path) -> BootFn:
    """``e2e_boot(scenario, files=None, timeout=600.0) -> GuestRun`` for this test.

    Every run is remembered so that a failing test reports the guest's console.
    """
    return _boot_fn(e2e_cache, e2e_share, request.node)


@pytest.fixture(scope="module")
def e2e_boot_module(request: pytest.FixtureRequest, e2e_cache: Path) -> BootFn:
    """Like ``e2e_boot`` with one share for a whole module (``shares/<module id>``).

    For modules that boot once in a module-scoped fixture and assert on the results
    in several tests: a boot costs about 20 s of both host cores.
    """
    return _boot_fn(e2e_cache, _fresh_share(e2e_cache, request.node), request.node)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Attach the console log of every guest the failed test booted."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when != "call" or not report.failed:
        return
    # GuestRun.check() already put the logs into the exception message.
    if call.excinfo is not None and call.excinfo.errisinstance(GuestError):
        return
    runs = list(item.stash.get(_RUNS, []))
    module = item.getparent(pytest.Module)
    if module is not None:
        runs = module.stash.get(_RUNS, []) + runs
    for n, run in enumerate(runs, start=1):
        report.sections.append((f"guest run {n}", run.describe()))
