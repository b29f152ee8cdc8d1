#pragma once
// A TLS stream on the socket itself. OpenSSL reads and writes the connected socket through a
// small BIO (recv/send, MSG_NOSIGNAL) while Asio only tells us when the socket is ready: no
// BIO pair to copy every byte through, no intermediate 17 KiB buffers, one composed operation
// per read or write instead of Asio's SSL engine loop. The model is nginx's and HAProxy's
// (non-blocking SSL_read/SSL_write retried on readiness).
//
// Record buffers (about 34 KiB a connection): a stream starts with SSL_MODE_RELEASE_BUFFERS,
// as nginx and HAProxy set it, so a connection that idles after its handshake (a tunnel that
// is opened and left) holds none. But the mode frees them whenever a read drains them and
// allocates them again on the next call: several malloc/free pairs of 17 KiB per proxied
// request on a busy keep-alive connection. So after kBusyCalls OpenSSL calls a stream keeps its
// buffers, and the stream's timer gives them back (and sets the mode again) once it has gone a
// whole kIdleRelease without a call. While it keeps them its read buffer holds four records
// (kBusyReadBufferBytes, 69 KiB; 88 KiB a busy connection with the write buffer), so a large
// body is read with a quarter of the system calls.
//
// Writes: one write operation sends as many records as the socket takes, every record but the
// write's last with MSG_MORE (see WriteStep).
//
// Coroutines try first (read_some_now, write_some_now; proxy/net.h wraps them): a read of bytes
// already received or a write the socket takes completes in the caller, and only what has to
// wait becomes an operation, which then waits for the socket before trying again. A read that
// follows our own write to the same peer (async_read_some_later) waits first: its try would
// almost always be a recv that learns EAGAIN.
//
// The stream carries one deadline for its operations (expires_after / expires_never, like
// beast::tcp_stream) that costs no system call to move: a single timer is armed when an
// operation has to wait and re-armed lazily when it fires early. An operation still pending
// at the deadline completes with beast::error::timeout; the socket stays open (so an HTTP
// layer can still answer 408). The price of laziness: an armed timer is outstanding work
// for the io_context until it fires or the stream is destroyed (egressd stops its loops
// explicitly; egress-bench closes its connections when a run ends).
//
// Heavy (Asio): include only from proxy/*.cc and bench/ drivers, like proxy/net.h.

#include <openssl/err.h>
#include <openssl/ssl.h>

#include <boost/asio/compose.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/ssl/context.hpp>
#include <boost/asio/ssl/error.hpp>
#include <boost/asio/ssl/stream_base.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core/error.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <utility>

namespace egress::proxy {

class TlsSocket {
public:
    using executor_type = boost::asio::any_io_executor;
    using socket_type = boost::asio::ip::tcp::socket;
    using handshake_type = boost::asio::ssl::stream_base::handshake_type;
    using error_code = boost::system::error_code;
    using Clock = std::chrono::steady_clock;

    /// Takes a connected socket; throws std::bad_alloc / boost::system::system_error when
    /// OpenSSL cannot make an SSL object (like asio::ssl::stream).
    TlsSocket(socket_type socket, boost::asio::ssl::context& ctx);
    TlsSocket(boost::beast::tcp_stream&& stream, boost::asio::ssl::context& ctx)
        : TlsSocket(stream.release_socket(), ctx) {}
    /// An unconnected stream (tests that only need an executor).
    template <class ExecutionContext>
    TlsSocket(ExecutionContext& ex, boost::asio::ssl::context& ctx)
        : TlsSocket(socket_type(ex), ctx) {}
    TlsSocket(TlsSocket&&) noexcept = default;
    TlsSocket& operator=(TlsSocket&& other) noexcept {
        if (this != &other) {
            close_core();
            core_ = std::move(other.core_);
        }
        return *this;
    }
    ~TlsSocket() { close_core(); }

