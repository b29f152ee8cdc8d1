"""Transparent mode: egressd as a sandbox's default route (issue #7).

The namespace tests need root (CAP_NET_ADMIN: network namespaces, veth, iptables), as CI runs;
without it they are skipped with the reason. Everything they address is the test's own namespace
(10.250.x.0/30) and loopback. configs/sandbox-netns.sh builds the namespace, exactly as a user
would; `curl` runs inside with no proxy variables and only the run CA trusted.
"""
from __future__ import annotations

import os
import socket
import subprocess
import uuid

import pytest

import helpers
from upstream import free_port

SCRIPT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "configs",
                                      "sandbox-netns.sh"))


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, iptables)"
    for tool in ("ip", "iptables", "curl"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            return f"{tool} is not installed"
    probe = f"egp{os.getpid() % 100000}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def require_netns():
    """Skips the test (with why) where network namespaces cannot be made."""
    why = _netns_unavailable()
    if why:
        pytest.skip(why)


class Sandbox:
    def __init__(self, name: str, subnet_base: str, proxy_port: int, ports: list[int],
                 hosts: list[str]):
        self.name = name
        a, b, c, d = (int(x) for x in subnet_base.split("."))
        self.gateway = f"{a}.{b}.{c}.{d + 1}"
        self.address = f"{a}.{b}.{c}.{d + 2}"
        args = [SCRIPT, "up", name, "--proxy-port", str(proxy_port), "--subnet", subnet_base,
                "--ports", ",".join(str(p) for p in ports)]
        for h in hosts:
            args += ["--host", h]
        r = subprocess.run(args, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, f"sandbox-netns.sh up failed: {r.stderr}{r.stdout}"
        assert f"listen.transparent: {self.gateway}:{proxy_port}" in r.stdout

    def run(self, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run([SCRIPT, "exec", self.name, "--", *cmd], capture_output=True,
                              text=True, timeout=timeout, env=helpers.clean_env())

    def curl(self, *args: str, timeout: int = 10) -> subprocess.CompletedProcess:
        return self.run("curl", "-sS", "--http1.1", "--max-time", str(timeout), *args,
                        timeout=timeout + 10)

    def down(self):
        subprocess.run([SCRIPT, "down", self.name], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def netns_setup(world, factory):
    require_netns()
    tp = free_port()
    tag = uuid.uuid4().hex[:4]
    w = world
    hosts = ["api.test", "plain.test", "tunnel.test", "unlisted.test"]
    bound = Sandbox(f"egt{tag}a", "10.250.31.0", tp, [w.U, w.plain.port], hosts)
    stranger = None
    try:
        stranger = Sandbox(f"egt{tag}b", "10.250.32.0", tp, [w.U], hosts)

        def mutate(cfg):
            # Both sandboxes' gateways (REDIRECT targets the incoming interface's address).
            cfg["listen"]["transparent"] = f"0.0.0.0:{tp}"
            cfg["runs"][0]["sources"] = [f"{bound.address}/32"]
            cfg["runs"][1]["sources"] = ["10.250.40.0/24"]  # some other sandbox
        e = factory.start(mutate)
        yield e, bound, stranger
    finally:
        bound.down()
        if stranger:
            stranger.down()


def test_curl_in_the_sandbox_gets_the_credential_injected(world, netns_setup, marker):
    e, sb, _ = netns_setup
    ca = os.path.join(e.workdir, "r1-ca.pem")
    # No proxy variables, only the run CA trusted; api.test resolves (hosts file) to the
    # gateway, and the kernel redirects the connection to egressd.
    r = sb.curl("--cacert", ca, "-H", "Authorization: Bearer sandbox-forged",
                f"https://api.test:{world.U}/echo?{marker}")
    assert r.returncode == 0, r.stderr
    seen = world.upstream.find(marker)
    assert len(seen) == 1
    assert seen[0].header("authorization") == [f"Bearer {world.secrets['api_token']}"]
    assert seen[0].sni == "api.test"
    recs = e.wait_audit(lambda x: x.get("host") == "api.test" and x.get("status") == 200
                        and x.get("path") == "/echo")
    assert recs[-1]["run"] == "r1"
    assert recs[-1]["decision"] == "allow"
    assert recs[-1]["pin"] is not None


def test_a_host_outside_policy_is_closed_and_audited(netns_setup, world):
    e, sb, _ = netns_setup
    ca = os.path.join(e.workdir, "r1-ca.pem")
    r = sb.curl("--cacert", ca, f"https://unlisted.test:{world.U}/")
    assert r.returncode != 0  # closed before any handshake: nothing to trust, nothing sent
    rec = e.wait_audit(lambda x: x.get("host") == "unlisted.test" and x["decision"] == "deny")
    assert rec[-1]["reason"] == "host_not_allowed"
    assert rec[-1]["run"] == "r1"
    assert not [s for s in world.upstream.requests if s.sni == "unlisted.test"]


def test_cleartext_http_is_served_without_a_credential(netns_setup, world, marker):
    e, sb, _ = netns_setup
    r = sb.curl(f"http://plain.test:{world.plain.port}/echo?{marker}")
    assert r.returncode == 0, r.stderr
    seen = world.plain.find(marker)
    assert len(seen) == 1
    assert seen[0].header("authorization") == []  # a pinned host over cleartext: no credential


def test_a_reload_applies_to_the_next_request_on_an_open_cleartext_connection(netns_setup,
                                                                              world, marker):
    """A keep-alive connection on the transparent listener reads the runtime per request: after
    a reload that takes plain.test out of the run's pins and sets idle_timeout to 1s, that
    connection's next request is refused and its next idle wait is 1 s (the build before kept
    the limits, and the whole runtime, the connection began with: a 60 s wait)."""
    e, sb, _ = netns_setup
    flag = os.path.join(e.workdir, f"reloaded-{marker}")
    script = f"""
import os, socket, time
s = socket.create_connection(("plain.test", {world.plain.port}), timeout=30)
def get(tag):
    s.sendall(("GET /echo?{marker}-" + tag + " HTTP/1.1\\r\\nHost: plain.test:{world.plain.port}"
               "\\r\\n\\r\\n").encode())
    data = b""
    while b"\\r\\n\\r\\n" not in data:
        data += s.recv(65536)
    head, _, body = data.partition(b"\\r\\n\\r\\n")
    n = int([l.split(b":")[1] for l in head.split(b"\\r\\n") if l.lower().startswith(b"content-length")][0])
    while len(body) < n:
        body += s.recv(65536)
    print(head.split(b"\\r\\n")[0].decode(), flush=True)
get("before")
deadline = time.monotonic() + 20
while not os.path.exists({flag!r}) and time.monotonic() < deadline:
    time.sleep(0.05)
get("after")
started = time.monotonic()
left = s.recv(65536)  # egressd's idle close: b""
print(f"closed {{left!r}} after {{time.monotonic() - started:.1f}}", flush=True)
"""
    proc = subprocess.Popen([SCRIPT, "exec", sb.name, "--", "python3", "-c", script],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=helpers.clean_env())
    pins = [dict(p) for p in e.config["runs"][0]["pins"]]
    limits = dict(e.config["limits"])

    def reloaded(c):
        c["runs"][0]["pins"] = [p for p in pins if not p["host"].startswith("plain.test")]
        c["limits"]["idle_timeout"] = "1s"

    def restored(c):
        c["runs"][0]["pins"], c["limits"] = pins, limits
    try:
        helpers.poll(lambda: world.plain.find(f"{marker}-before"), 20, "the first request")
        e.rewrite_config(reloaded)
        e.reload()
        open(flag, "w").close()
        out, err = proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:
            proc.kill()
        e.rewrite_config(restored)
        e.reload()
    assert proc.returncode == 0, err
    lines = out.split("\n")
    assert lines[:2] == ["HTTP/1.1 200 OK", "HTTP/1.1 403 Forbidden"], (out, err)
    assert lines[2].startswith("closed b'' after "), out
    assert float(lines[2].rsplit(" ", 1)[1]) < 5, out
    assert world.plain.find(f"{marker}-after") == []
    rec = e.wait_audit(lambda x: x.get("host") == "plain.test" and x.get("status") == 403)
    assert rec[-1]["reason"] == "host_not_allowed", rec[-1]


def test_a_client_hello_that_stalls_is_closed_and_audited(netns_setup, world):
    """A connection that sends part of a ClientHello and nothing more is closed at
    header_timeout, and the refusal is recorded (header_timeout, status 0: no answer can be
    written before a handshake), as a slow request head is on the other listeners; it left no
    record."""
    e, sb, _ = netns_setup
    e.rewrite_config(lambda c: c["limits"].update({"header_timeout": "1s"}))
    e.reload()
    try:
        r = sb.run("python3", "-c",
                   "import socket, time\n"
                   f"s = socket.create_connection(('api.test', {world.U}), timeout=5)\n"
                   "s.sendall(bytes([0x16, 3, 1, 2, 0, 1, 0]))\n"
                   "s.settimeout(5)\n"
                   "try:\n"
                   "    print('closed' if s.recv(10) == b'' else 'data')\n"
                   "except ConnectionResetError:\n"
                   "    print('closed')\n", timeout=20)  # reset: its bytes were never read
        assert r.returncode == 0 and r.stdout.strip() == "closed", (r.stdout, r.stderr)
        rec = e.wait_audit(lambda x: x.get("reason") == "header_timeout")[-1]
        assert rec["decision"] == "deny" and rec["status"] == 0 and rec["run"] == "r1", rec
    finally:
        e.rewrite_config(lambda c: c["limits"].pop("header_timeout", None))
        e.reload()


def test_other_ports_and_egressd_itself_are_unreachable(netns_setup, world):
    e, sb, _ = netns_setup
    admin_port = int(e.config["listen"]["admin"].rsplit(":", 1)[1])
    tp = int(e.config["listen"]["transparent"].rsplit(":", 1)[1])
    for port in (9, admin_port, tp):  # not redirected: dropped (a timeout, not a refusal)
        r = sb.curl(f"http://{sb.gateway}:{port}/", timeout=2)
        assert r.returncode == 28, (port, r.returncode, r.stderr)
    # DNS is refused at once: no name resolves except through the hosts file.
    r = sb.run("getent", "hosts", "example.com")
    assert r.returncode != 0


def test_a_source_bound_to_no_run_is_refused(netns_setup, world, marker):
    e, _, stranger = netns_setup
    ca = os.path.join(e.workdir, "r1-ca.pem")
    r = stranger.curl("--cacert", ca, f"https://api.test:{world.U}/echo?{marker}")
    assert r.returncode != 0
    assert world.upstream.find(marker) == []
    rec = e.wait_audit(lambda x: x.get("reason") == "no_identity")
    assert rec[-1]["status"] == 403


def test_a_direct_connection_to_the_transparent_port_is_refused(factory, world):
    """Without root: a connection that was not redirected has no original destination."""
    tp = free_port()

    def mutate(cfg):
        cfg["listen"]["transparent"] = f"127.0.0.1:{tp}"
    e = factory.start(mutate)
    s = socket.create_connection(("127.0.0.1", tp), timeout=5)
    s.sendall(b"GET / HTTP/1.1\r\nHost: api.test\r\n\r\n")
    s.settimeout(5)
    try:
        got = s.recv(100)
    except ConnectionResetError:  # closed with our request unread
        got = b""
    assert got == b""  # closed without an answer and without forwarding anything
    s.close()
    rec = e.wait_audit(lambda x: x.get("reason") == "no_original_destination")
    assert rec[-1]["decision"] == "deny"


def test_a_direct_connection_to_a_dual_stack_transparent_port_is_refused(factory, world):
    """With conntrack active (a sandbox's NAT rules are up) SO_ORIGINAL_DST answers for a
    connection nothing redirected too: its own destination. On a dual-stack listener
    ([::]:P) an IPv4 client's socket is v4-mapped while conntrack answers IPv4; the two are
    compared unmapped, so 127.0.0.1:P dialled directly is no_original_destination, not a
    connection to some host on port P (it had gone through policy as far as a dial)."""
    require_netns()
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    tp = free_port()
    sb = Sandbox(f"egt{uuid.uuid4().hex[:4]}d", "10.250.34.0", tp, [world.U], ["api.test"])
    try:
        def mutate(cfg):
            cfg["listen"]["transparent"] = f"[::]:{tp}"
            cfg["runs"][0]["sources"] = ["127.0.0.1/32"]
        e = factory.start(mutate)
        s = socket.create_connection(("127.0.0.1", tp), timeout=5)
        s.sendall(f"GET / HTTP/1.1\r\nHost: api.test:{world.U}\r\n\r\n".encode())
        s.settimeout(5)
        try:
            got = s.recv(100)
        except ConnectionResetError:
            got = b""
        s.close()
        assert got == b""
        rec = e.wait_audit(lambda x: x.get("reason") == "no_original_destination")
        assert rec[-1]["decision"] == "deny"
        assert [r.get("reason") for r in e.audit_records()] == ["no_original_destination"]
    finally:
        sb.down()


def test_a_revoked_runs_sandbox_is_refused_not_given_to_a_broader_run(world, factory, marker):
    """Dynamic runs bound by source: A to the sandbox's address (/32), B to its whole /24.
    Once A is revoked, the sandbox's connections are refused 403 run_revoked; they are not
    handed to B, the next-longest match (B's credential had reached the upstream for them)."""
    require_netns()
    from cp_helpers import api, api_ok, bearer_pin, cp_mutate, put_secret
    tp = free_port()
    sb = Sandbox(f"egt{uuid.uuid4().hex[:4]}r", "10.250.33.0", tp, [world.U], ["api.test"])
    try:
        def mutate(cfg):
            cp_mutate(world, ports=[world.U])(cfg)
            cfg["listen"]["transparent"] = f"0.0.0.0:{tp}"
        e = factory.start(mutate)
        put_secret(e, "tp_tok", "sk-tp-" + os.urandom(12).hex(), org="acme")
        ids = {}
        for name, cidr in (("a", f"{sb.address}/32"), ("b", "10.250.33.0/24")):
            ids[name] = api_ok(e, "POST", "/v1/runs", {
                "scope": {"org": "acme"}, "source_cidrs": [cidr],
                "pins": [bearer_pin(f"api.test:{world.U}", "tp_tok")]})["id"]
        # -k: a run other than A would answer with its own CA; the test is what reaches the
        # upstream, not the certificate.
        r = sb.curl("-k", f"https://api.test:{world.U}/echo?{marker}-a")
        assert r.returncode == 0, r.stderr
        assert e.wait_audit(lambda x: x.get("path") == "/echo" and x.get("run") == ids["a"])
        api_ok(e, "DELETE", f"/v1/runs/{ids['a']}")
        r = sb.curl("-k", f"https://api.test:{world.U}/echo?{marker}-after")
        assert r.returncode != 0
        assert world.upstream.find(f"{marker}-after") == []
        rec = e.wait_audit(lambda x: x.get("reason") == "run_revoked")
        assert rec[-1]["status"] == 403 and rec[-1]["proto_in"] == "transparent"
        assert api(e, "GET", f"/v1/runs/{ids['b']}").status == 200
    finally:
        sb.down()


def test_cleartext_to_a_pinned_host_whose_secret_is_missing_says_so(world, factory, marker):
    """A cleartext request on the transparent listener to a host pinned with a secret that
    could not be loaded is refused 403 secret_unavailable, as on the forward port (it was
    host_not_allowed, as if the host had no pin)."""
    require_netns()
    tp = free_port()
    P = world.plain.port
    sb = Sandbox(f"egt{uuid.uuid4().hex[:4]}m", "10.250.35.0", tp, [P], ["missing.test"])
    try:
        def mutate(cfg):
            cfg["listen"]["transparent"] = f"0.0.0.0:{tp}"
            cfg["runs"][0]["sources"] = [f"{sb.address}/32"]
            cfg["runs"][0]["pins"].append({
                "host": f"missing.test:{P}", "inject": {"type": "bearer"},
                "secret_file": os.path.join(world.tmp, "no-such-secret-file")})
        e = factory.start(mutate)
        r = sb.curl("-i", f"http://missing.test:{P}/echo?{marker}")
        assert r.returncode == 0, r.stderr
        head = r.stdout.split("\r\n\r\n", 1)[0].lower()
        assert head.startswith("http/1.1 403"), head
        assert "x-egress-reason: secret_unavailable" in head, head
        rec = e.wait_audit(lambda x: x.get("host") == "missing.test" and x.get("status") == 403)
        assert rec[-1]["reason"] == "secret_unavailable", rec[-1]
        assert world.plain.find(marker) == []
    finally:
        sb.down()
