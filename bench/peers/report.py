#!/usr/bin/env python3
"""bench/peers.sh's report: reads the run's results ($PEERS_W/res), prints the markdown section
for bench/RESULTS.md and writes $PEERS_W/plot.dat for peers.gp. Standard library only."""
import json
import os
import statistics

E = os.environ
W = E["PEERS_W"]
RES = os.path.join(W, "res")
PEERS = E["PEERS_LIST"].split()
LOADS = E["PEERS_LOADS_LIST"].split()
GO = E.get("PEERS_CLIENT_NAME") == "go"
CLIENT = "goload" if GO else "egress-bench"

LOAD_TITLE = {
    "h1_c1": "h1 keep-alive, 1 conn",
    "h1_c16": "h1 keep-alive, 16 conns",
    "h1_c64": "h1 keep-alive, 64 conns",
    "h2_2x50": "h2, 2 conns x 50 streams",
    "newconn_c16": "new conn per request, 16 at a time",
    "body64k_c16": "64 KiB bodies, 16 conns",
    "rate2000": "open loop 2000 req/s, 64 conns",
}
LOAD_SHORT = {
    "h1_c1": "h1 x1", "h1_c16": "h1 x16", "h1_c64": "h1 x64", "h2_2x50": "h2 2x50",
    "newconn_c16": "new conn x16", "body64k_c16": "64 KiB x16", "rate2000": "2000/s",
}


def redact(s: str) -> str:
    return s.replace(E["PEERS_SECRET"], "SECRET").replace(E["PEERS_TOKEN"], "TOKEN").replace(W, "$W")


def load_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def grp(n: float) -> str:
    """12 345 (thin grouping like the rest of RESULTS.md)."""
    return f"{n:,.0f}".replace(",", " ")


def ms(us) -> str:
    if us is None:
        return "–"
    v = us / 1000.0
    return f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 100 else f"{v:.0f}"


