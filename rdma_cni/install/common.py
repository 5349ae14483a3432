"""What every part of the installer uses: defaults, :class:`Options`, :class:`InstallError`, atomic writes."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import BinaryIO, TextIO

from rdma_cni.shared.atomicfile import write_atomic

DEFAULT_CNI_BIN_DIR = "/opt/cni/bin"
DEFAULT_CNI_CONF_DIR = "/etc/cni/net.d"
DEFAULT_NAME = "rdma-cni"
DEFAULT_KUBECONFIG_PATH = "/etc/cni/net.d/rdma-cni.d/rdma-cni.kubeconfig"
DEFAULT_SERVICEACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
DEFAULT_INTERVAL = 10.0


class InstallError(Exception):
    """A problem the operator must fix; the message says what and where."""


@dataclasses.dataclass
class Options:
    """Everything one install pass needs; built from the command line by :func:`main`."""

    source: str
    cni_bin_dir: str = DEFAULT_CNI_BIN_DIR
    name: str = DEFAULT_NAME
    kubeconfig_path: str = DEFAULT_KUBECONFIG_PATH
    serviceaccount_dir: str = DEFAULT_SERVICEACCOUNT_DIR
    cni_conf_dir: str = DEFAULT_CNI_CONF_DIR
    write_conf: str | None = None
    conf_source: str | None = None
    force: bool = False
    interval: float = DEFAULT_INTERVAL
    ready_file: str | None = None
    live_file: str | None = None
    environ: Mapping[str, str] = dataclasses.field(default_factory=lambda: os.environ)


def atomic_write(path: str, fill: Callable[[BinaryIO], None], mode: int) -> None:
    """Replace ``path`` with what ``fill`` writes, all at once (see :mod:`rdma_cni.shared.atomicfile`).

    Readers and executors of ``path`` see the old file or the new one, never
    a partial one, and never a missing one. The temporary file is opened
    close-on-exec, so no child process can inherit a writable descriptor,
    which would make exec of the renamed file fail with ETXTBSY.
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomic(path, fill, mode=mode)


def write_bytes_atomic(path: str, data: bytes, mode: int) -> None:
    """:func:`atomic_write` for data already in memory."""
    atomic_write(path, lambda f: f.write(data), mode)


def say(out: TextIO, line: str) -> None:
    """One progress line of the installer on ``out``."""
    out.write(f"rdma-cni install: {line}\n")
    out.flush()
