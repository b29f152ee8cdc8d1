// AuditLog::reopen (SIGHUP): log rotation and a changed audit.path, plain and durable.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <future>
#include <string>

#include "proxy/audit.h"

namespace egress::proxy {
namespace {

namespace fs = std::filesystem;

fs::path temp_dir() {
    auto dir = fs::temp_directory_path() / ("egress-audit-reopen-" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
    return dir;
}

size_t lines(const fs::path& p) {
    std::ifstream in(p);
    size_t n = 0;
    for (std::string line; std::getline(in, line);) {
        ++n;
    }
    return n;
}

AuditRecord record(const std::string& run) {
    AuditRecord r;
    r.run = run;
    r.decision = "allow";
    return r;
}

class AuditReopen : public ::testing::TestWithParam<bool> {};

TEST_P(AuditReopen, RotationAndANewPathGetTheRecordsThatFollow) {
    const bool durable = GetParam();
    auto dir = temp_dir();
    auto path = dir / "audit.jsonl";
    auto log = AuditLog::open(path.string(), durable);
    ASSERT_TRUE(log) << log.error();
    auto wait = [&](const AuditRecord& r) {  // durable: returns once the record is on disk
        std::promise<bool> done;
        (*log)->write_durable(r, [&](bool ok) { done.set_value(ok); });
        EXPECT_TRUE(done.get_future().get());
    };
    wait(record("before"));
    // logrotate: move the file away, then SIGHUP.
    fs::rename(path, dir / "audit.jsonl.1");
    wait(record("moved"));  // still the open (moved) file
    ASSERT_TRUE((*log)->reopen(path.string()));
    wait(record("after"));
    EXPECT_EQ(lines(dir / "audit.jsonl.1"), 2U);
    EXPECT_EQ(lines(path), 1U);
    // A new audit.path.
    auto other = dir / "sub" / "other.jsonl";
    ASSERT_TRUE((*log)->reopen(other.string()));
    wait(record("other"));
    EXPECT_EQ(lines(path), 1U);
    EXPECT_EQ(lines(other), 1U);
    // A path that cannot be opened: an error naming the key, the open file is kept.
    auto bad = (*log)->reopen((dir / "audit.jsonl.1" / "x").string());
    ASSERT_FALSE(bad);
    EXPECT_NE(bad.error().find("audit.path"), std::string::npos);
    wait(record("kept"));
    EXPECT_EQ(lines(other), 2U);
    log->reset();
    fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(PlainAndDurable, AuditReopen, ::testing::Values(false, true));

}  // namespace
}  // namespace egress::proxy
