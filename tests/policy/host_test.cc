#include "policy/host.h"

#include <gtest/gtest.h>

namespace egress::policy {
namespace {

struct NormalizeCase {
    std::string input;
    std::string want;  // "" means refused
};

class NormalizeHostTest : public ::testing::TestWithParam<NormalizeCase> {};

TEST_P(NormalizeHostTest, Normalizes) {
    const NormalizeCase& c = GetParam();
    Result<std::string> got = normalize_host(c.input);
    if (c.want.empty()) {
        EXPECT_FALSE(got.ok()) << "accepted " << c.input << " as " << (got ? *got : "");
    } else {
        ASSERT_TRUE(got.ok()) << c.input << ": " << got.error();
        EXPECT_EQ(*got, c.want);
    }
}

INSTANTIATE_TEST_SUITE_P(
    Table, NormalizeHostTest,
    ::testing::Values(
        // Case and one trailing dot.
        NormalizeCase{"api.github.com", "api.github.com"},
        NormalizeCase{"API.GitHub.COM", "api.github.com"},
        NormalizeCase{"api.github.com.", "api.github.com"}, NormalizeCase{"api.github.com..", ""},
        NormalizeCase{".", ""}, NormalizeCase{"", ""}, NormalizeCase{"a..b", ""},
        NormalizeCase{".a.b", ""}, NormalizeCase{"localhost", "localhost"},
        NormalizeCase{"_dmarc.example.com", "_dmarc.example.com"},
        NormalizeCase{"a-b.example", "a-b.example"}, NormalizeCase{"-a.example", ""},
        NormalizeCase{"a-.example", ""}, NormalizeCase{"a b.example", ""},
        NormalizeCase{"a*b.example", ""}, NormalizeCase{"a/b.example", ""},
        // IDN: punycode accepted, raw UTF-8 refused.
        NormalizeCase{"xn--bcher-kva.example", "xn--bcher-kva.example"},
        NormalizeCase{"XN--BCHER-KVA.example", "xn--bcher-kva.example"},
        NormalizeCase{"b\xc3\xbc"
                      "cher.example",
                      ""},
        // Userinfo and percent escapes.
        NormalizeCase{"user@api.github.com", ""}, NormalizeCase{"api%2egithub.com", ""},
        // Lengths.
        NormalizeCase{std::string(63, 'a') + ".test", std::string(63, 'a') + ".test"},
        NormalizeCase{std::string(64, 'a') + ".test", ""},
        // IPv4: canonical dotted quad only.
        NormalizeCase{"127.0.0.1", "127.0.0.1"}, NormalizeCase{"8.8.8.8.", "8.8.8.8"},
        NormalizeCase{"2130706433", ""}, NormalizeCase{"0x7f.1", ""},
        NormalizeCase{"0x7f000001", ""}, NormalizeCase{"127.1", ""}, NormalizeCase{"127.0.1", ""},
        NormalizeCase{"0177.0.0.1", ""}, NormalizeCase{"127.000.0.1", ""},
        NormalizeCase{"256.0.0.1", ""}, NormalizeCase{"1.2.3.4.5", ""},
        NormalizeCase{"example.123", ""}, NormalizeCase{"123.example", "123.example"},
        // IPv6: bracketed or bare, canonical inet_ntop form.
        NormalizeCase{"[::1]", "::1"}, NormalizeCase{"::1", "::1"},
        NormalizeCase{"[2001:DB8:0:0::1]", "2001:db8::1"},
        NormalizeCase{"[::ffff:127.0.0.1]", "::ffff:127.0.0.1"},
        NormalizeCase{"[fe80::1%eth0]", ""}, NormalizeCase{"[::1", ""}, NormalizeCase{"[]", ""},
        NormalizeCase{"[1.2.3.4]", ""}, NormalizeCase{"1:2", ""}));

TEST(NormalizeHost, NameLengthLimit) {
    std::string name;
    for (int i = 0; i < 25; ++i) {
        name += "abcdefghi.";
    }
    name += "abc";  // 253 bytes
    ASSERT_EQ(name.size(), 253U);
    EXPECT_TRUE(normalize_host(name).ok());
    EXPECT_FALSE(normalize_host(name + "x").ok());
    EXPECT_TRUE(normalize_host(name + ".").ok());  // the trailing dot does not count
}

struct AuthorityCase {
    std::string input;
    std::optional<uint16_t> default_port;
    bool ok;
    std::string host;
    uint16_t port;
};

class ParseAuthorityTest : public ::testing::TestWithParam<AuthorityCase> {};

TEST_P(ParseAuthorityTest, Parses) {
    const AuthorityCase& c = GetParam();
    Result<HostPort> got = parse_authority(c.input, c.default_port);
    ASSERT_EQ(got.ok(), c.ok) << c.input;
    if (c.ok) {
        EXPECT_EQ(got->host, c.host);
        EXPECT_EQ(got->port, c.port);
    }
}

INSTANTIATE_TEST_SUITE_P(
    Table, ParseAuthorityTest,
    ::testing::Values(AuthorityCase{"api.github.com:443", std::nullopt, true, "api.github.com",
                                    443},
                      AuthorityCase{"API.github.com.:8443", 443, true, "api.github.com", 8443},
                      AuthorityCase{"api.github.com", 443, true, "api.github.com", 443},
                      AuthorityCase{"api.github.com", std::nullopt, false, "", 0},
                      AuthorityCase{"[::1]:8080", std::nullopt, true, "::1", 8080},
                      AuthorityCase{"[::1]", 443, true, "::1", 443},
                      AuthorityCase{"::1:443", std::nullopt, false, "", 0},
                      AuthorityCase{"[::1]x", 443, false, "", 0},
                      AuthorityCase{"host:0", std::nullopt, false, "", 0},
                      AuthorityCase{"host:65535", std::nullopt, true, "host", 65535},
                      AuthorityCase{"host:65536", std::nullopt, false, "", 0},
                      AuthorityCase{"host:99999999999", std::nullopt, false, "", 0},
                      AuthorityCase{"host:", 443, false, "", 0},
                      AuthorityCase{"host:https", std::nullopt, false, "", 0},
                      AuthorityCase{"host:-1", std::nullopt, false, "", 0},
                      AuthorityCase{"user:pw@host:443", std::nullopt, false, "", 0},
                      AuthorityCase{"evil.test@good.test", 443, false, "", 0},
                      AuthorityCase{"", 443, false, "", 0},
                      AuthorityCase{"2130706433:80", std::nullopt, false, "", 0},
                      AuthorityCase{"127.0.0.1:8080", std::nullopt, true, "127.0.0.1", 8080}));

// spells_target is the request path's shortcut past parse_authority: whenever it says yes,
// the parse must give the target; the spellings it leaves to the parse are listed too.
TEST(SpellsTarget, YesOnlyWhereTheParseAgrees) {
    const HostPort name{"api.github.com", 443};
    const HostPort quad{"127.0.0.1", 8443};
    const HostPort v6{"::1", 443};
    struct Case {
        std::string authority;
        HostPort target;
        uint16_t default_port;
        bool spelled;
    };
    for (const Case& c : std::vector<Case>{
             {"api.github.com", name, 443, true},
             {"api.github.com:443", name, 443, true},
             {"api.github.com:443", name, 80, true},
             {"api.github.com", name, 80, false},        // the parse gives port 80: a mismatch
             {"API.github.com", name, 443, false},       // same target, left to the parse
             {"api.github.com.", name, 443, false},      // same target, left to the parse
             {"api.github.com:0443", name, 443, false},  // same target, left to the parse
             {"api.github.com:4430", name, 443, false},
             {"api.github.com:44", name, 443, false},
             {"api.github.com:", name, 443, false},
             {"api.github.com.evil.test", name, 443, false},
             {"api.github.co", name, 443, false},
             {"", name, 443, false},
             {"127.0.0.1:8443", quad, 443, true},
             {"127.0.0.1", quad, 443, false},
             {"127.0.0.1:8443x", quad, 443, false},
             {"[::1]", v6, 443, false},  // IPv6 always takes the parse
             {"::1", v6, 443, false},
             {"::1:443", v6, 443, false},
         }) {
        EXPECT_EQ(spells_target(c.authority, c.target, c.default_port), c.spelled) << c.authority;
        if (c.spelled) {
            Result<HostPort> parsed = parse_authority(c.authority, c.default_port);
            ASSERT_TRUE(parsed.ok()) << c.authority;
            EXPECT_EQ(*parsed, c.target) << c.authority;
        }
    }
    // Every target the parse produces is spelled by its own authority() text (except IPv6,
    // which is bracketed there and left to the parse).
    for (const char* a : {"a.test:1", "xn--bcher-kva.example:65535", "10.0.0.1:80", "_svc.a.b:443"}) {
        Result<HostPort> t = parse_authority(a, std::nullopt);
        ASSERT_TRUE(t.ok()) << a;
        EXPECT_TRUE(spells_target(t->authority(), *t, 443)) << a;
    }
}

TEST(HostPort, Authority) {
    EXPECT_EQ((HostPort{"a.test", 443}).authority(), "a.test:443");
    EXPECT_EQ((HostPort{"::1", 8443}).authority(), "[::1]:8443");
    EXPECT_TRUE((HostPort{"::1", 1}).is_ipv6_literal());
    EXPECT_FALSE((HostPort{"1.2.3.4", 1}).is_ipv6_literal());
}

TEST(HostPattern, RefusesBadPatterns) {
    for (const char* bad :
         {"*", "*.com", "*.com.", "a.*.b", "*a.b", "**.a.b", "*.*.a.b", "a.b.*", "*.", "",
          "*.1.2.3.4", "*.[::1]", "a.b:0", "a.b:x", "user@a.b", "b\xc3\xbc.test"}) {
        EXPECT_FALSE(HostPattern::parse(bad).ok()) << bad;
    }
}

TEST(HostPattern, SubtreeScopeForDenyLists) {
    using Scope = HostPattern::Scope;
    // Broad wildcards are refused for allow lists but fine for deny lists...
    EXPECT_FALSE(HostPattern::parse("*.internal").ok());
    Result<HostPattern> d = HostPattern::parse("*.internal", Scope::Subtree);
    ASSERT_TRUE(d.ok()) << d.error();
    // ... where a wildcard covers every depth below its suffix, never the suffix itself.
    EXPECT_TRUE(d->matches_host("a.internal"));
    EXPECT_TRUE(d->matches_host("metadata.google.internal"));
    EXPECT_FALSE(d->matches_host("internal"));
    EXPECT_FALSE(d->matches_host("notinternal"));
    EXPECT_FALSE(d->matches_host("a.internal.test"));
    Result<HostPattern> allow = HostPattern::parse("*.a.test");
    ASSERT_TRUE(allow.ok());
    EXPECT_FALSE(allow->matches_host("x.y.a.test"));  // one label only for allow lists
    // What is malformed stays malformed in either scope.
    for (const char* bad : {"*", "*.", "a.*.b", "*.1.2.3.4", "a.b:0", ""}) {
        EXPECT_FALSE(HostPattern::parse(bad, Scope::Subtree).ok()) << bad;
    }
}

TEST(HostPattern, ParsesAndNormalizes) {
    Result<HostPattern> p = HostPattern::parse("*.S3.AmazonAWS.com.:8443");
    ASSERT_TRUE(p.ok()) << p.error();
    EXPECT_TRUE(p->wildcard());
    EXPECT_EQ(p->port(), 8443);
    EXPECT_EQ(p->text(), "*.s3.amazonaws.com:8443");

    Result<HostPattern> v6 = HostPattern::parse("[::1]:9000");
    ASSERT_TRUE(v6.ok()) << v6.error();
    EXPECT_EQ(v6->text(), "[::1]:9000");
    EXPECT_TRUE(v6->matches(HostPort{"::1", 9000}));
    EXPECT_FALSE(v6->matches(HostPort{"::1", 9001}));

    Result<HostPattern> ip = HostPattern::parse("127.0.0.1");
    ASSERT_TRUE(ip.ok());
    EXPECT_FALSE(ip->wildcard());
    EXPECT_EQ(ip->port(), std::nullopt);
}

struct MatchCase {
    std::string pattern;
    std::string host;
    uint16_t port;
    bool want;
};

class HostPatternMatchTest : public ::testing::TestWithParam<MatchCase> {};

TEST_P(HostPatternMatchTest, Matches) {
    const MatchCase& c = GetParam();
    Result<HostPattern> p = HostPattern::parse(c.pattern);
    ASSERT_TRUE(p.ok()) << c.pattern << ": " << p.error();
    EXPECT_EQ(p->matches(HostPort{c.host, c.port}), c.want) << c.pattern << " vs " << c.host;
}

INSTANTIATE_TEST_SUITE_P(
    Table, HostPatternMatchTest,
    ::testing::Values(
        MatchCase{"api.github.com", "api.github.com", 443, true},
        MatchCase{"api.github.com", "api.github.com", 8443, true},
        MatchCase{"api.github.com", "github.com", 443, false},
        MatchCase{"api.github.com", "x.api.github.com", 443, false},
        MatchCase{"api.github.com", "api.github.com.evil", 443, false},
        MatchCase{"*.a.test", "b.a.test", 443, true}, MatchCase{"*.a.test", "a.test", 443, false},
        MatchCase{"*.a.test", "x.y.a.test", 443, false},
        MatchCase{"*.a.test", "ba.test", 443, false}, MatchCase{"*.a.test", ".a.test", 443, false},
        MatchCase{"*.a.test", "b.a.test.evil", 443, false},
        MatchCase{"*.a.test:8443", "b.a.test", 8443, true},
        MatchCase{"*.a.test:8443", "b.a.test", 443, false},
        MatchCase{"a.test:80", "a.test", 80, true}, MatchCase{"a.test:80", "a.test", 443, false}));

}  // namespace
}  // namespace egress::policy
