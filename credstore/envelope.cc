#include "credstore/envelope.h"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>

#include "common/hex.h"
#include "common/regular_file.h"
#include "common/secure_zero.h"

extern char** environ;

namespace egress::credstore {

namespace {

constexpr size_t kKeyBytes = 32;
constexpr size_t kNonceBytes = 12;
constexpr size_t kTagBytes = 16;
// Secrets named "ca:<run id>" hold a run CA's private key (PEM, multi-line). They are never
// injected into a header, so the CR/LF rule of validate_secret_bytes does not apply to them.
constexpr std::string_view kKeyMaterialPrefix = "ca:";
constexpr size_t kMaxKeyMaterialBytes = 64 * 1024;
constexpr std::string_view kWrapAad = "egressd/kek-wrap/v1";
constexpr std::string_view kSecretAadLabel = "egressd/secret/v1";
constexpr size_t kMaxKmsOutputBytes = 64 * 1024;
constexpr int kKmsTimeoutMs = 30'000;

// Owns a std::string holding key or plaintext bytes; wipes it on every exit path.
class WipedString {
public:
    WipedString() = default;
    explicit WipedString(std::string s) : s_(std::move(s)) {}
    ~WipedString() { egress::secure_wipe(s_); }
    WipedString(const WipedString&) = delete;
    WipedString& operator=(const WipedString&) = delete;
    std::string& get() { return s_; }

private:
    std::string s_;
};

struct CipherCtxDeleter {
    void operator()(EVP_CIPHER_CTX* ctx) const { EVP_CIPHER_CTX_free(ctx); }
};
using CipherCtxPtr = std::unique_ptr<EVP_CIPHER_CTX, CipherCtxDeleter>;

const unsigned char* bytes_of(std::string_view s) {
    return reinterpret_cast<const unsigned char*>(s.data());
}

// AES-256-GCM. Encrypting returns ct||tag; decrypting takes ct||tag and fails unless the tag
// verifies. WARNING: a decryption result is plaintext; callers wipe it.
Result<std::string> aes_gcm(bool encrypt, std::string_view key, std::string_view nonce,
                            std::string_view aad, std::string_view input) {
    if (key.size() != kKeyBytes || nonce.size() != kNonceBytes ||
        (!encrypt && input.size() < kTagBytes)) {
        return make_error("aes-gcm: bad input sizes");
    }
    const std::string_view body = encrypt ? input : input.substr(0, input.size() - kTagBytes);
    std::string tag =
        encrypt ? std::string(kTagBytes, '\0') : std::string(input.substr(body.size()));
    std::string out(body.size(), '\0');
    auto* o = reinterpret_cast<unsigned char*>(out.data());
    CipherCtxPtr ctx(EVP_CIPHER_CTX_new());
    const int enc = encrypt ? 1 : 0;
    int len = 0;
    bool ok =
        ctx &&
        EVP_CipherInit_ex(ctx.get(), EVP_aes_256_gcm(), nullptr, nullptr, nullptr, enc) == 1 &&
        EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_SET_IVLEN, kNonceBytes, nullptr) == 1 &&
        EVP_CipherInit_ex(ctx.get(), nullptr, nullptr, bytes_of(key), bytes_of(nonce), enc) == 1 &&
        EVP_CipherUpdate(ctx.get(), nullptr, &len, bytes_of(aad), static_cast<int>(aad.size())) ==
            1;
    int total = 0;
    if (ok && !body.empty()) {
        ok = EVP_CipherUpdate(ctx.get(), o, &total, bytes_of(body),
                              static_cast<int>(body.size())) == 1;
    }
    if (ok && !encrypt) {
        ok = EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_SET_TAG, kTagBytes, tag.data()) == 1;
    }
    ok = ok && EVP_CipherFinal_ex(ctx.get(), o + total, &len) == 1 &&
         static_cast<size_t>(total + len) == body.size();
    if (ok && encrypt) {
        ok = EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_GET_TAG, kTagBytes, tag.data()) == 1;
        out += tag;
    }
    if (!ok) {
        egress::secure_wipe(out);
        return make_error(encrypt ? "aes-gcm: encryption failed"
                                  : "aes-gcm: authentication failed");
    }
    return out;
}

Result<std::string> random_bytes(size_t n) {
    std::string out(n, '\0');
    if (RAND_bytes(reinterpret_cast<unsigned char*>(out.data()), static_cast<int>(n)) != 1) {
        return make_error("RAND_bytes failed");
    }
    return out;
}

