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
#include <unordered_map>

#include "common/result.h"
#include "tls/run_ca.h"

namespace egress::tls {

class LeafCache {
public:
    LeafCache(const RunCa& ca, size_t capacity);
    /// As above, minting leaves with `leaf_validity` (still capped by the CA's not_after).
    LeafCache(const RunCa& ca, size_t capacity, std::chrono::seconds leaf_validity);

    /// Thread-safe. `host` must be normalized and must already have passed policy.
    Result<std::shared_ptr<const Leaf>> get(const std::string& host);

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
    uint64_t hits_ = 0;
    uint64_t misses_ = 0;
};

}  // namespace egress::tls
