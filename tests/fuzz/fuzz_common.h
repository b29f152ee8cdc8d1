#pragma once
// Shared by the fuzz targets: a fixed run policy with every injection type, and the
// invariants a forwarded request head must hold whatever the sandbox sent. A broken invariant
// aborts with a message, so libFuzzer records it as a crash like a sanitizer report.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "policy/header_rules.h"
#include "policy/pipeline.h"

namespace egress::fuzz {

/// Aborts with `what` when `cond` is false (an invariant of OUR code, not of the input).
#define FUZZ_CHECK(cond, what)                                                             \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            std::fprintf(stderr, "FUZZ_CHECK failed at %s:%d: %s: %s\n", __FILE__, __LINE__, \
                         #cond, std::string(what).c_str());                                \
            std::abort();                                                                  \
        }                                                                                  \
    } while (0)

inline constexpr std::string_view kSecret = "ghp_FUZZs3cr3t";

inline policy::HostPattern pattern(std::string_view text) {
    auto p = policy::HostPattern::parse(text);
    FUZZ_CHECK(p.ok(), text);
    return *p;
}

/// The policy every request is judged against (like tests/policy/pipeline_test.cc).
struct Fixture {
    policy::GlobalPolicy global;
    policy::RunPolicy run;
    policy::TimePoint now = policy::TimePoint{} + std::chrono::hours(1000);

    Fixture() {
        using policy::InjectSpec;
        using policy::InjectType;
        global.allow_hosts = {pattern("pypi.org"), pattern("mixed.test"), pattern("*.open.test")};
        global.allowed_ports = {443, 80};
        global.unpinned = policy::Unpinned::Intercept;
        run.id = "fuzz";
        run.expires_at = now + std::chrono::minutes(30);
        auto pin = [&](std::string id, std::string_view host, InjectSpec spec,
                       std::vector<std::string> prefixes, std::vector<std::string> methods) {
            policy::Pin p;
            p.id = std::move(id);
            p.host = pattern(host);
            p.path_prefixes = std::move(prefixes);
            p.methods = std::move(methods);
            p.secret_name = "fuzz_token";
            p.inject = spec;
            p.secret = std::make_shared<const credstore::SecretValue>(kSecret);
            policy::prepare_injection(p);
            run.pins.push_back(std::move(p));
        };
        InjectSpec basic;
        basic.type = InjectType::Basic;
        basic.username = "x-access-token";
        InjectSpec header;
        header.type = InjectType::Header;
        header.header_name = "x-api-key";
        header.value_template = "k={secret}";
        pin("bearer", "api.github.com", InjectSpec{}, {"/repos/acme/"}, {});
        pin("basic", "git.test", basic, {}, {"GET", "POST"});
        pin("hdr", "*.key.test", header, {}, {});
        pin("mixed", "mixed.test", InjectSpec{}, {"/private/"}, {});
        pin("port", "api.port.test:8443", InjectSpec{}, {}, {});
        InjectSpec aws;
        aws.type = InjectType::AwsSigV4;
        aws.access_key_id = "AKIAFUZZEXAMPLE00001";
        aws.region = "us-east-1";
        aws.service = "s3";
        pin("aws", "aws.test", aws, {}, {});
        aws.service = "dynamodb";  // signs the body's hash: left to the caller (sign_body)
        pin("aws-body", "ddb.aws.test", aws, {}, {});
        run.pins[2].extra_headers = {{"x-extra", "1"}};
        policy::index_pins(run);
    }
};

inline const Fixture& fixture() {
    static const Fixture f;
    return f;
}

/// Resolves "%XX", "\" and dot segments the way a lenient upstream might; the result must
/// still lie under a pin's prefix when the pipeline matched that pin.
inline std::string lenient_normalize(std::string_view path) {
    std::string decoded;
    for (size_t i = 0; i < path.size(); ++i) {
        auto hex = [](char c) -> int {
            if (c >= '0' && c <= '9') return c - '0';
            if (c >= 'a' && c <= 'f') return c - 'a' + 10;
            if (c >= 'A' && c <= 'F') return c - 'A' + 10;
            return -1;
        };
        if (path[i] == '%' && i + 2 < path.size() && hex(path[i + 1]) >= 0 &&
            hex(path[i + 2]) >= 0) {
            decoded += static_cast<char>(hex(path[i + 1]) * 16 + hex(path[i + 2]));
            i += 2;
        } else {
            decoded += path[i] == '\\' ? '/' : path[i];
        }
    }
    std::vector<std::string> out;
    size_t start = 1;
    while (start <= decoded.size()) {
        size_t end = decoded.find('/', start);
        if (end == std::string::npos) {
            end = decoded.size();
        }
        std::string seg = decoded.substr(start, end - start);
        seg = seg.substr(0, seg.find(';'));
        if (seg == "..") {
            if (!out.empty()) {
                out.pop_back();
            }
        } else if (seg != ".") {
            out.push_back(decoded.substr(start, end - start));
        }
        start = end + 1;
    }
    std::string norm;
    for (const auto& s : out) {
        norm += "/" + s;
    }
    if (!decoded.empty() && decoded.back() == '/' && (norm.empty() || norm.back() != '/')) {
        norm += "/";
    }
    return norm.empty() ? "/" : norm;
}

