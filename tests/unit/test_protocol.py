"""The CNI protocol layer: verbs, versions, environment, results, errors, and stdout hygiene.

Everything here runs without root and without a node: the success paths of
ADD/CHECK belong to the integration tier. ``RDMA_CNI_SYSFS_ROOT`` points at an
empty temporary directory in every test, so the real ``/sys`` is never read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from rdma_cni import __version__
from rdma_cni.cli.main import run_cni
from rdma_cni.cni.errors import (
    CniError,
    DecodeFailure,
    IncompatibleVersion,
    InternalError,
    InvalidConfig,
    InvalidEnvironment,
)
from rdma_cni.cni.protocol import (
    LATEST_VERSION,
    MIN_VERSION_FOR_VERB,
    REQUIRED_ENV,
    SUPPORTED_VERSIONS,
    USED_ENV,
    VERBS,
    CniEnv,
    Interface,
    IPConfig,
    PodRef,
    Result,
    Route,
    check_version,
    decode_stdin,
    parse_cni_args,
    parse_env,
    valid_ifname,
    validate_ifname,
    version_document,
    version_tuple,
)

ROOT = Path(__file__).resolve().parents[2]

EXPECTED_VERSIONS = ("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")
CONF_VERBS = ("ADD", "DEL", "CHECK", "STATUS", "GC")
ATTACHMENT_VERBS = ("ADD", "DEL", "CHECK")
# What libcni's GetVersionInfo sets when it probes a plugin before using a
# conflist ("fake values required by plugins built against an older version
# of skel"); podman and CRI-O drop the network unless the probe succeeds.
LIBCNI_VERSION_PROBE = {
    "CNI_COMMAND": "VERSION",
    "CNI_NETNS": "dummy",
    "CNI_IFNAME": "dummy",
    "CNI_PATH": "dummy",
}
UNSUPPORTED_VERSIONS: tuple[Any, ...] = (
    "0.1.0",
    "0.2.0",
    "0.4.1",
    "1.0.1",
    "1.2.0",
    "2.0.0",
    "1.0",
    "v1.0.0",
    "",
    None,
    1,
    1.0,
    ["1.0.0"],
)
ERROR_KEYS = {"cniVersion", "code", "msg", "details"}

# The spec's table of required variables (CNI_COMMAND itself aside).
SPEC_REQUIRED = {
    "ADD": {"CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME"},
    "CHECK": {"CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME"},
    "DEL": {"CNI_CONTAINERID", "CNI_IFNAME"},
    "GC": {"CNI_PATH"},
    "STATUS": set(),
    "VERSION": set(),
}

K8S_ARGS = (
    "IgnoreUnknown=true;K8S_POD_NAMESPACE=team-a;K8S_POD_NAME=trainer-0;"
    "K8S_POD_INFRA_CONTAINER_ID=0123abcd;K8S_POD_UID=5f0c11ee-8a0b-4c6e-9d3f-0123456789ab"
)

HOSTILE_IFNAMES = (
    "../../etc/x",
    "a/b",
    "..",
    ".",
    "abcdefghijklmnop",  # 16 characters
    "net 1",
    "net:1",
    " net1",
    "net1\n",
    "\tnet1",
    "eth%d",
    "n\u00e9t1",  # non-ASCII
    "\u0435th0",  # Cyrillic e: looks like eth0
    "net\u00a01",  # no-break space
    "\udcff",  # an undecodable environment byte, as os.environ presents it
    "ne\x00t",
    "ne\x7ft",
)
HOSTILE_CONTAINER_IDS = (
    "../../etc/x",
    "a/b",
    "..",
    ".",
    "-leading-dash",
    "_leading",
    ".hidden",
    "abc@net1",
    "ctr id",
    "ctr\n",
    "ctr:1",
    "c\u00f6ntainer",
    "\udcff",
    "x" * 201,
)


# ---------------------------------------------------------------------------
# Fixtures and helpers


@dataclasses.dataclass
class Node:
    """A throwaway place for one test's state: empty sysfs, stateDir and lockFile."""

    root: Path
    sysfs: Path
    state_dir: Path
    lock_file: Path

    def conf(self, version: Any = LATEST_VERSION, **extra: Any) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "name": "rdma-net",
            "type": "rdma-cni",
            "stateDir": str(self.state_dir),
            "lockFile": str(self.lock_file),
        }
        if version is not _MISSING:
            doc["cniVersion"] = version
        doc.update(extra)
        return doc

    def files(self) -> list[str]:
        """Everything under the state and lock directories (relative paths)."""
        out = []
        for top in (self.state_dir, self.lock_file.parent):
            if top.exists():
                out += [str(p.relative_to(self.root)) for p in top.rglob("*")]
        return sorted(out)

    def stray_files(self) -> list[str]:
        """Anything in the test's tree other than the (empty) sysfs root."""
        return sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*") if p != self.sysfs)


_MISSING = object()


# Even tests without the node fixture never read the real /sys.
pytestmark = pytest.mark.usefixtures("no_real_sysfs")


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Node:
    # Nested so that "../../etc/x" relative to the attachments directory would
    # still land inside tmp_path, where stray_files() would see it.
    base = tmp_path / "a" / "b"
    sysfs = tmp_path / "empty-sys"  # the one _no_real_sysfs made
    sysfs.mkdir(exist_ok=True)
    monkeypatch.setenv("RDMA_CNI_SYSFS_ROOT", str(sysfs))
    monkeypatch.delenv("RDMA_CNI_FAKE_VF_CONTROL", raising=False)
    return Node(tmp_path, sysfs, base / "state", base / "lock" / "rdma-cni.lock")


def full_env(verb: str, node: Node | None = None, **overrides: str) -> dict[str, str]:
    """Every variable any verb needs; ``overrides`` with value "" are removed."""
    env = {
        "CNI_COMMAND": verb,
        "CNI_CONTAINERID": "0a1b2c3d4e5f",
        "CNI_NETNS": "/var/run/netns/cni-0a1b2c3d",
        "CNI_IFNAME": "net1",
        "CNI_PATH": "/opt/cni/bin",
        "CNI_ARGS": K8S_ARGS,
    }
    if node is not None:
        env["RDMA_CNI_SYSFS_ROOT"] = str(node.sysfs)
    env.update(overrides)
    return {k: v for k, v in env.items() if v != ""}


def invoke(environ: Mapping[str, str], stdin: Any) -> tuple[int, dict[str, Any] | None]:
    """run_cni with a document (serialized) or raw bytes; the answer must be JSON-serializable."""
    raw = stdin if isinstance(stdin, bytes) else json.dumps(stdin).encode()
    code, doc = run_cni(environ, raw)
    if doc is not None:
        json.dumps(doc)
    return code, doc


def assert_error(answer: tuple[int, dict[str, Any] | None], code: int, *fragments: str) -> dict[str, Any]:
    """The answer is a CNI error document with ``code`` whose text contains every fragment."""
    exit_code, doc = answer
    assert exit_code != 0, doc
    assert doc is not None
    assert set(doc) == ERROR_KEYS, doc
    assert doc["code"] == code, doc
    assert isinstance(doc["msg"], str) and doc["msg"]
    assert isinstance(doc["details"], str)
    assert isinstance(doc["cniVersion"], str) and doc["cniVersion"]
    text = doc["msg"] + " " + doc["details"]
    for fragment in fragments:
        assert fragment in text, (fragment, doc)
    return doc


