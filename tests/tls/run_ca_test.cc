#include "tls/run_ca.h"

#include <gtest/gtest.h>
#include <openssl/bn.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509v3.h>

#include <ctime>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace egress::tls {
namespace {

using std::chrono::hours;
using std::chrono::seconds;

std::unique_ptr<RunCa> make_ca(std::string_view id = "run-1", seconds validity = hours(1)) {
    auto ca = RunCa::create(id, validity);
    EXPECT_TRUE(ca.ok()) << (ca.ok() ? "" : ca.error());
    return std::move(ca).value();
}

std::shared_ptr<const Leaf> must_mint(const RunCa& ca, const std::string& host,
                                      seconds validity = hours(24)) {
    auto leaf = ca.mint(host, validity);
    EXPECT_TRUE(leaf.ok()) << (leaf.ok() ? "" : leaf.error());
    return leaf.ok() ? leaf.value() : nullptr;
}

/// X509_verify_cert of `leaf` against a store holding only `ca`, for `host` as a TLS server.
int verify_error(X509* leaf, X509* ca, const std::string& host) {
    X509_STORE* store = X509_STORE_new();
    X509_STORE_add_cert(store, ca);
    X509_STORE_CTX* ctx = X509_STORE_CTX_new();
    X509_STORE_CTX_init(ctx, store, leaf, nullptr);
    X509_STORE_CTX_set_purpose(ctx, X509_PURPOSE_SSL_SERVER);
    X509_VERIFY_PARAM* param = X509_STORE_CTX_get0_param(ctx);
    ASN1_OCTET_STRING* ip = a2i_IPADDRESS(host.c_str());
    if (ip != nullptr) {
        ASN1_OCTET_STRING_free(ip);
        X509_VERIFY_PARAM_set1_ip_asc(param, host.c_str());
    } else {
        X509_VERIFY_PARAM_set1_host(param, host.c_str(), host.size());
    }
    ERR_clear_error();
    const int rc = X509_verify_cert(ctx);
    const int err = rc == 1 ? X509_V_OK : X509_STORE_CTX_get_error(ctx);
    X509_STORE_CTX_free(ctx);
    X509_STORE_free(store);
    return err == X509_V_OK && rc != 1 ? X509_V_ERR_UNSPECIFIED : err;
}

/// What a leaked CA key could sign for `host`, which RunCa::mint refuses outside the CA's
/// name constraints: a leaf built as mint builds one (minted by another CA), issued and signed
/// again by `ca`'s key. Shows what the constraints in the CA certificate itself allow.
X509Ptr forge_leaf(const RunCa& ca, const std::string& host) {
    auto other = RunCa::create("forger", hours(1));
    EXPECT_TRUE(other.ok());
    auto leaf = (*other)->mint(host);
    EXPECT_TRUE(leaf.ok()) << (leaf.ok() ? "" : leaf.error());
    X509Ptr cert(X509_dup((*leaf)->cert.get()));
    X509_set_issuer_name(cert.get(), X509_get_subject_name(ca.cert()));
    const int akid = X509_get_ext_by_NID(cert.get(), NID_authority_key_identifier, -1);
    X509_EXTENSION_free(X509_delete_ext(cert.get(), akid));
    std::string key_pem = ca.key_pem();
    BIO* bio = BIO_new_mem_buf(key_pem.data(), static_cast<int>(key_pem.size()));
    EVP_PKEY* key = PEM_read_bio_PrivateKey(bio, nullptr, nullptr, nullptr);
    BIO_free(bio);
    EXPECT_NE(key, nullptr);
    EXPECT_GT(X509_sign(cert.get(), key, EVP_sha256()), 0);
    EVP_PKEY_free(key);
    return cert;
}

/// Seconds from now to `t` (negative: in the past).
long seconds_from_now(const ASN1_TIME* t) {
    int days = 0;
    int secs = 0;
    EXPECT_EQ(ASN1_TIME_diff(&days, &secs, nullptr, t), 1);
    return days * 86400L + secs;
}

std::vector<std::pair<int, std::string>> san_entries(X509* cert) {
    std::vector<std::pair<int, std::string>> out;
    auto* names =
        static_cast<GENERAL_NAMES*>(X509_get_ext_d2i(cert, NID_subject_alt_name, nullptr, nullptr));
    for (int i = 0; i < sk_GENERAL_NAME_num(names); ++i) {
        const GENERAL_NAME* gn = sk_GENERAL_NAME_value(names, i);
        int type = 0;
        auto* value = static_cast<ASN1_STRING*>(GENERAL_NAME_get0_value(gn, &type));
        out.emplace_back(type,
                         std::string(reinterpret_cast<const char*>(ASN1_STRING_get0_data(value)),
                                     ASN1_STRING_length(value)));
    }
    GENERAL_NAMES_free(names);
    return out;
}

bool extension_critical(X509* cert, int nid) {
    const int idx = X509_get_ext_by_NID(cert, nid, -1);
    EXPECT_GE(idx, 0) << OBJ_nid2sn(nid);
    return idx >= 0 && X509_EXTENSION_get_critical(X509_get_ext(cert, idx)) == 1;
}

std::string common_name(X509* cert) {
    char buf[256] = {};
    X509_NAME_get_text_by_NID(X509_get_subject_name(cert), NID_commonName, buf, sizeof(buf));
    return buf;
}

std::string group_name(const EVP_PKEY* key) {
    char buf[64] = {};
    size_t len = 0;
    EVP_PKEY_get_group_name(key, buf, sizeof(buf), &len);
    return buf;
}

TEST(RunCaTest, CaCertificateIsARestrictedCa) {
    auto ca = make_ca("run-1");
    X509* cert = ca->cert();
    ASSERT_NE(cert, nullptr);
    EXPECT_EQ(X509_get_version(cert), X509_VERSION_3);
    EXPECT_EQ(X509_check_ca(cert), 1);
    EXPECT_NE(X509_get_extension_flags(cert) & EXFLAG_CA, 0u);
    EXPECT_NE(X509_get_extension_flags(cert) & EXFLAG_SS, 0u);
    EXPECT_EQ(X509_get_key_usage(cert), static_cast<uint32_t>(KU_KEY_CERT_SIGN | KU_CRL_SIGN));
    EXPECT_TRUE(extension_critical(cert, NID_basic_constraints));
    EXPECT_TRUE(extension_critical(cert, NID_key_usage));
    EXPECT_EQ(X509_get_pathlen(cert), 0);
    EXPECT_NE(X509_get0_subject_key_id(cert), nullptr);
    EXPECT_EQ(common_name(cert), "egressd run run-1");
    EXPECT_EQ(X509_verify(cert, X509_get0_pubkey(cert)), 1);
    EXPECT_EQ(group_name(X509_get0_pubkey(cert)), "prime256v1");
}

TEST(RunCaTest, CaValidityIsBackdatedAndBoundedByTheRun) {
    auto ca = make_ca("run-1", hours(1));
    EXPECT_NEAR(seconds_from_now(X509_get0_notBefore(ca->cert())), -300, 5);
    EXPECT_NEAR(seconds_from_now(X509_get0_notAfter(ca->cert())), 3600, 5);
    const auto left = ca->not_after() - std::chrono::system_clock::now();
    EXPECT_NEAR(std::chrono::duration_cast<seconds>(left).count(), 3600, 5);
    EXPECT_EQ(X509_cmp_time(X509_get0_notAfter(ca->cert()), nullptr), 1);
}

TEST(RunCaTest, RejectsNonPositiveValidity) {
    EXPECT_FALSE(RunCa::create("x", seconds(0)).ok());
    EXPECT_FALSE(RunCa::create("x", seconds(-5)).ok());
}

TEST(RunCaTest, LongRunIdIsTruncatedInTheCommonName) {
    auto ca = make_ca(std::string(300, 'r'));
    ASSERT_NE(ca, nullptr);
    EXPECT_EQ(common_name(ca->cert()).size(), 64u);
}

TEST(RunCaTest, PemRoundTrips) {
    auto ca = make_ca();
    const std::string pem = ca->cert_pem();
    EXPECT_EQ(pem.rfind("-----BEGIN CERTIFICATE-----", 0), 0u);
    BIO* bio = BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size()));
    X509Ptr parsed(PEM_read_bio_X509(bio, nullptr, nullptr, nullptr));
    BIO_free(bio);
    ASSERT_NE(parsed, nullptr);
    EXPECT_EQ(X509_cmp(parsed.get(), ca->cert()), 0);
}

