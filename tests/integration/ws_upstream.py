"""A WebSocket origin on 127.0.0.1 for the integration tests: Python's `websockets` (the Debian
package, 10.x) in a thread of the test process, TLS with the test PKI or cleartext.

Each connection's handshake headers are recorded (`seen`), so a test can check what reached
the origin (the injected credential, no Sec-WebSocket-Extensions) without the origin sending
the secret anywhere but back through egressd. Messages are commands:
  "echo:TEXT"   answers TEXT;           binary data is echoed as it came;
  "auth"        answers "auth=" + the Authorization the handshake carried (an echoed secret);
  "authsplit:K" answers the same as a fragmented message: its first K characters in one frame,
                the rest in 3 more (the secret split across frames);
  "big:N"       answers N bytes of b"x" (frames with 16- and 64-bit lengths);
  "close"       the origin closes (its Close frame, then the TCP close);
  "wait:S"      answers "waited" after S seconds.
A path starting with /reject answers 403 instead of switching protocols.
"""
from __future__ import annotations

import asyncio
import http
import ssl
import threading

import websockets
import websockets.server

from upstream import free_port


class WsUpstream:
    def __init__(self, cert: str | None = None, key: str | None = None):
        self.port = free_port()
        self.seen: list[dict] = []  # per handshake: path, headers (lowercase names)
        self._lock = threading.Lock()
        self._ssl = None
        if cert:
            self._ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            self._ssl.load_cert_chain(cert, key)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Future | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("WebSocket upstream did not start")

    def _run(self):
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())

    async def _serve(self):
        self._stop = self._loop.create_future()
        async with websockets.serve(self._handler, "127.0.0.1", self.port, ssl=self._ssl,
                                    process_request=self._process_request,
                                    max_size=8 << 20):
            self._ready.set()
            await self._stop

    async def _process_request(self, path, headers):
        with self._lock:
            self.seen.append({"path": path,
                              "headers": {k.lower(): v for k, v in headers.raw_items()}})
        if path.startswith("/reject"):
            return http.HTTPStatus.FORBIDDEN, [("Content-Type", "text/plain")], b"rejected\n"
        return None

    async def _handler(self, ws, path=None):
        auth = ws.request_headers.get("Authorization", "")
        async for msg in ws:
            if isinstance(msg, bytes):
                await ws.send(msg)
            elif msg.startswith("echo:"):
                await ws.send(msg[5:])
            elif msg == "auth":
                await ws.send("auth=" + auth)
            elif msg.startswith("authsplit:"):
                text = "auth=" + auth
                k = int(msg[10:])
                rest = text[k:]
                third = max(1, len(rest) // 3)
                await ws.send([text[:k], rest[:third], rest[third:2 * third], rest[2 * third:]])
            elif msg.startswith("big:"):
                await ws.send(b"x" * int(msg[4:]))
            elif msg.startswith("wait:"):
                await asyncio.sleep(float(msg[5:]))
                await ws.send("waited")
            elif msg == "close":
                await ws.close(code=1000, reason="origin done")
                return

    def last_seen(self, path_part: str) -> dict:
        with self._lock:
            hits = [s for s in self.seen if path_part in s["path"]]
        assert hits, f"no handshake for {path_part!r} reached the origin"
        return hits[-1]

    def close(self):
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set_result, None)
        self._thread.join(10)
