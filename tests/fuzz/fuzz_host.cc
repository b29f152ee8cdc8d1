// Fuzz target: host normalisation, authorities and host patterns (policy/host.h), and pin
// lookup through the pin index (policy/run_policy.h).
//
// Input: "HOST_OR_AUTHORITY\nPATTERN" (without a newline, the whole input plays both parts).
// Invariants checked beyond "no sanitizer report":
//   * normalize_host is idempotent and its output is a plain LDH name, a canonical dotted
//     quad, or a canonical IPv6 literal; no numeric form that inet_aton reads differently
//     ("127.1", "0x7f.0.0.1", "2130706433", "0177.0.0.1") survives normalisation;
//   * parse_authority round-trips through HostPort::authority();
//   * spells_target never says yes where parse_authority gives another target (the request
//     path skips the parse on its yes);
//   * HostPattern::parse round-trips through text(), and matches() agrees with an
//     independent reading of the documented rule (exact, or exactly one extra label);
//   * match_pin and decide_destination give the same answer with and without the pin index.
#include <arpa/inet.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "fuzz_common.h"
#include "policy/address.h"
#include "policy/host.h"
#include "policy/run_policy.h"

namespace {

using namespace egress;
using egress::fuzz::fixture;

void check_normalized(std::string_view input, const std::string& n) {
    auto again = policy::normalize_host(n);
    FUZZ_CHECK(again.ok() && *again == n, "normalize_host is not idempotent: " + n);
    FUZZ_CHECK(!n.empty(), "empty normalized host");
    FUZZ_CHECK(input.find('@') == std::string_view::npos, "userinfo accepted");
    FUZZ_CHECK(input.find('%') == std::string_view::npos, "percent escape accepted");
    for (char c : input) {
        FUZZ_CHECK(static_cast<unsigned char>(c) < 0x80, "non-ASCII accepted");
    }
    if (n.find(':') != std::string::npos) {
        auto ip = policy::IpAddress::parse(n);
        FUZZ_CHECK(ip && !ip->is_v4() && ip->to_string() == n, "non-canonical IPv6 host: " + n);
        return;
    }
    FUZZ_CHECK(n.size() <= 253, "name longer than 253 bytes");
    FUZZ_CHECK(n.front() != '.' && n.back() != '.' && n.find("..") == std::string::npos,
               "empty label in " + n);
    for (char c : n) {
        const bool ok = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' ||
                        c == '_' || c == '.';
        FUZZ_CHECK(ok, "bad byte in normalized host: " + n);
    }
    // No second reading as a number: whatever inet_aton accepts must be the canonical quad.
    in_addr a{};
    if (inet_aton(n.c_str(), &a) != 0) {
        char buf[INET_ADDRSTRLEN] = {};
        inet_ntop(AF_INET, &a, buf, sizeof buf);
        FUZZ_CHECK(n == buf, "ambiguous numeric host " + n + " reads as " + buf);
    }
}

/// The documented matching rule, written independently of HostPattern::matches_host.
bool expected_match(const policy::HostPattern& p, const policy::HostPort& hp) {
    if (p.port() && *p.port() != hp.port) {
        return false;
    }
    if (!p.wildcard()) {
        return hp.host == p.host();
    }
    const std::string suffix = "." + p.host();
    if (hp.host.size() <= suffix.size() || !hp.host.ends_with(suffix)) {
        return false;
    }
    const std::string label = hp.host.substr(0, hp.host.size() - suffix.size());
    return !label.empty() && label.find('.') == std::string::npos;
}

void check_pin_index(const policy::HostPattern& p, const policy::HostPort& hp) {
    const auto& f = fixture();
    policy::RunPolicy run = f.run;
    policy::Pin pin = run.pins.front();
    pin.id = "fuzzed";
    pin.host = p;
    pin.path_prefixes.clear();
    run.pins.insert(run.pins.begin() + 2, pin);
    policy::RunPolicy linear = run;
    linear.pin_index.reset();
    policy::index_pins(run);
    for (std::string_view method : {"GET", "POST"}) {
        const policy::Pin* a =
            policy::match_pin(f.global, run, hp, method, "/repos/acme/x", f.now);
        const policy::Pin* b =
            policy::match_pin(f.global, linear, hp, method, "/repos/acme/x", f.now);
        FUZZ_CHECK((a == nullptr) == (b == nullptr) && (!a || a->id == b->id),
                   "pin index disagrees with the linear scan for " + hp.authority());
    }
    auto da = policy::decide_destination(f.global, run, hp, f.now);
    auto db = policy::decide_destination(f.global, linear, hp, f.now);
    FUZZ_CHECK(da.carry == db.carry && da.reason == db.reason && da.pinned == db.pinned,
               "decide_destination differs with the pin index for " + hp.authority());
    FUZZ_CHECK(policy::host_pinned(f.global, run, hp, f.now) ==
                   policy::host_pinned(f.global, linear, hp, f.now),
               "host_pinned differs with the pin index");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string_view in(reinterpret_cast<const char*>(data), size);
    const size_t nl = in.find('\n');
    const std::string_view host = in.substr(0, nl);
    const std::string_view pat = nl == std::string_view::npos ? in : in.substr(nl + 1);

    if (auto n = policy::normalize_host(host)) {
        check_normalized(host, *n);
    }
    auto hp = policy::parse_authority(host, 443);
    if (hp) {
        FUZZ_CHECK(hp->port != 0, "port 0 accepted");
        auto n = policy::normalize_host(hp->host);
        FUZZ_CHECK(n && *n == hp->host, "parse_authority host is not normalized: " + hp->host);
        auto back = policy::parse_authority(hp->authority(), std::nullopt);
        FUZZ_CHECK(back && *back == *hp, "authority does not round-trip: " + hp->authority());
        if (auto strict = policy::parse_authority(host, std::nullopt)) {
            FUZZ_CHECK(*strict == *hp, "explicit port parsed differently");
        }
    } else {
        FUZZ_CHECK(!policy::parse_authority(host, std::nullopt).ok(),
                   "accepted without a default port but refused with one");
    }

    // The pattern half, read as an authority, is the target to spell (and a few fixed ones).
    for (uint16_t dp : {uint16_t{443}, uint16_t{80}}) {
        auto target = policy::parse_authority(pat, dp);
        for (const policy::HostPort& t :
             {target ? *target : policy::HostPort{"a.test", 443}, policy::HostPort{"a.test", 443},
              policy::HostPort{"127.0.0.1", 8080}}) {
            if (policy::spells_target(host, t, dp)) {
                auto parsed = policy::parse_authority(host, dp);
                FUZZ_CHECK(parsed && *parsed == t,
                           "spells_target said yes but the parse differs: " + t.authority());
            }
        }
    }

    auto p = policy::HostPattern::parse(pat);
    if (!p) {
        return 0;
    }
    auto again = policy::HostPattern::parse(p->text());
    FUZZ_CHECK(again && again->text() == p->text() && again->wildcard() == p->wildcard() &&
                   again->host() == p->host() && again->port() == p->port(),
               "pattern does not round-trip: " + p->text());
    if (p->wildcard()) {
        FUZZ_CHECK(p->host().find('.') != std::string::npos, "wildcard over a single label");
        FUZZ_CHECK(!p->matches_host(p->host()), "wildcard matches its own parent");
    }
    if (hp) {
        FUZZ_CHECK(p->matches(*hp) == expected_match(*p, *hp),
                   "pattern " + p->text() + " vs " + hp->authority());
        check_pin_index(*p, *hp);
    }
    return 0;
}
