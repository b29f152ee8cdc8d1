"""A fleet's watch on a 3-member etcd cluster: a member that hangs or loses its leader must not
hold back what the rest of the cluster knows (DESIGN: "a run is an etcd lease, so expiry and
revocation reach every replica through a watch, within a second").

A replica keeps one watch stream to one etcd member. Two ways that member can go quiet without
closing the stream:
- it hangs (SIGSTOP here; a stuck disk, a paused VM): the kernel still ACKs, so TCP keepalive
  never fires. The replica's liveness check (a linearizable count of the prefix, about once a
  second, to the watched member first) gets no answer from it, another member answers, and
  the replica moves its watch there (and resyncs);
- it is cut off from the leader: etcd keeps such a watch open and sends nothing, unless the
  watch asks for a leader (the `Grpc-Metadata-hasleader: true` header), which makes etcd end
  it with "etcdserver: no leader".

A third way is a stream that stalls while its member answers everything else (behind a load
balancer, the one address of a cluster): the same check sees etcd hold a change under the
prefix that the watch has not delivered for state.etcd.timeout, and drops it. Writes elsewhere
in etcd move its revision too, and never come through the watch: a watch that delivers, or an
idle one, is never dropped.

One 3-member cluster (loopback, temp data, --pre-vote) serves the module; each test starts its
replicas on a key prefix of its own, on a cluster whose members all run and agree on a leader,
and leaves every member running (SIGCONT in a finally). The https:// case reuses
test_fleet's single-member etcd with client certificates.
"""
from __future__ import annotations

import base64
import json
import os
import re
import secrets as pysecrets
import select
import signal
import socket
import subprocess
import threading
import time
import urllib.request

import pytest

import helpers
from cp_helpers import api, bearer_pin, create_run, put_secret
from etcd_helpers import Etcd, require_etcd_bin
from upstream import free_port
from test_fleet import api_host, connect_status, etcd_tls, make_replica, on, sval, \
    start_replica, tls_keys, wait_run_known  # noqa: F401 - etcd_tls: a fixture used here

# state.etcd.timeout of the replica that watches the member that hangs: its liveness check
# waits this long for that member before moving on.
TIMEOUT_S = 1.0
# What the test allows on top of it: the check runs about once a second, then a resync (one
# range read) and the runtime rebuild. A sanitizer build runs several times slower.
SLACK_S = 3.0 * (2 if helpers.SANITIZER else 1)


class Member(Etcd):
    """One member of a cluster of three on loopback (client and peer ports picked free)."""

    def __init__(self, binary: str, workdir: str, name: str):
        super().__init__(binary, workdir)
        self.name = name
        self.initial_cluster = ""
        self.token = ""

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def command(self) -> list[str]:
        return [self.binary, "--name", self.name, "--data-dir", self.data_dir,
                "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                "--listen-peer-urls", self.peer_url,
                "--initial-advertise-peer-urls", self.peer_url,
                "--initial-cluster", self.initial_cluster,
                "--initial-cluster-state", "new", "--initial-cluster-token", self.token,
                # a member that ran again after SIGSTOP does not call an election the others
                # do not need (etcd 3.4's default is off)
                "--pre-vote",
                "--logger", "zap", "--log-outputs", "stderr", "--log-level", "error"]

    def launch(self):
        """Starts the process without waiting: a member is healthy only once a majority of
        the cluster runs (Etcd.start waits for /health, which would block on the first)."""
        assert not self.running()
        os.makedirs(self.workdir, exist_ok=True)
        self._log = open(self.log_path, "ab")
        env = {k: v for k, v in helpers.clean_env().items() if not k.startswith("ETCD")}
        self.proc = subprocess.Popen(self.command(), cwd=self.workdir, stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=self._log, env=env,
                                     preexec_fn=helpers._die_with_parent)

    def status(self) -> dict:
        """/v3/maintenance/status: this member's id and the leader's (as ints)."""
        j = self._post("/v3/maintenance/status", {})
        return {"member": int(j["header"]["member_id"]), "leader": int(j.get("leader", 0))}

    def stop_signal(self):
        os.kill(self.proc.pid, signal.SIGSTOP)

    def cont_signal(self):
        if self.running():
            os.kill(self.proc.pid, signal.SIGCONT)


