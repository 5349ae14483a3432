"""The network configuration model (load_netconf) and the pod request model (parse_request)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rdma_cni.cli.main import run_cni
from rdma_cni.cni import config as config_module
from rdma_cni.cni.config import DEFAULT_LOCK_FILE, DEFAULT_STATE_DIR, NetConf, load_netconf, suggest_field
from rdma_cni.cni.errors import InvalidConfig, InvalidPodRequest, UnsupportedField
from rdma_cni.cni.protocol import SUPPORTED_VERSIONS, valid_ifname
from rdma_cni.shared.podrequest import (
    DEFAULT_ANNOTATION,
    MAX_INTERFACES,
    MAX_RATE_MBPS,
    MAX_REQUEST_BYTES,
    InterfaceRequest,
    PodRequest,
    parse_request,
)

SOURCE = "pod team-a/trainer-0 annotation rdma_interfaces_required"


# Nothing here should read sysfs; if something does, it sees an empty tree.
pytestmark = pytest.mark.usefixtures("no_real_sysfs")


def conf(**extra: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"cniVersion": "1.1.0", "name": "rdma-net", "type": "rdma-cni"}
    doc.update(extra)
    return doc


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def config_log() -> Iterator[_Records]:
    """What rdma_cni.cni.config logs, whatever handlers the CLI installed on the parent logger."""
    logger = logging.getLogger("rdma_cni.config")
    handler = _Records()
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


# ---------------------------------------------------------------------------
# NetConf: valid configurations


def test_minimal_config_defaults() -> None:
    nc = load_netconf(conf())
    assert nc.cniVersion == "1.1.0" and nc.name == "rdma-net" and nc.type == "rdma-cni"
    assert nc.ipam is None and nc.pfs is None
    assert nc.annotation == DEFAULT_ANNOTATION
    assert nc.stateDir == DEFAULT_STATE_DIR and nc.lockFile == DEFAULT_LOCK_FILE
    assert nc.rdmaIsolation == "auto"
    assert nc.lockTimeoutSeconds == 60
    assert nc.logLevel == "info"
    assert nc.defaultRequest == [InterfaceRequest()]
    assert nc.capacityMbps == {}
    assert nc.vf_settings() == {}
    assert nc.unknown_keys == []


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
def test_every_supported_version_loads(version: str) -> None:
    assert load_netconf(conf(cniVersion=version)).cniVersion == version


def test_full_config() -> None:
    """Every field at once, each spelled as documented (so none is taken for a misspelling)."""
    doc = conf(
        ipam={"type": "host-local", "subnet": "10.1.0.0/24", "routes": [{"dst": "0.0.0.0/0"}]},
        dns={"nameservers": ["10.1.0.2"], "search": ["example.org"]},
        args={"cni": {"rdma_interfaces_required": [{}]}},
        runtimeConfig={"mac": "02:00:00:00:00:01"},
        prevResult={"cniVersion": "1.1.0", "interfaces": []},
        capabilities={"mac": True},
        pfs=["ens1f0", "ens1f1"],
        annotation="rdma.example.com/interfaces",
        defaultRequest=[{"min_tx_rate": 1000, "max_tx_rate": 2000}, {"name": "rdma1"}],
        kubeconfig="/etc/cni/net.d/rdma-cni.kubeconfig",
        rdmaIsolation="required",
        stateDir="/var/lib/cni/rdma-test",
        lockFile="/run/rdma-test/lock",
        lockTimeoutSeconds=2.5,
        ipamTimeoutSeconds=1.5,
        capacityMbps={"ens1f0": 100_000, "ens1f1": 0},
        dra=True,
        vlan=100,
        vlanQoS=3,
        spoofchk=False,
        trust=True,
        linkState="enable",
        mtu=9000,
        logFile="/var/log/rdma-cni.log",
        logLevel="debug",
    )
    assert set(doc) == set(NetConf.model_fields)
    nc = load_netconf(doc)
    assert nc.unknown_keys == []
    assert nc.ipam is not None and nc.ipam.type == "host-local"
    assert nc.ipam.model_extra == {"subnet": "10.1.0.0/24", "routes": [{"dst": "0.0.0.0/0"}]}
    assert nc.defaultRequest[0] == InterfaceRequest(min_tx_rate=1000, max_tx_rate=2000)
    assert nc.defaultRequest[1].name == "rdma1"
    assert nc.vf_settings() == {"vlan": [100, 3], "spoofchk": False, "trust": True, "link_state": "enable"}
    assert nc.dra is True


def test_a_dra_network_lists_its_pfs() -> None:
    with pytest.raises(InvalidConfig, match=r'a DRA network \("dra": true\) must list its PFs in pfs'):
        load_netconf(conf(dra=True))
    with pytest.raises(InvalidConfig, match="dra: Input should be a valid boolean"):
        load_netconf(conf(dra="yes", pfs=["a"]))
    assert load_netconf(conf()).dra is False


@pytest.mark.parametrize(
    "extra",
    [
        {"vlan": 0},
        {"vlan": 4095},
        {"vlan": 7, "vlanQoS": 7},
        {"vlanQoS": 0},
        {"mtu": 68},
        {"mtu": 65535},
        {"lockTimeoutSeconds": 600},
        {"lockTimeoutSeconds": 0.01},
        {"capacityMbps": {"eth0": MAX_RATE_MBPS}},
        {"annotation": "example.com/rdma"},
        {"annotation": "a"},
        {"rdmaIsolation": "off"},
        {"linkState": "auto"},
        {"logLevel": "warning"},
        {"defaultRequest": [{}] * MAX_INTERFACES},
        {"defaultRequest": [{"min_tx_rate": 5, "max_tx_rate": 0}]},
        {"pfs": ["ib0.8001"]},
        {"ipam": {"type": "whereabouts"}},
    ],
    ids=repr,
)
def test_valid_values(extra: dict[str, Any]) -> None:
    load_netconf(conf(**extra))


# ---------------------------------------------------------------------------
# NetConf: invalid values are code 7 with the field path and the reason

INVALID = [
    ({"rdmaIsolation": "sometimes"}, "rdmaIsolation", "'auto', 'required' or 'off'"),
    ({"rdmaIsolation": True}, "rdmaIsolation", "'auto', 'required' or 'off'"),
    ({"lockTimeoutSeconds": -1}, "lockTimeoutSeconds", "greater than 0"),
    ({"lockTimeoutSeconds": 0}, "lockTimeoutSeconds", "greater than 0"),
    ({"lockTimeoutSeconds": 601}, "lockTimeoutSeconds", "less than or equal to 600"),
    ({"lockTimeoutSeconds": "soon"}, "lockTimeoutSeconds", "valid number"),
    ({"vlan": 5000}, "vlan", "less than or equal to 4095"),
    ({"vlan": -1}, "vlan", "greater than or equal to 0"),
    ({"vlan": "100"}, "vlan", "valid integer"),
    ({"vlan": 1.5}, "vlan", "valid integer"),
    ({"vlan": True}, "vlan", "valid integer"),
    ({"vlanQoS": 3}, "vlanQoS", "non-zero vlan"),
    ({"vlan": 0, "vlanQoS": 3}, "vlanQoS", "non-zero vlan"),
    ({"vlan": 10, "vlanQoS": 8}, "vlanQoS", "less than or equal to 7"),
    ({"stateDir": "var/lib/cni"}, "stateDir", "absolute path"),
    ({"stateDir": "./state"}, "stateDir", "absolute path"),
    ({"stateDir": ""}, "stateDir", "absolute path"),
    ({"stateDir": "/var/lib/\x00x"}, "stateDir", "absolute path"),
    ({"lockFile": "rdma.lock"}, "lockFile", "absolute path"),
    ({"kubeconfig": "~/.kube/config"}, "kubeconfig", "absolute path"),
    ({"logFile": "rdma.log"}, "logFile", "absolute path"),
    ({"capacityMbps": {"eth0": -1}}, "capacityMbps.eth0", "greater than or equal to 0"),
    ({"capacityMbps": {"eth0": MAX_RATE_MBPS + 1}}, "capacityMbps.eth0", "less than or equal to"),
    ({"capacityMbps": {"eth0": 1.5}}, "capacityMbps.eth0", "valid integer"),
    ({"capacityMbps": {"../../etc": 10}}, "capacityMbps", "PF interface names"),
    ({"capacityMbps": {"a-very-long-interface": 10}}, "capacityMbps", "PF interface names"),
    ({"capacityMbps": [100]}, "capacityMbps", "valid dictionary"),
    ({"pfs": []}, "pfs", "at least one PF"),
    ({"pfs": ["eth0", "bad name"]}, "pfs", "not interface names"),
    ({"pfs": "eth0"}, "pfs", "valid list"),
    ({"annotation": "Bad Key!"}, "annotation", "annotation key"),
    ({"annotation": "rdma_interfaces_required\n"}, "annotation", "annotation key"),
    ({"annotation": "UPPER.example.com/x"}, "annotation", "annotation key"),
    ({"annotation": "a/b/c"}, "annotation", "annotation key"),
    ({"annotation": ""}, "annotation", "annotation key"),
    ({"mtu": 10}, "mtu", "greater than or equal to 68"),
    ({"mtu": 70000}, "mtu", "less than or equal to 65535"),
    ({"mtu": "1500"}, "mtu", "valid integer"),
    ({"logLevel": "loud"}, "logLevel", "'debug', 'info', 'warning' or 'error'"),
    ({"linkState": "up"}, "linkState", "'auto', 'enable' or 'disable'"),
    ({"defaultRequest": [{"min_tx_rate": 10, "max_tx_rate": 5}]}, "defaultRequest.0", "below min_tx_rate"),
    ({"defaultRequest": []}, "defaultRequest", "at least 1"),
    ({"defaultRequest": [{}] * (MAX_INTERFACES + 1)}, "defaultRequest", "at most 32"),
    ({"defaultRequest": [{"min_tx_rate": -1}]}, "defaultRequest.0.min_tx_rate", "greater than or equal"),
    ({"defaultRequest": [{"rate": 1}]}, "defaultRequest.0.rate", "Extra inputs"),
    ({"ipam": {"subnet": "10.0.0.0/24"}}, "ipam.type", "Field required"),
    ({"ipam": {"type": ""}}, "ipam.type", "at least 1 character"),
    ({"ipam": {"type": "../../bin/sh"}}, "ipam.type", "pattern"),
    ({"ipam": "host-local"}, "ipam", "valid dictionary"),
    ({"dns": {"nameserver": ["1.1.1.1"]}}, "dns.nameserver", "Extra inputs"),
    ({"name": ""}, "name", "at least 1 character"),
    ({"name": "../net"}, "name", "pattern"),
    ({"capabilities": {"mac": "yes please"}}, "capabilities.mac", "valid boolean"),
]


@pytest.mark.parametrize(("extra", "path", "reason"), INVALID, ids=[repr(i[0])[:60] for i in INVALID])
def test_invalid_values_are_code_7(extra: dict[str, Any], path: str, reason: str) -> None:
    with pytest.raises(InvalidConfig) as info:
        load_netconf(conf(**extra))
    assert info.value.code == 7
    assert path in info.value.msg, info.value.msg
    assert reason in info.value.msg, info.value.msg


def test_invalid_values_name_the_field_path_exactly() -> None:
    with pytest.raises(InvalidConfig) as info:
        load_netconf(conf(vlan=5000))
    assert info.value.msg.startswith("invalid network configuration: vlan: ")


def test_several_errors_are_all_reported() -> None:
    with pytest.raises(InvalidConfig) as info:
        load_netconf(conf(mtu=10, logLevel="loud", rdmaIsolation="x"))
    for field in ("mtu", "logLevel", "rdmaIsolation"):
        assert field in info.value.msg


def test_missing_name_is_code_7() -> None:
    doc = conf()
    del doc["name"]
    with pytest.raises(InvalidConfig, match="name: Field required"):
        load_netconf(doc)


@pytest.mark.parametrize("version", ["0.2.0", "1.2.0", None])
def test_load_netconf_refuses_unsupported_versions(version: Any) -> None:
    with pytest.raises(InvalidConfig):
        load_netconf(conf(cniVersion=version))


# ---------------------------------------------------------------------------
# Unknown keys: misspellings are code 2, the rest is accepted and logged

MISSPELLINGS = [
    ("max-tx-rate", "max_tx_rate"),
    ("max_tx_rate", "max_tx_rate"),
    ("min_tx_rate", "min_tx_rate"),
    ("minTxRate", "min_tx_rate"),
    ("rdma_isolation", "rdmaIsolation"),
    ("rdmaisolation", "rdmaIsolation"),
    ("statedir", "stateDir"),
    ("state-dir", "stateDir"),
    ("lockfile", "lockFile"),
    ("lock_file", "lockFile"),
    ("capacity_mbps", "capacityMbps"),
    ("CapacityMbps", "capacityMbps"),
    ("link_state", "linkState"),
    ("vlan_qos", "vlanQoS"),
    ("loglevel", "logLevel"),
    ("log_file", "logFile"),
    ("lockTimeoutSecond", "lockTimeoutSeconds"),
    ("defaultRequests", "defaultRequest"),
    ("rdmaIsolaton", "rdmaIsolation"),
]


@pytest.mark.parametrize(("key", "meant"), MISSPELLINGS)
def test_misspelled_key_is_code_2(key: str, meant: str) -> None:
    with pytest.raises(UnsupportedField) as info:
        load_netconf(conf(**{key: 1000}))
    assert info.value.code == 2
    assert repr(key) in info.value.msg
    assert meant in info.value.msg
    assert f"{key}=1000" in info.value.details


def test_misspelling_wins_over_invalid_values() -> None:
    """Naming the misspelled key is more useful than a value error elsewhere."""
    with pytest.raises(UnsupportedField):
        load_netconf(conf(statedir="/x", vlan=99999))


def test_misspelled_key_details_are_bounded() -> None:
    with pytest.raises(UnsupportedField) as info:
        load_netconf(conf(statedir="/" + "x" * 10_000))
    assert len(info.value.details) < 300


@pytest.mark.parametrize(
    "key", ["deviceID", "pciBusID", "foo", "plugins", "cni.dev/valid-attachments", "x-vendor"]
)
def test_unrelated_unknown_keys_are_accepted(key: str) -> None:
    nc = load_netconf(conf(**{key: "anything"}))
    assert key in nc.unknown_keys


def test_unknown_keys_are_logged(config_log: _Records) -> None:
    load_netconf(conf(foo=1, deviceID="0000:3b:02.1", pciBusID="0000:3b:02.1"))
    text = "\n".join(config_log.messages)
    assert "'foo'" in text
    # Keys that runtimes and Multus add on their own are not worth a line.
    assert "deviceID" not in text and "pciBusID" not in text


@pytest.mark.parametrize(
    ("key", "meant"),
    [("statedir", "stateDir"), ("STATEDIR", "stateDir"), ("foo", None), ("deviceid", None), ("x", None)],
)
def test_suggest_field(key: str, meant: str | None) -> None:
    assert suggest_field(key) == meant


# ---------------------------------------------------------------------------
# Through run_cni: the codes reach the error document


@pytest.fixture
def dirs(tmp_path: Path) -> dict[str, str]:
    return {"stateDir": str(tmp_path / "state"), "lockFile": str(tmp_path / "lock" / "l")}


@pytest.mark.parametrize(
    ("extra", "code", "fragment"),
    [
        ({"vlan": 5000}, 7, "vlan"),
        ({"ipam": {}}, 7, "ipam.type"),
        ({"capacity_mbps": {"eth0": 1}}, 2, "capacityMbps"),
        ({"max-tx-rate": 100}, 2, "max_tx_rate"),
    ],
)
def test_config_errors_through_run_cni(
    dirs: dict[str, str], tmp_path: Path, extra: dict[str, Any], code: int, fragment: str
) -> None:
    environ = {"CNI_COMMAND": "DEL", "CNI_CONTAINERID": "c1", "CNI_IFNAME": "net1"}
    exit_code, doc = run_cni(environ, json.dumps(conf(**dirs, **extra)).encode())
    assert exit_code != 0 and doc is not None
    assert doc["code"] == code and fragment in doc["msg"]
    assert set(doc) == {"cniVersion", "code", "msg", "details"}
    assert not (tmp_path / "state").exists()


def test_unknown_keys_accepted_through_run_cni(dirs: dict[str, str]) -> None:
    environ = {"CNI_COMMAND": "DEL", "CNI_CONTAINERID": "c1", "CNI_IFNAME": "net1"}
    doc = conf(**dirs, deviceID="0000:3b:02.1", pciBusID="0000:3b:02.1", foo={"bar": 1})
    assert run_cni(environ, json.dumps(doc).encode()) == (0, None)


# ---------------------------------------------------------------------------
# Pod requests: valid


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("[{}]", [InterfaceRequest()]),
        (
            '[{"min_tx_rate": 15000, "max_tx_rate": 20000}, {"min_tx_rate": 5000}, {}]',
            [
                InterfaceRequest(min_tx_rate=15000, max_tx_rate=20000),
                InterfaceRequest(min_tx_rate=5000),
                InterfaceRequest(),
            ],
        ),
        ('[{"max_tx_rate": 100}]', [InterfaceRequest(max_tx_rate=100)]),
        ('[{"min_tx_rate": 100, "max_tx_rate": 0}]', [InterfaceRequest(min_tx_rate=100)]),
        ('[{"min_tx_rate": 100, "max_tx_rate": 100}]', [InterfaceRequest(min_tx_rate=100, max_tx_rate=100)]),
        (f'[{{"max_tx_rate": {MAX_RATE_MBPS}}}]', [InterfaceRequest(max_tx_rate=MAX_RATE_MBPS)]),
        (
            '[{"name": "net1"}, {"name": "rdma1"}]',
            [InterfaceRequest(name="net1"), InterfaceRequest(name="rdma1")],
        ),
        ('[{"name": null}]', [InterfaceRequest()]),
        ("  [ {} ]  ", [InterfaceRequest()]),
        ("[" + ",".join(["{}"] * MAX_INTERFACES) + "]", [InterfaceRequest()] * MAX_INTERFACES),
    ],
    ids=lambda x: x[:40] if isinstance(x, str) else "",
)
def test_valid_requests(raw: str, expected: list[InterfaceRequest]) -> None:
    assert parse_request(raw, SOURCE) == PodRequest(interfaces=expected)
    # The same value already decoded (from the config's args) gives the same request.
    assert parse_request(json.loads(raw), SOURCE) == PodRequest(interfaces=expected)


def test_seed_annotation_format_is_accepted_unchanged() -> None:
    raw = '[{"min_tx_rate": 15000, "max_tx_rate": 20000}, {"min_tx_rate": 5000}, {}]'
    req = parse_request(raw, SOURCE)
    assert [(i.min_tx_rate, i.max_tx_rate) for i in req.interfaces] == [(15000, 20000), (5000, 0), (0, 0)]


# ---------------------------------------------------------------------------
# Pod requests: every violation is code 101 naming the source and the entry

INVALID_REQUESTS = [
    # (raw, fragments the message must contain besides the source)
    ("[]", ["no interfaces"]),
    ("", ["not valid JSON"]),
    ("not json", ["not valid JSON"]),
    ("[{}", ["not valid JSON"]),
    ("[" * 60_000, ["nested 60000 levels deep, the limit is 512"]),
    ("[" * 513 + "{}" + "]" * 513, ["nested 514 levels deep, the limit is 512"]),
    ("{}", ["expected a JSON list", "object"]),
    ('{"min_tx_rate": 1}', ["expected a JSON list", "object"]),
    ('"[{}]"', ["expected a JSON list", "string"]),
    ("3", ["expected a JSON list", "number"]),
    ("null", ["expected a JSON list", "null"]),
    ("true", ["expected a JSON list", "boolean"]),
    ("[" + ",".join(["{}"] * (MAX_INTERFACES + 1)) + "]", ["33 interfaces", "32"]),
    ("[1]", ["entry 0", "dictionary"]),
    ("[{}, []]", ["entry 1", "dictionary"]),
    ("[{}, null]", ["entry 1"]),
    ('[{"min_tx_rate": 1.5}]', ["entry 0.min_tx_rate", "integer"]),
    ('[{"min_tx_rate": 1.0}]', ["entry 0.min_tx_rate", "integer"]),
    ('[{"min_tx_rate": "1000"}]', ["entry 0.min_tx_rate", "integer"]),
    ('[{"min_tx_rate": true}]', ["entry 0.min_tx_rate", "integer"]),
    ('[{"min_tx_rate": null}]', ["entry 0.min_tx_rate", "integer"]),
    ('[{"min_tx_rate": -1}]', ["entry 0.min_tx_rate", "greater than or equal to 0"]),
    ('[{}, {"max_tx_rate": -5}]', ["entry 1.max_tx_rate", "greater than or equal to 0"]),
    (f'[{{"max_tx_rate": {MAX_RATE_MBPS + 1}}}]', ["entry 0.max_tx_rate", "less than or equal to"]),
    ('[{"max_tx_rate": 1e400}]', ["entry 0.max_tx_rate"]),
    ('[{"max_tx_rate": 99999999999999999999999999}]', ["entry 0.max_tx_rate"]),
    ('[{}, {"min_tx_rate": 2000, "max_tx_rate": 1000}]', ["entry 1", "below min_tx_rate"]),
    ('[{"min_tx_rate": 1, "rate": 2}]', ["entry 0.rate", "Extra inputs"]),
    ('[{"minTxRate": 1}]', ["entry 0.minTxRate", "Extra inputs"]),
    ('[{"name": "net1"}, {}, {"name": "net1"}]', ["entries 0 and 2", "'net1'", "unique"]),
    ('[{"name": ""}]', ["entry 0.name", "valid interface name"]),
    ('[{"name": "a/b"}]', ["entry 0.name", "valid interface name"]),
    ('[{"name": ".."}]', ["entry 0.name", "valid interface name"]),
    ('[{"name": "abcdefghijklmnop"}]', ["entry 0.name", "valid interface name"]),
    ('[{"name": "net 1"}]', ["entry 0.name", "valid interface name"]),
    ('[{"name": "n\\u00e9t"}]', ["entry 0.name", "valid interface name"]),
    ('[{"name": "a\\u0000b"}]', ["entry 0.name", "valid interface name"]),
    ('[{"name": "\\ud800"}]', ["entry 0.name", "valid interface name"]),
    ('[{"name": 5}]', ["entry 0.name", "string"]),
    (" " * (MAX_REQUEST_BYTES + 1), ["bytes", str(MAX_REQUEST_BYTES)]),
    ("[" + " " * MAX_REQUEST_BYTES + "{}]", ["bytes", str(MAX_REQUEST_BYTES)]),
    ('[{"name": "' + "\u00e9" * (MAX_REQUEST_BYTES // 2) + '"}]', ["bytes"]),
]


@pytest.mark.parametrize(
    ("raw", "fragments"), INVALID_REQUESTS, ids=[repr(r[0])[:50] for r in INVALID_REQUESTS]
)
def test_invalid_requests_are_code_101(raw: str, fragments: list[str]) -> None:
    with pytest.raises(InvalidPodRequest) as info:
        parse_request(raw, SOURCE)
    assert info.value.code == 101
    assert info.value.msg.startswith(SOURCE + ": "), info.value.msg
    for fragment in fragments:
        assert fragment in info.value.msg, (fragment, info.value.msg)


@pytest.mark.parametrize("value", [{}, {"min_tx_rate": 1}, 3, None, True, 1.5, [], [[]]], ids=repr)
def test_invalid_decoded_requests_are_code_101(value: Any) -> None:
    """Values from the config's args.cni arrive decoded; the same rules apply."""
    with pytest.raises(InvalidPodRequest) as info:
        parse_request(value, "config args.cni.rdma_interfaces_required")
    assert info.value.msg.startswith("config args.cni.rdma_interfaces_required: ")


