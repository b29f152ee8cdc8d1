#include "proxy/runtime.h"

#include <gtest/gtest.h>

namespace egress::proxy {
namespace {

std::shared_ptr<Run> run_with(const std::string& id, std::vector<std::string> cidrs) {
    auto r = std::make_shared<Run>();
    r->policy.id = id;
    for (const auto& c : cidrs) {
        r->sources.push_back(policy::Cidr::parse(c).value());
    }
    return r;
}

policy::IpAddress ip(const char* s) { return policy::IpAddress::parse(s).value(); }

TEST(FindBySource, LongestPrefixWins) {
    Runtime rt;
    rt.runs["wide"] = run_with("wide", {"10.0.0.0/8"});
    rt.runs["narrow"] = run_with("narrow", {"10.1.2.0/24", "fd00::/64"});
    EXPECT_EQ(rt.find_by_source(ip("10.1.2.3"))->policy.id, "narrow");
    EXPECT_EQ(rt.find_by_source(ip("10.9.9.9"))->policy.id, "wide");
    EXPECT_EQ(rt.find_by_source(ip("fd00::5"))->policy.id, "narrow");
    EXPECT_EQ(rt.find_by_source(ip("192.168.1.1")), nullptr);
}

TEST(FindBySource, TwoRunsTiedOnTheLongestPrefixMatchNeither) {
    Runtime rt;
    rt.runs["a"] = run_with("a", {"10.0.0.0/24", "10.0.0.7/32"});
    rt.runs["b"] = run_with("b", {"10.0.0.0/24"});
    EXPECT_EQ(rt.find_by_source(ip("10.0.0.7"))->policy.id, "a");  // /32 beats the tie
    EXPECT_EQ(rt.find_by_source(ip("10.0.0.8")), nullptr);         // tied /24: ambiguous
}

TEST(FindBySource, TheSidecarRunServesAnySourceUnlessItIsBound) {
    Runtime rt;
    auto only = run_with("only", {});
    rt.runs["only"] = only;
    rt.anonymous = only;
    EXPECT_EQ(rt.find_by_source(ip("10.2.3.4")), only);
    only->sources.push_back(policy::Cidr::parse("10.9.0.0/16").value());
    EXPECT_EQ(rt.find_by_source(ip("10.2.3.4")), nullptr);
    EXPECT_EQ(rt.find_by_source(ip("10.9.1.1")), only);
}

}  // namespace
}  // namespace egress::proxy
