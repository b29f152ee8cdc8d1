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
size_t scan(const std::vector<std::string>& needles, size_t max_len, std::string& buf, bool final,
            ScanState& st) {
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
    const size_t size = buf.size();
    for (size_t i = 0; i < size; ++i) {
        if (st.covered_left == 0) {
            // Outside a match, jump to the next byte that can start a needle (memchr is
            // vectorised; a body rarely holds one).
            size_t next = size;
            for (size_t k = 0; k < n_firsts; ++k) {
                if (const void* p = std::memchr(buf.data() + i, firsts[k], next - i)) {
                    next = static_cast<size_t>(static_cast<const char*>(p) - buf.data());
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
                if (n.size() > left && std::memcmp(n.data(), buf.data() + i, left) == 0) {
                    return i;  // a longer needle may still complete here
                }
            }
        }
        if (candidate) {
            for (const std::string& n : needles) {  // longest first
                if (n.size() <= left && std::memcmp(n.data(), buf.data() + i, n.size()) == 0) {
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

void Scrubber::scrub_in_place(std::string& buf, size_t& safe_len) {
    ScanState st{covered_left_, run_pos_, 0};
    safe_len = scan(needles_, max_len_, buf, false, st);
    covered_left_ = st.covered_left;
    run_pos_ = st.run_pos;
    replacements_ += st.replacements;
}

void Scrubber::feed(std::string_view in, std::string& out) {
    if (!active()) {
        out.append(in);
        return;
    }
    tail_.append(in);
    size_t safe = 0;
    scrub_in_place(tail_, safe);
    out.append(tail_, 0, safe);
    // Keep the unfinished bytes at the front and wipe where they were.
    const size_t held = tail_.size() - safe;
    std::memmove(tail_.data(), tail_.data() + safe, held);
    OPENSSL_cleanse(tail_.data() + held, tail_.size() - held);
    tail_.resize(held);
}

void Scrubber::finish(std::string& out) {
    ScanState st{covered_left_, run_pos_, 0};
    scan(needles_, max_len_, tail_, true, st);
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
    scan(needles_, max_len_, buf, true, st);
    replacements_ += st.replacements;
    return buf;
}

}  // namespace egress::policy
