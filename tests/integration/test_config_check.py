"""`egressd --check`: exit 0 on a good config; non-zero with "yaml.path: problem" on stderr."""
from __future__ import annotations

import pytest


def test_check_accepts_the_standard_config(factory):
    r = factory.make().check()
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("mutate, path", [
    (lambda c: c["policy"].__setitem__("unpinned", "bogus"), "policy.unpinned"),
    (lambda c: c["listen"].__setitem__("bogus_key", 1), "listen.bogus_key"),
    (lambda c: c["runs"][0]["pins"][0]["inject"].__setitem__("type", "token"),
     "runs[0].pins[0].inject.type"),
    (lambda c: c["limits"].__setitem__("header_timeout", "soon"), "limits.header_timeout"),
    # an anonymous run is only allowed when it is the only run
    (lambda c: c["runs"][0].__setitem__("token_file", None), "runs"),
    # what a start would refuse, checked too (no listener, no file written)
    (lambda c: c["state"].update({"backend": "etcd",
                                  "etcd": {"endpoints": ["https://127.0.0.1:2379"],
                                           "cert_file": "/nonexistent/etcd.pem"}}),
     "state.etcd.key_file: must be set with etcd.cert_file"),
    # etcd's TLS files are loaded (etcd is not dialled)
    (lambda c: c["state"].update({"backend": "etcd",
                                  "etcd": {"endpoints": ["https://127.0.0.1:2379"],
                                           "ca_file": "/nonexistent/etcd-ca.pem"}}),
     "state.etcd.ca_file: cannot load CA file '/nonexistent/etcd-ca.pem'"),
    (lambda c: c["state"].update({"backend": "etcd",
                                  "etcd": {"endpoints": ["https://127.0.0.1:2379"],
                                           "cert_file": "/nonexistent/etcd.pem",
                                           "key_file": "/nonexistent/etcd.key"}}),
     "state.etcd.cert_file / key_file: cannot load certificate file '/nonexistent/etcd.pem'"),
    (lambda c: c["runs"][0].__setitem__("token_file", "/nonexistent/r1.token"),
     "runs[0].token_file"),
    (lambda c: c["upstream"].__setitem__("ca_file", "/nonexistent/ca.pem"), "upstream.ca_file"),
    # a store secret in a static run is found by the run's scope: without one, refused
    # rather than a pin that can never resolve
    (lambda c: c["runs"][0]["pins"][1].update({"secret": "github_token"})
     or c["runs"][0]["pins"][1].pop("secret_file"),
     "runs[0].scope: required by runs[0].pins[1].secret"),
])
def test_check_rejects_bad_config_naming_the_key(factory, mutate, path):
    e = factory.make(mutate)
    r = e.check()
    assert r.returncode != 0, f"--check accepted a bad config ({path})"
    assert path in r.stderr, f"stderr does not name {path}: {r.stderr!r}"


def test_bad_config_does_not_start(factory):
    import subprocess
    e = factory.make(lambda c: c["policy"].__setitem__("unpinned", "bogus"))
    e.write_config()
    r = subprocess.run([e.binary, "--config", e.config_path], cwd=e.workdir,
                       capture_output=True, timeout=30, text=True)
    assert r.returncode != 0
    assert "policy.unpinned" in r.stderr


def test_check_writes_no_file(factory):
    """--check builds the runs (CAs in memory) but writes no ca_cert_out and opens no store."""
    import os
    e = factory.make()
    r = e.check()
    assert r.returncode == 0, r.stderr
    assert not os.path.exists(e.config["runs"][0]["ca_cert_out"])
    assert not os.path.exists(e.config["state"]["path"])


def test_check_accepts_the_etcd_backend_without_contacting_etcd(factory):
    """--check opens no store: an etcd config is checked for its form, not dialled (the
    endpoint here is a port nothing listens on)."""
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    closed = s.getsockname()[1]
    s.close()
    e = factory.make(lambda c: c["state"].update(
        {"backend": "etcd", "etcd": {"endpoints": [f"http://127.0.0.1:{closed}"]}}))
    r = e.check()
    assert r.returncode == 0, r.stderr


def test_static_pin_with_a_store_secret_and_a_scope_is_valid(factory):
    def store_pin(c):
        c["runs"][0]["pins"][0].pop("secret_file")
        c["runs"][0]["pins"][0]["secret"] = "github_token"
        c["runs"][0]["scope"] = {"org": "acme", "project": "web"}
    e = factory.make(store_pin)
    r = e.check()
    assert r.returncode == 0, r.stderr
    assert "is valid" in r.stdout


@pytest.mark.parametrize("text", ["", "\n  \n", "# listen:\n#   proxy: 127.0.0.1:3128\n"])
def test_an_empty_config_file_is_refused_by_check_and_start(factory, text):
    """An empty (or comment-only) file is refused, not read as all the defaults: a truncated
    file would start with no static run. An explicit {} still means all the defaults."""
    import subprocess
    e = factory.make()
    e.write_config()
    with open(e.config_path, "w") as f:
        f.write(text)
    r = subprocess.run([e.binary, "--check", "--config", e.config_path], cwd=e.workdir,
                       capture_output=True, timeout=30, text=True)
    assert r.returncode != 0
    assert "config is empty" in r.stderr, r.stderr
    r = subprocess.run([e.binary, "--config", e.config_path], cwd=e.workdir,
                       capture_output=True, timeout=30, text=True)
    assert r.returncode != 0
    assert "config is empty" in r.stderr, r.stderr
