#pragma once
// Upstream TLS session resumption. An upstream that sends session tickets gets them back on
// the next connection egressd opens to it (a new pooled connection, a redial after the pool
// dropped one), which then resumes instead of running a full handshake with certificate
// verification. OpenSSL's client side keeps no sessions by itself: the application must
// store what the server sends and offer it again (SSL_set_session).
#include <openssl/ssl.h>

#include <cstddef>
#include <list>
#include <memory>
#include <string>
#include <unordered_map>

#include "common/result.h"
#include "tls/openssl_ptr.h"

namespace egress::tls {

/// Installs the new-session callback on an upstream (client) context: a session the server
/// sends goes to the ClientSessionCache its connection was attached to, none to OpenSSL's
/// internal store. Connections that were never attached keep nothing.
Result<bool> enable_client_sessions(SSL_CTX* ctx);

/// The newest resumable session per key, for at most `max_entries` keys (the key stored
/// longest ago is dropped first). Keys are (run, destination) like the upstream pool, so
/// nothing is shared across runs. One per worker thread: no locks; a connection is used
/// on the thread of the cache it is attached to.
class ClientSessionCache {
public:
    explicit ClientSessionCache(size_t max_entries = 1024);
    ~ClientSessionCache();
    ClientSessionCache(const ClientSessionCache&) = delete;
    ClientSessionCache& operator=(const ClientSessionCache&) = delete;

    /// Before the handshake: sessions `ssl` receives are stored under `key`, and the cached
    /// session for `key` (if any) is offered. True when one was offered. The cache must
    /// outlive `ssl`.
    bool attach(SSL* ssl, const std::string& key);

    size_t size() const { return entries_.size(); }

    /// Takes ownership of one reference to `session` (the callback's path).
    void store(const std::string& key, SSL_SESSION* session);

private:
    struct Entry {
        SslSessionPtr session;
        std::list<std::string>::iterator order;
    };
    size_t max_entries_;
    std::unordered_map<std::string, Entry> entries_;
    std::list<std::string> order_;  // keys, oldest store first
};

}  // namespace egress::tls
