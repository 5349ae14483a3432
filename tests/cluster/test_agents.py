"""Node agents live with the real API server: three publish through the admission policy, resync
after kube-apiserver restarts, and win back their annotation after a conflicting write.

Needs root (the simulated nodes' veth VFs).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

import pytest

from rdma_cni.shared import nodestate
from tests.cluster.conftest import unique
from tests.support.kube.agents import Agent, start_agent, stop_agent
from tests.support.kube.controlplane import ControlPlane
from tests.support.simnode import SimPf
from tests.support.waiting import wait_for

if os.geteuid() != 0:
    pytest.skip("the simulated nodes need root (veth)", allow_module_level=True)

HEARTBEAT = 3.0
LAYOUTS = [
    [SimPf("simpf0", 4, 25000)],
    [SimPf("simpf0", 2, 10000), SimPf("simpf1", 2, 25000)],
    [SimPf("simpf0", 8, 100000)],
]


def published(cp: ControlPlane, node: str) -> nodestate.NodeState | None:
    annotations = cp.get("node", node)["metadata"].get("annotations") or {}
    text = annotations.get(nodestate.ANNOTATION)
    try:
        return nodestate.decode(text) if text else None
    except nodestate.NodeStateError:
        return None


@pytest.fixture(scope="module")
def agents(applied: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Agent]]:
    started: list[Agent] = []
    base = tmp_path_factory.mktemp("agents")
    try:
        for k, layout in enumerate(LAYOUTS):
            name = unique(f"agent{k}")
            prefix = f"k{k}{os.getpid() % 10000:04d}"
            started.append(start_agent(applied, str(base / name), name, layout, prefix, HEARTBEAT))
        yield started
    finally:
        for agent in started:
            stop_agent(applied, agent)


def test_three_agents_publish_their_nodes_through_the_policy(
    applied: ControlPlane, agents: list[Agent]
) -> None:
    for agent, layout in zip(agents, LAYOUTS, strict=True):
        state = wait_for(lambda a=agent: published(applied, a.name), 60, f"{agent.name}'s state")
        assert [(p.name, p.capacity_tx_rate, p.capacity_vfs) for p in state.pfs] == [
            (pf.name, pf.speed, pf.num_vfs) for pf in layout
        ]
        assert agent.process.alive()


def test_agents_resync_after_the_api_server_restarts(applied: ControlPlane, agents: list[Agent]) -> None:
    before = {a.name: wait_for(lambda a=a: published(applied, a.name), 60, "a state") for a in agents}
    applied.restart_apiserver()
    # Each agent writes again (its heartbeat) once the server is back, continuing its generations.
    for agent in agents:
        state = wait_for(
            lambda a=agent: (
                (s := published(applied, a.name)) and s.generation > before[a.name].generation and s
            ),
            60,
            f"{agent.name} to publish after the restart",
        )
        assert nodestate.same_content(state, before[agent.name])
        assert agent.process.alive()


def test_an_agent_wins_back_its_annotation_after_a_conflicting_write(
    applied: ControlPlane, agents: list[Agent]
) -> None:
    agent = agents[0]
    mine = wait_for(lambda: published(applied, agent.name), 60, "a state")
    # Another writer (an admin, a stale agent) leaves a state with no PFs.
    other = nodestate.encode(
        dataclasses.replace(mine, generation=10_000, pfs=(), networks=(), allocations=())
    )
    applied.kubectl("annotate", "node", agent.name, "--overwrite", f"{nodestate.ANNOTATION}={other}")
    state = wait_for(
        lambda: (s := published(applied, agent.name)) and s.pfs and s, 30, "the agent to rewrite its state"
    )
    assert nodestate.same_content(state, mine)
    assert agent.process.alive()