void append_u64(std::string& out, uint64_t v) {
    for (int shift = 56; shift >= 0; shift -= 8) {
        out.push_back(static_cast<char>((v >> shift) & 0xff));
    }
}

void append_field(std::string& out, std::string_view field) {
    append_u64(out, field.size());
    out.append(field);
}

// The canonical AAD: every field length-prefixed, so ("a", "bc") and ("ab", "c") differ.
std::string secret_aad(const std::string& name, const Scope& scope, uint64_t version) {
    std::string aad;
    append_field(aad, kSecretAadLabel);
    append_field(aad, name);
    append_field(aad, scope.to_string());
    append_u64(aad, version);
    return aad;
}

std::string now_rfc3339() {
    const std::time_t t = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
    std::tm tm{};
    gmtime_r(&t, &tm);
    char buf[32];
    std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
    return buf;
}


// ---- file provider -------------------------------------------------------------------------

// The KEK in one anonymous page: mlock'ed (kept out of swap), excluded from core dumps, wiped
// and unmapped on destruction.
class FileKeyProvider final : public KeyProvider {
public:
    static Result<std::unique_ptr<FileKeyProvider>> make(std::string_view key) {
        const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
        void* mem = mmap(nullptr, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (mem == MAP_FAILED) {
            return make_error("keys.master_key_file: cannot allocate key memory");
        }
        (void)mlock(mem, page);  // best effort: RLIMIT_MEMLOCK may refuse
#ifdef MADV_DONTDUMP
        (void)madvise(mem, page, MADV_DONTDUMP);
#endif
        std::memcpy(mem, key.data(), kKeyBytes);
        return std::unique_ptr<FileKeyProvider>(new FileKeyProvider(mem, page));
    }

    ~FileKeyProvider() override {
        egress::secure_zero(mem_, page_);
        (void)munlock(mem_, page_);
        (void)munmap(mem_, page_);
    }
    FileKeyProvider(const FileKeyProvider&) = delete;
    FileKeyProvider& operator=(const FileKeyProvider&) = delete;

    std::string key_id() const override {
        return key_id_;
    }

    Result<std::string> wrap(std::string_view dek) override {
        Result<std::string> nonce = random_bytes(kNonceBytes);
        if (!nonce) {
            return make_error("kek wrap: " + nonce.error());
        }
        Result<std::string> ct = aes_gcm(true, key(), *nonce, kWrapAad, dek);
        if (!ct) {
            return make_error("kek wrap: " + ct.error());
        }
        return *nonce + *ct;
    }

    Result<std::string> unwrap(std::string_view wrapped) override {
        if (wrapped.size() < kNonceBytes + kTagBytes) {
            return make_error("kek unwrap: wrapped key too short");
        }
        Result<std::string> dek = aes_gcm(false, key(), wrapped.substr(0, kNonceBytes), kWrapAad,
                                          wrapped.substr(kNonceBytes));
        if (!dek) {
            return make_error("kek unwrap: wrong master key or tampered data key");
        }
        return std::move(dek).value();
    }

private:
    FileKeyProvider(void* mem, size_t page) : mem_(mem), page_(page) {
        key_id_ = "file:" + sha256_hex(key()).substr(0, 8);
    }
    std::string_view key() const {
        return {static_cast<const char*>(mem_), kKeyBytes};
    }

    void* mem_;
    size_t page_;
    std::string key_id_;
};

std::string errno_text() {
    return std::strerror(errno);
}

Result<bool> create_key_file(const std::string& path) {
    const std::filesystem::path p(path);
    std::error_code ec;
    if (p.has_parent_path() && !std::filesystem::exists(p.parent_path(), ec)) {
        std::filesystem::create_directories(p.parent_path(), ec);
        if (ec) {
            return make_error("keys.master_key_file: cannot create folder of " + path + ": " +
                              ec.message());
        }
        std::filesystem::permissions(p.parent_path(), std::filesystem::perms::owner_all, ec);
    }
    Result<std::string> key = random_bytes(kKeyBytes);
    WipedString guard(key ? std::move(key).value() : std::string());
    if (guard.get().size() != kKeyBytes) {
        return make_error("keys.master_key_file: cannot make a key for " + path);
    }
    // false: it exists already; the caller opens and checks it.
    Result<bool> created = create_secret_file(path, guard.get());
    if (!created) {
        return make_error("keys.master_key_file: " + created.error());
    }
    return true;
}

// ---- KMS command provider ------------------------------------------------------------------

class Fd {
public:
    Fd() = default;
    explicit Fd(int fd) : fd_(fd) {}
    ~Fd() { reset(); }
    Fd(const Fd&) = delete;
    Fd& operator=(const Fd&) = delete;
    int get() const { return fd_; }
    void reset() {
        if (fd_ >= 0) {
            ::close(fd_);
        }
        fd_ = -1;
    }

private:
    int fd_ = -1;
};

// Writes to a pipe without letting SIGPIPE kill the process if the reader is gone: SIGPIPE is
// blocked on this thread for the write and a pending one is consumed afterwards.
ssize_t write_no_sigpipe(int fd, const char* data, size_t n) {
    sigset_t pipe_set;
    sigset_t old_set;
    sigemptyset(&pipe_set);
    sigaddset(&pipe_set, SIGPIPE);
    sigset_t pending;
    sigemptyset(&pending);
    pthread_sigmask(SIG_BLOCK, &pipe_set, &old_set);
    sigpending(&pending);
    const bool was_pending = sigismember(&pending, SIGPIPE) == 1;
    const ssize_t w = ::write(fd, data, n);
    const int saved = errno;
    if (w < 0 && saved == EPIPE && !was_pending) {
        const timespec zero{0, 0};
        (void)sigtimedwait(&pipe_set, nullptr, &zero);
    }
    pthread_sigmask(SIG_SETMASK, &old_set, nullptr);
    errno = saved;
    return w;
}

// Runs /bin/sh -c "<command>", feeding `input` on stdin and collecting stdout. stdin and
// stdout are serviced together with poll(), so a child that writes before reading everything
// cannot deadlock us. Errors name the command, never the data.
Result<std::string> run_command(const std::string& command, std::string_view input) {
    int in_pipe[2];
    int out_pipe[2];
    if (::pipe2(in_pipe, O_CLOEXEC) != 0) {
        return make_error("kms command '" + command + "': pipe: " + errno_text());
    }
    Fd in_read(in_pipe[0]);
    Fd in_write(in_pipe[1]);
    if (::pipe2(out_pipe, O_CLOEXEC) != 0) {
        return make_error("kms command '" + command + "': pipe: " + errno_text());
    }
    Fd out_read(out_pipe[0]);
    Fd out_write(out_pipe[1]);

    // posix_spawn is fork+exec that is safe in a multi-threaded process.
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, in_read.get(), STDIN_FILENO);
    posix_spawn_file_actions_adddup2(&actions, out_write.get(), STDOUT_FILENO);
    // Only stdin, stdout and stderr: egressd's listening and client sockets (Asio opens them
    // without close-on-exec) must not live on in a helper the plugin leaves running.
    posix_spawn_file_actions_addclosefrom_np(&actions, STDERR_FILENO + 1);
    std::string sh = "/bin/sh";
    std::string dash_c = "-c";
    std::string cmd = command;
    char* argv[] = {sh.data(), dash_c.data(), cmd.data(), nullptr};
    // SIGHUP as the plugin expects it: egressd ignores it while it starts (main.cc), and an
    // ignored signal would stay ignored in the child.
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    sigset_t defaults;
    sigemptyset(&defaults);
    sigaddset(&defaults, SIGHUP);
    posix_spawnattr_setsigdefault(&attr, &defaults);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGDEF);
    pid_t pid = -1;
    const int rc = posix_spawn(&pid, "/bin/sh", &actions, &attr, argv, environ);
    posix_spawnattr_destroy(&attr);
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) {
        return make_error("kms command '" + command + "': cannot start: " + std::strerror(rc));
    }
    in_read.reset();
    out_write.reset();
    ::fcntl(in_write.get(), F_SETFL, ::fcntl(in_write.get(), F_GETFL) | O_NONBLOCK);

    // unwrap's output is a plaintext data key: reserved once so that no copy is left behind
    // in a block a growing string gave back, and the read buffer is wiped after each read.
    std::string output;
    output.reserve(kMaxKmsOutputBytes + 4096);
    std::string failure;
    size_t written = 0;
    if (input.empty()) {
        in_write.reset();
    }
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(kKmsTimeoutMs);
    while (out_read.get() >= 0 && failure.empty()) {
        pollfd fds[2];
        nfds_t n = 0;
        fds[n++] = {out_read.get(), POLLIN, 0};
        if (in_write.get() >= 0) {
            fds[n++] = {in_write.get(), POLLOUT, 0};
        }
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        if (left.count() <= 0) {
            failure = "timed out";
            break;
        }
        const int ready = ::poll(fds, n, static_cast<int>(left.count()));
        if (ready < 0 && errno != EINTR) {
            failure = "poll: " + errno_text();
            break;
        }
        if (ready <= 0) {
            continue;
        }
        if (n == 2 && (fds[1].revents & (POLLOUT | POLLERR | POLLHUP)) != 0) {
            const ssize_t w =
                write_no_sigpipe(in_write.get(), input.data() + written, input.size() - written);
            if (w > 0) {
                written += static_cast<size_t>(w);
            }
            if ((w < 0 && errno != EAGAIN && errno != EINTR) || written == input.size()) {
                in_write.reset();  // done, or the child stopped reading: it sees EOF
            }
        }
        if ((fds[0].revents & (POLLIN | POLLERR | POLLHUP)) != 0) {
            char buf[4096];
            const ssize_t r = ::read(out_read.get(), buf, sizeof buf);
            if (r > 0) {
                output.append(buf, static_cast<size_t>(r));
                egress::secure_zero(buf, static_cast<size_t>(r));
                if (output.size() > kMaxKmsOutputBytes) {
                    failure = "output too large";
                }
            } else if (r == 0 || (errno != EINTR && errno != EAGAIN)) {
                out_read.reset();
            }
        }
    }
    in_write.reset();
    out_read.reset();
    if (!failure.empty()) {
        ::kill(pid, SIGKILL);
    }
    // The child may close stdout and keep running: wait for it within the same deadline.
    int status = 0;
    for (;;) {
        const pid_t done = ::waitpid(pid, &status, failure.empty() ? WNOHANG : 0);
        if (done == pid || (done < 0 && errno != EINTR)) {
            break;
        }
        if (done == 0 && std::chrono::steady_clock::now() >= deadline) {
            failure = "timed out";
            ::kill(pid, SIGKILL);
        } else if (done == 0) {
            ::usleep(1000);
        }
    }
    if (failure.empty() && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
        failure = WIFEXITED(status) ? "exited with status " + std::to_string(WEXITSTATUS(status))
                                    : "killed by signal " + std::to_string(WTERMSIG(status));
    }
    if (!failure.empty()) {
        egress::secure_wipe(output);
        return make_error("kms command '" + command + "' " + failure);
    }
    return output;
}

