"""HTTP/2 fixtures and a raw HTTP/2 client (python3-h2) for the h2 integration tests."""
from __future__ import annotations

import socket
import ssl

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import pytest

import helpers
from h2_upstream import H2Upstream

H2_HOST = "h2.test"  # resolved by egressd's override; the test cert has api.test etc.


@pytest.fixture(scope="module")
def h2up(world):
    u = H2Upstream(world.pki.server_cert, world.pki.server_key)
    yield u
    u.close()


def add_h2_pins(world, h2up, limits: dict | None = None):
    """A config mutator: pins api.test / basic.test on the h2 upstream's port as well."""
    def mutate(cfg):
        P = h2up.port
        r1 = cfg["runs"][0]
        sf = world.secret_files
        r1["pins"] += [
            {"host": f"api.test:{P}", "secret_file": sf["api_token"], "inject": {"type": "bearer"}},
            {"host": f"hdr.test:{P}", "secret_file": sf["hdr_key"],
             "inject": {"type": "header", "name": "x-api-key", "template": "Key {secret}"}},
        ]
        cfg["policy"]["allowed_ports"] = sorted(set(cfg["policy"]["allowed_ports"]) | {P})
        if limits:
            cfg["limits"].update(limits)
    return mutate


class H2Client:
    """A raw HTTP/2 client through egressd: CONNECT, TLS (ALPN h2), then frames via h2."""

    def __init__(self, e, world, host: str, port: int, run: str = "r1", ca: str | None = None,
                 timeout: float = 10.0, settings: dict | None = None):
        c, r = helpers.proxy_connect(e.proxy_port, f"{host}:{port}", world.auth(run),
                                     timeout=timeout)
        assert r.status == 200, (r.status, r.egress_reason)
        ctx = ssl.create_default_context(cafile=ca or e.config["runs"][0]["ca_cert_out"])
        ctx.set_alpn_protocols(["h2"])
        self.sock = ctx.wrap_socket(c.sock, server_hostname=host)
        self.sock.settimeout(timeout)
        assert self.sock.selected_alpn_protocol() == "h2"
        self.conn = h2.connection.H2Connection(
            config=h2.config.H2Configuration(client_side=True, header_encoding="utf-8",
                                             validate_outbound_headers=False,
                                             normalize_outbound_headers=False,
                                             validate_inbound_headers=False))
        self.conn.initiate_connection()
        if settings:
            self.conn.update_settings(settings)
        self.flush()
        self.authority = f"{host}:{port}"
        self.responses: dict[int, dict] = {}
        self.goaway = None
        self.closed = False
        self.hold: set[int] = set()  # streams whose DATA is never acknowledged (slow readers)

    def flush(self):
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def send_raw(self, data: bytes):
        self.sock.sendall(data)

    def headers(self, path: str, method: str = "GET", extra=(), end_stream=True,
                authority: str | None = None) -> int:
        sid = self.conn.get_next_available_stream_id()
        hdrs = [(":method", method), (":scheme", "https"),
                (":authority", authority or self.authority), (":path", path), *extra]
        self.conn.send_headers(sid, hdrs, end_stream=end_stream)
        self.responses[sid] = {"status": None, "headers": [], "body": b"", "trailers": [],
                               "reset": None, "ended": False}
        return sid

    def pump(self, until=lambda: False, timeout: float = 10.0):
        """Reads frames until `until()` is true, the connection closes, or timeout."""
        import time
        deadline = time.monotonic() + timeout
        while not until() and not self.closed and time.monotonic() < deadline:
            try:
                self.sock.settimeout(max(0.01, deadline - time.monotonic()))
                data = self.sock.recv(65536)
            except (socket.timeout, TimeoutError):
                break
            except (ssl.SSLError, OSError):
                self.closed = True
                break
            if not data:
                self.closed = True
                break
            try:
                events = self.conn.receive_data(data)
            except h2.exceptions.ProtocolError:
                self.closed = True
                break
            for ev in events:
                r = self.responses.get(getattr(ev, "stream_id", None) or 0)
                if isinstance(ev, h2.events.ResponseReceived):
                    r["status"] = int(dict(ev.headers)[":status"])
                    r["headers"] = [(k, v) for k, v in ev.headers if not k.startswith(":")]
                elif isinstance(ev, h2.events.DataReceived):
                    r["body"] += ev.data
                    if ev.stream_id in self.hold:
                        r["held"] = r.get("held", 0) + len(ev.data)
                    else:
                        self.conn.acknowledge_received_data(ev.flow_controlled_length,
                                                            ev.stream_id)
                elif isinstance(ev, h2.events.TrailersReceived):
                    r["trailers"] = list(ev.headers)
                elif isinstance(ev, h2.events.StreamEnded):
                    r["ended"] = True
                elif isinstance(ev, h2.events.StreamReset):
                    if r is not None:
                        r["reset"] = ev.error_code
                elif isinstance(ev, h2.events.ConnectionTerminated):
                    self.goaway = ev.error_code
            try:
                self.flush()
            except OSError:
                self.closed = True

    def request(self, path: str, method: str = "GET", extra=(), body: bytes | None = None,
                trailers=None, authority: str | None = None, timeout: float = 20.0) -> dict:
        sid = self.headers(path, method, extra, end_stream=(body is None and not trailers),
                           authority=authority)
        if body is not None:
            view = memoryview(body)
            while view:
                n = min(len(view), self.conn.local_flow_control_window(sid),
                        self.conn.max_outbound_frame_size)
                if n <= 0:
                    self.pump(until=lambda: self.conn.local_flow_control_window(sid) > 0,
                              timeout=timeout)
                    if self.closed:
                        break
                    continue
                self.conn.send_data(sid, bytes(view[:n]))
                view = view[n:]
                self.flush()
            if trailers:
                self.conn.send_headers(sid, trailers, end_stream=True)
            else:
                self.conn.end_stream(sid)
        elif trailers:
            pass
        self.flush()
        r = self.responses[sid]
        self.pump(until=lambda: r["ended"] or r["reset"] is not None, timeout=timeout)
        return r

    def close(self):
        try:
            self.conn.close_connection()
            self.flush()
        except Exception:
            pass
        try:
            self.sock.close()
        except OSError:
            pass


