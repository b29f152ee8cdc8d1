// HTTP/2 on the intercepted client leg: one reader coroutine (mem_recv), one writer coroutine
// (mem_send, the only writer), a watchdog (timeouts, drain), and one coroutine per stream
// running the shared core. Streams are looked up by id after every callback; the session is
// destroyed before anything its callbacks reference.
#include "proxy/h2_server.h"

#include <charconv>
#include <cstring>
#include <unordered_map>

#include "policy/header_rules.h"
#include "proxy/h2_common.h"
#include "proxy/h2_pool.h"

namespace egress::proxy {

namespace {

using Clock = std::chrono::steady_clock;

struct ServerStream {
    explicit ServerStream(const net::any_io_executor& ex) : signal(ex) {}
    int32_t id = 0;
    Signal signal;  // wakes the stream's handler when the request moves or the stream ends
    /// Wakes a response body writer (h2_send_body) when its bytes were taken or the stream
    /// ended: its own, so a handler may read the request and write the response at once.
    LazySignal sent;
    // request
    policy::RequestHead head;
    std::string host;  // a "host" header, if sent
    bool has_host = false;
    std::optional<uint64_t> content_length;
    uint64_t received = 0;  // request body bytes
    size_t header_bytes = 0;
    size_t header_fields = 0;
    std::vector<std::string> cookies;
    bool in_trailers = false;
    Headers trailers;
    bool end_on_headers = false;
    bool req_end = false;
    PieceQueue in;
    bool front_out = false;
    // response
    bool response_started = false;
    bool response_done = false;  // its END_STREAM went out: the response is complete
    PieceQueue out;
    size_t out_off = 0;
    size_t out_bytes = 0;
    bool out_last = false;
    Headers out_trailers;
    bool deferred = false;
    // state
    bool closed = false;
    uint32_t error = 0;
    Clock::time_point began = Clock::now();
    std::string refusal;  // why egressd or nghttp2 reset it (audited), empty for a client reset
    bool peer_reset = false;      // closed by the client's RST_STREAM
    bool header_refused = false;  // a header callback refused its block: nghttp2 resets it
                                  // INTERNAL_ERROR, for the client's fault (not an upstream's)
    bool body_stopped = false;  // the core wants no more of the request body (stop_reading)
    bool handled = false;       // a handler owns it
    bool head_complete = false;  // its request head arrived whole (it is a request)
    bool handler_gone = false;  // its handler finished: late DATA is consumed at once
    void (*abort_fn)(void*) = nullptr;  // the wait on the upstream (Downstream::abort_with)
    void* abort_arg = nullptr;

    /// The client is gone (reset, or the connection died): the upstream part it waits on, if
    /// any, is given up at once.
    void client_gone() {
        closed = true;
        if (auto* cut = std::exchange(abort_fn, nullptr)) {
            cut(abort_arg);
        }
        signal.notify();
        sent.notify();
    }
};

struct Conn {
    Conn(TlsStream& s, Scope sc) : io(s), scope(std::move(sc)), watchdog(s.get_executor()),
                                   handlers_done(s.get_executor()) {}
    ~Conn() { session.reset(); }  // before the streams its callbacks point into

    H2Io io;
    Scope scope;
    Limits limits;
    H2Pool pool;  // nghttp2's memory: outlives the session
    SessionPtr session;
    StreamMap<ServerStream> streams;
    std::vector<int32_t> ready;  // complete request heads from the last mem_recv
    net::steady_timer watchdog;
    Signal handlers_done;
    size_t handlers = 0;
    Clock::time_point started = Clock::now();
    bool settings_acked = false;
    bool goaway_sent = false;
    std::optional<ClosingGuard> closing;  // from the drain's GOAWAY until the close is done
    // flood accounting
    uint64_t total_streams = 0;
    uint64_t premature_resets = 0;
    double control_tokens = 0;
    Clock::time_point control_refill = Clock::now();
    double reset_tokens = 0;  // resets the client provoked (codec_reset)
    Clock::time_point reset_refill = Clock::now();
    bool calm = false;    // misbehaving peer: GOAWAY ENHANCE_YOUR_CALM (calm_down), a control
                          // flood's after this mem_recv, a reset flood's at once
    bool calmed = false;  // that GOAWAY is queued

