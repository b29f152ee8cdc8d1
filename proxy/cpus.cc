#include "proxy/cpus.h"

#include <sched.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <sstream>
#include <thread>

namespace egress::proxy {

namespace {

std::optional<double> parse_positive(std::string_view s) {
    uint64_t v = 0;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec != std::errc() || end != s.data() + s.size() || v == 0) {
        return std::nullopt;
    }
    return static_cast<double>(v);
}

std::optional<std::string> read_file(const std::string& path) {
    std::ifstream in(path);
    if (!in) {
        return std::nullopt;
    }
    std::ostringstream out;
    out << in.rdbuf();
    return out.str();
}

}  // namespace

std::optional<double> parse_cpu_max(std::string_view line) {
    while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) {
        line.remove_suffix(1);
    }
    const size_t space = line.find(' ');
    if (space == std::string_view::npos) {
        return std::nullopt;
    }
    const auto quota = parse_positive(line.substr(0, space));  // "max": no quota
    const auto period = parse_positive(line.substr(space + 1));
    if (!quota || !period) {
        return std::nullopt;
    }
    return *quota / *period;
}

std::optional<std::string> parse_cgroup_v2_path(std::string_view text) {
    // One line per hierarchy, "ID:CONTROLLERS:PATH"; v2 is the one with ID 0 and no controllers.
    while (!text.empty()) {
        const size_t eol = std::min(text.find('\n'), text.size());
        const std::string_view line = text.substr(0, eol);
        if (line.starts_with("0::/")) {
            return std::string(line.substr(3));
        }
        text.remove_prefix(std::min(eol + 1, text.size()));
    }
    return std::nullopt;
}

size_t cpus_allowed(size_t affinity, std::optional<double> quota) {
    size_t n = std::max<size_t>(affinity, 1);
    if (quota) {
        const double whole = std::ceil(*quota);
        if (whole < static_cast<double>(n)) {
            n = static_cast<size_t>(std::max(whole, 1.0));
        }
    }
    return n;
}

size_t usable_cpus() {
    size_t affinity = std::thread::hardware_concurrency();
    cpu_set_t set;
    CPU_ZERO(&set);
    if (::sched_getaffinity(0, sizeof set, &set) == 0) {
        affinity = static_cast<size_t>(CPU_COUNT(&set));
    }
    std::optional<double> quota;
    if (const auto self = read_file("/proc/self/cgroup")) {
        if (auto path = parse_cgroup_v2_path(*self)) {
            // Every level's quota applies; the smallest binds. Inside a cgroup namespace the
            // path is "/" and /sys/fs/cgroup is the container's own cgroup.
            std::string dir = *path;
            while (true) {
                if (const auto line = read_file("/sys/fs/cgroup" + dir + "/cpu.max")) {
                    if (const auto q = parse_cpu_max(*line); q && (!quota || *q < *quota)) {
                        quota = q;
                    }
                }
                if (dir.empty() || dir == "/") {
                    break;
                }
                dir.resize(dir.rfind('/'));
            }
        }
    }
    return cpus_allowed(affinity, quota);
}

}  // namespace egress::proxy
