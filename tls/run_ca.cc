#include "tls/run_ca.h"

#include <openssl/bn.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509v3.h>

#include <arpa/inet.h>

#include <algorithm>
#include <cctype>
#include <array>
#include <ctime>
#include <string>

#include "common/secure_zero.h"

namespace egress::tls {
namespace {

using Clock = std::chrono::system_clock;

constexpr std::chrono::seconds kBackdate = std::chrono::minutes(5);
// A run "that lives as long as the process" may ask for any validity; keep dates sane.
constexpr std::chrono::seconds kMaxValidity = std::chrono::hours(24 * 365 * 50);
constexpr size_t kMaxCommonName = 64;  // ub_common_name (RFC 5280)
constexpr size_t kMaxDnsName = 253;

struct BioDeleter {
    void operator()(BIO* p) const { BIO_free(p); }
};
struct BnDeleter {
    void operator()(BIGNUM* p) const { BN_free(p); }
};
struct GeneralNamesDeleter {
    void operator()(GENERAL_NAMES* p) const { GENERAL_NAMES_free(p); }
};
struct OctetDeleter {
    void operator()(ASN1_OCTET_STRING* p) const { ASN1_OCTET_STRING_free(p); }
};
using BioPtr = std::unique_ptr<BIO, BioDeleter>;
using BnPtr = std::unique_ptr<BIGNUM, BnDeleter>;
using GeneralNamesPtr = std::unique_ptr<GENERAL_NAMES, GeneralNamesDeleter>;
using OctetPtr = std::unique_ptr<ASN1_OCTET_STRING, OctetDeleter>;

Error ssl_error(const std::string& what) { return make_error(what + ": " + last_ssl_error()); }

PKeyPtr make_p256_key() { return PKeyPtr(EVP_PKEY_Q_keygen(nullptr, nullptr, "EC", "P-256")); }

/// Random positive 128-bit serial (top bit cleared so DER needs no sign byte, never zero).
bool set_random_serial(X509* cert) {
    std::array<unsigned char, 16> bytes{};
    if (RAND_bytes(bytes.data(), static_cast<int>(bytes.size())) != 1) {
        return false;
    }
    bytes[0] &= 0x7f;
    bytes[0] |= 0x40;  // keeps the serial 16 bytes long and non-zero
    BnPtr bn(BN_bin2bn(bytes.data(), static_cast<int>(bytes.size()), nullptr));
    return bn != nullptr && BN_to_ASN1_INTEGER(bn.get(), X509_get_serialNumber(cert)) != nullptr;
}

bool set_validity(X509* cert, std::time_t not_before, std::time_t not_after) {
    return ASN1_TIME_set(X509_getm_notBefore(cert), not_before) != nullptr &&
           ASN1_TIME_set(X509_getm_notAfter(cert), not_after) != nullptr;
}

bool add_ext(X509* cert, X509V3_CTX* ctx, int nid, const char* value) {
    X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, ctx, nid, value);
    if (ext == nullptr) {
        return false;
    }
    const int ok = X509_add_ext(cert, ext, -1);
    X509_EXTENSION_free(ext);
    return ok == 1;
}

bool add_common_name(X509_NAME* name, std::string_view cn) {
    return X509_NAME_add_entry_by_NID(name, NID_commonName, MBSTRING_UTF8,
                                      reinterpret_cast<const unsigned char*>(cn.data()),
                                      static_cast<int>(cn.size()), -1, 0) == 1;
}

/// Cuts `s` to at most `max` bytes without splitting a UTF-8 sequence.
std::string_view truncate_utf8(std::string_view s, size_t max) {
    if (s.size() <= max) {
        return s;
    }
    size_t n = max;
    while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xc0) == 0x80) {
        --n;
    }
    return s.substr(0, n);
}

/// A DNS name as it may appear in a SAN: LDH (and '_') labels, no empty label. The host
/// has passed policy normalization already; this is a last guard before it is signed.
bool valid_dns_name(std::string_view host) {
    if (host.empty() || host.size() > kMaxDnsName || host.front() == '.' || host.back() == '.') {
        return false;
    }
    char prev = '\0';
    for (char c : host) {
        const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                        (c >= '0' && c <= '9') || c == '-' || c == '_' || c == '.';
        if (!ok || (c == '.' && prev == '.')) {
            return false;
        }
        prev = c;
    }
    return true;
}

