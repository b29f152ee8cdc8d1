#pragma once
// Internal to proxy/: the per-thread worker (one io_context per core, STYLE.md §4) and the
// process-wide shared state. Includes Asio: only proxy/*.cc include this.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <list>
#include <map>
#include <set>
#include <mutex>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <spdlog/spdlog.h>

#include "common/published.h"
#include "policy/pipeline.h"
#include "proxy/audit.h"
#include "proxy/metrics.h"
#include "proxy/net.h"
#include "proxy/resolver.h"
#include "proxy/runtime.h"
#include "tls/openssl_ptr.h"
#include "tls/session_cache.h"

namespace egress::proxy {

class UpstreamPool;
class ControlPlane;
class Upstream;

/// Work that waits on an upstream and that the drain's cut must end at once (Worker::cut_all):
/// a request waiting for its upstream's response head, an upstream TCP connect or TLS
/// handshake in progress. Shutting the client's connection down is not noticed there, so
/// without the cut a request on a silent upstream outlived the drain without its audit
/// record. A node in the waiting coroutine's frame, linked into its worker's list (CutGuard)
/// without an allocation; `cut` must complete the wait through a posted handler (an abort, a
/// socket cancel), never inline.
struct Cuttable {
    void (*cut)(void* arg) = nullptr;
    void* arg = nullptr;
    Cuttable* prev = nullptr;
    Cuttable* next = nullptr;
};

/// A registered client connection's descriptor, and why it was cut (set on the connection's
/// own executor, before the shutdown): its requests' audit records say so rather than
/// client_aborted.
struct RegisteredConn {
    int fd = -1;
    const char* cut = nullptr;  // "run_revoked", "run_expired", "run_changed"
};

/// Open client connections by run, so revoking a run closes them at once. close_run posts
/// a shutdown(fd) to each connection's own executor. The connection resets its token when it
/// ends, and the socket's inode is checked before the shutdown, so an fd number that was
/// closed and reused by another socket (another thread's, e.g. the admin API's) is never hit.
class ConnectionRegistry {
public:
    /// Registers a connection of `run` unless `limit` of its connections are registered
    /// already: then 0, nothing registered (limits.connections_per_run). Counted by run id, so a
    /// run rebuilt (a rotated secret, a reload) keeps its count, and a connection holds no
    /// reference to the Run (its pins' secrets) it was admitted under.
    uint64_t add(const std::string& run, size_t limit, net::any_io_executor ex,
                 std::weak_ptr<RegisteredConn> fd_token);
    void remove(const std::string& run, uint64_t id);
    /// With `wait`, returns once every shutdown has run (or `wait` passed): a revoke answers
    /// after its run's connections are cut. Never with a wait from a worker's own thread.
    /// `why` goes to each connection's RegisteredConn::cut (null: the drain, which says so
    /// itself).
    size_t close_run(const std::string& run,
                     std::chrono::milliseconds wait = std::chrono::milliseconds(0),
                     const char* why = nullptr);
    /// Shuts down every registered connection (close_run for each run): the drain deadline.
    size_t close_all();

private:
    struct Entry {
        net::any_io_executor ex;
        std::weak_ptr<RegisteredConn> fd_token;
        uint64_t inode = 0;  // the socket's inode: a reused fd number is never shut down
    };
    std::mutex mu_;
    uint64_t next_id_ = 1;
    std::map<std::string, std::map<uint64_t, Entry>> by_run_;
};

/// The admin listeners' open connections (TCP and unix socket together), least recently
/// active first (admin_ioc's one thread only: no lock). admin.max_connections bounds them, as
/// limits.max_unidentified_connections bounds the proxy's: a new connection over it closes the
/// least recently active one that is not inside an authorized API call (waiting for or reading
/// a request, answering a probe, lingering after an error: all an unauthenticated client can
/// hold), so a flood of idle connections neither exhausts descriptors nor locks out probes and
/// egressctl. An API call inside its connection is never cut, and at most max_connections - 1
/// are: the call that would take the last place is answered 503, so there is always a
/// connection to close for a newcomer (a liveness probe while calls queue on a stalled etcd).
class AdminConnections {
public:
    /// One connection's place, in its coroutine frame.
    class Slot {
    public:
        template <class Socket>
        Slot(AdminConnections& owner, Socket& socket, size_t limit)
            : owner_(owner), socket_(&socket), shut_([](void* s) {
                  error_code ignored;
                  static_cast<Socket*>(s)->shutdown(net::socket_base::shutdown_both, ignored);
              }) {
            owner_.admit(*this, limit);
        }
        ~Slot() { owner_.leave(*this); }
        Slot(const Slot&) = delete;
        Slot& operator=(const Slot&) = delete;
        enum class Protect { Done, Closed, Full };
        /// An authorized API call begins: not closed to make room until it is answered.
        /// Closed: the connection was closed to make room already (its request is not acted
        /// on); Full: max_connections - 1 calls are in progress (answer 503).
        Protect protect(size_t limit);
        /// The call is answered: closable again, as the most recently active connection.
        void done() { owner_.touch(*this); }

