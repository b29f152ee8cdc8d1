#include "proxy/upstream.h"

#include <charconv>

#include <sys/socket.h>
#include <unistd.h>

#include "proxy/h2_client.h"
#include "tls/contexts.h"

namespace egress::proxy {

namespace {

tcp::endpoint to_endpoint(const policy::IpAddress& ip, uint16_t port) {
    if (ip.is_v4()) {
        net::ip::address_v4::bytes_type b{};
        std::copy_n(ip.bytes.begin(), 4, b.begin());
        return {net::ip::address_v4(b), port};
    }
    net::ip::address_v6::bytes_type b{};
    std::copy_n(ip.bytes.begin(), 16, b.begin());
    return {net::ip::address_v6(b), port};
}

}  // namespace

policy::IpAddress to_policy_address(const net::ip::address& a) {
    return dialled_address(unmapped(a));
}

policy::IpAddress dialled_address(const net::ip::address& a) {
    policy::IpAddress ip;
    if (a.is_v4()) {
        auto b = a.to_v4().to_bytes();
        std::copy(b.begin(), b.end(), ip.bytes.begin());
    } else {
        ip.family = policy::IpAddress::Family::V6;
        auto b = a.to_v6().to_bytes();
        std::copy(b.begin(), b.end(), ip.bytes.begin());
    }
    return ip;
}

namespace {

bool is_self(const Shared& s, const tcp::endpoint& ep) {
    for (const auto& own : s.own_listeners) {
        if (own.port() != ep.port()) {
            continue;
        }
        const auto a = unmapped(ep.address());
        if (own.address().is_unspecified() || a == own.address() || a.is_loopback() ||
            a.is_unspecified()) {
            return true;
        }
    }
    return false;
}

/// A dial the drain's cut ended (Worker::cut_all): audited as drain_timeout, like the work
/// the cut ends elsewhere; the client's connection is already shut down.
Refusal drain_cut_refusal() { return Refusal{503, "drain_timeout", ""}; }

}  // namespace

awaitable<Outcome<Dialed>> dial_upstream(Worker& w, const Runtime& rt,
                                         const policy::HostPort& dest, DialCut* dial) {
    const auto& limits = rt.config->limits;
    auto addrs = co_await w.resolver->resolve(dest.host);
    if (dial != nullptr && dial->stops()) {
        co_return client_gone_refusal();
    }
    if (!addrs) {
        spdlog::info("dns: {}: {}", dest.host, addrs.error());
        if (w.shared.drain_cut.load(std::memory_order_relaxed)) {
            co_return drain_cut_refusal();
        }
        co_return Refusal{502, "dns_failure", "dns"};
    }
    std::vector<tcp::endpoint> endpoints;
    for (const auto& ip : *addrs) {
        auto verdict = rt.addresses.vet(ip);
        if (!verdict.allowed) {
            spdlog::info("denied address {} for {}: {}", ip.to_string(), dest.host,
                         verdict.reason);
            co_return Refusal{403, verdict.reason.empty() ? "denied_address" : verdict.reason, ""};
        }
        auto ep = to_endpoint(ip, dest.port);
        if (is_self(w.shared, ep)) {
            co_return Refusal{403, "self_connection", ""};
        }
        endpoints.push_back(ep);
    }
    // Every answer was vetted (a denied one refuses the name); only the first
    // limits.max_dial_addresses are tried, so a name with dozens of answers that do not
    // answer holds the dial for that many connect_timeouts, not one per answer.
    if (endpoints.size() > limits.max_dial_addresses) {
        spdlog::debug("dial {}: trying {} of its {} addresses (limits.max_dial_addresses)",
                      dest.host, limits.max_dial_addresses, endpoints.size());
        endpoints.resize(limits.max_dial_addresses);
    }
    bool timed_out = false;
    for (const auto& ep : endpoints) {
        auto stream = std::make_unique<TcpStream>(w.ioc);
        stream->expires_after(limits.connect_timeout);
        error_code ec;
        {
            CutGuard cut(w, cancel_socket, &stream->socket(), dial);
            std::tie(ec) = co_await stream->async_connect(ep, use_nothrow);
        }
        if (ec == net::error::operation_aborted &&
            w.shared.drain_cut.load(std::memory_order_relaxed)) {
            co_return drain_cut_refusal();
        }
        if (dial != nullptr && dial->stops()) {
            co_return client_gone_refusal();
        }
        if (!ec) {
            stream->socket().set_option(tcp::no_delay(true), ec);
            stream->expires_never();
            co_return Dialed{std::move(stream), ep};
        }
        timed_out = timed_out || ec == beast::error::timeout;
        spdlog::info("connect {}:{} ({}) failed: {}", dest.host, dest.port,
                     ep.address().to_string(), ec.message());
    }
    if (timed_out) {
        co_return Refusal{504, "connect_timeout", "connect_timeout"};
    }
    co_return Refusal{502, "connect_failed", "connect"};
}

awaitable<Outcome<std::unique_ptr<TlsConn>>> tls_connect(Worker& w, const Runtime& rt, Dialed d,
                                                         const std::string& host,
                                                         const std::string& session_key,
                                                         bool h1_only, DialCut* dial) {
    auto conn = std::make_unique<TlsConn>();
    conn->peer = d.peer;
    // Asio added writability (EPOLLOUT) to the descriptor's registration to wait for the
    // connect, and never takes it away: every later wait's epoll_ctl would report the socket
    // writable too, a spurious event per read wait for the life of the connection. The
    // descriptor is registered again, for reads only (two calls, once per connection).
    tcp::socket dialed = d.stream->release_socket();
    error_code rec;
    const int fd = dialed.release(rec);
    tcp::socket fresh(w.ioc);
    if (!rec) {
        fresh.assign(d.peer.protocol(), fd, rec);
        if (rec) {
            ::close(fd);  // released, not adopted: ours to close
        }
    }
    if (rec) {
        spdlog::warn("upstream socket for {}: {}", host, rec.message());
        co_return Refusal{502, "connect_failed", "connect"};
    }
    conn->stream = std::make_unique<TlsStream>(std::move(fresh), *w.shared.client_ctx);
    SSL* ssl = conn->stream->native_handle();
    if (auto ok = tls::prepare_client(ssl, host); !ok) {
        spdlog::warn("tls setup for {}: {}", host, ok.error());
        co_return Refusal{502, "upstream_tls_failed", "tls"};
    }
    if (h1_only) {
        static constexpr unsigned char kHttp11[] = "\x08http/1.1";
        if (SSL_set_alpn_protos(ssl, kHttp11, sizeof kHttp11 - 1) != 0) {  // 0 is success
            co_return Refusal{502, "upstream_tls_failed", "tls"};
        }
    }
    if (w.tls_sessions) {
        w.tls_sessions->attach(ssl, session_key);  // offers the last ticket for this key
    }
    conn->stream->expires_after(rt.config->limits.tls_timeout);
    error_code ec;
    {
        CutGuard cut(w, cancel_socket, &conn->stream->socket(), dial);
        std::tie(ec) = co_await conn->stream->async_handshake(ssl::stream_base::client,
                                                              use_nothrow);
    }
    if (ec == net::error::operation_aborted &&
        w.shared.drain_cut.load(std::memory_order_relaxed)) {
        co_return drain_cut_refusal();
    }
    if (dial != nullptr && dial->stops()) {
        co_return client_gone_refusal();
    }
    if (ec) {
        if (ec == beast::error::timeout) {
            co_return Refusal{504, "upstream_tls_timeout", "tls_timeout", d.peer};
        }
        long verify = SSL_get_verify_result(ssl);
        spdlog::info("upstream tls {} ({}): {}{}", host, d.peer.address().to_string(),
                     ec.message(),
                     verify != X509_V_OK
                         ? std::string("; verify: ") + X509_verify_cert_error_string(verify)
                         : std::string());
        co_return Refusal{502, "upstream_tls_failed", "tls", d.peer};
    }
    conn->stream->expires_never();
    conn->alpn = tls::negotiated_alpn(ssl);
    spdlog::debug("upstream tls {} ({}): {}, {}", host, d.peer.address().to_string(),
                  SSL_get_version(ssl),
                  SSL_session_reused(ssl) == 1 ? "resumed" : "full handshake");
    co_return conn;
}

std::string UpstreamPool::key(const std::string& run, const policy::HostPort& dest) {
    // run "\n" authority, built in one string (once per request: no temporaries).
    const bool v6 = dest.is_ipv6_literal();
    std::string k;
    k.reserve(run.size() + dest.host.size() + 10);
    k.append(run);
    k.push_back('\n');
    if (v6) {
        k.push_back('[');
    }
    k.append(dest.host);
    k.append(v6 ? "]:" : ":");
    char port[8];
    k.append(port, std::to_chars(port, port + sizeof port, dest.port).ptr);
    return k;
}

std::unique_ptr<TlsConn> UpstreamPool::acquire(const std::string& key, bool retryable,
                                               std::chrono::milliseconds max_idle,
                                               const policy::AddressPolicy& addresses) {
    auto it = idle_.find(key);
    if (it == idle_.end()) {
        return nullptr;
    }
    auto& q = it->second;
    auto now = std::chrono::steady_clock::now();
    while (!q.empty()) {
        auto conn = std::move(q.back());
        q.pop_back();
        // Bytes already read (by our parser, or by OpenSSL's read-ahead: a close_notify that
        // came in behind the last response) mean the connection is not idle and clean.
        if (now - conn->idle_since > max_idle || conn->buffer.size() != 0 ||
            SSL_has_pending(conn->stream->native_handle()) == 1 ||
            !addresses.vet(dialled_address(conn->peer.address())).allowed) {
            continue;
        }
        if (retryable && now - conn->idle_since < kFreshIdle) {
            return conn;
        }
        // A peer that closed (0) or sent unsolicited bytes (>0) is not reusable.
        char byte;
        int fd = conn->stream->socket().native_handle();
        ssize_t n = ::recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            return conn;
        }
    }
    idle_.erase(it);
    return nullptr;
}

