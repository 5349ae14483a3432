"""The README's demo: a simulated SR-IOV node, then every verb through the built binary.

Builds a fake sysfs tree with two PFs of four VFs each (the VFs are real veth
devices), a network namespace standing in for a pod, and runs VERSION,
STATUS, ``inventory``, ADD (three interfaces with rates), CHECK and DEL,
printing what each returns. Run as root: ``make demo``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support import cnitool
from tests.support.simnode import SimNode, SimPf, add_netns, del_netns

NETWORK = "rdma-demo"
LIBCNI_RESULTS = "/var/lib/cni/results"  # where cnitool's libcni caches each ADD's result
REQUEST = [{"min_tx_rate": 15000, "max_tx_rate": 20000}, {"min_tx_rate": 5000}, {}]


def show(title: str) -> None:
    print(f"\n\033[1m== {title}\033[0m", flush=True)


def run(binary: str, command: str, conf: dict[str, object], env: dict[str, str]) -> dict[str, object] | None:
    full = {**os.environ, **env, "CNI_COMMAND": command}
    proc = subprocess.run(
        [binary], input=json.dumps(conf).encode(), env=full, capture_output=True, check=False
    )
    out = proc.stdout.decode().strip()
    print(f"$ CNI_COMMAND={command} {binary} < conf.json   -> exit {proc.returncode}")
    doc = json.loads(out) if out else None
    print(json.dumps(doc, indent=2) if doc is not None else "(no output: success)")
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr.decode())
        raise SystemExit(f"{command} failed")
    return doc


def write_manual_setup(root: str, conf: dict[str, object], node: SimNode, binary: str, netns: str) -> None:
    """A conflist and an env.sh for running the plugin by hand (cnitool) against the simulated node."""
    netd = os.path.join(root, "net.d")
    bindir = os.path.join(root, "bin")
    os.makedirs(netd, exist_ok=True)
    os.makedirs(bindir, exist_ok=True)
    link = os.path.join(bindir, "rdma-cni")
    if os.path.lexists(link):
        os.unlink(link)
    os.symlink(binary, link)
    plugin = {k: v for k, v in conf.items() if k not in ("cniVersion", "name")}
    with open(os.path.join(netd, "10-rdma-demo.conflist"), "w") as f:
        json.dump({"cniVersion": "1.1.0", "name": NETWORK, "plugins": [plugin]}, f, indent=2)
    env = {
        **node.env(),
        "NETCONFPATH": netd,
        "CNI_PATH": f"{bindir}:/usr/lib/cni",
        "CNI_IFNAME": "net1",
        "NETNS": netns,
        # make cnitool's build first on PATH: `cnitool` in the docs is that one.
        "PATH": f"{os.path.dirname(cnitool.path())}:$PATH",
    }
    with open(os.path.join(root, "env.sh"), "w") as f:
        f.writelines(f"export {k}={v}\n" for k, v in env.items())
    print(f"simulated node and pod netns {netns} are up; `source {root}/env.sh`, then run cnitool")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--binary", default="dist/rdma-cni")
    parser.add_argument("--dir", default=".demo")
    parser.add_argument(
        "--setup-only",
        action="store_true",
        help="build the simulated node and pod netns, write a conflist and env.sh, and stop",
    )
    parser.add_argument("--teardown", action="store_true", help="remove what --setup-only built")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("the demo needs root: it creates veth devices and a network namespace")
    binary = os.path.abspath(args.binary)
    root = os.path.abspath(args.dir)
    node = SimNode(os.path.join(root, "node"), [SimPf("demopf0", 4, 25000), SimPf("demopf1", 4, 10000)], "dm")
    netns_name = "rdma-demo-pod"
    del_netns(netns_name)
    node.down()
    # Records, leases and libcni's cache describe the simulated node just removed: a run
    # stopped half-way (a failed cnitool CHECK, say) would leave its VFs held in the next one.
    for leftover in ("state", "ipam"):
        shutil.rmtree(os.path.join(root, leftover), ignore_errors=True)
    for cached in glob.glob(os.path.join(LIBCNI_RESULTS, f"{NETWORK}-cnitool-*")):
        os.unlink(cached)
    if args.teardown:
        return 0
    node.up()
    netns = add_netns(netns_name)
    env = {
        **node.env(),
        "CNI_PATH": "/usr/lib/cni",
        "CNI_CONTAINERID": "demo-container",
        "CNI_NETNS": netns,
        "CNI_IFNAME": "net1",
    }
    conf: dict[str, object] = {
        "cniVersion": "1.1.0",
        "name": NETWORK,
        "type": "rdma-cni",
        "stateDir": os.path.join(root, "state"),
        "lockFile": os.path.join(root, "rdma-cni.lock"),
        "ipam": {
            "type": "host-local",
            "ranges": [[{"subnet": "10.99.0.0/24", "gateway": "10.99.0.1"}]],
            "dataDir": os.path.join(root, "ipam"),
        },
        "args": {"cni": {"rdma_interfaces_required": REQUEST}},
    }
    with open(os.path.join(root, "conf.json"), "w") as f:
        json.dump(conf, f, indent=2)
    if args.setup_only:
        write_manual_setup(root, conf, node, binary, netns)
        return 0
    try:
        show("VERSION")
        run(binary, "VERSION", conf, env)
        show("STATUS (can this node serve ADD?)")
        run(binary, "STATUS", conf, env)
        show("inventory: the simulated node (PF summary)")
        inv = subprocess.run(
            [binary, "inventory", "--config", os.path.join(root, "conf.json")],
            env={**os.environ, **env},
            capture_output=True,
            check=True,
            text=True,
        )
        for pf in json.loads(inv.stdout)["pfs"]:
            print(
                f"  {pf['name']}: {pf['capacity_vfs']} VFs, {pf['capacity_tx_rate']} Mbit/s, "
                f"VF netdevs {[v['netdev'] for v in pf['vfs']]}"
            )
        show(f"ADD: the pod asks for {json.dumps(REQUEST)}")
        result = run(binary, "ADD", conf, env)
        subprocess.run(["ip", "-n", netns_name, "-br", "addr"], check=False)
        print("PF-side VF settings (simulated):", json.dumps(node.vf_state()["pfs"]))
        show("CHECK")
        run(binary, "CHECK", {**conf, "prevResult": result}, env)
        show("DEL (twice: DEL is idempotent)")
        run(binary, "DEL", conf, env)
        run(binary, "DEL", conf, env)
        subprocess.run(["ip", "-n", netns_name, "-br", "link"], check=False)
        print(
            "VF netdevs back in the host:",
            sorted(n for n in SimNode.host_links() if n.startswith("dm0v") or n.startswith("dm1v")),
        )
    finally:
        del_netns(netns_name)
        node.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
