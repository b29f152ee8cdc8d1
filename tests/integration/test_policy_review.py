"""Policy review fixes, end to end: a pin without a port covers `allowed_ports` only (as the
destination decision does), and an X-Egress-* header named in Connection is still refused."""
from __future__ import annotations

import helpers
from clients import run_ca
from upstream import Upstream


def _pin(world, host, secret, inject):
    return {"host": host, "secret_file": world.secret_files[secret], "inject": inject}


def _sent(seen, name: str) -> int:
    """How many `name` headers the upstream got (a count: never a secret in test output)."""
    return len(seen.header(name))


# ---------------------------------------------------------------------------------------------
# a pin without a port never injects on a port outside allowed_ports


def test_portless_pin_leaves_a_port_it_does_not_cover_to_the_pin_naming_it(world, factory,
                                                                           marker):
    other = Upstream(world.pki.server_cert, world.pki.server_key)  # a port not in allowed_ports
    P = other.port
    try:
        def mutate(cfg):
            assert P not in cfg["policy"]["allowed_ports"]
            pins = cfg["runs"][0]["pins"]
            pins.insert(0, _pin(world, "other.test", "api_token", {"type": "bearer"}))
            pins.append(_pin(world, f"other.test:{P}", "hdr_key",
                             {"type": "header", "name": "x-api-key", "template": "{secret}"}))
        e = factory.start(mutate)
        ca = run_ca(e, "r1")

        t = helpers.tunnel(e.proxy_port, "other.test", P, world.auth(), ca)
        r = helpers.request(t, "GET", f"/echo/{marker}-own", f"other.test:{P}")
        t.close()
        assert r.status == 200, (r.status, r.egress_reason)
        seen = other.find(f"{marker}-own")
        assert len(seen) == 1
        assert _sent(seen[0], "authorization") == 0, "the portless pin injected on port P"
        key_ok = seen[0].header("x-api-key") == [world.secrets["hdr_key"]]
        assert key_ok, "the pin naming port P did not inject its key"
        rec = e.wait_audit(lambda a: f"{marker}-own" in (a.get("path") or ""))[-1]
        assert rec["secret"] == "hdr_key", rec

        # On an allowed port the portless pin still applies.
        t = helpers.tunnel(e.proxy_port, "other.test", world.U, world.auth(), ca)
        r = helpers.request(t, "GET", f"/echo/{marker}-allowed", f"other.test:{world.U}")
        t.close()
        assert r.status == 200, (r.status, r.egress_reason)
        seen = world.upstream.find(f"{marker}-allowed")
        assert len(seen) == 1
        auth_ok = seen[0].header("authorization") == [f"Bearer {world.secrets['api_token']}"]
        assert auth_ok, "the portless pin did not inject on an allowed port"
    finally:
        other.close()


def test_portless_pin_does_not_inject_on_an_allowed_unpinned_port(world, factory, marker):
    other = Upstream(world.pki.server_cert, world.pki.server_key)
    P = other.port
    try:
        def mutate(cfg):
            assert P not in cfg["policy"]["allowed_ports"]
            cfg["runs"][0]["allow_hosts"].append(f"other.test:{P}")
            cfg["runs"][0]["pins"].insert(
                0, _pin(world, "other.test", "api_token", {"type": "bearer"}))
        e = factory.start(mutate, unpinned="intercept")
        t = helpers.tunnel(e.proxy_port, "other.test", P, world.auth(), run_ca(e, "r1"))
        r = helpers.request(t, "GET", f"/echo/{marker}", f"other.test:{P}")
        t.close()
        assert r.status == 200, (r.status, r.egress_reason)
        seen = other.find(marker)
        assert len(seen) == 1
        assert _sent(seen[0], "authorization") == 0, "a credential went to an unpinned port"
        rec = e.wait_audit(lambda a: marker in (a.get("path") or ""))[-1]
        assert rec["pin"] is None and rec["secret"] is None, rec
    finally:
        other.close()


# ---------------------------------------------------------------------------------------------
# X-Egress-* is refused even when a Connection token names it


def test_forged_egress_header_named_in_connection_is_refused(world, egressd, marker):
    t = helpers.tunnel(egressd.proxy_port, "api.test", world.U, world.auth(), run_ca(egressd, "r1"))
    r = helpers.request(t, "GET", f"/echo/{marker}", f"api.test:{world.U}",
                        headers=[("Connection", "X-Egress-Run"), ("X-Egress-Run", "forged")])
    t.close()
    assert (r.status, r.egress_reason) == (403, "forged_egress_header")
    assert world.upstream.find(marker) == []
    egressd.wait_audit(lambda a: a.get("reason") == "forged_egress_header"
                       and marker in (a.get("path") or ""))
