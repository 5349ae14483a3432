"""The extender's options are its settings' fields: each flag sets its own field, defaults written once."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from rdma_cni.extender import options
from rdma_cni.extender.settings import Settings, flag_of, internal, option
from rdma_cni.shared.podrequest import parse_request

LISTEN = ["--listen", "127.0.0.1:9000"]
# Per option field: the arguments that set it, and the value the field then has. A new option
# fails test_every_option_is_tried until it has a row here.
TRIED: dict[str, tuple[list[str], Any]] = {
    "listen": ([], ("127.0.0.1", 9000)),
    "probe_listen": (["--probe-listen", ":8081"], ("0.0.0.0", 8081)),
    "metrics_listen": (["--metrics-listen", "[::1]:9474"], ("::1", 9474)),
    "events": (["--no-events"], False),
    "kubeconfig": (["--kubeconfig", "/k"], "/k"),
    "tls_cert": (["--tls-cert", "/c"], "/c"),
    "tls_key": (["--tls-key", "/k"], "/k"),
    "client_ca": (["--client-ca", "/ca"], "/ca"),
    "client_names": (["--client-name", "a", "--client-name", "b"], frozenset({"a", "b"})),
    "policy": (["--policy", "spread"], "spread"),
    "networks": (["--networks", "a, b,"], frozenset({"a", "b"})),
    "default_request": (
        ["--default-request", '[{"min_tx_rate": 5}]'],
        parse_request('[{"min_tx_rate": 5}]', "t"),
    ),
    "max_state_age": (["--max-state-age", "30"], 30.0),
    "reservation_ttl": (["--reservation-ttl", "12.5"], 12.5),
    "annotation": (["--annotation", "example.com/rdma"], "example.com/rdma"),
    "scheduler_names": (["--scheduler-name", "a", "--scheduler-name", "b"], frozenset({"a", "b"})),
    "max_connections": (["--max-connections", "7"], 7),
    "http_timeout": (["--http-timeout", "4"], 4.0),
    "best_nodes": (["--best-nodes", "3"], 3),
    "percentage_of_nodes_to_score": (["--percentage-of-nodes-to-score", "50"], 50),
    "log_level": (["--log-level", "debug"], "debug"),
}


def option_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(Settings) if flag_of(f) is not None}


def test_every_option_is_tried() -> None:
    assert set(TRIED) == option_fields()


@pytest.mark.parametrize("name", sorted(TRIED))
def test_each_flag_sets_its_own_field_and_only_it(name: str) -> None:
    argv, value = TRIED[name]
    got = options.settings([*LISTEN, *argv])
    assert getattr(got, name) == value
    base = options.settings(LISTEN)
    changed = {f.name for f in dataclasses.fields(Settings) if getattr(got, f.name) != getattr(base, f.name)}
    # --networks also gives the default request its one derived default (see below).
    assert changed <= {name, "listen", *(["default_request"] if name == "networks" else [])}


def test_without_flags_every_field_keeps_the_default_its_type_declares() -> None:
    assert options.settings(["--listen", "127.0.0.1:8888"]) == Settings()
    # The one derived default: a network named without a request gets one VF of no rate.
    got = options.settings([*LISTEN, "--networks", "a"])
    assert got.default_request == parse_request("[{}]", "--default-request")
    assert options.settings(
        [*LISTEN, "--networks", "a", "--default-request", "[{}, {}]"]
    ).default_request == (parse_request("[{}, {}]", "t"))


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-connections", "0"],
        ["--best-nodes", "x"],
        ["--percentage-of-nodes-to-score", "101"],
        ["--http-timeout", "601"],
        ["--reservation-ttl", "nan"],
        ["--annotation", "Bad Key"],
        ["--scheduler-name", "UPPER"],
        ["--default-request", "[{"],
        ["--probe-listen", "nowhere"],
        ["--policy", "random"],
    ],
)
def test_a_bad_value_is_refused_as_it_is_parsed(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        options.settings([*LISTEN, *argv])
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_a_field_that_says_neither_flag_nor_none_is_refused_loudly() -> None:
    @dataclasses.dataclass(frozen=True)
    class Made:
        shown: int = option(1, "a flag (default %(default)s)", type=int)
        hidden: int = internal(2)
        forgotten: int = 3

    with pytest.raises(TypeError, match=r"Settings\.forgotten: declare it with option"):
        options.parser(Made)

    @dataclasses.dataclass(frozen=True)
    class Fixed:
        shown: int = option(1, "a flag (default %(default)s)", type=int)
        hidden: int = internal(2)

    assert options.settings(["--shown", "5"], Fixed) == Fixed(5, 2)
    assert "(default 1)" in options.parser(Fixed).format_help()


def test_help_says_each_default_from_its_field() -> None:
    text = " ".join(options.parser().format_help().split())
    assert "(repeatable; default rdma-scheduler)" in text and "(default 256)" in text