/// What must hold for every head the pipeline lets through. `sent` is the header list the
/// client sent (after codec conversion, before the pipeline).
inline void check_forwarded(const policy::RequestHead& head, const policy::Decision& d,
                            const policy::RequestContext& ctx,
                            const std::vector<policy::Header>& sent) {
    using namespace policy;
    if (!d.forward()) {
        FUZZ_CHECK(d.status >= 400 && d.status < 600 && !d.reason.empty(), d.reason);
        FUZZ_CHECK(d.pin == nullptr && d.scrub == nullptr, "a refusal carries a credential");
        return;
    }
    // Host agreement: the authority names the connection's destination.
    const uint16_t dflt = iequals(head.scheme, "https") ? 443 : iequals(head.scheme, "http") ? 80
                          : ctx.tls                      ? 443
                                                         : 80;
    auto hp = parse_authority(head.authority, dflt);
    FUZZ_CHECK(hp.ok() && *hp == ctx.target, "forwarded authority " + head.authority +
                                                 " is not the target " + ctx.target.authority());
    for (const Header& h : head.headers) {
        FUZZ_CHECK(valid_header_name(h.name), "invalid header name forwarded: " + h.name);
        FUZZ_CHECK(valid_header_value(h.value), "invalid header value forwarded in " + h.name);
        FUZZ_CHECK(!is_egress_namespace(h.name), "x-egress-* forwarded: " + h.name);
        FUZZ_CHECK(!iequals(h.name, "host"), "host header forwarded beside the authority");
        const bool te_trailers = ctx.upstream_h2 && iequals(h.name, "te");
        FUZZ_CHECK(!is_hop_by_hop(h.name) || te_trailers, "hop-by-hop forwarded: " + h.name);
    }
    if (!ctx.tls) {
        // Over cleartext the pipeline only removes: every forwarded header was sent.
        FUZZ_CHECK(d.pin == nullptr && d.scrub == nullptr, "credential over cleartext");
        for (const Header& h : head.headers) {
            bool found = false;
            for (const Header& s : sent) {
                found = found || (iequals(s.name, h.name) && s.value == h.value);
            }
            FUZZ_CHECK(found, "cleartext request gained a header: " + h.name);
        }
        return;
    }
    if (d.pin != nullptr) {
        const Pin& pin = *d.pin;
        FUZZ_CHECK(pin.host.matches(ctx.target), "injected for a pin of another host");
        if (pin.inject.type == InjectType::AwsSigV4) {
            // Signed (or, for a body's hash, not yet): never the sandbox's own signature.
            const size_t n = head.count("authorization");
            FUZZ_CHECK(n == (d.sign_body ? 0u : 1u), "aws-sigv4: authorization count");
            if (n == 1) {
                const std::string& v = *head.find("authorization");
                FUZZ_CHECK(v.starts_with("AWS4-HMAC-SHA256 Credential=" + pin.inject.access_key_id +
                                         "/"),
                           "aws-sigv4: not our signature");
                FUZZ_CHECK(v.find(kSecret) == std::string::npos, "aws-sigv4: secret in header");
            }
            FUZZ_CHECK(head.count("x-amz-security-token") == 0, "aws-sigv4: sandbox's session");
        } else {
            const std::string value = injected_header_value(pin.inject, kSecret);
            FUZZ_CHECK(head.count(d.injected_header) == 1, "credential header not exactly once");
            FUZZ_CHECK(*head.find(d.injected_header) == value, "credential header replaced/merged");
        }
        if (!pin.methods.empty()) {
            bool ok = false;
            for (const auto& m : pin.methods) {
                ok = ok || m == head.method;
            }
            FUZZ_CHECK(ok, "pin injected for a method it does not allow: " + head.method);
        }
        if (!pin.path_prefixes.empty()) {
            const std::string_view p = head.path_only();
            const std::string norm = lenient_normalize(p);
            bool raw_ok = false;
            bool norm_ok = false;
            for (const auto& prefix : pin.path_prefixes) {
                raw_ok = raw_ok || p.starts_with(prefix);
                norm_ok = norm_ok || std::string_view(norm).starts_with(prefix);
            }
            FUZZ_CHECK(raw_ok, "pin injected outside its prefix: " + std::string(p));
            FUZZ_CHECK(norm_ok, "path escapes the pin prefix once normalized: " + std::string(p) +
                                    " -> " + norm);
        }
    } else {
        // No credential: the secret never appears in a header the client did not send.
        for (const Header& h : head.headers) {
            if (h.value.find(kSecret) == std::string::npos) {
                continue;
            }
            bool sent_it = false;
            for (const Header& s : sent) {
                sent_it = sent_it || s.value == h.value;
            }
            FUZZ_CHECK(sent_it, "secret in a forwarded header without a pin: " + h.name);
        }
    }
}

}  // namespace egress::fuzz