TEST(RunCaTest, LeafVerifiesUnderItsOwnRunCaOnly) {
    auto ca = make_ca("run-1");
    auto other = make_ca("run-2");
    auto same_name = make_ca("run-1");  // same subject, different key
    auto leaf = must_mint(*ca, "a.test");
    ASSERT_NE(leaf, nullptr);
    EXPECT_EQ(verify_error(leaf->cert.get(), ca->cert(), "a.test"), X509_V_OK);
    EXPECT_NE(verify_error(leaf->cert.get(), other->cert(), "a.test"), X509_V_OK);
    EXPECT_NE(verify_error(leaf->cert.get(), same_name->cert(), "a.test"), X509_V_OK);
    EXPECT_EQ(verify_error(leaf->cert.get(), ca->cert(), "b.test"), X509_V_ERR_HOSTNAME_MISMATCH);
    EXPECT_EQ(X509_check_host(leaf->cert.get(), "a.test", 0, 0, nullptr), 1);
    EXPECT_EQ(X509_check_host(leaf->cert.get(), "b.test", 0, 0, nullptr), 0);
    EXPECT_EQ(X509_check_host(leaf->cert.get(), "x.a.test", 0, 0, nullptr), 0);
}

TEST(RunCaTest, LoadFromSealedKeyServesTheSameCa) {
    auto ca = make_ca("run-1");
    std::string key = ca->key_pem();
    ASSERT_NE(key.find("PRIVATE KEY"), std::string::npos);
    auto loaded = RunCa::load(ca->cert_pem(), key);
    ASSERT_TRUE(loaded.ok()) << loaded.error();
    EXPECT_EQ(X509_cmp((*loaded)->cert(), ca->cert()), 0);
    using SysClock = std::chrono::system_clock;
    EXPECT_EQ(SysClock::to_time_t((*loaded)->not_after()), SysClock::to_time_t(ca->not_after()));
    auto leaf = must_mint(**loaded, "a.test");
    ASSERT_NE(leaf, nullptr);
    EXPECT_EQ(verify_error(leaf->cert.get(), ca->cert(), "a.test"), X509_V_OK);
    auto other = make_ca("run-2");
    EXPECT_FALSE(RunCa::load(ca->cert_pem(), other->key_pem()).ok());
    EXPECT_FALSE(RunCa::load("junk", key).ok());
}

