"""The harness behind test_adversarial.py: one egressd (an "arena") with a scripted DNS server,
well-behaved clients running in the background, and a checker that holds every attack case to
the same five assertions:

  (a) the refusal: status and X-Egress-Reason (h2: the stream's response or RST_STREAM; TLS-level
      refusals: the handshake fails), and for HTTP/1.1 framing errors, the connection is closed
      after the error response (a request smuggled behind the bad one is never answered);
  (b) nothing was injected: the test upstreams saw no request from the attack (or, for cases
      whose correct outcome is "served, sanitised", exactly the expected requests), and no
      request carries a secret it should not;
  (c) an audit record for the attempt: decision and reason (exact count);
  (d) egressd_denied_total{reason} grew by the expected amount (certs minted too, if given);
  (e) well-behaved HTTP/1.1 and HTTP/2 clients (another run, credential injected) were served
      during the attack, without a single error.

A case is a table entry: ``Case(id, attack, status, reason, ...)``; ``attack(ctx)`` does the
attack with raw sockets / raw h2 frames and returns an ``Obs``. Every loop is bounded in count
and time.
"""
from __future__ import annotations

import base64
import os
import re
import socket
import ssl
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import h2.config
import h2.connection

import helpers
from h2_helpers import H2Client, RawH2

GOOD_PREFIX = "/echo/good-"


fp = helpers.fp


# ---------------------------------------------------------------------------------------------
# observations and cases


@dataclass
class Obs:
    """What the attacker saw."""
    status: int | None = None          # HTTP status of the refusal (None: no HTTP response)
    reason: str | None = None          # X-Egress-Reason
    closed: bool | None = None         # the connection was closed after the response
    headers: list = field(default_factory=list)
    body: bytes = b""
    tls_failed: bool = False           # the TLS handshake was refused
    h2_reset: int | None = None        # RST_STREAM error code of the attacked stream
    h2_goaway: int | None = None
    problems: list[str] = field(default_factory=list)  # checks made during the attack
    notes: dict = field(default_factory=dict)

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.lower() == name.lower():
                return v
        return None


@dataclass
class Case:
    id: str
    attack: Callable[["Ctx"], Obs]
    status: int | None                 # expected refusal status (None: TLS-level or no HTTP)
    reason: str | None                 # expected X-Egress-Reason (and audit reason)
    decision: str = "deny"             # the audit decision expected
    audit_reason: str | None = None    # when the audit reason differs from the header
    audit_status: int | None = None    # when the audit status differs from `status`
    count: int = 1                     # audit records (and denied_total increments) expected
    denied: int | None = None          # denied_total increment (default: count if deny, else 0)
    closed: bool | None = None         # True: the connection must be closed after the refusal
    upstream: Callable | None = None   # None: the upstreams see nothing; else (ctx, new) -> err
    prepare: Callable | None = None    # before the snapshot
    minted: int | None = None          # expected egressd_certs_minted_total increment
    retry_after: bool = False          # a Retry-After header is required
    h2_reset: int | None = None        # expected RST_STREAM code instead of a status
    tls_failed: bool = False           # expected: the TLS handshake is refused
    audit: bool = True                 # False: no audit record exists by design (admin API)
    timeout: float = 3.0               # how long to wait for the audit record / metric

    def __repr__(self):
        return self.id


# ---------------------------------------------------------------------------------------------
# raw-socket helpers


def recv_closed(sock, timeout: float) -> tuple[bool, bytes]:
    """Waits up to `timeout` for the peer to close; returns (closed, bytes received meanwhile)."""
    got = b""
    deadline = time.monotonic() + timeout
    for _ in range(10000):
        left = deadline - time.monotonic()
        if left <= 0:
            return False, got
        try:
            sock.settimeout(left)
            b = sock.recv(65536)
        except (socket.timeout, TimeoutError):
            return False, got
        except ssl.SSLZeroReturnError:
            return True, got
        except (ssl.SSLError, ConnectionResetError, BrokenPipeError, OSError):
            return True, got
        if not b:
            return True, got
        got += b
    return False, got


