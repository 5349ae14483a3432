"""Every command in README.md and docs/*.md runs as written, or says why it cannot run here.

Each fenced shell block is either run here (from the repository, as root, with the built
binary; an ``sh`` block must exit 0 and a ``console`` block must print what it shows) or
carries a marker naming why not (``tests/support/docblocks.py`` lists them). A block that is
neither fails the test, so no command in the docs escapes silently.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.docblocks import MARKER_KINDS, ROOT, Block, all_blocks, console_steps

BLOCKS = all_blocks()
SHELL = [b for b in BLOCKS if b.is_shell]
# Run here: unmarked, in an empty directory, or when a tool they need is installed.
RUNNABLE = [b for b in SHELL if b.marker in (None, "run", "requires")]
BINARY = ROOT / "dist" / "rdma-cni"
DEMO_SETUP = "scripts/demo.py --setup-only"


def block_env() -> dict[str, str]:
    """The caller's environment, minus make's own variables (the blocks start make afresh)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    env.setdefault("HOME", "/root")
    return env


def run_shell(command: str, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-eu", "-o", "pipefail", "-c", command],
        cwd=cwd,
        env=block_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def missing_requirements(value: str) -> list[str]:
    """What a ``requires`` marker names that this machine lacks: commands on PATH, or absolute paths."""
    needs = value.split("(", 1)[0].split()
    return [n for n in needs if not (os.path.exists(n) if n.startswith("/") else shutil.which(n))]


def test_requirements_are_checked() -> None:
    assert missing_requirements("sh / (reason)") == []
    assert missing_requirements("no-such-tool-here /no/such/path (reason)") == [
        "no-such-tool-here",
        "/no/such/path",
    ]


def test_the_docs_have_shell_blocks() -> None:
    """A parser that found nothing would make every other test here pass for nothing."""
    assert len(SHELL) >= 20 and len(RUNNABLE) >= 5, [b.where for b in SHELL]


def test_every_shell_block_is_run_or_marked() -> None:
    """No shell block escapes: each runs here or carries a marker that says why not."""
    unexplained = [
        b.where
        for b in SHELL
        if b.marker is not None and (b.marker not in MARKER_KINDS - {"synopsis"} or not b.value)
    ]
    assert not unexplained, f"shell blocks with an unknown or empty marker: {unexplained}"
    accounted = {b.where for b in RUNNABLE} | {b.where for b in SHELL if b.marker in ("norun", "tested-by")}
    assert accounted == {b.where for b in SHELL}


def test_markers_sit_on_the_blocks_they_fit() -> None:
    """Only shell blocks are run or excused; a marker on a JSON or YAML block is a mistake."""
    misplaced = [b.where for b in BLOCKS if b.marker and not b.is_shell and b.marker != "synopsis"]
    assert not misplaced, misplaced
    runs = [b for b in SHELL if b.marker == "run"]
    assert all(b.value == "in an empty directory" for b in runs), [(b.where, b.value) for b in runs]


def test_tested_by_names_a_test_that_reads_the_page() -> None:
    for block in (b for b in SHELL if b.marker == "tested-by"):
        path, _, name = block.value.partition("::")
        source = ROOT / path
        assert source.is_file(), f"{block.where}: {path} does not exist"
        text = source.read_text()
        assert re.search(rf"^def {re.escape(name)}\(", text, re.M), f"{block.where}: no {name} in {path}"
        assert str(block.page.relative_to(ROOT)) in text, f"{block.where}: {path} does not read this page"


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.where)
def test_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    if not BINARY.exists():
        pytest.skip("needs dist/rdma-cni (make integration builds it)")
    if block.marker == "requires" and (missing := missing_requirements(block.value)):
        pytest.skip(f"{block.where} needs {', '.join(missing)}, not here ({block.value})")
    cwd = tmp_path if block.marker == "run" else ROOT
    try:
        if block.lang == "console":
            for command, shown in console_steps(block):
                got = run_shell(command, cwd)
                assert got.stdout.rstrip("\n") == shown, f"{block.where}: $ {command}\n{got.stderr}"
        else:
            got = run_shell(block.text, cwd)
            assert got.returncode == 0, f"{block.where} exited {got.returncode}:\n{got.stdout}\n{got.stderr}"
    finally:
        if DEMO_SETUP in block.text:  # a block that failed half-way leaves the simulated node up
            run_shell(".venv/bin/python scripts/demo.py --teardown", ROOT, timeout=120)


def readme_two_commands() -> list[str]:
    """The commands of the README's "Two commands" block, comments dropped."""
    section = (ROOT / "README.md").read_text().split("## Two commands", 1)[1]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]


def test_readme_two_commands() -> None:
    """README.md's two commands: ``make demo`` runs here; ``make test`` is the suite running this test."""
    demo, test = readme_two_commands()
    assert (demo, test) == ("make demo", "make test")
    if not BINARY.exists():
        pytest.skip("needs dist/rdma-cni (make integration builds it)")
    got = run_shell(demo, ROOT)
    assert got.returncode == 0, got.stdout + got.stderr
    assert "DEL" in got.stdout
    # make test is what CI runs (.ci/run), and it includes this test: check its recipe instead.
    recipe = run_shell("make -n --no-print-directory test", ROOT, timeout=120)
    assert "pytest" in recipe.stdout and "tests/unit tests/integration" in recipe.stdout
