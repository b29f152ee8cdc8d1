#include "proxy/audit.h"

#include "common/json_text.h"
#include "common/text_cursor.h"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

namespace egress::proxy {

namespace {

/// Writes v as exactly `width` decimal digits (leading zeros; the high digits of a larger v
/// are dropped, which no calendar field here reaches).
char* write_digits(char* p, unsigned v, int width) {
    for (int i = width - 1; i >= 0; --i) {
        p[i] = static_cast<char>('0' + v % 10);
        v /= 10;
    }
    return p + width;
}

/// "2026-12-02T17:53:31.687Z" at p (24 bytes); returns the end. By hand, with the
/// "YYYY-MM-DDTHH:MM:SS" part cached per thread for the current second: snprintf and gmtime_r
/// for every audit record were ~3% of egressd's CPU at h2 load.
char* write_iso8601_utc(char* p, std::chrono::system_clock::time_point t) {
    thread_local std::time_t cached_secs = -1;
    thread_local char cached[19];
    const auto whole = std::chrono::floor<std::chrono::seconds>(t);  // also before 1970
    const std::time_t secs = std::chrono::system_clock::to_time_t(whole);
    if (secs != cached_secs) {
        std::tm tm{};
        gmtime_r(&secs, &tm);
        char* q = write_digits(cached, static_cast<unsigned>(tm.tm_year + 1900), 4);
        *q++ = '-';
        q = write_digits(q, static_cast<unsigned>(tm.tm_mon + 1), 2);
        *q++ = '-';
        q = write_digits(q, static_cast<unsigned>(tm.tm_mday), 2);
        *q++ = 'T';
        q = write_digits(q, static_cast<unsigned>(tm.tm_hour), 2);
        *q++ = ':';
        q = write_digits(q, static_cast<unsigned>(tm.tm_min), 2);
        *q++ = ':';
        write_digits(q, static_cast<unsigned>(tm.tm_sec), 2);
        cached_secs = secs;
    }
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t - whole);
    std::memcpy(p, cached, sizeof cached);
    p += sizeof cached;
    *p++ = '.';
    p = write_digits(p, static_cast<unsigned>(ms.count()), 3);
    *p++ = 'Z';
    return p;
}

constexpr size_t kMillisChars = 64;  // to_chars' buffer below; longer is written as "0"

/// duration_ms with three decimals at p (kMillisChars bytes of room); returns the end.
/// std::to_chars(double, fixed, 3) was ~580 instructions per audit record (~0.9% of a
/// proxied h2 stream's). Below 10^6 ms the product v * 1000 is below 10^9 and within 1.2e-7
/// of the exact value (one rounding, 2^-53 relative), so whenever its fraction is further than
/// 1e-6 from one half, rounding it to an integer number of thousandths decides as to_chars
/// does on the exact binary value. Near-ties, negatives and longer durations go to to_chars.
/// Same bytes either way (AuditJson.DurationIsWhatToCharsWrites).
char* write_millis(char* p, double v) {
    if (v >= 0 && v < 1e6) {
        const double t = v * 1000.0;
        const double whole = std::floor(t);
        const double frac = t - whole;
        if (std::fabs(frac - 0.5) > 1e-6) {
            auto n = static_cast<uint64_t>(whole) + (frac > 0.5 ? 1 : 0);
            p = std::to_chars(p, p + kMillisChars, n / 1000).ptr;
            *p++ = '.';
            return write_digits(p, static_cast<unsigned>(n % 1000), 3);
        }
    }
    auto [end, ec] = std::to_chars(p, p + kMillisChars, v, std::chars_format::fixed, 3);
    if (ec == std::errc() && std::isfinite(v)) {
        return end;
    }
    *p = '0';  // not a duration this proxy can measure; keep the line valid JSON
    return p + 1;
}

}  // namespace

std::string iso8601_utc(std::chrono::system_clock::time_point t) {
    char buf[24];
    return std::string(buf, write_iso8601_utc(buf, t));
}

std::string duration_ms_text(double ms) {
    char buf[kMillisChars];
    return std::string(buf, write_millis(buf, ms));
}

