#pragma once
// How many worker threads "one per CPU" means for this process. std::thread::
// hardware_concurrency() counts the machine's online CPUs: in a Kubernetes pod limited to half
// a CPU on a 64-core node it says 64, and 64 event loops would each hold their own pools and
// caches and be throttled by the quota. The CPUs egressd may use are the fewer of its affinity
// mask (taskset, cpusets) and its cgroup v2 CPU quota (cpu.max, rounded up), as Go 1.25's
// GOMAXPROCS and the JVM count them. cgroup v1 quotas are not read.
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace egress::proxy {

/// The CPUs a cgroup v2 cpu.max line allows ("50000 100000" -> 0.5); nullopt for "max ..."
/// (no quota) or a line that does not parse.
std::optional<double> parse_cpu_max(std::string_view line);

/// The cgroup v2 path in a /proc/self/cgroup text ("0::/kubepods/pod1/c1" -> "/kubepods/pod1/c1");
/// nullopt when the process is not in a v2 hierarchy.
std::optional<std::string> parse_cgroup_v2_path(std::string_view proc_self_cgroup);

/// max(1, min(affinity, ceil(quota))): what the two limits leave.
size_t cpus_allowed(size_t affinity, std::optional<double> quota);

/// The CPUs this process may use now: its affinity mask and the smallest cpu.max quota from
/// its cgroup up to the root of /sys/fs/cgroup. At least 1.
size_t usable_cpus();

}  // namespace egress::proxy
