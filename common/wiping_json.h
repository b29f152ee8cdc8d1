#pragma once
// boost::json's allocator for documents that hold a secret value (an admin request's body, a
// new run's answer, a credentials document egressctl sends): every block is zeroed when it is
// freed, so a value leaves no copy behind, also when a parse fails halfway or a string grows.
#include <cstddef>
#include <new>

#include <boost/json/memory_resource.hpp>

#include "common/secure_zero.h"

namespace egress {

class WipingJsonResource final : public boost::json::memory_resource {
    // The aligned forms only for over-aligned requests: boost::json deallocates with the
    // alignment it allocated with, and the two must pair (operator new(n) with delete(p, n)).
    void* do_allocate(size_t n, size_t align) override {
        if (align > __STDCPP_DEFAULT_NEW_ALIGNMENT__) {
            return ::operator new(n, std::align_val_t(align));
        }
        return ::operator new(n);
    }
    void do_deallocate(void* p, size_t n, size_t align) override {
        secure_zero(p, n);
        if (align > __STDCPP_DEFAULT_NEW_ALIGNMENT__) {
            ::operator delete(p, n, std::align_val_t(align));
        } else {
            ::operator delete(p, n);
        }
    }
    bool do_is_equal(const boost::json::memory_resource& other) const noexcept override {
        return this == &other;
    }
};

}  // namespace egress
