#pragma once
// The protocol-neutral request core (DESIGN.md steps 6–11): one request head goes through the
// pipeline once, then upstream connect (pooled h1 connection or a stream on a pooled h2
// session), body relay both ways with backpressure, scrub and audit. Written once for every
// {h1, h2} client × {h1, h2} upstream combination; the codecs are thin adapters behind the
// Downstream and Upstream interfaces. Internal to proxy/ (includes Asio, not Beast's parser
// nor nghttp2).
#include <chrono>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "policy/request_head.h"
#include "proxy/upstream.h"
#include "proxy/worker.h"

namespace egress::proxy {

/// Why a run found missing from the current runtime is gone: its expiry passed, or it was
/// revoked (the 403 reason a client holding its token gets).
inline const char* run_end_reason(const Run& run) {
    return run.policy.expires_at <= policy::Clock::now() ? "run_expired" : "run_revoked";
}

/// Identity and destination of one client connection (or, for absolute-form, one request).
struct Scope {
    Worker* worker = nullptr;
    std::shared_ptr<const Runtime> runtime;
    std::shared_ptr<Run> run;
    policy::HostPort target;
    std::optional<std::string> sni;
    bool tls = false;  // intercepted TLS (https); false = absolute-form http://
    uint64_t conn_id = 0;
    std::string proto_in = "http/1.1";
    /// What audit records of the connection itself (not of a request) name as the method:
    /// "CONNECT" on the forward port, "TLS" on the transparent listener.
    std::string method = "CONNECT";
    /// Why the connection was cut under its requests (a revoke, an expiry, a reload that
    /// changed the run's token or sources), once it was: their records say so (RunAdmission).
    const char* const* cut_why = nullptr;
    const char* cut() const { return cut_why != nullptr ? *cut_why : nullptr; }
};

using Headers = std::vector<policy::Header>;

/// How a message body is framed, independent of protocol.
struct BodyInfo {
    bool none = false;                  // no body at all (END_STREAM on HEADERS, no CL/TE)
    std::optional<uint64_t> length;     // known length (content-length), if any
};

/// Why a body read failed.
enum class BodyFailure : uint8_t {
    Aborted,  // the peer closed or reset
    Timeout,  // no progress within idle_timeout
    Framing,  // malformed framing (chunk syntax, length mismatch): a smuggling attempt or a bug
    // Found by the exchange in a chunk-signed aws-sigv4 upload (policy::AwsChunkSigner):
    AwsChunk,        // not aws-chunked
    TooLargeToSign,  // a chunk over limits.sign_body_bytes
};

/// One piece of a body. `data` is the source's own buffer: it stays valid until the next read
/// on the same source, and the reader may rewrite it in place (the response scrubber does).
struct BodyChunk {
    std::span<char> data;
    bool last = false;   // the body (and its trailers) is complete
    bool ok = true;      // false: see `failure`
    BodyFailure failure = BodyFailure::Aborted;
    /// Bytes in front of data.data() that the reader owns and the reader's user may overwrite
    /// (the response scrubber puts the bytes it held back there: policy::Scrubber::feed_in_place).
    size_t headroom = 0;
    std::string_view view() const { return {data.data(), data.size()}; }
};

struct ResponseHead {
    int status = 0;
    std::string reason;  // HTTP/1.1 reason phrase, if the upstream sent one
    Headers headers;     // names as the upstream sent them (h2: lowercase), hop-by-hop removed
    BodyInfo body;
    /// A 101's Upgrade value (the protocol the connection switches to; hop-by-hop, so not in
    /// `headers`); "" for any other response.
    std::string upgrade;
};

/// The raw bytes of an HTTP/1.1 connection that switched protocols (a 101 to a WebSocket
/// upgrade): what either peer sends, as it comes. One read and one write may be pending at
/// once (the relay's two directions).
class RawBytes {
public:
    virtual ~RawBytes() = default;
    /// The next bytes the peer sent (bytes it sent behind its head first); valid until the
    /// next read. Empty: the peer closed, failed, or stop() was called.
    virtual awaitable<std::span<char>> read() = 0;
    /// All of `data`, or false.
    virtual awaitable<bool> write(std::string_view data) = 0;
    /// Ends a pending read or write now (it fails) and every later one.
    virtual void stop() = 0;
};

class Upstream;

/// The client side of one request. Methods run on the connection's executor; at most one
/// read and one write are in flight (the core is sequential).
class Downstream {
public:
    virtual ~Downstream() = default;
    virtual const char* proto() const = 0;  // "http/1.1" | "h2"
    virtual BodyInfo request_body() const = 0;
    /// Next request body piece; its view is valid until the next call. After the previous
    /// piece was forwarded (the next call), its bytes are released to the client (h2 window).
    virtual awaitable<BodyChunk> read_body() = 0;
    /// Request trailers, valid after read_body returned last (empty if none).
    virtual Headers request_trailers() = 0;
    /// Answers "Expect: 100-continue" (HTTP/1.1 only; h2 ignores it).
    virtual awaitable<void> send_continue() = 0;
    /// A refusal: status, text body, X-Egress-Reason. `keep_alive` is a hint for HTTP/1.1.
    virtual awaitable<void> refuse(int status, const std::string& reason, bool keep_alive) = 0;
    /// Sends the response head; `head.body.none` means no body follows.
    virtual awaitable<bool> send_head(const ResponseHead& head) = 0;
    /// Sends a body piece; with `last`, ends the response (with `trailers` if non-null and
    /// the framing can carry them). Waits while the client is slow (backpressure).
    virtual awaitable<bool> send_body(std::string_view data, bool last,
                                      const Headers* trailers) = 0;
    /// HTTP/1.1: whether the client sent "Connection: keep-alive" semantics.
    virtual bool client_keep_alive() const = 0;
    /// While the request waits on its upstream, a client that goes away ends the wait:
    /// `cut(arg)` runs (Upstream::abort while the response head is awaited, DialCut::cut
    /// while the upstream is dialed; it must complete the wait through a posted handler), so
    /// an abandoned request is never sent, and holds no upstream connection or stream, nor a
    /// handler or a connection slot, until an answer nobody will read. A null `cut` ends the
    /// watch. HTTP/2: the stream's RST_STREAM; HTTP/1.1: the connection's close (FIN, reset,
    /// close_notify).
    virtual void abort_with(void (*cut)(void*), void* arg) = 0;
    /// abort_with(Upstream::abort of `up`); nullptr ends the watch.
    void abort_with(Upstream* up);
    /// Whether the client went away during the watch.
    virtual bool gone() const = 0;
    /// Whether the request was cut for malformed framing rather than by its client leaving
    /// (HTTP/2: DATA that broke the stream's content-length, reset by nghttp2).
    virtual bool malformed() const { return false; }
    /// The exchange wants no more of the request body (its response ended or failed first):
    /// a pending read_body ends now, failed, and so does every later one. HTTP/2 only (the
    /// full-duplex path); HTTP/1.1 reads its body only before its response.
    virtual void stop_reading() {}
    /// Undoes stop_reading: the body is read on from where it was (the request goes out again
    /// on another upstream stream after a refused one). Bytes the client sent meanwhile were
    /// not consumed; the next read_body returns them.
    virtual void resume_reading() {}
    /// Sends a 101 (`head.upgrade` set) and gives the connection's raw bytes from then on;
    /// nullptr when it could not be sent or this protocol cannot switch (HTTP/2).
    virtual awaitable<RawBytes*> switch_protocols(const ResponseHead& head) = 0;
};

/// The origin side of one request.
class Upstream {
public:
    virtual ~Upstream() = default;
    virtual const char* proto() const = 0;  // "http/1.1" | "h2"
    virtual tcp::endpoint peer() const = 0;
    /// A pooled connection that may have been closed while idle (retry once on failure).
    virtual bool reused() const = 0;
    virtual awaitable<bool> send_head(const policy::RequestHead& head, const BodyInfo& body) = 0;
    virtual awaitable<bool> send_body(std::string_view data, bool last,
                                      const Headers* trailers) = 0;
    /// Whether the upstream has answered and will take no more of the request body (an
    /// HTTP/1.1 head saying it closes, a complete or reset HTTP/2 stream), or closed, while the
    /// body is still being sent, without waiting: such an early answer (a 413, a 401 on an
    /// upload) stops the upload. Reads what is already there and nothing more.
    virtual bool answered() = 0;
    /// The final response head (1xx skipped), waiting at most `wait` for it. Refusal on
    /// failure (502/504 + reason). Also called after a request body write failed: an answer
    /// the upstream sent before it stopped taking the body is still read.
    virtual awaitable<Outcome<ResponseHead>> read_head(bool head_request,
                                                       std::chrono::milliseconds wait) = 0;
    /// The last read_head failed because the connection was closed or reset before any byte
    /// of an answer: what a pooled connection the upstream closed while idle does.
    virtual bool closed_unanswered() const { return false; }
    virtual awaitable<BodyChunk> read_body() = 0;
    virtual Headers response_trailers() = 0;
    /// The exchange completed cleanly: the connection may go back to the pool.
    virtual void finish() = 0;
    /// Gives the request up now (its client went away): a wait for the response head ends
    /// with a failure; an HTTP/1.1 connection is shut, an HTTP/2 stream reset (CANCEL).
    virtual void abort() = 0;
    /// After a 101: the connection's raw bytes (never pooled again); nullptr on HTTP/2.
    virtual RawBytes* switched() = 0;
    /// The response echoed a credential (the scrubber replaced it where the relay reads it):
    /// the other copies of what was read are wiped (the read buffers' consumed bytes,
    /// OpenSSL's decrypted records), and this connection's reads are wiped from now on.
    virtual void wipe_reads() = 0;
};

inline void Downstream::abort_with(Upstream* up) {
    if (up == nullptr) {
        abort_with(nullptr, nullptr);
    } else {
        abort_with([](void* u) { static_cast<Upstream*>(u)->abort(); }, up);
    }
}

/// One request, end to end: refresh the run, pipeline, upstream, relay, scrub, audit.
/// Returns whether an HTTP/1.1 client connection may be reused.
awaitable<bool> serve_exchange(Downstream& down, policy::RequestHead head, Scope& scope,
                               std::chrono::steady_clock::time_point started);

/// "host:port" of an upstream peer as the audit record's upstream_addr names it.
std::string endpoint_text(const tcp::endpoint& ep);

/// audit.durable: queues `rec` (a decision record) on the durable audit log and resumes on
/// the calling coroutine's executor once the writer thread synced it (true) or failed to
/// (false). The event loop never blocks on the disk; records waiting at the same time share
/// one fdatasync.
awaitable<bool> audit_durably(AuditLog& log, const AuditRecord& rec);

/// Records a refusal in audit and metrics; `req_id` that of a decision record already
/// written for it (audit.durable), or 0 for a new one; `run` the run to name when it is not
/// the scope's (an identity refusal: the run whose token was presented, or none).
void audit_refusal(Scope& scope, const std::string& method, const std::string& path, int status,
                   const std::string& reason, std::chrono::steady_clock::time_point started,
                   uint64_t req_id = 0, const std::string* run = nullptr);

// --- codec factories (defined by the codecs) ---------------------------------------------
std::unique_ptr<Upstream> make_h1_upstream(Worker& w, std::unique_ptr<TlsConn> conn, bool reused,
                                           std::string host_header);
std::unique_ptr<Upstream> make_h1_plain_upstream(Dialed d, std::string host_header,
                                                 const Limits& limits);

/// Points the scope at its worker's current runtime and that runtime's copy of the scope's
/// run, when the runtime changed and the run is still in it. A run that ended is left as it
/// is: serve_exchange refuses its next request, and its connections are being closed.
/// Inline: the fuzz targets link h2_server.cc without exchange.cc.
inline void refresh_scope(Scope& scope) {
    const std::shared_ptr<const Runtime>& now = scope.worker->runtime();
    if (scope.runtime == now || !scope.run) {
        return;
    }
    if (const auto* fresh = now->lookup(scope.run->policy.id)) {
        scope.run = *fresh;
        scope.runtime = now;
    }
}

/// Serves HTTP/2 on an intercepted TLS connection (ALPN "h2") until it closes. Takes the
/// scope's contents (moved out: the caller's scope is left empty).
awaitable<void> serve_intercepted_h2(TlsStream& client, Scope& scope);

}  // namespace egress::proxy
