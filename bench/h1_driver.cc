// HTTP/1.1 driver: one request in flight per connection, keep-alive reuse, or one request per
// connection with --new-connection. The request is serialized once per run and written as is.

#include <algorithm>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/http.hpp>
#include <cctype>
#include <optional>

#include "bench/driver.h"
#include "bench/scheduler.h"
#include "bench/ticket_wait.h"
#include "bench/transport.h"

namespace egress::bench {
namespace http = boost::beast::http;
namespace {

constexpr std::size_t kReadBuffer = 64 * 1024;  // reads of up to 64 KiB
/// A wait for a ticket at least this long leaves a kept-alive connection idle (a server may
/// close it meanwhile); a closed loop's tickets come in microseconds.
constexpr auto kIdled = std::chrono::milliseconds(1);
/// A response head's limit (Beast's default is 8 KiB; a server's cookies and CSP go past it).
constexpr std::uint32_t kHeaderLimit = 1024 * 1024;

/// A response body that is counted and dropped.
struct DiscardBody {
  using value_type = std::uint64_t;  // bytes seen

  class reader {
   public:
    template <bool isRequest, class Fields>
    reader(http::header<isRequest, Fields>&, value_type& seen) : seen_(seen) {}
    void init(const boost::optional<std::uint64_t>&, error_code& ec) {
      seen_ = 0;
      ec = {};
    }
    template <class ConstBufferSequence>
    std::size_t put(const ConstBufferSequence& buffers, error_code& ec) {
      const std::size_t n = net::buffer_size(buffers);
      seen_ += n;
      ec = {};
      return n;
    }
    void finish(error_code& ec) { ec = {}; }

   private:
    value_type& seen_;
  };
};

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) ==
                  std::tolower(static_cast<unsigned char>(y));
         });
}

/// The request every driver of the run sends, serialized once (head and body in one buffer:
/// one write, and small requests go out in one TLS record).
struct SerializedRequest {
  std::string bytes;
  bool head_method = false;

  net::const_buffer buffer() const { return net::buffer(bytes); }
  std::size_t size() const { return bytes.size(); }
};

SerializedRequest serialize(const BenchOptions& o, bool absolute_form) {
  auto user_has = [&](std::string_view name) {
    return std::any_of(o.headers.begin(), o.headers.end(),
                       [&](const auto& h) { return iequals(h.first, name); });
  };
  const std::string& target = absolute_form ? o.target.absolute_form : o.target.origin_form;
  std::string head = o.method + " " + target + " HTTP/1.1\r\n";
  if (!user_has("host")) {
    head += "Host: " + o.target.authority + "\r\n";
  }
  if (!user_has("user-agent")) {
    head += "User-Agent: egress-bench\r\n";
  }
  if (absolute_form && !o.proxy->authorization.empty()) {
    head += "Proxy-Authorization: " + o.proxy->authorization + "\r\n";
  }
  if ((o.body_size > 0 || o.method == "POST" || o.method == "PUT") && !user_has("content-length")) {
    head += "Content-Length: " + std::to_string(o.body_size) + "\r\n";
  }
  for (const auto& [name, value] : o.headers) {
    head += name + ": " + value + "\r\n";
  }
  head += "\r\n";
  head.append(o.body_size, 'x');
  return {std::move(head), o.method == "HEAD"};
}

struct Exchange {
  std::optional<Failure> failure;
  unsigned status = 0;
  bool keep_alive = false;
  bool received_any = false;  // a byte of an answer came (with a failure: it may be partial)
  std::uint64_t bytes = 0;
  std::uint64_t body_bytes = 0;
};

/// RFC 9110 9.2.2: a request the client may send again when the connection failed before
/// any answer came (RFC 9112 9.3.1).
bool idempotent(std::string_view method) {
  return method == "GET" || method == "HEAD" || method == "OPTIONS" || method == "TRACE" ||
         method == "PUT" || method == "DELETE";
}

