#pragma once
// Bounded LRU of minted leaves per normalized host, for one run. Only one mint in flight per
// host: concurrent callers for the same host wait for that mint instead of minting again.
// Entries are re-minted when less than a quarter of their validity remains.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>

#include "common/result.h"
#include "tls/run_ca.h"

namespace egress::tls {

/// The error `LeafCache::get` returns when the per-run mint budget is spent.
inline constexpr std::string_view kMintRateExceeded = "mint_rate_exceeded";

class LeafCache {
public:
    LeafCache(const RunCa& ca, size_t capacity);
    /// As above, minting leaves with `leaf_validity` (still capped by the CA's not_after).
    LeafCache(const RunCa& ca, size_t capacity, std::chrono::seconds leaf_validity);

    /// Thread-safe. `host` must be normalized and must already have passed policy.
    Result<std::shared_ptr<const Leaf>> get(const std::string& host);

    /// At most `per_minute` mints (first mints and re-mints) per rolling minute, as a token
    /// bucket holding `per_minute` tokens; 0 = unlimited. Over it, `get` fails with
    /// kMintRateExceeded for a host with no usable leaf (a host whose leaf is due for a
    /// re-mint but still valid keeps being served). Bounds a storm of distinct SNI names.
    void set_mint_rate(size_t per_minute);
    /// Seconds until the mint budget holds a mint again, rounded up, at least 1 (1 when the
    /// rate is unlimited): the Retry-After of a kMintRateExceeded refusal.
    std::chrono::seconds mint_retry_after() const;

    /// Cached leaves (mints in flight for a new host are not counted).
    size_t size() const;
    size_t capacity() const { return capacity_; }
    /// Calls answered without minting (including callers that waited for another caller's
    /// mint of the same host).
    uint64_t hits() const;
    /// Mints started (first mints and re-mints, failed or not).
    uint64_t misses() const;

private:
    struct Entry;
    const RunCa& ca_;
    size_t capacity_;
    std::chrono::seconds leaf_validity_ = std::chrono::hours(24);
    mutable std::mutex mu_;
    std::condition_variable minted_;
    std::list<std::string> lru_;  // front = most recent
    std::unordered_map<std::string, std::shared_ptr<Entry>> map_;
    size_t mint_rate_ = 0;        // per minute; 0 = unlimited
    double mint_tokens_ = 0;
    std::chrono::steady_clock::time_point mint_refill_{};
    uint64_t hits_ = 0;
    uint64_t misses_ = 0;
};

}  // namespace egress::tls
