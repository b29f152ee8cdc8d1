#include "proxy/http1.h"

#include <sys/socket.h>

#include <array>
#include <boost/url/parse.hpp>
#include <cerrno>
#include <charconv>
#include <cstring>

#include "common/secure_zero.h"
#include "common/text_cursor.h"
#include "policy/header_rules.h"
#include "proxy/buffer_pool.h"

namespace egress::proxy {

namespace {

using Clock = std::chrono::steady_clock;

template <class Stream>
auto& lowest(Stream& s) {
    return beast::get_lowest_layer(s);
}

/// Free buffer space before each body read through the parser (chunked or close-delimited
/// bodies): the four TLS records a busy TlsSocket reads at once.
constexpr size_t kBodyReadBytes = 64 * 1024;

/// Responses with a Content-Length up to this go out head and body in one write.
constexpr uint64_t kCoalesceBodyBytes = 16 * 1024;

/// The heads (and chunked trailers) egressd sends are written straight into one string: one
/// allocation, where Beast's message allocates a node per field and its serializer walks them
/// again. Every name and value here was parsed (Beast, nghttp2) or built and validated by the
/// pipeline (trailers are checked where they are written), so no CR or LF reaches the wire.
/// "name: value\r\n" into a std::string or a TextCursor (the heads' pre-sized writers).
template <class Out>
void write_field(Out& out, std::string_view name, std::string_view value) {
    out.append(name);
    out.append(std::string_view(": "));
    out.append(value);
    out.append(std::string_view("\r\n"));
}

size_t fields_size(const Headers& headers) {
    size_t n = 0;
    for (const auto& h : headers) {
        n += h.name.size() + h.value.size() + 4;
    }
    return n;
}

/// At most kFramingBytes: "Content-Length: " and 20 digits, or "Transfer-Encoding: chunked".
constexpr size_t kFramingBytes = 40;
void write_framing(TextCursor& c, std::optional<uint64_t> length, bool chunked) {
    if (length) {
        char digits[24];
        auto [end, ec] = std::to_chars(digits, digits + sizeof digits, *length);
        write_field(c, "Content-Length", std::string_view(digits, static_cast<size_t>(end - digits)));
    } else if (chunked) {
        write_field(c, "Transfer-Encoding", "chunked");
    }
}

/// The request head as H1Upstream sends it: the pipeline's fields in order, Host first, the
/// framing ours (Content-Length or chunked) whatever the client sent.
std::string request_head_bytes(const policy::RequestHead& head, std::string_view host,
                               std::optional<uint64_t> length, bool chunked) {
    std::string out;
    const size_t bound = head.method.size() + head.path.size() + host.size() +
                         fields_size(head.headers) + kFramingBytes + head.upgrade.size() + 64;
    append_bounded(out, bound, [&](TextCursor& c) {
        c.append(head.method);
        c.push_back(' ');
        c.append(head.path);
        c.lit(" HTTP/1.1\r\n");
        write_field(c, "Host", host);
        for (const auto& h : head.headers) {
            // Transport framing is this serializer's job; te is hop-by-hop in HTTP/1.1.
            if (h.name == "content-length" || h.name == "transfer-encoding" || h.name == "te") {
                continue;
            }
            write_field(c, h.name, h.value);
        }
        write_framing(c, length, chunked);
        if (!head.upgrade.empty()) {
            c.lit("Connection: Upgrade\r\nUpgrade: ");
            c.append(head.upgrade);
            c.lit("\r\n");
        }
        c.lit("\r\n");
    });
    return out;
}

/// A deadline for one read that cancels it instead of closing the socket (beast's stream
/// expiry closes it), so the connection can still carry a 408 to a slow client.
template <class Stream>
class ReadDeadline {
public:
    ReadDeadline(Stream& s, std::chrono::milliseconds d)
        : timer_(s.get_executor()), state_(std::make_shared<State>()) {
        timer_.expires_after(d);
        auto& sock = lowest(s).socket();
        timer_.async_wait([st = state_, &sock](error_code ec) {
            if (!ec && st->active) {  // `sock` is only touched while its read is pending
                st->fired = true;
                error_code ignored;
                sock.cancel(ignored);
            }
        });
    }
    ~ReadDeadline() {
        state_->active = false;
        timer_.cancel();
    }
    ReadDeadline(const ReadDeadline&) = delete;
    ReadDeadline& operator=(const ReadDeadline&) = delete;
    bool fired() const { return state_->fired; }

private:
    struct State {
        bool active = true;
        bool fired = false;
    };
    net::steady_timer timer_;
    std::shared_ptr<State> state_;
};

/// A TLS stream's own deadline already cancels instead of closing, and moving it costs no
/// system call (no timer per read).
template <>
class ReadDeadline<TlsStream> {
public:
    ReadDeadline(TlsStream& s, std::chrono::milliseconds d) : s_(s) { s_.expires_after(d); }
    ~ReadDeadline() { s_.expires_never(); }
    ReadDeadline(const ReadDeadline&) = delete;
    ReadDeadline& operator=(const ReadDeadline&) = delete;
    bool fired() const { return s_.timed_out(); }

private:
    TlsStream& s_;
};

/// Zeroes a connection buffer's whole storage but its unread bytes, which stay: a consumed
/// byte stays where it was read (Beast's consume() only moves a pointer) until a later read
/// overwrites it, or in the freed block when the buffer goes.
void wipe_buffer(beast::flat_buffer& b) {
    std::string unread(static_cast<const char*>(b.data().data()), b.size());
    b.clear();  // the readable region starts at the storage's start again
    const size_t all = std::min(b.capacity(), b.max_size());
    if (all > 0) {
        auto region = b.prepare(all);
        egress::secure_zero(region.data(), region.size());
    }
    if (!unread.empty()) {
        auto region = b.prepare(unread.size());
        std::memcpy(region.data(), unread.data(), unread.size());
        b.commit(unread.size());
        egress::secure_wipe(unread);
    }
}

/// Caps a connection buffer's growth for one parse. Beast keeps reading while a chunk-size
/// line, its extensions or the trailer section have no end yet, and limits none of them
/// (the parser's header limit is the head's): without a cap a client could fill memory
/// until the idle timeout. Over the cap Beast fails with http::error::buffer_overflow.
class GrowthCap {
public:
    GrowthCap(beast::flat_buffer& b, size_t cap)
        : b_(b), saved_(b.max_size()) {
        b_.max_size(std::max(cap, b_.size() + 1));
    }
    ~GrowthCap() { b_.max_size(saved_); }
    GrowthCap(const GrowthCap&) = delete;
    GrowthCap& operator=(const GrowthCap&) = delete;

private:
    beast::flat_buffer& b_;
    size_t saved_;
};

/// Reads the next body piece of a Beast parser into `buf` (`cap` bytes): nothing is buffered
/// whole. Returns an empty non-last chunk when only framing was parsed. A chunk-size line
/// with its extensions, or a trailer section, longer than `framing_limit`
/// (limits.max_header_bytes) fails as Framing.
template <bool isRequest, class Stream>
awaitable<BodyChunk> h1_read_body(Stream& s, beast::flat_buffer& inbuf, H1Parser<isRequest>& p,
                                  char* buf, std::chrono::milliseconds timeout,
                                  size_t framing_limit, size_t cap = kRelayBufferBytes) {
    if (p.is_done()) {
        co_return BodyChunk{{}, true, true};
    }
    if (auto left = p.direct_body_left()) {
        // Content-Length: the body goes straight into the relay buffer, not through the
        // parser, and never past its end (a pipelined next message stays for its own parse).
        const auto room = static_cast<size_t>(std::min<uint64_t>(*left, cap));
        size_t n = 0;
        if (inbuf.size() > 0) {  // bytes that came in with the head
            n = std::min(inbuf.size(), room);
            std::memcpy(buf, inbuf.data().data(), n);
            inbuf.consume(n);
        } else {
            ReadDeadline deadline(s, timeout);
            auto [ec, got] = co_await read_some(s, net::buffer(buf, room));
            if (ec) {
                // EOF before Content-Length bytes is a truncation (the parser's partial_message).
                co_return BodyChunk{{}, false, false,
                                    deadline.fired() ? BodyFailure::Timeout : BodyFailure::Aborted};
            }
            n = got;
        }
        p.direct_body_read(n);
        co_return BodyChunk{std::span<char>(buf, n), p.is_done(), true};
    }
    // Chunked, or delimited by the connection's close: Beast's parser takes the framing.
    p.body_buffer(buf, cap);
    // Unparsed framing plus one read: chunk data goes to `buf` as it is parsed, so the buffer
    // holds at most one read's worth of it besides an unfinished chunk line or trailers.
    GrowthCap growth(inbuf, framing_limit + kBodyReadBytes);
    // Beast reads max(512, free capacity) bytes per call: without room for a whole TLS record
    // a body would be relayed (and re-encrypted, and sent) in 512-byte pieces.
    if (inbuf.capacity() - inbuf.size() < kBodyReadBytes) {
        inbuf.reserve(std::min(inbuf.size() + kBodyReadBytes, inbuf.max_size()));
    }
    ReadDeadline deadline(s, timeout);
    // Beast's operation, not proxy/net.h's tries: a piece already buffered is posted (one
    // turn of the event loop), as every read was before net.h. Content-Length bodies, the
    // common case, take the direct path above.
    auto [ec, n] = co_await http::async_read_some(s, inbuf, p, use_nothrow);
    if (ec == http::error::need_buffer) {
        ec = {};
    }
    if (ec) {
        auto failure = BodyFailure::Aborted;
        if (deadline.fired()) {
            failure = BodyFailure::Timeout;
        } else if (ec.category() == http::make_error_code(http::error::bad_chunk).category() &&
                   ec != http::error::end_of_stream && ec != http::error::partial_message) {
            failure = BodyFailure::Framing;  // bad chunk size, extension, body overrun,
                                             // framing over the cap (buffer_overflow)...
        }
        co_return BodyChunk{{}, false, false, failure};
    }
    size_t got = cap - p.body_room();
    co_return BodyChunk{std::span<char>(buf, got), p.is_done(), true};
}

/// Writes one body piece with HTTP/1.1 framing: raw (Content-Length) or chunked, the last
/// chunk carrying trailers.
template <class Stream>
awaitable<bool> h1_write_body(Stream& s, bool chunked, std::string_view data, bool last,
                              const Headers* trailers, std::chrono::milliseconds timeout,
                              std::string_view head = {}) {
    std::string framing;
    std::string tail;
    // At most four pieces (head, chunk size, data, chunk end and trailers): a fixed array, no
    // vector to grow and for Asio's write operation to copy; empty entries are skipped.
    std::array<net::const_buffer, 4> bufs{};
    size_t nbufs = 0;
    if (!head.empty()) {
        bufs[nbufs++] = net::buffer(head);  // a held-back head goes out in the same write
    }
    if (chunked) {
        if (!data.empty()) {
            char hex[24];
            int n = std::snprintf(hex, sizeof hex, "%zx\r\n", data.size());
            framing.assign(hex, static_cast<size_t>(n));
            bufs[nbufs++] = net::buffer(framing);
            bufs[nbufs++] = net::buffer(data);
            tail = "\r\n";
        }
        if (last) {
            tail += "0\r\n";
            if (trailers != nullptr) {
                for (const auto& h : *trailers) {
                    if (policy::valid_header_name(h.name) && policy::valid_header_value(h.value) &&
                        !policy::is_hop_by_hop(h.name) && h.name != "content-length") {
                        write_field(tail, h.name, h.value);
                    }
                }
            }
            tail += "\r\n";
        }
        if (!tail.empty()) {
            bufs[nbufs++] = net::buffer(tail);
        }
    } else if (!data.empty()) {
        bufs[nbufs++] = net::buffer(data);
    }
    if (nbufs == 0) {
        co_return true;
    }
    lowest(s).expires_after(timeout);
    auto [ec, n] = co_await write_all(s, bufs);
    lowest(s).expires_never();
    co_return !ec;
}

/// Converts a parsed HTTP/1.1 header into the protocol-neutral head. On success the fields
/// (and an origin-form target) are moved out of the parser; a refusal leaves it untouched for
/// the audit record.
Outcome<policy::RequestHead> to_request_head(H1RequestParser& p, bool tls, bool absolute_form) {
    policy::RequestHead head;
    std::string_view target = p.target();
    if (absolute_form) {
        auto url = boost::urls::parse_absolute_uri(target);
        if (!url) {
            return Refusal{400, "bad_request_target", ""};
        }
        head.path = std::string(url->encoded_path());
        if (head.path.empty()) {
            // RFC 9112 3.2.4: an OPTIONS of a URI with neither path nor query asks about the
            // server itself; the last proxy sends it as "OPTIONS *".
            head.path = p.method() == http::verb::options && !url->has_query() ? "*" : "/";
        }
        if (url->has_query()) {
            head.path += "?" + std::string(url->encoded_query());
        }
    } else if (target.empty() ||
               (target.front() != '/' && !(target == "*" && p.method() == http::verb::options))) {
        return Refusal{400, "bad_request_target", ""};
    }
    size_t hosts = 0;
    bool has_cl = false;
    bool has_te = false;
    for (const auto& f : p.fields()) {  // names are lowercase
        if (f.name == "host") {
            ++hosts;
        } else if (f.name == "content-length") {
            has_cl = true;
        } else if (f.name == "transfer-encoding") {
            has_te = true;
            if (!policy::iequals(f.value, "chunked")) {
                return Refusal{400, "bad_transfer_encoding", ""};
            }
        }
    }
    if (hosts > 1) {
        return Refusal{400, "duplicate_host", ""};
    }
    if (has_cl && has_te) {
        return Refusal{400, "bad_framing", ""};  // CL+TE: classic smuggling vector
    }
    head.method = std::string(p.method_string());
    head.scheme = tls ? "https" : "http";
    // A WebSocket handshake (RFC 6455 4.1) keeps its upgrade: an HTTP/1.1 GET without a body.
    // Any other Upgrade (h2c, or one on a request with a body) goes the way of the other
    // hop-by-hop fields, and the request is served as plain HTTP (RFC 9110 7.8 lets a proxy
    // ignore it).
    if (p.version() == 11 && p.method() == http::verb::get && p.is_done() &&
        policy::asks_websocket(p.fields())) {
        head.upgrade = "websocket";
    }
    if (!absolute_form) {
        head.path = p.take_target();
    }
    head.headers = std::move(p.fields());
    if (hosts == 1) {
        auto host = std::find_if(head.headers.begin(), head.headers.end(),
                                 [](const policy::Header& h) { return h.name == "host"; });
        head.authority = std::move(host->value);
        head.headers.erase(host);
    }
    return head;
}

/// A connection's raw bytes after a 101: first what `leftover` holds (bytes that came in
/// behind the head, read with it), then reads of the stream itself. No deadline of its own:
/// the relay's idle watch stops it (serve_exchange).
template <class Stream>
class StreamBytes final : public RawBytes {
public:
    StreamBytes(Stream& s, beast::flat_buffer& leftover) : s_(s), leftover_(leftover) {}
    awaitable<std::span<char>> read() override {
        if (stopped_) {
            co_return std::span<char>();
        }
        if (!buf_) {
            buf_ = acquire_relay_buffer();
        }
        if (leftover_.size() > 0) {
            const size_t n = std::min(leftover_.size(), kRelayBufferBytes);
            std::memcpy(buf_.get(), leftover_.data().data(), n);
            leftover_.consume(n);
            co_return std::span<char>(buf_.get(), n);
        }
        auto [ec, n] = co_await read_some(s_, net::buffer(buf_.get(), kRelayBufferBytes));
        if (ec || stopped_) {
            co_return std::span<char>();
        }
        co_return std::span<char>(buf_.get(), n);
    }
    awaitable<bool> write(std::string_view data) override {
        if (stopped_) {
            co_return false;
        }
        auto [ec, n] = co_await write_all(s_, net::buffer(data.data(), data.size()));
        co_return !ec && !stopped_;
    }
    void stop() override {
        stopped_ = true;
        error_code ignored;
        lowest(s_).socket().cancel(ignored);  // a pending read's or write's wait ends now
    }

private:
    Stream& s_;
    beast::flat_buffer& leftover_;
    RelayBuffer buf_;
    bool stopped_ = false;
};

/// The client side of one HTTP/1.1 request.
template <class Stream>
class H1Downstream final : public Downstream {
public:
    H1Downstream(Stream& s, beast::flat_buffer& buf, H1RequestParser& p, const Limits& limits,
                 const std::atomic<bool>& draining)
        : s_(s), buf_(buf), p_(p), timeout_(limits.idle_timeout),
          refusal_timeout_(limits.refusal_timeout), framing_limit_(limits.max_header_bytes),
          draining_(draining), http10_(p.version() < 11) {
        body_.none = p.is_done();
        if (auto cl = p.content_length()) {
            body_.length = *cl;
        }
        keep_alive_ = p.keep_alive();
        if (http10_ && p.chunked()) {
            keep_alive_ = false;  // RFC 9112 6.1: an HTTP/1.0 message with TE is faulty framing
        }
    }
    const char* proto() const override { return "http/1.1"; }
    BodyInfo request_body() const override { return body_; }
    bool client_keep_alive() const override { return keep_alive_; }
    ~H1Downstream() override { abort_with(nullptr, nullptr); }

