#pragma once
// The trust store a CA bundle starts from (the system roots plus a run CA, for clients whose
// SSL_CERT_FILE, REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE or GIT_SSL_CAINFO replaces their roots):
// egressctl's `run create --ca-bundle-out` and egressd's `runs[].ca_bundle_out` read it here.
// Header-only (libcrypto for OpenSSL's default file name): egressctl links no TLS library.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <openssl/x509.h>

#include "common/regular_file.h"
#include "common/result.h"

namespace egress {

/// Where the system roots are when no file is named: OpenSSL's default certificate file
/// (/usr/lib/ssl/cert.pem on Debian), else Debian's bundle. Not $SSL_CERT_FILE: in a shell
/// that pointed clients at an earlier bundle it names that bundle, and each new one would grow
/// by a CA.
inline std::vector<std::string> default_root_files() {
    return {X509_get_default_cert_file(), "/etc/ssl/certs/ca-certificates.crt"};
}

/// Reads a PEM trust file: at most 64 MiB, at least one certificate; the text ends in a line
/// end, so a CA appended to it starts on a line of its own. Errors say what is wrong with the
/// file, without its name (the caller names the key or option that gave it).
inline Result<std::string> read_root_file(const std::string& path) {
    constexpr size_t kMaxBytes = 64u << 20;
    auto opened = open_regular_file(path);
    if (!opened) {
        return make_error(opened.error());
    }
    const int fd = *opened;
    std::string text;
    char buf[65536];
    for (;;) {
        const ssize_t n = ::read(fd, buf, sizeof buf);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n < 0) {
            const int err = errno;
            ::close(fd);
            return make_error(std::strerror(err));
        }
        if (n == 0) {
            break;
        }
        text.append(buf, static_cast<size_t>(n));
        if (text.size() > kMaxBytes) {
            ::close(fd);
            return make_error("larger than 64 MiB");
        }
    }
    ::close(fd);
    if (text.find("-----BEGIN CERTIFICATE-----") == std::string::npos) {
        return make_error("no PEM certificate in it");
    }
    if (text.back() != '\n') {
        text += '\n';
    }
    return text;
}

/// The first of default_root_files() that is a regular file, or none.
inline std::optional<std::string> find_default_root_file() {
    for (auto& path : default_root_files()) {
        std::error_code ec;
        if (std::filesystem::is_regular_file(path, ec)) {
            return std::move(path);
        }
    }
    return std::nullopt;
}

}  // namespace egress