class Cluster:
    def __init__(self, binary: str, world):
        self.members = [Member(binary, world.new_dir(f"etcd-e{i}-"), f"e{i}") for i in (1, 2, 3)]
        spec = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        token = "egressd-watch-" + pysecrets.token_hex(4)
        for m in self.members:
            m.initial_cluster, m.token = spec, token

    def start(self) -> "Cluster":
        try:
            for m in self.members:
                m.launch()
            for m in self.members:
                m.wait_healthy(30.0)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self):
        for m in self.members:
            m.cont_signal()
            m.stop()

    def wait_healthy(self, timeout: float = 30.0):
        """Every member healthy and all of them agreeing on one leader."""
        for m in self.members:
            m.wait_healthy(timeout)

        def one_leader():
            try:
                leaders = {m.status()["leader"] for m in self.members}
            except (OSError, ValueError, KeyError):
                return False
            return len(leaders) == 1 and 0 not in leaders
        helpers.poll(one_leader, timeout, "the etcd members to agree on a leader", interval=0.1)

    def leader_not(self, avoid: Member, timeout: float = 20.0):
        """Makes sure `avoid` is not the leader (moves the leadership to another member if it
        is), so stopping it needs no election before the others can write."""
        def moved():
            st = avoid.status()
            if st["leader"] == 0:
                return False
            if st["leader"] != st["member"]:
                return True
            target = next(m for m in self.members if m is not avoid).status()["member"]
            try:
                avoid._post("/v3/maintenance/transfer-leadership", {"targetID": str(target)})
            except OSError:
                pass
            return False
        helpers.poll(moved, timeout, f"the leadership off {avoid.name}", interval=0.2)


@pytest.fixture(scope="module")
def cluster(world):
    c = Cluster(require_etcd_bin(), world).start()
    yield c
    c.stop()


@pytest.fixture
def prefix(request, cluster) -> str:
    """A key prefix of the test's own, on a cluster whose every member runs and agrees on a
    leader (a test that failed may have left one stopped)."""
    for m in cluster.members:
        m.cont_signal()
    cluster.wait_healthy()
    slug = re.sub(r"[^A-Za-z0-9]+", "-", request.node.name)[:40]
    return f"/egressd-watch-{slug}-{pysecrets.token_hex(3)}/"


