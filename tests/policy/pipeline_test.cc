#include "policy/pipeline.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>

namespace egress::policy {
namespace {

using std::chrono::minutes;

const TimePoint kNow = TimePoint{} + std::chrono::hours(1000);
constexpr std::string_view kSecret = "ghp_s3cr3t";

HostPattern pattern(std::string_view text) {
    Result<HostPattern> p = HostPattern::parse(text);
    EXPECT_TRUE(p.ok()) << text;
    return p.ok() ? *p : HostPattern{};
}

Pin make_pin(std::string id, std::string_view host, InjectSpec inject,
             std::vector<std::string> prefixes = {}) {
    Pin pin;
    pin.id = std::move(id);
    pin.host = pattern(host);
    pin.path_prefixes = std::move(prefixes);
    pin.secret_name = "github_token";
    pin.inject = inject;
    pin.secret = std::make_shared<const credstore::SecretValue>(kSecret);
    prepare_injection(pin);  // as the runtime and the control plane build pins
    return pin;
}

InjectSpec basic(std::string user) {
    InjectSpec s;
    s.type = InjectType::Basic;
    s.username = std::move(user);
    return s;
}

InjectSpec header(std::string name, std::string tmpl) {
    InjectSpec s;
    s.type = InjectType::Header;
    s.header_name = std::move(name);
    s.value_template = std::move(tmpl);
    return s;
}

class PipelineTest : public ::testing::Test {
protected:
    void SetUp() override {
        global_.allow_hosts = {pattern("pypi.org"), pattern("mixed.test")};
        global_.allowed_ports = {443, 80};
        run_.id = "run1";
        run_.expires_at = kNow + minutes(30);
        run_.pins = {make_pin("bearer", "api.github.com", InjectSpec{}, {"/repos/acme/"}),
                     make_pin("basic", "git.test", basic("x-access-token")),
                     make_pin("hdr", "*.key.test", header("X-Api-Key", "k={secret}")),
                     make_pin("mixed", "mixed.test", InjectSpec{}, {"/private/"})};
        ctx_.global = &global_;
        ctx_.run = &run_;
        ctx_.target = HostPort{"api.github.com", 443};
        ctx_.sni = "api.github.com";
        ctx_.tls = true;
        ctx_.now = kNow;
        head_.method = "GET";
        head_.scheme = "https";
        head_.authority = "api.github.com";
        head_.path = "/repos/acme/web";
        head_.headers = {{"accept", "*/*"}, {"user-agent", "curl/8"}};
    }

    void target(std::string host, uint16_t port = 443) {
        ctx_.target = HostPort{host, port};
        ctx_.sni = host;
        head_.authority = host;
    }

    Decision run() { return RequestPipeline{}.run(head_, ctx_); }

