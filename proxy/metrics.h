#pragma once
// Process-wide counters for /metrics (Prometheus text format, DESIGN.md metric names).
#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace egress::proxy {

class Metrics {
    static constexpr std::array<double, 12> kBuckets{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                     0.1,   0.25,   0.5,   1,    2.5,   10};

public:
    /// Request counters and the duration histogram of one writer (a worker thread). Each
    /// worker counts into its own shard, under a lock only /metrics also takes: with one
    /// lock and map for all, every proxied request wrote a cache line every core writes
    /// (the lock's), which cost more than the counting. render() adds the shards up. Aligned
    /// to a cache line so that two shards (allocated one after the other) never share one.
    class alignas(64) Shard {
    public:
        void request(std::string_view decision, std::string_view protocol, double seconds);

    private:
        friend class Metrics;
        mutable std::mutex mu_;
        std::map<std::pair<std::string, std::string>, uint64_t> requests_;
        std::array<uint64_t, kBuckets.size()> bucket_counts_{};
        uint64_t duration_count_ = 0;
        double duration_sum_ = 0;
    };

    /// A new shard for one writer; it lives as long as this Metrics.
    Shard& add_shard();

    /// Counts into the shared shard (callers that are not a worker: tests, the admin side).
    void request(std::string_view decision, std::string_view protocol, double seconds);
    void denied(const std::string& reason);
    void upstream_error(const std::string& kind);
    std::atomic<int64_t> active_connections{0};
    std::atomic<int64_t> runs_active{0};
    /// The state store revision the data path serves (etcd's revision with state.backend
    /// etcd: replicas of one fleet converge on the same value; a lagging one shows).
    std::atomic<uint64_t> state_revision{0};
    std::atomic<uint64_t> certs_minted{0};
    std::atomic<uint64_t> cert_cache_hits{0};
    /// The audit log's count of failed writes (AuditLog::write_errors), set at start; the
    /// log outlives these metrics. Null: rendered as 0.
    const std::atomic<uint64_t>* audit_write_errors = nullptr;

    /// Prometheus text exposition. `state_sync_age`: seconds since the state store last knew it
    /// held all of etcd's state (egressd_state_sync_age_seconds; absent with the file backend).
    std::string render(std::optional<double> state_sync_age = std::nullopt) const;

private:
    Shard common_;  // request() of callers that are not a worker
    mutable std::mutex mu_;  // denied_, upstream_errors_ and the list of shards
    std::vector<std::unique_ptr<Shard>> shards_;
    std::map<std::string, uint64_t> denied_;
    std::map<std::string, uint64_t> upstream_errors_;
};

}  // namespace egress::proxy