def median(xs):
    """Median of the values present: a run without responses has no latency (null), and a
    median of none is None."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def diff(a, b):
    return None if a is None or b is None else a - b


def plot_ms(us) -> str:
    return "?" if us is None else f"{us / 1000:.4f}"


def ratio_cell(r) -> str:
    return "–" if r is None else f"{r:.3f}"


def measure(load, peer):
    """One (load, peer): a dict with the numbers, or {'note': why not}."""
    meta = load_json(os.path.join(RES, f"{load}.{peer}.meta.json")) or {}
    if "note" in meta:
        return {"note": meta["note"]}
    d = load_json(os.path.join(RES, f"{load}.{peer}.json"))
    if not d or not d.get("a", {}).get("runs") or not d.get("b", {}).get("runs"):
        err = ""
        try:
            with open(os.path.join(RES, f"{load}.{peer}.err")) as f:
                err = f.read().strip().splitlines()[-1][:200]
        except (OSError, IndexError):
            pass
        return {"note": f"failed: {CLIENT} --compare gave no result" + (f" ({err})" if err else "")}
    a, b = d["a"], d["b"]
    breq = sum(r["requests"] for r in b["runs"])
    m = {
        "a_rps": a["median_rps"], "b_rps": b["median_rps"], "ratio": d["median_ratio"],
        "a_p50": median([r["p50_us"] for r in a["runs"]]),
        "b_p50": median([r["p50_us"] for r in b["runs"]]),
        "a_p99": a["median_p99_us"], "b_p99": b["median_p99_us"],
        "a_err": sum(r["errors"] for r in a["runs"]), "b_err": sum(r["errors"] for r in b["runs"]),
        "a_req": sum(r["requests"] for r in a["runs"]), "b_req": breq,
        "pairs": d["pairs"], "largs": meta.get("largs", ""),
        "a_args": redact(a["args"]), "b_args": redact(b["args"]),
    }
    ticks, hz = int(meta.get("cpu_ticks", 0)), int(meta.get("hz", 100))
    # Requests the proxy carried during the comparison, warmups included (nginx's log).
    m["proxied"] = int(meta.get("proxied", 0))
    m["cpu_us"] = ticks / hz * 1e6 / m["proxied"] if m["proxied"] else None
    uticks = meta.get("cpu_user_ticks")  # absent in runs before the split was recorded
    m["cpu_user_us"] = (int(uticks) / hz * 1e6 / m["proxied"]
                        if m["proxied"] and uticks is not None else None)
    m["rss_mib"] = int(meta.get("rss_kb", 0)) / 1024.0
    return m


R = {(l, p): measure(l, p) for l in LOADS for p in PEERS}


def cpu_cell(m: dict) -> str:
    """CPU µs per request, with its user-space part in parentheses when recorded."""
    if m["cpu_us"] is None:
        return "–"
    if m.get("cpu_user_us") is None:
        return f"{m['cpu_us']:.0f}"
    return f"{m['cpu_us']:.0f} ({m['cpu_user_us']:.0f})"

# ------------------------------------------------------------------ plot data
# One row per load: label, then direct and each peer: req/s, p50 ms, p99 ms, CPU µs/request
# ("?" = missing; direct has no CPU figure). Direct is the median of the direct medians measured
# next to each peer.
with open(os.path.join(W, "plot.dat"), "w") as f:
    f.write("# load direct_rps direct_p50 direct_p99 direct_cpu " +
            " ".join(f"{p}_rps {p}_p50 {p}_p99 {p}_cpu" for p in PEERS) + "\n")
    for l in LOADS:
        ok = [R[(l, p)] for p in PEERS if "note" not in R[(l, p)]]
        cols = ['"%s"' % LOAD_SHORT.get(l, l)]
        if ok:
            cols += [f"{median([m['a_rps'] for m in ok]):.1f}",
                     plot_ms(median([m['a_p50'] for m in ok])),
                     plot_ms(median([m['a_p99'] for m in ok])), "?"]
        else:
            cols += ["?"] * 4
        for p in PEERS:
            m = R[(l, p)]
            if "note" in m or not m["b_rps"]:
                cols += ["?"] * 4
            else:
                cpu = f"{m['cpu_us']:.1f}" if m["cpu_us"] else "?"
                cols += [f"{m['b_rps']:.1f}", plot_ms(m['b_p50']), plot_ms(m['b_p99']), cpu]
        f.write(" ".join(cols) + "\n")

# ------------------------------------------------------------------ markdown
out = []
w = out.append
if GO:
    w("## Peers with a Go net/http client (issue 5)")
    w("")
    w("Generated by `PEERS_CLIENT=go bench/peers.sh` (do not edit by hand: the next run replaces "
      "this section).")
    w("")
    w("The same proxies, upstream, credential and comparison as the section above, but the load "
      "comes from `bench/goload` (Go %s standard library: `net/http`, `crypto/tls`), the kind of "
      "client issue 5's reference figures were measured with, instead of egress-bench. A client's "
      "own CPU per request is spent on the same two cores in both the direct and the proxied run: "
      "the dearer the client, the smaller a proxy's share of each proxied request and the higher "
      "every proxy's ratio, so these ratios are the ones to read next to the issue's. goload opens "
      "`--connections` connections (h2: one Transport per connection, `--streams` goroutines on "
      "each); with `--new-connection` keep-alive is off, so every request is a CONNECT (or, to "
      "HAProxy, a TCP connection) and a full TLS handshake (net/http keeps no session cache by "
      "default)." % (E.get("V_GO", "").removeprefix("go") or "?"))
    w("")
else:
    w("## Peers: egressd next to HAProxy, mitmproxy and Squid (issue 5)")
    w("")
    w("Generated by `bench/peers.sh` (do not edit by hand: the next run replaces this section).")
    w("")
w("Every proxy terminates the client's TLS, adds `Authorization: Bearer <secret>` and "
  "re-encrypts to the same upstream, verifying it against the test CA. The upstream (nginx, 1 "
  "worker, certificate for `localhost`) answers 401 without that header, so a proxy that does not "
  f"inject counts as errors. Each row is one `{CLIENT} --compare 'direct' 'via proxy'` run "
  f"({E['PEERS_PAIRS_N']} pairs of {E['PEERS_DUR']}, alternating direct and proxied, medians): "
  "the ratio is the median of the per-pair ratios. Client, proxy and upstream share the machine's "
  "cores, so req/s mixes each proxy's cost with CPU contention; **CPU µs/req** (utime+stime of the "
  "proxy's processes over the comparison ÷ the requests that reached nginx through it, warmups "
  "included) is the figure that does not depend on the client; in parentheses its user-space "
  "part (utime; the rest is the kernel: TCP, and on loopback the receiver's side of each send). "
  "Peak RSS is VmHWM of the proxy's processes, reset before each load.")
w("")
w("* **egressd**: forward proxy (CONNECT), run CA leaf, pinned bearer credential, audit line per "
  "request to a file, pooled upstream connections (h1 and h2), worker threads = cores.")
w("* **HAProxy**: reverse proxy (the client targets it, no CONNECT), `http-request set-header`, "
  "`http-reuse always`, threads = cores; h1 frontend → h1 backend, h2 frontend → h2 backend.")
w("* **mitmproxy** (`mitmdump -q` + `bench/peers/mitm_addon.py`): forward proxy, its own CA, one "
  "Python process; one upstream connection per client connection.")
w("* **Squid** (squid-openssl, `-N`): forward proxy, `ssl_bump peek` then `bump`, "
  "`request_header_add`, no cache, no access log, one process; bumped connections are pinned to "
  "one upstream connection each. HTTP/1.1 only.")
w("")
w(f"Machine: {E['M_NPROC']} CPUs ({E['M_CPU']}), {E['M_MEM']}, {E['M_OS']}, kernel "
  f"{E['M_KERNEL']}; loopback only. Run {E['M_DATE']}, commit {E['M_COMMIT']}, "
  f"{E['M_MINUTES']} min; load average {E['M_LOAD_START']} at the start, {E['M_LOAD_END']} at the "
  "end (other work on the machine shows up here).")
w(f"Packages: {E['V_NGINX']}, haproxy {E['V_HAPROXY']}, mitmproxy {E['V_MITM']}, squid-openssl "
  f"{E['V_SQUID']}, openssl {E['V_OPENSSL']}, gnuplot-nox {E['V_GNUPLOT']}.")
w("")
bt = E.get("M_BUILD_TYPE") or "unknown"
w(f"Command ({bt} build in `{E['M_BUILD_ARG']}`; egressd{'' if GO else ' and egress-bench'} from it):")
w("")
w("```sh")
w("%sPEERS_DURATION=%s PEERS_PAIRS=%s bench/peers.sh %s" % ("PEERS_CLIENT=go " if GO else "", E["PEERS_DUR"], E["PEERS_PAIRS_N"], E["M_BUILD_ARG"]))
w("```")
w("")
w("![throughput, p50 and p99 latency and CPU per request, per load and proxy](%s)"
  % E["PEERS_SVG_NAME"])
w("")
w("| load | proxy | direct req/s | via req/s | ratio | p50 direct / via (ms) | "
  "p99 direct / via (ms) | CPU µs/req (user) | peak RSS | errors |")
w("|---|---|---|---|---|---|---|---|---|---|")
for l in LOADS:
    if l == "rate2000":
        continue
    for p in PEERS:
        m = R[(l, p)]
        if "note" in m:
            w(f"| {LOAD_TITLE.get(l, l)} | {p} | {m['note']} ||||||||")
            continue
        errs = f"{m['b_err']} / {m['b_req']}" if m["b_err"] else "0"
        if m["a_err"]:
            errs += f" (direct {m['a_err']})"
        cpu = cpu_cell(m)
        w(f"| {LOAD_TITLE.get(l, l)} | {p} | {grp(m['a_rps'])} | {grp(m['b_rps'])} | "
          f"{ratio_cell(m['ratio'])} | {ms(m['a_p50'])} / {ms(m['b_p50'])} | {ms(m['a_p99'])} / "
          f"{ms(m['b_p99'])} | {cpu} | {m['rss_mib']:.0f} MiB | {errs} |")
w("")
if "rate2000" in LOADS:
    w("Open loop, 2000 req/s offered over 64 connections (latency from each request's intended "
      "send time, so a proxy that falls behind shows it as latency, not as fewer requests):")
    w("")
    w("| proxy | direct req/s | via req/s | p50 direct / via (ms) | p99 direct (ms) | "
      "p99 via (ms) | **p99 added** (ms) | CPU µs/req (user) | peak RSS | errors |")
    w("|---|---|---|---|---|---|---|---|---|---|")
    for p in PEERS:
        m = R[("rate2000", p)]
        if "note" in m:
            w(f"| {p} | {m['note']} |||||||||")
            continue
        errs = f"{m['b_err']} / {m['b_req']}" if m["b_err"] else "0"
        cpu = cpu_cell(m)
        w(f"| {p} | {grp(m['a_rps'])} | {grp(m['b_rps'])} | {ms(m['a_p50'])} / {ms(m['b_p50'])} | "
          f"{ms(m['a_p99'])} | {ms(m['b_p99'])} | **{ms(diff(m['b_p99'], m['a_p99']))}** | {cpu} | "
          f"{m['rss_mib']:.0f} MiB | {errs} |")
    w("")
    w("At this rate the p99 of both sides is mostly the machine's own scheduling noise (other "
      "processes on the shared cores): a p99 added that is small next to the direct p99 itself, or "
      "negative, is a difference this run does not resolve; the p50 shows the proxy's own cost.")
    w("")
w(f"{CLIENT} arguments of each load (common: `--cacert $W/all-ca.pem --json --duration "
  f"{E['PEERS_DUR']} --warmup {E['PEERS_WARM']} --pairs {E['PEERS_PAIRS_N']}`; `$W` is the run's "
  "temp dir, A is direct, B the proxy; egressd's B is shown, the others differ only in `--proxy` "
  "or, for HAProxy, the URL):")
w("")
w("```")
for l in LOADS:
    m = next((R[(l, p)] for p in (["egressd"] + PEERS) if (l, p) in R and "note" not in R[(l, p)]), None)
    if m:
        w(f"{l}: {m['largs']} --compare \"{m['a_args']}\" \"{m['b_args']}\"")
w("```")
w("")
w("Each run of a comparison starts with a %s warmup (`--warmup`, not counted: connections are "
  "open and the interceptors' leaf certificates minted before measuring). Before each comparison "
  "a check run of 200 requests through the proxy must succeed, or the row says why. Ports are "
  "picked at run time; all files live in a temp dir that is removed at the end." % E["PEERS_WARM"])
print("\n".join(out))
