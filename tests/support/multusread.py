"""Multus' own reading of network annotations, for differential tests of rdma_cni.shared.multusnet.

``gobuild/multusread`` is a small Go program of ours that calls Multus'
``k8sclient.GetPodNetwork`` (the module pinned in its go.mod). :func:`binary`
builds it once with Go 1.26 (``-trimpath``, ``-mod=readonly``: the tree's go.sum
is never rewritten) into ``/var/cache/rdma-cni-build/multusread-<hash of go.mod,
go.sum, main.go>/``, a no-op when it is there; the first build downloads the
module through the Go module proxy. :func:`hand_cases` and :func:`fuzz_cases`
are the annotations fed to both readers; :func:`compare` states the rule.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rdma_cni.shared.multusnet import (
    MultusFails,
    UnreadableNetworks,
    read_default_network,
    read_networks,
)

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "gobuild" / "multusread"
GO = "/usr/local/go/bin/go"
CACHE = Path("/var/cache/rdma-cni-build")
MULTUS_NAMESPACE = "kube-system"


def source_hash() -> str:
    """Hash of the program's inputs: a new go.mod, go.sum or main.go is a new build."""
    digest = hashlib.sha256()
    for name in ("go.mod", "go.sum", "main.go"):
        digest.update(name.encode() + b"\0" + (SOURCE / name).read_bytes())
    return digest.hexdigest()[:16]


def binary() -> Path:
    """The built program; built under a lock so parallel runs build it once."""
    out_dir = CACHE / f"multusread-{source_hash()}"
    program = out_dir / "multusread"
    if program.exists():
        return program
    version = subprocess.run([GO, "version"], capture_output=True, text=True, check=False).stdout
    if " go1.26" not in version:
        raise RuntimeError(f"{GO} must be Go 1.26 (the machine's toolchain), got: {version.strip()!r}")
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".multusread.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if program.exists():
            return program
        tmp = Path(tempfile.mkdtemp(prefix="multusread-", dir=CACHE))
        env = {
            **os.environ,
            "PATH": f"/usr/local/go/bin:{os.environ.get('PATH', '')}",
            "GOTOOLCHAIN": "local",
            "GOFLAGS": "-mod=readonly -buildvcs=false",
        }
        try:
            subprocess.run(
                [GO, "build", "-trimpath", "-o", str(tmp / "multusread"), "."],
                cwd=SOURCE,
                env=env,
                check=True,
                capture_output=True,
                timeout=1800,
            )
            tmp.rename(out_dir)
        except subprocess.CalledProcessError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(f"building multusread failed: {exc.stderr.decode()[-2000:]}") from None
    return program


@dataclass(frozen=True)
class Case:
    """One pod's annotations: networks and default-network (None: not set)."""

    networks: str | None
    default_network: str | None = None
    namespace: str = "team-a"


