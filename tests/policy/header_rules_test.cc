#include "policy/header_rules.h"

#include <gtest/gtest.h>

namespace egress::policy {
namespace {

struct NameCase {
    std::string name;
    bool hop_by_hop;
    bool transport;
    bool egress;
};

class HeaderNameTest : public ::testing::TestWithParam<NameCase> {};

TEST_P(HeaderNameTest, Classifies) {
    const NameCase& c = GetParam();
    EXPECT_EQ(is_hop_by_hop(c.name), c.hop_by_hop) << c.name;
    EXPECT_EQ(is_transport_header(c.name), c.transport) << c.name;
    EXPECT_EQ(is_egress_namespace(c.name), c.egress) << c.name;
}

INSTANTIATE_TEST_SUITE_P(
    Table, HeaderNameTest,
    ::testing::Values(
        NameCase{"connection", true, true, false}, NameCase{"Connection", true, true, false},
        NameCase{"keep-alive", true, true, false}, NameCase{"proxy-connection", true, true, false},
        NameCase{"proxy-authorization", true, true, false},
        NameCase{"Proxy-Authenticate", true, true, false}, NameCase{"te", true, true, false},
        NameCase{"trailer", true, true, false}, NameCase{"transfer-encoding", true, true, false},
        NameCase{"upgrade", true, true, false}, NameCase{"host", false, true, false},
        NameCase{"content-length", false, true, false}, NameCase{":authority", false, true, false},
        NameCase{":path", false, true, false}, NameCase{"x-egress-run", false, true, true},
        NameCase{"X-Egress-Reason", false, true, true}, NameCase{"x-egress", false, false, false},
        NameCase{"authorization", false, false, false}, NameCase{"x-api-key", false, false, false},
        NameCase{"proxy", false, false, false}, NameCase{"accept-encoding", false, false, false},
        // every length the by-length check branches on, in other cases and near misses
        NameCase{"TE", true, true, false}, NameCase{"tf", false, false, false},
        NameCase{"UPGRADE", true, true, false}, NameCase{"Trailer", true, true, false},
        NameCase{"trailers", false, false, false}, NameCase{"upgradf", false, false, false},
        NameCase{"KEEP-ALIVE", true, true, false}, NameCase{"connectiom", false, false, false},
        NameCase{"Transfer-Encoding", true, true, false},
        NameCase{"transfer-encodinh", false, false, false}, NameCase{"proxy-", true, true, false},
        NameCase{"Proxy-Connection", true, true, false}, NameCase{"", false, false, false},
        // "proxy-" names of every length the check branches on (7, 10, 17 bytes)
        NameCase{"proxy-x", true, true, false}, NameCase{"Proxy-abcd", true, true, false},
        NameCase{"proxy-abcdefghijk", true, true, false}));

// The tchar table against RFC 9110's definition, byte by byte.
TEST(HeaderRules, NameBytesAreExactlyTchar) {
    const std::string_view specials = "!#$%&'*+-.^_`|~";
    for (int c = 0; c < 256; ++c) {
        const char ch = static_cast<char>(c);
        const bool tchar = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                           (c >= '0' && c <= '9') || specials.find(ch) != std::string_view::npos;
        EXPECT_EQ(valid_header_name(std::string_view(&ch, 1)), tchar) << c;
        EXPECT_EQ(valid_header_name(std::string("x") + ch + "y"), tchar) << c;
    }
}

TEST(HeaderRules, ValidName) {
    EXPECT_TRUE(valid_header_name("x-api-key"));
    EXPECT_TRUE(valid_header_name("X_Weird!#$%&'*+.^`|~1"));
    for (const char* bad :
         {"", "a b", "a:b", ":path", "a\r\nb", "a/b", "a\"b", "a(b", "\xc3\xa4"}) {
        EXPECT_FALSE(valid_header_name(bad)) << bad;
    }
    EXPECT_FALSE(valid_header_name(std::string_view("a\0b", 3)));
}

TEST(HeaderRules, ValidValue) {
    EXPECT_TRUE(valid_header_value(""));
    EXPECT_TRUE(valid_header_value("Bearer abc.def"));
    EXPECT_TRUE(valid_header_value("a\tb"));
    EXPECT_TRUE(valid_header_value("caf\xc3\xa9"));  // obs-text
    for (const char* bad : {"a\rb", "a\nb", "a\r\nX-Evil: 1", "\x01", "a\x7f"}) {
        EXPECT_FALSE(valid_header_value(bad)) << bad;
    }
    EXPECT_FALSE(valid_header_value(std::string_view("a\0b", 3)));
}

RequestHead head_with(std::vector<Header> headers) {
    RequestHead h;
    h.method = "GET";
    h.scheme = "https";
    h.authority = "a.test";
    h.path = "/";
    h.headers = std::move(headers);
    return h;
}

TEST(StripHopByHop, RemovesHopByHopAndProxyHeaders) {
    RequestHead h = head_with({{"accept", "*/*"},
                               {"connection", "keep-alive, X-Custom ,x-other"},
                               {"keep-alive", "timeout=5"},
                               {"proxy-authorization", "Basic abc"},
                               {"proxy-connection", "keep-alive"},
                               {"x-custom", "1"},
                               {"x-other", "2"},
                               {"transfer-encoding", "chunked"},
                               {"upgrade", "h2c"},
                               {"te", "gzip"},
                               {"trailer", "x"},
                               {"user-agent", "curl"}});
    EXPECT_EQ(strip_hop_by_hop(h), 10U);
    ASSERT_EQ(h.headers.size(), 2U);
    EXPECT_EQ(h.headers[0].name, "accept");
    EXPECT_EQ(h.headers[1].name, "user-agent");
}

TEST(StripHopByHop, TeTrailersKeptOnlyWhenAsked) {
    RequestHead h1 = head_with({{"te", "trailers"}, {"connection", "te"}});
    EXPECT_EQ(strip_hop_by_hop(h1, true), 1U);
    ASSERT_EQ(h1.headers.size(), 1U);
    EXPECT_EQ(h1.headers[0].value, "trailers");

    RequestHead h2 = head_with({{"te", "trailers"}});
    EXPECT_EQ(strip_hop_by_hop(h2, false), 1U);
    EXPECT_TRUE(h2.headers.empty());

    RequestHead h3 = head_with({{"te", "gzip, trailers"}});
    EXPECT_EQ(strip_hop_by_hop(h3, true), 1U);
}

TEST(StripHopByHop, ManyConnectionTokensAreMatchedAsFewAre) {
    // Over eight tokens the list is split and sorted once (fields x tokens would be quadratic
    // in the head's size): the same names go, in any case and with any spacing, in two
    // Connection fields; framing stays; a name that is only a token's prefix stays.
    std::string many = "a0";
    for (int i = 1; i < 40; ++i) {
        many += (i % 2 ? " , A" : ",a") + std::to_string(i);
    }
    RequestHead h = head_with({{"connection", many},
                               {"connection", "\tX-Custom\t"},
                               {"a7", "1"},
                               {"A39", "2"},
                               {"x-custom", "3"},
                               {"a4", "4"},
                               {"a400", "kept: a prefix match only"},
                               {"content-length", "5"},
                               {"accept", "*/*"}});
    EXPECT_EQ(strip_hop_by_hop(h), 6U);
    ASSERT_EQ(h.headers.size(), 3U);
    EXPECT_EQ(h.headers[0].name, "a400");
    EXPECT_EQ(h.headers[1].name, "content-length");
    EXPECT_EQ(h.headers[2].name, "accept");
}

TEST(StripHopByHop, ConnectionCannotStripFraming) {
    RequestHead h = head_with({{"connection", "content-length"}, {"content-length", "5"}});
    EXPECT_EQ(strip_hop_by_hop(h), 1U);
    EXPECT_EQ(h.count("content-length"), 1U);
}

TEST(StripHopByHop, ConnectionCannotStripTheContentEncoding) {
    // An upstream's "Connection: Content-Encoding" would hide a gzip body from the check that
    // refuses encoded bodies the scrubber cannot read.
    std::vector<Header> h = {{"Connection", "Content-Encoding"},
                             {"Content-Encoding", "gzip"},
                             {"Content-Length", "82"}};
    EXPECT_EQ(strip_hop_by_hop(h), 1U);
    ASSERT_NE(find_header(h, "content-encoding"), nullptr);
    EXPECT_EQ(*find_header(h, "content-encoding"), "gzip");
}

TEST(StripHopByHop, ConnectionTokensMatchWholeNamesInAnyCase) {
    // A response as an HTTP/1.1 upstream sends it (names in their own case). "x-update" names
    // X-Update only: Update and Date (both inside "x-update") stay.
    std::vector<Header> h = {{"Date", "Tue"},
                             {"Connection", "X-Update , keep-alive"},
                             {"X-Update", "1"},
                             {"Update", "2"},
                             {"Keep-Alive", "timeout=5"},
                             {"Content-Type", "text/plain"}};
    EXPECT_EQ(strip_hop_by_hop(h), 3U);
    ASSERT_EQ(h.size(), 3U);
    EXPECT_EQ(h[0].name, "Date");
    EXPECT_EQ(h[1].name, "Update");
    EXPECT_EQ(h[2].name, "Content-Type");
}

TEST(StripHopByHop, NothingToStrip) {
    RequestHead h = head_with({{"accept", "*/*"}});
    EXPECT_EQ(strip_hop_by_hop(h), 0U);
    EXPECT_EQ(h.headers.size(), 1U);
}

}  // namespace
}  // namespace egress::policy

