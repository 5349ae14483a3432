"""The CNI server's release of an earlier boot's records, for every network of the node, at its start.

Which state directories: the ``stateDir`` and ``lockFile`` of each network
configuration the agent is told about (``--network-config``), or the
plugin's defaults when it is told about none, as the node agent chooses its
networks (:func:`rdma_cni.agent.loop.setup_agent`). Each configuration is read
and validated as the agent reads it (:func:`rdma_cni.agent.snapshot.load_view`,
the plugin's own config model: the paths absolute, as ADD insists). One that
cannot be read or that the plugin would refuse is logged and skipped: the
others are still released, and that network's own first verb of the boot
does it (:mod:`rdma_cni.node.boot`). Networks sharing a ``stateDir`` and
``lockFile`` get one pass.

How: ``rdma-cni release-previous-boot`` run as the plugin, one directory
after the other (each pass releases at most 16 records; the next verb goes
on), all within one time budget: the server does this before it serves, and
a node with many networks must not keep it from serving for a verb timeout
each. Whatever fails is logged, never fatal.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Mapping, Sequence

log = logging.getLogger("rdma_cni.agent.cniserver")

# A network's stateDir and lockFile.
StatePaths = tuple[str, str]

# What of the plugin's answer reaches the log.
ANSWER_TAIL = 4096


def network_states(network_configs: Sequence[str]) -> list[StatePaths]:
    """The ``stateDir`` and ``lockFile`` of each network named, once each (the plugin's defaults if none is).

    A configuration that cannot be read or that the plugin's config model refuses is logged and
    left out: the server's start never fails for it.
    """
    from rdma_cni.agent.snapshot import load_view
    from rdma_cni.cni.errors import CniError

    if not network_configs:
        return [plugin_default()]
    states: list[StatePaths] = []
    for path in network_configs:
        try:
            view = load_view(path)
        except CniError as exc:
            log.error(
                "records of earlier boots of %s not released at start: %s%s; its first verb releases them",
                path,
                exc.msg,
                f" ({exc.details})" if exc.details else "",
            )
            continue
        pair = (view.state_dir, view.lock_file)
        add_state(states, pair)
    return states


def plugin_default() -> StatePaths:
    """The plugin's default ``stateDir`` and ``lockFile`` (a network that names neither uses them)."""
    from rdma_cni.agent.snapshot import default_view

    view = default_view()
    return (view.state_dir, view.lock_file)


def add_state(states: list[StatePaths], pair: StatePaths) -> None:
    """Append ``pair`` to ``states`` unless it names a directory and lock already there."""
    # Compared as the plugin's checks see them (node/statedir normalizes both paths).
    key = tuple(map(os.path.normpath, pair))
    if all(tuple(map(os.path.normpath, seen)) != key for seen in states):
        states.append(pair)


def release_all(
    plugin: Sequence[str], env: Mapping[str, str], states: Sequence[StatePaths], budget: float
) -> None:
    """Run ``release-previous-boot`` through ``plugin`` for each of ``states``, ``budget`` seconds in all."""
    deadline = time.monotonic() + budget
    for state_dir, lock_file in states:
        left = deadline - time.monotonic()
        if left <= 0:
            log.error(
                "records of earlier boots in %s not released: no time left at start (%.0f s for all); "
                "the first verb of its network releases them",
                state_dir,
                budget,
            )
            continue
        release_one(plugin, env, state_dir, lock_file, left)


def release_one(
    plugin: Sequence[str], env: Mapping[str, str], state_dir: str, lock_file: str, timeout: float
) -> None:
    """One ``release-previous-boot`` pass for ``state_dir``, within ``timeout`` s; logged, never fatal."""
    # The "=" form: a value is never read as an option, whatever it starts with.
    argv = [*plugin, "release-previous-boot", f"--state-dir={state_dir}", f"--lock-file={lock_file}"]
    try:
        proc = subprocess.run(
            argv,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.error("records of earlier boots in %s not released: %s", state_dir, exc)
        return
    answer = proc.stdout.decode(errors="replace").strip()[-ANSWER_TAIL:]
    if proc.returncode == 0:
        log.info("records of earlier boots in %s: %s", state_dir, answer)
        return
    err = proc.stderr.decode(errors="replace").strip()[-ANSWER_TAIL:]
    log.error("records of earlier boots in %s: exit %d: %s %s", state_dir, proc.returncode, answer, err)
