#!/usr/bin/python3
"""Writes the seed corpus of fuzz_h2_server: tests/fuzz/corpus/h2_server/<name>.

Each seed is the target's input format (see fuzz_h2_server.cc):
  byte 0  mem_recv chunk size (0: 16 KiB as read_loop reads, else 1..255 bytes),
  byte 1  CONNECT target index (bits 0-2, kTargets) | 0x80 to make the worker draining,
  rest    what the client sends: the connection preface, then frames.
Frames are built by hand with hyperframe and hpack (python3-h2's dependencies), so seeds can
be malformed on purpose; one seed comes from a real h2.connection client.

Run from anywhere: /usr/bin/python3 tests/fuzz/make_h2_seeds.py
"""
import os

import h2.config
import h2.connection
import hpack
from hyperframe import frame as hf

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "h2_server")
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# kTargets in fuzz_h2_server.cc
API, GIT, KEY, MIXED, PYPI, OPEN, PORT, EVIL = range(8)
DRAINING = 0x80


def settings(**kw):
    f = hf.SettingsFrame(0)
    for k, v in kw.items():
        f.settings[getattr(hf.SettingsFrame, k)] = v
    return f.serialize()


def settings_ack():
    return hf.SettingsFrame(0, flags=["ACK"]).serialize()


def headers(stream_id, fields, end_stream=True, end_headers=True, encoder=None, priority=False):
    enc = encoder or hpack.Encoder()
    block = enc.encode(fields, huffman=False) if fields is not None else b""
    flags = []
    if end_stream:
        flags.append("END_STREAM")
    if end_headers:
        flags.append("END_HEADERS")
    f = hf.HeadersFrame(stream_id, data=block, flags=flags)
    if priority:
        f.flags.add("PRIORITY")
        f.depends_on, f.stream_weight, f.exclusive = 0, 15, False
    return f.serialize()


def raw_frame(ftype, flags, stream_id, payload):
    return (len(payload).to_bytes(3, "big") + bytes([ftype, flags]) +
            (stream_id & 0x7FFFFFFF).to_bytes(4, "big") + payload)


def data(stream_id, payload, end_stream=True):
    return hf.DataFrame(stream_id, data=payload, flags=["END_STREAM"] if end_stream else []).serialize()


def rst(stream_id, code=8):
    return hf.RstStreamFrame(stream_id, error_code=code).serialize()


def ping(ack=False):
    return hf.PingFrame(0, opaque_data=b"12345678", flags=["ACK"] if ack else []).serialize()


def window_update(stream_id, inc):
    return hf.WindowUpdateFrame(stream_id, window_increment=inc).serialize()


def req(path="/repos/acme/web", authority="api.github.com", method="GET", scheme="https",
        extra=()):
    fields = [(":method", method), (":scheme", scheme), (":authority", authority), (":path", path)]
    return fields + list(extra)


def client_start():
    return PREFACE + settings(ENABLE_PUSH=0, INITIAL_WINDOW_SIZE=65535) + settings_ack()


SEEDS = {}


def seed(name, chunk, target, body):
    SEEDS[name] = bytes([chunk, target]) + body


# Well-formed requests, one per pin shape.
seed("get_pinned", 0, API, client_start() + headers(1, req(extra=[("authorization", "token mine"),
                                                                 ("user-agent", "fuzz")])))
seed("post_body_trailers", 0, API, client_start() +
     headers(1, req(method="POST", extra=[("content-length", "5"), ("te", "trailers")]),
             end_stream=False) +
     data(1, b"hello", end_stream=False) +
     headers(1, [("x-trailer", "1"), ("authorization", "Bearer trailer")], end_stream=True))
seed("basic_pin", 0, GIT, client_start() + headers(1, req("/acme.git/info/refs", "git.test")))
seed("header_pin", 0, KEY, client_start() + headers(1, req("/v1", "a.key.test:443",
                                                             extra=[("x-api-key", "mine")])))
seed("mixed_unmatched", 0, MIXED, client_start() + headers(1, req("/public/", "mixed.test")))
seed("allowed_unpinned", 0, PYPI, client_start() + headers(1, req("/simple/", "pypi.org")))
seed("port_pin", 0, PORT, client_start() + headers(1, req("/", "api.port.test:8443")))
seed("denied_target", 0, EVIL, client_start() + headers(1, req("/", "evil.test")))
seed("head_request", 0, API, client_start() + headers(1, req(method="HEAD")))
seed("secret_in_body", 0, API, client_start() +
     headers(1, req(method="PUT", path="/repos/acme/s2"), end_stream=False) +
     data(1, b"xx ghp_FUZZs3cr3t yy Bearer ghp_FUZZs3cr3t zz"))
seed("cookies_split", 0, API, client_start() + headers(1, req(extra=[("cookie", "a=1"),
                                                                     ("cookie", "b=2")])))
seed("small_chunks", 7, API, client_start() +
     headers(1, req(method="POST"), end_stream=False) + data(1, b"a" * 100))
seed("draining", 0, API | DRAINING, client_start() + headers(1, req()))

# Host / :authority games.
seed("host_and_authority_differ", 0, API, client_start() + headers(1, req(extra=[("host", "evil.test")])))
seed("host_only", 0, API, client_start() + headers(1, [(":method", "GET"), (":scheme", "https"),
                                                       (":path", "/repos/acme/x"),
                                                       ("host", "api.github.com")]))
seed("two_hosts", 0, API, client_start() + headers(1, req(extra=[("host", "api.github.com"),
                                                                 ("host", "evil.test")])))
seed("authority_userinfo", 0, API, client_start() + headers(1, req(authority="x@api.github.com")))
seed("authority_mismatch", 0, API, client_start() + headers(1, req(authority="pypi.org")))