def test_request_errors_are_bounded_for_oversized_input() -> None:
    with pytest.raises(InvalidPodRequest) as info:
        parse_request("x" * (10 * MAX_REQUEST_BYTES), SOURCE)
    assert len(info.value.msg) < 500


def test_request_model_is_immutable() -> None:
    req = parse_request("[{}]", SOURCE)
    with pytest.raises(ValueError):
        req.interfaces[0].min_tx_rate = 5  # type: ignore[misc]


# ---------------------------------------------------------------------------
# Fuzzing: parse_request returns a valid PodRequest or raises InvalidPodRequest

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5)
    ),
    max_leaves=30,
)
# Entries close to valid ones, so that the fuzzer also reaches the success path
# and the cross-entry checks (max >= min, unique names).
rates = st.one_of(
    st.integers(min_value=0, max_value=MAX_RATE_MBPS),
    st.integers(min_value=-5, max_value=5),
    st.sampled_from([MAX_RATE_MBPS + 1, 2**63, 1.0, "5", True, None]),
)
names = st.one_of(
    st.sampled_from(["net1", "net2", "rdma0", "", ".", "..", "a/b", "x" * 16, "eth%d"]),
    st.text(min_size=1, max_size=16),
    st.none(),
)
near_entries = st.fixed_dictionaries(
    {},
    optional={
        "min_tx_rate": rates,
        "max_tx_rate": rates,
        "name": names,
        "extra": json_scalars,
    },
)
near_requests = st.lists(near_entries, max_size=MAX_INTERFACES + 2)


