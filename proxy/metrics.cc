#include "proxy/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <sstream>

namespace egress::proxy {

namespace {

/// A floating value as Prometheus reads it: the shortest text that reads back as the same
/// double (std::to_chars), "+Inf", "-Inf" or "NaN". An ostream's default precision (6
/// significant digits) had the duration sum stop moving at 100000 s, and rounded it before.
std::string prom_double(double v) {
    if (std::isnan(v)) {
        return "NaN";
    }
    if (std::isinf(v)) {
        return v > 0 ? "+Inf" : "-Inf";
    }
    char buf[64];
    auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
    return std::string(buf, ec == std::errc() ? end : buf);
}

}  // namespace

void Metrics::Shard::request(std::string_view decision, std::string_view protocol,
                             double seconds) {
    std::lock_guard lock(mu_);
    // Looked up without building a key: the pair of strings is made once per new label set.
    auto it = std::find_if(requests_.begin(), requests_.end(), [&](const auto& kv) {
        return kv.first.first == decision && kv.first.second == protocol;
    });
    if (it == requests_.end()) {
        it = requests_.emplace(std::pair{std::string(decision), std::string(protocol)}, 0).first;
    }
    ++it->second;
    for (size_t i = 0; i < kBuckets.size(); ++i) {
        if (seconds <= kBuckets[i]) {
            ++bucket_counts_[i];
        }
    }
    ++duration_count_;
    duration_sum_ += seconds;
}

Metrics::Shard& Metrics::add_shard() {
    std::lock_guard lock(mu_);
    shards_.push_back(std::make_unique<Shard>());
    return *shards_.back();
}

void Metrics::request(std::string_view decision, std::string_view protocol, double seconds) {
    common_.request(decision, protocol, seconds);
}

void Metrics::denied(const std::string& reason) {
    std::lock_guard lock(mu_);
    ++denied_[reason];
}

void Metrics::upstream_error(const std::string& kind) {
    std::lock_guard lock(mu_);
    ++upstream_errors_[kind];
}

std::string Metrics::render(std::optional<double> state_sync_age) const {
    std::ostringstream o;
    std::lock_guard lock(mu_);
    std::map<std::pair<std::string, std::string>, uint64_t> requests;
    std::array<uint64_t, kBuckets.size()> buckets{};
    uint64_t count = 0;
    double sum = 0;
    std::vector<const Shard*> all{&common_};
    for (const auto& shard : shards_) {
        all.push_back(shard.get());
    }
    for (const Shard* shard : all) {
        std::lock_guard shard_lock(shard->mu_);
        for (const auto& [k, v] : shard->requests_) {
            requests[k] += v;
        }
        for (size_t i = 0; i < kBuckets.size(); ++i) {
            buckets[i] += shard->bucket_counts_[i];
        }
        count += shard->duration_count_;
        sum += shard->duration_sum_;
    }
    o << "# HELP egressd_requests_total Requests by decision and protocol.\n"
         "# TYPE egressd_requests_total counter\n";
    for (const auto& [k, v] : requests) {
        o << "egressd_requests_total{decision=\"" << k.first << "\",protocol=\"" << k.second
          << "\"} " << v << "\n";
    }
    o << "# HELP egressd_request_duration_seconds Request duration.\n"
         "# TYPE egressd_request_duration_seconds histogram\n";
    for (size_t i = 0; i < kBuckets.size(); ++i) {
        o << "egressd_request_duration_seconds_bucket{le=\"" << prom_double(kBuckets[i])
          << "\"} " << buckets[i] << "\n";
    }
    o << "egressd_request_duration_seconds_bucket{le=\"+Inf\"} " << count << "\n"
      << "egressd_request_duration_seconds_sum " << prom_double(sum) << "\n"
      << "egressd_request_duration_seconds_count " << count << "\n";
    o << "# TYPE egressd_active_connections gauge\negressd_active_connections "
      << active_connections.load() << "\n";
    o << "# TYPE egressd_runs_active gauge\negressd_runs_active " << runs_active.load() << "\n";
    o << "# TYPE egressd_state_revision gauge\negressd_state_revision " << state_revision.load()
      << "\n";
    if (state_sync_age) {
        o << "# HELP egressd_state_sync_age_seconds Seconds since this replica last knew it held "
             "all of etcd's state.\n# TYPE egressd_state_sync_age_seconds gauge\n"
             "egressd_state_sync_age_seconds "
          << prom_double(*state_sync_age) << "\n";
    }
    o << "# TYPE egressd_certs_minted_total counter\negressd_certs_minted_total "
      << certs_minted.load() << "\n";
    o << "# TYPE egressd_cert_cache_hits_total counter\negressd_cert_cache_hits_total "
      << cert_cache_hits.load() << "\n";
    o << "# HELP egressd_audit_write_errors_total Failed writes or syncs of the audit file (a "
         "full disk, an I/O error).\n"
         "# TYPE egressd_audit_write_errors_total counter\negressd_audit_write_errors_total "
      << (audit_write_errors != nullptr ? audit_write_errors->load() : 0) << "\n";
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