std::string_view trim(std::string_view s) {
    const auto space = [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; };
    while (!s.empty() && space(s.front())) {
        s.remove_prefix(1);
    }
    while (!s.empty() && space(s.back())) {
        s.remove_suffix(1);
    }
    return s;
}

class KmsCommandProvider final : public KeyProvider {
public:
    KmsCommandProvider(std::string command, std::string key_id)
        : command_(std::move(command)), key_id_(std::move(key_id)) {}

    std::string key_id() const override { return key_id_; }
    Result<std::string> wrap(std::string_view dek) override { return call("wrap", dek); }
    Result<std::string> unwrap(std::string_view wrapped) override {
        return call("unwrap", wrapped);
    }

private:
    Result<std::string> call(const char* verb, std::string_view data) {
        WipedString input(base64_encode(data) + "\n");
        Result<std::string> out = run_command(command_ + " " + verb, input.get());
        if (!out) {
            return make_error(out.error());
        }
        WipedString text(std::move(out).value());
        if (trim(text.get()).empty()) {
            return make_error("kms command '" + command_ + " " + verb + "' printed nothing");
        }
        Result<std::string> decoded = base64_decode(trim(text.get()));
        if (!decoded) {
            return make_error("kms command '" + command_ + " " + verb + "': output is not base64");
        }
        return std::move(decoded).value();
    }

