"""Attachments whose pod is gone though no DEL came: whether this boot may release one now.

A DEL can be lost: Multus v4.3.0's thick shim answers DEL itself, with success,
while its daemon is down, and a runtime bug can drop one. The pod's sandbox and
network namespace are then gone, and its record would hold its VFs and IPAM
addresses until the next boot (:mod:`rdma_cni.node.boot`). The node agent asks
here, every few seconds (``rdma-cni release-orphans``, run as the plugin by
:mod:`rdma_cni.agent.cniserver`), which records it may release as a DEL
without ``CNI_NETNS`` would: :func:`judge` answers None (release) only when the
kernel proves all of this:

1. **The record is this boot's and no verb of it is under way.** The pass
   holds the node lock, which every ADD and DEL holds from start to end, and
   an intent record (state ``adding``) younger than :data:`ADDING_SECONDS` is
   left to its runtime, whose DEL follows a failed ADD. A record of another
   boot (or in doubt) is the boot release's.
2. **Its network namespace no longer exists.** The record's ``netns_id``
   ([st_dev, st_ino] of the namespace's nsfs file, kept by ADD since record
   schema 3) is neither what its path now opens nor any namespace this
   process can see mounted or entered by a process (:func:`live_namespaces`).
   An inode number is reused once its namespace is freed, so a match says
   "maybe alive" and is refused; only absence counts. A record written
   before the field existed is judged by its path alone: an nsfs file there
   is taken as its namespace, alive.
3. **Every VF is back in the host.** The kernel moves a physical netdev (an
   SR-IOV VF) home when its namespace is destroyed, and in exclusive RDMA
   namespace mode the RDMA device too; each VF's netdev must be proven home by
   kernel identity (:meth:`rdma_cni.kernel.identity.VfFinder.in_host`), and a
   moved RDMA device seen in the host. A pod cannot fake this: moving a netdev
   into a namespace needs CAP_NET_ADMIN over the target namespace's owning user
   namespace and a handle on it (an fd or a pid of a process in it), and a
   pod holds neither for the host's; nor can it change the identity a VF is
   found by (its parent PCI device). So a VF seen home with its namespace gone
   sits in no pod.
4. **The record can be released without another verb's configuration.** One
   with IPAM results but no IPAM configuration of its own (schema 1) is left
   to its network's DEL or GC, or the next boot.

A record that cannot be read is never judged: its VFs stay held by the kernel's
view (a VF not proven home is not free) until an operator or the boot release
deals with it.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from collections.abc import Callable

from rdma_cni.node import boot
from rdma_cni.node.record import Attachment

log = logging.getLogger("rdma_cni.orphans")

HOST_NETNS_PATH = "/proc/self/ns/net"  # rdma_cni.kernel.netns.HOST_NETNS_PATH: its nsfs device
# An intent record younger than this may still be its ADD's (or the DEL its runtime sends after a
# failed ADD): the shim's longest wait for a verb, doubled.
ADDING_SECONDS = 600.0
# At most this many processes' namespaces are read for one pass (a node runs far fewer).
MAX_PROCESSES = 65536
_NET_MOUNT = re.compile(r"^net:\[(\d+)\]$")


def live_namespaces(proc: str = "/proc") -> set[int]:
    """Inode numbers of the network namespaces this process can see alive: mounted, or a process's.

    Read from this mount namespace's nsfs mounts (``/proc/self/mountinfo``: a root of
    ``net:[<ino>]``) and each visible process's ``ns/net`` link. A namespace that neither shows
    (a process in another PID namespace holds it, mounted where this one cannot see) is not
    here, which is why a namespace is never judged gone on this alone (see :func:`judge`).
    """
    live: set[int] = set()
    try:
        with open(os.path.join(proc, "self", "mountinfo"), encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split(" ", 5)
                if len(parts) > 4:
                    found = _NET_MOUNT.match(parts[3])
                    if found:
                        live.add(int(found.group(1)))
    except OSError as exc:
        log.warning("cannot read %s/self/mountinfo: %s", proc, exc.strerror)
    try:
        pids = [name for name in os.listdir(proc) if name.isdigit()][:MAX_PROCESSES]
    except OSError as exc:
        log.warning("cannot list %s: %s", proc, exc.strerror)
        return live
    for pid in pids:
        try:
            found = re.match(r"^net:\[(\d+)\]$", os.readlink(os.path.join(proc, pid, "ns", "net")))
        except OSError:
            continue  # gone since, or not ours to read
        if found:
            live.add(int(found.group(1)))
    return live


def namespace_alive(att: Attachment, live: set[int], nsfs_dev: int | None = None) -> str | None:
    """Why ``att``'s network namespace may still exist, or None when the kernel shows it gone."""
    if nsfs_dev is None:
        nsfs_dev = os.stat(HOST_NETNS_PATH).st_dev
    recorded = tuple(att.netns_id) if len(att.netns_id) == 2 else None
    if recorded is not None and recorded[0] == nsfs_dev and recorded[1] in live:
        return f"a network namespace with its inode ({recorded[1]}) is alive"
    if not att.netns:
        return None if recorded is not None else "the record names no network namespace"
    try:
        st = os.stat(att.netns)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return None
    except OSError as exc:
        return f"{att.netns} cannot be looked at ({exc.strerror})"
    if not stat.S_ISREG(st.st_mode) or st.st_dev != nsfs_dev:
        return None  # what an unmounted namespace file leaves behind, or something else: not a namespace
    if recorded is None:
        return f"{att.netns} is a namespace, and the record (schema {att.schema}) keeps no identity"
    if (st.st_dev, st.st_ino) == recorded:
        return f"{att.netns} is still its network namespace"
    return None  # another namespace at the path (the pod's is not there); the inode scan found none