def single_json(stdout: str) -> dict[str, Any]:
    """stdout holds exactly one JSON document (one line) and nothing else."""
    doc, end = json.JSONDecoder().raw_decode(stdout)
    assert stdout[end:] == "\n", repr(stdout)
    assert stdout.count("\n") == 1, repr(stdout)
    assert isinstance(doc, dict)
    return doc


# ---------------------------------------------------------------------------
# Versions


def test_supported_versions_and_verbs() -> None:
    assert SUPPORTED_VERSIONS == EXPECTED_VERSIONS
    assert LATEST_VERSION == "1.1.0"
    assert set(VERBS) == {"ADD", "DEL", "CHECK", "VERSION", "STATUS", "GC"}
    assert MIN_VERSION_FOR_VERB == {"CHECK": "0.4.0", "STATUS": "1.1.0", "GC": "1.1.0"}


@pytest.mark.parametrize("verb", sorted(SPEC_REQUIRED))
def test_required_env_matches_the_spec(verb: str) -> None:
    assert set(REQUIRED_ENV[verb]) == SPEC_REQUIRED[verb]


@pytest.mark.parametrize(
    ("text", "expected"), [("0.3.0", (0, 3, 0)), ("1.1.0", (1, 1, 0)), ("10.20.30", (10, 20, 30))]
)
def test_version_tuple(text: str, expected: tuple[int, int, int]) -> None:
    assert version_tuple(text) == expected


@pytest.mark.parametrize("text", ["1.0", "1.0.0.0", "a.b.c", "", "1..0", "-1.0.0", "1.0.0-rc1"])
def test_version_tuple_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not a semantic version"):
        version_tuple(text)


def _allowed(verb: str, version: str) -> bool:
    minimum = MIN_VERSION_FOR_VERB.get(verb)
    return minimum is None or version_tuple(version) >= version_tuple(minimum)


@pytest.mark.parametrize("verb", CONF_VERBS)
@pytest.mark.parametrize("version", EXPECTED_VERSIONS)
def test_check_version_matrix(verb: str, version: str) -> None:
    if _allowed(verb, version):
        assert check_version(version, verb) == version
    else:
        with pytest.raises(IncompatibleVersion) as info:
            check_version(version, verb)
        assert info.value.code == 1
        assert verb in info.value.msg and MIN_VERSION_FOR_VERB[verb] in info.value.msg


@pytest.mark.parametrize("version", UNSUPPORTED_VERSIONS, ids=repr)
def test_check_version_rejects_unsupported(version: Any) -> None:
    with pytest.raises(IncompatibleVersion) as info:
        check_version(version, "ADD")
    assert info.value.code == 1
    for supported in EXPECTED_VERSIONS:
        assert supported in info.value.msg


# ---------------------------------------------------------------------------
# stdin


def test_decode_stdin_object() -> None:
    assert decode_stdin(b'{"cniVersion": "1.0.0", "name": "n"}') == {"cniVersion": "1.0.0", "name": "n"}


@pytest.mark.parametrize(
    "raw",
    [b"", b"   ", b"not json", b"{", b'{"a": }', b"\xff\xfe{}", b"{'single': 'quotes'}"],
    ids=["empty", "blank", "text", "truncated", "bad-value", "not-utf8", "python-dict"],
)
def test_decode_stdin_not_json_is_code_6(raw: bytes) -> None:
    with pytest.raises(DecodeFailure) as info:
        decode_stdin(raw)
    assert info.value.code == 6
    assert "not JSON" in info.value.msg or "not UTF-8" in info.value.msg


def _deep_args(depth: int) -> bytes:
    """A config whose args.cni (a pod's Multus cni-args) nests ``depth`` levels in all."""
    inner = depth - 3  # the config, args and cni objects are the first three levels
    deep = "[" * inner + "]" * inner
    return (
        '{"cniVersion": "1.1.0", "name": "n", "type": "rdma-cni", "args": {"cni": {"x": ' + deep + "}}}"
    ).encode()


@pytest.mark.parametrize("depth", [10, 512])
def test_decode_stdin_reads_nesting_up_to_the_bound(depth: int) -> None:
    doc = decode_stdin(_deep_args(depth))
    level, inner = 3, doc["args"]["cni"]["x"]
    while inner:
        level, inner = level + 1, inner[0]
    assert level + 1 == depth


@pytest.mark.parametrize("depth", [513, 1_000, 100_000])
def test_decode_stdin_refuses_deeper_nesting_as_code_7(depth: int) -> None:
    with pytest.raises(InvalidConfig) as info:
        decode_stdin(_deep_args(depth))
    assert info.value.code == 7
    assert f"nested {depth} levels deep, more than the 512" in info.value.msg and "args.cni" in info.value.msg
    with pytest.raises(InvalidConfig):
        decode_stdin(b"[" * depth)  # not JSON either: the depth is measured first, at the same cost


@pytest.mark.parametrize("depth", [10, 1_000, 100_000])
def test_deep_cni_args_through_the_verb_is_a_clean_error(node: Node, depth: int) -> None:
    """ADD of a pod whose cni-args nest deep: a typed error, never a traceback or code 199."""
    code, doc = invoke(full_env("ADD", node, CNI_ARGS=""), _deep_args(depth))
    assert code != 0 and doc is not None
    assert doc["code"] == (7 if depth > 512 else 3), doc  # 3: past the config, to the missing netns
    assert "Traceback" not in doc["details"] and "RecursionError" not in doc["details"]


@pytest.mark.parametrize("raw", [b"[]", b"[{}]", b"1", b'"x"', b"null", b"true"])
def test_decode_stdin_not_an_object_is_code_6(raw: bytes) -> None:
    with pytest.raises(DecodeFailure) as info:
        decode_stdin(raw)
    assert info.value.code == 6
    assert "expected a JSON object" in info.value.msg


# ---------------------------------------------------------------------------
# Interface names and CNI_ARGS


@pytest.mark.parametrize("name", ["net1", "eth0", "a", "x" * 15, "ib0.8001", "net-1_a", "vf@1", "A.B"])
def test_valid_ifnames(name: str) -> None:
    assert validate_ifname(name, "CNI_IFNAME") == name
    assert valid_ifname(name)


@pytest.mark.parametrize("name", ["", *HOSTILE_IFNAMES], ids=repr)
def test_invalid_ifnames(name: str) -> None:
    with pytest.raises(InvalidEnvironment) as info:
        validate_ifname(name, "CNI_IFNAME")
    assert info.value.code == 4
    assert "CNI_IFNAME" in info.value.msg
    assert not valid_ifname(name)