    std::string command_;
    std::string key_id_;
};

}  // namespace

std::string sha256_hex(std::string_view bytes) {
    // Fetched once: EVP_sha256() has OpenSSL 3 fetch it from the provider on every digest
    // (an aws-sigv4 request hashes its canonical request, and maybe its body, each time).
    static EVP_MD* const sha256 = EVP_MD_fetch(nullptr, "SHA256", nullptr);
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int n = 0;
    EVP_Digest(bytes.data(), bytes.size(), md, &n, sha256, nullptr);
    std::string out = egress::to_hex(md, n);
    egress::secure_zero(md, sizeof md);  // a digest of key material is key material
    return out;
}

// ---- base64 --------------------------------------------------------------------------------

Result<std::string> base64_decode(std::string_view text) {
    // EVP_DecodeBlock skips whitespace and ignores padding; validate strictly first.
    if (text.size() % 4 != 0) {
        return make_error("invalid base64: length is not a multiple of 4");
    }
    size_t pad = 0;
    if (!text.empty() && text.back() == '=') {
        pad = text.size() >= 2 && text[text.size() - 2] == '=' ? 2 : 1;
    }
    for (size_t i = 0; i < text.size() - pad; ++i) {
        const char c = text[i];
        const bool valid = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') ||
                           (c >= '0' && c <= '9') || c == '+' || c == '/';
        if (!valid) {
            return make_error("invalid base64: unexpected character");
        }
    }
    if (text.empty()) {
        return std::string();
    }
    std::string out(text.size() / 4 * 3, '\0');
    const int n = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out.data()), bytes_of(text),
                                  static_cast<int>(text.size()));
    if (n < 0 || static_cast<size_t>(n) != out.size()) {
        egress::secure_wipe(out);
        return make_error("invalid base64");
    }
    out.resize(out.size() - pad);
    return out;
}