namespace {

/// `v` is printable ASCII without '"' and '\\': written as it is. Eight bytes per step ("any
/// byte below k" is (w - k*ones) & ~w & highs, exact as a yes/no for k <= 0x80; '"' and '\\'
/// are the zero bytes after an xor; a byte from 0x80 up has its high bit set): the audit
/// record's strings are checked on every request. The last step reads the last eight bytes
/// (overlapping the step before), a value under eight bytes is padded with plain ones: no
/// byte-at-a-time tail (it was a third of the check's instructions).
bool json_plain(std::string_view v) {
    constexpr uint64_t kOnes = 0x0101010101010101ULL;
    constexpr uint64_t kHighs = 0x8080808080808080ULL;
    const auto plain_word = [](uint64_t w) {
        const uint64_t quote = w ^ (kOnes * '"');
        const uint64_t slash = w ^ (kOnes * '\\');
        const uint64_t bad = w | ((w - kOnes * 0x20) & ~w) | ((quote - kOnes) & ~quote) |
                             ((slash - kOnes) & ~slash);
        return (bad & kHighs) == 0;
    };
    uint64_t w = kOnes * 'a';
    if (v.size() < 8) {
        if (!v.empty()) {
            std::memcpy(&w, v.data(), v.size());
        }
        return plain_word(w);
    }
    for (size_t i = 0; i + 8 < v.size(); i += 8) {
        std::memcpy(&w, v.data() + i, 8);
        if (!plain_word(w)) {
            return false;
        }
    }
    std::memcpy(&w, v.data() + v.size() - 8, 8);
    return plain_word(w);
}

/// The record's fields, in DESIGN.md's order, for a visitor that first measures (Measure)
/// and then writes (Write): one description of the line for both passes. `sep` is the text
/// before the value: the key with its comma.
template <class V>
void visit_record(const AuditRecord& r, std::string_view path, V& v) {
    v.time();
    v.opt(",\"run\":", r.run, !r.run.empty());
    v.str(",\"method\":", r.method);
    v.str(",\"scheme\":", r.scheme);
    v.str(",\"host\":", r.host);
    v.num(",\"port\":", r.port);
    v.str(",\"path\":", path);
    v.num(",\"status\":", r.status);
    v.opt(",\"pin\":", r.pin ? std::string_view(*r.pin) : std::string_view(), r.pin.has_value());
    v.opt(",\"secret\":", r.secret ? std::string_view(*r.secret) : std::string_view(),
          r.secret.has_value());
    v.str(",\"decision\":", r.decision);
    v.str(",\"reason\":", r.reason);
    v.num(",\"bytes_in\":", r.bytes_in);
    v.num(",\"bytes_out\":", r.bytes_out);
    v.millis(",\"duration_ms\":", r.duration_ms);
    v.opt(",\"upstream_addr\":", r.upstream_addr, !r.upstream_addr.empty());
    v.str(",\"proto_in\":", r.proto_in);
    v.opt(",\"proto_out\":", r.proto_out, !r.proto_out.empty());
    if (r.req_id != 0) {
        v.num(",\"req_id\":", r.req_id);
    }
    if (!r.event.empty()) {
        v.str(",\"event\":", r.event);
    }
}

constexpr std::string_view kTimeKey = "{\"time\":\"";
constexpr size_t kTimeChars = 24;  // "2026-12-02T17:53:31.687Z"
constexpr size_t kNumberChars = 20;  // a uint64_t or an int64_t in decimal

/// Upper bound of the line's length. A string's check (json_plain) is kept for Write, so each
/// value is scanned once (for the first kMaxStrings strings; any beyond take the escaper).
constexpr size_t kMaxStrings = 16;
struct Measure {
    size_t bytes = kTimeKey.size() + kTimeChars + 1 + 1;  // {"time":"…" and the closing '}'
    bool plain[kMaxStrings] = {};
    size_t strings = 0;
    void time() {}
    void str(std::string_view sep, std::string_view v) {
        const bool p = strings < kMaxStrings && json_plain(v);
        if (strings < kMaxStrings) {
            plain[strings] = p;
        }
        ++strings;
        bytes += sep.size() + (p ? v.size() + 2 : 6 * v.size() + 2);  // json_text.h's bound
    }
    void opt(std::string_view sep, std::string_view v, bool present) {
        if (present) {
            str(sep, v);
        } else {
            bytes += sep.size() + 4;  // null
        }
    }
    template <class Int>
    void num(std::string_view sep, Int) {
        bytes += sep.size() + kNumberChars;
    }
    void millis(std::string_view sep, double) { bytes += sep.size() + kMillisChars; }
};

struct Write {
    TextCursor& c;
    const bool* plain;
    size_t strings = 0;
    void time() {
        c.append(kTimeKey);
        c.p = write_iso8601_utc(c.p, std::chrono::system_clock::now());
        c.push_back('"');
    }
    void str(std::string_view sep, std::string_view v) {
        c.append(sep);
        const bool p = strings < kMaxStrings && plain[strings];
        ++strings;
        if (p) {
            c.push_back('"');
            c.append(v);
            c.push_back('"');
        } else {
            append_json_string(c, v);
        }
    }
    void opt(std::string_view sep, std::string_view v, bool present) {
        if (present) {
            str(sep, v);
        } else {
            c.append(sep);
            c.lit("null");
        }
    }
    template <class Int>
    void num(std::string_view sep, Int v) {
        c.append(sep);
        c.p = std::to_chars(c.p, c.p + kNumberChars, v).ptr;
    }
    void millis(std::string_view sep, double v) {
        c.append(sep);
        c.p = write_millis(c.p, v);
    }
};

}  // namespace

