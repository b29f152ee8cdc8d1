"""Loopback fixtures for the egress-bench tests.

* ``make_pki(dir)``: a test CA and a server certificate (SAN localhost, 127.0.0.1) made with the
  ``openssl`` command line.
* ``Origin``: a threaded HTTP/1.1 keep-alive server on 127.0.0.1, TLS or cleartext, counting
  connections and recording every request (method, path, headers, body length) and the SNI.
  ``/status/N`` answers N; every other path answers 200 with a small body. ``delay`` (seconds)
  holds every answer back that long (a slow server).
* ``Proxy``: a threaded forward proxy on 127.0.0.1. CONNECT is relayed byte for byte;
  absolute-form requests are parsed and forwarded one by one. It counts CONNECTs and records
  request lines and Proxy-Authorization values; it can require credentials (407), refuse hosts
  (403), send every CONNECT to 127.0.0.1 whatever the name (``resolve_to``) and send a 100
  before a CONNECT's 200 (``interim_connect``).
* ``H2Origin``: an HTTP/2 origin (python3-h2, TLS, ALPN "h2" only) on 127.0.0.1, recording every
  request and counting connections; ``/status/N`` answers N.
* ``ScriptedOrigin``: a cleartext HTTP/1.1 server on 127.0.0.1 whose answers a test scripts
  (``answer(conn_index, request_index, head) -> bytes | None``: None stalls the connection),
  with an optional keep-alive idle timeout; it counts requests received.
* ``silent_listener()`` / ``closed_port()``: a port that never answers / refuses.
"""
from __future__ import annotations

import http.server
import select
import socket
import socketserver
import ssl
import subprocess
import threading
import time
from pathlib import Path

IDLE_TIMEOUT = 30  # seconds a relay or request read may sit idle before the fixture gives up


