#include "tls/contexts.h"

#include <openssl/err.h>
#include <openssl/x509v3.h>

#include "common/regular_file.h"
#include "tls/client_hello.h"
#include "tls/session_cache.h"
#include "tls/trust_store.h"

namespace egress::tls {
namespace {

constexpr const char* kServerCiphers12 = "ECDHE+AESGCM:ECDHE+CHACHA20";
constexpr const char* kGroups = "X25519:P-256:P-384";
constexpr unsigned char kSessionIdContext[] = "egressd";

Error ssl_error(const std::string& what) { return make_error(what + ": " + last_ssl_error()); }

void free_sni(void*, void* ptr, CRYPTO_EX_DATA*, int, long, void*) {
    delete static_cast<std::string*>(ptr);
}

/// The SSL ex_data slot of client_hello_sni(): a std::string of the connection's own.
int sni_ex_index() {
    static const int index = SSL_get_ex_new_index(0, nullptr, nullptr, nullptr, free_sni);
    return index;
}

/// SSL_CTX_set_client_hello_cb: keeps this ClientHello's server name for client_hello_sni().
int record_sni(SSL* ssl, int*, void*) {
    const int index = sni_ex_index();
    if (index < 0) {
        return SSL_CLIENT_HELLO_ERROR;
    }
    delete static_cast<std::string*>(SSL_get_ex_data(ssl, index));  // an earlier ClientHello's
    SSL_set_ex_data(ssl, index, nullptr);
    const unsigned char* data = nullptr;
    size_t len = 0;
    if (SSL_client_hello_get0_ext(ssl, TLSEXT_TYPE_server_name, &data, &len) != 1) {
        return SSL_CLIENT_HELLO_SUCCESS;
    }
    auto ext = parse_server_name(std::span<const uint8_t>(data, len));
    auto* name = new std::string(ext.malformed || !ext.host ? std::string() : std::move(*ext.host));
    if (SSL_set_ex_data(ssl, index, name) != 1) {
        delete name;
        return SSL_CLIENT_HELLO_ERROR;
    }
    return SSL_CLIENT_HELLO_SUCCESS;
}

/// ALPN protocols in wire format (length-prefixed), or an error for an empty/oversized name.
Result<std::string> alpn_wire(const std::vector<std::string>& protos) {
    std::string wire;
    for (const auto& p : protos) {
        if (p.empty() || p.size() > 255) {
            return make_error("invalid ALPN protocol name '" + p + "'");
        }
        wire.push_back(static_cast<char>(p.size()));
        wire += p;
    }
    return wire;
}

/// The server's ALPN list lives in SSL_CTX ex_data: OpenSSL frees it with the context.
void free_alpn_list(void* /*parent*/, void* ptr, CRYPTO_EX_DATA* /*ad*/, int /*idx*/, long /*argl*/,
                    void* /*argp*/) {
    delete static_cast<std::vector<std::string>*>(ptr);
}

int alpn_ex_index() {
    static const int index = SSL_CTX_get_ex_new_index(0, nullptr, nullptr, nullptr, free_alpn_list);
    return index;
}

/// Server preference: the first of our protocols that the client offered. No overlap → no
/// ALPN extension in the reply (the client then speaks HTTP/1.1).
int select_alpn(SSL* /*ssl*/, const unsigned char** out, unsigned char* outlen,
                const unsigned char* in, unsigned int inlen, void* arg) {
    const auto* ours = static_cast<const std::vector<std::string>*>(arg);
    if (ours == nullptr) {
        return SSL_TLSEXT_ERR_NOACK;
    }
    for (const auto& proto : *ours) {
        unsigned int i = 0;
        while (i < inlen) {
            const unsigned int len = in[i];
            if (len == 0 || i + 1 + len > inlen) {
                break;  // malformed client list: stop reading it
            }
            const unsigned char* name = in + i + 1;
            if (len == proto.size() &&
                proto.compare(0, len, reinterpret_cast<const char*>(name), len) == 0) {
                *out = name;
                *outlen = static_cast<unsigned char>(len);
                return SSL_TLSEXT_ERR_OK;
            }
            i += 1 + len;
        }
    }
    return SSL_TLSEXT_ERR_NOACK;
}

bool is_ip_literal(const std::string& host) {
    ASN1_OCTET_STRING* ip = a2i_IPADDRESS(host.c_str());
    ERR_clear_error();
    const bool is_ip = ip != nullptr;
    ASN1_OCTET_STRING_free(ip);
    return is_ip;
}

}  // namespace

Result<SslCtxPtr> make_server_context(std::vector<std::string> alpn) {
    auto wire = alpn_wire(alpn);  // validates names
    if (!wire) {
        return make_error(wire.error());
    }
    SslCtxPtr ctx(SSL_CTX_new(TLS_server_method()));
    if (ctx == nullptr) {
        return ssl_error("SSL_CTX_new (server) failed");
    }
    if (SSL_CTX_set_min_proto_version(ctx.get(), TLS1_2_VERSION) != 1) {
        return ssl_error("setting the server TLS minimum version failed");
    }
    SSL_CTX_set_options(ctx.get(), SSL_OP_NO_RENEGOTIATION | SSL_OP_CIPHER_SERVER_PREFERENCE |
                                       SSL_OP_NO_COMPRESSION);
    SSL_CTX_clear_options(ctx.get(), SSL_OP_NO_TICKET);
    SSL_CTX_set_session_cache_mode(ctx.get(), SSL_SESS_CACHE_SERVER);
    if (sni_ex_index() < 0) {
        return ssl_error("SSL_get_ex_new_index failed");
    }
    SSL_CTX_set_client_hello_cb(ctx.get(), record_sni, nullptr);
    if (SSL_CTX_set_session_id_context(ctx.get(), kSessionIdContext,
                                       sizeof(kSessionIdContext) - 1) != 1 ||
        SSL_CTX_set_cipher_list(ctx.get(), kServerCiphers12) != 1 ||
        SSL_CTX_set1_groups_list(ctx.get(), kGroups) != 1) {
        return ssl_error("configuring the server TLS context failed");
    }
    if (!alpn.empty()) {
        const int index = alpn_ex_index();
        if (index < 0) {
            return ssl_error("SSL_CTX_get_ex_new_index failed");
        }
        auto* list = new std::vector<std::string>(std::move(alpn));
        if (SSL_CTX_set_ex_data(ctx.get(), index, list) != 1) {
            delete list;
            return ssl_error("SSL_CTX_set_ex_data failed");
        }
        SSL_CTX_set_alpn_select_cb(ctx.get(), select_alpn, list);
    }
    return ctx;
}

std::optional<std::string> client_hello_sni(const SSL* ssl) {
    const auto* name = static_cast<const std::string*>(SSL_get_ex_data(ssl, sni_ex_index()));
    if (name == nullptr) {
        return std::nullopt;
    }
    return *name;
}

Result<bool> use_leaf(SSL* ssl, const Leaf& leaf) {
    if (ssl == nullptr || leaf.cert == nullptr || leaf.key == nullptr) {
        return make_error("use_leaf: missing connection, certificate or key");
    }
    if (SSL_use_certificate(ssl, leaf.cert.get()) != 1 ||
        SSL_use_PrivateKey(ssl, leaf.key.get()) != 1 || SSL_check_private_key(ssl) != 1) {
        return ssl_error("installing the leaf certificate failed");
    }
    // The server context is shared by every run, and so are its session cache and ticket
    // keys: without a context of the leaf's own, a session made under run A's CA resumed
    // on run B's connection with no certificate shown (OpenSSL refuses to resume a session
    // whose id context differs, for session ids and tickets alike).
    if (SSL_set_session_id_context(ssl, leaf.session_context.data(),
                                   static_cast<unsigned int>(leaf.session_context.size())) != 1) {
        return ssl_error("setting the session id context failed");
    }
    return true;
}

namespace {

/// Why `path` cannot be read as a regular file without blocking (common/regular_file.h), or
/// nullopt when it can.
std::optional<std::string> unreadable_regular_file(const std::string& path) {
    auto fd = open_regular_file(path);
    if (!fd) {
        return fd.error();
    }
    ::close(*fd);
    return std::nullopt;
}

}  // namespace

Result<SslCtxPtr> make_client_context(const std::string& ca_file, std::vector<std::string> alpn) {
    auto wire = alpn_wire(alpn);
    if (!wire) {
        return make_error(wire.error());
    }
    SslCtxPtr ctx(SSL_CTX_new(TLS_client_method()));
    if (ctx == nullptr) {
        return ssl_error("SSL_CTX_new (client) failed");
    }
    if (SSL_CTX_set_min_proto_version(ctx.get(), TLS1_2_VERSION) != 1) {
        return ssl_error("setting the client TLS minimum version failed");
    }
    // An upstream may echo the credential injected into the request. OpenSSL decrypts a record
    // where it lies, and a stream in SSL_MODE_RELEASE_BUFFERS (proxy/tls_socket.h) frees the
    // drained read buffer inside the very SSL_read that copies the echo out, before the relay
    // can see it: unwiped, the freed block kept the credential until malloc reused it. With
    // SSL_OP_CLEANSE_PLAINTEXT each record's plaintext is wiped as it is read out and the read
    // buffer as it is given back (proxy/tls_socket.cc lifts it while a busy stream keeps its
    // buffers, and sets it again before they are freed). The write buffer holds only
    // ciphertext when freed: a record is encrypted where it was copied, in the same call.
    // No renegotiation an upstream asks for (a TLS 1.2 HelloRequest): a new handshake under a
    // connection already verified, which a hostile upstream could ask for again and again.
    SSL_CTX_set_options(ctx.get(), SSL_OP_NO_COMPRESSION | SSL_OP_CLEANSE_PLAINTEXT |
                                       SSL_OP_NO_RENEGOTIATION);
    SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER, nullptr);
    if (ca_file == "system") {
        if (SSL_CTX_set_default_verify_paths(ctx.get()) != 1) {
            return ssl_error("loading the system CA store failed");
        }
        // The bundle's certificates; those of a hashed directory are loaded when looked up.
        settle_certificates(SSL_CTX_get_cert_store(ctx.get()));
    } else {
        if (ca_file.empty()) {
            return make_error("CA file is empty (use \"system\" for the system store)");
        }
        // OpenSSL opens the file itself: a FIFO there would block it (and a reload) for good.
        if (auto why = unreadable_regular_file(ca_file)) {
            return make_error("cannot load CA file '" + ca_file + "': " + *why);
        }
        if (SSL_CTX_load_verify_locations(ctx.get(), ca_file.c_str(), nullptr) != 1) {
            return ssl_error("cannot load CA file '" + ca_file + "'");
        }
        if (settle_certificates(SSL_CTX_get_cert_store(ctx.get())) == 0) {
            ERR_clear_error();
            return make_error("CA file '" + ca_file + "' contains no certificate");
        }
    }
    X509_VERIFY_PARAM_set_hostflags(SSL_CTX_get0_param(ctx.get()),
                                    X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
    if (auto ok = enable_client_sessions(ctx.get()); !ok) {
        return make_error(ok.error());
    }
    if (!wire->empty() &&
        SSL_CTX_set_alpn_protos(ctx.get(), reinterpret_cast<const unsigned char*>(wire->data()),
                                static_cast<unsigned int>(wire->size())) != 0) {
        return ssl_error("setting the client ALPN list failed");  // note: 0 means success
    }
    return ctx;
}

Result<bool> use_client_certificate(SSL_CTX* ctx, const std::string& cert_file,
                                    const std::string& key_file) {
    if (auto why = unreadable_regular_file(cert_file)) {
        return make_error("cannot load certificate file '" + cert_file + "': " + *why);
    }
    if (auto why = unreadable_regular_file(key_file)) {
        return make_error("cannot load key file '" + key_file + "': " + *why);
    }
    if (SSL_CTX_use_certificate_chain_file(ctx, cert_file.c_str()) != 1) {
        return ssl_error("cannot load certificate file '" + cert_file + "'");
    }
    if (SSL_CTX_use_PrivateKey_file(ctx, key_file.c_str(), SSL_FILETYPE_PEM) != 1) {
        return ssl_error("cannot load key file '" + key_file + "'");
    }
    if (SSL_CTX_check_private_key(ctx) != 1) {
        return ssl_error("key file '" + key_file + "' does not match certificate file '" +
                         cert_file + "'");
    }
    return true;
}

Result<bool> prepare_client(SSL* ssl, const std::string& host_in) {
    if (ssl == nullptr) {
        return make_error("prepare_client: no connection");
    }
    std::string host = host_in;
    if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
        host = host.substr(1, host.size() - 2);
    }
    if (host.empty()) {
        return make_error("prepare_client: empty host");
    }
    X509_VERIFY_PARAM* param = SSL_get0_param(ssl);
    X509_VERIFY_PARAM_set_hostflags(param, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
    if (is_ip_literal(host)) {
        // No SNI for IP literals (RFC 6066 3); verify the certificate's SAN IP instead.
        if (X509_VERIFY_PARAM_set1_ip_asc(param, host.c_str()) != 1) {
            return ssl_error("setting the upstream IP to verify failed for '" + host + "'");
        }
        return true;
    }
    if (SSL_set_tlsext_host_name(ssl, host.c_str()) != 1) {
        return ssl_error("setting SNI failed for '" + host + "'");
    }
    if (SSL_set1_host(ssl, host.c_str()) != 1) {
        return ssl_error("setting the upstream host to verify failed for '" + host + "'");
    }
    return true;
}

std::string negotiated_alpn(const SSL* ssl) {
    const unsigned char* data = nullptr;
    unsigned int len = 0;
    SSL_get0_alpn_selected(ssl, &data, &len);
    if (data == nullptr || len == 0) {
        return {};
    }
    return std::string(reinterpret_cast<const char*>(data), len);
}

}  // namespace egress::tls
