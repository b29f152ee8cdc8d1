#include "proxy/etcd_store.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <future>
#include <mutex>
#include <thread>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/json.hpp>
#include <boost/url/parse.hpp>
#include <spdlog/spdlog.h>

#include "common/published.h"
#include "credstore/envelope.h"
#include "credstore/etcd_layout.h"
#include "proxy/resolver.h"
#include "proxy/tls_socket.h"
#include "tls/contexts.h"
#include "tls/session_cache.h"

namespace egress::proxy {

namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
namespace json = boost::json;
using net::awaitable;
using net::ip::tcp;
using credstore::StateSnapshot;
using credstore::etcd::View;
constexpr auto nothrow = net::as_tuple(net::use_awaitable);

// A transaction that lost a race to another replica is planned again on the fresher view.
constexpr int kMaxAttempts = 8;
// The etcd answer to one unary call (a range of the whole state included).
constexpr uint64_t kMaxAnswerBytes = 256u << 20;
// How often an open watch is checked (watch_check): one tiny read per replica.
constexpr std::chrono::milliseconds kWatchCheckEvery{1000};

/// A write etcd took that this replica could not read back: an error (503, "etcd
/// unreachable"), not the success whose answer says the change is in force here.
Error not_in_force(int64_t revision, const std::string& why) {
    return make_error("etcd unreachable: the change was written (revision " +
                      std::to_string(revision) +
                      ") but this replica could not read it back, so it is not in force here "
                      "yet (" + why + ")");
}

struct Endpoint {
    std::string text;  // as configured, for messages
    std::string host;
    std::string port;  // 1..65535, as digits (the Host header)
    unsigned short port_number = 0;
    bool tls = false;  // https://
};

Result<Endpoint> parse_endpoint(const std::string& text) {
    auto u = boost::urls::parse_uri(text);
    if (!u) {
        return make_error("'" + text + "' is not a URL");
    }
    if (u->scheme() != "http" && u->scheme() != "https") {
        return make_error("'" + text + "': expected an http:// or https:// URL");
    }
    if (u->host().empty()) {
        return make_error("'" + text + "' names no host");
    }
    std::string host = u->host();
    if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
        host = host.substr(1, host.size() - 2);
    }
    const std::string port = u->has_port() ? std::string(u->port()) : "2379";
    unsigned long number = 0;
    const bool digits =
        !port.empty() && port.size() <= 5 &&
        std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (digits) {
        number = std::stoul(port);
    }
    if (!digits || number == 0 || number > 65535) {
        return make_error("'" + text + "': the port must be a number from 1 to 65535");
    }
    return Endpoint{text, host, port, static_cast<unsigned short>(number),
                    u->scheme() == "https"};
}

std::string b64(std::string_view s) { return credstore::base64_encode(s); }

/// The watch stays quiet for hours: TCP keepalive (first probe after 10 s idle, then every
/// 5 s, 3 lost) and a 30 s bound on unacknowledged data find an etcd that vanished without a
/// FIN (a partition, a dead host) in about half a minute; the watch then resynchronizes.
void keep_alive(int fd) {
    const int on = 1, idle = 10, interval = 5, count = 3;
    const unsigned user_timeout_ms = 30000;
    ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on);
    ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
    ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
    ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof count);
    ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof user_timeout_ms);
}

int64_t int_field(const json::object& o, std::string_view key) {
    // The gateway writes int64 fields as strings ("revision": "12"), proto3 leaves zeros out.
    const json::value* v = o.if_contains(key);
    if (v == nullptr) {
        return 0;
    }
    if (v->is_int64()) {
        return v->as_int64();
    }
    if (v->is_uint64()) {
        return static_cast<int64_t>(v->as_uint64());
    }
    if (v->is_string()) {
        try {
            return std::stoll(std::string(v->as_string()));
        } catch (...) {
            return 0;
        }
    }
    return 0;
}

int64_t header_revision(const json::object& answer) {
    const json::value* h = answer.if_contains("header");
    return h != nullptr && h->is_object() ? int_field(h->as_object(), "revision") : 0;
}

/// The answer's cluster_id, as etcd wrote it (a uint64, as a string; "" if absent): a wiped
/// etcd, or one restored from a snapshot, is usually a new cluster (etcdctl snapshot restore
/// makes a new id unless given the old cluster's names and token).
std::string header_cluster(const json::object& answer) {
    const json::value* h = answer.if_contains("header");
    const json::value* id =
        h != nullptr && h->is_object() ? h->as_object().if_contains("cluster_id") : nullptr;
    if (id == nullptr) {
        return "";
    }
    return id->is_string() ? std::string(id->as_string()) : json::serialize(*id);
}

Result<std::string> string_b64(const json::object& o, std::string_view key) {
    const json::value* v = o.if_contains(key);
    if (v == nullptr) {
        return std::string();
    }
    if (!v->is_string()) {
        return make_error(std::string(key) + " is not a string");
    }
    return credstore::base64_decode(v->as_string());
}

// Request bodies are built outside the coroutines: GCC 12 miscompiles braced json::object
// initializer lists inside a coroutine body ("array used as initializer").
std::string lease_body(int64_t ttl) {
    json::object o;
    o["TTL"] = ttl;
    return json::serialize(o);
}

std::string txn_body(const credstore::etcd::TxnPlan& plan, const std::vector<int64_t>& leases) {
    json::array compare;
    for (const auto& [key, rev] : plan.expect) {
        json::object c;
        c["key"] = b64(key);
        c["target"] = "MOD";
        c["result"] = "EQUAL";
        c["mod_revision"] = std::to_string(rev);
        compare.push_back(std::move(c));
    }
    json::array success;
    for (size_t i = 0; i < plan.puts.size(); ++i) {
        json::object put;
        put["key"] = b64(plan.puts[i].key);
        put["value"] = b64(plan.puts[i].value);
        if (leases[i] != 0) {
            put["lease"] = std::to_string(leases[i]);
        } else if (plan.puts[i].keep_lease) {
            put["ignore_lease"] = true;
        }
        json::object op;
        op["request_put"] = std::move(put);
        success.push_back(std::move(op));
    }
    for (const auto& key : plan.deletes) {
        json::object del;
        del["key"] = b64(key);
        json::object op;
        op["request_delete_range"] = std::move(del);
        success.push_back(std::move(op));
    }
    json::object txn;
    txn["compare"] = std::move(compare);
    txn["success"] = std::move(success);
    return json::serialize(txn);
}

