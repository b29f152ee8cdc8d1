#pragma once
// Small pieces shared by the HTTP/2 server and client codecs. Include only from proxy/h2_*.cc
// (pulls in nghttp2).
#include <nghttp2/nghttp2.h>

#include <boost/container/small_vector.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/secure_zero.h"
#include "policy/request_head.h"
#include "proxy/pool_allocator.h"
#include "proxy/piece_queue.h"
#include "proxy/net.h"

namespace egress::proxy {

/// A one-waiter wake-up on one executor (single thread, no locks): notify() before wait()
/// is not lost. WARNING: only one coroutine may wait at a time.
class Signal {
public:
    explicit Signal(const net::any_io_executor& ex)
        : timer_(ex, net::steady_timer::time_point::max()) {}
    void notify() {
        pending_ = true;
        ++count_;
        timer_.cancel();
    }
    /// How many times notify() was called: lets a waiter see whether anything happened
    /// while it yielded.
    uint64_t count() const { return count_; }
    /// Waits for notify() or `timeout`; returns false on timeout.
    awaitable<bool> wait(std::chrono::milliseconds timeout) {
        if (pending_) {
            pending_ = false;
            co_return true;
        }
        timer_.expires_after(timeout);
        auto [ec] = co_await timer_.async_wait(use_nothrow);
        timer_.expires_at(net::steady_timer::time_point::max());
        if (pending_) {
            pending_ = false;
            co_return true;
        }
        co_return ec == net::error::operation_aborted;  // cancelled without notify: treat as wake
    }
    void cancel() { timer_.cancel(); }
    net::any_io_executor executor() { return timer_.get_executor(); }

private:
    net::steady_timer timer_;
    bool pending_ = false;
    uint64_t count_ = 0;
};

/// A stream's second Signal, for its body writer (h2_send_body) alone, so that a writer and a
/// reader of one stream (a full-duplex exchange) can wait at once: with one Signal each wait
/// re-arms the timer the other waits on, and they wake each other without end. Made the
/// first time a writer has to wait (most responses never do: a timer is not free to make), so
/// a notify before then has nobody to wake; a writer checks its condition before it waits,
/// with no suspension between, so it misses nothing.
class LazySignal {
public:
    void notify() {
        if (s_) {
            s_->notify();
        }
    }
    Signal& get(const net::any_io_executor& ex) {
        if (!s_) {
            s_.emplace(ex);
        }
        return *s_;
    }

private:
    std::optional<Signal> s_;
};

struct SessionDeleter {
    void operator()(nghttp2_session* s) const { nghttp2_session_del(s); }
};
using SessionPtr = std::unique_ptr<nghttp2_session, SessionDeleter>;

struct OptionDeleter {
    void operator()(nghttp2_option* o) const { nghttp2_option_del(o); }
};
using OptionPtr = std::unique_ptr<nghttp2_option, OptionDeleter>;

struct CallbacksDeleter {
    void operator()(nghttp2_session_callbacks* c) const { nghttp2_session_callbacks_del(c); }
};
using CallbacksPtr = std::unique_ptr<nghttp2_session_callbacks, CallbacksDeleter>;

/// A header block for nghttp2's submit calls (which copy names and values): a typical head
/// fits inline, so building one allocates nothing.
using NvList = boost::container::small_vector<nghttp2_nv, policy::kTypicalHeaderFields + 4>;

inline nghttp2_nv make_nv(std::string_view name, std::string_view value,
                          uint8_t flags = NGHTTP2_NV_FLAG_NONE) {
    return nghttp2_nv{reinterpret_cast<uint8_t*>(const_cast<char*>(name.data())),
                      reinterpret_cast<uint8_t*>(const_cast<char*>(value.data())), name.size(),
                      value.size(), flags};
}

/// Counts one decoded header field against a stream's budget (both codecs use it). Decoded
/// size, not wire size, so an HPACK bomb of table references stops here. Returns false when
/// the stream is over `max_fields` or `max_bytes` (the caller resets that stream only).
template <class Stream>
bool within_header_budget(Stream* st, size_t namelen, size_t valuelen, size_t max_fields,
                          size_t max_bytes) {
    st->header_bytes += namelen + valuelen + 32;  // RFC 9113 6.5.2 field size
    return ++st->header_fields <= max_fields && st->header_bytes <= max_bytes;
}

/// The data-provider body shared by both sides: copies queued pieces of `st->out` into
/// nghttp2's buffer, wakes the producer when room frees up (and, through `io` (an H2Io), the
/// producers waiting for the connection's budget), ends the stream (with trailers when there
/// are any) after the last piece, and defers when nothing is queued yet (the producer calls
/// nghttp2_session_resume_data). `Stream` has out, out_off, out_bytes, out_last, out_trailers,
/// deferred and signal members.
template <class Stream, class Io>
ssize_t read_outbound(nghttp2_session* session, int32_t stream_id, uint8_t* buf, size_t length,
                      uint32_t* data_flags, Stream* st, Io& io) {
    size_t copied = 0;
    while (copied < length && !st->out.empty()) {
        auto& front = st->out.front();
        size_t n = std::min(length - copied, front.size() - st->out_off);
        std::memcpy(buf + copied, front.data() + st->out_off, n);
        copied += n;
        st->out_off += n;
        st->out_bytes -= n;
        if (st->out_off == front.size()) {
            st->out.pop_front();
            st->out_off = 0;
        }
    }
    if (copied > 0) {
        io.dequeued(copied);
        st->sent.notify();  // room for the producer's next piece
    }
    if (st->out.empty() && st->out_last) {
        *data_flags |= NGHTTP2_DATA_FLAG_EOF;
        if (!st->out_trailers.empty()) {
            NvList nva;
            nva.reserve(st->out_trailers.size());
            for (const auto& h : st->out_trailers) {
                nva.push_back(make_nv(h.name, h.value));
            }
            if (nghttp2_submit_trailer(session, stream_id, nva.data(), nva.size()) == 0) {
                *data_flags |= NGHTTP2_DATA_FLAG_NO_END_STREAM;
            }
        }
        return static_cast<ssize_t>(copied);
    }
    if (copied == 0) {
        st->deferred = true;
        return NGHTTP2_ERR_DEFERRED;
    }
    return static_cast<ssize_t>(copied);
}

/// What nghttp2 reckons a header block may take encoded (nghttp2_hd_deflate_bound: 12 bytes,
/// then each field's name and value and 12 more) with a priority field: a block over the
/// session's max_send_header_block_length is not sent at all (session_prep_frame).
inline size_t h2_block_bound(const nghttp2_nv* nva, size_t n) {
    size_t bound = 12 + 5;  // 5: the priority field (NGHTTP2_PRIORITY_SPECLEN)
    for (size_t i = 0; i < n; ++i) {
        bound += nva[i].namelen + nva[i].valuelen + 12;
    }
    return bound;
}

/// The max_send_header_block_length of both codecs' sessions, for heads of at most `max_head`
/// bytes as egressd's limits count them (the larger of limits.max_header_bytes and
/// h2_max_header_list_bytes). nghttp2's default, 64 KiB of h2_block_bound, is less than those
/// limits let through: a response head near them was dropped unsent (its stream hung until
/// idle_timeout) and a request head was closed REFUSED_STREAM (and sent again, in vain). An
/// HTTP/1.1 field of k bytes ("a:\r\n" is 4) bounds at k + 9, at most 3.25 k; an HTTP/2 field
/// counts 32 bytes besides its name and value in the decoded size, more than the bound's 12.
/// So 4 × `max_head` holds every head that passed egressd's limits, and 256 KiB more the
/// fields egressd adds (the injected credential, a secret being at most 16 KiB, a pin's extra
/// headers). A head still over it is refused on its stream (on_frame_not_send, open()).
inline size_t h2_send_block_limit(size_t max_head) { return 4 * max_head + 256 * 1024; }

inline std::string_view sv(const uint8_t* p, size_t n) {
    return {reinterpret_cast<const char*>(p), n};
}

/// Headers that may not appear in an HTTP/2 message (RFC 9113 8.2.2); "te" other than
/// "trailers" is also dropped.
inline bool h2_forbidden(std::string_view n, std::string_view value) {
    if (n == "te") {
        return !policy::iequals(value, "trailers");
    }
    return n == "connection" || n == "keep-alive" || n == "proxy-connection" ||
           n == "transfer-encoding" || n == "upgrade" || n == "host";
}
inline bool h2_forbidden(const policy::Header& h) { return h2_forbidden(h.name, h.value); }

/// A connection's streams by id. Their state and the map's nodes come from a per-thread
/// cache of freed blocks (proxy/pool_allocator.h): with fifty streams in flight glibc's
/// seven-block bins overflowed and each took malloc's slow path.
template <class Stream>
using StreamMap =
    std::unordered_map<int32_t, std::shared_ptr<Stream>, std::hash<int32_t>,
                       std::equal_to<int32_t>,
                       PoolAllocator<std::pair<const int32_t, std::shared_ptr<Stream>>>>;

template <class Stream, class... Args>
std::shared_ptr<Stream> make_stream(Args&&... args) {
    return std::allocate_shared<Stream>(PoolAllocator<Stream>{}, std::forward<Args>(args)...);
}

/// What one call of a data callback takes at most (nghttp2's DATA payload length, 16 KiB):
/// the piece a stream with nothing queued may add past its connection's queue budget.
inline constexpr size_t kH2FramePiece = 16384;

/// Shared state of one HTTP/2 connection's I/O: the writer is the only coroutine that writes
/// to the TLS stream, and the only caller of nghttp2_session_mem_send.
struct H2Io {
    explicit H2Io(TlsStream& s) : stream(&s), wsig(s.get_executor()) {}
    TlsStream* stream;
    nghttp2_session* session = nullptr;
    Signal wsig;  // "there may be something to send"
    bool dead = false;
    bool writing = false;
    bool wipe_written = false;  // frames may carry a secret: zero each buffer once written
    /// The owner closes the socket itself, lingering (the server's drain): the writer, done,
    /// only stops the reader.
    bool linger = false;
    std::chrono::steady_clock::time_point write_started{};
    std::chrono::steady_clock::time_point last_activity = std::chrono::steady_clock::now();
    /// Body bytes queued for nghttp2 on all streams, and how many may be: past the budget a
    /// producer waits before queuing (h2_send_body) unless its stream has nothing queued, so a
    /// peer that reads nothing pins at most the budget plus kH2FramePiece per stream, not its
    /// streams times their windows.
    size_t queued = 0;
    size_t queue_budget = std::numeric_limits<size_t>::max();
    std::vector<Signal*> room_waiters;  // producers waiting for queued < queue_budget

