#include "proxy/logging.h"

#include <gtest/gtest.h>

#include <boost/json.hpp>

namespace egress::proxy {
namespace {

TEST(JsonLog, RequestIdentifiersBecomeFields) {
    auto line = json_log_line("t", "info", "conn=12 req=7 run=r1 GET a.test:443/x -> 200");
    auto v = boost::json::parse(line).as_object();
    EXPECT_EQ(v["conn_id"].to_number<uint64_t>(), 12u);
    EXPECT_EQ(v["req_id"].to_number<uint64_t>(), 7u);
    EXPECT_EQ(v["run"].as_string(), "r1");
    EXPECT_EQ(v["msg"].as_string(), "GET a.test:443/x -> 200");
    EXPECT_EQ(v["level"].as_string(), "info");
}

TEST(JsonLog, PlainMessagesAreEscaped) {
    auto line = json_log_line("t", "warn", "quote \" and newline \n and conn=x");
    auto v = boost::json::parse(line).as_object();
    EXPECT_EQ(v["msg"].as_string(), "quote \" and newline \n and conn=x");
    EXPECT_FALSE(v.contains("conn_id"));
    auto bad = boost::json::parse(json_log_line("t", "info", "conn=abc rest")).as_object();
    EXPECT_FALSE(bad.contains("conn_id"));
    EXPECT_EQ(bad["msg"].as_string(), "conn=abc rest");
}

// A request target's raw bytes reach log messages: the line stays valid UTF-8 JSON, with
// well-formed UTF-8 kept and a lone high byte read as Latin-1 (the audit record's rule).
TEST(JsonLog, RawHighBytesKeepTheLineValidUtf8) {
    auto line = json_log_line("t", "info", "conn=1 run=r\xff GET a.test:443/caf\xc3\xa9/\xff\xc3(");
    boost::system::error_code ec;
    auto v = boost::json::parse(line, ec);
    ASSERT_FALSE(ec) << line;
    EXPECT_EQ(v.as_object()["msg"].as_string(), "GET a.test:443/caf\xc3\xa9/\xc3\xbf\xc3\x83(");
    EXPECT_EQ(v.as_object()["run"].as_string(), "r\xc3\xbf");
}

}  // namespace
}  // namespace egress::proxy
