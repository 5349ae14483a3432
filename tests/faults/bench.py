"""One fault family's harness: runs the plugin, keeps the counts, and judges the node after each case."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from tests.faults.knobs import STATS
from tests.integration.conftest import Cluster, plugin_command
from tests.support.hostview import host_links
from tests.support.invariants import pending_releases, violations
from tests.support.processes import children_of
from tests.support.simnode import del_netns

# Every code docs/protocol.md documents; anything else (199 above all) is a bug.
DOCUMENTED = {1, 2, 3, 4, 5, 6, 7, 11, 50, 100, 101, 102, 103, 104, 105, 106, 107, 108}


@dataclass
class Run:
    code: int  # exit status (negative: killed by that signal)
    doc: dict[str, Any] | None
    stderr: str


@dataclass(frozen=True)
class Shim:
    """Run the plugin as shipped: the shim at ``path``, handing each verb to the CNI server at ``socket``
    (whose workers, forked from its zygote, run it)."""

    path: str
    socket: str
    server: int  # the CNI server's pid

    def workers(self) -> list[int]:
        """The processes that run verbs: the server's zygote's children."""
        return [w for z in children_of(self.server) for w in children_of(z)]


class Bench:
    """Counts inputs, cycles and violations for ``family`` and checks the node against its promises.

    With ``shim``, every run goes through the shim and the agent's CNI server, as shipped.
    """

    def __init__(self, cluster: Cluster, family: str, shim: Shim | None = None) -> None:
        self.cluster = cluster
        self.shim = shim
        self.stats: Counter[str] = STATS.setdefault(family, Counter())
        self.problems: list[str] = []
        # The host's own links (no veth at all): the plugin must never touch them.
        self.host_before = host_links(cluster.node.prefix + "\0")

    def env(self, verb: str, pod: dict[str, str]) -> dict[str, str]:
        env = {k: v for k, v in self.cluster.env(verb, pod).items() if v is not None}
        if self.shim is None:
            return env
        # A runtime's variables only: the node's environment is the server's.
        return {
            **{k: v for k, v in env.items() if k.startswith("CNI_")},
            "PATH": env.get("PATH", "/usr/bin:/bin"),
            "RDMA_CNI_SHIM_SOCKET": self.shim.socket,
        }

    def command(self) -> list[str]:
        return [self.shim.path] if self.shim is not None else plugin_command()

    def _judge(self, label: str, proc_code: int, out: bytes, err: bytes, verb: str) -> Run:
        text = out.decode(errors="replace")
        doc: dict[str, Any] | None = None
        if text.strip():
            try:
                parsed, end = json.JSONDecoder().raw_decode(text)
                if text[end:].strip() or not isinstance(parsed, dict):
                    raise ValueError("more than one JSON object")
                doc = parsed
            except ValueError as exc:
                self.fail(f"{label}: stdout is not one JSON object ({exc}): {text[:200]!r}")
        stderr = err.decode(errors="replace")
        if proc_code >= 0:
            if proc_code and (doc is None or doc.get("code") not in DOCUMENTED):
                self.fail(f"{label}: exit {proc_code} with {doc!r} (undocumented code or no error document)")
            if proc_code == 0 and doc is not None and verb in ("DEL", "CHECK", "STATUS", "GC"):
                self.fail(f"{label}: {verb} succeeded but printed {doc!r}")
            if "Traceback" in stderr:
                self.fail(f"{label}: a traceback on stderr: {stderr[-300:]!r}")
        return Run(proc_code, doc, stderr)

    def run(self, verb: str, pod: dict[str, str], conf: Any, label: str, timeout: float = 60) -> Run:
        """Run the plugin once; protocol breaches (several documents, code 199, tracebacks) are violations."""
        self.stats["runs"] += 1
        data = conf if isinstance(conf, bytes) else json.dumps(conf).encode()
        try:
            proc = subprocess.run(
                self.command(),
                input=data,
                env=self.env(verb, pod),
                capture_output=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            self.fail(f"{label} {verb}: still running after {timeout:g} s (killed)")
            return Run(-9, None, "")
        return self._judge(f"{label} {verb}", proc.returncode, proc.stdout, proc.stderr, verb)

    def run_killed(
        self, verb: str, pod: dict[str, str], conf: Any, after: float, victim: str = "caller"
    ) -> None:
        """Start the plugin and kill -9 its process group ``after`` seconds later (or let it end first).

        Through the shim, ``victim`` is ``caller`` (the shim, as a runtime's timeout kills it: the
        server then kills the verb's worker) or ``worker`` (the workers themselves, as a crash would).
        """
        self.stats["runs"] += 1
        proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=self.env(verb, pod),
            start_new_session=True,
        )
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(conf).encode())
        proc.stdin.close()
        time.sleep(after)
        if self.shim is not None and victim == "worker":
            for pid in self.shim.workers():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.stats["workers killed"] += 1
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def settle(self, pods: list[dict[str, str]], confs: list[Any], label: str) -> None:
        """DEL every pod with each conf (as a runtime retries), then judge the settled node."""
        conf = self.cluster.conf()
        for pod in pods:
            for attempt_conf in [*confs, conf]:
                self.run("DEL", pod, attempt_conf, f"{label} settle")
            last = self.run("DEL", pod, conf, f"{label} settle")
            if last.code != 0:
                self.fail(f"{label}: DEL with the sane config still fails: {last.doc}")
        if pending_releases(self.cluster.state_dir):
            # IPAM refused the release with the pod's own arguments (a CNI_IFNAME and
            # CNI_ARGS the runtime's every DEL repeats): the runtime's periodic GC,
            # which carries no pod arguments, is what finishes it (docs/protocol.md, "Lost,
            # corrupt and foreign records; IPAM cleanup that failed").
            valid = [
                dict(zip(("containerID", "ifname"), r[: -len(".json")].split("@"), strict=True))
                for r in self.cluster.records
            ]
            self.stats["gc"] += 1
            self.run("GC", {}, {**conf, "cni.dev/valid-attachments": valid}, f"{label} settle")
        before = len(self.problems)
        self.check(label, pods, settled=True)
        if len(self.problems) > before:
            return  # a VF may still be in these namespaces: deleting them would destroy it
        for pod in pods:
            ns = os.path.basename(pod.get("CNI_NETNS", ""))
            if ns in self.cluster.netns_names:
                del_netns(ns)
                self.cluster.netns_names.remove(ns)

    def check(self, label: str, pods: list[dict[str, str]], *, settled: bool) -> None:
        """Judge the node from the kernel's view (see tests/support/invariants.py)."""
        # This case's pods, and any namespace an earlier case had to keep (it may hold a VF).
        names = [
            os.path.basename(p["CNI_NETNS"]) for p in pods if p.get("CNI_NETNS", "").startswith("/run/netns/")
        ]
        names += [n for n in self.cluster.netns_names if n not in names]
        for problem in violations(self.cluster, names, self.host_before, settled=settled):
            self.fail(f"{label}: {problem}")

    def fail(self, text: str) -> None:
        self.stats["violations"] += 1
        self.problems.append(text)

    def verdict(self) -> None:
        """Fail the test listing the first violations (all were counted)."""
        shown = "\n".join(self.problems[:25])
        assert not self.problems, f"{len(self.problems)} violation(s):\n{shown}"
