#pragma once
// A file that reaches its place whole: written under a temporary name beside it, then renamed.
// The temporary is made by mkstemp (O_EXCL, a random name), so a symlink or file another user
// planted at a predictable name ("ca.pem.tmp", "ca.pem.tmp.<pid>") in a shared folder is never
// followed or truncated: egressd often runs as root, and ca_cert_out / --ca-out are usually in
// a folder the sandbox can see.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#include "common/result.h"

namespace egress {

/// Writes `content` to a new file beside `path` (mode `mode`, fsync'ed) and returns its name;
/// the caller renames it over `path` (rename(2) replaces the name, never follows it) or
/// removes it. Errors name the file and the cause.
inline Result<std::string> stage_file_beside(const std::string& path, std::string_view content,
                                             mode_t mode) {
    std::string tmp = path + ".tmp.XXXXXX";
    const int fd = ::mkostemp(tmp.data(), O_CLOEXEC);
    if (fd < 0) {
        return make_error("cannot create a file beside " + path + ": " + std::strerror(errno));
    }
    size_t done = 0;
    bool ok = ::fchmod(fd, mode) == 0;
    while (ok && done < content.size()) {
        const ssize_t n = ::write(fd, content.data() + done, content.size() - done);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        ok = n > 0;
        done += n > 0 ? static_cast<size_t>(n) : 0;
    }
    ok = ok && ::fsync(fd) == 0;
    const int err = errno;
    ::close(fd);
    if (!ok) {
        ::unlink(tmp.c_str());
        return make_error("cannot write " + tmp + ": " + std::strerror(err));
    }
    return tmp;
}

}  // namespace egress
