#include "credstore/secret.h"

#include "common/regular_file.h"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/rand.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/xattr.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <vector>
#include <mutex>
#include <ostream>

#include "common/secure_zero.h"

namespace egress::credstore {

namespace {

constexpr size_t kMaxSecretBytes = 16 * 1024;

// Memory locks do not stack: one munlock() unlocks a page however often it was mlock'ed. Small
// secret buffers share heap pages, so freeing one must not unlock a page another still uses.
// Each page is locked when its first secret buffer arrives and unlocked when its last goes.
// Secrets are made when runs are built, never per request, so one mutex is cheap enough.
class PageLocks {
public:
    void add(const void* p, size_t n) {
        std::lock_guard lock(mu_);
        for_each_page(p, n, [](Page& page, uintptr_t addr, size_t size) {
            // Best effort: RLIMIT_MEMLOCK may refuse; the next buffer on the page retries.
            if (!page.locked) {
                page.locked = ::mlock(reinterpret_cast<void*>(addr), size) == 0;
            }
            ++page.holders;
        });
    }

    void remove(const void* p, size_t n) {
        std::lock_guard lock(mu_);
        for_each_page(p, n, [this](Page& page, uintptr_t addr, size_t size) {
            if (--page.holders == 0) {
                if (page.locked) {
                    (void)::munlock(reinterpret_cast<void*>(addr), size);
                }
                pages_.erase(addr);
            }
        });
    }

private:
    struct Page {
        size_t holders = 0;
        bool locked = false;
    };

    template <class Fn>
    void for_each_page(const void* p, size_t n, Fn fn) {
        const uintptr_t start = reinterpret_cast<uintptr_t>(p) & ~(page_size_ - 1);
        const uintptr_t end = reinterpret_cast<uintptr_t>(p) + n;
        for (uintptr_t addr = start; addr < end; addr += page_size_) {
            fn(pages_[addr], addr, page_size_);
        }
    }

