"""``rdma-cni nodes``: the cluster as the scheduler extender sees it, for operators.

Lists Nodes (metadata only, as the extender's cache does), decodes each
node's published state and prints per PF the free bandwidth and VFs, the
state's age, and with ``--fits`` whether and where a pod's request would be
placed. Verdicts come from the extender's own :class:`Decider` (the same
views, staleness rule and placement search), so ``nodes --fits`` and the
extender's filter agree on the same states. Reservations the extender holds
in memory for binds not yet published are not visible here.

What it prints comes from every node's agent and from the API server: the
table escapes every cell (no control character, escape sequence or newline
reaches the terminal, so one row stays one row), error text is bounded and
escaped, and ``--json`` is JSON with every non-ASCII character escaped.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from typing import Any, TextIO

from rdma_cni.cni.errors import CniError, InvalidPodRequest
from rdma_cni.extender.decide import Decider, NodeView
from rdma_cni.extender.demand import Demand
from rdma_cni.shared import nodestate, placement
from rdma_cni.shared.podrequest import PodRequest, parse_request
from rdma_cni.shared.quote import bounded, escape

__all__ = ["NODES", "demand_of", "judge", "main", "parser", "render_table", "report"]

NODES = "/api/v1/nodes"
PROG = "rdma-cni nodes"
# An error printed (the API server's text among it) is cut to this many characters.
_MAX_ERROR = 1000


def _fits(value: str) -> PodRequest:
    try:
        return parse_request(value, "--fits")
    except InvalidPodRequest as exc:
        raise argparse.ArgumentTypeError(exc.msg) from exc


def demand_of(request: PodRequest | None, network: str | None) -> Demand | None:
    """The demand ``--fits`` asks about: on ``--network``'s PFs (and rails) when given, as the
    extender judges a pod selecting that network; else on every PF of the node."""
    if request is None:
        return None
    if network is None:
        return Demand.of(request, "--fits")
    return Demand.joint([(network, request, "--fits")])


def _age(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not number > 0 or number == float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive number of seconds")
    return number


def parser() -> argparse.ArgumentParser:
    """The subcommand's options."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Per node: each PF's free bandwidth and VFs from the published node state, "
        "and whether a request would fit (the scheduler extender's placement).",
    )
    p.add_argument(
        "--fits",
        type=_fits,
        metavar="JSON",
        help="a pod request as in its annotation, e.g. '[{\"min_tx_rate\": 10000}]'",
    )
    p.add_argument(
        "--network",
        metavar="NAME",
        help="judge --fits as an attachment of this network: on its PFs and their rails "
        "(needed for requests that name a rail)",
    )
    p.add_argument("--json", action="store_true", help="print JSON for scripts instead of a table")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: the in-cluster service account)")
    p.add_argument(
        "--max-state-age",
        type=_age,
        default=None,
        metavar="SECONDS",
        help="states older than this are stale (as the extender's option of that name; off by default)",
    )
    return p


def _state_kind(text: str | None, view: NodeView, stale: bool) -> str:
    if text is None:
        return "missing"
    if view.state is None:
        return "invalid"
    return "stale" if stale else "ok"


def judge(
    decider: Decider, view: NodeView, demand: Demand, now: float
) -> tuple[bool, str, int, list[dict[str, Any]] | None]:
    """(fits, reason, score, placement) for ``demand`` on a node, as the extender's filter judges it.

    The placement lists ``{"pf", "vfs", "min_tx_rate"}`` per PF used; None when the
    node does not fit (or the bind-sized search found no assignment).
    """
    # The extender's per-node rules, then the fit: filter's own decision, for one node holding nothing more.
    verdict = decider.admit(demand, view, now)
    if not verdict.fits:
        return False, verdict.reason, 0, None
    try:
        use = decider.use(demand, view)
    except placement.NoFit:
        return True, "", verdict.score, None
    return True, "", verdict.score, [{"pf": pf, "vfs": vfs, "min_tx_rate": rate} for pf, vfs, rate in use]