/// subjectAltName built from typed values (no config-string parsing of the host).
bool add_san(X509* cert, std::string_view host, ASN1_OCTET_STRING* ip, bool critical) {
    GeneralNamesPtr names(sk_GENERAL_NAME_new_null());
    GENERAL_NAME* gn = GENERAL_NAME_new();
    if (names == nullptr || gn == nullptr) {
        GENERAL_NAME_free(gn);
        return false;
    }
    if (ip != nullptr) {
        ASN1_OCTET_STRING* copy = ASN1_OCTET_STRING_dup(ip);
        if (copy == nullptr) {
            GENERAL_NAME_free(gn);
            return false;
        }
        GENERAL_NAME_set0_value(gn, GEN_IPADD, copy);
    } else {
        ASN1_IA5STRING* dns = ASN1_IA5STRING_new();
        if (dns == nullptr ||
            ASN1_STRING_set(dns, host.data(), static_cast<int>(host.size())) != 1) {
            ASN1_IA5STRING_free(dns);
            GENERAL_NAME_free(gn);
            return false;
        }
        GENERAL_NAME_set0_value(gn, GEN_DNS, dns);
    }
    if (sk_GENERAL_NAME_push(names.get(), gn) <= 0) {
        GENERAL_NAME_free(gn);
        return false;
    }
    return X509_add1_ext_i2d(cert, NID_subject_alt_name, names.get(), critical ? 1 : 0,
                             X509V3_ADD_DEFAULT) == 1;
}

}  // namespace

namespace {

/// The one host name a CA made for addresses only permits: every name outside it is refused.
constexpr std::string_view kNoHostNames = "invalid";

/// "permitted;DNS:a.test,permitted;IP:1.2.3.4/255.255.255.255,...", from validated names only
/// (no ',' ';' ':' beyond IPv6 colons can reach the conf string). A name type with no subtree
/// is not constrained at all (RFC 5280 4.2.1.10): without a permitted address of a family,
/// every address of it is excluded, so a CA made for host names cannot certify an address;
/// without a permitted host name, the only one permitted is kNoHostNames (RFC 6761's
/// `invalid`, which never resolves), so one made for addresses cannot certify a name. (An
/// excluded empty dNSName would say it too, but OpenSSL's conf syntax cannot spell it.)
Result<std::string> name_constraints_conf(const std::vector<std::string>& names) {
    std::string conf = "critical";
    bool dns = false;
    bool v4 = false;
    bool v6 = false;
    for (const auto& n : names) {
        if (n.empty() || n.size() > 253) {
            return make_error("name constraint: bad name");
        }
        unsigned char buf[16];
        if (inet_pton(AF_INET, n.c_str(), buf) == 1) {
            conf += ",permitted;IP:" + n + "/255.255.255.255";
            v4 = true;
            continue;
        }
        if (inet_pton(AF_INET6, n.c_str(), buf) == 1) {
            conf += ",permitted;IP:" + n + "/ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff";
            v6 = true;
            continue;
        }
        for (char c : n) {
            if (!(std::islower(static_cast<unsigned char>(c)) ||
                  std::isdigit(static_cast<unsigned char>(c)) || c == '.' || c == '-' ||
                  c == '_')) {
                return make_error("name constraint: '" + n + "' is not a normalized host");
            }
        }
        conf += ",permitted;DNS:" + n;
        dns = true;
    }
    if (!dns) {
        conf += ",permitted;DNS:" + std::string(kNoHostNames);
    }
    if (!v4) {
        conf += ",excluded;IP:0.0.0.0/0.0.0.0";
    }
    if (!v6) {
        conf += ",excluded;IP:::/::";
    }
    return conf;
}

}  // namespace

