"""The executable's entry point: CNI verbs from the environment, or operator subcommands.

Run with no arguments (as runtimes do) it is a CNI plugin: it reads
CNI_COMMAND and the config on stdin and prints exactly one JSON document on
stdout. With a first argument it runs an operator subcommand (``inventory``,
``install``, ``nodes``, ...). Heavy modules are imported inside the branch that needs them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Mapping
from typing import Any, BinaryIO, TextIO

from rdma_cni import __version__
from rdma_cni import log as rdma_log
from rdma_cni.cni.errors import CniError, InternalError
from rdma_cni.cni.protocol import (
    LATEST_VERSION,
    MAX_CONFIG_BYTES,
    check_version,
    decode_stdin,
    parse_env,
    version_document,
)

log = logging.getLogger("rdma_cni")

USAGE = f"""rdma-cni {__version__}: a CNI plugin giving pods SR-IOV VFs with their RDMA devices.

As a CNI plugin it is run by the container runtime with CNI_COMMAND set
(ADD, DEL, CHECK, VERSION, STATUS, GC) and the network configuration on stdin.

Operator subcommands:
  rdma-cni inventory [--pretty] [--config FILE]   print the node's SR-IOV/RDMA state as JSON
  rdma-cni install [options]                      DaemonSet entry point: install into /opt/cni/bin
  rdma-cni doctor [--json] [options]              check this node: exit 0 ok, 1 warning, 2 failure
  rdma-cni nodes [--fits JSON] [--json] [--kubeconfig FILE]
                                                  per node: free bandwidth and VFs, where a request fits
  rdma-cni claim [--name N] [--network NET] REQUEST
                                                  the DRA ResourceClaimTemplate for an annotation's request
  rdma-cni scheduler-extender --listen ADDR:PORT [options]
                                                  kube-scheduler extender (see docs/scheduling.md)
  rdma-cni scheduler-config --merge FILE --url URL --ca F --client-cert F --client-key F [--output F]
                                                  the control plane's kube-scheduler configuration with the
                                                  extender merged in (--remove: taken out; docs/deploy.md)
  rdma-cni cni-server [--socket PATH] [--plugin PATH]
                                                  run the verbs the host's shim hands over (docs/deploy.md)
  rdma-cni release-previous-boot [--state-dir DIR] [--lock-file FILE]
                                                  release the records an earlier boot left (docs/deploy.md)
  rdma-cni release-orphans [--state-dir DIR] [--lock-file FILE]
                                                  release this boot's records whose pod namespace is gone
                                                  though no DEL came (the agent runs it; docs/deploy.md)
  rdma-cni --version

