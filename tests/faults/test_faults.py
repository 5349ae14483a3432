"""The fault tier: hostile inputs and faults against the built binary on the simulated node.

Each test is one family; every case ends with the runtime's DEL and a check
of the node from the kernel's view (tests/support/invariants.py). Inputs,
kill delays and faults come from the seeded generator (see conftest.py), so
a failing seed replays exactly.
"""

from __future__ import annotations

import copy
import json
import os
import random
from collections.abc import Iterator
from typing import Any

import pytest

from tests.faults.bench import Bench, Shim
from tests.faults.knobs import scaled
from tests.integration.conftest import Cluster, plugin_command
from tests.support.cniserver import CniServerProcess, host_state_untouched
from tests.support.fake_ipam import crashes, hangs, prints, sleeper, sleeps_then_host_local, write_ipam
from tests.support.shim import build_shim
from tests.support.simnode import ip

if not os.environ.get("RDMA_CNI_BINARY"):
    pytest.skip(
        "the fault tier drives the built binary (make faults sets RDMA_CNI_BINARY)", allow_module_level=True
    )

# -- generators ---------------------------------------------------------------

SCALARS: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    7,
    4096,
    2**31,
    2**63,
    -(2**63),
    1.5,
    float("1e308"),
    "",
    "x",
]
STRINGS = ["", "x", "net1", "../../etc/passwd", "a" * 300, "\u00e9\u00e8", "%d", " ", "eth0", "lo", "null"]
PATH_KEYS = {"stateDir", "lockFile", "logFile", "kubeconfig"}
FIELDS = [
    "cniVersion", "name", "type", "ipam", "dns", "args", "capabilities", "pfs", "annotation",
    "defaultRequest", "kubeconfig", "rdmaIsolation", "stateDir", "lockFile", "lockTimeoutSeconds",
    "ipamTimeoutSeconds", "capacityMbps", "vlan", "vlanQoS", "spoofchk", "trust", "linkState", "mtu",
    "logFile", "logLevel", "prevResult",
]  # fmt: skip


def random_json(rng: random.Random, depth: int = 0) -> Any:
    """Any JSON value, small and shallow."""
    kind = rng.randrange(6 if depth < 3 else 3)
    if kind == 0:
        return rng.choice(SCALARS)
    if kind == 1:
        return rng.choice(STRINGS)
    if kind == 2:
        return rng.randint(-(2**40), 2**40)
    if kind == 3:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["min_tx_rate", "max_tx_rate", "name", "type", "subnet", rng.choice(STRINGS) or "k"]
    return {rng.choice(keys): random_json(rng, depth + 1) for _ in range(rng.randrange(4))}


def safe_path(rng: random.Random, cluster: Cluster) -> Any:
    """A value for a path field that can never reach outside the test's directory."""
    return rng.choice(
        [
            "relative/path",
            "",
            os.path.join(cluster.tmp, "fz", "a"),
            "/proc/rdma-cni-fault/x",
            os.path.join(cluster.tmp, "fz", "..", "fz2"),
            5,
            None,
        ]
    )


