// HTTP/2 driver, built on the proxy's HTTP/2 client (proxy/h2_client.h; issue 5: no second
// HTTP/2 client). Per connection slot: TCP (+ CONNECT) + TLS with ALPN "h2", one
// H2ClientSession, and --streams workers on it, each keeping one stream in flight (so up to M
// concurrent streams per connection). With --new-connection every request gets its own
// connection and session (one stream each).

#include <algorithm>
#include <charconv>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <deque>
#include <exception>
#include <optional>

#include "bench/driver.h"
#include "bench/scheduler.h"
#include "bench/ticket_wait.h"
#include "bench/transport.h"
#include "policy/request_head.h"
#include "proxy/h2_client.h"

namespace egress::bench {
namespace {

using proxy::H2ClientResponse;
using proxy::H2ClientSession;
using proxy::H2ClientStream;

/// Request bodies go out in slices of this size, each bounded by the exchange's deadline.
constexpr std::size_t kBodySlice = 64 * 1024;

/// The request every stream of the run sends, built once.
struct H2Request {
  policy::RequestHead head;
  std::string body;
  bool end_stream = true;
  std::optional<std::uint64_t> content_length;  // sent by open(), not from the head's fields
  std::uint64_t size = 0;  // header field bytes (name + value, uncompressed) + body
};

H2Request make_request(const BenchOptions& o) {
  H2Request r;
  r.head.method = o.method;
  r.head.scheme = "https";
  r.head.authority = o.target.authority;
  r.head.path = o.target.origin_form;
  bool has_user_agent = false;
  bool has_content_length = false;
  for (const auto& [name, value] : o.headers) {
    std::string lower = policy::ascii_lower(name);
    if (lower == "host") {
      r.head.authority = value;  // -H Host replaces :authority
      continue;
    }
    has_user_agent = has_user_agent || lower == "user-agent";
    if (lower == "content-length") {
      has_content_length = true;
      std::uint64_t n = 0;
      auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), n);
      if (ec == std::errc() && end == value.data() + value.size()) {
        r.content_length = n;
      }
      r.size += lower.size() + value.size();
      continue;
    }
    r.head.headers.push_back({std::move(lower), value});
  }
  if (!has_user_agent) {
    r.head.headers.insert(r.head.headers.begin(), {"user-agent", "egress-bench"});
  }
  if ((o.body_size > 0 || o.method == "POST" || o.method == "PUT") && !has_content_length) {
    r.content_length = o.body_size;
    r.size += 14 + std::to_string(o.body_size).size();
  }
  r.body.assign(o.body_size, 'x');
  r.end_stream = o.body_size == 0;
  r.size += 7 + r.head.method.size() + 7 + r.head.scheme.size() + 10 + r.head.authority.size() +
           5 + r.head.path.size() + r.body.size();
  for (const auto& h : r.head.headers) {
    r.size += h.name.size() + h.value.size();
  }
  return r;
}

struct Exchange {
  std::optional<Failure> failure;
  unsigned status = 0;
  std::uint64_t bytes = 0;
  std::uint64_t body_bytes = 0;
};


class Http2Driver final : public ConnectionDriver {
 public:
  Http2Driver(const RunContext& context, const H2Request& request, RunStats& stats,
              net::any_io_executor executor)
      : context_(context),
        request_(request),
        stats_(stats),
        executor_(executor),
        timer_(executor),
        latch_(executor) {}

  net::awaitable<void> run() override;

 private:
  net::awaitable<std::optional<Ticket>> take_ticket(net::steady_timer& timer) {
    return bench::take_ticket(context_.scheduler, timer);
  }
  net::awaitable<std::optional<Failure>> open();
  net::awaitable<void> close();
  net::awaitable<void> worker(std::shared_ptr<H2ClientSession> session,
                              std::optional<Ticket> ticket);
  net::awaitable<Exchange> exchange(H2ClientSession& session, H2ClientStream& stream);
  void record_failure(const Ticket& ticket, const Failure& failure);
  void record(const Ticket& ticket, const Exchange& x);

