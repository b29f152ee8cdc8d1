#pragma once
// Opening a file egressd reads (config, secrets, keys, trust roots) so that what sits at the
// path cannot hang the reader: a FIFO blocks open(2) until a writer comes (and a reload, the
// control thread's sweeps and the drain with it). O_NONBLOCK makes that open return at once,
// and anything but a regular file is then refused, naming what it is.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "common/result.h"

namespace egress {

/// A descriptor (>= 0, the caller closes it) open for reading on the regular file at `path`,
/// or an error text without the path: strerror, or "is not a regular file". O_NONBLOCK stays
/// set: reads of a regular file never block on it.
inline Result<int> open_regular_file(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) {
        return Error{std::strerror(errno)};
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
        const int err = errno;
        ::close(fd);
        return Error{std::strerror(err)};
    }
    if (!S_ISREG(st.st_mode)) {
        ::close(fd);
        return Error{S_ISDIR(st.st_mode) ? "is a folder, not a regular file"
                                         : "is not a regular file (a FIFO, socket or device)"};
    }
    return fd;
}

}  // namespace egress
