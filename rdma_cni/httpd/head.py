"""Reading a request's head: h11 decides, this adds what h11 lets through, and known heads are not read again.

h11 (python-hyper's HTTP/1.1 protocol library) refuses the framing errors of
RFC 9112 by itself (conflicting ``Content-Length`` headers, a transfer coding
other than ``chunked``, a missing or repeated ``Host``); :func:`parse_head`
adds obsolete line folding, both ``Content-Length`` and ``Transfer-Encoding``,
heads over :data:`MAX_HEAD` bytes or :data:`MAX_HEADERS` fields. Each is a
:class:`BadRequest` (400, 414, 431). Used by :mod:`rdma_cni.httpd.serve`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import h11

__all__ = ["HEAD_END", "MAX_HEAD", "BadRequest", "Heads", "Request", "too_long"]

# The request line and all header lines together (kube-scheduler's and Prometheus' are under 1 KiB),
# and the number of header fields. At most this plus one read is held while a head is incomplete.
MAX_HEAD = 64 * 1024
MAX_HEADERS = 100
# The memo of heads read (see Heads): a head is memoized up to this size, this many of them.
MEMO_HEAD = 4096
MEMO_HEADS = 256
# The blank line that ends a head, and a header line that continues the one before (obs-fold).
HEAD_END = re.compile(rb"\n\r?\n")
_OBS_FOLD = re.compile(rb"\n[ \t]")
# A Content-Length header line whose value is a plain number (Heads leaves its digits out of its key).
_LENGTH_LINE = re.compile(rb"\ncontent-length:[ \t]*([0-9]{1,18})[ \t]*\r?\n", re.IGNORECASE)


class BadRequest(Exception):
    """The request cannot be read: answer ``status`` and close the connection."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text


@dataclass(frozen=True, slots=True)
class Request:
    """What a request's head says; its body (if any) is still to be read (``BoundedHandler.body``)."""

    method: str
    path: str  # without the query
    keep: bool  # the client keeps the connection open after the answer
    length: int | None  # Content-Length; None without one
    chunked: bool  # Transfer-Encoding: chunked (never with a Content-Length)
    expect: bool  # Expect: 100-continue


def too_long(head: bytes) -> BadRequest:
    """The refusal of a head over :data:`MAX_HEAD` bytes: 414 when its request line alone is."""
    if b"\n" not in head[: MAX_HEAD + 1]:
        return BadRequest(414, "request line too long")
    return BadRequest(431, f"request head over {MAX_HEAD} bytes")


def parse_head(event: h11.Request, head: bytes) -> Request:
    """A :class:`Request` from h11's parsed head and its raw text; :class:`BadRequest` for what h11 allows."""
    if len(head) > MAX_HEAD:
        raise too_long(head)
    if _OBS_FOLD.search(head):
        # RFC 9112 section 5.2: refuse or unfold; what a proxy in front would make of it is unknown.
        raise BadRequest(400, "obsolete line folding in a header")
    if len(event.headers) > MAX_HEADERS:
        raise BadRequest(431, f"more than {MAX_HEADERS} headers")
    if not event.http_version.startswith(b"1."):
        raise BadRequest(400, "not an HTTP/1.x request")
    length = chunked = None
    connection: list[bytes] = []
    expect = False
    for name, value in event.headers:
        if name == b"content-length":
            length = int(value)  # h11 made sure there is one value, all digits
        elif name == b"transfer-encoding":
            chunked = True  # h11 refused any other coding
        elif name == b"connection":
            connection.extend(token.strip().lower() for token in value.split(b","))
        elif name == b"expect":
            expect = value.lower() == b"100-continue"
    if length is not None and chunked:
        # RFC 9112 section 6.3: a request with both is a smuggling attempt.
        raise BadRequest(400, "both Content-Length and Transfer-Encoding")
    keep = b"close" not in connection if event.http_version == b"1.1" else b"keep-alive" in connection
    path = event.target.decode("latin-1").split("?", 1)[0]
    return Request(event.method.decode("latin-1"), path, keep, length, bool(chunked), expect)


class Heads:
    """Heads already read: kube-scheduler, the probes and Prometheus send the same few again and again,
    and h11 takes tens of microseconds to read one.

    A head is known by its bytes with the digits of its one ``Content-Length`` left out (the only
    part of kube-scheduler's heads that changes from request to request): h11's verdict on a head
    does not depend on those digits as long as they are digits, and few enough (18 here; h11
    takes 20). Only heads that h11 accepted, of up to :data:`MEMO_HEAD` bytes, at most
    :data:`MEMO_HEADS` of them (forgotten all at once when full): at most 1 MiB. A refused head
    is read again each time.
    """

    def __init__(self) -> None:
        self._known: dict[bytes, Request] = {}

    def parse(self, head: bytes, end: int) -> Request:
        """The request ``head`` (up to and including its blank line, which starts at ``end``) makes."""
        key, length = head, None
        found = _LENGTH_LINE.search(head)
        if found is not None and head.lower().count(b"content-length") == 1:
            key, length = head[: found.start(1)] + head[found.end(1) :], int(found.group(1))
        known = self._known.get(key)
        if known is not None:
            return known if length is None else replace(known, length=length)
        if head.count(b"\n") > MAX_HEADERS + 2:  # the request line, the headers, the blank line
            raise BadRequest(431, f"more than {MAX_HEADERS} headers")
        parser = h11.Connection(h11.SERVER)
        try:
            parser.receive_data(head)
            event = parser.next_event()
        except h11.RemoteProtocolError as exc:
            raise BadRequest(400, str(exc)) from None
        if not isinstance(event, h11.Request):
            raise BadRequest(400, "not an HTTP/1.x request")
        request = parse_head(event, head[:end])
        if len(head) <= MEMO_HEAD:
            if len(self._known) >= MEMO_HEADS:
                self._known.clear()  # a few entries lost at once, never a lock on the request path
            self._known[key] = request
        return request
