// The protocol-neutral request core: written once for h1/h2 on either side (STYLE.md 2.5).
#include "proxy/exchange.h"

#include <algorithm>
#include <charconv>
#include <cstring>

#include "common/secure_zero.h"
#include "policy/aws_sigv4.h"
#include "policy/header_rules.h"
#include "policy/scrubber.h"
#include "policy/ws_frames.h"
#include "proxy/h2_client.h"
#include "proxy/pool_allocator.h"

namespace egress::proxy {

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

/// An upstream h2 stream refused unprocessed (H2ClientStream::refused): sent again.
constexpr const char* kRefusedStream = "upstream_refused_stream";
/// How many times one request is sent again after a refused stream. A GOAWAY'd session takes
/// no new stream, so each retry after one goes to a newer session: many streams in flight on
/// an upstream that serves few per connection need a few rounds (60 at 10 per connection:
/// 5). The bound stops an upstream that refuses every stream from looping.
constexpr int kMaxRefusedRetries = 10;

/// An HTTP/2 stream on a pooled upstream session.
class H2Upstream final : public Upstream, public PooledNew<H2Upstream> {
public:
    H2Upstream(H2Pooled p, std::string authority)
        : pooled_(std::move(p)), authority_(std::move(authority)) {}
    const char* proto() const override { return "h2"; }
    tcp::endpoint peer() const override { return pooled_.peer; }
    bool reused() const override { return false; }

    awaitable<bool> send_head(const policy::RequestHead& head, const BodyInfo& body) override {
        // Not a copy of the head with another authority: that was a vector and a string per
        // field each request, the injected credential among them (and never wiped).
        stream_ = pooled_.session->open(head, "https", authority_, body.none, body.length);
        co_return stream_ != nullptr;
    }
    awaitable<bool> send_body(std::string_view data, bool last, const Headers* trailers) override {
        co_return co_await stream_->write(data, last, trailers);
    }
    bool answered() override { return stream_->responded(); }
    awaitable<Outcome<ResponseHead>> read_head(bool head_request,
                                               std::chrono::milliseconds wait) override {
        H2ClientResponse r;
        if (!co_await stream_->response(r, wait)) {
            if (stream_->too_large()) {  // the head as it would go out: never sent, no retry
                co_return Refusal{431, "header_too_large", ""};
            }
            if (stream_->refused()) {
                co_return Refusal{502, kRefusedStream, "response"};
            }
            if (!stream_->responded()) {  // still open: no head within `wait`
                co_return Refusal{504, "upstream_timeout", "response_timeout"};
            }
            // A head over our limits was reset by us: a bad response, as from HTTP/1.1.
            co_return Refusal{502, stream_->error_code() != 0 && !stream_->bad_response()
                                       ? "upstream_reset"
                                       : "upstream_bad_response",
                              "response"};
        }
        ResponseHead rh;
        rh.status = r.status;
        rh.body.none = r.end_stream || head_request || r.status == 204 || r.status == 304;
        rh.headers.reserve(r.headers.size());
        for (auto& h : r.headers) {
            if (h.name == "content-length") {
                uint64_t n = 0;
                auto [p, ec] = std::from_chars(h.value.data(), h.value.data() + h.value.size(), n);
                if (ec == std::errc() && p == h.value.data() + h.value.size()) {
                    rh.body.length = n;
                }
            }
            rh.headers.push_back(std::move(h));
        }
        policy::strip_hop_by_hop(rh.headers);
        if (r.end_stream && !head_request && !rh.body.length && r.status != 204 &&
            r.status != 304) {
            // An h2 response ended on its HEADERS frame need not say its length; an HTTP/1.1
            // client must be told, or it would read a body until the connection closes.
            rh.body.length = 0;
            rh.headers.push_back({"content-length", "0"});
        }
        co_return rh;
    }
    awaitable<BodyChunk> read_body() override {
        auto p = co_await stream_->read();
        // A failed read of a stream still open waited io_timeout for nothing.
        co_return BodyChunk{p.data, p.eof, p.ok,
                            !p.ok && !stream_->responded() ? BodyFailure::Timeout
                                                           : BodyFailure::Aborted};
    }
    Headers response_trailers() override { return stream_->trailers(); }
    void finish() override {}
    void wipe_reads() override { pooled_.session->wipe_reads(); }
    void abort() override {
        if (stream_) {
            stream_->reset();
        }
    }
    RawBytes* switched() override { return nullptr; }

private:
    H2Pooled pooled_;
    std::string authority_;
    std::unique_ptr<H2ClientStream> stream_;
};

H2ClientOptions h2_client_options(const Limits& l) {
    H2ClientOptions o;
    o.wipe_sent = true;  // request heads carry the injected credential
    o.stream_window = static_cast<uint32_t>(l.h2_stream_window);
    o.connection_window = static_cast<uint32_t>(std::min<size_t>(l.connection_window(), (1u << 31) - 1));
    o.max_send_buffer = l.h2_stream_window;
    o.max_header_list_bytes = std::max<size_t>(l.max_header_bytes, l.h2_max_header_list_bytes);
    o.max_header_fields = std::max<size_t>(l.h2_max_header_fields, 100);
    o.io_timeout = l.idle_timeout;
    o.idle_timeout = l.upstream_idle_timeout;
    return o;
}

/// Upstream for the agreed destination: an h2 session with room, a pooled h1 connection, or
/// a fresh dial (vetted address, verified TLS, ALPN h2|http/1.1 negotiated on its own).
/// `retryable`: the request has no body and an idempotent method, so a failure on a pooled
/// connection before any response byte is sent again (UpstreamPool::acquire). `h1_only`: an
/// HTTP/1.1 connection whatever the destination speaks (a WebSocket upgrade): no h2 session,
/// and a dial of its own that offers http/1.1 alone. A client that goes away while the
/// upstream is dialed (`down` watched from the first wait on) ends the dial: Refusal{0,
/// "client_aborted"}; the caller ends the watch.
awaitable<Outcome<std::unique_ptr<Upstream>>> open_upstream(Scope& scope, bool allow_pool,
                                                            bool retryable, bool h1_only,
                                                            Downstream& down, DialCut& dial) {
    Worker& w = *scope.worker;
    const Runtime& rt = *scope.runtime;
    const auto& limits = rt.config->limits;
    std::string authority = scope.target.host_header(scope.tls);
    dial.pool = nullptr;  // not yet the dial others wait for (a retry reuses `dial`)
    if (!scope.tls) {
        down.abort_with(&DialCut::cut, &dial);  // (a client gone already: cut at once)
        if (dial.abandoned) {
            co_return client_gone_refusal();
        }
        auto dialed = co_await dial_upstream(w, rt, scope.target, &dial);
        if (auto* r = std::get_if<Refusal>(&dialed)) {
            co_return *r;
        }
        co_return make_h1_plain_upstream(std::move(std::get<Dialed>(dialed)), authority, limits);
    }
    auto key = UpstreamPool::key(scope.run->policy.id, scope.target);
    auto ex = w.ioc.get_executor();
    for (int round = 0;; ++round) {
        if (allow_pool) {
            if (h1_only) {
                if (auto c = w.pool->acquire(key, retryable, limits.upstream_idle_timeout,
                                             rt.addresses)) {
                    co_return make_h1_upstream(w, std::move(c), true, authority);
                }
                break;
            }
            if (auto s = w.pool->acquire_h2(key, rt.addresses)) {
                co_return std::make_unique<H2Upstream>(std::move(*s), authority);
            }
            if (auto c = w.pool->acquire(key, retryable, limits.upstream_idle_timeout,
                                         rt.addresses)) {
                co_return make_h1_upstream(w, std::move(c), true, authority);
            }
        }
        if (h1_only) {
            break;  // no h2 session to share: nothing to wait for
        }
        down.abort_with(&DialCut::cut, &dial);  // from here on, the request waits
        if (dial.abandoned) {
            co_return client_gone_refusal();  // gone already (an h2 stream reset meanwhile)
        }
        if (round < 8 && !w.pool->begin_dial(key, ex)) {
            co_await w.pool->wait_dial(key, &dial);  // another request's dial
            if (dial.abandoned) {
                co_return client_gone_refusal();
            }
            continue;
        }
        break;
    }
    if (!h1_only) {
        dial.pool = w.pool.get();  // requests that wait for this dial keep it going
        dial.key = key;
    }
    down.abort_with(&DialCut::cut, &dial);
    auto dialed = co_await dial_upstream(w, rt, scope.target, &dial);
    if (auto* r = std::get_if<Refusal>(&dialed)) {
        if (!h1_only) {
            w.pool->end_dial(key, std::nullopt);
        }
        co_return *r;
    }
    auto conn = co_await tls_connect(w, rt, std::move(std::get<Dialed>(dialed)),
                                     scope.target.host, key, h1_only, &dial);
    if (auto* r = std::get_if<Refusal>(&conn)) {
        if (!h1_only) {
            w.pool->end_dial(key, std::nullopt);
        }
        co_return *r;
    }
    auto& c = std::get<std::unique_ptr<TlsConn>>(conn);
    c->key = key;
    if (h1_only) {
        co_return make_h1_upstream(w, std::move(c), false, authority);
    }
    if (c->alpn == "h2") {
        H2Pooled p{H2ClientSession::start(std::move(c->stream), h2_client_options(limits)), c->peer};
        w.pool->add_h2(key, p);
        w.pool->end_dial(key, true);
        co_return std::make_unique<H2Upstream>(std::move(p), authority);
    }
    w.pool->end_dial(key, false);
    co_return make_h1_upstream(w, std::move(c), false, authority);
}

}  // namespace

