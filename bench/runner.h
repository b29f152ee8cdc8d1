#pragma once
// One benchmark run: T io_context threads, --connections drivers spread over them, one shared
// Scheduler; per-thread RunStats merged at the end.

#include <string>

#include "bench/options.h"
#include "bench/stats.h"

namespace egress::bench {

struct RunResult {
  std::string fatal_error;  // the run could not start (resolution, trust store, ...)
  RunStats stats;
  double elapsed_s = 0;  // measured interval: measure start → last counted completion
  double warmup_s = 0;
  bool interrupted = false;
  /// Open loop with --duration: requests due in the measured window that were never sent
  /// (the client was behind when the window ended). Not in counted().
  std::uint64_t not_sent = 0;

  std::uint64_t counted() const { return stats.ok + stats.failed; }
  /// Successful (status < 400) requests per second of the measured interval.
  double rps() const { return elapsed_s > 0 ? static_cast<double>(stats.ok) / elapsed_s : 0; }
};

/// Runs the benchmark described by `options` to completion (blocking). SIGINT ends it early.
RunResult run_benchmark(const BenchOptions& options);

/// What run_benchmark() sets up before any request (first hop resolution, trust store, ALPN),
/// done and thrown away: the reason the run could not start, or empty. Blocking.
std::string check_setup(const BenchOptions& options);

}  // namespace egress::bench
