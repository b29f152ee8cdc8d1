#pragma once
// A certificate authority that belongs to one run: ECDSA P-256 key and self-signed
// certificate, created in memory; the key is never written anywhere.
#include <array>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/result.h"
#include "tls/openssl_ptr.h"

namespace egress::tls {

/// RunCa::mint's error for a host outside the CA's name constraints (no leaf it could sign
/// would verify).
inline constexpr std::string_view kOutsideRunCa = "outside_run_ca";

/// A minted leaf: certificate for one host, signed by the run CA, with the run's leaf key.
struct Leaf {
    X509Ptr cert;
    PKeyPtr key;  // the run's shared leaf key (ref-counted by EVP_PKEY_up_ref)
    std::chrono::system_clock::time_point not_after;
    /// The TLS session id context of the connections it serves (use_leaf): SHA-256 of the run
    /// CA's certificate digest and the host. A session or ticket resumes only under the run
    /// CA and host that made it: never under another run's CA, nor for another host.
    std::array<unsigned char, 32> session_context{};
};

class RunCa {
public:
    /// Creates the CA key, the self-signed CA certificate (CN "egressd run <run_id>",
    /// basicConstraints CA:TRUE critical, keyUsage keyCertSign|cRLSign critical, SKID,
    /// pathlen 0), valid from now - 5 min to now + validity, and one EC P-256 leaf key shared
    /// by every leaf of the run (minting is then only a signature).
    ///
    /// `permitted`, when not empty, makes the CA carry critical X.509 name constraints that
    /// permit only those names, so even a leaked CA can forge nothing else: "api.test" (that
    /// host and its subdomains), ".s3.test" (subdomains only, for "*.s3.test" pins) or an
    /// IP literal. Entries must be normalized hosts (checked; anything else is an error).
    static Result<std::unique_ptr<RunCa>> create(std::string_view run_id,
                                                 std::chrono::seconds validity,
                                                 const std::vector<std::string>& permitted = {});

    std::string cert_pem() const;

    /// The names a CA certificate (PEM) permits by its X.509 name constraints: DNS names as
    /// they are (".a.test": subdomains only), single addresses as text ("127.0.0.1", "::1");
    /// nullopt when it carries none (it may certify any name).
    static std::optional<std::vector<std::string>> permitted_names(const std::string& cert_pem);

    /// The CA private key as PKCS#8 PEM, for sealing into the state store (fleet replicas
    /// and restarts must serve the run with the same CA). WARNING: key material; the caller
    /// seals it at once and wipes the string (secure_zero).
    std::string key_pem() const;

    /// Rebuilds a run CA from its certificate and (unsealed) key; a fresh leaf key is made.
    /// Fails if the key does not match the certificate or the certificate is not a CA.
    static Result<std::unique_ptr<RunCa>> load(const std::string& cert_pem,
                                               std::string_view key_pem);
    X509* cert() const { return cert_.get(); }
    std::chrono::system_clock::time_point not_after() const { return not_after_; }

    /// Mints a leaf for a normalized host: SAN DNS (or SAN IP for an IP literal), CN = host,
    /// EKU serverAuth, keyUsage digitalSignature, random 128-bit serial, AKID, valid from
    /// now - 5 min to min(CA not_after, now + leaf_validity). Thread-safe.
    Result<std::shared_ptr<const Leaf>> mint(const std::string& host,
                                             std::chrono::seconds leaf_validity =
                                                 std::chrono::hours(24)) const;

private:
    RunCa() = default;
    /// Whether this CA's name constraints (if any) let a leaf carry `host` (its SAN, the IP
    /// `ip` when not null, and a CN when `has_cn`). No key operation.
    bool names_allowed(std::string_view host, ASN1_OCTET_STRING* ip, bool has_cn) const;
    PKeyPtr ca_key_;
    PKeyPtr leaf_key_;
    X509Ptr cert_;
    std::chrono::system_clock::time_point not_after_;
};

}  // namespace egress::tls
