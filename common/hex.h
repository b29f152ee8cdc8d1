#pragma once
// Hex digits of bytes: digests, MACs, random ids, \u00XX and %XX escapes. One encoder for the
// project (OpenSSL's OPENSSL_buf2hexstr writes uppercase with separators; SigV4, our ids and
// the JSON escapes the scrubber matches need lowercase, or uppercase without separators).
#include <cstddef>
#include <string>
#include <string_view>

namespace egress {

/// Appends the two hex digits of each of the `n` bytes at `p` to `out` (anything with
/// push_back(char): a std::string, a wiping buffer), lowercase unless `upper`.
template <class Out>
void append_hex(Out& out, const void* p, size_t n, bool upper = false) {
    const char* const digits = upper ? "0123456789ABCDEF" : "0123456789abcdef";
    const auto* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) {
        out.push_back(digits[b[i] >> 4]);
        out.push_back(digits[b[i] & 15]);
    }
}

/// The bytes at `p` as lowercase hex. One byte of room is kept past the digits: a caller may
/// append a newline (the admin token written to its file) without a reallocation, which would
/// free a copy of a secret unwiped.
inline std::string to_hex(const void* p, size_t n) {
    std::string out;
    out.reserve(2 * n + 1);
    append_hex(out, p, n);
    return out;
}

inline std::string to_hex(std::string_view bytes) { return to_hex(bytes.data(), bytes.size()); }

}  // namespace egress
