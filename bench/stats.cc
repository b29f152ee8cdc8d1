#include "bench/stats.h"

#include <algorithm>

namespace egress::bench {

std::string error_key(ErrorKind kind, unsigned status) {
  switch (kind) {
    case ErrorKind::kConnect:
      return "connect";
    case ErrorKind::kProxyIo:
      return "proxy_io";
    case ErrorKind::kProxyStatus:
      return "connect_" + std::to_string(status);
    case ErrorKind::kTls:
      return "tls";
    case ErrorKind::kAlpn:
      return "alpn";
    case ErrorKind::kTimeout:
      return "timeout";
    case ErrorKind::kWrite:
      return "write";
    case ErrorKind::kRead:
      return "read";
    case ErrorKind::kParse:
      return "parse";
    case ErrorKind::kStatus:
      return "status_" + std::to_string(status / 100) + "xx";
  }
  return "unknown";
}

void RunStats::add_error(const std::string& key, std::string_view message) {
  ++failed;
  auto it = errors.find(key);
  if (it == errors.end()) {
    errors.emplace(key, 1);
    error_samples.emplace(key, std::string(message));
  } else {
    ++it->second;
  }
}

void RunStats::merge(const RunStats& other) {
  latency.merge(other.latency);
  latency_lower_bounds += other.latency_lower_bounds;
  connect_latency.merge(other.connect_latency);
  ok += other.ok;
  failed += other.failed;
  warmup_requests += other.warmup_requests;
  retries += other.retries;
  bytes_received += other.bytes_received;
  body_bytes_received += other.body_bytes_received;
  bytes_sent += other.bytes_sent;
  connections_opened += other.connections_opened;
  tls_handshakes += other.tls_handshakes;
  tls_resumed += other.tls_resumed;
  for (std::size_t i = 0; i < status_counts.size(); ++i) {
    status_counts[i] += other.status_counts[i];
  }
  for (const auto& [k, n] : other.errors) {
    errors[k] += n;
  }
  for (const auto& [k, m] : other.error_samples) {
    error_samples.emplace(k, m);
  }
  for (const auto& [k, n] : other.protocols) {
    protocols[k] += n;
  }
  last_completion = std::max(last_completion, other.last_completion);
}

void RunStats::record_failure(bool counted, Clock::time_point intended, const Failure& failure) {
  if (!counted) {
    ++warmup_requests;
    return;
  }
  add_error(failure.key(), failure.message);
  const auto now = Clock::now();
  if (failure.kind == ErrorKind::kTimeout) {
    latency.record(std::max(failure.waited_us, micros_since(intended, now)));
    ++latency_lower_bounds;
  }
  last_completion = std::max(last_completion, now);
}

void RunStats::record_response(bool counted, Clock::time_point intended, unsigned status,
                               std::uint64_t sent, std::uint64_t bytes, std::uint64_t body) {
  if (!counted) {
    ++warmup_requests;
    return;
  }
  const auto done = Clock::now();
  latency.record(micros_since(intended, done));
  last_completion = std::max(last_completion, done);
  bytes_sent += sent;
  bytes_received += bytes;
  body_bytes_received += body;
  if (status < status_counts.size()) {  // Beast takes any three digits
    ++status_counts[status];
  }
  if (status >= 400) {
    add_error(error_key(ErrorKind::kStatus, status), "HTTP " + std::to_string(status));
  } else {
    ++ok;
  }
}

}  // namespace egress::bench
