"""Hostile pods, annotation forms: no pod attached by Multus that the extender did not count (issue 29).

Seeded annotation variants (Go's key folding, repeated keys and cni-args,
deep nesting, padding past 64 KiB, comma forms, type errors, the default
network) go through Multus' own code (``gobuild/multusread``, Multus'
``GetPodNetwork``) and through the extender's :class:`Demands`. For each pod,
either the extender refuses it on every node, or its demand lists every
rdma-cni attachment Multus will make, in Multus' order, each with the number
of interfaces ADD will allocate for it (ADD reads the cni-args Multus passes
it; a request ADD refuses is one the extender refuses too).
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

from rdma_cni.cni.errors import InvalidPodRequest
from rdma_cni.extender.demand import Demands
from rdma_cni.shared.attachments import attachment_request
from rdma_cni.shared.podrequest import PodRequest, parse_request
from tests.faults.knobs import SEED, STATS, scaled
from tests.support import multusread
from tests.support import sched_objects as so

FAMILY = "hostile pods"
NETWORKS = frozenset({"rdma-a", "team-a/rdma-b"})
DEFAULT = parse_request("[{}]", "--default-request")
POD_WIDE = '[{"min_tx_rate": 100}, {}]'


def _ours(sel: dict[str, Any]) -> bool:
    name, namespace = sel["name"], sel["namespace"]
    return name == "rdma-a" or (name == "rdma-b" and namespace == "team-a")


def _multus_attaches(answer: dict[str, Any]) -> list[tuple[str, dict[str, Any] | None]] | None:
    """(network, cni-args) of each rdma-cni attachment Multus makes; None when it fails the pod."""
    parts = [answer["default_network"], answer["networks"]]
    if any(p is not None and not p["ok"] for p in parts):
        return None
    return [(s["name"], s["cni_args"]) for p in parts if p is not None for s in p["selections"] if _ours(s)]


def _add_counts(
    attached: list[tuple[str, dict[str, Any] | None]], pod_wide: str | None
) -> list[tuple[str, int]]:
    """Interfaces each ADD allocates, read from what Multus passes it; InvalidPodRequest when ADD refuses."""
    out = []
    for network, args in attached:
        request, _ = attachment_request(
            args, "args.cni", lambda: (pod_wide, "annotation") if pod_wide else (None, "default"), DEFAULT
        )
        assert isinstance(request, PodRequest)
        out.append((network, len(request.interfaces)))
    return out


def _case_annotations(case: multusread.Case, pod_wide: str | None) -> dict[str, str]:
    annotations = {}
    if case.networks is not None:
        annotations["k8s.v1.cni.cncf.io/networks"] = case.networks
    if case.default_network is not None:
        annotations["v1.multus-cni.io/default-network"] = case.default_network
    if pod_wide is not None:
        annotations["rdma_interfaces_required"] = pod_wide
    return annotations


def test_no_pod_attached_by_multus_that_the_extender_did_not_count() -> None:
    stats = STATS.setdefault(FAMILY, Counter())
    rng = random.Random(f"{SEED}:annotations")
    cases = multusread.hand_cases() + list(multusread.fuzz_cases(rng.randrange(1 << 32), scaled(800)))
    answers = multusread.multus(cases)
    demands = Demands(annotation="rdma_interfaces_required", networks=NETWORKS, default_request=DEFAULT)
    problems: list[str] = []
    refused = attached_pods = 0
    for index, (case, answer) in enumerate(zip(cases, answers, strict=True)):
        pod_wide = POD_WIDE if rng.random() < 0.3 else None
        stats["inputs"] += 1
        attached = _multus_attaches(answer)
        try:
            demand = demands.of_pod(so.pod(f"p{index}", _case_annotations(case, pod_wide)))
        except InvalidPodRequest:
            refused += 1
            continue  # refused on every node: never bound, never attached
        if not attached:
            continue  # Multus attaches no rdma-cni network: counting it or not is safe
        attached_pods += 1
        try:
            want = _add_counts(attached, pod_wide)
        except InvalidPodRequest:
            want = None  # every ADD would refuse it; the extender must have refused it too
        got = list(demand.networks) if demand is not None else []
        if want is None or got != want:
            problems.append(
                f"{case.networks!r:.120} / {case.default_network!r}: Multus {want}, extender {got}"
            )
    stats["cycles"] += 1
    stats["violations"] += len(problems)
    assert attached_pods > len(cases) // 20 and refused > 0  # both paths are exercised
    assert not problems, f"{len(problems)} pods attached by Multus but not counted:\n" + "\n".join(
        problems[:20]
    )
