"""A pass-through between kube-scheduler and the extender that remembers what kube-scheduler sent.

kube-scheduler's ``urlPrefix`` points here; each request is forwarded as it
came (method, path, body, content type) to the extender on loopback and its
answer returned unchanged. For every call the recorder keeps the verb, the
pod it was about and the answer's status; the first few bodies of each verb
are kept whole, for the wire fixture the unit tier replays. Listens on
127.0.0.1 only, on a port the kernel picks.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

KEEP_WHOLE = 3  # bodies kept whole per verb
MAX_BODY = 64 * 1024 * 1024


@dataclass(frozen=True)
class Call:
    """One call as the recorder saw it."""

    verb: str
    pod: str  # namespace/name, '' when the body names none
    status: int


@dataclass
class Recorder:
    """The running recorder: its port, the calls and the whole bodies kept."""

    target_port: int
    calls: list[Call] = field(default_factory=list)
    whole: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    server: ThreadingHTTPServer | None = None
    # Seconds each call of a verb waits before it is forwarded: a test widens a race kube-scheduler
    # runs anyway (the next pod's filter before the previous pod's bind) so it is lost every time.
    delays: dict[str, float] = field(default_factory=dict)

    @property
    def port(self) -> int:
        """The port kube-scheduler calls."""
        assert self.server is not None
        return int(self.server.server_address[1])

    def pods(self, verb: str) -> set[str]:
        """The pods (namespace/name) kube-scheduler asked about with ``verb``."""
        with self.lock:
            return {c.pod for c in self.calls if c.verb == verb}

    def count(self, verb: str) -> int:
        """How many ``verb`` calls went through."""
        with self.lock:
            return sum(1 for c in self.calls if c.verb == verb)

    def record(self, verb: str, request: bytes, status: int, answer: bytes) -> None:
        """Remember one call."""
        try:
            doc = json.loads(request)
        except ValueError:
            doc = None
        with self.lock:
            self.calls.append(Call(verb, _pod_of(doc), status))
            kept = self.whole.setdefault(verb, [])
            if len(kept) < KEEP_WHOLE:
                try:
                    reply = json.loads(answer)
                except ValueError:
                    reply = answer.decode("utf-8", "replace")
                kept.append({"request": doc, "status": status, "answer": reply})

    def stop(self) -> None:
        """Stop serving."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def _pod_of(doc: Any) -> str:
    if not isinstance(doc, dict):
        return ""
    if "PodName" in doc:  # ExtenderBindingArgs
        return f"{doc.get('PodNamespace')}/{doc.get('PodName')}"
    meta = (doc.get("Pod") or {}).get("metadata") or {}
    return f"{meta.get('namespace')}/{meta.get('name')}" if meta else ""


class _Server(ThreadingHTTPServer):
    """The recorder's listener, with as deep a queue of connections as the extender's own.

    socketserver listens with a backlog of 5; kube-scheduler binds each pod in a goroutine of its
    own, each on a connection of its own when they overlap, and the kernel drops the handshakes
    past the backlog (the retransmission costs them a second or more).
    """

    daemon_threads = True
    request_queue_size = 1024


def start_recorder(target_port: int) -> Recorder:
    """Start a recorder forwarding to the extender on ``127.0.0.1:target_port``."""
    recorder = Recorder(target_port)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as kube-scheduler's client expects

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                self.send_error(413)
                return
            body = self.rfile.read(length)
            delay = recorder.delays.get(self.path.rsplit("/", 1)[-1], 0.0)
            if delay:
                time.sleep(delay)
            conn = http.client.HTTPConnection("127.0.0.1", recorder.target_port, timeout=60)
            try:
                conn.request(
                    "POST",
                    self.path,
                    body=body,
                    headers={"Content-Type": self.headers.get("Content-Type", "application/json")},
                )
                resp = conn.getresponse()
                answer, status, ctype = resp.read(), resp.status, resp.getheader("Content-Type", "")
            except (OSError, http.client.HTTPException) as exc:
                # An answer cut short is the extender's failure to show, not the recorder's to hide
                # behind a dropped connection (kube-scheduler would report only "EOF").
                self.send_error(502, explain=f"{type(exc).__name__}: {exc}"[:300])
                return
            finally:
                conn.close()
            recorder.record(self.path.rsplit("/", 1)[-1], body, status, answer)
            self.send_response(status)
            self.send_header("Content-Type", ctype or "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass  # the calls are recorded, not logged

    recorder.server = _Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=recorder.server.serve_forever, daemon=True).start()
    return recorder
