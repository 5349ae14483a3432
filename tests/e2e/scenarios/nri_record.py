"""A recording relay between an NRI plugin and the runtime's NRI socket (guest side, test use only).

The plugin connects to ``--listen``; for each connection the relay connects to
``--upstream`` (containerd's ``nri.sock``) and copies bytes both ways,
appending every chunk it moved to ``--out`` as one JSON line::

    {"conn": 1, "dir": "runtime", "t": 0.0123, "hex": "..."}

``dir`` names the receiver: "runtime" for bytes the plugin sent, "plugin" for
bytes the runtime sent; ``t`` is seconds since the relay started. The bytes
are relayed unchanged, so the plugin and the runtime see each other as they
would directly. Standard library only: it runs under the guest's python3.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import sys
import threading
import time


def relay(
    conn_no: int, plugin: socket.socket, upstream: str, out: str, start: float, lock: threading.Lock
) -> None:
    """Relay one plugin connection until either side closes."""
    runtime = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        runtime.connect(upstream)
    except OSError as exc:
        print(
            f"nri_record: connection {conn_no}: cannot reach {upstream}: {exc}", file=sys.stderr, flush=True
        )
        plugin.close()
        runtime.close()
        return
    peers = {plugin: (runtime, "runtime"), runtime: (plugin, "plugin")}
    try:
        while True:
            ready, _, _ = select.select(list(peers), [], [])
            for sock in ready:
                data = sock.recv(1 << 16)
                if not data:
                    return
                other, receiver = peers[sock]
                with lock, open(out, "a", encoding="ascii") as f:
                    line = {"conn": conn_no, "dir": receiver, "t": round(time.monotonic() - start, 4)}
                    line["hex"] = data.hex()
                    f.write(json.dumps(line) + "\n")
                other.sendall(data)
    except OSError as exc:
        print(f"nri_record: connection {conn_no} ended: {exc}", file=sys.stderr, flush=True)
    finally:
        with lock, open(out, "a", encoding="ascii") as f:
            f.write(json.dumps({"conn": conn_no, "closed": round(time.monotonic() - start, 4)}) + "\n")
        plugin.close()
        runtime.close()


def main() -> int:
    """Listen, relay and record until killed."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--listen", required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if os.path.exists(args.listen):
        os.unlink(args.listen)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(args.listen)
    server.listen()
    start = time.monotonic()
    lock = threading.Lock()
    print("listening", flush=True)
    conn_no = 0
    while True:
        plugin, _ = server.accept()
        conn_no += 1
        threading.Thread(
            target=relay, args=(conn_no, plugin, args.upstream, args.out, start, lock), daemon=True
        ).start()


if __name__ == "__main__":
    sys.exit(main())
