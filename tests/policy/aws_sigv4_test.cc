// AWS Signature Version 4: the signatures AWS publishes (its SigV4 test suite's get-vanilla
// and the S3 developer guide's examples), and what egressd does to the sandbox's own signing.
// The expected values are AWS's, and the non-S3 one botocore's (an independent signer).
#include "policy/aws_sigv4.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <ctime>

#include "credstore/secret.h"
#include "policy/pipeline.h"

namespace egress::policy {
namespace {

constexpr std::string_view kEmpty =
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

TimePoint at(int y, int mo, int d, int h, int mi, int s) {
    std::tm tm{};
    tm.tm_year = y - 1900;
    tm.tm_mon = mo - 1;
    tm.tm_mday = d;
    tm.tm_hour = h;
    tm.tm_min = mi;
    tm.tm_sec = s;
    return Clock::from_time_t(timegm(&tm));
}

InjectSpec spec(std::string id, std::string region, std::string service) {
    InjectSpec s;
    s.type = InjectType::AwsSigV4;
    s.access_key_id = std::move(id);
    s.region = std::move(region);
    s.service = std::move(service);
    return s;
}

RequestHead head(std::string method, std::string authority, std::string path,
                 std::vector<Header> headers = {}) {
    RequestHead h;
    h.method = std::move(method);
    h.scheme = "https";
    h.authority = std::move(authority);
    h.path = std::move(path);
    h.headers = std::move(headers);
    return h;
}

/// aws_sign with credentials made from a spec and a secret access key.
void sign_with(RequestHead& h, const InjectSpec& s, std::string_view secret,
               std::string_view payload_hash, TimePoint now) {
    Result<std::shared_ptr<AwsCredentials>> creds = aws_credentials(s, secret);
    ASSERT_TRUE(creds) << creds.error();
    aws_sign(h, s, **creds, payload_hash, now);
}

std::string signature_of(const RequestHead& h) {
    const std::string* auth = h.find("authorization");
    if (auth == nullptr) {
        return "";
    }
    const size_t pos = auth->find("Signature=");
    return pos == std::string::npos ? "" : auth->substr(pos + 10);
}

TEST(AwsSigV4, SignsTheTestSuitesGetVanilla) {
    RequestHead h = head("GET", "example.amazonaws.com", "/");
    sign_with(h, spec("AKIDEXAMPLE", "us-east-1", "service"),
             "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", kEmpty, at(2015, 8, 30, 12, 36, 0));
    ASSERT_NE(h.find("x-amz-date"), nullptr);
    EXPECT_EQ(*h.find("x-amz-date"), "20150830T123600Z");
    ASSERT_NE(h.find("authorization"), nullptr);
    EXPECT_EQ(*h.find("authorization"),
              "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, "
              "SignedHeaders=host;x-amz-date, "
              "Signature=5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31");
    EXPECT_EQ(h.never_index, "authorization");
}

TEST(AwsSigV4, SignsTheS3GuidesGetObjectWithRange) {
    RequestHead h = head("GET", "examplebucket.s3.amazonaws.com", "/test.txt",
                         {{"range", "bytes=0-9"}, {"x-amz-content-sha256", std::string(kEmpty)},
                          {"user-agent", "not signed"}});
    sign_with(h, spec("AKIAIOSFODNN7EXAMPLE", "us-east-1", "s3"),
             "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", kEmpty, at(2013, 5, 24, 0, 0, 0));
    EXPECT_NE(h.find("authorization")->find("SignedHeaders=host;range;x-amz-content-sha256;"
                                            "x-amz-date,"),
              std::string::npos);
    EXPECT_EQ(signature_of(h), "f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41");
}

TEST(AwsSigV4, SignsTheS3GuidesListObjectsQuery) {
    RequestHead h = head("GET", "examplebucket.s3.amazonaws.com", "/?max-keys=2&prefix=J",
                         {{"x-amz-content-sha256", std::string(kEmpty)}});
    sign_with(h, spec("AKIAIOSFODNN7EXAMPLE", "us-east-1", "s3"),
             "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", kEmpty, at(2013, 5, 24, 0, 0, 0));
    EXPECT_EQ(signature_of(h), "34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7");
}

TEST(AwsSigV4, EncodesAPathTwiceAndSortsTheQueryForServicesOtherThanS3) {
    // botocore 1.29 (SigV4Auth) signs this request with this canonical request.
    const std::string body = "{\"Limit\":1}";
    RequestHead h = head("POST", "ddb.example.com", "/a%20b/c~d?b=2&a=x%2By&a=1",
                         {{"content-type", "application/x-amz-json-1.0"},
                          {"x-amz-target", "DynamoDB_20120810.ListTables"}});
    h.set("x-amz-date", "20261206T120000Z");
    std::string signed_headers;
    const InjectSpec s = spec("AKIDEXAMPLE", "eu-west-1", "dynamodb");
    EXPECT_EQ(aws_canonical_request(h, s, aws_payload_hash(body), signed_headers),
              "POST\n/a%2520b/c~d\na=1&a=x%2By&b=2\n"
              "content-type:application/x-amz-json-1.0\nhost:ddb.example.com\n"
              "x-amz-date:20261206T120000Z\nx-amz-target:DynamoDB_20120810.ListTables\n\n"
              "content-type;host;x-amz-date;x-amz-target\n"
              "55522f708dcfebccb7bd3e8d0001a53ecaf2beca9ca801f1e9161e24215faa99");
    EXPECT_EQ(signed_headers, "content-type;host;x-amz-date;x-amz-target");
    sign_with(h, s, "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", aws_payload_hash(body),
             at(2026, 12, 6, 12, 0, 0));
    EXPECT_EQ(signature_of(h), "e464de191d129ad37b38f430418b47a35471624c670b543c387f059506449300");
}

TEST(AwsSigV4, KeepsTheDaysSigningKeyAndMakesTheNextDaysOwn) {
    const InjectSpec s = spec("AKIDEXAMPLE", "us-east-1", "service");
    const std::string secret = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY";
    std::shared_ptr<AwsCredentials> kept = *aws_credentials(s, secret);
    auto sign = [&](TimePoint when, AwsCredentials& creds) {
        RequestHead h = head("GET", "example.amazonaws.com", "/");
        aws_sign(h, s, creds, kEmpty, when);
        return signature_of(h);
    };
    // get-vanilla with one pin's credentials, twice (key made, then kept), and the next day
    // (made again: the same as fresh credentials give).
    EXPECT_EQ(sign(at(2015, 8, 30, 12, 36, 0), *kept),
              "5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31");
    EXPECT_EQ(sign(at(2015, 8, 30, 12, 36, 0), *kept),
              "5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31");
    const std::string next_day = sign(at(2015, 8, 31, 0, 0, 1), *kept);
    EXPECT_EQ(next_day, sign(at(2015, 8, 31, 0, 0, 1), **aws_credentials(s, secret)));
    EXPECT_NE(next_day, "");
    EXPECT_NE(next_day, "5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31");
}

TEST(AwsSigV4, ReadsACredentialsDocumentWithASessionToken) {
    // As `aws sts assume-role --query Credentials` prints it (Expiration ignored).
    InjectSpec s = spec("", "us-east-1", "service");
    const std::string doc =
        R"({"AccessKeyId": "ASIAEXAMPLETEMP00001", "SecretAccessKey": )"
        R"("wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", "SessionToken": "FwoGZXIvYXdzEXAMPLE==",)"
        R"( "Expiration": "2026-12-06T15:00:00+00:00"})";
    Result<std::shared_ptr<AwsCredentials>> creds = aws_credentials(s, doc);
    ASSERT_TRUE(creds) << creds.error();
    EXPECT_EQ((*creds)->access_key_id, "ASIAEXAMPLETEMP00001");
    ASSERT_NE((*creds)->session_token, nullptr);
    RequestHead h = head("GET", "example.amazonaws.com", "/",
                         {{"x-amz-security-token", "the-sandbox-dummy-token"}});
    aws_sign(h, s, **creds, kEmpty, at(2015, 8, 30, 12, 36, 0));
    ASSERT_EQ(h.count("x-amz-security-token"), 1u);
    EXPECT_EQ(*h.find("x-amz-security-token"), "FwoGZXIvYXdzEXAMPLE==");
    // The token is a credential too: never indexed by an HTTP/2 encoder, wiped after use.
    EXPECT_TRUE(h.never_indexed("authorization"));
    EXPECT_TRUE(h.never_indexed("x-amz-security-token"));
    EXPECT_FALSE(h.never_indexed("x-amz-date"));
    const std::string auth = *h.find("authorization");
    EXPECT_EQ(auth.rfind("AWS4-HMAC-SHA256 Credential=ASIAEXAMPLETEMP00001/20150830/", 0), 0u);
    EXPECT_NE(auth.find("SignedHeaders=host;x-amz-date;x-amz-security-token,"),
              std::string::npos);
    RequestHead wiped = h;
    wiped.wipe_injected();
    EXPECT_EQ(*wiped.find("x-amz-security-token"), std::string(21, '\0'));
    EXPECT_EQ(*wiped.find("authorization"), std::string(auth.size(), '\0'));
    EXPECT_EQ(*wiped.find("x-amz-date"), "20150830T123600Z");
    // The same request signed with the key alone differs only by the token it signs.
    s.access_key_id = "ASIAEXAMPLETEMP00001";
    RequestHead plain = head("GET", "example.amazonaws.com", "/",
                             {{"x-amz-security-token", "FwoGZXIvYXdzEXAMPLE=="}});
    std::string signed_headers;
    plain.set("x-amz-date", "20150830T123600Z");
    EXPECT_EQ(aws_canonical_request(plain, s, kEmpty, signed_headers),
              aws_canonical_request(h, s, kEmpty, signed_headers));
}

TEST(AwsSigV4, RefusesAMalformedCredentialsDocumentWithoutItsValues) {
    const InjectSpec s = spec("", "us-east-1", "s3");
    const std::string key = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY";
    for (const std::string& doc : std::vector<std::string>{
             key, "[1]", R"({"SecretAccessKey": ")" + key + R"("})",
          R"({"AccessKeyId": "AKIA/BAD", "SecretAccessKey": ")" + key + R"("})",
          R"({"AccessKeyId": "AKIAIOSFODNN7EXAMPLE", "SecretAccessKey": 5})",
          R"({"AccessKeyId": "AKIAIOSFODNN7EXAMPLE", "SecretAccessKey": ")" + key +
              R"(", "SessionToken": "a
b"})"}) {
        Result<std::shared_ptr<AwsCredentials>> creds = aws_credentials(s, doc);
        ASSERT_FALSE(creds);
        EXPECT_EQ(creds.error().rfind("credentials document: ", 0), 0u) << creds.error();
        EXPECT_EQ(creds.error().find("wJalrXUtnFEMI"), std::string::npos);
    }
    // A pin on such a secret refuses (503) instead of forwarding without a signature.
    Pin pin;
    pin.id = "p";
    pin.host = *HostPattern::parse("aws.test");
    pin.inject = s;
    pin.secret = std::make_shared<const credstore::SecretValue>(key);
    prepare_injection(pin);
    ASSERT_NE(pin.injection, nullptr);
    EXPECT_EQ(pin.injection->aws, nullptr);
    EXPECT_EQ(pin.injection->aws_error.rfind("credentials document: not JSON", 0), 0u);
    RunPolicy run;
    run.id = "r";
    run.pins.push_back(pin);
    GlobalPolicy global;
    RequestContext ctx;
    ctx.global = &global;
    ctx.run = &run;
    ctx.target = HostPort{"aws.test", 443};
    ctx.tls = true;
    RequestHead h = head("GET", "aws.test", "/b/k");
    const Decision d = RequestPipeline().run(h, ctx);
    EXPECT_EQ(d.status, 503);
    EXPECT_EQ(d.reason, "aws_credentials_invalid");
}

TEST(AwsSigV4, SignsThePathAndQueryAsSentForS3AndNormalizedForOthers) {
    // As botocore computes them from the URL it sends: S3 takes the path as it is; other
    // services remove dot and empty segments and encode the path once more.
    const std::string path = "/bkt/a//b/./c/../d%2fe+f?b=2&a&c=x%20y&a=0";
    RequestHead h = head("GET", "s3.test", path);
    h.set("x-amz-date", "20261206T120000Z");
    std::string signed_headers;
    const std::string s3 =
        aws_canonical_request(h, spec("AKIDEXAMPLE", "us-east-1", "s3"), kEmpty, signed_headers);
    EXPECT_EQ(s3.substr(0, s3.find("\nhost:")), "GET\n/bkt/a//b/./c/../d%2fe+f\na=&a=0&b=2&c=x%20y");
    const std::string other = aws_canonical_request(h, spec("AKIDEXAMPLE", "us-east-1", "sts"),
                                                    kEmpty, signed_headers);
    EXPECT_EQ(other.substr(0, other.find("\nhost:")),
              "GET\n/bkt/a/b/d%252fe%2Bf\na=&a=0&b=2&c=x%20y");
    RequestHead dots = head("GET", "s3.test", "/a/../../b/");
    EXPECT_EQ(aws_canonical_request(dots, spec("AKIDEXAMPLE", "us-east-1", "sts"), kEmpty,
                                    signed_headers)
                  .substr(0, 7),
              "GET\n/b/");
}

TEST(AwsSigV4, CanonicalHeadersAreTrimmedAndRepeatsJoined) {
    RequestHead h = head("GET", "s3.test", "/",
                         {{"x-amz-meta-a", "  one   two  "}, {"x-amz-meta-a", "three"},
                          {"content-type", "text/plain"}, {"accept", "*/*"}});
    h.set("x-amz-date", "20261206T120000Z");
    std::string signed_headers;
    const std::string c = aws_canonical_request(h, spec("AKIDEXAMPLE", "us-east-1", "s3"),
                                                kEmpty, signed_headers);
    EXPECT_NE(c.find("\nx-amz-meta-a:one two,three\n"), std::string::npos);
    EXPECT_EQ(signed_headers, "content-type;host;x-amz-date;x-amz-meta-a");
}

TEST(AwsSigV4, DecidesThePayloadHashFromTheHead) {
    const InjectSpec s3 = spec("AKIDEXAMPLE", "us-east-1", "s3");
    const InjectSpec ddb = spec("AKIDEXAMPLE", "us-east-1", "dynamodb");
    const std::string hex(64, 'A');

    AwsPayload p = aws_payload(head("PUT", "s3.test", "/b/k"), s3, false);
    EXPECT_EQ(p.kind, AwsPayload::Kind::Hash);
    EXPECT_EQ(p.hash, "UNSIGNED-PAYLOAD");
    EXPECT_TRUE(p.add_header);

    p = aws_payload(head("GET", "s3.test", "/b/k"), s3, true);
    EXPECT_EQ(p.hash, kEmpty);
    EXPECT_TRUE(p.add_header);

    p = aws_payload(head("POST", "ddb.test", "/"), ddb, false);
    EXPECT_EQ(p.kind, AwsPayload::Kind::NeedBody);

    p = aws_payload(head("POST", "ddb.test", "/"), ddb, true);
    EXPECT_EQ(p.hash, kEmpty);
    EXPECT_FALSE(p.add_header);  // only S3 reads it

    p = aws_payload(head("POST", "ddb.test", "/", {{"x-amz-content-sha256", hex}}), ddb, false);
    EXPECT_EQ(p.kind, AwsPayload::Kind::Hash);
    EXPECT_EQ(p.hash, hex);      // as sent: AWS reads it from the header, which goes as it is
    EXPECT_FALSE(p.add_header);  // the client's own stays

    p = aws_payload(head("POST", "ddb.test", "/", {{"x-amz-content-sha256", hex},
                                                   {"x-amz-content-sha256", "UNSIGNED-PAYLOAD"}}),
                    ddb, false);
    EXPECT_EQ(p.kind, AwsPayload::Kind::Refuse);
    EXPECT_STREQ(p.reason, "bad_aws_payload_hash");

    p = aws_payload(head("PUT", "s3.test", "/b/k",
                         {{"x-amz-content-sha256", "STREAMING-UNSIGNED-PAYLOAD-TRAILER"}}),
                    s3, false);
    EXPECT_EQ(p.hash, "STREAMING-UNSIGNED-PAYLOAD-TRAILER");

    p = aws_payload(head("PUT", "s3.test", "/b/k",
                         {{"x-amz-content-sha256", "STREAMING-AWS4-HMAC-SHA256-PAYLOAD"}}),
                    s3, false);
    EXPECT_EQ(p.kind, AwsPayload::Kind::Hash);  // signed as declared, its chunks again
    EXPECT_EQ(p.hash, "STREAMING-AWS4-HMAC-SHA256-PAYLOAD");
    EXPECT_TRUE(p.chunked);

    for (const char* other : {"STREAMING-AWS4-HMAC-SHA256-PAYLOAD-TRAILER",
                              "STREAMING-AWS4-ECDSA-P256-SHA256-PAYLOAD"}) {
        p = aws_payload(head("PUT", "s3.test", "/b/k", {{"x-amz-content-sha256", other}}), s3,
                        false);
        EXPECT_EQ(p.kind, AwsPayload::Kind::Refuse) << other;
        EXPECT_STREQ(p.reason, "aws_chunk_signing") << other;
    }

    p = aws_payload(head("PUT", "s3.test", "/b/k", {{"x-amz-content-sha256", "abc"}}), s3,
                    false);
    EXPECT_EQ(p.kind, AwsPayload::Kind::Refuse);
    EXPECT_STREQ(p.reason, "bad_aws_payload_hash");

    p = aws_payload(head("GET", "s3.test", "/b/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&x-amz-signature=0"),
                    s3, true);
    EXPECT_EQ(p.kind, AwsPayload::Kind::Refuse);
    EXPECT_STREQ(p.reason, "aws_presigned_query");
}

TEST(AwsSigV4, ValidatesTheSpec) {
    EXPECT_TRUE(aws_spec_error(spec("AKIAIOSFODNN7EXAMPLE", "us-east-1", "s3")).empty());
    EXPECT_EQ(aws_spec_error(spec("AKIA/SHORT", "us-east-1", "s3")).rfind("inject.access_key_id:", 0),
              0u);
    EXPECT_EQ(aws_spec_error(spec("AKIAIOSFODNN7EXAMPLE", "US East", "s3")).rfind("inject.region:", 0),
              0u);
    EXPECT_EQ(aws_spec_error(spec("AKIAIOSFODNN7EXAMPLE", "us-east-1", "")).rfind("inject.service:", 0),
              0u);
    Result<InjectSpec> v = validate_injection(spec("AKIAIOSFODNN7EXAMPLE", "us-east-1", "s3/x"));
    ASSERT_FALSE(v);
    EXPECT_EQ(v.error().rfind("inject.service:", 0), 0u);
}

// The pipeline with an aws-sigv4 pin: the sandbox's own signature and session token go, the
// request is signed with the pin's key, and a body the signature needs is left to the caller.
struct PipelineCase {
    GlobalPolicy global;
    RunPolicy run;
    RequestContext ctx;

