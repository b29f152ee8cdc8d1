// Compiled and run by test_egress_bench.py (no Asio, builds in a second): checks the bucket
// layout, percentile ranks, precision and merge of bench/histogram.cc.
#include <cstdio>
#include <cstdlib>

#include "bench/histogram.h"

using egress::bench::LatencyHistogram;

#define CHECK(cond)                                                          \
  do {                                                                       \
    if (!(cond)) {                                                           \
      std::fprintf(stderr, "%s:%d: CHECK(%s)\n", __FILE__, __LINE__, #cond); \
      std::exit(1);                                                          \
    }                                                                        \
  } while (0)

int main() {
  {
    LatencyHistogram h;
    CHECK(h.value_at_percentile(50) == 0 && h.max() == 0 && h.count() == 0);
  }
  {  // Exact below 2048 µs.
    LatencyHistogram h;
    for (std::uint64_t v = 1; v <= 2000; ++v) h.record(v);
    CHECK(h.count() == 2000);
    CHECK(h.value_at_percentile(50) == 1000);
    CHECK(h.value_at_percentile(90) == 1800);
    CHECK(h.value_at_percentile(100) == 2000);
    CHECK(h.min() == 1 && h.max() == 2000);
    CHECK(h.mean() > 1000.4 && h.mean() < 1000.6);
  }
  {  // Ranks are exact: p99.9 of 1..1000 is the 999th value, not the max.
    LatencyHistogram h;
    for (std::uint64_t v = 1; v <= 1000; ++v) h.record(v);
    CHECK(h.value_at_percentile(99.9) == 999);
    CHECK(h.value_at_percentile(99) == 990);
    CHECK(h.value_at_percentile(50) == 500);
    CHECK(h.value_at_percentile(100) == 1000);
    LatencyHistogram one;
    one.record(7);
    CHECK(one.value_at_percentile(0) == 7 && one.value_at_percentile(99.9) == 7);
  }
  {  // Relative error below 1/1024 for large values; percentile never above max.
    for (std::uint64_t v : {2048ull, 2049ull, 4095ull, 123457ull, 9876543ull, 4000000000ull}) {
      LatencyHistogram h;
      h.record(v);
      h.record(1);
      const std::uint64_t got = h.value_at_percentile(100);
      CHECK(got == v);  // capped at the exact max
      LatencyHistogram g;
      g.record(v);
      g.record(v * 2 > LatencyHistogram::kMaxTrackable ? v : v * 2);
      const std::uint64_t p50 = g.value_at_percentile(50);
      CHECK(p50 >= v && static_cast<double>(p50 - v) <= static_cast<double>(v) / 1024.0);
    }
  }
  {  // Uniform 1..1e6: p99 within 0.1%.
    LatencyHistogram a, b;
    for (std::uint64_t v = 1; v <= 1000000; ++v) (v % 2 ? a : b).record(v);
    a.merge(b);
    CHECK(a.count() == 1000000);
    const double p99 = static_cast<double>(a.value_at_percentile(99));
    CHECK(p99 >= 990000 && p99 <= 990000 * 1.001);
    const double p999 = static_cast<double>(a.value_at_percentile(99.9));
    CHECK(p999 >= 999000 && p999 <= 999000 * 1.001);
    CHECK(a.max() == 1000000 && a.min() == 1);
  }
  {  // record(v, n) is n records of v.
    LatencyHistogram once, many;
    for (int i = 0; i < 500; ++i) once.record(3000);
    once.record(10);
    many.record(3000, 500);
    many.record(10, 1);
    many.record(99999, 0);  // nothing
    CHECK(many.count() == once.count() && many.count() == 501);
    CHECK(many.value_at_percentile(50) == once.value_at_percentile(50));
    CHECK(many.min() == 10 && many.max() == 3000 && many.mean() == once.mean());
  }
  {  // Clamping.
    LatencyHistogram h;
    h.record(~std::uint64_t{0});
    CHECK(h.max() == LatencyHistogram::kMaxTrackable);
  }
  std::puts("ok");
  return 0;
}
