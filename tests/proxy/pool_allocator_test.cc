#include "proxy/pool_allocator.h"

#include <gtest/gtest.h>

#include <array>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace egress::proxy {
namespace {

struct Block {
    std::array<char, 200> bytes{};
};

/// What the cache holds after `n` blocks went into it: nothing under AddressSanitizer, where
/// every block goes back to operator delete (these tests check that too).
constexpr size_t kept(size_t n) { return kSanitized ? 0 : n; }

TEST(PoolAllocator, AFreedBlockIsTheNextOneHandedOut) {
    using A = PoolAllocator<Block, 4>;
    A a;
    const size_t before = A::cached();
    Block* p = a.allocate(1);
    a.deallocate(p, 1);
    EXPECT_EQ(A::cached(), before + kept(1));
    Block* q = a.allocate(1);
    if (!kSanitized) {
        EXPECT_EQ(q, p);  // from this thread's cache, not from malloc
    }
    EXPECT_EQ(A::cached(), before);
    a.deallocate(q, 1);
}

TEST(PoolAllocator, KeepsAtMostKeepBlocks) {
    struct Other {
        std::array<char, 72> bytes{};
    };
    using A = PoolAllocator<Other, 4>;
    A a;
    std::vector<Other*> blocks;
    for (int i = 0; i < 10; ++i) {
        blocks.push_back(a.allocate(1));
    }
    for (Other* p : blocks) {
        a.deallocate(p, 1);
    }
    EXPECT_EQ(A::cached(), kept(4));  // the other six went back to operator delete
    // Arrays never come from or go to the cache.
    Other* arr = a.allocate(3);
    EXPECT_EQ(A::cached(), kept(4));
    a.deallocate(arr, 3);
    EXPECT_EQ(A::cached(), kept(4));
}

TEST(PoolAllocator, SharedObjectsAndMapNodesComeBackIntoTheCache) {
    struct Stream {
        int id = 0;
        std::string name;
    };
    using Map = std::unordered_map<int, std::shared_ptr<Stream>, std::hash<int>,
                                   std::equal_to<int>,
                                   PoolAllocator<std::pair<const int, std::shared_ptr<Stream>>>>;
    Map m;
    std::set<const void*> first_round;  // where round 0's streams lived
    size_t reused = 0;
    for (int round = 0; round < 3; ++round) {
        for (int i = 0; i < 50; ++i) {
            auto s = std::allocate_shared<Stream>(PoolAllocator<Stream>{});
            if (round == 0) {
                first_round.insert(s.get());
            } else {
                reused += first_round.count(s.get());
            }
            s->id = i;
            s->name = "stream-" + std::to_string(i) + "-with-a-name-past-the-inline-buffer";
            m[i] = std::move(s);
        }
        for (int i = 0; i < 50; ++i) {
            ASSERT_EQ(m.at(i)->id, i);
            ASSERT_EQ(m.at(i)->name.substr(0, 7 + std::to_string(i).size()),
                      "stream-" + std::to_string(i));
        }
        m.clear();
    }
    EXPECT_TRUE(m.empty());
    // Rounds 1 and 2 got round 0's blocks back (50 shared objects, well under Keep).
    EXPECT_EQ(reused, kept(100));
}

TEST(PoolAllocator, ABlockFreedOnAnotherThreadJoinsThatThreadsCache) {
    struct Cross {
        std::array<char, 48> bytes{};
    };
    using A = PoolAllocator<Cross, 8>;
    A a;
    Cross* p = a.allocate(1);
    size_t there = 0;
    std::thread t([&] {
        A b;
        b.deallocate(p, 1);
        there = A::cached();
        // The thread ends with one cached block: its cache gives it back to operator delete.
    });
    t.join();
    EXPECT_EQ(there, kept(1));
    EXPECT_EQ(A::cached(), 0U);  // this thread's cache is untouched
}

struct Base {
    virtual ~Base() = default;
};
struct Derived final : Base, PooledNew<Derived> {
    std::array<char, 100> bytes{};
};

TEST(PoolAllocator, PooledNewRecyclesObjectsDeletedThroughTheirBase) {
    std::unique_ptr<Base> a = std::make_unique<Derived>();
    const void* where = a.get();
    a.reset();  // Derived's operator delete, found through the virtual destructor
    EXPECT_EQ(PoolAllocator<Derived>::cached(), kept(1));
    std::unique_ptr<Base> b = std::make_unique<Derived>();
    if (!kSanitized) {
        EXPECT_EQ(static_cast<const void*>(b.get()), where);
    }
    EXPECT_EQ(PoolAllocator<Derived>::cached(), 0U);
}

}  // namespace
}  // namespace egress::proxy
