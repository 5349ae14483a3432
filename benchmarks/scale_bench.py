"""Scale: a node with 64 VFs (4 PFs x 16) and 64 single-VF pods added at once, then deleted at once.

rdma-cni runs 64 ADDs launched together, each pod read from the HTTPS API
stand-in, then 64 DELs: through the shim and the agent's CNI server as
shipped (``dist/rdma-cni-shim``, ``rdma-cni cni-server``), through the fat
binary (``--mode fat``: the launcher and its warm server), and with
``--previous DIR`` through a previous build's shim and agent too; beside
it, Debian's Go host-device plugin moves the same 64 veth "VFs" into the
same 64 network namespaces with the same host-local IPAM, also 64 at once.
``--bursts N`` repeats the whole round, modes interleaved. Reports errors,
wall time, per-call p50/p95/max and rdma-cni's node lock waits and hold
times (from its log). Then the cost of each extra interface: a pod with 8
interfaces against one with 1, ADD and DEL, sequentially (the fat binary).
Root needed. A script, not a timed test.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.datapath_bench import private_cache, stop_private_cache, wait_for_warm_server
from benchmarks.shim_bench import Agent
from tests.support.apiserver import ApiServer
from tests.support.simnode import SimNode, SimPf, add_netns, del_netns, ip

PFS, VFS_PER_PF = 4, 16


def launch_all(calls: list[tuple[list[str], dict[str, str], bytes]]) -> tuple[float, list[float], list[str]]:
    """Start every call at once; wall time, each call's duration (ms, start to exit) and the failures."""
    started: dict[int, tuple[float, subprocess.Popen[bytes]]] = {}
    begin = time.perf_counter()
    for cmd, env, stdin in calls:
        proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        started[proc.pid] = (time.perf_counter(), proc)
        assert proc.stdin is not None
        proc.stdin.write(stdin)
        proc.stdin.close()
    durations: list[float] = []
    errors: list[str] = []
    # Reap in exit order (outputs are far smaller than a pipe buffer), so each duration ends at its exit.
    for _ in started:
        pid, status, _usage = os.wait4(-1, 0)
        t0, proc = started[pid]
        durations.append((time.perf_counter() - t0) * 1000)
        proc.returncode = os.waitstatus_to_exitcode(status)
        assert proc.stdout is not None and proc.stderr is not None
        out, err = proc.stdout.read(), proc.stderr.read()
        proc.stdout.close()
        proc.stderr.close()
        if proc.returncode != 0:
            errors.append(f"exit {proc.returncode}: {out.decode()[:300]} {err.decode()[:300]}")
    return (time.perf_counter() - begin) * 1000, durations, errors


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def row(name: str, wall: float, durations: list[float], errors: list[str]) -> str:
    return (
        f"| {name} | {len(durations)} | {len(errors)} | {wall:.0f} | {statistics.median(durations):.0f} | "
        f"{percentile(durations, 0.95):.0f} | {max(durations):.0f} |"
    )


