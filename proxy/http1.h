#pragma once
// HTTP/1.1 codec for the client side: requests read with Beast's parser become a
// policy::RequestHead and are served by the protocol-neutral core (proxy/exchange.h); this
// file only adapts Beast to the Downstream/Upstream interfaces. Internal to proxy/.
#include <chrono>
#include <optional>
#include <string>

#include "proxy/exchange.h"

namespace egress::proxy {

/// Writes a refusal: status, text/plain body, X-Egress-Reason, and for 407
/// Proxy-Authenticate, for 429 Retry-After.
template <class Stream>
awaitable<void> write_refusal(Stream& s, int status, const std::string& reason, bool keep_alive);

/// Serves requests on an intercepted TLS connection until it closes.
awaitable<void> serve_intercepted_http1(TlsStream& client, beast::flat_buffer& buffer, Scope& scope);

/// Handles one absolute-form http:// request whose header is already parsed.
/// Returns whether the client connection may be kept alive.
awaitable<bool> forward_plain_http(TcpStream& client, beast::flat_buffer& buffer,
                                   http::request_parser<http::buffer_body>& parser, Scope& scope);

/// Handles one origin-form request on the transparent listener (cleartext), whose header is
/// already parsed and whose destination (scope.target) is decided.
awaitable<bool> forward_origin_http(TcpStream& client, beast::flat_buffer& buffer,
                                    http::request_parser<http::buffer_body>& parser, Scope& scope);

}  // namespace egress::proxy
