#include "policy/request_head.h"

#include <gtest/gtest.h>

namespace egress::policy {
namespace {

RequestHead sample() {
    RequestHead h;
    h.method = "GET";
    h.scheme = "https";
    h.authority = "a.test";
    h.path = "/x/y?q=1&r=/z";
    h.headers = {{"accept", "*/*"}, {"authorization", "one"}, {"authorization", "two"}};
    return h;
}

TEST(RequestHead, FindCountRemoveSet) {
    RequestHead h = sample();
    ASSERT_NE(h.find("authorization"), nullptr);
    EXPECT_EQ(*h.find("authorization"), "one");
    EXPECT_EQ(*h.find("Authorization"), "one");
    EXPECT_EQ(h.find("cookie"), nullptr);
    EXPECT_EQ(h.count("authorization"), 2U);
    EXPECT_EQ(h.count("cookie"), 0U);

    h.set("Authorization", "three");
    EXPECT_EQ(h.count("authorization"), 1U);
    EXPECT_EQ(*h.find("authorization"), "three");
    EXPECT_EQ(h.headers.back().name, "authorization");

    EXPECT_EQ(h.remove("accept"), 1U);
    EXPECT_EQ(h.remove("accept"), 0U);
    EXPECT_EQ(h.headers.size(), 1U);
}

TEST(RequestHead, PathOnly) {
    RequestHead h = sample();
    EXPECT_EQ(h.path_only(), "/x/y");
    h.path = "/plain";
    EXPECT_EQ(h.path_only(), "/plain");
    h.path = "/?";
    EXPECT_EQ(h.path_only(), "/");
    h.path = "";
    EXPECT_EQ(h.path_only(), "");
}

TEST(RequestHead, WipeInjectedZeroesOnlyTheInjectedField) {
    RequestHead h;
    h.headers = {{"x-api-key", "Key s3cr3t-value-longer-than-sso"},
                 {"accept", "*/*"},
                 {"x-api-key", "k2"}};
    h.wipe_injected();  // nothing injected: nothing touched
    EXPECT_EQ(h.headers[0].value, "Key s3cr3t-value-longer-than-sso");
    h.never_index = "x-api-key";
    const char* storage = h.headers[0].value.data();
    h.wipe_injected();
    EXPECT_EQ(h.headers[0].value.data(), storage);  // in place, not a new buffer
    EXPECT_EQ(h.headers[0].value, std::string(32, '\0'));
    EXPECT_EQ(h.headers[2].value, std::string(2, '\0'));
    EXPECT_EQ(h.headers[1].value, "*/*");
}

TEST(RequestHead, AsciiHelpers) {
    EXPECT_EQ(ascii_lower("Content-TYPE"), "content-type");
    EXPECT_EQ(ascii_lower("\xc3\x84"), "\xc3\x84");  // non-ASCII untouched
    EXPECT_TRUE(iequals("X-Egress-Run", "x-egress-run"));
    EXPECT_FALSE(iequals("abc", "abcd"));
    EXPECT_FALSE(iequals("abc", "abd"));
    EXPECT_TRUE(iequals("", ""));
}

}  // namespace
}  // namespace egress::policy
