"""A `_method` field in a POST's body (Rails, Laravel, Symfony, Spring, ASP.NET Core act on it
instead of the request line's method) must stay within a method-limited pin's methods, as the
`_method` query parameter and the override headers must: such a body is read whole (at most
limits.method_body_bytes) and refused 403 no_matching_pin before anything of it leaves."""
from __future__ import annotations

import hashlib
import json

import pytest

import helpers
from clients import run_ca
from h2_helpers import H2Client, header

LIMIT = 4096  # limits.method_body_bytes here

BOUNDARY = "b0undary"
BODIES = {
    "form": ("application/x-www-form-urlencoded", b"title=x&_method=DELETE"),
    "multipart": (f"multipart/form-data; boundary={BOUNDARY}",
                  (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"title\"\r\n\r\nx\r\n"
                   f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"_method\"\r\n\r\n"
                   f"DELETE\r\n--{BOUNDARY}--\r\n").encode()),
    "json": ("application/json", b'{"title": "x", "_method": "DELETE"}'),
}


@pytest.fixture(scope="module")
def e(world, factory):
    def mutate(cfg):
        cfg["runs"][0]["pins"].append(
            {"host": f"other.test:{world.U}", "secret_file": world.secret_files["api_token"],
             "inject": {"type": "bearer"}, "methods": ["GET", "POST"]})
        cfg["limits"]["method_body_bytes"] = LIMIT
    return factory.start(mutate)


def h1_post(e, world, host, path, ctype, body):
    t = helpers.tunnel(e.proxy_port, host, world.U, world.auth(), run_ca(e, "r1"))
    try:
        return helpers.request(t, "POST", path, f"{host}:{world.U}",
                               [("Content-Type", ctype)], body)
    finally:
        t.close()


def h2_post(e, world, host, path, ctype, body, length=True):
    c = H2Client(e, world, host, world.U)
    try:
        extra = [("content-type", ctype)] + ([("content-length", str(len(body)))] if length else [])
        r = c.request(path, "POST", extra=extra, body=body)
        return r["status"], header(r, "x-egress-reason"), r["body"]
    finally:
        c.close()


def denied(e, marker, status, reason):
    recs = e.wait_audit(lambda a: marker in (a.get("path") or "") and a.get("decision") == "deny")
    assert len(recs) == 1, recs
    assert recs[0]["status"] == status and recs[0]["reason"] == reason, recs[0]
    return recs[0]


@pytest.mark.parametrize("kind", sorted(BODIES))
def test_h1_a_method_field_the_pin_does_not_allow_is_refused(world, e, marker, kind):
    ctype, body = BODIES[kind]
    r = h1_post(e, world, "other.test", f"/echo/{marker}", ctype, body)
    assert (r.status, r.egress_reason) == (403, "no_matching_pin"), r.body[:200]
    assert world.upstream.find(marker) == []
    rec = denied(e, marker, 403, "no_matching_pin")
    assert rec["pin"] is None and rec["secret"] is None, rec


@pytest.mark.parametrize("kind", sorted(BODIES))
def test_h2_a_method_field_the_pin_does_not_allow_is_refused(world, e, marker, kind):
    ctype, body = BODIES[kind]
    status, reason, _ = h2_post(e, world, "other.test", f"/echo/{marker}", ctype, body)
    assert (status, reason) == (403, "no_matching_pin")
    assert world.upstream.find(marker) == []
    denied(e, marker, 403, "no_matching_pin")


@pytest.mark.parametrize("proto", ["h1", "h2"])
def test_a_post_without_a_refused_method_field_arrives_byte_identical(world, e, marker, proto):
    bodies = [("application/x-www-form-urlencoded", b"title=x&_method=GET&n=100%25"),
              ("application/json", json.dumps({"_method": "POST", "pad": "y" * 3000}).encode()),
              (f"multipart/form-data; boundary={BOUNDARY}",
               BODIES["multipart"][1].replace(b"name=\"_method\"", b"name=\"other\""))]
    for i, (ctype, body) in enumerate(bodies):
        path = f"/echo/{marker}-{i}"
        if proto == "h1":
            r = h1_post(e, world, "other.test", path, ctype, body)
            status, got = r.status, r.body
        else:
            status, _, got = h2_post(e, world, "other.test", path, ctype, body)
        assert status == 200, (i, got[:200])
        echo = json.loads(got)
        assert echo["method"] == "POST"
        assert (echo["body_length"], echo["body_sha256"]) == \
            (len(body), hashlib.sha256(body).hexdigest()), i
        [seen] = world.upstream.find(f"{marker}-{i}")
        assert seen.header("Authorization") == [f"Bearer {world.secrets['api_token']}"], i


