"""The extender's TLS files: loaded at start, re-read when they change, and each certificate's expiry.

The mutual-TLS extender serves kube-scheduler with ``--tls-cert``/``--tls-key``
and accepts only clients of ``--client-ca``. In a pod these are a Secret's and
a ConfigMap's files, which the kubelet replaces in place when the objects change
(a new ``..data`` directory, the links swapped at once, about a minute after the
change). A certificate rotated that way (by cert-manager, or by hand with
``kubectl create secret tls ... --dry-run=client -o yaml | kubectl apply -f -``)
must be served without a restart: a restarted extender is not ready until its
cache has synced, and RDMA pods wait meanwhile. So :class:`ServingTls` looks at
the three files every ``interval`` seconds (a ``stat`` each) and, when one
changed, builds a new context from them, which the server hands to the next
connection (connections open go on with the context they were accepted with).
Files that do not load (a key that does not match the certificate, a file
half-written by hand, a CA file with no certificate) leave the previous context
serving: that is logged, counted and shown as
``rdma_cni_extender_certificate_reload_failed`` until a later change loads.

Expiry, for the metric and the alert that warn before kube-scheduler's calls
start failing: the serving certificate's ``notAfter`` (the earliest of its file:
a chain with its CA says when the first link ends), the earliest of the client
CA file, and that of the client certificate kube-scheduler last presented (seen
at each verified handshake). A certificate's validity is read from its DER here,
standard library only: ``ssl`` gives it for a peer's certificate only.
"""

from __future__ import annotations

import base64
import binascii
import calendar
import logging
import os
import re
import ssl
import threading
import time

__all__ = ["CertificateError", "ServingTls", "TlsFilesError", "build_context", "not_after", "read_not_after"]

log = logging.getLogger("rdma_cni.extender")

# A PEM file is a few KiB; a CA bundle of a few hundred certificates stays under this.
MAX_PEM_BYTES = 1024 * 1024
MAX_CERTIFICATES = 500
_PEM = re.compile(rb"-----BEGIN CERTIFICATE-----\s*(.*?)\s*-----END CERTIFICATE-----", re.S)


class CertificateError(ValueError):
    """A certificate whose validity cannot be read (the message says where and why)."""


class TlsFilesError(ValueError):
    """The serving certificate, its key or the client CA cannot be loaded (the message says which)."""


def _item(data: bytes, pos: int, where: str) -> tuple[int, int, int]:
    """The DER item at ``pos``: (tag, start of its content, end of its content)."""
    if pos + 2 > len(data):
        raise CertificateError(f"{where}: truncated DER")
    tag, first = data[pos], data[pos + 1]
    pos += 2
    if first < 0x80:
        length = first
    else:
        count = first & 0x7F
        if not 1 <= count <= 4 or pos + count > len(data):
            raise CertificateError(f"{where}: bad DER length")
        length = int.from_bytes(data[pos : pos + count], "big")
        pos += count
    if pos + length > len(data):
        raise CertificateError(f"{where}: truncated DER")
    return tag, pos, pos + length


def _time(tag: int, text: bytes, where: str) -> float:
    """An ASN.1 UTCTime (0x17) or GeneralizedTime (0x18), in UTC, as Unix seconds."""
    try:
        value = text.decode("ascii")
        if not value.endswith("Z"):
            raise ValueError("not UTC")
        if tag == 0x17:  # YYMMDDHHMMSSZ; RFC 5280: YY < 50 is 20YY
            year = int(value[:2])
            value = f"{2000 + year if year < 50 else 1900 + year}{value[2:]}"
        elif tag != 0x18:
            raise ValueError(f"tag {tag:#x}")
        parsed = time.strptime(value[:14], "%Y%m%d%H%M%S")
    except (UnicodeDecodeError, ValueError) as exc:
        raise CertificateError(f"{where}: bad validity time: {exc}") from None
    return float(calendar.timegm(parsed))


def not_after(der: bytes, where: str = "certificate") -> float:
    """The ``notAfter`` of one DER certificate, as Unix seconds."""
    tag, start, end = _item(der, 0, where)  # Certificate ::= SEQUENCE
    if tag != 0x30:
        raise CertificateError(f"{where}: not a certificate")
    tag, pos, end = _item(der, start, where)  # tbsCertificate ::= SEQUENCE
    if tag != 0x30:
        raise CertificateError(f"{where}: not a certificate")
    fields = []
    while pos < end and len(fields) < 5:
        tag, start, stop = _item(der, pos, where)
        fields.append((tag, start, stop))
        pos = stop
    if fields and fields[0][0] == 0xA0:  # [0] version: validity comes one later
        fields = fields[1:]
    if len(fields) < 4 or fields[3][0] != 0x30:
        raise CertificateError(f"{where}: no validity")
    _, pos, stop = fields[3]  # serialNumber, signature, issuer, validity
    tag, start, end = _item(der, pos, where)  # notBefore
    tag, start, end = _item(der, end, where)  # notAfter
    return _time(tag, der[start:end], where)


