// egressctl: the command line for the egressd admin API.
//
//   egressctl [--admin URL] [--token-file F] [--timeout DURATION] COMMAND ...
//
// URL is http://HOST:PORT (default http://127.0.0.1:9901) or unix:/path.sock. The admin token
// comes from EGRESSD_ADMIN_TOKEN or --token-file; it is sent as a bearer token and never
// printed. Secret values are read from standard input only, never from an argument.
//
// Exit status: 0 success, 1 the request failed (the API's error on one line of stderr),
// 2 usage error.
#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/x509.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <termios.h>
#include <unistd.h>

#include <array>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/json.hpp>
#include <boost/url.hpp>

#include "common/json_text.h"
#include "common/secure_zero.h"
#include "common/staged_file.h"
#include "common/trust_roots.h"
#include "common/wiping_json.h"

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
namespace json = boost::json;
namespace urls = boost::urls;
using egress::append_json_string;
using egress::valid_utf8;

namespace {

constexpr const char* kDefaultAdmin = "http://127.0.0.1:9901";
constexpr const char* kDefaultCaOut = "./egress-run-ca.pem";
constexpr std::chrono::seconds kDefaultTimeout{30};

// --- errors ---------------------------------------------------------------------------------

/// A failed request or a local failure: one line on stderr, exit 1.
struct Failure : std::runtime_error {
    using std::runtime_error::runtime_error;
};
/// A request that may have reached the admin API, whose answer never came (a timeout or a
/// broken connection once sending had begun): what it asked for may have been done.
struct NoAnswer : Failure {
    using Failure::Failure;
};
/// Bad command line: one line on stderr (plus a hint), exit 2.
struct Usage : std::runtime_error {
    using std::runtime_error::runtime_error;
};
/// -h or --help where an option may stand, or `help` where a command word does: the usage on
/// stdout, exit 0. A positional value that reads "help" (`secret put help`) is a value.
struct Help {};

bool is_help(const std::string& word) {
    return word == "help" || word == "-h" || word == "--help";
}

const char* kUsage =
    "usage: egressctl [--admin URL] [--token-file FILE] [--timeout DURATION] COMMAND ...\n"
    "\n"
    "  --admin URL        admin API: http://HOST:PORT or unix:/path.sock\n"
    "                     (default http://127.0.0.1:9901)\n"
    "  --token-file FILE  admin token file (default: $EGRESSD_ADMIN_TOKEN)\n"
    "  --timeout DURATION give up on an admin API call not answered whole within\n"
    "                     DURATION (30s, 2m; default 30s): exit 1\n"
    "\n"
    "commands:\n"
    "  secret put NAME --scope org=ORG [--scope project=P ...] [--rotate]\n"
    "                     store a secret; the value is read from standard input\n"
    "  secret rotate NAME --scope ...   replace a secret's value (standard input)\n"
    "  secret list [--json]\n"
    "  secret rm NAME [--scope ...]\n"
    "  run create --scope org=ORG [--scope project=P] [--scope user=U] [--scope workflow=W]\n"
    "             [--pin HOST[:PORT]=SECRET:bearer|basic:USER|header:NAME[:TEMPLATE]\n"
    "                    |aws-sigv4:[ACCESS_KEY_ID]:REGION:SERVICE]...\n"
    "             [PIN OPTIONS] [--allow HOST]... [--ttl 30m] [--env] [--ca-out FILE]\n"
    "             [--ca-bundle-out FILE] [--system-ca-file FILE]\n"
    "                     --env prints the sandbox's variables and writes the run CA\n"
    "                     (--ca-out, default ./egress-run-ca.pem; NODE_EXTRA_CA_CERTS) and a\n"
    "                     bundle of the system roots (--system-ca-file, default OpenSSL's)\n"
    "                     plus the run CA (--ca-bundle-out, default ./egress-run-ca-bundle.pem;\n"
    "                     SSL_CERT_FILE, REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE, GIT_SSL_CAINFO)\n"
    "  run pin ID --pin HOST[:PORT]=SECRET:TYPE [PIN OPTIONS] [--ttl 10m]\n"
    "                     add a pin to a run (its ttl never past the run's end)\n"
    "    PIN OPTIONS narrow every --pin of the command:\n"
    "      --path PREFIX    only paths under PREFIX (repeatable)\n"
    "      --method M       only method M (repeatable)\n"
    "      --header N=V     a static header set with the credential (repeatable)\n"
    "  run show ID\n"
    "  run revoke ID\n"
    "  run explain ID URL [--method M] [--json]\n"
    "  keys rotate\n";

// --- small helpers --------------------------------------------------------------------------

struct Wiped {  // a string holding secret material, wiped when it goes away
    std::string s;
    ~Wiped() { wipe(); }
    void wipe() { egress::secure_wipe(s); }
};

/// A value that is a JSON object over several lines (an AWS credentials document as `aws sts
/// assume-role --query Credentials` prints it, indented) is made compact, one line: a secret
/// holds no CR or LF, and egressd reads the document's fields, not its layout. Anything else
/// is left as it is (and refused by egressd if it holds a line break).
void compact_json_document(Wiped& v) {
    const size_t first = v.s.find_first_not_of(" \t\r\n");
    if (v.s.find_first_of("\r\n") == std::string::npos || first == std::string::npos ||
        v.s[first] != '{') {
        return;
    }
    boost::system::error_code ec;
    json::value doc =
        json::parse(v.s, ec, json::make_shared_resource<egress::WipingJsonResource>());
    if (ec || !doc.is_object()) {
        return;
    }
    Wiped compact;
    // Room enough that it never grows (a growth would free a copy unwiped): the compact form
    // is shorter than the input but for numbers ("0.1" is written "1E-1").
    compact.s.reserve(2 * v.s.size() + 64);
    json::serializer sr;
    sr.reset(&doc);
    char piece[512];
    while (!sr.done()) {
        compact.s.append(sr.read(piece, sizeof piece));
    }
    egress::secure_zero(piece, sizeof piece);
    v.wipe();
    std::swap(v.s, compact.s);
}

std::string trim_ws(std::string s) {
    while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ' ||
                          s.back() == '\t')) {
        s.pop_back();
    }
    size_t i = 0;
    while (i < s.size() && (s[i] == ' ' || s[i] == '\t')) ++i;
    return s.substr(i);
}

/// Single-quoted for POSIX shells: safe for eval whatever the content.
std::string shell_quote(std::string_view v) {
    std::string out = "'";
    for (char c : v) {
        if (c == '\'') {
            out += "'\\''";
        } else {
            out.push_back(c);
        }
    }
    out += "'";
    return out;
}

