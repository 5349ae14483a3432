"""``rdma-cni claim``: the DRA ResourceClaimTemplate asking for what a pod annotation asks.

A pod moving from the annotation (and the scheduler extender) to DRA keeps
its request as it is and gets the template from it (docs/dra.md)::

    rdma-cni claim --name trainer --network rdma-dra \\
        '[{"min_tx_rate": 15000, "max_tx_rate": 20000}, {"min_tx_rate": 5000}, {}]'

The request is parsed by the annotation's own parser (same limits, same
messages, exit 1 with code 101); the template is printed as JSON (which
kubectl reads as YAML too) on stdout, and how a pod refers to it on stderr.
"""

from __future__ import annotations

import argparse
import json
from typing import TextIO

from rdma_cni.launch.startup import quiet_pydantic

DEFAULT_NETWORK = "rdma-dra"


def main(argv: list[str], out: TextIO) -> int:
    """Entry point of ``rdma-cni claim``: 0 and the template, or 1 and the parser's error (code 101)."""
    import sys

    from rdma_cni.shared import names
    from rdma_cni.shared.dra import DEVICE_CLASS

    parser = argparse.ArgumentParser(prog="rdma-cni claim", description=__doc__.split("\n\n")[0])
    parser.add_argument("request", help="the request as the annotation holds it (JSON)")
    parser.add_argument("--name", default="rdma", help="the template's name (default: %(default)s)")
    parser.add_argument("--namespace", help="the template's namespace (default: none, kubectl's)")
    parser.add_argument(
        "--network",
        default=DEFAULT_NETWORK,
        help="the DRA network the pod attaches (its NetworkAttachmentDefinition; default: %(default)s)",
    )
    parser.add_argument(
        "--device-class", default=DEVICE_CLASS, help="the DeviceClass of conf/dra.yaml (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    for flag, value, ok, rule in (
        ("--name", args.name, names.dns_subdomain(args.name), names.SUBDOMAIN_RULE),
        ("--network", args.network, names.valid_network_name(args.network), names.NETWORK_RULE),
        ("--device-class", args.device_class, names.dns_subdomain(args.device_class), names.SUBDOMAIN_RULE),
    ):
        if not ok:
            parser.error(f"{flag} {value!r} is not {rule}")
    if args.namespace is not None and not names.dns_label(args.namespace):
        parser.error(f"--namespace {args.namespace!r} is not {names.LABEL_RULE}")
    quiet_pydantic()
    from rdma_cni.shared.dra.claims import claim_template
    from rdma_cni.shared.errors import CniError
    from rdma_cni.shared.podrequest import parse_request

    try:
        request = parse_request(args.request, "the request")
    except CniError as exc:
        out.write(json.dumps({"error": exc.msg, "code": exc.code}) + "\n")
        return 1
    template = claim_template(
        request,
        name=args.name,
        network=args.network,
        namespace=args.namespace,
        device_class=args.device_class,
    )
    out.write(json.dumps(template, indent=2) + "\n")
    sys.stderr.write(
        f"rdma-cni claim: a pod uses it with spec.resourceClaims: [{{name: rdma, resourceClaimTemplateName: "
        f"{args.name}}}], resources.claims: [{{name: rdma}}] in a container, and the annotation "
        f"k8s.v1.cni.cncf.io/networks: {args.network} (docs/dra.md)\n"
    )
    return 0
