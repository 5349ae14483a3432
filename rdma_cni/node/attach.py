"""Giving one VF to a pod, and taking it back, step by step.

ADD order per VF, and why:

1. PF-side settings (rate, VLAN, ...), originals already in the record: the
   step a driver most often refuses (igb rejects min_tx_rate), so it fails
   before anything moved.
2. The RDMA device into the pod's namespace (when isolation moves it): also
   often refused (shared mode, drivers without disassociate support), and
   doing it before the netdev means a pod never sees a netdev without its
   RDMA device.
3. The netdev into the pod: the one proven to be the VF by its kernel
   identity (:mod:`rdma_cni.kernel.identity`), moved, renamed and labelled with the
   alias ``rdma-cni:<pci>`` (for operators only: a pod can rewrite it, so
   nothing trusts it) in one RTM_NEWLINK. The kernel only renames on the way
   in when the current name is taken in the pod, so the pod-side name never
   collides with a host interface and the host name never collides inside
   the pod. Its MAC is set and it is brought up in the same step.
4. IPAM; then addresses and routes. An IPAM type that never looks at
   the pod's interface (host-local, static) is started before step 3 and
   waited for after it, so its fork and exec overlap the namespace move,
   which is mostly the kernel waiting; release does the same with IPAM DEL
   and the move home. Every other type keeps CNI's order.

Each step is one object in :data:`STEPS` (:class:`Step`: ``do``, ``undo``
and ``check`` side by side), so ADD (:func:`perform`), its rollback and DEL
(:func:`release`) and CHECK (:func:`check`) are loops over one list, and a
step cannot be added to one of them without the others. Step names are ADD's
in-memory progress markers; records never hold them. What the netdev steps
do in the kernel is :mod:`rdma_cni.node.vfnetdev`'s.

:func:`release` undoes these in reverse and is idempotent: it is DEL, GC and
ADD's rollback all at once. Given ``progress`` (ADD's in-memory account of
which steps ran) it undoes exactly those; without it (a record left by a
crash) it undoes everything that can still be undone, tolerating steps that
never happened. A netdev goes back to the host only when its kernel identity
proves it is the VF, wherever it sits and whatever it is called. An IPAM DEL
that fails does not keep the VF: release reports it apart
(:class:`Released`), and the caller remembers it (:mod:`rdma_cni.node.ipam_pending`).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rdma_cni.cni.errors import CheckFailed, CniError, KernelError
from rdma_cni.kernel.identity import VfFinder
from rdma_cni.kernel.netlink import Link, Rtnl
from rdma_cni.kernel.netns import Netns
from rdma_cni.kernel.vfcontrol import VfControl
from rdma_cni.node.ipam import Ipam, IpamCall
from rdma_cni.node.record import VfRecord
from rdma_cni.node.vfnetdev import (
    apply_addresses,
    move_in,
    move_out,
)

if TYPE_CHECKING:
    from rdma_cni.cni.protocol import Result
    from rdma_cni.node.isolation import RdmaIsolation

log = logging.getLogger("rdma_cni.attach")


@dataclass
class Progress:
    """Which steps of ADD ran for each VF (by PCI address)."""

    done: dict[str, set[str]] = field(default_factory=dict)

    def mark(self, pci: str, step: str) -> None:
        self.done.setdefault(pci, set()).add(step)

    def ran(self, pci: str, step: str) -> bool:
        return step in self.done.get(pci, set())


# -- the steps: each one's do, undo and check side by side -----------------


def apply_pf_settings(vfctl: VfControl, vf: VfRecord) -> None:
    """The VF's PF-side settings (rate, VLAN, ...) this attachment asked for, if any."""
    if vf.pf_applied:
        vfctl.apply(vf.pf, vf.vf, vf.pf_applied)


@dataclass
class Context:
    """What the steps act through. ``rdma`` is None where RDMA devices are not to be touched.

    CHECK also sets ``prev`` (the runtime's prevResult); ``tables`` caches each
    PF's VF table for it.
    """

    host: Rtnl
    finder: VfFinder
    vfctl: VfControl
    ipam: Ipam | None
    rdma: RdmaIsolation | None = None
    prev: Result | None = None
    tables: dict[str, Any] = field(default_factory=dict)

    @property
    def pod(self) -> Netns:
        assert self.finder.pod is not None  # ADD and CHECK always have the pod
        return self.finder.pod


