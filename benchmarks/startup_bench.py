"""Start-up cost of the plugin: median wall time of VERSION and of a config error.

Both run through the built binary (kubelet's view), as shipped (handed to
the warm server, see docs/architecture.md) and with RDMA_CNI_WARM=0 (a cold
start every time), and, for comparison, through ``python -m rdma_cni``. A
script, not a timed test: run it with ``make bench`` or
``python benchmarks/startup_bench.py --binary dist/rdma-cni``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.datapath_bench import private_cache, stop_private_cache, wait_for_warm_server

CASES = {
    "VERSION": ({"CNI_COMMAND": "VERSION"}, {"cniVersion": "1.0.0"}),
    "config error (code 7)": (
        {
            "CNI_COMMAND": "ADD",
            "CNI_CONTAINERID": "bench",
            "CNI_NETNS": "/run/netns/none",
            "CNI_IFNAME": "net1",
            "CNI_PATH": "/usr/lib/cni",
        },
        {"cniVersion": "1.0.0", "name": "bench", "type": "rdma-cni", "rdmaIsolation": "sometimes"},
    ),
}


def measure(cmd: list[str], env: dict[str, str], stdin: bytes, runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, input=stdin, env=env, capture_output=True, check=False)
        times.append((time.perf_counter() - start) * 1000)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--binary", default="dist/rdma-cni")
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    binary = os.path.abspath(args.binary)
    tmp = tempfile.mkdtemp(prefix="rdma-cni-startup-")
    cache, tree = private_cache(tmp, binary)
    ours = {"RDMA_CNI_CACHE_DIR": cache}
    commands = {
        "dist/rdma-cni (warm start)": ([binary], ours),
        "dist/rdma-cni (cold, RDMA_CNI_WARM=0)": ([binary], {**ours, "RDMA_CNI_WARM": "0"}),
        "python -m rdma_cni": ([sys.executable, "-m", "rdma_cni"], {}),
    }
    try:
        # Launch the warm server (its first start is cold) before measuring.
        measure([binary], {"PATH": os.environ.get("PATH", ""), **ours, "CNI_COMMAND": "VERSION"}, b"{}", 1)
        wait_for_warm_server(tree)
        print("| command | case | median ms | p90 ms | runs |")
        print("| --- | --- | ---: | ---: | ---: |")
        for label, (cmd, mode_env) in commands.items():
            for case, (env_extra, conf) in CASES.items():
                env = {"PATH": os.environ.get("PATH", ""), **mode_env, **env_extra}
                times = measure(cmd, env, json.dumps(conf).encode(), args.runs)
                p90 = sorted(times)[int(len(times) * 0.9) - 1]
                print(f"| {label} | {case} | {statistics.median(times):.1f} | {p90:.1f} | {len(times)} |")
        print(f"load average {os.getloadavg()[0]:.2f} at the end")
    finally:
        stop_private_cache(cache, tree)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
