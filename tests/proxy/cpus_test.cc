#include "proxy/cpus.h"

#include <sched.h>

#include <gtest/gtest.h>

namespace egress::proxy {
namespace {

TEST(Cpus, CpuMaxLines) {
    EXPECT_EQ(parse_cpu_max("50000 100000\n"), 0.5);
    EXPECT_EQ(parse_cpu_max("200000 100000"), 2.0);
    EXPECT_EQ(parse_cpu_max("150000 100000\n"), 1.5);
    EXPECT_EQ(parse_cpu_max("max 100000\n"), std::nullopt);  // no quota
    for (const char* bad : {"", "\n", "50000", "0 100000", "50000 0", "-1 100000", "5e4 100000",
                            "50000 100000 7", "x y"}) {
        EXPECT_EQ(parse_cpu_max(bad), std::nullopt) << bad;
    }
}

TEST(Cpus, CgroupV2PathFromProcSelfCgroup) {
    EXPECT_EQ(parse_cgroup_v2_path("0::/kubepods/burstable/pod1/c1\n"),
              "/kubepods/burstable/pod1/c1");
    EXPECT_EQ(parse_cgroup_v2_path("0::/\n"), "/");  // inside a cgroup namespace
    // A hybrid host lists the v1 hierarchies first.
    EXPECT_EQ(parse_cgroup_v2_path("12:cpu,cpuacct:/x\n1:name=systemd:/y\n0::/user.slice\n"),
              "/user.slice");
    EXPECT_EQ(parse_cgroup_v2_path("12:cpu,cpuacct:/x\n1:name=systemd:/y\n"), std::nullopt);
    EXPECT_EQ(parse_cgroup_v2_path(""), std::nullopt);
}

TEST(Cpus, TheFewerOfAffinityAndQuotaRoundedUp) {
    EXPECT_EQ(cpus_allowed(64, 0.5), 1u);   // a 500m sidecar on a 64-core node
    EXPECT_EQ(cpus_allowed(64, 1.5), 2u);
    EXPECT_EQ(cpus_allowed(64, 4.0), 4u);
    EXPECT_EQ(cpus_allowed(2, 8.0), 2u);    // quota above the CPUs it may run on
    EXPECT_EQ(cpus_allowed(8, std::nullopt), 8u);
    EXPECT_EQ(cpus_allowed(0, std::nullopt), 1u);
    EXPECT_EQ(cpus_allowed(4, 0.001), 1u);
}

TEST(Cpus, UsableCpusAreWithinThisProcesssAffinity) {
    cpu_set_t set;
    CPU_ZERO(&set);
    ASSERT_EQ(sched_getaffinity(0, sizeof set, &set), 0);
    const size_t n = usable_cpus();
    EXPECT_GE(n, 1u);
    EXPECT_LE(n, static_cast<size_t>(CPU_COUNT(&set)));
}

}  // namespace
}  // namespace egress::proxy
