#pragma once
// Server (client-facing, intercepted) and client (upstream) TLS contexts. Create each
// SSL_CTX once; per-connection state goes on the SSL object.
#include <optional>
#include <string>
#include <vector>

#include "common/result.h"
#include "tls/openssl_ptr.h"
#include "tls/run_ca.h"

namespace egress::tls {

/// Server context for intercepted connections: TLS 1.2 minimum, renegotiation refused
/// (SSL_OP_NO_RENEGOTIATION), session tickets on, ECDHE only, ALPN chosen in server
/// preference order from `alpn` (e.g. {"h2", "http/1.1"}); no overlap → no ALPN (the
/// client then speaks HTTP/1.1). No certificate is set on the context: use_leaf() sets one
/// per connection.
Result<SslCtxPtr> make_server_context(std::vector<std::string> alpn);

/// The server name the client's ClientHello carried (the last one: a second after a TLS 1.3
/// HelloRetryRequest), as sent; "" when its server_name extension was malformed; nullopt
/// without one. A connection of make_server_context's records it for every handshake,
/// resumed ones too: SSL_get_servername reports a resumed TLS 1.2 session's name, not the
/// name this ClientHello asked for (and none at all without a servername callback).
std::optional<std::string> client_hello_sni(const SSL* ssl);

/// Puts the leaf (and its key) on one connection before the handshake.
Result<bool> use_leaf(SSL* ssl, const Leaf& leaf);

/// Client context for upstream connections: verifies peers against `ca_file` ("system" =
/// the default verify paths), TLS 1.2 minimum, sessions kept for resumption through a
/// ClientSessionCache attached per connection (tls/session_cache.h), ALPN list `alpn`.
Result<SslCtxPtr> make_client_context(const std::string& ca_file, std::vector<std::string> alpn);

/// A client certificate for every connection of `ctx` (a peer that asks for one, such as an
/// etcd with --client-cert-auth): the PEM chain in `cert_file`, its key in `key_file`.
Result<bool> use_client_certificate(SSL_CTX* ctx, const std::string& cert_file,
                                    const std::string& key_file);

/// Per-connection upstream setup: SNI (names only, not IP literals) and hostname (or IP)
/// verification against `host` via X509_VERIFY_PARAM, so the handshake fails unless the
/// certificate is valid for exactly that host.
Result<bool> prepare_client(SSL* ssl, const std::string& host);

/// The ALPN protocol negotiated on `ssl` ("" if none).
std::string negotiated_alpn(const SSL* ssl);

}  // namespace egress::tls
