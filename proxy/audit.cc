#include "proxy/audit.h"

#include <chrono>
#include <filesystem>

#include <unistd.h>

#include <spdlog/spdlog.h>

#include <boost/json.hpp>

namespace egress::proxy {

std::string iso8601_utc(std::chrono::system_clock::time_point t) {
    auto secs = std::chrono::system_clock::to_time_t(t);
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()) % 1000;
    std::tm tm{};
    gmtime_r(&secs, &tm);
    char buf[64];
    std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900,
                  tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
                  static_cast<int>(ms.count()));
    return buf;
}

std::string audit_json(const AuditRecord& r) {
    boost::json::object o;
    o["time"] = iso8601_utc(std::chrono::system_clock::now());
    o["run"] = r.run.empty() ? boost::json::value(nullptr) : boost::json::value(r.run);
    o["method"] = r.method;
    o["scheme"] = r.scheme;
    o["host"] = r.host;
    o["port"] = r.port;
    auto q = r.path.find('?');
    o["path"] = q == std::string::npos ? r.path : r.path.substr(0, q);
    o["status"] = r.status;
    o["pin"] = r.pin ? boost::json::value(*r.pin) : boost::json::value(nullptr);
    o["secret"] = r.secret ? boost::json::value(*r.secret) : boost::json::value(nullptr);
    o["decision"] = r.decision;
    o["reason"] = r.reason;
    o["bytes_in"] = r.bytes_in;
    o["bytes_out"] = r.bytes_out;
    o["duration_ms"] = std::round(r.duration_ms * 1000.0) / 1000.0;
    o["upstream_addr"] = r.upstream_addr.empty() ? boost::json::value(nullptr)
                                                 : boost::json::value(r.upstream_addr);
    o["proto_in"] = r.proto_in;
    o["proto_out"] = r.proto_out.empty() ? boost::json::value(nullptr)
                                         : boost::json::value(r.proto_out);
    if (r.req_id != 0) {
        o["req_id"] = r.req_id;
    }
    if (!r.event.empty()) {
        o["event"] = r.event;
    }
    return boost::json::serialize(o);
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
    std::lock_guard lock(mu_);
    if (durable_) {
        queue_.push_back({std::move(line), nullptr});
        wake_.notify_one();
        return;
    }
    std::fwrite(line.data(), 1, line.size(), file_);
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
