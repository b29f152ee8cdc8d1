// TlsSocket (proxy/tls_socket.h) over real loopback TCP: handshakes, gathered writes, large
// transfers through small socket buffers (the WANT_WRITE path), concurrent reads and writes
// on one stream (HTTP/2's reader and writer), the lazy deadline, close_notify, truncation,
// and the failure modes a socket BIO of our own must get right (EPIPE without SIGPIPE, no
// read from a descriptor number reused after close). And the reads and writes tried at once
// (read_some_now, write_some_now and proxy/net.h's helpers built on them).
#include "proxy/tls_socket.h"

#include "proxy/net.h"  // read_some, write_all, read_header: the coroutine fast paths

#include <gtest/gtest.h>
#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/asio.hpp>
#include <boost/asio/experimental/awaitable_operators.hpp>
#include <chrono>
#include <string>

#include "tests/tls/tls_test_util.h"
#include "tls/contexts.h"

namespace egress::proxy {
namespace {

namespace net = boost::asio;
namespace ssl = boost::asio::ssl;
using tcp = net::ip::tcp;
using boost::system::error_code;
using namespace std::chrono_literals;
using namespace net::experimental::awaitable_operators;
constexpr auto use_nothrow = net::as_tuple(net::use_awaitable);

std::string pattern(size_t n, char seed) {
    std::string s(n, '\0');
    for (size_t i = 0; i < n; ++i) {
        s[i] = static_cast<char>(seed + static_cast<char>(i * 7 % 251));
    }
    return s;
}

class TlsSocketTest : public tls::testing::RunCaTest {
protected:
    void SetUp() override {
        RunCaTest::SetUp();
        auto s = tls::make_server_context({"http/1.1"});
        auto c = tls::make_client_context(ca_file_->path(), {"http/1.1"});
        ASSERT_TRUE(s.ok() && c.ok());
        sctx_ = std::make_unique<ssl::context>(std::move(s).value().release());
        cctx_ = std::make_unique<ssl::context>(std::move(c).value().release());
        leaf_ = ca_->mint("a.test").value();
    }

    /// A connected pair of TLS streams (not yet handshaken). Fixed 256 KiB socket buffers
    /// (no autotuning to tens of MiB) so that a writer ahead of its reader meets EAGAIN; still
    /// several loopback MSS wide, or TCP would stall on window updates.
    std::pair<TlsSocket, TlsSocket> pair() {
        tcp::acceptor acceptor(ioc_, tcp::endpoint(net::ip::make_address("127.0.0.1"), 0));
        tcp::socket client(ioc_);
        client.open(tcp::v4());
        for (tcp::socket* sock : {&client}) {
            sock->set_option(net::socket_base::send_buffer_size(256 * 1024));
            sock->set_option(net::socket_base::receive_buffer_size(256 * 1024));
        }
        acceptor.set_option(net::socket_base::receive_buffer_size(256 * 1024));
        client.connect(acceptor.local_endpoint());
        tcp::socket server = acceptor.accept();
        server.set_option(net::socket_base::send_buffer_size(256 * 1024));
        client.set_option(tcp::no_delay(true));
        server.set_option(tcp::no_delay(true));
        TlsSocket s(std::move(server), *sctx_);
        TlsSocket c(std::move(client), *cctx_);
        EXPECT_TRUE(tls::use_leaf(s.native_handle(), *leaf_).ok());
        EXPECT_TRUE(tls::prepare_client(c.native_handle(), "a.test").ok());
        return {std::move(s), std::move(c)};
    }

    /// Runs `task` to completion (bounded: a hang fails the test instead of blocking it).
    void run(net::awaitable<void> task) {
        bool done = false;
        net::co_spawn(ioc_, std::move(task), [&](std::exception_ptr e) {
            done = true;
            ioc_.stop();  // a deadline's timer may still be armed: it is not ours to wait for
            if (e) {
                std::rethrow_exception(e);
            }
        });
        ioc_.run_for(20s);
        ioc_.restart();
        ASSERT_TRUE(done) << "the exchange did not finish within 20 s";
    }