std::string range_body(const std::string& key, const std::string& range_end) {
    json::object o;
    o["key"] = b64(key);
    o["range_end"] = b64(range_end);
    return json::serialize(o);
}

/// The watch's liveness check: a linearizable count of the keys under the prefix (etcd counts
/// them in its in-memory index; the answer's header holds the cluster's revision).
std::string count_body(const std::string& key, const std::string& range_end) {
    json::object o;
    o["key"] = b64(key);
    o["range_end"] = b64(range_end);
    o["count_only"] = true;
    return json::serialize(o);
}

/// The newest write under the prefix (its key only) and the count: what the check reads, at
/// most once per state.etcd.timeout, when etcd's revision moved and the watch's did not (etcd
/// reads every key of the range to sort them, so not every second).
std::string newest_body(const std::string& key, const std::string& range_end) {
    json::object o;
    o["key"] = b64(key);
    o["range_end"] = b64(range_end);
    o["limit"] = 1;
    o["sort_order"] = "DESCEND";
    o["sort_target"] = "MOD";
    o["keys_only"] = true;
    return json::serialize(o);
}

std::string watch_body(const std::string& key, const std::string& range_end, int64_t from) {
    json::object create;
    create["key"] = b64(key);
    create["range_end"] = b64(range_end);
    create["start_revision"] = std::to_string(from);
    json::object o;
    o["create_request"] = std::move(create);
    return json::serialize(o);
}

class EtcdStateStore final : public credstore::StateStore {
public:
    EtcdStateStore(EtcdConfig options, std::vector<Endpoint> endpoints,
                   std::unique_ptr<net::ssl::context> tls_ctx, std::vector<std::string> dns_servers,
                   std::map<std::string, std::vector<policy::IpAddress>> dns_overrides)
        : options_(std::move(options)),
          endpoints_(std::move(endpoints)),
          tls_ctx_(std::move(tls_ctx)),
          range_end_(credstore::etcd::prefix_range_end(options_.prefix)),
          dns_servers_(std::move(dns_servers)),
          dns_overrides_(std::move(dns_overrides)) {
        current_.store(std::make_shared<const StateSnapshot>());
    }

    ~EtcdStateStore() override { stop(); }

    void stop() override {
        stopping_ = true;
        ioc_.stop();
        if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) {
            thread_.join();
        }
    }

    Result<bool> start() {
        resolver_ = std::make_unique<Resolver>(
            ioc_, dns_servers_, dns_overrides_,
            std::max(std::chrono::milliseconds(1), options_.timeout / 2));
        thread_ = std::thread([this] {
            auto guard = net::make_work_guard(ioc_);
            ioc_.run();
        });
        int64_t keys = 0;
        const auto asked = Clock::now();
        auto loaded = run_sync(load(keys, cluster_id_));
        if (!loaded) {
            return make_error(loaded.error());
        }
        install(std::make_shared<View>(std::move(*loaded)), false);
        watched_keys_ = keys;
        note_synced(asked);
        // The watch must not end unseen: an exception out of it is logged, and the replica
        // would serve a state nobody updates, so it ends the process (a supervisor restarts it).
        net::co_spawn(ioc_, watch_loop(), [](std::exception_ptr e) {
            if (e) {
                try {
                    std::rethrow_exception(e);
                } catch (const std::exception& ex) {
                    spdlog::critical("etcd: the watch failed: {}; exiting", ex.what());
                } catch (...) {
                    spdlog::critical("etcd: the watch failed; exiting");
                }
                spdlog::default_logger()->flush();
                std::abort();
            }
        });
        return true;
    }

    std::shared_ptr<const StateSnapshot> snapshot() const override { return current_.load(); }

    std::optional<std::chrono::steady_clock::duration> sync_age() const override {
        const auto at = Clock::time_point(Clock::duration(synced_at_.load()));
        return std::max(Clock::now() - at, Clock::duration::zero());
    }

    Result<uint64_t> apply(const std::vector<credstore::Mutation>& mutations) override {
        std::lock_guard write_lock(write_mu_);
        if (stopping_) {
            return make_error("etcd: the store is stopped (shutting down)");
        }
        for (int attempt = 0; attempt < kMaxAttempts; ++attempt) {
            std::shared_ptr<const View> base;
            {
                std::lock_guard lock(mu_);
                base = view_;
            }
            Result<StateSnapshot> next = credstore::apply_mutations(*base->snap, mutations);
            if (!next) {
                return make_error(next.error());
            }
            credstore::etcd::TxnPlan plan = credstore::etcd::plan_txn(*base, *next, options_.prefix);
            if (plan.empty()) {
                return base->snap->revision;
            }
            if (plan.ops() > options_.max_txn_ops) {
                return make_error("etcd: the change writes " + std::to_string(plan.ops()) +
                                  " records in one transaction, more than "
                                  "state.etcd.max_txn_ops (" +
                                  std::to_string(options_.max_txn_ops) +
                                  "; raise it with etcd's --max-txn-ops)");
            }
            int64_t seen_before = 0;
            {
                std::lock_guard lock(mu_);
                seen_before = seen_revision_;
            }
            auto done = run_sync(commit(std::move(plan)));
            if (!done) {
                return make_error(done.error());
            }
            const auto [revision, succeeded, other_cluster] = *done;
            // Written: this replica shows its own write before answering, normally through
            // the watch (which also runs the listeners), else by reading the state again.
            if (succeeded) {
                if (revision <= seen_before || other_cluster) {
                    // A write takes etcd past every revision it held before: one at or below
                    // what this replica had seen means etcd's history is not the one this
                    // replica holds (restored from a backup, wiped, another cluster). Waiting
                    // for the watch would return at once, without the write: the state is
                    // read again, and installed whatever its revision (resync).
                    spdlog::warn("etcd: a write landed at revision {}{}, this replica had seen "
                                 "{}: reading the state again",
                                 revision, other_cluster ? " of another etcd cluster" : "",
                                 seen_before);
                    if (auto read = run_sync(resync()); !read) {
                        return not_in_force(revision, read.error());
                    }
                } else if (!wait_seen(revision)) {
                    spdlog::warn("etcd: the watch has not delivered revision {} within {} ms; "
                                 "reading the state", revision, options_.timeout.count());
                    if (auto read = run_sync(resync()); !read) {
                        // Not a success: the answer promises that this replica shows the
                        // change (a revoke's 200: its connections here are cut).
                        return not_in_force(revision, read.error());
                    }
                }
                return static_cast<uint64_t>(revision);
            }
            // Another write to the same records won: plan again on the state that has it. Not
            // by waiting for the watch: the answer's revision may be a write to other keys of
            // the cluster, which never comes through a watch of this prefix.
            if (auto fresh = run_sync(resync()); !fresh) {
                return make_error(fresh.error());
            }
        }
        return make_error("conflict: other replicas kept changing the same records in etcd; "
                          "try again");
    }

    void on_change(std::function<void(std::shared_ptr<const StateSnapshot>)> cb) override {
        std::lock_guard lock(mu_);
        listeners_.push_back(std::move(cb));
    }

