"""ADD+DEL through the host shim, beside the fat binary run directly and Go host-device, in one run.

The thick design's cost: the shim (launcher/shim.c) connects to the agent's
CNI server (``rdma-cni cni-server``), which starts the plugin as a runtime
would; the plugin then goes through its warm server as usual. The fat binary
is run the way the runtime runs it today (the launcher hands the call to the
same warm server). host-device moves the same kind of device with the same
IPAM (benchmarks/datapath_bench.py). Warm and cold (``RDMA_CNI_WARM=0``, for
the shim in the agent's environment, where the plugin runs). Interleaved,
medians of wall time.
Root needed. A script, not a timed test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.datapath_bench import (
    one_pod_rig,
    private_cache,
    stop_private_cache,
    timed,
    wait_for_warm_server,
)
from tests.support.simnode import SimPf, ip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--binary", default="dist/rdma-cni")
    parser.add_argument("--shim", default="dist/rdma-cni-shim")
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    binary, shim = os.path.abspath(args.binary), os.path.abspath(args.shim)
    tmp = tempfile.mkdtemp(prefix="rdma-cni-shim-bench-")
    rig = one_pod_rig(tmp, "shimbench", [SimPf("shimpf0", 1, 25000)], "sb", "10.89.0.0/24")
    cache, tree = private_cache(tmp, binary)
    ours_env = {**rig.env, "RDMA_CNI_CACHE_DIR": cache}
    socket_path = os.path.join(tmp, "agent", "cni.sock")
    cold_socket = os.path.join(tmp, "agent-cold", "cni.sock")
    # The server has the node's environment (as the DaemonSet has); the shim only what a runtime sets.
    server_env = {k: v for k, v in ours_env.items() if not k.startswith("CNI_")}
    shim_env = {k: v for k, v in rig.env.items() if k.startswith("CNI_")}
    cold_shim_env = {**shim_env, "RDMA_CNI_SHIM_SOCKET": cold_socket}
    shim_env.update(RDMA_CNI_SHIM_SOCKET=socket_path)
    theirs = {
        "cniVersion": "1.0.0",
        "name": "shimbench-hd",
        "type": "host-device",
        "device": rig.node.vf_netdev(0, 0),
        "ipam": {**rig.ipam, "dataDir": os.path.join(tmp, "ipam-hd")},
    }
    modes = {
        "rdma-cni fat binary (warm start)": ([binary], ours_env, rig.conf),
        "rdma-cni shim -> agent (warm start)": ([shim], shim_env, rig.conf),
        "rdma-cni fat binary (cold, RDMA_CNI_WARM=0)": (
            [binary],
            {**ours_env, "RDMA_CNI_WARM": "0"},
            rig.conf,
        ),
        "rdma-cni shim -> agent (cold, RDMA_CNI_WARM=0 in the agent)": ([shim], cold_shim_env, rig.conf),
        "host-device (Go)": (["/usr/lib/cni/host-device"], rig.cni_env, theirs),
    }
    results: dict[str, dict[str, list[float]]] = {m: {"ADD": [], "DEL": []} for m in modes}
    servers = [
        subprocess.Popen(
            # Its release of an earlier boot's records runs on the rig's state, never the machine's.
            [
                binary,
                "cni-server",
                "--socket",
                path,
                *("--state-dir", rig.conf["stateDir"]),
                *("--lock-file", rig.conf["lockFile"]),
            ],
            env=env,
            stdout=subprocess.PIPE,
        )
        for path, env in ((socket_path, server_env), (cold_socket, {**server_env, "RDMA_CNI_WARM": "0"}))
    ]
    try:
        for server in servers:
            assert server.stdout is not None
            json.loads(server.stdout.readline())
        timed([binary], {**ours_env, "CNI_COMMAND": "VERSION"}, rig.conf)  # starts the warm server
        wait_for_warm_server(tree)
        for cmd, env, conf in modes.values():  # one untimed cycle each
            for verb in ("ADD", "DEL"):
                timed(cmd, {**env, "CNI_COMMAND": verb}, conf)
        for _ in range(args.runs):
            for mode, (cmd, env, conf) in modes.items():
                for verb in ("ADD", "DEL"):
                    results[mode][verb].append(timed(cmd, {**env, "CNI_COMMAND": verb}, conf))
    finally:
        for server in servers:
            server.terminate()
            server.wait(20)
        stop_private_cache(cache, tree)
        ip("link", "del", rig.node.vf_wire(0, 0), check=False)
        rig.down()
    print(f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {args.runs} interleaved cycles each")
    print("| plugin | ADD median ms | DEL median ms | ADD+DEL ms | ratio to Go |")
    print("| --- | ---: | ---: | ---: | ---: |")
    cycle = {m: statistics.median(r["ADD"]) + statistics.median(r["DEL"]) for m, r in results.items()}
    for mode, r in results.items():
        a, d = statistics.median(r["ADD"]), statistics.median(r["DEL"])
        print(
            f"| {mode} | {a:.1f} | {d:.1f} | {a + d:.1f} | {cycle[mode] / cycle['host-device (Go)']:.2f}x |"
        )
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