@dataclass
class VfRun:
    """One VF's way through the steps: the pod-side link once moved, and an IPAM call under way."""

    vf: VfRecord
    link: Link | None = None
    call: IpamCall | None = None

    def close(self) -> None:
        """Wait for the IPAM call, if any: nothing returns while IPAM still runs."""
        if self.call is not None:
            call, self.call = self.call, None
            call.wait()


class Step(ABC):
    """One ADD step for one VF, with its undo and its check.

    ``undo`` must be idempotent and tolerate a step that never happened (a
    record left by a crash says nothing of progress). ``overlaps`` says the
    step may start while the step before it runs (:meth:`start`), and its
    undo while that step's undo runs; :meth:`do` and :meth:`undo` then finish
    what :meth:`start` began.
    """

    name: str  # ADD's progress marker
    undo_what: str  # names the undo in errors; formatted with the VfRecord's fields
    holds_vf: bool = True  # an undo that fails keeps the VF (and the record)

    def applies(self, ctx: Context, vf: VfRecord) -> bool:
        """Whether this VF has this step at all."""
        return True

    def overlaps(self, ctx: Context) -> bool:
        return False

    def start(self, ctx: Context, run: VfRun, verb: str) -> None:  # pragma: no cover - only overlapping steps
        raise NotImplementedError(f"step {self.name} does not overlap")

    @abstractmethod
    def do(self, ctx: Context, run: VfRun) -> None: ...

    @abstractmethod
    def undo(self, ctx: Context, run: VfRun) -> None: ...

    @abstractmethod
    def check(self, ctx: Context, run: VfRun) -> None:
        """Raise :class:`CheckFailed` if what :meth:`do` made is no longer so."""


class PfSettings(Step):
    """Rate, VLAN, trust, ... set on the PF for the VF; the originals are in the record."""

    name = "pf"
    undo_what = "restoring PF {pf} VF {vf} settings"

    def applies(self, ctx: Context, vf: VfRecord) -> bool:
        return bool(vf.pf_applied)

    def do(self, ctx: Context, run: VfRun) -> None:
        apply_pf_settings(ctx.vfctl, run.vf)

    def undo(self, ctx: Context, run: VfRun) -> None:
        ctx.vfctl.apply(run.vf.pf, run.vf.vf, run.vf.pf_original)

    def check(self, ctx: Context, run: VfRun) -> None:
        rec = run.vf
        rate = rec.pf_applied.get("rate")
        if rate is None:
            return
        if rec.pf not in ctx.tables:
            ctx.tables[rec.pf] = ctx.vfctl.read(rec.pf)
        info = (ctx.tables[rec.pf] or {}).get(rec.vf)
        if (
            info is not None
            and info.max_tx_rate is not None
            and [info.min_tx_rate or 0, info.max_tx_rate] != list(rate)
        ):
            raise CheckFailed(
                f"PF {rec.pf} VF {rec.vf} rate is min {info.min_tx_rate} max "
                f"{info.max_tx_rate} Mbit/s, ADD applied min {rate[0]} max {rate[1]}"
            )


class RdmaMove(Step):
    """The VF's RDMA device into the pod (when isolation moves it)."""

    name = "rdma"
    undo_what = "returning RDMA device {rdma_device}"

    def applies(self, ctx: Context, vf: VfRecord) -> bool:
        return ctx.rdma is not None and vf.rdma_action == "moved"

    def do(self, ctx: Context, run: VfRun) -> None:
        assert ctx.rdma is not None
        ctx.rdma.move_in(run.vf.rdma_device, ctx.pod)

    def undo(self, ctx: Context, run: VfRun) -> None:
        assert ctx.rdma is not None
        ctx.rdma.move_out(run.vf.rdma_device, ctx.finder.pod)

    def check(self, ctx: Context, run: VfRun) -> None:
        assert ctx.rdma is not None
        seen = ctx.rdma.where(run.vf.rdma_device, ctx.pod)
        if seen != "pod":
            raise CheckFailed(
                f"RDMA device {run.vf.rdma_device} of {run.vf.pod_name} is "
                f"{'in the host' if seen == 'host' else 'missing'}, not in the pod"
            )


