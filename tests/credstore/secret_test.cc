#include "credstore/secret.h"

#include "common/secure_zero.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

namespace egress::credstore {
namespace {

class TempFile {
public:
    explicit TempFile(std::string_view content) {
        char name[] = "/tmp/egress_secret_test_XXXXXX";
        const int fd = mkstemp(name);
        EXPECT_GE(fd, 0);
        close(fd);
        path_ = name;
        std::ofstream(path_, std::ios::binary) << content;
    }
    ~TempFile() { std::remove(path_.c_str()); }
    const std::string& path() const { return path_; }

private:
    std::string path_;
};

TEST(SecretValue, RevealsAndRedacts) {
    SecretValue s("hunter2");
    EXPECT_EQ(s.reveal(), "hunter2");
    EXPECT_EQ(s.size(), 7U);
    std::ostringstream os;
    os << s;
    EXPECT_EQ(os.str(), "<redacted>");
    EXPECT_EQ(os.str().find("hunter2"), std::string::npos);

    SecretPtr ptr = std::make_shared<const SecretValue>("abc");
    std::ostringstream os2;
    os2 << *ptr;
    EXPECT_EQ(os2.str(), "<redacted>");
}

TEST(SecretValue, EmptyAndBinary) {
    SecretValue empty("");
    EXPECT_EQ(empty.size(), 0U);
    EXPECT_EQ(empty.reveal(), "");
    const std::string bin("a\0b", 3);
    SecretValue s(bin);
    EXPECT_EQ(s.reveal(), bin);
}

// Reads the 8-byte entry `index` of a /proc table (pread: the tables are sparse, huge files).
std::optional<uint64_t> read_proc_entry(const char* path, uint64_t index) {
    const int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        return std::nullopt;
    }
    uint64_t entry = 0;
    const ssize_t n = pread(fd, &entry, sizeof entry, static_cast<off_t>(index * sizeof entry));
    close(fd);
    return n == static_cast<ssize_t>(sizeof entry) ? std::optional(entry) : std::nullopt;
}

// Whether the page holding `p` is mlock'ed (KPF_MLOCKED, bit 33 of /proc/kpageflags), or
// nullopt when this process may not read page frames (that needs CAP_SYS_ADMIN).
std::optional<bool> page_mlocked(const void* p) {
    const auto page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    const auto entry = read_proc_entry("/proc/self/pagemap", reinterpret_cast<uintptr_t>(p) / page);
    if (!entry) {
        return std::nullopt;
    }
    if ((*entry >> 63 & 1) == 0) {
        return false;  // not even present
    }
    const uint64_t pfn = *entry & ((uint64_t{1} << 55) - 1);
    if (pfn == 0) {
        return std::nullopt;  // frame numbers hidden from this process
    }
    const auto flags = read_proc_entry("/proc/kpageflags", pfn);
    if (!flags) {
        return std::nullopt;
    }
    return (*flags >> 33 & 1) != 0;
}

// Small secrets share heap pages, and one munlock() unlocks a page however often it was
// locked: freeing one secret must not unlock the pages of the secrets still alive.
TEST(SecretValue, PagesStayLockedWhileAnySecretOnThemLives) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    // The sanitizers' interceptors make mlock() a no-op that reports success.
    GTEST_SKIP() << "mlock is not carried out under a sanitizer";
#endif
    std::vector<std::unique_ptr<SecretValue>> values;
    for (int i = 0; i < 256; ++i) {
        values.push_back(std::make_unique<SecretValue>("a forty-byte credential, more or less"));
    }
    const std::optional<bool> first = page_mlocked(values[0]->reveal().data());
    if (!first) {
        GTEST_SKIP() << "page flags not readable (/proc/kpageflags needs CAP_SYS_ADMIN)";
    }
    for (const auto& v : values) {
        ASSERT_EQ(page_mlocked(v->reveal().data()), true);
    }
    for (size_t i = 0; i < values.size(); i += 2) {
        values[i].reset();
    }
    for (size_t i = 1; i < values.size(); i += 2) {
        EXPECT_EQ(page_mlocked(values[i]->reveal().data()), true) << "secret " << i;
    }
}

struct ValidateCase {
    std::string bytes;
    bool ok;
};

class ValidateSecretTest : public ::testing::TestWithParam<ValidateCase> {};

TEST_P(ValidateSecretTest, Validates) {
    const ValidateCase& c = GetParam();
    EXPECT_EQ(validate_secret_bytes(c.bytes).ok(), c.ok);
}

INSTANTIATE_TEST_SUITE_P(Table, ValidateSecretTest,
                         ::testing::Values(ValidateCase{"tok", true}, ValidateCase{"", false},
                                           ValidateCase{"a\rb", false}, ValidateCase{"a\nb", false},
                                           ValidateCase{std::string("a\0b", 3), false},
                                           ValidateCase{"with space\tand tab", true},
                                           ValidateCase{std::string(16384, 'x'), true},
                                           ValidateCase{std::string(16385, 'x'), false}));

struct FileCase {
    std::string content;
    bool ok;
    std::string value;
};

class LoadSecretFileTest : public ::testing::TestWithParam<FileCase> {};

TEST_P(LoadSecretFileTest, Loads) {
    const FileCase& c = GetParam();
    TempFile f(c.content);
    Result<SecretPtr> got = load_secret_file(f.path());
    ASSERT_EQ(got.ok(), c.ok) << (got.ok() ? "" : got.error());
    if (c.ok) {
        EXPECT_EQ((*got)->reveal(), c.value);
    } else {
        EXPECT_NE(got.error().find(f.path()), std::string::npos) << got.error();
        if (!c.content.empty()) {
            EXPECT_EQ(got.error().find(c.content), std::string::npos) << got.error();
        }
    }
}

