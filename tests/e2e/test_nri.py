"""RDMA devices in the pod over NRI: containerd 1.7 in the guest, rdma-cni its CRI network, the agent NRI.

One boot (``scenarios/nri.sh``, driven by ``scenarios/nri_cri.py``): pods through
the CRI, each with a VF from rdma-cni and a soft-RoCE device (rxe) made on that
VF inside the pod's namespace, which only the kernel's port-to-netdev tie links
to the pod; a host-network pod without attachments; then the agent restarted,
containerd restarted under the running agent, the agent frozen and stopped. Each
container runs a probe and exits; its CRI log says what it saw. The bytes
between the agent and containerd's NRI socket on the first connection are
recorded and decoded here with the plugin's own wire code (they are also the
unit tier's fixtures, ``tests/unit/data/nri/``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from guest import BootFn, GuestRun

from rdma_cni.agent.nri import mux, ttrpc
from rdma_cni.agent.nri import nri_api_pb2 as api
from tests.runtime.images import oci_archive

pytestmark = pytest.mark.e2e

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SCENARIOS = HERE / "scenarios"
BINARY = REPO / "dist" / "rdma-cni"
APISERVER = REPO / "tests" / "support" / "apiserver.py"
IMAGE = "docker.io/library/rdma-cni-busybox:e2e"  # as in scenarios/nri.sh and nri_cri.py
ANNOTATION = "rdma_interfaces_required"
# containerd's default NRI request timeout (plugin_request_timeout), left unset in nri.sh.
REQUEST_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def nri_run(e2e_boot_module: BootFn, tmp_path_factory: pytest.TempPathFactory) -> GuestRun:
    """The one boot every NRI test reads."""
    if not BINARY.is_file():
        pytest.fail(f"{BINARY} is missing: run `make build` (make e2e does)", pytrace=False)
    image = tmp_path_factory.mktemp("nri-image") / "busybox.tar"
    oci_archive(str(image), IMAGE, ["/bin/sleep", "2147483647"])
    pods = [
        {
            "namespace": "default",
            "name": name,
            "uid": hashlib.md5(name.encode()).hexdigest(),
            "annotations": {ANNOTATION: "[{}]"},
        }
        for name in ("nri-a", "nri-b")
    ]
    files = {
        "rdma-cni": BINARY,
        "apiserver.py": APISERVER,
        "pods.json": json.dumps(pods).encode(),
        "nodes.json": json.dumps([{"name": "e2e-guest"}]).encode(),
        "scenarios": SCENARIOS,
        "busybox.tar": image,
    }
    run = e2e_boot_module((SCENARIOS / "nri.sh").read_text(), files=files, timeout=900.0)
    print(
        f"\nnri guest: wall {run.wall_seconds:.1f} s, scenario from guest uptime "
        f"{run.guest_times.get('scenario_start')} s to {run.guest_times.get('scenario_end')} s"
    )
    return run


@pytest.fixture(scope="module")
def results(nri_run: GuestRun) -> dict[str, Any]:
    """The driver's facts; a run that left none fails every test that reads them."""
    path = nri_run.out / "nri" / "results.json"
    if not path.is_file():
        pytest.fail(f"the NRI scenario left no results: see test_scenario_completed ({path})", pytrace=False)
    return json.loads(path.read_text())


def container(results: dict[str, Any], name: str) -> dict[str, Any]:
    """One probe container's result, which must have run to completion."""
    got = results.get("containers", {}).get(name)
    assert got is not None, f"container {name} never ran: {results.get('error')}"
    assert "error" not in got, got["error"]
    assert got["exit_code"] == 0 and got["facts"].get("done") is not None, got.get("log")
    return got


def devices(c: dict[str, Any]) -> set[str]:
    """What the container listed in /dev/infiniband."""
    return set(c["facts"]["devices"].split())


def own(results: dict[str, Any], pod: str) -> str:
    """The uverbs node of the pod's rxe device (uverbsN)."""
    uverbs = results["pods"][pod]["uverbs"]
    assert uverbs, f"pod {pod} has no rxe uverbs device: {results['pods'][pod].get('rxe_add')}"
    return uverbs[0]


def refused(facts: dict[str, str], node: str) -> bool:
    """Did the device cgroup refuse the probe's node ``node``: creating it (m) or, once made, opening it?"""
    made = facts[f"mknod {node}"]
    return "Operation not permitted" in made or (
        made == "ok" and "Operation not permitted" in facts[f"open {node}"]
    )


def test_scenario_completed(nri_run: GuestRun) -> None:
    nri_run.check()
    res = json.loads((nri_run.out / "nri" / "results.json").read_text())
    assert "error" not in res, res["error"]
    assert res["steps"][-1] == "done"