    /// The client's socket is watched while the upstream is dialed and while its answer is
    /// awaited (nginx's default, not HAProxy's): its close (FIN, reset, or TLS close_notify)
    /// cuts the dial or aborts the upstream part. Bytes of a next request (pipelining) are kept for it: read into the
    /// connection's buffer on TLS, up to framing_limit, then the watch ends; on cleartext the
    /// watch ends at the first byte (it stays in the socket).
    using Downstream::abort_with;
    void abort_with(void (*cut)(void*), void* arg) override {
        if (cut == nullptr) {
            if (watch_ && watch_->cut != nullptr) {
                watch_->cut = nullptr;
                error_code ignored;
                lowest(s_).socket().cancel(ignored);  // the wait below is the only operation
            }
            return;
        }
        if (!watch_) {
            watch_ = std::make_shared<Watch>();
        }
        const bool armed = watch_->cut != nullptr;
        watch_->cut = cut;
        watch_->arg = arg;
        if (!armed) {
            arm();  // (called again while watching, as before each wait of a dial: the
                    // pending wait serves)
        }
    }
    bool gone() const override { return watch_ && watch_->gone; }

    awaitable<BodyChunk> read_body() override {
        if (!rbuf_) {
            rbuf_ = acquire_relay_buffer();
        }
        co_return co_await h1_read_body(s_, buf_, p_, rbuf_.get(), timeout_, framing_limit_);
    }
    Headers request_trailers() override { return std::move(p_.trailers()); }

