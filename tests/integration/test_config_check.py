"""`egressd --check`: exit 0 on a good config; non-zero with "yaml.path: problem" on stderr."""
from __future__ import annotations

import os

import pytest

import helpers


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


# ---------------------------------------------------------------------------------------------
# Files egressd writes never name one it reads (a key, a token, its store) nor each other


def _digest(path: str) -> str:
    import hashlib
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _existing_key_and_token(e) -> dict[str, str]:
    """Writes a master key and an admin token (0600) where e's config names them, as a
    start would have; returns path -> digest, to show they are left untouched."""
    import os
    files = {e.config["keys"]["master_key_file"]: os.urandom(32),
             e.config["admin"]["token_file"]: os.urandom(16).hex().encode() + b"\n"}
    for path, data in files.items():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, data)
        os.close(fd)
    return {path: _digest(path) for path in files}


def _start_refused(e, timeout: float = 15.0) -> str:
    """Starts egressd on e's config: it must exit non-zero (one still running after `timeout`
    is killed, and the test fails). Returns its stderr."""
    import subprocess
    import helpers
    e.write_config()
    p = subprocess.Popen([e.binary, "--config", e.config_path], cwd=e.workdir,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, env=helpers.clean_env(), text=True)
    try:
        _out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise AssertionError("egressd started on a config it must refuse")
    assert p.returncode != 0, err
    return err


def _key(c):
    return c["keys"]["master_key_file"]


def _linkpath(c, name: str) -> str:
    import os
    return os.path.join(os.path.dirname(_key(c)), name)


def _link(c, name: str, target: str) -> None:
    """A symlink `name` beside the master key, to `target` (which may not exist yet)."""
    import os
    os.makedirs(os.path.dirname(_key(c)), exist_ok=True)
    os.symlink(target, _linkpath(c, name))


def _write_key(c) -> str:
    """Writes a master key (32 random bytes, owner-only) at keys.master_key_file; its path."""
    real = _key(c)
    os.makedirs(os.path.dirname(real), exist_ok=True)
    fd = os.open(real, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, os.urandom(32))
    os.close(fd)
    return real


@pytest.mark.parametrize("mutate, message", [
    # the typo that replaced the master key with a socket (every stored secret lost)
    (lambda c: c["listen"].__setitem__("admin", "unix:" + _key(c)),
     "listen.admin: names the file of keys.master_key_file"),
    # ... and with a certificate, also on a SIGHUP (test below)
    (lambda c: c["runs"][0].__setitem__("ca_cert_out", _key(c)),
     "runs[0].ca_cert_out: names the file of keys.master_key_file"),
    (lambda c: c["runs"][1].__setitem__("ca_bundle_out", _key(c)),
     "runs[1].ca_bundle_out: names the file of keys.master_key_file"),
    (lambda c: c["audit"].__setitem__("path", _key(c)),
     "audit.path: names the file of keys.master_key_file"),
    (lambda c: c["runs"][0].__setitem__("ca_cert_out", c["admin"]["token_file"]),
     "runs[0].ca_cert_out: names the file of admin.token_file"),
    # the same file by another spelling
    (lambda c: c["runs"][1].__setitem__(
        "ca_cert_out", c["state"]["path"] + "/../" + _key(c).rsplit("/", 1)[1]),
     "runs[1].ca_cert_out: names the file of keys.master_key_file"),
    # ".." after a symlinked folder is the parent of the link's target, as the kernel
    # resolves it (the check normalised "link/.." away first: the key was replaced)
    (lambda c: (os.makedirs(os.path.dirname(_key(c)) + "/sub", exist_ok=True),
                _link(c, "../dirlink", os.path.dirname(_key(c)) + "/sub"),
                c["runs"][0].__setitem__("ca_cert_out", os.path.dirname(
                    os.path.dirname(_key(c))) + "/dirlink/../" + os.path.basename(_key(c)))),
     "runs[0].ca_cert_out: names the file of keys.master_key_file"),
    (lambda c: c["runs"][0].__setitem__("ca_cert_out", c["state"]["path"] + "/state.json"),
     "runs[0].ca_cert_out: is inside state.path"),
    # two runs sharing one CA file overwrote each other's CA
    (lambda c: c["runs"][1].__setitem__("ca_cert_out", c["runs"][0]["ca_cert_out"]),
     "runs[1].ca_cert_out: names the same file as runs[0].ca_cert_out"),
    # audit.path is appended to through a symlink at its name: the link's target counts
    (lambda c: (_link(c, "audit.link", _key(c)), c["audit"].__setitem__(
        "path", _linkpath(c, "audit.link"))),
     "audit.path: names the file of keys.master_key_file"),
    # a bundle written over the system roots it starts from grew by a CA at every start
    (lambda c: (c["upstream"].__setitem__("ca_file", "system"), c["runs"][0].__setitem__(
        "ca_bundle_out", "/etc/ssl/certs/ca-certificates.crt")),
     "runs[0].ca_bundle_out: names the file of the system trust store"),
], ids=["admin-socket-on-key", "ca-cert-out-on-key", "ca-bundle-out-on-key", "audit-on-key",
        "ca-cert-out-on-admin-token", "ca-cert-out-on-key-by-dotdot",
        "ca-cert-out-on-key-by-dotdot-after-a-symlink", "ca-cert-out-in-state",
        "two-runs-one-ca-cert-out", "audit-via-symlink-on-key", "bundle-on-system-roots"])