    static net::awaitable<void> handshake(TlsSocket& s, TlsSocket& c) {
        auto one = [](TlsSocket& t, ssl::stream_base::handshake_type type) -> net::awaitable<error_code> {
            auto [ec] = co_await t.async_handshake(type, use_nothrow);
            co_return ec;
        };
        auto [se, ce] = co_await (one(s, ssl::stream_base::server) && one(c, ssl::stream_base::client));
        EXPECT_FALSE(se) << se.message();
        EXPECT_FALSE(ce) << ce.message();
    }

    /// One read of at most one byte into `byte`; its error.
    static net::awaitable<error_code> read_byte(TlsSocket& s, char& byte) {
        auto [ec, n] = co_await s.async_read_some(net::buffer(&byte, 1), use_nothrow);
        co_return ec;
    }

    static net::awaitable<std::string> read_exactly(TlsSocket& s, size_t n) {
        std::string out(n, '\0');
        auto [ec, got] = co_await net::async_read(s, net::buffer(out), use_nothrow);
        EXPECT_FALSE(ec) << ec.message();
        out.resize(got);
        co_return out;
    }

    net::io_context ioc_{1};
    std::unique_ptr<ssl::context> sctx_;
    std::unique_ptr<ssl::context> cctx_;
    std::shared_ptr<const tls::Leaf> leaf_;
};

TEST_F(TlsSocketTest, HandshakeVerifiesAndGatheredBuffersArriveInOrder) {
    auto [s, c] = pair();
    run([&]() -> net::awaitable<void> {
        co_await handshake(s, c);
        EXPECT_EQ(SSL_get_verify_result(c.native_handle()), X509_V_OK);
        const std::string a = "GET /x HTTP/1.1\r\n";
        const std::string b = "Host: a.test\r\n";
        const std::string body = pattern(20000, 'a');  // a first buffer below 16 KiB, then more
        std::array<net::const_buffer, 4> bufs{net::buffer(a), net::const_buffer(), net::buffer(b),
                                              net::buffer(body)};
        auto [ec, n] = co_await net::async_write(c, bufs, use_nothrow);
        EXPECT_FALSE(ec);
        EXPECT_EQ(n, a.size() + b.size() + body.size());
        EXPECT_EQ(co_await read_exactly(s, n), a + b + body);
    }());
}

TEST_F(TlsSocketTest, OneWriteSendsSeveralRecordsAndNeverHoldsBackTheLast) {
    // A write_some takes as many records as the socket does (here all of 50 000 bytes: four
    // records), every one but the last sent with MSG_MORE. The last one must not be held
    // back: once the write completes, nothing may wait unsent in the kernel (SIOCOUTQNSD),
    // or the peer would see the response's end only when a timer flushed it.
    auto [s, c] = pair();
    run([&]() -> net::awaitable<void> {
        co_await handshake(s, c);
        for (size_t size : {size_t{50000}, size_t{16384}, size_t{16385}, size_t{100}}) {
            const std::string body = pattern(size, 'w');
            auto [ec, n] = co_await c.async_write_some(net::buffer(body), use_nothrow);
            EXPECT_FALSE(ec) << ec.message();
            EXPECT_EQ(n, size);
            int unsent = -1;
            EXPECT_EQ(::ioctl(c.socket().native_handle(), SIOCOUTQNSD, &unsent), 0);
            EXPECT_EQ(unsent, 0) << size << " bytes written";
            EXPECT_EQ(co_await read_exactly(s, size), body);
        }
    }());
}

TEST_F(TlsSocketTest, LargeTransfersBothWaysAtOnceWhileTheReadersLag) {
    // Each side writes 8 MiB while reading the other's on the same stream, and the readers
    // start late: the writers fill the socket buffers and SSL_write meets EAGAIN (WANT_WRITE)
    // while a read of the same SSL object waits, as with HTTP/2's reader and writer.
    auto [s, c] = pair();
    const std::string to_server = pattern(8 << 20, 'c');
    const std::string to_client = pattern(8 << 20, 's');
    run([&]() -> net::awaitable<void> {
        co_await handshake(s, c);
        auto pump = [](TlsSocket& out, const std::string& data) -> net::awaitable<void> {
            auto [ec, n] = co_await net::async_write(out, net::buffer(data), use_nothrow);
            EXPECT_FALSE(ec) << ec.message();
            EXPECT_EQ(n, data.size());
        };
        // The writers run beside the readers as tasks of their own on the same loop.
        net::co_spawn(ioc_, pump(c, to_server), net::detached);
        net::co_spawn(ioc_, pump(s, to_client), net::detached);
        // Start reading only once both writers wait for a writable socket (bounded: 10 s).
        net::steady_timer lag(ioc_);
        for (int i = 0; i < 10000 && !(SSL_want_write(s.native_handle()) &&
                                       SSL_want_write(c.native_handle()));
             ++i) {
            lag.expires_after(1ms);
            co_await lag.async_wait(use_nothrow);
        }
        EXPECT_TRUE(SSL_want_write(s.native_handle()) && SSL_want_write(c.native_handle()));
        auto [at_server, at_client] =
            co_await (read_exactly(s, to_server.size()) && read_exactly(c, to_client.size()));
        EXPECT_TRUE(at_server == to_server);
        EXPECT_TRUE(at_client == to_client);
    }());
}

TEST_F(TlsSocketTest, DeadlineTimesOutAPendingReadAndTheStreamStaysUsable) {
    auto [s, c] = pair();
    run([&]() -> net::awaitable<void> {
        co_await handshake(s, c);
        char byte;
        c.expires_after(50ms);
        EXPECT_EQ(co_await read_byte(c, byte), boost::beast::error::timeout);
        EXPECT_TRUE(c.timed_out());
        c.expires_never();  // the socket was not closed: a late answer still arrives
        EXPECT_FALSE(c.timed_out());
        co_await net::async_write(s, net::buffer(std::string("late")), use_nothrow);
        EXPECT_EQ(co_await read_exactly(c, 4), "late");
    }());
}

TEST_F(TlsSocketTest, ADeadlinePassedBeforeTheOperationFailsIt) {
    auto [s, c] = pair();
    run([&]() -> net::awaitable<void> {
        co_await handshake(s, c);
        c.expires_after(1ms);
        net::steady_timer t(ioc_, 20ms);
        co_await t.async_wait(use_nothrow);
        char byte;
        EXPECT_EQ(co_await read_byte(c, byte), boost::beast::error::timeout);
    }());
}

TEST_F(TlsSocketTest, DeadlineMovedLaterWhileWaitingIsHonoured) {
    // The timer armed for 50 ms fires early relative to the new deadline and re-arms: the
    // data sent at 200 ms is read, not a timeout.
    auto [s, c] = pair();
    run([&]() -> net::awaitable<void> {
        co_await handshake(s, c);
        c.expires_after(50ms);
        auto extend = [&]() -> net::awaitable<void> {
            net::steady_timer t(ioc_, 10ms);
            co_await t.async_wait(use_nothrow);
            c.expires_after(10s);
            t.expires_after(190ms);
            co_await t.async_wait(use_nothrow);
            co_await net::async_write(s, net::buffer(std::string("x")), use_nothrow);
        };
        char byte = 0;
        const error_code ec = co_await (read_byte(c, byte) && extend());
        EXPECT_FALSE(ec) << ec.message();
        EXPECT_EQ(byte, 'x');
    }());
}

TEST_F(TlsSocketTest, CancellingAPendingReadLeavesTheStreamUsable) {
    // Asio's cancellation slot reaches the wait inside the operation (awaitable operators
    // cancel the loser: HTTP/2's read, write and watchdog loops are joined that way).
    auto [s, c] = pair();
    run([&]() -> net::awaitable<void> {
        co_await handshake(s, c);
        char byte = 0;
        auto later = [&]() -> net::awaitable<void> {
            net::steady_timer t(ioc_, 20ms);
            co_await t.async_wait(use_nothrow);
        };
        auto first = co_await (read_byte(c, byte) || later());
        EXPECT_EQ(first.index(), 1u);  // the timer won; the read was cancelled
        EXPECT_FALSE(c.timed_out());
        co_await net::async_write(s, net::buffer(std::string("y")), use_nothrow);
        EXPECT_FALSE(co_await read_byte(c, byte));
        EXPECT_EQ(byte, 'y');
    }());
}

TEST_F(TlsSocketTest, CloseNotifyIsEofAndShutdownCompletesBothWays) {
    auto [s, c] = pair();
    run([&]() -> net::awaitable<void> {
        co_await handshake(s, c);
        s.expires_after(5s);
        auto server_close = [&]() -> net::awaitable<error_code> {
            auto [ec] = co_await s.async_shutdown(use_nothrow);  // waits for the client's
            co_return ec;
        };
        auto client_side = [&]() -> net::awaitable<error_code> {
            char byte;
            EXPECT_EQ(co_await read_byte(c, byte), net::error::eof);
            auto [ec] = co_await c.async_shutdown(use_nothrow);
            co_return ec;
        };
        auto [sec, cec] = co_await (server_close() && client_side());
        EXPECT_FALSE(sec) << sec.message();
        EXPECT_FALSE(cec) << cec.message();
    }());
}

TEST_F(TlsSocketTest, ShutdownFindsAPeerCloseNotifyThatArrivedWhileNobodyWasReading) {
    // The peer's close_notify is in the socket and the loop has already seen it readable
    // (edge-triggered: no new event will come). Our shutdown must read it, not wait for a
    // readiness that never comes and then time out.
    auto [s, c] = pair();
    run([&]() -> net::awaitable<void> {
        co_await handshake(s, c);
        SSL_set_shutdown(s.native_handle(), SSL_RECEIVED_SHUTDOWN);
        auto [sec] = co_await s.async_shutdown(use_nothrow);  // sends close_notify, no wait
        EXPECT_FALSE(sec) << sec.message();
        net::steady_timer t(ioc_, 50ms);  // the loop polls and sees the socket readable
        co_await t.async_wait(use_nothrow);
        c.expires_after(2s);
        auto [ec] = co_await c.async_shutdown(use_nothrow);
        EXPECT_FALSE(ec) << ec.message();
    }());
}

TEST_F(TlsSocketTest, APeerThatClosesWithoutCloseNotifyIsATruncation) {
    auto [s, c] = pair();
    run([&]() -> net::awaitable<void> {
        co_await handshake(s, c);
        s.socket().close();
        char byte;
        const error_code ec = co_await read_byte(c, byte);
        EXPECT_EQ(ec, ssl::error::stream_truncated) << ec.message();
    }());
}

TEST_F(TlsSocketTest, WritingToAVanishedPeerIsAnErrorNotSigpipe) {
    // OpenSSL's own socket BIO write()s: a peer gone would raise SIGPIPE and end this process.
    auto [s, c] = pair();
    run([&]() -> net::awaitable<void> {
        co_await handshake(s, c);
        s.socket().close();
        const std::string chunk = pattern(64 * 1024, 'w');
        error_code ec;
        for (int i = 0; i < 64 && !ec; ++i) {  // the first writes may still be accepted
            auto [wec, n] = co_await net::async_write(c, net::buffer(chunk), use_nothrow);
            ec = wec;
        }
        EXPECT_TRUE(ec == net::error::broken_pipe || ec == net::error::connection_reset)
            << ec.message();
    }());
}

TEST_F(TlsSocketTest, AfterCloseAReadNeverTouchesADescriptorNumberReused) {
    auto [s, c] = pair();
    run([&]() -> net::awaitable<void> {
        co_await handshake(s, c);
        co_await net::async_write(s, net::buffer(std::string("pending")), use_nothrow);
        const int old_fd = c.socket().native_handle();
        c.socket().close();
        int fds[2];
        EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
        // The kernel hands out the lowest free number: usually the one just closed.
        const bool reused = fds[0] == old_fd || fds[1] == old_fd;
        EXPECT_EQ(::write(fds[1], "other", 5), 5);
        EXPECT_EQ(::write(fds[0], "other", 5), 5);
        char buf[16];
        auto [ec, n] = co_await c.async_read_some(net::buffer(buf), use_nothrow);
        EXPECT_EQ(ec, net::error::bad_descriptor) << ec.message();
        char check[8];
        EXPECT_EQ(::recv(fds[0], check, sizeof check, MSG_DONTWAIT), 5);  // still unread
        EXPECT_EQ(::recv(fds[1], check, sizeof check, MSG_DONTWAIT), 5);
        ::close(fds[0]);
        ::close(fds[1]);
        if (!reused) {
            GTEST_LOG_(INFO) << "descriptor " << old_fd << " was not reused by this run";
        }
    }());
}

TEST_F(TlsSocketTest, BusyStreamsKeepTheirRecordBuffersUntilTheyIdle) {
    auto [s, c] = pair();
    run([&]() -> net::awaitable<void> {
        co_await handshake(s, c);
        co_await net::async_write(c, net::buffer(std::string("hello")), use_nothrow);
        EXPECT_EQ(co_await read_exactly(s, 5), "hello");
        // A connection that did little (a tunnel opened and left) frees them as it goes.
        EXPECT_FALSE(s.keeps_buffers());
        EXPECT_FALSE(c.keeps_buffers());
        // Requests and responses back and forth: both become busy.
        for (int i = 0; i < static_cast<int>(TlsSocket::kBusyCalls); ++i) {
            co_await net::async_write(c, net::buffer(std::string("ping")), use_nothrow);
            EXPECT_EQ(co_await read_exactly(s, 4), "ping");
            co_await net::async_write(s, net::buffer(std::string("pong")), use_nothrow);
            EXPECT_EQ(co_await read_exactly(c, 4), "pong");
        }
        EXPECT_TRUE(s.keeps_buffers());
        EXPECT_TRUE(c.keeps_buffers());
        // Idle for more than two periods: the server waits in a read (an idle keep-alive
        // client), the client does nothing at all (a pooled upstream connection).
        std::string got(5, '\0');
        bool read_done = false;
        net::co_spawn(
            s.get_executor(),
            [&]() -> net::awaitable<void> {
                auto [ec, n] = co_await net::async_read(s, net::buffer(got), use_nothrow);
                EXPECT_FALSE(ec) << ec.message();
                read_done = true;
            },
            net::detached);
        net::steady_timer idle(s.get_executor(), 2 * TlsSocket::kIdleRelease + 300ms);
        co_await idle.async_wait(use_nothrow);
        EXPECT_FALSE(s.keeps_buffers());
        EXPECT_FALSE(c.keeps_buffers());
        EXPECT_FALSE(read_done);
        // Both work on as before (OpenSSL allocates the buffers again when it needs them).
        co_await net::async_write(c, net::buffer(std::string("again")), use_nothrow);
        for (int i = 0; i < 100 && !read_done; ++i) {
            idle.expires_after(10ms);
            co_await idle.async_wait(use_nothrow);
        }
        EXPECT_TRUE(read_done);
        EXPECT_EQ(got, "again");
        EXPECT_FALSE(c.keeps_buffers());  // counting starts over
    }());
}

TEST_F(TlsSocketTest, MovedStreamKeepsWorking) {
    auto [s, c] = pair();
    run([&]() -> net::awaitable<void> {
        co_await handshake(s, c);
        auto moved = std::make_unique<TlsSocket>(std::move(c));
        co_await net::async_write(*moved, net::buffer(std::string("hello")), use_nothrow);
        EXPECT_EQ(co_await read_exactly(s, 5), "hello");
    }());
}

/// Waits (bounded) until `sock` has at least `bytes` unread bytes in the kernel.
net::awaitable<void> until_received(tcp::socket& sock, int bytes) {
    net::steady_timer t(co_await net::this_coro::executor);
    int have = 0;
    for (int i = 0; i < 2000; ++i) {
        EXPECT_EQ(::ioctl(sock.native_handle(), FIONREAD, &have), 0);
        if (have >= bytes) {
            co_return;
        }
        t.expires_after(1ms);
        co_await t.async_wait(use_nothrow);
    }
    ADD_FAILURE() << "only " << have << " of " << bytes << " bytes arrived";
}

TEST_F(TlsSocketTest, ReadNowTakesWhatIsThereAndOtherwiseTheReadWaitsFirst) {
    auto [s, c] = pair();
    run([&]() -> net::awaitable<void> {
        co_await handshake(s, c);
        char buf[64];
        // Nothing sent: no outcome, and the operation started after it waits for the socket
        // (it does not miss the data that comes later).
        auto a = s.read_some_now(net::buffer(buf));
        EXPECT_FALSE(a.outcome);
        EXPECT_FALSE(a.want_write);
        auto write_later = [&]() -> net::awaitable<void> {
            net::steady_timer t(co_await net::this_coro::executor);
            t.expires_after(20ms);
            co_await t.async_wait(use_nothrow);
            co_await net::async_write(c, net::buffer(std::string_view("first")), use_nothrow);
        };
        auto read_after = [&]() -> net::awaitable<std::string> {
            auto [ec, n] = co_await s.async_read_some_after(a, net::buffer(buf), use_nothrow);
            EXPECT_FALSE(ec) << ec.message();
            co_return std::string(buf, n);
        };
        EXPECT_EQ(co_await (read_after() && write_later()), "first");
        // Two records, both received before the read: one try takes both, with no wait.
        co_await net::async_write(c, net::buffer(std::string_view("head")), use_nothrow);
        co_await net::async_write(c, net::buffer(std::string_view("body")), use_nothrow);
        co_await until_received(s.socket(), 2 * (5 + 4 + 17));  // TLS 1.3 records
        auto b = s.read_some_now(net::buffer(buf));
        EXPECT_TRUE(b.outcome);
        if (b.outcome) {
            EXPECT_FALSE(b.outcome->first);
            EXPECT_EQ(std::string_view(buf, b.outcome->second), "headbody");
        }
        // proxy/net.h's read_some over both paths.
        co_await net::async_write(c, net::buffer(std::string_view("third")), use_nothrow);
        co_await until_received(s.socket(), 5 + 5 + 17);
        auto [ec3, n3] = co_await read_some(s, net::buffer(buf));
        EXPECT_FALSE(ec3);
        EXPECT_EQ(std::string_view(buf, n3), "third");
        auto read_waiting = [&]() -> net::awaitable<std::string> {
            auto [ec, n] = co_await read_some(s, net::buffer(buf));
            EXPECT_FALSE(ec) << ec.message();
            co_return std::string(buf, n);
        };
        EXPECT_EQ(co_await (read_waiting() && write_later()), "first");
    }());
}

TEST_F(TlsSocketTest, AReadThatExpectsNothingYetWaitsFirstYetMissesNothing) {
    auto [s, c] = pair();
    run([&]() -> net::awaitable<void> {
        co_await handshake(s, c);
        char buf[64];
        s.expires_after(2s);  // a read that missed its bytes would time out, not hang the test
        auto read_later = [&]() -> net::awaitable<std::string> {
            auto [ec, n] = co_await s.async_read_some_later(net::buffer(buf), use_nothrow);
            EXPECT_FALSE(ec) << ec.message();
            co_return std::string(buf, n);
        };
        auto write_after = [&](std::string_view text) -> net::awaitable<void> {
            net::steady_timer t(co_await net::this_coro::executor);
            t.expires_after(20ms);
            co_await t.async_wait(use_nothrow);
            co_await net::async_write(c, net::buffer(text), use_nothrow);
        };
        // Nothing there yet: the read waits for the bytes that come.
        EXPECT_EQ(co_await (read_later() && write_after("first")), "first");
        // Bytes that arrived before the read, after the loop saw the socket readable with no
        // operation waiting (the edge is gone): the wait still finds them, at once.
        co_await net::async_write(c, net::buffer(std::string_view("second")), use_nothrow);
        co_await until_received(s.socket(), 6 + 5 + 17);
        net::steady_timer idle(ioc_, 50ms);
        co_await idle.async_wait(use_nothrow);
        auto before = std::chrono::steady_clock::now();
        EXPECT_EQ(co_await read_later(), "second");
        EXPECT_LT(std::chrono::steady_clock::now() - before, 1s);
        // The rest of a record OpenSSL has already read: the socket is empty, so a wait would
        // last until the deadline; the read takes it at once.
        co_await net::async_write(c, net::buffer(std::string_view("headbody")), use_nothrow);
        co_await until_received(s.socket(), 8 + 5 + 17);
        auto [ec, n] = co_await s.async_read_some(net::buffer(buf, 4), use_nothrow);
        EXPECT_FALSE(ec) << ec.message();
        EXPECT_EQ(std::string_view(buf, n), "head");
        before = std::chrono::steady_clock::now();
        EXPECT_EQ(co_await read_later(), "body");
        EXPECT_LT(std::chrono::steady_clock::now() - before, 1s);
        // proxy/net.h's read_some with Arrival::Later.
        auto read_some_later = [&]() -> net::awaitable<std::string> {
            auto [ec, n] = co_await read_some(s, net::buffer(buf), Arrival::Later);
            EXPECT_FALSE(ec) << ec.message();
            co_return std::string(buf, n);
        };
        EXPECT_EQ(co_await (read_some_later() && write_after("third")), "third");
    }());
}

TEST_F(TlsSocketTest, WriteNowTakesWhatTheSocketTakesAndTheRestWaitsForRoom) {
    // Tries fill the socket until it takes nothing (want_write); the write started after that
    // waits for room, and write_all sends the rest through the full socket: the reader, who
    // starts late, gets every byte in order.
    auto [s, c] = pair();
    const std::string data = pattern(16 << 20, 'n');
    run([&]() -> net::awaitable<void> {
        co_await handshake(s, c);
        size_t at = 0;
        TlsSocket::Attempt a;
        for (int i = 0; i < 1000 && at < data.size(); ++i) {
            auto piece = net::buffer(data.data() + at, std::min<size_t>(64 << 10, data.size() - at));
            a = c.write_some_now(piece);
            if (!a.outcome && !a.tried) {  // a streak's end: this one goes through the loop
                auto [ec, n] = co_await c.async_write_some_after(a, piece, use_nothrow);
                a.outcome = TlsSocket::Outcome{ec, n};
            }
            if (!a.outcome) {
                break;
            }
            EXPECT_FALSE(a.outcome->first) << a.outcome->first.message();
            EXPECT_GT(a.outcome->second, 0u);
            at += a.outcome->second;
        }
        EXPECT_FALSE(a.outcome) << "the socket took all " << at << " bytes";
        if (a.outcome) {
            co_return;
        }
        EXPECT_TRUE(a.want_write);
        EXPECT_GT(at, 0u);
        auto writer = [&]() -> net::awaitable<void> {
            auto [ec, n] = co_await c.async_write_some_after(
                a, net::buffer(data.data() + at, std::min<size_t>(64 << 10, data.size() - at)),
                use_nothrow);
            EXPECT_FALSE(ec) << ec.message();
            EXPECT_GT(n, 0u);
            at += n;
            auto [ec2, n2] = co_await write_all(c, net::buffer(data.data() + at, data.size() - at));
            EXPECT_FALSE(ec2) << ec2.message();
            EXPECT_EQ(at + n2, data.size());
        };
        auto got = co_await (writer() && read_exactly(s, data.size()));
        EXPECT_TRUE(got == data);
    }());
}

TEST_F(TlsSocketTest, AStreamCompletesAtMostAStreakOfTriesBeforeOneGoesThroughTheLoop) {
    auto [s, c] = pair();
    run([&]() -> net::awaitable<void> {
        co_await handshake(s, c);
        const std::string sent = pattern(3 * TlsSocket::kInlineStreak, 'k');
        co_await net::async_write(c, net::buffer(sent), use_nothrow);
        co_await until_received(s.socket(), static_cast<int>(sent.size()));
        std::string got;
        char byte;
        for (uint32_t i = 0; i < TlsSocket::kInlineStreak; ++i) {
            auto a = s.read_some_now(net::buffer(&byte, 1));
            EXPECT_TRUE(a.outcome) << i;
            if (a.outcome) {
                got.append(&byte, a.outcome->second);
            }
        }
        // The streak is over: no try, and the operation started after it completes (posted).
        auto a = s.read_some_now(net::buffer(&byte, 1));
        EXPECT_FALSE(a.outcome);
        EXPECT_FALSE(a.tried);
        auto [ec, n] = co_await s.async_read_some_after(a, net::buffer(&byte, 1), use_nothrow);
        EXPECT_FALSE(ec);
        got.append(&byte, n);
        // And a new streak starts.
        auto b = s.read_some_now(net::buffer(&byte, 1));
        EXPECT_TRUE(b.outcome);
        if (b.outcome) {
            got.append(&byte, b.outcome->second);
        }
        EXPECT_EQ(got, sent.substr(0, TlsSocket::kInlineStreak + 2));
    }());
}

/// What reading a head left: the error, the head as Beast parsed it, and the bytes left over.
struct HeadResult {
    error_code ec;
    bool done = false;
    std::string method, target, fields, rest;
    bool operator==(const HeadResult&) const = default;
};

std::ostream& operator<<(std::ostream& os, const HeadResult& r) {
    return os << r.ec.message() << " done=" << r.done << " " << r.method << " " << r.target
              << " [" << r.fields << "] rest=[" << r.rest << "]";
}

TEST_F(TlsSocketTest, ReadHeaderOnATlsSocketAgreesWithBeast) {
    // proxy/net.h's read_header runs Beast's read steps in the coroutine; for each way a head
    // can arrive (whole, in pieces, with the body behind it, cut short by close_notify, never,
    // too large for the parser or for the buffer, malformed) it must come to what Beast's
    // http::async_read_header comes to on the same stream.
    struct Case {
        std::vector<std::string> pieces;
        bool close_after = false;
        uint32_t header_limit = 8192;
        size_t buffer_max = 1 << 20;
    };
    const std::string big(3000, 'v');
    const std::vector<Case> cases = {
        {{"GET /a HTTP/1.1\r\nHost: a.test\r\nX-One: 1\r\n\r\n"}},
        {{"GET /b HT", "TP/1.1\r\nHo", "st: a.test\r\n\r", "\nbody bytes"}},
        {{"POST /c HTTP/1.1\r\nHost: a.test\r\nContent-Length: 5\r\n\r\nhello"}},
        {{"GET /d HTTP/1.1\r\nHost: a.test\r\n"}, true},
        {{}, true},
        {{"GET /e HTTP/1.1\r\nX-Big: " + big + "\r\n\r\n"}, false, 1024},
        {{"GET /f HTTP/1.1\r\nX-Big: " + big + "\r\n\r\n"}, false, 8192, 1024},
        {{"G@T /g HTTP/1.1\r\n\r\n"}},
    };
    const std::vector<error_code> expected = {
        {}, {}, {}, http::error::partial_message, http::error::end_of_stream,
        http::error::header_limit, http::error::buffer_overflow, http::error::bad_method};
    ASSERT_EQ(expected.size(), cases.size());
    for (size_t i = 0; i < cases.size(); ++i) {
        const Case& k = cases[i];
        HeadResult results[2];
        for (int beast_read = 0; beast_read < 2; ++beast_read) {
            auto [s, c] = pair();
            HeadResult& r = results[beast_read];
            run([&]() -> net::awaitable<void> {
                co_await handshake(s, c);
                auto send = [&]() -> net::awaitable<void> {
                    net::steady_timer t(co_await net::this_coro::executor);
                    for (const auto& piece : k.pieces) {
                        co_await net::async_write(c, net::buffer(piece), use_nothrow);
                        t.expires_after(5ms);  // each piece in a read of its own
                        co_await t.async_wait(use_nothrow);
                    }
                    if (k.close_after) {
                        SSL_shutdown(c.native_handle());  // close_notify, without waiting
                    }
                };
                auto receive = [&]() -> net::awaitable<void> {
                    beast::flat_buffer b(k.buffer_max);
                    http::request_parser<http::empty_body> p;
                    p.header_limit(k.header_limit);
                    s.expires_after(5s);
                    if (beast_read == 1) {
                        auto [ec, n] = co_await http::async_read_header(s, b, p, use_nothrow);
                        r.ec = ec;
                    } else {
                        r.ec = co_await read_header(s, b, p);
                    }
                    r.done = p.is_header_done();
                    if (r.done) {
                        r.method = std::string(p.get().method_string());
                        r.target = std::string(p.get().target());
                        for (const auto& f : p.get()) {
                            r.fields += std::string(f.name_string()) + "=" + std::string(f.value()) + ";";
                        }
                    }
                    r.rest = beast::buffers_to_string(b.data());
                };
                co_await (send() && receive());
            }());
        }
        EXPECT_EQ(results[0], results[1]) << "case " << i;
        EXPECT_EQ(results[0].ec, expected[i]) << "case " << i << ": " << results[0];
    }
}

}  // namespace
}  // namespace egress::proxy
