// Micro-benchmarks of envelope encryption with a file KeyProvider: seal (fresh DEK, AES-GCM,
// DEK wrap) and unseal (DEK unwrap, decrypt into a locked SecretValue), by secret size.
#include <benchmark/benchmark.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>

#include "credstore/envelope.h"

namespace egress::credstore {
namespace {

/// A KEK file in a fresh temp dir, removed when the benchmark is done.
class TempKek {
public:
    TempKek() {
        std::string tmpl = (std::filesystem::temp_directory_path() / "egress-mb-XXXXXX").string();
        if (mkdtemp(tmpl.data()) == nullptr) std::abort();
        dir_ = tmpl;
        auto kek = open_master_key_file(dir_ + "/master.key", true);
        if (!kek.ok()) std::abort();
        kek_ = std::move(kek).value();
    }
    ~TempKek() {
        std::error_code ec;
        std::filesystem::remove_all(dir_, ec);
    }
    KeyProvider& kek() { return *kek_; }

private:
    std::string dir_;
    std::unique_ptr<KeyProvider> kek_;
};

const Scope kScope{"acme", "web", "", ""};

std::string plaintext(int64_t size) {
    std::string s(static_cast<size_t>(size), 'x');
    for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<char>('a' + i % 26);
    return s;
}

// Arg: secret size in bytes (40 = a GitHub token; 16384 = the maximum).
void BM_SecretSeal(benchmark::State& state) {
    TempKek t;
    const std::string secret = plaintext(state.range(0));
    for (auto _ : state) {
        auto sealed = seal(t.kek(), "github_token", kScope, 1, secret);
        if (!sealed.ok()) state.SkipWithError(sealed.error().c_str());
        benchmark::DoNotOptimize(sealed);
    }
    state.counters["seals/s"] = benchmark::Counter(static_cast<double>(state.iterations()),
                                                   benchmark::Counter::kIsRate);
}
BENCHMARK(BM_SecretSeal)->ArgName("bytes")->Arg(40)->Arg(1024)->Arg(16384);

void BM_SecretUnseal(benchmark::State& state) {
    TempKek t;
    const auto sealed = seal(t.kek(), "github_token", kScope, 1, plaintext(state.range(0)));
    if (!sealed.ok()) std::abort();
    for (auto _ : state) {
        auto secret = unseal(t.kek(), *sealed);
        if (!secret.ok()) state.SkipWithError(secret.error().c_str());
        benchmark::DoNotOptimize(secret);
    }
    state.counters["unseals/s"] = benchmark::Counter(static_cast<double>(state.iterations()),
                                                     benchmark::Counter::kIsRate);
}
BENCHMARK(BM_SecretUnseal)->ArgName("bytes")->Arg(40)->Arg(1024)->Arg(16384);

}  // namespace
}  // namespace egress::credstore
