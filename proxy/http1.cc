#include "proxy/http1.h"

#include <boost/url/parse.hpp>

#include "policy/header_rules.h"
#include "policy/scrubber.h"

namespace egress::proxy {

namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kRelayBufferBytes = 64 * 1024;
constexpr auto kRefusalWriteTimeout = std::chrono::seconds(5);

template <class Stream>
auto& lowest(Stream& s) {
    return beast::get_lowest_layer(s);
}

double ms_since(Clock::time_point t) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

uint16_t default_port(bool tls) { return tls ? 443 : 80; }

/// The Host value sent upstream: the agreed destination, default port omitted.
std::string host_header(const policy::HostPort& hp, bool tls) {
    std::string h = hp.is_ipv6_literal() ? "[" + hp.host + "]" : hp.host;
    if (hp.port != default_port(tls)) {
        h += ":" + std::to_string(hp.port);
    }
    return h;
}

struct RelayStats {
    uint64_t bytes = 0;
    error_code read_ec;
    error_code write_ec;
    bool ok() const { return !read_ec && !write_ec; }
};

/// Streams one message body from a parser on `in` to a serializer on `out`, 64 KiB at a
/// time: nothing is buffered whole, and a slow reader slows the writer (backpressure).
/// `scrub`, when active, replaces secret bytes on the way (equal length, so framing holds).
template <bool isRequest, class In, class Out>
awaitable<RelayStats> relay_body(In& in, beast::flat_buffer& inbuf,
                                 http::parser<isRequest, http::buffer_body>& p, Out& out,
                                 http::message<isRequest, http::buffer_body>& msg,
                                 policy::Scrubber* scrub, std::chrono::milliseconds timeout) {
    RelayStats st;
    auto buf = std::make_unique<char[]>(kRelayBufferBytes);
    std::string scrubbed;
    http::serializer<isRequest, http::buffer_body> sr{msg};
    msg.body().data = nullptr;
    msg.body().size = 0;
    msg.body().more = !p.is_done();
    lowest(out).expires_after(timeout);
    if (auto [ec, n] = co_await http::async_write_header(out, sr, use_nothrow); ec) {
        st.write_ec = ec;
        co_return st;
    }
    do {
        if (!p.is_done()) {
            p.get().body().data = buf.get();
            p.get().body().size = kRelayBufferBytes;
            lowest(in).expires_after(timeout);
            auto [ec, n] = co_await http::async_read_some(in, inbuf, p, use_nothrow);
            if (ec == http::error::need_buffer) {
                ec = {};
            }
            if (ec) {
                st.read_ec = ec;
                co_return st;
            }
            size_t got = kRelayBufferBytes - p.get().body().size;
            st.bytes += got;
            std::string_view chunk(buf.get(), got);
            if (scrub != nullptr && scrub->active()) {
                scrubbed.clear();
                scrub->feed(chunk, scrubbed);
                if (p.is_done()) {
                    scrub->finish(scrubbed);
                }
                chunk = scrubbed;
            }
            if (chunk.empty() && !p.is_done()) {
                continue;  // an empty buffer with more=true would serialize as the last chunk
            }
            // An empty but non-null buffer would serialize as a zero-size chunk, which is a
            // last-chunk of its own: pass nullptr so only one terminator is written.
            msg.body().data = chunk.empty() ? nullptr : const_cast<char*>(chunk.data());
            msg.body().size = chunk.size();
            msg.body().more = !p.is_done();
        } else {
            msg.body().data = nullptr;
            msg.body().size = 0;
            msg.body().more = false;
        }
        lowest(out).expires_after(timeout);
        auto [ec, n] = co_await http::async_write(out, sr, use_nothrow);
        if (ec == http::error::need_buffer) {
            ec = {};
        }
        if (ec) {
            st.write_ec = ec;
            co_return st;
        }
    } while (!p.is_done() || !sr.is_done());
    lowest(out).expires_never();
    lowest(in).expires_never();
    co_return st;
}

/// Converts a parsed HTTP/1.1 header into the protocol-neutral head.
Outcome<policy::RequestHead> to_request_head(const http::request<http::buffer_body>& req,
                                             bool tls, bool absolute_form) {
    policy::RequestHead head;
    head.method = std::string(req.method_string());
    head.scheme = tls ? "https" : "http";
    std::string_view target = req.target();
    if (absolute_form) {
        auto url = boost::urls::parse_absolute_uri(target);
        if (!url) {
            return Refusal{400, "bad_request_target", ""};
        }
        head.path = std::string(url->encoded_path());
        if (head.path.empty()) {
            head.path = "/";
        }
        if (url->has_query()) {
            head.path += "?" + std::string(url->encoded_query());
        }
    } else {
        if (target.empty() || (target.front() != '/' && !(target == "*" && req.method() ==
                                                                             http::verb::options))) {
            return Refusal{400, "bad_request_target", ""};
        }
        head.path = std::string(target);
    }
    size_t hosts = 0;
    bool has_cl = false;
    bool has_te = false;
    for (const auto& f : req) {
        std::string name = policy::ascii_lower(f.name_string());
        if (name == "host") {
            ++hosts;
            head.authority = std::string(f.value());
            continue;
        }
        has_cl = has_cl || name == "content-length";
        if (name == "transfer-encoding") {
            has_te = true;
            if (!policy::iequals(f.value(), "chunked")) {
                return Refusal{400, "bad_transfer_encoding", ""};
            }
        }
        head.headers.push_back({std::move(name), std::string(f.value())});
    }
    if (hosts > 1) {
        return Refusal{400, "duplicate_host", ""};
    }
    if (has_cl && has_te) {
        return Refusal{400, "bad_framing", ""};  // CL+TE: classic smuggling vector
    }
    return head;
}

}  // namespace