    ServerStream* find(int32_t id) {
        auto it = streams.find(id);
        return it == streams.end() ? nullptr : it->second.get();
    }
    void control_frame() {
        auto now = Clock::now();
        double burst = static_cast<double>(limits.h2_control_frame_burst);
        control_tokens = std::min(
            burst, control_tokens + std::chrono::duration<double>(now - control_refill).count() *
                                        burst / 10.0);
        control_refill = now;
        if (control_tokens < 1.0) {
            calm = true;
            return;
        }
        control_tokens -= 1.0;
    }
    /// Frames nghttp2 may hold queued for the client: a few per stream in flight and the
    /// acknowledgements it may owe (h2_max_outbound_ack), with room to spare.
    size_t max_outbound_items() const {
        return 4 * (limits.h2_max_concurrent_streams + limits.h2_max_outbound_ack) + 1024;
    }
    void fail_all() {
        for (auto& [id, st] : streams) {
            st->client_gone();
        }
    }
    /// GOAWAY(ENHANCE_YOUR_CALM) now, once, and no stream of the current read starts. Safe in
    /// nghttp2's callbacks: a stream may be closed while the writer's mem_send sends its
    /// RST_STREAM, and the reader may then be waiting for a read that never comes.
    void calm_down() {
        calm = true;
        ready.clear();  // never started: recorded as the connection ends (record_unstarted)
        if (std::exchange(calmed, true)) {
            return;
        }
        spdlog::info("conn={} h2: misbehaving client (resets/control flood): GOAWAY",
                     scope.conn_id);
        goaway_sent = true;
        nghttp2_session_terminate_session(session.get(), NGHTTP2_ENHANCE_YOUR_CALM);
        io.wsig.notify();
    }
    /// A stream reset before its response (rapid reset: it may have cost the upstream a
    /// request and its cancel, and costs us a handler): past h2_max_premature_resets, when
    /// they are at least half of the connection's streams, the client goes.
    void premature_reset() {
        ++premature_resets;
        if (premature_resets >= limits.h2_max_premature_resets &&
            premature_resets * 2 >= total_streams) {
            calm_down();
        }
    }
    /// A stream nghttp2 (or a header callback) reset because of the client's protocol error
    /// ("MadeYouReset", CVE-2025-8671: nghttp2 1.52 charges its stream reset bucket only for
    /// the RST_STREAM frames a client sends). Taken from a bucket of the same burst and rate,
    /// and, before the response completed, a premature reset like the client's own.
    void codec_reset(bool premature) {
        auto now = Clock::now();
        double burst = static_cast<double>(limits.h2_stream_reset_burst);
        reset_tokens = std::min(
            burst, reset_tokens + std::chrono::duration<double>(now - reset_refill).count() *
                                      static_cast<double>(limits.h2_stream_reset_rate));
        reset_refill = now;
        if (reset_tokens < 1.0) {
            calm_down();
        } else {
            reset_tokens -= 1.0;
        }
        if (premature) {
            premature_reset();
        }
    }
};

/// Whether nghttp2 closed a stream that the client did not reset with `error_code` because of
/// what the client sent. egressd's own resets carry NO_ERROR (after an early answer), CANCEL or
/// INTERNAL_ERROR (the core gave up: an upstream failure, the client gone) and REFUSED_STREAM
/// (too many handlers; nghttp2's, over the stream limit, never opened one). nghttp2 resets
/// with the others for the client's frames: PROTOCOL_ERROR (HTTP messaging: DATA beyond or
/// short of the content-length, a malformed field; a zero WINDOW_UPDATE), FLOW_CONTROL_ERROR,
/// STREAM_CLOSED, FRAME_SIZE_ERROR, COMPRESSION_ERROR; and with INTERNAL_ERROR when one of our
/// header callbacks refused the block.
/// The status a stream refused before a handler took it is audited with.
int refusal_status(const std::string& refusal) {
    return refusal == "header_too_large"   ? 431
           : refusal == "too_many_streams" ? 429
                                           : 400;
}

/// A stream no handler took and no close recorded: its one audit record (its refusal, or
/// client_aborted for a complete request that never started), marked so none follows.
void record_unstarted(Conn& c, ServerStream& st) {
    if (st.handled || (!st.head_complete && st.refusal.empty())) {
        return;
    }
    st.handled = true;
    if (st.refusal.empty()) {
        audit_refusal(c.scope, st.head.method, st.head.path, 0, "client_aborted", st.began);
    } else {
        audit_refusal(c.scope, st.head.method, st.head.path, refusal_status(st.refusal),
                      st.refusal, st.began);
    }
}

bool client_fault(const ServerStream& st, uint32_t error_code) {
    switch (error_code) {
        case NGHTTP2_NO_ERROR:
        case NGHTTP2_CANCEL:
        case NGHTTP2_REFUSED_STREAM:
            return false;
        case NGHTTP2_INTERNAL_ERROR:
            return st.header_refused;
        default:
            return true;
    }
}

// --- nghttp2 callbacks: never call mem_send/mem_recv here ---------------------------------

int on_begin_headers(nghttp2_session*, const nghttp2_frame* frame, void* user_data) {
    auto* c = static_cast<Conn*>(user_data);
    if (frame->hd.type != NGHTTP2_HEADERS) {
        return 0;
    }
    if (frame->headers.cat == NGHTTP2_HCAT_REQUEST) {
        auto st = make_stream<ServerStream>(c->io.stream->get_executor());
        st->id = frame->hd.stream_id;
        st->head.scheme = "";
        // Room for a typical request and the fields the pipeline sets, so neither the
        // fields below nor the injection grow the vector (it grew 1, 2, 4, 8: three moves).
        st->head.headers.reserve(policy::kTypicalHeaderFields);
        c->streams[st->id] = std::move(st);
        ++c->total_streams;
    } else if (auto* st = c->find(frame->hd.stream_id)) {
        st->in_trailers = true;
        st->header_bytes = 0;
        st->header_fields = 0;
    }
    return 0;
}

int on_header(nghttp2_session*, const nghttp2_frame* frame, const uint8_t* name, size_t namelen,
              const uint8_t* value, size_t valuelen, uint8_t, void* user_data) {
    auto* c = static_cast<Conn*>(user_data);
    auto* st = c->find(frame->hd.stream_id);
    if (st == nullptr) {
        return 0;
    }
    const bool within = within_header_budget(st, namelen, valuelen, c->limits.h2_max_header_fields,
                                             c->limits.h2_max_header_list_bytes);
    if (!within && st->in_trailers) {
        // The head went out already: the rest of the block is decoded (HPACK state stays in
        // sync) but not kept, and the body fails as malformed once the stream ends: 400
        // bad_framing and a deny record, as on HTTP/1.1 (a reset here, INTERNAL_ERROR, had
        // answered nothing and been recorded as the client's abort).
        if (st->refusal.empty()) {  // not over a refusal of the head (431) or stream (429)
            st->refusal = "bad_framing";
        }
        return 0;
    }
    if (!within || st->refusal == "header_too_large") {
        // A request head over the budget: the rest of the block is decoded (HPACK state must
        // stay in sync; h2_max_continuations bounds it) but not kept, and serve_stream answers
        // 431 with its reason, as the HTTP/1.1 leg does.
        st->refusal = "header_too_large";
        return 0;
    }
    auto n = sv(name, namelen);
    auto v = sv(value, valuelen);
    if (st->in_trailers) {
        if (!n.empty() && n[0] != ':') {
            st->trailers.push_back({std::string(n), std::string(v)});
        }
        return 0;
    }
    if (n == ":method") {
        st->head.method = v;
    } else if (n == ":scheme") {
        st->head.scheme = v;
    } else if (n == ":authority") {
        st->head.authority = v;
    } else if (n == ":path") {
        st->head.path = v;
    } else if (!n.empty() && n[0] == ':') {
        st->refusal = "bad_request";
        st->header_refused = true;
        return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;  // e.g. :protocol (not enabled)
    } else if (n == "host") {
        if (st->has_host) {
            st->host = "\n";  // two host headers: never agrees with anything
        } else {
            st->host = v;
        }
        st->has_host = true;
    } else if (n == "cookie") {
        st->cookies.emplace_back(v);  // HTTP/2 splits cookies; joined for HTTP/1.1 (RFC 9113 8.2.3)
    } else {
        if (n == "content-length") {
            uint64_t len = 0;
            auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), len);
            if (ec == std::errc() && p == v.data() + v.size()) {
                st->content_length = len;
            }
        }
        st->head.headers.push_back({std::string(n), std::string(v)});
    }
    return 0;
}

