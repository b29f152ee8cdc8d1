"""Fixtures for the egressd integration tests.

Everything listens on 127.0.0.1. Fake names (api.test, basic.test, ...) reach the test upstreams
through egressd's resolver.overrides; clients never resolve them (they go through the proxy).

Each test file runs in its own pytest process (ctest), so "session" fixtures are per file.
"""
from __future__ import annotations

import os
import secrets as pysecrets
import shutil
import tempfile
from dataclasses import dataclass, field

import pytest

import helpers
from dns_server import DnsServer
from upstream import Pki, SilentListener, Upstream, free_port, make_pki


def _egressd_bin() -> str:
    b = os.environ.get("EGRESSD_BIN")
    if not b:
        for cand in ("../../build-it/egressd", "../../build/egressd"):
            if os.path.exists(cand):
                b = os.path.abspath(cand)
                break
    if not b or not os.access(b, os.X_OK):
        pytest.fail(f"EGRESSD_BIN is not set or not executable: {b!r}", pytrace=False)
    return os.path.abspath(b)


@dataclass
class World:
    tmp: str
    pki: Pki
    upstream: Upstream          # TLS, cert from the trusted test CA
    plain: Upstream             # cleartext HTTP
    bad: Upstream               # TLS, cert from an UNTRUSTED CA
    silent: SilentListener      # accepts TCP, never answers
    closed_port: int            # nothing listens here
    secrets: dict[str, str]     # secret name (file basename) -> value
    secret_files: dict[str, str]
    tokens: dict[str, str] = field(default_factory=dict)  # run id -> proxy token
    # The resolver egressd asks for names no override covers: on loopback, NXDOMAIN for all
    # (without it, such a lookup went to the machine's resolver, off loopback).
    dns: DnsServer | None = None
    _n: int = 0

    def new_dir(self, prefix: str) -> str:
        self._n += 1
        d = os.path.join(self.tmp, f"{prefix}{self._n}")
        os.makedirs(d)
        return d

    @property
    def U(self) -> int:
        return self.upstream.port

    def auth(self, run: str = "r1") -> str:
        return helpers.basic_auth(run, self.tokens[run])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test's report never shows a secret: pytest prints both sides of a failed
    comparison, and a test's messages and output may hold one. Every value registered with
    helpers.secret() (the world's secrets and tokens, the control-plane tests' values, admin
    tokens) is replaced by its fingerprint in the report and the captured output."""
    outcome = yield
    rep = outcome.get_result()
    # Captured output is shown for passing tests too (-rP), and a skip's reason always.
    rep.sections = [(title, helpers.redact_secrets(body)) for title, body in rep.sections]
    if isinstance(rep.longrepr, tuple) and len(rep.longrepr) == 3:  # a skip: (file, line, why)
        path, line, why = rep.longrepr
        rep.longrepr = (path, line, helpers.redact_secrets(str(why)))
    elif rep.failed and rep.longrepr is not None:
        text = str(rep.longrepr)
        redacted = helpers.redact_secrets(text)
        if redacted != text:
            rep.longrepr = redacted


@pytest.fixture(scope="session")
def world():
    tmp = tempfile.mkdtemp(prefix="egressd-it-")
    pki = make_pki(os.path.join(tmp, "pki"))
    up = Upstream(pki.server_cert, pki.server_key)
    plain = Upstream()
    bad = Upstream(pki.bad_cert, pki.bad_key)
    silent = SilentListener()
    sdir = os.path.join(tmp, "secrets")
    os.makedirs(sdir)
    values = {
        "api_token": "sk-itest-api-" + pysecrets.token_hex(16),
        "basic_pw": "pw-itest-basic-" + pysecrets.token_hex(16),
        "hdr_key": "hk-itest-hdr-" + pysecrets.token_hex(16),
        "lim_token": "sk-itest-lim-" + pysecrets.token_hex(16),
        "plain_token": "sk-itest-plain-" + pysecrets.token_hex(16),
    }
    files = {}
    for name, v in values.items():
        p = os.path.join(sdir, name)
        with open(p, "w") as f:
            f.write(v)
        os.chmod(p, 0o600)
        files[name] = p
    w = World(tmp, pki, up, plain, bad, silent, free_port(), values, files)
    w.tokens = {"r1": "tok1-" + pysecrets.token_hex(12), "r2": "tok2-" + pysecrets.token_hex(12)}
    for v in [*values.values(), *w.tokens.values()]:
        helpers.secret(v)
    w.dns = DnsServer()
    yield w
    w.dns.close()
    up.close()
    plain.close()
    bad.close()
    silent.close()
    if os.environ.get("EGRESS_IT_KEEP_TMP"):
        print(f"kept {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)


OVERRIDE_HOSTS = ["api.test", "basic.test", "hdr.test", "other.test", "tunnel.test", "lim.test",
                  "plain.test", "slow.test", "down.test", "self.test", "bad.test",
                  "wrongname.test", "unlisted.test"]


def base_config(w: World, wd: str, *, unpinned: str = "tunnel", single_anonymous: bool = False,
                proxy_port: int | None = None, admin_port: int | None = None) -> dict:
    """The standard config: run r1 with every kind of pin, run r2 with none."""
    U = w.U
    pp = proxy_port or helpers_free_port()
    ap = admin_port or helpers_free_port()
    while ap == pp and not admin_port:  # two picks of a free port can return the same one
        ap = helpers_free_port()
    var = os.path.join(wd, "var")
    tok_files = {}
    for run, tok in w.tokens.items():
        p = os.path.join(wd, f"{run}.token")
        with open(p, "w") as f:
            f.write(tok)
        os.chmod(p, 0o600)
        tok_files[run] = p
    sf = w.secret_files

    def pin(host, secret, inject, **kw):
        d = {"host": host, "secret_file": sf[secret], "inject": inject}
        d.update(kw)
        return d

    r1 = {
        "id": "r1",
        "token_file": None if single_anonymous else tok_files["r1"],
        "ca_cert_out": os.path.join(wd, "r1-ca.pem"),
        "allow_hosts": [],
        "pins": [
            pin(f"api.test:{U}", "api_token", {"type": "bearer"}),
            pin(f"basic.test:{U}", "basic_pw", {"type": "basic", "username": "itest-user"}),
            pin(f"hdr.test:{U}", "hdr_key",
                {"type": "header", "name": "x-api-key", "template": "Key {secret}"}),
            pin(f"lim.test:{U}", "lim_token", {"type": "bearer"},
                path_prefixes=["/echo"], methods=["GET"]),
            pin(f"plain.test:{w.plain.port}", "plain_token", {"type": "bearer"}),
            pin(f"down.test:{w.closed_port}", "api_token", {"type": "bearer"}),
            pin(f"slow.test:{w.silent.port}", "api_token", {"type": "bearer"}),
            pin(f"bad.test:{w.bad.port}", "api_token", {"type": "bearer"}),
            pin(f"wrongname.test:{U}", "api_token", {"type": "bearer"}),
        ],
    }
    runs = [r1]
    if not single_anonymous:
        runs.append({"id": "r2", "token_file": tok_files["r2"],
                     "ca_cert_out": os.path.join(wd, "r2-ca.pem"), "allow_hosts": [],
                     "pins": []})
    overrides = {h: ["127.0.0.1"] for h in OVERRIDE_HOSTS}
    overrides["deny.test"] = ["127.0.0.2"]        # loopback, but not in allow_networks
    overrides["meta.test"] = ["169.254.169.254"]  # cloud metadata
    return {
        "listen": {"proxy": f"127.0.0.1:{pp}", "admin": f"127.0.0.1:{ap}"},
        "admin": {"token_file": os.path.join(var, "admin.token")},
        "state": {"backend": "file", "path": os.path.join(var, "state")},
        "keys": {"master_key_file": os.path.join(var, "master.key")},
        "upstream": {"ca_file": w.pki.ca},
        "resolver": {"overrides": overrides, "servers": [f"127.0.0.1:{w.dns.port}"]},
        "policy": {
            "unpinned": unpinned,
            "allow_hosts": ["tunnel.test", "self.test", "deny.test", "meta.test",
                            "nx-egressd-test.invalid"],
            "allow_networks": ["127.0.0.1/32"],
            "allowed_ports": sorted({U, w.plain.port, w.bad.port, w.silent.port, w.closed_port,
                                     pp, ap}),
        },
        "limits": {"header_timeout": "5s", "connect_timeout": "2s", "tls_timeout": "3s",
                   "drain_timeout": "2s"},
        "audit": {"path": os.path.join(wd, "audit.jsonl")},
        "runs": runs,
    }


def helpers_free_port() -> int:
    return free_port()


class EgressdFactory:
    def __init__(self, w: World, binary: str):
        self.w = w
        self.binary = binary
        self.started: list[helpers.Egressd] = []

    def make(self, mutate=None, **kw) -> helpers.Egressd:
        wd = self.w.new_dir("egressd-")
        cfg = base_config(self.w, wd, **kw)
        if mutate:
            mutate(cfg)
        return helpers.Egressd(self.binary, wd, cfg, self.w.secrets)

    def start(self, mutate=None, **kw) -> helpers.Egressd:
        e = self.make(mutate, **kw)
        self.started.append(e)
        return e.start()

    def finish(self):
        """Stops every egressd; each must exit 0 on SIGTERM and must not have written a secret."""
        problems = []
        for e in self.started:
            try:
                rc = e.stop()
                if rc != 0:
                    problems.append(f"egressd ({e.workdir}) exited {rc} after SIGTERM; stderr tail:\n"
                                    f"{e.stderr_text()[-2000:]}")
            except AssertionError as ex:
                problems.append(str(ex))
            leaks = e.leaks()
            if leaks:
                problems.append(f"secret bytes written by egressd: {leaks}")
        self.started.clear()
        return problems


@pytest.fixture(scope="session")
def egressd_bin():
    return _egressd_bin()


@pytest.fixture(scope="module")
def factory(world, egressd_bin):
    f = EgressdFactory(world, egressd_bin)
    yield f
    problems = f.finish()
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


@pytest.fixture(scope="module")
def egressd(factory) -> helpers.Egressd:
    """The standard egressd (unpinned: tunnel, runs r1 and r2), one per test module."""
    return factory.start()


@pytest.fixture
def marker(request) -> str:
    """A unique path segment for the current test, to find its requests upstream."""
    import re
    return "m-" + re.sub(r"[^A-Za-z0-9]+", "-", request.node.name)[:60] + "-" + \
        os.urandom(3).hex()