class NetdevMove(Step):
    """The netdev proven to be the VF into the pod, renamed, with its MAC, and up (one request)."""

    name = "move"
    undo_what = "returning VF {pci}"

    def do(self, ctx: Context, run: VfRun) -> None:
        home = ctx.finder.in_host(run.vf.pci)
        if home is None:
            raise KernelError(f"VF {run.vf.pci} is no longer proven to be in the host namespace")
        run.link = move_in(ctx.host, ctx.finder, run.vf, home)

    def undo(self, ctx: Context, run: VfRun) -> None:
        move_out(ctx.host, ctx.finder, run.vf)

    def check(self, ctx: Context, run: VfRun) -> None:
        rec, pod = run.vf, ctx.pod
        link = pod.rtnl.get_link(name=rec.pod_name)
        if link is None:
            raise CheckFailed(f"interface {rec.pod_name} (VF {rec.pci}) is missing from {pod.path}")
        if not ctx.finder.check(link, rec.pci):
            raise CheckFailed(
                f"interface {rec.pod_name} in {pod.path} is not VF {rec.pci} (the kernel does "
                "not report it as that VF's netdev, whatever its name or alias say)"
            )
        itf = _prev_interface(ctx, rec)[1]
        if itf.mac and itf.mac.lower() != link.mac.lower():
            raise CheckFailed(f"{rec.pod_name} has MAC {link.mac}, prevResult says {itf.mac}")
        if not link.up:
            raise CheckFailed(f"{rec.pod_name} is down")
        run.link = link


class IpamStep(Step):
    """The IPAM plugin's ADD for the pod-side name; the result is kept in the record.

    A type that never looks at the interface (``Ipam.interface_blind``) starts
    while the netdev moves, in and home: the move is mostly the kernel
    waiting, and IPAM's fork and exec use that time.
    """

    name = "ipam"
    undo_what = "IPAM DEL for {pod_name}"
    holds_vf = False  # a failed IPAM DEL is remembered apart (rdma_cni.node.ipam_pending)

    def applies(self, ctx: Context, vf: VfRecord) -> bool:
        return ctx.ipam is not None

    def overlaps(self, ctx: Context) -> bool:
        return ctx.ipam is not None and ctx.ipam.interface_blind

    def start(self, ctx: Context, run: VfRun, verb: str) -> None:
        assert ctx.ipam is not None
        run.call = ctx.ipam.start(verb, run.vf.pod_name)

    def do(self, ctx: Context, run: VfRun) -> None:
        assert ctx.ipam is not None
        if run.call is None:
            self.start(ctx, run, "ADD")
        assert run.call is not None
        run.vf.ipam = ctx.ipam.finish_add(run.call)

    def undo(self, ctx: Context, run: VfRun) -> None:
        assert ctx.ipam is not None
        if run.call is None:
            ctx.ipam.delete(run.vf.pod_name)
        else:
            ctx.ipam.finish_delete(run.call)

    def check(self, ctx: Context, run: VfRun) -> None:
        if ctx.ipam is not None and run.vf.ipam is not None:
            ctx.ipam.check(run.vf.pod_name, run.vf.ipam)


class Addresses(Step):
    """The IPAM result's addresses and routes on the pod-side interface."""

    name = "addresses"
    undo_what = "removing the addresses of {pod_name}"

    def applies(self, ctx: Context, vf: VfRecord) -> bool:
        # CHECK (the one caller with prevResult) verifies the addresses prevResult
        # gives the interface whoever set them, IPAM or a plugin later in the chain.
        return ctx.ipam is not None or ctx.prev is not None

    def do(self, ctx: Context, run: VfRun) -> None:
        assert run.link is not None and run.vf.ipam is not None
        apply_addresses(ctx.pod, run.link, run.vf.ipam)

    def undo(self, ctx: Context, run: VfRun) -> None:
        # Nothing to do: the kernel drops a netdev's addresses, and the routes
        # through it, when the netdev leaves the pod's namespace.
        return None

    def check(self, ctx: Context, run: VfRun) -> None:
        assert run.link is not None and ctx.prev is not None
        index = _prev_interface(ctx, run.vf)[0]
        have = set(ctx.pod.rtnl.addresses(run.link.index))
        for ip in ctx.prev.ips:
            if ip.interface == index and ip.address not in have:
                raise CheckFailed(
                    f"{run.vf.pod_name} lacks address {ip.address} (has {sorted(have) or 'none'})"
                )


