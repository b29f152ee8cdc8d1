#pragma once
// An allocator with a per-thread cache of freed blocks, for the objects an HTTP/2 connection
// makes and frees once per stream with many alive at once (the stream state and its map
// node, on both legs). glibc's per-thread cache keeps seven blocks of a size; with fifty
// streams in flight most of these allocations took malloc's slow path (`_int_malloc`, and
// for blocks over 1 KiB every time). HAProxy's pools with their per-thread caches are the
// model; nghttpx does the same for its streams' headers.
//
// Each thread keeps at most Keep freed blocks per block size (the rebound type's size); a
// block freed on another thread than the one that made it simply joins that thread's cache
// (every block comes from operator new). What a thread keeps goes back to operator delete
// when the thread ends. Arrays (n > 1) and over-aligned types bypass the cache, and so does
// everything in a build with AddressSanitizer.
#include <cstddef>
#include <new>

namespace egress::proxy {

// Under AddressSanitizer (the fuzz targets) every block goes to operator new and back, so a
// use after free of a stream stays detectable instead of landing in a recycled block.
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif
#else
inline constexpr bool kSanitized = false;
#endif

template <class T, size_t Keep = 128>
class PoolAllocator {
public:
    using value_type = T;

    PoolAllocator() noexcept = default;
    template <class U>
    PoolAllocator(const PoolAllocator<U, Keep>&) noexcept {}  // NOLINT: rebinding is implicit
    template <class U>
    struct rebind {
        using other = PoolAllocator<U, Keep>;
    };

    T* allocate(size_t n) {
        if (n == 1 && kCached) {
            if (void* p = Cache::pop()) {
                return static_cast<T*>(p);
            }
        }
        return static_cast<T*>(::operator new(n * sizeof(T)));
    }
    void deallocate(T* p, size_t n) noexcept {
        if (n == 1 && kCached && Cache::push(p)) {
            return;
        }
        ::operator delete(p);
    }

    /// Blocks this thread keeps for T (tests).
    static size_t cached() { return kCached ? Cache::count() : 0; }

private:
    static constexpr bool kCached = !kSanitized && sizeof(T) >= sizeof(void*) &&
                                    alignof(T) <= __STDCPP_DEFAULT_NEW_ALIGNMENT__;

    /// One free list per thread and block size. `dead` outlives the list (a trivially
    /// destructible thread_local): a block freed during the thread's teardown, after the list
    /// is gone, goes straight back to operator delete.
    class Cache {
    public:
        static void* pop() {
            if (dead()) {
                return nullptr;
            }
            List& l = list();
            if (l.head == nullptr) {
                return nullptr;
            }
            Node* n = l.head;
            l.head = n->next;
            --l.count;
            return n;
        }
        static bool push(void* p) {
            if (dead()) {
                return false;
            }
            List& l = list();
            if (l.count >= Keep) {
                return false;
            }
            l.head = ::new (p) Node{l.head};
            ++l.count;
            return true;
        }
        static size_t count() { return dead() ? 0 : list().count; }

    private:
        struct Node {
            Node* next;
        };
        struct List {
            Node* head = nullptr;
            size_t count = 0;
            ~List() {
                dead() = true;
                while (head != nullptr) {
                    Node* next = head->next;
                    ::operator delete(head);
                    head = next;
                }
            }
        };
        static List& list() {
            thread_local List l;
            return l;
        }
        static bool& dead() {
            thread_local bool d = false;
            return d;
        }
    };
};

/// Class-level new and delete through the same per-thread cache, for objects made with
/// make_unique and owned through a base pointer (derive from PooledNew<T>; a virtual
/// destructor in the base makes delete find these). Other sizes (a further derived class)
/// go to the global operators.
template <class T>
struct PooledNew {
    static void* operator new(size_t n) {
        return n == sizeof(T) ? static_cast<void*>(PoolAllocator<T>{}.allocate(1))
                              : ::operator new(n);
    }
    static void operator delete(void* p, size_t n) noexcept {
        if (n == sizeof(T)) {
            PoolAllocator<T>{}.deallocate(static_cast<T*>(p), 1);
        } else {
            ::operator delete(p);
        }
    }
};

/// Stateless: every instance can free what any other made.
template <class T, class U, size_t Keep>
bool operator==(const PoolAllocator<T, Keep>&, const PoolAllocator<U, Keep>&) noexcept {
    return true;
}

}  // namespace egress::proxy
