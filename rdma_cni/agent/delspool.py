"""DELs the shim spooled while the agent was down, run by the agent before it serves an ADD.

A runtime must always be able to delete a pod, agent or no agent. So the
shim, finding no server, writes the DEL request (the same bytes it would have
sent, without the namespace fd) into ``<socket dir>/del-spool`` atomically,
mode 0600, one file per attachment, and tells the runtime it succeeded. The
VFs stay held by their record meanwhile, so no ADD can be given them; the
pod's namespace dies with the pod, and the kernel moves a physical netdev in a
dying namespace back to the host's. When the agent's CNI server starts, and
before every ADD it serves, it runs each spooled DEL once, as a DEL with no
``CNI_NETNS`` (the runtime's namespace path means nothing by then; the plugin
takes the recorded one, as after containerd's second DEL). A DEL that fails
stays spooled and is tried again before the next ADD; the plugin's DEL is
idempotent, so running one twice is harmless.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable

from rdma_cni.agent.shimwire import REQUEST_HEADER, Request, WireError, parse_env, parse_header

log = logging.getLogger("rdma_cni.agent.cniserver")

SPOOL_NAME = "del-spool"
# What a spooled request may hold (the header's own bounds, and the file's).
MAX_FILE = REQUEST_HEADER.size + (64 << 10) + (1 << 20) + 1


def spool_dir(socket_path: str) -> str:
    """Where the shim spools DELs for the server at ``socket_path``."""
    return os.path.join(os.path.dirname(socket_path), SPOOL_NAME)


def read_spooled(path: str) -> Request:
    """One spooled request; WireError if it is not a DEL the shim wrote (owner, mode, format)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise WireError("not a private regular file of this user")
        if st.st_size > MAX_FILE:
            raise WireError(f"{st.st_size} bytes, more than a request can hold")
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(MAX_FILE + 1)
    finally:
        os.close(fd)
    header = parse_header(raw[: REQUEST_HEADER.size])
    body = raw[REQUEST_HEADER.size :]
    if len(body) != header.env_len + header.stdin_len:
        raise WireError("truncated")
    env = parse_env(body[: header.env_len])
    if env.get("CNI_COMMAND") != "DEL":
        raise WireError(f"CNI_COMMAND is {env.get('CNI_COMMAND', '')[:20]!r}, not DEL")
    # The runtime's namespace path was valid in its view, at its time: not here, not now.
    env["CNI_NETNS"] = ""
    return Request(env=env, stdin=body[header.env_len :])


def run_spool(directory: str, run: Callable[[Request], int]) -> tuple[int, int]:
    """Run every spooled DEL in ``directory`` once through ``run`` (its exit status); (done, left).

    A DEL that succeeds is removed; one that fails stays for the next pass. A
    file that is not a spooled DEL is set aside (renamed ``.bad-*``), never run.
    """
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith("del-") and n.endswith(".req"))
    except FileNotFoundError:
        return 0, 0
    done = left = 0
    for name in names:
        path = os.path.join(directory, name)
        try:
            request = read_spooled(path)
        except FileNotFoundError:
            continue
        except (OSError, WireError) as exc:
            log.error("spooled DEL %s is unusable (%s): set aside", name, exc)
            os.replace(path, os.path.join(directory, f".bad-{name}"))
            continue
        status = run(request)
        if status == 0:
            os.unlink(path)
            done += 1
            log.info("ran the spooled DEL %s", name)
        else:
            left += 1
            log.warning("the spooled DEL %s failed (exit %d): kept for the next pass", name, status)
    return done, left