/// A response head no request of ours can have: not a status at all, or a switch to a
/// protocol egress-bench does not speak.
std::optional<Failure> unusable_status(unsigned status) {
  if (status < 100) {
    return Failure{ErrorKind::kParse, 0, "status " + std::to_string(status) + " is no status"};
  }
  if (status == 101) {
    return Failure{ErrorKind::kParse, 0, "101 Switching Protocols: no upgrade can be followed"};
  }
  return std::nullopt;
}


class Http1Driver final : public ConnectionDriver {
 public:
  Http1Driver(const RunContext& context, const SerializedRequest& request, RunStats& stats,
              net::any_io_executor executor)
      : context_(context),
        request_(request),
        stats_(stats),
        timer_(std::move(executor)),
        retry_safe_(idempotent(context.options.method)) {}

  net::awaitable<void> run() override;

 private:
  net::awaitable<std::optional<Ticket>> take_ticket() {
    return bench::take_ticket(context_.scheduler, timer_);
  }
  net::awaitable<std::optional<Failure>> open();
  template <class Stream>
  net::awaitable<Exchange> exchange(Stream& stream);
  void record_failure(const Ticket& ticket, const Failure& failure);
  void record(const Ticket& ticket, const Exchange& x);

  const RunContext& context_;
  const SerializedRequest& request_;
  RunStats& stats_;
  net::steady_timer timer_;
  const bool retry_safe_;
  Connection conn_;
  std::uint64_t answered_on_conn_ = 0;  // exchanges on conn_ (0: it is fresh)
  std::string warmup_protocol_;  // conn_'s, opened in the warmup, not listed yet
  beast::flat_buffer buffer_;
};

net::awaitable<void> Http1Driver::run() {
  const bool new_connection = context_.options.new_connection;
  for (;;) {
    if (!new_connection && !conn_.is_open()) {
      if (context_.scheduler.finished(Clock::now())) {
        co_return;
      }
      if (auto failure = co_await open()) {
        // Charge the failure to a ticket, so a refused port cannot spin outside the budget.
        auto ticket = co_await take_ticket();
        if (!ticket) {
          co_return;
        }
        record_failure(*ticket, *failure);
        continue;
      }
    }
    const auto asked = Clock::now();
    auto ticket = co_await take_ticket();
    if (!ticket) {
      conn_.close();  // the run is over: nothing of it (a socket, a deadline's timer) outlives it
      co_return;
    }
    // The kept-alive connection sat idle before this request: it answered one before, or it
    // waited for this ticket's time (open loop).
    const bool idled = answered_on_conn_ > 0 || Clock::now() - asked >= kIdled;
    if (new_connection) {
      if (auto failure = co_await open()) {
        record_failure(*ticket, *failure);
        continue;
      }
    }
    Exchange x = co_await conn_.visit([this](auto& s) { return exchange(s); });
    if (x.failure && !x.received_any && !new_connection && idled && retry_safe_ &&
        (x.failure->kind == ErrorKind::kRead || x.failure->kind == ErrorKind::kWrite)) {
      // The server closed the kept-alive connection while it idled (its keep-alive timeout:
      // in open loop a connection waits for its ticket's time, its first one too): sent
      // again once on a new connection, as clients do; the second outcome is recorded, and
      // the retry counted (a proxy that drops connections must not look clean).
      ++stats_.retries;
      conn_.close();
      if (auto failure = co_await open()) {
        record_failure(*ticket, *failure);
        continue;
      }
      x = co_await conn_.visit([this](auto& s) { return exchange(s); });
    }
    record(*ticket, x);
    ++answered_on_conn_;
    if (new_connection || x.failure || !x.keep_alive) {
      conn_.close();
    }
  }
}

net::awaitable<std::optional<Failure>> Http1Driver::open() {
  const auto started = Clock::now();
  buffer_.clear();
  answered_on_conn_ = 0;
  TransportSetup::Opened opened;
  auto failure = co_await context_.transport.open(conn_, opened);
  if (failure) {
    conn_.close();
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
    if (opened.protocol != "cleartext") {
      ++stats_.tls_handshakes;
      stats_.tls_resumed += opened.resumed ? 1 : 0;
    }
  }
  co_return std::nullopt;
}

