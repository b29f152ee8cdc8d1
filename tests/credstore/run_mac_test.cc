#include "credstore/run_mac.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "credstore/envelope.h"

namespace egress::credstore {
namespace {

namespace fs = std::filesystem;

class RunMacTest : public ::testing::Test {
protected:
    void SetUp() override {
        char name[] = "/tmp/egress_run_mac_test_XXXXXX";
        ASSERT_NE(mkdtemp(name), nullptr);
        dir_ = name;
        auto k = open_master_key_file(dir_ + "/master.key", true);
        ASSERT_TRUE(k.ok()) << k.error();
        kek_ = std::move(*k);
        auto n = open_master_key_file(dir_ + "/next.key", true);
        ASSERT_TRUE(n.ok()) << n.error();
        next_ = std::move(*n);
    }
    void TearDown() override {
        std::error_code ec;
        fs::remove_all(dir_, ec);
    }

    // A run as create_run makes it: its CA key sealed, the record signed with that sealing's key.
    RunRecord signed_run(const std::string& id, SecretPtr* key_out = nullptr) {
        RunRecord r;
        r.id = id;
        r.scope = {"acme", "web", "", ""};
        r.token_sha256 = sha256_hex("token-" + id);
        r.created_at = 1000;
        r.expires_at = 2800;
        r.allow_hosts = {"pypi.org"};
        r.source_cidrs = {"10.0.0.0/24"};
        PinRecord p;
        p.id = "pin_1";
        p.host = "api.github.com";
        p.secret = "github_token";
        p.inject.type = "bearer";
        p.path_prefixes = {"/repos/acme/"};
        p.methods = {"GET"};
        p.extra_headers = {{"x-extra", "1"}};
        p.expires_at = 2000;
        r.pins.push_back(p);
        r.ca_cert_pem = "-----BEGIN CERTIFICATE-----\nnot parsed here\n";
        SecretPtr key;
        auto sealed = seal(*kek_, "ca:" + id, r.scope, 1, "ca key pem bytes", &key);
        EXPECT_TRUE(sealed.ok());
        r.ca_key = *sealed;
        sign_run(r, *key);
        if (key_out != nullptr) *key_out = key;
        return r;
    }

