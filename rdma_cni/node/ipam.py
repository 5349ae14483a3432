"""IPAM delegation: run the plugin named by ``ipam.type`` from CNI_PATH, as the spec prescribes.

This is the plugin's only exec. Each interface is a separate IPAM attachment
(its own CNI_IFNAME), so host-local and friends key their allocations by the
pod-side interface name.

IPAM plugins may speak an older CNI version than the config (Debian 12's
host-local stops at 1.0.0). The plugin's supported versions are asked once
with VERSION and cached in ``<stateDir>/ipam-versions.json`` keyed by the
binary's path, size and mtime; requests are then sent in the highest version
both sides speak.

Every IPAM exec runs under a guard process (:mod:`rdma_cni.node.ipam_guard`),
so a runtime killing the plugin never kills IPAM half-way through writing a
lease.

All IPAM calls of one verb share one time budget (``ipamTimeoutSeconds``):
a hanging IPAM holds the node lock once for that long, not once per call.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rdma_cni.cni.errors import DecodeFailure, IpamError, TryAgainLater
from rdma_cni.cni.protocol import CniEnv, Result, version_tuple
from rdma_cni.node.ipam_guard import GuardedCall, Outcome, start_guarded
from rdma_cni.node.statedir import make_dirs
from rdma_cni.shared.atomicfile import write_atomic

log = logging.getLogger("rdma_cni.ipam")

DEFAULT_BUDGET_SECONDS = 30.0
# IPAM types that read only their configuration and their own files, never
# the pod's interface: these may run while the VF is being moved (see
# Ipam.interface_blind). dhcp talks through the interface; anything else may.
INTERFACE_BLIND_TYPES = frozenset({"host-local", "static"})

# The deadline shared by every IPAM call of the verb that runs (one verb per
# process, but tests run several in one): set by the first call, cleared by
# start_verb().
_deadline: float | None = None


def start_verb() -> None:
    """Start a new verb's IPAM time budget (its first IPAM call starts the clock)."""
    global _deadline
    _deadline = None


def _remaining(budget: float) -> float:
    global _deadline
    if _deadline is None:
        _deadline = time.monotonic() + budget
    return _deadline - time.monotonic()


@dataclass
class IpamCall:
    """One IPAM request under way (see :meth:`Ipam.start`)."""

    verb: str
    ifname: str
    what: str
    guarded: GuardedCall | None  # None: nothing was run (no version both sides speak)

    def wait(self) -> Outcome | None:
        """Wait for the IPAM plugin to end (idempotent); :meth:`Ipam.finish_add` judges the answer."""
        return self.guarded.collect() if self.guarded is not None else None