int on_frame_recv(nghttp2_session* session, const nghttp2_frame* frame, void* user_data) {
    auto* c = static_cast<Conn*>(user_data);
    const bool end = (frame->hd.flags & NGHTTP2_FLAG_END_STREAM) != 0;
    switch (frame->hd.type) {
        case NGHTTP2_SETTINGS:
            if (frame->hd.flags & NGHTTP2_FLAG_ACK) {
                c->settings_acked = true;
            } else {
                c->control_frame();
            }
            return 0;
        case NGHTTP2_PING:
            if (!(frame->hd.flags & NGHTTP2_FLAG_ACK)) {
                c->control_frame();
            }
            return 0;
        case NGHTTP2_PRIORITY:
            c->control_frame();
            return 0;
        case NGHTTP2_RST_STREAM:
            // nghttp2 closes the stream next (on_stream_close counts it).
            if (auto* st = c->find(frame->hd.stream_id)) {
                st->peer_reset = true;
            }
            return 0;
        default:
            break;
    }
    auto* st = c->find(frame->hd.stream_id);
    if (st == nullptr) {
        return 0;
    }
    if (frame->hd.type == NGHTTP2_HEADERS) {
        if (frame->headers.cat == NGHTTP2_HCAT_REQUEST) {
            st->end_on_headers = end;
            st->req_end = end;
            st->head_complete = true;
            c->ready.push_back(st->id);
        } else if (end) {
            st->req_end = true;
        }
        st->signal.notify();
    } else if (frame->hd.type == NGHTTP2_DATA) {
        if (frame->hd.length == frame->data.padlen && !end) {
            // Empty DATA frames cost us and carry nothing; padding alone carries nothing
            // either (padlen counts the Pad Length field too).
            c->control_frame();
        }
        if (end) {
            st->req_end = true;
            st->signal.notify();
        }
    }
    return 0;
}

/// A frame of a type egressd does not use (an extension, or ALTSVC, ORIGIN, PRIORITY_UPDATE:
/// all registered as the application's, start_session): dropped, and counted as a control
/// frame, as an empty DATA frame is. nghttp2 would skip them silently, unbounded.
int on_unknown_frame(nghttp2_session*, void**, const nghttp2_frame_hd*, void* user_data) {
    static_cast<Conn*>(user_data)->control_frame();
    return NGHTTP2_ERR_CANCEL;
}

/// A complete response went out while the client has not finished its request (an early
/// answer: a refusal, a body timeout): RST_STREAM(NO_ERROR) asks it to stop sending (RFC 9113
/// 8.1) and closes the stream, which would otherwise stay half-open, and its connection busy,
/// for as long as the client likes.
int on_frame_send(nghttp2_session* session, const nghttp2_frame* frame, void* user_data) {
    auto* c = static_cast<Conn*>(user_data);
    if ((frame->hd.type == NGHTTP2_HEADERS || frame->hd.type == NGHTTP2_DATA) &&
        (frame->hd.flags & NGHTTP2_FLAG_END_STREAM) != 0) {
        if (auto* st = c->find(frame->hd.stream_id)) {
            st->response_done = true;
            if (!st->req_end) {
                nghttp2_submit_rst_stream(session, NGHTTP2_FLAG_NONE, st->id, NGHTTP2_NO_ERROR);
            }
        }
    }
    return 0;
}

/// A response header block (head or trailers) nghttp2 did not send: over the session's
/// max_send_header_block_length (h2_send_block_limit, sized for every head egressd's limits let
/// through, so a backstop). nghttp2 drops it and leaves the stream open, which would hang the
/// client until idle_timeout: reset it (INTERNAL_ERROR), which ends its handler (audited as
/// a client that went away: the core hears only that the stream is gone).
int on_frame_not_send(nghttp2_session* session, const nghttp2_frame* frame, int lib_error,
                      void* user_data) {
    auto* c = static_cast<Conn*>(user_data);
    // Only a block over the send bound: a HEADERS dropped because its stream or the session
    // is closing needs nothing (and must not replace the stream's own refusal, bad_framing).
    if (frame->hd.type != NGHTTP2_HEADERS || lib_error != NGHTTP2_ERR_FRAME_SIZE_ERROR) {
        return 0;
    }
    auto* st = c->find(frame->hd.stream_id);
    if (st == nullptr || st->closed) {
        return 0;
    }
    spdlog::warn("conn={} h2 stream {}: response header block not sent ({}): reset",
                 c->scope.conn_id, st->id, nghttp2_strerror(lib_error));
    nghttp2_submit_rst_stream(session, NGHTTP2_FLAG_NONE, st->id, NGHTTP2_INTERNAL_ERROR);
    return 0;
}