    awaitable<void> send_continue() override {
        if (http10_) {
            co_return;  // RFC 9110 10.1.1: an HTTP/1.0 client's 100-continue is ignored
        }
        static constexpr std::string_view kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
        lowest(s_).expires_after(timeout_);
        co_await write_all(s_, net::buffer(kContinue));
        lowest(s_).expires_never();
    }
    awaitable<void> refuse(int status, const std::string& reason, bool keep_alive) override {
        co_await write_refusal(s_, refusal_timeout_, status, reason, keep_alive,
                               p_.method() == http::verb::head);
    }
    awaitable<bool> send_head(const ResponseHead& rh) override {
        if (rh.status < 100 || rh.status > 999) {
            co_return false;  // Beast's and nghttp2's parsers admit three digits only
        }
        const bool switching = rh.status == 101 && !rh.upgrade.empty();
        none_ = rh.body.none || switching;
        if (p_.body_unread()) {
            keep_alive_ = false;  // an early answer (the upstream's): the rest is not read
        }
        chunked_ = !none_ && !rh.body.length;  // close-delimited or h2 bodies are re-framed
        if (chunked_ && http10_) {
            chunked_ = false;  // an HTTP/1.0 client knows no chunked coding: the close ends it
            keep_alive_ = false;
        }
        if (draining_.load(std::memory_order_relaxed)) {
            keep_alive_ = false;  // say so now: the connection closes after this response
        }
        std::string head;
        const std::string_view reason =
            rh.reason.empty() ? std::string_view(http::obsolete_reason(static_cast<http::status>(rh.status)))
                              : std::string_view(rh.reason);
        const size_t bound =
            reason.size() + fields_size(rh.headers) + kFramingBytes + rh.upgrade.size() + 64;
        append_bounded(head, bound, [&](TextCursor& c) {
            c.lit("HTTP/1.1 ");
            c.p = std::to_chars(c.p, c.p + 3, rh.status).ptr;  // three digits (checked above)
            c.push_back(' ');
            c.append(reason);
            c.lit("\r\n");
            for (const auto& h : rh.headers) {
                if (policy::iequals(h.name, "transfer-encoding") ||
                    ((!none_ || switching) && policy::iequals(h.name, "content-length"))) {
                    continue;
                }
                write_field(c, h.name, h.value);
            }
            if (switching) {
                c.lit("Connection: Upgrade\r\nUpgrade: ");
                c.append(rh.upgrade);
                c.lit("\r\n");
            } else {
                if (!none_) {
                    write_framing(c, rh.body.length, chunked_);
                }
                if (!keep_alive_) {
                    c.lit("Connection: close\r\n");
                }
            }
            c.lit("\r\n");
        });
        if (!none_ && rh.body.length && *rh.body.length <= kCoalesceBodyBytes) {
            // A small fixed-length body: hold the head back and send it with the body in one
            // write (one TLS record, one syscall instead of two per response).
            held_head_ = std::move(head);
            co_return true;
        }
        lowest(s_).expires_after(timeout_);
        auto [ec, n] = co_await write_all(s_, net::buffer(head));
        lowest(s_).expires_never();
        co_return !ec;
    }
    awaitable<RawBytes*> switch_protocols(const ResponseHead& rh) override {
        if (rh.status != 101 || rh.upgrade.empty()) {
            co_return nullptr;
        }
        // Not `|| !co_await` in one condition: GCC 12 miscompiles a co_await in a
        // short-circuit operand (the resumed coroutine hit an illegal instruction).
        const bool sent = co_await send_head(rh);
        if (!sent) {
            co_return nullptr;
        }
        keep_alive_ = false;  // the connection is the new protocol's until it closes
        raw_.emplace(s_, buf_);
        co_return &*raw_;
    }
    awaitable<bool> send_body(std::string_view data, bool last, const Headers* trailers) override {
        if (none_) {
            co_return true;
        }
        std::string head = std::move(held_head_);
        held_head_.clear();
        co_return co_await h1_write_body(s_, chunked_, data, last, trailers, timeout_, head);
    }

private:
    Stream& s_;
    beast::flat_buffer& buf_;
    H1RequestParser& p_;
    std::chrono::milliseconds timeout_;
    std::chrono::milliseconds refusal_timeout_;
    size_t framing_limit_;
    const std::atomic<bool>& draining_;
    bool http10_;
    RelayBuffer rbuf_;
    BodyInfo body_;
    bool keep_alive_ = false;
    bool none_ = false;
    bool chunked_ = false;
    std::string held_head_;  // serialized response head awaiting the body (small bodies)
    std::optional<StreamBytes<Stream>> raw_;  // after a 101