The launcher also starts `rdma-cni warm-server` by itself, and the CNI server `rdma-cni cni-workers`
(see docs/architecture.md).
"""


def _error_version(doc: Mapping[str, Any] | None) -> str:
    version = (doc or {}).get("cniVersion")
    return version if isinstance(version, str) and version else LATEST_VERSION


def run_cni(environ: Mapping[str, str], stdin: bytes) -> tuple[int, dict[str, Any] | None]:
    """Run one CNI invocation; return the exit code and the JSON document to print (None: print nothing).

    Every error document carries the config's cniVersion when stdin could be
    decoded (a runtime reads the error in the version it sent), else the latest.
    """
    doc: dict[str, Any] | None = None
    bad_stdin: CniError | None = None
    # Decoded before the environment is checked, so that an environment error
    # still answers in the config's version; a decoding error is raised after.
    try:
        doc = decode_stdin(stdin)
    except CniError as exc:  # not JSON (code 6), or over the size limit (code 7)
        bad_stdin = exc
    try:
        env = parse_env(environ)
        if env.command == "VERSION" and not stdin.strip():
            # An empty stdin is tolerated for VERSION: some tools probe with nothing.
            return 0, version_document(LATEST_VERSION)
        if bad_stdin is not None:
            raise bad_stdin
        assert doc is not None
        if env.command == "VERSION":
            return 0, version_document(_error_version(doc))
        check_version(doc.get("cniVersion"), env.command)
        from rdma_cni.verbs import dispatch

        started = time.monotonic()
        result = dispatch(env, doc)
        log.info(
            "%s %s/%s done in %.1f ms (%s start)",
            env.command,
            env.container_id,
            env.ifname,
            (time.monotonic() - started) * 1000,
            rdma_log.start_kind,
        )
        return 0, result
    except CniError as exc:
        answer = exc.to_dict(_error_version(doc))
        # The document's msg and details, bounded and escaped: they may quote what a pod wrote.
        log.error(
            "%s failed: %s%s",
            environ.get("CNI_COMMAND", "?"),
            answer["msg"],
            f" ({answer['details']})" if answer["details"] else "",
        )
        return 1, answer
    except Exception as exc:  # a bug: still answer with a CNI error document
        log.error("unexpected error:\n%s", traceback.format_exc())
        err = InternalError(
            f"internal error in rdma-cni: {type(exc).__name__}", f"{type(exc).__name__}: {exc}"
        )
        return 1, err.to_dict(_error_version(doc))


def _write(out: TextIO, doc: Mapping[str, Any]) -> None:
    out.write(json.dumps(doc))
    out.write("\n")
    out.flush()


def main(
    argv: list[str] | None = None,
    *,
    stdin: BinaryIO | None = None,
    stdout: TextIO | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    """Entry point of the ``rdma-cni`` executable."""
    argv = sys.argv[1:] if argv is None else argv
    environ = os.environ if environ is None else environ
    out = stdout or sys.stdout
    rdma_log.setup_stderr()
    if argv:
        return _subcommand(argv, out)
    if stdin is None and sys.stdin is not None:
        if not environ.get("CNI_COMMAND") and sys.stdin.isatty():
            sys.stderr.write(USAGE)
        stdin = sys.stdin.buffer
    # A closed stdin (sys.stdin is None) reads as empty: the verb then reports code 6.
    # One byte past the limit is enough to refuse an oversized config (decode_stdin).
    raw = stdin.read(MAX_CONFIG_BYTES + 1) if stdin is not None else b""
    # Only the CNI document may reach stdout: a stray print() anywhere in a verb
    # goes to stderr instead.
    with contextlib.redirect_stdout(sys.stderr):
        code, doc = run_cni(environ, raw)
    if doc is not None:
        _write(out, doc)
    return code


def cni_answer(environ: Mapping[str, str], stdin: bytes) -> tuple[int, bytes]:
    """One CNI invocation as the executable answers it: (exit status, what it prints on stdout).

    What the agent's verb workers (:mod:`rdma_cni.agent.verbworker`) run for each call the
    shim hands over, in place of a process running :func:`main`: the same set-up, the same
    document, the same code.
    """
    rdma_log.setup_stderr()
    with contextlib.redirect_stdout(sys.stderr):
        code, doc = run_cni(environ, stdin[: MAX_CONFIG_BYTES + 1])
    return code, b"" if doc is None else (json.dumps(doc) + "\n").encode()


def _subcommand(argv: list[str], out: TextIO) -> int:
    name, rest = argv[0], argv[1:]
    if name in ("-h", "--help", "help"):
        out.write(USAGE)
        return 0
    if name == "--version":
        out.write(f"rdma-cni {__version__}\n")
        return 0
    if name == "inventory":
        from rdma_cni.cli.inventory import main as run_subcommand
    elif name == "install":
        from rdma_cni.install.command import main as run_subcommand
    elif name == "doctor":
        from rdma_cni.cli.doctor import main as run_subcommand
    elif name == "nodes":
        from rdma_cni.cli.nodes import main as run_subcommand
    elif name == "claim":
        from rdma_cni.cli.claim import main as run_subcommand
    elif name == "scheduler-extender":
        from rdma_cni.extender.main import main as run_subcommand
    elif name == "scheduler-config":
        from rdma_cni.extender.schedconfig import main as run_subcommand
    elif name == "cni-server":
        from rdma_cni.agent.cniserver import main as run_server

        return run_server(rest)
    elif name == "release-previous-boot":
        return _release_previous_boot(rest, out)
    elif name == "cni-workers":
        from rdma_cni.agent.verbworker import main as run_workers

        # Started by the CNI server: its workers run this module's CNI entry for each call.
        return run_workers(rest, run=cni_answer)
    elif name == "release-orphans":
        return _release_orphans(rest, out)
    elif name == "warm-server":
        from rdma_cni.launch.warm import main as run_warm

        # Each child of the server runs this module's main, as a cold start does (the server
        # imports nothing of the entry points).
        return run_warm(rest, run=main)
    else:
        sys.stderr.write(f"rdma-cni: unknown subcommand {name!r}\n\n{USAGE}")
        return 2
    return run_subcommand(rest, out)


def _release_orphans(argv: list[str], out: TextIO) -> int:
    """``rdma-cni release-orphans``: the node agent's same-boot pass (:mod:`rdma_cni.node.orphans`).

    Prints what it did as JSON; exit 0, or 1 when a release failed or the state cannot be reached.
    """
    import argparse

    from rdma_cni.cni.config import DEFAULT_LOCK_FILE, DEFAULT_STATE_DIR

    p = argparse.ArgumentParser(
        prog="rdma-cni release-orphans",
        description="Release this boot's allocation records whose pod network namespace is gone and whose "
        "VFs are back in the host, as a DEL would.",
    )
    p.add_argument("--state-dir", default=DEFAULT_STATE_DIR, help="default: %(default)s")
    p.add_argument("--lock-file", default=DEFAULT_LOCK_FILE, help="default: %(default)s")
    args = p.parse_args(argv)
    for handler in logging.getLogger("rdma_cni").handlers:
        handler.setLevel(logging.INFO)  # what was released reaches the agent's log
    from rdma_cni.launch.startup import defer_unused
    from rdma_cni.verbs.gc import release_orphans

    defer_unused()
    try:
        sweep = release_orphans(args.state_dir, args.lock_file)
    except CniError as exc:
        _write(out, {"error": exc.msg, "code": exc.code})
        return 1
    _write(out, sweep.to_dict())
    return 1 if sweep.failed else 0


def _release_previous_boot(argv: list[str], out: TextIO) -> int:
    """``rdma-cni release-previous-boot``: what the agent's CNI server runs when it starts.

    Prints what it did as JSON; exit 0, or 1 when a release failed or the state cannot be reached.
    """
    import argparse

    from rdma_cni.cni.config import DEFAULT_LOCK_FILE, DEFAULT_STATE_DIR

    p = argparse.ArgumentParser(
        prog="rdma-cni release-previous-boot",
        description="Release the allocation records an earlier boot left (their VFs, names, IPAM).",
    )
    p.add_argument("--state-dir", default=DEFAULT_STATE_DIR, help="default: %(default)s")
    p.add_argument("--lock-file", default=DEFAULT_LOCK_FILE, help="default: %(default)s")
    p.add_argument("--lock-timeout", type=float, default=60.0, help="seconds; default: %(default)s")
    args = p.parse_args(argv)
    for handler in logging.getLogger("rdma_cni").handlers:
        handler.setLevel(logging.INFO)  # what was released reaches the agent's log
    from rdma_cni.launch.startup import defer_unused
    from rdma_cni.verbs.gc import release_previous_boot

    defer_unused()
    try:
        sweep = release_previous_boot(args.state_dir, args.lock_file, args.lock_timeout)
    except CniError as exc:
        _write(out, {"error": exc.msg, "code": exc.code})
        return 1
    _write(out, {"checked": True} if sweep is None else sweep.to_dict())
    return 1 if sweep is not None and sweep.failed else 0
