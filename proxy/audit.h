#pragma once
// Audit: exactly one JSON line per request (DESIGN.md "Audit record"). Never a secret value:
// records carry the pin id and the secret's *name* only.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>
#include <optional>
#include <string>
#include <string_view>

#include "common/result.h"

namespace egress::proxy {

/// A path as audit records and log lines show it: without the query, which may carry tokens
/// (OAuth codes, pre-signed URLs).
inline std::string_view without_query(std::string_view path) {
    return path.substr(0, path.find('?'));
}

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
    uint64_t req_id = 0;     // same id on a request's decision and completion records
    std::string event;       // "decision" for the pre-request record of audit.durable; else empty
};

/// The audit file. Plain mode: each record is appended and flushed by the caller's thread.
/// Durable mode (audit.durable): records go to one writer thread that appends every record
/// queued since its last pass with one write(2) and one fdatasync(2) (group commit), then
/// reports each `write_durable` caller's record as on disk. Records keep their order.
class AuditLog {
public:
    /// "-" writes to standard output (durable mode then only flushes, it cannot fsync a pipe).
    static Result<std::unique_ptr<AuditLog>> open(const std::string& path, bool durable = false);
    /// egressd --check: whether `open` would fail on `path`, found without a side effect: an
    /// existing file is opened for appending (nothing written) and closed; a missing one is
    /// fine (open creates it, and its folders). The error is the one `open` would give.
    static Result<bool> check(const std::string& path);
    ~AuditLog();  // durable: writes what is queued, then stops the writer
    AuditLog(const AuditLog&) = delete;
    AuditLog& operator=(const AuditLog&) = delete;

    bool durable() const { return durable_; }
    /// Appends a record (durable mode: queues it behind earlier ones, does not wait).
    void write(const AuditRecord& rec);
    /// Appends complete JSON lines at once (one write(2) in plain mode; durable mode queues
    /// them as one entry, completion records need no acknowledgement). A write that fails
    /// (a full disk, an I/O error) loses the lines that did not go whole: it is logged (at
    /// most one line per kErrorLogEvery) and counted (write_errors()), and it leaves no torn
    /// line: the file is cut back to its last whole line, or, where it cannot be (a pipe), the
    /// next write begins on a line of its own.
    void append(std::string_view lines);
    /// Durable mode: calls `done(true)` on the writer thread once the record is on disk, or
    /// `done(false)` if writing or syncing failed (the caller must then not proceed).
    /// Plain mode: writes it and calls `done(true)` at once.
    void write_durable(const AuditRecord& rec, std::function<void(bool)> done);
    /// fdatasync calls made so far (a measure of how well commits are grouped).
    uint64_t syncs() const { return syncs_.load(); }
    /// Writes (and durable mode's syncs) of the file that failed so far (/metrics:
    /// egressd_audit_write_errors_total, Metrics::audit_write_errors points here).
    const std::atomic<uint64_t>& write_errors() const { return write_errors_; }

    /// SIGHUP: log rotation (the file was moved or removed: a new one is created at `path`)
    /// or a changed audit.path. Opens `path` first and keeps the current file if that fails
    /// (the error names audit.path); records already handed over go to the old file.
    Result<bool> reopen(const std::string& path);

    /// At most one line about failed writes this often; the failures in between are counted
    /// and said with the next line.
    static constexpr std::chrono::seconds kErrorLogEvery{10};

private:
    AuditLog() = default;
    void writer_loop();
    /// Writes `bytes` (whole lines) at the end of the file; false if not all of them went
    /// (logged, counted, no torn line left). Called with mu_ (plain mode) or io_mu_ (durable
    /// mode's writer) held: one caller at a time.
    bool write_lines(std::string_view bytes);
    /// After a failed write (or, `sync`, fdatasync) of `lines` records: the count and,
    /// rate-limited, the log.
    void failed(bool sync, int err, size_t lines);
    /// After a write that went whole: says that writing works again, if a line said it failed.
    void succeeded();
    struct Pending {
        std::string line;
        std::function<void(bool)> done;
    };
    std::mutex mu_;
    /// Held by the durable writer while it writes and syncs outside mu_, and by reopen: the
    /// file is never switched under a write. Taken before mu_ when both are held.
    std::mutex io_mu_;
    FILE* file_ = nullptr;
    bool owned_ = false;
    bool durable_ = false;
    int fd_ = -1;
    std::condition_variable wake_;
    std::vector<Pending> queue_;
    bool stopping_ = false;
    std::thread writer_;
    std::atomic<uint64_t> syncs_{0};
    // Written under the same lock as write_lines (see there).
    std::string path_;
    std::atomic<uint64_t> write_errors_{0};
    bool torn_ = false;       // a failed write left a partial line that could not be cut off
    bool failing_ = false;    // the last write failed
    bool said_ = false;       // a failure line was written since the last success
    uint64_t unlogged_ = 0;   // records lost since the last failure line
    std::chrono::steady_clock::time_point next_line_{};
};

/// "2026-12-02T17:53:31.687Z": the one timestamp format of audit records and JSON logs.
std::string iso8601_utc(std::chrono::system_clock::time_point t);

/// A duration in milliseconds as JSON, with three decimals: what std::to_chars(fixed, 3)
/// writes, byte for byte; "0" for what it cannot (not finite, longer than 64 bytes). Exposed
/// for tests.
std::string duration_ms_text(double ms);

/// The JSON line for a record (no trailing newline). Exposed for tests.
std::string audit_json(const AuditRecord& rec);
/// The same, appended to `out`.
void append_audit_json(std::string& out, const AuditRecord& rec);

}  // namespace egress::proxy