    private:
        friend class AdminConnections;
        AdminConnections& owner_;
        void* socket_;
        void (*shut_)(void*);
        bool protected_ = false;
        bool linked_ = false;
        std::list<Slot*>::iterator at_;
    };

private:
    void admit(Slot& s, size_t limit);
    void leave(Slot& s);
    void touch(Slot& s);
    void unprotect(Slot& s);
    std::list<Slot*> open_;
    size_t protected_ = 0;  // slots inside an API call
    uint64_t closed_ = 0;
};

/// Process-wide state, shared read-mostly by every worker. What a request writes per request
/// (its id, the in-flight count, metrics) is kept per worker (Worker below): a line every core
/// writes costs each request a cache miss and a locked instruction on a contended line.
struct Shared {
    Published<const Runtime> runtime;
    /// Bumped after each store to `runtime`: workers reload their copy only when it moved.
    std::atomic<uint64_t> runtime_gen{0};
    /// Stores `next` as the runtime and returns the one it replaces.
    std::shared_ptr<const Runtime> publish(std::shared_ptr<const Runtime> next) {
        auto prev = runtime.exchange(std::move(next));
        runtime_gen.fetch_add(1, std::memory_order_release);
        return prev;
    }
    std::unique_ptr<AuditLog> audit;
    Metrics metrics;
    // asio's ssl::context adopts an SSL_CTX made by tls/ (and frees it).
    std::unique_ptr<ssl::context> server_ctx;  // intercepted leg
    std::unique_ptr<ssl::context> client_ctx;  // upstream leg
    policy::RequestPipeline pipeline;
    std::vector<tcp::endpoint> own_listeners;  // for the self-connection check
    std::atomic<bool> draining{false};
    /// The drain's deadline (steady_clock ticks), stored before `draining`: the lingering
    /// closes of the connections it ends (drain_close) wait no longer.
    std::atomic<std::chrono::steady_clock::rep> drain_deadline{0};
    /// Set when drain_timeout ran out and the connections still open were shut down: an allow
    /// record written after that says reason "drain_timeout" (Worker::audit), whichever error
    /// path its request or tunnel ended through.
    std::atomic<bool> drain_cut{false};
    std::atomic<uint64_t> next_conn_id{1};
    size_t worker_count = 1;  // set at start (a share of a process-wide limit per worker)
    /// state.etcd.max_staleness as the process started (the state.etcd keys, and the store's
    /// timeout it is checked against, need a restart): /readyz's bound.
    std::optional<std::chrono::milliseconds> max_staleness;
    std::atomic<uint64_t> next_req_id{1};  // workers take request ids from here in blocks
    ConnectionRegistry connections;
    AdminConnections admin_connections;  // admin_ioc's thread only
    ControlPlane* control = nullptr;  // set when the admin API is enabled
    /// The control thread: `control`'s calls run there, off the admin listener's thread.
    net::any_io_executor control_executor;
};

/// A connection of one worker that has not yet sent the request head that identifies its run
/// (so limits.connections_per_run does not count it yet), in the worker's list of them: an
/// intrusive list (the guard lives in the connection's coroutine frame), oldest first.
class UnidentifiedGuard {
public:
    UnidentifiedGuard(struct Worker& w, tcp::socket& s);
    ~UnidentifiedGuard() { identified(); }
    UnidentifiedGuard(const UnidentifiedGuard&) = delete;
    UnidentifiedGuard& operator=(const UnidentifiedGuard&) = delete;
    /// Leaves the list (the head came and named a run; or the connection ends).
    void identified();

private:
    friend struct Worker;
    struct Worker* w_;
    tcp::socket* socket_;
    UnidentifiedGuard* prev_ = nullptr;
    UnidentifiedGuard* next_ = nullptr;
    bool linked_ = false;
};

/// One event loop on one thread. Everything on it runs without locks.
struct Worker {
    explicit Worker(Shared& s);
    ~Worker();