int on_data_chunk(nghttp2_session* session, uint8_t, int32_t stream_id, const uint8_t* data,
                  size_t len, void* user_data) {
    auto* c = static_cast<Conn*>(user_data);
    auto* st = c->find(stream_id);
    if (st == nullptr || st->closed || st->handler_gone) {
        nghttp2_session_consume(session, stream_id, len);  // nobody will forward it
        return 0;
    }
    st->received += len;
    st->in.append(std::string_view(reinterpret_cast<const char*>(data), len));
    st->signal.notify();
    return 0;
}

/// nghttp2 rejected a frame of a stream (HTTP messaging rules: a malformed or duplicated
/// header, an absolute :path, DATA beyond content-length...) and resets that stream.
int on_invalid_frame_recv(nghttp2_session*, const nghttp2_frame* frame, int lib_error,
                          void* user_data) {
    auto* c = static_cast<Conn*>(user_data);
    auto* st = c->find(frame->hd.stream_id);
    if (st == nullptr) {
        // No stream was made (a HEADERS over the stream limit before the client acknowledged
        // our SETTINGS: nghttp2 queues a REFUSED_STREAM for it): no stream close will charge
        // the reset, so it is charged here, or a client could queue them without bound.
        // (Connection errors come here too: nghttp2 ends the connection for those itself.)
        if (lib_error == NGHTTP2_ERR_REFUSED_STREAM) {
            c->codec_reset(false);
        }
    } else if (st->refusal.empty()) {
        st->refusal = frame->hd.type == NGHTTP2_DATA ? "bad_framing" : "bad_request";
        spdlog::info("conn={} h2 stream {} refused by the codec: {}", c->scope.conn_id,
                     frame->hd.stream_id, nghttp2_strerror(lib_error));
    }
    return 0;
}

int on_stream_close(nghttp2_session* session, int32_t stream_id, uint32_t error_code,
                    void* user_data) {
    auto* c = static_cast<Conn*>(user_data);
    auto it = c->streams.find(stream_id);
    if (it == c->streams.end()) {
        return 0;
    }
    auto st = it->second;
    if (st->refusal.empty() && error_code == NGHTTP2_PROTOCOL_ERROR && !st->req_end &&
        st->content_length && st->received != *st->content_length) {
        st->refusal = "bad_framing";  // nghttp2 reset it: DATA disagreed with content-length
    }
    st->error = error_code;
    // Flood accounting, once per stream (it closes once). The client's RST_STREAM before a
    // response head (one after it is a client giving up on a download or a gRPC stream), or a
    // reset nghttp2 or a header callback made for the client's protocol error before the
    // response completed (MadeYouReset: the client's way to a reset without RST_STREAM): a
    // premature reset. Resets egressd makes for its own reasons (an upstream failure, too many
    // handlers, after an early answer) are not the client's doing and do not count.
    if (st->peer_reset) {
        if (!st->response_started) {
            c->premature_reset();
        }
    } else if (client_fault(*st, error_code)) {
        c->codec_reset(!st->response_done);
    }
    st->client_gone();
    // What nghttp2 will not send any more leaves the connection's queue budget.
    c->io.dequeued(st->out_bytes);
    st->out.clear();
    st->out_bytes = 0;
    st->out_off = 0;
    const bool started = st->handled;
    // Reset before a handler took it (refused; or a request reset in the read that brought
    // it, HEADERS and RST_STREAM together, as a rapid-reset client sends them): its record.
    record_unstarted(*c, *st);
    if (!started) {
        // Buffered request bytes nobody will read go back to the connection window.
        size_t left = 0;
        for (const auto& b : st->in) {
            left += b.size();
        }
        st->in.clear();
        if (left > 0) {
            nghttp2_session_consume(session, stream_id, left);
        }
    }
    c->streams.erase(it);
    return 0;
}

ssize_t read_response_body(nghttp2_session* session, int32_t stream_id, uint8_t* buf,
                           size_t length, uint32_t* data_flags, nghttp2_data_source* source,
                           void* user_data) {
    return read_outbound(session, stream_id, buf, length, data_flags,
                         static_cast<ServerStream*>(source->ptr), static_cast<Conn*>(user_data)->io);
}

// --- the stream as the core's Downstream ------------------------------------------------

