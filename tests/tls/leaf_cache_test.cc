#include "tls/leaf_cache.h"

#include <gtest/gtest.h>
#include <openssl/x509v3.h>

#include <atomic>
#include <latch>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace egress::tls {
namespace {

using std::chrono::hours;
using std::chrono::milliseconds;
using std::chrono::seconds;

std::unique_ptr<RunCa> make_ca(seconds validity = hours(1)) {
    auto ca = RunCa::create("cache-run", validity);
    EXPECT_TRUE(ca.ok());
    return std::move(ca).value();
}

std::shared_ptr<const Leaf> must_get(LeafCache& cache, const std::string& host) {
    auto leaf = cache.get(host);
    EXPECT_TRUE(leaf.ok()) << host << ": " << (leaf.ok() ? "" : leaf.error());
    return leaf.ok() ? leaf.value() : nullptr;
}

TEST(LeafCacheTest, CountsHitsAndMissesAndReturnsTheSameLeaf) {
    auto ca = make_ca();
    LeafCache cache(*ca, 8);
    EXPECT_EQ(cache.capacity(), 8u);
    auto first = must_get(cache, "a.test");
    ASSERT_NE(first, nullptr);
    EXPECT_EQ(cache.misses(), 1u);
    EXPECT_EQ(cache.hits(), 0u);
    auto second = must_get(cache, "a.test");
    EXPECT_EQ(second, first);  // same shared_ptr, no new mint
    EXPECT_EQ(cache.hits(), 1u);
    auto other = must_get(cache, "b.test");
    EXPECT_NE(other, first);
    EXPECT_EQ(cache.misses(), 2u);
    EXPECT_EQ(cache.size(), 2u);
    EXPECT_EQ(X509_check_host(first->cert.get(), "a.test", 0, 0, nullptr), 1);
    EXPECT_EQ(X509_check_host(other->cert.get(), "b.test", 0, 0, nullptr), 1);
}

TEST(LeafCacheTest, CapacityEvictsLeastRecentlyUsed) {
    auto ca = make_ca();
    LeafCache cache(*ca, 2);
    auto a = must_get(cache, "a.test");
    auto b = must_get(cache, "b.test");
    EXPECT_EQ(must_get(cache, "a.test"), a);  // a is now the most recent
    auto c = must_get(cache, "c.test");       // evicts b
    EXPECT_EQ(cache.size(), 2u);
    EXPECT_EQ(cache.misses(), 3u);
    EXPECT_EQ(must_get(cache, "a.test"), a);
    EXPECT_EQ(must_get(cache, "c.test"), c);
    EXPECT_EQ(cache.hits(), 3u);
    auto b2 = must_get(cache, "b.test");  // minted again, evicts a
    EXPECT_NE(b2, b);
    EXPECT_EQ(cache.misses(), 4u);
    EXPECT_EQ(cache.size(), 2u);
    EXPECT_NE(must_get(cache, "a.test"), a);
    EXPECT_EQ(cache.misses(), 5u);
    // An evicted leaf held by a caller stays valid.
    EXPECT_EQ(X509_check_private_key(b->cert.get(), b->key.get()), 1);
}

TEST(LeafCacheTest, ZeroCapacityCachesNothing) {
    auto ca = make_ca();
    LeafCache cache(*ca, 0);
    auto a = must_get(cache, "a.test");
    ASSERT_NE(a, nullptr);
    EXPECT_EQ(cache.size(), 0u);
    EXPECT_NE(must_get(cache, "a.test"), a);
    EXPECT_EQ(cache.misses(), 2u);
}

TEST(LeafCacheTest, ConcurrentCallersForOneHostShareOneMint) {
    auto ca = make_ca();
    for (int round = 0; round < 20; ++round) {
        LeafCache cache(*ca, 16);
        constexpr int kThreads = 8;
        std::latch start(kThreads);
        std::vector<std::shared_ptr<const Leaf>> got(kThreads);
        std::vector<std::thread> threads;
        for (int t = 0; t < kThreads; ++t) {
            threads.emplace_back([&, t] {
                start.arrive_and_wait();
                auto r = cache.get("same.test");
                if (r.ok()) {
                    got[t] = r.value();
                }
            });
        }
        for (auto& th : threads) {
            th.join();
        }
        EXPECT_EQ(cache.misses(), 1u);
        EXPECT_EQ(cache.hits(), static_cast<uint64_t>(kThreads - 1));
        for (const auto& leaf : got) {
            ASSERT_NE(leaf, nullptr);
            EXPECT_EQ(leaf, got[0]);
        }
    }
}

TEST(LeafCacheTest, ConcurrentCallersForManyHostsMintEachOnce) {
    auto ca = make_ca();
    LeafCache cache(*ca, 64);
    constexpr int kThreads = 8;
    constexpr int kHosts = 40;
    std::latch start(kThreads);
    std::vector<std::thread> threads;
    std::atomic<int> failures{0};
    for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&, t] {
            start.arrive_and_wait();
            for (int i = 0; i < kHosts; ++i) {
                const int h = (i * (t + 1) + t) % kHosts;  // different orders per thread
                if (!cache.get("h" + std::to_string(h) + ".test").ok()) {
                    ++failures;
                }
            }
        });
    }
    for (auto& th : threads) {
        th.join();
    }
    EXPECT_EQ(failures.load(), 0);
    EXPECT_EQ(cache.size(), static_cast<size_t>(kHosts));
    EXPECT_EQ(cache.hits() + cache.misses(), static_cast<uint64_t>(kThreads * kHosts));
    // Each thread visits a permutation only when gcd(t+1, kHosts) == 1; count distinct hosts.
    std::set<int> hosts;
    for (int t = 0; t < kThreads; ++t) {
        for (int i = 0; i < kHosts; ++i) {
            hosts.insert((i * (t + 1) + t) % kHosts);
        }
    }
    EXPECT_EQ(cache.misses(), hosts.size());
}

