"""A fake AWS endpoint for the aws-sigv4 integration tests: verifies Signature Version 4 the way
AWS does, with botocore's own signer as the independent implementation, then serves a tiny S3
and a tiny DynamoDB.

* ``AwsUpstream(cert, key, expect)``: a threaded HTTP/1.1 keep-alive TLS server on 127.0.0.1.
  ``expect`` maps a host name (the Host header without its port) to an ``Expect`` (access key
  id, secret access key, region, service): the credential a request for that host must be
  signed with. A test may give a host a WRONG secret to prove that the verifier can fail.
* ``verify(...)``: the verifier alone (no server), for a look at one request.

The verifier, for each request:
  1. parses ``Authorization: AWS4-HMAC-SHA256 Credential=AKID/DATE/REGION/SERVICE/aws4_request,
     SignedHeaders=a;b, Signature=HEX``; checks AKID, REGION, SERVICE against the host's Expect,
     DATE against x-amz-date, x-amz-date within 5 minutes of now; ``host`` and ``x-amz-date``
     and every ``x-amz-*`` header present must be signed (as S3 requires);
  2. for S3: x-amz-content-sha256 must be present (S3 answers MissingSecurityHeader without);
     a 64-hex value must be the body's SHA-256 (S3's XAmzContentSHA256Mismatch), for every
     service;
  3. rebuilds a ``botocore.awsrequest.AWSRequest`` (method, https://<Host><path>, the received
     header fields in order, the body) and asks ``botocore.auth.S3SigV4Auth`` (service s3) or
     ``botocore.auth.SigV4Auth`` (any other) for the canonical request, string to sign and
     signature with ``Credentials(AKID, expected secret)``, ``headers_to_sign`` overridden to
     sign exactly the SignedHeaders the request names, the received x-amz-date as timestamp.
     The URL is the request target as received, so botocore computes the canonical URI and
     query from the wire as it does for the requests it sends itself: S3's path as it is, any
     other service's with dot and empty segments removed and encoded once more, the query's
     pairs as sent, sorted;
  4. compares the signatures (constant time).
A request that fails gets 403 (400 for a body hash mismatch or a malformed header) with an
AWS-like error body (S3: XML ``<Error><Code>SignatureDoesNotMatch</Code>...``, with the
canonical request and string to sign as S3 gives them; others: JSON ``__type``
``...#InvalidSignatureException``) and the record says why. Nothing here ever writes a secret.

Every request is recorded as an ``AwsSeen`` (method, path, headers, body length and hash,
verified or not, why, the credential's fields, SignedHeaders, the canonical request botocore
computed). S3 (path style): ``PUT /bucket/key`` stores the body, ``GET``/``HEAD`` returns it,
``DELETE`` drops it, ``GET /bucket?list-type=2&prefix=P`` is ListObjectsV2 (XML, keys
url-encoded when ``encoding-type=url``, as boto3 asks). DynamoDB: ``POST /`` with
``X-Amz-Target: DynamoDB_20120810.ListTables`` answers ``{"TableNames": [...]}``, ``PutItem``
stores the item and answers ``{}``.
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
import http.server
import json
import re
import ssl
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field
from xml.sax.saxutils import escape as xml_escape

import botocore.auth
import botocore.awsrequest
import botocore.compat
import botocore.credentials

from upstream import TlsHttpServer

MAX_BODY = 16 << 20
MAX_SKEW_S = 300
SIGV4_TIMESTAMP = "%Y%m%dT%H%M%SZ"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_AUTH = re.compile(
    r"^AWS4-HMAC-SHA256 +Credential=([^,\s]+)\s*,\s*SignedHeaders=([^,\s]+)\s*,"
    r"\s*Signature=([0-9a-f]{64})$")


@dataclass
class Expect:
    access_key_id: str
    secret: str = field(repr=False)  # never printed
    region: str = "us-east-1"
    service: str = "s3"
    # temporary credentials: the x-amz-security-token every request must carry (and sign);
    # None: a long-term key, and a request with a token is refused
    session_token: str | None = field(default=None, repr=False)


@dataclass
class Verdict:
    ok: bool
    status: int = 200
    code: str = ""
    why: str = ""
    akid: str | None = None
    date: str | None = None
    region: str | None = None
    service: str | None = None
    signed_headers: list[str] = field(default_factory=list)
    # what botocore computed; out of the repr, as the received headers are (pytest prints the
    # arguments of a failing test's frames: a header a broken proxy filled with a secret
    # would be in it; explain() is for messages that take secrets out)
    canonical_request: str | None = field(default=None, repr=False)
    string_to_sign: str | None = field(default=None, repr=False)
    payload_hash: str | None = None
    # a chunk-signed upload's data, its aws-chunked encoding taken off (what S3 stores)
    decoded: bytes | None = field(default=None, repr=False)
    chunks: int = 0  # its chunks, the last (empty) one included


@dataclass
class AwsSeen:
    method: str
    path: str
    host: str
    headers: list[tuple[str, str]] = field(repr=False)
    body_len: int
    body_sha256: str
    verdict: Verdict

    @property
    def verified(self) -> bool:
        return self.verdict.ok

    def header(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name.lower()]

    def explain(self) -> str:
        """What a failure message may print: no secret is in any of it."""
        v = self.verdict
        return (f"{self.method} {self.path} host={self.host} verified={v.ok} status={v.status} "
                f"code={v.code} why={v.why}\nheaders={self.headers}\n"
                f"canonical request botocore computed:\n{v.canonical_request}\n"
                f"string to sign:\n{v.string_to_sign}")


def _fail(status: int, code: str, why: str, **kw) -> Verdict:
    return Verdict(False, status, code, why, **kw)


def decoded_query_params(raw_query: str) -> list[tuple[str, str]]:
    """Every query parameter decoded (a '+' is a '+', as AWS reads it); a parameter without
    '=' has the empty value. Raises UnicodeDecodeError on bytes that are not UTF-8."""
    out = []
    if not raw_query:
        return out
    for pair in raw_query.split("&"):
        k, _, v = pair.partition("=")
        out.append((urllib.parse.unquote_to_bytes(k).decode("utf-8"),
                    urllib.parse.unquote_to_bytes(v).decode("utf-8")))
    return out


def verify(method: str, raw_target: str, headers: list[tuple[str, str]], body: bytes,
           expect: dict[str, Expect], now: float | None = None) -> Verdict:
    """Verifies one request's SigV4 header signature as AWS would (see the module doc)."""
    def hget(name):
        return [v for k, v in headers if k.lower() == name]

    hosts = hget("host")
    if len(hosts) != 1:
        return _fail(400, "InvalidRequest", f"{len(hosts)} Host header fields")
    host_header = hosts[0].strip()
    host = host_header.rsplit(":", 1)[0].lower() if not host_header.startswith("[") else \
        host_header
    exp = expect.get(host)
    if exp is None:
        return _fail(403, "AccessDenied", f"no expected credential for host {host!r}")
    auths = hget("authorization")
    if len(auths) != 1:
        return _fail(403, "AccessDenied" if not auths else "InvalidRequest",
                     f"{len(auths)} Authorization header fields")
    m = _AUTH.match(auths[0].strip())
    if not m:
        return _fail(400, "AuthorizationHeaderMalformed",
                     f"Authorization is not AWS4-HMAC-SHA256 Credential=..., SignedHeaders=..., "
                     f"Signature=<64 hex>: {auths[0][:60]!r}...")
    cred, signed, their_sig = m.groups()
    parts = cred.split("/")
    if len(parts) != 5 or parts[4] != "aws4_request":
        return _fail(400, "AuthorizationHeaderMalformed", f"bad Credential scope {cred!r}")
    akid, cdate, region, service, _ = parts
    signed_list = signed.split(";")
    v = dict(akid=akid, date=cdate, region=region, service=service, signed_headers=signed_list)
    if akid != exp.access_key_id:
        return _fail(403, "InvalidAccessKeyId", f"access key id {akid!r} is not "
                     f"{exp.access_key_id!r}", **v)
    if region != exp.region:
        return _fail(400, "AuthorizationHeaderMalformed",
                     f"region {region!r} is wrong; expecting {exp.region!r}", **v)
    if service != exp.service:
        return _fail(400, "AuthorizationHeaderMalformed",
                     f"service {service!r} is wrong; expecting {exp.service!r}", **v)
    if signed_list != sorted(set(signed_list)) or any(s != s.lower() or not s
                                                       for s in signed_list):
        return _fail(400, "AuthorizationHeaderMalformed",
                     f"SignedHeaders {signed!r} not lowercase, sorted and unique", **v)
    dates = hget("x-amz-date")
    if len(dates) != 1:
        return _fail(403, "AccessDenied", f"{len(dates)} x-amz-date header fields", **v)
    amz_date = dates[0].strip()
    try:
        t = datetime.datetime.strptime(amz_date, SIGV4_TIMESTAMP).replace(
            tzinfo=datetime.timezone.utc).timestamp()
    except ValueError:
        return _fail(403, "AccessDenied", f"x-amz-date {amz_date!r} is not YYYYMMDDTHHMMSSZ", **v)
    now = time.time() if now is None else now
    if abs(now - t) > MAX_SKEW_S:
        return _fail(403, "RequestTimeTooSkewed",
                     f"x-amz-date {amz_date} is {int(now - t)} s from now", **v)
    if cdate != amz_date[:8]:
        return _fail(403, "SignatureDoesNotMatch",
                     f"Credential date {cdate} is not x-amz-date's {amz_date[:8]}", **v)
    present = {k.lower() for k, _ in headers}
    for need in ["host", "x-amz-date"] + sorted(n for n in present if n.startswith("x-amz-")):
        if need not in signed_list:
            return _fail(403, "AccessDenied",
                         f"header {need!r} is present but not in SignedHeaders {signed!r}", **v)
    for s in signed_list:
        if s not in present:
            return _fail(403, "SignatureDoesNotMatch",
                         f"signed header {s!r} is not in the request", **v)
    tokens = hget("x-amz-security-token")
    if exp.session_token is None and tokens:
        return _fail(403, "InvalidToken", "a session token came with a long-term key", **v)
    if exp.session_token is not None and (
            len(tokens) != 1 or not hmac.compare_digest(tokens[0].strip().encode(),
                                                        exp.session_token.encode())):
        return _fail(403, "InvalidToken", "the session token is missing or not the one of "
                     "this access key id", **v)
    sha = hget("x-amz-content-sha256")
    if len(sha) > 1:
        return _fail(400, "InvalidRequest", "several x-amz-content-sha256 fields", **v)
    if service == "s3" and not sha:
        return _fail(400, "MissingSecurityHeader",
                     "Your request was missing a required header: x-amz-content-sha256", **v)
    if sha:
        claimed = sha[0].strip()
        if claimed.startswith("STREAMING-AWS4-") and claimed != STREAMING_SIGNED:
            return _fail(400, "InvalidRequest", f"chunk-signed payload {claimed!r} reached "
                         "the upstream (its chunk signatures could not be right)", **v)
        if _HEX64.fullmatch(claimed):
            if hashlib.sha256(body).hexdigest() != claimed:
                return _fail(400, "XAmzContentSHA256Mismatch",
                             "x-amz-content-sha256 is not the SHA-256 of the body received", **v)
        elif claimed not in ("UNSIGNED-PAYLOAD", "STREAMING-UNSIGNED-PAYLOAD-TRAILER",
                             STREAMING_SIGNED):
            return _fail(400, "InvalidArgument",
                         f"x-amz-content-sha256 {claimed!r} is not a payload hash", **v)

    # The request as botocore would see it, then botocore's canonical request and signature.
    if raw_target.startswith(("http://", "https://")):
        return _fail(400, "InvalidRequest", f"absolute-form target {raw_target[:60]!r}", **v)
    req = botocore.awsrequest.AWSRequest(method=method, url=f"https://{host_header}{raw_target}",
                                         data=body)
    for k, val in headers:
        req.headers[k] = val  # appends: repeated fields kept, in order
    req.context["timestamp"] = amz_date
    creds = botocore.credentials.Credentials(exp.access_key_id, exp.secret)
    cls = botocore.auth.S3SigV4Auth if service == "s3" else botocore.auth.SigV4Auth
    signer = cls(creds, service, region)

    signed_set = set(signed_list)

    def headers_to_sign(request):
        hm = botocore.compat.HTTPHeaders()
        for k, val in request.headers.items():
            if k.lower() in signed_set:
                hm[k.lower()] = val
        return hm
    signer.headers_to_sign = headers_to_sign
    try:
        canonical = signer.canonical_request(req)
    except Exception as ex:  # noqa: BLE001 - a verifier answers, it does not crash
        return _fail(400, "InvalidRequest", f"botocore could not canonicalize: {type(ex).__name__}",
                     **v)
    sts = signer.string_to_sign(req, canonical)
    want = signer.signature(sts, req)
    v.update(canonical_request=canonical, string_to_sign=sts,
             payload_hash=canonical.rsplit("\n", 1)[1])
    if not hmac.compare_digest(want, their_sig):
        return _fail(403, "SignatureDoesNotMatch",
                     "The request signature we calculated does not match the signature you "
                     "provided. Check your key and signing method.", **v)
    if sha and sha[0].strip() == STREAMING_SIGNED:
        return verify_chunks(body, their_sig, amz_date, f"{cdate}/{region}/{service}/aws4_request",
                             exp.secret, hget("x-amz-decoded-content-length"), v)
    return Verdict(True, 200, "", "", **v)