template <class Stream>
net::awaitable<Exchange> Http1Driver::exchange(Stream& stream) {
  Exchange x;
  beast::get_lowest_layer(stream).expires_after(context_.options.timeout);
  auto [wec, written] = co_await net::async_write(stream, request_.buffer(), use_nothrow);
  if (wec == beast::error::timeout) {
    x.failure = Failure{ErrorKind::kTimeout, 0, "timed out"};
    co_return x;
  }
  // A write that failed may have met an answer the server sent early and closed on (413 to
  // an upload it will not take): it is read below, and the write error stands without one.
  if (buffer_.capacity() < kReadBuffer) {
    buffer_.reserve(kReadBuffer);  // Beast reads up to capacity − size at a time
  }
  // Interim responses (100 Continue unasked, 103 Early Hints) are skipped: the answer is
  // the final one (Beast's parser stops at a 1xx head, whose answer would then be read as
  // the next request's).
  std::optional<http::response_parser<DiscardBody>> reading;
  error_code rec;
  std::size_t read = 0;
  for (;;) {
    auto& p = reading.emplace();
    p.body_limit(boost::none);
    p.header_limit(kHeaderLimit);
    p.skip(request_.head_method);
    auto [ec, n] = co_await http::async_read(stream, buffer_, p, use_nothrow);
    rec = ec;
    read += n;
    const unsigned status = ec ? 0 : p.get().result_int();
    if (ec || status < 100 || status > 199 || status == 101) {
      break;
    }
  }
  auto& parser = *reading;
  x.received_any = read > 0 || buffer_.size() > 0;
  if (rec && wec) {
    x.failure = Failure{ErrorKind::kWrite, 0, wec.message()};
    co_return x;
  }
  if (rec) {
    if (rec == beast::error::timeout) {
      x.failure = Failure{ErrorKind::kTimeout, 0, "timed out"};
    } else if (rec.category() == http::make_error_code(http::error::end_of_stream).category() &&
               rec != http::error::end_of_stream && rec != http::error::partial_message) {
      x.failure = Failure{ErrorKind::kParse, 0, rec.message()};
    } else {
      x.failure = Failure{ErrorKind::kRead, 0, rec.message()};
    }
    co_return x;
  }
  beast::get_lowest_layer(stream).expires_never();
  x.status = parser.get().result_int();
  if ((x.failure = unusable_status(x.status))) {
    co_return x;
  }
  x.keep_alive = parser.get().keep_alive() && !wec;  // the request may be half written
  x.bytes = read;
  x.body_bytes = parser.get().body();
  co_return x;
}

void Http1Driver::record_failure(const Ticket& ticket, const Failure& failure) {
  stats_.record_failure(ticket.counted, ticket.intended, failure);
}

void Http1Driver::record(const Ticket& ticket, const Exchange& x) {
  if (ticket.counted && !warmup_protocol_.empty()) {
    ++stats_.protocols[warmup_protocol_];
    warmup_protocol_.clear();
  }
  if (x.failure) {
    record_failure(ticket, *x.failure);
    return;
  }
  stats_.record_response(ticket.counted, ticket.intended, x.status, request_.size(), x.bytes, x.body_bytes);
}

class Http1Factory final : public DriverFactory {
 public:
  explicit Http1Factory(const RunContext& context)
      : context_(context),
        request_(serialize(context.options, context.transport.absolute_form())) {}

  ConnectionDriverPtr create(RunStats& stats, net::any_io_executor executor) override {
    return std::make_unique<Http1Driver>(context_, request_, stats, std::move(executor));
  }

 private:
  const RunContext& context_;
  const SerializedRequest request_;
};

}  // namespace

std::unique_ptr<DriverFactory> make_http1_factory(const RunContext& context) {
  return std::make_unique<Http1Factory>(context);
}

}  // namespace egress::bench
