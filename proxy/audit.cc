#include "proxy/audit.h"

#include <chrono>
#include <filesystem>

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
    return boost::json::serialize(o);
}

Result<std::unique_ptr<AuditLog>> AuditLog::open(const std::string& path) {
    std::unique_ptr<AuditLog> log(new AuditLog());
    if (path == "-") {
        log->file_ = stdout;
        return log;
    }
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
    return log;
}

AuditLog::~AuditLog() {
    if (owned_ && file_ != nullptr) {
        std::fclose(file_);
    }
}

void AuditLog::write(const AuditRecord& rec) {
    std::string line = audit_json(rec);
    line.push_back('\n');
    std::lock_guard lock(mu_);
    std::fwrite(line.data(), 1, line.size(), file_);
    std::fflush(file_);
}

}  // namespace egress::proxy