def mutate_conf(rng: random.Random, cluster: Cluster, base: dict[str, Any]) -> dict[str, Any]:
    """One to three random edits of a valid configuration."""
    doc = copy.deepcopy(base)
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(7)
        key = rng.choice(FIELDS)
        if op == 0:
            doc.pop(key, None)
        elif op == 1 and key in PATH_KEYS:
            doc[key] = safe_path(rng, cluster)
        elif op == 1:
            doc[key] = random_json(rng)
        elif op == 2:
            doc[rng.choice(STRINGS) or "unknown"] = random_json(rng)
        elif op == 3:  # a misspelling of a known key
            k = rng.choice(FIELDS)
            doc[rng.choice([k.lower(), k.upper(), k[:-1], k + "s", k.replace("S", "_s")])] = random_json(rng)
        elif op == 4:
            ipam = doc.setdefault("ipam", {}) if isinstance(doc.get("ipam"), dict) else {}
            sub = rng.choice(["type", "ranges", "routes", "subnet", "gateway"])
            ipam[sub] = random_json(rng) if sub != "type" else rng.choice(["host-local", "nope", "../x", ""])
            doc["ipam"] = ipam
        elif op == 5:
            doc["args"] = {"cni": {"rdma_interfaces_required": random_json(rng)}}
        else:
            doc[rng.choice(["vlan", "mtu", "lockTimeoutSeconds", "ipamTimeoutSeconds", "vlanQoS"])] = (
                rng.choice([0, -5, 1, 68, 4095, 4096, 9000, 70000, 0.5, 601, "1"])
            )
    if isinstance(doc.get("ipam"), dict):
        doc["ipam"]["dataDir"] = base["ipam"]["dataDir"]  # leases stay where the oracle looks
    for key in ("stateDir", "lockFile"):
        # Removed, the plugin's defaults would be the machine's own /var/lib/cni and /run: records the
        # oracle never sees, left on the host (the defaults themselves are the unit tier's).
        if key not in doc:
            doc[key] = base[key]
    return doc


# Pods Kubernetes could not have named: ADD refuses each with code 4 (when nothing else is wrong).
BAD_POD_ARGS = [
    "K8S_POD_NAMESPACE=Default;K8S_POD_NAME=p",
    "K8S_POD_NAMESPACE=" + "n" * 64 + ";K8S_POD_NAME=p",
    "K8S_POD_NAMESPACE=team.a;K8S_POD_NAME=p",
    "K8S_POD_NAMESPACE=default;K8S_POD_NAME=" + "p" * 254,
    "K8S_POD_NAMESPACE=default;K8S_POD_NAME=P\x1b[2J",
    "K8S_POD_NAMESPACE=default",
    "K8S_POD_NAMESPACE=default;K8S_POD_NAME=p;K8S_POD_UID=uid-p",
]


def mutate_env(rng: random.Random, cluster: Cluster, pod: dict[str, str]) -> dict[str, str]:
    """One or two hostile CNI_* variables."""
    env = dict(pod)
    fifo = os.path.join(cluster.tmp, f"fifo{rng.randrange(1 << 30)}")
    choices: dict[str, list[str]] = {
        "CNI_CONTAINERID": [
            "",
            "../../x",
            "a" * 250,
            "ctr;reboot",
            "ctr\u00e9",
            ".",
            "ctr@net1",
            "ok-id_1.2",
        ],
        "CNI_IFNAME": ["", "a" * 16, "eth0/", "lo", "net 1", "%d", "..", "eth0", "n" * 15],
        "CNI_NETNS": ["", "relative", "/nonexistent/ns", "/proc/self/ns/net", "/proc/self/ns/mnt", "/", fifo],
        "CNI_ARGS": [
            "garbage",
            "K8S_POD_NAME=../..;K8S_POD_NAMESPACE=default",
            "=;;=",
            "A=" + "b" * 5000,
            *BAD_POD_ARGS,
        ],
        "CNI_PATH": ["", "/nonexistent", "relative", ":::"],
        "CNI_COMMAND": ["", "add", "NOPE", "VERSION", "DEL", "CHECK"],
    }
    for _ in range(rng.randint(1, 2)):
        var = rng.choice(sorted(choices))
        value = rng.choice(choices[var])
        if value == fifo and not os.path.exists(fifo):  # both draws may pick it
            os.mkfifo(fifo)
        env[var] = value
    return env


# -- families -----------------------------------------------------------------


def test_fuzzed_configurations(cluster: Cluster, rng: random.Random) -> None:
    bench = Bench(cluster, "config fuzzing")
    base = cluster.conf()
    with host_state_untouched():  # no edit sends the plugin to the machine's own stateDir or lock
        for n in range(scaled(250)):
            conf = mutate_conf(rng, cluster, base)
            bench.stats["inputs"] += 1
            pod = cluster.pod([{"max_tx_rate": 100}] if rng.random() < 0.5 else None)
            bench.run("ADD", pod, conf, f"config #{n} {json.dumps(conf)[:300]}")
            bench.settle([pod], [conf], f"config #{n}")
    bench.verdict()


