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
#include "bench/transport.h"

namespace egress::bench {
namespace http = boost::beast::http;
namespace {

constexpr std::size_t kReadBuffer = 64 * 1024;  // reads of up to 64 KiB

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
  std::uint64_t bytes = 0;
  std::uint64_t body_bytes = 0;
};


class Http1Driver final : public ConnectionDriver {
 public:
  Http1Driver(const RunContext& context, const SerializedRequest& request, RunStats& stats,
              net::any_io_executor executor)
      : context_(context), request_(request), stats_(stats), timer_(std::move(executor)) {}

  net::awaitable<void> run() override;

 private:
  net::awaitable<std::optional<Ticket>> take_ticket();
  net::awaitable<std::optional<Failure>> open();
  template <class Stream>
  net::awaitable<Exchange> exchange(Stream& stream);
  void record_failure(const Ticket& ticket, const Failure& failure);
  void record(const Ticket& ticket, const Exchange& x);

  const RunContext& context_;
  const SerializedRequest& request_;
  RunStats& stats_;
  net::steady_timer timer_;
  Connection conn_;
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
    auto ticket = co_await take_ticket();
    if (!ticket) {
      conn_.close();  // the run is over: nothing of it (a socket, a deadline's timer) outlives it
      co_return;
    }
    if (new_connection) {
      if (auto failure = co_await open()) {
        record_failure(*ticket, *failure);
        continue;
      }
    }
    const Exchange x = co_await conn_.visit([this](auto& s) { return exchange(s); });
    record(*ticket, x);
    if (new_connection || x.failure || !x.keep_alive) {
      conn_.close();
    }
  }
}

net::awaitable<std::optional<Ticket>> Http1Driver::take_ticket() {
  auto ticket = context_.scheduler.next(Clock::now());
  if (ticket && ticket->intended > Clock::now()) {
    timer_.expires_at(ticket->intended);
    co_await timer_.async_wait(use_nothrow);
  }
  co_return ticket;
}

net::awaitable<std::optional<Failure>> Http1Driver::open() {
  const auto started = Clock::now();
  buffer_.clear();
  TransportSetup::Opened opened;
  auto failure = co_await context_.transport.open(conn_, opened);
  if (failure) {
    conn_.close();
    co_return failure;
  }
  if (started >= context_.scheduler.measure_start()) {  // a warmup connection is not counted
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
  if (wec) {
    x.failure = wec == beast::error::timeout ? Failure{ErrorKind::kTimeout, 0, "timed out"}
                                             : Failure{ErrorKind::kWrite, 0, wec.message()};
    co_return x;
  }
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
  x.keep_alive = parser.get().keep_alive();
  x.bytes = read;
  x.body_bytes = parser.get().body();
  co_return x;
}

void Http1Driver::record_failure(const Ticket& ticket, const Failure& failure) {
  stats_.record_failure(ticket.counted, failure.key(), failure.message);
}

void Http1Driver::record(const Ticket& ticket, const Exchange& x) {
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
