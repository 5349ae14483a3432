"""The nesting measure every reader of pod-written JSON runs before parsing (shared/jsondepth)."""

from __future__ import annotations

import json
import time

import pytest

from rdma_cni.shared.jsondepth import MAX_DEPTH, depth_over


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ("[]", 1),
        ("[" * 600 + "]" * 600, 600),
        ('{"a": ' * 600 + "1" + "}" * 600, 600),
        ("[{" * 300 + "}]" * 300, 600),
        ("[]" * 5000, 1),  # many, side by side: not deep
        ("[" * 600, 600),  # not JSON: measured all the same
    ],
)
def test_depth_is_the_deepest_bracket(text: str, depth: int) -> None:
    assert depth_over(text, limit=0) == depth
    assert depth_over(text, limit=depth) is None


def test_the_bound_is_inclusive() -> None:
    assert depth_over("[" * MAX_DEPTH + "]" * MAX_DEPTH) is None
    assert depth_over("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1)) == MAX_DEPTH + 1


@pytest.mark.parametrize(
    "value",
    [
        "[" * 1000,
        "[{" * 1000 + "\\",
        '"' * 1000 + "[" * 1000,
        "\\" * 999 + '"' + "[" * 1000,
    ],
)
def test_brackets_in_strings_do_not_count(value: str) -> None:
    text = json.dumps({"s": value, "t": [value]})
    assert json.loads(text)["s"] == value
    assert depth_over(text, limit=1) == 2


def test_a_quarter_mebibyte_is_measured_in_milliseconds() -> None:
    for text in ("[" * (256 * 1024), '["\\"' * (64 * 1024), "[{" * (128 * 1024)):
        began = time.perf_counter()
        depth_over(text)
        assert time.perf_counter() - began < 1.0  # ~40 ms when quiet
