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

}  // namespace
}  // namespace egress::proxy
