#include "proxy/malloc_tuning.h"

#include <string>

#include <gtest/gtest.h>

namespace egress::proxy {
namespace {

const std::string kOurs = "glibc.malloc.tcache_count=" + std::to_string(kTcacheCount);

TEST(MallocTuning, UnsetOrEmptyTunablesGetTheTcacheCount) {
    EXPECT_EQ(tuned_glibc_tunables(nullptr), kOurs);
    EXPECT_EQ(tuned_glibc_tunables(""), kOurs);
}

TEST(MallocTuning, OtherTunablesAreKeptAndTheCountAppended) {
    EXPECT_EQ(tuned_glibc_tunables("glibc.malloc.arena_max=2"),
              "glibc.malloc.arena_max=2:" + kOurs);
    EXPECT_EQ(tuned_glibc_tunables("glibc.malloc.tcache_max=4096:glibc.malloc.mxfast=0"),
              "glibc.malloc.tcache_max=4096:glibc.malloc.mxfast=0:" + kOurs);
}

TEST(MallocTuning, AnOperatorsOwnTcacheCountWins) {
    EXPECT_EQ(tuned_glibc_tunables("glibc.malloc.tcache_count=7"), std::nullopt);
    EXPECT_EQ(tuned_glibc_tunables("glibc.malloc.arena_max=2:glibc.malloc.tcache_count=0"),
              std::nullopt);
}

TEST(MallocTuning, OnlyTheWholeTunableNameCounts) {
    // A longer name that starts with ours, or ours as a value, is not the tunable.
    EXPECT_EQ(tuned_glibc_tunables("glibc.malloc.tcache_count_x=1"),
              "glibc.malloc.tcache_count_x=1:" + kOurs);
    EXPECT_EQ(tuned_glibc_tunables("x.y=glibc.malloc.tcache_count"),
              "x.y=glibc.malloc.tcache_count:" + kOurs);
}

}  // namespace
}  // namespace egress::proxy
