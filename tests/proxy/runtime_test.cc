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
    EXPECT_EQ(rt.find_by_source(ip("10.1.2.3")).run->policy.id, "narrow");
    EXPECT_EQ(rt.find_by_source(ip("10.9.9.9")).run->policy.id, "wide");
    EXPECT_EQ(rt.find_by_source(ip("fd00::5")).run->policy.id, "narrow");
    EXPECT_EQ(rt.find_by_source(ip("192.168.1.1")).run, nullptr);
}

TEST(FindBySource, TwoRunsTiedOnTheLongestPrefixMatchNeither) {
    Runtime rt;
    rt.runs["a"] = run_with("a", {"10.0.0.0/24", "10.0.0.7/32"});
    rt.runs["b"] = run_with("b", {"10.0.0.0/24"});
    EXPECT_EQ(rt.find_by_source(ip("10.0.0.7")).run->policy.id, "a");  // /32 beats the tie
    EXPECT_EQ(rt.find_by_source(ip("10.0.0.8")).run, nullptr);         // tied /24: ambiguous
}

TEST(FindBySource, TheSidecarRunServesAnySourceUnlessItIsBound) {
    Runtime rt;
    auto only = run_with("only", {});
    rt.runs["only"] = only;
    rt.anonymous = only;
    EXPECT_EQ(rt.find_by_source(ip("10.2.3.4")).run, only);
    only->sources.push_back(policy::Cidr::parse("10.9.0.0/16").value());
    EXPECT_EQ(rt.find_by_source(ip("10.2.3.4")).run, nullptr);
    EXPECT_EQ(rt.find_by_source(ip("10.9.1.1")).run, only);
}

// A source bound to a run that ended is refused with the end reason, not handed to a broader
// run that was there before or to the sidecar's; a run created after it takes it over, with
// the same range or a broader one.
TEST(FindBySource, AnEndedRunsRangeRefusesRatherThanFallsBack) {
    Runtime rt;
    auto only = run_with("only", {});
    rt.runs["wide"] = run_with("wide", {"10.0.0.0/8"});
    rt.runs["wide"]->dynamic = true;
    rt.runs["wide"]->created_at = 50;
    rt.anonymous = only;
    rt.ended["gone"] = {"sha", "run_revoked", {policy::Cidr::parse("10.1.2.3/32").value()}, 100};
    auto m = rt.find_by_source(ip("10.1.2.3"));
    EXPECT_EQ(m.run, nullptr);
    EXPECT_EQ(m.ended, "run_revoked");
    EXPECT_EQ(rt.find_by_source(ip("10.1.2.4")).run->policy.id, "wide");
    EXPECT_TRUE(rt.find_by_source(ip("10.1.2.4")).ended.empty());
    rt.runs.erase("wide");
    EXPECT_EQ(rt.find_by_source(ip("10.1.2.3")).ended, "run_revoked");  // not the sidecar's
    EXPECT_EQ(rt.find_by_source(ip("10.7.7.7")).run, only);
    auto again = run_with("again", {"10.1.0.0/16"});  // broader, but made after "gone"
    again->dynamic = true;
    again->created_at = 101;
    rt.runs["again"] = again;
    m = rt.find_by_source(ip("10.1.2.3"));
    ASSERT_NE(m.run, nullptr);
    EXPECT_EQ(m.run->policy.id, "again");
    EXPECT_TRUE(m.ended.empty());
    again->created_at = 100;  // made in the same second as "gone": not after it
    EXPECT_EQ(rt.find_by_source(ip("10.1.2.3")).ended, "run_revoked");
}

// A pin whose secret is missing refuses what the pin would cover, under the allow decision's
// port rule (its own port, else policy.allowed_ports), as secret_unavailable; the host on
// another port is port_not_allowed, as it is with the secret there.
TEST(DestinationRefusalReason, UnavailablePinsFollowThePortRule) {
    proxy::Run run;
    run.unavailable_pins.push_back({policy::HostPattern::parse("missing.test").value(), "p0",
                                    "missing.token", "/nowhere/missing.token"});
    run.unavailable_pins.push_back(
        {policy::HostPattern::parse("ported.test:8443").value(), "p1", "s", ""});
    policy::GlobalPolicy global;
    global.allowed_ports = {443};
    struct Case {
        policy::HostPort dest;
        std::string_view want;
        const char* pin;  // find_unavailable_pin's answer
    };
    for (const Case& c : {
             Case{{"missing.test", 443}, "secret_unavailable", "p0"},
             Case{{"missing.test", 22}, "port_not_allowed", nullptr},
             Case{{"ported.test", 8443}, "secret_unavailable", "p1"},
             Case{{"ported.test", 443}, "port_not_allowed", nullptr},
             Case{{"other.test", 443}, "host_not_allowed", nullptr},
         }) {
        const std::string what = c.dest.host + ":" + std::to_string(c.dest.port);
        EXPECT_EQ(destination_refusal_reason(run, global, c.dest, "host_not_allowed"), c.want)
            << what;
        const UnavailablePin* up = find_unavailable_pin(run, global, c.dest);
        if (c.pin == nullptr) {
            EXPECT_EQ(up, nullptr) << what;
        } else {
            ASSERT_NE(up, nullptr) << what;
            EXPECT_EQ(up->pin_id, c.pin) << what;
        }
        // Other reasons are the decision's own.
        EXPECT_EQ(destination_refusal_reason(run, global, c.dest, "host_denied"), "host_denied")
            << what;
    }
}

}  // namespace
}  // namespace egress::proxy