TEST(RunCaTest, NameConstraintsPermitOnlyTheRunsHosts) {
    auto ca = RunCa::create("run-nc", hours(1), {"api.test", ".s3.test", "127.0.0.1"});
    ASSERT_TRUE(ca.ok()) << ca.error();
    EXPECT_TRUE(extension_critical((*ca)->cert(), NID_name_constraints));
    auto ok = must_mint(**ca, "api.test");
    auto sub = must_mint(**ca, "b.s3.test");
    auto ip = must_mint(**ca, "127.0.0.1");
    auto outside = forge_leaf(**ca, "evil.test");
    auto apex = forge_leaf(**ca, "s3.test");
    EXPECT_EQ(verify_error(ok->cert.get(), (*ca)->cert(), "api.test"), X509_V_OK);
    EXPECT_EQ(verify_error(sub->cert.get(), (*ca)->cert(), "b.s3.test"), X509_V_OK);
    EXPECT_EQ(verify_error(ip->cert.get(), (*ca)->cert(), "127.0.0.1"), X509_V_OK);
    EXPECT_EQ(verify_error(outside.get(), (*ca)->cert(), "evil.test"),
              X509_V_ERR_PERMITTED_VIOLATION);
    EXPECT_EQ(verify_error(apex.get(), (*ca)->cert(), "s3.test"),
              X509_V_ERR_PERMITTED_VIOLATION);
    EXPECT_FALSE(RunCa::create("bad", hours(1), {"a,DNS:evil.test"}).ok());
    EXPECT_EQ(RunCa::permitted_names((*ca)->cert_pem()),
              (std::vector<std::string>{"api.test", ".s3.test", "127.0.0.1"}));
    // Addresses: only the permitted one; no other IPv4, and no IPv6 (OpenSSL finds it outside
    // the permitted addresses first; it is also excluded, for verifiers that keep families apart).
    auto ip_other = forge_leaf(**ca, "10.0.0.1");
    auto ip6 = forge_leaf(**ca, "::1");
    EXPECT_EQ(verify_error(ip_other.get(), (*ca)->cert(), "10.0.0.1"),
              X509_V_ERR_PERMITTED_VIOLATION);
    EXPECT_EQ(verify_error(ip6.get(), (*ca)->cert(), "::1"),
              X509_V_ERR_PERMITTED_VIOLATION);
}

