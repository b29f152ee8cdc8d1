#include "proxy/audit.h"

#include "common/json_text.h"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>

#include <unistd.h>

#include <spdlog/spdlog.h>


namespace egress::proxy {

namespace {

void append_digits(std::string& out, unsigned v, int width) {
    char buf[8];
    for (int i = width - 1; i >= 0; --i) {
        buf[i] = static_cast<char>('0' + v % 10);
        v /= 10;
    }
    out.append(buf, static_cast<size_t>(width));
}

}  // namespace

// By hand, with the "YYYY-MM-DDTHH:MM:SS" part cached per thread for the current second:
// snprintf and gmtime_r for every audit record were ~3% of egressd's CPU at h2 load.
void append_iso8601_utc(std::string& out, std::chrono::system_clock::time_point t) {
    thread_local std::time_t cached_secs = -1;
    thread_local std::string cached;
    const auto whole = std::chrono::floor<std::chrono::seconds>(t);  // also before 1970
    const std::time_t secs = std::chrono::system_clock::to_time_t(whole);
    if (secs != cached_secs) {
        std::tm tm{};
        gmtime_r(&secs, &tm);
        cached.clear();
        append_digits(cached, static_cast<unsigned>(tm.tm_year + 1900), 4);
        cached.push_back('-');
        append_digits(cached, static_cast<unsigned>(tm.tm_mon + 1), 2);
        cached.push_back('-');
        append_digits(cached, static_cast<unsigned>(tm.tm_mday), 2);
        cached.push_back('T');
        append_digits(cached, static_cast<unsigned>(tm.tm_hour), 2);
        cached.push_back(':');
        append_digits(cached, static_cast<unsigned>(tm.tm_min), 2);
        cached.push_back(':');
        append_digits(cached, static_cast<unsigned>(tm.tm_sec), 2);
        cached_secs = secs;
    }
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t - whole);
    out += cached;
    out.push_back('.');
    append_digits(out, static_cast<unsigned>(ms.count()), 3);
    out.push_back('Z');
}

std::string iso8601_utc(std::chrono::system_clock::time_point t) {
    std::string out;
    append_iso8601_utc(out, t);
    return out;
}

namespace {

bool plain_byte(char ch) {
    auto c = static_cast<unsigned char>(ch);
    return c >= 0x20 && c < 0x80 && c != '"' && c != '\\';
}

/// `v` is printable ASCII without '"' and '\\': written as it is. Eight bytes per step ("any
/// byte below k" is (w - k*ones) & ~w & highs, exact as a yes/no for k <= 0x80; '"' and '\\'
/// are the zero bytes after an xor; a byte from 0x80 up has its high bit set): the audit
/// record's strings are checked on every request.
bool json_plain(std::string_view v) {
    constexpr uint64_t kOnes = 0x0101010101010101ULL;
    constexpr uint64_t kHighs = 0x8080808080808080ULL;
    size_t i = 0;
    for (; i + 8 <= v.size(); i += 8) {
        uint64_t w = 0;
        std::memcpy(&w, v.data() + i, 8);
        const uint64_t quote = w ^ (kOnes * '"');
        const uint64_t slash = w ^ (kOnes * '\\');
        const uint64_t bad = w | ((w - kOnes * 0x20) & ~w) | ((quote - kOnes) & ~quote) |
                             ((slash - kOnes) & ~slash);
        if ((bad & kHighs) != 0) {
            return false;
        }
    }
    return std::all_of(v.begin() + static_cast<std::ptrdiff_t>(i), v.end(), plain_byte);
}

/// Appends `v` as a JSON string: one append when it is plain, else common/json_text.h's
/// escaper (which also keeps the line valid UTF-8).
void json_string(std::string& out, std::string_view v) {
    if (!json_plain(v)) {
        append_json_string(out, v);
        return;
    }
    out.push_back('"');
    out += v;
    out.push_back('"');
}

/// Starts `"name":` after '{' or a previous field (a value never ends in '{').
void field(std::string& out, std::string_view name) {
    // One append per field (the record has twenty), four for a name too long for the buffer.
    char key[32];
    if (name.size() > sizeof key - 4) {
        out.append(out.back() != '{' ? ",\"" : "\"");
        out.append(name);
        out.append("\":");
        return;
    }
    size_t n = 0;
    if (out.back() != '{') {
        key[n++] = ',';
    }
    key[n++] = '"';
    std::memcpy(key + n, name.data(), name.size());
    n += name.size();
    key[n++] = '"';
    key[n++] = ':';
    out.append(key, n);
}

void str_field(std::string& out, std::string_view name, std::string_view v) {
    field(out, name);
    json_string(out, v);
}

void opt_field(std::string& out, std::string_view name, std::string_view v, bool present) {
    field(out, name);
    if (present) {
        json_string(out, v);
    } else {
        out += "null";
    }
}

template <class Int>
void append_number(std::string& out, Int v) {
    char buf[24];
    auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
    out.append(buf, end);
}

void num_field(std::string& out, std::string_view name, uint64_t v) {
    field(out, name);
    append_number(out, v);
}

}  // namespace