template <class Stream>
awaitable<void> write_refusal(Stream& s, int status, const std::string& reason, bool keep_alive) {
    http::response<http::string_body> res{static_cast<http::status>(status), 11};
    res.set(http::field::server, "egressd");
    res.set(http::field::content_type, "text/plain; charset=utf-8");
    res.set("X-Egress-Reason", reason);
    if (status == 407) {
        res.set(http::field::proxy_authenticate, "Basic realm=\"egressd\"");
    }
    if (status == 429) {
        res.set(http::field::retry_after, "1");
    }
    res.body() = "egressd: " + std::to_string(status) + " " +
                 std::string(http::obsolete_reason(static_cast<http::status>(status))) + ": " +
                 reason + "\n";
    res.keep_alive(keep_alive);
    res.prepare_payload();
    lowest(s).expires_after(kRefusalWriteTimeout);
    co_await http::async_write(s, res, use_nothrow);
    lowest(s).expires_never();
}

template awaitable<void> write_refusal<TcpStream>(TcpStream&, int, const std::string&, bool);
template awaitable<void> write_refusal<TlsStream>(TlsStream&, int, const std::string&, bool);

void audit_refusal(Scope& scope, const std::string& method, const std::string& path, int status,
                   const std::string& reason, Clock::time_point started) {
    auto& shared = scope.worker->shared;
    AuditRecord rec;
    rec.run = scope.run ? scope.run->policy.id : "";
    rec.method = method;
    rec.scheme = scope.tls ? "https" : (method == "CONNECT" ? "" : "http");
    rec.host = scope.target.host;
    rec.port = scope.target.port;
    rec.path = path;
    rec.status = status;
    rec.decision = "deny";
    rec.reason = reason;
    rec.duration_ms = ms_since(started);
    rec.proto_in = scope.proto_in;
    shared.audit->write(rec);
    shared.metrics.denied(reason);
    shared.metrics.request("deny", scope.proto_in, rec.duration_ms / 1000.0);
    spdlog::info("conn={} run={} {} {}{} -> {} {}", scope.conn_id, rec.run, method,
                 scope.target.authority(), path, status, reason);
}