// The CA itself signs nothing its constraints forbid (a reload may have routed another host
// to the run since it was made): the mint fails with kOutsideRunCa, and egressd refuses the
// CONNECT instead of handing the client a leaf it must reject.
TEST(RunCaTest, MintRefusesNamesOutsideTheConstraints) {
    auto ca = RunCa::create("run-nc", hours(1), {"api.test", ".s3.test", "127.0.0.1"});
    ASSERT_TRUE(ca.ok()) << ca.error();
    for (const char* host : {"evil.test", "s3.test", "10.0.0.1", "::1", "api.test.evil"}) {
        auto leaf = (*ca)->mint(host);
        ASSERT_FALSE(leaf.ok()) << host;
        EXPECT_EQ(leaf.error(), kOutsideRunCa) << host;
    }
    for (const char* host : {"api.test", "x.api.test", "b.s3.test", "127.0.0.1"}) {
        EXPECT_TRUE((*ca)->mint(host).ok()) << host;
    }
    // An unconstrained CA mints for any valid name.
    EXPECT_TRUE(make_ca("plain")->mint("evil.test").ok());
}

// A CA made for host names only certifies no address of either family: a name type without a
// subtree would be unconstrained (RFC 5280), so both are excluded.
TEST(RunCaTest, NameConstraintsOfHostNamesExcludeEveryAddress) {
    auto ca = RunCa::create("run-names", hours(1), {"api.test"});
    ASSERT_TRUE(ca.ok()) << ca.error();
    auto name = must_mint(**ca, "api.test");
    auto v4 = forge_leaf(**ca, "93.184.216.34");
    auto v6 = forge_leaf(**ca, "2001:db8::1");
    EXPECT_EQ(verify_error(name->cert.get(), (*ca)->cert(), "api.test"), X509_V_OK);
    EXPECT_EQ(verify_error(v4.get(), (*ca)->cert(), "93.184.216.34"),
              X509_V_ERR_EXCLUDED_VIOLATION);
    EXPECT_EQ(verify_error(v6.get(), (*ca)->cert(), "2001:db8::1"),
              X509_V_ERR_EXCLUDED_VIOLATION);
    EXPECT_EQ(RunCa::permitted_names(make_ca("plain")->cert_pem()), std::nullopt);
    EXPECT_EQ(RunCa::permitted_names("junk"), std::nullopt);
}

TEST(RunCaTest, NameConstraintsOfAddressesExcludeEveryHostName) {
    // A CA made for addresses only: no DNS subtree permitted would leave host names
    // unconstrained (RFC 5280 4.2.1.10), so a leaked CA could certify any of them, and egressd
    // itself would mint them (an unpinned intercepted host). Every host name is excluded.
    auto ca = RunCa::create("run-ip", hours(1), {"127.0.0.1"});
    ASSERT_TRUE(ca.ok()) << ca.error();
    auto ip = must_mint(**ca, "127.0.0.1");
    EXPECT_EQ(verify_error(ip->cert.get(), (*ca)->cert(), "127.0.0.1"), X509_V_OK);
    auto name = forge_leaf(**ca, "evil.test");
    EXPECT_EQ(verify_error(name.get(), (*ca)->cert(), "evil.test"),
              X509_V_ERR_PERMITTED_VIOLATION);
    auto minted = (*ca)->mint("evil.test");
    ASSERT_FALSE(minted.ok());
    EXPECT_EQ(minted.error(), kOutsideRunCa);
    EXPECT_EQ(RunCa::permitted_names((*ca)->cert_pem()),
              (std::vector<std::string>{"127.0.0.1"}));
}

