// Run CA files: build_runtime writes nothing; write_ca_files writes all of them or none.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "proxy/runtime.h"

namespace egress::proxy {
namespace {

namespace fs = std::filesystem;

class RuntimeCaFiles : public ::testing::Test {
protected:
    void SetUp() override {
        char tmpl[] = "/tmp/egress-runtime-ca-XXXXXX";
        ASSERT_NE(::mkdtemp(tmpl), nullptr);
        dir_ = tmpl;
    }
    void TearDown() override {
        std::error_code ec;
        fs::remove_all(dir_, ec);
    }

    std::shared_ptr<const Config> config(const std::string& r1_ttl, const std::string& r2_out) {
        std::string yaml = "runs:\n"
                           "  - id: r1\n"
                           "    token_file: " + write("r1.token", "tok1") + "\n"
                           "    ttl: " + r1_ttl + "\n"
                           "    ca_cert_out: " + path("r1-ca.pem") + "\n"
                           "  - id: r2\n"
                           "    token_file: " + write("r2.token", "tok2") + "\n"
                           "    ca_cert_out: " + r2_out + "\n";
        auto c = parse_config(yaml, "test.yaml");
        EXPECT_TRUE(c) << c.error();
        return std::make_shared<const Config>(std::move(*c));
    }
    std::shared_ptr<Runtime> build(std::shared_ptr<const Config> c, const Runtime* prev = nullptr) {
        BuildWarnings w;
        auto rt = build_runtime(std::move(c), w, prev);
        EXPECT_TRUE(rt) << rt.error();
        return *rt;
    }
    std::string path(const std::string& name) const { return dir_ + "/" + name; }
    std::string write(const std::string& name, const std::string& content) const {
        std::ofstream(path(name)) << content;
        return path(name);
    }
    static std::string read(const std::string& p) {
        std::ifstream in(p);
        std::stringstream ss;
        ss << in.rdbuf();
        return ss.str();
    }

