#include "policy/aws_sigv4.h"

#include <openssl/evp.h>
#include <openssl/core_names.h>
#include <openssl/params.h>

#include <algorithm>
#include <array>
#include <ctime>
#include <utility>
#include <vector>

#include <boost/json/parser.hpp>
#include <boost/json/static_resource.hpp>
#include <boost/json/value.hpp>

#include "common/hex.h"
#include "common/secure_zero.h"
#include "credstore/envelope.h"
#include "policy/header_rules.h"

namespace egress::policy {

namespace {

constexpr std::string_view kAlgorithm = "AWS4-HMAC-SHA256";
constexpr std::string_view kEmptyHash =
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
constexpr std::string_view kUnsigned = "UNSIGNED-PAYLOAD";
constexpr std::string_view kStreamingSigned = "STREAMING-AWS4-HMAC-SHA256-PAYLOAD";

bool is_hex64(std::string_view s) {
    return s.size() == 64 && std::all_of(s.begin(), s.end(), [](char c) {
               return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
           });
}

bool unreserved(char c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
           c == '-' || c == '.' || c == '_' || c == '~';
}

/// SigV4's UriEncode: every byte but the unreserved ones (and '/' with keep_slash) as %XX,
/// uppercase hex.
void uri_encode(std::string_view s, bool keep_slash, std::string& out) {
    for (const char c : s) {
        if (unreserved(c) || (keep_slash && c == '/')) {
            out.push_back(c);
        } else {
            out.push_back('%');
            egress::append_hex(out, &c, 1, /*upper=*/true);
        }
    }
}

/// RFC 3986 5.2.4's dot segments removed, and empty segments ("//") as AWS requires: the
/// path a service other than S3 signs, before it is encoded (botocore's remove_dot_segments).
std::string remove_dot_segments(std::string_view path) {
    std::vector<std::string_view> out;
    for (size_t pos = 0; pos <= path.size();) {
        size_t slash = path.find('/', pos);
        if (slash == std::string_view::npos) {
            slash = path.size();
        }
        const std::string_view seg = path.substr(pos, slash - pos);
        if (seg == "..") {
            if (!out.empty()) {
                out.pop_back();
            }
        } else if (!seg.empty() && seg != ".") {
            out.push_back(seg);
        }
        pos = slash + 1;
    }
    std::string result = path.starts_with('/') ? "/" : "";
    for (size_t i = 0; i < out.size(); ++i) {
        if (i > 0) {
            result.push_back('/');
        }
        result.append(out[i]);
    }
    if (path.ends_with('/') && !out.empty()) {
        result.push_back('/');
    }
    return result;
}

/// The path as the client sent it for S3; for other services with dot and empty segments
/// removed, then encoded again (so "%20" signs as "%2520"). This is how the SDKs compute it
/// from the path they put on the wire, and so how the sandbox's own SDK computed it.
std::string canonical_uri(std::string_view path, bool s3) {
    if (path.empty()) {
        return "/";
    }
    if (s3) {
        return std::string(path);
    }
    std::string out;
    uri_encode(remove_dot_segments(path), true, out);
    return out;
}

/// The query's name=value pairs as sent (the SDKs send them encoded), a pair without '='
/// as "name=", sorted by name, then value.
std::string canonical_query(std::string_view query) {
    if (query.empty()) {
        return {};
    }
    std::vector<std::pair<std::string_view, std::string_view>> params;
    for (size_t pos = 0; pos <= query.size();) {
        size_t amp = query.find('&', pos);
        if (amp == std::string_view::npos) {
            amp = query.size();
        }
        const std::string_view part = query.substr(pos, amp - pos);
        const size_t eq = part.find('=');
        params.emplace_back(part.substr(0, eq),
                            eq == std::string_view::npos ? std::string_view() : part.substr(eq + 1));
        pos = amp + 1;
    }
    std::sort(params.begin(), params.end());
    std::string out;
    out.reserve(query.size() + params.size());
    for (size_t i = 0; i < params.size(); ++i) {
        if (i > 0) {
            out.push_back('&');
        }
        out.append(params[i].first).append("=").append(params[i].second);
    }
    return out;
}

bool signs_header(std::string_view name) {
    return name.starts_with("x-amz-") || name == "content-type" || name == "content-md5" ||
           name == "range";
}

/// A header value as SigV4 canonicalizes it: leading and trailing blanks trimmed, runs of
/// spaces inside collapsed to one.
void append_trimmed(std::string_view v, std::string& out) {
    const size_t b = v.find_first_not_of(" \t");
    if (b == std::string_view::npos) {
        return;
    }
    const size_t e = v.find_last_not_of(" \t");
    v = v.substr(b, e - b + 1);
    bool space = false;
    for (const char c : v) {
        if (c == ' ' || c == '\t') {
            space = true;
            continue;
        }
        if (space) {
            out.push_back(' ');
            space = false;
        }
        out.push_back(c);
    }
}

using Mac = std::array<unsigned char, 32>;

// HMAC-SHA256 through an algorithm fetched once: HMAC() fetches its own from the provider on
// every call in OpenSSL 3, which was most of a signature's cost (credstore::sha256_hex does
// the same for the digests).
EVP_MAC* hmac_algorithm() {
    static EVP_MAC* const mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
    return mac;
}

/// An HMAC-SHA256 context keyed with `key`, or null.
EVP_MAC_CTX* keyed_hmac(std::string_view key) {
    EVP_MAC_CTX* ctx = EVP_MAC_CTX_new(hmac_algorithm());
    char digest[] = "SHA256";
    const OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string("digest", digest, 0),
                                 OSSL_PARAM_construct_end()};
    if (ctx != nullptr && EVP_MAC_init(ctx, reinterpret_cast<const unsigned char*>(key.data()),
                                       key.size(), params) != 1) {
        EVP_MAC_CTX_free(ctx);
        ctx = nullptr;
    }
    return ctx;
}

/// The HMAC of `data` on a keyed context (consumed, not freed); all zeros on failure: a
/// signature AWS refuses, never one made with a wrong key.
Mac finish_hmac(EVP_MAC_CTX* ctx, std::string_view data) {
    Mac out{};
    size_t n = 0;
    const bool ok =
        ctx != nullptr &&
        EVP_MAC_update(ctx, reinterpret_cast<const unsigned char*>(data.data()), data.size()) ==
            1 &&
        EVP_MAC_final(ctx, out.data(), &n, out.size()) == 1;
    if (!ok) {
        out.fill(0);
    }
    return out;
}

Mac hmac(std::string_view key, std::string_view data) {
    EVP_MAC_CTX* ctx = keyed_hmac(key);
    Mac out = finish_hmac(ctx, data);
    EVP_MAC_CTX_free(ctx);  // cleanses its key schedule
    return out;
}

std::string_view view(const Mac& m) {
    return {reinterpret_cast<const char*>(m.data()), m.size()};
}

/// HMAC("AWS4" + secret, day), then the region, the service and "aws4_request": the key that
/// signs for a whole day. Every step is wiped.
Mac signing_key(std::string_view day, const InjectSpec& spec, std::string_view secret) {
    std::string k_secret;
    k_secret.reserve(4 + secret.size());
    k_secret.append("AWS4").append(secret);
    Mac k_date = hmac(k_secret, day);
    egress::secure_wipe(k_secret);
    Mac k_region = hmac(view(k_date), spec.region);
    Mac k_service = hmac(view(k_region), spec.service);
    Mac k_signing = hmac(view(k_service), "aws4_request");
    for (Mac* m : {&k_date, &k_region, &k_service}) {
        egress::secure_zero(m->data(), m->size());
    }
    return k_signing;
}

std::string amz_date(TimePoint now) {
    const std::time_t t = Clock::to_time_t(now);
    std::tm tm{};
    gmtime_r(&t, &tm);
    char buf[20];
    std::strftime(buf, sizeof buf, "%Y%m%dT%H%M%SZ", &tm);
    return buf;
}

bool valid_scope_part(std::string_view s) {
    return !s.empty() && s.size() <= 64 && std::all_of(s.begin(), s.end(), [](char c) {
               return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-';
           });
}

bool valid_access_key_id(std::string_view id) {
    return id.size() >= 16 && id.size() <= 128 && std::all_of(id.begin(), id.end(), [](char c) {
               return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9');
           });
}

/// The fields of a credentials document, read from `secret` (JSON). The parser's temporary
/// buffer and the value's storage are arrays of ours, wiped when done.
Result<bool> read_credentials_document(std::string_view secret, AwsCredentials& out) {
    constexpr std::string_view kWhat = "credentials document: ";
    std::vector<unsigned char> arena(2 * secret.size() + 4096);
    std::array<unsigned char, 4096> temp{};
    std::string error;
    try {
        boost::json::static_resource storage(arena.data(), arena.size());
        boost::json::parser parser(boost::json::storage_ptr(), {}, temp.data(), temp.size());
        parser.reset(boost::json::storage_ptr(&storage));
        boost::json::error_code ec;
        parser.write(secret.data(), secret.size(), ec);
        if (ec) {
            error = "not JSON (expected {\"AccessKeyId\": ..., \"SecretAccessKey\": ..., "
                    "\"SessionToken\": ...})";
        } else {
            const boost::json::value doc = parser.release();
            const boost::json::object* o = doc.if_object();
            auto field = [&](const char* name) -> const boost::json::string* {
                const boost::json::value* v = o != nullptr ? o->if_contains(name) : nullptr;
                return v != nullptr ? v->if_string() : nullptr;
            };
            const boost::json::string* id = field("AccessKeyId");
            const boost::json::string* key = field("SecretAccessKey");
            const boost::json::value* token_value =
                o != nullptr ? o->if_contains("SessionToken") : nullptr;
            const boost::json::string* token = field("SessionToken");
            if (o == nullptr) {
                error = "not a JSON object";
            } else if (id == nullptr || !valid_access_key_id(*id)) {
                error = "AccessKeyId is missing or not 16 to 128 letters and digits";
            } else if (key == nullptr || key->empty()) {
                error = "SecretAccessKey is missing or not a string";
            } else if (token_value != nullptr && !token_value->is_null() &&
                       (token == nullptr || token->empty() || !valid_header_value(*token))) {
                error = "SessionToken is not a string that can be a header value";
            } else {
                out.access_key_id = std::string(*id);
                out.secret_access_key = std::make_shared<const credstore::SecretValue>(
                    std::string_view(*key));
                if (token != nullptr) {
                    out.session_token = std::make_shared<const credstore::SecretValue>(
                        std::string_view(*token));
                }
            }
        }
    } catch (const std::bad_alloc&) {
        error = "too deeply nested or too large";
    }
    egress::secure_zero(arena.data(), arena.size());
    egress::secure_zero(temp.data(), temp.size());
    if (!error.empty()) {
        return make_error(std::string(kWhat) + error);
    }
    return true;
}

}  // namespace