def test_a_written_path_naming_a_file_egressd_reads_is_refused(factory, mutate, message):
    """--check and the start refuse, naming the key; the key and token are left as they were."""
    e = factory.make()
    mutate(e.config)  # after make: the Egressd object reads a TCP listen.admin's port
    before = _existing_key_and_token(e)
    r = e.check()
    assert r.returncode != 0, "--check accepted it"
    assert message in r.stderr, r.stderr
    err = _start_refused(e)
    assert message in err, err
    assert {p: _digest(p) for p in before} == before, "a key or token file was changed"


def test_a_master_key_named_through_a_symlink_is_still_protected(factory):
    """keys.master_key_file names a symlink to the key; ca_cert_out names the key itself. The
    key is read through the link, so that CA file would replace it: refused (the check
    compared the link's own name)."""
    e = factory.make()
    real = _write_key(e.config)
    before = _digest(real)
    _link(e.config, "link.key", real)
    e.config["keys"]["master_key_file"] = _linkpath(e.config, "link.key")
    e.config["runs"][0]["ca_cert_out"] = real
    r = e.check()
    assert r.returncode != 0, "--check accepted it"
    assert "runs[0].ca_cert_out: names the file of keys.master_key_file" in r.stderr, r.stderr
    assert "runs[0].ca_cert_out: names the file of keys.master_key_file" in _start_refused(e)
    assert _digest(real) == before


def test_one_symlink_named_as_the_master_key_and_as_a_ca_file_is_refused(factory):
    """keys.master_key_file and ca_cert_out both name one symlink to the key: the key is read
    through it, and the CA's rename would replace it (the config's key path then holds a
    certificate). The check compared the followed form of one with the name of the other."""
    import os
    e = factory.make()
    real = _write_key(e.config)
    _link(e.config, "link.key", real)
    link = _linkpath(e.config, "link.key")
    e.config["keys"]["master_key_file"] = link
    e.config["runs"][0]["ca_cert_out"] = link
    r = e.check()
    assert r.returncode != 0, "--check accepted it"
    assert "runs[0].ca_cert_out: names the file of keys.master_key_file" in r.stderr, r.stderr
    assert os.path.islink(link)


def test_check_passes_a_dangling_symlink_at_the_next_key_as_a_start_does(factory):
    """A rotation's .next is looked for through a symlink at its name: a dangling one is no
    .next to a start, and --check (which had read it as a broken key file) agrees."""
    import os
    e = factory.make()
    _link(e.config, os.path.basename(_key(e.config)) + ".next",
          os.path.join(e.workdir, "nowhere.key"))
    r = e.check()
    assert r.returncode == 0, r.stderr


def test_a_folder_where_a_ca_file_goes_is_refused_and_reloads_go_on(factory, world):
    """A folder at ca_bundle_out: a start ended in std::terminate (the bundle comparison read
    it as a file and threw), --check passed, and on a reload the exception ended the SIGHUP
    loop: no later reload (nor the audit file's reopen) happened. Now --check, the start and
    the reload refuse it, naming the key, and the next SIGHUP reloads."""
    import os
    e = factory.make()
    folder = os.path.join(e.workdir, "bundle-dir")
    os.makedirs(folder)
    e.config["runs"][0]["ca_bundle_out"] = folder
    r = e.check()
    assert r.returncode == 1, r.stderr
    assert f"runs[0].ca_bundle_out: {folder} is a folder" in r.stderr, r.stderr
    err = _start_refused(e)
    assert f"runs[0].ca_bundle_out: {folder} is a folder" in err, err
    e = factory.start()
    e.rewrite_config(lambda c: c["runs"][0].__setitem__("ca_bundle_out", folder))
    e.reload("reload refused")
    assert f"{folder} is a folder" in e.stderr_text()
    e.rewrite_config(lambda c: c["runs"][0].pop("ca_bundle_out"))
    e.reload("reloaded")


