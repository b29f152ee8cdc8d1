// common/published.h: the holder of the state snapshot (credstore) and the runtime (proxy).
#include "common/published.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

namespace egress {
namespace {

struct Pair {
    explicit Pair(int v) : a(v), b(v) {}
    int a;
    int b;
};

TEST(Published, LoadsWhatWasStoredAndExchangeReturnsThePrevious) {
    Published<const Pair> p;
    EXPECT_EQ(p.load(), nullptr);
    auto one = std::make_shared<const Pair>(1);
    p.store(one);
    EXPECT_EQ(p.load(), one);
    auto prev = p.exchange(std::make_shared<const Pair>(2));
    EXPECT_EQ(prev, one);
    EXPECT_EQ(p.load()->a, 2);
    prev.reset();
    EXPECT_EQ(one.use_count(), 1);  // the holder let go of the value it replaced
}

// Readers load while a writer replaces the value: every load is a whole value that was
// stored (never a pointer of one with the reference count of another, which frees a value
// still in use), and every replaced value is freed once its last reader lets go. Under
// ThreadSanitizer (.ci/sanitize.sh thread) a load not ordered before the next replacement
// would also be reported.
TEST(Published, ConcurrentLoadsSeeWholeValuesWhileAWriterReplacesThem) {
    static std::atomic<int> live{0};
    struct Counted : Pair {
        explicit Counted(int v) : Pair(v) { live.fetch_add(1); }
        ~Counted() { live.fetch_sub(1); }
    };
    constexpr int kWrites = 20000;
    {
        Published<const Counted> p;
        p.store(std::make_shared<const Counted>(0));
        std::atomic<bool> done{false};
        std::atomic<long> loads{0};
        std::atomic<int> torn{0};
        std::atomic<int> started{0};
        std::vector<std::thread> readers;
        for (int r = 0; r < 3; ++r) {
            readers.emplace_back([&] {
                started.fetch_add(1);
                int last = 0;
                while (!done.load(std::memory_order_acquire)) {
                    auto v = p.load();
                    if (!v || v->a != v->b || v->a < last) {
                        torn.fetch_add(1);
                    }
                    last = v ? v->a : last;
                    loads.fetch_add(1, std::memory_order_relaxed);
                }
            });
        }
        while (started.load() < 3) {
            std::this_thread::yield();
        }
        for (int i = 1; i <= kWrites; ++i) {
            auto prev = p.exchange(std::make_shared<const Counted>(i));
            ASSERT_EQ(prev->a, i - 1);
        }
        done.store(true, std::memory_order_release);
        for (auto& t : readers) {
            t.join();
        }
        EXPECT_EQ(torn.load(), 0);
        EXPECT_GT(loads.load(), 0);
        EXPECT_EQ(p.load()->a, kWrites);
        EXPECT_EQ(live.load(), 1);  // only the current value is left
    }
    EXPECT_EQ(live.load(), 0);
}

}  // namespace
}  // namespace egress
