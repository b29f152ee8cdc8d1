"""egress-bench against a loopback HTTPS origin and a loopback forward proxy (servers.py).

The binary comes from $EGRESS_BENCH_BIN (set by ctest), else build-bench/ or build/ in the repo.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import servers  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT = 60


def _find_binary() -> str | None:
    env = os.environ.get("EGRESS_BENCH_BIN")
    if env:
        return env
    for build in ("build-bench", "build"):
        p = REPO / build / "bench" / "egress-bench"
        if p.exists():
            return str(p)
    return None


BIN = _find_binary()
pytestmark = pytest.mark.skipif(BIN is None, reason="egress-bench not built")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return servers.make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def origin(pki):
    o = servers.Origin(pki)
    yield o
    o.stop()


@pytest.fixture
def plain_origin():
    o = servers.Origin(None)
    yield o
    o.stop()


@pytest.fixture
def proxy():
    p = servers.Proxy()
    yield p
    p.stop()


def bench(*args, expect=0):
    r = subprocess.run([BIN, *map(str, args)], capture_output=True, text=True,
                       timeout=RUN_TIMEOUT)
    assert r.returncode == expect, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


def bench_json(*args, expect=0) -> dict:
    return json.loads(bench("--json", *args, expect=expect).stdout)


def basic(userinfo: str) -> str:
    return "Basic " + base64.b64encode(userinfo.encode()).decode()


# --- counts, percentiles, JSON ---------------------------------------------------------------

def test_requests_exact_count_keepalive(origin, pki):
    out = bench_json("--cacert", pki["ca"], "--requests", 300, "--connections", 4, origin.url())
    assert out["requests"] == {"total": 300, "ok": 300, "errors": 0, "warmup": 0}
    assert len(origin.requests) == 300
    assert out["status"] == {"200": 300}
    assert out["connections_opened"] == 4 and origin.connections == 4
    assert out["alpn"] == {"http/1.1": 4}
    assert out["errors"] == {}
    assert out["bytes_received"] > out["body_bytes_received"] == 300 * 18
    assert out["rps"] > 0 and out["elapsed_s"] > 0


def test_percentiles_ordered_and_nonzero(origin, pki):
    out = bench_json("--cacert", pki["ca"], "--requests", 200, origin.url())
    lat = out["latency_us"]
    assert lat["count"] == 200
    assert 0 < lat["min"] <= lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["p99_9"] <= lat["max"]
    assert lat["min"] <= lat["mean"] <= lat["max"]
    conn = out["connect_latency_us"]
    assert conn["count"] == 1 and conn["p50"] > 0


def test_json_documented_fields(origin, pki):
    out = bench_json("--cacert", pki["ca"], "--requests", 5, origin.url())
    for key in ("target", "proxy", "protocol", "method", "connections", "streams", "threads",
                "new_connection", "rate", "elapsed_s", "warmup_s", "requests", "rps",
                "latency_us", "connect_latency_us", "errors", "error_samples", "status", "alpn",
                "connections_opened", "tls_handshakes", "tls_resumed", "bytes_received",
                "body_bytes_received", "bytes_sent"):
        assert key in out, key
    for key in ("count", "min", "mean", "p50", "p90", "p99", "p99_9", "max"):
        assert key in out["latency_us"], key
    assert out["protocol"] == "h1" and out["proxy"] is None and out["rate"] is None


def test_text_report(origin, pki):
    text = bench("--cacert", pki["ca"], "--requests", 20, origin.url()).stdout
    for needle in ("requests/s", "p50", "p90", "p99 ", "p99.9", "max", "status codes    200 20",
                   "protocols       http/1.1 1", "20 total, 20 ok, 0 errors"):
        assert needle in text, needle


def test_threads_and_sni_hostname(origin, pki):
    out = bench_json("--cacert", pki["ca"], "--requests", 100, "--connections", 4,
                     "--threads", 2, origin.url("/", host="localhost"))
    assert out["requests"]["ok"] == 100 and out["threads"] == 2
    assert "localhost" in origin.sni


def test_duration_bounds_the_run(origin, pki):
    out = bench_json("--cacert", pki["ca"], "--duration", "500ms", "--connections", 2,
                     origin.url())
    assert out["requests"]["ok"] > 0
    assert 0.45 <= out["elapsed_s"] < 5


def test_warmup_not_counted(origin, pki):
    out = bench_json("--cacert", pki["ca"], "--warmup", "200ms", "--requests", 50, origin.url())
    assert out["requests"]["total"] == 50
    assert out["requests"]["warmup"] > 0
    assert len(origin.requests) == 50 + out["requests"]["warmup"]
    assert out["warmup_s"] >= 0.2


def test_method_body_and_headers(origin, pki):
    out = bench_json("--cacert", pki["ca"], "--requests", 10, "--body-size", 100000,
                     "-H", "X-Bench: one", "-H", "X-Other:two", "--method", "PUT",
                     origin.url("/up"))
    assert out["requests"]["ok"] == 10
    assert out["bytes_sent"] > 10 * 100000
    assert len(origin.requests) == 10
    for method, path, headers, body_len in origin.requests:
        assert (method, path, body_len) == ("PUT", "/up", 100000)
        assert ("X-Bench", "one") in headers and ("X-Other", "two") in headers


def test_body_size_defaults_to_post(origin, pki):
    bench_json("--cacert", pki["ca"], "--requests", 3, "--body-size", 10, origin.url())
    assert [(m, n) for m, _, _, n in origin.requests] == [("POST", 10)] * 3


# --- errors by kind --------------------------------------------------------------------------

def test_status_5xx_counted_as_errors(origin, pki):
    out = bench_json("--cacert", pki["ca"], "--requests", 20, origin.url("/status/500"),
                     expect=1)
    assert out["requests"] == {"total": 20, "ok": 0, "errors": 20, "warmup": 0}
    assert out["errors"] == {"status_5xx": 20}
    assert out["status"] == {"500": 20}
    assert out["latency_us"]["count"] == 20  # responses still have a latency


def test_status_4xx(origin, pki):
    out = bench_json("--cacert", pki["ca"], "--requests", 7, origin.url("/status/404"), expect=1)
    assert out["errors"] == {"status_4xx": 7}


def test_closed_port_connect_errors(pki):
    s = servers.closed_port()
    try:
        out = bench_json("--cacert", pki["ca"], "--requests", 10, "--connections", 2,
                         f"https://127.0.0.1:{s.getsockname()[1]}/", expect=1)
    finally:
        s.close()
    assert out["requests"] == {"total": 10, "ok": 0, "errors": 10, "warmup": 0}
    assert out["errors"] == {"connect": 10}
    assert "refused" in out["error_samples"]["connect"].lower()


def test_timeout(pki):
    s = servers.silent_listener()
    try:
        out = bench_json("--cacert", pki["ca"], "--requests", 2, "--timeout", "200ms",
                         f"https://127.0.0.1:{s.getsockname()[1]}/", expect=1)
    finally:
        s.close()
    assert out["errors"] == {"timeout": 2}
    # Each timed-out request is a latency lower bound (it recorded none: a stall was hidden).
    assert out["latency_us"]["count"] == out["latency_us"]["lower_bounds"] == 2, out
    assert out["latency_us"]["min"] >= 200_000, out


def test_no_response_means_no_latency(pki):
    """A run that got no response has no latency: null in JSON, n/a in text (it had reported
    0 us for every percentile)."""
    s = servers.closed_port()
    url = f"https://127.0.0.1:{s.getsockname()[1]}/"
    try:
        out = bench_json("--cacert", pki["ca"], "--requests", 3, url, expect=1)
        text = bench("--cacert", pki["ca"], "--requests", 3, url, expect=1).stdout
    finally:
        s.close()
    for hist in ("latency_us", "connect_latency_us"):
        assert out[hist]["count"] == 0
        assert all(out[hist][k] is None
                   for k in ("min", "mean", "p50", "p90", "p99", "p99_9", "max")), out[hist]
    assert "latency (us)    n/a" in text and "p50 0" not in text, text


def test_untrusted_certificate_is_tls_error(origin):
    out = bench_json("--requests", 3, origin.url(), expect=1)  # system store: test CA unknown
    assert out["errors"] == {"tls": 3}
    assert "verify" in out["error_samples"]["tls"].lower()
    assert origin.requests == []


def test_insecure_skips_verification(origin):
    out = bench_json("--insecure", "--requests", 3, origin.url())
    assert out["requests"]["ok"] == 3


def test_hostname_mismatch_is_tls_error(origin, pki):
    p = servers.Proxy(resolve_to="127.0.0.1")
    try:
        out = bench_json("--cacert", pki["ca"], "--proxy", p.url(), "--requests", 2,
                         f"https://wrong.test:{origin.port}/", expect=1)
    finally:
        p.stop()
    assert out["errors"] == {"tls": 2}
    assert origin.requests == []


# --- through the proxy -----------------------------------------------------------------------

def test_proxy_connect_per_connection_with_auth(origin, pki, proxy):
    out = bench_json("--cacert", pki["ca"], "--proxy", proxy.url("alice:s3cr%3At"),
                     "--connections", 3, "--requests", 60, origin.url("/", host="localhost"))
    assert out["requests"]["ok"] == 60
    assert proxy.connects == 3
    assert proxy.auth_seen == [basic("alice:s3cr:t")] * 3
    assert all(line == f"CONNECT localhost:{origin.port} HTTP/1.1" for line in proxy.request_lines)
    assert len(origin.requests) == 60
    assert out["proxy"] == f"http://alice:***@127.0.0.1:{proxy.port}"


def test_proxy_user_shown_percent_encoded_so_json_stays_utf8(origin, pki, proxy):
    """A proxy user that percent-decodes to bytes that are not UTF-8 (%FF): the report shows it
    as written, so --json stays valid UTF-8 (the decoded byte had been copied into it), while
    Proxy-Authorization still carries the decoded user."""
    r = subprocess.run([BIN, "--json", "--cacert", pki["ca"], "--proxy",
                        proxy.url("%FFu%20x:pw"), "--requests", "2", origin.url()],
                       capture_output=True, timeout=RUN_TIMEOUT)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.decode("utf-8"))  # strict: raises on invalid UTF-8
    assert out["proxy"] == f"http://%FFu%20x:***@127.0.0.1:{proxy.port}"
    assert proxy.auth_seen == ["Basic " + base64.b64encode(b"\xffu x:pw").decode()]
    text = subprocess.run([BIN, "--cacert", pki["ca"], "--proxy", proxy.url("%FFu%20x:pw"),
                           "--requests", "1", origin.url()], capture_output=True,
                          timeout=RUN_TIMEOUT).stdout.decode("utf-8")
    assert f"http://%FFu%20x:***@127.0.0.1:{proxy.port} (CONNECT)" in text


def test_proxy_new_connection_per_request(origin, pki, proxy):
    out = bench_json("--cacert", pki["ca"], "--proxy", proxy.url("u:p"), "--new-connection",
                     "--connections", 2, "--requests", 25, origin.url("/", host="localhost"))
    assert out["requests"]["ok"] == 25
    assert proxy.connects == 25
    assert origin.connections == 25
    assert out["connections_opened"] == 25 and out["tls_handshakes"] == 25
    assert out["tls_resumed"] >= 1  # client session cache across connections
    assert out["alpn"] == {"http/1.1": 25}


def test_no_tls_resume(origin, pki):
    out = bench_json("--cacert", pki["ca"], "--new-connection", "--no-tls-resume",
                     "--requests", 5, origin.url())
    assert out["tls_handshakes"] == 5 and out["tls_resumed"] == 0


def test_proxy_status_errors(origin, pki):
    p = servers.Proxy(require_auth=basic("good:pw"), deny_hosts={"denied.test"})
    try:
        bad = bench_json("--cacert", pki["ca"], "--proxy", p.url("bad:pw"), "--requests", 4,
                         origin.url(), expect=1)
        denied = bench_json("--cacert", pki["ca"], "--proxy", p.url("good:pw"), "--requests", 3,
                            f"https://denied.test:{origin.port}/", expect=1)
    finally:
        p.stop()
    assert bad["errors"] == {"connect_407": 4}
    assert denied["errors"] == {"connect_403": 3}
    assert origin.requests == []


def test_http_through_proxy_uses_absolute_form(plain_origin, proxy):
    out = bench_json("--proxy", proxy.url("bob:pw"), "--requests", 12, "--connections", 2,
                     plain_origin.url("/p?q=1"))
    assert out["requests"]["ok"] == 12
    assert out["alpn"] == {"cleartext": 2}
    assert proxy.connects == 0
    assert proxy.request_lines == [f"GET http://127.0.0.1:{plain_origin.port}/p?q=1 HTTP/1.1"] * 12
    assert proxy.auth_seen == [basic("bob:pw")] * 12
    assert [p for _, p, _, _ in plain_origin.requests] == ["/p?q=1"] * 12


def test_http_direct_origin_form(plain_origin):
    out = bench_json("--requests", 5, plain_origin.url("/x"))
    assert out["requests"]["ok"] == 5
    assert [p for _, p, _, _ in plain_origin.requests] == ["/x"] * 5


# --- open loop -------------------------------------------------------------------------------

def test_rate_with_duration(origin, pki):
    out = bench_json("--cacert", pki["ca"], "--rate", 200, "--duration", "1s", "--connections", 4,
                     origin.url())
    total = out["requests"]["total"]
    assert 190 <= total <= 210, total
    assert out["requests"]["ok"] == total
    assert 100 <= out["rps"] <= 230  # the last response may land late on a busy machine
    assert out["rate"] == 200


def test_open_loop_rate_is_the_offered_rate_when_the_server_keeps_up(origin, pki):
    """n requests offered at R/s span n/R seconds: req/s is R when every answer comes in time
    (measured to the last completion alone it read n/(n-1) of R: 11.1 at --rate 10 for 1 s)."""
    out = bench_json("--cacert", pki["ca"], "--rate", 20, "--duration", "1s", origin.url())
    n = out["requests"]["total"]
    assert n == 20 and out["requests"]["ok"] == n, out["requests"]
    assert out["rps"] <= 20.0 + 1e-6 and out["elapsed_s"] >= 1.0 - 1e-6, out


def test_warmup_connections_are_not_counted(origin, pki):
    """--new-connection with a warmup: the connection figures cover the counted requests'
    connections only (warmup's had been counted too: 62 for 10 requests)."""
    out = bench_json("--cacert", pki["ca"], "--new-connection", "--warmup", "300ms",
                     "--requests", 10, origin.url())
    assert out["requests"]["total"] == 10 and out["requests"]["warmup"] > 0
    assert out["connections_opened"] == 10 and out["tls_handshakes"] == 10, out
    assert out["connect_latency_us"]["count"] == 10
    assert sum(out["alpn"].values()) == 10, out["alpn"]


def test_duration_bounds_an_open_loop_run_that_falls_behind(origin, pki):
    """--rate 100 for 1 s on one connection to a server that takes 50 ms: the client can send
    about 20 of the 100 requests due in the window. The run ends when the window does (it had
    sent all 100 late, lasting 5 s, plus 2.5 s for the warmup's 50), the requests due but not
    sent are counted as not_sent (JSON and text), and latency still counts from each request's
    due time."""
    origin.delay = 0.05
    started = time.monotonic()
    r = bench("--json", "--cacert", pki["ca"], "--rate", 100, "--duration", "1s", "--warmup",
              "500ms", origin.url())
    wall = time.monotonic() - started
    out = json.loads(r.stdout)
    n, not_sent = out["requests"]["total"], out["not_sent"]
    assert wall < 3.0, (wall, out["requests"], not_sent)
    assert n + not_sent == 100, (n, not_sent)
    assert 5 <= n <= 35 and out["requests"]["errors"] == 0, out["requests"]
    assert out["requests"]["warmup"] <= 15, out["requests"]  # late warmup requests dropped
    assert out["latency_us"]["max"] >= 500_000, out["latency_us"]  # from the due time
    assert out["elapsed_s"] < 1.6, out["elapsed_s"]
    text = bench("--cacert", pki["ca"], "--rate", 100, "--duration", "500ms",
                 origin.url()).stdout
    line = next(l for l in text.splitlines() if l.startswith("requests "))
    assert " not sent " in line, text


def test_open_loop_that_keeps_up_sends_everything(origin, pki):
    out = bench_json("--cacert", pki["ca"], "--rate", 100, "--duration", "500ms",
                     "--connections", 4, origin.url())
    assert out["not_sent"] == 0 and out["requests"]["total"] == 50, out


def test_rate_with_requests_is_exact(origin, pki):
    out = bench_json("--cacert", pki["ca"], "--rate", 500, "--requests", 40, "--warmup", "100ms",
                     "--connections", 2, origin.url())
    assert out["requests"]["total"] == 40
    assert out["requests"]["warmup"] == 50
    assert len(origin.requests) == 90


# --- compare ---------------------------------------------------------------------------------

def test_compare_text(origin, pki):
    r = bench("--cacert", pki["ca"], "--requests", 50, origin.url(),
              "--compare", "--connections 1", "--connections 2 -H 'X-Side: b'", "--pairs", 2)
    text = r.stdout
    assert "median A rps" in text and "median B rps" in text and "median B/A" in text
    rows = [l for l in text.splitlines() if l[:1].isdigit()]
    assert len(rows) == 2
    assert len(origin.requests) == 4 * 50
    sides = ["b" if ("X-Side", "b") in h else "a" for _, _, h, _ in origin.requests]
    assert sides == ["a"] * 50 + ["b"] * 50 + ["a"] * 50 + ["b"] * 50  # A B A B


def test_compare_json(origin, pki):
    out = json.loads(bench("--json", "--cacert", pki["ca"], "--requests", 30, origin.url(),
                           "--compare", "", "--connections 2", "--pairs", 3).stdout)
    assert out["pairs"] == 3
    assert len(out["a"]["runs"]) == len(out["b"]["runs"]) == 3
    assert len(out["ratios"]) == 3
    ratios = sorted(out["ratios"])
    assert out["median_ratio"] == pytest.approx(ratios[1])
    for side in ("a", "b"):
        rps = sorted(r["rps"] for r in out[side]["runs"])
        assert out[side]["median_rps"] == pytest.approx(rps[1])
        assert all(r["requests"] == 30 for r in out[side]["runs"])


def test_compare_checks_both_sides_before_the_first_run(origin, pki, tmp_path):
    """B cannot start (its --cacert is missing): nothing runs, exit 1 (A had run first)."""
    r = bench("--cacert", pki["ca"], "--requests", 5, origin.url(), "--compare", "",
              f"--cacert {tmp_path / 'missing.pem'}", expect=1)
    assert origin.requests == []
    assert "--compare B" in r.stderr and "missing.pem" in r.stderr, r.stderr


def test_compare_a_run_that_cannot_start_keeps_the_complete_pairs(origin, pki, tmp_path):
    """B's --cacert disappears after pair 1 (found at the check, gone at pair 2's B): the
    comparison stops, prints pair 1 and exits 1 (it had thrown the complete pair away and
    printed nothing)."""
    ca = tmp_path / "ca.pem"
    shutil.copy(pki["ca"], ca)
    p = subprocess.Popen([BIN, "--json", "--cacert", pki["ca"], "--rate", "50", "--requests",
                          "25", origin.url(), "--compare", "", f"--cacert {ca}", "--pairs", "3"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(origin.requests) < 25 * 2 + 5:
            time.sleep(0.02)  # into pair 2's A run
        ca.unlink()
        out, err = p.communicate(timeout=RUN_TIMEOUT)
    finally:
        p.kill()
    assert p.returncode == 1, err
    assert len(origin.requests) == 25 * 3, len(origin.requests)  # pair 2's B never started
    rep = json.loads(out)
    assert rep["pairs"] == 1 and len(rep["a"]["runs"]) == len(rep["b"]["runs"]) == 1, rep
    assert rep["b"]["runs"][0]["requests"] == 25
    assert "pair 2 B" in err and "ca.pem" in err, err


def _peers_report(tmp_path, compare: dict, load: str) -> str:
    """bench/peers/report.py on one (load, peer) comparison; returns its markdown."""
    w = tmp_path / "w"
    (w / "res").mkdir(parents=True)
    (w / "res" / f"{load}.egressd.json").write_text(json.dumps(compare))
    (w / "res" / f"{load}.egressd.meta.json").write_text(json.dumps({"largs": "--rate 50"}))
    env = {k: "x" for k in ("PEERS_SECRET", "PEERS_TOKEN", "M_NPROC", "M_CPU", "M_MEM", "M_OS",
                            "M_KERNEL", "M_DATE", "M_COMMIT", "M_MINUTES", "M_LOAD_START",
                            "M_LOAD_END", "V_NGINX", "V_HAPROXY", "V_MITM", "V_SQUID",
                            "V_OPENSSL", "V_GNUPLOT", "PEERS_DUR", "PEERS_WARM", "PEERS_PAIRS_N",
                            "M_BUILD_ARG", "PEERS_SVG_NAME")}
    env.update(PEERS_W=str(w), PEERS_LIST="egressd", PEERS_LOADS_LIST=load,
               PATH=os.environ.get("PATH", ""))
    r = subprocess.run([sys.executable, str(REPO / "bench/peers/report.py")], env=env,
                       capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_compare_side_without_responses_has_no_latency(origin, pki, tmp_path):
    """A side whose runs got no response (its proxy port refuses): its p50/p99 are null and
    stay out of the medians (they had been 0 us, and peers/report.py then printed a negative
    'p99 added'); the text report says n/a; report.py copes with the nulls."""
    s = servers.closed_port()
    dead_proxy = f"http://127.0.0.1:{s.getsockname()[1]}"
    args = ["--cacert", pki["ca"], "--rate", 100, "--requests", 10, origin.url(),
            "--compare", "", f"--proxy {dead_proxy}", "--pairs", 2]
    try:
        out = json.loads(bench("--json", *args, expect=1).stdout)
        text = bench(*args, expect=1).stdout
    finally:
        s.close()
    assert out["pairs"] == 2
    assert all(r["p99_us"] > 0 and r["p50_us"] > 0 for r in out["a"]["runs"]), out["a"]
    assert all(r["p99_us"] is None and r["p50_us"] is None for r in out["b"]["runs"]), out["b"]
    assert out["b"]["median_p99_us"] is None and out["a"]["median_p99_us"] > 0
    rows = [line.split() for line in text.splitlines() if line[:1].isdigit()]
    assert len(rows) == 2 and all(row[-1] == "n/a" for row in rows), text
    md = _peers_report(tmp_path, out, "rate2000")
    row = next(line for line in md.splitlines() if line.startswith("| egressd |"))
    assert "**–**" in row and "-" not in row.replace("–", ""), row


def test_compare_interrupted_reports_the_complete_pairs(origin, pki):
    """Ctrl-C during a comparison: the cut run is left out, and so is the A run of its pair;
    the report of the complete pairs is printed (it had printed nothing, or medians with a
    B of 0)."""
    p = subprocess.Popen([BIN, "--json", "--cacert", pki["ca"], "--rate", "50", "--duration",
                          "1s", origin.url(), "--compare", "", "--connections 2",
                          "--pairs", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    before = len(origin.requests)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(origin.requests) - before < 50 * 3 + 10:
            time.sleep(0.02)  # into pair 2's B run
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=RUN_TIMEOUT)
    finally:
        p.kill()
    assert p.returncode == 0, err
    rep = json.loads(out)
    assert rep["pairs"] == 1 and len(rep["a"]["runs"]) == len(rep["b"]["runs"]) == 1, rep
    assert rep["median_ratio"] == pytest.approx(rep["ratios"][0])
    assert "interrupted, left out" in err


# --- what the review of 2026-12-07 found (each failed before) -------------------------------

OK_200 = b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nhello\n"


@pytest.fixture
def scripted():
    made = []

    def make(answer, **kw):
        o = servers.ScriptedOrigin(answer, **kw)
        made.append(o)
        return o
    yield make
    for o in made:
        o.stop()


def test_a_stalled_server_shows_in_the_latency(scripted):
    """Open loop against a server whose connections answer 3 requests, then stall: the timed
    out requests, and those due but never sent, are in the percentiles as lower bounds (only
    the fast answers were: p99 and max of a few ms)."""
    o = scripted(lambda conn, n, head: OK_200 if n <= 3 else None)
    out = bench_json("--rate", 20, "--connections", 4, "--duration", "2s", "--timeout", "1s",
                     o.url(), expect=0)
    lat = out["latency_us"]
    timeouts = out["errors"].get("timeout", 0)
    assert timeouts >= 4, out
    assert lat["lower_bounds"] == timeouts + out["not_sent"], out
    assert lat["count"] == out["requests"]["ok"] + lat["lower_bounds"], out
    assert lat["max"] >= 1_000_000 and lat["p99"] >= 900_000, lat


def test_ctrl_c_stops_an_open_loop_run_waiting_for_its_tickets(scripted):
    """--rate 2 with 20 connections: each connection holds a ticket due up to 10 s ahead.
    Ctrl-C after ~1 s ends the run then; the waiting tickets are not sent (all 20 were, over
    9.5 s)."""
    o = scripted(lambda conn, n, head: OK_200)
    p = subprocess.Popen([BIN, "--json", "--rate", "2", "--connections", "20", "--requests",
                          "20", o.url()], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and o.received < 2:
            time.sleep(0.02)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=5)
    finally:
        p.kill()
    rep = json.loads(out)
    assert rep["interrupted"] is True, rep
    assert 2 <= rep["requests"]["total"] <= 4 and o.received <= 4, (rep, o.received)


def test_h2_whole_exchange_is_bounded_by_the_timeout(h2_origin, pki):
    """A server dripping a body byte every 200 ms: --timeout 1s ends each stream at ~1 s
    (each wait was bounded, not the exchange: the run never ended)."""
    h2_origin.trickle = 0.2
    started = time.monotonic()
    out = bench_json("--h2", "--cacert", pki["ca"], "--requests", 2, "--timeout", "1s",
                     h2_origin.url(), expect=1)
    assert out["errors"] == {"timeout": 2}, out
    assert "during the response body" in out["error_samples"]["timeout"]
    assert time.monotonic() - started < RUN_TIMEOUT / 2


def test_h2_a_reset_is_a_reset_not_a_timeout(h2_origin, pki):
    h2_origin.trickle = 0.1
    h2_origin.trickle_reset = 0.4
    out = bench_json("--h2", "--cacert", pki["ca"], "--requests", 2, "--timeout", "2s",
                     h2_origin.url(), expect=1)
    assert out["errors"] == {"read": 2}, out
    assert "stream reset (error 2)" in out["error_samples"]["read"], out


def test_a_keepalive_connection_the_server_closed_while_idle_is_reopened(scripted):
    """Open loop, 4 connections at 5 req/s: each idles 0.8 s between its requests, and the
    server closes connections idle 0.3 s (a keep-alive timeout). The request is sent again on
    a new connection, as clients do (each had counted as a read or write error)."""
    o = scripted(lambda conn, n, head: OK_200, idle_timeout=0.3)
    out = bench_json("--rate", 5, "--connections", 4, "--duration", "2s", o.url())
    assert out["errors"] == {}, out
    assert out["requests"]["ok"] == out["requests"]["total"] >= 8, out
    assert o.connections > 4, o.connections
    # The first attempts met closed connections: the server got each request once.
    assert out["retries"] > 0 and o.received == out["requests"]["total"], (o.received, out)


def test_a_connection_failing_its_first_request_in_closed_loop_is_not_retried(scripted):
    """A server that closes every connection at its first request: each failure is recorded
    once, the request not sent twice (a retry there would hide a proxy dropping
    connections)."""
    o = scripted(lambda conn, n, head: "close")
    out = bench_json("--requests", 3, o.url(), expect=1)
    assert out["errors"] == {"read": 3} and out["retries"] == 0, out
    assert o.received == 3, o.received


def test_a_post_is_not_sent_again(scripted):
    o = scripted(lambda conn, n, head: OK_200, idle_timeout=0.3)
    out = bench_json("--rate", 5, "--connections", 2, "--duration", "1s", "--method", "POST",
                     o.url(), expect=0)
    assert set(out["errors"]) <= {"read", "write"} and out["requests"]["errors"] > 0, out
    assert o.received == out["requests"]["ok"], (o.received, out)  # none twice


def test_a_large_response_head_is_read(scripted):
    big = b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 20000 + b"\r\nContent-Length: 6\r\n\r\nhello\n"
    o = scripted(lambda conn, n, head: big)
    out = bench_json("--requests", 3, o.url())
    assert out["errors"] == {} and out["status"] == {"200": 3}, out


def test_an_answer_before_the_upload_ends_is_recorded(scripted):
    """A server that answers 413 to a 20 MB upload and closes: the 413 is what the run
    records, not the write's reset."""
    o = scripted(lambda conn, n, head: b"HTTP/1.1 413 Too Large\r\nContent-Length: 0\r\n"
                 b"Connection: close\r\n\r\n")
    out = bench_json("--requests", 3, "--body-size", 20_000_000, o.url(), expect=1)
    assert out["errors"] == {"status_4xx": 3} and out["status"] == {"413": 3}, out


@pytest.mark.parametrize("head,key", [
    (b"HTTP/1.1 000 Zero\r\nContent-Length: 6\r\n\r\nhello\n", "parse"),
    (b"HTTP/1.1 099 Low\r\nContent-Length: 6\r\n\r\nhello\n", "parse"),
    (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: upgrade\r\n\r\n",
     "parse"),
    (b"HTTP/1.1 999 Odd\r\nContent-Length: 6\r\n\r\nhello\n", "status_9xx"),
])
def test_statuses_no_request_can_have(scripted, head, key):
    o = scripted(lambda conn, n, h: head)
    out = bench_json("--requests", 2, o.url(), expect=1)
    assert out["requests"]["ok"] == 0 and out["errors"] == {key: 2}, out
    if key == "status_9xx":
        assert out["status"] == {"999": 2}, out


def test_an_interim_answer_to_connect_is_skipped(origin, pki):
    p = servers.Proxy(interim_connect=True)
    try:
        out = bench_json("--cacert", pki["ca"], "--requests", 3, "--proxy", p.url(),
                         origin.url())
    finally:
        p.stop()
    assert out["errors"] == {} and out["requests"]["ok"] == 3, out


def test_protocols_of_keepalive_connections_opened_in_the_warmup(origin, pki):
    out = bench_json("--cacert", pki["ca"], "--warmup", "300ms", "--duration", "500ms",
                     origin.url())
    assert out["requests"]["warmup"] > 0 and out["connections_opened"] == 0, out
    assert out["alpn"] == {"http/1.1": 1}, out


def test_measured_time_is_not_longer_than_the_window(origin, pki):
    out = bench_json("--cacert", pki["ca"], "--rate", "0.1", "--duration", "1s", origin.url())
    assert out["requests"]["total"] == 1 and out["elapsed_s"] <= 1.0, out


def test_json_inside_a_compare_side_is_honoured(origin, pki):
    r = bench("--cacert", pki["ca"], "--requests", 2, origin.url(), "--pairs", 1,
              "--compare", "--json", "")
    assert json.loads(r.stdout)["pairs"] == 1


# --- usage -----------------------------------------------------------------------------------

# --- HTTP/2 (the proxy's H2ClientSession) ---------------------------------------------------

@pytest.fixture
def h2_origin(pki):
    o = servers.H2Origin(pki)
    yield o
    o.stop()


def test_h2_requests_exact_with_streams(h2_origin, pki):
    out = bench_json("--h2", "--cacert", pki["ca"], "--connections", 2, "--streams", 10,
                     "--requests", 500, h2_origin.url("/x?y=1"))
    assert out["requests"] == {"total": 500, "ok": 500, "errors": 0, "warmup": 0}
    assert len(h2_origin.requests) == 500
    assert out["status"] == {"200": 500}
    assert out["protocol"] == "h2" and out["streams"] == 10
    assert out["alpn"] == {"h2": 2}
    assert out["connections_opened"] == 2 and h2_origin.connections == 2
    assert out["body_bytes_received"] == 500 * len(servers.H2Origin.BODY)
    assert out["bytes_received"] > out["body_bytes_received"] and out["bytes_sent"] > 0
    lat = out["latency_us"]
    assert lat["count"] == 500
    assert 0 < lat["min"] <= lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["p99_9"] <= lat["max"]
    method, path, headers, body = h2_origin.requests[0]
    assert (method, path, body) == ("GET", "/x?y=1", 0)
    assert (":authority", f"127.0.0.1:{h2_origin.port}") in headers
    assert ("user-agent", "egress-bench") in headers


@pytest.mark.parametrize("streams", [1, 10])
def test_h2_streams_are_concurrent(h2_origin, pki, streams):
    """1 connection x --streams M to a server that holds every answer 50 ms: the server sees
    exactly M streams open at once (neither fewer, --streams not honoured, nor more); the
    session count is the check that all of them went over one connection."""
    h2_origin.delay = 0.05
    n = 20 * streams  # 1 s of 50 ms rounds
    out = bench_json("--h2", "--cacert", pki["ca"], "--streams", streams, "--requests", n,
                     h2_origin.url())
    assert out["requests"]["ok"] == n and h2_origin.connections == 1
    assert h2_origin.max_open == streams, h2_origin.max_open


def test_h2_streams_refused_by_a_goaway_are_sent_again(pki):
    """A server that sends GOAWAY after every 25 requests and closes (nginx's
    keepalive_requests): the streams it refused unprocessed (past the GOAWAY's last stream)
    go out again on the next connection, as a client does (RFC 9113 8.7), and are not errors
    of the server's; every request is answered once."""
    o = servers.H2Origin(pki)
    o.goaway_after = 25
    try:
        out = bench_json("--h2", "--cacert", pki["ca"], "--streams", 10, "--requests", 300,
                         o.url("/g"))
        assert out["requests"] == {"total": 300, "ok": 300, "errors": 0, "warmup": 0}, out
        assert len(o.requests) == 300
        assert o.connections >= 12, o.connections
        assert o.refused > 0, "no stream was refused: the GOAWAY path was not exercised"
    finally:
        o.stop()


@pytest.mark.parametrize("mode", ["keep-alive", "--new-connection"])
def test_h1_interim_responses_are_skipped(origin, pki, mode):
    """A 103 Early Hints before each answer is not the answer: every request gets its 200,
    and exactly as many requests reach the server (the 200 had been read as the next
    request's answer, and --new-connection never read it)."""
    before = len(origin.requests)
    args = ["--cacert", pki["ca"], "--requests", 6, origin.url("/early-hints")]
    out = bench_json(*(args if mode == "keep-alive" else [mode, *args]))
    assert out["status"] == {"200": 6}, out["status"]
    assert out["requests"]["ok"] == 6 and len(origin.requests) - before == 6


def test_an_h2_stream_refused_on_a_live_connection_is_sent_again_on_it(pki):
    """A server that refuses one stream (RST_STREAM REFUSED_STREAM) and goes on: the request
    is sent again at once on the same connection, not parked until the run's end (its
    latency had spanned the run, and the run had opened a second connection for it)."""
    o = servers.H2Origin(pki)
    o.refuse_nth = 3
    try:
        out = bench_json("--h2", "--cacert", pki["ca"], "--streams", 4, "--duration", "1500ms",
                         "--rate", 40, o.url("/r"))
        assert out["requests"]["errors"] == 0 and out["requests"]["ok"] >= 40, out["requests"]
        assert o.refused == 1
        assert o.connections == 1, o.connections
        assert out["latency_us"]["max"] < 1_000_000, out["latency_us"]
    finally:
        o.stop()


def test_h2_errors_counted(h2_origin, pki):
    out = bench_json("--h2", "--cacert", pki["ca"], "--streams", 4, "--requests", 40,
                     h2_origin.url("/status/503"), expect=1)
    assert out["requests"] == {"total": 40, "ok": 0, "errors": 40, "warmup": 0}
    assert out["errors"] == {"status_5xx": 40} and out["status"] == {"503": 40}
    out = bench_json("--h2", "--cacert", pki["ca"], "--streams", 4, "--requests", 12,
                     h2_origin.url("/status/404"), expect=1)
    assert out["errors"] == {"status_4xx": 12}


def test_h2_method_body_and_headers(h2_origin, pki):
    out = bench_json("--h2", "--cacert", pki["ca"], "--streams", 3, "--requests", 9,
                     "--body-size", 70000, "-H", "X-Test: 1", "-H", "Host: api.test",
                     h2_origin.url("/up"))
    assert out["requests"]["ok"] == 9 and out["method"] == "POST"
    assert len(h2_origin.requests) == 9
    for method, path, headers, body in h2_origin.requests:
        assert (method, path, body) == ("POST", "/up", 70000)
        assert ("x-test", "1") in headers and (":authority", "api.test") in headers
        assert ("content-length", "70000") in headers


def test_h2_alpn_refused_by_h1_server(origin, pki):
    out = bench_json("--h2", "--cacert", pki["ca"], "--requests", 3, origin.url(), expect=1)
    assert out["errors"] == {"alpn": 3}
    assert "not h2" in out["error_samples"]["alpn"]
    assert origin.requests == []


def test_h2_through_proxy(h2_origin, pki, proxy):
    out = bench_json("--h2", "--cacert", pki["ca"], "--proxy", proxy.url("alice:pw"),
                     "--connections", 2, "--streams", 10, "--requests", 300,
                     h2_origin.url("/", host="localhost"))
    assert out["requests"] == {"total": 300, "ok": 300, "errors": 0, "warmup": 0}
    assert len(h2_origin.requests) == 300
    assert proxy.connects == 2 and h2_origin.connections == 2
    assert proxy.auth_seen == [basic("alice:pw")] * 2
    assert out["alpn"] == {"h2": 2}


def test_h2_new_connection_through_proxy(h2_origin, pki, proxy):
    out = bench_json("--h2", "--cacert", pki["ca"], "--proxy", proxy.url("u:p"),
                     "--new-connection", "--streams", 10, "--connections", 2, "--requests", 20,
                     h2_origin.url("/", host="localhost"))
    assert out["requests"]["ok"] == 20 and len(h2_origin.requests) == 20
    assert proxy.connects == 20 and h2_origin.connections == 20
    assert out["connections_opened"] == 20 and out["alpn"] == {"h2": 20}
    assert out["streams"] == 1
    assert out["tls_resumed"] >= 1


def test_h2_rate_duration_and_warmup(h2_origin, pki):
    out = bench_json("--h2", "--cacert", pki["ca"], "--streams", 5, "--rate", 200,
                     "--duration", "1s", "--warmup", "300ms", h2_origin.url())
    assert 150 <= out["requests"]["total"] <= 205, out["requests"]
    assert out["requests"]["errors"] == 0
    assert out["requests"]["warmup"] >= 40
    assert len(h2_origin.requests) == out["requests"]["total"] + out["requests"]["warmup"]


def test_h2_compare(h2_origin, pki, proxy):
    out = json.loads(bench("--json", "--h2", "--cacert", pki["ca"], "--streams", 4,
                           "--requests", 40, h2_origin.url("/", host="localhost"),
                           "--compare", "", f"--proxy {proxy.url()}", "--pairs", 2).stdout)
    assert len(out["ratios"]) == 2
    for side in ("a", "b"):
        assert all(r["requests"] == 40 and r["errors"] == 0 for r in out[side]["runs"])
    assert proxy.connects == 2


def test_h2_needs_https(plain_origin):
    r = bench("--h2", plain_origin.url(), expect=2)
    assert "https" in r.stderr


@pytest.mark.parametrize("args", [
    [],
    ["ftp://127.0.0.1/"],
    ["--connections", "0", "https://127.0.0.1/"],
    ["--duration", "ten", "https://127.0.0.1/"],
    ["-H", "no colon", "https://127.0.0.1/"],
    ["--proxy", "https://127.0.0.1:1", "https://127.0.0.1/"],
    ["--bogus", "https://127.0.0.1/"],
    ["https://a/", "https://b/"],
    ["--compare", "'unbalanced", "", "https://127.0.0.1/"],
    ["--streams", "5", "https://127.0.0.1/"],  # --streams without --h2 was ignored
    ["--pairs", "3", "https://127.0.0.1/"],  # --pairs without --compare was ignored
    ["--rate", "0.0000001", "https://127.0.0.1/"],  # its schedule overflowed the clock
])
def test_usage_errors(args):
    bench(*args, expect=2)


def test_help():
    assert "--compare" in bench("--help").stdout


# --- histogram -------------------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_histogram_unit(tmp_path):
    exe = tmp_path / "histogram_check"
    subprocess.run(["g++", "-std=c++20", "-O1", f"-I{REPO}", str(REPO / "bench/histogram.cc"),
                    str(Path(__file__).parent / "histogram_check.cc"), "-o", str(exe)],
                   check=True, timeout=120)
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