Result<std::unique_ptr<RunCa>> RunCa::create(std::string_view run_id,
                                             std::chrono::seconds validity,
                                             const std::vector<std::string>& permitted) {
    if (validity <= std::chrono::seconds(0)) {
        return make_error("run CA validity must be positive");
    }
    validity = std::min(validity, kMaxValidity);

    std::unique_ptr<RunCa> ca(new RunCa());
    ca->ca_key_ = make_p256_key();
    if (ca->ca_key_ == nullptr) {
        return ssl_error("run CA key generation failed");
    }
    ca->leaf_key_ = make_p256_key();
    if (ca->leaf_key_ == nullptr) {
        return ssl_error("run leaf key generation failed");
    }

    X509Ptr cert(X509_new());
    if (cert == nullptr) {
        return ssl_error("X509_new failed");
    }
    const std::time_t now = Clock::to_time_t(Clock::now());
    const std::time_t not_after = now + static_cast<std::time_t>(validity.count());
    const std::string cn = "egressd run " + std::string(run_id);
    X509_NAME* name = X509_get_subject_name(cert.get());
    if (X509_set_version(cert.get(), X509_VERSION_3) != 1 || !set_random_serial(cert.get()) ||
        !set_validity(cert.get(), now - kBackdate.count(), not_after) ||
        X509_NAME_add_entry_by_txt(name, "O", MBSTRING_UTF8,
                                   reinterpret_cast<const unsigned char*>("egressd"), -1, -1,
                                   0) != 1 ||
        !add_common_name(name, truncate_utf8(cn, kMaxCommonName)) ||
        X509_set_issuer_name(cert.get(), name) != 1 ||
        X509_set_pubkey(cert.get(), ca->ca_key_.get()) != 1) {
        return ssl_error("building the run CA certificate failed");
    }

    X509V3_CTX ctx;
    X509V3_set_ctx(&ctx, cert.get(), cert.get(), nullptr, nullptr, 0);
    if (!add_ext(cert.get(), &ctx, NID_basic_constraints, "critical,CA:TRUE,pathlen:0") ||
        !add_ext(cert.get(), &ctx, NID_key_usage, "critical,keyCertSign,cRLSign") ||
        !add_ext(cert.get(), &ctx, NID_subject_key_identifier, "hash")) {
        return ssl_error("adding run CA extensions failed");
    }
    if (!permitted.empty()) {
        auto conf = name_constraints_conf(permitted);
        if (!conf) {
            return make_error(conf.error());
        }
        if (!add_ext(cert.get(), &ctx, NID_name_constraints, conf->c_str())) {
            return ssl_error("adding run CA name constraints failed");
        }
    }
    if (X509_sign(cert.get(), ca->ca_key_.get(), EVP_sha256()) <= 0) {
        return ssl_error("signing the run CA certificate failed");
    }
    // Fill OpenSSL's lazily computed extension cache now, while only this thread sees the
    // certificate; concurrent mint() calls then only read it.
    X509_check_purpose(cert.get(), -1, 0);
    ca->cert_ = std::move(cert);
    ca->not_after_ = Clock::from_time_t(not_after);
    return ca;
}

std::string RunCa::cert_pem() const {
    BioPtr bio(BIO_new(BIO_s_mem()));
    if (bio == nullptr || PEM_write_bio_X509(bio.get(), cert_.get()) != 1) {
        ERR_clear_error();
        return {};
    }
    char* data = nullptr;
    const long len = BIO_get_mem_data(bio.get(), &data);
    return len > 0 ? std::string(data, static_cast<size_t>(len)) : std::string();
}

std::optional<std::vector<std::string>> RunCa::permitted_names(const std::string& cert_pem) {
    BioPtr bio(BIO_new_mem_buf(cert_pem.data(), static_cast<int>(cert_pem.size())));
    X509Ptr cert(bio ? PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr) : nullptr);
    ERR_clear_error();
    if (cert == nullptr) {
        return std::nullopt;
    }
    auto* nc = static_cast<NAME_CONSTRAINTS*>(
        X509_get_ext_d2i(cert.get(), NID_name_constraints, nullptr, nullptr));
    if (nc == nullptr) {
        ERR_clear_error();
        return std::nullopt;
    }
    std::vector<std::string> out;
    for (int i = 0; i < sk_GENERAL_SUBTREE_num(nc->permittedSubtrees); ++i) {
        const GENERAL_NAME* base = sk_GENERAL_SUBTREE_value(nc->permittedSubtrees, i)->base;
        if (base->type == GEN_DNS) {
            const ASN1_IA5STRING* d = base->d.dNSName;
            std::string name(reinterpret_cast<const char*>(d->data), static_cast<size_t>(d->length));
            if (name != kNoHostNames) {  // the stand-in of a CA that permits no host name
                out.push_back(std::move(name));
            }
        } else if (base->type == GEN_IPADD) {
            // Address then mask: 8 bytes (IPv4) or 32 (IPv6); ours are single addresses.
            const ASN1_OCTET_STRING* ip = base->d.iPAddress;
            char text[INET6_ADDRSTRLEN] = {};
            if ((ip->length == 8 && inet_ntop(AF_INET, ip->data, text, sizeof text)) ||
                (ip->length == 32 && inet_ntop(AF_INET6, ip->data, text, sizeof text))) {
                out.emplace_back(text);
            }
        }
    }
    NAME_CONSTRAINTS_free(nc);
    return out;
}

