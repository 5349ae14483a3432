"""The extender's filter and prioritize answers, byte for byte, pinned for one fixed sequence of requests.

The other tests of kept answers compare them with a full pass of today's code; a change that
alters both (how ranks, indexes or the encoding are built, the order of a map, a reason's text)
would pass them. This one replays a fixed sequence (random samples of the nodes in random order,
the same set reordered, republished states, reservations, holds, each request shape) through both
filter modes (``--best-nodes=1`` as conf/ ships it, and every fitting node with prioritize after)
and compares a digest of every answer's bytes with the digest the code gave when it was pinned.
A deliberate change of an answer updates :data:`PINNED` (and says why in its commit).
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

from rdma_cni.extender.decide import Decider, NodeView
from rdma_cni.extender.demand import Demands
from rdma_cni.extender.reservations import Reservations
from rdma_cni.extender.settings import Settings
from rdma_cni.extender.verbs import Extender
from rdma_cni.shared import nodestate
from tests.support import sched_objects as so

PFS = [("ens1f0", 25_000, 4), ("ens1f1", 25_000, 4), ("ens2f0", 100_000, 8)]
SHAPES = (
    [(5_000, 10_000)],
    [(15_000, 0)],
    [(10_000, 0), (10_000, 0)],
    [(0, 0)] * 3,
    [(40_000, 0)],
    [(60_000, 0), (20_000, 0)],
    [(20_000, 0)] * 4,
    [(90_000, 0)],
)
# sha256 of every answer of replay(), and how many answers: pinned 2026-11-28 on main at d042278.
PINNED = {
    1: ("4bf189a6db2135d394c440400a4532761b9a58269956980a3a5db8e93aaced7c", 400),
    0: ("79bc9f61f2e7f9288a505fbb077fd32d57141e6e1983b34d3713790f9a2da036", 800),
}


def random_state(rng: random.Random, uid: str) -> str:
    """A node state with a few pods, every PF within its VFs and bandwidth (as an agent publishes)."""
    used = {name: [0, 0] for name, _, _ in PFS}
    caps = {name: (cap, vfs) for name, cap, vfs in PFS}
    pods: list[so.PodUse] = []
    for i in range(rng.randint(0, 8)):
        pf = rng.choice(list(caps))
        rate = rng.choice((0, 2_000, 5_000, 10_000, 20_000))
        if used[pf][0] < caps[pf][1] and used[pf][1] + rate <= caps[pf][0]:  # type: ignore[operator]
            used[pf][0] += 1
            used[pf][1] += rate
            pods.append((f"{uid}-{i}", [(pf, rate, 0)]))
    return nodestate.encode(so.state(PFS, pods))


def replay(best_nodes: int) -> tuple[str, int]:
    """Every answer of the fixed sequence, as (sha256 of them all, how many)."""
    rng = random.Random(38)
    decider = Decider(settings=Settings(best_nodes=best_nodes))
    views: dict[str, NodeView] = {}
    generation = [1]
    ext = Extender(
        decider=decider,
        demands=Demands(annotation="rdma_interfaces_required"),
        # A fixed clock: no hold or reservation runs out however slowly the test runs.
        reservations=Reservations(600, clock=lambda: 0.0),
        cache_views=lambda: views,
        cache_generation=lambda: generation[0],
        settings=Settings(best_nodes=best_nodes),
    )
    ext.ready.set()
    names = [f"node-{i:04d}" for i in range(120)]
    for name in names:
        views[name] = decider.view(random_state(rng, name))
    views["node-0007"] = decider.view(None)  # no agent
    views["node-0008"] = decider.view("{not a state")
    known = names[:]
    names.append("node-9999")  # a node the cache does not know
    digest = hashlib.sha256()
    count = 0
    last: list[str] = []

    def out(answer: Any) -> None:
        nonlocal count
        body = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
        digest.update(len(body).to_bytes(4, "big") + body)
        count += 1

    for step in range(400):
        action = rng.random()
        name = rng.choice(known[9:])
        if action < 0.15:
            views[name] = decider.view(random_state(rng, f"{name}-{step}"))
            generation[0] += 1
        elif action < 0.3:
            ext.reservations.add(f"r{step}", "team-a", f"r{step}", name, (("ens2f0", 1, 10_000),))
        elif action < 0.35 and len(ext.reservations):
            ext.reservations.drop(rng.choice(ext.reservations.all()).uid, "test")
        if last and rng.random() < 0.4:
            sample = last[:]
            rng.shuffle(sample)  # the same nodes in another order, as kube-scheduler sends them
        else:
            sample = rng.sample(names, 40)
        last = sample
        pod = so.rdma_pod(f"p{step}", rng.choice(SHAPES))
        args = so.args_names(pod, sample)
        answer = ext.filter_encoded(args)
        out(answer)
        if not best_nodes and isinstance(answer, bytes):
            passed = json.loads(answer)["NodeNames"]
            out(ext.prioritize(so.args_names(pod, passed)))
    return digest.hexdigest(), count


def test_answers_are_the_pinned_bytes_with_best_nodes() -> None:
    assert replay(1) == PINNED[1]


def test_answers_are_the_pinned_bytes_with_every_fitting_node() -> None:
    assert replay(0) == PINNED[0]
