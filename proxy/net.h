#pragma once
// Asio/Beast aliases for proxy/ sources. Heavy: include only from proxy/*.cc, never from a
// header that policy/, tls/ or credstore/ include.
#include <boost/asio.hpp>
#include <boost/asio/experimental/awaitable_operators.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>

#include "proxy/tls_socket.h"

namespace egress::proxy {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = boost::beast::http;
namespace ssl = boost::asio::ssl;
using tcp = boost::asio::ip::tcp;
using boost::system::error_code;

template <class T = void>
using awaitable = net::awaitable<T>;

/// Expected errors are values (STYLE.md 10): co_await op(..., use_nothrow) → tuple(ec, ...).
inline constexpr auto use_nothrow = net::as_tuple(net::use_awaitable);

using TcpStream = beast::tcp_stream;
/// TLS on the socket itself (proxy/tls_socket.h), not asio::ssl::stream's BIO pair.
using TlsStream = TlsSocket;

}  // namespace egress::proxy
