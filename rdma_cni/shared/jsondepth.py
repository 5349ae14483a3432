"""How deep JSON text nests, found before it is parsed. Standard library only.

Python's ``json`` parser recurses once per array or object, so text nested
about as deep as the interpreter's recursion limit (1,000 frames, less the
caller's own) raises ``RecursionError`` partway, at a depth that depends on
who called it; Go's ``encoding/json`` (Multus) reads 10,000 levels. Text a
pod wrote (Multus' networks annotation and its ``cni-args``, the request
annotation, the network configuration Multus builds from them) is therefore
measured first, and anything deeper than :data:`MAX_DEPTH` is refused by its
reader with a typed error: the same answer from every caller, and neither a
traceback nor a parse that stops wherever the stack happens to end.

The measure runs at C speed (``str`` methods and iterators, no per-character
Python loop): text with no more openers than the limit costs two ``count``
calls; 256 KiB of ``[`` (the API server's limit for a pod's annotations) takes
14 to 40 ms and a few copies of the text.
"""

from __future__ import annotations

import re
from itertools import accumulate

__all__ = ["MAX_DEPTH", "depth_over"]

# The deepest nesting any reader of pod-written JSON accepts. Half of Python's default recursion
# limit, so that a parse of accepted text never meets the limit whoever calls it; real annotations
# and configurations nest fewer than 10 levels.
MAX_DEPTH = 512

_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def depth_over(text: str, limit: int = MAX_DEPTH) -> int | None:
    """How deep ``text`` nests arrays and objects when that is more than ``limit``, else None.

    Brackets inside JSON strings do not count. Text that is not JSON is
    measured as if it were (its parser will refuse it anyway): the answer is
    then only an estimate, never an error.
    """
    if text.count("[") + text.count("{") <= limit:
        return None  # fewer openers than the limit: it cannot nest deeper
    # Outside strings only: drop escaped backslashes, then escaped quotes, so that every quote left
    # opens or closes a string, and keep every other piece between quotes.
    unescaped = text.replace("\\\\", "").replace('\\"', "")
    outside = "".join(unescaped.split('"')[::2])
    brackets = _NOT_BRACKET.sub("", outside)
    depth = max(accumulate(map(_STEP.__getitem__, brackets)), default=0)
    return depth if depth > limit else None
