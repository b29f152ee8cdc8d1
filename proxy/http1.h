#pragma once
// HTTP/1.1 codec for the client side: requests read with Beast's parser become a
// policy::RequestHead and are served by the protocol-neutral core (proxy/exchange.h); this
// file only adapts Beast to the Downstream/Upstream interfaces. Internal to proxy/.
#include <chrono>
#include <optional>
#include <string>

#include "proxy/exchange.h"
#include "proxy/h1_parser.h"

namespace egress::proxy {

/// Writes a refusal: status, text/plain body, X-Egress-Reason, and for 407
/// Proxy-Authenticate, for 429 Retry-After (`retry_after`); within `timeout`
/// (limits.refusal_timeout: a client that does not read it has its connection closed). The
/// refusal of a HEAD (`head_request`) is its head alone.
template <class Stream>
awaitable<void> write_refusal(Stream& s, std::chrono::milliseconds timeout, int status,
                              const std::string& reason, bool keep_alive,
                              bool head_request = false,
                              std::chrono::seconds retry_after = std::chrono::seconds(1));

/// How reading a request head ended.
enum class HeadRead : uint8_t {
    Ok,
    Closed,    // clean close, reset, or a keep-alive connection idle past idle_timeout
    Timeout,   // started (or first request) but no complete head within header_timeout
    TooLarge,  // over max_header_bytes
    Bad,       // unparseable
};

/// Reads one request head into `parser`. A keep-alive connection (`first` false, nothing
/// buffered) may idle for idle_timeout before the next request's first byte; from then on (and
/// from accept on the first request) the whole head must arrive within header_timeout, so a
/// slowloris client is cut off at header_timeout wherever it starts. From the head's first
/// byte `begun` counts it in flight (the drain waits for a head under way; a connection idle
/// between requests is not waited for): the caller lets go when the request's own count
/// begins (serve_exchange, run_tunnel), or once a refused head is answered.
template <class Stream>
awaitable<HeadRead> read_request_head(Stream& s, beast::flat_buffer& buf,
                                      H1RequestParser& parser, bool first,
                                      const Limits& limits, Worker& w,
                                      std::optional<InflightGuard>& begun);

/// Answers a failed head read (408 header_timeout, 431, 400) and audits it; nothing for Closed.
template <class Stream>
awaitable<void> refuse_head(Stream& s, HeadRead result, Scope& scope,
                            std::chrono::steady_clock::time_point started);

/// Notes, however the handling of a request ends, whether its body was left unread (the
/// connection then ends with linger_close).
struct UnreadBodyNote {
    const H1RequestParser& parser;
    bool& unread;
    ~UnreadBodyNote() { unread = parser.body_unread(); }
};

/// Serves requests on an intercepted TLS connection until it closes. `begun`: the CONNECT's
/// count in flight, kept until its first request's head is read.
awaitable<void> serve_intercepted_http1(TlsStream& client, beast::flat_buffer& buffer, Scope& scope,
                                        std::optional<InflightGuard>& begun);

/// What an audit record of a refused request names as its path (the query is removed when the
/// record is written): an origin-form target as it is, an absolute-form one's path, never its
/// scheme and authority (userinfo included); "" for the authority form and '*'.
std::string audit_path(std::string_view target);

/// Handles one absolute-form http:// request whose header is already parsed.
/// Returns whether the client connection may be kept alive.
awaitable<bool> forward_plain_http(TcpStream& client, beast::flat_buffer& buffer,
                                   H1RequestParser& parser, Scope& scope);

/// Handles one origin-form request on the transparent listener (cleartext), whose header is
/// already parsed and whose destination (scope.target) is decided.
awaitable<bool> forward_origin_http(TcpStream& client, beast::flat_buffer& buffer,
                                    H1RequestParser& parser, Scope& scope);

}  // namespace egress::proxy
