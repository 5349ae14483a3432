"""Client TLS for the Kubernetes API: certificate files, the SSL context, and a warm server's context cache.

Both clients build their TLS from :class:`~rdma_cni.kube.credentials.ClusterCredentials`:
:func:`tls_files` gives inline PEM data the file paths ``load_cert_chain``
needs, :func:`ssl_context` builds the client context.

The plugin's pod GET asks :func:`client_context`, which a warm server
(:mod:`rdma_cni.launch.warm`) can answer from contexts it keeps: a child that had to
build one tells the server (:func:`note_context_miss`, through the pipe whose
fd the server sets in :data:`context_hint_fd`), and the server builds it too
(:func:`keep_context`) so that later children inherit it. The agent's verb
workers, which run many verbs each, keep the contexts they build themselves
(:data:`keep_built`). A cold start keeps, reads and hashes nothing for this.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import ssl
from collections.abc import Iterator

from rdma_cni.cni.errors import KubernetesError
from rdma_cni.kube.credentials import ClusterCredentials
from rdma_cni.kube.status import describe

# Client TLS contexts by the digest of what they were built from (the CA, the
# client certificate and key: their content, never their paths). A warm
# server fills this for the kubeconfigs its children used (keep_context), so
# each later child inherits a built context instead of parsing certificates
# again; a changed file has another digest, so a context is never stale.
_CONTEXTS: dict[bytes, ssl.SSLContext] = {}
_MAX_CONTEXTS = 8
# Set by a warm server's child: where to say that a kubeconfig's context was not
# there (see note_context_miss); -1 otherwise.
context_hint_fd = -1
_missed: str | None = None
# Set by a process that runs many verbs (the agent's verb workers): it keeps the contexts it builds.
keep_built = False


def _material(creds: ClusterCredentials) -> tuple[bytes, ClusterCredentials] | None:
    """The digest of what :func:`ssl_context` would be built from, and ``creds`` with those bytes inline.

    Building from the inline copy means the context is made of exactly the
    bytes the digest names, even if a file changes meanwhile. None when it
    cannot be cached: the system trust store (its content is not read here),
    or a file that cannot be read now (building the context reports that).
    """
    if not creds.insecure_skip_tls_verify and creds.ca_data is None and creds.ca_file is None:
        return None

    def content(data: bytes | None, path: str | None) -> bytes | None:
        if data is None and path is not None:
            with open(path, "rb") as f:
                return f.read()
        return data

    try:
        ca = None if creds.insecure_skip_tls_verify else content(creds.ca_data, creds.ca_file)
        cert = content(creds.client_cert_data, creds.client_cert_file)
        key = content(creds.client_key_data, creds.client_key_file)
    except OSError:
        return None
    import hashlib  # here: only a warm server and its children keep contexts (~1.5 ms of a cold start)

    digest = hashlib.sha256()
    for part in (ca, cert, key):
        digest.update(b"-" if part is None else b"+" + len(part).to_bytes(8, "big") + part)
    inline = dataclasses.replace(
        creds,
        ca_file=None,
        ca_data=ca,
        client_cert_file=None,
        client_cert_data=cert,
        client_key_file=None,
        client_key_data=key,
    )
    return digest.digest(), inline


def _build_context(creds: ClusterCredentials) -> ssl.SSLContext:
    with tls_files(creds, ca_in_memory=True) as (verify, cert):
        return ssl_context(verify, cert, creds.ca_data)


def client_context(creds: ClusterCredentials) -> ssl.SSLContext:
    """The client TLS context for ``creds``: one built for the same content before, else a new one."""
    global _missed
    # Only a warm server and the agent's workers keep contexts, and only a warm server's children
    # can say they built one: a cold start reads and hashes nothing for them.
    material = _material(creds) if _CONTEXTS or context_hint_fd >= 0 or keep_built else None
    context = _CONTEXTS.get(material[0]) if material is not None else None
    if context is not None:
        return context
    if keep_built and material is not None:
        return _store(*material)
    _missed = creds.source if material is not None else None
    return _build_context(creds)


def keep_context(creds: ClusterCredentials) -> bool:
    """Build and keep the context of ``creds`` for later :func:`client_context` calls (a warm server)."""
    material = _material(creds)
    if material is None or material[0] in _CONTEXTS:
        return False
    _store(*material)
    return True


def _store(key: bytes, inline: ClusterCredentials) -> ssl.SSLContext:
    """Build the context of ``inline`` (the bytes ``key`` names) and keep it, the oldest dropped first."""
    context = _build_context(inline)
    if len(_CONTEXTS) >= _MAX_CONTEXTS:
        del _CONTEXTS[next(iter(_CONTEXTS))]  # the oldest: a kubeconfig since rotated, most likely
    _CONTEXTS[key] = context
    return context


def note_context_miss(kubeconfig: str) -> None:
    """Tell the warm server, if any, that ``kubeconfig``'s context had to be built (it builds it too)."""
    global _missed
    if _missed is None or context_hint_fd < 0:
        return
    _missed = None
    line = os.fsencode(kubeconfig) + b"\n"
    if len(line) <= 512 and b"\n" not in line[:-1]:
        with contextlib.suppress(OSError):  # a full pipe or a gone server: only a lost hint
            os.write(context_hint_fd, line)


