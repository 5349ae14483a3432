"""ADD's steps: each has do, undo and check; perform, rollback and CHECK are loops over one list."""

from __future__ import annotations

import pytest

from rdma_cni.cni.errors import KernelError
from rdma_cni.cni.protocol import Result
from rdma_cni.node import attach
from rdma_cni.node.attach import STEPS, Context, Progress, Step, VfRun
from rdma_cni.node.record import VfRecord

NAMES = [s.name for s in STEPS]


def test_the_steps_and_their_progress_names() -> None:
    # The names are ADD's progress markers; "up" is part of the netdev move.
    assert NAMES == ["pf", "rdma", "move", "ipam", "addresses"]


@pytest.mark.parametrize("step", STEPS, ids=NAMES)
def test_every_step_implements_do_undo_and_check_itself(step: Step) -> None:
    assert isinstance(step, Step)
    for method in ("do", "undo", "check"):
        assert method in type(step).__dict__, f"step {step.name} inherits {method} instead of defining it"
    assert step.undo_what, f"step {step.name} has no words for its undo's errors"


def test_a_step_without_undo_or_check_cannot_exist() -> None:
    class NoUndo(Step):
        name = "x"
        undo_what = "x"

        def do(self, ctx: Context, run: VfRun) -> None: ...

        def check(self, ctx: Context, run: VfRun) -> None: ...

    class NoCheck(Step):
        name = "y"
        undo_what = "y"

        def do(self, ctx: Context, run: VfRun) -> None: ...

        def undo(self, ctx: Context, run: VfRun) -> None: ...

    for cls in (NoUndo, NoCheck):
        with pytest.raises(TypeError, match="abstract"):
            cls()  # type: ignore[abstract]


class _Ipam:
    def __init__(self, blind: bool) -> None:
        self.interface_blind = blind


def _vf() -> VfRecord:
    return VfRecord(
        pf="pf0",
        vf=0,
        pci="0000:01:00.1",
        host_name="eth1",
        host_mac="",
        host_mtu=1500,
        pod_name="net1",
        pf_applied={"rate": [0, 100]},
        rdma_device="mlx5_1",
        rdma_action="moved",
    )


def _ctx(blind: bool = False) -> Context:
    return Context(host=None, finder=None, vfctl=None, ipam=_Ipam(blind), rdma=object())  # type: ignore[arg-type]


def _record(monkeypatch: pytest.MonkeyPatch, fail_at: str = "") -> list[str]:
    """Replace every step's work with a note of it; ``fail_at`` names a step whose do fails."""
    calls: list[str] = []
    for step in STEPS:

        def do(ctx: Context, run: VfRun, step: Step = step) -> None:
            calls.append(f"do {step.name}")
            run.link = object()  # type: ignore[assignment]
            if step.name == fail_at:
                raise KernelError("injected")

        def undo(ctx: Context, run: VfRun, step: Step = step) -> None:
            calls.append(f"undo {step.name}")
            run.call = None

        def start(ctx: Context, run: VfRun, verb: str, step: Step = step) -> None:
            calls.append(f"start {step.name} {verb}")
            run.call = object()  # type: ignore[assignment]

        monkeypatch.setattr(step, "do", do)
        monkeypatch.setattr(step, "undo", undo)
        monkeypatch.setattr(step, "start", start)
    monkeypatch.setattr(VfRun, "close", lambda self: None)
    return calls


def _release(ctx: Context, progress: Progress | None) -> attach.Released:
    return attach.release(
        [_vf()],
        host=ctx.host,
        finder=ctx.finder,
        vfctl=ctx.vfctl,
        ipam=ctx.ipam,
        progress=progress,
        rdma=ctx.rdma,
    )


@pytest.mark.parametrize("with_progress", [True, False], ids=["rollback", "del"])
def test_release_undoes_in_the_reverse_of_perform_order(
    monkeypatch: pytest.MonkeyPatch, with_progress: bool
) -> None:
    calls = _record(monkeypatch)
    ctx, progress = _ctx(), Progress()
    attach.perform(ctx, _vf(), progress)
    assert calls == [f"do {n}" for n in NAMES]
    calls.clear()
    out = _release(ctx, progress if with_progress else None)
    assert calls == [f"undo {n}" for n in reversed(NAMES)] and out.errors == []


