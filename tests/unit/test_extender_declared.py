"""RDMA resources a pod declares (rdma-cni.io/bandwidth, rdma-cni.io/vf) are held to its demand."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from rdma_cni.cni.errors import InvalidPodRequest
from rdma_cni.extender.decide import Decider
from rdma_cni.extender.declared import BANDWIDTH, VFS, declared
from rdma_cni.extender.demand import Demands
from rdma_cni.extender.reservations import Reservations
from rdma_cni.extender.service import rebuild_reservations
from rdma_cni.extender.verbs import Extender
from rdma_cni.shared import nodestate
from tests.support import sched_objects as so

DEMANDS = Demands(annotation="rdma_interfaces_required")
WHO = "pod team-a/p"


def pod(rates: list[int] | None, *containers: dict[str, Any], init: dict[str, Any] | None = None) -> Any:
    """A pod asking for one interface per rate (no annotation when None), with these resources."""
    doc = so.pod("p") if rates is None else so.rdma_pod("p", [(r, 0) for r in rates])
    doc["spec"]["containers"] = [{"name": f"c{k}", "resources": r} for k, r in enumerate(containers)]
    if init is not None:
        doc["spec"]["initContainers"] = [{"name": "init", "resources": init}]
    return doc


def asks(bandwidth: Any, vfs: Any, *, limits_only: bool = False) -> dict[str, Any]:
    extended = {BANDWIDTH: bandwidth, VFS: vfs}
    return {"limits": extended} if limits_only else {"requests": {"cpu": "10m", **extended}}


def refused(doc: Any) -> str:
    with pytest.raises(InvalidPodRequest) as err:
        DEMANDS.of_pod(doc)
    return str(err.value.msg)


def test_a_pod_that_declares_nothing_is_judged_as_before() -> None:
    got = DEMANDS.of_pod(pod([25_000], {"requests": {"cpu": "1"}}))
    assert got is not None and got.min_total == 25_000
    assert DEMANDS.of_pod(pod(None, {})) is None


@pytest.mark.parametrize(
    "resources",
    [
        asks("25000", "2"),
        asks("25k", "2"),  # the API server writes 25000 back as 25k
        asks("25e3", 2),
        asks("25000", "2", limits_only=True),  # requests default to limits
    ],
)
def test_a_pod_that_declares_its_demand_exactly_passes(resources: dict[str, Any]) -> None:
    got = DEMANDS.of_pod(pod([20_000, 5_000], resources))
    assert got is not None and got.min_total == 25_000


def test_declarations_are_summed_over_containers() -> None:
    assert DEMANDS.of_pod(pod([20_000, 5_000], asks("20000", "1"), asks("5k", "1"))) is not None
    assert declared(pod([1], asks("1Ki", "1"), asks("1", "1")), WHO) == {BANDWIDTH: 1025, VFS: 2}


def test_declaring_less_or_more_bandwidth_than_the_interfaces_ask_is_refused() -> None:
    message = refused(pod([25_000], asks("5000", "1")))
    assert message == (
        f"pod team-a/p requests 5000 as {BANDWIDTH}, but its RDMA interfaces ask for 25000 (the sum of "
        f"their min_tx_rate): request exactly that, or neither {BANDWIDTH} nor {VFS}"
    )
    assert "requests 40000 as" in refused(pod([25_000], asks("40k", "1")))


def test_declaring_the_wrong_vf_count_or_one_resource_alone_is_refused() -> None:
    assert f"requests 1 as {VFS}, but its RDMA interfaces ask for 2 (one VF each)" in refused(
        pod([1, 1], asks("2", "1"))
    )
    assert f"does not request it as {VFS}" in refused(pod([1], {"requests": {BANDWIDTH: "1"}}))
    assert f"does not request it as {BANDWIDTH}" in refused(pod([1], {"requests": {VFS: "1"}}))


def test_declaring_on_a_pod_that_asks_no_rdma_interface_is_refused() -> None:
    assert refused(pod(None, asks("1", "1"))) == (
        f"pod team-a/p requests {BANDWIDTH}, {VFS} but asks for no RDMA interface"
    )


def test_init_containers_may_not_declare() -> None:
    message = refused(pod([1], asks("1", "1"), init={"requests": {VFS: "1"}}))
    assert message == f"pod team-a/p: initContainers may not request {VFS}; declare it in containers"


@pytest.mark.parametrize("value", ["fast", "1.5k", "-3", "500m", "", True, None, "9" * 40, "1e999", [1]])
def test_a_declared_value_that_is_no_whole_number_is_refused_bounded(value: Any) -> None:
    message = refused(pod([1], asks(value, "1")))
    assert message.startswith(f"pod team-a/p containers[0] resources {BANDWIDTH} is ")
    assert message.endswith(", not a whole number") and len(message) < 250


def test_filter_answers_the_refusal_once_and_preempt_keeps_no_node() -> None:
    extender = Extender(decider=Decider(), demands=DEMANDS, reservations=Reservations(60))
    extender.ready.set()
    liar = pod([25_000], asks("5000", "1"))
    answer = extender.filter(so.args_names(liar, ["n1", "n2"]))
    assert answer["Error"].startswith("rdma-cni: pod team-a/p requests 5000 as rdma-cni.io/bandwidth")
    assert not answer.get("NodeNames") and not answer.get("FailedNodes")
    victims = {"n1": {"Pods": [{"UID": "v"}], "NumPDBViolations": 0}}
    assert extender.preempt({"Pod": liar, "NodeNameToMetaVictims": victims}) == {"NodeNameToMetaVictims": {}}


def test_rebuild_reserves_for_a_bound_pod_whatever_it_declared() -> None:
    # Bound already: its ADD takes what the annotation asks, so that is what is held until published.
    bound = pod([10_000], asks("1", "1"))
    bound["spec"]["nodeName"] = "n1"
    decider = Decider()
    view = decider.view(nodestate.encode(so.state([("ens1f0", 25_000, 4)])))
    client = SimpleNamespace(list=lambda path, params: {"items": [json.loads(json.dumps(bound))]})
    reservations = Reservations(60)
    cache: Any = SimpleNamespace(views={"n1": view})
    assert rebuild_reservations(client, cache, DEMANDS, decider, reservations) == 1
    assert [r.use for r in reservations.all()] == [(("ens1f0", 1, 10_000),)]