def test_parse_cni_args_kubernetes() -> None:
    assert parse_cni_args(K8S_ARGS) == {
        "IgnoreUnknown": "true",
        "K8S_POD_NAMESPACE": "team-a",
        "K8S_POD_NAME": "trainer-0",
        "K8S_POD_INFRA_CONTAINER_ID": "0123abcd",
        "K8S_POD_UID": "5f0c11ee-8a0b-4c6e-9d3f-0123456789ab",
    }


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("", {}),
        (";;", {}),
        ("FOO=bar", {"FOO": "bar"}),
        ("SOMETHING_NEW=1;K8S_POD_NAME=p;", {"SOMETHING_NEW": "1", "K8S_POD_NAME": "p"}),
        ("EMPTY=", {"EMPTY": ""}),
        ("EXPR=a=b", {"EXPR": "a=b"}),
        ("K=1;K=2", {"K": "2"}),
    ],
)
def test_parse_cni_args_tolerant(raw: str, expected: dict[str, str]) -> None:
    assert parse_cni_args(raw) == expected


@pytest.mark.parametrize("raw", ["IgnoreUnknown", "=value", "A=1;junk", "K8S_POD_NAME=p;;=x"])
def test_parse_cni_args_malformed(raw: str) -> None:
    with pytest.raises(InvalidEnvironment) as info:
        parse_cni_args(raw)
    assert info.value.code == 4
    assert "CNI_ARGS" in info.value.msg


# The pod CNI_ARGS names: Kubernetes' own rules, each at its boundary.
_UUID = "5f0c11ee-8a0b-4c6e-9d3f-0123456789ab"
_LABEL63 = "a" + "b" * 61 + "c"
_SUBDOMAIN253 = ".".join(["a" * 63] * 3 + ["b" * 61])


def _pod_args(namespace: str = "team-a", name: str = "trainer-0", uid: str = _UUID) -> str:
    return f"IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name};K8S_POD_UID={uid}"


@pytest.mark.parametrize(
    ("namespace", "name", "uid"),
    [
        (_LABEL63, "p", _UUID),  # a namespace of 63 characters, the most a label has
        ("a", "p", _UUID),
        ("0-9", "p", _UUID),  # digits may begin and end a label
        ("team-a", _SUBDOMAIN253, _UUID),  # a pod name of 253 characters
        ("team-a", "trainer.0.x-1", _UUID),  # dots in a pod name (a subdomain)
        ("team-a", "p", _UUID.upper()),
        ("team-a", "p", "0123456789abcdef0123456789abcdef"),  # a static pod's UID
        ("team-a", "p", ""),  # no UID: nothing to check
    ],
    ids=repr,
)
def test_parse_cni_args_accepts_what_kubernetes_names(namespace: str, name: str, uid: str) -> None:
    assert len(_SUBDOMAIN253) == 253
    args = parse_cni_args(_pod_args(namespace, name, uid))
    env = CniEnv("ADD", args=args)
    assert env.pod == PodRef(namespace, name, uid)


@pytest.mark.parametrize(
    ("namespace", "name", "uid", "key"),
    [
        (_LABEL63 + "d", "p", _UUID, "K8S_POD_NAMESPACE"),  # 64 characters
        ("Team-a", "p", _UUID, "K8S_POD_NAMESPACE"),  # upper case
        ("team.a", "p", _UUID, "K8S_POD_NAMESPACE"),  # a dot: a label, not a subdomain
        ("-team", "p", _UUID, "K8S_POD_NAMESPACE"),
        ("team-", "p", _UUID, "K8S_POD_NAMESPACE"),
        ("team_a", "p", _UUID, "K8S_POD_NAMESPACE"),
        ("..", "p", _UUID, "K8S_POD_NAMESPACE"),
        ("team-a", _SUBDOMAIN253 + "b", _UUID, "K8S_POD_NAME"),  # 254 characters
        ("team-a", "Trainer-0", _UUID, "K8S_POD_NAME"),  # upper case
        ("team-a", "../..", _UUID, "K8S_POD_NAME"),
        ("team-a", "a..b", _UUID, "K8S_POD_NAME"),  # an empty part between dots
        ("team-a", ".p", _UUID, "K8S_POD_NAME"),
        ("team-a", "p-", _UUID, "K8S_POD_NAME"),
        ("team-a", "p/q", _UUID, "K8S_POD_NAME"),
        ("team-a", "p\x1b[31m", _UUID, "K8S_POD_NAME"),
        ("team-a", "", _UUID, "K8S_POD_NAME"),  # a namespace but no pod
        ("team-a", "p", "u1", "K8S_POD_UID"),
        ("team-a", "p", _UUID + "0", "K8S_POD_UID"),
        ("team-a", "p", _UUID.replace("-", "_"), "K8S_POD_UID"),
        ("team-a", "p", "0123456789abcdef0123456789abcdeg", "K8S_POD_UID"),
        ("team-a", "p", "{" + _UUID + "}", "K8S_POD_UID"),
    ],
    ids=repr,
)
def test_parse_cni_args_refuses_names_kubernetes_would_not(
    namespace: str, name: str, uid: str, key: str
) -> None:
    with pytest.raises(InvalidEnvironment) as info:
        parse_cni_args(_pod_args(namespace, name, uid))
    assert info.value.code == 4
    assert key in info.value.msg and "CNI_ARGS" in info.value.msg
    assert "\x1b" not in info.value.msg  # a tenant's escape sequence never reaches a terminal


def test_parse_cni_args_quotes_a_long_name_bounded() -> None:
    name = "x" * 60_000
    with pytest.raises(InvalidEnvironment) as info:
        parse_cni_args(_pod_args(name=name + "_"))
    assert "(60001 characters)" in info.value.msg and len(info.value.msg) < 400
    with pytest.raises(InvalidEnvironment) as info:
        parse_cni_args(_pod_args(namespace="\x1b]2 pwned\x07" + "n" * 5000))
    assert "\\x1b" in info.value.msg and "\x1b" not in info.value.msg  # escaped, never raw
    assert len(info.value.msg) < 400


@pytest.mark.parametrize(
    "raw",
    [
        "IgnoreUnknown=1;K8S_POD_NAME=My_Container",  # podman: its container name, no namespace
        "K8S_POD_NAMESPACE=;K8S_POD_NAME=Anything_At_All",  # an empty namespace names no pod
        "K8S_POD_NAME=p",
    ],
)
def test_parse_cni_args_without_a_namespace_names_no_pod(raw: str) -> None:
    assert CniEnv("ADD", args=parse_cni_args(raw)).pod is None


# ---------------------------------------------------------------------------
# parse_env


def test_parse_env_full() -> None:
    env = parse_env(full_env("ADD", CNI_PATH="/opt/cni/bin:/usr/lib/cni::"))
    assert env.command == "ADD"
    assert env.container_id == "0a1b2c3d4e5f"
    assert env.netns == "/var/run/netns/cni-0a1b2c3d"
    assert env.ifname == "net1"
    assert env.path == ("/opt/cni/bin", "/usr/lib/cni")
    assert env.require_path() == env.path
    assert env.pod == PodRef("team-a", "trainer-0", "5f0c11ee-8a0b-4c6e-9d3f-0123456789ab")
    assert str(env.pod) == "team-a/trainer-0"
    assert env.environ["CNI_ARGS"] == K8S_ARGS


