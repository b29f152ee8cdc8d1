#pragma once
// Helpers for the tls unit tests: in-memory handshakes over BIO pairs, temp CA files and a
// run-CA fixture.
#include <gtest/gtest.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>

#include "tls/contexts.h"
#include "tls/openssl_ptr.h"
#include "tls/run_ca.h"

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

/// A fixture with a run CA, its certificate in a file (the upstream CA file of a client
/// context), and server connections presenting leaves it mints.
class RunCaTest : public ::testing::Test {
protected:
    void SetUp() override {
        auto ca = RunCa::create("test-run", std::chrono::hours(1));
        ASSERT_TRUE(ca.ok());
        ca_ = std::move(ca).value();
        ca_file_ = std::make_unique<TempFile>(ca_->cert_pem());
    }

    /// A server SSL from `ctx` presenting a leaf minted for `leaf_host`.
    SslPtr server_ssl(SSL_CTX* ctx, const std::string& leaf_host) {
        auto leaf = ca_->mint(leaf_host);
        EXPECT_TRUE(leaf.ok());
        SslPtr ssl(SSL_new(ctx));
        auto used = use_leaf(ssl.get(), *leaf.value());
        EXPECT_TRUE(used.ok()) << (used.ok() ? "" : used.error());
        return ssl;
    }

    std::unique_ptr<RunCa> ca_;
    std::unique_ptr<TempFile> ca_file_;
};

}  // namespace egress::tls::testing
