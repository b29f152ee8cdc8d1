#include "tls/leaf_cache.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <utility>

namespace egress::tls {
namespace {

using Clock = std::chrono::system_clock;

}  // namespace

/// One host's slot. Waiters keep it alive through a shared_ptr, so an entry evicted or
/// dropped while its mint runs still delivers the result to them.
struct LeafCache::Entry {
    std::shared_ptr<const Leaf> leaf;  // null until the first mint succeeds
    Clock::time_point minted_at;
    bool minting = false;
    uint64_t mints_done = 0;  // bumped when a mint finishes; waiters wait for a change
    bool failed = false;      // final: a failed entry is dropped from the map, never reused
    std::string error;
    bool in_lru = false;
    std::list<std::string>::iterator lru_pos;
};

LeafCache::LeafCache(const RunCa& ca, size_t capacity) : ca_(ca), capacity_(capacity) {}

LeafCache::LeafCache(const RunCa& ca, size_t capacity, std::chrono::seconds leaf_validity)
    : ca_(ca), capacity_(capacity), leaf_validity_(leaf_validity) {}

void LeafCache::set_mint_rate(size_t per_minute) {
    std::lock_guard lock(mu_);
    mint_rate_ = per_minute;
    mint_tokens_ = static_cast<double>(per_minute);
    mint_refill_ = std::chrono::steady_clock::now();
}

std::chrono::seconds LeafCache::mint_retry_after() const {
    std::lock_guard lock(mu_);
    if (mint_rate_ == 0) {
        return std::chrono::seconds(1);
    }
    const double per_second = static_cast<double>(mint_rate_) / 60.0;
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - mint_refill_).count();
    const double tokens =
        std::min(static_cast<double>(mint_rate_), mint_tokens_ + per_second * elapsed);
    const double wait = std::ceil((1.0 - tokens) / per_second);
    return std::chrono::seconds(wait < 1.0 ? 1 : static_cast<int64_t>(wait));
}

namespace {

/// Less than a quarter of the leaf's validity left, or already expired. A leaf that already
/// ends with the run CA is kept until it expires: a new one could not last longer.
bool needs_remint(const Leaf& leaf, Clock::time_point minted_at, Clock::time_point ca_not_after,
                  Clock::time_point now) {
    if (now >= leaf.not_after) {
        return true;
    }
    if (leaf.not_after >= ca_not_after) {
        return false;
    }
    return (leaf.not_after - now) * 4 < (leaf.not_after - minted_at);
}

}  // namespace

Result<std::shared_ptr<const Leaf>> LeafCache::get(const std::string& host) {
    std::unique_lock lock(mu_);
    std::shared_ptr<Entry> entry;
    if (auto it = map_.find(host); it != map_.end()) {
        entry = it->second;
        if (entry->minting) {
            const uint64_t seen = entry->mints_done;
            minted_.wait(lock, [&] { return entry->mints_done != seen; });
            if (entry->failed) {
                return make_error(entry->error);
            }
            ++hits_;
            if (entry->in_lru) {
                lru_.splice(lru_.begin(), lru_, entry->lru_pos);
            }
            return entry->leaf;
        }
        if (entry->leaf != nullptr &&
            !needs_remint(*entry->leaf, entry->minted_at, ca_.not_after(), Clock::now())) {
            ++hits_;
            lru_.splice(lru_.begin(), lru_, entry->lru_pos);
            return entry->leaf;
        }
    }
    if (mint_rate_ != 0) {
        auto now = std::chrono::steady_clock::now();
        double per_second = static_cast<double>(mint_rate_) / 60.0;
        mint_tokens_ = std::min(static_cast<double>(mint_rate_),
                                mint_tokens_ + per_second *
                                    std::chrono::duration<double>(now - mint_refill_).count());
        mint_refill_ = now;
        if (mint_tokens_ < 1.0) {
            if (entry && entry->leaf != nullptr && Clock::now() < entry->leaf->not_after) {
                ++hits_;  // due for a re-mint but still valid: keep serving it
                if (entry->in_lru) {
                    lru_.splice(lru_.begin(), lru_, entry->lru_pos);
                }
                return entry->leaf;
            }
            return make_error(std::string(kMintRateExceeded));
        }
        mint_tokens_ -= 1.0;
    }
    if (!entry) {
        entry = std::make_shared<Entry>();
        map_.emplace(host, entry);
    }

    // This caller mints; others asking for `host` wait on the entry, other hosts proceed.
    entry->minting = true;
    ++misses_;
    lock.unlock();
    const Clock::time_point started = Clock::now();
    Result<std::shared_ptr<const Leaf>> minted = make_error("leaf mint failed");
    try {
        minted = ca_.mint(host, leaf_validity_);
    } catch (const std::exception& e) {
        minted = make_error(std::string("leaf mint failed: ") + e.what());
    } catch (...) {
        minted = make_error("leaf mint failed: unknown exception");
    }
    lock.lock();

    entry->minting = false;
    ++entry->mints_done;
    auto it = map_.find(host);
    const bool cached = it != map_.end() && it->second == entry;
    if (!minted.ok()) {
        if (mint_rate_ != 0 && minted.error() == kOutsideRunCa) {
            // Nothing was minted for the host (the CA may not certify it): its refusals do
            // not spend the mint budget the run's other hosts need.
            mint_tokens_ = std::min(static_cast<double>(mint_rate_), mint_tokens_ + 1.0);
        }
        entry->failed = true;
        entry->error = minted.error();
        entry->leaf.reset();
        if (cached) {
            if (entry->in_lru) {
                lru_.erase(entry->lru_pos);
                entry->in_lru = false;
            }
            map_.erase(it);
        }
        minted_.notify_all();
        return make_error(entry->error);
    }

    entry->leaf = minted.value();
    entry->minted_at = started;
    if (cached) {
        if (entry->in_lru) {
            lru_.splice(lru_.begin(), lru_, entry->lru_pos);
        } else {
            lru_.push_front(host);
            entry->lru_pos = lru_.begin();
            entry->in_lru = true;
        }
        while (lru_.size() > capacity_) {
            auto victim = map_.find(lru_.back());
            victim->second->in_lru = false;
            map_.erase(victim);
            lru_.pop_back();
        }
    }
    std::shared_ptr<const Leaf> leaf = entry->leaf;
    minted_.notify_all();
    return leaf;
}

size_t LeafCache::size() const {
    std::lock_guard lock(mu_);
    return lru_.size();
}

uint64_t LeafCache::hits() const {
    std::lock_guard lock(mu_);
    return hits_;
}

uint64_t LeafCache::misses() const {
    std::lock_guard lock(mu_);
    return misses_;
}

}  // namespace egress::tls
