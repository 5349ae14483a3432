"""The docs' examples and reference tables agree with the code.

JSON examples parse (network configurations through the plugin's own validation, node states
through the extender's decoder), pod annotations through the pod-request parser, and the
option tables and synopses list exactly what the subcommands accept.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
from pathlib import Path

import pytest
import yaml

from rdma_cni.agent.cniserver import parser as cni_server_parser
from rdma_cni.cni import errors
from rdma_cni.cni.config import NetConf, load_netconf
from rdma_cni.extender.options import parser as extender_parser
from rdma_cni.install.command import _parser as install_parser
from rdma_cni.shared import nodestate
from rdma_cni.shared.podrequest import DEFAULT_ANNOTATION, parse_request
from tests.support.docblocks import ROOT, Block, all_blocks

BLOCKS = all_blocks()
DOCS = ROOT / "docs"


def options(parser: argparse.ArgumentParser) -> set[str]:
    """Every long option a parser accepts, hidden ones (for tests only) left out."""
    return {
        s
        for a in parser._actions
        if a.help != argparse.SUPPRESS
        for s in a.option_strings
        if s.startswith("--") and s != "--help"
    }


def table_rows(page: Path, header: str) -> list[str]:
    """The first cells of the Markdown table whose header row starts with ``| header |``."""
    lines = page.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header} |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(line.split("|")[1])
    return rows


def test_json_blocks_parse() -> None:
    bad = []
    for block in (b for b in BLOCKS if b.lang == "json"):
        try:
            json.loads(block.text)
        except ValueError as exc:
            bad.append(f"{block.where}: {exc}")
    assert not bad, bad


def test_network_configuration_example_is_valid() -> None:
    block = next(b for b in BLOCKS if b.page.name == "configuration.md" and b.lang == "json")
    conf = load_netconf(json.loads(block.text))
    assert conf.type == "rdma-cni" and conf.rdmaIsolation == "auto"


def test_node_state_examples_decode_as_documented() -> None:
    examples = [b for b in BLOCKS if b.page.name == "node-state.md" and b.lang == "json"]
    assert [nodestate.decode(b.text).version for b in examples] == [1, 2]


def test_configuration_table_lists_every_field() -> None:
    """Every field of the network configuration is documented, and nothing else is."""
    documented = {
        name
        for cell in table_rows(DOCS / "configuration.md", "field")
        for name in re.findall(r"`(\w+)`", cell)
    }
    assert documented == set(NetConf.model_fields) | {"cniVersion"}


def annotations(block: Block) -> dict[str, str]:
    return yaml.safe_load(block.text)["metadata"]["annotations"]


def test_pod_annotation_examples_parse_and_match_conf() -> None:
    """The annotation examples are valid requests, and the README's is conf/pod.yaml's."""
    examples = [b for b in BLOCKS if b.lang == "yaml" and "annotations:" in b.text]
    assert examples
    for block in examples:
        shown = annotations(block)
        if DEFAULT_ANNOTATION in shown:
            parse_request(json.loads(shown[DEFAULT_ANNOTATION]), block.where)
        networks = shown.get("k8s.v1.cni.cncf.io/networks", "").strip()
        for element in json.loads(networks) if networks.startswith("[") else []:
            parse_request(element["cni-args"][DEFAULT_ANNOTATION], block.where)
    readme = next(b for b in examples if b.page.name == "README.md")
    pod = yaml.safe_load((ROOT / "conf" / "pod.yaml").read_text())["metadata"]["annotations"]
    assert annotations(readme) == pod


def attachment_definitions() -> dict[str, NetConf]:
    """The NetworkAttachmentDefinitions the docs show, by name, their configs through load_netconf."""
    found = {}
    for block in (b for b in BLOCKS if b.lang == "yaml" and "kind: NetworkAttachmentDefinition" in b.text):
        nad = yaml.safe_load(block.text)
        conf = load_netconf(json.loads(nad["spec"]["config"]))
        assert conf.name == nad["metadata"]["name"], block.where
        found[conf.name] = conf
    return found


def test_attachment_definition_examples_are_valid_with_their_rails() -> None:
    nads = attachment_definitions()
    assert nads["rdma-rail-0"].rails == {"ens1f0": "rail-0"}
    assert sorted(nads["rdma-all"].rails.values()) == [f"rail-{r}" for r in range(8)]


def test_constrained_request_examples_parse_and_name_documented_rails() -> None:
    """The docs show rail, pf and different_pfs requests; each parses, and its rails exist where it says."""
    nads = attachment_definitions()
    requests = []
    for block in (b for b in BLOCKS if b.lang == "yaml" and DEFAULT_ANNOTATION in b.text):
        shown = annotations(block)
        if DEFAULT_ANNOTATION not in shown:
            continue
        request = parse_request(json.loads(shown[DEFAULT_ANNOTATION]), block.where)
        requests.append(request)
        network = shown.get("k8s.v1.cni.cncf.io/networks", "").strip()
        if network in nads:
            rails = set(nads[network].rails.values())
            assert {i.rail for i in request.interfaces if i.rail} <= rails, block.where
    assert any(i.rail for r in requests for i in r.interfaces)
    assert any(r.different_pfs for r in requests)


def test_install_option_table_is_complete() -> None:
    documented = {
        o for cell in table_rows(DOCS / "deploy.md", "option") for o in re.findall(r"--[\w-]+", cell)
    }
    assert documented == options(install_parser())


def test_node_agent_option_table_names_real_options() -> None:
    documented = {
        o for cell in table_rows(DOCS / "node-state.md", "option") for o in re.findall(r"--[\w-]+", cell)
    }
    assert documented and documented <= options(install_parser())


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.marker == "synopsis"], ids=lambda b: b.where)
def test_synopsis_lists_exactly_the_options(block: Block) -> None:
    parsers = {"rdma-cni scheduler-extender": extender_parser, "rdma-cni cni-server": cni_server_parser}
    assert block.value in parsers, f"{block.where}: no parser known for {block.value}"
    assert set(re.findall(r"--[\w-]+", block.text)) == options(parsers[block.value]())


def test_error_code_table_matches_the_code() -> None:
    """docs/protocol.md lists exactly the codes rdma_cni/cni/errors.py raises."""
    raised = {
        cls.code
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, errors.CniError) and cls is not errors.CniError
    }
    documented = {int(cell) for cell in table_rows(DOCS / "protocol.md", "code")}
    assert documented == raised


def test_metrics_table_names_exactly_the_metrics() -> None:
    """docs/operations.md names every metric the agent and the extender export, as exported."""
    source = "".join((ROOT / "rdma_cni" / f).read_text() for f in ("agent/metrics.py", "extender/metrics.py"))
    exported = set()
    for kind, name in re.findall(r'(\w+)\(\s*"(rdma_cni_\w+)"', source):
        # prometheus_client exposes every counter as <name>_total, whichever way it was named.
        exported.add(f"{name.removesuffix('_total')}_total" if kind.startswith("Counter") else name)
    documented = {
        name
        for cell in table_rows(DOCS / "operations.md", "metric")
        for name in re.findall(r"`(rdma_cni_\w+)`", cell)
    }
    assert documented == exported