/// "a.b.c.d:port" for the audit record's upstream_addr. IPv4 by hand: address::to_string goes
/// through inet_ntop and a temporary string, 2 % of a proxied request's instructions.
std::string endpoint_text(const tcp::endpoint& ep) {
    char buf[96];
    char* p = buf;
    char* const end = buf + sizeof buf;
    const auto addr = ep.address();
    if (addr.is_v4()) {
        const auto bytes = addr.to_v4().to_bytes();
        for (size_t i = 0; i < bytes.size(); ++i) {
            if (i != 0) {
                *p++ = '.';
            }
            p = std::to_chars(p, end, bytes[i]).ptr;
        }
    } else {
        const std::string text = addr.to_string();  // at most 45 characters, + "%" scope id
        const size_t n = std::min(text.size(), sizeof buf - 8);
        std::memcpy(p, text.data(), n);
        p += n;
    }
    *p++ = ':';
    p = std::to_chars(p, end, ep.port()).ptr;
    return std::string(buf, p);
}

namespace {

struct BodyAnswer {
    int status;  // 0: nobody to answer (the client left)
    const char* reason;
};

/// What a client is answered, and the audit records, for a request body that failed.
BodyAnswer body_answer(BodyFailure failure) {
    switch (failure) {
    case BodyFailure::Aborted:
        return {0, "client_aborted"};
    case BodyFailure::Timeout:
        return {408, "body_timeout"};
    case BodyFailure::Framing:
        return {400, "bad_framing"};
    case BodyFailure::AwsChunk:
        return {400, "bad_aws_chunk"};
    case BodyFailure::TooLargeToSign:
        return {413, "body_too_large_to_sign"};
    }
    return {400, "bad_framing"};
}

/// A response whose body is not in the identity coding (Content-Encoding other than
/// "identity").
bool encoded(const ResponseHead& rh) {
    for (const auto& h : rh.headers) {
        if (policy::iequals(h.name, "content-encoding") &&
            !policy::iequals(policy::trim_ows(h.value), "identity") &&
            !policy::trim_ows(h.value).empty()) {
            return true;
        }
    }
    return false;
}

/// Drops the request trailer fields the head's rules govern. RFC 9110 6.5.1: a trailer may
/// not carry framing, routing, authentication or request controls, and an upstream that
/// merges trailers into the header section would otherwise see a field the pipeline refuses
/// (x-egress-*), removes (proxy-*, hop-by-hop) or owns (the injected credential and the
/// pin's headers) in the head, chosen by the sandbox.
void drop_governed_trailers(Headers& trailers, const policy::Decision& d) {
    std::erase_if(trailers, [&d](const policy::Header& h) {
        if (policy::is_hop_by_hop(h.name) || policy::is_transport_header(h.name)) {
            return true;
        }
        for (std::string_view n : {"authorization", "cookie", "accept-encoding",
                                   "content-encoding", "content-type", "content-range",
                                   "cache-control", "max-forwards", "expect", "range",
                                   "if-range"}) {
            if (policy::iequals(h.name, n)) {
                return true;
            }
        }
        if (policy::is_override_header(h.name)) {
            return true;  // what pin matching checks in the head (policy/run_policy.h)
        }
        if (d.pin == nullptr) {
            return false;
        }
        if (policy::iequals(h.name, d.injected_header)) {
            return true;
        }
        return std::any_of(d.pin->extra_headers.begin(), d.pin->extra_headers.end(),
                           [&h](const policy::Header& x) { return policy::iequals(h.name, x.name); });
    });
}

/// The request trailers to forward with `chunk`: after the body's last piece, the client's
/// trailers less the fields the head's rules govern; none before.
Headers last_trailers(Downstream& down, const BodyChunk& chunk, const policy::Decision& d) {
    Headers trailers;
    if (chunk.last) {
        trailers = down.request_trailers();
        drop_governed_trailers(trailers, d);
    }
    return trailers;
}

/// The one audit record, metrics and log line of a refused request (`rec` complete).
void record_denial(Scope& scope, const AuditRecord& rec) {
    auto& shared = scope.worker->shared;
    scope.worker->audit(rec);
    shared.metrics.denied(rec.reason);
    scope.worker->metrics.request("deny", scope.proto_in, rec.duration_ms / 1000.0);
    if (spdlog::should_log(spdlog::level::info)) {  // the arguments cost even when it is off
        spdlog::info("conn={} req={} run={} {} {}{} -> {} {}", scope.conn_id, rec.req_id, rec.run,
                     rec.method, scope.target.authority(), without_query(rec.path), rec.status,
                     rec.reason);
    }
}

/// Relays a connection that switched protocols (a WebSocket) both ways, until either side
/// closes or fails, or neither sends anything for `idle` (limits.idle_timeout, as a blind
/// tunnel). The upstream's bytes go through `ws` (its frames scrubbed) when it is set; the
/// client's go as they come. Returns "" when a peer closed, else why the relay ended.
awaitable<const char*> relay_switched(RawBytes& client, RawBytes& origin,
                                      policy::WsServerScrubber* ws, AuditRecord& rec,
                                      std::chrono::milliseconds idle) {
    using namespace net::experimental::awaitable_operators;
    auto last = Clock::now();
    const char* why = "";
    bool done = false;
    net::steady_timer timer(co_await net::this_coro::executor);
    // Whichever direction ends first ends the other and the watch: a WebSocket closes as a
    // whole (its closing handshake is frames; the TCP or TLS close comes after it).
    auto stop = [&] {
        if (!done) {
            done = true;
            client.stop();
            origin.stop();
            timer.cancel();
        }
    };
    auto upward = [&]() -> awaitable<void> {
        for (;;) {
            const std::span<char> in = co_await client.read();
            if (in.empty()) {
                break;
            }
            last = Clock::now();
            if (!co_await origin.write({in.data(), in.size()})) {
                break;
            }
            rec.bytes_in += in.size();
        }
        stop();
    };
    auto downward = [&]() -> awaitable<void> {
        std::string out;
        for (;;) {
            const std::span<char> in = co_await origin.read();
            if (in.empty()) {
                break;
            }
            last = Clock::now();
            std::string_view send(in.data(), in.size());
            if (ws != nullptr) {
                out.clear();
                const bool ok = ws->feed(send, out);
                egress::secure_zero(in.data(), in.size());  // an echoed secret, unscrubbed
                if (!ok) {
                    why = ws->error();
                    break;
                }
                send = out;
            }
            if (!send.empty() && !co_await client.write(send)) {
                break;
            }
            rec.bytes_out += in.size();
        }
        egress::secure_wipe(out);
        stop();
    };
    auto watch = [&]() -> awaitable<void> {
        while (!done) {
            const auto deadline = last + idle;
            if (Clock::now() >= deadline) {
                why = "idle_timeout";
                stop();
                break;
            }
            timer.expires_at(deadline);
            co_await timer.async_wait(use_nothrow);
        }
    };
    co_await (upward() && downward() && watch());
    co_return why;
}

/// What the response scrubber holds back of a body (the last longest-needle - 1 bytes of each
/// piece, whatever they are: policy/scrubber.h) goes out in front of the next piece, or, when
/// the upstream sends nothing more for `after` (limits.scrub_hold_timeout; 0: never), on its
/// own: a stream that pauses (a watch, an event stream waiting for its next event) does not
/// keep its last bytes until the next event. The release depends on the time alone, never on
/// the bytes, so neither its size nor its moment tells the client anything about them; a
/// credential echo split across such a pause goes out in two parts, the first unscrubbed.
/// One timer per exchange, armed by the first piece that leaves bytes held and re-armed only
/// when it fires early (a body in one piece holds none and costs nothing here; a piece costs a
/// clock read); a coroutine is spawned only for a release itself, which is rare. (A watcher
/// coroutine per exchange cost an HTTP/2 stream 10% more instructions: most h2 bodies end
/// with an empty END_STREAM frame after their data, so their one data piece holds bytes.)
/// The relay calls before_read() and after_read() around each upstream read, and stop()
/// before it returns.
/// WARNING: a release writes to the client while the relay waits on the upstream: the two
/// never write at once (after_read says when a release is under way; settle() waits for it).
class HeldRelease {
public:
    HeldRelease(net::any_io_executor ex, Downstream& down, Upstream& up,
                policy::Scrubber& scrubber, std::chrono::milliseconds after)
        : ex_(std::move(ex)), down_(down), up_(up), scrubber_(scrubber), after_(after) {}
    HeldRelease(const HeldRelease&) = delete;
    HeldRelease& operator=(const HeldRelease&) = delete;

