#include "policy/run_policy.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <algorithm>
#include <cctype>

#include <boost/url/encode.hpp>
#include <boost/url/encoding_opts.hpp>
#include <boost/url/grammar/alnum_chars.hpp>
#include <boost/url/grammar/lut_chars.hpp>
#include <boost/url/parse_query.hpp>
#include <boost/url/pct_string_view.hpp>
#include <boost/url/rfc/unreserved_chars.hpp>

#include "common/base64.h"
#include "common/hex.h"
#include "common/secure_zero.h"
#include "policy/aws_sigv4.h"
#include "policy/header_rules.h"
#include "policy/request_head.h"

namespace egress::policy {

namespace {

constexpr std::string_view kSecretPlaceholder = "{secret}";

bool has_ctl(std::string_view s) {
    return std::any_of(s.begin(), s.end(), [](char ch) {
        const auto c = static_cast<unsigned char>(ch);
        return c < 0x20 || c == 0x7f;
    });
}

size_t count_occurrences(std::string_view s, std::string_view needle) {
    size_t n = 0;
    for (size_t pos = s.find(needle); pos != std::string_view::npos;
         pos = s.find(needle, pos + needle.size())) {
        ++n;
    }
    return n;
}

bool run_live(const RunPolicy& run, TimePoint now) {
    return !run.revoked && now < run.expires_at;
}

bool pin_live(const Pin& pin, TimePoint now) {
    return now < pin.expires_at;
}

// A path that could climb out of a prefix once the upstream normalizes it.
bool dangerous_path(std::string_view path) {
    if (path.empty() || path.front() != '/') {
        return true;
    }
    for (char ch : path) {
        const auto c = static_cast<unsigned char>(ch);
        // '#' has no place in a request target, and a server that takes it for a fragment
        // cuts the path there: nginx resolves "/repos/acme/..#" to "/repos/".
        if (ch == '\\' || ch == '#' || c < 0x20 || c == 0x7f) {
            return true;
        }
    }
    const std::string lower = ascii_lower(path);
    if (lower.find("%2e") != std::string::npos || lower.find("%2f") != std::string::npos ||
        lower.find("%5c") != std::string::npos) {
        return true;
    }
    // Dot segments, also with a path parameter ("..;/" is ".." to some servers).
    size_t start = 1;
    while (start <= path.size()) {
        size_t end = path.find('/', start);
        if (end == std::string_view::npos) {
            end = path.size();
        }
        std::string_view segment = path.substr(start, end - start);
        segment = segment.substr(0, segment.find(';'));
        if (segment == "." || segment == "..") {
            return true;
        }
        start = end + 1;
    }
    return false;
}

bool path_matches(const Pin& pin, std::string_view path) {
    if (pin.path_prefixes.empty()) {
        return true;
    }
    if (dangerous_path(path)) {
        return false;
    }
    // Whole segments: "/repos/acme" grants "/repos/acme" and "/repos/acme/x", never
    // "/repos/acme-evil" (a prefix ending in '/' already says where its segment ends).
    return std::any_of(pin.path_prefixes.begin(), pin.path_prefixes.end(),
                       [&](const std::string& prefix) {
                           return path.starts_with(prefix) &&
                                  (path.size() == prefix.size() || prefix.ends_with('/') ||
                                   path[prefix.size()] == '/');
                       });
}

bool method_matches(const Pin& pin, std::string_view method) {
    return pin.methods.empty() ||
           std::find(pin.methods.begin(), pin.methods.end(), method) != pin.methods.end();
}

/// Headers by which some servers take the method (Google APIs, Express's and Laravel's
/// method-override) or the path (IIS URL Rewrite, Symfony) from the request instead of its
/// request line: a pin limited to methods or paths must allow what they claim too.
constexpr std::string_view kMethodOverrides[] = {"x-http-method-override", "x-http-method",
                                                 "x-method-override"};
constexpr std::string_view kPathOverrides[] = {"x-original-url", "x-rewrite-url"};

/// A field name as a CGI-style server reads it: without case, '-' and '_' alike (Puma, which
/// Rack::MethodOverride reads behind, gunicorn before 22 and FastCGI front ends make both
/// HTTP_X_HTTP_METHOD_OVERRIDE: "X_HTTP_METHOD_OVERRIDE" overrides the method there).
bool cgi_name_equals(std::string_view name, std::string_view lower_dashed) {
    if (name.size() != lower_dashed.size()) {
        return false;
    }
    for (size_t i = 0; i < name.size(); ++i) {
        char c = name[i];
        if (c >= 'A' && c <= 'Z') {
            c = static_cast<char>(c - 'A' + 'a');
        } else if (c == '_') {
            c = '-';
        }
        if (c != lower_dashed[i]) {
            return false;
        }
    }
    return true;
}

/// The `_method` query parameters a method-limited pin must also allow (Symfony and Laravel
/// take a POST's method from it, uppercased).
bool query_method_matches(const Pin& pin, std::string_view path) {
    const size_t q = path.find('?');
    return q == std::string_view::npos || form_method_matches(pin, path.substr(q + 1));
}

}  // namespace

bool key_names_method(std::string_view key) {
    auto is_method = [](std::string_view k) { return iequals(k, "_method"); };
    if (is_method(key)) {
        return true;  // as Rack 3, Spring and ASP.NET Core (whose form keys ignore case) read it
    }
    // PHP: the name ends at a NUL (php_register_variable_ex takes it as a C string), leading
    // spaces are skipped, then ' ', '.' and '[' become '_'. Also checked without the skip.
    std::string php(key.substr(0, key.find('\0')));
    std::replace_if(php.begin(), php.end(),
                    [](char c) { return c == '.' || c == ' ' || c == '['; }, '_');
    const size_t spaces = key.substr(0, key.find('\0')).find_first_not_of(' ');
    if (is_method(php) ||
        (spaces != std::string_view::npos && is_method(std::string_view(php).substr(spaces)))) {
        return true;
    }
    // Rack 2 (normalize_params): leading '[' and ']' skipped, the name up to the next bracket,
    // then only ']' to the end is the plain key ("[_method]", "]_method]").
    const size_t from = key.find_first_not_of("[]");
    if (from == std::string_view::npos) {
        return false;
    }
    const size_t to = std::min(key.find_first_of("[]", from), key.size());
    return key.find_first_not_of(']', to) == std::string_view::npos &&
           is_method(key.substr(from, to - from));
}

bool form_method_matches(const Pin& pin, std::string_view query) {
    const std::string lower = ascii_lower(query);
    if (lower.find('%') == std::string::npos && lower.find("method") == std::string::npos) {
        return true;  // the common case: no key can decode to _method
    }
    // Boost 1.81's parse_query builds its view from query.data() read as a C string (its
    // detail::query_ref is made from a char const*, so strlen): a view that does not end at a
    // NUL was read past its end (found by fuzz_body_method), and only its checks before that
    // (no raw NUL passes the query grammar) kept the result right. It gets a string of its own.
    const std::string terminated(query);
    auto params = boost::urls::parse_query(terminated);
    if (!params) {
        return false;
    }
    for (const auto& p : *params) {
        // '+' is a space in a key (PHP, Rack, servlets); "_%6Dethod" is "_method"; each
        // server's spelling of the key is key_names_method's.
        if (!key_names_method(p.key.decode(boost::urls::encoding_opts(true, false, false)))) {
            continue;
        }
        std::string method = p.has_value ? p.value.decode() : std::string();
        std::replace(method.begin(), method.end(), '+', ' ');
        std::transform(method.begin(), method.end(), method.begin(),
                       [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
        if (!method_matches(pin, method)) {
            return false;
        }
    }
    return true;
}

namespace {

/// The bucket a virtual-hosted S3 name addresses ("photos" of "photos.s3.us-east-1.amazonaws.com"
/// or "photos.s3-us-west-2.amazonaws.com": a first label before one that begins with "s3"), or
/// "" for a path-style endpoint.
std::string_view virtual_hosted_bucket(std::string_view host) {
    const size_t dot = host.find('.');
    if (dot == std::string_view::npos || dot == 0) {
        return {};
    }
    return host.substr(dot + 1).starts_with("s3") ? host.substr(0, dot) : std::string_view();
}

/// S3's x-amz-copy-source (CopyObject, UploadPartCopy: "bucket/key" or "/bucket/key",
/// percent-encoded, "?versionId=..." after it) names an object the request READS with the
/// pin's key: an S3 pin limited to a bucket (its virtual-hosted name) or to path prefixes
/// must also contain it, or a copy would bring any object the key can read into the pin's
/// reach. An access point ARN or a source that does not decode matches nothing.
bool copy_source_matches(const Pin& pin, std::string_view host, std::string_view value) {
    value = trim_ows(value);
    value = value.substr(0, value.find('?'));
    auto pct = boost::urls::make_pct_string_view(value);
    if (!pct || value.starts_with("arn:")) {
        return false;
    }
    std::string src = pct->decode();
    if (!src.starts_with('/')) {
        src.insert(src.begin(), '/');
    }
    std::string_view rest = src;
    if (const std::string_view bucket = virtual_hosted_bucket(host); !bucket.empty()) {
        // the pin's host is one bucket: the source must be in it; its prefixes are key paths
        if (!rest.substr(1).starts_with(bucket) || rest.size() < bucket.size() + 2 ||
            rest[bucket.size() + 1] != '/') {
            return false;
        }
        rest.remove_prefix(bucket.size() + 1);
    }
    return path_matches(pin, rest);
}

bool overrides_match(const Pin& pin, const RequestHead* head, std::string_view path,
                     std::string_view host) {
    const bool s3 = pin.inject.type == InjectType::AwsSigV4 && pin.inject.service == "s3";
    if (head == nullptr || (pin.methods.empty() && pin.path_prefixes.empty() &&
                            (!s3 || virtual_hosted_bucket(host).empty()))) {
        return true;
    }
    if (!pin.methods.empty() && !query_method_matches(pin, path)) {
        return false;
    }
    for (const Header& h : head->headers) {
        const auto named = [&](std::string_view n) { return cgi_name_equals(h.name, n); };
        if (s3 && named("x-amz-copy-source") && !copy_source_matches(pin, host, h.value)) {
            return false;
        }
        if (!pin.methods.empty() && std::any_of(std::begin(kMethodOverrides),
                                                std::end(kMethodOverrides), named) &&
            !method_matches(pin, trim_ows(h.value))) {
            return false;
        }
        if (!pin.path_prefixes.empty() &&
            std::any_of(std::begin(kPathOverrides), std::end(kPathOverrides), named)) {
            const std::string_view v = trim_ows(h.value);
            if (!path_matches(pin, v.substr(0, v.find('?')))) {
                return false;
            }
        }
    }
    return true;
}

}  // namespace

bool is_override_header(std::string_view name) {
    const auto named = [&](std::string_view n) { return cgi_name_equals(name, n); };
    return std::any_of(std::begin(kMethodOverrides), std::end(kMethodOverrides), named) ||
           std::any_of(std::begin(kPathOverrides), std::end(kPathOverrides), named) ||
           named("x-amz-copy-source");
}

std::optional<std::string> path_prefix_problem(std::string_view prefix) {
    if (prefix.empty() || prefix.front() != '/') {
        return "must start with '/'";
    }
    const bool plain = prefix.find_first_of("?#") == std::string_view::npos &&
                       std::none_of(prefix.begin(), prefix.end(), [](char c) {
                           return static_cast<unsigned char>(c) <= 0x20 || c == 0x7f;
                       });
    if (!plain) {
        return "must be a plain path (no query, fragment, spaces or control characters)";
    }
    return std::nullopt;
}

Result<InjectSpec> validate_injection(InjectSpec spec) {
    switch (spec.type) {
        case InjectType::Bearer: break;
        case InjectType::Basic:
            if (spec.username.find(':') != std::string::npos) {
                return make_error("inject.username: must not contain ':'");
            }
            if (has_ctl(spec.username)) {
                return make_error("inject.username: must not contain control characters");
            }
            break;
        case InjectType::Header:
            if (!valid_header_name(spec.header_name)) {
                return make_error("inject.name: not a valid header name");
            }
            if (is_transport_header(spec.header_name) || is_egress_namespace(spec.header_name)) {
                return make_error("inject.name: \"" + spec.header_name +
                                  "\" is a transport or reserved header");
            }
            spec.header_name = ascii_lower(spec.header_name);
            if (count_occurrences(spec.value_template, kSecretPlaceholder) != 1) {
                return make_error("inject.template: must contain \"{secret}\" exactly once");
            }
            if (!valid_header_value(spec.value_template)) {
                return make_error("inject.template: must not contain control characters");
            }
            break;
        case InjectType::AwsSigV4:
            if (std::string e = aws_spec_error(spec); !e.empty()) {
                return make_error(std::move(e));
            }
            break;
    }
    return spec;
}

std::string injected_header_name(const InjectSpec& spec) {
    if (spec.type == InjectType::Header) {
        return ascii_lower(spec.header_name);
    }
    return "authorization";
}

std::string injected_header_value(const InjectSpec& spec, std::string_view secret) {
    switch (spec.type) {
        case InjectType::Bearer: {
            std::string value;
            value.reserve(7 + secret.size());
            value.append("Bearer ").append(secret);
            return value;
        }
        case InjectType::Basic: {
            std::string credentials;
            credentials.reserve(spec.username.size() + 1 + secret.size());
            credentials.append(spec.username).append(":").append(secret);
            std::string blob = egress::base64_encode(credentials);
            std::string value = "Basic " + blob;
            egress::secure_zero(credentials.data(), credentials.size());
            egress::secure_zero(blob.data(), blob.size());
            return value;
        }
        case InjectType::Header: {
            std::string value = spec.value_template;
            const size_t pos = value.find(kSecretPlaceholder);
            if (pos != std::string::npos) {
                value.replace(pos, kSecretPlaceholder.size(), secret);
            }
            return value;
        }
        case InjectType::AwsSigV4:
            return {};  // signed per request (aws_sign)
    }
    return {};
}

namespace {

/// Adds `form` to the needles unless it is `s` itself or there already; wipes it otherwise.
void add_form(std::string_view s, std::string form, std::vector<std::string>& needles) {
    if (form != s && std::find(needles.begin(), needles.end(), form) == needles.end()) {
        needles.push_back(std::move(form));
    } else {
        egress::secure_wipe(form);
    }
}

/// `s` percent-encoded by an encoder that leaves the unreserved characters and `keep` as they
/// are, hex digits in lowercase or not; with `plus`, a space as '+' (a form field).
std::string percent_form(std::string_view s, const char* keep, bool lower, bool plus) {
    const auto raw = boost::urls::unreserved_chars + boost::urls::grammar::lut_chars(keep);
    return boost::urls::encode(s, raw, boost::urls::encoding_opts(plus, lower));
}

/// `s` as a JSON string's content: '"' and '\' escaped, control characters as \b \f \n
/// \r \t or \u00XX; with `slash`, '/' as "\/" (PHP); with `html`, '&' '<' '>' as \u0026
/// \u003c \u003e (Go's encoding/json); with `ascii`, every non-ASCII character as \uXXXX
/// (surrogate pairs above U+FFFF: Python's json.dumps, PHP); with `dotnet`, as .NET's
/// System.Text.Json writes by default: also '"' '+' '\'' '`' as \u00XX, hex in uppercase
/// ("\u002B"). Bytes that are not UTF-8 are left as they are.
std::string json_form(std::string_view s, bool slash, bool html, bool ascii, bool dotnet = false) {
    std::string out;
    out.reserve(s.size() * 6 + 8);  // at most \u00XX per byte: it never grows (unwiped copies)
    auto u_escape = [&](uint32_t cp) {
        const unsigned char unit[2] = {static_cast<unsigned char>(cp >> 8),
                                       static_cast<unsigned char>(cp & 0xff)};
        out.append("\\u");
        egress::append_hex(out, unit, 2, /*upper=*/dotnet);
    };
    for (size_t i = 0; i < s.size(); ++i) {
        const auto c = static_cast<unsigned char>(s[i]);
        if (dotnet && (c == '"' || c == '+' || c == '\'' || c == '`')) {
            u_escape(c);
        } else if (c == '"' || c == '\\' || (slash && c == '/')) {
            out.push_back('\\');
            out.push_back(static_cast<char>(c));
        } else if (c < 0x20 || (ascii && c == 0x7f)) {  // Python escapes DEL as \u007f
            const char* named = c == '\b' ? "\\b" : c == '\f' ? "\\f" : c == '\n' ? "\\n"
                                : c == '\r' ? "\\r" : c == '\t' ? "\\t" : nullptr;
            if (named != nullptr) {
                out.append(named);
            } else {
                u_escape(c);
            }
        } else if (html && (c == '&' || c == '<' || c == '>')) {
            u_escape(c);
        } else if (ascii && c >= 0x80) {
            // One UTF-8 sequence, decoded; anything else is left byte by byte.
            const size_t n = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 0;
            uint32_t cp = n == 4 ? c & 0x07u : n == 3 ? c & 0x0fu : c & 0x1fu;
            bool ok = n != 0 && i + n <= s.size();
            for (size_t k = 1; ok && k < n; ++k) {
                const auto b = static_cast<unsigned char>(s[i + k]);
                ok = (b & 0xc0) == 0x80;
                cp = (cp << 6) | (b & 0x3fu);
            }
            if (!ok) {
                out.push_back(static_cast<char>(c));
                continue;
            }
            if (cp >= 0x10000) {
                cp -= 0x10000;
                u_escape(0xd800 + (cp >> 10));
                u_escape(0xdc00 + (cp & 0x3ff));
            } else {
                u_escape(cp);
            }
            i += n - 1;
        } else {
            out.push_back(static_cast<char>(c));
        }
    }
    return out;
}

/// Adds the forms in which an upstream commonly echoes `s` inside other text, where they
/// differ from `s` itself. Percent-encoded (a URL, a form field, a redirect's Location), in
/// upper- and lowercase hex, as the common encoders leave characters raw: RFC 3986's
/// unreserved only, and also '/' (Python's quote), "!'()*" (JavaScript's
/// encodeURIComponent), "$&+:=@" (Go's PathEscape), "$&+,/:;=@" (Go's URL.EscapedPath), a
/// space as '+' (form fields). JSON
/// string content as JavaScript, PHP ("\/", \uXXXX), Go (\u0026 for '&' '<' '>') and
/// Python (\uXXXX for non-ASCII) write it, and as .NET's System.Text.Json does ("\u002B"
/// for '+', frequent in base64 tokens). PHP's urlencode and Java's URLEncoder also encode '~'
/// (as %7E, a space as '+'; Java leaves '*'). A token of letters, digits, '-', '.' and '_' has
/// none. At most 20 forms.
void add_echo_forms(std::string_view s, std::vector<std::string>& needles) {
    for (const bool lower : {false, true}) {
        for (const char* keep : {"", "/", "!'()*", "$&+:=@", "$&+,/:;=@"}) {
            add_form(s, percent_form(s, keep, lower, false), needles);
        }
        add_form(s, percent_form(s, "", lower, true), needles);
    }
    for (const char* keep : {"-._", "-._*"}) {  // PHP's urlencode, Java's URLEncoder
        const auto raw = boost::urls::grammar::alnum_chars + boost::urls::grammar::lut_chars(keep);
        add_form(s, boost::urls::encode(s, raw, boost::urls::encoding_opts(true, false)), needles);
    }
    add_form(s, json_form(s, false, true, true, true), needles);
    for (const auto [slash, html, ascii] : {std::array<bool, 3>{false, false, false},
                                            std::array<bool, 3>{true, false, false},
                                            std::array<bool, 3>{true, false, true},
                                            std::array<bool, 3>{false, true, false},
                                            std::array<bool, 3>{false, false, true}}) {
        add_form(s, json_form(s, slash, html, ascii), needles);
    }
}

}  // namespace

std::shared_ptr<const Injection> make_injection(const InjectSpec& spec,
                                                const credstore::SecretValue& secret) {
    auto inj = std::make_shared<Injection>();
    inj->header = injected_header_name(spec);
    std::string value = injected_header_value(spec, secret.reveal());
    // The key searched in answers: the secret, or the secret access key of a credentials
    // document (and its session token below); the document itself is never sent as it is.
    std::string_view key = secret.reveal();
    if (spec.type == InjectType::AwsSigV4) {
        auto creds = aws_credentials(spec, secret.reveal());
        if (creds) {
            inj->aws = std::move(*creds);
            key = inj->aws->secret_access_key->reveal();
        } else {
            inj->aws_error = creds.error();
        }
    }
    std::vector<std::string> needles;
    // Room for every needle at once: a reallocation would move short (inline) strings and
    // free their old bytes unwiped.
    // (At most 4 + 3 x 17 needles: the secret or key, the value, the basic blob, a session
    // token, and each's echo forms.)
    needles.reserve(64);
    needles.emplace_back(key);
    if (!value.empty()) {  // aws-sigv4 has no fixed value: a signature per request
        needles.push_back(value);
    }
    if (spec.type == InjectType::Basic) {
        needles.push_back(value.substr(6));  // the base64 blob after "Basic "
    }
    // The secret and the basic blob as they are echoed inside a URL or a JSON string. The
    // injected value's own forms are not needed: each holds the secret's (or the blob's)
    // form, which is searched already.
    add_echo_forms(key, needles);
    if (inj->aws && inj->aws->session_token) {
        const std::string_view token = inj->aws->session_token->reveal();
        needles.emplace_back(token);
        add_echo_forms(token, needles);
    }
    if (spec.type == InjectType::Basic) {
        std::string blob = needles[2];
        add_echo_forms(blob, needles);
        egress::secure_wipe(blob);
    }
    inj->scrub = std::make_shared<const ScrubPlan>(std::move(needles));  // wipes them
    inj->value = std::make_shared<const credstore::SecretValue>(value);
    egress::secure_wipe(value);
    return inj;
}

void prepare_injection(Pin& pin) {
    pin.injection = pin.secret ? make_injection(pin.inject, *pin.secret) : nullptr;
}

const std::shared_ptr<const Injection>* InjectionCache::find(const Pin& pin) const {
    const auto it = by_secret_.find(pin.secret.get());
    if (it != by_secret_.end()) {
        for (const Entry& e : it->second) {
            if (e.spec == pin.inject) {
                return &e.injection;
            }
        }
    }
    return nullptr;
}

void InjectionCache::remember(const Pin& pin) {
    if (pin.secret && pin.injection && find(pin) == nullptr) {
        add(pin);
    }
}

void InjectionCache::prepare(Pin& pin) {
    if (!pin.secret) {
        pin.injection = nullptr;
    } else if (const auto* kept = find(pin)) {
        pin.injection = *kept;
    } else {
        prepare_injection(pin);
        add(pin);
    }
}

void index_pins(RunPolicy& run) {
    auto index = std::make_shared<PinIndex>();
    for (uint32_t i = 0; i < run.pins.size(); ++i) {
        const auto& h = run.pins[i].host;
        (h.wildcard() ? index->wildcard_parent : index->exact)[h.host()].push_back(i);
    }
    index->pin_count = run.pins.size();
    run.pin_index = std::move(index);
}

namespace {

/// Calls fn(pin) for the pins that could match `host`, in pin order, until fn returns true.
/// Returns the pin fn accepted, or nullptr.
template <class Fn>
const Pin* find_pin(const RunPolicy& run, const std::string& host, Fn&& fn) {
    const PinIndex* index = run.pin_index.get();
    if (index == nullptr || index->pin_count != run.pins.size()) {
        for (const Pin& pin : run.pins) {
            if (fn(pin)) {
                return &pin;
            }
        }
        return nullptr;
    }
    static const std::vector<uint32_t> kNone;
    auto exact_it = index->exact.find(host);
    const auto& exact = exact_it == index->exact.end() ? kNone : exact_it->second;
    auto dot = host.find('.');
    const std::vector<uint32_t>* wild = &kNone;
    if (dot != std::string::npos) {
        auto it = index->wildcard_parent.find(host.substr(dot + 1));
        if (it != index->wildcard_parent.end()) {
            wild = &it->second;
        }
    }
    size_t a = 0;
    size_t b = 0;
    while (a < exact.size() || b < wild->size()) {  // merge: keep the pins' order
        uint32_t i = (b >= wild->size() || (a < exact.size() && exact[a] < (*wild)[b]))
                         ? exact[a++]
                         : (*wild)[b++];
        if (fn(run.pins[i])) {
            return &run.pins[i];
        }
    }
    return nullptr;
}

}  // namespace

DestinationDecision decide_destination(const GlobalPolicy& global, const RunPolicy& run,
                                       const HostPort& dest, TimePoint now) {
    DestinationDecision d;
    if (run.revoked) {
        d.reason = "run_revoked";
        return d;
    }
    if (!run_live(run, now)) {
        d.reason = "run_expired";
        return d;
    }
    if (std::any_of(global.deny_hosts.begin(), global.deny_hosts.end(),
                    [&](const HostPattern& p) { return p.matches(dest); })) {
        d.reason = "host_denied";
        return d;
    }
    d.pinned = find_pin(run, dest.host, [&](const Pin& pin) {
                   return pin_live(pin, now) && pattern_allows(pin.host, dest, global);
               }) != nullptr;
    if (d.pinned) {
        d.carry = Carry::Intercept;
        return d;
    }
    if (host_allowed(global, run, dest)) {
        d.carry = global.unpinned == Unpinned::Intercept ? Carry::Intercept : Carry::Tunnel;
        return d;
    }
    // Tell a wrong port apart from a host nobody named.
    auto host_named = [&](const HostPattern& p) { return p.matches_host(dest.host); };
    const bool named =
        std::any_of(run.allow_hosts.begin(), run.allow_hosts.end(), host_named) ||
        std::any_of(global.allow_hosts.begin(), global.allow_hosts.end(), host_named) ||
        find_pin(run, dest.host, [&](const Pin& pin) {
            return pin_live(pin, now) && host_named(pin.host);
        }) != nullptr;
    d.reason = named ? "port_not_allowed" : "host_not_allowed";
    return d;
}

bool pattern_allows(const HostPattern& p, const HostPort& dest, const GlobalPolicy& global) {
    if (!p.matches_host(dest.host)) {
        return false;
    }
    if (p.port()) {
        return *p.port() == dest.port;
    }
    return std::find(global.allowed_ports.begin(), global.allowed_ports.end(), dest.port) !=
           global.allowed_ports.end();
}

bool host_allowed(const GlobalPolicy& global, const RunPolicy& run, const HostPort& dest) {
    auto allows = [&](const HostPattern& p) { return pattern_allows(p, dest, global); };
    return std::any_of(run.allow_hosts.begin(), run.allow_hosts.end(), allows) ||
           std::any_of(global.allow_hosts.begin(), global.allow_hosts.end(), allows);
}

const Pin* match_pin(const GlobalPolicy& global, const RunPolicy& run, const HostPort& dest,
                     std::string_view method, std::string_view path, TimePoint now,
                     const RequestHead* head) {
    if (!run_live(run, now)) {
        return nullptr;
    }
    const std::string_view path_only = path.substr(0, path.find('?'));
    // The port rule of decide_destination: a pin without a port must not take over a port
    // that another pin names (or that only an allow pattern admits) and inject there.
    return find_pin(run, dest.host, [&](const Pin& pin) {
        return pin_live(pin, now) && pattern_allows(pin.host, dest, global) &&
               method_matches(pin, method) && path_matches(pin, path_only) &&
               overrides_match(pin, head, path, dest.host);
    });
}


bool host_pinned(const GlobalPolicy& global, const RunPolicy& run, const HostPort& dest,
                 TimePoint now) {
    if (!run_live(run, now)) {
        return false;
    }
    return find_pin(run, dest.host, [&](const Pin& pin) {
               return pin_live(pin, now) && pattern_allows(pin.host, dest, global);
           }) != nullptr;
}

}  // namespace egress::policy

namespace egress::policy {

Result<std::vector<Header>> validate_extra_headers(const std::vector<Header>& headers,
                                                   const InjectSpec& inject) {
    if (headers.size() > kMaxExtraHeaders) {
        return make_error("headers: " + std::to_string(headers.size()) + " headers (at most " +
                          std::to_string(kMaxExtraHeaders) + ")");
    }
    std::vector<Header> out;
    const std::string injected = injected_header_name(inject);
    for (const auto& h : headers) {
        std::string name = ascii_lower(h.name);
        if (!valid_header_name(name)) {
            return make_error("headers." + h.name + ": not a valid header name");
        }
        if (is_transport_header(name) || is_egress_namespace(name)) {
            return make_error("headers." + name + ": transport and proxy headers cannot be set");
        }
        if (name == injected) {
            return make_error("headers." + name + ": is the injected credential header");
        }
        if (!valid_header_value(h.value)) {
            return make_error("headers." + name + ": value contains CR, LF or NUL");
        }
        for (const auto& o : out) {
            if (o.name == name) {
                return make_error("headers." + name + ": set twice");
            }
        }
        out.push_back({name, h.value});
    }
    return out;
}

}  // namespace egress::policy
