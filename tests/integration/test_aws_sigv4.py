"""The aws-sigv4 injection: egressd signs each intercepted request to an AWS pin with Signature
Version 4 (the pin's secret is the secret access key), replacing whatever the sandbox's SDK
signed with its dummy credentials. The upstream (aws_upstream.py) verifies every signature as
AWS does, with botocore's signer as the independent implementation, and serves a tiny S3 and
DynamoDB. Real clients: boto3 (dummy credentials) and curl over HTTP/1.1 and HTTP/2.

Pins of run r1 (module fixture `e`):
  s3.test:GOOD   service s3        the upstream expects the pin's secret
  ddb.test:GOOD  service dynamodb  the upstream expects the pin's secret
  s3.test:WRONG  service s3        that upstream expects ANOTHER secret (proves the verifier)
  ddb.test:WRONG service dynamodb  ditto
"""
from __future__ import annotations

import base64
import calendar
import gzip
import hashlib
import json
import os
import subprocess
import time
import urllib.parse
from dataclasses import dataclass, field

import boto3
import botocore.config
import h2.exceptions
import pytest
from botocore.exceptions import ClientError

import helpers
from aws_upstream import AwsSeen, AwsUpstream, Expect
from clients import proxy_env, run_ca
from h2_helpers import H2Client

AKID = "AKIAEGRESSTEST000001"
REGION = "us-east-1"
DUMMY_AKID = "AKIDSANDBOXDUMMY"
DUMMY_SECRET = "sandbox-dummy-secret"
SECRET_NAME = "aws_secret"


_REDACT: list[str] = [DUMMY_SECRET]  # the aws fixture adds the real secret


def show(*xs) -> str:
    """A failure message's text for xs, with every secret we know of taken out (pytest prints
    it; a response, a record or a header could hold a secret if egressd were broken)."""
    text = " ".join(x if isinstance(x, str) else repr(x) for x in xs)
    for i, sec in enumerate(_REDACT):
        for form in (sec, urllib.parse.quote(sec, safe=""), json.dumps(sec)[1:-1]):
            text = text.replace(form, f"[SECRET {i}]")
    return text


def aws_like_secret() -> str:
    """40 characters of the secret access key alphabet, with a '/' and a '+' in it."""
    s = list(base64.b64encode(os.urandom(30)).decode())
    s[7], s[23] = "/", "+"
    return "".join(s)


@dataclass
class Aws:
    secret: str = field(repr=False)  # pytest prints a failing test's arguments
    secret_file: str
    good: AwsUpstream   # expects the pin's secret
    wrong: AwsUpstream  # expects another secret for the same names


@pytest.fixture(scope="module")
def aws(world):
    secret = aws_like_secret()
    sf = os.path.join(world.tmp, "secrets", SECRET_NAME)
    with open(sf, "w") as f:
        f.write(secret)
    os.chmod(sf, 0o600)
    _REDACT.append(secret)
    other = aws_like_secret()
    good = AwsUpstream(world.pki.server_cert, world.pki.server_key, {
        "s3.test": Expect(AKID, secret, REGION, "s3"),
        "ddb.test": Expect(AKID, secret, REGION, "dynamodb")})
    wrong = AwsUpstream(world.pki.server_cert, world.pki.server_key, {
        "s3.test": Expect(AKID, other, REGION, "s3"),
        "ddb.test": Expect(AKID, other, REGION, "dynamodb")})
    yield Aws(secret, sf, good, wrong)
    good.close()
    wrong.close()


def aws_pins(aws: Aws, limits: dict | None = None):
    """The config mutator: the four aws-sigv4 pins of run r1, names and ports allowed."""
    def mutate(cfg):
        r1 = next(r for r in cfg["runs"] if r["id"] == "r1")
        for up in (aws.good, aws.wrong):
            for host, service in (("s3.test", "s3"), ("ddb.test", "dynamodb")):
                r1["pins"].append({
                    "host": f"{host}:{up.port}", "secret_file": aws.secret_file,
                    "inject": {"type": "aws-sigv4", "access_key_id": AKID, "region": REGION,
                               "service": service}})
            cfg["policy"]["allowed_ports"].append(up.port)
        for host in ("s3.test", "ddb.test"):
            cfg["resolver"]["overrides"][host] = ["127.0.0.1"]
        cfg["limits"].update(limits or {})
    return mutate


def start(factory, aws: Aws, limits: dict | None = None):
    """An egressd with the AWS pins. The secret is added to the ones its leaks() looks for
    (the factory's finish() checks that none is in anything egressd wrote); not to the world's
    own dict, whose repr pytest prints when a test fails."""
    e = factory.start(aws_pins(aws, limits))
    e.secrets = {**e.secrets, SECRET_NAME: aws.secret}
    return e


@pytest.fixture(scope="module")
def e(factory, aws):
    return start(factory, aws)


# ---------------------------------------------------------------------------------------------
# clients and checks


def boto(world, e, service: str, host: str, port: int):
    """A boto3 client as a sandbox has one: dummy credentials, egressd as its HTTPS proxy,
    egressd's run CA trusted."""
    cfg = botocore.config.Config(
        proxies={"https": e.proxy_url("r1", world.tokens["r1"])},
        s3={"addressing_style": "path"}, retries={"max_attempts": 1},
        connect_timeout=10, read_timeout=30)
    return boto3.session.Session().client(
        service, endpoint_url=f"https://{host}:{port}", region_name=REGION,
        aws_access_key_id=DUMMY_AKID, aws_secret_access_key=DUMMY_SECRET,
        config=cfg, verify=run_ca(e, "r1"))


@dataclass
class CurlResult:
    rc: int
    status: int
    version: str
    headers: dict[str, str]  # lowercase name -> last value
    body: bytes
    stderr: str

    @property
    def reason(self) -> str | None:
        return self.headers.get("x-egress-reason")


