"""Helpers for the control-plane integration tests: the admin API client, egressctl, dynamic
runs, and a smart-HTTP git server that requires a bearer token.

Secret values must never reach the test output: comparisons that involve them go through
`expect(cond, msg)` (not rewritten by pytest, so the values are not printed), and messages name
secrets by a short fingerprint only.
"""
from __future__ import annotations

import http.client
import http.server
import json
import os
import sys
import socket
import ssl
import subprocess
import threading
import urllib.parse
from dataclasses import dataclass

import pytest

import helpers
import upstream

# Every admin API body and egressctl output seen by the tests, to grep for secret values.
SEEN: list[tuple[str, bytes]] = []


fp = helpers.fp
expect = helpers.expect


def contains_any(data: bytes | str, values: dict[str, str]) -> list[str]:
    """Names of the secrets whose value (or its base64, or JSON-escaped form) occurs in data."""
    import base64
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogateescape")
    found = []
    for name, v in values.items():
        b = v.encode()
        forms = [b, base64.b64encode(b), json.dumps(v).encode()[1:-1]]
        if any(f and f in data for f in forms):
            found.append(name)
    return found


def egressctl_bin() -> str:
    d = os.environ.get("EGRESS_BUILD_DIR")
    cands = [os.path.join(d, "egressctl")] if d else []
    cands += [os.path.abspath(p) for p in ("../../build-ctl/egressctl", "../../build/egressctl")]
    for c in cands:
        if os.access(c, os.X_OK):
            return os.path.abspath(c)
    pytest.fail(f"egressctl not found (EGRESS_BUILD_DIR={d!r})", pytrace=False)


# ---------------------------------------------------------------------------------------------
# config


def cp_mutate(w, overrides: dict[str, list[str]] | None = None, ports: list[int] = (),
              extra=None):
    """Turns conftest.base_config into a control-plane config: no static runs (every run is
    dynamic), fake names resolved to 127.0.0.1, the given ports allowed."""
    def mutate(cfg: dict):
        cfg["runs"] = []
        # Real clients (git, curl, requests) on a loaded CI machine: a 3 s handshake budget
        # has been seen to run out (git's gnutls handshake closed under it).
        cfg["limits"]["tls_timeout"] = "10s"
        cfg["resolver"]["overrides"].update(overrides or {})
        cfg["policy"]["allowed_ports"] = sorted(set(cfg["policy"]["allowed_ports"]) | set(ports))
        if extra:
            extra(cfg)
    return mutate


KMS_STUB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kms_stub.py")


def kms_stub(w, name: str) -> tuple[str, str]:
    """A test KMS (kms_stub.py) with a fresh random key in a directory of its own: returns
    (KEYFILE, the keys.kms_command that uses it)."""
    kek = os.path.join(w.new_dir(name), "kek")
    with open(kek, "wb") as f:
        f.write(os.urandom(32))
    return kek, f"{sys.executable} {KMS_STUB} {kek}"


def admin_token(e: helpers.Egressd) -> str:
    with open(e.config["admin"]["token_file"]) as f:
        return helpers.secret(f.read().strip())


def state_dir(e: helpers.Egressd) -> str:
    return e.config["state"]["path"]


def master_key_file(e: helpers.Egressd) -> str:
    return e.config["keys"]["master_key_file"]


# ---------------------------------------------------------------------------------------------
# admin API

_DEFAULT = object()


@dataclass
class ApiReply:
    status: int
    body: bytes
    headers: dict

    @property
    def json(self):
        return json.loads(self.body) if self.body else None