def judge(
    att: Attachment,
    *,
    vf_home: Callable[[str, str], bool],
    rdma_home: Callable[[str], bool],
    live: Callable[[], set[int]],
    now: boot.Boot,
    nsfs_dev: int | None = None,
) -> str | None:
    """None when ``att`` may be released now (see the module's rules); otherwise why it is kept.

    ``vf_home(pci, host_name)``: the VF's netdev proven home by kernel identity.
    ``rdma_home(device)``: the RDMA device seen in the host's namespace.
    ``live()``: :func:`live_namespaces` (called only once the cheaper refusals are passed).
    ``now``: this boot (:func:`rdma_cni.node.boot.current`). The caller holds the node lock.
    """
    verdict, _how = boot.judge(att.boot_id, att.created_at, now)
    if verdict != "current":
        return "not surely of this boot: the boot release's"
    if att.state == "adding" and now.now - att.created_at < ADDING_SECONDS:
        return "its ADD may be under way (an intent record): its runtime's DEL releases it"
    if not att.vfs:
        return "the record lists no VF"
    if att.ipam_conf is None and any(vf.ipam is not None for vf in att.vfs):
        return "the record keeps no IPAM configuration (an earlier version's): its network's DEL or GC's"
    # The namespace first: a record of a live pod (every record, nearly always) costs a stat.
    if att.netns and len(att.netns_id) == 2:
        try:
            st = os.stat(att.netns)
            if (st.st_dev, st.st_ino) == tuple(att.netns_id):
                return f"{att.netns} is still its network namespace"
        except OSError:
            pass
    for vf in att.vfs:
        if not vf_home(vf.pci, vf.host_name):
            return f"VF {vf.pci} is not back in the host (its namespace may still exist)"
        if vf.rdma_action == "moved" and vf.rdma_device and not rdma_home(vf.rdma_device):
            return f"RDMA device {vf.rdma_device} of VF {vf.pci} is not back in the host"
    why = namespace_alive(att, live(), nsfs_dev)
    if why is not None:
        return why
    return None