  const RunContext& context_;
  const H2Request& request_;
  RunStats& stats_;
  net::any_io_executor executor_;
  net::steady_timer timer_;  // the driver's own open-loop waits
  net::steady_timer latch_;  // wakes run() when the last worker ends
  std::shared_ptr<H2ClientSession> session_;
  std::string warmup_protocol_;  // the session's, opened in the warmup, not listed yet
  SSL* ssl_ = nullptr;  // the session's TLS object, to keep its ticket resumable on close
  std::deque<Ticket> pending_;  // taken but not sent: the session stopped taking streams
  int running_ = 0;
  std::exception_ptr worker_error_;
};

net::awaitable<void> Http2Driver::run() {
  const bool new_connection = context_.options.new_connection;
  const int streams = new_connection ? 1 : std::max(1, context_.options.streams);
  auto next_ticket = [this]() -> net::awaitable<std::optional<Ticket>> {
    if (!pending_.empty()) {
      Ticket t = pending_.front();
      pending_.pop_front();
      co_return t;
    }
    co_return co_await take_ticket(timer_);
  };
  for (;;) {
    if (context_.scheduler.stopped()) {
      for (const Ticket& t : pending_) {
        context_.scheduler.give_back(t);  // Ctrl-C: not sent on a new connection
      }
      pending_.clear();
    }
    if (pending_.empty() && context_.scheduler.finished(Clock::now())) {
      co_return;
    }
    std::optional<Ticket> first;
    if (new_connection) {
      first = co_await next_ticket();
      if (!first) {
        co_return;
      }
    }
    if (auto failure = co_await open()) {
      // Charge the failure to a ticket, so a refused port cannot spin outside the budget.
      if (!first) {
        first = co_await next_ticket();
      }
      if (!first) {
        co_return;
      }
      record_failure(*first, *failure);
      continue;
    }
    if (new_connection) {
      auto stream = session_->open(request_.head, request_.head.scheme, request_.head.authority,
                                   request_.end_stream, request_.content_length);
      if (!stream) {
        record_failure(*first, {ErrorKind::kWrite, 0, "cannot open an HTTP/2 stream"});
      } else {
        const Exchange x = co_await exchange(*session_, *stream);
        stream.reset();
        record(*first, x);
      }
      co_await close();
      continue;
    }
    // Multiplexed: `streams` workers share the session; pending tickets (left over when the
    // previous session stopped taking streams, e.g. GOAWAY) go first.
    running_ = streams;
    for (int i = 0; i < streams; ++i) {
      std::optional<Ticket> t;
      if (!pending_.empty()) {
        t = pending_.front();
        pending_.pop_front();
      }
      net::co_spawn(executor_, worker(session_, t), [this](std::exception_ptr e) {
        if (e && !worker_error_) {
          worker_error_ = e;
        }
        if (--running_ == 0) {
          latch_.cancel();
        }
      });
    }
    while (running_ > 0) {
      latch_.expires_at(Clock::time_point::max());
      co_await latch_.async_wait(use_nothrow);
    }
    co_await close();
    if (worker_error_) {
      std::rethrow_exception(worker_error_);
    }
  }
}