namespace {

/// One request, end to end: head → pipeline → upstream → response. Shared by intercepted
/// https and absolute-form http. Returns whether the client connection may be reused.
template <class ClientStream>
awaitable<bool> handle_request(ClientStream& client, beast::flat_buffer& cbuf,
                               http::request_parser<http::buffer_body>& parser, Scope& scope,
                               bool absolute_form) {
    const auto started = Clock::now();
    Worker& w = *scope.worker;
    Shared& shared = w.shared;
    InflightGuard inflight(shared);
    // Every request sees the current control-plane state: a rotated secret applies to the
    // next request, and a revoked or expired run is refused even on an open connection.
    {
        auto current = shared.runtime.load();
        auto fresh = current->find(scope.run->policy.id);
        if (!fresh) {
            bool expired = scope.run->policy.expires_at <= policy::Clock::now();
            const char* reason = expired ? "run_expired" : "run_revoked";
            co_await write_refusal(client, 403, reason, false);
            audit_refusal(scope, std::string(parser.get().method_string()),
                          std::string(parser.get().target()), 403, reason, started);
            co_return false;
        }
        scope.run = std::move(fresh);
        scope.runtime = std::move(current);
    }
    const Runtime& rt = *scope.runtime;
    const auto& limits = rt.config->limits;
    auto& req = parser.get();
    const bool body_expected = !parser.is_done();
    const bool client_keep_alive = req.keep_alive();
    std::string method(req.method_string());

    auto head_or = to_request_head(req, scope.tls, absolute_form);
    if (auto* r = std::get_if<Refusal>(&head_or)) {
        co_await write_refusal(client, r->status, r->reason, false);
        audit_refusal(scope, method, std::string(req.target()), r->status, r->reason, started);
        co_return false;
    }
    auto& head = std::get<policy::RequestHead>(head_or);

    policy::RequestContext ctx;
    ctx.global = &rt.config->policy;
    ctx.run = &scope.run->policy;
    ctx.target = scope.target;
    ctx.sni = scope.sni;
    ctx.tls = scope.tls;
    ctx.now = policy::Clock::now();
    auto decision = shared.pipeline.run(head, ctx);
    if (!decision.forward()) {
        bool ka = client_keep_alive && !body_expected;
        co_await write_refusal(client, decision.status, decision.reason, ka);
        audit_refusal(scope, method, head.path, decision.status, decision.reason, started);
        co_return ka;
    }

    // Expect: 100-continue is answered here; the upstream never sees it.
    if (const auto* expect = head.find("expect"); expect && policy::iequals(*expect, "100-continue")) {
        head.remove("expect");
        static constexpr std::string_view kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
        lowest(client).expires_after(limits.idle_timeout);
        co_await net::async_write(client, net::buffer(kContinue), use_nothrow);
    }

    // Upstream connection: pooled per (run, destination) for TLS; fresh for plain http.
    std::unique_ptr<TlsConn> tls_conn;
    std::unique_ptr<TcpStream> plain_conn;
    beast::flat_buffer plain_buf;
    tcp::endpoint peer;
    bool reused = false;
    auto connect = [&](bool allow_pool) -> awaitable<std::optional<Refusal>> {
        reused = false;
        if (scope.tls) {
            auto key = UpstreamPool::key(scope.run->policy.id, scope.target);
            tls_conn = allow_pool ? w.pool->acquire(key) : nullptr;
            if (tls_conn) {
                reused = true;
                peer = tls_conn->peer;
                co_return std::nullopt;
            }
            auto dialed = co_await dial_upstream(w, rt, scope.target);
            if (auto* r = std::get_if<Refusal>(&dialed)) {
                co_return *r;
            }
            auto conn = co_await tls_connect(w, rt, std::move(std::get<Dialed>(dialed)),
                                             scope.target.host);
            if (auto* r = std::get_if<Refusal>(&conn)) {
                co_return *r;
            }
            tls_conn = std::move(std::get<std::unique_ptr<TlsConn>>(conn));
            tls_conn->key = key;
            peer = tls_conn->peer;
            co_return std::nullopt;
        }
        auto dialed = co_await dial_upstream(w, rt, scope.target);
        if (auto* r = std::get_if<Refusal>(&dialed)) {
            co_return *r;
        }
        auto& d = std::get<Dialed>(dialed);
        plain_conn = std::move(d.stream);
        peer = d.peer;
        co_return std::nullopt;
    };
    if (auto refusal = co_await connect(true)) {
        if (!refusal->kind.empty()) {
            shared.metrics.upstream_error(refusal->kind);
        }
        co_await write_refusal(client, refusal->status, refusal->reason, false);
        audit_refusal(scope, method, head.path, refusal->status, refusal->reason, started);
        co_return false;
    }

    // Serialize the head exactly as the pipeline left it.
    http::request<http::buffer_body> ureq;
    ureq.method_string(head.method);
    ureq.target(head.path);
    ureq.version(11);
    ureq.set(http::field::host, host_header(scope.target, scope.tls));
    for (const auto& h : head.headers) {
        ureq.insert(h.name, h.value);
    }
    if (parser.chunked()) {
        ureq.chunked(true);
    }

    AuditRecord rec;
    rec.run = scope.run->policy.id;
    rec.method = method;
    rec.scheme = head.scheme;
    rec.host = scope.target.host;
    rec.port = scope.target.port;
    rec.path = head.path;
    rec.proto_in = scope.proto_in;
    rec.proto_out = "http/1.1";
    rec.upstream_addr = peer.address().to_string() + ":" + std::to_string(peer.port());
    if (decision.pin != nullptr) {
        rec.pin = decision.pin->id;
        rec.secret = decision.pin->secret_name;
    }
    rec.reason = decision.reason;

    policy::Scrubber scrubber(std::move(decision.scrub));
    auto finish = [&](int status, const std::string& reason, const std::string& kind) {
        rec.status = status;
        rec.decision = "allow";  // the pipeline allowed it; reason records what went wrong
        if (!reason.empty()) {
            rec.reason = reason;
        }
        rec.duration_ms = ms_since(started);
        if (!kind.empty()) {
            shared.metrics.upstream_error(kind);
        }
        shared.audit->write(rec);
        shared.metrics.request(rec.decision, scope.proto_in, rec.duration_ms / 1000.0);
        spdlog::info("conn={} run={} {} {}{} -> {} pin={} in={} out={} {:.1f}ms", scope.conn_id,
                     rec.run, method, scope.target.authority(), rec.path, status,
                     rec.pin.value_or("-"), rec.bytes_in, rec.bytes_out, rec.duration_ms);
    };

    // A pooled connection the upstream closed while idle fails before any response byte;
    // a request without a body is then retried once on a fresh connection (nothing of it
    // can have been processed).
    enum class Exchange { Done, Retry };
    bool client_ka = false;
    bool upstream_reusable = false;
    auto exchange = [&](auto& up, beast::flat_buffer& ubuf) -> awaitable<Exchange> {
        const bool may_retry = reused && !body_expected;
        // Request body: client → upstream.
        auto sent = co_await relay_body(client, cbuf, parser, up, ureq, nullptr, limits.idle_timeout);
        rec.bytes_in = sent.bytes;
        if (sent.write_ec && may_retry) {
            co_return Exchange::Retry;
        }
        if (sent.read_ec) {
            finish(0, "client_aborted", "");
            co_return Exchange::Done;
        }
        if (sent.write_ec) {
            co_await write_refusal(client, 502, "upstream_write_failed", false);
            finish(502, "upstream_write_failed", "write");
            co_return Exchange::Done;
        }
        // Response head (skipping interim 1xx responses).
        std::optional<http::response_parser<http::buffer_body>> rp;
        for (;;) {
            rp.emplace();
            rp->body_limit(boost::none);
            rp->header_limit(static_cast<uint32_t>(limits.max_header_bytes));
            if (req.method() == http::verb::head) {
                rp->skip(true);
            }
            lowest(up).expires_after(limits.idle_timeout);
            auto [ec, n] = co_await http::async_read_header(up, ubuf, *rp, use_nothrow);
            if (ec && may_retry && ec != beast::error::timeout) {
                co_return Exchange::Retry;
            }
            if (ec) {
                bool timeout = ec == beast::error::timeout;
                co_await write_refusal(client, timeout ? 504 : 502,
                                       timeout ? "upstream_timeout" : "upstream_bad_response",
                                       false);
                finish(timeout ? 504 : 502, timeout ? "upstream_timeout" : "upstream_bad_response",
                       timeout ? "response_timeout" : "response");
                co_return Exchange::Done;
            }
            int code = rp->get().result_int();
            if (code >= 100 && code < 200 && code != 101) {
                continue;
            }
            break;
        }
        auto& ures = rp->get();
        http::response<http::buffer_body> cres;
        cres.result(ures.result_int());
        cres.reason(ures.reason());
        cres.version(11);
        std::string connection_tokens;
        if (auto it = ures.find(http::field::connection); it != ures.end()) {
            connection_tokens = policy::ascii_lower(it->value());
        }
        for (const auto& f : ures) {
            std::string name = policy::ascii_lower(f.name_string());
            if (policy::is_hop_by_hop(name) ||
                (!connection_tokens.empty() && connection_tokens.find(name) != std::string::npos)) {
                continue;
            }
            if (scrubber.active()) {
                cres.insert(name, scrubber.scrub_value(f.value()));
            } else {
                cres.insert(f.name_string(), f.value());
            }
        }
        if (rp->chunked() || (!rp->content_length() && !rp->is_done())) {
            cres.chunked(true);  // close-delimited upstream bodies are re-framed as chunked
        }
        cres.keep_alive(client_keep_alive);
        auto got = co_await relay_body(up, ubuf, *rp, client, cres, &scrubber, limits.idle_timeout);
        rec.bytes_out = got.bytes;
        if (!got.ok()) {
            finish(ures.result_int(), got.read_ec ? "upstream_aborted" : "client_aborted",
                   got.read_ec ? "response_body" : "");
            co_return Exchange::Done;
        }
        finish(ures.result_int(), "", "");
        client_ka = client_keep_alive;
        upstream_reusable = ures.keep_alive() && rp->is_done();
        co_return Exchange::Done;
    };

    for (int attempt = 0;; ++attempt) {
        Exchange ex = tls_conn ? co_await exchange(*tls_conn->stream, tls_conn->buffer)
                               : co_await exchange(*plain_conn, plain_buf);
        if (ex == Exchange::Done || attempt > 0) {
            break;
        }
        spdlog::debug("conn={} pooled upstream connection was closed; retrying", scope.conn_id);
        tls_conn.reset();
        if (auto refusal = co_await connect(false)) {
            co_await write_refusal(client, refusal->status, refusal->reason, false);
            audit_refusal(scope, method, head.path, refusal->status, refusal->reason, started);
            co_return false;
        }
        rec.upstream_addr = peer.address().to_string() + ":" + std::to_string(peer.port());
    }
    if (tls_conn && upstream_reusable) {
        w.pool->release(std::move(tls_conn));
    }
    co_return client_ka;
}

}  // namespace

