"""Tenant text is bounded and escaped wherever it is quoted (issue 29, item 2, the quoting side).

One helper (``shared/quote``) renders untrusted text; each site that quotes
a pod's (or an agent's) text is driven here with a huge hostile value, and
the message it makes must stay small and free of control characters.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from rdma_cni.cli.main import run_cni
from rdma_cni.cni.config import load_netconf
from rdma_cni.cni.errors import CniError, InvalidConfig, InvalidEnvironment, InvalidPodRequest
from rdma_cni.cni.protocol import parse_env, validate_ifname
from rdma_cni.kube.events import MAX_MESSAGE, EventSink
from rdma_cni.node.podmeta import CRI_ANNOTATIONS, resolve_request, runtime_annotations
from rdma_cni.shared import nodestate
from rdma_cni.shared.podrequest import MAX_ERRORS, parse_request
from rdma_cni.shared.quote import QUOTE_LIMIT, bounded, escape, quote

HUGE = 60_000
# An escape sequence (title, clear screen), a newline and a forged line, then padding.
HOSTILE = "\x1b]0;pwned\x07\x1b[2J\nFORGED LINE " + "\u202e" + "x" * HUGE


def assert_tame(text: str, limit: int) -> None:
    """Small, one line, nothing a terminal would act on."""
    assert len(text) <= limit, len(text)
    assert text.isprintable(), [c for c in text if not c.isprintable()][:5]


# ---------------------------------------------------------------------------
# The helper


def test_quote_short_text_is_its_repr() -> None:
    assert quote("net1") == "'net1'"
    assert quote("a\x1bb") == "'a\\x1bb'"


def test_quote_long_text_keeps_a_prefix_and_says_the_size() -> None:
    got = quote(HOSTILE)
    assert got.endswith(f"... ({len(HOSTILE)} characters)")
    assert got.startswith("'\\x1b]0;pwned\\x07\\x1b[2J\\nFORGED LINE \\u202ex")
    assert_tame(got, 10 * QUOTE_LIMIT + 40)


@pytest.mark.parametrize(
    "value",
    [None, True, 10**4000, 1e308, ["x" * HUGE] * 1000, {"k" * HUGE: [[[["deep"]]]]}, "\udc80" * HUGE],
    ids=["null", "true", "bigint", "float", "list", "dict", "surrogates"],
)
def test_quote_any_value_is_bounded(value: Any) -> None:
    assert_tame(quote(value), 10 * QUOTE_LIMIT + 40)


def test_quote_survives_a_hostile_repr() -> None:
    class Bad:
        def __repr__(self) -> str:
            raise RuntimeError("no")

    assert quote(Bad()).startswith("<Bad")


def test_bounded_and_escape() -> None:
    assert escape("ok") == "ok" and escape("a\nb\x1b") == "a\\nb\\x1b"
    assert bounded("short", 10) == "short"
    got = bounded(HOSTILE, 100)
    assert_tame(got, 1100) and got.endswith(f"({len(HOSTILE)} characters)")
    # A traceback keeps its lines, each escaped.
    assert bounded("a\x1b\nb", 100, lines=True) == "a\\x1b\nb"


# ---------------------------------------------------------------------------
# The pod request's errors: ADD's code 101 and the extender's filter reason


@pytest.mark.parametrize(
    "request_",
    [
        [{"name": "x" * HUGE}],
        [{"pf": "y" * HUGE}],
        [{"rail": HOSTILE[:HUGE]}],
        [{"pf": "eth0", "rail": "r" * HUGE}],
        [{"k" * HUGE: 1}],
        [{"name": "n" * 1800} for _ in range(32)],
        [{f"z{i}" * 10: 1} for i in range(32)],
    ],
    ids=["name", "pf", "rail", "pf-and-rail", "key", "32-names", "32-keys"],
)
def test_request_errors_are_bounded(request_: Any) -> None:
    for raw in (json.dumps(request_), request_):  # the annotation, or args already decoded
        with pytest.raises(InvalidPodRequest) as info:
            parse_request(raw, "pod ns/p annotation x")
        assert_tame(info.value.msg, (MAX_ERRORS + 1) * (10 * QUOTE_LIMIT + 300))


def test_request_error_still_names_the_field_and_the_value() -> None:
    with pytest.raises(InvalidPodRequest) as info:
        parse_request(json.dumps([{}, {"name": "x" * HUGE}]), "pod ns/p annotation x")
    assert info.value.msg.startswith("pod ns/p annotation x: entry 1.name: 'xxxx")
    assert f"... ({HUGE} characters) is not a valid interface name" in info.value.msg


def test_many_errors_are_counted_not_listed() -> None:
    with pytest.raises(InvalidPodRequest) as info:
        parse_request([{"name": f"bad name {i}"} for i in range(32)], "x")
    assert info.value.msg.count("is not a valid interface name") == MAX_ERRORS
    assert info.value.msg.endswith(f"and {32 - MAX_ERRORS} more")


def test_request_from_config_args_is_bounded(tmp_path: Path) -> None:
    conf = load_netconf(
        {
            "cniVersion": "1.0.0",
            "name": "rdma-net",
            "type": "rdma-cni",
            "stateDir": str(tmp_path / "state"),
            "lockFile": str(tmp_path / "lock"),
            "args": {"cni": {"rdma_interfaces_required": [{"name": HOSTILE}]}},
        }
    )
    env = parse_env({"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "c", "CNI_NETNS": "/x", "CNI_IFNAME": "net1"})
    with pytest.raises(InvalidPodRequest) as info:
        resolve_request(env, conf)
    assert_tame(info.value.msg, 1000)


def test_runtime_annotations_of_a_wrong_shape_are_quoted_bounded(tmp_path: Path) -> None:
    conf = load_netconf(
        {
            "cniVersion": "1.0.0",
            "name": "rdma-net",
            "type": "rdma-cni",
            "runtimeConfig": {CRI_ANNOTATIONS: {"a": [HOSTILE] * 100}},
        }
    )
    with pytest.raises(InvalidConfig) as info:
        runtime_annotations(conf)
    assert_tame(info.value.msg, 1000)


# ---------------------------------------------------------------------------
# The CNI edge: CNI_IFNAME (Multus passes a selection's "interface"), the error document, the log


def test_cni_ifname_error_is_bounded() -> None:
    with pytest.raises(InvalidEnvironment) as info:
        validate_ifname(HOSTILE, "CNI_IFNAME")
    assert_tame(info.value.msg, 1000)
    assert info.value.msg.startswith("CNI_IFNAME='\\x1b]0;pwned")


def test_error_document_is_bounded_whatever_a_message_holds() -> None:
    doc = CniError(HOSTILE, HOSTILE).to_dict("1.0.0")
    assert_tame(doc["msg"], 2048 * 10 + 40)
    assert len(doc["details"]) <= 8192 * 10 + 40 and "\x1b" not in doc["details"]


def test_cni_error_answer_and_log_line_are_bounded(caplog: pytest.LogCaptureFixture) -> None:
    env = {
        "CNI_COMMAND": "ADD",
        "CNI_CONTAINERID": "c1",
        "CNI_NETNS": "/var/run/netns/x",
        "CNI_IFNAME": HOSTILE,
        "CNI_PATH": "/opt/cni/bin",
    }
    conf = {"cniVersion": "1.0.0", "name": "rdma-net", "type": "rdma-cni"}
    with caplog.at_level(logging.ERROR, logger="rdma_cni"):
        code, doc = run_cni(env, json.dumps(conf).encode())
    assert code != 0 and doc is not None and doc["code"] == 4
    assert_tame(doc["msg"], 1000)
    line = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)
    assert line and len(line) < 1200 and "\x1b" not in line and "\nFORGED" not in line


# ---------------------------------------------------------------------------
# Events (kubectl describe) and node state errors (the extender's reason, rdma-cni nodes)


def test_event_message_is_bounded_and_escaped() -> None:
    posted: list[dict[str, Any]] = []
    sink = EventSink(lambda _path, body: posted.append(body), "test", min_interval=0.0)
    try:
        for message in (HOSTILE, "\x1b" * HUGE, "\U000e0001" * HUGE, "fine"):
            assert sink.emit(kind="Pod", name="p", namespace="ns", reason="R", message=message)
        assert sink.flush()
    finally:
        sink.close()
    messages = [e["message"] for e in posted]
    assert messages[-1] == "fine"
    for message in messages:
        assert_tame(message, MAX_MESSAGE)
    assert messages[0].endswith(f"({len(HOSTILE)} characters)")


def test_node_state_errors_are_bounded() -> None:
    state = nodestate.encode(nodestate.NodeState(2, 1, "2026-01-01T00:00:00Z", (), ()))
    for key, value in (
        ("updated", HOSTILE),
        ("generation", [HOSTILE] * 10),
        ("pfs", [[HOSTILE, 1, 0, 1, 0, 0]]),
    ):
        doc = json.loads(state)
        doc[key] = value
        with pytest.raises(nodestate.NodeStateError) as info:
            nodestate.decode(json.dumps(doc))
        assert_tame(str(info.value), 1000)


def test_no_fit_messages_escape_pf_names() -> None:
    # A PF name the kernel allows (an ESC in it) reaches the extender's reasons through placement.
    from rdma_cni.shared import placement

    pfs = (placement.PfState("\x1b[2J\x1b[H", 0, 100, 0), placement.PfState("\u202eok", 0, None, 0))
    with pytest.raises(placement.NoFit) as info:
        placement.place((placement.Request(10, 0),), pfs)
    assert info.value.message.isprintable() and "\\x1b[2J\\x1b[H: 0 VFs" in info.value.message


@pytest.mark.parametrize(
    ("key", "value", "code"),
    [
        ("CNI_ARGS", "IgnoreUnknown=1;" + HOSTILE.replace(";", ""), 4),
        ("CNI_CONTAINERID", HOSTILE, 4),
        ("CNI_NETNS", HOSTILE, 4),
        ("CNI_COMMAND", HOSTILE, 4),
    ],
)
def test_cni_environment_errors_are_bounded(key: str, value: str, code: int) -> None:
    env = {
        "CNI_COMMAND": "ADD",
        "CNI_CONTAINERID": "c1",
        "CNI_NETNS": "/var/run/netns/x",
        "CNI_IFNAME": "net1",
        "CNI_PATH": "/opt/cni/bin",
        key: value,
    }
    code_, doc = run_cni(env, json.dumps({"cniVersion": "1.0.0", "name": "n", "type": "rdma-cni"}).encode())
    assert code_ != 0 and doc is not None and doc["code"] == code
    assert_tame(doc["msg"], 1000)


def test_runtime_mac_error_is_bounded() -> None:
    from rdma_cni.cni.config import parse_mac

    with pytest.raises(InvalidConfig) as info:
        parse_mac(HOSTILE, "runtimeConfig.mac")
    assert_tame(info.value.msg, 1000)
