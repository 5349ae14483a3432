"""rdma_cni.exporter: what the agent's and the extender's /metrics share."""

from __future__ import annotations

import argparse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from rdma_cni import exporter


class _Fixed:
    def __init__(self, name: str) -> None:
        self.name = name

    def collect(self) -> Iterator[Any]:
        yield GaugeMetricFamily(self.name, "a test gauge", value=1.0)


def test_watching_another_collector_replaces_the_first() -> None:
    registry = CollectorRegistry()
    slot = exporter.CollectorSlot(registry)
    slot.watch(_Fixed("first"))
    assert registry.get_sample_value("first") == 1.0
    slot.watch(_Fixed("second"))
    assert registry.get_sample_value("first") is None
    assert registry.get_sample_value("second") == 1.0


def test_serve_answers_metrics_until_shut_down() -> None:
    registry = CollectorRegistry()
    exporter.CollectorSlot(registry).watch(_Fixed("served_gauge"))
    server = exporter.serve(registry, ("127.0.0.1", 0))
    try:
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            assert b"served_gauge 1.0" in resp.read()
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("value", "expected"),
    [("127.0.0.1:9101", ("127.0.0.1", 9101)), (":80", ("0.0.0.0", 80)), ("[::1]:0", ("::1", 0))],
)
def test_address_option(value: str, expected: tuple[str, int]) -> None:
    assert exporter.address_option("--metrics-listen", "0.0.0.0:9101")(value) == expected


@pytest.mark.parametrize("value", ["9101", "host:", "host:http", "host:65536", "host:-1"])
def test_address_option_refuses_what_is_not_addr_port(value: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as info:
        exporter.address_option("--listen", "127.0.0.1:8888")(value)
    assert str(info.value) == f"--listen {value!r}: expected ADDR:PORT, e.g. 127.0.0.1:8888"
