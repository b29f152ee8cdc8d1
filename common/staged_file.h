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
#include <utility>

#include "common/result.h"

namespace egress {

/// A file staged beside `path`: created at once (mkostemp: O_EXCL, a random name, `mode`),
/// written later. A caller that must not act unless the file can be written (egressctl run
/// create: no run nobody can find) creates it first. Unless `finish` succeeded, the temporary
/// is closed and removed when the StagedFile goes away.
class StagedFile {
public:
    static Result<StagedFile> create_beside(const std::string& path, mode_t mode) {
        StagedFile f;
        f.tmp_ = path + ".tmp.XXXXXX";
        f.fd_ = ::mkostemp(f.tmp_.data(), O_CLOEXEC);
        if (f.fd_ < 0) {
            return make_error("cannot create a file beside " + path + ": " +
                              std::strerror(errno));
        }
        f.kept_ = false;  // ours now: removed unless finished
        if (::fchmod(f.fd_, mode) != 0) {
            return make_error("cannot write " + f.tmp_ + ": " + std::strerror(errno));
        }
        return f;
    }

    StagedFile(StagedFile&& o) noexcept
        : fd_(std::exchange(o.fd_, -1)), tmp_(std::move(o.tmp_)), kept_(o.kept_) {
        o.kept_ = true;
    }
    StagedFile& operator=(StagedFile&&) = delete;
    ~StagedFile() {
        if (fd_ >= 0) {
            ::close(fd_);
        }
        if (!kept_) {
            ::unlink(tmp_.c_str());
        }
    }

    /// Writes `content`, fsyncs and closes; returns the temporary's name, which the caller
    /// renames over the target (rename(2) replaces the name, never follows it) or removes.
    /// Call once.
    Result<std::string> finish(std::string_view content) {
        size_t done = 0;
        bool ok = fd_ >= 0;
        while (ok && done < content.size()) {
            const ssize_t n = ::write(fd_, content.data() + done, content.size() - done);
            if (n < 0 && errno == EINTR) {
                continue;
            }
            ok = n > 0;
            done += n > 0 ? static_cast<size_t>(n) : 0;
        }
        ok = ok && ::fsync(fd_) == 0;
        const int err = errno;
        if (fd_ >= 0) {
            ::close(fd_);
            fd_ = -1;
        }
        if (!ok) {
            return make_error("cannot write " + tmp_ + ": " + std::strerror(err));
        }
        kept_ = true;
        return tmp_;
    }

private:
    StagedFile() = default;
    int fd_ = -1;
    std::string tmp_;
    bool kept_ = true;  // nothing to remove (not created, moved from, or finished)
};

/// Writes `content` to a new file beside `path` (mode `mode`, fsync'ed) and returns its name;
/// the caller renames it over `path` (rename(2) replaces the name, never follows it) or
/// removes it. Errors name the file and the cause.
inline Result<std::string> stage_file_beside(const std::string& path, std::string_view content,
                                             mode_t mode) {
    auto f = StagedFile::create_beside(path, mode);
    if (!f) {
        return make_error(f.error());
    }
    return f->finish(content);
}

}  // namespace egress
