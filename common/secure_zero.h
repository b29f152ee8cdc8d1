#pragma once
// Zeroing memory that held a secret, in a way the compiler may not drop as a dead store.
//
// glibc's explicit_bzero is its vectorized memset followed by a compiler barrier. OpenSSL's
// OPENSSL_cleanse (the same guarantee) stores eight bytes per loop iteration on x86-64: once
// every block an h2 upstream session frees was wiped, it was 2.3% of the instructions of a
// proxied h2 stream (bench/RESULTS.md). One function for every wipe in egressd.
#include <cstddef>
#include <memory>
#include <string>
#include <string.h>  // explicit_bzero (glibc 2.25+)

namespace egress {

inline void secure_zero(void* p, size_t n) {
    if (n != 0) {
        ::explicit_bzero(p, n);
    }
}

/// Zeroes a string's bytes, then empties it (its buffer stays allocated, now zero).
inline void secure_wipe(std::string& s) {
    secure_zero(s.data(), s.size());
    s.clear();
}

/// An allocator that zeroes what it frees: for containers that may hold a secret and copy it
/// when they grow (a string body, a read buffer), so the old block is not freed in clear.
template <class T>
struct WipingAllocator {
    using value_type = T;
    WipingAllocator() = default;
    template <class U>
    WipingAllocator(const WipingAllocator<U>&) noexcept {}
    T* allocate(size_t n) { return std::allocator<T>().allocate(n); }
    void deallocate(T* p, size_t n) noexcept {
        secure_zero(p, n * sizeof(T));
        std::allocator<T>().deallocate(p, n);
    }
    template <class U>
    bool operator==(const WipingAllocator<U>&) const noexcept { return true; }
};

}  // namespace egress
