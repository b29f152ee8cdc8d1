#include "proxy/metrics.h"

#include <sstream>

namespace egress::proxy {

void Metrics::request(const std::string& decision, const std::string& protocol, double seconds) {
    std::lock_guard lock(mu_);
    ++requests_[{decision, protocol}];
    for (size_t i = 0; i < kBuckets.size(); ++i) {
        if (seconds <= kBuckets[i]) {
            ++bucket_counts_[i];
        }
    }
    ++duration_count_;
    duration_sum_ += seconds;
}

void Metrics::denied(const std::string& reason) {
    std::lock_guard lock(mu_);
    ++denied_[reason];
}

void Metrics::upstream_error(const std::string& kind) {
    std::lock_guard lock(mu_);
    ++upstream_errors_[kind];
}

std::string Metrics::render() const {
    std::ostringstream o;
    std::lock_guard lock(mu_);
    o << "# HELP egressd_requests_total Requests by decision and protocol.\n"
         "# TYPE egressd_requests_total counter\n";
    for (const auto& [k, v] : requests_) {
        o << "egressd_requests_total{decision=\"" << k.first << "\",protocol=\"" << k.second
          << "\"} " << v << "\n";
    }
    o << "# HELP egressd_request_duration_seconds Request duration.\n"
         "# TYPE egressd_request_duration_seconds histogram\n";
    for (size_t i = 0; i < kBuckets.size(); ++i) {
        o << "egressd_request_duration_seconds_bucket{le=\"" << kBuckets[i] << "\"} "
          << bucket_counts_[i] << "\n";
    }
    o << "egressd_request_duration_seconds_bucket{le=\"+Inf\"} " << duration_count_ << "\n"
      << "egressd_request_duration_seconds_sum " << duration_sum_ << "\n"
      << "egressd_request_duration_seconds_count " << duration_count_ << "\n";
    o << "# TYPE egressd_active_connections gauge\negressd_active_connections "
      << active_connections.load() << "\n";
    o << "# TYPE egressd_runs_active gauge\negressd_runs_active " << runs_active.load() << "\n";
    o << "# TYPE egressd_certs_minted_total counter\negressd_certs_minted_total "
      << certs_minted.load() << "\n";
    o << "# TYPE egressd_cert_cache_hits_total counter\negressd_cert_cache_hits_total "
      << cert_cache_hits.load() << "\n";
    o << "# TYPE egressd_denied_total counter\n";
    for (const auto& [k, v] : denied_) {
        o << "egressd_denied_total{reason=\"" << k << "\"} " << v << "\n";
    }
    o << "# TYPE egressd_upstream_errors_total counter\n";
    for (const auto& [k, v] : upstream_errors_) {
        o << "egressd_upstream_errors_total{kind=\"" << k << "\"} " << v << "\n";
    }
    return o.str();
}

}  // namespace egress::proxy
