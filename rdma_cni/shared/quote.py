"""Quoting text a tenant (or any other party we do not trust) chose, bounded and escaped.

Every message that repeats a value it did not write itself goes through
:func:`quote` (or :func:`bounded` for a whole message): a 60,000-character
interface name must not become a 60,000-character error, repeated per node
in a filter answer, per line in a log or per event; and an escape sequence
must not reach an operator's terminal through ``kubectl describe``, a log
viewer or ``rdma-cni nodes``. Standard library only, no I/O.
"""

from __future__ import annotations

__all__ = ["QUOTE_LIMIT", "bounded", "escape", "quote"]

# Characters of a quoted value kept: enough to recognise it, never its whole size.
QUOTE_LIMIT = 64


def _shape(value: object, limit: int) -> str:
    # Values that are not text (a decoded JSON object where a string was expected) are shown as
    # reprlib shows them: a few items of each container, a few levels deep, strings cut short.
    # Imported here: this module is on every CNI start's path (the error document), reprlib is not.
    import reprlib

    shape = reprlib.Repr()
    shape.maxlevel = 2
    shape.maxdict = shape.maxlist = shape.maxtuple = shape.maxset = shape.maxfrozenset = 3
    shape.maxstring = limit
    shape.maxother = 40
    try:
        return shape.repr(value)[: 10 * limit]
    except Exception:  # a hostile __repr__ of an object we were handed
        return f"<{type(value).__name__}>"


def _escaped(text: str) -> str:
    # repr escapes exactly what is not printable (control characters, newlines, escape
    # sequences' ESC, bidirectional overrides, lone surrogates) and the quote and backslash.
    return repr(text)[1:-1]


def escape(text: str) -> str:
    """``text`` with every non-printable character escaped (``\\x1b``, ``\\n``, ``\\u202e``); unbounded.

    For text already bounded by its source (a table cell of a decoded node
    state); for anything else use :func:`bounded`.
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escaped(c) for c in text)


def quote(value: object, limit: int = QUOTE_LIMIT) -> str:
    """``value`` as ``'text'``, escaped, its first ``limit`` characters at most, then its length.

    ``'abc'`` for a short string, ``'abcd...'... (60000 characters)`` for a
    long one; ``null``, ``true`` and ``false`` as in JSON (where untrusted values come
    from); any other value that is not a string by a few of its items or digits.
    The result is at most about ``10 * limit + 40`` characters whatever the input.
    """
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]  # as the JSON it came from
    if not isinstance(value, str):
        return _shape(value, limit)
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


def bounded(text: str, limit: int, *, lines: bool = False) -> str:
    """A whole message: its first ``limit`` characters, non-printable ones escaped, then its length.

    For messages assembled from parts (an event, a CNI error's ``msg``), as a
    last bound after each part was quoted: what is kept is escaped, what is cut
    is said with its size. Newlines are escaped too (one message is one line)
    unless ``lines`` (a traceback in a CNI error's ``details``). At most about
    ``10 * limit + 30`` characters whatever the input.
    """
    head = text[:limit]
    head = "\n".join(escape(part) for part in head.split("\n")) if lines else escape(head)
    if len(text) <= limit:
        return head
    return f"{head}... ({len(text)} characters)"