// Written by hand rather than through boost::json::object: one per request on the hot path,
// and the fields and their order are fixed (DESIGN.md "Audit record").
std::string audit_json(const AuditRecord& r) {
    std::string out;
    append_audit_json(out, r);
    return out;
}

void append_audit_json(std::string& out, const AuditRecord& r) {
    const std::string_view path = without_query(r.path);
    Measure m;
    visit_record(r, path, m);
    // Measured, then written with plain stores into the space measured (common/text_cursor.h).
    append_bounded(out, m.bytes, [&](TextCursor& c) {
        Write w{c, m.plain};
        visit_record(r, path, w);
        c.push_back('}');
    });
}

namespace {

Error cannot_open(const std::string& path, int err) {
    return make_error("audit.path: cannot open " + path + ": " + std::strerror(err));
}

/// The audit file at `path`, opened for appending ("-": standard output, not owned).
/// `create` false (AuditLog::check): neither the file nor its folders are made, a missing file
/// gives nullptr, and a FIFO without a reader is not waited for (nullptr too).
Result<FILE*> open_append(const std::string& path, bool create = true) {
    if (path == "-") {
        return stdout;
    }
    if (!create) {
        const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC | O_NONBLOCK);
        if (fd < 0) {
            if (errno == ENOENT || errno == ENXIO) {
                return nullptr;
            }
            return cannot_open(path, errno);
        }
        FILE* f = ::fdopen(fd, "a");
        if (f == nullptr) {
            const int err = errno;
            ::close(fd);
            return cannot_open(path, err);
        }
        return f;
    }
    std::error_code ec;
    auto parent = std::filesystem::path(path).parent_path();
    if (!parent.empty()) {
        std::filesystem::create_directories(parent, ec);
    }
    FILE* f = std::fopen(path.c_str(), "ae");
    if (f == nullptr) {
        return cannot_open(path, errno);
    }
    return f;
}

}  // namespace

Result<std::unique_ptr<AuditLog>> AuditLog::open(const std::string& path, bool durable) {
    std::unique_ptr<AuditLog> log(new AuditLog());
    log->durable_ = durable;
    log->path_ = path;
    auto f = open_append(path);
    if (!f) {
        return make_error(f.error());
    }
    log->file_ = *f;
    log->owned_ = *f != stdout;
    log->fd_ = ::fileno(*f);
    if (durable) {
        log->writer_ = std::thread([l = log.get()] { l->writer_loop(); });
    }
    return log;
}

Result<bool> AuditLog::check(const std::string& path) {
    auto f = open_append(path, /*create=*/false);
    if (!f) {
        return make_error(f.error());
    }
    if (*f != nullptr && *f != stdout) {
        std::fclose(*f);
    }
    return true;
}

Result<bool> AuditLog::reopen(const std::string& path) {
    auto f = open_append(path);
    if (!f) {
        return make_error(f.error());
    }
    FILE* old = nullptr;
    bool old_owned = false;
    {
        std::lock_guard io(io_mu_);
        std::lock_guard lock(mu_);
        old = file_;
        old_owned = owned_;
        file_ = *f;
        owned_ = *f != stdout;
        fd_ = ::fileno(*f);
        path_ = path;
        if (*f != old) {
            torn_ = false;  // a new file: its end is not our torn line (standard output stays)
        }
    }
    if (old_owned && old != *f) {
        std::fclose(old);
    }
    return true;
}

AuditLog::~AuditLog() {
    if (writer_.joinable()) {
        {
            std::lock_guard lock(mu_);
            stopping_ = true;
        }
        wake_.notify_one();
        writer_.join();
    }
    if (owned_ && file_ != nullptr) {
        std::fclose(file_);
    }
}

void AuditLog::write(const AuditRecord& rec) {
    std::string line = audit_json(rec);
    line.push_back('\n');
    append(line);
}

void AuditLog::append(std::string_view lines) {
    if (lines.empty()) {
        return;
    }
    std::lock_guard lock(mu_);
    if (durable_) {
        queue_.push_back({std::string(lines), nullptr});
        wake_.notify_one();
        return;
    }
    write_lines(lines);
}