def test_parse_env_without_pod_or_path() -> None:
    env = parse_env({"CNI_COMMAND": "DEL", "CNI_CONTAINERID": "c1", "CNI_IFNAME": "net1"})
    assert env.pod is None
    assert env.netns == ""  # DEL may come without a netns
    with pytest.raises(InvalidEnvironment, match="CNI_PATH"):
        env.require_path()
    only_ns = parse_env({"CNI_COMMAND": "STATUS", "CNI_ARGS": "K8S_POD_NAMESPACE=ns"})
    assert only_ns.pod is None


@pytest.mark.parametrize("verb", VERBS)
def test_parse_env_minimal_per_verb(verb: str) -> None:
    environ = {"CNI_COMMAND": verb, **{var: full_env(verb)[var] for var in REQUIRED_ENV[verb]}}
    assert isinstance(parse_env(environ), CniEnv)


@pytest.mark.parametrize(
    ("verb", "var"), [(verb, var) for verb in VERBS for var in REQUIRED_ENV[verb]], ids=lambda x: str(x)
)
@pytest.mark.parametrize("how", ["missing", "empty"])
def test_parse_env_missing_variable(verb: str, var: str, how: str) -> None:
    environ = full_env(verb)
    if how == "missing":
        del environ[var]
    else:
        environ[var] = ""
    with pytest.raises(InvalidEnvironment) as info:
        parse_env(environ)
    assert info.value.code == 4
    assert var in info.value.msg and verb in info.value.msg


@pytest.mark.parametrize("command", [None, ""])
def test_parse_env_no_command(command: str | None) -> None:
    environ = {} if command is None else {"CNI_COMMAND": command}
    with pytest.raises(InvalidEnvironment) as info:
        parse_env(environ)
    assert "CNI_COMMAND" in info.value.msg
    assert all(verb in info.value.msg for verb in VERBS)


@pytest.mark.parametrize("command", ["FOO", "add", "ADD ", "VERSIONS", "DELETE", "status"])
def test_parse_env_unknown_verb(command: str) -> None:
    with pytest.raises(InvalidEnvironment) as info:
        parse_env(full_env(command))
    assert info.value.code == 4
    assert "CNI_COMMAND" in info.value.msg and repr(command) in info.value.msg
    assert all(verb in info.value.msg for verb in VERBS)


@pytest.mark.parametrize("netns", ["relative/path", "netns", "../../proc/1/ns/net"])
def test_parse_env_relative_netns(netns: str) -> None:
    with pytest.raises(InvalidEnvironment, match="CNI_NETNS"):
        parse_env(full_env("ADD", CNI_NETNS=netns))


@pytest.mark.parametrize("container_id", ["a", "0a1b2c3d" * 8, "x" * 200, "pod_1.abc-def", "ABC123"])
def test_parse_env_valid_container_ids(container_id: str) -> None:
    assert parse_env(full_env("DEL", CNI_CONTAINERID=container_id)).container_id == container_id


@pytest.mark.parametrize("container_id", HOSTILE_CONTAINER_IDS, ids=repr)
@pytest.mark.parametrize("verb", ATTACHMENT_VERBS)
def test_parse_env_hostile_container_id(verb: str, container_id: str) -> None:
    with pytest.raises(InvalidEnvironment) as info:
        parse_env(full_env(verb, CNI_CONTAINERID=container_id))
    assert "CNI_CONTAINERID" in info.value.msg


@pytest.mark.parametrize("ifname", HOSTILE_IFNAMES, ids=repr)
@pytest.mark.parametrize("verb", ATTACHMENT_VERBS)
def test_parse_env_hostile_ifname(verb: str, ifname: str) -> None:
    with pytest.raises(InvalidEnvironment) as info:
        parse_env(full_env(verb, CNI_IFNAME=ifname))
    assert "CNI_IFNAME" in info.value.msg


@pytest.mark.parametrize("args", ["K8S_POD_NAME", "=x", "A=1;broken"])
def test_parse_env_malformed_cni_args(args: str) -> None:
    with pytest.raises(InvalidEnvironment, match="CNI_ARGS"):
        parse_env(full_env("ADD", CNI_ARGS=args))


# Values no verb could use: each must be ignored by the verbs that do not read it.
_UNUSABLE = {
    "CNI_CONTAINERID": "../x",
    "CNI_NETNS": "dummy",
    "CNI_IFNAME": "../../etc/x",
    "CNI_ARGS": "junk",
    "CNI_PATH": "dummy",
}


@pytest.mark.parametrize("verb", VERBS)
def test_parse_env_validates_only_what_the_verb_reads(verb: str) -> None:
    """Each variable a verb reads is validated; the others are neither checked nor exposed."""
    fields = {
        "CNI_CONTAINERID": "container_id",
        "CNI_NETNS": "netns",
        "CNI_IFNAME": "ifname",
        "CNI_ARGS": "args",
        "CNI_PATH": "path",
    }
    for var, bad in _UNUSABLE.items():
        environ = full_env(verb, **{var: bad})
        if var in USED_ENV[verb] and var != "CNI_PATH":  # any CNI_PATH is a list of directories
            with pytest.raises(InvalidEnvironment, match=var):
                parse_env(environ)
        else:
            env = parse_env(environ)
            assert env.environ[var] == bad  # still handed on to IPAM as it came
            if var not in USED_ENV[verb]:
                assert not getattr(env, fields[var]), (var, env)
    ignored = {k: v for k, v in _UNUSABLE.items() if k not in USED_ENV[verb]}
    env = parse_env({"CNI_COMMAND": verb, **full_env(verb), **ignored})
    assert env.command == verb


# ---------------------------------------------------------------------------
# Results


def rich_result() -> Result:
    return Result(
        interfaces=[
            Interface(
                name="net1",
                mac="02:00:00:00:00:01",
                sandbox="/var/run/netns/x",
                mtu=9000,
                pci_id="0000:3b:02.1",
            ),
            Interface(name="net1-1", mac="02:00:00:00:00:02", sandbox="/var/run/netns/x", mtu=1500),
            Interface(name="host0"),
        ],
        ips=[
            IPConfig(address="10.1.0.5/24", gateway="10.1.0.1", interface=0),
            IPConfig(address="fd00::5/64", gateway="fd00::1", interface=1),
            IPConfig(address="192.168.7.9/32"),
        ],
        routes=[
            Route(dst="0.0.0.0/0", gw="10.1.0.1"),
            Route(dst="10.2.0.0/16", gw="10.1.0.254", mtu=8000, advmss=1400, priority=10, table=100, scope=0),
            Route(dst="::/0"),
        ],
        dns={"nameservers": ["10.1.0.2"], "domain": "example.org", "search": ["example.org"]},
    )


LEGACY_INTERFACES = [
    {"name": "net1", "mac": "02:00:00:00:00:01", "sandbox": "/var/run/netns/x"},
    {"name": "net1-1", "mac": "02:00:00:00:00:02", "sandbox": "/var/run/netns/x"},
    {"name": "host0"},
]
DNS = {"nameservers": ["10.1.0.2"], "domain": "example.org", "search": ["example.org"]}