def test_fuzzed_environments(cluster: Cluster, rng: random.Random) -> None:
    bench = Bench(cluster, "environment fuzzing")
    conf = cluster.conf()
    for n in range(scaled(120)):
        pod = cluster.pod([{}])
        env = mutate_env(rng, cluster, pod)
        bench.stats["inputs"] += 1
        verb = env.get("CNI_COMMAND") or "ADD"
        changed = {k: v for k, v in env.items() if v != pod.get(k)}
        label = f"env #{n} {json.dumps(changed)[:200]}"
        env.pop("CNI_COMMAND", None)
        out = bench.run(verb if verb in ("ADD", "DEL", "CHECK", "VERSION") else "ADD", env, conf, label)
        code = (out.doc or {}).get("code")
        if set(changed) == {"CNI_ARGS"} and changed["CNI_ARGS"] in BAD_POD_ARGS and code != 4:
            bench.fail(f"{label}: ADD of a pod Kubernetes could not name got code {code}, not 4: {out.doc}")
        # Accepted or refused, the node must make sense now (a VF "in the pod" the host is, say).
        bench.check(label, [pod], settled=False)
        bench.run("DEL", env, conf, label)  # the runtime DELs with what it has
        bench.settle([pod], [], label)
    bench.verdict()


def test_fuzzed_annotations(cluster: Cluster, rng: random.Random) -> None:
    bench = Bench(cluster, "annotation fuzzing")
    conf = cluster.conf()
    for n in range(scaled(120)):
        value = random_json(rng)
        if rng.random() < 0.5:
            value = [
                random_json(rng) if rng.random() < 0.3 else {"min_tx_rate": rng.randint(-5, 30000)}
            ] * rng.randint(1, 5)
        raw = json.dumps(value) if rng.random() < 0.9 else json.dumps(value)[:-1]
        bench.stats["inputs"] += 1
        pod = cluster.pod(raw)
        bench.run("ADD", pod, conf, f"annotation #{n} {raw[:200]}")
        bench.check(f"annotation #{n}", [pod], settled=False)
        bench.settle([pod], [], f"annotation #{n}")
    bench.verdict()


@pytest.fixture
def through(request: pytest.FixtureRequest, cluster: Cluster, tmp_path: Any) -> Iterator[Shim | None]:
    """For ``start`` ``shim``: the shim and a CNI server of the built binary (the shipped path)."""
    if request.node.callspec.params.get("start") != "shim":
        yield None
        return
    path = build_shim(str(tmp_path))
    socket_path = os.path.join(cluster.tmp, "agent", "cni.sock")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **cluster.node.env()}
    server = CniServerProcess(
        plugin_command(),
        socket_path,
        env,
        os.path.join(cluster.tmp, "cni-server.log"),
        state=(cluster.state_dir, cluster.conf()["lockFile"]),
    )
    try:
        yield Shim(path, socket_path, server.pid)
    finally:
        server.stop()