def report(
    items: list[Mapping[str, Any]],
    *,
    now: float,
    demand: Demand | None = None,
    max_state_age: float | None = None,
    annotation: str = nodestate.ANNOTATION,
) -> dict[str, Any]:
    """The ``--json`` document for listed Node objects (metadata is all that is read)."""
    decider = Decider(max_state_age=max_state_age)
    nodes = []
    for item in items:
        meta = item.get("metadata") or {}
        name = meta.get("name") or ""
        if not isinstance(name, str):
            name = json.dumps(name)[:64]  # not a Node the API server would list: shown, never trusted
        annotations = meta.get("annotations") or {}
        raw = annotations.get(annotation) if isinstance(annotations, dict) else None
        text = raw if isinstance(raw, str) else None
        view = decider.view(text)
        state = view.state
        stale = state is not None and max_state_age is not None and now - view.updated > max_state_age
        entry: dict[str, Any] = {
            "name": name,
            "state": _state_kind(text, view, stale),
            "problem": decider.unusable(view, now),
            "updated": state.updated if state else None,
            "age_seconds": round(max(0.0, now - view.updated), 1) if state and view.updated else None,
            "generation": state.generation if state else None,
            "pfs": [
                {
                    "name": pf.name,
                    "numa_node": pf.numa_node,
                    "capacity_mbps": pf.capacity_tx_rate,
                    "used_mbps": pf.used_tx_rate,
                    "free_mbps": pf.free_tx_rate,
                    "capacity_vfs": pf.capacity_vfs,
                    "used_vfs": pf.used_vfs,
                    "free_vfs": pf.free_vfs,
                }
                for pf in (state.pfs if state else ())
            ],
        }
        if demand is not None:
            fits, reason, score, where = judge(decider, view, demand, now)
            entry["fits"] = {"fits": fits, "reason": reason, "score": score, "placement": where}
        nodes.append(entry)
    nodes.sort(key=lambda n: n["name"])
    doc: dict[str, Any] = {"max_state_age": max_state_age, "nodes": nodes}
    if demand is not None:
        doc["request"] = [
            {
                "min_tx_rate": r.min_tx_rate,
                "max_tx_rate": r.max_tx_rate,
                **({"pf": r.pf} if r.pf is not None else {}),
                **({"rail": r.rail} if r.rail is not None else {}),
            }
            for r in demand.requests
        ]
        if any(demand.different_pfs):
            doc["different_pfs"] = True
        if demand.networks:
            doc["network"] = demand.networks[0][0]
        doc["fitting_nodes"] = [n["name"] for n in nodes if n["fits"]["fits"]]
    return doc


def _age_text(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.0f}h"


def _fits_text(fits: Mapping[str, Any]) -> str:
    if not fits["fits"]:
        return "no: " + str(fits["reason"]).removeprefix("rdma-cni: ")
    where = fits["placement"]
    if not where:
        return f"yes (score {fits['score']})"
    on = ", ".join(f"{p['pf']} x{p['vfs']}" for p in where)
    return f"yes (score {fits['score']}): {on}"


def render_table(doc: Mapping[str, Any]) -> str:
    """The report as aligned columns: one row per PF, a node without a usable state on one row."""
    with_fits = "request" in doc
    header = ["NODE", "STATE", "AGE", "PF", "FREE_MBPS", "FREE_VFS"] + (["FITS"] if with_fits else [])
    rows: list[list[str]] = []
    for node in doc["nodes"]:
        note = str(node["problem"]).removeprefix("rdma-cni: ")
        fits = _fits_text(node["fits"]) if with_fits else ""
        first = [node["name"], node["state"], _age_text(node["age_seconds"])]
        if not node["pfs"]:
            rows.append([*first, "-", "-", "-"] + ([fits] if with_fits else [note]))
            continue
        for i, pf in enumerate(node["pfs"]):
            free = "?" if pf["free_mbps"] is None else f"{pf['free_mbps']}/{pf['capacity_mbps']}"
            cells = first if i == 0 else ["", "", ""]
            extra = (fits if with_fits else note) if i == 0 else ""
            rows.append([*cells, pf["name"], free, f"{pf['free_vfs']}/{pf['capacity_vfs']}", extra])
    if not with_fits:
        # The last column holds problems (a node without a usable state); absent when there are none.
        if any(r[-1] for r in rows):
            header.append("NOTE")
        else:
            rows = [r[:-1] for r in rows]
    # Node names come from the API server, PF names from each agent (the kernel allows escape
    # sequences in an interface name), reasons quote both: every cell is escaped.
    rows = [[escape(cell) for cell in r] for r in rows]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for r in [header, *rows]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return "\n".join(lines) + "\n"


def main(argv: list[str], out: TextIO) -> int:
    """Entry point of ``rdma-cni nodes``: 0 printed, 1 the API could not be used, 2 bad options."""
    args = parser().parse_args(argv)
    from rdma_cni.kube import client as kubeapi

    try:
        client = kubeapi.ApiClient.from_kubeconfig(args.kubeconfig)
    except CniError as exc:
        sys.stderr.write(f"{PROG}: {bounded(exc.msg, _MAX_ERROR)}\n")
        return 1
    try:
        with client:
            doc = client.list(NODES, metadata_only=True)
    except kubeapi.ApiError as exc:
        sys.stderr.write(
            f"{PROG}: cannot list nodes at {client.server}: {bounded(exc.message, _MAX_ERROR)}\n"
        )
        return 1
    result = report(
        doc.get("items") or [],
        now=Decider().now(),
        demand=demand_of(args.fits, args.network),
        max_state_age=args.max_state_age,
    )
    # ensure_ascii (json's default): escapes, control characters and newlines stay inside JSON strings.
    out.write(json.dumps(result, indent=2, ensure_ascii=True) + "\n" if args.json else render_table(result))
    out.flush()
    return 0
