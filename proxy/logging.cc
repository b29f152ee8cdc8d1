#include "proxy/logging.h"

#include "proxy/audit.h"

#include "common/json_text.h"

#include <chrono>
#include <ctime>

#include <boost/json.hpp>
#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

namespace egress::proxy {

namespace {

class JsonFormatter final : public spdlog::formatter {
public:
    void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
        auto level = spdlog::level::to_string_view(msg.level);
        std::string line = json_log_line(iso8601_utc(msg.time),
                                         std::string(level.data(), level.size()),
                                         std::string(msg.payload.data(), msg.payload.size()));
        line.push_back('\n');
        dest.append(line.data(), line.data() + line.size());
    }
    std::unique_ptr<spdlog::formatter> clone() const override {
        return std::make_unique<JsonFormatter>();
    }
};

}  // namespace

std::string json_log_line(const std::string& time, const std::string& level,
                          const std::string& message) {
    boost::json::object o;
    o["time"] = time;
    o["level"] = level;
    std::string_view rest = message;
    // Leading key=value tokens that identify the request become fields.
    for (;;) {
        auto sp = rest.find(' ');
        std::string_view tok = rest.substr(0, sp);
        auto eq = tok.find('=');
        if (eq == std::string_view::npos) {
            break;
        }
        auto key = tok.substr(0, eq);
        auto val = tok.substr(eq + 1);
        if (key == "conn" || key == "req") {
            uint64_t n = 0;
            bool digits = !val.empty();
            for (char c : val) {
                digits = digits && c >= '0' && c <= '9';
                n = n * 10 + static_cast<uint64_t>(c - '0');
            }
            if (!digits) {
                break;
            }
            o[key == "conn" ? "conn_id" : "req_id"] = n;
        } else if (key == "run") {
            std::string run;
            append_utf8_or_latin1(run, val);
            o["run"] = std::move(run);
        } else {
            break;
        }
        if (sp == std::string_view::npos) {
            rest = {};
            break;
        }
        rest.remove_prefix(sp + 1);
    }
    // boost::json writes a string's bytes as they are: a raw byte of a request target in the
    // message would make the line invalid UTF-8.
    std::string msg;
    append_utf8_or_latin1(msg, rest);
    o["msg"] = std::move(msg);
    return boost::json::serialize(o);
}

void setup_logging(const std::string& format, const std::string& level) {
    auto logger = spdlog::stderr_color_mt("egressd");
    if (format == "json") {
        logger->set_formatter(std::make_unique<JsonFormatter>());
    }
    spdlog::set_default_logger(logger);
    spdlog::set_level(spdlog::level::from_str(level));
}

}  // namespace egress::proxy