def test_check_refuses_a_dangling_symlink_where_the_admin_token_goes(factory):
    """A start cannot create the admin token through a dangling symlink (O_EXCL): --check took
    the link for a missing file and passed."""
    import os
    e = factory.make()
    tok = e.config["admin"]["token_file"]
    os.makedirs(os.path.dirname(tok), exist_ok=True)
    os.symlink(os.path.join(e.workdir, "nowhere", "token"), tok)
    r = e.check()
    assert r.returncode != 0 and "admin.token_file" in r.stderr, r.stderr
    assert "admin.token_file" in _start_refused(e)


def test_an_admin_socket_path_holding_a_file_is_refused_not_removed(factory):
    """listen.admin: unix:PATH removed whatever was at PATH before the bind; only a socket
    (an earlier run's) is removed now: anything else is refused, by --check too."""
    import os
    import socket
    e = factory.make()
    victim = os.path.join(e.workdir, "victim.txt")
    os.makedirs(e.workdir, exist_ok=True)
    with open(victim, "w") as f:
        f.write("untouched\n")
    e.config["listen"]["admin"] = "unix:" + victim
    r = e.check()
    assert r.returncode != 0, "--check accepted it"
    assert "listen.admin: " + victim + " exists and is a regular file, not a socket" in r.stderr, \
        r.stderr
    err = _start_refused(e)
    assert "exists and is a regular file, not a socket" in err, err
    with open(victim) as f:
        assert f.read() == "untouched\n"
    # An earlier run's socket is still removed and bound again.
    os.unlink(victim)
    old = socket.socket(socket.AF_UNIX)
    old.bind(victim)
    old.close()
    r = e.check()
    assert r.returncode == 0, r.stderr


def test_a_reload_naming_the_master_key_as_ca_cert_out_is_refused(factory, world, marker):
    """The reload that would have renamed a CA over the master key is refused, naming the
    key; the key and the serving CA are unchanged."""
    import helpers
    from clients import run_ca
    e = factory.start()
    key = e.config["keys"]["master_key_file"]
    key_before = _digest(key)
    e.rewrite_config(lambda c: c["runs"][0].__setitem__("ca_cert_out", key))
    e.reload("reload refused")
    line = e.last_line("reload refused")
    assert "runs[0].ca_cert_out: names the file of keys.master_key_file" in line, line
    assert _digest(key) == key_before, "the master key was changed"
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), run_ca(e, "r1"))
    assert helpers.request(c, "GET", f"/echo/{marker}", f"api.test:{world.U}").status == 200
    c.close()


# ---------------------------------------------------------------------------------------------
# --check runs the start's own checks of the admin token, the master key and the audit file


def _write(path: str, data: bytes, mode: int) -> None:
    import os
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, data)
    os.close(fd)
    os.chmod(path, mode)


def _token(c):
    return c["admin"]["token_file"]


@pytest.mark.parametrize("files, message", [
    (lambda c: _write(_token(c), b"t" * 32 + b"\n", 0o644),
     "admin.token_file: {token} is readable by group or others (mode 0644)"),
    (lambda c: _write(_token(c), b"", 0o600), "admin.token_file: "),
    (lambda c: _write(_key(c), b"k" * 32, 0o640),
     "keys.master_key_file: {key} is readable by group or others (mode 0640)"),
    (lambda c: _write(_key(c), b"", 0o600),
     "keys.master_key_file: {key} must hold exactly 32 bytes (has 0)"),
    (lambda c: _write(_key(c), b"k" * 31, 0o600),
     "keys.master_key_file: {key} must hold exactly 32 bytes (has 31)"),
    # a rotation's next key is read by the start too
    (lambda c: _write(_key(c) + ".next", b"k" * 33, 0o600),
     "keys.master_key_file: {key}.next must hold exactly 32 bytes (has 33)"),
    (lambda c: __import__("os").makedirs(c["audit"]["path"]),
     "audit.path: cannot open {audit}: Is a directory"),
], ids=["token-mode", "token-empty", "key-mode", "key-empty", "key-short", "key-next-long",
        "audit-folder"])
def test_check_refuses_what_the_start_refuses_in_token_key_and_audit_files(factory, files,
                                                                            message):
    """--check had passed these and the start then refused them: both refuse now, with the
    same message (the same functions check them)."""
    e = factory.make()
    files(e.config)
    message = message.format(token=_token(e.config), key=_key(e.config),
                             audit=e.config["audit"]["path"])
    r = e.check()
    assert r.returncode != 0, "--check accepted it"
    assert message in r.stderr, r.stderr
    err = _start_refused(e)
    assert message in err, err


