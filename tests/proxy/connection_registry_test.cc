#include <memory>

#include "proxy/worker.h"

#include <gtest/gtest.h>

namespace egress::proxy {
namespace {

// limits.connections_per_run is counted by run id in the registry: up to the limit per run,
// each run apart, a slot given back is usable again, and a refused add registers nothing.
TEST(ConnectionRegistry, AdmitsUpToTheLimitPerRunId) {
    net::io_context ioc;
    ConnectionRegistry reg;
    auto fd = std::make_shared<int>(-1);  // no socket: nothing to shut down
    const uint64_t a = reg.add("r1", 2, ioc.get_executor(), fd);
    const uint64_t b = reg.add("r1", 2, ioc.get_executor(), fd);
    EXPECT_NE(a, 0u);
    EXPECT_NE(b, 0u);
    EXPECT_NE(a, b);
    EXPECT_EQ(reg.add("r1", 2, ioc.get_executor(), fd), 0u);
    EXPECT_EQ(reg.add("r1", 2, ioc.get_executor(), fd), 0u);  // the refusals took no slot
    EXPECT_NE(reg.add("r2", 2, ioc.get_executor(), fd), 0u);  // another run: its own count
    reg.remove("r1", a);
    const uint64_t c = reg.add("r1", 2, ioc.get_executor(), fd);
    EXPECT_NE(c, 0u);
    EXPECT_EQ(reg.add("r1", 2, ioc.get_executor(), fd), 0u);
    EXPECT_EQ(reg.close_run("r1"), 2u);  // b and c are what the run has registered
    EXPECT_EQ(reg.add("r3", 0, ioc.get_executor(), fd), 0u);  // a limit of 0 admits none
    EXPECT_EQ(reg.close_run("r3"), 0u);
}

}  // namespace
}  // namespace egress::proxy
