"""``rdma-cni nodes`` as a process (the built binary when RDMA_CNI_BINARY is set) against the API stand-in."""

from __future__ import annotations

import json
import subprocess
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
