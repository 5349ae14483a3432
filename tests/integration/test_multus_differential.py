"""The extender's reading of Multus' annotations against Multus' own code (issue 29 item 1).

``gobuild/multusread`` calls Multus' ``k8sclient.GetPodNetwork`` (module
gopkg.in/k8snetworkplumbingwg/multus-cni.v4 at the tag in its go.mod); the
same hand-written and seeded fuzzed annotations go through
:mod:`rdma_cni.shared.multusnet`. For every case: ours selects what Multus
selects (namespace, name, interface, cni-args as the plugin will get them), or
ours refuses; when Multus errors, ours selects nothing or refuses.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from rdma_cni.shared.multusnet import MULTUS_VERSION
from tests.support import multusread

FUZZ_SEED = 29
FUZZ_COUNT = 600


@pytest.fixture(scope="module")
def go_sum_kept() -> bytes:
    """go.sum before the build: the build must leave the tree's go.sum as committed."""
    return (multusread.SOURCE / "go.sum").read_bytes()


@pytest.fixture(scope="module")
def program(go_sum_kept: bytes) -> Path:
    return multusread.binary()


def _check(cases: list[multusread.Case]) -> None:
    theirs = multusread.multus(cases)
    bad = []
    for case, answer in zip(cases, theirs, strict=True):
        problem = multusread.disagreement(case, multusread.ours(case), answer)
        if problem:
            bad.append(f"{case.networks!r:.160} / {case.default_network!r}: {problem:.400}")
    assert not bad, f"{len(bad)} of {len(cases)} cases differ from Multus:\n" + "\n".join(bad[:20])


def test_build_pins_the_multus_version_and_keeps_go_sum(program: Path, go_sum_kept: bytes) -> None:
    mod = (multusread.SOURCE / "go.mod").read_text()
    assert f"gopkg.in/k8snetworkplumbingwg/multus-cni.v4 {MULTUS_VERSION}" in mod
    assert (multusread.SOURCE / "go.sum").read_bytes() == go_sum_kept
    assert program.parent.name == f"multusread-{multusread.source_hash()}"
    assert hashlib.sha256(go_sum_kept).digest()  # committed, non-empty
    assert multusread.binary() == program  # a no-op when built


def test_hand_written_annotations_read_as_multus_reads_them(program: Path) -> None:
    _check(multusread.hand_cases())


def test_fuzzed_annotations_read_as_multus_reads_them(program: Path) -> None:
    cases = list(multusread.fuzz_cases(FUZZ_SEED, FUZZ_COUNT))
    _check(cases)
    theirs = multusread.multus(cases)
    # The fuzz reaches both sides of Multus: accepted and refused annotations, many of each.
    assert sum(a["networks"]["ok"] for a in theirs) > FUZZ_COUNT // 5
    assert sum(not a["networks"]["ok"] for a in theirs) > FUZZ_COUNT // 5


def test_the_issue_forms_are_counted_as_multus_attaches_them(program: Path) -> None:
    """Each form of the issue: Multus attaches rdma-a, and ours selects it too (or refuses)."""
    forms = [
        '[{"Name": "rdma-a", "CNI-ARGS": {"rdma_interfaces_required": "[{}]"}}]',
        '[{"name": "rdma-a", "cni-arg\u017f": {"rdma_interfaces_required": "[{}]"}}]',
        '[{"name": "other", "name": "rdma-a"}]',
        '[{"name": "rdma-a", "cni-args": {"a": 1}, "cni-args": {"rdma_interfaces_required": "[{}]"}}]',
        '[{"name": "rdma-a"}]' + " " * (70 * 1024),
        '[{"name": "rdma-a", "x": ' + "[" * 3000 + "]" * 3000 + "}]",
    ]
    cases = [multusread.Case(f) for f in forms] + [multusread.Case(None, "rdma-a")]
    theirs = multusread.multus(cases)
    for case, answer in zip(cases, theirs, strict=True):
        key = "networks" if case.networks is not None else "default_network"
        assert answer[key]["ok"] and [s["name"] for s in answer[key]["selections"]] == ["rdma-a"]
        mine = multusread.ours(case)[key]
        assert "refuses" in mine or [s["name"] for s in mine["selections"]] == ["rdma-a"], mine
