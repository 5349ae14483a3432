"""``rdma-cni scheduler-config``: the operator's KubeSchedulerConfiguration with the extender merged in.

The stanza it writes is conf/kube-scheduler-default.yaml's with the ClusterIP and the credentials
inline (never a file kube-scheduler would read at start); the operator's profiles, plugins and
other extenders are kept; what cannot be merged, and credentials kube-scheduler would refuse or
that have expired, are refused with the reason; ``--remove`` is the revert. The real
kube-scheduler starting with what it writes, and staying up whatever happens to the extender, is
tests/cluster/test_default_scheduler_robust.py.
"""

from __future__ import annotations

import base64
import copy
import io
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml

from rdma_cni.extender import schedconfig
from tests.support.apiserver import make_ca, make_cert, make_cert_dated
from tests.unit.test_conf_scheduler import scheduler_config, validation_errors

URL = "https://10.96.0.77:443"


@pytest.fixture(scope="module")
def creds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("creds")
    serving_ca = make_ca(str(d / "serving"), common_name="serving CA")
    client_ca = make_ca(str(d / "client"), common_name="client CA")
    cert, key = make_cert(str(d / "client"), client_ca, "client", "/CN=rdma-cni-kube-scheduler", client=True)
    expired, expired_key = make_cert_dated(
        str(d / "client"),
        client_ca,
        "expired",
        "/CN=rdma-cni-kube-scheduler",
        client=True,
        start="20200101000000Z",
        end="20210101000000Z",
    )
    old_ca, _ = make_cert_dated(
        str(d / "serving"),
        serving_ca,
        "oldca",
        "/CN=old",
        client=False,
        start="20200101000000Z",
        end="20210101000000Z",
    )
    return {
        "ca": serving_ca[0],
        "cert": cert,
        "key": key,
        "other_key": str(d / "serving" / "ca.key"),
        "expired": expired,
        "expired_key": expired_key,
        "old_ca": old_ca,
        "dir": str(d),
    }


@pytest.fixture(autouse=True)
def _no_expiry_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test CAs live 30 days: no warning, but where a test asks for one."""
    monkeypatch.setattr(schedconfig, "EXPIRY_WARNING", 0)


def run(argv: list[str], stdin: str = "") -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    try:
        code = schedconfig.main(argv, out, err, io.StringIO(stdin))
    except SystemExit as exc:  # argparse's usage errors
        code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def render(creds: dict[str, str], *extra: str, stdin: str = "") -> tuple[int, str, str]:
    args = ["--url", URL, "--ca", creds["ca"], "--client-cert", creds["cert"], "--client-key", creds["key"]]
    return run([*args, *extra], stdin)


def test_a_fresh_configuration_is_conf_s_with_the_credentials_inline(creds: dict[str, str]) -> None:
    code, out, err = render(creds)
    assert (code, err) == (0, "")
    assert out.startswith("# kube-scheduler's configuration, written by rdma-cni scheduler-config")
    doc = yaml.safe_load(out)
    assert validation_errors(doc) == []
    shipped = scheduler_config("kube-scheduler-default.yaml")
    (ext,) = doc["extenders"]
    (conf_ext,) = shipped["extenders"]
    # Everything but where it is and who it is, exactly as conf/ ships it.
    assert {k: v for k, v in ext.items() if k not in ("urlPrefix", "tlsConfig")} == {
        k: v for k, v in conf_ext.items() if k not in ("urlPrefix", "tlsConfig")
    }
    assert ext["urlPrefix"] == URL
    tls = ext["tlsConfig"]
    assert set(tls) == {"serverName", "caData", "certData", "keyData"}  # no file to read at start
    assert tls["serverName"] == conf_ext["tlsConfig"]["serverName"]
    for field, name in (("caData", "ca"), ("certData", "cert"), ("keyData", "key")):
        assert base64.b64decode(tls[field]) == Path(creds[name]).read_bytes()
    assert {k: v for k, v in doc.items() if k != "extenders"} == {
        k: v for k, v in shipped.items() if k != "extenders"
    }


OPERATORS = """\
apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
clientConnection:
  kubeconfig: /etc/kubernetes/scheduler.conf
leaderElection:
  leaderElect: true
profiles:
  - schedulerName: default-scheduler
    plugins:
      score:
        disabled:
          - name: NodeResourcesBalancedAllocation
  - schedulerName: batch
    percentageOfNodesToScore: 30
extenders:
  - urlPrefix: http://127.0.0.1:9999
    filterVerb: filter
    weight: 1
