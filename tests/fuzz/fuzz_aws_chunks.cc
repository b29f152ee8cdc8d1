// Fuzz target: a chunk-signed upload's aws-chunked body signed again (policy::AwsChunkSigner),
// the parser a hostile sandbox feeds every byte of such a body.
//
// Input: one byte choosing max_chunk (2^(b % 18) bytes), one choosing how the body is cut into
// pieces, then the body.
// Invariants checked beyond "no sanitizer report":
//   * fed whole and fed in pieces, the signer ends in the same state (Ok and complete, Ok and
//     waiting, Malformed, TooLarge) and, when Ok, gives on the same bytes;
//   * what it gives on is never more than it took, and a complete body comes out as long as it
//     went in, equal to it byte for byte except in the 64 hex digits of each chunk's
//     signature (found by a parser of this file's own), which are new lowercase hex;
//   * once a feed failed, later feeds fail the same way and give on nothing.
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_common.h"
#include "policy/aws_sigv4.h"

using egress::policy::AwsChunkSigner;
using egress::policy::AwsCredentials;
using egress::policy::InjectSpec;
using egress::policy::InjectType;

namespace {

struct Fixture {
    InjectSpec spec;
    std::shared_ptr<AwsCredentials> creds;
    Fixture() {
        spec.type = InjectType::AwsSigV4;
        spec.access_key_id = "AKIAIOSFODNN7EXAMPLE";
        spec.region = "us-east-1";
        spec.service = "s3";
        auto c = egress::policy::aws_credentials(spec, "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY");
        FUZZ_CHECK(c, "the fixture's credentials");
        creds = *c;
    }
    AwsChunkSigner signer() const {
        return AwsChunkSigner(creds, spec,
                              {"20130524T000000Z", "20130524/us-east-1/s3/aws4_request",
                               std::string(64, '4')});
    }
};

struct Run {
    AwsChunkSigner::Status status = AwsChunkSigner::Status::Ok;
    bool complete = false;
    std::string out;
};

/// Feeds `body` cut after every byte whose value has the `cut` bits clear (all of it at once
/// when cut is 0xff... and no byte matches), stopping at the first failure.
Run feed(const Fixture& f, std::string_view body, size_t max_chunk, uint8_t cut) {
    AwsChunkSigner signer = f.signer();
    Run r;
    size_t prev = 0;
    auto step = [&](size_t end) {
        r.status = signer.feed(body.substr(prev, end - prev), max_chunk);
        if (r.status == AwsChunkSigner::Status::Ok) {
            r.out.append(signer.output().data(), signer.output().size());
        }
        FUZZ_CHECK(r.out.size() <= end, "gave on more than it took");
        prev = end;
    };
    for (size_t i = 0; i < body.size() && r.status == AwsChunkSigner::Status::Ok; ++i) {
        if (cut != 0 && (static_cast<uint8_t>(body[i]) & cut) == 0) {
            step(i + 1);
        }
    }
    if (r.status == AwsChunkSigner::Status::Ok && prev < body.size()) {
        step(body.size());
    }
    if (r.status != AwsChunkSigner::Status::Ok) {
        // A failed signer takes nothing more (the exchange has refused the request by then).
        FUZZ_CHECK(signer.feed("0;", max_chunk) == r.status && signer.output().empty(),
                   "a failed signer went on");
    }
    r.complete = signer.complete();
    return r;
}

bool hex_digit(char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); }

/// The offsets of each chunk signature's 64 digits in a body the signer took whole (this
/// file's own reading of "hex;chunk-signature=SIG\r\nDATA\r\n").
std::vector<size_t> signature_offsets(std::string_view body) {
    static constexpr std::string_view kExt = ";chunk-signature=";
    std::vector<size_t> at;
    size_t pos = 0;
    while (pos < body.size()) {
        const size_t semi = body.find(';', pos);
        FUZZ_CHECK(semi != std::string_view::npos, "a complete body without a chunk header");
        uint64_t size = std::stoull(std::string(body.substr(pos, semi - pos)), nullptr, 16);
        FUZZ_CHECK(body.substr(semi, kExt.size()) == kExt, "a header without its signature");
        at.push_back(semi + kExt.size());
        pos = semi + kExt.size() + 64 + 2 + size + 2;
    }
    return at;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    static const Fixture f;
    if (size < 2 || size > 1 << 18) {
        return 0;
    }
    const size_t max_chunk = size_t{1} << (data[0] % 18);
    const uint8_t cut = data[1];
    std::string_view body(reinterpret_cast<const char*>(data) + 2, size - 2);

    const Run whole = feed(f, body, max_chunk, 0);
    const Run pieces = feed(f, body, max_chunk, cut);
    FUZZ_CHECK(whole.status == pieces.status, "whole and in pieces end differently");
    if (whole.status != AwsChunkSigner::Status::Ok) {
        return 0;
    }
    FUZZ_CHECK(whole.complete == pieces.complete, "only one of them is complete");
    FUZZ_CHECK(whole.out == pieces.out, "whole and in pieces give on other bytes");
    if (!whole.complete) {
        return 0;
    }
    FUZZ_CHECK(whole.out.size() == body.size(), "a complete body changed length");
    std::vector<bool> sig(body.size(), false);
    for (size_t at : signature_offsets(body)) {
        for (size_t i = at; i < at + 64; ++i) {
            sig[i] = true;
            FUZZ_CHECK(hex_digit(whole.out[i]), "a new signature that is not lowercase hex");
        }
    }
    for (size_t i = 0; i < body.size(); ++i) {
        FUZZ_CHECK(sig[i] || whole.out[i] == body[i], "a byte outside a signature changed");
    }
    return 0;
}