# Malformed requests (nghttp2's messaging checks and ours).
seed("connect_in_tunnel", 0, API, client_start() + headers(1, [(":method", "CONNECT"),
                                                               (":authority", "evil.test:443")]))
seed("scheme_http", 0, API, client_start() + headers(1, req(scheme="http")))
seed("protocol_pseudo", 0, API, client_start() + headers(1, req(extra=[(":protocol", "websocket")])))
seed("uppercase_name", 0, API, client_start() + headers(1, req(extra=[("X-Upper", "1")])))
seed("connection_header", 0, API, client_start() + headers(1, req(extra=[("connection", "close"),
                                                                        ("te", "gzip")])))
seed("crlf_value", 0, API, client_start() + headers(1, req(extra=[("x-a", "b\r\nx-injected: 1")])))
seed("nul_name", 0, API, client_start() + headers(1, req(extra=[("x-a\x00b", "c")])))
seed("forged_egress", 0, API, client_start() + headers(1, req(extra=[("x-egress-reason", "allowed")])))
seed("proxy_authorization", 0, API, client_start() + headers(1, req(extra=[("proxy-authorization", "Basic eDp5")])))
seed("path_traversal", 0, API, client_start() + headers(1, req(path="/repos/acme/%2e%2e/admin")))
seed("content_length_mismatch", 0, API, client_start() +
     headers(1, req(method="POST", extra=[("content-length", "10")]), end_stream=False) +
     data(1, b"abc"))
seed("no_pseudo_headers", 0, API, client_start() + headers(1, [("x-a", "b")]))

# Flow control and frame-level abuse.
seed("zero_window", 0, API, PREFACE + settings(INITIAL_WINDOW_SIZE=0) + settings_ack() +
     headers(1, req(method="POST"), end_stream=False) + data(1, b"q" * 64) +
     window_update(0, 1) + window_update(1, 1))
seed("window_overflow", 0, API, client_start() + headers(1, req()) + window_update(0, 0x7FFFFFFF) +
     window_update(0, 0x7FFFFFFF))
seed("rapid_reset", 0, API, client_start() + b"".join(
    headers(i, req()) + rst(i) for i in range(1, 80, 2)))
seed("rst_before_body", 0, API, client_start() + headers(1, req(method="POST"), end_stream=False) +
     rst(1) + data(1, b"late"))
seed("ping_flood", 0, API, client_start() + ping() * 60)
seed("settings_flood", 0, API, client_start() + settings(HEADER_TABLE_SIZE=0) * 40)
seed("priority_flood", 0, API, client_start() + b"".join(
    hf.PriorityFrame(i, depends_on=0, stream_weight=1).serialize() for i in range(1, 60, 2)))
seed("empty_data_flood", 0, API, client_start() + headers(1, req(method="POST"), end_stream=False) +
     data(1, b"", end_stream=False) * 50)
seed("too_many_streams", 0, API, client_start() + b"".join(headers(i, req()) for i in range(1, 240, 2)))
seed("even_stream_id", 0, API, client_start() + headers(2, req()))
seed("goaway", 0, API, client_start() + headers(1, req()) +
     hf.GoAwayFrame(0, last_stream_id=1, error_code=0).serialize())
seed("push_promise_from_client", 0, API, client_start() +
     raw_frame(5, 4, 1, (2).to_bytes(4, "big") + hpack.Encoder().encode(req())))
seed("unknown_frame", 0, API, client_start() + raw_frame(0xFA, 0xFF, 1, b"xyz") + headers(1, req()))

# Header block abuse.
enc = hpack.Encoder()
block = enc.encode(req() + [("x-big", "v" * 3000)])
cont = [block[i:i + 100] for i in range(0, len(block), 100)]
seed("continuation_flood", 0, API, client_start() +
     raw_frame(1, 1, 1, cont[0]) +  # HEADERS, END_STREAM, no END_HEADERS
     b"".join(raw_frame(9, 0, 1, c) for c in cont[1:-1]) + raw_frame(9, 4, 1, cont[-1]))
seed("continuation_interleaved", 0, API, client_start() +
     raw_frame(1, 1, 1, cont[0]) + headers(3, req()) + raw_frame(9, 4, 1, cont[1]))
enc = hpack.Encoder()
first = enc.encode(req() + [("x-bomb", "b" * 4000)])
again = enc.encode(req() + [("x-bomb", "b" * 4000)] * 20)  # indexed references: tiny on the wire
seed("hpack_bomb", 0, API, client_start() + raw_frame(1, 5, 1, first) + raw_frame(1, 5, 3, again))
seed("too_many_fields", 0, API, client_start() + headers(1, req(extra=[(f"x-{i}", "v") for i in range(150)])))
seed("hpack_table_size_update", 0, API, client_start() + raw_frame(1, 5, 1, b"\x3f\xe1\x1f" + hpack.Encoder().encode(req())))
seed("hpack_garbage", 0, API, client_start() + raw_frame(1, 5, 1, b"\xff\xff\xff\xff\x0f\x80"))

# A real client's bytes, split into 1-byte reads.
conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
conn.initiate_connection()
conn.send_headers(1, req(path="/repos/acme/h2", extra=[("te", "trailers")]), end_stream=False)
conn.send_data(1, b'{"a": 1}', end_stream=False)
conn.send_headers(3, req(path="/repos/other"), end_stream=True)
conn.send_data(1, b"", end_stream=True)
seed("h2_client_two_streams", 1, API, conn.data_to_send())


def main():
    os.makedirs(OUT, exist_ok=True)
    for name, blob in SEEDS.items():
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(blob)
    print(f"{len(SEEDS)} seeds in {OUT}")


if __name__ == "__main__":
    main()