    struct Watch {
        void (*cut)(void*) = nullptr;  // null: not watching (the wait's late completion is
        void* arg = nullptr;           // ignored)
        bool gone = false;
    };
    std::shared_ptr<Watch> watch_;

    void arm() {
        lowest(s_).socket().async_wait(tcp::socket::wait_read,
                                       [this, w = watch_](error_code ec) {
                                           if (w->cut != nullptr && !ec) {
                                               readable(*w);
                                           }
                                       });
    }
    /// The client's socket became readable while its request waits for the upstream.
    void readable(Watch& w) {
        char byte = 0;
        const ssize_t n = ::recv(lowest(s_).socket().native_handle(), &byte, 1,
                                 MSG_PEEK | MSG_DONTWAIT);
        bool closed = n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
        if (!closed && n > 0) {
            if constexpr (std::is_same_v<Stream, TlsStream>) {
                // Records: a close_notify (TLS 1.3 encrypts it like data), or a next request.
                auto a = s_.read_some_now(buf_.prepare(TlsSocket::kMaxRecordPlaintext));
                if (!a.outcome && !a.tried) {
                    // The stream's run of inline reads is spent (TlsSocket::kInlineStreak):
                    // the bytes stay in the socket, so waiting again would only spin.
                    w.cut = nullptr;
                    return;
                }
                if (a.outcome) {
                    closed = static_cast<bool>(a.outcome->first);
                    buf_.commit(a.outcome->second);
                    if (!closed && buf_.size() > framing_limit_) {
                        w.cut = nullptr;  // a pipelining client: no more is read for now
                        return;
                    }
                }
            } else {
                w.cut = nullptr;  // a next request's bytes: left in the socket for it
                return;
            }
        }
        if (closed) {
            w.gone = true;
            std::exchange(w.cut, nullptr)(w.arg);
            return;
        }
        arm();
    }
};

/// Whether a complete response head lets the connection live on (HTTP/1.1 without
/// "Connection: close", or HTTP/1.0 with keep-alive), by Beast's reading of it. A head Beast
/// cannot parse does not.
bool keeps_connection(std::string_view head) {
    http::response_parser<http::empty_body> p;
    p.header_limit(static_cast<std::uint32_t>(head.size()));
    p.eager(false);
    error_code ec;
    p.put(net::buffer(head.data(), head.size()), ec);
    return p.is_header_done() && p.keep_alive();
}

/// Whether a response head (complete, in `head`) is an interim one: 1xx other than 101.
bool interim_head(std::string_view head) {
    return head.size() >= 12 && head.starts_with("HTTP/1.") && head[8] == ' ' && head[9] == '1' &&
           head.substr(9, 3) != "101";
}

/// The origin side of one HTTP/1.1 request: a pooled TLS connection or plain TCP.
template <class Stream>
class H1Upstream final : public Upstream {
public:
    H1Upstream(Worker* w, std::unique_ptr<TlsConn> tls, std::unique_ptr<TcpStream> plain,
               tcp::endpoint peer, bool reused, std::string host, std::chrono::milliseconds t)
        : w_(w), tls_(std::move(tls)), plain_(std::move(plain)), peer_(peer), reused_(reused),
          host_(std::move(host)), timeout_(t) {}
    const char* proto() const override { return "http/1.1"; }
    tcp::endpoint peer() const override { return peer_; }
    bool reused() const override { return reused_; }
    bool closed_unanswered() const override { return closed_unanswered_; }

