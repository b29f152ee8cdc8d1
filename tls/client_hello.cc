#include "tls/client_hello.h"

#include <vector>

namespace egress::tls {

namespace {

using Status = ClientHelloPeek::Status;

/// Big-endian reader over a byte span; every read is bounds-checked.
class Reader {
public:
    explicit Reader(std::span<const uint8_t> b) : b_(b) {}
    bool u8(uint32_t& v) { return n(1, v); }
    bool u16(uint32_t& v) { return n(2, v); }
    bool u24(uint32_t& v) { return n(3, v); }
    bool skip(size_t k) {
        if (b_.size() - pos_ < k) return false;
        pos_ += k;
        return true;
    }
    bool sub(size_t k, std::span<const uint8_t>& out) {
        if (b_.size() - pos_ < k) return false;
        out = b_.subspan(pos_, k);
        pos_ += k;
        return true;
    }
    size_t left() const { return b_.size() - pos_; }

private:
    bool n(size_t k, uint32_t& v) {
        if (b_.size() - pos_ < k) return false;
        v = 0;
        for (size_t i = 0; i < k; ++i) v = (v << 8) | b_[pos_ + i];
        pos_ += k;
        return true;
    }
    std::span<const uint8_t> b_;
    size_t pos_ = 0;
};

/// Parses a complete ClientHello body (after the 4-byte handshake header).
ClientHelloPeek parse_body(std::span<const uint8_t> body) {
    Reader r(body);
    uint32_t v = 0;
    if (!r.u16(v) || !r.skip(32)) return {Status::Malformed, {}};             // version, random
    if (!r.u8(v) || v > 32 || !r.skip(v)) return {Status::Malformed, {}};     // session id
    if (!r.u16(v) || v < 2 || (v & 1) || !r.skip(v)) return {Status::Malformed, {}};  // suites
    if (!r.u8(v) || v < 1 || !r.skip(v)) return {Status::Malformed, {}};      // compression
    if (r.left() == 0) return {Status::Complete, {}};                         // no extensions
    uint32_t ext_len = 0;
    std::span<const uint8_t> exts;
    if (!r.u16(ext_len) || !r.sub(ext_len, exts) || r.left() != 0) {
        return {Status::Malformed, {}};
    }
    Reader e(exts);
    std::optional<std::string> sni;
    bool seen_sni = false;
    while (e.left() > 0) {
        uint32_t type = 0;
        uint32_t len = 0;
        std::span<const uint8_t> data;
        if (!e.u16(type) || !e.u16(len) || !e.sub(len, data)) return {Status::Malformed, {}};
        if (type != 0) continue;  // server_name (RFC 6066 §3)
        if (seen_sni) return {Status::Malformed, {}};  // the extension twice
        seen_sni = true;
        auto ext = parse_server_name(data);
        if (ext.malformed) return {Status::Malformed, {}};
        sni = std::move(ext.host);
    }
    return {Status::Complete, std::move(sni)};
}

}  // namespace

ServerNameExtension parse_server_name(std::span<const uint8_t> ext) {
    Reader s(ext);
    uint32_t list_len = 0;
    std::span<const uint8_t> list;
    if (!s.u16(list_len) || !s.sub(list_len, list) || s.left() != 0) {
        return {true, {}};
    }
    ServerNameExtension out;
    Reader l(list);
    while (l.left() > 0) {
        uint32_t name_type = 0;
        uint32_t name_len = 0;
        std::span<const uint8_t> name;
        if (!l.u8(name_type) || !l.u16(name_len) || !l.sub(name_len, name)) {
            return {true, {}};
        }
        if (name_type == 0) {  // host_name; at most one per RFC 6066
            if (out.host || name.empty()) return {true, {}};
            out.host = std::string(name.begin(), name.end());
        }
    }
    return out;
}

ClientHelloPeek peek_client_hello(std::span<const uint8_t> bytes) {
    if (bytes.empty()) return {Status::NeedMore, {}};
    if (bytes[0] != 0x16) return {Status::NotTls, {}};
    // Gather handshake-record fragments until the ClientHello message is complete.
    std::vector<uint8_t> msg;
    size_t pos = 0;
    for (;;) {
        if (bytes.size() - pos < 5) return {Status::NeedMore, {}};
        const uint8_t* h = bytes.data() + pos;
        if (h[0] != 0x16) return {Status::Malformed, {}};  // interleaved non-handshake record
        if (h[1] != 0x03) return {Status::Malformed, {}};  // record version 3.x
        size_t len = (size_t{h[3]} << 8) | h[4];
        if (len == 0 || len > 16384) return {Status::Malformed, {}};
        if (bytes.size() - pos - 5 < len) return {Status::NeedMore, {}};
        msg.insert(msg.end(), h + 5, h + 5 + len);
        pos += 5 + len;
        if (msg.size() >= 4) {
            if (msg[0] != 0x01) return {Status::Malformed, {}};  // not a ClientHello
            size_t body = (size_t{msg[1]} << 16) | (size_t{msg[2]} << 8) | msg[3];
            if (body > kMaxClientHello) return {Status::Malformed, {}};
            if (msg.size() - 4 >= body) {
                if (msg.size() - 4 > body) return {Status::Malformed, {}};  // trailing bytes
                return parse_body(std::span<const uint8_t>(msg).subspan(4, body));
            }
        }
    }
}

}  // namespace egress::tls
