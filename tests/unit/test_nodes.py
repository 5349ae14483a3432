"""``rdma-cni nodes`` against the API stand-in over real HTTPS: table, --json, --fits, errors.

The property test checks the point of ``--fits``: on the same published
states it names exactly the nodes the extender's filter passes.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rdma_cni.cli import main as cli
from rdma_cni.cli import nodes as nodes_cmd
from rdma_cni.extender.decide import Decider
from rdma_cni.extender.demand import Demands
from rdma_cni.extender.reservations import Reservations
from rdma_cni.extender.verbs import Extender
from rdma_cni.shared import nodestate
from tests.support import sched_objects as so
from tests.support.apiserver import ApiServer

ANNOTATION = "rdma_interfaces_required"


@pytest.fixture(scope="module")
def api() -> Iterator[ApiServer]:
    with ApiServer() as server:
        yield server


@pytest.fixture(scope="module")
def kubeconfig(api: ApiServer, tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(api.write_kubeconfig(tmp_path_factory.mktemp("kube") / "kubeconfig"))


# Names of the nodes the tests put in the module's API stand-in.
_added: set[str] = set()


def reset_nodes(api: ApiServer, nodes: dict[str, str | None]) -> None:
    """Make the API hold exactly ``nodes`` (name -> annotation text, None: no state)."""
    for name in sorted(_added - set(nodes)):
        api.remove_node(name)
    _added.clear()
    for name, text in nodes.items():
        api.add_node(name, annotations={} if text is None else {nodestate.ANNOTATION: text}, images=3)
        _added.add(name)


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = nodes_cmd.main(list(argv), out)
    return code, out.getvalue()


TWO_PFS = [("ens1f0", 25_000, 4), ("ens1f1", None, 2)]


@pytest.fixture
def cluster(api: ApiServer) -> None:
    reset_nodes(
        api,
        {
            "a": nodestate.encode(so.state(TWO_PFS, [("u1", [("ens1f0", 10_000, 20_000)])])),
            "b": None,
            "c": "{not json",
            "d": nodestate.encode(so.state([("ens1f0", 25_000, 4)], age=4000)),
        },
    )


def test_table_shows_each_pf_and_each_problem(cluster: None, kubeconfig: str) -> None:
    code, text = run("--kubeconfig", kubeconfig, "--max-state-age", "600")
    assert code == 0
    lines = text.splitlines()
    assert lines[0].split() == ["NODE", "STATE", "AGE", "PF", "FREE_MBPS", "FREE_VFS", "NOTE"]
    # Aligned: every column starts at the header's offset.
    starts = [lines[0].index(h) for h in ("STATE", "PF", "FREE_MBPS", "FREE_VFS")]
    assert lines[1][: starts[0]].strip() == "a"
    assert lines[1][starts[1] :].split()[:3] == ["ens1f0", "15000/25000", "3/4"]
    assert lines[2][starts[1] :].split() == ["ens1f1", "?", "2/2"]
    assert lines[2][: starts[1]].strip() == ""
    rows = {line.split()[0]: line for line in lines[3:]}
    assert "missing" in rows["b"] and "no rdma-cni.io/node-state annotation" in rows["b"]
    assert "invalid" in rows["c"] and "not valid JSON" in rows["c"]
    assert "stale" in rows["d"] and "older than 600 s" in rows["d"] and "67m" in rows["d"]


def test_without_max_state_age_an_old_state_is_not_stale(cluster: None, kubeconfig: str) -> None:
    code, text = run("--kubeconfig", kubeconfig, "--json")
    doc = json.loads(text)
    assert code == 0
    assert {n["name"]: n["state"] for n in doc["nodes"]} == {
        "a": "ok",
        "b": "missing",
        "c": "invalid",
        "d": "ok",
    }


def test_json_schema(cluster: None, kubeconfig: str) -> None:
    code, text = run("--kubeconfig", kubeconfig, "--json", "--max-state-age", "600")
    assert code == 0
    doc = json.loads(text)
    assert doc["max_state_age"] == 600
    assert "request" not in doc and "fitting_nodes" not in doc
    a, b, c, d = doc["nodes"]
    assert a["state"] == "ok" and a["problem"] == "" and a["generation"] == 1
    assert 0 <= a["age_seconds"] < 60
    assert a["pfs"] == [
        {
            "name": "ens1f0",
            "numa_node": 0,
            "capacity_mbps": 25_000,
            "used_mbps": 10_000,
            "free_mbps": 15_000,
            "capacity_vfs": 4,
            "used_vfs": 1,
            "free_vfs": 3,
        },
        {
            "name": "ens1f1",
            "numa_node": 0,
            "capacity_mbps": None,
            "used_mbps": 0,
            "free_mbps": None,
            "capacity_vfs": 2,
            "used_vfs": 0,
            "free_vfs": 2,
        },
    ]
    assert (b["state"], b["pfs"], b["age_seconds"], b["updated"]) == ("missing", [], None, None)
    assert c["state"] == "invalid" and c["problem"].startswith("rdma-cni: invalid node state:")
    assert d["state"] == "stale" and 3990 <= d["age_seconds"] <= 4100 and d["pfs"][0]["free_vfs"] == 4


def test_fits_says_where(cluster: None, kubeconfig: str) -> None:
    request = json.dumps([{"min_tx_rate": 10_000}, {}])
    code, text = run("--kubeconfig", kubeconfig, "--json", "--max-state-age", "600", "--fits", request)
    assert code == 0
    doc = json.loads(text)
    assert doc["request"] == [{"min_tx_rate": 10_000, "max_tx_rate": 0}, {"min_tx_rate": 0, "max_tx_rate": 0}]
    assert doc["fitting_nodes"] == ["a"]
    fits = {n["name"]: n["fits"] for n in doc["nodes"]}
    placed = fits["a"]["placement"]
    # The min rate needs the PF of known capacity; the two interfaces are both placed.
    assert sum(p["vfs"] for p in placed) == 2
    assert {"pf": "ens1f0", "vfs": 1, "min_tx_rate": 10_000} in placed or {
        "pf": "ens1f0",
        "vfs": 2,
        "min_tx_rate": 10_000,
    } in placed
    assert fits["b"]["fits"] is False and "annotation" in fits["b"]["reason"]
    assert fits["d"]["fits"] is False and "older than 600 s" in fits["d"]["reason"]
    # Too much bandwidth: the extender's reason, naming the request.
    code, text = run("--kubeconfig", kubeconfig, "--fits", '[{"min_tx_rate": 20000}]')
    assert code == 0
    row = next(line for line in text.splitlines() if line.startswith("a "))
    assert "no: needs 20000 Mbit/s free on one PF" in row
    assert text.splitlines()[0].split()[-1] == "FITS"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{", "--fits: not valid JSON"),
        ('{"min_tx_rate": 1}', "--fits: expected a JSON list of interface objects"),
        ("[]", "--fits: asks for no interfaces"),
        ('[{"min_tx_rate": 20, "max_tx_rate": 10}]', "--fits:"),
    ],
)
def test_bad_fits_is_a_usage_error(value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        run("--kubeconfig", "/nonexistent", "--fits", value)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "rdma-cni nodes: error: argument --fits:" in err and message in err


def test_unreachable_api(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with ApiServer() as gone:
        kubeconfig = gone.write_kubeconfig(tmp_path / "kubeconfig", ca="data")
        url = gone.url
    code, text = run("--kubeconfig", str(kubeconfig))
    assert (code, text) == (1, "")
    assert f"rdma-cni nodes: cannot list nodes at {url}" in capsys.readouterr().err


def test_refused_credentials(api: ApiServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig", token="not-the-token")
    code, text = run("--kubeconfig", str(kubeconfig))
    assert (code, text) == (1, "")
    err = capsys.readouterr().err
    assert f"rdma-cni nodes: cannot list nodes at {api.url}" in err and "not-the-token" not in err


def test_bad_kubeconfig(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _ = run("--kubeconfig", str(tmp_path / "missing"))
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith("rdma-cni nodes: ") and "missing" in err


def test_dispatched_by_the_cli(cluster: None, kubeconfig: str) -> None:
    out = io.StringIO()
    assert cli.main(["nodes", "--kubeconfig", kubeconfig, "--json"], stdout=out) == 0
    assert [n["name"] for n in json.loads(out.getvalue())["nodes"]] == ["a", "b", "c", "d"]


# ---------------------------------------------------------------------------
# --fits agrees with the extender's filter

_pf = st.tuples(st.sampled_from([None, 10_000, 25_000, 100_000]), st.integers(0, 4), st.integers(0, 4))
_iface = st.tuples(
    st.sampled_from([0, 0, 1_000, 5_000, 10_000, 30_000]), st.sampled_from([0, 0, 20_000, 50_000])
)


@st.composite
def node_text(draw: st.DrawFn) -> str | None:
    kind = draw(st.sampled_from(["state", "state", "state", "missing", "invalid", "old"]))
    if kind == "missing":
        return None
    if kind == "invalid":
        return '{"version": 1}'
    pfs = []
    for i, (cap, vfs, used) in enumerate(draw(st.lists(_pf, min_size=1, max_size=3))):
        rate = draw(st.integers(0, cap)) if cap else 0
        pfs.append(
            nodestate.PfSummary(
                f"p{i}",
                capacity_tx_rate=cap,
                used_tx_rate=rate,
                capacity_vfs=vfs,
                used_vfs=min(used, vfs),
                numa_node=0,
            )
        )
    state = so.state([], age=1000 if kind == "old" else 0)
    return nodestate.encode(
        nodestate.NodeState(state.version, state.generation, state.updated, tuple(pfs), ())
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    texts=st.lists(node_text(), min_size=1, max_size=6),
    request=st.lists(_iface, min_size=1, max_size=3).map(
        lambda xs: [{"min_tx_rate": lo, "max_tx_rate": hi if hi >= lo else lo} for lo, hi in xs]
    ),
)
def test_fits_agrees_with_the_extender_filter(
    api: ApiServer, kubeconfig: str, texts: list[str | None], request: list[dict[str, int]]
) -> None:
    nodes = {f"n{i}": text for i, text in enumerate(texts)}
    reset_nodes(api, nodes)
    value = json.dumps(request)
    code, out = run("--kubeconfig", kubeconfig, "--json", "--max-state-age", "600", "--fits", value)
    assert code == 0
    doc = json.loads(out)

    extender = Extender(
        decider=Decider(max_state_age=600),
        demands=Demands(annotation=ANNOTATION),
        reservations=Reservations(300.0),
    )
    objects = [so.node(name, text) for name, text in nodes.items()]
    answer: dict[str, Any] = extender.filter(so.args_nodes(so.pod("p", {ANNOTATION: value}), objects))
    passing = sorted(n["metadata"]["name"] for n in (answer.get("Nodes") or {}).get("items") or [])
    assert doc["fitting_nodes"] == passing
    failed = {**(answer.get("FailedNodes") or {}), **(answer.get("FailedAndUnresolvableNodes") or {})}
    for node in doc["nodes"]:
        if not node["fits"]["fits"]:
            assert node["fits"]["reason"] == failed[node["name"]]


def test_fits_with_a_network_judges_rails_as_the_extender_does() -> None:
    """--network NAME: the request is judged as an attachment of NAME (its PFs and rails)."""
    import dataclasses

    base = so.state([("p0", 25_000, 4), ("p1", 25_000, 4)], [("u1", [("p1", 0, 0)] * 4)])  # p1 full
    railed = dataclasses.replace(
        base,
        version=nodestate.VERSION_2,
        networks=(nodestate.Network("net", ("p0", "p1"), ("rail-0", "rail-1")),),
    )
    texts = {"v2": nodestate.encode(railed), "v1": nodestate.encode(base)}
    objects = [so.node(name, text) for name, text in texts.items()]
    for value in (
        '[{"rail": "rail-0"}]',
        '[{"rail": "rail-1"}]',
        '{"interfaces": [{}, {}], "different_pfs": true}',
    ):
        request = nodes_cmd._fits(value)
        doc = nodes_cmd.report(objects, now=Decider().now(), demand=nodes_cmd.demand_of(request, "net"))
        assert doc["network"] == "net"
        extender = Extender(
            decider=Decider(),
            demands=Demands(annotation=ANNOTATION, networks=frozenset({"net"})),
            reservations=Reservations(300.0),
        )
        pod = so.pod("p", {ANNOTATION: value, "k8s.v1.cni.cncf.io/networks": "net"})
        answer: dict[str, Any] = extender.filter(so.args_nodes(pod, objects))
        passing = sorted(n["metadata"]["name"] for n in (answer.get("Nodes") or {}).get("items") or [])
        assert doc["fitting_nodes"] == passing, (value, doc, answer)
    # rail-0 fits the v2 node only (a v1 state has no rails); the request shows its constraint.
    doc = nodes_cmd.report(
        objects,
        now=Decider().now(),
        demand=nodes_cmd.demand_of(nodes_cmd._fits('[{"rail": "rail-0"}]'), "net"),
    )
    assert doc["fitting_nodes"] == ["v2"]
    assert doc["request"] == [{"min_tx_rate": 0, "max_tx_rate": 0, "rail": "rail-0"}]
    placed = {n["name"]: n["fits"]["placement"] for n in doc["nodes"]}
    assert placed["v2"] == [{"pf": "p0", "vfs": 1, "min_tx_rate": 0}]
    # Without --network the request is judged on every PF, without rails.
    doc = nodes_cmd.report(
        objects,
        now=Decider().now(),
        demand=nodes_cmd.demand_of(nodes_cmd._fits('[{"rail": "rail-0"}]'), None),
    )
    assert doc["fitting_nodes"] == [] and "network" not in doc


# ---------------------------------------------------------------------------
# What agents publish is not trusted (issue 29, item 7)

# Clears the screen, sets the terminal's title, and starts a forged row for another node.
FORGED = "\x1b]0;pwned\x07\x1b[2J\nzz  ok  0s  ens9  99999/99999  64/64"
# Short enough for the kernel, which allows ESC in an interface name: decodes, must be escaped.
KERNEL_VALID = "\x1b[2J\x1b[H"
BIDI = "\u202eeth0"  # right-to-left override: printable to no terminal, allowed by the kernel


def _hostile_nodes(api: ApiServer) -> None:
    def state(pf: str) -> str:
        # Written as an agent would, with only the PF name hostile.
        text = nodestate.encode(so.state([("ens1f0", 25_000, 4)]))
        return text.replace('"ens1f0"', json.dumps(pf))

    reset_nodes(api, {"forged": state(FORGED), "esc": state(KERNEL_VALID), "bidi": state(BIDI)})


def test_table_escapes_what_agents_publish(api: ApiServer, kubeconfig: str) -> None:
    _hostile_nodes(api)
    code, text = run("--kubeconfig", kubeconfig)
    assert code == 0
    lines = text.splitlines()
    # One header and one row per node: the newline in the forged name made no row.
    assert len(lines) == 4 and text.count("\n") == 4
    assert [line.split()[0] for line in lines[1:]] == ["bidi", "esc", "forged"]
    assert all(c.isprintable() for line in lines for c in line)
    rows = {line.split()[0]: line for line in lines[1:]}
    # The forged name is refused on decode (whitespace): the node is invalid, its reason escaped.
    assert "invalid" in rows["forged"] and "is not an interface name the kernel allows" in rows["forged"]
    assert "\\x1b]0;pwned\\x07\\x1b[2J\\nzz" in rows["forged"]
    # Names the kernel allows decode, and are shown escaped.
    assert "ok" in rows["esc"] and "\\x1b[2J\\x1b[H" in rows["esc"]
    assert "ok" in rows["bidi"] and "\\u202eeth0" in rows["bidi"]


def test_json_stays_exact_json_with_hostile_names(api: ApiServer, kubeconfig: str) -> None:
    _hostile_nodes(api)
    code, text = run("--kubeconfig", kubeconfig, "--json")
    assert code == 0
    assert text.isascii() and all(c.isprintable() or c == "\n" for c in text)
    nodes = {n["name"]: n for n in json.loads(text)["nodes"]}
    # The exact names, as published, once decoded.
    assert nodes["esc"]["pfs"][0]["name"] == KERNEL_VALID
    assert nodes["bidi"]["pfs"][0]["name"] == BIDI
    assert nodes["forged"]["state"] == "invalid" and nodes["forged"]["pfs"] == []


def test_node_names_and_errors_are_escaped_too() -> None:
    # Node names come from the API server: a hostile one (or a stand-in's) is escaped as well.
    items = [{"metadata": {"name": "n\x1b[31m\nx", "annotations": {}}}, {"metadata": {"name": 7}}]
    table = nodes_cmd.render_table(nodes_cmd.report(items, now=0.0))
    assert table.count("\n") == 3 and "\x1b" not in table and "n\\x1b[31m\\nx" in table


def test_api_error_text_is_bounded_and_escaped(
    api: ApiServer, kubeconfig: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from rdma_cni.kube import client as kubeapi

    def refuse(*_a: Any, **_k: Any) -> Any:
        raise kubeapi.ApiError(500, "InternalError", "\x1b]0;x\x07" + "y" * 60_000)

    monkeypatch.setattr(kubeapi.ApiClient, "list", refuse)
    code, _ = run("--kubeconfig", kubeconfig)
    err = capsys.readouterr().err
    assert code == 1 and len(err) < 1200 and "\x1b" not in err and "(60006 characters)" in err
    assert err.count("\n") == 1
