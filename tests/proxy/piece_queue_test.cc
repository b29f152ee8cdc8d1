#include "proxy/piece_queue.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

namespace egress::proxy {
namespace {

std::vector<std::string> contents(const PieceQueue& q) { return {q.begin(), q.end()}; }

TEST(PieceQueue, IsFirstInFirstOut) {
    PieceQueue q;
    EXPECT_TRUE(q.empty());
    EXPECT_EQ(q.slots(), 0u);
    q.emplace_back("a");
    q.emplace_back(std::string(100, 'b'));
    q.emplace_back("xyz", 2);
    EXPECT_EQ(q.size(), 3u);
    EXPECT_EQ(q.front(), "a");
    q.pop_front();
    EXPECT_EQ(q.front(), std::string(100, 'b'));
    EXPECT_EQ(contents(q), (std::vector<std::string>{std::string(100, 'b'), "xy"}));
    q.pop_front();
    q.pop_front();
    EXPECT_TRUE(q.empty());
    EXPECT_EQ(q.slots(), 0u);  // emptied: every slot reclaimed
    q.emplace_back("c");
    EXPECT_EQ(q.front(), "c");
    q.clear();
    EXPECT_TRUE(q.empty());
}

// A reset stream keeps the piece its reader holds (its bytes, where they are) and drops the
// rest; on an empty queue it does nothing.
TEST(PieceQueue, ClearAfterFrontKeepsThePieceInHand) {
    PieceQueue q;
    q.clear_after_front();
    EXPECT_TRUE(q.empty());
    q.emplace_back("gone");
    q.emplace_back(std::string(100, 'h'));
    q.emplace_back("x");
    q.emplace_back("y");
    q.pop_front();
    const char* in_hand = q.front().data();
    q.clear_after_front();
    EXPECT_EQ(contents(q), (std::vector<std::string>{std::string(100, 'h')}));
    EXPECT_EQ(q.front().data(), in_hand);  // not moved: a reader's view of it stays valid
    q.pop_front();
    EXPECT_TRUE(q.empty());
}

// A stream's usual queue (one or two pieces) allocates no slots, and keeps first-in-first-out
// order when it outgrows them.
TEST(PieceQueue, APieceInHandStaysPutWhileMoreAreQueued) {
    // The reader holds a view of the front piece across waits while the producer queues more:
    // a short piece (its bytes inside the string object) moved with its slot when the queue
    // grew, and the view read a zeroed first byte or a freed block.
    for (const std::string& first : std::vector<std::string>{"ab", "", std::string(15, 's'),
                                                             std::string(100, 'h')}) {
        PieceQueue q;
        q.emplace_back(first);
        const char* in_hand = q.front().data();
        for (int i = 0; i < 40; ++i) {
            q.emplace_back("cd");
        }
        EXPECT_EQ(q.front().data(), in_hand) << first.size();
        EXPECT_EQ(std::string_view(in_hand, first.size()), first);
    }
}

TEST(PieceQueue, SmallPiecesJoinTheLastOneButNeverTheFront) {
    // A peer's one-byte DATA frames: one slot and one heap block per byte had let a stream's
    // queue cost ~80 times the window its bytes are counted against.
    PieceQueue q;
    q.append("a");
    const char* in_hand = q.front().data();
    for (int i = 0; i < 100000; ++i) {
        q.append("b");
    }
    EXPECT_EQ(q.front().data(), in_hand);  // the front is never appended to
    EXPECT_EQ(q.front(), "a");
    EXPECT_LE(q.slots(), 2 + 100000 / PieceQueue::kCoalesceBelow);
    size_t bytes = 0;
    for (const auto& piece : q) {
        bytes += piece.size();
        EXPECT_LE(piece.size(), PieceQueue::kCoalesceBelow);
    }
    EXPECT_EQ(bytes, 100001U);
    // Larger pieces are not joined once the last one is full.
    PieceQueue big;
    big.append("x");
    big.append(std::string(PieceQueue::kCoalesceBelow, 'y'));
    big.append("z");
    EXPECT_EQ(big.size(), 3U);
}

TEST(PieceQueue, FirstPiecesUseInlineSlots) {
    PieceQueue q;
    EXPECT_TRUE(q.slots_inline());
    for (size_t i = 0; i < PieceQueue::kInlineSlots; ++i) {
        q.emplace_back(std::to_string(i));
    }
    EXPECT_TRUE(q.slots_inline());
    q.emplace_back("spill");
    EXPECT_FALSE(q.slots_inline());
    EXPECT_EQ(contents(q), (std::vector<std::string>{"0", "1", "spill"}));
    q.pop_front();
    q.pop_front();
    q.pop_front();
    EXPECT_TRUE(q.empty());
    q.emplace_back("again");
    EXPECT_EQ(q.front(), "again");
}

// A producer that stays ahead of its consumer: the queue never empties, yet the consumed
// slots do not pile up, and the order holds through every compaction.
TEST(PieceQueue, NeverEmptyQueueStaysBounded) {
    PieceQueue q;
    int next_in = 0;
    int next_out = 0;
    for (int i = 0; i < 3; ++i) {
        q.emplace_back(std::to_string(next_in++));
    }
    size_t max_slots = 0;
    for (int round = 0; round < 10000; ++round) {
        q.emplace_back(std::to_string(next_in++));
        ASSERT_EQ(q.front(), std::to_string(next_out++));
        q.pop_front();
        ASSERT_EQ(q.size(), 3u);
        max_slots = std::max(max_slots, q.slots());
    }
    EXPECT_LE(max_slots, 40u);
    auto rest = contents(q);
    ASSERT_EQ(rest.size(), 3u);
    EXPECT_EQ(rest.front(), std::to_string(next_out));
    EXPECT_EQ(rest.back(), std::to_string(next_in - 1));
}

}  // namespace
}  // namespace egress::proxy