def expected_result(version: str) -> dict[str, Any]:
    """The result document for ``version``, written out by hand."""
    if version in ("0.3.0", "0.3.1", "0.4.0"):
        return {
            "cniVersion": version,
            "interfaces": LEGACY_INTERFACES,
            "ips": [
                {"version": "4", "address": "10.1.0.5/24", "gateway": "10.1.0.1", "interface": 0},
                {"version": "6", "address": "fd00::5/64", "gateway": "fd00::1", "interface": 1},
                {"version": "4", "address": "192.168.7.9/32"},
            ],
            "routes": [
                {"dst": "0.0.0.0/0", "gw": "10.1.0.1"},
                {"dst": "10.2.0.0/16", "gw": "10.1.0.254"},
                {"dst": "::/0"},
            ],
            "dns": DNS,
        }
    if version == "1.0.0":
        doc = expected_result("0.4.0")
        doc["cniVersion"] = "1.0.0"
        for ip in doc["ips"]:
            del ip["version"]
        return doc
    assert version == "1.1.0"
    return {
        "cniVersion": "1.1.0",
        "interfaces": [
            {
                "name": "net1",
                "mac": "02:00:00:00:00:01",
                "sandbox": "/var/run/netns/x",
                "mtu": 9000,
                "pciID": "0000:3b:02.1",
            },
            {"name": "net1-1", "mac": "02:00:00:00:00:02", "sandbox": "/var/run/netns/x", "mtu": 1500},
            {"name": "host0"},
        ],
        "ips": [
            {"address": "10.1.0.5/24", "gateway": "10.1.0.1", "interface": 0},
            {"address": "fd00::5/64", "gateway": "fd00::1", "interface": 1},
            {"address": "192.168.7.9/32"},
        ],
        "routes": [
            {"dst": "0.0.0.0/0", "gw": "10.1.0.1"},
            {
                "dst": "10.2.0.0/16",
                "gw": "10.1.0.254",
                "mtu": 8000,
                "advmss": 1400,
                "priority": 10,
                "table": 100,
                "scope": 0,
            },
            {"dst": "::/0"},
        ],
        "dns": DNS,
    }


@pytest.mark.parametrize("version", EXPECTED_VERSIONS)
def test_result_to_dict(version: str) -> None:
    doc = rich_result().to_dict(version)
    assert doc == expected_result(version)
    assert json.loads(json.dumps(doc)) == doc


@pytest.mark.parametrize("version", EXPECTED_VERSIONS)
def test_result_shape_rules(version: str) -> None:
    doc = rich_result().to_dict(version)
    legacy = version_tuple(version) < (1, 0, 0)
    modern = version == "1.1.0"
    assert all(("version" in ip) == legacy for ip in doc["ips"])
    assert ("mtu" in doc["interfaces"][0]) == modern
    assert ("pciID" in doc["interfaces"][0]) == modern
    assert ("table" in doc["routes"][1]) == modern


@pytest.mark.parametrize("version", EXPECTED_VERSIONS)
def test_result_empty(version: str) -> None:
    assert Result().to_dict(version) == {"cniVersion": version, "interfaces": [], "ips": [], "dns": {}}


def _without_modern_fields(result: Result) -> Result:
    return Result(
        interfaces=[dataclasses.replace(i, mtu=None, pci_id="") for i in result.interfaces],
        ips=list(result.ips),
        routes=[Route(dst=r.dst, gw=r.gw) for r in result.routes],
        dns=dict(result.dns),
    )


@pytest.mark.parametrize("version", EXPECTED_VERSIONS)
def test_result_round_trip(version: str) -> None:
    original = rich_result()
    doc = original.to_dict(version)
    back = Result.from_dict(json.loads(json.dumps(doc)))
    expected = original if version == "1.1.0" else _without_modern_fields(original)
    assert back == expected
    assert back.to_dict(version) == doc


@pytest.mark.parametrize("source", EXPECTED_VERSIONS)
@pytest.mark.parametrize("target", EXPECTED_VERSIONS)
def test_result_converts_between_versions(source: str, target: str) -> None:
    """A prevResult or IPAM answer of one version re-serializes in the config's version."""
    back = Result.from_dict(rich_result().to_dict(source))
    doc = back.to_dict(target)
    assert doc["cniVersion"] == target
    if version_tuple(source) >= (1, 1, 0) or version_tuple(target) < (1, 1, 0):
        assert doc == expected_result(target)


def test_result_from_ipam_answer() -> None:
    """IPAM answers carry no interfaces; old ones carry ips[].version."""
    doc = {
        "cniVersion": "0.4.0",
        "ips": [{"version": "4", "address": "10.0.0.2/24", "gateway": "10.0.0.1"}],
        "routes": [{"dst": "0.0.0.0/0"}],
    }
    result = Result.from_dict(doc)
    assert result.interfaces == []
    assert result.ips == [IPConfig(address="10.0.0.2/24", gateway="10.0.0.1")]
    assert result.ips[0].family == "4"
    assert result.routes == [Route(dst="0.0.0.0/0")]
    assert result.dns == {}


@pytest.mark.parametrize(
    "doc",
    [
        [],
        "result",
        None,
        {"interfaces": [{"mac": "02:00:00:00:00:01"}]},
        {"interfaces": [1]},
        {"interfaces": "net1"},
        {"ips": [{"gateway": "10.0.0.1"}]},
        {"ips": [None]},
        {"routes": [{"gw": "10.0.0.1"}]},
        {"routes": ["0.0.0.0/0"]},
        {"dns": ["10.0.0.2"]},
    ],
    ids=repr,
)
def test_result_from_dict_malformed(doc: Any) -> None:
    with pytest.raises(DecodeFailure) as info:
        Result.from_dict(doc)
    assert info.value.code == 6


def test_version_document() -> None:
    assert version_document("0.4.0") == {"cniVersion": "0.4.0", "supportedVersions": list(EXPECTED_VERSIONS)}


# ---------------------------------------------------------------------------
# Error documents


def test_error_document_shape() -> None:
    assert CniError("boom").to_dict("1.0.0") == {
        "cniVersion": "1.0.0",
        "code": 999,
        "msg": "boom",
        "details": "",
    }
    assert InternalError("x", "trace").to_dict("0.4.0") == {
        "cniVersion": "0.4.0",
        "code": 199,
        "msg": "x",
        "details": "trace",
    }


# ---------------------------------------------------------------------------
# run_cni: every verb x every version


@pytest.mark.parametrize("version", [*EXPECTED_VERSIONS, "0.1.0", "0.2.0", "9.9.9"])
def test_version_verb(node: Node, version: str) -> None:
    answer = invoke({"CNI_COMMAND": "VERSION"}, {"cniVersion": version})
    assert answer == (0, {"cniVersion": version, "supportedVersions": list(EXPECTED_VERSIONS)})
    assert node.stray_files() == []


