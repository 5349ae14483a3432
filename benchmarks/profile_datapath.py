"""Where a warm ADD and DEL spend their CPU: the verbs run as a warm server's child, or as the agent's
workers, run them.

The set-up is datapath_bench's (one simulated VF, the pod read from the HTTPS
API stand-in, real host-local). This process imports what the warm server
imports (:func:`rdma_cni.launch.warm.preload`), then forks one child per verb, as
the server does, and the child runs :func:`rdma_cni.cli.main.run_cni` with the
verb's environment and config; with ``--in-process`` it runs every verb itself,
as one of the agent's verb workers does (:class:`rdma_cni.agent.verbworker.Verbs`,
its API connection kept), and the figures are this process's. Printed: per verb, the median wall and CPU
time of the child (the IPAM guard and host-local, which it waits for,
included), the CPU of host-local alone (run directly, the part nothing can
cut), and with ``--profile`` the cProfile of all runs merged, by cumulative
and by own time. Root needed. A diagnostic script, not a timed test.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import resource
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.datapath_bench import one_pod_rig
from tests.support.simnode import SimPf

SPLIT: dict[str, list[tuple[float, float, int]]] = {"ADD": [], "DEL": []}
# As a warm server does: children name the kubeconfigs whose TLS context they
# built, and this process keeps those contexts for the next children.
HINT_R, HINT_W = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)


def keep_hinted_contexts() -> None:
    """What rdma_cni.launch.warm.Server does with its children's hints."""
    from rdma_cni.kube import credentials, tls

    try:
        data = os.read(HINT_R, 65536)
    except BlockingIOError:
        return
    for path in set(filter(None, data.split(b"\n"))):
        tls.keep_context(credentials.load_credentials(os.fsdecode(path)))
    gc.freeze()


def run_child(
    verb: str, env: dict[str, str], conf: dict[str, object], profile_to: str | None, cpu_timer: bool = False
) -> tuple[float, float]:
    """Fork a child that runs one verb in-process; its (wall ms, CPU ms, children included)."""
    data = json.dumps(conf).encode()
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: what rdma_cni.launch.warm's child does, minus the hand-over
        code = 1
        try:
            os.environ.clear()
            os.environ.update(env)
            os.environ["CNI_COMMAND"] = verb
            from rdma_cni import log
            from rdma_cni.cli.main import run_cni
            from rdma_cni.kube import tls

            log.start_kind = "warm"
            tls.context_hint_fd = HINT_W
            if profile_to:
                # CPU time of this process (not wall): what a loaded node pays.
                prof = cProfile.Profile(time.process_time) if cpu_timer else cProfile.Profile()
                code, doc = prof.runcall(run_cni, dict(os.environ), data)
                prof.dump_stats(profile_to)
            else:
                code, doc = run_cni(dict(os.environ), data)
            if code:
                os.write(2, f"{verb} failed: {json.dumps(doc)}\n".encode())
        finally:
            os._exit(code)
    _, status, usage = os.wait4(pid, 0)
    wall = (time.perf_counter() - start) * 1000
    keep_hinted_contexts()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{verb} failed")
    SPLIT[verb].append((usage.ru_utime * 1000, usage.ru_stime * 1000, usage.ru_minflt))
    return wall, (usage.ru_utime + usage.ru_stime) * 1000