    std::string dir_;
    std::unique_ptr<KeyProvider> kek_;
    std::unique_ptr<KeyProvider> next_;
};

TEST_F(RunMacTest, ASignedRunVerifiesWithTheKeyItsCaKeyUnsealsTo) {
    SecretPtr made;
    RunRecord r = signed_run("run_a", &made);
    EXPECT_EQ(r.mac.size(), 64u);
    SecretPtr unsealed;
    ASSERT_TRUE(unseal(*kek_, r.ca_key, &unsealed).ok());
    ASSERT_TRUE(unsealed);
    EXPECT_EQ(unsealed->reveal(), made->reveal());  // seal's and unseal's are the same key
    EXPECT_TRUE(run_mac_valid(r, *unsealed));
    // as the stores keep it (JSON), read back
    auto back = run_record_from_json(run_record_to_json(r));
    ASSERT_TRUE(back.ok()) << back.error();
    EXPECT_EQ(back->mac, r.mac);
    EXPECT_TRUE(run_mac_valid(*back, *unsealed));
}

TEST_F(RunMacTest, AnAwsPinRoundTripsToTheSameMac) {
    SecretPtr key;
    RunRecord r = signed_run("run_aws", &key);
    r.pins[0].inject.type = "aws-sigv4";
    r.pins[0].inject.access_key_id = "AKIDEXAMPLE";
    r.pins[0].inject.region = "us-east-1";
    r.pins[0].inject.service = "s3";
    sign_run(r, *key);
    auto back = run_record_from_json(run_record_to_json(r));
    ASSERT_TRUE(back.ok()) << back.error();
    EXPECT_TRUE(run_mac_valid(*back, *key));
    back->pins[0].inject.region = "eu-west-1";
    EXPECT_FALSE(run_mac_valid(*back, *key));
}

// Every field that decides where a secret goes, changed by someone who can write the state
// but has no master key: the MAC no longer verifies.
TEST_F(RunMacTest, AnyChangeOutsideEgressdFailsToVerify) {
    SecretPtr key;
    const RunRecord good = signed_run("run_b", &key);
    const std::vector<std::pair<const char*, std::function<void(RunRecord&)>>> edits = {
        {"token_sha256", [](RunRecord& r) { r.token_sha256 = sha256_hex("attacker"); }},
        {"an extra pin",
         [](RunRecord& r) {
             PinRecord p = r.pins[0];
             p.id = "pin_evil";
             p.host = "evil.test";
             r.pins.push_back(p);
         }},
        {"pin host", [](RunRecord& r) { r.pins[0].host = "evil.test"; }},
        {"pin secret", [](RunRecord& r) { r.pins[0].secret = "other_token"; }},
        {"pin inject", [](RunRecord& r) { r.pins[0].inject.type = "header"; }},
        {"pin template", [](RunRecord& r) { r.pins[0].inject.value_template = "x{secret}"; }},
        {"pin path", [](RunRecord& r) { r.pins[0].path_prefixes.clear(); }},
        {"pin methods", [](RunRecord& r) { r.pins[0].methods.push_back("POST"); }},
        {"pin header", [](RunRecord& r) { r.pins[0].extra_headers[0].second = "2"; }},
        {"pin expiry", [](RunRecord& r) { r.pins[0].expires_at += 3600; }},
        {"scope", [](RunRecord& r) { r.scope.project.clear(); }},
        {"expiry", [](RunRecord& r) { r.expires_at += 3600; }},
        {"created", [](RunRecord& r) { r.created_at -= 1; }},
        {"revoked", [](RunRecord& r) { r.revoked = true; }},
        {"allow_hosts", [](RunRecord& r) { r.allow_hosts.push_back("evil.test"); }},
        {"source_cidrs", [](RunRecord& r) { r.source_cidrs.clear(); }},
        {"ca_cert_pem", [](RunRecord& r) { r.ca_cert_pem += "x"; }},
        {"mac removed", [](RunRecord& r) { r.mac.clear(); }},
        {"mac upper case", [](RunRecord& r) {
             for (char& c : r.mac) c = static_cast<char>(std::toupper(c));
         }},
        // two list elements' boundary moved: length-prefixed fields tell them apart
        {"list boundary", [](RunRecord& r) { r.allow_hosts = {"pypi.", "org"}; }},
    };
    ASSERT_TRUE(run_mac_valid(good, *key));
    for (const auto& [what, edit] : edits) {
        RunRecord r = good;
        edit(r);
        EXPECT_FALSE(run_mac_valid(r, *key)) << what;
    }
}

// A record made of another run's parts (its CA key and MAC, or its MAC alone) does not verify.
TEST_F(RunMacTest, AnotherRunsKeyOrMacDoesNotVerify) {
    SecretPtr key_a;
    SecretPtr key_b;
    RunRecord a = signed_run("run_c", &key_a);
    RunRecord b = signed_run("run_d", &key_b);
    EXPECT_NE(key_a->reveal(), key_b->reveal());
    EXPECT_FALSE(run_mac_valid(a, *key_b));
    RunRecord copy = a;  // run a's record under another id
    copy.id = b.id;
    EXPECT_FALSE(run_mac_valid(copy, *key_a));
    EXPECT_FALSE(run_mac_valid(copy, *key_b));
}

// keys rotate rewraps the CA key's DEK under the new KEK: the MAC key is the same, the record
// (its MAC untouched) still verifies.
TEST_F(RunMacTest, AKekRotationKeepsTheMacValid) {
    SecretPtr key;
    RunRecord r = signed_run("run_e", &key);
    auto rewrapped = rewrap(*kek_, *next_, r.ca_key);
    ASSERT_TRUE(rewrapped.ok()) << rewrapped.error();
    r.ca_key = *rewrapped;
    SecretPtr after;
    ASSERT_TRUE(unseal(*next_, r.ca_key, &after).ok());
    EXPECT_EQ(after->reveal(), key->reveal());
    EXPECT_TRUE(run_mac_valid(r, *after));
    // A CA key whose blob was changed gives no key at all.
    RunRecord bad = r;
    bad.ca_key.ciphertext[4] = bad.ca_key.ciphertext[4] == 'A' ? 'B' : 'A';
    SecretPtr none;
    EXPECT_FALSE(unseal(*next_, bad.ca_key, &none).ok());
    EXPECT_FALSE(none);
}

}  // namespace
}  // namespace egress::credstore