void pretty(std::ostream& os, const json::value& v, int indent = 0) {
    std::string pad(indent, ' ');
    switch (v.kind()) {
        case json::kind::object: {
            const auto& o = v.get_object();
            if (o.empty()) {
                os << "{}";
                return;
            }
            os << "{\n";
            size_t i = 0;
            for (const auto& [k, val] : o) {
                os << pad << "  " << json::serialize(json::string(k)) << ": ";
                pretty(os, val, indent + 2);
                os << (++i < o.size() ? ",\n" : "\n");
            }
            os << pad << "}";
            return;
        }
        case json::kind::array: {
            const auto& a = v.get_array();
            if (a.empty()) {
                os << "[]";
                return;
            }
            os << "[\n";
            for (size_t i = 0; i < a.size(); ++i) {
                os << pad << "  ";
                pretty(os, a[i], indent + 2);
                os << (i + 1 < a.size() ? ",\n" : "\n");
            }
            os << pad << "]";
            return;
        }
        default:
            os << json::serialize(v);
    }
}

std::string scope_text(const json::value& v) {
    if (!v.is_object()) return "-";
    std::string out;
    for (const char* k : {"org", "project", "user", "workflow"}) {
        if (auto* f = v.get_object().if_contains(k); f != nullptr && f->is_string()) {
            if (!out.empty()) out += ",";
            out += std::string(k) + "=" + std::string(f->get_string());
        }
    }
    return out.empty() ? "-" : out;
}

std::string str_field(const json::value& v, const char* key, const char* dflt = "-") {
    if (!v.is_object()) return dflt;
    auto* f = v.get_object().if_contains(key);
    if (f == nullptr || f->is_null()) return dflt;
    if (f->is_string()) return std::string(f->get_string());
    return json::serialize(*f);
}

// --- command line ---------------------------------------------------------------------------

struct Args {
    std::vector<std::string> pos;                                  // positionals
    std::vector<std::pair<std::string, std::string>> opts;        // --name value
    std::vector<std::string> flags;                                // --name

    std::vector<std::string> all(const std::string& name) const {
        std::vector<std::string> out;
        for (const auto& [k, v] : opts) {
            if (k == name) out.push_back(v);
        }
        return out;
    }
    std::optional<std::string> one(const std::string& name) const {
        auto v = all(name);
        if (v.size() > 1) throw Usage("--" + name + " given more than once");
        if (v.empty()) return std::nullopt;
        return v.front();
    }
    bool flag(const std::string& name) const {
        for (const auto& f : flags) {
            if (f == name) return true;
        }
        return false;
    }
};

/// Splits argv after the command words. `valued` options take a value (`--x V` or `--x=V`);
/// `boolean` ones do not; anything else starting with "--" is a usage error.
/// The message for an argument that is no known option: it names the argument only when it is
/// shaped like an option ("--" and lowercase letters, digits and '-'); anything else may be a
/// secret value typed where an option goes, and is never echoed.
std::string unknown_option(const std::string& arg) {
    bool shaped = arg.size() > 2 && arg.size() <= 34 && arg.rfind("--", 0) == 0;
    for (size_t i = 2; shaped && i < arg.size(); ++i) {
        const char c = arg[i];
        shaped = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-';
    }
    return shaped ? "unknown option '" + arg + "'"
                  : std::string("unknown option (not shown: it may be a value typed where an "
                                "option goes; values are read from standard input)");
}

Args parse_args(const std::vector<std::string>& in, const std::vector<std::string>& valued,
                const std::vector<std::string>& boolean) {
    Args a;
    auto contains = [](const std::vector<std::string>& v, const std::string& s) {
        for (const auto& e : v) {
            if (e == s) return true;
        }
        return false;
    };
    bool only_pos = false;
    for (size_t i = 0; i < in.size(); ++i) {
        const std::string& arg = in[i];
        if (!only_pos && (arg == "-h" || arg == "--help")) throw Help{};
        if (only_pos || arg.size() < 2 || arg.rfind("--", 0) != 0) {
            if (!only_pos && arg.size() > 1 && arg[0] == '-' && arg != "-") {
                throw Usage(unknown_option(arg));
            }
            a.pos.push_back(arg);
            continue;
        }
        if (arg == "--") {
            only_pos = true;
            continue;
        }
        std::string name = arg.substr(2);
        std::optional<std::string> value;
        if (auto eq = name.find('='); eq != std::string::npos) {
            value = name.substr(eq + 1);
            name = name.substr(0, eq);
        }
        if (contains(valued, name)) {
            if (!value) {
                if (i + 1 >= in.size()) throw Usage("--" + name + " needs a value");
                value = in[++i];
            }
            a.opts.emplace_back(name, *value);
        } else if (contains(boolean, name)) {
            if (value) throw Usage("--" + name + " takes no value");
            a.flags.push_back(name);
        } else {
            throw Usage(unknown_option("--" + name));
        }
    }
    return a;
}

void want_pos(const Args& a, size_t n, const char* what, bool echo_extra = true) {
    if (a.pos.size() < n) throw Usage(std::string("missing ") + what);
    if (a.pos.size() > n) {
        // Never echo an extra argument that may be a secret value typed by mistake.
        if (!echo_extra) {
            throw Usage("too many arguments: the secret value is read from standard input, "
                        "never from an argument");
        }
        throw Usage("unexpected argument '" + a.pos[n] + "'");
    }
}

/// --scope org=acme --scope project=web  (or --scope org=acme,project=web) → JSON object.
json::object parse_scopes(const std::vector<std::string>& items, bool required) {
    json::object s;
    for (const auto& item : items) {
        std::string_view rest = item;
        while (!rest.empty()) {
            auto comma = rest.find(',');
            std::string_view kv = rest.substr(0, comma);
            rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
            auto eq = kv.find('=');
            if (eq == std::string_view::npos || eq == 0 || eq + 1 == kv.size()) {
                throw Usage("--scope '" + std::string(kv) + "': expected FIELD=VALUE");
            }
            std::string k(kv.substr(0, eq));
            if (k != "org" && k != "project" && k != "user" && k != "workflow") {
                throw Usage("--scope: unknown field '" + k +
                            "' (expected org, project, user or workflow)");
            }
            if (s.contains(k)) throw Usage("--scope: " + k + " given more than once");
            s[k] = std::string(kv.substr(eq + 1));
        }
    }
    if (required && !s.contains("org")) throw Usage("--scope org=ORG is required");
    return s;
}

/// "30m" → 1800. Units s, m, h, d; a bare number is seconds. `flag` names the option in errors.
int64_t parse_duration(const std::string& text, const std::string& flag = "--ttl") {
    if (text.empty()) throw Usage(flag + ": empty duration");
    size_t i = 0;
    int64_t n = 0;
    while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) {
        if (n > 100'000'000) throw Usage(flag + " '" + text + "': too large");
        n = n * 10 + (text[i] - '0');
        ++i;
    }
    if (i == 0) throw Usage(flag + " '" + text + "': expected a number with s, m, h or d");
    std::string unit = text.substr(i);
    int64_t mult = unit.empty() || unit == "s" ? 1
                   : unit == "m"               ? 60
                   : unit == "h"               ? 3600
                   : unit == "d"               ? 86400
                                               : 0;
    if (mult == 0) {
        throw Usage(flag + " '" + text + "': unknown unit '" + unit + "' (s, m, h, d)");
    }
    if (n <= 0) throw Usage(flag + " must be positive");
    return n * mult;
}