"""


def test_the_operators_profiles_and_extenders_are_kept(creds: dict[str, str], tmp_path: Path) -> None:
    current = tmp_path / "kube-scheduler.yaml"
    current.write_text(OPERATORS)
    code, out, err = render(creds, "--merge", str(current))
    assert code == 0
    doc = yaml.safe_load(out)
    before = yaml.safe_load(OPERATORS)
    assert {k: v for k, v in doc.items() if k != "extenders"} == {
        k: v for k, v in before.items() if k != "extenders"
    }
    assert doc["extenders"][0] == before["extenders"][0]
    assert doc["extenders"][1]["urlPrefix"] == URL and len(doc["extenders"]) == 2
    assert validation_errors(doc) == []
    # Pods of every profile reach the extender: it must bind the pods of both names.
    assert "--scheduler-name=default-scheduler --scheduler-name=batch" in err
    assert "--percentage-of-nodes-to-score" in err
    # Run again on its own output: the earlier stanza is replaced, not added to (kube-scheduler
    # allows one binder, and the managed resources once).
    current.write_text(out)
    code, again, _ = render(creds, "--merge", str(current))
    assert code == 0 and yaml.safe_load(again) == doc


def test_stdin_and_the_output_file(creds: dict[str, str], tmp_path: Path) -> None:
    target = tmp_path / "out.yaml"
    target.write_text("old")
    os.chmod(target, 0o644)
    code, out, _ = render(creds, "--merge", "-", "--output", str(target), stdin=OPERATORS)
    assert (code, out) == (0, "")
    # It holds kube-scheduler's private key: 0600, as kubeadm's scheduler.conf.
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert yaml.safe_load(target.read_text())["extenders"][1]["urlPrefix"] == URL
    code, _, err = render(creds, "--output", str(tmp_path / "missing" / "out.yaml"))
    assert code == 1 and "cannot write" in err


def test_remove_is_the_revert(creds: dict[str, str], tmp_path: Path) -> None:
    current = tmp_path / "kube-scheduler.yaml"
    current.write_text(OPERATORS)
    _, merged, _ = render(creds, "--merge", str(current))
    current.write_text(merged)
    code, out, err = run(["--remove", "--merge", str(current)])
    assert (code, err) == (0, "")
    assert yaml.safe_load(out) == yaml.safe_load(OPERATORS)
    # A configuration of its own (no other extender): the extenders key goes with it.
    _, fresh, _ = render(creds)
    current.write_text(fresh)
    code, out, _ = run(["--remove", "--merge", str(current)])
    assert code == 0 and "extenders" not in yaml.safe_load(out)
    # Nothing of ours: unchanged, and said.
    current.write_text(OPERATORS)
    code, out, err = run(["--remove", "--merge", str(current)])
    assert code == 0 and yaml.safe_load(out) == yaml.safe_load(OPERATORS)
    assert "no rdma-cni extender in it" in err


def _changed(change: Any) -> str:
    doc = yaml.safe_load(OPERATORS)
    change(doc)
    return yaml.safe_dump(doc)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (
            _changed(lambda d: d["extenders"][0].update(bindVerb="bind")),
            "binds pods (bindVerb), and kube-scheduler allows one binding extender",
        ),
        (_changed(lambda d: d.update(apiVersion="kubescheduler.config.k8s.io/v1beta3")), "convert it first"),
        (_changed(lambda d: d.update(kind="KubeProxyConfiguration")), "not a KubeSchedulerConfiguration"),
        (_changed(lambda d: d.update(extenders={"a": 1})), "extenders are not a list"),
        (_changed(lambda d: d.update(profiles=["x"])), "profiles are not a list"),
        (OPERATORS + "---\n" + OPERATORS, "not one KubeSchedulerConfiguration"),
        ("[1, 2]\n", "not one KubeSchedulerConfiguration"),
        ("profiles: [\n", "is not YAML"),
    ],
)
def test_what_cannot_be_merged_is_refused(creds: dict[str, str], tmp_path: Path, text: str, why: str) -> None:
    current = tmp_path / "kube-scheduler.yaml"
    current.write_text(text)
    code, out, err = render(creds, "--merge", str(current))
    assert (code, out) == (1, "")
    assert err.startswith("rdma-cni scheduler-config: refused: ") and why in err, err


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"--url": "http://10.96.0.77:443"}, "expected https://ADDRESS:PORT"),
        ({"--url": "https://rdma-cni-scheduler-extender.kube-system.svc:443"}, "does not know Service names"),
        ({"--url": "https://x.kube-system.svc.cluster.local"}, "does not know Service names"),
        ({"--url": "https://10.96.0.77:443/extender"}, "no path"),
        ({"--client-key": "other_key"}, "do not go together"),
        ({"--ca": "key"}, "--ca: "),
        ({"--client-cert": "expired", "--client-key": "expired_key"}, "expired on 2021-01-01"),
        ({"--ca": "old_ca"}, "--ca"),
        ({"--ca": "/nonexistent/ca.crt"}, "cannot read --ca /nonexistent/ca.crt"),
    ],
)
def test_credentials_kube_scheduler_would_refuse_are_refused(
    creds: dict[str, str], change: dict[str, str], why: str
) -> None:
    args = {"--url": URL, "--ca": creds["ca"], "--client-cert": creds["cert"], "--client-key": creds["key"]}
    args.update({k: creds.get(v, v) for k, v in change.items()})
    code, out, err = run([x for kv in args.items() for x in kv])
    assert (code, out) == (1, "")
    assert why in err, err


def test_a_ca_bundle_with_an_expired_ca_beside_a_live_one_is_written_with_a_warning(
    creds: dict[str, str], tmp_path: Path
) -> None:
    bundle = tmp_path / "bundle.crt"
    bundle.write_bytes(Path(creds["old_ca"]).read_bytes() + Path(creds["ca"]).read_bytes())
    code, _, err = run(
        ["--url", URL, "--ca", str(bundle), "--client-cert", creds["cert"], "--client-key", creds["key"]]
    )
    assert code == 0 and "warning: --ca" in err and "a certificate ends on 2021-01-01" in err


def test_certificates_ending_within_30_days_are_written_with_a_warning(
    creds: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(schedconfig, "EXPIRY_WARNING", 30 * 86400)  # the test CAs end in 30 days
    code, out, err = render(creds)
    assert code == 0 and out
    assert "warning: --ca" in err and "warning: --client-cert" in err


def test_a_ca_openssl_cannot_use_is_refused(creds: dict[str, str], tmp_path: Path) -> None:
    """A certificate whose validity reads but which OpenSSL refuses (no signature): kube-scheduler's Go
    would not parse it either."""
    from rdma_cni.extender import certs

    text = Path(creds["ca"]).read_text()
    der = base64.b64decode("".join(text.split("-----")[2].split()))
    _, start, _ = certs._item(der, 0, "ca")
    _, _, tbs_end = certs._item(der, start, "ca")
    _, _, algo_end = certs._item(der, tbs_end, "ca")
    body = der[start:algo_end]  # tbsCertificate and the algorithm, without the signature
    cut = b"\x30\x82" + len(body).to_bytes(2, "big") + body
    pem = tmp_path / "cut.crt"
    pem.write_text(
        "-----BEGIN CERTIFICATE-----\n" + base64.encodebytes(cut).decode() + "-----END CERTIFICATE-----\n"
    )
    code, _, err = run(
        ["--url", URL, "--ca", str(pem), "--client-cert", creds["cert"], "--client-key", creds["key"]]
    )
    assert code == 1 and "no CA certificate kube-scheduler could use" in err


def test_inputs_are_bounded(creds: dict[str, str], tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (1024 * 1024 + 1))
    code, _, err = render(creds, "--merge", str(big))
    assert code == 1 and "over 1048576 bytes" in err
    unreadable = tmp_path / "garbage.crt"
    unreadable.write_text(
        "-----BEGIN CERTIFICATE-----\nMAIwAA==\n-----END CERTIFICATE-----\n" + Path(creds["ca"]).read_text()
    )
    code, _, err = run(
        ["--url", URL, "--ca", str(unreadable), "--client-cert", creds["cert"], "--client-key", creds["key"]]
    )
    assert code == 1 and "no validity" in err


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--remove"], "--remove needs --merge"),
        (["--remove", "--merge", "x", "--url", URL], "--remove takes no --url"),
        (["--url", URL], "are required (or --remove)"),
        (
            ["--url", URL, "--ca", "a", "--client-cert", "b", "--client-key", "c", "--http-timeout", "0"],
            "from 0 to 600",
        ),
    ],
)
def test_usage_errors(argv: list[str], why: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, _ = run(argv)
    assert code == 2 and why in capsys.readouterr().err


def test_the_stanza_is_what_the_module_says() -> None:
    """stanza() builds from its arguments only: two calls never share a mutable part."""
    one = schedconfig.stanza(URL, "n", b"a", b"b", b"c", 10)
    two = schedconfig.stanza(URL, "n", b"a", b"b", b"c", 10)
    one["managedResources"].append({})
    assert copy.deepcopy(two)["managedResources"] == [
        {"name": "rdma-cni.io/vf", "ignoredByScheduler": False},
        {"name": "rdma-cni.io/bandwidth", "ignoredByScheduler": False},
    ]
