"""ArgsDecoder: the same documents as json.loads, with node lists reused only where that is provably so."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rdma_cni.extender.rawargs import ArgsDecoder
from tests.support import sched_objects as so

NAMES = [f"node-{i:05d}" for i in range(200)]


def body(pod_name: str, names: list[object], **extra: object) -> bytes:
    # As kube-scheduler's Go encoder writes ExtenderArgs: struct order, no spaces.
    doc = {"Pod": so.rdma_pod(pod_name, [(1_000, 0)]), "Nodes": None, "NodeNames": names, **extra}
    return json.dumps(doc, separators=(",", ":")).encode()


def test_a_repeated_node_list_is_decoded_once_and_shared() -> None:
    decoder = ArgsDecoder()
    docs = [decoder.loads(body(f"p{i}", NAMES)) for i in range(5)]
    for i, doc in enumerate(docs):
        assert doc == json.loads(body(f"p{i}", NAMES))
    # Seen once, checked when seen again, reused from then on: one list object.
    assert decoder.reused == 3 and docs[2]["NodeNames"] is docs[3]["NodeNames"] is docs[4]["NodeNames"]
    # Another list of the same length is not mistaken for it.
    other = [*NAMES[:-1], "node-99999"]
    assert decoder.loads(body("q", other))["NodeNames"] == other
    assert decoder.reused == 3


@pytest.mark.parametrize(
    "raw",
    [
        # A later duplicate of an earlier key, after the names: json.loads keeps the later one.
        body("p", NAMES)[:-1] + b',"Pod":{"metadata":{"name":"other"}}}',
        # The names, then more members.
        body("p", NAMES)[:-1] + b',"Extra":1}',
        # The key inside the pod, not at the top level.
        json.dumps(
            {
                "Pod": {"metadata": {"name": "p", "annotations": {"x": "y"}}, "NodeNames": NAMES},
                "NodeNames": None,
            }
        ).encode(),
        # Whitespace after the closing brace, lower-case keys, spaces after the colon.
        body("p", NAMES) + b"\n",
        body("p", NAMES).replace(b'"NodeNames"', b'"nodenames"'),
        json.dumps({"Pod": so.rdma_pod("p", [(1, 0)]), "NodeNames": NAMES}).encode(),
    ],
)
def test_other_layouts_decode_as_json_loads_does(raw: bytes) -> None:
    decoder = ArgsDecoder()
    for _ in range(4):
        assert decoder.loads(raw) == json.loads(raw)


def test_a_remembered_end_after_a_head_that_changes_its_meaning() -> None:
    decoder = ArgsDecoder()
    plain = body("p", NAMES)
    for _ in range(3):
        decoder.loads(plain)
    assert decoder.reused == 1
    end = plain[plain.rindex(b'"NodeNames":') :]
    # The same end after a head that leaves a string open, nests it deeper, or is not JSON.
    for head in (b'{"Pod":{},"x":"', b'{"Pod":{"a":', b'{"Pod":{}', b"[", b'{"Pod":{},"NodeNames":[],'):
        raw = head + end
        try:
            expected = json.loads(raw)
        except ValueError:
            with pytest.raises(ValueError):
                decoder.loads(raw)
        else:
            assert decoder.loads(raw) == expected


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_sequence_of_bodies_decodes_as_json_loads_does(data: st.DataObject) -> None:
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    lists = [NAMES, NAMES[:150], [*NAMES[1:], "x"], [1, "a"] * 100]
    decoder = ArgsDecoder()
    for step in range(data.draw(st.integers(1, 12))):
        names = rng.choice(lists)
        raw = body(f"p{step}", names)
        cut = rng.random()
        if cut < 0.15:  # damaged: truncated or with a byte changed
            at = rng.randrange(len(raw))
            raw = raw[:at] if rng.random() < 0.5 else raw[:at] + b"]" + raw[at + 1 :]
        elif cut < 0.25:
            raw = raw[:-1] + b',"Pod":null}'
        try:
            expected = json.loads(raw)
        except ValueError:
            with pytest.raises(ValueError):
                decoder.loads(raw)
            continue
        assert decoder.loads(raw) == expected
