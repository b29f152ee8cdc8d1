#pragma once
// Asio/Beast aliases for proxy/ sources. Heavy: include only from proxy/*.cc, never from a
// header that policy/, tls/ or credstore/ include.
#include <boost/asio.hpp>
#include <boost/asio/experimental/awaitable_operators.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>

#include <array>
#include <chrono>
#include <cstddef>
#include <limits>

#include <linux/sockios.h>
#include <sys/ioctl.h>

#include "common/secure_zero.h"
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

/// An IPv4-mapped IPv6 address (::ffff:a.b.c.d, what a dual-stack socket reports for an IPv4
/// peer) as the IPv4 address it is; any other address as it is.
inline net::ip::address unmapped(const net::ip::address& a) {
    if (a.is_v6() && a.to_v6().is_v4_mapped()) {
        return net::ip::make_address_v4(net::ip::v4_mapped, a.to_v6());
    }
    return a;
}

/// Expected errors are values (STYLE.md 10): co_await op(..., use_nothrow) → tuple(ec, ...).
inline constexpr auto use_nothrow = net::as_tuple(net::use_awaitable);

// Reads and writes for coroutines. On a TlsSocket they try the socket at once and complete in
// the calling coroutine when the result is known (TlsSocket::read_some_now); only what has to
// wait goes through an operation. On other streams they are the Asio and Beast operations.

/// Whether a read may find bytes there already. Later: it follows our own write to the same
/// peer, which has yet to answer (a response right after its request, the next request right
/// after a response); on a TlsSocket it waits for the socket first
/// (TlsSocket::async_read_some_later), without a try whose recv would only learn EAGAIN.
enum class Arrival { Maybe, Later };

/// For a loop that reads a stream over and over (HTTP/2's read loops): a read that did not
/// fill its buffer took all the socket had, so the next one would most likely only learn
/// EAGAIN and waits first (what OpenSSL still holds is read at once).
inline Arrival arrival_after(size_t got, size_t asked) {
    return got < asked ? Arrival::Later : Arrival::Maybe;
}

/// s.async_read_some.
template <class Stream, class MutableBuffers>
awaitable<std::tuple<error_code, size_t>> read_some(Stream& s, const MutableBuffers& bufs,
                                                    Arrival arrival = Arrival::Maybe) {
    if constexpr (std::is_same_v<Stream, TlsSocket>) {
        if (arrival == Arrival::Later) {
            co_return co_await s.async_read_some_later(bufs, use_nothrow);
        }
        auto a = s.read_some_now(bufs);
        if (a.outcome) {
            co_return *a.outcome;
        }
        co_return co_await s.async_read_some_after(a, bufs, use_nothrow);
    } else {
        co_return co_await s.async_read_some(bufs, use_nothrow);
    }
}

/// net::async_write: all of bufs, or an error.
template <class Stream, class ConstBuffers>
awaitable<std::tuple<error_code, size_t>> write_all(Stream& s, const ConstBuffers& bufs) {
    if constexpr (std::is_same_v<Stream, TlsSocket>) {
        auto a = s.write_some_now(bufs);
        if (!a.outcome) {
            auto [ec, sent] = co_await s.async_write_some_after(a, bufs, use_nothrow);
            a.outcome = {ec, sent};
        }
        const auto [ec, n] = *a.outcome;
        if (ec || n == net::buffer_size(bufs)) {
            co_return std::tuple(ec, n);
        }
        beast::buffers_suffix<ConstBuffers> rest(bufs);  // the socket took part: write the rest
        rest.consume(n);
        auto [rec, rn] = co_await net::async_write(s, rest, use_nothrow);
        co_return std::tuple(rec, n + rn);
    } else {
        co_return co_await net::async_write(s, bufs, use_nothrow);
    }
}

