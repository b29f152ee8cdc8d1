#pragma once
// JSON text written by hand: the audit record and JSON log lines (egressd) and the secret
// upload body (egressctl, built in a buffer it wipes). One UTF-8 rule and one escaper for all
// of them. Light: the standard library only.
#include <cstddef>
#include <string>
#include <string_view>

#include "common/hex.h"

namespace egress {

/// Length of the well-formed UTF-8 sequence starting at v[i] (RFC 3629: no overlong forms,
/// no surrogates, nothing above U+10FFFF), or 0.
inline size_t utf8_sequence(std::string_view v, size_t i) {
    auto at = [&](size_t k) { return static_cast<unsigned char>(v[k]); };
    const unsigned c = at(i);
    size_t n = 0;
    unsigned lo = 0x80;
    unsigned hi = 0xbf;
    if (c >= 0xc2 && c <= 0xdf) {
        n = 2;
    } else if (c >= 0xe0 && c <= 0xef) {
        n = 3;
        lo = c == 0xe0 ? 0xa0 : lo;
        hi = c == 0xed ? 0x9f : hi;
    } else if (c >= 0xf0 && c <= 0xf4) {
        n = 4;
        lo = c == 0xf0 ? 0x90 : lo;
        hi = c == 0xf4 ? 0x8f : hi;
    } else {
        return 0;
    }
    if (i + n > v.size() || at(i + 1) < lo || at(i + 1) > hi) {
        return 0;
    }
    for (size_t k = 2; k < n; ++k) {
        if (at(i + k) < 0x80 || at(i + k) > 0xbf) {
            return 0;
        }
    }
    return n;
}

/// `v` is well-formed UTF-8 (what a strict JSON parser such as boost::json accepts).
inline bool valid_utf8(std::string_view v) {
    for (size_t i = 0; i < v.size();) {
        if (static_cast<unsigned char>(v[i]) < 0x80) {
            ++i;
        } else if (const size_t n = utf8_sequence(v, i)) {
            i += n;
        } else {
            return false;
        }
    }
    return true;
}

/// Appends `v` as valid UTF-8: `ascii(c)` writes each byte below 0x80, well-formed sequences
/// go as they are, any other byte from 0x80 up becomes the character U+0080..U+00FF (its
/// Latin-1 reading), so a raw byte of a request target never makes a line that strict
/// readers reject. `Out` is std::string or any sink with push_back(char) and
/// append(std::string_view) (the audit writer's pre-sized cursor).
template <class Out, class Ascii>
void append_utf8(Out& out, std::string_view v, Ascii ascii) {
    for (size_t i = 0; i < v.size();) {
        const auto c = static_cast<unsigned char>(v[i]);
        if (c < 0x80) {
            ascii(static_cast<char>(c));
            ++i;
        } else if (const size_t n = utf8_sequence(v, i)) {
            out.append(v.substr(i, n));
            i += n;
        } else {
            out.push_back(static_cast<char>(0xc0 | (c >> 6)));
            out.push_back(static_cast<char>(0x80 | (c & 0x3f)));
            ++i;
        }
    }
}

/// The same with ASCII as it is (for text that a JSON library escapes afterwards).
inline void append_utf8_or_latin1(std::string& out, std::string_view v) {
    append_utf8(out, v, [&](char ch) { out.push_back(ch); });
}

/// Appends `v` as a JSON string literal (RFC 8259: quote, backslash and control characters
/// escaped) in valid UTF-8. No temporaries: every byte goes straight into `out`, which the
/// caller may wipe. At most 6 * v.size() + 2 bytes ("\u00XX" for a control character).
template <class Out>
void append_json_string(Out& out, std::string_view v) {
    out.push_back('"');
    append_utf8(out, v, [&](char ch) {
        const auto c = static_cast<unsigned char>(ch);
        if (c == '"' || c == '\\') {
            out.push_back('\\');
            out.push_back(ch);
        } else if (c < 0x20) {
            out.append(std::string_view("\\u00"));
            append_hex(out, &c, 1);
        } else {
            out.push_back(ch);
        }
    });
    out.push_back('"');
}

}  // namespace egress