net::awaitable<void> Http2Driver::worker(std::shared_ptr<H2ClientSession> session,
                                         std::optional<Ticket> ticket) {
  net::steady_timer timer(executor_);
  bool retried = ticket.has_value();  // a leftover ticket gets one more session, not more
  for (;;) {
    if (!ticket) {
      ticket = co_await take_ticket(timer);
      if (!ticket) {
        co_return;
      }
      retried = false;
    }
    auto stream = session->open(request_.head, request_.head.scheme, request_.head.authority,
                                 request_.end_stream, request_.content_length);
    if (!stream) {
      if (retried) {
        record_failure(*ticket, {ErrorKind::kWrite, 0, "cannot open an HTTP/2 stream"});
      } else {
        pending_.push_back(*ticket);  // the next session sends it
      }
      co_return;
    }
    const Exchange x = co_await exchange(*session, *stream);
    if (x.failure && stream->refused() && !retried) {
      // Refused unprocessed (RST_STREAM REFUSED_STREAM, or above the last stream id of a
      // GOAWAY: nginx sends one after keepalive_requests streams). RFC 9113 8.7: sent again,
      // once, as a client does; not an error of the server's. On this session while it still
      // takes streams (a server refusing one stream, at a moment it had too many); else the
      // next session sends it (parked until then, the ticket's latency would span the run).
      stream.reset();
      retried = true;
      if (session->has_capacity()) {
        continue;
      }
      pending_.push_back(*ticket);
      co_return;
    }
    stream.reset();
    record(*ticket, x);
    ticket.reset();
  }
}

net::awaitable<std::optional<Failure>> Http2Driver::open() {
  const auto started = Clock::now();
  Connection conn;
  TransportSetup::Opened opened;
  if (auto failure = co_await context_.transport.open(conn, opened)) {
    conn.close();
    failure->waited_us = micros_since(started, Clock::now());
    co_return failure;
  }
  warmup_protocol_.clear();
  if (started < context_.scheduler.measure_start()) {
    // A warmup connection is not counted; its protocol is listed once it carries a counted
    // request (a keep-alive run's warmup opens every connection it measures on).
    warmup_protocol_ = opened.protocol;
  } else {
    stats_.connect_latency.record(micros_since(started, Clock::now()));
    ++stats_.connections_opened;
    ++stats_.protocols[opened.protocol];
    ++stats_.tls_handshakes;
    stats_.tls_resumed += opened.resumed ? 1 : 0;
  }
  if (opened.protocol != "h2") {
    conn.close();
    co_return Failure{ErrorKind::kAlpn, 0,
                      "the server selected " +
                          (opened.protocol == "none" ? std::string("no protocol")
                                                     : "'" + opened.protocol + "'") +
                          " in ALPN, not h2"};
  }
  auto tls = conn.release_tls();
  ssl_ = tls->native_handle();
  proxy::H2ClientOptions ho;
  ho.io_timeout = std::max(std::chrono::milliseconds(1),
                           std::chrono::duration_cast<std::chrono::milliseconds>(
                               context_.options.timeout));
  ho.idle_timeout = std::max(ho.idle_timeout, ho.io_timeout);
  session_ = H2ClientSession::start(std::move(tls), ho);
  co_return std::nullopt;
}

net::awaitable<void> Http2Driver::close() {
  if (!session_) {
    co_return;
  }
  // GOAWAY, then wait (bounded) until the writer has stopped, so the TLS object can be marked
  // shut down: OpenSSL would otherwise flag the session ticket not resumable when it is freed.
  session_->shutdown();
  const auto deadline = Clock::now() + context_.options.timeout;
  for (int spins = 0; session_->alive() && Clock::now() < deadline; ++spins) {
    if (spins < 64) {
      co_await net::post(executor_, net::use_awaitable);
    } else {
      timer_.expires_after(std::chrono::milliseconds(1));
      co_await timer_.async_wait(use_nothrow);
    }
  }
  if (!session_->alive() && ssl_ != nullptr) {
    SSL_set_shutdown(ssl_, SSL_SENT_SHUTDOWN | SSL_RECEIVED_SHUTDOWN);
  }
  ssl_ = nullptr;
  session_.reset();
}

