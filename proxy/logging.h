#pragma once
// Process logging (spdlog to standard error): "text" for people, "json" for log pipelines —
// one object per line with time, level, conn_id, req_id, run and msg.
#include <string>

namespace egress::proxy {

/// Installs the default logger. `format` is "text" or "json"; `level` a spdlog level name.
void setup_logging(const std::string& format, const std::string& level);

/// The JSON line for one message (exposed for tests): leading "conn=N req=N run=ID" tokens
/// become the conn_id, req_id and run fields; the rest is the escaped msg.
std::string json_log_line(const std::string& time, const std::string& level,
                          const std::string& message);

}  // namespace egress::proxy
