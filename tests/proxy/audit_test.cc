#include "proxy/audit.h"

#include "common/json_text.h"

#include <gtest/gtest.h>

#include <boost/json.hpp>

#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <charconv>
#include <cmath>
#include <csignal>
#include <future>
#include <random>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <latch>
#include <limits>
#include <string>
#include <thread>
#include <vector>

namespace egress::proxy {
namespace {

std::filesystem::path temp_file(const std::string& name) {
    auto dir = std::filesystem::temp_directory_path() /
               ("egress-audit-" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir);
    auto p = dir / name;
    std::filesystem::remove(p);
    return p;
}

std::vector<boost::json::object> read_records(const std::filesystem::path& p) {
    std::ifstream in(p);
    std::vector<boost::json::object> out;
    for (std::string line; std::getline(in, line);) {
        out.push_back(boost::json::parse(line).as_object());
    }
    return out;
}

AuditRecord record(uint64_t id) {
    AuditRecord r;
    r.run = "r1";
    r.method = "GET";
    r.host = "a.test";
    r.port = 443;
    r.path = "/x?token=hidden";
    r.decision = "allow";
    r.req_id = id;
    return r;
}

TEST(AuditLog, DurableWritesAreGroupCommittedAndAllReported) {
    auto path = temp_file("durable.jsonl");
    auto log = AuditLog::open(path.string(), true);
    ASSERT_TRUE(log.ok()) << log.error();
    ASSERT_TRUE((*log)->durable());
    constexpr int kThreads = 8;
    constexpr int kPerThread = 50;
    std::atomic<int> ok{0};
    std::atomic<int> failed{0};
    std::latch start(kThreads);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&, t] {
            start.arrive_and_wait();
            for (int i = 0; i < kPerThread; ++i) {
                auto rec = record(static_cast<uint64_t>(t * kPerThread + i + 1));
                rec.event = "decision";
                std::atomic<bool> done{false};
                (*log)->write_durable(rec, [&](bool good) {
                    (good ? ok : failed).fetch_add(1);
                    done.store(true);
                    done.notify_one();
                });
                done.wait(false);  // like a request waiting for its decision record
            }
        });
    }
    for (auto& th : threads) th.join();
    EXPECT_EQ(ok.load(), kThreads * kPerThread);
    EXPECT_EQ(failed.load(), 0);
    // Group commit: concurrent waiters share syncs (8 waiters at a time, so well under one
    // sync per record), and every record reported durable is in the file.
    EXPECT_GE((*log)->syncs(), 1u);
    EXPECT_LT((*log)->syncs(), static_cast<uint64_t>(kThreads * kPerThread));
    auto recs = read_records(path);
    ASSERT_EQ(recs.size(), static_cast<size_t>(kThreads * kPerThread));
    std::vector<bool> seen(kThreads * kPerThread + 1);
    for (const auto& r : recs) {
        EXPECT_EQ(r.at("event").as_string(), "decision");
        EXPECT_EQ(r.at("path").as_string(), "/x");  // query removed
        seen[r.at("req_id").to_number<size_t>()] = true;
    }
    EXPECT_EQ(std::count(seen.begin() + 1, seen.end(), true), kThreads * kPerThread);
}

TEST(AuditLog, DurableKeepsOrderOfPlainAndDurableRecords) {
    auto path = temp_file("order.jsonl");
    {
        auto log = AuditLog::open(path.string(), true);
        ASSERT_TRUE(log.ok());
        std::atomic<bool> done{false};
        auto decision = record(1);
        decision.event = "decision";
        (*log)->write_durable(decision, [&](bool) {
            done.store(true);
            done.notify_one();
        });
        done.wait(false);
        auto completion = record(1);
        completion.status = 200;
        (*log)->write(completion);  // queued; written before the log closes
    }
    auto recs = read_records(path);
    ASSERT_EQ(recs.size(), 2u);
    EXPECT_EQ(recs[0].at("event").as_string(), "decision");
    EXPECT_FALSE(recs[1].contains("event"));
    EXPECT_EQ(recs[1].at("status").to_number<int>(), 200);
}

TEST(AuditLog, PlainModeReportsDurableWritesAtOnce) {
    auto path = temp_file("plain.jsonl");
    auto log = AuditLog::open(path.string(), false);
    ASSERT_TRUE(log.ok());
    bool called = false;
    (*log)->write_durable(record(7), [&](bool good) { called = good; });
    EXPECT_TRUE(called);
    EXPECT_EQ((*log)->syncs(), 0u);
    EXPECT_EQ(read_records(path).size(), 1u);
}

