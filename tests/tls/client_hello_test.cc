#include "tls/client_hello.h"

#include <gtest/gtest.h>
#include <openssl/ssl.h>

#include <string>
#include <vector>

namespace egress::tls {
namespace {

using Status = ClientHelloPeek::Status;

/// The bytes a real OpenSSL client sends first (its ClientHello), optionally with SNI.
std::vector<uint8_t> real_client_hello(const char* sni, int max_version = 0) {
    SSL_CTX* ctx = SSL_CTX_new(TLS_client_method());
    if (max_version != 0) SSL_CTX_set_max_proto_version(ctx, max_version);
    SSL* ssl = SSL_new(ctx);
    BIO* rbio = BIO_new(BIO_s_mem());
    BIO* wbio = BIO_new(BIO_s_mem());
    SSL_set_bio(ssl, rbio, wbio);
    if (sni != nullptr) SSL_set_tlsext_host_name(ssl, sni);
    SSL_set_connect_state(ssl);
    EXPECT_LE(SSL_do_handshake(ssl), 0);  // wants to read the ServerHello
    std::vector<uint8_t> out(static_cast<size_t>(BIO_ctrl_pending(wbio)));
    BIO_read(wbio, out.data(), static_cast<int>(out.size()));
    SSL_free(ssl);
    SSL_CTX_free(ctx);
    return out;
}

ClientHelloPeek peek(const std::vector<uint8_t>& b) { return peek_client_hello(b); }

TEST(ClientHelloTest, ReadsTheSniOfARealClientHello) {
    for (int v : {0, TLS1_2_VERSION}) {
        auto hello = real_client_hello("api.github.com", v);
        ASSERT_GT(hello.size(), 50u);
        auto p = peek(hello);
        EXPECT_EQ(p.status, Status::Complete);
        ASSERT_TRUE(p.sni.has_value());
        EXPECT_EQ(*p.sni, "api.github.com");
    }
}

TEST(ClientHelloTest, EveryPrefixNeedsMore) {
    auto hello = real_client_hello("a.test");
    for (size_t n = 0; n < hello.size(); ++n) {
        auto p = peek_client_hello(std::span<const uint8_t>(hello.data(), n));
        ASSERT_EQ(p.status, Status::NeedMore) << "prefix " << n;
    }
}

TEST(ClientHelloTest, AClientHelloWithoutSniIsCompleteWithNoName) {
    auto p = peek(real_client_hello(nullptr));
    EXPECT_EQ(p.status, Status::Complete);
    EXPECT_FALSE(p.sni.has_value());
}

TEST(ClientHelloTest, ReassemblesAClientHelloSplitAcrossRecords) {
    auto hello = real_client_hello("split.test");
    // Re-frame the one handshake message as two records.
    std::vector<uint8_t> msg(hello.begin() + 5, hello.end());
    size_t half = msg.size() / 2;
    std::vector<uint8_t> two;
    for (auto [from, to] : {std::pair{size_t{0}, half}, std::pair{half, msg.size()}}) {
        size_t len = to - from;
        two.insert(two.end(), {0x16, 0x03, 0x01, static_cast<uint8_t>(len >> 8),
                               static_cast<uint8_t>(len & 0xff)});
        two.insert(two.end(), msg.begin() + static_cast<long>(from),
                   msg.begin() + static_cast<long>(to));
    }
    auto p = peek(two);
    EXPECT_EQ(p.status, Status::Complete);
    EXPECT_EQ(p.sni.value_or(""), "split.test");
}

TEST(ClientHelloTest, CleartextIsNotTls) {
    std::string get = "GET / HTTP/1.1\r\nHost: a.test\r\n\r\n";
    EXPECT_EQ(peek(std::vector<uint8_t>(get.begin(), get.end())).status, Status::NotTls);
}

TEST(ClientHelloTest, MalformedRecordsAreRejected) {
    auto hello = real_client_hello("a.test");
    auto bad_version = hello;
    bad_version[1] = 0x02;
    EXPECT_EQ(peek(bad_version).status, Status::Malformed);
    auto not_hello = hello;
    not_hello[5] = 0x02;  // ServerHello
    EXPECT_EQ(peek(not_hello).status, Status::Malformed);
    auto zero_len = std::vector<uint8_t>{0x16, 0x03, 0x01, 0x00, 0x00};
    EXPECT_EQ(peek(zero_len).status, Status::Malformed);
    // A handshake length past the record's end, with a non-handshake record following.
    auto truncated = hello;
    truncated[8] = static_cast<uint8_t>(truncated[8] + 1);
    truncated.insert(truncated.end(), {0x17, 0x03, 0x03, 0x00, 0x01, 0x00});
    EXPECT_EQ(peek(truncated).status, Status::Malformed);
}

TEST(ClientHelloTest, OversizedClientHelloIsRejected) {
    std::vector<uint8_t> b{0x16, 0x03, 0x01, 0x00, 0x04, 0x01, 0x01, 0x00, 0x00};  // 64 KiB
    EXPECT_EQ(peek(b).status, Status::Malformed);
}

}  // namespace
}  // namespace egress::tls
