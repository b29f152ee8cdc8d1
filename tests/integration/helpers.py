"""Helpers shared by the integration tests: the egressd process, raw proxy clients, curl."""
from __future__ import annotations

import base64
import json
import os
import select
import signal
import socket
import ssl
import subprocess
import time
from dataclasses import dataclass, field

import yaml

DEADLINE_READY_S = 10.0

# "address" or "thread" when egressd was built with EGRESS_SANITIZE (tests/CMakeLists.txt passes
# it on). A sanitizer multiplies memory (ASan's quarantine and shadow, TSan's shadow), so a
# bound on egressd's footprint says nothing there and is not checked; everything else is.
SANITIZER = os.environ.get("EGRESS_SANITIZE", "")


def poll(pred, timeout: float, what: str, interval: float = 0.02):
    """Calls pred() until it returns a truthy value or `timeout` seconds pass (then fails)."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        last = pred()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last={last!r})")
        time.sleep(interval)


def file_text(path: str) -> str:
    """A log file's text ("" when it cannot be read); bytes that are not UTF-8 replaced."""
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def clean_env(**extra) -> dict:
    """The environment for client subprocesses and egressd: no proxy or CA variables
    inherited, and no allocator tunables (egressd adds its own: proxy/malloc_tuning.h)."""
    env = {k: v for k, v in os.environ.items()
           if k.lower() not in ("http_proxy", "https_proxy", "all_proxy", "no_proxy",
                                "ssl_cert_file", "curl_ca_bundle", "requests_ca_bundle",
                                "glibc_tunables")}
    env.update(extra)
    return env


def pin_bearer(cfg: dict, host: str, port: int) -> None:
    """Pins host:port in run r1 with r1's first pin's secret (the api_token) as a bearer
    credential, and allows the port: a config mutator's part for a test's own upstream."""
    r1 = next(r for r in cfg["runs"] if r["id"] == "r1")
    r1["pins"].append({"host": f"{host}:{port}", "secret_file": r1["pins"][0]["secret_file"],
                       "inject": {"type": "bearer"}})
    cfg["policy"]["allowed_ports"].append(port)