void UpstreamPool::release(std::unique_ptr<TlsConn> conn) {
    if (max_idle_ == 0) {
        return;  // pooling off: the connection closes here
    }
    auto& q = idle_[conn->key];
    if (q.size() >= max_idle_) {
        q.pop_front();
    }
    conn->idle_since = std::chrono::steady_clock::now();
    q.push_back(std::move(conn));
}

UpstreamPool::~UpstreamPool() {
    for (auto& [key, sessions] : h2_) {
        for (auto& p : sessions) {
            p.session->shutdown();
        }
    }
}

namespace {

/// Whether a pooled session can serve no request now or later: closed, or with no stream open
/// and none it may open (a GOAWAY, or SETTINGS_MAX_CONCURRENT_STREAMS 0). The latter is shut
/// down: kept, every request would dial a session beside it, and an upstream that answers
/// once, then allows no stream and keeps the connection busy (PINGs) would pile them up.
bool useless(const H2Pooled& p) {
    if (!p.session->alive()) {
        return true;
    }
    if (!p.session->has_capacity() && p.session->open_streams() == 0) {
        p.session->shutdown();
        return true;
    }
    return false;
}

}  // namespace

std::optional<H2Pooled> UpstreamPool::acquire_h2(const std::string& key,
                                                  const policy::AddressPolicy& addresses) {
    auto it = h2_.find(key);
    if (it == h2_.end()) {
        return std::nullopt;
    }
    auto& v = it->second;
    std::erase_if(v, [&](const H2Pooled& p) {
        return useless(p) || !addresses.vet(dialled_address(p.peer.address())).allowed;
    });
    for (auto& p : v) {
        if (p.session->has_capacity()) {
            return p;
        }
    }
    if (v.empty()) {
        h2_.erase(it);
    }
    return std::nullopt;
}

