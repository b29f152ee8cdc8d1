// Micro-benchmarks of destination policy and pin matching with many pins: decide_destination
// (CONNECT time) and match_pin (per request), hitting the last pin and missing, with exact
// and wildcard host patterns.
#include <benchmark/benchmark.h>

#include <memory>
#include <string>
#include <string_view>

#include "credstore/secret.h"
#include "policy/run_policy.h"

namespace egress::policy {
namespace {

/// prefix + decimal i + suffix (appends, avoiding GCC 12's -Wrestrict false positive on
/// "literal" + std::string&&).
std::string numbered(std::string_view prefix, int64_t i, std::string_view suffix = {}) {
    std::string s(prefix);
    s += std::to_string(i);
    s += suffix;
    return s;
}

const TimePoint kNow = TimePoint{} + std::chrono::hours(1000);

HostPattern must_pattern(const std::string& text) {
    Result<HostPattern> p = HostPattern::parse(text);
    if (!p.ok()) std::abort();
    return *p;
}

/// A run with n pins: exact "api<i>.svc.example.com", or wildcard "*.t<i>.example.com".
/// Every pin has a path prefix and a method list, so match_pin does its full check.
RunPolicy make_run(int64_t n, bool wildcard) {
    RunPolicy run;
    run.id = "run-bench";
    run.expires_at = kNow + std::chrono::minutes(30);
    const auto secret = std::make_shared<const credstore::SecretValue>("s3cr3t-token-value");
    run.pins.reserve(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
        Pin pin;
        pin.id = numbered("pin", i);
        pin.host = must_pattern(wildcard ? numbered("*.t", i, ".example.com")
                                         : numbered("api", i, ".svc.example.com"));
        pin.path_prefixes = {"/v1/"};
        pin.methods = {"GET", "POST"};
        pin.secret_name = "token";
        pin.secret = secret;
        run.pins.push_back(std::move(pin));
    }
    index_pins(run);  // as the runtime does for every run it loads
    return run;
}

HostPort last_host(int64_t n, bool wildcard) {
    const std::string i = std::to_string(n - 1);
    return HostPort{wildcard ? "bucket.t" + i + ".example.com" : "api" + i + ".svc.example.com",
                    443};
}

const HostPort kMiss{"nomatch.example.org", 443};

void set_rate(benchmark::State& state) {
    state.counters["lookups/s"] = benchmark::Counter(static_cast<double>(state.iterations()),
                                                     benchmark::Counter::kIsRate);
}

// Args: {pins, wildcard}.
void BM_DecideDestinationLastPin(benchmark::State& state) {
    const bool wildcard = state.range(1) != 0;
    const RunPolicy run = make_run(state.range(0), wildcard);
    const GlobalPolicy global;
    const HostPort dest = last_host(state.range(0), wildcard);
    for (auto _ : state) {
        DestinationDecision d = decide_destination(global, run, dest, kNow);
        if (d.carry != Carry::Intercept) state.SkipWithError("expected intercept");
        benchmark::DoNotOptimize(d);
    }
    set_rate(state);
}

void BM_DecideDestinationMiss(benchmark::State& state) {
    const RunPolicy run = make_run(state.range(0), state.range(1) != 0);
    GlobalPolicy global;
    global.allow_hosts = {must_pattern("pypi.org")};
    for (auto _ : state) {
        DestinationDecision d = decide_destination(global, run, kMiss, kNow);
        if (d.carry != Carry::Deny) state.SkipWithError("expected deny");
        benchmark::DoNotOptimize(d);
    }
    set_rate(state);
}

void BM_MatchPinLastPin(benchmark::State& state) {
    const bool wildcard = state.range(1) != 0;
    const RunPolicy run = make_run(state.range(0), wildcard);
    const GlobalPolicy global;
    const HostPort dest = last_host(state.range(0), wildcard);
    for (auto _ : state) {
        const Pin* pin = match_pin(global, run, dest, "GET", "/v1/items/42?x=1", kNow);
        if (pin != &run.pins.back()) state.SkipWithError("expected the last pin");
        benchmark::DoNotOptimize(pin);
    }
    set_rate(state);
}

void BM_MatchPinMiss(benchmark::State& state) {
    const RunPolicy run = make_run(state.range(0), state.range(1) != 0);
    const GlobalPolicy global;
    for (auto _ : state) {
        const Pin* pin = match_pin(global, run, kMiss, "GET", "/v1/items/42", kNow);
        if (pin != nullptr) state.SkipWithError("expected no pin");
        benchmark::DoNotOptimize(pin);
    }
    set_rate(state);
}

void pin_sweep(benchmark::internal::Benchmark* b) {
    b->ArgNames({"pins", "wildcard"});
    for (int64_t wildcard : {0, 1})
        for (int64_t n : {10, 100, 1000, 10000}) b->Args({n, wildcard});
}

BENCHMARK(BM_DecideDestinationLastPin)->Apply(pin_sweep);
BENCHMARK(BM_DecideDestinationMiss)->Apply(pin_sweep);
BENCHMARK(BM_MatchPinLastPin)->Apply(pin_sweep);
BENCHMARK(BM_MatchPinMiss)->Apply(pin_sweep);

}  // namespace
}  // namespace egress::policy