/// 30 s → "30s", 120 s → "2m": as --timeout takes it.
std::string duration_text(std::chrono::seconds d) {
    const int64_t n = d.count();
    if (n % 3600 == 0) return std::to_string(n / 3600) + "h";
    if (n % 60 == 0) return std::to_string(n / 60) + "m";
    return std::to_string(n) + "s";
}

/// HOST[:PORT]=SECRET:bearer | SECRET:basic:USER | SECRET:header:NAME[:TEMPLATE]
///   | SECRET:aws-sigv4:ACCESS_KEY_ID:REGION:SERVICE
json::object parse_pin(const std::string& text) {
    auto bad = [&](const std::string& why) {
        return Usage("--pin '" + text + "': " + why +
                     " (expected HOST[:PORT]=SECRET:bearer|basic:USER|header:NAME"
                     "|aws-sigv4:ACCESS_KEY_ID:REGION:SERVICE)");
    };
    auto eq = text.find('=');
    if (eq == std::string::npos || eq == 0) throw bad("missing HOST=");
    std::string host = text.substr(0, eq);
    std::string rest = text.substr(eq + 1);
    auto c1 = rest.find(':');
    if (c1 == std::string::npos || c1 == 0) throw bad("missing SECRET:TYPE");
    std::string secret = rest.substr(0, c1);
    std::string spec = rest.substr(c1 + 1);
    json::object inject;
    auto c2 = spec.find(':');
    std::string type = spec.substr(0, c2);
    std::string arg = c2 == std::string::npos ? "" : spec.substr(c2 + 1);
    if (type == "bearer") {
        if (c2 != std::string::npos) throw bad("bearer takes no argument");
        inject["type"] = "bearer";
    } else if (type == "basic") {
        if (arg.empty()) throw bad("basic needs a user name");
        inject["type"] = "basic";
        inject["username"] = arg;
    } else if (type == "header") {
        auto c3 = arg.find(':');
        std::string name = arg.substr(0, c3);
        if (name.empty()) throw bad("header needs a header name");
        inject["type"] = "header";
        inject["name"] = name;
        if (c3 != std::string::npos) inject["template"] = arg.substr(c3 + 1);
    } else if (type == "aws-sigv4") {
        const auto c3 = arg.find(':');
        const auto c4 = c3 == std::string::npos ? c3 : arg.find(':', c3 + 1);
        if (c4 == std::string::npos || arg.find(':', c4 + 1) != std::string::npos) {
            throw bad("aws-sigv4 needs ACCESS_KEY_ID:REGION:SERVICE");
        }
        inject["type"] = "aws-sigv4";
        if (c3 > 0) {  // none: the secret is a credentials document
            inject["access_key_id"] = arg.substr(0, c3);
        }
        inject["region"] = arg.substr(c3 + 1, c4 - c3 - 1);
        inject["service"] = arg.substr(c4 + 1);
    } else {
        throw bad("unknown injection type '" + type + "'");
    }
    json::object pin;
    pin["host"] = host;
    pin["secret"] = secret;
    pin["inject"] = inject;
    return pin;
}

// --- HTTP client ----------------------------------------------------------------------------

struct Endpoint {
    bool is_unix = false;
    std::string unix_path;
    std::string host;  // for TCP; also the Host header
    std::string port;
    std::string display;  // for error messages
};

Endpoint parse_admin(const std::string& text) {
    Endpoint e;
    e.display = text;
    if (text.rfind("unix:", 0) == 0) {
        e.is_unix = true;
        std::string p = text.substr(5);
        if (p.rfind("//", 0) == 0) p = p.substr(2);  // unix:///run/x.sock
        if (p.empty()) throw Usage("--admin '" + text + "': empty unix socket path");
        e.unix_path = p;
        return e;
    }
    auto u = urls::parse_uri(text);
    if (!u) throw Usage("--admin '" + text + "': not a URL (http://HOST:PORT or unix:/path)");
    if (u->scheme_id() != urls::scheme::http) {
        throw Usage("--admin '" + text + "': only http:// or unix: are supported");
    }
    e.host = std::string(u->encoded_host());
    if (e.host.size() > 1 && e.host.front() == '[' && e.host.back() == ']') {
        e.host = e.host.substr(1, e.host.size() - 2);
    }
    if (e.host.empty()) throw Usage("--admin '" + text + "': no host");
    e.port = u->has_port() ? std::string(u->port()) : "80";
    return e;
}

struct Reply {
    int status = 0;
    std::string reason;
    std::string body;
};

class Client {
public:
    Client(Endpoint ep, std::string token, std::chrono::seconds timeout)
        : ep_(std::move(ep)), timeout_(timeout) {
        token_.s = std::move(token);
    }

    /// One request; `body` may hold a secret and is wiped by the caller.
    Reply call(http::verb method, const std::string& target, const std::string* body = nullptr) {
        http::request<http::string_body> req{method, target, 11};
        if (ep_.is_unix) {
            req.set(http::field::host, "localhost");
        } else {
            bool v6 = ep_.host.find(':') != std::string::npos;
            req.set(http::field::host,
                    (v6 ? "[" + ep_.host + "]" : ep_.host) + ":" + ep_.port);
        }
        req.set(http::field::user_agent, "egressctl");
        req.set(http::field::accept, "application/json");
        Wiped auth;
        auth.s = "Bearer " + token_.s;
        req.set(http::field::authorization, auth.s);
        req.keep_alive(false);
        if (body != nullptr) {
            req.set(http::field::content_type, "application/json");
            req.body() = *body;
        }
        req.prepare_payload();
        sending_begun_ = false;
        // `req` holds copies of the body (a secret's value, for `secret put`) and of the
        // token (the Authorization field): wiped on every way out of here, the timeout's
        // Failure and any other exception included, not only on success and system_error.
        struct WipeOnExit {
            http::request<http::string_body>& req;
            ~WipeOnExit() { wipe(req); }
        } wipe_on_exit{req};
        try {
            if (ep_.is_unix) return exchange<net::local::stream_protocol>(req);
            return exchange<net::ip::tcp>(req);
        } catch (const boost::system::system_error& ex) {
            std::string what = "cannot reach the admin API at " + ep_.display + ": " +
                               ex.code().message();
            if (sending_begun_) throw NoAnswer(what);
            throw Failure(what);
        }
    }

private:
    static void wipe(http::request<http::string_body>& req) {
        if (!req.body().empty()) egress::secure_zero(req.body().data(), req.body().size());
        // The field's value lives in the request's own (non-const) storage.
        const auto auth = req[http::field::authorization];
        if (!auth.empty()) egress::secure_zero(const_cast<char*>(auth.data()), auth.size());
    }