class H2Downstream final : public Downstream {
public:
    H2Downstream(std::shared_ptr<Conn> c, std::shared_ptr<ServerStream> st)
        : c_(std::move(c)), st_(std::move(st)), head_request_(st_->head.method == "HEAD") {}
    ~H2Downstream() override {
        auto& st = *st_;
        st.handler_gone = true;
        if (c_->io.dead) {
            return;
        }
        if (!st.closed && (!st.out_last || !st.out.empty())) {
            // The core gave up (client or upstream failure): the response is incomplete.
            nghttp2_submit_rst_stream(c_->session.get(), NGHTTP2_FLAG_NONE, st.id,
                                      st.response_started ? NGHTTP2_INTERNAL_ERROR : NGHTTP2_CANCEL);
        }
        size_t left = 0;
        for (const auto& b : st.in) {
            left += b.size();
        }
        st.in.clear();
        st.front_out = false;
        if (left > 0) {
            nghttp2_session_consume(c_->session.get(), st.id, left);
        }
        c_->io.wsig.notify();
    }
    const char* proto() const override { return "h2"; }
    BodyInfo request_body() const override {
        BodyInfo b;
        b.none = st_->end_on_headers;
        b.length = st_->content_length;
        return b;
    }
    bool client_keep_alive() const override { return true; }
    using Downstream::abort_with;
    void abort_with(void (*cut)(void*), void* arg) override {
        st_->abort_fn = cut;
        st_->abort_arg = arg;
        if (cut != nullptr && gone()) {
            st_->client_gone();  // reset before the wait began
        }
    }
    bool gone() const override { return st_->closed || c_->io.dead; }
    bool malformed() const override { return st_->refusal == "bad_framing"; }
    void stop_reading() override {
        st_->body_stopped = true;
        st_->signal.notify();
    }
    void resume_reading() override { st_->body_stopped = false; }
    /// HTTP/2 never switches (no Upgrade; RFC 8441's extended CONNECT is not offered).
    awaitable<RawBytes*> switch_protocols(const ResponseHead&) override { co_return nullptr; }

    awaitable<BodyChunk> read_body() override {
        auto& st = *st_;
        if (st.front_out) {
            // Forwarded: only now is the client allowed to send more (flow control).
            st.front_out = false;
            size_t n = st.in.front().size();
            st.in.pop_front();
            if (!c_->io.dead) {
                nghttp2_session_consume(c_->session.get(), st.id, n);
                c_->io.wsig.notify();
            }
        }
        for (;;) {
            if (st.body_stopped) {
                co_return BodyChunk{{}, false, false, BodyFailure::Aborted};
            }
            // Trailers over the budget (on_header) make a body that ended malformed.
            const bool bad_end = st.req_end && st.refusal == "bad_framing";
            if (!st.in.empty()) {
                st.front_out = true;
                co_return BodyChunk{st.in.front(), st.req_end && !bad_end && st.in.size() == 1,
                                    true};
            }
            if (bad_end) {
                co_return BodyChunk{{}, false, false, BodyFailure::Framing};
            }
            if (st.req_end) {
                co_return BodyChunk{{}, true, true};
            }
            if (st.closed || c_->io.dead) {
                // nghttp2 resets a stream whose DATA breaks its content-length.
                co_return BodyChunk{{}, false, false,
                                    st.refusal == "bad_framing" ? BodyFailure::Framing
                                                                : BodyFailure::Aborted};
            }
            if (!co_await st.signal.wait(c_->limits.idle_timeout)) {
                co_return BodyChunk{{}, false, false, BodyFailure::Timeout};
            }
        }
    }
    Headers request_trailers() override { return st_->trailers; }
    awaitable<void> send_continue() override { co_return; }

    awaitable<void> refuse(int status, const std::string& reason, bool) override {
        ResponseHead rh;
        rh.status = status;
        std::string body = "egressd: " + std::to_string(status) + ": " + reason + "\n";
        rh.headers = {{"content-type", "text/plain; charset=utf-8"},
                      {"x-egress-reason", reason},
                      {"content-length", std::to_string(body.size())}};
        rh.body.length = body.size();
        // The answer to a HEAD ends with its head: DATA on it is a stream error (RFC 9113
        // 8.1.1) and the client would never see the status.
        rh.body.none = head_request_;
        if (co_await send_head(rh) && !head_request_) {
            co_await send_body(body, true, nullptr);
        }
    }

    awaitable<bool> send_head(const ResponseHead& rh) override { co_return submit_head(rh); }

    awaitable<bool> send_body(std::string_view data, bool last, const Headers* trailers) override {
        auto& st = *st_;
        const bool queued = co_await h2_send_body(c_->io, st, data, last, trailers,
                                                  c_->limits.h2_stream_window,
                                                  c_->limits.idle_timeout);
        co_return queued && (!st.closed || st.out_last);
    }

private:
    /// The response head to nghttp2, at once. Not a coroutine itself: its header list lives
    /// on the stack, not in an awaitable frame (the list made send_head's frame larger than
    /// Asio recycles, so every stream's frame went to malloc's slow path).
    bool submit_head(const ResponseHead& rh) {
        auto& st = *st_;
        if (st.closed || c_->io.dead || st.response_started) {
            return false;
        }
        st.response_started = true;
        std::string status = std::to_string(rh.status);
        // nghttp2 copies names and values during the submit: values are not copied here, and
        // a name is lowered into `lowered` only if it has upper-case bytes (an HTTP/1.1
        // upstream's may; an h2 upstream's never do). Reserved up front: the views into it
        // must not move.
        std::vector<std::string> lowered;
        const auto has_upper = [](std::string_view n) {
            return std::any_of(n.begin(), n.end(), [](char c) { return c >= 'A' && c <= 'Z'; });
        };
        if (std::any_of(rh.headers.begin(), rh.headers.end(),
                        [&](const auto& h) { return has_upper(h.name); })) {
            lowered.reserve(rh.headers.size());
        }
        NvList nva;
        nva.reserve(rh.headers.size() + 1);
        nva.push_back(make_nv(":status", status));
        for (const auto& h : rh.headers) {
            std::string_view name = h.name;
            if (has_upper(name)) {
                name = lowered.emplace_back(policy::ascii_lower(name));
            }
            if (!h2_forbidden(name, h.value) && name != "te") {
                nva.push_back(make_nv(name, h.value));
            }
        }
        nghttp2_data_provider prd{};
        prd.source.ptr = st_.get();
        prd.read_callback = read_response_body;
        if (rh.body.none) {
            st.out_last = true;
        }
        int rv = nghttp2_submit_response(c_->session.get(), st.id, nva.data(), nva.size(),
                                         rh.body.none ? nullptr : &prd);
        c_->io.wsig.notify();
        return rv == 0;
    }