def test_a_body_over_the_bound_is_refused_not_forwarded_unchecked(world, e, marker):
    body = b"title=" + b"x" * LIMIT + b"&_method=DELETE"
    ctype = "application/x-www-form-urlencoded"
    r = h1_post(e, world, "other.test", f"/echo/{marker}-h1", ctype, body)
    assert (r.status, r.egress_reason) == (413, "body_too_large_to_check")
    # no content-length: found while it is read
    status, reason, _ = h2_post(e, world, "other.test", f"/echo/{marker}-h2", ctype, body,
                                length=False)
    assert (status, reason) == (413, "body_too_large_to_check")
    assert world.upstream.find(marker) == []
    denied(e, f"{marker}-h1", 413, "body_too_large_to_check")
    denied(e, f"{marker}-h2", 413, "body_too_large_to_check")


def test_a_pin_without_a_methods_limit_is_untouched(world, e, marker):
    ctype, body = BODIES["form"]
    big = body + b"&pad=" + b"z" * (2 * LIMIT)  # over the bound: nothing is read whole
    r = h1_post(e, world, "api.test", f"/echo/{marker}", ctype, big)
    assert r.status == 200, (r.status, r.egress_reason)
    assert json.loads(r.body)["body_sha256"] == hashlib.sha256(big).hexdigest()


BYPASS_PART = (b"Content-Disposition: form-data; name=\"_method\"\r\n\r\nDELETE\r\n")
# Each as a server reads it: the media type ends at ',' (Rack, PHP); an empty Content-Type is
# none (Rack: a form); "/json" anywhere is JSON (Laravel); PHP skips a key's leading spaces
# (Rack the spaces after '&'); PHP splits under the first "boundary" then '=' ("xboundary=")
# and keeps a space after the '='.
READINGS = [
    ("comma", "application/x-www-form-urlencoded, text/plain", b"title=x&_method=DELETE"),
    ("empty", "", b"title=x&_method=DELETE"),
    ("json_param", "text/plain; x=/json", b'{"title": "x", "_method": "DELETE"}'),
    ("lead_plus", "application/x-www-form-urlencoded", b"title=x&+_method=DELETE"),
    ("lead_pct20", "application/x-www-form-urlencoded", b"title=x&%20_method=DELETE"),
    ("lead_spaces", "application/x-www-form-urlencoded", b"title=x&  _method=DELETE"),
    ("mp_xboundary", "multipart/form-data; xboundary=foo; boundary=bar",
     b"--foo\r\n" + BYPASS_PART + b"--foo--\r\n"),
    ("mp_space", "multipart/form-data; boundary= foo",
     b"-- foo\r\n" + BYPASS_PART + b"-- foo--\r\n"),
    ("mp_name_space", "multipart/form-data; boundary=foo",
     b"--foo\r\n" + BYPASS_PART.replace(b"\"_method\"", b"\" _method\"") + b"--foo--\r\n"),
    # part headers as PHP, Rack and ASP.NET Core read them (folded, single-quoted, Content-ID,
    # an encoded word); JSON PHP parses and Boost does not; a form in UTF-16
    ("mp_folded", "multipart/form-data; boundary=foo",
     b"--foo\r\nContent-Disposition: form-data;\r\n name=\"_method\"\r\n\r\nDELETE\r\n"
     b"--foo--\r\n"),
    ("mp_single_quote", "multipart/form-data; boundary=foo",
     b"--foo\r\nContent-Disposition: form-data; name='_method'\r\n\r\nDELETE\r\n--foo--\r\n"),
    ("mp_content_id", "multipart/form-data; boundary=foo",
     b"--foo\r\nContent-ID: _method\r\n\r\nDELETE\r\n--foo--\r\n"),
    ("mp_encoded_word", "multipart/form-data; boundary=foo",
     b"--foo\r\nContent-Disposition: form-data; name=\"=?utf-8?B?X21ldGhvZA==?=\"\r\n\r\n"
     b"DELETE\r\n--foo--\r\n"),
    ("json_inf", "application/json", b'{"n": 1e9999999999, "_method": "DELETE"}'),
    ("form_utf16", "application/x-www-form-urlencoded; charset=utf-16le",
     "_method=DELETE".encode("utf-16-le")),
]


@pytest.mark.parametrize("name,ctype,body", READINGS, ids=[c[0] for c in READINGS])
def test_h1_each_servers_reading_of_the_body_is_checked(world, e, marker, name, ctype, body):
    r = h1_post(e, world, "other.test", f"/echo/{marker}", ctype, body)
    assert (r.status, r.egress_reason) == (403, "no_matching_pin"), (name, r.status)
    assert world.upstream.find(marker) == []
    denied(e, marker, 403, "no_matching_pin")
