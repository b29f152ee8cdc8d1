// The resolver's deadline: limits.dns_timeout bounds a whole lookup, and what c-ares reports
// after it is dropped without touching the coroutine that stopped waiting.
#include "proxy/resolver.h"

#include <gtest/gtest.h>

#include <boost/asio.hpp>
#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace egress::proxy {
namespace {

namespace net = boost::asio;
using namespace std::chrono_literals;
using Answer = Result<std::vector<policy::IpAddress>>;

/// Runs resolve(host) on ioc until it returns (at most `limit` of loop time).
std::optional<Answer> resolve_on(net::io_context& ioc, Resolver& r, std::string host,
                                 std::chrono::seconds limit = 10s) {
    std::optional<Answer> out;
    net::co_spawn(
        ioc, [&]() -> net::awaitable<void> { out = co_await r.resolve(host); }, net::detached);
    const auto end = std::chrono::steady_clock::now() + limit;
    while (!out && std::chrono::steady_clock::now() < end) {
        if (ioc.stopped()) {
            ioc.restart();
        }
        ioc.run_one_for(100ms);
    }
    return out;
}

/// DNS servers that never answer: UDP sockets bound on loopback and never read.
struct SilentServers {
    SilentServers(net::io_context& ioc, int n) {
        for (int i = 0; i < n; ++i) {
            sockets.emplace_back(ioc,
                                 net::ip::udp::endpoint(net::ip::make_address("127.0.0.1"), 0));
            addresses.push_back("127.0.0.1:" +
                                std::to_string(sockets.back().local_endpoint().port()));
        }
    }
    std::vector<net::ip::udp::socket> sockets;
    std::vector<std::string> addresses;
};

TEST(Resolver, CAresScheduleEndsInsideTheBudget) {
    net::io_context ioc;
    // Two servers that never answer (bound, never read): c-ares tries each twice, and its
    // per-try timeout is sized so that all of it ends inside the budget (1 s: 4 tries end at
    // 857 ms): the lookup ends with c-ares' own timeout, before the resolver's deadline (with
    // half the budget per try it would have run 3 x the budget, cut by the deadline).
    SilentServers silent(ioc, 2);
    const std::vector<std::string>& servers = silent.addresses;
    Resolver r(ioc, servers, {}, 1000ms);
    std::optional<Answer> out = resolve_on(ioc, r, "nx.resolver-test.invalid");
    ASSERT_TRUE(out.has_value());
    ASSERT_FALSE(out->ok());
    EXPECT_EQ(out->error(), "dns_failure: Timeout while contacting DNS servers");
}

TEST(Resolver, DeadlineEndsTheLookupNotCAres) {
    net::io_context ioc;
    // A budget too small for c-ares' schedule (its tries are at least 1 ms: 3 servers x 3 ms
    // > 5 ms): the lookup ends at the resolver's own deadline, c-ares finishing later.
    SilentServers silent(ioc, 3);
    const std::vector<std::string>& servers = silent.addresses;
    Resolver r(ioc, servers, {}, 5ms);
    std::optional<Answer> out = resolve_on(ioc, r, "nx.resolver-test.invalid");
    ASSERT_TRUE(out.has_value());
    ASSERT_FALSE(out->ok());
    // Our deadline's message, not c-ares' own "Timeout while contacting DNS servers".
    EXPECT_EQ(out->error(), "dns_failure: no answer within 5ms");

    // c-ares keeps retrying, then completes the abandoned lookup; the loop then runs out of
    // work (every socket and timer released), with nothing resumed twice.
    ioc.restart();
    ioc.run_for(10s);
    EXPECT_TRUE(ioc.stopped());

    // The channel is still usable afterwards.
    out = resolve_on(ioc, r, "nx2.resolver-test.invalid");
    ASSERT_TRUE(out.has_value());
    EXPECT_FALSE(out->ok());
}

TEST(Resolver, AnswerGivenAtOnceIsNotWaitedFor) {
    net::io_context ioc;
    net::ip::udp::socket silent(ioc,
                                net::ip::udp::endpoint(net::ip::make_address("127.0.0.1"), 0));
    // c-ares answers "localhost" from the hosts file inside ares_getaddrinfo, before the
    // resolver starts waiting: that answer must be taken, not the deadline's failure.
    Resolver r(ioc, {"127.0.0.1:" + std::to_string(silent.local_endpoint().port())}, {}, 30s);
    std::optional<Answer> out = resolve_on(ioc, r, "localhost");
    ASSERT_TRUE(out.has_value());
    ASSERT_TRUE(out->ok()) << out->error();
    ASSERT_FALSE((*out)->empty());
    const std::string first = (*out)->front().to_string();
    EXPECT_TRUE(first == "127.0.0.1" || first == "::1") << first;
}

TEST(Resolver, LiteralsAndOverridesNeedNoQuery) {
    net::io_context ioc;
    std::map<std::string, std::vector<policy::IpAddress>> overrides{
        {"api.test", {*policy::IpAddress::parse("10.1.2.3")}}};
    Resolver r(ioc, {"127.0.0.1:9"}, overrides, 1s);
    std::optional<Answer> out = resolve_on(ioc, r, "192.0.2.7");
    ASSERT_TRUE(out && out->ok());
    EXPECT_EQ((*out)->front().to_string(), "192.0.2.7");
    out = resolve_on(ioc, r, "api.test");
    ASSERT_TRUE(out && out->ok());
    EXPECT_EQ((*out)->front().to_string(), "10.1.2.3");
}

TEST(Resolver, EveryServersTriesFitTheBudget) {
    using std::chrono::milliseconds;
    // Two rounds over N servers, the second at twice the timeout: 3·N·t, with one t spare.
    EXPECT_EQ(Resolver::try_timeout_ms(milliseconds(5000), 1), 1250);
    EXPECT_EQ(Resolver::try_timeout_ms(milliseconds(2000), 3), 200);
    EXPECT_EQ(Resolver::try_timeout_ms(milliseconds(2000), 0), 500);  // none listed: one
    EXPECT_EQ(Resolver::try_timeout_ms(milliseconds(5), 3), 1);        // at least 1 ms
    for (size_t n = 1; n <= 8; ++n) {
        const int t = Resolver::try_timeout_ms(milliseconds(5000), n);
        EXPECT_LT(3 * static_cast<int>(n) * t, 5000) << n;
    }
}

}  // namespace
}  // namespace egress::proxy