std::string RunCa::key_pem() const {
    BioPtr bio(BIO_new(BIO_s_secmem()));
    if (bio == nullptr ||
        PEM_write_bio_PrivateKey(bio.get(), ca_key_.get(), nullptr, nullptr, 0, nullptr,
                                 nullptr) != 1) {
        ERR_clear_error();
        return {};
    }
    char* data = nullptr;
    const long len = BIO_get_mem_data(bio.get(), &data);
    std::string out = len > 0 ? std::string(data, static_cast<size_t>(len)) : std::string();
    if (len > 0) {
        egress::secure_zero(data, static_cast<size_t>(len));
    }
    return out;
}

Result<std::unique_ptr<RunCa>> RunCa::load(const std::string& cert_pem, std::string_view key_pem) {
    BioPtr cbio(BIO_new_mem_buf(cert_pem.data(), static_cast<int>(cert_pem.size())));
    BioPtr kbio(BIO_new_mem_buf(key_pem.data(), static_cast<int>(key_pem.size())));
    if (cbio == nullptr || kbio == nullptr) {
        return ssl_error("BIO_new_mem_buf failed");
    }
    std::unique_ptr<RunCa> ca(new RunCa());
    ca->cert_.reset(PEM_read_bio_X509(cbio.get(), nullptr, nullptr, nullptr));
    if (ca->cert_ == nullptr) {
        return ssl_error("run CA certificate does not parse");
    }
    ca->ca_key_.reset(PEM_read_bio_PrivateKey(kbio.get(), nullptr, nullptr, nullptr));
    if (ca->ca_key_ == nullptr) {
        return ssl_error("run CA key does not parse");
    }
    if (X509_check_private_key(ca->cert_.get(), ca->ca_key_.get()) != 1 ||
        X509_check_ca(ca->cert_.get()) == 0) {
        return ssl_error("run CA key does not match its certificate");
    }
    ca->leaf_key_ = make_p256_key();
    if (ca->leaf_key_ == nullptr) {
        return ssl_error("run leaf key generation failed");
    }
    const ASN1_TIME* na = X509_get0_notAfter(ca->cert_.get());
    std::tm tm{};
    if (ASN1_TIME_to_tm(na, &tm) != 1) {
        return ssl_error("run CA notAfter unreadable");
    }
    ca->not_after_ = Clock::from_time_t(timegm(&tm));
    X509_check_purpose(ca->cert_.get(), -1, 0);
    return ca;
}

bool RunCa::names_allowed(std::string_view host, ASN1_OCTET_STRING* ip, bool has_cn) const {
    auto* nc = static_cast<NAME_CONSTRAINTS*>(
        X509_get_ext_d2i(cert_.get(), NID_name_constraints, nullptr, nullptr));
    if (nc == nullptr) {
        ERR_clear_error();
        return true;
    }
    // OpenSSL's own check, the one a verifier applies, on a probe holding only the names the
    // leaf would carry (subject CN, SAN): nothing is signed. The check reads the extensions
    // OpenSSL caches on a certificate, and caching them encodes it (for its fingerprint), which
    // a certificate built from nothing cannot do (no signature algorithm): the probe is a copy
    // of the CA's own certificate with its subject and extensions replaced, never used for
    // anything else.
    X509Ptr probe(X509_dup(cert_.get()));
    bool built = probe != nullptr;
    while (built && X509_get_ext_count(probe.get()) > 0) {
        X509_EXTENSION_free(X509_delete_ext(probe.get(), 0));
    }
    X509_NAME* subject = built ? X509_NAME_new() : nullptr;
    built = subject != nullptr && (!has_cn || add_common_name(subject, host)) &&
            X509_set_subject_name(probe.get(), subject) == 1 &&
            add_san(probe.get(), host, ip, !has_cn) && X509_check_purpose(probe.get(), -1, 0) == 1;
    X509_NAME_free(subject);
    const int verdict = built ? NAME_CONSTRAINTS_check(probe.get(), nc) : X509_V_ERR_UNSPECIFIED;
    NAME_CONSTRAINTS_free(nc);
    ERR_clear_error();
    return verdict == X509_V_OK;
}

