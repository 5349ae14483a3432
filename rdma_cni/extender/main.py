"""``rdma-cni scheduler-extender``: check the options, load TLS and credentials, start the service, serve.

The options are :mod:`rdma_cni.extender.options`', the wiring and its
start-up order (ready only once the node cache is synced and reservations
are rebuilt) :mod:`rdma_cni.extender.service`'s. Exit codes: 2 for options
that cannot work together (or a listener anyone could call), 1 for what
cannot be loaded or bound, 0 after SIGTERM or SIGINT.
"""

from __future__ import annotations

import json
import logging
import signal
import ssl
import sys
import threading
from typing import Any, TextIO

from rdma_cni.extender.certs import ServingTls, TlsFilesError
from rdma_cni.extender.listener import UnauthenticatedListener, check_listener
from rdma_cni.extender.options import settings
from rdma_cni.extender.service import MetricsListenError, Service
from rdma_cni.extender.settings import Settings

__all__ = ["main"]

PROG = "rdma-cni scheduler-extender"


class _Exit(Exception):
    """Stop with ``code`` after saying ``message`` on stderr."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def main(argv: list[str], out: TextIO) -> int:
    """Entry point of ``rdma-cni scheduler-extender``."""
    args = settings(argv)
    _set_log_level(args.log_level.upper())
    try:
        _check_options(args)
        serving_tls = _server_tls(args)
        tls = serving_tls.context if serving_tls is not None else None
        client = _api_client(args.kubeconfig)
        service = _service(args, serving_tls, client)
    except _Exit as exc:
        sys.stderr.write(f"{PROG}: {exc.message}\n")
        return exc.code
    done = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    service.start()
    _announce(service, args, tls, out)
    while not done.wait(1.0):
        pass
    service.stop()
    client.close()
    return 0


def _set_log_level(level: str) -> None:
    root = logging.getLogger("rdma_cni")
    root.setLevel(level)
    for handler in root.handlers:
        handler.setLevel(level)  # a long-running server logs at the chosen level


def _check_options(args: Settings) -> None:
    """Options that go together, and a listener that needs client certificates, before anything is loaded."""
    if bool(args.tls_cert) != bool(args.tls_key):
        raise _Exit(2, "--tls-cert and --tls-key go together")
    if args.client_ca and not args.tls_cert:
        raise _Exit(2, "--client-ca needs --tls-cert and --tls-key")
    if args.client_names and not args.client_ca:
        raise _Exit(2, "--client-name needs --client-ca")
    if not args.client_ca:
        try:
            check_listener(args.listen[0], None)  # before anything is loaded or bound
        except UnauthenticatedListener as exc:
            raise _Exit(2, str(exc)) from None


def _server_tls(args: Settings) -> ServingTls | None:
    """The server's TLS files (None: plain HTTP), requiring client certificates with --client-ca;
    re-read when they change (a rotated Secret), so that a rotation needs no restart."""
    if not args.tls_cert:
        return None
    assert args.tls_key is not None  # _check_options: they go together
    try:
        return ServingTls(args.tls_cert, args.tls_key, args.client_ca)
    except TlsFilesError as exc:
        raise _Exit(1, str(exc)) from None


def _api_client(kubeconfig: str | None) -> Any:
    from rdma_cni.cni.errors import CniError
    from rdma_cni.kube import client as kubeapi

    try:
        return kubeapi.ApiClient.from_kubeconfig(kubeconfig)
    except CniError as exc:
        raise _Exit(1, exc.msg) from None


def _service(args: Settings, serving_tls: ServingTls | None, client: Any) -> Service:
    """The service, its listeners bound; :class:`_Exit` when one cannot be."""
    from rdma_cni.kube.events import EventSink

    try:
        return Service(
            client,
            args,
            serving_tls=serving_tls,
            events=EventSink(client.post, "rdma-cni-extender") if args.events else None,
        )
    except UnauthenticatedListener as exc:  # a host name that resolved to a non-loopback address
        client.close()
        raise _Exit(2, str(exc)) from None
    except MetricsListenError as exc:
        raise _Exit(1, str(exc)) from None
    except OSError as exc:
        where = "{}:{}".format(*args.listen)
        if args.probe_listen is not None:
            where += " or --probe-listen {}:{}".format(*args.probe_listen)
        raise _Exit(1, f"cannot listen on {where}: {exc}") from None


def _announce(service: Service, args: Settings, tls: ssl.SSLContext | None, out: TextIO) -> None:
    """One JSON line on ``out``: where the service listens (tests and operators read it)."""
    host, port = service.address
    announced: dict[str, Any] = {
        "listening": f"{host}:{port}",
        "tls": tls is not None,
        "client_ca": bool(args.client_ca),
    }
    if service.probe_address is not None:
        announced["probes"] = "{}:{}".format(*service.probe_address)
    if service.metrics_address is not None:
        announced["metrics"] = "{}:{}".format(*service.metrics_address)
    out.write(json.dumps(announced) + "\n")
    out.flush()
