#pragma once
// The server-to-client bytes of a WebSocket connection (RFC 6455 5.2), scrubbed frame by frame.
// After a 101 the connection carries frames, not a body: a secret echoed in a message must be
// replaced like one echoed in a body, but a frame's header must pass untouched (a replacement
// inside it would break the framing), and a frame must never wait for the next one (the
// server may wait for the client's answer before it sends another: a body scrubber holding
// back a tail until the next piece would stall the conversation). So each frame's payload
// goes through its own Scrubber stream, whose held-back tail is released at the frame's end.
// Lengths never change. A needle split across two frames is not found (each frame's payload
// is scrubbed on its own).
//
// What cannot be scrubbed is refused: a masked server frame (RFC 6455 5.1 forbids it; its
// payload is XORed), and reserved bits set, which only an extension (permessage-deflate)
// may use: the pipeline removes the client's Sec-WebSocket-Extensions when it injects, so
// none was negotiated and compressed payloads never pass unread.
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

class WsServerScrubber {
public:
    explicit WsServerScrubber(std::shared_ptr<const ScrubPlan> plan);

    /// Appends to `out` the bytes of `in` that can go now (a payload tail that may begin a
    /// needle waits for the rest of its frame). Returns false, and appends nothing more, on a
    /// frame it cannot scrub (error() says why); every later call also returns false.
    bool feed(std::string_view in, std::string& out);
    /// "" while the stream is good; else "upstream_masked_frame" or "upstream_reserved_bits".
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
    Scrubber payload_;

    /// Takes header bytes from `in`; true once the header is whole and valid.
    bool take_header(std::string_view& in, std::string& out);
};

}  // namespace egress::policy