    /// The exchange runs as asynchronous operations under one deadline (`timeout_`) that
    /// covers the lookup, the connect, the request and the whole answer: a listener that
    /// accepts and never answers (a wedged egressd, an admin call stuck behind its state
    /// store) fails the command instead of hanging it.
    template <class Protocol>
    Reply exchange(http::request<http::string_body>& req) {
        using error_code = boost::system::error_code;
        // Owned by a pointer so that a timeout during the name lookup can leave it behind: the
        // lookup is getaddrinfo on Asio's resolver thread, which the io_context's destructor
        // joins (a stalled DNS server held the command for resolv.conf's whole retry time,
        // past --timeout). Its handlers never run: nothing runs that io_context again.
        auto ioc_owner = std::make_unique<net::io_context>();
        net::io_context& ioc = *ioc_owner;
        bool resolving = false;
        typename Protocol::socket sock(ioc);
        net::ip::tcp::resolver resolver(ioc);
        beast::flat_buffer buf;
        http::response_parser<http::string_body> parser;
        parser.body_limit(64 << 20);
        const char* phase = "connecting to";
        std::optional<error_code> result;  // set when the exchange has ended
        auto on_read = [&](error_code ec, size_t) { result = ec; };
        auto on_write = [&](error_code ec, size_t) {
            if (ec) {
                result = ec;
                return;
            }
            phase = "waiting for an answer from";
            http::async_read(sock, buf, parser, on_read);
        };
        auto on_connect = [&](error_code ec, auto&&...) {
            if (ec) {
                result = ec;
                return;
            }
            phase = "sending a request to";
            sending_begun_ = true;
            http::async_write(sock, req, on_write);
        };
        if constexpr (std::is_same_v<Protocol, net::ip::tcp>) {
            resolving = true;
            phase = "looking up";
            resolver.async_resolve(ep_.host, ep_.port,
                                   [&](error_code ec, net::ip::tcp::resolver::results_type rs) {
                                       resolving = false;
                                       phase = "connecting to";
                                       if (ec) {
                                           result = ec;
                                           return;
                                       }
                                       net::async_connect(sock, rs, on_connect);
                                   });
        } else {
            sock.async_connect(typename Protocol::endpoint(ep_.unix_path), on_connect);
        }
        ioc.run_for(timeout_);
        if (!result) {
            // Pending handlers are destroyed with the io_context, never run.
            error_code ignored;
            sock.close(ignored);
            std::string what = std::string("timed out after ") + duration_text(timeout_) +
                               " " + phase + " the admin API at " + ep_.display +
                               " (--timeout " + duration_text(timeout_) + ")";
            if (resolving) {
                (void)ioc_owner.release();  // not joined: the process ends after the error
            }
            if (sending_begun_) throw NoAnswer(what);
            throw Failure(what);
        }
        if (*result) throw boost::system::system_error(*result);
        auto& res = parser.get();
        error_code ec;
        sock.shutdown(Protocol::socket::shutdown_both, ec);
        return Reply{static_cast<int>(res.result_int()), std::string(res.reason()),
                     std::move(res.body())};
    }

    Endpoint ep_;
    Wiped token_;
    std::chrono::seconds timeout_;
    bool sending_begun_ = false;  // of the current call: some of its request may be there
};

/// The API's error as one line: "400 invalid_request: pins[0].secret: unknown secret ...".
std::string api_error(const Reply& r) {
    boost::system::error_code ec;
    auto v = json::parse(r.body, ec);
    std::string line = std::to_string(r.status);
    if (!ec && v.is_object() && v.get_object().contains("error")) {
        line += " " + str_field(v, "error", "");
        std::string detail = str_field(v, "detail", "");
        if (!detail.empty()) line += ": " + detail;
        return line;
    }
    line += " " + (r.reason.empty() ? std::string("error") : r.reason);
    std::string body = trim_ws(r.body.substr(0, 200));
    for (auto& c : body) {
        if (c == '\n' || c == '\r') c = ' ';
    }
    if (!body.empty()) line += ": " + body;
    return line;
}

json::value parse_reply(const Reply& r) {
    boost::system::error_code ec;
    auto v = json::parse(r.body, ec);
    if (ec) throw Failure("the admin API answered " + std::to_string(r.status) +
                          " with a body that is not JSON");
    return v;
}

void expect(const Reply& r, std::initializer_list<int> ok) {
    for (int s : ok) {
        if (r.status == s) return;
    }
    throw Failure(api_error(r));
}

std::string target(std::initializer_list<std::string> segments,
                   std::vector<std::pair<std::string, std::string>> params = {}) {
    urls::url u;
    u.set_path_absolute(true);
    for (const auto& s : segments) u.segments().push_back(s);
    for (const auto& [k, v] : params) u.params().append({k, v});
    std::string t(u.encoded_path());
    if (u.has_query()) t += "?" + std::string(u.encoded_query());
    return t;
}

// --- secret value from standard input -------------------------------------------------------

Wiped read_secret_value() {
    Wiped v;
    const bool tty = ::isatty(STDIN_FILENO) == 1;
    termios saved{};
    bool echo_off = false;
    if (tty) {
        std::fputs("secret value (input hidden): ", stderr);
        std::fflush(stderr);
        if (::tcgetattr(STDIN_FILENO, &saved) == 0) {
            termios t = saved;
            t.c_lflag &= ~static_cast<tcflag_t>(ECHO);
            echo_off = ::tcsetattr(STDIN_FILENO, TCSAFLUSH, &t) == 0;
        }
    }
    char buf[4096];
    for (;;) {
        ssize_t n = ::read(STDIN_FILENO, buf, sizeof buf);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
            egress::secure_zero(buf, sizeof buf);
            if (echo_off) ::tcsetattr(STDIN_FILENO, TCSAFLUSH, &saved);
            throw Failure(std::string("cannot read the secret value from standard input: ") +
                          std::strerror(errno));
        }
        if (n == 0) break;
        if (v.s.size() + static_cast<size_t>(n) > (1u << 20)) {
            egress::secure_zero(buf, sizeof buf);
            if (echo_off) ::tcsetattr(STDIN_FILENO, TCSAFLUSH, &saved);
            throw Failure("secret value on standard input is larger than 1 MiB");
        }
        // Grow without leaving unwiped copies behind.
        if (v.s.capacity() < v.s.size() + static_cast<size_t>(n)) {
            Wiped bigger;
            bigger.s.reserve(2 * (v.s.size() + static_cast<size_t>(n)) + 64);
            bigger.s.append(v.s);
            v.wipe();
            std::swap(v.s, bigger.s);
        }
        v.s.append(buf, static_cast<size_t>(n));
        if (tty && v.s.find('\n') != std::string::npos) break;  // one line from a terminal
    }
    egress::secure_zero(buf, sizeof buf);
    if (echo_off) {
        ::tcsetattr(STDIN_FILENO, TCSAFLUSH, &saved);
        std::fputs("\n", stderr);
    }
    // Strip one trailing newline (as `echo` or a heredoc leaves), "\r\n" counting as one.
    if (!v.s.empty() && v.s.back() == '\n') {
        v.s.back() = '\0';
        v.s.pop_back();
        if (!v.s.empty() && v.s.back() == '\r') {
            v.s.back() = '\0';
            v.s.pop_back();
        }
    }
    if (v.s.empty()) {
        throw Failure("refusing an empty secret value (pipe the value on standard input)");
    }
    if (!valid_utf8(v.s)) {
        throw Failure("the secret value is not valid UTF-8 text");
    }
    compact_json_document(v);
    return v;
}

// --- commands -------------------------------------------------------------------------------