    std::shared_ptr<Conn> c_;
    std::shared_ptr<ServerStream> st_;
    bool head_request_;  // the stream's head may be moved into the exchange; its method is kept
};

/// A stream's own copy of its connection's scope (serve_exchange refreshes the run and the
/// runtime in it), whose run and runtime are non-owning aliases of the connection's: the
/// connection (which the stream's handler holds) outlives the copy, and nothing on a stream's
/// path keeps a copy of them beyond it. An owning copy per stream took and dropped two
/// references on control blocks every worker writes; serve_exchange stores owning pointers
/// when the runtime has changed since the connection began.
Scope stream_scope(Scope& conn) {
    // The pointers are moved out around the copy (one thread, no suspension), so the copy
    // gets every other member, present and future, without touching their counts.
    std::shared_ptr<const Runtime> runtime = std::move(conn.runtime);
    std::shared_ptr<Run> run = std::move(conn.run);
    Scope copy = conn;
    conn.runtime = std::move(runtime);
    conn.run = std::move(run);
    copy.runtime = std::shared_ptr<const Runtime>(std::shared_ptr<const Runtime>(),  // aliasing,
                                                  conn.runtime.get());              // no owner
    copy.run = std::shared_ptr<Run>(std::shared_ptr<Run>(), conn.run.get());
    return copy;
}

awaitable<void> serve_stream(std::shared_ptr<Conn> c, std::shared_ptr<ServerStream> st) {
    struct Count {
        Conn& c;
        ~Count() {
            if (--c.handlers == 0) {
                c.handlers_done.notify();
            }
        }
    } count{*c};
    const auto started = Clock::now();
    if (st->closed || c->io.dead) {
        co_return;  // reset before we got to it (rapid reset): nothing forwarded
    }
    Scope scope = stream_scope(c->scope);
    scope.proto_in = "h2";
    H2Downstream down(c, st);
    auto& head = st->head;
    if (!st->cookies.empty()) {
        std::string joined;
        for (const auto& ck : st->cookies) {
            joined += joined.empty() ? ck : "; " + ck;
        }
        head.headers.push_back({"cookie", std::move(joined)});
    }
    auto refuse = [&](int status, const char* reason) -> awaitable<void> {
        co_await down.refuse(status, reason, false);
        audit_refusal(scope, head.method, head.path, status, reason, started);
    };
    if (st->refusal == "header_too_large") {
        co_await refuse(431, "header_too_large");
        co_return;
    }
    if (head.method == "CONNECT") {
        co_await refuse(405, "connect_in_tunnel");
        co_return;
    }
    if (head.scheme != "https") {
        co_await refuse(400, "bad_scheme");
        co_return;
    }
    if (st->has_host) {
        if (head.authority.empty()) {
            head.authority = st->host;
        } else if (!policy::iequals(st->host, head.authority)) {
            co_await refuse(400, "host_authority_mismatch");
            co_return;
        }
    }
    // A stream that arrives while draining, before our GOAWAY reached the client, is served
    // (the drain waits for it) as HTTP/1.1 serves such a request with Connection: close: the
    // client could not know, and a 503 is final. The GOAWAY (watch_loop) stops new ones.
    co_await serve_exchange(down, std::move(head), scope, started);
}

void log_error(std::exception_ptr e) {
    if (e) {
        try {
            std::rethrow_exception(e);
        } catch (const std::exception& ex) {
            spdlog::error("h2 stream coroutine: {}", ex.what());
        }
    }
}

awaitable<void> read_loop(std::shared_ptr<Conn> c) {
    auto buf = std::make_unique<uint8_t[]>(16 * 1024);
    Arrival next = Arrival::Maybe;
    auto ex = co_await net::this_coro::executor;
    while (!c->io.dead) {
        auto [ec, n] = co_await read_some(*c->io.stream, net::buffer(buf.get(), 16 * 1024), next);
        if (ec) {
            break;
        }
        next = arrival_after(n, 16 * 1024);
        c->io.last_activity = Clock::now();
        ssize_t rv = nghttp2_session_mem_recv(c->session.get(), buf.get(), n);
        if (rv < 0) {
            spdlog::info("conn={} h2: {}", c->scope.conn_id, nghttp2_strerror(static_cast<int>(rv)));
            if (rv == NGHTTP2_ERR_FLOODED || rv == NGHTTP2_ERR_BAD_CLIENT_MAGIC) {
                break;
            }
            // nghttp2 has queued a GOAWAY for protocol errors: let the writer flush it.
            nghttp2_session_terminate_session(c->session.get(), NGHTTP2_PROTOCOL_ERROR);
            c->io.wsig.notify();
            break;
        }
        // Frames nghttp2 queued for a client that sends but does not read (its replies to
        // the client's frames) are bounded: past that, the client goes.
        if (nghttp2_session_get_outbound_queue_size(c->session.get()) > c->max_outbound_items()) {
            c->calm = true;
        }
        if (c->calm) {
            c->calm_down();  // a control flood; or resets in this read (already done)
        }
        // Spawn after mem_recv returned: a stream reset in the same read never starts.
        for (int32_t id : c->ready) {
            auto it = c->streams.find(id);
            if (it == c->streams.end() || it->second->closed) {
                continue;
            }
            if (c->handlers >= c->limits.h2_max_concurrent_streams) {
                // nghttp2 frees a stream's slot when the client resets it, but its handler runs
                // on until it notices (it may be waiting for the upstream): without this, a
                // client resetting and reopening streams would keep any number of upstream
                // requests in flight. REFUSED_STREAM: nothing was processed, it may retry.
                it->second->refusal = "too_many_streams";
                nghttp2_submit_rst_stream(c->session.get(), NGHTTP2_FLAG_NONE, id,
                                          NGHTTP2_REFUSED_STREAM);
                continue;
            }
            it->second->handled = true;
            ++c->handlers;
            net::co_spawn(ex, serve_stream(c, it->second), log_error);
        }
        c->ready.clear();
        c->io.wsig.notify();
        // Only a misbehaving client stops the reading. The drain's graceful GOAWAY (the
        // watchdog's goaway_sent) does not: streams in flight still need the client's
        // WINDOW_UPDATEs and request DATA. nghttp2 stops wanting to read once they are done,
        // and the watchdog closes the idle connection.
        if (c->calm || !nghttp2_session_want_read(c->session.get())) {
            break;
        }
    }
    // Reader done: GOAWAY (no-op if already terminated); the writer flushes what is queued,
    // then sees the session wants neither to read nor to write, and closes.
    nghttp2_session_terminate_session(c->session.get(), NGHTTP2_NO_ERROR);
    c->io.wsig.notify();
    c->watchdog.cancel();
}