def run_in_process(
    verbs: Any,
    verb: str,
    env: dict[str, str],
    conf: dict[str, object],
    profile_to: str | None,
    cpu_timer: bool,
) -> tuple[float, float]:
    """Run one verb in this process as a worker does; its (wall ms, CPU ms, children included)."""
    from rdma_cni.agent.shimwire import Request

    request = Request(
        env={**{k: v for k, v in env.items() if k.startswith("CNI_")}, "CNI_COMMAND": verb},
        stdin=json.dumps(conf).encode(),
    )
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    if profile_to:
        prof = cProfile.Profile(time.process_time) if cpu_timer else cProfile.Profile()
        answer = prof.runcall(verbs.run_one, request, None)
        prof.dump_stats(profile_to)
    else:
        answer = verbs.run_one(request, None)
    wall = (time.perf_counter() - start) * 1000
    own2, children2 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    if answer.encoded[8:12] != b"\0\0\0\0":
        raise SystemExit(f"{verb} failed: {answer.encoded[24:].decode(errors='replace')}")
    user = (own2.ru_utime - own.ru_utime + children2.ru_utime - children.ru_utime) * 1000
    system = (own2.ru_stime - own.ru_stime + children2.ru_stime - children.ru_stime) * 1000
    SPLIT[verb].append(
        (user, system, own2.ru_minflt - own.ru_minflt + children2.ru_minflt - children.ru_minflt)
    )
    return wall, user + system


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument(
        "--profile", action="store_true", help="cProfile every run and print the merged profile"
    )
    parser.add_argument("--cpu", action="store_true", help="profile CPU time (process_time), not wall time")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--pfs", type=int, default=1, help="simulated PFs (the node the verbs scan)")
    parser.add_argument("--vfs", type=int, default=1, help="VFs per PF")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run the verbs in this process, as the agent's verb workers do, not in a forked child each",
    )
    parser.add_argument(
        "--launcher",
        default="dist/rdma-cni",
        help="the built binary whose guard mode guards IPAM, as in the binary's own children ('' to fork)",
    )
    args = parser.parse_args()
    if args.launcher:
        import subprocess

        # A launcher from before the guard mode would start the plugin instead: ask it first.
        probe = subprocess.run(
            [args.launcher, "--ipam-guard", "1000", "/bin/true"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            check=False,
        )
        if not probe.stdout.endswith(b"\nR 0 0 0 0\n"):
            raise SystemExit(f"{args.launcher} has no IPAM guard mode: make build, or --launcher ''")
        from rdma_cni.node import ipam_guard

        # Where the guard's launcher is kept (rdma_cni.node.ipam_guard): it is run through this fd.
        ipam_guard._launcher = (os.open(args.launcher, os.O_RDONLY | os.O_CLOEXEC), args.launcher)
    tmp = tempfile.mkdtemp(prefix="rdma-cni-prof-")
    pfs = [SimPf(f"profpf{k}", args.vfs, 25000) for k in range(args.pfs)]
    rig = one_pod_rig(tmp, "prof", pfs, "pq", "10.89.0.0/24")
    env, conf = rig.env, rig.conf
    from rdma_cni.launch.warm import preload

    preload()
    gc.freeze()  # as the warm server does before serving
    verbs = None
    if args.in_process:
        from rdma_cni.agent.verbworker import Verbs
        from rdma_cni.cli.main import cni_answer
        from rdma_cni.kube import podget

        gc.disable()  # as in a worker: collected between verbs, off their path
        os.environ.update({k: v for k, v in env.items() if not k.startswith("CNI_")})
        podget.keep_connections(True)
        verbs = Verbs(cni_answer)
        verbs.warm_up()
    wall: dict[str, list[float]] = {"ADD": [], "DEL": []}
    cpu: dict[str, list[float]] = {"ADD": [], "DEL": []}
    profiles: dict[str, list[str]] = {"ADD": [], "DEL": []}
    hl_cpu: list[float] = []
    try:
        for i in range(args.runs + 1):
            for verb in ("ADD", "DEL"):
                out = os.path.join(tmp, f"{verb}-{i}.prof") if args.profile else None
                if verbs is not None:
                    w, c = run_in_process(verbs, verb, env, conf, out, args.cpu)
                    gc.collect()
                else:
                    w, c = run_child(verb, env, conf, out, args.cpu)
                if i == 0:
                    continue  # the first ADD asks host-local VERSION and fills caches
                wall[verb].append(w)
                cpu[verb].append(c)
                if out:
                    profiles[verb].append(out)
        # host-local alone, ADD and DEL, for the floor nothing here can cut.
        hl_env = {**env, "CNI_IFNAME": "hl0"}
        hl_conf = json.dumps({"cniVersion": "1.0.0", "name": "prof", "ipam": rig.ipam}).encode()
        import subprocess

        for _ in range(args.runs):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            for verb in ("ADD", "DEL"):
                subprocess.run(
                    ["/usr/lib/cni/host-local"],
                    input=hl_conf,
                    env={**hl_env, "CNI_COMMAND": verb},
                    capture_output=True,
                    check=True,
                )
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            hl_cpu.append((after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) * 1000)
    finally:
        rig.down()
    print("| verb | wall median ms | CPU median ms (children included) |")
    print("| --- | ---: | ---: |")
    for verb in ("ADD", "DEL"):
        print(f"| {verb} | {statistics.median(wall[verb]):.1f} | {statistics.median(cpu[verb]):.1f} |")
    for verb in ("ADD", "DEL"):
        user = statistics.median(u for u, _, _ in SPLIT[verb])
        system = statistics.median(s for _, s, _ in SPLIT[verb])
        faults = statistics.median(f for _, _, f in SPLIT[verb])
        print(f"{verb}: user {user:.1f} ms, system {system:.1f} ms, {faults:.0f} minor page faults (medians)")
    total = statistics.median(cpu["ADD"]) + statistics.median(cpu["DEL"])
    print(f"ADD+DEL CPU {total:.1f} ms, of which host-local ADD+DEL alone {statistics.median(hl_cpu):.1f} ms")
    print(f"over {args.runs} runs; load average {os.getloadavg()[0]:.2f}")
    for verb, files in profiles.items():
        if not files:
            continue
        stats = pstats.Stats(files[0])
        for f in files[1:]:
            stats.add(f)
        print(f"\n===== {verb}: cProfile of {len(files)} runs, by cumulative time =====")
        stats.sort_stats("cumulative").print_stats(args.top)
        print(f"\n===== {verb}: by own time =====")
        stats.sort_stats("tottime").print_stats(args.top)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
