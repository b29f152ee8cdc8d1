#pragma once
// Relay buffers reused per worker thread. Allocating (and zeroing) a fresh 64 KiB buffer for
// every request body showed up in profiles as memset plus page faults when malloc handed the
// memory back to the kernel; a small per-thread free list removes both. Each worker is one
// thread and a buffer is released on the thread that acquired it (coroutine frames never
// migrate between workers), so no lock is needed.
#include <cstddef>
#include <memory>
#include <vector>

namespace egress::proxy {

inline constexpr size_t kRelayBufferBytes = 64 * 1024;
/// Kept free in front of an upstream response's body pieces (HTTP/1.1) in their relay buffer:
/// the response scrubber puts the bytes it held back from one piece in front of the next there,
/// instead of copying the next piece behind them (BodyChunk::headroom). Longer than the longest
/// needle of usual credentials (their forms included); longer ones take the copy.
inline constexpr size_t kScrubHeadroom = 512;

struct RelayBufferReturn {
    void operator()(char* p) const noexcept;
};
using RelayBuffer = std::unique_ptr<char[], RelayBufferReturn>;

/// A kRelayBufferBytes buffer, uninitialised, from this thread's free list when possible.
RelayBuffer acquire_relay_buffer();

namespace detail {
inline constexpr size_t kMaxPooledBuffers = 64;  // 4 MiB per worker at most
inline std::vector<char*>& relay_free_list() {
    thread_local std::vector<char*> list;
    thread_local struct Drain {
        ~Drain() {
            for (char* p : relay_free_list()) delete[] p;
        }
    } drain;
    (void)drain;
    return list;
}
}  // namespace detail

inline void RelayBufferReturn::operator()(char* p) const noexcept {
    auto& list = detail::relay_free_list();
    if (list.size() < detail::kMaxPooledBuffers) {
        list.push_back(p);
    } else {
        delete[] p;
    }
}

inline RelayBuffer acquire_relay_buffer() {
    auto& list = detail::relay_free_list();
    if (!list.empty()) {
        char* p = list.back();
        list.pop_back();
        return RelayBuffer(p);
    }
    return RelayBuffer(new char[kRelayBufferBytes]);
}

}  // namespace egress::proxy