private:
    using Listener = std::function<void(std::shared_ptr<const StateSnapshot>)>;

    // ---- sync bridge (callers are admin threads, never the store's own thread) ---------
    template <typename T>
    T run_sync(awaitable<T> op) {
        std::promise<T> done;
        auto answer = done.get_future();
        net::co_spawn(
            ioc_,
            [&done, op = std::move(op)]() mutable -> awaitable<void> {
                done.set_value(co_await std::move(op));
            },
            [&done](std::exception_ptr e) {
                if (e) {
                    done.set_exception(e);
                }
            });
        return answer.get();
    }

    /// Blocks until the watch has published `revision` and its listeners have run.
    bool wait_seen(int64_t revision) {
        std::unique_lock lock(mu_);
        return seen_cv_.wait_for(lock, options_.timeout,
                                 [&] { return seen_revision_ >= revision; });
    }

    // ---- unary calls ----------------------------------------------------------------------
    using Clock = std::chrono::steady_clock;

    awaitable<Result<json::object>> call(std::string_view path, std::string body) {
        co_return co_await call_from(preferred_, path, std::move(body), nullptr, nullptr);
    }

    /// call() that tries endpoints_[first] first. `answered`: the index of the endpoint that
    /// answered; `failed`: why those tried before it did not ("" when the first answered).
    awaitable<Result<json::object>> call_from(size_t first, std::string_view path,
                                              std::string body, size_t* answered,
                                              std::string* failed) {
        std::string failures;
        const size_t n = endpoints_.size();
        for (size_t i = 0; i < n; ++i) {
            const size_t idx = (first + i) % n;
            bool refused = false;
            auto r = co_await call_one(endpoints_[idx], path, body, refused);
            if (r) {
                preferred_ = idx;
                if (answered != nullptr) {
                    *answered = idx;
                }
                if (failed != nullptr) {
                    *failed = std::move(failures);
                }
                co_return r;
            }
            if (refused) {  // another member would refuse it too
                co_return make_error("etcd refused the request: " + r.error());
            }
            failures += (failures.empty() ? "" : "; ") + r.error();
        }
        co_return make_error("etcd unreachable: " + failures);
    }

    /// One call on one member. `refused`: etcd answered 4xx (a request it will not take from
    /// any member); anything else (no connection, a timeout, 5xx: no leader, shutting down)
    /// is worth the next endpoint. options_.timeout bounds the whole call.
    awaitable<Result<json::object>> call_one(const Endpoint& ep, std::string_view path,
                                             const std::string& body, bool& refused) {
        const auto deadline = Clock::now() + options_.timeout;
        beast::tcp_stream tcp(ioc_);
        if (std::string bad = co_await dial(ep, tcp, deadline); !bad.empty()) {
            co_return make_error(bad);
        }
        if (!ep.tls) {
            co_return co_await exchange(tcp, ep, path, body, refused, deadline);
        }
        TlsSocket tls(std::move(tcp), *tls_ctx_);
        if (std::string bad = co_await handshake(ep, tls, deadline); !bad.empty()) {
            co_return make_error(bad);
        }
        co_return co_await exchange(tls, ep, path, body, refused, deadline);
    }

    static Clock::duration left(Clock::time_point deadline) {
        return std::max(deadline - Clock::now(), Clock::duration::zero());
    }

    /// A TCP connection to `ep` within the deadline; "" or why not.
    awaitable<std::string> dial(const Endpoint& ep, beast::tcp_stream& stream,
                                Clock::time_point deadline) {
        auto addresses = co_await resolver_->resolve(ep.host);
        std::vector<tcp::endpoint> targets;
        if (addresses) {
            for (const auto& a : *addresses) {
                targets.emplace_back(net::ip::make_address(a.to_string()), ep.port_number);
            }
            resolved_[ep.text] = targets;
        } else if (auto last = resolved_.find(ep.text); last != resolved_.end()) {
            targets = last->second;  // the DNS failed: the last answer it gave
        } else {
            co_return ep.text + ": " + addresses.error();
        }
        stream.expires_after(left(deadline));
        auto [cec, connected] = co_await stream.async_connect(targets, nothrow);
        if (cec) {
            co_return ep.text + ": " + cec.message();
        }
        // A request goes out in more than one write (head, body; TLS records): without
        // TCP_NODELAY the second waits for the first's ACK, which etcd delays (40 ms).
        boost::system::error_code nec;
        stream.socket().set_option(tcp::no_delay(true), nec);
        co_return "";
    }

    /// The TLS handshake of an https:// endpoint: etcd's certificate must be valid for the
    /// endpoint's host (name or IP) and chain to state.etcd.ca_file. "" or why not.
    awaitable<std::string> handshake(const Endpoint& ep, TlsSocket& stream,
                                     Clock::time_point deadline) {
        SSL* ssl = stream.native_handle();
        if (auto ok = tls::prepare_client(ssl, ep.host); !ok) {
            co_return ep.text + ": " + ok.error();
        }
        // Every call is a connection of its own: resuming the member's last session spares
        // each a full handshake and certificate check.
        tls_sessions_.attach(ssl, ep.text);
        stream.expires_after(left(deadline));
        auto [ec] = co_await stream.async_handshake(net::ssl::stream_base::client, nothrow);
        if (ec) {
            const long verify = SSL_get_verify_result(ssl);
            co_return ep.text + ": TLS handshake: " + ec.message() +
                (verify != X509_V_OK
                     ? std::string(" (certificate: ") + X509_verify_cert_error_string(verify) + ")"
                     : std::string());
        }
        spdlog::debug("etcd: {}: {}, {}", ep.text, SSL_get_version(ssl),
                      SSL_session_reused(ssl) == 1 ? "resumed" : "full handshake");
        co_return "";
    }

    /// One request and its answer on a connected stream (TCP or TLS).
    template <class Stream>
    awaitable<Result<json::object>> exchange(Stream& stream, const Endpoint& ep,
                                             std::string_view path, const std::string& body,
                                             bool& refused, Clock::time_point deadline) {
        stream.expires_after(left(deadline));
        http::request<http::string_body> req{http::verb::post, path, 11};
        req.set(http::field::host, ep.host + ":" + ep.port);
        req.set(http::field::content_type, "application/json");
        req.body() = body;
        req.prepare_payload();
        auto [wec, written] = co_await http::async_write(stream, req, nothrow);
        if (wec) {
            co_return make_error(ep.text + ": " + wec.message());
        }
        beast::flat_buffer buf;
        http::response_parser<http::string_body> parser;
        parser.body_limit(kMaxAnswerBytes);
        auto [rdec, read] = co_await http::async_read(stream, buf, parser, nothrow);
        if (rdec) {
            co_return make_error(ep.text + ": " + rdec.message());
        }
        const auto& res = parser.get();
        boost::system::error_code jec;
        json::value v = json::parse(res.body(), jec);
        if (res.result() != http::status::ok) {
            std::string what = "HTTP " + std::to_string(res.result_int());
            if (!jec && v.is_object()) {
                if (const json::value* m = v.as_object().if_contains("message");
                    m != nullptr && m->is_string()) {
                    what += ": " + std::string(m->as_string());
                }
            }
            refused = res.result_int() >= 400 && res.result_int() < 500;
            co_return make_error(ep.text + std::string(path) + ": " + what);
        }
        if (jec || !v.is_object()) {
            co_return make_error(ep.text + std::string(path) + ": answer is not a JSON object");
        }
        co_return std::move(v.as_object());
    }

    // ---- the state ------------------------------------------------------------------------
    /// Reads every record under the prefix (one consistent revision); `keys`: how many keys
    /// etcd holds under it (records that do not parse, keys outside the layout included);
    /// `cluster`: the answer's cluster id.
    awaitable<Result<View>> load(int64_t& keys, std::string& cluster) {
        auto r = co_await call("/v3/kv/range", range_body(options_.prefix, range_end_));
        if (!r) {
            co_return make_error(r.error());
        }
        cluster = header_cluster(*r);
        StateSnapshot snap;
        View view;
        keys = 0;
        if (const json::value* kvs = r->if_contains("kvs"); kvs != nullptr && kvs->is_array()) {
            for (const json::value& kv : kvs->as_array()) {
                apply_event(snap, view.mod_revisions, kv, false);
            }
            keys = static_cast<int64_t>(kvs->as_array().size());
        }
        snap.revision = static_cast<uint64_t>(header_revision(*r));
        view.snap = std::make_shared<const StateSnapshot>(std::move(snap));
        co_return view;
    }

    /// Reads the whole state and makes it this replica's view (on the store's thread, so
    /// listeners stay in order; watch events it already holds are skipped when they come).
    ///
    /// The read is linearizable: in one etcd history its revision is at least any revision
    /// this replica held when it asked. One below that, or from another cluster id, means
    /// etcd's history is not the one this replica holds: restored from a snapshot (an older
    /// revision, often a new cluster id), wiped (a new cluster, revision 1), replaced. The read
    /// is then installed whatever its revision, what this replica had seen is forgotten (so a
    /// write waits for its own revision again), and an open watch is cut, to resume from the
    /// read. A compaction changes neither: the watch is cancelled, and the read comes back at
    /// the same revision or later.
    awaitable<Result<bool>> resync() {
        int64_t keys = 0;
        std::string cluster;
        int64_t asked_at = 0;
        {
            std::lock_guard lock(mu_);
            asked_at = static_cast<int64_t>(view_->snap->revision);
        }
        const auto asked = Clock::now();
        auto loaded = co_await load(keys, cluster);
        if (!loaded) {
            co_return make_error(loaded.error());
        }
        const auto got = static_cast<int64_t>(loaded->snap->revision);
        const bool other_cluster =
            !cluster.empty() && !cluster_id_.empty() && cluster != cluster_id_;
        if (got < asked_at || other_cluster) {
            const std::string why =
                other_cluster
                    ? "etcd's cluster id changed (" + cluster_id_ + " to " + cluster + ")"
                    : "etcd's revision " + std::to_string(got) + " is below this replica's " +
                          std::to_string(asked_at);
            spdlog::warn("etcd: {}: etcd was restored from a backup, wiped or replaced; this "
                         "replica now serves etcd's state at revision {}",
                         why, got);
            cluster_id_ = cluster;
            install(std::make_shared<View>(std::move(*loaded)), true, true);
            watched_keys_ = keys;
            note_synced(asked);
            if (open_watch_) {
                open_watch_->drop(why + ": the watch resumes from the state read");
            }
            co_return true;
        }
        {
            // The watch runs on while the read is in flight: if it installed a newer revision
            // meanwhile (a revocation from another replica), the older read must not replace
            // it. The watch will not send that change again; the view would roll back for good.
            std::lock_guard lock(mu_);
            if (view_ && got < static_cast<int64_t>(view_->snap->revision)) {
                note_synced(asked);  // the view holds more than etcd did when asked
                co_return true;
            }
        }
        if (!cluster.empty()) {
            cluster_id_ = cluster;
        }
        install(std::make_shared<View>(std::move(*loaded)), true);
        watched_keys_ = keys;
        note_synced(asked);
        co_return true;
    }

    /// This replica's view held all etcd held under the prefix when a request sent at `asked`
    /// was answered: /metrics' egressd_state_sync_age_seconds and state.etcd.max_staleness
    /// count from the latest such time.
    void note_synced(Clock::time_point asked) {
        const int64_t at = asked.time_since_epoch().count();
        int64_t prev = synced_at_.load();
        while (prev < at && !synced_at_.compare_exchange_weak(prev, at)) {
        }
    }

    /// One key-value of a range or watch answer into the state; a bad record is logged and
    /// skipped (the rest of the fleet's state keeps serving).
    void apply_event(StateSnapshot& snap, std::map<std::string, int64_t>& revs,
                     const json::value& kv_value, bool deleted) {
        if (!kv_value.is_object()) {
            return;
        }
        const json::object& kv = kv_value.as_object();
        auto key = string_b64(kv, "key");
        auto value = string_b64(kv, "value");
        if (!key || !value) {
            spdlog::error("etcd: a key or value is not base64; skipped");
            return;
        }
        auto r = credstore::etcd::apply_kv(
            snap, revs, options_.prefix, *key,
            deleted ? std::nullopt : std::optional<std::string_view>(*value),
            int_field(kv, "mod_revision"));
        if (!r) {
            spdlog::error("etcd: record skipped: {}", r.error());
        }
    }

    /// Makes `view` this replica's state, runs the listeners, then lets apply() callers
    /// waiting for its revision go. Runs on the store's thread (or in start(), before it
    /// serves anyone), so listeners see revisions in order. `reset`: etcd's history changed
    /// (resync): the revisions seen before are forgotten.
    void install(std::shared_ptr<const View> view, bool notify, bool reset = false) {
        std::vector<Listener> listeners;
        {
            std::lock_guard lock(mu_);
            view_ = view;
            listeners = listeners_;
        }
        current_.store(view->snap);
        if (notify) {
            for (const auto& l : listeners) {
                l(view->snap);
            }
        }
        {
            std::lock_guard lock(mu_);
            const auto revision = static_cast<int64_t>(view->snap->revision);
            seen_revision_ = reset ? revision : std::max(seen_revision_, revision);
        }
        seen_cv_.notify_all();
    }

    // ---- writes -----------------------------------------------------------------------------
    struct Committed {
        int64_t revision = 0;
        bool succeeded = false;
        bool other_cluster = false;  // the answer names another cluster id than the view's
    };

    /// Sends the plan as one transaction.
    awaitable<Result<Committed>> commit(credstore::etcd::TxnPlan plan) {
        const int64_t now = std::chrono::duration_cast<std::chrono::seconds>(
                                std::chrono::system_clock::now().time_since_epoch())
                                .count();
        std::vector<int64_t> leases(plan.puts.size(), 0);
        for (size_t i = 0; i < plan.puts.size(); ++i) {
            if (const auto& expires = plan.puts[i].run_expires_at) {
                const int64_t ttl =
                    std::max<int64_t>(*expires - now, 0) + options_.lease_grace.count();
                auto lease = co_await call("/v3/lease/grant", lease_body(ttl));
                if (!lease) {
                    co_return make_error(lease.error());
                }
                leases[i] = int_field(*lease, "ID");
            }
        }
        auto r = co_await call("/v3/kv/txn", txn_body(plan, leases));
        const json::value* ok = r ? r->if_contains("succeeded") : nullptr;
        const bool succeeded = ok != nullptr && ok->is_bool() && ok->as_bool();
        if (r && !succeeded) {
            // etcd answered that the guard failed: the leases granted for this attempt hold
            // no key. Ended now, best effort, rather than left to run out with the run (the
            // next attempt grants its own). Not after a transport error: the transaction may
            // have been applied, and its keys would go with the lease.
            for (const int64_t id : leases) {
                if (id != 0) {
                    json::object o;
                    o["ID"] = std::to_string(id);
                    (void)co_await call("/v3/lease/revoke", json::serialize(o));
                }
            }
        }
        if (!r) {
            co_return make_error(r.error());
        }
        const std::string cluster = header_cluster(*r);
        co_return Committed{header_revision(*r), succeeded,
                            !cluster.empty() && !cluster_id_.empty() && cluster != cluster_id_};
    }

    // ---- the watch --------------------------------------------------------------------------
    awaitable<void> watch_loop() {
        std::chrono::milliseconds backoff{100};
        bool read_first = false;  // the first watch starts from the state start() loaded
        for (;;) {
            if (stopping_) {
                co_return;
            }
            if (read_first) {
                // After a broken watch: the whole state again (deletions while away, a
                // compaction past our revision), then watch from there.
                if (auto r = co_await resync(); !r) {
                    spdlog::warn("etcd: resync failed ({}); retrying in {} ms", r.error(),
                                 backoff.count());
                    co_await sleep(backoff);
                    backoff = std::min(backoff * 2, std::chrono::milliseconds(2000));
                    continue;
                }
                spdlog::info("etcd: resynchronized at revision {}", current_.load()->revision);
            }
            read_first = true;
            std::string why = co_await watch(static_cast<int64_t>(current_.load()->revision) + 1,
                                             backoff);
            if (stopping_) {
                co_return;
            }
            spdlog::warn("etcd: watch ended ({}); resynchronizing", why);
            co_await sleep(backoff);
            // A watch that delivered something reset it to 100 ms; one that keeps ending at
            // once (refused, cancelled) backs off up to 2 s instead of spinning.
            backoff = std::min(backoff * 2, std::chrono::milliseconds(2000));
        }
    }

    awaitable<void> sleep(std::chrono::milliseconds d) {
        net::steady_timer t(ioc_);
        t.expires_after(d);
        co_await t.async_wait(nothrow);
    }

    /// Streams watch events from `from_revision` until the stream breaks or watch_check drops
    /// it; returns why.
    awaitable<std::string> watch(int64_t from_revision, std::chrono::milliseconds& backoff) {
        const size_t watched = preferred_ % endpoints_.size();
        const Endpoint& ep = endpoints_[watched];
        const auto deadline = Clock::now() + options_.timeout;
        beast::tcp_stream tcp(ioc_);
        std::string bad = co_await dial(ep, tcp, deadline);
        if (bad.empty()) {
            keep_alive(tcp.socket().native_handle());
            if (!ep.tls) {
                co_return co_await watch_on(tcp, watched, from_revision, backoff, deadline);
            }
            TlsSocket tls(std::move(tcp), *tls_ctx_);
            bad = co_await handshake(ep, tls, deadline);
            if (bad.empty()) {
                co_return co_await watch_on(tls, watched, from_revision, backoff, deadline);
            }
        }
        preferred_ = (watched + 1) % endpoints_.size();
        co_return bad;
    }

    /// What an open watch shares with its check (watch_check): the check sets `stalled` and
    /// cuts the stream's pending read; the watch ends the check when it ends.
    struct WatchCheck {
        explicit WatchCheck(net::io_context& ioc) : timer(ioc) {}
        net::steady_timer timer;  // the check's wait for its next round
        bool over = false;        // the watch has ended: the check stops
        std::string stalled;      // why the check dropped the watch
        std::function<void()> cut;

        void drop(std::string why) {
            stalled = std::move(why);
            if (cut) {
                cut();
            }
        }
    };
    // The open watch's check, null between watches (the store's thread only): resync() cuts
    // the watch through it when etcd's history changed under it.
    std::shared_ptr<WatchCheck> open_watch_;

    template <class Stream>
    awaitable<std::string> watch_on(Stream& stream, size_t watched, int64_t from_revision,
                                    std::chrono::milliseconds& backoff,
                                    Clock::time_point deadline) {
        const Endpoint& ep = endpoints_[watched];
        stream.expires_after(left(deadline));
        http::request<http::string_body> req{http::verb::post, "/v3/watch", 11};
        req.set(http::field::host, ep.host + ":" + ep.port);
        req.set(http::field::content_type, "application/json");
        // A member cut off from the leader keeps a watch open and sends nothing; a watch that
        // requires a leader is ended by etcd instead ("etcdserver: no leader"), and resumes
        // on a member that has one.
        req.set("Grpc-Metadata-hasleader", "true");
        req.body() = watch_body(options_.prefix, range_end_, from_revision);
        req.prepare_payload();
        auto [wec, written] = co_await http::async_write(stream, req, nothrow);
        if (wec) {
            co_return ep.text + ": " + wec.message();
        }
        beast::flat_buffer buf;
        http::response_parser<http::buffer_body> parser;
        parser.body_limit(boost::none);
        auto [hec, head] = co_await http::async_read_header(stream, buf, parser, nothrow);
        if (hec) {
            co_return ep.text + ": " + hec.message();
        }
        if (parser.get().result() != http::status::ok) {
            co_return ep.text + "/v3/watch: HTTP " + std::to_string(parser.get().result_int());
        }
        // A quiet fleet sends nothing for hours; a member that hangs sends nothing either (and
        // its kernel still answers TCP keepalive): watch_check tells them apart.
        stream.expires_never();
        auto check = std::make_shared<WatchCheck>(ioc_);
        check->cut = [&stream] {
            boost::system::error_code ignored;
            stream.socket().cancel(ignored);
        };
        open_watch_ = check;
        struct EndCheck {  // on every way out of this frame, its destruction included
            EtcdStateStore& store;
            std::shared_ptr<WatchCheck> check;
            ~EndCheck() {
                if (store.open_watch_ == check) {
                    store.open_watch_ = nullptr;
                }
                check->over = true;
                check->cut = nullptr;
                if (!store.stopping_) {
                    check->timer.cancel();
                }
            }
        } end_check{*this, check};
        net::co_spawn(ioc_, watch_check(check, watched), net::detached);
        json::stream_parser messages;
        std::array<char, 16384> piece;
        for (;;) {
            parser.get().body().data = piece.data();
            parser.get().body().size = piece.size();
            auto [ec, n] = co_await http::async_read_some(stream, buf, parser, nothrow);
            if (!check->stalled.empty()) {
                co_return check->stalled;
            }
            if (ec == http::error::need_buffer) {
                ec = {};
            }
            const size_t got = piece.size() - parser.get().body().size;
            std::string_view data(piece.data(), got);
            while (!data.empty()) {
                boost::system::error_code jec;
                const size_t used = messages.write_some(data.data(), data.size(), jec);
                if (jec) {
                    co_return "a watch message is not JSON: " + jec.message();
                }
                data.remove_prefix(used);
                if (messages.done()) {
                    json::value msg = messages.release();
                    messages.reset();
                    if (std::string bad = on_watch_message(msg); !bad.empty()) {
                        co_return bad;
                    }
                    backoff = std::chrono::milliseconds(100);  // the watch works
                }
            }
            if (ec) {
                co_return ep.text + ": " + ec.message();
            }
            if (parser.is_done()) {
                co_return "etcd closed the watch";
            }
        }
    }

    /// Checks an open watch about once a second until it ends: one linearizable count of the
    /// keys under the prefix, asked of the watched member first.
    /// - The watched member does not answer it and another member does (the watched one
    ///   hangs, lost its leader, or went away without a FIN): the watch is dropped at once and
    ///   resumes from the member that answered.
    /// - etcd's revision is past the view's while the watch delivers nothing: that alone is
    ///   not a stall (writes elsewhere in etcd move the revision, and never come through a
    ///   watch of this prefix). It is one once etcd holds a change under the prefix that the
    ///   view lacks (another count of keys, or, read once the revision has been ahead for
    ///   state.etcd.timeout, a newer write) and the watch has still delivered nothing
    ///   state.etcd.timeout after that change was seen: the watch is dropped, and the state
    ///   read again. Otherwise the view is etcd's prefix at that revision, which is noted.
    /// An idle cluster answers the view's own revision: nothing more is read or done.
    awaitable<void> watch_check(std::shared_ptr<WatchCheck> check, size_t watched) {
        const Endpoint& ep = endpoints_[watched];
        const std::string count_request = count_body(options_.prefix, range_end_);
        const auto bound = options_.timeout;
        int64_t current_at = 0;  // the view held etcd's prefix at this revision (a check)
        std::optional<Clock::time_point> behind_since;  // etcd ahead of an unchanged view
        int64_t behind_view = 0;                        // the view's revision meanwhile
        int64_t behind_etcd = 0;                        // etcd's when it was first ahead
        std::optional<Clock::time_point> lacking_since;  // a change the view lacks, seen
        // A check the view had not caught up with when answered: when it was sent, and etcd's
        // revision then. Once the view (or current_at) reaches that revision, the view held
        // all etcd held at that time (a watch that delivers steadily confirms this way).
        std::optional<std::pair<Clock::time_point, int64_t>> pending;
        for (;;) {
            check->timer.expires_after(kWatchCheckEvery);
            co_await check->timer.async_wait(nothrow);
            if (check->over) {
                co_return;
            }
            size_t answered = watched;
            std::string failed;
            const auto asked = Clock::now();
            const auto asked_view = static_cast<int64_t>(current_.load()->revision);
            auto r = co_await call_from(watched, "/v3/kv/range", count_request, &answered,
                                        &failed);
            if (check->over) {
                co_return;
            }
            if (!r) {  // no member answers: none to move to (the watch breaks or resumes)
                spdlog::debug("etcd: watch check: {}", r.error());
                continue;
            }
            if (answered != watched) {
                check->drop(ep.text + " did not answer a liveness check (" + failed + "), " +
                            endpoints_[answered].text + " did: the watch moves there");
                co_return;
            }
            const int64_t etcd_revision = header_revision(*r);
            const int64_t etcd_keys = int_field(*r, "count");
            const std::string cluster = header_cluster(*r);
            // A linearizable read answers at least every revision this replica held when it
            // asked: one below, or another cluster id, is another etcd history (resync()).
            const bool other_cluster =
                !cluster.empty() && !cluster_id_.empty() && cluster != cluster_id_;
            if (etcd_revision < asked_view || other_cluster) {
                check->drop(other_cluster
                                ? "etcd answers with another cluster id (" + cluster_id_ +
                                      " to " + cluster + "): restored, wiped or replaced"
                                : "etcd's revision " + std::to_string(etcd_revision) +
                                      " is below this replica's " + std::to_string(asked_view) +
                                      ": etcd was restored or wiped");
                co_return;
            }
            const auto view_revision = static_cast<int64_t>(current_.load()->revision);
            if (pending && std::max(view_revision, current_at) >= pending->second) {
                note_synced(pending->first);
                pending.reset();
            }
            if (etcd_revision <= std::max(view_revision, current_at)) {
                note_synced(asked);
                pending.reset();
                behind_since.reset();
                lacking_since.reset();
                continue;
            }
            pending = std::pair{asked, etcd_revision};
            const auto now = Clock::now();
            if (!behind_since || view_revision != behind_view) {  // the watch delivered since
                behind_since = now;
                behind_view = view_revision;
                behind_etcd = etcd_revision;
                lacking_since.reset();
            }
            int64_t newest = 0;
            if (!lacking_since && etcd_keys != watched_keys_) {
                lacking_since = now;
            } else if (!lacking_since && now - *behind_since >= bound) {
                auto n = co_await call_from(answered, "/v3/kv/range",
                                            newest_body(options_.prefix, range_end_), nullptr,
                                            nullptr);
                if (check->over) {
                    co_return;
                }
                if (!n || static_cast<int64_t>(current_.load()->revision) != behind_view) {
                    continue;  // no answer, or the watch delivered meanwhile: the next round
                }
                if (const json::value* kvs = n->if_contains("kvs");
                    kvs != nullptr && kvs->is_array() && !kvs->as_array().empty() &&
                    kvs->as_array().front().is_object()) {
                    newest = int_field(kvs->as_array().front().as_object(), "mod_revision");
                }
                if (newest <= behind_view && int_field(*n, "count") == watched_keys_) {
                    current_at = header_revision(*n);  // the writes were elsewhere in etcd
                    note_synced(asked);  // the view held etcd's prefix when the count was sent
                    pending.reset();
                    behind_since.reset();
                    continue;
                }
                // A write etcd held when it was first seen ahead is that old already.
                lacking_since = newest > behind_view && newest <= behind_etcd ? *behind_since
                                                                              : now;
            }
            if (lacking_since && now - *lacking_since >= bound) {
                check->drop(
                    "the watch on " + ep.text + " is stalled: etcd holds changes under the prefix "
                    "that it has not delivered for " +
                    std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(
                                       now - *lacking_since)
                                       .count()) +
                    " ms (etcd at revision " + std::to_string(etcd_revision) + ", " +
                    std::to_string(etcd_keys) + " keys; this replica at " +
                    std::to_string(view_revision) + ", " + std::to_string(watched_keys_) +
                    " keys" + (newest > 0 ? ", newest write " + std::to_string(newest) : "") +
                    ")");
                co_return;
            }
        }
    }

    /// One watch answer: applies its events as one new view. Returns why the watch must be
    /// restarted, or "".
    std::string on_watch_message(const json::value& msg) {
        const json::object* o = msg.if_object();
        const json::value* result = o != nullptr ? o->if_contains("result") : nullptr;
        if (result == nullptr || !result->is_object()) {
            if (o != nullptr && o->contains("error")) {
                return "etcd: " + json::serialize(o->at("error"));
            }
            return "a watch message without a result";
        }
        const json::object& res = result->as_object();
        if (const json::value* c = res.if_contains("canceled"); c != nullptr && c->is_bool() &&
                                                                c->as_bool()) {
            return "the watch was canceled (compact revision " +
                   std::to_string(int_field(res, "compact_revision")) + ")";
        }
        const json::value* events = res.if_contains("events");
        if (events == nullptr || !events->is_array() || events->as_array().empty()) {
            return "";  // created, or a progress notification
        }
        std::shared_ptr<const View> base;
        {
            std::lock_guard lock(mu_);
            base = view_;
        }
        StateSnapshot snap = *base->snap;
        std::map<std::string, int64_t> revs = base->mod_revisions;
        // The view's revision is that of the newest event it holds, not the answer's header
        // (the cluster's revision, which may count writes to other keys or events still to
        // come): events at or below it are skipped as already held.
        const auto held = static_cast<int64_t>(base->snap->revision);
        int64_t newest = held;
        for (const json::value& ev : events->as_array()) {
            const json::value* kv = ev.is_object() ? ev.as_object().if_contains("kv") : nullptr;
            const int64_t rev = kv != nullptr && kv->is_object()
                                    ? int_field(kv->as_object(), "mod_revision")
                                    : 0;
            if (rev <= held) {
                continue;  // already in the view (a resync read past it)
            }
            const json::value* type = ev.as_object().if_contains("type");
            const bool deleted = type != nullptr && type->is_string() && type->as_string() == "DELETE";
            apply_event(snap, revs, *kv, deleted);
            newest = std::max(newest, rev);
            // etcd sends a delete only for a key it held; a put of version 1 creates one
            if (deleted) {
                --watched_keys_;
            } else if (int_field(kv->as_object(), "version") == 1) {
                ++watched_keys_;
            }
        }
        if (newest == held) {
            return "";
        }
        snap.revision = static_cast<uint64_t>(newest);
        auto next = std::make_shared<View>();
        next->snap = std::make_shared<const StateSnapshot>(std::move(snap));
        next->mod_revisions = std::move(revs);
        install(std::move(next), true);
        return "";
    }

    EtcdConfig options_;
    std::vector<Endpoint> endpoints_;
    std::unique_ptr<net::ssl::context> tls_ctx_;  // set when an endpoint is https://
    std::string range_end_;
    std::atomic<size_t> preferred_{0};
    // How many keys etcd holds under the prefix as of the view (the load's count, then each
    // watched create and delete): the watch check compares it with etcd's count. The store's
    // thread only (start() sets it before the watch starts).
    int64_t watched_keys_ = 0;
    // etcd's cluster id as of the view (the store's thread only; start() sets it first).
    std::string cluster_id_;
    // When the view was last known to hold all of etcd's prefix (steady_clock ticks): when the
    // read or check that showed it was sent (note_synced).
    std::atomic<int64_t> synced_at_{0};
    std::atomic<bool> stopping_{false};

    std::mutex write_mu_;  // one apply() at a time on this replica
    mutable std::mutex mu_;
    std::condition_variable seen_cv_;
    std::shared_ptr<const View> view_ = std::make_shared<const View>();  // guarded by mu_
    int64_t seen_revision_ = 0;                                         // guarded by mu_
    std::vector<Listener> listeners_;                                   // guarded by mu_
    Published<const StateSnapshot> current_;

    std::thread thread_;
    // TLS sessions by endpoint, for resumption (the store's thread only; outlives every SSL,
    // which the coroutine frames hold).
    tls::ClientSessionCache tls_sessions_{16};
    // Last: destroyed first, with the coroutine frames it owns (they use the members above).
    net::io_context ioc_{1};
    // etcd's host names, looked up with c-ares within half of state.etcd.timeout (Asio's
    // resolver blocks a thread in getaddrinfo for as long as the system's resolver takes,
    // and every later lookup queues behind it); resolver.servers and resolver.overrides apply
    // as for upstreams. A failed lookup falls back on the endpoint's last answer. The store's
    // thread only (made in start(), before that thread runs). After ioc_: the resolver's
    // descriptors and timer go before the io_context.
    std::vector<std::string> dns_servers_;
    std::map<std::string, std::vector<policy::IpAddress>> dns_overrides_;
    std::unique_ptr<Resolver> resolver_;
    std::map<std::string, std::vector<tcp::endpoint>> resolved_;  // endpoint text → last answer
};

}  // namespace