    awaitable<bool> send_head(const policy::RequestHead& head, const BodyInfo& body) override {
        chunked_ = !body.length && !body.none;
        request_done_ = body.none;
        std::string out = request_head_bytes(head, host_, body.length, chunked_);
        lowest(stream()).expires_after(timeout_);
        auto [ec, n] = co_await write_all(stream(), net::buffer(out));
        lowest(stream()).expires_never();
        if (!head.never_index.empty()) {
            egress::secure_zero(out.data(), out.size());  // it held the injected credential
        }
        co_return !ec;
    }
    awaitable<bool> send_body(std::string_view data, bool last, const Headers* trailers) override {
        const bool ok = co_await h1_write_body(stream(), chunked_, data, last, trailers, timeout_);
        request_done_ = ok && last;
        co_return ok;
    }
    bool answered() override {
        auto& b = buffer();
        for (;;) {
            const std::string_view got(static_cast<const char*>(b.data().data()), b.size());
            if (const size_t end = got.find("\r\n\r\n"); end != std::string_view::npos) {
                if (interim_head(got)) {
                    b.consume(end + 4);  // 100 Continue, sent unasked: the upload goes on
                    continue;
                }
                // RFC 9112 9.3: the client stops sending when the answer says the server is
                // closing. An answer that keeps the connection is one the server sends while
                // it reads on (it drains the body, or streams both ways): the body goes on.
                return !keeps_connection(got.substr(0, end + 4));
            }
            if (got.size() > max_header_bytes_) {
                return true;
            }
            // No whole head here yet: read what has arrived, without waiting.
            const size_t before = b.size();
            if constexpr (std::is_same_v<Stream, TlsStream>) {
                // Only records already here are read. A TLS 1.3 session ticket sent after
                // the handshake is consumed and is no answer.
                auto a = stream().read_some_now(b.prepare(TlsSocket::kMaxRecordPlaintext));
                if (!a.outcome) {
                    return false;
                }
                if (a.outcome->first) {
                    return true;  // the upstream closed or reset: stop sending
                }
                b.commit(a.outcome->second);
            } else {
                error_code ec;
                const size_t ready = stream().socket().available(ec);
                if (!ec && ready > 0) {
                    b.commit(stream().socket().read_some(b.prepare(ready), ec));
                }
                if (ec) {
                    return true;
                }
            }
            if (b.size() == before) {
                return false;
            }
        }
    }
    awaitable<Outcome<ResponseHead>> read_head(bool head_request,
                                               std::chrono::milliseconds wait) override {
        // One deadline for the final head and every interim (1xx) head before it: an upstream
        // sending 102 Processing more often than `wait` would otherwise hold the client for
        // ever (HTTP/2's wait is bounded the same way).
        const auto deadline = std::chrono::steady_clock::now() + wait;
        for (;;) {
            rp_.emplace();
            rp_->body_limit(boost::none);
            rp_->header_limit(static_cast<uint32_t>(max_header_bytes_));
            rp_->field_limit(max_header_fields_);  // the head's and, later, the trailers'
            if (head_request) {
                rp_->skip(true);
            }
            lowest(stream()).expires_after(std::max<std::chrono::steady_clock::duration>(
                deadline - std::chrono::steady_clock::now(), std::chrono::milliseconds(1)));
            auto ec = co_await read_header(stream(), buffer(), *rp_, Arrival::Later);
            lowest(stream()).expires_never();
            if (ec) {
                closed_unanswered_ = !rp_->got_some() && buffer().size() == 0 &&
                                     (ec == http::error::end_of_stream ||
                                      ec == net::error::eof ||
                                      ec == net::ssl::error::stream_truncated ||
                                      ec == net::error::connection_reset ||
                                      ec == net::error::broken_pipe);
                bool timeout = ec == beast::error::timeout;
                co_return Refusal{timeout ? 504 : 502,
                                  timeout ? "upstream_timeout" : "upstream_bad_response",
                                  timeout ? "response_timeout" : "response"};
            }
            int code = rp_->status();
            if (code >= 100 && code < 200 && code != 101) {
                continue;
            }
            break;
        }
        // A transfer coding other than chunked (gzip, deflate, "gzip, chunked") would reach
        // the client decoded of its framing only, the compressed bytes with no field saying
        // so (and past the scrubber, which reads the identity coding): refused for every
        // request, with or without a credential.
        for (const auto& f : rp_->fields()) {
            if (policy::iequals(f.name, "transfer-encoding") &&
                !policy::iequals(policy::trim_ows(f.value), "chunked")) {
                co_return Refusal{502, "upstream_transfer_coding", "response"};
            }
        }
        ResponseHead rh;
        rh.status = rp_->status();
        rh.reason = std::string(rp_->reason());
        rh.headers = std::move(rp_->fields());
        if (rh.status == 101) {
            if (const auto* u = policy::find_header(rh.headers, "upgrade")) {
                rh.upgrade = std::string(policy::trim_ows(*u));
            }
        }
        policy::strip_hop_by_hop(rh.headers);  // the request's rule: whole Connection tokens
        rh.body.none = rp_->is_done();
        if (!rp_->chunked()) {
            if (auto cl = rp_->content_length()) {
                rh.body.length = *cl;
            }
        }
        co_return rh;
    }
    awaitable<BodyChunk> read_body() override {
        if (!rbuf_) {
            rbuf_ = acquire_relay_buffer();
        }
        // The body goes behind kScrubHeadroom bytes the response scrubber may fill.
        auto chunk = co_await h1_read_body(stream(), buffer(), *rp_, rbuf_.get() + kScrubHeadroom,
                                           timeout_, max_header_bytes_,
                                           kRelayBufferBytes - kScrubHeadroom);
        chunk.headroom = kScrubHeadroom;
        co_return chunk;
    }
    Headers response_trailers() override { return std::move(rp_->trailers()); }
    void wipe_reads() override {
        wipe_buffer(buffer());
        if constexpr (std::is_same_v<Stream, TlsStream>) {
            if (tls_) {
                tls_->stream->cleanse_plaintext();
            }
        }
        // A connection handed back to the pool keeps its buffer: wiped again at the end.
        wipe_at_end_ = true;
    }
    ~H1Upstream() override {
        if (wipe_at_end_) {
            wipe_buffer(buffer());
        }
    }
    void abort() override {
        // Pending waits end with operation_aborted; the connection is never pooled again
        // (finish() is not called after a failed exchange).
        error_code ignored;
        lowest(stream()).socket().shutdown(tcp::socket::shutdown_both, ignored);
        lowest(stream()).socket().cancel(ignored);
    }
    RawBytes* switched() override {
        if (!rp_ || rp_->status() != 101) {
            return nullptr;
        }
        request_done_ = false;  // never pooled: the connection speaks another protocol now
        raw_.emplace(stream(), buffer());
        return &*raw_;
    }
    void finish() override {
        // Only after a whole exchange: an upstream that answered early, before it took the
        // whole request body, may have the rest of it coming as the next request's bytes.
        if (tls_ && w_ && request_done_ && rp_ && rp_->is_done() && rp_->keep_alive()) {
            w_->pool->release(std::move(tls_));
        }
    }

private:
    Stream& stream() {
        if constexpr (std::is_same_v<Stream, TlsStream>) {
            return *tls_->stream;
        } else {
            return *plain_;
        }
    }
    beast::flat_buffer& buffer() { return tls_ ? tls_->buffer : plain_buf_; }