    /// The relay is about to wait for the next upstream piece: the clock starts if bytes are
    /// held.
    void before_read() {
        if (after_.count() == 0 || scrubber_.held() == 0) {
            return;
        }
        deadline_ = Clock::now() + after_;
        reading_ = true;
        if (!armed_) {
            arm();
        }
    }
    /// The read returned: no release starts until the next before_read(). False while one is
    /// being written: the relay awaits settle() before it writes.
    bool after_read() {
        reading_ = false;
        return !releasing_;
    }
    awaitable<void> settle() {
        while (releasing_) {
            co_await done_->async_wait(use_nothrow);
        }
    }
    /// A release's write failed: the client is gone.
    bool failed() const { return failed_; }
    bool running() const { return armed_ || releasing_; }
    /// Ends the timer and any release; the relay awaits it (when running()) before its
    /// locals go: the timer's handler and a release refer to them.
    awaitable<void> stop() {
        stopping_ = true;
        reading_ = false;
        if (armed_) {
            timer_->cancel();
        }
        while (armed_ || releasing_) {
            co_await done_->async_wait(use_nothrow);
        }
    }

private:
    void arm() {
        if (!timer_) {
            timer_.emplace(ex_);
            done_.emplace(ex_, net::steady_timer::time_point::max());
        }
        armed_ = true;
        timer_->expires_at(deadline_);
        timer_->async_wait([this](error_code) { fired(); });
    }
    void fired() {
        armed_ = false;
        if (stopping_) {
            done_->cancel();  // wakes stop()
            return;
        }
        if (!reading_) {
            return;  // the read came back first; before_read() arms again when bytes are held
        }
        if (Clock::now() < deadline_) {
            arm();  // reads came and went since it was set: wait for the current deadline
            return;
        }
        reading_ = false;  // one release per pause
        releasing_ = true;
        net::co_spawn(ex_, release(), [this](std::exception_ptr) {
            releasing_ = false;
            done_->cancel();  // wakes settle() or stop()
        });
    }
    awaitable<void> release() {
        out_.clear();
        scrubber_.finish(out_);  // the stream goes on as a new one
        bool ok = true;
        if (!out_.empty()) {
            ok = co_await down_.send_body(out_, false, nullptr);
        }
        egress::secure_wipe(out_);
        if (!ok && !failed_) {
            // The client is gone: the relay's wait on a paused upstream ends now, not when
            // the upstream speaks again or idle_timeout passes.
            failed_ = true;
            up_.abort();
        }
    }

    net::any_io_executor ex_;
    Downstream& down_;
    Upstream& up_;
    policy::Scrubber& scrubber_;
    std::chrono::milliseconds after_;
    Clock::time_point deadline_{};
    std::optional<net::steady_timer> timer_;  // the release deadline
    std::optional<net::steady_timer> done_;   // cancelled when a release or the timer ends
    std::string out_;  // the released bytes (wiped once sent)
    bool armed_ = false;      // timer_ has a wait outstanding
    bool reading_ = false;    // the relay waits for the upstream; deadline_ is set
    bool releasing_ = false;  // a release writes to the client
    bool failed_ = false;
    bool stopping_ = false;
};

}  // namespace

void Worker::cut_all() {
    for (Cuttable* c = cuttable; c != nullptr; c = c->next) {
        c->cut(c->arg);  // completions are posted: the list does not change under the walk
    }
    if (resolver) {
        resolver->cancel_all();
    }
}