Result<tls::SslCtxPtr> etcd_tls_context(const EtcdConfig& options) {
    if (!has_https_endpoint(options.endpoints)) {
        return tls::SslCtxPtr();
    }
    auto ctx = tls::make_client_context(options.ca_file, {"http/1.1"});
    if (!ctx) {
        return make_error("state.etcd.ca_file: " + ctx.error());
    }
    if (options.cert_file && options.key_file) {
        if (auto ok =
                tls::use_client_certificate(ctx->get(), *options.cert_file, *options.key_file);
            !ok) {
            return make_error("state.etcd.cert_file / key_file: " + ok.error());
        }
    }
    return std::move(*ctx);
}

Result<std::unique_ptr<credstore::StateStore>> open_etcd_store(
    const EtcdConfig& options, std::vector<std::string> dns_servers,
    std::map<std::string, std::vector<policy::IpAddress>> dns_overrides) {
    if (options.endpoints.empty()) {
        return make_error("state.etcd.endpoints: no endpoint");
    }
    if (options.prefix.empty()) {
        return make_error("state.etcd.prefix: must not be empty");
    }
    std::vector<Endpoint> endpoints;
    for (const auto& text : options.endpoints) {
        auto ep = parse_endpoint(text);
        if (!ep) {
            return make_error("state.etcd.endpoints: " + ep.error());
        }
        endpoints.push_back(std::move(*ep));
    }
    auto ctx = etcd_tls_context(options);
    if (!ctx) {
        return make_error(ctx.error());
    }
    std::unique_ptr<net::ssl::context> tls_ctx;
    if (*ctx) {
        tls_ctx = std::make_unique<net::ssl::context>(ctx->release());
    }
    auto store = std::make_unique<EtcdStateStore>(options, std::move(endpoints),
                                                  std::move(tls_ctx), std::move(dns_servers),
                                                  std::move(dns_overrides));
    if (auto s = store->start(); !s) {
        return make_error("state.etcd.endpoints: " + s.error());
    }
    return std::unique_ptr<credstore::StateStore>(std::move(store));
}

}  // namespace egress::proxy