    /// The current runtime as this worker last loaded it, reloaded only when the control
    /// plane published another (Shared::runtime_gen): a load takes a lock and a reference on
    /// lines every core writes, per request. A request still sees every change published
    /// before it starts.
    const std::shared_ptr<const Runtime>& runtime() {
        const uint64_t gen = shared.runtime_gen.load(std::memory_order_acquire);
        if (gen != runtime_gen_ || !runtime_) {
            runtime_ = shared.runtime.load();
            runtime_gen_ = gen;
        }
        return runtime_;
    }
    /// A request id, unique in the process: taken from Shared::next_req_id kReqIdBlock at a
    /// time, so ids of different workers interleave in blocks rather than in time order.
    uint64_t next_req_id() {
        if (req_id_next_ == req_id_end_) {
            req_id_next_ = shared.next_req_id.fetch_add(kReqIdBlock);
            req_id_end_ = req_id_next_ + kReqIdBlock;
        }
        return req_id_next_++;
    }
    static constexpr uint64_t kReqIdBlock = 64;
    /// Requests and tunnels in progress on this worker (the drain on SIGTERM waits for every
    /// worker's to reach 0). Written by this worker's thread only, read by the drain.
    std::atomic<int64_t> inflight{0};
    /// Connections the drain ended that are still closing (ClosingGuard): once nothing is in
    /// flight, the drain waits for these too, so a response already written is not destroyed
    /// by a reset or by the exit while the client still reads it.
    std::atomic<int64_t> closing{0};
    /// This worker's request counters (Metrics::Shard).
    Metrics::Shard& metrics;
    /// Upstream TLS sessions (tickets) by pool key, for resumption. Declared before ioc so
    /// it outlives every connection (and SSL) the loop's coroutines hold. Null when
    /// limits.upstream_tls_sessions is 0.
    std::unique_ptr<tls::ClientSessionCache> tls_sessions;
    /// The watchdog timers of this worker's HTTP/2 connections (h2_server.cc), touched on
    /// this worker's thread only: SIGTERM cancels them so each connection sends its GOAWAY
    /// at once instead of at its next 250 ms tick. Declared before ioc: a connection frame
    /// destroyed with the loop still unregisters itself.
    std::set<net::steady_timer*> h2_watchdogs;
    /// This worker's waits on upstreams (this worker's thread only; CutGuard).
    Cuttable* cuttable = nullptr;
    /// Connections not identified yet, oldest first (UnidentifiedGuard). Over this worker's
    /// share of limits.max_unidentified_connections, a new one ends the oldest: a client
    /// that opens connections and never sends a head holds at most that many descriptors
    /// (each for header_timeout at most), while one that sends its head at once is never
    /// the oldest for long.
    UnidentifiedGuard* unidentified_oldest = nullptr;
    UnidentifiedGuard* unidentified_newest = nullptr;
    size_t unidentified_count = 0;
    uint64_t unidentified_evicted = 0;
    /// The drain's cut: every wait on an upstream ends now (each Cuttable's cut, and every
    /// DNS lookup in flight), so each request ends through its error path with its record.
    void cut_all();
    net::io_context ioc{1};
    Shared& shared;
    std::unique_ptr<Resolver> resolver;
    std::unique_ptr<UpstreamPool> pool;

    /// Runs the event loop (ioc.run() plus the idle hook below) until ioc is stopped.
    void run();

