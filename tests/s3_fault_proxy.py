"""A fault-injecting HTTP/1.1 proxy for S3 tests, in front of the moto server.

Contract
--------
``S3FaultProxy(upstream_url)`` listens on a free port of 127.0.0.1 (``.url``) and forwards
every request to ``upstream_url``, except those a rule matches. A rule matches by HTTP
method (``None``: any) and a regex searched in the request target (path and query), and
is applied ``times`` times (``None``: always); the first rule that still applies wins.
Actions:

* ``status``: answer ``status`` (500 → ``InternalError``, 503 → ``SlowDown``, others a
  generic code) with S3's XML error body, without forwarding;
* ``delay``: wait ``seconds``, then forward;
* ``blackhole``: read the request, never answer (until the client closes or the proxy stops);
* ``cut``: forward, then send the headers with the full ``Content-Length`` and only
  ``fraction`` of the body, and close the connection;
* ``drop``: forward (the request takes effect), then close without answering: a lost answer;
* ``forward``: forward unchanged (only counts).

``rule.hits`` counts the requests a rule was applied to, ``proxy.hits`` all of them, and
``proxy.requests`` logs ``(method, target)`` of every request. Bounded: ``stop()`` ends the
accept loop, wakes every black-holed or delayed handler and closes every open connection.
"""

from __future__ import annotations

import http.client
import re
import select
import socket
import threading
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

ACTIONS = ("status", "delay", "blackhole", "cut", "drop", "forward")
_ERROR_CODES = {500: ("InternalError", "We encountered an internal error. Please try again."),
                503: ("SlowDown", "Please reduce your request rate.")}
# Headers that describe one hop, not the message: never forwarded.
_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection", "te",
        "upgrade", "trailer"}


@dataclass
class Rule:
    method: str | None
    pattern: re.Pattern[str]
    action: str
    times: int | None = None
    status: int = 500
    seconds: float = 0.0
    fraction: float = 0.5
    hits: int = 0

    def claims(self, method: str, target: str) -> bool:
        """Matches and still applies; counts the hit (caller holds the proxy lock)."""
        if self.method is not None and self.method != method:
            return False
        if not self.pattern.search(target):
            return False
        if self.times is not None and self.hits >= self.times:
            return False
        self.hits += 1
        return True


class S3FaultProxy:
    def __init__(self, upstream_url: str) -> None:
        parts = urlsplit(upstream_url)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.rules: list[Rule] = []
        self.requests: list[tuple[str, str]] = []
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.proxy = self
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True,
                                        name="s3-fault-proxy")
        self._thread.start()

    def add_rule(self, method: str | None, path_regex: str, action: str, *,
                 times: int | None = 1, status: int = 500, seconds: float = 0.0,
                 fraction: float = 0.5) -> Rule:
        if action not in ACTIONS:
            raise ValueError(f"action must be one of {ACTIONS}, got {action!r}")
        rule = Rule(method.upper() if method else None, re.compile(path_regex), action,
                    times, status, seconds, fraction)
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()
            self.requests.clear()

    @property
    def hits(self) -> int:
        with self._lock:
            return sum(r.hits for r in self.rules)

    def match(self, method: str, target: str) -> Rule | None:
        with self._lock:
            self.requests.append((method, target))
            for rule in self.rules:
                if rule.claims(method, target):
                    return rule
        return None

    def stop(self) -> None:
        self.stopping.set()
        self._server.shutdown()
        self._server.close_all()
        self._server.server_close()
        self._thread.join(timeout=5)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    proxy: S3FaultProxy

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()

    def process_request(self, request: socket.socket, client_address: object) -> None:
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)  # type: ignore[arg-type]

    def shutdown_request(self, request: socket.socket) -> None:
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def close_all(self) -> None:
        # Wakes handlers blocked reading an idle keep-alive connection.
        with self._open_lock:
            sockets = list(self._open)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 60  # an idle keep-alive connection never holds a thread longer than this
    server: _Server

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - base signature
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._handle()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def _handle(self) -> None:
        proxy = self.server.proxy
        body = self._read_body()
        rule = proxy.match(self.command, self.path)
        action = rule.action if rule else "forward"
        if action == "status":
            assert rule is not None
            self._send_error(rule.status)
        elif action == "blackhole":
            self._hold(proxy.stopping)
        else:
            if action == "delay" and rule is not None and proxy.stopping.wait(rule.seconds):
                self.close_connection = True
                return
            status, reason, headers, data = self._forward(body)
            if action == "drop":
                self.close_connection = True
                return
            self._send(status, reason, headers, data,
                       cut=rule.fraction if action == "cut" and rule else None)

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self.server.proxy.upstream, timeout=30)
        try:
            conn.putrequest(self.command, self.path, skip_host=True,
                            skip_accept_encoding=True)
            for key, value in self.headers.items():
                if key.lower() not in _HOP and key.lower() != "content-length":
                    conn.putheader(key, value)
            if body or self.command in ("PUT", "POST"):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body or None)
            resp = conn.getresponse()
            data = resp.read()
            headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP]
            return resp.status, resp.reason, headers, data
        finally:
            conn.close()

    def _send(self, status: int, reason: str, headers: list[tuple[str, str]], data: bytes,
              cut: float | None) -> None:
        self.send_response_only(status, reason)
        has_length = any(k.lower() == "content-length" for k, _ in headers)
        for key, value in headers:
            self.send_header(key, value)
        if not has_length and self.command != "HEAD":
            self.send_header("Content-Length", str(len(data)))
        if cut is not None:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command == "HEAD":
            return
        if cut is None:
            self.wfile.write(data)
            return
        self.wfile.write(data[: int(len(data) * cut)])
        self.wfile.flush()
        self.close_connection = True

    def _send_error(self, status: int) -> None:
        code, message = _ERROR_CODES.get(status, (f"Http{status}", "Injected fault."))
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                f"<Message>{message}</Message><Resource>{self.path}</Resource>"
                f"<RequestId>{uuid.uuid4().hex[:16]}</RequestId></Error>").encode()
        self._send(status, http.client.responses.get(status, "Error"),
                   [("Content-Type", "application/xml"),
                    ("Content-Length", str(len(body)))], body, cut=None)

    def _hold(self, stopping: threading.Event) -> None:
        """Never answer: wait until the client hangs up or the proxy stops."""
        sock = self.connection
        while not stopping.is_set():
            readable, _, _ = select.select([sock], [], [], 0.1)
            if readable:
                try:
                    if not sock.recv(65536, socket.MSG_PEEK):
                        break  # the client closed
                    sock.recv(65536)  # a pipelined request we also ignore
                except OSError:
                    break
        self.close_connection = True