def api(e: helpers.Egressd, method: str, path: str, body=None, *, token=_DEFAULT,
        host: str | None = None, raw: bytes | None = None, timeout: float = 10.0) -> ApiReply:
    """One admin API request (a fresh connection); every response body is kept in SEEN."""
    conn = http.client.HTTPConnection("127.0.0.1", e.admin_port, timeout=timeout)
    headers = {"Host": host or f"127.0.0.1:{e.admin_port}"}
    if token is _DEFAULT:
        token = admin_token(e)
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = raw
    if body is not None:
        data = json.dumps(body).encode()
    if data is not None:
        headers["Content-Type"] = "application/json"
    try:
        conn.request(method, path, body=data, headers=headers)
        r = conn.getresponse()
        out = ApiReply(r.status, r.read(), {k.lower(): v for k, v in r.getheaders()})
    finally:
        conn.close()
    SEEN.append((f"{method} {path}", out.body))
    return out


def api_ok(e, method, path, body=None, status=(200, 201, 204)) -> dict | None:
    r = api(e, method, path, body)
    expect(r.status in status, f"{method} {path} -> {r.status}: {r.body[:300]!r}")
    return r.json


def refused_or_closed(c: helpers.Conn, host: str, path: str):
    """The next request on an open connection: (status, reason), or (None, "closed")."""
    try:
        r = helpers.request(c, "GET", path, host)
        return r.status, r.egress_reason
    except (ConnectionError, ssl.SSLError, OSError, ValueError):
        return None, "closed"


def put_secret(e, name: str, value: str, **scope) -> dict:
    scope = scope or {"org": "acme"}
    r = api(e, "POST", "/v1/secrets", {"name": name, "scope": scope, "value": value})
    expect(r.status == 201, f"POST /v1/secrets {name} -> {r.status}: {r.body[:300]!r}")
    if hasattr(e, "secrets"):
        e.secrets[f"cp:{name}:{fp(value)}"] = value  # egressd must never write it in clear
    return r.json


def rotate_secret(e, name: str, value: str, **scope) -> dict:
    scope = scope or {"org": "acme"}
    r = api(e, "PUT", f"/v1/secrets/{name}", {"scope": scope, "value": value})
    expect(r.status == 200, f"PUT /v1/secrets/{name} -> {r.status}: {r.body[:300]!r}")
    e.secrets[f"cp:{name}:{fp(value)}"] = value
    return r.json


# ---------------------------------------------------------------------------------------------
# egressctl