awaitable<void> serve_intercepted_http1(TlsStream& client, beast::flat_buffer& buffer,
                                        Scope& scope) {
    const auto& limits = scope.runtime->config->limits;
    bool first = true;
    for (;;) {
        http::request_parser<http::buffer_body> parser;
        parser.header_limit(static_cast<uint32_t>(limits.max_header_bytes));
        parser.body_limit(boost::none);
        lowest(client).expires_after(first ? limits.header_timeout : limits.idle_timeout);
        auto [ec, n] = co_await http::async_read_header(client, buffer, parser, use_nothrow);
        first = false;
        if (ec == http::error::end_of_stream || ec == net::error::eof ||
            ec == ssl::error::stream_truncated || ec == beast::error::timeout ||
            ec == net::error::operation_aborted) {
            break;  // clean close, idle timeout, or shutdown
        }
        if (ec == http::error::header_limit) {
            co_await write_refusal(client, 431, "header_too_large", false);
            audit_refusal(scope, "", "", 431, "header_too_large", Clock::now());
            break;
        }
        if (ec) {
            co_await write_refusal(client, 400, "bad_request", false);
            audit_refusal(scope, "", "", 400, "bad_request", Clock::now());
            break;
        }
        if (scope.worker->shared.draining.load()) {
            parser.get().keep_alive(false);
        }
        bool keep = co_await handle_request(client, buffer, parser, scope, false);
        if (!keep || scope.worker->shared.draining.load()) {
            break;
        }
    }
    // Send our close_notify without waiting for the peer's (it may never come).
    SSL_set_shutdown(client.native_handle(), SSL_RECEIVED_SHUTDOWN);
    lowest(client).expires_after(std::chrono::seconds(1));
    co_await client.async_shutdown(use_nothrow);
    error_code ignored;
    lowest(client).socket().shutdown(tcp::socket::shutdown_both, ignored);
}

awaitable<bool> forward_plain_http(TcpStream& client, beast::flat_buffer& buffer,
                                   http::request_parser<http::buffer_body>& parser, Scope& scope) {
    co_return co_await handle_request(client, buffer, parser, scope, true);
}

}  // namespace egress::proxy
