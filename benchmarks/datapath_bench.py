"""ADD and DEL wall time for one VF: rdma-cni (built binary) beside Debian's Go host-device plugin.

Both move the same kind of device (a veth on the simulated node) into a
network namespace with the same host-local IPAM. rdma-cni also reads the pod
from the local HTTPS API stand-in, takes the node lock and writes its
record, as in production. rdma-cni runs twice: as shipped (the launcher hands
each invocation to its warm server, see docs/architecture.md; the one cold
start that launches the server is not counted) and with RDMA_CNI_WARM=0
(every invocation a cold start). Reports medians, the ratios, the node
lock's hold time (from rdma-cni's log), and memory: the peak RSS of a cold
ADD, of the warm-start client (the launcher) and of the warm server. Root
needed. A script, not a timed test.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support.apiserver import ApiServer
from tests.support.processes import cache_id, wait_gone, warm_servers
from tests.support.simnode import SimNode, SimPf, add_netns, del_netns, ip


def timed(cmd: list[str], env: dict[str, str], conf: dict[str, object]) -> float:
    """Run one invocation; its wall time in ms (it must succeed)."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, input=json.dumps(conf).encode(), env=env, capture_output=True, check=False)
    elapsed = (time.perf_counter() - start) * 1000
    if proc.returncode != 0:
        raise SystemExit(f"{env['CNI_COMMAND']} failed: {proc.stdout.decode()} {proc.stderr.decode()}")
    return elapsed


