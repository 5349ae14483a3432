"""Whole-number Kubernetes quantities (``25k``, ``25000``, ``1e3``), read exactly. Standard library only.

The API server writes a quantity back in its canonical form: ``25000`` becomes
``25k``, ``1500`` stays ``1500``. rdma-cni reads quantities that count whole
units (Mbit/s of bandwidth, VFs): in the extended resources a pod declares
(extender/declared) and in the capacity a DRA allocation consumed
(agent/dra). A fraction (``500m``, ``1.5``) or anything else is no count of
whole units, and :func:`whole` says so with None; no float is ever involved.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["whole"]

# Digits, then a decimal or binary suffix or a decimal exponent. Longer text is no count of Mbit/s.
_QUANTITY = re.compile(r"\+?([0-9]{1,18})(?:(k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)|[eE]\+?([0-9]{1,2}))?")
_SUFFIX = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}


def whole(value: Any) -> int | None:
    """``value`` as a whole, non-negative number, or None when it is not one.

    Accepts a non-negative int (a JSON number) or quantity text of at most 24
    characters: digits with an optional ``k``..``E`` or ``Ki``..``Ei`` suffix or
    a decimal exponent (``e3``).
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value >= 0 else None
    match = _QUANTITY.fullmatch(value) if isinstance(value, str) and len(value) <= 24 else None
    if match is None:
        return None
    digits, suffix, exponent = match.groups()
    scale = 10 ** int(exponent) if exponent is not None else _SUFFIX[suffix or ""]
    return int(digits) * scale