    executor_type get_executor() { return core_->socket.get_executor(); }
    SSL* native_handle() { return core_->ssl; }
    socket_type& socket() { return core_->socket; }

    /// The deadline for operations pending or started from now on (all of them, reads and
    /// writes alike); a stream that timed out stays timed out until the deadline is reset.
    void expires_after(std::chrono::steady_clock::duration d) {
        core_->deadline = Clock::now() + d;
        core_->expired = false;
    }
    void expires_never() {
        core_->deadline = Clock::time_point::max();
        core_->expired = false;
    }
    /// Whether an operation failed because the deadline passed (until it is reset).
    bool timed_out() const { return core_->expired; }

    /// OpenSSL calls after which a stream keeps its record buffers between calls.
    static constexpr uint32_t kBusyCalls = 16;
    /// A stream that keeps them gives them back after this long without a call (1–2 periods).
    static constexpr std::chrono::milliseconds kIdleRelease{1000};
    /// A busy stream's read buffer: with read ahead, one recv takes up to four whole records
    /// (a 64 KiB body in one system call, not four). Streams that are not busy (handshakes,
    /// a request now and then) keep OpenSSL's one-record buffer, allocated per call.
    static constexpr size_t kBusyReadBufferBytes = 4 * SSL3_RT_MAX_PACKET_SIZE;
    /// Whether the stream keeps its record buffers between OpenSSL calls (it is busy).
    bool keeps_buffers() const { return core_->keep_buffers; }
    /// From now on OpenSSL wipes the plaintext of each record once it is read out, and its
    /// record buffers when it gives them back (SSL_OP_CLEANSE_PLAINTEXT: by default a record
    /// is decrypted where it lies and stays there, in the buffer or in the heap block that
    /// held it, until overwritten), also while the stream keeps its buffers; the buffers it
    /// holds now are given back (wiped), or, while a record is half read or written or read
    /// ahead is unread, as soon as they drain (the stream releases them again). For a
    /// connection whose peer echoed a credential.
    void cleanse_plaintext();

    template <class Token>
    auto async_handshake(handshake_type type, Token&& token) {
        if (type == boost::asio::ssl::stream_base::client) {
            SSL_set_connect_state(core_->ssl);
        } else {
            SSL_set_accept_state(core_->ssl);
        }
        return start<void(error_code)>(HandshakeStep{}, std::forward<Token>(token));
    }
    /// Sends close_notify; waits for the peer's unless SSL_RECEIVED_SHUTDOWN is already set.
    template <class Token>
    auto async_shutdown(Token&& token) {
        return start<void(error_code)>(ShutdownStep{}, std::forward<Token>(token));
    }
    template <class MutableBuffers, class Token>
    auto async_read_some(const MutableBuffers& buffers, Token&& token) {
        return start<void(error_code, size_t)>(read_step(buffers), std::forward<Token>(token));
    }
    /// Writes up to one buffer or, for a sequence of small buffers (a serialized head and a
    /// body), up to kGatherBytes of them gathered into one TLS record.
    template <class ConstBuffers, class Token>
    auto async_write_some(const ConstBuffers& buffers, Token&& token) {
        return start<void(error_code, size_t)>(write_step(buffers), std::forward<Token>(token));
    }

