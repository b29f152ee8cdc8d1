"""Test upstreams for the egressd integration tests.

* ``make_pki(dir)``: a test CA, a server certificate it signed (SANs api.test, basic.test,
  hdr.test, other.test, tunnel.test, lim.test, ..., localhost, 127.0.0.1), and an UNTRUSTED CA
  with its own server certificate, all made with the ``openssl`` command line.
* ``Upstream``: a threaded HTTP/1.1 keep-alive server on 127.0.0.1 (TLS or cleartext) that
  records every request it sees, with endpoints:
    /echo            JSON: method, path, headers ([name, value] pairs), body length and sha256
    /bytes/N         N deterministic bytes, Content-Length, written in 64 KiB pieces
                     (?pace=MS: a pause of MS ms after each piece, so the transfer stays in
                     flight at the upstream; ?id=I: progress(I) tells how far it got)
    /chunked/N       the same bytes, chunked transfer coding
    /upload          reads the body as a stream, replies JSON length + sha256
    /reflect         echoes the request's Authorization / X-Api-Key value into the response
                     header X-Seen and into a chunked body, the value split across two chunks
                     (?split=1: one byte per chunk; ?cl=1: a Content-Length body instead)
    /redirect?to=U   302 to U
    /bighead/N       200 whose head has an N-byte field (X-Pad)
    /status/N        an empty response with status N (?upgrade=P: with "Upgrade: P";
                     ?accept=A: with "Sec-WebSocket-Accept: A")
    /interim/N/MS    N interim heads (102 Processing) MS ms apart, then a 200
    /fields/N        200 with N head fields (?trailers=T: and T trailer fields, chunked;
                     ?set=Name:Value: a field as given, ?tset=Name:Value: a trailer; repeatable)
    /reflect-reason  401 whose reason phrase carries the request's Authorization value
    /reflect-name    200 whose field names carry the request's Authorization token
    /reflect-gzip    the Authorization value in a gzip-encoded body, whatever Accept-Encoding said
    /reflect-te-gzip the same gzip body as a transfer coding (Transfer-Encoding: gzip, chunked)
    /reflect-encoded the Authorization value as a URL and JSON carry it: a Location whose query
                     holds it percent-encoded, and a JSON body with it percent-encoded (upper-
                     and lowercase hex), JSON-escaped, and JSON-escaped with '/' escaped too (PHP)
* ``SilentListener``: accepts TCP connections and never sends a byte.
"""
from __future__ import annotations

import gzip
import hashlib
import http.server
import json
import os
import re
import socket
import socketserver
import ssl
import subprocess
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

SAN_HOSTS = [
    "api.test", "basic.test", "hdr.test", "other.test", "tunnel.test", "lim.test",
    "plain.test", "slow.test", "down.test", "self.test", "deny.test", "localhost", "enc.test",
    "stall.test", "s3.test", "ddb.test",
]

# ---------------------------------------------------------------------------------------------
# Deterministic payloads. The period is a prime, so it never lines up with 64 KiB writes or
# with any buffer size the proxy is likely to use: a dropped or repeated buffer changes the hash.
_PERIOD = 65521
_BLOCK = hashlib.shake_256(b"egressd-integration").digest(_PERIOD)
_DOUBLE = _BLOCK + _BLOCK


def payload(offset: int, n: int) -> bytes:
    """Bytes [offset, offset+n) of the infinite deterministic stream (n <= _PERIOD)."""
    start = offset % _PERIOD
    return _DOUBLE[start:start + n]


def iter_payload(total: int, piece: int = 65536):
    off = 0
    while off < total:
        n = min(piece, total - off, _PERIOD)
        yield payload(off, n)
        off += n


def payload_sha256(total: int) -> str:
    h = hashlib.sha256()
    for chunk in iter_payload(total):
        h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# PKI


def _openssl(*args: str, cwd: str) -> None:
    r = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {r.stderr.decode(errors='replace')}")


