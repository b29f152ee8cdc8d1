#pragma once
// A FIFO of body pieces for the HTTP/2 codecs (light: no Asio, no nghttp2).
#include <algorithm>
#include <cstddef>
#include <functional>
#include <string>
#include <string_view>
#include <utility>

#include <boost/container/small_vector.hpp>

#include "common/secure_zero.h"

namespace egress::proxy {

/// FIFO of body pieces (a stream's inbound DATA or outbound body). std::deque allocates its
/// map and a 512-byte node when constructed: with four per proxied h2 stream that was 8
/// mallocs per stream, for queues that mostly hold zero or one piece. This one keeps its
/// first two slots inline (a small response's one DATA piece costs no slot allocation, only
/// the piece's own bytes). Popped slots are reclaimed when the queue empties, or compacted
/// when most of it is consumed (a queue that never empties).
///
/// A piece's bytes stay where they are while later pieces are queued: the reader holds a view
/// of the front piece across waits (a response piece waits for the client's window while the
/// upstream's reader queues more), and the slots move when the queue grows. A moved string
/// keeps its heap block, but a short one (15 bytes or less) keeps its bytes in the string
/// object itself, and they moved with the slot: the view then read a zeroed first byte, or a
/// freed block. So every piece's bytes are on the heap.
class PieceQueue {
public:
    static constexpr size_t kInlineSlots = 2;
    bool empty() const { return head_ == items_.size(); }
    size_t size() const { return items_.size() - head_; }
    std::string& front() { return items_[head_]; }
    template <class... Args>
    void emplace_back(Args&&... args) {
        std::string& piece = items_.emplace_back(std::forward<Args>(args)...);
        if (piece.capacity() < kHeapBytes) {
            piece.reserve(kHeapBytes);  // out of the string object's own buffer
        }
    }
    /// Queues `bytes` behind the last piece when that is not the front (whose bytes a reader
    /// may hold) and holds fewer than kCoalesceBelow bytes; else as a piece of their own. A
    /// peer's DATA frames of one byte each had cost a slot (32 bytes) and a heap block (48)
    /// per byte: eighty times the flow-control window they are counted against.
    /// A piece that grows moves to a larger block, and the old one is zeroed first: it holds
    /// a peer's bytes not yet scrubbed (an upstream's echo of a credential).
    void append(std::string_view bytes) {
        if (size() >= 2 && items_.back().size() < kCoalesceBelow) {
            std::string& back = items_.back();
            if (back.size() + bytes.size() > back.capacity()) {
                std::string grown;
                grown.reserve(std::max(2 * back.capacity(), back.size() + bytes.size()));
                grown.append(back);
                egress::secure_zero(back.data(), back.size());
                back.swap(grown);
            }
            back.append(bytes);
            return;
        }
        emplace_back(bytes);
    }
    static constexpr size_t kCoalesceBelow = 16 * 1024;
    void pop_front() {
        std::string().swap(items_[head_]);  // give the piece's memory back now (an assignment
                                            // of an empty string keeps the block)
        if (++head_ == items_.size()) {
            clear();
        } else if (head_ >= 16 && head_ * 2 >= items_.size()) {
            items_.erase(items_.begin(), items_.begin() + static_cast<std::ptrdiff_t>(head_));
            head_ = 0;
        }
    }
    void clear() {
        items_.clear();
        head_ = 0;
    }
    /// Drops every piece but the first (one its reader may still be using).
    void clear_after_front() {
        if (!empty()) {
            items_.erase(items_.begin() + static_cast<std::ptrdiff_t>(head_) + 1, items_.end());
        }
    }
    auto begin() const { return items_.begin() + static_cast<std::ptrdiff_t>(head_); }
    auto end() const { return items_.end(); }
    /// Slots held, consumed ones included (what the compaction bounds; for tests).
    size_t slots() const { return items_.size(); }
    /// The slots live inside the queue object (no slot allocation has happened; for tests).
    bool slots_inline() const {
        const auto* p = reinterpret_cast<const char*>(items_.data());
        const auto* self = reinterpret_cast<const char*>(this);
        return std::less_equal<const char*>()(self, p) &&
               std::less<const char*>()(p, self + sizeof *this);
    }

private:
    /// A capacity past std::string's inline buffer (15 bytes in libstdc++).
    static constexpr size_t kHeapBytes = sizeof(std::string);
    boost::container::small_vector<std::string, kInlineSlots> items_;
    size_t head_ = 0;
};

}  // namespace egress::proxy