def ssl_context(
    verify: str | bool, cert: tuple[str, str] | None, ca_data: bytes | None = None
) -> ssl.SSLContext:
    """The client TLS context: the CA (``ca_data`` PEM, else the file ``verify`` names, else the
    system trust store), an optional client certificate."""
    if verify is False:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        try:
            if ca_data is not None:
                # PEM blocks are ASCII; text around them (a CA file's comments)
                # may not be, and OpenSSL skips it when it reads a file itself.
                context = ssl.create_default_context(cadata=ca_data.decode("ascii", errors="ignore"))
            else:
                context = ssl.create_default_context(cafile=verify if isinstance(verify, str) else None)
        except (ValueError, OSError) as exc:  # ssl.SSLError is an OSError: no certificate in it
            raise KubernetesError(
                "cannot load the API server's certificate authority", describe(exc)
            ) from exc
    if cert is not None:
        try:
            context.load_cert_chain(cert[0], cert[1])
        except (OSError, ssl.SSLError) as exc:
            raise KubernetesError(
                "cannot load the client certificate and key for the API server", describe(exc)
            ) from exc
    return context


@contextlib.contextmanager
def tls_files(
    creds: ClusterCredentials, ca_in_memory: bool = False
) -> Iterator[tuple[str | bool, tuple[str, str] | None]]:
    """Yield the CA (a path, True for the system store, False for none) and the client cert and key paths.

    ``load_cert_chain`` only accepts file paths, so inline data goes into a fresh 0700
    directory as 0600 files, removed when the block exits. With ``ca_in_memory``
    inline CA data stays in memory (the caller passes it to :func:`ssl_context`):
    the usual kubeconfig (a token and inline CA data, as ``rdma-cni install``
    writes it) then needs no files, nor tempfile's imports in a cold ADD.
    """
    tmpdir: str | None = None

    def materialise(filename: str, data: bytes) -> str:
        nonlocal tmpdir
        if tmpdir is None:
            import tempfile  # here: most kubeconfigs never need it (~2 ms of a cold start)

            tmpdir = tempfile.mkdtemp(prefix="rdma-cni-k8s-")  # mkdtemp creates it 0700
        target = os.path.join(tmpdir, filename)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return target

    try:
        verify: str | bool
        if creds.insecure_skip_tls_verify:
            verify = False
        elif creds.ca_data is not None:
            verify = True if ca_in_memory else materialise("ca.crt", creds.ca_data)
        elif creds.ca_file is not None:
            verify = creds.ca_file
        else:
            verify = True  # the system trust store
        cert_path = creds.client_cert_file
        if creds.client_cert_data is not None:
            cert_path = materialise("client.crt", creds.client_cert_data)
        key_path = creds.client_key_file
        if creds.client_key_data is not None:
            key_path = materialise("client.key", creds.client_key_data)
        cert = (cert_path, key_path) if cert_path and key_path else None
        yield verify, cert
    finally:
        if tmpdir is not None:
            import shutil

            shutil.rmtree(tmpdir, ignore_errors=True)