def test_containerd_17_with_nri_registers_the_agent(results: dict[str, Any]) -> None:
    assert results["version"]["runtime"] == "containerd"
    assert results["version"]["version"].startswith("1.7."), results["version"]
    assert results["first_registration_seconds"] is not None


def test_each_pods_rxe_sits_on_its_vf_inside_its_namespace(results: dict[str, Any]) -> None:
    for pod in ("nri-a", "nri-b"):
        info = results["pods"][pod]
        assert info["rxe_add"]["rc"] == 0, info["rxe_add"]
        assert len(info["record"]["vfs"]) == 1
    assert own(results, "nri-a") != own(results, "nri-b")
    assert results["rdma_cm"], "rdma_ucm gave no rdma_cm device"


def test_a_pods_container_sees_exactly_its_own_rdma_devices(results: dict[str, Any]) -> None:
    for name, pod in (("a1", "nri-a"), ("b1", "nri-b")):
        c = container(results, name)
        assert devices(c) == {own(results, pod), "rdma_cm"}, c["log"]
        for dev in devices(c):
            assert c["facts"][f"open /dev/infiniband/{dev}"] == "ok", c["log"]


def test_a_soft_device_on_a_decoy_link_in_the_pod_is_not_the_pods(results: dict[str, Any]) -> None:
    # Pod A's namespace also holds a veth named like a second attachment, with an rxe on it:
    # the kernel ties that rxe to a netdev in the pod, but not to the pod's VF.
    decoy = results["decoy"]
    assert all(step["rc"] == 0 for step in decoy["steps"]), decoy
    assert decoy["uverbs"], decoy
    assert decoy["uverbs"][0] not in devices(container(results, "a1"))


def test_opening_another_pods_uverbs_is_refused_by_the_device_cgroup(results: dict[str, Any]) -> None:
    for name in ("a1", "b1"):
        c = container(results, name)
        facts = c["facts"]
        # containerd's default rules allow mknod of any char device (c *:* m); opening is the test.
        assert refused(facts, "other"), c["log"]
        # The same steps on the pod's own device work: the refusal is the cgroup's, not the probe's.
        assert facts["mknod own"] == "ok" and facts["open own"] == "ok", c["log"]


def test_memlock_is_raised_only_for_containers_with_devices(results: dict[str, Any]) -> None:
    assert container(results, "a1")["facts"]["memlock"] == "unlimited"
    plain = container(results, "plain1")["facts"]["memlock"]
    stopped = container(results, "a4_stopped")["facts"]["memlock"]
    assert plain == stopped != "unlimited"


def test_a_pod_without_attachments_is_left_unchanged(results: dict[str, Any]) -> None:
    c = container(results, "plain1")
    assert devices(c) == set(), c["log"]
    assert refused(c["facts"], "other"), c["log"]
    assert results["pods"]["nri-plain"]["host_network"] and results["pods"]["nri-plain"].get("record") is None


def test_the_agent_restarted_mid_run_registers_again_and_serves(results: dict[str, Any]) -> None:
    assert results["restart_registration_seconds"] is not None
    c = container(results, "b2")
    assert devices(c) == {own(results, "nri-b"), "rdma_cm"}, c["log"]
    assert c["facts"]["memlock"] == "unlimited"


def test_the_agent_reconnects_by_itself_when_containerd_restarts(results: dict[str, Any]) -> None:
    r = results.get("containerd_restart")
    assert r is not None, f"the containerd restart step never ran: {results.get('error')}"
    shown = {k: v for k, v in r.items() if k != "agent_log"}
    said = f"{shown}\nagent log during the restart:\n{r['agent_log']}"
    # containerd really went away and a new one came up, with the pods of the old one.
    assert r["stop_seconds"] is not None, said
    assert r["new_containerd_pid"] != r["old_containerd_pid"] and r["cri_ready_seconds"] is not None, said
    assert r["version"]["version"].startswith("1.7."), said
    # The same agent process throughout: nobody restarted it, nobody told it.
    assert r["agent_running"] and r["agent_pid_after"] == r["agent_pid_before"] is not None, said
    # It noticed: its connection ended and it synchronized again, with the new containerd,
    # which listed it among its plugins (the counts wait_registered watches).
    assert "NRI: connection to /var/run/nri/nri.sock ended" in r["agent_log"], said
    assert r["agent_registrations_while_down"] == 0, said
    assert r["reregistration_seconds"] is not None, said
    # And soon: containers the new containerd creates before the agent is back get no devices. It
    # retries every 0.1 s after a connection it was registered on ends (every 2 s before: 1.9 s
    # after CRI was ready, 2026-11-28; 0.26 s with the fast retries, the 0.2 s of this count's
    # polling included).
    assert r["reregistration_seconds"] - r["cri_ready_seconds"] < 1.0, said
    # The new containerd's synchronization carried the pods it recovered (nri-a, nri-b, nri-plain).
    assert r["synchronized"] and "(3 pods," in r["synchronized"], said
    # A new container in an existing attached pod, created after that, gets exactly its pod's devices.
    c = container(results, "b3_containerd")
    assert devices(c) == {own(results, "nri-b"), "rdma_cm"}, f"{c['log']}\n{said}"
    assert c["facts"]["memlock"] == "unlimited", c["log"]
    assert refused(c["facts"], "other") and c["facts"]["open own"] == "ok", c["log"]