def test_check_accepts_the_files_a_start_made(factory):
    """Token, key and audit file as a start leaves them (and none yet: test_check_writes_no_file)
    pass --check; the audit file is not written by it."""
    import os
    e = factory.start()
    assert e.stop() == 0
    audit = e.config["audit"]["path"]
    before = os.stat(audit)
    r = e.check()
    assert r.returncode == 0, r.stderr
    after = os.stat(audit)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


# ---------------------------------------------------------------------------------------------
# files that are not regular files, unreadable paths, and an unopenable audit.path on reload
# (a read-only review of config loading, 2026-12-07)

def _fifo(path: str) -> str:
    import os
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.mkfifo(path, 0o600)
    return path


@pytest.mark.parametrize("where, key", [
    (lambda c, d: c["runs"][0]["pins"][0].__setitem__("secret_file", _fifo(f"{d}/fifo-secret")),
     "runs[0].pins[0].secret_file"),
    (lambda c, d: c["runs"][0].__setitem__("token_file", _fifo(f"{d}/fifo-token")),
     "runs[0].token_file"),
    (lambda c, d: c["upstream"].__setitem__("ca_file", _fifo(f"{d}/fifo-ca.pem")),
     "upstream.ca_file"),
], ids=["secret_file", "token_file", "ca_file"])
def test_a_fifo_where_a_file_is_read_is_refused_not_waited_on(factory, where, key):
    """A FIFO (a named pipe nobody writes) at a secret, token or CA path: open(2) blocked until
    a writer came, so --check hung, and a reload hung the control thread (no later reload, no
    sweep, a SIGTERM that did not end the process). Refused at once now, naming the key."""
    e = factory.make()
    where(e.config, e.workdir)
    r = e.check()  # bounded: check() times out after 30 s
    assert r.returncode != 0, r.stderr
    assert key in r.stderr and "not a regular file" in r.stderr, r.stderr


def test_a_fifo_secret_on_reload_is_refused_and_reloads_go_on(factory):
    e = factory.start()
    fifo = _fifo(f"{e.workdir}/fifo-secret")
    e.rewrite_config(lambda c: c["runs"][0]["pins"][0].__setitem__("secret_file", fifo))
    e.reload("reload refused")
    assert "not a regular file" in e.last_line("reload refused"), e.last_line("reload refused")
    e.rewrite_config(lambda c: None)  # the file as it is: the FIFO still named
    e.reload("reload refused")  # the control thread still answers SIGHUP


def test_a_secret_path_that_cannot_be_looked_at_is_an_error_not_missing(factory):
    """A secret_file whose path cannot be resolved (a symlink loop here; for a non-root
    process also a folder it may not search) was reported as not existing, and --check
    passed with the pin disabled: the message sent the operator the wrong way."""
    import os
    e = factory.make()
    loop = os.path.join(e.workdir, "loop")
    os.makedirs(e.workdir, exist_ok=True)
    os.symlink(loop, loop)
    e.config["runs"][0]["pins"][0]["secret_file"] = os.path.join(loop, "token")
    r = e.check()
    assert r.returncode != 0, r.stderr
    assert "runs[0].pins[0].secret_file" in r.stderr and "does not exist" not in r.stderr, \
        r.stderr


def test_a_reload_to_an_audit_path_that_cannot_be_opened_is_refused(factory, world):
    """audit.path changed to a folder by a reload: the reload was applied (logged as
    reloaded), records kept going to the old file, and each later rotation (SIGHUP after
    logrotate moved the file) tried the folder again: no new audit file, records lost with the
    moved one. Now the reload is refused and rotation goes on."""
    import os
    e = factory.start()
    folder = os.path.join(e.workdir, "audit-folder")
    os.makedirs(folder)
    e.rewrite_config(lambda c: c["audit"].__setitem__("path", folder))
    e.reload("reload refused")
    assert "audit.path" in e.last_line("reload refused"), e.last_line("reload refused")
    # logrotate: move the file away, SIGHUP; the configured path is recreated
    os.rename(e.audit_path, e.audit_path + ".1")
    e.reload("reload refused")  # the file still names the folder: refused again
    assert os.path.exists(e.audit_path), "rotation did not reopen the audit file in effect"
    c, r = helpers.proxy_connect(e.proxy_port, f"tunnel.test:{world.U}", world.auth())
    c.close()
    assert r.status == 200
    e.wait_audit(lambda a: a.get("host") == "tunnel.test")
