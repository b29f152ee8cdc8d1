#include "credstore/envelope.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <fcntl.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <cstring>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace egress::credstore {
namespace {

namespace fs = std::filesystem;

class TempDir {
public:
    TempDir() {
        char name[] = "/tmp/egress_envelope_test_XXXXXX";
        const char* made = mkdtemp(name);
        EXPECT_NE(made, nullptr);
        path_ = name;
    }
    ~TempDir() {
        std::error_code ec;
        fs::remove_all(path_, ec);
    }
    const std::string& path() const { return path_; }

private:
    std::string path_;
};

void write_file(const std::string& path, std::string_view content, mode_t mode) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << content;
    ASSERT_EQ(chmod(path.c_str(), mode), 0);
}

std::unique_ptr<KeyProvider> make_key(const TempDir& dir, const std::string& file, char fill) {
    const std::string path = dir.path() + "/" + file;
    write_file(path, std::string(32, fill), 0600);
    auto kek = open_master_key_file(path, false);
    EXPECT_TRUE(kek.ok()) << kek.error();
    return kek.ok() ? std::move(kek).value() : nullptr;
}

// Flips one bit of the decoded bytes at `index` and re-encodes.
std::string flip_byte(const std::string& b64, size_t index) {
    std::string bytes = base64_decode(b64).value();
    bytes.at(index) = static_cast<char>(bytes.at(index) ^ 0x01);
    return base64_encode(bytes);
}

const Scope kScope{"acme", "web", "", ""};

TEST(Base64, RoundTripsEveryPaddingLength) {
    const std::string all = [] {
        std::string s;
        for (int i = 0; i < 256; ++i) {
            s.push_back(static_cast<char>(i));
        }
        return s;
    }();
    for (size_t n = 0; n <= 10; ++n) {
        const std::string in = all.substr(n * 7 % 200, n);
        const std::string enc = base64_encode(in);
        EXPECT_EQ(enc.size() % 4, 0U);
        auto dec = base64_decode(enc);
        ASSERT_TRUE(dec.ok()) << enc;
        EXPECT_EQ(*dec, in) << n;
    }
    auto whole = base64_decode(base64_encode(all));
    ASSERT_TRUE(whole.ok());
    EXPECT_EQ(*whole, all);
    EXPECT_EQ(base64_encode("foobar"), "Zm9vYmFy");
    EXPECT_EQ(base64_encode("fo"), "Zm8=");
    EXPECT_EQ(base64_decode("Zm8=").value(), "fo");
    EXPECT_EQ(base64_decode("Zg==").value(), "f");
}

TEST(Base64, RejectsInvalidInput) {
    for (const char* bad :
         {"Zm8", "Zm9v!mFy", "Zm=v", "Z===", "====", "Zm9v\nYmFy", " Zm8=", "Zm8=Zm8=", "Zg=a"}) {
        EXPECT_FALSE(base64_decode(bad).ok()) << bad;
    }
}

struct stat with_owner(struct stat st, uid_t uid) {
    st.st_uid = uid;
    return st;
}

