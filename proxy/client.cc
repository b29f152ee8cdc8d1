// The forward-proxy port: identity, CONNECT (intercept or tunnel) and absolute-form http://.
#include <boost/url/parse.hpp>

#include "policy/header_rules.h"
#include "proxy/http1.h"
#include "tls/contexts.h"

namespace egress::proxy {

namespace {

using Clock = std::chrono::steady_clock;
using namespace net::experimental::awaitable_operators;
constexpr size_t kTunnelBufferBytes = 16 * 1024;

/// Counts a client connection against its run's connections_per_run limit.
class RunConnectionGuard {
public:
    bool acquire(std::shared_ptr<Run> run, size_t limit) {
        if (run->connections.fetch_add(1) >= limit) {
            run->connections.fetch_sub(1);
            return false;
        }
        run_ = std::move(run);
        return true;
    }
    ~RunConnectionGuard() {
        if (run_) {
            run_->connections.fetch_sub(1);
        }
    }

private:
    std::shared_ptr<Run> run_;
};

struct Identity {
    std::shared_ptr<Run> run;
    int status = 0;
    std::string reason;
};

Identity identify(const Runtime& rt, const http::request<http::buffer_body>& req) {
    auto it = req.find(http::field::proxy_authorization);
    if (it == req.end()) {
        if (rt.anonymous) {
            return {rt.anonymous, 0, ""};
        }
        return {nullptr, 407, "no_identity"};
    }
    std::string user;
    std::string pass;
    if (!parse_proxy_basic(it->value(), user, pass)) {
        return {nullptr, 407, "bad_identity"};
    }
    auto run = rt.find(user);
    bool ok = run && token_matches(*run, pass);
    std::string ended_reason;
    if (!run) {
        if (auto e = rt.ended.find(user);
            e != rt.ended.end() && credstore::constant_time_equals(sha256_hex(pass), e->second.first)) {
            ended_reason = e->second.second;
        }
    }
    OPENSSL_cleanse(pass.data(), pass.size());
    if (!ended_reason.empty()) {
        return {nullptr, 403, ended_reason};
    }
    if (!ok) {
        return {nullptr, 407, "bad_identity"};
    }
    return {run, 0, ""};
}

awaitable<void> pump(tcp::socket& from, tcp::socket& to, uint64_t& bytes,
                     Clock::time_point& last_activity) {
    auto buf = std::make_unique<char[]>(kTunnelBufferBytes);
    for (;;) {
        auto [ec, n] = co_await from.async_read_some(net::buffer(buf.get(), kTunnelBufferBytes),
                                                     use_nothrow);
        if (n > 0) {
            last_activity = Clock::now();
            auto [wec, wn] = co_await net::async_write(to, net::buffer(buf.get(), n), use_nothrow);
            bytes += wn;
            if (wec) {
                break;
            }
        }
        if (ec) {
            break;
        }
    }
    error_code ignored;
    to.shutdown(tcp::socket::shutdown_send, ignored);  // propagate the half-close
}

awaitable<void> idle_watchdog(Clock::time_point& last_activity, std::chrono::milliseconds idle) {
    net::steady_timer timer(co_await net::this_coro::executor);
    for (;;) {
        auto deadline = last_activity + idle;
        if (Clock::now() >= deadline) {
            co_return;
        }
        timer.expires_at(deadline);
        co_await timer.async_wait(use_nothrow);
    }
}

/// Blind relay for allowed, unpinned hosts under `unpinned: tunnel`.
awaitable<void> run_tunnel(TcpStream& client, beast::flat_buffer& buf, Scope& scope,
                           Clock::time_point started) {
    Worker& w = *scope.worker;
    InflightGuard inflight(w.shared);
    const Runtime& rt = *scope.runtime;
    auto dialed = co_await dial_upstream(w, rt, scope.target);
    if (auto* r = std::get_if<Refusal>(&dialed)) {
        if (!r->kind.empty()) {
            w.shared.metrics.upstream_error(r->kind);
        }
        co_await write_refusal(client, r->status, r->reason, false);
        audit_refusal(scope, "CONNECT", "", r->status, r->reason, started);
        co_return;
    }
    auto& d = std::get<Dialed>(dialed);
    static constexpr std::string_view kEstablished = "HTTP/1.1 200 Connection established\r\n\r\n";
    auto [ec, n] = co_await net::async_write(client.socket(), net::buffer(kEstablished), use_nothrow);
    if (ec) {
        co_return;
    }
    uint64_t up_bytes = 0;
    uint64_t down_bytes = 0;
    if (buf.size() > 0) {  // bytes the client sent right behind the CONNECT
        auto [wec, wn] = co_await net::async_write(d.stream->socket(), buf.data(), use_nothrow);
        up_bytes += wn;
        buf.consume(buf.size());
    }
    auto last_activity = Clock::now();
    auto& cs = client.socket();
    auto& us = d.stream->socket();
    co_await ((pump(cs, us, up_bytes, last_activity) && pump(us, cs, down_bytes, last_activity)) ||
              idle_watchdog(last_activity, rt.config->limits.idle_timeout));
    AuditRecord rec;
    rec.run = scope.run->policy.id;
    rec.method = "CONNECT";
    rec.host = scope.target.host;
    rec.port = scope.target.port;
    rec.status = 200;
    rec.decision = "allow";
    rec.reason = "tunnel";
    rec.bytes_in = up_bytes;
    rec.bytes_out = down_bytes;
    rec.duration_ms = std::chrono::duration<double, std::milli>(Clock::now() - started).count();
    rec.upstream_addr = d.peer.address().to_string() + ":" + std::to_string(d.peer.port());
    rec.proto_in = "tunnel";
    rec.proto_out = "tunnel";
    w.shared.audit->write(rec);
    w.shared.metrics.request("allow", "tunnel", rec.duration_ms / 1000.0);
}

/// TLS interception of a pinned (or intercepted) host with a leaf minted by the run CA.
awaitable<void> run_intercept(TcpStream& client, beast::flat_buffer& buf, Scope& scope,
                              Clock::time_point started) {
    Worker& w = *scope.worker;
    auto& leaves = *scope.run->leaves;
    auto misses_before = leaves.misses();
    auto leaf = leaves.get(scope.target.host);
    if (!leaf) {
        spdlog::error("conn={} leaf mint for {} failed: {}", scope.conn_id, scope.target.host,
                      leaf.error());
        co_await write_refusal(client, 502, "leaf_mint_failed", false);
        audit_refusal(scope, "CONNECT", "", 502, "leaf_mint_failed", started);
        co_return;
    }
    if (leaves.misses() != misses_before) {
        w.shared.metrics.certs_minted.fetch_add(1);
    } else {
        w.shared.metrics.cert_cache_hits.fetch_add(1);
    }
    static constexpr std::string_view kEstablished = "HTTP/1.1 200 Connection established\r\n\r\n";
    auto [ec, n] = co_await net::async_write(client.socket(), net::buffer(kEstablished), use_nothrow);
    if (ec) {
        co_return;
    }
    if (buf.size() > 0) {
        // A client that pipelines its ClientHello behind CONNECT before the 200: the bytes
        // are already in our buffer and cannot be handed to OpenSSL's socket BIO.
        co_await write_refusal(client, 400, "data_before_connect_response", false);
        audit_refusal(scope, "CONNECT", "", 400, "data_before_connect_response", started);
        co_return;
    }
    TlsStream tls(std::move(client), *w.shared.server_ctx);
    if (auto ok = tls::use_leaf(tls.native_handle(), **leaf); !ok) {
        spdlog::error("conn={} use_leaf: {}", scope.conn_id, ok.error());
        co_return;
    }
    const auto& limits = scope.runtime->config->limits;
    beast::get_lowest_layer(tls).expires_after(limits.tls_timeout);
    auto [hec] = co_await tls.async_handshake(ssl::stream_base::server, use_nothrow);
    if (hec) {
        spdlog::info("conn={} client tls handshake for {} failed: {}", scope.conn_id,
                     scope.target.host, hec.message());
        audit_refusal(scope, "CONNECT", "", 0, "client_tls_failed", started);
        co_return;
    }
    beast::get_lowest_layer(tls).expires_never();
    if (const char* sni = SSL_get_servername(tls.native_handle(), TLSEXT_NAMETYPE_host_name)) {
        auto norm = policy::normalize_host(sni);
        scope.sni = norm ? *norm : std::string("<invalid>");
    }
    scope.tls = true;
    if (tls::negotiated_alpn(tls.native_handle()) == "h2") {
        scope.proto_in = "h2";
        co_await serve_intercepted_h2(tls, scope);
        co_return;
    }
    beast::flat_buffer tls_buf;
    co_await serve_intercepted_http1(tls, tls_buf, scope);
}

bool secret_unavailable(const Run& run, const policy::HostPort& dest) {
    for (const auto& p : run.unavailable_pins) {
        if (p.matches(dest)) {
            return true;
        }
    }
    return false;
}

}  // namespace

awaitable<void> serve_proxy_client(tcp::socket socket, Worker& w) {
    Shared& shared = w.shared;
    shared.metrics.active_connections.fetch_add(1);
    struct ActiveGuard {
        Metrics& m;
        ~ActiveGuard() { m.active_connections.fetch_sub(1); }
    } active{shared.metrics};

    error_code ignored;
    socket.set_option(tcp::no_delay(true), ignored);
    TcpStream stream(std::move(socket));
    beast::flat_buffer buf;
    auto rt = shared.runtime.load();
    const auto& limits = rt->config->limits;
    Scope scope;
    scope.worker = &w;
    scope.runtime = rt;
    scope.conn_id = shared.next_conn_id.fetch_add(1);
    RunConnectionGuard run_guard;
    std::shared_ptr<int> fd_token;
    uint64_t registration = 0;
    struct RegistrationGuard {
        Shared& shared;
        Scope& scope;
        std::shared_ptr<int>& token;
        uint64_t& id;
        ~RegistrationGuard() {
            token.reset();  // same thread as any posted shutdown: the fd is never stale
            if (id != 0 && scope.run) {
                shared.connections.remove(scope.run->policy.id, id);
            }
        }
    } registration_guard{shared, scope, fd_token, registration};
    bool first = true;

    for (;;) {
        const auto started = Clock::now();
        http::request_parser<http::buffer_body> parser;
        parser.header_limit(static_cast<uint32_t>(limits.max_header_bytes));
        parser.body_limit(boost::none);
        stream.expires_after(first ? limits.header_timeout : limits.idle_timeout);
        auto [ec, n] = co_await http::async_read_header(stream, buf, parser, use_nothrow);
        first = false;
        if (ec == http::error::end_of_stream || ec == net::error::eof ||
            ec == beast::error::timeout || ec == net::error::operation_aborted) {
            co_return;
        }
        if (ec == http::error::header_limit) {
            co_await write_refusal(stream, 431, "header_too_large", false);
            audit_refusal(scope, "", "", 431, "header_too_large", started);
            co_return;
        }
        if (ec) {
            co_await write_refusal(stream, 400, "bad_request", false);
            audit_refusal(scope, "", "", 400, "bad_request", started);
            co_return;
        }
        stream.expires_never();
        auto& req = parser.get();
        std::string method(req.method_string());
        bool is_connect = req.method() == http::verb::connect;

        auto id = identify(*rt, req);
        if (!id.run) {
            co_await write_refusal(stream, id.status, id.reason, false);
            audit_refusal(scope, method, "", id.status, id.reason, started);
            co_return;
        }
        if (!scope.run) {
            if (!run_guard.acquire(id.run, limits.connections_per_run)) {
                scope.run = id.run;
                co_await write_refusal(stream, 429, "too_many_connections", false);
                audit_refusal(scope, method, "", 429, "too_many_connections", started);
                co_return;
            }
            scope.run = id.run;
            // Registered so that revoking the run closes this connection at once.
            fd_token = std::make_shared<int>(stream.socket().native_handle());
            registration = shared.connections.add(scope.run->policy.id,
                                                  stream.get_executor(), fd_token);
        } else if (scope.run->policy.id != id.run->policy.id) {
            co_await write_refusal(stream, 403, "identity_changed", false);
            audit_refusal(scope, method, "", 403, "identity_changed", started);
            co_return;
        }

        // Destination: CONNECT authority, or the absolute-form URI's authority.
        Outcome<policy::HostPort> dest = Refusal{400, "bad_request_target", ""};
        if (is_connect) {
            auto hp = policy::parse_authority(req.target(), std::nullopt);
            if (hp) {
                dest = *hp;
            }
        } else {
            auto url = boost::urls::parse_absolute_uri(req.target());
            if (!url) {
                dest = Refusal{400, "not_a_proxy_request", ""};
            } else if (url->scheme_id() != boost::urls::scheme::http) {
                dest = Refusal{400, "use_connect_for_https", ""};
            } else if (url->has_userinfo()) {
                dest = Refusal{400, "userinfo_in_uri", ""};
            } else {
                auto hp = policy::parse_authority(url->encoded_authority(), 80);
                if (hp) {
                    dest = *hp;
                }
            }
        }
        if (auto* r = std::get_if<Refusal>(&dest)) {
            co_await write_refusal(stream, r->status, r->reason, false);
            audit_refusal(scope, method, "", r->status, r->reason, started);
            co_return;
        }
        scope.target = std::get<policy::HostPort>(dest);
        scope.tls = false;
        scope.sni.reset();

        auto dd = policy::decide_destination(rt->config->policy, scope.run->policy, scope.target,
                                             policy::Clock::now());
        if (dd.carry == policy::Carry::Deny) {
            std::string reason = dd.reason;
            if (reason == "host_not_allowed" && secret_unavailable(*scope.run, scope.target)) {
                reason = "secret_unavailable";
            }
            bool ka = !is_connect && req.keep_alive() && parser.is_done();
            co_await write_refusal(stream, 403, reason, ka);
            audit_refusal(scope, method, is_connect ? "" : std::string(req.target()), 403, reason,
                          started);
            if (!ka) {
                co_return;
            }
            continue;
        }
        if (is_connect) {
            scope.proto_in = dd.carry == policy::Carry::Tunnel ? "tunnel" : "http/1.1";
            if (dd.carry == policy::Carry::Tunnel) {
                co_await run_tunnel(stream, buf, scope, started);
            } else {
                co_await run_intercept(stream, buf, scope, started);
            }
            co_return;
        }
        scope.proto_in = "http/1.1";
        bool keep = co_await forward_plain_http(stream, buf, parser, scope);
        if (!keep || shared.draining.load()) {
            co_return;
        }
    }
}

}  // namespace egress::proxy
