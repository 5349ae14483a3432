"""A TCP relay on 127.0.0.1 that a test can cut: a network partition between a client and its server.

Bytes pass unchanged (TLS included, so the client still checks the server's
certificate). :meth:`Relay.cut` closes every connection and turns new ones
away (accepted, then closed at once) until :meth:`Relay.resume`.
:attr:`Relay.delay` holds every chunk the server sends for that many seconds
before the client gets it (in order): the client's view of the server, its
watches included, trails everyone else's by that much, while what it sends
arrives at once.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time

_CHUNK = 64 * 1024


class Relay:
    """Forwards ``127.0.0.1:<port>`` to ``target`` until cut."""

    def __init__(self, target: tuple[str, int], delay: float = 0.0) -> None:
        self.target = target
        # Seconds each chunk from the server waits before it is sent on to the client (read per chunk).
        self.delay = delay
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._cut = False
        self.turned_away = 0
        threading.Thread(target=self._accept, name="relay", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._cut:
                    self.turned_away += 1
                    client.close()
                    continue
            try:
                server = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._open |= {client, server}
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()
            threading.Thread(target=self._pump_late, args=(server, client), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(_CHUNK):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            self._close(src, dst)

    def _pump_late(self, src: socket.socket, dst: socket.socket) -> None:
        """:meth:`_pump`, each chunk sent :attr:`delay` seconds after it came (a thread sends them)."""
        chunks: queue.SimpleQueue[tuple[float, bytes] | None] = queue.SimpleQueue()
        threading.Thread(target=self._send_late, args=(chunks, src, dst), daemon=True).start()
        try:
            while data := src.recv(_CHUNK):
                chunks.put((time.monotonic() + self.delay, data))
        except OSError:
            pass
        finally:
            chunks.put(None)

    def _send_late(
        self, chunks: queue.SimpleQueue[tuple[float, bytes] | None], src: socket.socket, dst: socket.socket
    ) -> None:
        try:
            while (item := chunks.get()) is not None:
                due, data = item
                if (wait := due - time.monotonic()) > 0:
                    time.sleep(wait)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            self._close(src, dst)

    def _close(self, *socks: socket.socket) -> None:
        for s in socks:
            with self._lock:
                self._open.discard(s)
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def cut(self) -> None:
        """Close every relayed connection and refuse new ones."""
        with self._lock:
            self._cut = True
            live = list(self._open)
        self._close(*live)

    def resume(self) -> None:
        """Relay new connections again."""
        with self._lock:
            self._cut = False

    def close(self) -> None:
        """Stop listening and close everything."""
        self.cut()
        self._listener.close()
