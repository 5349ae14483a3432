"""CPU per filter in-process: the extender's filter verb as rdma-scheduler calls it at scale.

Run by hand: ``.venv/bin/python benchmarks/filter_cpu.py [--nodes 5000] [--sample 500]``.
The Extender of ``--best-nodes=1`` (conf/'s) is built on the node states of
benchmarks/extender_bench.py, without a server or an API: each pod's
ExtenderArgs (decoded from JSON, as the server does) names ``--sample`` nodes
drawn at random, as kube-scheduler's own sample of a large cluster is another
part of it pod after pod, and each filter holds its one passing node, as
filter does, so reservations build up as in a burst. The retrier of refused pods
(extender/retry.py) is wired in as the service wires it, its thread not started
(``--without-retrier`` leaves it out, for the difference). It reports the process
CPU time per filter (``time.process_time``), after a warm-up, so other load on
the machine changes the figure less than a wall-clock one would. With
``--profile`` it prints cProfile's top functions too.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.extender_bench import node_specs, pod_object, pod_specs  # noqa: E402
from rdma_cni.extender.decide import Decider  # noqa: E402
from rdma_cni.extender.demand import Demands  # noqa: E402
from rdma_cni.extender.reservations import Reservations  # noqa: E402
from rdma_cni.extender.retry import Retrier  # noqa: E402
from rdma_cni.extender.settings import Settings  # noqa: E402
from rdma_cni.extender.verbs import Extender  # noqa: E402
from rdma_cni.shared import nodestate  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Build the extender, filter the pods, print the CPU per filter."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--sample", type=int, default=500, help="nodes named per filter (default 500)")
    parser.add_argument("--pods", type=int, default=2000)
    parser.add_argument("--warm", type=int, default=200, help="filters before the clock starts")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--without-retrier", action="store_true", help="no retrier of refused pods")
    args = parser.parse_args(argv)
    settings = Settings(best_nodes=1)
    decider = Decider(settings=settings)
    views = {
        s["name"]: decider.view(s["annotations"][nodestate.ANNOTATION]) for s in node_specs(args.nodes, 1)
    }
    demands = Demands(annotation=settings.annotation)
    reservations = Reservations(settings.reservation_ttl)
    retrier = None
    if not args.without_retrier:
        retrier = Retrier(None, decider, demands, reservations, lambda: views, settings.scheduler_names)
    ext = Extender(
        decider=decider,
        demands=demands,
        reservations=reservations,
        cache_views=lambda: views,
        cache_generation=lambda: 1,
        settings=settings,
        retrier=retrier,
    )
    ext.ready.set()
    rng = random.Random(3)
    names = list(views)
    bodies = [
        json.dumps(
            {"Pod": pod_object(p), "Nodes": None, "NodeNames": rng.sample(names, args.sample)}
        ).encode()
        for p in pod_specs(args.warm + args.pods, 2, "p")
    ]
    passed = 0
    for body in bodies[: args.warm]:
        ext.filter_encoded(json.loads(body))
    profile = cProfile.Profile() if args.profile else None
    start = time.process_time()
    if profile is not None:
        profile.enable()
    for body in bodies[args.warm :]:
        answer = ext.filter_encoded(json.loads(body))
        passed += b'"NodeNames":[]' not in answer if isinstance(answer, bytes) else 0
    if profile is not None:
        profile.disable()
    per = (time.process_time() - start) / args.pods * 1e3
    print(f"{args.nodes} nodes, {args.sample} per filter, {args.pods} pods ({passed} passed a node):")
    print(f"{per:.2f} ms CPU per filter ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")
    if profile is not None:
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
