"""An HTTP/2 test upstream (python3-h2 over TLS with ALPN "h2" only) that records every request.

Endpoints (like upstream.Upstream):
    /echo       JSON: method, path, headers, body length/sha256, request trailers, proto "h2"
    /bytes/N    N deterministic bytes (upstream.payload), Content-Length
    /early-bytes/N  the same, answered on the request's HEADERS while its body still comes
                (a server streaming back, as gRPC's bidirectional calls do)
    /trailers   JSON echo as above, then response trailers grpc-status: 0, x-trailer: t1
    /reflect    the request's Authorization / X-Api-Key value in header x-seen and the body
    /reflect-late  that value in the body only, in a DATA frame after 2000 bytes of filler
    /status/N   an empty response with status N
    /fields     ?set=Name:Value fields in the head, ?tset=Name:Value in trailers (repeatable)
Flow control is honoured both ways: large bodies wait for WINDOW_UPDATEs.

`settings_frames[i]` counts the SETTINGS frames (not acknowledgements) the i-th connection
received; with `ack_settings = False` they are never acknowledged (an upstream that ignores
them: the ACKs python3-h2 makes are dropped on the way out).

An upstream that stops taking streams: `streams_after_first = N` sends
SETTINGS_MAX_CONCURRENT_STREAMS N with a connection's first answer; `ping_every = S`
sends a PING whenever the connection has been quiet S seconds (so it is never idle on the wire).
`live` is the number of connections open now.

Every request head that arrives is also recorded in `heads` (its path), when it arrives: a
stream that never ends (an upload still coming, a stream reset before its end) is answered and
recorded in `requests` only at its end, if at all, but reached the upstream all the same.

Refusals, as real servers make them (each stream refused is counted in `refused`, never in
`requests`: nothing of it was processed):
    goaway_after = N   after answering N requests on a connection, GOAWAY with the last of
                       them as last_stream_id, then close (nginx after keepalive_requests):
                       streams above it that were already sent are never answered
    a path holding "/refuse-once/"  RST_STREAM REFUSED_STREAM the first time that path comes
                                    (then answered as its route: /echo/refuse-once/X)
    a path holding "/refuse-early-once/"  the same, but at once on its HEADERS, while the
                                    request body may still be coming
"""
from __future__ import annotations

import hashlib
import json
import socket
import ssl
import threading
import urllib.parse

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions

from upstream import Seen, iter_payload


def _without_settings_acks(data: bytes) -> bytes:
    """`data` (whole frames, as python3-h2 hands them out) without SETTINGS ACK frames."""
    kept, i = [], 0
    while i < len(data):
        length = int.from_bytes(data[i:i + 3], "big")
        end = i + 9 + length
        if not (data[i + 3] == 0x4 and data[i + 4] & 0x1):
            kept.append(data[i:end])
        i = end
    return b"".join(kept)


class _Stream:
    def __init__(self, sid: int, headers: list[tuple[str, str]]):
        self.sid = sid
        self.headers = headers
        self.pseudo = {k: v for k, v in headers if k.startswith(":")}
        self.regular = [(k, v) for k, v in headers if not k.startswith(":")]
        # fields the sender marked never-indexed (RFC 7541 7.1.3): hpack decodes them as
        # NeverIndexedHeaderTuple, whose `indexable` is False
        self.never_indexed = [h[0] for h in headers if not getattr(h, "indexable", True)]
        self.sha = hashlib.sha256()
        self.n = 0
        self.trailers: list[tuple[str, str]] = []
        self.out = b""            # response body still to send
        self.out_trailers = None
        self.body_iter = None     # generator for big bodies
        self.done = False
        self.responded = False