    /// Reads and writes tried at once, for coroutines: a read of bytes that are already there,
    /// or a write the socket takes, completes in the calling coroutine. An operation that
    /// completes at its start must post its result (Asio's rule), which costs the operation, a
    /// post and a turn of the event loop; on the path of a proxied request that is most reads
    /// and writes (proxy/net.h: read_some, write_all, read_header).
    ///
    /// Fairness: a stream completes at most kInlineStreak tries in a row this way; then a try
    /// is not made (tried false) and the operation started after it goes through the event
    /// loop, so a peer that keeps a socket full (an upload, a flood of HTTP/2 frames) cannot
    /// keep a coroutine running past the other connections of its loop.
    using Outcome = std::pair<error_code, size_t>;
    struct Attempt {
        std::optional<Outcome> outcome;  // the result, known now
        bool tried = true;               // false: the streak's limit; the operation tries
        bool want_write = false;         // else what the socket must become ready for
    };
    static constexpr uint32_t kInlineStreak = 16;
    /// One try of async_read_some's read (same rules: no other read in flight).
    template <class MutableBuffers>
    Attempt read_some_now(const MutableBuffers& buffers) {
        return now(read_step(buffers));
    }
    /// One try of async_write_some's write (no other write in flight). Without an outcome the
    /// write must be retried with the same bytes (OpenSSL's rule after WANT_WRITE).
    template <class ConstBuffers>
    Attempt write_some_now(const ConstBuffers& buffers) {
        return now(write_step(buffers));
    }
    /// After an attempt without an outcome: the operation, which waits for the socket first
    /// (trying again at once would cost a second recv or send to learn it would block).
    /// Waiting first never misses what is there already: Asio starts every wait with
    /// epoll_ctl(EPOLL_CTL_MOD), on which the kernel checks readiness again and reports a
    /// socket that is ready at once, though the reactor is edge-triggered and drops an edge
    /// that no operation waited for.
    template <class MutableBuffers, class Token>
    auto async_read_some_after(const Attempt& a, const MutableBuffers& buffers, Token&& token) {
        return start<void(error_code, size_t)>(read_step(buffers), std::forward<Token>(token),
                                               wait_for(a));
    }
    template <class ConstBuffers, class Token>
    auto async_write_some_after(const Attempt& a, const ConstBuffers& buffers, Token&& token) {
        return start<void(error_code, size_t)>(write_step(buffers), std::forward<Token>(token),
                                               wait_for(a));
    }

    /// A read that expects nothing yet (the response right after its request went out, the
    /// next request right after a response went out): it waits for the socket first, without
    /// the try whose recv would only learn EAGAIN. What has arrived already is not missed (see
    /// above); what OpenSSL holds already (a record read ahead, the rest of one) is read at once.
    template <class MutableBuffers, class Token>
    auto async_read_some_later(const MutableBuffers& buffers, Token&& token) {
        const Status::Kind first =
            SSL_has_pending(core_->ssl) == 0 ? Status::WantRead : Status::Done;
        return start<void(error_code, size_t)>(read_step(buffers), std::forward<Token>(token), first);
    }

    static constexpr size_t kMaxRecordPlaintext = 16 * 1024;  // TLS's largest record
    static constexpr size_t kGatherBytes = kMaxRecordPlaintext;  // gathered into one record

private:
    struct Core {
        explicit Core(socket_type s) : socket(std::move(s)), timer(socket.get_executor()) {}
        ~Core();
        Core(const Core&) = delete;
        Core& operator=(const Core&) = delete;
        socket_type socket;  // OpenSSL's BIO reads the descriptor from here on every call
        SSL* ssl = nullptr;
        boost::asio::steady_timer timer;
        Clock::time_point deadline = Clock::time_point::max();
        Clock::time_point armed_at = Clock::time_point::max();  // the timer's expiry; max: idle
        uint64_t generation = 0;  // of the timer's wait: an older wait that completes is ignored
        int waiting = 0;          // operations waiting for the socket
        bool expired = false;
        bool closed = false;
        bool keep_buffers = false;  // SSL_MODE_RELEASE_BUFFERS is off
        // The context wipes records (SSL_OP_CLEANSE_PLAINTEXT: an upstream's, whose records may
        // echo a credential): while buffers are released, as OpenSSL frees a drained read
        // buffer inside the SSL_read that copies the echo out. A stream that keeps its buffers
        // reads without it (they are wiped when given back); cleanse_plaintext() keeps it on.
        bool cleanse_released = false;
        bool cleanse_always = false;  // cleanse_plaintext() was called
        bool used = false;          // an OpenSSL call ran since release_due was set
        uint32_t calls = 0;         // OpenSSL calls while the mode is on
        Clock::time_point release_due = Clock::time_point::max();
        std::string gather;
        bool more_to_send = false;  // the record being written is not the write's last: MSG_MORE
        uint32_t inline_streak = 0;  // tries completed in a row in the caller (kInlineStreak)
    };