    std::string dir_;
};

TEST_F(RuntimeCaFiles, BuildWritesNothingWriteCaFilesWritesEveryRun) {
    auto rt = build(config("null", path("r2-ca.pem")));
    EXPECT_FALSE(fs::exists(path("r1-ca.pem")));
    ASSERT_TRUE(write_ca_files(*rt));
    EXPECT_EQ(read(path("r1-ca.pem")), rt->find("r1")->ca->cert_pem());
    EXPECT_EQ(read(path("r2-ca.pem")), rt->find("r2")->ca->cert_pem());
}

TEST_F(RuntimeCaFiles, OneUnwritableFileLeavesEveryFileAsItWas) {
    auto first = build(config("null", path("r2-ca.pem")));
    ASSERT_TRUE(write_ca_files(*first));
    const std::string r1_before = read(path("r1-ca.pem"));
    // A reload with a new ttl for r1 (a new CA) and an r2 file that cannot be written.
    write("not-a-dir", "x");
    auto next = build(config("1h", path("not-a-dir/r2-ca.pem")), first.get());
    ASSERT_NE(next->find("r1")->ca, first->find("r1")->ca);
    auto w = write_ca_files(*next, first.get());
    ASSERT_FALSE(w);
    EXPECT_NE(w.error().find("runs[1].ca_cert_out"), std::string::npos) << w.error();
    EXPECT_EQ(read(path("r1-ca.pem")), r1_before);
    EXPECT_FALSE(fs::exists(path("r1-ca.pem.tmp")));
}

TEST_F(RuntimeCaFiles, AKeptCaIsNotRewritten) {
    auto first = build(config("null", path("r2-ca.pem")));
    ASSERT_TRUE(write_ca_files(*first));
    fs::remove(path("r1-ca.pem"));
    auto next = build(config("null", path("r2-ca.pem")), first.get());
    ASSERT_EQ(next->find("r1")->ca, first->find("r1")->ca);
    ASSERT_TRUE(write_ca_files(*next, first.get()));
    EXPECT_FALSE(fs::exists(path("r1-ca.pem")));  // skipped: same CA, same file
    // A new path for the kept CA is written.
    auto moved = build(config("null", path("r2-moved.pem")), next.get());
    ASSERT_TRUE(write_ca_files(*moved, next.get()));
    EXPECT_EQ(read(path("r2-moved.pem")), first->find("r2")->ca->cert_pem());
}

TEST_F(RuntimeCaFiles, ProcessLifetimeRunsGetStaticCaValidityAndANewValueMakesANewCa) {
    auto rt = build(config("null", path("r2-ca.pem")));
    const auto left = rt->find("r1")->ca->not_after() - std::chrono::system_clock::now();
    EXPECT_GT(left, std::chrono::hours(24 * 364));  // limits.static_ca_validity: 8760h
    EXPECT_LE(left, std::chrono::hours(24 * 365));
    auto ttl = build(config("1h", path("r2-ca.pem")));
    EXPECT_LE(ttl->find("r1")->ca->not_after() - std::chrono::system_clock::now(),
              std::chrono::hours(1));
    // A reload that changes the key: the run gets a new CA (and so a new ca_cert_out).
    auto c = parse_config("limits: {static_ca_validity: 2h}\nruns:\n  - id: r1\n"
                          "    token_file: " + write("r1.token", "tok1") + "\n",
                          "t.yaml");
    ASSERT_TRUE(c) << c.error();
    BuildWarnings w;
    auto next = build_runtime(std::make_shared<const Config>(std::move(*c)), w, rt.get());
    ASSERT_TRUE(next) << next.error();
    EXPECT_NE((*next)->find("r1")->ca, rt->find("r1")->ca);
    EXPECT_LE((*next)->find("r1")->ca->not_after() - std::chrono::system_clock::now(),
              std::chrono::hours(2));
}

TEST(CaExpiry, WarnsATenthOfTheValidityAheadAtMostAWeekThenExpired) {
    using namespace std::chrono;
    const auto end = system_clock::now();
    const auto year = duration_cast<seconds>(hours(24 * 365));
    EXPECT_EQ(ca_expiry(end, year, end - hours(24 * 8)), CaExpiry::Fine);
    EXPECT_EQ(ca_expiry(end, year, end - hours(24 * 7)), CaExpiry::Soon);  // capped: a week
    EXPECT_EQ(ca_expiry(end, year, end - seconds(1)), CaExpiry::Soon);
    EXPECT_EQ(ca_expiry(end, year, end), CaExpiry::Expired);
    EXPECT_EQ(ca_expiry(end, year, end + hours(1)), CaExpiry::Expired);
    const auto day = duration_cast<seconds>(hours(24));
    EXPECT_EQ(ca_expiry(end, day, end - minutes(145)), CaExpiry::Fine);  // a tenth: 144 min
    EXPECT_EQ(ca_expiry(end, day, end - minutes(144)), CaExpiry::Soon);
}

TEST_F(RuntimeCaFiles, StoreSecretPinsAreOffUntilResolvedThenMergedInConfigOrder) {
    // pins: [0] file, [1] store "gh" (same host as [2]: order decides), [2] file, [3] store
    // "npm" on its own host.
    auto c = parse_config(
        "runs:\n  - id: r1\n    token_file: " + write("t", "tok") +
            "\n    scope: {org: acme, project: web}\n    pins:\n"
            "      - {host: a.test, secret_file: " + write("fa", "file-a") +
            ", inject: {type: bearer}}\n"
            "      - {host: b.test, secret: gh, inject: {type: bearer}, path_prefixes: [/x/]}\n"
            "      - {host: b.test, secret_file: " + write("fb", "file-b") +
            ", inject: {type: bearer}}\n"
            "      - {host: c.test, secret: npm, inject: {type: basic, username: ci}}\n",
        "t.yaml");
    ASSERT_TRUE(c) << c.error();
    auto statics = build(std::make_shared<const Config>(std::move(*c)));
    ASSERT_TRUE(statics);
    const proxy::Run& r = *statics->find("r1");
    EXPECT_EQ(r.scope.to_string(), "org=acme,project=web");
    ASSERT_EQ(r.policy.pins.size(), 2u);  // the file pins only
    ASSERT_EQ(r.store_pins.size(), 2u);
    EXPECT_EQ(r.store_pins[0].pin.id, "r1-pin-1");
    EXPECT_EQ(r.store_pins[0].pin.secret_name, "gh");
    EXPECT_EQ(r.store_pins[0].after, 1u);
    EXPECT_EQ(r.store_pins[0].yaml_path, "runs[0].pins[1]");
    EXPECT_EQ(r.store_pins[1].after, 2u);
    EXPECT_FALSE(r.store_pins[0].pin.secret);
    // As built (not yet resolved), the store pins' hosts are refused as secret_unavailable.
    ASSERT_EQ(r.unavailable_pins.size(), 2u);
    EXPECT_EQ(r.unavailable_pins[0].host.text(), "b.test");
    EXPECT_EQ(r.unavailable_pins[1].host.text(), "c.test");

    // gh resolved, npm not: merged in config order, npm's host stays unavailable.
    auto gh = std::make_shared<const credstore::SecretValue>("store-gh");
    policy::InjectionCache injections;
    auto served = with_store_secrets(r, {gh, nullptr}, injections);
    ASSERT_EQ(served->policy.pins.size(), 3u);
    EXPECT_EQ(served->policy.pins[0].id, "r1-pin-0");
    EXPECT_EQ(served->policy.pins[1].id, "r1-pin-1");
    EXPECT_EQ(served->policy.pins[2].id, "r1-pin-2");
    EXPECT_EQ(served->policy.pins[1].secret, gh);
    ASSERT_TRUE(served->policy.pins[1].injection);
    ASSERT_EQ(served->unavailable_pins.size(), 1u);
    EXPECT_EQ(served->unavailable_pins[0].host.text(), "c.test");
    EXPECT_EQ(served->ca, r.ca);  // the same CA and leaf cache: sandboxes keep trusting it
    EXPECT_EQ(served->leaves, r.leaves);
    EXPECT_EQ(served->token, r.token);
    EXPECT_TRUE(served->store_pins.empty());

    // The first matching pin in order wins: /x/ on b.test is the store pin, / the file pin.
    policy::GlobalPolicy global;
    const auto now = policy::Clock::now();
    const policy::HostPort b{"b.test", 443};
    const policy::Pin* at_x = policy::match_pin(global, served->policy, b, "GET", "/x/1", now);
    const policy::Pin* at_y = policy::match_pin(global, served->policy, b, "GET", "/y", now);
    ASSERT_NE(at_x, nullptr);
    ASSERT_NE(at_y, nullptr);
    EXPECT_EQ(at_x->id, "r1-pin-1");
    EXPECT_EQ(at_y->id, "r1-pin-2");

    // Both resolved: nothing unavailable, four pins.
    auto npm = std::make_shared<const credstore::SecretValue>("store-npm");
    auto both = with_store_secrets(r, {gh, npm}, injections);
    EXPECT_EQ(both->policy.pins.size(), 4u);
    EXPECT_TRUE(both->unavailable_pins.empty());
    EXPECT_EQ(both->policy.pins[3].id, "r1-pin-3");
}

}  // namespace
}  // namespace egress::proxy
