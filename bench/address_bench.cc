// Micro-benchmarks of host normalisation, authority parsing, host-pattern matching, and
// address classification / vetting of resolved addresses.
#include <benchmark/benchmark.h>

#include <array>
#include <string_view>
#include <vector>

#include "policy/address.h"
#include "policy/host.h"

namespace egress::policy {
namespace {

struct Case {
    const char* label;
    std::string_view text;
};

constexpr std::array kHosts = {
    Case{"dns", "api.github.com"},
    Case{"dns_upper_dot", "API.GitHub.COM."},
    Case{"dns_long", "a-very-long-label-name.with.many.labels.s3.eu-west-1.amazonaws.com"},
    Case{"ipv4", "140.82.112.6"},
    Case{"ipv6_bracket", "[2001:db8:85a3::8a2e:370:7334]"},
    Case{"refused_numeric", "0x7f.1"},
};

void BM_NormalizeHost(benchmark::State& state) {
    const Case& c = kHosts.at(static_cast<size_t>(state.range(0)));
    state.SetLabel(c.label);
    for (auto _ : state) {
        Result<std::string> r = normalize_host(c.text);
        benchmark::DoNotOptimize(r);
    }
}
BENCHMARK(BM_NormalizeHost)->DenseRange(0, static_cast<int64_t>(kHosts.size()) - 1);

constexpr std::array kAuthorities = {
    Case{"host", "api.github.com"},
    Case{"host_port", "api.github.com:443"},
    Case{"ipv4_port", "140.82.112.6:8443"},
    Case{"ipv6_port", "[2001:db8::1]:443"},
    Case{"refused_userinfo", "user@api.github.com:443"},
};

void BM_ParseAuthority(benchmark::State& state) {
    const Case& c = kAuthorities.at(static_cast<size_t>(state.range(0)));
    state.SetLabel(c.label);
    for (auto _ : state) {
        Result<HostPort> r = parse_authority(c.text, 443);
        benchmark::DoNotOptimize(r);
    }
}
BENCHMARK(BM_ParseAuthority)->DenseRange(0, static_cast<int64_t>(kAuthorities.size()) - 1);

// Arg 0: exact pattern; 1: wildcard pattern.
void BM_HostPatternMatch(benchmark::State& state) {
    const bool wildcard = state.range(0) != 0;
    const HostPattern p = *HostPattern::parse(wildcard ? "*.s3.amazonaws.com" : "api.github.com");
    const HostPort hp{wildcard ? "bucket.s3.amazonaws.com" : "api.github.com", 443};
    state.SetLabel(wildcard ? "wildcard" : "exact");
    for (auto _ : state) benchmark::DoNotOptimize(p.matches(hp));
}
BENCHMARK(BM_HostPatternMatch)->Arg(0)->Arg(1);

constexpr std::array kAddresses = {
    Case{"ipv4_public", "140.82.112.6"},
    Case{"ipv4_private", "10.1.2.3"},
    Case{"ipv4_metadata", "169.254.169.254"},
    Case{"ipv6_public", "2606:4700:4700::1111"},
    Case{"ipv6_ula", "fd12:3456:789a::1"},
    Case{"ipv4_mapped", "::ffff:127.0.0.1"},
    Case{"nat64", "64:ff9b::a00:1"},
    Case{"teredo", "2001:0:4136:e378:8000:63bf:3fff:fdd2"},
};

void BM_IpParse(benchmark::State& state) {
    const Case& c = kAddresses.at(static_cast<size_t>(state.range(0)));
    state.SetLabel(c.label);
    for (auto _ : state) benchmark::DoNotOptimize(IpAddress::parse(c.text));
}
BENCHMARK(BM_IpParse)->DenseRange(0, static_cast<int64_t>(kAddresses.size()) - 1);

void BM_Classify(benchmark::State& state) {
    const Case& c = kAddresses.at(static_cast<size_t>(state.range(0)));
    const IpAddress ip = *IpAddress::parse(c.text);
    state.SetLabel(std::string(c.label) + ":" + std::string(to_string(classify(ip))));
    for (auto _ : state) {
        benchmark::DoNotOptimize(ip);
        benchmark::DoNotOptimize(classify(ip));
    }
}
BENCHMARK(BM_Classify)->DenseRange(0, static_cast<int64_t>(kAddresses.size()) - 1);

// AddressPolicy::vet with a few named exceptions (as a test deployment configures them).
void BM_AddressVet(benchmark::State& state) {
    const Case& c = kAddresses.at(static_cast<size_t>(state.range(0)));
    const IpAddress ip = *IpAddress::parse(c.text);
    std::vector<Cidr> allow;
    for (const char* n : {"127.0.0.1/32", "10.42.0.0/16", "fd00:1234::/32", "192.168.1.10"})
        allow.push_back(*Cidr::parse(n));
    const AddressPolicy policy(std::move(allow));
    const AddressVerdict v = policy.vet(ip);
    state.SetLabel(std::string(c.label) + (v.allowed ? ":allowed" : ":" + v.reason));
    for (auto _ : state) {
        AddressVerdict verdict = policy.vet(ip);
        benchmark::DoNotOptimize(verdict);
    }
}
BENCHMARK(BM_AddressVet)->DenseRange(0, static_cast<int64_t>(kAddresses.size()) - 1);

}  // namespace
}  // namespace egress::policy
