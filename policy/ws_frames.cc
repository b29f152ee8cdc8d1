#include "policy/ws_frames.h"

#include <openssl/evp.h>
#include <openssl/sha.h>

#include <algorithm>

namespace egress::policy {

std::string websocket_accept(std::string_view key) {
    static constexpr std::string_view kGuid = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";
    std::string input(key);
    input.append(kGuid);
    unsigned char digest[SHA_DIGEST_LENGTH];
    SHA1(reinterpret_cast<const unsigned char*>(input.data()), input.size(), digest);
    char out[4 * ((SHA_DIGEST_LENGTH + 2) / 3) + 1];
    const int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out), digest, SHA_DIGEST_LENGTH);
    return std::string(out, static_cast<size_t>(n));
}

WsServerScrubber::WsServerScrubber(std::shared_ptr<const ScrubPlan> plan)
    : payload_(std::move(plan)) {}

bool WsServerScrubber::take_header(std::string_view& in, std::string& out) {
    while (have_ < need_ && !in.empty()) {
        header_[have_++] = static_cast<uint8_t>(in.front());
        in.remove_prefix(1);
        if (have_ == 2) {
            if ((header_[0] & 0x70) != 0) {
                error_ = "upstream_reserved_bits";
                return false;
            }
            if ((header_[1] & 0x80) != 0) {
                error_ = "upstream_masked_frame";
                return false;
            }
            const uint8_t len7 = header_[1] & 0x7f;
            need_ = 2 + (len7 == 126 ? 2 : len7 == 127 ? 8 : 0);
        }
    }
    if (have_ < need_) {
        return false;  // more header bytes to come
    }
    const uint8_t len7 = header_[1] & 0x7f;
    uint64_t len = len7;
    if (len7 >= 126) {
        len = 0;
        for (size_t i = 2; i < need_; ++i) {
            len = (len << 8) | header_[i];
        }
    }
    out.append(reinterpret_cast<const char*>(header_), have_);
    payload_left_ = len;
    in_payload_ = true;
    have_ = 0;
    need_ = 2;
    ++frames_;
    return true;
}

bool WsServerScrubber::feed(std::string_view in, std::string& out) {
    if (*error_ != '\0') {
        return false;
    }
    while (!in.empty() || (in_payload_ && payload_left_ == 0)) {
        if (!in_payload_) {
            if (!take_header(in, out)) {
                if (*error_ != '\0') {
                    return false;
                }
                break;  // a header cut short: the rest comes with the next piece
            }
            continue;  // a zero-length payload ends its frame at once (below)
        }
        const auto n = static_cast<size_t>(std::min<uint64_t>(payload_left_, in.size()));
        payload_.feed(in.substr(0, n), out);
        in.remove_prefix(n);
        payload_left_ -= n;
        if (payload_left_ == 0) {
            payload_.finish(out);  // the frame ends: nothing of it waits for the next one
            in_payload_ = false;
        }
    }
    return true;
}

}  // namespace egress::policy
