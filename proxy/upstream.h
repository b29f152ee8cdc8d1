#pragma once
// Upstream side: resolve, vet every address, connect to a vetted address (never a second
// lookup), verified TLS, and a per-worker keep-alive pool keyed by (run, host, port).
#include <chrono>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <variant>

#include "policy/host.h"
#include "proxy/worker.h"

namespace egress::proxy {

/// A refusal or failure that becomes a status, an X-Egress-Reason and an audit record.
struct Refusal {
    int status = 0;
    std::string reason;
    std::string kind;  // egressd_upstream_errors_total{kind}; "" for policy refusals
};

template <class T>
using Outcome = std::variant<T, Refusal>;

struct Dialed {
    std::unique_ptr<TcpStream> stream;
    tcp::endpoint peer;
};

/// Resolves dest.host (overrides first), refuses the whole name if any answer is denied
/// (fail closed: a mix of allowed and denied answers is a rebinding signal), refuses
/// egressd's own listeners, and connects to the vetted addresses in order.
awaitable<Outcome<Dialed>> dial_upstream(Worker& w, const Runtime& rt, const policy::HostPort& dest);

struct TlsConn {
    std::unique_ptr<TlsStream> stream;
    beast::flat_buffer buffer;
    tcp::endpoint peer;
    std::string alpn;
    std::string key;
    std::chrono::steady_clock::time_point idle_since;
};

/// Verified TLS over a dialed connection: SNI, hostname verification, tls_timeout.
awaitable<Outcome<std::unique_ptr<TlsConn>>> tls_connect(Worker& w, const Runtime& rt, Dialed d,
                                                         const std::string& host);

/// Keep-alive connections of one worker. Never shared across runs or threads.
class UpstreamPool {
public:
    explicit UpstreamPool(size_t max_idle_per_key) : max_idle_(max_idle_per_key) {}
    static std::string key(const std::string& run, const policy::HostPort& dest);
    /// A live idle connection for key, or nullptr. Dead or stale connections are dropped.
    std::unique_ptr<TlsConn> acquire(const std::string& key);
    void release(std::unique_ptr<TlsConn> conn);

private:
    size_t max_idle_;
    std::unordered_map<std::string, std::deque<std::unique_ptr<TlsConn>>> idle_;
};

}  // namespace egress::proxy