TEST(NotOwnerOnly, OnlyTheOwnerOrAKubernetesSecretForANonRootEgressd) {
    struct stat st{};
    auto with = [&](uid_t uid, gid_t gid, unsigned mode) {
        st.st_uid = uid;
        st.st_gid = gid;
        st.st_mode = S_IFREG | mode;
        return st;
    };
    const ProcessIds nonroot{65532, {65532, 10}};
    const ProcessIds root{0, {0}};
    // The owner's alone: whoever owns it.
    EXPECT_FALSE(not_owner_only("k", "f", with(65532, 65532, 0600), nonroot));
    EXPECT_FALSE(not_owner_only("k", "f", with(0, 0, 0400), root));
    // Root's file under egressd's (supplementary) group, 0440 or 0640: a Kubernetes Secret
    // with fsGroup, for a non-root egressd.
    EXPECT_FALSE(not_owner_only("k", "f", with(0, 65532, 0440), nonroot));
    EXPECT_FALSE(not_owner_only("k", "f", with(0, 10, 0640), nonroot));
    // Not with a bit for others, group write, another group, another owner, or a root egressd.
    EXPECT_TRUE(not_owner_only("k", "f", with(0, 65532, 0444), nonroot));
    EXPECT_TRUE(not_owner_only("k", "f", with(0, 65532, 0460), nonroot));
    EXPECT_TRUE(not_owner_only("k", "f", with(0, 4242, 0440), nonroot));
    EXPECT_TRUE(not_owner_only("k", "f", with(65532, 65532, 0440), nonroot));
    EXPECT_TRUE(not_owner_only("k", "f", with(0, 0, 0440), root));
    auto why = not_owner_only("admin.token_file", "/x/t", with(0, 4242, 0644), nonroot);
    ASSERT_TRUE(why);
    EXPECT_EQ(*why, "admin.token_file: /x/t is readable by group or others (mode 0644); chmod "
                    "600 it");
}

TEST(NotOwnerOnly, AFileWithAnAclIsNotTakenForAKubernetesSecret) {
    // Root's 0440 file in egressd's group, but a POSIX ACL lets user 1000 read it too (the
    // group bits are then the ACL's mask): refused.
    TempDir dir;
    const std::string path = dir.path() + "/token";
    write_file(path, "t", 0440);
    struct AclEntry {
        uint16_t tag, perm;
        uint32_t id;
    };
    struct {
        uint32_t version = 2;
        AclEntry e[5] = {{0x01, 4, ~0u}, {0x02, 4, 1000}, {0x04, 4, ~0u}, {0x10, 4, ~0u},
                         {0x20, 0, ~0u}};
    } acl;
    if (::setxattr(path.c_str(), "system.posix_acl_access", &acl, sizeof acl, 0) != 0) {
        GTEST_SKIP() << "no POSIX ACLs here: " << std::strerror(errno);
    }
    struct stat st{};
    ASSERT_EQ(::stat(path.c_str(), &st), 0);
    ASSERT_EQ(st.st_mode & 0777, 0440u);
    const ProcessIds nonroot{65532, {st.st_gid}};
    EXPECT_TRUE(not_owner_only("k", path, with_owner(st, 0), nonroot));
    ASSERT_EQ(::removexattr(path.c_str(), "system.posix_acl_access"), 0);
    ASSERT_EQ(::chmod(path.c_str(), 0440), 0);
    ASSERT_EQ(::stat(path.c_str(), &st), 0);
    EXPECT_FALSE(not_owner_only("k", path, with_owner(st, 0), nonroot));
}

TEST(MasterKeyFile, PermissionsAndSize) {
    TempDir dir;
    const std::string path = dir.path() + "/master.key";
    write_file(path, std::string(32, 'k'), 0644);
    auto loose = open_master_key_file(path, true);
    ASSERT_FALSE(loose.ok());
    EXPECT_EQ(loose.error(), "keys.master_key_file: " + path +
                                 " is readable by group or others (mode 0644); chmod 600 it");

    ASSERT_EQ(chmod(path.c_str(), 0640), 0);
    EXPECT_FALSE(open_master_key_file(path, false).ok());

    ASSERT_EQ(chmod(path.c_str(), 0600), 0);
    auto ok = open_master_key_file(path, false);
    ASSERT_TRUE(ok.ok()) << ok.error();
    EXPECT_EQ((*ok)->key_id().rfind("file:", 0), 0U);
    EXPECT_EQ((*ok)->key_id().size(), 5U + 8U);

    ASSERT_EQ(chmod(path.c_str(), 0400), 0);
    EXPECT_TRUE(open_master_key_file(path, false).ok());

    write_file(path, std::string(31, 'k'), 0600);
    auto short_key = open_master_key_file(path, false);
    ASSERT_FALSE(short_key.ok());
    EXPECT_NE(short_key.error().find("exactly 32 bytes"), std::string::npos);
    write_file(path, std::string(33, 'k'), 0600);
    EXPECT_FALSE(open_master_key_file(path, false).ok());
}

