"""The old-root tier: the host side in a Debian 11 root (glibc 2.31), the server in the project's userspace.

The root is debootstrapped once by scripts/oldroot.sh and kept outside the
tree (/var/cache/rdma-cni-build/bullseye-root-v1). The shim is installed into
it by ``rdma-cni install --mode shim``, as the DaemonSet would; each call runs
inside it (chroot) in a private mount namespace where the agent's socket
directory and the pod's network namespace file are bind-mounted at paths the
server does not have, so nothing on the host side can lean on the host's libc
or the server on the runtime's mount view.
"""

from __future__ import annotations

import os
import subprocess

import pytest

# The integration tier's simulated node, API stand-in and CNI environment.
from tests.integration.conftest import api_server, cluster  # noqa: F401
from tests.support.shim import REPO

if os.geteuid() != 0:
    pytest.skip("the old-root tier needs root (debootstrap, chroot, mounts)", allow_module_level=True)


@pytest.fixture(scope="session")
def old_root() -> str:
    """The cached Debian 11 root (made on first use: a few minutes, needs the Debian mirror)."""
    out = subprocess.run(
        [os.path.join(REPO, "scripts", "oldroot.sh")], check=True, capture_output=True, text=True
    )
    return out.stdout.strip()


@pytest.fixture(scope="session")
def binary() -> str:
    """The fat binary under test; the shim lies beside it (make build)."""
    path = os.environ.get("RDMA_CNI_BINARY") or os.path.join(REPO, "dist", "rdma-cni")
    shim = os.path.join(os.path.dirname(path), "rdma-cni-shim")
    if not (os.path.exists(path) and os.path.exists(shim)):
        pytest.fail(f"{path} and {shim} are not built: run make oldroot", pytrace=False)
    return path
