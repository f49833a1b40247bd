"""Serving: one I/O thread reads whole requests (TLS handshake, head and body) without
blocking, under a deadline; a few workers compute the answers, scrapes and proven
credentials first; connections and pending output are capped (the comment above
``EventServer``). What a request is answered with is routing.py's.
"""

from __future__ import annotations

import itertools
import logging
import queue
import re
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler

from profagent.exporters.http.auth import Authenticator, client_key
from profagent.system.cputime import CPU

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 64 * 1024  # head and body of one request; we only serve GET and HEAD
MAX_PENDING_OUTPUT = 256 * 1024**2  # answers written but not yet taken by their clients, all together


@dataclass(frozen=True)
class HttpLimits:
    """The endpoint's caps (keys ``http.*``); the defaults are the config's."""

    request_deadline: float = 10.0
    max_connections: int = 256
    max_connections_per_client: int = 16
    workers: int = 4
    auth_backoff_max: float = 5.0


# Connection states. Reading and writing happen in the one I/O thread, never in a worker,
# so a slow client costs a socket and a buffer, never a thread.
_HANDSHAKE, _READING, _QUEUED, _HELD, _WRITING = range(5)
_CONTENT_LENGTH = re.compile(rb"^content-length[ \t]*:[ \t]*(\d{1,12})[ \t]*\r?$", re.I | re.M)
_TRANSFER_ENCODING = re.compile(rb"^transfer-encoding[ \t]*:", re.I | re.M)
_REQUEST_PATH = re.compile(rb"^[A-Z]+ ([^ ?\r\n]*)")
_PRIORITY_PATHS = (b"/metrics", b"/healthz")


class _Conn:
    __slots__ = ("sock", "address", "client", "state", "buf", "out", "close_after", "eof", "deadline", "release_at")

    def __init__(self, sock: socket.socket, address: tuple, deadline: float) -> None:
        self.sock = sock
        self.address = address
        self.client = client_key(str(address[0]))
        self.state = _READING
        self.buf = bytearray()
        self.out: list[memoryview] = []  # the answer still to send (the body is the shared exposition, not a copy)
        self.close_after = False
        self.eof = False  # the client has shut its side: answer what it sent, then close
        self.deadline = deadline  # reading the whole request, or writing the whole answer, ends by then
        self.release_at = 0.0  # a held (delayed) answer goes out then


