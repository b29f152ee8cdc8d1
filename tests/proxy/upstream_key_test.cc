#include "proxy/upstream.h"

#include <gtest/gtest.h>

namespace egress::proxy {
namespace {

// The idle-pool key names one run and one destination: the run, a newline (never in a run id
// or a host), and the destination's authority exactly as HostPort::authority() writes it.
TEST(UpstreamPoolKey, IsTheRunAndTheAuthority) {
    for (const policy::HostPort& dest :
         {policy::HostPort{"api.github.com", 443}, policy::HostPort{"127.0.0.1", 1},
          policy::HostPort{"::1", 65535}, policy::HostPort{"2001:db8::5", 8443}}) {
        EXPECT_EQ(UpstreamPool::key("run-1", dest), "run-1\n" + dest.authority());
    }
    EXPECT_EQ(UpstreamPool::key("r", {"::1", 443}), "r\n[::1]:443");
    EXPECT_NE(UpstreamPool::key("a", {"b.test", 443}), UpstreamPool::key("a", {"b.test", 444}));
    EXPECT_NE(UpstreamPool::key("a", {"b.test", 443}), UpstreamPool::key("b", {"b.test", 443}));
}

}  // namespace
}  // namespace egress::proxy
