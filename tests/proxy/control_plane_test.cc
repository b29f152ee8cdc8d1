// The control plane's runtime builds for static runs whose pins name store secrets: resolved
// by the run's scope, the served copy kept while nothing it is made of changes, rebuilt when
// a secret it uses does. Against a real file store, master key and admin token in a temp dir.
#include "proxy/control_plane.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <boost/json.hpp>

#include "proxy/runtime.h"

namespace egress::proxy {
namespace {

namespace fs = std::filesystem;

class StaticStorePins : public ::testing::Test {
protected:
    /// The config's `keys:` value (a master key file unless a test says otherwise).
    virtual std::string keys_yaml() { return "{master_key_file: " + dir_ + "/master.key}"; }
    /// A KMS plugin for keys.kms_command (dir_/kms.sh): `key-id` prints `id`, `wrap` and
    /// `unwrap` run the shell commands given (stdin: base64; stdout: base64).
    std::string kms_script(const std::string& id, const std::string& wrap,
                           const std::string& unwrap) {
        const std::string script = dir_ + "/kms.sh";
        std::ofstream f(script);
        f << "#!/bin/sh\ncase \"$1\" in\n  key-id) echo " << id << " ;;\n  wrap) " << wrap
          << " ;;\n  unwrap) " << unwrap << " ;;\n  *) exit 2 ;;\nesac\n";
        f.close();
        std::filesystem::permissions(script, fs::perms::owner_all);
        return script;
    }

