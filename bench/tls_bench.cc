// Micro-benchmarks of the run CA: creation (CA key + self-signed cert + shared leaf key),
// leaf mint (one ECDSA signature), and the per-run LeafCache hit and miss paths.
// Issue 5 targets: run creation < 2 ms, leaf mint < 1 ms, steady-state hit ratio > 99%.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tls/contexts.h"
#include "tls/leaf_cache.h"
#include "tls/run_ca.h"

namespace egress::tls {
namespace {

/// prefix + decimal i + suffix (appends, avoiding GCC 12's -Wrestrict false positive on
/// "literal" + std::string&&).
std::string numbered(std::string_view prefix, int64_t i, std::string_view suffix = {}) {
    std::string s(prefix);
    s += std::to_string(i);
    s += suffix;
    return s;
}

std::unique_ptr<RunCa> must_ca(const std::vector<std::string>& permitted = {}) {
    auto ca = RunCa::create("bench", std::chrono::hours(8), permitted);
    if (!ca.ok()) std::abort();
    return std::move(ca).value();
}

// Arg: number of name constraints (0 = none).
void BM_RunCaCreate(benchmark::State& state) {
    std::vector<std::string> permitted;
    for (int64_t i = 0; i < state.range(0); ++i)
        permitted.push_back(numbered("api", i, ".example.com"));
    for (auto _ : state) {
        auto ca = RunCa::create("bench", std::chrono::hours(8), permitted);
        if (!ca.ok()) state.SkipWithError(ca.error().c_str());
        benchmark::DoNotOptimize(ca);
    }
    state.counters["runs/s"] = benchmark::Counter(static_cast<double>(state.iterations()),
                                                  benchmark::Counter::kIsRate);
}
BENCHMARK(BM_RunCaCreate)->ArgName("constraints")->Arg(0)->Arg(4)->Unit(benchmark::kMicrosecond);

// Arg 0: DNS name; 1: IP literal.
void BM_LeafMint(benchmark::State& state) {
    const auto ca = must_ca();
    const std::string host = state.range(0) != 0 ? "140.82.112.6" : "api.github.com";
    state.SetLabel(state.range(0) != 0 ? "ip" : "dns");
    for (auto _ : state) {
        auto leaf = ca->mint(host);
        if (!leaf.ok()) state.SkipWithError(leaf.error().c_str());
        benchmark::DoNotOptimize(leaf);
    }
    state.counters["mints/s"] = benchmark::Counter(static_cast<double>(state.iterations()),
                                                   benchmark::Counter::kIsRate);
}
BENCHMARK(BM_LeafMint)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);

// A name-constrained CA (4 names). Arg 0: a leaf for a permitted name (checked, then signed);
// 1: a refusal of a name outside them (outside_run_ca: checked, nothing signed).
void BM_LeafMintConstrained(benchmark::State& state) {
    std::vector<std::string> permitted;
    for (int64_t i = 0; i < 4; ++i) permitted.push_back(numbered("api", i, ".example.com"));
    const auto ca = must_ca(permitted);
    const bool outside = state.range(0) != 0;
    state.SetLabel(outside ? "refused" : "minted");
    const std::string host = outside ? "h1.elsewhere.test" : "api1.example.com";
    for (auto _ : state) {
        auto leaf = ca->mint(host);
        if (leaf.ok() == outside) state.SkipWithError("unexpected mint outcome");
        benchmark::DoNotOptimize(leaf);
    }
}
BENCHMARK(BM_LeafMintConstrained)->ArgName("outside")->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);

// Steady state: requests cycle over `hosts` hosts of one run (capacity 1024). The CA and the
// cache live across the benchmark's runs, and every run first warms the cache with each host
// once (untimed), so hits/misses/hit_ratio count only the timed, steady-state requests.
void BM_LeafCacheHit(benchmark::State& state) {
    static const auto ca = must_ca();
    static LeafCache cache(*ca, 1024);
    std::vector<std::string> hosts;
    for (int64_t i = 0; i < state.range(0); ++i) hosts.push_back(numbered("h", i, ".example.com"));
    for (const std::string& h : hosts)
        if (!cache.get(h).ok()) std::abort();
    const uint64_t hits0 = cache.hits();
    const uint64_t misses0 = cache.misses();
    size_t next = 0;
    for (auto _ : state) {
        auto leaf = cache.get(hosts[next]);
        if (!leaf.ok()) state.SkipWithError(leaf.error().c_str());
        benchmark::DoNotOptimize(leaf);
        if (++next == hosts.size()) next = 0;
    }
    const double hits = static_cast<double>(cache.hits() - hits0);
    const double misses = static_cast<double>(cache.misses() - misses0);
    state.counters["hits"] = hits;
    state.counters["misses"] = misses;
    state.counters["hit_ratio"] = hits / (hits + misses);
}
BENCHMARK(BM_LeafCacheHit)->ArgName("hosts")->Arg(1)->Arg(64)->Arg(1000);

// Miss path: capacity 1, two alternating hosts, so every get() evicts and mints.
void BM_LeafCacheMiss(benchmark::State& state) {
    const auto ca = must_ca();
    LeafCache cache(*ca, 1);
    const std::string hosts[2] = {"a.example.com", "b.example.com"};
    size_t next = 0;
    for (auto _ : state) {
        auto leaf = cache.get(hosts[next]);
        if (!leaf.ok()) state.SkipWithError(leaf.error().c_str());
        benchmark::DoNotOptimize(leaf);
        next ^= 1U;
    }
    state.counters["hits"] = static_cast<double>(cache.hits());
    state.counters["misses"] = static_cast<double>(cache.misses());
}
BENCHMARK(BM_LeafCacheMiss)->Unit(benchmark::kMicrosecond);

// Per intercepted connection before the handshake: SSL_new from the server context and the
// cached leaf installed on it (use_leaf). Arg 1 installs the leaf, 0 is SSL_new/SSL_free only.
void BM_ServerSslWithLeaf(benchmark::State& state) {
    const auto ca = must_ca();
    auto leaf = ca->mint("api.github.com");
    auto ctx = make_server_context({"h2", "http/1.1"});
    if (!leaf.ok() || !ctx.ok()) std::abort();
    const bool install = state.range(0) != 0;
    for (auto _ : state) {
        SSL* ssl = SSL_new(ctx->get());
        if (install && !use_leaf(ssl, **leaf).ok()) state.SkipWithError("use_leaf failed");
        SSL_free(ssl);
    }
}
BENCHMARK(BM_ServerSslWithLeaf)->ArgName("leaf")->Arg(0)->Arg(1);

}  // namespace
}  // namespace egress::tls
