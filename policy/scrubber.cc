#include "policy/scrubber.h"

#include <openssl/crypto.h>

#include <algorithm>
#include <array>
#include <cstring>

namespace egress::policy {

namespace {

constexpr std::string_view kRedacted = "[REDACTED]";

struct ScanState {
    size_t covered_left = 0;
    size_t run_pos = 0;
    size_t replacements = 0;
};

/// Scrubs `buf` left to right, replacing every byte covered by some needle occurrence
/// (occurrences may overlap; the longest at a position is taken, so overlaps only extend the
/// covered run). Returns how many leading bytes are final. Unless `final`, it stops at the
/// first position where a needle could still begin but the buffer ends first; the caller
/// holds those bytes back. Replacement text is "[REDACTED]" cut or padded with '*', so the
/// length never changes and a byte's replacement depends only on its offset in the run.
size_t scan(const std::vector<std::string>& needles, size_t max_len, char* buf, size_t size,
            bool final, ScanState& st) {
    std::array<bool, 256> first{};
    std::array<unsigned char, 256> firsts{};  // the distinct first bytes, for memchr
    size_t n_firsts = 0;
    for (const std::string& n : needles) {
        auto c = static_cast<unsigned char>(n.front());
        if (!first[c]) {
            first[c] = true;
            firsts[n_firsts++] = c;
        }
    }
    for (size_t i = 0; i < size; ++i) {
        if (st.covered_left == 0) {
            // Outside a match, jump to the next byte that can start a needle (memchr is
            // vectorised; a body rarely holds one).
            size_t next = size;
            for (size_t k = 0; k < n_firsts; ++k) {
                if (const void* p = std::memchr(buf + i, firsts[k], next - i)) {
                    next = static_cast<size_t>(static_cast<const char*>(p) - buf);
                }
            }
            i = next;
            if (i == size) {
                break;
            }
        }
        const size_t left = size - i;
        const bool candidate = first[static_cast<unsigned char>(buf[i])];
        if (candidate && !final && left < max_len) {
            for (const std::string& n : needles) {
                if (n.size() > left && std::memcmp(n.data(), buf + i, left) == 0) {
                    return i;  // a longer needle may still complete here
                }
            }
        }
        if (candidate) {
            for (const std::string& n : needles) {  // longest first
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
    return size;
}

}  // namespace

Scrubber::Scrubber(std::vector<std::string> needles) {
    std::erase_if(needles, [](const std::string& n) { return n.empty(); });
    std::sort(needles.begin(), needles.end(), [](const std::string& a, const std::string& b) {
        return a.size() != b.size() ? a.size() > b.size() : a < b;
    });
    needles.erase(std::unique(needles.begin(), needles.end()), needles.end());
    needles_ = std::move(needles);
    max_len_ = needles_.empty() ? 0 : needles_.front().size();
}

Scrubber::~Scrubber() {
    for (std::string& n : needles_) {
        OPENSSL_cleanse(n.data(), n.size());
    }
    OPENSSL_cleanse(tail_.data(), tail_.size());
}

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
    OPENSSL_cleanse(tail_.data(), tail_.size());
    ScanState st{covered_left_, run_pos_, 0};
    const size_t safe = scan(needles_, max_len_, out.data() + start, out.size() - start, false, st);
    covered_left_ = st.covered_left;
    run_pos_ = st.run_pos;
    replacements_ += st.replacements;
    // Hold back the unfinished bytes (shorter than the longest needle) and wipe them in out.
    char* held = out.data() + start + safe;
    const size_t held_len = out.size() - start - safe;
    tail_.assign(held, held_len);
    OPENSSL_cleanse(held, held_len);
    out.resize(start + safe);
}

void Scrubber::finish(std::string& out) {
    ScanState st{covered_left_, run_pos_, 0};
    scan(needles_, max_len_, tail_.data(), tail_.size(), true, st);
    replacements_ += st.replacements;
    out.append(tail_);
    OPENSSL_cleanse(tail_.data(), tail_.size());
    tail_.clear();
    covered_left_ = 0;
    run_pos_ = 0;
}

std::string Scrubber::scrub_value(std::string_view value) {
    std::string buf(value);
    if (!active()) {
        return buf;
    }
    ScanState st;
    scan(needles_, max_len_, buf.data(), buf.size(), true, st);
    replacements_ += st.replacements;
    return buf;
}

}  // namespace egress::policy