class Ipam:
    """The IPAM plugin of one network config, found on CNI_PATH."""

    def __init__(self, conf_doc: Mapping[str, Any], env: CniEnv, state_dir: str) -> None:
        ipam = conf_doc.get("ipam") or {}
        # The document was validated as a NetConf (0 < ipamTimeoutSeconds <= 600).
        self.budget = float(conf_doc.get("ipamTimeoutSeconds", DEFAULT_BUDGET_SECONDS))
        self.type = str(ipam.get("type", ""))
        self._doc = dict(conf_doc)
        self._env = env
        self._cache_path = os.path.join(state_dir, "ipam-versions.json")
        self.binary = self._find(env.require_path())

    def _find(self, path: tuple[str, ...]) -> str:
        for directory in path:
            candidate = os.path.join(directory, self.type)
            if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
                return candidate
        raise IpamError(f"IPAM plugin {self.type!r} not found in CNI_PATH ({':'.join(path)})")

    @property
    def interface_blind(self) -> bool:
        """Whether this IPAM type never looks at the pod's interface, so it may run before the VF moves.

        host-local and static read only their configuration and their own
        files; dhcp needs the interface in the pod, and an unknown type may
        too, so every other type runs after the move, as CNI orders it.
        """
        return self.type in INTERFACE_BLIND_TYPES

    def _exec(self, verb: str, ifname: str, stdin: Mapping[str, Any]) -> tuple[int, Any]:
        return self._outcome(self._launch(verb, ifname, stdin))

    def _launch(self, verb: str, ifname: str, stdin: Mapping[str, Any]) -> IpamCall:
        env = dict(self._env.environ)
        env["CNI_COMMAND"] = verb
        if ifname:
            env["CNI_IFNAME"] = ifname
        what = f"IPAM plugin {self.type} {verb} for {ifname or 'the network'}"
        left = _remaining(self.budget)
        if left <= 0:
            raise TryAgainLater(
                f"{what} not run: the verb's IPAM time budget (ipamTimeoutSeconds, {self.budget:g} s) "
                "is spent"
            )
        try:
            guarded = start_guarded([self.binary], env, json.dumps(stdin).encode(), left)
        except OSError as exc:  # fork or pipe refused: the node is short of processes or descriptors
            raise TryAgainLater(f"{what} not run: cannot start its guard process: {exc.strerror}") from exc
        return IpamCall(verb, ifname, what, guarded)

    def _outcome(self, call: IpamCall) -> tuple[int, Any]:
        verb, what = call.verb, call.what
        done = call.wait()
        assert done is not None  # _launch always starts a guard
        if done.spawn_error:
            raise IpamError(f"cannot run IPAM plugin {self.binary}: {done.spawn_error}")
        if done.stderr:
            log.info("IPAM %s %s stderr: %s", self.type, verb, done.stderr.decode(errors="replace").strip())
        if done.timed_out:
            raise TryAgainLater(
                f"{what} did not finish within the verb's IPAM time budget (ipamTimeoutSeconds, "
                f"{self.budget:g} s); its process group was killed"
            )
        if done.status is None:
            raise IpamError(f"{what} was killed by signal {done.signal}")
        out = done.stdout.decode(errors="replace").strip()
        try:
            doc = json.loads(out) if out else None
        except ValueError:
            doc = None
            if done.status == 0:
                raise IpamError(f"{what} printed something that is not JSON", out[:500]) from None
        return done.status, doc

    def supported_versions(self) -> list[str]:
        """The IPAM plugin's supportedVersions (cached by binary identity)."""
        st = os.stat(self.binary)
        key = f"{self.binary}:{st.st_size}:{st.st_mtime_ns}"
        try:
            with open(self._cache_path, encoding="utf-8") as f:
                cache = json.load(f)
            if isinstance(cache, dict) and isinstance(cache.get(key), list):
                return cache[key]
        except (OSError, ValueError):
            cache = {}
        code, doc = self._exec("VERSION", "", {"cniVersion": "0.4.0"})
        versions = doc.get("supportedVersions") if code == 0 and isinstance(doc, dict) else None
        if not isinstance(versions, list):
            raise IpamError(f"IPAM plugin {self.type} did not answer VERSION", json.dumps(doc)[:500])
        try:
            make_dirs(os.path.dirname(self._cache_path))
            # A lost cache is asked again: no directory fsync needed.
            write_atomic(self._cache_path, json.dumps({key: versions}), sync_dir=False)
        except OSError as exc:
            log.warning("cannot cache IPAM versions in %s: %s", self._cache_path, exc)
        return versions

    def _version_for(self, wanted: str, minimum: str = "0.3.0") -> str | None:
        """The highest version <= ``wanted`` (and >= ``minimum``) the IPAM plugin speaks."""
        ours = version_tuple(wanted)
        usable = []
        for v in self.supported_versions():
            try:
                t = version_tuple(v)
            except ValueError:
                continue
            if version_tuple(minimum) <= t <= ours:
                usable.append((t, v))
        return max(usable)[1] if usable else None

    def _request(
        self, verb: str, ifname: str, extra: Mapping[str, Any] | None = None, minimum: str = "0.3.0"
    ) -> Any:
        call = self._begin(verb, ifname, extra, minimum)
        if call is None:
            return None
        try:
            return self._end(call)
        finally:
            call.wait()  # reaped even when the wait itself was interrupted

    def _begin(
        self, verb: str, ifname: str, extra: Mapping[str, Any] | None = None, minimum: str = "0.3.0"
    ) -> IpamCall | None:
        """Start one request (None: the plugin speaks no version that allows it)."""
        version = str(self._doc["cniVersion"])
        if version_tuple(version) > (1, 0, 0):
            # Only 1.1.0 has outrun common IPAM plugins; older configs go as they are.
            negotiated = self._version_for(version, minimum)
            if negotiated is None:
                return None
            version = negotiated
        # Each interface is its own IPAM attachment: a chained prevResult is not its business.
        stdin = {k: v for k, v in self._doc.items() if k != "prevResult"}
        stdin.update(extra or {})
        stdin["cniVersion"] = version
        return self._launch(verb, ifname, stdin)

    def _end(self, call: IpamCall) -> Any:
        """Wait for a request and judge its answer."""
        verb, ifname = call.verb, call.ifname
        if call.guarded is None:
            return None
        code, doc = self._outcome(call)
        # An error document is a failure even with exit status 0: a plugin saying
        # so must not hand the pod interfaces without addresses.
        if code != 0 or (isinstance(doc, dict) and "code" in doc):
            msg = doc.get("msg", "") if isinstance(doc, dict) else ""
            err_code = doc.get("code") if isinstance(doc, dict) else None
            target = ifname or "the network"
            status = f"exit status {code}" + (" with an error document" if code == 0 else "")
            text = f"IPAM plugin {self.type} {verb} for {target} failed: {str(msg)[:500] or status}"
            if err_code == 11:
                raise TryAgainLater(text, str(doc.get("details", "")))
            raise IpamError(text, json.dumps(doc)[:500] if doc else "")
        return doc

    def add(self, ifname: str) -> dict[str, Any]:
        """IPAM ADD for one pod-side interface; returns the IPAM result document."""
        call = self.start("ADD", ifname)
        try:
            return self.finish_add(call)
        finally:
            call.wait()

    def start(self, verb: str, ifname: str) -> IpamCall:
        """Start IPAM ``verb`` (ADD or DEL) for one pod-side interface; :meth:`finish_add` or
        :meth:`finish_delete` waits for it. The caller must make sure :meth:`IpamCall.wait` runs
        on every path (it is idempotent), so that IPAM never outlives the caller's own rollback."""
        # A plugin speaking no usable version is not run: its ADD then has no result, its DEL is moot.
        return self._begin(verb, ifname) or IpamCall(verb, ifname, f"IPAM plugin {self.type} {verb}", None)

    def finish_add(self, call: IpamCall) -> dict[str, Any]:
        """The result of an IPAM ADD started with :meth:`start`, checked."""
        doc = self._end(call)
        if not isinstance(doc, dict):
            raise IpamError(f"IPAM plugin {self.type} ADD for {call.ifname} returned no result")
        check_result(doc, f"IPAM plugin {self.type} ADD for {call.ifname}")
        return doc

    def delete(self, ifname: str) -> None:
        """IPAM DEL for one pod-side interface (idempotent for well-behaved IPAM plugins)."""
        self._request("DEL", ifname)

    def finish_delete(self, call: IpamCall) -> None:
        """Wait for an IPAM DEL started with :meth:`start`; raises as :meth:`delete` does."""
        self._end(call)

    def check(self, ifname: str, prev: Mapping[str, Any]) -> None:
        """IPAM CHECK for one interface, against its own result."""
        self._request("CHECK", ifname, {"prevResult": dict(prev)}, minimum="0.4.0")

    def gc(self, valid: list[dict[str, str]]) -> bool:
        """Forward GC; False when the IPAM plugin does not speak 1.1.0."""
        if self._version_for(str(self._doc["cniVersion"]), "1.1.0") is None:
            return False
        self._request("GC", "", {"cni.dev/valid-attachments": valid}, minimum="1.1.0")
        return True

    def status(self) -> bool:
        """Forward STATUS; False when the IPAM plugin does not speak 1.1.0 (nothing to ask)."""
        if self._version_for(str(self._doc["cniVersion"]), "1.1.0") is None:
            return False
        self._request("STATUS", "", minimum="1.1.0")
        return True


