"""What an API server's answer means for its caller: one status classifier for both Kubernetes clients.

The plugin's pod GET (:mod:`rdma_cni.kube.podget`) and the long-running
client (:mod:`rdma_cni.kube.client`) type their failures differently (CNI
error codes there, exception classes here), but they must agree on what a
status means: 429 and 5xx are worth retrying, 401 and 403 are refused
credentials, 404 is a missing object. :func:`classify` says it once.

Also here: how foreign text (an answer body, an exception's message) is
shortened before it goes into an error message. Standard library only, and
cheap to import: a cold ADD loads it.
"""

from __future__ import annotations

import enum

# Longest piece of server-supplied text copied into an error message.
MAX_FOREIGN_TEXT = 300


class Status(enum.Enum):
    """What an HTTP status from the API server tells the caller to do."""

    OK = "ok"  # 2xx
    NOT_FOUND = "not found"  # 404: the object does not exist
    CONFLICT = "conflict"  # 409: re-read and retry
    GONE = "gone"  # 410: the resourceVersion is too old; list again
    INVALID = "invalid"  # 422: the request is wrong
    REFUSED = "refused"  # 401, 403: the credentials were refused
    RETRY = "retry"  # 429, 5xx: the server is overloaded or failing; back off and retry
    OTHER = "other"  # anything else: an error nobody can act on


_BY_CODE = {404: Status.NOT_FOUND, 409: Status.CONFLICT, 410: Status.GONE, 422: Status.INVALID}


def classify(code: int) -> Status:
    """The :class:`Status` of an HTTP status code."""
    if 200 <= code < 300:
        return Status.OK
    known = _BY_CODE.get(code)
    if known is not None:
        return known
    if code in (401, 403):
        return Status.REFUSED
    if code == 429 or code >= 500:
        return Status.RETRY
    return Status.OTHER


def describe(exc: BaseException) -> str:
    """``Class: message`` of an exception, for error messages (redact before showing)."""
    return f"{exc.__class__.__name__}: {exc}"


def snippet(text: str) -> str:
    """``text`` on one line, cut to :data:`MAX_FOREIGN_TEXT` characters."""
    text = " ".join(text.split())
    if len(text) > MAX_FOREIGN_TEXT:
        return text[:MAX_FOREIGN_TEXT] + "..."
    return text
