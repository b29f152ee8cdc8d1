#include "proxy/malloc_tuning.h"

#include <sys/auxv.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <string_view>

namespace egress::proxy {

std::optional<std::string> tuned_glibc_tunables(const char* inherited) {
    const std::string_view current = inherited == nullptr ? std::string_view{} : inherited;
    // Tunables are name=value pairs separated by ':'; a name matches only whole.
    for (size_t pos = 0; pos <= current.size();) {
        const size_t end = std::min(current.find(':', pos), current.size());
        const std::string_view pair = current.substr(pos, end - pos);
        if (pair.substr(0, pair.find('=')) == "glibc.malloc.tcache_count") {
            return std::nullopt;
        }
        pos = end + 1;
    }
    std::string tuned{current};
    if (!tuned.empty()) {
        tuned += ':';
    }
    tuned += "glibc.malloc.tcache_count=" + std::to_string(kTcacheCount);
    return tuned;
}

void reexec_with_malloc_tuning(char** argv) {
#ifdef __GLIBC__
    if (::getauxval(AT_SECURE) != 0) {
        return;  // glibc ignores the tunable in a set-id process anyway
    }
    // After the exec, getenv sees the string set here whole (glibc parses a copy), so the
    // second start finds the count and goes on: one exec at most.
    const char* inherited = std::getenv("GLIBC_TUNABLES");
    const std::optional<std::string> before =
        inherited == nullptr ? std::nullopt : std::optional<std::string>(inherited);
    const auto tuned = tuned_glibc_tunables(inherited);
    if (!tuned) {
        return;
    }
    // The binary's own path, not /proc/self/exe itself: exec names the process after the
    // file it runs (pgrep, ps, top would show "exe").
    char path[4096];
    const ssize_t n = ::readlink("/proc/self/exe", path, sizeof path - 1);
    if (n <= 0 || static_cast<size_t>(n) >= sizeof path - 1) {
        return;
    }
    path[n] = '\0';
    if (::setenv("GLIBC_TUNABLES", tuned->c_str(), 1) != 0) {
        return;
    }
    ::execv(path, argv);
    // Not reached unless exec failed (no /proc, the binary replaced or removed since start):
    // carry on untuned, with the environment as it was.
    if (before) {
        ::setenv("GLIBC_TUNABLES", before->c_str(), 1);
    } else {
        ::unsetenv("GLIBC_TUNABLES");
    }
#else
    (void)argv;
#endif
}

}  // namespace egress::proxy