    const size_t page_size_ = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    std::mutex mu_;
    std::map<uintptr_t, Page> pages_;  // page address -> live secret buffers on it
};

PageLocks& page_locks() {
    static auto* locks = new PageLocks();  // never destroyed: secrets may outlive statics
    return *locks;
}

}  // namespace

SecretValue::SecretValue(std::string_view bytes)
    : size_(bytes.size()), capacity_(bytes.empty() ? 1 : bytes.size()) {
    data_ = new char[capacity_];
    page_locks().add(data_, capacity_);  // keeps the bytes out of swap
    if (!bytes.empty()) {
        std::memcpy(data_, bytes.data(), bytes.size());
    }
}

SecretValue::~SecretValue() {
    egress::secure_zero(data_, capacity_);
    page_locks().remove(data_, capacity_);
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
    auto fd = egress::open_regular_file(path);
    if (!fd) {
        return make_error("secret file " + path + ": cannot open: " + fd.error());
    }
    // Read at most one byte past what a valid secret plus "\r\n" may hold.
    std::string content(kMaxSecretBytes + 3, '\0');
    size_t n = 0;
    int err = 0;
    while (n < content.size()) {
        const ssize_t got = ::read(*fd, content.data() + n, content.size() - n);
        if (got < 0 && errno == EINTR) {
            continue;
        }
        if (got <= 0) {
            err = got < 0 ? errno : 0;
            break;
        }
        n += static_cast<size_t>(got);
    }
    ::close(*fd);
    if (err != 0) {
        egress::secure_wipe(content);
        return make_error("secret file " + path + ": read error: " + std::strerror(err));
    }
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

ProcessIds ProcessIds::current() {
    ProcessIds ids;
    ids.euid = ::geteuid();
    ids.groups.push_back(::getegid());
    const int n = ::getgroups(0, nullptr);
    if (n > 0) {
        std::vector<gid_t> more(static_cast<size_t>(n));
        const int got = ::getgroups(n, more.data());
        more.resize(got > 0 ? static_cast<size_t>(got) : 0);
        ids.groups.insert(ids.groups.end(), more.begin(), more.end());
    }
    return ids;
}

std::optional<std::string> not_owner_only(std::string_view key, const std::string& path,
                                          const struct stat& st, const ProcessIds& ids) {
    const unsigned mode = static_cast<unsigned>(st.st_mode) & 07777;
    if ((mode & 077) == 0) {
        return std::nullopt;
    }
    const bool our_group = std::find(ids.groups.begin(), ids.groups.end(), st.st_gid) !=
                           ids.groups.end();
    // With a POSIX ACL the group bits are only its mask: a named user may read it too.
    const bool acl = ::getxattr(path.c_str(), "system.posix_acl_access", nullptr, 0) >= 0;
    if (st.st_uid == 0 && ids.euid != 0 && our_group && (mode & 037) == 0 && !acl) {
        return std::nullopt;  // a Kubernetes Secret under the pod's fsGroup (0440)
    }
    char text[8];
    std::snprintf(text, sizeof text, "%04o", mode);
    return std::string(key) + ": " + path + " is readable by group or others (mode " + text +
           "); chmod 600 it";
}

Result<SecretPtr> load_owner_only_secret_file(std::string_view key, const std::string& path) {
    struct stat st{};
    if (::stat(path.c_str(), &st) != 0) {
        return make_error(std::string(key) + ": " + path + ": " + std::strerror(errno));
    }
    if (auto why = not_owner_only(key, path, st)) {
        return make_error(*why);
    }
    auto secret = load_secret_file(path);
    if (!secret) {
        return make_error(std::string(key) + ": " + secret.error());
    }
    return secret;
}

namespace {

/// Writes `bytes` to `fd` whole and syncs it: 0, or the errno (EIO for a short write).
int write_synced(int fd, std::string_view bytes) {
    if (::fchmod(fd, 0600) != 0) {
        return errno;
    }
    const ssize_t n = ::write(fd, bytes.data(), bytes.size());
    if (n < 0) {
        return errno;
    }
    if (static_cast<size_t>(n) != bytes.size()) {
        return EIO;
    }
    return ::fsync(fd) == 0 ? 0 : errno;
}

/// 0: linked; EEXIST: `path` exists (another creator won); another errno: failed.
/// The file is unnamed until it is linked (O_TMPFILE): nothing is left behind by a crash.
/// -1: this filesystem (or a missing /proc) does not allow it; the caller uses a named temp.
int create_unnamed(const std::string& dir, const std::string& path, std::string_view bytes) {
    const int fd = ::open(dir.c_str(), O_TMPFILE | O_WRONLY | O_CLOEXEC, 0600);
    if (fd < 0) {
        return errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL ? -1 : errno;
    }
    int rc = write_synced(fd, bytes);
    if (rc == 0) {
        const std::string self = "/proc/self/fd/" + std::to_string(fd);
        if (::linkat(AT_FDCWD, self.c_str(), AT_FDCWD, path.c_str(), AT_SYMLINK_FOLLOW) != 0) {
            rc = errno == ENOENT && ::access("/proc/self/fd", F_OK) != 0 ? -1 : errno;
        }
    }
    ::close(fd);
    return rc;
}

/// The same with a named temp beside `path`, of a name no other creator uses, linked (not
/// renamed: link never replaces) and then removed. A crash between the two leaves the temp.
int create_named(const std::string& path, std::string_view bytes) {
    unsigned char nonce[8];
    if (RAND_bytes(nonce, sizeof nonce) != 1) {
        return EIO;
    }
    uint64_t n = 0;
    std::memcpy(&n, nonce, sizeof n);
    const std::string tmp = path + ".tmp." + std::to_string(n);
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {
        return errno;
    }
    int rc = write_synced(fd, bytes);
    ::close(fd);
    if (rc == 0 && ::link(tmp.c_str(), path.c_str()) != 0) {
        rc = errno;
    }
    ::unlink(tmp.c_str());
    return rc;
}

}  // namespace

Result<bool> create_secret_file(const std::string& path, std::string_view bytes, CreateVia via) {
    struct stat st{};
    if (::lstat(path.c_str(), &st) == 0) {
        return false;
    }
    // What an interrupted create of an older egressd left (it used this one name).
    ::unlink((path + ".tmp").c_str());
    const size_t slash = path.rfind('/');
    const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
    // Linked into place, never renamed: when creators race (replicas starting at once on a
    // shared volume), exactly one link succeeds and the others find its whole file.
    int rc = via == CreateVia::Unnamed ? create_unnamed(dir, path, bytes) : -1;
    if (rc == -1) {
        rc = create_named(path, bytes);
    }
    if (rc == EEXIST) {
        // Another creator linked it a moment ago: its folder fsync too, before the caller
        // uses the key (best effort: the creator reports its own failure).
        if (const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); dfd >= 0) {
            ::fsync(dfd);
            ::close(dfd);
        }
        return false;
    }
    if (rc != 0) {
        return make_error("cannot create " + path + ": " + std::strerror(rc));
    }
    const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0 || ::fsync(dfd) != 0) {
        const std::string dir_why = std::strerror(errno);
        if (dfd >= 0) {
            ::close(dfd);
        }
        return make_error("cannot fsync " + dir + ": " + dir_why);
    }
    ::close(dfd);
    return true;
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
