#include "bench/transport.h"

#include <openssl/ssl.h>
#include <openssl/x509v3.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/http.hpp>

#include "bench/driver.h"
#include "tls/trust_store.h"

namespace egress::bench {
namespace http = boost::beast::http;
namespace {

int session_slot_index() {
  static const int index = SSL_CTX_get_ex_new_index(0, nullptr, nullptr, nullptr, nullptr);
  return index;
}

bool is_ip_literal(const std::string& host) {
  error_code ec;
  net::ip::make_address(host, ec);
  return !ec;
}

Failure io_failure(const error_code& ec, ErrorKind kind) {
  if (ec == beast::error::timeout) {
    return {ErrorKind::kTimeout, 0, "timed out"};
  }
  return {kind, 0, ec.message()};
}

}  // namespace

void Connection::close() {
  error_code ignored;
  if (tls_) {
    // No close_notify on the wire (nghttpx does the same): a round trip per --new-connection
    // request that the load being measured does not need. Marking the shutdown as done keeps
    // OpenSSL from flagging the session not resumable when the SSL object is freed.
    SSL_set_shutdown(tls_->native_handle(), SSL_SENT_SHUTDOWN | SSL_RECEIVED_SHUTDOWN);
    tls_->socket().close(ignored);
    tls_.reset();
  }
  if (tcp_) {
    tcp_->socket().close(ignored);
    tcp_.reset();
  }
}

std::unique_ptr<TlsStream> Connection::release_tls() {
  if (!tls_) {
    return nullptr;
  }
  auto out = std::make_unique<TlsStream>(std::move(*tls_));
  tls_.reset();
  return out;
}

TransportSetup::TransportSetup(const BenchOptions& options, std::vector<tcp::endpoint> endpoints)
    : options_(options), endpoints_(std::move(endpoints)) {
  if (options_.proxy && options_.target.tls) {
    connect_request_ = "CONNECT " + options_.target.connect_authority +
                       " HTTP/1.1\r\nHost: " + options_.target.connect_authority + "\r\n";
    if (!options_.proxy->authorization.empty()) {
      connect_request_ += "Proxy-Authorization: " + options_.proxy->authorization + "\r\n";
    }
    connect_request_ += "\r\n";
  }
}

TransportSetup::~TransportSetup() {
  if (session_ != nullptr) {
    SSL_SESSION_free(session_);
  }
}

std::string TransportSetup::init_tls(const std::vector<std::string>& alpn) {
  SSL_CTX* ctx = ctx_.native_handle();
  error_code ec;
  if (options_.insecure) {
    ctx_.set_verify_mode(ssl::verify_none);
  } else {
    if (!options_.cacert.empty()) {
      ctx_.load_verify_file(options_.cacert, ec);
      if (ec) {
        return "--cacert " + options_.cacert + ": " + ec.message();
      }
    } else {
      ctx_.set_default_verify_paths(ec);
      if (ec) {
        return "cannot load the system trust store: " + ec.message();
      }
    }
    ctx_.set_verify_mode(ssl::verify_peer);
    tls::settle_certificates(SSL_CTX_get_cert_store(ctx));  // before --threads handshake
  }
  std::string wire;
  for (const auto& p : alpn) {
    wire.push_back(static_cast<char>(p.size()));
    wire += p;
  }
  if (!wire.empty() &&
      SSL_CTX_set_alpn_protos(ctx, reinterpret_cast<const unsigned char*>(wire.data()),
                              static_cast<unsigned>(wire.size())) != 0) {
    return "cannot set ALPN";
  }
  if (options_.tls_resume) {
    // Client cache without OpenSSL's internal store: keep the newest session (TLS 1.3 tickets
    // arrive after the handshake) and offer it on the next connection.
    SSL_CTX_set_ex_data(ctx, session_slot_index(), this);
    SSL_CTX_set_session_cache_mode(ctx, SSL_SESS_CACHE_CLIENT | SSL_SESS_CACHE_NO_INTERNAL_STORE);
    SSL_CTX_sess_set_new_cb(ctx, &TransportSetup::on_new_session);
  } else {
    SSL_CTX_set_session_cache_mode(ctx, SSL_SESS_CACHE_OFF);
    SSL_CTX_set_options(ctx, SSL_OP_NO_TICKET);
  }
  return {};
}

int TransportSetup::on_new_session(SSL* ssl, SSL_SESSION* session) {
  auto* self =
      static_cast<TransportSetup*>(SSL_CTX_get_ex_data(SSL_get_SSL_CTX(ssl), session_slot_index()));
  if (self == nullptr) {
    return 0;  // not taken: OpenSSL frees it
  }
  self->store_session(session);
  return 1;  // we own the reference now
}

void TransportSetup::store_session(SSL_SESSION* session) const {
  std::lock_guard lock(session_mutex_);
  if (session_ != nullptr) {
    SSL_SESSION_free(session_);
  }
  session_ = session;
}

void TransportSetup::apply_session(SSL* ssl) const {
  std::lock_guard lock(session_mutex_);
  if (session_ != nullptr) {
    SSL_set_session(ssl, session_);  // takes its own reference
  }
}

net::awaitable<std::optional<Failure>> TransportSetup::open(Connection& conn,
                                                            Opened& opened) const {
  TcpStream stream(co_await net::this_coro::executor);
  const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
  stream.expires_after(options_.timeout);
  {
    auto [ec, endpoint] = co_await stream.async_connect(endpoints_, use_nothrow);
    if (ec) {
      co_return io_failure(ec, ErrorKind::kConnect);
    }
  }
  error_code ignored;
  stream.socket().set_option(tcp::no_delay(true), ignored);

  if (!connect_request_.empty()) {
    auto [wec, written] =
        co_await net::async_write(stream, net::buffer(connect_request_), use_nothrow);
    if (wec) {
      co_return io_failure(wec, ErrorKind::kProxyIo);
    }
    beast::flat_buffer buffer;
    unsigned status = 0;
    do {  // interim heads (a 100 before the 200) are skipped, as for requests
      http::response_parser<http::empty_body> parser;
      parser.skip(true);  // a 2xx CONNECT response has no body; others end the connection
      auto [rec, read] = co_await http::async_read(stream, buffer, parser, use_nothrow);
      if (rec) {
        co_return io_failure(rec, ErrorKind::kProxyIo);
      }
      status = parser.get().result_int();
    } while (status >= 100 && status < 200 && status != 101);
    if (status / 100 != 2) {
      co_return Failure{ErrorKind::kProxyStatus, status,
                        "proxy answered CONNECT with " + std::to_string(status)};
    }
    if (buffer.size() != 0) {
      co_return Failure{ErrorKind::kProxyIo, 0, "proxy sent bytes after its CONNECT response"};
    }
  }

  if (!options_.target.tls) {
    opened.protocol = "cleartext";
    stream.expires_never();
    conn.tcp_.emplace(std::move(stream));
    co_return std::nullopt;
  }

  TlsStream tls(std::move(stream), ctx_);
  tls.expires_after(deadline - std::chrono::steady_clock::now());  // --timeout bounds all of open()
  SSL* ssl = tls.native_handle();
  const std::string& host = options_.target.host;
  const bool ip = is_ip_literal(host);
  if (!ip) {
    SSL_set_tlsext_host_name(ssl, host.c_str());  // SNI carries names only (RFC 6066)
  }
  if (!options_.insecure) {
    X509_VERIFY_PARAM* param = SSL_get0_param(ssl);
    X509_VERIFY_PARAM_set_hostflags(param, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
    const int set = ip ? X509_VERIFY_PARAM_set1_ip_asc(param, host.c_str())
                       : X509_VERIFY_PARAM_set1_host(param, host.c_str(), host.size());
    if (set != 1) {
      co_return Failure{ErrorKind::kTls, 0, "cannot set the expected host name"};
    }
  }
  if (options_.tls_resume) {
    apply_session(ssl);
  }
  auto [hec] = co_await tls.async_handshake(ssl::stream_base::client, use_nothrow);
  if (hec) {
    if (hec == beast::error::timeout) {
      co_return Failure{ErrorKind::kTimeout, 0, "TLS handshake timed out"};
    }
    std::string message = hec.message();
    const long verify = SSL_get_verify_result(ssl);
    if (verify != X509_V_OK) {
      message += std::string(": ") + X509_verify_cert_error_string(verify);
    }
    co_return Failure{ErrorKind::kTls, 0, std::move(message)};
  }
  const unsigned char* alpn = nullptr;
  unsigned alpn_len = 0;
  SSL_get0_alpn_selected(ssl, &alpn, &alpn_len);
  opened.protocol = alpn_len ? std::string(reinterpret_cast<const char*>(alpn), alpn_len) : "none";
  opened.resumed = SSL_session_reused(ssl) == 1;
  tls.expires_never();
  conn.tls_.emplace(std::move(tls));
  co_return std::nullopt;
}

std::shared_ptr<const TransportSetup> make_transport_setup(const BenchOptions& options,
                                                           std::string& error) {
  const std::string& host = options.proxy ? options.proxy->host : options.target.host;
  const std::uint16_t port = options.proxy ? options.proxy->port : options.target.port;
  net::io_context ioc;
  tcp::resolver resolver(ioc);
  error_code ec;
  auto results = resolver.resolve(host, std::to_string(port), ec);
  if (ec || results.empty()) {
    error = "cannot resolve " + host + ": " + ec.message();
    return nullptr;
  }
  std::vector<tcp::endpoint> endpoints;
  for (const auto& r : results) {
    endpoints.push_back(r.endpoint());
  }
  auto setup = std::make_shared<TransportSetup>(options, std::move(endpoints));
  if (options.target.tls) {
    std::vector<std::string> alpn;
    alpn.push_back(options.protocol == Protocol::kHttp2 ? "h2" : "http/1.1");
    error = setup->init_tls(alpn);
    if (!error.empty()) {
      return nullptr;
    }
  }
  return setup;
}

}  // namespace egress::bench
