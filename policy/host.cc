#include "policy/host.h"

#include <arpa/inet.h>

#include <algorithm>
#include <charconv>
#include <vector>

namespace egress::policy {

namespace {

constexpr size_t kMaxNameBytes = 253;
constexpr size_t kMaxLabelBytes = 63;

bool is_digit(char c) {
    return c >= '0' && c <= '9';
}

bool all_digits(std::string_view s) {
    if (s.empty()) {
        return false;
    }
    for (char c : s) {
        if (!is_digit(c)) {
            return false;
        }
    }
    return true;
}

bool name_char(char c) {
    return (c >= 'a' && c <= 'z') || is_digit(c) || c == '-' || c == '_';
}

// The label of a dotted name that begins at `start` (empty labels included, so they can be
// refused); `start` moves to the next label, npos after the last. Walks a name without a
// label vector: normalize_host runs on every request's authority.
std::string_view next_label(std::string_view name, size_t& start) {
    const size_t dot = name.find('.', start);
    const std::string_view label =
        name.substr(start, dot == std::string_view::npos ? std::string_view::npos : dot - start);
    start = dot == std::string_view::npos ? std::string_view::npos : dot + 1;
    return label;
}

// "a.b.c" → {"a", "b", "c"}.
std::vector<std::string_view> split_labels(std::string_view name) {
    std::vector<std::string_view> labels;
    labels.reserve(static_cast<size_t>(std::count(name.begin(), name.end(), '.')) + 1);
    for (size_t start = 0; start != std::string_view::npos;) {
        labels.push_back(next_label(name, start));
    }
    return labels;
}

Result<std::string> normalize_ipv6(std::string_view text) {
    const std::string copy(text);
    in6_addr addr{};
    if (inet_pton(AF_INET6, copy.c_str(), &addr) != 1) {
        return make_error("invalid IPv6 literal");
    }
    char buf[INET6_ADDRSTRLEN] = {};
    if (inet_ntop(AF_INET6, &addr, buf, sizeof(buf)) == nullptr) {
        return make_error("invalid IPv6 literal");
    }
    return std::string(buf);
}

// A name whose last label looks numeric must be a canonical dotted quad: exactly four
// decimal labels, no leading zeros, each at most 255.
bool canonical_dotted_quad(std::string_view name) {
    size_t labels = 0;
    for (size_t start = 0; start != std::string_view::npos; ++labels) {
        const std::string_view label = next_label(name, start);
        if (labels == 4 || !all_digits(label) || label.size() > 3 ||
            (label.size() > 1 && label[0] == '0')) {
            return false;
        }
        int v = 0;
        for (char c : label) {
            v = v * 10 + (c - '0');
        }
        if (v > 255) {
            return false;
        }
    }
    return labels == 4;
}

struct SplitAuthority {
    std::string_view host;
    std::optional<std::string_view> port;
};

// Splits "host", "host:port", "[v6]" or "[v6]:port". A bare IPv6 literal (several colons,
// no brackets) is refused: "1::2:443" is ambiguous.
Result<SplitAuthority> split_authority(std::string_view text) {
    if (text.empty()) {
        return make_error("empty authority");
    }
    if (text.find('@') != std::string_view::npos) {
        return make_error("userinfo is not allowed");
    }
    SplitAuthority out;
    if (text.front() == '[') {
        const size_t close = text.find(']');
        if (close == std::string_view::npos) {
            return make_error("unterminated IPv6 literal");
        }
        out.host = text.substr(0, close + 1);
        const std::string_view rest = text.substr(close + 1);
        if (!rest.empty()) {
            if (rest.front() != ':') {
                return make_error("junk after IPv6 literal");
            }
            out.port = rest.substr(1);
        }
        return out;
    }
    const size_t colon = text.find(':');
    if (colon == std::string_view::npos) {
        out.host = text;
        return out;
    }
    if (text.find(':', colon + 1) != std::string_view::npos) {
        return make_error("IPv6 literal needs brackets");
    }
    out.host = text.substr(0, colon);
    out.port = text.substr(colon + 1);
    return out;
}

Result<uint16_t> parse_port(std::string_view text) {
    if (text.empty()) {
        return make_error("empty port");
    }
    if (!all_digits(text) || text.size() > 5) {
        return make_error("invalid port");
    }
    uint32_t v = 0;
    for (char c : text) {
        v = v * 10 + static_cast<uint32_t>(c - '0');
    }
    if (v == 0 || v > 65535) {
        return make_error("port out of range");
    }
    return static_cast<uint16_t>(v);
}

std::string bracket(const std::string& host) {
    return host.find(':') != std::string::npos ? "[" + host + "]" : host;
}

}  // namespace

std::string HostPort::authority() const {
    return bracket(host) + ":" + std::to_string(port);
}

std::string HostPort::host_header(bool tls) const {
    return port == (tls ? 443 : 80) ? bracket(host) : authority();
}

Result<std::string> normalize_host(std::string_view host) {
    if (host.empty()) {
        return make_error("empty host");
    }
    for (char c : host) {
        if (static_cast<unsigned char>(c) >= 0x80) {
            return make_error("non-ASCII host (IDN must be punycode)");
        }
    }
    if (host.find('@') != std::string_view::npos) {
        return make_error("userinfo is not allowed");
    }
    if (host.find('%') != std::string_view::npos) {
        return make_error("percent escapes are not allowed");
    }
    if (host.front() == '[') {
        if (host.size() < 3 || host.back() != ']') {
            return make_error("invalid bracketed IPv6 literal");
        }
        return normalize_ipv6(host.substr(1, host.size() - 2));
    }
    if (host.find(':') != std::string_view::npos) {
        return normalize_ipv6(host);
    }
    std::string name(host);
    for (char& c : name) {
        if (c >= 'A' && c <= 'Z') {
            c = static_cast<char>(c - 'A' + 'a');
        }
    }
    if (name.back() == '.') {
        name.pop_back();
    }
    if (name.empty()) {
        return make_error("empty host");
    }
    if (name.size() > kMaxNameBytes) {
        return make_error("host name longer than 253 bytes");
    }
    std::string_view last;
    for (size_t start = 0; start != std::string_view::npos;) {
        const std::string_view label = next_label(name, start);
        last = label;
        if (label.empty()) {
            return make_error("empty label in host name");
        }
        if (label.size() > kMaxLabelBytes) {
            return make_error("label longer than 63 bytes");
        }
        for (char c : label) {
            if (!name_char(c)) {
                return make_error("invalid character in host name");
            }
        }
        if (label.front() == '-' || label.back() == '-') {
            return make_error("label starts or ends with '-'");
        }
    }
    if ((all_digits(last) || last.starts_with("0x")) && !canonical_dotted_quad(name)) {
        return make_error("ambiguous numeric host (only a canonical dotted quad is allowed)");
    }
    return name;
}

Result<HostPort> parse_authority(std::string_view authority, std::optional<uint16_t> default_port) {
    Result<SplitAuthority> split = split_authority(authority);
    if (!split) {
        return make_error(split.error());
    }
    Result<std::string> host = normalize_host(split->host);
    if (!host) {
        return make_error(host.error());
    }
    HostPort hp;
    hp.host = std::move(*host);
    if (split->port) {
        Result<uint16_t> port = parse_port(*split->port);
        if (!port) {
            return make_error(port.error());
        }
        hp.port = *port;
    } else if (default_port && *default_port != 0) {
        hp.port = *default_port;
    } else {
        return make_error("missing port");
    }
    return hp;
}

bool spells_target(std::string_view authority, const HostPort& target, uint16_t default_port) {
    if (target.host.empty() || !authority.starts_with(target.host) || target.is_ipv6_literal()) {
        return false;
    }
    std::string_view rest = authority.substr(target.host.size());
    if (rest.empty()) {
        return target.port == default_port;
    }
    char buf[8];
    buf[0] = ':';
    auto [end, ec] = std::to_chars(buf + 1, buf + sizeof buf, target.port);
    return ec == std::errc() && target.port != 0 && rest == std::string_view(buf, end);
}

Result<HostPattern> HostPattern::parse(std::string_view text, Scope scope) {
    Result<SplitAuthority> split = split_authority(text);
    if (!split) {
        return make_error("host pattern: " + split.error());
    }
    HostPattern p;
    std::string_view host = split->host;
    if (host.starts_with("*.")) {
        p.wildcard_ = true;
        host.remove_prefix(2);
    }
    Result<std::string> norm = normalize_host(host);
    if (!norm) {
        return make_error("host pattern: " + norm.error());
    }
    p.host_ = std::move(*norm);
    p.subtree_ = scope == Scope::Subtree;
    if (p.wildcard_) {
        // An allow pattern as broad as "*.com" would open a whole TLD; a deny pattern may be
        // ("*.internal").
        const size_t min_labels = p.subtree_ ? 1 : 2;
        if (p.host_.find(':') != std::string::npos || split_labels(p.host_).size() < min_labels) {
            return make_error(min_labels == 2
                                  ? "host pattern: a wildcard needs at least two labels after it"
                                  : "host pattern: a wildcard needs a label after it");
        }
        // A wildcard over a numeric host makes no sense ("*.1.2.3.4").
        const std::vector<std::string_view> labels = split_labels(p.host_);
        if (all_digits(labels.back())) {
            return make_error("host pattern: wildcard over an IP literal");
        }
    }
    if (split->port) {
        Result<uint16_t> port = parse_port(*split->port);
        if (!port) {
            return make_error("host pattern: " + port.error());
        }
        p.port_ = *port;
    }
    p.text_ = (p.wildcard_ ? "*." : "") + bracket(p.host_);
    if (p.port_) {
        p.text_ += ":" + std::to_string(*p.port_);
    }
    return p;
}

bool HostPattern::matches_host(std::string_view host) const {
    if (!wildcard_) {
        return host == host_;
    }
    // One extra, non-empty label in front of the suffix (Subtree: one or more).
    if (host.size() < host_.size() + 2 || !host.ends_with(host_)) {
        return false;
    }
    const std::string_view head = host.substr(0, host.size() - host_.size());
    if (head.back() != '.') {
        return false;
    }
    const std::string_view label = head.substr(0, head.size() - 1);
    return !label.empty() && (subtree_ || label.find('.') == std::string_view::npos);
}

bool HostPattern::matches(const HostPort& hp) const {
    return matches_host(hp.host) && (!port_ || *port_ == hp.port);
}

}  // namespace egress::policy
