#include "bench/scheduler.h"

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
  const double ns = static_cast<double>(index) * 1e9 / *plan_.rate;
  return plan_.start + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::nanoseconds(static_cast<std::int64_t>(std::llround(ns))));
}

std::optional<Ticket> Scheduler::next(Clock::time_point now) {
  if (stopped_.load(std::memory_order_relaxed)) {
    return std::nullopt;
  }
  if (plan_.rate) {
    const std::uint64_t i = issued_.fetch_add(1, std::memory_order_relaxed);
    const Clock::time_point due = intended_at(i);
    if (i < warmup_tickets_) {
      return Ticket{due, false};
    }
    if (plan_.requests && i - warmup_tickets_ >= *plan_.requests) {
      return std::nullopt;
    }
    if (measure_end_ && due >= *measure_end_) {
      return std::nullopt;
    }
    return Ticket{due, true};
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
    return measure_end_ && intended_at(i) >= *measure_end_;
  }
  if (measure_end_ && now >= *measure_end_) {
    return true;
  }
  return plan_.requests && now >= warmup_end_ &&
         counted_.load(std::memory_order_relaxed) >= *plan_.requests;
}

}  // namespace egress::bench