def ctl(e: helpers.Egressd, *args: str, stdin: str | bytes | None = None, env: dict | None = None,
        token_file: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    cmd = [egressctl_bin(), "--admin", f"http://127.0.0.1:{e.admin_port}"]
    if token_file:
        cmd += ["--token-file", e.config["admin"]["token_file"]]
    cmd += list(args)
    if isinstance(stdin, str):
        stdin = stdin.encode()
    r = subprocess.run(cmd, input=stdin if stdin is not None else b"", capture_output=True,
                       timeout=timeout, env=env if env is not None else helpers.clean_env())
    SEEN.append(("egressctl " + " ".join(args[:3]), r.stdout + r.stderr))
    r.out = r.stdout.decode(errors="replace")
    r.err = r.stderr.decode(errors="replace")
    return r


def ctl_ok(e, *args, **kw) -> subprocess.CompletedProcess:
    r = ctl(e, *args, **kw)
    expect(r.returncode == 0, f"egressctl {' '.join(args[:4])} -> rc {r.returncode}: {r.err}")
    return r


# ---------------------------------------------------------------------------------------------
# dynamic runs


@dataclass
class DynRun:
    id: str
    token: str
    ca_file: str
    proxy_port: int
    reply: dict

    @property
    def auth(self) -> str:
        return helpers.basic_auth(self.id, self.token)

    def tunnel(self, host: str, port: int) -> helpers.Conn:
        return helpers.tunnel(self.proxy_port, host, port, self.auth, self.ca_file)


def parse_proxy_url(url: str) -> tuple[str, str, int]:
    u = urllib.parse.urlsplit(url)
    return u.username, u.password, u.port


def create_run(e, w, scope: dict, pins: list[dict], *, ttl: int | None = None,
               allow: list[str] = (), status: int = 201) -> DynRun:
    body = {"scope": scope, "pins": pins}
    if ttl is not None:
        body["ttl_seconds"] = ttl
    if allow:
        body["allow_hosts"] = list(allow)
    r = api(e, "POST", "/v1/runs", body)
    expect(r.status == status, f"POST /v1/runs -> {r.status}: {r.body[:400]!r}")
    j = r.json
    rid, tok, port = parse_proxy_url(j["proxy_url"])
    assert rid == j["id"] and port == e.proxy_port, j["id"]
    ca = os.path.join(e.workdir, f"{rid}-ca.pem")
    with open(ca, "w") as f:
        f.write(j["ca_pem"])
    return DynRun(rid, tok, ca, port, j)


def bearer_pin(host: str, secret: str, **kw) -> dict:
    d = {"host": host, "secret": secret, "inject": {"type": "bearer"}}
    d.update(kw)
    return d


def seen_auth(up: upstream.Upstream, marker: str) -> list[str]:
    """The Authorization values the upstream saw on requests whose path holds marker."""
    return [v for r in up.find(marker) for v in r.header("Authorization")]


def get_via(run: DynRun, host: str, port: int, path: str, conn: helpers.Conn | None = None):
    """GET path through the run (a new tunnel unless conn is given); returns (conn, response)."""
    c = conn or run.tunnel(host, port)
    return c, helpers.request(c, "GET", path, f"{host}:{port}")


# ---------------------------------------------------------------------------------------------
# smart-HTTP git server (git http-backend behind http.server + TLS) that requires a token


class _GitHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "itest-git/1"
    sys_version = ""

    def log_message(self, fmt, *args):
        pass

    def _body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            out = []
            for _ in range(1_000_000):
                size = int(self.rfile.readline(1024).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    for _ in range(1000):
                        if self.rfile.readline(65536) in (b"\r\n", b"\n", b""):
                            break
                    break
                out.append(self.rfile.read(size))
                self.rfile.readline(16)
            return b"".join(out)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _reply(self, status: int, headers: list[tuple[str, str]], body: bytes):
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _handle(self):
        srv: GitServer = self.server.owner
        body = self._body()
        ok = self.headers.get("Authorization") == f"Bearer {srv.token}"
        srv.record(self.command, self.path, ok)
        if not ok:
            self._reply(401, [("WWW-Authenticate", 'Bearer realm="itest-git"'),
                              ("Content-Type", "text/plain")], b"token required\n")
            return
        u = urllib.parse.urlsplit(self.path)
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "GIT_PROJECT_ROOT": srv.root,
            "GIT_HTTP_EXPORT_ALL": "1",
            "PATH_INFO": urllib.parse.unquote(u.path),
            "QUERY_STRING": u.query,
            "REQUEST_METHOD": self.command,
            "REMOTE_ADDR": "127.0.0.1",
            "REMOTE_USER": "itest",
            "CONTENT_TYPE": self.headers.get("Content-Type") or "",
            "CONTENT_LENGTH": str(len(body)),
        }
        if self.headers.get("Content-Encoding"):
            env["HTTP_CONTENT_ENCODING"] = self.headers["Content-Encoding"]
        if self.headers.get("Git-Protocol"):
            env["GIT_PROTOCOL"] = self.headers["Git-Protocol"]
        p = subprocess.run(["git", "http-backend"], input=body, env=env, capture_output=True,
                           timeout=60)
        out = p.stdout
        i4, i2 = out.find(b"\r\n\r\n"), out.find(b"\n\n")
        if p.returncode != 0 or (i4 < 0 and i2 < 0):
            self._reply(500, [("Content-Type", "text/plain")], b"http-backend failed\n")
            return
        if i4 >= 0 and (i2 < 0 or i4 < i2):
            head, rest = out[:i4].decode("latin-1"), out[i4 + 4:]
        else:
            head, rest = out[:i2].decode("latin-1"), out[i2 + 2:]
        head = head.replace("\r\n", "\n")
        status = 200
        headers = []
        for line in head.split("\n"):
            if not line.strip():
                continue
            k, _, v = line.partition(":")
            if k.lower() == "status":
                status = int(v.strip().split()[0])
            else:
                headers.append((k.strip(), v.strip()))
        self._reply(status, headers, rest)

    do_GET = do_POST = do_HEAD = _handle


class _GitTlsServer(upstream.TlsHttpServer):

    def __init__(self, owner, ctx):
        self.owner = owner
        self.ctx = ctx
        super().__init__(("127.0.0.1", 0), _GitHandler)


class GitServer:
    """HTTPS smart-HTTP git server on 127.0.0.1; every request needs `Bearer <token>`."""

    def __init__(self, root: str, cert: str, key: str, token: str):
        self.root = root
        self.token = token
        self.lock = threading.Lock()
        self.log: list[tuple[str, str, bool]] = []
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        ctx.set_alpn_protocols(["http/1.1"])
        self.server = _GitTlsServer(self, ctx)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever,
                                       kwargs={"poll_interval": 0.1}, daemon=True)
        self.thread.start()

    def record(self, method, path, ok):
        with self.lock:
            self.log.append((method, path, ok))

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def make_leaf(pki_dir: str, name: str, hosts: list[str]) -> tuple[str, str]:
    """A server certificate for `hosts`, signed by the integration test CA."""
    upstream.make_leaf(pki_dir, "testca", name, hosts)
    return os.path.join(pki_dir, f"{name}.pem"), os.path.join(pki_dir, f"{name}.key")