STREAMING_SIGNED = "STREAMING-AWS4-HMAC-SHA256-PAYLOAD"
_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_CHUNK_HEAD = re.compile(rb"([0-9a-fA-F]{1,16});chunk-signature=([0-9a-f]{64})\r\n")


def verify_chunks(body: bytes, seed: str, amz_date: str, scope: str, secret: str,
                  decoded_lengths: list[str], v: dict) -> Verdict:
    """A chunk-signed upload's aws-chunked body, as S3 checks it: each chunk's signature is the
    HMAC, under the day's signing key, of "AWS4-HMAC-SHA256-PAYLOAD", the date, the scope, the
    previous signature (the request's, first), the empty string's hash and the chunk's hash;
    the last chunk is empty; the data is x-amz-decoded-content-length long. Written from the
    S3 API reference's description, apart from egressd's code and botocore (which has none)."""
    key = ("AWS4" + secret).encode()
    for part in scope.split("/"):  # the day, the region, the service, "aws4_request"
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    prev, pos, out, n = seed, 0, bytearray(), 0
    while True:
        m = _CHUNK_HEAD.match(body, pos)
        if not m:
            return _fail(400, "IncompleteBody", f"chunk {n}: no aws-chunked header at {pos}", **v)
        size = int(m.group(1), 16)
        data = body[m.end():m.end() + size]
        if len(data) != size or body[m.end() + size:m.end() + size + 2] != b"\r\n":
            return _fail(400, "IncompleteBody", f"chunk {n}: {size} bytes and CRLF expected", **v)
        sts = "\n".join(["AWS4-HMAC-SHA256-PAYLOAD", amz_date, scope, prev, _EMPTY_SHA256,
                         hashlib.sha256(data).hexdigest()])
        want = hmac.new(key, sts.encode(), hashlib.sha256).hexdigest()
        n += 1
        if not hmac.compare_digest(want, m.group(2).decode()):
            return _fail(403, "SignatureDoesNotMatch",
                         f"chunk {n - 1}'s signature does not chain from the previous one", **v)
        prev, pos = want, m.end() + size + 2
        out += data
        if size == 0:
            break
    if pos != len(body):
        return _fail(400, "IncompleteBody", f"{len(body) - pos} bytes after the last chunk", **v)
    if decoded_lengths != [str(len(out))]:
        return _fail(400, "IncompleteBody", f"x-amz-decoded-content-length {decoded_lengths} "
                     f"for {len(out)} bytes of data", **v)
    return Verdict(True, 200, "", "", decoded=bytes(out), chunks=n, **v)