def lock_stats(log: str, since: int) -> tuple[list[float], list[float]]:
    """Node lock waits and holds logged after byte offset ``since``."""
    with open(log) as f:
        f.seek(since)
        text = f.read()
    pairs = re.findall(r"node lock: waited ([0-9.]+) ms, held ([0-9.]+) ms", text)
    return [float(w) for w, _ in pairs], [float(h) for _, h in pairs]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--binary", default="dist/rdma-cni")
    parser.add_argument("--shim", default="dist/rdma-cni-shim")
    parser.add_argument("--previous", help="a directory with a previous build's rdma-cni and rdma-cni-shim")
    parser.add_argument("--bursts", type=int, default=1, help="rounds of every mode, interleaved")
    parser.add_argument("--no-fat", action="store_true", help="leave the fat binary's bursts out")
    parser.add_argument("--runs", type=int, default=10, help="sequential cycles for the 8-vs-1 comparison")
    args = parser.parse_args()
    binary = os.path.abspath(args.binary)
    agents: list[Agent] = []
    tag = f"s{os.getpid() % 10000}"
    tmp = tempfile.mkdtemp(prefix="rdma-cni-scale-")
    node = SimNode(
        os.path.join(tmp, "node"), [SimPf(f"{tag}pf{k}", VFS_PER_PF, 100000) for k in range(PFS)], tag
    )
    api = ApiServer(os.path.join(tmp, "api"))
    names = [f"{tag}-{n}" for n in range(PFS * VFS_PER_PF)]
    log = os.path.join(tmp, "rdma-cni.log")
    cache, tree = private_cache(tmp, binary)
    try:
        node.up()
        api.start()
        kubeconfig = api.write_kubeconfig(os.path.join(tmp, "kubeconfig"), mode="token")
        netns = [add_netns(name) for name in names]
        for n in range(len(names)):
            api.add_pod("default", f"pod-{n}", {"rdma_interfaces_required": '[{"min_tx_rate": 1000}]'})
        api.add_pod("default", "one", {"rdma_interfaces_required": json.dumps([{"min_tx_rate": 100}])})
        api.add_pod("default", "eight", {"rdma_interfaces_required": json.dumps([{"min_tx_rate": 100}] * 8)})
        ipam = {
            "type": "host-local",
            "ranges": [[{"subnet": "10.90.0.0/16"}]],
            "dataDir": os.path.join(tmp, "ipam"),
        }
        conf = json.dumps(
            {
                "cniVersion": "1.0.0",
                "name": "scale",
                "type": "rdma-cni",
                "kubeconfig": kubeconfig,
                "stateDir": os.path.join(tmp, "state"),
                "lockFile": os.path.join(tmp, "lock"),
                "ipam": ipam,
                "logFile": log,
            }
        ).encode()
        base = {
            "PATH": os.environ.get("PATH", ""),
            "CNI_PATH": "/usr/lib/cni",
            "CNI_IFNAME": "net1",
            **node.env(),
        }
        ours_base = {**base, "RDMA_CNI_CACHE_DIR": cache}

        def ours(verb: str, n: int, pod: str = "") -> tuple[list[str], dict[str, str], bytes]:
            env = {
                **ours_base,
                "CNI_COMMAND": verb,
                "CNI_CONTAINERID": f"scale{n}",
                "CNI_NETNS": netns[n],
                "CNI_ARGS": f"IgnoreUnknown=true;K8S_POD_NAMESPACE=default;K8S_POD_NAME={pod or f'pod-{n}'}",
            }
            return [binary], env, conf

        def through(agent: Agent, shim: str) -> Callable[[str, int], tuple[list[str], dict[str, str], bytes]]:
            def make(verb: str, n: int) -> tuple[list[str], dict[str, str], bytes]:
                _cmd, env, stdin = ours(verb, n)
                env = {k: v for k, v in env.items() if k.startswith("CNI_")}
                return [shim], {**env, "PATH": base["PATH"], "RDMA_CNI_SHIM_SOCKET": agent.socket}, stdin

            return make

        def theirs(verb: str, n: int) -> tuple[list[str], dict[str, str], bytes]:
            k, i = divmod(n, VFS_PER_PF)
            doc = {
                "cniVersion": "1.0.0",
                "name": "scale-hd",
                "type": "host-device",
                "device": node.vf_netdev(k, i),
                "ipam": {**ipam, "dataDir": os.path.join(tmp, "ipam-hd")},
            }
            env = {**base, "CNI_COMMAND": verb, "CNI_CONTAINERID": f"hd{n}", "CNI_NETNS": netns[n]}
            return ["/usr/lib/cni/host-device"], env, json.dumps(doc).encode()

        # The first start of a binary is cold and starts its warm server: not counted.
        subprocess.run(
            [binary],
            env={**ours_base, "CNI_COMMAND": "VERSION"},
            input=b"{}",
            capture_output=True,
            check=False,
        )
        wait_for_warm_server(tree)
        count = len(names)
        server_env = {k: v for k, v in base.items() if not k.startswith("CNI_")}
        modes: dict[str, Callable[[str, int], tuple[list[str], dict[str, str], bytes]]] = {
            "host-device (Go)": theirs
        }
        rig = SimpleNamespace(conf=json.loads(conf))
        builds = {"this build": (binary, os.path.abspath(args.shim))}
        if args.previous:
            prev = os.path.abspath(args.previous)
            builds["previous build"] = (os.path.join(prev, "rdma-cni"), os.path.join(prev, "rdma-cni-shim"))
        for label, (build, shim) in builds.items():
            agent = Agent(build, tmp, label.replace(" ", "-"), rig, server_env)  # type: ignore[arg-type]
            agents.append(agent)
            modes[f"rdma-cni shim -> agent, {label}"] = through(agent, shim)
        if not args.no_fat:
            modes["rdma-cni fat binary (warm start)"] = ours
        print(f"| {count} pods at once, 1 VF each | calls | errors | wall ms | p50 ms | p95 ms | max ms |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        results: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.bursts):
            for label, make in modes.items():
                for verb in ("ADD", "DEL"):
                    offset = os.path.getsize(log) if os.path.exists(log) else 0
                    wall, durations, errors = launch_all([make(verb, n) for n in range(count)])
                    results.setdefault((label, verb), []).append(wall)
                    print(row(f"{label} {verb}", wall, durations, errors))
                    for error in errors[:3]:
                        print(f"    {error}", file=sys.stderr)
                    if make is not theirs:
                        waits, holds = lock_stats(log, offset)
                        if holds:
                            p50, p95 = statistics.median(holds), percentile(holds, 0.95)
                            worst = f"hold max {max(holds):.1f}, wait max {max(waits):.0f}"
                            print(
                                f"|   node lock ({verb}) | {len(holds)} | | | hold p50 {p50:.1f} "
                                f"| hold p95 {p95:.1f} | {worst} |"
                            )
            print(f"load average {os.getloadavg()[0]:.2f} after the round")
        go = statistics.median(results[("host-device (Go)", "ADD")]) + statistics.median(
            results[("host-device (Go)", "DEL")]
        )
        for label in modes:
            mine = statistics.median(results[(label, "ADD")]) + statistics.median(results[(label, "DEL")])
            print(f"wall ADD+DEL of {count}, {label}: {mine:.0f} ms ({mine / go:.2f}x host-device's)")

        # Cost per extra interface: 8 interfaces against 1, sequential, medians.
        per: dict[str, dict[str, list[float]]] = {
            "one": {"ADD": [], "DEL": []},
            "eight": {"ADD": [], "DEL": []},
        }
        for _ in range(args.runs):
            for pod in per:
                for verb in ("ADD", "DEL"):
                    wall, _, errors = launch_all([ours(verb, 0, pod)])
                    if errors:
                        raise SystemExit(f"{pod} {verb}: {errors[0]}")
                    per[pod][verb].append(wall)
        print("\n| pod | ADD median ms | DEL median ms |")
        print("| --- | ---: | ---: |")
        for pod, label in (("one", "1 interface"), ("eight", "8 interfaces")):
            add, delete = statistics.median(per[pod]["ADD"]), statistics.median(per[pod]["DEL"])
            print(f"| {label} | {add:.1f} | {delete:.1f} |")
        for verb in ("ADD", "DEL"):
            extra = (statistics.median(per["eight"][verb]) - statistics.median(per["one"][verb])) / 7
            print(f"{verb}: {extra:.1f} ms per extra interface (warm start, {args.runs} runs each)")
    finally:
        for agent in agents:
            agent.stop()
        stop_private_cache(cache, tree)
        for name in names:
            del_netns(name)
        for k, i in node.all_vfs():
            ip("link", "del", node.vf_wire(k, i), check=False)
        api.stop()
        node.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