// A process killed while creating the key (here by SIGXFSZ at its first write, as a crash or
// power loss could) leaves no master.key, never an empty one that blocks every later start.
TEST(MasterKeyFile, CreateKilledMidwayLeavesNoKeyFileAndTheNextStartCreatesIt) {
    TempDir dir;
    const std::string path = dir.path() + "/master.key";
    auto create_with_no_room = [&] {
        const rlimit none{0, 0};
        setrlimit(RLIMIT_FSIZE, &none);
        (void)open_master_key_file(path, true);
        std::exit(0);
    };
    EXPECT_EXIT(create_with_no_room(), ::testing::KilledBySignal(SIGXFSZ), "");
    EXPECT_FALSE(fs::exists(path));
    auto created = open_master_key_file(path, true);
    ASSERT_TRUE(created.ok()) << created.error();
    EXPECT_EQ(fs::file_size(path), 32U);
    EXPECT_FALSE(fs::exists(path + ".tmp"));  // the leftover is gone
}

TEST(MasterKeyFile, CreatedWhenMissingWith0600) {
    TempDir dir;
    const std::string path = dir.path() + "/sub/dir/master.key";
    EXPECT_FALSE(open_master_key_file(path, false).ok());
    EXPECT_FALSE(fs::exists(path));

    auto created = open_master_key_file(path, true);
    ASSERT_TRUE(created.ok()) << created.error();
    struct stat st {};
    ASSERT_EQ(stat(path.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600U);
    EXPECT_EQ(st.st_size, 32);

    // Reopening reads the same key (same id, and it unwraps what the first one wrapped).
    auto again = open_master_key_file(path, true);
    ASSERT_TRUE(again.ok()) << again.error();
    EXPECT_EQ((*again)->key_id(), (*created)->key_id());
    auto sealed = seal(**created, "tok", kScope, 1, "value-1");
    ASSERT_TRUE(sealed.ok()) << sealed.error();
    auto opened = unseal(**again, *sealed);
    ASSERT_TRUE(opened.ok()) << opened.error();
    EXPECT_EQ((*opened)->reveal(), "value-1");
}

TEST(Envelope, SealUnsealRoundTrip) {
    TempDir dir;
    auto kek = make_key(dir, "k", 'a');
    ASSERT_NE(kek, nullptr);
    auto sealed = seal(*kek, "github_token", kScope, 3, "ghp_supersecretvalue");
    ASSERT_TRUE(sealed.ok()) << sealed.error();
    EXPECT_EQ(sealed->name, "github_token");
    EXPECT_EQ(sealed->scope, kScope);
    EXPECT_EQ(sealed->version, 3U);
    EXPECT_EQ(sealed->kek_id, kek->key_id());
    EXPECT_EQ(sealed->created_at.size(), 20U);  // 2026-01-02T03:04:05Z
    EXPECT_EQ(sealed->created_at.back(), 'Z');
    EXPECT_EQ(base64_decode(sealed->nonce)->size(), 12U);
    EXPECT_EQ(base64_decode(sealed->ciphertext)->size(), 20U + 16U);
    auto opened = unseal(*kek, *sealed);
    ASSERT_TRUE(opened.ok()) << opened.error();
    EXPECT_EQ((*opened)->reveal(), "ghp_supersecretvalue");

    // Fresh DEK and nonce every time.
    auto again = seal(*kek, "github_token", kScope, 3, "ghp_supersecretvalue");
    ASSERT_TRUE(again.ok());
    EXPECT_NE(again->ciphertext, sealed->ciphertext);
    EXPECT_NE(again->wrapped_dek, sealed->wrapped_dek);
    EXPECT_NE(again->nonce, sealed->nonce);
}

TEST(Envelope, SealValidatesThePlaintext) {
    TempDir dir;
    auto kek = make_key(dir, "k", 'a');
    EXPECT_FALSE(seal(*kek, "t", kScope, 1, "").ok());
    EXPECT_FALSE(seal(*kek, "t", kScope, 1, "a\r\nX-Injected: 1").ok());
    EXPECT_FALSE(seal(*kek, "t", kScope, 1, std::string(16 * 1024 + 1, 'x')).ok());
    EXPECT_FALSE(seal(*kek, "", kScope, 1, "v").ok());
    // Run CA keys ("ca:<run id>") are multi-line PEM and are allowed newlines.
    const std::string pem = "-----BEGIN PRIVATE KEY-----\nMIGHAgEA\n-----END PRIVATE KEY-----\n";
    auto ca = seal(*kek, "ca:run_1", kScope, 1, pem);
    ASSERT_TRUE(ca.ok()) << ca.error();
    EXPECT_EQ(unseal(*kek, *ca).value()->reveal(), pem);
}

TEST(Envelope, SealNeverContainsThePlaintext) {
    TempDir dir;
    auto kek = make_key(dir, "k", 'a');
    const std::string value = "sk_live_PLAINTEXT_MARKER_12345";
    auto sealed = seal(*kek, "stripe", kScope, 1, value);
    ASSERT_TRUE(sealed.ok());
    std::ostringstream all;
    all << sealed->name << sealed->scope.to_string() << sealed->created_at << sealed->kek_id
        << sealed->wrapped_dek << sealed->nonce << sealed->ciphertext;
    for (const std::string& field : {sealed->wrapped_dek, sealed->nonce, sealed->ciphertext}) {
        all << base64_decode(field).value();
    }
    EXPECT_EQ(all.str().find(value), std::string::npos);
    EXPECT_EQ(all.str().find(base64_encode(value)), std::string::npos);
}

TEST(Envelope, AadBindsNameScopeAndVersion) {
    TempDir dir;
    auto kek = make_key(dir, "k", 'a');
    auto sealed = seal(*kek, "github_token", kScope, 2, "value");
    ASSERT_TRUE(sealed.ok());
    ASSERT_TRUE(unseal(*kek, *sealed).ok());

    SealedSecret renamed = *sealed;
    renamed.name = "other_token";
    EXPECT_FALSE(unseal(*kek, renamed).ok());

    SealedSecret rescoped = *sealed;
    rescoped.scope = Scope{"acme", "", "", ""};
    EXPECT_FALSE(unseal(*kek, rescoped).ok());
    rescoped.scope = Scope{"acme", "web", "ana", ""};
    EXPECT_FALSE(unseal(*kek, rescoped).ok());

    SealedSecret reversioned = *sealed;
    reversioned.version = 1;
    EXPECT_FALSE(unseal(*kek, reversioned).ok());

    // Length-prefixed fields: the boundary between name and scope cannot shift.
    auto a = seal(*kek, "a", Scope{"bc", "", "", ""}, 1, "v");
    ASSERT_TRUE(a.ok());
    SealedSecret shifted = *a;
    shifted.name = "ab";
    shifted.scope = Scope{"c", "", "", ""};
    EXPECT_FALSE(unseal(*kek, shifted).ok());
    // The error says nothing about the value.
    auto err = unseal(*kek, renamed);
    EXPECT_EQ(err.error().find("value"), std::string::npos);
}

TEST(Envelope, TamperingIsDetected) {
    TempDir dir;
    auto kek = make_key(dir, "k", 'a');
    auto sealed = seal(*kek, "tok", kScope, 1, "some-secret-value");
    ASSERT_TRUE(sealed.ok());
    const size_t ct_len = base64_decode(sealed->ciphertext)->size();
    for (size_t i : {size_t{0}, ct_len / 2, ct_len - 1}) {  // body and tag
        SealedSecret t = *sealed;
        t.ciphertext = flip_byte(t.ciphertext, i);
        EXPECT_FALSE(unseal(*kek, t).ok()) << "ciphertext byte " << i;
    }
    const size_t wrapped_len = base64_decode(sealed->wrapped_dek)->size();
    for (size_t i : {size_t{0}, size_t{12}, wrapped_len - 1}) {  // nonce, ct, tag
        SealedSecret t = *sealed;
        t.wrapped_dek = flip_byte(t.wrapped_dek, i);
        EXPECT_FALSE(unseal(*kek, t).ok()) << "wrapped dek byte " << i;
    }
    SealedSecret nonce = *sealed;
    nonce.nonce = flip_byte(nonce.nonce, 5);
    EXPECT_FALSE(unseal(*kek, nonce).ok());
    SealedSecret truncated = *sealed;
    truncated.ciphertext = base64_encode(base64_decode(sealed->ciphertext)->substr(0, 8));
    EXPECT_FALSE(unseal(*kek, truncated).ok());
    SealedSecret garbage = *sealed;
    garbage.wrapped_dek = "not base64!";
    EXPECT_FALSE(unseal(*kek, garbage).ok());

    auto other_kek = make_key(dir, "k2", 'b');
    EXPECT_FALSE(unseal(*other_kek, *sealed).ok());
}

TEST(Envelope, KekRotationRewrapsOnlyTheDataKey) {
    TempDir dir;
    auto old_kek = make_key(dir, "old", 'o');
    auto new_kek = make_key(dir, "new", 'n');
    ASSERT_NE(old_kek->key_id(), new_kek->key_id());
    auto sealed = seal(*old_kek, "tok", kScope, 4, "rotate-me");
    ASSERT_TRUE(sealed.ok());
    EXPECT_FALSE(unseal(*new_kek, *sealed).ok());

    auto rewrapped = rewrap(*old_kek, *new_kek, *sealed);
    ASSERT_TRUE(rewrapped.ok()) << rewrapped.error();
    EXPECT_EQ(rewrapped->ciphertext, sealed->ciphertext);
    EXPECT_EQ(rewrapped->nonce, sealed->nonce);
    EXPECT_EQ(rewrapped->name, sealed->name);
    EXPECT_EQ(rewrapped->version, sealed->version);
    EXPECT_EQ(rewrapped->created_at, sealed->created_at);
    EXPECT_NE(rewrapped->wrapped_dek, sealed->wrapped_dek);
    EXPECT_EQ(rewrapped->kek_id, new_kek->key_id());

    EXPECT_FALSE(unseal(*old_kek, *rewrapped).ok());
    auto opened = unseal(*new_kek, *rewrapped);
    ASSERT_TRUE(opened.ok()) << opened.error();
    EXPECT_EQ((*opened)->reveal(), "rotate-me");

    // Rewrapping with the wrong source key fails and names no data.
    EXPECT_FALSE(rewrap(*old_kek, *new_kek, *rewrapped).ok());
}

/// A KEK that neither wraps nor unwraps: a KMS that is down.
class DownKek : public KeyProvider {
public:
    std::string key_id() const override { return "kms:down"; }
    Result<std::string> wrap(std::string_view) override { return make_error("kms down"); }
    Result<std::string> unwrap(std::string_view) override { return make_error("kms down"); }
};

// `keys rotate` skips a record whose data key does not unwrap, but fails as a whole when the
// new key does not wrap: rewrap says which side failed.
TEST(Envelope, ARewrapFailureSaysWhetherTheRecordOrTheNewKeyFailed) {
    TempDir dir;
    auto old_kek = make_key(dir, "old", 'o');
    auto new_kek = make_key(dir, "new", 'n');
    auto sealed = seal(*old_kek, "tok", kScope, 1, "rotate-me");
    ASSERT_TRUE(sealed.ok());
    DownKek down;
    bool record_failed = false;
    EXPECT_FALSE(rewrap(*new_kek, *old_kek, *sealed, &record_failed).ok());  // wrong key
    EXPECT_TRUE(record_failed);
    record_failed = false;
    EXPECT_FALSE(rewrap(down, *new_kek, *sealed, &record_failed).ok());
    EXPECT_TRUE(record_failed);
    record_failed = true;
    EXPECT_FALSE(rewrap(*old_kek, down, *sealed, &record_failed).ok());
    EXPECT_FALSE(record_failed) << "the new key failed, not the record";
    EXPECT_TRUE(rewrap(*old_kek, *new_kek, *sealed, &record_failed).ok());
}

// A tiny KMS plugin: wraps with `openssl enc` under a fixed test key, base64 over the pipes.
class FakeKms {
public:
    explicit FakeKms(const TempDir& dir, const std::string& key_id = "test-kms-1") {
        script_ = dir.path() + "/kms.sh";
        std::ofstream out(script_);
        out << "#!/bin/sh\n"
               "K=000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f\n"
               "IV=0f0e0d0c0b0a09080706050403020100\n"
               "case \"$1\" in\n"
               "  key-id) echo "
            << key_id
            << "; echo ignored-second-line ;;\n"
               "  wrap) base64 -d | openssl enc -aes-256-cbc -K $K -iv $IV | base64 -w0 ;;\n"
               "  unwrap) base64 -d | openssl enc -d -aes-256-cbc -K $K -iv $IV | base64 -w0 ;;\n"
               "  *) exit 2 ;;\n"
               "esac\n";
        out.close();
        chmod(script_.c_str(), 0700);
    }
    const std::string& script() const { return script_; }

private:
    std::string script_;
};

TEST(KmsCommandProvider, RoundTrip) {
    TempDir dir;
    FakeKms kms(dir);
    auto provider = make_kms_command_provider(kms.script());
    ASSERT_TRUE(provider.ok()) << provider.error();
    EXPECT_EQ((*provider)->key_id(), "kms:test-kms-1");

    const std::string dek(32, '\x5a');
    auto wrapped = (*provider)->wrap(dek);
    ASSERT_TRUE(wrapped.ok()) << wrapped.error();
    EXPECT_NE(*wrapped, dek);
    auto unwrapped = (*provider)->unwrap(*wrapped);
    ASSERT_TRUE(unwrapped.ok()) << unwrapped.error();
    EXPECT_EQ(*unwrapped, dek);

    auto sealed = seal(**provider, "tok", kScope, 1, "kms-protected");
    ASSERT_TRUE(sealed.ok()) << sealed.error();
    EXPECT_EQ(sealed->kek_id, "kms:test-kms-1");
    auto opened = unseal(**provider, *sealed);
    ASSERT_TRUE(opened.ok()) << opened.error();
    EXPECT_EQ((*opened)->reveal(), "kms-protected");

    // Rotation from a file KEK to the KMS and back.
    auto file_kek = make_key(dir, "k", 'f');
    auto from_file = seal(*file_kek, "tok", kScope, 2, "moved");
    ASSERT_TRUE(from_file.ok());
    auto to_kms = rewrap(*file_kek, **provider, *from_file);
    ASSERT_TRUE(to_kms.ok()) << to_kms.error();
    EXPECT_EQ(unseal(**provider, *to_kms).value()->reveal(), "moved");
}

TEST(KmsCommandProvider, FailuresNameTheCommandNotTheData) {
    TempDir dir;
    auto missing = make_kms_command_provider(dir.path() + "/no-such-kms");
    ASSERT_FALSE(missing.ok());
    EXPECT_NE(missing.error().find("no-such-kms key-id"), std::string::npos) << missing.error();
    EXPECT_NE(missing.error().find("exited with status"), std::string::npos);

    EXPECT_FALSE(make_kms_command_provider("").ok());
    EXPECT_FALSE(make_kms_command_provider("true").ok());  // no key id printed

    // key-id works, wrap and unwrap fail (unwrap of garbage: openssl reports bad decrypt).
    const std::string script = dir.path() + "/failing.sh";
    {
        std::ofstream out(script);
        out << "#!/bin/sh\n"
               "case \"$1\" in key-id) echo k ;; wrap) cat >/dev/null; exit 7 ;;\n"
               "  unwrap) echo '%%% not base64 %%%' ;; esac\n";
    }
    chmod(script.c_str(), 0700);
    auto provider = make_kms_command_provider(script);
    ASSERT_TRUE(provider.ok()) << provider.error();
    const std::string dek = "DEK-BYTES-THAT-MUST-NOT-LEAK-0123";
    auto wrapped = (*provider)->wrap(dek);
    ASSERT_FALSE(wrapped.ok());
    EXPECT_NE(wrapped.error().find(script + " wrap"), std::string::npos) << wrapped.error();
    EXPECT_NE(wrapped.error().find("status 7"), std::string::npos) << wrapped.error();
    EXPECT_EQ(wrapped.error().find(dek), std::string::npos);
    EXPECT_EQ(wrapped.error().find(base64_encode(dek)), std::string::npos);
    auto unwrapped = (*provider)->unwrap("wrapped");
    ASSERT_FALSE(unwrapped.ok());
    EXPECT_NE(unwrapped.error().find("not base64"), std::string::npos) << unwrapped.error();
    EXPECT_FALSE(seal(**provider, "tok", kScope, 1, "v").ok());
}

// The plugin gets stdin, stdout and stderr only: a descriptor of ours without close-on-exec
// (as Asio's sockets are) is not inherited; nor is SIGHUP ignored (egressd ignores it while
// it starts).
TEST(KmsCommandProvider, ChildInheritsNoOtherDescriptorNorIgnoredSighup) {
    TempDir dir;
    const int fd = ::open("/dev/null", O_RDONLY);  // no O_CLOEXEC
    ASSERT_GT(fd, STDERR_FILENO);
    const std::string script = dir.path() + "/fds.sh";
    {
        std::ofstream out(script);
        out << "#!/bin/sh\n"
               "if [ -e /proc/self/fd/" << fd << " ]; then echo inherited; exit; fi\n"
               "case $(awk '/^SigIgn/ {print substr($2, length($2))}' /proc/self/status) in\n"
               "  1|3|5|7|9|b|d|f) echo sighup-ignored ;;\n"
               "  *) echo clean ;;\n"
               "esac\n";
    }
    chmod(script.c_str(), 0700);
    auto* const before = std::signal(SIGHUP, SIG_IGN);
    auto provider = make_kms_command_provider(script);
    std::signal(SIGHUP, before);
    ::close(fd);
    ASSERT_TRUE(provider.ok()) << provider.error();
    EXPECT_EQ((*provider)->key_id(), "kms:clean");
}

TEST(KmsCommandProvider, ChildThatIgnoresStdinDoesNotHangOrKillUs) {
    TempDir dir;
    const std::string script = dir.path() + "/deaf.sh";
    {
        std::ofstream out(script);
        out << "#!/bin/sh\ncase \"$1\" in key-id) echo deaf ;; *) exit 0 ;; esac\n";
    }
    chmod(script.c_str(), 0700);
    auto provider = make_kms_command_provider(script);
    ASSERT_TRUE(provider.ok()) << provider.error();
    // The child exits without reading: the write may hit EPIPE (which must not kill us with
    // SIGPIPE), and an empty answer is an error, not an empty wrapped key.
    for (int i = 0; i < 20; ++i) {
        auto wrapped = (*provider)->wrap(std::string(4096, 'x'));
        ASSERT_FALSE(wrapped.ok());
        EXPECT_NE(wrapped.error().find("printed nothing"), std::string::npos) << wrapped.error();
    }
}

}  // namespace
}  // namespace egress::credstore
