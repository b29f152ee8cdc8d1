// Fuzz target: response scrubbing (policy/scrubber.h), differentially.
//
// Input: up to three needle lines (64 bytes each at most), then the body:
// "NEEDLE\nNEEDLE\n\x00\nBODY" (a line holding a single NUL ends the needles; without one, the
// first line is the needle and the rest the body). The fuzzer picks needles that contain one
// another ("Bearer tok" and "tok"), which is what the memmem skipping in scan() relies on.
// Invariants checked beyond "no sanitizer report":
//   * scrub_value equals the definition (byte by byte, no skipping: the longest needle at each
//     position extends the covered run; the replacement text restarts with each run);
//   * feeding the body in pieces (cut where the input's bytes say) gives the same output, through
//     feed() and through feed_in_place() (each piece scrubbed in a buffer of its own);
//   * each piece releases all but (longest needle - 1) of the bytes held and given, whatever
//     they are (what goes out when must not tell the client anything about the bytes);
//   * the output has the body's length. (Not "holds no needle": the replacement text next to
//     kept bytes can spell a needle such as "ab[", which is no leak of the input.)
#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_common.h"
#include "policy/scrubber.h"
#include "tests/policy/scrubber_definition.h"

using egress::policy::Scrubber;
using egress::policy::testing::scrub_definition;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size > 8192) {
        return 0;  // the definition is quadratic; long bodies add nothing here
    }
    std::string_view in(reinterpret_cast<const char*>(data), size);
    std::vector<std::string> needles;
    const size_t end = in.find(std::string_view("\n\0\n", 3));
    std::string_view head =
        end == std::string_view::npos ? in.substr(0, in.find('\n')) : in.substr(0, end);
    std::string_view body = end == std::string_view::npos
                                ? (head.size() < in.size() ? in.substr(head.size() + 1) : "")
                                : in.substr(end + 3);
    while (!head.empty() && needles.size() < 3) {
        const size_t nl = head.find('\n');
        needles.emplace_back(head.substr(0, std::min(nl, size_t{64})));
        head = nl == std::string_view::npos ? std::string_view() : head.substr(nl + 1);
    }
    const std::string want = scrub_definition(needles, body);

    Scrubber one(needles);
    const std::string got = one.scrub_value(body);
    FUZZ_CHECK(got == want, "scrub_value differs from the definition");

    // Streamed: cut after every byte whose low bits are zero (input-driven piece sizes).
    // How much each piece releases depends on sizes alone: all but (longest needle - 1) bytes.
    size_t hold = 0;
    for (const std::string& n : needles) {
        hold = std::max(hold, n.empty() ? 0 : n.size() - 1);
    }
    Scrubber streamed(needles);
    std::string out;
    size_t prev = 0;
    for (size_t i = 0; i < body.size(); ++i) {
        if ((static_cast<unsigned char>(body[i]) & 7) == 0) {
            const size_t had = streamed.held() + (i + 1 - prev);
            const size_t before = out.size();
            streamed.feed(body.substr(prev, i + 1 - prev), out);
            if (streamed.active()) {
                FUZZ_CHECK(out.size() - before == had - std::min(hold, had),
                           "a piece's release depends on its bytes");
            }
            prev = i + 1;
        }
    }
    streamed.feed(body.substr(prev), out);
    streamed.finish(out);
    FUZZ_CHECK(out == want, "streamed output differs from the definition");
    FUZZ_CHECK(out.size() == body.size(), "length changed");

    // The same cuts, scrubbed in place (each piece in a buffer of its own, as relayed).
    Scrubber in_place(needles);
    std::string sent;
    std::string spill;
    prev = 0;
    for (size_t i = 0; i <= body.size(); ++i) {
        if (i == body.size() || (static_cast<unsigned char>(body[i]) & 7) == 0) {
            const size_t end_at = std::min(i + 1, body.size());
            std::string piece(body.substr(prev, end_at - prev));
            sent.append(in_place.feed_in_place(piece, i == body.size(), spill));
            prev = end_at;
        }
    }
    FUZZ_CHECK(sent == want, "in-place output differs from the definition");

    // Again, each piece behind headroom the held bytes may be put in (as an HTTP/1.1 upstream's
    // relay buffer has): 16 bytes, which some held tails fit and some do not (needles of up to
    // 64 bytes), so both ways are taken in one stream.
    constexpr size_t kHeadroom = 16;
    Scrubber roomy(needles);
    std::string sent_roomy;
    prev = 0;
    for (size_t i = 0; i <= body.size(); ++i) {
        if (i == body.size() || (static_cast<unsigned char>(body[i]) & 7) == 0) {
            const size_t end_at = std::min(i + 1, body.size());
            std::string buf(kHeadroom, '\xff');
            buf.append(body.substr(prev, end_at - prev));
            const size_t held = roomy.held();
            const std::string_view out = roomy.feed_in_place(
                std::span<char>(buf.data() + kHeadroom, buf.size() - kHeadroom), kHeadroom,
                i == body.size(), spill);
            FUZZ_CHECK(held > kHeadroom || out.empty() ||
                           out.data() == buf.data() + kHeadroom - held,
                       "held bytes that fit the headroom were copied with the piece");
            sent_roomy.append(out);
            prev = end_at;
        }
    }
    FUZZ_CHECK(sent_roomy == want, "in-place output with headroom differs from the definition");
    return 0;
}