def read_not_after(path: str) -> list[float]:
    """The ``notAfter`` of every certificate of a PEM file, in its order (at least one)."""
    with open(path, "rb") as f:
        data = f.read(MAX_PEM_BYTES + 1)
    if len(data) > MAX_PEM_BYTES:
        raise CertificateError(f"{path}: over {MAX_PEM_BYTES} bytes")
    blocks = _PEM.findall(data)
    if not blocks:
        raise CertificateError(f"{path}: no PEM certificate")
    out = []
    for n, block in enumerate(blocks[:MAX_CERTIFICATES]):
        try:
            der = base64.b64decode(b"".join(block.split()), validate=True)
        except (binascii.Error, ValueError):
            raise CertificateError(f"{path}: certificate {n + 1} is not base64") from None
        out.append(not_after(der, f"{path}: certificate {n + 1}"))
    return out


def build_context(cert: str, key: str, client_ca: str | None) -> ssl.SSLContext:
    """The server's context: ``cert`` and ``key``, and with ``client_ca`` a client certificate required."""
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        tls.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise TlsFilesError(f"cannot load --tls-cert/--tls-key: {exc}") from None
    if client_ca:
        try:
            tls.load_verify_locations(cafile=client_ca)
        except (OSError, ssl.SSLError) as exc:
            raise TlsFilesError(f"cannot load --client-ca: {exc}") from None
        tls.verify_mode = ssl.CERT_REQUIRED
    return tls


def _signature(paths: tuple[str, ...]) -> tuple[tuple[int, ...] | None, ...]:
    """What says a file changed: its identity, size and times (None: it cannot be read now)."""
    out: list[tuple[int, ...] | None] = []
    for path in paths:
        try:
            st = os.stat(path)  # follows the kubelet's ..data links: a swap is a new inode
        except OSError:
            out.append(None)
            continue
        out.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(out)


class ServingTls:
    """The server's TLS context from ``cert``, ``key`` and ``client_ca``, re-read when they change.

    The constructor loads them (:class:`TlsFilesError` when it cannot: the extender does not start);
    :meth:`check` reloads after a change and says whether :attr:`context` is new.
    """

    def __init__(self, cert: str, key: str, client_ca: str | None) -> None:
        self.paths = (cert, key) + ((client_ca,) if client_ca else ())
        self.client_ca = client_ca
        self._lock = threading.Lock()
        self.signature = _signature(self.paths)
        self.context = build_context(cert, key, client_ca)
        self.expiry: dict[str, float] = {}
        self._read_expiry()
        # Reloads after a change of the files, by outcome; 1 while the files on disk do not load.
        self.reloads = {"loaded": 0, "failed": 0}
        self.failing = False
        self.last_error = ""

    def _read_expiry(self) -> None:
        """The serving certificate's and the client CA's expiry (left as they were if unreadable)."""
        for name, path in (("serving", self.paths[0]), ("client_ca", self.client_ca)):
            if path is None:
                continue
            try:
                self.expiry[name] = min(read_not_after(path))
            except (OSError, CertificateError) as exc:
                log.warning("cannot read the expiry of %s: %s", path, exc)

    def seen_client(self, not_after_seconds: float) -> None:
        """A client (kube-scheduler) presented a verified certificate ending at ``not_after_seconds``."""
        self.expiry["client"] = not_after_seconds

    def check(self) -> bool:
        """Reload when a file changed since the last look; True when :attr:`context` was replaced."""
        with self._lock:
            signature = _signature(self.paths)
            if signature == self.signature:
                return False
            self.signature = signature
            try:
                context = build_context(*self.paths[:2], self.client_ca)
            except TlsFilesError as exc:
                self.reloads["failed"] += 1
                self.failing = True
                if str(exc) != self.last_error:
                    log.error(
                        "the TLS files changed but do not load (%s): still serving the previous "
                        "certificate; they are read again when they change",
                        exc,
                    )
                self.last_error = str(exc)
                return False
            self.context = context
            self.reloads["loaded"] += 1
            self.failing = False
            self.last_error = ""
            self._read_expiry()
            log.info(
                "TLS files reloaded: serving certificate valid until %s",
                time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.expiry.get("serving", 0))),
            )
            return True