// Written by hand rather than through boost::json::object: one per request on the hot path,
// and the fields and their order are fixed (DESIGN.md "Audit record").
std::string audit_json(const AuditRecord& r) {
    std::string out;
    out.reserve(384);
    append_audit_json(out, r);
    return out;
}

void append_audit_json(std::string& out, const AuditRecord& r) {
    out.push_back('{');
    field(out, "time");
    out.push_back('"');
    append_iso8601_utc(out, std::chrono::system_clock::now());
    out.push_back('"');
    opt_field(out, "run", r.run, !r.run.empty());
    str_field(out, "method", r.method);
    str_field(out, "scheme", r.scheme);
    str_field(out, "host", r.host);
    num_field(out, "port", r.port);
    auto q = r.path.find('?');
    str_field(out, "path", std::string_view(r.path).substr(0, q));
    field(out, "status");
    append_number(out, r.status);
    opt_field(out, "pin", r.pin ? std::string_view(*r.pin) : std::string_view(), r.pin.has_value());
    opt_field(out, "secret", r.secret ? std::string_view(*r.secret) : std::string_view(),
              r.secret.has_value());
    str_field(out, "decision", r.decision);
    str_field(out, "reason", r.reason);
    num_field(out, "bytes_in", r.bytes_in);
    num_field(out, "bytes_out", r.bytes_out);
    field(out, "duration_ms");
    char ms[64];
    auto [ms_end, ms_ec] =
        std::to_chars(ms, ms + sizeof ms, r.duration_ms, std::chars_format::fixed, 3);
    if (ms_ec == std::errc()) {
        out.append(ms, ms_end);
    } else {
        out += "0";  // not a duration this proxy can measure; keep the line valid JSON
    }
    opt_field(out, "upstream_addr", r.upstream_addr, !r.upstream_addr.empty());
    str_field(out, "proto_in", r.proto_in);
    opt_field(out, "proto_out", r.proto_out, !r.proto_out.empty());
    if (r.req_id != 0) {
        num_field(out, "req_id", r.req_id);
    }
    if (!r.event.empty()) {
        str_field(out, "event", r.event);
    }
    out.push_back('}');
}

Result<std::unique_ptr<AuditLog>> AuditLog::open(const std::string& path, bool durable) {
    std::unique_ptr<AuditLog> log(new AuditLog());
    log->durable_ = durable;
    if (path == "-") {
        log->file_ = stdout;
        log->fd_ = STDOUT_FILENO;
    } else {
        std::error_code ec;
        auto parent = std::filesystem::path(path).parent_path();
        if (!parent.empty()) {
            std::filesystem::create_directories(parent, ec);
        }
        log->file_ = std::fopen(path.c_str(), "ae");
        if (log->file_ == nullptr) {
            return make_error("audit.path: cannot open " + path + ": " + std::strerror(errno));
        }
        log->owned_ = true;
        log->fd_ = ::fileno(log->file_);
    }
    if (durable) {
        log->writer_ = std::thread([l = log.get()] { l->writer_loop(); });
    }
    return log;
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
    std::fwrite(lines.data(), 1, lines.size(), file_);
    std::fflush(file_);
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

bool write_all(int fd, const std::string& bytes) {
    size_t off = 0;
    while (off < bytes.size()) {
        ssize_t n = ::write(fd, bytes.data() + off, bytes.size() - off);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            return false;
        }
        off += static_cast<size_t>(n);
    }
    return true;
}

}  // namespace

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
        bool ok = write_all(fd_, bytes);
        if (ok && owned_) {
            ok = ::fdatasync(fd_) == 0;
            syncs_.fetch_add(1);
        }
        if (!ok) {
            spdlog::error("audit.durable: writing the audit file failed: {}", std::strerror(errno));
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
