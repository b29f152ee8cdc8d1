#include "tls/session_cache.h"

#include <openssl/crypto.h>

#include <mutex>

namespace egress::tls {
namespace {

/// What a connection is attached to: owned by its SSL (freed with it through the ex_data
/// free callback), so a session arriving late never finds a dangling key.
struct Binding {
    ClientSessionCache* cache;
    std::string key;
};

void free_binding(void*, void* ptr, CRYPTO_EX_DATA*, int, long, void*) {
    delete static_cast<Binding*>(ptr);
}

int binding_index() {
    static int index = -1;
    static std::once_flag once;
    std::call_once(once, [] {
        index = SSL_get_ex_new_index(0, nullptr, nullptr, nullptr, free_binding);
    });
    return index;
}

int on_new_session(SSL* ssl, SSL_SESSION* session) {
    const int index = binding_index();
    auto* b = index < 0 ? nullptr : static_cast<Binding*>(SSL_get_ex_data(ssl, index));
    if (b == nullptr || SSL_SESSION_is_resumable(session) != 1) {
        return 0;
    }
    // A copy: OpenSSL marks the connection's own session object not resumable when the
    // connection is freed without a close_notify (ssl_clear_bad_session), which is how
    // pooled upstream connections usually end.
    if (SSL_SESSION* copy = SSL_SESSION_dup(session)) {
        b->cache->store(b->key, copy);
    }
    return 0;  // OpenSSL keeps managing the original
}

}  // namespace

Result<bool> enable_client_sessions(SSL_CTX* ctx) {
    if (ctx == nullptr || binding_index() < 0) {
        return make_error("enabling upstream session resumption failed");
    }
    SSL_CTX_set_session_cache_mode(ctx, SSL_SESS_CACHE_CLIENT | SSL_SESS_CACHE_NO_INTERNAL_STORE);
    SSL_CTX_sess_set_new_cb(ctx, on_new_session);
    return true;
}

ClientSessionCache::ClientSessionCache(size_t max_entries)
    : max_entries_(max_entries == 0 ? 1 : max_entries) {}

ClientSessionCache::~ClientSessionCache() = default;

bool ClientSessionCache::attach(SSL* ssl, const std::string& key) {
    const int index = binding_index();
    if (ssl == nullptr || index < 0) {
        return false;
    }
    auto* b = new Binding{this, key};
    if (SSL_set_ex_data(ssl, index, b) != 1) {
        delete b;
        return false;
    }
    auto it = entries_.find(key);
    if (it == entries_.end()) {
        return false;
    }
    return SSL_set_session(ssl, it->second.session.get()) == 1;
}

void ClientSessionCache::store(const std::string& key, SSL_SESSION* session) {
    SslSessionPtr owned(session);
    auto it = entries_.find(key);
    if (it != entries_.end()) {
        it->second.session = std::move(owned);  // the newest ticket replaces the older one
        order_.splice(order_.end(), order_, it->second.order);
        return;
    }
    if (entries_.size() >= max_entries_) {
        entries_.erase(order_.front());
        order_.pop_front();
    }
    order_.push_back(key);
    entries_.emplace(key, Entry{std::move(owned), std::prev(order_.end())});
}

}  // namespace egress::tls
