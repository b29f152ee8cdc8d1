#pragma once
// RAII ownership of OpenSSL handles (STYLE.md 14).
#include <memory>

#include <openssl/evp.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>

namespace egress::tls {

struct X509Deleter { void operator()(X509* p) const { X509_free(p); } };
struct PKeyDeleter { void operator()(EVP_PKEY* p) const { EVP_PKEY_free(p); } };
struct SslCtxDeleter { void operator()(SSL_CTX* p) const { SSL_CTX_free(p); } };
struct SslDeleter { void operator()(SSL* p) const { SSL_free(p); } };
// SSL_SESSION_free cleanses the session's keys.
struct SslSessionDeleter { void operator()(SSL_SESSION* p) const { SSL_SESSION_free(p); } };

using X509Ptr = std::unique_ptr<X509, X509Deleter>;
using PKeyPtr = std::unique_ptr<EVP_PKEY, PKeyDeleter>;
using SslCtxPtr = std::unique_ptr<SSL_CTX, SslCtxDeleter>;
using SslPtr = std::unique_ptr<SSL, SslDeleter>;
using SslSessionPtr = std::unique_ptr<SSL_SESSION, SslSessionDeleter>;

/// The OpenSSL error queue as one line (and clears it). Never contains key material.
std::string last_ssl_error();

}  // namespace egress::tls