    explicit PipelineCase(std::string service) {
        run.id = "r1";
        Pin pin;
        pin.id = "p1";
        pin.host = *HostPattern::parse("aws.test");
        pin.secret_name = "aws_key";
        pin.inject = spec("AKIAEGRESSTEST000001", "us-east-1", std::move(service));
        pin.secret = std::make_shared<const credstore::SecretValue>(
            std::string("wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"));
        prepare_injection(pin);
        run.pins.push_back(std::move(pin));
        ctx.global = &global;
        ctx.run = &run;
        ctx.target = HostPort{"aws.test", 443};
        ctx.tls = true;
        ctx.now = at(2026, 12, 6, 12, 0, 0);
    }
};

TEST(AwsSigV4Pipeline, ReplacesTheSandboxesSignature) {
    PipelineCase c("s3");
    RequestHead h = head(
        "GET", "aws.test", "/bkt/key",
        {{"authorization", "AWS4-HMAC-SHA256 Credential=AKIDSANDBOXDUMMY/20261206/us-east-1/s3/"
                           "aws4_request, SignedHeaders=host, Signature=00"},
         {"x-amz-date", "20200101T000000Z"},
         {"x-amz-security-token", "dummy-session"},
         {"x-amz-content-sha256", std::string(kEmpty)},
         {"accept-encoding", "gzip"}});
    c.ctx.body_empty = true;
    const Decision d = RequestPipeline().run(h, c.ctx);
    ASSERT_TRUE(d.forward()) << d.reason;
    EXPECT_FALSE(d.sign_body);
    EXPECT_EQ(d.reason, "injected");
    EXPECT_EQ(h.count("authorization"), 1u);
    EXPECT_EQ(h.find("authorization")->rfind("AWS4-HMAC-SHA256 Credential=AKIAEGRESSTEST000001/"
                                             "20261206/us-east-1/s3/aws4_request, ",
                                             0),
              0u);
    EXPECT_EQ(h.find("authorization")->find("AKIDSANDBOXDUMMY"), std::string::npos);
    EXPECT_EQ(h.find("x-amz-security-token"), nullptr);
    EXPECT_EQ(*h.find("x-amz-date"), "20261206T120000Z");
    // The key never leaves: the answer may stay encoded (nothing to scrub out of it).
    EXPECT_FALSE(d.secret_sent);
    ASSERT_NE(h.find("accept-encoding"), nullptr);
    EXPECT_EQ(*h.find("accept-encoding"), "gzip");
    // The same request signed directly gives the same signature.
    RequestHead again = head("GET", "aws.test", "/bkt/key",
                             {{"x-amz-content-sha256", std::string(kEmpty)},
                              {"accept-encoding", "identity"}});
    sign_with(again, c.run.pins[0].inject, "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", kEmpty,
             c.ctx.now);
    EXPECT_EQ(signature_of(h), signature_of(again));
    ASSERT_NE(d.scrub, nullptr);  // the secret key is still scrubbed from answers
}

TEST(AwsSigV4Pipeline, AddsUnsignedPayloadForAnS3Upload) {
    PipelineCase c("s3");
    RequestHead h = head("PUT", "aws.test", "/bkt/key", {{"content-length", "5"}});
    const Decision d = RequestPipeline().run(h, c.ctx);
    ASSERT_TRUE(d.forward()) << d.reason;
    ASSERT_NE(h.find("x-amz-content-sha256"), nullptr);
    EXPECT_EQ(*h.find("x-amz-content-sha256"), "UNSIGNED-PAYLOAD");
    EXPECT_NE(h.find("authorization")->find("x-amz-content-sha256"), std::string::npos);
}

TEST(AwsSigV4Pipeline, LeavesABodyHashToTheCallerThenSignsIt) {
    PipelineCase c("dynamodb");
    RequestHead h = head("POST", "aws.test", "/",
                         {{"authorization", "AWS4-HMAC-SHA256 dummy"},
                          {"content-type", "application/x-amz-json-1.0"}});
    const Decision d = RequestPipeline().run(h, c.ctx);
    ASSERT_TRUE(d.forward()) << d.reason;
    EXPECT_TRUE(d.sign_body);
    EXPECT_EQ(h.find("authorization"), nullptr);  // nothing of the sandbox's leaves unsigned
    sign_with_body(h, d, "{\"Limit\":1}", c.ctx.now);
    std::string signed_headers;
    RequestHead direct = head("POST", "aws.test", "/",
                              {{"content-type", "application/x-amz-json-1.0"},
                               {"accept-encoding", "identity"}});
    sign_with(direct, c.run.pins[0].inject, "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY",
             aws_payload_hash("{\"Limit\":1}"), c.ctx.now);
    EXPECT_EQ(signature_of(h), signature_of(direct));
    EXPECT_NE(signature_of(h), "");
    EXPECT_EQ(h.find("x-amz-content-sha256"), nullptr);
}

// aws-chunked bodies: AWS's example of a chunk-signed upload (the S3 API reference,
// "Signature calculations ... transferring payload in multiple chunks": 65536 and 1024 bytes of
// 'a' after the request's seed signature), with the sandbox's chunk signatures replaced.
std::string aws_chunk(size_t n, std::string_view sig) {
    char size[32];
    std::snprintf(size, sizeof(size), "%zx", n);
    return std::string(size) + ";chunk-signature=" + std::string(sig) + "\r\n" +
           std::string(n, 'a') + "\r\n";
}

constexpr std::string_view kDummySig =
    "0000000000000000000000000000000000000000000000000000000000000000";

struct ChunkCase {
    InjectSpec s3 = spec("AKIAIOSFODNN7EXAMPLE", "us-east-1", "s3");
    std::shared_ptr<AwsCredentials> creds;
    ChunkCase() {
        auto c = aws_credentials(s3, "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY");
        EXPECT_TRUE(c);
        creds = *c;
    }
    AwsChunkSigner signer() {
        return AwsChunkSigner(creds, s3,
                              {"20130524T000000Z", "20130524/us-east-1/s3/aws4_request",
                               "4f232c4386841ef735655705268965c44a0e4690baa4adea153f7db9fa80a0a9"});
    }
};

TEST(AwsChunkSigner, SignsAwsExampleUploadAgainPieceByPiece) {
    ChunkCase c;
    const std::string sent =
        aws_chunk(65536, kDummySig) + aws_chunk(1024, kDummySig) + aws_chunk(0, kDummySig);
    const std::string expected =
        aws_chunk(65536, "ad80c730a21e5b8d04586a2213dd63b9a0e99e0e2307b0ade35a65485a288648") +
        aws_chunk(1024, "0055627c9e194cb4542bae2aa5492e3c1575bbb81b612b7d234b86a503ef5497") +
        aws_chunk(0, "b6c6ea8a5354eaf15b3cb7646744f4275b71ea724fed81ceb9323e279d449df9");
    // Whole, and in pieces that split the header lines, the data and the CRLFs.
    for (size_t piece : {sent.size(), size_t{1}, size_t{7}, size_t{4096}, size_t{65600}}) {
        AwsChunkSigner signer = c.signer();
        std::string out;
        for (size_t off = 0; off < sent.size(); off += piece) {
            ASSERT_EQ(signer.feed(std::string_view(sent).substr(off, piece), 65536),
                      AwsChunkSigner::Status::Ok)
                << "piece " << piece << " at " << off;
            out.append(signer.output().data(), signer.output().size());
            EXPECT_EQ(signer.complete(), off + piece >= sent.size());
        }
        EXPECT_EQ(out.size(), sent.size());  // content-length stays true
        EXPECT_TRUE(out == expected) << "piece " << piece;
    }
}

TEST(AwsChunkSigner, RefusesWhatIsNotAwsChunked) {
    ChunkCase c;
    const std::string good = aws_chunk(3, kDummySig);
    const std::vector<std::pair<std::string, AwsChunkSigner::Status>> cases = {
        {"3\r\naaa\r\n", AwsChunkSigner::Status::Malformed},  // no signature
        {"3;chunk-signature=00\r\naaa\r\n", AwsChunkSigner::Status::Malformed},
        {"3;chunk-signaturX=" + std::string(kDummySig) + "\r\naaa\r\n",
         AwsChunkSigner::Status::Malformed},
        {"x;chunk-signature=" + std::string(kDummySig) + "\r\n",
         AwsChunkSigner::Status::Malformed},
        {";chunk-signature=" + std::string(kDummySig) + "\r\n",
         AwsChunkSigner::Status::Malformed},
        {"3;chunk-signature=" + std::string(kDummySig) + "\r\naaaa\r\n",
         AwsChunkSigner::Status::Malformed},  // data longer than its size
        {std::string(200, '1'), AwsChunkSigner::Status::Malformed},  // no end of line
        {"10001;chunk-signature=" + std::string(kDummySig) + "\r\n",
         AwsChunkSigner::Status::TooLarge},  // over max_chunk, refused before its data
        {"ffffffffffffffffff;chunk-signature=" + std::string(kDummySig) + "\r\n",
         AwsChunkSigner::Status::Malformed},  // more than 16 hex digits
        {aws_chunk(0, kDummySig) + "x", AwsChunkSigner::Status::Malformed},  // after the last
        // under S3's 8 KiB minimum, and not the last chunk with data
        {aws_chunk(100, kDummySig) + aws_chunk(100, kDummySig), AwsChunkSigner::Status::Malformed},
    };
    for (const auto& [body, want] : cases) {
        AwsChunkSigner signer = c.signer();
        EXPECT_EQ(signer.feed(body, 65536), want) << body.substr(0, 40);
        EXPECT_FALSE(signer.complete()) << body.substr(0, 40);
    }
    // A small chunk as the last with data is S3's own case.
    {
        AwsChunkSigner signer = c.signer();
        EXPECT_EQ(signer.feed(aws_chunk(8192, kDummySig) + aws_chunk(1, kDummySig) +
                                  aws_chunk(0, kDummySig),
                              65536),
                  AwsChunkSigner::Status::Ok);
        EXPECT_TRUE(signer.complete());
    }
    // A body that stops inside a chunk is not complete (the exchange refuses it then).
    AwsChunkSigner signer = c.signer();
    EXPECT_EQ(signer.feed(good.substr(0, good.size() - 1), 65536), AwsChunkSigner::Status::Ok);
    EXPECT_EQ(signer.output().size(), 0u);  // nothing goes on before its signature is made
    EXPECT_FALSE(signer.complete());
}

TEST(AwsSigV4Pipeline, SignsAChunkSignedUploadAndItsChunks) {
    PipelineCase c("s3");
    RequestHead h = head("PUT", "aws.test", "/bkt/key",
                         {{"x-amz-content-sha256", "STREAMING-AWS4-HMAC-SHA256-PAYLOAD"},
                          {"content-encoding", "aws-chunked"},
                          {"x-amz-decoded-content-length", "3"}});
    Decision d = RequestPipeline().run(h, c.ctx);
    ASSERT_TRUE(d.forward()) << d.reason;
    ASSERT_NE(d.aws_chunks, nullptr);
    EXPECT_FALSE(d.sign_body);
    EXPECT_EQ(*h.find("x-amz-content-sha256"), "STREAMING-AWS4-HMAC-SHA256-PAYLOAD");
    // The first chunk chains from the request's own signature.
    const std::string seed = signature_of(h);
    ASSERT_EQ(d.aws_chunks->feed(aws_chunk(3, kDummySig), 1024), AwsChunkSigner::Status::Ok);
    const std::string first(d.aws_chunks->output().data(), d.aws_chunks->output().size());
    AwsChunkSigner again(c.run.pins[0].injection->aws, c.run.pins[0].inject,
                         {"20261206T120000Z", "20261206/us-east-1/s3/aws4_request", seed});
    ASSERT_EQ(again.feed(aws_chunk(3, kDummySig), 1024), AwsChunkSigner::Status::Ok);
    EXPECT_EQ(first, std::string(again.output().data(), again.output().size()));
    EXPECT_EQ(first.find(kDummySig), std::string::npos);
}

TEST(AwsSigV4Pipeline, RefusesOtherChunkSigningAndPresignedQueries) {
    PipelineCase c("s3");
    RequestHead chunked =
        head("PUT", "aws.test", "/bkt/key",
             {{"x-amz-content-sha256", "STREAMING-AWS4-HMAC-SHA256-PAYLOAD-TRAILER"}});
    Decision d = RequestPipeline().run(chunked, c.ctx);
    EXPECT_EQ(d.status, 400);
    EXPECT_EQ(d.reason, "aws_chunk_signing");
    RequestHead presigned = head("GET", "aws.test", "/bkt/key?X-Amz-Credential=x");
    d = RequestPipeline().run(presigned, c.ctx);
    EXPECT_EQ(d.status, 400);
    EXPECT_EQ(d.reason, "aws_presigned_query");
}

}  // namespace
}  // namespace egress::policy
