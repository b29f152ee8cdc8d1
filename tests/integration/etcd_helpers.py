"""A throwaway single-member etcd for the fleet tests (Debian's etcd-server: /usr/bin/etcd 3.4).

It listens on 127.0.0.1 only (client and peer ports picked free), keeps its data in a temp
folder, and can be stopped and started again on the same ports and data (an outage). Tests
read it through its JSON gateway (POST /v3/kv/range; keys and values are base64).
"""
from __future__ import annotations

import base64
import dataclasses
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import urllib.request

import pytest

import helpers
from upstream import free_port

DEADLINE_READY_S = 15.0


def etcd_bin() -> str | None:
    """The etcd binary ($EGRESS_ETCD_BIN, then PATH, then /usr/bin/etcd), or None."""
    b = os.environ.get("EGRESS_ETCD_BIN") or shutil.which("etcd") or "/usr/bin/etcd"
    return b if os.access(b, os.X_OK) else None


def require_etcd_bin() -> str:
    """The etcd binary; without one the fleet tests are skipped, except in CI (CI=true), where
    .ci/run installs etcd-server and a missing binary is a failure, not a silent skip."""
    b = etcd_bin()
    if b is None:
        why = "etcd not installed (apt-get install etcd-server): the fleet tests need it"
        if os.environ.get("CI") == "true":
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    return b


def b64(data: bytes | str) -> str:
    if isinstance(data, str):
        data = data.encode()
    return base64.b64encode(data).decode()


def prefix_end(prefix: bytes) -> bytes:
    """etcd's range_end for "every key starting with prefix": the prefix with its last byte
    incremented (trailing 0xff bytes dropped)."""
    p = bytearray(prefix)
    while p:
        if p[-1] < 0xFF:
            p[-1] += 1
            return bytes(p)
        p.pop()
    return b"\0"  # every key


def _strip_zero_tail(data: bytes, block: int = 1 << 20) -> bytes:
    """data without its zero-filled tail (etcd preallocates 64 MB WAL files), found a block at
    a time (comparing whole blocks is far faster than bytes.rstrip)."""
    zeros = bytes(block)
    end = len(data)
    while end >= block and data[end - block:end] == zeros:
        end -= block
    return data[:end].rstrip(b"\0")


@dataclasses.dataclass
class EtcdTls:
    """An etcd serving its client port over TLS with client certificates required
    (--client-cert-auth): cert/key its own (serverAuth and clientAuth: etcd 3.4's gateway dials
    its gRPC server with it; its only name is localhost, no IP), ca the CA both sides trust,
    client_cert/client_key what the tests' own reads present."""
    ca: str
    cert: str
    key: str
    client_cert: str
    client_key: str

    def args(self) -> list[str]:
        return ["--cert-file", self.cert, "--key-file", self.key,
                "--trusted-ca-file", self.ca, "--client-cert-auth"]

    def context(self) -> ssl.SSLContext:
        c = ssl.create_default_context(cafile=self.ca)
        c.load_cert_chain(self.client_cert, self.client_key)
        return c


