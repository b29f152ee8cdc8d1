// Fuzz target: WebSocket server frames scrubbed frame by frame (policy/ws_frames.h),
// differentially.
//
// Input: one needle line (64 bytes at most), then the server's bytes.
// Invariants checked beyond "no sanitizer report":
//   * the output, fed whole and fed in pieces (cut after each byte whose low 3 bits are 0),
//     is the same, and so is where it stops (a refused frame) and why;
//   * it equals a reference written here: frame by frame, the header as it came and the
//     payload scrubbed by the byte-by-byte definition (tests/policy/scrubber_definition.h),
//     for every whole frame; a masked frame or one with reserved bits set stops the stream;
//   * nothing comes out that did not go in (the output is never longer than the input).
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

/// The whole frames of `in`, each header kept and each payload scrubbed; `error` names a
/// refused frame. A frame cut short at the end contributes nothing.
std::string reference(const std::vector<std::string>& needles, std::string_view in,
                      std::string& error) {
    std::string out;
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
        if (in.size() - header < len) {
            break;
        }
        out.append(in.substr(0, header));
        out.append(scrub_definition(needles, in.substr(header, len)));
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
    FUZZ_CHECK(out_whole.size() <= stream.size() && out_cut.size() <= stream.size(),
               "more bytes out than in");
    FUZZ_CHECK(out_whole.size() >= want.size() && out_cut.size() >= want.size(),
               "a whole frame was held back");
    return 0;
}