// The workers batch one event-loop turn's records into one buffer and append it at once.
TEST(AuditLog, AppendedBatchOfLinesIsEveryRecordInOrder) {
    for (bool durable : {false, true}) {
        auto path = temp_file(durable ? "batch-durable.jsonl" : "batch.jsonl");
        {
            auto log = AuditLog::open(path.string(), durable);
            ASSERT_TRUE(log.ok());
            std::string batch;
            for (uint64_t id = 1; id <= 3; ++id) {
                append_audit_json(batch, record(id));
                batch.push_back('\n');
            }
            (*log)->append(batch);
            (*log)->append("");
        }  // durable: the destructor writes what is queued
        auto recs = read_records(path);
        ASSERT_EQ(recs.size(), 3u) << durable;
        for (uint64_t i = 0; i < 3; ++i) {
            EXPECT_EQ(recs[i].at("req_id").as_int64(), static_cast<int64_t>(i + 1));
            EXPECT_EQ(recs[i].at("path").as_string(), "/x");  // query removed
        }
    }
}

TEST(AuditJson, IsOneValidObjectWithEveryFieldAndEscapes) {
    AuditRecord r = record(42);
    r.method = "GE\"T";
    r.path = "/a\\b\x01c?q=secret";
    r.reason = "line\nbreak";
    r.status = 403;
    r.duration_ms = 1.23456;
    auto v = boost::json::parse(audit_json(r)).as_object();
    EXPECT_EQ(v.at("method").as_string(), "GE\"T");
    EXPECT_EQ(v.at("path").as_string(), "/a\\b\x01c");  // query removed
    EXPECT_EQ(v.at("reason").as_string(), "line\nbreak");
    EXPECT_EQ(v.at("status").to_number<int>(), 403);
    EXPECT_EQ(v.at("port").to_number<int>(), 443);
    EXPECT_NEAR(v.at("duration_ms").to_number<double>(), 1.235, 1e-9);
    EXPECT_TRUE(v.at("pin").is_null());
    EXPECT_TRUE(v.at("secret").is_null());
    EXPECT_TRUE(v.at("upstream_addr").is_null());
    EXPECT_TRUE(v.at("proto_out").is_null());
    EXPECT_EQ(v.at("req_id").to_number<uint64_t>(), 42u);
    EXPECT_FALSE(v.contains("event"));
    for (const char* k : {"time", "run", "method", "scheme", "host", "port", "path", "status",
                          "pin", "secret", "decision", "reason", "bytes_in", "bytes_out",
                          "duration_ms", "upstream_addr", "proto_in", "proto_out"}) {
        EXPECT_TRUE(v.contains(k)) << k;
    }
    r.pin = "r1-pin-0";
    r.secret = "gh";
    r.run.clear();
    auto w = boost::json::parse(audit_json(r)).as_object();
    EXPECT_EQ(w.at("pin").as_string(), "r1-pin-0");
    EXPECT_EQ(w.at("secret").as_string(), "gh");
    EXPECT_TRUE(w.at("run").is_null());
}

// The escape check looks at eight bytes at a time (the last step overlapping, a short value
// padded): every byte, at every position of values shorter than, as long as and longer than
// one step, gives a line a strict JSON parser accepts, and reads back as the byte (ASCII) or
// as its Latin-1 character (a lone byte from 0x80 up is not UTF-8).
TEST(AuditJson, EveryByteAtEveryPositionIsEscapedOrKept) {
    AuditRecord r = record(1);
    for (int b = 0; b < 256; ++b) {
        for (size_t len : {1, 7, 8, 9, 16, 17}) {
            for (size_t pos = 0; pos < len; ++pos) {
                std::string value(len, 'a');
                value[pos] = static_cast<char>(b);
                r.reason = value;
                boost::system::error_code ec;
                auto v = boost::json::parse(audit_json(r), ec);
                ASSERT_FALSE(ec) << "byte " << b << " at " << pos << " of " << len;
                std::string expected = value;
                if (b >= 0x80) {  // U+0080..U+00FF in UTF-8
                    expected.replace(pos, 1, {static_cast<char>(0xc0 | (b >> 6)),
                                              static_cast<char>(0x80 | (b & 0x3f))});
                }
                ASSERT_EQ(v.as_object().at("reason").as_string(), expected)
                    << "byte " << b << " at " << pos << " of " << len;
            }
        }
    }
}

