"""rdma_cni.httpd.head: the memo of request heads (refusals are tested through the servers)."""

from __future__ import annotations

import pytest

from rdma_cni.httpd.head import MEMO_HEAD, MEMO_HEADS, BadRequest, Heads


def _head(extra: bytes = b"") -> bytes:
    return b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n" + extra + b"\r\n"


def test_a_head_read_again_is_the_same_request() -> None:
    heads = Heads()
    head = _head()
    first = heads.parse(head, len(head) - 2)
    assert (first.method, first.path, first.length, first.keep) == ("POST", "/filter", 2, True)
    assert heads.parse(head, len(head) - 2) == first
    assert len(heads._known) == 1


def test_the_memo_is_bounded_in_entries_and_entry_size() -> None:
    heads = Heads()
    for i in range(MEMO_HEADS * 2 + 3):
        head = _head(b"X-N: %d\r\n" % i)
        heads.parse(head, len(head) - 2)
        assert len(heads._known) <= MEMO_HEADS
    big = _head(b"X-Big: " + b"y" * MEMO_HEAD + b"\r\n")
    known = len(heads._known)
    heads.parse(big, len(big) - 2)
    assert len(heads._known) == known  # too big to keep


def test_a_refused_head_is_refused_every_time_and_never_kept() -> None:
    heads = Heads()
    head = _head(b"Content-Length: 3\r\n")
    for _ in range(2):
        with pytest.raises(BadRequest) as info:
            heads.parse(head, len(head) - 2)
        assert info.value.status == 400 and "Content-Length" in info.value.text
    assert not heads._known


def test_heads_that_differ_only_in_their_length_share_one_entry() -> None:
    heads = Heads()
    for length in (2, 155_112, 0, 7):
        head = b"POST /filter HTTP/1.1\r\nHost: x\r\ncontent-LENGTH:  %d \r\nX-A: b\r\n\r\n" % length
        request = heads.parse(head, len(head) - 2)
        assert (request.path, request.length) == ("/filter", length)
    assert len(heads._known) == 1
    # Two Content-Length lines (equal or not) are never taken for one: h11 judges each such head.
    for second in (b"2", b"3"):
        head = _head(b"Content-Length: " + second + b"\r\n")
        if second == b"2":
            assert heads.parse(head, len(head) - 2).length == 2
        else:
            with pytest.raises(BadRequest):
                heads.parse(head, len(head) - 2)
    assert len(heads._known) == 2
