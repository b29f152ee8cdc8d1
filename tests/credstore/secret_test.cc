#include "credstore/secret.h"

#include "common/secure_zero.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>

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
