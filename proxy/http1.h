#pragma once
// HTTP/1.1 codec for the client side: requests read with Beast's parser become a
// policy::RequestHead, go through the shared pipeline once, and are relayed with bodies
// streamed both ways. Internal to proxy/.
#include <chrono>
#include <optional>
#include <string>

#include "proxy/upstream.h"
#include "proxy/worker.h"

namespace egress::proxy {

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
};

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

/// Records a refusal in audit and metrics.
void audit_refusal(Scope& scope, const std::string& method, const std::string& path, int status,
                   const std::string& reason, std::chrono::steady_clock::time_point started);

}  // namespace egress::proxy
