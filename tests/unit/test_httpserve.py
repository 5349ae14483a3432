"""rdma_cni.httpserve: the memo of request heads (the listener itself is tested through its users)."""

from __future__ import annotations

import pytest

from rdma_cni import httpserve
from rdma_cni.httpserve import BadRequest, Heads


def _head(extra: bytes = b"") -> bytes:
    return b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n" + extra + b"\r\n"


def test_a_head_read_again_is_the_same_request() -> None:
    heads = Heads()
    head = _head()
    first = heads.parse(head, len(head) - 2)
    assert (first.method, first.path, first.length, first.keep) == ("POST", "/filter", 2, True)
    assert heads.parse(head, len(head) - 2) is first


def test_the_memo_is_bounded_in_entries_and_entry_size() -> None:
    heads = Heads()
    for i in range(httpserve.MEMO_HEADS * 2 + 3):
        head = _head(b"X-N: %d\r\n" % i)
        heads.parse(head, len(head) - 2)
        assert len(heads._known) <= httpserve.MEMO_HEADS
    big = _head(b"X-Big: " + b"y" * httpserve.MEMO_HEAD + b"\r\n")
    request = heads.parse(big, len(big) - 2)
    assert heads.parse(big, len(big) - 2) is not request  # read again: too big to keep
    assert big not in heads._known


def test_a_refused_head_is_refused_every_time_and_never_kept() -> None:
    heads = Heads()
    head = _head(b"Content-Length: 3\r\n")
    for _ in range(2):
        with pytest.raises(BadRequest) as info:
            heads.parse(head, len(head) - 2)
        assert info.value.status == 400 and "Content-Length" in info.value.text
    assert not heads._known