    /// What one attempt of an OpenSSL call came to.
    struct Status {
        enum Kind { Done, WantRead, WantWrite, Failed } kind;
        error_code ec;
        size_t bytes = 0;
    };
    /// Classifies a failed SSL call (ret <= 0) and drains OpenSSL's error queue.
    static Status classify(SSL* ssl, int ret);

    struct HandshakeStep {
        Status operator()(Core& core) const;
    };
    struct ShutdownStep {
        Status operator()(Core& core) const;
    };
    struct ReadStep {
        char* data = nullptr;
        size_t size = 0;
        Status operator()(Core& core) const;
    };
    /// Writes as many records as the socket takes (not one per call of the operation): a
    /// 64 KiB body goes out in one step, and every record but the last is sent with MSG_MORE,
    /// so the kernel builds one segment of them and the peer wakes once, not once a record.
    struct WriteStep {
        const char* data = nullptr;
        size_t size = 0;
        Status operator()(Core& core) const;
    };

    // The BIO between OpenSSL and core->socket (tls_socket.cc).
    static const BIO_METHOD* socket_bio_method();
    static int bio_write(BIO* bio, const char* data, int len);
    static int bio_read(BIO* bio, char* data, int len);

    /// Closes the socket now and cancels the timer: a timer handler still holding the core
    /// must not keep the descriptor open until it fires.
    void close_core() noexcept;

    /// False when the deadline has passed (the operation completes with timeout); otherwise
    /// makes sure a timer will fire by the deadline.
    static bool arm(const std::shared_ptr<Core>& core);
    /// Makes sure the timer fires by `at` (re-arms only when it would fire later).
    static void fire_by(const std::shared_ptr<Core>& core, Clock::time_point at);
    static void on_timer(const std::shared_ptr<Core>& core, uint64_t generation);
    /// Before every OpenSSL call: counts calls until the stream is busy, then keeps buffers.
    static void note_use(const std::shared_ptr<Core>& core) {
        core->used = true;
        if (!core->keep_buffers && ++core->calls >= kBusyCalls) {
            start_keeping_buffers(core);
        }
    }
    static void start_keeping_buffers(const std::shared_ptr<Core>& core);

    /// One composed operation: try the OpenSSL call; on WANT_READ/WRITE wait for the socket
    /// and try again. A result known at initiation is posted (Asio's rule: a completion
    /// handler never runs inside the initiating function).
    template <class Step>
    struct Op {
        std::shared_ptr<Core> core;
        Step step;
        /// WantRead/WantWrite: the step was just tried (TlsSocket::now) and must wait for that
        /// first.
        Status::Kind wait_first = Status::Done;
        bool started = false;
        bool waiting = false;
        bool deferred = false;
        Status result{Status::Done, {}, 0};

        template <class Self>
        void operator()(Self& self, error_code ec = {}) {
            if (deferred) {
                return deliver(self);
            }
            if (waiting) {
                waiting = false;
                --core->waiting;
                if (ec) {
                    // Cancelled (the deadline, a close, an owner's cancel) or a socket error.
                    return finish(self, {Status::Failed,
                                         core->expired ? error_code(boost::beast::error::timeout) : ec,
                                         0});
                }
            }
            if (core->closed) {
                return finish(self, {Status::Failed, boost::asio::error::bad_descriptor, 0});
            }
            Status s{wait_first, {}, 0};
            if (wait_first == Status::Done) {
                note_use(core);
                s = step(*core);
            }
            wait_first = Status::Done;
            if (s.kind == Status::Done || s.kind == Status::Failed) {
                return finish(self, std::move(s));
            }
            if (!arm(core)) {
                return finish(self, {Status::Failed, boost::beast::error::timeout, 0});
            }
            waiting = true;
            started = true;
            ++core->waiting;
            core->socket.async_wait(s.kind == Status::WantRead ? socket_type::wait_read
                                                               : socket_type::wait_write,
                                    std::move(self));
        }