def remote_ports(pid: int) -> set[int]:
    """The remote ports of pid's established TCP connections over IPv4 loopback."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = set()
    with open(f"/proc/{pid}/net/tcp") as f:
        next(f)
        for line in f:
            cols = line.split()
            if cols[3] == "01" and cols[9] in inodes:  # ESTABLISHED
                ports.add(int(cols[2].split(":")[1], 16))
    return ports


def watches(e: helpers.Egressd, m: Member) -> bool:
    """Whether replica e holds a connection to member m's client port (its watch: unary calls
    are short connections of their own)."""
    return m.client_port in remote_ports(e.proc.pid)



def refused_on(a, run_a, world, bound: float, why: str):
    """Polls until replica A refuses run_a (the run revoked through B); its CONNECT status."""
    def refused():
        st = connect_status(run_a, api_host(world))
        return st if st[0] != 200 else None
    try:
        return helpers.poll(refused, bound, "A to refuse the run revoked through B",
                            interval=0.05)
    except AssertionError:
        pytest.fail(f"A still admits the run {bound:.0f} s after its revocation with its "
                    f"{why}; A's etcd log lines:\n{etcd_lines(a)}", pytrace=False)

def test_a_hung_member_does_not_hold_back_a_revocation(factory, world, cluster, prefix):
    """Replica A watches e1 (first in its endpoints); e1 hangs (SIGSTOP: the kernel still ACKs,
    TCP keepalive never fires); a run is revoked through B (on e2 and e3, still a majority).
    A refuses the run within state.etcd.timeout and a few seconds, not never: its liveness
    check gets no answer from e1, e2 answers, and A moves its watch to e2 (one log line)."""
    e1, e2, e3 = cluster.members
    key = os.urandom(32)
    a = start_replica(factory, make_replica(factory, world, prefix,
                                            [e1.url, e2.url, e3.url], key,
                                            timeout=f"{int(TIMEOUT_S * 1000)}ms"))
    b = start_replica(factory, make_replica(factory, world, prefix, [e2.url, e3.url], key))
    put_secret(b, "watch_tok", sval("watch"), org="acme")
    run = create_run(b, world, {"org": "acme"}, [bearer_pin(api_host(world), "watch_tok")])
    run_a = on(run, a)
    wait_run_known(a, run_a, world, timeout=5.0)
    assert watches(a, e1), "A does not watch e1, the first of its endpoints"
    cluster.leader_not(e1)
    e1.stop_signal()
    try:
        def revoked():
            r = api(b, "DELETE", f"/v1/runs/{run.id}", timeout=30)
            return r.status == 200
        helpers.poll(revoked, 20.0, "B to revoke the run with e1 hung", interval=0.2)
        t0 = time.monotonic()
        assert connect_status(run, api_host(world)) == (403, "run_revoked")

        bound = TIMEOUT_S + SLACK_S
        st = refused_on(a, run_a, world, bound, "watched member e1 hung")
        took = time.monotonic() - t0
        assert st == (403, "run_revoked"), st
        assert took <= bound, took
        log = a.stderr_text()
        dropped = [line for line in log.splitlines() if "watch ended" in line]
        assert len(dropped) == 1, dropped
        assert e1.url in dropped[0] and "liveness check" in dropped[0], dropped[0]
        helpers.poll(lambda: watches(a, e2) or watches(a, e3), 5.0,
                     "A's watch to move off e1")
    finally:
        e1.cont_signal()
    cluster.wait_healthy()
    # e1 back: writes through A land and reach B, and B's reach A
    put_secret(a, "after_a", sval("after-a"), org="acme")
    put_secret(b, "after_b", sval("after-b"), org="acme")
    for e in (a, b):
        helpers.poll(lambda e=e: {"after_a", "after_b"} <= {
            s["name"] for s in api(e, "GET", "/v1/secrets").json["secrets"]}, 5.0,
            f"both secrets on :{e.admin_port}")
    for e in (a, b):
        e.stop()


def test_a_member_without_a_leader_ends_the_watch(factory, world, cluster, prefix):
    """Replica A watches e1 (its only endpoint); e2 and e3 hang, so e1 has no leader. etcd
    would keep A's watch open and silent; A asks for a leader (Grpc-Metadata-hasleader), so
    e1 ends the watch with "etcdserver: no leader" and A says so, then retries. Once e2 and
    e3 run again, A resynchronizes: a change made meanwhile through B reaches it."""
    e1, e2, e3 = cluster.members
    key = os.urandom(32)
    a = start_replica(factory, make_replica(factory, world, prefix, [e1.url], key))
    b = start_replica(factory, make_replica(factory, world, prefix, [e2.url, e3.url], key))
    put_secret(b, "before", sval("before"), org="acme")
    helpers.poll(lambda: any(s["name"] == "before" for s in
                             api(a, "GET", "/v1/secrets").json["secrets"]), 5.0,
                 "A to see B's write")
    assert watches(a, e1)
    for m in (e2, e3):
        m.stop_signal()
    try:
        # etcd cancels a hasleader watch after three election timeouts without a leader (1 s
        # each by default), counted from when e1 notices the leader is gone
        helpers.poll(lambda: re.search(r"watch ended \(etcd: .*no leader",
                                       a.stderr_text()), 20.0,
                     "A's watch on e1 to end with 'no leader'", interval=0.2)
    finally:
        for m in (e2, e3):
            m.cont_signal()
    cluster.wait_healthy()
    put_secret(b, "after", sval("after"), org="acme")
    helpers.poll(lambda: any(s["name"] == "after" for s in
                             api(a, "GET", "/v1/secrets").json["secrets"]), 15.0,
                 "A to see a write made through B after the cluster recovered")
    for e in (a, b):
        e.stop()


class FreezingProxy:
    """A TCP relay to one etcd member that can freeze the connections open at a moment (they
    stay open, the relay's kernel keeps ACKing, nothing more reaches the client) while new
    connections pass: a watch stalled on a member that still answers every other request,
    as behind an L4 load balancer whose backend connection hangs."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.port = free_port()
        self.listener = socket.create_server(("127.0.0.1", self.port))
        self.frozen: set[socket.socket] = set()
        self.open: dict[socket.socket, float] = {}  # client side -> when it was accepted
        self.lock = threading.Lock()
        self.stopping = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self):
        self.listener.settimeout(0.2)
        while not self.stopping:
            try:
                client, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            try:
                member = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.open[client] = time.monotonic()
            threading.Thread(target=self._relay, args=(client, member), daemon=True).start()

    def _relay(self, client: socket.socket, member: socket.socket):
        try:
            while not self.stopping:
                ready, _, _ = select.select([client, member], [], [], 0.2)
                with self.lock:
                    frozen = client in self.frozen
                for s in ready:
                    if frozen and s is member:
                        continue  # left unread: the member's answers stop here
                    data = s.recv(65536)
                    if not data:
                        return
                    (member if s is client else client).sendall(data)
                if frozen:
                    time.sleep(0.05)
        except OSError:
            pass
        finally:
            with self.lock:
                self.open.pop(client, None)
                self.frozen.discard(client)
            client.close()
            member.close()

    def freeze(self, min_age: float = 0.5) -> int:
        """Freezes the connections open for min_age seconds or more: the replica's watch, not
        its short calls (nor a watch still being set up); how many are frozen."""
        now = time.monotonic()
        with self.lock:
            self.frozen |= {c for c, t in self.open.items() if now - t >= min_age}
            return len(self.frozen)

    def freeze_watch(self):
        helpers.poll(self.freeze, 10.0, "a watch open through the relay", interval=0.1)

    def close(self):
        self.stopping = True
        self.listener.close()


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_a_stalled_watch_on_a_member_that_answers_is_dropped(factory, world, cluster, prefix,
                                                             request, scheme):
    """A's only endpoint is a relay to one member (one address for the cluster, as a load
    balancer's); A's watch through it freezes while the member answers everything else. A
    revocation (a put) and a new secret (a created key) made through B reach A within
    state.etcd.timeout and a few seconds: A's check sees etcd hold changes under the prefix
    that its watch has not delivered, drops the watch (one log line) and reads the state
    again. Over http:// to e2 of the cluster, and over https:// (client certificates) to
    test_fleet's single-member etcd (the cut of a TLS stream)."""
    e1, e2, e3 = cluster.members
    if scheme == "https":
        member = request.getfixturevalue("etcd_tls")
        relay = FreezingProxy(member.client_port)
        a_url, b_urls, tls = f"https://localhost:{relay.port}", [member.url], tls_keys(world)
    else:
        relay = FreezingProxy(e2.client_port)
        a_url, b_urls, tls = relay.url, [e3.url, e1.url], {}
    try:
        key = os.urandom(32)
        a = start_replica(factory, make_replica(factory, world, prefix, [a_url], key,
                                                timeout=f"{int(TIMEOUT_S * 1000)}ms", **tls))
        b = start_replica(factory, make_replica(factory, world, prefix, b_urls, key, **tls))
        put_secret(b, "stall_tok", sval("stall"), org="acme")
        run = create_run(b, world, {"org": "acme"}, [bearer_pin(api_host(world), "stall_tok")])
        run_a = on(run, a)
        wait_run_known(a, run_a, world, timeout=5.0)
        relay.freeze_watch()
        assert api(b, "DELETE", f"/v1/runs/{run.id}").status == 200
        t0 = time.monotonic()

        bound = TIMEOUT_S + SLACK_S
        st = refused_on(a, run_a, world, bound, "watch frozen")
        assert st == (403, "run_revoked"), st
        assert time.monotonic() - t0 <= bound
        dropped = [line for line in a.stderr_text().splitlines() if "watch ended" in line]
        assert len(dropped) == 1 and "is stalled" in dropped[0], dropped

        # again, for a key created (etcd's count of the prefix moves)
        relay.freeze_watch()
        put_secret(b, "created_meanwhile", sval("created"), org="acme")
        t0 = time.monotonic()
        helpers.poll(lambda: "created_meanwhile" in {
            s["name"] for s in api(a, "GET", "/v1/secrets").json["secrets"]}, bound,
            "A to list a secret created through B while its watch was frozen")
        assert time.monotonic() - t0 <= bound
        dropped = [line for line in a.stderr_text().splitlines() if "watch ended" in line]
        assert len(dropped) == 2 and "is stalled" in dropped[1], dropped
        for e in (a, b):
            e.stop()
    finally:
        relay.close()