// Well-formed UTF-8 goes out as it is; malformed sequences (overlong, surrogate, truncated,
// above U+10FFFF) are written byte by byte as Latin-1 characters and the line stays valid
// JSON. egressctl's check of a secret before upload (valid_utf8) uses the same rule.
TEST(AuditJson, KeepsUtf8AndEscapesMalformedSequences) {
    AuditRecord r = record(1);
    const std::string good = "/caf\xc3\xa9/\xe2\x82\xac/\xf0\x9f\x98\x80/\xf4\x8f\xbf\xbf";
    r.reason = good;
    const std::string line = audit_json(r);
    EXPECT_NE(line.find(good), std::string::npos);
    EXPECT_EQ(boost::json::parse(line).as_object().at("reason").as_string(), good);
    for (const std::string bad : {"\xc0\x80", "\xed\xa0\x80", "\xe2\x82", "\xf4\x90\x80\x80",
                                  "\xf8\x88\x80\x80\x80", "\x80", "\xc3"}) {
        r.reason = "x" + bad + "y";
        boost::system::error_code ec;
        auto v = boost::json::parse(audit_json(r), ec);
        ASSERT_FALSE(ec) << r.reason.size();
        std::string expected = "x";
        for (char c : bad) {
            const auto u = static_cast<unsigned char>(c);
            expected += {static_cast<char>(0xc0 | (u >> 6)), static_cast<char>(0x80 | (u & 0x3f))};
        }
        expected += "y";
        EXPECT_EQ(v.as_object().at("reason").as_string(), expected);
        EXPECT_FALSE(valid_utf8(r.reason));
    }
    EXPECT_TRUE(valid_utf8(good));
}

// The formatter caches the date and time of the current second per thread: check it against
// strftime on instants in different seconds, back and forth, and before 1970.
TEST(AuditJson, TimestampMatchesStrftimeAcrossSeconds) {
    using namespace std::chrono;
    auto expect = [](system_clock::time_point t) {
        auto ms = duration_cast<milliseconds>(t.time_since_epoch());
        auto secs = duration_cast<seconds>(ms);
        if (ms < secs) {
            secs -= seconds(1);
        }
        std::time_t tt = secs.count();
        std::tm tm{};
        gmtime_r(&tt, &tm);
        char buf[64];
        std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S", &tm);
        char frac[8];
        std::snprintf(frac, sizeof frac, ".%03dZ", static_cast<int>((ms - secs).count()));
        return std::string(buf) + frac;
    };
    const system_clock::time_point base{milliseconds(1796300011687)};  // 2026-12-03T...
    for (auto t : {base, base + milliseconds(5), base + milliseconds(313), base - hours(30),
                   base + milliseconds(999), base, system_clock::time_point{milliseconds(-1500)},
                   system_clock::time_point{}}) {
        EXPECT_EQ(iso8601_utc(t), expect(t));
    }
    EXPECT_EQ(iso8601_utc(system_clock::time_point{milliseconds(1796300011687)}),
              "2026-12-03T12:13:31.687Z");
}

TEST(AuditJson, DurationHasThreeDecimals) {
    AuditRecord r = record(1);
    for (auto [ms, text] : {std::pair{0.0, "0.000"}, {12.3456, "12.346"}, {0.0004, "0.000"},
                            {123456.5, "123456.500"}}) {
        r.duration_ms = ms;
        auto line = audit_json(r);
        EXPECT_NE(line.find(std::string("\"duration_ms\":") + text + ","), std::string::npos)
            << line;
    }
}

