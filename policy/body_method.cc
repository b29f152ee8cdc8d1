// A `_method` field in a POST's body: the method Rails, Laravel, Symfony, Spring and ASP.NET
// Core act on instead of the request line's, which a pin limited to methods must also allow
// (declared in policy/run_policy.h, beside match_pin's query and header overrides).
#include <algorithm>
#include <cctype>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <boost/json/basic_parser_impl.hpp>

#include "policy/header_rules.h"
#include "policy/request_head.h"
#include "policy/run_policy.h"

namespace egress::policy {

namespace {

/// What a content-type makes of a POST body for the servers above, as a set: a body is checked
/// as each kind some server may read it as.
enum BodyKind : unsigned { kNone = 0, kForm = 1, kMultipart = 2, kJson = 4 };

/// No content-type, or an empty one, is a form to Rack. The media type ends at ';', ',' or
/// whitespace (Rack cuts at ';' or ',', PHP also at a space). Laravel reads JSON when "/json"
/// or "+json" is anywhere in the field, so any "json" is checked as JSON; any "form" or
/// "multipart" elsewhere than in the media type is checked as both a form and multipart.
unsigned body_kind(const std::string* content_type) {
    if (content_type == nullptr || trim_ows(*content_type).empty()) {
        return kForm;
    }
    const std::string lower = ascii_lower(trim_ows(*content_type));
    const std::string type = lower.substr(0, lower.find_first_of(";, \t\r\n\v\f"));
    unsigned kind = kNone;
    if (type == "application/x-www-form-urlencoded" ||
        lower.find("urlencoded") != std::string::npos) {
        kind |= kForm;
    }
    if (type.starts_with("multipart/")) {
        kind |= kMultipart;
    } else if (lower.find("form") != std::string::npos ||
               lower.find("multipart") != std::string::npos) {
        kind |= kForm | kMultipart;
    }
    if (lower.find("json") != std::string::npos) {
        kind |= kJson;
    }
    return kind;
}

bool allows(const Pin& pin, std::string method) {
    std::transform(method.begin(), method.end(), method.begin(),
                   [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
    return std::find(pin.methods.begin(), pin.methods.end(), method) != pin.methods.end();
}

/// The parameters after a media type or disposition type ("; name=value; b=\"q\\\"\""):
/// lowercase names, values unquoted.
std::vector<std::pair<std::string, std::string>> parameters(std::string_view s) {
    std::vector<std::pair<std::string, std::string>> out;
    size_t i = s.find(';');
    while (i != std::string_view::npos && i < s.size()) {
        ++i;  // past ';'
        const size_t eq = s.find_first_of("=;", i);
        if (eq == std::string_view::npos || s[eq] == ';') {
            i = eq;
            continue;
        }
        std::string name = ascii_lower(trim_ows(s.substr(i, eq - i)));
        size_t j = eq + 1;
        while (j < s.size() && (s[j] == ' ' || s[j] == '\t')) {
            ++j;
        }
        std::string value;
        if (j < s.size() && s[j] == '"') {
            for (++j; j < s.size() && s[j] != '"'; ++j) {
                if (s[j] == '\\' && j + 1 < s.size()) {
                    ++j;
                }
                value.push_back(s[j]);
            }
            i = s.find(';', j);
        } else {
            const size_t end = s.find(';', j);
            value = std::string(trim_ows(s.substr(j, end == std::string_view::npos ? end : end - j)));
            i = end;
        }
        out.emplace_back(std::move(name), std::move(value));
    }
    return out;
}

constexpr size_t kMostBoundaries = 16;

/// Every boundary a server may split a multipart body under: for each "boundary" in the field
/// (any case, also inside a longer parameter name), the value after the first '=' that follows
/// it, as PHP takes it (up to ',' or ';', spaces kept, or up to the next '"'), trimmed, and
/// unquoted with escapes as parameters() reads it; with Rack's reading after the last
/// "boundary=" and each parameter whose name has "boundary". More than kMostBoundaries: refused.
std::vector<std::string> boundaries(std::string_view content_type) {
    std::vector<std::string> out;
    auto add = [&](std::string_view b) {
        if (!b.empty() && std::find(out.begin(), out.end(), b) == out.end()) {
            out.emplace_back(b);
        }
    };
    const std::string lower = ascii_lower(content_type);
    for (size_t at = lower.find("boundary"); at != std::string::npos;
         at = lower.find("boundary", at + 1)) {
        const size_t eq = content_type.find('=', at + 8);
        if (eq == std::string_view::npos) {
            break;
        }
        std::string_view raw = content_type.substr(eq + 1);
        std::string_view value = raw.substr(0, raw.find_first_of(",;"));
        add(value);
        add(trim_ows(value));
        const std::string_view ows = trim_ows(raw);
        if (ows.starts_with('"')) {
            add(ows.substr(1, ows.find('"', 1) == std::string_view::npos ? std::string_view::npos
                                                                         : ows.find('"', 1) - 1));
            std::string unquoted;  // with backslash escapes
            for (size_t j = 1; j < ows.size() && ows[j] != '"'; ++j) {
                if (ows[j] == '\\' && j + 1 < ows.size()) {
                    ++j;
                }
                unquoted.push_back(ows[j]);
            }
            add(unquoted);
        }
        // Rack: boundary="?([^";,]+)"? right after "boundary="
        if (raw.starts_with('"')) {
            raw.remove_prefix(1);
        }
        add(raw.substr(0, raw.find_first_of("\";,")));
    }
    for (const auto& [name, value] : parameters(content_type)) {
        if (name.find("boundary") != std::string::npos) {
            add(value);
        }
    }
    return out;
}

/// Lowercase, backslashes removed and %XX decoded: where "method" is looked for in a part's header
/// block that is not read precisely (part_matches).
std::string loose_form(std::string_view s) {
    std::string out;
    out.reserve(s.size());
    for (size_t i = 0; i < s.size(); ++i) {
        if (s[i] == '\\') {
            continue;
        }
        if (s[i] == '%' && i + 2 < s.size() && std::isxdigit(static_cast<unsigned char>(s[i + 1])) &&
            std::isxdigit(static_cast<unsigned char>(s[i + 2]))) {
            out.push_back(static_cast<char>(std::stoi(std::string(s.substr(i + 1, 2)), nullptr, 16)));
            i += 2;
            continue;
        }
        out.push_back(s[i]);
    }
    return ascii_lower(out);
}

/// A form's charset, where one is named, is one in which "_method=" is its ASCII bytes (ASP.NET
/// Core decodes a form in the charset it names: "_method=DELETE" in UTF-16 holds neither).
bool ascii_compatible_charset(const std::string& content_type) {
    for (const auto& [name, value] : parameters(content_type)) {
        if (name != "charset") {
            continue;
        }
        const std::string c = ascii_lower(trim_ows(value));
        const bool ok = c == "utf-8" || c == "utf8" || c == "us-ascii" || c == "ascii" ||
                        c.starts_with("iso-8859-") || c.starts_with("iso8859-") ||
                        c.starts_with("latin") || c.starts_with("windows-125") ||
                        c.starts_with("cp125");
        if (!ok) {
            return false;
        }
    }
    return true;
}

/// Whether `s` holds a character some server reads differently from egressd's
/// parameters(): a single quote (PHP quotes with it), a backslash, or an encoded word ("=?",
/// ASP.NET Core and Tomcat decode it).
bool odd_text(std::string_view s) {
    return s.find_first_of("'\\") != std::string_view::npos ||
           s.find("=?") != std::string_view::npos;
}

/// Whether `s` holds a control byte other than a tab: Tomcat trims every byte Java's
/// Character.isWhitespace takes (\v, \f, 0x1C-0x1F) around parameter names and values, where
/// egressd trims spaces and tabs ("name=\v_method" is _method to Spring).
bool has_control(std::string_view s) {
    return std::any_of(s.begin(), s.end(), [](char c) {
        const auto u = static_cast<unsigned char>(c);
        return (u < 0x20 && u != '\t') || u == 0x7f;
    });
}

/// Whether a field's value names another field a regex could take for a part's name (Rack 2
/// finds "Content-Disposition: ... name=" and "Content-ID:" anywhere in the header block).
bool names_a_field(std::string_view value) {
    const std::string loose = loose_form(value);
    return loose.find("content-") != std::string::npos ||
           loose.find("method") != std::string::npos;
}

/// A field a plain part may have besides Content-Disposition and Content-Type, as common
/// clients send it: Content-Length (OkHttp) with digits only, Content-Transfer-Encoding
/// (Apache httpmime) with one token.
bool plain_extra_field(std::string_view name, std::string_view value) {
    const std::string_view v = trim_ows(value);
    if (iequals(name, "content-length")) {
        return !v.empty() && v.find_first_not_of("0123456789") == std::string_view::npos;
    }
    if (iequals(name, "content-transfer-encoding")) {
        return !v.empty() &&
               std::all_of(v.begin(), v.end(), [](char c) {
                   return std::isalnum(static_cast<unsigned char>(c)) || c == '-';
               });
    }
    return false;
}

/// One part: its header block (every line with its line break) and its content. The name is
/// read from Content-Disposition's name or name* parameter (folded lines unfolded, as PHP and
/// Rack 3 read them; an unquoted value also up to whitespace, as PHP) and from a Content-ID
/// field (Rack takes it when there is no Content-Disposition name). Servers read part headers
/// in more ways than this (Rack 2's unanchored regexes, PHP's single quotes, encoded words in
/// ASP.NET Core and Tomcat, RFC 2231 values in any charset in Tomcat), so a block that is not
/// the plain form clients send (lines ending in CRLF, only Content-Disposition and
/// Content-Type fields, and a digits-only Content-Length or a one-token
/// Content-Transfer-Encoding, one Content-Disposition with at most one name, which the
/// parameters read where a regex would, no folding, no control byte but tab, no Content-Type
/// naming a field or "method", and no quote, backslash or encoded word outside a file name) and that holds "method" (any case, %-decoded) or an encoded word must have
/// content the pin allows, whatever its name reads as. File names are left out of the plain
/// test (.NET's HttpClient sends filename* and encoded words there, which no server reads as
/// a name); they still count for "method".
bool part_matches(const Pin& pin, std::string_view headers, std::string_view content) {
    auto content_allowed = [&] { return allows(pin, std::string(content)); };
    bool plain = true;
    size_t dispositions = 0;
    std::vector<std::string> fields;  // unfolded
    for (size_t line = 0; line < headers.size();) {
        size_t end = headers.find('\n', line);
        end = end == std::string_view::npos ? headers.size() : end;
        std::string_view field = headers.substr(line, end - line);
        if (field.ends_with('\r')) {
            field.remove_suffix(1);
        } else {
            plain = false;  // a bare LF
        }
        if (!field.empty() && (field.front() == ' ' || field.front() == '\t')) {
            plain = false;  // a folded line: part of the field before it
            if (!fields.empty()) {
                fields.back() += field;
            }
        } else if (!field.empty()) {
            fields.emplace_back(field);
        }
        line = end + 1;
    }
    for (const std::string& f : fields) {
        const size_t colon = f.find(':');
        if (colon == std::string::npos) {
            plain = false;
            continue;
        }
        const std::string_view name = trim_ows(std::string_view(f).substr(0, colon));
        const std::string_view rest = std::string_view(f).substr(colon + 1);
        if (has_control(f)) {
            plain = false;
        }
        if (iequals(name, "content-disposition")) {
            ++dispositions;
            // Rack 2 takes the last " name=" of the line wherever it stands (also past a
            // quoted value without ';', or before the first ';'): the names a regex would
            // see must be the ones the parameters read.
            size_t seen = 0;
            const std::string loose = loose_form(rest);
            for (size_t n = loose.find("name"); n != std::string::npos;
                 n = loose.find("name", n + 1)) {
                const bool word_start =
                    n == 0 || !(std::isalnum(static_cast<unsigned char>(loose[n - 1])) ||
                                loose[n - 1] == '_' || loose[n - 1] == '-');
                const size_t after = loose.find_first_not_of(" \t", n + 4);
                if (word_start && after != std::string::npos &&
                    (loose[after] == '=' || loose[after] == '*')) {
                    ++seen;
                }
            }
            size_t read = 0;
            if (odd_text(rest.substr(0, rest.find(';')))) {
                plain = false;
            }
            for (const auto& [param, v] : parameters(rest)) {
                if (param == "filename" || param == "filename*") {
                    continue;
                }
                if (odd_text(v) && param != "name*") {
                    plain = false;
                }
                if (param != "name" && param != "name*") {
                    continue;
                }
                ++read;
                // PHP ends an unquoted value at whitespace ("name=_method x")
                const std::string_view word =
                    std::string_view(v).substr(0, v.find_first_of(" \t"));
                if ((key_names_method(v) || key_names_method(word)) && !content_allowed()) {
                    return false;
                }
                if (param == "name*") {
                    // RFC 2231: charset'language'%XX. Tomcat decodes it in any charset (a
                    // UTF-16 "_method" holds no "method" to find): only an ASCII one is plain.
                    const std::string charset = v.substr(0, v.find('\''));
                    if (!ascii_compatible_charset("x; charset=" + charset)) {
                        return content_allowed();
                    }
                    plain = false;
                }
            }
            if (seen != read || read > 1) {
                plain = false;
            }
        } else if (iequals(name, "content-id")) {
            plain = false;
            if (key_names_method(trim_ows(rest)) && !content_allowed()) {
                return false;
            }
        } else if (iequals(name, "content-type")) {
            if (odd_text(rest) || names_a_field(rest)) {
                plain = false;  // "text/plain; x=Content-ID:_method" is a name to Rack 2
            }
        } else if (!plain_extra_field(name, rest)) {
            plain = false;  // any other field (Rack 2 reads "Content-ID:" inside "X-Content-ID:")
        }
    }
    plain = plain && dispositions <= 1;
    if (!plain && (loose_form(headers).find("method") != std::string::npos ||
                   headers.find("=?") != std::string_view::npos)) {
        return content_allowed();
    }
    return true;
}

/// The parts of `body` under `boundary` named `_method` name only methods the pin allows.
/// Delimiter lines may end in CRLF or LF (servers differ); a body without one has no parts. A
/// part's header block ends at its first blank line (LF LF or LF CRLF, as PHP reads it) and
/// also, when that differs, at CRLFCRLF (as Rack reads it): both readings are checked.
bool multipart_matches(const Pin& pin, std::string_view body, std::string_view boundary) {
    if (boundary.empty()) {
        return true;
    }
    const std::string delimiter = "--" + std::string(boundary);
    // Where the delimiter starts a line at or after `from`, or npos.
    auto next_delimiter = [&](size_t from) {
        for (size_t at = body.find(delimiter, from); at != std::string_view::npos;
             at = body.find(delimiter, at + 1)) {
            if (at == 0 || body[at - 1] == '\n') {
                return at;
            }
        }
        return std::string_view::npos;
    };
    size_t at = next_delimiter(0);
    while (at != std::string_view::npos) {
        const size_t after = at + delimiter.size();
        if (body.substr(after, 2) == "--") {
            break;  // the close delimiter
        }
        const size_t line_end = body.find('\n', after);
        if (line_end == std::string_view::npos) {
            break;
        }
        const size_t headers_at = line_end + 1;
        const size_t next = next_delimiter(headers_at);
        // One reading of the part: its headers end at `blank` (the blank line's first byte,
        // after the last header's line break), its content starts at `content_at`.
        auto reading_matches = [&](size_t blank, size_t content_at) {
            if (blank == std::string_view::npos ||
                (next != std::string_view::npos && content_at > next)) {
                // No blank line before the next delimiter: PHP and Rack read the headers on
                // past it (PHP takes a "--B" line into the field before it), with content
                // this walk does not see. Refused when they mention a method.
                const std::string_view region = body.substr(
                    headers_at,
                    next == std::string_view::npos ? std::string_view::npos : next - headers_at);
                return loose_form(region).find("method") == std::string::npos &&
                       region.find("=?") == std::string_view::npos;
            }
            std::string_view content = body.substr(
                content_at,
                next == std::string_view::npos ? std::string_view::npos : next - content_at);
            if (next != std::string_view::npos) {  // the line break before the delimiter
                if (content.ends_with('\n')) {
                    content.remove_suffix(1);
                }
                if (content.ends_with('\r')) {
                    content.remove_suffix(1);
                }
            }
            return part_matches(pin, body.substr(headers_at, blank - headers_at), content);
        };
        // Searched only up to the next delimiter: a blank line past it is not this part's,
        // and a search to the end of the body for each part made a body of many parts
        // without blank lines cost (parts x body size).
        const std::string_view upto =
            body.substr(0, next == std::string_view::npos ? body.size() : next);
        // PHP: the first line that is empty (LF LF, or LF CR LF).
        size_t php_blank = std::string_view::npos;
        size_t php_content = 0;
        const size_t crlf_blank = upto.find("\n\r\n", line_end);
        const size_t lf_blank = upto.find("\n\n", line_end);
        if (crlf_blank != std::string_view::npos &&
            (lf_blank == std::string_view::npos || crlf_blank < lf_blank)) {
            php_blank = crlf_blank + 1;
            php_content = crlf_blank + 3;
        } else if (lf_blank != std::string_view::npos) {
            php_blank = lf_blank + 1;
            php_content = lf_blank + 2;
        }
        if (!reading_matches(php_blank, php_content)) {
            return false;
        }
        // Rack: CRLFCRLF (the delimiter line's own CRLF may be its first half).
        const size_t rack = upto.find("\r\n\r\n", line_end > 0 ? line_end - 1 : 0);
        const size_t rack_blank = rack == std::string_view::npos ? rack : rack + 2;
        if (rack_blank != php_blank &&
            !reading_matches(rack_blank, rack == std::string_view::npos ? 0 : rack + 4)) {
            return false;
        }
        at = next;
    }
    return true;
}

/// Every top-level "_method" of a JSON object, seen by a SAX parser: each duplicate key (a
/// server may keep the first or the last) and with no tree built (a deep document costs no
/// recursion). Non-string values are recorded as what allows nothing.
struct JsonMethods {
    static constexpr std::size_t max_array_size = -1;
    static constexpr std::size_t max_object_size = -1;
    static constexpr std::size_t max_string_size = -1;
    static constexpr std::size_t max_key_size = -1;
    static constexpr size_t kLongest = 64;  // longer than any method a pin names

    size_t depth = 0;
    std::string key;          // the top-level key being read (first kLongest bytes)
    bool key_is_method = false;  // the value that follows belongs to "_method"
    std::string value;
    std::vector<std::string> methods;  // what each "_method" names ("" for a non-string)

    using error_code = boost::json::error_code;
    using string_view = boost::json::string_view;
    void scalar() {
        if (depth == 1 && key_is_method) {
            methods.emplace_back();
        }
        key_is_method = false;
    }
    bool on_document_begin(error_code&) { return true; }
    bool on_document_end(error_code&) { return true; }
    bool on_array_begin(error_code&) {
        scalar();
        ++depth;
        return true;
    }
    bool on_array_end(std::size_t, error_code&) {
        --depth;
        return true;
    }
    bool on_object_begin(error_code&) {
        scalar();
        ++depth;
        return true;
    }
    bool on_object_end(std::size_t, error_code&) {
        --depth;
        return true;
    }
    bool on_string_part(string_view s, std::size_t, error_code&) {
        if (depth == 1 && key_is_method && value.size() <= kLongest) {
            value.append(s.data(), std::min(s.size(), kLongest + 1 - value.size()));
        }
        return true;
    }
    bool on_string(string_view s, std::size_t n, error_code& ec) {
        on_string_part(s, n, ec);
        if (depth == 1 && key_is_method) {
            methods.push_back(value.size() <= kLongest ? value : std::string());
        }
        value.clear();
        key_is_method = false;
        return true;
    }
    bool on_key_part(string_view s, std::size_t, error_code&) {
        if (depth == 1 && key.size() <= kLongest) {
            key.append(s.data(), std::min(s.size(), kLongest + 1 - key.size()));
        }
        return true;
    }
    bool on_key(string_view s, std::size_t n, error_code& ec) {
        on_key_part(s, n, ec);
        key_is_method = depth == 1 && key == "_method";
        key.clear();
        return true;
    }
    bool on_number_part(string_view, error_code&) { return true; }
    bool on_int64(int64_t, string_view, error_code&) { return scalar(), true; }
    bool on_uint64(uint64_t, string_view, error_code&) { return scalar(), true; }
    bool on_double(double, string_view, error_code&) { return scalar(), true; }
    bool on_bool(bool, error_code&) { return scalar(), true; }
    bool on_null(error_code&) { return scalar(), true; }
    bool on_comment_part(string_view, error_code&) { return true; }
    bool on_comment(string_view, error_code&) { return true; }
};

/// A JSON body's top-level "_method" keys name only methods the pin allows. Parsed more
/// leniently than the servers do (comments, trailing commas, invalid UTF-8, any depth), so
/// what they read is read here too. A body that still does not parse may parse for a server
/// (PHP's json_decode takes 1e9999999999 as INF, where Boost fails): it is refused when it
/// holds "method" (any case) or a \u escape, and carries no field otherwise.
bool json_matches(const Pin& pin, std::string_view body) {
    boost::json::parse_options opt;
    opt.max_depth = static_cast<std::size_t>(-1);
    opt.allow_comments = true;
    opt.allow_trailing_commas = true;
    opt.allow_invalid_utf8 = true;
    boost::json::basic_parser<JsonMethods> parser(opt);
    boost::json::error_code ec;
    parser.write_some(false, body.data(), body.size(), ec);
    if (ec) {
        return ascii_lower(body).find("method") == std::string::npos &&
               body.find("\\u") == std::string_view::npos &&
               body.find("\\U") == std::string_view::npos;
    }
    return std::all_of(parser.handler().methods.begin(), parser.handler().methods.end(),
                       [&](const std::string& m) { return !m.empty() && allows(pin, m); });
}

/// The Content-Type fields as servers read them: each one, and when there are several, their
/// join with ", " (Apache, which PHP sees, and Puma, which Rails sees, merge them).
std::vector<std::string> content_types(const RequestHead& head) {
    std::vector<std::string> out;
    for (const Header& h : head.headers) {
        if (iequals(h.name, "content-type")) {
            out.push_back(h.value);
        }
    }
    if (out.size() > 1) {
        std::string joined;
        for (const std::string& t : out) {
            joined += joined.empty() ? t : ", " + t;
        }
        out.push_back(std::move(joined));
    }
    return out;
}

}  // namespace

bool body_may_override_method(const Pin& pin, const RequestHead& head) {
    if (pin.methods.empty() || head.method != "POST") {
        return false;
    }
    const std::vector<std::string> types = content_types(head);
    if (types.empty()) {
        return body_kind(nullptr) != kNone;
    }
    return std::any_of(types.begin(), types.end(),
                       [](const std::string& t) { return body_kind(&t) != kNone; });
}

bool body_method_matches(const Pin& pin, const RequestHead& head, std::string_view body) {
    auto matches = [&](const std::string* content_type) {
        const unsigned kind = body_kind(content_type);
        if ((kind & kForm) != 0 && (!form_method_matches(pin, body) ||
                                    (content_type != nullptr &&
                                     !ascii_compatible_charset(*content_type)))) {
            return false;  // a form in another charset is refused rather than decoded
        }
        if ((kind & kJson) != 0 && !json_matches(pin, body)) {
            return false;
        }
        if ((kind & kMultipart) != 0) {
            const std::vector<std::string> each = boundaries(*content_type);
            if (each.size() > kMostBoundaries) {
                return false;  // each is a pass over the body: refused rather than read
            }
            for (const std::string& boundary : each) {
                if (!multipart_matches(pin, body, boundary)) {
                    return false;
                }
            }
        }
        return true;
    };
    const std::vector<std::string> types = content_types(head);
    if (types.empty()) {
        return matches(nullptr);
    }
    return std::all_of(types.begin(), types.end(), [&](const std::string& t) { return matches(&t); });
}

}  // namespace egress::policy