/// The largest admin token file read (egressd reads at most as much: load_secret_file).
constexpr size_t kMaxTokenFileBytes = 16 * 1024;

struct Ctx {
    Endpoint ep;
    std::optional<std::string> token_file;
    std::chrono::seconds timeout = kDefaultTimeout;

    Client client() const {
        std::string tok;
        if (token_file) {
            int fd = ::open(token_file->c_str(), O_RDONLY | O_CLOEXEC);
            if (fd < 0) {
                throw Failure("--token-file " + *token_file + ": " + std::strerror(errno));
            }
            // Read whole (a pipe gives it in pieces), up to egressd's own bound on a token.
            char buf[4096];
            tok.reserve(kMaxTokenFileBytes + sizeof buf);  // never moved: no copy left behind
            int err = 0;
            for (;;) {
                const ssize_t n = ::read(fd, buf, sizeof buf);
                if (n < 0 && errno == EINTR) {
                    continue;
                }
                if (n <= 0) {
                    err = n < 0 ? errno : 0;
                    break;
                }
                tok.append(buf, static_cast<size_t>(n));
                if (tok.size() > kMaxTokenFileBytes + 2) {  // a line end may follow it
                    break;
                }
            }
            ::close(fd);
            egress::secure_zero(buf, sizeof buf);
            if (err != 0) {
                egress::secure_wipe(tok);
                throw Failure("--token-file " + *token_file + ": " + std::strerror(err));
            }
            while (!tok.empty() && std::isspace(static_cast<unsigned char>(tok.back()))) {
                tok.pop_back();
            }
            if (tok.size() > kMaxTokenFileBytes) {
                egress::secure_wipe(tok);
                throw Failure("--token-file " + *token_file + " holds more than " +
                              std::to_string(kMaxTokenFileBytes) + " bytes");
            }
        } else if (const char* env = std::getenv("EGRESSD_ADMIN_TOKEN")) {
            tok = env;
        } else {
            throw Usage("no admin token: set EGRESSD_ADMIN_TOKEN or pass --token-file FILE");
        }
        while (!tok.empty() && std::isspace(static_cast<unsigned char>(tok.back()))) tok.pop_back();
        if (tok.empty()) {
            throw Failure(token_file ? "--token-file " + *token_file + " is empty"
                                     : std::string("EGRESSD_ADMIN_TOKEN is empty"));
        }
        return Client(ep, std::move(tok), timeout);
    }
};

void print_secret_line(const json::value& v, const char* verb) {
    std::cout << "secret " << str_field(v, "name") << " (" << scope_text(v.at("scope")) << ") "
              << verb << ": version " << str_field(v, "version") << ", created "
              << str_field(v, "created_at") << "\n";
}

int cmd_secret_put(const Ctx& ctx, const std::vector<std::string>& rest, bool rotate_cmd) {
    auto a = parse_args(rest, {"scope"}, {"rotate"});
    want_pos(a, 1, "secret NAME", false);
    const std::string& name = a.pos[0];
    auto scope = parse_scopes(a.all("scope"), true);
    const bool rotate = rotate_cmd || a.flag("rotate");
    auto client = ctx.client();  // token problems before reading the value
    Wiped value = read_secret_value();

    Wiped body;
    body.s.reserve(value.s.size() * 6 + name.size() + 256);
    body.s = "{";
    if (!rotate) {
        body.s += "\"name\":";
        append_json_string(body.s, name);
        body.s += ",";
    }
    body.s += "\"scope\":" + json::serialize(scope) + ",\"value\":";
    append_json_string(body.s, value.s);
    body.s += "}";
    value.wipe();

    Reply r = rotate ? client.call(http::verb::put, target({"v1", "secrets", name}), &body.s)
                     : client.call(http::verb::post, target({"v1", "secrets"}), &body.s);
    body.wipe();
    if (!rotate && r.status == 409) {
        std::string scopes;
        for (const auto& [k, v] : scope) {
            scopes += " --scope " + std::string(k) + "=" + std::string(v.as_string());
        }
        throw Failure(api_error(r) + " (to replace its value: egressctl secret rotate " + name +
                      scopes + ")");
    }
    expect(r, {200, 201});
    print_secret_line(parse_reply(r), rotate ? "rotated" : "stored");
    return 0;
}

int cmd_secret_list(const Ctx& ctx, const std::vector<std::string>& rest) {
    auto a = parse_args(rest, {}, {"json"});
    want_pos(a, 0, "");
    auto r = ctx.client().call(http::verb::get, "/v1/secrets");
    expect(r, {200});
    auto v = parse_reply(r);
    if (a.flag("json")) {
        pretty(std::cout, v);
        std::cout << "\n";
        return 0;
    }
    std::vector<std::array<std::string, 4>> rows{{"NAME", "SCOPE", "VERSION", "CREATED_AT"}};
    if (auto* arr = v.is_object() ? v.get_object().if_contains("secrets") : nullptr;
        arr != nullptr && arr->is_array()) {
        for (const auto& s : arr->get_array()) {
            rows.push_back({str_field(s, "name"),
                            scope_text(s.is_object() && s.get_object().contains("scope")
                                           ? s.at("scope")
                                           : json::value()),
                            str_field(s, "version"), str_field(s, "created_at")});
        }
    }
    std::array<size_t, 4> w{};
    for (const auto& row : rows) {
        for (size_t i = 0; i < 4; ++i) w[i] = std::max(w[i], row[i].size());
    }
    for (const auto& row : rows) {
        std::string line;
        for (size_t i = 0; i < 4; ++i) {
            line += row[i];
            if (i < 3) line += std::string(w[i] - row[i].size() + 2, ' ');
        }
        std::cout << line << "\n";
    }
    return 0;
}

int cmd_secret_rm(const Ctx& ctx, const std::vector<std::string>& rest) {
    auto a = parse_args(rest, {"scope"}, {});
    want_pos(a, 1, "secret NAME");
    auto scopes = a.all("scope");
    std::vector<std::pair<std::string, std::string>> params;
    std::string where = "every scope";
    if (!scopes.empty()) {
        auto s = parse_scopes(scopes, true);
        std::string text;
        for (const char* k : {"org", "project", "user", "workflow"}) {
            if (auto* f = s.if_contains(k)) {
                if (!text.empty()) text += ",";
                text += std::string(k) + "=" + std::string(f->as_string());
            }
        }
        params.emplace_back("scope", text);
        where = "scope " + text;
    }
    auto r = ctx.client().call(http::verb::delete_, target({"v1", "secrets", a.pos[0]}, params));
    expect(r, {200, 204});
    std::cout << "secret " << a.pos[0] << " deleted (" << where << ")\n";
    return 0;
}

/// A public certificate file (the run CA, the CA bundle) egressctl is to write: its temporary
/// is created beside it before the run is made (a folder that cannot be written fails the
/// command with no run behind it), then written and renamed over it once the run exists,
/// never following a name planted beside it (StagedFile). `flag` names the option in errors.
class CaOutput {
public:
    CaOutput(const std::string& path, const char* flag) : flag_(flag) {
        namespace fs = std::filesystem;
        std::error_code ec;
        fs::path abs = fs::absolute(path, ec);
        if (ec) throw Failure(std::string(flag) + " " + path + ": " + ec.message());
        path_ = abs.lexically_normal().string();
        auto f = egress::StagedFile::create_beside(path_, 0644);
        if (!f) throw Failure(std::string(flag) + " " + path_ + ": " + f.error());
        staged_.emplace(std::move(*f));
    }

