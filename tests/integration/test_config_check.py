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