@pytest.mark.parametrize("start", ["cold", "warm", "shim"])
def test_kill_9_at_random_points_then_del(
    cluster: Cluster, rng: random.Random, start: str, through: Shim | None
) -> None:
    bench = Bench(cluster, f"kill -9 ({start})", through)
    # A warm ADD takes ~0.1 s, a cold one ~0.5 s (more under load); kills land anywhere in it,
    # and some cycles give IPAM a slow start so that kills land inside IPAM too. Through the
    # shim the victim is the shim (the server then kills the verb's worker) or the workers.
    span = 0.9 if start == "cold" else 0.25
    # Some cycles give IPAM a slow start: "slow-local" runs after the VF moved (CNI's order), a
    # slow "host-local" while it moves (the plugin overlaps the two for host-local), so kills land
    # inside IPAM and inside the overlap too.
    bindir = os.path.join(cluster.tmp, "bin")
    overlapdir = os.path.join(cluster.tmp, "bin-overlap")
    slow = sleeps_then_host_local(0.2, os.path.join(cluster.tmp, "m"))
    write_ipam(bindir, "slow-local", {"ADD": slow, "DEL": slow})
    write_ipam(overlapdir, "host-local", {"ADD": slow, "DEL": slow})
    plain_path = f"{bindir}:/usr/lib/cni"
    cluster.cni_path = plain_path
    assert bench.run("STATUS", {}, cluster.conf(), "warm-up").code == 0
    for n in range(scaled(20)):
        conf = cluster.conf()
        draw = rng.random()
        cluster.cni_path = f"{overlapdir}:{plain_path}" if 0.3 <= draw < 0.5 else plain_path
        if draw < 0.3:
            conf["ipam"]["type"] = "slow-local"
        victim = rng.choice(["caller", "worker"])
        for verb in ("ADD", "DEL"):
            pod = cluster.pod([{"max_tx_rate": 100}, {}])
            if start == "cold":
                pod["RDMA_CNI_WARM"] = "0"
            if verb == "DEL" and bench.run("ADD", pod, conf, f"kill #{n}").code != 0:
                bench.fail(f"kill #{n}: ADD on a clean node failed")
            delay = rng.uniform(0, span)
            bench.run_killed(verb, pod, conf, delay, victim)
            bench.stats["cycles"] += 1
            bench.settle([pod], [conf], f"kill #{n} {verb} {start} after {delay:.3f}s ({victim})")
    bench.verdict()


BROKEN = {
    "refusing": prints({"cniVersion": "1.0.0", "code": 999, "msg": "refused"}, 1),
    "error-doc-exit-0": prints({"cniVersion": "1.0.0", "code": 7, "msg": "liar"}, 0),
    "bad-address": prints({"cniVersion": "1.0.0", "ips": [{"address": "10.77.0.999/24"}]}),
    "not-json": "cat >/dev/null; echo garbage",
    "crashing": crashes(),
    "hanging": "HANG",
}


def test_broken_ipam_plugins(cluster: Cluster) -> None:
    bench = Bench(cluster, "broken IPAM")
    bindir = os.path.join(cluster.tmp, "bin")
    cluster.cni_path = f"{bindir}:/usr/lib/cni"
    tag = sleeper(bindir, f"fz{os.getpid()}hang")
    for kind, behaviour in BROKEN.items():
        code = hangs(tag, 60) if behaviour == "HANG" else behaviour
        # A DEL answering with a result (exit 0) is a success the plugin cannot tell from a real one.
        for verb in ("ADD",) if kind == "bad-address" else ("ADD", "DEL"):
            label = f"IPAM {kind} on {verb}"
            write_ipam(bindir, "broken", {verb: code})
            conf = cluster.conf(ipamTimeoutSeconds=1)
            conf["ipam"]["type"] = "broken"
            pod = cluster.pod([{"max_tx_rate": 100}, {}])
            add = bench.run("ADD", pod, conf, label)
            if verb == "ADD" and add.code == 0:
                bench.fail(f"{label}: ADD succeeded")
            if verb == "DEL":
                if bench.run("DEL", pod, conf, label).code == 0:
                    bench.fail(f"{label}: DEL succeeded although IPAM failed")
                bench.check(label, [pod], settled=False)
            write_ipam(bindir, "broken", {})  # repaired: host-local
            bench.stats["cycles"] += 1
            bench.settle([pod], [conf], label)
    bench.verdict()


def _record(cluster: Cluster, pod: dict[str, str]) -> str:
    return os.path.join(cluster.state_dir, "attachments", f"{pod['CNI_CONTAINERID']}@net1.json")


