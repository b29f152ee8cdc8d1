#include "policy/scrubber.h"

#include <openssl/crypto.h>

#include <algorithm>
#include <array>
#include <cstring>

#include "common/secure_zero.h"

namespace egress::policy {

namespace {

constexpr std::string_view kRedacted = "[REDACTED]";

struct ScanState {
    size_t covered_left = 0;
    size_t run_pos = 0;
    size_t replacements = 0;
};

/// Where the next needle occurrence can begin at or after `i` and before `end`, outside a
/// match (`end` if none). Every needle starting before `end` fits before `size` (the caller
/// holds back the last longest-needle - 1 bytes of a piece that is not final, whatever they
/// are), so only full occurrences matter and they are found with memmem (glibc's skips ahead
/// on a miss; a first-byte filter stopped at every byte that starts a needle: text dense in
/// those bytes scrubbed at ~0.3 GB/s). Only the kernels are searched ("Bearer tok" holds
/// "tok"): an occurrence of a needle at q puts one of its kernels at most `back` bytes after
/// q, so the kernel found first, minus `back`, is never past q; the caller checks byte by byte
/// from there.
size_t next_start(const ScrubPlan& plan, const char* buf, size_t i, size_t size, size_t end) {
    size_t next = end;
    for (const auto& k : plan.search().kernels) {
        const std::string_view n = plan.needles()[k.needle];
        const size_t hay_end = std::min(size, next + k.back + n.size() - 1);
        if (hay_end <= i || hay_end - i < n.size()) {
            continue;
        }
        if (const void* p = ::memmem(buf + i, hay_end - i, n.data(), n.size())) {
            const auto at = static_cast<size_t>(static_cast<const char*>(p) - buf);
            next = std::min(next, at - std::min(at - i, k.back));
        }
    }
    return next;
}

/// Scrubs the first `end` bytes of `buf` left to right, replacing every byte covered by some
/// needle occurrence (occurrences may overlap; the longest at a position is taken, so overlaps
/// only extend the covered run). A needle is looked for at every position before `end`, and
/// may cover bytes up to `size`; the bytes from `end` on are left as they are (the caller
/// holds them back and scans them again in front of the next piece, `st` carrying a run that
/// covers them). Replacement text is "[REDACTED]" cut or padded with '*', so the length never
/// changes and a byte's replacement depends only on its offset in the run. WARNING: where
/// `end` lies must never depend on the bytes (see Scrubber::feed): which bytes go out when is
/// what the client sees.
void scan(const ScrubPlan& plan, char* buf, size_t size, size_t end, ScanState& st) {
    const ScrubPlan::Search& search = plan.search();
    for (size_t i = 0; i < end; ++i) {
        if (st.covered_left == 0) {
            i = next_start(plan, buf, i, size, end);
            if (i == end) {
                break;
            }
        }
        const size_t left = size - i;
        if (search.first[static_cast<unsigned char>(buf[i])]) {
            for (const std::string_view n : plan.needles()) {  // longest first
                if (n.size() <= left && std::memcmp(n.data(), buf + i, n.size()) == 0) {
                    if (st.covered_left == 0) {
                        st.run_pos = 0;
                    }
                    st.covered_left = std::max(st.covered_left, n.size());
                    ++st.replacements;
                    break;
                }
            }
        }
        if (st.covered_left > 0) {
            buf[i] = st.run_pos < kRedacted.size() ? kRedacted[st.run_pos] : '*';
            ++st.run_pos;
            --st.covered_left;
        }
    }
}

/// Kernels and first bytes of `needles` (distinct, non-empty).
ScrubPlan::Search plan_search(const std::vector<std::string_view>& needles) {
    ScrubPlan::Search s;
    for (size_t k = 0; k < needles.size(); ++k) {
        const std::string_view kn = needles[k];
        bool holds_other = false;
        for (size_t o = 0; o < needles.size() && !holds_other; ++o) {
            holds_other = o != k && kn.find(needles[o]) != std::string_view::npos;
        }
        if (holds_other) {
            continue;
        }
        size_t back = 0;  // the largest offset of this kernel inside any needle
        for (const std::string_view n : needles) {
            for (size_t at = n.find(kn); at != std::string::npos; at = n.find(kn, at + 1)) {
                back = std::max(back, at);
            }
        }
        s.kernels.push_back({k, back});
    }
    for (const std::string_view n : needles) {
        auto c = static_cast<unsigned char>(n.front());
        s.first[c] = true;
    }
    return s;
}

}  // namespace

ScrubPlan::ScrubPlan(std::vector<std::string> needles) {
    std::erase_if(needles, [](const std::string& n) { return n.empty(); });
    std::sort(needles.begin(), needles.end(), [](const std::string& a, const std::string& b) {
        return a.size() != b.size() ? a.size() > b.size() : a < b;
    });
    const auto dups = std::unique(needles.begin(), needles.end());
    for (auto it = dups; it != needles.end(); ++it) {
        egress::secure_wipe(*it);  // a needle twice (a template of just the secret)
    }
    needles.erase(dups, needles.end());
    size_t total = 0;
    for (const std::string& n : needles) {
        total += n.size();
    }
    std::string joined;
    joined.reserve(total);  // one buffer, so no unwiped copy is left behind by growing
    for (const std::string& n : needles) {
        joined += n;
    }
    bytes_ = std::make_unique<const credstore::SecretValue>(joined);
    egress::secure_wipe(joined);
    const std::string_view all = bytes_->reveal();
    size_t at = 0;
    needles_.reserve(needles.size());
    for (std::string& n : needles) {
        needles_.push_back(all.substr(at, n.size()));
        at += n.size();
        egress::secure_wipe(n);
    }
    max_len_ = needles_.empty() ? 0 : needles_.front().size();
    search_ = plan_search(needles_);
}

ScrubPlan::~ScrubPlan() {
    egress::secure_zero(search_.first.data(), search_.first.size());
}

Scrubber::Scrubber(std::shared_ptr<const ScrubPlan> plan) : plan_(std::move(plan)) {}

Scrubber::Scrubber(std::vector<std::string> needles)
    : plan_(std::make_shared<const ScrubPlan>(std::move(needles))) {}

Scrubber::~Scrubber() { egress::secure_zero(tail_.data(), tail_.size()); }

// One copy per piece: the held-back bytes and `in` are appended to `out` and scrubbed there
// (a 64 KiB body piece used to be copied into the tail, copied out, and the tail wiped).
void Scrubber::feed(std::string_view in, std::string& out) {
    if (!active()) {
        out.append(in);
        return;
    }
    const size_t start = out.size();
    out.reserve(start + tail_.size() + in.size());  // no reallocation between the appends
    out.append(tail_);
    out.append(in);
    egress::secure_zero(tail_.data(), tail_.size());
    const size_t safe = scan_and_hold(out.data() + start, out.size() - start, false);
    out.resize(start + safe);
}

size_t Scrubber::scan_and_hold(char* data, size_t size, bool final) {
    // Not final: the last (longest needle - 1) bytes wait, whatever they are. Holding only
    // bytes that begin a needle told the client, by how much of a piece it got, whether text
    // it had an upstream reflect was a prefix of the secret (byte by byte, the whole secret).
    const size_t safe = final ? size : size - std::min(size, plan_->max_len() - 1);
    ScanState st{covered_left_, run_pos_, 0};
    scan(*plan_, data, size, safe, st);
    covered_left_ = st.covered_left;
    run_pos_ = st.run_pos;
    replacements_ += st.replacements;
    // Hold back the rest, as it came (it is scanned again in front of the next piece), and
    // wipe it there.
    tail_.assign(data + safe, size - safe);
    egress::secure_zero(data + safe, size - safe);
    return safe;
}

void Scrubber::finish(std::string& out) {
    if (active()) {
        ScanState st{covered_left_, run_pos_, 0};
        scan(*plan_, tail_.data(), tail_.size(), tail_.size(), st);
        replacements_ += st.replacements;
    }
    out.append(tail_);
    egress::secure_wipe(tail_);
    covered_left_ = 0;
    run_pos_ = 0;
}

std::string_view Scrubber::feed_in_place(std::span<char> piece, size_t headroom, bool last,
                                         std::string& spill) {
    if (!active()) {
        return {piece.data(), piece.size()};
    }
    if (!tail_.empty() && tail_.size() <= headroom) {
        // The held bytes go in front of the piece, in the reader's headroom: one span, and
        // only the held bytes are copied (a 64 KiB piece copied behind them into `spill` cost
        // ~1.8 us). The scan goes on from where the held bytes start, as feed()'s does.
        char* start = piece.data() - tail_.size();
        std::memcpy(start, tail_.data(), tail_.size());
        piece = std::span<char>(start, tail_.size() + piece.size());
        egress::secure_zero(tail_.data(), tail_.size());
        tail_.clear();
    }
    if (!tail_.empty()) {
        spill.clear();
        const size_t before = replacements_;
        feed({piece.data(), piece.size()}, spill);
        if (last) {
            finish(spill);
        }
        if (replacements_ != before) {
            // Scrubbed in `spill`: the piece as it was read still holds what was replaced.
            egress::secure_zero(piece.data(), piece.size());
        }
        return spill;
    }
    const size_t safe = scan_and_hold(piece.data(), piece.size(), last);  // last: holds none
    if (last) {
        covered_left_ = 0;
        run_pos_ = 0;
    }
    return {piece.data(), safe};
}

std::string Scrubber::scrub_value(std::string_view value) {
    std::string buf(value);
    scrub_in_place(buf);
    return buf;
}

void Scrubber::scrub_in_place(std::string& value) {
    if (!active()) {
        return;
    }
    ScanState st;
    scan(*plan_, value.data(), value.size(), value.size(), st);
    replacements_ += st.replacements;
}

bool Scrubber::name_holds_secret(std::string_view name) {
    if (!active()) {
        return false;
    }
    // Every needle holds a kernel, so the kernels alone decide; names are short.
    for (const auto& k : plan_->search().kernels) {
        const std::string_view n = plan_->needles()[k.needle];
        for (size_t i = 0; i + n.size() <= name.size(); ++i) {
            if (iequals(name.substr(i, n.size()), n)) {
                ++replacements_;
                return true;
            }
        }
    }
    return false;
}

void Scrubber::scrub_fields(std::vector<Header>& fields) {
    if (!active()) {
        return;
    }
    std::erase_if(fields, [this](const Header& h) { return name_holds_secret(h.name); });
    for (auto& h : fields) {
        scrub_in_place(h.value);
    }
}

}  // namespace egress::policy