    /// Writes `pem` under the temporary name; `commit` puts it in place.
    void write(const std::string& pem) {
        auto tmp = staged_->finish(pem);
        if (!tmp) throw Failure(std::string(flag_) + " " + path_ + ": " + tmp.error());
        tmp_ = std::move(*tmp);
    }

    /// Renames the written file over the path; returns the absolute path.
    const std::string& commit() {
        if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
            const int err = errno;
            ::unlink(tmp_.c_str());
            throw Failure(std::string(flag_) + " " + path_ + ": " + std::strerror(err));
        }
        tmp_.clear();
        return path_;
    }

    ~CaOutput() {
        if (!tmp_.empty()) ::unlink(tmp_.c_str());  // written, never committed
    }
    CaOutput(const CaOutput&) = delete;
    CaOutput& operator=(const CaOutput&) = delete;

private:
    const char* flag_;
    std::string path_;
    std::optional<egress::StagedFile> staged_;
    std::string tmp_;
};

/// An output path that exists must be a file egressctl can replace: a regular file or a symlink
/// (rename(2) replaces the link, never follows it). A folder, a FIFO, a device ... is refused
/// before the run is made: found only at the rename, after the run, it left a run to revoke
/// and, for --ca-bundle-out, a --ca-out already replaced by that revoked run's CA.
void check_output_path(const std::string& path, const char* flag) {
    struct stat st {};
    if (::lstat(path.c_str(), &st) != 0) return;  // missing (or unreachable: staging says why)
    if (S_ISREG(st.st_mode) || S_ISLNK(st.st_mode)) return;
    const char* what = S_ISDIR(st.st_mode)    ? "a directory"
                       : S_ISFIFO(st.st_mode) ? "a FIFO"
                       : S_ISSOCK(st.st_mode) ? "a socket"
                                              : "a device";
    throw Usage(std::string(flag) + " " + path + ": is " + what +
                ", not a file (give a file's path)");
}

/// The bundle's default name: beside the run CA file, "-bundle" before its ".pem"
/// (./egress-run-ca.pem -> ./egress-run-ca-bundle.pem).
std::string default_bundle_path(const std::string& ca_out) {
    constexpr std::string_view kPem = ".pem";
    if (ca_out.size() > kPem.size() && ca_out.ends_with(kPem)) {
        return ca_out.substr(0, ca_out.size() - kPem.size()) + "-bundle.pem";
    }
    return ca_out + "-bundle.pem";
}

/// The trust store a CA bundle starts from: `given` (--system-ca-file), else the system's
/// (egress::find_default_root_file). Returns the PEM text, or empty (with a warning) when
/// there is none to read.
std::string system_roots(const std::optional<std::string>& given) {
    std::optional<std::string> path = given ? given : egress::find_default_root_file();
    if (!path) {
        std::cerr << "egressctl: warning: no system trust store found ("
                  << egress::default_root_files()[0]
                  << "); the CA bundle holds the run CA only, so hosts egressd tunnels blind "
                     "fail verification; give --system-ca-file FILE\n";
        return {};
    }
    auto text = egress::read_root_file(*path);
    if (!text) {
        throw Failure("--system-ca-file " + *path + ": " + text.error());
    }
    return std::move(*text);
}

/// The --pin specs of a command, each narrowed by --path, --method and --header.
json::array pins_from(const Args& a) {
    json::array paths;
    for (const auto& p : a.all("path")) {
        if (p.empty() || p[0] != '/') throw Usage("--path '" + p + "': must start with /");
        paths.push_back(json::string(p));
    }
    json::array methods;
    for (const auto& m : a.all("method")) {
        if (m.empty()) throw Usage("--method needs a method");
        methods.push_back(json::string(m));
    }
    json::object headers;
    for (const auto& h : a.all("header")) {
        auto eq = h.find('=');
        if (eq == std::string::npos || eq == 0) {
            throw Usage("--header '" + h.substr(0, h.find('=')) + "': expected NAME=VALUE");
        }
        headers[h.substr(0, eq)] = h.substr(eq + 1);
    }
    json::array pins;
    for (const auto& p : a.all("pin")) {
        json::object pin = parse_pin(p);
        if (!paths.empty()) pin["path_prefixes"] = paths;
        if (!methods.empty()) pin["methods"] = methods;
        if (!headers.empty()) pin["headers"] = headers;
        pins.push_back(std::move(pin));
    }
    if (pins.empty() && (!paths.empty() || !methods.empty() || !headers.empty())) {
        throw Usage("--path, --method and --header narrow a --pin; none given");
    }
    return pins;
}

int cmd_run_pin(const Ctx& ctx, const std::vector<std::string>& rest) {
    auto a = parse_args(rest, {"pin", "path", "method", "header", "ttl"}, {});
    want_pos(a, 1, "run ID");
    json::array pins = pins_from(a);
    if (pins.size() != 1) throw Usage("run pin takes exactly one --pin");
    json::object pin = std::move(pins[0].as_object());
    if (auto ttl = a.one("ttl")) pin["ttl_seconds"] = parse_duration(*ttl);
    std::string body = json::serialize(pin);
    auto r = ctx.client().call(http::verb::post, target({"v1", "runs", a.pos[0], "pins"}), &body);
    expect(r, {200, 201});
    pretty(std::cout, parse_reply(r));
    std::cout << "\n";
    return 0;
}

/// Revokes a run just created that egressctl cannot hand over; says what became of it.
std::string revoke_unusable(Client& client, const json::value& run) {
    const std::string id = str_field(run, "id", "");
    if (id.empty()) return "the answer named no run id";
    std::string why;
    try {
        auto r = client.call(http::verb::delete_, target({"v1", "runs", id}));
        if (r.status == 200 || r.status == 204) return "run " + id + " revoked";
        why = api_error(r);
    } catch (const Failure& f) {
        why = f.what();
    }
    return "run " + id + " was made but could not be revoked (" + why +
           "): egressctl run revoke " + id;
}