TEST(LeafCacheTest, ConcurrentCallersUnderEvictionPressureStayConsistent) {
    auto ca = make_ca();
    LeafCache cache(*ca, 3);
    std::vector<std::thread> threads;
    std::atomic<int> bad{0};
    for (int t = 0; t < 4; ++t) {
        threads.emplace_back([&, t] {
            for (int i = 0; i < 200; ++i) {
                const std::string host = "h" + std::to_string((i + t) % 7) + ".test";
                auto r = cache.get(host);
                if (!r.ok() ||
                    X509_check_host(r.value()->cert.get(), host.c_str(), 0, 0, nullptr) != 1) {
                    ++bad;
                }
            }
        });
    }
    for (auto& th : threads) {
        th.join();
    }
    EXPECT_EQ(bad.load(), 0);
    EXPECT_LE(cache.size(), 3u);
    EXPECT_EQ(cache.hits() + cache.misses(), 800u);
}

TEST(LeafCacheTest, FailedMintIsReportedAndNotCached) {
    auto ca = make_ca();
    LeafCache cache(*ca, 4);
    auto bad = cache.get("not a host");
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.error().find("not a host"), std::string::npos);
    EXPECT_EQ(cache.size(), 0u);
    EXPECT_FALSE(cache.get("not a host").ok());
    EXPECT_EQ(cache.misses(), 2u);  // tried again, not served from a cached failure
    EXPECT_EQ(cache.hits(), 0u);
}

TEST(LeafCacheTest, FailedMintReachesConcurrentWaiters) {
    auto ca = make_ca();
    LeafCache cache(*ca, 4);
    constexpr int kThreads = 8;
    std::latch start(kThreads);
    std::atomic<int> failures{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&] {
            start.arrive_and_wait();
            if (!cache.get("bad,host").ok()) {
                ++failures;
            }
        });
    }
    for (auto& th : threads) {
        th.join();
    }
    EXPECT_EQ(failures.load(), kThreads);
    EXPECT_EQ(cache.size(), 0u);
    EXPECT_EQ(cache.hits(), 0u);
    EXPECT_GE(cache.misses(), 1u);
}

TEST(LeafCacheTest, RemintsWhenLessThanAQuarterOfValidityRemains) {
    auto ca = make_ca();
    LeafCache cache(*ca, 4, seconds(2));
    auto first = must_get(cache, "a.test");
    ASSERT_NE(first, nullptr);
    EXPECT_EQ(must_get(cache, "a.test"), first);  // fresh: a hit
    std::this_thread::sleep_until(first->not_after - milliseconds(200));
    auto second = must_get(cache, "a.test");
    ASSERT_NE(second, nullptr);
    EXPECT_NE(second, first);
    EXPECT_GT(second->not_after, first->not_after);
    EXPECT_EQ(cache.misses(), 2u);
    EXPECT_EQ(cache.hits(), 1u);
    EXPECT_EQ(cache.size(), 1u);
    EXPECT_EQ(must_get(cache, "a.test"), second);
}