    /// `n` queued bytes left (sent, or their stream closed): wakes the waiting producers.
    void dequeued(size_t n) {
        queued -= n;
        if (queued < queue_budget) {
            for (Signal* s : room_waiters) {
                s->notify();
            }
        }
    }

    void close_socket() {
        error_code ignored;
        auto& sock = stream->socket();
        sock.shutdown(tcp::socket::shutdown_both, ignored);
        sock.close(ignored);
    }

    /// Moves `buf` into a larger buffer (at least `need` bytes) and wipes the old one, which a
    /// plain reallocation would free with the frames it held.
    static void grow_wiping(std::string& buf, size_t need) {
        std::string bigger;
        bigger.reserve(std::max(need, 2 * buf.capacity()));
        bigger.append(buf);
        egress::secure_zero(buf.data(), buf.size());
        buf.swap(bigger);
    }

    /// The writer: serializes frames with mem_send (copying each piece before the next call,
    /// whose pointer it invalidates), one async_write at a time, until the session wants
    /// neither to read nor to write, or the connection dies.
    awaitable<void> write_loop() {
        std::string wbuf;
        // No yield before serializing: a notify() wakes this writer through the timer's
        // cancellation, which queues it behind the handlers already ready on the loop, so their
        // frames join this write anyway. An explicit yield loop (up to 32 posts while others
        // kept notifying) was needed when TLS reads handed out one record per turn; with whole
        // reads it cost more than it saved: without it, Go client, h2 2x50, 1.5% (nginx) and
        // 2% (nghttpd) more streams/s (medians of 9 A/B pairs) and 25% fewer system calls.
        while (!dead) {
            wbuf.clear();
            while (wbuf.size() < 64 * 1024) {
                const uint8_t* data = nullptr;
                ssize_t n = nghttp2_session_mem_send(session, &data);
                if (n < 0) {
                    dead = true;
                    break;
                }
                if (n == 0) {
                    break;
                }
                if (wipe_written && wbuf.size() + static_cast<size_t>(n) > wbuf.capacity()) {
                    grow_wiping(wbuf, wbuf.size() + static_cast<size_t>(n));
                }
                wbuf.append(reinterpret_cast<const char*>(data), static_cast<size_t>(n));
            }
            if (!wbuf.empty()) {
                writing = true;
                write_started = std::chrono::steady_clock::now();
                auto [ec, n] = co_await write_all(*stream, net::buffer(wbuf));
                writing = false;
                last_activity = std::chrono::steady_clock::now();  // the peer is reading
                if (wipe_written) {
                    egress::secure_zero(wbuf.data(), wbuf.size());
                }
                if (ec) {
                    dead = true;
                    break;
                }
                continue;
            }
            if (dead || (!nghttp2_session_want_read(session) && !nghttp2_session_want_write(session))) {
                break;
            }
            co_await wsig.wait(std::chrono::hours(24));
        }
        dead = true;
        if (linger) {
            // The reader's wait ends, and any it starts later fails at once (a cancel alone
            // misses a wait the TLS stream re-arms after a partial record); the socket stays
            // open for the lingering close.
            stream->expires_after(std::chrono::milliseconds(0));
            error_code ignored;
            stream->socket().cancel(ignored);
        } else {
            close_socket();
        }
    }
};

/// One stream's outgoing body, for both codecs (the server's responses, the client's request
/// bodies): waits while the connection's queue is over its budget (io.queue_budget) and this
/// stream's previous bytes are still queued, queues `data` for nghttp2's data callback and,
/// with the last piece, the trailers (names lowercased; fields HTTP/2 forbids, te and
/// content-length dropped), resumes a deferred stream, wakes the writer, then waits while more
/// than `window` bytes are queued, so a slow reader holds only this stream's handler; after the
/// last piece, until nothing is queued, so the handler (and the request, in flight for a
/// SIGTERM drain) ends when nghttp2 has the whole body. False when the stream or connection is
/// gone, or the body was already complete.
template <class Stream>
awaitable<bool> h2_send_body(H2Io& io, Stream& st, std::string_view data, bool last,
                             const std::vector<policy::Header>* trailers, size_t window,
                             std::chrono::milliseconds timeout) {
    if (st.closed || io.dead || st.out_last) {
        co_return false;
    }
    // Wakes the writer for what was queued (a deferred stream is resumed first).
    const auto kick = [&io, &st] {
        if (st.deferred) {
            st.deferred = false;
            nghttp2_session_resume_data(io.session, st.id);
        }
        io.wsig.notify();
    };
    while (!data.empty()) {
        if (st.closed || io.dead) {
            co_return false;
        }
        // Within the connection's budget the piece is queued whole. Past it a piece waits in
        // its producer's buffer until the peer has taken enough of the connection's others,
        // except on a stream with nothing queued: the peer took all it was given, so it may
        // queue one more frame's worth (kH2FramePiece) at a time. Streams whose reader stopped
        // (their window closed, their bytes queued) thus hold the budget without stalling the
        // streams whose reader goes on (head-of-line blocking: four unread streams of 256 KiB
        // windows used to stop every stream of the connection for idle_timeout). A peer that
        // reads nothing pins the budget plus at most kH2FramePiece per stream.
        size_t take = data.size();
        if (io.queued >= io.queue_budget) {
            if (st.out_bytes > 0) {
                Signal& sent = st.sent.get(st.signal.executor());
                io.room_waiters.push_back(&sent);
                struct Leave {
                    std::vector<Signal*>& waiters;
                    Signal* s;
                    ~Leave() { std::erase(waiters, s); }
                } leave{io.room_waiters, &sent};
                if (!co_await sent.wait(timeout)) {
                    co_return false;
                }
                continue;
            }
            take = std::min(take, kH2FramePiece);
        }
        st.out.append(data.substr(0, take));
        st.out_bytes += take;
        io.queued += take;
        data.remove_prefix(take);
        if (!data.empty()) {
            kick();  // the rest waits for this piece to be taken
        }
    }
    if (last) {
        st.out_last = true;
        if (trailers != nullptr) {
            for (const auto& h : *trailers) {
                policy::Header l{policy::ascii_lower(h.name), h.value};
                if (!h2_forbidden(l) && l.name != "te" && l.name != "content-length") {
                    st.out_trailers.push_back(std::move(l));
                }
            }
        }
    }
    kick();
    while (st.out_bytes > (last ? 0 : window)) {
        if (st.closed || io.dead) {
            co_return false;
        }
        if (!co_await st.sent.get(st.signal.executor()).wait(timeout)) {
            co_return false;
        }
    }
    co_return true;
}

}  // namespace egress::proxy
