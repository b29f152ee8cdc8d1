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
//  - a chunk-signed upload (STREAMING-AWS4-HMAC-SHA256-PAYLOAD, the aws-chunked body of the
//    AWS SDK for Java v1's PutObject and UploadPart): signed as declared, and each chunk's
//    signature, made by the sandbox with its dummy key, is made again (AwsChunkSigner).
// Refused: the other chunk-signed forms (signed trailers, SigV4a), and a presigned URL (its
// query carries a signature of its own; AWS refuses two).
//
// The canonical URI and query are computed from the request as the client sent it, as the
// SDKs compute them from what they put on the wire (botocore's SigV4Auth and S3SigV4Auth), so
// egressd signs what the sandbox's own SDK signed: for S3 the path as it is; for any other
// service with dot and empty segments removed and encoded once more (every byte but
// A-Z a-z 0-9 - . _ ~ and '/', so "%20" becomes "%2520"); the query's pairs as sent, sorted.
#include <array>
#include <memory>
#include <mutex>
#include <span>
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
    bool chunked = false;         // Kind::Hash: an aws-chunked body whose chunks are signed
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

/// What aws_sign made: the request's date, credential scope and signature (the "seed" a
/// chunk-signed upload's chunk signatures chain from).
struct AwsSignature {
    std::string date;       // x-amz-date, 20130524T000000Z
    std::string scope;      // 20130524/us-east-1/s3/aws4_request
    std::string signature;  // lowercase hex
};

/// Signs `head` for `spec` with `creds` at `now`: removes the client's authorization,
/// x-amz-date and x-amz-security-token, sets x-amz-date, the session token if any, and
/// authorization (never_index = "authorization", never_index_also the session token's field
/// when there is one). WARNING: derives key material from the
/// secret; every copy of a key is wiped before return.
AwsSignature aws_sign(RequestHead& head, const InjectSpec& spec, AwsCredentials& creds,
                      std::string_view payload_hash, TimePoint now);

/// A chunk-signed upload's body (x-amz-content-sha256: STREAMING-AWS4-HMAC-SHA256-PAYLOAD),
/// signed again as it streams. The body is in aws-chunked encoding, each chunk
///   hex(size) ";chunk-signature=" signature CRLF data CRLF
/// and a last chunk of size 0 followed by CRLF. Chunks are at least 8 KiB but for the last
/// one with data, as S3 requires (a chunk costs a signature). Each signature is an HMAC over
/// the previous one (the first: the request's) and the chunk's hash, so a chunk is held until
/// all of its data came (at most `max_chunk` bytes: limits.sign_body_bytes), then goes on
/// with the signature made with the pin's key. The output is as long as the input, so the request's
/// content-length and x-amz-decoded-content-length stay true.
class AwsChunkSigner {
public:
    enum class Status : uint8_t {
        Ok,
        Malformed,  // not aws-chunked as above (400 bad_aws_chunk)
        TooLarge,   // a chunk over max_chunk (413 body_too_large_to_sign)
    };
    AwsChunkSigner(std::shared_ptr<AwsCredentials> creds, const InjectSpec& spec,
                   AwsSignature seed);
    /// Takes the next bytes of the body; what may go upstream is then in output(). Once it
    /// failed, every later feed fails the same way.
    Status feed(std::string_view in, size_t max_chunk);
    /// The signed chunks completed by the last feed() (valid until the next one).
    std::span<char> output() { return {out_.data(), out_.size()}; }
    /// The last chunk came, and nothing after it.
    bool complete() const { return done_; }

private:
    Status parse(size_t max_chunk);

    std::shared_ptr<AwsCredentials> creds_;
    const InjectSpec& spec_;  // the pin's, which outlives the request
    AwsSignature prev_;       // .signature: the previous chunk's (the request's, first)
    std::string in_;          // a chunk not yet complete: its header line and data so far
    std::string out_;
    size_t line_ = 0;         // in_'s header line length (CRLF excluded), once found
    uint64_t size_ = 0;       // that chunk's data size
    bool done_ = false;
    bool small_ = false;  // the last chunk with data was under S3's 8 KiB minimum
    Status failed_ = Status::Ok;
};

/// The canonical request of `head` (its x-amz-date already set) and, in `signed_headers`,
/// the ';'-joined names it signs. Exposed for tests.
std::string aws_canonical_request(const RequestHead& head, const InjectSpec& spec,
                                  std::string_view payload_hash, std::string& signed_headers);

/// Validates an aws-sigv4 injection's fields; errors name the field ("inject.region: ...").
/// access_key_id may be empty: the secret is then a credentials document (AwsCredentials).
std::string aws_spec_error(const InjectSpec& spec);

}  // namespace egress::policy