net::awaitable<Exchange> Http2Driver::exchange(H2ClientSession& session, H2ClientStream& stream) {
  Exchange x;
  // --timeout bounds the whole exchange, as for HTTP/1.1: each wait gets what is left of it
  // (a server dripping a byte per wait would otherwise hold the stream, and the run, open).
  const auto deadline = Clock::now() + context_.options.timeout;
  auto left = [&] {
    return std::max(std::chrono::milliseconds(1),
                    std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()));
  };
  // Why a wait failed, by what the stream and the session say; a wait that ran out with both
  // still open is the timeout.
  auto failure = [&](ErrorKind kind, std::string_view what) -> Failure {
    if (stream.error_code() != 0) {
      return {kind, 0,
              "stream reset (error " + std::to_string(stream.error_code()) + ") " +
                  std::string(what)};
    }
    if (!session.alive()) {
      return {kind, 0, "connection closed " + std::string(what)};
    }
    if (stream.responded()) {
      return {kind, 0, "stream closed " + std::string(what)};
    }
    return {ErrorKind::kTimeout, 0, "timed out " + std::string(what)};
  };
  // The body in slices, each write's waits bounded by what is left of the deadline (a server
  // granting window a little at a time cannot stretch the exchange past it).
  H2ClientResponse response;
  bool head_early = false;
  for (std::size_t at = 0; !request_.end_stream && at < request_.body.size();) {
    const std::size_t n = std::min(kBodySlice, request_.body.size() - at);
    const bool last = at + n == request_.body.size();
    const std::string_view slice = std::string_view(request_.body).substr(at, n);
    const auto wait = left();
    const bool written = co_await stream.write(slice, last, nullptr, wait);
    if (written) {
      at += n;
      if (Clock::now() >= deadline && !last) {
        x.failure = Failure{ErrorKind::kTimeout, 0, "timed out while sending the request body"};
        co_return x;
      }
      continue;
    }
    // A server may answer before it has read the whole body (413) and end the stream: that
    // answer is read, not the write's failure recorded.
    // (No co_await inside && : GCC 12 miscompiles it.)
    if (stream.responded()) {
      const auto now = std::chrono::milliseconds(1);
      head_early = co_await stream.response(response, now);
      if (head_early) {
        break;
      }
    }
    x.failure = failure(ErrorKind::kWrite, "while sending the request body");
    co_return x;
  }
  if (!head_early && !co_await stream.response(response, left())) {
    x.failure = failure(ErrorKind::kRead, "before the response head");
    co_return x;
  }
  x.status = static_cast<unsigned>(response.status);
  x.bytes = 7 + 3;  // ":status" and its value
  for (const auto& h : response.headers) {
    x.bytes += h.name.size() + h.value.size();
  }
  for (;;) {
    auto piece = co_await stream.read(left());
    if (!piece.ok) {
      x.failure = failure(ErrorKind::kRead, "during the response body");
      co_return x;
    }
    if (!piece.eof && Clock::now() >= deadline) {
      x.failure = Failure{ErrorKind::kTimeout, 0, "timed out during the response body"};
      co_return x;
    }
    x.body_bytes += piece.data.size();  // the last bytes may come with eof
    if (piece.eof) {
      break;
    }
  }
  x.bytes += x.body_bytes;
  co_return x;
}

void Http2Driver::record_failure(const Ticket& ticket, const Failure& failure) {
  stats_.record_failure(ticket.counted, ticket.intended, failure);
}

void Http2Driver::record(const Ticket& ticket, const Exchange& x) {
  if (ticket.counted && !warmup_protocol_.empty()) {
    ++stats_.protocols[warmup_protocol_];
    warmup_protocol_.clear();
  }
  if (x.failure) {
    record_failure(ticket, *x.failure);
    return;
  }
  stats_.record_response(ticket.counted, ticket.intended, x.status, request_.size, x.bytes, x.body_bytes);
}

class Http2Factory final : public DriverFactory {
 public:
  explicit Http2Factory(const RunContext& context)
      : context_(context), request_(make_request(context.options)) {}

  ConnectionDriverPtr create(RunStats& stats, net::any_io_executor executor) override {
    return std::make_unique<Http2Driver>(context_, request_, stats, std::move(executor));
  }

 private:
  const RunContext& context_;
  const H2Request request_;
};

}  // namespace

std::unique_ptr<DriverFactory> make_http2_factory(const RunContext& context) {
  return std::make_unique<Http2Factory>(context);
}

}  // namespace egress::bench
