#include "bench/runner.h"

#include <atomic>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <csignal>
#include <cstdio>
#include <exception>
#include <thread>
#include <vector>

#include "bench/driver.h"
#include "bench/options.h"
#include "bench/scheduler.h"

namespace egress::bench {
namespace net = boost::asio;
namespace {

std::atomic<Scheduler*> g_active_scheduler{nullptr};
std::atomic<bool> g_interrupted{false};

extern "C" void on_sigint(int) {
  g_interrupted.store(true, std::memory_order_relaxed);
  if (Scheduler* s = g_active_scheduler.load(std::memory_order_relaxed)) {
    s->stop();  // a relaxed atomic store: async-signal-safe
  }
}

/// Installs the SIGINT handler for the duration of a run; a second SIGINT kills the process.
class InterruptScope {
 public:
  explicit InterruptScope(Scheduler& scheduler) {
    g_active_scheduler.store(&scheduler);
    struct sigaction sa = {};
    sa.sa_handler = on_sigint;
    sa.sa_flags = SA_RESETHAND;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &previous_);
  }
  ~InterruptScope() {
    g_active_scheduler.store(nullptr);
    sigaction(SIGINT, &previous_, nullptr);
  }

 private:
  struct sigaction previous_ = {};
};

}  // namespace

std::string check_setup(const BenchOptions& options) {
  std::string error;
  make_transport_setup(options, error);
  return error;
}

RunResult run_benchmark(const BenchOptions& options) {
  RunResult result;
  if (g_interrupted.load()) {
    result.fatal_error = "interrupted";
    result.interrupted = true;
    return result;
  }
  auto transport = make_transport_setup(options, result.fatal_error);
  if (!transport) {
    return result;
  }
  const int threads = std::max(1, std::min(options.threads, options.connections));
  std::vector<std::unique_ptr<net::io_context>> loops;
  std::vector<std::unique_ptr<RunStats>> stats;
  for (int i = 0; i < threads; ++i) {
    loops.push_back(std::make_unique<net::io_context>(1));
    stats.push_back(std::make_unique<RunStats>());
  }

  SchedulePlan plan;
  plan.start = Clock::now();
  plan.warmup = std::chrono::duration_cast<Clock::duration>(options.warmup);
  if (options.duration) {
    plan.duration = std::chrono::duration_cast<Clock::duration>(*options.duration);
  }
  plan.requests = options.requests;
  plan.rate = options.rate;
  Scheduler scheduler(plan);
  InterruptScope interrupt_scope(scheduler);

  const RunContext context{options, scheduler, *transport};
  auto factory = options.protocol == Protocol::kHttp2 ? make_http2_factory(context)
                                                      : make_http1_factory(context);
  std::vector<ConnectionDriverPtr> drivers;
  std::atomic<bool> crashed{false};
  for (int i = 0; i < options.connections; ++i) {
    const auto t = static_cast<std::size_t>(i % threads);
    drivers.push_back(factory->create(*stats[t], loops[t]->get_executor()));
    net::co_spawn(loops[t]->get_executor(), drivers.back()->run(),
                  [&scheduler, &crashed](std::exception_ptr e) {
                    if (!e) {
                      return;
                    }
                    // A bug, not a network error (those are values): report and end the run.
                    try {
                      std::rethrow_exception(e);
                    } catch (const std::exception& ex) {
                      std::fprintf(stderr, "egress-bench: driver failed: %s\n", ex.what());
                    }
                    crashed.store(true);
                    scheduler.stop();
                  });
  }

  std::vector<std::thread> workers;
  for (int t = 1; t < threads; ++t) {
    workers.emplace_back([&loops, t] { loops[static_cast<std::size_t>(t)]->run(); });
  }
  loops[0]->run();
  for (auto& w : workers) {
    w.join();
  }
  drivers.clear();

  for (const auto& s : stats) {
    result.stats.merge(*s);
  }
  const auto measure_start = scheduler.measure_start();
  result.not_sent = scheduler.not_sent();
  result.stats.latency_lower_bounds += scheduler.record_not_sent(result.stats.latency);
  auto end = std::max(result.stats.last_completion, measure_start);
  if (plan.rate && *plan.rate > 0) {
    // Open loop: n tickets (counted, or due and not sent) were offered over n / rate, the
    // first due at the window's start. Up to the last completion only, the window lacked the
    // last ticket's interval (req/s read n/(n-1) of the rate); a run that fell behind ends at
    // its last completion. Never past the window (--rate 0.1 --duration 2s offers one
    // request in 2 s, not in 10).
    auto offered = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(
        static_cast<double>(result.counted() + result.not_sent) / *plan.rate));
    if (plan.duration) {
      offered = std::min(offered, *plan.duration);
    }
    end = std::max(end, measure_start + offered);
  }
  result.elapsed_s = std::chrono::duration<double>(end - measure_start).count();
  result.warmup_s = std::chrono::duration<double>(measure_start - plan.start).count();
  result.interrupted = g_interrupted.load();
  if (crashed.load()) {
    result.fatal_error = "a driver failed (see above)";
  }
  return result;
}

}  // namespace egress::bench
