"""rdma_cni.kube.podget, .credentials and .tls against a real HTTPS API server stand-in (no mocked HTTP)."""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
import socket
import ssl
import stat
import subprocess
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rdma_cni import __version__
from rdma_cni.cni.errors import CniError, InvalidConfig, KubernetesError, TryAgainLater
from rdma_cni.kube import credentials, podget, tls

# tests/ is not a package on sys.path when pytest runs from the venv's script.
_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from tests.support.apiserver import ApiServer, make_ca  # noqa: E402

ANNOTATION = "rdma-cni.example.com/request"

# Small budgets keep the failure tests fast.
FAST = {"timeout": (2.0, 2.0), "retries": 2, "backoff": 0.01}


@pytest.fixture(scope="module")
def api() -> Iterator[ApiServer]:
    with ApiServer() as server:
        server.add_pod("default", "web-0", {ANNOTATION: '{"vfs": 1}'}, uid="1111-2222")
        server.add_pod("team-a", "db-0.shard-1", {ANNOTATION: "x"})
        server.add_pod("default", "plain", None)
        yield server


@pytest.fixture(autouse=True)
def _clean_server(api: ApiServer) -> Iterator[None]:
    api.reset()
    yield
    api.reset()


@pytest.fixture
def token_creds(api: ApiServer, tmp_path: Path) -> credentials.ClusterCredentials:
    return credentials.load_credentials(api.write_kubeconfig(tmp_path / "kubeconfig", mode="token"))


def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _full_text(exc: BaseException) -> str:
    """Everything an operator could ever see of an exception, chained causes included."""
    parts = ["".join(traceback.format_exception(exc)), repr(exc)]
    if isinstance(exc, CniError):
        parts += [exc.msg, exc.details, json.dumps(exc.to_dict("1.1.0"))]
    return "\n".join(parts)


# --------------------------------------------------------------------------
# Credential styles, end to end


@pytest.mark.parametrize(
    ("mode", "ca"),
    [
        ("token", "file"),
        ("token", "data"),
        ("token-file", "file"),
        ("token-file", "data"),
        ("client-cert-files", "file"),
        ("client-cert-files", "data"),
        ("client-cert-data", "file"),
        ("client-cert-data", "data"),
        ("insecure", "file"),
    ],
)
def test_kubeconfig_credential_styles(api: ApiServer, tmp_path: Path, mode: str, ca: str) -> None:
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig", mode=mode, ca=ca)
    creds = credentials.load_credentials(kubeconfig)
    pod = podget.get_pod(creds, "default", "web-0")

    assert pod["kind"] == "Pod"
    assert pod["metadata"]["uid"] == "1111-2222"
    assert podget.pod_annotation(pod, ANNOTATION) == '{"vfs": 1}'
    seen = api.requests_seen
    assert len(seen) == 1
    assert seen[0].path == "/api/v1/namespaces/default/pods/web-0"
    assert seen[0].accept == "application/json"
    assert seen[0].user_agent == f"rdma-cni/{__version__}"
    if mode.startswith("client-cert"):
        assert seen[0].client_cert_cn == "rdma-cni-test-client"
        assert seen[0].authorization is None
    else:
        assert seen[0].authorization == f"Bearer {api.token}"
        assert seen[0].client_cert_cn is None