def multus(cases: list[Case]) -> list[dict[str, Any]]:
    """Multus' answer for each case, in order (see gobuild/multusread/main.go)."""
    lines = []
    for case in cases:
        doc: dict[str, Any] = {"namespace": case.namespace, "multus_namespace": MULTUS_NAMESPACE}
        if case.networks is not None:
            doc["networks"] = case.networks
        if case.default_network is not None:
            doc["default_network"] = case.default_network
        lines.append(json.dumps(doc))
    done = subprocess.run(
        [str(binary())],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    answers = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(answers) == len(cases), done.stderr[-2000:]
    return answers


def ours(case: Case) -> dict[str, Any]:
    """Our reader's answer in the program's shape: ok+selections, "fails", or "refuses" (with doubt)."""

    def one(read: Any) -> dict[str, Any]:
        try:
            reading = read()
        except MultusFails as exc:
            return {"ok": False, "fails": str(exc)}
        except UnreadableNetworks as exc:
            return {"ok": False, "refuses": exc.msg}
        if reading is None:
            return {"ok": True, "selections": []}
        sels = [
            {"namespace": s.namespace, "name": s.name, "interface": s.interface, "cni_args": s.cni_args}
            for s in reading.selections
        ]
        return {"ok": True, "selections": sels, "doubt": reading.doubt}

    out = {"networks": one(lambda: read_networks(case.networks, case.namespace))}
    if case.default_network is not None:
        out["default_network"] = one(lambda: read_default_network(case.default_network, MULTUS_NAMESPACE))
    return out


def disagreement(case: Case, mine: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """None when our reading is allowed next to Multus', else what differs.

    Allowed: the same selections (namespace, name, interface, cni-args); a
    refusal; a doubt (the pod is then refused when it selects an rdma-cni
    network). When Multus errors, ours must fail or refuse (select nothing).
    """
    for key in ("networks", "default_network"):
        a, b = mine.get(key), theirs.get(key)
        if b is None:
            continue
        if "refuses" in a or a.get("doubt"):
            continue
        if not b["ok"]:
            if a["ok"]:
                return f"{key}: Multus errors ({b['error'][:200]}), ours selects {a['selections']}"
            continue
        if not a["ok"]:
            return f"{key}: ours fails ({a['fails']}), Multus selects {b['selections']}"
        if a["selections"] != b["selections"]:
            return f"{key}: ours {a['selections']} != Multus {b['selections']}"
    return None


def hand_cases() -> list[Case]:
    """The issue's forms and Multus' own edge cases, by hand."""
    deep = "[" * 3000 + "]" * 3000
    pad = " " * (70 * 1024)
    texts = [
        "rdma-a",
        " other/rdma-a@net2 , x ,",
        "a,,b",
        "rdma-a,",
        "/rdma-a",
        "ns/",
        "A",
        "rdma-a@",
        "rdma-a@x@y",
        "a/b/c",
        "rdma-a@net 1",
        "rdma-a@sixteen-chars-xx",
        "rdma-a@fifteen-chars-x",
        "rdma-a@a/b",
        "\x1crdma-a",
        "\u00a0rdma-a\u3000",
        "\u0085ns\u2028/rdma-a",
        "rdma-a\n",
        "null",
        "-rdma",
        "rdma-",
        "[]",
        "null ,[",
        '{"name": "rdma-a"}',
        '"rdma-a"',
        "[1]",
        "[null]",
        '[{"name": "rdma-a"}, null]',
        '[{"name": "rdma-a"}]',
        '[{"Name": "rdma-a", "CNI-ARGS": {"rdma_interfaces_required": "[{}]"}}]',
        '[{"NAME": "rdma-a", "NameSpace": "infra", "INTERFACE": "net5"}]',
        '[{"name": "rdma-a", "cni-arg\u017f": {"x": 1}}]',
        '[{"name": "rdma-a", "cni-args": {"\u212a": 1}, "\u212aey": 2}]',
        '[{"nam\u212a": "rdma-a"}]',
        '[{"name": "\u212aelvin"}]',
        '[{"name": "other", "name": "rdma-a"}]',
        '[{"name": "rdma-a", "name": null}]',
        '[{"name": "rdma-a", "cni-args": {"a": 1}, "cni-args": {"b": 2}}]',
        '[{"name": "rdma-a", "cni-args": {"a": 1}, "cni-args": null, "cni-args": {"b": 2}}]',
        '[{"name": "rdma-a", "cni-args": {"a": {"x": 1}}, "cni-args": {"a": {"y": 2}}}]',
        '[{"name": "rdma-a", "cni-args": {"a": 1, "a": 2}}]',
        '[{"name": "rdma-a", "cni-args": []}]',
        '[{"name": "rdma-a", "cni-args": "x"}]',
        '[{"name": 5}]',
        '[{"name": "rdma-a", "interface": 5}]',
        '[{"name": "rdma-a", "namespace": true}]',
        '[{"name": "rdma-a", "interfaceRequest": "net7"}]',
        '[{"name": "rdma-a", "interfaceRequest": "net7", "interface": "net8"}]',
        '[{"name": "rdma-a", "cni-args": {"n": 1e400}}]',
        '[{"name": "rdma-a", "cni-args": {"n": 1e-400}}]',
        '[{"name": "rdma-a", "cni-args": {"n": 12345678901234567890}}]',
        '[{"name": "rdma-a", "cni-args": {"n": 1e21, "m": 1e20, "k": -0, "f": 0.5}}]',
        '[{"name": "rdma-a", "unknown": 1e400}]',
        '[{"name": "rdma-a", "cni-args": {"n": NaN}}]',
        '[{"name": "rdma-a", "unknown": Infinity}]',
        '[{"name": "rdma-a\\ud800"}]',
        '[{"name": "rdma-a", "cni-args": {"s": "\\ud800\\ud83d\\ude00"}}]',
        '[{"name": "rdma-a"}] x',
        '[{"name": "rdma-a",}]',
        '[{"name": "rdma-a"}]\n\t ',
        '\ufeff[{"name": "rdma-a"}]',
        '[{"name": "rdma-a", "x": ' + "[" * 3000 + "]" * 3000 + "}]",
        '[{"name": "rdma-a", "x": ' + "[" * 10001 + "]" * 10001 + "}]",
        '[{"name": "rdma-a", "x": ' + "[" * 500 + "]" * 500 + "}]",
        deep,
        '[{"name": "rdma-a"}]' + pad,
        pad + "rdma-a",
        '[{"name": "rdma-a", "mac": "02:00:00:00:00:01"}]',
        '[{"name": "rdma-a", "mac": "not-a-mac"}]',
        '[{"name": "rdma-a", "mac": 5}]',
        '[{"name": "rdma-a", "infiniband-guid": "00:11:22:33:44:55:66:77"}]',
        '[{"name": "rdma-a", "ips": ["10.0.0.1/24", "fd00::1"]}]',
        '[{"name": "rdma-a", "ips": ["10.0.0.300"]}]',
        '[{"name": "rdma-a", "ips": "10.0.0.1"}]',
        '[{"name": "rdma-a", "ips": [1]}]',
        '[{"name": "rdma-a", "ips": [null]}]',
        '[{"name": "rdma-a", "ips": []}]',
        '[{"name": "rdma-a", "portMappings": [{"hostPort": 1.5}]}]',
        '[{"name": "rdma-a", "bandwidth": null}]',
        '[{"name": "rdma-a", "default-route": ["10.0.0.1"]}]',
        '[{"name": "rdma-a", "deviceID": 3}]',
        '[{"name": "rdma-a", "mac": "0000.5e00.5301", "infiniband-guid": "00:11:22:33:44:55:66:77"}]',
        '[{"name": "rdma-a", "ips": ["10.0.0.1/24", "fd00::1"], "default-route": ["10.0.0.1", "", null]}]',
        '[{"name": "rdma-a", "bandwidth": {"ingressRate": 1, "X": 1.5}, '
        '"portMappings": [{"hostPort": 8}, null]}]',
        '[{"name": "rdma-a", "cni-args": {"x": ' + "[" * 800 + "]" * 800 + "}}]",
        # At the reader's bound (512 levels in all): read, and read as Multus reads it.
        '[{"name": "rdma-a", "cni-args": {"x": ' + "[" * 509 + "]" * 509 + "}}]",
        '[{"name": "rdma-a", "cni-args": {"x": ' + "[" * 510 + "]" * 510 + "}}]",
        '[{"name": "rdma-a", "bandwidth": {"ingressRate": 1.5}}]',
        '[{"name": "rdma-a", "portMappings": [{"protocol": 6}]}]',
        '[{"name": "rdma-a", "portMappings": {}}]',
        '[{"name": "rdma-a", "default-route": [5]}]',
        '[{"name": "rdma-a", "mac": "02:00:00:00:00"}]',
        '[{"Name": "rdma-a", "IPs": [null, "fe80::1%x"], "ips": []}]',
        '[{"Name": "rdma-a", "IPs": [5], "ips": []}]',
        '[{"name": "rdma-a", "bandwidth": {"egressBurst": 9223372036854775808}}]',
        '[{"name": "rdma-a", "bandwidth": {"egressBurst": -9223372036854775808}}]',
        ",".join(["rdma-a"] * 40),
        ",".join(["a"] * 1025),
        ",".join(["a"] * 1024),
        json.dumps([{"name": "rdma-a"}] * 40),
    ]
    cases = [Case(t) for t in texts]
    cases += [
        Case(None, "rdma-a"),
        Case(None, "infra/rdma-a@eth0"),
        Case("rdma-b", '[{"name": "rdma-a", "cni-args": {"rdma_interfaces_required": "[{}]"}}]'),
        Case(None, ""),
        Case(None, "[]"),
        Case(None, "rdma-a,rdma-b"),
        Case(None, "[null]"),
        Case(None, "A"),
        Case(None, '[{"Name": "rdma-a"}]'),
        Case("", None),
    ]
    return cases


_KEYS = [
    "name",
    "Name",
    "NAME",
    "nAmE",
    "namespace",
    "NameSpace",
    "interface",
    "Interface",
    "interfaceRequest",
    "cni-args",
    "CNI-ARGS",
    "cni-arg\u017f",
    "Cni-Args",
    "ips",
    "mac",
    "deviceID",
    "bandwidth",
    "portMappings",
    "PORTMAPPINGS",
    "Bandwidth",
    "default-route",
    "IPs",
    "infiniband-guid",
    "unknown",
    "nam\u212a",
    "\u212aey",
    "name ",
    "n\u0061me",
]
_NAMES = ["rdma-a", "rdma-b", "Rdma-a", "rdma-\u212a", "", " rdma-a", "x", "rdma_a", "a" * 70]
_ADDRESSES = [
    "10.0.0.1",
    "10.0.0.1/24",
    "fd00::1",
    "",
    None,
    5,
    "fe80::1%x",
    "010.0.0.1",
    "::ffff:1.2.3.4",
    "x",
]
_NUMBERISH = [80, 1.5, "80", None, 1e2, 9223372036854775807, 9223372036854775808, -0, True, "tcp"]
_SPACES = ["", " ", "\t", "\n", "\u00a0", "\x1c", "\u2003", "\u0085", "\u200b"]


def _value(rng: random.Random, key: str, depth: int = 0) -> Any:
    roll = rng.random()
    named = key.lower().startswith(("name", "nam")) or key in ("interface", "Interface", "interfaceRequest")
    if named and roll < 0.85:
        return (
            rng.choice(_NAMES) if "name" in key.lower() else rng.choice(["net1", "eth0", "", "a b", "x" * 20])
        )
    if ("arg" in key.lower() or key == "\u212aey") and roll < 0.8:
        return {
            rng.choice(["rdma_interfaces_required", "a", "A", "\u212a"]): _value(rng, "any", depth + 1)
            for _ in range(rng.randint(0, 3))
        }
    low = key.lower()
    if low in ("ips", "default-route") and roll < 0.8:
        return [rng.choice(_ADDRESSES) for _ in range(rng.randint(0, 2))]
    if low in ("portmappings", "bandwidth") and roll < 0.8:
        fields = [
            "hostPort",
            "containerPort",
            "protocol",
            "hostIP",
            "HOSTPORT",
            "ingressRate",
            "EgressBurst",
            "x",
        ]
        entry = {rng.choice(fields): rng.choice(_NUMBERISH) for _ in range(rng.randint(0, 3))}
        return [entry, None][: rng.randint(0, 2)] if low == "portmappings" else entry
    if low in ("mac", "infiniband-guid") and roll < 0.8:
        return rng.choice(["02:00:00:00:00:01", "02-00-00-00-00-01", "0200.0000.0001", "x", "", 5])
    choices = [None, True, 5, 1.5, "s", [], [1, "x", None], {"k": 1}, 1e300]
    if depth < 3 and rng.random() < 0.3:
        return {"n": _value(rng, "any", depth + 1)}
    return rng.choice(choices)


def _raw_json(rng: random.Random, value: Any) -> str:
    """JSON text with number forms json.dumps does not write (huge exponents, big integers)."""
    text = json.dumps(value, ensure_ascii=rng.random() < 0.5)
    if rng.random() < 0.1:
        text = text.replace("1e+300", rng.choice(["1e400", "1E+308", "123456789012345678901234567890", "-0"]))
    return text


def _element(rng: random.Random) -> str:
    pairs = []
    for _ in range(rng.randint(0, 4)):
        key = rng.choice(_KEYS)
        pairs.append(
            f"{json.dumps(key, ensure_ascii=rng.random() < 0.5)}: {_raw_json(rng, _value(rng, key))}"
        )
    if rng.random() < 0.1:
        depth = rng.choice([10, 900, 2000])
        pairs.append('"x": ' + "[" * depth + "]" * depth)
    return "{" + ", ".join(pairs) + "}"


def _comma_item(rng: random.Random) -> str:
    sp = lambda: rng.choice(_SPACES)  # noqa: E731
    item = rng.choice(["rdma-a", "rdma-b", "x", "-a", "a-", "A", "", "a.b", "1"])
    if rng.random() < 0.4:
        item = rng.choice(["ns", "", "NS", " ns", "a/b"]) + "/" + sp() + item
    if rng.random() < 0.3:
        item += "@" + sp() + rng.choice(["net1", "", "a b", "fifteen-chars-x", "sixteen-chars-xy", "a@b"])
    return sp() + item + sp()


def fuzz_cases(seed: int, count: int) -> Iterator[Case]:
    """Seeded variants: key cases and folds, repeats, nesting, padding, comma forms, type errors."""
    rng = random.Random(seed)
    for _ in range(count):
        roll = rng.random()
        if roll < 0.35:
            text = ",".join(_comma_item(rng) for _ in range(rng.randint(1, 4)))
        elif roll < 0.9:
            elements = [
                rng.choice([_element(rng), "null", "5", '"s"']) if rng.random() < 0.05 else _element(rng)
                for _ in range(rng.randint(0, 3))
            ]
            text = "[" + ", ".join(elements) + "]"
            if rng.random() < 0.05:
                text = text[: rng.randint(0, len(text))]
            if rng.random() < 0.05:
                text = text + " " * rng.choice([10, 70 * 1024])
        else:
            text = rng.choice(['{"name": "rdma-a"}', "5", '"rdma-a"', "true", "[", "rdma-a]", "[[]]"])
        default = None
        if rng.random() < 0.15:
            default = rng.choice(["rdma-a", "", "a,b", "[]", '[{"name": "rdma-a"}]', "ns/rdma-a@x", "[null]"])
        yield Case(text, default)
