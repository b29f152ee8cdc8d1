#pragma once
// The server-to-client bytes of a WebSocket connection (RFC 6455 5.2), scrubbed message by
// message. After a 101 the connection carries frames, not a body: a secret echoed in a message
// must be replaced like one echoed in a body, but a frame's header must stay a valid header
// (a replacement inside it would break the framing), and a message must never wait for the
// next one (the server may wait for the client's answer before it sends another: a body
// scrubber holding back a tail until the next piece would stall the conversation).
//
// So a message's payload, across its fragments, goes through one Scrubber stream, whose
// held-back tail is released when the message ends (its FIN frame); a control frame's payload
// (ping, pong, close: never fragmented) through a stream of its own. A fragment that does not
// end its message leaves its last (longest needle - 1) bytes to the next fragment, which
// RFC 6455 5.4 allows ("an intermediary MAY change the fragmentation of a message"): its
// header is rewritten with the shorter length and the next one's with the longer, so that a
// secret split across two fragments is found as one. A client reads a message when it ends,
// so holding a fragment's tail back delays nothing it can act on. A frame that ends a message
// and was not given bytes of an earlier fragment passes with its header as it came; every
// replacement keeps the length. Two messages are separate: a secret split across two messages
// is not found (as across two responses).
//
// What cannot be scrubbed is refused: a masked server frame (RFC 6455 5.1 forbids it; its
// payload is XORed), reserved bits set, which only an extension (permessage-deflate) may
// use: the pipeline removes the client's Sec-WebSocket-Extensions when it injects, so none
// was negotiated and compressed payloads never pass unread; and a new message begun before
// the last one ended (5.4 forbids interleaving them; the bytes held for it would be lost).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "policy/scrubber.h"

namespace egress::policy {

/// Sec-WebSocket-Accept for a handshake's Sec-WebSocket-Key (RFC 6455 4.2.2): base64 of the
/// SHA-1 of the key and the protocol's GUID. A 101 whose accept value is not this one does
/// not come from a WebSocket server answering this handshake, and is not relayed.
std::string websocket_accept(std::string_view key);

/// A fresh Sec-WebSocket-Key (RFC 6455 4.1: base64 of 16 random bytes) for the handshake
/// egressd sends upstream in place of the client's.
std::string websocket_key();

class WsServerScrubber {
public:
    explicit WsServerScrubber(std::shared_ptr<const ScrubPlan> plan);
    ~WsServerScrubber();  // wipes the message bytes not sent yet
    WsServerScrubber(const WsServerScrubber&) = delete;
    WsServerScrubber& operator=(const WsServerScrubber&) = delete;

    /// Appends to `out` the bytes of `in` that can go now: the last (longest needle - 1)
    /// payload bytes of a frame not yet whole wait for the rest of it, whatever they are (how
    /// much goes out never depends on the bytes). No timer releases them: a client cannot
    /// act on a frame before its last byte, which comes with the upstream's next bytes.
    /// Returns false, and appends nothing more, on a frame it cannot scrub (error() says
    /// why); every later call also returns false.
    bool feed(std::string_view in, std::string& out);
    /// "" while the stream is good; else "upstream_masked_frame", "upstream_reserved_bits",
    /// "upstream_bad_frame_length" (a 64-bit length with its top bit set) or
    /// "upstream_interleaved_message".
    const char* error() const { return error_; }
    /// Frames whose header has passed so far.
    uint64_t frames() const { return frames_; }

private:
    /// Header bytes so far; at most 14 (2 + 8 length bytes + 4 mask bytes).
    uint8_t header_[14] = {};
    size_t have_ = 0;
    size_t need_ = 2;  // header bytes needed to know the whole header
    uint64_t payload_left_ = 0;
    bool in_payload_ = false;
    uint64_t frames_ = 0;
    const char* error_ = "";
    bool control_ = false;     // the current frame is a control frame (opcode 8 and up)
    bool fin_ = false;         // the current data frame ends its message
    bool in_message_ = false;  // a data frame without FIN came: its message goes on
    uint64_t send_left_ = 0;   // payload bytes the current data frame's header announced, unsent
    uint64_t unsent_ = 0;      // bytes of the message taken in and not sent (carry_ + held)
    size_t keep_ = 0;          // what a fragment leaves to the next: longest needle - 1
    std::string carry_;        // scrubbed bytes of the message, not sent yet
    Scrubber message_;         // a message's payload, across its fragments
    Scrubber control_payload_; // one control frame's payload

    /// Takes header bytes from `in`; true once the header is whole and valid.
    bool take_header(std::string_view& in, std::string& out);
    /// Moves what the current data frame may still send from carry_ to `out`.
    void send_carried(std::string& out);
};

}  // namespace egress::policy
