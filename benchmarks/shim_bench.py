"""The shipped path's cost: ADD+DEL through the host shim and the agent, beside Go host-device, in one run.

On one simulated node (one veth "VF", the pod read from the HTTPS API stand-in,
Debian's host-local), interleaved cycle by cycle:

- ``shim -> agent``: ``dist/rdma-cni-shim`` handing each call to ``rdma-cni
  cni-server`` (the agent's CNI server) of this build, as shipped;
- ``fat binary``: ``dist/rdma-cni`` run directly (``--mode fat``), its
  launcher handing the call to its warm server;
- each of those of a previous build too (``--previous DIR``, holding that
  build's ``rdma-cni`` and ``rdma-cni-shim``: today's ``dist/`` kept before a change);
- Go host-device moving the same veth into the same namespace with the same host-local.

Reported per mode: median wall time of ADD and DEL, the ratio of ADD+DEL to
host-device's, and per verb the CPU time and the minor page faults of every
process the call went through (the shim or launcher, the agent with its
workers or the warm server with its children, the IPAM guard and host-local),
which a loaded machine does not inflate as it does wall time. Then, per build,
``--starts`` fresh agents (each with its own cache, so it unpacks the binary
as a restarted container does): the time until the server says it listens,
and its first ADD and DEL against the warm medians. Then memory: the agent,
its zygote and workers (this build), the agent and its warm server (previous).
Root needed. A script, not a timed test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.datapath_bench import Rig, one_pod_rig, private_cache, stop_private_cache
from tests.support.processes import cache_id, children_of, warm_servers
from tests.support.simnode import SimPf, ip

GO = "host-device (Go)"


def _stat(pid: int) -> tuple[float, int, str] | None:
    """(CPU s of the process and its reaped children, their minor faults, its state), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(") ", 1)[1].split()
    except OSError:
        return None
    ticks = sum(int(fields[i]) for i in (11, 12, 13, 14))
    return ticks / os.sysconf("SC_CLK_TCK"), int(fields[7]) + int(fields[8]), fields[0]


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo.extend(children_of(current))
    return out


@dataclass
class Mode:
    """One way of running the plugin: a command, its environment and config, and whose CPU it costs."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    conf: dict[str, object]
    # Processes besides our own children whose CPU and faults the call costs (an agent's tree, a warm server).
    tree: Callable[[], list[int]] = lambda: []
    wall: dict[str, list[float]] = field(default_factory=lambda: {"ADD": [], "DEL": []})
    cpu: dict[str, list[float]] = field(default_factory=lambda: {"ADD": [], "DEL": []})
    faults: dict[str, list[int]] = field(default_factory=lambda: {"ADD": [], "DEL": []})

    def sample(self) -> tuple[float, int]:
        own = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu, faults = own.ru_utime + own.ru_stime, own.ru_minflt
        for pid in self.tree():
            got = _stat(pid)
            if got is not None:
                cpu += got[0]
                faults += got[1]
        return cpu, faults

    def settle(self) -> None:
        """Wait for the tree to go idle (a worker's clean-up after its answer, a warm child's exit)."""
        deadline = time.monotonic() + 1.0
        time.sleep(0.02)
        while time.monotonic() < deadline:
            states = [_stat(p) for p in self.tree()]
            if all(s is None or s[2] in "SIZ" for s in states) and not any(
                children_of(p) for p in self.tree() if p in servers_of_fat
            ):
                return
            time.sleep(0.01)

    def once(self, verb: str, record: bool = True) -> tuple[float, bytes]:
        before = self.sample()
        start = time.perf_counter()
        proc = subprocess.run(
            self.cmd,
            input=json.dumps(self.conf).encode(),
            env={**self.env, "CNI_COMMAND": verb},
            capture_output=True,
            check=False,
        )
        elapsed = (time.perf_counter() - start) * 1000
        if proc.returncode != 0:
            raise SystemExit(f"{self.name} {verb} failed: {proc.stdout.decode()} {proc.stderr.decode()}")
        self.settle()
        after = self.sample()
        if record:
            self.wall[verb].append(elapsed)
            self.cpu[verb].append((after[0] - before[0]) * 1000)
            self.faults[verb].append(after[1] - before[1])
        return elapsed, proc.stdout


# Warm servers of the fat binary's modes: their children must be reaped before a sample.
servers_of_fat: set[int] = set()


def knows_kubeconfig(binary: str, tmp: str) -> bool:
    """Whether ``binary cni-server`` takes ``--kubeconfig`` (asked with a cache of its own)."""
    out = subprocess.run(
        [binary, "cni-server", "--help"],
        env={"PATH": os.environ.get("PATH", ""), "RDMA_CNI_CACHE_DIR": os.path.join(tmp, "probe-cache")},
        capture_output=True,
        check=False,
    )
    return b"--kubeconfig" in out.stdout


class Agent:
    """``rdma-cni cni-server`` of one build on its own socket and cache, on the rig's state."""

    def __init__(self, binary: str, tmp: str, name: str, rig: Rig, env: dict[str, str]) -> None:
        self.binary = binary
        self.dir = os.path.join(tmp, name)
        os.makedirs(self.dir, exist_ok=True)
        self.socket = os.path.join(self.dir, "agent", "cni.sock")
        self.cache = os.path.join(self.dir, "cache")
        self.tree_dir = os.path.join(self.cache, cache_id(binary))
        conf = rig.conf
        # As shipped, the agent names the kubeconfig it writes, and its workers connect ahead
        # (a build from before that option is run as it was).
        ahead = ["--kubeconfig", str(conf["kubeconfig"])] if knows_kubeconfig(binary, tmp) else []
        started = time.perf_counter()
        self.proc = subprocess.Popen(
            [
                binary,
                "cni-server",
                *("--socket", self.socket),
                *("--state-dir", str(conf["stateDir"]), "--lock-file", str(conf["lockFile"])),
                *ahead,
            ],
            env={**env, "RDMA_CNI_CACHE_DIR": self.cache},
            stdout=subprocess.PIPE,
            stderr=open(os.path.join(self.dir, "server.log"), "ab"),  # noqa: SIM115 - the server keeps it
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"{binary} cni-server did not start: see {self.dir}/server.log")
        json.loads(line)
        self.ready_after = time.perf_counter() - started

    def tree(self) -> list[int]:
        pids = descendants(self.proc.pid)
        # A previous build's server runs the launcher, whose warm server lives outside its tree.
        return pids + [p for p in warm_servers(self.tree_dir) if p not in pids]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        stop_private_cache(self.cache, self.tree_dir)