def curl(world, e, url: str, http2: bool, *args: str, data: bytes | None = None,
         timeout: int = 60) -> CurlResult:
    """curl through egressd (HTTPS_PROXY, the run CA); `data` is POSTed from stdin as is."""
    cmd = ["curl", "-sS", "--http2" if http2 else "--http1.1", "--max-time", str(timeout),
           "--cacert", run_ca(e, "r1"), "--suppress-connect-headers", "-i",
           "-w", "\n%{http_code} %{http_version}", *args]
    if data is not None:
        cmd += ["--data-binary", "@-"]
    r = subprocess.run([*cmd, url], input=data, env=proxy_env(e, "r1", world.tokens["r1"]),
                       capture_output=True, timeout=timeout + 10)
    out, _, tail = r.stdout.rpartition(b"\n")
    code, _, version = tail.decode().partition(" ")
    # Interim (1xx) heads first, then the final head and the body.
    head, body = b"", out
    for _ in range(10):
        head, _, body = body.partition(b"\r\n\r\n")
        first = head.split(b"\r\n", 1)[0].split(b" ")
        if len(first) < 2 or not first[1].startswith(b"1"):
            break
    headers = {}
    for line in head.decode("latin-1").split("\r\n")[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return CurlResult(r.returncode, int(code) if code.isdigit() else 0, version, headers, body,
                      r.stderr.decode(errors="replace"))


def h2_call(world, e, host: str, port: int, method: str, path: str, headers=(),
            body: bytes | None = None) -> CurlResult:
    """One request on a raw HTTP/2 stream (python3-h2) through egressd, the body sent while
    the answer may already be coming (an early refusal: a complete answer, then RST_STREAM
    NO_ERROR, RFC 9113 8.1; curl 7.88 reports such a stream as error 92 and loses the
    answer, hence this client for refusals of requests with a body)."""
    c = H2Client(e, world, host, port)
    try:
        extra = list(headers) + ([("content-length", str(len(body)))] if body is not None else [])
        sid = c.headers(path, method, extra, end_stream=body is None)
        r = c.responses[sid]
        left = memoryview(body or b"")
        while left and r["reset"] is None and not r["ended"]:
            n = min(len(left), c.conn.local_flow_control_window(sid),
                    c.conn.max_outbound_frame_size)
            if n <= 0:
                c.pump(until=lambda: (c.conn.local_flow_control_window(sid) > 0
                                      or r["reset"] is not None or r["ended"]), timeout=10)
                if c.closed:
                    break
                continue
            try:
                c.conn.send_data(sid, bytes(left[:n]), end_stream=(n == len(left)))
            except h2.exceptions.StreamClosedError:
                break
            left = left[n:]
            c.flush()
        c.pump(until=lambda: r["ended"] or r["reset"] is not None, timeout=10)
    finally:
        c.close()
    hdrs = {k.lower(): v for k, v in r["headers"]}
    ok = r["ended"] and r["reset"] in (None, 0)  # complete, then at most RST_STREAM(NO_ERROR)
    return CurlResult(0 if ok else 1, r["status"] or 0, "2", hdrs, r["body"],
                      f"reset={r['reset']} ended={r['ended']}")


def assert_signed_by_egressd(seen: AwsSeen, aws: Aws, service: str):
    """The upstream verified the request as AWS would, signed with the pin's credential, and
    nothing of the sandbox's dummy credentials (nor the real secret itself) reached it."""
    # (booleans and names only in the asserts: pytest prints an assert's operands, and a
    # header value could hold a secret)
    ok = seen.verified
    assert ok, "upstream did not verify the signature:\n" + show(seen.explain())
    v = seen.verdict
    scope = (v.akid, v.region, v.service)
    assert scope == (AKID, REGION, service), show(seen.explain())
    counts = (len(seen.header("authorization")), len(seen.header("x-amz-date")))
    assert counts == (1, 1), counts
    for what, needle in (("the sandbox's dummy access key id", DUMMY_AKID),
                         ("the sandbox's dummy secret", DUMMY_SECRET),
                         ("the secret access key itself", aws.secret)):
        where = [k for k, val in seen.headers if needle in val]
        assert not where, f"{what} reached the upstream in {where}"
    tokens = len(seen.header("x-amz-security-token"))
    assert tokens == 0, "a client's x-amz-security-token reached the upstream"
    # x-amz-date is egressd's own "now" (the verifier allows 5 minutes, this is tighter)
    t = calendar.timegm(time.strptime(seen.header("x-amz-date")[0], "%Y%m%dT%H%M%SZ"))
    assert abs(time.time() - t) < 60, seen.header("x-amz-date")


def new_since(up: AwsUpstream, n0: int, host: str | None = None) -> list[AwsSeen]:
    return [s for s in up.requests[n0:] if host is None or s.host == host]


def bucket_name() -> str:
    return "bkt-" + os.urandom(4).hex()


# ---------------------------------------------------------------------------------------------
# S3 with boto3


KEY = "dir/ä b+c.txt"


def test_s3_put_and_get_of_a_key_that_needs_encoding(world, e, aws):
    bucket = bucket_name()
    body = os.urandom(3000) + "ä+/ ".encode()
    s3 = boto(world, e, "s3", "s3.test", aws.good.port)
    s3.put_object(Bucket=bucket, Key=KEY, Body=body, ContentType="text/plain; charset=utf-8",
                  Metadata={"note": "x y"})
    got = s3.get_object(Bucket=bucket, Key=KEY)
    assert got["Body"].read() == body
    assert got["ContentType"] == "text/plain; charset=utf-8"
    # the upstream stored it under the decoded key: the path reached it as the client sent it
    assert aws.good.object(bucket, KEY) == body

    seen = aws.good.find(f"/{bucket}/")
    assert [s.method for s in seen] == ["PUT", "GET"], [(s.method, s.path) for s in seen]
    put, get = seen
    assert put.path == f"/{bucket}/dir/%C3%A4%20b%2Bc.txt", put.path
    for s in seen:
        assert_signed_by_egressd(s, aws, "s3")
        assert s.header("x-amz-content-sha256"), "S3 needs x-amz-content-sha256"
    # what egressd signs: host, content-md5, content-type, every x-amz-* (botocore sends
    # Content-MD5 and x-amz-meta-note with a PutObject)
    signed = put.verdict.signed_headers
    for h in ("host", "content-md5", "content-type", "x-amz-content-sha256", "x-amz-date",
              "x-amz-meta-note"):
        assert h in signed, f"{h} not signed: {signed}"
    assert "user-agent" not in signed and "content-length" not in signed, signed
    assert put.body_len == len(body)
    # the payload hash signed is the client's x-amz-content-sha256 (boto3: UNSIGNED-PAYLOAD
    # over https with a Content-MD5; a GET: the empty body's hash)
    assert put.verdict.payload_hash == put.header("x-amz-content-sha256")[0]
    assert get.verdict.payload_hash == hashlib.sha256(b"").hexdigest()


def test_s3_list_objects_v2_with_a_prefix_that_needs_encoding(world, e, aws):
    bucket = bucket_name()
    s3 = boto(world, e, "s3", "s3.test", aws.good.port)
    for k in (KEY, "dir/ä b/z.txt", "dir/other.txt", "top.txt"):
        s3.put_object(Bucket=bucket, Key=k, Body=k.encode())
    n0 = len(aws.good.requests)
    r = s3.list_objects_v2(Bucket=bucket, Prefix="dir/ä b")
    assert sorted(c["Key"] for c in r["Contents"]) == sorted([KEY, "dir/ä b/z.txt"])
    assert r["Prefix"] == "dir/ä b"
    [ls] = new_since(aws.good, n0)
    assert_signed_by_egressd(ls, aws, "s3")
    # the query reached the upstream encoded, and the verifier's canonical query (every
    # parameter decoded and re-encoded, sorted) is what egressd signed
    assert "prefix=dir%2F%C3%A4%20b" in ls.path, show(ls.path)
    cq = ls.verdict.canonical_request.split("\n")[2]
    assert cq == "encoding-type=url&list-type=2&prefix=dir%2F%C3%A4%20b", cq


# ---------------------------------------------------------------------------------------------
# DynamoDB with boto3: egressd hashes the body (botocore sends no x-amz-content-sha256)


def test_dynamodb_list_tables_and_put_item(world, e, aws):
    ddb = boto(world, e, "dynamodb", "ddb.test", aws.good.port)
    n0 = len(aws.good.requests)
    names = ddb.list_tables()["TableNames"]
    assert "egress-table-a" in names
    item = {"pk": {"S": "ä b+c/" + os.urandom(8).hex()}, "n": {"N": "42"}}
    ddb.put_item(TableName="egress-items", Item=item)
    seen = new_since(aws.good, n0, "ddb.test")
    assert [s.header("x-amz-target") for s in seen] == [["DynamoDB_20120810.ListTables"],
                                                        ["DynamoDB_20120810.PutItem"]]
    for s in seen:
        assert_signed_by_egressd(s, aws, "dynamodb")
        assert s.header("x-amz-content-sha256") == [], \
            "egressd must not add x-amz-content-sha256 for a service other than S3"
        assert {"host", "x-amz-date", "x-amz-target", "content-type"} <= \
            set(s.verdict.signed_headers), s.verdict.signed_headers
        # the verifier hashed the body it received (no header): egressd signed that hash
        assert s.verdict.payload_hash == s.body_sha256
    assert seen[1].body_len > 0 and seen[1].body_sha256 != hashlib.sha256(b"").hexdigest()
    assert ("egress-items", item) in aws.good.server.items
    assert "egress-items" in ddb.list_tables()["TableNames"]


# ---------------------------------------------------------------------------------------------
# HTTP/2 clients (curl --http2): egressd signs what it forwards over HTTP/1.1


def test_http2_get_of_an_s3_object(world, e, aws):
    bucket = bucket_name()
    body = os.urandom(5000)
    boto(world, e, "s3", "s3.test", aws.good.port).put_object(Bucket=bucket, Key=KEY, Body=body)
    url = f"https://s3.test:{aws.good.port}/{bucket}/dir/%C3%A4%20b%2Bc.txt"
    r = curl(world, e, url, True)
    assert (r.rc, r.status, r.version) == (0, 200, "2"), show(r.rc, r.status, r.version, r.stderr)
    assert r.body == body
    [get] = [s for s in aws.good.find(f"/{bucket}/") if s.method == "GET"]
    assert_signed_by_egressd(get, aws, "s3")
    # a request without x-amz-content-sha256 and without a body: the empty body's hash, and
    # the header added (S3 requires it on every signed request)
    assert get.verdict.payload_hash == hashlib.sha256(b"").hexdigest()
    assert get.header("x-amz-content-sha256") == [hashlib.sha256(b"").hexdigest()]


def test_http2_post_of_100_kib_to_dynamodb(world, e, aws, tmp_path):
    doc = {"TableName": "egress-big", "Item": {"pk": {"S": "k"}, "blob": {"S": "x" * 102400}}}
    payload = json.dumps(doc).encode()
    f = tmp_path / "item.json"
    f.write_bytes(payload)
    n0 = len(aws.good.requests)
    url = f"https://ddb.test:{aws.good.port}/"
    r = curl(world, e, url, True, "-H", "X-Amz-Target: DynamoDB_20120810.PutItem",
             "-H", "Content-Type: application/x-amz-json-1.0", "--data-binary", f"@{f}")
    assert (r.rc, r.status, r.version) == (0, 200, "2"), show(r.rc, r.status, r.body[:300], r.stderr)
    [s] = new_since(aws.good, n0, "ddb.test")
    assert_signed_by_egressd(s, aws, "dynamodb")
    assert s.body_len == len(payload)
    assert s.verdict.payload_hash == hashlib.sha256(payload).hexdigest()
    assert s.header("x-amz-content-sha256") == []


# ---------------------------------------------------------------------------------------------
# canonical URI and query of requests botocore did not encode (curl sends the path as given)


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_s3_canonical_uri_is_the_path_as_sent(world, e, aws, http2):
    """Reserved characters raw, lowercase hex: S3's canonical URI is the path as the client
    sent it (as botocore computes it from the URL it sends); the path is forwarded as sent."""
    bucket = bucket_name()
    raw = f"/{bucket}/it's!(a)*~%c3%a4%20b%2b.txt"
    body = os.urandom(100)
    put = curl(world, e, f"https://s3.test:{aws.good.port}{raw}", http2, "-X", "PUT",
               "-H", "Content-Type: application/octet-stream", data=body)
    assert (put.rc, put.status) == (0, 200), show(put.status, put.body[:300], put.stderr)
    [s] = aws.good.find(f"/{bucket}/")
    assert s.path == raw, "egressd must forward the path as the client sent it"
    assert_signed_by_egressd(s, aws, "s3")
    assert s.verdict.canonical_request.split("\n")[1] == raw, s.verdict.canonical_request
    assert aws.good.object(bucket, "it's!(a)*~ä b+.txt") == body


# raw path tail -> the canonical URI AWS (botocore's SigV4Auth) computes for a service other
# than S3: the path as received, dot segments and empty segments removed, encoded once more
OTHER_SERVICE_PATHS = {
    "canonical": ("a%20b/%C3%A4-_.~", "a%2520b/%25C3%25A4-_.~"),
    "lowercase-hex": ("%c3%a4", "%25c3%25a4"),
    "reserved-raw": ("a!b'(c)*+=,;@$:&", "a%21b%27%28c%29%2A%2B%3D%2C%3B%40%24%3A%26"),
    "encoded-unreserved": ("a%7Eb%41", "a%257Eb%2541"),
    "encoded-slash": ("a%2Fb", "a%252Fb"),
    "dot-segments": ("a//b/./c/../d", "a/b/d"),
}


@pytest.mark.parametrize("case", OTHER_SERVICE_PATHS)
def test_other_services_canonical_uri_is_the_path_encoded_again(world, e, aws, case):
    raw_tail, canonical_tail = OTHER_SERVICE_PATHS[case]
    tag = "p-" + os.urandom(3).hex()
    n0 = len(aws.good.requests)
    r = curl(world, e, f"https://ddb.test:{aws.good.port}/{tag}/{raw_tail}", False,
             "--path-as-is")
    [d] = new_since(aws.good, n0, "ddb.test")
    assert d.path == f"/{tag}/{raw_tail}", "egressd must forward the path as the client sent it"
    cr = d.verdict.canonical_request
    assert cr is not None, show(d.explain())
    assert cr.split("\n")[1] == f"/{tag}/{canonical_tail}", cr  # the verifier's own reading
    assert_signed_by_egressd(d, aws, "dynamodb")
    # (the fake DynamoDB serves POST / only: a verified request elsewhere is its 400)
    assert r.status == 400 and b"UnknownOperationException" in r.body, show(r.status, r.body[:300])


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
@pytest.mark.parametrize("host", ["s3.test", "ddb.test"])
def test_canonical_query_string_as_aws_computes_it(world, e, aws, host, http2):
    """A query botocore would have encoded differently: the pairs as sent, sorted by name then
    value; a name without '=' has ''."""
    tag = "q-" + os.urandom(3).hex()
    query = "b=x!y&a=%c3%a4&z&a=0&k=a+b&x=%7E~&c=,;:@$&B=1&e=b=c&s=%2F/"
    n0 = len(aws.good.requests)
    curl(world, e, f"https://{host}:{aws.good.port}/{bucket_name()}/{tag}?{query}", http2)
    [d] = new_since(aws.good, n0, host.split(":")[0])
    assert d.path.endswith("?" + query), d.path
    assert_signed_by_egressd(d, aws, "s3" if host == "s3.test" else "dynamodb")
    assert d.verdict.canonical_request.split("\n")[2] == (
        "B=1&a=%c3%a4&a=0&b=x!y&c=,;:@$&e=b=c&k=a+b&s=%2F/&x=%7E~&z="), \
        d.verdict.canonical_request


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_the_sandbox_aws_headers_are_replaced(world, e, aws, http2):
    """A client's own Authorization, x-amz-date and x-amz-security-token never reach AWS;
    a Range and the client's x-amz-* headers are signed."""
    bucket = bucket_name()
    boto(world, e, "s3", "s3.test", aws.good.port).put_object(Bucket=bucket, Key="k",
                                                              Body=b"0123456789abcdef")
    fake = (f"AWS4-HMAC-SHA256 Credential={DUMMY_AKID}/20200101/{REGION}/s3/aws4_request, "
            f"SignedHeaders=host;x-amz-date, Signature={'0' * 64}")
    r = curl(world, e, f"https://s3.test:{aws.good.port}/{bucket}/k", http2,
             "-H", f"Authorization: {fake}", "-H", "X-Amz-Date: 20200101T000000Z",
             "-H", "X-Amz-Security-Token: sandbox-session-token",
             "-H", "X-Amz-Request-Payer: requester", "-H", "Range: bytes=0-3")
    assert (r.rc, r.status) == (0, 200), show(r.rc, r.status, r.body[:300], r.stderr)
    [get] = [s for s in aws.good.find(f"/{bucket}/") if s.method == "GET"]
    assert_signed_by_egressd(get, aws, "s3")
    token_seen = any("sandbox-session-token" in v for _, v in get.headers)
    assert not token_seen, "the client's x-amz-security-token reached the upstream"
    assert get.header("x-amz-date")[0] != "20200101T000000Z"
    assert {"range", "x-amz-request-payer"} <= set(get.verdict.signed_headers), \
        get.verdict.signed_headers


# ---------------------------------------------------------------------------------------------
# the verifier can fail


def test_an_upstream_expecting_another_secret_refuses_the_signature(world, e, aws):
    n0 = len(aws.wrong.requests)
    s3 = boto(world, e, "s3", "s3.test", aws.wrong.port)
    with pytest.raises(ClientError) as ex:
        s3.put_object(Bucket=bucket_name(), Key=KEY, Body=b"never stored")
    err = ex.value.response
    assert err["ResponseMetadata"]["HTTPStatusCode"] == 403, show(str(err))
    assert err["Error"]["Code"] == "SignatureDoesNotMatch", show(str(err))
    ddb = boto(world, e, "dynamodb", "ddb.test", aws.wrong.port)
    with pytest.raises(ClientError) as ex:
        ddb.list_tables()
    assert ex.value.response["Error"]["Code"] == "InvalidSignatureException"
    seen = new_since(aws.wrong, n0)
    assert len(seen) == 2
    for s in seen:
        # signed by egressd (its access key id, right scope), with a key the upstream rejects
        refused = not s.verified and s.verdict.code == "SignatureDoesNotMatch"
        assert refused, show(s.explain())
        assert s.verdict.akid == AKID
    assert not aws.wrong.server.objects


# ---------------------------------------------------------------------------------------------
# limits.sign_body_bytes


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_sign_body_bytes_limits_what_egressd_reads_to_hash(world, factory, aws, http2, marker):
    e2 = start(factory, aws, {"sign_body_bytes": 1024})
    hdrs = [("x-amz-target", "DynamoDB_20120810.PutItem"),
            ("content-type", "application/x-amz-json-1.0")]

    def item(total: int) -> bytes:
        doc = {"TableName": "egress-lim", "Item": {"pk": {"S": ""}}}
        doc["Item"]["pk"]["S"] = "y" * (total - len(json.dumps(doc)))
        b = json.dumps(doc).encode()
        assert len(b) == total
        return b

    def post(tag: str, body: bytes) -> CurlResult:
        if http2:  # a raw stream: curl 7.88 loses an early answer on HTTP/2 (see h2_call)
            return h2_call(world, e2, "ddb.test", aws.good.port, "POST", f"/?m={tag}", hdrs,
                           body)
        args = [x for k, v in hdrs for x in ("-H", f"{k}: {v}")]
        return curl(world, e2, f"https://ddb.test:{aws.good.port}/?m={tag}", False, *args,
                    data=body)

    n0 = len(aws.good.requests)
    big = post(f"{marker}-big", item(2048))
    assert (big.rc, big.status, big.reason) == (0, 413, "body_too_large_to_sign"), \
        show(big.status, big.headers, big.body[:300], big.stderr)
    assert aws.good.find(f"{marker}-big") == [], "a body too large to sign must not be forwarded"
    small = post(f"{marker}-small", item(512))
    assert (small.rc, small.status) == (0, 200), show(small.status, small.headers, small.body[:300])
    [s] = aws.good.find(f"{marker}-small")
    assert_signed_by_egressd(s, aws, "dynamodb")
    assert s.body_len == 512 and s.verdict.payload_hash == s.body_sha256
    # S3 bodies are never read to be hashed: a 2 KiB PUT without x-amz-content-sha256 is signed
    # UNSIGNED-PAYLOAD, the header added
    bucket = bucket_name()
    put = curl(world, e2, f"https://s3.test:{aws.good.port}/{bucket}/big", http2,
               "-X", "PUT", data=os.urandom(2048))
    assert put.status == 200, show(put.status, put.headers, put.body[:300], put.stderr)
    [p] = aws.good.find(f"/{bucket}/big")
    assert_signed_by_egressd(p, aws, "s3")
    assert p.header("x-amz-content-sha256") == ["UNSIGNED-PAYLOAD"]
    assert p.verdict.payload_hash == "UNSIGNED-PAYLOAD" and p.body_len == 2048
    assert len(new_since(aws.good, n0)) == 2
    [rec] = e2.wait_audit(lambda a: a.get("host") == "ddb.test" and a.get("status") == 413)
    assert rec["reason"] == "body_too_large_to_sign" and rec["decision"] == "deny", show(rec)
    assert rec["run"] == "r1" and rec["method"] == "POST"
    assert rec["proto_in"] == ("h2" if http2 else "http/1.1"), show(rec)


def test_a_body_declared_too_large_to_sign_is_refused_before_100_continue(world, factory, aws):
    """An HTTP/1.1 client that waits for 100 Continue before its body gets the 413 instead: it
    is never asked to send a body that would only be refused."""
    e2 = start(factory, aws, {"sign_body_bytes": 1024})
    c = helpers.tunnel(e2.proxy_port, "ddb.test", aws.good.port, world.auth("r1"), run_ca(e2, "r1"))
    try:
        c.send((f"POST /?m=expect HTTP/1.1\r\nHost: ddb.test:{aws.good.port}\r\n"
                "X-Amz-Target: DynamoDB_20120810.PutItem\r\n"
                "Content-Type: application/x-amz-json-1.0\r\n"
                "Content-Length: 2048\r\nExpect: 100-continue\r\n\r\n").encode())
        r = helpers.read_response(c)
    finally:
        c.close()
    assert (r.status, r.egress_reason) == (413, "body_too_large_to_sign"), (r.status, r.egress_reason)
    assert aws.good.find("m=expect") == []


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
@pytest.mark.parametrize("spelling", ["upper", "trailing-dot"])
def test_the_signed_host_is_the_host_sent(world, e, aws, http2, spelling, marker):
    """Host agreement admits any spelling of the target; egressd sends its own, and signs that
    one (it signed the client's spelling: SignatureDoesNotMatch)."""
    host = {"upper": "S3.TEST", "trailing-dot": "s3.test."}[spelling]
    bucket = bucket_name()
    r = curl(world, e, f"https://s3.test:{aws.good.port}/{bucket}/k?m={marker}", http2,
             "-X", "PUT", "-H", f"Host: {host}:{aws.good.port}", data=b"abc")
    assert (r.rc, r.status) == (0, 200), show(r.status, r.body[:300], r.stderr)
    [seen] = aws.good.find(marker)
    assert seen.verified and seen.host == "s3.test", show(seen.explain())


def test_a_copy_source_outside_a_path_limited_s3_pin_is_refused(world, factory, aws, marker):
    """CopyObject reads the object x-amz-copy-source names with the pin's key: a pin limited
    to /allowed/ must not copy /secret/data in."""
    def mutate(cfg):
        aws_pins(aws)(cfg)
        r1 = next(r for r in cfg["runs"] if r["id"] == "r1")
        for p in r1["pins"]:
            if p["host"] == f"s3.test:{aws.good.port}":
                p["path_prefixes"] = ["/allowed/"]
    e2 = factory.start(mutate)
    e2.secrets = {**e2.secrets, SECRET_NAME: aws.secret}
    url = f"https://s3.test:{aws.good.port}/allowed/copy?m={marker}"
    for source in ("/secret/data", "secret/data?versionId=1", "%2Fsecret%2Fdata",
                   "/allowed/%2e%2e/secret/data"):
        r = curl(world, e2, url, False, "-X", "PUT", "-H", f"x-amz-copy-source: {source}")
        assert (r.status, r.reason) == (403, "no_matching_pin"), show(source, r.status, r.body[:200])
    assert aws.good.find(marker) == []
    r = curl(world, e2, url + "-in", False, "-X", "PUT", "-H", "x-amz-copy-source: /allowed/src")
    assert r.status == 200, show(r.status, r.body[:300])
    [seen] = aws.good.find(marker + "-in")
    assert seen.verified and "x-amz-copy-source" in seen.verdict.signed_headers


# ---------------------------------------------------------------------------------------------
# chunk-signed uploads (STREAMING-AWS4-HMAC-SHA256-PAYLOAD)


def aws_chunked(sizes: list[int]) -> tuple[bytes, bytes]:
    """An aws-chunked body as the AWS SDK for Java v1 sends a PutObject's (its chunks' signatures
    made with the sandbox's dummy key: any 64 hex digits, egressd makes them again), and the
    data it carries."""
    data = os.urandom(sum(sizes))
    out, pos = bytearray(), 0
    for n in [*sizes, 0]:
        out += b"%x;chunk-signature=%s\r\n" % (n, os.urandom(32).hex().encode())
        out += data[pos:pos + n] + b"\r\n"
        pos += n
    return bytes(out), data


def chunk_signed_args(decoded_length: int) -> list[str]:
    return ["-X", "PUT", "-H", "x-amz-content-sha256: STREAMING-AWS4-HMAC-SHA256-PAYLOAD",
            "-H", "Content-Encoding: aws-chunked", "-H", "Content-Type: application/octet-stream",
            "-H", f"x-amz-decoded-content-length: {decoded_length}"]


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_chunk_signed_upload_is_signed_again_chunk_by_chunk(world, e, aws, http2, marker):
    """The upstream checks the request's signature and every chunk's, chained from it, with the
    real key (aws_upstream.verify_chunks), and stores the data; boto3 reads it back."""
    body, data = aws_chunked([65536, 65536, 1000])
    bucket = bucket_name()
    r = curl(world, e, f"https://s3.test:{aws.good.port}/{bucket}/obj?m={marker}", http2,
             *chunk_signed_args(len(data)), data=body)
    assert (r.rc, r.status) == (0, 200), show(r.status, r.headers, r.body[:300], r.stderr)
    [seen] = aws.good.find(marker)
    assert seen.verified and seen.verdict.chunks == 4, show(seen.explain())
    assert seen.body_len == len(body)  # as long as sent: content-length stays true
    got = boto(world, e, "s3", "s3.test", aws.good.port).get_object(Bucket=bucket, Key="obj")
    same = got["Body"].read() == data
    assert same and "ContentEncoding" not in got


def test_chunk_signed_upload_to_the_wrong_key_fails_at_the_upstream(world, e, aws, marker):
    """The verifier can fail: the upstream that expects another key refuses."""
    body, data = aws_chunked([1000])
    r = curl(world, e, f"https://s3.test:{aws.wrong.port}/{bucket_name()}/obj?m={marker}", False,
             *chunk_signed_args(len(data)), data=body)
    assert r.status == 403 and b"SignatureDoesNotMatch" in r.body, show(r.status, r.body[:300])


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_malformed_or_too_large_chunks_are_refused(world, factory, aws, http2, marker):
    e2 = start(factory, aws, {"sign_body_bytes": 1024})
    url = f"https://s3.test:{aws.good.port}/{bucket_name()}/obj?m={marker}"
    # a chunk held whole to be signed, over limits.sign_body_bytes
    body, data = aws_chunked([2048])
    r = curl(world, e2, url, http2, *chunk_signed_args(len(data)), data=body)
    assert (r.status, r.reason) == (413, "body_too_large_to_sign"), show(r.status, r.body[:200])
    # not aws-chunked: a signature that is no signature, a chunk longer than its size, a chunk
    # under S3's 8 KiB minimum that is not the last with data
    for bad in (b"3;chunk-signature=abc\r\nxyz\r\n0;chunk-signature=abc\r\n\r\n",
                aws_chunked([10])[0].replace(b"a;", b"9;", 1), aws_chunked([5, 5])[0]):
        r = curl(world, e2, url, http2, *chunk_signed_args(10), data=bad)
        assert (r.status, r.reason) == (400, "bad_aws_chunk"), show(r.status, r.body[:200])
    assert aws.good.find(marker) == []  # no request with a body that broke reached it whole
    e2.wait_audit(lambda a: a.get("reason") == "bad_aws_chunk" and a["status"] == 400, count=3)


# ---------------------------------------------------------------------------------------------
# what egressd refuses to sign


REFUSALS = {  # case: (method, query added, x-amz-content-sha256 or None, status, reason)
    "chunk-signed-trailer": ("PUT", "", "STREAMING-AWS4-HMAC-SHA256-PAYLOAD-TRAILER", 400,
                             "aws_chunk_signing"),
    "chunk-signed-ecdsa": ("PUT", "", "STREAMING-AWS4-ECDSA-P256-SHA256-PAYLOAD-TRAILER", 400,
                           "aws_chunk_signing"),
    "bad-hash": ("PUT", "", "nonsense", 400, "bad_aws_payload_hash"),
    "short-hex": ("PUT", "", "ab" * 31, 400, "bad_aws_payload_hash"),
    "presigned-signature": ("GET", "&X-Amz-Signature=abc", None, 400, "aws_presigned_query"),
    "presigned-credential": ("GET", f"&X-Amz-Credential={DUMMY_AKID}%2F20200101%2F{REGION}"
                                    "%2Fs3%2Faws4_request", None, 400, "aws_presigned_query"),
}

# curl-h1: curl --http1.1, a PUT with its body; curl-h2: curl --http2, no body (a refusal from
# the head alone, nothing in flight); h2-body: a raw HTTP/2 stream whose body is in flight
# when the refusal comes.
REFUSAL_CLIENTS = ["curl-h1", "curl-h2", "h2-body"]


def refuse_request(world, e, aws, case: str, client: str, bucket: str, tag: str) -> CurlResult:
    method, query, sha, _, _ = REFUSALS[case]
    path = f"/{bucket}/obj?m={tag}{query}"
    if client == "h2-body":
        hdrs = [("x-amz-content-sha256", sha)] if sha else []
        return h2_call(world, e, "s3.test", aws.good.port, method, path, hdrs,
                       b"z" * 100 if method == "PUT" else None)
    args = ["-X", method] + (["-H", f"x-amz-content-sha256: {sha}"] if sha else [])
    data = b"z" * 100 if method == "PUT" and client == "curl-h1" else None
    return curl(world, e, f"https://s3.test:{aws.good.port}{path}", client == "curl-h2", *args,
                data=data)


@pytest.mark.parametrize("client", REFUSAL_CLIENTS)
@pytest.mark.parametrize("case", REFUSALS)
def test_refused_requests(world, e, aws, case, client, marker):
    _, _, _, status, reason = REFUSALS[case]
    bucket = bucket_name()
    r = refuse_request(world, e, aws, case, client, bucket, marker)
    assert (r.rc, r.status, r.reason) == (0, status, reason), \
        show(r.status, r.headers, r.body[:300], r.stderr)
    named = reason.encode() in r.body
    assert named, show(r.body[:300])
    assert aws.good.find(marker) == [], "a refused request must not reach the upstream"
    [rec] = e.wait_audit(lambda a: bucket in (a.get("path") or ""))
    assert (rec["status"], rec["reason"], rec["decision"]) == (status, reason, "deny"), show(rec)


# ---------------------------------------------------------------------------------------------
# audit and secrets


def test_audit_names_the_secret_and_says_injected(world, e, aws):
    bucket = bucket_name()
    boto(world, e, "s3", "s3.test", aws.good.port).put_object(Bucket=bucket, Key="a/b",
                                                              Body=b"audit")
    [rec] = e.wait_audit(lambda a: bucket in (a.get("path") or "") and a.get("method") == "PUT")
    assert rec["secret"] == SECRET_NAME, show(rec)
    assert rec["reason"] == "injected", show(rec)
    assert rec["decision"] == "allow" and rec["status"] == 200, show(rec)
    assert rec["host"] == "s3.test" and int(rec["port"]) == aws.good.port, show(rec)
    assert rec["pin"] is not None
    in_record = aws.secret in json.dumps(rec)
    assert not in_record, "the secret is in the audit record"


def test_no_secret_in_anything_egressd_wrote(world, factory, aws):
    """Signed requests, refused ones, an upstream that rejects the signature, a body too large
    to sign: the secret access key (nor its URL, JSON or base64 forms, nor the signing key's
    seed "AWS4" + secret) is in nothing egressd wrote, and never reaches a client."""
    e3 = start(factory, aws, {"sign_body_bytes": 1024})
    seen_by_client = []
    s3 = boto(world, e3, "s3", "s3.test", aws.good.port)
    bucket = bucket_name()
    s3.put_object(Bucket=bucket, Key=KEY, Body=b"leak check")
    seen_by_client.append(s3.get_object(Bucket=bucket, Key=KEY)["Body"].read())
    seen_by_client.append(json.dumps(s3.list_objects_v2(Bucket=bucket, Prefix="dir/"),
                                     default=str).encode())
    seen_by_client.append(json.dumps(
        boto(world, e3, "dynamodb", "ddb.test", aws.good.port).list_tables()).encode())
    with pytest.raises(ClientError) as ex:  # the upstream that expects another key
        boto(world, e3, "s3", "s3.test", aws.wrong.port).get_object(Bucket=bucket, Key="x")
    seen_by_client.append(json.dumps(ex.value.response, default=str).encode())
    for client in REFUSAL_CLIENTS:
        for case in ("chunk-signed-trailer", "bad-hash", "presigned-signature"):
            r = refuse_request(world, e3, aws, case, client, bucket, "leak")
            seen_by_client += [r.body, json.dumps(r.headers).encode()]
    big = b"{" + b" " * 4000 + b"}"
    hdrs = [("x-amz-target", "DynamoDB_20120810.ListTables")]
    for r in (curl(world, e3, f"https://ddb.test:{aws.good.port}/", False,
                   "-H", "x-amz-target: DynamoDB_20120810.ListTables", data=big),
              h2_call(world, e3, "ddb.test", aws.good.port, "POST", "/", hdrs, big)):
        seen_by_client += [r.body, json.dumps(r.headers).encode()]
    e3.wait_audit(lambda a: a.get("reason") == "body_too_large_to_sign", count=2)
    assert e3.stop() == 0
    s = aws.secret
    forms = [s.encode(), urllib.parse.quote(s, safe="").encode(),
             json.dumps(s)[1:-1].replace("/", "\\/").encode(), base64.b64encode(s.encode()),
             ("AWS4" + s).encode()]
    leaks = e3.leaks(forms)
    assert leaks == [], f"secret bytes found in files egressd wrote (file, form): {leaks}"
    leaked = [i for i, f in enumerate(forms) for b in seen_by_client if f in b]
    assert leaked == [], f"forms {sorted(set(leaked))} of the secret reached the client"


def test_an_s3_object_stored_gzip_encoded_comes_back_as_it_is(world, e, aws):
    """S3 answers an object's own Content-Encoding whatever the request accepted. A bearer pin
    must refuse such an answer (an echoed token inside gzip would pass the scrubber unseen);
    an aws-sigv4 pin sent no key to echo, so the body passes as it is, and the client's
    accept-encoding is not rewritten."""
    bucket = bucket_name()
    raw = os.urandom(3000)
    packed = gzip.compress(raw)
    s3 = boto(world, e, "s3", "s3.test", aws.good.port)
    s3.put_object(Bucket=bucket, Key="data.bin.gz", Body=packed, ContentEncoding="gzip")
    got = s3.get_object(Bucket=bucket, Key="data.bin.gz")
    assert got["ContentEncoding"] == "gzip"
    assert got["Body"].read() == packed
    [seen] = [s for s in aws.good.find(f"/{bucket}/data.bin.gz") if s.method == "GET"]
    assert_signed_by_egressd(seen, aws, "s3")
    # curl asking for gzip: the upstream sees the client's own accept-encoding (a bearer pin
    # would have rewritten it to identity), and the answer is relayed encoded, byte for byte.
    n0 = len(aws.good.requests)
    r = curl(world, e, f"https://s3.test:{aws.good.port}/{bucket}/data.bin.gz", False,
             "-H", "Accept-Encoding: gzip, br")
    assert (r.rc, r.status) == (0, 200), show(r.rc, r.status, r.stderr)
    assert r.headers.get("content-encoding") == "gzip" and r.body == packed
    [s2] = new_since(aws.good, n0, "s3.test")
    assert s2.header("accept-encoding") == ["gzip, br"], s2.header("accept-encoding")
    assert_signed_by_egressd(s2, aws, "s3")


# ---------------------------------------------------------------------------------------------
# temporary credentials: the secret is a credentials document with a session token


def credentials_document(akid: str, secret: str, token: str) -> str:
    """As `aws sts assume-role --query Credentials` prints it."""
    return json.dumps({"AccessKeyId": akid, "SecretAccessKey": secret, "SessionToken": token,
                       "Expiration": "2026-12-06T23:00:00+00:00"})


def test_temporary_credentials_rotate_as_one_secret(world, factory, aws):
    """A pin without access_key_id reads its secret as a credentials document: egressd signs
    with its AccessKeyId and SecretAccessKey and sends its SessionToken (signed); a new
    document in the same secret (SIGHUP) switches all three at once."""
    first = ("ASIAEGRESSTEMP000001", aws_like_secret(), "FwoGZXIvYXdz" + os.urandom(48).hex())
    second = ("ASIAEGRESSTEMP000002", aws_like_secret(), "FwoGZXIvYXdz" + os.urandom(48).hex())
    for _, key, token in (first, second):
        _REDACT.extend([key, token])
    role = AwsUpstream(world.pki.server_cert, world.pki.server_key, {
        "ddb.test": Expect(first[0], first[1], REGION, "dynamodb", session_token=first[2])})
    doc_file = os.path.join(world.tmp, "secrets", "aws_role")
    with open(doc_file, "w") as f:
        f.write(credentials_document(*first))
    os.chmod(doc_file, 0o600)

    def mutate(cfg):
        aws_pins(aws)(cfg)
        r1 = next(r for r in cfg["runs"] if r["id"] == "r1")
        r1["pins"].append({"host": f"ddb.test:{role.port}", "secret_file": doc_file,
                           "inject": {"type": "aws-sigv4", "region": REGION,
                                      "service": "dynamodb"}})
        cfg["policy"]["allowed_ports"].append(role.port)
    try:
        e2 = factory.start(mutate)
        e2.secrets = {**e2.secrets, SECRET_NAME: aws.secret, "role_key_1": first[1],
                      "role_token_1": first[2], "role_key_2": second[1],
                      "role_token_2": second[2]}
        ddb = boto(world, e2, "dynamodb", "ddb.test", role.port)
        assert "egress-table-a" in ddb.list_tables()["TableNames"]
        [s1] = role.requests
        assert s1.verified, "upstream did not verify:\n" + show(s1.explain())
        assert s1.verdict.akid == first[0]
        assert "x-amz-security-token" in s1.verdict.signed_headers
        # rotated: a new document in the same secret, then a reload
        with open(doc_file, "w") as f:
            f.write(credentials_document(*second))
        role.set_expect("ddb.test", Expect(second[0], second[1], REGION, "dynamodb",
                                           session_token=second[2]))
        e2.reload()
        assert "egress-table-a" in ddb.list_tables()["TableNames"]
        s2 = role.requests[-1]
        assert s2.verified, "upstream did not verify after the rotation:\n" + show(s2.explain())
        assert s2.verdict.akid == second[0]
        # a document that is not one: refused, named in the log without a value
        with open(doc_file, "w") as f:
            f.write(second[1])  # the bare key, without its id
        e2.reload()
        n0 = len(role.requests)
        with pytest.raises(ClientError) as err:
            ddb.list_tables()
        assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
        assert len(role.requests) == n0, "nothing may reach the upstream unsigned"
        log = e2.stderr_text()
        assert "credentials document: not JSON" in log and "aws_credentials_invalid" in log
        assert e2.leaks() == [], "a key or token in what egressd wrote"
    finally:
        role.close()