// ---- providers -----------------------------------------------------------------------------

Result<std::unique_ptr<KeyProvider>> open_master_key_file(const std::string& path,
                                                          bool create_if_missing) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) {
        if (errno != ENOENT || !create_if_missing) {
            return make_error("keys.master_key_file: " + path + ": " + errno_text());
        }
        Result<bool> created = create_key_file(path);
        if (!created) {
            return make_error(created.error());
        }
    }
    auto opened = egress::open_regular_file(path);
    if (!opened) {
        return make_error("keys.master_key_file: " + path + ": " + opened.error());
    }
    Fd fd(*opened);
    if (::fstat(fd.get(), &st) != 0) {
        return make_error("keys.master_key_file: " + path + ": " + errno_text());
    }
    if (auto why = not_owner_only("keys.master_key_file", path, st)) {
        return make_error(*why);
    }
    if (st.st_size != static_cast<off_t>(kKeyBytes)) {
        return make_error("keys.master_key_file: " + path + " must hold exactly 32 bytes (has " +
                          std::to_string(st.st_size) + ")");
    }
    WipedString key(std::string(kKeyBytes + 1, '\0'));
    size_t got = 0;
    while (got < key.get().size()) {
        const ssize_t r = ::read(fd.get(), key.get().data() + got, key.get().size() - got);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            break;
        }
        got += static_cast<size_t>(r);
    }
    if (got != kKeyBytes) {
        return make_error("keys.master_key_file: " + path + " must hold exactly 32 bytes");
    }
    Result<std::unique_ptr<FileKeyProvider>> provider =
        FileKeyProvider::make(std::string_view(key.get()).substr(0, kKeyBytes));
    if (!provider) {
        return make_error(provider.error());
    }
    return std::unique_ptr<KeyProvider>(std::move(provider).value());
}

Result<std::unique_ptr<KeyProvider>> make_kms_command_provider(const std::string& command) {
    if (trim(command).empty()) {
        return make_error("keys.kms_command: empty command");
    }
    Result<std::string> out = run_command(command + " key-id", {});
    if (!out) {
        return make_error(out.error());
    }
    std::string_view text(*out);
    const std::string_view first = trim(text.substr(0, text.find('\n')));
    if (first.empty()) {
        return make_error("kms command '" + command + " key-id' printed no key id");
    }
    return std::unique_ptr<KeyProvider>(
        std::make_unique<KmsCommandProvider>(command, "kms:" + std::string(first)));
}

std::string hmac_sha256(std::string_view key, std::string_view data) {
    unsigned char out[EVP_MAX_MD_SIZE];
    size_t n = 0;
    if (EVP_Q_mac(nullptr, "HMAC", nullptr, "SHA256", nullptr, key.data(), key.size(),
                  bytes_of(data), data.size(), out, sizeof out, &n) == nullptr) {
        return {};
    }
    std::string mac(reinterpret_cast<const char*>(out), n);
    OPENSSL_cleanse(out, sizeof out);  // a derived key's bytes, when it makes one
    return mac;
}

namespace {

// The record MAC key of a sealing (envelope.h): derived from its DEK, never the DEK itself.
SecretPtr record_mac_key(std::string_view dek) {
    WipedString key(hmac_sha256(dek, "egressd record mac v1"));
    if (key.get().empty()) {
        return nullptr;
    }
    return std::make_shared<const SecretValue>(key.get());
}

}  // namespace

// ---- seal / unseal / rewrap ----------------------------------------------------------------