def _check_outcome(raw: Any) -> None:
    try:
        req = parse_request(raw, SOURCE)
    except InvalidPodRequest as exc:
        assert exc.code == 101
        assert exc.msg.startswith(SOURCE + ": ")
        json.dumps(exc.to_dict("1.1.0"))
        return
    assert isinstance(req, PodRequest)
    assert 1 <= len(req.interfaces) <= MAX_INTERFACES
    seen = set()
    for entry in req.interfaces:
        assert isinstance(entry.min_tx_rate, int) and not isinstance(entry.min_tx_rate, bool)
        assert isinstance(entry.max_tx_rate, int) and not isinstance(entry.max_tx_rate, bool)
        assert 0 <= entry.min_tx_rate <= MAX_RATE_MBPS
        assert 0 <= entry.max_tx_rate <= MAX_RATE_MBPS
        assert entry.max_tx_rate == 0 or entry.max_tx_rate >= entry.min_tx_rate
        if entry.name is not None:
            assert valid_ifname(entry.name) and entry.name.isascii()
            assert entry.name not in seen
            seen.add(entry.name)


FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(json_values)
def test_fuzz_decoded_values(value: Any) -> None:
    _check_outcome(value)


@FUZZ
@given(json_values)
def test_fuzz_annotation_text(value: Any) -> None:
    _check_outcome(json.dumps(value))