@pytest.mark.parametrize("stdin", [b"", b"\n", b"  \t\n"])
def test_version_verb_empty_stdin(node: Node, stdin: bytes) -> None:
    assert invoke({"CNI_COMMAND": "VERSION"}, stdin) == (
        0,
        {"cniVersion": LATEST_VERSION, "supportedVersions": list(EXPECTED_VERSIONS)},
    )


def test_version_verb_ignores_other_variables(node: Node) -> None:
    """VERSION needs nothing but CNI_COMMAND, and a full config is fine too."""
    code, doc = invoke(full_env("VERSION", node), node.conf("0.3.1"))
    assert code == 0 and doc == version_document("0.3.1")


@pytest.mark.parametrize("stdin", [b"not json", b"[1]"])
def test_version_verb_bad_stdin(node: Node, stdin: bytes) -> None:
    assert_error(invoke({"CNI_COMMAND": "VERSION"}, stdin), 6)


@pytest.mark.parametrize("version", UNSUPPORTED_VERSIONS, ids=repr)
@pytest.mark.parametrize("verb", CONF_VERBS)
def test_unsupported_version_is_code_1(node: Node, verb: str, version: Any) -> None:
    doc = assert_error(invoke(full_env(verb, node), node.conf(version)), 1, *EXPECTED_VERSIONS)
    assert "version" in doc["msg"]
    assert node.stray_files() == []


@pytest.mark.parametrize("verb", CONF_VERBS)
def test_missing_version_is_code_1(node: Node, verb: str) -> None:
    assert_error(invoke(full_env(verb, node), node.conf(_MISSING)), 1, *EXPECTED_VERSIONS)


@pytest.mark.parametrize(
    ("verb", "version"),
    [(v, ver) for v in CONF_VERBS for ver in EXPECTED_VERSIONS if not _allowed(v, ver)],
)
def test_too_old_version_is_code_1(node: Node, verb: str, version: str) -> None:
    assert_error(invoke(full_env(verb, node), node.conf(version)), 1, verb, MIN_VERSION_FOR_VERB[verb])
    assert node.stray_files() == []


@pytest.mark.parametrize(
    ("verb", "var", "version"),
    [
        (verb, var, version)
        for verb in CONF_VERBS
        for var in REQUIRED_ENV[verb]
        for version in EXPECTED_VERSIONS
        if _allowed(verb, version)
    ],
)
def test_missing_required_variable_is_code_4(node: Node, verb: str, var: str, version: str) -> None:
    assert_error(invoke(full_env(verb, node, **{var: ""}), node.conf(version)), 4, var)
    assert node.stray_files() == []


def test_missing_command_is_code_4(node: Node) -> None:
    environ = full_env("ADD", node)
    del environ["CNI_COMMAND"]
    assert_error(invoke(environ, node.conf()), 4, "CNI_COMMAND", *VERBS)


@pytest.mark.parametrize("command", ["FOO", "add", "DELETE"])
def test_unknown_verb_is_code_4(node: Node, command: str) -> None:
    assert_error(invoke(full_env(command, node), node.conf()), 4, "CNI_COMMAND", command, *VERBS)


@pytest.mark.parametrize("verb", CONF_VERBS)
@pytest.mark.parametrize(
    "stdin", [b"", b"not json", b"\xff", b"{", b"[]", b"null", b"42", b'"conf"'], ids=repr
)
def test_bad_stdin_is_code_6(node: Node, verb: str, stdin: bytes) -> None:
    assert_error(invoke(full_env(verb, node), stdin), 6, "decode")
    assert node.stray_files() == []


@pytest.mark.parametrize("verb", ["ADD", "DEL", "CHECK"])
@pytest.mark.parametrize("ifname", ["", *HOSTILE_IFNAMES], ids=repr)
def test_hostile_ifname_never_reaches_a_path(node: Node, verb: str, ifname: str) -> None:
    assert_error(invoke(full_env(verb, node, CNI_IFNAME=ifname), node.conf()), 4, "CNI_IFNAME")
    assert node.stray_files() == []


@pytest.mark.parametrize("verb", ["ADD", "DEL", "CHECK"])
@pytest.mark.parametrize("container_id", ["", *HOSTILE_CONTAINER_IDS], ids=repr)
def test_hostile_container_id_never_reaches_a_path(node: Node, verb: str, container_id: str) -> None:
    answer = invoke(full_env(verb, node, CNI_CONTAINERID=container_id), node.conf())
    assert_error(answer, 4, "CNI_CONTAINERID")
    assert node.stray_files() == []


def test_hostile_values_ignored_by_verbs_that_do_not_read_them(node: Node) -> None:
    """STATUS and GC read no container ID, interface or netns: leftovers cannot fail them."""
    leftovers = {"CNI_IFNAME": "../../etc/x", "CNI_CONTAINERID": "../x", "CNI_NETNS": "dummy"}
    assert_error(invoke(full_env("STATUS", node, **leftovers), node.conf()), 50, "no SR-IOV PF")
    assert invoke(full_env("GC", node, **leftovers), node.conf()) == (0, None)
    # Only the state and lock directories were made: nothing named after a leftover.
    made = [f for f in node.stray_files() if f not in ("a", "a/b")]
    assert made and all(f.startswith(("a/b/state", "a/b/lock")) for f in made), made


def test_version_answers_libcnis_probe(node: Node) -> None:
    """libcni's exact GetVersionInfo probe (podman, CRI-O) gets the version document."""
    answer = invoke(LIBCNI_VERSION_PROBE, {"cniVersion": "1.0.0"})
    assert answer == (0, version_document("1.0.0"))
    assert node.stray_files() == []


@pytest.mark.parametrize("verb", CONF_VERBS)
def test_version_needs_no_variable_any_verb_reads(node: Node, verb: str) -> None:
    """VERSION ignores every value another verb would refuse."""
    environ = {"CNI_COMMAND": "VERSION", **_UNUSABLE}
    assert invoke(environ, node.conf("0.4.0")) == (0, version_document("0.4.0"))


@pytest.mark.parametrize("args", ["K8S_POD_NAME", "=x", "IgnoreUnknown=true;junk"])
def test_malformed_cni_args_is_code_4_for_add(node: Node, args: str) -> None:
    assert_error(invoke(full_env("ADD", node, CNI_ARGS=args), node.conf()), 4, "CNI_ARGS")


_BAD_POD = "IgnoreUnknown=true;K8S_POD_NAMESPACE=Team.A;K8S_POD_NAME=../..;K8S_POD_UID=u1"


def test_pod_kubernetes_could_not_name_is_code_4_for_add(node: Node) -> None:
    assert_error(invoke(full_env("ADD", node, CNI_ARGS=_BAD_POD), node.conf()), 4, "K8S_POD_NAMESPACE")


@pytest.mark.parametrize("args", ["IgnoreUnknown=true;junk", _BAD_POD])
@pytest.mark.parametrize("verb", ["DEL", "CHECK"])
def test_malformed_cni_args_ignored_by_verbs_that_do_not_read_it(node: Node, verb: str, args: str) -> None:
    """DEL must release whatever CNI_ARGS holds; CHECK has no use for it either."""
    environ = full_env(verb, node, CNI_ARGS=args)
    if verb == "DEL":
        assert invoke(environ, node.conf()) == (0, None)
    else:
        assert_error(invoke(environ, node.conf(prevResult={"cniVersion": "1.1.0"})), 106)


