#pragma once
// Process-wide counters for /metrics (Prometheus text format, DESIGN.md metric names).
#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

namespace egress::proxy {

class Metrics {
public:
    void request(const std::string& decision, const std::string& protocol, double seconds);
    void denied(const std::string& reason);
    void upstream_error(const std::string& kind);
    std::atomic<int64_t> active_connections{0};
    std::atomic<int64_t> runs_active{0};
    std::atomic<uint64_t> certs_minted{0};
    std::atomic<uint64_t> cert_cache_hits{0};

    /// Prometheus text exposition.
    std::string render() const;

private:
    static constexpr std::array<double, 12> kBuckets{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                     0.1,   0.25,   0.5,   1,    2.5,   10};
    mutable std::mutex mu_;
    std::map<std::pair<std::string, std::string>, uint64_t> requests_;
    std::map<std::string, uint64_t> denied_;
    std::map<std::string, uint64_t> upstream_errors_;
    std::array<uint64_t, kBuckets.size()> bucket_counts_{};
    uint64_t duration_count_ = 0;
    double duration_sum_ = 0;
};

}  // namespace egress::proxy
