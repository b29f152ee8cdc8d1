#pragma once
// A credential value in memory. Never printable: streaming or formatting it prints
// "<redacted>". Its bytes live in a buffer whose pages stay mlock'ed while any SecretValue
// uses them (best effort, RLIMIT_MEMLOCK permitting, so they stay out of swap; locks are
// counted per page because buffers share pages and munlock does not stack), and are wiped
// (secure_zero) when the value is destroyed.
#include <sys/stat.h>
#include <sys/types.h>

#include <cstddef>
#include <iosfwd>
#include <memory>
#include <string>
#include <optional>
#include <string_view>
#include <vector>

#include "common/result.h"

namespace egress::credstore {

class SecretValue {
public:
    explicit SecretValue(std::string_view bytes);
    ~SecretValue();
    SecretValue(const SecretValue&) = delete;
    SecretValue& operator=(const SecretValue&) = delete;

    /// The raw bytes. Callers must not log, copy into long-lived strings, or return them.
    std::string_view reveal() const { return {data_, size_}; }
    size_t size() const { return size_; }

private:
    char* data_ = nullptr;
    size_t size_ = 0;
    size_t capacity_ = 0;
};

using SecretPtr = std::shared_ptr<const SecretValue>;

std::ostream& operator<<(std::ostream& os, const SecretValue&);  // prints "<redacted>"

/// Checks a value that is about to become a secret: non-empty, at most 16 KiB, no CR, LF or
/// NUL (a secret with CR/LF could split a header when injected).
Result<bool> validate_secret_bytes(std::string_view bytes);

/// Reads a mounted secret file. One trailing "\n" or "\r\n" is removed (files written by
/// `echo` or by Kubernetes often have one); then validate_secret_bytes applies. The error
/// message names the path and the problem, never the content.
Result<SecretPtr> load_secret_file(const std::string& path);

/// Who egressd runs as, for not_owner_only (a parameter so that tests running as root can
/// ask what a non-root egressd would be told).
struct ProcessIds {
    uid_t euid = 0;
    std::vector<gid_t> groups;  // effective and supplementary
    static ProcessIds current();
};

/// An error naming the config key `key` when the file `path` (its stat `st`) may be read by
/// anyone but egressd: a file that grants what egressd's keys grant (the master key, the
/// admin token) must be its owner's alone (0600, 0400). Nothing when it is. One exception:
/// a file root owns, readable by a group egressd is in and by nobody else (0440), when
/// egressd is not root: a Kubernetes Secret as the kubelet mounts it for a non-root
/// container (its fsGroup; the volume is mounted into egressd's container only), which
/// egressd could not read otherwise (as PostgreSQL accepts a root-owned 0640 key); not when
/// the file has a POSIX ACL (its group bits are then only the ACL's mask).
std::optional<std::string> not_owner_only(std::string_view key, const std::string& path,
                                          const struct stat& st,
                                          const ProcessIds& ids = ProcessIds::current());

/// load_secret_file for a file that must be its owner's alone (not_owner_only); errors start
/// with `key`.
Result<SecretPtr> load_owner_only_secret_file(std::string_view key, const std::string& path);

/// Creates the file `path` (mode 0600) holding `bytes`, so that it never exists incomplete: the
/// bytes go to an unnamed file in its folder (O_TMPFILE; where the filesystem has none, a temp
/// of a random name beside it), which is fsync'ed, linked to `path` (link never replaces a
/// file), and the folder fsync'ed. A crash leaves either no `path` or the whole file, never an
/// empty one that would block every later start. Returns false, writing nothing, if `path`
/// exists, also when another process created it meanwhile: of creators that race, exactly one
/// gets true and the others read its file. Errors name the path, never the content.
/// `Named` skips the unnamed file (for tests of the fallback).
enum class CreateVia { Unnamed, Named };
Result<bool> create_secret_file(const std::string& path, std::string_view bytes,
                                CreateVia via = CreateVia::Unnamed);

/// Constant-time comparison for tokens.
bool constant_time_equals(std::string_view a, std::string_view b);

}  // namespace egress::credstore