awaitable<void> watch_loop(std::shared_ptr<Conn> c) {
    // After the watchdog ends the session (a timeout) it keeps watching the writer only: a
    // client that stopped reading would hold the GOAWAY, and the connection, for ever.
    bool terminated = false;
    while (!c->io.dead) {
        c->watchdog.expires_after(std::chrono::milliseconds(250));
        co_await c->watchdog.async_wait(use_nothrow);
        if (c->io.dead) {
            break;
        }
        auto now = Clock::now();
        auto* s = c->session.get();
        if (c->io.writing && now - c->io.write_started > c->limits.idle_timeout) {
            c->io.dead = true;  // the client stopped reading
            c->io.close_socket();
            break;
        }
        if (terminated) {
            continue;
        }
        if (!c->settings_acked && now - c->started > c->limits.h2_settings_timeout) {
            nghttp2_session_terminate_session(s, NGHTTP2_SETTINGS_TIMEOUT);
            c->io.wsig.notify();
            terminated = true;
            continue;
        }
        if (c->scope.worker->shared.draining.load() && !c->goaway_sent) {
            c->goaway_sent = true;
            c->io.linger = true;  // closed by the drain: lingering (serve_intercepted_h2)
            c->closing.emplace(*c->scope.worker);
            nghttp2_submit_goaway(s, NGHTTP2_FLAG_NONE, nghttp2_session_get_last_proc_stream_id(s),
                                  NGHTTP2_NO_ERROR, nullptr, 0);
            c->io.wsig.notify();
        }
        // A stream without a handler whose head began header_timeout ago has an unfinished
        // header block (complete heads get their handler at once). HTTP/2 cannot abandon it:
        // nothing else may come between its frames, so the connection goes (GOAWAY).
        bool heads_pending = false;
        for (const auto& [id, st] : c->streams) {
            if (st->handled) {
                continue;
            }
            heads_pending = true;
            if (now - st->began > c->limits.header_timeout) {
                spdlog::info("conn={} h2 stream {}: header block unfinished after {} ms: GOAWAY",
                             c->scope.conn_id, id, c->limits.header_timeout.count());
                audit_refusal(c->scope, st->head.method, st->head.path, 0, "header_timeout",
                              st->began);  // status 0: no response, the connection is closed
                st->handled = true;  // recorded: not again as the connection ends
                nghttp2_session_terminate_session(s, NGHTTP2_NO_ERROR);
                c->io.wsig.notify();
                terminated = true;
                break;
            }
        }
        if (terminated) {
            continue;
        }
        bool idle = c->streams.empty() && c->handlers == 0;
        if (idle) {
            c->pool.trim();  // an idle connection holds no spare blocks
        }
        // With no stream handler running (none holds an alias of the connection's scope, see
        // stream_scope), the scope takes the current runtime and run: an open connection keeps
        // neither a replaced runtime nor the Run of a secret rotated since (its pins hold the
        // old value) longer than a tick after its streams end.
        if (c->handlers == 0) {
            refresh_scope(c->scope);
        }
        // Without handlers and heads under way, what streams are left only wait for the client
        // to take their responses: a client that neither sends nor reads for idle_timeout
        // loses them.
        bool quiet = c->handlers == 0 && !heads_pending;
        if ((idle && c->goaway_sent) ||
            (quiet && now - c->io.last_activity > c->limits.idle_timeout)) {
            nghttp2_session_terminate_session(s, NGHTTP2_NO_ERROR);
            c->io.wsig.notify();
            terminated = true;
        }
    }
}

