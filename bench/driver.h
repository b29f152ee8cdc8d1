#pragma once
// The per-connection protocol seam. A run owns one DriverFactory (HTTP/1.1 today; HTTP/2 later,
// built on the proxy's HTTP/2 client) which creates one ConnectionDriver per --connections slot.
// Drivers share the run's Scheduler and TransportSetup and write into their thread's RunStats.
// Light header: no Beast, no Asio SSL.

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/awaitable.hpp>
#include <memory>
#include <string>

namespace egress::bench {

struct BenchOptions;
struct RunStats;
class Scheduler;
class TransportSetup;

/// Everything the drivers of one run share. Each member is read-only or thread-safe, and
/// outlives every driver.
struct RunContext {
  const BenchOptions& options;
  Scheduler& scheduler;
  const TransportSetup& transport;
};

/// One load-generating connection slot: opens its connection (TCP, proxy CONNECT, TLS) through
/// the TransportSetup, takes tickets from the Scheduler, sends requests and records every
/// outcome in its thread's RunStats. An HTTP/1.1 driver has one request in flight; an HTTP/2
/// driver would multiplex --streams tickets over one session.
class ConnectionDriver {
 public:
  virtual ~ConnectionDriver() = default;
  /// Runs until the scheduler has no ticket left. Must be co_spawned on the executor given to
  /// DriverFactory::create(); the driver must outlive the coroutine. Network and peer errors
  /// are recorded, never thrown.
  virtual boost::asio::awaitable<void> run() = 0;
};
using ConnectionDriverPtr = std::unique_ptr<ConnectionDriver>;

/// Per-run, per-protocol state shared by its drivers (e.g. the serialized request).
class DriverFactory {
 public:
  virtual ~DriverFactory() = default;
  /// `stats` belongs to the single thread running `executor` and outlives the driver.
  virtual ConnectionDriverPtr create(RunStats& stats, boost::asio::any_io_executor executor) = 0;
};

/// HTTP/1.1 with keep-alive (or one request per connection with --new-connection).
std::unique_ptr<DriverFactory> make_http1_factory(const RunContext& context);

/// HTTP/2 (TLS, ALPN h2) on the proxy's HTTP/2 client: --streams concurrent streams per
/// connection, or one stream per connection with --new-connection.
std::unique_ptr<DriverFactory> make_http2_factory(const RunContext& context);

/// Resolves the first hop (proxy or target) and builds the TLS client context. Blocking; call
/// once per run before any driver starts. nullptr with `error` set when the run cannot start.
std::shared_ptr<const TransportSetup> make_transport_setup(const BenchOptions& options,
                                                           std::string& error);

}  // namespace egress::bench
