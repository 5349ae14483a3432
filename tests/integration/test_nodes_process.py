"""``rdma-cni nodes`` as a process (the built binary when RDMA_CNI_BINARY is set) against the API stand-in."""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rdma_cni.shared import nodestate
from tests.integration.conftest import plugin_command
from tests.support import sched_objects as so
from tests.support.apiserver import ApiServer


@pytest.fixture
def api() -> Iterator[ApiServer]:
    with ApiServer() as server:
        server.add_node(
            "gpu-1",
            annotations={
                nodestate.ANNOTATION: nodestate.encode(
                    so.state([("ens1f0", 100_000, 8)], [("u1", [("ens1f0", 40_000, 0)])])
                )
            },
        )
        server.add_node("cpu-1")
        yield server


def nodes(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*plugin_command(), "nodes", *argv], capture_output=True, text=True, timeout=60)


def test_table_json_and_fits(api: ApiServer, tmp_path: Path) -> None:
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    table = nodes("--kubeconfig", kubeconfig, "--fits", '[{"min_tx_rate": 50000}]')
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["NODE", "STATE", "AGE", "PF", "FREE_MBPS", "FREE_VFS", "FITS"]
    assert lines[2].split()[:6] == ["gpu-1", "ok", lines[2].split()[2], "ens1f0", "60000/100000", "7/8"]
    assert lines[2].endswith("yes (score 9): ens1f0 x1")
    assert lines[1].split()[:2] == ["cpu-1", "missing"]

    as_json = nodes("--kubeconfig", kubeconfig, "--json", "--fits", '[{"min_tx_rate": 70000}]')
    assert as_json.returncode == 0, as_json.stderr
    doc = json.loads(as_json.stdout)
    assert doc["fitting_nodes"] == []
    assert doc["nodes"][1]["fits"]["reason"] == "rdma-cni: needs 70000 Mbit/s free on one PF with a free VF"


def test_bad_fits_exits_2_naming_the_option(api: ApiServer, tmp_path: Path) -> None:
    got = nodes("--kubeconfig", api.write_kubeconfig(tmp_path / "kubeconfig"), "--fits", '{"min_tx_rate": 1}')
    assert got.returncode == 2 and got.stdout == ""
    assert "argument --fits: --fits: expected a JSON list of interface objects" in got.stderr


PAGE = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def docs_example() -> tuple[str, str]:
    """The command and the output shown in docs/operations.md, "The cluster: nodes"."""
    section = PAGE.read_text().split("## The cluster: nodes", 1)[1].split("\n## ", 1)[0]
    block = section.split("```console\n", 1)[1].split("```", 1)[0]
    command, _, output = block.partition("\n")
    assert command.startswith("$ ")
    return command[2:], output


def test_docs_example_runs_as_written(tmp_path: Path) -> None:
    """The docs' command, run by a shell as written, prints the docs' table for the states it shows."""
    with ApiServer() as api:
        # Before the states are stamped: the printed ages can be no older than this allows.
        stamped = time.time()
        rdma1 = so.state(
            [("ens1f0", 100_000, 8), ("ens1f1", 100_000, 8)],
            [("u1", [("ens1f0", 40_000, 0), ("ens1f1", 40_000, 0)]), ("u2", [("ens1f0", 50_000, 0)])],
            age=30,
        )
        rdma2 = so.state([("ens2f0", 25_000, 4)], [("u3", [("ens2f0", 0, 0)])] * 4, age=40)
        rdma3 = so.state([("ens1f0", 100_000, 8)], age=4000)
        for name, state in (("rdma-1", rdma1), ("rdma-2", rdma2), ("rdma-3", rdma3)):
            api.add_node(name, annotations={nodestate.ANNOTATION: nodestate.encode(state)})
        api.add_node("cpu-1")
        (tmp_path / ".kube").mkdir()
        api.write_kubeconfig(tmp_path / ".kube" / "config", ca="data")
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        wrapper = bin_dir / "rdma-cni"
        wrapper.write_text("#!/bin/sh\nexec " + " ".join(f"'{p}'" for p in plugin_command()) + ' "$@"\n')
        wrapper.chmod(0o755)
        command, shown = docs_example()
        got = subprocess.run(
            ["bash", "-c", command],
            capture_output=True,
            text=True,
            timeout=60,
            env={"HOME": str(tmp_path), "PATH": f"{bin_dir}:/usr/bin:/bin"},
        )
        printed = time.time()
    assert got.returncode == 0, got.stderr
    # A fresh state's age is what was published plus the time since it was stamped, which a
    # loaded machine stretches: up to the measured time from stamping to the command's exit,
    # plus the second the stamp's truncation adds. Within that the docs' age is shown; an age
    # outside it (or a wrong one) stays and fails the comparison.
    slack = math.ceil(printed - stamped) + 1
    lines = got.stdout.splitlines(keepends=True)
    for i, line in enumerate(lines):
        for name, published in (("rdma-1", 30), ("rdma-2", 40)):
            m = re.match(rf"{name}\s+ok\s+(\d+)s ", line)
            if m and published <= int(m[1]) <= published + slack and len(m[1]) == len(str(published)):
                lines[i] = line[: m.start(1)] + str(published) + line[m.end(1) :]
    assert "".join(lines) == shown
