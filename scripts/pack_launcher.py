"""Pack the PyInstaller one-dir build behind the C launcher into one executable.

Layout of the output: the launcher program, then one entry per file of the
tree (header: u32 path length, u32 mode, u64 size; then the path and the
bytes), then a 40-byte trailer: magic ``RDMACNI\\x01``, u64 offset of the
first entry, u64 entry count, 16 hex characters of the payload's sha256 (the
cache key). Entries are sorted so the same tree always packs to the same bytes.
See launcher/launcher.c for the reading side.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import stat
import struct
import sys

MAGIC = b"RDMACNI\x01"


def entries(tree: str) -> list[tuple[str, int, bytes]]:
    """(relative path, mode, content) of every regular file under ``tree``."""
    out = []
    for dirpath, dirnames, filenames in os.walk(tree):
        dirnames.sort()
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            if not stat.S_ISREG(st.st_mode):
                raise SystemExit(f"{full}: only regular files can be packed")
            with open(full, "rb") as f:
                out.append((os.path.relpath(full, tree), stat.S_IMODE(st.st_mode), f.read()))
    return out


def pack(launcher: str, tree: str, output: str) -> str:
    """Write the packed executable; returns its cache id."""
    with open(launcher, "rb") as f:
        head = f.read()
    files = entries(tree)
    if "rdma-cni" not in {p for p, _, _ in files}:
        raise SystemExit(f"{tree} has no top-level rdma-cni program")
    body = bytearray()
    for path, mode, data in files:
        encoded = path.encode()
        body += struct.pack("<IIQ", len(encoded), mode, len(data)) + encoded + data
    cache_id = hashlib.sha256(bytes(body)).hexdigest()[:16]
    trailer = MAGIC + struct.pack("<QQ", len(head), len(files)) + cache_id.encode()
    tmp = output + ".tmp"
    with open(tmp, "wb") as f:
        f.write(head + bytes(body) + trailer)
    os.chmod(tmp, 0o755)
    os.rename(tmp, output)
    return cache_id


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launcher", required=True)
    parser.add_argument("--tree", required=True)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    cache_id = pack(args.launcher, args.tree, args.output)
    print(f"{args.output}: {os.path.getsize(args.output) / 1e6:.1f} MB, cache id {cache_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
