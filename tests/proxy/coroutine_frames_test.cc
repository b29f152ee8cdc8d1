// Asio's per-thread recycling of coroutine frames, as egressd configures it (CMakeLists.txt:
// BOOST_ASIO_RECYCLING_ALLOCATOR_CACHE_SIZE). A proxied request nests several coroutines (the
// exchange, a head's write, proxy/net.h's helpers); with Asio's default of two kept frames
// the rest went to malloc and back on every request.
//
// Counts calls of the global operator new, replaced for this test binary (a thread-local
// counter in front of malloc; every other test of the binary runs through it unchanged).
#include <gtest/gtest.h>

#include <boost/asio.hpp>
#include <cstdlib>
#include <new>

namespace {

thread_local size_t g_news = 0;

}  // namespace

// GCC sees the free() below as a mismatch for a pointer from `new`; this operator new is
// malloc underneath, so it is not.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void* operator new(std::size_t n) {
    ++g_news;
    if (void* p = std::malloc(n == 0 ? 1 : n)) {
        return p;
    }
    throw std::bad_alloc();
}
// The nothrow form too (std::stable_sort's temporary buffer uses it): otherwise it would come
// from the sanitizer's or the library's allocator and reach the free() above.
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
    ++g_news;
    return std::malloc(n == 0 ? 1 : n);
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
#pragma GCC diagnostic pop

namespace egress::proxy {
namespace {

namespace net = boost::asio;

/// A chain of `depth` coroutines, each awaiting the next; the last yields to the event loop
/// once, as an operation that has to wait would. Small frames, as the helpers' are.
net::awaitable<int> nest(int depth) {
    if (depth == 0) {
        co_await net::post(co_await net::this_coro::executor, net::use_awaitable);
        co_return 1;
    }
    co_return 1 + co_await nest(depth - 1);
}

TEST(CoroutineFrames, ARequestsNestedFramesAreRecycledNotAllocated) {
    constexpr int kDepth = 6;  // as deep as a request's chain, deeper than Asio's default cache
    net::io_context ioc{1};
    size_t news_in_steady_state = 0;
    int sum = 0;
    net::co_spawn(
        ioc,
        [&]() -> net::awaitable<void> {
            sum += co_await nest(kDepth);  // warms the thread's cache
            const size_t before = g_news;
            for (int i = 0; i < 100; ++i) {
                sum += co_await nest(kDepth);
            }
            news_in_steady_state = g_news - before;
        },
        net::detached);
    ioc.run();
    EXPECT_EQ(sum, 101 * (kDepth + 1));
    EXPECT_EQ(news_in_steady_state, 0u)
        << "coroutine frames went to operator new: is BOOST_ASIO_RECYCLING_ALLOCATOR_CACHE_SIZE "
           "still set for every translation unit?";
}

}  // namespace
}  // namespace egress::proxy