// The line is measured, then written into the space measured: every field at its longest
// (each string byte a six-byte \u00XX escape, the largest numbers, a duration to_chars cannot
// write in 64 bytes) still fits, appends after what the buffer held, and parses back.
TEST(AuditJson, WorstCaseFieldsFitTheMeasuredLine) {
    AuditRecord r;
    const std::string ctl(300, '\x01');
    for (std::string* f : {&r.run, &r.method, &r.scheme, &r.host, &r.path, &r.decision, &r.reason,
                           &r.upstream_addr, &r.proto_in, &r.proto_out, &r.event}) {
        *f = ctl;
    }
    r.pin = ctl;
    r.secret = ctl;
    r.port = 65535;
    r.status = std::numeric_limits<int>::min();
    r.bytes_in = std::numeric_limits<uint64_t>::max();
    r.bytes_out = std::numeric_limits<uint64_t>::max();
    r.req_id = std::numeric_limits<uint64_t>::max();
    for (double ms : {1e300, -1e300, std::numeric_limits<double>::infinity(), 0.5}) {
        r.duration_ms = ms;
        std::string out = "before\n";
        append_audit_json(out, r);
        ASSERT_TRUE(out.starts_with("before\n{\"time\":\""));
        boost::system::error_code ec;
        auto v = boost::json::parse(std::string_view(out).substr(7), ec);
        ASSERT_FALSE(ec) << ms;
        const auto& o = v.as_object();
        EXPECT_EQ(o.at("event").as_string(), ctl);
        EXPECT_EQ(o.at("secret").as_string(), ctl);
        EXPECT_EQ(o.at("status").as_int64(), std::numeric_limits<int>::min());
        EXPECT_EQ(o.at("bytes_out").as_uint64(), std::numeric_limits<uint64_t>::max());
        EXPECT_EQ(o.at("req_id").as_uint64(), std::numeric_limits<uint64_t>::max());
        EXPECT_EQ(o.size(), 20U);  // every field, event and req_id included
    }
}

// The whole line of a typical record, byte for byte after its timestamp: field order, nulls,
// numbers and the query cut are the contract (DESIGN.md "Audit record").
TEST(AuditJson, TypicalLineIsExactlyTheContract) {
    AuditRecord r;
    r.run = "run-1";
    r.method = "GET";
    r.scheme = "https";
    r.host = "api.github.com";
    r.port = 443;
    r.path = "/repos/a/b?token=q";
    r.status = 200;
    r.pin = "gh-read";
    r.secret = "gh";
    r.decision = "allow";
    r.reason = "injected";
    r.bytes_in = 0;
    r.bytes_out = 1234;
    r.duration_ms = 3.14159;
    r.upstream_addr = "127.0.0.1:8443";
    r.proto_in = "h2";
    r.req_id = 7;
    const std::string line = audit_json(r);
    ASSERT_EQ(line.substr(0, 9), "{\"time\":\"");
    EXPECT_EQ(line.substr(33),
              "\",\"run\":\"run-1\",\"method\":\"GET\",\"scheme\":\"https\","
              "\"host\":\"api.github.com\",\"port\":443,\"path\":\"/repos/a/b\",\"status\":200,"
              "\"pin\":\"gh-read\",\"secret\":\"gh\",\"decision\":\"allow\",\"reason\":\"injected\","
              "\"bytes_in\":0,\"bytes_out\":1234,\"duration_ms\":3.142,"
              "\"upstream_addr\":\"127.0.0.1:8443\",\"proto_in\":\"h2\",\"proto_out\":null,"
              "\"req_id\":7}");
}

/// Writes beyond `limit` bytes of a file fail (RLIMIT_FSIZE, EFBIG; SIGXFSZ ignored) while
/// it lives: a disk that fills up in the middle of a write, deterministically.
class FileSizeLimit {
public:
    explicit FileSizeLimit(uint64_t limit) {
        ::getrlimit(RLIMIT_FSIZE, &old_);
        old_handler_ = std::signal(SIGXFSZ, SIG_IGN);
        rlimit r = old_;
        r.rlim_cur = limit;
        ::setrlimit(RLIMIT_FSIZE, &r);
    }
    ~FileSizeLimit() {
        ::setrlimit(RLIMIT_FSIZE, &old_);
        std::signal(SIGXFSZ, old_handler_);
    }

private:
    rlimit old_{};
    void (*old_handler_)(int) = SIG_DFL;
};

std::string line_of(uint64_t id) {
    std::string l = audit_json(record(id));
    l.push_back('\n');
    return l;
}

bool durable_write(AuditLog& log, uint64_t id) {
    std::promise<bool> done;
    log.write_durable(record(id), [&](bool ok) { done.set_value(ok); });
    return done.get_future().get();
}