def _make_ca(d: str, name: str) -> None:
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", f"{name}.key", cwd=d)
    _openssl("req", "-x509", "-new", "-key", f"{name}.key", "-sha256", "-days", "2",
             "-subj", f"/CN=egressd integration {name}", "-out", f"{name}.pem",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)


def make_leaf(d: str, ca: str, name: str, hosts: list[str], eku: str = "serverAuth",
              ips: bool = True) -> None:
    """{name}.pem / {name}.key in d, signed by {ca}.pem: SANs hosts (and 127.0.0.1 and ::1
    unless not ips); extendedKeyUsage eku ("serverAuth", "clientAuth" or both, comma-separated)."""
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", f"{name}.key", cwd=d)
    _openssl("req", "-new", "-key", f"{name}.key", "-subj", f"/CN={hosts[0]}",
             "-out", f"{name}.csr", cwd=d)
    sans = ",".join([f"DNS:{h}" for h in hosts] + (["IP:127.0.0.1", "IP:::1"] if ips else []))
    with open(os.path.join(d, f"{name}.ext"), "w") as f:
        f.write("basicConstraints=critical,CA:FALSE\n"
                "keyUsage=critical,digitalSignature\n"
                f"extendedKeyUsage={eku}\n"
                f"subjectAltName={sans}\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-days", "2", "-sha256", "-extfile", f"{name}.ext",
             "-out", f"{name}.pem", cwd=d)


@dataclass
class Pki:
    dir: str
    ca: str              # trusted test CA (egressd's upstream.ca_file)
    server_cert: str
    server_key: str
    untrusted_ca: str    # a CA nobody trusts
    bad_cert: str        # same names, signed by the untrusted CA
    bad_key: str


def make_pki(d: str) -> Pki:
    os.makedirs(d, exist_ok=True)
    _make_ca(d, "testca")
    make_leaf(d, "testca", "server", SAN_HOSTS)
    _make_ca(d, "untrustedca")
    make_leaf(d, "untrustedca", "bad", SAN_HOSTS)
    j = lambda n: os.path.join(d, n)  # noqa: E731
    return Pki(d, j("testca.pem"), j("server.pem"), j("server.key"), j("untrustedca.pem"),
               j("bad.pem"), j("bad.key"))


# ---------------------------------------------------------------------------------------------
# HTTP upstream


