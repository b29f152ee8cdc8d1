// Fuzz target: WebSocket server frames scrubbed message by message (policy/ws_frames.h),
// differentially.
//
// Input: one needle line (64 bytes at most), then the server's bytes.
// Invariants checked beyond "no sanitizer report":
//   * the output, fed whole and fed in pieces (cut after each byte whose low 3 bits are 0),
//     is the same, and so is where it stops (a refused frame) and why;
//   * it equals a reference written here for every whole frame: a control frame's header as
//     it came and its payload scrubbed by the byte-by-byte definition
//     (tests/policy/scrubber_definition.h); a data frame carrying the next bytes of its whole
//     message scrubbed by the definition, all but the last (needle length - 1) of what it
//     brought and earlier fragments left unless it ends the message, its header as it came
//     when its length is unchanged, else in the shortest form; a masked frame, one with
//     reserved bits set, or a new message begun inside another stops the stream;
//   * no more comes out than went in, but for the rewritten headers' longer length forms.
#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_common.h"
#include "policy/ws_frames.h"
#include "tests/policy/scrubber_definition.h"

using egress::policy::ScrubPlan;
using egress::policy::WsServerScrubber;
using egress::policy::testing::scrub_definition;

namespace {

/// An unmasked frame header: `first`, then `len` in its shortest form.
std::string header_for(uint8_t first, uint64_t len) {
    std::string h(1, static_cast<char>(first));
    if (len < 126) {
        h.push_back(static_cast<char>(len));
    } else if (len <= 0xffff) {
        h.push_back(static_cast<char>(126));
        h.push_back(static_cast<char>(len >> 8));
        h.push_back(static_cast<char>(len & 0xff));
    } else {
        h.push_back(static_cast<char>(127));
        for (int shift = 56; shift >= 0; shift -= 8) {
            h.push_back(static_cast<char>((len >> shift) & 0xff));
        }
    }
    return h;
}

/// The output for the whole frames of `in` (see the invariants above); `error` names a
/// refused frame. A frame cut short at the end contributes nothing.
std::string reference(const std::vector<std::string>& needles, std::string_view in,
                      std::string& error) {
    const size_t keep = needles[0].empty() ? 0 : needles[0].size() - 1;
    std::string out;
    std::string message;  // the payload of the message in progress, as it came
    size_t sent = 0;      // how much of it went out
    bool in_message = false;
    while (in.size() >= 2) {
        const auto b0 = static_cast<uint8_t>(in[0]);
        const auto b1 = static_cast<uint8_t>(in[1]);
        if ((b0 & 0x70) != 0) {
            error = "upstream_reserved_bits";
            break;
        }
        if ((b1 & 0x80) != 0) {
            error = "upstream_masked_frame";
            break;
        }
        const uint8_t len7 = b1 & 0x7f;
        const size_t header = 2 + (len7 == 126 ? 2 : len7 == 127 ? 8 : 0);
        if (in.size() < header) {
            break;
        }
        uint64_t len = len7;
        if (len7 >= 126) {
            len = 0;
            for (size_t i = 2; i < header; ++i) {
                len = (len << 8) | static_cast<uint8_t>(in[i]);
            }
        }
        if ((len >> 63) != 0) {
            error = "upstream_bad_frame_length";
            break;
        }
        const uint8_t opcode = b0 & 0x0f;
        if (opcode < 8 && opcode != 0 && in_message) {
            error = "upstream_interleaved_message";
            break;
        }
        if (in.size() - header < len) {
            break;
        }
        const std::string_view payload = in.substr(header, len);
        if (opcode >= 8) {
            out.append(in.substr(0, header));
            out.append(scrub_definition(needles, payload));
        } else {
            const bool fin = (b0 & 0x80) != 0;
            message.append(payload);
            const size_t unsent = message.size() - sent;
            const size_t send = fin ? unsent : unsent - std::min(keep, unsent);
            out.append(send == len ? std::string(in.substr(0, header)) : header_for(b0, send));
            out.append(scrub_definition(needles, message).substr(sent, send));
            sent += send;
            in_message = !fin;
            if (fin) {
                message.clear();
                sent = 0;
            }
        }
        in.remove_prefix(header + len);
    }
    return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size > 16384) {
        return 0;  // the definition is quadratic
    }
    std::string_view in(reinterpret_cast<const char*>(data), size);
    const size_t nl = in.find('\n');
    if (nl == std::string_view::npos) {
        return 0;
    }
    const std::vector<std::string> needles{std::string(in.substr(0, std::min(nl, size_t{64})))};
    const std::string_view stream = in.substr(nl + 1);

    WsServerScrubber whole(std::make_shared<const ScrubPlan>(std::vector<std::string>(needles)));
    std::string out_whole;
    const bool ok_whole = whole.feed(stream, out_whole);

    WsServerScrubber cut(std::make_shared<const ScrubPlan>(std::vector<std::string>(needles)));
    std::string out_cut;
    bool ok_cut = true;
    size_t prev = 0;
    for (size_t i = 0; i <= stream.size() && ok_cut; ++i) {
        if (i == stream.size() || (static_cast<unsigned char>(stream[i]) & 7) == 0) {
            const size_t end = std::min(i + 1, stream.size());
            ok_cut = cut.feed(stream.substr(prev, end - prev), out_cut);
            prev = end;
        }
    }
    FUZZ_CHECK(ok_whole == ok_cut, "fed whole and in pieces, one was refused and one not");
    FUZZ_CHECK(std::string_view(whole.error()) == cut.error(), "refused for different reasons");

    std::string error;
    const std::string want = reference(needles, stream, error);
    FUZZ_CHECK(std::string_view(whole.error()) == error, "refusal differs from the reference");
    // Bytes of a frame cut short may have come out already (its header, its payload's start):
    // both outputs begin with the whole frames' bytes, exactly.
    FUZZ_CHECK(out_whole.compare(0, want.size(), want) == 0, "whole frames differ from the reference");
    FUZZ_CHECK(out_cut.compare(0, want.size(), want) == 0, "pieces differ from the reference");
    // A rewritten header may take a longer length form: 8 bytes at most more per frame.
    FUZZ_CHECK(out_whole.size() <= stream.size() + 8 * whole.frames() &&
                   out_cut.size() <= stream.size() + 8 * cut.frames(),
               "more bytes out than in");
    FUZZ_CHECK(out_whole.size() >= want.size() && out_cut.size() >= want.size(),
               "a whole frame was held back");
    return 0;
}