@pytest.mark.parametrize("version", ["0.3.1", "0.4.0", "1.0.0"])
@pytest.mark.parametrize(
    "environ",
    [
        {"CNI_COMMAND": "ADD"},  # the required variables missing
        {"CNI_COMMAND": "DEL", "CNI_CONTAINERID": "../x", "CNI_IFNAME": "net1"},
        {"CNI_COMMAND": "BOGUS"},
        {},
    ],
    ids=["missing", "invalid", "unknown-verb", "no-command"],
)
def test_environment_error_answers_in_the_config_version(
    node: Node, environ: dict[str, str], version: str
) -> None:
    doc = assert_error(invoke(environ, node.conf(version)), 4)
    assert doc["cniVersion"] == version


@pytest.mark.parametrize("version", EXPECTED_VERSIONS)
def test_del_without_record_succeeds_twice(node: Node, version: str) -> None:
    environ = full_env("DEL", node)
    for _ in range(2):
        assert invoke(environ, node.conf(version)) == (0, None)
    assert not any(name.endswith(".json") for name in node.files())


@pytest.mark.parametrize("version", EXPECTED_VERSIONS)
def test_del_without_netns_or_args(node: Node, version: str) -> None:
    environ = full_env("DEL", node, CNI_NETNS="", CNI_ARGS="", CNI_PATH="")
    assert invoke(environ, node.conf(version)) == (0, None)


def test_del_with_unknown_cni_args_keys(node: Node) -> None:
    environ = full_env("DEL", node, CNI_ARGS=K8S_ARGS + ";SOMETHING_ELSE=1;MAC=02:00:00:00:00:09")
    assert invoke(environ, node.conf()) == (0, None)


def test_status_without_pfs_is_code_50(node: Node) -> None:
    doc = assert_error(invoke(full_env("STATUS", node), node.conf("1.1.0")), 50, "no SR-IOV PF")
    assert doc["cniVersion"] == "1.1.0"


def test_status_with_configured_pfs_names_them(node: Node) -> None:
    conf = node.conf("1.1.0", pfs=["ens1f0", "ens1f1"])
    assert_error(invoke({"CNI_COMMAND": "STATUS"}, conf), 50, "ens1f0", "ens1f1")


def test_gc_without_records_succeeds(node: Node) -> None:
    conf = node.conf("1.1.0", **{"cni.dev/valid-attachments": [{"containerID": "c1", "ifname": "net1"}]})
    assert invoke(full_env("GC", node), conf) == (0, None)
    assert invoke({"CNI_COMMAND": "GC", "CNI_PATH": "/opt/cni/bin"}, node.conf("1.1.0")) == (0, None)


def test_gc_with_malformed_attachments_is_code_7(node: Node) -> None:
    conf = node.conf("1.1.0", **{"cni.dev/valid-attachments": [{"containerID": 1}]})
    assert_error(invoke(full_env("GC", node), conf), 7, "cni.dev/valid-attachments")


@pytest.mark.parametrize("verb", CONF_VERBS)
def test_config_errors_reach_every_verb(node: Node, verb: str) -> None:
    assert_error(invoke(full_env(verb, node), node.conf(rdmaIsolation="sometimes")), 7, "rdmaIsolation")
    assert_error(invoke(full_env(verb, node), node.conf(statedir="/tmp/x")), 2, "statedir", "stateDir")
    assert node.stray_files() == []


_VERB_MODULES = {"ADD": "add", "DEL": "delete", "CHECK": "check", "STATUS": "status", "GC": "gc"}


@pytest.mark.parametrize("verb", CONF_VERBS)
def test_unexpected_exception_is_code_199(node: Node, verb: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    module = importlib.import_module(f"rdma_cni.verbs.{_VERB_MODULES[verb]}")

    def explode(*args: Any, **kwargs: Any) -> None:
        raise ZeroDivisionError("the flux capacitor is empty")

    monkeypatch.setattr(module, "run", explode)
    doc = assert_error(
        invoke(full_env(verb, node), node.conf("1.1.0")),
        199,
        "ZeroDivisionError",
        "the flux capacitor is empty",
    )
    assert "ZeroDivisionError: the flux capacitor is empty" in doc["details"]
    assert doc["cniVersion"] == "1.1.0"


def test_error_document_uses_the_config_version(node: Node) -> None:
    doc = assert_error(invoke(full_env("DEL", node), node.conf("0.4.0", mtu=1)), 7, "mtu")
    assert doc["cniVersion"] == "0.4.0"


# ---------------------------------------------------------------------------
# The process: stdout carries exactly one JSON document, diagnostics go to stderr


def _process_env(node: Node, **cni: str) -> dict[str, str]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": str(ROOT),
        "RDMA_CNI_SYSFS_ROOT": str(node.sysfs),
    }
    env.update({k: v for k, v in cni.items() if v != ""})
    return env


def run_module(
    node: Node, stdin: bytes, args: tuple[str, ...] = (), **cni: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rdma_cni", *args],
        input=stdin.decode("utf-8", "surrogateescape"),
        capture_output=True,
        text=True,
        env=_process_env(node, **cni),
        cwd=ROOT,
        timeout=60,
        check=False,
    )


def test_process_version(node: Node) -> None:
    proc = run_module(node, b'{"cniVersion": "1.0.0"}', CNI_COMMAND="VERSION")
    assert proc.returncode == 0, proc.stderr
    assert single_json(proc.stdout) == version_document("1.0.0")
    assert proc.stderr == ""


@pytest.mark.parametrize(
    ("cni", "stdin", "code", "diagnostic"),
    [
        ({}, b"{}", 4, "CNI_COMMAND is not set"),
        ({"CNI_COMMAND": "BOGUS"}, b"{}", 4, "not a CNI verb"),
        ({"CNI_COMMAND": "ADD", "CNI_NETNS": "/x", "CNI_IFNAME": "net1"}, b"{}", 4, "CNI_CONTAINERID"),
        ({"CNI_COMMAND": "DEL", "CNI_CONTAINERID": "c", "CNI_IFNAME": "net1"}, b"not json", 6, "decode"),
        (
            {"CNI_COMMAND": "DEL", "CNI_CONTAINERID": "c", "CNI_IFNAME": "net1"},
            b'{"cniVersion": "0.2.0"}',
            1,
            "0.2.0",
        ),
    ],
    ids=["no-command", "unknown-verb", "missing-var", "not-json", "old-version"],
)
def test_process_errors(node: Node, cni: dict[str, str], stdin: bytes, code: int, diagnostic: str) -> None:
    proc = run_module(node, stdin, **cni)
    assert proc.returncode != 0
    doc = single_json(proc.stdout)
    assert set(doc) == ERROR_KEYS and doc["code"] == code
    assert diagnostic in proc.stderr


def test_process_config_error(node: Node) -> None:
    conf = json.dumps(node.conf(vlan=5000)).encode()
    proc = run_module(node, conf, CNI_COMMAND="DEL", CNI_CONTAINERID="c1", CNI_IFNAME="net1")
    assert proc.returncode != 0
    assert single_json(proc.stdout)["code"] == 7
    assert "vlan" in proc.stderr


