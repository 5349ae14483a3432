"""IPAM delegation: run the plugin named by ``ipam.type`` from CNI_PATH, as the spec prescribes.

This is the plugin's only exec. Each interface is a separate IPAM attachment
(its own CNI_IFNAME), so host-local and friends key their allocations by the
pod-side interface name.

IPAM plugins may speak an older CNI version than the config (Debian 12's
host-local stops at 1.0.0). The plugin's supported versions are asked once
with VERSION and cached in ``<stateDir>/ipam-versions.json`` keyed by the
binary's path, size and mtime; requests are then sent in the highest version
both sides speak.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from collections.abc import Mapping
from typing import Any

from rdma_cni.errors import IpamError, TryAgainLater
from rdma_cni.protocol import CniEnv, version_tuple

log = logging.getLogger("rdma_cni.ipam")

TIMEOUT_SECONDS = 60


class Ipam:
    """The IPAM plugin of one network config, found on CNI_PATH."""

    def __init__(self, conf_doc: Mapping[str, Any], env: CniEnv, state_dir: str) -> None:
        ipam = conf_doc.get("ipam") or {}
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

    def _exec(self, verb: str, ifname: str, stdin: Mapping[str, Any]) -> tuple[int, Any]:
        env = dict(self._env.environ)
        env["CNI_COMMAND"] = verb
        if ifname:
            env["CNI_IFNAME"] = ifname
        try:
            proc = subprocess.run(
                [self.binary],
                input=json.dumps(stdin).encode(),
                env=env,
                capture_output=True,
                timeout=TIMEOUT_SECONDS,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise TryAgainLater(
                f"IPAM plugin {self.type} {verb} for {ifname} timed out after {TIMEOUT_SECONDS} s"
            ) from exc
        except OSError as exc:
            raise IpamError(f"cannot run IPAM plugin {self.binary}: {exc.strerror}") from exc
        if proc.stderr:
            log.info("IPAM %s %s stderr: %s", self.type, verb, proc.stderr.decode(errors="replace").strip())
        out = proc.stdout.decode(errors="replace").strip()
        try:
            doc = json.loads(out) if out else None
        except ValueError:
            doc = None
            if proc.returncode == 0:
                raise IpamError(
                    f"IPAM plugin {self.type} {verb} printed something that is not JSON", out[:500]
                ) from None
        return proc.returncode, doc

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
            os.makedirs(os.path.dirname(self._cache_path), mode=0o700, exist_ok=True)
            tmp = f"{self._cache_path}.{os.getpid()}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({key: versions}, f)
            os.rename(tmp, self._cache_path)
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
        code, doc = self._exec(verb, ifname, stdin)
        if code != 0:
            msg = doc.get("msg", "") if isinstance(doc, dict) else ""
            err_code = doc.get("code") if isinstance(doc, dict) else None
            target = ifname or "the network"
            text = f"IPAM plugin {self.type} {verb} for {target} failed: {msg or f'exit status {code}'}"
            if err_code == 11:
                raise TryAgainLater(text, str(doc.get("details", "")))
            raise IpamError(text, json.dumps(doc)[:500] if doc else "")
        return doc

    def add(self, ifname: str) -> dict[str, Any]:
        """IPAM ADD for one pod-side interface; returns the IPAM result document."""
        doc = self._request("ADD", ifname)
        if not isinstance(doc, dict):
            raise IpamError(f"IPAM plugin {self.type} ADD for {ifname} returned no result")
        return doc

    def delete(self, ifname: str) -> None:
        """IPAM DEL for one pod-side interface (idempotent for well-behaved IPAM plugins)."""
        self._request("DEL", ifname)

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
