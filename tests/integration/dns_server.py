"""A tiny scripted DNS server on 127.0.0.1 (UDP and TCP on one port) for the integration tests.

egressd is pointed at it with ``resolver.servers: ["127.0.0.1:PORT"]``. Every answer has TTL 0
(nothing may be cached), and every query is logged, so a test can tell how many lookups egressd
made for a name (one per connection attempt: no second lookup between vetting and connecting).

Scripts, per name (lowercase, no trailing dot):

* ``fixed(*addresses)``: always the same answer; IPv4 addresses answer A queries, IPv6
  addresses AAAA queries (a family with no address gets an empty NOERROR answer).
* ``rebinding(first, then)``: the first lookup (first A or AAAA query of a family) gets
  ``first``, every later one gets ``then`` (DNS rebinding: allowed, then denied).

A script set for ``*.parent`` answers every name one label below ``parent`` that has no script
of its own. Unknown names get NXDOMAIN. Only loopback is ever bound; nothing is forwarded anywhere.
"""
from __future__ import annotations

import ipaddress
import socket
import struct
import threading
from dataclasses import dataclass, field

import dnslib


def _split(addresses) -> tuple[list[str], list[str]]:
    v4, v6 = [], []
    for a in addresses:
        ip = ipaddress.ip_address(a)
        (v4 if ip.version == 4 else v6).append(str(ip))
    return v4, v6


@dataclass
class Script:
    """Answers for one name: `answer(qtype, n)` for the n-th (0-based) query of that type."""
    first: list[str]
    then: list[str] | None = None  # None: always `first`

    def answer(self, qtype: str, n: int) -> list[str]:
        addrs = self.first if (self.then is None or n == 0) else self.then
        v4, v6 = _split(addrs)
        return v4 if qtype == "A" else v6 if qtype == "AAAA" else []


def fixed(*addresses: str) -> Script:
    return Script(list(addresses))


def rebinding(first, then) -> Script:
    first = [first] if isinstance(first, str) else list(first)
    then = [then] if isinstance(then, str) else list(then)
    return Script(first, then)


@dataclass
class Query:
    name: str
    qtype: str
    answer: list[str]
    proto: str


@dataclass
class DnsServer:
    scripts: dict[str, Script] = field(default_factory=dict)
    log: list[Query] = field(default_factory=list)
    mute: bool = False  # True: every query is logged and never answered (a lookup that hangs)
    drop: set = field(default_factory=set)  # query types logged, never answered ({"AAAA"}: a
    #                                         firewall that drops them)

    def __post_init__(self):
        self.lock = threading.Lock()
        self.counts: dict[tuple[str, str], int] = {}
        self._stop = threading.Event()
        # One port for both transports: bind UDP first, then TCP on the same number.
        for _ in range(50):
            self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self.udp.bind(("127.0.0.1", 0))
            self.port = self.udp.getsockname()[1]
            self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                self.tcp.bind(("127.0.0.1", self.port))
                break
            except OSError:
                self.udp.close()
                self.tcp.close()
        else:
            raise RuntimeError("no free port for UDP+TCP DNS")
        self.tcp.listen(16)
        self.udp.settimeout(0.2)
        self.tcp.settimeout(0.2)
        self.threads = [threading.Thread(target=self._udp_loop, daemon=True),
                        threading.Thread(target=self._tcp_loop, daemon=True)]
        for t in self.threads:
            t.start()

    # -- scripting and observation ------------------------------------------------------------
    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set(self, name: str, script: Script):
        with self.lock:
            key = name.lower().rstrip(".")
            self.scripts[key] = script
            for qt in ("A", "AAAA"):
                self.counts.pop((key, qt), None)

    def queries(self, name: str, qtype: str | None = None) -> list[Query]:
        key = name.lower().rstrip(".")
        with self.lock:
            return [q for q in self.log if q.name == key and (qtype is None or q.qtype == qtype)]

    # -- protocol -----------------------------------------------------------------------------
    def _reply(self, data: bytes, proto: str) -> bytes | None:
        try:
            req = dnslib.DNSRecord.parse(data)
        except Exception:  # noqa: BLE001 (garbage: no answer)
            return None
        if self.mute or any(dnslib.QTYPE.get(q.qtype, "") in self.drop for q in req.questions):
            with self.lock:
                for q in req.questions:
                    name = str(q.qname).lower().rstrip(".")
                    self.log.append(Query(name, dnslib.QTYPE.get(q.qtype, str(q.qtype)), [], proto))
            return None
        reply = req.reply()
        reply.header.ra = 1
        for q in req.questions:
            name = str(q.qname).lower().rstrip(".")
            qtype = dnslib.QTYPE.get(q.qtype, str(q.qtype))
            with self.lock:
                script = self.scripts.get(name)
                if script is None and "." in name:  # "*.parent" scripts answer one extra label
                    script = self.scripts.get("*." + name.split(".", 1)[1])
                n = self.counts.get((name, qtype), 0)
                self.counts[(name, qtype)] = n + 1
                answer = script.answer(qtype, n) if script else []
                self.log.append(Query(name, qtype, answer, proto))
            if script is None:
                reply.header.rcode = dnslib.RCODE.NXDOMAIN
                continue
            for a in answer:
                rdata = dnslib.A(a) if qtype == "A" else dnslib.AAAA(a)
                reply.add_answer(dnslib.RR(q.qname, q.qtype, rdata=rdata, ttl=0))
        return reply.pack()

    def _udp_loop(self):
        while not self._stop.is_set():
            try:
                data, peer = self.udp.recvfrom(4096)
            except (socket.timeout, OSError):
                continue
            out = self._reply(data, "udp")
            if out is not None:
                try:
                    self.udp.sendto(out, peer)
                except OSError:
                    pass

    def _tcp_loop(self):
        while not self._stop.is_set():
            try:
                c, _ = self.tcp.accept()
            except (socket.timeout, OSError):
                continue
            threading.Thread(target=self._tcp_conn, args=(c,), daemon=True).start()

    def _tcp_conn(self, c: socket.socket):
        c.settimeout(5)
        buf = b""
        try:
            for _ in range(1000):  # bounded: at most 1000 queries per connection
                while len(buf) < 2:
                    b = c.recv(4096)
                    if not b:
                        return
                    buf += b
                (n,) = struct.unpack("!H", buf[:2])
                while len(buf) < 2 + n:
                    b = c.recv(4096)
                    if not b:
                        return
                    buf += b
                msg, buf = buf[2:2 + n], buf[2 + n:]
                out = self._reply(msg, "tcp")
                if out is not None:
                    c.sendall(struct.pack("!H", len(out)) + out)
        except OSError:
            pass
        finally:
            c.close()

    def close(self):
        self._stop.set()
        for t in self.threads:
            t.join(timeout=5)
        self.udp.close()
        self.tcp.close()