# ---------------------------------------------------------------------------------------------
# the server


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "AmazonS3-fake"
    sys_version = ""

    def log_message(self, fmt, *args):
        pass

    def version_string(self):
        return self.server_version

    def _read_body(self) -> bytes:
        te = (self.headers.get("Transfer-Encoding") or "").lower()
        out = bytearray()
        if "chunked" in te:
            for _ in range(1_000_000):
                line = self.rfile.readline(1024)
                if not line:
                    raise ConnectionError("eof in chunk size")
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    for _ in range(1000):
                        if self.rfile.readline(65536) in (b"\r\n", b"\n", b""):
                            break
                    return bytes(out)
                if len(out) + size > MAX_BODY:
                    raise ValueError("body too large")
                out += self.rfile.read(size)
                self.rfile.readline(16)
            raise ValueError("too many chunks")
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            raise ValueError("body too large")
        while len(out) < n:
            b = self.rfile.read(min(n - len(out), 65536))
            if not b:
                raise ConnectionError("eof in body")
            out += b
        return bytes(out)

    def _send(self, status: int, body: bytes, ctype: str, extra=()):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("x-amz-request-id", uuid.uuid4().hex[:16].upper())
        for k, val in extra:
            self.send_header(k, val)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, service: str, status: int, code: str, message: str, verdict=None):
        if service == "s3" or service is None:
            body = ("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error>"
                    f"<Code>{xml_escape(code)}</Code><Message>{xml_escape(message)}</Message>")
            if verdict is not None and verdict.canonical_request is not None:
                body += (f"<CanonicalRequest>{xml_escape(verdict.canonical_request)}"
                         f"</CanonicalRequest><StringToSign>{xml_escape(verdict.string_to_sign)}"
                         "</StringToSign>")
            body += f"<RequestId>{uuid.uuid4().hex[:16].upper()}</RequestId></Error>"
            self._send(status, body.encode(), "application/xml")
        else:
            if code == "SignatureDoesNotMatch":
                code = "InvalidSignatureException"
            body = json.dumps({"__type": f"com.amazon.coral.service#{code}", "message": message})
            self._send(status, body.encode(), "application/x-amz-json-1.0")

    def _handle(self):
        try:
            body = self._read_body()
        except (ValueError, ConnectionError):
            self.close_connection = True
            return
        headers = [(k, val) for k, val in self.headers.items()]
        srv: _Server = self.server
        with srv.lock:
            expect = dict(srv.expect)
        verdict = verify(self.command, self.path, headers, body, expect)
        host = (self.headers.get("Host") or "").rsplit(":", 1)[0].lower()
        seen = AwsSeen(self.command, self.path, host, headers, len(body),
                       hashlib.sha256(body).hexdigest(), verdict)
        srv.record(seen)
        service = expect[host].service if host in expect else None
        if not verdict.ok:
            self._error(service, verdict.status, verdict.code, verdict.why, verdict)
            return
        if service == "s3":
            self._s3(body if verdict.decoded is None else verdict.decoded)
        elif service == "dynamodb":
            self._dynamodb(body)
        else:
            self._send(200, b"{}", "application/json")

    # -- S3, path style ---------------------------------------------------------------------
    def _s3(self, body: bytes):
        srv: _Server = self.server
        split = urllib.parse.urlsplit(self.path)
        q = dict(decoded_query_params(split.query))
        segs = split.path.lstrip("/").split("/", 1)
        bucket = urllib.parse.unquote(segs[0])
        key = urllib.parse.unquote(segs[1]) if len(segs) > 1 else ""
        if not bucket:
            return self._error("s3", 400, "NotImplemented", "ListBuckets is not implemented")
        if not key:
            if self.command == "PUT":
                return self._send(200, b"", "application/xml", [("Location", f"/{bucket}")])
            if self.command == "GET" and q.get("list-type") == "2":
                return self._list_v2(bucket, q)
            return self._error("s3", 400, "NotImplemented", "only ListObjectsV2 on a bucket")
        if self.command == "PUT":
            etag = '"' + hashlib.md5(body).hexdigest() + '"'
            with srv.lock:
                # S3 keeps the codings other than its own aws-chunked
                codings = [c.strip() for c in (self.headers.get("Content-Encoding") or "")
                           .split(",") if c.strip() and c.strip() != "aws-chunked"]
                srv.objects[(bucket, key)] = (body, self.headers.get("Content-Type")
                                              or "binary/octet-stream", etag,
                                              ", ".join(codings) or None)
            return self._send(200, b"", "application/xml", [("ETag", etag)])
        with srv.lock:
            obj = srv.objects.get((bucket, key))
        if self.command == "DELETE":
            with srv.lock:
                srv.objects.pop((bucket, key), None)
            return self._send(204, b"", "application/xml")
        if self.command in ("GET", "HEAD"):
            if obj is None:
                return self._error("s3", 404, "NoSuchKey", "The specified key does not exist.")
            data, ctype, etag, encoding = obj
            extra = [("ETag", etag), ("Last-Modified", "Mon, 01 Jan 2024 00:00:00 GMT")]
            if encoding:  # as S3 does: the object's Content-Encoding, whatever was accepted
                extra.append(("Content-Encoding", encoding))
            return self._send(200, data, ctype, extra)
        return self._error("s3", 405, "MethodNotAllowed", f"{self.command} on an object")

    def _list_v2(self, bucket: str, q: dict):
        srv: _Server = self.server
        prefix = q.get("prefix", "")
        url_enc = q.get("encoding-type") == "url"

        def enc(s: str) -> str:
            return xml_escape(urllib.parse.quote(s, safe="/") if url_enc else s)
        with srv.lock:
            items = sorted((k, v) for (b, k), v in srv.objects.items()
                           if b == bucket and k.startswith(prefix))
        x = ['<?xml version="1.0" encoding="UTF-8"?>\n'
             '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">',
             f"<Name>{xml_escape(bucket)}</Name><Prefix>{enc(prefix)}</Prefix>",
             f"<KeyCount>{len(items)}</KeyCount><MaxKeys>1000</MaxKeys>",
             "<IsTruncated>false</IsTruncated>"]
        if url_enc:
            x.append("<EncodingType>url</EncodingType>")
        for k, (data, _ctype, etag, _encoding) in items:
            x.append(f"<Contents><Key>{enc(k)}</Key>"
                     "<LastModified>2024-01-01T00:00:00.000Z</LastModified>"
                     f"<ETag>{xml_escape(etag)}</ETag><Size>{len(data)}</Size>"
                     "<StorageClass>STANDARD</StorageClass></Contents>")
        x.append("</ListBucketResult>")
        self._send(200, "".join(x).encode(), "application/xml")

    # -- DynamoDB -----------------------------------------------------------------------------
    def _dynamodb(self, body: bytes):
        srv: _Server = self.server
        target = self.headers.get("X-Amz-Target") or ""
        ctype = "application/x-amz-json-1.0"
        if self.command != "POST" or urllib.parse.urlsplit(self.path).path != "/":
            return self._error("dynamodb", 400, "UnknownOperationException", "POST / only")
        try:
            doc = json.loads(body or b"{}")
        except ValueError:
            return self._error("dynamodb", 400, "SerializationException", "body is not JSON")
        if target == "DynamoDB_20120810.ListTables":
            with srv.lock:
                names = sorted(set(srv.tables) | {t for t, _ in srv.items})
            return self._send(200, json.dumps({"TableNames": names}).encode(), ctype)
        if target == "DynamoDB_20120810.PutItem":
            if not isinstance(doc, dict) or "TableName" not in doc or "Item" not in doc:
                return self._error("dynamodb", 400, "ValidationException", "TableName, Item")
            with srv.lock:
                srv.items.append((doc["TableName"], doc["Item"]))
            return self._send(200, b"{}", ctype)
        return self._error("dynamodb", 400, "UnknownOperationException", f"target {target!r}")

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_PATCH = do_OPTIONS = _handle


