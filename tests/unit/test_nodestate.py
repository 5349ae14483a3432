"""The node-state annotation: encoding, strict decoding, the VF eligibility rule, placement's view."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rdma_cni.shared import nodestate, placement
from rdma_cni.shared.nodestate import Allocation, InterfaceUse, NodeState, NodeStateError, PfSummary


def _state(**over: Any) -> NodeState:
    base: dict[str, Any] = {
        "version": 1,
        "generation": 7,
        "updated": "2026-11-22T20:00:00Z",
        "pfs": (
            PfSummary(
                "ens1f0",
                capacity_tx_rate=100_000,
                used_tx_rate=25_000,
                capacity_vfs=8,
                used_vfs=2,
                numa_node=0,
            ),
            PfSummary(
                "ens1f1", capacity_tx_rate=None, used_tx_rate=0, capacity_vfs=4, used_vfs=0, numa_node=None
            ),
        ),
        "allocations": (
            Allocation(
                "team-a",
                "trainer-0",
                "uid-1",
                (InterfaceUse("ens1f0", 20_000, 40_000), InterfaceUse("ens1f0", 5_000, 0)),
            ),
        ),
    }
    base.update(over)
    return NodeState(**base)


def _doc() -> dict[str, Any]:
    return json.loads(nodestate.encode(_state()))


def test_encode_is_compact_sorted_and_round_trips() -> None:
    text = nodestate.encode(_state())
    assert " " not in text
    assert text.startswith('{"allocations":[{"interfaces":[{"max_tx_rate":40000')
    assert nodestate.decode(text) == _state()


def test_pf_summary_free_properties() -> None:
    pf = PfSummary(
        "p", capacity_tx_rate=10_000, used_tx_rate=12_000, capacity_vfs=4, used_vfs=5, numa_node=None
    )
    assert pf.free_vfs == 0 and pf.free_tx_rate == 0
    assert (
        PfSummary(
            "p", capacity_tx_rate=None, used_tx_rate=0, capacity_vfs=4, used_vfs=1, numa_node=None
        ).free_tx_rate
        is None
    )
    assert (
        PfSummary(
            "p", capacity_tx_rate=10_000, used_tx_rate=4_000, capacity_vfs=4, used_vfs=1, numa_node=None
        ).free_tx_rate
        == 6_000
    )


def test_unknown_keys_are_ignored_at_every_level() -> None:
    doc = _doc()
    doc["future"] = {"x": 1}
    doc["pfs"][0]["driver"] = "mlx5_core"
    doc["allocations"][0]["node"] = "n1"
    doc["allocations"][0]["interfaces"][0]["vf"] = 3
    assert nodestate.decode(json.dumps(doc)) == _state()


def test_numa_minus_one_means_none() -> None:
    doc = _doc()
    doc["pfs"][0]["numa_node"] = -1
    assert nodestate.decode(json.dumps(doc)).pfs[0].numa_node is None


def _mutate(path: str, value: Any) -> str:
    doc = _doc()
    target: Any = doc
    keys = path.split("/")
    for key in keys[:-1]:
        target = target[int(key)] if isinstance(target, list) else target[key]
    last: Any = int(keys[-1]) if isinstance(target, list) else keys[-1]
    if value is KeyError:
        del target[last]
    else:
        target[last] = value
    return json.dumps(doc)


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("version", 3, "node state version 3 is not supported"),
        ("version", "1", "node state.version: expected an integer"),
        ("generation", -1, "node state.generation: -1 is outside"),
        ("generation", KeyError, "node state: missing 'generation'"),
        ("updated", 5, "node state.updated: expected a string"),
        ("pfs", {}, "node state.pfs: expected a list"),
        ("pfs/0", [], "pfs[0]: expected an object"),
        ("pfs/0/name", "", "pfs[0].name: '' is not an interface name the kernel allows"),
        ("pfs/0/capacity_tx_rate", 1.5, "pfs[0].capacity_tx_rate: expected an integer or null"),
        ("pfs/0/capacity_tx_rate", 10_000_001, "pfs[0].capacity_tx_rate: 10000001 is outside 0..10000000"),
        ("pfs/0/used_vfs", True, "pfs[0].used_vfs: expected an integer"),
        ("pfs/0/capacity_vfs", 5000, "pfs[0].capacity_vfs: 5000 is outside 0..4096"),
        ("pfs/0/used_tx_rate", None, "pfs[0].used_tx_rate: expected an integer"),
        ("pfs/1/name", "ens1f0", "node state lists PF 'ens1f0' more than once"),
        ("allocations/0/uid", None, "allocations[0].uid: expected a string"),
        ("allocations/0/interfaces", "x", "allocations[0].interfaces: expected a list"),
        (
            "allocations/0/interfaces/0/pf",
            "ens9",
            "allocations[0].interfaces[0].pf: 'ens9' is not a listed PF",
        ),
        (
            "allocations/0/interfaces/1/min_tx_rate",
            -5,
            "allocations[0].interfaces[1].min_tx_rate: -5 is outside",
        ),
    ],
)
def test_decode_refuses_with_the_field_named(path: str, value: Any, message: str) -> None:
    with pytest.raises(NodeStateError, match="^" + re.escape(message)):
        nodestate.decode(_mutate(path, value))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "node state is not valid JSON"),
        ("[1]", "node state: expected an object"),
        ('"x"', "node state: expected an object"),
        ("[" * 100_000, "node state is not valid JSON"),
        (" " * (256 * 1024 + 1), "node state is 262145 characters, the limit is 262144"),
    ],
)
def test_decode_refuses_garbage(text: str, message: str) -> None:
    with pytest.raises(NodeStateError, match="^" + message):
        nodestate.decode(text)


def test_decode_refuses_non_string_and_too_many_entries() -> None:
    with pytest.raises(NodeStateError, match="must be a string, got bytes"):
        nodestate.decode(b"{}")  # type: ignore[arg-type]
    doc = _doc()
    doc["pfs"] = [dict(doc["pfs"][0], name=f"p{i}") for i in range(nodestate.MAX_PFS + 1)]
    doc["allocations"] = []
    with pytest.raises(NodeStateError, match=r"node state\.pfs: 257 entries, the limit is 256"):
        nodestate.decode(json.dumps(doc))


def test_same_content_ignores_generation_and_time_only() -> None:
    a = _state()
    assert nodestate.same_content(a, _state(generation=99, updated="2030-01-01T00:00:00Z"))
    assert not nodestate.same_content(a, _state(allocations=()))
    assert not nodestate.same_content(
        a,
        _state(
            pfs=(
                PfSummary(
                    "ens1f0",
                    capacity_tx_rate=100_000,
                    used_tx_rate=25_000,
                    capacity_vfs=8,
                    used_vfs=3,
                    numa_node=0,
                ),
            )
        ),
    )


@pytest.mark.parametrize(
    ("netdev", "userspace", "rdma", "isolation", "eligible"),
    [
        (True, False, False, "auto", True),
        (True, False, False, "off", True),
        (True, False, False, "required", False),
        (True, False, True, "required", True),
        (False, False, True, "auto", False),
        (True, True, True, "auto", False),
    ],
)
def test_eligible_vf(netdev: bool, userspace: bool, rdma: bool, isolation: str, eligible: bool) -> None:
    got = nodestate.eligible_vf(
        has_netdev=netdev, userspace_driver=userspace, has_rdma_device=rdma, isolation=isolation
    )
    assert got is eligible


def test_eligible_vf_refuses_an_unknown_policy() -> None:
    with pytest.raises(ValueError, match="unknown rdmaIsolation policy 'strict'"):
        nodestate.eligible_vf(
            has_netdev=True, userspace_driver=False, has_rdma_device=True, isolation="strict"
        )


def test_pf_states_applies_reservations_and_releases() -> None:
    state = _state()
    plain = nodestate.pf_states(state)
    assert plain == [
        placement.PfState("ens1f0", 6, 100_000, 25_000, 0),
        placement.PfState("ens1f1", 4, None, 0, None),
    ]
    reserved = nodestate.pf_states(state, {"ens1f0": (2, 30_000)})
    assert reserved[0] == placement.PfState("ens1f0", 4, 100_000, 55_000, 0)
    # Releasing a victim's interfaces frees its VFs and rate, never beyond the PF's capacity.
    released = nodestate.pf_states(state, {"ens1f0": (-2, -25_000), "ens1f1": (-9, 0)})
    assert released[0] == placement.PfState("ens1f0", 8, 100_000, 0, 0)
    assert released[1].free_vfs == 4
    # Over-reserved VFs clamp to zero free rather than an invalid negative count.
    assert nodestate.pf_states(state, {"ens1f1": (9, 0)})[1].free_vfs == 0


def test_largest_node_fits_well_inside_the_annotation_limit() -> None:
    pfs = tuple(
        PfSummary(
            f"ens{i}f{i % 2}np{i % 2}",
            capacity_tx_rate=400_000,
            used_tx_rate=390_000,
            capacity_vfs=128,
            used_vfs=127,
            numa_node=i % 2,
        )
        for i in range(16)
    )
    allocations = tuple(
        Allocation(
            f"namespace-with-a-long-name-{i:03d}",
            f"a-pod-with-a-rather-long-generated-name-{i:05d}-abcde",
            f"0f3c2b1a-{i:04d}-4e5f-8a9b-0c1d2e3f4a5b",
            tuple(InterfaceUse(pfs[(i + j) % 16].name, 10_000_000, 10_000_000) for j in range(8)),
        )
        for i in range(256)
    )
    text = nodestate.encode(_state(pfs=pfs, allocations=allocations, generation=(1 << 62)))
    assert len(text.encode()) < 200 * 1024
    assert nodestate.decode(text).allocations == allocations


names = st.text(alphabet="abcdefghij0123456789", min_size=1, max_size=12)


@given(
    st.lists(
        st.builds(
            PfSummary,
            name=names,
            capacity_tx_rate=st.none() | st.integers(0, 10_000_000),
            used_tx_rate=st.integers(0, 10_000_000),
            capacity_vfs=st.integers(0, 4096),
            used_vfs=st.integers(0, 4096),
            numa_node=st.none() | st.integers(0, 8),
        ),
        max_size=6,
        unique_by=lambda p: p.name,
    ),
    st.integers(0, 1 << 40),
)
def test_round_trip_property(pfs: list[PfSummary], generation: int) -> None:
    allocations = tuple(
        Allocation("ns", f"pod{i}", f"u{i}", (InterfaceUse(pf.name, 1, 2),)) for i, pf in enumerate(pfs)
    )
    state = _state(pfs=tuple(pfs), allocations=allocations, generation=generation)
    assert nodestate.decode(nodestate.encode(state)) == state


# -- version 2: networks, and arrays instead of objects ---------------------


def _v2(**over: Any) -> NodeState:
    networks = (
        nodestate.Network("rdma-rail-0", ("ens1f0",), ("rail-0",)),
        nodestate.Network("rdma-all", ("ens1f0", "ens1f1"), (None, "rail-1")),
    )
    return _state(version=nodestate.VERSION_2, networks=networks, **over)


def test_v2_round_trips_with_networks_and_rails() -> None:
    text = nodestate.encode(_v2())
    doc = json.loads(text)
    assert doc["networks"] == [["rdma-rail-0", [[0, "rail-0"]]], ["rdma-all", [[0, None], [1, "rail-1"]]]]
    assert doc["allocations"] == [["team-a", "trainer-0", "uid-1", [0, 20_000, 40_000, 0, 5_000, 0]]]
    assert nodestate.decode(text) == _v2()


def test_v1_and_v2_states_are_both_read() -> None:
    v1 = nodestate.decode(nodestate.encode(_state()))
    v2 = nodestate.decode(nodestate.encode(_v2()))
    assert v1.version == 1 and v1.networks == ()
    assert v2.version == 2 and [n.name for n in v2.networks] == ["rdma-rail-0", "rdma-all"]
    assert (v1.pfs, v1.allocations) == (v2.pfs, v2.allocations)
    assert not nodestate.same_content(v1, v2)
    with pytest.raises(NodeStateError, match=r"version 3 is not supported .*knows 1 and 2"):
        nodestate.decode(json.dumps(dict(json.loads(nodestate.encode(_v2())), version=3)))


def _v2_mutated(path: str, value: Any) -> str:
    doc: Any = json.loads(nodestate.encode(_v2()))
    *parents, last = path.split("/")
    node = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return json.dumps(doc)


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("pfs/0", ["ens1f0", 1, 2], "pfs[0]: expected a list of at least 6 entries"),
        ("pfs/1/3", -1, "pfs[1].capacity_vfs: -1 is outside 0..4096"),
        ("networks/0/1/0/0", 2, "networks[0].pfs[0]: 2 is not the index of a listed PF"),
        ("networks/0/1/0/1", 5, "networks[0].pfs[0].rail: expected a string"),
        ("networks/1/1/1/0", 0, "networks[1]: lists a PF more than once"),
        ("networks/0/0", "", "networks[0].name: '' is not a network name"),
        ("allocations/0/3", [0, 1], "allocations[0]: interfaces must be a flat list"),
        ("allocations/0/3/3", True, "allocations[0].interfaces[1]: true is not the index"),
        ("allocations/0/3/4", -5, "allocations[0].interfaces[1].min_tx_rate: -5 is outside"),
        ("networks", None, "node state.networks: expected a list"),
    ],
)
def test_v2_decode_refuses_with_the_field_named(path: str, value: Any, message: str) -> None:
    with pytest.raises(NodeStateError, match="^" + re.escape(message)):
        nodestate.decode(_v2_mutated(path, value))


def test_v2_keeps_256_pods_of_8_interfaces_well_inside_128_kib() -> None:
    """The figure: every allocation kept, so preemption can judge victims on the biggest nodes."""
    pfs = tuple(
        PfSummary(
            f"ens{i}f{i % 2}np{i % 2}",
            capacity_tx_rate=400_000,
            used_tx_rate=390_000,
            capacity_vfs=128,
            used_vfs=127,
            numa_node=i % 2,
        )
        for i in range(16)
    )
    allocations = tuple(
        Allocation(
            f"namespace-with-a-long-name-{i:03d}",
            f"a-pod-with-a-rather-long-generated-name-{i:05d}-abcde",
            f"0f3c2b1a-{i:04d}-4e5f-8a9b-0c1d2e3f4a5b",
            tuple(InterfaceUse(pfs[(i + j) % 16].name, 10_000_000, 10_000_000) for j in range(8)),
        )
        for i in range(256)
    )
    networks = tuple(
        nodestate.Network(
            f"rdma-rail-{r}", tuple(pf.name for pf in pfs[r * 2 : r * 2 + 2]), (f"rail-{r}",) * 2
        )
        for r in range(8)
    )
    state = _state(
        version=nodestate.VERSION_2, pfs=pfs, allocations=allocations, networks=networks, generation=1 << 62
    )
    text = nodestate.encode(state)
    v1_size = len(nodestate.encode(dataclasses.replace(state, version=1, networks=())).encode())
    print(f"node state at 256 pods x 8 interfaces: v2 {len(text.encode())} bytes, v1 {v1_size} bytes")
    assert len(text.encode()) < 100 * 1024
    assert nodestate.decode(text) == state


# ---------------------------------------------------------------------------
# One conversion from published state to placement input (style item 1)


def test_pf_state_is_the_one_conversion() -> None:
    pf = nodestate.PfSummary(
        "ens1f0", capacity_tx_rate=25_000, used_tx_rate=10_000, capacity_vfs=8, used_vfs=3, numa_node=1
    )
    assert nodestate.pf_state(pf) == placement.PfState("ens1f0", 5, 25_000, 10_000, 1)
    # Reservations not yet published, and releases (preemption victims), clamped.
    assert nodestate.pf_state(pf, (2, 5_000)).free_vfs == 3
    assert nodestate.pf_state(pf, (2, 5_000)).reserved_mbps == 15_000
    assert nodestate.pf_state(pf, (-9, -50_000)) == placement.PfState("ens1f0", 8, 25_000, 0, 1)
    # As if empty: every eligible VF free, nothing reserved, whatever is held.
    assert nodestate.pf_state(pf, (2, 5_000), empty=True) == placement.PfState("ens1f0", 8, 25_000, 0, 1)
    # PfSummary.free_vfs says what the conversion says.
    assert (
        pf.free_vfs == 5
        and nodestate.PfSummary(
            "p", capacity_tx_rate=None, used_tx_rate=0, capacity_vfs=2, used_vfs=4, numa_node=None
        ).free_vfs
        == 0
    )


def test_pf_states_and_the_extenders_empty_states_use_it() -> None:
    from rdma_cni.extender.decide import Decider

    state = nodestate.NodeState(
        2,
        1,
        "2026-01-01T00:00:00Z",
        (
            nodestate.PfSummary(
                "a", capacity_tx_rate=100, used_tx_rate=40, capacity_vfs=4, used_vfs=2, numa_node=0
            ),
            nodestate.PfSummary(
                "b", capacity_tx_rate=None, used_tx_rate=0, capacity_vfs=2, used_vfs=2, numa_node=None
            ),
        ),
        (),
    )
    held = {"a": (1, 10)}
    assert nodestate.pf_states(state, held) == [
        nodestate.pf_state(pf, held.get(pf.name, (0, 0))) for pf in state.pfs
    ]
    empty = [nodestate.pf_state(pf, empty=True) for pf in state.pfs]
    assert nodestate.pf_states(state, held, empty=True) == empty
    assert list(Decider._empty(state)) == empty


def test_a_per_pf_rule_in_pf_state_reaches_every_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    # The point of one conversion: a rule added there (here: PF "b" offers nothing) is seen by
    # pf_states, PfSummary.free_vfs and the extender's "as if empty" states alike.
    from rdma_cni.extender.decide import Decider

    real = nodestate.pf_state

    def rule(pf: nodestate.PfSummary, held: tuple[int, int] = (0, 0), *, empty: bool = False) -> Any:
        got = real(pf, held, empty=empty)
        return (
            placement.PfState(got.name, 0, got.capacity_mbps, got.reserved_mbps, got.numa_node)
            if pf.name == "b"
            else got
        )

    monkeypatch.setattr(nodestate, "pf_state", rule)
    b = nodestate.PfSummary(
        "b", capacity_tx_rate=None, used_tx_rate=0, capacity_vfs=4, used_vfs=0, numa_node=None
    )
    state = nodestate.NodeState(2, 1, "2026-01-01T00:00:00Z", (b,), ())
    assert b.free_vfs == 0
    assert nodestate.pf_states(state)[0].free_vfs == 0
    assert Decider._empty(state)[0].free_vfs == 0


# ---------------------------------------------------------------------------
# Names are checked on decode (issue 29, item 7)

_V2 = {
    "version": 2,
    "generation": 1,
    "updated": "2026-01-01T00:00:00Z",
    "pfs": [["ens1f0", 100, 0, 4, 0, 0]],
    "networks": [["rdma-a", [[0, "rail-0"]]]],
    "allocations": [["ml", "p-0", "6f0d93e4-5d3a-4c4b-9a1e-2f7c0b8e1d55", [0, 0, 0]]],
}
_V1 = {
    "version": 1,
    "generation": 1,
    "updated": "2026-01-01T00:00:00Z",
    "pfs": [
        {
            "name": "ens1f0",
            "capacity_tx_rate": 100,
            "used_tx_rate": 0,
            "capacity_vfs": 4,
            "used_vfs": 0,
            "numa_node": 0,
        }
    ],
    "allocations": [
        {
            "namespace": "ml",
            "name": "p-0",
            "uid": "u",
            "interfaces": [{"pf": "ens1f0", "min_tx_rate": 0, "max_tx_rate": 0}],
        }
    ],
}


def _with(doc: dict[str, Any], path: tuple[Any, ...], value: Any) -> str:
    doc = json.loads(json.dumps(doc))
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return json.dumps(doc)


V2_NAMES = {
    "pf": ("pfs", 0, 0),
    "network": ("networks", 0, 0),
    "rail": ("networks", 0, 1, 0, 1),
    "namespace": ("allocations", 0, 0),
    "pod": ("allocations", 0, 1),
    "uid": ("allocations", 0, 2),
    "updated": ("updated",),
}
V1_NAMES = {
    "pf": ("pfs", 0, "name"),
    "namespace": ("allocations", 0, "namespace"),
    "pod": ("allocations", 0, "name"),
    "uid": ("allocations", 0, "uid"),
    "updated": ("updated",),
}
HOSTILE_NAMES = ["\x1b]0;t\x07\n", "a\nb", "x" * 60_000, "a b", "\u2028\t", "é" * 8, "\udc80"]


def test_both_versions_decode_with_good_names() -> None:
    assert nodestate.decode(json.dumps(_V2)).networks[0].rails == ("rail-0",)
    assert nodestate.decode(json.dumps(_V1)).pfs[0].name == "ens1f0"


@pytest.mark.parametrize("value", HOSTILE_NAMES, ids=repr)
@pytest.mark.parametrize(("doc", "field"), [(_V2, f) for f in V2_NAMES] + [(_V1, f) for f in V1_NAMES])
def test_a_bad_name_makes_the_state_invalid(doc: dict[str, Any], field: str, value: str) -> None:
    path = (V2_NAMES if doc is _V2 else V1_NAMES)[field]
    text = _with(doc, path, value)
    if doc is _V1 and field == "pf":  # the allocation names the PF too: rename both
        text = _with(json.loads(text), ("allocations", 0, "interfaces", 0, "pf"), value)
    with pytest.raises(NodeStateError) as info:
        nodestate.decode(text)
    message = str(info.value)
    assert len(message) < 1000 and message.isprintable()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("pf", "\x1b[2J"),  # the kernel allows control characters: valid, escaped by every printer
        ("pf", "\u2028"),  # a line separator: no whitespace byte in its UTF-8
        ("pf", "eth%d"),
        ("pf", "é" * 7),
        ("pf", "x" * 15),
        ("pf", "ib0.8001"),
        ("network", "rdma.example-1"),
        ("network", "RDMA_net.1"),  # the CNI specification's rule, as the configuration's
        ("rail", "Rail_0.a"),
        ("namespace", ""),
        ("pod", ""),
        ("uid", ""),
        ("updated", "2026-11-26T07:00:00.123456+00:00"),
    ],
)
def test_names_within_their_rules_decode(field: str, value: str) -> None:
    assert nodestate.decode(_with(_V2, V2_NAMES[field], value)).version == 2


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("pf", "x" * 16, "1-15 bytes"),
        ("pf", "é" * 8, "1-15 bytes"),
        ("pf", "à", "whitespace"),  # its UTF-8 holds 0xa0, whitespace to the kernel
        ("pf", "..", "not '.' or '..'"),
        ("pf", "a/b", "'/'"),
        ("pf", "a:b", "':'"),
        ("pf", "a\x00", "NUL"),
        ("network", "-x", "a network name"),
        ("network", "a\n", "a network name"),
        ("rail", "-x", "rail label"),
        ("namespace", "a.b", "namespace name"),
        ("pod", "P", "Pod name"),
        ("uid", "u u", "a UID"),
        ("updated", "yesterday at 5", "RFC 3339"),
    ],
)
def test_a_bad_name_is_refused_saying_its_rule(field: str, value: str, rule: str) -> None:
    with pytest.raises(NodeStateError, match=re.escape(rule)):
        nodestate.decode(_with(_V2, V2_NAMES[field], value))


@pytest.mark.parametrize(
    "name", ["rdma-a", "RDMA_A", "net.1", "a" * 253, "-x", "a b", "a\n", "é", "a" * 254, ""]
)
def test_network_names_follow_the_configurations_rule(name: str) -> None:
    # An agent publishes its configurations' names: the state must accept exactly what the config does.
    from rdma_cni.cni.config import load_netconf
    from rdma_cni.cni.errors import InvalidConfig

    try:
        load_netconf({"cniVersion": "1.0.0", "name": name, "type": "rdma-cni"})
        config_ok = len(name) <= 253  # the state's bound on every name (the config has none)
    except InvalidConfig:
        config_ok = False
    try:
        nodestate.decode(_with(_V2, V2_NAMES["network"], name))
        state_ok = True
    except NodeStateError:
        state_ok = False
    assert state_ok == config_ok