TEST(RunCaTest, LeafHasServerFieldsAndAkid) {
    auto ca = make_ca();
    auto leaf = must_mint(*ca, "api.example.test");
    ASSERT_NE(leaf, nullptr);
    X509* cert = leaf->cert.get();
    EXPECT_EQ(X509_get_version(cert), X509_VERSION_3);
    EXPECT_EQ(common_name(cert), "api.example.test");
    EXPECT_EQ(X509_NAME_cmp(X509_get_issuer_name(cert), X509_get_subject_name(ca->cert())), 0);
    EXPECT_EQ(X509_check_ca(cert), 0);
    EXPECT_EQ(X509_get_key_usage(cert), static_cast<uint32_t>(KU_DIGITAL_SIGNATURE));
    EXPECT_TRUE(extension_critical(cert, NID_key_usage));
    EXPECT_EQ(X509_get_extended_key_usage(cert), static_cast<uint32_t>(XKU_SSL_SERVER));
    ASSERT_NE(X509_get0_authority_key_id(cert), nullptr);
    EXPECT_EQ(ASN1_OCTET_STRING_cmp(X509_get0_authority_key_id(cert),
                                    X509_get0_subject_key_id(ca->cert())),
              0);
    EXPECT_EQ(X509_verify(cert, X509_get0_pubkey(ca->cert())), 1);
    EXPECT_EQ(X509_check_private_key(cert, leaf->key.get()), 1);
    EXPECT_EQ(group_name(leaf->key.get()), "prime256v1");
}

TEST(RunCaTest, SerialsAreRandomPositive128Bit) {
    auto ca = make_ca();
    std::set<std::string> seen;
    for (int i = 0; i < 20; ++i) {
        auto leaf = must_mint(*ca, "a.test");
        ASSERT_NE(leaf, nullptr);
        BIGNUM* bn = ASN1_INTEGER_to_BN(X509_get0_serialNumber(leaf->cert.get()), nullptr);
        EXPECT_FALSE(BN_is_negative(bn));
        EXPECT_FALSE(BN_is_zero(bn));
        EXPECT_GT(BN_num_bits(bn), 120);
        EXPECT_LE(BN_num_bits(bn), 128);
        char* hex = BN_bn2hex(bn);
        seen.insert(hex);
        OPENSSL_free(hex);
        BN_free(bn);
    }
    EXPECT_EQ(seen.size(), 20u);
}

TEST(RunCaTest, LeavesShareTheRunLeafKey) {
    auto ca = make_ca();
    auto a = must_mint(*ca, "a.test");
    auto b = must_mint(*ca, "b.test");
    ASSERT_NE(a, nullptr);
    ASSERT_NE(b, nullptr);
    EXPECT_EQ(a->key.get(), b->key.get());
    EXPECT_EQ(EVP_PKEY_eq(X509_get0_pubkey(a->cert.get()), X509_get0_pubkey(b->cert.get())), 1);
    EXPECT_NE(EVP_PKEY_eq(X509_get0_pubkey(a->cert.get()), X509_get0_pubkey(ca->cert())), 1);
    auto other = make_ca();
    auto c = must_mint(*other, "a.test");
    EXPECT_NE(EVP_PKEY_eq(a->key.get(), c->key.get()), 1);
    // The key stays usable after the CA and the other leaf are gone (reference counted).
    ca.reset();
    b.reset();
    EXPECT_EQ(X509_check_private_key(a->cert.get(), a->key.get()), 1);
}

TEST(RunCaTest, SanDnsForNames) {
    auto ca = make_ca();
    auto leaf = must_mint(*ca, "a.test");
    ASSERT_NE(leaf, nullptr);
    auto sans = san_entries(leaf->cert.get());
    ASSERT_EQ(sans.size(), 1u);
    EXPECT_EQ(sans[0].first, GEN_DNS);
    EXPECT_EQ(sans[0].second, "a.test");
}

TEST(RunCaTest, SanIpForIpv4Literal) {
    auto ca = make_ca();
    auto leaf = must_mint(*ca, "10.1.2.3");
    ASSERT_NE(leaf, nullptr);
    auto sans = san_entries(leaf->cert.get());
    ASSERT_EQ(sans.size(), 1u);
    EXPECT_EQ(sans[0].first, GEN_IPADD);
    EXPECT_EQ(sans[0].second, std::string("\x0a\x01\x02\x03", 4));
    EXPECT_EQ(X509_check_ip_asc(leaf->cert.get(), "10.1.2.3", 0), 1);
    EXPECT_EQ(X509_check_ip_asc(leaf->cert.get(), "10.1.2.4", 0), 0);
    EXPECT_EQ(verify_error(leaf->cert.get(), ca->cert(), "10.1.2.3"), X509_V_OK);
}