def test_a_frozen_agent_delays_a_container_by_at_most_the_request_timeout(results: dict[str, Any]) -> None:
    frozen = container(results, "a2_frozen")
    assert devices(frozen) == set(), frozen["log"]
    assert refused(frozen["facts"], "own")  # no device rule either: the container is as if NRI were off
    baseline = container(results, "a4_stopped")["create_seconds"]
    # Under TCG a CreateContainer alone takes seconds; the frozen plugin may add its timeout, no more.
    assert frozen["create_seconds"] <= baseline + REQUEST_TIMEOUT + 5, (frozen, baseline)
    thawed = container(results, "a3_thawed")
    assert devices(thawed) == {own(results, "nri-a"), "rdma_cm"}, thawed["log"]


def test_with_the_agent_stopped_containers_start_without_devices(results: dict[str, Any]) -> None:
    c = container(results, "a4_stopped")
    assert devices(c) == set(), c["log"]
    assert refused(c["facts"], "own") and c["facts"]["memlock"] != "unlimited"
    # No plugin connected: containerd does not wait for one, unlike for the frozen agent
    # (whose container waited out the request timeout: a timer, not CPU, so safe under load).
    frozen = container(results, "a2_frozen")
    assert frozen["create_seconds"] >= REQUEST_TIMEOUT - 0.5, frozen
    assert c["create_seconds"] < frozen["create_seconds"] - 1, (c, frozen)


# -- the recorded wire ---------------------------------------------------------


def decode_capture(path: Path) -> dict[str, list[tuple[int, ttrpc.Message]]]:
    """Receiver ("plugin"/"runtime") -> (multiplexer connection, ttrpc message), first connection only."""
    streams: dict[str, bytearray] = {"plugin": bytearray(), "runtime": bytearray()}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("conn") == 1 and "hex" in rec:
            streams[rec["dir"]] += bytes.fromhex(rec["hex"])
    out: dict[str, list[tuple[int, ttrpc.Message]]] = {}
    for receiver, data in streams.items():
        readers: dict[int, ttrpc.Reader] = {}
        msgs = []
        pos = 0
        while pos < len(data):
            conn, size = mux.HEADER.unpack_from(data, pos)
            payload = bytes(data[pos + mux.HEADER.size : pos + mux.HEADER.size + size])
            assert len(payload) == size, "a frame cut short"
            pos += mux.HEADER.size + size
            msgs += [(conn, m) for m in readers.setdefault(conn, ttrpc.Reader()).feed(payload)]
        assert all(r.pending == 0 for r in readers.values())
        out[receiver] = msgs
    return out


def test_the_recorded_wire_decodes_with_the_plugins_own_code(nri_run: GuestRun) -> None:
    msgs = decode_capture(nri_run.out / "nri" / "capture.jsonl")
    calls = [
        ttrpc.decode_request(m.payload).method
        for conn, m in msgs["plugin"]
        if conn == mux.PLUGIN_CONN and m.type == ttrpc.TYPE_REQUEST
    ]
    assert calls[:2] == ["Configure", "Synchronize"] and "CreateContainer" in calls, calls
    (register,) = [m for conn, m in msgs["runtime"] if conn == mux.RUNTIME_CONN]
    assert ttrpc.decode_request(register.payload).method == "RegisterPlugin"
    answers = [ttrpc.decode_response(m.payload) for conn, m in msgs["runtime"] if conn == mux.PLUGIN_CONN]
    assert len(answers) == len(calls) and all(a.code == 0 for a in answers)
    # The adjustments the agent sent carry the devices the containers saw.
    adjusted = [api.CreateContainerResponse.FromString(a.payload).adjust for a in answers if a.payload]
    paths = {d.path for adj in adjusted for d in adj.linux.devices}
    assert "/dev/infiniband/rdma_cm" in paths
