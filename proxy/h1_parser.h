#pragma once
// Beast's HTTP/1.1 parser (http::basic_parser: the syntax, framing, limits and smuggling
// checks) with egressd's own storage behind it. Beast's http::parser keeps a message whose
// basic_fields allocates a node per field, plus the target and the reason; the codec then
// copied every field into a policy::Header list. This parser stores the fields once, straight
// into that list, which the request head then takes over (moved, not copied).
// Internal to proxy/ (Beast).
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "policy/request_head.h"
#include "proxy/net.h"

namespace egress::proxy {

template <bool isRequest>
class H1Parser final : public http::basic_parser<isRequest> {
    using Base = http::basic_parser<isRequest>;

public:
    H1Parser() { fields_.reserve(policy::kTypicalHeaderFields); }

    // Request line (requests only).
    http::verb method() const { return method_; }
    std::string_view method_string() const { return method_str_; }
    std::string_view target() const { return target_; }
    /// Hands the target over (the parser's copy is left empty).
    std::string take_target() { return std::move(target_); }

    // Status line (responses only).
    int status() const { return status_; }
    std::string_view reason() const { return reason_; }

    int version() const { return version_; }

    /// The header's fields in order. Requests: names lowercased (the pipeline's form);
    /// responses: names as received, so an HTTP/1.1 client sees them unchanged.
    std::vector<policy::Header>& fields() { return fields_; }
    const std::vector<policy::Header>& fields() const { return fields_; }
    /// First value of the field `name` (compared case-insensitively), or nullptr.
    const std::string* find(std::string_view name) const {
        return policy::find_header(fields_, name);
    }
    /// At most `n` fields in the head, and as many in the trailers: one more is
    /// http::error::header_limit, as a head over header_limit() is (431). Per-field work
    /// downstream (the Connection tokens, the header rules) stays bounded whatever fits in
    /// max_header_bytes: 64 KiB of "a:\r\n" would be ~13 000 fields.
    void field_limit(size_t n) { field_limit_ = n; }
    /// Fields after a chunked body (trailers), names lowercased.
    std::vector<policy::Header>& trailers() { return trailers_; }

    /// Where the next body bytes go, as with http::buffer_body: a read stops when the room
    /// is full (http::error::need_buffer) and body_room() is what was left.
    void body_buffer(char* data, size_t size) {
        body_ = data;
        room_ = size;
    }
    size_t body_room() const { return room_; }

    /// Keep-alive as the parser decided it (version, Connection, close-delimited body),
    /// unless close() was called (a draining server answers with Connection: close).
    bool keep_alive() const { return !close_ && Base::keep_alive(); }
    void close() { close_ = true; }

    /// A Content-Length body is taken by the caller, not through the parser (which would copy
    /// each byte out of its read buffer once more): what the read buffer holds, then straight
    /// from the stream into the relay buffer (h1_read_body). The parser is told how many bytes
    /// arrived. Once started, the body is this counter's: the parser's own state is never fed
    /// again for this message (a new message gets a new parser), so is_done() below is the
    /// one to ask. Returns how many body bytes are still to come, if the body is taken so;
    /// the first call that answers latches the count from the parser.
    std::optional<uint64_t> direct_body_left() {
        if (!direct_left_) {
            if (!this->is_header_done() || Base::is_done() || this->chunked()) {
                return std::nullopt;
            }
            auto left = this->content_length_remaining();
            if (!left) {
                return std::nullopt;  // delimited by the connection's close
            }
            direct_left_ = *left;
        }
        return direct_left_;
    }
    /// `n` body bytes (at most direct_body_left()) were read straight into the relay buffer.
    void direct_body_read(size_t n) { *direct_left_ -= std::min<uint64_t>(n, *direct_left_); }
    /// The message is complete (hides basic_parser::is_done, which a direct body never reaches).
    bool is_done() const { return (direct_left_ && *direct_left_ == 0) || Base::is_done(); }
    /// A head was read whose body was not read to its end: its sender may still be sending.
    bool body_unread() const { return this->is_header_done() && !is_done(); }

private:
    void on_request_impl(http::verb method, beast::string_view method_str,
                         beast::string_view target, int version, error_code& ec) override {
        method_ = method;
        method_str_.assign(method_str.data(), method_str.size());
        target_.assign(target.data(), target.size());
        version_ = version;
        ec = {};
    }
    void on_response_impl(int code, beast::string_view reason, int version,
                          error_code& ec) override {
        status_ = code;
        reason_.assign(reason.data(), reason.size());
        version_ = version;
        ec = {};
    }
    void on_field_impl(http::field, beast::string_view name, beast::string_view value,
                       error_code& ec) override {
        auto& to = this->is_header_done() ? trailers_ : fields_;
        if (to.size() >= field_limit_) {
            ec = http::error::header_limit;
            return;
        }
        auto& f = to.emplace_back();
        const std::string_view n(name.data(), name.size());
        if (isRequest || &to == &trailers_) {
            f.name = policy::ascii_lower(n);
        } else {
            f.name.assign(n);
        }
        f.value.assign(value.data(), value.size());
        ec = {};
    }
    void on_header_impl(error_code& ec) override { ec = {}; }
    void on_body_init_impl(const boost::optional<std::uint64_t>&, error_code& ec) override {
        ec = {};
    }
    size_t on_body_impl(beast::string_view body, error_code& ec) override {
        return store(body, ec);
    }
    void on_chunk_header_impl(std::uint64_t, beast::string_view, error_code& ec) override {
        ec = {};
    }
    size_t on_chunk_body_impl(std::uint64_t, beast::string_view body, error_code& ec) override {
        return store(body, ec);
    }
    void on_finish_impl(error_code& ec) override { ec = {}; }

    size_t store(beast::string_view body, error_code& ec) {
        const size_t n = std::min(room_, body.size());
        if (n > 0) {
            std::memcpy(body_, body.data(), n);
            body_ += n;
            room_ -= n;
        }
        if (n < body.size()) {
            ec = http::error::need_buffer;
        } else {
            ec = {};
        }
        return n;
    }

    http::verb method_ = http::verb::unknown;
    std::string method_str_;
    std::string target_;
    int status_ = 0;
    std::string reason_;
    int version_ = 11;
    std::vector<policy::Header> fields_;
    std::vector<policy::Header> trailers_;
    char* body_ = nullptr;
    size_t room_ = 0;
    bool close_ = false;
    std::optional<uint64_t> direct_left_;  // set once the body is read straight
    size_t field_limit_ = std::numeric_limits<size_t>::max();
};

using H1RequestParser = H1Parser<true>;
using H1ResponseParser = H1Parser<false>;

}  // namespace egress::proxy