TEST(RunCaTest, SanIpForIpv6Literal) {
    auto ca = make_ca();
    for (const std::string host : {"::1", "[::1]"}) {
        auto leaf = must_mint(*ca, host);
        ASSERT_NE(leaf, nullptr);
        auto sans = san_entries(leaf->cert.get());
        ASSERT_EQ(sans.size(), 1u);
        EXPECT_EQ(sans[0].first, GEN_IPADD);
        EXPECT_EQ(sans[0].second.size(), 16u);
        EXPECT_EQ(X509_check_ip_asc(leaf->cert.get(), "::1", 0), 1);
        EXPECT_EQ(verify_error(leaf->cert.get(), ca->cert(), "::1"), X509_V_OK);
    }
    auto leaf = must_mint(*ca, "2001:db8::1");
    ASSERT_NE(leaf, nullptr);
    EXPECT_EQ(X509_check_ip_asc(leaf->cert.get(), "2001:db8:0::1", 0), 1);
}

TEST(RunCaTest, LongNameGoesInSanOnly) {
    auto ca = make_ca();
    const std::string host = std::string(60, 'a') + "." + std::string(60, 'b') + ".test";
    auto leaf = must_mint(*ca, host);
    ASSERT_NE(leaf, nullptr);
    EXPECT_EQ(common_name(leaf->cert.get()), "");
    EXPECT_TRUE(extension_critical(leaf->cert.get(), NID_subject_alt_name));
    EXPECT_EQ(verify_error(leaf->cert.get(), ca->cert(), host), X509_V_OK);
}

TEST(RunCaTest, RefusesHostsThatAreNotNames) {
    auto ca = make_ca();
    for (const std::string& host :
         std::vector<std::string>{"", "a b.test", "a.test,DNS:evil.test", "*.a.test", "a..test",
                                  ".a.test", "a.test/x", "1:2", std::string(254, 'a')}) {
        EXPECT_FALSE(ca->mint(host).ok()) << host;
    }
    EXPECT_FALSE(ca->mint("a.test", seconds(0)).ok());
}

TEST(RunCaTest, LeafValidityIsBoundedByTheCa) {
    auto ca = make_ca("run-1", hours(1));
    auto leaf = must_mint(*ca, "a.test");  // asks for 24 h
    ASSERT_NE(leaf, nullptr);
    EXPECT_EQ(leaf->not_after, ca->not_after());
    EXPECT_EQ(
        ASN1_TIME_compare(X509_get0_notAfter(leaf->cert.get()), X509_get0_notAfter(ca->cert())), 0);
    EXPECT_NEAR(seconds_from_now(X509_get0_notBefore(leaf->cert.get())), -300, 5);

    auto short_leaf = must_mint(*ca, "a.test", seconds(60));
    ASSERT_NE(short_leaf, nullptr);
    EXPECT_NEAR(seconds_from_now(X509_get0_notAfter(short_leaf->cert.get())), 60, 5);
    EXPECT_LT(short_leaf->not_after, ca->not_after());
}

TEST(RunCaTest, ConcurrentMintsAllVerify) {
    auto ca = make_ca();
    std::vector<std::shared_ptr<const Leaf>> leaves(4 * 25);
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
        threads.emplace_back([&, t] {
            for (int i = 0; i < 25; ++i) {
                auto r = ca->mint("h" + std::to_string(i) + ".test");
                if (r.ok()) {
                    leaves[t * 25 + i] = r.value();
                }
            }
        });
    }
    for (auto& th : threads) {
        th.join();
    }
    for (int t = 0; t < 4; ++t) {
        for (int i = 0; i < 25; ++i) {
            const auto& leaf = leaves[t * 25 + i];
            ASSERT_NE(leaf, nullptr);
            EXPECT_EQ(verify_error(leaf->cert.get(), ca->cert(), "h" + std::to_string(i) + ".test"),
                      X509_V_OK);
        }
    }
}

}  // namespace
}  // namespace egress::tls
