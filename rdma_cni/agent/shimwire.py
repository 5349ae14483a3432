"""The shim's wire format (launcher/shim.h): one request, one answer, over the agent's unix socket.

A request is a fixed header, the runtime's ``CNI_*`` variables (NUL-separated
``KEY=VALUE``) and the network configuration as the runtime gave it; the
pod's network namespace travels beside the header as an fd. The same bytes,
without the fd, are what a DEL spooled while the agent was down holds
(:mod:`rdma_cni.agent.delspool`). Everything here is read from another
process, so every length is bounded before anything is read.
"""

from __future__ import annotations

import dataclasses
import struct

REQUEST_MAGIC = b"RCNISHQ1"
ANSWER_MAGIC = b"RCNISHA1"
REQUEST_HEADER = struct.Struct("=8sIIIi")
ANSWER_HEADER = struct.Struct("=8siIII")
FLAG_NETNS = 1
MAX_ENV = 64 << 10
# The plugin refuses a configuration over 1 MiB itself; one byte more tells it to.
MAX_STDIN = (1 << 20) + 1
# The variables a runtime's call may set for the plugin; nothing else is taken from a caller.
FORWARDED = ("CNI_COMMAND", "CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_ARGS", "CNI_PATH")


class WireError(ValueError):
    """A request that is not one the shim sends (wrong magic, a length out of bounds, bad variables)."""


@dataclasses.dataclass
class Header:
    """A request's fixed part."""

    env_len: int
    stdin_len: int
    flags: int
    netns_errno: int

    @property
    def has_netns(self) -> bool:
        """Whether the pod's network namespace came with the request."""
        return bool(self.flags & FLAG_NETNS)


@dataclasses.dataclass
class Request:
    """One CNI call as the runtime made it: its ``CNI_*`` variables and its stdin."""

    env: dict[str, str]
    stdin: bytes
    netns_errno: int = 0

    @property
    def command(self) -> str:
        """``CNI_COMMAND``."""
        return self.env.get("CNI_COMMAND", "")


def parse_header(raw: bytes) -> Header:
    """The header, checked: WireError unless it is one the shim could have sent."""
    if len(raw) != REQUEST_HEADER.size:
        raise WireError("short request header")
    magic, env_len, stdin_len, flags, netns_errno = REQUEST_HEADER.unpack(raw)
    if magic != REQUEST_MAGIC:
        raise WireError("not an rdma-cni shim request")
    if env_len > MAX_ENV or stdin_len > MAX_STDIN:
        raise WireError(f"request too large (environment {env_len} bytes, stdin {stdin_len} bytes)")
    if flags & ~FLAG_NETNS or not 0 <= netns_errno < 4096:
        raise WireError("unknown request flags")
    return Header(env_len, stdin_len, flags, netns_errno)


def parse_env(raw: bytes) -> dict[str, str]:
    """The ``CNI_*`` variables of a request; WireError for anything else in it."""
    env: dict[str, str] = {}
    for entry in raw.split(b"\0"):
        if not entry:
            continue
        key, sep, value = entry.partition(b"=")
        name = key.decode("ascii", "replace")
        if not sep or name not in FORWARDED:
            raise WireError(f"variable {name[:40]!r} is not one the shim forwards")
        env[name] = value.decode("utf-8", "surrogateescape")
    return env


def encode_request(env: dict[str, str], stdin: bytes, *, netns: bool = False, netns_errno: int = 0) -> bytes:
    """The bytes the shim sends (and spools) for a call: for tests and tools."""
    blob = b"".join(f"{k}={v}".encode("utf-8", "surrogateescape") + b"\0" for k, v in env.items())
    flags = FLAG_NETNS if netns else 0
    return REQUEST_HEADER.pack(REQUEST_MAGIC, len(blob), len(stdin), flags, netns_errno) + blob + stdin


def encode_answer(status: int, stdout: bytes, stderr: bytes) -> bytes:
    """The answer to one request: the plugin's exit status, stdout and stderr."""
    return ANSWER_HEADER.pack(ANSWER_MAGIC, status, len(stdout), len(stderr), 0) + stdout + stderr


def decode_answer(raw: bytes) -> tuple[int, bytes, bytes]:
    """Exit status, stdout and stderr of a whole answer (for tests)."""
    magic, status, out_len, err_len, _ = ANSWER_HEADER.unpack_from(raw)
    if magic != ANSWER_MAGIC:
        raise WireError("not an rdma-cni answer")
    body = raw[ANSWER_HEADER.size :]
    return status, body[:out_len], body[out_len : out_len + err_len]