// A write the disk cuts short keeps the lines that went whole and leaves no part of one:
// the next record begins a line of its own (it had been glued to the torn one, invalid
// JSONL, and nothing said it). The failure is counted (egressd_audit_write_errors_total).
TEST(AuditLog, AFailedWriteLeavesNoTornLineAndIsCounted) {
    for (bool durable : {false, true}) {
        SCOPED_TRACE(durable);
        auto path = temp_file(durable ? "full-durable.jsonl" : "full.jsonl");
        {
            std::ofstream f(path);
            for (uint64_t id = 100; id < 110; ++id) {
                f << line_of(id);
            }
        }
        const uint64_t before = std::filesystem::file_size(path);
        auto log = AuditLog::open(path.string(), durable);
        ASSERT_TRUE(log.ok()) << log.error();
        const std::string first = line_of(1);
        {
            // Room for the first line and 10 bytes of the second.
            FileSizeLimit limit(before + first.size() + 10);
            if (durable) {
                (*log)->append(first + line_of(2));
                EXPECT_FALSE(durable_write(**log, 3));  // after the queued lines: not on disk
            } else {
                (*log)->append(first + line_of(2));
                EXPECT_EQ((*log)->write_errors().load(), 1u);
            }
            EXPECT_EQ(std::filesystem::file_size(path), before + first.size());
        }
        EXPECT_GE((*log)->write_errors().load(), 1u);
        if (durable) {
            EXPECT_TRUE(durable_write(**log, 4));
        } else {
            (*log)->write(record(4));
        }
        auto recs = read_records(path);  // every line parses
        ASSERT_EQ(recs.size(), 12u);
        EXPECT_EQ(recs[10].at("req_id").as_int64(), 1);
        EXPECT_EQ(recs[11].at("req_id").as_int64(), 4);
    }
}

// A file that takes no byte (/dev/full: ENOSPC): plain records are dropped and counted, a
// durable one is reported as not written; nothing throws or blocks.
TEST(AuditLog, AFullDeviceIsCountedAndDurableWritesFail) {
    if (::access("/dev/full", W_OK) != 0) {
        GTEST_SKIP() << "no writable /dev/full";
    }
    auto plain = AuditLog::open("/dev/full", false);
    ASSERT_TRUE(plain.ok()) << plain.error();
    (*plain)->write(record(1));
    (*plain)->write(record(2));
    EXPECT_EQ((*plain)->write_errors().load(), 2u);
    auto durable = AuditLog::open("/dev/full", true);
    ASSERT_TRUE(durable.ok()) << durable.error();
    EXPECT_FALSE(durable_write(**durable, 3));
    EXPECT_EQ((*durable)->write_errors().load(), 1u);
}

TEST(AuditLog, UnwritablePathNamesTheKey) {
    auto log = AuditLog::open("/proc/egress-no-such-dir/audit.jsonl", true);
    ASSERT_FALSE(log.ok());
    EXPECT_NE(log.error().find("audit.path"), std::string::npos);
}

}  // namespace
}  // namespace egress::proxy

namespace egress::proxy {
namespace {

std::string to_chars_fixed3(double v) {
    char buf[400];
    auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::fixed, 3);
    return ec == std::errc() ? std::string(buf, end) : std::string("0");
}

// The fast path writes exactly what std::to_chars(fixed, 3) writes: every value an exchange
// measures (random, over the whole range and its edges) and the half-way cases, where the
// product by 1000 and the exact binary value could round differently.
TEST(AuditJson, DurationIsWhatToCharsWrites) {
    std::vector<double> values = {0.0,    0.0004, 0.0005, 0.0015, 0.0025, 1.0005, 2.0005,
                                  0.1235, 12.3456, 999.9995, 999999.9995, 999999.9999, 1e6,
                                  1e6 - 1e-9, 4e9, 1e12, 123456.5, 0.0125, 5e-324,
                                  std::nextafter(0.0005, 1.0), std::nextafter(0.0005, 0.0)};
    std::mt19937_64 rng(20261204);
    std::uniform_real_distribution<double> small(0.0, 5.0), mid(0.0, 2e6);
    for (int i = 0; i < 100000; ++i) {
        values.push_back(small(rng));
        values.push_back(mid(rng));
        // Exact ties in decimal: k.xyz5, whose binary value lies just above or below.
        values.push_back(static_cast<double>(rng() % 100000000) / 1000.0 + 0.0005);
    }
    for (double v : values) {
        ASSERT_EQ(duration_ms_text(v), to_chars_fixed3(v)) << std::hexfloat << v;
    }
    EXPECT_EQ(duration_ms_text(-1.5), "-1.500");  // not measured, but still what to_chars says
    EXPECT_EQ(duration_ms_text(std::numeric_limits<double>::infinity()), "0");
    EXPECT_EQ(duration_ms_text(std::nan("")), "0");
}

}  // namespace
}  // namespace egress::proxy