def fat_tree(tree_dir: str) -> Callable[[], list[int]]:
    def tree() -> list[int]:
        pids = warm_servers(tree_dir)
        servers_of_fat.update(pids)
        return pids

    return tree


def memory(pid: int) -> dict[str, float]:
    """RSS, Pss and USS (private pages) of ``pid`` in MiB."""
    out = {"Rss": 0.0, "Pss": 0.0, "Uss": 0.0}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("Rss", "Pss"):
                    out[key] = int(value.split()[0]) / 1024
                elif key in ("Private_Clean", "Private_Dirty"):
                    out["Uss"] += int(value.split()[0]) / 1024
    except OSError:
        pass
    return out


def describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return "?"
    return " ".join(a.decode(errors="replace") for a in argv[1:3] if a) or os.path.basename(argv[0].decode())


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--binary", default="dist/rdma-cni")
    parser.add_argument("--shim", default="dist/rdma-cni-shim")
    parser.add_argument("--previous", help="a directory with a previous build's rdma-cni and rdma-cni-shim")
    parser.add_argument("--runs", type=int, default=20, help="interleaved warm cycles")
    parser.add_argument("--starts", type=int, default=3, help="fresh agents per build for the first verb")
    parser.add_argument("--no-fat", action="store_true", help="leave the fat binary out")
    args = parser.parse_args()
    builds = {"this build": (os.path.abspath(args.binary), os.path.abspath(args.shim))}
    if args.previous:
        prev = os.path.abspath(args.previous)
        builds["previous build"] = (os.path.join(prev, "rdma-cni"), os.path.join(prev, "rdma-cni-shim"))
    print(
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC on {platform.node()}, "
        f"{os.cpu_count()} CPUs, {platform.release()}; load average {os.getloadavg()[0]:.2f} at the start"
    )
    tmp = tempfile.mkdtemp(prefix="rdma-cni-shim-bench-")
    rig = one_pod_rig(tmp, "shimbench", [SimPf("shimpf0", 1, 25000)], "sb", "10.89.0.0/24")
    # The server has the node's environment (as the DaemonSet has); the shim only what a runtime sets.
    server_env = {k: v for k, v in rig.env.items() if not k.startswith("CNI_")}
    shim_env = {k: v for k, v in rig.env.items() if k.startswith("CNI_")}
    theirs = {
        "cniVersion": "1.0.0",
        "name": "shimbench-hd",
        "type": "host-device",
        "device": rig.node.vf_netdev(0, 0),
        "ipam": {**rig.ipam, "dataDir": os.path.join(tmp, "ipam-hd")},
    }
    agents: dict[str, Agent] = {}
    caches: list[tuple[str, str]] = []
    modes: list[Mode] = [Mode(GO, ["/usr/lib/cni/host-device"], rig.cni_env, theirs)]
    try:
        for label, (binary, shim) in builds.items():
            agent = agents[label] = Agent(binary, tmp, label.replace(" ", "-"), rig, server_env)
            modes.append(
                Mode(
                    f"shim -> agent, {label}",
                    [shim],
                    {**shim_env, "RDMA_CNI_SHIM_SOCKET": agent.socket},
                    rig.conf,
                    agent.tree,
                )
            )
            if not args.no_fat:
                fat_dir = os.path.join(tmp, label.replace(" ", "-") + "-fat")
                os.makedirs(fat_dir)
                cache, tree = private_cache(fat_dir, binary)
                caches.append((cache, tree))
                modes.append(
                    Mode(
                        f"fat binary, {label}",
                        [binary],
                        {**rig.env, "RDMA_CNI_CACHE_DIR": cache},
                        rig.conf,
                        fat_tree(tree),
                    )
                )
        for mode in modes:  # untimed: a fat binary's first call starts its warm server
            for verb in ("ADD", "DEL"):
                mode.once(verb, record=False)
            time.sleep(0.5)
            for verb in ("ADD", "DEL"):
                mode.once(verb, record=False)
        for _ in range(args.runs):
            for mode in modes:
                for verb in ("ADD", "DEL"):
                    mode.once(verb)
        load_warm = os.getloadavg()[0]
        print(f"\n### Warm, {args.runs} interleaved cycles (load average {load_warm:.2f} at the end)\n")
        print("| plugin | ADD ms | DEL ms | ADD+DEL ms | against Go | CPU ms ADD / DEL ", end="")
        print("| page faults ADD / DEL |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        go = med(modes[0].wall["ADD"]) + med(modes[0].wall["DEL"])
        for mode in modes:
            a, d = med(mode.wall["ADD"]), med(mode.wall["DEL"])
            print(
                f"| {mode.name} | {a:.1f} | {d:.1f} | {a + d:.1f} | {(a + d) / go:.2f}x "
                f"| {med(mode.cpu['ADD']):.1f} / {med(mode.cpu['DEL']):.1f} "
                f"| {med(mode.faults['ADD']):.0f} / {med(mode.faults['DEL']):.0f} |"
            )
        print("\n### Memory of the warm agents (MiB: resident, proportional, private)\n")
        print("| build | process | Rss | Pss | Uss |")
        print("| --- | --- | ---: | ---: | ---: |")
        for label, agent in agents.items():
            total = {"Rss": 0.0, "Pss": 0.0, "Uss": 0.0}
            for pid in agent.tree():
                m = memory(pid)
                for k in total:
                    total[k] += m[k]
                sizes = f"{m['Rss']:.1f} | {m['Pss']:.1f} | {m['Uss']:.1f}"
                print(f"| {label} | {pid} {describe(pid)} | {sizes} |")
            print(f"| {label} | all | {total['Rss']:.1f} | {total['Pss']:.1f} | {total['Uss']:.1f} |")
        for agent in agents.values():
            agent.stop()
        agents.clear()

        starts = args.starts
        print(f"\n### First verbs after an agent starts ({starts} fresh agents per build, own cache each)\n")
        print("| build | listening after s | first ADD ms | first DEL ms | first ADD / warm ADD ", end="")
        print("| first ADD+DEL / warm |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for label, (binary, shim) in builds.items():
            warm_mode = next(m for m in modes if m.name == f"shim -> agent, {label}")
            warm_add, warm_del = med(warm_mode.wall["ADD"]), med(warm_mode.wall["DEL"])
            for n in range(args.starts):
                agent = Agent(binary, tmp, f"{label.replace(' ', '-')}-start{n}", rig, server_env)
                try:
                    mode = Mode("first", [shim], {**shim_env, "RDMA_CNI_SHIM_SOCKET": agent.socket}, rig.conf)
                    first_add, _ = mode.once("ADD", record=False)
                    first_del, _ = mode.once("DEL", record=False)
                finally:
                    agent.stop()
                both = (first_add + first_del) / (warm_add + warm_del)
                print(
                    f"| {label} | {agent.ready_after:.2f} | {first_add:.1f} | {first_del:.1f} "
                    f"| {first_add / warm_add:.2f}x | {both:.2f}x |"
                )
        print(f"\nload average {os.getloadavg()[0]:.2f} at the end")
    finally:
        for agent in agents.values():
            agent.stop()
        for cache, tree in caches:
            stop_private_cache(cache, tree)
        ip("link", "del", rig.node.vf_wire(0, 0), check=False)
        rig.down()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    sys.exit(main())