def test_lost_corrupt_and_foreign_records(cluster: Cluster) -> None:
    bench = Bench(cluster, "records")
    conf = cluster.conf()
    spoil = {
        "lost": lambda path: os.unlink(path),
        "corrupt": lambda path: _write(path, "{not json"),
        "truncated": lambda path: _write(path, ""),
        "no-vfs": lambda path: _edit(path, lambda r: r.update(vfs=[])),
        "wrong-pci": lambda path: _edit(path, lambda r: [v.update(pci="0000:ff:1f.7") for v in r["vfs"]]),
    }
    for kind, how in spoil.items():
        pod = cluster.pod([{"max_tx_rate": 100}, {}])
        if bench.run("ADD", pod, conf, kind).code != 0:
            bench.fail(f"records {kind}: ADD on a clean node failed")
            bench.settle([pod], [], f"records {kind}")
            continue
        how(_record(cluster, pod))
        # Another pod comes and goes meanwhile: it must never get the spoiled attachment's VFs.
        # (The spoiled pod's VFs now sit in it without a record, by construction: only the
        # settled node after DEL is judged.)
        other = cluster.pod([{}])
        if bench.run("ADD", other, conf, f"records {kind} neighbour").code != 0:
            bench.fail(f"records {kind}: the node stopped serving other pods")
        bench.stats["cycles"] += 1
        bench.settle([pod, other], [], f"records {kind}")
    # Foreign: another network's attachment on the same node; our GC must leave it alone.
    theirs = cluster.conf(name="other-net")
    pod = cluster.pod([{}])
    bench.run("ADD", pod, theirs, "foreign")
    gc = {**conf, "cni.dev/valid-attachments": []}
    bench.run("GC", {}, gc, "foreign GC")
    bench.check("foreign record after our GC", [pod], settled=False)
    if not os.path.exists(_record(cluster, pod)):
        bench.fail("foreign: our GC removed another network's record")
    bench.stats["cycles"] += 1
    bench.settle([pod], [theirs], "foreign")
    bench.verdict()


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _edit(path: str, change: Any) -> None:
    with open(path) as f:
        rec = json.load(f)
    change(rec)
    with open(path, "w") as f:
        json.dump(rec, f)


def test_pods_relabelling_and_renaming_their_interfaces(cluster: Cluster) -> None:
    bench = Bench(cluster, "hostile pods")
    conf = cluster.conf()
    acts = {
        "rename": [["link", "set", "net1", "down"], ["link", "set", "net1", "name", "eth9"]],
        "relabel": [
            ["link", "set", "net1", "alias", "rdma-cni:0000:5e:01.3"],
            ["link", "set", "net1-1", "alias", ""],
        ],
        "swap-names": [
            ["link", "set", "net1", "down"],
            ["link", "set", "net1-1", "down"],
            ["link", "set", "net1", "name", "tmp0"],
            ["link", "set", "net1-1", "name", "net1"],
            ["link", "set", "tmp0", "name", "net1-1"],
        ],
        "decoy": [
            ["link", "set", "net1", "down"],
            ["link", "set", "net1", "name", "hidden0"],
            ["link", "add", "net1", "type", "veth", "peer", "name", "decoypeer"],
        ],
    }
    for kind, commands in acts.items():
        pod = cluster.pod([{"max_tx_rate": 100}, {}])
        add = bench.run("ADD", pod, conf, kind)
        if add.code != 0:
            bench.fail(f"hostile pod {kind}: ADD on a clean node failed")
            continue
        ns = os.path.basename(pod["CNI_NETNS"])
        for args in commands:
            ip("-n", ns, *args)
        if kind == "decoy":
            with open(_record(cluster, pod)) as f:
                pci = json.load(f)["vfs"][0]["pci"]
            ip("-n", ns, "link", "set", "net1", "alias", f"rdma-cni:{pci}")
        bench.stats["cycles"] += 1
        bench.settle([pod], [], f"hostile pod {kind}")
    bench.verdict()