        template <class Self>
        void finish(Self& self, Status s) {
            result = std::move(s);
            if (started) {
                return deliver(self);
            }
            deferred = true;
            auto ex = core->socket.get_executor();
            boost::asio::post(ex, std::move(self));
        }

        template <class Self>
        void deliver(Self& self) {
            const error_code ec = result.kind == Status::Failed ? result.ec : error_code();
            if constexpr (std::is_same_v<Step, ReadStep> || std::is_same_v<Step, WriteStep>) {
                self.complete(ec, result.bytes);
            } else {
                self.complete(ec);
            }
        }
    };

    template <class MutableBuffers>
    static ReadStep read_step(const MutableBuffers& buffers) {
        ReadStep step;
        for (auto it = boost::asio::buffer_sequence_begin(buffers);
             it != boost::asio::buffer_sequence_end(buffers); ++it) {
            const boost::asio::mutable_buffer b = *it;
            if (b.size() != 0) {
                step.data = static_cast<char*>(b.data());
                step.size = b.size();
                break;
            }
        }
        return step;
    }
    template <class ConstBuffers>
    WriteStep write_step(const ConstBuffers& buffers) {
        WriteStep step;
        size_t nonempty = 0;
        for (auto it = boost::asio::buffer_sequence_begin(buffers);
             it != boost::asio::buffer_sequence_end(buffers) && nonempty < 2; ++it) {
            const boost::asio::const_buffer b = *it;
            if (b.size() != 0 && nonempty++ == 0) {
                step.data = static_cast<const char*>(b.data());
                step.size = b.size();
            }
        }
        if (nonempty > 1 && step.size < kGatherBytes) {
            std::string& g = core_->gather;
            g.clear();
            for (auto it = boost::asio::buffer_sequence_begin(buffers);
                 it != boost::asio::buffer_sequence_end(buffers) && g.size() < kGatherBytes; ++it) {
                const boost::asio::const_buffer b = *it;
                g.append(static_cast<const char*>(b.data()), std::min(b.size(), kGatherBytes - g.size()));
            }
            step.data = g.data();
            step.size = g.size();
        }
        return step;
    }
    /// One attempt of a read or write step, outside an operation.
    template <class Step>
    Attempt now(const Step& step) {
        if (core_->closed) {
            return {Outcome{boost::asio::error::bad_descriptor, 0}};
        }
        if (core_->inline_streak >= kInlineStreak) {
            return {std::nullopt, false};
        }
        note_use(core_);
        Status s = step(*core_);
        if (s.kind == Status::Done) {
            ++core_->inline_streak;
            return {Outcome{error_code(), s.bytes}};
        }
        if (s.kind == Status::Failed) {
            return {Outcome{s.ec, 0}};
        }
        return {std::nullopt, true, s.kind == Status::WantWrite};
    }
    static Status::Kind wait_for(const Attempt& a) {
        if (a.outcome || !a.tried) {
            return Status::Done;  // nothing to wait for: the operation tries at once
        }
        return a.want_write ? Status::WantWrite : Status::WantRead;
    }

    template <class Signature, class Step, class Token>
    auto start(Step step, Token&& token, Status::Kind wait_first = Status::Done) {
        core_->inline_streak = 0;  // this one waits or goes through the event loop
        return boost::asio::async_compose<Token, Signature>(Op<Step>{core_, step, wait_first},
                                                            token, core_->socket);
    }

    std::shared_ptr<Core> core_;
};

}  // namespace egress::proxy
