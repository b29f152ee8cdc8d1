#pragma once
// A trust store shared by threads, made ready before they use it. Header-only (OpenSSL
// alone): egressd's upstream context and egress-bench's client context both call it.
#include <cstddef>

#include <openssl/x509.h>
#include <openssl/x509v3.h>

namespace egress::tls {

/// Computes each certificate's extension cache now and returns how many certificates the
/// store holds. OpenSSL computes a certificate's cache (key identifiers, CA and purpose
/// flags) the first time it builds a chain with it, under the certificate's lock, and
/// publishes it with an acquire/release flag that later readers check without the lock. With
/// one store shared by threads (egressd's workers, egress-bench --threads) that first
/// computation ran in whichever handshake came first while another thread read the
/// identifiers: correct, but invisible to ThreadSanitizer (libcrypto is not instrumented: it
/// sees the allocation under the lock and the other thread's memcmp, not the flag), which
/// reported a race in egress-bench. Done here, before any thread handshakes, the computation
/// is ordered before every reader by the threads' creation.
inline size_t settle_certificates(X509_STORE* store) {
    size_t n = 0;
    STACK_OF(X509_OBJECT)* objs = X509_STORE_get0_objects(store);
    for (int i = 0; i < sk_X509_OBJECT_num(objs); ++i) {
        if (X509* x = X509_OBJECT_get0_X509(sk_X509_OBJECT_value(objs, i))) {
            X509_check_purpose(x, -1, 0);  // purpose -1: only fills the cache
            ++n;
        }
    }
    return n;
}

}  // namespace egress::tls
