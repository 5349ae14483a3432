"""Typed errors and the one place where they become CNI error codes.

Every failure the plugin can report is a subclass of :class:`CniError`; the CLI
turns it into the CNI error document. Anything else that escapes a verb is an
unexpected bug and is reported as :class:`InternalError` with the exception
text in ``details``. Standard library only: this module is imported on every
start.

It lives in ``shared/`` because both halves raise these errors (the pod
request parser, run by ADD and by the scheduler extender, raises
:class:`InvalidPodRequest`) and ``shared/`` imports nothing above it;
:mod:`rdma_cni.cni.errors` is the same classes under the CNI edge's name.
"""

from __future__ import annotations

from rdma_cni.shared.quote import bounded

# The CNI error document's msg and details reach the runtime's logs and the pod's events
# (FailedCreatePodSandBox): bounded whatever a message quoted, as a last guard.
MAX_MSG = 2048
MAX_DETAILS = 8192


class CniError(Exception):
    """An error with a CNI error code, a short message and optional details."""

    code: int = 999

    def __init__(self, msg: str, details: str = "") -> None:
        super().__init__(msg)
        self.msg = msg
        self.details = details

    def to_dict(self, cni_version: str) -> dict[str, object]:
        """The CNI error document for this error."""
        return {
            "cniVersion": cni_version,
            "code": self.code,
            "msg": bounded(self.msg, MAX_MSG),
            "details": bounded(self.details, MAX_DETAILS, lines=True),
        }


# Codes reserved by the CNI specification.


class IncompatibleVersion(CniError):
    code = 1


class UnsupportedField(CniError):
    code = 2


class UnknownContainer(CniError):
    code = 3


class InvalidEnvironment(CniError):
    code = 4


class IOFailure(CniError):
    code = 5


class DecodeFailure(CniError):
    code = 6


class InvalidConfig(CniError):
    code = 7


class TryAgainLater(CniError):
    code = 11


class PluginUnavailable(CniError):
    """STATUS: the plugin cannot serve ADD right now."""

    code = 50


# Plugin-specific codes (100 and up). Documented in docs/protocol.md; keep in sync.


class NoCapacity(CniError):
    """The pod's request does not fit in the node's free VFs and bandwidth."""

    code = 100


class InvalidPodRequest(CniError):
    """The pod's annotation (or the config's request) is malformed."""

    code = 101


class KubernetesError(CniError):
    """The pod could not be read from the API server (other than transiently)."""

    code = 102


class KernelError(CniError):
    """The kernel refused a network change (netlink error)."""

    code = 103


class IpamError(CniError):
    """The delegated IPAM plugin failed or returned something unusable."""

    code = 104


class RdmaError(CniError):
    """An RDMA device could not be found or moved as the config requires."""

    code = 105


class CheckFailed(CniError):
    """CHECK found the attachment different from what ADD made."""

    code = 106


class StateError(CniError):
    """The allocation record is inconsistent with the request (e.g. a duplicate ADD)."""

    code = 107


class GarbageCollectionFailed(CniError):
    """GC could not release some attachments; details lists them."""

    code = 108


class InternalError(CniError):
    """An unexpected exception: a bug. The traceback text is in details."""

    code = 199