def test_process_del_prints_nothing(node: Node) -> None:
    conf = json.dumps(node.conf("0.4.0", foo="bar")).encode()
    proc = run_module(node, conf, CNI_COMMAND="DEL", CNI_CONTAINERID="c1", CNI_IFNAME="net1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""


def test_process_status_failure(node: Node) -> None:
    conf = json.dumps(node.conf("1.1.0")).encode()
    proc = run_module(node, conf, CNI_COMMAND="STATUS")
    assert proc.returncode != 0
    assert single_json(proc.stdout)["code"] == 50
    assert "no SR-IOV PF" in proc.stderr


def test_process_unexpected_exception_and_stray_output(node: Node) -> None:
    """A bug in a verb still yields one JSON error on stdout; prints and tracebacks go to stderr."""
    snippet = textwrap.dedent(
        """
        import sys
        import rdma_cni.verbs.delete as delete

        def run(env, conf, doc):
            print("stray print from a verb")
            sys.stdout.write("stray write\\n")
            raise KeyError("no such thing")

        delete.run = run
        from rdma_cni.cli.main import main
        sys.exit(main())
        """
    )
    env = _process_env(node, CNI_COMMAND="DEL", CNI_CONTAINERID="c1", CNI_IFNAME="net1")
    proc = subprocess.run(
        [sys.executable, "-c", snippet],
        input=json.dumps(node.conf()),
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0
    doc = single_json(proc.stdout)
    assert doc["code"] == 199 and "KeyError" in doc["details"] and "no such thing" in doc["details"]
    assert "Traceback" in proc.stderr
    assert "stray print from a verb" in proc.stderr and "stray write" in proc.stderr


def test_process_closed_stdin(node: Node) -> None:
    """With fd 0 closed, VERSION still answers and a config verb reports code 6."""
    for cni, expected in (({"CNI_COMMAND": "VERSION"}, None), ({"CNI_COMMAND": "STATUS"}, 6)):
        proc = subprocess.run(
            ["/bin/sh", "-c", 'exec "$0" -m rdma_cni <&-', sys.executable],
            capture_output=True,
            text=True,
            env=_process_env(node, **cni),
            cwd=ROOT,
            timeout=60,
            check=False,
        )
        doc = single_json(proc.stdout)
        if expected is None:
            assert proc.returncode == 0 and doc == version_document(LATEST_VERSION)
        else:
            assert proc.returncode != 0 and doc["code"] == expected


def test_process_version_flag(node: Node) -> None:
    proc = run_module(node, b"", ("--version",))
    assert proc.returncode == 0
    assert proc.stdout == f"rdma-cni {__version__}\n"


# ---------------------------------------------------------------------------
# Start-up hygiene: cheap paths import nothing heavy

HEAVY = ("pydantic", "pyroute2", "requests", "filelock")

_IMPORT_PROBE = textwrap.dedent(
    """
    import json, sys
    from rdma_cni.cli.main import run_cni
    code, doc = run_cni(json.loads(sys.argv[1]), sys.argv[2].encode())
    print(json.dumps({"code": code, "doc": doc, "modules": sorted(sys.modules)}))
    """
)


def _probe_imports(node: Node, environ: dict[str, str], stdin: str) -> dict:
    """Run one verb in a fresh interpreter; its exit code, document and every module it imported."""
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE, json.dumps(environ), stdin],
        capture_output=True,
        text=True,
        env=_process_env(node),
        cwd=ROOT,
        timeout=60,
        check=True,
    )
    return json.loads(proc.stdout)


@pytest.mark.parametrize(
    ("environ", "stdin", "code"),
    [
        ({"CNI_COMMAND": "VERSION"}, '{"cniVersion": "1.0.0"}', 0),
        ({"CNI_COMMAND": "VERSION"}, "", 0),
        ({}, '{"cniVersion": "1.0.0", "name": "n"}', 4),
        ({"CNI_COMMAND": "NOPE"}, "{}", 4),
        ({"CNI_COMMAND": "ADD"}, '{"cniVersion": "1.0.0", "name": "n"}', 4),
        ({"CNI_COMMAND": "STATUS"}, "not json", 6),
        ({"CNI_COMMAND": "STATUS"}, '{"cniVersion": "0.2.0", "name": "n"}', 1),
    ],
    ids=["version", "version-empty", "no-command", "unknown-verb", "missing-vars", "not-json", "bad-version"],
)
def test_cheap_paths_import_nothing_heavy(node: Node, environ: dict[str, str], stdin: str, code: int) -> None:
    out = _probe_imports(node, environ, stdin)
    if code:
        assert out["code"] != 0 and out["doc"]["code"] == code, out["doc"]
    else:
        assert out["code"] == 0 and out["doc"]["cniVersion"], out["doc"]
    heavy = sorted(m for m in out["modules"] if m.split(".")[0] in HEAVY)
    assert heavy == []


@pytest.mark.parametrize(
    ("cni", "stdin"),
    [({"CNI_COMMAND": "VERSION"}, b'{"cniVersion": "0.4.0"}'), ({}, b"{}")],
    ids=["version", "no-command"],
)
def test_entry_point_imports_nothing_heavy(node: Node, cni: dict[str, str], stdin: bytes) -> None:
    """The same through ``python -m rdma_cni`` itself, watched with -X importtime."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "rdma_cni"],
        input=stdin,
        capture_output=True,
        env=_process_env(node, **cni),
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    single_json(proc.stdout.decode())
    imported = {
        line.rsplit("|", 1)[-1].strip()
        for line in proc.stderr.decode().splitlines()
        if line.startswith("import time:")
    }
    assert "rdma_cni.cli.main" in imported  # the probe does see our imports
    assert sorted(m for m in imported if m.split(".")[0] in HEAVY) == []


def test_heavy_modules_are_really_used_by_config_verbs(node: Node) -> None:
    """Guard against a vacuous hygiene test: DEL does import pydantic, the records and the lock."""
    environ = {"CNI_COMMAND": "DEL", "CNI_CONTAINERID": "c1", "CNI_IFNAME": "net1"}
    out = _probe_imports(node, environ, json.dumps(node.conf()))
    assert out["code"] == 0, out["doc"]
    assert {"pydantic", "rdma_cni.node.record"} <= set(out["modules"])


@pytest.mark.parametrize(
    ("argv", "collecting"),
    [([], False), (["warm-server"], True), (["scheduler-extender"], True), (["inventory"], True)],
    ids=["cni-verb", "warm-server", "extender", "inventory"],
)
def test_entry_point_stops_the_cycle_collector_only_for_cni_verbs(argv: list[str], collecting: bool) -> None:
    """A CNI verb is one short process that `_exit`s; subcommands that live long keep collecting cycles."""
    code = f"import gc, sys; sys.argv = ['rdma-cni', *{argv!r}]; import rdma_cni.__main__; "
    code += "print(gc.isenabled())"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60, check=True
    )
    assert proc.stdout.strip() == str(collecting)