class H2Upstream:
    def __init__(self, cert: str, key: str):
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(cert, key)
        self.ctx.set_alpn_protocols(["h2"])
        self.lock = threading.Lock()
        self.requests_seen: list[Seen] = []
        self.heads_seen: list[str] = []  # the :path of every request head received
        self.connections = 0
        self.goaway_after = 0     # 0: never
        self.refused = 0          # streams refused unprocessed (GOAWAY'd or REFUSED_STREAM)
        self.max_header_list_size = 1 << 16  # decoded request head it takes (h2's default)
        self.ack_settings = True
        self.streams_after_first: int | None = None
        self.ping_every = 0.0
        self.live = 0
        self.settings_frames: list[int] = []  # per connection, in accept order
        self._refused_paths: set[str] = set()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    # -- observation (same shape as upstream.Upstream) --------------------------------------
    @property
    def requests(self) -> list[Seen]:
        with self.lock:
            return list(self.requests_seen)

    def find(self, marker: str) -> list[Seen]:
        return [r for r in self.requests if marker in r.path]

    def heads(self, marker: str) -> list[str]:
        """Paths of the request heads that reached the upstream (ended or not) with `marker`."""
        with self.lock:
            return [p for p in self.heads_seen if marker in p]

    def close(self):
        self._stop.set()
        self.thread.join(timeout=5)
        self.sock.close()

    # -- server -----------------------------------------------------------------------------
    def _accept(self):
        while not self._stop.is_set():
            try:
                c, _ = self.sock.accept()
            except (socket.timeout, OSError):
                continue
            with self.lock:
                self.connections += 1
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, raw: socket.socket):
        raw.settimeout(30)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            s = self.ctx.wrap_socket(raw, server_side=True)
        except (OSError, ssl.SSLError):
            raw.close()
            return
        sni = None
        with self.lock:
            index = len(self.settings_frames)
            self.settings_frames.append(0)
            self.live += 1

        def send(data: bytes):
            s.sendall(data if self.ack_settings else _without_settings_acks(data))

        conn = h2.connection.H2Connection(
            config=h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
        conn.decoder.max_header_list_size = self.max_header_list_size
        conn.initiate_connection()
        conn.update_settings({h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 100})
        send(conn.data_to_send())
        streams: dict[int, _Stream] = {}
        served = [0]
        try:
            while not self._stop.is_set():
                self._pump(conn, streams)
                out = conn.data_to_send()
                if out:
                    send(out)
                    continue
                if self.ping_every:
                    s.settimeout(self.ping_every)
                try:
                    data = s.recv(65536)
                except TimeoutError:
                    if not self.ping_every:
                        raise
                    conn.ping(b"keepbusy")
                    continue
                if not data:
                    break
                try:
                    events = conn.receive_data(data)
                except h2.exceptions.ProtocolError:
                    send(conn.data_to_send())
                    break
                with self.lock:
                    self.settings_frames[index] += sum(
                        isinstance(ev, h2.events.RemoteSettingsChanged) for ev in events)
                last = None
                for ev in events:
                    if last is not None and getattr(ev, "stream_id", 0) > last:
                        # after our GOAWAY's last stream: never processed
                        if isinstance(ev, h2.events.RequestReceived):
                            with self.lock:
                                self.refused += 1
                        continue
                    self._event(conn, streams, ev, sni)
                    if (self.goaway_after and isinstance(ev, h2.events.StreamEnded)
                            and ev.stream_id in streams and streams[ev.stream_id].responded):
                        served[0] += 1
                        if served[0] == self.goaway_after:
                            last = ev.stream_id
                if last is not None:
                    # Answers up to `last` first (h2 takes no frame after its GOAWAY), then
                    # the GOAWAY, then the close: what the client sent above it is refused.
                    # (an /echo answer's body is in st.out, a /bytes one's in body_iter; the
                    # windows egressd gives are far larger than these answers)
                    while any(st.responded and not st.done for st in streams.values()):
                        self._pump(conn, streams)
                        send(conn.data_to_send())
                    with self.lock:
                        self.refused += len([sid for sid, st in streams.items()
                                             if sid > last and not st.responded])
                    conn.close_connection(last_stream_id=last)
                    send(conn.data_to_send())
                    # Streams the client had sent past `last` that are still in flight
                    # (in this read or the next): refused too, counted at the client.
                    # What the client sent is read and dropped before the close, as nginx's
                    # lingering close: a close with unread bytes is a reset, which can take
                    # the answers above with it before the client read them.
                    s.settimeout(2)
                    while s.recv(65536):
                        pass
                    break
                send(conn.data_to_send())
        except (OSError, ssl.SSLError, ConnectionError):
            pass
        finally:
            with self.lock:
                self.live -= 1
            try:
                s.close()
            except OSError:
                pass

    def _event(self, conn, streams, ev, sni):
        if isinstance(ev, h2.events.RequestReceived):
            st = _Stream(ev.stream_id, list(ev.headers))
            with self.lock:
                self.heads_seen.append(st.pseudo.get(":path", "/"))
            if self._refuse_first(st.pseudo.get(":path", "/"), "/refuse-early-once/"):
                conn.reset_stream(st.sid, error_code=h2.errors.ErrorCodes.REFUSED_STREAM)
                return
            streams[ev.stream_id] = st
            if st.pseudo.get(":path", "/").startswith("/early-bytes/"):
                self._respond(conn, st)  # at once, while the request body may still come
        elif isinstance(ev, h2.events.DataReceived):
            st = streams.get(ev.stream_id)
            if st is not None:
                st.sha.update(ev.data)
                st.n += len(ev.data)
            conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
        elif isinstance(ev, h2.events.TrailersReceived):
            st = streams.get(ev.stream_id)
            if st is not None:
                st.trailers = list(ev.headers)
        elif isinstance(ev, h2.events.StreamEnded):
            st = streams.get(ev.stream_id)
            if st is not None and not st.responded:
                self._respond(conn, st)
        elif isinstance(ev, h2.events.StreamReset):
            streams.pop(ev.stream_id, None)

    def _refuse_first(self, path: str, marker: str) -> bool:
        """Whether `path` holds `marker` and comes for the first time (counted refused)."""
        if marker not in path:
            return False
        with self.lock:
            first = path not in self._refused_paths
            self._refused_paths.add(path)
            if first:
                self.refused += 1
        return first

    def _respond(self, conn, st: _Stream):
        st.responded = True
        if self.streams_after_first is not None and not getattr(conn, "limited", False):
            conn.limited = True  # once per connection, ahead of its first answer
            conn.update_settings(
                {h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: self.streams_after_first})
        p = st.pseudo
        path = p.get(":path", "/")
        if self._refuse_first(path, "/refuse-once/"):
            conn.reset_stream(st.sid, error_code=h2.errors.ErrorCodes.REFUSED_STREAM)
            return
        seen = Seen(p.get(":method", ""), path, st.regular, st.n)
        seen.authority = p.get(":authority")
        seen.trailers = st.trailers
        with self.lock:
            self.requests_seen.append(seen)
        url = urllib.parse.urlsplit(path)
        parts = url.path.split("/")
        base = "/" + parts[1] if len(parts) > 1 else "/"
        echo = {"method": p.get(":method"), "path": path, "authority": p.get(":authority"),
                "headers": [[k, v] for k, v in st.regular],
                "never_indexed": st.never_indexed,
                "body_length": st.n,
                "body_sha256": st.sha.hexdigest(), "trailers": [[k, v] for k, v in st.trailers],
                "proto": "h2"}
        if base in ("/echo", "/upload"):
            body = json.dumps(echo).encode()
            self._send(conn, st, 200, [("content-type", "application/json"),
                                       ("content-length", str(len(body)))], body)
        elif base == "/trailers":
            body = json.dumps(echo).encode()
            self._send(conn, st, 200, [("content-type", "application/json")], body,
                       trailers=[("grpc-status", "0"), ("x-trailer", "t1")])
        elif len(parts) == 3 and parts[1] in ("bytes", "early-bytes") and parts[2].isdigit():
            total = int(parts[2])
            st.body_iter = iter_payload(total, 16384)
            conn.send_headers(st.sid, [(":status", "200"), ("content-type", "application/octet-stream"),
                                       ("content-length", str(total))],
                              end_stream=(total == 0 or p.get(":method") == "HEAD"))
            if total == 0 or p.get(":method") == "HEAD":
                st.body_iter = None
                st.done = True
        elif base == "/reflect-late":
            # The value in the body only, after a filler: its own DATA frame, not the first.
            value = dict(st.regular).get("authorization") or dict(st.regular).get("x-api-key") or ""
            late = b"seen=" + value.encode("latin-1") + b";end\n"
            filler = b"f" * 2000
            st.body_iter = iter([filler, late])
            conn.send_headers(st.sid, [(":status", "200"), ("content-type", "text/plain"),
                                       ("content-length", str(len(filler) + len(late)))])
        elif base == "/fields":
            # ?set=Name:Value fields in the head, ?tset=Name:Value in trailers (repeatable)
            pairs = urllib.parse.parse_qsl(urllib.parse.urlsplit(path).query)
            sets = [tuple(kv.split(":", 1)) for k, kv in pairs if k == "set" and ":" in kv]
            tsets = [tuple(kv.split(":", 1)) for k, kv in pairs if k == "tset" and ":" in kv]
            self._send(conn, st, 200, [("content-type", "text/plain")] + sets, b"ok",
                       trailers=tsets or None)
        elif base == "/reflect":
            value = dict(st.regular).get("authorization") or dict(st.regular).get("x-api-key") or ""
            body = b"seen=" + value.encode("latin-1") + b";end\n"
            self._send(conn, st, 200, [("content-type", "text/plain"), ("x-seen", value)], body)
        elif len(parts) == 3 and parts[1] == "status" and parts[2].isdigit():
            self._send(conn, st, int(parts[2]), [("content-length", "0")], b"")
        elif len(parts) == 3 and parts[1] == "empty" and parts[2].isdigit():
            # ended on the HEADERS frame without a content-length, as h2 servers may
            self._send(conn, st, int(parts[2]), [("content-type", "text/plain")], b"")
        else:
            self._send(conn, st, 404, [("content-type", "text/plain")], b"not found\n")

    def _send(self, conn, st, status, headers, body: bytes, trailers=None):
        conn.send_headers(st.sid, [(":status", str(status))] + headers,
                          end_stream=(not body and not trailers))
        st.out = body
        st.out_trailers = trailers
        if not body and trailers:
            conn.send_headers(st.sid, trailers, end_stream=True)
            st.done = True
        elif not body:
            st.done = True

    def _pump(self, conn, streams: dict[int, _Stream]):
        """Sends as much pending body as the flow-control windows allow."""
        for sid, st in list(streams.items()):
            if not st.responded:
                continue
            if st.done:
                streams.pop(sid, None)
                continue
            try:
                while True:
                    if not st.out and st.body_iter is not None:
                        st.out = next(st.body_iter, b"")
                        if not st.out:
                            st.body_iter = None
                    if not st.out:
                        if st.body_iter is None:
                            if st.out_trailers:
                                conn.send_headers(sid, st.out_trailers, end_stream=True)
                            else:
                                conn.end_stream(sid)
                            st.done = True
                        break
                    window = min(conn.local_flow_control_window(sid), conn.max_outbound_frame_size)
                    if window <= 0:
                        break
                    piece, st.out = st.out[:window], st.out[window:]
                    conn.send_data(sid, piece)
            except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError, KeyError):
                st.done = True
            except h2.exceptions.FlowControlError:
                pass