    /// Writes an audit record. Records are appended to `audit_pending` and go to the file
    /// with one write(2) when the loop runs out of ready work (run()): one write per request
    /// cost ~12% of egressd's CPU at h2 load (ext4 write path), and a flush posted behind
    /// each turn still wrote one record at a time when an h2 upstream hands out one
    /// response per turn. No added latency (the flush runs as soon as the loop is free); at
    /// most kAuditFlushBytes or kIdleEvery handlers' records in memory. audit.durable's
    /// decision records do not come here.
    void audit(const AuditRecord& rec);
    void flush_audit();
    std::string audit_pending;
    static constexpr size_t kAuditFlushBytes = 64 * 1024;
    static constexpr size_t kIdleEvery = 256;

private:
    std::shared_ptr<const Runtime> runtime_;
    uint64_t runtime_gen_ = 0;
    uint64_t req_id_next_ = 0;
    uint64_t req_id_end_ = 0;
};

/// Adds one to a worker's count while it lives. Only the worker's own thread writes the
/// count: a plain load and store, no locked instruction.
class CountGuard {
public:
    explicit CountGuard(std::atomic<int64_t>& n) : n_(n) { add(1); }
    ~CountGuard() { add(-1); }
    CountGuard(const CountGuard&) = delete;
    CountGuard& operator=(const CountGuard&) = delete;

private:
    void add(int64_t d) {
        n_.store(n_.load(std::memory_order_relaxed) + d, std::memory_order_relaxed);
    }
    std::atomic<int64_t>& n_;
};

/// Counts one request or tunnel in flight on its worker for the drain on SIGTERM.
class InflightGuard : public CountGuard {
public:
    explicit InflightGuard(Worker& w) : CountGuard(w.inflight) {}
};

/// Counts one connection the drain ended while it closes (Worker::closing). Taken with no
/// suspension after its last request stopped counting in flight: the drain looks at the
/// closes only after every worker's loop has turned since it saw nothing in flight.
class ClosingGuard : public CountGuard {
public:
    explicit ClosingGuard(Worker& w) : CountGuard(w.closing) {}
};

/// The close of a connection the drain ended (the caller holds a ClosingGuard): a lingering
/// close (linger_close), as the client may still send (HTTP/2 WINDOW_UPDATEs, a pipelined
/// request) and closing with its bytes unread would reset the connection and discard what
/// the kernel had not sent yet. Past limits.linger_timeout it waits on while the client has
/// not acknowledged everything, until the drain's deadline.
template <class Socket>
awaitable<void> drain_close(Socket& s, Worker& w) {
    const std::chrono::steady_clock::time_point deadline(
        std::chrono::steady_clock::duration(w.shared.drain_deadline.load()));
    co_await linger_close(s, w.runtime()->config->limits.linger_timeout,
                          std::numeric_limits<size_t>::max(), deadline);
}

/// Serves one client connection on the forward-proxy port (CONNECT and absolute-form).
awaitable<void> serve_proxy_client(tcp::socket socket, Worker& worker);
/// Serves one connection the kernel redirected to the transparent listener: original
/// destination from the socket, host from the peeked TLS SNI (or Host), run from the source.
awaitable<void> serve_transparent_client(tcp::socket socket, Worker& worker);
/// Serves one admin connection (/healthz, /readyz, /metrics, /v1 control-plane API).
template <class Socket>
awaitable<void> serve_admin_client(Socket socket, Shared& shared);

/// The waits of one upstream dial as the request's client sees them: a client that goes
/// away meanwhile (Downstream::abort_with(DialCut::cut, this)) cuts the connect or handshake
/// wait in progress (or its wait for another request's dial: UpstreamPool::wait_dial), and
/// the dial stops at its next step, so a request nobody waits for any more is never sent
/// (nginx's check for a broken client connection while it connects upstream). A DNS lookup
/// in progress is not cut; the dial stops after it. A dial other requests wait for (it may
/// bring the HTTP/2 session they share: UpstreamPool::begin_dial) goes on for them; only its
/// own request gives up.
struct DialCut {
    Cuttable* waiting = nullptr;  // the connect or handshake in progress (its CutGuard)
    bool abandoned = false;       // the client went away: its request gives up
    const UpstreamPool* pool = nullptr;  // with `key`: the coalesced dial this is, if any
    std::string key;
    /// Whether the dial itself ends: abandoned, and no other request waits for it.
    bool stops() const;
    static void cut(void* self);  // Downstream::abort_with's cut
};

/// Links a wait into its worker's cut list (Worker::cuttable) for as long as it lives.
class CutGuard {
public:
    /// With `dial`, the wait is also the one that dial's client cuts (DialCut).
    CutGuard(Worker& w, void (*cut)(void*), void* arg, DialCut* dial = nullptr)
        : w_(w), dial_(dial) {
        node_.cut = cut;
        node_.arg = arg;
        node_.next = w.cuttable;
        if (w.cuttable != nullptr) {
            w.cuttable->prev = &node_;
        }
        w.cuttable = &node_;
        if (dial_ != nullptr) {
            dial_->waiting = &node_;
        }
    }
    ~CutGuard() {
        (node_.prev != nullptr ? node_.prev->next : w_.cuttable) = node_.next;
        if (node_.next != nullptr) {
            node_.next->prev = node_.prev;
        }
        if (dial_ != nullptr) {
            dial_->waiting = nullptr;
        }
    }
    CutGuard(const CutGuard&) = delete;
    CutGuard& operator=(const CutGuard&) = delete;

private:
    Worker& w_;
    DialCut* dial_;
    Cuttable node_;
};

/// A Cuttable's cut for a socket waiting to connect or to be readable/writable: the wait
/// completes with operation_aborted (the socket stays open; its owner closes it).
inline void cancel_socket(void* socket) {
    boost::system::error_code ec;
    static_cast<net::ip::tcp::socket*>(socket)->cancel(ec);
}

}  // namespace egress::proxy