def test_relative_paths_resolve_against_kubeconfig_dir(
    api: ApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Written next to the certificates, so the kubeconfig names them relatively.
    kubeconfig = api.write_kubeconfig(Path(api.directory) / "relative.kubeconfig", mode="client-cert-files")
    doc = json.loads(Path(kubeconfig).read_text())
    assert doc["clusters"][0]["cluster"]["certificate-authority"] == "ca.crt"
    assert doc["users"][0]["user"]["client-key"] == "client.key"
    monkeypatch.chdir(tmp_path)

    creds = credentials.load_credentials(kubeconfig)

    assert creds.ca_file == os.path.join(api.directory, "ca.crt")
    assert podget.get_pod(creds, "default", "web-0")["metadata"]["name"] == "web-0"


def test_token_file_is_read_relative_and_stripped(
    api: ApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kubeconfig = api.write_kubeconfig(tmp_path / "kc", mode="token-file")
    assert json.loads(Path(kubeconfig).read_text())["users"][0]["user"]["tokenFile"] == "kc.token"
    monkeypatch.chdir("/")

    assert credentials.load_credentials(kubeconfig).token == api.token


def test_token_file_wins_over_token_and_token_is_the_fallback(api: ApiServer, tmp_path: Path) -> None:
    kubeconfig = Path(api.write_kubeconfig(tmp_path / "kc", mode="token-file"))
    doc = json.loads(kubeconfig.read_text())
    doc["users"][0]["user"]["token"] = "stale-inline-token"
    kubeconfig.write_text(json.dumps(doc))
    assert credentials.load_credentials(str(kubeconfig)).token == api.token

    (tmp_path / "kc.token").unlink()
    assert credentials.load_credentials(str(kubeconfig)).token == "stale-inline-token"


def test_yaml_kubeconfig_when_pyyaml_is_available(api: ApiServer, tmp_path: Path) -> None:
    yaml = pytest.importorskip("yaml")
    doc = json.loads(Path(api.write_kubeconfig(tmp_path / "kc.json", mode="client-cert-data")).read_text())
    kubeconfig = tmp_path / "kc.yaml"
    kubeconfig.write_text(yaml.safe_dump(doc))

    creds = credentials.load_credentials(str(kubeconfig))

    assert podget.get_pod(creds, "default", "web-0")["metadata"]["name"] == "web-0"


def test_yaml_kubeconfig_without_pyyaml_says_use_json(
    api: ApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kubeconfig = tmp_path / "kc.yaml"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\ncurrent-context: x\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # makes `import yaml` fail

    with pytest.raises(InvalidConfig) as info:
        credentials.load_credentials(str(kubeconfig))

    assert str(kubeconfig) in info.value.msg
    assert "JSON" in info.value.msg
    assert "PyYAML" in info.value.msg


def test_inline_key_material_lives_in_private_files_only_during_the_request(
    api: ApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    creds = credentials.load_credentials(
        api.write_kubeconfig(tmp_path / "kc", mode="client-cert-data", ca="data")
    )
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))

    with tls.tls_files(creds) as (verify, cert):
        assert isinstance(verify, str)
        assert cert is not None
        key_dir = os.path.dirname(cert[1])
        assert stat.S_IMODE(os.stat(key_dir).st_mode) == 0o700
        for path in (verify, *cert):
            assert os.path.dirname(path) == key_dir
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert Path(cert[1]).read_bytes() == creds.client_key_data
    assert not os.path.exists(key_dir)

    podget.get_pod(creds, "default", "web-0")
    assert list(scratch.iterdir()) == []


def test_credentials_repr_hides_secrets(api: ApiServer, tmp_path: Path) -> None:
    creds = credentials.load_credentials(api.write_kubeconfig(tmp_path / "kc", mode="client-cert-data"))
    creds = dataclasses.replace(creds, token="repr-canary-token")
    text = repr(creds)
    assert "repr-canary-token" not in text
    assert "PRIVATE KEY" not in text


def test_server_by_hostname_matches_certificate(
    api: ApiServer, token_creds: credentials.ClusterCredentials
) -> None:
    creds = dataclasses.replace(token_creds, server=f"https://localhost:{api.port}")
    assert podget.get_pod(creds, "default", "web-0")["metadata"]["name"] == "web-0"


def test_proxy_environment_is_ignored(
    api: ApiServer, token_creds: credentials.ClusterCredentials, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A runtime's proxy settings (meant for image pulls) must not capture API traffic.
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY"):
        monkeypatch.setenv(var, f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)

    assert podget.get_pod(token_creds, "default", "web-0")["metadata"]["name"] == "web-0"


# --------------------------------------------------------------------------
# In-cluster service account


@pytest.fixture
def service_account(api: ApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    sa_dir = tmp_path / "serviceaccount"
    sa_dir.mkdir()
    (sa_dir / "token").write_text(api.token + "\n")
    (sa_dir / "ca.crt").write_bytes(Path(api.ca_path).read_bytes())
    (sa_dir / "namespace").write_text("kube-system")
    monkeypatch.setenv("RDMA_CNI_SERVICEACCOUNT_DIR", str(sa_dir))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(api.port))
    return sa_dir


@pytest.mark.parametrize("kubeconfig", [None, ""])
def test_in_cluster_service_account(api: ApiServer, service_account: Path, kubeconfig: str | None) -> None:
    creds = credentials.load_credentials(kubeconfig)

    assert creds.server == f"https://127.0.0.1:{api.port}"
    assert creds.ca_file == str(service_account / "ca.crt")
    pod = podget.get_pod(creds, "team-a", "db-0.shard-1")
    assert podget.pod_annotation(pod, ANNOTATION) == "x"
    assert api.auth_headers == [f"Bearer {api.token}"]


@pytest.mark.parametrize("var", ["KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"])
def test_in_cluster_without_service_env(
    service_account: Path, monkeypatch: pytest.MonkeyPatch, var: str
) -> None:
    monkeypatch.delenv(var)
    with pytest.raises(InvalidConfig, match=var):
        credentials.load_credentials(None)


@pytest.mark.parametrize("missing", ["token", "ca.crt"])
def test_in_cluster_without_service_account_files(service_account: Path, missing: str) -> None:
    (service_account / missing).unlink()
    with pytest.raises(InvalidConfig) as info:
        credentials.load_credentials(None)
    assert str(service_account / missing) in info.value.msg


def test_in_cluster_ipv6_host_is_bracketed(service_account: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    assert credentials.load_credentials(None).server == "https://[fd00::1]:443"


# --------------------------------------------------------------------------
# API answers


def test_pod_not_found(api: ApiServer, token_creds: credentials.ClusterCredentials) -> None:
    with pytest.raises(KubernetesError) as info:
        podget.get_pod(token_creds, "default", "ghost", **FAST)
    assert info.value.code == 102
    assert info.value.msg == "pod default/ghost not found"
    assert api.request_count == 1  # a 404 is an answer, not a reason to retry


def test_removed_pod_is_not_found(api: ApiServer, token_creds: credentials.ClusterCredentials) -> None:
    api.add_pod("default", "short-lived", {})
    podget.get_pod(token_creds, "default", "short-lived")
    api.remove_pod("default", "short-lived")
    with pytest.raises(KubernetesError, match="not found"):
        podget.get_pod(token_creds, "default", "short-lived")


def test_wrong_token_is_refused(api: ApiServer, token_creds: credentials.ClusterCredentials) -> None:
    creds = dataclasses.replace(token_creds, token="wrong-token-0123456789")
    with pytest.raises(KubernetesError) as info:
        podget.get_pod(creds, "default", "web-0", **FAST)
    assert "refused the credentials" in info.value.msg
    assert "401" in info.value.msg
    assert "wrong-token-0123456789" not in _full_text(info.value)
    assert api.request_count == 1


def test_forbidden_namespace(api: ApiServer, token_creds: credentials.ClusterCredentials) -> None:
    api.forbid_namespace("default")
    with pytest.raises(KubernetesError) as info:
        podget.get_pod(token_creds, "default", "web-0", **FAST)
    assert "403" in info.value.msg
    assert "forbidden" in info.value.details
    assert api.request_count == 1


def test_response_that_is_not_json(api: ApiServer, token_creds: credentials.ClusterCredentials) -> None:
    api.malform_next(1)
    with pytest.raises(KubernetesError, match="not JSON"):
        podget.get_pod(token_creds, "default", "web-0", **FAST)


def test_pod_without_annotations(token_creds: credentials.ClusterCredentials) -> None:
    pod = podget.get_pod(token_creds, "default", "plain")
    assert "annotations" not in pod["metadata"]
    assert podget.pod_annotation(pod, ANNOTATION) is None


@pytest.mark.parametrize(
    ("pod", "expected"),
    [
        ({"metadata": {"annotations": {"k": "v"}}}, "v"),
        ({"metadata": {"annotations": {"other": "v"}}}, None),
        ({"metadata": {"annotations": {"k": 3}}}, None),
        ({"metadata": {"annotations": None}}, None),
        ({"metadata": {}}, None),
        ({"metadata": "junk"}, None),
        ({}, None),
    ],
)
def test_pod_annotation(pod: dict[str, Any], expected: str | None) -> None:
    assert podget.pod_annotation(pod, "k") == expected


# --------------------------------------------------------------------------
# Transient failures


@pytest.mark.parametrize("status", [500, 503, 429])
def test_transient_failures_are_retried(
    api: ApiServer, token_creds: credentials.ClusterCredentials, status: int
) -> None:
    api.fail_next(2, status=status)
    pod = podget.get_pod(token_creds, "default", "web-0", retries=3, backoff=0.01)
    assert pod["metadata"]["name"] == "web-0"
    assert api.request_count == 3


def test_persistent_503_is_try_again_later(
    api: ApiServer, token_creds: credentials.ClusterCredentials
) -> None:
    api.fail_next(100)
    with pytest.raises(TryAgainLater) as info:
        podget.get_pod(token_creds, "default", "web-0", **FAST)
    assert info.value.code == 11
    assert token_creds.server in info.value.msg
    assert "503" in info.value.details
    assert api.request_count == 3  # the first try and two retries


def test_connection_refused_is_try_again_later(token_creds: credentials.ClusterCredentials) -> None:
    creds = dataclasses.replace(token_creds, server=f"https://127.0.0.1:{_closed_port()}")
    with pytest.raises(TryAgainLater) as info:
        podget.get_pod(creds, "default", "web-0", **FAST)
    assert creds.server in info.value.msg
    assert "ConnectionError" in info.value.details


def test_hanging_server_times_out_within_budget(
    api: ApiServer, token_creds: credentials.ClusterCredentials
) -> None:
    api.hang(30)
    start = time.monotonic()
    with pytest.raises(TryAgainLater) as info:
        podget.get_pod(token_creds, "default", "web-0", timeout=(1.0, 0.3), retries=1, backoff=0.01)
    elapsed = time.monotonic() - start
    assert elapsed < 3.0
    assert "Timeout" in info.value.details
    assert api.request_count == 2


def test_wrong_ca_is_a_clear_permanent_error(
    api: ApiServer, token_creds: credentials.ClusterCredentials, tmp_path: Path
) -> None:
    other_ca, _ = make_ca(str(tmp_path), "other-ca", "some other CA")
    creds = dataclasses.replace(token_creds, ca_file=other_ca)
    with pytest.raises(KubernetesError) as info:
        podget.get_pod(creds, "default", "web-0", **FAST)
    assert "TLS" in info.value.msg
    assert creds.server in info.value.msg
    assert "certificate" in info.value.details.lower()
    # The handshake failed, so no request was ever read, and none was retried.
    assert api.request_count == 0


def test_inline_ca_stays_in_memory_for_the_pod_get(
    api: ApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The usual kubeconfig (a token and inline CA data, as the installer writes it) needs no files."""
    creds = credentials.load_credentials(api.write_kubeconfig(tmp_path / "kc", mode="token", ca="data"))
    assert creds.ca_data is not None and creds.ca_file is None

    def no_files(*args: object, **kwargs: object) -> str:
        raise AssertionError("a temporary directory was made for inline CA data")

    monkeypatch.setattr(tempfile, "mkdtemp", no_files)
    assert podget.get_pod(creds, "default", "web-0")["metadata"]["name"] == "web-0"


def test_wrong_inline_ca_is_a_clear_permanent_error(api: ApiServer, tmp_path: Path) -> None:
    """Inline CA data is still what the server's certificate is verified against."""
    creds = credentials.load_credentials(api.write_kubeconfig(tmp_path / "kc", mode="token", ca="data"))
    other_ca, _ = make_ca(str(tmp_path), "other-ca", "some other CA")
    creds = dataclasses.replace(creds, ca_data=Path(other_ca).read_bytes())
    with pytest.raises(KubernetesError) as info:
        podget.get_pod(creds, "default", "web-0", **FAST)
    assert "TLS" in info.value.msg and "certificate" in info.value.details.lower()
    assert api.request_count == 0


def test_inline_ca_that_holds_no_certificate_is_a_clear_error(api: ApiServer, tmp_path: Path) -> None:
    creds = credentials.load_credentials(api.write_kubeconfig(tmp_path / "kc", mode="token", ca="data"))
    garbage = b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"
    creds = dataclasses.replace(creds, ca_data=garbage)
    with pytest.raises(KubernetesError) as info:
        podget.get_pod(creds, "default", "web-0", **FAST)
    assert info.value.msg == "cannot load the API server's certificate authority"
    assert "certificate" in info.value.details
    assert api.request_count == 0


# --------------------------------------------------------------------------
# Hostile names


@pytest.mark.parametrize(
    ("namespace", "name", "field"),
    [
        ("..", "web-0", "namespace"),
        ("default", "../..", "pod name"),
        ("default/../kube-system", "web-0", "namespace"),
        ("default", "web-0/exec", "pod name"),
        ("default", "web-0?watch=1", "pod name"),
        ("default", "web-0#x", "pod name"),
        ("default", "web%2F0", "pod name"),
        ("default", "Web-0", "pod name"),
        ("default", "web-0\n", "pod name"),
        ("default", "", "pod name"),
        ("", "web-0", "namespace"),
        ("a.b", "web-0", "namespace"),
        ("x" * 64, "web-0", "namespace"),
        ("default", "x" * 254, "pod name"),
        ("default", "-web", "pod name"),
        ("default", "web-0 ", "pod name"),
    ],
)
def test_hostile_names_never_reach_the_server(
    api: ApiServer, token_creds: credentials.ClusterCredentials, namespace: str, name: str, field: str
) -> None:
    with pytest.raises(KubernetesError) as info:
        podget.get_pod(token_creds, namespace, name, **FAST)
    assert info.value.msg.startswith(f"invalid {field} ")
    assert api.request_count == 0


def test_longest_valid_names_are_accepted(
    api: ApiServer, token_creds: credentials.ClusterCredentials
) -> None:
    namespace, name = "n" * 63, ".".join(["p" * 63] * 3) + "." + "q" * 61
    assert len(name) == 253
    api.add_pod(namespace, name, {})
    assert podget.get_pod(token_creds, namespace, name)["metadata"]["name"] == name


# --------------------------------------------------------------------------
# Malformed kubeconfigs


def _del(*keys: str) -> Callable[[dict[str, Any]], Any]:
    def mutate(doc: dict[str, Any]) -> Any:
        target: Any = doc
        for key in keys[:-1]:
            target = target[int(key)] if isinstance(target, list) else target[key]
        del target[keys[-1]]
        return doc

    return mutate


def _set(value: Any, *keys: str) -> Callable[[dict[str, Any]], Any]:
    def mutate(doc: dict[str, Any]) -> Any:
        target: Any = doc
        for key in keys[:-1]:
            target = target[int(key)] if isinstance(target, list) else target[key]
        target[keys[-1]] = value
        return doc

    return mutate


CLUSTER = ("clusters", "0", "cluster")
USER = ("users", "0", "user")
NOT_PEM = base64.b64encode(b"hello").decode()
FAKE_CERT_PEM = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n").decode()


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        pytest.param(lambda doc: [doc], "not a mapping", id="list-document"),
        pytest.param(_del("current-context"), "current-context is missing", id="no-current-context"),
        pytest.param(
            _set("elsewhere", "current-context"), 'contexts[name="elsewhere"]', id="unknown-context"
        ),
        pytest.param(
            _del("contexts", "0", "context", "user"), ".context.user is missing", id="context-no-user"
        ),
        pytest.param(_set({}, "clusters"), "clusters is missing or not a list", id="clusters-not-list"),
        pytest.param(_set([], "users"), 'users[name="stand-in-user"] is missing', id="user-not-listed"),
        pytest.param(_del(*CLUSTER, "server"), ".cluster.server is missing", id="no-server"),
        pytest.param(
            _set("ftp://host", *CLUSTER, "server"), ".server is not an http(s) URL", id="bad-scheme"
        ),
        pytest.param(
            _set("/no/such/ca.crt", *CLUSTER, "certificate-authority"),
            "/no/such/ca.crt",
            id="ca-file-missing",
        ),
        pytest.param(
            _set("!!!notbase64", *CLUSTER, "certificate-authority-data"),
            "certificate-authority-data is not valid base64",
            id="ca-data-not-base64",
        ),
        pytest.param(
            _set(NOT_PEM, *CLUSTER, "certificate-authority-data"),
            "certificate-authority-data does not decode to a PEM block",
            id="ca-data-not-pem",
        ),
        pytest.param(
            _set("yes", *CLUSTER, "insecure-skip-tls-verify"),
            "insecure-skip-tls-verify must be",
            id="insecure-not-bool",
        ),
        pytest.param(
            _set(True, *CLUSTER, "insecure-skip-tls-verify"),
            "both insecure-skip-tls-verify and a certificate authority",
            id="insecure-with-ca",
        ),
        pytest.param(_set({}, *USER), 'users[name="stand-in-user"].user has no token', id="no-credentials"),
        pytest.param(_set({"exec": {"command": "aws"}}, *USER), "exec is not supported", id="exec-user"),
        pytest.param(
            _set({"client-certificate-data": FAKE_CERT_PEM}, *USER), "no client-key", id="cert-without-key"
        ),
        pytest.param(_set({"tokenFile": "missing.token"}, *USER), ".user.tokenFile", id="token-file-missing"),
        pytest.param(_set(12345, *USER, "token"), ".user.token must be a string", id="token-not-string"),
        pytest.param(_set("two words", *USER, "token"), "whitespace or non-printable", id="token-with-space"),
    ],
)
def test_malformed_kubeconfig(
    api: ApiServer, tmp_path: Path, mutate: Callable[[dict[str, Any]], Any], expected: str
) -> None:
    kubeconfig = Path(api.write_kubeconfig(tmp_path / "kubeconfig", mode="token"))
    doc = mutate(json.loads(kubeconfig.read_text()))
    kubeconfig.write_text(json.dumps(doc))

    with pytest.raises(InvalidConfig) as info:
        credentials.load_credentials(str(kubeconfig))

    assert info.value.code == 7
    assert str(kubeconfig) in info.value.msg
    assert expected in info.value.msg
    assert api.token not in _full_text(info.value)


def test_kubeconfig_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(InvalidConfig) as info:
        credentials.load_credentials(str(missing))
    assert str(missing) in info.value.msg


def test_kubeconfig_neither_json_nor_yaml(tmp_path: Path) -> None:
    pytest.importorskip("yaml")
    kubeconfig = tmp_path / "kc"
    kubeconfig.write_text("clusters: [unterminated\n  token: s3cr3t-value\n")
    with pytest.raises(InvalidConfig) as info:
        credentials.load_credentials(str(kubeconfig))
    assert str(kubeconfig) in info.value.msg
    assert "neither valid JSON nor valid YAML" in info.value.msg
    assert "s3cr3t-value" not in _full_text(info.value)


# --------------------------------------------------------------------------
# Secrets never leak


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def test_token_never_appears_in_logs_or_errors(
    api: ApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)  # urllib3's own debug lines too
    capture = _Capture()
    rdma_logger = logging.getLogger("rdma_cni")
    rdma_logger.addHandler(capture)
    old_level = rdma_logger.level
    rdma_logger.setLevel(logging.DEBUG)
    good = credentials.load_credentials(api.write_kubeconfig(tmp_path / "kc", mode="token"))
    wrong = dataclasses.replace(good, token="wrong-canary-" + "z" * 24)
    other_ca, _ = make_ca(str(tmp_path), "other-ca")
    errors: list[BaseException] = []

    def attempt(
        creds: credentials.ClusterCredentials, namespace: str = "default", name: str = "web-0", **kw: Any
    ) -> None:
        try:
            podget.get_pod(creds, namespace, name, **{**FAST, **kw})
        except CniError as exc:
            errors.append(exc)

    try:
        attempt(good)  # success, with debug logging
        attempt(good, name="ghost")  # 404
        attempt(wrong)  # 401
        api.forbid_namespace("default")
        attempt(good)  # 403
        api.reset()
        api.fail_next(100)
        attempt(good)  # persistent 503, logs each retry
        api.reset()
        api.malform_next(1)
        attempt(good)  # not JSON
        api.hang(30)
        attempt(good, timeout=(1.0, 0.2), retries=1)  # timeout
        api.reset()
        attempt(dataclasses.replace(good, ca_file=other_ca))  # TLS failure
        attempt(dataclasses.replace(good, server=f"https://127.0.0.1:{_closed_port()}"))  # refused
        attempt(good, name="../..")  # hostile name
    finally:
        rdma_logger.removeHandler(capture)
        rdma_logger.setLevel(old_level)

    assert len(errors) == 9
    assert any("retrying" in line for line in capture.lines)
    everything = "\n".join(
        [*capture.lines, caplog.text, *(r.getMessage() for r in caplog.records), *map(_full_text, errors)]
    )
    assert good.token
    assert good.token not in everything
    assert wrong.token
    assert wrong.token not in everything


# --------------------------------------------------------------------------
# Start-up cost


def test_import_does_not_load_requests() -> None:
    code = (
        "import sys, rdma_cni.kube.podget\n"
        "heavy = [m for m in ('requests', 'urllib3', 'yaml') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, check=True
    )
    assert proc.stdout.strip() == ""
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert "rdma_cni.kube.podget" in imported
    assert not {"requests", "urllib3", "yaml"} & imported


# --------------------------------------------------------------------------
# The stdlib HTTP client's own edges


def test_answer_larger_than_the_bound_is_refused(
    api: ApiServer, token_creds: credentials.ClusterCredentials, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(podget, "_MAX_BODY", 2000)
    api.add_pod("default", "big", {"rdma_interfaces_required": "x" * 4000})
    with pytest.raises(KubernetesError) as info:
        podget.get_pod(token_creds, "default", "big", **FAST)
    assert "larger than 2000 bytes" in info.value.msg
    assert api.request_count == 1  # a bound is not retried


@pytest.mark.parametrize("server", ["ftp://127.0.0.1:1", "https://127.0.0.1:99999", "https:///nohost"])
def test_server_address_that_is_not_an_http_url(
    token_creds: credentials.ClusterCredentials, server: str
) -> None:
    creds = dataclasses.replace(token_creds, server=server)
    with pytest.raises(KubernetesError) as info:
        podget.get_pod(creds, "default", "web-0", **FAST)
    assert "is not an http(s)://host[:port] URL" in info.value.msg
    assert token_creds.source in info.value.msg


def test_plain_http_server_is_spoken_to_without_tls(token_creds: credentials.ClusterCredentials) -> None:
    # kubeconfigs may name http:// servers; nothing listens here, so the answer is "try again".
    creds = dataclasses.replace(token_creds, server=f"http://127.0.0.1:{_closed_port()}")
    with pytest.raises(TryAgainLater) as info:
        podget.get_pod(creds, "default", "web-0", **FAST)
    assert "ConnectionError" in info.value.details


def test_unloadable_client_certificate_is_a_clear_error(
    api: ApiServer, token_creds: credentials.ClusterCredentials, tmp_path: Path
) -> None:
    garbage = tmp_path / "client.crt"
    garbage.write_text("not a certificate")
    creds = dataclasses.replace(token_creds, client_cert_file=str(garbage), client_key_file=str(garbage))
    with pytest.raises(KubernetesError) as info:
        podget.get_pod(creds, "default", "web-0", **FAST)
    assert "client certificate" in info.value.msg
    assert api.request_count == 0


# --------------------------------------------------------------------------
# A password in the server URL


def _kubeconfig_with_server(api: ApiServer, tmp_path: Path, server: str) -> str:
    path = api.write_kubeconfig(tmp_path / "kubeconfig", mode="token")
    with open(path) as f:
        doc = json.load(f)
    doc["clusters"][0]["cluster"]["server"] = server
    with open(path, "w") as f:
        json.dump(doc, f)
    return path


@pytest.mark.parametrize("where", ["closed-port", "503", "bad-scheme"])
def test_server_url_password_is_never_printed(
    api: ApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    password = "Pa55w0rd%21x"  # percent-encoded in the URL: "Pa55w0rd!x" decoded
    host = f"127.0.0.1:{_closed_port() if where == 'closed-port' else api.port}"
    scheme = "ftp" if where == "bad-scheme" else "https"
    path = _kubeconfig_with_server(api, tmp_path, f"{scheme}://alice:{password}@{host}/")
    if where == "503":
        api.fail_next(100)
    caplog.set_level(logging.DEBUG)
    with pytest.raises(CniError) as info:
        creds = credentials.load_credentials(path)
        assert creds.server == f"https://{host}" and "alice" not in repr(creds)
        podget.get_pod(creds, "default", "web-0", **FAST)
    seen = _full_text(info.value) + caplog.text
    assert host in info.value.msg
    for secret in ("Pa55w0rd", "alice:"):
        assert secret not in seen


def test_server_url_userinfo_does_not_replace_the_token(api: ApiServer, tmp_path: Path) -> None:
    server = f"https://bob:pw@127.0.0.1:{api.port}"
    creds = credentials.load_credentials(_kubeconfig_with_server(api, tmp_path, server))
    assert creds.server == f"https://127.0.0.1:{api.port}"
    assert podget.get_pod(creds, "default", "web-0", **FAST)["metadata"]["name"] == "web-0"


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("https://h:1/p?q=a@b", ("https://h:1/p?q=a@b", None)),
        ("https://u:p@w@h:1/p", ("https://h:1/p", "u:p@w")),
        ("https://u@h", ("https://h", "u")),
        ("no-scheme@host", ("no-scheme@host", None)),
    ],
)
def test_split_userinfo(url: str, expected: tuple[str, str | None]) -> None:
    assert credentials.split_userinfo(url) == expected


# --------------------------------------------------------------------------
# TLS contexts kept by a warm server


@pytest.fixture
def no_contexts(monkeypatch: pytest.MonkeyPatch) -> dict[bytes, Any]:
    kept: dict[bytes, Any] = {}
    monkeypatch.setattr(tls, "_CONTEXTS", kept)
    monkeypatch.setattr(tls, "_missed", None)
    monkeypatch.setattr(tls, "context_hint_fd", -1)
    return kept


def _no_building(*_args: Any) -> Any:
    raise AssertionError("a TLS context was built although one was kept for the same content")


@pytest.mark.parametrize(
    ("mode", "ca"), [("token", "file"), ("client-cert-data", "data"), ("insecure", "file")]
)
def test_a_kept_context_serves_later_requests(
    api: ApiServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    no_contexts: dict[bytes, Any],
    mode: str,
    ca: str,
) -> None:
    creds = credentials.load_credentials(api.write_kubeconfig(tmp_path / "kc", mode=mode, ca=ca))
    assert tls.keep_context(creds)
    assert not tls.keep_context(creds)  # already kept
    monkeypatch.setattr(tls, "ssl_context", _no_building)
    assert podget.get_pod(creds, "default", "web-0")["metadata"]["uid"] == "1111-2222"


def test_a_ca_file_with_text_around_its_pem_block_is_kept(
    api: ApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_contexts: dict[bytes, Any]
) -> None:
    """Kept contexts load the CA from its bytes: non-ASCII text outside the PEM block, which
    OpenSSL skips in a file, is skipped there too."""
    creds = credentials.load_credentials(api.write_kubeconfig(tmp_path / "kc", mode="token", ca="file"))
    assert creds.ca_file is not None
    own_ca = tmp_path / "ca.crt"
    own_ca.write_bytes("Zertifikat für die Tests ✓\n".encode() + Path(creds.ca_file).read_bytes())
    creds = dataclasses.replace(creds, ca_file=str(own_ca))
    assert tls.keep_context(creds)
    monkeypatch.setattr(tls, "ssl_context", _no_building)
    assert podget.get_pod(creds, "default", "web-0")["metadata"]["uid"] == "1111-2222"


def test_a_changed_ca_file_is_never_served_a_kept_context(
    api: ApiServer, tmp_path: Path, no_contexts: dict[bytes, Any]
) -> None:
    creds = credentials.load_credentials(api.write_kubeconfig(tmp_path / "kc", mode="token", ca="file"))
    assert creds.ca_file is not None
    own_ca = tmp_path / "ca.crt"
    own_ca.write_bytes(Path(creds.ca_file).read_bytes())  # a copy: the server's own file stays
    creds = dataclasses.replace(creds, ca_file=str(own_ca))
    assert tls.keep_context(creds)
    other, _ = make_ca(str(tmp_path), stem="other", common_name="another CA")
    os.replace(other, own_ca)  # the kubeconfig's CA file now trusts someone else
    with pytest.raises(KubernetesError, match="TLS connection"):
        podget.get_pod(creds, "default", "web-0", **FAST)


def test_the_system_trust_store_and_unreadable_files_are_never_kept(
    api: ApiServer, tmp_path: Path, no_contexts: dict[bytes, Any]
) -> None:
    creds = credentials.load_credentials(api.write_kubeconfig(tmp_path / "kc", mode="client-cert-files"))
    assert not tls.keep_context(dataclasses.replace(creds, ca_file=None, ca_data=None))
    assert creds.client_key_file is not None
    assert not tls.keep_context(dataclasses.replace(creds, client_key_file=str(tmp_path / "gone.key")))
    assert no_contexts == {}


def test_the_oldest_kept_context_makes_room(
    api: ApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_contexts: dict[bytes, Any]
) -> None:
    monkeypatch.setattr(tls, "_MAX_CONTEXTS", 1)
    first = credentials.load_credentials(api.write_kubeconfig(tmp_path / "a", mode="token", ca="file"))
    second = credentials.load_credentials(api.write_kubeconfig(tmp_path / "b", mode="insecure"))
    assert tls.keep_context(first) and tls.keep_context(second)
    assert len(no_contexts) == 1
    assert tls.keep_context(first)  # it was dropped, so it is built again


def test_a_context_built_by_a_child_is_named_to_the_server_once(
    api: ApiServer, tmp_path: Path, no_contexts: dict[bytes, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = api.write_kubeconfig(tmp_path / "kc", mode="token", ca="file")
    creds = credentials.load_credentials(path)
    r, w = os.pipe2(os.O_NONBLOCK)
    monkeypatch.setattr(tls, "context_hint_fd", w)
    try:
        podget.get_pod(creds, "default", "web-0")
        tls.note_context_miss(path)
        tls.note_context_miss(path)
        assert os.read(r, 4096) == path.encode() + b"\n"
        tls.keep_context(creds)  # what the server does with it
        podget.get_pod(creds, "default", "web-0")
        tls.note_context_miss(path)
        with pytest.raises(BlockingIOError):
            os.read(r, 4096)
    finally:
        os.close(r)
        os.close(w)


def test_a_cold_start_neither_hashes_certificates_nor_imports_hashlib(api: ApiServer, tmp_path: Path) -> None:
    """Only a warm server keeps contexts: a process that cannot keep one builds it and hashes nothing."""
    from tests.unit.test_startup import run

    path = api.write_kubeconfig(tmp_path / "kc", mode="token", ca="file")
    out = run(
        f"""
        import json, sys
        from rdma_cni.launch.startup import defer_unused
        defer_unused()  # as the built binary's entry point does
        from rdma_cni.kube import credentials, podget, tls
        tls.client_context(credentials.load_credentials({str(path)!r}))
        print(json.dumps({{"hashlib": "hashlib" in sys.modules, "kept": len(tls._CONTEXTS)}}))
        """
    )
    assert out == {"hashlib": False, "kept": 0}


def test_a_ca_file_that_holds_no_certificate_is_a_clear_error(api: ApiServer, tmp_path: Path) -> None:
    creds = credentials.load_credentials(api.write_kubeconfig(tmp_path / "kc", mode="token"))
    (tmp_path / "ca.crt").write_text("no certificate here\n")
    creds = dataclasses.replace(creds, ca_file=str(tmp_path / "ca.crt"), ca_data=None)
    with pytest.raises(KubernetesError) as info:
        podget.get_pod(creds, "default", "web-0", **FAST)
    assert info.value.msg == "cannot load the API server's certificate authority"
    assert api.request_count == 0


# --------------------------------------------------------------------------
# A process that runs many verbs (the agent's workers) keeps its connection


@pytest.fixture
def keeping(no_contexts: dict[bytes, Any]) -> Iterator[None]:
    podget.keep_connections(True)
    yield
    podget.keep_connections(False)


def _ports(api: ApiServer) -> list[int]:
    return [seen.client_port for seen in api.requests_seen]


def test_a_worker_keeps_one_connection_and_one_context_for_its_gets(
    api: ApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keeping: None
) -> None:
    creds = credentials.load_credentials(api.write_kubeconfig(tmp_path / "kc", mode="token", ca="data"))
    for _ in range(3):
        assert podget.get_pod(creds, "default", "web-0")["metadata"]["uid"] == "1111-2222"
    assert len(set(_ports(api))) == 1
    assert len(podget.kept_fds()) == 1
    monkeypatch.setattr(tls, "ssl_context", _no_building)  # the context was kept as well
    podget.get_pod(creds, "default", "web-0")
    podget.keep_connections(False)
    assert podget.kept_fds() == set()


def test_without_keeping_each_get_has_its_own_connection(
    api: ApiServer, token_creds: credentials.ClusterCredentials
) -> None:
    for _ in range(2):
        podget.get_pod(token_creds, "default", "web-0")
    assert len(set(_ports(api))) == 2 and podget.kept_fds() == set()


def test_a_kept_connection_the_server_closed_is_replaced_and_the_get_repeated(
    api: ApiServer,
    token_creds: credentials.ClusterCredentials,
    keeping: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    podget.get_pod(token_creds, "default", "web-0")
    (conn,) = podget._kept.values()
    assert conn.sock is not None
    # Closed under it, and found out only on use (a server closing it as the GET goes out): a
    # fresh connection answers, the GET repeated.
    conn.sock.shutdown(socket.SHUT_RDWR)
    with monkeypatch.context() as patch:
        patch.setattr(podget, "_reusable", lambda _conn: True)
        assert podget.get_pod(token_creds, "default", "web-0")["metadata"]["uid"] == "1111-2222"
    (fresh,) = podget._kept.values()
    assert fresh is not conn
    # Something waiting on an idle kept connection (a server's close) means it is not used again.
    assert fresh.sock is not None
    ours, theirs = socket.socketpair()
    theirs.close()
    fresh.sock.close()
    fresh.sock = ours
    api.reset()
    podget.get_pod(token_creds, "default", "web-0")
    assert len(api.requests_seen) == 1


def test_a_connection_is_kept_per_context_a_changed_ca_gets_its_own(
    api: ApiServer, tmp_path: Path, keeping: None
) -> None:
    creds = credentials.load_credentials(api.write_kubeconfig(tmp_path / "kc", mode="token", ca="file"))
    assert creds.ca_file is not None
    own_ca = tmp_path / "ca.crt"
    own_ca.write_bytes(Path(creds.ca_file).read_bytes())
    creds = dataclasses.replace(creds, ca_file=str(own_ca))
    podget.get_pod(creds, "default", "web-0")
    own_ca.write_bytes(b"# rotated\n" + Path(creds.ca_file).read_bytes())  # other bytes: another context
    podget.get_pod(creds, "default", "web-0")
    assert len(set(_ports(api))) == 2 and len(podget.kept_fds()) == 2


# A worker connects before its first verb (rdma_cni/agent/verbworker.py, Verbs.warm_up)


def test_a_connection_opened_ahead_is_the_one_the_first_get_uses(
    api: ApiServer, token_creds: credentials.ClusterCredentials, keeping: None
) -> None:
    assert podget.connect_ahead(token_creds) is None
    (conn,) = podget._kept.values()
    assert conn.sock is not None and api.requests_seen == []  # connected and handshaken; nothing sent
    port = conn.sock.getsockname()[1]
    assert podget.connect_ahead(token_creds) is None  # once per server and context
    assert len(podget.kept_fds()) == 1
    assert podget.get_pod(token_creds, "default", "web-0")["metadata"]["uid"] == "1111-2222"
    assert _ports(api) == [port]


def test_a_process_that_keeps_no_connection_opens_none_ahead(
    api: ApiServer, token_creds: credentials.ClusterCredentials
) -> None:
    assert podget.connect_ahead(token_creds) == "connections are not kept in this process"
    assert podget.kept_fds() == set()


def test_a_server_that_cannot_be_reached_ahead_is_said_and_left_to_the_verb(
    token_creds: credentials.ClusterCredentials, keeping: None
) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    creds = dataclasses.replace(token_creds, server=f"https://127.0.0.1:{port}")
    problem = podget.connect_ahead(creds, timeout=2)
    assert problem is not None and problem.startswith("ConnectionRefusedError"), problem
    assert podget.kept_fds() == set()


def test_credentials_whose_ca_cannot_be_read_ahead_are_said(
    token_creds: credentials.ClusterCredentials, tmp_path: Path, keeping: None
) -> None:
    creds = dataclasses.replace(token_creds, ca_file=str(tmp_path / "gone.crt"), ca_data=None)
    problem = podget.connect_ahead(creds)
    assert problem is not None and "certificate authority" in problem and "No such file" in problem, problem
    assert podget.kept_fds() == set()


class _ReadableTls(ssl.SSLSocket):
    """A TLS socket with something to read, and what reading it without waiting gives."""

    def __init__(self, readable: socket.socket, gives: bytes | Exception) -> None:  # no handshake
        self.readable, self.gives, self.timeouts = readable, gives, [5.0]

    def fileno(self) -> int:
        return self.readable.fileno()

    def gettimeout(self) -> float | None:
        return self.timeouts[-1]

    def setblocking(self, flag: bool) -> None:
        self.timeouts.append(None if flag else 0.0)

    def settimeout(self, value: float | None) -> None:
        self.timeouts.append(value)

    def recv(self, buflen: int = 1024, flags: int = 0) -> bytes:
        if isinstance(self.gives, Exception):
            raise self.gives
        return self.gives


@pytest.mark.parametrize(
    ("gives", "reusable"),
    [
        (ssl.SSLWantReadError("session tickets only"), True),
        (b"", False),  # the server closed it
        (b"H", False),  # something nobody asked for
        (ConnectionResetError(104, "Connection reset by peer"), False),
    ],
    ids=["tickets", "closed", "stray-data", "reset"],
)
def test_a_kept_tls_connection_with_only_session_tickets_waiting_is_reused(
    gives: bytes | Exception, reusable: bool
) -> None:
    ours, theirs = socket.socketpair()
    theirs.send(b"x")  # readable, as a TLS record waiting makes it
    try:
        sock = _ReadableTls(ours, gives)
        assert podget._reusable(types.SimpleNamespace(sock=sock)) is reusable  # type: ignore[arg-type]
        assert sock.timeouts[-1] == 5.0  # its timeout as it was
    finally:
        ours.close()
        theirs.close()