INSTANTIATE_TEST_SUITE_P(
    Table, LoadSecretFileTest,
    ::testing::Values(FileCase{"tok", true, "tok"}, FileCase{"tok\n", true, "tok"},
                      FileCase{"tok\r\n", true, "tok"}, FileCase{"tok\n\n", false, ""},
                      FileCase{"tok\r", false, ""}, FileCase{"to\nk", false, ""},
                      FileCase{"to\rk\n", false, ""}, FileCase{" tok ", true, " tok "},
                      FileCase{"", false, ""}, FileCase{"\n", false, ""},
                      FileCase{std::string(16384, 'x') + "\r\n", true, std::string(16384, 'x')},
                      FileCase{std::string(16385, 'x'), false, ""}));

TEST(LoadSecretFile, MissingFile) {
    Result<SecretPtr> got = load_secret_file("/nonexistent/egress/secret");
    ASSERT_FALSE(got.ok());
    EXPECT_NE(got.error().find("/nonexistent/egress/secret"), std::string::npos);
}

TEST(CreateSecretFile, WritesWholeFile0600AndReplacesALeftoverTemp) {
    TempFile dir_marker("");
    const std::string path = dir_marker.path() + ".token";
    std::ofstream(path + ".tmp") << "";  // what an interrupted create left
    auto created = create_secret_file(path, "tok-1\n");
    ASSERT_TRUE(created.ok()) << created.error();
    EXPECT_TRUE(*created);
    std::ifstream in(path, std::ios::binary);
    EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "tok-1\n");
    struct stat st{};
    ASSERT_EQ(stat(path.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600U);
    EXPECT_NE(access((path + ".tmp").c_str(), F_OK), 0);

    // An existing file is never replaced.
    auto again = create_secret_file(path, "tok-2\n");
    ASSERT_TRUE(again.ok()) << again.error();
    EXPECT_FALSE(*again);
    std::ifstream in2(path, std::ios::binary);
    EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in2), {}), "tok-1\n");
    std::remove(path.c_str());

    auto missing_dir = create_secret_file("/nonexistent/egress/token", "tok");
    ASSERT_FALSE(missing_dir.ok());
    EXPECT_NE(missing_dir.error().find("cannot create /nonexistent/egress/token: "),
              std::string::npos)
        << missing_dir.error();
}

class CreateSecretFileVia : public ::testing::TestWithParam<CreateVia> {};

INSTANTIATE_TEST_SUITE_P(BothWays, CreateSecretFileVia,
                         ::testing::Values(CreateVia::Unnamed, CreateVia::Named));

TEST_P(CreateSecretFileVia, ConcurrentCreatorsAgreeOnOneFile) {
    // Replicas sharing a volume may start at once and each make the master key: exactly one
    // creates the file, the others find it and read it, and the file holds the creator's
    // bytes (before: two "created" it, the second rename replacing the key the first had
    // already used, or one failed on the other's temp file).
    TempFile dir_marker("");
    constexpr int kThreads = 6;
    for (int round = 0; round < 100; ++round) {
        const std::string path = dir_marker.path() + ".race" + std::to_string(round);
        std::atomic<int> ready{0};
        std::vector<std::optional<Result<bool>>> results(kThreads);
        std::vector<std::thread> threads;
        for (int i = 0; i < kThreads; ++i) {
            threads.emplace_back([&, i] {
                ready.fetch_add(1);
                while (ready.load() < kThreads) {
                }
                results[i] = create_secret_file(path, "key-" + std::to_string(i) + "\n",
                                                GetParam());
            });
        }
        for (auto& t : threads) {
            t.join();
        }
        int created = 0;
        std::string winner;
        for (int i = 0; i < kThreads; ++i) {
            ASSERT_TRUE(results[i]->ok()) << "round " << round << ": " << results[i]->error();
            if (**results[i]) {
                ++created;
                winner = "key-" + std::to_string(i) + "\n";
            }
        }
        ASSERT_EQ(created, 1) << "round " << round;
        std::ifstream in(path, std::ios::binary);
        EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), winner);
        struct stat st{};
        ASSERT_EQ(stat(path.c_str(), &st), 0);
        EXPECT_EQ(st.st_mode & 0777, 0600U);
        std::remove(path.c_str());
    }
    // No temp file is left beside them (the named way removes its own).
    const std::string dir = dir_marker.path().substr(0, dir_marker.path().rfind('/'));
    const std::string base = dir_marker.path().substr(dir.size() + 1) + ".race";
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
        EXPECT_EQ(entry.path().filename().string().rfind(base, 0), std::string::npos)
            << entry.path();
    }
}

TEST(ConstantTimeEquals, Compares) {
    EXPECT_TRUE(constant_time_equals("abc", "abc"));
    EXPECT_TRUE(constant_time_equals("", ""));
    EXPECT_FALSE(constant_time_equals("abc", "abd"));
    EXPECT_FALSE(constant_time_equals("abc", "abcd"));
    EXPECT_FALSE(constant_time_equals("", "a"));
}

}  // namespace
}  // namespace egress::credstore

TEST(SecureWipe, ZeroesTheBytesInPlaceThenEmptiesTheString) {
    std::string s = "a secret longer than the small-string buffer";
    const size_t n = s.size();
    const char* storage = s.data();
    egress::secure_wipe(s);
    EXPECT_TRUE(s.empty());
    ASSERT_EQ(s.data(), storage);  // clear() keeps the buffer: what it held is now zero
    EXPECT_EQ(std::string(storage, n), std::string(n, '\0'));
    egress::secure_wipe(s);  // an empty string is fine
    EXPECT_TRUE(s.empty());
}
