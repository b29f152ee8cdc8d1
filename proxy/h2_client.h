#pragma once
// HTTP/2 client over one TLS connection (nghttp2), multiplexing streams up to the peer's
// SETTINGS_MAX_CONCURRENT_STREAMS. Used by the proxy's upstream leg and reusable as is by a
// load generator: it depends only on Asio/Beast streams and policy::RequestHead (pure), not on
// the proxy's scopes, runtime or pool.
//
// Threading: everything runs on the stream's executor (one thread); no method may be called
// from another thread. The session owns one reader and one writer coroutine (one writer per
// connection); nghttp2 is never re-entered from its callbacks.
//
// Flow control: automatic window updates are off. Response DATA is acknowledged to the
// server on the stream (nghttp2_session_consume_stream) only when the caller asks for the next
// piece, i.e. after it has forwarded the previous one, so at most `stream_window` bytes are
// buffered per stream; on the connection it is acknowledged on receipt, so a stream whose
// caller stops reading never holds back the session's other streams.
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "policy/request_head.h"
#include "proxy/net.h"
#include "proxy/pool_allocator.h"

namespace egress::proxy {

struct H2ClientOptions {
    uint32_t stream_window = 256 * 1024;      // receive window per stream (= buffer bound)
    uint32_t connection_window = 1 << 20;     // receive window for the connection
    size_t max_send_buffer = 256 * 1024;      // request bytes queued per stream before write() waits
    size_t max_header_list_bytes = 65536;     // response header block limit; the request
                                              // blocks sent: h2_send_block_limit of it
    size_t max_header_fields = 100;
    std::chrono::milliseconds idle_timeout{30'000};  // no open stream this long: GOAWAY, close
    std::chrono::milliseconds io_timeout{60'000};    // a stream read/write waits at most this
    /// The session carries a secret (egressd's upstream leg: the injected credential). Every
    /// frame byte written is wiped after the write, and every block nghttp2 frees (its copy
    /// of a request's fields among them) before it is reused or given back.
    bool wipe_sent = false;
};

struct H2ClientResponse {
    int status = 0;
    std::vector<policy::Header> headers;  // lowercase, pseudo-headers removed
    bool end_stream = false;              // no body follows
};

class H2ClientSession;
struct H2ClientStreamState;

/// One request/response on a session. Destroying an unfinished stream resets it (CANCEL).
class H2ClientStream : public PooledNew<H2ClientStream> {  // one per proxied h2 stream
public:
    H2ClientStream(std::shared_ptr<H2ClientSession> session,
                   std::shared_ptr<H2ClientStreamState> state);
    ~H2ClientStream();
    H2ClientStream(const H2ClientStream&) = delete;
    H2ClientStream& operator=(const H2ClientStream&) = delete;

    /// Queues request body bytes; waits while more than max_send_buffer are queued.
    /// `last` ends the request, with `trailers` when non-null. False: stream/session failed.
    /// `wait` replaces io_timeout for each wait.
    awaitable<bool> write(std::string_view data, bool last,
                          const std::vector<policy::Header>* trailers = nullptr,
                          std::optional<std::chrono::milliseconds> wait = std::nullopt);
    /// Waits for the final response head (1xx skipped) and moves it into `out`: call once.
    /// False: reset (after no head), closed or timed out. `wait` replaces io_timeout.
    awaitable<bool> response(H2ClientResponse& out,
                             std::optional<std::chrono::milliseconds> wait = std::nullopt);
    /// Next response body piece (valid until the next call). eof=true at the end: with the
    /// last bytes when the end had come by then, else with none. Bytes returned by the
    /// previous call are consumed (window update) first. `wait` replaces io_timeout (a
    /// caller with a deadline for the whole response: egress-bench).
    struct Piece {
        std::span<char> data;  // the stream's buffer until the next read(); may be rewritten
        bool eof = false;
        bool ok = true;
    };
    awaitable<Piece> read(std::optional<std::chrono::milliseconds> wait = std::nullopt);
    /// Response trailers, after read() reported eof.
    const std::vector<policy::Header>& trailers() const;
    /// Whether the server has answered completely (its response ended, END_STREAM) or reset
    /// or closed the stream: it will take no more of the request (RFC 9113 8.1). A response
    /// head alone is not that: a server may answer while it reads on (bidirectional streams).
    bool responded() const;
    /// RST_STREAM error code when the stream was reset (0 otherwise).
    uint32_t error_code() const;
    /// The peer refused the stream unprocessed (RST_STREAM REFUSED_STREAM, or above the
    /// last stream id of its GOAWAY): RFC 9113 8.7, safe to send again elsewhere.
    bool refused() const;
    /// We reset the stream because its response head broke max_header_list_bytes or
    /// max_header_fields (the upstream's fault: not a reset of its own).
    bool bad_response() const;
    /// A header block of the request (its head, or trailers) was too large to send (over the
    /// session's max_send_header_block_length, h2_send_block_limit): not a refusal, the
    /// upstream never saw that block. A head too large never opens a stream at all.
    bool too_large() const;
    void reset();

private:
    std::shared_ptr<H2ClientSession> session_;
    std::shared_ptr<H2ClientStreamState> state_;
};

class H2ClientSession : public std::enable_shared_from_this<H2ClientSession> {
public:
    /// Takes a connected TLS stream whose ALPN is "h2", sends the preface and SETTINGS and
    /// starts the reader and writer on the stream's executor.
    static std::shared_ptr<H2ClientSession> start(std::unique_ptr<TlsStream> stream,
                                                  H2ClientOptions opts = {});
    ~H2ClientSession();

    /// Whether new streams may be opened (no GOAWAY, not closed, below the peer's limit).
    bool has_capacity() const;
    bool alive() const;
    size_t open_streams() const;

    /// Opens a stream for `head` (:method and :path from the head, :scheme and :authority as
    /// given, so a caller that sends another authority need not copy the head; headers as
    /// given, lowercase; connection-specific headers must already be gone). With `end_stream`
    /// the request has no body. The content-length sent is `content_length`, in its one
    /// spelling, never the head's fields (a client's "3, 3", two fields or "003" would make
    /// a strict upstream reset the stream). nullptr when the session cannot open streams.
    std::unique_ptr<H2ClientStream> open(const policy::RequestHead& head, std::string_view scheme,
                                         std::string_view authority, bool end_stream,
                                         std::optional<uint64_t> content_length = std::nullopt);

    /// GOAWAY and close once in-flight streams are done.
    void shutdown();
    /// A stream's response echoed a credential: the session's read buffer and OpenSSL's
    /// records are wiped now and after every read from now on (Upstream::wipe_reads), and the
    /// HPACK decoder's dynamic table is emptied once the upstream acknowledges it.
    void wipe_reads();

    struct Impl;

private:
    H2ClientSession() = default;
    friend class H2ClientStream;
    std::unique_ptr<Impl> impl_;
};

}  // namespace egress::proxy