int cmd_run_create(const Ctx& ctx, const std::vector<std::string>& rest) {
    auto a = parse_args(rest,
                        {"scope", "pin", "path", "method", "header", "allow", "ttl", "ca-out",
                         "ca-bundle-out", "system-ca-file"},
                        {"env", "json"});
    want_pos(a, 0, "");
    json::object req;
    req["scope"] = parse_scopes(a.all("scope"), true);
    if (auto ttl = a.one("ttl")) req["ttl_seconds"] = parse_duration(*ttl);
    json::array allow;
    for (const auto& h : a.all("allow")) {
        if (h.empty()) throw Usage("--allow needs a host");
        allow.push_back(json::string(h));
    }
    if (!allow.empty()) req["allow_hosts"] = allow;
    req["pins"] = pins_from(a);
    const bool env = a.flag("env");
    auto ca_out = a.one("ca-out");
    auto bundle_out = a.one("ca-bundle-out");
    if (env && !ca_out) ca_out = kDefaultCaOut;
    if (env && !bundle_out) bundle_out = default_bundle_path(*ca_out);
    if (ca_out && bundle_out) {
        const auto same = [](const std::string& x, const std::string& y) {
            return std::filesystem::absolute(x).lexically_normal() ==
                   std::filesystem::absolute(y).lexically_normal();
        };
        if (same(*ca_out, *bundle_out)) {
            // NODE_EXTRA_CA_CERTS would name every system root as the run's CA.
            throw Usage("--ca-bundle-out names the same file as --ca-out: give two files");
        }
    }
    if (a.one("system-ca-file") && !bundle_out) {
        throw Usage("--system-ca-file is what a CA bundle starts from: give --env or "
                    "--ca-bundle-out");
    }
    // Read and staged before the run is made: a trust store that cannot be read, or an
    // output file that cannot be created, fails the command without leaving a run behind.
    std::string roots;
    if (bundle_out) roots = system_roots(a.one("system-ca-file"));
    if (ca_out) check_output_path(*ca_out, "--ca-out");
    if (bundle_out) check_output_path(*bundle_out, "--ca-bundle-out");
    std::optional<CaOutput> ca_file;
    std::optional<CaOutput> bundle_file;
    if (ca_out) ca_file.emplace(*ca_out, "--ca-out");
    if (bundle_out) bundle_file.emplace(*bundle_out, "--ca-bundle-out");

    std::string body = json::serialize(req);
    Client client = ctx.client();
    Reply r;
    try {
        r = client.call(http::verb::post, "/v1/runs", &body);
    } catch (const NoAnswer& f) {
        // egressd may have read the whole request and made the run; its answer, the only
        // place egressctl learns the id, never came.
        throw Failure(std::string(f.what()) +
                      ": the run may have been created; its id is unknown (no answer named "
                      "it: it would be in egressd's state store, and ends at its ttl)");
    }
    expect(r, {200, 201});
    auto v = parse_reply(r);
    if (!v.is_object()) throw Failure("the admin API answered with an unexpected body");
    auto& o = v.get_object();
    std::string proxy_url = str_field(v, "proxy_url", "");
    std::string ca_pem = str_field(v, "ca_pem", "");
    std::string ca_path;
    std::string bundle_path;
    try {
        if (proxy_url.empty() || ca_pem.empty()) {
            throw Failure("the admin API answered without proxy_url or ca_pem");
        }
        // SSL_CERT_FILE, REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE and GIT_SSL_CAINFO replace a
        // client's trust store: they name the bundle (the system roots and the run CA), so
        // hosts egressd carries through a blind tunnel still verify. NODE_EXTRA_CA_CERTS adds
        // to Node's own roots: it names the run CA alone.
        if (ca_file) ca_file->write(ca_pem);
        if (bundle_file) {
            std::string bundle = roots + ca_pem;
            if (bundle.back() != '\n') bundle += '\n';
            bundle_file->write(bundle);
        }
        // The bundle first: if its rename fails the run is revoked, and --ca-out must still
        // hold the CA it held, not the revoked run's.
        if (bundle_file) bundle_path = bundle_file->commit();
        if (ca_file) ca_path = ca_file->commit();
    } catch (const Failure& f) {
        // The run exists, but its id and proxy token were never printed: nobody could use
        // or find it, and it would count toward admin.max_runs until it expired.
        throw Failure(std::string(f.what()) + "; " + revoke_unusable(client, v));
    }

    if (env) {
        std::string q = shell_quote(proxy_url);
        std::string ca = shell_quote(ca_path);
        std::string bundle = shell_quote(bundle_path);
        std::string no_proxy = shell_quote("localhost,127.0.0.1,::1");
        std::cout << "# egressd run " << str_field(v, "id") << ", expires "
                  << str_field(v, "expires_at") << "\n";
        for (const char* k : {"HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"}) {
            std::cout << "export " << k << "=" << q << "\n";
        }
        for (const char* k : {"NO_PROXY", "no_proxy"}) {
            std::cout << "export " << k << "=" << no_proxy << "\n";
        }
        for (const char* k :
             {"SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "GIT_SSL_CAINFO", "CURL_CA_BUNDLE"}) {
            std::cout << "export " << k << "=" << bundle << "\n";
        }
        std::cout << "export NODE_EXTRA_CA_CERTS=" << ca << "\n";
        return 0;
    }
    json::object out;
    for (const char* k : {"id", "proxy_url", "expires_at", "scope", "pins"}) {
        if (auto* f = o.if_contains(k)) out[k] = *f;
    }
    if (ca_out) {
        out["ca_file"] = ca_path;
    } else {
        out["ca_pem"] = ca_pem;
    }
    if (bundle_out) out["ca_bundle_file"] = bundle_path;
    pretty(std::cout, out);
    std::cout << "\n";
    return 0;
}

int cmd_run_show(const Ctx& ctx, const std::vector<std::string>& rest) {
    auto a = parse_args(rest, {}, {});
    want_pos(a, 1, "run ID");
    auto r = ctx.client().call(http::verb::get, target({"v1", "runs", a.pos[0]}));
    expect(r, {200});
    pretty(std::cout, parse_reply(r));
    std::cout << "\n";
    return 0;
}

int cmd_run_revoke(const Ctx& ctx, const std::vector<std::string>& rest) {
    auto a = parse_args(rest, {}, {});
    want_pos(a, 1, "run ID");
    auto r = ctx.client().call(http::verb::delete_, target({"v1", "runs", a.pos[0]}));
    expect(r, {200, 204});
    std::cout << "run " << a.pos[0] << " revoked\n";
    return 0;
}

int cmd_run_explain(const Ctx& ctx, const std::vector<std::string>& rest) {
    auto a = parse_args(rest, {"method"}, {"json"});
    want_pos(a, 2, "run ID and URL");
    std::vector<std::pair<std::string, std::string>> params{{"url", a.pos[1]}};
    if (auto m = a.one("method")) params.emplace_back("method", *m);
    auto r = ctx.client().call(http::verb::get,
                               target({"v1", "runs", a.pos[0], "explain"}, params));
    expect(r, {200});
    auto v = parse_reply(r);
    if (a.flag("json") || !v.is_object()) {
        pretty(std::cout, v);
        std::cout << "\n";
        return 0;
    }
    const auto& o = v.get_object();
    std::cout << "run:      " << str_field(v, "run") << "\n"
              << "request:  " << str_field(v, "method") << " " << str_field(v, "url") << "\n"
              << "decision: " << str_field(v, "decision") << " (" << str_field(v, "reason")
              << ")\n";
    if (auto* p = o.if_contains("pin"); p != nullptr && p->is_object()) {
        std::cout << "pin:      " << str_field(*p, "id") << " (host " << str_field(*p, "host")
                  << ")\n";
    } else {
        std::cout << "pin:      none\n";
    }
    if (auto* s = o.if_contains("secret"); s != nullptr && s->is_object()) {
        std::cout << "secret:   " << str_field(*s, "name");
        const auto& so = s->get_object();
        if (so.contains("scope")) std::cout << " in " << scope_text(so.at("scope"));
        if (so.contains("version")) std::cout << ", version " << str_field(*s, "version");
        if (so.contains("source")) {
            std::cout << " (" << str_field(*s, "source");
            if (so.contains("file")) std::cout << " " << str_field(*s, "file");
            std::cout << ")";
        }
        std::cout << "\n";
    } else {
        std::cout << "secret:   none\n";
    }
    if (auto* ch = o.if_contains("chain"); ch != nullptr && ch->is_array() &&
                                           !ch->get_array().empty()) {
        std::cout << "scope chain (most specific wins):\n";
        for (const auto& c : ch->get_array()) {
            bool chosen = c.is_object() && c.get_object().contains("chosen") &&
                          c.at("chosen").is_bool() && c.at("chosen").get_bool();
            bool matches = c.is_object() && c.get_object().contains("matches") &&
                           c.at("matches").is_bool() && c.at("matches").get_bool();
            std::cout << "  " << (chosen ? "* " : "  ")
                      << scope_text(c.is_object() && c.get_object().contains("scope")
                                        ? c.at("scope")
                                        : json::value())
                      << "  version " << str_field(c, "version")
                      << (chosen ? "  (chosen)" : matches ? "  (matches)" : "  (does not match)")
                      << "\n";
        }
    }
    return 0;
}

int cmd_keys_rotate(const Ctx& ctx, const std::vector<std::string>& rest) {
    auto a = parse_args(rest, {}, {});
    want_pos(a, 0, "");
    auto r = ctx.client().call(http::verb::post, "/v1/keys/rotate");
    expect(r, {200});
    auto v = parse_reply(r);
    std::cout << "master key rotated: now " << str_field(v, "kek_id") << ", "
              << str_field(v, "rewrapped") << " data keys rewrapped\n";
    // Records no loaded key unwraps are left under their old key: name each one.
    const json::value* skipped = v.is_object() ? v.get_object().if_contains("skipped") : nullptr;
    if (skipped != nullptr && skipped->is_array() && !skipped->get_array().empty()) {
        std::cout << skipped->get_array().size()
                  << " skipped (no loaded key unwraps them; left as they were, not served):\n";
        for (const auto& e : skipped->get_array()) {
            std::cout << "  " << str_field(e, "kind") << " " << str_field(e, "name");
            if (e.is_object() && e.get_object().contains("scope")) {
                std::cout << " (" << scope_text(e.at("scope")) << ")";
            }
            std::cout << ": " << str_field(e, "reason") << "\n";
        }
        // Not a clean rotation: a script that goes on to retire the old key must stop here.
        std::cerr << "egressctl: keys rotate: " << skipped->get_array().size()
                  << " record(s) not rewrapped (listed above)\n";
        return 1;
    }
    return 0;
}

int dispatch(const std::vector<std::string>& argv) {
    // Global options come before the command words (and may also follow them).
    Ctx ctx;
    std::optional<std::string> admin;
    std::optional<std::string> timeout;
    std::vector<std::string> words;
    for (size_t i = 0; i < argv.size(); ++i) {
        const std::string& arg = argv[i];
        auto take = [&](const char* name, std::optional<std::string>& dst) -> bool {
            std::string flag = std::string("--") + name;
            if (arg == flag) {
                if (i + 1 >= argv.size()) throw Usage(flag + " needs a value");
                if (dst) throw Usage(flag + " given more than once");
                dst = argv[++i];
                return true;
            }
            if (arg.rfind(flag + "=", 0) == 0) {
                if (dst) throw Usage(flag + " given more than once");
                dst = arg.substr(flag.size() + 1);
                return true;
            }
            return false;
        };
        if (take("admin", admin) || take("token-file", ctx.token_file) ||
            take("timeout", timeout)) {
            continue;
        }
        // Before the command: -h and --help are options. After it, each command's own
        // parse_args reads them where an option may stand.
        if (words.empty() && (arg == "-h" || arg == "--help")) throw Help{};
        words.push_back(arg);
    }
    // `help` is the command, or the subcommand (`egressctl secret help`).
    if (!words.empty() && (is_help(words[0]) || (words.size() > 1 && is_help(words[1])))) {
        throw Help{};
    }
    ctx.ep = parse_admin(admin.value_or(kDefaultAdmin));
    if (timeout) {
        const int64_t t = parse_duration(*timeout, "--timeout");
        if (t > 86400) throw Usage("--timeout '" + *timeout + "': at most 1d");
        ctx.timeout = std::chrono::seconds(t);
    }
    if (words.empty()) throw Usage("missing command");
    auto rest_from = [&](size_t n) {
        return std::vector<std::string>(words.begin() + static_cast<long>(n), words.end());
    };
    const std::string& group = words[0];
    const std::string sub = words.size() > 1 ? words[1] : "";
    if (group == "secret") {
        if (sub == "put") return cmd_secret_put(ctx, rest_from(2), false);
        if (sub == "rotate") return cmd_secret_put(ctx, rest_from(2), true);
        if (sub == "list" || sub == "ls") return cmd_secret_list(ctx, rest_from(2));
        if (sub == "rm" || sub == "delete") return cmd_secret_rm(ctx, rest_from(2));
        throw Usage(sub.empty() ? "secret: missing subcommand (put, rotate, list, rm)"
                                : "secret: unknown subcommand '" + sub + "'");
    }
    if (group == "run") {
        if (sub == "create") return cmd_run_create(ctx, rest_from(2));
        if (sub == "pin") return cmd_run_pin(ctx, rest_from(2));
        if (sub == "show") return cmd_run_show(ctx, rest_from(2));
        if (sub == "revoke") return cmd_run_revoke(ctx, rest_from(2));
        if (sub == "explain") return cmd_run_explain(ctx, rest_from(2));
        throw Usage(sub.empty() ? "run: missing subcommand (create, pin, show, revoke, explain)"
                                : "run: unknown subcommand '" + sub + "'");
    }
    if (group == "keys") {
        if (sub == "rotate") return cmd_keys_rotate(ctx, rest_from(2));
        throw Usage(sub.empty() ? "keys: missing subcommand (rotate)"
                                : "keys: unknown subcommand '" + sub + "'");
    }
    throw Usage("unknown command '" + group + "'");
}

}  // namespace

int main(int argc, char** argv) {
    // Secret values pass through this process: keep them out of core dumps.
    ::prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    std::vector<std::string> args(argv + 1, argv + argc);
    try {
        return dispatch(args);
    } catch (const Help&) {
        std::cout << kUsage;
        return 0;
    } catch (const Usage& u) {
        std::cerr << "egressctl: " << u.what() << " (egressctl --help for usage)\n";
        return 2;
    } catch (const Failure& f) {
        std::cerr << "egressctl: " << f.what() << "\n";
        return 1;
    } catch (const std::exception& ex) {
        std::cerr << "egressctl: " << ex.what() << "\n";
        return 1;
    }
}