def header(r: dict, name: str):
    for k, v in r["headers"]:
        if k.lower() == name:
            return v
    return None


class RawH2:
    """Raw frames on a fresh H2Client connection after the SETTINGS exchange: header blocks are
    encoded with our own HPACK encoder (nothing validated), and replies are parsed with
    hyperframe + hpack, so streams the h2 state machine would refuse to open still work."""

    def __init__(self, c: H2Client):
        import hpack
        c.pump(timeout=0.3)  # SETTINGS both ways (h2 acknowledges the server's)
        self.c = c
        self.enc = hpack.Encoder()
        self.dec = hpack.Decoder()
        self.dec.max_allowed_table_size = 1 << 16
        self.buf = b""
        self.next_sid = 1
        self.streams: dict[int, dict] = {}
        self.goaway = None
        self.closed = False
        self.ping_acks: list[bytes] = []  # opaque data of the PING ACKs received

    def send_headers(self, hdrs, end_stream=True) -> int:
        from hyperframe.frame import HeadersFrame
        sid = self.next_sid
        self.next_sid += 2
        flags = ["END_HEADERS"] + (["END_STREAM"] if end_stream else [])
        self.streams[sid] = {"status": None, "reset": None, "ended": False, "headers": [],
                             "body": b""}
        self.c.send_raw(HeadersFrame(sid, data=self.enc.encode(hdrs), flags=flags).serialize())
        return sid

    def get_frame(self, path: str, extra=()) -> tuple[int, bytes]:
        """A new stream's complete GET (HEADERS with END_STREAM) to the client's authority,
        serialized, not sent: for bursts that must reach egressd in one write."""
        from hyperframe.frame import HeadersFrame
        sid = self.next_sid
        self.next_sid += 2
        self.streams[sid] = {"status": None, "reset": None, "ended": False, "headers": [],
                             "body": b""}
        hdrs = [(":method", "GET"), (":scheme", "https"), (":authority", self.c.authority),
                (":path", path), *extra]
        return sid, HeadersFrame(sid, data=self.enc.encode(hdrs),
                                 flags=["END_HEADERS", "END_STREAM"]).serialize()

    def send(self, data: bytes):
        self.c.send_raw(data)

    def pump(self, until=lambda: False, timeout: float = 5.0):
        import time
        from hyperframe.frame import (DataFrame, Frame, GoAwayFrame, HeadersFrame, PingFrame,
                                      RstStreamFrame, WindowUpdateFrame)
        deadline = time.monotonic() + timeout
        while not until() and not self.closed and time.monotonic() < deadline:
            try:
                self.c.sock.settimeout(max(0.01, deadline - time.monotonic()))
                data = self.c.sock.recv(65536)
            except (socket.timeout, TimeoutError):
                break
            except (ssl.SSLError, OSError):
                self.closed = True
                break
            if not data:
                self.closed = True
                break
            self.buf += data
            while len(self.buf) >= 9:
                f, length = Frame.parse_frame_header(memoryview(self.buf[:9]))
                if len(self.buf) < 9 + length:
                    break
                f.parse_body(memoryview(self.buf[9:9 + length]))
                self.buf = self.buf[9 + length:]
                st = self.streams.get(f.stream_id)
                if isinstance(f, HeadersFrame):
                    hdrs = self.dec.decode(f.data)
                    if st is not None:
                        for k, v in hdrs:
                            k = k.decode() if isinstance(k, bytes) else k
                            v = v.decode() if isinstance(v, bytes) else v
                            if k == ":status":
                                st["status"] = int(v)
                            else:
                                st["headers"].append((k, v))
                if isinstance(f, (HeadersFrame, DataFrame)) and "END_STREAM" in f.flags and st:
                    st["ended"] = True
                if isinstance(f, DataFrame) and st is not None:
                    st["body"] = st.get("body", b"") + f.data  # callers may add streams
                if isinstance(f, DataFrame) and f.flow_controlled_length:
                    self.reply(WindowUpdateFrame(0, window_increment=f.flow_controlled_length))
                if isinstance(f, RstStreamFrame) and st is not None:
                    st["reset"] = f.error_code
                if isinstance(f, GoAwayFrame):
                    self.goaway = f.error_code
                if isinstance(f, PingFrame) and "ACK" not in f.flags:
                    self.reply(PingFrame(0, opaque_data=f.opaque_data, flags=["ACK"]))
                elif isinstance(f, PingFrame):
                    self.ping_acks.append(bytes(f.opaque_data))

    def reply(self, frame) -> None:
        """Sends a frame the client owes the peer (a window update, a PING ACK). A peer that
        has sent everything and closed (a draining egressd after its last stream) may be gone
        before the reply to its last DATA frame: the frames already read still count."""
        try:
            self.c.send_raw(frame.serialize())
        except (ssl.SSLError, OSError):
            self.closed = True

    def refused(self, sid) -> bool:
        st = self.streams[sid]
        return st["reset"] is not None or self.goaway is not None or (st["status"] or 0) >= 400


def frames_until_closed(sock, timeout: float) -> tuple[float | None, int | None]:
    """Reads raw HTTP/2 frames until the peer closes (within `timeout`): (seconds it took, or
    None if still open; the error code of the GOAWAY that came, or None)."""
    import time
    from hyperframe.frame import Frame, GoAwayFrame
    buf, goaway, t0 = b"", None, time.monotonic()
    sock.settimeout(0.2)
    while time.monotonic() - t0 < timeout:
        try:
            data = sock.recv(65536)
        except (socket.timeout, TimeoutError):
            continue
        except (ssl.SSLError, OSError):
            return time.monotonic() - t0, goaway
        if not data:
            return time.monotonic() - t0, goaway
        buf += data
        while len(buf) >= 9:
            f, n = Frame.parse_frame_header(memoryview(buf[:9]))
            if len(buf) < 9 + n:
                break
            f.parse_body(memoryview(buf[9:9 + n]))
            buf = buf[9 + n:]
            if isinstance(f, GoAwayFrame):
                goaway = f.error_code
    return None, goaway
