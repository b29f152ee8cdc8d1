#pragma once
// Streaming replacement of secret bytes in a response, across chunk boundaries.
// Replacements keep the length of what they replace ("[REDACTED]" cut or padded with '*'),
// so Content-Length framing stays valid and nothing needs buffering beyond a short tail.
#include <array>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "credstore/secret.h"
#include "policy/request_head.h"

namespace egress::policy {

/// The needles of one credential and how a body is searched for them. Made once per pin
/// (policy::Injection), not per request: sorting, planning and wiping the needles cost ~2.3 k
/// instructions per request when every exchange built its own. Read-only, so every request's
/// Scrubber shares it. WARNING: holds secret bytes: they
/// live in one mlock'ed buffer (credstore::SecretValue), wiped on destruction.
class ScrubPlan {
public:
    /// Empty needles are ignored, duplicates kept once. Wipes the argument's bytes.
    explicit ScrubPlan(std::vector<std::string> needles);
    ~ScrubPlan();  // wipes the search's first bytes (the needles wipe themselves)
    ScrubPlan(const ScrubPlan&) = delete;
    ScrubPlan& operator=(const ScrubPlan&) = delete;

    /// How a body is searched, derived from the needles: it holds each needle's first byte,
    /// so it is wiped with them.
    struct Search {
        struct Kernel {
            size_t needle;  // index of a needle that contains no other needle
            size_t back;    // a needle holding it may start up to this many bytes earlier
        };
        std::vector<Kernel> kernels;  // every needle contains at least one kernel
        std::array<bool, 256> first{};  // bytes that start some needle
    };

    const std::vector<std::string_view>& needles() const { return needles_; }  // longest first
    const Search& search() const { return search_; }
    size_t max_len() const { return max_len_; }

private:
    std::unique_ptr<const credstore::SecretValue> bytes_;  // the needles, back to back
    std::vector<std::string_view> needles_;                // views into bytes_
    Search search_;
    size_t max_len_ = 0;
};

class Scrubber {
public:
    Scrubber() = default;
    /// One response's stream over a shared plan (null: nothing to scrub). WARNING: holds
    /// secret bytes (the held-back tail); never log a Scrubber.
    explicit Scrubber(std::shared_ptr<const ScrubPlan> plan);
    /// With a plan of its own, for one-off uses and tests.
    explicit Scrubber(std::vector<std::string> needles);
    ~Scrubber();  // wipes the held-back tail

    bool active() const { return plan_ != nullptr && !plan_->needles().empty(); }

    /// Appends scrubbed bytes of `in` to `out`. Holds back exactly min(longest needle - 1,
    /// bytes held before + `in`), whatever the bytes are: how much of a piece goes out never
    /// depends on its content (holding only what could begin a needle told the client, by the
    /// sizes it received, whether text it chose was a prefix of the secret). The held bytes
    /// are emitted by a later feed or by finish().
    void feed(std::string_view in, std::string& out);
    /// Emits whatever is held back (scrubbed as far as its bytes show). At the end of the
    /// stream, or in the middle of it (the stream paused: limits.scrub_hold_timeout); the
    /// stream then goes on as a new one, so a needle split across this point is not found.
    void finish(std::string& out);
    /// How many bytes are held back (0 after finish() or a last piece).
    size_t held() const { return tail_.size(); }
    /// The same stream, scrubbed where the piece lies (no copy of the body): returns the bytes
    /// to send now, rewritten in place where a needle was (the length never changes). The
    /// last bytes are held back (and wiped where they lay), as feed() holds them. Bytes held
    /// back from the previous piece (every piece after the first, unless finish() emitted
    /// them) go in front of `piece`: into its `headroom` (that many bytes before
    /// piece.data() that the caller owns and lets the scrubber overwrite), when they fit, so
    /// the result is the held bytes and a prefix of `piece`, one span and no copy of the
    /// piece; otherwise it falls back to feed() into `spill` and returns `spill` (and zeroes
    /// `piece` when a needle was replaced: the copy is scrubbed, not the piece). `last` also
    /// does what finish() does.
    std::string_view feed_in_place(std::span<char> piece, size_t headroom, bool last,
                                   std::string& spill);
    std::string_view feed_in_place(std::span<char> piece, bool last, std::string& spill) {
        return feed_in_place(piece, 0, last, spill);
    }

    /// Scrubs one complete value (a header value).
    std::string scrub_value(std::string_view value);
    /// The same, in place: `value` changes only where a needle occurs (no allocation).
    void scrub_in_place(std::string& value);
    /// Whether a field name holds a needle, compared without case (an HTTP/2 upstream
    /// lowercases the names it sends, and an echoed credential's letters with them). Such a
    /// field is dropped whole: a name cannot be redacted into one that means anything. Counts
    /// as a replacement.
    bool name_holds_secret(std::string_view name);
    /// A response's or trailers' fields: values scrubbed in place, fields whose names hold a
    /// needle dropped.
    void scrub_fields(std::vector<Header>& fields);

    size_t replacements() const { return replacements_; }

private:
    /// Scrubs `data` in place from the stream's state, holds back (into tail_, wiped in
    /// `data`) its last (longest needle - 1) bytes unless `final`; returns how many bytes are
    /// final.
    size_t scan_and_hold(char* data, size_t size, bool final);

    std::shared_ptr<const ScrubPlan> plan_;
    std::string tail_;
    size_t replacements_ = 0;
    // Where the stream stands inside a replacement that started in an earlier feed().
    size_t covered_left_ = 0;  // bytes still covered by a match already found
    size_t run_pos_ = 0;       // offset into the replacement text of the next covered byte
};

}  // namespace egress::policy