def exchange(c: helpers.Conn, data: bytes, check_closed: bool, timeout: float = 5.0,
             head_request: bool = False) -> Obs:
    """Sends raw bytes, reads one response; with check_closed, waits for the close."""
    obs = Obs()
    try:
        c.sock.settimeout(timeout)
        c.send(data)
    except OSError as ex:
        obs.notes["send_error"] = repr(ex)
    try:
        r = helpers.read_response(c, head_request=head_request)
        obs.status, obs.reason, obs.headers, obs.body = r.status, r.egress_reason, r.headers, r.body
    except (ConnectionError, ValueError, OSError, ssl.SSLError) as ex:
        obs.notes["read_error"] = repr(ex)
        obs.closed = True
        return obs
    if check_closed:
        closed, extra = recv_closed(c.sock, timeout)
        extra = c.buf + extra
        obs.closed = closed and not extra
        if extra:
            obs.notes["after_refusal"] = extra[:200]
    return obs


def proxy_raw(port: int, data: bytes, check_closed: bool, timeout: float = 5.0) -> Obs:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    c = helpers.Conn(s)
    try:
        return exchange(c, data, check_closed, timeout)
    finally:
        c.close()


# ---------------------------------------------------------------------------------------------
# well-behaved clients


class GoodClients:
    """HTTP/1.1 (requests, keep-alive) and HTTP/2 (httpx) clients of another run, each doing a
    request every ~20 ms to a pinned host; every response must be 200 and every request must
    reach the upstream with exactly that run's credential."""

    def __init__(self, e: helpers.Egressd, run: str, token: str, ca: str, h1_url: str,
                 h2_url: str):
        self.e, self.run, self.token, self.ca = e, run, token, ca
        self.h1_url, self.h2_url = h1_url, h2_url
        self.lock = threading.Lock()
        self.ok = {"h1": 0, "h2": 0}
        self.errors: list[tuple[float, str, str]] = []
        self.paths: list[tuple[str, str]] = []   # (proto, path) of every 200
        self.stop_ev = threading.Event()
        self.threads = [threading.Thread(target=self._loop, args=(p,), daemon=True)
                        for p in ("h1", "h2")]
        self.tag = os.urandom(3).hex()

    def start(self):
        for t in self.threads:
            t.start()
        helpers.poll(lambda: (self.ok["h1"] > 0 and self.ok["h2"] > 0) or self.errors, 20,
                     "the first good requests")
        assert not self.errors, f"good clients failed from the start: {self.errors[:3]}"

    def stop(self):
        self.stop_ev.set()
        for t in self.threads:
            t.join(timeout=15)

    def _record(self, proto, path, status, err=None):
        with self.lock:
            if err is None and status == 200:
                self.ok[proto] += 1
                self.paths.append((proto, path))
            else:
                self.errors.append((time.monotonic(), proto, err or f"status {status}"))

    def _loop(self, proto):
        proxy = self.e.proxy_url(self.run, self.token)
        if proto == "h1":
            import requests
            client = requests.Session()
            client.trust_env = False
            client.proxies = {"https": proxy, "http": proxy}
            client.verify = self.ca
            base = self.h1_url
        else:
            import httpx
            client = httpx.Client(http2=True, proxies=proxy, verify=self.ca, timeout=10)
            base = self.h2_url
        try:
            for i in range(1_000_000):
                if self.stop_ev.is_set():
                    break
                path = f"{GOOD_PREFIX}{proto}-{self.tag}-{i}"
                try:
                    r = client.get(base + path, timeout=10)
                    status = r.status_code
                    if proto == "h2" and r.http_version != "HTTP/2":
                        self._record(proto, path, 0, f"not h2: {r.http_version}")
                        continue
                    self._record(proto, path, status)
                except Exception as ex:  # noqa: BLE001
                    self._record(proto, path, 0, repr(ex)[:300])
                self.stop_ev.wait(0.02)
        finally:
            client.close()

    def counts(self) -> tuple[int, int, int, int]:
        with self.lock:
            return self.ok["h1"], self.ok["h2"], len(self.errors), len(self.paths)