Result<std::shared_ptr<AwsCredentials>> aws_credentials(const InjectSpec& spec,
                                                        std::string_view secret) {
    auto creds = std::make_shared<AwsCredentials>();
    if (!spec.access_key_id.empty()) {
        creds->access_key_id = spec.access_key_id;
        creds->secret_access_key = std::make_shared<const credstore::SecretValue>(secret);
        return creds;
    }
    Result<bool> read = read_credentials_document(secret, *creds);
    if (!read) {
        return make_error(read.error());
    }
    return creds;
}

std::string aws_spec_error(const InjectSpec& spec) {
    if (!spec.access_key_id.empty() && !valid_access_key_id(spec.access_key_id)) {
        return "inject.access_key_id: expected 16 to 128 letters and digits (e.g. AKIA...), "
               "or none for a credentials document as the secret";
    }
    if (!valid_scope_part(spec.region)) {
        return "inject.region: expected a region such as us-east-1 (lowercase letters, digits, "
               "'-')";
    }
    if (!valid_scope_part(spec.service)) {
        return "inject.service: expected a service such as s3 (lowercase letters, digits, '-')";
    }
    return {};
}

AwsPayload aws_payload(const RequestHead& head, const InjectSpec& spec, bool body_empty) {
    AwsPayload p;
    const size_t q = head.path.find('?');
    if (q != std::string::npos) {
        const std::string query = ascii_lower(std::string_view(head.path).substr(q));
        if (query.find("x-amz-signature=") != std::string::npos ||
            query.find("x-amz-credential=") != std::string::npos) {
            p.kind = AwsPayload::Kind::Refuse;
            p.reason = "aws_presigned_query";
            return p;
        }
    }
    if (const std::string* declared = head.find("x-amz-content-sha256")) {
        // Signed as sent: the header goes upstream as it is, and AWS reads the hash from it.
        if (head.count("x-amz-content-sha256") != 1) {
            p.kind = AwsPayload::Kind::Refuse;
            p.reason = "bad_aws_payload_hash";
        } else if (is_hex64(*declared)) {
            p.hash = *declared;
        } else if (*declared == kUnsigned || *declared == "STREAMING-UNSIGNED-PAYLOAD-TRAILER") {
            p.hash = *declared;
        } else if (*declared == kStreamingSigned) {
            p.hash = *declared;
            p.chunked = true;
        } else if (declared->starts_with("STREAMING-")) {
            p.kind = AwsPayload::Kind::Refuse;
            p.reason = "aws_chunk_signing";
        } else {
            p.kind = AwsPayload::Kind::Refuse;
            p.reason = "bad_aws_payload_hash";
        }
        return p;
    }
    const bool s3 = spec.service == "s3";
    if (body_empty) {
        p.hash = kEmptyHash;
    } else if (s3) {
        p.hash = kUnsigned;
    } else {
        p.kind = AwsPayload::Kind::NeedBody;
        return p;
    }
    p.add_header = s3;  // S3 refuses a request without it; other services do not read it
    return p;
}

