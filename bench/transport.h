#pragma once
// Opening one benchmark connection: TCP to the first hop (TCP_NODELAY), CONNECT through the
// proxy for https targets, then TLS with SNI, hostname verification, ALPN and client-side session
// resumption, on egressd's TLS stream (proxy/tls_socket.h). Heavy (Beast, Asio, OpenSSL):
// include only from driver implementations.

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/ssl.hpp>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "bench/options.h"
#include "proxy/tls_socket.h"
#include "bench/stats.h"

namespace egress::bench {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace ssl = boost::asio::ssl;
using tcp = boost::asio::ip::tcp;
using boost::system::error_code;

/// Expected errors are values (STYLE.md 10).
inline constexpr auto use_nothrow = net::as_tuple(net::use_awaitable);

using TcpStream = beast::tcp_stream;
/// The proxy's TLS stream (proxy/tls_socket.h): the HTTP/2 driver hands it to the proxy's client.
using TlsStream = proxy::TlsSocket;

/// One open (or closed) benchmark connection: cleartext or TLS.
class Connection {
 public:
  bool is_open() const { return tcp_.has_value() || tls_.has_value(); }
  void close();
  /// Calls f(TcpStream&) or f(TlsStream&); both calls must return the same type.
  template <class F>
  auto visit(F&& f) {
    return tls_ ? f(*tls_) : f(*tcp_);
  }
  /// Moves the TLS stream out (for a session that owns it, e.g. HTTP/2); the connection is
  /// closed afterwards. nullptr when the connection is not TLS.
  std::unique_ptr<TlsStream> release_tls();

 private:
  friend class TransportSetup;
  std::optional<TcpStream> tcp_;
  std::optional<TlsStream> tls_;
};

/// Connection parameters of one run; immutable after creation except the TLS session slot,
/// which is mutex-protected. Shared by every driver on every thread.
class TransportSetup {
 public:
  struct Opened {
    std::string protocol;  // ALPN result ("http/1.1", "h2"), "none" (TLS, no ALPN), "cleartext"
    bool resumed = false;
  };

  TransportSetup(const BenchOptions& options, std::vector<tcp::endpoint> endpoints);
  ~TransportSetup();
  TransportSetup(const TransportSetup&) = delete;
  TransportSetup& operator=(const TransportSetup&) = delete;

  /// Loads the trust anchors and sets ALPN. Empty string on success.
  std::string init_tls(const std::vector<std::string>& alpn);

  /// Opens `conn` (closed on entry) on the calling coroutine's executor. Bounded by --timeout.
  net::awaitable<std::optional<Failure>> open(Connection& conn, Opened& opened) const;

  /// Whether requests use absolute-form (http:// target through a proxy).
  bool absolute_form() const { return options_.proxy && !options_.target.tls; }

 private:
  static int on_new_session(SSL* ssl, SSL_SESSION* session);
  void store_session(SSL_SESSION* session) const;
  void apply_session(SSL* ssl) const;

  const BenchOptions& options_;
  std::vector<tcp::endpoint> endpoints_;
  std::string connect_request_;  // CONNECT head, when tunnelling
  mutable ssl::context ctx_{ssl::context::tls_client};
  mutable std::mutex session_mutex_;
  mutable SSL_SESSION* session_ = nullptr;  // latest ticket from the target, owned
};

}  // namespace egress::bench