@dataclass
class Seen:
    method: str
    path: str
    headers: list[tuple[str, str]]
    body_len: int = 0
    sni: str | None = None
    resumed: bool | None = None  # TLS: the connection resumed a session (None: cleartext)
    trailers: list[tuple[str, str]] = field(default_factory=list)  # a chunked body's trailers

    def header(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name.lower()]


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "integration-upstream/1"
    sys_version = ""

    def log_message(self, fmt, *args):  # quiet
        pass

    def version_string(self):
        return self.server_version

    # -- body reading ---------------------------------------------------------------------
    def _iter_body(self):
        te = (self.headers.get("Transfer-Encoding") or "").lower()
        if "chunked" in te:
            for _ in range(10_000_000):
                line = self.rfile.readline(1024)
                if not line:
                    raise ConnectionError("eof in chunk size")
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    # trailers
                    for _ in range(1000):
                        t = self.rfile.readline(65536)
                        if t in (b"\r\n", b"\n", b""):
                            break
                        k, _, v = t.decode("latin-1").partition(":")
                        self.trailers.append((k.strip(), v.strip()))
                    return
                left = size
                while left:
                    b = self.rfile.read(min(left, 65536))
                    if not b:
                        raise ConnectionError("eof in chunk")
                    left -= len(b)
                    yield b
                self.rfile.readline(16)
            return
        n = int(self.headers.get("Content-Length") or 0)
        while n:
            b = self.rfile.read(min(n, 65536))
            if not b:
                raise ConnectionError("eof in body")
            n -= len(b)
            yield b

    def _consume_body(self):
        h = hashlib.sha256()
        n = 0
        for b in self._iter_body():
            h.update(b)
            n += len(b)
        return n, h.hexdigest()

    # -- responses ------------------------------------------------------------------------
    def _send(self, status: int, body: bytes, ctype="application/json", extra=()):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in extra:
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _chunk(self, data: bytes):
        self.wfile.write(b"%x\r\n" % len(data) + data + b"\r\n")

    def _handle(self):
        url = urllib.parse.urlsplit(self.path)
        q = dict(urllib.parse.parse_qsl(url.query))
        parts = url.path.split("/")
        base = "/" + parts[1] if len(parts) > 1 else "/"  # "/echo/<marker>" routes like "/echo"
        self.trailers = []
        seen = Seen(self.command, self.path, [(k, v) for k, v in self.headers.items()],
                    sni=getattr(self.connection, "egress_sni", None),
                    resumed=getattr(self.connection, "session_reused", None),
                    trailers=self.trailers)
        if base == "/upload":
            self.server.record(seen)
            if q.get("continue"):
                # An interim answer nobody asked for (no Expect): the upload must go on.
                self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                self.wfile.flush()
            n, digest = self._consume_body()
            seen.body_len = n
            self._send(200, json.dumps({"length": n, "sha256": digest}).encode())
            return
        if base == "/reject-upload":
            # Refuses an upload from its head alone, as an origin does on a bad credential or
            # an oversized Content-Length: the answer, then a lingering close as nginx and Go
            # do it (our FIN, then the body read and dropped until the client's FIN, at most
            # ?linger=ms; with linger=0 the close is at once and the kernel resets the
            # connection under the bytes still arriving, the answer with it).
            self.server.record(seen)
            self.send_response(int(q.get("status", "413")))
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", "9")
            if q.get("keep"):
                # Says nothing of closing and then takes the whole body, as a server that
                # answers early and drains the upload does (RFC 9112 9.3: the client need not
                # stop sending; a request sent behind a cut upload would be read as body).
                self.end_headers()
                self.wfile.write(b"rejected\n")
                self.wfile.flush()
                try:
                    seen.body_len, _ = self._consume_body()
                except OSError:
                    self.close_connection = True
                return
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(b"rejected\n")
            self.wfile.flush()
            self.close_connection = True
            linger = min(int(q.get("linger", "3000")), 10000) / 1000
            if linger > 0:
                raw = self.connection
                socket.socket.shutdown(raw, socket.SHUT_WR)  # TCP FIN under the TLS layer
                deadline = time.monotonic() + linger
                drained = 0
                while time.monotonic() < deadline:
                    raw.settimeout(max(0.01, deadline - time.monotonic()))
                    try:
                        got = socket.socket.recv(raw, 65536)  # ciphertext, dropped
                    except OSError:
                        break
                    if not got:
                        break
                    drained += len(got)
                seen.body_len = drained
            return
        n, digest = self._consume_body()
        seen.body_len = n
        self.server.record(seen)
        if base == "/echo":
            body = json.dumps({
                "method": self.command, "path": self.path,
                "headers": [[k, v] for k, v in self.headers.items()],
                "body_length": n, "body_sha256": digest, "sni": seen.sni,
            }).encode()
            self._send(200, body)
        elif len(parts) == 3 and parts[1] in ("bytes", "chunked") and parts[2].isdigit():
            total = int(parts[2])
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            if parts[1] == "bytes":
                self.send_header("Content-Length", str(total))
            else:
                self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            if self.command == "HEAD":
                return
            sent = 0
            for piece in iter_payload(total):
                if parts[1] == "bytes":
                    self.wfile.write(piece)
                else:
                    self._chunk(piece)
                sent += len(piece)
                if q.get("id"):
                    self.server.progress[q["id"]] = sent  # how far the writer got (backpressure)
                if q.get("pace") and sent < total:
                    self.wfile.flush()
                    time.sleep(min(int(q["pace"]), 1000) / 1000)
            if parts[1] == "chunked":
                self.wfile.write(b"0\r\n\r\n")
        elif base == "/reflect-reason":
            value = self.headers.get("Authorization") or ""
            self.send_response(401, "Rejected " + value)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"no")
        elif base == "/reflect-name":
            # The credential (its token, without the scheme) in field names, as sent and
            # lowercased, beside a field that is kept.
            token = (self.headers.get("Authorization") or "").split(" ")[-1]
            self._send(200, b"{}", extra=[("X-Echo-" + token, "1"),
                                          ("x-lower-" + token.lower(), "2"), ("X-Kept", "yes")])
        elif base == "/reflect-gzip":
            value = self.headers.get("Authorization") or ""
            body = gzip.compress(b"seen=" + value.encode("latin-1") + b";end\n")
            self._send(200, body, "text/plain", extra=[("Content-Encoding", "gzip")])
        elif base == "/reflect-te-gzip":
            value = self.headers.get("Authorization") or ""
            body = gzip.compress(b"seen=" + value.encode("latin-1") + b";end\n")
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Transfer-Encoding", "gzip, chunked")
            self.end_headers()
            self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        elif base == "/reflect-encoded":
            value = self.headers.get("Authorization") or ""
            quoted = urllib.parse.quote(value, safe="")
            lower = re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), quoted)
            body = ('{"url": "%s", "url_lower": "%s", "json": %s, "php": %s}\n' % (
                quoted, lower, json.dumps(value), json.dumps(value).replace("/", "\\/"))).encode()
            self._send(200, body, "application/json",
                       extra=[("Location", "/next?auth=" + quoted)])
        elif base == "/reflect":
            value = self.headers.get("Authorization") or self.headers.get("X-Api-Key") or ""
            pad = b"a" * int(q.get("pad", "0"))  # filler before the echoed value
            body = pad + b"seen=" + value.encode("latin-1") + b";end\n"
            # Cut in the middle of the value, so the secret spans two chunks / two writes.
            cut = len(pad) + len(b"seen=") + max(1, len(value) - max(3, len(value) // 3))
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("X-Seen", value)
            self.send_header("Set-Cookie", "auth=" + value.replace(" ", "_"))
            if q.get("cl"):
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[:cut])
                self.wfile.flush()
                self.wfile.write(body[cut:])
                return
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            if q.get("split"):
                self._chunk(body[:len(pad)]) if pad else None
                for i in range(len(pad), len(body)):
                    self._chunk(body[i:i + 1])
            else:
                self._chunk(body[:cut])
                self.wfile.flush()
                self._chunk(body[cut:])
            self.wfile.write(b"0\r\n\r\n")
        elif len(parts) >= 4 and parts[1] == "interim" and parts[2].isdigit() \
                and parts[3].isdigit():
            # N interim heads (102 Processing), one every MS ms, then the answer
            for _ in range(min(int(parts[2]), 100)):
                self.wfile.write(b"HTTP/1.1 102 Processing\r\n\r\n")
                self.wfile.flush()
                time.sleep(min(int(parts[3]), 5000) / 1000)
            self._send(200, b'{"interim":true}')
        elif len(parts) >= 3 and parts[1] == "fields" and parts[2].isdigit():
            # N fields in the head (?trailers=T: T trailer fields, chunked); ?set=Name:Value
            # adds a field as given (repeatable)
            n, t = min(int(parts[2]), 100000), min(int(q.get("trailers", "0")), 100000)
            pairs = urllib.parse.parse_qsl(url.query)
            sets = [kv.split(":", 1) for k, kv in pairs if k == "set" and ":" in kv]
            tsets = [kv.split(":", 1) for k, kv in pairs if k == "tset" and ":" in kv]
            head = [b"HTTP/1.1 200 OK\r\n", b"Content-Type: text/plain\r\n"]
            head += [b"X-F%d: %d\r\n" % (i, i) for i in range(n)]
            head += [f"{k}: {v}\r\n".encode("latin-1") for k, v in sets]
            if t or tsets:
                head.append(b"Transfer-Encoding: chunked\r\n\r\n")
                body = b"2\r\nok\r\n0\r\n" + b"".join(
                    b"X-T%d: %d\r\n" % (i, i) for i in range(t)) + b"".join(
                    f"{k}: {v}\r\n".encode("latin-1") for k, v in tsets) + b"\r\n"
            else:
                head.append(b"Content-Length: 2\r\n\r\n")
                body = b"ok"
            self.wfile.write(b"".join(head) + body)
        elif len(parts) == 3 and parts[1] == "delay" and parts[2].isdigit():
            time.sleep(min(int(parts[2]), 10000) / 1000)  # answers after N ms (at most 10 s)
            self._send(200, b'{"delayed":true}')
        elif len(parts) >= 3 and parts[1] == "drop" and parts[2].isdigit():
            # Answers as a keep-alive connection would (no Connection: close), then closes it
            # N ms later while it idles; with ?say=408 it first writes an unsolicited 408, as
            # some servers do when their idle timeout ends a connection.
            self._send(200, b'{"dropping":true}')
            self.wfile.flush()
            time.sleep(min(int(parts[2]), 5000) / 1000)
            if q.get("say") == "408":
                self.wfile.write(b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n"
                                 b"Connection: close\r\n\r\n")
                self.wfile.flush()
            self.close_connection = True
        elif base == "/hangup":
            # Takes the request and closes without a byte of answer: an upstream that acted
            # on it and went away, or closed its idle connection as the request came.
            self.close_connection = True
        elif base == "/badhead":
            # An answer whose head does not parse (two Content-Length values), then the close.
            self.wfile.write(b"HTTP/1.1 201 Created\r\nContent-Length: 1, 2\r\n\r\nx")
            self.wfile.flush()
            self.close_connection = True
        elif len(parts) == 3 and parts[1] == "short" and parts[2].isdigit():
            # Announces Content-Length N, sends N/2 bytes, then closes: a truncated response.
            total = int(parts[2])
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(total))
            self.end_headers()
            self.wfile.write(payload(0, total // 2))
            self.wfile.flush()
            self.close_connection = True
        elif base == "/hop":
            # Connection names X-Update: that header is hop-by-hop, Update and Date (whose
            # names sit inside "x-update") are not.
            self._send(200, b"{}", extra=[("Connection", "X-Update, keep-alive"),
                                          ("Keep-Alive", "timeout=5"), ("X-Update", "1"),
                                          ("Update", "2"), ("X-Kept", "yes")])
        elif len(parts) == 3 and parts[1] == "bighead" and parts[2].isdigit():
            # A response head of about N bytes (an X-Pad field), whatever the request's size.
            self._send(200, b"{}", extra=[("X-Pad", "p" * min(int(parts[2]), 1 << 20))])
        elif base == "/redirect":
            self._send(302, b"", "text/plain", [("Location", q.get("to", "/echo"))])
        elif len(parts) == 3 and parts[1] == "status" and parts[2].isdigit():
            # ?upgrade=P: also "Upgrade: P" (a server that lets its client choose a status and
            # a header, as a smuggling attempt through a WebSocket upgrade would want).
            extra = [("Upgrade", q["upgrade"]), ("Connection", "Upgrade")] if "upgrade" in q else []
            if "accept" in q:
                extra.append(("Sec-WebSocket-Accept", q["accept"]))
            self._send(int(parts[2]), b"", "text/plain", extra)
        else:
            self._send(404, b"not found\n", "text/plain")

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _handle


class TlsHttpServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    """A threaded HTTP/1.1 test server: TLS with `self.ctx` (None: cleartext), the handshake in
    the connection's own thread, never in the accept loop; a peer's errors end its connection
    only. Shared by the test origins (this module's, aws_upstream's, cp_helpers' git server)."""
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    ctx: ssl.SSLContext | None = None

    def finish_request(self, request, client_address):
        request.settimeout(30)
        if self.ctx is not None:
            try:
                request = self.ctx.wrap_socket(request, server_side=True)
            except (OSError, ssl.SSLError):
                return
        try:
            super().finish_request(request, client_address)
        except (OSError, ssl.SSLError, ConnectionError, ValueError):
            pass
        finally:
            try:
                request.close()
            except OSError:
                pass

    def handle_error(self, request, client_address):
        pass


class _Server(TlsHttpServer):
    request_queue_size = 128

    def __init__(self, addr, ctx: ssl.SSLContext | None):
        self.ctx = ctx
        self.lock = threading.Lock()
        self.requests_seen: list[Seen] = []
        self.connections = 0
        self.progress: dict[str, int] = {}
        super().__init__(addr, _Handler)

    def record(self, seen: Seen):
        with self.lock:
            self.requests_seen.append(seen)

    def finish_request(self, request, client_address):
        with self.lock:
            self.connections += 1
        super().finish_request(request, client_address)


class Upstream:
    """An HTTP/1.1 server on 127.0.0.1 with TLS (cert/key given) or cleartext."""

    def __init__(self, cert: str | None = None, key: str | None = None):
        ctx = None
        if cert:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(cert, key)
            ctx.set_alpn_protocols(["http/1.1"])

            def on_sni(sslsock, name, _ctx):
                try:
                    sslsock.egress_sni = name  # read back by the handler
                except AttributeError:
                    pass
                return None
            ctx.sni_callback = on_sni
        self.server = _Server(("127.0.0.1", 0), ctx)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever,
                                       kwargs={"poll_interval": 0.1}, daemon=True)
        self.thread.start()

    @property
    def requests(self) -> list[Seen]:
        with self.server.lock:
            return list(self.server.requests_seen)

    def find(self, marker: str) -> list[Seen]:
        """Requests whose target contains `marker` (tests put a unique token in the query)."""
        return [r for r in self.requests if marker in r.path]

    def progress(self, ident: str) -> int:
        return self.server.progress.get(ident, 0)

    def all_header_values(self) -> list[str]:
        return [v for r in self.requests for _, v in r.headers]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class SilentListener:
    """Accepts TCP connections on 127.0.0.1 and never answers (TLS handshakes time out)."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                c, _ = self.sock.accept()
            except (socket.timeout, OSError):
                continue
            self.conns.append(c)

    def close(self):
        self._stop.set()
        self.thread.join(timeout=5)
        for c in self.conns:
            c.close()
        self.sock.close()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_EPHEMERAL_LOW = _ephemeral_low()


_HANDED_OUT = "/tmp/egressd-it-ports"  # ports recently handed out, shared by test processes


def _claim(port: int, now: float) -> bool:
    """Records `port` as handed out unless another test process (ctest runs two test files
    at once) took it in the last 120 s: a port checked free but not yet bound by the process
    it was picked for passes every bind check, so two picks of it collide ("Address already
    in use" when the second process binds, seen once in a full run)."""
    import fcntl
    with open(_HANDED_OUT, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        recent = {}
        for line in f.read().split("\n"):
            parts = line.split()
            if len(parts) == 2 and now - float(parts[1]) < 120:
                recent[int(parts[0])] = float(parts[1])
        if port in recent:
            return False
        recent[port] = now
        f.seek(0)
        f.truncate()
        f.write("".join(f"{p} {t}\n" for p, t in recent.items()))
        return True


def free_port() -> int:
    """A port that was free a moment ago, for a process started next to listen on, and not
    handed out to another test process lately (_claim). Picked below the kernel's ephemeral
    range: a port from bind(0) is an ephemeral one, which any outgoing connection (egressd's
    to etcd or an upstream, a client's) may take as its local port before the process binds it
    ("Address already in use", seen under a loaded CI)."""
    import random
    low = 20000
    if _EPHEMERAL_LOW - low >= 1000:
        for _ in range(200):
            port = random.randrange(low, _EPHEMERAL_LOW)
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            finally:
                s.close()
            if _claim(port, time.time()):
                return port
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port
