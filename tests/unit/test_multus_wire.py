"""What Multus v4.3.0 (thick and thin) passed rdma-cni on a real node, fed to the plugin's parsing.

tests/unit/data/multus/v4.3.0-{thick,thin}.json are recorded by the node tier
(tests/node/test_multus_input.py, test_multus_thin.py): one pod selecting the same rdma-cni
network twice, ``net1`` with its request in the pod-wide annotation and ``rail2`` with its own in
``cni-args``, through ADD and DEL. The plugin must take each call as Multus makes it: the
environment (thick: ``IgnoreUnknown=true`` and the pod's four K8S_ keys; thin: containerd's keys
after Multus' own, so every key twice, ``IgnoreUnknown`` as ``true`` and as ``1``, and
``CNI_PATH`` twice), the network configuration Multus re-encodes (keys sorted, ``args.cni`` on
``rail2`` only, ``prevResult`` on DEL, no ``runtimeConfig``), and each attachment's request from
where Multus put it. (``CNI_ARGS``' items are stored sorted: containerd's order varies.)
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from rdma_cni.cni.config import load_netconf
from rdma_cni.cni.protocol import decode_stdin, parse_env
from rdma_cni.node.podmeta import resolve_request
from rdma_cni.shared.attachments import args_request

FIXTURES = os.path.join(os.path.dirname(__file__), "data", "multus")
MODES = ("thick", "thin")
SANDBOX = "9f" * 32
PLACEHOLDERS = {
    "<sandbox>": SANDBOX,
    "<pod-uid>": "15394b79-df39-4702-ae15-3e8b19302e90",
    "<namespace>": "team-a",
    "<netns>": "/var/run/netns/cni-df1cd0dc-e168-8274-be2d-5ca0fc9636ff",
    "<mac>": "86:22:ff:7d:c7:2f",
    "<address>": "192.168.160.4/20",
}


def calls(mode: str) -> list[dict[str, Any]]:
    with open(os.path.join(FIXTURES, f"v4.3.0-{mode}.json")) as f:
        text = f.read()
    for placeholder, value in PLACEHOLDERS.items():
        text = text.replace(placeholder, value)
    return list(json.loads(text)["calls"])


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(c, id=f"{m}-{c['env']['CNI_COMMAND']}-{c['env']['CNI_IFNAME']}")
        for m in MODES
        for c in calls(m)
    ],
)
def test_each_recorded_call_is_taken_as_multus_makes_it(call: dict[str, Any]) -> None:
    env = parse_env(call["env"])
    assert env.command == call["env"]["CNI_COMMAND"]
    assert env.container_id == SANDBOX
    if env.command == "ADD":
        assert env.pod is not None and (env.pod.namespace, env.pod.name) == ("team-a", "wire")
    else:  # DEL works from the records, whatever CNI_ARGS says (Multus' DEL may come after the pod is gone)
        assert env.pod is None
    doc = decode_stdin(json.dumps(call["stdin"]).encode())
    conf = load_netconf(doc)
    assert "runtimeConfig" not in call["stdin"]
    present, raw = args_request(doc.get("args", {}).get("cni"))
    if env.ifname == "rail2":
        # Its selection's cni-args, as Multus merged them: the attachment's own request, found
        # without asking the API server.
        assert present and raw == [{"min_tx_rate": 1000}]
        request, source = resolve_request(env, conf)
        assert [i.min_tx_rate for i in request.interfaces] == [1000], source
    else:
        assert not present  # the pod-wide annotation applies (read from the API at ADD)
    if env.command == "DEL":
        assert doc["prevResult"]["interfaces"], "Multus passes DEL the ADD's result"
    else:
        assert "prevResult" not in doc


@pytest.mark.parametrize("mode", MODES)
def test_the_recording_is_one_pod_through_add_and_del_in_multus_order(mode: str) -> None:
    order = [(c["env"]["CNI_COMMAND"], c["env"]["CNI_IFNAME"]) for c in calls(mode)]
    assert order == [("ADD", "net1"), ("ADD", "rail2"), ("DEL", "rail2"), ("DEL", "net1")]
    (args,) = {c["env"]["CNI_ARGS"] for c in calls(mode)}
    keys = [item.split("=", 1)[0] for item in args.split(";")]
    # Thin passes containerd's keys after its own: each twice (the plugin keeps the last).
    assert sorted(set(keys)) == [
        "IgnoreUnknown",
        "K8S_POD_INFRA_CONTAINER_ID",
        "K8S_POD_NAME",
        "K8S_POD_NAMESPACE",
        "K8S_POD_UID",
    ]
    assert len(keys) == (10 if mode == "thin" else 5)
    (path,) = {c["env"]["CNI_PATH"] for c in calls(mode)}
    assert path == ("/opt/cni/bin:/opt/cni/bin" if mode == "thin" else "/opt/cni/bin")
