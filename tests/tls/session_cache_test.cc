#include "tls/session_cache.h"

#include <gtest/gtest.h>

#include <string>

#include "tests/tls/tls_test_util.h"
#include "tls/contexts.h"

namespace egress::tls {
namespace {

class SessionCacheTest : public testing::RunCaTest {
protected:
    void SetUp() override {
        RunCaTest::SetUp();
        auto s = make_server_context({"http/1.1"});
        auto c = make_client_context(ca_file_->path(), {"http/1.1"});
        ASSERT_TRUE(s.ok() && c.ok());
        sctx_ = std::move(s).value();
        cctx_ = std::move(c).value();
    }

    /// One upstream connection to a server with a leaf for `host`, attached to `cache` under
    /// `key`; the client then reads once so the TLS 1.3 tickets sent after the handshake
    /// reach the cache. Returns whether the handshake resumed; `offered` says whether the
    /// cache had a session to offer.
    bool connect(ClientSessionCache& cache, const std::string& key, const std::string& host,
                 bool* offered = nullptr) {
        SslPtr client(SSL_new(cctx_.get()));
        EXPECT_TRUE(prepare_client(client.get(), host).ok());
        const bool o = cache.attach(client.get(), key);
        if (offered != nullptr) {
            *offered = o;
        }
        SslPtr server = server_ssl(sctx_.get(), host);
        auto r = testing::handshake(client.get(), server.get());
        EXPECT_TRUE(r.ok) << r.error;
        EXPECT_EQ(SSL_get_verify_result(client.get()), X509_V_OK);
        char byte;
        EXPECT_LE(SSL_read(client.get(), &byte, 1), 0);  // nothing to read; tickets processed
        ERR_clear_error();
        return SSL_session_reused(client.get()) == 1;
    }

    SslCtxPtr sctx_;
    SslCtxPtr cctx_;
};

TEST_F(SessionCacheTest, SecondConnectionResumesWithTheTicketOfTheFirst) {
    ClientSessionCache cache;
    bool offered = true;
    EXPECT_FALSE(connect(cache, "r1\na.test:443", "a.test", &offered));
    EXPECT_FALSE(offered);
    EXPECT_EQ(cache.size(), 1u);
    EXPECT_TRUE(connect(cache, "r1\na.test:443", "a.test", &offered));
    EXPECT_TRUE(offered);
    EXPECT_TRUE(connect(cache, "r1\na.test:443", "a.test"));  // the newest ticket works too
}

TEST_F(SessionCacheTest, KeysAreSeparate) {
    ClientSessionCache cache;
    EXPECT_FALSE(connect(cache, "r1\na.test:443", "a.test"));
    bool offered = true;
    // another run, same destination: nothing offered, full handshake
    EXPECT_FALSE(connect(cache, "r2\na.test:443", "a.test", &offered));
    EXPECT_FALSE(offered);
    EXPECT_EQ(cache.size(), 2u);
}

TEST_F(SessionCacheTest, KeepsAtMostMaxEntriesDroppingTheOldest) {
    ClientSessionCache cache(2);
    connect(cache, "k1", "a.test");
    connect(cache, "k2", "a.test");
    connect(cache, "k3", "a.test");
    EXPECT_EQ(cache.size(), 2u);
    bool offered = true;
    connect(cache, "k1", "a.test", &offered);
    EXPECT_FALSE(offered);  // k1 was the oldest
    connect(cache, "k3", "a.test", &offered);
    EXPECT_TRUE(offered);
}

TEST_F(SessionCacheTest, UnattachedConnectionsKeepNothing) {
    ClientSessionCache cache;
    SslPtr client(SSL_new(cctx_.get()));
    ASSERT_TRUE(prepare_client(client.get(), "a.test").ok());
    SslPtr server = server_ssl(sctx_.get(), "a.test");
    ASSERT_TRUE(testing::handshake(client.get(), server.get()).ok);
    char byte;
    EXPECT_LE(SSL_read(client.get(), &byte, 1), 0);
    ERR_clear_error();
    EXPECT_EQ(cache.size(), 0u);
}

}  // namespace
}  // namespace egress::tls
