#pragma once
// Hands out request tickets to every driver on every thread (lock-free). Closed loop: a ticket is
// available at once while the budget lasts. Open loop (--rate): ticket i is due at
// start + i/rate whoever takes it, and latency is measured from that intended time, so a stalled
// server shows up as latency instead of silently lowering the offered load (coordinated omission).
// --duration bounds the wall clock in both loops: once the window's end has passed no ticket is
// handed out, however late the client is; in open loop the tickets that were due in the window
// but never sent are counted (not_sent()), not sent late.

#include <atomic>
#include <cstdint>
#include <optional>

#include "bench/stats.h"

namespace egress::bench {

struct Ticket {
  Clock::time_point intended;  // when the request should be sent (now, in closed loop)
  bool counted = true;         // false during warmup
};

struct SchedulePlan {
  Clock::time_point start;
  Clock::duration warmup{0};
  std::optional<Clock::duration> duration;  // measured time after warmup
  std::optional<std::uint64_t> requests;    // counted tickets, exact
  std::optional<double> rate;               // requests/s over all drivers
};

class Scheduler {
 public:
  explicit Scheduler(const SchedulePlan& plan);

  /// The next ticket, or nullopt when the run is over (budget spent, time up, or stop()).
  /// Thread-safe. In open loop the ticket may be due in the future: wait until `intended`.
  std::optional<Ticket> next(Clock::time_point now);
  /// True once next() can only return nullopt (cheap; used to avoid opening useless connections).
  bool finished(Clock::time_point now) const;
  /// Ends the run early (e.g. SIGINT). Thread-safe and async-signal-safe.
  void stop();
  bool stopped() const { return stopped_.load(std::memory_order_relaxed); }
  /// A ticket taken but not sent because stop() came while it waited for its time: not sent
  /// (not_sent() counts it if it was due before the stop).
  void give_back(const Ticket& ticket);

  /// Open loop with --duration, after the run: counted tickets due in the measured window (up
  /// to stop(), if it came first) that were never handed out, because the client was behind
  /// (every connection busy) when the window ended. 0 in closed loop or without --duration.
  std::uint64_t not_sent() const;
  /// Records the not_sent() tickets in `h` as lower bounds of their latency: each waited at
  /// least from its due time to the window's end (or the stop). They are taken to be the
  /// last ones due, the smallest bounds. Returns how many were recorded.
  std::uint64_t record_not_sent(LatencyHistogram& h) const;

  /// Start of the measured interval.
  Clock::time_point measure_start() const { return measure_start_; }

 private:
  Clock::time_point intended_at(std::uint64_t index) const;
  /// Open loop with --duration: the window's end, or the stop if it came first.
  Clock::time_point window_end() const;
  /// Open loop: how many tickets are due before `t` (the first index due at or after it).
  std::uint64_t due_before(Clock::time_point t) const;

  SchedulePlan plan_;
  Clock::time_point warmup_end_;
  Clock::time_point measure_start_;
  std::optional<Clock::time_point> measure_end_;
  std::uint64_t warmup_tickets_ = 0;       // open loop: tickets due before warmup_end_
  std::atomic<std::uint64_t> issued_{0};   // open loop: every ticket
  std::atomic<std::uint64_t> counted_{0};  // closed loop: counted tickets
  std::atomic<std::uint64_t> sent_{0};     // open loop: counted tickets handed out
  std::atomic<bool> stopped_{false};
  std::atomic<Clock::rep> stopped_at_{0};  // Clock::now() at stop(), since the clock's epoch
};

}  // namespace egress::bench