TEST(LeafCacheTest, LeafEndingWithTheCaIsKeptUntilItExpires) {
    auto ca = make_ca(seconds(2));
    LeafCache cache(*ca, 4);
    auto first = must_get(cache, "a.test");
    ASSERT_NE(first, nullptr);
    EXPECT_EQ(first->not_after, ca->not_after());
    // Re-minting could not extend it, so it is served to the end of the run...
    std::this_thread::sleep_until(first->not_after - milliseconds(200));
    EXPECT_EQ(must_get(cache, "a.test"), first);
    EXPECT_EQ(cache.misses(), 1u);
    // ...and after the run CA expires nothing is served.
    std::this_thread::sleep_until(first->not_after + milliseconds(50));
    auto expired = cache.get("a.test");
    ASSERT_FALSE(expired.ok());
    EXPECT_NE(expired.error().find("expired"), std::string::npos);
    EXPECT_EQ(cache.size(), 0u);
}

TEST(LeafCacheTest, MintRateBoundsDistinctNamesButKeepsServingCachedOnes) {
    auto ca = make_ca();
    LeafCache cache(*ca, 64);
    cache.set_mint_rate(3);  // 3 per minute: a burst of 3, then one every 20 s
    ASSERT_NE(must_get(cache, "a.test"), nullptr);
    ASSERT_NE(must_get(cache, "b.test"), nullptr);
    ASSERT_NE(must_get(cache, "c.test"), nullptr);
    auto over = cache.get("d.test");
    ASSERT_FALSE(over.ok());
    EXPECT_EQ(over.error(), kMintRateExceeded);
    EXPECT_EQ(cache.misses(), 3u);  // the refused name was not minted
    EXPECT_EQ(cache.size(), 3u);    // nor cached
    // Names already minted are hits and cost nothing.
    for (int i = 0; i < 10; ++i) {
        ASSERT_NE(must_get(cache, "a.test"), nullptr);
    }
    EXPECT_EQ(cache.hits(), 10u);
    // Retry-After of the refusal: the bucket regains a mint 20 s after it was spent, less
    // the moments this test took (it was 1 whatever the rate).
    const auto retry = cache.mint_retry_after();
    EXPECT_GE(retry.count(), 15);
    EXPECT_LE(retry.count(), 20);
}

TEST(LeafCacheTest, MintRetryAfterIsAtLeastOneSecond) {
    auto ca = make_ca();
    LeafCache cache(*ca, 64);
    EXPECT_EQ(cache.mint_retry_after().count(), 1);  // unlimited
    cache.set_mint_rate(60);                         // one a second: under a second to wait
    int minted = 0;
    while (minted < 100 && cache.get("h" + std::to_string(minted) + ".test").ok()) {
        ++minted;
    }
    EXPECT_LT(minted, 100);
    EXPECT_EQ(cache.mint_retry_after().count(), 1);
}

TEST(LeafCacheTest, HostsOutsideTheCaConstraintsDoNotSpendTheMintRate) {
    auto ca = RunCa::create("run-nc", std::chrono::hours(1), {"a.test"});
    ASSERT_TRUE(ca.ok()) << ca.error();
    LeafCache cache(**ca, 64);
    cache.set_mint_rate(2);
    for (int i = 0; i < 5; ++i) {
        auto outside = cache.get("evil.test");
        ASSERT_FALSE(outside.ok());
        EXPECT_EQ(outside.error(), kOutsideRunCa);
    }
    EXPECT_EQ(cache.size(), 0u);
    ASSERT_NE(must_get(cache, "a.test"), nullptr);
    ASSERT_NE(must_get(cache, "x.a.test"), nullptr);
}

TEST(LeafCacheTest, ZeroMintRateIsUnlimited) {
    auto ca = make_ca();
    LeafCache cache(*ca, 64);
    cache.set_mint_rate(0);
    for (int i = 0; i < 20; ++i) {
        ASSERT_NE(must_get(cache, "h" + std::to_string(i) + ".test"), nullptr);
    }
    EXPECT_EQ(cache.misses(), 20u);
}

}  // namespace
}  // namespace egress::tls
