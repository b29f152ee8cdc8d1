#pragma once
// Base64 (RFC 4648, padded) through OpenSSL's EVP_EncodeBlock: one encoder for the project.
// The output is one allocation, sized so that appending one byte does not reallocate (a
// caller may add a newline to a wrapped key and wipe the one buffer).
#include <openssl/evp.h>

#include <string>
#include <string_view>

namespace egress {

inline std::string base64_encode(std::string_view bytes) {
    std::string out(4 * ((bytes.size() + 2) / 3) + 1, '\0');
    const int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                  reinterpret_cast<const unsigned char*>(bytes.data()),
                                  static_cast<int>(bytes.size()));
    out.resize(n < 0 ? 0 : static_cast<size_t>(n));
    return out;
}

}  // namespace egress
