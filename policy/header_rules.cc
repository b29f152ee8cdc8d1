#include "policy/header_rules.h"

#include <algorithm>
#include <array>
#include <string>
#include <vector>

namespace egress::policy {

namespace {

bool istarts_with(std::string_view s, std::string_view prefix) {
    return s.size() >= prefix.size() && iequals(s.substr(0, prefix.size()), prefix);
}

bool is_one_of(std::string_view name, std::initializer_list<std::string_view> names) {
    return std::any_of(names.begin(), names.end(),
                       [&](std::string_view n) { return iequals(name, n); });
}

// RFC 9110 tchar as a table: every field name of every request is checked byte by byte.
constexpr std::array<bool, 256> kTchar = [] {
    std::array<bool, 256> t{};
    for (int c = 0; c < 256; ++c) {
        t[static_cast<size_t>(c)] = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                                    (c >= '0' && c <= '9') ||
                                    std::string_view("!#$%&'*+-.^_`|~").find(static_cast<char>(c)) !=
                                        std::string_view::npos;
    }
    return t;
}();

bool is_tchar(char c) { return kTchar[static_cast<unsigned char>(c)]; }

// The values of every Connection header, joined with commas: the tokens they name. One string
// (no allocation for the usual "keep-alive" or "close"), split again where it is consulted.
std::string connection_values(const std::vector<Header>& headers) {
    std::string joined;
    for (const Header& h : headers) {
        if (iequals(h.name, "connection")) {
            if (!joined.empty()) {
                joined.push_back(',');
            }
            joined.append(h.value);
        }
    }
    return joined;
}

}  // namespace

bool named_in(std::string_view tokens, std::string_view name) {
    while (!tokens.empty()) {
        const size_t comma = tokens.find(',');
        if (iequals(trim_ows(tokens.substr(0, comma)), name)) {
            return true;
        }
        if (comma == std::string_view::npos) {
            break;
        }
        tokens.remove_prefix(comma + 1);
    }
    return false;
}

std::string_view trim_ows(std::string_view s) {
    while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) {
        s.remove_prefix(1);
    }
    while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) {
        s.remove_suffix(1);
    }
    return s;
}

bool is_hop_by_hop(std::string_view name) {
    // By length first: most fields of a request have a length no hop-by-hop name has, and
    // this runs for every field of every request. "proxy-connection" is under "proxy-".
    bool named = false;
    switch (name.size()) {
    case 2:
        named = iequals(name, "te");
        break;
    case 7:
        named = iequals(name, "trailer") || iequals(name, "upgrade");
        break;
    case 10:
        named = iequals(name, "connection") || iequals(name, "keep-alive");
        break;
    case 17:
        named = iequals(name, "transfer-encoding");
        break;
    default:
        break;
    }
    return named || istarts_with(name, "proxy-");  // any length: "proxy-x" has seven bytes
}

bool is_transport_header(std::string_view name) {
    return is_one_of(name, {"host", "content-length", "connection", "transfer-encoding", "te",
                            "upgrade", "keep-alive", "trailer"}) ||
           istarts_with(name, "proxy-") || istarts_with(name, ":") || is_egress_namespace(name);
}

bool is_egress_namespace(std::string_view name) {
    return istarts_with(name, "x-egress-");
}

size_t strip_egress_namespace(std::vector<Header>& headers) {
    return std::erase_if(headers, [](const Header& h) { return is_egress_namespace(h.name); });
}

bool valid_header_name(std::string_view name) {
    return !name.empty() && std::all_of(name.begin(), name.end(), is_tchar);
}

bool valid_header_value(std::string_view value) {
    return std::none_of(value.begin(), value.end(), [](char ch) {
        const auto c = static_cast<unsigned char>(ch);
        return (c < 0x20 && c != '\t') || c == 0x7f;
    });
}

bool asks_websocket(const std::vector<Header>& headers) {
    bool upgrade = false;
    for (const Header& h : headers) {
        if (iequals(h.name, "upgrade") && named_in(h.value, "websocket")) {
            upgrade = true;
        }
    }
    return upgrade && named_in(connection_values(headers), "upgrade");
}

namespace {

/// The tokens a Connection value names, for asking of each field whether it is one: a few
/// (the usual "keep-alive", "close, te") are looked for in the string; many are split once,
/// lowercased and sorted, so fields × tokens (64 KiB of head holds thousands of each) costs
/// a lookup per field, not a scan of every token.
class ConnectionTokens {
public:
    explicit ConnectionTokens(std::string joined) : joined_(std::move(joined)) {
        size_t n = joined_.empty() ? 0 : 1 + std::count(joined_.begin(), joined_.end(), ',');
        if (n <= kScanned) {
            return;
        }
        std::string_view rest = joined_;
        sorted_.reserve(n);
        while (!rest.empty()) {
            const size_t comma = rest.find(',');
            auto t = trim_ows(rest.substr(0, comma));
            if (!t.empty()) {
                sorted_.push_back(ascii_lower(t));
            }
            if (comma == std::string_view::npos) {
                break;
            }
            rest.remove_prefix(comma + 1);
        }
        std::sort(sorted_.begin(), sorted_.end());
        sorted_.erase(std::unique(sorted_.begin(), sorted_.end()), sorted_.end());
        split_ = true;
    }
    bool empty() const { return joined_.empty(); }
    bool names(std::string_view field) const {
        if (!split_) {
            return named_in(joined_, field);
        }
        return std::binary_search(sorted_.begin(), sorted_.end(), ascii_lower(field));
    }

private:
    static constexpr size_t kScanned = 8;
    std::string joined_;
    std::vector<std::string> sorted_;
    bool split_ = false;
};

}  // namespace

size_t strip_hop_by_hop(std::vector<Header>& headers, bool keep_te_trailers) {
    const ConnectionTokens tokens(connection_values(headers));
    const size_t before = headers.size();
    std::erase_if(headers, [&](const Header& h) {
        if (keep_te_trailers && iequals(h.name, "te") && iequals(trim_ows(h.value), "trailers")) {
            return false;
        }
        if (is_hop_by_hop(h.name)) {
            return true;
        }
        // Connection may name extra hop-by-hop headers, but never the message framing nor its
        // encoding: a "Connection: content-length" must not let the sandbox strip the body
        // length, nor a "Connection: content-encoding" let an upstream hide that its body is
        // gzip from the scrubber's check (the echoed credential inside would pass unseen).
        if (iequals(h.name, "content-length") || iequals(h.name, "content-encoding")) {
            return false;
        }
        return !tokens.empty() && tokens.names(h.name);
    });
    return before - headers.size();
}

}  // namespace egress::policy
