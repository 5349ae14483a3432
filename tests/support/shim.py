"""The host shim (launcher/shim.c) for tests: built from source, run as a runtime runs it, a plugin stand-in.

Built once per session with the same flags as ``make build`` into a directory
of the caller's, so a test always runs the shim of the tree it tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_shim(out_dir: str) -> str:
    """Compile launcher/shim.c statically into ``out_dir``; its path."""
    path = os.path.join(out_dir, "rdma-cni-shim")
    subprocess.run(
        [
            os.environ.get("CC", "cc"),
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-static",
            "-o",
            path,
            os.path.join(REPO, "launcher", "shim.c"),
        ],
        check=True,
    )
    return path


@dataclass
class ShimOutcome:
    """What a runtime sees of one shim call."""

    code: int
    stdout: str
    stderr: str

    @property
    def doc(self) -> dict[str, Any] | None:
        """The JSON document on stdout, if any."""
        return json.loads(self.stdout) if self.stdout.strip() else None


def run_shim(
    shim: str, socket_path: str, env: dict[str, str], stdin: bytes = b"{}", timeout: float = 60
) -> ShimOutcome:
    """Run the shim with ``env`` (plus the socket's path) and ``stdin``."""
    proc = subprocess.run(
        [shim],
        input=stdin,
        env={"PATH": "/usr/bin:/bin", **env, "RDMA_CNI_SHIM_SOCKET": socket_path},
        capture_output=True,
        timeout=timeout,
        check=False,
    )
    return ShimOutcome(proc.returncode, proc.stdout.decode(), proc.stderr.decode())


def write_echo_plugin(path: str) -> str:
    """A plugin stand-in that answers with what it was given (environment, stdin, the namespace it opens).

    Run as the CNI server runs a plugin, ``<it> cni-workers``, it is the real zygote and workers
    (:mod:`rdma_cni.agent.verbworker`) with this verb in place of the plugin's; run with other
    arguments (``release-previous-boot``), it answers once, as a process.

    Its stdin picks a behaviour: ``{"exit": N}`` exits N, ``{"sleep": S, "pidfile": P}``
    writes its pid to P and sleeps S seconds first, ``{"big": N}`` prints N bytes,
    ``{"kill": SIG}`` kills itself with SIG, ``{"calls": P}`` appends a line
    ``CNI_COMMAND CNI_CONTAINERID CNI_IFNAME`` to P first (``{"exit_file": F}``
    then exits with the number F holds, when F exists). What a worker must not keep after a
    verb: ``{"thread": true}`` leaves a thread running, ``{"leak": true}`` a file open,
    ``{"child": true}`` a child running, ``{"setns": PATH}`` the thread in another network
    namespace, ``{"handler": true}`` a logging handler; ``{"raise": N}`` raises SystemExit(N).
    ``ECHO_MAX_VERBS`` in the zygote's environment bounds the verbs a worker serves.
    """
    body = textwrap.dedent(
        """\
        import json, os, sys, threading, time

        LEAKED = []

        def verb(environ, raw):
            try:
                conf = json.loads(raw or b"{}")
            except ValueError:
                conf = {}
            if not isinstance(conf, dict):
                conf = {}
            if conf.get("big"):
                return 0, ("x" * conf["big"]).encode()
            if conf.get("kill"):
                os.kill(os.getpid(), conf["kill"])
            if conf.get("raise"):
                raise SystemExit(conf["raise"])
            if conf.get("thread"):
                threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
            if conf.get("leak"):
                LEAKED.append(open(os.devnull))
            if conf.get("child"):
                import subprocess
                subprocess.Popen(["sleep", "5"])
            if conf.get("setns"):
                import ctypes
                fd = os.open(conf["setns"], os.O_RDONLY)
                ctypes.CDLL(None).setns(fd, 0x40000000)
                os.close(fd)
            if conf.get("handler"):
                import logging
                logging.getLogger("rdma_cni").handlers.append(logging.NullHandler())
            if conf.get("calls"):
                with open(conf["calls"], "a") as f:
                    names = ("CNI_COMMAND", "CNI_CONTAINERID", "CNI_IFNAME")
                    f.write(" ".join(environ.get(k, "") for k in names) + "\\n")
            if conf.get("exit_file") and os.path.exists(conf["exit_file"]):
                with open(conf["exit_file"]) as f:
                    conf["exit"] = int(f.read())
            if conf.get("pidfile"):
                with open(conf["pidfile"], "w") as f:
                    f.write(str(os.getpid()))
            time.sleep(conf.get("sleep", 0))
            via = environ.get("RDMA_CNI_NETNS_VIA", "")
            ns = None
            if via.startswith("/"):
                st = os.stat(via)
                ns = [st.st_dev, st.st_ino]
            sys.stderr.write("plugin stderr\\n")
            import logging
            doc = {
                "env": dict(environ),
                "stdin": raw.decode(),
                "netns": ns,
                "pid": os.getpid(),
                "handlers": len(logging.getLogger("rdma_cni").handlers),
            }
            return conf.get("exit", 0), (json.dumps(doc) + "\\n").encode()

        if sys.argv[1:2] == ["cni-workers"]:
            from rdma_cni.agent import verbworker
            verbworker.MAX_VERBS = int(os.environ.get("ECHO_MAX_VERBS", verbworker.MAX_VERBS))
            sys.exit(verbworker.main(sys.argv[2:], run=verb, preload=lambda: None))
        code, out = verb(dict(os.environ), sys.stdin.buffer.read())
        sys.stdout.buffer.write(out)
        sys.exit(code)
        """
    )
    with open(path, "w") as f:
        f.write(f"#!{sys.executable}\n{body}")
    os.chmod(path, 0o755)
    return path