def _prev_interface(ctx: Context, rec: VfRecord) -> tuple[int, Any]:
    assert ctx.prev is not None
    for n, itf in enumerate(ctx.prev.interfaces):
        if itf.name == rec.pod_name:
            return n, itf
    raise CheckFailed(f"prevResult does not list interface {rec.pod_name}")


# In ADD's order; release walks it backwards. Every step is in all three loops.
STEPS: tuple[Step, ...] = (PfSettings(), RdmaMove(), NetdevMove(), IpamStep(), Addresses())


def perform(ctx: Context, vf: VfRecord, progress: Progress) -> Link:
    """Every ADD step for ``vf``, each marked before it runs (so rollback covers a half-done step).

    Returns the pod-side link. An IPAM call is waited for before this returns
    or raises, so the rollback's IPAM DEL never races an IPAM ADD under way.
    """
    run = VfRun(vf)
    steps = [s for s in STEPS if s.applies(ctx, vf)]
    try:
        for i, step in enumerate(steps):
            after = steps[i + 1] if i + 1 < len(steps) else None
            if after is not None and after.overlaps(ctx):
                progress.mark(vf.pci, after.name)
                after.start(ctx, run, "ADD")
            progress.mark(vf.pci, step.name)
            step.do(ctx, run)
    finally:
        run.close()
    assert run.link is not None  # NetdevMove always applies
    return run.link


def check(ctx: Context, vf: VfRecord) -> None:
    """CHECK of every step of ``vf``, in ADD's order; raises CheckFailed naming the first fault."""
    run = VfRun(vf)
    for step in STEPS:
        if step.applies(ctx, vf):
            step.check(ctx, run)


# -- release (DEL, GC, rollback) ------------------------------------------


@dataclass
class Released:
    """What :func:`release` could not undo.

    ``errors``: kernel-side steps that failed (the VFs concerned may not be
    home: the record must stay). ``ipam_failed``: pod-side names whose IPAM
    DEL failed, with ``ipam_errors`` saying why; these hold no VF.
    """

    errors: list[str] = field(default_factory=list)
    ipam_failed: list[str] = field(default_factory=list)
    ipam_errors: list[str] = field(default_factory=list)


def release(
    vfs: list[VfRecord],
    *,
    host: Rtnl,
    finder: VfFinder,
    vfctl: VfControl,
    ipam: Ipam | None,
    progress: Progress | None,
    rdma: RdmaIsolation | None = None,
) -> Released:
    """Undo ADD for ``vfs``, last VF first, each VF's steps last first; keeps going past failures."""
    out = Released()
    ctx = Context(host=host, finder=finder, vfctl=vfctl, ipam=ipam, rdma=rdma)

    def attempt(step: Step, run: VfRun, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except (CniError, OSError) as exc:
            what = step.undo_what.format(**vars(run.vf))
            text = exc.msg if isinstance(exc, CniError) else str(exc)
            log.error("%s: %s", what, text)
            if step.holds_vf:
                out.errors.append(f"{what}: {text}")
            else:
                out.ipam_failed.append(run.vf.pod_name)
                out.ipam_errors.append(f"{what}: {text}")

    for vf in reversed(vfs):
        steps = [
            s for s in STEPS if s.applies(ctx, vf) and (progress is None or progress.ran(vf.pci, s.name))
        ]
        run = VfRun(vf)
        try:
            started: Step | None = None
            for i in reversed(range(len(steps))):
                step = steps[i]
                if i > 0 and step.overlaps(ctx) and steps[i - 1] is _before(step):
                    attempt(step, run, step.start, ctx, run, "DEL")  # finished once the step before is undone
                    started = step if run.call is not None else None
                    continue
                attempt(step, run, step.undo, ctx, run)
                if started is not None:
                    attempt(started, run, started.undo, ctx, run)
                    started = None
        finally:
            run.close()
    return out


def _before(step: Step) -> Step | None:
    """The step ADD runs just before ``step`` (whether or not it applies to a given VF)."""
    i = STEPS.index(step)
    return STEPS[i - 1] if i > 0 else None