awaitable<bool> audit_durably(AuditLog& log, const AuditRecord& rec) {
    auto ex = co_await net::this_coro::executor;
    co_return co_await net::async_initiate<decltype(net::use_awaitable), void(bool)>(
        [&log, &rec, ex](auto handler) {
            auto h = std::make_shared<decltype(handler)>(std::move(handler));
            log.write_durable(rec, [h, ex](bool ok) {
                net::post(ex, [h, ok]() mutable { (*h)(ok); });
            });
        },
        net::use_awaitable);
}

void audit_refusal(Scope& scope, const std::string& method, const std::string& path, int status,
                   const std::string& reason, Clock::time_point started, uint64_t req_id,
                   const std::string* run) {
    AuditRecord rec;
    rec.run = run != nullptr ? *run : (scope.run ? scope.run->policy.id : "");
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
    rec.req_id = req_id != 0 ? req_id : scope.worker->next_req_id();
    record_denial(scope, rec);
}

awaitable<bool> serve_exchange(Downstream& down, policy::RequestHead head, Scope& scope,
                               Clock::time_point started) {
    Worker& w = *scope.worker;
    Shared& shared = w.shared;
    InflightGuard inflight(w);
    const BodyInfo req_body = down.request_body();
    const bool client_ka = down.client_keep_alive();
    // Every request sees the current control-plane state: a rotated secret applies to the
    // next request, and a revoked or expired run is refused even on an open connection.
    {
        // References, copied into the scope only when they changed: no reference count (a
        // line the other workers write) is touched by a request on an unchanged runtime.
        const std::shared_ptr<const Runtime>& current = w.runtime();
        const std::shared_ptr<Run>* fresh = current->lookup(scope.run->policy.id);
        if (fresh == nullptr) {
            const char* reason = run_end_reason(*scope.run);
            co_await down.refuse(403, reason, false);
            audit_refusal(scope, head.method, head.path, 403, reason, started);
            co_return false;
        }
        if (scope.run != *fresh) {
            scope.run = *fresh;
        }
        if (scope.runtime != current) {
            scope.runtime = current;
        }
    }
    const Runtime& rt = *scope.runtime;
    const std::string method = head.method;

    policy::RequestContext ctx;
    ctx.global = &rt.config->policy;
    ctx.run = &scope.run->policy;
    ctx.target = scope.target;
    ctx.sni = scope.sni;
    ctx.tls = scope.tls;
    ctx.upstream_h2 = true;  // "te: trailers" survives; the h1 serializer drops any te
    ctx.body_empty = req_body.none || (req_body.length && *req_body.length == 0);
    ctx.now = policy::Clock::now();
    auto decision = shared.pipeline.run(head, ctx);
    // The head now holds the credential in clear: wiped on every way out of this exchange.
    struct WipeInjected {
        policy::RequestHead& head;
        ~WipeInjected() { head.wipe_injected(); }
    } wipe_injected{head};
    if (!decision.forward()) {
        bool ka = client_ka && req_body.none;
        co_await down.refuse(decision.status, decision.reason, ka);
        audit_refusal(scope, method, head.path, decision.status, decision.reason, started);
        co_return ka;
    }
    // A WebSocket's frames are scrubbed with the same needles (policy/ws_frames.h).
    const bool upgrade = !head.upgrade.empty();
    std::shared_ptr<const policy::ScrubPlan> frame_plan;
    // The upstream gets a handshake key of egressd's own, and its 101 must answer that key:
    // a key the client chose lets the client compute the accept value and have an upstream
    // that echoes what it is told (a status, a header) open a raw relay past the pipeline.
    // The client's accept is then computed from the client's key (RFC 6455 4.2.2).
    std::string ws_client_key;
    std::string ws_key;
    if (upgrade) {
        frame_plan = decision.scrub;
        if (const std::string* key = head.find("sec-websocket-key"); key != nullptr) {
            ws_client_key = std::string(policy::trim_ows(*key));
            ws_key = policy::websocket_key();
            head.set("sec-websocket-key", ws_key);
        }
    }
    // The needles (the secret, the injected value) are the pin's plan, shared and wiped with
    // it; what the scrubber holds back of this response is wiped by its destructor.
    policy::Scrubber scrubber(std::move(decision.scrub));

    // A body read whole before the request leaves (aws-sigv4 signing its hash, a `_method`
    // field a pin limited to methods checks), at most `whole_bytes`; a larger one is refused
    // 413 `too_large`. Declared larger, it is refused before a 100 Continue asks the client
    // to send it (its refusal reads and drops what comes anyway).
    size_t whole_bytes = 0;
    const char* too_large = nullptr;
    if (decision.sign_body) {
        whole_bytes = rt.config->limits.sign_body_bytes;
        too_large = "body_too_large_to_sign";
    }
    if (decision.check_body_method &&
        (too_large == nullptr || rt.config->limits.method_body_bytes < whole_bytes)) {
        whole_bytes = rt.config->limits.method_body_bytes;
        too_large = "body_too_large_to_check";
    }
    if (too_large != nullptr && req_body.length && *req_body.length > whole_bytes) {
        co_await down.refuse(413, too_large, false);
        audit_refusal(scope, method, head.path, 413, too_large, started);
        co_return false;
    }

    // Expect (RFC 9110 10.1.1) is egressd's to answer and never goes upstream: 100-continue,
    // in any of the fields or list members, gets the 100 here; another expectation is dropped
    // (a server MAY refuse it 417; the upstream, which never sees it, cannot).
    if (head.find("expect") != nullptr) {
        bool wants_continue = false;
        for (const auto& h : head.headers) {
            wants_continue = wants_continue || (policy::iequals(h.name, "expect") &&
                                                policy::named_in(h.value, "100-continue"));
        }
        head.remove("expect");
        if (wants_continue) {
            co_await down.send_continue();
        }
    }

    AuditRecord rec;
    rec.run = scope.run->policy.id;
    rec.method = method;
    rec.scheme = head.scheme;
    rec.host = scope.target.host;
    rec.port = scope.target.port;
    rec.path = head.path;
    rec.proto_in = scope.proto_in;
    if (decision.pin != nullptr) {
        rec.pin = decision.pin->id;
        rec.secret = decision.pin->secret_name;
    }
    rec.reason = decision.reason;
    rec.req_id = w.next_req_id();

    auto finish = [&](int status, const std::string& reason, const std::string& kind) {
        rec.status = status;
        rec.decision = "allow";  // the pipeline allowed it; reason records what went wrong
        if (!reason.empty()) {
            rec.reason = reason;
        }
        // Ended because egressd cut its connection (a revoke...), not by its client: a
        // download cut short, a WebSocket whose relay ended. Other outcomes keep their reason.
        if (const char* cut = scope.cut();
            cut != nullptr && (reason == "client_aborted" || (reason.empty() && status == 101))) {
            rec.reason = cut;
        }
        rec.duration_ms = ms_since(started);
        if (!kind.empty()) {
            shared.metrics.upstream_error(kind);
        }
        w.audit(rec);
        w.metrics.request(rec.decision, scope.proto_in, rec.duration_ms / 1000.0);
        if (spdlog::should_log(spdlog::level::info)) {  // authority() and value_or copy strings
            spdlog::info("conn={} req={} run={} {} {}{} -> {} pin={} in={} out={} {} {:.1f}ms",
                         scope.conn_id, rec.req_id, rec.run, method, scope.target.authority(),
                         without_query(rec.path), status, rec.pin.value_or("-"), rec.bytes_in,
                         rec.bytes_out,
                         rec.proto_out, rec.duration_ms);
        }
    };
    // A request body the client broke (malformed framing: 400 bad_framing) or stalled (408
    // body_timeout) after the pipeline allowed the request: a refusal, recorded and counted
    // as one. `status` was sent already (or could not be).
    auto deny_body = [&](int status, const char* reason) {
        rec.status = status;
        rec.decision = "deny";
        rec.reason = reason;
        rec.duration_ms = ms_since(started);
        record_denial(scope, rec);
    };

    // A pooled connection skips its liveness peek only for a request whose failure is retried
    // and whose method is idempotent (RFC 9110 9.2.2): a POST without a body is peeked for,
    // so it leans on the retry only when the upstream closes in the instant after the peek.
    const bool idempotent = method == "GET" || method == "HEAD" || method == "OPTIONS" ||
                            method == "PUT" || method == "DELETE" || method == "TRACE";
    // A request body the client broke off (recorded client_aborted), broke (400 bad_framing,
    // bad_aws_chunk), stalled (408 body_timeout) or made too large to sign (413) before the
    // whole request went upstream.
    auto body_failed = [&](BodyFailure failure) -> awaitable<void> {
        const auto [status, reason] = body_answer(failure);
        if (status == 0) {
            finish(0, reason, "");
            co_return;
        }
        co_await down.refuse(status, reason, false);
        deny_body(status, reason);
    };

    const auto& limits = rt.config->limits;
    // A chunk-signed aws-sigv4 upload: each piece of the body read from the client passes
    // through the chunk signer, which gives on the chunks it completed, signed again (none:
    // an empty piece), or fails the read.
    auto resign = [&](BodyChunk& chunk) {
        if (!decision.aws_chunks || !chunk.ok) {
            return;
        }
        auto& signer = *decision.aws_chunks;
        auto status = signer.feed(chunk.view(), limits.sign_body_bytes);
        if (status == policy::AwsChunkSigner::Status::Ok && chunk.last && !signer.complete()) {
            status = policy::AwsChunkSigner::Status::Malformed;  // the body ended mid-chunk
        }
        if (status != policy::AwsChunkSigner::Status::Ok) {
            chunk.ok = false;
            chunk.failure = status == policy::AwsChunkSigner::Status::TooLarge
                                ? BodyFailure::TooLargeToSign
                                : BodyFailure::AwsChunk;
            chunk.data = {};
            chunk.headroom = 0;
            return;
        }
        chunk.data = signer.output();
        chunk.headroom = 0;  // the signer's buffer
    };
    // An h2 upstream that refused the stream unprocessed (REFUSED_STREAM, or a GOAWAY below
    // it: nginx sends one after keepalive_requests streams) did nothing with the request,
    // which goes out again on another session, from the pool (RFC 9113 8.7). A body read
    // from the client cannot be read again: one of at most limits.retry_body_bytes sent to an
    // h2 upstream is kept until the answer comes (`replay`), and goes out again with it.
    int refused_retries = 0;
    std::string replay;        // the body as forwarded so far, while it may be sent again
    Headers replay_trailers;
    bool replay_whole = false;  // `replay` is the whole body (its last piece went)
    bool keep_replay = !req_body.none && limits.retry_body_bytes > 0 &&
                       (!req_body.length || *req_body.length <= limits.retry_body_bytes);
    auto keep_piece = [&](std::string_view data, bool last, const Headers& trailers) {
        if (!keep_replay) {
            return;
        }
        if (replay.size() + data.size() <= limits.retry_body_bytes) {
            replay.append(data);
            if (last) {
                replay_whole = true;
                replay_trailers = trailers;
            }
        } else {
            keep_replay = false;  // too large to keep: not sent again
            std::string().swap(replay);
        }
    };
    // A body read whole (aws-sigv4 signing its hash, Decision::sign_body; a `_method` field
    // checked, Decision::check_body_method), at most `whole_bytes`, before anything of the
    // request leaves (even the dial); it goes out as a kept body (`replay`), so a refused h2
    // stream can send it again too.
    if (too_large != nullptr) {
        bool fits = true;  // a declared length was checked above
        while (fits) {
            auto chunk = co_await down.read_body();
            if (!chunk.ok) {
                co_await body_failed(chunk.failure);
                co_return false;
            }
            rec.bytes_in += chunk.data.size();
            fits = replay.size() + chunk.data.size() <= whole_bytes;
            if (fits) {
                replay.append(chunk.view());
            }
            if (chunk.last) {
                replay_trailers = last_trailers(down, chunk, decision);
                break;
            }
        }
        if (!fits) {
            co_await down.refuse(413, too_large, false);
            deny_body(413, too_large);
            co_return false;
        }
        // A `_method` the pin does not allow: refused as match_pin refuses one in the query
        // (no pin matched; the credential never left).
        if (decision.check_body_method &&
            !policy::body_method_matches(*decision.pin, head, replay)) {
            rec.pin.reset();
            rec.secret.reset();
            co_await down.refuse(403, "no_matching_pin", false);
            deny_body(403, "no_matching_pin");
            co_return false;
        }
        replay_whole = true;
        keep_replay = true;
        if (decision.sign_body) {
            policy::sign_with_body(head, decision, replay, ctx.now);
        }
    }

    // The client went away while the upstream was dialed: nothing was sent, nobody reads an
    // answer (an upstream that came at the same moment is dropped unused). Or its h2 stream
    // was reset for a body that broke its content-length: a refusal, as a body's below. (A
    // coroutine only on this path: a request that dials nothing makes no frame for it.)
    auto left_during_dial = [&]() -> awaitable<void> {
        if (down.malformed()) {
            co_await down.refuse(400, "bad_framing", false);
            deny_body(400, "bad_framing");
        } else {
            finish(0, "client_aborted", "");
        }
    };
    DialCut dial;
    auto opened =
        co_await open_upstream(scope, true, req_body.none && idempotent, upgrade, down, dial);
    down.abort_with(nullptr);
    if (dial.abandoned) {
        co_await left_during_dial();
        co_return false;
    }
    // A dial refused (policy, DNS, connect, TLS): recorded as a refusal, with the pin and
    // secret the pipeline chose and the address that was reached, if one was (a TLS failure
    // on a credentialed host is the record that shows an interception attempt).
    auto dial_refused = [&](const Refusal& r) {
        rec.upstream_addr = r.peer ? endpoint_text(*r.peer) : std::string();
        rec.proto_out.clear();  // (a retry's first upstream answered nothing either)
        deny_body(r.status, r.reason.c_str());
    };
    if (auto* r = std::get_if<Refusal>(&opened)) {
        if (!r->kind.empty()) {
            shared.metrics.upstream_error(r->kind);
        }
        co_await down.refuse(r->status, r->reason, false);
        dial_refused(*r);
        co_return false;
    }
    auto up = std::move(std::get<std::unique_ptr<Upstream>>(opened));
    // For as long as the exchange holds its upstream, the drain's cut (Worker::cut_all) ends
    // whatever waits on it: a body write to an upstream that stopped reading, a response
    // body that stalled, a 101's relay (shutting the client's connection down is not noticed
    // there). Not after finish() (an HTTP/1.1 connection may be back in the pool), nor while
    // a reopen dials (its own cut). The exchange then ends through its error path, recorded.
    struct HeldUpstream {
        std::unique_ptr<Upstream>* up;
        bool released = false;
    } held{&up};
    CutGuard held_cut(
        w,
        [](void* p) {
            auto& h = *static_cast<HeldUpstream*>(p);
            if (!h.released && *h.up) {
                (*h.up)->abort();
            }
        },
        &held);
    rec.proto_out = up->proto();
    rec.upstream_addr = endpoint_text(up->peer());
    // The upstream once more, for a retry (a stale pooled connection, a refused stream):
    // false when the request ended here, recorded (its client left during the dial, or the
    // dial was refused).
    auto reopen = [&](bool allow_pool, bool h1_only) -> awaitable<bool> {
        up.reset();
        auto again = co_await open_upstream(scope, allow_pool, false, h1_only, down, dial);
        down.abort_with(nullptr);
        if (dial.abandoned) {
            co_await left_during_dial();
            co_return false;
        }
        if (auto* r = std::get_if<Refusal>(&again)) {
            co_await down.refuse(r->status, r->reason, false);
            dial_refused(*r);
            co_return false;
        }
        up = std::move(std::get<std::unique_ptr<Upstream>>(again));
        rec.upstream_addr = endpoint_text(up->peer());
        rec.proto_out = up->proto();
        co_return true;
    };

    if (shared.audit->durable()) {
        // audit.durable: the decision is on disk before the request (and its credential)
        // leaves. If it cannot be written, nothing is sent.
        AuditRecord pre = rec;
        pre.event = "decision";
        pre.decision = "allow";
        if (!co_await audit_durably(*shared.audit, pre)) {
            co_await down.refuse(503, "audit_unavailable", false);
            audit_refusal(scope, method, head.path, 503, "audit_unavailable", started);
            co_return false;
        }
    }

    bool keep = false;  // the answer: whether an HTTP/1.1 client connection may be reused
    std::optional<ResponseHead> resp;
    bool early = false;  // the upstream answered before it took the whole request body

    // HTTP/2 on both legs with a request body: full duplex. The body goes up while the
    // response comes down (a bidirectional gRPC stream: the client may wait for the server's
    // first message before it sends its next), instead of the whole upload first: the upload
    // runs as a coroutine of its own beside this one, which waits for the response and relays
    // it, and the two meet at `done`. A quiet side is not a timeout while the other moves: the
    // exchange ends on idle_timeout only when neither did.
    const bool duplex = !req_body.none && !replay_whole &&
                        std::string_view(down.proto()) == "h2" &&
                        std::string_view(up->proto()) == "h2";
    bool request_done = !duplex;     // the whole request body went up
    bool response_started = false;   // the response head went to the client
    bool response_over = false;      // the response part is done (the upload stops reading)
    const char* cut_reason = nullptr;  // why the upload cut the upstream part, if it did
    std::optional<BodyFailure> upload_failure;
    uint64_t in_seen = 0;  // bytes_in when the response part last looked for progress
    bool upload_running = false;
    bool swapping = false;  // the upload is being taken off a refused stream (stop_reading)
    std::optional<net::steady_timer> upload_ended;  // cancelled when the upload returns

    auto upload = [&]() -> awaitable<void> {
        uint64_t out_seen = rec.bytes_out;
        for (;;) {
            auto chunk = co_await down.read_body();
            resign(chunk);
            if (!chunk.ok) {
                if (response_over || swapping) {
                    break;  // the response ended first, or the stream was refused
                            // (stop_reading): nothing failed
                }
                if (chunk.failure == BodyFailure::Timeout && rec.bytes_out != out_seen) {
                    out_seen = rec.bytes_out;  // the response moves: the client may wait on it
                    continue;
                }
                upload_failure = chunk.failure;
                cut_reason = chunk.failure == BodyFailure::Timeout && response_started
                                 ? "idle_timeout"
                                 : body_answer(chunk.failure).reason;
                up->abort();  // the response part ends with it
                break;
            }
            rec.bytes_in += chunk.data.size();
            if (chunk.data.empty() && !chunk.last) {
                continue;
            }
            Headers trailers = last_trailers(down, chunk, decision);
            keep_piece(chunk.view(), chunk.last, trailers);
            if (swapping) {
                break;  // kept: it goes out on the next stream
            }
            if (!co_await up->send_body(chunk.view(), chunk.last,
                                        trailers.empty() ? nullptr : &trailers)) {
                break;  // the upstream stream ended or failed: the response part sees it
            }
            if (chunk.last) {
                request_done = true;
                break;
            }
        }
    };
    if (duplex) {
        auto ex = co_await net::this_coro::executor;
        upload_ended.emplace(ex, net::steady_timer::time_point::max());
        bool head_sent = co_await up->send_head(head, req_body);
        Outcome<ResponseHead> got = Refusal{};
        for (;;) {  // once per upstream stream the request goes out on (a refused one: again)
            if (!head_sent) {
                co_await down.refuse(502, "upstream_write_failed", false);
                finish(502, "upstream_write_failed", "write");
                co_return false;
            }
            if (!replay_whole) {
                upload_ended->expires_at(net::steady_timer::time_point::max());
                upload_running = true;
                net::co_spawn(ex, upload(), [&upload_running, &upload_ended](std::exception_ptr) {
                    upload_running = false;
                    upload_ended->cancel();
                });
            }
            in_seen = rec.bytes_in;
            for (;;) {
                {
                    CutGuard cut(w, [](void* u) { static_cast<Upstream*>(u)->abort(); },
                                 up.get());
                    // A client that resets once its upload is over is noticed here, as in the
                    // sequential path (before, the upload's read notices it).
                    down.abort_with(up.get());
                    got = co_await up->read_head(method == "HEAD", limits.idle_timeout);
                    down.abort_with(nullptr);
                }
                if (down.gone() && !upload_failure) {
                    upload_failure = BodyFailure::Aborted;
                    cut_reason = "client_aborted";
                }
                const auto* r = std::get_if<Refusal>(&got);
                if (r != nullptr && r->reason == "upstream_timeout" && !upload_failure &&
                    !request_done && rec.bytes_in != in_seen) {
                    in_seen = rec.bytes_in;  // still uploading: the answer may come at its end
                    continue;
                }
                break;
            }
            const auto* r = std::get_if<Refusal>(&got);
            if (upload_failure || r == nullptr || r->reason != kRefusedStream ||
                refused_retries >= kMaxRefusedRetries || !keep_replay) {
                break;
            }
            // Refused unprocessed, and all of the body forwarded so far is kept: the upload
            // leaves the refused stream (a read waiting on the client ends; the client's next
            // bytes stay where they are), and the request goes out again on another stream
            // with the kept bytes, then the upload goes on there.
            if (upload_running) {
                swapping = true;
                down.stop_reading();
                up->abort();
                while (upload_running) {
                    co_await upload_ended->async_wait(use_nothrow);
                }
                swapping = false;
                down.resume_reading();
            }
            if (down.gone()) {  // the upload's read that failed meanwhile would have said so
                upload_failure = down.malformed() ? BodyFailure::Framing : BodyFailure::Aborted;
                cut_reason = down.malformed() ? "bad_framing" : "client_aborted";
                break;
            }
            if (!keep_replay) {
                break;  // a piece that came meanwhile made the body too large to keep
            }
            ++refused_retries;
            spdlog::debug("conn={} upstream refused the stream unprocessed; retrying",
                          scope.conn_id);
            if (!co_await reopen(true, false)) {
                co_return false;
            }
            if (!replay_whole && std::string_view(up->proto()) != "h2") {
                break;  // an HTTP/1.1 upstream now: the rest of the body cannot stream beside
                        // the answer (rare: the origin stopped offering h2)
            }
            head_sent = co_await up->send_head(head, req_body);
            if (head_sent && (!replay.empty() || replay_whole)) {
                // A failure here is the next read_head's refusal (or the upload's, which
                // goes on from the kept bytes).
                const bool whole = co_await up->send_body(
                    replay, replay_whole, replay_trailers.empty() ? nullptr : &replay_trailers);
                request_done = whole && replay_whole;
            }
        }
        if (upload_failure) {
            goto done;  // no head reached the client: the upload's failure is recorded there
        }
        if (auto* r = std::get_if<Refusal>(&got)) {
            co_await down.refuse(r->status, r->reason, false);
            finish(r->status, r->reason, r->kind);
            goto done;
        }
        keep_replay = false;  // answered: never sent again
        std::string().swap(replay);
        resp = std::move(std::get<ResponseHead>(got));
    } else {
        // Request head and body, then the response head. A pooled h1 connection the upstream
        // closed while idle fails before any response byte; a request without a body is then
        // retried once on a fresh connection: always when its head could not be written
        // (nothing of it went out), and when it went out only if its method is idempotent
        // (RFC 9110 9.2.2: a proxy MUST NOT retry others; the upstream may have acted on a
        // POST and closed before answering) and the connection closed without a byte of
        // answer (a head that came and did not parse is this upstream's answer, not a stale
        // connection). A stream an h2 upstream refused goes out again (`replay` above).
        bool refused = false;
        for (int attempt = 0;; ++attempt) {
            const bool may_retry = attempt == 0 && up->reused() && req_body.none;
            bool sent = co_await up->send_head(head, req_body);
            const bool head_sent = sent;
            bool client_failed = false;
            BodyFailure client_failure = BodyFailure::Aborted;
            if (sent && replay_whole) {
                // Sent again after a refused stream: the kept body, not the client's.
                sent = co_await up->send_body(replay, true,
                                              replay_trailers.empty() ? nullptr : &replay_trailers);
            } else if (sent && !req_body.none) {
                keep_replay = keep_replay && std::string_view(up->proto()) == "h2";
                for (;;) {
                    if (up->answered()) {
                        // An early answer (RFC 9112 9.3, RFC 9113 8.1): the upstream refused the
                        // upload before taking all of it, and closes or has ended the stream. Its
                        // answer goes to the client; the rest of the body is not forwarded.
                        early = true;
                        break;
                    }
                    auto chunk = co_await down.read_body();
                    resign(chunk);
                    if (!chunk.ok) {
                        client_failed = true;
                        client_failure = chunk.failure;
                        break;
                    }
                    rec.bytes_in += chunk.data.size();
                    if (chunk.data.empty() && !chunk.last) {
                        continue;
                    }
                    Headers trailers = last_trailers(down, chunk, decision);
                    keep_piece(chunk.view(), chunk.last, trailers);
                    if (!co_await up->send_body(chunk.view(), chunk.last,
                                                trailers.empty() ? nullptr : &trailers)) {
                        sent = false;
                        break;
                    }
                    if (chunk.last) {
                        break;
                    }
                }
            }
            if (client_failed) {
                // The upstream connection is dropped, not pooled: the partial request dies with
                // it. A malformed or stalled request body is a refusal of the request (the head
                // went out, the request never completes upstream): the client is told and it is
                // counted.
                co_await body_failed(client_failure);
                co_return false;
            }
            if (!sent && may_retry) {
                goto retry;
            }
            if (early || (!sent && head_sent)) {
                // The upstream began to answer, or stopped taking the body, before the whole
                // request went out. An early answer (RFC 9112 9.3: a 413, or a 401 on a bad
                // credential, before the whole upload), here or on its way, is the client's, not a
                // 502: one that began is waited for as any response, after a failed write for
                // linger_timeout only (an upstream that answers and closes without lingering may
                // reset the connection under its own answer; then there is none to read).
                auto got = co_await up->read_head(method == "HEAD", early ? limits.idle_timeout
                                                                          : limits.linger_timeout);
                if (auto* rh = std::get_if<ResponseHead>(&got)) {
                    resp = std::move(*rh);
                    early = true;
                    break;
                }
                if (auto* r = std::get_if<Refusal>(&got); r != nullptr && r->status == 431) {
                    // A head too large to send (an h2 upstream's header block bound): the
                    // stream never opened, nothing went upstream; the client's, not a 502.
                    co_await down.refuse(r->status, r->reason, false);
                    finish(r->status, r->reason, "");
                    co_return false;
                }
                sent = false;
                early = false;
            }
            if (!sent) {
                co_await down.refuse(502, "upstream_write_failed", false);
                finish(502, "upstream_write_failed", "write");
                co_return false;
            }
            {
                Outcome<ResponseHead> got = Refusal{};
                {
                    CutGuard cut(w, [](void* u) { static_cast<Upstream*>(u)->abort(); },
                                 up.get());
                    down.abort_with(up.get());
                    got = co_await up->read_head(method == "HEAD", limits.idle_timeout);
                    down.abort_with(nullptr);
                }
                if (down.gone()) {
                    // The client reset its request while it waited: the upstream's part was cut
                    // (abort_with), or its answer came in the same turn; nobody reads either.
                    finish(0, "client_aborted", "");
                    co_return false;
                }
                if (auto* r = std::get_if<Refusal>(&got)) {
                    if (may_retry && idempotent && up->closed_unanswered()) {
                        goto retry;
                    }
                    refused = r->reason == kRefusedStream && (req_body.none || replay_whole) &&
                              refused_retries < kMaxRefusedRetries;
                    if (refused) {
                        ++refused_retries;
                        goto retry;
                    }
                    co_await down.refuse(r->status, r->reason, false);
                    finish(r->status, r->reason, r->kind);
                    co_return false;
                }
                resp = std::move(std::get<ResponseHead>(got));
                break;
            }
        retry:
            spdlog::debug("conn={} {}; retrying", scope.conn_id,
                          refused ? "upstream refused the stream unprocessed"
                                  : "pooled upstream connection was closed");
            // A stale pooled connection is retried on a fresh one; a refused stream may go to any
            // session with room (the refusing one takes none), so fifty refused at once share
            // one new dial instead of making fifty.
            if (!co_await reopen(refused, upgrade)) {
                co_return false;
            }
        }
    }

    // Response: head scrubbed, body streamed (scrubbed), trailers scrubbed; egressd's own
    // namespace is egressd's alone in both.
    policy::strip_egress_namespace(resp->headers);
    if (scrubber.active()) {
        scrubber.scrub_in_place(resp->reason);  // an h1 reason phrase is upstream text too
        scrubber.scrub_fields(resp->headers);
        if (!resp->body.none && encoded(*resp) && decision.secret_sent) {
            // The request asked for identity; a body encoded anyway (gzip...) would carry an
            // echoed credential past the scrubber, which sees only the encoded bytes. (Not
            // after aws-sigv4, which sent no credential to echo: the body passes as it is.)
            co_await down.refuse(502, "upstream_encoded_response", false);
            finish(502, "upstream_encoded_response", "response");
            goto done;
        }
    }
    if (resp->status == 101) {
        // Only the switch this request asked for: a 101 nobody asked for (or to another
        // protocol) would leave the client reading bytes it cannot frame.
        const char* bad = nullptr;
        std::string* accept = nullptr;
        for (policy::Header& h : resp->headers) {
            if (policy::iequals(h.name, "sec-websocket-accept")) {  // h1: the upstream's case
                accept = &h.value;
                break;
            }
        }
        if (!upgrade || !policy::iequals(resp->upgrade, head.upgrade) || ws_key.empty() ||
            accept == nullptr || policy::trim_ows(*accept) != policy::websocket_accept(ws_key)) {
            // Also a 101 whose accept value does not answer egressd's key: whatever sent it (a
            // status the client could choose, echoed by the upstream) is no WebSocket server,
            // and an open relay to it would carry requests past the pipeline.
            bad = "upstream_bad_response";
        } else if (scrubber.active() &&
                   policy::find_header(resp->headers, "sec-websocket-extensions") != nullptr) {
            bad = "upstream_websocket_extension";  // none was offered: frames we cannot read
        }
        if (bad != nullptr) {
            co_await down.refuse(502, bad, false);
            finish(502, bad, "response");
            goto done;
        }
        *accept = policy::websocket_accept(ws_client_key);  // answers the client's own key
        RawBytes* origin = up->switched();
        RawBytes* client = nullptr;
        if (origin != nullptr) {  // no co_await in a conditional operand (GCC 12)
            client = co_await down.switch_protocols(*resp);
        }
        if (client == nullptr) {
            finish(101, "client_aborted", "");
            goto done;
        }
        std::optional<policy::WsServerScrubber> frames;
        if (scrubber.active()) {
            frames.emplace(std::move(frame_plan));
        }
        const char* why = co_await relay_switched(*client, *origin, frames ? &*frames : nullptr,
                                                  rec, limits.idle_timeout);
        finish(101, why, "");  // one record when the connection ends, as a tunnel's
        goto done;
    }
    if (!co_await down.send_head(*resp)) {
        finish(resp->status, "client_aborted", "");
        goto done;
    }
    response_started = true;
    if (!resp->body.none) {
        std::string spill;  // only when the scrubber held bytes back from the previous piece
        auto ex = co_await net::this_coro::executor;
        HeldRelease release(std::move(ex), down, *up, scrubber, limits.scrub_hold_timeout);
        const char* failed = nullptr;  // the body failed: the record's reason (after stop())
        const char* failed_kind = "";
        // Whatever ends the loop, an exception too (bad_alloc), the watcher is stopped
        // before `release`, `scrubber` and `spill` go: it refers to them.
        std::exception_ptr thrown;
        try {
            for (;;) {
                release.before_read();
                auto chunk = co_await up->read_body();
                if (!release.after_read()) {
                    co_await release.settle();  // the held bytes go first
                }
                if (release.failed()) {
                    failed = "client_aborted";
                    break;
                }
                if (!chunk.ok) {
                    if (duplex && chunk.failure == BodyFailure::Timeout && cut_reason == nullptr) {
                        if (!request_done && rec.bytes_in != in_seen) {
                            // The upload moves: a quiet response is not idle.
                            in_seen = rec.bytes_in;
                            continue;
                        }
                        cut_reason = "idle_timeout";  // nothing moved either way
                    }
                    // The bytes that came go out, the held ones too (as after a pause: the
                    // upstream is gone), unless held bytes wait for more (scrub_hold_timeout: 0).
                    // Then the client is told the body is incomplete (h1: close without
                    // last-chunk; h2: reset).
                    if (scrubber.held() > 0 && limits.scrub_hold_timeout.count() != 0) {
                        spill.clear();
                        scrubber.finish(spill);
                        co_await down.send_body(spill, false, nullptr);  // it fails anyway
                        egress::secure_wipe(spill);
                    }
                    if (cut_reason != nullptr) {  // the duplex exchange cut the upstream part
                        failed = cut_reason;
                    } else {
                        failed = "upstream_aborted";
                        failed_kind = "response_body";
                    }
                    break;
                }
                rec.bytes_out += chunk.data.size();
                // Scrubbed where it lies, in the upstream's buffer (no copy, no allocation),
                // behind the bytes held from the previous piece (put in the buffer's headroom,
                // or, where there is none, copied with the piece into `spill`).
                const std::string_view out =
                    scrubber.feed_in_place(chunk.data, chunk.headroom, chunk.last, spill);
                if (out.empty() && !chunk.last) {
                    continue;
                }
                Headers trailers;
                if (chunk.last) {
                    trailers = up->response_trailers();
                    policy::strip_egress_namespace(trailers);
                    scrubber.scrub_fields(trailers);
                }
                if (!co_await down.send_body(out, chunk.last,
                                             trailers.empty() ? nullptr : &trailers)) {
                    failed = "client_aborted";
                    break;
                }
                if (chunk.last) {
                    break;
                }
            }
        } catch (...) {
            thrown = std::current_exception();
        }
        if (release.running()) {
            co_await release.stop();
        }
        if (thrown) {
            std::rethrow_exception(thrown);
        }
        if (failed != nullptr) {
            finish(resp->status, failed, failed_kind);
            goto done;
        }
    }
    // An early answer is the upstream's own, but the request never reached it whole: the
    // record says so (its bytes_in counts what the client sent up to then).
    finish(resp->status, early || !request_done ? "upstream_early_response" : "", "");
    if (scrubber.replacements() > 0) {
        up->wipe_reads();  // before a pooled connection goes back with what it read
    }
    up->finish();
    held.released = true;
    keep = down.client_keep_alive();  // as the response head said (a drain may have begun)

done:
    if (duplex) {
        response_over = true;
        if (upload_running) {
            down.stop_reading();  // an upload waiting on the client ends now,
            up->abort();          // and one waiting on the upstream's window
            while (upload_running) {
                co_await upload_ended->async_wait(use_nothrow);
            }
        }
        if (upload_failure && rec.status == 0) {
            // The upload failed before any response head: as in the sequential path.
            if (*upload_failure == BodyFailure::Aborted) {
                finish(0, "client_aborted", "");
            } else {
                const int status = body_answer(*upload_failure).status;
                co_await down.refuse(status, cut_reason, false);
                deny_body(status, cut_reason);
            }
        }
    }
    if (!held.released && up && scrubber.replacements() > 0) {
        up->wipe_reads();  // the exchange failed after the scrubber found an echo
    }
    co_return keep;
}

}  // namespace egress::proxy
