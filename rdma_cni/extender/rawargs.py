"""Decoding ExtenderArgs bodies, reusing the node-name list of an earlier body that ended the same way.

kube-scheduler sends the pod and then the node names (Go's encoder writes
the fields in struct order, ``NodeNames`` last). For a scheduler that sends
the same names in the same order pod after pod (the project's stand-in does;
kube-scheduler lists them in the order its parallel filters finish, so its
bodies differ and take the ``json.loads`` path, and
:class:`~rdma_cni.extender.answers.Answers` matches its lists as sets),
:class:`ArgsDecoder` remembers the end of a body
from the ``"NodeNames":`` key on and the list it decoded to; a later body
that ends with the same bytes is decoded as its beginning followed by
``"NodeNames":null}``, a few KiB, and gets that same list object back. The
server then compares node lists by identity instead of string by string.

Why the result is what ``json.loads`` gives for the whole body: a remembered
end is the key, one JSON array ``A`` (checked: ``A`` alone decodes to the
list) and the ``}`` that ends the body. If the beginning ``H`` plus
``"NodeNames":null}`` decodes, the parser expects a value right after the
key, and the closing brace ends the outermost object (nothing follows it).
Decoding ``H`` plus the key, ``A`` and the brace reads the same tokens up to
the value, ``A`` as the same array (an array's text means the same wherever
it stands), then the same brace: the same document with ``A`` for ``null``.
Anything else (another layout, keys in another case, a body that does not
decode) takes the plain ``json.loads`` path.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from rdma_cni.extender.bounded import Bounded

__all__ = ["ArgsDecoder"]

_KEY = b'"NodeNames":'
_NULL_END = _KEY + b"null}"
# Ends shorter than this are decoded as they come: reusing them saves nothing.
_MIN_TAIL = 1024
# Remembered ends, by length; a node list change adds one, so few are needed. Bounded in bytes too:
# kube-scheduler's end at 5,000 nodes is ~0.4 MB (4 MB at 15,000 nodes of the longest names); a
# remembered end also keeps its decoded list, counted as twice its bytes more.
_KEPT = 16
_TAIL_BYTES = 8 * 1024 * 1024


class ArgsDecoder:
    """``json.loads`` for request bodies, with remembered node lists. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Length of an end -> (the end's bytes, the list it decodes to).
        self._known: Bounded[int, tuple[bytes, list[Any]]] = Bounded(_KEPT, _TAIL_BYTES)
        # Ends seen once, not yet checked: an end is checked (one more decode) when it comes again.
        self._seen: Bounded[int, bytes] = Bounded(_KEPT, _TAIL_BYTES)
        self.reused = 0  # bodies decoded with a remembered list (tests read it)

    def loads(self, raw: bytes) -> Any:
        """The decoded body, as ``json.loads(raw)`` (ValueError when it is not JSON)."""
        at = raw.rfind(_KEY)
        size = len(raw) - at
        if at < 0 or size < _MIN_TAIL:
            return json.loads(raw)
        known = self._known.get(size)
        if known is not None and raw.endswith(known[0]):
            doc = self._head(raw, at)
            if doc is not None:
                doc["NodeNames"] = known[1]
                self.reused += 1
                return doc
        doc = json.loads(raw)
        if isinstance(doc, dict) and isinstance(doc.get("NodeNames"), list):
            self._learn(raw, at, size, doc["NodeNames"])
        return doc

    @staticmethod
    def _head(raw: bytes, at: int) -> dict[str, Any] | None:
        # The body with null for the names, when that decodes (then to an object: the brace that
        # follows null ends the body, so it closes the outermost value).
        try:
            doc = json.loads(raw[:at] + _NULL_END)
        except (ValueError, RecursionError):
            return None
        return doc if isinstance(doc, dict) else None

    def _learn(self, raw: bytes, at: int, size: int, names: list[Any]) -> None:
        tail = raw[at:]
        with self._lock:
            if self._seen.get(size) != tail:
                self._seen.put(size, tail, len(tail))
                return
            self._seen.pop(size)
        # Seen twice: worth checking that between the key and the last byte (the brace that ends a
        # body decoding to an object) stands exactly one JSON value: the names' array.
        try:
            json.loads(tail[len(_KEY) : -1])
        except (ValueError, RecursionError):
            return
        self._known.put(size, (tail, names), 3 * len(tail))
