"""A pod that fills its netns with links: NRI's proof of its VFs and DEL, timed, with the agent's memory.

On the simulated node (veth VFs, real netns), pod A gets one VF through the
built binary's ADD; then its namespace is filled with N more links (made over
one netlink socket, :mod:`tests.support.linkflood`), and for each N:

- NRI: the agent's proof of A's VFs (``PodDevices``, which CreateContainer
  runs) in a fresh Python process, as the agent would run it: its wall time,
  whether it proved the VF, and that process's RSS before and after (growth
  stays with the agent). ``--source`` imports another version's tree
  (with ``--binary`` that version's build: figures before a change).
- DEL of A, and 0.1 s after it started, pod B's ADD on the same node (which
  waits for the node lock): DEL's wall time, how long DEL held the node lock
  and how long B's ADD waited for it (from rdma-cni's log).

Root needed. A script, not a timed test::

    .venv/bin/python benchmarks/netns_bench.py --links 4000,10000,24000
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support.apiserver import ApiServer
from tests.support.linkflood import flood
from tests.support.simnode import SimNode, SimPf, add_netns, del_netns

PROOF = textwrap.dedent(
    """
    import json, sys, time
    def rss():
        with open("/proc/self/status") as f:
            pairs = (line.partition(":") for line in f)
            return {k: int(v.split()[0]) for k, _, v in pairs if k in ("VmRSS", "VmHWM")}
    from rdma_cni.agent.nri import plugin
    from rdma_cni.node.record import RecordStore
    plugin.PodDevices([sys.argv[1]])("warm-up")  # the agent's imports, done before the pod's containers
    before = rss()
    att = RecordStore(sys.argv[1]).get(sys.argv[2], "net1")
    start = time.monotonic()
    plugin.PodDevices([sys.argv[1]])(sys.argv[2])  # what CreateContainer runs
    took = time.monotonic() - start
    after = rss()
    start = time.monotonic()
    proven = plugin.prove_in_pod(att, [v.pci for v in att.vfs])
    prove_took = time.monotonic() - start
    want = [v.pci for v in att.vfs]
    print(json.dumps({"seconds": took, "prove_seconds": prove_took, "proven": sorted(proven), "want": want,
                      "before": before, "after": after}))
    """
)


class Rig:
    """The simulated node, the API stand-in with pods a and b, and the CNI config."""

    def __init__(self, tmp: str, binary: str, source: str) -> None:
        self.tmp = tmp
        self.binary = binary
        self.source = source
        self.node = SimNode(os.path.join(tmp, "node"), [SimPf("nbpf0", 2, 25000)], prefix="nb").up()
        self.api = ApiServer(os.path.join(tmp, "api"))
        self.api.start()
        for name in ("a", "b"):
            self.api.add_pod("default", name, {"rdma_interfaces_required": '[{"max_tx_rate": 1000}]'})
        self.conf = {
            "cniVersion": "1.0.0",
            "name": "nb",
            "type": "rdma-cni",
            "kubeconfig": self.api.write_kubeconfig(os.path.join(tmp, "kubeconfig"), mode="token"),
            "stateDir": os.path.join(tmp, "state"),
            "lockFile": os.path.join(tmp, "lock"),
            "lockTimeoutSeconds": 120,
            "logFile": os.path.join(tmp, "rdma-cni.log"),
        }
        self.netns = {name: f"rcnib{os.getpid()}{name}" for name in ("a", "b")}

    def env(self, verb: str, pod: str) -> dict[str, str]:
        return {
            "PATH": os.environ.get("PATH", ""),
            "CNI_PATH": "/usr/lib/cni",
            "CNI_COMMAND": verb,
            "CNI_CONTAINERID": f"bench-{pod}",
            "CNI_NETNS": f"/run/netns/{self.netns[pod]}",
            "CNI_IFNAME": "net1",
            "CNI_ARGS": f"IgnoreUnknown=true;K8S_POD_NAMESPACE=default;K8S_POD_NAME={pod}",
            "RDMA_CNI_WARM": "0",
            **self.node.env(),
        }

    def run(self, verb: str, pod: str) -> float:
        start = time.monotonic()
        proc = subprocess.run(
            [self.binary], input=json.dumps(self.conf).encode(), env=self.env(verb, pod), capture_output=True
        )
        if proc.returncode != 0:
            raise SystemExit(f"{verb} {pod} failed: {proc.stdout.decode()} {proc.stderr.decode()}")
        return time.monotonic() - start

    def lock_lines(self) -> list[tuple[float, float]]:
        try:
            with open(str(self.conf["logFile"])) as f:
                text = f.read()
        except FileNotFoundError:
            return []
        return [
            (float(m.group(1)), float(m.group(2)))
            for m in re.finditer(r"node lock: waited ([0-9.]+) ms, held ([0-9.]+) ms", text)
        ]

    def down(self) -> None:
        for ns in self.netns.values():
            del_netns(ns)
        self.api.stop()
        self.node.down()


def one_size(rig: Rig, links: int) -> dict[str, object]:
    """ADD a, flood its netns, prove, then DEL a racing ADD b; returns the figures."""
    for ns in rig.netns.values():
        add_netns(ns)
    rig.run("ADD", "a")
    start = time.monotonic()
    made = flood(f"/run/netns/{rig.netns['a']}", links)
    made_in = time.monotonic() - start
    env = {**os.environ, **rig.node.env(), "PYTHONPATH": rig.source}
    proc = subprocess.run(
        [sys.executable, "-c", PROOF, str(rig.conf["stateDir"]), "bench-a"],
        env=env,
        cwd=rig.source,  # `python -c` imports from its working directory first
        capture_output=True,
        text=True,
        check=True,
    )
    proof = json.loads(proc.stdout)
    seen = len(rig.lock_lines())
    out: dict[str, float] = {}

    def add_b() -> None:
        time.sleep(0.1)
        out["add_b"] = rig.run("ADD", "b")

    racer = threading.Thread(target=add_b)
    racer.start()
    out["del_a"] = rig.run("DEL", "a")
    racer.join()
    pair = rig.lock_lines()[seen:]
    rig.run("DEL", "b")
    for ns in rig.netns.values():
        del_netns(ns)
    return {
        "links": made,
        "made_s": made_in,
        "nri_s": proof["seconds"],
        "prove_s": proof["prove_seconds"],
        "nri_proved": proof["proven"] == proof["want"],
        "rss_before_mib": proof["before"]["VmRSS"] / 1024,
        "rss_after_mib": proof["after"]["VmRSS"] / 1024,
        "del_s": out["del_a"],
        "del_held_ms": max((h for _, h in pair), default=0.0),
        "add_waited_ms": max((w for w, _ in pair), default=0.0),
        "add_s": out["add_b"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--binary", default="dist/rdma-cni")
    parser.add_argument("--links", default="4000,10000,24000", help="comma-separated link counts")
    parser.add_argument(
        "--source",
        default=os.getcwd(),
        help="where the agent's code is imported from (another version's tree)",
    )
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="rdma-cni-netns-bench-")
    rig = Rig(tmp, os.path.abspath(args.binary), os.path.abspath(args.source))
    rows = []
    try:
        rows.append(one_size(rig, 0))
        for n in (int(x) for x in args.links.split(",")):
            rows.append(one_size(rig, n))
    finally:
        rig.down()
    print(
        "| links in the pod's netns | NRI answer s | its proof again s | VF proven "
        "| agent RSS before -> after MiB | DEL s | DEL held the lock ms | other ADD waited ms |"
    )
    print("| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['links']:,} | {r['nri_s']:.3f} | {r['prove_s']:.3f} "
            f"| {'yes' if r['nri_proved'] else 'no'} "
            f"| {r['rss_before_mib']:.0f} -> {r['rss_after_mib']:.0f} | {r['del_s']:.2f} "
            f"| {r['del_held_ms']:.0f} | {r['add_waited_ms']:.0f} |"
        )
    print(
        f"load average {os.getloadavg()[0]:.2f} at the end; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
