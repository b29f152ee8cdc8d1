#include "policy/run_policy.h"

#include "policy/scrubber.h"

#include <gtest/gtest.h>

#include <chrono>

namespace egress::policy {
namespace {

using std::chrono::minutes;

const TimePoint kNow = TimePoint{} + std::chrono::hours(1000);

HostPattern pattern(std::string_view text) {
    Result<HostPattern> p = HostPattern::parse(text);
    EXPECT_TRUE(p.ok()) << text;
    return p.ok() ? *p : HostPattern{};
}

Pin make_pin(std::string id, std::string_view host, std::vector<std::string> prefixes = {},
             std::vector<std::string> methods = {}) {
    Pin pin;
    pin.id = std::move(id);
    pin.host = pattern(host);
    pin.path_prefixes = std::move(prefixes);
    pin.methods = std::move(methods);
    pin.secret_name = "tok";
    pin.secret = std::make_shared<const credstore::SecretValue>("s3cr3t");
    return pin;
}

// A secret with bytes a URL or a JSON string escapes is also searched for in those forms
// (an upstream that echoes the request's Authorization in a redirect's query, or PHP's
// json_encode of the request headers); a plain token adds no needle.
TEST(MakeInjection, SearchesTheEchoFormsOfASecret) {
    const std::string secret = "wJal/rXU+tnF\\\"EMI=";  // wJal/rXU+tnF\"EMI=
    auto inj = make_injection(InjectSpec{}, credstore::SecretValue(secret));
    Scrubber s(inj->scrub);
    const std::string forms[] = {
        "wJal%2FrXU%2BtnF%5C%22EMI%3D", "wJal%2frXU%2btnF%5c%22EMI%3d",
        "wJal/rXU+tnF\\\\\\\"EMI=", "wJal\\/rXU+tnF\\\\\\\"EMI=", secret, "Bearer " + secret};
    for (size_t i = 0; i < std::size(forms); ++i) {  // (failures name the form's index only)
        const std::string body = "{\"seen\": \"" + forms[i] + "\"}";
        const std::string out = s.scrub_value(body);
        EXPECT_TRUE(out.find(forms[i]) == std::string::npos) << "form " << i;
        EXPECT_EQ(out.size(), body.size()) << "form " << i;
        EXPECT_TRUE(out.find("[REDACTED") != std::string::npos) << "form " << i;
    }
    auto plain = make_injection(InjectSpec{}, credstore::SecretValue("ghp_abc-DEF.1_2"));
    EXPECT_EQ(plain->scrub->needles().size(), 2U);  // the secret and "Bearer <secret>"
    auto tilde = make_injection(InjectSpec{}, credstore::SecretValue("ghp_abc-DEF.1~2"));
    EXPECT_EQ(tilde->scrub->needles().size(), 3U);  // and "%7E" as PHP and Java encode '~'
}

// The encoders upstreams echo with do not all encode the same bytes: Python's quote keeps '/',
// JavaScript's encodeURIComponent "!'()*", Go's PathEscape "$&+:=@" and URL.EscapedPath
// "$&+,/:;=@", a form field writes a
// space as '+'; Go's encoding/json writes '&' '<' '>' as \u0026..., Python's json.dumps and
// PHP's json_encode non-ASCII as \uXXXX. Each such echo is scrubbed.
TEST(MakeInjection, SearchesWhatTheCommonEncodersMakeOfASecret) {
    const std::string secret = "a/b+c=d&e!f(g) h\xc3\xa9i\xf0\x9f\x98\x80j";  // ...é...😀
    auto inj = make_injection(InjectSpec{}, credstore::SecretValue(secret));
    Scrubber s(inj->scrub);
    const std::string forms[] = {
        "a/b%2Bc%3Dd%26e%21f%28g%29%20h%C3%A9i%F0%9F%98%80j",    // Python quote
        "a/b%2bc%3dd%26e%21f%28g%29%20h%c3%a9i%f0%9f%98%80j",    // the same, lowercase hex
        "a%2Fb%2Bc%3Dd%26e!f(g)%20h%C3%A9i%F0%9F%98%80j",        // encodeURIComponent
        "a%2Fb+c=d&e%21f%28g%29%20h%C3%A9i%F0%9F%98%80j",        // Go PathEscape
        "a/b+c=d&e%21f%28g%29%20h%C3%A9i%F0%9F%98%80j",          // Go URL.EscapedPath
        "a%2Fb%2Bc%3Dd%26e%21f%28g%29+h%C3%A9i%F0%9F%98%80j",    // a form field (space as '+')
        "a/b+c=d\\u0026e!f(g) h\xc3\xa9i\xf0\x9f\x98\x80j",          // Go encoding/json
        "a/b+c=d&e!f(g) h\\u00e9i\\ud83d\\ude00j",                   // Python json.dumps
        "a\\/b+c=d&e!f(g) h\\u00e9i\\ud83d\\ude00j",               // PHP json_encode
        "a/b\\u002Bc=d\\u0026e!f(g) h\\u00E9i\\uD83D\\uDE00j",       // .NET System.Text.Json
    };
    for (size_t i = 0; i < std::size(forms); ++i) {  // (failures name the form's index only)
        const std::string body = "{\"seen\": \"" + forms[i] + "\"}";
        const std::string out = s.scrub_value(body);
        EXPECT_TRUE(out.find(forms[i]) == std::string::npos) << "form " << i;
        EXPECT_EQ(out.size(), body.size()) << "form " << i;
    }
    EXPECT_LE(inj->scrub->needles().size(), 2U + 20U);
    // '~' as PHP's urlencode and Java's URLEncoder write it (Java leaves '*').
    for (const auto& [token, echoed] : {std::pair<std::string, std::string>{"abc~def", "abc%7Edef"},
                                        {"a*b~c d", "a*b%7Ec+d"},
                                        {"a*b~c d", "a%2Ab%7Ec+d"}}) {
        auto t = make_injection(InjectSpec{}, credstore::SecretValue(token));
        Scrubber st(t->scrub);
        EXPECT_EQ(st.scrub_value("/x?t=" + echoed).find(echoed), std::string::npos) << echoed;
    }
    // DEL as Python's json.dumps writes it.
    auto del = make_injection(InjectSpec{}, credstore::SecretValue("del\x7fsecret"));
    Scrubber sd(del->scrub);
    const std::string body = "{\"seen\": \"del\\u007fsecret\"}";
    EXPECT_EQ(sd.scrub_value(body).find("del\\u007fsecret"), std::string::npos);
}

TEST(ValidateInjection, AcceptsAndLowercases) {
    InjectSpec h;
    h.type = InjectType::Header;
    h.header_name = "X-Api-Key";
    h.value_template = "token {secret}";
    Result<InjectSpec> v = validate_injection(h);
    ASSERT_TRUE(v.ok()) << v.error();
    EXPECT_EQ(v->header_name, "x-api-key");

    EXPECT_TRUE(validate_injection(InjectSpec{}).ok());
    InjectSpec b;
    b.type = InjectType::Basic;
    b.username = "x-access-token";
    EXPECT_TRUE(validate_injection(b).ok());
    b.username = "";
    EXPECT_TRUE(validate_injection(b).ok());
}

struct BadInjection {
    InjectType type;
    std::string name;
    std::string value_template;
    std::string username;
    std::string field;  // expected prefix of the error
};

class ValidateInjectionBad : public ::testing::TestWithParam<BadInjection> {};

TEST_P(ValidateInjectionBad, Refuses) {
    const BadInjection& c = GetParam();
    InjectSpec spec;
    spec.type = c.type;
    spec.header_name = c.name;
    spec.value_template = c.value_template;
    spec.username = c.username;
    Result<InjectSpec> v = validate_injection(spec);
    ASSERT_FALSE(v.ok()) << c.name << " " << c.value_template;
    EXPECT_EQ(v.error().rfind(c.field, 0), 0U) << v.error();
}

INSTANTIATE_TEST_SUITE_P(
    Table, ValidateInjectionBad,
    ::testing::Values(
        BadInjection{InjectType::Header, "", "{secret}", "", "inject.name"},
        BadInjection{InjectType::Header, "x key", "{secret}", "", "inject.name"},
        BadInjection{InjectType::Header, "Host", "{secret}", "", "inject.name"},
        BadInjection{InjectType::Header, "content-length", "{secret}", "", "inject.name"},
        BadInjection{InjectType::Header, "transfer-encoding", "{secret}", "", "inject.name"},
        BadInjection{InjectType::Header, "connection", "{secret}", "", "inject.name"},
        BadInjection{InjectType::Header, "te", "{secret}", "", "inject.name"},
        BadInjection{InjectType::Header, "upgrade", "{secret}", "", "inject.name"},
        BadInjection{InjectType::Header, "keep-alive", "{secret}", "", "inject.name"},
        BadInjection{InjectType::Header, "proxy-authorization", "{secret}", "", "inject.name"},
        BadInjection{InjectType::Header, ":authority", "{secret}", "", "inject.name"},
        BadInjection{InjectType::Header, "X-Egress-Run", "{secret}", "", "inject.name"},
        BadInjection{InjectType::Header, "x-key", "no placeholder", "", "inject.template"},
        BadInjection{InjectType::Header, "x-key", "{secret}{secret}", "", "inject.template"},
        BadInjection{InjectType::Header, "x-key", "{secret}\r\nX-Evil: 1", "", "inject.template"},
        BadInjection{InjectType::Basic, "", "", "a:b", "inject.username"},
        BadInjection{InjectType::Basic, "", "", "a\nb", "inject.username"}));

TEST(InjectedHeader, NamesAndValues) {
    InjectSpec bearer;
    EXPECT_EQ(injected_header_name(bearer), "authorization");
    EXPECT_EQ(injected_header_value(bearer, "tok"), "Bearer tok");

    InjectSpec basic;
    basic.type = InjectType::Basic;
    basic.username = "user";
    EXPECT_EQ(injected_header_name(basic), "authorization");
    // base64("user:pass") and base64("x:a") with padding.
    EXPECT_EQ(injected_header_value(basic, "pass"), "Basic dXNlcjpwYXNz");
    basic.username = "x";
    EXPECT_EQ(injected_header_value(basic, "a"), "Basic eDph");
    basic.username = "";
    EXPECT_EQ(injected_header_value(basic, "ab"), "Basic OmFi");
    EXPECT_EQ(injected_header_value(basic, "abcd"), "Basic OmFiY2Q=");

    InjectSpec header;
    header.type = InjectType::Header;
    header.header_name = "X-Api-Key";
    header.value_template = "key={secret};v=1";
    EXPECT_EQ(injected_header_name(header), "x-api-key");
    EXPECT_EQ(injected_header_value(header, "k"), "key=k;v=1");
}

struct DestCase {
    std::string name;
    std::string host;
    uint16_t port;
    Carry carry;
    std::string reason;
    bool pinned;
};

class DecideDestinationTest : public ::testing::TestWithParam<DestCase> {};

TEST_P(DecideDestinationTest, Decides) {
    const DestCase& c = GetParam();
    GlobalPolicy global;
    global.unpinned = Unpinned::Tunnel;
    global.allow_hosts = {pattern("pypi.org"), pattern("files.test:8443")};
    global.allowed_ports = {443};
    RunPolicy run;
    run.id = "r1";
    run.expires_at = kNow + minutes(30);
    run.allow_hosts = {pattern("*.npmjs.test")};
    run.pins = {make_pin("p1", "api.github.com"), make_pin("p2", "*.s3.test:9000")};
    // Denied whatever the pins and allow lists say: one name under an allowed wildcard, one
    // pinned bucket on one port only.
    global.deny_hosts = {pattern("evil.npmjs.test"), pattern("secret.s3.test:9000"),
                         *HostPattern::parse("*.corp.test", HostPattern::Scope::Subtree)};
    run.allow_hosts.push_back(pattern("*.a.corp.test"));
    Pin expired = make_pin("p3", "old.test");
    expired.expires_at = kNow;
    run.pins.push_back(expired);

    const DestinationDecision d = decide_destination(global, run, HostPort{c.host, c.port}, kNow);
    EXPECT_EQ(d.carry, c.carry) << c.name;
    EXPECT_EQ(d.reason, c.reason) << c.name;
    EXPECT_EQ(d.pinned, c.pinned) << c.name;
}

INSTANTIATE_TEST_SUITE_P(
    Table, DecideDestinationTest,
    ::testing::Values(
        DestCase{"pinned", "api.github.com", 443, Carry::Intercept, "", true},
        DestCase{"pinned_bad_port", "api.github.com", 8443, Carry::Deny, "port_not_allowed", false},
        DestCase{"pinned_own_port", "b.s3.test", 9000, Carry::Intercept, "", true},
        DestCase{"pinned_own_port_only", "b.s3.test", 443, Carry::Deny, "port_not_allowed", false},
        DestCase{"global_allowed", "pypi.org", 443, Carry::Tunnel, "", false},
        DestCase{"run_allowed", "registry.npmjs.test", 443, Carry::Tunnel, "", false},
        DestCase{"run_wildcard_apex", "npmjs.test", 443, Carry::Deny, "host_not_allowed", false},
        DestCase{"allowed_own_port", "files.test", 8443, Carry::Tunnel, "", false},
        DestCase{"allowed_wrong_port", "files.test", 443, Carry::Deny, "port_not_allowed", false},
        DestCase{"expired_pin", "old.test", 443, Carry::Deny, "host_not_allowed", false},
        DestCase{"unknown", "evil.test", 443, Carry::Deny, "host_not_allowed", false},
        DestCase{"denied_under_allowed_wildcard", "evil.npmjs.test", 443, Carry::Deny,
                 "host_denied", false},
        DestCase{"denied_pinned_port", "secret.s3.test", 9000, Carry::Deny, "host_denied",
                 false},
        DestCase{"denied_pattern_other_port", "secret.s3.test", 443, Carry::Deny,
                 "port_not_allowed", false},
        DestCase{"sibling_of_denied", "ok.s3.test", 9000, Carry::Intercept, "", true},
        DestCase{"denied_subtree_deep", "x.a.corp.test", 443, Carry::Deny, "host_denied",
                 false}),
    [](const ::testing::TestParamInfo<DestCase>& info) { return info.param.name; });

TEST(DecideDestination, InterceptModeAndRunState) {
    GlobalPolicy global;
    global.unpinned = Unpinned::Intercept;
    global.allow_hosts = {pattern("pypi.org")};
    RunPolicy run;
    run.expires_at = kNow + minutes(1);
    const HostPort pypi{"pypi.org", 443};
    EXPECT_EQ(decide_destination(global, run, pypi, kNow).carry, Carry::Intercept);
    EXPECT_TRUE(host_allowed(global, run, pypi));
    EXPECT_FALSE(host_allowed(global, run, HostPort{"pypi.org", 80}));

    run.expires_at = kNow;
    DestinationDecision d = decide_destination(global, run, pypi, kNow);
    EXPECT_EQ(d.carry, Carry::Deny);
    EXPECT_EQ(d.reason, "run_expired");

    run.expires_at = kNow + minutes(1);
    run.revoked = true;
    d = decide_destination(global, run, pypi, kNow);
    EXPECT_EQ(d.carry, Carry::Deny);
    EXPECT_EQ(d.reason, "run_revoked");
}

struct PinCase {
    std::string name;
    std::string host;
    uint16_t port;
    std::string method;
    std::string path;
    std::string want;  // pin id, "" for none
};

class MatchPinTest : public ::testing::TestWithParam<PinCase> {};

TEST_P(MatchPinTest, Matches) {
    const PinCase& c = GetParam();
    RunPolicy run;
    run.expires_at = kNow + minutes(30);
    run.pins = {make_pin("repos", "api.github.com", {"/repos/acme/"}, {"GET", "HEAD"}),
                make_pin("any", "uploads.github.com"),
                make_pin("port", "*.s3.test:9000", {"/bucket/"}),
                make_pin("later", "api.github.com", {"/user"}, {"POST"})};
    Pin expired = make_pin("expired", "old.test");
    expired.expires_at = kNow;
    run.pins.push_back(expired);
    Pin live = make_pin("live", "old.test");
    live.expires_at = kNow + std::chrono::seconds(1);
    run.pins.push_back(live);

    const Pin* pin =
        match_pin(GlobalPolicy{}, run, HostPort{c.host, c.port}, c.method, c.path, kNow);
    EXPECT_EQ(pin == nullptr ? "" : pin->id, c.want) << c.name;
}

INSTANTIATE_TEST_SUITE_P(
    Table, MatchPinTest,
    ::testing::Values(
        PinCase{"prefix", "api.github.com", 443, "GET", "/repos/acme/web", "repos"},
        PinCase{"prefix_query", "api.github.com", 443, "GET", "/repos/acme/web?x=/../", "repos"},
        PinCase{"prefix_other_org", "api.github.com", 443, "GET", "/repos/evil/web", ""},
        PinCase{"prefix_missing_slash", "api.github.com", 443, "GET", "/repos/acme", ""},
        PinCase{"method_head", "api.github.com", 443, "HEAD", "/repos/acme/x", "repos"},
        PinCase{"method_post", "api.github.com", 443, "POST", "/repos/acme/x", ""},
        PinCase{"method_case", "api.github.com", 443, "get", "/repos/acme/x", ""},
        PinCase{"second_pin", "api.github.com", 443, "POST", "/user/keys", "later"},
        // A prefix matches whole segments: "/user" is not a prefix of "/users/x".
        PinCase{"prefix_whole", "api.github.com", 443, "POST", "/user", "later"},
        PinCase{"prefix_whole_query", "api.github.com", 443, "POST", "/user?x=1", "later"},
        PinCase{"prefix_not_a_segment", "api.github.com", 443, "POST", "/users/x", ""},
        PinCase{"prefix_not_a_segment_dash", "api.github.com", 443, "POST", "/user-evil", ""},
        PinCase{"any_path", "uploads.github.com", 443, "PUT", "/whatever/../x", "any"},
        // A pin without a port covers allowed_ports only, as in decide_destination.
        PinCase{"portless_outside_allowed_ports", "uploads.github.com", 8443, "GET", "/", ""},
        PinCase{"dotdot", "api.github.com", 443, "GET", "/repos/acme/../evil/x", ""},
        PinCase{"dot", "api.github.com", 443, "GET", "/repos/acme/./x", ""},
        PinCase{"trailing_dotdot", "api.github.com", 443, "GET", "/repos/acme/x/..", ""},
        PinCase{"dotdot_param", "api.github.com", 443, "GET", "/repos/acme/..;/evil", ""},
        PinCase{"dotdot_fragment", "api.github.com", 443, "GET", "/repos/acme/..#", ""},
        PinCase{"dotdot_fragment_more", "api.github.com", 443, "GET", "/repos/acme/..#/x", ""},
        PinCase{"fragment", "api.github.com", 443, "GET", "/repos/acme/x#y", ""},
        PinCase{"encoded_hash", "api.github.com", 443, "GET", "/repos/acme/x%23y", "repos"},
        PinCase{"encoded_dot", "api.github.com", 443, "GET", "/repos/acme/%2e%2e/evil", ""},
        PinCase{"encoded_dot_upper", "api.github.com", 443, "GET", "/repos/acme/%2E%2E/e", ""},
        PinCase{"encoded_slash", "api.github.com", 443, "GET", "/repos/acme/..%2fevil", ""},
        PinCase{"encoded_slash_upper", "api.github.com", 443, "GET", "/repos/acme/x%2Fy", ""},
        PinCase{"backslash", "api.github.com", 443, "GET", "/repos/acme/..\\evil", ""},
        PinCase{"dots_in_name_ok", "api.github.com", 443, "GET", "/repos/acme/a..b/.x", "repos"},
        PinCase{"not_origin_form", "api.github.com", 443, "GET", "*", ""},
        PinCase{"wildcard_port", "b.s3.test", 9000, "GET", "/bucket/k", "port"},
        PinCase{"wildcard_wrong_port", "b.s3.test", 443, "GET", "/bucket/k", ""},
        PinCase{"wildcard_apex", "s3.test", 9000, "GET", "/bucket/k", ""},
        PinCase{"wildcard_deep", "a.b.s3.test", 9000, "GET", "/bucket/k", ""},
        PinCase{"expired_skipped", "old.test", 443, "GET", "/", "live"},
        PinCase{"other_host", "github.com", 443, "GET", "/repos/acme/x", ""}),
    [](const ::testing::TestParamInfo<PinCase>& info) { return info.param.name; });

// Servers that take the method or path from a header (X-HTTP-Method-Override, X-Original-URL)
// would run what the pin's limits refuse: a limited pin must allow what they claim too.
TEST(MatchPin, OverrideHeadersMustStayWithinThePinsLimits) {
    RunPolicy run;
    run.expires_at = kNow + minutes(30);
    run.pins = {make_pin("repos", "api.github.com", {"/repos/acme/"}, {"GET", "POST"}),
                make_pin("any", "uploads.github.com")};
    const HostPort gh{"api.github.com", 443};
    auto with = [](std::string name, std::string value) {
        RequestHead h;
        h.headers.push_back({std::move(name), std::move(value)});
        return h;
    };
    auto match = [&](const HostPort& dest, std::string_view method, const RequestHead& h) {
        const Pin* p = match_pin(GlobalPolicy{}, run, dest, method, "/repos/acme/x", kNow, &h);
        return p == nullptr ? std::string() : p->id;
    };
    EXPECT_EQ(match(gh, "POST", with("X-HTTP-Method-Override", "GET")), "repos");
    EXPECT_EQ(match(gh, "POST", with("X-HTTP-Method-Override", " DELETE ")), "");
    EXPECT_EQ(match(gh, "POST", with("x-http-method", "PUT")), "");
    EXPECT_EQ(match(gh, "POST", with("X-Method-Override", "PATCH")), "");
    EXPECT_EQ(match(gh, "GET", with("X-Original-URL", "/repos/acme/y?z")), "repos");
    EXPECT_EQ(match(gh, "GET", with("X-Original-URL", "/admin/delete")), "");
    EXPECT_EQ(match(gh, "GET", with("X-Rewrite-URL", "/repos/acme/../evil")), "");
    EXPECT_EQ(match(gh, "GET", with("X-Rewrite-URL", "https://evil.test/repos/acme/")), "");
    EXPECT_EQ(match(gh, "GET", with("X-Other", "DELETE")), "repos");
    // CGI-style servers (Puma under Rack::MethodOverride) read '_' as '-'.
    EXPECT_EQ(match(gh, "POST", with("X_HTTP_METHOD_OVERRIDE", "DELETE")), "");
    EXPECT_EQ(match(gh, "POST", with("x-http-method_override", "DELETE")), "");
    EXPECT_EQ(match(gh, "POST", with("X_HTTP_METHOD_OVERRIDE", "GET")), "repos");
    EXPECT_EQ(match(gh, "GET", with("X_ORIGINAL_URL", "/admin/delete")), "");
    EXPECT_EQ(match(gh, "GET", with("X-Original-URL", "/repos/acme/..#")), "");
    EXPECT_TRUE(is_override_header("X_HTTP_METHOD_OVERRIDE"));
    EXPECT_TRUE(is_override_header("x_original_url"));
    EXPECT_FALSE(is_override_header("x_http_method_overrides"));
    // Symfony and Laravel take a POST's method from a `_method` query parameter too.
    auto query = [&](std::string_view method, std::string_view path) {
        RequestHead h;
        const Pin* p = match_pin(GlobalPolicy{}, run, gh, method, path, kNow, &h);
        return p == nullptr ? std::string() : p->id;
    };
    EXPECT_EQ(query("POST", "/repos/acme/x?_method=get"), "repos");
    EXPECT_EQ(query("POST", "/repos/acme/x?a=1&_method=DELETE"), "");
    EXPECT_EQ(query("POST", "/repos/acme/x?%5Fmethod=DEL%45TE"), "");
    EXPECT_EQ(query("POST", "/repos/acme/x?_method"), "");  // no value: no method it allows
    EXPECT_EQ(query("POST", "/repos/acme/x?my_method=DELETE"), "repos");
    EXPECT_EQ(query("POST", "/repos/acme/x?q=%zz_method"), "");  // unparsable: fail closed
    // keys PHP reads as _method: partly encoded, or with '.', ' ' or '[' for '_'
    EXPECT_EQ(query("POST", "/repos/acme/x?_%6Dethod=DELETE"), "");
    EXPECT_EQ(query("POST", "/repos/acme/x?%5F%6Dethod=DELETE"), "");
    EXPECT_EQ(query("POST", "/repos/acme/x?.method=DELETE"), "");
    EXPECT_EQ(query("POST", "/repos/acme/x?%20method=DELETE"), "");
    EXPECT_EQ(query("POST", "/repos/acme/x?a=%41"), "repos");  // decodes to nothing of it
    EXPECT_TRUE(is_override_header("X-Original-URL"));
    EXPECT_TRUE(is_override_header("x-amz-copy-source"));
    EXPECT_FALSE(is_override_header("x-amz-date"));
    // A pin without limits has nothing an override could widen.
    const HostPort up{"uploads.github.com", 443};
    EXPECT_EQ(match(up, "GET", with("X-HTTP-Method-Override", "DELETE")), "any");
    // Without a head (callers that match by method and path only), as before.
    EXPECT_EQ(match_pin(GlobalPolicy{}, run, gh, "GET", "/repos/acme/x", kNow)->id, "repos");
}

/// A POST head with one content-type field per entry (none for an empty list).
RequestHead post(std::vector<std::string> types) {
    RequestHead h;
    h.method = "POST";
    for (auto& t : types) {
        h.headers.push_back({"content-type", std::move(t)});
    }
    return h;
}

// Rails, Laravel, Symfony, Spring and ASP.NET Core take a POST's method from a `_method` field
// in its body too: a form key, a multipart part, a top-level JSON key.
TEST(BodyMethod, AFieldInAPostBodyMustStayWithinThePinsMethods) {
    const Pin pin = make_pin("p", "api.test", {}, {"GET", "POST"});
    const RequestHead form = post({"application/x-www-form-urlencoded; charset=utf-8"});
    const RequestHead json = post({"application/json"});
    const RequestHead vnd = post({"application/vnd.api+json"});
    const RequestHead multi = post({"multipart/form-data; boundary=\"XyZ\""});
    const RequestHead untyped = post({});
    const RequestHead octets = post({"application/octet-stream"});
    // which requests are read whole: a POST with such a body to a pin limited to methods
    EXPECT_TRUE(body_may_override_method(pin, form));
    EXPECT_TRUE(body_may_override_method(pin, json));
    EXPECT_TRUE(body_may_override_method(pin, vnd));
    EXPECT_TRUE(body_may_override_method(pin, multi));
    EXPECT_TRUE(body_may_override_method(pin, untyped));  // Rack reads it as a form
    EXPECT_FALSE(body_may_override_method(pin, octets));
    EXPECT_TRUE(body_may_override_method(pin, post({"application/octet-stream", "text/json"})));
    RequestHead get = form;
    get.method = "GET";
    EXPECT_FALSE(body_may_override_method(pin, get));
    EXPECT_FALSE(body_may_override_method(make_pin("any", "api.test"), form));

    EXPECT_FALSE(body_method_matches(pin, form, "a=1&_method=DELETE"));
    EXPECT_FALSE(body_method_matches(pin, form, "_method=delete"));
    EXPECT_FALSE(body_method_matches(pin, form, "+method=DELETE"));  // " method" mapped unskipped
    EXPECT_FALSE(body_method_matches(pin, untyped, "_method=DELETE"));
    EXPECT_TRUE(body_method_matches(pin, form, "_method=get&a=1"));
    EXPECT_TRUE(body_method_matches(pin, form, "a=1&b=2"));
    EXPECT_TRUE(body_method_matches(pin, octets, "_method=DELETE"));  // no server reads it

    EXPECT_FALSE(body_method_matches(pin, json, R"({"a": [1, {"b": 2}], "_method": "DELETE"})"));
    EXPECT_FALSE(body_method_matches(pin, vnd, R"({"\u005fmethod": "PUT"})"));
    EXPECT_FALSE(body_method_matches(pin, json, R"({"_method": "GET", "_method": "DELETE"})"));
    EXPECT_FALSE(body_method_matches(pin, json, R"({"_method": ["DELETE"]})"));
    EXPECT_FALSE(body_method_matches(pin, json, R"({"_method": "DELETE", /* c */ })"));
    EXPECT_TRUE(body_method_matches(pin, json, R"({"_method": "post"})"));
    EXPECT_TRUE(body_method_matches(pin, json, R"({"x": {"_method": "DELETE"}})"));  // nested
    EXPECT_TRUE(body_method_matches(pin, json, R"([{"_method": "DELETE"}])"));
    EXPECT_TRUE(body_method_matches(pin, json, R"({"title": )"));  // no JSON: no field,
    EXPECT_FALSE(body_method_matches(pin, json, R"({"_method": )"));  // unless it says method
    // deeper than any default depth limit, then the field
    const std::string deep = "{\"a\": " + std::string(5000, '[') + std::string(5000, ']') +
                             ", \"_method\": \"DELETE\"}";
    EXPECT_FALSE(body_method_matches(pin, json, deep));

    const std::string part =
        "--XyZ\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\n1\r\n"
        "--XyZ\r\ncontent-disposition: form-data; name=\"_method\"\r\n\r\nDELETE\r\n"
        "--XyZ--\r\n";
    EXPECT_FALSE(body_method_matches(pin, multi, part));
    EXPECT_FALSE(body_method_matches(
        pin, multi, "--XyZ\nContent-Disposition: form-data; name=_method\n\nput\n--XyZ--\n"));
    EXPECT_TRUE(body_method_matches(
        pin, multi,
        "--XyZ\r\nContent-Disposition: form-data; name=\"_method\"\r\n\r\nGET\r\n--XyZ--\r\n"));
    EXPECT_TRUE(body_method_matches(
        pin, multi,
        "--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"_method\"\r\n"
        "\r\nDELETE\r\n--XyZ--\r\n"));
    // a second boundary parameter is checked as well
    EXPECT_FALSE(body_method_matches(
        pin, post({"multipart/form-data; boundary=a; boundary=XyZ"}), part));
}

// The content-type as each server reads it, form keys with PHP's leading spaces skipped and
// Rack 2's brackets, and every boundary a server may split a multipart body under.
TEST(BodyMethod, EachServersReadingOfTheBodyIsChecked) {
    const Pin pin = make_pin("p", "api.test", {}, {"GET", "POST"});
    const std::string field = "title=x&_method=DELETE";
    // the media type ends at ',' (Rack, PHP) or a space (PHP); an empty field is none (Rack)
    EXPECT_FALSE(body_method_matches(
        pin, post({"application/x-www-form-urlencoded, text/plain"}), field));
    EXPECT_FALSE(body_method_matches(
        pin, post({"application/x-www-form-urlencoded text/plain"}), field));
    EXPECT_FALSE(body_method_matches(pin, post({""}), field));
    EXPECT_FALSE(body_method_matches(pin, post({"  "}), field));
    EXPECT_TRUE(body_may_override_method(pin, post({""})));
    // Laravel: "/json" anywhere in the field
    EXPECT_TRUE(body_may_override_method(pin, post({"text/plain; x=/json"})));
    EXPECT_FALSE(body_method_matches(pin, post({"text/plain; x=/json"}), R"({"_method":"PUT"})"));
    EXPECT_FALSE(body_method_matches(pin, post({"text/plain; x=form"}), field));
    EXPECT_TRUE(body_method_matches(pin, post({"text/plain"}), field));  // no server reads it

    // PHP skips a key's leading spaces, Rack the spaces after '&'
    const RequestHead form = post({"application/x-www-form-urlencoded"});
    EXPECT_FALSE(body_method_matches(pin, form, "title=x&+_method=DELETE"));
    EXPECT_FALSE(body_method_matches(pin, form, "title=x&%20_method=DELETE"));
    EXPECT_FALSE(body_method_matches(pin, form, "title=x&++%20_method=DELETE"));
    EXPECT_FALSE(body_method_matches(pin, form, "title=x&_method%00x=DELETE"));  // PHP: a C string
    EXPECT_FALSE(body_method_matches(pin, form, "title=x&%5B_method%5D=DELETE"));  // Rack 2
    EXPECT_FALSE(body_method_matches(pin, form, "title=x&_METHOD=DELETE"));  // ASP.NET Core
    EXPECT_TRUE(body_method_matches(pin, form, "title=x&+_method=GET"));
    EXPECT_TRUE(body_method_matches(pin, form, "title=x&%2B_method=DELETE"));  // "+_method"
    EXPECT_TRUE(body_method_matches(pin, form, "title=x&_method%5Ba%5D=DELETE"));  // an array
    // the same key check serves the query string
    EXPECT_FALSE(form_method_matches(pin, "a=1&+_method=DELETE"));
    EXPECT_FALSE(form_method_matches(pin, "a=1&%20%20_method=PUT"));

    const std::string spaced =
        "--foo\r\nContent-Disposition: form-data; name=\" _method\"\r\n\r\nDELETE\r\n--foo--\r\n";
    EXPECT_FALSE(body_method_matches(pin, post({"multipart/form-data; boundary=foo"}), spaced));

    // PHP splits under the value after the first "boundary" and '=' (also inside another
    // parameter's name), a space after '=' kept; Rack after the last "boundary="
    const std::string under_foo =
        "--foo\r\nContent-Disposition: form-data; name=\"_method\"\r\n\r\nDELETE\r\n--foo--\r\n";
    const std::string under_space_foo =
        "-- foo\r\nContent-Disposition: form-data; name=\"_method\"\r\n\r\nDELETE\r\n-- foo--\r\n";
    EXPECT_FALSE(body_method_matches(
        pin, post({"multipart/form-data; xboundary=foo; boundary=bar"}), under_foo));
    EXPECT_FALSE(body_method_matches(
        pin, post({"multipart/form-data; boundaryx; a=foo; boundary=bar"}), under_foo));
    EXPECT_FALSE(body_method_matches(
        pin, post({"multipart/form-data; boundary= foo"}), under_space_foo));
    EXPECT_FALSE(body_method_matches(
        pin, post({"multipart/form-data; boundary=\"foo\"; Boundary=bar"}), under_foo));
    EXPECT_FALSE(body_method_matches(
        pin, post({"multipart/form-data, boundary=foo"}), under_foo));
    EXPECT_TRUE(body_method_matches(
        pin, post({"multipart/form-data; boundary=bar"}), under_foo));  // no part under bar
    std::string many = "multipart/form-data";
    for (int i = 0; i < 17; ++i) {
        many += "; boundary=b" + std::to_string(i);
    }
    EXPECT_FALSE(body_method_matches(pin, post({many}), "a"));  // each boundary is a pass
}

// Part headers read as PHP, Rack 2, Rack 3 and ASP.NET Core read them; Content-Type fields
// merged as Apache and Puma merge them; JSON that Boost refuses but PHP reads; a form in a
// charset where "_method=" is not its ASCII bytes. Each was a bypass (the part or field read
// as DELETE by some server reached the upstream with the credential).
TEST(BodyMethod, PartHeadersFieldsAndEncodingsAsServersReadThem) {
    const Pin pin = make_pin("p", "api.test", {}, {"GET", "POST"});
    const RequestHead multi = post({"multipart/form-data; boundary=B"});
    auto one_part = [](const std::string& headers, const std::string& content) {
        return "--B\r\n" + headers + "\r\n" + content + "\r\n--B--\r\n";
    };
    const std::vector<std::string> bypasses = {
        // folded (PHP, Rack 3 unfold)
        "Content-Disposition: form-data;\r\n name=\"_method\"\r\n",
        // single quotes, an unquoted word (PHP)
        "Content-Disposition: form-data; name='_method'\r\n",
        "Content-Disposition: form-data; name=_method x\r\n",
        // Content-ID names the part (Rack)
        "Content-ID: _method\r\n",
        // Rack 2's unanchored regex
        "X-Content-Disposition: x; name=_method\r\nContent-Disposition: form-data; name=\"t\"\r\n",
        "Content-Disposition: form-data; name=\"t\" name=_method\r\n",
        // an encoded word (ASP.NET Core)
        "Content-Disposition: form-data; name=\"=?utf-8?B?X21ldGhvZA==?=\"\r\n",
        // Rack 2's Content-ID regex is unanchored; its name regex needs no ';'
        "X-Content-ID: _method\r\n",
        "Content-Disposition: form-data\r\nX-Content-ID: _method\r\n",
        "Content-Disposition: form-data name=_method\r\n",
        // Rack 2's regexes also match inside a part's Content-Type
        "Content-Type: text/plain; x=Content-ID:_method\r\n",
        "Content-Type: a; x=Content-Disposition: name=_method\r\n"
        "Content-Disposition: form-data; name=\"a\"\r\n",
        // Tomcat trims \v, \f and 0x1C-0x1F around names (Java's isWhitespace)
        "Content-Disposition: form-data; name=\x0b_method\r\n",
        "Content-Disposition: form-data; name=x; name\x0b=_method\r\n",
        // RFC 2231 in UTF-16 (Tomcat decodes name* in any charset): no "method" to see
        "Content-Disposition: form-data; name*=UTF-16LE''%5F%00%6D%00%65%00%74%00%68%00%6F%00%64%00\r\n",
    };
    for (const std::string& h : bypasses) {
        EXPECT_FALSE(body_method_matches(pin, multi, one_part(h, "DELETE"))) << h;
        EXPECT_TRUE(body_method_matches(pin, multi, one_part(h, "GET"))) << h;
    }
    // headers that end at a bare LF for PHP's reading and at CRLFCRLF for Rack's
    EXPECT_FALSE(body_method_matches(
        pin, multi,
        "--B\r\nX-A: 1\n\nContent-Disposition: form-data; name=\"_method\"\r\n\r\nDELETE\r\n"
        "--B--\r\n"));
    // headers with no blank line before the next delimiter: PHP and Rack read on past it
    EXPECT_FALSE(body_method_matches(
        pin, multi,
        "--B\r\nContent-Disposition: form-data; name=\"_method\"\r\n--B\r\n\r\nDELETE\r\n"
        "--B--\r\n"));
    // ... for Rack only (PHP's reading ends at the bare LF LF and gets GET)
    EXPECT_FALSE(body_method_matches(
        pin, multi,
        "--B\r\nContent-Disposition: form-data; name=\"_method\"\r\nX: 1\n\nGET\r\n--B\r\n"
        "\r\nDELETE\r\n--B--\r\n"));
    // .NET's HttpClient: filename* and an encoded word in filename, which no server reads as
    // a name: plain, whatever the file's name or content
    EXPECT_TRUE(body_method_matches(
        pin, multi,
        one_part("Content-Disposition: form-data; name=\"file\"; "
                 "filename=\"=?utf-8?B?w5xiZXJ3ZWlzdW5nLnBkZg==?=\"; "
                 "filename*=utf-8''%C3%9Cberweisung.pdf\r\nContent-Type: application/pdf\r\n",
                 "DELETE")));
    EXPECT_TRUE(body_method_matches(
        pin, multi,
        one_part("Content-Disposition: form-data; name=file; filename=methods.csv; "
                 "filename*=utf-8''methods.csv\r\nContent-Type: text/csv\r\n",
                 "PUT")));
    // OkHttp's Content-Length and httpmime's Content-Transfer-Encoding in a part are plain
    EXPECT_TRUE(body_method_matches(
        pin, multi,
        one_part("Content-Disposition: form-data; name=\"payment_method\"\r\n"
                 "Content-Length: 4\r\n",
                 "card")));
    EXPECT_TRUE(body_method_matches(
        pin, multi,
        one_part("Content-Disposition: form-data; name=\"shipping_method\"\r\n"
                 "Content-Type: text/plain; charset=UTF-8\r\nContent-Transfer-Encoding: 8bit\r\n",
                 "ups")));
    // the plain form with a name that merely holds "method" is not refused
    EXPECT_TRUE(body_method_matches(
        pin, multi, one_part("Content-Disposition: form-data; name=\"payment_method\"\r\n",
                             "pm_card_visa")));
    EXPECT_TRUE(body_method_matches(
        pin, multi,
        one_part("Content-Disposition: form-data; name=\"f\"; filename=\"method.txt\"\r\n"
                 "Content-Type: text/plain\r\n",
                 "DELETE")));

    // two Content-Type fields, merged: "multipart/form-data, text/plain; boundary=B"
    const RequestHead two = post({"multipart/form-data", "text/plain; boundary=B"});
    EXPECT_TRUE(body_may_override_method(pin, two));
    EXPECT_FALSE(body_method_matches(
        pin, two, one_part("Content-Disposition: form-data; name=\"_method\"\r\n", "DELETE")));

    // JSON Boost cannot parse but PHP can (an exponent PHP takes as INF)
    const RequestHead json = post({"application/json"});
    EXPECT_FALSE(body_method_matches(pin, json, R"({"n":1e9999999999,"_method":"DELETE"})"));
    EXPECT_FALSE(body_method_matches(pin, json, R"({"n":1e9999999999,"\u005f\u006d\u0065thod":"DELETE"})"));
    EXPECT_TRUE(body_method_matches(pin, json, R"({"n":1e9999999999,"title":"x"})"));

    // Many parts without a blank line: each part's header search stops at the next
    // delimiter (it ran to the end of the body for each part: 1 MiB took 95 s of a worker),
    // and a part named _method after them is still found.
    std::string many_parts;
    while (many_parts.size() < (1U << 20)) {
        many_parts += "--B\r\nX: y\r\n";
    }
    // A complexity guard, not a speed figure: linear is milliseconds (3 ms at -O2), the
    // search to the end for each part took 95 s.
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_TRUE(body_method_matches(pin, multi, many_parts));
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
    many_parts += "--B\r\nContent-Disposition: form-data; name=\"_method\"\r\n\r\nPUT\r\n--B--\r\n";
    EXPECT_FALSE(body_method_matches(pin, multi, many_parts));

    // a form in UTF-16 (ASP.NET Core decodes the charset it names)
    std::string utf16;
    for (char c : std::string("_method=DELETE")) {
        utf16.push_back(c);
        utf16.push_back('\0');
    }
    EXPECT_FALSE(body_method_matches(
        pin, post({"application/x-www-form-urlencoded; charset=utf-16le"}), utf16));
    EXPECT_TRUE(body_method_matches(
        pin, post({"application/x-www-form-urlencoded; charset=UTF-8"}), "title=x"));
    EXPECT_TRUE(body_method_matches(
        pin, post({"application/x-www-form-urlencoded; charset=iso-8859-1"}), "title=x"));
}

// S3's CopyObject reads the object x-amz-copy-source names with the pin's key: a pin limited to
// paths or to one bucket must contain it too.
TEST(MatchPin, AnS3CopySourceMustStayWithinThePin) {
    auto s3 = [](Pin p) {
        p.inject.type = InjectType::AwsSigV4;
        p.inject.region = "us-east-1";
        p.inject.service = "s3";
        return p;
    };
    RunPolicy run;
    run.expires_at = kNow + minutes(30);
    run.pins = {s3(make_pin("path", "s3.test", {"/allowed/"})),
                s3(make_pin("vhost", "photos.s3.us-east-1.amazonaws.com")),
                s3(make_pin("vhost-prefix", "logs.s3-us-west-2.amazonaws.com", {"/data/"})),
                make_pin("bearer", "api.test", {"/allowed/"})};
    auto copy = [&](std::string_view host, std::string_view path, std::string source) {
        RequestHead h;
        h.headers.push_back({"X-Amz-Copy-Source", std::move(source)});
        const Pin* p = match_pin(GlobalPolicy{}, run, HostPort{std::string(host), 443}, "PUT",
                                 path, kNow, &h);
        return p == nullptr ? std::string() : p->id;
    };
    EXPECT_EQ(copy("s3.test", "/allowed/copy", "/allowed/x"), "path");
    EXPECT_EQ(copy("s3.test", "/allowed/copy", "allowed/x?versionId=3"), "path");
    EXPECT_EQ(copy("s3.test", "/allowed/copy", "/secret/data"), "");
    EXPECT_EQ(copy("s3.test", "/allowed/copy", "%2Fsecret%2Fdata"), "");
    EXPECT_EQ(copy("s3.test", "/allowed/copy", "/allowed/%2e%2e/secret/data"), "");
    EXPECT_EQ(copy("s3.test", "/allowed/copy", "/allowed/%zz"), "");  // does not decode
    EXPECT_EQ(copy("s3.test", "/allowed/copy",
                   "arn:aws:s3:us-east-1:123456789012:accesspoint/ap/object/k"), "");
    EXPECT_EQ(copy("photos.s3.us-east-1.amazonaws.com", "/k2", "photos/k1"), "vhost");
    EXPECT_EQ(copy("photos.s3.us-east-1.amazonaws.com", "/k2", "/photos/a/b"), "vhost");
    EXPECT_EQ(copy("photos.s3.us-east-1.amazonaws.com", "/k2", "other/k1"), "");
    EXPECT_EQ(copy("photos.s3.us-east-1.amazonaws.com", "/k2", "photosX/k1"), "");
    EXPECT_EQ(copy("photos.s3.us-east-1.amazonaws.com", "/k2", "photos"), "");
    EXPECT_EQ(copy("logs.s3-us-west-2.amazonaws.com", "/data/k2", "logs/data/k1"),
              "vhost-prefix");
    EXPECT_EQ(copy("logs.s3-us-west-2.amazonaws.com", "/data/k2", "logs/other/k1"), "");
    // Only S3 pins read it: to a bearer pin it is any header.
    EXPECT_EQ(copy("api.test", "/allowed/x", "/secret/data"), "bearer");
}

TEST(MatchPin, ExpiryAndRunState) {
    RunPolicy run;
    run.expires_at = kNow + minutes(30);
    run.pins = {make_pin("p", "a.test")};
    run.pins[0].expires_at = kNow + minutes(5);
    const HostPort dest{"a.test", 443};
    const GlobalPolicy global;
    EXPECT_NE(match_pin(global, run, dest, "GET", "/", kNow), nullptr);
    EXPECT_TRUE(host_pinned(global, run, dest, kNow));
    EXPECT_EQ(match_pin(global, run, dest, "GET", "/", kNow + minutes(5)), nullptr);
    EXPECT_FALSE(host_pinned(global, run, dest, kNow + minutes(5)));

    run.revoked = true;
    EXPECT_EQ(match_pin(global, run, dest, "GET", "/", kNow), nullptr);
    EXPECT_FALSE(host_pinned(global, run, dest, kNow));
}

TEST(HostPinned, IgnoresPathAndMethod) {
    RunPolicy run;
    run.pins = {make_pin("p", "a.test:8443", {"/only/"}, {"GET"})};
    const GlobalPolicy global;
    EXPECT_TRUE(host_pinned(global, run, HostPort{"a.test", 8443}, kNow));
    EXPECT_FALSE(host_pinned(global, run, HostPort{"a.test", 443}, kNow));
    EXPECT_FALSE(host_pinned(global, run, HostPort{"b.test", 8443}, kNow));
}

// A pin without a port covers allowed_ports only, so on another port the pin that names that
// port applies (not the first pin for the host), and on a port only an allow pattern admits
// no pin applies at all: the same port rule as decide_destination.
TEST(MatchPin, PortlessPinCoversAllowedPortsOnly) {
    RunPolicy run;
    run.expires_at = kNow + minutes(30);
    run.pins = {make_pin("portless", "other.test"), make_pin("own_port", "other.test:9000")};
    GlobalPolicy global;  // allowed_ports {443}
    const HostPort p443{"other.test", 443};
    const HostPort p9000{"other.test", 9000};
    const HostPort p8443{"other.test", 8443};
    for (bool indexed : {false, true}) {
        if (indexed) {
            index_pins(run);
        }
        const Pin* pin = match_pin(global, run, p443, "GET", "/", kNow);
        EXPECT_EQ(pin ? pin->id : "-", "portless");
        pin = match_pin(global, run, p9000, "GET", "/", kNow);
        EXPECT_EQ(pin ? pin->id : "-", "own_port");
        EXPECT_EQ(match_pin(global, run, p8443, "GET", "/", kNow), nullptr);
        EXPECT_FALSE(host_pinned(global, run, p8443, kNow));
        EXPECT_FALSE(decide_destination(global, run, p8443, kNow).pinned);
    }
    // Once 9000 is an allowed port both pins cover it, and the first in order applies.
    global.allowed_ports = {443, 9000};
    const Pin* pin = match_pin(global, run, p9000, "GET", "/", kNow);
    EXPECT_EQ(pin ? pin->id : "-", "portless");

    // Allowed but unpinned on 8443: no pin's credential may be injected there.
    global.allow_hosts = {pattern("other.test:8443")};
    EXPECT_EQ(decide_destination(global, run, p8443, kNow).carry, Carry::Tunnel);
    EXPECT_EQ(match_pin(global, run, p8443, "GET", "/", kNow), nullptr);
    EXPECT_FALSE(host_pinned(global, run, p8443, kNow));
}

}  // namespace
}  // namespace egress::policy