def basic_auth(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


# ---------------------------------------------------------------------------------------------
# egressd process


def _die_with_parent():
    """In the child before exec: SIGTERM egressd if the test process dies (no orphans)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def audit_lines(data: bytes) -> list[dict]:
    """The records in audit bytes: every complete line must be one JSON object. A line still
    being written is left for the next read: a write that crosses a page boundary can be seen
    half done by a reader polling the file (as a log shipper tailing it would)."""
    out = []
    for line in data[:data.rfind(b"\n") + 1].split(b"\n"):
        if line.strip():
            out.append(json.loads(line))
    return out


class Egressd:
    def __init__(self, binary: str, workdir: str, config: dict, secrets: dict[str, str]):
        self.binary = binary
        self.workdir = workdir
        self.config = config
        self.secrets = secrets  # name -> value, for leak checks
        self.proc: subprocess.Popen | None = None
        self.config_path = os.path.join(workdir, "egressd.yaml")
        self.stdout_path = os.path.join(workdir, "egressd.stdout")
        self.stderr_path = os.path.join(workdir, "egressd.stderr")
        self.proxy_port = int(config["listen"]["proxy"].rsplit(":", 1)[1])
        self.admin_port = int(config["listen"]["admin"].rsplit(":", 1)[1])
        self.audit_path = config["audit"]["path"]
        self.extra_env: dict[str, str] = {}  # added to egressd's environment at start
        self.binary_prefix: list[str] = []  # e.g. ["taskset", "-c", "0"]

    # -- lifecycle --------------------------------------------------------------------------
    def write_config(self):
        os.makedirs(self.workdir, exist_ok=True)
        with open(self.config_path, "w") as f:
            yaml.safe_dump(self.config, f, sort_keys=False)

    def rewrite_config(self, mutate):
        """Applies `mutate` to the config file egressd reads on SIGHUP (as it is on disk)."""
        with open(self.config_path) as f:
            cfg = yaml.safe_load(f)
        mutate(cfg)
        with open(self.config_path, "w") as f:
            yaml.safe_dump(cfg, f, sort_keys=False)

    def sighup_caught(self) -> bool:
        """Whether egressd catches SIGHUP yet: it ignores it until its reload loop has started,
        which can be after /readyz first answers 200 (a SIGHUP sent then was lost)."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) & (1 << (signal.SIGHUP - 1)))
        return False

    def reload(self, expect: str = "reloaded"):
        """SIGHUP (once egressd catches it), then waits for one more `expect` line in the log."""
        poll(self.sighup_caught, 10, "egressd catching SIGHUP")
        before = self.stderr_text().count(expect)
        self.proc.send_signal(signal.SIGHUP)
        poll(lambda: self.stderr_text().count(expect) > before, 10, f"{expect!r} log line")

    def last_line(self, containing: str) -> str:
        """The last line of egressd's stderr holding `containing` ("" if none): a request's
        log line may land after the line a test waited for, so "the last line" is not it."""
        return next((ln for ln in reversed(self.stderr_text().splitlines()) if containing in ln),
                    "")

    def check(self) -> subprocess.CompletedProcess:
        self.write_config()
        return subprocess.run([self.binary, "--check", "--config", self.config_path],
                              cwd=self.workdir, capture_output=True, timeout=30, text=True)

    def start(self):
        self.write_config()
        self._out = open(self.stdout_path, "ab")
        self._err = open(self.stderr_path, "ab")
        self.proc = subprocess.Popen([*self.binary_prefix, self.binary, "--config", self.config_path],
                                     cwd=self.workdir,
                                     stdout=self._out, stderr=self._err, stdin=subprocess.DEVNULL,
                                     env=clean_env(**self.extra_env), preexec_fn=_die_with_parent)
        try:
            self.wait_ready()
        except BaseException:
            self.kill()
            raise
        return self

    def admin_get(self, path: str, timeout: float = 2.0):
        """(status, body) of GET http://admin/path, or None if the connection fails."""
        try:
            with socket.create_connection(("127.0.0.1", self.admin_port), timeout=timeout) as s:
                s.settimeout(timeout)
                s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{self.admin_port}\r\n"
                          "Connection: close\r\n\r\n".encode())
                resp = read_response(Conn(s))
                return resp.status, resp.body
        except (OSError, ValueError, ConnectionError):
            return None

    def wait_ready(self, timeout: float = DEADLINE_READY_S):
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"egressd exited with {self.proc.returncode} before ready; "
                                     f"stderr:\n{self.stderr_text()[-4000:]}")
            r = self.admin_get("/readyz", timeout=0.5)
            return r is not None and r[0] == 200
        poll(ready, timeout, "egressd /readyz", interval=0.05)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM and wait; returns the exit status (kills and fails if it does not exit)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"egressd did not exit within {timeout}s of SIGTERM")
        self._close_logs()
        return self.proc.returncode

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._close_logs()

    def _close_logs(self):
        for f in (getattr(self, "_out", None), getattr(self, "_err", None)):
            if f is not None and not f.closed:
                f.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- observation ------------------------------------------------------------------------
    def stderr_text(self) -> str:
        return file_text(self.stderr_path)

    def vm_hwm_kib(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
        raise AssertionError("no VmHWM in /proc/PID/status")

    def check_peak_rss(self, limit_kib: int) -> int:
        """Asserts that egressd's peak RSS is under `limit_kib` (not under a sanitizer: see
        SANITIZER) and returns it."""
        hwm = self.vm_hwm_kib()
        if not SANITIZER:
            assert hwm < limit_kib, f"egressd peak RSS {hwm} KiB >= {limit_kib} KiB"
        return hwm

    def audit_records(self) -> list[dict]:
        try:
            with open(self.audit_path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return []
        return audit_lines(data)

    def wait_audit(self, pred, count: int = 1, timeout: float = 5.0) -> list[dict]:
        """Polls the audit file until at least `count` records satisfy pred; returns them."""
        def got():
            if not os.path.exists(self.audit_path):
                return None
            recs = [r for r in self.audit_records() if pred(r)]
            return recs if len(recs) >= count else None
        return poll(got, timeout, f"{count} audit record(s)")

    def ca_paths(self) -> list[str]:
        return [r["ca_cert_out"] for r in self.config.get("runs", [])]

    def written_files(self) -> list[str]:
        """Everything egressd wrote: logs, audit, run CA files, and the whole var dir."""
        files = [self.stdout_path, self.stderr_path, self.audit_path, *self.ca_paths()]
        var = os.path.join(self.workdir, "var")
        for root, _dirs, names in os.walk(var):
            files.extend(os.path.join(root, n) for n in names)
        return [p for p in files if os.path.isfile(p)]

    def leaks(self, extra_needles: list[bytes] = ()) -> list[tuple[str, str]]:
        """(file, secret name) for every secret whose bytes appear in a file egressd wrote."""
        needles = {n: v.encode() for n, v in self.secrets.items()}
        for i, b in enumerate(extra_needles):
            needles[f"extra[{i}]"] = b
        found = []
        for p in self.written_files():
            with open(p, "rb") as f:
                data = f.read()
            for name, needle in needles.items():
                if needle and needle in data:
                    found.append((p, name))
        return found

    def proxy_url(self, run: str | None = None, token: str | None = None) -> str:
        if run is None:
            return f"http://127.0.0.1:{self.proxy_port}"
        return f"http://{run}:{token}@127.0.0.1:{self.proxy_port}"


# ---------------------------------------------------------------------------------------------
# Raw HTTP/1.1 over a socket (plain or TLS)


class Conn:
    """A socket with a read buffer, bounded reads and a deadline per operation."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = b""

    def send(self, data: bytes):
        self.sock.sendall(data)

    def _fill(self) -> bool:
        b = self.sock.recv(65536)
        if not b:
            return False
        self.buf += b
        return True

    def read_until(self, sep: bytes, limit: int = 1 << 20) -> bytes:
        for _ in range(100000):
            i = self.buf.find(sep)
            if i >= 0:
                out, self.buf = self.buf[:i + len(sep)], self.buf[i + len(sep):]
                return out
            if len(self.buf) > limit:
                raise ValueError("line too long")
            if not self._fill():
                raise ConnectionError(f"eof before {sep!r} (have {self.buf[:200]!r})")
        raise ValueError("too many reads")

    def read_exact(self, n: int) -> bytes:
        for _ in range(10_000_000):
            if len(self.buf) >= n:
                out, self.buf = self.buf[:n], self.buf[n:]
                return out
            if not self._fill():
                raise ConnectionError(f"eof with {len(self.buf)} of {n} bytes")
        raise ValueError("too many reads")

    def read_to_eof(self, limit: int = 64 << 20) -> bytes:
        for _ in range(10_000_000):
            try:
                if not self._fill():
                    break
            except (ssl.SSLError, ConnectionResetError):
                break
            if len(self.buf) > limit:
                raise ValueError("body too long")
        out, self.buf = self.buf, b""
        return out

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


@dataclass
class Response:
    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes = b""
    chunks: list[bytes] = field(default_factory=list)

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.lower() == name.lower():
                return v
        return None

    def header_all(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name.lower()]

    @property
    def egress_reason(self) -> str | None:
        return self.header("X-Egress-Reason")

    def raw_head(self) -> str:
        return "\n".join(f"{k}: {v}" for k, v in self.headers)


def send_unread_until_cut(port: int, request: bytes, limit: int, deadline_s: float = 15.0):
    """Sends `request` pipelined on one connection, up to `limit` times, and never reads the
    answers (a small receive buffer), so the peer's writes of its answers stall, then its
    reads. Returns the seconds from the last send the peer's side took (its reads had
    stopped: its write was stuck) to the peer cutting the connection (a reset, or its end seen
    without reading), or None if it was still open after `deadline_s`. Measured from the
    stall, not from the start: how long filling the buffers takes depends on the build's speed
    (a sanitizer's is several times slower)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.setblocking(False)
    p = select.poll()
    cut = select.POLLERR | select.POLLHUP | select.POLLRDHUP
    p.register(s, select.POLLOUT | cut)
    started = last_progress = time.monotonic()
    pending = b""
    sent = 0
    try:
        while time.monotonic() - started < deadline_s:
            if not pending and sent < limit:
                batch = min(64, limit - sent)
                pending, sent = request * batch, sent + batch
            elif not pending:
                p.modify(s, cut)  # all sent: wait for the cut alone
            events = p.poll(100)
            if any(ev & cut for _, ev in events):
                return time.monotonic() - last_progress
            if pending and any(ev & select.POLLOUT for _, ev in events):
                try:
                    n = s.send(pending)
                except BlockingIOError:
                    n = 0
                except OSError:  # reset, broken pipe
                    return time.monotonic() - last_progress
                if n > 0:
                    pending, last_progress = pending[n:], time.monotonic()
        return None
    finally:
        s.close()


def read_response(c: Conn, head_request: bool = False, connect: bool = False) -> Response:
    head = c.read_until(b"\r\n\r\n", limit=256 * 1024).decode("latin-1")
    lines = head.split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
        raise ValueError(f"bad status line {lines[0]!r}")
    status = int(parts[1])
    headers = []
    for ln in lines[1:]:
        if not ln:
            continue
        k, _, v = ln.partition(":")
        headers.append((k.strip(), v.strip()))
    r = Response(status, parts[2] if len(parts) > 2 else "", headers)
    if head_request or status in (204, 304) or 100 <= status < 200 or (connect and status == 200):
        return r
    te = (r.header("Transfer-Encoding") or "").lower()
    if "chunked" in te:
        body = []
        for _ in range(10_000_000):
            size = int(c.read_until(b"\r\n").split(b";")[0].strip(), 16)
            if size == 0:
                for _ in range(1000):
                    if c.read_until(b"\r\n") == b"\r\n":
                        break
                break
            chunk = c.read_exact(size)
            r.chunks.append(chunk)
            body.append(chunk)
            c.read_exact(2)
        r.body = b"".join(body)
    elif r.header("Content-Length") is not None:
        r.body = c.read_exact(int(r.header("Content-Length")))
    else:
        r.body = c.read_to_eof()
    return r


def proxy_connect(proxy_port: int, target: str, auth: str | None = None,
                  extra: str = "", timeout: float = 10.0, host_header: str | None = None):
    """Sends CONNECT target; returns (Conn, Response). The Conn stays open (tunnel on 200)."""
    s = socket.create_connection(("127.0.0.1", proxy_port), timeout=timeout)
    s.settimeout(timeout)
    c = Conn(s)
    req = f"CONNECT {target} HTTP/1.1\r\nHost: {host_header or target}\r\n"
    if auth:
        req += f"Proxy-Authorization: {auth}\r\n"
    req += extra + "\r\n"
    c.send(req.encode())
    return c, read_response(c, connect=True)


def tls_wrap(c: Conn, server_hostname: str, cafile: str | None, check_hostname: bool = True,
             timeout: float = 10.0) -> Conn:
    ctx = ssl.create_default_context(cafile=cafile) if cafile else ssl._create_unverified_context()
    if cafile:
        ctx.check_hostname = check_hostname
        if not check_hostname:
            ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.set_alpn_protocols(["http/1.1"])
    assert not c.buf, f"bytes after CONNECT response: {c.buf[:100]!r}"
    s = ctx.wrap_socket(c.sock, server_hostname=server_hostname)
    s.settimeout(timeout)
    return Conn(s)


def tunnel(proxy_port: int, host: str, port: int, auth: str | None, cafile: str,
           sni: str | None = None, check_hostname: bool = True) -> Conn:
    """CONNECT + TLS through egressd; fails the test unless the CONNECT got 200."""
    c, r = proxy_connect(proxy_port, f"{host}:{port}", auth)
    assert r.status == 200, f"CONNECT {host}:{port} -> {r.status} {r.egress_reason}: {r.body!r}"
    return tls_wrap(c, sni or host, cafile, check_hostname=check_hostname)


def request(c: Conn, method: str, target: str, host: str, headers: list[tuple[str, str]] = (),
            body: bytes | None = None) -> Response:
    req = f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n"
    for k, v in headers:
        req += f"{k}: {v}\r\n"
    if body is not None:
        req += f"Content-Length: {len(body)}\r\n"
    c.send(req.encode() + b"\r\n" + (body or b""))
    return read_response(c, head_request=(method == "HEAD"))


# ---------------------------------------------------------------------------------------------
# curl


def curl(args: list[str], env: dict | None = None, timeout: float = 60.0,
         check: bool = False) -> subprocess.CompletedProcess:
    cmd = ["curl", "-sS", "--http1.1", "--max-time", str(int(timeout)), *args]
    r = subprocess.run(cmd, env=env or clean_env(), capture_output=True, timeout=timeout + 10)
    if check and r.returncode != 0:
        raise AssertionError(f"{cmd} -> rc {r.returncode}: {r.stderr.decode(errors='replace')}")
    return r


def closed_by_peer(c: Conn) -> bool:
    """True once the peer has closed c (EOF or reset), without sending anything on it."""
    s = c.sock
    pending = s.pending() if isinstance(s, ssl.SSLSocket) else 0
    if not pending and not select.select([s], [], [], 0)[0]:
        return False
    old = s.gettimeout()
    try:
        s.settimeout(0.05)
        data = s.recv(1)
    except (ssl.SSLWantReadError, socket.timeout):  # a TLS record with no data (a ticket)
        return False
    except (OSError, ssl.SSLError):
        return True
    finally:
        try:
            s.settimeout(old)
        except OSError:
            pass
    assert not data, f"unexpected bytes on an idle connection: {data!r}"
    return True


# ---------------------------------------------------------------------------------------------
# secret values in test output


SECRET_VALUES: set[str] = set()


def secret(value: str) -> str:
    """Registers `value` as a secret of this test session and returns it: a failing test's
    report (assertion introspection, messages, captured output) is redacted of it by the
    conftest hook (redact_secrets)."""
    if value:
        SECRET_VALUES.add(value)
    return value


_GRAM = 10  # a run of this many characters of a secret is taken for a piece of it
_grams: tuple[int, frozenset[str]] = (-1, frozenset())


def _secret_grams() -> frozenset[str]:
    global _grams
    if _grams[0] != len(SECRET_VALUES):
        grams = {v[i:i + _GRAM] for v in SECRET_VALUES for i in range(len(v) - _GRAM + 1)}
        _grams = (len(SECRET_VALUES), frozenset(grams))
    return _grams[1]


def redact_secrets(text: str) -> str:
    """`text` with every registered secret replaced by its fingerprint, as it is and in the
    forms a report may show it in (percent-encoded, JSON-escaped, base64); then any run of
    10 or more characters of a secret left (pytest shortens a long repr to 'head...tail')
    by a mark."""
    import urllib.parse
    for v in sorted(SECRET_VALUES, key=len, reverse=True):
        mark = f"[secret {fp(v)}]"
        forms = {v, urllib.parse.quote(v, safe=""), json.dumps(v)[1:-1],
                 base64.b64encode(v.encode()).decode()}
        for form in sorted(forms, key=len, reverse=True):
            if form in text:
                text = text.replace(form, mark)
    grams = _secret_grams()
    covered = bytearray(len(text))
    for i in range(len(text) - _GRAM + 1):
        if text[i:i + _GRAM] in grams:
            covered[i:i + _GRAM] = b"\1" * _GRAM
    if not any(covered):
        return text
    out, i = [], 0
    while i < len(text):
        if covered[i]:
            while i < len(text) and covered[i]:
                i += 1
            out.append("[secret piece]")
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def fp(value: str | bytes) -> str:
    """A short fingerprint for messages (never the value itself)."""
    import hashlib
    if isinstance(value, str):
        value = value.encode()
    return "sha256:" + hashlib.sha256(value).hexdigest()[:12]


def expect(cond, msg: str):
    """assert without pytest's introspection (which would print the compared values)."""
    if not cond:
        raise AssertionError(msg)


def copies_in_memory(pid: int, value: str, want, timeout: float = 5.0) -> int:
    """How many copies of `value` the memory of process `pid` holds, once `want(count)` holds
    (or the deadline passes). The needle is the value's random tail: a freed heap block keeps
    all but its first 16 bytes, so the whole value would hide a copy left behind."""
    tail = value[-32:].encode()
    deadline = time.monotonic() + timeout
    while True:
        n = occurrences_in_memory(pid, tail)
        if want(n) or time.monotonic() > deadline:
            return n
        time.sleep(0.1)


def active_connections(e: "Egressd") -> int:
    """egressd_active_connections, read from /metrics."""
    import re
    r = e.admin_get("/metrics", timeout=5)
    assert r is not None and r[0] == 200, r
    m = re.search(rb"^egressd_active_connections (\d+)", r[1], re.M)
    assert m, r[1][:2000]
    return int(m.group(1))


def occurrences_in_memory(pid: int, needle: bytes) -> int:
    """How often `needle` occurs in the writable memory of process `pid` (heap, thread arenas,
    stacks, anonymous mappings), read through /proc/PID/mem (the test runs egressd as a child)."""
    found = 0
    chunk = 16 << 20
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for line in maps:
            span, perms = line.split()[:2]
            if not perms.startswith("rw"):
                continue
            start, end = (int(x, 16) for x in span.split("-"))
            if end - start > 1 << 36:
                continue  # a sanitizer's shadow reservation (terabytes, never egressd's data)
            # In pieces that overlap by len(needle) - 1: a copy across a boundary counts once.
            at = start
            try:
                while at < end:
                    mem.seek(at)
                    found += mem.read(min(chunk, end - at)).count(needle)
                    at += chunk - (len(needle) - 1)
            except (OSError, ValueError, OverflowError):
                continue  # a mapping that went away or cannot be read ([vvar] and the like)
    return found


def start_fails(e: Egressd, within: float = 15.0) -> str:
    """Starts e, expecting it to exit non-zero within `within` seconds; its stderr."""
    e.write_config()
    with open(e.stderr_path, "wb") as err:
        p = subprocess.Popen([e.binary, "--config", e.config_path], cwd=e.workdir,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                             env=clean_env(), preexec_fn=_die_with_parent)
        try:
            rc = p.wait(timeout=within)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)
            raise AssertionError(f"egressd still running {within:.0f} s after start; "
                                 f"stderr:\n{e.stderr_text()[-2000:]}")
    stderr = e.stderr_text()
    assert rc != 0, f"egressd exited 0; stderr:\n{stderr[-2000:]}"
    assert not e.leaks()
    return stderr