Result<SealedSecret> seal(KeyProvider& kek, const std::string& name, const Scope& scope,
                          uint64_t version, std::string_view plaintext, SecretPtr* mac_key_out) {
    if (name.empty()) {
        return make_error("secret name is empty");
    }
    if (name.starts_with(kKeyMaterialPrefix)) {
        if (plaintext.empty() || plaintext.size() > kMaxKeyMaterialBytes) {
            return make_error("key material for " + name + " is empty or too large");
        }
    } else if (Result<bool> valid = validate_secret_bytes(plaintext); !valid) {
        return make_error(valid.error());
    }
    Result<std::string> dek_bytes = random_bytes(kKeyBytes);
    Result<std::string> nonce = random_bytes(kNonceBytes);
    if (!dek_bytes || !nonce) {
        return make_error("seal " + name + ": RAND_bytes failed");
    }
    WipedString dek(std::move(dek_bytes).value());
    Result<std::string> ct =
        aes_gcm(true, dek.get(), *nonce, secret_aad(name, scope, version), plaintext);
    if (!ct) {
        return make_error("seal " + name + ": " + ct.error());
    }
    Result<std::string> wrapped = kek.wrap(dek.get());
    if (!wrapped) {
        return make_error("seal " + name + ": " + wrapped.error());
    }
    SealedSecret out;
    out.name = name;
    out.scope = scope;
    out.version = version;
    out.created_at = now_rfc3339();
    out.kek_id = kek.key_id();
    out.wrapped_dek = base64_encode(*wrapped);
    out.nonce = base64_encode(*nonce);
    out.ciphertext = base64_encode(*ct);
    if (mac_key_out != nullptr) {
        *mac_key_out = record_mac_key(dek.get());
        if (!*mac_key_out) {
            return make_error("seal " + name + ": HMAC failed");
        }
    }
    return out;
}

Result<SecretPtr> unseal(KeyProvider& kek, const SealedSecret& sealed, SecretPtr* mac_key_out) {
    const std::string failure =
        "secret " + sealed.name + ": cannot decrypt (wrong master key " + "or tampered data)";
    Result<std::string> wrapped = base64_decode(sealed.wrapped_dek);
    Result<std::string> nonce = base64_decode(sealed.nonce);
    Result<std::string> ct = base64_decode(sealed.ciphertext);
    if (!wrapped || !nonce || !ct || nonce->size() != kNonceBytes || ct->size() < kTagBytes) {
        return make_error(failure);
    }
    Result<std::string> dek_bytes = kek.unwrap(*wrapped);
    if (!dek_bytes) {
        return make_error(failure);
    }
    WipedString dek(std::move(dek_bytes).value());
    if (dek.get().size() != kKeyBytes) {
        return make_error(failure);
    }
    Result<std::string> plain = aes_gcm(false, dek.get(), *nonce,
                                        secret_aad(sealed.name, sealed.scope, sealed.version), *ct);
    if (!plain) {
        return make_error(failure);
    }
    WipedString plaintext(std::move(plain).value());
    if (mac_key_out != nullptr) {
        *mac_key_out = record_mac_key(dek.get());
        if (!*mac_key_out) {
            return make_error(failure);
        }
    }
    return SecretPtr(std::make_shared<const SecretValue>(plaintext.get()));
}

Result<SealedSecret> rewrap(KeyProvider& from, KeyProvider& to, const SealedSecret& sealed,
                            bool* record_failed) {
    if (record_failed != nullptr) {
        *record_failed = true;  // until the DEK is unwrapped
    }
    Result<std::string> wrapped = base64_decode(sealed.wrapped_dek);
    if (!wrapped) {
        return make_error("rewrap " + sealed.name + ": wrapped data key is not base64");
    }
    Result<std::string> dek_bytes = from.unwrap(*wrapped);
    if (!dek_bytes) {
        return make_error("rewrap " + sealed.name + ": cannot unwrap data key with " +
                          from.key_id());
    }
    WipedString dek(std::move(dek_bytes).value());
    if (dek.get().size() != kKeyBytes) {
        return make_error("rewrap " + sealed.name + ": data key has the wrong size");
    }
    if (record_failed != nullptr) {
        *record_failed = false;
    }
    Result<std::string> rewrapped = to.wrap(dek.get());
    if (!rewrapped) {
        return make_error("rewrap " + sealed.name + ": " + rewrapped.error());
    }
    SealedSecret out = sealed;
    out.kek_id = to.key_id();
    out.wrapped_dek = base64_encode(*rewrapped);
    return out;
}

}  // namespace egress::credstore