namespace egress::policy {
namespace {

// The pin index must never change an answer: compare indexed and linear matching over a
// table of hosts, ports, methods and paths, including wildcard and port-specific pins.
TEST(PinIndex, SameAnswersAsTheLinearScan) {
    RunPolicy run;
    run.id = "r";
    const char* hosts[] = {"api.test",  "*.s3.test", "api.test:8443", "x.s3.test",
                           "other.test", "*.a.test", "b.a.test",      "10.0.0.1"};
    for (size_t i = 0; i < std::size(hosts); ++i) {
        Pin p;
        p.id = "p" + std::to_string(i);
        p.host = *HostPattern::parse(hosts[i]);
        if (i == 3) {
            p.methods = {"POST"};
        }
        if (i == 0) {
            p.path_prefixes = {"/v1/"};
        }
        run.pins.push_back(std::move(p));
    }
    RunPolicy indexed = run;
    index_pins(indexed);
    ASSERT_TRUE(indexed.pin_index);
    GlobalPolicy global;
    auto now = Clock::now();
    const char* queries[] = {"api.test", "x.s3.test", "y.s3.test", "s3.test", "a.b.s3.test",
                             "b.a.test", "c.a.test", "other.test", "nope.test", "10.0.0.1"};
    for (const char* q : queries) {
        for (uint16_t port : {443, 8443}) {
            HostPort hp{q, port};
            for (const char* m : {"GET", "POST"}) {
                for (const char* path : {"/v1/x", "/v2/x"}) {
                    const Pin* a = match_pin(global, run, hp, m, path, now);
                    const Pin* b = match_pin(global, indexed, hp, m, path, now);
                    EXPECT_EQ(a ? a->id : "-", b ? b->id : "-") << q << ":" << port << m << path;
                }
            }
            EXPECT_EQ(host_pinned(global, run, hp, now), host_pinned(global, indexed, hp, now))
                << q;
            auto da = decide_destination(global, run, hp, now);
            auto db = decide_destination(global, indexed, hp, now);
            EXPECT_EQ(da.carry, db.carry) << q << ":" << port;
            EXPECT_EQ(da.reason, db.reason) << q << ":" << port;
        }
    }
    // A stale index (pins changed after indexing) is ignored, not trusted.
    indexed.pins.pop_back();
    EXPECT_EQ(match_pin(global, indexed, HostPort{"10.0.0.1", 443}, "GET", "/", now), nullptr);
}

}  // namespace
}  // namespace egress::policy