std::string aws_payload_hash(std::string_view bytes) {
    return credstore::sha256_hex(bytes);
}

std::string aws_canonical_request(const RequestHead& head, const InjectSpec& spec,
                                  std::string_view payload_hash, std::string& signed_headers) {
    std::vector<std::pair<std::string_view, std::string_view>> fields;
    fields.emplace_back("host", head.authority);
    for (const Header& h : head.headers) {
        if (signs_header(h.name)) {
            fields.emplace_back(h.name, h.value);
        }
    }
    // By name; the values of a repeated field keep their order (joined with ',').
    std::stable_sort(fields.begin(), fields.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    std::string headers;
    signed_headers.clear();
    for (size_t i = 0; i < fields.size(); ++i) {
        const bool repeat = i > 0 && fields[i].first == fields[i - 1].first;
        if (repeat) {
            headers.push_back(',');
        } else {
            if (i > 0) {
                headers.push_back('\n');
                signed_headers.push_back(';');
            }
            headers.append(fields[i].first).push_back(':');
            signed_headers.append(fields[i].first);
        }
        append_trimmed(fields[i].second, headers);
    }
    headers.push_back('\n');

    const std::string_view path = head.path_only();
    const std::string_view query =
        path.size() < head.path.size() ? std::string_view(head.path).substr(path.size() + 1)
                                       : std::string_view();
    std::string out;
    out.reserve(256 + head.path.size() + headers.size());
    out.append(head.method).push_back('\n');
    out.append(canonical_uri(path, spec.service == "s3")).push_back('\n');
    out.append(canonical_query(query)).push_back('\n');
    out.append(headers).push_back('\n');
    out.append(signed_headers).push_back('\n');
    out.append(payload_hash);
    return out;
}

AwsSigningKeys::~AwsSigningKeys() {
    EVP_MAC_CTX_free(keyed_);  // cleanses its key schedule
}

AwsSigningKeys::Mac AwsSigningKeys::sign(std::string_view day, const InjectSpec& spec,
                                         std::string_view secret, std::string_view data) {
    EVP_MAC_CTX* ctx = nullptr;
    {
        std::lock_guard lock(mutex_);
        if (keyed_ == nullptr || day_ != day) {
            EVP_MAC_CTX_free(keyed_);
            Mac key = signing_key(day, spec, secret);
            keyed_ = keyed_hmac(view(key));
            egress::secure_zero(key.data(), key.size());
            day_ = day;
        }
        ctx = keyed_ != nullptr ? EVP_MAC_CTX_dup(keyed_) : nullptr;
    }
    Mac out = finish_hmac(ctx, data);
    EVP_MAC_CTX_free(ctx);
    return out;
}

AwsSignature aws_sign(RequestHead& head, const InjectSpec& spec, AwsCredentials& creds,
                      std::string_view payload_hash, TimePoint now) {
    head.remove("authorization");
    if (creds.session_token) {  // ours, signed with the other x-amz-* fields
        head.set("x-amz-security-token", std::string(creds.session_token->reveal()));
    } else {
        head.remove("x-amz-security-token");  // the dummy credentials' session: not ours
    }
    const std::string date = amz_date(now);
    head.set("x-amz-date", date);
    std::string signed_headers;
    const std::string request = aws_canonical_request(head, spec, payload_hash, signed_headers);
    const std::string_view day = std::string_view(date).substr(0, 8);
    std::string scope;
    scope.append(day).append("/").append(spec.region).append("/").append(spec.service);
    scope.append("/aws4_request");
    std::string to_sign;
    to_sign.append(kAlgorithm).append("\n").append(date).append("\n").append(scope);
    to_sign.append("\n").append(credstore::sha256_hex(request));

    const Mac sig = creds.keys.sign(day, spec, creds.secret_access_key->reveal(), to_sign);
    std::string value;
    value.reserve(160 + signed_headers.size());
    value.append(kAlgorithm).append(" Credential=").append(creds.access_key_id).append("/");
    value.append(scope).append(", SignedHeaders=").append(signed_headers);
    std::string signature = egress::to_hex(sig.data(), sig.size());
    value.append(", Signature=").append(signature);
    head.set("authorization", std::move(value));
    head.never_index = "authorization";
    head.never_index_also = creds.session_token ? "x-amz-security-token" : "";
    return {date, std::move(scope), std::move(signature)};
}

AwsChunkSigner::AwsChunkSigner(std::shared_ptr<AwsCredentials> creds, const InjectSpec& spec,
                               AwsSignature seed)
    : creds_(std::move(creds)), spec_(spec), prev_(std::move(seed)) {}

AwsChunkSigner::Status AwsChunkSigner::feed(std::string_view in, size_t max_chunk) {
    out_.clear();
    if (failed_ != Status::Ok || in.empty()) {
        return failed_;  // a body that broke stays broken
    }
    if (done_) {
        return failed_ = Status::Malformed;  // bytes after the last chunk
    }
    in_.append(in);
    return failed_ = parse(max_chunk);
}

AwsChunkSigner::Status AwsChunkSigner::parse(size_t max_chunk) {
    static constexpr std::string_view kExt = ";chunk-signature=";
    // hex(size) (at most 16 digits), the extension, a signature: the longest header line
    static constexpr size_t kMaxLine = 16 + kExt.size() + 64;
    // S3's smallest chunk but for the last one with data (S3 refuses smaller ones): a chunk
    // costs a signature, so a body of 1-byte chunks would cost ~20 times a body's CPU.
    static constexpr uint64_t kMinChunk = 8192;
    size_t pos = 0;  // in_'s bytes before pos are done: erased once, on the way out
    const auto done = [&](Status s) {
        in_.erase(0, pos);
        return s;
    };
    for (;;) {
        const std::string_view rest = std::string_view(in_).substr(pos);
        if (line_ == 0) {
            const size_t crlf = rest.find("\r\n");
            if (crlf == std::string::npos) {
                return done(rest.size() > kMaxLine + 1 ? Status::Malformed : Status::Ok);
            }
            const std::string_view line = rest.substr(0, crlf);
            const size_t semi = line.find(';');
            if (semi == 0 || semi == std::string_view::npos || semi > 16 ||
                line.substr(semi, kExt.size()) != kExt ||
                !is_hex64(line.substr(semi + kExt.size()))) {
                return done(Status::Malformed);
            }
            uint64_t size = 0;
            for (const char c : line.substr(0, semi)) {
                const int v = c >= '0' && c <= '9'   ? c - '0'
                              : c >= 'a' && c <= 'f' ? c - 'a' + 10
                              : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                                     : -1;
                if (v < 0) {
                    return done(Status::Malformed);
                }
                size = size * 16 + static_cast<uint64_t>(v);
            }
            if (size > max_chunk) {
                return done(Status::TooLarge);
            }
            if (size > 0 && small_) {
                return done(Status::Malformed);  // a small chunk was not the last with data
            }
            small_ = size > 0 && size < kMinChunk;
            line_ = crlf;
            size_ = size;
        }
        // The chunk's data and its CRLF; the last chunk (size 0) ends with a CRLF of its own.
        const size_t need = line_ + 2 + size_ + 2;
        if (rest.size() < need) {
            return done(Status::Ok);
        }
        if (rest.substr(need - 2, 2) != "\r\n") {
            return done(Status::Malformed);
        }
        const std::string_view data = rest.substr(line_ + 2, size_);
        std::string to_sign;
        to_sign.reserve(256);
        to_sign.append(kAlgorithm).append("-PAYLOAD\n").append(prev_.date).append("\n");
        to_sign.append(prev_.scope).append("\n").append(prev_.signature).append("\n");
        to_sign.append(kEmptyHash).append("\n").append(credstore::sha256_hex(data));
        const Mac sig = creds_->keys.sign(std::string_view(prev_.date).substr(0, 8), spec_,
                                          creds_->secret_access_key->reveal(), to_sign);
        prev_.signature = egress::to_hex(sig.data(), sig.size());
        out_.append(rest.substr(0, rest.find(';') + kExt.size())).append(prev_.signature);
        out_.append("\r\n").append(data).append("\r\n");
        pos += need;
        line_ = 0;
        if (size_ == 0) {
            if (pos != in_.size()) {
                return done(Status::Malformed);  // bytes after the last chunk
            }
            done_ = true;
            return done(Status::Ok);
        }
    }
}

}  // namespace egress::policy