class Etcd:
    def __init__(self, binary: str, workdir: str, extra_args: list[str] = (),
                 tls: EtcdTls | None = None):
        self.binary = binary
        self.tls = tls
        self.extra_args = list(extra_args) + (tls.args() if tls else [])
        self.workdir = workdir
        self.data_dir = os.path.join(workdir, "data")
        self.log_path = os.path.join(workdir, "etcd.log")
        self.client_port = free_port()
        self.peer_port = free_port()
        while self.peer_port == self.client_port:
            self.peer_port = free_port()
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        """http://127.0.0.1:PORT; with TLS https://localhost:PORT (the name its certificate
        holds; it listens on 127.0.0.1 either way)."""
        if self.tls:
            return f"https://localhost:{self.client_port}"
        return f"http://127.0.0.1:{self.client_port}"

    def _open(self, req, timeout: float):
        return urllib.request.urlopen(req, timeout=timeout,
                                      context=self.tls.context() if self.tls else None)

    def command(self) -> list[str]:
        p = self.peer_port
        return [self.binary, "--name", "t", "--data-dir", self.data_dir,
                "--listen-client-urls",
                f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}",
                "--advertise-client-urls", self.url,
                "--listen-peer-urls", f"http://127.0.0.1:{p}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{p}",
                "--initial-cluster", f"t=http://127.0.0.1:{p}",
                "--initial-cluster-state", "new",
                "--logger", "zap", "--log-outputs", "stderr", "--log-level", "error",
                *self.extra_args]

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> "Etcd":
        """Starts etcd (again: same ports, same data) and waits for /health."""
        assert not self.running(), "etcd is already running"
        os.makedirs(self.workdir, exist_ok=True)
        self._log = open(self.log_path, "ab")
        env = {k: v for k, v in helpers.clean_env().items() if not k.startswith("ETCD")}
        self.proc = subprocess.Popen(self.command(), cwd=self.workdir, stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=self._log, env=env,
                                     preexec_fn=helpers._die_with_parent)
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self, timeout: float = DEADLINE_READY_S):
        def healthy():
            if self.proc.poll() is not None:
                raise AssertionError(f"etcd exited with {self.proc.returncode} before healthy; "
                                     f"log:\n{self.log_text()[-3000:]}")
            try:
                with self._open(self.url + "/health", 1) as r:
                    return r.status == 200 and json.loads(r.read()).get("health") == "true"
            except (OSError, ValueError):
                return False
        helpers.poll(healthy, timeout, "etcd /health", interval=0.05)

    def stop(self, timeout: float = 10.0):
        """SIGTERM (SIGKILL if it lingers) and wait: its ports are closed when this returns."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self._log is not None and not self._log.closed:
            self._log.close()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- its history replaced (an operator's restore or wipe) -------------------------------
    def _etcdctl(self, *args: str) -> None:
        b = shutil.which("etcdctl") or "/usr/bin/etcdctl"
        if not os.access(b, os.X_OK):
            pytest.skip("etcdctl not installed (apt-get install etcd-client)")
        env = {k: v for k, v in helpers.clean_env().items() if not k.startswith("ETCD")}
        env["ETCDCTL_API"] = "3"
        r = subprocess.run([b, *args], capture_output=True, env=env, timeout=60,
                           cwd=self.workdir)
        assert r.returncode == 0, f"etcdctl {args[:2]}: {r.stderr[-600:]!r}"

    def snapshot_save(self, path: str) -> None:
        """etcdctl snapshot save: a backup of the whole keyspace at its current revision."""
        self._etcdctl("--endpoints", self.url, "snapshot", "save", path)

    def restore(self, snapshot: str) -> None:
        """Stops etcd, replaces its data with `snapshot` (etcdctl snapshot restore, same name
        and peer URL: the revision goes back to the snapshot's) and starts it again."""
        self.stop()
        shutil.rmtree(self.data_dir)
        p = self.peer_port
        self._etcdctl("snapshot", "restore", snapshot, "--data-dir", self.data_dir,
                      "--name", "t", "--initial-cluster", f"t=http://127.0.0.1:{p}",
                      "--initial-advertise-peer-urls", f"http://127.0.0.1:{p}")
        self.start()

    def wipe(self) -> None:
        """Stops etcd, deletes its data and starts it again, empty, on the same ports."""
        self.stop()
        shutil.rmtree(self.data_dir)
        self.start()

    def log_text(self) -> str:
        return helpers.file_text(self.log_path)

    # -- reading the store ------------------------------------------------------------------
    def _post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with self._open(req, 5) as r:
            return json.loads(r.read())

    def range(self, prefix: str) -> list[dict]:
        """Every key under prefix: [{"key": str, "value": bytes, "lease": int}], decoded."""
        p = prefix.encode()
        j = self._post("/v3/kv/range", {"key": b64(p), "range_end": b64(prefix_end(p))})
        out = []
        for kv in j.get("kvs", []):
            out.append({"key": base64.b64decode(kv["key"]).decode(errors="replace"),
                        "value": base64.b64decode(kv.get("value", "")),
                        "lease": int(kv.get("lease", 0))})
        return out

    def max_mod_revision(self, prefix: str) -> int:
        """The revision of the newest write under prefix still held (0: none)."""
        p = prefix.encode()
        j = self._post("/v3/kv/range", {"key": b64(p), "range_end": b64(prefix_end(p)),
                                        "keys_only": True})
        return max((int(kv.get("mod_revision", 0)) for kv in j.get("kvs", [])), default=0)

    def lease_granted_ttl(self, lease: int) -> int:
        """The TTL (seconds) lease was granted with; -1 for a lease that is gone."""
        return int(self._post("/v3/lease/timetolive", {"ID": lease}).get("grantedTTL", -1))

    def leases(self) -> set[int]:
        """The IDs of every lease granted and not yet ended."""
        return {int(x["ID"]) for x in self._post("/v3/lease/leases", {}).get("leases", [])}

    def put(self, key: str, value: str) -> None:
        """Writes a key as it is (a hand edit, or a record another version wrote)."""
        self._post("/v3/kv/put", {"key": b64(key), "value": b64(value)})

    def keys(self, prefix: str) -> list[str]:
        return [kv["key"] for kv in self.range(prefix)]

    def dump(self, prefix: str) -> bytes:
        """Every key and value under prefix, decoded, one "key\\tvalue" record a line."""
        return b"\n".join(kv["key"].encode() + b"\t" + kv["value"] for kv in self.range(prefix))

    def on_disk(self) -> bytes:
        """Everything etcd keeps on disk (WAL, snapshots, bbolt) and its log, concatenated."""
        out = []
        for root, _dirs, names in os.walk(self.workdir):
            for n in names:
                try:
                    with open(os.path.join(root, n), "rb") as f:
                        out.append(_strip_zero_tail(f.read()))
                except OSError:
                    pass
        return b"".join(out)


class GatewayRelay:
    """An HTTP/1.1 relay on 127.0.0.1 in front of etcd's JSON gateway, one request per
    connection (as egressd makes them), that can hold back what a replica reads: with
    `pause_watch` set the watch stream's bytes wait (up to 30 s); with `hold_range` set the
    answer to a read of the whole prefix (a resync) is kept until `release` is set, and
    `held` tells that one is being kept. For races between a replica's watch and its reads."""

    def __init__(self, etcd_port: int):
        self.etcd_port = etcd_port
        self.delay_txn = 0.0  # seconds a transaction waits before it is sent on to etcd
        self.pause_watch = threading.Event()
        self.hold_range = threading.Event()
        self.held = threading.Event()
        self.release = threading.Event()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self):
        while not self.closed:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    @staticmethod
    def _read_request(c: socket.socket) -> tuple[str, bytes, bytes] | None:
        buf = b""
        while b"\r\n\r\n" not in buf:
            d = c.recv(65536)
            if not d:
                return None
            buf += d
        head, body = buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        length = 0
        for line in lines[1:]:
            k, _, v = line.partition(":")
            if k.strip().lower() == "content-length":
                length = int(v.strip())
        while len(body) < length:
            d = c.recv(65536)
            if not d:
                break
            body += d
        return lines[0].split(" ")[1], head + b"\r\n\r\n" + body, body

    def _serve(self, c: socket.socket):
        import time
        u = None
        try:
            c.settimeout(60)
            req = self._read_request(c)
            if req is None:
                return
            path, raw, body = req
            if path == "/v3/kv/txn" and self.delay_txn > 0:
                time.sleep(self.delay_txn)
            u = socket.create_connection(("127.0.0.1", self.etcd_port), timeout=60)
            u.sendall(raw)
            whole = False
            if path == "/v3/kv/range":
                j = json.loads(body or b"{}")
                whole = not (j.get("count_only") or j.get("keys_only") or j.get("limit"))
            if whole and self.hold_range.is_set():
                answer = b""
                u.settimeout(5)
                while True:  # etcd's gateway answers with Content-Length: read it whole
                    try:
                        d = u.recv(65536)
                    except socket.timeout:
                        break
                    if not d:
                        break
                    answer += d
                    head, _, rest = answer.partition(b"\r\n\r\n")
                    m = [ln for ln in head.split(b"\r\n")
                         if ln.lower().startswith(b"content-length:")]
                    if m and len(rest) >= int(m[0].split(b":")[1]):
                        break
                self.held.set()
                self.release.wait(60)
                c.sendall(answer)
                return
            while True:
                d = u.recv(65536)
                if not d:
                    return
                if path == "/v3/watch":
                    for _ in range(600):  # 30 s at most
                        if not self.pause_watch.is_set():
                            break
                        time.sleep(0.05)
                c.sendall(d)
        except OSError:
            pass
        finally:
            for s in (c, u):
                if s is not None:
                    try:
                        s.close()
                    except OSError:
                        pass

    def close(self):
        self.closed = True
        self.release.set()
        self.pause_watch.clear()
        self.sock.close()


class CuttableRelay:
    """A loopback TCP relay to `target_port` (etcd, for a partition). cut() closes every
    relayed connection and, until restore(), closes each new one as soon as it is accepted (a
    peer that is unreachable without being stalled). Threads are daemons; close() ends them."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.lsock = socket.socket()
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(64)
        self.port = self.lsock.getsockname()[1]
        self.mu = threading.Lock()
        self.down = False
        self.closed = False
        self.live: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self):
        while True:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return  # closed
            try:
                u = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
                u.settimeout(None)
            except OSError:
                c.close()
                continue
            with self.mu:
                if self.down or self.closed:
                    c.close()
                    u.close()
                    continue
                self.live += [c, u]
            threading.Thread(target=self._pipe, args=(c, u), daemon=True).start()
            threading.Thread(target=self._pipe, args=(u, c), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _close_live(self):
        for s in self.live:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self.live.clear()

    def cut(self):
        with self.mu:
            self.down = True
            self._close_live()

    def restore(self):
        with self.mu:
            self.down = False

    def close(self):
        with self.mu:
            self.closed = True
            self._close_live()
        self.lsock.close()