@FUZZ
@given(near_requests)
def test_fuzz_near_valid_requests(value: list[dict[str, Any]]) -> None:
    _check_outcome(value)
    _check_outcome(json.dumps(value))


@FUZZ
@given(st.text(max_size=200))
def test_fuzz_arbitrary_text(raw: str) -> None:
    _check_outcome(raw)


@st.composite
def valid_entries(draw: st.DrawFn) -> dict[str, Any]:
    entry: dict[str, Any] = {}
    low = draw(st.integers(min_value=0, max_value=MAX_RATE_MBPS))
    if draw(st.booleans()):
        entry["min_tx_rate"] = low
    if draw(st.booleans()):
        entry["max_tx_rate"] = draw(
            st.just(0) | st.integers(min_value=entry.get("min_tx_rate", 0), max_value=MAX_RATE_MBPS)
        )
    return entry


@FUZZ
@given(
    st.lists(valid_entries(), min_size=1, max_size=MAX_INTERFACES),
    st.lists(st.from_regex(r"[a-z][a-z0-9_.-]{0,14}", fullmatch=True), unique=True, max_size=MAX_INTERFACES),
)
def test_fuzz_valid_requests_are_accepted(entries: list[dict[str, Any]], names: list[str]) -> None:
    names = [n for n in names if n not in (".", "..")]
    for entry, name in zip(entries, names, strict=False):
        entry["name"] = name
    req = parse_request(json.dumps(entries), SOURCE)
    assert len(req.interfaces) == len(entries)
    for entry, parsed in zip(entries, req.interfaces, strict=True):
        assert parsed.min_tx_rate == entry.get("min_tx_rate", 0)
        assert parsed.max_tx_rate == entry.get("max_tx_rate", 0)
        assert parsed.name == entry.get("name")


