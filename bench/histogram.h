#pragma once
// HdrHistogram-style latency histogram: log-linear buckets over integer microseconds, three
// significant decimal digits (relative error < 1/1024), fixed memory (~190 KiB), O(1) record.
// Pure: no I/O, no locks. One instance per io_context thread; merge() them after the run.

#include <cstdint>
#include <vector>

namespace egress::bench {

class LatencyHistogram {
 public:
  /// Values above this (about 71 minutes in µs) are clamped to it.
  static constexpr std::uint64_t kMaxTrackable = (std::uint64_t{1} << 32) - 1;

  LatencyHistogram();

  /// Records one value in microseconds. Never fails; values above kMaxTrackable are clamped.
  void record(std::uint64_t value_us) { record(value_us, 1); }
  /// Records `value_us` `n` times.
  void record(std::uint64_t value_us, std::uint64_t n);
  /// Adds every count of `other` into this histogram.
  void merge(const LatencyHistogram& other);

  std::uint64_t count() const { return total_; }
  std::uint64_t min() const { return total_ ? min_ : 0; }
  /// Exact maximum (not bucketed).
  std::uint64_t max() const { return max_; }
  double mean() const;
  /// The value at percentile p (0 < p <= 100), as the highest value equivalent to the bucket
  /// holding the ceil(p% · count)-th smallest recording, capped at max(). 0 when empty.
  std::uint64_t value_at_percentile(double p) const;

 private:
  static std::size_t index_of(std::uint64_t v);
  static std::uint64_t highest_equivalent(std::size_t index);

  std::vector<std::uint64_t> counts_;
  std::uint64_t total_ = 0;
  std::uint64_t min_ = UINT64_MAX;
  std::uint64_t max_ = 0;
  long double sum_ = 0;
};

}  // namespace egress::bench
