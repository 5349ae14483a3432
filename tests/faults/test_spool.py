"""The "spool" fault family: the DEL spool under random interleavings of everything that touches it.

Two networks share the node (and its node lock, as by default); the second
one's IPAM DEL is switched at random between working, failing and hanging
past its timeout, and its verbs wait for the node lock less long than that.
A small pool of pods is ADDed and DELed through the shim
(launcher/shim.c, built from source), their container ids reused, while CNI
servers of the built binary (``rdma-cni cni-server --take-over``, the
agent's server) are started beside each other, stopped, and killed -9. The
invariants, checked after every step:

- no VF of a live attachment is ever released (it stays in its pod, with its record);
- an ADD waits for another attachment's spooled DEL at most once its node-lock hold
  (:data:`ADD_BOUND`: the failing network's ``ipamTimeoutSeconds`` plus margin);
- once an agent stops while another waited, the socket is served again within seconds;
- at the end, with IPAM repaired and one agent up, every DEL has run: no record, no VF,
  no lease and no spool entry is left but those of live attachments, which DEL then clears.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import time
from typing import Any

import pytest

from tests.faults.bench import Bench
from tests.faults.knobs import scaled
from tests.integration.conftest import HOST_LOCAL_DIR, Cluster
from tests.support.fake_ipam import write_ipam
from tests.support.invariants import locate_vfs
from tests.support.shim import build_shim, run_shim

if not os.environ.get("RDMA_CNI_BINARY"):
    pytest.skip(
        "the fault tier drives the built binary (make faults sets RDMA_CNI_BINARY)", allow_module_level=True
    )

IPAM_TIMEOUT = 3
# What an ADD may wait for the spool: one spooled DEL holding the node lock through its IPAM timeout.
ADD_BOUND = IPAM_TIMEOUT + 5.0
# An ADD whose own attachment has a spooled DEL settles it first: that run, and one under way.
OWN_BOUND = 2 * IPAM_TIMEOUT + 5.0
SERVED_WITHIN = 10.0


class Agents:
    """The CNI servers of the node: at most two, the second waiting to take over from the first."""

    def __init__(self, cluster: Cluster, socket_path: str) -> None:
        self.cluster = cluster
        self.socket_path = socket_path
        self.procs: list[subprocess.Popen[bytes]] = []
        self.log = os.path.join(cluster.tmp, "cni-servers.log")

    def start(self) -> None:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **self.cluster.node.env()}
        conf = self.cluster.conf()
        argv = [os.environ["RDMA_CNI_BINARY"], "cni-server", "--socket", self.socket_path, "--take-over"]
        argv += ["--state-dir", conf["stateDir"], "--lock-file", conf["lockFile"]]
        with open(self.log, "ab") as log:
            self.procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=log))

    def stop(self, sig: int) -> bool:
        """Stop the oldest (the owner, or the one waiting); whether another was waiting to take over."""
        proc = self.procs.pop(0)
        proc.send_signal(sig)
        proc.wait(60)
        return bool(self.procs)

    def close(self) -> None:
        while self.procs:
            self.stop(signal.SIGTERM)


def served(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except OSError:
            return False
    return True


def test_the_spool_under_random_interleavings(cluster: Cluster, rng: random.Random) -> None:
    bench = Bench(cluster, "spool")
    shim = build_shim(cluster.tmp)
    socket_path = os.path.join(cluster.tmp, "agent", "cni.sock")
    spool = os.path.join(cluster.tmp, "agent", "del-spool")
    bindir = os.path.join(cluster.tmp, "bin")
    mode = os.path.join(cluster.tmp, "ipam-mode")
    with open(mode, "w") as f:
        f.write("ok")
    flaky_del = (
        f'm=$(cat {mode}); if [ "$m" = fail ]; then cat >/dev/null; '
        'echo \'{"cniVersion": "1.0.0", "code": 11, "msg": "IPAM store down"}\'; exit 1; fi; '
        f'if [ "$m" = hang ]; then exec sleep 60; fi; exec {HOST_LOCAL_DIR}/host-local'
    )
    write_ipam(bindir, "flaky", {"DEL": flaky_del})
    cluster.cni_path = f"{bindir}:{HOST_LOCAL_DIR}"
    net_a = cluster.conf()
    # Its verbs give up on the node lock before a hanging IPAM DEL lets go of it: a spooled DEL then
    # fails for a while although nothing is wrong with it, as on a busy node.
    net_b = cluster.conf(name="rdma-b", ipamTimeoutSeconds=IPAM_TIMEOUT, lockTimeoutSeconds=2)
    net_b["ipam"] = {**net_b["ipam"], "type": "flaky", "ranges": [[{"subnet": "10.78.0.0/24"}]]}
    # A pod is a container id (reused) with its namespace, and the network it attaches.
    pods = [(cluster.pod([{}]), rng.choice([net_a, net_b])) for _ in range(4)]
    live: set[int] = set()  # ADDed, not DELeted since: each holds its VF
    owed: set[int] = set()  # a DEL the runtime must try again (after a failed ADD whose DEL failed too)
    agents = Agents(cluster, socket_path)

    def shim_call(verb: str, i: int) -> tuple[Any, float]:
        pod, conf = pods[i]
        env = {k: v for k, v in cluster.env(verb, pod).items() if k.startswith("CNI_")}
        began = time.monotonic()
        out = run_shim(shim, socket_path, env, json.dumps(conf).encode(), timeout=300)
        bench.stats["runs"] += 1
        return out, time.monotonic() - began

    def own_entry(i: int) -> bool:
        pod = pods[i][0]
        name = f"del-{pod['CNI_CONTAINERID']}-{pod['CNI_IFNAME'].encode().hex()}.req"
        return any(n in (name, ".run-" + name) for n in os.listdir(spool)) if os.path.isdir(spool) else False

    def check_live(label: str) -> None:
        names = [os.path.basename(p["CNI_NETNS"]) for p, _ in pods]
        where = {ns for places in locate_vfs(cluster.node, names).values() for ns, _ in places}
        for i in live:
            ns = os.path.basename(pods[i][0]["CNI_NETNS"])
            if ns not in where:
                bench.fail(f"{label}: the VF of live attachment {i} ({ns}) was released")

    try:
        agents.start()
        for step in range(scaled(150)):
            draw = rng.random()
            label = f"step {step}"
            if draw < 0.12 and len(agents.procs) < 2:
                agents.start()
                label += ": agent started"
            elif draw < 0.24 and agents.procs:
                sig = rng.choice([signal.SIGTERM, signal.SIGTERM, signal.SIGKILL])
                waited = agents.stop(sig)
                label += f": agent stopped ({signal.Signals(sig).name})"
                bench.stats["rollouts" if waited else "stops"] += 1
                if waited:
                    deadline = time.monotonic() + SERVED_WITHIN
                    while not served(socket_path) and time.monotonic() < deadline:
                        time.sleep(0.1)
                    if not served(socket_path):
                        bench.fail(f"{label}: the socket was not served {SERVED_WITHIN:g} s after a rollout")
                if not agents.procs and rng.random() < 0.7:
                    agents.start()
            elif draw < 0.34:
                with open(mode, "w") as f:
                    f.write(rng.choice(["ok", "ok", "fail", "hang"]))
                label += ": IPAM of rdma-b switched"
            else:
                i = rng.randrange(len(pods))
                if i in live or i in owed:
                    out, _took = shim_call("DEL", i)
                    label += f": DEL {i}"
                    bench.stats["spooled"] += "DEL spooled" in out.stderr
                    if out.code != 0 and not (out.doc and out.doc.get("code") in (11, 104)):
                        bench.fail(f"{label}: {out}")
                    if out.code == 0 or (out.doc and out.doc.get("code") == 104):
                        live.discard(i)  # done or spooled (104: VFs home, the lease release pending)
                        owed.discard(i)
                else:
                    own = own_entry(i)
                    out, took = shim_call("ADD", i)
                    label += f": ADD {i}"
                    bound = OWN_BOUND if own else ADD_BOUND
                    if took > bound:
                        bench.fail(f"{label}: took {took:.1f} s, more than {bound:g} s")
                    if out.code == 0:
                        live.add(i)
                    else:
                        # 11: no agent, or its own spooled DEL failing; 104: the lease of its earlier
                        # attachment is not released yet (the IPAM fails): both are told to come back.
                        if not (out.doc and out.doc.get("code") in (11, 104)):
                            bench.fail(f"{label}: {out}")
                        # A runtime DELs after a failed ADD (its outcome may be unknown: the agent died).
                        undo, _ = shim_call("DEL", i)
                        if undo.code != 0 and not (undo.doc and undo.doc.get("code") == 104):
                            owed.add(i)  # not undone: the runtime DELs it again later
                            bench.stats["owed"] += 1
            bench.stats["cycles"] += 1
            check_live(label)
        # The end: IPAM repaired, one agent up, every owed DEL runs.
        with open(mode, "w") as f:
            f.write("ok")
        while len(agents.procs) > 1:
            agents.stop(signal.SIGTERM)
        if not agents.procs:
            agents.start()

        def drain() -> None:
            deadline = time.monotonic() + 120
            while os.path.isdir(spool) and [n for n in os.listdir(spool) if "del-" in n]:
                if any(n.startswith(".bad-") for n in os.listdir(spool)):
                    bench.fail(f"a spooled DEL was set aside: {sorted(os.listdir(spool))}")
                    break
                if time.monotonic() > deadline:
                    bench.fail(f"spooled DELs never ran: {sorted(os.listdir(spool))}")
                    break
                time.sleep(0.5)

        drain()
        check_live("after the spool drained")
        held = {r.split("@")[0] for r in cluster.records}
        for i, (pod, _) in enumerate(pods):
            if i not in live | owed and pod["CNI_CONTAINERID"] in held:
                bench.fail(f"attachment {i} was DELeted but its record is still there")
        for i in sorted(live | owed):
            out, _ = shim_call("DEL", i)
            if out.code != 0:
                bench.fail(f"final DEL {i}: {out}")
        # The agent left may still be taking the socket over from the one just stopped: a final DEL
        # the shim spooled then (exit 0, as a runtime is told) runs once it serves. Seen once
        # (seed 50789866): the node was judged before that DEL ran, its lease still there.
        drain()
        live.clear()
        owed.clear()
        bench.stats["inputs"] += len(pods)
        bench.settle([p for p, _ in pods], [net_b], "spool end")
        leases_b = os.path.join(cluster.tmp, "ipam", "rdma-b")
        left = [n for n in os.listdir(leases_b) if n[0].isdigit()] if os.path.isdir(leases_b) else []
        if left:
            bench.fail(f"leases of rdma-b left after every DEL: {left}")
    finally:
        agents.close()
        if bench.problems:
            with open(agents.log, errors="replace") as f:
                print(f.read()[-6000:])
    bench.verdict()