    GlobalPolicy global_;
    RunPolicy run_;
    RequestContext ctx_;
    RequestHead head_;
};

bool has(const std::shared_ptr<const ScrubPlan>& plan, std::string_view s) {
    return plan != nullptr &&
           std::find(plan->needles().begin(), plan->needles().end(), s) != plan->needles().end();
}

TEST_F(PipelineTest, BearerInjected) {
    const Decision d = run();
    ASSERT_TRUE(d.forward()) << d.reason;
    ASSERT_NE(d.pin, nullptr);
    EXPECT_EQ(d.pin->id, "bearer");
    EXPECT_EQ(d.injected_header, "authorization");
    EXPECT_EQ(head_.count("authorization"), 1U);
    EXPECT_EQ(*head_.find("authorization"), "Bearer ghp_s3cr3t");
    EXPECT_EQ(*head_.find("accept-encoding"), "identity");
    EXPECT_TRUE(d.secret_sent);  // an encoded answer would hide an echo: refused upstream
    EXPECT_TRUE(has(d.scrub, kSecret));
    EXPECT_TRUE(has(d.scrub, "Bearer ghp_s3cr3t"));
}

TEST_F(PipelineTest, WebsocketHandshakeInjectedWithoutExtensions) {
    // A compressed frame could not be scrubbed: the offer goes where a credential goes in.
    head_.upgrade = "websocket";
    head_.headers.push_back({"sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="});
    head_.headers.push_back({"sec-websocket-extensions", "permessage-deflate"});
    const Decision d = run();
    ASSERT_TRUE(d.forward()) << d.reason;
    EXPECT_EQ(*head_.find("authorization"), "Bearer ghp_s3cr3t");
    EXPECT_EQ(head_.find("sec-websocket-extensions"), nullptr);
    EXPECT_NE(head_.find("sec-websocket-key"), nullptr);
    EXPECT_EQ(head_.upgrade, "websocket");
}

TEST_F(PipelineTest, WebsocketWithoutCredentialKeepsItsExtensions) {
    target("pypi.org");  // allowed, no pin: nothing to scrub
    head_.upgrade = "websocket";
    head_.headers.push_back({"sec-websocket-extensions", "permessage-deflate"});
    const Decision d = run();
    ASSERT_TRUE(d.forward()) << d.reason;
    EXPECT_EQ(d.pin, nullptr);
    EXPECT_NE(head_.find("sec-websocket-extensions"), nullptr);
}

TEST_F(PipelineTest, WebsocketRefusedWhenPolicySaysSo) {
    global_.websocket = false;
    head_.upgrade = "websocket";
    Decision d = run();
    EXPECT_EQ(d.status, 403);
    EXPECT_EQ(d.reason, "websocket_denied");
    EXPECT_EQ(head_.find("authorization"), nullptr) << "refused before any injection";
    head_.upgrade.clear();  // the same request without the upgrade is served
    d = run();
    EXPECT_TRUE(d.forward()) << d.reason;
}

// Every request of a pin shares the plan made once with the pin.
TEST_F(PipelineTest, InjectionIsMadeOncePerPin) {
    const RequestHead fresh = head_;
    const Decision first = run();
    ASSERT_TRUE(first.forward()) << first.reason;
    ASSERT_NE(run_.pins[0].injection, nullptr);
    EXPECT_EQ(first.scrub, run_.pins[0].injection->scrub);
    head_ = fresh;
    const Decision second = run();
    ASSERT_TRUE(second.forward()) << second.reason;
    EXPECT_EQ(second.scrub, first.scrub);
    EXPECT_EQ(*head_.find("authorization"), "Bearer ghp_s3cr3t");
}

// A pin made without prepare_injection() gets the same header and needles, made per request.
TEST_F(PipelineTest, PinWithoutPreparedInjectionGetsOneMade) {
    for (Pin& pin : run_.pins) {
        pin.injection = nullptr;
    }
    target("git.test");
    const Decision d = run();
    ASSERT_TRUE(d.forward()) << d.reason;
    const std::string blob = "eC1hY2Nlc3MtdG9rZW46Z2hwX3MzY3IzdA==";
    EXPECT_EQ(*head_.find("authorization"), "Basic " + blob);
    EXPECT_EQ(head_.never_index, "authorization");
    ASSERT_NE(d.scrub, nullptr);
    EXPECT_EQ(d.scrub->needles().size(), 5U);
    EXPECT_TRUE(has(d.scrub, kSecret));
    EXPECT_TRUE(has(d.scrub, "Basic " + blob));
    EXPECT_TRUE(has(d.scrub, blob));
    // The blob's '=' padding as a URL would carry it (the secret itself has no such byte).
    EXPECT_TRUE(has(d.scrub, "eC1hY2Nlc3MtdG9rZW46Z2hwX3MzY3IzdA%3D%3D"));
    EXPECT_TRUE(has(d.scrub, "eC1hY2Nlc3MtdG9rZW46Z2hwX3MzY3IzdA%3d%3d"));
}

// One build's pins share an injection per secret object and spec, and keep one remembered
// from the build before; a changed secret object or spec gets a new one.
TEST_F(PipelineTest, InjectionCacheSharesEqualInjections) {
    const Pin before = make_pin("p", "x.test", InjectSpec{});
    InjectionCache cache;
    cache.remember(before);

    Pin same = make_pin("p", "x.test", InjectSpec{});
    same.secret = before.secret;
    cache.prepare(same);
    EXPECT_EQ(same.injection, before.injection);

    Pin other_secret = make_pin("q", "y.test", InjectSpec{});  // equal bytes, another object
    cache.prepare(other_secret);
    ASSERT_NE(other_secret.injection, nullptr);
    EXPECT_NE(other_secret.injection, before.injection);
    Pin sharing = make_pin("r", "z.test", InjectSpec{});
    sharing.secret = other_secret.secret;
    cache.prepare(sharing);
    EXPECT_EQ(sharing.injection, other_secret.injection);

    Pin other_spec = make_pin("p", "x.test", basic("u"));
    other_spec.secret = before.secret;
    cache.prepare(other_spec);
    ASSERT_NE(other_spec.injection, nullptr);
    EXPECT_NE(other_spec.injection, before.injection);
    EXPECT_EQ(std::string(other_spec.injection->value->reveal()).rfind("Basic ", 0), 0U);

    Pin no_secret = make_pin("s", "w.test", InjectSpec{});
    no_secret.secret = nullptr;
    cache.prepare(no_secret);
    EXPECT_EQ(no_secret.injection, nullptr);
}

TEST_F(PipelineTest, PinWithoutSecretHasNoInjection) {
    Pin pin = make_pin("p", "x.test", InjectSpec{});
    ASSERT_NE(pin.injection, nullptr);
    pin.secret = nullptr;
    prepare_injection(pin);
    EXPECT_EQ(pin.injection, nullptr);
}

TEST_F(PipelineTest, ClientAuthorizationReplacedNotMerged) {
    head_.headers.push_back({"authorization", "Bearer client-token"});
    head_.headers.push_back({"Authorization", "Basic Zm9vOmJhcg=="});
    head_.headers.push_back({"accept-encoding", "gzip, br"});
    const Decision d = run();
    ASSERT_TRUE(d.forward()) << d.reason;
    EXPECT_EQ(head_.count("authorization"), 1U);
    EXPECT_EQ(*head_.find("authorization"), "Bearer ghp_s3cr3t");
    EXPECT_EQ(head_.count("accept-encoding"), 1U);
    EXPECT_EQ(*head_.find("accept-encoding"), "identity");
}

// A byte range of an answer could hold a piece of an echoed credential that the scrubber,
// which looks at each answer whole, never sees whole: a credential going upstream takes the
// whole answer.
TEST_F(PipelineTest, RangeDroppedWhenTheCredentialGoesUpstream) {
    head_.headers.push_back({"Range", "bytes=14-33"});
    head_.headers.push_back({"If-Range", "\"etag\""});
    const Decision d = run();
    ASSERT_TRUE(d.forward()) << d.reason;
    EXPECT_TRUE(d.secret_sent);
    EXPECT_EQ(head_.find("range"), nullptr);
    EXPECT_EQ(head_.find("if-range"), nullptr);
}

TEST_F(PipelineTest, BasicInjected) {
    target("git.test");
    const Decision d = run();
    ASSERT_TRUE(d.forward()) << d.reason;
    // base64("x-access-token:ghp_s3cr3t")
    const std::string blob = "eC1hY2Nlc3MtdG9rZW46Z2hwX3MzY3IzdA==";
    EXPECT_EQ(*head_.find("authorization"), "Basic " + blob);
    EXPECT_TRUE(has(d.scrub, kSecret));
    EXPECT_TRUE(has(d.scrub, "Basic " + blob));
    EXPECT_TRUE(has(d.scrub, blob));
}

TEST_F(PipelineTest, HeaderInjected) {
    target("eu.key.test");
    head_.headers.push_back({"x-api-key", "client"});
    const Decision d = run();
    ASSERT_TRUE(d.forward()) << d.reason;
    EXPECT_EQ(d.injected_header, "x-api-key");
    EXPECT_EQ(head_.never_index, "x-api-key");  // HTTP/2: sent never-indexed
    EXPECT_EQ(head_.count("x-api-key"), 1U);
    EXPECT_EQ(*head_.find("x-api-key"), "k=ghp_s3cr3t");
    EXPECT_EQ(head_.find("authorization"), nullptr);
    EXPECT_TRUE(has(d.scrub, "k=ghp_s3cr3t"));
}

struct RefusalCase {
    std::string name;
    std::function<void(RequestHead&, RequestContext&, RunPolicy&)> mutate;
    int status;
    std::string reason;
};

class PipelineRefusalTest : public PipelineTest,
                            public ::testing::WithParamInterface<RefusalCase> {};

TEST_P(PipelineRefusalTest, Refuses) {
    const RefusalCase& c = GetParam();
    head_.headers.push_back({"authorization", "Bearer client"});
    c.mutate(head_, ctx_, run_);
    const Decision d = run();
    EXPECT_EQ(d.status, c.status) << d.reason;
    EXPECT_EQ(d.reason, c.reason);
    EXPECT_EQ(d.pin, nullptr);
    EXPECT_EQ(d.scrub, nullptr);
    for (const Header& h : head_.headers) {
        EXPECT_EQ(h.value.find(kSecret), std::string::npos) << h.name;
    }
}

INSTANTIATE_TEST_SUITE_P(
    Table, PipelineRefusalTest,
    ::testing::Values(
        RefusalCase{"missing_host", [](auto& h, auto&, auto&) { h.authority.clear(); }, 400,
                    "missing_host"},
        RefusalCase{"bad_host", [](auto& h, auto&, auto&) { h.authority = "a b:443"; }, 400,
                    "bad_host"},
        RefusalCase{"userinfo_host",
                    [](auto& h, auto&, auto&) { h.authority = "x@api.github.com"; }, 400,
                    "bad_host"},
        RefusalCase{"host_mismatch", [](auto& h, auto&, auto&) { h.authority = "evil.test"; },
                    421, "host_mismatch"},
        RefusalCase{"port_mismatch",
                    [](auto& h, auto&, auto&) { h.authority = "api.github.com:8443"; }, 421,
                    "host_mismatch"},
        RefusalCase{"default_port_http",
                    [](auto& h, auto&, auto&) { h.scheme = "http"; }, 421, "host_mismatch"},
        RefusalCase{"sni_mismatch", [](auto&, auto& c, auto&) { c.sni = "evil.test"; }, 421,
                    "sni_mismatch"},
        RefusalCase{"stray_host_header",
                    [](auto& h, auto&, auto&) { h.headers.push_back({"host", "evil.test"}); },
                    421, "host_mismatch"},
        RefusalCase{"forged_egress",
                    [](auto& h, auto&, auto&) { h.headers.push_back({"X-Egress-Run", "r"}); },
                    403, "forged_egress_header"},
        RefusalCase{"forged_egress_named_in_connection",  // stripping must not hide it
                    [](auto& h, auto&, auto&) {
                        h.headers.push_back({"connection", "X-Egress-Run"});
                        h.headers.push_back({"X-Egress-Run", "r"});
                    },
                    403, "forged_egress_header"},
        RefusalCase{"bad_header_value",
                    [](auto& h, auto&, auto&) { h.headers.push_back({"x-a", "1\r\nx-b: 2"}); },
                    400, "bad_header"},
        RefusalCase{"bad_header_name",
                    [](auto& h, auto&, auto&) { h.headers.push_back({"x a", "1"}); }, 400,
                    "bad_header"},
        RefusalCase{"nul_header_value",
                    [](auto& h, auto&, auto&) {
                        h.headers.push_back({"x-a", std::string("1\0" "2", 3)});
                    },
                    400, "bad_header"},
        RefusalCase{"expired_run",
                    [](auto&, auto& c, auto& r) { r.expires_at = c.now; }, 403, "run_expired"},
        RefusalCase{"expired_run_before_host_check",
                    [](auto& h, auto& c, auto& r) {
                        r.expires_at = c.now - minutes(1);
                        h.authority = "evil.test";
                    },
                    403, "run_expired"},
        RefusalCase{"revoked_run", [](auto&, auto&, auto& r) { r.revoked = true; }, 403,
                    "run_revoked"},
        RefusalCase{"pinned_no_match_not_allowed",
                    [](auto& h, auto&, auto&) { h.path = "/repos/evil/x"; }, 403,
                    "no_matching_pin"},
        RefusalCase{"traversal_no_match",
                    [](auto& h, auto&, auto&) { h.path = "/repos/acme/../evil"; }, 403,
                    "no_matching_pin"},
        RefusalCase{"not_allowed_host",
                    [](auto& h, auto& c, auto&) {
                        c.target = HostPort{"evil.test", 443};
                        c.sni = "evil.test";
                        h.authority = "evil.test";
                    },
                    403, "host_not_allowed"},
        RefusalCase{"expired_pin",
                    [](auto&, auto& c, auto& r) {
                        for (Pin& p : r.pins) {
                            p.expires_at = c.now;
                        }
                    },
                    403, "host_not_allowed"}),
    [](const ::testing::TestParamInfo<RefusalCase>& info) { return info.param.name; });

TEST_F(PipelineTest, ProxyAndHopByHopHeadersNeverLeave) {
    head_.headers.push_back({"proxy-authorization", "Basic cnVuOnRvaw=="});
    head_.headers.push_back({"connection", "keep-alive, x-drop"});
    head_.headers.push_back({"x-drop", "1"});
    head_.headers.push_back({"te", "trailers"});
    ASSERT_TRUE(run().forward());
    EXPECT_EQ(head_.find("proxy-authorization"), nullptr);
    EXPECT_EQ(head_.find("connection"), nullptr);
    EXPECT_EQ(head_.find("x-drop"), nullptr);
    EXPECT_EQ(head_.find("te"), nullptr);
}

TEST_F(PipelineTest, TeTrailersKeptForH2Upstream) {
    ctx_.upstream_h2 = true;
    head_.headers.push_back({"te", "trailers"});
    ASSERT_TRUE(run().forward());
    EXPECT_EQ(head_.count("te"), 1U);
}

TEST_F(PipelineTest, HostAgreementNormalizes) {
    head_.authority = "API.GitHub.com.:443";
    ctx_.sni = "Api.Github.Com";
    const Decision d = run();
    EXPECT_TRUE(d.forward()) << d.reason;
    EXPECT_NE(d.pin, nullptr);
}

TEST_F(PipelineTest, NoSniIsFine) {
    ctx_.sni.reset();
    EXPECT_TRUE(run().forward());
}

TEST_F(PipelineTest, CleartextNeverInjects) {
    ctx_.tls = false;
    ctx_.sni.reset();
    ctx_.target = HostPort{"api.github.com", 80};
    head_.scheme = "http";
    head_.headers.push_back({"authorization", "Bearer client"});
    const Decision d = run();
    ASSERT_TRUE(d.forward()) << d.reason;
    EXPECT_EQ(d.reason, "cleartext_no_credential");
    EXPECT_EQ(d.pin, nullptr);
    EXPECT_TRUE(d.injected_header.empty());
    EXPECT_TRUE(head_.never_index.empty());
    EXPECT_EQ(d.scrub, nullptr);
    EXPECT_EQ(*head_.find("authorization"), "Bearer client");
    EXPECT_EQ(head_.find("accept-encoding"), nullptr);
}

TEST_F(PipelineTest, AllowedHostWithoutPinForwardsBare) {
    target("pypi.org");
    head_.headers.push_back({"accept-encoding", "gzip"});
    const Decision d = run();
    ASSERT_TRUE(d.forward()) << d.reason;
    EXPECT_EQ(d.pin, nullptr);
    EXPECT_EQ(d.scrub, nullptr);
    EXPECT_EQ(*head_.find("accept-encoding"), "gzip");
    EXPECT_EQ(head_.find("authorization"), nullptr);
}

TEST_F(PipelineTest, PinnedAndAllowedHostWithoutMatchingPinForwardsBare) {
    target("mixed.test");
    head_.path = "/public/x";
    Decision d = run();
    ASSERT_TRUE(d.forward()) << d.reason;
    EXPECT_EQ(d.pin, nullptr);
    EXPECT_EQ(head_.find("authorization"), nullptr);

    head_.path = "/private/x";
    d = run();
    ASSERT_TRUE(d.forward()) << d.reason;
    ASSERT_NE(d.pin, nullptr);
    EXPECT_EQ(d.pin->id, "mixed");
}

TEST_F(PipelineTest, MissingSecretFailsClosed) {
    run_.pins[0].secret.reset();
    const Decision d = run();
    EXPECT_FALSE(d.forward());
    EXPECT_EQ(head_.find("authorization"), nullptr);
}

TEST_F(PipelineTest, IPv6Target) {
    Result<HostPattern> p = HostPattern::parse("[::1]:8443");
    ASSERT_TRUE(p.ok());
    run_.pins[0].host = *p;
    run_.pins[0].path_prefixes.clear();
    ctx_.target = HostPort{"::1", 8443};
    ctx_.sni.reset();
    head_.authority = "[::1]:8443";
    const Decision d = run();
    ASSERT_TRUE(d.forward()) << d.reason;
    EXPECT_NE(d.pin, nullptr);
}

}  // namespace
}  // namespace egress::policy
