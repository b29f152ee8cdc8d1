#include "proxy/h1_parser.h"

#include <gtest/gtest.h>

#include <string>
#include <string_view>
#include <vector>

namespace egress::proxy {
namespace {

using Fields = std::vector<std::pair<std::string, std::string>>;

Fields pairs(const std::vector<policy::Header>& h) {
    Fields out;
    for (const auto& f : h) {
        out.emplace_back(f.name, f.value);
    }
    return out;
}

/// Feeds `wire` until the parser stops; returns the bytes consumed and leaves the error in ec.
template <bool isRequest>
size_t feed(H1Parser<isRequest>& p, std::string_view wire, error_code& ec) {
    size_t used = 0;
    while (used < wire.size() && !p.is_done()) {
        size_t n = p.put(net::buffer(wire.data() + used, wire.size() - used), ec);
        used += n;
        if (ec || n == 0) {
            break;
        }
    }
    return used;
}

TEST(H1Parser, RequestFieldsKeepTheWireOrderWithLowercaseNames) {
    H1RequestParser p;
    error_code ec;
    const std::string wire =
        "GET /a/b?q=1 HTTP/1.1\r\nHost: api.test\r\nX-A: 1\r\nX-B: 2\r\nx-a: 3\r\n"
        "Accept-Encoding: gzip\r\n\r\n";
    EXPECT_EQ(feed(p, wire, ec), wire.size());
    ASSERT_FALSE(ec) << ec.message();
    EXPECT_TRUE(p.is_done());  // no body
    EXPECT_EQ(p.method(), http::verb::get);
    EXPECT_EQ(p.method_string(), "GET");
    EXPECT_EQ(p.target(), "/a/b?q=1");
    EXPECT_EQ(p.version(), 11);
    // Beast's basic_fields would have grouped the two x-a lines; the wire order is kept.
    EXPECT_EQ(pairs(p.fields()), (Fields{{"host", "api.test"},
                                         {"x-a", "1"},
                                         {"x-b", "2"},
                                         {"x-a", "3"},
                                         {"accept-encoding", "gzip"}}));
    ASSERT_NE(p.find("X-B"), nullptr);
    EXPECT_EQ(*p.find("X-B"), "2");
    EXPECT_EQ(*p.find("x-a"), "1");  // the first
    EXPECT_EQ(p.find("x-none"), nullptr);
    EXPECT_TRUE(p.keep_alive());
    p.close();
    EXPECT_FALSE(p.keep_alive());
    EXPECT_EQ(p.take_target(), "/a/b?q=1");
    EXPECT_TRUE(p.target().empty());
}

TEST(H1Parser, ResponseNamesKeepTheirCase) {
    H1ResponseParser p;
    p.skip(true);  // a HEAD response: the header only
    error_code ec;
    const std::string wire =
        "HTTP/1.1 404 Not Here\r\nContent-Type: text/plain\r\nContent-Length: 9\r\n\r\n";
    EXPECT_EQ(feed(p, wire, ec), wire.size());
    ASSERT_FALSE(ec) << ec.message();
    EXPECT_EQ(p.status(), 404);
    EXPECT_EQ(p.reason(), "Not Here");
    EXPECT_EQ(pairs(p.fields()),
              (Fields{{"Content-Type", "text/plain"}, {"Content-Length", "9"}}));
    ASSERT_TRUE(p.content_length());
    EXPECT_EQ(*p.content_length(), 9u);
}

TEST(H1Parser, KeepAliveFollowsVersionConnectionAndFraming) {
    const std::vector<std::pair<std::string, bool>> cases{
        {"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", true},
        {"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n", false},
        {"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n", false},
        {"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n", true},
        {"HTTP/1.1 200 OK\r\n\r\n", false},  // close-delimited body
    };
    for (const auto& [wire, keep] : cases) {
        H1ResponseParser p;
        error_code ec;
        p.put(net::buffer(wire), ec);
        ASSERT_TRUE(!ec || ec == http::error::need_more) << wire << ec.message();
        EXPECT_EQ(p.keep_alive(), keep) << wire;
    }
}

TEST(H1Parser, BodyGoesIntoTheGivenRoomAndStopsWhenItIsFull) {
    H1RequestParser p;
    p.body_limit(boost::none);
    error_code ec;
    const std::string head = "POST /u HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\n";
    EXPECT_EQ(feed(p, head + "0123456789", ec), head.size());  // the header first
    ASSERT_TRUE(p.is_header_done());
    char room[4];
    std::string body;
    std::string_view rest = "0123456789";
    while (!p.is_done()) {
        p.body_buffer(room, sizeof room);
        size_t n = p.put(net::buffer(rest.data(), rest.size()), ec);
        rest.remove_prefix(n);
        body.append(room, sizeof room - p.body_room());
        ASSERT_TRUE(!ec || ec == http::error::need_buffer) << ec.message();
    }
    EXPECT_EQ(body, "0123456789");
    EXPECT_TRUE(rest.empty());

    H1RequestParser q;  // no room given: nothing is consumed
    feed(q, head, ec);
    ASSERT_FALSE(ec);
    EXPECT_EQ(q.put(net::buffer(std::string_view("0123")), ec), 0u);
    EXPECT_EQ(ec, http::error::need_buffer);
}

TEST(H1Parser, ChunkedTrailersAreKeptApartWithLowercaseNames) {
    H1ResponseParser p;
    p.body_limit(boost::none);
    error_code ec;
    const std::string wire =
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: Grpc-Status\r\n\r\n"
        "5\r\nhello\r\n0\r\nGrpc-Status: 0\r\nX-Sum: abc\r\n\r\n";
    char room[64];
    p.body_buffer(room, sizeof room);
    EXPECT_EQ(feed(p, wire, ec), wire.size());
    ASSERT_FALSE(ec) << ec.message();
    EXPECT_TRUE(p.is_done());
    EXPECT_EQ(std::string_view(room, sizeof room - p.body_room()), "hello");
    EXPECT_EQ(pairs(p.fields()),
              (Fields{{"Transfer-Encoding", "chunked"}, {"Trailer", "Grpc-Status"}}));
    EXPECT_EQ(pairs(p.trailers()), (Fields{{"grpc-status", "0"}, {"x-sum", "abc"}}));
}

TEST(H1Parser, BeastStillRefusesSmugglingShapes) {
    // The syntax and framing checks are Beast's basic_parser's, unchanged by our storage.
    for (const std::string wire : {
             "GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
             "GET / HTTP/1.1\r\nHost : a\r\n\r\n",
             "GET / HTTP/1.1\r\nHo st: a\r\n\r\n",
             "GET / HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n",
         }) {
        H1RequestParser p;
        error_code ec;
        feed(p, wire, ec);
        EXPECT_TRUE(ec && ec != http::error::need_more) << wire;
    }
}

}  // namespace
}  // namespace egress::proxy
