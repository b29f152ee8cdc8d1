#pragma once
// Audit: exactly one JSON line per request (DESIGN.md "Audit record"). Never a secret value:
// records carry the pin id and the secret's *name* only.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <optional>
#include <string>

#include "common/result.h"

namespace egress::proxy {

struct AuditRecord {
    std::string run;
    std::string method;
    std::string scheme;
    std::string host;
    uint16_t port = 0;
    std::string path;  // query removed by the writer
    int status = 0;
    std::optional<std::string> pin;
    std::optional<std::string> secret;  // name, never the value
    std::string decision;               // "allow" | "deny"
    std::string reason;
    uint64_t bytes_in = 0;   // from the client (request body)
    uint64_t bytes_out = 0;  // to the client (response body)
    double duration_ms = 0;
    std::string upstream_addr;
    std::string proto_in;   // "http/1.1", "h2", "tunnel"
    std::string proto_out;
};

class AuditLog {
public:
    /// "-" writes to standard output.
    static Result<std::unique_ptr<AuditLog>> open(const std::string& path);
    ~AuditLog();
    void write(const AuditRecord& rec);

private:
    AuditLog() = default;
    std::mutex mu_;
    FILE* file_ = nullptr;
    bool owned_ = false;
};

/// "2026-12-02T17:53:31.687Z": the one timestamp format of audit records and JSON logs.
std::string iso8601_utc(std::chrono::system_clock::time_point t);

/// The JSON line for a record (no trailing newline). Exposed for tests.
std::string audit_json(const AuditRecord& rec);

}  // namespace egress::proxy
