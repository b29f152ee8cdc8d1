#include "tls/openssl_ptr.h"

#include <openssl/err.h>
#include <openssl/ssl.h>

#include <string>

namespace egress::tls {

std::string last_ssl_error() {
    // Error strings of libssl are loaded lazily by OpenSSL 3; make sure they are there even
    // when no SSL object was created yet (e.g. a failure while building a context).
    static const int loaded = OPENSSL_init_ssl(OPENSSL_INIT_LOAD_SSL_STRINGS, nullptr);
    (void)loaded;
    std::string out;
    const char* data = nullptr;
    int flags = 0;
    while (unsigned long code = ERR_get_error_all(nullptr, nullptr, nullptr, &data, &flags)) {
        char buf[256];
        ERR_error_string_n(code, buf, sizeof(buf));
        if (!out.empty()) {
            out += "; ";
        }
        out += buf;
        // Error data is text OpenSSL attaches (a file name, "Expecting: CERTIFICATE", a
        // verify reason); it never holds key bytes.
        if ((flags & ERR_TXT_STRING) != 0 && data != nullptr && *data != '\0') {
            out += " (";
            out += data;
            out += ")";
        }
    }
    if (out.empty()) {
        out = "no OpenSSL error reported";
    }
    return out;
}

}  // namespace egress::tls
