#pragma once
// AWS Signature Version 4 (inject type aws-sigv4): a request signed on its way out with the
// pin's secret access key, which the sandbox never holds. The sandbox's AWS SDK signs with
// dummy credentials; egressd drops that signature and signs the request again.
//
// What is signed (the "SignedHeaders"): host, content-md5, content-type, range and every
// x-amz-* header the request carries. AWS requires host and x-amz-date, and S3 every x-amz-*
// header; the others are fields no hop after egressd rewrites. Fields a hop may rewrite
// (user-agent, accept-encoding, content-length, the body's framing) are left out, so that
// nothing between egressd and AWS can break the signature.
//
// The payload hash (RFC: the "HashedPayload" of the canonical request):
//  - the client's x-amz-content-sha256 when it is a SHA-256 in hex, UNSIGNED-PAYLOAD or
//    STREAMING-UNSIGNED-PAYLOAD-TRAILER (AWS checks the body against a declared hash);
//  - no body: the hash of the empty string;
//  - S3: UNSIGNED-PAYLOAD (allowed by S3 over TLS), with x-amz-content-sha256 added;
//  - any other service: the body's own hash, so egressd reads the body first (AwsPayload's
//    NeedBody; the exchange bounds it by limits.sign_body_bytes).
// Refused: a chunk-signed upload (STREAMING-AWS4-HMAC-SHA256-PAYLOAD...: each chunk carries a
// signature made with the sandbox's dummy key, which egressd would have to rewrite), and a
// presigned URL (its query carries a signature of its own; AWS refuses two).
//
// The canonical URI and query are computed from the request as the client sent it, as the
// SDKs compute them from what they put on the wire (botocore's SigV4Auth and S3SigV4Auth), so
// egressd signs what the sandbox's own SDK signed: for S3 the path as it is; for any other
// service with dot and empty segments removed and encoded once more (every byte but
// A-Z a-z 0-9 - . _ ~ and '/', so "%20" becomes "%2520"); the query's pairs as sent, sorted.
#include <array>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "common/result.h"
#include "policy/request_head.h"
#include "policy/run_policy.h"

struct evp_mac_ctx_st;  // OpenSSL's EVP_MAC_CTX (<openssl/types.h>), kept out of this header

namespace egress::policy {

/// What a request's payload hash will be, decided from its head.
struct AwsPayload {
    enum class Kind : uint8_t { Hash, NeedBody, Refuse };
    Kind kind = Kind::Hash;
    std::string hash;             // Kind::Hash: the value signed as the payload's hash
    bool add_header = false;      // Kind::Hash: set x-amz-content-sha256 to `hash` (S3)
    const char* reason = nullptr; // Kind::Refuse: "aws_chunk_signing", "bad_aws_payload_hash",
                                  // "aws_presigned_query"
};

/// The payload decision for `head` under `spec` (type AwsSigV4). `body_empty`: the request
/// has no body or a zero content-length.
AwsPayload aws_payload(const RequestHead& head, const InjectSpec& spec, bool body_empty);

/// The day's signing key of one pin (HMAC-SHA256 of the secret, the UTC day, the region, the
/// service and "aws4_request"), made by the day's first request and shared by the pin's
/// requests on every worker: four of a signature's five HMACs. Kept as an HMAC context keyed
/// with it, which each signature copies (no key schedule, no algorithm lookup per request);
/// OpenSSL cleanses it when the next day's replaces it or the injection is dropped.
class AwsSigningKeys {
public:
    using Mac = std::array<unsigned char, 32>;
    AwsSigningKeys() = default;
    ~AwsSigningKeys();
    AwsSigningKeys(const AwsSigningKeys&) = delete;
    AwsSigningKeys& operator=(const AwsSigningKeys&) = delete;
    /// HMAC-SHA256 of `data` under the signing key for `day` (YYYYMMDD); all zeros if OpenSSL
    /// failed (a signature AWS refuses).
    Mac sign(std::string_view day, const InjectSpec& spec, std::string_view secret,
             std::string_view data);

private:
    std::mutex mutex_;
    std::string day_;
    ::evp_mac_ctx_st* keyed_ = nullptr;  // EVP_MAC_CTX keyed with the day's signing key
};

/// What an aws-sigv4 pin signs with, made once per pin (Injection::aws). From the pin's
/// secret: the secret access key when the spec names an access_key_id; else a credentials
/// document, JSON with AccessKeyId, SecretAccessKey and, for temporary credentials,
/// SessionToken (as `aws sts assume-role --query Credentials`, `aws configure
/// export-credentials` and a credential_process print it; other fields are ignored), so that
/// temporary credentials rotate as one secret. A session token is sent as
/// x-amz-security-token, and signed.
struct AwsCredentials {
    std::string access_key_id;
    credstore::SecretPtr secret_access_key;
    credstore::SecretPtr session_token;  // null: a long-term key
    AwsSigningKeys keys;                 // the day's signing key
};

/// Reads the credentials of `spec` from `secret`. The error says what is missing or malformed
/// ("credentials document: SessionToken is not a string"), never a value. The document is
/// parsed in buffers that are wiped after.
Result<std::shared_ptr<AwsCredentials>> aws_credentials(const InjectSpec& spec,
                                                        std::string_view secret);

/// SHA-256 of `bytes`, lowercase hex (the payload hash of a body read whole).
std::string aws_payload_hash(std::string_view bytes);

/// Signs `head` for `spec` with `creds` at `now`: removes the client's authorization,
/// x-amz-date and x-amz-security-token, sets x-amz-date, the session token if any, and
/// authorization (never_index = "authorization"). WARNING: derives key material from the
/// secret; every copy of a key is wiped before return.
void aws_sign(RequestHead& head, const InjectSpec& spec, AwsCredentials& creds,
              std::string_view payload_hash, TimePoint now);

/// The canonical request of `head` (its x-amz-date already set) and, in `signed_headers`,
/// the ';'-joined names it signs. Exposed for tests.
std::string aws_canonical_request(const RequestHead& head, const InjectSpec& spec,
                                  std::string_view payload_hash, std::string& signed_headers);

/// Validates an aws-sigv4 injection's fields; errors name the field ("inject.region: ...").
/// access_key_id may be empty: the secret is then a credentials document (AwsCredentials).
std::string aws_spec_error(const InjectSpec& spec);

}  // namespace egress::policy
