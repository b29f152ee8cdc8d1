#pragma once
// Counters one io_context thread writes while the run is going (no locks, no atomics: every
// driver on that thread shares one RunStats), merged into the run's totals afterwards.

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "bench/histogram.h"

namespace egress::bench {

using Clock = std::chrono::steady_clock;

/// Why a request failed. The report key is error_key(); kProxyStatus and kStatus carry a code.
enum class ErrorKind {
  kConnect,      // TCP connect to the target or proxy failed
  kProxyIo,      // I/O error while exchanging CONNECT with the proxy
  kProxyStatus,  // the proxy answered CONNECT with a non-2xx status ("connect_403")
  kTls,          // TLS handshake failed (including certificate verification)
  kAlpn,         // --h2: the server did not select h2 in ALPN
  kTimeout,      // any phase exceeded --timeout
  kWrite,        // writing the request failed
  kRead,         // reading the response failed (reset, EOF, truncated TLS)
  kParse,        // the response was not valid HTTP
  kStatus,       // the response status was 4xx or 5xx ("status_5xx")
};

std::string error_key(ErrorKind kind, unsigned status = 0);

/// A failed request or connection attempt, as recorded in RunStats.
struct Failure {
  ErrorKind kind;
  unsigned status = 0;
  std::string message;
  /// A failed connection attempt's own duration: it is charged to a ticket taken after it
  /// (a keep-alive connection opens before its first ticket), whose due time says nothing.
  std::uint64_t waited_us = 0;
  std::string key() const { return error_key(kind, status); }
};

/// Whole microseconds from `from` to `to`, rounded up so a recorded latency is never 0.
inline std::uint64_t micros_since(Clock::time_point from, Clock::time_point to) {
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(to - from).count();
  return ns <= 0 ? 0 : static_cast<std::uint64_t>((ns + 999) / 1000);
}

struct RunStats {
  /// Counted requests that got a response, and lower bounds (below) for those that did not:
  /// µs from each one's intended send time.
  LatencyHistogram latency;
  /// Of those, lower bounds: a request that timed out (it waited at least that long), and in
  /// open loop one due but never sent (due → the window's end). Without them a stalled
  /// server left only the fast answers in the percentiles.
  std::uint64_t latency_lower_bounds = 0;
  LatencyHistogram connect_latency;  // TCP + CONNECT + TLS of every successful open, µs
  std::uint64_t ok = 0;              // counted, status < 400
  std::uint64_t failed = 0;          // counted, any error (including 4xx/5xx)
  std::uint64_t warmup_requests = 0;
  /// HTTP/1.1 requests sent again on a new connection: their kept-alive connection failed
  /// before any answer byte after it had idled (counted or not).
  std::uint64_t retries = 0;
  std::uint64_t bytes_received = 0;  // HTTP bytes of counted responses (head + body)
  std::uint64_t body_bytes_received = 0;
  std::uint64_t bytes_sent = 0;  // HTTP bytes of counted requests
  std::uint64_t connections_opened = 0;
  std::uint64_t tls_handshakes = 0;
  std::uint64_t tls_resumed = 0;
  std::array<std::uint64_t, 1000> status_counts{};  // counted responses by status code
  std::map<std::string, std::uint64_t, std::less<>> errors;
  std::map<std::string, std::string, std::less<>> error_samples;  // first message per key
  std::map<std::string, std::uint64_t, std::less<>> protocols;    // per opened connection
  Clock::time_point last_completion{};                            // of a counted request

  /// Counts one counted error; `message` is kept as the sample for its key if it is the first.
  void add_error(const std::string& key, std::string_view message);
  void merge(const RunStats& other);

  /// One finished request, shared by every driver. A warmup request (not counted) only bumps
  /// warmup_requests. A response's latency is measured from `intended` (its scheduled send
  /// time, so open-loop stalls are not hidden); 4xx/5xx count as status errors. A failure has
  /// no latency (a refused port's few µs are not one), except a timeout: recorded as a lower
  /// bound, `intended` → now, or the attempt's own waited_us if longer.
  void record_failure(bool counted, Clock::time_point intended, const Failure& failure);
  void record_response(bool counted, Clock::time_point intended, unsigned status,
                       std::uint64_t bytes_sent, std::uint64_t bytes, std::uint64_t body_bytes);
};

}  // namespace egress::bench
