#pragma once
// The memory of one nghttp2 session (nghttp2_mem): freed blocks are kept on free lists by
// size class and handed out again, instead of going back to malloc. nghttp2 allocates about
// eight blocks per stream and session (the stream, its outbound items, header buffers); with
// fifty streams in flight, glibc's per-thread cache (seven blocks a size) overflows and most
// of them took malloc's slow path (`_int_malloc`/`_int_free`, ~250 instructions a pair; see
// bench/RESULTS.md). nghttpx gives its own sessions' headers a block allocator for the same
// reason.
//
// One session, one thread: no locks. The pool must outlive its session (declare it before
// the SessionPtr). What it keeps is bounded (kMaxCachedBytes: 16 KiB kept too little for 50
// streams in flight, which then missed the cache) and given back when the session has no
// open stream (trim, from the session's watchdog), so an idle connection does not hold a
// burst's memory.
//
// A pool made with `wipe` zeroes every block as nghttp2 frees it (cached or given back): the
// upstream session's blocks hold its copy of a request's fields, the injected credential
// among them (nghttp2_submit_request copies the name/value list).
#include <nghttp2/nghttp2.h>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "common/secure_zero.h"

namespace egress::proxy {

class H2Pool {
public:
    /// Blocks of 32, 64, ... 4096 bytes (a 16-byte header included); larger ones go straight
    /// to malloc and back.
    static constexpr size_t kClasses = 8;
    static constexpr size_t kHeader = 16;  // keeps malloc's 16-byte alignment
    static constexpr size_t kMaxClassBytes = size_t{32} << (kClasses - 1);
    /// Free blocks kept for reuse, at most (beyond it a freed block goes back to malloc).
    static constexpr size_t kMaxCachedBytes = 64 * 1024;

    explicit H2Pool(bool wipe = false) : wipe_(wipe) {
        mem_.mem_user_data = this;
        mem_.malloc = [](size_t n, void* self) { return static_cast<H2Pool*>(self)->allocate(n); };
        mem_.free = [](void* p, void* self) { static_cast<H2Pool*>(self)->release(p); };
        mem_.calloc = [](size_t count, size_t n, void* self) {
            return static_cast<H2Pool*>(self)->allocate_zeroed(count, n);
        };
        mem_.realloc = [](void* p, size_t n, void* self) {
            return static_cast<H2Pool*>(self)->reallocate(p, n);
        };
    }
    ~H2Pool() { trim(); }
    H2Pool(const H2Pool&) = delete;
    H2Pool& operator=(const H2Pool&) = delete;

    /// For nghttp2_session_{client,server}_new3.
    nghttp2_mem* mem() { return &mem_; }

    void* allocate(size_t n) {
        if (n > kMaxClassBytes - kHeader) {
            if (n > SIZE_MAX - kHeader) {
                return nullptr;
            }
            return stamp(std::malloc(n + kHeader), n + kHeader);
        }
        const size_t c = size_class(n + kHeader);
        const size_t bytes = size_t{32} << c;
        if (Free* f = free_[c]) {
            free_[c] = f->next;
            cached_ -= bytes;
            return stamp(f, bytes);
        }
        return stamp(std::malloc(bytes), bytes);
    }

    void release(void* p) {
        if (p == nullptr) {
            return;
        }
        char* base = static_cast<char*>(p) - kHeader;
        size_t bytes = 0;
        std::memcpy(&bytes, base, sizeof bytes);
        if (wipe_) {
            egress::secure_zero(p, bytes - kHeader);
        }
        if (bytes > kMaxClassBytes || cached_ + bytes > kMaxCachedBytes) {
            std::free(base);
            return;
        }
        const size_t c = size_class(bytes);
        Free* f = reinterpret_cast<Free*>(base);
        f->next = free_[c];
        free_[c] = f;
        cached_ += bytes;
    }

    void* allocate_zeroed(size_t count, size_t n) {
        if (n != 0 && count > SIZE_MAX / n) {
            return nullptr;
        }
        void* p = allocate(count * n);
        if (p != nullptr) {
            std::memset(p, 0, count * n);
        }
        return p;
    }

    /// realloc's contract: the block keeps its first min(old, n) bytes; nullptr (and the old
    /// block untouched) when there is no memory.
    void* reallocate(void* p, size_t n) {
        if (p == nullptr) {
            return allocate(n);
        }
        const size_t usable = usable_size(p);
        if (n <= usable && n != 0) {
            return p;
        }
        void* q = allocate(n);
        if (q == nullptr) {
            return nullptr;
        }
        std::memcpy(q, p, usable < n ? usable : n);
        release(p);
        return q;
    }

    /// Bytes a block from allocate(n) can hold (n or more).
    static size_t usable_size(const void* p) {
        size_t bytes = 0;
        std::memcpy(&bytes, static_cast<const char*>(p) - kHeader, sizeof bytes);
        return bytes - kHeader;
    }
    /// Bytes of free blocks kept for reuse.
    size_t cached_bytes() const { return cached_; }
    /// Gives every kept block back to malloc (the session's watchdog calls it when no stream
    /// is open, so an idle connection holds only what nghttp2 itself still uses).
    void trim() {
        for (Free*& head : free_) {
            while (head != nullptr) {
                Free* next = head->next;
                std::free(head);
                head = next;
            }
        }
        cached_ = 0;
    }

private:
    struct Free {
        Free* next;
    };

    /// The smallest class whose blocks hold `bytes` (32 << c >= bytes).
    static size_t size_class(size_t bytes) {
        return bytes <= 32 ? 0 : static_cast<size_t>(std::bit_width(bytes - 1)) - 5;
    }
    static void* stamp(void* base, size_t bytes) {
        if (base == nullptr) {
            return nullptr;
        }
        std::memcpy(base, &bytes, sizeof bytes);
        return static_cast<char*>(base) + kHeader;
    }

    nghttp2_mem mem_{};
    bool wipe_ = false;
    Free* free_[kClasses] = {};
    size_t cached_ = 0;
};

}  // namespace egress::proxy
