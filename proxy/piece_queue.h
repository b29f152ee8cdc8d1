#pragma once
// A FIFO of body pieces for the HTTP/2 codecs (light: no Asio, no nghttp2).
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace egress::proxy {

/// FIFO of body pieces (a stream's inbound DATA or outbound body). std::deque allocates its
/// map and a 512-byte node when constructed: with four per proxied h2 stream that was 8
/// mallocs per stream, for queues that mostly hold zero or one piece. This one
/// allocates nothing until the first push. Popped slots are reclaimed when the queue
/// empties, or compacted when most of it is consumed (a queue that never empties).
class PieceQueue {
public:
    bool empty() const { return head_ == items_.size(); }
    size_t size() const { return items_.size() - head_; }
    std::string& front() { return items_[head_]; }
    template <class... Args>
    void emplace_back(Args&&... args) {
        items_.emplace_back(std::forward<Args>(args)...);
    }
    void pop_front() {
        items_[head_] = std::string();  // give the piece's memory back now
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
    auto begin() const { return items_.begin() + static_cast<std::ptrdiff_t>(head_); }
    auto end() const { return items_.end(); }
    /// Slots held, consumed ones included (what the compaction bounds; for tests).
    size_t slots() const { return items_.size(); }

private:
    std::vector<std::string> items_;
    size_t head_ = 0;
};

}  // namespace egress::proxy
