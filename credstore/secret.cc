#include "credstore/secret.h"

#include <openssl/crypto.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <ostream>

#include "common/secure_zero.h"

namespace egress::credstore {

namespace {

constexpr size_t kMaxSecretBytes = 16 * 1024;

}  // namespace

SecretValue::SecretValue(std::string_view bytes)
    : size_(bytes.size()), capacity_(bytes.empty() ? 1 : bytes.size()) {
    data_ = new char[capacity_];
    // Best effort: keep the bytes out of swap. RLIMIT_MEMLOCK may refuse; that is not fatal.
    (void)mlock(data_, capacity_);
    if (!bytes.empty()) {
        std::memcpy(data_, bytes.data(), bytes.size());
    }
}

SecretValue::~SecretValue() {
    egress::secure_zero(data_, capacity_);
    (void)munlock(data_, capacity_);
    delete[] data_;
}

std::ostream& operator<<(std::ostream& os, const SecretValue&) {
    return os << "<redacted>";
}

Result<bool> validate_secret_bytes(std::string_view bytes) {
    if (bytes.empty()) {
        return make_error("secret is empty");
    }
    if (bytes.size() > kMaxSecretBytes) {
        return make_error("secret is longer than 16 KiB");
    }
    if (bytes.find_first_of(std::string_view("\r\n\0", 3)) != std::string_view::npos) {
        return make_error("secret contains CR, LF or NUL");
    }
    return true;
}

Result<SecretPtr> load_secret_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) {
        return make_error("secret file " + path + ": cannot open: " + std::strerror(errno));
    }
    // Read at most one byte past what a valid secret plus "\r\n" may hold.
    std::string content(kMaxSecretBytes + 3, '\0');
    in.read(content.data(), static_cast<std::streamsize>(content.size()));
    if (in.bad()) {
        egress::secure_wipe(content);
        return make_error("secret file " + path + ": read error");
    }
    const size_t n = static_cast<size_t>(in.gcount());
    std::string_view value(content.data(), n);
    if (value.ends_with("\r\n")) {
        value.remove_suffix(2);
    } else if (value.ends_with('\n')) {
        value.remove_suffix(1);
    }
    Result<bool> valid = validate_secret_bytes(value);
    if (!valid) {
        egress::secure_wipe(content);
        return make_error("secret file " + path + ": " + valid.error());
    }
    SecretPtr secret = std::make_shared<const SecretValue>(value);
    egress::secure_wipe(content);
    return secret;
}

bool constant_time_equals(std::string_view a, std::string_view b) {
    // The length is not secret; the bytes are compared without an early exit.
    if (a.size() != b.size()) {
        return false;
    }
    if (a.empty()) {
        return true;
    }
    return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace egress::credstore
