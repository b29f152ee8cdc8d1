// The control plane's runtime builds for static runs whose pins name store secrets: resolved
// by the run's scope, the served copy kept while nothing it is made of changes, rebuilt when
// a secret it uses does. Against a real file store, master key and admin token in a temp dir.
#include "proxy/control_plane.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "proxy/runtime.h"

namespace egress::proxy {
namespace {

namespace fs = std::filesystem;

class StaticStorePins : public ::testing::Test {
protected:
    void SetUp() override {
        char tmpl[] = "/tmp/egress-cp-test-XXXXXX";
        ASSERT_NE(::mkdtemp(tmpl), nullptr);
        dir_ = tmpl;
        const std::string yaml =
            "admin: {token_file: " + dir_ + "/admin.token}\n"
            "state: {backend: file, path: " + dir_ + "/state}\n"
            "keys: {master_key_file: " + dir_ + "/master.key}\n"
            "runs:\n"
            "  - id: app\n"
            "    token_file: null\n"
            "    ca_cert_out: " + dir_ + "/ca.pem\n"
            "    scope: {org: acme, project: web}\n"
            "    pins:\n"
            "      - {host: a.test, secret: gh, inject: {type: bearer}}\n";
        auto c = parse_config(yaml, "t.yaml");
        ASSERT_TRUE(c) << c.error();
        BuildWarnings w;
        auto statics = build_runtime(std::make_shared<const Config>(std::move(*c)), w);
        ASSERT_TRUE(statics) << statics.error();
        statics_ = *statics;
        auto cp = ControlPlane::open(statics_);
        ASSERT_TRUE(cp) << cp.error();
        cp_ = std::move(*cp);
    }
    void TearDown() override {
        cp_.reset();
        std::error_code ec;
        fs::remove_all(dir_, ec);
    }

    std::shared_ptr<const Runtime> build(BuildWarnings* w = nullptr) {
        auto rt = cp_->build_runtime(w);
        EXPECT_TRUE(rt) << rt.error();
        return *rt;
    }
    void put(const std::string& name, const std::string& scope_json, const std::string& value) {
        auto r = cp_->handle("POST", "/v1/secrets",
                             R"({"name": ")" + name + R"(", "scope": )" + scope_json +
                                 R"(, "value": ")" + value + R"("})");
        ASSERT_EQ(r.status, 201) << r.body;
    }
    void rotate(const std::string& name, const std::string& scope_json, const std::string& value) {
        auto r = cp_->handle("PUT", "/v1/secrets/" + name,
                             R"({"scope": )" + scope_json + R"(, "value": ")" + value + R"("})");
        ASSERT_EQ(r.status, 200) << r.body;
    }
    /// The value the run's first pin injects. Compared with EXPECT_TRUE, so a failure names
    /// which value was wanted without printing one (the project's rule for secret values).
    static std::string injected_value(const proxy::Run& run) {
        if (run.policy.pins.empty() || !run.policy.pins[0].secret) return "";
        return std::string(run.policy.pins[0].secret->reveal());
    }

    std::string dir_;
    std::shared_ptr<Runtime> statics_;
    std::unique_ptr<ControlPlane> cp_;
};

TEST_F(StaticStorePins, OffUntilPutThenTheMostSpecificSecretOfTheRunsScope) {
    BuildWarnings w;
    auto rt = build(&w);
    auto app = rt->find("app");
    ASSERT_TRUE(app);
    EXPECT_TRUE(app->policy.pins.empty());
    ASSERT_EQ(app->unavailable_pins.size(), 1u);
    EXPECT_EQ(app->unavailable_pins[0].text(), "a.test");
    ASSERT_EQ(w.lines.size(), 1u);
    EXPECT_EQ(w.lines[0],
              "runs[0].pins[0].secret: no secret 'gh' for scope org=acme,project=web in the "
              "store; pin for a.test disabled until the secret is put");
    EXPECT_EQ(rt->anonymous, app);  // the sidecar's run is the served copy
    EXPECT_EQ(app->ca, statics_->find("app")->ca);

    put("gh", R"({"org": "globex"})", "v-globex");  // another org's: never used
    EXPECT_TRUE(build()->find("app")->policy.pins.empty());
    put("gh", R"({"org": "acme"})", "v-org");
    rt = build();
    EXPECT_TRUE(injected_value(*rt->find("app")) == "v-org") << "want the org-level secret";
    EXPECT_TRUE(rt->find("app")->unavailable_pins.empty());
    ASSERT_TRUE(rt->find("app")->policy.pins[0].injection);
    put("gh", R"({"org": "acme", "project": "web"})", "v-project");
    EXPECT_TRUE(injected_value(*build()->find("app")) == "v-project")
        << "want the project-level secret";
    put("gh", R"({"org": "acme", "project": "web", "user": "ana"})", "v-user");  // narrower
    EXPECT_TRUE(injected_value(*build()->find("app")) == "v-project")
        << "want the project-level secret, not a user's";
}

TEST_F(StaticStorePins, TheServedCopyIsKeptUntilItsSecretChanges) {
    put("gh", R"({"org": "acme"})", "v1");
    BuildWarnings w;
    auto first = build(&w)->find("app");
    EXPECT_TRUE(w.lines.empty());
    // Another secret's change rebuilds the runtime, not this run: same object, same count of
    // connections, no new injection.
    put("other", R"({"org": "acme"})", "x");
    auto second = build()->find("app");
    EXPECT_EQ(second, first);
    // Its secret rotated: a new copy with the new value, the same CA and leaf cache.
    rotate("gh", R"({"org": "acme"})", "v2");
    auto third = build()->find("app");
    EXPECT_NE(third, first);
    EXPECT_TRUE(injected_value(*third) == "v2") << "want the rotated value";
    EXPECT_EQ(third->ca, first->ca);
    EXPECT_EQ(third->leaves, first->leaves);
    // A reload (new statics) rebuilds it even with the same secrets.
    BuildWarnings rw;
    auto c = parse_config("admin: {token_file: " + dir_ + "/admin.token}\n"
                          "state: {backend: file, path: " + dir_ + "/state}\n"
                          "keys: {master_key_file: " + dir_ + "/master.key}\n"
                          "runs:\n  - id: app\n    token_file: null\n    ca_cert_out: " +
                              dir_ + "/ca.pem\n    scope: {org: acme}\n    pins:\n"
                              "      - {host: a.test, secret: gh, inject: {type: bearer}, "
                              "methods: [GET]}\n",
                          "t.yaml");
    ASSERT_TRUE(c) << c.error();
    auto reloaded = build_runtime(std::make_shared<const Config>(std::move(*c)), rw,
                                  build().get());
    ASSERT_TRUE(reloaded) << reloaded.error();
    cp_->set_statics(*reloaded);
    auto fourth = build()->find("app");
    EXPECT_NE(fourth, third);
    EXPECT_EQ(fourth->ca, first->ca);  // kept across the reload
    ASSERT_EQ(fourth->policy.pins.size(), 1u);
    EXPECT_EQ(fourth->policy.pins[0].methods, std::vector<std::string>{"GET"});
    EXPECT_TRUE(injected_value(*fourth) == "v2") << "want the rotated value";
}

}  // namespace
}  // namespace egress::proxy