    Worker* w_;
    std::unique_ptr<TlsConn> tls_;
    std::unique_ptr<TcpStream> plain_;
    beast::flat_buffer plain_buf_;
    tcp::endpoint peer_;
    bool reused_;
    std::string host_;
    std::chrono::milliseconds timeout_;
    bool chunked_ = false;
    bool request_done_ = false;  // the whole request (head, body, trailers) went out
    bool closed_unanswered_ = false;  // read_head: closed before a byte of answer
    std::optional<H1ResponseParser> rp_;
    RelayBuffer rbuf_;
    std::optional<StreamBytes<Stream>> raw_;  // after a 101
    bool wipe_at_end_ = false;  // wipe_reads() was called

public:
    size_t max_header_bytes_ = 65536;
    size_t max_header_fields_ = 100;
};

}  // namespace

std::string audit_path(std::string_view target) {
    if (target.starts_with('/')) {
        return std::string(target);
    }
    std::string path;
    if (auto url = boost::urls::parse_absolute_uri(target)) {
        const auto p = url->encoded_path();
        path.assign(p.data(), p.size());
        if (path.empty()) {
            path = "/";
        }
    }
    return path;
}

namespace {

/// One HTTP/1.1 request: head → protocol-neutral head → the shared core.
template <class ClientStream>
awaitable<bool> handle_request(ClientStream& client, beast::flat_buffer& cbuf,
                               H1RequestParser& parser, Scope& scope, bool absolute_form) {
    const auto started = Clock::now();
    const auto& limits = scope.runtime->config->limits;
    H1Downstream<ClientStream> down(client, cbuf, parser, limits, scope.worker->shared.draining);
    auto head_or = to_request_head(parser, scope.tls, absolute_form);
    if (auto* r = std::get_if<Refusal>(&head_or)) {
        InflightGuard inflight(*scope.worker);  // a refusal being written is in flight too
        co_await write_refusal(client, limits.refusal_timeout, r->status, r->reason, false);
        audit_refusal(scope, std::string(parser.method_string()), audit_path(parser.target()),
                      r->status, r->reason, started);
        co_return false;
    }
    co_return co_await serve_exchange(down, std::move(std::get<policy::RequestHead>(head_or)),
                                      scope, started);
}

}  // namespace

std::unique_ptr<Upstream> make_h1_upstream(Worker& w, std::unique_ptr<TlsConn> conn, bool reused,
                                           std::string host_header) {
    auto peer = conn->peer;
    const auto& rt = w.runtime();
    auto up = std::make_unique<H1Upstream<TlsStream>>(&w, std::move(conn), nullptr, peer, reused,
                                                      std::move(host_header),
                                                      rt->config->limits.idle_timeout);
    up->max_header_bytes_ = rt->config->limits.max_header_bytes;
    up->max_header_fields_ = rt->config->limits.max_header_fields;
    return up;
}

std::unique_ptr<Upstream> make_h1_plain_upstream(Dialed d, std::string host_header,
                                                 const Limits& limits) {
    auto up = std::make_unique<H1Upstream<TcpStream>>(nullptr, nullptr, std::move(d.stream),
                                                      d.peer, false, std::move(host_header),
                                                      limits.idle_timeout);
    up->max_header_bytes_ = limits.max_header_bytes;
    up->max_header_fields_ = limits.max_header_fields;
    return up;
}

template <class Stream>
awaitable<void> write_refusal(Stream& s, std::chrono::milliseconds timeout, int status,
                              const std::string& reason, bool keep_alive, bool head_request,
                              std::chrono::seconds retry_after) {
    http::response<http::string_body> res{static_cast<http::status>(status), 11};
    res.set(http::field::server, "egressd");
    res.set(http::field::content_type, "text/plain; charset=utf-8");
    res.set("X-Egress-Reason", reason);
    if (status == 407) {
        res.set(http::field::proxy_authenticate, "Basic realm=\"egressd\"");
    }
    if (status == 429) {
        res.set(http::field::retry_after,
                std::to_string(std::max<int64_t>(1, retry_after.count())));
    }
    res.body() = "egressd: " + std::to_string(status) + " " +
                 std::string(http::obsolete_reason(static_cast<http::status>(status))) + ": " +
                 reason + "\n";
    res.keep_alive(keep_alive);
    res.prepare_payload();
    lowest(s).expires_after(timeout);
    if (head_request) {
        // The answer to a HEAD has no body (RFC 9110 9.3.2): its Content-Length says what a
        // GET would get, and bytes after the head would be read as the next response on a
        // connection kept alive.
        http::response_serializer<http::string_body> sr{res};
        co_await http::async_write_header(s, sr, use_nothrow);
    } else {
        co_await http::async_write(s, res, use_nothrow);
    }
    lowest(s).expires_never();
}

template awaitable<void> write_refusal<TcpStream>(TcpStream&, std::chrono::milliseconds, int,
                                                  const std::string&, bool, bool,
                                                  std::chrono::seconds);
template awaitable<void> write_refusal<TlsStream>(TlsStream&, std::chrono::milliseconds, int,
                                                  const std::string&, bool, bool,
                                                  std::chrono::seconds);

template <class Stream>
awaitable<HeadRead> read_request_head(Stream& s, beast::flat_buffer& buf,
                                      H1RequestParser& parser, bool first,
                                      const Limits& limits, Worker& w,
                                      std::optional<InflightGuard>& begun) {
    parser.header_limit(static_cast<uint32_t>(limits.max_header_bytes));
    parser.field_limit(limits.max_header_fields);
    parser.body_limit(boost::none);
    if (!first && buf.size() == 0) {
        lowest(s).expires_after(limits.idle_timeout);
        auto [ec, n] = co_await read_some(s, buf.prepare(4096), Arrival::Later);
        lowest(s).expires_never();
        if (ec) {
            co_return HeadRead::Closed;  // idle keep-alive connection ends quietly
        }
        buf.commit(n);
    }
    ReadDeadline deadline(s, limits.header_timeout);
    error_code ec;
    if (buf.size() == 0) {
        // A connection's first head: its first bytes alone, so it counts from them.
        auto [rec, n] = co_await read_some(s, buf.prepare(4096));
        buf.commit(n);
        ec = rec == net::error::eof ? error_code(http::error::end_of_stream) : rec;
    }
    if (buf.size() > 0 && !begun) {
        begun.emplace(w);
    }
    if (!ec) {
        ec = co_await read_header(s, buf, parser);
    }
    if (!ec) {
        co_return HeadRead::Ok;
    }
    if (deadline.fired()) {
        co_return HeadRead::Timeout;
    }
    if (ec == http::error::header_limit) {
        co_return HeadRead::TooLarge;
    }
    // A parser error or a TLS protocol error (e.g. a refused renegotiation) is answered.
    const bool bad = ec.category() == http::make_error_code(http::error::bad_target).category() ||
                     (ec.category() == net::error::get_ssl_category() &&
                      ec != ssl::error::stream_truncated);
    if (!bad || ec == http::error::end_of_stream || ec == http::error::partial_message) {
        co_return HeadRead::Closed;  // eof (maybe mid-head), reset, TLS truncation, shutdown
    }
    co_return HeadRead::Bad;
}

template <class Stream>
awaitable<void> refuse_head(Stream& s, HeadRead result, Scope& scope, Clock::time_point started) {
    int status = 400;
    std::string reason = "bad_request";
    if (result == HeadRead::Closed || result == HeadRead::Ok) {
        co_return;
    }
    if (result == HeadRead::Timeout) {
        status = 408;
        reason = "header_timeout";
    } else if (result == HeadRead::TooLarge) {
        status = 431;
        reason = "header_too_large";
    }
    co_await write_refusal(s, scope.runtime->config->limits.refusal_timeout, status, reason, false);
    audit_refusal(scope, "", "", status, reason, started);
}

template awaitable<HeadRead> read_request_head<TcpStream>(
    TcpStream&, beast::flat_buffer&, H1RequestParser&, bool, const Limits&, Worker&,
    std::optional<InflightGuard>&);
template awaitable<HeadRead> read_request_head<TlsStream>(
    TlsStream&, beast::flat_buffer&, H1RequestParser&, bool, const Limits&, Worker&,
    std::optional<InflightGuard>&);
template awaitable<void> refuse_head<TcpStream>(TcpStream&, HeadRead, Scope&, Clock::time_point);
template awaitable<void> refuse_head<TlsStream>(TlsStream&, HeadRead, Scope&, Clock::time_point);

awaitable<void> serve_intercepted_http1(TlsStream& client, beast::flat_buffer& buffer,
                                        Scope& scope, std::optional<InflightGuard>& begun) {
    bool first = true;
    bool unread = false;  // the last request's body was not read to its end
    for (;;) {
        const auto started = Clock::now();
        H1RequestParser parser;
        // The limits of the runtime the scope holds now: a request may have moved the scope
        // to a reloaded one, and the runtime it held before may be gone with its config.
        auto got = co_await read_request_head(client, buffer, parser, first,
                                              scope.runtime->config->limits, *scope.worker,
                                              begun);
        first = false;
        if (got != HeadRead::Ok) {
            co_await refuse_head(client, got, scope, started);
            break;
        }
        UnreadBodyNote note{parser, unread};
        if (scope.worker->shared.draining.load()) {
            parser.close();
        }
        begun.reset();  // the request counts itself from here (serve_exchange)
        bool keep = co_await handle_request(client, buffer, parser, scope, false);
        if (!keep || scope.worker->shared.draining.load()) {
            break;
        }
    }
    // Ended by the drain: counted from here, before any wait, until its lingering close.
    std::optional<ClosingGuard> closing;
    if (scope.worker->shared.draining.load()) {
        closing.emplace(*scope.worker);
    }
    begun.reset();
    // Send our close_notify without waiting for the peer's (it may never come).
    SSL_set_shutdown(client.native_handle(), SSL_RECEIVED_SHUTDOWN);
    lowest(client).expires_after(std::chrono::seconds(1));
    co_await client.async_shutdown(use_nothrow);
    if (closing) {
        co_await drain_close(lowest(client).socket(), *scope.worker);
        co_return;
    }
    if (unread) {
        co_await linger_close(lowest(client).socket(),
                              scope.runtime->config->limits.linger_timeout);
        co_return;
    }
    error_code ignored;
    lowest(client).socket().shutdown(tcp::socket::shutdown_both, ignored);
}

awaitable<bool> forward_plain_http(TcpStream& client, beast::flat_buffer& buffer,
                                   H1RequestParser& parser, Scope& scope) {
    co_return co_await handle_request(client, buffer, parser, scope, true);
}

awaitable<bool> forward_origin_http(TcpStream& client, beast::flat_buffer& buffer,
                                    H1RequestParser& parser, Scope& scope) {
    co_return co_await handle_request(client, buffer, parser, scope, false);
}

}  // namespace egress::proxy