def make_pki(d: Path) -> dict:
    d.mkdir(parents=True, exist_ok=True)

    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=egress-bench test CA")
    run("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
    (d / "ext.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n"
                               "extendedKeyUsage=serverAuth\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-extfile", "ext.cnf", "-out", "server.pem")
    return {"ca": str(d / "ca.pem"), "cert": str(d / "server.pem"), "key": str(d / "server.key")}


def _listener() -> socket.socket:
    """A TCP listening socket on 127.0.0.1, on a port of the kernel's choosing."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen(128)
    return s


def _nodelay(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _OriginHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _serve(self):
        length = int(self.headers.get("Content-Length", "0") or 0)
        body_in = self.rfile.read(length) if length else b""
        self.server.record(self.command, self.path, list(self.headers.items()), len(body_in))
        path = self.path
        if path.startswith("http://") or path.startswith("https://"):
            path = "/" + path.split("/", 3)[3] if path.count("/") >= 3 else "/"
        status = 200
        if path.startswith("/status/"):
            status = int(path.split("/")[2])
        body = b"hello from origin\n"
        head = f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        if path.startswith("/early-hints"):  # an interim answer first, as a CDN may send
            head = b"HTTP/1.1 103 Early Hints\r\nLink: </s.css>; rel=preload\r\n\r\n" + head
        if self.server.delay:
            time.sleep(self.server.delay)
        # One write per response: no Nagle / delayed-ACK stall between head and body.
        self.wfile.write(head + (b"" if self.command == "HEAD" else body))

    do_GET = do_POST = do_PUT = do_HEAD = do_DELETE = _serve


class Origin(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, pki: dict | None):
        super().__init__(("127.0.0.1", 0), _OriginHandler)
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str, list, int]] = []
        self.connections = 0
        self.delay = 0.0
        self.sni: list[str | None] = []
        self.tls = None
        if pki:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(pki["cert"], pki["key"])
            ctx.set_alpn_protocols(["http/1.1"])
            ctx.sni_callback = self._on_sni
            self.tls = ctx
        self.port = self.server_address[1]
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path="/", host="127.0.0.1"):
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}{path}"

    def _on_sni(self, sslobj, name, ctx):
        with self.lock:
            self.sni.append(name)

    def record(self, method, path, headers, body_len):
        with self.lock:
            self.requests.append((method, path, headers, body_len))

    def finish_request(self, request, client_address):
        with self.lock:
            self.connections += 1
        _nodelay(request)
        conn = request
        try:
            if self.tls:
                conn = self.tls.wrap_socket(request, server_side=True)
            self.RequestHandlerClass(conn, client_address, self)
        except (OSError, ssl.SSLError):
            pass
        finally:
            conn.close()

    def handle_error(self, request, client_address):
        pass  # clients that hang up mid-request are part of the tests

    def stop(self):
        self.shutdown()
        self.server_close()


def _read_head(sock: socket.socket, buf: bytes) -> tuple[bytes | None, bytes]:
    """Reads up to and including CRLFCRLF; returns (head, leftover) or (None, b"") on EOF."""
    while b"\r\n\r\n" not in buf:
        if len(buf) > 65536:
            return None, b""
        data = sock.recv(65536)
        if not data:
            return None, b""
        buf += data
    head, rest = buf.split(b"\r\n\r\n", 1)
    return head + b"\r\n\r\n", rest


def _read_exact(sock: socket.socket, buf: bytes, n: int) -> tuple[bytes | None, bytes]:
    while len(buf) < n:
        data = sock.recv(65536)
        if not data:
            return None, b""
        buf += data
    return buf[:n], buf[n:]


def _headers(head: bytes) -> list[tuple[str, str]]:
    out = []
    for line in head.decode("latin-1").split("\r\n")[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            out.append((k.strip(), v.strip()))
    return out


def _content_length(headers) -> int:
    for k, v in headers:
        if k.lower() == "content-length":
            return int(v)
    return 0


def _relay(a: socket.socket, b: socket.socket) -> None:
    socks = [a, b]
    while True:
        ready, _, _ = select.select(socks, [], [], IDLE_TIMEOUT)
        if not ready:
            return
        for s in ready:
            data = s.recv(65536)
            if not data:
                return
            (b if s is a else a).sendall(data)


class _ProxyHandler(socketserver.BaseRequestHandler):
    def handle(self):
        proxy: Proxy = self.server.owner
        client = self.request
        client.settimeout(IDLE_TIMEOUT)
        _nodelay(client)
        upstream = None
        buf = b""
        try:
            while True:  # one request head per iteration; ends when the client closes
                head, buf = _read_head(client, buf)
                if head is None:
                    return
                line = head.split(b"\r\n", 1)[0].decode("latin-1")
                method, target, _ = line.split(" ", 2)
                headers = _headers(head)
                auth = next((v for k, v in headers if k.lower() == "proxy-authorization"), None)
                proxy.record(method, line, auth)
                if proxy.require_auth is not None and auth != proxy.require_auth:
                    client.sendall(b"HTTP/1.1 407 Proxy Authentication Required\r\n"
                                   b"Content-Length: 0\r\nConnection: close\r\n\r\n")
                    return
                if method == "CONNECT":
                    host, port = target.rsplit(":", 1)
                    if host in proxy.deny_hosts:
                        client.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n"
                                       b"Connection: close\r\n\r\n")
                        return
                    upstream = socket.create_connection((proxy.resolve_to or host, int(port)))
                    _nodelay(upstream)
                    if proxy.interim_connect:  # a 100 first: clients skip interim heads
                        client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                    client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                    if buf:
                        upstream.sendall(buf)
                    _relay(client, upstream)
                    return
                # Absolute-form: forward this one request in origin-form, relay its response.
                rest = target.split("://", 1)[1]
                authority, _, path = rest.partition("/")
                host, _, port = authority.rpartition(":")
                body, buf = _read_exact(client, buf, _content_length(headers))
                if body is None:
                    return
                if upstream is None:
                    upstream = socket.create_connection((host, int(port)))
                    _nodelay(upstream)
                    up_buf = b""
                kept = [(k, v) for k, v in headers if k.lower() != "proxy-authorization"]
                out = f"{method} /{path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in kept)
                upstream.sendall(out.encode("latin-1") + b"\r\n" + body)
                rhead, up_buf = _read_head(upstream, up_buf)
                if rhead is None:
                    return
                rbody, up_buf = _read_exact(upstream, up_buf, _content_length(_headers(rhead)))
                if rbody is None:
                    return
                client.sendall(rhead + rbody)
        except OSError:
            return
        finally:
            if upstream is not None:
                upstream.close()


class _ProxyServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request, client_address):
        pass


class Proxy:
    def __init__(self, require_auth: str | None = None, deny_hosts=(), resolve_to=None,
                 interim_connect=False):
        self.require_auth = require_auth
        self.interim_connect = interim_connect
        self.deny_hosts = set(deny_hosts)
        self.resolve_to = resolve_to
        self.lock = threading.Lock()
        self.connects = 0
        self.request_lines: list[str] = []
        self.auth_seen: list[str | None] = []
        self.server = _ProxyServer(("127.0.0.1", 0), _ProxyHandler)
        self.server.owner = self
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, userinfo: str | None = None) -> str:
        return f"http://{userinfo + '@' if userinfo else ''}127.0.0.1:{self.port}"

    def record(self, method, line, auth):
        with self.lock:
            if method == "CONNECT":
                self.connects += 1
            self.request_lines.append(line)
            self.auth_seen.append(auth)

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


class ScriptedOrigin:
    """Cleartext HTTP/1.1 on 127.0.0.1. For each request head received, ``answer(conn, n,
    head)`` (the connection's index, the request's index on it from 1, the head) gives the
    bytes to send: None holds the connection silent until the client leaves; the string
    "close" closes it without an answer. A request body is not read (an answer before the
    body). ``idle_timeout`` (seconds) closes a connection that idles that long between
    requests, as a server's keep-alive timeout does."""

    def __init__(self, answer, idle_timeout: float | None = None):
        self.answer = answer
        self.idle_timeout = idle_timeout
        self.lock = threading.Lock()
        self.received = 0
        self.connections = 0
        self.sock = _listener()
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, path="/"):
        return f"http://127.0.0.1:{self.port}{path}"

    def _accept(self):
        while True:
            try:
                s, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
                index = self.connections
            threading.Thread(target=self._serve, args=(s, index), daemon=True).start()

    def _serve(self, s: socket.socket, index: int):
        _nodelay(s)
        buf = b""
        n = 0
        try:
            while True:
                s.settimeout(self.idle_timeout or IDLE_TIMEOUT)
                try:
                    head, buf = _read_head(s, buf)
                except TimeoutError:
                    return
                if head is None:
                    return
                n += 1
                with self.lock:
                    self.received += 1
                out = self.answer(index, n, head)
                if out is None:
                    s.settimeout(IDLE_TIMEOUT)
                    while s.recv(65536):
                        pass
                    return
                if out == "close":
                    return
                s.sendall(out)
                buf = b""  # a body the answer came before is not read
        except OSError:
            return
        finally:
            s.close()

    def stop(self):
        self.sock.close()


