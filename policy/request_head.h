#pragma once
// The protocol-neutral request head. The HTTP/1.1 codec (Beast) and the HTTP/2 codec
// (nghttp2) both produce it; the pipeline runs on it once; dumb serializers write it out.
#include <string>
#include <string_view>
#include <vector>

namespace egress::policy {

struct Header {
    std::string name;  // lowercase
    std::string value;
};

/// Room the codecs reserve for a head's fields up front: most requests and responses carry
/// fewer, so the vector is allocated once instead of growing 1, 2, 4, 8, 16.
inline constexpr size_t kTypicalHeaderFields = 16;

struct RequestHead {
    std::string method;     // as sent, e.g. "GET"
    std::string scheme;     // "https" or "http"
    std::string authority;  // Host / :authority exactly as the client sent it ("" if absent)
    std::string path;       // origin-form: "/a/b?q=1"
    std::vector<Header> headers;  // in order, lowercase names; never contains "host"
    /// The field whose value is the injected credential (set by the pipeline), "" if none.
    /// An HTTP/2 encoder sends it never-indexed (RFC 7541 7.1.3): in a pooled connection's
    /// HPACK table it would be a target for compression-length probing by the sandbox's own
    /// requests. nghttp2 does so by itself only for "authorization" and short cookies.
    std::string never_index;
    /// A second such field, "" if none: aws-sigv4's x-amz-security-token (a session token is
    /// a credential too) beside its authorization.
    std::string never_index_also;
    /// Whether `name` (lowercase) is one of those fields.
    bool never_indexed(std::string_view name) const {
        return (!never_index.empty() && name == never_index) ||
               (!never_index_also.empty() && name == never_index_also);
    }
    /// "websocket" when an HTTP/1.1 client asked to switch this request's connection to a
    /// WebSocket (RFC 6455 4.1: GET, no body, "Upgrade: websocket", "Connection: upgrade");
    /// "" otherwise. Upgrade and Connection are hop-by-hop and never in `headers`: the HTTP/1.1
    /// upstream serializer writes them again from this. Other protocols (h2c...) are not
    /// offered upstream: their Upgrade is dropped with the other hop-by-hop fields.
    std::string upgrade;

    /// First value for `name` (lowercase), or nullptr.
    const std::string* find(std::string_view name) const;
    size_t count(std::string_view name) const;
    /// Removes every header named `name`; returns how many were removed.
    size_t remove(std::string_view name);
    /// Removes every `name` header, then appends one with `value`.
    void set(std::string_view name, std::string value);
    /// Path without the query string.
    std::string_view path_only() const;
    /// Overwrites the values of the injected credential fields (never_indexed) with zeros, in
    /// place: the request is done and this copy of the secret is not left in freed memory.
    void wipe_injected();
};

/// First value of the header `name` (compared case-insensitively) in `headers`, or nullptr.
const std::string* find_header(const std::vector<Header>& headers, std::string_view name);

/// Lowercases ASCII in place and returns it.
std::string ascii_lower(std::string_view s);

/// ASCII case-insensitive equality. Inline: header rules call it for every field against
/// every name they know, and most calls end at the length check.
inline bool iequals(std::string_view a, std::string_view b) {
    if (a.size() != b.size()) {
        return false;
    }
    for (size_t i = 0; i < a.size(); ++i) {
        char x = a[i];
        char y = b[i];
        x = (x >= 'A' && x <= 'Z') ? static_cast<char>(x - 'A' + 'a') : x;
        y = (y >= 'A' && y <= 'Z') ? static_cast<char>(y - 'A' + 'a') : y;
        if (x != y) {
            return false;
        }
    }
    return true;
}

}  // namespace egress::policy
