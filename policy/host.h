#pragma once
// Host names, authorities and host patterns. Pure logic, no I/O.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "common/result.h"

namespace egress::policy {

/// A destination: a normalized host and a port.
/// `host` is lowercase ASCII with no trailing dot: a DNS name of LDH labels, a canonical
/// dotted-quad IPv4 literal, or an IPv6 literal in inet_ntop form *without* brackets.
struct HostPort {
    std::string host;
    uint16_t port = 0;

    bool is_ipv6_literal() const { return host.find(':') != std::string::npos; }
    /// "host:port", with brackets around an IPv6 literal.
    std::string authority() const;
    /// The Host / :authority value egressd sends upstream (and aws-sigv4 signs): as
    /// authority(), the scheme's default port (443 with TLS, else 80) left out.
    std::string host_header(bool tls) const;
    bool operator==(const HostPort&) const = default;
};

/// Normalizes a host as sent by a client (CONNECT target, Host, :authority, SNI, URI host).
/// Lowercases, strips exactly one trailing dot, accepts "[v6]" or bare v6 literal (returned
/// without brackets, canonical). Refuses: empty, empty labels, labels > 63 or names > 253
/// bytes, bytes outside [a-z0-9-_] in names, labels starting or ending with '-', userinfo
/// ('@'), percent escapes, non-ASCII (IDN must arrive as punycode "xn--"), and ambiguous
/// numeric IPv4 forms ("2130706433", "0x7f.1", "127.1", "0177.0.0.1", leading zeros): a name
/// whose last label is all digits or hex-prefixed is treated as a numeric literal and must be
/// a canonical dotted quad.
Result<std::string> normalize_host(std::string_view host);

/// Parses "host", "host:port", "[v6]" or "[v6]:port". When the port is absent, uses
/// `default_port` or fails if there is none. Refuses port 0, ports > 65535, empty or
/// non-numeric ports, userinfo and everything normalize_host refuses.
Result<HostPort> parse_authority(std::string_view authority, std::optional<uint16_t> default_port);

/// Whether `authority` is `target` (normalized: as parse_authority returns it) spelled exactly
/// as this module writes it: "host:port", or "host" when the port is `default_port` (no
/// brackets: an IPv6 target never matches). Then
/// parse_authority(authority, default_port) == target (normalize_host is idempotent), so a
/// caller can skip the parse; false says nothing (the client may spell the same target
/// another way: upper case, a trailing dot, "[v6]"). The request path's fast path: nearly
/// every client sends the authority it connected to.
bool spells_target(std::string_view authority, const HostPort& target, uint16_t default_port);

/// A pattern naming allowed hosts: an exact name ("api.github.com"), or one leading wildcard
/// label ("*.s3.amazonaws.com", which matches exactly one extra label: "b.s3.amazonaws.com",
/// never "s3.amazonaws.com" nor "a.b.s3.amazonaws.com"), optionally with its own port
/// ("host:8443"). IP literals are allowed as exact patterns. "*", "*.com"-style patterns with
/// fewer than two labels after the wildcard, and wildcards anywhere but a whole first label
/// are refused at load.
class HostPattern {
public:
    /// OneLabel: allow lists and pins ("*.a.b" matches "x.a.b" only; "*.b" refused).
    /// Subtree: deny lists, where broader is safer ("*.b" allowed, and "*.a.b" matches
    /// "x.a.b" and "y.x.a.b" alike).
    enum class Scope : uint8_t { OneLabel, Subtree };
    static Result<HostPattern> parse(std::string_view text, Scope scope = Scope::OneLabel);

    /// `host` must already be normalized.
    bool matches_host(std::string_view host) const;
    /// Host matches and, if the pattern names a port, the port is equal.
    bool matches(const HostPort& hp) const;

    std::optional<uint16_t> port() const { return port_; }
    /// The exact host, or for a wildcard the parent after "*." (e.g. "s3.amazonaws.com").
    const std::string& host() const { return host_; }
    bool wildcard() const { return wildcard_; }
    /// The pattern as written after normalization, e.g. "*.a.test:8443".
    const std::string& text() const { return text_; }

private:
    std::string text_;
    std::string host_;  // exact host, or the suffix after "*." for a wildcard
    bool wildcard_ = false;
    bool subtree_ = false;  // Scope::Subtree
    std::optional<uint16_t> port_;
};

}  // namespace egress::policy