def check_result(doc: Mapping[str, Any], what: str) -> None:
    """Refuse (code 104) an IPAM result the plugin could not apply or pass on as it is."""
    try:
        res = Result.from_dict(doc)
    except DecodeFailure as exc:
        raise IpamError(f"{what} returned a malformed result: {exc.msg}", exc.details) from exc

    def bad(problem: str) -> IpamError:
        return IpamError(f"{what} returned an invalid result: {problem}", json.dumps(doc)[:500])

    def address(text: str, where: str, version: int) -> None:
        try:
            parsed = ipaddress.ip_address(text)
        except ValueError:
            raise bad(f"{where} {text[:100]!r} is not an IP address") from None
        if parsed.version != version:
            raise bad(f"{where} {text[:100]!r} is not an IPv{version} address")

    for i, ip in enumerate(res.ips):
        try:
            version = ipaddress.ip_interface(ip.address).version if "/" in ip.address else None
        except ValueError:
            version = None
        if version is None:
            raise bad(f"ips[{i}].address {ip.address[:100]!r} is not an address with a prefix length")
        if ip.gateway:
            address(ip.gateway, f"ips[{i}].gateway", version)
    for i, route in enumerate(res.routes):
        try:
            net = ipaddress.ip_network(route.dst, strict=False)
        except ValueError:
            raise bad(f"routes[{i}].dst {route.dst[:100]!r} is not a network") from None
        if route.gw:
            address(route.gw, f"routes[{i}].gw", net.version)
        for key in ("mtu", "advmss", "priority", "table", "scope"):
            value = getattr(route, key)
            if value is not None and (type(value) is not int or not 0 <= value < 1 << 32):
                raise bad(f"routes[{i}].{key} {value!r} is not a 32-bit unsigned integer")
    for key in ("nameservers", "search", "options"):
        values = res.dns.get(key, [])
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise bad(f"dns.{key} is not a list of strings")
    if not isinstance(res.dns.get("domain", ""), str):
        raise bad("dns.domain is not a string")