namespace egress::policy {
namespace {

TEST(AsksWebsocket, NeedsBothTheUpgradeAndTheConnectionToken) {
    using H = std::vector<Header>;
    EXPECT_TRUE(asks_websocket(H{{"upgrade", "websocket"}, {"connection", "Upgrade"}}));
    EXPECT_TRUE(asks_websocket(H{{"Upgrade", "WebSocket"}, {"Connection", "keep-alive, upgrade"}}));
    EXPECT_TRUE(asks_websocket(
        H{{"connection", "keep-alive"}, {"upgrade", "h2c, websocket"}, {"connection", "upgrade"}}));
    EXPECT_FALSE(asks_websocket(H{{"upgrade", "websocket"}}));  // Connection must name it
    EXPECT_FALSE(asks_websocket(H{{"connection", "upgrade"}}));
    EXPECT_FALSE(asks_websocket(H{{"upgrade", "h2c"}, {"connection", "upgrade"}}));
    EXPECT_FALSE(asks_websocket(H{{"upgrade", "websockets"}, {"connection", "upgrade"}}));
    EXPECT_FALSE(asks_websocket(H{{"upgrade", "websocket"}, {"connection", "upgrades"}}));
    EXPECT_FALSE(asks_websocket(H{{"x-upgrade", "websocket"}, {"connection", "upgrade"}}));
}

}  // namespace
}  // namespace egress::policy