@pytest.mark.parametrize("fail_at", NAMES)
def test_rollback_undoes_exactly_the_steps_begun(monkeypatch: pytest.MonkeyPatch, fail_at: str) -> None:
    calls = _record(monkeypatch, fail_at)
    ctx, progress = _ctx(), Progress()
    with pytest.raises(KernelError):
        attach.perform(ctx, _vf(), progress)
    begun = NAMES[: NAMES.index(fail_at) + 1]  # marked before it runs: a half-done step is undone too
    calls.clear()
    _release(ctx, progress)
    assert calls == [f"undo {n}" for n in reversed(begun)]


def test_interface_blind_ipam_overlaps_the_netdev_move_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _record(monkeypatch)
    ctx, progress = _ctx(blind=True), Progress()
    attach.perform(ctx, _vf(), progress)
    assert calls == ["do pf", "do rdma", "start ipam ADD", "do move", "do ipam", "do addresses"]
    calls.clear()
    _release(ctx, progress)
    assert calls == ["undo addresses", "start ipam DEL", "undo move", "undo ipam", "undo rdma", "undo pf"]


def test_a_failed_undo_is_reported_and_the_rest_still_run(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _record(monkeypatch)
    by_name = dict(zip(NAMES, STEPS, strict=True))

    def fails(ctx: Context, run: VfRun) -> None:
        calls.append("undo move")
        raise KernelError("stuck")

    def ipam_fails(ctx: Context, run: VfRun) -> None:
        calls.append("undo ipam")
        raise KernelError("lease")

    monkeypatch.setattr(by_name["move"], "undo", fails)
    monkeypatch.setattr(by_name["ipam"], "undo", ipam_fails)
    out = _release(_ctx(), None)
    assert calls == [f"undo {n}" for n in reversed(NAMES)]
    assert out.errors == ["returning VF 0000:01:00.1: stuck"]  # holds the VF: the record stays
    assert out.ipam_failed == ["net1"] and out.ipam_errors == ["IPAM DEL for net1: lease"]


def test_check_asks_every_step_that_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    for step in STEPS:
        monkeypatch.setattr(step, "check", lambda ctx, run, step=step: seen.append(step.name))
    attach.check(_ctx(), _vf())
    assert seen == NAMES
    seen.clear()
    attach.check(
        Context(host=None, finder=None, vfctl=None, ipam=None), VfRecord("p", 0, "a", "h", "", 0, "n")
    )  # type: ignore[arg-type]
    assert seen == ["move"]
    seen.clear()
    # CHECK verifies prevResult's addresses even without IPAM (a later plugin in the chain may set them).
    no_ipam = Context(host=None, finder=None, vfctl=None, ipam=None, prev=Result())  # type: ignore[arg-type]
    attach.check(no_ipam, VfRecord("p", 0, "a", "h", "", 0, "n"))
    assert seen == ["move", "addresses"]


def test_check_of_a_missing_interface_names_it() -> None:
    class _Rtnl:
        def get_link(self, name: str) -> None:
            return None

    class _Pod:
        path = "/run/netns/p"
        rtnl = _Rtnl()

    class _Finder:
        pod = _Pod()

    ctx = Context(host=None, finder=_Finder(), vfctl=None, ipam=None)  # type: ignore[arg-type]
    with pytest.raises(attach.CheckFailed, match=r"net1 \(VF 0000:01:00\.1\) is missing from /run/netns/p"):
        attach.NetdevMove().check(ctx, VfRun(_vf()))


def test_run_close_waits_for_the_ipam_call_once() -> None:
    waited: list[int] = []

    class _Call:
        def wait(self) -> None:
            waited.append(1)

    run = VfRun(_vf(), call=_Call())  # type: ignore[arg-type]
    run.close()
    run.close()
    assert waited == [1]


def test_release_walks_vfs_last_first(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    for step in STEPS:
        monkeypatch.setattr(
            step, "undo", lambda ctx, run, step=step: order.append(f"{run.vf.pci} {step.name}")
        )
    a, b = _vf(), _vf()
    b.pci = "0000:01:00.2"
    ctx = _ctx()
    attach.release(
        [a, b], host=ctx.host, finder=ctx.finder, vfctl=ctx.vfctl, ipam=ctx.ipam, progress=None, rdma=ctx.rdma
    )
    assert order == [f"{b.pci} {n}" for n in reversed(NAMES)] + [f"{a.pci} {n}" for n in reversed(NAMES)]
