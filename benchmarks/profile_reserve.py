"""ADD's part under the node lock alone: :func:`rdma_cni.verbs.add.reserve`, N times in a row in one process.

A simulated node (``--pfs`` x ``--vfs``, 4 x 16 by default: the node of
``scale_bench.py``) and one state directory; this process runs ``survey``
before the node lock and ``reserve`` under it, as ADD does, once per VF, each
time for a new attachment (its record stays, so each run reads one record more
than the one before), as one of the agent's verb workers would (its caches
kept between verbs).
No namespace move, no IPAM: only what the lock covers. Printed: the median
and p95 of the hold and of each part (reading the records, the node's sysfs,
the choice with its proof, the intent record's write), over
all runs and over the last quarter (the fullest node); with ``--profile`` the
cProfile of all runs by own time. Root needed (veths). A diagnostic script,
not a timed test.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support.simnode import SimNode, SimPf

PARTS: dict[str, list[float]] = {}


@contextlib.contextmanager
def timed(part: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        PARTS.setdefault(part, []).append((time.perf_counter() - start) * 1000)


def wrap(module: Any, name: str, part: str) -> None:
    """Time every call of ``module.name`` as ``part``."""
    original: Callable[..., Any] = getattr(module, name)

    def timed_call(*args: Any, **kwargs: Any) -> Any:
        with timed(part):
            return original(*args, **kwargs)

    setattr(module, name, timed_call)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pfs", type=int, default=4)
    parser.add_argument("--vfs", type=int, default=16, help="VFs per PF")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="rdma-cni-reserve-")
    tag = f"r{os.getpid() % 10000}"
    pfs = [SimPf(f"{tag}pf{k}", args.vfs, 100000) for k in range(args.pfs)]
    node = SimNode(os.path.join(tmp, "node"), pfs, tag)
    node.up()
    os.environ.update(node.env())
    try:
        from rdma_cni.cni.config import load_netconf
        from rdma_cni.cni.protocol import CniEnv
        from rdma_cni.kernel.identity import VfFinder
        from rdma_cni.kernel.netlink import Rtnl
        from rdma_cni.node.ipam_pending import PendingStore
        from rdma_cni.node.record import RecordStore, node_lock
        from rdma_cni.shared.podrequest import InterfaceRequest, PodRequest
        from rdma_cni.verbs import add

        # Whichever way this version reads the records under the lock.
        for name in ("all", "derived"):
            if hasattr(add.RecordStore, name):
                wrap(add.RecordStore, name, "records")
        wrap(add, "scan", "sysfs scan")
        if hasattr(add, "reowned"):
            wrap(add, "reowned", "survey brought up to date")
        wrap(add, "choose_proven", "choice and proof")
        wrap(add, "plan", "plan")
        wrap(add.RecordStore, "write", "intent record write")
        doc = {
            "cniVersion": "1.0.0",
            "name": "reserve",
            "type": "rdma-cni",
            "stateDir": os.path.join(tmp, "state"),
            "lockFile": os.path.join(tmp, "lock"),
        }
        conf = load_netconf(doc)
        store = RecordStore(conf.stateDir)
        pendings = PendingStore(conf.stateDir)
        request = PodRequest(interfaces=[InterfaceRequest(min_tx_rate=1000)])
        profiler = cProfile.Profile() if args.profile else None
        holds = []
        for n in range(args.pfs * args.vfs):
            env = CniEnv(command="ADD", container_id=f"c{n}", netns="/proc/self/ns/net", ifname="net1")
            with Rtnl() as host:
                finder = VfFinder(host)
                finder.trust_sysfs()  # as ADD does, before the lock
                with timed("survey (before the lock)"):
                    draft = add.survey(conf, store)
                start = time.perf_counter()
                if profiler:
                    profiler.enable()
                with node_lock(conf.lockFile, 10):
                    add.reserve(
                        env,
                        conf,
                        doc,
                        store,
                        pendings,
                        finder,
                        request,
                        ["net1"],
                        "",
                        "bench",
                        [1, 2],
                        draft,
                    )
                if profiler:
                    profiler.disable()
                holds.append((time.perf_counter() - start) * 1000)
        rows = {"hold": holds, **PARTS}
        quarter = len(holds) // 4
        print(f"| {len(holds)} reserves in a row | p50 ms | p95 ms | p50 of the last {quarter} ms |")
        print("| --- | ---: | ---: | ---: |")
        for part, values in rows.items():
            p95 = sorted(values)[int(0.95 * (len(values) - 1))]
            tail = statistics.median(values[-quarter:])
            print(f"| {part} | {statistics.median(values):.2f} | {p95:.2f} | {tail:.2f} |")
        if profiler:
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)
    finally:
        node.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
