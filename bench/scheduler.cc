#include "bench/scheduler.h"

#include <algorithm>
#include <cmath>

namespace egress::bench {

Scheduler::Scheduler(const SchedulePlan& plan) : plan_(plan) {
  warmup_end_ = plan_.start + plan_.warmup;
  if (plan_.rate) {
    const double warmup_s = std::chrono::duration<double>(plan_.warmup).count();
    warmup_tickets_ = static_cast<std::uint64_t>(std::ceil(warmup_s * *plan_.rate - 1e-9));
    measure_start_ = intended_at(warmup_tickets_);
  } else {
    measure_start_ = warmup_end_;
  }
  if (plan_.duration) {
    measure_end_ = measure_start_ + *plan_.duration;
  }
}

Clock::time_point Scheduler::intended_at(std::uint64_t index) const {
  // Saturated far beyond any run (--rate is at least 0.001/s, --duration at most 1e18 ns):
  // llround of a double past int64 is undefined.
  const double ns = std::min(static_cast<double>(index) * 1e9 / *plan_.rate, 4e18);
  return plan_.start + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::nanoseconds(static_cast<std::int64_t>(std::llround(ns))));
}

std::uint64_t Scheduler::due_before(Clock::time_point t) const {
  if (t <= plan_.start) {
    return 0;
  }
  const double s = std::chrono::duration<double>(t - plan_.start).count();
  auto n = static_cast<std::uint64_t>(std::max(0.0, std::ceil(s * *plan_.rate)));
  // The estimate is off by at most one either way (rounding); settle it on intended_at().
  while (n > 0 && intended_at(n - 1) >= t) {
    --n;
  }
  while (intended_at(n) < t) {
    ++n;
  }
  return n;
}

void Scheduler::stop() {
  // clock_gettime and lock-free atomics only: callable from a signal handler.
  Clock::rep expected = 0;
  stopped_at_.compare_exchange_strong(expected, Clock::now().time_since_epoch().count(),
                                      std::memory_order_relaxed);
  stopped_.store(true, std::memory_order_relaxed);
}

void Scheduler::give_back(const Ticket& ticket) {
  if (plan_.rate && ticket.counted) {
    sent_.fetch_sub(1, std::memory_order_relaxed);
  }
}

std::optional<Ticket> Scheduler::next(Clock::time_point now) {
  if (stopped_.load(std::memory_order_relaxed)) {
    return std::nullopt;
  }
  if (plan_.rate) {
    for (;;) {
      const std::uint64_t i = issued_.fetch_add(1, std::memory_order_relaxed);
      if (i < warmup_tickets_) {
        if (!measure_end_ || now < measure_start_) {
          return Ticket{intended_at(i), false};
        }
        // The warmup is over on the clock but the client has not sent all of it (it fell
        // behind): the rest is dropped, so the measured window is not spent on warmup.
        std::uint64_t seen = i + 1;
        while (seen < warmup_tickets_ &&
               !issued_.compare_exchange_weak(seen, warmup_tickets_, std::memory_order_relaxed)) {
        }
        continue;
      }
      if (plan_.requests && i - warmup_tickets_ >= *plan_.requests) {
        return std::nullopt;
      }
      const Clock::time_point due = intended_at(i);
      // Past the window's end on the clock, a ticket still due in it is not sent late (the
      // run would last as long as the client is behind): not_sent() counts it.
      if (measure_end_ && (due >= *measure_end_ || now >= *measure_end_)) {
        return std::nullopt;
      }
      sent_.fetch_add(1, std::memory_order_relaxed);
      return Ticket{due, true};
    }
  }
  if (now < warmup_end_) {
    return Ticket{now, false};
  }
  if (measure_end_ && now >= *measure_end_) {
    return std::nullopt;
  }
  if (plan_.requests && counted_.fetch_add(1, std::memory_order_relaxed) >= *plan_.requests) {
    return std::nullopt;
  }
  return Ticket{now, true};
}

bool Scheduler::finished(Clock::time_point now) const {
  if (stopped_.load(std::memory_order_relaxed)) {
    return true;
  }
  if (plan_.rate) {
    const std::uint64_t i = issued_.load(std::memory_order_relaxed);
    if (plan_.requests && i >= warmup_tickets_ && i - warmup_tickets_ >= *plan_.requests) {
      return true;
    }
    return measure_end_ && (intended_at(i) >= *measure_end_ || now >= *measure_end_);
  }
  if (measure_end_ && now >= *measure_end_) {
    return true;
  }
  return plan_.requests && now >= warmup_end_ &&
         counted_.load(std::memory_order_relaxed) >= *plan_.requests;
}

Clock::time_point Scheduler::window_end() const {
  Clock::time_point end = *measure_end_;
  if (stopped_.load(std::memory_order_relaxed)) {
    const Clock::time_point at{Clock::duration(stopped_at_.load(std::memory_order_relaxed))};
    end = std::min(end, at);
  }
  return end;
}

std::uint64_t Scheduler::not_sent() const {
  if (!plan_.rate || !measure_end_) {
    return 0;
  }
  const Clock::time_point end = window_end();
  const std::uint64_t all = due_before(end);
  std::uint64_t due = all > warmup_tickets_ ? all - warmup_tickets_ : 0;
  if (plan_.requests) {
    due = std::min(due, *plan_.requests);
  }
  const std::uint64_t sent = sent_.load(std::memory_order_relaxed);
  return due > sent ? due - sent : 0;
}

std::uint64_t Scheduler::record_not_sent(LatencyHistogram& h) const {
  const std::uint64_t n = not_sent();
  if (n == 0) {
    return 0;
  }
  const Clock::time_point end = window_end();
  // One past the last ticket due in the window (and in --requests' budget: none beyond it
  // existed).
  std::uint64_t last = due_before(end);
  if (plan_.requests) {
    last = std::min(last, warmup_tickets_ + *plan_.requests);
  }
  const std::uint64_t first = last - n;
  // In groups of at most n / 65536 tickets (a run far behind a high rate has millions), each
  // recorded at its smallest bound, its latest ticket's: still a lower bound for every one.
  const std::uint64_t step = std::max<std::uint64_t>(1, (n + 65535) / 65536);
  for (std::uint64_t i = first; i < last; i += step) {
    const std::uint64_t count = std::min(step, last - i);
    h.record(micros_since(intended_at(i + count - 1), end), count);
  }
  return n;
}

}  // namespace egress::bench