    void SetUp() override {
        char tmpl[] = "/tmp/egress-cp-test-XXXXXX";
        ASSERT_NE(::mkdtemp(tmpl), nullptr);
        dir_ = tmpl;
        const std::string yaml =
            "admin: {token_file: " + dir_ + "/admin.token}\n"
            "state: {backend: file, path: " + dir_ + "/state}\n"
            "keys: " + keys_yaml() + "\n"
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
    void remove(const std::string& name, const std::string& scope_query) {
        auto r = cp_->handle("DELETE", "/v1/secrets/" + name + "?scope=" + scope_query, "");
        ASSERT_EQ(r.status, 204) << r.body;
    }
    /// POST /v1/runs with one bearer pin on a.test using secret `secret`; the run's id.
    std::string create_run(const std::string& scope_json, const std::string& secret) {
        auto r = cp_->handle("POST", "/v1/runs",
                             R"({"scope": )" + scope_json +
                                 R"(, "pins": [{"host": "a.test", "secret": ")" + secret +
                                 R"(", "inject": {"type": "bearer"}}]})");
        EXPECT_EQ(r.status, 201) << r.body;
        const auto at = r.body.find(R"("id":")");
        if (at == std::string::npos) return "";
        const auto start = at + 6;
        return r.body.substr(start, r.body.find('"', start) - start);
    }
    /// Reopens the control plane on the same files (as a restart does).
    Result<std::unique_ptr<ControlPlane>> reopen() {
        cp_.reset();
        return ControlPlane::open(statics_);
    }
    std::string state_path() const { return dir_ + "/state/state.json"; }
    boost::json::value read_state() const {
        std::ifstream in(state_path());
        std::stringstream text;
        text << in.rdbuf();
        return boost::json::parse(text.str());
    }
    /// Edits the state file (the control plane closed): run `id`'s CA key names `kek_id`.
    void seal_run_ca_key_under(const std::string& id, const std::string& kek_id) {
        auto st = read_state();
        bool found = false;
        for (auto& run : st.at("runs").as_array()) {
            if (run.at("id").as_string() == id) {
                run.at("ca_key").as_object()["kek_id"] = kek_id;
                found = true;
            }
        }
        ASSERT_TRUE(found) << id;
        std::ofstream(state_path(), std::ios::trunc) << boost::json::serialize(st);
    }
    std::string secret_kek_id(const std::string& name) const {
        const auto st = read_state();  // not in the for: the loop would outlive it
        for (const auto& s : st.at("secrets").as_array()) {
            if (s.at("name").as_string() == name) return std::string(s.at("kek_id").as_string());
        }
        return "";
    }
    std::string run_kek_id(const std::string& id) const {
        const auto st = read_state();
        for (const auto& r : st.at("runs").as_array()) {
            if (r.at("id").as_string() == id) {
                return std::string(r.at("ca_key").at("kek_id").as_string());
            }
        }
        return "";
    }
    /// A secret deleted and created again has its name, scope and version (1) again. A build
    /// that never sees it missing (a replica whose etcd watch resynchronized, or got both
    /// changes in one batch; here: no build between the two writes) must still take the new
    /// value, for the static run's store pin and for a dynamic run's pin, and let the old one
    /// go (wiped once the last runtime holding it is dropped).
    void expect_a_recreated_secret_is_a_new_value() {
        put("gh", R"({"org": "acme"})", "v-old");
        const std::string run_id = create_run(R"({"org": "acme"})", "gh");
        ASSERT_FALSE(run_id.empty());
        auto before = build();
        auto app1 = before->find("app");
        auto dyn1 = before->find(run_id);
        ASSERT_TRUE(app1 && dyn1);
        ASSERT_FALSE(app1->policy.pins.empty() || dyn1->policy.pins.empty());
        EXPECT_TRUE(injected_value(*app1) == "v-old" && injected_value(*dyn1) == "v-old");
        const std::weak_ptr<const credstore::SecretValue> old_value = app1->policy.pins[0].secret;

        remove("gh", "org%3Dacme");
        put("gh", R"({"org": "acme"})", "v-new");
        auto after = build();
        auto app2 = after->find("app");
        auto dyn2 = after->find(run_id);
        ASSERT_TRUE(app2 && dyn2);
        EXPECT_TRUE(app2 != app1) << "the static run's served copy was kept";
        EXPECT_TRUE(dyn2 != dyn1) << "the dynamic run was kept";
        EXPECT_TRUE(injected_value(*app2) == "v-new")
            << "static run: want the re-created secret's value";
        EXPECT_TRUE(injected_value(*dyn2) == "v-new")
            << "dynamic run: want the re-created secret's value";
        EXPECT_EQ(app2->ca, app1->ca);  // the same runs: their CAs are kept
        EXPECT_EQ(dyn2->ca, dyn1->ca);
        // Only the runtime held here keeps the old value now.
        before.reset();
        app1.reset();
        dyn1.reset();
        EXPECT_TRUE(old_value.expired()) << "the deleted secret's value is still held";
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
    EXPECT_EQ(app->unavailable_pins[0].host.text(), "a.test");
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

TEST_F(StaticStorePins, ASecretDeletedAndCreatedAgainBetweenTwoBuildsIsANewValue) {
    expect_a_recreated_secret_is_a_new_value();
}

// A run whose CA key is sealed under a key id no loaded key has (here: the state edited) is
// not served; `keys rotate` rewraps everything else, names the run in "skipped" and
// completes: no master.key.next is left for every start to trip over.
TEST_F(StaticStorePins, AKeyRotationSkipsARecordNoKeyUnwraps) {
    put("gh", R"({"org": "acme"})", "v1");
    const std::string run_id = create_run(R"({"org": "acme"})", "gh");
    ASSERT_FALSE(run_id.empty());
    const std::string old_id = secret_kek_id("gh");
    cp_.reset();
    seal_run_ca_key_under(run_id, "file:00000000");
    auto cp = reopen();
    ASSERT_TRUE(cp) << cp.error();
    cp_ = std::move(*cp);
    EXPECT_EQ(build()->find(run_id), nullptr) << "a run no key unwraps is not served";

    auto r = cp_->handle("POST", "/v1/keys/rotate", "");
    ASSERT_EQ(r.status, 200) << r.body;
    const auto out = boost::json::parse(r.body).as_object();
    const std::string new_id(out.at("kek_id").as_string());
    EXPECT_NE(new_id, old_id);
    EXPECT_EQ(out.at("rewrapped").to_number<int>(), 1) << r.body;
    const auto& skipped = out.at("skipped").as_array();
    ASSERT_EQ(skipped.size(), 1u) << r.body;
    EXPECT_EQ(skipped[0].at("kind").as_string(), "run");
    EXPECT_EQ(skipped[0].at("name").as_string(), run_id);
    EXPECT_NE(std::string(skipped[0].at("reason").as_string()).find("file:00000000"),
              std::string::npos);
    EXPECT_FALSE(fs::exists(dir_ + "/master.key.next"));
    EXPECT_EQ(secret_kek_id("gh"), new_id);
    EXPECT_EQ(run_kek_id(run_id), "file:00000000") << "a skipped record is left as it was";
    auto rt = build();
    ASSERT_TRUE(rt->find("app"));
    EXPECT_TRUE(injected_value(*rt->find("app")) == "v1");

    // A restart unseals the secret under the new key alone.
    cp = reopen();
    ASSERT_TRUE(cp) << cp.error();
    cp_ = std::move(*cp);
    EXPECT_TRUE(injected_value(*build()->find("app")) == "v1");
}

// The same when the rotation was interrupted after master.key.next was written: the start
// finishes it past the run no key unwraps (it had refused to start, at every start).
TEST_F(StaticStorePins, AnInterruptedRotationFinishesAtStartPastARecordNoKeyUnwraps) {
    put("gh", R"({"org": "acme"})", "v1");
    const std::string run_id = create_run(R"({"org": "acme"})", "gh");
    ASSERT_FALSE(run_id.empty());
    const std::string old_id = secret_kek_id("gh");
    cp_.reset();
    seal_run_ca_key_under(run_id, "file:00000000");
    {
        std::ofstream next(dir_ + "/master.key.next", std::ios::binary);
        next << std::string(32, '\x5a');
    }
    fs::permissions(dir_ + "/master.key.next", fs::perms::owner_read | fs::perms::owner_write);
    auto cp = reopen();
    ASSERT_TRUE(cp) << cp.error();
    cp_ = std::move(*cp);
    EXPECT_FALSE(fs::exists(dir_ + "/master.key.next"));
    EXPECT_NE(secret_kek_id("gh"), old_id);
    EXPECT_EQ(run_kek_id(run_id), "file:00000000");
    EXPECT_TRUE(injected_value(*build()->find("app")) == "v1");
    EXPECT_EQ(build()->find(run_id), nullptr);
}

// The same with keys.kms_command whose output starts with a fixed header, as some KMS's
// ciphertexts do: every wrapped data key then begins with the same bytes, and the unsealed
// value cache must not take the re-created record for the old one.
class HeaderKmsStorePins : public StaticStorePins {
protected:
    std::string keys_yaml() override {
        // Not a cipher: "wrap" puts an 18-byte header before the data key (base64 of each
        // joins into base64 of both), "unwrap" takes it off.
        return "{kms_command: " +
               kms_script("header-kms", "printf %s SEVBREVSSEVBREVSSEVBREVS; tr -d '\\n'",
                          "tr -d '\\n' | cut -c25-") +
               "}";
    }
};

TEST_F(HeaderKmsStorePins, ASecretDeletedAndCreatedAgainBetweenTwoBuildsIsANewValue) {
    expect_a_recreated_secret_is_a_new_value();
}

// A KEK rotation re-wraps every data key but seals nothing anew: dynamic runs are kept (no
// unwrap per pin through the KMS), and keep injecting the same value.
TEST_F(HeaderKmsStorePins, AKeyRotationKeepsDynamicRuns) {
    put("gh", R"({"org": "acme"})", "v-old");
    const std::string run_id = create_run(R"({"org": "acme"})", "gh");
    ASSERT_FALSE(run_id.empty());
    auto dyn1 = build()->find(run_id);
    ASSERT_TRUE(dyn1);
    auto r = cp_->handle("POST", "/v1/keys/rotate", "");
    ASSERT_EQ(r.status, 200) << r.body;
    auto dyn2 = build()->find(run_id);
    EXPECT_EQ(dyn2, dyn1);
    ASSERT_FALSE(dyn2->policy.pins.empty());
    EXPECT_TRUE(std::string(dyn2->policy.pins[0].secret->reveal()) == "v-old");
}

// A KMS that stops wrapping (the new key fails, not a record): the rotation fails as a whole
// and writes nothing, rather than skip records it could not wrap. Interrupted and found at
// start, it does not keep the control plane from opening.
class FailingWrapKmsStorePins : public StaticStorePins {
protected:
    std::string keys_yaml() override {
        // Not a cipher: the data key as it is; "wrap" fails once the file no-wrap exists.
        return "{kms_command: " +
               kms_script("plain-kms", "[ -e " + dir_ + "/no-wrap ] && exit 1; tr -d '\\n'",
                          "tr -d '\\n'") +
               ", master_key_file: " + dir_ + "/master.key}";
    }
};

TEST_F(FailingWrapKmsStorePins, ARotationWhoseNewKeyFailsChangesNothingAndDoesNotStopAStart) {
    put("gh", R"({"org": "acme"})", "v1");
    const std::string before = read_state().at("secrets").as_array().at(0).at("wrapped_dek")
                                   .as_string().c_str();
    std::ofstream(dir_ + "/no-wrap") << "";
    auto r = cp_->handle("POST", "/v1/keys/rotate", "");
    EXPECT_EQ(r.status, 500) << r.body;
    EXPECT_NE(r.body.find("kek_failed"), std::string::npos) << r.body;
    EXPECT_EQ(r.body.find("skipped"), std::string::npos) << r.body;
    EXPECT_EQ(read_state().at("secrets").as_array().at(0).at("wrapped_dek").as_string(), before);

    std::ofstream(dir_ + "/master.key.next") << "";  // what makes a start finish a rotation
    auto cp = reopen();
    ASSERT_TRUE(cp) << "a rotation that cannot complete must not stop a start: " << cp.error();
    cp_ = std::move(*cp);
    EXPECT_TRUE(injected_value(*build()->find("app")) == "v1");
}

}  // namespace
}  // namespace egress::proxy
