// The forward-proxy port: identity, CONNECT (intercept or tunnel) and absolute-form http://.
#include <poll.h>
#include <sys/socket.h>

#include <boost/url/parse.hpp>

#include "common/secure_zero.h"
#include "policy/header_rules.h"
#include "proxy/http1.h"
#include "tls/client_hello.h"
#include "tls/contexts.h"

namespace egress::proxy {

namespace {

using Clock = std::chrono::steady_clock;
using namespace net::experimental::awaitable_operators;
constexpr size_t kTunnelBufferBytes = 16 * 1024;

/// A client connection admitted to its run: counted against limits.connections_per_run and
/// registered so that revoking the run closes it at once. Released when the connection ends.
class RunAdmission {
public:
    explicit RunAdmission(Shared& shared) : shared_(shared) {}
    RunAdmission(const RunAdmission&) = delete;
    RunAdmission& operator=(const RunAdmission&) = delete;

    /// False (nothing held) when the run is at its connection limit. Holds the run's id, not
    /// the Run: a connection that outlives a rebuild of its run (a rotated secret) does not
    /// keep the old one's secrets in memory.
    bool admit(const Run& run, size_t limit, tcp::socket& socket) {
        fd_token_ = std::make_shared<RegisteredConn>(RegisteredConn{socket.native_handle()});
        registration_ =
            shared_.connections.add(run.policy.id, limit, socket.get_executor(), fd_token_);
        if (registration_ == 0) {
            fd_token_.reset();
            return false;
        }
        run_id_ = run.policy.id;
        return true;
    }
    /// Where the reason the connection was cut will be (read on the connection's executor).
    const char* const* cut_why() const { return fd_token_ ? &fd_token_->cut : nullptr; }
    ~RunAdmission() {
        fd_token_.reset();  // same thread as any posted shutdown: the fd is never stale
        if (registration_ != 0) {
            shared_.connections.remove(run_id_, registration_);
        }
    }

private:
    Shared& shared_;
    std::string run_id_;
    std::shared_ptr<RegisteredConn> fd_token_;
    uint64_t registration_ = 0;
};

/// Counts a client connection in egressd_active_connections.
struct ActiveConnection {
    explicit ActiveConnection(Metrics& m) : m_(m) { m_.active_connections.fetch_add(1); }
    ~ActiveConnection() { m_.active_connections.fetch_sub(1); }
    ActiveConnection(const ActiveConnection&) = delete;
    ActiveConnection& operator=(const ActiveConnection&) = delete;
    Metrics& m_;
};

struct Identity {
    std::shared_ptr<Run> run;
    int status = 0;
    std::string reason;
    std::string ended_run;  // a revoked or expired run whose token this request presented
};

Identity identify(const Runtime& rt, const H1RequestParser& req) {
    const std::string* auth = req.find("proxy-authorization");
    if (auth == nullptr) {
        if (rt.anonymous) {
            return {rt.anonymous, 0, "", {}};
        }
        return {nullptr, 407, "no_identity", {}};
    }
    std::string user;
    std::string pass;
    if (!parse_proxy_basic(*auth, user, pass)) {
        return {nullptr, 407, "bad_identity", {}};
    }
    auto run = rt.find(user);
    bool ok = run && token_matches(*run, pass);
    std::string ended_reason;
    if (!run) {
        if (auto e = rt.ended.find(user);
            e != rt.ended.end() && credstore::constant_time_equals(sha256_hex(pass),
                                                                   e->second.token_sha256)) {
            ended_reason = e->second.reason;
        }
    }
    egress::secure_zero(pass.data(), pass.size());
    if (!ended_reason.empty()) {
        return {nullptr, 403, ended_reason, user};
    }
    if (!ok) {
        return {nullptr, 407, "bad_identity", {}};
    }
    return {run, 0, "", {}};
}

/// Whether a blind tunnel's destination is still allowed: asked before each relayed read, it
/// decides again only when the control plane published a new runtime (a reload that denies
/// the host or narrows allow_networks, a run's allow list changed through the API), so an
/// open tunnel does not outlive the policy that let it open. It holds the run's id, not the
/// run or the runtime (run_tunnel lets go of both once the bytes flow).
class TunnelPolicy {
public:
    TunnelPolicy(Worker& w, std::string run_id, policy::HostPort target, tcp::endpoint peer)
        : w_(w), run_id_(std::move(run_id)), target_(std::move(target)),
          peer_(dialled_address(peer.address())) {}
    bool still_allowed() {
        const uint64_t gen = w_.shared.runtime_gen.load(std::memory_order_acquire);
        if (gen == gen_ || ended_) {
            return !ended_;
        }
        gen_ = gen;
        const auto& rt = w_.runtime();
        const auto* run = rt->lookup(run_id_);
        ended_ = run == nullptr ||
                 policy::decide_destination(rt->config->policy, (*run)->policy, target_,
                                            policy::Clock::now())
                         .carry == policy::Carry::Deny ||
                 !rt->addresses.vet(peer_).allowed;
        return !ended_;
    }
    bool ended() const { return ended_; }

private:
    Worker& w_;
    std::string run_id_;
    policy::HostPort target_;
    policy::IpAddress peer_;
    // No generation matches: the first relayed byte decides again, against the runtime of
    // that moment, so a change published while the tunnel was decided and dialled (a DNS
    // lookup, a connect; on the transparent listener the wait for the ClientHello) applies.
    uint64_t gen_ = std::numeric_limits<uint64_t>::max();
    bool ended_ = false;
};

awaitable<void> pump(tcp::socket& from, tcp::socket& to, uint64_t& bytes,
                     Clock::time_point& last_activity, TunnelPolicy& policy) {
    // The buffer is allocated when the first byte arrives: an idle tunnel holds none
    // (10 000 idle tunnels: bench/idle_tunnels.py).
    std::unique_ptr<char[]> buf;
    for (;;) {
        if (!buf) {
            auto [wec] = co_await from.async_wait(tcp::socket::wait_read, use_nothrow);
            if (wec) {
                break;
            }
            buf = std::make_unique<char[]>(kTunnelBufferBytes);
        }
        auto [ec, n] = co_await from.async_read_some(net::buffer(buf.get(), kTunnelBufferBytes),
                                                     use_nothrow);
        if (n > 0 && !policy.still_allowed()) {
            // Both directions end: the other one's wait is cut by the shutdown.
            error_code ignored;
            from.shutdown(tcp::socket::shutdown_both, ignored);
            to.shutdown(tcp::socket::shutdown_both, ignored);
            break;
        }
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

/// A CONNECT tunnel's first flight from the client, read (not forwarded) until it is known
/// what it is: when it is a TLS ClientHello, its server name must be the CONNECT host, or the
/// tunnel could front for a host the policy never allowed (SNI "forbidden.example" to the
/// address of an allowed host on a shared CDN). Not TLS (a server-speaks-first protocol, or
/// an SNI-less ClientHello) passes. Only the SNI can be checked on a blind tunnel; a Host
/// header inside the TLS is seen only when the host is intercepted (policy.unpinned:
/// intercept), where host agreement answers 421. A first flight in plain text that is an
/// HTTP/1 request head gets the same check on its Host (a CDN routes plain HTTP by Host
/// alone); as with the SNI, only the first request: the tunnel is not parsed after.
struct FirstFlight {
    std::string held;    // what the client sent so far: forwarded when accepted
    std::string reason;  // "" = accepted; else sni_mismatch, bad_client_hello, host_mismatch
    bool eof = false;    // the client closed or failed before it was known
};

enum class PlainHead : uint8_t { NotHttp, NeedMore, Agrees, Mismatch };

/// Whether `line` (a first line without its end, or what came of it so far: `whole` false) is
/// an HTTP/1 request line, "token SP target SP HTTP/": Yes, No, or Maybe (a prefix of one).
/// The separators are runs of SP and HTAB, as nginx and HAProxy read them (RFC 9112 has one
/// SP): with one SP only, "GET  /x HTTP/1.1" passed as not HTTP, and a server routed it by its
/// Host all the same. The version is the line's last word (blanks after it aside): a blank
/// inside the target ("GET /a\tb HTTP/1.1", which lenient parsers take) leaves it a request
/// line. Such lines then fail the strict parse: a mismatch. A line not yet whole is a Maybe
/// once its method is a token: its last word has not come.
enum class Shape : uint8_t { No, Maybe, Yes };
Shape request_line_shape(std::string_view line, bool whole) {
    constexpr std::string_view kBlank = " \t";
    const size_t i = line.find_first_of(kBlank);
    if (i == std::string_view::npos) {  // a method so far, or nothing
        return !whole && (line.empty() || policy::valid_header_name(line)) ? Shape::Maybe
                                                                            : Shape::No;
    }
    if (!policy::valid_header_name(line.substr(0, i))) {
        return Shape::No;
    }
    if (!whole) {
        return Shape::Maybe;
    }
    const size_t end = line.find_last_not_of(kBlank);  // past it: trailing blanks
    const size_t target = line.find_first_not_of(kBlank, i);
    const size_t last_blank = line.substr(0, end + 1).find_last_of(kBlank);
    if (target == std::string_view::npos || last_blank < target) {
        return Shape::No;  // "GET" and blanks, or "GET /x" (HTTP/0.9: no Host to route by)
    }
    return line.substr(last_blank + 1, end - last_blank).starts_with("HTTP/") ? Shape::Yes
                                                                              : Shape::No;
}

/// What a plain-text first flight says of the tunnel's host. Not shaped as an HTTP/1 request
/// line (another protocol: SMTP's "EHLO x", Redis, SSH's banner): passes. Shaped as one
/// (after any empty lines, which servers skip): its head must be whole within `max_head`
/// (limits.max_header_bytes, as any request head) and parse, name `host` in its one Host
/// field, and, in absolute or authority form, in its target too (a server routes by the target over Host); anything
/// else is a mismatch: a head a CDN would still route (bare LF line ends, an invalid field)
/// but the check skipped would be no check. As with the SNI, only the first request.
PlainHead plain_http_host(std::string_view held, const std::string& host, size_t max_head) {
    const size_t start = std::min(held.find_first_not_of("\r\n"), held.size());
    const std::string_view flight = held.substr(start);
    const size_t eol = flight.find('\n');
    std::string_view line = flight.substr(0, eol);
    if (!line.empty() && line.back() == '\r') {
        line.remove_suffix(1);
    }
    switch (request_line_shape(line, eol != std::string_view::npos)) {
        case Shape::No:
            return PlainHead::NotHttp;
        case Shape::Maybe:
            return held.size() > max_head ? PlainHead::Mismatch : PlainHead::NeedMore;
        case Shape::Yes:
            break;
    }
    H1RequestParser p;
    p.header_limit(static_cast<uint32_t>(max_head));
    p.eager(false);
    error_code ec;
    p.put(net::buffer(flight.data(), flight.size()), ec);
    if (ec == http::error::need_more && held.size() <= max_head) {
        return PlainHead::NeedMore;
    }
    if (ec || !p.is_header_done()) {
        return PlainHead::Mismatch;  // shaped as HTTP, and not a head that parses
    }
    auto names_host = [&](std::string_view authority) {
        auto hp = policy::parse_authority(authority, 80);
        return hp && hp->host == host;
    };
    const std::string_view target = p.target();
    if (!target.empty() && target.front() != '/' && target != "*") {
        auto url = boost::urls::parse_absolute_uri(target);
        if (url ? !names_host(url->encoded_authority()) : !names_host(target)) {
            return PlainHead::Mismatch;
        }
    }
    const std::string* value = nullptr;
    for (const auto& f : p.fields()) {  // names are lowercase
        if (f.name == "host") {
            if (value != nullptr) {
                return PlainHead::Mismatch;
            }
            value = &f.value;
        }
    }
    return value != nullptr && names_host(*value) ? PlainHead::Agrees : PlainHead::Mismatch;
}

awaitable<FirstFlight> read_first_flight(tcp::socket& from, beast::flat_buffer& early,
                                         const std::string& host, size_t max_head) {
    FirstFlight f;
    f.held.assign(static_cast<const char*>(early.data().data()), early.size());
    early.consume(early.size());
    using Status = tls::ClientHelloPeek::Status;
    // A plain head is parsed again only once a line end came with the last read: a head sent
    // a byte at a time costs a parse per line, not per byte.
    bool new_line = true;
    for (;;) {
        const auto p = tls::peek_client_hello(std::span<const uint8_t>(
            reinterpret_cast<const uint8_t*>(f.held.data()), f.held.size()));
        if (p.status == Status::NotTls && !new_line && f.held.size() <= max_head) {
            // Nothing that could change the verdict: wait for more.
        } else if (p.status == Status::NotTls) {
            const PlainHead head = plain_http_host(f.held, host, max_head);
            if (head == PlainHead::Mismatch) {
                f.reason = "host_mismatch";
            }
            if (head != PlainHead::NeedMore) {
                co_return f;
            }
        } else if (p.status == Status::Malformed) {
            f.reason = "bad_client_hello";
            co_return f;
        } else if (p.status == Status::Complete) {
            if (p.sni) {
                auto sni = policy::normalize_host(*p.sni);
                if (!sni || *sni != host) {
                    f.reason = "sni_mismatch";
                }
            }
            co_return f;
        }
        // NeedMore. Wait for readability first: a tunnel whose client stays silent (the
        // server speaks first) holds no buffer.
        auto [wec] = co_await from.async_wait(tcp::socket::wait_read, use_nothrow);
        if (wec) {
            f.eof = true;
            co_return f;
        }
        const size_t at = f.held.size();
        f.held.resize(at + kTunnelBufferBytes);
        auto [ec, n] = co_await from.async_read_some(net::buffer(f.held.data() + at,
                                                                 kTunnelBufferBytes),
                                                     use_nothrow);
        f.held.resize(at + n);
        if (ec) {
            f.eof = true;
            co_return f;
        }
        new_line = std::memchr(f.held.data() + at, '\n', n) != nullptr;
        // A ClientHello's bound, records' headers included (only for what starts as TLS: a
        // plain first flight is bounded by plain_http_host, and may be long, a body behind
        // its head or another protocol's first burst).
        if (f.held[0] == 0x16 && f.held.size() > tls::kMaxClientHello + 1024) {
            f.reason = "bad_client_hello";
            co_return f;
        }
    }
}

awaitable<bool> announce_established(TcpStream& client) {
    static constexpr std::string_view kEstablished = "HTTP/1.1 200 Connection established\r\n\r\n";
    auto [ec, n] = co_await net::async_write(client.socket(), net::buffer(kEstablished), use_nothrow);
    co_return !ec;
}

/// A new record of an allowed CONNECT (or transparent connection) of `scope`.
AuditRecord allowed_connection_record(Scope& scope) {
    AuditRecord rec;
    rec.req_id = scope.worker->next_req_id();
    rec.run = scope.run->policy.id;
    rec.method = scope.method;
    rec.host = scope.target.host;
    rec.port = scope.target.port;
    rec.decision = "allow";
    rec.proto_in = scope.proto_in;
    return rec;
}

/// The record of a CONNECT whose client left before its 200 could be written (while the
/// upstream was dialed, say): allowed, status 0, client_aborted, as a request whose client
/// left. `rec` is the tunnel's (its durable decision record names the same req_id), or
/// allowed_connection_record's for an intercepted host.
void audit_left_before_established(Scope& scope, AuditRecord rec, Clock::time_point started) {
    Worker& w = *scope.worker;
    rec.status = 0;
    rec.reason = "client_aborted";
    rec.duration_ms = std::chrono::duration<double, std::milli>(Clock::now() - started).count();
    w.audit(rec);
    w.metrics.request("allow", scope.proto_in, rec.duration_ms / 1000.0);
}

/// A tunnel's client, watched while its upstream is dialed as Downstream::abort_with watches
/// a request's: a client that leaves (its FIN with nothing unread, or a reset) cuts the dial
/// (DialCut::cut), which ends with client_aborted instead of holding the connection slot
/// until the connects time out. Bytes the client sends meanwhile end the watch, left unread
/// for the relay (a first flight sent ahead of the 200; on the transparent listener the
/// peeked first flight is there already, so the watch ends at once).
class TunnelDialWatch {
public:
    /// `talking`: the client's first flight came with its CONNECT head (it is in the relay's
    /// buffer, not in the socket): a FIN after it is a half-close, which ends the watch; a
    /// reset still cuts the dial.
    TunnelDialWatch(tcp::socket& socket, DialCut& dial, bool talking)
        : socket_(socket), state_(std::make_shared<State>(State{&dial})), talking_(talking) {
        arm();
    }
    ~TunnelDialWatch() {
        if (state_->dial != nullptr) {
            state_->dial = nullptr;
            error_code ignored;
            socket_.cancel(ignored);  // the wait below is the socket's only operation
        }
    }
    TunnelDialWatch(const TunnelDialWatch&) = delete;
    TunnelDialWatch& operator=(const TunnelDialWatch&) = delete;

private:
    struct State {
        DialCut* dial;  // null once the watch ended
    };
    void arm() {
        socket_.async_wait(tcp::socket::wait_read, [this, st = state_](error_code ec) {
            if (st->dial != nullptr && !ec) {
                readable(*st);
            }
        });
    }
    void readable(State& st) {
        char byte = 0;
        const ssize_t n =
            ::recv(socket_.native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
        if (n > 0) {
            st.dial = nullptr;  // the client's bytes, for the relay
            return;
        }
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
            arm();
            return;
        }
        if (n == 0 && talking_) {
            st.dial = nullptr;  // a half-close after bytes already read: the relay sends them
            return;
        }
        DialCut::cut(std::exchange(st.dial, nullptr));
    }
    tcp::socket& socket_;
    std::shared_ptr<State> state_;
    bool talking_;
};

/// Blind relay for allowed, unpinned hosts under `unpinned: tunnel`. `announce`: answer the
/// CONNECT with 200 first (false on the transparent listener, where there is no CONNECT).
awaitable<void> run_tunnel(TcpStream& client, beast::flat_buffer& buf, Scope& scope,
                           Clock::time_point started, bool announce) {
    Worker& w = *scope.worker;
    InflightGuard inflight(w);
    const Runtime& rt = *scope.runtime;
    DialCut dial;
    // A first flight read with the CONNECT head is in `buf`, not in the socket: the watch
    // must not take the client's half-close after it for a client gone (its bytes go to the
    // upstream once dialed), only a reset.
    std::optional<TunnelDialWatch> watch;
    watch.emplace(client.socket(), dial, buf.size() > 0);
    auto dialed = co_await dial_upstream(w, rt, scope.target, &dial);
    watch.reset();
    if (dial.abandoned) {
        // The client left while the upstream was dialed: no 200, nothing relayed (an upstream
        // reached in the same turn is closed unused).
        audit_left_before_established(scope, allowed_connection_record(scope), started);
        co_return;
    }
    if (auto* r = std::get_if<Refusal>(&dialed)) {
        if (!r->kind.empty()) {
            w.shared.metrics.upstream_error(r->kind);
        }
        if (announce) {
            co_await write_refusal(client, rt.config->limits.refusal_timeout, r->status,
                                   r->reason, false);
        }
        audit_refusal(scope, scope.method, "", r->status, r->reason, started);
        co_return;
    }
    auto& d = std::get<Dialed>(dialed);
    AuditRecord rec = allowed_connection_record(scope);
    rec.reason = "tunnel";
    rec.upstream_addr = endpoint_text(d.peer);
    rec.proto_in = "tunnel";
    rec.proto_out = "tunnel";
    if (w.shared.audit->durable()) {
        // audit.durable: the tunnel's decision is on disk before a byte reaches the upstream,
        // as a request's is before it leaves; if it cannot be written, nothing is relayed.
        AuditRecord pre = rec;
        pre.event = "decision";
        if (!co_await audit_durably(*w.shared.audit, pre)) {
            if (announce) {
                co_await write_refusal(client, rt.config->limits.refusal_timeout, 503,
                                       "audit_unavailable", false);
            }
            audit_refusal(scope, scope.method, "", 503, "audit_unavailable", started);
            co_return;
        }
    }
    if (announce) {
        const bool announced = co_await announce_established(client);
        if (!announced) {
            audit_left_before_established(scope, std::move(rec), started);
            co_return;
        }
    }
    uint64_t up_bytes = 0;
    uint64_t down_bytes = 0;
    auto last_activity = Clock::now();
    auto& cs = client.socket();
    auto& us = d.stream->socket();
    // The drain's cut (Worker::cut_all) ends the relay: an upstream that never closes after
    // the client's end (shut down at drain_timeout) kept it in flight past the loops' stop,
    // without its record.
    CutGuard cut(
        w,
        [](void* s) {
            error_code ignored;
            static_cast<tcp::socket*>(s)->shutdown(tcp::socket::shutdown_both, ignored);
            static_cast<tcp::socket*>(s)->cancel(ignored);
        },
        &us);
    std::string refused;
    const auto idle_timeout = rt.config->limits.idle_timeout;
    TunnelPolicy policy(w, scope.run->policy.id, scope.target, d.peer);
    // Once the bytes flow, the tunnel needs neither the runtime nor its run (the audit names
    // the run by id): one open for hours must not keep a replaced runtime, or the Run of a
    // secret rotated since (its pins hold the old value), in memory. `rt` is not used after.
    auto let_go = [&scope] {
        scope.run.reset();
        scope.runtime.reset();
    };
    // The destination refused since the tunnel was decided: nothing more either way.
    auto end_both = [&] {
        error_code ignored;
        cs.shutdown(tcp::socket::shutdown_both, ignored);
        us.shutdown(tcp::socket::shutdown_both, ignored);
        us.cancel(ignored);
    };
    // Client to upstream. Behind a CONNECT the first flight is checked (read_first_flight)
    // while the upstream's bytes flow the other way; on the transparent listener the SNI
    // already chose the destination, and the bytes go as they come.
    auto upward = [&]() -> awaitable<void> {
        if (announce) {
            FirstFlight first = co_await read_first_flight(cs, buf, scope.target.host,
                                                           rt.config->limits.max_header_bytes);
            if (!first.reason.empty()) {
                refused = first.reason;
                if (refused == "host_mismatch") {
                    // A plain HTTP request: answered as egressd answers one (421, the reason).
                    co_await write_refusal(client, rt.config->limits.refusal_timeout, 421,
                                           refused, false);
                } else {
                    // A TLS fatal alert, as a server that does not serve the name would send:
                    // unrecognized_name (112), or decode_error (50) for a malformed
                    // ClientHello.
                    const char alert[] = {
                        0x15, 0x03, 0x03, 0x00, 0x02, 0x02,
                        static_cast<char>(refused == "sni_mismatch" ? 112 : 50)};
                    co_await net::async_write(cs, net::buffer(alert, sizeof alert), use_nothrow);
                }
                error_code ignored;
                cs.shutdown(tcp::socket::shutdown_both, ignored);
                us.shutdown(tcp::socket::shutdown_both, ignored);
                us.cancel(ignored);  // ends the other direction's wait at once
                co_return;
            }
            if (!first.held.empty() && !policy.still_allowed()) {
                end_both();
                co_return;
            }
            if (!first.held.empty()) {
                last_activity = Clock::now();
                auto [wec, wn] = co_await net::async_write(us, net::buffer(first.held), use_nothrow);
                up_bytes += wn;
                if (wec) {
                    co_return;
                }
            }
            let_go();
            if (first.eof) {
                error_code ignored;
                us.shutdown(tcp::socket::shutdown_send, ignored);
                co_return;
            }
        } else {
            let_go();
            if (buf.size() > 0 && !policy.still_allowed()) {
                end_both();
                co_return;
            }
            if (buf.size() > 0) {
                auto [wec, wn] = co_await net::async_write(us, buf.data(), use_nothrow);
                up_bytes += wn;
                buf.consume(buf.size());
            }
        }
        co_await pump(cs, us, up_bytes, last_activity, policy);
    };
    co_await ((upward() && pump(us, cs, down_bytes, last_activity, policy)) ||
              idle_watchdog(last_activity, idle_timeout));
    if (!refused.empty()) {
        spdlog::info("conn={} tunnel to {}:{} refused: {} (the {} is not the CONNECT host)",
                     scope.conn_id, scope.target.host, scope.target.port, refused,
                     refused == "host_mismatch" ? "Host of its first request" : "TLS server name");
        audit_refusal(scope, scope.method, "", refused == "bad_client_hello" ? 400 : 421,
                      refused, started, rec.req_id);
        co_return;
    }
    rec.status = 200;
    if (policy.ended()) {
        rec.reason = "policy_changed";  // relayed, then ended: the destination is now refused
        spdlog::info("conn={} tunnel to {}:{} closed: the policy no longer allows it",
                     scope.conn_id, scope.target.host, scope.target.port);
    } else if (const char* cut = scope.cut()) {
        rec.reason = cut;  // relayed, then cut with its run's connections
    }
    rec.bytes_in = up_bytes;
    rec.bytes_out = down_bytes;
    rec.duration_ms = std::chrono::duration<double, std::milli>(Clock::now() - started).count();
    w.audit(rec);
    w.metrics.request("allow", "tunnel", rec.duration_ms / 1000.0);
}

/// TLS interception of a pinned (or intercepted) host with a leaf minted by the run CA.
/// `announce` as for run_tunnel; without it the ClientHello is still unread in the socket.
/// `begun` counts the connection in flight from its CONNECT (or ClientHello) until its TLS
/// handshake is done and its first request's head read (HTTP/1.1), or its HTTP/2 session
/// starts (the drain's GOAWAY then says which streams were taken).
awaitable<void> run_intercept(TcpStream& client, beast::flat_buffer& buf, Scope& scope,
                              Clock::time_point started, bool announce,
                              std::optional<InflightGuard>& begun) {
    Worker& w = *scope.worker;
    if (buf.size() > 0) {
        // A client that pipelines its ClientHello behind CONNECT before the 200: the bytes
        // are already in our buffer and cannot be handed to OpenSSL's socket BIO. Refused
        // before the 200, so the client reads the refusal as the answer to its CONNECT.
        co_await write_refusal(client, scope.runtime->config->limits.refusal_timeout, 400,
                               "data_before_connect_response", false);
        audit_refusal(scope, scope.method, "", 400, "data_before_connect_response", started);
        co_return;
    }
    auto& leaves = *scope.run->leaves;
    auto misses_before = leaves.misses();
    auto leaf = leaves.get(scope.target.host);
    if (!leaf) {
        const bool rate = leaf.error() == tls::kMintRateExceeded;
        const bool outside = leaf.error() == tls::kOutsideRunCa;
        int status = rate ? 429 : outside ? 403 : 502;
        std::string reason = rate      ? std::string(tls::kMintRateExceeded)
                             : outside ? std::string(tls::kOutsideRunCa)
                                       : "leaf_mint_failed";
        if (rate) {
            spdlog::warn("conn={} run {}: leaf mint rate exceeded (limits.leaf_mints_per_minute)",
                         scope.conn_id, scope.run->policy.id);
        } else if (outside) {
            spdlog::warn("conn={} run {}: {} is outside the names its CA may certify (fixed when "
                         "the run was created); refused, not intercepted",
                         scope.conn_id, scope.run->policy.id, scope.target.host);
        } else {
            spdlog::error("conn={} leaf mint for {} failed: {}", scope.conn_id, scope.target.host,
                          leaf.error());
        }
        if (announce) {
            // Over the mint rate: Retry-After is when the run's bucket holds a mint again.
            const auto retry = rate ? leaves.mint_retry_after() : std::chrono::seconds(1);
            co_await write_refusal(client, scope.runtime->config->limits.refusal_timeout, status,
                                   reason, false, false, retry);
        }
        audit_refusal(scope, scope.method, "", status, reason, started);
        co_return;
    }
    if (leaves.misses() != misses_before) {
        w.shared.metrics.certs_minted.fetch_add(1);
    } else {
        w.shared.metrics.cert_cache_hits.fetch_add(1);
    }
    if (announce) {
        const bool announced = co_await announce_established(client);
        if (!announced) {
            audit_left_before_established(scope, allowed_connection_record(scope), started);
            co_return;
        }
    }
    TlsStream tls(std::move(client), *w.shared.server_ctx);
    if (auto ok = tls::use_leaf(tls.native_handle(), **leaf); !ok) {
        spdlog::error("conn={} use_leaf: {}", scope.conn_id, ok.error());
        audit_refusal(scope, scope.method, "", 0, "leaf_install_failed", started);
        co_return;
    }
    const auto& limits = scope.runtime->config->limits;
    tls.expires_after(limits.tls_timeout);
    auto [hec] = co_await tls.async_handshake(ssl::stream_base::server, use_nothrow);
    if (hec) {
        spdlog::info("conn={} client tls handshake for {} failed: {}", scope.conn_id,
                     scope.target.host, hec.message());
        audit_refusal(scope, scope.method, "", 0, "client_tls_failed", started);
        co_return;
    }
    tls.expires_never();
    // This ClientHello's name, also on a resumed TLS 1.2 session (SSL_get_servername gives
    // the session's there, or none): a sandbox could otherwise resume a session and send
    // another name unchecked.
    if (auto sni = tls::client_hello_sni(tls.native_handle())) {
        auto norm = policy::normalize_host(*sni);
        scope.sni = norm ? *norm : std::string("<invalid>");
    }
    scope.tls = true;
    if (tls::negotiated_alpn(tls.native_handle()) == "h2") {
        scope.proto_in = "h2";
        begun.reset();
        co_await serve_intercepted_h2(tls, scope);
        co_return;
    }
    beast::flat_buffer tls_buf;
    co_await serve_intercepted_http1(tls, tls_buf, scope, begun);
}

/// Called right after a connection was registered for its run (RunAdmission::admit): the
/// identity was checked against a runtime that a revoke may have replaced before the
/// registration, when closing the run's connections could not see this one yet. Registered
/// first and checked second, a revoke either finds the connection or is seen here.
bool still_live(Worker& w, const Run& run) {
    return w.runtime()->lookup(run.policy.id) != nullptr;
}

/// The forward port's requests on one client connection; `unread`: the last one's body was
/// left unread (an early answer).
awaitable<void> proxy_requests(TcpStream& stream, Worker& w, bool& unread) {
    Shared& shared = w.shared;
    beast::flat_buffer buf;
    Scope scope;
    scope.worker = &w;
    scope.conn_id = shared.next_conn_id.fetch_add(1);
    RunAdmission admission(shared);
    UnidentifiedGuard unidentified(w, stream.socket());
    bool first = true;

    // The runtime as it is now; assigned only when it changed (no reference count per request).
    auto refresh = [&scope, &w] {
        if (scope.runtime != w.runtime()) {
            scope.runtime = w.runtime();
        }
    };
    for (;;) {
        const auto started = Clock::now();
        refresh();
        H1RequestParser parser;
        UnreadBodyNote note{parser, unread};
        std::optional<InflightGuard> begun;  // from the head's first byte (read_request_head)
        auto got = co_await read_request_head(stream, buf, parser, first,
                                              scope.runtime->config->limits, w, begun);
        // The identity is checked against the runtime of this head, not of the accept or of
        // the previous request: a head may come seconds later, after a revoke.
        refresh();
        const auto& rt = scope.runtime;
        const auto& limits = rt->config->limits;
        first = false;
        if (got != HeadRead::Ok) {
            co_await refuse_head(stream, got, scope, started);
            co_return;
        }
        std::string method(parser.method_string());
        bool is_connect = parser.method() == http::verb::connect;

        // Destination first: CONNECT authority, or the absolute-form URI's authority. Every
        // record of this head, a refusal of its identity too, names this request's
        // destination (and its path without the scheme and authority), never the previous
        // request's on a keep-alive connection.
        Outcome<policy::HostPort> dest = Refusal{400, "bad_request_target", ""};
        std::string rec_path;  // "" for CONNECT and what is not absolute-form
        if (is_connect) {
            auto hp = policy::parse_authority(parser.target(), std::nullopt);
            if (hp) {
                dest = *hp;
            }
        } else {
            auto url = boost::urls::parse_absolute_uri(parser.target());
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
            if (url) {
                rec_path = audit_path(parser.target());
            }
        }
        scope.target = policy::HostPort{};
        if (auto* hp = std::get_if<policy::HostPort>(&dest)) {
            scope.target = *hp;
        }
        scope.tls = false;
        scope.sni.reset();

        auto id = identify(*rt, parser);
        if (!id.run) {
            // The connection ends here: the run of an earlier request on it does not answer
            // for this one. An ended run is named (its token was checked); an unknown name
            // is not.
            scope.run.reset();
            co_await write_refusal(stream, limits.refusal_timeout, id.status, id.reason, false);
            audit_refusal(scope, method, rec_path, id.status, id.reason, started, 0,
                          id.ended_run.empty() ? nullptr : &id.ended_run);
            co_return;
        }
        // The run is held by the scope alone from here (moved out of `id`), so a tunnel or a
        // connection that lets go of it (run_tunnel, serve_intercepted_h2) really does.
        if (!scope.run) {
            scope.run = std::move(id.run);
            unidentified.identified();  // counted by its run from here
            if (!admission.admit(*scope.run, limits.connections_per_run, stream.socket())) {
                co_await write_refusal(stream, limits.refusal_timeout, 429,
                                       "too_many_connections", false);
                audit_refusal(scope, method, rec_path, 429, "too_many_connections", started);
                co_return;
            }
            scope.cut_why = admission.cut_why();
            if (!still_live(w, *scope.run)) {
                const char* reason = run_end_reason(*scope.run);
                co_await write_refusal(stream, limits.refusal_timeout, 403, reason, false);
                audit_refusal(scope, method, rec_path, 403, reason, started);
                co_return;
            }
        } else if (scope.run->policy.id != id.run->policy.id) {
            co_await write_refusal(stream, limits.refusal_timeout, 403, "identity_changed",
                                   false);
            // Named by the identity this request proved, not the connection's first one.
            const std::string proved = id.run->policy.id;
            audit_refusal(scope, method, rec_path, 403, "identity_changed", started, 0, &proved);
            co_return;
        } else {
            scope.run = std::move(id.run);  // the same run, maybe rebuilt since (a reload)
        }

        if (auto* r = std::get_if<Refusal>(&dest)) {
            co_await write_refusal(stream, limits.refusal_timeout, r->status, r->reason, false);
            audit_refusal(scope, method, rec_path, r->status, r->reason, started);
            co_return;
        }

        auto dd = policy::decide_destination(rt->config->policy, scope.run->policy, scope.target,
                                             policy::Clock::now());
        if (dd.carry == policy::Carry::Deny) {
            std::string reason(destination_refusal_reason(*scope.run, rt->config->policy,
                                                          scope.target, dd.reason));
            bool ka = !is_connect && parser.keep_alive() && parser.is_done();
            co_await write_refusal(stream, limits.refusal_timeout, 403, reason, ka,
                                   parser.method() == http::verb::head);
            audit_refusal(scope, method, rec_path, 403, reason, started);
            if (!ka) {
                co_return;
            }
            continue;
        }
        if (is_connect) {
            scope.proto_in = dd.carry == policy::Carry::Tunnel ? "tunnel" : "http/1.1";
            scope.method = "CONNECT";
            if (dd.carry == policy::Carry::Tunnel) {
                begun.reset();  // the tunnel counts itself
                co_await run_tunnel(stream, buf, scope, started, true);
            } else {
                co_await run_intercept(stream, buf, scope, started, true, begun);
            }
            co_return;
        }
        scope.proto_in = "http/1.1";
        begun.reset();  // the request counts itself from here (serve_exchange)
        bool keep = co_await forward_plain_http(stream, buf, parser, scope);
        if (!keep || shared.draining.load()) {
            co_return;
        }
    }
}

/// Ends a client connection served in the clear (the proxy port's, the transparent port's
/// plain HTTP): a lingering close when the drain ended it (counted until it is closed; taken
/// with no wait since its last response stopped counting in flight; nothing to read if the
/// socket went to a TLS stream), or when a request body was left unread.
awaitable<void> end_plain_client(TcpStream& stream, Worker& w, bool unread) {
    if (w.shared.draining.load()) {
        ClosingGuard closing(w);
        co_await drain_close(stream.socket(), w);
    } else if (unread) {
        co_await linger_close(stream.socket(), w.runtime()->config->limits.linger_timeout);
    }
}

}  // namespace

awaitable<void> serve_proxy_client(tcp::socket socket, Worker& w) {
    ActiveConnection active(w.shared.metrics);
    error_code ignored;
    socket.set_option(tcp::no_delay(true), ignored);
    TcpStream stream(std::move(socket));
    bool unread = false;
    co_await proxy_requests(stream, w, unread);
    co_await end_plain_client(stream, w, unread);
}

namespace {

constexpr int kSoOriginalDst = 80;  // SO_ORIGINAL_DST (linux/netfilter_ipv4.h) and
                                    // IP6T_SO_ORIGINAL_DST (linux/netfilter_ipv6/ip6_tables.h)

/// The destination the client dialled before the kernel redirected it to us (iptables or
/// nftables REDIRECT/DNAT record it in conntrack). Nullopt if the socket was not redirected.
std::optional<tcp::endpoint> original_destination(tcp::socket& socket) {
    const int fd = socket.native_handle();
    tcp::endpoint ep;
    socklen_t len = static_cast<socklen_t>(ep.capacity());
    error_code ec;
    auto local = socket.local_endpoint(ec);
    if (ec) {
        return std::nullopt;
    }
    if (local.address().is_v6() && !local.address().to_v6().is_v4_mapped() &&
        ::getsockopt(fd, SOL_IPV6, kSoOriginalDst, ep.data(), &len) == 0) {
        ep.resize(len);
    } else if (len = static_cast<socklen_t>(ep.capacity());
               ::getsockopt(fd, SOL_IP, kSoOriginalDst, ep.data(), &len) == 0) {
        ep.resize(len);
    } else {
        return std::nullopt;
    }
    // Dialled the transparent port directly: nothing was redirected. Compared unmapped: on a
    // dual-stack listener ([::]:P) an IPv4 client's socket is AF_INET6 (::ffff:a.b.c.d) while
    // conntrack answers AF_INET, so a plain comparison never matched.
    if (unmapped(ep.address()) == unmapped(local.address()) && ep.port() == local.port()) {
        return std::nullopt;
    }
    return ep;
}

struct Peeked {
    tls::ClientHelloPeek hello;
    bool eof = false;  // closed or timed out before a decision
};

/// How many bytes of the connection a peek must see before what it holds can change the
/// verdict: the end of the TLS record the bytes stop in, or of its 5-byte header (the
/// records before it are whole: peek_client_hello read them and wants more). `got` is a
/// prefix peek_client_hello answered NeedMore for.
size_t client_hello_bytes_wanted(std::span<const uint8_t> got) {
    size_t pos = 0;
    while (got.size() - pos >= 5) {
        const size_t len = (size_t{got[pos + 3]} << 8) | got[pos + 4];
        if (got.size() - pos - 5 < len) {
            return pos + 5 + len;
        }
        pos += 5 + len;
    }
    return pos + 5;
}

/// SO_RCVLOWAT: the bytes a TCP socket must hold before poll/epoll report it readable (Linux
/// honours it for TCP, and since 4.18 does not even wake the waiter before); end of stream
/// and errors are reported whatever it says. Peeked bytes are not consumed, so they count.
bool set_receive_low_water(int fd, size_t bytes) {
    const int v = static_cast<int>(bytes);
    return ::setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &v, sizeof v) == 0;
}

/// Whether the peer shut its sending side (its FIN arrived), without consuming anything.
bool peer_sent_fin(int fd) {
    pollfd p{fd, POLLRDHUP, 0};
    return ::poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

/// Waits for the start of the connection and peeks (MSG_PEEK: nothing is consumed) until it is
/// a complete ClientHello, clearly not TLS, or malformed; bounded by `deadline`.
///
/// Peeked bytes stay unread, so the socket stays readable: a ClientHello stalled partway was
/// woken (and peeked, up to 16 KiB copied) every 5 ms until the deadline, ~0.2% of a core per
/// connection. Each wait now sets the socket's receive low-water mark to the end of the
/// record the bytes stop in (client_hello_bytes_wanted), so the kernel wakes it once that
/// record (or its header) is there, or at the peer's FIN; the mark is back at 1 before the
/// socket is read for real. A FIN before the ClientHello is whole ends the wait at once (its
/// rest cannot come). A wake without new bytes and without a FIN (the kernel also reports a
/// socket under memory pressure readable) waits before peeking again, 5 ms doubling up to
/// 200 ms, as every wait did when the mark cannot be set.
awaitable<Peeked> peek_first_bytes(tcp::socket& socket, Clock::time_point deadline) {
    std::vector<uint8_t> buf(5 + tls::kMaxClientHello + 5 * 4);  // record headers of a split hello
    net::steady_timer timer(co_await net::this_coro::executor);
    const int fd = socket.native_handle();
    constexpr auto kFirstPause = std::chrono::milliseconds(5);
    constexpr auto kLongestPause = std::chrono::milliseconds(200);
    auto pause = kFirstPause;
    size_t last = 0;
    bool low_water_set = false;
    for (;;) {
        timer.expires_at(deadline);
        auto r = co_await (socket.async_wait(tcp::socket::wait_read, use_nothrow) ||
                           timer.async_wait(use_nothrow));
        if (r.index() == 1) {
            co_return Peeked{{}, true};
        }
        if (low_water_set) {
            // Whatever comes next (OpenSSL, a relay, the HTTP parser) reads as usual.
            set_receive_low_water(fd, 1);
            low_water_set = false;
        }
        error_code ec;
        size_t n = socket.receive(net::buffer(buf), tcp::socket::message_peek, ec);
        if (ec || n == 0) {
            co_return Peeked{{}, true};
        }
        auto p = tls::peek_client_hello(std::span<const uint8_t>(buf.data(), n));
        if (p.status != tls::ClientHelloPeek::Status::NeedMore) {
            co_return Peeked{std::move(p), false};
        }
        if (n == buf.size()) {
            co_return Peeked{{tls::ClientHelloPeek::Status::Malformed, {}}, false};
        }
        if (n == last) {
            if (peer_sent_fin(fd)) {
                co_return Peeked{{}, true};
            }
            timer.expires_at(std::min(deadline, Clock::now() + pause));
            co_await timer.async_wait(use_nothrow);
            pause = std::min(pause * 2, kLongestPause);
        } else {
            pause = kFirstPause;
        }
        last = n;
        if (Clock::now() >= deadline) {
            co_return Peeked{{}, true};
        }
        const size_t wanted = std::min(
            client_hello_bytes_wanted(std::span<const uint8_t>(buf.data(), n)), buf.size());
        low_water_set = set_receive_low_water(fd, wanted);
    }
}

/// Cleartext HTTP on the transparent listener: origin-form requests, the host from Host and
/// the port from the original destination (they must agree).
awaitable<void> transparent_requests(TcpStream& stream, Scope& scope, uint16_t port,
                                     bool& unread) {
    Worker& w = *scope.worker;
    Shared& shared = w.shared;
    beast::flat_buffer buf;
    bool first = true;
    for (;;) {
        const auto started = Clock::now();
        // Each request reads the runtime as it is now (a reload's limits and policy apply to
        // a keep-alive connection's next request, and it does not keep the one it began with).
        refresh_scope(scope);
        const auto& limits = scope.runtime->config->limits;
        H1RequestParser parser;
        UnreadBodyNote note{parser, unread};
        std::optional<InflightGuard> begun;  // from the head's first byte (read_request_head)
        auto got = co_await read_request_head(stream, buf, parser, first, limits, w, begun);
        first = false;
        if (got != HeadRead::Ok) {
            co_await refuse_head(stream, got, scope, started);
            co_return;
        }
        std::string method(parser.method_string());
        const std::string* host = parser.find("host");
        auto dest = host == nullptr ? Result<policy::HostPort>(make_error("no Host"))
                                    : policy::parse_authority(*host, 80);
        std::string reason;
        int status = 400;
        if (!dest) {
            reason = "bad_host";
        } else if (dest->port != port) {
            status = 421;  // as every other host_mismatch
            reason = "host_mismatch";  // Host names another port than the one dialled
        }
        if (!reason.empty()) {
            co_await write_refusal(stream, limits.refusal_timeout, status, reason, false);
            audit_refusal(scope, method, audit_path(parser.target()), status, reason, started);
            co_return;
        }
        scope.target = *dest;
        auto dd = policy::decide_destination(scope.runtime->config->policy, scope.run->policy,
                                             scope.target, policy::Clock::now());
        if (dd.carry == policy::Carry::Deny) {
            // As on the forward port: a pinned host whose secret is missing says so.
            const std::string reason(destination_refusal_reason(
                *scope.run, scope.runtime->config->policy, scope.target, dd.reason));
            bool ka = parser.keep_alive() && parser.is_done();
            co_await write_refusal(stream, limits.refusal_timeout, 403, reason, ka,
                                   parser.method() == http::verb::head);
            audit_refusal(scope, method, audit_path(parser.target()), 403, reason, started);
            if (!ka) {
                co_return;
            }
            continue;
        }
        begun.reset();  // the request counts itself from here (serve_exchange)
        bool keep = co_await forward_origin_http(stream, buf, parser, scope);
        if (!keep || shared.draining.load()) {
            co_return;
        }
    }
}

awaitable<void> serve_transparent_http(TcpStream& stream, Scope& scope, uint16_t port) {
    bool unread = false;
    co_await transparent_requests(stream, scope, port, unread);
    co_await end_plain_client(stream, *scope.worker, unread);
}

}  // namespace

awaitable<void> serve_transparent_client(tcp::socket socket, Worker& w) {
    Shared& shared = w.shared;
    ActiveConnection active(shared.metrics);
    const auto started = Clock::now();
    error_code ec;
    socket.set_option(tcp::no_delay(true), ec);
    Scope scope;
    scope.worker = &w;
    scope.runtime = w.runtime();
    // Only until the connection is handed to its serving function below, which may move
    // scope.runtime to a newer runtime (so this connection does not keep the one it began with).
    const Runtime& rt = *scope.runtime;
    const auto& limits = rt.config->limits;
    scope.conn_id = shared.next_conn_id.fetch_add(1);
    scope.method = "TLS";
    scope.proto_in = "transparent";

    auto original = original_destination(socket);
    if (!original) {
        spdlog::info("conn={} transparent: not a redirected connection", scope.conn_id);
        audit_refusal(scope, "", "", 400, "no_original_destination", started);
        co_return;
    }
    auto peer = socket.remote_endpoint(ec);
    if (ec) {
        co_return;
    }
    // Identity: the run bound to the client's source address (or the sidecar's only run).
    auto match = rt.find_by_source(to_policy_address(peer.address()));
    if (!match.ended.empty()) {
        // Bound to a run that was revoked or expired: refused as its token would be, never
        // handed to a broader run (or the anonymous one) instead.
        audit_refusal(scope, "", "", 403, std::string(match.ended), started);
        co_return;
    }
    scope.run = std::move(match.run);
    if (!scope.run) {
        spdlog::info("conn={} transparent: no run for source {}", scope.conn_id,
                     peer.address().to_string());
        audit_refusal(scope, "", "", 403, "no_identity", started);
        co_return;
    }
    RunAdmission admission(shared);
    if (!admission.admit(*scope.run, limits.connections_per_run, socket)) {
        audit_refusal(scope, "", "", 429, "too_many_connections", started);
        co_return;
    }
    scope.cut_why = admission.cut_why();
    if (!still_live(w, *scope.run)) {
        audit_refusal(scope, "", "", 403, run_end_reason(*scope.run), started);
        co_return;
    }

    auto peeked = co_await peek_first_bytes(socket, started + limits.header_timeout);
    if (peeked.eof) {
        if (Clock::now() >= started + limits.header_timeout) {
            // egressd gives up on a ClientHello that did not come whole: a refusal, recorded
            // (status 0: the connection is closed, there is nothing to answer in). A client
            // that closed first is a client leaving.
            audit_refusal(scope, "", "", 0, "header_timeout", started);
        }
        co_return;
    }
    using Status = tls::ClientHelloPeek::Status;
    TcpStream stream(std::move(socket));
    if (peeked.hello.status == Status::NotTls) {
        scope.proto_in = "http/1.1";
        co_await serve_transparent_http(stream, scope, original->port());
        co_return;
    }
    if (peeked.hello.status == Status::Malformed) {
        audit_refusal(scope, "", "", 400, "bad_client_hello", started);
        co_return;
    }
    // The host is the SNI; without one, the address that was dialled. The credential only
    // ever goes where egressd itself resolves and vets that host (never to the original
    // address the sandbox chose), so a ClientHello naming a pinned host while dialling
    // another address gains nothing: the request reaches the pinned host.
    auto norm = policy::normalize_host(original->address().to_string());
    if (peeked.hello.sni) {
        norm = policy::normalize_host(*peeked.hello.sni);
        if (!norm) {
            audit_refusal(scope, "", "", 400, "bad_sni", started);
            co_return;
        }
    }
    if (!norm) {
        co_return;
    }
    const std::string host = *norm;
    scope.target = policy::HostPort{host, original->port()};
    auto dd = policy::decide_destination(rt.config->policy, scope.run->policy, scope.target,
                                         policy::Clock::now());
    if (dd.carry == policy::Carry::Deny) {
        std::string reason(
            destination_refusal_reason(*scope.run, rt.config->policy, scope.target, dd.reason));
        spdlog::info("conn={} transparent {}:{} (dialled {}) refused: {}", scope.conn_id, host,
                     original->port(), original->address().to_string(), reason);
        audit_refusal(scope, "", "", 403, reason, started);
        co_return;  // no HTTP to answer with before a handshake: the connection is closed
    }
    beast::flat_buffer none;
    if (dd.carry == policy::Carry::Tunnel) {
        scope.proto_in = "tunnel";
        co_await run_tunnel(stream, none, scope, started, false);
    } else {
        std::optional<InflightGuard> begun(std::in_place, w);  // its ClientHello is here
        co_await run_intercept(stream, none, scope, started, false, begun);
    }
}

}  // namespace egress::proxy
