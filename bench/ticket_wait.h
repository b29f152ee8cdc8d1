#pragma once
// Taking a ticket and waiting for its time, shared by the drivers. Asio: include only from
// driver implementations.

#include <algorithm>
#include <boost/asio/as_tuple.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <chrono>
#include <optional>

#include "bench/scheduler.h"

namespace egress::bench {

/// How often a driver waiting for an open-loop ticket's time looks whether the run was
/// stopped: SIGINT's handler can only set a flag, so a wait of seconds (a low --rate) would
/// otherwise send its request after Ctrl-C.
/// Each look is a wake-up per waiting connection: at 200 ms, 1000 connections at a low rate
/// cost 5000 wake-ups a second on a machine the proxy under test shares.
inline constexpr std::chrono::milliseconds kStopPoll{200};

/// The next ticket, once it is due; nullopt when the run is over, or stopped while the ticket
/// waited (it is given back, not sent).
inline boost::asio::awaitable<std::optional<Ticket>> take_ticket(Scheduler& scheduler,
                                                                 boost::asio::steady_timer& timer) {
  auto ticket = scheduler.next(Clock::now());
  while (ticket && ticket->intended > Clock::now()) {
    if (scheduler.stopped()) {
      scheduler.give_back(*ticket);
      co_return std::nullopt;
    }
    timer.expires_at(std::min(ticket->intended, Clock::now() + kStopPoll));
    co_await timer.async_wait(boost::asio::as_tuple(boost::asio::use_awaitable));
  }
  co_return ticket;
}

}  // namespace egress::bench