def silent_listener() -> socket.socket:
    """A listening socket nobody accepts on: the kernel completes TCP handshakes, then silence."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    return s


def closed_port() -> socket.socket:
    """A bound socket that does not listen: connecting to its port is refused."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s


class H2Origin:
    """An HTTP/2 origin (python3-h2 over TLS, ALPN "h2" only) on 127.0.0.1, recording every
    request (method, path, headers, body length) and counting connections. ``/status/N``
    answers N; every other path answers 200 with a small body. With ``goaway_after = N`` a
    connection answers N requests, then sends GOAWAY naming the last and closes (as nginx
    after keepalive_requests): streams the client sent past it are refused unprocessed and
    counted in ``refused``. With ``refuse_nth = N`` the N-th request it receives (across
    connections) is refused with RST_STREAM REFUSED_STREAM, the connection going on. With
    ``delay`` (seconds) every answer is held back that long after its request ended, other
    streams going on meanwhile; ``max_open`` is the most streams one connection had open at
    once (received, not yet answered). With ``trickle`` (seconds) an answer is its head, then
    one body byte every ``trickle`` seconds without end; with ``trickle_reset`` (seconds) too,
    the stream is reset (INTERNAL_ERROR) that long after its head."""

    BODY = b"hello from h2 origin\n"

    def __init__(self, pki: dict):
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(pki["cert"], pki["key"])
        ctx.set_alpn_protocols(["h2"])
        self.tls = ctx
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str, list, int]] = []
        self.connections = 0
        self.goaway_after = 0
        self.refuse_nth = 0
        self.delay = 0.0
        self.trickle = 0.0
        self.trickle_reset = 0.0
        self.max_open = 0
        self.received = 0
        self.refused = 0
        self.sock = _listener()
        self.port = self.sock.getsockname()[1]
        self.stopped = False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def url(self, path="/", host="127.0.0.1"):
        return f"https://{host}:{self.port}{path}"

    def _accept(self):
        while not self.stopped:
            try:
                s, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
            threading.Thread(target=self._serve, args=(s,), daemon=True).start()

    def _serve(self, raw: socket.socket):
        import h2.config
        import h2.connection
        import h2.errors
        import h2.events

        _nodelay(raw)
        raw.settimeout(IDLE_TIMEOUT)
        try:
            conn_sock = self.tls.wrap_socket(raw, server_side=True)
        except (OSError, ssl.SSLError):
            raw.close()
            return
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        conn.initiate_connection()
        streams: dict[int, list] = {}  # id -> [headers, body_len]
        held: list[tuple[float, int, list | None]] = []  # (due, id, stream): answers `delay` holds
        trickling: dict[int, list[float]] = {}  # id -> [next byte due, reset due]
        answered = 0
        try:
            conn_sock.sendall(conn.data_to_send())
            while True:
                wait = IDLE_TIMEOUT
                dues = [due for due, _, _ in held] + [min(t) for t in trickling.values()]
                if dues:
                    wait = max(0.001, min(dues) - time.monotonic())
                conn_sock.settimeout(wait)
                try:
                    data = conn_sock.recv(65536)
                except TimeoutError:
                    if not held and not trickling:
                        return
                    data = None
                if data == b"":
                    return
                last = None
                events = conn.receive_data(data) if data else []
                for ev in events:
                    if last is not None and getattr(ev, "stream_id", 0) > last:
                        if isinstance(ev, h2.events.RequestReceived):
                            with self.lock:
                                self.refused += 1
                        continue
                    if isinstance(ev, h2.events.RequestReceived):
                        with self.lock:
                            self.received += 1
                            refuse = self.received == self.refuse_nth
                            self.refused += 1 if refuse else 0
                        if refuse:
                            conn.reset_stream(ev.stream_id, error_code=h2.errors.ErrorCodes
                                              .REFUSED_STREAM)
                            continue
                        streams[ev.stream_id] = [
                            [(k.decode() if isinstance(k, bytes) else k,
                              v.decode() if isinstance(v, bytes) else v) for k, v in ev.headers],
                            0]
                        with self.lock:
                            self.max_open = max(self.max_open, len(streams) + len(held))
                    elif isinstance(ev, h2.events.DataReceived):
                        if ev.stream_id in streams:
                            streams[ev.stream_id][1] += len(ev.data)
                        conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                    if isinstance(ev, h2.events.StreamEnded):
                        st = streams.pop(ev.stream_id, None)
                        if self.delay:
                            held.append((time.monotonic() + self.delay, ev.stream_id, st))
                            continue
                        self._respond(conn, ev.stream_id, st, trickling)
                        answered += 1
                        if answered == self.goaway_after:
                            last = ev.stream_id
                    elif isinstance(ev, h2.events.ConnectionTerminated):
                        conn_sock.sendall(conn.data_to_send())
                        return
                now = time.monotonic()
                for item in [h for h in held if h[0] <= now]:
                    held.remove(item)
                    self._respond(conn, item[1], item[2], trickling)
                for sid, t in list(trickling.items()):
                    if sid not in conn.streams or conn.streams[sid].closed:
                        del trickling[sid]  # the client reset it
                    elif t[1] <= now:
                        conn.reset_stream(sid, error_code=h2.errors.ErrorCodes.INTERNAL_ERROR)
                        del trickling[sid]
                    elif t[0] <= now:
                        conn.send_data(sid, b"x")
                        t[0] = now + self.trickle
                if last is not None:
                    with self.lock:
                        self.refused += len([i for i in streams if i > last])
                    conn.close_connection(last_stream_id=last)
                    conn_sock.sendall(conn.data_to_send())
                    return
                out = conn.data_to_send()
                if out:
                    conn_sock.sendall(out)
        except Exception:  # noqa: BLE001 — clients that hang up are part of the tests
            return
        finally:
            conn_sock.close()

    def _respond(self, conn, sid: int, st, trickling: dict):
        if st is None:
            return
        headers, body_len = st
        h = dict((k, v) for k, v in headers if k.startswith(":"))
        method, path = h.get(":method", ""), h.get(":path", "")
        with self.lock:
            self.requests.append((method, path, headers, body_len))
        status = int(path.split("/")[2]) if path.startswith("/status/") else 200
        if self.trickle:
            conn.send_headers(sid, [(":status", str(status))])
            now = time.monotonic()
            trickling[sid] = [now + self.trickle,
                                    now + (self.trickle_reset or float("inf"))]
            return
        body = b"" if method == "HEAD" else self.BODY
        conn.send_headers(sid, [(":status", str(status)),
                                ("content-length", str(len(self.BODY)))],
                          end_stream=not body)
        if body:
            conn.send_data(sid, body, end_stream=True)

    def stop(self):
        self.stopped = True
        self.sock.close()
