#include "bench/histogram.h"

#include <algorithm>
#include <bit>
#include <cmath>

namespace egress::bench {
namespace {

// 2048 linear sub-buckets per power of two: values below 2048 µs are exact, larger ones keep
// 11 significant bits. Bucket b covers [1024·2^b, 2048·2^b) with step 2^b (b = 0 also holds
// 0..1023 with step 1), the HdrHistogram layout with unit magnitude 0.
constexpr unsigned kSubBucketHalfMagnitude = 10;
constexpr std::uint64_t kSubBucketHalf = std::uint64_t{1} << kSubBucketHalfMagnitude;
constexpr std::uint64_t kSubBucketMask = 2 * kSubBucketHalf - 1;

unsigned bucket_of(std::uint64_t v) {
  // Index of the highest set bit of (v | mask) minus the sub-bucket magnitude.
  return static_cast<unsigned>(std::bit_width(v | kSubBucketMask)) - 1 - kSubBucketHalfMagnitude;
}

constexpr std::size_t kBuckets = 32 - kSubBucketHalfMagnitude;  // covers kMaxTrackable
constexpr std::size_t kCounts = (kBuckets + 1) * kSubBucketHalf;

}  // namespace

LatencyHistogram::LatencyHistogram() : counts_(kCounts, 0) {}

std::size_t LatencyHistogram::index_of(std::uint64_t v) {
  const unsigned b = bucket_of(v);
  const std::uint64_t sub = v >> b;  // in [1024, 2048) for b > 0, [0, 2048) for b == 0
  return static_cast<std::size_t>(((std::uint64_t{b} + 1) << kSubBucketHalfMagnitude) +
                                  (sub - kSubBucketHalf));
}

std::uint64_t LatencyHistogram::highest_equivalent(std::size_t index) {
  // Inverse of index_of: index = (b+1)·1024 + sub − 1024, with sub in [1024, 2048) except for
  // the first 2048 indices, which map to bucket 0 directly.
  std::uint64_t b = index >> kSubBucketHalfMagnitude;
  std::uint64_t sub = (index & (kSubBucketHalf - 1)) + kSubBucketHalf;
  if (b == 0) {
    return index;  // exact values 0..1023
  }
  b -= 1;
  const std::uint64_t lowest = sub << b;
  return lowest + ((std::uint64_t{1} << b) - 1);
}

void LatencyHistogram::record(std::uint64_t value_us, std::uint64_t n) {
  if (n == 0) {
    return;
  }
  const std::uint64_t v = std::min(value_us, kMaxTrackable);
  counts_[index_of(v)] += n;
  total_ += n;
  min_ = std::min(min_, v);
  max_ = std::max(max_, v);
  sum_ += static_cast<long double>(v) * static_cast<long double>(n);
}

void LatencyHistogram::merge(const LatencyHistogram& other) {
  for (std::size_t i = 0; i < counts_.size(); ++i) {
    counts_[i] += other.counts_[i];
  }
  total_ += other.total_;
  min_ = std::min(min_, other.min_);
  max_ = std::max(max_, other.max_);
  sum_ += other.sum_;
}

double LatencyHistogram::mean() const {
  return total_ ? static_cast<double>(sum_ / static_cast<long double>(total_)) : 0.0;
}

std::uint64_t LatencyHistogram::value_at_percentile(double p) const {
  if (total_ == 0) {
    return 0;
  }
  p = std::clamp(p, 0.0, 100.0);
  // The rank ceil(p% of total) in integers, p in parts per million: in doubles 99.9 / 100 is
  // a hair above 0.999, so p99.9 of 1000 values took rank 1000 (the max), not 999.
  const auto ppm = static_cast<std::uint64_t>(std::llround(p * 10'000.0));
  auto rank = (ppm * total_ + 999'999) / 1'000'000;
  rank = std::clamp<std::uint64_t>(rank, 1, total_);
  std::uint64_t seen = 0;
  for (std::size_t i = 0; i < counts_.size(); ++i) {
    seen += counts_[i];
    if (seen >= rank) {
      return std::min(highest_equivalent(i), max_);
    }
  }
  return max_;
}

}  // namespace egress::bench
