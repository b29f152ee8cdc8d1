"""gRPC through egressd with real gRPC (Debian's python3-grpcio) on both sides: the client
through egressd's CONNECT port (grpc.http_proxy), the server a TLS gRPC server on loopback.
HTTP/2 on both legs: the pinned credential reaches the server as metadata, and a
bidirectional stream works as one, each request message answered before the client sends the
next (the request body is relayed up while the response comes down; a proxy that took the
whole request body first would hold the client's first message until it hangs up)."""
from __future__ import annotations

import queue
import threading
import time
from concurrent import futures

import grpc
import pytest

import helpers
from clients import run_ca
from upstream import free_port

METHOD = "/egress.test.Chat/Talk"
UNARY = "/egress.test.Chat/Once"
GATHER = "/egress.test.Chat/Gather"
HANG = "/egress.test.Chat/Hang"


class GrpcUpstream:
    def __init__(self, cert: str, key: str):
        self.port = free_port()
        self.metadata: list[dict] = []
        self._lock = threading.Lock()
        self.hang_uploaded = threading.Event()  # a Hang call has read its whole request

        def talk(request_iterator, context):
            with self._lock:
                self.metadata.append(dict(context.invocation_metadata()))
            auth = dict(context.invocation_metadata()).get("authorization", "")
            for msg in request_iterator:
                if msg == b"auth":
                    yield b"auth=" + auth.encode()
                elif msg.startswith(b"ticks:"):  # answers N times, 0.5 s apart
                    for i in range(int(msg[6:])):
                        time.sleep(0.5)
                        yield b"tick-%d" % i
                else:
                    yield b"echo:" + msg

        def gather(request_iterator, context):  # answers once, when the client is done
            return b"gathered:" + b",".join(request_iterator)

        def hang(request_iterator, context):  # takes the whole request, then answers late
            for _ in request_iterator:
                pass
            self.hang_uploaded.set()
            time.sleep(8)
            return b"late"

        def once(request, context):
            with self._lock:
                self.metadata.append(dict(context.invocation_metadata()))
            return b"once:" + request

        handler = grpc.method_handlers_generic_handler("egress.test.Chat", {
            "Talk": grpc.stream_stream_rpc_method_handler(talk),
            "Once": grpc.unary_unary_rpc_method_handler(once),
            "Gather": grpc.stream_unary_rpc_method_handler(gather),
            "Hang": grpc.stream_unary_rpc_method_handler(hang),
        })
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        self.server.add_generic_rpc_handlers((handler,))
        with open(cert, "rb") as f:
            chain = f.read()
        with open(key, "rb") as f:
            pkey = f.read()
        creds = grpc.ssl_server_credentials([(pkey, chain)])
        self.server.add_secure_port(f"127.0.0.1:{self.port}", creds)
        self.server.start()

    def close(self):
        self.server.stop(grace=1).wait(5)


@pytest.fixture(scope="module")
def up(world):
    u = GrpcUpstream(world.pki.server_cert, world.pki.server_key)
    yield u
    u.close()


def _with_pin(port: int, idle_timeout: str | None = None):
    def mutate(c):
        helpers.pin_bearer(c, "api.test", port)
        if idle_timeout:
            c["limits"]["idle_timeout"] = idle_timeout
    return mutate


@pytest.fixture(scope="module")
def e(factory, up):
    return factory.start(mutate=_with_pin(up.port))


@pytest.fixture(scope="module")
def e_idle(factory, up):
    """idle_timeout 3 s: each side below stays quiet for 6 s while the other moves. (It was
    1.5 s and 3 s: a sanitizer build on a loaded 2-core machine once took longer than 1.5 s
    between the client's last message and the server's answer.)"""
    return factory.start(mutate=_with_pin(up.port, "3s"))


def _channel(world, e, up) -> grpc.Channel:
    with open(run_ca(e, "r1"), "rb") as f:
        creds = grpc.ssl_channel_credentials(root_certificates=f.read())
    proxy = f"http://r1:{world.tokens['r1']}@127.0.0.1:{e.proxy_port}"
    return grpc.secure_channel(f"api.test:{up.port}", creds,
                               options=[("grpc.http_proxy", proxy),
                                        ("grpc.enable_retries", 0)])