def own_children_cpu() -> float:
    """User+system CPU seconds of this process's reaped children (and theirs)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def children_cpu(pid: int) -> float:
    """User+system CPU seconds of the reaped children of ``pid`` (cutime + cstime)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(") ", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def peak_rss(cmd: list[str], env: dict[str, str], conf: dict[str, object]) -> int:
    """Peak RSS (KiB) of one invocation and the processes it waited for, through GNU time.

    Not from this process's wait4: the kernel keeps a process's peak across
    exec, and a child forked from this (large) interpreter starts out with
    its pages counted; time(1) is small.
    """
    with tempfile.NamedTemporaryFile("r") as out:
        timed(["/usr/bin/time", "-f", "%M", "-o", out.name, *cmd], env, conf)
        return int(out.read().split()[-1])


def memory_of(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM (peak) and Pss of a running process, in KiB."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                out["Pss"] = int(line.split()[1])
    return out


def private_cache(tmp: str, binary: str) -> tuple[str, str]:
    """A cache directory of a bench's own under ``tmp``, and the tree ``binary`` unpacks into there.

    Its tree and warm server are nobody else's: other runs of the same binary
    on this machine share the default cache (and may stop its server), and
    the bench stops its own server at the end (:func:`stop_private_cache`).
    Set ``RDMA_CNI_CACHE_DIR`` to the first in every invocation's environment.
    """
    cache = os.path.join(tmp, "cache")
    return cache, os.path.join(cache, cache_id(os.path.abspath(binary)))


def stop_private_cache(cache: str, tree: str) -> None:
    """Stop the warm server a bench started in its own cache, and remove that cache."""
    for pid in warm_servers(tree):
        os.kill(pid, signal.SIGTERM)
        wait_gone(pid)
    shutil.rmtree(cache, ignore_errors=True)


def wait_for_warm_server(tree: str, timeout: float = 60) -> None:
    """Wait until the warm server of the unpacked ``tree`` listens."""
    sock = os.path.join(tree, "warm.sock")
    deadline = time.monotonic() + timeout
    while not os.path.exists(sock):
        if time.monotonic() > deadline:
            raise SystemExit(f"no warm server at {sock}")
        time.sleep(0.05)


@dataclass
class Rig:
    """A simulated node, the API stand-in holding one pod, its netns, and what rdma-cni is run with."""

    node: SimNode
    api: ApiServer
    netns_name: str
    ipam: dict[str, object]
    cni_env: dict[str, str]  # the CNI_* a runtime sets for the pod (what host-device gets too)
    env: dict[str, str]  # cni_env, the pod's CNI_ARGS and the simulated node's variables
    conf: dict[str, object]  # rdma-cni's network config, host-local as IPAM

    def down(self) -> None:
        del_netns(self.netns_name)
        self.api.stop()
        self.node.down()


def one_pod_rig(tmp: str, name: str, pfs: list[SimPf], prefix: str, subnet: str) -> Rig:
    """Set up the node the data-path benchmarks share; the pod ``default/<name>`` asks for one VF."""
    node = SimNode(os.path.join(tmp, "node"), pfs, prefix=prefix)
    node.up()
    api = ApiServer(os.path.join(tmp, "api"))
    api.start()
    api.add_pod("default", name, {"rdma_interfaces_required": '[{"max_tx_rate": 1000}]'})
    kubeconfig = api.write_kubeconfig(os.path.join(tmp, "kubeconfig"), mode="token")
    netns_name = f"rdma-{name}"
    ipam: dict[str, object] = {
        "type": "host-local",
        "ranges": [[{"subnet": subnet}]],
        "dataDir": os.path.join(tmp, "ipam"),
    }
    cni_env = {
        "PATH": os.environ.get("PATH", ""),
        "CNI_PATH": "/usr/lib/cni",
        "CNI_CONTAINERID": name,
        "CNI_NETNS": add_netns(netns_name),
        "CNI_IFNAME": "net1",
    }
    env = {
        **cni_env,
        **node.env(),
        "CNI_ARGS": f"IgnoreUnknown=true;K8S_POD_NAMESPACE=default;K8S_POD_NAME={name}",
    }
    conf: dict[str, object] = {
        "cniVersion": "1.0.0",
        "name": name,
        "type": "rdma-cni",
        "kubeconfig": kubeconfig,
        "stateDir": os.path.join(tmp, "state"),
        "lockFile": os.path.join(tmp, "lock"),
        "ipam": ipam,
        "logFile": os.path.join(tmp, "rdma-cni.log"),
    }
    return Rig(node, api, netns_name, ipam, cni_env, env, conf)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--binary", default="dist/rdma-cni")
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="rdma-cni-bench-")
    rig = one_pod_rig(tmp, "bench", [SimPf("benchpf0", 1, 25000)], "bn", "10.88.0.0/24")
    node, base, ours = rig.node, rig.cni_env, rig.conf
    log = str(ours["logFile"])
    cache, tree = private_cache(tmp, args.binary)
    ours_env = {**rig.env, "RDMA_CNI_CACHE_DIR": cache}
    theirs = {
        "cniVersion": "1.0.0",
        "name": "bench-hd",
        "type": "host-device",
        "device": node.vf_netdev(0, 0),
        "ipam": {**rig.ipam, "dataDir": os.path.join(tmp, "ipam-hd")},
    }
    modes = {"rdma-cni (warm start)": {}, "rdma-cni (cold, RDMA_CNI_WARM=0)": {"RDMA_CNI_WARM": "0"}}
    results: dict[str, dict[str, list[float]]] = {
        **{mode: {"ADD": [], "DEL": []} for mode in modes},
        "host-device (Go)": {"ADD": [], "DEL": []},
    }
    binary = os.path.abspath(args.binary)
    try:
        # The first warm-mode start is cold and launches the server: not counted.
        timed([binary], {**ours_env, "CNI_COMMAND": "VERSION"}, ours)
        wait_for_warm_server(tree)
        # CPU time, which the load of a shared machine does not inflate: the
        # processes this script waits for (their own waited-for children,
        # such as host-local, included), and for warm starts the server's
        # children, which run the verbs.
        cpu = dict.fromkeys(results, 0.0)
        server = warm_servers(tree)[0]
        served_before = children_cpu(server)
        for _ in range(args.runs):
            for mode, extra in modes.items():
                for verb in ("ADD", "DEL"):
                    before = own_children_cpu()
                    results[mode][verb].append(
                        timed([binary], {**ours_env, **extra, "CNI_COMMAND": verb}, ours)
                    )
                    cpu[mode] += own_children_cpu() - before
            for verb in ("ADD", "DEL"):
                before = own_children_cpu()
                results["host-device (Go)"][verb].append(
                    timed(["/usr/lib/cni/host-device"], {**base, "CNI_COMMAND": verb}, theirs)
                )
                cpu["host-device (Go)"] += own_children_cpu() - before
        time.sleep(0.5)  # the server reaps its last child after that child has reported
        cpu[next(iter(modes))] += children_cpu(server) - served_before
        rss: dict[str, list[int]] = {mode: [] for mode in modes}
        for _ in range(3):
            for mode, extra in modes.items():
                rss[mode].append(peak_rss([binary], {**ours_env, **extra, "CNI_COMMAND": "ADD"}, ours))
                timed([binary], {**ours_env, **extra, "CNI_COMMAND": "DEL"}, ours)
        servers = warm_servers(tree)
        server_memory = memory_of(servers[0]) if servers else {}
    finally:
        stop_private_cache(cache, tree)
        ip("link", "del", node.vf_wire(0, 0), check=False)
        rig.down()
    print("| plugin | ADD median ms | DEL median ms | ADD+DEL ms |")
    print("| --- | ---: | ---: | ---: |")
    cycle = {}
    for name, r in results.items():
        a, d = statistics.median(r["ADD"]), statistics.median(r["DEL"])
        cycle[name] = a + d
        print(f"| {name} | {a:.1f} | {d:.1f} | {a + d:.1f} |")
    print()
    for mode in modes:
        print(f"ratio {mode} / host-device (ADD+DEL): {cycle[mode] / cycle['host-device (Go)']:.2f}x")
    print(f"over {args.runs} cycles each, interleaved; load average {os.getloadavg()[0]:.2f} at the end")
    print()
    print("| plugin | CPU ms per ADD+DEL | ratio to Go |")
    print("| --- | ---: | ---: |")
    for name in results:
        per = cpu[name] * 1000 / args.runs
        print(f"| {name} | {per:.1f} | {cpu[name] / cpu['host-device (Go)']:.2f}x |")
    print()
    print("| peak RSS | MiB |")
    print("| --- | ---: |")
    warm_mode, cold_mode = modes
    print(
        f"| cold ADD (launcher exec'd into Python, host-local included) | {max(rss[cold_mode]) / 1024:.1f} |"
    )
    print(f"| warm-start client (the launcher) during ADD | {max(rss[warm_mode]) / 1024:.1f} |")
    if server_memory:
        now, peak, pss = (server_memory[k] / 1024 for k in ("VmRSS", "VmHWM", "Pss"))
        print(
            f"| warm server, resident now / peak / proportional (Pss) | {now:.1f} / {peak:.1f} / {pss:.1f} |"
        )
    with open(log) as f:
        held = [float(m.group(1)) for m in re.finditer(r"held ([0-9.]+) ms", f.read())]
    if held:
        print(
            f"node lock hold time: median {statistics.median(held):.1f} ms, max {max(held):.1f} ms "
            f"({len(held)} verbs)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
