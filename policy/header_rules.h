#pragma once
// Which headers may cross the proxy and which headers configuration may set.
// All names are compared case-insensitively.
#include <string_view>

#include "policy/request_head.h"

namespace egress::policy {

/// Hop-by-hop (RFC 9110 7.6.1) plus proxy credentials: connection, keep-alive,
/// proxy-connection, te, trailer, transfer-encoding, upgrade, and every proxy-* header.
bool is_hop_by_hop(std::string_view name);

/// Headers configuration may never set or inject into: host, content-length, connection,
/// transfer-encoding, te, upgrade, keep-alive, trailer, every proxy-*, every pseudo-header
/// (":..."), and the proxy's own namespace x-egress-*.
bool is_transport_header(std::string_view name);

/// The proxy's own namespace, "x-egress-*": the sandbox may not send these.
bool is_egress_namespace(std::string_view name);
/// Removes the fields of that namespace from an upstream's response head or trailers: a
/// client can then take X-Egress-Reason as egressd's word (an upstream could otherwise dress
/// its own 403 as a refusal of egressd's). Returns the number removed.
size_t strip_egress_namespace(std::vector<Header>& headers);

/// RFC 9110 token characters, non-empty.
bool valid_header_name(std::string_view name);
/// No CR, LF or NUL (other CTLs except HTAB refused too); obs-text allowed.
bool valid_header_value(std::string_view value);
/// `s` without leading and trailing optional whitespace (SP, HTAB; RFC 9110 5.6.3).
std::string_view trim_ows(std::string_view s);
/// Whether `name` is one of the comma-separated tokens in `tokens` (OWS around each ignored,
/// case-insensitive).
bool named_in(std::string_view tokens, std::string_view name);

/// Whether the fields ask to switch the connection to a WebSocket (RFC 6455 4.1): "websocket"
/// among the Upgrade tokens and "upgrade" among the Connection tokens (case-insensitive).
bool asks_websocket(const std::vector<Header>& headers);

/// Removes hop-by-hop headers, every header named in a Connection header's tokens (whole
/// tokens, case-insensitive; never Content-Length), and Proxy-*. `te: trailers` is kept when
/// `keep_te_trailers` (HTTP/2 upstreams); any other te is removed. Returns the number removed.
/// One rule for both directions: requests before they leave, responses before they are relayed.
size_t strip_hop_by_hop(std::vector<Header>& headers, bool keep_te_trailers = false);
inline size_t strip_hop_by_hop(RequestHead& head, bool keep_te_trailers = false) {
    return strip_hop_by_hop(head.headers, keep_te_trailers);
}

}  // namespace egress::policy
