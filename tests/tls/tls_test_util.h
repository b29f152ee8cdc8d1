#pragma once
// Helpers for the tls unit tests: in-memory handshakes over BIO pairs and temp CA files.
#include <gtest/gtest.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "tls/openssl_ptr.h"

namespace egress::tls::testing {

struct HandshakeResult {
    bool ok = false;
    std::string error;  // OpenSSL error queue after a failure
};

/// Runs both ends of a handshake in this thread over a BIO pair until both finish or one
/// fails. `client` and `server` take ownership of their BIO end.
inline HandshakeResult handshake(SSL* client, SSL* server) {
    BIO* client_bio = nullptr;
    BIO* server_bio = nullptr;
    if (BIO_new_bio_pair(&client_bio, 0, &server_bio, 0) != 1) {
        return {false, "BIO_new_bio_pair failed"};
    }
    SSL_set_bio(client, client_bio, client_bio);
    SSL_set_bio(server, server_bio, server_bio);
    SSL_set_connect_state(client);
    SSL_set_accept_state(server);
    bool client_done = false;
    bool server_done = false;
    for (int round = 0; round < 100 && !(client_done && server_done); ++round) {
        for (auto [ssl, done] :
             {std::pair{client, &client_done}, std::pair{server, &server_done}}) {
            if (*done) {
                continue;
            }
            const int rc = SSL_do_handshake(ssl);
            if (rc == 1) {
                *done = true;
                continue;
            }
            const int err = SSL_get_error(ssl, rc);
            if (err != SSL_ERROR_WANT_READ && err != SSL_ERROR_WANT_WRITE) {
                return {false, (ssl == client ? "client: " : "server: ") + last_ssl_error()};
            }
        }
    }
    if (!(client_done && server_done)) {
        return {false, "handshake made no progress: " + last_ssl_error()};
    }
    return {true, {}};
}

/// A file under the test temp dir, removed on destruction.
class TempFile {
public:
    explicit TempFile(const std::string& contents) {
        std::string templ = ::testing::TempDir() + "egress_tls_XXXXXX";
        const int fd = mkstemp(templ.data());
        EXPECT_GE(fd, 0);
        if (fd >= 0) {
            close(fd);
        }
        path_ = templ;
        std::ofstream(path_, std::ios::binary) << contents;
    }
    ~TempFile() { std::remove(path_.c_str()); }
    TempFile(const TempFile&) = delete;
    TempFile& operator=(const TempFile&) = delete;

    const std::string& path() const { return path_; }

private:
    std::string path_;
};

}  // namespace egress::tls::testing