def test_unknown_keys_cost_bounded_work(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import difflib

    calls = []
    real = difflib.get_close_matches
    monkeypatch.setattr(difflib, "get_close_matches", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    doc: dict[str, Any] = {"cniVersion": "1.1.0", "name": "n", "type": "rdma-cni"}
    doc.update({f"k{i}": i for i in range(5000)})
    caplog.set_level(logging.INFO, logger="rdma_cni")
    load_netconf(doc)
    assert len(calls) == config_module.FUZZY_SUGGESTIONS
    assert "ignoring 4980 more unknown network configuration keys" in caplog.text
    assert (
        caplog.text.count("ignoring unknown network configuration key") == config_module.LOGGED_UNKNOWN_KEYS
    )
    # A misspelling past the fuzzy budget is still caught when it differs only by case or separators.
    with pytest.raises(UnsupportedField, match="stateDir"):
        load_netconf({**doc, "state_dir": "/x"})


def test_a_key_too_long_to_match_skips_difflib(monkeypatch: pytest.MonkeyPatch) -> None:
    import difflib

    monkeypatch.setattr(difflib, "get_close_matches", lambda *a, **k: pytest.fail("difflib ran"))
    assert suggest_field("x" * 10_000) is None


# ---------------------------------------------------------------------------
# Constraints: pf, rail, different_pfs (the request) and rails on the config's pfs


def test_constrained_requests() -> None:
    req = parse_request('[{"rail": "rail-0", "min_tx_rate": 100}, {"pf": "ens1f0"}, {}]', SOURCE)
    assert [(i.pf, i.rail) for i in req.interfaces] == [(None, "rail-0"), ("ens1f0", None), (None, None)]
    assert req.different_pfs is False
    spread = parse_request('{"interfaces": [{"rail": "a.b_c-1"}, {}], "different_pfs": true}', SOURCE)
    assert spread.different_pfs is True and spread.interfaces[0].rail == "a.b_c-1"
    # The object form without the flag means what the list means.
    assert parse_request('{"interfaces": [{}]}', SOURCE) == parse_request("[{}]", SOURCE)
    assert parse_request({"interfaces": [{}], "different_pfs": True}, SOURCE).different_pfs


INVALID_CONSTRAINTS = [
    ('[{"pf": "ens1f0", "rail": "r"}]', ["entry 0:", "names both pf 'ens1f0' and rail 'r'"]),
    ('[{"pf": "bad name"}]', ["entry 0.pf", "valid PF interface name"]),
    ('[{"pf": ""}]', ["entry 0.pf"]),
    ('[{"pf": 3}]', ["entry 0.pf", "string"]),
    ('[{}, {"rail": "-r"}]', ["entry 1.rail", "not a rail label"]),
    ('[{"rail": "r r"}]', ["entry 0.rail", "not a rail label"]),
    ('[{"rail": ""}]', ["entry 0.rail", "not a rail label"]),
    ('[{"rail": "' + "r" * 64 + '"}]', ["entry 0.rail", "1-63 characters"]),
    ('[{"rail": null, "pf": null}]', None),
    ('{"interfaces": [{}], "different_pfs": "yes"}', ["different_pfs", "boolean"]),
    ('{"interfaces": [{}], "different_pfs": 1}', ["different_pfs", "boolean"]),
    ('{"interfaces": [{}], "spread": true}', ["spread", "Extra inputs"]),
    ('{"interfaces": {}}', ["interfaces: expected a JSON list"]),
    ('{"interfaces": []}', ["no interfaces"]),
    ('{"interfaces": [{"rail": 5}]}', ["interfaces entry 0.rail", "string"]),
    ('{"different_pfs": true}', ["expected a JSON list", "different_pfs"]),
]


@pytest.mark.parametrize(
    ("raw", "fragments"), INVALID_CONSTRAINTS, ids=[repr(r[0])[:50] for r in INVALID_CONSTRAINTS]
)
def test_invalid_constraints_are_code_101_naming_the_field(raw: str, fragments: list[str] | None) -> None:
    if fragments is None:
        parse_request(raw, SOURCE)  # null means "not set"
        return
    with pytest.raises(InvalidPodRequest) as info:
        parse_request(raw, SOURCE)
    assert info.value.code == 101 and info.value.msg.startswith(SOURCE + ": ")
    for fragment in fragments:
        assert fragment in info.value.msg, (fragment, info.value.msg)


def test_pfs_entries_may_carry_rails() -> None:
    nc = load_netconf(conf(pfs=[{"name": "ens1f0", "rail": "rail-0"}, "ens2f0", {"name": "ens3f0"}]))
    assert nc.pfs == ["ens1f0", "ens2f0", "ens3f0"]  # readers of pfs see names, as before
    assert nc.rails == {"ens1f0": "rail-0"}
    assert load_netconf(conf(pfs=["ens1f0"])).rails == {}
    assert load_netconf(conf()).rails == {}


@pytest.mark.parametrize(
    ("pfs", "fragments"),
    [
        ([{"name": "ens1f0", "rail": "-x"}], ["pfs.0.rail", "not a rail label"]),
        (["a", {"name": "bad name"}], ["pfs.1.name", "not an interface name"]),
        ([{"rail": "r"}], ["pfs.0.name", "Field required"]),
        ([{"name": "a", "speed": 1}], ["pfs.0.speed", "Extra inputs"]),
        ([{"name": "a", "rail": 3}], ["pfs.0.rail", "string"]),
    ],
)
def test_invalid_pf_entries_are_code_7(pfs: list[Any], fragments: list[str]) -> None:
    with pytest.raises(InvalidConfig) as info:
        load_netconf(conf(pfs=pfs))
    assert info.value.code == 7
    for fragment in fragments:
        assert fragment in info.value.msg, info.value.msg