class Chunks:
    """A write-only file that keeps what is written by reference (no copy of the body)."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.chunks.append(data)
        return len(data)

    def flush(self) -> None:
        pass


# The endpoint may face the network and every local user. One I/O thread reads each whole
# request (TLS handshake, head and body) without blocking, under a deadline for the whole
# request (``http.request_deadline``); only then does one of a few workers compute the answer,
# scrapes and already-proven credentials first. A slow client therefore holds a socket and a
# buffer, never a worker. Connections are capped in all and per client
# (``http.max_connections``, ``http.max_connections_per_client``); at the cap, the connection
# that has been reading its request longest is closed to make room, one that has begun a
# request before one that has sent nothing yet. Failed logins delay the
# failing answers of that client only (``http.auth_backoff_max``); a correct password is
# always accepted.
class EventServer:
    """One I/O thread reads whole requests (and TLS handshakes) without blocking; a
    fixed pool of workers only computes answers, scrapes and proven credentials first."""

    def __init__(self, listener: socket.socket, handler: type[BaseHTTPRequestHandler], limits: HttpLimits,
                 ssl_context: ssl.SSLContext | None, auth: Authenticator, peer_check: Callable[[ssl.SSLSocket], bool] | None) -> None:
        self.listener = listener
        self.handler = handler
        self.limits = limits
        self.ssl_context = ssl_context
        self.auth = auth
        self.peer_check = peer_check
        self.refused: dict[str, int] = {"per_client": 0, "evicted": 0, "deadline": 0, "too_large": 0, "tls": 0, "output": 0}
        self._conns: dict[int, _Conn] = {}
        self._per_client: dict[str, int] = {}
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._seq = itertools.count()
        self._stop = False
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._threads: list[threading.Thread] = []

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        self.listener.setblocking(False)
        self._sel.register(self.listener, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._threads = [threading.Thread(target=self._loop, name="profagent-http", daemon=True)]
        self._threads += [threading.Thread(target=self._work, name=f"profagent-http-{i}", daemon=True)
                          for i in range(max(1, self.limits.workers))]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop = True
        self._wake()
        for _ in range(max(1, self.limits.workers)):
            self._queue.put((-1, next(self._seq), None, b""))
        for t in self._threads:
            t.join(timeout=10)
        for conn in list(self._conns.values()):
            self._close(conn)
        self._sel.close()
        self.listener.close()
        self._wake_r.close()
        self._wake_w.close()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass  # already pending, or closing

    # -- the I/O thread -------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop:
            ready = self._sel.select(0.25)
            with CPU.charge("http"):
                self._step(ready)

    def _step(self, ready: list) -> None:
        """One turn of the I/O thread: what select() found, answers to send, deadlines."""
        for key, _ in ready:
            if key.data == "accept":
                self._guarded(self._accept, None)
            elif key.data == "wake":
                try:
                    while self._wake_r.recv(4096):
                        pass
                except (BlockingIOError, OSError):
                    pass
            else:
                self._guarded(self._on_ready, key.data)
        self._take_answers()
        now = time.monotonic()
        for conn in list(self._conns.values()):
            if conn.state == _HELD and now >= conn.release_at:
                self._guarded(self._start_write, conn)
            elif conn.state in (_HANDSHAKE, _READING, _WRITING) and now >= conn.deadline:
                self.refused["deadline"] += 1
                self._close(conn)

    def _guarded(self, step: Callable, conn: _Conn | None) -> None:
        """One connection's surprise never stops the I/O thread: that connection is closed."""
        try:
            step() if conn is None else step(conn)
        except Exception as exc:
            log.warning("HTTP connection %s failed: %r", conn.address if conn else "accept", exc)
            if conn is not None:
                self._close(conn)

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, address = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: try again on the next event
                log.warning("accepting an HTTP connection failed: %s", exc)
                return
            client = client_key(str(address[0]))
            # At a cap, the connection that has been sending its request longest makes room
            # (a scrape sends its request at once, a slow client is the oldest; see
            # _evict_slowest); a client sharing its address with an attacker (loopback) is
            # thus still served.
            if self._per_client.get(client, 0) >= self.limits.max_connections_per_client and not self._evict_slowest(client):
                self._refuse("per_client", sock, f"more than {self.limits.max_connections_per_client} connections from {client}")
                continue
            if len(self._conns) >= self.limits.max_connections and not self._evict_slowest(None):
                self._refuse("evicted", sock, f"more than {self.limits.max_connections} HTTP connections")
                continue
            sock.setblocking(False)
            try:  # headers and body go out as two writes; Nagle + delayed ACK would add ~40 ms
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            conn = _Conn(sock, address, time.monotonic() + self.limits.request_deadline)
            if self.ssl_context is not None:
                conn.sock = self.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                conn.state = _HANDSHAKE
            self._conns[id(conn)] = conn
            self._per_client[client] = self._per_client.get(client, 0) + 1
            self._sel.register(conn.sock, selectors.EVENT_READ, conn)
            self._on_ready(conn)  # a prompt client's request is usually here already

    def _refuse(self, reason: str, sock: socket.socket, what: str) -> None:
        self.refused[reason] += 1
        if self.refused[reason] % 100 == 1:
            log.warning("%s: closing new ones (%d so far)", what, self.refused[reason])
        sock.close()

    def _evict_slowest(self, client: str | None) -> bool:
        """Close the connection (of ``client``, or of anyone) that has been reading its request
        longest, one that has sent part of a request before one that has sent nothing yet: a
        scrape just accepted may not have sent its request, a slow client has begun. A
        candidate's socket is read first, so a request already there (the accept loop ran
        before the selector) is answered, not lost."""
        candidates = sorted((c for c in self._conns.values()
                             if c.state in (_HANDSHAKE, _READING) and (client is None or c.client == client)),
                            key=lambda c: (not c.buf, c.deadline))
        for conn in candidates:
            if conn.state == _READING:
                self._read(conn)
                if id(conn) not in self._conns:
                    return True  # it had hung up (or failed): its slot is free
            if conn.state in (_HANDSHAKE, _READING):
                self._evict(conn, client)
                return True
        return False  # every candidate had its whole request in: queued, it still holds its slot

    def _evict(self, conn: _Conn, client: str | None) -> None:
        reason = "per_client" if client else "evicted"
        self.refused[reason] += 1
        if self.refused[reason] % 100 == 1:
            cap = f"{self.limits.max_connections_per_client} connections from {client}" if client else f"{self.limits.max_connections} HTTP connections"
            log.warning("%s at once: closing the slowest to make room (%d so far)", cap, self.refused[reason])
        self._close(conn)

    def _close(self, conn: _Conn) -> None:
        if self._conns.pop(id(conn), None) is None:
            return
        left = self._per_client.get(conn.client, 1) - 1
        if left > 0:
            self._per_client[conn.client] = left
        else:
            self._per_client.pop(conn.client, None)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        try:
            conn.sock.close()
        except OSError:
            pass

    def _set_events(self, conn: _Conn, events: int) -> None:
        try:
            self._sel.modify(conn.sock, events, conn)
        except KeyError:
            self._sel.register(conn.sock, events, conn)

    def _on_ready(self, conn: _Conn) -> None:
        if conn.state == _HANDSHAKE:
            self._handshake(conn)
        elif conn.state == _READING:
            self._read(conn)
        elif conn.state == _WRITING:
            self._write(conn)

    def _handshake(self, conn: _Conn) -> None:
        try:
            conn.sock.do_handshake()  # type: ignore[attr-defined]
        except ssl.SSLWantReadError:
            self._set_events(conn, selectors.EVENT_READ)
            return
        except ssl.SSLWantWriteError:
            self._set_events(conn, selectors.EVENT_WRITE)
            return
        except (ssl.SSLError, OSError) as exc:
            log.debug("TLS handshake from %s failed: %s", conn.address, exc)
            self.refused["tls"] += 1
            self._close(conn)
            return
        if self.peer_check is not None and not self.peer_check(conn.sock):  # type: ignore[arg-type]
            log.debug("TLS client %s refused: certificate not allowed", conn.address)
            self.refused["tls"] += 1
            self._close(conn)
            return
        conn.state = _READING
        self._set_events(conn, selectors.EVENT_READ)
        self._read(conn)  # the request may have come with the handshake's last flight

    def _read(self, conn: _Conn) -> None:
        while True:
            try:
                chunk = conn.sock.recv(16384)
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                break
            except OSError:
                self._close(conn)
                return
            if not chunk:
                conn.eof = True
                break
            conn.buf += chunk
            if len(conn.buf) > MAX_REQUEST_BYTES:
                break
        self._dispatch(conn)
        if conn.eof and conn.state == _READING:  # nothing (more) to answer
            self._close(conn)

    def _dispatch(self, conn: _Conn) -> None:
        """Queue the request once its head and body are in; answer errors here."""
        end = conn.buf.find(b"\r\n\r\n")
        if end < 0:
            if len(conn.buf) > MAX_REQUEST_BYTES:
                self._error(conn, 431, "Request Header Fields Too Large")
            return
        head = bytes(conn.buf[: end + 4])
        if _TRANSFER_ENCODING.search(head):
            self._error(conn, 501, "Not Implemented")
            return
        length = _CONTENT_LENGTH.search(head)
        total = len(head) + (int(length.group(1)) if length else 0)
        if total > MAX_REQUEST_BYTES:
            self._error(conn, 413, "Content Too Large")
            return
        if len(conn.buf) < total:
            return
        request = bytes(conn.buf[:total])
        del conn.buf[:total]
        conn.state = _QUEUED
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        self._queue.put((self._priority(head), next(self._seq), conn, request))

    def _priority(self, head: bytes) -> int:
        """0: a scrape needing no bcrypt; 1: another cheap request; 2: a password to check."""
        if self.auth.enabled:
            m = re.search(rb"^authorization[ \t]*:[ \t]*(.*?)[ \t]*\r?$", head, re.I | re.M)
            if not self.auth.cached(m.group(1).decode("latin-1") if m else None):
                return 2
        path = _REQUEST_PATH.match(head)
        return 0 if path and path.group(1) in _PRIORITY_PATHS else 1

    def _error(self, conn: _Conn, status: int, reason: str) -> None:
        self.refused["too_large"] += 1
        conn.out = [memoryview(f"HTTP/1.1 {status} {reason}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode())]
        conn.close_after = True
        self._start_write(conn)

    def _take_answers(self) -> None:
        while True:
            try:
                conn, out, close, delay = self._done.get_nowait()
            except queue.Empty:
                return
            if id(conn) not in self._conns:
                continue
            conn.out, conn.close_after = [memoryview(b) for b in out if b], close
            self._bound_output(conn)
            if delay > 0:
                conn.state, conn.release_at = _HELD, time.monotonic() + delay
            else:
                self._start_write(conn)

    def _bound_output(self, newest: _Conn) -> None:
        """Answers not yet taken by their clients stay under MAX_PENDING_OUTPUT: clients
        that do not read are closed, the one writing longest first."""
        pending = {id(c): sum(len(m) for m in c.out) for c in self._conns.values() if c.out}
        total = sum(pending.values())
        while total > MAX_PENDING_OUTPUT:
            writers = [c for c in self._conns.values() if c.out and c is not newest and c.state in (_WRITING, _HELD)]
            if not writers:
                return
            slowest = min(writers, key=lambda c: c.deadline)
            total -= pending[id(slowest)]
            self.refused["output"] += 1
            if self.refused["output"] % 100 == 1:
                log.warning("HTTP answers not taken by their clients hold over %d bytes: closing the slowest (%d so far)",
                            MAX_PENDING_OUTPUT, self.refused["output"])
            self._close(slowest)

    def _start_write(self, conn: _Conn) -> None:
        conn.state = _WRITING
        conn.deadline = time.monotonic() + self.limits.request_deadline
        self._set_events(conn, selectors.EVENT_WRITE)
        self._write(conn)

    def _write(self, conn: _Conn) -> None:
        try:
            while conn.out:
                sent = conn.sock.send(conn.out[0][:262144])
                conn.out[0] = conn.out[0][sent:]
                if not conn.out[0]:
                    conn.out.pop(0)
        except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
            return
        except OSError:
            self._close(conn)
            return
        if conn.close_after:
            self._close(conn)
            return
        conn.state = _READING  # keep-alive: the next request has a new deadline
        conn.deadline = time.monotonic() + self.limits.request_deadline
        self._set_events(conn, selectors.EVENT_READ)
        self._dispatch(conn)  # a pipelined request may already be buffered
        if conn.eof and conn.state == _READING:
            self._close(conn)

    # -- workers ---------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            _, _, conn, request = self._queue.get()
            if conn is None:
                return
            try:
                with CPU.charge("http"):
                    handler = self.handler((conn.sock, request), conn.address, self)  # type: ignore[arg-type]
                answer = (conn, handler.wfile.chunks, handler.close_connection, handler.hold)
            except Exception as exc:  # never lose a worker
                log.warning("HTTP worker failed: %s", exc)
                answer = (conn, [], True, 0.0)
            self._done.put(answer)
            self._wake()
