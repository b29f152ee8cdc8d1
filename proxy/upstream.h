#pragma once
// Upstream side: resolve, vet every address, connect to a vetted address (never a second
// lookup), verified TLS, and a per-worker keep-alive pool keyed by (run, host, port).
#include <chrono>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <variant>

#include "policy/host.h"
#include "proxy/worker.h"

namespace egress::proxy {

class H2ClientSession;

/// A refusal or failure that becomes a status, an X-Egress-Reason and an audit record.
struct Refusal {
    int status = 0;
    std::string reason;
    std::string kind;  // egressd_upstream_errors_total{kind}; "" for policy refusals
    /// The upstream's address when one was reached (a TLS handshake that failed or timed
    /// out): its audit record names it, as an answered request's does.
    std::optional<tcp::endpoint> peer{};
};

template <class T>
using Outcome = std::variant<T, Refusal>;

struct Dialed {
    std::unique_ptr<TcpStream> stream;
    tcp::endpoint peer;
};

/// Resolves dest.host (overrides first), refuses the whole name if any answer is denied
/// (fail closed: a mix of allowed and denied answers is a rebinding signal), refuses
/// egressd's own listeners, and connects to the vetted addresses in order, the first
/// limits.max_dial_addresses of them at most. With `dial`, a client that goes away ends it
/// (DialCut): Refusal{0, "client_aborted"}.
awaitable<Outcome<Dialed>> dial_upstream(Worker& w, const Runtime& rt, const policy::HostPort& dest,
                                         DialCut* dial = nullptr);

/// The policy's form of a client's address (an IPv4-mapped IPv6 address, what a dual-stack
/// listener reports for an IPv4 client, as the IPv4 one).
policy::IpAddress to_policy_address(const net::ip::address& a);

/// The address dial_upstream vetted for a peer it dialled: it connects to the resolved
/// address in the form it was resolved, so this is the exact inverse (an IPv4-mapped answer
/// stays mapped). Every later check of a dialled connection (a pooled connection's reuse, a
/// blind tunnel's policy) vets this form, so it decides as the dial did: an allow_networks
/// exception written as ::ffff:127.0.0.1/128 admitted the dial and admits the checks too.
policy::IpAddress dialled_address(const net::ip::address& a);

/// What a dial its client left ends with (DialCut): nobody reads an answer.
inline Refusal client_gone_refusal() { return Refusal{0, "client_aborted", ""}; }

struct TlsConn {
    std::unique_ptr<TlsStream> stream;
    beast::flat_buffer buffer;
    tcp::endpoint peer;
    std::string alpn;
    std::string key;
    std::chrono::steady_clock::time_point idle_since;
};

/// Verified TLS over a dialed connection: SNI, hostname verification, tls_timeout. Offers
/// the session last received under `session_key` (the pool key) and keeps what the server
/// sends for the next connection (worker's tls_sessions). `h1_only`: ALPN offers http/1.1
/// alone (a WebSocket upgrade needs an HTTP/1.1 connection).
awaitable<Outcome<std::unique_ptr<TlsConn>>> tls_connect(Worker& w, const Runtime& rt, Dialed d,
                                                         const std::string& host,
                                                         const std::string& session_key,
                                                         bool h1_only = false,
                                                         DialCut* dial = nullptr);

/// A pooled HTTP/2 session and the vetted address it is connected to.
struct H2Pooled {
    std::shared_ptr<H2ClientSession> session;
    tcp::endpoint peer;
};

/// Keep-alive connections and HTTP/2 sessions of one worker, keyed by (run, destination).
/// Never shared across runs or threads.
class UpstreamPool {
public:
    explicit UpstreamPool(size_t max_idle_per_key) : max_idle_(max_idle_per_key) {}
    ~UpstreamPool();
    static std::string key(const std::string& run, const policy::HostPort& dest);
    /// A live idle connection for key, or nullptr. Dead or stale connections are dropped.
    /// `retryable`: the request can be sent again on a fresh connection if this one fails
    /// before any response byte, and its method is idempotent (proxy/exchange.cc); then a
    /// connection given back less than kFreshIdle ago is handed out without the peek that
    /// asks the kernel whether the peer closed or wrote while it idled.
    /// A connection idle longer than `max_idle` (limits.upstream_idle_timeout) is closed, and
    /// so is one whose address `addresses` no longer allows (a reload that narrowed
    /// policy.allow_networks: it was vetted at its dial only).
    std::unique_ptr<TlsConn> acquire(const std::string& key, bool retryable,
                                     std::chrono::milliseconds max_idle,
                                     const policy::AddressPolicy& addresses);
    /// See acquire. A peek costs a system call per request on a busy keep-alive connection.
    /// Its failure is retried anyway, and what it guards against comes later than this: a
    /// server closes an idle connection at its idle timeout (seconds; nginx 75 s, Node 5 s),
    /// some after writing an unsolicited 408, which must not be taken for the next response.
    static constexpr std::chrono::milliseconds kFreshIdle{100};
    void release(std::unique_ptr<TlsConn> conn);

    /// A live HTTP/2 session for key with room for one more stream, if any. A session whose
    /// address `addresses` no longer allows leaves the pool (its open streams finish).
    std::optional<H2Pooled> acquire_h2(const std::string& key,
                                       const policy::AddressPolicy& addresses);
    void add_h2(const std::string& key, H2Pooled s);

    /// Dial coalescing: while one TLS dial for key is in flight, others wait for it (it may
    /// yield an h2 session they can share) unless the destination is known to speak only
    /// HTTP/1.1. begin_dial returns false when the caller should wait_dial instead.
    bool begin_dial(const std::string& key, net::any_io_executor ex);
    void end_dial(const std::string& key, std::optional<bool> negotiated_h2);  // nullopt: failed
    /// With `dial`, this waiter's client leaving ends its wait (DialCut::cut), and only its.
    awaitable<void> wait_dial(const std::string& key, DialCut* dial = nullptr);
    /// Whether requests wait for key's dial in progress (wait_dial).
    bool awaited(const std::string& key) const;

private:
    struct Dialing {  // a coalesced dial in progress: the waiters' wake-up and their count
        explicit Dialing(net::any_io_executor ex) : done(ex, net::steady_timer::time_point::max()) {}
        net::steady_timer done;
        size_t waiters = 0;
    };
    size_t max_idle_;
    std::unordered_map<std::string, std::deque<std::unique_ptr<TlsConn>>> idle_;
    std::unordered_map<std::string, std::vector<H2Pooled>> h2_;
    std::unordered_map<std::string, std::shared_ptr<Dialing>> dialing_;
    std::unordered_map<std::string, bool> h1_only_;
};

}  // namespace egress::proxy
