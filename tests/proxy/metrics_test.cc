#include "proxy/metrics.h"

#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

namespace egress::proxy {
namespace {

/// The value of the first line of `text` that starts with `series` followed by a space.
std::string value_of(const std::string& text, const std::string& series) {
    const std::string key = "\n" + series + " ";
    const size_t at = ("\n" + text).find(key);
    if (at == std::string::npos) {
        return "(absent)";
    }
    const size_t start = at + key.size() - 1;  // "\n" was prepended
    return text.substr(start, text.find('\n', start) - start);
}

TEST(Metrics, RenderAddsUpEveryShardAndTheSharedOne) {
    Metrics m;
    Metrics::Shard& a = m.add_shard();
    Metrics::Shard& b = m.add_shard();
    a.request("allow", "h2", 0.002);
    a.request("allow", "h2", 0.2);
    b.request("allow", "h2", 0.0005);
    b.request("deny", "http/1.1", 3);
    m.request("allow", "tunnel", 0.0001);
    const std::string text = m.render();
    EXPECT_EQ(value_of(text, R"(egressd_requests_total{decision="allow",protocol="h2"})"), "3");
    EXPECT_EQ(value_of(text, R"(egressd_requests_total{decision="deny",protocol="http/1.1"})"),
              "1");
    EXPECT_EQ(value_of(text, R"(egressd_requests_total{decision="allow",protocol="tunnel"})"),
              "1");
    EXPECT_EQ(value_of(text, R"(egressd_request_duration_seconds_bucket{le="0.001"})"), "2");
    EXPECT_EQ(value_of(text, R"(egressd_request_duration_seconds_bucket{le="0.0025"})"), "3");
    EXPECT_EQ(value_of(text, R"(egressd_request_duration_seconds_bucket{le="0.25"})"), "4");
    EXPECT_EQ(value_of(text, R"(egressd_request_duration_seconds_bucket{le="10"})"), "5");
    EXPECT_EQ(value_of(text, R"(egressd_request_duration_seconds_bucket{le="+Inf"})"), "5");
    EXPECT_EQ(value_of(text, "egressd_request_duration_seconds_count"), "5");
}

TEST(Metrics, ShardsCountedByTheirOwnThreadsWhileRenderedAreExact) {
    Metrics m;
    constexpr int kThreads = 4;
    constexpr int kEach = 20000;
    std::vector<Metrics::Shard*> shards;
    for (int i = 0; i < kThreads; ++i) {
        shards.push_back(&m.add_shard());
    }
    std::vector<std::thread> threads;
    for (int i = 0; i < kThreads; ++i) {
        threads.emplace_back([s = shards[i]] {
            for (int n = 0; n < kEach; ++n) {
                s->request("allow", "h2", 0.01);
            }
        });
    }
    for (int i = 0; i < 50; ++i) {
        (void)m.render();  // concurrent with the writers: must neither tear nor block them
    }
    for (auto& t : threads) {
        t.join();
    }
    EXPECT_EQ(value_of(m.render(), R"(egressd_requests_total{decision="allow",protocol="h2"})"),
              std::to_string(kThreads * kEach));
}

// The sum is written with every digit a double needs to read back as itself: at the
// default ostream precision (6 significant digits) it stopped moving at 100000 s (a day and
// a bit of requests) and rounded everything before.
TEST(Metrics, DurationSumKeepsEveryDigit) {
    Metrics m;
    m.request("allow", "h2", 123456.789012);
    m.request("allow", "h2", 0.000123);
    const std::string sum = value_of(m.render(), "egressd_request_duration_seconds_sum");
    EXPECT_EQ(std::stod(sum), 123456.789012 + 0.000123) << sum;
    EXPECT_EQ(sum, "123456.789135");
}

TEST(Metrics, AuditWriteErrorsAreTheLogsCount) {
    Metrics m;
    EXPECT_EQ(value_of(m.render(), "egressd_audit_write_errors_total"), "0");
    std::atomic<uint64_t> errors{3};
    m.audit_write_errors = &errors;
    EXPECT_EQ(value_of(m.render(), "egressd_audit_write_errors_total"), "3");
}

}  // namespace
}  // namespace egress::proxy
