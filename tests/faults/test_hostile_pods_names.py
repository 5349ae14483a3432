"""The fault tier's hostile node-state names (issue 29, item 7), in the family "hostile pods".

Node states are published to the API stand-in with names no agent should
write, seeded: escape sequences that set a terminal's title or clear it, a
newline followed by a forged table row, names of 60,000 characters, unicode
(bidirectional overrides, line separators, C1 controls, characters whose
UTF-8 the kernel calls whitespace), lone surrogates, and names breaking their
Kubernetes rules, in any name field of either version. The built extender's
filter and the built ``rdma-cni nodes`` (table, ``--json``, ``--fits``) read
them. Invariants: a state with a name outside its rule is refused (no node
passes on it, its reason says so); no control character, escape sequence or
newline reaches an answer or a terminal; one node prints as its own rows and
no more; ``--json`` names what was published, exactly; every reason is
bounded, whatever the name's size.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rdma_cni.shared import nodestate
from tests.faults.knobs import SEED, STATS, scaled
from tests.integration.conftest import plugin_command
from tests.support import sched_objects as so
from tests.support.apiserver import ApiServer

if not os.environ.get("RDMA_CNI_BINARY"):
    pytest.skip(
        "the fault tier drives the built binary (make faults sets RDMA_CNI_BINARY)", allow_module_level=True
    )

FAMILY = "hostile pods"
ANNOTATION = "rdma_interfaces_required"
STATES = 40
# A reason quotes a value in at most 64 characters, each escaped in at most 10, plus the rule.
MAX_REASON = 1200

HOSTILE = [
    "\x1b]0;pwned\x07",  # sets the terminal's title (kernel-valid: no whitespace)
    "\x1b[2J\x1b[H",  # clears the screen (kernel-valid)
    "a\nnode-x  ok  0s  ens9  99999/99999  64/64",  # a forged row
    "\x1b[31m\r\n",
    "x" * 60_000,
    "\u202eeth0",  # right-to-left override (kernel-valid)
    "\u2028",  # line separator (kernel-valid)
    "\x9b2J",  # C1 CSI (kernel-valid)
    "é" * 8,  # 16 bytes
    "à",  # 0xa0 in its UTF-8: whitespace to the kernel
    "Ünïcødé",
    "a b",
    "..",
    "a/b",
    "a:b",
    "nul\x00",
    "\udc80",
    "",
    "RDMA_A",
    "-x",
]
FIELDS = ("pf", "network", "rail", "namespace", "pod", "uid", "updated")
# PF names the kernel allows although no terminal should print them raw: such states are valid.
KERNEL_VALID = ["\x1b]0;pwned\x07", "\x1b[2J\x1b[H", "\u202eeth0", "\u2028", "\x9b2J", "é" * 7, "\x1b[8m\x7f"]


def _base(version: int) -> dict[str, Any]:
    updated = so.stamp()
    if version == 2:
        return {
            "version": 2,
            "generation": 1,
            "updated": updated,
            "pfs": [["ens1f0", 100_000, 0, 8, 1, 0], ["ens1f1", 100_000, 0, 8, 0, 0]],
            "networks": [["rdma-a", [[0, "rail-0"], [1, "rail-1"]]]],
            "allocations": [["team-a", "pod-0", "6f0d93e4-5d3a-4c4b-9a1e-2f7c0b8e1d55", [0, 0, 0]]],
        }
    pf = {"capacity_tx_rate": 100_000, "used_tx_rate": 0, "capacity_vfs": 8, "numa_node": 0}
    return {
        "version": 1,
        "generation": 1,
        "updated": updated,
        "pfs": [{"name": "ens1f0", "used_vfs": 1, **pf}, {"name": "ens1f1", "used_vfs": 0, **pf}],
        "allocations": [
            {
                "namespace": "team-a",
                "name": "pod-0",
                "uid": "u-0",
                "interfaces": [{"pf": "ens1f0", "min_tx_rate": 0, "max_tx_rate": 0}],
            }
        ],
    }


def _set(doc: dict[str, Any], field: str, value: str) -> None:
    """Put ``value`` in ``field`` of a state document (both of a v1 PF's mentions)."""
    if doc["version"] == 2:
        row = doc["allocations"][0]
        places = {
            "pf": (doc["pfs"][1], 0),
            "network": (doc["networks"][0], 0),
            "rail": (doc["networks"][0][1][0], 1),
            "namespace": (row, 0),
            "pod": (row, 1),
            "uid": (row, 2),
            "updated": (doc, "updated"),
        }
        target, key = places[field]
        target[key] = value
        return
    alloc = doc["allocations"][0]
    if field == "pf":
        doc["pfs"][0]["name"] = value
        alloc["interfaces"][0]["pf"] = value
    elif field in ("namespace", "pod", "uid"):
        alloc[{"namespace": "namespace", "pod": "name", "uid": "uid"}[field]] = value
    else:  # the updated stamp; version 1 has no networks or rails, so it takes their values too
        doc["updated"] = value


def _states(rng: random.Random, count: int) -> dict[str, str]:
    """Node name -> annotation text: each state with one to three hostile names."""
    out = {}
    for i in range(count):
        doc = _base(rng.choice([1, 2]))
        if rng.random() < 0.4:  # valid, with a PF name every printer must escape
            _set(doc, "pf", rng.choice(KERNEL_VALID))
            out[f"h{i}"] = json.dumps(doc)
            continue
        for _ in range(rng.randint(1, 3)):
            _set(doc, rng.choice(FIELDS), rng.choice(HOSTILE))
        out[f"h{i}"] = json.dumps(doc)
    return out


def _valid(text: str) -> nodestate.NodeState | None:
    try:
        return nodestate.decode(text)
    except nodestate.NodeStateError:
        return None


def _tame(text: str, limit: int) -> str:
    """Why ``text`` is not bounded, one line and printable ("" when it is)."""
    if len(text) > limit:
        return f"{len(text)} characters (bound {limit})"
    bad = [c for c in text if not c.isprintable()]
    return f"unescaped {bad[:3]!r}" if bad else ""


@pytest.fixture
def api() -> Iterator[ApiServer]:
    with ApiServer() as server:
        yield server


def _extender(tmp: Path, api: ApiServer) -> tuple[subprocess.Popen[str], int]:
    kubeconfig = api.write_kubeconfig(tmp / "kubeconfig")
    cmd = [
        *plugin_command(),
        "scheduler-extender",
        "--listen",
        "127.0.0.1:0",
        "--kubeconfig",
        str(kubeconfig),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, "the extender did not start"
    port = int(json.loads(line)["listening"].rsplit(":", 1)[1])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/readyz")
        ready = conn.getresponse().status == 200
        conn.close()
        if ready:
            return proc, port
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("the extender never became ready")


def _filter(port: int, pod: dict[str, Any], names: list[str]) -> tuple[dict[str, Any], int, str]:
    """The answer, its size, and what is wrong with its bytes ("" when nothing)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/filter", body=json.dumps(so.args_names(pod, names)))
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    assert resp.status == 200, raw[:300]
    try:
        return json.loads(raw.decode()), len(raw), ""
    except UnicodeDecodeError as exc:
        return json.loads(raw.decode(errors="replace")), len(raw), f"not UTF-8 ({exc.reason})"


def _nodes(kubeconfig: str, *args: str) -> tuple[int, str, str]:
    proc = subprocess.run(
        [*plugin_command(), "nodes", "--kubeconfig", kubeconfig, *args],
        capture_output=True,
        timeout=60,
        check=False,
    )
    # A byte that is not UTF-8 shows as U+FFFD, which the checks below count as a violation.
    return proc.returncode, proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")


def test_hostile_node_state_names(tmp_path: Path, api: ApiServer) -> None:
    stats: Counter[str] = STATS.setdefault(FAMILY, Counter())
    rng = random.Random(f"{SEED}:hostile-names")
    states = _states(rng, scaled(STATES))
    states["good"] = json.dumps(_base(2))
    for name, text in states.items():
        api.add_node(name, annotations={nodestate.ANNOTATION: text})
    valid = {name: _valid(text) for name, text in states.items()}
    stats["inputs"] += len(states) - 1
    problems: list[str] = []

    # An independent look at the rule: nothing with a newline, whitespace or over 15 bytes decodes.
    for name, state in valid.items():
        for pf in state.pfs if state else ():
            raw = pf.name.encode("utf-8")
            if len(raw) > 15 or any(b in b" \t\n\r\v\f\xa0/:" for b in raw):
                problems.append(f"{name}: PF name {pf.name[:40]!r} decoded")

    proc, port = _extender(tmp_path, api)
    try:
        names = sorted(states)
        for rates in ([(0, 0)], [(1_000_000, 0)]):  # fits every valid node; fits none (reasons name PFs)
            answer, size, broken = _filter(port, so.rdma_pod("p", rates), names)
            if broken:
                problems.append(f"filter {rates}: the answer is {broken}")
            stats["cycles"] += 1
            stats["runs"] += 1
            passed = set(answer.get("NodeNames") or [])
            # An invalid state cannot be helped by preemption: unresolvable.
            failed = {**(answer.get("FailedNodes") or {}), **(answer.get("FailedAndUnresolvableNodes") or {})}
            if size > len(names) * (MAX_REASON + 64) + 1024:
                problems.append(f"filter {rates}: answer of {size} bytes for {len(names)} nodes")
            for name in names:
                if valid[name] is None and name in passed:
                    problems.append(f"filter {rates}: {name} passed on an invalid state")
                if valid[name] is None and not str(failed.get(name, "")).startswith(
                    "rdma-cni: invalid node state"
                ):
                    problems.append(
                        f"filter {rates}: {name} not refused as invalid: {failed.get(name)!r:.200}"
                    )
                if rates == [(0, 0)] and valid[name] is not None and name not in passed:
                    problems.append(f"filter {rates}: valid {name} refused: {failed.get(name)!r:.200}")
            for name, reason in failed.items():
                why = _tame(str(reason), MAX_REASON)
                if why:
                    problems.append(f"filter {rates}: reason for {name}: {why}")
        assert proc.poll() is None, "the extender died"
    finally:
        proc.kill()
        proc.wait(10)

    kubeconfig = str(api.write_kubeconfig(tmp_path / "kubeconfig-nodes"))
    rows = 1 + sum(max(1, len(state.pfs)) if state else 1 for state in valid.values())
    for args in ((), ("--fits", '[{"min_tx_rate": 1000000}]')):
        code, out, err = _nodes(kubeconfig, *args)
        stats["cycles"] += 1
        stats["runs"] += 1
        if code != 0 or err:
            problems.append(f"nodes {args}: exit {code}, stderr {err[:200]!r}")
        lines = out.split("\n")
        if lines[-1] != "" or len(lines) - 1 != rows:
            problems.append(f"nodes {args}: {len(lines) - 1} lines for {rows} rows")
        for line in lines:
            why = _tame(line, 4 * MAX_REASON) or ("not UTF-8" if "\ufffd" in line else "")
            if why:
                problems.append(f"nodes {args}: a line: {why}")
    code, out, _ = _nodes(kubeconfig, "--json")
    stats["cycles"] += 1
    stats["runs"] += 1
    if not out.isascii():
        problems.append("nodes --json: not ASCII (a raw character escaped nothing)")
    published = {n["name"]: n for n in json.loads(out)["nodes"]}
    for name, state in valid.items():
        got = published[name]
        expected = [pf.name for pf in state.pfs] if state else []
        if [pf["name"] for pf in got["pfs"]] != expected or got["state"] != ("ok" if state else "invalid"):
            problems.append(
                f"nodes --json: {name} shows {got['state']} {[pf['name'] for pf in got['pfs']]!r:.100}"
            )

    stats["violations"] += len(problems)
    assert not problems, "\n".join(problems[:20])