def test_a_watch_that_delivers_is_never_dropped(factory, world, cluster, prefix):
    """Writes under the prefix (through B) and elsewhere in etcd (another prefix) for several
    checks, then none at all: the replica watching never drops its watch nor reads the whole
    state again (its log has no 'watch ended', no 'resynchronized')."""
    e1, e2, e3 = cluster.members
    key = os.urandom(32)
    a = start_replica(factory, make_replica(factory, world, prefix, [e1.url, e2.url, e3.url],
                                            key, timeout="1s"))
    b = start_replica(factory, make_replica(factory, world, prefix, [e2.url, e3.url], key))
    put_secret(a, "quiet", sval("quiet"), org="acme")
    other = f"/egressd-watch-other-{pysecrets.token_hex(3)}/"
    deadline = time.monotonic() + 6.0
    i = 0
    while time.monotonic() < deadline:  # writes elsewhere move etcd's revision, not ours
        i += 1
        req = urllib.request.Request(
            e2.url + "/v3/kv/put",
            data=json.dumps({"key": _b64(f"{other}k{i % 3}"), "value": _b64("x")}).encode(),
            headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=5) as r:
            r.read()
        if i % 3 == 0:  # and some under the prefix, which the watch delivers
            put_secret(b, f"busy_{i}", sval("busy"), org="acme")
        time.sleep(0.2)
    time.sleep(3.0)  # and then nothing at all
    log = a.stderr_text()
    assert "watch ended" not in log and "resynchronized" not in log, etcd_lines(a)
    names = {s["name"] for s in api(a, "GET", "/v1/secrets").json["secrets"]}
    assert {f"busy_{k}" for k in range(3, i + 1, 3)} <= names
    for e in (a, b):
        e.stop()


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def etcd_lines(e: helpers.Egressd) -> str:
    return "\n".join(line for line in e.stderr_text().splitlines() if "etcd" in line)[-2000:]
