#pragma once
// Zeroing the dead stack below a frame that handled key material.
//
// A key's bytes can be left in the stack frames of the functions that used it, out of our
// reach: OpenSSL's key setup and digests, the standard library's copies. Those frames are
// dead once the calls return, but their bytes stay until a later call happens to overwrite
// them: an ASan build (larger frames, so no later call reached the spot) kept the master key
// in the main thread's stack for the process's life, past its rotation (test_kek_rotation).
// Called right after key handling, from the frame that made those calls, this overwrites the
// region where their frames were.
#include <cstddef>

#include "common/secure_zero.h"

namespace egress {

inline constexpr size_t kBurnStackBytes = 64 * 1024;

/// Zeroes kBurnStackBytes of stack below the caller's frame (noinline: its frame lies below
/// the caller's, where the caller's callees ran).
[[gnu::noinline]] inline void burn_stack() {
    char dead[kBurnStackBytes];
    secure_zero(dead, sizeof dead);
    asm volatile("" : : "r"(dead) : "memory");  // the buffer is used: kept, and zeroed
}

}  // namespace egress