Result<std::shared_ptr<const Leaf>> RunCa::mint(const std::string& host_in,
                                                std::chrono::seconds leaf_validity) const {
    if (leaf_validity <= std::chrono::seconds(0)) {
        return make_error("leaf validity must be positive");
    }
    std::string_view host = host_in;
    if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
        host = host.substr(1, host.size() - 2);
    }
    const std::string host_str(host);
    OctetPtr ip(a2i_IPADDRESS(host_str.c_str()));
    ERR_clear_error();  // a2i_IPADDRESS queues an error for names
    if (ip == nullptr && !valid_dns_name(host)) {
        return make_error("cannot mint a certificate for invalid host '" + host_in + "'");
    }

    const auto now_tp = Clock::now();
    const std::time_t now = Clock::to_time_t(now_tp);
    const std::time_t ca_not_after = Clock::to_time_t(not_after_);
    if (now >= ca_not_after) {
        return make_error("run CA has expired");
    }
    const std::time_t wanted =
        now + static_cast<std::time_t>(std::min(leaf_validity, kMaxValidity).count());
    const std::time_t not_after = std::min(ca_not_after, wanted);

    // IP leaves carry no CN: verifiers apply DNS name constraints to a CN when there is no
    // DNS SAN, and an address is not a DNS name.
    const bool has_cn = host.size() <= kMaxCommonName && ip == nullptr;
    // A name-constrained CA hands out no leaf its own constraints forbid: every client would
    // refuse it. The names it may certify are fixed at the run's creation; a reload since
    // (unpinned: intercept, a wider allow list) may route other hosts here. Checked before
    // anything is signed: such a host costs no signature (its refusals do not spend the mint
    // budget, so a sandbox could otherwise make one per CONNECT).
    if (!names_allowed(host, ip.get(), has_cn)) {
        return make_error(std::string(kOutsideRunCa));
    }

    X509Ptr cert(X509_new());
    if (cert == nullptr) {
        return ssl_error("X509_new failed");
    }
    X509_NAME* subject = X509_get_subject_name(cert.get());
    if (X509_set_version(cert.get(), X509_VERSION_3) != 1 || !set_random_serial(cert.get()) ||
        !set_validity(cert.get(), now - kBackdate.count(), not_after) ||
        (has_cn && !add_common_name(subject, host)) ||
        X509_set_issuer_name(cert.get(), X509_get_subject_name(cert_.get())) != 1 ||
        X509_set_pubkey(cert.get(), leaf_key_.get()) != 1) {
        return ssl_error("building the leaf certificate for '" + host_in + "' failed");
    }

    X509V3_CTX ctx;
    X509V3_set_ctx(&ctx, cert_.get(), cert.get(), nullptr, nullptr, 0);
    // An empty subject requires a critical subjectAltName (RFC 5280 4.2.1.6).
    if (!add_ext(cert.get(), &ctx, NID_basic_constraints, "critical,CA:FALSE") ||
        !add_ext(cert.get(), &ctx, NID_key_usage, "critical,digitalSignature") ||
        !add_ext(cert.get(), &ctx, NID_ext_key_usage, "serverAuth") ||
        !add_ext(cert.get(), &ctx, NID_authority_key_identifier, "keyid:always") ||
        !add_san(cert.get(), host, ip.get(), !has_cn)) {
        return ssl_error("adding leaf extensions for '" + host_in + "' failed");
    }
    if (X509_sign(cert.get(), ca_key_.get(), EVP_sha256()) <= 0) {
        return ssl_error("signing the leaf for '" + host_in + "' failed");
    }
    ERR_clear_error();

    auto leaf = std::make_shared<Leaf>();
    leaf->cert = std::move(cert);
    if (EVP_PKEY_up_ref(leaf_key_.get()) != 1) {
        return ssl_error("EVP_PKEY_up_ref failed");
    }
    leaf->key.reset(leaf_key_.get());
    leaf->not_after = Clock::from_time_t(not_after);
    // The session id context: SHA-256 of the CA certificate's SHA-256 and the host, the same
    // for every leaf of one run and host (a re-minted leaf keeps its sessions resumable).
    unsigned char ca_digest[EVP_MAX_MD_SIZE];
    unsigned int ca_len = 0;
    if (X509_digest(cert_.get(), EVP_sha256(), ca_digest, &ca_len) != 1) {
        return ssl_error("digesting the run CA failed");
    }
    std::string input(reinterpret_cast<const char*>(ca_digest), ca_len);
    input += host_str;
    unsigned int digest_len = 0;
    if (EVP_Digest(input.data(), input.size(), leaf->session_context.data(), &digest_len,
                   EVP_sha256(), nullptr) != 1 ||
        digest_len != leaf->session_context.size()) {
        return ssl_error("the session context for '" + host_in + "' failed");
    }
    return std::shared_ptr<const Leaf>(std::move(leaf));
}

}  // namespace egress::tls
