#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
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
    auto fd = std::make_shared<RegisteredConn>();  // no socket: nothing to shut down
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

// close_run shuts each connection down on its own executor and leaves why with it, for its
// requests' audit records; the drain's close_all leaves no reason (it says so itself).
TEST(ConnectionRegistry, CloseRunLeavesWhyWithTheConnection) {
    net::io_context ioc;
    ConnectionRegistry reg;
    int revoked[2];
    int drained[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, revoked), 0);
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, drained), 0);
    auto a = std::make_shared<RegisteredConn>(RegisteredConn{revoked[0]});
    auto b = std::make_shared<RegisteredConn>(RegisteredConn{drained[0]});
    ASSERT_NE(reg.add("r1", 10, ioc.get_executor(), a), 0u);
    ASSERT_NE(reg.add("r2", 10, ioc.get_executor(), b), 0u);
    EXPECT_EQ(reg.close_run("r1", std::chrono::milliseconds(0), "run_revoked"), 1u);
    EXPECT_EQ(a->cut, nullptr);  // not before it runs on the connection's executor
    EXPECT_EQ(reg.close_all(), 2u);  // r1's connection is still registered, and r2's
    ioc.run();
    ASSERT_NE(a->cut, nullptr);
    EXPECT_STREQ(a->cut, "run_revoked");
    EXPECT_EQ(b->cut, nullptr);
    char byte;
    EXPECT_EQ(::read(revoked[1], &byte, 1), 0);  // shut down: the peer reads its end
    EXPECT_EQ(::read(drained[1], &byte, 1), 0);
    for (int fd : {revoked[0], revoked[1], drained[0], drained[1]}) {
        ::close(fd);
    }
}

}  // namespace
}  // namespace egress::proxy