/// The server session of one connection with our callbacks, options, SETTINGS and
/// connection window (c.limits set). False if nghttp2 cannot create it. The fuzz target
/// tests/fuzz/fuzz_h2_server.cc drives the session this makes.
bool start_session(Conn& c) {
    const auto& l = c.limits;
    c.control_tokens = static_cast<double>(l.h2_control_frame_burst);
    c.reset_tokens = static_cast<double>(l.h2_stream_reset_burst);

    nghttp2_session_callbacks* cbs_raw = nullptr;
    nghttp2_session_callbacks_new(&cbs_raw);
    CallbacksPtr cbs(cbs_raw);
    nghttp2_session_callbacks_set_on_begin_headers_callback(cbs.get(), on_begin_headers);
    nghttp2_session_callbacks_set_on_header_callback(cbs.get(), on_header);
    nghttp2_session_callbacks_set_on_frame_recv_callback(cbs.get(), on_frame_recv);
    nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cbs.get(), on_data_chunk);
    nghttp2_session_callbacks_set_on_stream_close_callback(cbs.get(), on_stream_close);
    nghttp2_session_callbacks_set_on_frame_send_callback(cbs.get(), on_frame_send);
    nghttp2_session_callbacks_set_on_frame_not_send_callback(cbs.get(), on_frame_not_send);
    nghttp2_session_callbacks_set_on_invalid_frame_recv_callback(cbs.get(), on_invalid_frame_recv);
    nghttp2_session_callbacks_set_unpack_extension_callback(cbs.get(), on_unknown_frame);
    nghttp2_option* opt_raw = nullptr;
    nghttp2_option_new(&opt_raw);
    OptionPtr opt(opt_raw);
    // HTTP messaging checks stay ON: uppercase or CR/LF/NUL in fields, connection-specific
    // headers, bad pseudo-headers, content-length vs DATA are stream errors inside nghttp2.
    nghttp2_option_set_no_auto_window_update(opt.get(), 1);
    nghttp2_option_set_max_continuations(opt.get(), l.h2_max_continuations);
    nghttp2_option_set_stream_reset_rate_limit(opt.get(), l.h2_stream_reset_burst,
                                               l.h2_stream_reset_rate);
    nghttp2_option_set_max_outbound_ack(opt.get(), l.h2_max_outbound_ack);
    nghttp2_option_set_max_settings(opt.get(), l.h2_max_settings);
    nghttp2_option_set_no_closed_streams(opt.get(), 1);
    for (unsigned type = 0x0a; type <= 0xff; ++type) {  // past the RFC 9113 types
        nghttp2_option_set_user_recv_extension_type(opt.get(), static_cast<uint8_t>(type));
    }
    // Response heads as large as an upstream may send within egressd's limits.
    nghttp2_option_set_max_send_header_block_length(
        opt.get(), h2_send_block_limit(std::max(l.max_header_bytes, l.h2_max_header_list_bytes)));
    nghttp2_session* s = nullptr;
    if (nghttp2_session_server_new3(&s, cbs.get(), &c, opt.get(), c.pool.mem()) != 0) {
        return false;
    }
    c.session.reset(s);
    c.io.session = s;
    nghttp2_settings_entry settings[] = {
        {NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS, static_cast<uint32_t>(l.h2_max_concurrent_streams)},
        {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, static_cast<uint32_t>(l.h2_stream_window)},
        {NGHTTP2_SETTINGS_MAX_HEADER_LIST_SIZE, static_cast<uint32_t>(l.h2_max_header_list_bytes)},
        {NGHTTP2_SETTINGS_ENABLE_PUSH, 0},
    };
    nghttp2_submit_settings(s, NGHTTP2_FLAG_NONE, settings, std::size(settings));
    // Connection window: enough for a few streams' windows, still bounded per connection.
    nghttp2_session_set_local_window_size(
        s, NGHTTP2_FLAG_NONE, 0,
        static_cast<int32_t>(std::min<size_t>(l.connection_window(), (1u << 31) - 1)));
    return true;
}

}  // namespace

awaitable<void> serve_intercepted_h2(TlsStream& client, Scope& scope) {
    // Moved, not copied: the caller's scope would otherwise keep the runtime and run the
    // connection began with for its whole life (refresh_scope lets the connection's go).
    auto c = std::make_shared<Conn>(client, std::move(scope));
    c->limits = c->scope.runtime->config->limits;
    // Response bytes queued per connection, as the inbound direction's connection window:
    // a client that reads none of its streams pins this much, not streams x h2_stream_window.
    c->io.queue_budget = c->limits.connection_window();
    if (!start_session(*c)) {
        co_return;
    }

    // SIGTERM cancels the watchdog (Server::run) so the GOAWAY goes out at once.
    struct Registered {
        std::set<net::steady_timer*>& set;
        net::steady_timer* timer;
        ~Registered() { set.erase(timer); }
    } registered{c->scope.worker->h2_watchdogs, &c->watchdog};
    registered.set.insert(registered.timer);

    using namespace net::experimental::awaitable_operators;
    co_await (read_loop(c) && c->io.write_loop() && watch_loop(c));
    // Streams the session goes with (nghttp2 closes none of them once it is deleted): a
    // complete request of a read that ended the connection (a flood after it, a protocol
    // error), or one refused whose RST_STREAM the GOAWAY dropped, gets its one record.
    for (auto& [id, st] : c->streams) {
        record_unstarted(*c, *st);
    }
    c->io.dead = true;
    c->fail_all();
    // Every stream handler holds the connection; wait for them before the TLS stream goes.
    while (c->handlers > 0) {
        co_await c->handlers_done.wait(std::chrono::seconds(1));
    }
    if (c->io.linger) {
        // Our close_notify without waiting for the client's, then the drain's lingering close:
        // the client's unread WINDOW_UPDATEs would otherwise reset the connection and discard
        // the response bytes the kernel has not sent yet.
        SSL_set_shutdown(client.native_handle(), SSL_RECEIVED_SHUTDOWN);
        client.expires_after(std::chrono::seconds(1));
        co_await client.async_shutdown(use_nothrow);
        co_await drain_close(client.socket(), *c->scope.worker);
        c->closing.reset();
    }
}

}  // namespace egress::proxy