# ---------------------------------------------------------------------------------------------
# the arena


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^(\S+)\s+(\S+)$", line)
        if m:
            try:
                out[m.group(1)] = float(m.group(2))
            except ValueError:
                pass
    return out


@dataclass
class Snap:
    audit_off: int
    denied: dict[str, float]
    minted: float
    upstream: dict[str, int]
    good: tuple[int, int, int, int]
    t: float


class Arena:
    """One running egressd with its upstreams, DNS server and good clients."""

    def __init__(self, e: helpers.Egressd, world, h2up, dns, secrets_r1: dict[str, str],
                 good_secret: str):
        self.e, self.w, self.h2up, self.dns = e, world, h2up, dns
        self.secrets_r1 = secrets_r1       # name -> value, never allowed in an attack's request
        self.good_secret = good_secret
        self.good: GoodClients | None = None
        self.upstreams = {"h1": world.upstream, "plain": world.plain, "bad": world.bad,
                          "h2": h2up}
        self.extra_secrets: dict[str, str] = {}

    # -- observation ------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        r = self.e.admin_get("/metrics", timeout=5)
        assert r is not None and r[0] == 200, f"GET /metrics failed: {r!r}"
        return parse_metrics(r[1].decode(errors="replace"))

    @staticmethod
    def denied_of(m: dict[str, float]) -> dict[str, float]:
        out = {}
        for k, v in m.items():
            mm = re.match(r'^egressd_denied_total\{reason="(.*)"\}$', k)
            if mm:
                out[mm.group(1)] = v
        return out

    def audit_size(self) -> int:
        """The end of the last complete line: a batch of records being appended right now may
        be in the file in part, and a later read from the middle of a line would not parse."""
        try:
            with open(self.e.audit_path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return 0
        return data.rfind(b"\n") + 1

    def audit_since(self, off: int) -> list[dict]:
        try:
            with open(self.e.audit_path, "rb") as f:
                f.seek(off)
                data = f.read()
        except FileNotFoundError:
            return []
        return helpers.audit_lines(data)

    def snapshot(self) -> Snap:
        m = self.metrics()
        return Snap(self.audit_size(), self.denied_of(m), m.get("egressd_certs_minted_total", 0),
                    {k: len(u.requests) for k, u in self.upstreams.items()},
                    self.good.counts() if self.good else (0, 0, 0, 0), time.monotonic())

    def new_requests(self, snap: Snap) -> list[tuple[str, object]]:
        out = []
        for k, u in self.upstreams.items():
            for r in u.requests[snap.upstream[k]:]:
                if not r.path.startswith(GOOD_PREFIX):
                    out.append((k, r))
        return out

    # -- the five assertions ----------------------------------------------------------------
    def verify(self, case: Case, obs: Obs, snap: Snap, ctx: "Ctx"):
        problems = [f"during the attack: {p}" for p in obs.problems]

        # (a) the refusal
        if case.tls_failed:
            if not obs.tls_failed:
                problems.append(f"(a) TLS handshake was not refused (status {obs.status}, "
                                f"notes {obs.notes})")
        elif case.h2_reset is not None:
            if obs.h2_reset != case.h2_reset:
                problems.append(f"(a) stream: want RST_STREAM({case.h2_reset}), got status "
                                f"{obs.status} reason {obs.reason!r} reset {obs.h2_reset} "
                                f"goaway {obs.h2_goaway}")
        else:
            if (obs.status, obs.reason) != (case.status, case.reason):
                problems.append(f"(a) want {case.status} {case.reason!r}, got {obs.status} "
                                f"{obs.reason!r} (reset={obs.h2_reset}, notes={obs.notes})")
            if case.retry_after and not obs.header("Retry-After"):
                problems.append("(a) no Retry-After header")
        if case.closed and obs.closed is not True:
            problems.append(f"(a) connection not closed after the refusal "
                            f"(closed={obs.closed}, notes={obs.notes})")

        # (e) the good clients are served; this wait also lets late writes land
        if self.good is not None:
            h1_0, h2_0, err0, _ = snap.good
            try:
                helpers.poll(lambda: self.good.counts()[0] >= h1_0 + 2 and
                             self.good.counts()[1] >= h2_0 + 2, 15, "good clients progress")
            except AssertionError:
                problems.append(f"(e) good clients made no progress: before {snap.good}, "
                                f"now {self.good.counts()}")
            with self.good.lock:
                errs = self.good.errors[err0:]
                paths = self.good.paths[snap.good[3]:]
            if errs:
                problems.append(f"(e) good clients failed during the attack: {errs[:3]}")
            problems += self.check_good_injection(paths)

        # (c) audit and (d) metrics
        reason = case.audit_reason or case.reason
        status = case.audit_status if case.audit_status is not None else case.status
        denied_want = case.denied if case.denied is not None else \
            (case.count if case.decision == "deny" else 0)

        def mine(a):
            return a.get("decision") == case.decision and a.get("reason") == reason and \
                not (a.get("path") or "").startswith(GOOD_PREFIX)

        def settled():
            recs = [a for a in self.audit_since(snap.audit_off) if mine(a)]
            d = self.denied_of(self.metrics()).get(reason, 0) - snap.denied.get(reason, 0)
            ok = (not case.audit or len(recs) >= case.count) and d >= denied_want
            return (recs, d) if ok else None
        try:
            helpers.poll(settled, case.timeout, "audit record and metric", interval=0.05)
        except AssertionError:
            pass
        recs = [a for a in self.audit_since(snap.audit_off) if mine(a)]
        m = self.metrics()
        d = self.denied_of(m).get(reason, 0) - snap.denied.get(reason, 0)
        if case.audit:
            if len(recs) != case.count:
                others = [(a.get("decision"), a.get("reason"), a.get("status"), a.get("path"))
                          for a in self.audit_since(snap.audit_off)
                          if not (a.get("path") or "").startswith(GOOD_PREFIX)][:6]
                problems.append(f"(c) want {case.count} audit record(s) decision="
                                f"{case.decision} reason={reason!r}, found {len(recs)}; other "
                                f"new records: {others}")
            elif status is not None:
                bad = [a.get("status") for a in recs if a.get("status") != status]
                if bad:
                    problems.append(f"(c) audit status {bad[:3]}, want {status}")
        if d != denied_want:
            problems.append(f"(d) egressd_denied_total{{reason={reason!r}}} grew by {d:g}, "
                            f"want {denied_want}")
        if case.minted is not None:
            dm = m.get("egressd_certs_minted_total", 0) - snap.minted
            if dm != case.minted:
                problems.append(f"(d) egressd_certs_minted_total grew by {dm:g}, "
                                f"want {case.minted}")

        # (b) nothing injected
        new = self.new_requests(snap)
        if case.upstream is None:
            if new:
                problems.append(f"(b) the upstream saw {len(new)} request(s) from the attack: "
                                f"{[(k, r.method, r.path[:80]) for k, r in new][:4]}")
        else:
            err = case.upstream(ctx, new)
            if err:
                problems.append(f"(b) {err}")
        secrets = dict(self.secrets_r1, **self.extra_secrets)
        allowed = getattr(ctx, "allowed_secret_paths", set())
        for k, r in new:
            if any(name.lower() == "x-injected" for name, _ in r.headers):
                problems.append(f"(b) a smuggled header reached the upstream: {r.path[:80]}")
            if r.path in allowed:
                continue
            for name, value in secrets.items():
                if any(value in v for _, v in r.headers) or value in r.path:
                    problems.append(f"(b) secret {name} ({fp(value)}) reached the upstream in "
                                    f"{r.method} {r.path[:80]}")

        if not self.e.alive():
            problems.append("egressd died")
        if problems:
            raise AssertionError(f"case {case.id}:\n  - " + "\n  - ".join(problems))

    def check_good_injection(self, paths) -> list[str]:
        if not paths:
            return []
        want = f"Bearer {self.good_secret}"
        seen = {}
        for key in ("h1", "h2"):
            for r in self.upstreams[key].requests:
                if r.path.startswith(GOOD_PREFIX):
                    seen[r.path] = r
        bad = []
        for proto, p in paths:
            r = seen.get(p)
            if r is None:
                bad.append(f"{p}: not seen upstream")
                continue
            vals = r.header("Authorization")
            if vals != [want]:
                bad.append(f"{p}: Authorization {[fp(v) for v in vals]} (want {fp(want)})")
        return [f"(e) good client request not injected correctly: {bad[:3]}"] if bad else []


# ---------------------------------------------------------------------------------------------
# the attacker's toolbox, per case


class Ctx:
    """What an attack function gets: the arena, a unique marker, and raw-socket helpers."""

    def __init__(self, arena: Arena, case: Case, marker: str):
        self.a = arena
        self.e = arena.e
        self.w = arena.w
        self.case = case
        self.m = marker
        self.allowed_secret_paths: set[str] = set()
        self.state: dict = {}

    # ports and identities
    @property
    def U(self) -> int:
        return self.w.U

    @property
    def P(self) -> int:
        return self.w.plain.port

    @property
    def H2(self) -> int:
        return self.a.h2up.port

    def auth(self, run: str = "r1") -> str:
        return self.w.auth(run) if run in self.w.tokens else self.state["auth:" + run]

    def ca(self, run: str = "r1") -> str:
        return next(r["ca_cert_out"] for r in self.e.config["runs"] if r["id"] == run)

    # CONNECT and tunnels
    def connect(self, target: str, run: str | None = "r1", auth: str | None = None,
                extra: str = "") -> tuple[helpers.Conn, helpers.Response]:
        return helpers.proxy_connect(self.e.proxy_port, target,
                                     auth if auth is not None else
                                     (self.auth(run) if run else None), extra=extra, timeout=10)

    def connect_obs(self, target: str, run: str | None = "r1", auth: str | None = None,
                    extra: str = "") -> Obs:
        """CONNECT that must be refused: the refusal as an Obs (closed checked if the case
        wants it)."""
        try:
            c, r = self.connect(target, run, auth, extra)
        except (ConnectionError, ValueError, OSError) as ex:
            return Obs(notes={"connect_error": repr(ex)}, closed=True)
        obs = Obs(status=r.status, reason=r.egress_reason, headers=r.headers, body=r.body)
        if r.status == 200:
            obs.notes["tunnel"] = "CONNECT was accepted"
        if self.case.closed:
            closed, extra_b = recv_closed(c.sock, 5)
            obs.closed = closed and not c.buf and not extra_b
        c.close()
        return obs

    def tls(self, host: str, port: int, run: str = "r1", sni: str | None = None,
            check_hostname: bool = True, cafile: str | None = None,
            alpn=("http/1.1",)) -> helpers.Conn:
        c, r = self.connect(f"{host}:{port}", run)
        assert r.status == 200, f"CONNECT {host}:{port} -> {r.status} {r.egress_reason}"
        ctx = ssl.create_default_context(cafile=cafile or self.ca(run))
        ctx.check_hostname = check_hostname
        ctx.set_alpn_protocols(list(alpn))
        s = ctx.wrap_socket(c.sock, server_hostname=sni or host)
        s.settimeout(10)
        return helpers.Conn(s)

    def in_tunnel(self, host: str, port: int, data: bytes | str, run: str = "r1",
                  sni: str | None = None, check_hostname: bool = True,
                  head_request: bool = False) -> Obs:
        if isinstance(data, str):
            data = data.encode("latin-1")
        t = self.tls(host, port, run, sni=sni, check_hostname=check_hostname)
        try:
            return exchange(t, data, bool(self.case.closed), head_request=head_request)
        finally:
            t.close()

    def proxy_raw(self, data: bytes | str) -> Obs:
        if isinstance(data, str):
            data = data.encode("latin-1")
        return proxy_raw(self.e.proxy_port, data, bool(self.case.closed))

    def smuggled(self, host: str) -> str:
        """A well-formed request pipelined behind a malformed one: it must never be answered."""
        return f"GET /echo/{self.m}-smuggled HTTP/1.1\r\nHost: {host}\r\n\r\n"

    # HTTP/2
    def h2(self, host: str, port: int, run: str = "r1", sni: str | None = None,
           check_hostname: bool = True) -> RawH2:
        c, r = self.connect(f"{host}:{port}", run)
        assert r.status == 200, f"CONNECT {host}:{port} -> {r.status} {r.egress_reason}"
        ctx = ssl.create_default_context(cafile=self.ca(run))
        ctx.check_hostname = check_hostname
        ctx.set_alpn_protocols(["h2"])
        s = ctx.wrap_socket(c.sock, server_hostname=sni or host)
        s.settimeout(10)
        assert s.selected_alpn_protocol() == "h2", s.selected_alpn_protocol()
        cl = H2Client.__new__(H2Client)
        cl.sock = s
        cl.conn = h2.connection.H2Connection(config=h2.config.H2Configuration(
            client_side=True, header_encoding="utf-8", validate_outbound_headers=False,
            normalize_outbound_headers=False, validate_inbound_headers=False))
        cl.conn.initiate_connection()
        cl.flush()
        cl.authority = f"{host}:{port}"
        cl.responses = {}
        cl.goaway = None
        cl.closed = False
        cl.hold = set()
        return RawH2(cl)

    def h2_request(self, raw: RawH2, hdrs: list[tuple[str, str]], body: bytes | None = None,
                   timeout: float = 5.0) -> tuple[int, Obs]:
        """One raw stream; returns (stream id, its outcome)."""
        from hyperframe.frame import ContinuationFrame, DataFrame, HeadersFrame
        block = raw.enc.encode(hdrs)  # encoded once: the encoder's table must match the peer's
        sid = raw.next_sid
        raw.next_sid += 2
        raw.streams[sid] = {"status": None, "reset": None, "ended": False, "headers": []}
        pieces = [block[i:i + 16384] for i in range(0, len(block), 16384)] or [b""]
        flags = ["END_STREAM"] if body is None else []
        if len(pieces) == 1:
            flags.append("END_HEADERS")
        out = HeadersFrame(sid, data=pieces[0], flags=flags).serialize()
        for i, p in enumerate(pieces[1:], 1):  # a block over the frame size: CONTINUATIONs
            out += ContinuationFrame(sid, data=p, flags=["END_HEADERS"] if i == len(pieces) - 1
                                     else []).serialize()
        raw.send(out)
        if body is not None:
            raw.send(DataFrame(sid, data=body, flags=["END_STREAM"]).serialize())
        st = raw.streams[sid]
        raw.pump(until=lambda: st["ended"] or st["reset"] is not None or raw.goaway is not None,
                 timeout=timeout)
        obs = Obs(status=st["status"], headers=list(st["headers"]), h2_reset=st["reset"],
                  h2_goaway=raw.goaway)
        obs.reason = obs.header("x-egress-reason")
        return sid, obs

    def h2_base(self, path: str, authority: str | None = None, method: str = "GET"):
        return [(":method", method), (":scheme", "https"),
                (":authority", authority or f"api.test:{self.H2}"), (":path", path)]

    # audit/upstream helpers for cases whose right outcome is "served, sanitised"
    def expect_upstream(self, new, want: list[tuple[str, str, dict]]) -> str | None:
        """`want`: (upstream key, path, {header: [values]}) for exactly the new requests."""
        got = sorted((k, r.path) for k, r in new)
        exp = sorted((k, p) for k, p, _ in want)
        if got != exp:
            return f"upstream requests {got[:6]}, want {exp}"
        byp = {(k, r.path): r for k, r in new}
        for k, p, hdrs in want:
            r = byp[(k, p)]
            for name, vals in hdrs.items():
                have = r.header(name)
                if have != vals:
                    return (f"{p}: header {name} = {[fp(v) for v in have]}, want "
                            f"{[fp(v) for v in vals]}")
        return None


def openssl_s_client(proxy_port: int, target: str, auth_user: str, auth_pass: str,
                     args: list[str]) -> subprocess.Popen:
    """openssl s_client through egressd's CONNECT (-proxy); stdin is a pipe (command letters
    such as 'R' work: no -ign_eof)."""
    cmd = ["openssl", "s_client", "-proxy", f"127.0.0.1:{proxy_port}", "-proxy_user", auth_user,
           "-proxy_pass", f"pass:{auth_pass}", "-connect", target, *args]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=helpers.clean_env())


def b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()