void UpstreamPool::add_h2(const std::string& key, H2Pooled s) {
    auto& v = h2_[key];
    std::erase_if(v, useless);
    v.push_back(std::move(s));
}

bool UpstreamPool::begin_dial(const std::string& key, net::any_io_executor ex) {
    if (auto h1 = h1_only_.find(key); h1 != h1_only_.end() && h1->second) {
        return true;
    }
    if (dialing_.count(key) != 0) {
        return false;
    }
    dialing_[key] = std::make_shared<Dialing>(ex);
    return true;
}

void UpstreamPool::end_dial(const std::string& key, std::optional<bool> negotiated_h2) {
    if (negotiated_h2) {
        h1_only_[key] = !*negotiated_h2;
    }
    if (auto it = dialing_.find(key); it != dialing_.end()) {
        it->second->done.cancel();
        dialing_.erase(it);
    }
}

awaitable<void> UpstreamPool::wait_dial(const std::string& key, DialCut* dial) {
    auto it = dialing_.find(key);
    if (it == dialing_.end()) {
        co_return;
    }
    auto dialing = it->second;  // kept alive past end_dial's erase
    ++dialing->waiters;
    // This waiter's own way out (the others go on waiting): its wait on the shared timer is
    // cancelled alone, through the operation's cancellation slot (completed by a posted
    // handler, as a Cuttable's cut must be).
    net::cancellation_signal leave;
    Cuttable node;
    node.cut = [](void* s) {
        static_cast<net::cancellation_signal*>(s)->emit(net::cancellation_type::terminal);
    };
    node.arg = &leave;
    if (dial != nullptr) {
        dial->waiting = &node;
    }
    co_await dialing->done.async_wait(net::bind_cancellation_slot(leave.slot(), use_nothrow));
    if (dial != nullptr) {
        dial->waiting = nullptr;
    }
    --dialing->waiters;
}

bool UpstreamPool::awaited(const std::string& key) const {
    auto it = dialing_.find(key);
    return it != dialing_.end() && it->second->waiters != 0;
}

bool DialCut::stops() const {
    return abandoned && !(pool != nullptr && pool->awaited(key));
}

void DialCut::cut(void* self) {
    auto* d = static_cast<DialCut*>(self);
    d->abandoned = true;
    if (d->waiting != nullptr && d->stops()) {
        d->waiting->cut(d->waiting->arg);
    }
}

}  // namespace egress::proxy