void AuditLog::write_durable(const AuditRecord& rec, std::function<void(bool)> done) {
    if (!durable_) {
        write(rec);
        done(true);
        return;
    }
    std::string line = audit_json(rec);
    line.push_back('\n');
    std::lock_guard lock(mu_);
    queue_.push_back({std::move(line), std::move(done)});
    wake_.notify_one();
}

namespace {

/// Writes all of `bytes`; `written` says how many went (also on failure, errno set).
bool write_all(int fd, std::string_view bytes, size_t& written) {
    written = 0;
    while (written < bytes.size()) {
        ssize_t n = ::write(fd, bytes.data() + written, bytes.size() - written);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            if (n == 0) {
                errno = EIO;
            }
            return false;
        }
        written += static_cast<size_t>(n);
    }
    return true;
}

}  // namespace

bool AuditLog::write_lines(std::string_view bytes) {
    size_t written = 0;
    if (torn_) {
        // A failed write left part of a line that could not be cut off: the next record
        // begins on a line of its own (the torn one is then a line of its own, not JSON).
        if (!write_all(fd_, "\n", written)) {
            const int err = errno;
            failed(false, err, static_cast<size_t>(std::count(bytes.begin(), bytes.end(), '\n')));
            return false;
        }
        torn_ = false;
    }
    if (write_all(fd_, bytes, written)) {
        succeeded();
        return true;
    }
    const int err = errno;
    // The lines that went whole stay; the part of a line after them is cut off.
    const size_t whole = bytes.substr(0, written).rfind('\n') + 1;  // npos + 1 == 0
    if (const size_t torn = written - whole; torn > 0) {
        // Only a file egressd opened itself (O_APPEND, no other writer): standard output may
        // be a file opened without O_APPEND (the cut would leave a gap of NULs before the next
        // write) or shared with another process (whose bytes the cut would take).
        struct stat st{};
        if (owned_ && (::fcntl(fd_, F_GETFL) & O_APPEND) != 0 && ::fstat(fd_, &st) == 0 &&
            S_ISREG(st.st_mode) &&
            static_cast<uint64_t>(st.st_size) >= torn &&
            ::ftruncate(fd_, st.st_size - static_cast<off_t>(torn)) == 0) {
            // cut back to the end of the last whole line (O_APPEND: the next write goes there)
        } else {
            torn_ = true;
        }
    }
    const std::string_view lost = bytes.substr(whole);
    failed(false, err, static_cast<size_t>(std::count(lost.begin(), lost.end(), '\n')));
    return false;
}

void AuditLog::failed(bool sync, int err, size_t lines) {
    write_errors_.fetch_add(1, std::memory_order_relaxed);
    failing_ = true;
    unlogged_ += lines;
    const auto now = std::chrono::steady_clock::now();
    if (now < next_line_) {
        return;
    }
    spdlog::error("audit: {} {} failed: {}; {} audit records {}{} (the next such line in {} s "
                  "at the earliest)",
                  sync ? "syncing" : "writing", path_, std::strerror(err), unlogged_,
                  sync ? "written but maybe not on disk" : "lost",
                  said_ ? " since the last line" : "", kErrorLogEvery.count());
    unlogged_ = 0;
    said_ = true;
    next_line_ = now + kErrorLogEvery;
}

void AuditLog::succeeded() {
    if (!failing_) {
        return;
    }
    failing_ = false;
    if (said_) {
        spdlog::info("audit: writing {} works again{}", path_,
                     unlogged_ == 0 ? std::string()
                                    : "; " + std::to_string(unlogged_) +
                                          " more audit records failed since the last line");
        unlogged_ = 0;
        said_ = false;
        next_line_ = {};
    }
}

void AuditLog::writer_loop() {
    std::vector<Pending> batch;
    std::string bytes;
    for (;;) {
        {
            std::unique_lock lock(mu_);
            wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
            if (queue_.empty() && stopping_) {
                return;
            }
            batch.swap(queue_);
        }
        // Everything queued while the previous fdatasync ran commits together: one write,
        // one sync, however many requests are waiting.
        bytes.clear();
        for (const auto& p : batch) {
            bytes += p.line;
        }
        bool ok = false;
        {
            std::lock_guard io(io_mu_);
            ok = write_lines(bytes);
            if (ok && owned_) {
                ok = ::fdatasync(fd_) == 0;
                syncs_.fetch_add(1);
                if (!ok) {
                    failed(true, errno,
                           static_cast<size_t>(std::count(bytes.begin(), bytes.end(), '\n')));
                }
            }
        }
        for (auto& p : batch) {
            if (p.done) {
                p.done(ok);
            }
        }
        batch.clear();
    }
}

}  // namespace egress::proxy