def test_unary_call_carries_the_pinned_credential(world, e, up):
    with _channel(world, e, up) as ch:
        once = ch.unary_unary(UNARY)
        assert once(b"hi", timeout=10) == b"once:hi"
    assert up.metadata[-1]["authorization"] == f"Bearer {world.secrets['api_token']}"
    rec = e.wait_audit(lambda r: r.get("path") == UNARY)[-1]
    assert rec["status"] == 200 and rec["proto_in"] == "h2" and rec["proto_out"] == "h2", rec
    assert rec["secret"] == "api_token"


def test_bidirectional_stream_answers_each_message_before_the_next(world, e, up):
    """The client sends its next message only after the answer to the previous one came back:
    a conversation, which needs both directions open at once through egressd."""
    secret = world.secrets["api_token"]
    answers: queue.Queue = queue.Queue()
    sent: list[bytes] = []

    def requests():
        for i in range(5):
            msg = f"turn-{i}".encode()
            sent.append(msg)
            yield msg
            # Waits for this turn's answer (10 s at most) before saying anything more.
            got = answers.get(timeout=10)
            if got is None:
                return
        yield b"auth"

    with _channel(world, e, up) as ch:
        talk = ch.stream_stream(METHOD)
        call = talk(requests(), timeout=30)
        got = []
        try:
            for reply in call:
                got.append(reply)
                answers.put(reply)
        finally:
            answers.put(None)
    assert got[:5] == [b"echo:turn-%d" % i for i in range(5)], got
    echoed = got[5].decode()
    assert secret not in echoed, "the server's echo reached the client unscrubbed"
    assert "[REDACTED]" in echoed and len(echoed) == len(f"auth=Bearer {secret}")
    rec = e.wait_audit(lambda r: r.get("path") == METHOD)[-1]
    assert rec["status"] == 200 and rec["decision"] == "allow", rec
    assert rec["reason"] == "injected", rec
    assert rec["bytes_in"] > 0 and rec["bytes_out"] > 0, rec
    assert e.leaks() == []


def test_a_client_quiet_while_the_server_streams_is_not_timed_out(world, e_idle, up):
    """One message up, then the client only listens for 6 s (twice idle_timeout) while the
    server answers every 0.5 s: the exchange is not idle, its upload only quiet."""
    done = threading.Event()

    def requests():
        yield b"ticks:12"
        done.wait(15)

    with _channel(world, e_idle, up) as ch:
        call = ch.stream_stream(METHOD)(requests(), timeout=20)
        got = []
        try:
            for reply in call:
                got.append(reply)
                if len(got) == 12:
                    done.set()
        finally:
            done.set()
    assert got == [b"tick-%d" % i for i in range(12)]


def test_a_server_quiet_while_the_client_streams_is_not_timed_out(world, e_idle, up):
    """Twelve messages 0.5 s apart (6 s, twice idle_timeout) before the server's only answer."""
    def requests():
        for i in range(12):
            yield b"part-%d" % i
            time.sleep(0.5)

    with _channel(world, e_idle, up) as ch:
        reply = ch.stream_unary(GATHER)(requests(), timeout=20)
    assert reply == b"gathered:" + b",".join(b"part-%d" % i for i in range(12))


def test_a_stream_quiet_both_ways_ends_at_idle_timeout(world, e_idle, up):
    done = threading.Event()

    def requests():
        yield b"hello"
        done.wait(10)  # then silence both ways

    t0 = time.monotonic()
    with _channel(world, e_idle, up) as ch:
        call = ch.stream_stream(METHOD)(requests(), timeout=20)
        got = []
        with pytest.raises(grpc.RpcError):
            for reply in call:
                got.append(reply)
        done.set()
    assert got == [b"echo:hello"]
    assert time.monotonic() - t0 < 8
    rec = e_idle.wait_audit(lambda r: r.get("path") == METHOD and r.get("reason") == "idle_timeout")
    assert rec[-1]["status"] == 200, rec


def test_a_client_cancelling_after_its_upload_ends_the_wait_for_the_answer(world, e, up):
    """The upload is over, the answer not there yet, and the client cancels (RST_STREAM): the
    upstream part is given up at once, recorded client_aborted, not when the server answers."""
    with _channel(world, e, up) as ch:
        up.hang_uploaded.clear()
        fut = ch.stream_unary(HANG).future(iter([b"a", b"b"]), timeout=30)
        assert up.hang_uploaded.wait(10), "the upload did not reach the upstream"
        t0 = time.monotonic()
        fut.cancel()
        recs = e.wait_audit(lambda r: r.get("path") == HANG, timeout=5)
    assert time.monotonic() - t0 < 4
    assert recs[0]["reason"] == "client_aborted" and recs[0]["status"] == 0, recs