class _Server(TlsHttpServer):
    request_queue_size = 64

    def __init__(self, addr, ctx: ssl.SSLContext, expect: dict[str, Expect]):
        self.ctx = ctx
        self.lock = threading.Lock()
        self.expect = expect
        self.seen: list[AwsSeen] = []
        # (bucket, key) -> (body, content type, etag, content encoding or None)
        self.objects: dict[tuple[str, str], tuple[bytes, str, str, str | None]] = {}
        self.tables: list[str] = ["egress-table-a", "egress-table-b"]
        self.items: list[tuple[str, dict]] = []
        super().__init__(addr, _Handler)

    def record(self, seen: AwsSeen):
        with self.lock:
            if len(self.seen) < 100_000:
                self.seen.append(seen)


class AwsUpstream:
    """The fake AWS endpoint (TLS, HTTP/1.1) on 127.0.0.1; see the module doc."""

    def __init__(self, cert: str, key: str, expect: dict[str, Expect]):
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        ctx.set_alpn_protocols(["http/1.1"])
        self.server = _Server(("127.0.0.1", 0), ctx, dict(expect))
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever,
                                       kwargs={"poll_interval": 0.1}, daemon=True)
        self.thread.start()

    def set_expect(self, host: str, exp: Expect):
        with self.server.lock:
            self.server.expect[host] = exp

    @property
    def requests(self) -> list[AwsSeen]:
        with self.server.lock:
            return list(self.server.seen)

    def find(self, marker: str) -> list[AwsSeen]:
        """Requests whose raw target (path and query) contains `marker`."""
        return [r for r in self.requests if marker in r.path]

    def object(self, bucket: str, key: str) -> bytes | None:
        with self.server.lock:
            o = self.server.objects.get((bucket, key))
        return o[0] if o else None

    def close(self):
        self.server.shutdown()
        self.server.server_close()
