#include "policy/ws_frames.h"

#include <openssl/evp.h>
#include <openssl/rand.h>
#include <openssl/sha.h>

#include <algorithm>
#include <stdexcept>

#include "common/secure_zero.h"

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

std::string websocket_key() {
    unsigned char nonce[16];
    if (RAND_bytes(nonce, sizeof nonce) != 1) {
        throw std::runtime_error("RAND_bytes failed: cannot make a WebSocket key");
    }
    char out[4 * ((sizeof nonce + 2) / 3) + 1];
    const int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out), nonce, sizeof nonce);
    return std::string(out, static_cast<size_t>(n));
}

WsServerScrubber::WsServerScrubber(std::shared_ptr<const ScrubPlan> plan)
    : keep_(plan != nullptr && plan->max_len() > 0 ? plan->max_len() - 1 : 0),
      message_(plan),
      control_payload_(std::move(plan)) {}

WsServerScrubber::~WsServerScrubber() {
    egress::secure_wipe(carry_);
}

namespace {

/// Appends an unmasked frame header: `first` (FIN, opcode) and `len` in its shortest form.
void append_header(std::string& out, uint8_t first, uint64_t len) {
    out.push_back(static_cast<char>(first));
    if (len < 126) {
        out.push_back(static_cast<char>(len));
    } else if (len <= 0xffff) {
        out.push_back(static_cast<char>(126));
        out.push_back(static_cast<char>(len >> 8));
        out.push_back(static_cast<char>(len & 0xff));
    } else {
        out.push_back(static_cast<char>(127));
        for (int shift = 56; shift >= 0; shift -= 8) {
            out.push_back(static_cast<char>((len >> shift) & 0xff));
        }
    }
}

}  // namespace

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
    if ((len >> 63) != 0) {
        // RFC 6455 5.2: a 64-bit length's most significant bit is 0. Taken as a length, it
        // would wrap the bytes a fragment carries on (unsent_ + len) and the rest of the
        // stream would be held, never sent, for as long as the upstream sends.
        error_ = "upstream_bad_frame_length";
        return false;
    }
    const uint8_t opcode = header_[0] & 0x0f;
    control_ = opcode >= 8;
    if (control_) {
        out.append(reinterpret_cast<const char*>(header_), have_);
    } else {
        if (opcode != 0 && in_message_) {
            error_ = "upstream_interleaved_message";
            return false;
        }
        fin_ = (header_[0] & 0x80) != 0;
        in_message_ = !fin_;
        // The bytes this frame carries: what earlier fragments left, and its own, but for the
        // tail it leaves to the next fragment when the message goes on.
        const uint64_t total = unsent_ + len;
        send_left_ = fin_ ? total : total - std::min<uint64_t>(keep_, total);
        if (send_left_ == len) {
            out.append(reinterpret_cast<const char*>(header_), have_);  // as it came
        } else {
            append_header(out, header_[0], send_left_);
        }
    }
    payload_left_ = len;
    in_payload_ = true;
    have_ = 0;
    need_ = 2;
    ++frames_;
    return true;
}

void WsServerScrubber::send_carried(std::string& out) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(send_left_, carry_.size()));
    out.append(carry_, 0, n);
    carry_.erase(0, n);
    send_left_ -= n;
    unsent_ -= n;
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
            send_carried(out);  // bytes an earlier fragment left, as far as this one sends
            continue;           // a zero-length payload ends its frame at once (below)
        }
        const auto n = static_cast<size_t>(std::min<uint64_t>(payload_left_, in.size()));
        if (control_) {
            control_payload_.feed(in.substr(0, n), out);
        } else {
            message_.feed(in.substr(0, n), carry_);
            unsent_ += n;
            send_carried(out);
        }
        in.remove_prefix(n);
        payload_left_ -= n;
        if (payload_left_ == 0) {
            if (control_) {
                control_payload_.finish(out);  // the frame ends: nothing waits for another
            } else if (fin_) {
                message_.finish(carry_);  // the message ends: nothing waits for another
                send_carried(out);
            }
            // A fragment that does not end its message has sent what its header announced:
            // the scrubber holds back at most keep_ bytes, and the header left keep_ of them.
            in_payload_ = false;
        }
    }
    return true;
}

}  // namespace egress::policy