/// http::async_read_header. On a TlsSocket, Beast's steps (beast/http/impl/read.hpp,
/// read_some_op) with read_some: parse what is buffered, read at most 64 KiB more while the
/// parser needs it, EOF after some bytes is the parser's put_eof and before any is
/// end_of_stream. A head already buffered (read while the connection idled) or already
/// received is parsed without a composed operation posting its result.
/// `arrival` is that of the first bytes read from the socket.
template <class Stream, bool isRequest>
awaitable<error_code> read_header(Stream& s, beast::flat_buffer& b, http::basic_parser<isRequest>& p,
                                  Arrival arrival = Arrival::Maybe) {
    if constexpr (std::is_same_v<Stream, TlsSocket>) {
        while (!p.is_header_done()) {
            if (b.size() > 0) {
                error_code ec;
                b.consume(p.put(b.data(), ec));
                if (ec != http::error::need_more) {
                    if (ec) {
                        co_return ec;
                    }
                    continue;
                }
            }
            const size_t size = beast::read_size(b, 65536);
            if (size == 0) {
                co_return http::error::buffer_overflow;
            }
            auto [ec, n] = co_await read_some(s, b.prepare(size), arrival);
            arrival = Arrival::Maybe;
            b.commit(n);
            if (ec == net::error::eof) {
                if (!p.got_some()) {
                    co_return http::error::end_of_stream;
                }
                error_code eof;
                p.put_eof(eof);  // partial_message: the head was cut short
                co_return eof;
            }
            if (ec) {
                co_return ec;
            }
        }
        co_return error_code();
    } else {
        auto [ec, n] = co_await http::async_read_header(s, b, p, use_nothrow);
        co_return ec;
    }
}

using TcpStream = beast::tcp_stream;
/// TLS on the socket itself (proxy/tls_socket.h), not asio::ssl::stream's BIO pair.
using TlsStream = TlsSocket;

/// Bytes sent on socket `fd` the peer has not acknowledged yet (SIOCOUTQ; 0 if unknown).
inline int unacked_bytes(int fd) {
    int n = 0;
    return ::ioctl(fd, SIOCOUTQ, &n) == 0 ? n : 0;
}

/// Ends a connection after an answer sent while the peer may still be sending (a refusal of a
/// request with a body, an upstream's early answer, an admin request over its size): our side
/// is shut down for sending, then what the peer sends is read and dropped until it closes,
/// `limit` passes or `max_bytes` were dropped. Closing with unread bytes would reset the
/// connection, and a reset can discard the answer before the peer reads it (RFC 9112 9.6;
/// nginx's lingering close). The dropped bytes are wiped: the admin API's may be secrets.
/// Reads the socket itself: on TLS, after our close_notify, the records are not decrypted.
/// With `hold_until` (a drain's close), `limit` counts from the peer's last bytes (a slow
/// reader's WINDOW_UPDATEs), and past it the close waits on while the peer has not
/// acknowledged all we sent; it ends at `hold_until` whatever the peer does.
template <class Socket>
awaitable<void> linger_close(Socket& s, std::chrono::milliseconds limit,
                             size_t max_bytes = std::numeric_limits<size_t>::max(),
                             std::chrono::steady_clock::time_point hold_until = {}) {
    error_code ec;
    s.shutdown(net::socket_base::shutdown_send, ec);  // the answer ends with our FIN
    if (ec) {
        co_return;
    }
    std::array<char, 16 * 1024> sink;
    net::steady_timer timer(s.get_executor());
    const bool hold = hold_until != std::chrono::steady_clock::time_point{};
    timer.expires_after(limit);
    if (hold && timer.expiry() > hold_until) {
        timer.expires_at(hold_until);
    }
    using namespace net::experimental::awaitable_operators;
    for (size_t dropped = 0; dropped < max_bytes;) {
        auto r = co_await (s.async_read_some(net::buffer(sink), use_nothrow) ||
                           timer.async_wait(use_nothrow));
        if (r.index() == 1) {
            const auto now = std::chrono::steady_clock::now();
            if (hold && now < hold_until && unacked_bytes(s.native_handle()) > 0) {
                timer.expires_at(std::min(now + std::chrono::milliseconds(50), hold_until));
                continue;
            }
            break;  // the time is up
        }
        auto [rec, n] = std::get<0>(r);
        if (rec) {
            break;  // the peer closed (it has the answer) or reset
        }
        dropped += n;
        if (hold) {
            timer.expires_at(std::min(std::chrono::steady_clock::now() + limit, hold_until));
        }
    }
    egress::secure_zero(sink.data(), sink.size());
}

}  // namespace egress::proxy
