#pragma once
// Text written into memory its caller sized: the string is grown once to an upper bound of
// what will be written, the writer stores through a pointer, and the string is cut back to
// what was written. For the per-request lines and heads (the audit record, HTTP/1.1 heads):
// through std::string's append each piece cost a capacity check and an out-of-line copy
// (~6k instructions for the audit line alone; bench/RESULTS.md). Light: the standard library only.
#include <cstddef>
#include <cstring>
#include <string>
#include <string_view>

namespace egress {

/// A write position in sized memory. Also a sink for common/json_text.h's escaper.
struct TextCursor {
    char* p;
    void push_back(char c) { *p++ = c; }
    void append(std::string_view s) {
        if (!s.empty()) {
            std::memcpy(p, s.data(), s.size());
            p += s.size();
        }
    }
    template <size_t N>
    void lit(const char (&s)[N]) {  // a literal: its length is known, the copy is inlined
        std::memcpy(p, s, N - 1);
        p += N - 1;
    }
};

/// Appends to `out` what `write(TextCursor&)` writes, which must be at most `bound` bytes.
template <class Write>
void append_bounded(std::string& out, size_t bound, Write&& write) {
    const size_t start = out.size();
    out.resize(start + bound);
    TextCursor c{out.data() + start};
    write(c);
    out.resize(static_cast<size_t>(c.p - out.data()));
}

}  // namespace egress