def make_bare_repo(root: str, name: str = "repo.git") -> str:
    """root/name: a bare repository with one commit holding README.md; returns the content."""
    content = "hello from the itest git server\n"
    work = os.path.join(root, "_work")
    bare = os.path.join(root, name)
    git = ["git", "-c", "user.name=itest", "-c", "user.email=itest@example.invalid",
           "-c", "init.defaultBranch=main"]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": root,
           "GIT_CONFIG_NOSYSTEM": "1"}
    for args in (["init", "-q", "--bare", bare], ["init", "-q", work]):
        subprocess.run(git + args, check=True, capture_output=True, env=env, timeout=60)
    with open(os.path.join(work, "README.md"), "w") as f:
        f.write(content)
    for args in (["add", "README.md"], ["commit", "-q", "-m", "initial"],
                 ["push", "-q", bare, "HEAD:refs/heads/main"]):
        subprocess.run(git + ["-C", work] + args, check=True, capture_output=True, env=env,
                       timeout=60)
    subprocess.run(["git", "-C", bare, "symbolic-ref", "HEAD", "refs/heads/main"], check=True,
                   capture_output=True, env=env, timeout=60)
    return content


def unix_admin_get(path: str, sock_path: str, timeout: float = 1.0):
    """(status, body) of GET path over a unix socket, or None."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(sock_path)
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
                      .encode())
            r = helpers.read_response(helpers.Conn(s))
            return r.status, r.body
    except (OSError, ValueError, ConnectionError):
        return None


class UnixAdminEgressd(helpers.Egressd):
    """egressd whose admin API listens on a unix socket (listen.admin: unix:/path)."""

    def __init__(self, binary: str, workdir: str, config: dict, secrets: dict[str, str],
                 sock_path: str):
        config["listen"]["admin"] = "127.0.0.1:0"  # parsed by the base class; replaced below
        super().__init__(binary, workdir, config, secrets)
        config["listen"]["admin"] = f"unix:{sock_path}"
        self.sock_path = sock_path
        self.admin_port = None

    def wait_ready(self, timeout: float = helpers.DEADLINE_READY_S):
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"egressd exited with {self.proc.returncode} before ready; "
                                     f"stderr:\n{self.stderr_text()[-4000:]}")
            r = unix_admin_get("/readyz", self.sock_path, timeout=0.5)
            return r is not None and r[0] == 200
        helpers.poll(ready, timeout, "egressd /readyz (unix socket)", interval=0.05)
