"""The extender's resident memory at its request limits (issue 21, finding 3).

Starts an extender HTTP server in a child process (no API server: NodeNames
are looked up in an empty cache, which is the same work) and sends it
``--clients`` concurrent bodies of the maximum size, ``--rounds`` times, of
the kinds that cost the most memory once decoded:

- ``objects``: a pod carrying ``[{},{},...]`` (a 64-byte dict per 3 bytes of JSON);
- ``names``: ``NodeNames`` with the most nodes a request may name, padded to the limit;
- ``fullnodes``: full Nodes with long annotations, new names every request (the
  full-Node view cache);
- ``oversized``: a Content-Length of 2 GiB, refused with 413 before any byte of it.

It prints the child's RSS before, its peak (VmHWM) and after, and how the
requests were answered (200; 503 when the in-flight body budget had no room).

    python benchmarks/extender_rss.py [--clients 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rdma_cni.extender import server as srv  # noqa: E402

CHILD = """
import sys, threading
sys.path.insert(0, {root!r})
from rdma_cni.extender.decide import Decider
from rdma_cni.extender.demand import Demands
from rdma_cni.extender.reservations import Reservations
from rdma_cni.extender.server import ExtenderServer
from rdma_cni.extender.verbs import Extender
ext = Extender(decider=Decider(max_state_age=600), demands=Demands(annotation="rdma_interfaces_required"),
               reservations=Reservations(60))
ext.ready.set()
server = ExtenderServer(("127.0.0.1", 0), ext)
print(server.server_address[1], flush=True)
server.serve_forever()
"""

POD = {
    "metadata": {
        "name": "p",
        "namespace": "default",
        "uid": "u",
        "annotations": {"rdma_interfaces_required": '[{"min_tx_rate": 1000}]'},
    }
}


def status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of ``pid`` in KiB, and its thread count."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "Threads"):
                out[key] = int(value.split()[0])
    return out


def body(kind: str, limit: int, round_: int, client: int) -> bytes:
    """A body of ``kind`` of at most ``limit`` bytes."""
    if kind == "objects":
        head = json.dumps({"Pod": dict(POD, spec={"x": []}), "NodeNames": ["n"]}).encode()
        fill = (limit - len(head) - 8) // 3
        return head.replace(b'"x": []', b'"x": [' + b",".join([b"{}"] * fill) + b"]")
    if kind == "names":
        count = srv.MAX_NODES
        pad = max(1, (limit - 200) // count - 4)
        names = [f"{round_}-{client}-{i}".ljust(pad, "x")[:pad] for i in range(count)]
        return json.dumps({"Pod": POD, "Nodes": None, "NodeNames": names}).encode()
    if kind == "fullnodes":
        note = json.dumps({"updated": 0, "pfs": [], "pods": [], "pad": "x" * 20_000})
        nodes, size, i = [], 200, 0
        while size + 20_200 < limit:
            name = f"r{round_}c{client}n{i}"
            nodes.append({"metadata": {"name": name, "annotations": {"rdma-cni/node-state": note}}})
            size += 20_200
            i += 1
        return json.dumps({"Pod": POD, "Nodes": {"items": nodes}, "NodeNames": None}).encode()
    raise ValueError(kind)


def post(port: int, data: bytes | None, length: int | None = None) -> str:
    """POST /filter; the status (or the error) as text."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            size = len(data) if data is not None else length
            sock.sendall(
                b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % size
            )
            if data is not None:
                with contextlib.suppress(OSError):  # refused (503) before all of it was read
                    sock.sendall(data)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
            return answer.split(b" ", 2)[1].decode() if answer else "closed"
    except OSError as exc:
        return type(exc).__name__


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kinds", default="objects,names,fullnodes,oversized")
    args = p.parse_args()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(root=ROOT)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        time.sleep(0.3)
        before = status(child.pid)
        print(
            f"limits: body {srv.MAX_BODY >> 20} MiB, in flight {srv.BODY_BUDGET >> 20} MiB, "
            f"{srv.MAX_NODES} nodes, {srv.MAX_CONNECTIONS} connections"
        )
        print(f"before: RSS {before['VmRSS'] / 1024:.0f} MiB, {before['Threads']} threads")
        for kind in args.kinds.split(","):
            answers: Counter[str] = Counter()
            start = time.monotonic()
            for round_ in range(args.rounds):
                bodies = [
                    None if kind == "oversized" else body(kind, srv.MAX_BODY, round_, c)
                    for c in range(args.clients)
                ]
                threads = [
                    threading.Thread(
                        target=lambda b=b, answers=answers: answers.update([post(port, b, 2 << 30)]),
                        daemon=True,
                    )
                    for b in bodies
                ]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            now = status(child.pid)
            print(
                f"{kind:>10}: {args.clients} x {args.rounds} bodies in {time.monotonic() - start:.1f} s, "
                f"answers {dict(answers)}; peak RSS so far {now['VmHWM'] / 1024:.0f} MiB, "
                f"RSS now {now['VmRSS'] / 1024:.0f} MiB"
            )
        after = status(child.pid)
        print(f"peak RSS {after['VmHWM'] / 1024:.0f} MiB (Deployment limit 512 MiB)")
    finally:
        child.kill()
        child.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
